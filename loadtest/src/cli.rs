//! Command-line configuration: one subcommand per scenario, with defaults sized for a 2-core machine.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use clap::{Args, FromArgMatches, Parser, Subcommand, ValueEnum};
use serde::Serialize;
use tether_runtime::parse_duration;

use crate::client::Protocol;
use crate::peers::RatholeTransport;

/// Load tests for Tether: throughput, latency and scale, side by side with the direct path and rathole.
#[derive(Debug, Parser)]
#[command(name = "tether-loadtest", version)]
pub struct Cli {
    /// Options shared by every scenario.
    #[command(flatten)]
    pub common: CommonArgs,
    /// The scenario.
    #[command(subcommand)]
    pub command: Command,
}

/// Options shared by every scenario.
#[derive(Debug, Clone, Args)]
pub struct CommonArgs {
    /// Where results go: SCENARIO.json, SCENARIO.txt and SVG plots.
    #[arg(long, global = true, default_value = "loadtest-results")]
    pub out: PathBuf,
    /// Directory holding tether-relay and tether-agent (default: next to this binary, else PATH).
    #[arg(long, global = true, env = "TETHER_BIN_DIR")]
    pub bin_dir: Option<PathBuf>,
    /// The rathole binary (default: PATH, else ~/.cargo/bin); without one, rathole runs are skipped.
    #[arg(long, global = true)]
    pub rathole: Option<PathBuf>,
    /// How rathole's client and server talk.
    #[arg(long, global = true, value_enum, default_value_t = RatholeTransport::Tcp)]
    pub rathole_transport: RatholeTransport,
    /// The HAProxy binary, for the `haproxy` path and `failover`'s load balancer (default: $TETHER_HAPROXY,
    /// else PATH, else /usr/sbin/haproxy); without one, haproxy runs are skipped.
    #[arg(long, global = true)]
    pub haproxy: Option<PathBuf>,
    /// The iperf3 binary (default: PATH); without one, the raw loopback figure is skipped.
    #[arg(long, global = true)]
    pub iperf3: Option<PathBuf>,
    /// Working directory for data dirs, configs and process logs (default: a temporary one, removed at the end).
    #[arg(long, global = true)]
    pub work_dir: Option<PathBuf>,
    /// RUST_LOG for the relay and agent processes.
    #[arg(long, global = true, default_value = "warn")]
    pub log_level: String,
    /// A command line to run the relay under, e.g. "valgrind --tool=callgrind --callgrind-out-file=relay.%p".
    #[arg(long, global = true)]
    pub relay_wrapper: Option<String>,
    /// An extra argument for the relay, as `--relay-arg=--FLAG=VALUE` (repeatable). A per-client bound named
    /// here keeps this value instead of being lifted, e.g. `--relay-arg=--principal-early-cancel-rate=10`.
    #[arg(long = "relay-arg", global = true, allow_hyphen_values = true)]
    pub relay_args: Vec<String>,
    /// A command line to run the agent under.
    #[arg(long, global = true)]
    pub agent_wrapper: Option<String>,
    /// An extra argument for the agent, as `--agent-arg=--FLAG=VALUE` (repeatable), e.g.
    /// `--agent-arg=--quic-timeout=1s`.
    #[arg(long = "agent-arg", global = true, allow_hyphen_values = true)]
    pub agent_args: Vec<String>,
    /// No progress bars.
    #[arg(long, global = true)]
    pub no_progress: bool,
    /// The agent transports to measure side by side in `requests`, `bulk` and `hol` (comma-separated or
    /// repeated: `--transport quic,wss`): one relay and agent (`--transport X`) per transport, labelled
    /// `tether quic`, `tether wss`, with quic/wss ratios. Default: one agent with its own choice (`auto`,
    /// QUIC on loopback), labelled `tether`; each report's `tunnel_transport` setting says which transport
    /// every Tether path's tunnel ran on. `watches` runs its one agent with the first one given. `tunnels` and
    /// `reconnect` dial their simulated agents (and `tunnels` its real one) with the first one given: `wss`
    /// (the default for simulated agents) or `quic`.
    #[arg(long, global = true, value_enum, value_delimiter = ',')]
    pub transport: Vec<AgentTransport>,
}

