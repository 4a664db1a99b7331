//! End to end over a real tunnel: user (HTTPS, h1/h2) → relay → WebSocket/TLS tunnel → fake agent (a hyper
//! HTTP/1.1 server on each accepted stream).

mod common;

use std::convert::Infallible;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use anyhow::{Context as _, anyhow};
use bytes::Bytes;
use common::{AgentIdentity, Client, TestRelay, dial};
use http::{HeaderValue, Method, Request, Response, StatusCode};
use http_body_util::combinators::BoxBody;
use http_body_util::{BodyExt, Full, StreamBody};
use hyper::body::{Frame, Incoming};
use hyper::service::service_fn;
use hyper_util::rt::{TokioExecutor, TokioIo};
use tether_tunnel::{Connection, OpenOptions, Priority, TunnelError, code, kind, ws};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::sync::mpsc;

type BoxError = Box<dyn std::error::Error + Send + Sync>;
type AgentBody = BoxBody<Bytes, BoxError>;
type Handler = Arc<
    dyn Fn(Request<Incoming>) -> Pin<Box<dyn Future<Output = Response<AgentBody>> + Send>>
        + Send
        + Sync,
>;

/// What the fake agent does with each stream the relay opens.
#[derive(Clone)]
enum Mode {
    Serve(Handler),
    NeverAccept,
    Refuse(&'static str),
}

struct FakeAgent {
    conn: Connection,
    opened: Arc<AtomicUsize>,
}

fn full(data: impl Into<Bytes>) -> AgentBody {
    Full::new(data.into())
        .map_err(|never| match never {})
        .boxed()
}

fn handler<F, Fut>(f: F) -> Mode
where
    F: Fn(Request<Incoming>) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = Response<AgentBody>> + Send + 'static,
{
    Mode::Serve(Arc::new(move |req| Box::pin(f(req))))
}

impl FakeAgent {
    async fn connect(
        relay: &TestRelay,
        identity: &AgentIdentity,
        mode: Mode,
    ) -> anyhow::Result<FakeAgent> {
        let conn = dial(relay, identity).await?;
        let opened = Arc::new(AtomicUsize::new(0));
        let (c, n) = (conn.clone(), opened.clone());
        tokio::spawn(async move {
            let mut held = Vec::new();
            while let Some(incoming) = c.accept().await {
                n.fetch_add(1, Ordering::SeqCst);
                anyhow::ensure!(
                    incoming.kind == kind::HTTP,
                    "unexpected stream kind {}",
                    incoming.kind
                );
                match &mode {
                    Mode::NeverAccept => held.push(incoming),
                    Mode::Refuse(reason) => incoming.refuse(code::REFUSED, reason),
                    Mode::Serve(h) => {
                        let stream = incoming.accept(Bytes::new())?;
                        let h = h.clone();
                        tokio::spawn(async move {
                            let svc = service_fn(move |req| {
                                let h = h.clone();
                                async move { Ok::<_, Infallible>(h(req).await) }
                            });
                            let _ = hyper::server::conn::http1::Builder::new()
                                .serve_connection(TokioIo::new(stream), svc)
                                .with_upgrades()
                                .await;
                        });
                    }
                }
            }
            Ok::<_, anyhow::Error>(())
        });
        Ok(FakeAgent { conn, opened })
    }

