//! The transport-neutral handles relay and agent code use: each is a thin enum over the WebSocket/session
//! implementation ([`crate::conn`]) and the QUIC one ([`crate::quic`]), with the same behaviour either way.

use std::io;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use bytes::Bytes;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

use crate::conn::{
    CloseInfo, OpenOptions, SessionConnection, SessionIncoming, SessionStream,
    SessionStreamControl, Transport, TunnelError,
};
use crate::quic::{QuicConnection, QuicIncoming, QuicStream, QuicStreamControl};
use crate::{Priority, SessionConfig};
use tether_proto::StreamId;

/// Which transport carries a [`Connection`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TransportKind {
    /// The protocol session over a WebSocket over TLS over TCP.
    WebSocket,
    /// Native QUIC streams (TLS 1.3 over UDP).
    Quic,
}

impl TransportKind {
    /// `wss` or `quic`, as shown to users.
    pub fn as_str(self) -> &'static str {
        match self {
            TransportKind::WebSocket => "wss",
            TransportKind::Quic => "quic",
        }
    }
}

#[derive(Clone)]
enum ConnInner {
    Session(SessionConnection),
    Quic(QuicConnection),
}

/// A tunnel connection. Cheap to clone; all clones are the same connection. Dropping every clone and every
/// stream closes it (gracefully, once streams are done).
#[derive(Clone)]
pub struct Connection {
    inner: ConnInner,
}

impl Connection {
    /// Starts a session connection over `transport` (see [`SessionConnection::spawn`]).
    pub(crate) fn spawn<T, F>(config: SessionConfig, transport: F) -> Connection
    where
        T: Transport,
        F: std::future::Future<Output = T> + Send + 'static,
    {
        Connection {
            inner: ConnInner::Session(SessionConnection::spawn(config, transport)),
        }
    }

    pub(crate) fn from_quic(conn: QuicConnection) -> Connection {
        Connection {
            inner: ConnInner::Quic(conn),
        }
    }

    /// Which transport carries this connection.
    pub fn transport(&self) -> TransportKind {
        match &self.inner {
            ConnInner::Session(_) => TransportKind::WebSocket,
            ConnInner::Quic(_) => TransportKind::Quic,
        }
    }

    /// Opens a stream. Returns at once: data may be written before the peer accepts. Use
    /// [`StreamControl::accepted`] to wait for the answer.
    pub fn open(&self, options: OpenOptions) -> Result<Stream, TunnelError> {
        Ok(Stream {
            inner: match &self.inner {
                ConnInner::Session(c) => StreamInner::Session(c.open(options)?),
                ConnInner::Quic(c) => StreamInner::Quic(c.open(options)?),
            },
        })
    }

    /// The next stream the peer opened, or `None` once the connection is closed or going away.
    pub async fn accept(&self) -> Option<Incoming> {
        match &self.inner {
            ConnInner::Session(c) => {
                let i = c.accept().await?;
                Some(Incoming {
                    kind: i.kind,
                    priority: i.priority,
                    deadline: i.deadline,
                    metadata: i.metadata.clone(),
                    inner: IncomingInner::Session(i),
                })
            }
            ConnInner::Quic(c) => {
                let i = c.accept().await?;
                Some(Incoming {
                    kind: i.kind,
                    priority: i.priority,
                    deadline: i.deadline,
                    metadata: i.metadata.clone(),
                    inner: IncomingInner::Quic(i),
                })
            }
        }
    }

    /// Graceful shutdown: no new streams; resolves [`Connection::closed`] once open streams finish. Streams
    /// the peer opened that were not accepted yet are refused with code SHUTDOWN (retryable elsewhere).
    pub fn go_away(&self, code: u32, reason: &str) {
        match &self.inner {
            ConnInner::Session(c) => c.go_away(code, reason),
            ConnInner::Quic(c) => c.go_away(code, reason),
        }
    }

    /// Immediate close: every stream fails.
    pub fn close(&self, code: u32, reason: &str) {
        match &self.inner {
            ConnInner::Session(c) => c.close(code, reason),
            ConnInner::Quic(c) => c.close(code, reason),
        }
    }

    /// Resolves when the connection has ended.
    pub async fn closed(&self) -> CloseInfo {
        match &self.inner {
            ConnInner::Session(c) => c.closed().await,
            ConnInner::Quic(c) => c.closed().await,
        }
    }

    /// True once the connection has ended.
    pub fn is_closed(&self) -> bool {
        match &self.inner {
            ConnInner::Session(c) => c.is_closed(),
            ConnInner::Quic(c) => c.is_closed(),
        }
    }

