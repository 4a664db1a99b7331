//! End to end with the real relay (`tether_relay::Relay`): register a cluster through the admin API, run the
//! agent with the onboarding token, send user requests through `/clusters/NAME/…`, restart the relay on the
//! same port, delete the cluster (over either transport).

mod common;

use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{Result, bail};
use common::TestApiserver;
use common::real_relay::RelayProcess;
use http::{Method, StatusCode};
use tether_agent::{AgentError, Backoff, Config, Secret};
use tokio::sync::oneshot;

const DEADLINE: Duration = Duration::from_secs(30);

fn agent_config(relay: &RelayProcess, dir: &Path, token: Option<&str>) -> Result<Config> {
    let ca_path: PathBuf = dir.join("relay-ca.pem");
    std::fs::write(&ca_path, &relay.ca_pem)?;
    let mut config = Config::new(relay.url(), "prod", dir.join("agent-state"));
    config.onboarding_token = token.map(Secret::new);
    config.relay_ca = Some(ca_path);
    config.kubeconfig = Some(dir.join("kubeconfig"));
    config.backoff = Backoff {
        base: Duration::from_millis(50),
        cap: Duration::from_millis(500),
        ..Backoff::default()
    };
    Ok(config)
}

/// Deletes cluster `prod` through the admin API.
async fn delete_cluster(relay: &RelayProcess) -> Result<()> {
    let (status, _) = relay
        .call(
            Method::DELETE,
            "/api/v1/clusters/prod",
            &relay.admin_token,
            None,
        )
        .await?;
    assert_eq!(status, StatusCode::NO_CONTENT);
    Ok(())
}

/// Deletes cluster `prod` and waits for `agent`'s run to end with the identity rejected (401 or 403): the fatal
/// error, not a retry.
async fn delete_and_expect_rejection(
    relay: &RelayProcess,
    agent: tokio::task::JoinHandle<Result<(), AgentError>>,
) -> Result<()> {
    delete_cluster(relay).await?;
    match tokio::time::timeout(DEADLINE, agent).await?? {
        Err(AgentError::CredentialRejected { status }) => {
            assert!(status == StatusCode::UNAUTHORIZED || status == StatusCode::FORBIDDEN);
            Ok(())
        }
        other => bail!("expected the identity to be rejected, got {other:?}"),
    }
}

#[tokio::test]
async fn onboard_serve_restart_and_delete_with_the_real_relay() -> Result<()> {
    tether_runtime::tls::install_crypto_provider();
    let dir = tempfile::tempdir()?;
    let api = TestApiserver::start().await?;
    common::write_kubeconfig(dir.path(), &api.url(), &api.ca.pem(), None)?;
    let relay_dir = dir.path().join("relay");
    let relay = RelayProcess::start(&relay_dir, "127.0.0.1:0".parse()?).await?;
    let token = relay.register("prod").await?;

    let (stop_agent, agent_stopped) = oneshot::channel::<()>();
    let agent = tokio::spawn(tether_agent::run(
        agent_config(&relay, dir.path(), Some(&token))?,
        async move {
            let _ = agent_stopped.await;
        },
    ));

    // Onboarding + tunnel + one request, end to end.
    let (status, body) = relay.user_get("prod", "/api/v1/namespaces?limit=3").await?;
    assert_eq!(status, StatusCode::OK, "{}", String::from_utf8_lossy(&body));
    let json: serde_json::Value = serde_json::from_slice(&body)?;
    assert_eq!(json["path"], "/api/v1/namespaces");
    assert_eq!(json["query"], "limit=3");
    let seen = api.seen();
    assert_eq!(seen.len(), 1);
    assert_eq!(seen[0].headers["authorization"], "Bearer user-token");
    assert!(dir.path().join("agent-state/identity.json").exists());
    assert!(dir.path().join("agent-state/identity-key.pem").exists());

    // The relay restarts on the same port (same data dir, so the same CAs and the same stored identity).
    let addr = relay.addr;
    relay.stop().await?;
    let relay = RelayProcess::start(&relay_dir, addr).await?;
    let (status, body) = relay.user_get("prod", "/version").await?;
    assert_eq!(status, StatusCode::OK, "{}", String::from_utf8_lossy(&body));
    assert_eq!(api.seen().len(), 2);

    // Deleting the cluster revokes its identity: the agent stops with the fatal error.
    delete_and_expect_rejection(&relay, agent).await?;
    drop(stop_agent);
    relay.stop().await?;
    Ok(())
}