/// An agent's `--transport`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum AgentTransport {
    /// QUIC, else WebSocket.
    Auto,
    /// QUIC only.
    Quic,
    /// WebSocket over TLS only.
    Wss,
}

impl AgentTransport {
    /// As on the agent's command line.
    pub fn as_str(self) -> &'static str {
        match self {
            AgentTransport::Auto => "auto",
            AgentTransport::Quic => "quic",
            AgentTransport::Wss => "wss",
        }
    }
}

/// The scenarios.
#[derive(Debug, Subcommand)]
pub enum Command {
    /// Concurrent kubectl-like requests (get, list, watch) through Tether, directly, and through rathole (and,
    /// asked for, HAProxy).
    Requests(RequestsArgs),
    /// Large streamed responses over one stream and over many, against the same paths and iperf3.
    Bulk(BulkArgs),
    /// Many idle tunnels on one relay: relay RSS per tunnel, heartbeat CPU, connect rate, idle agent RSS.
    Tunnels(TunnelsArgs),
    /// The relay restarted under many connected agents: time until all are back, peak vs mean accept rate.
    Reconnect(ReconnectArgs),
    /// A stalled reader beside parallel GETs on the same tunnel: GET p99 with and without it.
    Hol(HolArgs),
    /// Stream open/close cycles through one tunnel: relay and agent RSS and stream tables before and after.
    Churn(ChurnArgs),
    /// Thousands of open watches through one tunnel to the sample apiserver (real relay, agent and apiserver
    /// processes, the relay's product bounds, many principals): GET latency beside them, memory per watch,
    /// upstream connections, the agent's memory after, and how fast every watch ends when the agent is killed.
    Watches(WatchesArgs),
    /// A local relay fleet (replicas on PostgreSQL behind HAProxy) under GETs and watches: one replica killed,
    /// then all rolled; failed requests, recovery time, routes of the dead replica, how each watch ended.
    Failover(FailoverArgs),
    /// Every scenario in turn, with its defaults (`churn` excepted: a million cycles take a while).
    All,
    /// Internal: serve the upstream (used as a child process by the scenarios).
    #[command(hide = true)]
    Upstream(UpstreamArgs),
}

/// Which path a request takes to the upstream.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, ValueEnum, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum PathKind {
    /// Client → relay → tunnel → agent → upstream.
    Tether,
    /// Client → upstream.
    Direct,
    /// Client → rathole server → rathole client → upstream (TCP; TLS end to end).
    Rathole,
    /// Client → HAProxy → upstream (HTTP mode; HAProxy terminates the client's TLS and opens its own to the
    /// upstream). Not measured unless asked for: `--paths direct,tether,rathole,haproxy`.
    Haproxy,
}

impl PathKind {
    /// Its label in reports.
    pub fn label(self) -> &'static str {
        match self {
            PathKind::Tether => "tether",
            PathKind::Direct => "direct",
            PathKind::Rathole => "rathole",
            PathKind::Haproxy => "haproxy",
        }
    }
}

