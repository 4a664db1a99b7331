//! Shared test support: a throwaway CA, an HTTPS "apiserver" that records what reaches it, and kubeconfigs.

#![allow(dead_code, unreachable_pub)]

use std::convert::Infallible;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::{Context as _, Result};
use base64::Engine as _;
use bytes::Bytes;
use http::{HeaderMap, Request, Response, StatusCode, Version};
use http_body_util::{BodyExt, Full, StreamBody, combinators::BoxBody};
use hyper::body::{Frame, Incoming};
use hyper_util::rt::{TokioExecutor, TokioIo};
use rcgen::{BasicConstraints, CertificateParams, CertifiedIssuer, IsCa, KeyPair};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;
use tokio::sync::mpsc;

pub mod harness;
pub mod idp;
pub mod proxy;
pub mod real_relay;
pub mod relay;

/// A CA that issues server and client certificates.
pub struct TestCa {
    issuer: CertifiedIssuer<'static, KeyPair>,
}

/// A PEM certificate and its key.
pub struct Issued {
    pub cert_pem: String,
    pub key_pem: String,
}

impl TestCa {
    pub fn new() -> Result<Self> {
        let mut params = CertificateParams::new(Vec::<String>::new())?;
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        params
            .distinguished_name
            .push(rcgen::DnType::CommonName, "tether test CA");
        Ok(Self {
            issuer: CertifiedIssuer::self_signed(params, KeyPair::generate()?)?,
        })
    }

    pub fn pem(&self) -> String {
        self.issuer.pem()
    }

    pub fn der(&self) -> Vec<u8> {
        self.issuer.der().to_vec()
    }

    pub fn issue(&self, names: &[&str]) -> Result<Issued> {
        let key = KeyPair::generate()?;
        let mut params =
            CertificateParams::new(names.iter().map(|n| n.to_string()).collect::<Vec<_>>())?;
        params.distinguished_name.push(
            rcgen::DnType::CommonName,
            names.first().copied().unwrap_or("client"),
        );
        let cert = params.signed_by(&key, &self.issuer)?;
        Ok(Issued {
            cert_pem: cert.pem(),
            key_pem: key.serialize_pem(),
        })
    }

    /// Signs a certificate request with this CA.
    pub fn sign_csr(
        &self,
        csr: &rcgen::CertificateSigningRequestParams,
    ) -> Result<rcgen::Certificate> {
        Ok(csr.signed_by(&self.issuer)?)
    }

    /// A rustls server config for `names`, ALPN h2 + http/1.1, asking (not requiring) a client certificate.
    pub fn server_config(&self, names: &[&str]) -> Result<Arc<rustls::ServerConfig>> {
        let issued = self.issue(names)?;
        let provider = Arc::new(rustls::crypto::aws_lc_rs::default_provider());
        let mut roots = rustls::RootCertStore::empty();
        roots.add(CertificateDer::from(self.der()))?;
        let verifier = rustls::server::WebPkiClientVerifier::builder_with_provider(
            Arc::new(roots),
            provider.clone(),
        )
        .allow_unauthenticated()
        .build()?;
        let chain = CertificateDer::pem_slice_iter(issued.cert_pem.as_bytes())
            .collect::<Result<Vec<_>, _>>()?;
        let key = PrivateKeyDer::from_pem_slice(issued.key_pem.as_bytes())?;
        let mut config = rustls::ServerConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()?
            .with_client_cert_verifier(verifier)
            .with_single_cert(chain, key)?;
        config.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
        Ok(Arc::new(config))
    }
}

/// What one request looked like when it reached the test apiserver.
#[derive(Debug, Clone)]
pub struct Seen {
    pub method: String,
    pub uri: String,
    pub version: Version,
    pub headers: HeaderMap,
    /// Whether the TLS client presented a certificate.
    pub client_cert: bool,
}

type Body = BoxBody<Bytes, Infallible>;