    fn opened(&self) -> usize {
        self.opened.load(Ordering::SeqCst)
    }
}

/// A relay with one onboarded cluster `edge` and its agent connected.
async fn setup(
    dir: &std::path::Path,
    mode: Mode,
) -> anyhow::Result<(TestRelay, FakeAgent, AgentIdentity)> {
    setup_with(tether_relay::Config::new(dir.to_path_buf()), mode).await
}

async fn setup_with(
    config: tether_relay::Config,
    mode: Mode,
) -> anyhow::Result<(TestRelay, FakeAgent, AgentIdentity)> {
    let relay = TestRelay::start_with(config).await?;
    let identity = relay.admin()?.onboarded("edge").await?;
    let agent = FakeAgent::connect(&relay, &identity, mode).await?;
    relay.admin()?.wait_connected("edge", true).await?;
    Ok((relay, agent, identity))
}

async fn within<T>(what: &str, fut: impl Future<Output = T>) -> anyhow::Result<T> {
    tokio::time::timeout(Duration::from_secs(20), fut)
        .await
        .map_err(|_| anyhow!("timed out waiting for {what}"))
}

fn echo_agent() -> Mode {
    handler(|req: Request<Incoming>| async move {
        let (parts, body) = req.into_parts();
        let body = body
            .collect()
            .await
            .map(|c| c.to_bytes())
            .unwrap_or_default();
        let described = serde_json::json!({
            "method": parts.method.as_str(),
            "uri": parts.uri.to_string(),
            "version": format!("{:?}", parts.version),
            "host": parts.headers.get("host").and_then(|v| v.to_str().ok()),
            "authorization": parts.headers.get("authorization").and_then(|v| v.to_str().ok()),
            "te": parts.headers.get("te").is_some(),
            "bodyLen": body.len(),
            "bodySha": hex::encode(<sha2::Sha256 as sha2::Digest>::digest(&body)),
        });
        let mut resp = Response::new(full(described.to_string()));
        resp.headers_mut()
            .insert("content-type", HeaderValue::from_static("application/json"));
        resp
    })
}

#[tokio::test]
async fn requests_reach_the_agent_over_the_tunnel() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let (relay, agent, _) = setup(dir.path(), echo_agent()).await?;
    let shown = relay.admin()?.show("edge").await?.json()?;
    assert_eq!(shown["connected"], true);
    assert_eq!(shown["agentVersion"], "0.0.0-test");
    assert!(
        shown["connectedSince"].is_string() && shown["lastSeen"].is_string(),
        "{shown}"
    );

    let client = relay.client()?;
    for h2 in [false, true] {
        let body = Bytes::from(vec![7u8; 300_000]);
        let req = client
            .request(
                h2,
                Method::POST,
                "/clusters/edge/api/v1/namespaces/default/configmaps?fieldManager=kubectl",
            )
            .header(http::header::AUTHORIZATION, "Bearer user-token")
            .header(http::header::TE, "trailers")
            .body(Full::new(body.clone()))?;
        let reply = client.send(h2, req).await?;
        assert_eq!(reply.status, StatusCode::OK, "{reply:?}");
        let v = reply.json()?;
        assert_eq!(v["method"], "POST");
        assert_eq!(
            v["uri"],
            "/api/v1/namespaces/default/configmaps?fieldManager=kubectl"
        );
        assert_eq!(v["version"], "HTTP/1.1");
        assert_eq!(v["host"], "edge");
        assert_eq!(v["authorization"], "Bearer user-token");
        assert_eq!(v["te"], false);
        assert_eq!(v["bodyLen"], body.len());
        assert_eq!(
            v["bodySha"],
            hex::encode(<sha2::Sha256 as sha2::Digest>::digest(&body))
        );
    }
    let reply = client.get("/clusters/edge", Some("t")).await?;
    assert_eq!(reply.json()?["uri"], "/");
    assert_eq!(agent.opened(), 3);
    relay.stop().await
}

#[tokio::test]
async fn no_credential_is_refused_before_anything_enters_the_tunnel() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let (relay, agent, _) = setup(dir.path(), echo_agent()).await?;
    let client = relay.client()?;
    for h2 in [false, true] {
        let req = client
            .request(h2, Method::GET, "/clusters/edge/api/v1/secrets")
            .body(Full::default())?;
        client.send(h2, req).await?.status_message(401)?;
        let req = client
            .request(h2, Method::GET, "/clusters/edge/api/v1/secrets")
            .header(http::header::AUTHORIZATION, "")
            .body(Full::default())?;
        client.send(h2, req).await?.status_message(401)?;
    }
    client
        .get("/clusters/other/api", Some("t"))
        .await?
        .status_message(404)?;
    assert_eq!(agent.opened(), 0, "a refused request opened a stream");
    // The same request with a credential does reach the agent.
    assert_eq!(
        client
            .get("/clusters/edge/api/v1/secrets", Some("t"))
            .await?
            .status,
        StatusCode::OK
    );
    assert_eq!(agent.opened(), 1);
    relay.stop().await
}

