//! Serving one tunnel stream: an HTTP/1.1 exchange from the relay, forwarded to THE apiserver and nothing else.
//!
//! The upstream URL, its CA and its TLS server name come from the agent's kube config, never from the request:
//! absolute-form URIs naming another host are refused (400), `CONNECT` is refused (405), and the upstream URI is
//! always the apiserver base plus the request's path and query.
//!
//! Pass-through (the default, and for every token that is not Entra-style): the user's `Authorization` header
//! reaches the apiserver unchanged and the forwarding client carries no credential of its own (no client
//! certificate, no token).
//!
//! With the authentication proxy ([`Upstream::with_auth_proxy`], [`crate::auth_proxy`]): a request with an
//! Entra-style bearer token is validated in the agent and refused with 401 if invalid; if valid, it is sent
//! on separate clients that carry the agent's OWN credentials from its kube config (client certificate and/or
//! token), with the user's `Authorization` and `Impersonate-*` headers replaced by impersonation headers for
//! the validated identity.

use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use http::header::{self, HeaderMap, HeaderName, HeaderValue};
use http::uri::{Authority, PathAndQuery, Scheme};
use http::{Method, Request, Response, StatusCode, Uri};
use http_body_util::{Either, Empty, Full};
use hyper::body::Incoming;
use hyper_rustls::FixedServerNameResolver;
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use kube::client::ConfigExt as _;
use rustls::pki_types::ServerName;
use tether_auth::Identity;
use tether_runtime::serve::BoxError;
use tether_tunnel::heads::{self, BodyReader, ReadChunk, SharedStream, WriteChunk};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tower::ServiceExt as _;

use crate::auth_proxy::{AuthProxy, Credential, impersonate};
use crate::pool::{self, Busy, Lease, Leased, Pool, PoolOptions};
use crate::upstream::{
    Conn, ConnectTimedOut, Http2, LegacyClient, ReqBody, RespBody, SendError, Settings,
    TimeoutConnector,
};

/// The body of a response the agent sends back over a stream: the apiserver's, streamed, or a small error.
pub type ResponseBody = Either<Leased, Full<Bytes>>;

/// Connect timeout to the apiserver when the kube config sets none.
const DEFAULT_CONNECT_TIMEOUT: Duration = Duration::from_secs(10);
/// How long a stream may take to deliver a complete request head.
const HEADER_READ_TIMEOUT: Duration = Duration::from_secs(30);
/// Bound on the buffered request head (request line and headers).
const MAX_HEADER_BYTES: usize = 64 * 1024;
/// How long a served stream waits for the relay to finish with it.
const LINGER_TIMEOUT: Duration = Duration::from_secs(30);
/// Idle pooled connections to the apiserver are closed after this long.
const POOL_IDLE_TIMEOUT: Duration = Duration::from_secs(90);
/// HTTP/2 receive window of each request on a pooled upstream connection: the tunnel stream's initial window,
/// as a response cannot leave the agent faster than its tunnel stream takes it. The connection's window is this
/// times the streams per connection (see [`clients`]).
const UPSTREAM_STREAM_WINDOW: u32 = 256 * 1024;
/// How long a pooled request whose user went away still waits for its response head before it is cancelled
/// (see [`send_pooled`]).
const ABANDONED_HEAD_WAIT: Duration = Duration::from_secs(10);

/// Why the upstream (apiserver) client could not be built from the kube config.
#[derive(Debug, thiserror::Error)]
pub enum UpstreamError {
    /// The cluster URL is not an absolute http(s) URL.
    #[error("invalid apiserver URL {url:?}: {reason}")]
    InvalidUrl {
        /// The URL from the kube config.
        url: String,
        /// What is wrong with it.
        reason: &'static str,
    },
    /// The TLS server name from the kube config is not a valid DNS name or IP address.
    #[error("invalid TLS server name {0:?}")]
    InvalidServerName(String),
    /// rustls rejected the TLS configuration.
    #[error("TLS configuration rejected: {0}")]
    Tls(#[source] rustls::Error),
    /// The TLS settings or the agent's own credentials could not be loaded from the kube config (its CA file
    /// or data, client certificate, token, exec plugin).
    #[error("cannot load the TLS settings or credentials from the kube config: {0}")]
    Credentials(#[source] kube::Error),
    /// The kube config holds no credential of the agent's own, so impersonation cannot work.
    #[error(
        "the kube config has no credentials of the agent's own (client certificate or token); the authentication proxy needs them to impersonate users"
    )]
    NoOwnCredentials,
}

/// The one apiserver this agent forwards to, with its HTTP clients. Cheap to clone.
#[derive(Clone)]
pub struct Upstream {
    inner: Arc<UpstreamInner>,
}

struct UpstreamInner {
    scheme: Scheme,
    authority: Authority,
    /// The cluster URL's path without its trailing slash ("" when none).
    base_path: String,
    /// h2 or HTTP/1.1, pooled keep-alive connections that grow with load: ordinary requests.
    pooled: Pool<Conn>,
    /// HTTP/1.1 only, no idle pool: upgrade requests (an h2 connection cannot upgrade).
    upgrade: LegacyClient,
    /// The authentication proxy and the clients carrying the agent's own credentials; `None`: pass-through
    /// only.
    impersonating: Option<Impersonating>,
}

/// Sends requests as the agent itself, impersonating users the proxy authenticated.
struct Impersonating {
    proxy: AuthProxy,
    /// Like [`UpstreamInner::pooled`], presenting the agent's client certificate if it has one.
    pooled: Pool<Conn>,
    /// Like [`UpstreamInner::upgrade`], presenting the agent's client certificate if it has one.
    upgrade: LegacyClient,
    /// Produces the agent's `Authorization` header (static or refreshed token, basic auth); `None` when the
    /// agent authenticates with its client certificate only.
    authorization: Option<Authorizer>,
}

