//! The QUIC transport: one QUIC connection per tunnel, one bidirectional QUIC stream per logical stream.
//!
//! Nothing of `tether_proto::Session` runs here: QUIC already multiplexes, flow-controls and keeps the
//! connection alive. What Tether adds is small and specified in docs/PROTOCOL.md ("QUIC transport"):
//!
//! - a **stream header** at the head of each bidirectional stream (version, kind, priority, deadline,
//!   metadata), answered by an ACCEPT or REFUSE at the head of the reverse direction;
//! - one unidirectional **session stream** per side, carrying the agent's HELLO (the request-like metadata
//!   the relay needs before it authenticates: cluster name, agent version), the relay's WELCOME, and GOAWAY.
//!
//! The server side is split so that the relay authenticates before any stream is accepted:
//! [`Listener::accept`] → [`Handshake::finish`] (TLS with client certificates, the HELLO) → the relay checks
//! [`PendingTunnel::peer_certificates`] and [`PendingTunnel::headers`] → [`PendingTunnel::accept`] (only now
//! may the agent open streams: the server's initial stream limit is 0) or [`PendingTunnel::refuse`].
//!
//! Application error codes on the wire (RESET_STREAM, STOP_SENDING, CONNECTION_CLOSE) are the Tether codes
//! of [`crate::code`].

use std::collections::VecDeque;
use std::future::Future;
use std::io;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::task::{Context, Poll, Waker};
use std::time::{Duration, Instant};

use bytes::{Buf, BufMut, Bytes, BytesMut};
use http::{HeaderMap, HeaderName, HeaderValue};
use quinn::crypto::rustls::{QuicClientConfig, QuicServerConfig};
use quinn::{
    IdleTimeout, MtuDiscoveryConfig, ReadError, RecvStream, SendStream, VarInt, WriteError,
};
use rustls::pki_types::CertificateDer;
use tokio::io::ReadBuf;
use tokio::sync::Notify;
use tokio::task::AbortHandle;

use crate::conn::{CloseInfo, OpenOptions, TunnelError};
use crate::{ConnectionError, Priority, Role, SessionConfig, Stats, code};
use tether_proto::StreamId;

mod socket;

/// The ALPN protocol both sides require: Tether's tunnel protocol, version 1, over QUIC.
pub const ALPN: &[u8] = b"tether/1";

/// The version byte that starts every stream header, answer and session stream.
pub const VERSION: u8 = 1;

/// Initial (and minimum) UDP payload size: fits a 1,280-byte IPv6 path with room for tunnels around it.
pub const INITIAL_MTU: u16 = 1200;

/// Largest HELLO payload accepted.
pub const MAX_HELLO: usize = 8 * 1024;

/// Longest REFUSE or GOAWAY reason, in bytes.
pub const MAX_REASON: usize = 1024;

/// QUIC send priority of control streams (quinn: higher goes first); normal streams have 0.
const PRIORITY_CONTROL: i32 = 100;

/// How long a stream that we finished keeps the connection from closing gracefully while the peer
/// acknowledges its last bytes.
const CLOSE_LINGER: Duration = Duration::from_secs(5);

const MSG_HELLO: u8 = 1;
const MSG_WELCOME: u8 = 2;
const MSG_GOAWAY: u8 = 3;

const ANSWER_ACCEPT: u8 = 0;
const ANSWER_REFUSE: u8 = 1;

/// Fixed part of a stream header: version, kind, priority, deadline, metadata length.
const HEADER_LEN: usize = 1 + 2 + 1 + 4 + 4;

fn varint(code: u32) -> VarInt {
    VarInt::from_u32(code)
}