#[tokio::test]
async fn large_and_streamed_responses_flow_incrementally() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    // /big: 8 MiB in one response. /watch: one event per message from the test.
    let (tx, rx) = mpsc::channel::<Bytes>(1);
    let rx = Arc::new(tokio::sync::Mutex::new(Some(rx)));
    let mode = handler(move |req: Request<Incoming>| {
        let rx = rx.clone();
        async move {
            if req.uri().path() == "/big" {
                let data: Vec<u8> = (0..8 * 1024 * 1024u32).map(|i| (i % 251) as u8).collect();
                return Response::new(full(data));
            }
            let rx = rx.lock().await.take();
            let events = futures_util::stream::unfold(rx, |rx| async move {
                let mut rx = rx?;
                let chunk = rx.recv().await?;
                Some((Ok::<_, BoxError>(Frame::data(chunk)), Some(rx)))
            });
            Response::new(BodyExt::boxed(StreamBody::new(events)))
        }
    });
    let (relay, _agent, _) = setup(dir.path(), mode).await?;
    let client = relay.client()?;
    let reply = client.get("/clusters/edge/big", Some("t")).await?;
    assert_eq!(reply.body.len(), 8 * 1024 * 1024);
    assert!(
        reply
            .body
            .iter()
            .enumerate()
            .all(|(i, b)| *b == (i % 251) as u8),
        "body bytes changed"
    );

    // A watch over HTTP/2: every event arrives while the response is still open.
    let req = client
        .request(true, Method::GET, "/clusters/edge/api/v1/pods?watch=true")
        .header(http::header::AUTHORIZATION, "Bearer t")
        .body(Full::<Bytes>::default())?;
    let tls = client_h2(&client).await?;
    let (mut sender, conn) =
        hyper::client::conn::http2::handshake(TokioExecutor::new(), tls).await?;
    tokio::spawn(conn);
    let resp = sender.send_request(req).await?;
    assert_eq!(resp.status(), StatusCode::OK);
    let mut body = resp.into_body();
    for i in 0..5 {
        let event = Bytes::from(format!("{{\"type\":\"ADDED\",\"object\":{{\"n\":{i}}}}}\n"));
        tx.send(event.clone()).await?;
        let mut got = Vec::new();
        while got.len() < event.len() {
            let frame = within("a watch event", body.frame())
                .await?
                .ok_or_else(|| anyhow!("watch ended"))??;
            if let Ok(data) = frame.into_data() {
                got.extend_from_slice(&data);
            }
        }
        assert_eq!(got, event);
    }
    drop(tx);
    // The end may come as an empty DATA frame carrying END_STREAM, then the end of the body.
    while let Some(frame) = within("the end of the watch", body.frame()).await? {
        let data = frame?
            .into_data()
            .map_err(|_| anyhow!("unexpected trailers"))?;
        assert!(data.is_empty(), "data after the last event: {data:?}");
    }
    relay.stop().await
}

async fn client_h2(
    client: &Client,
) -> anyhow::Result<TokioIo<tokio_rustls::client::TlsStream<tokio::net::TcpStream>>> {
    client.raw_tls(b"h2").await.map(TokioIo::new)
}

