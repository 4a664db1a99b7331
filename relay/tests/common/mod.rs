//! Test support: a relay on 127.0.0.1:0 in a temp dir, and a small HTTPS client that trusts its CA.
#![allow(dead_code, unreachable_pub)]

use std::net::SocketAddr;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context as _, anyhow};
use bytes::Bytes;
use http::{HeaderMap, Method, Request, StatusCode, Version};
use http_body_util::{BodyExt, Full};
use hyper_util::rt::{TokioExecutor, TokioIo};
use serde_json::Value;
use tether_relay::{Config, Relay, RelayError};
use tether_runtime::Secret;
use tokio::net::TcpStream;
use tokio::sync::oneshot;
use tokio::task::JoinHandle;
use tokio_rustls::TlsConnector;

/// A running relay.
pub struct TestRelay {
    pub addr: SocketAddr,
    pub ca_pem: String,
    /// The agent CA that issues cluster identities.
    pub agent_ca_pem: String,
    pub admin_token: Secret,
    stop: Option<oneshot::Sender<()>>,
    join: Option<JoinHandle<Result<(), RelayError>>>,
}

impl TestRelay {
    /// Starts a relay with default settings on `dir`.
    pub async fn start(dir: &Path) -> anyhow::Result<Self> {
        Self::start_with(Config::new(dir.to_path_buf())).await
    }

    /// Starts a relay with `config`.
    pub async fn start_with(config: Config) -> anyhow::Result<Self> {
        tether_runtime::tls::install_crypto_provider();
        // RUST_LOG=debug shows the relay's logs for a failing test.
        let _ = tracing_subscriber::fmt()
            .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
            .with_test_writer()
            .try_init();
        let relay = Relay::new(config).await?;
        let ca_pem = relay.ca_pem().map(str::to_owned).unwrap_or_default();
        let agent_ca_pem = relay.agent_ca_pem().to_owned();
        let admin_token = relay.admin_token().clone();
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
        let addr = listener.local_addr()?;
        let (tx, rx) = oneshot::channel::<()>();
        // Served on two shards, as the relay binary serves on a machine with more than one CPU: every test
        // that starts a relay goes through the placement of connections (tether_runtime::shards).
        let shards = tether_runtime::shards::Shards::start(2, "test-relay")?;
        let join = tokio::spawn(async move {
            let served = relay
                .serve_on(listener, Some(shards.clone()), async move {
                    let _ = rx.await;
                })
                .await;
            // Stopped off the shards' own threads: joining one from itself would wait forever.
            let _ = tokio::task::spawn_blocking(move || drop(shards)).await;
            served
        });
        Ok(Self {
            addr,
            ca_pem,
            agent_ca_pem,
            admin_token,
            stop: Some(tx),
            join: Some(join),
        })
    }

    /// Signals shutdown (SIGTERM, as far as the relay knows) without waiting: the relay drains.
    pub fn begin_stop(&mut self) {
        if let Some(tx) = self.stop.take() {
            let _ = tx.send(());
        }
    }

    /// Signals shutdown and waits for `serve` to return.
    pub async fn stop(mut self) -> anyhow::Result<()> {
        if let Some(tx) = self.stop.take() {
            let _ = tx.send(());
        }
        match self.join.take() {
            Some(join) => Ok(join.await??),
            None => Ok(()),
        }
    }

    pub fn client(&self) -> anyhow::Result<Client> {
        Client::new(self.addr, self.ca_pem.as_bytes(), "localhost")
    }

    /// A client presenting `identity` as its TLS client certificate.
    pub fn client_as(&self, identity: &AgentIdentity) -> anyhow::Result<Client> {
        Client::with_config(
            self.addr,
            agent_tls(self, Some(identity), &[b"h2", b"http/1.1"])?,
            "localhost",
        )
    }

    pub fn admin(&self) -> anyhow::Result<Admin> {
        Ok(Admin {
            client: self.client()?,
            token: self.admin_token.expose().to_owned(),
        })
    }

    /// The `wss://` URL of the tunnel endpoint.
    pub fn tunnel_url(&self) -> String {
        format!("wss://localhost:{}/agent/v1/tunnel", self.addr.port())
    }
}

/// A response, fully read.
#[derive(Debug)]
pub struct Reply {
    pub status: StatusCode,
    pub headers: HeaderMap,
    pub body: Bytes,
    pub version: Version,
}

impl Reply {
    pub fn json(&self) -> anyhow::Result<Value> {
        serde_json::from_slice(&self.body)
            .with_context(|| format!("not JSON: {:?}", String::from_utf8_lossy(&self.body)))
    }

