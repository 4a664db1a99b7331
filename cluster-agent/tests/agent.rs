//! The whole agent (`tether_agent::run`) against a stand-in relay built on `tether_tunnel`'s server side and
//! a real HTTPS apiserver: onboarding, credential reuse, revocation, stream kinds, reconnects and drain.

mod common;

use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use anyhow::{Context as _, Result, bail};
use bytes::Bytes;
use common::relay::{CREDENTIAL, FakeRelay};
use common::{TestApiserver, TestCa};
use http::{Request, StatusCode};
use http_body_util::{BodyExt, Empty};
use hyper::body::Incoming;
use hyper_util::rt::TokioIo;
use tether_agent::{AgentError, Backoff, Config, Secret};
use tether_tunnel::{Connection, OpenOptions, Priority, TunnelError, code, kind};
use tokio::sync::oneshot;
use tokio::task::JoinHandle;

const DEADLINE: Duration = Duration::from_secs(20);

struct Env {
    api: TestApiserver,
    relay: FakeRelay,
    dir: tempfile::TempDir,
}

async fn env(onboarding_token: Option<&str>) -> Result<Env> {
    tether_tunnel::tls::install_crypto_provider();
    let api = TestApiserver::start().await?;
    let relay = FakeRelay::start(
        "127.0.0.1:0".parse()?,
        Arc::new(TestCa::new()?),
        onboarding_token,
    )
    .await?;
    let dir = tempfile::tempdir()?;
    common::write_kubeconfig(dir.path(), &api.url(), &api.ca.pem(), None)?;
    std::fs::write(dir.path().join("relay-ca.pem"), relay.ca.pem())?;
    Ok(Env { api, relay, dir })
}

impl Env {
    fn state_dir(&self) -> std::path::PathBuf {
        self.dir.path().join("state")
    }

    fn config(&self, token: Option<&str>) -> Config {
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
        config
    }

    /// The next tunnel the agent establishes.
    async fn next_tunnel(&mut self) -> Result<Connection> {
        tokio::time::timeout(DEADLINE, self.relay.tunnels.recv())
            .await?
            .context("relay stopped")
    }
}

struct Running {
    stop: Option<oneshot::Sender<()>>,
    task: JoinHandle<Result<(), AgentError>>,
}

impl Running {
    fn start(config: Config) -> Self {
        let (stop, stopped) = oneshot::channel::<()>();
        let task = tokio::spawn(tether_agent::run(config, async move {
            let _ = stopped.await;
        }));
        Self {
            stop: Some(stop),
            task,
        }
    }

    fn shutdown(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
    }

    async fn finished(self) -> Result<Result<(), AgentError>> {
        Ok(tokio::time::timeout(DEADLINE, self.task).await??)
    }
}

fn http_stream(conn: &Connection) -> Result<tether_tunnel::Stream, TunnelError> {
    conn.open(OpenOptions {
        kind: kind::HTTP,
        priority: Priority::Normal,
        deadline: Some(Duration::from_secs(10)),
        metadata: Bytes::new(),
    })
}

/// Sends one request over a new HTTP stream, as the relay does.
async fn request(
    conn: &Connection,
    req: Request<Empty<Bytes>>,
) -> Result<http::Response<Incoming>> {
    let stream = http_stream(conn)?;
    let (mut sender, connection) =
        hyper::client::conn::http1::handshake(TokioIo::new(stream)).await?;
    tokio::spawn(connection.with_upgrades());
    Ok(tokio::time::timeout(DEADLINE, sender.send_request(req)).await??)
}

fn user_get(path: &str) -> Result<Request<Empty<Bytes>>> {
    Ok(Request::get(path)
        .header("authorization", "Bearer user-token")
        .body(Empty::new())?)
}

fn file_mode(path: &Path) -> Result<u32> {
    use std::os::unix::fs::PermissionsExt;
    Ok(std::fs::metadata(path)?.permissions().mode() & 0o777)
}

