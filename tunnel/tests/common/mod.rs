//! Test support: a relay-like WebSocket upgrade server (hyper + `ws::upgrade_response` +
//! `ws::accept_upgraded`), connection pairs over in-memory pipes, TLS material, and data helpers.
#![allow(dead_code)]

pub(crate) mod cases;

use std::convert::Infallible;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context as _;
use bytes::Bytes;
use http::{HeaderMap, Request, Response, StatusCode};
use http_body_util::Full;
use hyper::body::Incoming as HyperBody;
use hyper::service::service_fn;
use hyper_util::rt::TokioIo;
use tether_tunnel::{
    Connection, OpenOptions, Priority, Role, SessionConfig, Stream, TunnelError, kind, ws,
};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::sync::mpsc;
use tokio::task::JoinHandle;

/// How the test server answers upgrade requests.
#[derive(Clone)]
pub(crate) struct ServerOptions {
    pub(crate) config: SessionConfig,
    /// Required `Authorization` header value; other requests get 401 with a body.
    pub(crate) require_auth: Option<&'static str>,
}

impl ServerOptions {
    pub(crate) fn new() -> Self {
        Self {
            config: SessionConfig::new(Role::Server),
            require_auth: None,
        }
    }
}

/// Serves one HTTP/1.1 connection like the relay's agent endpoint: authenticate, `upgrade_response`, and
/// once hyper hands over the upgraded IO, `accept_upgraded`. Started connections go to `accepted`.
pub(crate) async fn serve_upgrade<IO>(
    io: IO,
    options: ServerOptions,
    accepted: mpsc::UnboundedSender<Connection>,
) where
    IO: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let service = service_fn(move |mut req: Request<HyperBody>| {
        let options = options.clone();
        let accepted = accepted.clone();
        async move {
            if let Some(expected) = options.require_auth {
                let given = req
                    .headers()
                    .get(http::header::AUTHORIZATION)
                    .and_then(|v| v.to_str().ok());
                if given != Some(expected) {
                    return Ok::<_, Infallible>(plain(
                        StatusCode::UNAUTHORIZED,
                        "bad credential for this cluster",
                    ));
                }
            }
            match ws::upgrade_response(&req) {
                Ok(response) => {
                    let on_upgrade = hyper::upgrade::on(&mut req);
                    tokio::spawn(async move {
                        if let Ok(upgraded) = on_upgrade.await {
                            let _ = accepted
                                .send(ws::accept_upgraded(TokioIo::new(upgraded), options.config));
                        }
                    });
                    Ok(response.map(|()| Full::new(Bytes::new())))
                }
                Err(why) => Ok(plain(StatusCode::BAD_REQUEST, &why)),
            }
        }
    });
    let _ = hyper::server::conn::http1::Builder::new()
        .serve_connection(TokioIo::new(io), service)
        .with_upgrades()
        .await;
}

fn plain(status: StatusCode, body: &str) -> Response<Full<Bytes>> {
    let mut response = Response::new(Full::new(Bytes::from(body.to_owned())));
    *response.status_mut() = status;
    response
}

/// Two connected tunnel ends and the task that links their pipes (abort it to kill the transport).
pub(crate) struct Pair {
    pub(crate) client: Connection,
    pub(crate) server: Connection,
    pub(crate) link: JoinHandle<()>,
}

/// A client (`ws::connect_over`, i.e. tungstenite's client handshake) and a server (hyper upgrade +
/// `accept_upgraded`) over in-memory pipes joined by a copying task.
pub(crate) async fn pair() -> anyhow::Result<Pair> {
    pair_with(SessionConfig::new(Role::Client), ServerOptions::new()).await
}

pub(crate) async fn pair_with(
    client_config: SessionConfig,
    server: ServerOptions,
) -> anyhow::Result<Pair> {
    let (client_io, mut link_a) = tokio::io::duplex(64 * 1024);
    let (mut link_b, server_io) = tokio::io::duplex(64 * 1024);
    let link = tokio::spawn(async move {
        let _ = tokio::io::copy_bidirectional(&mut link_a, &mut link_b).await;
    });
    let (tx, mut rx) = mpsc::unbounded_channel();
    tokio::spawn(serve_upgrade(server_io, server, tx));
    let client = ws::connect_over(
        client_io,
        "ws://relay.test/agent/v1/tunnel",
        HeaderMap::new(),
        client_config,
    )
    .await?;
    let server = rx
        .recv()
        .await
        .context("the server did not start a connection")?;
    Ok(Pair {
        client,
        server,
        link,
    })
}

pub(crate) fn open_options(metadata: &'static str) -> OpenOptions {
    OpenOptions {
        kind: kind::HTTP,
        priority: Priority::Normal,
        deadline: Some(Duration::from_secs(30)),
        metadata: Bytes::from_static(metadata.as_bytes()),
    }
}

/// Accepts the next incoming stream with empty metadata.
pub(crate) async fn accept(conn: &Connection) -> anyhow::Result<Stream> {
    let incoming = conn
        .accept()
        .await
        .context("connection ended instead of yielding a stream")?;
    Ok(incoming.accept(Bytes::new())?)
}

/// Opens a stream from `opener` without a deadline and accepts it at `acceptor` with its answer (`answer`)
/// held back for `hold`: the opener's stream, its control handle, and the acceptor's stream.
pub(crate) async fn open_held(
    opener: &Connection,
    acceptor: &Connection,
    metadata: &'static str,
    answer: &'static [u8],
    hold: Duration,
) -> anyhow::Result<(Stream, tether_tunnel::StreamControl, Stream)> {
    let stream = opener.open(OpenOptions {
        deadline: None,
        ..open_options(metadata)
    })?;
    let control = stream.control();
    let incoming = within("accept", acceptor.accept())
        .await?
        .context("no incoming stream")?;
    let served = incoming.accept_deferred(Bytes::from_static(answer), hold)?;
    Ok((stream, control, served))
}

