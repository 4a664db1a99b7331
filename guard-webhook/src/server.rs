//! The HTTPS webhook server (hyper, rustls with aws-lc-rs; HTTP/1.1 and HTTP/2).
//!
//! | route | caller | what |
//! |---|---|---|
//! | `POST /authenticate` | apiserver (client certificate with a pinned subject) | TokenReview v1 / v1beta1 |
//! | `POST /authorize` | apiserver (client certificate with a pinned subject) | SubjectAccessReview v1 / v1beta1 |
//! | `PUT /snapshot`, `GET /snapshot` | snapshot pusher (bearer push token, and when configured a client certificate with a pinned subject, issued by the snapshot CA; 404 when no token is configured) | replace / show the RBAC snapshot |
//! | `GET /metrics` | a client certificate with a webhook or metrics subject (or anyone, if made public); or anyone on the separate [`run_metrics`] listener (`--metrics-listen`, off by default, meant for loopback) | Prometheus text |
//! | `GET /healthz` | anyone | `ok` |
//!
//! The client certificate is verified against the configured client CA during the handshake, and its subject
//! common name is then checked against the [`Callers`] lists for the path: a certificate from the same CA for
//! another purpose does not open the webhooks. A certificate issued by one of the [`Callers::snapshot_cas`] (the
//! agent's push certificate) opens `/snapshot` and nothing else, whatever its subject. Connections without a
//! certificate are accepted (for probes) but get 401 on every path but `/healthz`. Bodies are size-bounded, every request has a deadline, and errors are Kubernetes
//! `Status` JSON.

use std::convert::Infallible;
use std::future::Future;
use std::io::BufReader;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::{HeaderMap, Method, Request, Response, StatusCode, header};
use http_body_util::{BodyExt, Full, Limited};
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper_util::rt::{TokioIo, TokioTimer};
use rustls::pki_types::{CertificateDer, UnixTime};
use rustls::server::WebPkiClientVerifier;
use rustls::server::danger::ClientCertVerifier;
use serde_json::{Value, json};
use sha2::{Digest, Sha256};
use subtle::ConstantTimeEq as _;
use tether_runtime::Secret;
use tether_runtime::serve;
use tether_runtime::tls::TlsError;
use tokio::net::TcpListener;
use tokio::sync::Semaphore;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::engine::{Guard, new_request_id};
use crate::review::{
    AccessReviewRequest, ReviewError, TokenReviewRequest, access_review_answer,
    token_review_authenticated, token_review_refused,
};
use crate::snapshot::UpdateOutcome;

/// Who may call what, by the subject common name of the (CA-verified) client certificate.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Callers {
    /// May call `/authenticate` and `/authorize` (and read `/metrics`); default `kube-apiserver`, the client the
    /// webhook kubeconfigs in `deploy/guard/` present. Empty: any certificate of the client CA (not advised).
    pub webhook_subjects: Vec<String>,
    /// When not empty, `PUT`/`GET /snapshot` also needs a client certificate with one of these subjects (besides
    /// the push token): the agent's. Default empty (token only).
    pub snapshot_subjects: Vec<String>,
    /// When not empty, `PUT`/`GET /snapshot` also needs a client certificate issued directly by one of these CA
    /// certificates (DER), and a certificate they issued opens nothing else (not the webhooks, not `/metrics`).
    /// They must also be trusted at the handshake: build the TLS config with [`server_tls_for`]. Default empty.
    pub snapshot_cas: Vec<CertificateDer<'static>>,
    /// May read `/metrics` (besides the webhook subjects), e.g. a Prometheus client certificate.
    pub metrics_subjects: Vec<String>,
    /// `/metrics` on the webhook port without any certificate (default `false`).
    pub public_metrics: bool,
}

impl Default for Callers {
    fn default() -> Self {
        Self {
            webhook_subjects: vec![DEFAULT_WEBHOOK_SUBJECT.to_owned()],
            snapshot_subjects: Vec::new(),
            snapshot_cas: Vec::new(),
            metrics_subjects: Vec::new(),
            public_metrics: false,
        }
    }
}