/// `requests` options.
#[derive(Debug, Clone, Args, Serialize)]
pub struct RequestsArgs {
    /// Concurrent clients, each with one request in flight.
    #[arg(long, default_value_t = 32)]
    pub concurrency: usize,
    /// Measured time per path.
    #[arg(long, default_value = "10s", value_parser = parse_duration)]
    #[serde(serialize_with = "ser_duration")]
    pub duration: Duration,
    /// Unmeasured time before it, per path.
    #[arg(long, default_value = "2s", value_parser = parse_duration)]
    #[serde(serialize_with = "ser_duration")]
    pub warmup: Duration,
    /// HTTP version of the client.
    #[arg(long, value_enum, default_value_t = Protocol::H1)]
    pub protocol: Protocol,
    /// Request mix as KIND=WEIGHT (kinds: get, list, watch).
    #[arg(long, default_value = "get=80,list=15,watch=5", value_parser = parse_mix)]
    pub mix: Mix,
    /// Pods in the list response.
    #[arg(long, default_value_t = 50)]
    pub list_items: usize,
    /// Paths to measure (`haproxy` only when named here).
    #[arg(
        long,
        value_enum,
        value_delimiter = ',',
        default_value = "direct,tether,rathole"
    )]
    pub paths: Vec<PathKind>,
    /// A reconnect storm during each Tether path's run: this many tunnel connects a second (WebSocket, each
    /// closed once it is up) from simulated agents, beside the clients' requests. 0: none; at most 100,000.
    #[arg(long, default_value_t = 0, value_parser = clap::value_parser!(u32).range(0..=100_000))]
    pub storm_rate: u32,
    /// Simulated agents the storm takes in turn (onboarded before the runs).
    #[arg(long, default_value_t = 64)]
    pub storm_agents: usize,
}

impl Default for RequestsArgs {
    /// The command line's defaults.
    fn default() -> Self {
        defaults()
    }
}

/// `bulk` options.
#[derive(Debug, Clone, Args, Serialize)]
pub struct BulkArgs {
    /// Size of each streamed response (e.g. 64MiB).
    #[arg(long, default_value = "64MiB", value_parser = parse_size)]
    pub size: u64,
    /// Parallel streams to measure, comma-separated.
    #[arg(long, value_delimiter = ',', default_value = "1,8")]
    pub streams: Vec<usize>,
    /// Measured time per path and stream count.
    #[arg(long, default_value = "5s", value_parser = parse_duration)]
    #[serde(serialize_with = "ser_duration")]
    pub duration: Duration,
    /// Unmeasured time before it.
    #[arg(long, default_value = "1s", value_parser = parse_duration)]
    #[serde(serialize_with = "ser_duration")]
    pub warmup: Duration,
    /// HTTP version of the client.
    #[arg(long, value_enum, default_value_t = Protocol::H1)]
    pub protocol: Protocol,
    /// Paths to measure (`haproxy` only when named here).
    #[arg(
        long,
        value_enum,
        value_delimiter = ',',
        default_value = "direct,tether,rathole"
    )]
    pub paths: Vec<PathKind>,
    /// Time of iperf3 per stream count, whole seconds (0 skips it; a bare number is seconds).
    #[arg(long, alias = "iperf-seconds", default_value = "3s", value_parser = parse_duration)]
    #[serde(serialize_with = "ser_duration")]
    pub iperf_time: Duration,
}

impl Default for BulkArgs {
    /// The command line's defaults.
    fn default() -> Self {
        defaults()
    }
}

/// `tunnels` options.
#[derive(Debug, Clone, Args, Serialize)]
pub struct TunnelsArgs {
    /// Tunnels to hold (the target is 10,000: needs `ulimit -n` above 10,100 for this process).
    #[arg(long, default_value_t = 1000)]
    pub count: usize,
    /// Idle time over which heartbeat CPU is measured.
    #[arg(long, default_value = "30s", value_parser = parse_duration)]
    #[serde(serialize_with = "ser_duration")]
    pub idle: Duration,
    /// Heartbeat interval asked of the relay (when it has `--heartbeat-interval`) and used until a relay
    /// names one.
    #[arg(long, default_value = "5s", value_parser = parse_duration)]
    #[serde(serialize_with = "ser_duration")]
    pub heartbeat_interval: Duration,
    /// Tunnel connects in flight at once.
    #[arg(long, default_value_t = 64)]
    pub connect_concurrency: usize,
    /// Registrations and onboardings in flight at once.
    #[arg(long, default_value_t = 8)]
    pub onboard_concurrency: usize,
    /// Skip the idle `tether-agent` process (its RSS is the "idle agent" figure).
    #[arg(long)]
    pub no_real_agent: bool,
}