/// kube-rs's auth layer around a service that hands back the headers it was given: the agent's current
/// `Authorization` value, refreshed as kube-rs does (token files re-read, exec plugins re-run).
type Authorizer = tower::util::BoxCloneSyncService<Request<Empty<Bytes>>, Response<()>, BoxError>;

impl std::fmt::Debug for Upstream {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Upstream")
            .field("base", &self.base())
            .finish_non_exhaustive()
    }
}

impl Upstream {
    /// Builds the forwarding clients from a kube config: its cluster URL, its TLS settings as kube-rs builds them
    /// (the CA re-read from `root_cert_file` to follow a rotation, else `root_cert`, else the platform's roots;
    /// `accept_invalid_certs`), `tls_server_name` and `connect_timeout`.
    /// The config's credentials (client certificate, token, exec plugin) are deliberately NOT used.
    pub fn from_kube_config(config: &kube::Config) -> Result<Self, UpstreamError> {
        Self::from_kube_config_with(config, None, PoolOptions::default())
    }

    /// [`Upstream::from_kube_config`] or, with `proxy`, [`Upstream::with_auth_proxy`], with the connection pool
    /// sized by `pool` ([`crate::pool`]).
    pub fn from_kube_config_with(
        config: &kube::Config,
        proxy: Option<AuthProxy>,
        pool: PoolOptions,
    ) -> Result<Self, UpstreamError> {
        let mut inner = UpstreamInner::pass_through(config, &pool)?;
        if let Some(proxy) = proxy {
            inner.impersonating = Some(Impersonating::new(
                config,
                proxy,
                &pool,
                &inner.scheme,
                &inner.authority,
            )?);
        }
        Ok(Self {
            inner: Arc::new(inner),
        })
    }

    /// Like [`Upstream::from_kube_config`], with the authentication proxy: requests with an Entra-style token
    /// are validated by `proxy` and, if valid, sent with the agent's OWN credentials from `config` (its client
    /// certificate, token, token file or exec plugin, as kube-rs loads them) and impersonation headers. Fails
    /// when `config` holds no credential of the agent's own.
    pub fn with_auth_proxy(config: &kube::Config, proxy: AuthProxy) -> Result<Self, UpstreamError> {
        Self::from_kube_config_with(config, Some(proxy), PoolOptions::default())
    }

    /// Pooled upstream connections and requests in use now, pass-through and impersonating together
    /// (upgrades, which have a connection each, are not counted).
    pub(crate) fn usage(&self) -> pool::Usage {
        let own = self.inner.pooled.usage();
        match &self.inner.impersonating {
            Some(imp) => own + imp.pooled.usage(),
            None => own,
        }
    }

    /// Whether the authentication proxy is on.
    pub fn impersonates(&self) -> bool {
        self.inner.impersonating.is_some()
    }

    /// The apiserver base URL requests are forwarded to.
    pub fn base(&self) -> String {
        format!(
            "{}://{}{}",
            self.inner.scheme, self.inner.authority, self.inner.base_path
        )
    }

    /// The upstream URI for a request target: the apiserver base plus the target's path and query. The target
    /// may be origin-form (`/api/v1/...`) or absolute-form naming the apiserver itself; anything else (another
    /// host, authority-form, `*`) is refused.
    pub fn target(&self, request_uri: &Uri) -> Result<Uri, TargetError> {
        if let Some(authority) = request_uri.authority()
            && !authority
                .as_str()
                .eq_ignore_ascii_case(self.inner.authority.as_str())
        {
            return Err(TargetError::OtherHost);
        }
        let given = request_uri.path_and_query();
        let path = given.map(PathAndQuery::as_str).unwrap_or("/");
        if !path.starts_with('/') {
            return Err(TargetError::NotAPath);
        }
        let path_and_query = match given {
            // Parsed already: used as it is (a clone shares its bytes).
            Some(given) if self.inner.base_path.is_empty() => given.clone(),
            _ => PathAndQuery::try_from(format!("{}{}", self.inner.base_path, path))
                .map_err(|_| TargetError::NotAPath)?,
        };
        Uri::builder()
            .scheme(self.inner.scheme.clone())
            .authority(self.inner.authority.clone())
            .path_and_query(path_and_query)
            .build()
            .map_err(|_| TargetError::NotAPath)
    }
}

impl UpstreamInner {
    /// The plain clients (no credential of the agent's) for `config`.
    fn pass_through(config: &kube::Config, pool: &PoolOptions) -> Result<Self, UpstreamError> {
        let url = &config.cluster_url;
        let invalid = |reason| UpstreamError::InvalidUrl {
            url: url.to_string(),
            reason,
        };
        let scheme = url.scheme().cloned().ok_or_else(|| invalid("no scheme"))?;
        if scheme != Scheme::HTTPS && scheme != Scheme::HTTP {
            return Err(invalid("the scheme must be https or http"));
        }
        let authority = url.authority().cloned().ok_or_else(|| invalid("no host"))?;
        if url.query().is_some() {
            return Err(invalid("a query is not allowed in the cluster URL"));
        }
        let base_path = url.path().trim_end_matches('/').to_string();

        if config.accept_invalid_certs {
            tracing::warn!(
                "the kube config disables apiserver certificate verification (insecure-skip-tls-verify)"
            );
        }
        let tls = upstream_tls(config)?;
        let (pooled, upgrade) = clients(config, &scheme, &authority, tls, pool)?;
        Ok(Self {
            scheme,
            authority,
            base_path,
            pooled,
            upgrade,
            impersonating: None,
        })
    }
}

