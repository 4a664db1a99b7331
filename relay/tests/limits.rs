//! Per-client connection bounds at the relay (issue 10 item 1, issue 17 item 5), as attacks over real TLS
//! connections and a real tunnel: early cancellations per principal and per address, connections per principal
//! and per address, the idle timeout of user connections, and the agents' own connection budget.
//!
//! Another client address is another loopback address (127.0.0.2): Linux routes all of 127.0.0.0/8 to `lo`.

mod common;

use std::convert::Infallible;
use std::net::IpAddr;
use std::time::Duration;

use bytes::Bytes;
use common::{Client, TestRelay, dial};
use http::{HeaderMap, Method, Request, Response, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper_util::rt::{TokioExecutor, TokioIo};
use tokio::task::JoinHandle;

const OTHER_IP: IpAddr = IpAddr::V4(std::net::Ipv4Addr::new(127, 0, 0, 2));

/// A fake agent: a watch (`watch=1`) gets its head and then nothing, anything else `200 ok`.
struct Agent {
    _conn: tether_tunnel::Connection,
}

impl Agent {
    async fn connect(relay: &TestRelay, cluster: &str) -> anyhow::Result<Self> {
        let identity = relay.admin()?.onboarded(cluster).await?;
        let conn = dial(relay, &identity).await?;
        serve_streams(conn.clone());
        relay.admin()?.wait_connected(cluster, true).await?;
        Ok(Self { _conn: conn })
    }
}

fn serve_streams(conn: tether_tunnel::Connection) {
    tokio::spawn(async move {
        while let Some(incoming) = conn.accept().await {
            let Ok(stream) = incoming.accept(Bytes::new()) else {
                continue;
            };
            tokio::spawn(async move {
                let svc = service_fn(|req: Request<Incoming>| async move {
                    if req.uri().query().is_some_and(|q| q.contains("watch=1")) {
                        return Ok::<_, Infallible>(Response::new(Never.boxed()));
                    }
                    Ok::<_, Infallible>(Response::new(
                        Full::new(Bytes::from_static(b"ok"))
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

/// An HTTP/1.1 connection with one watch on it; dropping it closes the connection (the user goes away).
struct Watch {
    status: StatusCode,
    headers: HeaderMap,
    body: Option<Incoming>,
    conn: JoinHandle<Result<(), hyper::Error>>,
}

impl Drop for Watch {
    fn drop(&mut self) {
        self.conn.abort();
    }
}

impl Watch {
    /// Opens a watch as `token` from `source` over a new HTTP/1.1 connection; returns once the head arrived.
    async fn open(client: &Client, token: &str, source: Option<IpAddr>) -> anyhow::Result<Self> {
        let io = TokioIo::new(client.raw_tls_from(b"http/1.1", source).await?);
        let (mut sender, conn) = hyper::client::conn::http1::handshake(io).await?;
        let conn = tokio::spawn(conn);
        let req = client
            .request(false, Method::GET, "/clusters/edge/api/v1/pods?watch=1")
            .header("authorization", format!("Bearer {token}"))
            .body(Full::<Bytes>::default())?;
        let resp = sender.send_request(req).await?;
        let (parts, body) = resp.into_parts();
        Ok(Self {
            status: parts.status,
            headers: parts.headers,
            body: Some(body),
            conn,
        })
    }

    /// The `Status` message of a refusal (reads the body).
    async fn message(&mut self) -> anyhow::Result<String> {
        let body = self.body.take().ok_or_else(|| anyhow::anyhow!("no body"))?;
        let bytes = body.collect().await?.to_bytes();
        let v: serde_json::Value = serde_json::from_slice(&bytes)?;
        Ok(v["message"].as_str().unwrap_or_default().to_owned())
    }

    /// Waits (bounded) until the relay has closed the connection.
    async fn closed(&mut self) -> anyhow::Result<()> {
        tokio::time::timeout(Duration::from_secs(20), &mut self.conn)
            .await
            .map_err(|_| anyhow::anyhow!("the relay did not close the connection"))?
            .ok();
        Ok(())
    }
}

/// An HTTP/2 connection to the relay, kept open.
struct H2 {
    sender: hyper::client::conn::http2::SendRequest<Full<Bytes>>,
    conn: JoinHandle<Result<(), hyper::Error>>,
}

impl Drop for H2 {
    fn drop(&mut self) {
        self.conn.abort();
    }
}

impl H2 {
    async fn open(client: &Client, source: Option<IpAddr>) -> anyhow::Result<Self> {
        let io = TokioIo::new(client.raw_tls_from(b"h2", source).await?);
        let (sender, conn) =
            hyper::client::conn::http2::handshake(TokioExecutor::new(), io).await?;
        Ok(Self {
            sender,
            conn: tokio::spawn(conn),
        })
    }

    /// Sends a GET and returns the status once the whole response was read.
    async fn get(
        &mut self,
        client: &Client,
        path: &str,
        token: &str,
    ) -> anyhow::Result<StatusCode> {
        let req = client
            .request(true, Method::GET, path)
            .header("authorization", format!("Bearer {token}"))
            .body(Full::default())?;
        let resp = self.sender.send_request(req).await?;
        let status = resp.status();
        resp.into_body().collect().await?;
        Ok(status)
    }

    /// Opens a watch on this connection; the stream stays open while the returned body lives.
    async fn watch(
        &mut self,
        client: &Client,
        token: &str,
    ) -> anyhow::Result<(StatusCode, Incoming)> {
        let req = client
            .request(true, Method::GET, "/clusters/edge/api/v1/pods?watch=1")
            .header("authorization", format!("Bearer {token}"))
            .body(Full::default())?;
        let resp = self.sender.send_request(req).await?;
        Ok((resp.status(), resp.into_body()))
    }

    fn is_closed(&self) -> bool {
        self.conn.is_finished()
    }
}

fn retry_after(headers: &HeaderMap) -> Option<&str> {
    headers.get("retry-after").and_then(|v| v.to_str().ok())
}

/// Opens watches as `token` (or a new token each time) from `source` and drops each right after its head,
/// until the relay answers 429; returns that refusal and how many were answered before. Bounded.
async fn cancel_until_refused(
    client: &Client,
    token: Option<&str>,
    source: Option<IpAddr>,
) -> anyhow::Result<(Watch, usize)> {
    for i in 0..200 {
        let fresh = format!("canceller-{i}");
        let watch = Watch::open(client, token.unwrap_or(&fresh), source).await?;
        if watch.status == StatusCode::TOO_MANY_REQUESTS {
            return Ok((watch, i));
        }
        anyhow::ensure!(watch.status == StatusCode::OK, "{}", watch.status);
        drop(watch);
    }
    anyhow::bail!("200 watches opened and cancelled at once, and the relay never said 429")
}

/// One principal that opens watches and drops them at once gets 429 with Retry-After once past its
/// early-cancellation burst; another principal from the same address still gets its watch and GETs. On the
/// old main nothing counted cancellations (the 200 cancels all went through, and each reached the agent).
#[tokio::test]
async fn early_cancellations_of_one_principal_get_429_and_nobody_else_notices() -> anyhow::Result<()>
{
    let dir = tempfile::tempdir()?;
    let mut config = tether_relay::Config::new(dir.path().to_path_buf());
    config.limits.principal_early_cancel_burst = 5;
    config.limits.principal_early_cancel_rate = 1;
    // Long enough that a loaded test machine still drops the watches "early".
    config.limits.early_cancel_window = Duration::from_secs(60);
    let relay = TestRelay::start_with(config).await?;
    let _agent = Agent::connect(&relay, "edge").await?;
    let client = relay.client()?;

    let (mut refused, answered) = cancel_until_refused(&client, Some("rude"), None).await?;
    assert!(answered >= 5, "refused after only {answered} cancellations");
    assert!(retry_after(&refused.headers).is_some());
    let message = refused.message().await?;
    assert!(
        message.contains("early cancellations of this client"),
        "{message}"
    );

    let polite = Watch::open(&client, "polite", None).await?;
    assert_eq!(polite.status, StatusCode::OK);
    let mut h2 = H2::open(&client, None).await?;
    let status = h2
        .get(&client, "/clusters/edge/api/v1/pods", "polite")
        .await?;
    assert_eq!(status, StatusCode::OK);
    drop((polite, h2));
    relay.stop().await
}

/// The same by address: a new token per request does not escape the bound of its source IP; another address
/// is unaffected.
#[tokio::test]
async fn early_cancellations_from_one_address_get_429_and_other_addresses_do_not_notice()
-> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let mut config = tether_relay::Config::new(dir.path().to_path_buf());
    config.limits.ip_early_cancel_burst = 5;
    config.limits.ip_early_cancel_rate = 1;
    config.limits.early_cancel_window = Duration::from_secs(60);
    let relay = TestRelay::start_with(config).await?;
    let _agent = Agent::connect(&relay, "edge").await?;
    let client = relay.client()?;

    let (mut refused, answered) = cancel_until_refused(&client, None, None).await?;
    assert!(answered >= 5, "refused after only {answered} cancellations");
    assert!(retry_after(&refused.headers).is_some());
    let message = refused.message().await?;
    assert!(
        message.contains("early cancellations from this address"),
        "{message}"
    );

    let other = Watch::open(&client, "elsewhere", Some(OTHER_IP)).await?;
    assert_eq!(other.status, StatusCode::OK);
    drop(other);
    relay.stop().await
}

/// A principal holding its bound of connections gets 429 with Retry-After on a new one, which is then closed
/// (HTTP/1.1); another principal is unaffected; one HTTP/2 connection counts once however many requests it
/// carries; a connection that ends gives its slot back. On the old main connections were not counted.
#[tokio::test]
async fn connections_per_principal_are_bounded() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let mut config = tether_relay::Config::new(dir.path().to_path_buf());
    config.limits.max_connections_per_principal = 2;
    let relay = TestRelay::start_with(config).await?;
    let _agent = Agent::connect(&relay, "edge").await?;
    let client = relay.client()?;

    let mut held = Vec::new();
    for _ in 0..2 {
        let w = Watch::open(&client, "greedy", None).await?;
        assert_eq!(w.status, StatusCode::OK);
        held.push(w);
    }
    let mut third = Watch::open(&client, "greedy", None).await?;
    assert_eq!(third.status, StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(retry_after(&third.headers), Some("1"));
    assert_eq!(
        third
            .headers
            .get("connection")
            .and_then(|v| v.to_str().ok()),
        Some("close")
    );
    let message = third.message().await?;
    assert!(
        message.contains("concurrent connections of this client"),
        "{message}"
    );
    third.closed().await?;

    let other = Watch::open(&client, "other", None).await?;
    assert_eq!(other.status, StatusCode::OK);
    let mut h2 = H2::open(&client, None).await?;
    for _ in 0..5 {
        let status = h2
            .get(&client, "/clusters/edge/api/v1/pods", "many")
            .await?;
        assert_eq!(status, StatusCode::OK);
    }
    let (status, _many_watch) = h2.watch(&client, "many").await?;
    assert_eq!(status, StatusCode::OK);

    held.pop();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    loop {
        let w = Watch::open(&client, "greedy", None).await?;
        if w.status == StatusCode::OK {
            held.push(w);
            break;
        }
        anyhow::ensure!(
            tokio::time::Instant::now() < deadline,
            "the closed connection's slot never came back"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    drop((held, other, h2));
    relay.stop().await
}

/// Opens user connections from `source` until `want` are held (each proven served by a `/healthz`), waiting
/// for slots that earlier short-lived connections still hold. Bounded.
async fn hold_connections(
    client: &Client,
    source: Option<IpAddr>,
    want: usize,
) -> anyhow::Result<Vec<H2>> {
    let mut held = Vec::new();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    while held.len() < want {
        anyhow::ensure!(
            tokio::time::Instant::now() < deadline,
            "could hold only {} connections",
            held.len()
        );
        let Ok(mut conn) = H2::open(client, source).await else {
            tokio::time::sleep(Duration::from_millis(20)).await;
            continue;
        };
        match conn.get(client, "/healthz", "x").await {
            Ok(StatusCode::OK) => held.push(conn),
            _ => tokio::time::sleep(Duration::from_millis(20)).await,
        }
    }
    Ok(held)
}

/// Whether a new connection from `source` is served (a `/healthz` answered).
async fn served(client: &Client, source: Option<IpAddr>) -> bool {
    let Ok(mut conn) = H2::open(client, source).await else {
        return false;
    };
    matches!(conn.get(client, "/healthz", "x").await, Ok(StatusCode::OK))
}

/// One address at its bound of connections: its next connection is closed at accept, another address is
/// served, and a freed slot comes back. Silent connections (no ClientHello) from one address cannot take more
/// than its share of the handshake slots. On the old main neither was bounded.
#[tokio::test]
async fn connections_and_handshakes_per_address_are_bounded() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let mut config = tether_relay::Config::new(dir.path().to_path_buf());
    config.limits.max_connections_per_ip = 3;
    config.limits.max_handshakes_per_ip = 2;
    config.limits.max_handshakes = 3;
    // Far longer than the test's deadlines: only a freed slot can let a waiting connection through in time.
    config.limits.tls_handshake_timeout = Duration::from_secs(120);
    let relay = TestRelay::start_with(config).await?;
    let client = relay.client()?;

    let mut held = hold_connections(&client, None, 3).await?;
    assert!(!served(&client, None).await, "a 4th connection was served");
    assert!(served(&client, Some(OTHER_IP)).await);
    held.pop();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    while !served(&client, None).await {
        anyhow::ensure!(
            tokio::time::Instant::now() < deadline,
            "the closed connection's slot never came back"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    drop(held);

    // Two connections from 127.0.0.4 that never start their handshake hold that address's two handshake
    // slots and two of the three global ones; a third from it waits for its address's turn without a global
    // slot...
    let silent_ip: IpAddr = [127, 0, 0, 4].into();
    let mut silent = Vec::new();
    for _ in 0..2 {
        silent.push(client.tcp_from(silent_ip).await?);
    }
    let third = client.tcp_from(silent_ip).await?;
    let waiting = tokio::spawn({
        let client = client.clone();
        async move {
            let io = TokioIo::new(client.tls_over(third, b"h2").await?);
            let (sender, conn) =
                hyper::client::conn::http2::handshake(TokioExecutor::new(), io).await?;
            let mut h2 = H2 {
                sender,
                conn: tokio::spawn(conn),
            };
            h2.get(&client, "/healthz", "x").await
        }
    });
    // ...so another address gets the last global slot long before the silent ones time out...
    let other: IpAddr = [127, 0, 0, 3].into();
    let elsewhere =
        tokio::time::timeout(Duration::from_secs(20), served(&client, Some(other))).await;
    assert_eq!(elsewhere.ok(), Some(true), "another address was not served");
    assert!(
        !waiting.is_finished(),
        "served before its address had a handshake slot"
    );
    // ...and the waiting one is served as soon as its address's slots come back.
    drop(silent);
    let status = tokio::time::timeout(Duration::from_secs(20), waiting).await???;
    assert_eq!(status, StatusCode::OK);
    relay.stop().await
}

/// With a short `--user-idle-timeout`, an idle HTTP/1.1 keep-alive connection is closed and an idle HTTP/2
/// connection gets GOAWAY and closes; connections carrying a watch (HTTP/1.1 and HTTP/2) stay open and usable.
/// On the old main idle connections were never closed.
#[tokio::test]
async fn idle_user_connections_are_closed_and_watches_are_not() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let mut config = tether_relay::Config::new(dir.path().to_path_buf());
    let idle = Duration::from_millis(500);
    config.limits.user_idle_timeout = idle;
    let relay = TestRelay::start_with(config).await?;
    let _agent = Agent::connect(&relay, "edge").await?;
    let client = relay.client()?;

    let h1_watch = Watch::open(&client, "watcher", None).await?;
    assert_eq!(h1_watch.status, StatusCode::OK);
    let mut h2_watching = H2::open(&client, None).await?;
    let (status, _h2_watch) = h2_watching.watch(&client, "watcher").await?;
    assert_eq!(status, StatusCode::OK);

    // Idle after one request each.
    let io = TokioIo::new(client.raw_tls(b"http/1.1").await?);
    let (mut sender, conn) = hyper::client::conn::http1::handshake(io).await?;
    let mut h1_idle = tokio::spawn(conn);
    let req = client
        .request(false, Method::GET, "/clusters/edge/api/v1/pods")
        .header("authorization", "Bearer idler")
        .body(Full::<Bytes>::default())?;
    let resp = sender.send_request(req).await?;
    assert_eq!(resp.status(), StatusCode::OK);
    resp.into_body().collect().await?;
    let mut h2_idle = H2::open(&client, None).await?;
    let status = h2_idle
        .get(&client, "/clusters/edge/api/v1/pods", "idler")
        .await?;
    assert_eq!(status, StatusCode::OK);

    tokio::time::timeout(Duration::from_secs(20), &mut h1_idle)
        .await
        .map_err(|_| anyhow::anyhow!("the idle HTTP/1.1 connection was not closed"))?
        .ok();
    tokio::time::timeout(Duration::from_secs(20), &mut h2_idle.conn)
        .await
        .map_err(|_| anyhow::anyhow!("the idle HTTP/2 connection was not closed"))?
        .ok();
    // The watches were open at least as long as the idle connections were idle; give their connections'
    // idle checks another two rounds, then they must still be open and usable.
    tokio::time::sleep(idle * 2).await;
    assert!(
        !h1_watch.conn.is_finished(),
        "the HTTP/1.1 watch's connection was closed"
    );
    assert!(
        !h2_watching.is_closed(),
        "the HTTP/2 watch's connection was closed"
    );
    let status = h2_watching
        .get(&client, "/clusters/edge/api/v1/pods", "watcher")
        .await?;
    assert_eq!(status, StatusCode::OK);
    drop((h1_watch, h2_watching, sender));
    relay.stop().await
}

/// Idle user connections fill the user budget (`--max-connections`): a further user connection is refused,
/// yet the agent connects, and reconnects, on its own budget. On the old main the one budget was shared and
/// the agent's connection waited in the backlog for as long as the users stayed.
#[tokio::test]
async fn agents_connect_while_idle_users_fill_the_user_budget() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let mut config = tether_relay::Config::new(dir.path().to_path_buf());
    config.limits.max_connections = 3;
    let relay = TestRelay::start_with(config).await?;
    let identity = relay.admin()?.onboarded("edge").await?;
    let client = relay.client()?;

    let held = hold_connections(&client, None, 3).await?;
    assert!(
        !served(&client, None).await,
        "a user connection past the budget was served"
    );
    assert!(
        !served(&client, Some(OTHER_IP)).await,
        "the user budget is not per address"
    );
    for attempt in 0..2 {
        let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
        let conn = loop {
            match tokio::time::timeout(Duration::from_secs(10), dial(&relay, &identity)).await {
                Ok(Ok(conn)) => break conn,
                other => {
                    // A reconnect may race the relay noticing that the previous tunnel is gone.
                    anyhow::ensure!(
                        tokio::time::Instant::now() < deadline,
                        "attempt {attempt}: the agent could not connect: {:?}",
                        other.map(|r| r.err())
                    );
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
            }
        };
        conn.close(tether_tunnel::code::SHUTDOWN, "test reconnects");
    }
    drop(held);
    relay.stop().await
}

/// Issue 17 item 5: with every default, one principal holds 1,000 watches to one cluster over HTTP/1.1 (one
/// connection each, opened 100 at a time from one address), and then still gets an ordinary GET through.
#[tokio::test]
async fn one_principal_holds_a_thousand_watches_with_the_defaults() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let relay = TestRelay::start(dir.path()).await?;
    let _agent = Agent::connect(&relay, "edge").await?;
    let client = relay.client()?;

    let mut watches = Vec::new();
    let mut opening = tokio::task::JoinSet::new();
    for _ in 0..1_000 {
        if opening.len() >= 100
            && let Some(opened) = opening.join_next().await
        {
            watches.push(opened??);
        }
        let client = client.clone();
        opening.spawn(async move { Watch::open(&client, "controller", None).await });
    }
    while let Some(opened) = opening.join_next().await {
        watches.push(opened??);
    }
    let refused: Vec<_> = watches
        .iter()
        .filter(|w| w.status != StatusCode::OK)
        .map(|w| w.status)
        .collect();
    assert!(
        refused.is_empty(),
        "{} of 1,000 refused: {refused:?}",
        refused.len()
    );
    let mut h2 = H2::open(&client, None).await?;
    let status = h2
        .get(&client, "/clusters/edge/api/v1/pods", "controller")
        .await?;
    assert_eq!(status, StatusCode::OK);
    drop((watches, h2));
    relay.stop().await
}

/// Issue 17 item 5: with the relay's defaults, one tunnel carries 10,000 concurrent watches (the agent
/// advertises 16,384 streams, as `cluster-agent`'s `TUNNEL_MAX_STREAMS`): 10 principals, 1,000 each on one
/// HTTP/2 connection, from 4 addresses; nothing at the relay caps a tunnel below that.
#[tokio::test]
async fn one_tunnel_carries_ten_thousand_watches_with_the_defaults() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let relay = TestRelay::start(dir.path()).await?;
    let identity = relay.admin()?.onboarded("edge").await?;
    let tls = common::agent_tls(&relay, Some(&identity), &[b"http/1.1"])?;
    let mut headers = HeaderMap::new();
    headers.insert("tether-cluster", http::HeaderValue::from_static("edge"));
    let mut session = tether_tunnel::SessionConfig::new(tether_tunnel::Role::Client);
    session.max_concurrent_streams = 16_384;
    let conn = tether_tunnel::ws::connect(&relay.tunnel_url(), tls, headers, session).await?;
    serve_streams(conn.clone());
    relay.admin()?.wait_connected("edge", true).await?;
    let client = relay.client()?;

    let mut principals = tokio::task::JoinSet::new();
    for p in 0..10u8 {
        let client = client.clone();
        principals.spawn(async move {
            let source = IpAddr::from([127, 0, 0, 1 + p % 4]);
            let mut h2 = H2::open(&client, Some(source)).await?;
            let token = format!("controller-{p}");
            let mut held = Vec::new();
            for _ in 0..1_000 {
                let (status, body) = h2.watch(&client, &token).await?;
                anyhow::ensure!(status == StatusCode::OK, "principal {p}: {status}");
                held.push(body);
            }
            Ok::<_, anyhow::Error>((h2, held))
        });
    }
    let mut all = Vec::new();
    while let Some(done) = principals.join_next().await {
        all.push(done??);
    }
    let open: usize = all.iter().map(|(_, held)| held.len()).sum();
    assert_eq!(open, 10_000);
    let mut h2 = H2::open(&client, None).await?;
    let status = h2
        .get(&client, "/clusters/edge/api/v1/pods", "someone-else")
        .await?;
    assert_eq!(status, StatusCode::OK);
    drop((all, h2, conn));
    relay.stop().await
}
