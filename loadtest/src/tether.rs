//! Tether driven through its binaries: the `tether-relay` process, its admin REST API, and `tether-agent`
//! processes. Nothing here links the relay or agent crates, so their internals can change freely.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{Context as _, bail};
use bytes::Bytes;
use http::{Method, Request, StatusCode, Uri, header};
use http_body_util::{BodyExt, Full};
use hyper_rustls::HttpsConnector;
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use serde_json::{Value, json};
use tokio::time::Instant;

use crate::certs;
use crate::procs::{self, Proc};

/// Where the Tether binaries are.
#[derive(Debug, Clone)]
pub struct Binaries {
    /// `tether-relay`.
    pub relay: PathBuf,
    /// `tether-agent`.
    pub agent: PathBuf,
    /// `tether-sample-apiserver` (the test kit's stand-in for kube-apiserver), when found.
    pub sample_apiserver: Option<PathBuf>,
}

impl Binaries {
    /// Finds the binaries in `dir`, else next to this executable, else on PATH.
    pub fn locate(dir: Option<&Path>) -> anyhow::Result<Self> {
        let own_dir = std::env::current_exe()
            .ok()
            .and_then(|p| p.parent().map(Path::to_path_buf));
        // Test executables live in target/*/deps; the binaries one level up.
        let candidates: Vec<PathBuf> = dir
            .map(Path::to_path_buf)
            .into_iter()
            .chain(own_dir.iter().cloned())
            .chain(
                own_dir
                    .as_deref()
                    .and_then(Path::parent)
                    .map(Path::to_path_buf),
            )
            .collect();
        let find = |name: &str| {
            candidates
                .iter()
                .map(|d| d.join(name))
                .find(|p| p.is_file())
                .or_else(|| procs::find_program(name, None))
        };
        match (find("tether-relay"), find("tether-agent")) {
            (Some(relay), Some(agent)) => Ok(Self {
                relay,
                agent,
                sample_apiserver: find("tether-sample-apiserver"),
            }),
            _ => bail!(
                "tether-relay and tether-agent not found (looked in {candidates:?} and PATH): build them with \
                 `cargo build --release --workspace --bins` or pass --bin-dir"
            ),
        }
    }
}

/// Options for starting a relay.
#[derive(Debug, Clone, Default)]
pub struct RelayOptions {
    /// A command line to prefix the relay with (e.g. `valgrind --tool=callgrind`).
    pub wrapper: Option<String>,
    /// `RUST_LOG` for the relay.
    pub log_level: String,
    /// Heartbeat interval to ask for, when the relay has a `--heartbeat-interval` flag.
    pub heartbeat_interval: Option<Duration>,
    /// Keep the relay's own per-client bounds (streams, rates, connections per principal and per address)
    /// instead of lifting them; for scenarios whose clients are many principals, as in production.
    pub product_bounds: bool,
    /// More arguments (`--FLAG=VALUE`, e.g. `--entra-*`); a per-client bound given here is not lifted.
    pub extra_args: Vec<String>,
}

/// A running `tether-relay`.
#[derive(Debug)]
pub struct RelayProcess {
    proc: Proc,
    /// Where it listens.
    pub addr: SocketAddr,
    /// Its data directory (database, generated CA, admin token).
    pub data_dir: PathBuf,
    /// The CA that signed its certificate (PEM).
    pub ca_pem: String,
    /// `https://127.0.0.1:PORT`.
    pub url: String,
    admin_token: String,
    http: RelayHttp,
}

type RelayHttp = Client<HttpsConnector<HttpConnector>, Full<Bytes>>;

/// Flags the relay binary advertises in `--help` (the loadtest adapts to what the build supports).
pub fn relay_supports(binary: &Path, flag: &str) -> bool {
    std::process::Command::new(binary)
        .arg("--help")
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).contains(flag))
        .unwrap_or(false)
}

impl RelayOptions {
    /// Whether `flag` is among the extra arguments (`--flag=…` or `--flag`).
    fn names(&self, flag: &str) -> bool {
        self.extra_args
            .iter()
            .any(|a| a == flag || a.strip_prefix(flag).is_some_and(|r| r.starts_with('=')))
    }
}

