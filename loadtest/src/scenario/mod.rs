//! The scenarios and the environment they share: working directory, progress bars, the upstream child
//! process, and the Tether, rathole and HAProxy paths to it.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use anyhow::Context as _;
use indicatif::{ProgressBar, ProgressStyle};
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::Command;

use crate::certs::ServerTls;
use crate::cli::{AgentTransport, CommonArgs, PathKind};
use crate::client::{self, HttpClient, LoadPlan, Protocol, Target};
use crate::peers::{Haproxy, Rathole};
use crate::procs::{self, Proc};
use crate::report::{Figure, Report};
use crate::tether::{AgentOptions, AgentProcess, Binaries, RelayOptions, RelayProcess};
use crate::upstream;

pub mod bulk;
pub mod churn;
pub mod failover;
pub mod hol;
pub mod reconnect;
pub mod requests;
pub mod tunnels;
pub mod watches;

/// What every scenario needs: options, a working directory, progress bars.
#[derive(Debug)]
pub struct Env {
    /// The shared options.
    pub common: CommonArgs,
    /// Working directory (data dirs, configs, process logs).
    pub work: PathBuf,
    _tmp: Option<tempfile::TempDir>,
}

impl Env {
    /// Sets up the working directory.
    pub fn new(common: CommonArgs) -> anyhow::Result<Self> {
        let (work, tmp) = match &common.work_dir {
            Some(dir) => {
                std::fs::create_dir_all(dir)?;
                (dir.clone(), None)
            }
            None => {
                let tmp = tempfile::Builder::new()
                    .prefix("tether-loadtest-")
                    .tempdir()?;
                (tmp.path().to_path_buf(), Some(tmp))
            }
        };
        Ok(Self {
            common,
            work,
            _tmp: tmp,
        })
    }

    /// A fresh subdirectory of the working directory.
    pub fn dir(&self, name: &str) -> anyhow::Result<PathBuf> {
        let d = self.work.join(name);
        if d.exists() {
            std::fs::remove_dir_all(&d)?;
        }
        std::fs::create_dir_all(&d)?;
        Ok(d)
    }

    /// A progress bar of `len` steps (hidden with --no-progress or when stderr is not a terminal).
    pub fn bar(&self, len: u64, message: &str) -> ProgressBar {
        if self.common.no_progress {
            return ProgressBar::hidden();
        }
        let bar = ProgressBar::new(len);
        if let Ok(style) =
            ProgressStyle::with_template("{msg:32} [{bar:36}] {pos}/{len} {elapsed_precise}")
        {
            bar.set_style(style.progress_chars("=> "));
        }
        bar.set_message(message.to_owned());
        bar
    }

    /// Prints a line without tearing progress bars.
    pub fn say(&self, line: &str) {
        eprintln!("{line}");
    }

    /// The Tether binaries.
    pub fn binaries(&self) -> anyhow::Result<Binaries> {
        Binaries::locate(self.common.bin_dir.as_deref())
    }

    /// The rathole binary, if one can be found.
    pub fn rathole_binary(&self) -> Option<PathBuf> {
        self.common
            .rathole
            .clone()
            .or_else(|| procs::find_program("rathole", None))
    }

    /// The HAProxy binary, if one can be found: `--haproxy`, else `$TETHER_HAPROXY`, `PATH`, `/usr/sbin`.
    pub fn haproxy_binary(&self) -> Option<PathBuf> {
        self.common
            .haproxy
            .clone()
            .or_else(tether_testkit::haproxy::HaProxy::binary)
    }

    /// The iperf3 binary, if one can be found.
    pub fn iperf3_binary(&self) -> Option<PathBuf> {
        self.common
            .iperf3
            .clone()
            .or_else(|| procs::find_program("iperf3", None))
    }

    /// Starts a relay with data under `name`.
    pub async fn relay(
        &self,
        name: &str,
        heartbeat: Option<Duration>,
    ) -> anyhow::Result<RelayProcess> {
        let bins = self.binaries()?;
        let dir = self.dir(name)?;
        RelayProcess::start(&bins.relay, &dir, None, &self.relay_options(heartbeat)).await
    }

