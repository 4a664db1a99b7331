//! `--state-secret`: the identity in a Kubernetes Secret of the sample apiserver (testkit), so a new pod with an
//! empty filesystem keeps it, and replicas racing to onboard use the one-time token once.

mod common;

use std::sync::atomic::Ordering;

use anyhow::{Context as _, Result, ensure};
use common::harness::{Env, Running, env};
use k8s_openapi::api::core::v1::Secret as KubeSecret;
use tether_agent::state_secret::SecretRef;
use tether_testkit::{SampleApiserver, SampleOptions};

const SECRET: &str = "default/tether-agent-identity";

/// A "pod": an agent with its own empty state directory, the shared Secret, and the sample apiserver.
fn pod(env: &Env, api: &SampleApiserver, name: &str, token: Option<&str>) -> Result<Running> {
    let mut config = env.config(token);
    config.state_dir = env.dir.path().join(name);
    config.kubeconfig = Some(api.agent_kubeconfig_path());
    config.state_secret = Some(SECRET.parse::<SecretRef>().map_err(anyhow::Error::msg)?);
    Ok(Running::start(config))
}

async fn stored_secret(api: &SampleApiserver) -> Result<KubeSecret> {
    let config = kube::Config::from_custom_kubeconfig(
        kube::config::Kubeconfig::read_from(api.kubeconfig_path())?,
        &kube::config::KubeConfigOptions::default(),
    )
    .await?;
    let secrets: kube::Api<KubeSecret> =
        kube::Api::namespaced(kube::Client::try_from(config)?, "default");
    Ok(secrets.get("tether-agent-identity").await?)
}

fn last_presented(env: &Env) -> Result<String> {
    env.relay
        .presented()
        .last()
        .cloned()
        .flatten()
        .context("no client certificate presented")
}

fn empty_dir(path: &std::path::Path) -> bool {
    std::fs::read_dir(path).map_or(true, |mut d| d.next().is_none())
}

#[tokio::test]
async fn a_new_pod_with_an_empty_filesystem_keeps_the_identity() -> Result<()> {
    let mut env = env(Some("onb-1")).await?;
    let api = SampleApiserver::start(SampleOptions::new(env.dir.path().join("api"))).await?;

    let mut first = pod(&env, &api, "pod-a", Some("onb-1"))?;
    let _tunnel = env.next_tunnel().await?;
    let identity = last_presented(&env)?;
    first.shutdown();
    first.finished().await??;
    ensure!(
        empty_dir(&env.dir.path().join("pod-a")),
        "the identity went to the filesystem"
    );

    let secret = stored_secret(&api).await?;
    let data = secret.data.unwrap_or_default();
    ensure!(data.contains_key("identity.json") && data.contains_key("identity-key.pem"));
    let managed = secret.metadata.labels.unwrap_or_default();
    assert_eq!(
        managed
            .get("app.kubernetes.io/managed-by")
            .map(String::as_str),
        Some("tether-agent")
    );

    // The pod moves: another node, nothing on disk, the onboarding token long used. Same identity, no onboarding.
    let mut second = pod(&env, &api, "pod-b", None)?;
    let _tunnel = env.next_tunnel().await?;
    assert_eq!(last_presented(&env)?, identity);
    assert_eq!(env.relay.state.onboard_calls.load(Ordering::SeqCst), 1);
    ensure!(empty_dir(&env.dir.path().join("pod-b")));
    second.shutdown();
    second.finished().await??;
    Ok(())
}

#[tokio::test]
async fn two_replicas_racing_onboard_exactly_once() -> Result<()> {
    let mut env = env(Some("onb-1")).await?;
    let api = SampleApiserver::start(SampleOptions::new(env.dir.path().join("api"))).await?;

    let mut a = pod(&env, &api, "replica-a", Some("onb-1"))?;
    let mut b = pod(&env, &api, "replica-b", Some("onb-1"))?;
    let _one = env.next_tunnel().await?;
    let _two = env.next_tunnel().await?;
    assert_eq!(env.relay.state.onboard_calls.load(Ordering::SeqCst), 1);
    let presented = env.relay.presented();
    ensure!(presented.len() >= 2, "{presented:?}");
    ensure!(
        presented.iter().all(|p| p.is_some() && *p == presented[0]),
        "both replicas use the one identity: {presented:?}"
    );
    // The claim is gone once the identity is stored.
    let annotations = stored_secret(&api)
        .await?
        .metadata
        .annotations
        .unwrap_or_default();
    ensure!(
        !annotations.keys().any(|k| k.starts_with("tether.dev/")),
        "{annotations:?}"
    );
    a.shutdown();
    b.shutdown();
    a.finished().await??;
    b.finished().await??;
    Ok(())
}

#[tokio::test]
async fn a_renewed_identity_replaces_the_one_in_the_secret() -> Result<()> {
    let mut env = env(Some("onb-1")).await?;
    let api = SampleApiserver::start(SampleOptions::new(env.dir.path().join("api"))).await?;
    // Renewal is due about two thirds into this.
    if let Ok(mut v) = env.relay.state.validity.lock() {
        *v = time::Duration::seconds(6);
    }
    let mut agent = pod(&env, &api, "pod-a", Some("onb-1"))?;
    let _tunnel = env.next_tunnel().await?;
    let key_of = |s: KubeSecret| {
        s.data
            .and_then(|d| d.get("identity-key.pem").map(|k| k.0.clone()))
            .unwrap_or_default()
    };
    let first = key_of(stored_secret(&api).await?);
    ensure!(!first.is_empty());
    let give_up = tokio::time::Instant::now() + common::harness::DEADLINE;
    loop {
        let now = key_of(stored_secret(&api).await?);
        if !now.is_empty() && now != first {
            break;
        }
        ensure!(
            tokio::time::Instant::now() < give_up,
            "the renewed identity never reached the Secret"
        );
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
    ensure!(empty_dir(&env.dir.path().join("pod-a")));
    agent.shutdown();
    agent.finished().await??;
    Ok(())
}
