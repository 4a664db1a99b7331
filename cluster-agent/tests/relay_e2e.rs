//! End to end with the real relay (`tether_relay::Relay`): register a cluster through the admin API, run the
//! agent with the onboarding token, send user requests through `/clusters/NAME/…`, restart the relay on the
//! same port, delete the cluster.

mod common;

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{Context as _, Result, bail};
use bytes::Bytes;
use common::TestApiserver;
use http::{Method, Request, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use tether_agent::{AgentError, Backoff, Config, Secret};
use tokio::sync::oneshot;
use tokio::task::JoinHandle;

const DEADLINE: Duration = Duration::from_secs(30);

struct RelayProcess {
    addr: SocketAddr,
    admin_token: String,
    ca_pem: String,
    stop: Option<oneshot::Sender<()>>,
    task: JoinHandle<Result<(), tether_relay::RelayError>>,
}

impl RelayProcess {
    async fn start(data_dir: &Path, addr: SocketAddr) -> Result<Self> {
        let mut config = tether_relay::Config::new(data_dir.to_path_buf());
        config.limits.shutdown_grace = Duration::from_secs(1);
        let relay = tether_relay::Relay::new(config).await?;
        let admin_token = relay.admin_token().expose().to_string();
        let ca_pem = relay
            .ca_pem()
            .context("the relay generated no CA")?
            .to_string();
        let listener = tokio::net::TcpListener::bind(addr).await?;
        let addr = listener.local_addr()?;
        let (stop, stopped) = oneshot::channel::<()>();
        let task = tokio::spawn(relay.serve(listener, async move {
            let _ = stopped.await;
        }));
        Ok(Self {
            addr,
            admin_token,
            ca_pem,
            stop: Some(stop),
            task,
        })
    }

    fn url(&self) -> String {
        format!("https://127.0.0.1:{}", self.addr.port())
    }

    async fn stop(mut self) -> Result<()> {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        tokio::time::timeout(DEADLINE, &mut self.task).await???;
        Ok(())
    }

    /// One HTTPS request to the relay, trusting its CA.
    async fn call(
        &self,
        method: Method,
        path: &str,
        bearer: &str,
        body: Option<serde_json::Value>,
    ) -> Result<(StatusCode, Bytes)> {
        let tls = tether_tunnel::tls::client_config(Some(self.ca_pem.as_bytes()), &[])?;
        let https = hyper_rustls::HttpsConnectorBuilder::new()
            .with_tls_config((*tls).clone())
            .https_only()
            .enable_http1()
            .build();
        let client: Client<_, Full<Bytes>> = Client::builder(TokioExecutor::new()).build(https);
        let body = body.map(|b| Bytes::from(b.to_string())).unwrap_or_default();
        let req = Request::builder()
            .method(method)
            .uri(format!("{}{path}", self.url()))
            .header("authorization", format!("Bearer {bearer}"))
            .header("content-type", "application/json")
            .body(Full::new(body))?;
        let resp = tokio::time::timeout(DEADLINE, client.request(req)).await??;
        let status = resp.status();
        Ok((status, resp.into_body().collect().await?.to_bytes()))
    }

    async fn register(&self, name: &str) -> Result<String> {
        let (status, body) = self
            .call(
                Method::POST,
                "/api/v1/clusters",
                &self.admin_token,
                Some(serde_json::json!({"name": name})),
            )
            .await?;
        if status != StatusCode::CREATED {
            bail!("register: {status}: {}", String::from_utf8_lossy(&body));
        }
        let json: serde_json::Value = serde_json::from_slice(&body)?;
        Ok(json["onboardingToken"]
            .as_str()
            .context("no onboardingToken")?
            .to_string())
    }

    /// A user request through the relay, retried while the cluster is not connected yet (503).
    async fn user_get(&self, cluster: &str, path: &str) -> Result<(StatusCode, Bytes)> {
        let give_up = tokio::time::Instant::now() + DEADLINE;
        loop {
            let (status, body) = self
                .call(
                    Method::GET,
                    &format!("/clusters/{cluster}{path}"),
                    "user-token",
                    None,
                )
                .await?;
            if status != StatusCode::SERVICE_UNAVAILABLE || tokio::time::Instant::now() >= give_up {
                return Ok((status, body));
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
}

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