impl RelayProcess {
    /// Starts a relay on `addr` (a free loopback port when `None`) with `data_dir`, and waits until `/healthz`
    /// answers.
    pub async fn start(
        binary: &Path,
        data_dir: &Path,
        addr: Option<SocketAddr>,
        options: &RelayOptions,
    ) -> anyhow::Result<Self> {
        std::fs::create_dir_all(data_dir)?;
        let mut attempts = 0;
        loop {
            attempts += 1;
            let addr = match addr {
                Some(a) => a,
                None => SocketAddr::from(([127, 0, 0, 1], procs::free_port()?)),
            };
            let mut args = vec![
                "--listen".to_owned(),
                addr.to_string(),
                "--data-dir".to_owned(),
                data_dir.display().to_string(),
                "--hostname".to_owned(),
                "127.0.0.1,localhost".to_owned(),
            ];
            if let Some(hb) = options.heartbeat_interval
                && relay_supports(binary, "--heartbeat-interval")
            {
                args.push("--heartbeat-interval".to_owned());
                args.push(format!("{}s", hb.as_secs().max(1)));
            }
            // The load generator is one principal from one address by design: lift the relay's per-client
            // bounds (issue 10) so they do not shape the figures (unless the scenario's clients are many).
            if !options.product_bounds && relay_supports(binary, "--principal-request-rate") {
                for flag in [
                    "--max-streams-per-principal",
                    "--max-streams-per-ip",
                    "--principal-request-rate",
                    "--principal-request-burst",
                    "--ip-request-rate",
                    "--ip-request-burst",
                ] {
                    if !options.names(flag) {
                        args.push(flag.to_owned());
                        args.push("1000000".to_owned());
                    }
                }
            }
            if !options.product_bounds && relay_supports(binary, "--max-connections-per-principal")
            {
                for flag in [
                    "--max-connections-per-principal",
                    "--max-connections-per-ip",
                    "--max-handshakes-per-ip",
                    "--principal-early-cancel-rate",
                    "--principal-early-cancel-burst",
                    "--ip-early-cancel-rate",
                    "--ip-early-cancel-burst",
                ] {
                    if !options.names(flag) {
                        args.push(flag.to_owned());
                        args.push("1000000".to_owned());
                    }
                }
            }
            args.extend(options.extra_args.iter().cloned());
            let log = data_dir.join("relay.log");
            let proc = Proc::spawn(
                "tether-relay",
                options.wrapper.as_deref(),
                binary,
                &args,
                &[("RUST_LOG", &options.log_level)],
                &log,
            )?;
            match Self::ready(proc, addr, data_dir).await {
                Ok(relay) => return Ok(relay),
                // Another process may have taken the port we picked: pick again.
                Err(e) if attempts < 3 && procs::tail(&log, 5).contains("in use") => {
                    tracing::debug!(error = %e, "relay port taken, retrying");
                }
                Err(e) => return Err(e),
            }
        }
    }

    async fn ready(mut proc: Proc, addr: SocketAddr, data_dir: &Path) -> anyhow::Result<Self> {
        let deadline = Instant::now() + Duration::from_secs(60);
        let ca_path = data_dir.join("ca.pem");
        let token_path = data_dir.join("admin-token");
        loop {
            proc.check_running()?;
            if ca_path.is_file()
                && token_path.is_file()
                && tokio::net::TcpStream::connect(addr).await.is_ok()
            {
                break;
            }
            if Instant::now() > deadline {
                bail!("the relay did not start within 60 s");
            }
            tokio::time::sleep(Duration::from_millis(25)).await;
        }
        let ca_pem = std::fs::read_to_string(&ca_path)?;
        let admin_token = std::fs::read_to_string(&token_path)?.trim().to_owned();
        let tls = (*certs::client_config(&[&ca_pem], &[], None)?).clone();
        let connector = hyper_rustls::HttpsConnectorBuilder::new()
            .with_tls_config(tls)
            .https_only()
            .enable_http1()
            .build();
        let http = Client::builder(TokioExecutor::new()).build(connector);
        let relay = Self {
            proc,
            addr,
            data_dir: data_dir.to_path_buf(),
            ca_pem,
            url: format!("https://{addr}"),
            admin_token,
            http,
        };
        loop {
            match relay.call(Method::GET, "/healthz", None, false).await {
                Ok((StatusCode::OK, _)) => return Ok(relay),
                _ if Instant::now() > deadline => {
                    bail!("the relay's /healthz did not answer within 60 s")
                }
                _ => tokio::time::sleep(Duration::from_millis(25)).await,
            }
        }
    }

