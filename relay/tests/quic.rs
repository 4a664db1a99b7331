//! The relay's QUIC listener: agents tunnel over UDP on the HTTPS port number, authenticated exactly as over
//! WebSocket; the API shows each tunnel's transport and round trip; unauthenticated handshakes are bounded
//! in number and in time (the attack: clients that finish the QUIC handshake and never say HELLO).

mod common;

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use anyhow::anyhow;
use bytes::Bytes;
use common::{AgentIdentity, TestRelay, agent_tls};
use http::{HeaderMap, HeaderValue, Response, StatusCode};
use http_body_util::Full;
use hyper::service::service_fn;
use hyper_util::rt::TokioIo;
use tether_tunnel::quic::{self, QuicError};
use tether_tunnel::{Connection, Role, SessionConfig, code, kind};

fn headers(cluster: &str) -> anyhow::Result<HeaderMap> {
    let mut h = HeaderMap::new();
    h.insert("tether-cluster", HeaderValue::from_str(cluster)?);
    h.insert(
        "tether-agent-version",
        HeaderValue::from_static("0.0.0-test"),
    );
    Ok(h)
}

fn session() -> SessionConfig {
    let mut s = SessionConfig::new(Role::Client);
    s.handshake_timeout = Duration::from_secs(5);
    s
}

/// Dials the relay's QUIC listener (same port number as HTTPS) as `identity`'s agent, or with no
/// certificate, naming `cluster`.
async fn dial_quic(
    relay: &TestRelay,
    identity: Option<&AgentIdentity>,
    cluster: &str,
) -> anyhow::Result<Result<Connection, QuicError>> {
    let tls = agent_tls(relay, identity, &[])?;
    Ok(quic::connect_addr(relay.addr, "localhost", tls, headers(cluster)?, session()).await)
}

