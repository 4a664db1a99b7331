//! Trading the one-time onboarding token and a CSR for the cluster's certificate:
//! `POST {relay}/agent/v1/onboard` with `{"cluster", "token", "csr"}` → `{"cluster", "certificate", "notAfter"}`.
//!
//! The request goes through the same dial step as the tunnel ([`tether_tunnel::proxy::dial`]: directly or
//! through the HTTP CONNECT proxy), then TLS with the relay, then one HTTP/1.1 exchange.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::{Request, StatusCode, header};
use http_body_util::{BodyExt, Full, Limited};
use hyper_util::rt::TokioIo;
use serde::{Deserialize, Serialize};
use tether_runtime::Secret;
use tether_tunnel::proxy::{self, ProxyConfig};

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
    csr: &'a str,
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct OnboardResponse {
    cluster: String,
    certificate: String,
    #[serde(default)]
    not_after: Option<String>,
}

/// What the relay issued: the certificate (PEM) for the CSR's key.
#[derive(Debug)]
pub(crate) struct Issued {
    pub(crate) certificate: String,
}

/// One onboarding attempt.
pub(crate) struct Onboarding<'a> {
    pub(crate) url: &'a str,
    pub(crate) tls: &'a Arc<rustls::ClientConfig>,
    pub(crate) proxy: Option<&'a ProxyConfig>,
    pub(crate) cluster: &'a str,
    pub(crate) token: &'a Secret,
    pub(crate) csr: &'a str,
    pub(crate) timeout: Duration,
}

impl Onboarding<'_> {
    /// Posts the token and CSR and returns the certificate the relay issued.
    pub(crate) async fn run(&self) -> Result<Issued, OnboardError> {
        let transient = |reason: String| OnboardError::Transient {
            url: self.url.to_string(),
            reason,
        };
        let body = serde_json::to_vec(&OnboardRequest {
            cluster: self.cluster,
            token: self.token.expose(),
            csr: self.csr,
        })
        .map_err(|e| transient(e.to_string()))?;
        let (status, body) = tokio::time::timeout(self.timeout, self.exchange(Bytes::from(body)))
            .await
            .map_err(|_| transient(format!("no answer within {:?}", self.timeout)))?
            .map_err(transient)?;

        if status == StatusCode::OK {
            let parsed: OnboardResponse = serde_json::from_slice(&body)
                .map_err(|e| transient(format!("unexpected response body: {e}")))?;
            if parsed.cluster != self.cluster {
                return Err(transient(format!(
                    "the relay answered for cluster {:?}",
                    parsed.cluster
                )));
            }
            if parsed.certificate.is_empty() {
                return Err(transient("the relay returned no certificate".into()));
            }
            tracing::debug!(not_after = ?parsed.not_after, "certificate issued");
            return Ok(Issued {
                certificate: parsed.certificate,
            });
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

    /// Dial (maybe through the proxy), TLS, one POST; the status and the (bounded) body.
    async fn exchange(&self, body: Bytes) -> Result<(StatusCode, Bytes), String> {
        let url = url::Url::parse(self.url).map_err(|e| e.to_string())?;
        let host = match url.host() {
            Some(url::Host::Domain(d)) => d.to_owned(),
            Some(url::Host::Ipv4(ip)) => ip.to_string(),
            Some(url::Host::Ipv6(ip)) => ip.to_string(),
            None => return Err("no host in the relay URL".to_owned()),
        };
        let port = url.port_or_known_default().unwrap_or(443);
        let tcp = proxy::dial(&host, port, self.proxy, self.timeout)
            .await
            .map_err(|e| crate::error_chain(&e))?;
        let server_name = rustls::pki_types::ServerName::try_from(host.clone())
            .map_err(|e| format!("{host}: not a valid TLS server name: {e}"))?;
        let mut tls = (**self.tls).clone();
        tls.alpn_protocols = vec![b"http/1.1".to_vec()];
        let tls = tokio_rustls::TlsConnector::from(Arc::new(tls))
            .connect(server_name, tcp)
            .await
            .map_err(|e| format!("TLS handshake with the relay failed: {e}"))?;
        let (mut sender, connection) = hyper::client::conn::http1::handshake(TokioIo::new(tls))
            .await
            .map_err(|e| crate::error_chain(&e))?;
        let connection = tokio::spawn(connection);

        let authority = url[url::Position::BeforeHost..url::Position::AfterPort].to_owned();
        let path = &url[url::Position::BeforePath..];
        let request = Request::post(path)
            .header(header::HOST, authority)
            .header(header::CONTENT_TYPE, "application/json")
            .header(header::ACCEPT, "application/json")
            .header(
                header::USER_AGENT,
                concat!("tether-agent/", env!("CARGO_PKG_VERSION")),
            )
            .body(Full::new(body))
            .map_err(|e| e.to_string())?;
        let result = async {
            let response = sender
                .send_request(request)
                .await
                .map_err(|e| crate::error_chain(&e))?;
            let status = response.status();
            let body = Limited::new(response.into_body(), MAX_RESPONSE)
                .collect()
                .await
                .map_err(|e| format!("reading the response: {e}"))?
                .to_bytes();
            Ok((status, body))
        }
        .await;
        connection.abort();
        result
    }
}

/// The `message` of a Kubernetes `Status` body, else the body text (trimmed).
pub(crate) fn status_message(body: &[u8]) -> String {
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