fn code_of(v: VarInt) -> u32 {
    u32::try_from(v.into_inner()).unwrap_or(code::PROTOCOL_ERROR)
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

/// Why a QUIC tunnel could not be established (client side) or accepted (server side).
#[derive(Debug, thiserror::Error)]
pub enum QuicError {
    /// The relay URL is not usable.
    #[error("invalid relay URL: {0}")]
    InvalidUrl(String),
    /// DNS resolution failed or gave no address.
    #[error("cannot resolve {addr}: {source}")]
    Resolve {
        /// host:port looked up.
        addr: String,
        /// The cause.
        #[source]
        source: io::Error,
    },
    /// The UDP socket could not be bound.
    #[error("cannot bind a UDP socket: {0}")]
    Bind(#[source] io::Error),
    /// The TLS configuration cannot be used for QUIC (it must allow TLS 1.3).
    #[error("TLS configuration unusable for QUIC: {0}")]
    Tls(String),
    /// The transport settings are out of range.
    #[error("invalid QUIC settings: {0}")]
    Config(String),
    /// The QUIC or TLS handshake failed, or the connection was lost during the tunnel handshake.
    #[error("QUIC handshake failed: {0}")]
    Handshake(String),
    /// The relay refused the tunnel after the handshake (e.g. the identity does not name the cluster).
    #[error("relay refused the tunnel (code {code}): {reason}")]
    Rejected {
        /// See [`crate::code`].
        code: u32,
        /// The relay's reason.
        reason: String,
    },
    /// The peer broke the tunnel handshake (malformed HELLO or WELCOME).
    #[error("tunnel handshake violated: {0}")]
    Protocol(String),
    /// The handshake did not finish within the session's handshake timeout.
    #[error("timed out during the QUIC tunnel handshake")]
    TimedOut,
}

/// The QUIC transport settings derived from the session settings, so both transports share one set of knobs:
/// stream window = `max_stream_window` (quinn does not auto-tune, so a stream gets the ceiling the WebSocket
/// transport grows to), no connection receive window of its own (quinn returns connection credit only as the
/// application reads, so streams nobody reads would use it up and freeze every other stream; what all streams
/// together hold unread is bounded by streams × stream window instead, as for WebSocket tunnels), send window =
/// `connection_window`, at most
/// `max_concurrent_streams` streams from the peer, keepalive and idle timeout as configured, initial MTU 1,200
/// with path MTU discovery, no datagrams. `accept_streams` false sets the peer's stream limit to 0 (raised
/// once the relay has authenticated the tunnel).
pub fn transport_config(
    config: &SessionConfig,
    accept_streams: bool,
) -> Result<quinn::TransportConfig, QuicError> {
    let mut t = quinn::TransportConfig::default();
    let streams = if accept_streams {
        config.max_concurrent_streams
    } else {
        0
    };
    t.max_concurrent_bidi_streams(varint(streams))
        .max_concurrent_uni_streams(varint(1))
        .stream_receive_window(varint(config.max_stream_window.max(1)))
        .receive_window(VarInt::MAX)
        .send_window(u64::from(config.connection_window.max(1)))
        .keep_alive_interval(Some(config.keepalive_interval))
        .max_idle_timeout(Some(
            IdleTimeout::try_from(config.idle_timeout)
                .map_err(|e| QuicError::Config(format!("idle timeout: {e}")))?,
        ))
        .initial_mtu(INITIAL_MTU)
        .min_mtu(INITIAL_MTU)
        .mtu_discovery_config(Some(MtuDiscoveryConfig::default()))
        .datagram_receive_buffer_size(None);
    Ok(t)
}

// ---------------------------------------------------------------------------------------------------------
// Client

/// Dials `url` (`quic://`, `https://` or `wss://host[:port]`, the path is ignored; port 443 by default) over
/// QUIC with `tls` (its ALPN list is replaced by [`ALPN`]; the client certificate in it is the agent's
/// identity), sends `headers` in the HELLO (e.g. `Tether-Cluster`, `Tether-Agent-Version`), and starts a client
/// [`crate::Connection`] once the relay sent WELCOME. Must be called within a Tokio runtime.
pub async fn connect(
    url: &str,
    tls: Arc<rustls::ClientConfig>,
    headers: HeaderMap,
    config: SessionConfig,
) -> Result<crate::Connection, QuicError> {
    let (host, port) = parse_url(url)?;
    let addr = tokio::net::lookup_host((host.as_str(), port))
        .await
        .map_err(|source| QuicError::Resolve {
            addr: format!("{host}:{port}"),
            source,
        })?
        .next()
        .ok_or_else(|| QuicError::Resolve {
            addr: format!("{host}:{port}"),
            source: io::Error::new(io::ErrorKind::NotFound, "no address"),
        })?;
    connect_addr(addr, &host, tls, headers, config).await
}

/// [`connect`] to a known address, with `server_name` for SNI and certificate checks.
pub async fn connect_addr(
    addr: SocketAddr,
    server_name: &str,
    tls: Arc<rustls::ClientConfig>,
    headers: HeaderMap,
    mut config: SessionConfig,
) -> Result<crate::Connection, QuicError> {
    config.role = Role::Client;
    let hello = encode_hello(&headers)?;
    let mut tls = (*tls).clone();
    tls.alpn_protocols = vec![ALPN.to_vec()];
    tls.enable_early_data = false;
    let crypto =
        QuicClientConfig::try_from(Arc::new(tls)).map_err(|e| QuicError::Tls(e.to_string()))?;
    let mut client = quinn::ClientConfig::new(Arc::new(crypto));
    client.transport_config(Arc::new(transport_config(&config, true)?));
    let bind: SocketAddr = if addr.is_ipv4() {
        (std::net::Ipv4Addr::UNSPECIFIED, 0).into()
    } else {
        (std::net::Ipv6Addr::UNSPECIFIED, 0).into()
    };
    let endpoint = endpoint(bind, None)?;
    let handshake = async {
        let connecting = endpoint
            .connect_with(client, addr, server_name)
            .map_err(|e| QuicError::Handshake(e.to_string()))?;
        let conn = connecting.await.map_err(handshake_error)?;
        let mut session = conn.open_uni().await.map_err(handshake_error)?;
        let mut first = BytesMut::new();
        first.put_u8(VERSION);
        put_message(&mut first, MSG_HELLO, &hello);
        session
            .write_all(&first)
            .await
            .map_err(|e| write_handshake_error(&conn, e))?;
        let mut peer = conn.accept_uni().await.map_err(handshake_error)?;
        let (kind, payload) =
            read_first_message(&mut peer, MAX_HELLO)
                .await
                .map_err(|e| match conn.close_reason() {
                    Some(reason) => handshake_error(reason),
                    None => e,
                })?;
        if kind != MSG_WELCOME {
            conn.close(varint(code::PROTOCOL_ERROR), b"expected WELCOME");
            return Err(QuicError::Protocol(format!(
                "expected WELCOME, got message type {kind}"
            )));
        }
        drop(payload);
        Ok::<_, QuicError>((conn, session, peer))
    };
    let (conn, session, peer) = tokio::time::timeout(config.handshake_timeout, handshake)
        .await
        .map_err(|_| QuicError::TimedOut)??;
    Ok(crate::Connection::from_quic(QuicConnection::start(
        conn, config, session, peer,
    )))
}

/// Only the QUIC and TLS handshakes with `addr` (`server_name` for SNI and the certificate check; the client
/// certificate in `tls`, if any, is presented), then closes the connection with [`code::NO_ERROR`]: no HELLO
/// is sent, so the relay opens no tunnel. Returns the round-trip time quinn measured. For `tether-agent doctor`
/// (is UDP to the relay open, and does its certificate verify over QUIC?). Gives up after `timeout`.
pub async fn probe(
    addr: SocketAddr,
    server_name: &str,
    tls: Arc<rustls::ClientConfig>,
    timeout: Duration,
) -> Result<Duration, QuicError> {
    let mut tls = (*tls).clone();
    tls.alpn_protocols = vec![ALPN.to_vec()];
    tls.enable_early_data = false;
    let crypto =
        QuicClientConfig::try_from(Arc::new(tls)).map_err(|e| QuicError::Tls(e.to_string()))?;
    let mut client = quinn::ClientConfig::new(Arc::new(crypto));
    client.transport_config(Arc::new(transport_config(
        &SessionConfig::new(Role::Client),
        true,
    )?));
    let bind: SocketAddr = if addr.is_ipv4() {
        (std::net::Ipv4Addr::UNSPECIFIED, 0).into()
    } else {
        (std::net::Ipv6Addr::UNSPECIFIED, 0).into()
    };
    let endpoint = endpoint(bind, None)?;
    let connecting = endpoint
        .connect_with(client, addr, server_name)
        .map_err(|e| QuicError::Handshake(e.to_string()))?;
    let result = match tokio::time::timeout(timeout, connecting).await {
        Err(_) => Err(QuicError::TimedOut),
        Ok(Err(e)) => Err(handshake_error(e)),
        Ok(Ok(conn)) => {
            let rtt = conn.rtt();
            conn.close(varint(code::NO_ERROR), b"probe done");
            Ok(rtt)
        }
    };
    endpoint.close(varint(code::NO_ERROR), b"probe done");
    // Lets the CONNECTION_CLOSE go out; bounded, as the peer may be gone.
    let _ = tokio::time::timeout(Duration::from_secs(1), endpoint.wait_idle()).await;
    result
}

/// A quinn endpoint on a UDP socket bound to `addr`, receiving through [`socket::OneByOne`].
fn endpoint(
    addr: SocketAddr,
    server: Option<quinn::ServerConfig>,
) -> Result<quinn::Endpoint, QuicError> {
    let socket = std::net::UdpSocket::bind(addr).map_err(QuicError::Bind)?;
    let runtime = Arc::new(quinn::TokioRuntime);
    let socket = quinn::Runtime::wrap_udp_socket(&*runtime, socket).map_err(QuicError::Bind)?;
    let config = quinn::EndpointConfig::default();
    let socket = Arc::new(socket::OneByOne::new(socket, &config));
    quinn::Endpoint::new_with_abstract_socket(config, server, socket, runtime)
        .map_err(QuicError::Bind)
}

fn parse_url(url: &str) -> Result<(String, u16), QuicError> {
    let invalid = |why: &str| QuicError::InvalidUrl(format!("{url}: {why}"));
    let parsed = url::Url::parse(url).map_err(|e| invalid(&e.to_string()))?;
    match parsed.scheme() {
        "quic" | "https" | "wss" => {}
        other => return Err(invalid(&format!("unsupported scheme {other:?}"))),
    }
    let host = match parsed.host() {
        Some(url::Host::Domain(d)) => d.to_owned(),
        Some(url::Host::Ipv4(ip)) => ip.to_string(),
        Some(url::Host::Ipv6(ip)) => ip.to_string(),
        None => return Err(invalid("missing host")),
    };
    Ok((host, parsed.port().unwrap_or(443)))
}

fn handshake_error(e: quinn::ConnectionError) -> QuicError {
    match e {
        quinn::ConnectionError::ApplicationClosed(close) => QuicError::Rejected {
            code: code_of(close.error_code),
            reason: String::from_utf8_lossy(&close.reason).into_owned(),
        },
        quinn::ConnectionError::TimedOut => QuicError::TimedOut,
        other => QuicError::Handshake(other.to_string()),
    }
}

fn write_handshake_error(conn: &quinn::Connection, e: WriteError) -> QuicError {
    match conn.close_reason() {
        Some(reason) => handshake_error(reason),
        None => QuicError::Handshake(e.to_string()),
    }
}

// ---------------------------------------------------------------------------------------------------------
// Server

/// A UDP endpoint accepting QUIC tunnels.
#[derive(Debug)]
pub struct Listener {
    endpoint: quinn::Endpoint,
    config: SessionConfig,
}

impl Listener {
    /// Binds `addr` with `tls` (its ALPN list is replaced by [`ALPN`]). `tls` decides which client
    /// certificates pass the handshake (for agents: a verifier for the agent CA); the relay checks the
    /// identity itself afterwards, on [`PendingTunnel::peer_certificates`]. Must be called within a Tokio
    /// runtime.
    pub fn bind(
        addr: SocketAddr,
        tls: Arc<rustls::ServerConfig>,
        mut config: SessionConfig,
    ) -> Result<Self, QuicError> {
        config.role = Role::Server;
        let mut tls = (*tls).clone();
        tls.alpn_protocols = vec![ALPN.to_vec()];
        tls.max_early_data_size = 0;
        let crypto =
            QuicServerConfig::try_from(Arc::new(tls)).map_err(|e| QuicError::Tls(e.to_string()))?;
        let mut server = quinn::ServerConfig::with_crypto(Arc::new(crypto));
        server.transport_config(Arc::new(transport_config(&config, false)?));
        let endpoint = endpoint(addr, Some(server))?;
        Ok(Self { endpoint, config })
    }

    /// The bound address.
    pub fn local_addr(&self) -> io::Result<SocketAddr> {
        self.endpoint.local_addr()
    }

    /// The next connection attempt, or `None` once the listener is closed. Run [`Handshake::finish`] in its
    /// own task so that a slow client holds up nobody.
    pub async fn accept(&self) -> Option<Handshake> {
        let incoming = self.endpoint.accept().await?;
        Some(Handshake {
            incoming,
            config: self.config.clone(),
        })
    }

    /// Stops accepting: new attempts are refused, connections already accepted go on (for a graceful
    /// shutdown; [`Listener::close`] ends them).
    pub fn stop_accepting(&self) {
        self.endpoint.set_server_config(None);
    }

    /// Stops accepting and closes every connection of this endpoint with `code` and `reason`.
    pub fn close(&self, code: u32, reason: &str) {
        self.endpoint.close(varint(code), reason.as_bytes());
    }
}

/// A connection attempt on a [`Listener`].
#[derive(Debug)]
pub struct Handshake {
    incoming: quinn::Incoming,
    config: SessionConfig,
}

impl Handshake {
    /// The client's address.
    pub fn remote_address(&self) -> SocketAddr {
        self.incoming.remote_address()
    }

    /// Refuses the attempt before any handshake state is kept (the client sees CONNECTION_REFUSED): for a
    /// server that is over its bound of handshakes in progress, or shutting down.
    pub fn refuse(self) {
        self.incoming.refuse();
    }

    /// Runs the QUIC/TLS handshake and reads the client's HELLO, within the handshake timeout. No stream can
    /// be opened by the client yet.
    pub async fn finish(self) -> Result<PendingTunnel, QuicError> {
        let config = self.config;
        let work = async {
            let conn = self.incoming.await.map_err(handshake_error)?;
            let mut session = conn.accept_uni().await.map_err(handshake_error)?;
            let (kind, payload) = match read_first_message(&mut session, MAX_HELLO).await {
                Ok(m) => m,
                Err(e) => {
                    conn.close(varint(code::PROTOCOL_ERROR), b"malformed HELLO");
                    return Err(e);
                }
            };
            if kind != MSG_HELLO {
                conn.close(varint(code::PROTOCOL_ERROR), b"expected HELLO");
                return Err(QuicError::Protocol(format!(
                    "expected HELLO, got message type {kind}"
                )));
            }
            let headers = match decode_hello(payload) {
                Ok(h) => h,
                Err(e) => {
                    conn.close(varint(code::PROTOCOL_ERROR), b"malformed HELLO");
                    return Err(e);
                }
            };
            Ok::<_, QuicError>((conn, session, headers))
        };
        let (conn, session, headers) = tokio::time::timeout(config.handshake_timeout, work)
            .await
            .map_err(|_| QuicError::TimedOut)??;
        let peer_certificates = conn
            .peer_identity()
            .and_then(|any| any.downcast::<Vec<CertificateDer<'static>>>().ok())
            .map(|certs| *certs)
            .unwrap_or_default();
        Ok(PendingTunnel {
            remote: conn.remote_address(),
            inner: Some(PendingInner {
                conn,
                session,
                config,
            }),
            headers,
            peer_certificates,
        })
    }
}

/// A QUIC tunnel whose handshake is done and that the relay has not accepted yet: the client cannot open
/// streams. Dropping it refuses the tunnel (code REFUSED).
#[derive(Debug)]
pub struct PendingTunnel {
    /// `None` once answered.
    inner: Option<PendingInner>,
    headers: HeaderMap,
    peer_certificates: Vec<CertificateDer<'static>>,
    remote: SocketAddr,
}

#[derive(Debug)]
struct PendingInner {
    conn: quinn::Connection,
    session: RecvStream,
    config: SessionConfig,
}

impl PendingTunnel {
    /// The client's certificate chain, leaf first (empty if it sent none).
    pub fn peer_certificates(&self) -> &[CertificateDer<'static>] {
        &self.peer_certificates
    }

    /// The HELLO's headers (the same names the WebSocket upgrade request carries, e.g. `Tether-Cluster`).
    pub fn headers(&self) -> &HeaderMap {
        &self.headers
    }

    /// The client's address.
    pub fn remote_address(&self) -> SocketAddr {
        self.remote
    }

    /// Accepts the tunnel: sends WELCOME, lets the client open up to `max_concurrent_streams` streams, and
    /// starts a server [`crate::Connection`].
    pub async fn accept(mut self) -> Result<crate::Connection, QuicError> {
        let Some(inner) = self.inner.take() else {
            return Err(QuicError::Handshake("tunnel already answered".to_owned()));
        };
        let conn = inner.conn;
        let mut session = conn.open_uni().await.map_err(handshake_error)?;
        let mut first = BytesMut::new();
        first.put_u8(VERSION);
        put_message(&mut first, MSG_WELCOME, &[]);
        // Credit first, so that it reaches the client no later than WELCOME on a path without loss.
        conn.set_max_concurrent_bi_streams(varint(inner.config.max_concurrent_streams));
        session
            .write_all(&first)
            .await
            .map_err(|e| write_handshake_error(&conn, e))?;
        let quic = QuicConnection::start(conn, inner.config, session, inner.session);
        Ok(crate::Connection::from_quic(quic))
    }

    /// Refuses the tunnel: the client's connect fails with [`QuicError::Rejected`] carrying `code` and
    /// `reason` (at most [`MAX_REASON`] bytes are sent).
    pub fn refuse(mut self, code: u32, reason: &str) {
        if let Some(inner) = self.inner.take() {
            inner
                .conn
                .close(varint(code), truncate(reason, MAX_REASON).as_bytes());
        }
    }
}

impl Drop for PendingTunnel {
    fn drop(&mut self) {
        if let Some(inner) = self.inner.take() {
            inner
                .conn
                .close(varint(code::REFUSED), b"tunnel not accepted");
        }
    }
}

// ---------------------------------------------------------------------------------------------------------
// Wire encoding (docs/PROTOCOL.md, "QUIC transport")

fn truncate(s: &str, max: usize) -> &str {
    if s.len() <= max {
        return s;
    }
    let mut end = max;
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    &s[..end]
}

fn len_u32(n: usize) -> u32 {
    u32::try_from(n).unwrap_or(u32::MAX)
}

fn put_message(buf: &mut BytesMut, kind: u8, payload: &[u8]) {
    buf.put_u8(kind);
    buf.put_u32(len_u32(payload.len()));
    buf.put_slice(payload);
}

/// Most headers a HELLO may carry.
const MAX_HELLO_HEADERS: usize = 64;

fn encode_hello(headers: &HeaderMap) -> Result<Vec<u8>, QuicError> {
    let mut out = Vec::new();
    let count = u8::try_from(headers.len())
        .ok()
        .filter(|n| usize::from(*n) <= MAX_HELLO_HEADERS)
        .ok_or_else(|| QuicError::Config(format!("at most {MAX_HELLO_HEADERS} HELLO headers")))?;
    out.push(count);
    for (name, value) in headers {
        let name = name.as_str().as_bytes();
        let value = value.as_bytes();
        let (Ok(name_len), Ok(value_len)) = (u8::try_from(name.len()), u16::try_from(value.len()))
        else {
            return Err(QuicError::Config("HELLO header too long".to_owned()));
        };
        out.push(name_len);
        out.extend_from_slice(name);
        out.extend_from_slice(&value_len.to_be_bytes());
        out.extend_from_slice(value);
    }
    if out.len() > MAX_HELLO {
        return Err(QuicError::Config(format!(
            "HELLO headers larger than {MAX_HELLO} bytes"
        )));
    }
    Ok(out)
}

fn decode_hello(mut payload: Bytes) -> Result<HeaderMap, QuicError> {
    let bad = |why: &str| QuicError::Protocol(format!("malformed HELLO: {why}"));
    if payload.remaining() < 1 {
        return Err(bad("empty"));
    }
    let count = usize::from(payload.get_u8());
    if count > MAX_HELLO_HEADERS {
        return Err(bad("too many headers"));
    }
    let mut headers = HeaderMap::new();
    for _ in 0..count {
        if payload.remaining() < 1 {
            return Err(bad("truncated"));
        }
        let name_len = usize::from(payload.get_u8());
        if payload.remaining() < name_len + 2 {
            return Err(bad("truncated"));
        }
        let name = payload.split_to(name_len);
        let value_len = usize::from(payload.get_u16());
        if payload.remaining() < value_len {
            return Err(bad("truncated"));
        }
        let value = payload.split_to(value_len);
        let name = HeaderName::from_bytes(&name).map_err(|_| bad("invalid header name"))?;
        let value =
            HeaderValue::from_maybe_shared(value).map_err(|_| bad("invalid header value"))?;
        headers.append(name, value);
    }
    if payload.has_remaining() {
        return Err(bad("trailing bytes"));
    }
    Ok(headers)
}

/// Reads the session stream's version byte and its first message.
async fn read_first_message(
    recv: &mut RecvStream,
    max_payload: usize,
) -> Result<(u8, Bytes), QuicError> {
    let mut version = [0u8; 1];
    recv.read_exact(&mut version)
        .await
        .map_err(|e| QuicError::Protocol(format!("session stream: {e}")))?;
    if version[0] != VERSION {
        return Err(QuicError::Protocol(format!(
            "unsupported version {} (this side speaks {VERSION})",
            version[0]
        )));
    }
    read_message(recv, max_payload)
        .await?
        .ok_or_else(|| QuicError::Protocol("session stream ended early".to_owned()))
}

/// Reads one session-stream message; `None` when the stream finished cleanly between messages.
async fn read_message(
    recv: &mut RecvStream,
    max_payload: usize,
) -> Result<Option<(u8, Bytes)>, QuicError> {
    let mut head = [0u8; 5];
    match recv.read_exact(&mut head).await {
        Ok(()) => {}
        Err(quinn::ReadExactError::FinishedEarly(0)) => return Ok(None),
        Err(e) => return Err(QuicError::Protocol(format!("session stream: {e}"))),
    }
    let kind = head[0];
    let len = u32::from_be_bytes([head[1], head[2], head[3], head[4]]) as usize;
    if len > max_payload {
        return Err(QuicError::Protocol(format!(
            "session message of {len} bytes (at most {max_payload})"
        )));
    }
    let mut payload = vec![0u8; len];
    recv.read_exact(&mut payload)
        .await
        .map_err(|e| QuicError::Protocol(format!("session stream: {e}")))?;
    Ok(Some((kind, Bytes::from(payload))))
}

fn encode_goaway(code: u32, reason: &str) -> Vec<u8> {
    let reason = truncate(reason, MAX_REASON);
    let mut payload = BytesMut::with_capacity(4 + reason.len());
    payload.put_u32(code);
    payload.put_slice(reason.as_bytes());
    let mut out = BytesMut::new();
    put_message(&mut out, MSG_GOAWAY, &payload);
    out.to_vec()
}

/// What the opener puts at the head of a stream.
#[derive(Debug)]
struct Header {
    kind: u16,
    priority: Priority,
    deadline: Option<Duration>,
    metadata: Bytes,
}

fn encode_open(options: &OpenOptions) -> Bytes {
    let mut out = BytesMut::with_capacity(HEADER_LEN + options.metadata.len());
    out.put_u8(VERSION);
    out.put_u16(options.kind);
    out.put_u8(match options.priority {
        Priority::Control => 0,
        Priority::Normal => 1,
    });
    let ms = options.deadline.map_or(0, |d| {
        u32::try_from(d.as_millis()).unwrap_or(u32::MAX).max(1)
    });
    out.put_u32(ms);
    out.put_u32(len_u32(options.metadata.len()));
    out.put_slice(&options.metadata);
    out.freeze()
}

/// Why a peer's stream header was not taken.
enum HeaderError {
    /// Not a header this side accepts: reset with PROTOCOL_ERROR.
    Malformed(String),
    /// The stream or the connection failed while reading.
    Stream,
}

async fn read_header(recv: &mut RecvStream, max_metadata: usize) -> Result<Header, HeaderError> {
    let mut fixed = [0u8; HEADER_LEN];
    recv.read_exact(&mut fixed).await.map_err(|e| match e {
        quinn::ReadExactError::FinishedEarly(_) => {
            HeaderError::Malformed("stream ended inside its header".to_owned())
        }
        quinn::ReadExactError::ReadError(_) => HeaderError::Stream,
    })?;
    let mut b = &fixed[..];
    let version = b.get_u8();
    if version != VERSION {
        return Err(HeaderError::Malformed(format!(
            "stream header version {version}"
        )));
    }
    let kind = b.get_u16();
    let priority = match b.get_u8() {
        0 => Priority::Control,
        1 => Priority::Normal,
        other => return Err(HeaderError::Malformed(format!("priority {other}"))),
    };
    let deadline = match b.get_u32() {
        0 => None,
        ms => Some(Duration::from_millis(u64::from(ms))),
    };
    let len = b.get_u32() as usize;
    if len > max_metadata {
        return Err(HeaderError::Malformed(format!(
            "stream metadata of {len} bytes (at most {max_metadata})"
        )));
    }
    let mut metadata = vec![0u8; len];
    recv.read_exact(&mut metadata).await.map_err(|e| match e {
        quinn::ReadExactError::FinishedEarly(_) => {
            HeaderError::Malformed("stream ended inside its header".to_owned())
        }
        quinn::ReadExactError::ReadError(_) => HeaderError::Stream,
    })?;
    Ok(Header {
        kind,
        priority,
        deadline,
        metadata: Bytes::from(metadata),
    })
}

fn encode_accept(metadata: &Bytes) -> Bytes {
    let mut out = BytesMut::with_capacity(6 + metadata.len());
    out.put_u8(VERSION);
    out.put_u8(ANSWER_ACCEPT);
    out.put_u32(len_u32(metadata.len()));
    out.put_slice(metadata);
    out.freeze()
}

fn encode_refuse(code: u32, reason: &str) -> Bytes {
    let reason = truncate(reason, MAX_REASON);
    let mut out = BytesMut::with_capacity(8 + reason.len());
    out.put_u8(VERSION);
    out.put_u8(ANSWER_REFUSE);
    out.put_u32(code);
    out.put_u16(u16::try_from(reason.len()).unwrap_or(0));
    out.put_slice(reason.as_bytes());
    out.freeze()
}

fn stream_id(id: quinn::StreamId) -> StreamId {
    let n = id.index() * 2
        + match id.initiator() {
            quinn::Side::Client => 1,
            quinn::Side::Server => 2,
        };
    StreamId(u32::try_from(n).unwrap_or(u32::MAX))
}

fn now() -> Instant {
    tokio::time::Instant::now().into_std()
}

fn spawn<F: Future<Output = ()> + Send + 'static>(f: F) -> Option<AbortHandle> {
    tokio::runtime::Handle::try_current()
        .ok()
        .map(|rt| rt.spawn(f).abort_handle())
}

/// Runs `work` here as far as it goes without waiting and spawns a task only for what is left. What a stream
/// waits for at its start (the peer's header) has usually arrived already, and a task per stream was a spawn
/// and a wake-up per request. A timeout inside `work` arms no timer when what it waits for is ready. Call it
/// from a task, never from a drop: a timer polled while the runtime shuts down panics.
fn run_or_spawn<F: Future<Output = ()> + Send + 'static>(work: F) {
    let mut work = Box::pin(work);
    if work
        .as_mut()
        .poll(&mut Context::from_waker(Waker::noop()))
        .is_pending()
    {
        // The task's first poll registers its own waker in place of the no-op one.
        tokio::spawn(work);
    }
}

// ---------------------------------------------------------------------------------------------------------
// Connection

/// A stream the peer opened whose header arrived, not yet taken by `accept`.
struct Queued {
    send: SendStream,
    recv: RecvStream,
    header: Header,
    received: Instant,
}

struct State {
    incoming: VecDeque<Queued>,
    /// We stopped taking new streams.
    going_away: bool,
    /// The peer sent GOAWAY.
    peer_going_away: bool,
    /// Streams with a live handle, or finished and waiting for the peer's acknowledgement.
    open: usize,
    /// What we closed the connection with.
    local_close: Option<(u32, String)>,
    /// Set once quinn reported the connection closed.
    closed: Option<CloseInfo>,
    /// Our session stream, taken to send GOAWAY.
    session: Option<SendStream>,
}

struct Shared {
    conn: quinn::Connection,
    config: SessionConfig,
    state: Mutex<State>,
    /// Wakes `accept()` waiters (a stream arrived, the connection is going away or closed).
    notify: Notify,
    /// Wakes `closed()` waiters, once the connection has closed: every stream's task may wait there, so it is
    /// not woken at each new stream (see the WebSocket transport's `Shared`).
    closed_notify: Notify,
    /// Answers waiting to leave with their stream's first bytes, by due time.
    deferred: Mutex<DeferredAnswers>,
    /// Wakes the task that writes deferred answers when one is due sooner than it waits for.
    deferred_notify: Notify,
}

/// How often, at most, the task writing deferred answers wakes: answers due within one tick of each other go
/// together, so that a busy connection's answers cost that task a wake-up per tick rather than one each.
const DEFERRED_TICK: Duration = Duration::from_millis(5);

/// Answers held back by [`QuicIncoming::accept`] with a hold. Each leaves with its stream's first write (the
/// same quinn packet as the reply's first bytes, as the WebSocket session's deferred ACCEPT leaves in the same
/// batch), or when due from one task per connection (started with the first deferred answer), so that a stream
/// costs no timer or task of its own. The heap holds the answers of the last hold's worth of streams at most.
#[derive(Default)]
struct DeferredAnswers {
    heap: std::collections::BinaryHeap<DeferredAnswer>,
    task_started: bool,
}

/// Ordered by due time alone: answers due at the same instant go in any order (they are other streams').
struct DeferredAnswer {
    due: tokio::time::Instant,
    stream: std::sync::Weak<StreamShared>,
}

impl PartialEq for DeferredAnswer {
    fn eq(&self, other: &Self) -> bool {
        self.due == other.due
    }
}

impl Eq for DeferredAnswer {}

impl PartialOrd for DeferredAnswer {
    fn partial_cmp(&self, other: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(other))
    }
}

