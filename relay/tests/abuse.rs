//! Abuse resistance at the relay's user endpoint (issue 10), as attacks over a real tunnel: user (HTTPS) →
//! relay → WebSocket/TLS tunnel → a fake agent that reports which headers reached it.

mod common;

use std::convert::Infallible;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use bytes::Bytes;
use common::{Client, TestRelay, dial};
use http::{HeaderValue, Method, Request, Response, StatusCode};
use http_body_util::Full;
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
                        Ok::<_, Infallible>(Response::new(Full::new(Bytes::from(
                            Value::Object(headers).to_string(),
                        ))))
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
