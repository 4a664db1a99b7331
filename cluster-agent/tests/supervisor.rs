//! The tunnel supervisor against the stand-in relay acting as a relay fleet behind one load balancer (each
//! tunnel "held" by a replica id, named in its `welcome` with the fleet's size): K tunnels on distinct
//! replicas, a duplicate replica closed and redialled, K capped at the replicas the relay reports, losing one
//! tunnel without disturbing the other, make-before-break when a replica drains, and the identity renewed
//! once then every other tunnel moved onto it — with a client running GETs throughout that must see no
//! failure.
//!
//! The client stands in for the relay's forwarding: it opens each request on the newest tunnel the agent
//! still takes streams on, and a request the agent refuses with SHUTDOWN (its GOAWAY crossed the request) is
//! sent again on another tunnel, as the protocol says such a stream may be ("retryable elsewhere").

mod common;

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::Duration;

use anyhow::{Context as _, Result, ensure};
use bytes::Bytes;
use common::harness::{DEADLINE, Env, Running, env, http_stream, user_get};
use common::relay::{RelayState, TunnelRecord, pem_fingerprint};
use http::StatusCode;
use http_body_util::BodyExt;
use hyper_util::rt::TokioIo;
use tether_api::control::{Draining, Message};
use tether_tunnel::{TunnelError, code};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// What the GET client saw.
#[derive(Default)]
struct Tally {
    ok: AtomicUsize,
    failed: AtomicUsize,
    /// Requests refused by a tunnel going away and sent again on another.
    retried: AtomicUsize,
    /// Every failure, for the assertion message.
    errors: std::sync::Mutex<Vec<String>>,
}

impl Tally {
    fn fail(&self, error: String) {
        self.failed.fetch_add(1, Ordering::SeqCst);
        if let Ok(mut e) = self.errors.lock() {
            e.push(error);
        }
    }
}

/// One GET as the relay would send it: on the newest tunnel still taking streams, again on another when the
/// agent refuses it because that tunnel is going away.
async fn get(relay: &RelayState, path: &str, tally: &Tally) -> Result<(), String> {
    let mut tried: Vec<usize> = Vec::new();
    for _ in 0..4 {
        let records = relay.tunnel_records();
        let Some((index, record)) = records
            .iter()
            .enumerate()
            .rev()
            .find(|(i, r)| r.live() && !tried.contains(i))
        else {
            return Err("no tunnel to send on".to_owned());
        };
        tried.push(index);
        let stream = match http_stream(&record.conn) {
            Ok(stream) => stream,
            // Closed between the choice and the open (the test closed it, or it just drained).
            Err(TunnelError::Closed(_)) => continue,
            Err(e) => return Err(format!("open: {e}")),
        };
        let control = stream.control();
        match control.accepted().await {
            Ok(_) => {}
            // The agent's GOAWAY crossed the OPEN: refused (or, once queued, reset) with SHUTDOWN, which
            // means "not served, retry elsewhere".
            Err(TunnelError::Refused {
                code: code::SHUTDOWN,
                ..
            })
            | Err(TunnelError::Reset(code::SHUTDOWN))
            | Err(TunnelError::Closed(_)) => {
                tally.retried.fetch_add(1, Ordering::SeqCst);
                continue;
            }
            Err(e) => return Err(format!("stream refused: {e}")),
        }
        let (mut sender, connection) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
            .await
            .map_err(|e| format!("handshake: {e}"))?;
        tokio::spawn(connection);
        let resp = tokio::time::timeout(
            DEADLINE,
            sender.send_request(user_get(path).map_err(|e| e.to_string())?),
        )
        .await
        .map_err(|_| "no answer".to_owned())?
        .map_err(|e| format!("request: {e}"))?;
        let status = resp.status();
        let body = resp
            .into_body()
            .collect()
            .await
            .map_err(|e| format!("body: {e}"))?;
        if status != StatusCode::OK {
            return Err(format!(
                "{status}: {}",
                String::from_utf8_lossy(&body.to_bytes())
            ));
        }
        return Ok(());
    }
    Err("refused on every tunnel".to_owned())
}