impl Ord for DeferredAnswer {
    /// Reversed: the heap's top is the answer due first.
    fn cmp(&self, other: &Self) -> std::cmp::Ordering {
        other.due.cmp(&self.due)
    }
}

/// Writes deferred answers as they fall due (an answer whose stream wrote first finds its head written, and a
/// stream that is gone is skipped), until the connection closes.
async fn write_deferred(shared: Arc<Shared>) {
    let closed = shared.conn.closed();
    tokio::pin!(closed);
    let mut due = Vec::new();
    loop {
        let notified = shared.deferred_notify.notified();
        tokio::pin!(notified);
        notified.as_mut().enable();
        let now = tokio::time::Instant::now();
        let next = {
            let mut q = lock(&shared.deferred);
            while q.heap.peek().is_some_and(|next| next.due <= now) {
                if let Some(answer) = q.heap.pop() {
                    due.push(answer.stream);
                }
            }
            q.heap.peek().map(|next| next.due.max(now + DEFERRED_TICK))
        };
        for stream in due.drain(..) {
            if let Some(ss) = stream.upgrade() {
                ss.write_head();
            }
        }
        tokio::select! {
            _ = &mut closed => return,
            () = &mut notified => {}
            () = tokio::time::sleep_until(next.unwrap_or(now)), if next.is_some() => {}
        }
    }
}