    /// The relay options these common options give.
    pub fn relay_options(&self, heartbeat: Option<Duration>) -> RelayOptions {
        RelayOptions {
            wrapper: self.common.relay_wrapper.clone(),
            log_level: self.common.log_level.clone(),
            heartbeat_interval: heartbeat,
            extra_args: self.common.relay_args.clone(),
            ..RelayOptions::default()
        }
    }

    /// Starts the upstream as a child process (its own CPU, apart from the load client's).
    pub async fn upstream(&self, list_items: usize) -> anyhow::Result<UpstreamProcess> {
        let dir = self.dir("upstream")?;
        let tls = ServerTls::generate()?;
        let cert = dir.join("upstream.crt");
        let key = dir.join("upstream.key");
        std::fs::write(&cert, &tls.cert_pem)?;
        std::fs::write(&key, &tls.key_pem)?;
        let exe = std::env::current_exe()?;
        let mut command = Command::new(exe);
        command
            .arg("upstream")
            .arg("--cert")
            .arg(&cert)
            .arg("--key")
            .arg(&key)
            .arg("--list-items")
            .arg(list_items.to_string());
        let mut proc =
            Proc::spawn_command("upstream", command, &[], &dir.join("upstream.log"), true)?;
        let stdout = proc.child_mut().stdout.take().context("upstream stdout")?;
        let mut lines = BufReader::new(stdout).lines();
        let line = tokio::time::timeout(Duration::from_secs(20), lines.next_line())
            .await
            .context("the upstream did not start within 20 s")??
            .context("the upstream exited before listening")?;
        let addr: SocketAddr = line
            .strip_prefix("listening on ")
            .context("unexpected upstream output")?
            .parse()?;
        Ok(UpstreamProcess {
            proc,
            addr,
            ca_pem: tls.ca_pem,
            dir,
        })
    }

    /// The agent's extra flags: `--transport transport` when given, then every `--agent-arg`.
    pub fn agent_args(&self, transport: Option<AgentTransport>) -> Vec<String> {
        let mut args: Vec<String> = transport
            .map(|t| vec!["--transport".to_owned(), t.as_str().to_owned()])
            .unwrap_or_default();
        args.extend(self.common.agent_args.iter().cloned());
        args
    }

    /// Starts a relay and an agent for cluster `loadtest` in front of `up`, the agent with `--transport
    /// transport` when given; `label` names the path in reports.
    pub async fn tether_path(
        &self,
        up: &UpstreamProcess,
        transport: Option<AgentTransport>,
        label: String,
    ) -> anyhow::Result<TetherPath> {
        let bins = self.binaries()?;
        let name = match transport {
            Some(t) => format!("relay-{}", t.as_str()),
            None => "relay".to_owned(),
        };
        let relay = self.relay(&name, None).await?;
        let token = relay.register("loadtest").await?;
        let kubeconfig = up.dir.join("kubeconfig");
        crate::tether::write_kubeconfig(&kubeconfig, &format!("https://{}", up.addr), &up.ca_pem)?;
        let agent = AgentProcess::start(
            &bins.agent,
            &relay,
            "loadtest",
            &token,
            &kubeconfig,
            &self.dir(&name.replace("relay", "agent"))?,
            &AgentOptions {
                wrapper: self.common.agent_wrapper.clone(),
                log_level: self.common.log_level.clone(),
                extra_args: self.agent_args(transport),
            },
        )
        .await?;
        Ok(TetherPath {
            label,
            relay,
            agent,
        })
    }

    /// The Tether paths to measure: one per `--transport`, or one with the agent's default.
    pub async fn tether_paths(&self, up: &UpstreamProcess) -> anyhow::Result<Vec<TetherPath>> {
        let mut transports = self.common.transport.clone();
        transports.dedup();
        if transports.is_empty() {
            return Ok(vec![self.tether_path(up, None, "tether".to_owned()).await?]);
        }
        let mut paths = Vec::new();
        for t in transports {
            paths.push(
                self.tether_path(up, Some(t), format!("tether {}", t.as_str()))
                    .await?,
            );
        }
        Ok(paths)
    }