#[tokio::test]
async fn upgrades_become_byte_pipes_over_the_tunnel() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let mode = handler(|mut req: Request<Incoming>| async move {
        let on = hyper::upgrade::on(&mut req);
        tokio::spawn(async move {
            let Ok(upgraded) = on.await else { return };
            let mut io = TokioIo::new(upgraded);
            let mut all = Vec::new();
            let _ = io.read_to_end(&mut all).await; // until the user half-closes
            let _ = io.write_all(&all).await;
            let _ = io.write_all(b"\x00exit 0").await;
            let _ = io.shutdown().await;
        });
        let mut resp = Response::new(full(Bytes::new()));
        *resp.status_mut() = StatusCode::SWITCHING_PROTOCOLS;
        resp.headers_mut()
            .insert("connection", HeaderValue::from_static("Upgrade"));
        resp.headers_mut()
            .insert("upgrade", HeaderValue::from_static("websocket"));
        resp.headers_mut().insert(
            "sec-websocket-protocol",
            HeaderValue::from_static("v5.channel.k8s.io"),
        );
        resp
    });
    let (relay, _agent, _) = setup(dir.path(), mode).await?;
    let client = relay.client()?;
    let io = TokioIo::new(client.raw_tls(b"http/1.1").await?);
    let (mut sender, conn) = hyper::client::conn::http1::handshake(io).await?;
    tokio::spawn(conn.with_upgrades());
    let req = client
        .request(
            false,
            Method::GET,
            "/clusters/edge/api/v1/namespaces/default/pods/p/exec?command=cat&stdin=true",
        )
        .header(http::header::AUTHORIZATION, "Bearer t")
        .header(http::header::CONNECTION, "Upgrade")
        .header(http::header::UPGRADE, "websocket")
        .header(http::header::SEC_WEBSOCKET_KEY, "dGhlIHNhbXBsZSBub25jZQ==")
        .header(http::header::SEC_WEBSOCKET_VERSION, "13")
        .header(http::header::SEC_WEBSOCKET_PROTOCOL, "v5.channel.k8s.io")
        .body(Full::<Bytes>::default())?;
    let resp = sender.send_request(req).await?;
    assert_eq!(resp.status(), StatusCode::SWITCHING_PROTOCOLS);
    assert_eq!(
        resp.headers()["sec-websocket-protocol"],
        "v5.channel.k8s.io"
    );
    let mut io = TokioIo::new(hyper::upgrade::on(resp).await?);
    let payload: Vec<u8> = (0..1_000_000u32).map(|i| (i * 7 % 256) as u8).collect();
    let (mut rd, mut wr) = tokio::io::split(&mut io);
    let write = async {
        wr.write_all(&payload).await?;
        wr.shutdown().await // half-close; the answer still comes back
    };
    let read = async {
        let mut back = Vec::new();
        rd.read_to_end(&mut back).await.map(|_| back)
    };
    let (w, back) = within("the byte pipe", async { tokio::join!(write, read) }).await?;
    w?;
    let back = back?;
    let mut expected = payload.clone();
    expected.extend_from_slice(b"\x00exit 0");
    assert_eq!(back.len(), expected.len());
    assert!(back == expected, "bytes changed in the pipe");
    relay.stop().await
}

#[tokio::test]
async fn an_agent_that_never_accepts_gets_a_504() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let mut config = tether_relay::Config::new(dir.path().to_path_buf());
    config.open_timeout = Duration::from_millis(300);
    let (relay, agent, _) = setup_with(config, Mode::NeverAccept).await?;
    let reply = relay
        .client()?
        .get("/clusters/edge/api/v1/pods", Some("t"))
        .await?;
    let msg = reply.status_message(504)?;
    assert!(msg.contains("did not answer within 300ms"), "{msg}");
    assert_eq!(reply.json()?["reason"], "Timeout");
    assert_eq!(reply.headers["tether-error-origin"], "tunnel");
    assert_eq!(agent.opened(), 1);
    relay.stop().await
}

#[tokio::test]
async fn a_refused_stream_is_a_502_with_the_agents_reason() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let (relay, _agent, _) = setup(dir.path(), Mode::Refuse("apiserver unreachable")).await?;
    let reply = relay
        .client()?
        .get("/clusters/edge/api/v1/pods", Some("t"))
        .await?;
    let msg = reply.status_message(502)?;
    assert!(msg.contains("apiserver unreachable"), "{msg}");
    relay.stop().await
}

#[tokio::test]
async fn delete_closes_the_tunnel_and_revokes_the_identity() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let (relay, agent, identity) = setup(dir.path(), echo_agent()).await?;
    let admin = relay.admin()?;
    assert_eq!(admin.delete("edge").await?.status, StatusCode::NO_CONTENT);
    within("the tunnel to close", agent.conn.closed()).await?;
    match dial(&relay, &identity).await {
        Err(ws::ConnectError::Rejected { status, .. }) => {
            assert_eq!(status, StatusCode::UNAUTHORIZED)
        }
        other => anyhow::bail!(
            "reconnecting with a revoked identity: {:?}",
            other.map(|_| "connected")
        ),
    }
    relay
        .client()?
        .get("/clusters/edge/api", Some("t"))
        .await?
        .status_message(404)?;
    // A cluster registered again under the same name does not take the old identity back.
    admin.create_ok("edge").await?;
    assert!(
        matches!(
            dial(&relay, &identity).await,
            Err(ws::ConnectError::Rejected { status, .. }) if status == StatusCode::UNAUTHORIZED
        ),
        "the old identity works for the new registration"
    );
    relay.stop().await
}