impl Impersonating {
    /// The impersonating clients, presenting the agent's own credentials from `config`.
    fn new(
        config: &kube::Config,
        proxy: AuthProxy,
        pool: &PoolOptions,
        scheme: &Scheme,
        authority: &Authority,
    ) -> Result<Self, UpstreamError> {
        let tls = kube_tls(config)?;
        let own_identity = tls.client_auth_cert_resolver.clone();
        let authorization = config
            .auth_layer()
            .map_err(UpstreamError::Credentials)?
            .map(|layer| {
                let echo = tower::service_fn(|req: Request<Empty<Bytes>>| async move {
                    let (parts, _) = req.into_parts();
                    let mut response = Response::new(());
                    *response.headers_mut() = parts.headers;
                    // kube-rs's layer is an Either whose halves must share the error type: BoxError.
                    Ok::<_, BoxError>(response)
                });
                tower::util::BoxCloneSyncService::new(
                    tower::ServiceBuilder::new().layer(layer).service(echo),
                )
            });
        if !own_identity.has_certs() && authorization.is_none() {
            return Err(UpstreamError::NoOwnCredentials);
        }
        let (pooled, upgrade) = clients(config, scheme, authority, tls, pool)?;
        Ok(Self {
            proxy,
            pooled,
            upgrade,
            authorization,
        })
    }
}

/// Why a request target was refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum TargetError {
    /// An absolute-form URI named a host other than the apiserver.
    #[error(
        "this agent forwards only to its own apiserver; absolute URIs naming another host are refused"
    )]
    OtherHost,
    /// The target is not a path (authority-form or asterisk-form).
    #[error("the request target must be a path")]
    NotAPath,
}

/// The pooled (h2 or HTTP/1.1) and upgrade (HTTP/1.1, unpooled) clients for the apiserver at
/// `scheme://authority` with `tls`, honouring the kube config's `tls_server_name` and `connect_timeout`.
fn clients(
    config: &kube::Config,
    scheme: &Scheme,
    authority: &Authority,
    tls: rustls::ClientConfig,
    pool: &PoolOptions,
) -> Result<(Pool<Conn>, LegacyClient), UpstreamError> {
    let server_name = match &config.tls_server_name {
        Some(name) => Some(
            ServerName::try_from(name.clone())
                .map_err(|_| UpstreamError::InvalidServerName(name.clone()))?,
        ),
        None => None,
    };
    let connect_timeout = config.connect_timeout.unwrap_or(DEFAULT_CONNECT_TIMEOUT);
    let connector = |http2: bool| {
        let mut http = HttpConnector::new();
        http.enforce_http(false);
        http.set_nodelay(true);
        let builder = hyper_rustls::HttpsConnectorBuilder::new()
            .with_tls_config(tls.clone())
            .https_or_http();
        let builder = match &server_name {
            Some(name) => {
                builder.with_server_name_resolver(FixedServerNameResolver::new(name.clone()))
            }
            None => builder,
        };
        let https = if http2 {
            builder.enable_http1().enable_http2().wrap_connector(http)
        } else {
            builder.enable_http1().wrap_connector(http)
        };
        TimeoutConnector {
            inner: https,
            timeout: connect_timeout,
        }
    };
    // Every stream's window fits in the connection's: a response nobody reads (its user stopped reading, so its
    // tunnel stream is full) holds its own window and never the connection's, which other users' requests on
    // the same upstream connection need.
    let connection_window = upstream_connection_window(pool.streams_per_connection);
    let base = Uri::builder()
        .scheme(scheme.clone())
        .authority(authority.clone())
        .path_and_query("/")
        .build()
        .map_err(|_| UpstreamError::InvalidUrl {
            url: config.cluster_url.to_string(),
            reason: "no usable scheme and host",
        })?;
    // An apiserver without HTTP/2: hyper-util's pooled HTTP/1.1 keep-alive connections, one client per slot.
    let http1 = connector(false);
    let http2 = Http2 {
        connect_timeout,
        stream_window: UPSTREAM_STREAM_WINDOW,
        connection_window,
        idle: POOL_IDLE_TIMEOUT,
    };
    let settings = Arc::new(Settings::new(base, connector(true), http2, move || {
        Client::builder(TokioExecutor::new())
            .timer(TokioTimer::new())
            .pool_timer(TokioTimer::new())
            .pool_idle_timeout(POOL_IDLE_TIMEOUT)
            .build(http1.clone())
    }));
    let pooled = Pool::new(pool.clone(), move |open| {
        Conn::new(settings.clone(), open.clone())
    });
    let upgrade = Client::builder(TokioExecutor::new())
        .timer(TokioTimer::new())
        .pool_max_idle_per_host(0)
        .build(connector(false));
    Ok((pooled, upgrade))
}

/// HTTP/2 receive window of a whole upstream connection: room for every stream it may carry at its full window,
/// so responses nobody reads cannot use up the connection's credit and stall the other requests on it (with
/// hyper's default of 5 MiB, three unread large lists froze every short GET sharing their connection).
fn upstream_connection_window(streams_per_connection: u32) -> u32 {
    // h2's largest window is 2^31 - 1.
    let largest = (1u64 << 31) - 1;
    let wanted = u64::from(streams_per_connection.max(1)) * u64::from(UPSTREAM_STREAM_WINDOW);
    u32::try_from(wanted.min(largest)).unwrap_or(u32::MAX >> 1)
}