/// GETs one after another until `stop` is set.
fn run_gets(
    relay: Arc<RelayState>,
    tally: Arc<Tally>,
    stop: Arc<AtomicBool>,
) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        while !stop.load(Ordering::SeqCst) {
            match get(&relay, "/api/v1/namespaces/default/pods", &tally).await {
                Ok(()) => tally.ok.fetch_add(1, Ordering::SeqCst),
                Err(e) => {
                    tally.fail(e);
                    // A failing client does not spin.
                    tokio::time::sleep(Duration::from_millis(20)).await;
                    0
                }
            };
        }
    })
}

/// Waits until the tunnels the agent still uses sit on exactly `want` (sorted).
async fn live_replicas(relay: &RelayState, want: &[&str]) -> Result<()> {
    let want: Vec<String> = want.iter().map(|s| (*s).to_owned()).collect();
    tether_testkit::wait::until(
        "the agent's tunnels on the wanted replicas",
        DEADLINE,
        || {
            let live = relay.live_replicas();
            let matches = live == want;
            async move { matches }
        },
    )
    .await
    .with_context(|| format!("live tunnels: {:?}", relay.live_replicas()))
}

/// The environment and its relay's state (which the GET client shares).
struct Fleet {
    env: Env,
    relay: Arc<RelayState>,
}

async fn fleet(ids: &[&str], plan: &[&str]) -> Result<Fleet> {
    let env = env(Some("onb-1")).await?;
    env.relay.set_replicas(ids, plan);
    env.relay.state.heartbeat_seconds.store(1, Ordering::SeqCst);
    let relay = env.relay.state.clone();
    Ok(Fleet { env, relay })
}

/// A loopback address with a port free a moment ago.
fn free_addr() -> Result<SocketAddr> {
    let listener = std::net::TcpListener::bind("127.0.0.1:0")?;
    Ok(listener.local_addr()?)
}

