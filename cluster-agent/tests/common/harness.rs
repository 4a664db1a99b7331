//! The agent (`tether_agent::run`) against the stand-in relay ([`super::relay::FakeRelay`]) and the test
//! apiserver: an environment, a running agent, and requests over the tunnel as the relay sends them.

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context as _, Result};
use bytes::Bytes;
use http::Request;
use http_body_util::Empty;
use hyper::body::Incoming;
use hyper_util::rt::TokioIo;
use tether_agent::{AgentError, Backoff, Config, Secret};
use tether_api::control::Message;
use tether_tunnel::{Connection, OpenOptions, Priority, TunnelError, kind};
use tokio::sync::oneshot;
use tokio::task::JoinHandle;

use super::relay::FakeRelay;
use super::{TestApiserver, TestCa};

pub const DEADLINE: Duration = Duration::from_secs(20);

pub struct Env {
    pub api: TestApiserver,
    pub relay: FakeRelay,
    pub dir: tempfile::TempDir,
}

pub async fn env(onboarding_token: Option<&str>) -> Result<Env> {
    tether_runtime::tls::install_crypto_provider();
    let api = TestApiserver::start().await?;
    let relay = FakeRelay::start(
        "127.0.0.1:0".parse()?,
        Arc::new(TestCa::new()?),
        onboarding_token,
    )
    .await?;
    let dir = tempfile::tempdir()?;
    super::write_kubeconfig(dir.path(), &api.url(), &api.ca.pem(), None)?;
    std::fs::write(dir.path().join("relay-ca.pem"), relay.ca.pem())?;
    Ok(Env { api, relay, dir })
}

impl Env {
    pub fn state_dir(&self) -> std::path::PathBuf {
        self.dir.path().join("state")
    }

    pub fn config(&self, token: Option<&str>) -> Config {
        let mut config = Config::new(self.relay.url(), "prod", self.state_dir());
        config.onboarding_token = token.map(Secret::new);
        config.relay_ca = Some(self.dir.path().join("relay-ca.pem"));
        config.kubeconfig = Some(self.dir.path().join("kubeconfig"));
        config.backoff = Backoff {
            base: Duration::from_millis(20),
            cap: Duration::from_millis(200),
            ..Backoff::default()
        };
        config.connect_timeout = Duration::from_secs(5);
        // The stand-in relay speaks WebSocket only (the real relay's QUIC is tested against the real relay).
        config.transport = tether_agent::TransportMode::Wss;
        config
    }

    /// The next control message the agent sends that `pick` selects (others are skipped).
    pub async fn next_message<T>(
        &mut self,
        mut pick: impl FnMut(Message) -> Option<T>,
    ) -> Result<T> {
        tokio::time::timeout(DEADLINE, async {
            loop {
                let message = self.relay.messages.recv().await.context("relay stopped")?;
                if let Some(found) = pick(message) {
                    return Ok(found);
                }
            }
        })
        .await
        .context("no such control message in time")?
    }

    /// The next tunnel the agent establishes.
    pub async fn next_tunnel(&mut self) -> Result<Connection> {
        tokio::time::timeout(DEADLINE, self.relay.tunnels.recv())
            .await?
            .context("relay stopped")
    }
}

pub struct Running {
    pub stop: Option<oneshot::Sender<()>>,
    pub task: JoinHandle<Result<(), AgentError>>,
}

impl Running {
    pub fn start(config: Config) -> Self {
        let (stop, stopped) = oneshot::channel::<()>();
        let task = tokio::spawn(tether_agent::run(config, async move {
            let _ = stopped.await;
        }));
        Self {
            stop: Some(stop),
            task,
        }
    }

    pub fn shutdown(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
    }

    pub async fn finished(self) -> Result<Result<(), AgentError>> {
        Ok(tokio::time::timeout(DEADLINE, self.task).await??)
    }
}

pub fn http_stream(conn: &Connection) -> Result<tether_tunnel::Stream, TunnelError> {
    conn.open(OpenOptions {
        kind: kind::HTTP,
        priority: Priority::Normal,
        deadline: Some(Duration::from_secs(10)),
        metadata: Bytes::new(),
    })
}

/// Sends one request over a new HTTP stream, as the relay does.
pub async fn request(
    conn: &Connection,
    req: Request<Empty<Bytes>>,
) -> Result<http::Response<Incoming>> {
    let stream = http_stream(conn)?;
    let (mut sender, connection) =
        hyper::client::conn::http1::handshake(TokioIo::new(stream)).await?;
    tokio::spawn(connection.with_upgrades());
    Ok(tokio::time::timeout(DEADLINE, sender.send_request(req)).await??)
}

pub fn user_get(path: &str) -> Result<Request<Empty<Bytes>>> {
    Ok(Request::get(path)
        .header("authorization", "Bearer user-token")
        .body(Empty::new())?)
}

pub fn file_mode(path: &Path) -> Result<u32> {
    use std::os::unix::fs::PermissionsExt;
    Ok(std::fs::metadata(path)?.permissions().mode() & 0o777)
}
