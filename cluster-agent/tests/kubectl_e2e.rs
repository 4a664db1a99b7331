//! The real `kubectl` → the real relay → the agent → the sample apiserver: list, logs (followed), exec (a
//! WebSocket upgrade through both hops), and proof that the agent adds no credential of its own. Skipped with a
//! note when no kubectl binary is installed.

mod common;

use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::Result;
use base64::Engine as _;
use common::real_relay::RelayProcess;
use tether_agent::{Backoff, Config, Secret};
use tether_testkit::kubectl::Kubectl;
use tether_testkit::tools::{self, Tool};
use tether_testkit::{SampleApiserver, SampleOptions};
use tokio::sync::oneshot;

const DEADLINE: Duration = Duration::from_secs(30);

/// A kubeconfig for a user of cluster `prod` through the relay, with `token` if any.
fn user_kubeconfig(dir: &Path, relay: &RelayProcess, token: Option<&str>) -> Result<PathBuf> {
    let ca = base64::engine::general_purpose::STANDARD.encode(relay.ca_pem.as_bytes());
    let user = match token {
        Some(token) => format!("    token: {token}\n"),
        None => "    {}\n".to_string(),
    };
    let yaml = format!(
        "apiVersion: v1\nkind: Config\nclusters:\n- name: prod\n  cluster:\n    server: {url}/clusters/prod\n    certificate-authority-data: {ca}\nusers:\n- name: user\n  user:\n{user}contexts:\n- name: prod\n  context:\n    cluster: prod\n    user: user\n    namespace: default\ncurrent-context: prod\n",
        url = relay.url(),
    );
    let path = dir.join(format!("user-kubeconfig-{}", token.is_some()));
    std::fs::write(&path, yaml)?;
    Ok(path)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kubectl_through_relay_and_agent() -> Result<()> {
    if tools::require(Tool::Kubectl).is_none() {
        return Ok(());
    }
    tether_runtime::tls::install_crypto_provider();
    let dir = tempfile::tempdir()?;
    let api = SampleApiserver::start(SampleOptions::new(dir.path().join("api"))).await?;
    let relay = RelayProcess::start(&dir.path().join("relay"), "127.0.0.1:0".parse()?).await?;
    let token = relay.register("prod").await?;

    // The agent's kubeconfig holds the apiserver's admin token: its own identity, never used for forwarding.
    std::fs::write(dir.path().join("relay-ca.pem"), &relay.ca_pem)?;
    let mut config = Config::new(relay.url(), "prod", dir.path().join("agent-state"));
    config.onboarding_token = Some(Secret::new(token));
    config.relay_ca = Some(dir.path().join("relay-ca.pem"));
    config.kubeconfig = Some(api.kubeconfig_path());
    config.backoff = Backoff {
        base: Duration::from_millis(50),
        cap: Duration::from_millis(500),
        ..Backoff::default()
    };
    let (stop_agent, agent_stopped) = oneshot::channel::<()>();
    let agent = tokio::spawn(tether_agent::run(config, async move {
        let _ = agent_stopped.await;
    }));
    // Wait until the cluster answers through the relay (503 until the tunnel is up). The helper's token is
    // unknown to the apiserver, and the agent adds no credential of its own: the apiserver says 401.
    let (status, body) = relay.user_get("prod", "/api").await?;
    assert_eq!(
        status,
        http::StatusCode::UNAUTHORIZED,
        "{}",
        String::from_utf8_lossy(&body)
    );

    let kubectl = Kubectl::new(&user_kubeconfig(dir.path(), &relay, Some(api.token()))?)?;

    let out = kubectl.run(&["get", "pods", "-o", "name"]).await?;
    assert!(out.success(), "{out}");
    assert!(out.stdout.lines().any(|l| l.trim() == "pod/demo"), "{out}");

    let out = kubectl.run(&["logs", "demo", "--tail=1"]).await?;
    assert!(out.success(), "{out}");
    assert!(out.stdout.contains("tick"), "{out}");

    // A followed log streams through: lines keep arriving while the request is open.
    let mut follow = kubectl.spawn(&["logs", "-f", "demo", "--tail=1"])?;
    let first = follow
        .wait_for_line(DEADLINE, |l| l.contains("tick"))
        .await?;
    let next = follow
        .wait_for_line(DEADLINE, |l| l.contains("tick") && l != first)
        .await?;
    assert_ne!(first, next);
    drop(follow);

    // exec is a 101 upgrade on both hops.
    let out = kubectl
        .run(&["exec", "demo", "--", "echo", "hello", "through", "tether"])
        .await?;
    assert!(out.success(), "{out}");
    assert_eq!(out.stdout.trim(), "hello through tether", "{out}");
    let out = kubectl
        .run_with_stdin(
            &["exec", "-i", "demo", "--", "cat"],
            b"line one\nline two\n",
        )
        .await?;
    assert!(out.success(), "{out}");
    assert_eq!(out.stdout, "line one\nline two\n", "{out}");

    // Without a credential of their own, users get the apiserver's refusal: the agent adds none (kubectl, seeing
    // 401 with no credential configured, asks for a username and fails on the closed stdin).
    let anonymous = Kubectl::new(&user_kubeconfig(dir.path(), &relay, None)?)?;
    let out = anonymous.run(&["get", "pods", "-o", "name"]).await?;
    assert!(!out.success(), "{out}");
    assert!(!out.stdout.contains("pod/demo"), "{out}");
    let wrong = Kubectl::new(&user_kubeconfig(
        dir.path(),
        &relay,
        Some("not-a-valid-token"),
    )?)?;
    let out = wrong.run(&["get", "pods", "-o", "name"]).await?;
    assert!(!out.success(), "{out}");
    // kubectl's wording for a 401.
    assert!(
        out.stderr
            .contains("the server has asked for the client to provide credentials"),
        "{out}"
    );

    drop(stop_agent);
    tokio::time::timeout(DEADLINE, agent).await???;
    relay.stop().await?;
    Ok(())
}