/// An HTTPS server standing in for the apiserver.
///
/// - `/stream`: a body fed chunk by chunk from [`TestApiserver::stream_sender`];
/// - `/upgrade`: 101 to `tether-test`, then reads to EOF and answers `bye:` + what it read, then closes;
/// - `/version` and `/api/v1/nodes` (list, and watch from a resourceVersion) from the agent's own client
///   (User-Agent `tether-agent/…`): a small cluster whose nodes tests add with [`TestApiserver::add_node`];
/// - `/hang`: recorded, then never answered (an apiserver that accepted a request and went quiet);
/// - `/digest`: reads the whole request body, then answers its length and [`digest`] as JSON;
///   [`TestApiserver::hanging`] counts those still held (a cancelled request stops being held);
/// - anything else: 200 with a JSON echo of method, path and query.
///
/// [`TestApiserver::seen`] lists every request but the agent's own (those are in `agent_requests`).
pub struct TestApiserver {
    pub addr: SocketAddr,
    pub ca: Arc<TestCa>,
    seen: Arc<Mutex<Vec<Seen>>>,
    cluster: Arc<FakeCluster>,
    stream_rx: Arc<Mutex<Option<mpsc::Receiver<Bytes>>>>,
    stream_tx: mpsc::Sender<Bytes>,
    hanging: Arc<std::sync::atomic::AtomicUsize>,
    task: tokio::task::JoinHandle<()>,
}

/// Counts one held `/hang` request until dropped (the server drops it when the client cancels).
struct Held(Arc<std::sync::atomic::AtomicUsize>);

impl Held {
    fn new(count: &Arc<std::sync::atomic::AtomicUsize>) -> Self {
        count.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        Self(count.clone())
    }
}

impl Drop for Held {
    fn drop(&mut self) {
        self.0.fetch_sub(1, std::sync::atomic::Ordering::SeqCst);
    }
}

impl Drop for TestApiserver {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl TestApiserver {
    pub async fn start() -> Result<Self> {
        Self::start_on("127.0.0.1:0".parse()?).await
    }

    /// Listens on `addr` (its certificate names that IP address too).
    pub async fn start_on(addr: SocketAddr) -> Result<Self> {
        let ca = Arc::new(TestCa::new()?);
        let ip = addr.ip().to_string();
        let tls =
            tokio_rustls::TlsAcceptor::from(ca.server_config(&["localhost", "127.0.0.1", &ip])?);
        let listener = TcpListener::bind(addr).await?;
        let addr = listener.local_addr()?;
        let seen = Arc::new(Mutex::new(Vec::new()));
        let cluster = Arc::new(FakeCluster::new());
        let (stream_tx, stream_rx) = mpsc::channel(16);
        let stream_rx = Arc::new(Mutex::new(Some(stream_rx)));
        let hanging = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let task = {
            let hanging = hanging.clone();
            let seen = seen.clone();
            let stream_rx = stream_rx.clone();
            let cluster = cluster.clone();
            tokio::spawn(async move {
                while let Ok((tcp, _)) = listener.accept().await {
                    let tls = tls.clone();
                    let seen = seen.clone();
                    let stream_rx = stream_rx.clone();
                    let cluster = cluster.clone();
                    let hanging = hanging.clone();
                    tokio::spawn(async move {
                        let Ok(tls_stream) = tls.accept(tcp).await else {
                            return;
                        };
                        let client_cert = tls_stream.get_ref().1.peer_certificates().is_some();
                        let service = hyper::service::service_fn(move |req: Request<Incoming>| {
                            let seen = seen.clone();
                            let stream_rx = stream_rx.clone();
                            let cluster = cluster.clone();
                            let hanging = hanging.clone();
                            async move {
                                if is_agent_request(&req) {
                                    return Ok::<_, Infallible>(cluster.handle(&req));
                                }
                                if req.uri().path() == "/digest" {
                                    record(&req, client_cert, &seen);
                                    let answer = match req.into_body().collect().await {
                                        Ok(body) => {
                                            let body = body.to_bytes();
                                            serde_json::json!({"length": body.len(), "digest": digest(&body)})
                                        }
                                        Err(e) => serde_json::json!({"error": e.to_string()}),
                                    };
                                    return Ok(text(StatusCode::OK, &answer.to_string()));
                                }
                                if req.uri().path() == "/hang" {
                                    record(&req, client_cert, &seen);
                                    let _held = Held::new(&hanging);
                                    std::future::pending::<()>().await;
                                }
                                Ok::<_, Infallible>(handle(req, client_cert, &seen, &stream_rx))
                            }
                        });
                        let _ = hyper_util::server::conn::auto::Builder::new(TokioExecutor::new())
                            .serve_connection_with_upgrades(TokioIo::new(tls_stream), service)
                            .await;
                    });
                }
            })
        };
        Ok(Self {
            addr,
            ca,
            seen,
            cluster,
            stream_rx,
            stream_tx,
            hanging,
            task,
        })
    }