#[tokio::test]
async fn a_second_tunnel_joins_the_first_and_requests_spread_over_both() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let (relay, first, identity) = setup(dir.path(), echo_agent()).await?;
    // Two agent replicas sharing one identity (or one agent keeping two tunnels): neither displaces the other.
    let second = FakeAgent::connect(&relay, &identity, echo_agent()).await?;
    let admin = relay.admin()?;
    let shown = admin
        .wait_for("edge", "two tunnels", |v| {
            v["tunnels"].as_array().map(Vec::len) == Some(2)
        })
        .await?;
    assert_eq!(shown["connected"], true, "{shown}");
    assert!(!first.conn.is_closed(), "the first tunnel was displaced");
    let client = relay.client()?;
    for _ in 0..10 {
        let reply = client.get("/clusters/edge/api", Some("t")).await?;
        assert_eq!(reply.status, StatusCode::OK, "{reply:?}");
    }
    assert_eq!(first.opened() + second.opened(), 10);
    assert!(
        first.opened() > 0 && second.opened() > 0,
        "requests were not spread: {} and {}",
        first.opened(),
        second.opened()
    );

    // The first tunnel's agent moves it (GOAWAY): new requests go to the second only.
    let before = first.opened();
    first
        .conn
        .go_away(code::SHUTDOWN, "moving to another replica");
    within("the first tunnel to close", first.conn.closed()).await?;
    for _ in 0..5 {
        let reply = client.get("/clusters/edge/api", Some("t")).await?;
        assert_eq!(reply.status, StatusCode::OK, "{reply:?}");
    }
    assert_eq!(first.opened(), before);
    // The first tunnel's end does not mark the cluster disconnected.
    let shown = admin
        .wait_for("edge", "one tunnel", |v| {
            v["tunnels"].as_array().map(Vec::len) == Some(1)
        })
        .await?;
    assert_eq!(shown["connected"], true, "{shown}");
    relay.stop().await
}

#[tokio::test]
async fn a_tunnel_past_the_bound_is_refused_and_the_established_ones_are_kept() -> anyhow::Result<()>
{
    let dir = tempfile::tempdir()?;
    let mut config = tether_relay::Config::new(dir.path().to_path_buf());
    config.limits.max_tunnels_per_cluster = 2;
    let (relay, first, identity) = setup_with(config, echo_agent()).await?;
    let second = FakeAgent::connect(&relay, &identity, echo_agent()).await?;
    // A third tunnel with the same identity (a stolen certificate, a leaking agent): refused with a Status
    // that says why; the two established tunnels stay.
    match dial(&relay, &identity).await {
        Err(ws::ConnectError::Rejected { status, body, .. }) => {
            assert_eq!(status, StatusCode::TOO_MANY_REQUESTS, "{body}");
            assert!(
                body.contains("already holds 2 tunnels")
                    && body.contains("established tunnels are kept"),
                "{body}"
            );
        }
        Err(other) => anyhow::bail!("expected a refusal, got {other}"),
        Ok(_) => anyhow::bail!("a third tunnel was accepted past the bound"),
    }
    assert!(!first.conn.is_closed() && !second.conn.is_closed());
    let shown = relay.admin()?.show("edge").await?.json()?;
    assert_eq!(
        shown["tunnels"].as_array().map(Vec::len),
        Some(2),
        "{shown}"
    );
    // Once one goes, a new one is taken again.
    second.conn.close(code::NO_ERROR, "gone");
    let again = tether_testkit::wait::eventually(
        "a third tunnel once the second is gone",
        Duration::from_secs(20),
        || async { dial(&relay, &identity).await.ok() },
    )
    .await?;
    drop(again);
    relay.stop().await
}

