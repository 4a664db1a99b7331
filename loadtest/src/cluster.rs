//! A whole Tether path to a Kubernetes-like apiserver, every piece its own process as in production:
//! `tether-sample-apiserver` (the test kit's stand-in for kube-apiserver, with kube-apiserver's limit of 100
//! HTTP/2 streams per connection), `tether-relay` with its **product defaults** for every per-client bound,
//! and `tether-agent` with its `/metrics`. The development token issuer runs in this process and mints
//! Entra-style tokens for as many principals as a scenario wants: the relay validates each (so it counts
//! principals by their `oid`, as in production) and the agent validates it again and impersonates the user
//! on its own credentials. Users reach the relay from any loopback address (127.0.0.0/8), so principals can
//! come from addresses of their own, as they would from their own machines.
//!
//! What it does not do: anything beyond loopback, or guard (the sample apiserver allows every authenticated
//! request).

use std::net::{IpAddr, SocketAddr};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context as _, bail};
use bytes::Bytes;
use http::{Request, StatusCode, header};
use http_body_util::{BodyExt as _, Full};
use hyper_util::rt::TokioIo;
use tether_testkit::dev_issuer::{DEV_AUDIENCE, DEV_TENANT, DevIssuer, TokenRequest};
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
use tokio::time::Instant;

use crate::certs;
use crate::procs::{self, Proc};
use crate::tether::{AgentOptions, AgentProcess, Binaries, RelayOptions, RelayProcess};

/// The cluster's name at the relay.
pub const CLUSTER: &str = "sample";

/// What to start.
#[derive(Debug, Clone, Default)]
pub struct ClusterOptions {
    /// `RUST_LOG` of the relay, the agent and the sample apiserver.
    pub log_level: String,
    /// More flags for the relay.
    pub relay_args: Vec<String>,
    /// More flags for the agent.
    pub agent_args: Vec<String>,
}

/// A user's TLS connection to the relay.
pub type Tls = tokio_rustls::client::TlsStream<tokio::net::TcpStream>;

/// Connects users to the relay from chosen loopback addresses.
#[derive(Clone)]
pub struct Connector {
    relay: SocketAddr,
    h1: tokio_rustls::TlsConnector,
    h2: tokio_rustls::TlsConnector,
}

impl Connector {
    /// A TLS connection from `from`, with ALPN `h2` or `http/1.1` as `http2` says.
    pub async fn connect(&self, from: IpAddr, http2: bool) -> anyhow::Result<Tls> {
        let socket = match from {
            IpAddr::V4(_) => tokio::net::TcpSocket::new_v4()?,
            IpAddr::V6(_) => tokio::net::TcpSocket::new_v6()?,
        };
        socket.bind(SocketAddr::new(from, 0))?;
        socket.set_nodelay(true)?;
        let tcp = socket.connect(self.relay).await?;
        let name = rustls::pki_types::ServerName::IpAddress(self.relay.ip().into());
        let tls = if http2 { &self.h2 } else { &self.h1 };
        Ok(tls.connect(name, tcp).await?)
    }
}

/// The running processes and the issuer; everything is killed when dropped.
pub struct SampleCluster {
    /// The relay (product defaults, Entra-style tokens validated).
    pub relay: RelayProcess,
    /// The agent, `None` once killed.
    agent: Option<AgentProcess>,
    /// The agent's `/readyz`, `/livez` and `/metrics` (plain HTTP).
    pub agent_metrics: SocketAddr,
    sample: Proc,
    /// The sample apiserver's directory (kubeconfig, CA, admin token).
    pub sample_dir: PathBuf,
    /// The sample apiserver's address.
    pub sample_addr: SocketAddr,
    issuer: DevIssuer,
    tls: Arc<rustls::ClientConfig>,
}

impl std::fmt::Debug for SampleCluster {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SampleCluster")
            .field("relay", &self.relay.url)
            .field("sample", &self.sample_addr)
            .finish_non_exhaustive()
    }
}