/// Serves every HTTP stream the relay opens with a fixed answer naming the transport.
fn serve_http(conn: &Connection) {
    let c = conn.clone();
    tokio::spawn(async move {
        while let Some(incoming) = c.accept().await {
            if incoming.kind != kind::HTTP {
                incoming.refuse(code::UNSUPPORTED_KIND, "test agent");
                continue;
            }
            let Ok(stream) = incoming.accept(Bytes::new()) else {
                continue;
            };
            tokio::spawn(async move {
                let svc = service_fn(|_req| async {
                    Ok::<_, Infallible>(Response::new(Full::new(Bytes::from_static(b"over quic"))))
                });
                let _ = hyper::server::conn::http1::Builder::new()
                    .serve_connection(TokioIo::new(stream), svc)
                    .await;
            });
        }
    });
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_agent_tunnels_over_quic_and_the_api_shows_the_transport_and_rtt() -> anyhow::Result<()>
{
    let dir = tempfile::tempdir()?;
    let relay = TestRelay::start(dir.path()).await?;
    let admin = relay.admin()?;
    let identity = admin.onboarded("edge").await?;
    let conn = dial_quic(&relay, Some(&identity), "edge").await??;
    assert_eq!(conn.transport(), tether_tunnel::TransportKind::Quic);
    serve_http(&conn);
    let shown = admin.wait_connected("edge", true).await?;
    let tunnels = shown["tunnels"].as_array().cloned().unwrap_or_default();
    assert_eq!(tunnels.len(), 1, "{shown}");
    assert_eq!(tunnels[0]["transport"], "quic", "{shown}");
    assert!(
        tunnels[0]["rttMillis"].as_f64().is_some(),
        "QUIC measures the RTT from the handshake: {shown}"
    );
    assert_eq!(shown["agentVersion"], "0.0.0-test");

    // Forwarding works the same over QUIC.
    let reply = relay
        .client()?
        .get("/clusters/edge/api", Some("user-token"))
        .await?;
    assert_eq!(reply.status, StatusCode::OK, "{reply:?}");
    assert_eq!(&reply.body[..], b"over quic");

    // A WebSocket tunnel of the same cluster joins it (neither displaces the other) and shows as wss.
    let ws = common::dial(&relay, &identity).await?;
    let shown = admin
        .wait_for("edge", "on quic and wss", |v| {
            v["tunnels"].as_array().map(Vec::len) == Some(2)
        })
        .await?;
    let mut transports: Vec<&str> = shown["tunnels"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|t| t["transport"].as_str())
        .collect();
    transports.sort_unstable();
    assert_eq!(transports, ["quic", "wss"], "{shown}");
    assert!(!conn.is_closed(), "the QUIC tunnel was displaced");
    drop(ws);
    relay.stop().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn quic_tunnels_are_authenticated_like_websocket_ones() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let relay = TestRelay::start(dir.path()).await?;
    let admin = relay.admin()?;
    let edge = admin.onboarded("edge").await?;
    admin.onboarded("other").await?;

    // No certificate, another cluster's certificate, a cluster name that is not one: refused with the
    // Status the WebSocket path answers, before any stream.
    let cases: [(Option<&AgentIdentity>, &str, &str); 3] = [
        (None, "edge", "no client certificate"),
        (Some(&edge), "other", "not an identity of cluster other"),
        (Some(&edge), "Not A Label", "must name the cluster"),
    ];
    for (identity, cluster, expect) in cases {
        match dial_quic(&relay, identity, cluster).await? {
            Err(QuicError::Rejected { code: c, reason }) => {
                assert_eq!(c, code::REFUSED, "{reason}");
                let status: serde_json::Value = serde_json::from_str(&reason)?;
                assert_eq!(status["code"], 401, "{status}");
                assert_eq!(status["kind"], "Status", "{status}");
                let message = status["message"].as_str().unwrap_or_default();
                assert!(message.contains(expect), "{expect:?} not in {message:?}");
            }
            other => return Err(anyhow!("{cluster}: expected a refusal, got {other:?}")),
        }
    }
    let shown = admin.show("other").await?.json()?;
    assert_eq!(shown["connected"], false, "{shown}");

    // A deleted cluster's identity is revoked for QUIC too.
    let conn = dial_quic(&relay, Some(&edge), "edge").await??;
    admin.wait_connected("edge", true).await?;
    let deleted = admin.delete("edge").await?;
    assert!(deleted.status.is_success(), "{deleted:?}");
    let closed = tokio::time::timeout(Duration::from_secs(20), conn.closed()).await;
    assert!(
        closed.is_ok(),
        "deleting the cluster did not close its QUIC tunnel"
    );
    match dial_quic(&relay, Some(&edge), "edge").await? {
        Err(QuicError::Rejected { code: c, .. }) => assert_eq!(c, code::REFUSED),
        other => return Err(anyhow!("a revoked identity was not refused: {other:?}")),
    }
    relay.stop().await
}

/// A raw QUIC client that completes the QUIC/TLS handshake with the relay (ALPN tether/1, no client
/// certificate) and then says nothing: it holds one unauthenticated handshake at the relay.
async fn stalled_handshake(
    relay: &TestRelay,
) -> anyhow::Result<(quinn::Endpoint, quinn::Connection)> {
    let mut tls = (*agent_tls(relay, None, &[])?).clone();
    tls.alpn_protocols = vec![quic::ALPN.to_vec()];
    let crypto = quinn::crypto::rustls::QuicClientConfig::try_from(Arc::new(tls))?;
    let client = quinn::ClientConfig::new(Arc::new(crypto));
    let endpoint = quinn::Endpoint::client(SocketAddr::from(([127, 0, 0, 1], 0)))?;
    let conn = endpoint
        .connect_with(client, relay.addr, "localhost")?
        .await?;
    Ok((endpoint, conn))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unauthenticated_quic_handshakes_are_bounded_in_number_and_time() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let mut config = tether_relay::Config::new(dir.path().to_path_buf());
    config.limits.max_quic_handshakes = 2;
    config.limits.tls_handshake_timeout = Duration::from_secs(2);
    let relay = TestRelay::start_with(config).await?;
    let identity = relay.admin()?.onboarded("edge").await?;

    // The attack: two clients finish the QUIC handshake and never send HELLO, filling every slot.
    let attackers = [
        stalled_handshake(&relay).await?,
        stalled_handshake(&relay).await?,
    ];

    // Past the bound a handshake is refused at once rather than queued: the real agent is turned away
    // while the slots are held (it would retry, or use WebSocket).
    match dial_quic(&relay, Some(&identity), "edge").await? {
        Err(QuicError::Handshake(why)) => {
            assert!(why.to_lowercase().contains("refused"), "{why}")
        }
        other => {
            return Err(anyhow!(
                "a handshake past the bound was not refused: {other:?}"
            ));
        }
    }

    // Each stalled handshake is dropped by the relay once its time is up.
    for (_, conn) in &attackers {
        let closed = tokio::time::timeout(Duration::from_secs(20), conn.closed()).await;
        assert!(closed.is_ok(), "a stalled handshake was never dropped");
    }

    // The slots are free again: the agent connects.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    let conn = loop {
        match dial_quic(&relay, Some(&identity), "edge").await? {
            Ok(conn) => break conn,
            Err(e) if tokio::time::Instant::now() < deadline => {
                tracing::debug!(error = %e, "retrying");
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            Err(e) => return Err(anyhow!("the agent could not connect after the attack: {e}")),
        }
    };
    relay.admin()?.wait_connected("edge", true).await?;
    drop(conn);
    drop(attackers);
    relay.stop().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_quic_means_no_udp_listener() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let mut config = tether_relay::Config::new(dir.path().to_path_buf());
    config.no_quic = true;
    let relay = TestRelay::start_with(config).await?;
    let identity = relay.admin()?.onboarded("edge").await?;
    let tls = agent_tls(&relay, Some(&identity), &[])?;
    let mut s = session();
    s.handshake_timeout = Duration::from_secs(1);
    let result = quic::connect_addr(relay.addr, "localhost", tls, headers("edge")?, s).await;
    assert!(result.is_err(), "a QUIC tunnel was accepted with --no-quic");
    // WebSocket still works.
    let ws = common::dial(&relay, &identity).await?;
    relay.admin()?.wait_connected("edge", true).await?;
    drop(ws);
    relay.stop().await
}

/// Opens one HTTP stream (a kind the relay refuses) on `conn`.
fn open_http(conn: &Connection) -> Result<tether_tunnel::Stream, tether_tunnel::TunnelError> {
    conn.open(tether_tunnel::OpenOptions {
        kind: kind::HTTP,
        priority: tether_tunnel::Priority::Normal,
        deadline: Some(Duration::from_secs(10)),
        metadata: Bytes::new(),
    })
}

/// Opens one HTTP stream on `conn` as soon as the relay's stream credit allows it (`what` names the wait).
async fn open_http_when_allowed(
    conn: &Connection,
    what: &str,
) -> anyhow::Result<tether_tunnel::Stream> {
    let stream = tether_testkit::wait::eventually(what, Duration::from_secs(10), || async {
        open_http(conn).ok()
    })
    .await?;
    Ok(stream)
}

/// Opens HTTP streams (a kind the relay refuses) on `conn` without yielding, so no answer can free a slot
/// meanwhile, until the relay's stream limit stops it; returns the streams opened.
fn open_until_refused(conn: &Connection) -> anyhow::Result<Vec<tether_tunnel::Stream>> {
    let mut opened = Vec::new();
    for _ in 0..100 {
        match open_http(conn) {
            Ok(stream) => opened.push(stream),
            Err(tether_tunnel::TunnelError::TooManyStreams) => return Ok(opened),
            Err(e) => anyhow::bail!("opening failed: {e}"),
        }
    }
    anyhow::bail!("the relay let the agent open 100 streams at once")
}

/// The attack: an authenticated agent parks streams at the relay (which serves only its control stream). The
/// relay allows an agent `AGENT_STREAMS` at once over either transport (over QUIC each allowed stream is state
/// quinn keeps per tunnel), refuses what it does not serve, and the tunnel stays usable.
// One thread: nothing runs between the opens, so the count is the relay's limit, not a race with its refusals.
#[tokio::test(flavor = "current_thread")]
async fn an_agent_may_open_only_a_few_streams_at_the_relay_over_either_transport()
-> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let relay = TestRelay::start(dir.path()).await?;
    let identity = relay.admin()?.onboarded("edge").await?;
    let quic = dial_quic(&relay, Some(&identity), "edge").await??;
    let wss = common::dial(&relay, &identity).await?;
    for (name, conn) in [("quic", &quic), ("wss", &wss)] {
        // QUIC raises the agent's stream credit from zero once the tunnel is accepted: wait for it.
        let first = open_http_when_allowed(conn, "stream credit from the relay").await?;
        let more = open_until_refused(conn)?;
        assert_eq!(
            more.len() + 1,
            tether_relay::AGENT_STREAMS as usize,
            "{name}: streams an agent may hold open at the relay"
        );
        match tokio::time::timeout(Duration::from_secs(10), first.control().accepted()).await? {
            Err(tether_tunnel::TunnelError::Refused { code: c, .. }) => {
                assert_eq!(c, code::UNSUPPORTED_KIND, "{name}");
            }
            other => anyhow::bail!("{name}: expected a refusal, got {other:?}"),
        }
        drop((first, more));
        // Refused streams free their slots: the tunnel is still up and may open again.
        drop(open_http_when_allowed(conn, "a slot after the refusals").await?);
        assert!(!conn.is_closed(), "{name}: the tunnel was closed");
    }
    relay.stop().await
}
