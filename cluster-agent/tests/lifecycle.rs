//! The cluster lifecycle over the tunnel, against the stand-in relay: the control channel (hello, heartbeats,
//! health, metadata that follows node changes through a watch), identity renewal without reconnecting or
//! dropping streams, failed renewals, the end of the control channel, and the outbound proxy.

mod common;

use std::sync::atomic::Ordering;
use std::time::Duration;

use anyhow::{Context as _, Result};
use bytes::Bytes;
use common::harness::{DEADLINE, Running, env, request, user_get};
use common::proxy::ConnectProxy;
use common::relay::{RenewMode, pem_fingerprint};
use http::StatusCode;
use http_body_util::BodyExt;
use tether_api::control::Message;
use tether_tunnel::code;
use tether_tunnel::proxy::{NoProxy, Proxy};

/// The certificate fingerprint in the agent's identity.json.
fn stored_fingerprint(state_dir: &std::path::Path) -> Option<String> {
    let text = std::fs::read(state_dir.join("identity.json")).ok()?;
    let json: serde_json::Value = serde_json::from_slice(&text).ok()?;
    pem_fingerprint(json["certificate"].as_str()?)
}

#[tokio::test]
async fn control_channel_carries_hello_metadata_health_and_heartbeats() -> Result<()> {
    let mut env = env(Some("onb-1")).await?;
    env.relay.state.heartbeat_seconds.store(1, Ordering::SeqCst);
    env.api.set_version("v1.33.1+k3s1");
    env.api.add_node(
        "n1",
        "4",
        "8Gi",
        &[("k3s.io/hostname", "n1")],
        Some("aws:///eu-west-1a/i-1"),
    );
    let mut agent = Running::start(env.config(Some("onb-1")));
    let conn = env.next_tunnel().await?;

    // hello comes first.
    let first = env.next_message(Some).await?;
    match first {
        Message::Hello(hello) => assert_eq!(hello.agent_version, env!("CARGO_PKG_VERSION")),
        other => anyhow::bail!("the first message must be hello, got {other:?}"),
    }
    let metadata = env
        .next_message(|m| match m {
            Message::Metadata(m) => Some(m),
            _ => None,
        })
        .await?;
    assert_eq!(metadata.kubernetes_version, "v1.33.1+k3s1");
    assert_eq!(metadata.node_count, 1);
    assert_eq!(metadata.total_cpu_millis, 4000);
    assert_eq!(metadata.total_memory_bytes, 8 << 30);
    assert_eq!(metadata.distribution, "k3s");
    assert_eq!(metadata.infrastructure, "aws");
    assert_eq!(metadata.agent_version, env!("CARGO_PKG_VERSION"));

    let health = env
        .next_message(|m| match m {
            Message::Health(h) => Some(h),
            _ => None,
        })
        .await?;
    assert_eq!(health.agent_version, env!("CARGO_PKG_VERSION"));
    assert_eq!(health.reconnects, 0);
    assert!(health.memory_bytes > 0);

    // Heartbeats count up on the configured interval.
    let mut seqs = Vec::new();
    for _ in 0..2 {
        seqs.push(
            env.next_message(|m| match m {
                Message::Heartbeat(h) => Some(h.seq),
                _ => None,
            })
            .await?,
        );
    }
    assert_eq!(seqs[1], seqs[0] + 1, "{seqs:?}");

    // A node added to the cluster shows up in a new metadata message.
    env.api
        .add_node("n2", "500m", "16384Ki", &[], Some("aws:///eu-west-1b/i-2"));
    let metadata = env
        .next_message(|m| match m {
            Message::Metadata(m) if m.node_count == 2 => Some(m),
            _ => None,
        })
        .await?;
    assert_eq!(metadata.total_cpu_millis, 4500);
    assert_eq!(metadata.total_memory_bytes, (8 << 30) + (16 << 20));
    // Followed with one list and a watch, not by polling.
    let requests = env.api.agent_requests();
    let lists = requests
        .iter()
        .filter(|r| r.starts_with("/api/v1/nodes") && !r.contains("watch=true"))
        .count();
    assert_eq!(lists, 1, "{requests:?}");
    assert!(
        requests
            .iter()
            .any(|r| r.starts_with("/api/v1/nodes") && r.contains("watch=true")),
        "{requests:?}"
    );

    // After a reconnect: hello again, metadata again at once, and the reconnect counted.
    conn.close(code::NO_ERROR, "relay closing this tunnel");
    let _conn = env.next_tunnel().await?;
    env.next_message(|m| matches!(m, Message::Hello(_)).then_some(()))
        .await?;
    let again = env
        .next_message(|m| match m {
            Message::Metadata(m) => Some(m),
            _ => None,
        })
        .await?;
    assert_eq!(again.node_count, 2);
    let health = env
        .next_message(|m| match m {
            Message::Health(h) => Some(h),
            _ => None,
        })
        .await?;
    assert_eq!(health.reconnects, 1);

    agent.shutdown();
    agent.finished().await??;
    Ok(())
}

