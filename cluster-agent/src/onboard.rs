//! Trading the one-time onboarding token for the cluster's credential: `POST {relay}/agent/v1/onboard`.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::{Request, StatusCode, header};
use http_body_util::{BodyExt, Full, Limited};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use serde::{Deserialize, Serialize};
use tether_tunnel::Secret;

/// Largest onboarding response body read.
const MAX_RESPONSE: usize = 64 * 1024;

/// Why onboarding failed.
#[derive(Debug, thiserror::Error)]
pub(crate) enum OnboardError {
    /// The relay refused the token (invalid, already used, or cluster unknown): retrying cannot help.
    #[error("the relay refused the onboarding token (HTTP {status}): {message}")]
    Refused {
        /// HTTP status.
        status: StatusCode,
        /// The relay's message.
        message: String,
    },
    /// The relay could not be reached or answered badly; a later attempt may work.
    #[error("onboarding at {url} failed: {reason}")]
    Transient {
        /// The onboarding URL.
        url: String,
        /// What went wrong.
        reason: String,
    },
}

#[derive(Serialize)]
struct OnboardRequest<'a> {
    cluster: &'a str,
    token: &'a str,
}

#[derive(Deserialize)]
struct OnboardResponse {
    cluster: String,
    credential: String,
}

/// Posts the onboarding token and returns the credential the relay issued.
pub(crate) async fn onboard(
    url: &str,
    tls: &Arc<rustls::ClientConfig>,
    cluster: &str,
    token: &Secret,
    timeout: Duration,
) -> Result<Secret, OnboardError> {
    let transient = |reason: String| OnboardError::Transient {
        url: url.to_string(),
        reason,
    };
    let mut http = HttpConnector::new();
    http.enforce_http(false);
    http.set_connect_timeout(Some(timeout));
    let mut tls_config = (**tls).clone();
    // hyper-rustls sets ALPN itself.
    tls_config.alpn_protocols.clear();
    let https = hyper_rustls::HttpsConnectorBuilder::new()
        .with_tls_config(tls_config)
        .https_only()
        .enable_http1()
        .wrap_connector(http);
    let client: Client<_, Full<Bytes>> = Client::builder(TokioExecutor::new())
        .pool_max_idle_per_host(0)
        .build(https);

    let body = serde_json::to_vec(&OnboardRequest {
        cluster,
        token: token.expose(),
    })
    .map_err(|e| transient(e.to_string()))?;
    let request = Request::post(url)
        .header(header::CONTENT_TYPE, "application/json")
        .header(header::ACCEPT, "application/json")
        .body(Full::new(Bytes::from(body)))
        .map_err(|e| transient(e.to_string()))?;

    let exchange = async {
        let response = client
            .request(request)
            .await
            .map_err(|e| transient(crate::error_chain(&e)))?;
        let status = response.status();
        let body = Limited::new(response.into_body(), MAX_RESPONSE)
            .collect()
            .await
            .map_err(|e| transient(format!("reading the response: {e}")))?
            .to_bytes();
        Ok::<_, OnboardError>((status, body))
    };
    let (status, body) = tokio::time::timeout(timeout, exchange)
        .await
        .map_err(|_| transient(format!("no answer within {timeout:?}")))??;

    if status == StatusCode::OK {
        let parsed: OnboardResponse = serde_json::from_slice(&body)
            .map_err(|e| transient(format!("unexpected response body: {e}")))?;
        if parsed.cluster != cluster {
            return Err(transient(format!(
                "the relay answered for cluster {:?}",
                parsed.cluster
            )));
        }
        if parsed.credential.is_empty() {
            return Err(transient("the relay returned an empty credential".into()));
        }
        return Ok(Secret::new(parsed.credential));
    }
    let message = status_message(&body);
    // 408 and 429 are worth retrying like server errors; every other client error is final.
    if status.is_client_error()
        && status != StatusCode::REQUEST_TIMEOUT
        && status != StatusCode::TOO_MANY_REQUESTS
    {
        return Err(OnboardError::Refused { status, message });
    }
    Err(transient(format!("HTTP {status}: {message}")))
}

/// The `message` of a Kubernetes `Status` body, else the body text (trimmed).
fn status_message(body: &[u8]) -> String {
    if let Ok(value) = serde_json::from_slice::<serde_json::Value>(body)
        && let Some(message) = value.get("message").and_then(|m| m.as_str())
    {
        return message.to_string();
    }
    let text = String::from_utf8_lossy(body);
    text.trim().chars().take(300).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn status_message_prefers_the_status_json() {
        assert_eq!(
            status_message(br#"{"kind":"Status","message":"token already used"}"#),
            "token already used"
        );
        assert_eq!(status_message(b"  plain text \n"), "plain text");
    }
}