impl Default for TunnelsArgs {
    /// The command line's defaults.
    fn default() -> Self {
        defaults()
    }
}

/// How the relay is stopped in `reconnect`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum StopSignal {
    /// SIGTERM: the relay sends GOAWAY and drains (a rolling restart).
    Term,
    /// SIGKILL: a crash.
    Kill,
}

/// `failover` options.
#[derive(Debug, Clone, Args, Serialize)]
pub struct FailoverArgs {
    /// Relay replicas behind the load balancer.
    #[arg(long, default_value_t = 3)]
    pub replicas: usize,
    /// Tunnels the agent keeps, on distinct replicas (K).
    #[arg(long, default_value_t = 2)]
    pub tunnels: u32,
    /// Clients GETting in a loop through the load balancer: half keep their HTTP/2 connection (client-go),
    /// half open a new one per request (kubectl runs).
    #[arg(long, default_value_t = 8)]
    pub clients: usize,
    /// Pause after each GET of one client.
    #[arg(long, default_value = "25ms", value_parser = parse_duration)]
    #[serde(serialize_with = "ser_duration")]
    pub pause: Duration,
    /// Open watches (each lists, watches, and lists again when its watch ends, as an informer does).
    #[arg(long, default_value_t = 100)]
    pub watches: usize,
    /// How long a replica stopping lets watches run (the replicas' --drain-timeout).
    #[arg(long, default_value = "10s", value_parser = parse_duration)]
    #[serde(serialize_with = "ser_duration")]
    pub drain_timeout: Duration,
    /// Load kept on before the kill, after it, and after the roll.
    #[arg(long, default_value = "5s", value_parser = parse_duration)]
    #[serde(serialize_with = "ser_duration")]
    pub settle: Duration,
    /// Give up on one step (a replica exiting, coming back, the tunnels moving) after this long.
    #[arg(long, default_value = "90s", value_parser = parse_duration)]
    #[serde(serialize_with = "ser_duration")]
    pub step_timeout: Duration,
}

impl Default for FailoverArgs {
    /// The command line's defaults.
    fn default() -> Self {
        defaults()
    }
}

/// `reconnect` options.
#[derive(Debug, Clone, Args, Serialize)]
pub struct ReconnectArgs {
    /// Connected agents (the target is 10,000).
    #[arg(long, default_value_t = 1000)]
    pub count: usize,
    /// How the relay is stopped.
    #[arg(long, value_enum, default_value_t = StopSignal::Term)]
    pub signal: StopSignal,
    /// Give up waiting for the agents after this long.
    #[arg(long, default_value = "120s", value_parser = parse_duration)]
    #[serde(serialize_with = "ser_duration")]
    pub deadline: Duration,
    /// Width of the accept-rate bins (peak vs mean is taken over these).
    #[arg(long, default_value = "1s", value_parser = parse_duration)]
    #[serde(serialize_with = "ser_duration")]
    pub bin: Duration,
    /// Tunnel connects in flight at once for the initial connection.
    #[arg(long, default_value_t = 64)]
    pub connect_concurrency: usize,
    /// Registrations and onboardings in flight at once.
    #[arg(long, default_value_t = 8)]
    pub onboard_concurrency: usize,
}

impl Default for ReconnectArgs {
    /// The command line's defaults.
    fn default() -> Self {
        defaults()
    }
}