    /// The relay's process id.
    pub fn pid(&self) -> u32 {
        self.proc.pid()
    }

    /// The relay process.
    pub fn process(&self) -> &Proc {
        &self.proc
    }

    /// Stops the relay with SIGTERM (it drains), killing it after `grace`.
    pub async fn stop(self, grace: Duration) -> Duration {
        self.proc.stop(grace).await
    }

    /// Kills the relay (SIGKILL), as a crash would.
    pub async fn kill(self) {
        self.proc.kill().await;
    }

    async fn call(
        &self,
        method: Method,
        path: &str,
        body: Option<Value>,
        admin: bool,
    ) -> anyhow::Result<(StatusCode, Value)> {
        let uri: Uri = format!("{}{path}", self.url).parse()?;
        let mut req = Request::builder().method(method).uri(uri);
        if admin {
            req = req.header(
                header::AUTHORIZATION,
                format!("Bearer {}", self.admin_token),
            );
        }
        let body = match body {
            Some(v) => {
                req = req.header(header::CONTENT_TYPE, "application/json");
                Full::new(Bytes::from(v.to_string()))
            }
            None => Full::new(Bytes::new()),
        };
        let resp =
            tokio::time::timeout(Duration::from_secs(30), self.http.request(req.body(body)?))
                .await
                .context("relay API call timed out")??;
        let status = resp.status();
        let bytes = tokio::time::timeout(Duration::from_secs(30), resp.into_body().collect())
            .await
            .context("relay API body timed out")??
            .to_bytes();
        let value = serde_json::from_slice(&bytes).unwrap_or(Value::Null);
        Ok((status, value))
    }

    /// Registers cluster `name` and returns its one-time onboarding token.
    pub async fn register(&self, name: &str) -> anyhow::Result<String> {
        let (status, body) = self
            .call(
                Method::POST,
                "/api/v1/clusters",
                Some(json!({"name": name})),
                true,
            )
            .await?;
        if status != StatusCode::CREATED {
            bail!("registering {name}: HTTP {status}: {body}");
        }
        body["onboardingToken"]
            .as_str()
            .map(str::to_owned)
            .context("no onboardingToken in the registration answer")
    }

    /// The cluster as the admin API shows it.
    pub async fn cluster(&self, name: &str) -> anyhow::Result<Value> {
        let (status, body) = self
            .call(Method::GET, &format!("/api/v1/clusters/{name}"), None, true)
            .await?;
        if status != StatusCode::OK {
            bail!("cluster {name}: HTTP {status}: {body}");
        }
        Ok(body)
    }

    /// Waits until the admin API shows `name` connected.
    pub async fn wait_connected(&self, name: &str, limit: Duration) -> anyhow::Result<()> {
        let deadline = Instant::now() + limit;
        loop {
            let c = self.cluster(name).await?;
            if c["connected"] == true {
                return Ok(());
            }
            if Instant::now() > deadline {
                bail!("cluster {name} did not connect within {limit:?}: {c}");
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// `POST /agent/v1/onboard` with a CSR (for relays that issue certificates) — older relays ignore the CSR
    /// and answer with a bearer credential.
    pub async fn onboard(
        &self,
        cluster: &str,
        token: &str,
        csr_pem: &str,
    ) -> anyhow::Result<Value> {
        let (status, body) = self
            .call(
                Method::POST,
                "/agent/v1/onboard",
                Some(json!({"cluster": cluster, "token": token, "csr": csr_pem})),
                false,
            )
            .await?;
        if status != StatusCode::OK {
            bail!("onboarding {cluster}: HTTP {status}: {body}");
        }
        Ok(body)
    }
}

/// Writes a kubeconfig naming the upstream at `server` (trusting `ca_pem`) with a dummy token.
pub fn write_kubeconfig(path: &Path, server: &str, ca_pem: &str) -> anyhow::Result<()> {
    write_kubeconfig_with_token(path, server, ca_pem, "loadtest")
}

/// Writes a kubeconfig naming `server` (trusting `ca_pem`) with a bearer `token`, readable by its owner only.
pub fn write_kubeconfig_with_token(
    path: &Path,
    server: &str,
    ca_pem: &str,
    token: &str,
) -> anyhow::Result<()> {
    use base64::Engine as _;
    let ca = base64::engine::general_purpose::STANDARD.encode(ca_pem);
    let config = json!({
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "upstream", "cluster": {"server": server, "certificate-authority-data": ca}}],
        "users": [{"name": "loadtest", "user": {"token": token}}],
        "contexts": [{"name": "upstream", "context": {"cluster": "upstream", "user": "loadtest"}}],
        "current-context": "upstream",
    });
    let text = serde_yaml::to_string(&config)?;
    use std::io::Write as _;
    use std::os::unix::fs::OpenOptionsExt as _;
    let mut file = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o600)
        .open(path)?;
    file.write_all(text.as_bytes())?;
    Ok(())
}

