//! Simulated agents: many tunnels from one process, each onboarded by the real relay, holding its tunnel idle
//! with the control channel's heartbeats, and reconnecting with the agent's full-jitter backoff.
//!
//! Onboarding sends a CSR: a relay that issues client certificates answers with one (the tunnel then
//! authenticates with mTLS); an older relay ignores the CSR and answers with a bearer credential. Both work.
//!
//! The control channel (a stream of kind CONTROL, `tether_api::control`'s messages) is spoken as the agent
//! speaks it: `hello`, then after the relay's `welcome` a `metadata` and a `health`, then a `heartbeat` and a
//! `health` every interval the welcome names; a relay's `draining` window is kept for the reconnect. When the
//! relay refuses the control stream (a relay without one), the tunnel is held with protocol keepalives only, and
//! [`SimStats::control_refused`] says so.
//!
//! A fleet dials over WebSocket or over QUIC ([`SimTransport`]). Over QUIC each simulated agent binds a UDP
//! socket of its own, as every real agent has one, and keeps the agent's default liveness (a keepalive every
//! second, silence of three seconds ends the tunnel), so the relay carries what 10,000 real QUIC agents cost it.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, RwLock};
use std::time::Duration;

use anyhow::Context as _;
use bytes::Bytes;
use http::{HeaderMap, HeaderValue, StatusCode};
use rand::RngExt as _;
use tether_api::control::{self, Message};
use tether_api::reconnect::{Backoff, DRAINING_WAIT, Reconnect};
use tether_tunnel::quic::{self, QuicError};
use tether_tunnel::ws::{self, ConnectError};
use tether_tunnel::{Connection, OpenOptions, Priority, Role, SessionConfig, code, kind};
use tokio::sync::Semaphore;
use tokio::task::JoinSet;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use crate::certs;
use crate::stats::Timeline;
use crate::tether::RelayProcess;

/// The agent's default `--quic-keepalive`: QUIC tunnels ping every second.
const QUIC_KEEPALIVE: Duration = Duration::from_secs(1);
/// The agent's default `--quic-timeout`.
const QUIC_TIMEOUT: Duration = Duration::from_secs(3);

/// The transport simulated agents dial.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SimTransport {
    /// WebSocket over TLS (TCP).
    Wss,
    /// QUIC, one UDP socket per agent.
    Quic,
}

impl SimTransport {
    /// From the load generator's `--transport` (its first value): WebSocket when none is given. `auto` is
    /// refused: the real agent races both transports, and a simulated one would have to choose for it.
    pub fn from_flag(transport: Option<crate::cli::AgentTransport>) -> anyhow::Result<Self> {
        use crate::cli::AgentTransport;
        match transport {
            None | Some(AgentTransport::Wss) => Ok(Self::Wss),
            Some(AgentTransport::Quic) => Ok(Self::Quic),
            Some(AgentTransport::Auto) => anyhow::bail!(
                "simulated agents dial one transport: give `--transport wss` or `--transport quic`, not auto"
            ),
        }
    }

    /// As on the agent's command line.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Wss => "wss",
            Self::Quic => "quic",
        }
    }
}

/// Why a simulated agent's dial failed.
#[derive(Debug)]
pub enum DialError {
    /// Over WebSocket.
    Wss(ConnectError),
    /// Over QUIC.
    Quic(QuicError),
    /// No tunnel within the fleet's connect timeout.
    TimedOut,
}

impl std::fmt::Display for DialError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Wss(e) => write!(f, "{}", crate::client::error_chain(e)),
            Self::Quic(e) => write!(f, "{}", crate::client::error_chain(e)),
            Self::TimedOut => f.write_str("timed out"),
        }
    }
}

impl DialError {
    /// The HTTP status the relay refused the tunnel with: the WebSocket upgrade's answer, or the Kubernetes
    /// Status in a QUIC refusal's reason.
    fn status(&self) -> Option<StatusCode> {
        match self {
            Self::Wss(ConnectError::Rejected { status, .. }) => Some(*status),
            Self::Quic(QuicError::Rejected { reason, .. }) => {
                tether_api::refusal::status_code(reason).and_then(|c| StatusCode::from_u16(c).ok())
            }
            _ => None,
        }
    }

    /// The relay refused the tunnel (e.g. 503 while it starts).
    fn rejected(&self) -> bool {
        matches!(
            self,
            Self::Wss(ConnectError::Rejected { .. }) | Self::Quic(QuicError::Rejected { .. })
        )
    }

