//! The session state machine: one per tunnel connection, on each side.

use std::time::{Duration, Instant};

use bytes::Bytes;

use crate::StreamId;

/// Which end of the transport this session is. The client (the agent, which dialled) opens odd stream ids.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    /// Initiated the transport (the agent).
    Client,
    /// Accepted the transport (the relay).
    Server,
}

/// Scheduling class of a stream. Control streams' data is always sent before normal streams' data;
/// connection control frames (ping, window updates, resets, ...) go before both.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Priority {
    /// Heartbeats, metadata, identity: small, latency-sensitive.
    Control,
    /// User traffic, scheduled round-robin between streams.
    Normal,
}

/// Session limits and timers. `Default` gives production values.
#[derive(Debug, Clone)]
pub struct Config {
    /// Which end this is.
    pub role: Role,
    /// Receive window granted to each stream (default 256 KiB).
    pub initial_stream_window: u32,
    /// Receive window for the whole connection (default 16 MiB).
    pub connection_window: u32,
    /// Largest frame payload accepted (default 64 KiB).
    pub max_frame_size: u32,
    /// Most streams the peer may have open at once (default 1024).
    pub max_concurrent_streams: u32,
    /// Most bytes buffered for sending per stream before `write` accepts no more (default 256 KiB).
    pub send_buffer: usize,
    /// Send a PING after this long without receiving anything (default 15 s).
    pub keepalive_interval: Duration,
    /// Declare the connection dead after this long without receiving anything (default 45 s).
    pub idle_timeout: Duration,
    /// Time allowed for the HELLO/SETTINGS exchange (default 10 s).
    pub handshake_timeout: Duration,
    /// Largest OPEN/ACCEPT metadata accepted (default 16 KiB).
    pub max_metadata: usize,
}

impl Config {
    /// Production defaults for `role`.
    pub fn new(role: Role) -> Self {
        Self {
            role,
            initial_stream_window: 256 * 1024,
            connection_window: 16 * 1024 * 1024,
            max_frame_size: 64 * 1024,
            max_concurrent_streams: 1024,
            send_buffer: 256 * 1024,
            keepalive_interval: Duration::from_secs(15),
            idle_timeout: Duration::from_secs(45),
            handshake_timeout: Duration::from_secs(10),
            max_metadata: 16 * 1024,
        }
    }
}

/// Something the application must learn about. Drained with [`Session::poll_event`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Event {
    /// The handshake completed; streams may be used (they may also be opened before, they are queued).
    Connected {
        /// The version both peers speak.
        version: u16,
    },
    /// The peer opened a stream. Answer with [`Session::accept_stream`] or [`Session::refuse_stream`].
    StreamOpened {
        /// The stream.
        id: StreamId,
        /// Its kind.
        kind: u16,
        /// Its scheduling class.
        priority: Priority,
        /// When the opener stops waiting for the answer.
        deadline: Option<Instant>,
        /// Opaque metadata.
        metadata: Bytes,
    },
    /// The peer accepted a stream we opened.
    StreamAccepted {
        /// The stream.
        id: StreamId,
        /// Opaque metadata.
        metadata: Bytes,
    },
    /// The peer refused a stream we opened (the stream is gone).
    StreamRefused {
        /// The stream.
        id: StreamId,
        /// Why (see [`crate::code`]).
        code: u32,
        /// Human-readable reason.
        reason: String,
    },
    /// A stream we opened was not answered before its deadline; it was reset (the stream is gone).
    StreamTimedOut {
        /// The stream.
        id: StreamId,
    },
    /// Data (or the end of data) can be read from the stream.
    Readable {
        /// The stream.
        id: StreamId,
    },
    /// The stream's send buffer has room again.
    Writable {
        /// The stream.
        id: StreamId,
    },
    /// The peer reset the stream (the stream is gone).
    StreamReset {
        /// The stream.
        id: StreamId,
        /// Why (see [`crate::code`]).
        code: u32,
    },
    /// The peer will accept no streams above `last_stream`; streams we opened above it were failed with
    /// [`Event::StreamReset`] (code SHUTDOWN) and may be retried elsewhere.
    GoAway {
        /// Highest stream of ours the peer processed.
        last_stream: StreamId,
        /// Why.
        code: u32,
        /// Human-readable reason.
        reason: String,
    },
    /// The connection is over. No more events follow; streams still open were failed.
    Closed {
        /// Why, if it was not a graceful close.
        error: Option<ConnectionError>,
    },
}

/// Result of [`Session::read`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ReadResult {
    /// Bytes from the peer (shares the received buffer).
    Data(Bytes),
    /// The peer half-closed: no more data will come.
    Finished,
    /// Nothing buffered yet; wait for [`Event::Readable`].
    Blocked,
}

/// Why the connection ended abnormally.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ConnectionError {
    /// The peer broke the protocol; we sent GOAWAY with `code`.
    #[error("protocol violation by peer (code {code}): {reason}")]
    ProtocolViolation {
        /// The GOAWAY code sent.
        code: u32,
        /// What went wrong.
        reason: String,
    },
    /// The peer closed the connection with an error code.
    #[error("closed by peer (code {code}): {reason}")]
    ClosedByPeer {
        /// The GOAWAY code received.
        code: u32,
        /// The peer's reason.
        reason: String,
    },
    /// Nothing was received for the idle timeout.
    #[error("peer went silent: no frame for {0:?}")]
    TimedOut(Duration),
    /// The handshake did not finish in time.
    #[error("handshake timed out")]
    HandshakeTimedOut,
    /// The transport ended without a GOAWAY.
    #[error("transport closed unexpectedly")]
    TransportClosed,
    /// No common protocol version.
    #[error("no common protocol version (ours {ours:?}, theirs {theirs:?})")]
    VersionMismatch {
        /// Our range.
        ours: (u16, u16),
        /// The peer's range.
        theirs: (u16, u16),
    },
    /// The application closed the connection with an error code.
    #[error("closed locally (code {code}): {reason}")]
    ClosedLocally {
        /// The code sent.
        code: u32,
        /// The reason sent.
        reason: String,
    },
}

