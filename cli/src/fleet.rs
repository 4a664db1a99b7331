//! `tether up --replicas N`: a relay fleet on this machine — N `tether-relay` processes sharing one PostgreSQL,
//! behind a real load balancer (HAProxy), with the quickstart's cluster side (the sample apiserver, guard, the
//! development issuer) and a `tether-agent` process dialling the load balancer. Users try the fleet with it;
//! the fleet tests (`cli/tests/fleet.rs`) and `tether-loadtest failover` drive the same code.
//!
//! Relays and the agent run as processes (the `tether-relay` and `tether-agent` programs beside `tether`), so a
//! replica can be killed (SIGKILL) or drained (SIGTERM) and started again; the cluster side runs in this
//! process, as with `tether up`.
//!
//! Layout of the directory (besides what `tether up` keeps there: `sample-apiserver/`, `guard/`, `dev-issuer/`,
//! `agent/`, `kubeconfig`, `config.json`):
//! - `relay/`: what every replica shares, made once: the relay CA (`ca.pem`, `ca-key.pem`), the agent CA
//!   (`agent-ca.pem`, `agent-ca-key.pem`) and the `admin-token`. Each start copies the CAs into the replicas' data
//!   dirs, and every replica reads the one admin token (`--admin-token-file`).
//! - `relay-1/` … `relay-N/`: each replica's data dir (its own server certificate, issued from the shared CA).
//! - `haproxy/haproxy.cfg`: the load balancer's configuration, written at each start.
//! - `logs/`: `relay-N.log`, `agent.log`, `haproxy.log`.
//! - PostgreSQL's data in `postgres/` — or, as root (PostgreSQL runs as the `postgres` user, who cannot enter
//!   root's directories), in `/var/lib/tether-up/postgres-HASH` ([`tether_testkit::postgres::kept_dir_for`]).
//! - `fleet.json`: what runs where (load balancer, database URL, each replica's address, pid and log).
//!
//! The load balancer listens on `--listen` (users and agents alike) in TCP mode: TLS passes through to the
//! relays, which need the agents' client certificates. It checks each replica's `GET /readyz` over HTTPS every
//! 500 ms (the replica's certificate verified against the fleet CA), so a draining or dead replica leaves
//! rotation within about half a second. QUIC (UDP) does not go through it: replicas run with `--no-quic`, and
//! the agent tunnels over WebSocket through the load balancer.

use std::net::{Ipv4Addr, SocketAddr, TcpListener};
use std::path::{Path, PathBuf};
use std::process::{ExitStatus, Stdio};
use std::time::Duration;

use serde_json::json;
use tether_runtime::Secret;
use tether_testkit::haproxy::{Backend, HaProxy, HaProxyOptions, ServerStatus};
use tether_testkit::postgres::{self, Postgres};
use tether_testkit::{SampleApiserver, dev_issuer::DevIssuer};
use tokio::process::{Child, Command};
use tokio::time::Instant;

use crate::args::UpArgs;
use crate::client::RelayClient;
use crate::kubeconfig::{self, KubeconfigSpec};
use crate::up::{
    self, Entra, GUARD_DIR, GuardRuntime, UpError, UpOptions, create_private_dir, display_addr,
    relay_config, validate_name,
};

/// The most replicas the local fleet runs.
pub const MAX_REPLICAS: usize = 9;
/// The database the replicas share.
const DATABASE: &str = "tether";
/// How long a replica has to become ready after it starts.
const READY_WAIT: Duration = Duration::from_secs(60);
/// How long the agent has to connect.
const CONNECT_WAIT: Duration = Duration::from_secs(60);
/// The files every replica must share (relay/src/certs.rs and relay/src/identity.rs name them).
const SHARED_CA_FILES: [&str; 4] = ["ca.pem", "ca-key.pem", "agent-ca.pem", "agent-ca-key.pem"];
/// A replica's server certificate files: re-issued when the shared CA changed.
const SERVER_CERT_FILES: [&str; 3] = ["server.pem", "server-key.pem", "server-cert.json"];

/// The programs the fleet runs.
#[derive(Debug, Clone)]
pub struct FleetBinaries {
    /// `tether-relay`.
    pub relay: PathBuf,
    /// `tether-agent`.
    pub agent: PathBuf,
    /// `haproxy`.
    pub haproxy: PathBuf,
}

impl FleetBinaries {
    /// `tether-relay` and `tether-agent` beside the running `tether` executable; HAProxy from
    /// `$TETHER_HAPROXY`, `PATH` or `/usr/sbin`.
    pub fn beside_current_exe() -> Result<FleetBinaries, UpError> {
        let exe = std::env::current_exe().map_err(|e| {
            UpError::MissingProgram(format!("cannot find the tether executable: {e}"))
        })?;
        let dir = exe.parent().unwrap_or(Path::new("."));
        let find = |name: &str| {
            let path = dir.join(name);
            if path.is_file() {
                Ok(path)
            } else {
                Err(UpError::MissingProgram(format!(
                    "{name} not found beside {}: `tether up --replicas N` runs the relays and the agent as \
                     processes, from the tether executable's directory; build them with `cargo build --bins \
                     -p tether-relay -p tether-agent -p tether-cli` (or install them beside tether)",
                    exe.display()
                )))
            }
        };
        Ok(FleetBinaries {
            relay: find("tether-relay")?,
            agent: find("tether-agent")?,
            haproxy: haproxy_binary()?,
        })
    }
}

/// HAProxy, or why not.
pub fn haproxy_binary() -> Result<PathBuf, UpError> {
    HaProxy::binary().ok_or_else(|| {
        UpError::MissingProgram(
            "HAProxy is not installed: the local fleet runs it as its load balancer (Debian: apt-get install \
             haproxy; or set TETHER_HAPROXY to the binary)"
                .into(),
        )
    })
}

/// Where PostgreSQL keeps the fleet's data.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum DatabaseHome {
    /// Kept for the next run: `DIR/postgres`, or `/var/lib/tether-up/postgres-HASH` as root.
    Kept,
    /// A temporary directory removed at the end (tests, load tests).
    Temporary,
}