#[tokio::test]
async fn renewal_keeps_the_tunnel_and_an_open_stream() -> Result<()> {
    let mut env = env(Some("onb-1")).await?;
    // Renewal is due about two thirds into this (from issue, not from the backdated notBefore).
    if let Ok(mut v) = env.relay.state.validity.lock() {
        *v = time::Duration::seconds(6);
    }
    let mut config = env.config(Some("onb-1"));
    // The test apiserver's stream never ends on its own; do not wait for it at shutdown.
    config.drain_timeout = Duration::from_millis(200);
    let mut agent = Running::start(config);
    let conn = env.next_tunnel().await?;
    let first = stored_fingerprint(&env.state_dir()).context("no identity stored")?;
    let first_key = std::fs::read(env.state_dir().join("identity-key.pem"))?;

    // A streaming response is open through the tunnel…
    let feed = env.api.stream_sender();
    let resp = request(&conn, user_get("/stream")?).await?;
    assert_eq!(resp.status(), StatusCode::OK);
    let mut body = resp.into_body();
    feed.send(Bytes::from_static(b"before renewal\n")).await?;
    let chunk = tokio::time::timeout(DEADLINE, body.frame())
        .await?
        .context("ended")??;
    assert_eq!(
        chunk.data_ref().map(|d| d.as_ref()),
        Some(&b"before renewal\n"[..])
    );

    // …while the agent renews over the control channel and stores the new identity.
    let csr = env
        .next_message(|m| match m {
            Message::Renew(r) => Some(r.csr),
            _ => None,
        })
        .await?;
    assert!(csr.starts_with("-----BEGIN CERTIFICATE REQUEST-----"));
    let state_dir = env.state_dir();
    let second = common::eventually(DEADLINE, || {
        stored_fingerprint(&state_dir).filter(|fp| *fp != first)
    })
    .await?;
    assert_ne!(
        std::fs::read(env.state_dir().join("identity-key.pem"))?,
        first_key
    );

    // The stream still flows, on the same tunnel: no reconnect happened.
    feed.send(Bytes::from_static(b"after renewal\n")).await?;
    let chunk = tokio::time::timeout(DEADLINE, body.frame())
        .await?
        .context("ended")??;
    assert_eq!(
        chunk.data_ref().map(|d| d.as_ref()),
        Some(&b"after renewal\n"[..])
    );
    assert!(!conn.is_closed());
    assert_eq!(env.relay.state.tunnel_attempts.load(Ordering::SeqCst), 1);
    drop(feed);
    drop(body);

    // The next connection presents the new certificate (or a later one, if another renewal already ran).
    conn.close(code::NO_ERROR, "relay closing this tunnel");
    let conn = env.next_tunnel().await?;
    let presented = env.relay.presented();
    assert_eq!(presented.len(), 2);
    assert_eq!(presented[0].as_deref(), Some(first.as_str()));
    let now_stored = stored_fingerprint(&env.state_dir());
    assert!(
        presented[1].as_deref() == Some(second.as_str()) || presented[1] == now_stored,
        "{presented:?}"
    );
    assert_eq!(
        request(&conn, user_get("/version")?).await?.status(),
        StatusCode::OK
    );
    agent.shutdown();
    agent.finished().await??;
    Ok(())
}