#[tokio::test]
async fn onboards_then_serves_a_request_end_to_end() -> Result<()> {
    let mut env = env(Some("onb-1")).await?;
    let mut agent = Running::start(env.config(Some("onb-1")));
    let conn = env.next_tunnel().await?;

    // Onboarded exactly once, credential stored privately before use.
    assert_eq!(env.relay.state.onboard_calls.load(Ordering::SeqCst), 1);
    let cred_path = env.state_dir().join("credential.json");
    assert_eq!(file_mode(&cred_path)?, 0o600);
    assert_eq!(file_mode(&env.state_dir())?, 0o700);
    let stored: serde_json::Value = serde_json::from_slice(&std::fs::read(&cred_path)?)?;
    assert_eq!(stored["credential"], CREDENTIAL);
    assert_eq!(stored["cluster"], "prod");
    assert_eq!(stored["relay"], env.relay.url());

    let headers = env
        .relay
        .state
        .tunnel_headers
        .lock()
        .map(|h| h.clone())
        .unwrap_or_default();
    assert_eq!(headers.len(), 1);
    assert_eq!(
        headers[0]["authorization"],
        format!("Bearer {CREDENTIAL}").as_str()
    );
    assert_eq!(headers[0]["tether-cluster"], "prod");
    assert_eq!(
        headers[0]["tether-agent-version"],
        env!("CARGO_PKG_VERSION")
    );

    let resp = request(&conn, user_get("/api/v1/namespaces?limit=1")?).await?;
    assert_eq!(resp.status(), StatusCode::OK);
    let json: serde_json::Value =
        serde_json::from_slice(&resp.into_body().collect().await?.to_bytes())?;
    assert_eq!(json["path"], "/api/v1/namespaces");
    assert_eq!(json["query"], "limit=1");
    let seen = env.api.seen();
    assert_eq!(seen.len(), 1);
    assert_eq!(seen[0].headers["authorization"], "Bearer user-token");

    agent.shutdown();
    agent.finished().await??;

    // A restart reuses the stored credential: the (now used) token is not sent again, so the relay's
    // one-time check cannot fail it.
    let mut agent = Running::start(env.config(Some("onb-1")));
    let conn = env.next_tunnel().await?;
    assert_eq!(env.relay.state.onboard_calls.load(Ordering::SeqCst), 1);
    let resp = request(&conn, user_get("/version")?).await?;
    assert_eq!(resp.status(), StatusCode::OK);
    agent.shutdown();
    agent.finished().await??;

    // And without any token at all.
    let mut agent = Running::start(env.config(None));
    let _conn = env.next_tunnel().await?;
    assert_eq!(env.relay.state.onboard_calls.load(Ordering::SeqCst), 1);
    agent.shutdown();
    agent.finished().await??;
    Ok(())
}

#[tokio::test]
async fn revoked_credential_ends_run_with_a_clear_error() -> Result<()> {
    let env = env(Some("onb-1")).await?;
    env.relay.state.revoked.store(true, Ordering::SeqCst);
    let agent = Running::start(env.config(Some("onb-1")));
    let err = match agent.finished().await? {
        Ok(()) => bail!("run must fail when the relay rejects the credential"),
        Err(err) => err,
    };
    assert!(
        matches!(err, AgentError::CredentialRejected { status } if status == StatusCode::UNAUTHORIZED),
        "{err}"
    );
    assert!(
        err.to_string()
            .contains("deleted or revoked; register it again"),
        "{err}"
    );
    // Retrying cannot help, so it did not.
    assert_eq!(env.relay.state.tunnel_attempts.load(Ordering::SeqCst), 1);
    Ok(())
}

#[tokio::test]
async fn refused_onboarding_token_ends_run() -> Result<()> {
    let env = env(Some("the-real-token")).await?;
    let agent = Running::start(env.config(Some("a-wrong-token")));
    let err = match agent.finished().await? {
        Ok(()) => bail!("run must fail when the relay refuses the onboarding token"),
        Err(err) => err,
    };
    assert!(
        matches!(err, AgentError::OnboardingRefused { status, .. } if status == StatusCode::UNAUTHORIZED),
        "{err}"
    );
    assert!(
        !err.to_string().contains("a-wrong-token"),
        "the token must never be printed: {err}"
    );
    assert!(!env.state_dir().join("credential.json").exists());
    Ok(())
}