/// The apiserver TLS settings exactly as kube-rs's own client builds them ([`kube::client::ConfigExt`]): the
/// config's CA — re-read from `root_cert_file` (in-cluster: the service-account `ca.crt`) about every minute, so
/// the agent follows a cluster CA rotation as kube-rs does — else the platform's roots, `accept_invalid_certs`,
/// and the agent's own client identity, if any (the impersonating clients keep it; pass-through drops it).
fn kube_tls(config: &kube::Config) -> Result<rustls::ClientConfig, UpstreamError> {
    config
        .rustls_client_config()
        .map_err(UpstreamError::Credentials)
}

/// [`kube_tls`] without any client identity: a pass-through request carries the user's identity only.
fn upstream_tls(config: &kube::Config) -> Result<rustls::ClientConfig, UpstreamError> {
    let mut tls = kube_tls(config)?;
    let no_identity = rustls::ClientConfig::builder_with_provider(tls.crypto_provider().clone())
        .with_safe_default_protocol_versions()
        .map_err(UpstreamError::Tls)?
        .with_root_certificates(rustls::RootCertStore::empty())
        .with_no_client_auth();
    tls.client_auth_cert_resolver = no_identity.client_auth_cert_resolver;
    Ok(tls)
}

/// Serves one stream of kind `HTTP` as an HTTP/1.1 server whose every request goes to `upstream`. Returns when
/// the exchange (and, after a `101 Switching Protocols`, the upgraded byte pipe) is over and the peer has
/// finished with the stream.
pub async fn serve_stream<IO>(io: IO, upstream: Upstream) -> Result<(), hyper::Error>
where
    IO: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let io = SharedStream::new(io);
    let pipe = PipeSlot::default();
    let service = {
        let pipe = pipe.clone();
        hyper::service::service_fn(move |mut req: Request<Incoming>| {
            let upstream = upstream.clone();
            let pipe = pipe.clone();
            async move {
                let downstream = is_upgrade(req.headers()).then(|| hyper::upgrade::on(&mut req));
                let Forwarded {
                    mut response,
                    upgraded,
                } = forward(req.map(ReqBody::Http1), &upstream).await;
                if let (Some(downstream), Some(upgraded)) = (downstream, upgraded) {
                    let run_pipe = async move {
                        let (down, up) = match tokio::try_join!(downstream, upgraded) {
                            Ok(pair) => pair,
                            Err(e) => {
                                tracing::debug!(error = %e, "upgrade failed");
                                return;
                            }
                        };
                        copy_upgraded(&mut TokioIo::new(down), up).await;
                    };
                    if let Ok(mut slot) = pipe.0.lock() {
                        *slot = Some(Box::pin(run_pipe));
                    }
                }
                // One stream carries one exchange: `close` makes hyper end the stream after this response. Not
                // on a 101, where it would contradict the upgrade (WebSocket clients reject it).
                if response.status() != StatusCode::SWITCHING_PROTOCOLS {
                    response
                        .headers_mut()
                        .insert(header::CONNECTION, HeaderValue::from_static("close"));
                }
                Ok::<_, std::convert::Infallible>(response)
            }
        })
    };
    let result = hyper::server::conn::http1::Builder::new()
        .timer(TokioTimer::new())
        .header_read_timeout(HEADER_READ_TIMEOUT)
        .max_buf_size(MAX_HEADER_BYTES)
        // The relay may half-close its side once the request is sent; keep answering.
        .half_close(true)
        .serve_connection(TokioIo::new(io.clone()), service)
        .with_upgrades()
        .await;
    // After a 101 the connection future has handed the stream over; the byte pipe runs here, in this task,
    // so that cancelling the task (drain timeout) ends the pipe too.
    let pipe = pipe.0.lock().ok().and_then(|mut slot| slot.take());
    if let Some(pipe) = pipe {
        pipe.await;
    }
    linger(io).await;
    result
}

/// Serves one stream of kind `HTTP_HEADS`: a binary request head, the request body to the end of the relay's
/// side, then the response head and body back (docs/PROTOCOL.md). The request goes to `upstream` exactly as
/// one from [`serve_stream`] does. `abort` resets the stream: used when the apiserver's response breaks off,
/// so the relay sees a failure rather than a clean end.
pub async fn serve_heads<IO, F>(io: IO, upstream: Upstream, abort: F) -> std::io::Result<()>
where
    IO: ReadChunk + WriteChunk + Send + 'static,
    F: FnOnce(),
{
    let io = SharedStream::new(io);
    let mut reader = io.clone();
    let read = tokio::time::timeout(
        HEADER_READ_TIMEOUT,
        heads::read_block(&mut reader, MAX_HEADER_BYTES),
    )
    .await;
    drop(reader);
    let head = match read {
        Ok(Ok(Some(block))) => heads::decode_request(block),
        // The relay finished its side without a request: nothing to answer.
        Ok(Ok(None)) => return Ok(()),
        Ok(Err(e)) => Err(e),
        Err(_) => {
            tracing::debug!("no request head within the header read timeout; dropping the stream");
            return Ok(());
        }
    };
    let head = match head {
        Ok(head) => head,
        Err(heads::BadHead::Io(e)) => return Err(e),
        Err(e) => {
            tracing::debug!(error = %e, "refusing a stream with an invalid request head");
            let response = status_response(StatusCode::BAD_REQUEST, "BadRequest", &e.to_string());
            write_response(&io, response, abort).await?;
            linger(io).await;
            return Ok(());
        }
    };
    let body = if head.body {
        // The stream's own chunks go upstream as they are (no copy), as the relay's response bodies do.
        let reader: Box<dyn ReadChunk + Send> = Box::new(io.clone());
        let length = heads::content_length(&head.headers);
        ReqBody::Stream(BodyReader::new(reader, false).with_length(length))
    } else {
        ReqBody::Empty
    };
    let mut req = Request::new(body);
    *req.method_mut() = head.method;
    *req.uri_mut() = head.target;
    *req.headers_mut() = head.headers;
    let Forwarded { response, upgraded } = forward(req, &upstream).await;
    match upgraded {
        Some(upgraded) if response.status() == StatusCode::SWITCHING_PROTOCOLS => {
            let block = heads::encode_response(response.status(), response.headers(), false)
                .map_err(std::io::Error::other)?;
            let mut writer = io.clone();
            writer.write_all(&block).await?;
            match upgraded.await {
                Ok(up) => copy_upgraded(&mut writer, up).await,
                Err(e) => tracing::debug!(error = %e, "upgrade failed"),
            }
        }
        _ => write_response(&io, response, abort).await?,
    }
    linger(io).await;
    Ok(())
}

