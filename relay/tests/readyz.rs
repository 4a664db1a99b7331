//! The relay's probes over real HTTPS: `/readyz` (readiness: the store answers, the relay is not draining)
//! beside `/healthz` (liveness). On shutdown `/readyz` answers 503 `draining` at once, while the relay still
//! accepts and serves (the drain); the store-down answer is decided by `handlers::health::readiness`,
//! unit-tested there.

mod common;

use std::convert::Infallible;
use std::time::Duration;

use bytes::Bytes;
use common::TestRelay;
use http::{Method, Request, Response, StatusCode};
use http_body_util::{BodyExt, Full, StreamBody};
use hyper::body::{Frame, Incoming};
use hyper::service::service_fn;
use hyper_util::rt::TokioIo;

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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn readyz_goes_false_at_once_on_shutdown_while_the_relay_still_serves() -> anyhow::Result<()>
{
    let dir = tempfile::tempdir()?;
    let mut config = tether_relay::Config::new(dir.path().to_path_buf());
    config.limits.shutdown_grace = Duration::from_secs(60);
    let mut relay = TestRelay::start_with(config).await?;
    let identity = relay.admin()?.onboarded("edge").await?;
    let conn = common::dial(&relay, &identity).await?;
    // The agent answers every request with a body that never ends (a watch).
    let agent = conn.clone();
    tokio::spawn(async move {
        while let Some(incoming) = agent.accept().await {
            let Ok(stream) = incoming.accept(Bytes::new()) else {
                continue;
            };
            tokio::spawn(async move {
                let svc = service_fn(|_req: Request<Incoming>| async {
                    let forever = futures_util::stream::pending::<
                        Result<Frame<Bytes>, Box<dyn std::error::Error + Send + Sync>>,
                    >();
                    Ok::<_, Infallible>(Response::new(StreamBody::new(forever)))
                });
                let _ = hyper::server::conn::http1::Builder::new()
                    .serve_connection(TokioIo::new(stream), svc)
                    .await;
            });
        }
    });
    relay.admin()?.wait_connected("edge", true).await?;
    let client = relay.client()?;
    let io = TokioIo::new(client.raw_tls(b"http/1.1").await?);
    let (mut sender, h1) = hyper::client::conn::http1::handshake(io).await?;
    tokio::spawn(h1);
    let req = client
        .request(false, Method::GET, "/clusters/edge/api/v1/pods?watch=true")
        .header(http::header::AUTHORIZATION, "Bearer t")
        .body(Full::<Bytes>::default())?;
    let watch = sender.send_request(req).await?;
    assert_eq!(watch.status(), StatusCode::OK);
    assert_eq!(client.get("/readyz", None).await?.status, StatusCode::OK);

    relay.begin_stop();
    // At once: a load balancer probing now stops sending new users here, while this relay still accepts and
    // answers (the watch keeps the drain going).
    let reply = client.get("/readyz", None).await?;
    assert_eq!(reply.status, StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(&reply.body[..], b"draining");
    assert_eq!(client.get("/healthz", None).await?.status, StatusCode::OK);
    // The agent goes (its tunnel had GOAWAY): the watch ends, and the relay stops.
    conn.close(tether_tunnel::code::NO_ERROR, "agent gone");
    let _ = tokio::time::timeout(Duration::from_secs(20), watch.into_body().collect()).await?;
    tokio::time::timeout(Duration::from_secs(20), relay.stop()).await??;
    Ok(())
}
