//! The real relay (`tether_relay::Relay`) in-process, with an HTTPS client for its admin and user endpoints.

use std::net::SocketAddr;
use std::path::Path;
use std::time::Duration;

use anyhow::{Context as _, Result, bail};
use bytes::Bytes;
use http::{Method, Request, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use tokio::sync::oneshot;
use tokio::task::JoinHandle;

const DEADLINE: Duration = Duration::from_secs(30);

pub struct RelayProcess {
    pub addr: SocketAddr,
    pub admin_token: String,
    pub ca_pem: String,
    /// Open streams per tunnel.
    pub stats: tether_relay::TunnelStats,
    stop: Option<oneshot::Sender<()>>,
    task: JoinHandle<Result<(), tether_relay::RelayError>>,
}

impl RelayProcess {
    pub async fn start(data_dir: &Path, addr: SocketAddr) -> Result<Self> {
        Self::start_with(data_dir, addr, |_| {}).await
    }

    /// Starts with the configuration adjusted by `adjust`.
    pub async fn start_with(
        data_dir: &Path,
        addr: SocketAddr,
        adjust: impl FnOnce(&mut tether_relay::Config),
    ) -> Result<Self> {
        let mut config = tether_relay::Config::new(data_dir.to_path_buf());
        config.limits.shutdown_grace = Duration::from_secs(1);
        adjust(&mut config);
        let relay = tether_relay::Relay::new(config).await?;
        let admin_token = relay.admin_token().expose().to_string();
        let ca_pem = relay
            .ca_pem()
            .context("the relay generated no CA")?
            .to_string();
        let stats = relay.tunnel_stats();
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
            stats,
            stop: Some(stop),
            task,
        })
    }

    pub fn url(&self) -> String {
        format!("https://{}", self.addr)
    }

    pub async fn stop(mut self) -> Result<()> {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        tokio::time::timeout(DEADLINE, &mut self.task).await???;
        Ok(())
    }

    /// One HTTPS request to the relay, trusting its CA.
    pub async fn call(
        &self,
        method: Method,
        path: &str,
        bearer: &str,
        body: Option<serde_json::Value>,
    ) -> Result<(StatusCode, Bytes)> {
        let tls = tether_runtime::tls::client_config(Some(self.ca_pem.as_bytes()), &[])?;
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

    pub async fn register(&self, name: &str) -> Result<String> {
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

    /// The cluster's JSON from the admin API.
    pub async fn cluster(&self, name: &str) -> Result<serde_json::Value> {
        let (status, body) = self
            .call(
                Method::GET,
                &format!("/api/v1/clusters/{name}"),
                &self.admin_token,
                None,
            )
            .await?;
        if status != StatusCode::OK {
            bail!("show {name}: {status}: {}", String::from_utf8_lossy(&body));
        }
        Ok(serde_json::from_slice(&body)?)
    }

    /// A user request through the relay, retried while the cluster is not connected yet (503).
    pub async fn user_get(&self, cluster: &str, path: &str) -> Result<(StatusCode, Bytes)> {
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