/// What to start.
#[derive(Debug, Clone)]
pub struct FleetOptions {
    /// The quickstart's options: directory, cluster (sample or `kubeconfig`), the load balancer's address
    /// (`listen`), lifecycle settings, guard.
    pub up: UpOptions,
    /// How many relay replicas (2 to [`MAX_REPLICAS`]).
    pub replicas: usize,
    /// How many tunnels the agent keeps, on distinct replicas (`tether-agent --tunnels`).
    pub tunnels: u32,
    /// The programs.
    pub binaries: FleetBinaries,
    /// Where PostgreSQL's data lives.
    pub database: DatabaseHome,
    /// A replica's lease on its tunnels lasts this long without renewal (`tether-relay --lease-ttl`).
    pub lease_ttl: Duration,
    /// How long a SIGTERMed replica lets open watches, logs and exec sessions run (`--drain-timeout`).
    pub drain_timeout: Duration,
    /// How often the load balancer checks each replica's `/readyz`.
    pub check_interval: Duration,
    /// `RUST_LOG` of the relays and the agent when the environment sets none.
    pub log_level: String,
}

impl FleetOptions {
    /// Options for tests: three replicas, two tunnels, a temporary database, the sample cluster and guard, the
    /// load balancer on a free port.
    pub fn for_tests(dir: &Path, binaries: FleetBinaries) -> FleetOptions {
        FleetOptions {
            up: UpOptions::for_tests(dir),
            replicas: 3,
            tunnels: 2,
            binaries,
            database: DatabaseHome::Temporary,
            lease_ttl: Duration::from_secs(5),
            drain_timeout: Duration::from_secs(30),
            check_interval: Duration::from_millis(500),
            log_level: "info".into(),
        }
    }

    /// `tether up --replicas N …`.
    pub fn from_args(args: UpArgs) -> Result<FleetOptions, UpError> {
        let replicas = args.replicas;
        let tunnels = args.tunnels;
        let drain_timeout = args.drain_timeout;
        Ok(FleetOptions {
            up: args.into(),
            replicas,
            tunnels,
            binaries: FleetBinaries::beside_current_exe()?,
            database: DatabaseHome::Kept,
            lease_ttl: Duration::from_secs(5),
            drain_timeout,
            check_interval: Duration::from_millis(500),
            log_level: "info".into(),
        })
    }

    fn validate(&self) -> Result<(), UpError> {
        validate_name(&self.up.cluster)?;
        if !(2..=MAX_REPLICAS).contains(&self.replicas) {
            return Err(UpError::Config(format!(
                "--replicas {}: the local fleet runs 2 to {MAX_REPLICAS} replicas (1 is plain `tether up`)",
                self.replicas
            )));
        }
        if self.tunnels == 0 {
            return Err(UpError::Config("--tunnels must be at least 1".into()));
        }
        if self.lease_ttl.is_zero() || self.drain_timeout.is_zero() || self.check_interval.is_zero()
        {
            return Err(UpError::Config(
                "the lease TTL, drain timeout and check interval must be greater than zero".into(),
            ));
        }
        relay_config(&self.up.dir, &self.up, None)
            .validate()
            .map_err(|e| UpError::Config(e.to_string()))
    }
}

/// Which of the fleet's flags the programs know. The relay's (`--replica-id`, `--peer-listen`, …) and the
/// agent's (`--tunnels`, `--transport`) arrive with the fleet work of issue 11; a program without them still
/// runs in the fleet — replicas share the store but not their tunnels, and a request reaches the cluster only
/// through the replica holding its tunnel.
#[derive(Debug, Clone, Copy, Default)]
pub struct Features {
    /// `tether-relay --replica-id/--peer-listen/--peer-address/--lease-ttl/--drain-timeout`.
    pub relay_peering: bool,
    /// `tether-agent --tunnels`.
    pub agent_tunnels: bool,
    /// `tether-agent --transport`.
    pub agent_transport: bool,
}

impl Features {
    async fn probe(binaries: &FleetBinaries) -> Features {
        let relay = help_text(&binaries.relay).await;
        let agent = help_text(&binaries.agent).await;
        Features {
            relay_peering: [
                "--replica-id",
                "--peer-listen",
                "--peer-address",
                "--lease-ttl",
            ]
            .iter()
            .all(|flag| relay.contains(flag)),
            agent_tunnels: agent.contains("--tunnels"),
            agent_transport: agent.contains("--transport"),
        }
    }
}

async fn help_text(program: &Path) -> String {
    match Command::new(program)
        .arg("--help")
        .stdin(Stdio::null())
        .output()
        .await
    {
        Ok(out) => String::from_utf8_lossy(&out.stdout).into_owned(),
        Err(_) => String::new(),
    }
}

/// One relay replica: a `tether-relay` process with its own data dir and ports.
#[derive(Debug)]
pub struct Replica {
    /// Its id (`relay-1`, …): the name in HAProxy's configuration and `--replica-id`.
    pub id: String,
    /// Where it serves HTTPS (users, agents, the admin API, probes).
    pub addr: SocketAddr,
    /// Where its peers reach it (`--peer-listen`, `--peer-address`).
    pub peer_addr: SocketAddr,
    /// Its data dir.
    pub data_dir: PathBuf,
    /// Its log.
    pub log: PathBuf,
    child: Option<Child>,
    pid: Option<u32>,
    started: Option<Instant>,
    /// The supervisor (foreground command) starts it again no earlier than this.
    not_before: Option<Instant>,
}

impl Replica {
    /// Its base URL (`https://127.0.0.1:PORT`).
    pub fn url(&self) -> String {
        format!("https://{}", display_addr(self.addr))
    }

    /// The process id while it runs.
    pub fn pid(&self) -> Option<u32> {
        self.pid
    }

    /// When it was last started.
    pub fn started(&self) -> Option<Instant> {
        self.started
    }
}

/// A running local fleet.
pub struct Fleet {
    options: FleetOptions,
    /// Which fleet flags the programs know.
    pub features: Features,
    /// The load balancer's URL: users, agents and the admin API.
    pub lb_url: String,
    /// The fleet's CA (PEM): every replica's certificate chains to it.
    pub ca_pem: String,
    /// The admin token every replica accepts.
    pub admin_token: Secret,
    /// The kubeconfig for kubectl through the load balancer.
    pub kubeconfig_path: PathBuf,
    /// The config file for `tether` commands (through the load balancer).
    pub config_path: PathBuf,
    /// The bearer token the kubeconfig carries (passed through to the cluster).
    pub user_token: Option<String>,
    /// The sample apiserver, when no kubeconfig was given.
    pub sample: Option<SampleApiserver>,
    /// The DEVELOPMENT-ONLY token issuer, when guard is wired in.
    pub issuer: Option<DevIssuer>,
    guard: Option<GuardRuntime>,
    entra: Option<Entra>,
    cluster_kubeconfig: PathBuf,
    /// The URL of the database the replicas share (with the password of a kept database: a secret; given to the
    /// replicas in their environment, never on their command line).
    pub database_url: String,
    /// The same URL without the password, to show.
    pub database_shown: String,
    postgres: Option<Postgres>,
    replicas: Vec<Replica>,
    haproxy: Option<HaProxy>,
    agent: Option<Child>,
    agent_pid: Option<u32>,
}