    /// The relay refused the agent's identity: the real agent stops dialling.
    fn identity_refused(&self) -> bool {
        self.status()
            .is_some_and(|s| s == StatusCode::UNAUTHORIZED || s == StatusCode::FORBIDDEN)
    }
}

/// How a simulated agent proves who it is.
#[derive(Clone)]
enum Identity {
    /// `Authorization: Bearer …` (relays before client certificates).
    Bearer(String),
    /// A client certificate issued by the relay's agent CA.
    Certificate,
}

/// One simulated agent, onboarded and ready to dial.
#[derive(Clone)]
pub struct SimAgent {
    /// Its cluster name.
    pub cluster: String,
    tunnel_url: String,
    tls: Arc<rustls::ClientConfig>,
    headers: HeaderMap,
    identity: Identity,
}

impl std::fmt::Debug for SimAgent {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let identity = match self.identity {
            Identity::Bearer(_) => "bearer",
            Identity::Certificate => "certificate",
        };
        f.debug_struct("SimAgent")
            .field("cluster", &self.cluster)
            .field("identity", &identity)
            .finish_non_exhaustive()
    }
}

impl SimAgent {
    /// Onboards `cluster` at `relay` with its one-time `token`.
    pub async fn onboard(relay: &RelayProcess, cluster: &str, token: &str) -> anyhow::Result<Self> {
        let (key_pem, csr_pem) = certs::key_and_csr(cluster)?;
        let answer = relay.onboard(cluster, token, &csr_pem).await?;
        let (identity, tls) = match (
            answer["certificate"].as_str(),
            answer["credential"].as_str(),
        ) {
            (Some(cert), _) => (
                Identity::Certificate,
                certs::client_config(&[&relay.ca_pem], &[], Some((cert, &key_pem)))?,
            ),
            (None, Some(credential)) => (
                Identity::Bearer(credential.to_owned()),
                certs::client_config(&[&relay.ca_pem], &[], None)?,
            ),
            (None, None) => {
                anyhow::bail!("onboarding answer has neither certificate nor credential: {answer}")
            }
        };
        let mut headers = HeaderMap::new();
        headers.insert("tether-cluster", HeaderValue::from_str(cluster)?);
        headers.insert(
            "tether-agent-version",
            HeaderValue::from_static(env!("CARGO_PKG_VERSION")),
        );
        if let Identity::Bearer(credential) = &identity {
            let mut v = HeaderValue::from_str(&format!("Bearer {credential}"))?;
            v.set_sensitive(true);
            headers.insert(http::header::AUTHORIZATION, v);
        }
        Ok(Self {
            cluster: cluster.to_owned(),
            tunnel_url: format!("{}/agent/v1/tunnel", relay.url),
            tls,
            headers,
            identity,
        })
    }

    /// Whether the relay issued a client certificate (mTLS) rather than a bearer credential.
    pub fn uses_certificate(&self) -> bool {
        matches!(self.identity, Identity::Certificate)
    }

    /// Dials the relay over `transport` and opens a tunnel.
    pub async fn connect(&self, transport: SimTransport) -> Result<Connection, DialError> {
        match transport {
            SimTransport::Wss => ws::connect(
                &self.tunnel_url,
                self.tls.clone(),
                self.headers.clone(),
                SessionConfig::new(Role::Client),
            )
            .await
            .map_err(DialError::Wss),
            SimTransport::Quic => {
                let mut session = SessionConfig::new(Role::Client);
                session.keepalive_interval = QUIC_KEEPALIVE;
                session.idle_timeout = QUIC_TIMEOUT;
                quic::connect(
                    &self.tunnel_url,
                    self.tls.clone(),
                    self.headers.clone(),
                    session,
                )
                .await
                .map_err(DialError::Quic)
            }
        }
    }
}

/// Counters shared by many simulated agents.
#[derive(Debug, Default)]
pub struct SimStats {
    /// Tunnels up right now.
    pub connected: AtomicU64,
    /// Successful connects, all time.
    pub connects: AtomicU64,
    /// Failed connect attempts.
    pub connect_errors: AtomicU64,
    /// Connects refused with an HTTP status (e.g. 503 while the relay starts).
    pub rejected: AtomicU64,
    /// Heartbeats sent.
    pub heartbeats: AtomicU64,
    /// Tunnels whose control stream the relay accepted.
    pub control_accepted: AtomicU64,
    /// Tunnels whose control stream the relay refused (a relay without a control channel).
    pub control_refused: AtomicU64,
    /// Tunnels lost (closed by the relay or the network).
    pub disconnects: AtomicU64,
    /// The first distinct connect error seen.
    pub first_error: std::sync::Mutex<Option<String>>,
}