impl Shared {
    /// Holds `ss`'s answer back for up to `hold`: it leaves with the stream's first write, or then.
    fn defer(self: &Arc<Self>, ss: &Arc<StreamShared>, hold: Duration) {
        let due = tokio::time::Instant::now() + hold;
        let mut q = lock(&self.deferred);
        let sooner = q.heap.peek().is_none_or(|next| due < next.due);
        q.heap.push(DeferredAnswer {
            due,
            stream: Arc::downgrade(ss),
        });
        let start = !std::mem::replace(&mut q.task_started, true);
        drop(q);
        if start {
            if spawn(write_deferred(self.clone())).is_none() {
                // No runtime to time it: the answer goes now.
                lock(&self.deferred).task_started = false;
                ss.write_head();
            }
        } else if sooner {
            self.deferred_notify.notify_one();
        }
    }
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, State> {
        lock(&self.state)
    }

    fn close_reason(&self) -> String {
        if let Some(CloseInfo { error }) = &self.lock().closed {
            return match error {
                Some(e) => e.to_string(),
                None => "connection closed".to_owned(),
            };
        }
        match self.conn.close_reason() {
            Some(e) => e.to_string(),
            None => "connection closing".to_owned(),
        }
    }

    fn go_away(&self, code: u32, reason: &str) {
        let mut st = self.lock();
        if st.closed.is_some() || st.going_away {
            return;
        }
        st.going_away = true;
        let queued: Vec<Queued> = st.incoming.drain(..).collect();
        let session = st.session.take();
        drop(st);
        self.conn.set_max_concurrent_bi_streams(varint(0));
        for q in queued {
            refuse_parts(q.send, q.recv, code::SHUTDOWN, reason);
        }
        if let Some(mut session) = session {
            let message = encode_goaway(code, reason);
            spawn(async move {
                if session.write_all(&message).await.is_ok() {
                    let _ = session.finish();
                }
            });
        }
        self.notify.notify_waiters();
        self.maybe_close();
    }