impl std::fmt::Debug for Fleet {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Fleet")
            .field("lb_url", &self.lb_url)
            .field("replicas", &self.replicas)
            .finish_non_exhaustive()
    }
}

impl Fleet {
    /// Starts PostgreSQL, the cluster side, the replicas, the load balancer and the agent, and waits until
    /// every replica is in rotation and the agent is connected. On failure everything started is stopped.
    pub async fn start(options: FleetOptions) -> Result<Fleet, UpError> {
        options.validate()?;
        create_private_dir(&options.up.dir)?;
        let dir = std::fs::canonicalize(&options.up.dir).map_err(|source| UpError::Io {
            path: options.up.dir.clone(),
            source,
        })?;
        let mut options = options;
        options.up.dir = dir.clone();
        create_private_dir(&dir.join("logs"))?;
        let features = Features::probe(&options.binaries).await;

        let (postgres, database_url) = start_postgres(&dir, &options.database).await?;
        let database_shown = postgres.url_without_password(DATABASE);
        let (sample, issuer, guard, entra, cluster_kubeconfig, user_token) =
            up::Up::start_cluster(&dir, &options.up).await?;
        let lb_addr = options.up.listen;
        let mut fleet = Fleet {
            features,
            lb_url: String::new(),
            ca_pem: String::new(),
            admin_token: Secret::new(String::new()),
            kubeconfig_path: dir.join("kubeconfig"),
            config_path: dir.join("config.json"),
            user_token,
            sample,
            issuer,
            guard,
            entra,
            cluster_kubeconfig,
            database_url,
            database_shown,
            postgres: Some(postgres),
            replicas: Vec::new(),
            haproxy: None,
            agent: None,
            agent_pid: None,
            options,
        };
        match fleet.bring_up(lb_addr).await {
            Ok(()) => Ok(fleet),
            Err(e) => {
                // What started is stopped; the error that stopped the start is the one to see.
                let _ = fleet.stop_everything().await;
                Err(e)
            }
        }
    }

    async fn bring_up(&mut self, lb_addr: SocketAddr) -> Result<(), UpError> {
        let dir = self.options.up.dir.clone();
        // The shared secrets: made (and the schema migrated) once, by a relay built in this process that never
        // serves; every replica then finds them.
        let mut seed_config = relay_config(&dir, &self.options.up, self.entra.as_ref());
        seed_config.database_url = Some(self.database_url.clone());
        let seed = tether_relay::Relay::new(seed_config)
            .await
            .map_err(|e| UpError::Relay(e.to_string()))?;
        self.admin_token = seed.admin_token().clone();
        self.ca_pem = seed.ca_pem().map(str::to_string).unwrap_or_default();
        drop(seed);

        for n in 1..=self.options.replicas {
            let id = format!("relay-{n}");
            let data_dir = dir.join(&id);
            share_ca_files(&dir.join("relay"), &data_dir)?;
            self.replicas.push(Replica {
                log: dir.join("logs").join(format!("{id}.log")),
                id,
                addr: SocketAddr::from((Ipv4Addr::LOCALHOST, free_port()?)),
                peer_addr: SocketAddr::from((Ipv4Addr::LOCALHOST, free_port()?)),
                data_dir,
                child: None,
                pid: None,
                started: None,
                not_before: None,
            });
        }
        for i in 0..self.replicas.len() {
            self.spawn_replica(i)?;
        }
        for i in 0..self.replicas.len() {
            self.wait_replica_ready(i, READY_WAIT).await?;
        }

        let backends = self
            .replicas
            .iter()
            .map(|r| Backend::new(r.id.clone(), r.addr))
            .collect();
        let mut lb_options = HaProxyOptions::new(
            dir.join("haproxy"),
            lb_addr,
            backends,
            dir.join("relay").join("ca.pem"),
        );
        lb_options.check_interval = self.options.check_interval;
        let haproxy = HaProxy::start(&self.options.binaries.haproxy, lb_options)
            .await
            .map_err(|e| UpError::LoadBalancer(e.to_string()))?;
        // HAProxy writes its log beside its configuration; keep a link with the others.
        let _ = std::fs::remove_file(dir.join("logs").join("haproxy.log"));
        let _ =
            std::os::unix::fs::symlink(haproxy.log_path(), dir.join("logs").join("haproxy.log"));
        self.lb_url = format!("https://{}", display_addr(haproxy.addr()));
        self.haproxy = Some(haproxy);
        self.wait_in_rotation(self.replicas.len(), READY_WAIT)
            .await?;

        let token = self.register().await?;
        self.spawn_agent(token.as_ref())?;
        let connected = self.wait_connected(CONNECT_WAIT).await;
        // The one-time token is spent (or useless) either way.
        let _ = std::fs::remove_file(self.onboarding_token_file());
        connected?;
        self.write_files()
    }

    /// The fleet's directory (absolute).
    pub fn dir(&self) -> &Path {
        &self.options.up.dir
    }

    /// The cluster's name.
    pub fn cluster(&self) -> &str {
        &self.options.up.cluster
    }

    /// The options it runs with.
    pub fn options(&self) -> &FleetOptions {
        &self.options
    }

    /// The replicas.
    pub fn replicas(&self) -> &[Replica] {
        &self.replicas
    }

    /// The index of the replica with id `id`.
    pub fn replica_index(&self, id: &str) -> Option<usize> {
        self.replicas.iter().position(|r| r.id == id)
    }

    /// The load balancer's address.
    pub fn lb_addr(&self) -> Option<SocketAddr> {
        self.haproxy.as_ref().map(HaProxy::addr)
    }

    /// A client of the admin API through the load balancer.
    pub fn client(&self) -> Result<RelayClient, UpError> {
        Ok(RelayClient::with_token(
            &self.lb_url,
            Some(self.ca_pem.as_bytes()),
            self.admin_token.clone(),
        )?)
    }

    /// A client of the admin API of replica `i` alone.
    pub fn replica_client(&self, i: usize) -> Result<RelayClient, UpError> {
        let replica = self.replica(i)?;
        Ok(RelayClient::with_token(
            &replica.url(),
            Some(self.ca_pem.as_bytes()),
            self.admin_token.clone(),
        )?)
    }

    fn replica(&self, i: usize) -> Result<&Replica, UpError> {
        self.replicas
            .get(i)
            .ok_or_else(|| UpError::Config(format!("no replica #{i}")))
    }

