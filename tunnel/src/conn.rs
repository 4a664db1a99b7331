//! Transport-independent connection and stream handles.

use std::io;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use bytes::Bytes;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

use tether_proto::{ConnectionError, Priority, StreamId};

/// Why a tunnel operation failed.
#[derive(Debug, Clone, thiserror::Error)]
pub enum TunnelError {
    /// The peer refused the stream.
    #[error("stream refused by peer (code {code}): {reason}")]
    Refused {
        /// See [`crate::code`].
        code: u32,
        /// The peer's reason.
        reason: String,
    },
    /// The peer did not accept the stream before its deadline.
    #[error("peer did not answer within {0:?}")]
    TimedOut(Duration),
    /// The stream was reset.
    #[error("stream reset (code {0})")]
    Reset(u32),
    /// Too many streams are open on this connection.
    #[error("too many concurrent streams on the tunnel")]
    TooManyStreams,
    /// The tunnel is closing or closed.
    #[error("tunnel closed: {0}")]
    Closed(String),
}

impl TunnelError {
    /// True when trying again (on this or a new tunnel) may succeed.
    pub fn is_retryable(&self) -> bool {
        todo!()
    }
}

impl From<TunnelError> for io::Error {
    fn from(e: TunnelError) -> Self {
        io::Error::other(e)
    }
}

/// How to open a stream.
#[derive(Debug, Clone)]
pub struct OpenOptions {
    /// What the stream carries (see [`crate::kind`]).
    pub kind: u16,
    /// Scheduling class.
    pub priority: Priority,
    /// How long to wait for the peer to accept; `None` = no deadline.
    pub deadline: Option<Duration>,
    /// Opaque metadata sent with the OPEN frame.
    pub metadata: Bytes,
}

/// How and why a connection ended.
#[derive(Debug, Clone)]
pub struct CloseInfo {
    /// `None` for a graceful close.
    pub error: Option<ConnectionError>,
}

/// A tunnel connection. Cheap to clone; all clones are the same connection. Dropping every clone and every
/// stream closes it.
#[derive(Clone)]
pub struct Connection {
    _private: (),
}

#[allow(unused_variables, clippy::todo)]
impl Connection {
    /// Opens a stream. Returns at once: data may be written before the peer accepts. Use
    /// [`StreamControl::accepted`] to wait for the answer.
    pub fn open(&self, options: OpenOptions) -> Result<Stream, TunnelError> {
        todo!()
    }

    /// The next stream the peer opened, or `None` once the connection is closed or going away.
    pub async fn accept(&self) -> Option<Incoming> {
        todo!()
    }

    /// Graceful shutdown: no new streams; resolves [`Connection::closed`] once open streams finish.
    pub fn go_away(&self, code: u32, reason: &str) {
        todo!()
    }

    /// Immediate close: every stream fails.
    pub fn close(&self, code: u32, reason: &str) {
        todo!()
    }

    /// Resolves when the connection has ended.
    pub async fn closed(&self) -> CloseInfo {
        todo!()
    }

    /// True once the connection has ended.
    pub fn is_closed(&self) -> bool {
        todo!()
    }

    /// Smoothed round-trip time measured by the protocol's pings.
    pub fn rtt(&self) -> Option<Duration> {
        todo!()
    }

    /// Number of streams currently open.
    pub fn open_streams(&self) -> usize {
        todo!()
    }
}

impl std::fmt::Debug for Connection {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Connection").finish_non_exhaustive()
    }
}

/// A stream the peer opened, waiting for an answer.
pub struct Incoming {
    /// Its kind (see [`crate::kind`]).
    pub kind: u16,
    /// Its scheduling class.
    pub priority: Priority,
    /// When the opener stops waiting.
    pub deadline: Option<Instant>,
    /// Opaque metadata from the opener.
    pub metadata: Bytes,
    _private: (),
}

#[allow(unused_variables, clippy::todo)]
impl Incoming {
    /// Accepts the stream.
    pub fn accept(self, metadata: Bytes) -> Result<Stream, TunnelError> {
        todo!()
    }

    /// Refuses the stream with a code and reason.
    pub fn refuse(self, code: u32, reason: &str) {
        todo!()
    }
}

/// One logical byte stream. `shutdown()` half-closes our side (the peer reads EOF); dropping a stream that
/// was not finished and fully read resets it (code CANCEL).
pub struct Stream {
    _private: (),
}

impl Stream {
    /// A handle to watch or reset the stream while another task owns the reader/writer.
    pub fn control(&self) -> StreamControl {
        todo!()
    }

    /// The stream id (for logs).
    pub fn id(&self) -> StreamId {
        todo!()
    }
}

/// A handle on a stream that does not own its bytes. Cheap to clone.
#[derive(Clone)]
pub struct StreamControl {
    _private: (),
}

#[allow(unused_variables, clippy::todo)]
impl StreamControl {
    /// Waits for the peer's answer to a stream we opened: accept metadata, or why it failed
    /// (refused, timed out, reset, tunnel closed). Resolves at once for streams the peer opened.
    pub async fn accepted(&self) -> Result<Bytes, TunnelError> {
        todo!()
    }

    /// Resets the stream.
    pub fn reset(&self, code: u32) {
        todo!()
    }
}

#[allow(unused_variables, clippy::todo)]
impl AsyncRead for Stream {
    fn poll_read(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        todo!()
    }
}

#[allow(unused_variables, clippy::todo)]
impl AsyncWrite for Stream {
    fn poll_write(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
        todo!()
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        todo!()
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        todo!()
    }
}