    /// Closes gracefully once either side is going away and no stream is left.
    fn maybe_close(&self) {
        let mut st = self.lock();
        if st.closed.is_none()
            && st.local_close.is_none()
            && (st.going_away || st.peer_going_away)
            && st.open == 0
            && st.incoming.is_empty()
        {
            st.local_close = Some((code::NO_ERROR, "drained".to_owned()));
            drop(st);
            self.conn.close(varint(code::NO_ERROR), b"drained");
        }
    }

    fn close(&self, code: u32, reason: &str) {
        let mut st = self.lock();
        st.going_away = true;
        if st.local_close.is_none() && st.closed.is_none() {
            st.local_close = Some((code, reason.to_owned()));
        }
        drop(st);
        self.conn
            .close(varint(code), truncate(reason, MAX_REASON).as_bytes());
        self.notify.notify_waiters();
    }

    fn queue(&self, send: SendStream, recv: RecvStream, header: Header) {
        let mut st = self.lock();
        if st.going_away || st.closed.is_some() {
            drop(st);
            refuse_parts(send, recv, code::SHUTDOWN, "connection is going away");
            return;
        }
        st.incoming.push_back(Queued {
            send,
            recv,
            header,
            received: now(),
        });
        drop(st);
        self.notify.notify_waiters();
    }
}

/// Answers a peer's stream with REFUSE, then finishes it.
fn refuse_parts(mut send: SendStream, mut recv: RecvStream, code: u32, reason: &str) {
    let _ = recv.stop(varint(code));
    let Ok(runtime) = tokio::runtime::Handle::try_current() else {
        // No runtime to write the answer from: a reset with the code says as much.
        let _ = send.reset(varint(code));
        return;
    };
    let answer = encode_refuse(code, reason);
    runtime.spawn(async move {
        if tokio::time::timeout(CLOSE_LINGER, send.write_all(&answer))
            .await
            .is_ok_and(|r| r.is_ok())
        {
            let _ = send.finish();
        } else {
            let _ = send.reset(varint(code));
        }
    });
}

/// One per connection, shared by `Connection` clones and streams: when the last one goes, the connection
/// goes away (and closes once drained).
struct Handle {
    shared: Arc<Shared>,
}

impl Drop for Handle {
    fn drop(&mut self) {
        self.shared.go_away(code::NO_ERROR, "connection dropped");
    }
}

/// The QUIC side of [`crate::Connection`].
#[derive(Clone)]
pub(crate) struct QuicConnection {
    handle: Arc<Handle>,
}

impl QuicConnection {
    fn start(
        conn: quinn::Connection,
        config: SessionConfig,
        session_send: SendStream,
        session_recv: RecvStream,
    ) -> Self {
        let shared = Arc::new(Shared {
            conn,
            config,
            state: Mutex::new(State {
                incoming: VecDeque::new(),
                going_away: false,
                peer_going_away: false,
                open: 0,
                local_close: None,
                closed: None,
                session: Some(session_send),
            }),
            notify: Notify::new(),
            closed_notify: Notify::new(),
            deferred: Mutex::new(DeferredAnswers::default()),
            deferred_notify: Notify::new(),
        });
        tokio::spawn(accept_streams(shared.clone()));
        tokio::spawn(watch_session(shared.clone(), session_recv));
        tokio::spawn(watch_closed(shared.clone()));
        QuicConnection {
            handle: Arc::new(Handle { shared }),
        }
    }

    fn shared(&self) -> &Arc<Shared> {
        &self.handle.shared
    }

    pub(crate) fn open(&self, options: OpenOptions) -> Result<QuicStream, TunnelError> {
        let shared = self.shared();
        {
            let st = shared.lock();
            if st.closed.is_some() || st.going_away || st.peer_going_away {
                drop(st);
                return Err(TunnelError::Closed(shared.close_reason()));
            }
        }
        if options.metadata.len() > shared.config.max_metadata {
            return Err(TunnelError::Refused {
                code: code::REFUSED,
                reason: "stream metadata larger than the session allows".to_owned(),
            });
        }
        // Opening must not wait: a stream limit reached is reported at once, as with the session.
        let opened = {
            let mut open = std::pin::pin!(shared.conn.open_bi());
            open.as_mut().poll(&mut Context::from_waker(Waker::noop()))
        };
        let (send, recv) = match opened {
            Poll::Ready(Ok(parts)) => parts,
            Poll::Ready(Err(e)) => return Err(TunnelError::Closed(e.to_string())),
            Poll::Pending => return Err(TunnelError::TooManyStreams),
        };
        if options.priority == Priority::Control {
            let _ = send.set_priority(PRIORITY_CONTROL);
        }
        let head = encode_open(&options);
        let ss = StreamShared::new(self.handle.clone(), send, recv, head, Answer::Pending);
        let task = spawn(drive_open(ss.clone(), options.deadline));
        lock(&ss.inner).task = task;
        Ok(QuicStream {
            ss,
            finished: false,
            eof: false,
        })
    }

    pub(crate) async fn accept(&self) -> Option<QuicIncoming> {
        let shared = self.shared();
        loop {
            let notified = shared.notify.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            {
                let mut st = shared.lock();
                if let Some(q) = st.incoming.pop_front() {
                    drop(st);
                    let id = stream_id(q.send.id());
                    return Some(QuicIncoming {
                        kind: q.header.kind,
                        priority: q.header.priority,
                        deadline: q.header.deadline.map(|d| q.received + d),
                        metadata: q.header.metadata,
                        id,
                        parts: Some((q.send, q.recv)),
                        handle: self.handle.clone(),
                    });
                }
                if st.going_away
                    || st.peer_going_away
                    || st.closed.is_some()
                    || shared.conn.close_reason().is_some()
                {
                    return None;
                }
            }
            notified.await;
        }
    }