    /// Smoothed round-trip time: measured by the protocol's pings (WebSocket), or by QUIC.
    pub fn rtt(&self) -> Option<Duration> {
        match &self.inner {
            ConnInner::Session(c) => c.rtt(),
            ConnInner::Quic(c) => c.rtt(),
        }
    }

    /// Number of streams currently open.
    pub fn open_streams(&self) -> usize {
        match &self.inner {
            ConnInner::Session(c) => c.open_streams(),
            ConnInner::Quic(c) => c.open_streams(),
        }
    }

    /// Counters: protocol frames and bytes (WebSocket), or UDP datagrams and bytes (QUIC); open streams.
    pub fn stats(&self) -> tether_proto::Stats {
        match &self.inner {
            ConnInner::Session(c) => c.stats(),
            ConnInner::Quic(c) => c.stats(),
        }
    }

    /// The peer's TLS certificate chain, leaf first, for QUIC connections (empty otherwise: over WebSocket
    /// the relay's HTTP server sees the certificates before the upgrade).
    pub fn peer_certificates(&self) -> Vec<rustls::pki_types::CertificateDer<'static>> {
        match &self.inner {
            ConnInner::Session(_) => Vec::new(),
            ConnInner::Quic(c) => c.peer_certificates(),
        }
    }
}

impl std::fmt::Debug for Connection {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Connection")
            .field("transport", &self.transport())
            .finish_non_exhaustive()
    }
}

enum IncomingInner {
    Session(SessionIncoming),
    Quic(QuicIncoming),
}

/// A stream the peer opened, waiting for an answer. Dropping it unanswered refuses it (code REFUSED).
pub struct Incoming {
    /// Its kind (see [`crate::kind`]).
    pub kind: u16,
    /// Its scheduling class.
    pub priority: Priority,
    /// When the opener stops waiting.
    pub deadline: Option<Instant>,
    /// Opaque metadata from the opener.
    pub metadata: Bytes,
    inner: IncomingInner,
}

impl Incoming {
    /// The stream id (for logs).
    pub fn id(&self) -> StreamId {
        match &self.inner {
            IncomingInner::Session(i) => i.id(),
            IncomingInner::Quic(i) => i.id,
        }
    }

    /// Accepts the stream.
    pub fn accept(self, metadata: Bytes) -> Result<Stream, TunnelError> {
        self.answer(metadata, None)
    }

    /// Accepts the stream, letting the answer wait up to `hold` (and at most half the time left before the
    /// opener's deadline) for the stream's first bytes or other output to leave with: for a stream whose
    /// reply follows shortly (an HTTP response), the opener then reads the answer and the reply in one
    /// transport write instead of being woken for each. Over QUIC only the stream's own first bytes or its end
    /// carry the answer, in the same packet.
    pub fn accept_deferred(self, metadata: Bytes, hold: Duration) -> Result<Stream, TunnelError> {
        let hold = match self.deadline {
            Some(deadline) => {
                // The session's clock (tokio's, which tests may pause).
                let now = tokio::time::Instant::now().into_std();
                hold.min(deadline.saturating_duration_since(now) / 2)
            }
            None => hold,
        };
        self.answer(metadata, Some(hold))
    }

    fn answer(self, metadata: Bytes, hold: Option<Duration>) -> Result<Stream, TunnelError> {
        Ok(Stream {
            inner: match self.inner {
                IncomingInner::Session(i) => StreamInner::Session(i.accept(metadata, hold)?),
                IncomingInner::Quic(i) => StreamInner::Quic(i.accept(metadata, hold)?),
            },
        })
    }

    /// Refuses the stream with a code and reason.
    pub fn refuse(self, code: u32, reason: &str) {
        match self.inner {
            IncomingInner::Session(i) => i.refuse(code, reason),
            IncomingInner::Quic(i) => i.refuse(code, reason),
        }
    }
}

impl std::fmt::Debug for Incoming {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Incoming")
            .field("id", &self.id())
            .field("kind", &self.kind)
            .field("priority", &self.priority)
            .field("deadline", &self.deadline)
            .field("metadata_len", &self.metadata.len())
            .finish()
    }
}

enum StreamInner {
    Session(SessionStream),
    Quic(QuicStream),
}

/// One logical byte stream. `shutdown()` half-closes our side (the peer reads EOF); dropping a stream that
/// was not finished and fully read resets it (code CANCEL). `poll_flush` returns at once: written bytes
/// are sent without further calls.
pub struct Stream {
    inner: StreamInner,
}