/// The client certificate subject guard expects from kube-apiserver by default (`deploy/guard/*.kubeconfig`).
pub const DEFAULT_WEBHOOK_SUBJECT: &str = "kube-apiserver";

/// Server limits and timeouts, and who may call.
#[derive(Clone, Debug)]
pub struct Limits {
    /// Largest webhook request body.
    pub max_body_bytes: usize,
    /// Largest snapshot body.
    pub max_snapshot_bytes: usize,
    /// Deadline of one request, body included.
    pub request_timeout: Duration,
    /// Deadline of the TLS handshake.
    pub tls_handshake_timeout: Duration,
    /// Deadline for a request's headers (HTTP/1.1).
    pub header_read_timeout: Duration,
    /// Most connections at once.
    pub max_connections: usize,
    /// How long shutdown waits for requests in flight.
    pub shutdown_grace: Duration,
    /// Whose certificates open which paths.
    pub callers: Callers,
}

impl Default for Limits {
    fn default() -> Self {
        Self {
            max_body_bytes: 64 * 1024,
            max_snapshot_bytes: 8 * 1024 * 1024,
            request_timeout: Duration::from_secs(10),
            tls_handshake_timeout: Duration::from_secs(10),
            header_read_timeout: Duration::from_secs(10),
            max_connections: 1024,
            shutdown_grace: Duration::from_secs(5),
            callers: Callers::default(),
        }
    }
}

/// How the server runs.
#[derive(Clone)]
pub struct ServerConfig {
    /// TLS, from [`server_tls`] (client certificates verified, optional at the handshake).
    pub tls: Arc<rustls::ServerConfig>,
    /// Limits.
    pub limits: Limits,
    /// The bearer token that may `PUT /snapshot`; `None` disables the endpoint.
    pub snapshot_push_token: Option<Secret>,
}

impl std::fmt::Debug for ServerConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ServerConfig")
            .field("limits", &self.limits)
            .field("snapshot_push_token", &self.snapshot_push_token)
            .finish_non_exhaustive()
    }
}

/// Why the server stopped with an error.
#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    /// The listener failed.
    #[error("accepting connections failed: {0}")]
    Accept(#[source] std::io::Error),
    /// An address could not be bound.
    #[error("cannot listen on {addr}{purpose}: {source}")]
    Bind {
        /// The address.
        addr: SocketAddr,
        /// What the listener is for (`""` for the webhooks, `" for metrics"`).
        purpose: &'static str,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
    /// The snapshot client CAs cannot be used.
    #[error("snapshot client CA: {0}")]
    SnapshotCa(#[source] TlsError),
}

/// A TLS server config from PEM certificate chain and key, verifying client certificates against `client_ca_pem`
/// (optional at the handshake, required by the webhook paths). ALPN `h2`, `http/1.1`.
pub fn server_tls(
    cert_pem: &[u8],
    key_pem: &[u8],
    client_ca_pem: &[u8],
) -> Result<Arc<rustls::ServerConfig>, TlsError> {
    server_tls_for(cert_pem, key_pem, client_ca_pem, &Callers::default())
}

/// As [`server_tls`], also trusting `callers`' [`Callers::snapshot_cas`] at the handshake (which path a
/// certificate of theirs may call is decided per request). A CA certificate in both `client_ca_pem` and the
/// snapshot CAs is refused: its certificates would then open nothing but `/snapshot`.
pub fn server_tls_for(
    cert_pem: &[u8],
    key_pem: &[u8],
    client_ca_pem: &[u8],
    callers: &Callers,
) -> Result<Arc<rustls::ServerConfig>, TlsError> {
    let provider = Arc::new(rustls::crypto::aws_lc_rs::default_provider());
    let mut roots = rustls::RootCertStore::empty();
    let cas = pem_certs(client_ca_pem, "client CA")?;
    for ca in cas.iter().cloned() {
        roots
            .add(ca)
            .map_err(|e| TlsError::Invalid(format!("unusable client CA certificate: {e}")))?;
    }
    for ca in &callers.snapshot_cas {
        if cas.contains(ca) {
            return Err(TlsError::Invalid(
                "the snapshot client CA is also a client CA of the webhooks: give the agent's push certificate \
                 a CA of its own (or leave the snapshot CA out and pin --snapshot-client-cn alone)"
                    .to_owned(),
            ));
        }
        roots.add(ca.clone()).map_err(|e| {
            TlsError::Invalid(format!("unusable snapshot client CA certificate: {e}"))
        })?;
    }
    let verifier = WebPkiClientVerifier::builder_with_provider(Arc::new(roots), provider.clone())
        .allow_unauthenticated()
        .build()
        .map_err(|e| TlsError::Invalid(format!("client certificate verifier: {e}")))?;
    let certs = rustls_pemfile::certs(&mut BufReader::new(cert_pem))
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| TlsError::Invalid(format!("malformed server certificate PEM: {e}")))?;
    if certs.is_empty() {
        return Err(TlsError::Invalid(
            "no server certificate found (expected a PEM block \"BEGIN CERTIFICATE\")".to_owned(),
        ));
    }
    let key = rustls_pemfile::private_key(&mut BufReader::new(key_pem))
        .map_err(|e| TlsError::Invalid(format!("malformed private key PEM: {e}")))?
        .ok_or_else(|| {
            TlsError::Invalid(
                "no private key found (expected a PEM block \"BEGIN PRIVATE KEY\")".to_owned(),
            )
        })?;
    let mut config = rustls::ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()?
        .with_client_cert_verifier(verifier)
        .with_single_cert(certs, key)?;
    config.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
    Ok(Arc::new(config))
}

/// The certificates of a PEM bundle (at least one); `what` names it in errors.
pub(crate) fn pem_certs(pem: &[u8], what: &str) -> Result<Vec<CertificateDer<'static>>, TlsError> {
    let certs = rustls_pemfile::certs(&mut BufReader::new(pem))
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| TlsError::Invalid(format!("malformed {what} PEM: {e}")))?;
    if certs.is_empty() {
        return Err(TlsError::Invalid(format!(
            "no {what} certificate found (expected a PEM block \"BEGIN CERTIFICATE\")"
        )));
    }
    Ok(certs)
}