/// Over QUIC alone, with no WebSocket to fall back to, deleting the cluster still ends the agent's run with the
/// fatal error: QUIC has no HTTP answer, so the relay puts its Kubernetes Status in the close reason, and the agent
/// reads the 401/403 from it (`tether_api::refusal`) rather than dialling forever.
#[tokio::test]
async fn a_deleted_cluster_stops_an_agent_that_dials_only_quic() -> Result<()> {
    tether_runtime::tls::install_crypto_provider();
    let dir = tempfile::tempdir()?;
    let api = TestApiserver::start().await?;
    common::write_kubeconfig(dir.path(), &api.url(), &api.ca.pem(), None)?;
    let relay = RelayProcess::start(&dir.path().join("relay"), "127.0.0.1:0".parse()?).await?;
    let token = relay.register("prod").await?;
    let mut config = agent_config(&relay, dir.path(), Some(&token))?;
    config.transport = tether_agent::TransportMode::Quic;
    let (stop_agent, agent_stopped) = oneshot::channel::<()>();
    let agent = tokio::spawn(tether_agent::run(config, async move {
        let _ = agent_stopped.await;
    }));

    let (status, body) = relay.user_get("prod", "/version").await?;
    assert_eq!(status, StatusCode::OK, "{}", String::from_utf8_lossy(&body));
    cluster_until(&relay, |c| c["tunnels"][0]["transport"] == "quic").await?;
    delete_and_expect_rejection(&relay, agent).await?;
    drop(stop_agent);
    relay.stop().await
}