/// `hol` options.
#[derive(Debug, Clone, Args, Serialize)]
pub struct HolArgs {
    /// Concurrent GET clients.
    #[arg(long, default_value_t = 8)]
    pub concurrency: usize,
    /// Measured time of each phase (baseline, stalled, baseline again).
    #[arg(long, default_value = "8s", value_parser = parse_duration)]
    #[serde(serialize_with = "ser_duration")]
    pub duration: Duration,
    /// Unmeasured time before each phase.
    #[arg(long, default_value = "1s", value_parser = parse_duration)]
    #[serde(serialize_with = "ser_duration")]
    pub warmup: Duration,
    /// Size of the response each stalled reader asks for and stops reading.
    #[arg(long, default_value = "1GiB", value_parser = parse_size)]
    pub stall_size: u64,
    /// Stalled readers (one principal, each on its own HTTP/1.1 connection), enough unread stream windows to
    /// fill the tunnel's 16 MiB connection window.
    #[arg(long, default_value_t = 64)]
    pub stalled_readers: usize,
    /// Clients of the open/cancel burst (another principal): each opens a watch over HTTP/1.1 and drops it
    /// within 10–50 ms, again and again, for the measured phase. 0 skips the phase.
    #[arg(long, default_value_t = 48)]
    pub burst_clients: usize,
    /// HTTP version of the GET clients (the stalled reader always has its own HTTP/1.1 connection).
    #[arg(long, value_enum, default_value_t = Protocol::H1)]
    pub protocol: Protocol,
    /// Drop this share (0–1) of the tunnel's packets, both ways, and of nothing else (iptables' statistic
    /// match on the relay↔agent connection: root and iptables needed; run it in a network namespace of its
    /// own, as `scripts/bench.sh hol-loss` does).
    #[arg(long, value_parser = parse_share)]
    pub tunnel_loss: Option<f64>,
}

/// A share between 0 and 1.
fn parse_share(value: &str) -> Result<f64, String> {
    let share: f64 = value
        .parse()
        .map_err(|_| format!("not a number: {value:?}"))?;
    if (0.0..=1.0).contains(&share) {
        Ok(share)
    } else {
        Err(format!("a share between 0 and 1, not {share}"))
    }
}

impl Default for HolArgs {
    /// The command line's defaults.
    fn default() -> Self {
        defaults()
    }
}

/// `churn` options.
#[derive(Debug, Clone, Args, Serialize)]
pub struct ChurnArgs {
    /// Measured open/close cycles.
    #[arg(long, default_value_t = 1_000_000)]
    pub cycles: u64,
    /// Unmeasured cycles first (allocator arenas and pools reach their working size).
    #[arg(long, default_value_t = 10_000)]
    pub warmup_cycles: u64,
    /// Cycles in flight at once (each worker keeps one HTTP/1.1 connection).
    #[arg(long, default_value_t = 32)]
    pub concurrency: usize,
    /// Every Nth cycle is a watch dropped once its head arrived (a reset mid-response); 0: none.
    #[arg(long, default_value_t = 10)]
    pub cancel_every: u64,
}

impl Default for ChurnArgs {
    /// The command line's defaults.
    fn default() -> Self {
        defaults()
    }
}

/// `watches` options.
#[derive(Debug, Clone, Args, Serialize)]
pub struct WatchesArgs {
    /// Principals that each hold `--watches-per-principal` watches on one HTTP/2 connection (client-go
    /// informers: k9s, Lens, Argo CD), each from a loopback address of its own.
    #[arg(long, default_value_t = 20)]
    pub principals: usize,
    /// Watches of each of those principals.
    #[arg(long, default_value_t = 100)]
    pub watches_per_principal: usize,
    /// Watches of one more principal, one HTTP/1.1 connection each (a kube-rs controller); 0: none.
    #[arg(long, default_value_t = 1000)]
    pub controller_watches: usize,
    /// GETs per second of the latency probe (a principal of its own; the relay lets one sustain 200/s).
    #[arg(long, default_value_t = 100)]
    pub get_rate: u32,
    /// Measured time of each latency phase (idle, beside the watches).
    #[arg(long, default_value = "10s", value_parser = parse_duration)]
    #[serde(serialize_with = "ser_duration")]
    pub duration: Duration,
    /// How long the agent sits idle after the watches closed before its memory is read the last time.
    #[arg(long, default_value = "10s", value_parser = parse_duration)]
    #[serde(serialize_with = "ser_duration")]
    pub settle: Duration,
}

