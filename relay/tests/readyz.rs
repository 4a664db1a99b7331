//! The relay's probes over real HTTPS: `/readyz` (readiness: the store answers, the relay is not draining)
//! beside `/healthz` (liveness). The 503 answers (store down, draining) are decided by
//! `handlers::health::readiness`, unit-tested there: the relay accepts only SQLite URLs today (a PostgreSQL
//! store that a test could stop arrives with the relay-fleet work), and the listener stops accepting before it
//! marks the relay draining.

mod common;

use common::TestRelay;
use http::{Method, StatusCode};
use http_body_util::Full;

#[tokio::test]
async fn readyz_answers_ok_without_a_token_and_only_to_get() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let relay = TestRelay::start(dir.path()).await?;
    let client = relay.client()?;
    for h2 in [false, true] {
        let req = client
            .request(h2, Method::GET, "/readyz")
            .body(Full::default())?;
        let reply = client.send(h2, req).await?;
        assert_eq!(reply.status, StatusCode::OK, "h2={h2}");
        assert_eq!(&reply.body[..], b"ok");
    }
    let req = client
        .request(false, Method::POST, "/readyz")
        .body(Full::default())?;
    assert_eq!(
        client.send(false, req).await?.status,
        StatusCode::METHOD_NOT_ALLOWED
    );
    // A path that only starts like a probe is not one.
    assert_eq!(
        client.get("/readyz/x", None).await?.status,
        StatusCode::NOT_FOUND
    );
    assert_eq!(client.get("/healthz", None).await?.status, StatusCode::OK);
    relay.stop().await
}