/// Writes `response` as a head block and its body's bytes; a body that breaks off resets the stream.
async fn write_response<IO, F>(
    io: &SharedStream<IO>,
    response: Response<ResponseBody>,
    abort: F,
) -> std::io::Result<()>
where
    IO: WriteChunk,
    F: FnOnce(),
{
    use http_body_util::BodyExt as _;
    let (parts, mut body) = response.into_parts();
    let has_body = !http_body::Body::is_end_stream(&body);
    let block = heads::encode_response(parts.status, &parts.headers, has_body)
        .map_err(std::io::Error::other)?;
    let mut writer = io.clone();
    // The head goes out with the first chunks: chunks already in hand are written back to back, so the tunnel's
    // driver wakes once for them (the session copies each into the stream's send buffer, QUIC keeps them as
    // they are; no copy here), not once per HTTP/2 DATA frame of the apiserver's.
    let mut batch = Batch::default();
    batch.push(block);
    loop {
        let frame = if batch.is_empty() {
            body.frame().await
        } else if batch.bytes >= COALESCE_BYTES {
            batch.write_to(&mut writer).await?;
            continue;
        } else {
            match futures_util::FutureExt::now_or_never(body.frame()) {
                Some(frame) => frame,
                None => {
                    batch.write_to(&mut writer).await?;
                    continue;
                }
            }
        };
        match frame {
            None => break,
            Some(Ok(frame)) => {
                if let Ok(data) = frame.into_data() {
                    batch.push(data);
                }
            }
            Some(Err(e)) => {
                tracing::debug!(error = %e, "the apiserver's response broke off; resetting the stream");
                abort();
                return Ok(());
            }
        }
    }
    batch.write_to(&mut writer).await
}

/// Chunks in hand, not written yet.
#[derive(Default)]
struct Batch {
    chunks: Vec<Bytes>,
    bytes: usize,
}

impl Batch {
    fn push(&mut self, chunk: Bytes) {
        self.bytes += chunk.len();
        self.chunks.push(chunk);
    }

    fn is_empty(&self) -> bool {
        self.chunks.is_empty()
    }

    async fn write_to<W: WriteChunk>(&mut self, writer: &mut W) -> std::io::Result<()> {
        heads::write_all_chunks(writer, &mut self.chunks).await?;
        self.bytes = 0;
        Ok(())
    }
}

/// Up to how many bytes of a response already in hand are written back to back before more are gathered.
const COALESCE_BYTES: usize = 64 * 1024;

/// Copies an upgraded exchange both ways until both directions end.
async fn copy_upgraded<D>(down: &mut D, up: hyper::upgrade::Upgraded)
where
    D: AsyncRead + AsyncWrite + Unpin,
{
    let mut up = TokioIo::new(up);
    match tokio::io::copy_bidirectional(down, &mut up).await {
        Ok((to_apiserver, to_client)) => {
            tracing::debug!(to_apiserver, to_client, "upgraded stream finished");
        }
        Err(e) => tracing::debug!(error = %e, "upgraded stream ended with an error"),
    }
}

/// Half-closes our side, then waits (bounded) until the peer is done with the stream: EOF or an error.
///
/// A tunnel stream dropped before it is both finished and read to the end is reset, and a reset may discard
/// response bytes still queued for sending; the relay's HTTP/1.1 client does not half-close its side, it drops
/// (resets) the stream once it has read the whole response. Lingering until then delivers every byte.
async fn linger<IO>(mut io: SharedStream<IO>)
where
    IO: AsyncRead + AsyncWrite + Unpin,
{
    let wait = async {
        let _ = io.shutdown().await;
        // Usually nothing comes (the relay has finished its side): a small buffer, zeroed once per stream.
        let mut sink = [0u8; 256];
        loop {
            match io.read(&mut sink).await {
                Ok(0) | Err(_) => break,
                Ok(_) => {}
            }
        }
    };
    if tokio::time::timeout(LINGER_TIMEOUT, wait).await.is_err() {
        tracing::debug!("the relay kept a finished stream open; dropping it");
    }
}

/// Where the service leaves the byte pipe of an upgraded exchange for [`serve_stream`] to run.
#[derive(Clone, Default)]
struct PipeSlot(Arc<Mutex<Option<Pipe>>>);

/// The byte pipe of an upgraded exchange.
type Pipe = Pin<Box<dyn Future<Output = ()> + Send>>;

/// What [`forward`] produced: the response to send back and, on a `101 Switching Protocols` to a request that
/// asked to upgrade, the apiserver's side of the upgraded connection.
struct Forwarded {
    response: Response<ResponseBody>,
    upgraded: Option<hyper::upgrade::OnUpgrade>,
}

impl From<Response<ResponseBody>> for Forwarded {
    fn from(response: Response<ResponseBody>) -> Self {
        Forwarded {
            response,
            upgraded: None,
        }
    }
}

