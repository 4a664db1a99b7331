//! Request errors, and the one place where they — and the domain errors they wrap — become HTTP responses
//! (Kubernetes `Status` JSON).

use std::time::Duration;

use http::{HeaderValue, Response, StatusCode, header};
use serde_json::json;

use crate::body::{self, Body};
use crate::identity::IssueError;
use crate::rbac::RbacError;
use crate::store::StoreError;

/// Where a request error came from; it picks the log level and tells the user who to look at.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Origin {
    /// The request itself is wrong (auth, unknown name, bad body).
    Client,
    /// The cluster side: no tunnel, the agent refused or did not answer, the tunnel broke.
    Tunnel,
    /// The relay itself (store, bug).
    Internal,
}

impl Origin {
    fn as_str(self) -> &'static str {
        match self {
            Origin::Client => "client",
            Origin::Tunnel => "tunnel",
            Origin::Internal => "internal",
        }
    }
}

/// A request that failed, with everything needed to answer it: status, Kubernetes reason, message, origin
/// and whether retrying can help.
#[derive(Debug, Clone)]
pub(crate) struct ApiError {
    pub(crate) status: StatusCode,
    pub(crate) reason: &'static str,
    pub(crate) message: String,
    pub(crate) origin: Origin,
    pub(crate) retryable: bool,
    /// The tunnel the request went on is going away (the agent retiring or moving it, the tunnel closing)
    /// before the cluster answered: another tunnel of the cluster can take a safe request again.
    pub(crate) tunnel_gone: bool,
    /// Sent as `Retry-After` (and `details.retryAfterSeconds`); clients such as client-go retry on it.
    pub(crate) retry_after: Option<Duration>,
}

impl ApiError {
    fn new(
        status: StatusCode,
        reason: &'static str,
        message: impl Into<String>,
        origin: Origin,
    ) -> Self {
        Self {
            status,
            reason,
            message: message.into(),
            origin,
            retryable: false,
            tunnel_gone: false,
            retry_after: None,
        }
    }

    fn retryable(mut self) -> Self {
        self.retryable = true;
        self
    }

    pub(crate) fn retry_after(mut self, after: Duration) -> Self {
        self.retryable = true;
        self.retry_after = Some(after);
        self
    }

    pub(crate) fn unauthorized(message: impl Into<String>) -> Self {
        Self::new(
            StatusCode::UNAUTHORIZED,
            "Unauthorized",
            message,
            Origin::Client,
        )
    }

    /// A cluster identity (client certificate) that expired: refused with reason `IdentityExpired`.
    pub(crate) fn identity_expired(cluster: &str, not_after: time::OffsetDateTime) -> Self {
        let at = not_after
            .format(&time::format_description::well_known::Rfc3339)
            .unwrap_or_else(|_| not_after.unix_timestamp().to_string());
        Self::new(
            StatusCode::UNAUTHORIZED,
            "IdentityExpired",
            format!(
                "the identity of cluster {cluster} expired at {at}: delete the cluster and connect it again"
            ),
            Origin::Client,
        )
    }

    pub(crate) fn bad_request(message: impl Into<String>) -> Self {
        Self::new(
            StatusCode::BAD_REQUEST,
            "BadRequest",
            message,
            Origin::Client,
        )
    }

    pub(crate) fn invalid(message: impl Into<String>) -> Self {
        Self::new(StatusCode::BAD_REQUEST, "Invalid", message, Origin::Client)
    }

    pub(crate) fn not_found(message: impl Into<String>) -> Self {
        Self::new(StatusCode::NOT_FOUND, "NotFound", message, Origin::Client)
    }

    pub(crate) fn cluster_not_found(name: &str) -> Self {
        Self::not_found(format!("clusters \"{name}\" not found"))
    }

    pub(crate) fn already_exists(message: impl Into<String>) -> Self {
        Self::new(
            StatusCode::CONFLICT,
            "AlreadyExists",
            message,
            Origin::Client,
        )
    }

    pub(crate) fn conflict(message: impl Into<String>) -> Self {
        Self::new(StatusCode::CONFLICT, "Conflict", message, Origin::Client)
    }

    pub(crate) fn method_not_allowed() -> Self {
        Self::new(
            StatusCode::METHOD_NOT_ALLOWED,
            "MethodNotAllowed",
            "method not allowed on this path",
            Origin::Client,
        )
    }