    pub(crate) fn go_away(&self, code: u32, reason: &str) {
        self.shared().go_away(code, reason);
    }

    pub(crate) fn close(&self, code: u32, reason: &str) {
        self.shared().close(code, reason);
    }

    pub(crate) async fn closed(&self) -> CloseInfo {
        let shared = self.shared();
        loop {
            let notified = shared.closed_notify.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            if let Some(info) = shared.lock().closed.clone() {
                return info;
            }
            notified.await;
        }
    }

    pub(crate) fn is_closed(&self) -> bool {
        self.shared().lock().closed.is_some() || self.shared().conn.close_reason().is_some()
    }

    pub(crate) fn rtt(&self) -> Option<Duration> {
        Some(self.shared().conn.rtt())
    }

    pub(crate) fn open_streams(&self) -> usize {
        self.shared().lock().open
    }

    pub(crate) fn stats(&self) -> Stats {
        let s = self.shared().conn.stats();
        Stats {
            frames_in: s.udp_rx.datagrams,
            frames_out: s.udp_tx.datagrams,
            bytes_in: s.udp_rx.bytes,
            bytes_out: s.udp_tx.bytes,
            open_streams: len_u32(self.open_streams()),
            // QUIC streams are quinn's: no session sheds them.
            ..Stats::default()
        }
    }

    /// The peer's certificate chain, leaf first (empty if it sent none).
    pub(crate) fn peer_certificates(&self) -> Vec<CertificateDer<'static>> {
        self.shared()
            .conn
            .peer_identity()
            .and_then(|any| any.downcast::<Vec<CertificateDer<'static>>>().ok())
            .map(|certs| *certs)
            .unwrap_or_default()
    }
}

async fn accept_streams(shared: Arc<Shared>) {
    while let Ok((mut send, mut recv)) = shared.conn.accept_bi().await {
        let shared = shared.clone();
        // The header nearly always came with the stream's first packet: read here, no task.
        run_or_spawn(async move {
            let limit = shared.config.handshake_timeout;
            let read =
                tokio::time::timeout(limit, read_header(&mut recv, shared.config.max_metadata));
            let failure = match read.await {
                Ok(Ok(header)) => return shared.queue(send, recv, header),
                Ok(Err(HeaderError::Malformed(why))) => {
                    tracing::debug!(%why, "malformed QUIC stream header: resetting the stream");
                    code::PROTOCOL_ERROR
                }
                Ok(Err(HeaderError::Stream)) => code::CANCEL,
                Err(_) => {
                    tracing::debug!(
                        ?limit,
                        "QUIC stream header incomplete: resetting the stream"
                    );
                    code::TIMEOUT
                }
            };
            let _ = recv.stop(varint(failure));
            let _ = send.reset(varint(failure));
        });
    }
}

async fn watch_session(shared: Arc<Shared>, mut recv: RecvStream) {
    loop {
        match read_message(&mut recv, 4 + MAX_REASON).await {
            Ok(Some((MSG_GOAWAY, mut payload))) => {
                if payload.remaining() < 4 {
                    shared.close(code::PROTOCOL_ERROR, "malformed GOAWAY");
                    return;
                }
                let code = payload.get_u32();
                let reason = String::from_utf8_lossy(&payload);
                tracing::debug!(code, %reason, "peer is going away");
                shared.lock().peer_going_away = true;
                shared.notify.notify_waiters();
                shared.maybe_close();
            }
            // Unknown message types are skipped: later versions may add some.
            Ok(Some(_)) => {}
            Ok(None) => return,
            Err(e) => {
                if shared.conn.close_reason().is_none() {
                    shared.close(code::PROTOCOL_ERROR, &e.to_string());
                }
                return;
            }
        }
    }
}

async fn watch_closed(shared: Arc<Shared>) {
    let e = shared.conn.closed().await;
    let mut st = shared.lock();
    let error = match e {
        quinn::ConnectionError::LocallyClosed => match &st.local_close {
            Some((code, reason)) if *code != code::NO_ERROR => {
                Some(ConnectionError::ClosedLocally {
                    code: *code,
                    reason: reason.clone(),
                })
            }
            _ => None,
        },
        quinn::ConnectionError::ApplicationClosed(close) => {
            let code = code_of(close.error_code);
            (code != code::NO_ERROR).then(|| ConnectionError::ClosedByPeer {
                code,
                reason: String::from_utf8_lossy(&close.reason).into_owned(),
            })
        }
        quinn::ConnectionError::TimedOut => {
            Some(ConnectionError::TimedOut(shared.config.idle_timeout))
        }
        quinn::ConnectionError::TransportError(t) => Some(ConnectionError::ProtocolViolation {
            code: code::PROTOCOL_ERROR,
            reason: t.to_string(),
        }),
        quinn::ConnectionError::ConnectionClosed(c) => Some(ConnectionError::ClosedByPeer {
            code: code::PROTOCOL_ERROR,
            reason: c.to_string(),
        }),
        _ => Some(ConnectionError::TransportClosed),
    };
    match &error {
        None => tracing::debug!("QUIC tunnel closed"),
        Some(e) => tracing::debug!(error = %e, "QUIC tunnel closed with an error"),
    }
    st.closed = Some(CloseInfo { error });
    st.incoming.clear();
    drop(st);
    shared.notify.notify_waiters();
    shared.closed_notify.notify_waiters();
}

// ---------------------------------------------------------------------------------------------------------
// Streams

/// Counts a stream in [`State::open`] while it lives.
struct OpenGuard(Arc<Shared>);

impl OpenGuard {
    fn new(shared: Arc<Shared>) -> Self {
        shared.lock().open += 1;
        Self(shared)
    }
}

impl Drop for OpenGuard {
    fn drop(&mut self) {
        {
            let mut st = self.0.lock();
            st.open = st.open.saturating_sub(1);
        }
        self.0.maybe_close();
    }
}

enum Answer {
    Pending,
    Accepted(Bytes),
    Failed(TunnelError),
}

struct Halves {
    send: SendStream,
    recv: RecvStream,
    /// Header or answer bytes not yet written; user data waits behind them.
    head: Bytes,
    /// The stream's writer, waiting for the head to be written.
    head_waiter: Option<Waker>,
    /// The task writing the head (opening task or `head_task`), when quinn last kept the writer's waker.
    head_task_waiter: Option<Waker>,
    answer: Answer,
    /// A reader waiting for the answer.
    answer_waiter: Option<Waker>,
    /// The reader and writer last left pending by quinn: a local reset must wake them, quinn does not.
    read_waiter: Option<Waker>,
    write_waiter: Option<Waker>,
    /// Set once the stream can no longer be used.
    failed: Option<TunnelError>,
    /// Our direction was finished.
    finished: bool,
    /// The task writing the head / waiting for the answer (an opened stream's).
    task: Option<AbortHandle>,
    /// The task finishing an answer's write that did not fit at once (an accepted stream's).
    head_task: Option<AbortHandle>,
    guard: Option<OpenGuard>,
}

impl Halves {
    fn wake(&mut self) {
        if let Some(w) = self.head_waiter.take() {
            w.wake();
        }
        if let Some(w) = self.head_task_waiter.take() {
            w.wake();
        }
        if let Some(w) = self.answer_waiter.take() {
            w.wake();
        }
        if let Some(w) = self.read_waiter.take() {
            w.wake();
        }
        if let Some(w) = self.write_waiter.take() {
            w.wake();
        }
    }

    /// Fails the stream and resets both directions with `code` (no-op if it already failed).
    fn fail(&mut self, error: TunnelError, code: u32) {
        if self.failed.is_none() {
            self.failed = Some(error.clone());
        }
        if matches!(self.answer, Answer::Pending) {
            self.answer = Answer::Failed(error);
        }
        let _ = self.send.reset(varint(code));
        let _ = self.recv.stop(varint(code));
        for task in [self.task.take(), self.head_task.take()]
            .into_iter()
            .flatten()
        {
            task.abort();
        }
        self.wake();
    }
}

struct StreamShared {
    id: StreamId,
    conn: Arc<Shared>,
    _handle: Arc<Handle>,
    inner: Mutex<Halves>,
    answered: Notify,
}

