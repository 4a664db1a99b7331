//! The probes: `GET /healthz` (liveness: the process serves requests) and `GET /readyz` (readiness: this relay
//! can serve — its store answers and it is not draining). Neither needs a token and neither names a cluster;
//! both answer `text/plain`. Liveness never looks at the store, so a database outage takes relays out of the
//! Service's endpoints (readiness) without the kubelet restarting them all (liveness).

use std::time::Duration;

use http::{Method, Response, StatusCode};

use crate::api_error::ApiError;
use crate::body::Body;
use crate::respond;
use crate::state::Shared;
use crate::store::Store;

/// How long `/readyz` waits for the store before answering 503 (below the chart's probe timeout).
pub(crate) const STORE_CHECK_TIMEOUT: Duration = Duration::from_secs(2);

/// `GET /healthz`: 200 while the relay serves requests.
pub(crate) fn healthz(method: &Method) -> Result<Response<Body>, ApiError> {
    probe_method(method)?;
    Ok(respond::text(StatusCode::OK, "ok"))
}

/// `GET /readyz`: 200 when the store answers within [`STORE_CHECK_TIMEOUT`] and the relay is not draining,
/// else 503 saying which (and nothing more).
pub(crate) async fn readyz(shared: &Shared, method: &Method) -> Result<Response<Body>, ApiError> {
    probe_method(method)?;
    let draining = shared.is_shutting_down();
    let store_ok = !draining && store_answers(shared.store.as_ref()).await;
    let (status, text) = readiness(draining, store_ok);
    Ok(respond::text(status, text))
}

/// One cheap read: a cluster lookup by a name no cluster can have (names are never empty).
async fn store_answers(store: &dyn Store) -> bool {
    match tokio::time::timeout(STORE_CHECK_TIMEOUT, store.cluster("")).await {
        Ok(Ok(_)) => true,
        Ok(Err(e)) => {
            tracing::warn!(error = %e, "readiness: the store does not answer");
            false
        }
        Err(_) => {
            tracing::warn!(timeout = ?STORE_CHECK_TIMEOUT, "readiness: the store timed out");
            false
        }
    }
}

/// The readiness answer: draining wins over the store's state.
fn readiness(draining: bool, store_ok: bool) -> (StatusCode, &'static str) {
    if draining {
        (StatusCode::SERVICE_UNAVAILABLE, "draining")
    } else if store_ok {
        (StatusCode::OK, "ok")
    } else {
        (StatusCode::SERVICE_UNAVAILABLE, "store unavailable")
    }
}

/// Probes are `GET` (and `HEAD`, which hyper answers without the body).
fn probe_method(method: &Method) -> Result<(), ApiError> {
    if method == Method::GET || method == Method::HEAD {
        Ok(())
    } else {
        Err(ApiError::method_not_allowed())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ready_only_when_the_store_answers_and_not_draining() {
        assert_eq!(readiness(false, true), (StatusCode::OK, "ok"));
        assert_eq!(
            readiness(false, false),
            (StatusCode::SERVICE_UNAVAILABLE, "store unavailable")
        );
        assert_eq!(
            readiness(true, true),
            (StatusCode::SERVICE_UNAVAILABLE, "draining")
        );
        assert_eq!(
            readiness(true, false),
            (StatusCode::SERVICE_UNAVAILABLE, "draining")
        );
    }

    /// A real SQLite store answers; once closed (as a store that went away) it does not.
    #[tokio::test]
    async fn the_store_check_sees_a_store_that_stopped_answering() {
        let dir = tempfile::tempdir().expect("temp dir");
        let url = format!("sqlite://{}", dir.path().join("relay.db").display());
        let store = crate::store::open(&url).await.expect("store opens");
        assert!(store_answers(store.as_ref()).await);
        store.close().await.expect("store closes");
        assert!(!store_answers(store.as_ref()).await);
    }

    #[test]
    fn probes_answer_get_and_head_only() {
        assert!(probe_method(&Method::GET).is_ok());
        assert!(probe_method(&Method::HEAD).is_ok());
        assert!(probe_method(&Method::POST).is_err());
        assert!(probe_method(&Method::DELETE).is_err());
    }
}