/// Verifies that a client certificate was issued by one of the snapshot CAs (rustls's own verifier, with only
/// those CAs as roots).
fn snapshot_verifier(
    cas: &[CertificateDer<'static>],
) -> Result<Option<Arc<dyn ClientCertVerifier>>, TlsError> {
    if cas.is_empty() {
        return Ok(None);
    }
    let mut roots = rustls::RootCertStore::empty();
    for ca in cas {
        roots.add(ca.clone()).map_err(|e| {
            TlsError::Invalid(format!("unusable snapshot client CA certificate: {e}"))
        })?;
    }
    let provider = Arc::new(rustls::crypto::aws_lc_rs::default_provider());
    let verifier = WebPkiClientVerifier::builder_with_provider(Arc::new(roots), provider)
        .build()
        .map_err(|e| TlsError::Invalid(format!("snapshot client certificate verifier: {e}")))?;
    Ok(Some(verifier))
}

type Body = Full<Bytes>;

struct Shared {
    guard: Arc<Guard>,
    limits: Limits,
    push_token_hash: Option<[u8; 32]>,
}

#[derive(Clone)]
struct ConnCtx {
    peer: SocketAddr,
    /// The verified client certificate's subject common name (`Some("")` when it has none or several).
    client_cn: Option<Arc<str>>,
    /// The certificate was issued by a snapshot CA: it may push snapshots and do nothing else.
    snapshot_issued: bool,
}

impl ConnCtx {
    /// The caller's certificate has one of the `allowed` subjects (any, when empty) and is not a snapshot
    /// pusher's: for the webhooks and `/metrics`.
    fn subject_in(&self, allowed: &[String]) -> bool {
        !self.snapshot_issued && self.cn_in(allowed)
    }

    fn cn_in(&self, allowed: &[String]) -> bool {
        match &self.client_cn {
            None => false,
            Some(cn) => {
                allowed.is_empty() || (!cn.is_empty() && allowed.iter().any(|a| **a == **cn))
            }
        }
    }

    /// The caller may push snapshots as far as its certificate goes: issued by a snapshot CA when those are
    /// configured, with a pinned subject when those are.
    fn may_push(&self, callers: &Callers) -> bool {
        if !callers.snapshot_cas.is_empty() && !self.snapshot_issued {
            return false;
        }
        callers.snapshot_subjects.is_empty() || self.cn_in(&callers.snapshot_subjects)
    }
}

/// The single subject common name of a DER certificate; empty if it has none, several, or cannot be read.
fn common_name(der: &[u8]) -> String {
    let Ok((_, cert)) = x509_parser::parse_x509_certificate(der) else {
        return String::new();
    };
    let mut names = cert.subject().iter_common_name().map(|cn| cn.as_str());
    match (names.next(), names.next()) {
        (Some(Ok(cn)), None) => cn.to_owned(),
        _ => String::new(),
    }
}

/// The accept loop's limits, from guard's: no HTTP/2 keep-alive pings, 64 KiB request heads, 256 streams.
fn serve_limits(limits: &Limits) -> serve::Limits {
    serve::Limits {
        max_connections: limits.max_connections,
        tls_handshake_timeout: limits.tls_handshake_timeout,
        header_read_timeout: limits.header_read_timeout,
        max_header_bytes: 64 * 1024,
        h2_max_concurrent_streams: 256,
        h2_keep_alive_interval: None,
        ..serve::Limits::default()
    }
}

/// Serves `guard` on `listener` until `shutdown` resolves, then drains requests in flight (up to the grace).
pub async fn run(
    guard: Arc<Guard>,
    config: ServerConfig,
    listener: TcpListener,
    shutdown: impl Future<Output = ()> + Send,
) -> Result<(), ServeError> {
    let shared = Arc::new(Shared {
        guard,
        limits: config.limits.clone(),
        push_token_hash: config
            .snapshot_push_token
            .as_ref()
            .map(|t| Sha256::digest(t.expose().as_bytes()).into()),
    });
    let snapshot_issuers =
        snapshot_verifier(&config.limits.callers.snapshot_cas).map_err(ServeError::SnapshotCa)?;
    if let Ok(addr) = listener.local_addr() {
        tracing::info!(%addr, "guard listening");
    }
    let make_service = move |conn: serve::Conn| {
        let shared = shared.clone();
        let snapshot_issued = match (&snapshot_issuers, &conn.client_cert) {
            (Some(verifier), Some(cert)) => verifier
                .verify_client_cert(cert, &[], UnixTime::now())
                .is_ok(),
            _ => false,
        };
        let ctx = ConnCtx {
            peer: conn.peer,
            client_cn: conn
                .client_cert
                .as_ref()
                .map(|c| Arc::from(common_name(c.as_ref()))),
            snapshot_issued,
        };
        service_fn(move |req: Request<Incoming>| {
            let shared = shared.clone();
            let ctx = ctx.clone();
            async move {
                let deadline = shared.limits.request_timeout;
                let response = match tokio::time::timeout(deadline, route(&shared, ctx, req)).await
                {
                    Ok(r) => r,
                    Err(_) => status(
                        StatusCode::GATEWAY_TIMEOUT,
                        "Timeout",
                        "the request took too long",
                    ),
                };
                Ok::<_, Infallible>(response)
            }
        })
    };
    let draining = serve::serve(
        listener,
        config.tls.clone(),
        serve_limits(&config.limits),
        make_service,
        shutdown,
    )
    .await;
    draining.begin();
    if tokio::time::timeout(config.limits.shutdown_grace, draining.wait())
        .await
        .is_err()
    {
        tracing::warn!("requests still open after the shutdown grace period; leaving them");
    }
    tracing::info!("guard stopped");
    Ok(())
}

/// Serves `/metrics` and `/healthz` in plain HTTP on `listener` until `shutdown`, for a local scraper without a
/// client certificate (the program's `--metrics-listen`, off by default and meant for a loopback address).
/// Nothing else is served there.
pub async fn run_metrics(
    guard: Arc<Guard>,
    listener: TcpListener,
    shutdown: impl Future<Output = ()> + Send,
) -> Result<(), ServeError> {
    let slots = Arc::new(Semaphore::new(64));
    let connections = TaskTracker::new();
    let graceful = CancellationToken::new();
    if let Ok(addr) = listener.local_addr() {
        tracing::info!(%addr, "guard metrics listening");
    }
    tokio::pin!(shutdown);
    loop {
        let permit = tokio::select! {
            () = &mut shutdown => break,
            p = slots.clone().acquire_owned() => match p {
                Ok(p) => p,
                Err(_) => break,
            },
        };
        let (tcp, _) = tokio::select! {
            () = &mut shutdown => break,
            accepted = listener.accept() => match accepted {
                Ok(a) => a,
                Err(e) if is_transient(&e) => {
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    continue;
                }
                Err(e) => return Err(ServeError::Accept(e)),
            },
        };
        let guard = guard.clone();
        let graceful = graceful.clone();
        connections.spawn(async move {
            let svc = service_fn(move |req: Request<Incoming>| {
                let guard = guard.clone();
                async move {
                    let response = match (req.uri().path(), req.method()) {
                        ("/metrics", &Method::GET) => metrics(&guard),
                        ("/healthz", &Method::GET) => text(StatusCode::OK, "ok"),
                        (path, _) => status(
                            StatusCode::NOT_FOUND,
                            "NotFound",
                            &format!("the metrics listener serves no {path}"),
                        ),
                    };
                    Ok::<_, Infallible>(response)
                }
            });
            let mut builder = hyper::server::conn::http1::Builder::new();
            builder
                .timer(TokioTimer::new())
                .header_read_timeout(Duration::from_secs(10));
            let conn = builder.serve_connection(TokioIo::new(tcp), svc);
            tokio::pin!(conn);
            tokio::select! {
                _ = conn.as_mut() => {}
                () = graceful.cancelled() => {
                    conn.as_mut().graceful_shutdown();
                    let _ = tokio::time::timeout(Duration::from_secs(5), conn.as_mut()).await;
                }
            }
            drop(permit);
        });
    }
    drop(listener);
    graceful.cancel();
    connections.close();
    let _ = tokio::time::timeout(Duration::from_secs(5), connections.wait()).await;
    Ok(())
}

fn is_transient(e: &std::io::Error) -> bool {
    use std::io::ErrorKind::*;
    matches!(
        e.kind(),
        ConnectionAborted | ConnectionReset | Interrupted | WouldBlock | OutOfMemory
    ) || matches!(e.raw_os_error(), Some(23 | 24))
}

fn request_id(headers: &HeaderMap) -> String {
    ["audit-id", "x-request-id"]
        .iter()
        .filter_map(|h| headers.get(*h))
        .filter_map(|v| v.to_str().ok())
        .map(str::trim)
        .find(|v| {
            !v.is_empty()
                && v.len() <= 64
                && v.bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
        })
        .map(str::to_owned)
        .unwrap_or_else(new_request_id)
}

fn metrics(guard: &Guard) -> Response<Body> {
    let mut r = text(StatusCode::OK, &guard.metrics().encode());
    r.headers_mut().insert(
        header::CONTENT_TYPE,
        http::HeaderValue::from_static(
            "application/openmetrics-text; version=1.0.0; charset=utf-8",
        ),
    );
    r
}

async fn route(shared: &Shared, ctx: ConnCtx, req: Request<Incoming>) -> Response<Body> {
    let path = req.uri().path().to_owned();
    let method = req.method().clone();
    match (path.as_str(), &method) {
        ("/healthz", &Method::GET) => text(StatusCode::OK, "ok"),
        ("/metrics", &Method::GET) => {
            let callers = &shared.limits.callers;
            if callers.public_metrics
                || ctx.subject_in(&callers.webhook_subjects)
                || (!callers.metrics_subjects.is_empty()
                    && ctx.subject_in(&callers.metrics_subjects))
            {
                metrics(&shared.guard)
            } else {
                status(
                    StatusCode::UNAUTHORIZED,
                    "Unauthorized",
                    "/metrics needs a client certificate with an allowed subject on this port",
                )
            }
        }
        ("/authenticate", &Method::POST) => authenticate(shared, &ctx, req).await,
        ("/authorize", &Method::POST) => authorize(shared, &ctx, req).await,
        ("/snapshot", &Method::PUT | &Method::GET) => snapshot(shared, &ctx, req).await,
        ("/healthz" | "/metrics" | "/authenticate" | "/authorize" | "/snapshot", _) => status(
            StatusCode::METHOD_NOT_ALLOWED,
            "MethodNotAllowed",
            &format!("{method} is not allowed on {path}"),
        ),
        _ => status(
            StatusCode::NOT_FOUND,
            "NotFound",
            &format!("guard serves no {path}"),
        ),
    }
}

async fn read_body(req: Request<Incoming>, limit: usize) -> Result<Bytes, Response<Body>> {
    if let Some(len) = req
        .headers()
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<usize>().ok())
        && len > limit
    {
        return Err(too_large(limit));
    }
    match Limited::new(req.into_body(), limit).collect().await {
        Ok(b) => Ok(b.to_bytes()),
        Err(e) if e.is::<http_body_util::LengthLimitError>() => Err(too_large(limit)),
        Err(_) => Err(status(
            StatusCode::BAD_REQUEST,
            "BadRequest",
            "the request body could not be read",
        )),
    }
}