/// Echoes everything read back, then half-closes.
pub(crate) async fn echo(mut stream: Stream) -> anyhow::Result<()> {
    let (mut r, mut w) = tokio::io::split(&mut stream);
    tokio::io::copy(&mut r, &mut w).await?;
    w.shutdown().await?;
    drop((r, w));
    Ok(())
}

/// Serves every incoming stream of `conn` with [`echo`] until the connection ends.
pub(crate) fn spawn_echo_server(conn: Connection) -> JoinHandle<()> {
    tokio::spawn(async move {
        while let Some(incoming) = conn.accept().await {
            if let Ok(stream) = incoming.accept(Bytes::new()) {
                tokio::spawn(echo(stream));
            }
        }
    })
}

/// Deterministic pseudo-random bytes (xorshift), different per seed.
pub(crate) fn pattern(len: usize, seed: u64) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x >> 24) as u8
        })
        .collect()
}

/// Writes `data`, half-closes, and reads everything the peer sends until EOF.
pub(crate) async fn round_trip(stream: Stream, data: Vec<u8>) -> anyhow::Result<Vec<u8>> {
    let (mut r, mut w) = tokio::io::split(stream);
    let writer = tokio::spawn(async move {
        w.write_all(&data).await?;
        w.shutdown().await?;
        Ok::<_, std::io::Error>(w)
    });
    let mut received = Vec::new();
    r.read_to_end(&mut received).await?;
    let w = writer.await??;
    // Finished and read to EOF: dropping must not reset.
    drop(r.unsplit(w));
    Ok(received)
}

/// The [`TunnelError`] inside an io::Error from a stream.
pub(crate) fn tunnel_error(e: &std::io::Error) -> Option<TunnelError> {
    e.get_ref()
        .and_then(|inner| inner.downcast_ref::<TunnelError>())
        .cloned()
}

/// Bounds a test step so that a bug hangs nothing; not a timing assertion.
pub(crate) async fn within<F: Future>(what: &str, f: F) -> anyhow::Result<F::Output> {
    tokio::time::timeout(Duration::from_secs(60), f)
        .await
        .with_context(|| format!("{what} did not finish"))
}

/// A CA and a server certificate for `localhost` and 127.0.0.1, as PEM.
pub(crate) struct Pki {
    pub(crate) ca_pem: String,
    pub(crate) cert_pem: String,
    pub(crate) key_pem: String,
}

pub(crate) fn pki() -> anyhow::Result<Pki> {
    let ca_key = rcgen::KeyPair::generate()?;
    let mut ca_params = rcgen::CertificateParams::new(Vec::<String>::new())?;
    ca_params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
    ca_params
        .distinguished_name
        .push(rcgen::DnType::CommonName, "tether test CA");
    let ca = rcgen::CertifiedIssuer::self_signed(ca_params, ca_key)?;
    let key = rcgen::KeyPair::generate()?;
    let params =
        rcgen::CertificateParams::new(vec!["localhost".to_owned(), "127.0.0.1".to_owned()])?;
    let cert = params.signed_by(&key, &ca)?;
    Ok(Pki {
        ca_pem: ca.pem(),
        cert_pem: cert.pem(),
        key_pem: key.serialize_pem(),
    })
}

/// A TLS listener on 127.0.0.1:0 serving [`serve_upgrade`] on each connection. Returns its port.
pub(crate) async fn tls_server(
    pki: &Pki,
    options: ServerOptions,
    accepted: mpsc::UnboundedSender<Connection>,
) -> anyhow::Result<u16> {
    let config =
        tether_runtime::tls::server_config(pki.cert_pem.as_bytes(), pki.key_pem.as_bytes())?;
    let acceptor = tokio_rustls::TlsAcceptor::from(Arc::clone(&config));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let port = listener.local_addr()?.port();
    tokio::spawn(async move {
        while let Ok((tcp, _)) = listener.accept().await {
            let acceptor = acceptor.clone();
            let options = options.clone();
            let accepted = accepted.clone();
            tokio::spawn(async move {
                if let Ok(tls) = acceptor.accept(tcp).await {
                    serve_upgrade(tls, options, accepted).await;
                }
            });
        }
    });
    Ok(port)
}

/// How the shared cases (`cases.rs`) get a connected pair for one transport.
pub(crate) trait Harness {
    /// QUIC knows the RTT from its handshake; the session learns it from its first ping.
    const RTT_FROM_HANDSHAKE: bool;
    /// How long the idle case stays quiet.
    const QUIET: Duration;
    /// A client and a server connected over this transport, with these settings.
    async fn pair_with(client: SessionConfig, server: SessionConfig) -> anyhow::Result<Pair>;
    /// [`Harness::pair_with`] with default settings.
    async fn pair() -> anyhow::Result<Pair> {
        Self::pair_with(
            SessionConfig::new(Role::Client),
            SessionConfig::new(Role::Server),
        )
        .await
    }
    /// Shortens keepalive and idle timeout where the transport detects a dead peer only by silence.
    fn quick_liveness(config: &mut SessionConfig);
}

/// The WebSocket transport over in-memory pipes (virtual time works: tests may pause the clock).
pub(crate) struct Ws;

impl Harness for Ws {
    const RTT_FROM_HANDSHAKE: bool = false;
    const QUIET: Duration = Duration::from_secs(600);

    async fn pair_with(client: SessionConfig, server: SessionConfig) -> anyhow::Result<Pair> {
        pair_with(
            client,
            ServerOptions {
                config: server,
                require_auth: None,
            },
        )
        .await
    }

    fn quick_liveness(_config: &mut SessionConfig) {}
}