    /// How many `/hang` requests the server still holds (sent to it and not cancelled).
    pub fn hanging(&self) -> usize {
        self.hanging.load(std::sync::atomic::Ordering::SeqCst)
    }

    pub fn url(&self) -> String {
        format!("https://{}", self.addr)
    }

    pub fn seen(&self) -> Vec<Seen> {
        self.seen.lock().map(|s| s.clone()).unwrap_or_default()
    }

    /// Adds (or replaces) a node; open watches see ADDED (or MODIFIED).
    pub fn add_node(
        &self,
        name: &str,
        cpu: &str,
        memory: &str,
        labels: &[(&str, &str)],
        provider_id: Option<&str>,
    ) {
        self.cluster
            .add_node(name, cpu, memory, labels, provider_id);
    }

    /// Sets the `gitVersion` served at `/version`.
    pub fn set_version(&self, git_version: &str) {
        if let Ok(mut v) = self.cluster.version.lock() {
            *v = git_version.to_owned();
        }
    }

    /// The agent's own requests (path and query), in order.
    pub fn agent_requests(&self) -> Vec<String> {
        self.cluster
            .requests
            .lock()
            .map(|r| r.clone())
            .unwrap_or_default()
    }

    /// Feeds the `/stream` response body; dropping every sender ends it.
    pub fn stream_sender(&self) -> mpsc::Sender<Bytes> {
        self.stream_tx.clone()
    }

    /// A kube config for this server as the agent would load it (through a kubeconfig file).
    pub async fn kube_config(
        &self,
        dir: &Path,
        creds: Option<&AgentCreds>,
    ) -> Result<kube::Config> {
        let path = write_kubeconfig(dir, &self.url(), &self.ca.pem(), creds)?;
        let kubeconfig = kube::config::Kubeconfig::read_from(&path)?;
        Ok(kube::Config::from_custom_kubeconfig(
            kubeconfig,
            &kube::config::KubeConfigOptions::default(),
        )
        .await?)
    }
}

fn handle(
    mut req: Request<Incoming>,
    client_cert: bool,
    seen: &Mutex<Vec<Seen>>,
    stream_rx: &Mutex<Option<mpsc::Receiver<Bytes>>>,
) -> Response<Body> {
    record(&req, client_cert, seen);
    match req.uri().path() {
        "/stream" => {
            let Some(rx) = stream_rx.lock().ok().and_then(|mut rx| rx.take()) else {
                return text(StatusCode::CONFLICT, "stream already taken");
            };
            let frames = futures_util::stream::unfold(rx, |mut rx| async move {
                rx.recv()
                    .await
                    .map(|chunk| (Ok::<_, Infallible>(Frame::data(chunk)), rx))
            });
            let mut resp = Response::new(BodyExt::boxed(StreamBody::new(frames)));
            resp.headers_mut()
                .insert("content-type", http::HeaderValue::from_static("text/plain"));
            resp
        }
        "/upgrade" => {
            let on_upgrade = hyper::upgrade::on(&mut req);
            tokio::spawn(async move {
                let Ok(upgraded) = on_upgrade.await else {
                    return;
                };
                let mut io = TokioIo::new(upgraded);
                let mut got = Vec::new();
                if io.read_to_end(&mut got).await.is_err() {
                    return;
                }
                let mut reply = b"bye:".to_vec();
                reply.extend_from_slice(&got);
                let _ = io.write_all(&reply).await;
                let _ = io.shutdown().await;
            });
            let mut resp = Response::new(BodyExt::boxed(Full::new(Bytes::new())));
            *resp.status_mut() = StatusCode::SWITCHING_PROTOCOLS;
            let h = resp.headers_mut();
            h.insert("upgrade", http::HeaderValue::from_static("tether-test"));
            h.insert("connection", http::HeaderValue::from_static("Upgrade"));
            h.insert("x-upstream", http::HeaderValue::from_static("yes"));
            resp
        }
        _ => {
            let body = serde_json::json!({
                "method": req.method().as_str(),
                "path": req.uri().path(),
                "query": req.uri().query(),
            });
            let mut resp = text(StatusCode::OK, &body.to_string());
            resp.headers_mut().insert(
                "content-type",
                http::HeaderValue::from_static("application/json"),
            );
            resp
        }
    }
}

/// FNV-1a of `bytes`: what `/digest` answers, to compare a body that went through the agent with what was sent.
pub fn digest(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325, |h, b| {
        (h ^ u64::from(*b)).wrapping_mul(0x0100_0000_01b3)
    })
}