fn too_large(limit: usize) -> Response<Body> {
    status(
        StatusCode::PAYLOAD_TOO_LARGE,
        "RequestEntityTooLarge",
        &format!("the request body is larger than {limit} bytes"),
    )
}

fn unauthenticated_caller(
    shared: &Shared,
    webhook: &'static str,
    id: &str,
    ctx: &ConnCtx,
) -> Response<Body> {
    let (audit, message) = match &ctx.client_cn {
        None => (
            "caller presented no client certificate",
            "a client certificate issued by the configured client CA is required",
        ),
        Some(_) if ctx.snapshot_issued => (
            "caller presented a snapshot push certificate",
            "a snapshot push certificate may push snapshots only",
        ),
        Some(_) => (
            "caller's client certificate subject is not allowed",
            "the client certificate's subject is not allowed to call this webhook",
        ),
    };
    tracing::warn!(peer = %ctx.peer, subject = ?ctx.client_cn, webhook, "refused a webhook caller");
    shared.guard.record_error(webhook, id, audit);
    status(StatusCode::UNAUTHORIZED, "Unauthorized", message)
}

/// What both webhooks do first: check the caller, read the body and parse the review; each refusal is audited.
async fn admit<T>(
    shared: &Shared,
    ctx: &ConnCtx,
    req: Request<Incoming>,
    webhook: &'static str,
    parse: fn(&[u8]) -> Result<T, ReviewError>,
) -> Result<(String, T), Response<Body>> {
    let id = request_id(req.headers());
    if !ctx.subject_in(&shared.limits.callers.webhook_subjects) {
        return Err(unauthenticated_caller(shared, webhook, &id, ctx));
    }
    let body = read_body(req, shared.limits.max_body_bytes)
        .await
        .inspect_err(|_| shared.guard.record_error(webhook, &id, "unreadable body"))?;
    match parse(&body) {
        Ok(review) => Ok((id, review)),
        Err(e) => {
            shared.guard.record_error(webhook, &id, &e.to_string());
            Err(status(
                StatusCode::BAD_REQUEST,
                "BadRequest",
                &e.to_string(),
            ))
        }
    }
}