/// Forwards one request and builds the response to send back; errors become Kubernetes `Status` responses.
async fn forward(req: Request<ReqBody>, upstream: &Upstream) -> Forwarded {
    if req.method() == Method::CONNECT {
        return Forwarded::from(status_response(
            StatusCode::METHOD_NOT_ALLOWED,
            "MethodNotAllowed",
            "CONNECT is not supported",
        ));
    }
    let target = match upstream.target(req.uri()) {
        Ok(target) => target,
        Err(e) => {
            return Forwarded::from(status_response(
                StatusCode::BAD_REQUEST,
                "BadRequest",
                &e.to_string(),
            ));
        }
    };
    let route = match route(upstream, req.headers()).await {
        Ok(route) => route,
        Err(refused) => return refused.into(),
    };
    let upgrade = is_upgrade(req.headers());

    let (parts, body) = req.into_parts();
    let mut headers = forwarded_headers(parts.headers, upgrade);
    let (pooled, upgrading) = match &route {
        Route::PassThrough => (&upstream.inner.pooled, &upstream.inner.upgrade),
        Route::Impersonate(identity, imp) => {
            if let Err(reason) = impersonate(&mut headers, identity) {
                return unauthorized(reason).into();
            }
            match imp.own_authorization().await {
                Ok(Some(value)) => {
                    headers.insert(header::AUTHORIZATION, value);
                }
                Ok(None) => {}
                Err(e) => {
                    let detail = crate::error_chain(e.as_ref());
                    tracing::warn!(error = %detail, "the agent's own credentials are unavailable");
                    return Forwarded::from(status_response(
                        StatusCode::BAD_GATEWAY,
                        "InternalError",
                        &format!("the agent's own credentials are unavailable: {detail}"),
                    ));
                }
            }
            (&imp.pooled, &imp.upgrade)
        }
    };
    let mut out = Request::builder()
        .method(parts.method)
        .uri(target)
        .version(http::Version::HTTP_11);
    if let Some(out_headers) = out.headers_mut() {
        *out_headers = headers;
    }
    let out = match out.body(body) {
        Ok(out) => out,
        Err(e) => {
            return Forwarded::from(status_response(
                StatusCode::BAD_REQUEST,
                "BadRequest",
                &e.to_string(),
            ));
        }
    };

    let lease = if upgrade {
        None
    } else {
        match pooled
            .acquire(pool::is_long_running(&out.method().clone(), out.uri()))
            .await
        {
            Ok(lease) => Some(lease),
            Err(Busy) => return busy(&upstream.base()).into(),
        }
    };
    let sent = match lease {
        Some(lease) => send_pooled(lease, out)
            .await
            .map(|(resp, lease)| (resp, Some(lease))),
        None => upgrading
            .request(out)
            .await
            .map(|resp| (resp.map(RespBody::Http1), None))
            .map_err(SendError::Legacy),
    };
    let (mut resp, lease) = match sent {
        Ok(sent) => sent,
        Err(e) => return upstream_error(&e, &upstream.base()).into(),
    };

    if resp.status() == StatusCode::SWITCHING_PROTOCOLS {
        if !upgrade {
            // The apiserver switched protocols for a request that did not ask to: do not pass that on.
            return Forwarded::from(status_response(
                StatusCode::BAD_GATEWAY,
                "InternalError",
                "unexpected 101 from the apiserver",
            ));
        }
        let upgraded = hyper::upgrade::on(&mut resp);
        let mut response = Response::new(Either::Right(Full::new(Bytes::new())));
        *response.status_mut() = StatusCode::SWITCHING_PROTOCOLS;
        *response.headers_mut() = resp.headers().clone();
        return Forwarded {
            response,
            upgraded: Some(upgraded),
        };
    }

    let (mut parts, body) = resp.into_parts();
    strip_hop_by_hop(&mut parts.headers, false);
    let body = match lease {
        Some(lease) => Leased::new(body, lease),
        None => Leased::unleased(body),
    };
    Response::from_parts(parts, Either::Left(body)).into()
}

/// Sends a request on a shared (pooled) upstream connection; when the user goes away before the response head
/// arrives, the request is handed to a task of its own that waits for the head.
///
/// Dropping a request that is still waiting for its head resets an HTTP/2 stream the apiserver may not have
/// taken up yet, and servers bound those: hyper's h2 server closes the whole connection (GOAWAY
/// `ENHANCE_YOUR_CALM`, "too_many_resets") after 20 resets of streams its application has not accepted, Go's
/// after too many handlers queued — failing every other user's request on that connection. So a request whose
/// tunnel stream goes away keeps going until its head arrives (or [`ABANDONED_HEAD_WAIT`] passes), and only
/// then is dropped: a reset after the head cancels a stream the server is already serving, which is cheap and
/// not counted. The number of such requests is bounded by the pool (each keeps its lease until then).
///
/// The request runs in the caller's task while the caller waits (no task and channel per request: 12 % fewer
/// instructions per small GET in the agent, docs/BENCHMARKS.md); only an abandoned one moves.
async fn send_pooled(lease: Lease<Conn>, out: Request<ReqBody>) -> Sent {
    let mut in_flight = InFlight(Some(Box::pin(async move {
        let result = lease.client().send(out).await;
        (result, lease)
    })));
    let (result, lease) = match in_flight.0.as_mut() {
        Some(request) => request.await,
        None => unreachable!("set above"),
    };
    in_flight.0 = None;
    result.map(|response| (response, lease))
}

/// What [`send_pooled`] gets back: the response head with the lease its body keeps, or why there is none.
type Sent = Result<(Response<RespBody>, Lease<Conn>), SendError>;