impl StreamShared {
    fn new(
        handle: Arc<Handle>,
        send: SendStream,
        recv: RecvStream,
        head: Bytes,
        answer: Answer,
    ) -> Arc<Self> {
        let conn = handle.shared.clone();
        Arc::new(StreamShared {
            id: stream_id(send.id()),
            conn: conn.clone(),
            _handle: handle,
            inner: Mutex::new(Halves {
                send,
                recv,
                head,
                head_waiter: None,
                head_task_waiter: None,
                answer,
                answer_waiter: None,
                read_waiter: None,
                write_waiter: None,
                failed: None,
                finished: false,
                task: None,
                head_task: None,
                guard: Some(OpenGuard::new(conn)),
            }),
            answered: Notify::new(),
        })
    }
}

impl StreamShared {
    fn halves(&self) -> MutexGuard<'_, Halves> {
        lock(&self.inner)
    }

    fn read_error(&self, e: ReadError) -> (TunnelError, u32) {
        match e {
            ReadError::Reset(c) => (TunnelError::Reset(code_of(c)), code_of(c)),
            ReadError::ConnectionLost(_) => {
                (TunnelError::Closed(self.conn.close_reason()), code::CANCEL)
            }
            _ => (TunnelError::Reset(code::CANCEL), code::CANCEL),
        }
    }

    fn write_error(&self, e: WriteError) -> (TunnelError, u32) {
        match e {
            WriteError::Stopped(c) => (TunnelError::Reset(code_of(c)), code_of(c)),
            WriteError::ConnectionLost(_) => {
                (TunnelError::Closed(self.conn.close_reason()), code::CANCEL)
            }
            _ => (TunnelError::Reset(code::CANCEL), code::CANCEL),
        }
    }

    /// Writes the head (header or answer); once it is written, wakes whichever of the stream's writer and the
    /// task writing it waits. `writer`: the stream's writer drives it (an answer's `head_task` is then no longer
    /// needed); otherwise the opening task, the task finishing an answer, or a deferred answer's time.
    fn poll_head(&self, cx: &mut Context<'_>, writer: bool) -> Poll<Result<(), TunnelError>> {
        let mut h = self.halves();
        if let Some(e) = &h.failed {
            return Poll::Ready(Err(e.clone()));
        }
        while !h.head.is_empty() {
            let head = h.head.clone();
            match Pin::new(&mut h.send).poll_write(cx, &head) {
                Poll::Ready(Ok(n)) => h.head.advance(n),
                Poll::Ready(Err(e)) => {
                    let (error, code) = self.write_error(e);
                    h.fail(error.clone(), code);
                    return Poll::Ready(Err(error));
                }
                Poll::Pending => {
                    // quinn keeps one waker, the last poller's: whoever finishes the head wakes the other.
                    let slot = if writer {
                        &mut h.head_waiter
                    } else {
                        &mut h.head_task_waiter
                    };
                    *slot = Some(cx.waker().clone());
                    return Poll::Pending;
                }
            }
        }
        for w in [h.head_waiter.take(), h.head_task_waiter.take()]
            .into_iter()
            .flatten()
        {
            w.wake();
        }
        if writer && let Some(task) = h.head_task.take() {
            task.abort();
        }
        Poll::Ready(Ok(()))
    }

    /// Writes the head now; a task finishes it if it does not fit at once (it nearly always does).
    fn write_head(self: &Arc<Self>) {
        if self
            .poll_head(&mut Context::from_waker(Waker::noop()), false)
            .is_pending()
        {
            let writer = self.clone();
            let task = spawn(async move {
                let _ = std::future::poll_fn(|cx| writer.poll_head(cx, false)).await;
            });
            self.halves().head_task = task;
        }
    }

    /// Reads exactly `n` bytes of the answer.
    async fn read_exact(&self, n: usize) -> Result<Vec<u8>, TunnelError> {
        let mut buf = vec![0u8; n];
        let mut filled = 0;
        std::future::poll_fn(|cx| {
            let mut h = self.halves();
            while filled < n {
                match h.recv.poll_read(cx, &mut buf[filled..]) {
                    Poll::Ready(Ok(0)) => {
                        let e = TunnelError::Reset(code::PROTOCOL_ERROR);
                        h.fail(e.clone(), code::PROTOCOL_ERROR);
                        return Poll::Ready(Err(e));
                    }
                    Poll::Ready(Ok(k)) => filled += k,
                    Poll::Ready(Err(e)) => {
                        let (error, code) = self.read_error(e);
                        h.fail(error.clone(), code);
                        return Poll::Ready(Err(error));
                    }
                    Poll::Pending => return Poll::Pending,
                }
            }
            Poll::Ready(Ok(()))
        })
        .await?;
        Ok(buf)
    }

    /// Reads the acceptor's ACCEPT or REFUSE.
    async fn read_answer(&self) -> Result<Bytes, TunnelError> {
        let malformed = |why: &str| {
            tracing::debug!(why, "malformed QUIC stream answer");
            TunnelError::Reset(code::PROTOCOL_ERROR)
        };
        let head = self.read_exact(2).await?;
        if head[0] != VERSION {
            return Err(malformed("version"));
        }
        match head[1] {
            ANSWER_ACCEPT => {
                let len = self.read_exact(4).await?;
                let len = u32::from_be_bytes([len[0], len[1], len[2], len[3]]) as usize;
                if len > self.conn.config.max_metadata {
                    return Err(malformed("metadata too large"));
                }
                Ok(Bytes::from(self.read_exact(len).await?))
            }
            ANSWER_REFUSE => {
                let fixed = self.read_exact(6).await?;
                let code = u32::from_be_bytes([fixed[0], fixed[1], fixed[2], fixed[3]]);
                let len = usize::from(u16::from_be_bytes([fixed[4], fixed[5]]));
                if len > MAX_REASON {
                    return Err(malformed("reason too long"));
                }
                let reason = self.read_exact(len).await?;
                Err(TunnelError::Refused {
                    code,
                    reason: String::from_utf8_lossy(&reason).into_owned(),
                })
            }
            _ => Err(malformed("answer type")),
        }
    }

    fn set_answer(&self, result: Result<Bytes, TunnelError>) {
        let mut h = self.halves();
        h.task = None;
        match result {
            Ok(metadata) => {
                if matches!(h.answer, Answer::Pending) {
                    h.answer = Answer::Accepted(metadata);
                }
                h.wake();
            }
            Err(e) => {
                let code = match &e {
                    TunnelError::TimedOut(_) => code::TIMEOUT,
                    TunnelError::Refused { code, .. } => *code,
                    TunnelError::Reset(c) => *c,
                    _ => code::CANCEL,
                };
                h.fail(e, code);
            }
        }
        drop(h);
        self.answered.notify_waiters();
    }

    fn reset(&self, code: u32) {
        let mut h = self.halves();
        if h.failed.is_some() {
            return;
        }
        h.fail(TunnelError::Reset(code), code);
        drop(h);
        self.answered.notify_waiters();
    }
}

impl Drop for StreamShared {
    fn drop(&mut self) {
        let h = self.inner.get_mut().unwrap_or_else(PoisonError::into_inner);
        let guard = h.guard.take();
        if h.finished && h.failed.is_none() {
            // Keep the connection from closing gracefully until the peer has our last bytes. They are
            // often acknowledged already: no task then. (Only the acknowledgement is looked at here: a
            // timer polled in a drop could find the runtime shutting down, which panics.) Without a runtime
            // the guard goes with the task that was never spawned.
            let mut stopped = Box::pin(h.send.stopped());
            if stopped
                .as_mut()
                .poll(&mut Context::from_waker(Waker::noop()))
                .is_pending()
            {
                spawn(async move {
                    let _ = tokio::time::timeout(CLOSE_LINGER, stopped).await;
                    drop(guard);
                });
            }
        }
    }
}

async fn drive_open(ss: Arc<StreamShared>, deadline: Option<Duration>) {
    let work = async {
        std::future::poll_fn(|cx| ss.poll_head(cx, false)).await?;
        ss.read_answer().await
    };
    let result = match deadline {
        Some(d) => tokio::time::timeout(d, work)
            .await
            .unwrap_or(Err(TunnelError::TimedOut(d))),
        None => work.await,
    };
    ss.set_answer(result);
}

/// The QUIC side of [`crate::Stream`].
pub(crate) struct QuicStream {
    ss: Arc<StreamShared>,
    finished: bool,
    eof: bool,
}

impl QuicStream {
    pub(crate) fn id(&self) -> StreamId {
        self.ss.id
    }

    pub(crate) fn control(&self) -> QuicStreamControl {
        QuicStreamControl {
            ss: self.ss.clone(),
        }
    }

    pub(crate) fn finished(&self) -> bool {
        self.finished
    }

    pub(crate) fn eof(&self) -> bool {
        self.eof
    }