async fn authenticate(shared: &Shared, ctx: &ConnCtx, req: Request<Incoming>) -> Response<Body> {
    let (id, review) =
        match admit(shared, ctx, req, "authenticate", TokenReviewRequest::parse).await {
            Ok(admitted) => admitted,
            Err(refused) => return refused,
        };
    let answer = match shared.guard.authenticate(&review.token, &id).await {
        Ok(identity) => token_review_authenticated(&review.api_version, &identity),
        Err(e) => token_review_refused(&review.api_version, &e.to_string()),
    };
    json_response(StatusCode::OK, &answer)
}

async fn authorize(shared: &Shared, ctx: &ConnCtx, req: Request<Incoming>) -> Response<Body> {
    let (id, review) = match admit(shared, ctx, req, "authorize", AccessReviewRequest::parse).await
    {
        Ok(admitted) => admitted,
        Err(refused) => return refused,
    };
    let decision = shared.guard.authorize(&review.request, &id);
    json_response(
        StatusCode::OK,
        &access_review_answer(&review.api_version, &decision, ""),
    )
}

fn bearer_matches(headers: &HeaderMap, expected: &[u8; 32]) -> bool {
    let Some(value) = headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
    else {
        return false;
    };
    let Some((scheme, token)) = value.trim().split_once(' ') else {
        return false;
    };
    if !scheme.eq_ignore_ascii_case("bearer") || token.trim().is_empty() {
        return false;
    }
    let got: [u8; 32] = Sha256::digest(token.trim().as_bytes()).into();
    bool::from(got.ct_eq(expected))
}