fn record<B>(req: &Request<B>, client_cert: bool, seen: &Mutex<Vec<Seen>>) {
    if let Ok(mut seen) = seen.lock() {
        seen.push(Seen {
            method: req.method().to_string(),
            uri: req.uri().to_string(),
            version: req.version(),
            headers: req.headers().clone(),
            client_cert,
        });
    }
}

fn is_agent_request<B>(req: &Request<B>) -> bool {
    req.headers()
        .get("user-agent")
        .and_then(|v| v.to_str().ok())
        .is_some_and(|ua| ua.starts_with("tether-agent/"))
}

/// Nodes and a version, served to the agent's own client (list and watch).
struct FakeCluster {
    version: Mutex<String>,
    /// Every change: (resourceVersion, event type, object).
    log: Mutex<Vec<(u64, &'static str, serde_json::Value)>>,
    nodes: Mutex<std::collections::BTreeMap<String, serde_json::Value>>,
    latest: tokio::sync::watch::Sender<u64>,
    requests: Mutex<Vec<String>>,
}

impl FakeCluster {
    fn new() -> Self {
        Self {
            version: Mutex::new("v1.33.1".to_owned()),
            log: Mutex::new(Vec::new()),
            nodes: Mutex::new(Default::default()),
            latest: tokio::sync::watch::channel(1).0,
            requests: Mutex::new(Vec::new()),
        }
    }

    fn add_node(
        &self,
        name: &str,
        cpu: &str,
        memory: &str,
        labels: &[(&str, &str)],
        provider_id: Option<&str>,
    ) {
        let (Ok(mut log), Ok(mut nodes)) = (self.log.lock(), self.nodes.lock()) else {
            return;
        };
        let rv = *self.latest.borrow() + 1;
        let labels: serde_json::Map<String, serde_json::Value> = labels
            .iter()
            .map(|(k, v)| ((*k).to_owned(), serde_json::Value::from(*v)))
            .collect();
        let mut spec = serde_json::json!({});
        if let Some(id) = provider_id {
            spec["providerID"] = id.into();
        }
        let node = serde_json::json!({
            "apiVersion": "v1", "kind": "Node",
            "metadata": {"name": name, "labels": labels, "resourceVersion": rv.to_string()},
            "spec": spec,
            "status": {"capacity": {"cpu": cpu, "memory": memory, "pods": "110"}},
        });
        let kind = if nodes.insert(name.to_owned(), node.clone()).is_some() {
            "MODIFIED"
        } else {
            "ADDED"
        };
        log.push((rv, kind, node));
        self.latest.send_replace(rv);
    }

    fn handle<B>(self: &Arc<Self>, req: &Request<B>) -> Response<Body> {
        if let Ok(mut r) = self.requests.lock() {
            r.push(req.uri().to_string());
        }
        let query = req.uri().query().unwrap_or("");
        let param = |name: &str| {
            query.split('&').find_map(|kv| {
                kv.split_once('=')
                    .filter(|(k, _)| *k == name)
                    .map(|(_, v)| v.to_owned())
            })
        };
        match req.uri().path() {
            "/version" => {
                let version = self.version.lock().map(|v| v.clone()).unwrap_or_default();
                json(serde_json::json!({
                    "major": "1", "minor": "33", "gitVersion": version, "gitCommit": "", "gitTreeState": "",
                    "buildDate": "", "goVersion": "", "compiler": "", "platform": "linux/amd64",
                }))
            }
            "/api/v1/nodes" if param("watch").as_deref() == Some("true") => {
                let from: u64 = param("resourceVersion")
                    .and_then(|rv| rv.parse().ok())
                    .unwrap_or(0);
                self.watch(from)
            }
            "/api/v1/nodes" => {
                let rv = *self.latest.borrow();
                let items: Vec<serde_json::Value> = self
                    .nodes
                    .lock()
                    .map(|n| n.values().cloned().collect())
                    .unwrap_or_default();
                json(serde_json::json!({
                    "apiVersion": "v1", "kind": "NodeList",
                    "metadata": {"resourceVersion": rv.to_string()},
                    "items": items,
                }))
            }
            _ => text(StatusCode::NOT_FOUND, "not served to the agent"),
        }
    }

