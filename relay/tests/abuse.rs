//! Abuse resistance at the relay's user endpoint (issue 10), as attacks over a real tunnel: user (HTTPS) →
//! relay → WebSocket/TLS tunnel → a fake agent that reports which headers reached it.

mod common;

use std::convert::Infallible;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use bytes::Bytes;
use common::{Client, TestRelay, dial};
use http::{HeaderValue, Method, Request, Response, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper_util::rt::TokioIo;
use serde_json::{Value, json};

/// A fake agent answering every stream with the request headers it received, as JSON (name → values).
struct EchoAgent {
    opened: Arc<AtomicUsize>,
    _conn: tether_tunnel::Connection,
}

impl EchoAgent {
    async fn connect(relay: &TestRelay, cluster: &str) -> anyhow::Result<Self> {
        let identity = relay.admin()?.onboarded(cluster).await?;
        let conn = dial(relay, &identity).await?;
        let opened = Arc::new(AtomicUsize::new(0));
        let (c, n) = (conn.clone(), opened.clone());
        tokio::spawn(async move {
            while let Some(incoming) = c.accept().await {
                n.fetch_add(1, Ordering::SeqCst);
                let Ok(stream) = incoming.accept(Bytes::new()) else {
                    continue;
                };
                tokio::spawn(async move {
                    let svc = service_fn(|req: Request<Incoming>| async move {
                        if req.uri().query().is_some_and(|q| q.contains("watch=1")) {
                            // A watch that never ends: the head now, then nothing.
                            return Ok::<_, Infallible>(Response::new(Never.boxed()));
                        }
                        let mut headers = serde_json::Map::new();
                        for name in req.headers().keys() {
                            let values: Vec<Value> = req
                                .headers()
                                .get_all(name)
                                .iter()
                                .map(|v| Value::from(v.to_str().unwrap_or("?")))
                                .collect();
                            headers.insert(name.as_str().to_owned(), Value::Array(values));
                        }
                        Ok::<_, Infallible>(Response::new(
                            Full::new(Bytes::from(Value::Object(headers).to_string()))
                                .map_err(|never| match never {})
                                .boxed(),
                        ))
                    });
                    let _ = hyper::server::conn::http1::Builder::new()
                        .serve_connection(TokioIo::new(stream), svc)
                        .await;
                });
            }
        });
        relay.admin()?.wait_connected(cluster, true).await?;
        Ok(Self {
            opened,
            _conn: conn,
        })
    }

    fn opened(&self) -> usize {
        self.opened.load(Ordering::SeqCst)
    }
}

/// A body that never yields a frame (a watch with no events).
struct Never;

impl http_body::Body for Never {
    type Data = Bytes;
    type Error = Infallible;

    fn poll_frame(
        self: std::pin::Pin<&mut Self>,
        _: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<http_body::Frame<Bytes>, Infallible>>> {
        std::task::Poll::Pending
    }
}

async fn send(
    client: &Client,
    h2: bool,
    headers: &[(&'static str, &'static str)],
) -> anyhow::Result<common::Reply> {
    let mut b = client.request(h2, Method::GET, "/clusters/edge/api/v1/secrets");
    for (k, v) in headers {
        b = b.header(*k, HeaderValue::from_static(v));
    }
    client.send(h2, b.body(Full::default())?).await
}

/// `Authorization: x`, `Basic …`, two Authorization headers, a token with spaces: refused with 401 before any
/// stream is opened (on the old main, any non-empty Authorization header went into the tunnel).
#[tokio::test]
async fn implausible_credentials_never_enter_a_tunnel() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let relay = TestRelay::start(dir.path()).await?;
    let agent = EchoAgent::connect(&relay, "edge").await?;
    let client = relay.client()?;
    for h2 in [false, true] {
        for value in [
            "x",
            "Basic dXNlcjpwdw==",
            "Bearer a b",
            "Bearer ===",
            "Token abc",
        ] {
            let reply = send(&client, h2, &[("authorization", value)]).await?;
            reply.status_message(401)?;
        }
        let mut b = client.request(h2, Method::GET, "/clusters/edge/api/v1/secrets");
        b = b
            .header("authorization", "Bearer a")
            .header("authorization", "Bearer b");
        client
            .send(h2, b.body(Full::default())?)
            .await?
            .status_message(401)?;
    }
    assert_eq!(
        agent.opened(),
        0,
        "an implausible credential opened a stream"
    );
    let ok = send(&client, false, &[("authorization", "Bearer abc.def-_~+/=")]).await?;
    assert_eq!(ok.status, StatusCode::OK, "{ok:?}");
    assert_eq!(agent.opened(), 1);
    relay.stop().await
}

/// `Connection: authorization` must not strip the header after the relay checked it (on the old main the
/// agent received no Authorization at all), and `Connection` can still remove other headers.
#[tokio::test]
async fn connection_cannot_remove_the_checked_authorization() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let relay = TestRelay::start(dir.path()).await?;
    let _agent = EchoAgent::connect(&relay, "edge").await?;
    let client = relay.client()?;
    let reply = send(
        &client,
        false,
        &[
            ("authorization", "Bearer user-token"),
            ("connection", "keep-alive, Authorization, x-hop"),
            ("x-hop", "1"),
        ],
    )
    .await?;
    assert_eq!(reply.status, StatusCode::OK, "{reply:?}");
    let seen = reply.json()?;
    assert_eq!(
        seen["authorization"],
        json!(["Bearer user-token"]),
        "{seen}"
    );
    assert!(seen.get("x-hop").is_none(), "{seen}");
    assert!(seen.get("connection").is_none(), "{seen}");
    relay.stop().await
}