async fn snapshot(shared: &Shared, ctx: &ConnCtx, req: Request<Incoming>) -> Response<Body> {
    let Some(expected) = &shared.push_token_hash else {
        return status(
            StatusCode::NOT_FOUND,
            "NotFound",
            "snapshot pushes are not enabled on this guard",
        );
    };
    if !ctx.may_push(&shared.limits.callers) {
        tracing::warn!(peer = %ctx.peer, subject = ?ctx.client_cn, snapshot_ca = ctx.snapshot_issued, "refused a snapshot caller");
        return status(
            StatusCode::UNAUTHORIZED,
            "Unauthorized",
            "snapshot pushes need the agent's push certificate (issued by the snapshot client CA, with an allowed subject) besides the push token",
        );
    }
    if !bearer_matches(req.headers(), expected) {
        return status(
            StatusCode::UNAUTHORIZED,
            "Unauthorized",
            "a valid snapshot push token is required",
        );
    }
    let store = shared.guard.store();
    if req.method() == Method::GET {
        return json_response(StatusCode::OK, &json!({ "version": store.version() }));
    }
    let body = match read_body(req, shared.limits.max_snapshot_bytes).await {
        Ok(b) => b,
        Err(r) => return r,
    };
    match store.update_json(&body) {
        Ok(UpdateOutcome::Applied) => {
            let version = store.version();
            shared
                .guard
                .metrics()
                .snapshot_version
                .set(i64::try_from(version).unwrap_or(i64::MAX));
            tracing::info!(version, "snapshot applied");
            json_response(
                StatusCode::OK,
                &json!({ "version": version, "applied": true }),
            )
        }
        Ok(UpdateOutcome::Stale { current }) => json_response(
            StatusCode::OK,
            &json!({ "version": current, "applied": false }),
        ),
        Err(crate::snapshot::SnapshotError::Io { path, source }) => {
            tracing::error!(%path, error = %source, "persisting the snapshot failed");
            status(
                StatusCode::INTERNAL_SERVER_ERROR,
                "InternalError",
                "the snapshot could not be persisted; the previous one stays in use",
            )
        }
        Err(e) => status(StatusCode::BAD_REQUEST, "BadRequest", &e.to_string()),
    }
}

fn text(code: StatusCode, body: &str) -> Response<Body> {
    let mut r = Response::new(Full::new(Bytes::from(body.to_owned())));
    *r.status_mut() = code;
    r.headers_mut().insert(
        header::CONTENT_TYPE,
        http::HeaderValue::from_static("text/plain; charset=utf-8"),
    );
    r
}

fn json_response(code: StatusCode, value: &Value) -> Response<Body> {
    let bytes = serde_json::to_vec(value).unwrap_or_default();
    let mut r = Response::new(Full::new(Bytes::from(bytes)));
    *r.status_mut() = code;
    r.headers_mut().insert(
        header::CONTENT_TYPE,
        http::HeaderValue::from_static("application/json"),
    );
    r
}

/// The one place errors become HTTP: a Kubernetes `Status` body.
fn status(code: StatusCode, reason: &str, message: &str) -> Response<Body> {
    json_response(
        code,
        &json!({
            "apiVersion": "v1",
            "kind": "Status",
            "status": "Failure",
            "message": message,
            "reason": reason,
            "code": code.as_u16(),
        }),
    )
}