    fn replica_mut(&mut self, i: usize) -> Result<&mut Replica, UpError> {
        self.replicas
            .get_mut(i)
            .ok_or_else(|| UpError::Config(format!("no replica #{i}")))
    }

    /// Writes `DIR/kubeconfig-ID`, reaching the cluster through replica `i` alone (not the load balancer), with
    /// `token` as the user's bearer token (default: the quickstart user's); its path.
    pub fn replica_kubeconfig(&self, i: usize, token: Option<&str>) -> Result<PathBuf, UpError> {
        let replica = self.replica(i)?;
        let path = self.dir().join(format!("kubeconfig-{}", replica.id));
        let text = kubeconfig::render(&KubeconfigSpec {
            relay_url: &replica.url(),
            cluster: self.cluster(),
            ca_pem: Some(self.ca_pem.as_bytes()),
            token: token.or(self.user_token.as_deref()),
        })?;
        kubeconfig::write_private(&path, &text)?;
        Ok(path)
    }

    /// Writes a kubeconfig at `path` reaching the cluster through the load balancer with `token`.
    pub fn kubeconfig_with_token(&self, path: &Path, token: &str) -> Result<(), UpError> {
        let text = kubeconfig::render(&KubeconfigSpec {
            relay_url: &self.lb_url,
            cluster: self.cluster(),
            ca_pem: Some(self.ca_pem.as_bytes()),
            token: Some(token),
        })?;
        kubeconfig::write_private(path, &text)?;
        Ok(())
    }

    /// Guard's engine, when guard is wired in.
    pub fn guard(&self) -> Option<&std::sync::Arc<tether_guard::Guard>> {
        self.guard.as_ref().map(|g| &g.guard)
    }

    /// The command line of replica `i`.
    fn replica_args(&self, replica: &Replica) -> Vec<String> {
        let up = &self.options.up;
        let dir = self.dir();
        let mut args = vec![
            "--listen".to_string(),
            replica.addr.to_string(),
            "--data-dir".into(),
            path_arg(&replica.data_dir),
            "--admin-token-file".into(),
            path_arg(&dir.join("relay").join("admin-token")),
            "--no-quic".into(),
        ];
        let mut hostnames = vec!["localhost".to_string(), "127.0.0.1".into(), "::1".into()];
        if !up.listen.ip().is_unspecified() && !up.listen.ip().is_loopback() {
            hostnames.push(up.listen.ip().to_string());
        }
        hostnames.extend(up.extra_hostnames.iter().cloned());
        for name in hostnames {
            args.extend(["--hostname".to_string(), name]);
        }
        let durations = [
            ("--heartbeat-interval", up.heartbeat_interval),
            ("--offline-threshold", up.offline_threshold),
            ("--identity-validity", up.identity_validity),
        ];
        for (flag, value) in durations {
            if let Some(value) = value {
                args.extend([flag.to_string(), duration_arg(value)]);
            }
        }
        if let Some(version) = &up.latest_agent_version {
            args.extend(["--latest-agent-version".to_string(), version.clone()]);
        }
        if let Some(entra) = &self.entra {
            args.extend(entra_args(entra));
        }
        if self.features.relay_peering {
            args.extend([
                "--replica-id".to_string(),
                replica.id.clone(),
                "--peer-listen".into(),
                replica.peer_addr.to_string(),
                "--peer-address".into(),
                replica.peer_addr.to_string(),
                "--lease-ttl".into(),
                duration_arg(self.options.lease_ttl),
                "--drain-timeout".into(),
                duration_arg(self.options.drain_timeout),
                // HAProxy checks /readyz every check interval and takes a replica out at the first 503.
                "--drain-delay".into(),
                duration_arg((self.options.check_interval * 4).min(self.options.drain_timeout / 2)),
            ]);
        }
        args
    }

    fn spawn_replica(&mut self, i: usize) -> Result<(), UpError> {
        let args = self.replica_args(self.replica(i)?);
        let program = self.options.binaries.relay.clone();
        let log_level = self.options.log_level.clone();
        // The database URL carries the password: in the environment (readable by this user only), not in the
        // arguments (readable by every user of the machine).
        let url = self.database_url.clone();
        let env = [("TETHER_RELAY_DATABASE_URL", url.as_str())];
        let replica = self.replica_mut(i)?;
        if replica.child.is_some() {
            return Err(UpError::Replica {
                id: replica.id.clone(),
                message: "it is running already".into(),
            });
        }
        let child = spawn(&program, &args, &env, &replica.log, &log_level).map_err(|e| {
            UpError::Replica {
                id: replica.id.clone(),
                message: e,
            }
        })?;
        replica.pid = child.id();
        replica.child = Some(child);
        replica.started = Some(Instant::now());
        Ok(())
    }

    /// Starts replica `i` again (same id, ports and data dir) and waits until its `/readyz` answers 200.
    pub async fn start_replica(&mut self, i: usize) -> Result<(), UpError> {
        self.spawn_replica(i)?;
        self.wait_replica_ready(i, READY_WAIT).await?;
        self.write_fleet_json()
    }