impl Default for WatchesArgs {
    /// The command line's defaults.
    fn default() -> Self {
        defaults()
    }
}

/// `upstream` (internal) options.
#[derive(Debug, Clone, Args)]
pub struct UpstreamArgs {
    /// Address to bind; the bound address is printed on stdout.
    #[arg(long, default_value = "127.0.0.1:0")]
    pub listen: SocketAddr,
    /// PEM certificate chain.
    #[arg(long)]
    pub cert: PathBuf,
    /// PEM private key.
    #[arg(long)]
    pub key: PathBuf,
    /// Pods in the list response.
    #[arg(long, default_value_t = 50)]
    pub list_items: usize,
}

/// A scenario's options as the command line gives them when no flag is set: each default is written once, in
/// its `#[arg]` attribute.
fn defaults<T: Args + FromArgMatches>() -> T {
    let command = T::augment_args(clap::Command::new("tether-loadtest"));
    let parsed = command
        .try_get_matches_from(["tether-loadtest"])
        .and_then(|matches| T::from_arg_matches(&matches));
    #[allow(clippy::expect_used)]
    parsed.expect("every scenario option has a default")
}

/// A request mix: (kind, weight) pairs.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Mix(pub Vec<(String, u32)>);

fn ser_duration<S: serde::Serializer>(d: &Duration, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_str(&format!("{d:?}"))
}

/// Parses a byte size: `4096`, `64KiB`, `64MiB`, `1GiB`, `10MB` (powers of 1000), `512k` (= KiB).
pub fn parse_size(s: &str) -> Result<u64, String> {
    let s = s.trim();
    let split = s.find(|c: char| !c.is_ascii_digit()).unwrap_or(s.len());
    let (num, unit) = s.split_at(split);
    let n: u64 = num
        .parse()
        .map_err(|_| format!("invalid size {s:?} (expected e.g. 64MiB)"))?;
    let mult: u64 = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1,
        "k" | "kib" => 1 << 10,
        "m" | "mib" => 1 << 20,
        "g" | "gib" => 1 << 30,
        "kb" => 1_000,
        "mb" => 1_000_000,
        "gb" => 1_000_000_000,
        _ => {
            return Err(format!(
                "invalid size unit in {s:?} (use KiB, MiB, GiB, KB, MB or GB)"
            ));
        }
    };
    n.checked_mul(mult)
        .ok_or_else(|| format!("size {s:?} is too large"))
}