    /// 429 for one client over one of its own bounds ([`crate::quota`]); `Retry-After` says when to come back.
    pub(crate) fn client_over_bound(what: &str, cluster: &str, after: Duration) -> Self {
        Self::new(
            StatusCode::TOO_MANY_REQUESTS,
            "TooManyRequests",
            format!("too many requests: over the relay's bound on {what} (cluster {cluster})"),
            Origin::Client,
        )
        .retry_after(after)
    }

    /// 429 for a tunnel over `--max-tunnels-per-cluster`: the cluster's established tunnels are kept.
    pub(crate) fn too_many_tunnels(cluster: &str, max: usize) -> Self {
        Self::new(
            StatusCode::TOO_MANY_REQUESTS,
            "TooManyRequests",
            format!(
                "cluster {cluster} already holds {max} tunnels at this relay replica (--max-tunnels-per-cluster): \
                 the established tunnels are kept and this one is refused"
            ),
            Origin::Client,
        )
        .retry_after(Duration::from_secs(30))
    }

    pub(crate) fn too_large(limit: usize) -> Self {
        Self::new(
            StatusCode::PAYLOAD_TOO_LARGE,
            "RequestEntityTooLarge",
            format!("request body is larger than {limit} bytes"),
            Origin::Client,
        )
    }

    pub(crate) fn not_connected(name: &str) -> Self {
        Self::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "ServiceUnavailable",
            format!("cluster {name} is not connected to the relay"),
            Origin::Tunnel,
        )
        .retryable()
    }

    pub(crate) fn shutting_down() -> Self {
        Self::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "ServiceUnavailable",
            "the relay is shutting down",
            Origin::Internal,
        )
        .retry_after(Duration::from_secs(1))
    }

    pub(crate) fn tunnel(
        status: StatusCode,
        reason: &'static str,
        message: impl Into<String>,
    ) -> Self {
        Self::new(status, reason, message, Origin::Tunnel)
    }

    pub(crate) fn internal(message: impl Into<String>) -> Self {
        Self::new(
            StatusCode::INTERNAL_SERVER_ERROR,
            "InternalError",
            message,
            Origin::Internal,
        )
    }

    /// Whether the failure is the tunnel's doing and retrying may help.
    pub(crate) fn mark_retryable(self) -> Self {
        self.retryable()
    }

    /// Marks the error as the tunnel going away under the request ([`ApiError::tunnel_gone`]).
    pub(crate) fn mark_tunnel_gone(mut self) -> Self {
        self.tunnel_gone = true;
        self
    }

    /// The Kubernetes `Status` object for this error (the body of [`ApiError::into_response`]; for QUIC
    /// tunnels, the reason of the refusal).
    pub(crate) fn status_json(&self) -> serde_json::Value {
        let mut details = serde_json::Map::new();
        if let Some(after) = self.retry_after {
            details.insert("retryAfterSeconds".into(), json!(after.as_secs().max(1)));
        }
        let mut status = json!({
            "kind": "Status",
            "apiVersion": "v1",
            "metadata": {},
            "status": "Failure",
            "message": self.message,
            "reason": self.reason,
            "code": self.status.as_u16(),
        });
        if !details.is_empty()
            && let Some(obj) = status.as_object_mut()
        {
            obj.insert("details".into(), serde_json::Value::Object(details));
        }
        status
    }

    /// The one mapping from an error to what the client sees: a Kubernetes `Status` object.
    pub(crate) fn into_response(self) -> Response<Body> {
        match self.origin {
            Origin::Client => {
                tracing::debug!(status = %self.status, error = %self.message, "request refused")
            }
            Origin::Tunnel => {
                tracing::info!(status = %self.status, error = %self.message, "request failed on the tunnel side")
            }
            Origin::Internal => {
                tracing::warn!(status = %self.status, error = %self.message, "request failed inside the relay")
            }
        }
        let status = self.status_json();
        let mut resp = Response::new(body::full(status.to_string()));
        *resp.status_mut() = self.status;
        let h = resp.headers_mut();
        h.insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/json"),
        );
        h.insert(
            "tether-error-origin",
            HeaderValue::from_static(self.origin.as_str()),
        );
        h.insert(
            "tether-error-retryable",
            HeaderValue::from_static(if self.retryable { "true" } else { "false" }),
        );
        // client-go ignores the Status body of a failed discovery request (kubectl then prints only "the server
        // could not find the requested resource"), but it prints every `Warning: 299` header. This puts the
        // relay's own words in front of the kubectl user, whatever request failed.
        if let Ok(warning) = HeaderValue::from_str(&warning_header(&self.message)) {
            h.insert(header::WARNING, warning);
        }
        if self.status == StatusCode::UNAUTHORIZED {
            h.insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
        }
        if let Some(after) = self.retry_after {
            h.insert(
                header::RETRY_AFTER,
                HeaderValue::from(after.as_secs().max(1)),
            );
        }
        resp
    }
}