impl SimStats {
    fn note_error(&self, e: &DialError) {
        self.connect_errors.fetch_add(1, Ordering::Relaxed);
        if e.rejected() {
            self.rejected.fetch_add(1, Ordering::Relaxed);
        }
        if let Ok(mut first) = self.first_error.lock()
            && first.is_none()
        {
            *first = Some(e.to_string());
        }
    }

    /// A counter's value.
    pub fn get(counter: &AtomicU64) -> u64 {
        counter.load(Ordering::Relaxed)
    }
}

/// Holds a connected tunnel until it closes or `stop` is cancelled: refuses streams the relay opens, speaks
/// the control channel (heartbeats at the relay's interval, `default_heartbeat` until it names one). Returns
/// the reconnect window of the relay's `draining` message, if it sent one.
pub async fn hold(
    conn: &Connection,
    default_heartbeat: Duration,
    stats: &SimStats,
    stop: &CancellationToken,
) -> Option<Duration> {
    let draining = std::sync::Mutex::new(None);
    let refuser = async {
        while let Some(incoming) = conn.accept().await {
            incoming.refuse(code::UNSUPPORTED_KIND, "simulated agent serves no streams");
        }
    };
    let control = async {
        if control_channel(conn, default_heartbeat, stats, &draining)
            .await
            .is_err()
        {
            // Without a control channel (or after it failed) the tunnel still lives on keepalives.
            std::future::pending::<()>().await;
        }
    };
    tokio::pin!(control);
    tokio::select! {
        _ = conn.closed() => {}
        () = refuser => {
            // GOAWAY: as the agent does, give the relay's `draining` message a moment to arrive.
            let _ = tokio::time::timeout(DRAINING_WAIT, &mut control).await;
        }
        () = &mut control => {}
        () = stop.cancelled() => conn.close(code::NO_ERROR, "load test over"),
    }
    draining.lock().ok().and_then(|window| *window)
}

async fn control_channel(
    conn: &Connection,
    default_heartbeat: Duration,
    stats: &SimStats,
    draining: &std::sync::Mutex<Option<Duration>>,
) -> anyhow::Result<()> {
    let stream = conn.open(OpenOptions {
        kind: kind::CONTROL,
        priority: Priority::Control,
        deadline: Some(Duration::from_secs(30)),
        metadata: Bytes::new(),
    })?;
    let answer = stream.control();
    let (rd, mut wr) = tokio::io::split(stream);
    let mut reader = control::Reader::new(rd);
    let version = env!("CARGO_PKG_VERSION").to_owned();
    let hello = control::Hello {
        agent_version: version.clone(),
        ..control::Hello::default()
    };
    control::send(&mut wr, &Message::Hello(hello)).await?;
    if answer.accepted().await.is_err() {
        stats.control_refused.fetch_add(1, Ordering::Relaxed);
        anyhow::bail!("control stream refused");
    }
    stats.control_accepted.fetch_add(1, Ordering::Relaxed);
    let mut interval = default_heartbeat;
    if let Ok(Ok(Some(Message::Welcome(welcome)))) =
        tokio::time::timeout(Duration::from_secs(30), reader.recv()).await
        && welcome.heartbeat_interval_seconds > 0
    {
        interval = Duration::from_secs(welcome.heartbeat_interval_seconds);
    }
    // As the agent does: metadata and health at once, then a heartbeat and a health report every interval.
    let started = Instant::now();
    let health = |conn: &Connection| {
        Message::Health(control::Health {
            agent_version: version.clone(),
            uptime_seconds: started.elapsed().as_secs(),
            tunnel_rtt_millis: conn.rtt().map(|d| d.as_secs_f64() * 1000.0),
            ..control::Health::default()
        })
    };
    let metadata = control::Metadata {
        kubernetes_version: "v1.33.0".to_owned(),
        node_count: 1,
        total_cpu_millis: 2000,
        total_memory_bytes: 4 << 30,
        distribution: "loadtest".to_owned(),
        infrastructure: "loopback".to_owned(),
        agent_version: version.clone(),
    };
    control::send(&mut wr, &Message::Metadata(metadata)).await?;
    control::send(&mut wr, &health(conn)).await?;
    // Agents started together should not beat together: start at a random phase.
    let phase = interval.mul_f64(rand::rng().random_range(0.0..1.0));
    let mut tick = tokio::time::interval_at(Instant::now() + phase, interval);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut seq = 0u64;
    let reader = async {
        // Drain whatever the relay sends (certificates, snapshots); keep `draining`'s window, as the agent
        // does; end when the stream ends.
        while let Ok(Some(message)) = reader.recv().await {
            if let Message::Draining(d) = message
                && let Ok(mut slot) = draining.lock()
            {
                *slot = Some(Duration::from_millis(d.reconnect_within_ms));
            }
        }
    };
    tokio::pin!(reader);
    loop {
        tokio::select! {
            _ = tick.tick() => {
                seq += 1;
                control::send(&mut wr, &Message::Heartbeat(control::Heartbeat { seq })).await?;
                control::send(&mut wr, &health(conn)).await?;
                stats.heartbeats.fetch_add(1, Ordering::Relaxed);
            }
            () = &mut reader => anyhow::bail!("control stream ended"),
        }
    }
}