/// Options for starting an agent.
#[derive(Debug, Clone, Default)]
pub struct AgentOptions {
    /// A command line to prefix the agent with (e.g. `valgrind --tool=callgrind`).
    pub wrapper: Option<String>,
    /// `RUST_LOG` for the agent.
    pub log_level: String,
    /// More flags for the agent (e.g. `--health-listen ADDR` for its `/metrics`).
    pub extra_args: Vec<String>,
}

/// A running `tether-agent` serving one cluster.
#[derive(Debug)]
pub struct AgentProcess {
    proc: Proc,
}

impl AgentProcess {
    /// Onboards (with `onboarding_token`) and runs an agent for `cluster` against `relay`, forwarding to the
    /// apiserver named by `kubeconfig`; waits until the relay shows the cluster connected.
    pub async fn start(
        binary: &Path,
        relay: &RelayProcess,
        cluster: &str,
        onboarding_token: &str,
        kubeconfig: &Path,
        dir: &Path,
        options: &AgentOptions,
    ) -> anyhow::Result<Self> {
        let state = dir.join(format!("agent-{cluster}"));
        std::fs::create_dir_all(&state)?;
        let token_file = state.join("onboarding-token");
        std::fs::write(&token_file, onboarding_token)?;
        let ca_file = state.join("relay-ca.pem");
        std::fs::write(&ca_file, &relay.ca_pem)?;
        let args = [
            "--relay",
            &relay.url,
            "--cluster",
            cluster,
            "--onboarding-token-file",
            &token_file.display().to_string(),
            "--state-dir",
            &state.display().to_string(),
            "--relay-ca",
            &ca_file.display().to_string(),
            "--kubeconfig",
            &kubeconfig.display().to_string(),
        ]
        .map(str::to_owned)
        .into_iter()
        .chain(options.extra_args.iter().cloned())
        .collect::<Vec<_>>();
        let log = dir.join(format!("agent-{cluster}.log"));
        let mut proc = Proc::spawn(
            "tether-agent",
            options.wrapper.as_deref(),
            binary,
            &args,
            &[("RUST_LOG", &options.log_level)],
            &log,
        )?;
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            proc.check_running()?;
            if relay.cluster(cluster).await?["connected"] == true {
                return Ok(Self { proc });
            }
            if Instant::now() > deadline {
                bail!(
                    "agent for {cluster} did not connect within 60 s; its log:\n{}",
                    procs::tail(&log, 15)
                );
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// The agent process.
    pub fn process(&self) -> &Proc {
        &self.proc
    }

    /// Stops the agent (SIGTERM, then kill after `grace`).
    pub async fn stop(self, grace: Duration) {
        self.proc.stop(grace).await;
    }

    /// Kills the agent (SIGKILL), as a crash or an OOM kill would: no drain, its sockets just close.
    pub async fn kill(self) {
        self.proc.kill().await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_bound_given_as_a_relay_argument_is_not_lifted() {
        let options = RelayOptions {
            extra_args: vec![
                "--principal-early-cancel-rate=10".into(),
                "--max-handshakes-per-ip".into(),
            ],
            ..RelayOptions::default()
        };
        assert!(options.names("--principal-early-cancel-rate"));
        assert!(options.names("--max-handshakes-per-ip"));
        assert!(!options.names("--principal-early-cancel-burst"));
        assert!(!options.names("--principal-early-cancel"));
    }
}