#[tokio::test]
async fn streams_other_than_control_opened_by_the_agent_are_refused() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let (relay, agent, _) = setup(dir.path(), echo_agent()).await?;
    let stream = agent.conn.open(OpenOptions {
        kind: kind::HTTP,
        priority: Priority::Normal,
        deadline: Some(Duration::from_secs(10)),
        metadata: Bytes::new(),
    })?;
    match within("the relay's answer", stream.control().accepted()).await? {
        Err(TunnelError::Refused { code, .. }) => assert_eq!(code, code::UNSUPPORTED_KIND),
        other => anyhow::bail!("expected a refusal, got {other:?}"),
    }
    relay.stop().await
}

#[tokio::test]
async fn agent_disconnect_is_recorded() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let (relay, agent, _) = setup(dir.path(), echo_agent()).await?;
    agent.conn.close(code::NO_ERROR, "agent stopping");
    let shown = relay.admin()?.wait_connected("edge", false).await?;
    assert!(shown["connectedSince"].is_null(), "{shown}");
    assert!(shown["lastSeen"].is_string(), "{shown}");
    relay
        .client()?
        .get("/clusters/edge/api", Some("t"))
        .await?
        .status_message(503)?;
    relay.stop().await
}

#[tokio::test]
async fn shutdown_sends_goaway_and_returns() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let (relay, agent, _) = setup(dir.path(), echo_agent()).await?;
    within("the relay to stop", relay.stop()).await??;
    let info = within("the tunnel to close", agent.conn.closed()).await?;
    assert!(info.error.is_none(), "not a graceful close: {info:?}");
    Ok(())
}

#[tokio::test]
async fn shutdown_lets_an_in_flight_request_finish() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let (started_tx, mut started_rx) = mpsc::channel::<()>(1);
    let (release_tx, release_rx) = mpsc::channel::<()>(1);
    let release_rx = Arc::new(tokio::sync::Mutex::new(release_rx));
    let mode = handler(move |_req| {
        let (started, release) = (started_tx.clone(), release_rx.clone());
        async move {
            let _ = started.send(()).await;
            let _ = release.lock().await.recv().await;
            Response::new(full("finished"))
        }
    });
    let mut config = tether_relay::Config::new(dir.path().to_path_buf());
    config.limits.shutdown_grace = Duration::from_secs(60);
    let (relay, agent, _) = setup_with(config, mode).await?;
    let client = relay.client()?;
    let request = tokio::spawn(async move { client.get("/clusters/edge/slow", Some("t")).await });
    within("the request to reach the agent", started_rx.recv()).await?;
    let stop = tokio::spawn(relay.stop());
    // The relay is draining: the tunnel got GOAWAY but stays up for the stream in flight.
    release_tx.send(()).await?;
    let reply = within("the in-flight request", request).await???;
    assert_eq!(reply.status, StatusCode::OK);
    assert_eq!(&reply.body[..], b"finished");
    within("the relay to stop", stop).await???;
    within("the tunnel to close", agent.conn.closed()).await?;
    Ok(())
}

#[tokio::test]
async fn shutdown_cuts_what_outlives_the_grace_period() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let mode = handler(|_req| async move {
        // A watch that never ends.
        let forever = futures_util::stream::pending::<Result<Frame<Bytes>, BoxError>>();
        Response::new(BodyExt::boxed(StreamBody::new(forever)))
    });
    let mut config = tether_relay::Config::new(dir.path().to_path_buf());
    config.limits.shutdown_grace = Duration::from_millis(100);
    let (relay, agent, _) = setup_with(config, mode).await?;
    let client = relay.client()?;
    let io = TokioIo::new(client.raw_tls(b"http/1.1").await?);
    let (mut sender, conn) = hyper::client::conn::http1::handshake(io).await?;
    tokio::spawn(conn);
    let req = client
        .request(false, Method::GET, "/clusters/edge/api/v1/pods?watch=true")
        .header(http::header::AUTHORIZATION, "Bearer t")
        .body(Full::<Bytes>::default())?;
    let resp = sender.send_request(req).await?;
    assert_eq!(resp.status(), StatusCode::OK);
    within("the relay to stop", relay.stop()).await??;
    within("the tunnel to close", agent.conn.closed()).await?;
    // The watch ended (with an error: it was cut, not completed).
    let end = within("the watch to end", resp.into_body().collect()).await?;
    assert!(end.is_err(), "a cut watch must not look complete");
    Ok(())
}