/// Shared by the agents of a [`Fleet`].
#[derive(Debug)]
struct FleetShared {
    transport: SimTransport,
    backoff: Backoff,
    default_heartbeat: Duration,
    stats: Arc<SimStats>,
    accepts: RwLock<Option<Arc<Timeline>>>,
    stop: CancellationToken,
    /// Bounds concurrent FIRST connects (the initial ramp); reconnects are not bounded, as in the field.
    initial_gate: Option<Arc<Semaphore>>,
}

/// Many simulated agents running at once, each connecting, holding its tunnel and reconnecting with the
/// agent's backoff until [`Fleet::shutdown`].
#[derive(Debug)]
pub struct Fleet {
    shared: Arc<FleetShared>,
    tasks: JoinSet<()>,
}

impl Fleet {
    /// Starts one task per agent. At most `initial_concurrency` first connects are in flight at once; every
    /// successful connect is counted in `accepts` (if given; see also [`Fleet::count_accepts_in`]).
    pub fn start(
        agents: &[Arc<SimAgent>],
        transport: SimTransport,
        backoff: Backoff,
        default_heartbeat: Duration,
        initial_concurrency: Option<usize>,
        accepts: Option<Arc<Timeline>>,
    ) -> Self {
        let shared = Arc::new(FleetShared {
            transport,
            backoff,
            default_heartbeat,
            stats: Arc::new(SimStats::default()),
            accepts: RwLock::new(accepts),
            stop: CancellationToken::new(),
            initial_gate: initial_concurrency.map(|n| Arc::new(Semaphore::new(n.max(1)))),
        });
        let mut tasks = JoinSet::new();
        for agent in agents {
            tasks.spawn(run(agent.clone(), shared.clone()));
        }
        Self { shared, tasks }
    }

    /// The fleet's counters.
    pub fn stats(&self) -> &SimStats {
        &self.shared.stats
    }

    /// From now on, every successful connect is also counted in `timeline`.
    pub fn count_accepts_in(&self, timeline: Arc<Timeline>) {
        if let Ok(mut slot) = self.shared.accepts.write() {
            *slot = Some(timeline);
        }
    }