    /// Asserts a Kubernetes `Status` failure with `code`, returns its message.
    pub fn status_message(&self, code: u16) -> anyhow::Result<String> {
        anyhow::ensure!(
            self.status.as_u16() == code,
            "expected {code}, got {} {:?}",
            self.status,
            self.body
        );
        let v = self.json()?;
        anyhow::ensure!(
            v["kind"] == "Status" && v["apiVersion"] == "v1" && v["status"] == "Failure",
            "{v}"
        );
        anyhow::ensure!(v["code"] == code, "{v}");
        Ok(v["message"].as_str().unwrap_or_default().to_owned())
    }
}

/// An HTTPS client that opens one connection per request.
#[derive(Clone)]
pub struct Client {
    addr: SocketAddr,
    tls: Arc<rustls::ClientConfig>,
    server_name: String,
}

impl Client {
    pub fn new(addr: SocketAddr, ca_pem: &[u8], server_name: &str) -> anyhow::Result<Self> {
        let tls = tether_runtime::tls::client_config(Some(ca_pem), &[b"h2", b"http/1.1"])?;
        Self::with_config(addr, tls, server_name)
    }

    pub fn with_config(
        addr: SocketAddr,
        tls: Arc<rustls::ClientConfig>,
        server_name: &str,
    ) -> anyhow::Result<Self> {
        Ok(Self {
            addr,
            tls,
            server_name: server_name.to_owned(),
        })
    }

    pub async fn raw_tls(
        &self,
        alpn: &[u8],
    ) -> anyhow::Result<tokio_rustls::client::TlsStream<TcpStream>> {
        self.raw_tls_from(alpn, None).await
    }

    /// A TLS connection from `source` (another loopback address such as 127.0.0.2, to be another client IP)
    /// when given.
    pub async fn raw_tls_from(
        &self,
        alpn: &[u8],
        source: Option<std::net::IpAddr>,
    ) -> anyhow::Result<tokio_rustls::client::TlsStream<TcpStream>> {
        let tcp = match source {
            None => TcpStream::connect(self.addr).await?,
            Some(ip) => self.tcp_from(ip).await?,
        };
        self.tls_over(tcp, alpn).await
    }

    /// A TCP connection to the relay from the loopback address `ip`.
    pub async fn tcp_from(&self, ip: std::net::IpAddr) -> anyhow::Result<TcpStream> {
        let socket = match ip {
            std::net::IpAddr::V4(_) => tokio::net::TcpSocket::new_v4()?,
            std::net::IpAddr::V6(_) => tokio::net::TcpSocket::new_v6()?,
        };
        socket.bind(SocketAddr::new(ip, 0))?;
        Ok(socket.connect(self.addr).await?)
    }

    /// TLS over a TCP connection to the relay.
    pub async fn tls_over(
        &self,
        tcp: TcpStream,
        alpn: &[u8],
    ) -> anyhow::Result<tokio_rustls::client::TlsStream<TcpStream>> {
        let mut config = (*self.tls).clone();
        config.alpn_protocols = vec![alpn.to_vec()];
        let name = rustls::pki_types::ServerName::try_from(self.server_name.clone())?;
        Ok(TlsConnector::from(Arc::new(config))
            .connect(name, tcp)
            .await?)
    }

    /// Sends one request over HTTP/1.1 (`h2 = false`) or HTTP/2 and reads the whole response.
    pub async fn send(&self, h2: bool, req: Request<Full<Bytes>>) -> anyhow::Result<Reply> {
        let resp = if h2 {
            let io = TokioIo::new(self.raw_tls(b"h2").await?);
            let (mut sender, conn) =
                hyper::client::conn::http2::handshake(TokioExecutor::new(), io).await?;
            tokio::spawn(conn);
            sender.send_request(req).await?
        } else {
            let io = TokioIo::new(self.raw_tls(b"http/1.1").await?);
            let (mut sender, conn) = hyper::client::conn::http1::handshake(io).await?;
            tokio::spawn(conn);
            sender.send_request(req).await?
        };
        let (parts, body) = resp.into_parts();
        let body = body.collect().await?.to_bytes();
        Ok(Reply {
            status: parts.status,
            headers: parts.headers,
            body,
            version: parts.version,
        })
    }

    /// A request builder with the right URI form for either protocol.
    pub fn request(&self, h2: bool, method: Method, path: &str) -> http::request::Builder {
        let builder = Request::builder().method(method);
        if h2 {
            builder
                .uri(format!(
                    "https://{}:{}{}",
                    self.server_name,
                    self.addr.port(),
                    path
                ))
                .version(Version::HTTP_2)
        } else {
            builder.uri(path).header(
                http::header::HOST,
                format!("{}:{}", self.server_name, self.addr.port()),
            )
        }
    }