    /// A watch response: every change after `from`, then new ones as they come.
    fn watch(self: &Arc<Self>, from: u64) -> Response<Body> {
        let latest = self.latest.subscribe();
        let frames = futures_util::stream::unfold(
            (from, latest, Arc::clone(self)),
            |(mut sent, mut latest, cluster)| async move {
                loop {
                    let log: Vec<(u64, &'static str, serde_json::Value)> =
                        cluster.log.lock().map(|l| l.clone()).unwrap_or_default();
                    let since = sent;
                    let chunk: String = log
                        .into_iter()
                        .filter(|(rv, _, _)| *rv > since)
                        .map(|(rv, kind, object)| {
                            sent = sent.max(rv);
                            format!("{}\n", serde_json::json!({"type": kind, "object": object}))
                        })
                        .collect();
                    if !chunk.is_empty() {
                        return Some((
                            Ok::<_, Infallible>(Frame::data(Bytes::from(chunk))),
                            (sent, latest, cluster),
                        ));
                    }
                    if latest.changed().await.is_err() {
                        return None;
                    }
                }
            },
        );
        let mut resp = Response::new(BodyExt::boxed(StreamBody::new(frames)));
        resp.headers_mut().insert(
            "content-type",
            http::HeaderValue::from_static("application/json"),
        );
        resp
    }
}

fn json(value: serde_json::Value) -> Response<Body> {
    let mut resp = text(StatusCode::OK, &value.to_string());
    resp.headers_mut().insert(
        "content-type",
        http::HeaderValue::from_static("application/json"),
    );
    resp
}

fn text(status: StatusCode, body: &str) -> Response<Body> {
    let mut resp = Response::new(BodyExt::boxed(Full::new(Bytes::from(body.to_string()))));
    *resp.status_mut() = status;
    resp
}

/// Credentials the agent's own kubeconfig user holds (which forwarding must never use).
pub struct AgentCreds {
    pub token: String,
    pub client: Issued,
}

/// Writes a kubeconfig naming `server` with CA `ca_pem` and, optionally, a user with a token and client cert.
pub fn write_kubeconfig(
    dir: &Path,
    server: &str,
    ca_pem: &str,
    creds: Option<&AgentCreds>,
) -> Result<PathBuf> {
    let b64 = |s: &str| base64::engine::general_purpose::STANDARD.encode(s.as_bytes());
    let user = match creds {
        // An empty token: the user authenticates with its client certificate only.
        Some(c) if c.token.is_empty() => format!(
            "    client-certificate-data: {}\n    client-key-data: {}\n",
            b64(&c.client.cert_pem),
            b64(&c.client.key_pem)
        ),
        Some(c) => format!(
            "    token: {}\n    client-certificate-data: {}\n    client-key-data: {}\n",
            c.token,
            b64(&c.client.cert_pem),
            b64(&c.client.key_pem)
        ),
        None => "    {}\n".to_string(),
    };
    let yaml = format!(
        "apiVersion: v1\nkind: Config\nclusters:\n- name: test\n  cluster:\n    server: {server}\n    certificate-authority-data: {ca}\nusers:\n- name: agent\n  user:\n{user}contexts:\n- name: test\n  context:\n    cluster: test\n    user: agent\ncurrent-context: test\n",
        ca = b64(ca_pem),
    );
    std::fs::create_dir_all(dir)?;
    let path = dir.join("kubeconfig");
    std::fs::write(&path, yaml).context("writing kubeconfig")?;
    Ok(path)
}

/// Polls `check` until it returns `Some`, failing after `deadline`.
pub async fn eventually<T>(deadline: Duration, mut check: impl FnMut() -> Option<T>) -> Result<T> {
    Ok(tether_testkit::wait::eventually("condition", deadline, || {
        let value = check();
        async move { value }
    })
    .await?)
}