/// `GET path` on the probe port: status and body.
async fn probe(addr: SocketAddr, path: &str) -> Result<(u16, String)> {
    let mut tcp = tokio::net::TcpStream::connect(addr).await?;
    tcp.write_all(
        format!("GET {path} HTTP/1.1\r\nhost: probe\r\nconnection: close\r\n\r\n").as_bytes(),
    )
    .await?;
    let mut reply = Vec::new();
    tokio::time::timeout(DEADLINE, tcp.read_to_end(&mut reply)).await??;
    let text = String::from_utf8_lossy(&reply).into_owned();
    let status = text
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .context("no status")?;
    let body = text.split("\r\n\r\n").nth(1).unwrap_or_default().to_owned();
    Ok((status, body))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn k_tunnels_land_on_distinct_replicas_and_losing_one_disturbs_no_other() -> Result<()> {
    // The load balancer sends the first two tunnels to r1: the second is a duplicate.
    let Fleet { mut env, relay } = fleet(&["r1", "r2"], &["r1", "r1", "r2"]).await?;
    let probes = free_addr()?;
    let mut config = env.config(Some("onb-1"));
    config.tunnels = 2;
    config.health_listen = Some(probes);
    let mut agent = Running::start(config);

    live_replicas(&relay, &["r1", "r2"]).await?;
    let records = relay.tunnel_records();
    ensure!(
        records.len() == 3,
        "three tunnels: r1, the duplicate r1, r2"
    );
    ensure!(
        !records[1].live() && records[1].replica == "r1",
        "the duplicate on r1 was closed by the agent"
    );
    // Each tunnel has its own control channel; all say the same instance and K = 2.
    let mut hellos = Vec::new();
    while hellos.len() < 3 {
        hellos.push(
            env.next_message(|m| match m {
                Message::Hello(h) => Some(h),
                _ => None,
            })
            .await?,
        );
    }
    ensure!(!hellos[0].instance.is_empty(), "{hellos:?}");
    ensure!(
        hellos.iter().all(|h| h.instance == hellos[0].instance),
        "{hellos:?}"
    );
    ensure!(hellos.iter().all(|h| h.tunnels == 2), "{hellos:?}");
    // The relay shows both tunnels a moment before the agent has counted the second one's welcome.
    tether_testkit::wait::until("/readyz counting both tunnels", DEADLINE, || async {
        probe(probes, "/readyz")
            .await
            .is_ok_and(|(status, body)| status == 200 && body.contains("2 tunnel(s) up"))
    })
    .await?;
    let (_, metrics) = probe(probes, "/metrics").await?;
    ensure!(
        metrics.contains("tether_agent_tunnels{transport=\"wss\"} 2"),
        "{metrics}"
    );

    // A long-running exchange (an exec-like byte pipe) on r1's tunnel.
    let r1 = live_record(&relay, "r1")?;
    let mut pipe = open_pipe(&r1).await?;
    pipe.write_all(b"one;").await?;

    // r2's tunnel is lost: the agent dials again (r1 first, a duplicate, then r2) and r1's is untouched.
    // (A request in flight on the lost tunnel is lost with it; GETs start once it is gone.)
    let r2 = live_record(&relay, "r2")?;
    env.relay.set_replicas(&["r1", "r2"], &["r1"]);
    r2.conn.close(code::NO_ERROR, "replica r2 lost this tunnel");
    let tally = Arc::new(Tally::default());
    let stop = Arc::new(AtomicBool::new(false));
    let gets = run_gets(relay.clone(), tally.clone(), stop.clone());
    let (status, _) = probe(probes, "/readyz").await?;
    ensure!(status == 200, "ready with one tunnel of two: {status}");
    pipe.write_all(b"two;").await?;
    tether_testkit::wait::until("the agent back on r1 and r2", DEADLINE, || {
        let records = relay.tunnel_records();
        let back = relay.live_replicas() == ["r1", "r2"] && records.len() >= 5;
        async move { back }
    })
    .await
    .with_context(|| format!("live: {:?}", relay.live_replicas()))?;
    ensure!(r1.live(), "r1's tunnel must not be touched");
    pipe.write_all(b"three").await?;
    ensure!(finish_pipe(pipe).await? == "bye:one;two;three");

    stop.store(true, Ordering::SeqCst);
    gets.await?;
    report(&tally, "k tunnels");
    agent.shutdown();
    agent.finished().await??;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn k_is_capped_at_the_replicas_the_relay_reports() -> Result<()> {
    // A relay that reports one replica: one tunnel, whatever K.
    let Fleet { mut env, relay } = fleet(&["only"], &[]).await?;
    let mut config = env.config(Some("onb-1"));
    config.tunnels = 3;
    let mut agent = Running::start(config);
    live_replicas(&relay, &["only"]).await?;
    // Two heartbeats later (1 s apart) the agent has still opened no second tunnel; it dials at once
    // when it wants one, so the first heartbeat already follows any second dial.
    for _ in 0..2 {
        env.next_message(|m| matches!(m, Message::Heartbeat(_)).then_some(()))
            .await?;
    }
    ensure!(
        env.relay.state.tunnel_attempts.load(Ordering::SeqCst) == 1,
        "a second tunnel was opened: {}",
        env.relay.state.tunnel_attempts.load(Ordering::SeqCst)
    );
    agent.shutdown();
    agent.finished().await??;

    // A relay without a fleet (no replica in welcome): one tunnel too.
    let mut env = common::harness::env(Some("onb-2")).await?;
    env.relay.state.heartbeat_seconds.store(1, Ordering::SeqCst);
    let mut config = env.config(Some("onb-2"));
    config.tunnels = 2;
    let mut agent = Running::start(config);
    let _conn = env.next_tunnel().await?;
    for _ in 0..2 {
        env.next_message(|m| matches!(m, Message::Heartbeat(_)).then_some(()))
            .await?;
    }
    ensure!(env.relay.state.tunnel_attempts.load(Ordering::SeqCst) == 1);
    agent.shutdown();
    agent.finished().await??;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_draining_replica_is_left_make_before_break_without_a_failed_request() -> Result<()> {
    let Fleet { env, relay } = fleet(&["r1", "r2"], &["r1"]).await?;
    let mut config = env.config(Some("onb-1"));
    config.tunnels = 1;
    let mut agent = Running::start(config);
    live_replicas(&relay, &["r1"]).await?;
    let old = live_record(&relay, "r1")?;

    // A long-running exchange (an exec-like byte pipe) open on the old tunnel, and GETs throughout.
    let mut pipe = open_pipe(&old).await?;
    pipe.write_all(b"before;").await?;
    let tally = Arc::new(Tally::default());
    let stop = Arc::new(AtomicBool::new(false));
    let gets = run_gets(relay.clone(), tally.clone(), stop.clone());
    tether_testkit::wait::until("GETs flowing", DEADLINE, || {
        let n = tally.ok.load(Ordering::SeqCst);
        async move { n >= 20 }
    })
    .await?;

    // r1 drains: out of the load balancer, and it asks its agents to move, new tunnel first.
    env.relay.drain_replica("r1");
    env.relay.send_to_replica(
        "r1",
        Message::Draining(Draining {
            reconnect_within_ms: 60_000,
            make_before_break: true,
        }),
    );
    // The agent opens its replacement on r2 and only then sends GOAWAY on the old tunnel, which the relay
    // kept serving meanwhile.
    live_replicas(&relay, &["r2"]).await?;
    ensure!(
        !old.conn.is_closed(),
        "the old tunnel lets its streams finish"
    );
    let ok_at_move = tally.ok.load(Ordering::SeqCst);
    tether_testkit::wait::until("GETs on the new tunnel", DEADLINE, || {
        let n = tally.ok.load(Ordering::SeqCst);
        async move { n >= ok_at_move + 20 }
    })
    .await?;
    // The exchange open on the old tunnel runs to its end.
    pipe.write_all(b"after").await?;
    ensure!(finish_pipe(pipe).await? == "bye:before;after");
    // With its last stream done, the old tunnel closes.
    tokio::time::timeout(DEADLINE, old.conn.closed()).await?;

    stop.store(true, Ordering::SeqCst);
    gets.await?;
    report(&tally, "drain");
    ensure!(
        env.relay.state.tunnel_attempts.load(Ordering::SeqCst) == 2,
        "one replacement, no redial"
    );
    agent.shutdown();
    agent.finished().await??;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_identity_is_renewed_once_then_the_other_tunnel_moves_onto_it() -> Result<()> {
    let Fleet { mut env, relay } = fleet(&["r1", "r2"], &["r1", "r2"]).await?;
    if let Ok(mut v) = env.relay.state.validity.lock() {
        *v = time::Duration::seconds(12);
    }
    let mut config = env.config(Some("onb-1"));
    config.tunnels = 2;
    let mut agent = Running::start(config);
    live_replicas(&relay, &["r1", "r2"]).await?;
    let first: Vec<TunnelRecord> = relay.tunnel_records();
    let old_fingerprint = first[0].presented.clone().context("no certificate")?;
    ensure!(first[1].presented.as_deref() == Some(old_fingerprint.as_str()));

    let tally = Arc::new(Tally::default());
    let stop = Arc::new(AtomicBool::new(false));
    let gets = run_gets(relay.clone(), tally.clone(), stop.clone());

    // One renewal, on one of the two control channels (both were due at the same time).
    env.next_message(|m| matches!(m, Message::Renew(_)).then_some(()))
        .await?;
    let state_dir = env.state_dir();
    let renewed = common::eventually(DEADLINE, || {
        stored_fingerprint(&state_dir).filter(|fp| *fp != old_fingerprint)
    })
    .await?;
    // The other tunnel moves: a new tunnel presenting the new certificate, then GOAWAY on the old one.
    tether_testkit::wait::until("the other tunnel on the new certificate", DEADLINE, || {
        // Live: the renewing tunnel (opened with the old certificate, renewed in band) and the moved one.
        let live: Vec<TunnelRecord> = relay
            .tunnel_records()
            .into_iter()
            .filter(TunnelRecord::live)
            .collect();
        let moved = live.len() == 2
            && live
                .iter()
                .filter(|r| r.presented.as_deref() == Some(renewed.as_str()))
                .count()
                == 1
            && relay.live_replicas() == ["r1", "r2"];
        async move { moved }
    })
    .await
    .with_context(|| format!("live: {:?}", relay.live_replicas()))?;
    let records = relay.tunnel_records();
    let kept = records[..2].iter().filter(|r| r.live()).count();
    ensure!(
        kept == 1,
        "the renewing tunnel stays, the other moved: {kept}"
    );
    ensure!(
        env.relay.state.renew_requests.load(Ordering::SeqCst) == 1,
        "renewed once, not per tunnel"
    );
    stop.store(true, Ordering::SeqCst);
    gets.await?;
    report(&tally, "renewal");
    agent.shutdown();
    agent.finished().await??;
    Ok(())
}

fn live_record(relay: &RelayState, replica: &str) -> Result<TunnelRecord> {
    relay
        .tunnel_records()
        .into_iter()
        .rev()
        .find(|r| r.live() && r.replica == replica)
        .with_context(|| format!("no live tunnel on {replica}"))
}

/// An upgraded exchange on `record`'s tunnel (the test apiserver's `/upgrade`: it answers `bye:` and what it
/// read once its input ends), as exec or port-forward would hold one open.
async fn open_pipe(record: &TunnelRecord) -> Result<TokioIo<hyper::upgrade::Upgraded>> {
    let stream = http_stream(&record.conn)?;
    let (mut sender, connection) =
        hyper::client::conn::http1::handshake(TokioIo::new(stream)).await?;
    tokio::spawn(connection.with_upgrades());
    let req = http::Request::get("/upgrade")
        .header("connection", "Upgrade")
        .header("upgrade", "tether-test")
        .header("authorization", "Bearer user-token")
        .body(http_body_util::Empty::<Bytes>::new())?;
    let mut resp = tokio::time::timeout(DEADLINE, sender.send_request(req)).await??;
    ensure!(resp.status() == StatusCode::SWITCHING_PROTOCOLS);
    Ok(TokioIo::new(hyper::upgrade::on(&mut resp).await?))
}

/// Ends the pipe's input and reads the answer to its end.
async fn finish_pipe(mut pipe: TokioIo<hyper::upgrade::Upgraded>) -> Result<String> {
    pipe.shutdown().await?;
    let mut reply = Vec::new();
    tokio::time::timeout(DEADLINE, pipe.read_to_end(&mut reply)).await??;
    Ok(String::from_utf8_lossy(&reply).into_owned())
}

fn stored_fingerprint(state_dir: &std::path::Path) -> Option<String> {
    let text = std::fs::read(state_dir.join("identity.json")).ok()?;
    let json: serde_json::Value = serde_json::from_slice(&text).ok()?;
    pem_fingerprint(json["certificate"].as_str()?)
}

fn report(tally: &Tally, what: &str) {
    let (ok, failed, retried) = (
        tally.ok.load(Ordering::SeqCst),
        tally.failed.load(Ordering::SeqCst),
        tally.retried.load(Ordering::SeqCst),
    );
    println!(
        "{what}: {ok} GETs answered, {failed} failed, {retried} sent again after a GOAWAY crossed them"
    );
    let errors = tally.errors.lock().map(|e| e.clone()).unwrap_or_default();
    assert_eq!(failed, 0, "failed GETs: {errors:?}");
    assert!(ok > 0);
}