    pub(crate) fn poll_read(
        &mut self,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        if self.eof || buf.remaining() == 0 {
            return Poll::Ready(Ok(()));
        }
        let mut h = self.ss.halves();
        if let Some(e) = &h.failed {
            return Poll::Ready(Err(e.clone().into()));
        }
        match &h.answer {
            Answer::Pending => {
                h.answer_waiter = Some(cx.waker().clone());
                return Poll::Pending;
            }
            Answer::Failed(e) => return Poll::Ready(Err(e.clone().into())),
            Answer::Accepted(_) => {}
        }
        // Into the buffer as it is: quinn copies into the unfilled part without it being zeroed first (a
        // body's buffers are up to 64 KiB, and zeroing each one was a tenth of the relay's CPU under bulk).
        let before = buf.filled().len();
        match h.recv.poll_read_buf(cx, buf) {
            Poll::Ready(Ok(())) => {
                if buf.filled().len() == before {
                    self.eof = true;
                }
                Poll::Ready(Ok(()))
            }
            Poll::Ready(Err(e)) => {
                let (error, code) = self.ss.read_error(e);
                h.fail(error.clone(), code);
                drop(h);
                self.ss.answered.notify_waiters();
                Poll::Ready(Err(error.into()))
            }
            Poll::Pending => {
                h.read_waiter = Some(cx.waker().clone());
                Poll::Pending
            }
        }
    }

    pub(crate) fn poll_write(
        &mut self,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        if buf.is_empty() {
            return Poll::Ready(Ok(0));
        }
        self.poll_send(cx, |send, cx| Pin::new(send).poll_write(cx, buf))
    }

    /// [`crate::heads::WriteChunk::poll_write_chunks`]: quinn keeps the chunks themselves in the stream's
    /// send buffer (no copy).
    pub(crate) fn poll_write_chunks(
        &mut self,
        cx: &mut Context<'_>,
        chunks: &mut [Bytes],
    ) -> Poll<io::Result<usize>> {
        if chunks.iter().all(Bytes::is_empty) {
            return Poll::Ready(Ok(0));
        }
        // quinn's `write_chunks` is cancel-safe and polls the stream once per poll: a fresh one each time.
        self.poll_send(cx, |send, cx| {
            std::pin::pin!(send.write_chunks(chunks))
                .poll(cx)
                .map_ok(|written| written.bytes)
        })
    }

    /// Runs `write` on the send half once the stream may carry data (not shut down, not failed or refused, its
    /// head written); a write error fails the stream.
    fn poll_send(
        &mut self,
        cx: &mut Context<'_>,
        write: impl FnOnce(&mut SendStream, &mut Context<'_>) -> Poll<Result<usize, WriteError>>,
    ) -> Poll<io::Result<usize>> {
        if self.finished {
            return Poll::Ready(Err(io::Error::new(
                io::ErrorKind::BrokenPipe,
                "write after shutdown",
            )));
        }
        let mut h = self.ss.halves();
        if let Some(e) = &h.failed {
            return Poll::Ready(Err(e.clone().into()));
        }
        if let Answer::Failed(e) = &h.answer {
            return Poll::Ready(Err(e.clone().into()));
        }
        if !h.head.is_empty() {
            drop(h);
            std::task::ready!(self.poll_head_first(cx))?;
            h = self.ss.halves();
        }
        match write(&mut h.send, cx) {
            Poll::Ready(Ok(n)) => Poll::Ready(Ok(n)),
            Poll::Ready(Err(e)) => {
                let (error, code) = self.ss.write_error(e);
                h.fail(error.clone(), code);
                drop(h);
                self.ss.answered.notify_waiters();
                Poll::Ready(Err(error.into()))
            }
            Poll::Pending => {
                h.write_waiter = Some(cx.waker().clone());
                Poll::Pending
            }
        }
    }

    /// Before the stream's first bytes or its end: the head not yet written (an accepted stream's answer,
    /// deferred or not; an opened stream's header, which its opening task may not have written yet) is written
    /// here, so that it leaves in the same packet as what follows it.
    fn poll_head_first(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        self.ss.poll_head(cx, true).map_err(io::Error::from)
    }

    pub(crate) fn poll_shutdown(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        if self.finished {
            return Poll::Ready(Ok(()));
        }
        let mut h = self.ss.halves();
        if let Some(e) = &h.failed {
            return Poll::Ready(Err(e.clone().into()));
        }
        if !h.head.is_empty() {
            drop(h);
            std::task::ready!(self.poll_head_first(cx))?;
            h = self.ss.halves();
        }
        match h.send.finish() {
            Ok(()) => {
                h.finished = true;
                self.finished = true;
                Poll::Ready(Ok(()))
            }
            Err(_) => Poll::Ready(Err(TunnelError::Closed(self.ss.conn.close_reason()).into())),
        }
    }
}

impl Drop for QuicStream {
    fn drop(&mut self) {
        if !(self.finished && self.eof) {
            self.ss.reset(code::CANCEL);
        }
    }
}

/// The QUIC side of [`crate::StreamControl`].
#[derive(Clone)]
pub(crate) struct QuicStreamControl {
    ss: Arc<StreamShared>,
}

impl QuicStreamControl {
    pub(crate) fn id(&self) -> StreamId {
        self.ss.id
    }

    pub(crate) async fn accepted(&self) -> Result<Bytes, TunnelError> {
        loop {
            let notified = self.ss.answered.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            match &self.ss.halves().answer {
                Answer::Accepted(metadata) => return Ok(metadata.clone()),
                Answer::Failed(e) => return Err(e.clone()),
                Answer::Pending => {}
            }
            notified.await;
        }
    }

    pub(crate) fn reset(&self, code: u32) {
        self.ss.reset(code);
    }

    /// As [`crate::StreamControl::failed`]: the stream's failure (ours, the peer's STOP_SENDING, or the
    /// connection closing); pending while the stream is usable.
    pub(crate) async fn failed(&self) -> TunnelError {
        let conn = self.ss.conn.conn.clone();
        let stopped = self.ss.halves().send.stopped();
        tokio::pin!(stopped);
        let mut stopped_done = false;
        loop {
            let notified = self.ss.answered.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            if let Some(e) = self.ss.halves().failed.clone() {
                return e;
            }
            tokio::select! {
                () = &mut notified => {}
                _ = conn.closed() => return TunnelError::Closed(self.ss.conn.close_reason()),
                stop = &mut stopped, if !stopped_done => {
                    stopped_done = true;
                    match stop {
                        // The peer no longer reads what we send: it reset the stream.
                        Ok(Some(code)) => {
                            let code = u32::try_from(code.into_inner()).unwrap_or(code::CANCEL);
                            return TunnelError::Reset(code);
                        }
                        // All we sent was read (a finished stream): nothing failed.
                        Ok(None) => {}
                        Err(_) => return TunnelError::Closed(self.ss.conn.close_reason()),
                    }
                }
                // A failure recorded without a wake-up (read or write errors) is found on the next turn.
                () = tokio::time::sleep(Duration::from_millis(500)) => {}
            }
        }
    }
}

/// The QUIC side of [`crate::Incoming`].
pub(crate) struct QuicIncoming {
    pub(crate) kind: u16,
    pub(crate) priority: Priority,
    pub(crate) deadline: Option<Instant>,
    pub(crate) metadata: Bytes,
    pub(crate) id: StreamId,
    /// `None` once answered.
    parts: Option<(SendStream, RecvStream)>,
    handle: Arc<Handle>,
}

impl QuicIncoming {
    /// Accepts the stream; with `hold`, the answer waits up to that long to leave with the stream's first
    /// bytes (the caller has capped it by the opener's deadline).
    pub(crate) fn accept(
        mut self,
        metadata: Bytes,
        hold: Option<Duration>,
    ) -> Result<QuicStream, TunnelError> {
        let Some((send, recv)) = self.parts.take() else {
            return Err(TunnelError::Closed("stream already answered".to_owned()));
        };
        if self.handle.shared.conn.close_reason().is_some() {
            return Err(TunnelError::Closed(self.handle.shared.close_reason()));
        }
        if self.priority == Priority::Control {
            let _ = send.set_priority(PRIORITY_CONTROL);
        }
        let head = encode_accept(&metadata);
        let ss = StreamShared::new(
            self.handle.clone(),
            send,
            recv,
            head,
            Answer::Accepted(metadata),
        );
        match hold {
            Some(hold) if !hold.is_zero() => self.handle.shared.defer(&ss, hold),
            _ => ss.write_head(),
        }
        Ok(QuicStream {
            ss,
            finished: false,
            eof: false,
        })
    }

    pub(crate) fn refuse(mut self, code: u32, reason: &str) {
        if let Some((send, recv)) = self.parts.take() {
            refuse_parts(send, recv, code, reason);
        }
    }
}

impl Drop for QuicIncoming {
    fn drop(&mut self) {
        if let Some((send, recv)) = self.parts.take() {
            refuse_parts(send, recv, code::REFUSED, "not accepted");
        }
    }
}
