//! End to end with the real relay (`tether_relay::Relay`): register a cluster through the admin API, run the
//! agent with the onboarding token, send user requests through `/clusters/NAME/…`, restart the relay on the
//! same port, delete the cluster.

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

#[tokio::test]
async fn onboard_serve_restart_and_delete_with_the_real_relay() -> Result<()> {
    tether_tunnel::tls::install_crypto_provider();
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
    assert!(dir.path().join("agent-state/credential.json").exists());

    // The relay restarts on the same port (same data dir, so the same CA and the same stored credential).
    let addr = relay.addr;
    relay.stop().await?;
    let relay = RelayProcess::start(&relay_dir, addr).await?;
    let (status, body) = relay.user_get("prod", "/version").await?;
    assert_eq!(status, StatusCode::OK, "{}", String::from_utf8_lossy(&body));
    assert_eq!(api.seen().len(), 2);

    // Deleting the cluster revokes its credential: the agent stops with the fatal error.
    let (status, _) = relay
        .call(
            Method::DELETE,
            "/api/v1/clusters/prod",
            &relay.admin_token,
            None,
        )
        .await?;
    assert_eq!(status, StatusCode::NO_CONTENT);
    let result = tokio::time::timeout(DEADLINE, agent).await??;
    match result {
        Err(AgentError::CredentialRejected { status }) => {
            assert!(status == StatusCode::UNAUTHORIZED || status == StatusCode::FORBIDDEN)
        }
        other => bail!("expected the credential to be rejected, got {other:?}"),
    }
    drop(stop_agent);
    relay.stop().await?;
    Ok(())
}