    /// Starts rathole in front of `up`, or explains why not.
    pub async fn rathole(&self, up: &UpstreamProcess) -> Result<Rathole, String> {
        let Some(bin) = self.rathole_binary() else {
            return Err(
                "rathole not found (cargo install rathole): rathole runs skipped".to_owned(),
            );
        };
        let probe = async {
            let client = client::http_client(&[&up.ca_pem], Protocol::H1)?;
            Rathole::start(
                &bin,
                &self.dir("rathole")?,
                up.addr,
                self.common.rathole_transport,
                &client,
                "/version",
            )
            .await
        };
        probe
            .await
            .map_err(|e| format!("rathole could not start: {e:#}"))
    }

    /// Starts HAProxy in front of `up` with a certificate of its own, or explains why not.
    pub async fn haproxy(&self, up: &UpstreamProcess) -> Result<Haproxy, String> {
        let Some(bin) = self.haproxy_binary() else {
            return Err(
                "haproxy not found (apt-get install haproxy, or --haproxy PATH): haproxy runs skipped"
                    .to_owned(),
            );
        };
        let probe = async {
            let tls = ServerTls::generate()?;
            let client = client::http_client(&[&tls.ca_pem], Protocol::H1)?;
            Haproxy::start(
                &bin,
                &self.dir("haproxy")?,
                up.addr,
                &up.ca_pem,
                &tls,
                &client,
                "/version",
            )
            .await
        };
        probe
            .await
            .map_err(|e| format!("haproxy could not start: {e:#}"))
    }

    /// The paths asked for, starting what each needs; unavailable peers are noted in `report` and skipped.
    pub async fn paths(
        &self,
        up: &UpstreamProcess,
        wanted: &[PathKind],
        report: &mut Report,
    ) -> anyhow::Result<Paths> {
        let mut paths = Paths::default();
        let mut wanted = wanted.to_vec();
        wanted.dedup();
        for kind in wanted {
            match kind {
                PathKind::Direct => paths.direct = true,
                PathKind::Tether => {
                    paths.tether = self.tether_paths(up).await?;
                    let mut shown = Vec::new();
                    for path in &paths.tether {
                        shown.push(format!("{}={}", path.label, tunnel_transport(path).await?));
                    }
                    report.setting("tunnel_transport", shown.join(","));
                }
                PathKind::Rathole => match self.rathole(up).await {
                    Ok(r) => paths.rathole = Some(r),
                    Err(note) => report.notes.push(note),
                },
                PathKind::Haproxy => match self.haproxy(up).await {
                    Ok(h) => paths.haproxy = Some(h),
                    Err(note) => report.notes.push(note),
                },
            }
        }
        Ok(paths)
    }
}

/// The transport `path`'s tunnel runs on, as the relay's admin API shows it: what the agent chose with
/// `auto`, so a report says which one its `tether` figures are of.
async fn tunnel_transport(path: &TetherPath) -> anyhow::Result<String> {
    let cluster = path.relay.cluster("loadtest").await?;
    cluster["tunnels"]
        .as_array()
        .and_then(|t| t.first())
        .and_then(|t| t["transport"].as_str())
        .map(str::to_owned)
        .with_context(|| format!("the relay shows no tunnel for {}: {cluster}", path.label))
}

/// The upstream child process.
#[derive(Debug)]
pub struct UpstreamProcess {
    /// The process.
    pub proc: Proc,
    /// Where it listens.
    pub addr: SocketAddr,
    /// The CA its certificate chains to.
    pub ca_pem: String,
    /// Its directory (certificates, kubeconfig for agents).
    pub dir: PathBuf,
}

/// Relay and agent in front of the upstream.
#[derive(Debug)]
pub struct TetherPath {
    /// The path's label in reports (`tether`, or `tether quic`, `tether wss`).
    pub label: String,
    /// The relay.
    pub relay: RelayProcess,
    /// The agent for cluster `loadtest`.
    pub agent: AgentProcess,
}