/// Forged identity and address headers never reach the cluster; the relay says who really connected.
#[tokio::test]
async fn forged_identity_headers_are_dropped_and_the_real_address_added() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let relay = TestRelay::start(dir.path()).await?;
    let _agent = EchoAgent::connect(&relay, "edge").await?;
    let client = relay.client()?;
    for h2 in [false, true] {
        let reply = send(
            &client,
            h2,
            &[
                ("authorization", "Bearer user-token"),
                ("x-remote-user", "admin"),
                ("x-remote-group", "system:masters"),
                ("x-remote-extra-scopes", "all"),
                ("x-forwarded-for", "203.0.113.9"),
                ("x-forwarded-proto", "http"),
                ("forwarded", "for=203.0.113.9"),
                ("x-real-ip", "203.0.113.9"),
                ("impersonate-user", "bob"),
            ],
        )
        .await?;
        assert_eq!(reply.status, StatusCode::OK, "{reply:?}");
        let seen = reply.json()?;
        for gone in [
            "x-remote-user",
            "x-remote-group",
            "x-remote-extra-scopes",
            "x-forwarded-proto",
            "forwarded",
            "x-real-ip",
        ] {
            assert!(seen.get(gone).is_none(), "{gone} reached the agent: {seen}");
        }
        assert_eq!(seen["x-forwarded-for"], json!(["127.0.0.1"]), "{seen}");
        // Impersonation is authorized by the apiserver against the caller's own credential.
        assert_eq!(seen["impersonate-user"], json!(["bob"]), "{seen}");
    }
    relay.stop().await
}

/// Opens a watch as `token` over its own HTTP/1.1 connection and returns once the head arrived; the response
/// (and so the stream) stays open until the returned value is dropped.
async fn open_watch(
    client: &Client,
    token: &str,
) -> anyhow::Result<(StatusCode, http::HeaderMap, Box<dyn std::any::Any + Send>)> {
    let io = TokioIo::new(client.raw_tls(b"http/1.1").await?);
    let (mut sender, conn) = hyper::client::conn::http1::handshake(io).await?;
    let conn = tokio::spawn(conn);
    let req = client
        .request(false, Method::GET, "/clusters/edge/api/v1/pods?watch=1")
        .header("authorization", format!("Bearer {token}"))
        .body(Full::<Bytes>::default())?;
    let resp = sender.send_request(req).await?;
    let (parts, body) = resp.into_parts();
    struct Held {
        _body: Incoming,
        conn: tokio::task::JoinHandle<Result<(), hyper::Error>>,
    }
    impl Drop for Held {
        fn drop(&mut self) {
            self.conn.abort();
        }
    }
    Ok((
        parts.status,
        parts.headers,
        Box::new(Held { _body: body, conn }),
    ))
}

/// One principal at its bound of concurrent requests to a cluster gets 429 with Retry-After; another principal
/// (from the same address) keeps working; when a watch ends, the first principal can open again. On the old
/// main every principal shared the tunnel's 1,024 streams.
#[tokio::test]
async fn one_principal_over_its_bound_gets_429_and_nobody_else_notices() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let mut config = tether_relay::Config::new(dir.path().to_path_buf());
    config.limits.max_streams_per_principal = 3;
    let relay = TestRelay::start_with(config).await?;
    let _agent = EchoAgent::connect(&relay, "edge").await?;
    let client = relay.client()?;
    let mut held = Vec::new();
    for _ in 0..3 {
        let (status, _, h) = open_watch(&client, "greedy-token").await?;
        assert_eq!(status, StatusCode::OK);
        held.push(h);
    }
    let (status, headers, _over) = open_watch(&client, "greedy-token").await?;
    assert_eq!(status, StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(
        headers.get("retry-after").and_then(|v| v.to_str().ok()),
        Some("1")
    );
    for h2 in [false, true] {
        let other = send(&client, h2, &[("authorization", "Bearer polite-token")]).await?;
        assert_eq!(other.status, StatusCode::OK, "{other:?}");
        let (status, _, _w) = open_watch(&client, "polite-token").await?;
        assert_eq!(status, StatusCode::OK);
    }
    // A watch ends (the client goes away): the slot comes back.
    held.pop();
    let deadline = tokio::time::Instant::now() + std::time::Duration::from_secs(10);
    loop {
        let (status, _, h) = open_watch(&client, "greedy-token").await?;
        if status == StatusCode::OK {
            held.push(h);
            break;
        }
        anyhow::ensure!(
            tokio::time::Instant::now() < deadline,
            "the ended watch's slot never came back"
        );
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
    drop(held);
    relay.stop().await
}

/// An onboarding token past `--onboarding-token-ttl` is refused (on the old main it never expired); a fresh
/// cluster with the default TTL onboards.
#[tokio::test]
async fn onboarding_tokens_expire() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let mut config = tether_relay::Config::new(dir.path().to_path_buf());
    config.onboarding_token_ttl = std::time::Duration::from_millis(1);
    let relay = TestRelay::start_with(config).await?;
    let token = relay.admin()?.create_ok("stale").await?;
    // Wait (bounded) until the clock is past the TTL; the store's creation time is at most now.
    tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    let (_, csr) = common::new_csr("x")?;
    let reply = relay
        .client()?
        .post_json(
            "/agent/v1/onboard",
            None,
            &json!({ "cluster": "stale", "token": token, "csr": csr }),
        )
        .await?;
    let message = reply.status_message(401)?;
    assert!(message.contains("expired"), "{message}");
    relay.stop().await?;

    let dir = tempfile::tempdir()?;
    let relay = TestRelay::start(dir.path()).await?;
    relay.admin()?.onboarded("fresh").await?;
    relay.stop().await
}
