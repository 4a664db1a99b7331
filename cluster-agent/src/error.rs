//! Why the agent stops: [`AgentError`], every variant fatal.

use http::StatusCode;
use tether_runtime::tls;

use crate::auth_proxy::AuthProxyError;
use crate::config::ConfigError;
use crate::forward::UpstreamError;
use crate::identity::IdentityError;
use crate::state_secret::StateSecretError;

/// The Kubernetes `Status` reason with which the relay refuses an expired identity.
pub const IDENTITY_EXPIRED_REASON: &str = "IdentityExpired";

/// Why the agent stopped. Every variant is fatal: retrying with the same configuration cannot help.
#[derive(Debug, thiserror::Error)]
pub enum AgentError {
    /// The configuration is not usable.
    #[error("invalid configuration: {0}")]
    Config(#[from] ConfigError),
    /// The kubeconfig (or in-cluster configuration) could not be loaded.
    #[error("cannot load the Kubernetes configuration: {0}")]
    KubeConfig(#[source] Box<dyn std::error::Error + Send + Sync>),
    /// The apiserver client could not be built.
    #[error("cannot set up the apiserver client: {0}")]
    Upstream(#[from] UpstreamError),
    /// The agent's own Kubernetes client could not be built.
    #[error("cannot build the agent's Kubernetes client: {0}")]
    KubeClient(#[source] kube::Error),
    /// The relay CA, the proxy CA or the identity could not be made into a TLS configuration.
    #[error("cannot set up TLS to the relay: {0}")]
    RelayTls(#[from] tls::TlsError),
    /// The identity files could not be read or written, or a key could not be generated.
    #[error(transparent)]
    Identity(#[from] IdentityError),
    /// The relay refused the onboarding token.
    #[error(
        "the relay refused the onboarding token (HTTP {status}): {message}; get a new one with `tether cluster connect`"
    )]
    OnboardingRefused {
        /// HTTP status.
        status: StatusCode,
        /// The relay's message.
        message: String,
    },
    /// The relay rejected the cluster's identity: the cluster was deleted (its identity revoked), or the
    /// certificate is not this cluster's.
    #[error(
        "the relay rejected this cluster's identity (HTTP {status}): it was deleted or revoked; register it again"
    )]
    CredentialRejected {
        /// HTTP status (401 or 403).
        status: StatusCode,
    },
    /// The authentication proxy could not be set up (Entra settings, authority CA).
    #[error("cannot set up the authentication proxy: {0}")]
    AuthProxy(#[from] AuthProxyError),
    /// The guard CA could not be read or used.
    #[error("cannot set up TLS to guard: {0}")]
    GuardTls(#[source] tls::TlsError),
    /// The state Secret (`--state-secret`) holds no usable identity or could not be written.
    #[error(transparent)]
    StateSecret(#[from] StateSecretError),
    /// The thread that follows the cluster's nodes could not be started.
    #[error("cannot start the metadata thread: {0}")]
    MetadataThread(#[source] std::io::Error),
    /// The probe port (`--health-listen`) could not be bound.
    #[error("cannot listen for probes on {addr}: {source}")]
    HealthListen {
        /// The address.
        addr: std::net::SocketAddr,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
    /// The cluster's certificate expired (the agent could not renew it in time, e.g. it was offline).
    #[error(
        "this cluster's identity expired: delete it at the relay and connect it again ({message})"
    )]
    IdentityExpired {
        /// The relay's message.
        message: String,
    },
}

/// The relay's message when a 401 says the identity expired (a `Status` with reason `IdentityExpired`).
pub(crate) fn expired_reason(status: StatusCode, body: &str) -> Option<String> {
    if status != StatusCode::UNAUTHORIZED {
        return None;
    }
    let parsed = serde_json::from_str::<serde_json::Value>(body).ok();
    let reason = parsed
        .as_ref()
        .and_then(|v| v.get("reason"))
        .and_then(|r| r.as_str());
    let expired = match reason {
        Some(reason) => reason == IDENTITY_EXPIRED_REASON,
        // A body cut short (or not JSON) still names the reason.
        None => body.contains(IDENTITY_EXPIRED_REASON),
    };
    expired.then(|| crate::onboard::status_message(body.as_bytes()))
}

/// The fatal error for a relay that refused the tunnel with `status` (and the `Status` JSON `body`): 401 or
/// 403 reject the identity (expired, revoked, or not this cluster's); anything else may be retried (`None`).
pub(crate) fn refusal(status: StatusCode, body: &str) -> Option<AgentError> {
    if status != StatusCode::UNAUTHORIZED && status != StatusCode::FORBIDDEN {
        return None;
    }
    Some(match expired_reason(status, body) {
        Some(message) => AgentError::IdentityExpired { message },
        None => AgentError::CredentialRejected { status },
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn refusals_that_are_fatal() {
        let expired =
            r#"{"kind":"Status","reason":"IdentityExpired","message":"expired at X","code":401}"#;
        assert!(matches!(
            refusal(StatusCode::UNAUTHORIZED, expired),
            Some(AgentError::IdentityExpired { .. })
        ));
        assert!(matches!(
            refusal(StatusCode::FORBIDDEN, "{}"),
            Some(AgentError::CredentialRejected { .. })
        ));
        assert!(matches!(
            refusal(StatusCode::UNAUTHORIZED, "not json"),
            Some(AgentError::CredentialRejected { .. })
        ));
        assert!(refusal(StatusCode::SERVICE_UNAVAILABLE, expired).is_none());
        assert!(refusal(StatusCode::BAD_GATEWAY, "").is_none());
    }
}