#[tokio::test]
async fn the_store_reflects_a_restart_and_the_agent_can_reconnect() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let (relay, agent, identity) = setup(dir.path(), echo_agent()).await?;
    relay.stop().await?;
    within("the tunnel to close", agent.conn.closed()).await?;
    let relay = TestRelay::start(dir.path()).await?;
    let shown = relay.admin()?.show("edge").await?.json()?;
    assert_eq!(
        (shown["connected"].clone(), shown["onboarded"].clone()),
        (false.into(), true.into())
    );
    let _agent = FakeAgent::connect(&relay, &identity, echo_agent())
        .await
        .context("reconnect")?;
    relay.admin()?.wait_connected("edge", true).await?;
    assert_eq!(
        relay
            .client()?
            .get("/clusters/edge/version", Some("t"))
            .await?
            .status,
        StatusCode::OK
    );
    relay.stop().await
}

#[tokio::test]
async fn delete_closes_a_tunnel_with_a_watch_in_flight() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let mode = handler(|_req| async move {
        let forever = futures_util::stream::pending::<Result<Frame<Bytes>, BoxError>>();
        Response::new(BodyExt::boxed(StreamBody::new(forever)))
    });
    let (relay, agent, _) = setup(dir.path(), mode).await?;
    let client = relay.client()?;
    let io = TokioIo::new(client.raw_tls(b"http/1.1").await?);
    let (mut sender, conn) = hyper::client::conn::http1::handshake(io).await?;
    tokio::spawn(conn);
    let req = client
        .request(false, Method::GET, "/clusters/edge/api/v1/pods?watch=true")
        .header(http::header::AUTHORIZATION, "Bearer t")
        .body(Full::<Bytes>::default())?;
    let resp = sender.send_request(req).await?;
    assert_eq!(resp.status(), StatusCode::OK);
    assert_eq!(
        relay.admin()?.delete("edge").await?.status,
        StatusCode::NO_CONTENT
    );
    let info = within("the tunnel to close", agent.conn.closed()).await?;
    assert!(info.error.is_some(), "{info:?}");
    let end = within("the watch to end", resp.into_body().collect()).await?;
    assert!(end.is_err(), "a cut watch must not look complete");
    relay.stop().await
}

#[tokio::test]
async fn a_restart_on_sqlite_forgets_the_tunnels_of_the_run_before() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let (relay, agent, _) = setup(dir.path(), echo_agent()).await?;
    relay.stop().await?;
    within("the tunnel to close", agent.conn.closed()).await?;
    // What a SIGKILLed run leaves behind: its replica row with a running lease, and its tunnel.
    let url = format!("sqlite://{}", dir.path().join("relay.db").display());
    let store = tether_relay::store::open(&url).await?;
    store
        .register_replica(&tether_relay::store::ReplicaLease {
            id: "relay-killed".into(),
            peer_address: None,
            ttl: Duration::from_secs(600),
            draining: false,
        })
        .await?;
    store
        .put_tunnel(&tether_relay::store::TunnelRecord {
            replica: "relay-killed".into(),
            tunnel_id: 1,
            cluster: "edge".into(),
            agent_instance: String::new(),
            agent_tunnels: 0,
            transport: "wss".into(),
            agent_address: "127.0.0.1:1".into(),
            connected_since: time::OffsetDateTime::now_utc(),
            usable: true,
        })
        .await?;
    store.close().await?;
    // The next run (SQLite serves one relay) removes them: the cluster is not connected until its agent is back.
    let relay = TestRelay::start(dir.path()).await?;
    let shown = relay.admin()?.show("edge").await?.json()?;
    assert_eq!(shown["connected"], false, "{shown}");
    assert_eq!(
        shown["tunnels"].as_array().map(Vec::len),
        Some(0),
        "{shown}"
    );
    relay.stop().await
}