/// A pooled request waiting for its head, owning its lease; dropped while waiting, it goes on in a task of its
/// own until the head arrives or [`ABANDONED_HEAD_WAIT`] passes (see [`send_pooled`]).
struct InFlight(Option<Pin<Box<dyn Future<Output = Answered> + Send>>>);

/// A pooled request's answer (or error), with the lease it held.
type Answered = (Result<Response<RespBody>, SendError>, Lease<Conn>);

impl Drop for InFlight {
    fn drop(&mut self) {
        let Some(request) = self.0.take() else {
            return;
        };
        // Without a runtime (it is shutting down) there is nobody left to wait: the request goes.
        if let Ok(runtime) = tokio::runtime::Handle::try_current() {
            runtime.spawn(async move {
                let _ = tokio::time::timeout(ABANDONED_HEAD_WAIT, request).await;
            });
        }
    }
}

/// Every upstream connection is full and none may be added: 503 with `Retry-After`, as kube-apiserver's
/// max-in-flight filter answers.
fn busy(base: &str) -> Response<ResponseBody> {
    tracing::warn!(
        apiserver = base,
        "every upstream connection is full; shedding a request"
    );
    let mut response = status_response(
        StatusCode::SERVICE_UNAVAILABLE,
        "ServiceUnavailable",
        &format!(
            "the agent has too many requests open to the apiserver at {base}; try again shortly"
        ),
    );
    response
        .headers_mut()
        .insert(header::RETRY_AFTER, HeaderValue::from_static("1"));
    response
}

/// How one request goes to the apiserver.
enum Route<'a> {
    /// As the user sent it, on the clients without credentials.
    PassThrough,
    /// As the agent, impersonating the validated identity.
    Impersonate(Identity, &'a Impersonating),
}

/// Decides the route: pass-through unless the proxy is on and the request carries an Entra-style token, which
/// must then validate (else the 401 response to send back).
async fn route<'a>(
    upstream: &'a Upstream,
    headers: &HeaderMap,
) -> Result<Route<'a>, Response<ResponseBody>> {
    let Some(imp) = &upstream.inner.impersonating else {
        return Ok(Route::PassThrough);
    };
    let token = match imp.proxy.credential(headers) {
        Ok(Credential::PassThrough) => return Ok(Route::PassThrough),
        Ok(Credential::Entra(token)) => token,
        Err(reason) => return Err(unauthorized(reason)),
    };
    match imp.proxy.authenticate(token).await {
        Ok(identity) => {
            tracing::debug!(uid = %identity.uid, groups = identity.groups.len(), "Entra token accepted; impersonating");
            Ok(Route::Impersonate(identity, imp))
        }
        Err(e) => {
            tracing::info!(reason = e.label(), "Entra token refused in the cluster");
            Err(unauthorized(&e.to_string()))
        }
    }
}

impl Impersonating {
    /// The agent's own `Authorization` value, if it authenticates with one.
    async fn own_authorization(&self) -> Result<Option<HeaderValue>, BoxError> {
        let Some(authorizer) = &self.authorization else {
            return Ok(None);
        };
        let response = authorizer
            .clone()
            .oneshot(Request::new(Empty::new()))
            .await?;
        Ok(response.headers().get(header::AUTHORIZATION).cloned())
    }
}

/// A 401 `Status`, as the apiserver answers a credential it does not accept.
fn unauthorized(reason: &str) -> Response<ResponseBody> {
    status_response(StatusCode::UNAUTHORIZED, "Unauthorized", reason)
}

/// True when the request asks to switch protocols (`Connection: upgrade` with an `Upgrade` header).
fn is_upgrade(headers: &HeaderMap) -> bool {
    headers.contains_key(header::UPGRADE)
        && connection_tokens(headers).any(|t| t.eq_ignore_ascii_case("upgrade"))
}

fn connection_tokens(headers: &HeaderMap) -> impl Iterator<Item = &str> {
    headers
        .get_all(header::CONNECTION)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .map(str::trim)
        .filter(|t| !t.is_empty())
}

/// Headers that describe one hop, not the message (RFC 9110 §7.6.1), plus the legacy ones proxies drop.
static HOP_BY_HOP: [HeaderName; 8] = [
    header::CONNECTION,
    HeaderName::from_static("keep-alive"),
    HeaderName::from_static("proxy-connection"),
    header::PROXY_AUTHENTICATE,
    header::PROXY_AUTHORIZATION,
    header::TE,
    header::TRAILER,
    header::TRANSFER_ENCODING,
];

/// Removes hop-by-hop headers and those named by `Connection`. With `keep_upgrade`, `Upgrade` and a
/// `Connection: Upgrade` stay so the apiserver sees the upgrade request.
fn strip_hop_by_hop(headers: &mut HeaderMap, keep_upgrade: bool) {
    let named: Vec<HeaderName> = connection_tokens(headers)
        .filter_map(|t| HeaderName::from_bytes(t.as_bytes()).ok())
        .collect();
    // One pass over the names the message has (usually none of these) instead of a hashed removal of each
    // name it might have.
    let doomed: Vec<HeaderName> = headers
        .keys()
        .filter(|name| {
            if *name == header::UPGRADE {
                return !keep_upgrade;
            }
            HOP_BY_HOP.contains(name) || named.contains(name)
        })
        .cloned()
        .collect();
    for name in &doomed {
        headers.remove(name);
    }
    if keep_upgrade {
        headers.insert(header::CONNECTION, HeaderValue::from_static("Upgrade"));
    }
}

/// The headers to send upstream: the request's, minus hop-by-hop ones, minus `Host` (the client sets it from
/// the apiserver URI). `Authorization` and everything else pass unchanged.
fn forwarded_headers(mut headers: HeaderMap, upgrade: bool) -> HeaderMap {
    strip_hop_by_hop(&mut headers, upgrade);
    headers.remove(header::HOST);
    headers
}