/// Parses `get=80,list=15,watch=5`.
pub fn parse_mix(s: &str) -> Result<Mix, String> {
    let mut out = Vec::new();
    for part in s.split(',').map(str::trim).filter(|p| !p.is_empty()) {
        let (kind, weight) = part
            .split_once('=')
            .ok_or_else(|| format!("invalid mix entry {part:?} (expected KIND=WEIGHT)"))?;
        let kind = kind.trim();
        if !matches!(kind, "get" | "list" | "watch") {
            return Err(format!(
                "unknown request kind {kind:?} (use get, list, watch)"
            ));
        }
        let weight: u32 = weight
            .trim()
            .parse()
            .map_err(|_| format!("invalid weight in {part:?}"))?;
        if weight > 1000 {
            return Err(format!("weight in {part:?} is above 1000"));
        }
        out.push((kind.to_owned(), weight));
    }
    if out.iter().all(|(_, w)| *w == 0) {
        return Err("the mix needs at least one kind with a weight above 0".to_owned());
    }
    Ok(Mix(out))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_are_the_command_lines() {
        let d = BulkArgs::default();
        assert_eq!((d.size, d.streams), (64 << 20, vec![1, 8]));
        assert_eq!(d.iperf_time, Duration::from_secs(3));
        assert_eq!(HolArgs::default().stall_size, 1 << 30);
        assert_eq!(ReconnectArgs::default().deadline, Duration::from_secs(120));
        assert_eq!(TunnelsArgs::default().idle, Duration::from_secs(30));
    }

    #[test]
    fn sizes_parse() {
        assert_eq!(parse_size("4096"), Ok(4096));
        assert_eq!(parse_size("64MiB"), Ok(64 << 20));
        assert_eq!(parse_size("1GiB"), Ok(1 << 30));
        assert_eq!(parse_size("10MB"), Ok(10_000_000));
        assert_eq!(parse_size("512k"), Ok(512 << 10));
        assert!(parse_size("lots").is_err());
        assert!(parse_size("1PB").is_err());
        assert!(parse_size("99999999999999999999GiB").is_err());
    }

    #[test]
    fn mixes_parse() -> Result<(), String> {
        assert_eq!(
            parse_mix("get=80,list=15,watch=5"),
            Ok(Mix(vec![
                ("get".into(), 80),
                ("list".into(), 15),
                ("watch".into(), 5)
            ]))
        );
        assert_eq!(
            RequestsArgs::default().mix,
            parse_mix("get=80,list=15,watch=5")?
        );
        assert_eq!(parse_mix("get=1"), Ok(Mix(vec![("get".into(), 1)])));
        assert!(parse_mix("get").is_err());
        assert!(parse_mix("delete=1").is_err());
        assert!(parse_mix("get=0").is_err());
        assert!(parse_mix("get=x").is_err());
        Ok(())
    }

    #[test]
    fn cli_defaults_match_the_structs() {
        use clap::CommandFactory;
        Cli::command().debug_assert();
        let cli = Cli::try_parse_from(["tether-loadtest", "requests"]).expect("defaults parse");
        match cli.command {
            Command::Requests(a) => {
                let d = RequestsArgs::default();
                assert_eq!(
                    (a.concurrency, a.duration, a.warmup),
                    (d.concurrency, d.duration, d.warmup)
                );
                assert_eq!((a.mix, a.paths, a.protocol), (d.mix, d.paths, d.protocol));
            }
            other => panic!("parsed {other:?}"),
        }
        let cli = Cli::try_parse_from([
            "tether-loadtest",
            "bulk",
            "--streams",
            "1,4",
            "--size",
            "8MiB",
        ])
        .expect("bulk parses");
        match cli.command {
            Command::Bulk(a) => assert_eq!((a.streams, a.size), (vec![1, 4], 8 << 20)),
            other => panic!("parsed {other:?}"),
        }
        for scenario in ["requests", "bulk"] {
            let cli = Cli::try_parse_from([
                "tether-loadtest",
                "--haproxy",
                "/opt/haproxy",
                scenario,
                "--paths",
                "direct,tether,rathole,haproxy",
            ])
            .expect("haproxy is a path");
            let paths = match cli.command {
                Command::Requests(a) => a.paths,
                Command::Bulk(a) => a.paths,
                other => panic!("parsed {other:?}"),
            };
            assert_eq!(paths.last(), Some(&PathKind::Haproxy), "{scenario}");
            assert_eq!(cli.common.haproxy, Some(PathBuf::from("/opt/haproxy")));
        }
        // Opt-in: the default paths stay those of the recorded runs.
        let defaults = [RequestsArgs::default().paths, BulkArgs::default().paths];
        for paths in defaults {
            assert_eq!(
                paths,
                [PathKind::Direct, PathKind::Tether, PathKind::Rathole]
            );
        }
        for (scenario, ok) in [
            ("tunnels", true),
            ("reconnect", true),
            ("hol", true),
            ("watches", true),
            ("nope", false),
        ] {
            assert_eq!(
                Cli::try_parse_from(["tether-loadtest", scenario]).is_ok(),
                ok,
                "{scenario}"
            );
        }
    }
}