/// Why a stream could not be opened.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum OpenError {
    /// The peer's concurrent-stream limit is reached.
    #[error("too many open streams (peer allows {0})")]
    TooManyStreams(u32),
    /// The connection is closing or closed.
    #[error("connection is closing")]
    Closing,
    /// Metadata larger than allowed.
    #[error("stream metadata too large")]
    MetadataTooLarge,
    /// Stream ids are exhausted; open a new connection.
    #[error("stream ids exhausted")]
    IdsExhausted,
}

/// Why an operation on a stream failed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum StreamError {
    /// No such stream (never existed, or already closed and forgotten).
    #[error("unknown stream {0:?}")]
    UnknownStream(StreamId),
    /// The stream was reset (by either side) with this code.
    #[error("stream reset (code {0})")]
    Reset(u32),
    /// Writing after `finish`.
    #[error("stream already finished")]
    Finished,
    /// The operation does not fit the stream's state (e.g. accepting a stream we opened).
    #[error("invalid stream state: {0}")]
    InvalidState(&'static str),
    /// The connection is gone.
    #[error("connection closed")]
    ConnectionClosed,
}

/// Counters for metrics and benchmarks.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Stats {
    /// Frames received.
    pub frames_in: u64,
    /// Frames sent.
    pub frames_out: u64,
    /// Bytes received (wire).
    pub bytes_in: u64,
    /// Bytes sent (wire).
    pub bytes_out: u64,
    /// Streams currently open.
    pub open_streams: u32,
}

/// One end of a tunnel connection. See the crate docs for the `handle_*`/`poll_*` discipline.
#[derive(Debug)]
pub struct Session {
    _private: (),
}

#[allow(unused_variables, clippy::todo)]
impl Session {
    /// A new session; HELLO and SETTINGS are queued for sending at once.
    pub fn new(config: Config, now: Instant) -> Self {
        todo!()
    }

    /// Feeds bytes received from the transport. Any protocol violation closes the session (GOAWAY queued,
    /// [`Event::Closed`] emitted); it never panics and never buffers more than its limits.
    pub fn handle_input(&mut self, now: Instant, data: Bytes) {
        todo!()
    }

    /// Tells the session that time has passed (call at or after [`Session::poll_timeout`]).
    pub fn handle_timeout(&mut self, now: Instant) {
        todo!()
    }

    /// Tells the session the transport is gone (EOF or error).
    pub fn handle_transport_closed(&mut self) {
        todo!()
    }

    /// The next chunk of bytes to write to the transport, or None when there is nothing to send.
    /// Control frames come first, then control-priority stream data, then normal stream data round-robin.
    pub fn poll_transmit(&mut self, now: Instant) -> Option<Bytes> {
        todo!()
    }

    /// The next event for the application.
    pub fn poll_event(&mut self) -> Option<Event> {
        todo!()
    }

    /// When [`Session::handle_timeout`] must be called next.
    pub fn poll_timeout(&self) -> Option<Instant> {
        todo!()
    }

    /// Opens a stream. Data may be written at once, before the peer accepts.
    pub fn open_stream(
        &mut self,
        now: Instant,
        kind: u16,
        priority: Priority,
        deadline: Option<Duration>,
        metadata: Bytes,
    ) -> Result<StreamId, OpenError> {
        todo!()
    }

    /// Accepts a stream the peer opened.
    pub fn accept_stream(&mut self, id: StreamId, metadata: Bytes) -> Result<(), StreamError> {
        todo!()
    }

    /// Refuses a stream the peer opened.
    pub fn refuse_stream(&mut self, id: StreamId, code: u32, reason: &str) -> Result<(), StreamError> {
        todo!()
    }

    /// Buffers bytes for sending; returns how many were taken (0 = buffer full, wait for
    /// [`Event::Writable`]).
    pub fn write(&mut self, id: StreamId, data: &[u8]) -> Result<usize, StreamError> {
        todo!()
    }

    /// Half-closes our side of the stream (FIN after the buffered data).
    pub fn finish(&mut self, id: StreamId) -> Result<(), StreamError> {
        todo!()
    }

    /// Takes up to `max` received bytes from the stream; grants the peer credit as the application reads.
    pub fn read(&mut self, id: StreamId, max: usize) -> Result<ReadResult, StreamError> {
        todo!()
    }

    /// Abruptly ends the stream in both directions and forgets it.
    pub fn reset(&mut self, id: StreamId, code: u32) {
        todo!()
    }

    /// Graceful shutdown: GOAWAY is sent, no new streams are accepted, open streams may finish; the session
    /// closes when the last stream is done.
    pub fn go_away(&mut self, code: u32, reason: &str) {
        todo!()
    }

    /// Immediate close: GOAWAY with `code`, every stream failed.
    pub fn close(&mut self, code: u32, reason: &str) {
        todo!()
    }

    /// True once the session is over and nothing remains to be sent.
    pub fn is_closed(&self) -> bool {
        todo!()
    }

    /// Smoothed round-trip time measured by PING, if any was answered.
    pub fn rtt(&self) -> Option<Duration> {
        todo!()
    }

    /// Counters.
    pub fn stats(&self) -> Stats {
        todo!()
    }
}