#[tokio::test]
async fn failed_renewals_are_retried_without_dropping_the_tunnel() -> Result<()> {
    let mut env = env(Some("onb-1")).await?;
    if let Ok(mut v) = env.relay.state.validity.lock() {
        *v = time::Duration::seconds(3);
    }
    if let Ok(mut mode) = env.relay.state.renew_mode.lock() {
        *mode = RenewMode::Refuse("the CA is offline".to_owned());
    }
    let mut agent = Running::start(env.config(Some("onb-1")));
    let conn = env.next_tunnel().await?;
    let first = stored_fingerprint(&env.state_dir()).context("no identity stored")?;

    // Refused twice: retried, the identity unchanged, the tunnel up.
    for _ in 0..2 {
        env.next_message(|m| matches!(m, Message::Renew(_)).then_some(()))
            .await?;
    }
    assert_eq!(
        stored_fingerprint(&env.state_dir()).as_deref(),
        Some(first.as_str())
    );
    assert!(!conn.is_closed());

    // The relay can issue again: the next attempt succeeds.
    if let Ok(mut mode) = env.relay.state.renew_mode.lock() {
        *mode = RenewMode::Issue;
    }
    let state_dir = env.state_dir();
    common::eventually(DEADLINE, || {
        stored_fingerprint(&state_dir).filter(|fp| *fp != first)
    })
    .await?;
    assert!(!conn.is_closed());
    assert_eq!(env.relay.state.tunnel_attempts.load(Ordering::SeqCst), 1);
    agent.shutdown();
    agent.finished().await??;
    Ok(())
}

#[tokio::test]
async fn the_end_of_the_control_channel_closes_the_tunnel_and_the_agent_reconnects() -> Result<()> {
    let mut env = env(Some("onb-1")).await?;
    let mut agent = Running::start(env.config(Some("onb-1")));
    let conn = env.next_tunnel().await?;
    env.next_message(|m| matches!(m, Message::Hello(_)).then_some(()))
        .await?;
    let control = env
        .relay
        .state
        .control_streams
        .lock()
        .ok()
        .and_then(|s| s.first().cloned())
        .context("no control stream")?;
    control.reset(code::CANCEL);

    let second = env.next_tunnel().await?;
    tokio::time::timeout(DEADLINE, conn.closed()).await?;
    env.next_message(|m| matches!(m, Message::Hello(_)).then_some(()))
        .await?;
    assert_eq!(
        request(&second, user_get("/version")?).await?.status(),
        StatusCode::OK
    );
    agent.shutdown();
    agent.finished().await??;
    Ok(())
}

#[tokio::test]
async fn onboarding_and_tunnel_go_through_the_proxy() -> Result<()> {
    let mut env = env(Some("onb-1")).await?;
    let proxy = ConnectProxy::start(Some(("agent", "s3cret"))).await?;
    let mut config = env.config(Some("onb-1"));
    config.proxy = Some(Proxy::parse(&proxy.url("agent:s3cret@"))?);
    // The relay's CA given as the proxy CA (as for a TLS-inspecting proxy) instead of as the relay CA.
    config.proxy_ca = config.relay_ca.take();
    let mut agent = Running::start(config);
    let conn = env.next_tunnel().await?;
    assert_eq!(
        request(&conn, user_get("/version")?).await?.status(),
        StatusCode::OK
    );
    let requests = proxy.requests();
    assert_eq!(requests.len(), 2, "onboarding and tunnel: {requests:?}");
    let target = format!("CONNECT 127.0.0.1:{} HTTP/1.1\r\n", env.relay.addr.port());
    assert!(
        requests.iter().all(|r| r.starts_with(&target)),
        "{requests:?}"
    );
    assert!(
        requests
            .iter()
            .all(|r| r.contains("Proxy-Authorization: Basic ")),
        "{requests:?}"
    );
    agent.shutdown();
    agent.finished().await??;

    // Listed in the bypass list: straight to the relay.
    let mut config = env.config(None);
    config.proxy = Some(Proxy::parse(&proxy.url("agent:s3cret@"))?);
    config.no_proxy = Some(NoProxy::parse("example.com,127.0.0.0/8")?);
    let before = proxy.connections();
    let mut agent = Running::start(config);
    let _conn = env.next_tunnel().await?;
    assert_eq!(proxy.connections(), before);
    agent.shutdown();
    agent.finished().await??;
    Ok(())
}

#[tokio::test]
async fn wrong_proxy_credentials_are_retried_and_logged_not_fatal() -> Result<()> {
    let env = env(Some("onb-1")).await?;
    let proxy = ConnectProxy::start(Some(("agent", "right"))).await?;
    let mut config = env.config(Some("onb-1"));
    config.proxy = Some(Proxy::parse(&proxy.url("agent:wrong@"))?);
    let mut agent = Running::start(config);
    // The agent keeps trying (a proxy can be fixed without restarting the agent) and never reaches the relay.
    common::eventually(DEADLINE, || (proxy.requests().len() >= 2).then_some(())).await?;
    assert_eq!(env.relay.state.onboard_calls.load(Ordering::SeqCst), 0);
    assert!(!agent.task.is_finished());
    agent.shutdown();
    agent.finished().await??;
    Ok(())
}