    pub async fn get(&self, path: &str, token: Option<&str>) -> anyhow::Result<Reply> {
        let mut b = self.request(false, Method::GET, path);
        if let Some(t) = token {
            b = b.header(http::header::AUTHORIZATION, format!("Bearer {t}"));
        }
        self.send(false, b.body(Full::default())?).await
    }

    pub async fn post_json(
        &self,
        path: &str,
        token: Option<&str>,
        body: &Value,
    ) -> anyhow::Result<Reply> {
        let mut b = self
            .request(false, Method::POST, path)
            .header(http::header::CONTENT_TYPE, "application/json");
        if let Some(t) = token {
            b = b.header(http::header::AUTHORIZATION, format!("Bearer {t}"));
        }
        self.send(false, b.body(Full::new(Bytes::from(body.to_string())))?)
            .await
    }
}

/// The admin API, with the admin token.
pub struct Admin {
    pub client: Client,
    pub token: String,
}

impl Admin {
    pub async fn create(&self, name: &str) -> anyhow::Result<Reply> {
        self.client
            .post_json(
                "/api/v1/clusters",
                Some(&self.token),
                &serde_json::json!({ "name": name }),
            )
            .await
    }

    /// Creates `name` and returns its onboarding token.
    pub async fn create_ok(&self, name: &str) -> anyhow::Result<String> {
        let reply = self.create(name).await?;
        anyhow::ensure!(
            reply.status == StatusCode::CREATED,
            "create {name}: {reply:?}"
        );
        reply.json()?["onboardingToken"]
            .as_str()
            .map(str::to_owned)
            .ok_or_else(|| anyhow!("no onboardingToken"))
    }

    /// Creates `name` and onboards it as an agent would; returns the agent's identity.
    pub async fn onboarded(&self, name: &str) -> anyhow::Result<AgentIdentity> {
        let token = self.create_ok(name).await?;
        self.onboard(name, &token).await
    }

    /// Onboards `name` with `token`: a new key, a CSR, the relay's certificate.
    pub async fn onboard(&self, name: &str, token: &str) -> anyhow::Result<AgentIdentity> {
        let (key_pem, csr) = new_csr("whatever-the-agent-asks-for")?;
        let reply = self
            .client
            .post_json(
                "/agent/v1/onboard",
                None,
                &serde_json::json!({ "cluster": name, "token": token, "csr": csr }),
            )
            .await?;
        anyhow::ensure!(reply.status == StatusCode::OK, "onboard {name}: {reply:?}");
        let v = reply.json()?;
        anyhow::ensure!(v["cluster"] == name, "{v}");
        Ok(AgentIdentity {
            cluster: name.to_owned(),
            cert_pem: v["certificate"]
                .as_str()
                .ok_or_else(|| anyhow!("no certificate: {v}"))?
                .to_owned(),
            key_pem,
            not_after: v["notAfter"]
                .as_str()
                .ok_or_else(|| anyhow!("no notAfter: {v}"))?
                .to_owned(),
        })
    }

    /// `GET /api/v1/clusters?QUERY`, the names in order.
    pub async fn list_names(&self, query: &str) -> anyhow::Result<Vec<String>> {
        let reply = self
            .client
            .get(&format!("/api/v1/clusters?{query}"), Some(&self.token))
            .await?;
        anyhow::ensure!(reply.status == StatusCode::OK, "list {query}: {reply:?}");
        Ok(reply.json()?["items"]
            .as_array()
            .ok_or_else(|| anyhow!("no items"))?
            .iter()
            .filter_map(|c| c["name"].as_str().map(str::to_owned))
            .collect())
    }