fn upstream_error(e: &SendError, base: &str) -> Response<ResponseBody> {
    if crate::chain_has::<ConnectTimedOut>(e) {
        tracing::warn!(apiserver = base, "apiserver connect timed out");
        return status_response(
            StatusCode::GATEWAY_TIMEOUT,
            "Timeout",
            &format!("the agent timed out connecting to the apiserver at {base}"),
        );
    }
    let detail = crate::error_chain(e);
    tracing::warn!(apiserver = base, error = %detail, "apiserver request failed");
    let message = if e.is_connect() {
        format!("the agent cannot reach the apiserver at {base}: {detail}")
    } else {
        format!("the apiserver at {base} failed the request: {detail}")
    };
    status_response(StatusCode::BAD_GATEWAY, "InternalError", &message)
}

/// A Kubernetes `Status` failure response, which kubectl and client libraries know how to show.
pub(crate) fn status_response(
    status: StatusCode,
    reason: &str,
    message: &str,
) -> Response<ResponseBody> {
    let body = serde_json::json!({
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Failure",
        "message": message,
        "reason": reason,
        "code": status.as_u16(),
    });
    let mut response = Response::new(Either::Right(Full::new(Bytes::from(body.to_string()))));
    *response.status_mut() = status;
    response.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    response
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn the_upstream_connection_window_holds_every_stream_at_its_full_window() {
        assert_eq!(
            upstream_connection_window(100),
            100 * UPSTREAM_STREAM_WINDOW
        );
        assert_eq!(upstream_connection_window(0), UPSTREAM_STREAM_WINDOW);
        assert_eq!(upstream_connection_window(u32::MAX), (1 << 31) - 1);
    }

    fn upstream(url: &str) -> Upstream {
        let config = kube::Config::new(url.parse().unwrap());
        Upstream::from_kube_config(&config).unwrap()
    }

    #[test]
    fn target_keeps_path_and_query_and_base_path() {
        let up = upstream("https://api.example:6443");
        let t = up
            .target(&"/api/v1/pods?watch=1&limit=5".parse().unwrap())
            .unwrap();
        assert_eq!(
            t.to_string(),
            "https://api.example:6443/api/v1/pods?watch=1&limit=5"
        );

        let up = upstream("https://gw.example/k8s/prod/");
        let t = up.target(&"/api/v1/namespaces".parse().unwrap()).unwrap();
        assert_eq!(
            t.to_string(),
            "https://gw.example/k8s/prod/api/v1/namespaces"
        );
    }

    #[test]
    fn target_never_leaves_the_apiserver() {
        let up = upstream("https://api.example:6443");
        assert_eq!(
            up.target(&"http://evil.example/api".parse().unwrap()),
            Err(TargetError::OtherHost)
        );
        assert_eq!(
            up.target(&"https://api.example:6444/api".parse().unwrap()),
            Err(TargetError::OtherHost)
        );
        assert_eq!(
            up.target(&"evil.example:443".parse().unwrap()),
            Err(TargetError::OtherHost)
        );
        assert_eq!(up.target(&"*".parse().unwrap()), Err(TargetError::NotAPath));
        // A path that looks like a network-path reference stays a path on the apiserver.
        let t = up.target(&"//evil.example/x".parse().unwrap()).unwrap();
        assert_eq!(
            t.authority().map(Authority::as_str),
            Some("api.example:6443")
        );
        // Absolute-form naming the apiserver itself is fine.
        let t = up
            .target(&"https://api.example:6443/version".parse().unwrap())
            .unwrap();
        assert_eq!(t.to_string(), "https://api.example:6443/version");
    }

    #[test]
    fn rejects_unusable_cluster_urls() {
        for url in ["ftp://x.example", "/relative"] {
            let config = kube::Config::new(url.parse().unwrap());
            assert!(Upstream::from_kube_config(&config).is_err(), "{url}");
        }
    }

    #[test]
    fn hop_by_hop_headers_are_dropped() {
        let mut h = HeaderMap::new();
        h.insert(
            header::CONNECTION,
            HeaderValue::from_static("keep-alive, x-secret-hop"),
        );
        h.insert("x-secret-hop", HeaderValue::from_static("1"));
        h.insert("keep-alive", HeaderValue::from_static("timeout=5"));
        h.insert(
            header::TRANSFER_ENCODING,
            HeaderValue::from_static("chunked"),
        );
        h.insert(header::UPGRADE, HeaderValue::from_static("websocket"));
        h.insert(
            header::AUTHORIZATION,
            HeaderValue::from_static("Bearer user"),
        );
        h.insert(header::HOST, HeaderValue::from_static("relay.example"));
        let out = forwarded_headers(h.clone(), false);
        assert_eq!(out.len(), 1);
        assert_eq!(out[header::AUTHORIZATION], "Bearer user");
    }

    #[test]
    fn upgrade_headers_are_kept_for_upgrades() {
        let mut h = HeaderMap::new();
        h.insert(header::CONNECTION, HeaderValue::from_static("Upgrade"));
        h.insert(header::UPGRADE, HeaderValue::from_static("SPDY/3.1"));
        h.insert(
            "x-stream-protocol-version",
            HeaderValue::from_static("v4.channel.k8s.io"),
        );
        assert!(is_upgrade(&h));
        let out = forwarded_headers(h.clone(), true);
        assert_eq!(out[header::UPGRADE], "SPDY/3.1");
        assert_eq!(out[header::CONNECTION], "Upgrade");
        assert_eq!(out["x-stream-protocol-version"], "v4.channel.k8s.io");
    }
}