#[tokio::test]
async fn unknown_stream_kind_is_refused() -> Result<()> {
    let mut env = env(Some("onb-1")).await?;
    let mut agent = Running::start(env.config(Some("onb-1")));
    let conn = env.next_tunnel().await?;
    let stream = conn.open(OpenOptions {
        kind: 0x7777,
        priority: Priority::Normal,
        deadline: Some(Duration::from_secs(10)),
        metadata: Bytes::new(),
    })?;
    match tokio::time::timeout(DEADLINE, stream.control().accepted()).await? {
        Err(TunnelError::Refused { code: c, .. }) => assert_eq!(c, code::UNSUPPORTED_KIND),
        other => bail!("expected a refusal, got {other:?}"),
    }
    // The tunnel still serves HTTP streams.
    assert_eq!(
        request(&conn, user_get("/version")?).await?.status(),
        StatusCode::OK
    );
    agent.shutdown();
    agent.finished().await??;
    Ok(())
}

#[tokio::test]
async fn reconnects_when_the_relay_closes_and_after_it_restarts_on_the_same_port() -> Result<()> {
    let mut env = env(Some("onb-1")).await?;
    let mut agent = Running::start(env.config(Some("onb-1")));

    // The relay closes the tunnel: the agent dials again.
    let conn = env.next_tunnel().await?;
    conn.close(code::NO_ERROR, "relay closing this tunnel");
    let conn = env.next_tunnel().await?;
    assert_eq!(
        request(&conn, user_get("/version")?).await?.status(),
        StatusCode::OK
    );

    // The relay goes away entirely and comes back on the same port.
    let port = env.relay.addr.port();
    conn.close(code::SHUTDOWN, "relay restarting");
    drop(conn);
    let Env { api, relay, dir } = env;
    let relay = relay.restart().await?;
    assert_eq!(relay.addr.port(), port);
    let mut env = Env { api, relay, dir };
    let conn = env.next_tunnel().await?;
    assert_eq!(
        request(&conn, user_get("/version")?).await?.status(),
        StatusCode::OK
    );
    // Still no second onboarding.
    assert_eq!(env.relay.state.onboard_calls.load(Ordering::SeqCst), 1);

    agent.shutdown();
    agent.finished().await??;
    Ok(())
}

#[tokio::test]
async fn shutdown_lets_an_in_flight_request_finish() -> Result<()> {
    let mut env = env(Some("onb-1")).await?;
    let mut agent = Running::start(env.config(Some("onb-1")));
    let conn = env.next_tunnel().await?;
    let feed = env.api.stream_sender();
    let resp = request(&conn, user_get("/stream")?).await?;
    assert_eq!(resp.status(), StatusCode::OK);
    let mut body = resp.into_body();
    feed.send(Bytes::from_static(b"before shutdown\n")).await?;
    let first = tokio::time::timeout(DEADLINE, body.frame())
        .await?
        .context("ended")??;
    assert_eq!(
        first.data_ref().map(|d| d.as_ref()),
        Some(&b"before shutdown\n"[..])
    );

    agent.shutdown();
    // The in-flight response keeps flowing after the shutdown signal, and run has not returned.
    feed.send(Bytes::from_static(b"after shutdown\n")).await?;
    let second = tokio::time::timeout(DEADLINE, body.frame())
        .await?
        .context("ended")??;
    assert_eq!(
        second.data_ref().map(|d| d.as_ref()),
        Some(&b"after shutdown\n"[..])
    );
    assert!(!agent.task.is_finished());

    // The response ends; the drain completes and run returns Ok.
    drop(feed);
    drop(env.api);
    let rest = tokio::time::timeout(DEADLINE, body.collect()).await?;
    let _ = rest;
    agent.finished().await??;
    Ok(())
}