impl Stream {
    /// A handle to watch or reset the stream while another task owns the reader/writer.
    pub fn control(&self) -> StreamControl {
        StreamControl {
            inner: match &self.inner {
                StreamInner::Session(s) => ControlInner::Session(s.control()),
                StreamInner::Quic(s) => ControlInner::Quic(s.control()),
            },
        }
    }

    /// The stream id (for logs).
    pub fn id(&self) -> StreamId {
        match &self.inner {
            StreamInner::Session(s) => s.id(),
            StreamInner::Quic(s) => s.id(),
        }
    }
}

impl crate::heads::ReadChunk for Stream {
    fn poll_chunk(&mut self, cx: &mut Context<'_>, max: usize) -> Option<Poll<io::Result<Bytes>>> {
        match &mut self.inner {
            StreamInner::Session(s) => Some(s.poll_take(cx, max)),
            // quinn hands out chunks only through a future borrowing the stream; QUIC bodies are copied.
            StreamInner::Quic(_) => None,
        }
    }
}

impl crate::heads::WriteChunk for Stream {
    fn takes_chunks(&self) -> bool {
        matches!(self.inner, StreamInner::Quic(_))
    }

    fn poll_write_chunks(
        &mut self,
        cx: &mut Context<'_>,
        chunks: &mut [Bytes],
    ) -> Poll<io::Result<usize>> {
        match &mut self.inner {
            // The session copies what it is given into the stream's send buffer.
            StreamInner::Session(s) => crate::heads::poll_write_first(s, cx, chunks),
            StreamInner::Quic(s) => s.poll_write_chunks(cx, chunks),
        }
    }
}

impl std::fmt::Debug for Stream {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match &self.inner {
            StreamInner::Session(s) => s.fmt(f),
            StreamInner::Quic(s) => f
                .debug_struct("Stream")
                .field("id", &s.id())
                .field("finished", &s.finished())
                .field("eof", &s.eof())
                .finish(),
        }
    }
}

impl AsyncRead for Stream {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        match &mut self.get_mut().inner {
            StreamInner::Session(s) => Pin::new(s).poll_read(cx, buf),
            StreamInner::Quic(s) => s.poll_read(cx, buf),
        }
    }
}

impl AsyncWrite for Stream {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        match &mut self.get_mut().inner {
            StreamInner::Session(s) => Pin::new(s).poll_write(cx, buf),
            StreamInner::Quic(s) => s.poll_write(cx, buf),
        }
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match &mut self.get_mut().inner {
            StreamInner::Session(s) => Pin::new(s).poll_flush(cx),
            StreamInner::Quic(_) => Poll::Ready(Ok(())),
        }
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match &mut self.get_mut().inner {
            StreamInner::Session(s) => Pin::new(s).poll_shutdown(cx),
            StreamInner::Quic(s) => s.poll_shutdown(cx),
        }
    }
}

#[derive(Clone)]
enum ControlInner {
    Session(SessionStreamControl),
    Quic(QuicStreamControl),
}

/// A handle on a stream that does not own its bytes. Cheap to clone.
#[derive(Clone)]
pub struct StreamControl {
    inner: ControlInner,
}

impl StreamControl {
    /// Waits for the peer's answer to a stream we opened: accept metadata, or why it failed
    /// (refused, timed out, reset, tunnel closed). Resolves at once for streams the peer opened (with the
    /// metadata we accepted them with).
    pub async fn accepted(&self) -> Result<Bytes, TunnelError> {
        match &self.inner {
            ControlInner::Session(c) => c.accepted().await,
            ControlInner::Quic(c) => c.accepted().await,
        }
    }

    /// Waits until the stream can no longer be used — reset (by the peer or by us), refused, timed out, or its
    /// tunnel closed — and returns why. Stays pending while the stream is usable, and once it has ended
    /// normally. Lets a task that waits on something else (an upstream answer) stop as soon as nobody is left
    /// to give the answer to.
    pub async fn failed(&self) -> TunnelError {
        match &self.inner {
            ControlInner::Session(c) => c.failed().await,
            ControlInner::Quic(c) => c.failed().await,
        }
    }

    /// Resets the stream: both directions fail at once, here with [`TunnelError::Reset`], at the peer too.
    pub fn reset(&self, code: u32) {
        match &self.inner {
            ControlInner::Session(c) => c.reset(code),
            ControlInner::Quic(c) => c.reset(code),
        }
    }

    /// The stream id (for logs).
    pub fn id(&self) -> StreamId {
        match &self.inner {
            ControlInner::Session(c) => c.id(),
            ControlInner::Quic(c) => c.id(),
        }
    }
}

impl std::fmt::Debug for StreamControl {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StreamControl")
            .field("id", &self.id())
            .finish()
    }
}