/// Polls the relay's view of cluster `prod` until `check` accepts it.
async fn cluster_until(
    relay: &RelayProcess,
    mut check: impl FnMut(&serde_json::Value) -> bool,
) -> Result<serde_json::Value> {
    let give_up = tokio::time::Instant::now() + DEADLINE;
    loop {
        let json = relay.cluster("prod").await?;
        if check(&json) {
            return Ok(json);
        }
        if tokio::time::Instant::now() >= give_up {
            bail!("the cluster never reached the expected state: {json}");
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

fn stored_identity(dir: &Path) -> Result<serde_json::Value> {
    Ok(serde_json::from_slice(&std::fs::read(
        dir.join("agent-state/identity.json"),
    )?)?)
}

#[tokio::test]
async fn metadata_health_renewal_and_expiry_with_the_real_relay() -> Result<()> {
    tether_runtime::tls::install_crypto_provider();
    let dir = tempfile::tempdir()?;
    let api = TestApiserver::start().await?;
    api.set_version("v1.32.4-eks-1234567");
    api.add_node(
        "ip-10-0-0-1",
        "2",
        "4Gi",
        &[("eks.amazonaws.com/nodegroup", "ng")],
        Some("aws:///eu-west-1a/i-1"),
    );
    common::write_kubeconfig(dir.path(), &api.url(), &api.ca.pem(), None)?;
    let relay_dir = dir.path().join("relay");
    let relay = RelayProcess::start_with(&relay_dir, "127.0.0.1:0".parse()?, |c| {
        c.heartbeat_interval = Duration::from_secs(1);
        c.identity_validity = Duration::from_secs(6);
    })
    .await?;
    let token = relay.register("prod").await?;
    let (stop_agent, agent_stopped) = oneshot::channel::<()>();
    let agent = tokio::spawn(tether_agent::run(
        agent_config(&relay, dir.path(), Some(&token))?,
        async move {
            let _ = agent_stopped.await;
        },
    ));

    // Metadata and health reach the relay.
    let json = cluster_until(&relay, |c| {
        c["nodeCount"] == 1 && c["agentHealth"].is_object()
    })
    .await?;
    assert_eq!(json["connectivityStatus"], "Connected");
    assert_eq!(json["kubernetesVersion"], "v1.32.4-eks-1234567");
    assert_eq!(json["totalCpuMillis"], 2000);
    assert_eq!(json["totalMemoryBytes"], 4u64 << 30);
    assert_eq!(json["distribution"], "eks");
    assert_eq!(json["infrastructure"], "aws");
    assert_eq!(json["agentVersion"], env!("CARGO_PKG_VERSION"));
    assert_eq!(json["agentHealth"]["reconnects"], 0);

    // A node added to the cluster shows up.
    api.add_node(
        "ip-10-0-0-2",
        "2",
        "4Gi",
        &[],
        Some("aws:///eu-west-1b/i-2"),
    );
    cluster_until(&relay, |c| {
        c["nodeCount"] == 2 && c["totalCpuMillis"] == 4000
    })
    .await?;

    // The identity is renewed in band, and the relay shows the new one.
    let first = stored_identity(dir.path())?["certificate"].clone();
    let give_up = tokio::time::Instant::now() + DEADLINE;
    while stored_identity(dir.path())?["certificate"] == first {
        if tokio::time::Instant::now() >= give_up {
            bail!("no renewal");
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let (status, _) = relay.user_get("prod", "/version").await?;
    assert_eq!(status, StatusCode::OK);

    // Stopped long enough, the identity expires; the relay refuses it with the recovery steps.
    drop(stop_agent);
    tokio::time::timeout(DEADLINE, agent).await???;
    let not_after = stored_identity(dir.path())?["notAfter"]
        .as_str()
        .unwrap_or_default()
        .to_owned();
    let not_after_text = not_after.clone();
    let not_after =
        time::OffsetDateTime::parse(&not_after, &time::format_description::well_known::Rfc3339)?;
    let give_up = tokio::time::Instant::now() + DEADLINE;
    while time::OffsetDateTime::now_utc() <= not_after {
        if tokio::time::Instant::now() >= give_up {
            bail!("the identity did not expire");
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    cluster_until(&relay, |c| c["connectivityStatus"] == "Expired").await?;
    let result = tokio::time::timeout(
        DEADLINE,
        tether_agent::run(
            agent_config(&relay, dir.path(), None)?,
            std::future::pending(),
        ),
    )
    .await?;
    match result {
        Err(e @ AgentError::IdentityExpired { .. }) => {
            let text = e.to_string();
            assert!(
                text.contains("delete it at the relay and connect it again")
                    && text.contains("the identity of cluster prod expired at"),
                "{text}"
            );
        }
        other => bail!("expected IdentityExpired, got {other:?}"),
    }

    // Recovery as the relay says: delete the cluster, connect it again, start the agent with the new token.
    // The expired identity in the state directory is replaced; nobody has to empty the directory by hand.
    delete_cluster(&relay).await?;
    let token = relay.register("prod").await?;
    let (stop_agent, agent_stopped) = oneshot::channel::<()>();
    let agent = tokio::spawn(tether_agent::run(
        agent_config(&relay, dir.path(), Some(&token))?,
        async move {
            let _ = agent_stopped.await;
        },
    ));
    cluster_until(&relay, |c| c["connectivityStatus"] == "Connected").await?;
    assert_ne!(
        stored_identity(dir.path())?["notAfter"].as_str(),
        Some(not_after_text.as_str())
    );
    let (status, _) = relay.user_get("prod", "/version").await?;
    assert_eq!(status, StatusCode::OK);
    drop(stop_agent);
    tokio::time::timeout(DEADLINE, agent).await???;
    relay.stop().await?;
    Ok(())
}