/// An RFC 7234 warning (`299 tether-relay "text"`) carrying `message`, as kube-apiserver sends warnings.
fn warning_header(message: &str) -> String {
    let text: String = message
        .chars()
        .map(|c| {
            if c.is_ascii_graphic() || c == ' ' {
                c
            } else {
                '?'
            }
        })
        .collect::<String>()
        .replace('\\', "\\\\")
        .replace('"', "\\\"");
    format!("299 tether-relay \"tether relay: {text}\"")
}

impl From<StoreError> for ApiError {
    fn from(e: StoreError) -> Self {
        match e {
            StoreError::AlreadyExists(name) => {
                ApiError::already_exists(format!("clusters \"{name}\" already exists"))
            }
            StoreError::Conflict(message) => ApiError::conflict(message),
            StoreError::NotFound(message) => ApiError::not_found(message),
            other => ApiError::internal(format!("store error: {other}")).mark_retryable(),
        }
    }
}

impl From<RbacError> for ApiError {
    fn from(e: RbacError) -> Self {
        match e {
            RbacError::Invalid(message) => ApiError::invalid(message),
            RbacError::Conflict(message) => ApiError::conflict(message),
            RbacError::NotFound(message) => ApiError::not_found(message),
            RbacError::ClusterNotFound(name) => ApiError::cluster_not_found(&name),
            RbacError::Store(e) => e.into(),
            RbacError::Encode(_) => ApiError::internal(e.to_string()),
        }
    }
}

impl From<IssueError> for ApiError {
    fn from(e: IssueError) -> Self {
        match e {
            IssueError::InvalidCsr(_) => ApiError::bad_request(e.to_string()),
            IssueError::Sign(_) => ApiError::internal(e.to_string()),
        }
    }
}

#[cfg(test)]
mod tests {
    use http_body_util::BodyExt;

    use super::*;

    async fn body_json(resp: Response<Body>) -> serde_json::Value {
        let bytes = resp
            .into_body()
            .collect()
            .await
            .map(|c| c.to_bytes())
            .unwrap_or_default();
        serde_json::from_slice(&bytes).unwrap_or_default()
    }

    #[tokio::test]
    async fn status_json_shape() {
        let resp = ApiError::cluster_not_found("prod").into_response();
        assert_eq!(resp.status(), StatusCode::NOT_FOUND);
        assert_eq!(resp.headers()["tether-error-origin"], "client");
        let v = body_json(resp).await;
        assert_eq!(v["kind"], "Status");
        assert_eq!(v["apiVersion"], "v1");
        assert_eq!(v["status"], "Failure");
        assert_eq!(v["reason"], "NotFound");
        assert_eq!(v["code"], 404);
        assert_eq!(v["message"], "clusters \"prod\" not found");
        assert!(v["metadata"].is_object());
    }

    #[tokio::test]
    async fn retry_after_is_sent() {
        let resp = ApiError::shutting_down().into_response();
        assert_eq!(resp.status(), StatusCode::SERVICE_UNAVAILABLE);
        assert_eq!(resp.headers()[header::RETRY_AFTER], "1");
        assert_eq!(resp.headers()["tether-error-retryable"], "true");
        let v = body_json(resp).await;
        assert_eq!(v["details"]["retryAfterSeconds"], 1);
    }

    #[tokio::test]
    async fn not_connected_is_retryable_but_not_delayed() {
        let resp = ApiError::not_connected("prod").into_response();
        assert_eq!(resp.headers()["tether-error-origin"], "tunnel");
        assert_eq!(resp.headers()["tether-error-retryable"], "true");
        assert!(resp.headers().get(header::RETRY_AFTER).is_none());
    }

    #[test]
    fn every_error_carries_a_warning_kubectl_prints() {
        let resp = ApiError::cluster_not_found("x").into_response();
        let warning = resp.headers()[header::WARNING]
            .to_str()
            .unwrap_or_default()
            .to_string();
        assert_eq!(
            warning,
            r#"299 tether-relay "tether relay: clusters \"x\" not found""#
        );
        assert_eq!(
            warning_header("a\\b\u{e9}"),
            r#"299 tether-relay "tether relay: a\\b?""#
        );
    }
}