/// The paths a scenario measures.
#[derive(Debug, Default)]
pub struct Paths {
    /// Straight to the upstream.
    pub direct: bool,
    /// Through relay and agent: one per measured agent transport.
    pub tether: Vec<TetherPath>,
    /// Through rathole.
    pub rathole: Option<Rathole>,
    /// Through HAProxy.
    pub haproxy: Option<Haproxy>,
}

impl Paths {
    /// The targets in measuring order, each with the processes on its path (for CPU accounting).
    pub fn targets(&self, up: &UpstreamProcess) -> Vec<(Target, Vec<(String, u32)>)> {
        let mut out = Vec::new();
        let upstream = ("upstream".to_owned(), up.proc.pid());
        if self.direct {
            out.push((
                Target {
                    label: "direct".into(),
                    base: format!("https://{}", up.addr),
                },
                vec![upstream.clone()],
            ));
        }
        for t in &self.tether {
            out.push((
                Target {
                    label: t.label.clone(),
                    base: format!("{}/clusters/loadtest", t.relay.url),
                },
                vec![
                    ("relay".to_owned(), t.relay.pid()),
                    ("agent".to_owned(), t.agent.process().pid()),
                    upstream.clone(),
                ],
            ));
        }
        if let Some(r) = &self.rathole {
            out.push((
                Target {
                    label: "rathole".into(),
                    base: format!("https://{}", r.service),
                },
                vec![
                    ("rathole server".to_owned(), r.server.pid()),
                    ("rathole client".to_owned(), r.client.pid()),
                    upstream.clone(),
                ],
            ));
        }
        if let Some(h) = &self.haproxy {
            out.push((
                Target {
                    label: "haproxy".into(),
                    base: format!("https://{}", h.addr),
                },
                vec![("haproxy".to_owned(), h.proc.pid()), upstream],
            ));
        }
        out
    }

    /// The CAs a client must trust to reach every target.
    pub fn client(&self, up: &UpstreamProcess, protocol: Protocol) -> anyhow::Result<HttpClient> {
        let mut cas = vec![up.ca_pem.as_str()];
        for t in &self.tether {
            cas.push(&t.relay.ca_pem);
        }
        if let Some(h) = &self.haproxy {
            cas.push(&h.ca_pem);
        }
        client::http_client(&cas, protocol)
    }

    /// Stops every process.
    pub async fn stop(self) {
        for t in self.tether {
            t.agent.stop(Duration::from_secs(5)).await;
            t.relay.stop(Duration::from_secs(5)).await;
        }
        if let Some(r) = self.rathole {
            r.stop().await;
        }
        if let Some(h) = self.haproxy {
            h.stop().await;
        }
    }
}

/// The labels of the Tether runs in `report` that measure one agent transport each (`tether quic`, …).
pub fn transport_labels(report: &Report) -> (Option<String>, Option<String>) {
    let find = |t: &str| {
        let label = format!("tether {t}");
        report
            .runs
            .iter()
            .any(|r| r.label == label || r.label.starts_with(&format!("{label} ")))
            .then_some(label)
    };
    (find("quic"), find("wss"))
}

/// CPU time of a set of processes (and of this one) over a measured period.
#[derive(Debug)]
pub struct CpuMeter {
    start: Vec<(String, u32, Option<Duration>)>,
    own: Option<Duration>,
}

impl CpuMeter {
    /// Starts measuring `procs` (name, pid).
    pub fn start(procs: &[(String, u32)]) -> Self {
        Self {
            start: procs
                .iter()
                .map(|(n, pid)| (n.clone(), *pid, procs::cpu_time(*pid)))
                .collect(),
            own: procs::own_cpu_time(),
        }
    }