    /// Waits up to `limit` until replica `i` answers `GET /readyz` with 200; fails at once if it exits.
    pub async fn wait_replica_ready(&mut self, i: usize, limit: Duration) -> Result<(), UpError> {
        let client = self.replica_client(i)?;
        let deadline = Instant::now() + limit;
        loop {
            let last = match client.get_raw("/readyz").await {
                Ok((status, _)) if status.is_success() => return Ok(()),
                Ok((status, body)) => format!(
                    "/readyz answered {status}: {}",
                    String::from_utf8_lossy(&body)
                ),
                Err(e) => e.to_string(),
            };
            if let Some(status) = self.replica_exit(i)? {
                let replica = self.replica(i)?;
                return Err(UpError::Replica {
                    id: replica.id.clone(),
                    message: format!(
                        "it exited ({status}) while starting; the end of {}:\n{}",
                        replica.log.display(),
                        tail(&replica.log, 20)
                    ),
                });
            }
            if Instant::now() >= deadline {
                let replica = self.replica(i)?;
                return Err(UpError::Replica {
                    id: replica.id.clone(),
                    message: format!(
                        "not ready within {limit:?} ({last}); the end of {}:\n{}",
                        replica.log.display(),
                        tail(&replica.log, 20)
                    ),
                });
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// The exit status of replica `i` if its process has exited (it is then no longer running).
    pub fn replica_exit(&mut self, i: usize) -> Result<Option<ExitStatus>, UpError> {
        let replica = self.replica_mut(i)?;
        let Some(child) = &mut replica.child else {
            return Ok(None);
        };
        match child.try_wait() {
            Ok(Some(status)) => {
                replica.child = None;
                replica.pid = None;
                Ok(Some(status))
            }
            Ok(None) => Ok(None),
            Err(e) => Err(UpError::Replica {
                id: replica.id.clone(),
                message: format!("cannot check on its process: {e}"),
            }),
        }
    }

    /// Whether replica `i`'s process runs.
    pub fn replica_running(&self, i: usize) -> bool {
        self.replicas.get(i).is_some_and(|r| r.child.is_some())
    }

    /// Kills replica `i` (SIGKILL: no drain, its connections reset) and waits until the process is gone.
    pub async fn kill_replica(&mut self, i: usize) -> Result<(), UpError> {
        let replica = self.replica_mut(i)?;
        let id = replica.id.clone();
        let Some(mut child) = replica.child.take() else {
            return Err(UpError::Replica {
                id,
                message: "it is not running".into(),
            });
        };
        replica.pid = None;
        child.kill().await.map_err(|e| UpError::Replica {
            id,
            message: format!("cannot kill it: {e}"),
        })
    }

    /// Sends SIGTERM to replica `i` (it drains: `/readyz` false at once, agents asked to move) without
    /// waiting; see [`Fleet::wait_replica_exit`].
    pub async fn terminate_replica(&mut self, i: usize) -> Result<(), UpError> {
        let replica = self.replica(i)?;
        let Some(pid) = replica.pid else {
            return Err(UpError::Replica {
                id: replica.id.clone(),
                message: "it is not running".into(),
            });
        };
        signal(pid, "TERM").await.map_err(|e| UpError::Replica {
            id: replica.id.clone(),
            message: e,
        })
    }

    /// Waits up to `limit` for replica `i`'s process to exit; its exit status.
    pub async fn wait_replica_exit(
        &mut self,
        i: usize,
        limit: Duration,
    ) -> Result<ExitStatus, UpError> {
        let replica = self.replica_mut(i)?;
        let id = replica.id.clone();
        let Some(child) = &mut replica.child else {
            return Err(UpError::Replica {
                id,
                message: "it is not running".into(),
            });
        };
        match tokio::time::timeout(limit, child.wait()).await {
            Ok(Ok(status)) => {
                replica.child = None;
                replica.pid = None;
                Ok(status)
            }
            Ok(Err(e)) => Err(UpError::Replica {
                id,
                message: format!("cannot wait for it: {e}"),
            }),
            Err(_) => Err(UpError::Replica {
                id,
                message: format!("still running {limit:?} after it was asked to stop"),
            }),
        }
    }

    /// Each replica as the load balancer sees it.
    pub async fn lb_servers(&self) -> Result<Vec<ServerStatus>, UpError> {
        let Some(haproxy) = &self.haproxy else {
            return Err(UpError::LoadBalancer("not running".into()));
        };
        haproxy
            .servers()
            .await
            .map_err(|e| UpError::LoadBalancer(e.to_string()))
    }

    /// Waits up to `limit` until the load balancer's view of the replicas satisfies `check`.
    pub async fn wait_lb(
        &self,
        what: &str,
        limit: Duration,
        check: impl FnMut(&[ServerStatus]) -> bool,
    ) -> Result<Vec<ServerStatus>, UpError> {
        let Some(haproxy) = &self.haproxy else {
            return Err(UpError::LoadBalancer("not running".into()));
        };
        haproxy
            .wait_servers(what, limit, check)
            .await
            .map_err(|e| UpError::LoadBalancer(e.to_string()))
    }

    /// Waits until at least `n` replicas are in the load balancer's rotation.
    pub async fn wait_in_rotation(&self, n: usize, limit: Duration) -> Result<(), UpError> {
        self.wait_lb(&format!("{n} replicas in rotation"), limit, |servers| {
            servers.iter().filter(|s| s.is_up()).count() >= n
        })
        .await
        .map(|_| ())
    }

    /// The cluster as replica `i` reports it (`GET /api/v1/clusters/NAME`, the relay's JSON).
    pub async fn cluster_at(&self, i: usize) -> Result<serde_json::Value, UpError> {
        Ok(self
            .replica_client(i)?
            .show_cluster_json(self.cluster())
            .await?)
    }

    /// Registers the cluster unless this directory's agent is already onboarded at this load balancer's URL;
    /// the onboarding token.
    async fn register(&self) -> Result<Option<Secret>, UpError> {
        let client = self.client()?;
        let name = self.cluster();
        let state = self.agent_state_dir();
        let onboarded_here = match tether_agent::identity::load(&state, &self.lb_url, name) {
            Ok(Some(identity)) => !identity.is_expired(time::OffsetDateTime::now_utc()),
            Ok(None) => false,
            Err(e) => {
                tracing::warn!(error = %e, "the agent's stored identity is unusable; onboarding again");
                false
            }
        };
        match client.show_cluster(name).await {
            Ok(_) if onboarded_here => return Ok(None),
            Ok(_) => client.delete_cluster(name).await?,
            Err(e) if e.status() == Some(http::StatusCode::NOT_FOUND) => {}
            Err(e) => return Err(e.into()),
        }
        if state.exists() {
            std::fs::remove_dir_all(&state).map_err(|source| UpError::Io {
                path: state.clone(),
                source,
            })?;
        }
        let created = client.create_cluster(name, &self.options.up.tags).await?;
        Ok(Some(created.onboarding_token))
    }

    /// The agent's state dir.
    pub fn agent_state_dir(&self) -> PathBuf {
        self.dir().join("agent")
    }

    fn onboarding_token_file(&self) -> PathBuf {
        self.dir().join("agent-onboarding-token")
    }

    /// The agent's log.
    pub fn agent_log(&self) -> PathBuf {
        self.dir().join("logs").join("agent.log")
    }

    fn agent_args(&self, onboarding_token: Option<&Secret>) -> Result<Vec<String>, UpError> {
        let dir = self.dir();
        let mut args = vec![
            "--relay".to_string(),
            self.lb_url.clone(),
            "--cluster".into(),
            self.cluster().to_string(),
            "--state-dir".into(),
            path_arg(&self.agent_state_dir()),
            "--relay-ca".into(),
            path_arg(&dir.join("relay").join("ca.pem")),
            "--kubeconfig".into(),
            path_arg(&self.cluster_kubeconfig),
            "--drain-timeout".into(),
            "5s".into(),
        ];
        if let Some(token) = onboarding_token {
            let file = self.onboarding_token_file();
            write_private(&file, token.expose())?;
            args.extend(["--onboarding-token-file".to_string(), path_arg(&file)]);
        }
        if let Some(entra) = &self.entra {
            args.extend(entra_args(entra));
        }
        if let Some(guard) = &self.guard {
            args.extend([
                "--guard-url".to_string(),
                format!("{}/snapshot", guard.url()),
                "--guard-push-token-file".into(),
                path_arg(&dir.join(GUARD_DIR).join("push-token")),
                "--guard-ca".into(),
                path_arg(&dir.join(GUARD_DIR).join("ca.pem")),
                // Guard takes pushes only with the agent's push certificate besides the token.
                "--guard-client-cert".into(),
                path_arg(&dir.join(GUARD_DIR).join("push.crt")),
                "--guard-client-key".into(),
                path_arg(&dir.join(GUARD_DIR).join("push.key")),
            ]);
        }
        if self.features.agent_tunnels {
            args.extend(["--tunnels".to_string(), self.options.tunnels.to_string()]);
        }
        if self.features.agent_transport {
            // QUIC (UDP) does not go through the load balancer's TCP mode.
            args.extend(["--transport".to_string(), "wss".into()]);
        }
        Ok(args)
    }

    fn spawn_agent(&mut self, onboarding_token: Option<&Secret>) -> Result<(), UpError> {
        if self.agent.is_some() {
            return Err(UpError::Agent("it is running already".into()));
        }
        let args = self.agent_args(onboarding_token)?;
        let child = spawn(
            &self.options.binaries.agent,
            &args,
            &[],
            &self.agent_log(),
            &self.options.log_level,
        )
        .map_err(UpError::Agent)?;
        self.agent_pid = child.id();
        self.agent = Some(child);
        Ok(())
    }

    /// The agent's process id while it runs.
    pub fn agent_pid(&self) -> Option<u32> {
        self.agent_pid
    }

    /// Waits up to `limit` until a replica reports the cluster connected; fails at once if the agent exits.
    pub async fn wait_connected(&mut self, limit: Duration) -> Result<(), UpError> {
        let deadline = Instant::now() + limit;
        loop {
            for i in 0..self.replicas.len() {
                if !self.replica_running(i) {
                    continue;
                }
                if let Ok(cluster) = self.cluster_at(i).await
                    && cluster["connected"] == true
                {
                    return Ok(());
                }
            }
            if let Some(agent) = &mut self.agent
                && let Ok(Some(status)) = agent.try_wait()
            {
                self.agent = None;
                self.agent_pid = None;
                return Err(UpError::Agent(format!(
                    "it exited ({status}); the end of {}:\n{}",
                    self.agent_log().display(),
                    tail(&self.agent_log(), 20)
                )));
            }
            if Instant::now() >= deadline {
                return Err(UpError::NotConnected(limit));
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// Stops the agent (SIGTERM: it drains), waiting up to 15 s before killing it.
    pub async fn stop_agent(&mut self) -> Result<(), UpError> {
        let Some(mut agent) = self.agent.take() else {
            return Ok(());
        };
        if let Some(pid) = self.agent_pid.take() {
            signal(pid, "TERM").await.map_err(UpError::Agent)?;
        }
        if tokio::time::timeout(Duration::from_secs(15), agent.wait())
            .await
            .is_err()
        {
            let _ = agent.kill().await;
            return Err(UpError::Agent(
                "it did not stop within 15 s of SIGTERM".into(),
            ));
        }
        Ok(())
    }

    /// Starts the agent again (with its stored identity) and waits until it is connected.
    pub async fn start_agent(&mut self) -> Result<(), UpError> {
        self.spawn_agent(None)?;
        self.wait_connected(CONNECT_WAIT).await?;
        self.write_fleet_json()
    }

    fn write_files(&self) -> Result<(), UpError> {
        crate::up::write_client_files(
            &self.lb_url,
            self.cluster(),
            &self.ca_pem,
            self.user_token.as_deref(),
            &self.kubeconfig_path,
            &self.config_path,
        )?;
        self.write_fleet_json()
    }

    /// `DIR/fleet.json`: what runs where, for people and scripts (`kill -9 $(jq .replicas[0].pid …)`).
    fn write_fleet_json(&self) -> Result<(), UpError> {
        let replicas: Vec<serde_json::Value> = self
            .replicas
            .iter()
            .map(|r| {
                json!({
                    "id": r.id,
                    "url": r.url(),
                    "peerAddress": r.peer_addr.to_string(),
                    "pid": r.pid,
                    "dataDir": r.data_dir,
                    "log": r.log,
                })
            })
            .collect();
        let document = json!({
            "loadBalancer": {
                "url": self.lb_url,
                "pid": self.haproxy.as_ref().map(HaProxy::pid),
                "config": self.haproxy.as_ref().map(|h| h.config_path().to_path_buf()),
                "log": self.haproxy.as_ref().map(|h| h.log_path().to_path_buf()),
            },
            "database": self.database_shown,
            "databasePassword": self.postgres.as_ref().and_then(Postgres::password_file),
            "databaseLog": self.postgres.as_ref().map(Postgres::log_path),
            "replicas": replicas,
            "agent": { "pid": self.agent_pid, "log": self.agent_log() },
            "fleetFlags": {
                "relayPeering": self.features.relay_peering,
                "agentTunnels": self.features.agent_tunnels,
            },
        });
        let path = self.dir().join("fleet.json");
        let text =
            serde_json::to_string_pretty(&document).map_err(|e| UpError::Config(e.to_string()))?;
        std::fs::write(&path, text + "\n").map_err(|source| UpError::Io { path, source })
    }

    /// Stops everything in the reverse order of the start: the agent (drains), the cluster side, the load
    /// balancer, the replicas (SIGTERM, in parallel; killed after the drain timeout and 10 s more),
    /// PostgreSQL. Every step runs; the first error is returned.
    pub async fn shutdown(mut self) -> Result<(), UpError> {
        self.stop_everything().await
    }

    async fn stop_everything(&mut self) -> Result<(), UpError> {
        let mut first: Option<UpError> = None;
        let mut note = |r: Result<(), UpError>| {
            if let Err(e) = r
                && first.is_none()
            {
                first = Some(e);
            }
        };
        note(self.stop_agent().await);
        if let Some(haproxy) = self.haproxy.take() {
            haproxy.stop().await;
        }
        let grace = self.options.drain_timeout + Duration::from_secs(10);
        for i in 0..self.replicas.len() {
            if self.replica_running(i) {
                note(self.terminate_replica(i).await);
            }
        }
        for i in 0..self.replicas.len() {
            if self.replica_running(i) && self.wait_replica_exit(i, grace).await.is_err() {
                note(self.kill_replica(i).await);
            }
        }
        if let Some(sample) = self.sample.take() {
            sample.shutdown().await;
        }
        if let Some(guard) = &mut self.guard {
            note(guard.stop().await);
        }
        if let Some(issuer) = self.issuer.take() {
            issuer.shutdown().await;
        }
        if let Some(postgres) = self.postgres.take() {
            // pg_ctl waits for the server: off the async threads.
            let _ = tokio::task::spawn_blocking(move || drop(postgres)).await;
        }
        match first {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }

    /// For the foreground command: starts again every replica whose process exited (a replica killed or
    /// stopped from outside comes back, as a Deployment's would) — a second after it exited, or 5 s when it ran
    /// for less than 10 s or failed to start; one line per event.
    async fn supervise(&mut self) -> Vec<String> {
        let mut lines = Vec::new();
        for i in 0..self.replicas.len() {
            match self.replica_exit(i) {
                Ok(Some(status)) => {
                    let replica = &mut self.replicas[i];
                    let brief = replica
                        .started
                        .is_some_and(|s| s.elapsed() < Duration::from_secs(10));
                    let wait = Duration::from_secs(if brief { 5 } else { 1 });
                    replica.not_before = Some(Instant::now() + wait);
                    lines.push(format!(
                        "{} exited ({status}); starting it again in {wait:?}",
                        replica.id
                    ));
                }
                Ok(None) => {}
                Err(e) => lines.push(e.to_string()),
            }
            let replica = &self.replicas[i];
            if self.replica_running(i) || replica.not_before.is_some_and(|t| Instant::now() < t) {
                continue;
            }
            let id = replica.id.clone();
            match self.start_replica(i).await {
                Ok(()) => lines.push(format!("{id} is ready again")),
                Err(e) => {
                    lines.push(format!("{e}"));
                    self.replicas[i].not_before = Some(Instant::now() + Duration::from_secs(5));
                }
            }
        }
        lines
    }
}

/// Starts (or, for a kept home, starts again) the fleet's PostgreSQL and makes sure its database exists.
async fn start_postgres(dir: &Path, home: &DatabaseHome) -> Result<(Postgres, String), UpError> {
    let bindir = postgres::bindir().ok_or_else(|| {
        UpError::MissingProgram(
            "PostgreSQL is not installed: the local fleet's replicas share one (Debian: apt-get install \
             postgresql; or set TETHER_PG_BINDIR to the directory holding initdb and pg_ctl)"
                .into(),
        )
    })?;
    let home = home.clone();
    let dir = dir.to_path_buf();
    tokio::task::spawn_blocking(move || {
        let pg = match home {
            DatabaseHome::Kept => Postgres::start_kept(bindir, &postgres::kept_dir_for(&dir)),
            DatabaseHome::Temporary => Postgres::start_in(bindir),
        }
        .map_err(|e| UpError::Postgres(e.to_string()))?;
        let url = pg
            .ensure_database(DATABASE)
            .map_err(|e| UpError::Postgres(e.to_string()))?;
        Ok((pg, url))
    })
    .await
    .map_err(|e| UpError::Postgres(format!("the start task failed: {e}")))?
}

/// Copies the shared CA files from `shared` into the replica's data dir (created 0700); when they changed,
/// removes the replica's server certificate so that it issues one from the new CA.
fn share_ca_files(shared: &Path, data_dir: &Path) -> Result<(), UpError> {
    create_private_dir(data_dir)?;
    let io = |path: &Path| {
        let path = path.to_path_buf();
        move |source| UpError::Io { path, source }
    };
    let mut changed = false;
    for name in SHARED_CA_FILES {
        let from = shared.join(name);
        let to = data_dir.join(name);
        let bytes = std::fs::read(&from).map_err(io(&from))?;
        if std::fs::read(&to).ok().as_deref() != Some(&bytes[..]) {
            changed = true;
            let text = String::from_utf8_lossy(&bytes);
            write_private(&to, &text)?;
        }
    }
    if changed {
        for name in SERVER_CERT_FILES {
            let path = data_dir.join(name);
            match std::fs::remove_file(&path) {
                Ok(()) => {}
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                Err(e) => return Err(io(&path)(e)),
            }
        }
    }
    Ok(())
}

/// Writes `text` to a new 0600 file at `path` (replacing one that exists).
fn write_private(path: &Path, text: &str) -> Result<(), UpError> {
    use std::io::Write as _;
    use std::os::unix::fs::OpenOptionsExt as _;
    let io = |source| UpError::Io {
        path: path.to_path_buf(),
        source,
    };
    match std::fs::remove_file(path) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(io(e)),
    }
    let mut file = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(path)
        .map_err(io)?;
    file.write_all(text.as_bytes()).map_err(io)
}

fn entra_args(entra: &Entra) -> Vec<String> {
    vec![
        "--entra-tenant".to_string(),
        tether_testkit::dev_issuer::DEV_TENANT.to_string(),
        "--entra-audience".into(),
        entra.audience.clone(),
        "--entra-authority".into(),
        entra.authority.clone(),
        "--entra-authority-ca".into(),
        path_arg(&entra.authority_ca),
    ]
}

/// A path as a program argument (the fleet's paths come from the user's directory: UTF-8 in practice; a
/// lossy one fails visibly at the program).
fn path_arg(path: &Path) -> String {
    path.to_string_lossy().into_owned()
}

/// A duration in the programs' syntax (`500ms`, `5s`).
fn duration_arg(d: Duration) -> String {
    if d.subsec_millis() == 0 {
        format!("{}s", d.as_secs())
    } else {
        format!("{}ms", d.as_millis())
    }
}

/// Spawns `program args…` with `env` added, stdout and stderr appended to `log`, killed if the handle is
/// dropped. The caller's `TETHER_*` variables are not passed on: every setting comes from here.
fn spawn(
    program: &Path,
    args: &[String],
    env: &[(&str, &str)],
    log: &Path,
    log_level: &str,
) -> Result<Child, String> {
    let file = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(log)
        .map_err(|e| format!("cannot open {}: {e}", log.display()))?;
    let stderr = file
        .try_clone()
        .map_err(|e| format!("cannot open {}: {e}", log.display()))?;
    let mut command = Command::new(program);
    command.args(args);
    for (key, _) in std::env::vars_os() {
        if key.to_string_lossy().starts_with("TETHER_") {
            command.env_remove(key);
        }
    }
    command.envs(env.iter().copied());
    if std::env::var_os("RUST_LOG").is_none() {
        command.env("RUST_LOG", log_level);
    }
    command
        .stdin(Stdio::null())
        .stdout(file)
        .stderr(stderr)
        // A process group of its own: Ctrl-C in the terminal reaches `tether` alone, which then stops every
        // process in order (the agent drains before the relays go).
        .process_group(0)
        .kill_on_drop(true)
        .spawn()
        .map_err(|e| format!("cannot start {}: {e}", program.display()))
}

/// Sends a signal by name (`TERM`) with the `kill` command (this crate has no unsafe code for `kill(2)`).
async fn signal(pid: u32, name: &str) -> Result<(), String> {
    let status = Command::new("kill")
        .arg(format!("-{name}"))
        .arg(pid.to_string())
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .await
        .map_err(|e| format!("cannot run kill: {e}"))?;
    if status.success() {
        Ok(())
    } else {
        Err(format!("kill -{name} {pid} failed ({status})"))
    }
}

fn free_port() -> Result<u16, UpError> {
    TcpListener::bind((Ipv4Addr::LOCALHOST, 0))
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .map_err(|e| UpError::Config(format!("cannot find a free port: {e}")))
}

/// The last `n` lines of a log file.
fn tail(path: &Path, n: usize) -> String {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(n)..].join("\n")
}

/// `tether up --replicas N` in the foreground: start, print what to try, keep the replicas running (one that
/// exits is started again) until Ctrl-C or SIGTERM, shut down.
pub async fn run_foreground(args: UpArgs) -> Result<(), UpError> {
    let mut fleet = Fleet::start(FleetOptions::from_args(args)?).await?;
    print_summary(&fleet);
    let stop = tether_runtime::process::shutdown_signal();
    tokio::pin!(stop);
    let mut tick = tokio::time::interval(Duration::from_millis(500));
    loop {
        // Ctrl-C is heard while a replica starts too (what started is stopped by the shutdown).
        let supervised = async {
            tick.tick().await;
            fleet.supervise().await
        };
        tokio::select! {
            () = &mut stop => break,
            lines = supervised => {
                for line in lines {
                    println!("{line}");
                }
            }
        }
    }
    println!("Shutting down…");
    fleet.shutdown().await
}

fn print_summary(fleet: &Fleet) {
    let dir = fleet.dir();
    println!(
        "A Tether relay fleet is up: {} replicas on PostgreSQL behind HAProxy.",
        fleet.replicas.len()
    );
    println!(
        "  load balancer: {}  (users, agents and the admin API; TLS passes through to the replicas)",
        fleet.lb_url
    );
    for r in &fleet.replicas {
        println!(
            "  {}:  {}  pid {}  log {}",
            r.id,
            r.url(),
            r.pid.map(|p| p.to_string()).unwrap_or_default(),
            r.log.display()
        );
    }
    println!("  database:      {}", fleet.database_shown);
    match &fleet.sample {
        Some(sample) => println!(
            "  cluster:       \"{}\" — the sample apiserver at {}, its agent (pid {}) connected through the load \
             balancer over WebSocket",
            fleet.cluster(),
            sample.url(),
            fleet.agent_pid.map(|p| p.to_string()).unwrap_or_default()
        ),
        None => println!(
            "  cluster:       \"{}\" — its agent connected through the load balancer",
            fleet.cluster()
        ),
    }
    if !fleet.features.relay_peering {
        println!(
            "  note: this tether-relay has no peer link (--peer-listen): a request reaches the cluster only through \
             the replica holding its tunnel"
        );
    }
    println!(
        "  state:         {}  (what runs where: fleet.json)",
        dir.display()
    );
    println!();
    let kubeconfig = fleet.kubeconfig_path.display();
    let config = fleet.config_path.display();
    println!("Try:");
    println!("  kubectl --kubeconfig {kubeconfig} get pods -w          # one terminal: a watch");
    println!(
        "  kill -9 $(jq .replicas[0].pid {}/fleet.json)           # another: kill a replica (it comes back)",
        dir.display()
    );
    println!(
        "  kill -TERM $(jq .replicas[1].pid {}/fleet.json)        # or drain one",
        dir.display()
    );
    println!("  kubectl --kubeconfig {kubeconfig} get pods             # still answered");
    println!(
        "  tether --config {config} cluster show {}",
        fleet.cluster()
    );
    if fleet.issuer.is_some() {
        println!(
            "  tether token --dir {} --user alice@contoso.com   # DEVELOPMENT ONLY token; see README's access control",
            dir.display()
        );
    }
    println!();
    println!("Press Ctrl-C to stop.");
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations_use_the_programs_syntax() {
        assert_eq!(duration_arg(Duration::from_secs(5)), "5s");
        assert_eq!(duration_arg(Duration::from_millis(1500)), "1500ms");
    }

    #[test]
    fn replicas_are_counted_from_two() {
        let binaries = FleetBinaries {
            relay: "r".into(),
            agent: "a".into(),
            haproxy: "h".into(),
        };
        let mut options = FleetOptions::for_tests(Path::new("/tmp/x"), binaries);
        assert!(options.validate().is_ok());
        options.replicas = 1;
        assert!(options.validate().is_err_and(|e| e.is_config()));
        options.replicas = MAX_REPLICAS + 1;
        assert!(options.validate().is_err());
        options.replicas = 3;
        options.tunnels = 0;
        assert!(options.validate().is_err());
    }

    #[test]
    fn replicas_get_the_shared_ca_and_reissue_their_certificate_when_it_changes()
    -> anyhow::Result<()> {
        let dir = tempfile::tempdir()?;
        let shared = dir.path().join("relay");
        std::fs::create_dir_all(&shared)?;
        for name in SHARED_CA_FILES {
            std::fs::write(shared.join(name), format!("{name} v1"))?;
        }
        let replica = dir.path().join("relay-1");
        share_ca_files(&shared, &replica)?;
        assert_eq!(
            std::fs::read_to_string(replica.join("ca.pem"))?,
            "ca.pem v1"
        );
        std::fs::write(replica.join("server.pem"), "issued from v1")?;
        share_ca_files(&shared, &replica)?;
        assert!(replica.join("server.pem").exists(), "same CA: kept");
        std::fs::write(shared.join("ca.pem"), "ca.pem v2")?;
        share_ca_files(&shared, &replica)?;
        assert_eq!(
            std::fs::read_to_string(replica.join("ca.pem"))?,
            "ca.pem v2"
        );
        assert!(!replica.join("server.pem").exists(), "new CA: re-issued");
        use std::os::unix::fs::PermissionsExt as _;
        let mode = std::fs::metadata(replica.join("ca-key.pem"))?
            .permissions()
            .mode();
        assert_eq!(mode & 0o777, 0o600);
        Ok(())
    }
}
