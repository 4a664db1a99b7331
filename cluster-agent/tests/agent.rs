//! The whole agent (`tether_agent::run`) against a stand-in relay built on `tether_tunnel`'s server side and
//! a real HTTPS apiserver: onboarding with a CSR, the stored identity presented with mutual TLS, revocation
//! and expiry, stream kinds, reconnects and drain.

mod common;

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use anyhow::{Context as _, Result, bail};
use bytes::Bytes;
use common::harness::{DEADLINE, Env, Running, env, file_mode, http_stream, request, user_get};
use common::relay::{FakeRelay, pem_fingerprint};
use common::{TestApiserver, TestCa};
use http::{Request, StatusCode};
use http_body_util::{BodyExt, Empty};
use hyper_util::rt::TokioIo;
use tether_agent::{AgentError, Backoff, Config, Secret};
use tether_tunnel::{OpenOptions, Priority, TunnelError, code};

#[tokio::test]
async fn onboards_then_serves_a_request_end_to_end() -> Result<()> {
    let mut env = env(Some("onb-1")).await?;
    let mut agent = Running::start(env.config(Some("onb-1")));
    let conn = env.next_tunnel().await?;

    // Onboarded exactly once, with a CSR; the identity stored privately before use.
    assert_eq!(env.relay.state.onboard_calls.load(Ordering::SeqCst), 1);
    let bodies = env
        .relay
        .state
        .onboard_bodies
        .lock()
        .map(|b| b.clone())
        .unwrap_or_default();
    assert_eq!(bodies[0]["cluster"], "prod");
    assert_eq!(bodies[0]["token"], "onb-1");
    let csr = bodies[0]["csr"].as_str().context("no csr")?;
    assert!(
        csr.starts_with("-----BEGIN CERTIFICATE REQUEST-----"),
        "{csr}"
    );
    assert!(!bodies[0].to_string().contains("PRIVATE KEY"));

    let identity_path = env.state_dir().join("identity.json");
    let key_path = env.state_dir().join("identity-key.pem");
    assert_eq!(file_mode(&identity_path)?, 0o600);
    assert_eq!(file_mode(&key_path)?, 0o600);
    assert_eq!(file_mode(&env.state_dir())?, 0o700);
    let stored: serde_json::Value = serde_json::from_slice(&std::fs::read(&identity_path)?)?;
    assert_eq!(stored["cluster"], "prod");
    assert_eq!(stored["relay"], env.relay.url());
    assert!(stored["notAfter"].is_string());
    assert!(std::fs::read_to_string(&key_path)?.starts_with("-----BEGIN PRIVATE KEY-----"));

    // The tunnel is authenticated with that certificate (mutual TLS), not with a header.
    let stored_fp = pem_fingerprint(stored["certificate"].as_str().unwrap_or_default());
    assert!(stored_fp.is_some());
    assert_eq!(env.relay.presented(), vec![stored_fp]);
    let headers = env
        .relay
        .state
        .tunnel_headers
        .lock()
        .map(|h| h.clone())
        .unwrap_or_default();
    assert_eq!(headers.len(), 1);
    assert!(headers[0].get("authorization").is_none());
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

    // A restart reuses the stored identity: the (now used) token is not sent again, so the relay's
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
async fn revoked_identity_ends_run_with_a_clear_error() -> Result<()> {
    let env = env(Some("onb-1")).await?;
    env.relay.state.revoked.store(true, Ordering::SeqCst);
    let agent = Running::start(env.config(Some("onb-1")));
    let err = match agent.finished().await? {
        Ok(()) => bail!("run must fail when the relay rejects the identity"),
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
async fn expired_identity_ends_run_with_the_recovery_steps() -> Result<()> {
    let mut env = env(Some("onb-1")).await?;
    let mut agent = Running::start(env.config(Some("onb-1")));
    let conn = env.next_tunnel().await?;
    agent.shutdown();
    agent.finished().await??;
    drop(conn);

    // The relay now refuses the stored identity as expired.
    env.relay.state.expired.store(true, Ordering::SeqCst);
    let agent = Running::start(env.config(None));
    let err = match agent.finished().await? {
        Ok(()) => bail!("run must fail when the identity expired"),
        Err(err) => err,
    };
    assert!(matches!(err, AgentError::IdentityExpired { .. }), "{err:?}");
    let text = err.to_string();
    assert!(
        text.starts_with(
            "this cluster's identity expired: delete it at the relay and connect it again"
        ),
        "{text}"
    );
    assert!(text.contains("expired at 2020-01-01T00:00:00Z"), "{text}");
    assert_eq!(env.relay.state.tunnel_attempts.load(Ordering::SeqCst), 2);

    // Recovery as documented: the cluster is registered again (a new token); the agent, pointed at a fresh
    // state directory, onboards again.
    env.relay.state.expired.store(false, Ordering::SeqCst);
    if let Ok(mut token) = env.relay.state.onboarding_token.lock() {
        *token = Some("onb-2".to_owned());
    }
    std::fs::remove_dir_all(env.state_dir())?;
    let mut agent = Running::start(env.config(Some("onb-2")));
    let conn = env.next_tunnel().await?;
    assert_eq!(env.relay.state.onboard_calls.load(Ordering::SeqCst), 2);
    assert_eq!(
        request(&conn, user_get("/version")?).await?.status(),
        StatusCode::OK
    );
    agent.shutdown();
    agent.finished().await??;
    Ok(())
}

#[tokio::test]
async fn an_identity_is_not_reused_for_another_cluster_name() -> Result<()> {
    let mut env = env(Some("onb-1")).await?;
    let mut agent = Running::start(env.config(Some("onb-1")));
    let _conn = env.next_tunnel().await?;
    agent.shutdown();
    agent.finished().await??;

    // The same state directory pointed at another cluster name: the stored identity is not used for it.
    let mut config = env.config(None);
    config.cluster = "staging".to_owned();
    assert!(matches!(
        config.validate(),
        Err(tether_agent::ConfigError::MissingOnboardingToken { .. })
    ));
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
    assert!(!env.state_dir().join("identity.json").exists());
    assert!(!env.state_dir().join("identity-key.pem").exists());
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
    tether_runtime::tls::install_crypto_provider();
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

#[tokio::test]
async fn a_stream_ends_with_its_tunnel() -> Result<()> {
    let mut env = env(Some("onb-1")).await?;
    let mut config = env.config(Some("onb-1"));
    // Far beyond the test's deadline: a stream left behind would hold shutdown up.
    config.drain_timeout = Duration::from_secs(600);
    let mut agent = Running::start(config);
    let conn = env.next_tunnel().await?;
    let feed = env.api.stream_sender();
    let resp = request(&conn, user_get("/stream")?).await?;
    assert_eq!(resp.status(), StatusCode::OK);

    // The tunnel goes while the apiserver has nothing to send (a quiet watch).
    conn.close(code::NO_ERROR, "relay closing this tunnel");
    let _conn = env.next_tunnel().await?;

    // The upstream response is dropped: the apiserver's side sees its body consumer go away.
    common::eventually(DEADLINE, || feed.is_closed().then_some(())).await?;
    // And nothing is left to drain.
    agent.shutdown();
    agent.finished().await??;
    drop(resp);
    Ok(())
}