    /// Waits until `until` holds for the counters, polling every 20 ms, or fails after `limit`. The bar (if
    /// any) shows tunnels up.
    pub async fn wait_for(
        &self,
        limit: Duration,
        bar: Option<&indicatif::ProgressBar>,
        until: impl Fn(&SimStats) -> bool,
    ) -> anyhow::Result<Duration> {
        let start = Instant::now();
        loop {
            let stats = self.stats();
            if let Some(b) = bar {
                b.set_position(SimStats::get(&stats.connected));
            }
            if until(stats) {
                return Ok(start.elapsed());
            }
            if start.elapsed() > limit {
                let first = stats.first_error.lock().ok().and_then(|e| e.clone());
                anyhow::bail!(
                    "gave up after {limit:?}: {} tunnels up, {} connect errors (first: {})",
                    SimStats::get(&stats.connected),
                    SimStats::get(&stats.connect_errors),
                    first.as_deref().unwrap_or("none")
                );
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// Closes every tunnel and waits for the tasks.
    pub async fn shutdown(mut self) {
        self.shared.stop.cancel();
        while self.tasks.join_next().await.is_some() {}
    }
}

/// One simulated agent until `stop`: connect, hold, and on loss reconnect as the agent does
/// ([`tether_api::reconnect::Reconnect`], the relay's `draining` window included).
async fn run(agent: Arc<SimAgent>, fleet: Arc<FleetShared>) {
    let stats = &fleet.stats;
    let mut reconnect = Reconnect::new(fleet.backoff);
    let mut first_permit = match &fleet.initial_gate {
        Some(gate) => tokio::select! {
            p = gate.clone().acquire_owned() => p.ok(),
            () = fleet.stop.cancelled() => return,
        },
        None => None,
    };
    loop {
        let connecting =
            tokio::time::timeout(Duration::from_secs(15), agent.connect(fleet.transport));
        let result = tokio::select! {
            r = connecting => r,
            () = fleet.stop.cancelled() => return,
        };
        drop(first_permit.take());
        let delay = match result {
            Ok(Ok(conn)) => {
                reconnect.connected();
                stats.connects.fetch_add(1, Ordering::Relaxed);
                stats.connected.fetch_add(1, Ordering::Relaxed);
                if let Ok(slot) = fleet.accepts.read()
                    && let Some(t) = slot.as_ref()
                {
                    t.add(1);
                }
                let window = hold(&conn, fleet.default_heartbeat, stats, &fleet.stop).await;
                stats.connected.fetch_sub(1, Ordering::Relaxed);
                if fleet.stop.is_cancelled() {
                    return;
                }
                stats.disconnects.fetch_add(1, Ordering::Relaxed);
                reconnect.lost(window)
            }
            Ok(Err(e)) if e.identity_refused() => {
                // The real agent gives up here: its identity was refused.
                stats.note_error(&e);
                return;
            }
            Ok(Err(e)) => {
                stats.note_error(&e);
                reconnect.next_delay()
            }
            Err(_) => {
                stats.note_error(&DialError::TimedOut);
                reconnect.next_delay()
            }
        };
        tokio::select! {
            () = tokio::time::sleep(delay) => {}
            () = fleet.stop.cancelled() => return,
        }
    }
}

/// The transport the relay shows for the first agent's tunnel (`none` when it shows none), so a report says
/// what the relay really carried.
pub async fn transport_at_relay(relay: &RelayProcess, agents: &[Arc<SimAgent>]) -> String {
    let Some(agent) = agents.first() else {
        return "none".to_owned();
    };
    match relay.cluster(&agent.cluster).await {
        Ok(cluster) => cluster["tunnels"][0]["transport"]
            .as_str()
            .unwrap_or("none")
            .to_owned(),
        Err(e) => format!("unknown ({e:#})"),
    }
}

/// Registers and onboards `count` clusters named `PREFIX-N` with `concurrency` requests in flight.
pub async fn onboard_many(
    relay: &RelayProcess,
    prefix: &str,
    count: usize,
    concurrency: usize,
    progress: Option<&indicatif::ProgressBar>,
) -> anyhow::Result<Vec<Arc<SimAgent>>> {
    use futures_util::stream::{self, StreamExt as _, TryStreamExt as _};
    let agents: Vec<Arc<SimAgent>> = stream::iter(0..count)
        .map(|i| async move {
            let name = format!("{prefix}-{i}");
            let token = relay.register(&name).await?;
            let agent = SimAgent::onboard(relay, &name, &token)
                .await
                .with_context(|| format!("onboarding {name}"))?;
            if let Some(p) = progress {
                p.inc(1);
            }
            anyhow::Ok(Arc::new(agent))
        })
        .buffered(concurrency.max(1))
        .try_collect()
        .await?;
    Ok(agents)
}

/// What a [`Storm`] did.
#[derive(Debug, Default)]
pub struct StormOutcome {
    /// Tunnels connected (and closed again).
    pub connects: u64,
    /// Connect attempts that failed or timed out.
    pub errors: u64,
    /// Ticks skipped because [`STORM_IN_FLIGHT`] connects were already in flight.
    pub skipped: u64,
    /// Time from dialling to the relay's upgrade answer, per connected tunnel.
    pub latency: crate::stats::Latency,
    /// How long it dialled (the connects still in flight when it stopped are waited for, not counted here).
    pub elapsed: Duration,
    /// The first connect error seen.
    pub first_error: Option<String>,
}

/// At most this many of a storm's connects are in flight at once; ticks beyond it are skipped and counted.
pub const STORM_IN_FLIGHT: usize = 256;

/// A reconnect storm at a fixed rate: `rate` times a second one of the agents dials the relay over WebSocket
/// (TCP and TLS handshake, upgrade, registration), and once the tunnel is up closes it again. It stands in for
/// a fleet of agents coming back after a relay restart while users' requests are being served, so that what
/// the relay's accept path costs those requests can be measured (`requests --storm-rate`).
#[derive(Debug)]
pub struct Storm {
    stop: CancellationToken,
    task: tokio::task::JoinHandle<StormOutcome>,
}

impl Storm {
    /// Starts dialling `rate` times a second, taking `agents` in turn.
    pub fn start(agents: Vec<Arc<SimAgent>>, rate: u32) -> anyhow::Result<Self> {
        anyhow::ensure!(!agents.is_empty(), "a storm needs at least one agent");
        anyhow::ensure!(
            (1..=100_000).contains(&rate),
            "a storm's rate is 1 to 100,000 connects a second, not {rate}"
        );
        let stop = CancellationToken::new();
        let task = tokio::spawn(storm(agents, rate, stop.clone()));
        Ok(Self { stop, task })
    }

    /// Stops dialling, waits for the connects in flight, and says what the storm did.
    pub async fn stop(mut self) -> anyhow::Result<StormOutcome> {
        self.stop.cancel();
        (&mut self.task).await.context("the storm's task failed")
    }
}

/// A storm dropped without [`Storm::stop`] (the run beside it failed) stops dialling too; the connects in flight
/// end on their own timeouts.
impl Drop for Storm {
    fn drop(&mut self) {
        self.stop.cancel();
    }
}

async fn storm(agents: Vec<Arc<SimAgent>>, rate: u32, stop: CancellationToken) -> StormOutcome {
    let started = Instant::now();
    let mut outcome = StormOutcome::default();
    let mut tick = tokio::time::interval(Duration::from_secs(1) / rate);
    // An open loop at a fixed rate; after a stall it goes on at the rate rather than catching up in a burst.
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Skip);
    let gate = Arc::new(Semaphore::new(STORM_IN_FLIGHT));
    let mut inflight: JoinSet<Result<Duration, String>> = JoinSet::new();
    let mut turn = 0usize;
    let record =
        |outcome: &mut StormOutcome,
         r: Result<Result<Duration, String>, tokio::task::JoinError>| match r {
            Ok(Ok(took)) => {
                outcome.connects += 1;
                outcome.latency.record(took);
            }
            Ok(Err(e)) => {
                outcome.errors += 1;
                outcome.first_error.get_or_insert(e);
            }
            Err(e) => {
                outcome.errors += 1;
                outcome.first_error.get_or_insert(e.to_string());
            }
        };
    loop {
        tokio::select! {
            () = stop.cancelled() => break,
            Some(r) = inflight.join_next() => record(&mut outcome, r),
            _ = tick.tick() => {
                let Ok(permit) = gate.clone().try_acquire_owned() else {
                    outcome.skipped += 1;
                    continue;
                };
                let agent = agents[turn % agents.len()].clone();
                turn += 1;
                inflight.spawn(async move {
                    let _permit = permit;
                    let dialled = Instant::now();
                    let conn = tokio::time::timeout(Duration::from_secs(15), agent.connect(SimTransport::Wss))
                        .await
                        .map_err(|_| "timed out".to_owned())?
                        .map_err(|e| e.to_string())?;
                    let took = dialled.elapsed();
                    conn.close(code::NO_ERROR, "storm");
                    let _ = tokio::time::timeout(Duration::from_secs(5), conn.closed()).await;
                    Ok(took)
                });
            }
        }
    }
    outcome.elapsed = started.elapsed();
    while let Some(r) = inflight.join_next().await {
        record(&mut outcome, r);
    }
    outcome
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_storm_dropped_without_stop_stops_dialling() {
        let stop = CancellationToken::new();
        let watched = stop.clone();
        let task = tokio::spawn(async move {
            watched.cancelled().await;
            StormOutcome::default()
        });
        drop(Storm {
            stop: stop.clone(),
            task,
        });
        assert!(stop.is_cancelled());
    }
}