impl SampleCluster {
    /// Starts the sample apiserver, the issuer, the relay and the agent under `dir`, and waits until the
    /// cluster is connected.
    pub async fn start(
        bins: &Binaries,
        dir: &Path,
        options: &ClusterOptions,
    ) -> anyhow::Result<Self> {
        let sample_bin = bins.sample_apiserver.as_deref().context(
            "tether-sample-apiserver not found: build it with `cargo build --release -p tether-testkit --bins` \
             or pass --bin-dir",
        )?;
        let sample_dir = dir.join("sample");
        std::fs::create_dir_all(&sample_dir)?;
        let sample_addr = SocketAddr::from(([127, 0, 0, 1], procs::free_port()?));
        let mut sample = Proc::spawn(
            "tether-sample-apiserver",
            None,
            sample_bin,
            &[
                "--dir".to_owned(),
                sample_dir.display().to_string(),
                "--listen".to_owned(),
                sample_addr.to_string(),
            ],
            &[("RUST_LOG", &options.log_level)],
            &dir.join("sample.log"),
        )?;
        let deadline = Instant::now() + Duration::from_secs(60);
        while !(sample_dir.join("kubeconfig").is_file() && sample_dir.join("token").is_file()) {
            sample.check_running()?;
            if Instant::now() > deadline {
                bail!("the sample apiserver did not start within 60 s");
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        procs::wait_tcp(sample_addr, Duration::from_secs(30)).await?;

        let issuer = DevIssuer::start(
            &dir.join("issuer"),
            SocketAddr::from(([127, 0, 0, 1], 0)),
            DEV_AUDIENCE,
        )
        .await?;
        let entra = vec![
            "--entra-tenant".to_owned(),
            DEV_TENANT.to_owned(),
            "--entra-audience".to_owned(),
            DEV_AUDIENCE.to_owned(),
            "--entra-authority".to_owned(),
            issuer.authority().to_owned(),
            "--entra-authority-ca".to_owned(),
            issuer.ca_file().display().to_string(),
        ];

        let relay = RelayProcess::start(
            &bins.relay,
            &dir.join("relay"),
            None,
            &RelayOptions {
                log_level: options.log_level.clone(),
                product_bounds: true,
                extra_args: entra.iter().chain(&options.relay_args).cloned().collect(),
                ..RelayOptions::default()
            },
        )
        .await?;
        let token = relay.register(CLUSTER).await?;
        let agent_metrics = SocketAddr::from(([127, 0, 0, 1], procs::free_port()?));
        let mut agent_args = entra;
        agent_args.extend(["--health-listen".to_owned(), agent_metrics.to_string()]);
        agent_args.extend(options.agent_args.iter().cloned());
        let agent = AgentProcess::start(
            &bins.agent,
            &relay,
            CLUSTER,
            &token,
            &sample_dir.join("kubeconfig"),
            &dir.join("agent"),
            &AgentOptions {
                wrapper: None,
                log_level: options.log_level.clone(),
                extra_args: agent_args,
            },
        )
        .await?;
        let tls = certs::client_config(&[&relay.ca_pem], &[b"h2", b"http/1.1"], None)?;
        Ok(Self {
            relay,
            agent: Some(agent),
            agent_metrics,
            sample,
            sample_dir,
            sample_addr,
            issuer,
            tls,
        })
    }

    /// A one-hour token of a principal of its own for each `user` name (each gets its own `oid`).
    pub fn principal(&self, user: &str) -> anyhow::Result<String> {
        Ok(self.issuer.mint(&TokenRequest::user(user))?.token)
    }

    /// The sample apiserver's admin token (for changes made straight at the apiserver).
    pub fn admin_token(&self) -> anyhow::Result<String> {
        Ok(std::fs::read_to_string(self.sample_dir.join("token"))?
            .trim()
            .to_owned())
    }

    /// The sample apiserver's CA (PEM).
    pub fn sample_ca(&self) -> anyhow::Result<String> {
        Ok(std::fs::read_to_string(self.sample_dir.join("ca.pem"))?)
    }

    /// `/clusters/sample`: the prefix of every path through the relay.
    pub fn prefix(&self) -> String {
        format!("/clusters/{CLUSTER}")
    }

    /// The agent process, while it runs.
    pub fn agent(&self) -> Option<&AgentProcess> {
        self.agent.as_ref()
    }

    /// SIGKILLs the agent; the instant the signal went.
    pub async fn kill_agent(&mut self) -> Option<Instant> {
        let agent = self.agent.take()?;
        let at = Instant::now();
        agent.kill().await;
        Some(at)
    }

    /// The sample apiserver's process id.
    pub fn sample_pid(&self) -> u32 {
        self.sample.pid()
    }

    /// What a user needs to connect to the relay (cheap to clone, for tasks).
    pub fn connector(&self) -> Connector {
        let with = |alpn: &[u8]| {
            let mut config = (*self.tls).clone();
            config.alpn_protocols = vec![alpn.to_vec()];
            tokio_rustls::TlsConnector::from(Arc::new(config))
        };
        Connector {
            relay: self.relay.addr,
            h1: with(b"http/1.1"),
            h2: with(b"h2"),
        }
    }

    /// A user's connection to the relay from the loopback address `from`, TLS with ALPN `h2` or
    /// `http/1.1` as `http2` says.
    pub async fn connect(&self, from: IpAddr, http2: bool) -> anyhow::Result<Tls> {
        self.connector().connect(from, http2).await
    }

    /// A request through the relay on a fresh HTTP/1.1 connection from `from`, read to its end.
    pub async fn request(
        &self,
        from: IpAddr,
        token: &str,
        method: http::Method,
        path: &str,
        body: Option<serde_json::Value>,
    ) -> anyhow::Result<(StatusCode, Bytes)> {
        let tls = self.connect(from, false).await?;
        let (mut sender, conn) =
            hyper::client::conn::http1::handshake::<_, Full<Bytes>>(TokioIo::new(tls)).await?;
        tokio::spawn(conn);
        let mut req = Request::builder()
            .method(method)
            .uri(format!("{}{path}", self.prefix()))
            .header(header::HOST, self.relay.addr.to_string())
            .header(header::AUTHORIZATION, format!("Bearer {token}"));
        let body = match body {
            Some(v) => {
                req = req.header(header::CONTENT_TYPE, "application/json");
                Full::new(Bytes::from(v.to_string()))
            }
            None => Full::new(Bytes::new()),
        };
        let resp = tokio::time::timeout(
            Duration::from_secs(60),
            sender.send_request(req.body(body)?),
        )
        .await
        .context("no response within 60 s")??;
        let status = resp.status();
        let bytes = tokio::time::timeout(Duration::from_secs(60), resp.into_body().collect())
            .await
            .context("the body did not end within 60 s")??
            .to_bytes();
        Ok((status, bytes))
    }

    /// The agent's `/metrics` gauge `name`.
    pub async fn agent_gauge(&self, name: &str) -> anyhow::Result<u64> {
        let mut tcp = tokio::net::TcpStream::connect(self.agent_metrics).await?;
        tcp.write_all(b"GET /metrics HTTP/1.0\r\nHost: agent\r\n\r\n")
            .await?;
        let mut text = String::new();
        tokio::time::timeout(Duration::from_secs(10), tcp.read_to_string(&mut text)).await??;
        text.lines()
            .find_map(|l| l.strip_prefix(name)?.strip_prefix(' '))
            .and_then(|v| v.trim().parse().ok())
            .with_context(|| format!("no {name} in the agent's /metrics"))
    }

    /// Streams open on the cluster's tunnel at the relay (its control stream included).
    pub async fn relay_open_streams(&self) -> anyhow::Result<u64> {
        self.relay.cluster(CLUSTER).await?["openStreams"]
            .as_u64()
            .context("the relay shows no openStreams")
    }

    /// Whether the relay shows the cluster connected.
    pub async fn connected(&self) -> anyhow::Result<bool> {
        Ok(self.relay.cluster(CLUSTER).await?["connected"] == true)
    }

    /// Stops the agent, the relay and the sample apiserver.
    pub async fn stop(self) {
        let Self {
            relay,
            agent,
            sample,
            issuer,
            ..
        } = self;
        if let Some(agent) = agent {
            agent.stop(Duration::from_secs(5)).await;
        }
        relay.stop(Duration::from_secs(5)).await;
        sample.kill().await;
        issuer.shutdown().await;
    }
}