#[tokio::test]
async fn drain_timeout_bounds_shutdown() -> Result<()> {
    let mut env = env(Some("onb-1")).await?;
    let mut config = env.config(Some("onb-1"));
    config.drain_timeout = Duration::from_millis(200);
    let mut agent = Running::start(config);
    let conn = env.next_tunnel().await?;
    let _feed = env.api.stream_sender();
    let resp = request(&conn, user_get("/stream")?).await?;
    assert_eq!(resp.status(), StatusCode::OK);
    // The stream never ends on its own; run still returns once the drain timeout passed.
    agent.shutdown();
    agent.finished().await??;
    let mut body = resp.into_body();
    let end = tokio::time::timeout(DEADLINE, async {
        while let Some(Ok(_)) = body.frame().await {}
    })
    .await;
    assert!(
        end.is_ok(),
        "the relay side sees the stream end once the agent closed the tunnel"
    );
    Ok(())
}

#[tokio::test]
async fn upgrade_over_the_tunnel_is_a_byte_pipe_with_half_close() -> Result<()> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut env = env(Some("onb-1")).await?;
    let mut agent = Running::start(env.config(Some("onb-1")));
    let conn = env.next_tunnel().await?;
    let stream = http_stream(&conn)?;
    let (mut sender, connection) =
        hyper::client::conn::http1::handshake(TokioIo::new(stream)).await?;
    tokio::spawn(connection.with_upgrades());
    let req = Request::get("/upgrade")
        .header("connection", "Upgrade")
        .header("upgrade", "tether-test")
        .header("authorization", "Bearer user-token")
        .body(Empty::<Bytes>::new())?;
    let mut resp = tokio::time::timeout(DEADLINE, sender.send_request(req)).await??;
    assert_eq!(resp.status(), StatusCode::SWITCHING_PROTOCOLS);
    let mut io = TokioIo::new(hyper::upgrade::on(&mut resp).await?);
    io.write_all(b"exec stdin").await?;
    io.shutdown().await?;
    let mut reply = Vec::new();
    tokio::time::timeout(DEADLINE, io.read_to_end(&mut reply)).await??;
    assert_eq!(reply, b"bye:exec stdin");
    agent.shutdown();
    agent.finished().await??;
    Ok(())
}

#[tokio::test]
async fn onboarding_waits_for_a_relay_that_is_not_up_yet() -> Result<()> {
    tether_tunnel::tls::install_crypto_provider();
    let api = TestApiserver::start().await?;
    let dir = tempfile::tempdir()?;
    common::write_kubeconfig(dir.path(), &api.url(), &api.ca.pem(), None)?;
    let ca = Arc::new(TestCa::new()?);
    std::fs::write(dir.path().join("relay-ca.pem"), ca.pem())?;
    // A port nothing listens on yet.
    let addr = std::net::TcpListener::bind("127.0.0.1:0")?.local_addr()?;

    let mut config = Config::new(
        format!("https://127.0.0.1:{}", addr.port()),
        "prod",
        dir.path().join("state"),
    );
    config.onboarding_token = Some(Secret::new("onb-1"));
    config.relay_ca = Some(dir.path().join("relay-ca.pem"));
    config.kubeconfig = Some(dir.path().join("kubeconfig"));
    config.backoff = Backoff {
        base: Duration::from_millis(20),
        cap: Duration::from_millis(200),
        ..Backoff::default()
    };
    let mut agent = Running::start(config);

    // The agent keeps retrying onboarding while the relay is down, and succeeds once it is up.
    let relay = FakeRelay::start(addr, ca, Some("onb-1")).await?;
    let mut env = Env { api, relay, dir };
    let conn = env.next_tunnel().await?;
    assert_eq!(env.relay.state.onboard_calls.load(Ordering::SeqCst), 1);
    assert_eq!(
        request(&conn, user_get("/version")?).await?.status(),
        StatusCode::OK
    );
    agent.shutdown();
    agent.finished().await??;
    Ok(())
}