    /// Waits until `check` holds for the cluster as `show` returns it; returns that JSON.
    pub async fn wait_for(
        &self,
        name: &str,
        what: &str,
        check: impl Fn(&Value) -> bool,
    ) -> anyhow::Result<Value> {
        let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
        loop {
            let reply = self.show(name).await?;
            let v = if reply.status == StatusCode::OK {
                reply.json()?
            } else {
                Value::Null
            };
            if check(&v) {
                return Ok(v);
            }
            anyhow::ensure!(
                tokio::time::Instant::now() < deadline,
                "cluster {name} never became {what}: {v}"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// Waits until `name`'s `connectivityStatus` is `status`.
    pub async fn wait_status(&self, name: &str, status: &str) -> anyhow::Result<Value> {
        self.wait_for(name, status, |v| v["connectivityStatus"] == status)
            .await
    }

    pub async fn show(&self, name: &str) -> anyhow::Result<Reply> {
        self.client
            .get(&format!("/api/v1/clusters/{name}"), Some(&self.token))
            .await
    }

    pub async fn list(&self) -> anyhow::Result<Reply> {
        self.client.get("/api/v1/clusters", Some(&self.token)).await
    }

    pub async fn delete(&self, name: &str) -> anyhow::Result<Reply> {
        let req = self
            .client
            .request(false, Method::DELETE, &format!("/api/v1/clusters/{name}"))
            .header(
                http::header::AUTHORIZATION,
                format!("Bearer {}", self.token),
            )
            .body(Full::default())?;
        self.client.send(false, req).await
    }

    /// Waits until the API reports `name` as `connected == want`; when connected, also until the relay has
    /// recorded the connection (it registers the tunnel first, then writes the agent version to the store).
    pub async fn wait_connected(&self, name: &str, want: bool) -> anyhow::Result<Value> {
        let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
        loop {
            let reply = self.show(name).await?;
            if reply.status == StatusCode::OK {
                let v = reply.json()?;
                let recorded = !want || !v["agentVersion"].is_null();
                if v["connected"] == want && recorded {
                    return Ok(v);
                }
            }
            anyhow::ensure!(
                tokio::time::Instant::now() < deadline,
                "cluster {name} never became connected={want}"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
}

/// What an agent keeps after onboarding.
#[derive(Debug, Clone)]
pub struct AgentIdentity {
    pub cluster: String,
    pub cert_pem: String,
    pub key_pem: String,
    pub not_after: String,
}

/// A fresh ECDSA P-256 key (PEM) and a CSR for it asking for `cn`.
pub fn new_csr(cn: &str) -> anyhow::Result<(String, String)> {
    let key = rcgen::KeyPair::generate()?;
    let mut params = rcgen::CertificateParams::new(Vec::<String>::new())?;
    params
        .distinguished_name
        .push(rcgen::DnType::CommonName, cn);
    let csr = params.serialize_request(&key)?.pem()?;
    Ok((key.serialize_pem(), csr))
}

/// An agent's TLS config: trusts the relay's CA, presents `identity` when given.
pub fn agent_tls(
    relay: &TestRelay,
    identity: Option<&AgentIdentity>,
    alpn: &[&[u8]],
) -> anyhow::Result<Arc<rustls::ClientConfig>> {
    let mut roots = rustls::RootCertStore::empty();
    for cert in rustls_pemfile::certs(&mut relay.ca_pem.as_bytes()) {
        roots.add(cert?)?;
    }
    let provider = Arc::new(rustls::crypto::aws_lc_rs::default_provider());
    let builder = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()?
        .with_root_certificates(roots);
    let mut config = match identity {
        Some(id) => {
            let chain = rustls_pemfile::certs(&mut id.cert_pem.as_bytes())
                .collect::<Result<Vec<_>, _>>()?;
            let key = rustls_pemfile::private_key(&mut id.key_pem.as_bytes())?
                .ok_or_else(|| anyhow!("no key"))?;
            builder.with_client_auth_cert(chain, key)?
        }
        None => builder.with_no_client_auth(),
    };
    config.alpn_protocols = alpn.iter().map(|p| p.to_vec()).collect();
    Ok(Arc::new(config))
}

/// Dials the tunnel endpoint as `identity`'s agent (header `Tether-Cluster: cluster`).
pub async fn dial_as(
    relay: &TestRelay,
    identity: Option<&AgentIdentity>,
    cluster: &str,
) -> Result<tether_tunnel::Connection, tether_tunnel::ws::ConnectError> {
    use tether_tunnel::ws::ConnectError;
    let tls = agent_tls(relay, identity, &[b"http/1.1"])
        .map_err(|e| ConnectError::Handshake(e.to_string()))?;
    let mut headers = HeaderMap::new();
    headers.insert(
        "tether-cluster",
        http::HeaderValue::from_str(cluster).map_err(|e| ConnectError::Handshake(e.to_string()))?,
    );
    headers.insert(
        "tether-agent-version",
        http::HeaderValue::from_static("0.0.0-test"),
    );
    tether_tunnel::ws::connect(
        &relay.tunnel_url(),
        tls,
        headers,
        tether_tunnel::SessionConfig::new(tether_tunnel::Role::Client),
    )
    .await
}

/// Dials as the agent of `identity.cluster`.
pub async fn dial(
    relay: &TestRelay,
    identity: &AgentIdentity,
) -> Result<tether_tunnel::Connection, tether_tunnel::ws::ConnectError> {
    dial_as(relay, Some(identity), &identity.cluster).await
}