    /// CPU time used since the start, per process, with the load client (this process) last.
    pub fn finish(&self) -> Vec<(String, Duration)> {
        let mut out: Vec<(String, Duration)> = self
            .start
            .iter()
            .filter_map(|(n, pid, start)| {
                Some((n.clone(), procs::cpu_time(*pid)?.saturating_sub((*start)?)))
            })
            .collect();
        if let (Some(a), Some(b)) = (self.own, procs::own_cpu_time()) {
            out.push(("load client".to_owned(), b.saturating_sub(a)));
        }
        out
    }
}

/// CPU time of a set of processes (and of this one) over a load run's measured window: from the end of its
/// warm-up to the end of its duration, the window in which `client::run_load` counts requests and bytes. A
/// meter over the whole run adds the warm-up's CPU to the window's requests: 5–12 % more per request with the
/// defaults (docs/BENCHMARKS.md, twenty-fifth pass).
#[derive(Debug)]
pub struct WindowMeter {
    task: tokio::task::JoinHandle<Vec<(String, Duration)>>,
}

impl WindowMeter {
    /// Starts measuring `procs` (name, pid) over the window of `plan`, for a run that starts now.
    pub fn start(procs: &[(String, u32)], plan: &LoadPlan) -> Self {
        let from = tokio::time::Instant::now() + plan.warmup;
        let until = from + plan.duration;
        let procs = procs.to_vec();
        let task = tokio::spawn(async move {
            tokio::time::sleep_until(from).await;
            let meter = CpuMeter::start(&procs);
            tokio::time::sleep_until(until).await;
            meter.finish()
        });
        Self { task }
    }

    /// CPU time over the window, per process, with the load client last; waits for the window to end.
    pub async fn finish(self) -> Vec<(String, Duration)> {
        self.task.await.unwrap_or_default()
    }

    /// Adds "CPU µs per request" figures for `label` to `report`.
    pub async fn per_request_figures(self, report: &mut Report, label: &str, requests: u64) {
        let cpu = self.finish().await;
        if requests == 0 {
            return;
        }
        for (name, cpu) in cpu {
            report.figures.push(Figure::new(
                format!("{label}: {name} CPU per request"),
                cpu.as_secs_f64() * 1e6 / requests as f64,
                "µs",
            ));
        }
    }
}

/// Serves the upstream in this process until SIGTERM/SIGINT (the `upstream` subcommand).
pub async fn serve_upstream(args: &crate::cli::UpstreamArgs) -> anyhow::Result<()> {
    let cert = std::fs::read_to_string(&args.cert)?;
    let key = std::fs::read_to_string(&args.key)?;
    let tls = ServerTls {
        ca_pem: String::new(),
        cert_pem: cert,
        key_pem: key,
    }
    .server_config()?;
    upstream::bind_and_serve(
        args.listen,
        tls,
        args.list_items,
        |addr| println!("listening on {addr}"),
        tether_runtime::process::shutdown_signal(),
    )
    .await
}

/// Stops `up` (kills it: it holds no state).
pub async fn stop_upstream(up: UpstreamProcess) {
    up.proc.kill().await;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_window_meter_reports_each_process_and_this_one_per_request() {
        let plan = LoadPlan {
            concurrency: 1,
            warmup: Duration::from_millis(20),
            duration: Duration::from_millis(50),
            schedule: Vec::new(),
            request_timeout: Duration::from_secs(1),
            interval: Duration::from_millis(10),
            timeline_bytes: false,
        };
        let me = std::process::id();
        let meter = WindowMeter::start(&[("self".to_owned(), me)], &plan);
        let mut report = Report::new("test");
        meter.per_request_figures(&mut report, "path", 10).await;
        let names: Vec<&str> = report.figures.iter().map(|f| f.name.as_str()).collect();
        assert_eq!(
            names,
            [
                "path: self CPU per request",
                "path: load client CPU per request"
            ]
        );
        // No requests, no figures (and no division by zero).
        let meter = WindowMeter::start(&[("self".to_owned(), me)], &plan);
        let mut report = Report::new("test");
        meter.per_request_figures(&mut report, "path", 0).await;
        assert!(report.figures.is_empty());
    }
}
