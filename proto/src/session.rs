//! The session state machine: one per tunnel connection, on each side.

use std::collections::{BTreeSet, VecDeque};
use std::fmt;
use std::time::{Duration, Instant};

use bytes::{Buf, BufMut, Bytes, BytesMut};

use crate::frame::{
    FLAG_FIN, FrameHeader, MAX_FRAME_SIZE_LIMIT, MAX_REASON_LEN, MAX_WINDOW, MIN_MAX_FRAME_SIZE,
    OPEN_FIXED_LEN, ty,
};
use crate::{DecodeError, Frame, Settings, StreamId, VERSIONS, code};

/// The streams by id, hashed with foldhash (seeded per process): SipHash, std's default, was ~2 % of the
/// instructions of a small request here. Peers choose the ids of the streams they open, and a seeded hash keeps
/// them from choosing collisions; the stream limit bounds the map either way.
/// The session's map and the tunnel layer's (by [`StreamId`]) both use it.
pub type StreamMap<K, V> = std::collections::HashMap<K, V, foldhash::fast::RandomState>;

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
    /// Receive window granted to each stream at first (default 256 KiB).
    pub initial_stream_window: u32,
    /// Largest receive window a stream's window grows to (default 1 MiB). A stream whose reader drains half
    /// its window within two round trips (at least [`TUNE_PERIOD`]) is held back by the window rather than by
    /// its reader, so its window doubles, up to this; a slow or stalled reader keeps the initial window. The
    /// growth of all streams together stays within half of `connection_window`.
    pub max_stream_window: u32,
    /// Receive window for the whole connection (default 16 MiB): bytes in flight on the wire. Credit comes
    /// back as soon as data is buffered in a stream within that stream's own window, not when it is read, so
    /// a reader that stalls holds at most its stream's window and never starves the other streams; memory
    /// held for unread data is bounded by the stream windows (streams × `initial_stream_window`, plus at
    /// most half of this for windows grown by auto-tuning).
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
            max_stream_window: 1024 * 1024,
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
    /// Times the session started shedding (refusing new streams with [`code::OVERLOADED`]) because the peer
    /// reset too many streams right after opening them.
    pub shed_periods: u64,
    /// Peer streams refused with [`code::OVERLOADED`] while shedding.
    pub shed_streams: u64,
}

/// Where a stream is in its life, as reported by [`Session::stream_state`]. A stream that is gone (closed and
/// fully read, reset, refused or timed out) has no state: the session has forgotten it.
///
/// ```text
///      ours: open_stream, send OPEN                  theirs: recv OPEN, Event::StreamOpened
///                   │                                                   │
///                   ▼                                                   ▼
///             ┌───────────┐  deadline: send RESET(TIMEOUT)        ┌───────────┐
///     gone ◀──│  Opening  │  recv REFUSE                          │  Offered  │──▶ gone
///             └───────────┘                                       └───────────┘  refuse_stream:
///       recv ACCEPT │  (DATA and FIN may already be sent)  accept_stream: │      send REFUSE
///                   │                                     send ACCEPT     │
///                   └──────────────────┐          ┌──────────────────────┘
///                                      ▼          ▼
///                                    ┌──────────────┐
///                     finish: ┌──────│     Open     │──────┐ recv FIN
///                   send FIN  │      └──────────────┘      │
///                             ▼                            ▼
///                  ┌──────────────────┐        ┌───────────────────┐
///                  │  HalfClosedLocal │        │  HalfClosedRemote │
///                  └──────────────────┘        └───────────────────┘
///                      recv FIN │                          │ finish: send FIN
///                               ▼                          ▼
///                             ┌──────────────────────────────┐  FIN sent and all
///                             │            Closed            │─────────────────▶ gone
///                             └──────────────────────────────┘  data read
///
///   Any state ── reset() sends RESET, or RESET received (Event::StreamReset) ──▶ gone
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StreamState {
    /// We opened it and the peer has not answered yet (data may already flow from us).
    Opening,
    /// The peer opened it and the application has not answered yet.
    Offered,
    /// Both directions are open.
    Open,
    /// We finished sending (FIN queued or sent); the peer may still send.
    HalfClosedLocal,
    /// The peer finished sending; we may still send.
    HalfClosedRemote,
    /// Both sides finished; the stream lingers until our FIN is out and the application read everything.
    Closed,
}

/// Largest DATA payload emitted per stream per scheduling turn, and the size of a send chunk.
const QUANTUM: usize = 32 * 1024;
/// Smallest payload room of a send chunk, so that small writes coalesce into one frame. With its header the
/// chunk is 1 KiB: glibc serves allocations up to 1,032 bytes from a per-thread cache, and larger ones from the
/// shared heap, where a request of 1 KiB or more also consolidates the freed small chunks first. A small GET's
/// head (relay) and answer (agent) fit in one; a 4 KiB chunk was one of the three allocations above 1 KiB a small
/// GET made in the relay, and one of four in the agent (docs/BENCHMARKS.md, nineteenth pass).
const MIN_CHUNK: usize = 1024 - FrameHeader::LEN;
/// Highest stream id (the top bit is reserved).
const MAX_STREAM_ID: u32 = (1 << 31) - 1;
/// Pongs queued but not yet transmitted before a PING flood is declared.
const MAX_PENDING_PONGS: usize = 32;
/// Control frames queued (and not yet transmitted) before a peer that keeps causing more is cut off.
const MAX_CONTROL_QUEUE: usize = 4096;
/// Peer RESETs of streams younger than [`RAPID_RESET_AGE`] tolerated per [`RAPID_RESET_WINDOW`] before the
/// session sheds new streams for [`SHED_PERIOD`].
const RAPID_RESET_LIMIT: u32 = 1000;
/// How long the session refuses new peer streams (code OVERLOADED) once the peer reset too many right after
/// opening them. Streams already open are not touched.
pub const SHED_PERIOD: Duration = Duration::from_secs(1);
/// How young a stream must be for its reset to count as "rapid".
const RAPID_RESET_AGE: Duration = Duration::from_secs(1);
/// Window over which rapid resets are counted.
const RAPID_RESET_WINDOW: Duration = Duration::from_secs(10);
/// How many forgotten streams are remembered, so that late reads and writes get a precise answer.
const TOMBSTONES: usize = 256;
/// Soft limit of one control batch; the rest goes in the next chunk (still before any data).
const CONTROL_BATCH: usize = 64 * 1024;
/// Received payloads smaller than this are copied (and coalesced) rather than kept as slices of the input.
/// The shortest "two round trips" window auto-tuning uses (see [`Config::max_stream_window`]): on a fast
/// link, a reader must still drain half its window within this long to earn a larger one.
pub const TUNE_PERIOD: Duration = Duration::from_millis(1);

const MIN_ZERO_COPY: usize = 512;
/// A received payload is kept as a slice only if it is at least 1/`PIN_RATIO` of the input chunk it came in,
/// so that buffered slices never pin more than `PIN_RATIO` times their size.
const PIN_RATIO: usize = 4;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    /// Waiting for the peer's HELLO and SETTINGS.
    Handshaking,
    /// Streams flow (possibly draining after a GOAWAY).
    Open,
    /// Over; only already queued control frames (GOAWAY) remain to be sent.
    Closed,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Answer {
    /// Ours, OPEN sent, no ACCEPT/REFUSE yet.
    Opening { deadline: Option<Instant> },
    /// Theirs, the application has not accepted or refused it yet.
    Offered,
    /// Accepted (by either side).
    Accepted,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum SendHalf {
    Open,
    /// `finish` was called; FIN goes out with (or after) the last buffered byte.
    FinQueued,
    FinSent,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum RecvHalf {
    Open,
    FinReceived,
    /// The application saw [`ReadResult::Finished`].
    FinRead,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Tomb {
    /// Reset, refused or timed out with this code.
    Reset(u32),
    /// Finished in both directions and fully read.
    Done,
}

#[derive(Debug)]
struct Stream {
    local: bool,
    priority: Priority,
    answer: Answer,
    opened_at: Instant,
    /// Data to send. Each chunk is [`FrameHeader::LEN`] bytes of headroom followed by payload.
    chunks: VecDeque<BytesMut>,
    send_buffered: usize,
    /// Credit the peer granted for this stream.
    send_window: i64,
    send: SendHalf,
    /// `write` could not take everything: emit [`Event::Writable`] when there is room.
    want_writable: bool,
    /// In a ready queue.
    queued: bool,
    /// Received data not yet read: zero-copy slices of the input, then `recv_tail`.
    recv: VecDeque<Bytes>,
    /// Small payloads, copied and coalesced (see [`MIN_ZERO_COPY`]).
    recv_tail: BytesMut,
    recv_buffered: usize,
    /// Credit the peer still has for this stream.
    recv_window: u32,
    /// The stream's receive window: credit is granted back once half of it is read (auto-tuned, see
    /// [`Config::max_stream_window`]).
    recv_target: u32,
    /// When credit was last granted (or the stream opened).
    last_grant: Instant,
    /// Read by the application but not yet granted back.
    recv_unacked: u32,
    recv_half: RecvHalf,
    /// [`Event::Readable`] was emitted and the application has not drained the stream since.
    readable_notified: bool,
}

impl Stream {
    fn new(
        local: bool,
        priority: Priority,
        answer: Answer,
        now: Instant,
        send_window: i64,
        recv_window: u32,
    ) -> Self {
        Stream {
            local,
            priority,
            answer,
            opened_at: now,
            chunks: VecDeque::new(),
            send_buffered: 0,
            send_window,
            send: SendHalf::Open,
            want_writable: false,
            queued: false,
            recv: VecDeque::new(),
            recv_tail: BytesMut::new(),
            recv_buffered: 0,
            recv_window,
            recv_target: recv_window,
            last_grant: now,
            recv_unacked: 0,
            recv_half: RecvHalf::Open,
            readable_notified: false,
        }
    }

    /// Whether DATA may go out: the opener sends at once, the acceptor after ACCEPT.
    fn may_send(&self) -> bool {
        self.local || self.answer == Answer::Accepted
    }

    /// Whether the scheduler can emit a frame for this stream now (connection credit aside).
    fn sendable(&self) -> bool {
        if !self.may_send() || self.send == SendHalf::FinSent {
            return false;
        }
        if self.chunks.is_empty() {
            self.send == SendHalf::FinQueued
        } else {
            self.send_window > 0
        }
    }

    /// Buffers a received payload. Large payloads stay slices of the input (no copy); small ones, or ones
    /// that would pin a much larger input buffer, are copied into a coalescing tail, so that memory held is
    /// bounded by the bytes buffered and never by how the peer cut its frames.
    fn receive(&mut self, payload: Bytes, input_len: usize) {
        self.recv_buffered += payload.len();
        if payload.len() < MIN_ZERO_COPY || payload.len().saturating_mul(PIN_RATIO) < input_len {
            self.recv_tail.extend_from_slice(&payload);
            return;
        }
        if !self.recv_tail.is_empty() {
            self.recv.push_back(self.recv_tail.split().freeze());
        }
        self.recv.push_back(payload);
    }

    fn is_done(&self) -> bool {
        self.answer == Answer::Accepted
            && self.send == SendHalf::FinSent
            && self.recv_half == RecvHalf::FinRead
    }

    fn state(&self) -> StreamState {
        match self.answer {
            Answer::Opening { .. } => return StreamState::Opening,
            Answer::Offered => return StreamState::Offered,
            Answer::Accepted => {}
        }
        match (
            self.send == SendHalf::Open,
            self.recv_half == RecvHalf::Open,
        ) {
            (true, true) => StreamState::Open,
            (false, true) => StreamState::HalfClosedLocal,
            (true, false) => StreamState::HalfClosedRemote,
            (false, false) => StreamState::Closed,
        }
    }

    /// Copies `data` into send chunks (the one copy on the send path), filling the last chunk first.
    fn buffer(&mut self, mut data: &[u8]) {
        self.send_buffered += data.len();
        if let Some(last) = self.chunks.back_mut() {
            let payload = last.len() - FrameHeader::LEN;
            let room = (last.capacity() - last.len()).min(QUANTUM.saturating_sub(payload));
            let take = room.min(data.len());
            last.extend_from_slice(&data[..take]);
            data = &data[take..];
        }
        while !data.is_empty() {
            let take = data.len().min(QUANTUM);
            let mut chunk =
                BytesMut::with_capacity(FrameHeader::LEN + take.clamp(MIN_CHUNK, QUANTUM));
            chunk.put_bytes(0, FrameHeader::LEN);
            chunk.extend_from_slice(&data[..take]);
            self.chunks.push_back(chunk);
            data = &data[take..];
        }
    }
}

#[derive(Debug, Clone, Copy)]
struct PingState {
    data: [u8; 8],
    /// When it was queued; an unanswered PING is replaced after a keepalive interval.
    queued: Instant,
    /// When the PING left (set by `poll_transmit`).
    sent: Option<Instant>,
}

/// One end of a tunnel connection. See the crate docs for the `handle_*`/`poll_*` discipline.
pub struct Session {
    config: Config,
    phase: Phase,
    created: Instant,
    /// The version agreed once the peer's HELLO arrived.
    version: Option<u16>,
    /// The peer's SETTINGS, once received (which completes the handshake).
    peer: Option<Settings>,
    /// A frame split across `handle_input` calls (at most one frame, bounded by `max_frame_size`).
    rx: BytesMut,
    /// Control frames to send, in order.
    control: VecDeque<Frame>,
    /// ACCEPT frames waiting for other output to leave with ([`Session::accept_stream_deferred`]).
    deferred: Vec<Frame>,
    /// When the first of `deferred` must go at the latest.
    deferred_due: Option<Instant>,
    pending_pongs: usize,
    events: VecDeque<Event>,
    streams: StreamMap<u32, Stream>,
    /// Deadlines of streams we opened that are not answered yet.
    deadlines: BTreeSet<(Instant, u32)>,
    ready_control: VecDeque<u32>,
    ready_normal: VecDeque<u32>,
    next_local_id: u64,
    /// Highest stream id the peer opened (processed or refused).
    max_peer_id: u32,
    local_count: u32,
    peer_count: u32,
    /// Connection credit the peer granted us.
    conn_send_window: i64,
    /// Connection credit the peer still has.
    conn_recv_window: u32,
    /// Read (or discarded) but not yet granted back to the peer.
    conn_recv_unacked: u32,
    /// How far auto-tuning grew the windows of live streams beyond the initial one, together. Kept at most half
    /// the connection window, so streams that grew and then stalled cannot take all of it.
    grown: u32,
    /// Set when we sent GOAWAY: the last peer stream we process.
    local_goaway: Option<StreamId>,
    /// Set when the peer sent a graceful GOAWAY.
    peer_goaway: Option<(StreamId, u32, String)>,
    last_recv: Instant,
    ping: Option<PingState>,
    ping_counter: u64,
    srtt: Option<Duration>,
    rapid_resets: u32,
    rapid_reset_window_start: Instant,
    /// While set and in the future, new peer streams are refused with [`code::OVERLOADED`].
    shed_until: Option<Instant>,
    tombstones: VecDeque<(u32, Tomb)>,
    stats: Stats,
}

impl fmt::Debug for Session {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Session")
            .field("role", &self.config.role)
            .field("phase", &self.phase)
            .field("version", &self.version)
            .field("streams", &self.streams.len())
            .field("control_queued", &self.control.len())
            .field("events_queued", &self.events.len())
            .field("local_goaway", &self.local_goaway)
            .field("peer_goaway", &self.peer_goaway)
            .field("stats", &self.stats)
            .finish_non_exhaustive()
    }
}

fn reason_bytes(reason: &str) -> Bytes {
    let mut end = reason.len().min(MAX_REASON_LEN);
    while !reason.is_char_boundary(end) {
        end -= 1;
    }
    Bytes::copy_from_slice(&reason.as_bytes()[..end])
}

/// Metadata that would pin a much larger input buffer while it waits in an event is copied.
fn unpin(bytes: Bytes, input_len: usize) -> Bytes {
    if bytes.len().saturating_mul(PIN_RATIO) < input_len {
        Bytes::copy_from_slice(&bytes)
    } else {
        bytes
    }
}

fn len_u32(n: usize) -> u32 {
    u32::try_from(n).unwrap_or(u32::MAX)
}

fn len_i64(n: usize) -> i64 {
    i64::try_from(n).unwrap_or(i64::MAX)
}

impl Session {
    /// A new session; HELLO and SETTINGS are queued for sending at once.
    ///
    /// Out-of-range limits are clamped: windows to 1..=2^31-1, `max_frame_size` to 32 KiB..=2^24-1.
    pub fn new(config: Config, now: Instant) -> Self {
        let mut config = config;
        config.max_frame_size = config
            .max_frame_size
            .clamp(MIN_MAX_FRAME_SIZE, MAX_FRAME_SIZE_LIMIT);
        config.initial_stream_window = config.initial_stream_window.clamp(1, MAX_WINDOW);
        config.max_stream_window = config
            .max_stream_window
            .clamp(config.initial_stream_window, MAX_WINDOW);
        config.connection_window = config.connection_window.clamp(1, MAX_WINDOW);
        config.send_buffer = config.send_buffer.max(1);
        let settings = Settings {
            initial_stream_window: config.initial_stream_window,
            connection_window: config.connection_window,
            max_frame_size: config.max_frame_size,
            max_concurrent_streams: config.max_concurrent_streams,
        };
        let mut control = VecDeque::new();
        control.push_back(Frame::Hello {
            min_version: VERSIONS.0,
            max_version: VERSIONS.1,
        });
        control.push_back(Frame::Settings(settings));
        Session {
            next_local_id: match config.role {
                Role::Client => 1,
                Role::Server => 2,
            },
            conn_recv_window: config.connection_window,
            config,
            phase: Phase::Handshaking,
            created: now,
            version: None,
            peer: None,
            rx: BytesMut::new(),
            control,
            deferred: Vec::new(),
            deferred_due: None,
            pending_pongs: 0,
            events: VecDeque::new(),
            streams: StreamMap::default(),
            deadlines: BTreeSet::new(),
            ready_control: VecDeque::new(),
            ready_normal: VecDeque::new(),
            max_peer_id: 0,
            local_count: 0,
            peer_count: 0,
            conn_send_window: 0,
            conn_recv_unacked: 0,
            grown: 0,
            local_goaway: None,
            peer_goaway: None,
            last_recv: now,
            ping: None,
            ping_counter: 0,
            srtt: None,
            rapid_resets: 0,
            rapid_reset_window_start: now,
            shed_until: None,
            tombstones: VecDeque::new(),
            stats: Stats::default(),
        }
    }

    /// Feeds bytes received from the transport. Any protocol violation closes the session (GOAWAY queued,
    /// [`Event::Closed`] emitted); it never panics and never buffers more than its limits.
    ///
    /// Chunk boundaries do not matter. Payloads of frames that arrive whole in `data` are handed to the
    /// application as slices of `data`; a frame split across calls is copied once to reassemble it.
    pub fn handle_input(&mut self, now: Instant, mut data: Bytes) {
        if self.phase == Phase::Closed || data.is_empty() {
            return;
        }
        self.stats.bytes_in += data.len() as u64;
        self.last_recv = now;
        if !self.rx.is_empty() {
            let Some(mut whole) = self.reassemble(&mut data) else {
                return;
            };
            self.decode_frames(now, &mut whole);
        }
        if self.phase != Phase::Closed {
            self.decode_frames(now, &mut data);
            if self.phase != Phase::Closed && !data.is_empty() {
                // An incomplete frame: shorter than a header plus `max_frame_size`, which `decode` checked.
                self.rx.extend_from_slice(&data);
            }
        }
        self.after_op();
    }

    /// Moves bytes from `data` into the partial frame in `rx`; returns the frame once it is whole (or as soon
    /// as its header shows it is too large, for `decode` to reject).
    fn reassemble(&mut self, data: &mut Bytes) -> Option<Bytes> {
        let missing_header = FrameHeader::LEN.saturating_sub(self.rx.len());
        if missing_header > 0 {
            let n = missing_header.min(data.len());
            self.rx.extend_from_slice(&data[..n]);
            data.advance(n);
        }
        let header = FrameHeader::parse(&self.rx)?;
        if header.length > self.config.max_frame_size {
            return Some(self.rx.split().freeze());
        }
        let total = FrameHeader::LEN + header.length as usize;
        let n = (total - self.rx.len()).min(data.len());
        self.rx.reserve(total - self.rx.len());
        self.rx.extend_from_slice(&data[..n]);
        data.advance(n);
        (self.rx.len() == total).then(|| self.rx.split().freeze())
    }

    fn decode_frames(&mut self, now: Instant, buf: &mut Bytes) {
        let input_len = buf.len();
        while self.phase != Phase::Closed {
            match Frame::decode(buf, self.config.max_frame_size) {
                Ok(Some(frame)) => {
                    self.stats.frames_in += 1;
                    self.handle_frame(now, frame, input_len);
                }
                Ok(None) => return,
                Err(e) => {
                    let code = match e {
                        DecodeError::FrameTooLarge { .. } => code::FRAME_SIZE_ERROR,
                        DecodeError::Malformed { .. } | DecodeError::BadMagic => {
                            code::PROTOCOL_ERROR
                        }
                    };
                    self.fatal(code, &e.to_string());
                    return;
                }
            }
            if self.events.len() > self.event_cap() {
                self.fatal(code::ENHANCE_YOUR_CALM, "too many undelivered events");
            }
        }
    }

    /// Events the application may leave undrained before the peer is cut off for causing more.
    fn event_cap(&self) -> usize {
        (self.config.max_concurrent_streams as usize)
            .saturating_mul(4)
            .saturating_add(4096)
    }

    /// `input_len` is the size of the input chunk the frame was decoded from (see [`Stream::receive`]).
    fn handle_frame(&mut self, now: Instant, frame: Frame, input_len: usize) {
        if self.phase == Phase::Handshaking {
            match (self.version.is_some(), frame) {
                (
                    false,
                    Frame::Hello {
                        min_version,
                        max_version,
                    },
                ) => self.on_hello(min_version, max_version),
                (false, _) => self.fatal(code::PROTOCOL_ERROR, "first frame is not HELLO"),
                (true, Frame::Settings(settings)) => self.on_settings(now, settings),
                (true, _) => self.fatal(code::PROTOCOL_ERROR, "second frame is not SETTINGS"),
            }
            return;
        }
        match frame {
            Frame::Hello { .. } => self.fatal(code::PROTOCOL_ERROR, "HELLO sent twice"),
            Frame::Settings(_) => self.fatal(code::PROTOCOL_ERROR, "SETTINGS sent more than once"),
            Frame::Open {
                stream,
                kind,
                priority,
                deadline_ms,
                metadata,
            } => {
                let metadata = unpin(metadata, input_len);
                self.on_open(now, stream.0, kind, priority, deadline_ms, metadata);
            }
            Frame::Accept { stream, metadata } => {
                self.on_accept(stream.0, unpin(metadata, input_len))
            }
            Frame::Refuse {
                stream,
                code,
                reason,
            } => self.on_refuse(stream.0, code, &reason),
            Frame::Data {
                stream,
                fin,
                payload,
            } => self.on_data(stream.0, fin, payload, input_len),
            Frame::WindowUpdate { stream, increment } => self.on_window_update(stream.0, increment),
            Frame::Reset { stream, code } => self.on_reset(now, stream.0, code),
            Frame::Ping { ack, data } => self.on_ping(now, ack, data),
            Frame::GoAway {
                last_stream,
                code,
                reason,
            } => self.on_goaway(last_stream, code, &reason),
        }
    }

    fn on_hello(&mut self, min: u16, max: u16) {
        let best = VERSIONS.1.min(max);
        if best < VERSIONS.0.max(min) {
            self.shut(
                Some((code::VERSION_MISMATCH, "no common protocol version")),
                Some(ConnectionError::VersionMismatch {
                    ours: VERSIONS,
                    theirs: (min, max),
                }),
            );
            return;
        }
        self.version = Some(best);
    }

    fn on_settings(&mut self, now: Instant, settings: Settings) {
        self.peer = Some(settings);
        self.phase = Phase::Open;
        self.conn_send_window = i64::from(settings.connection_window);
        let mut ids: Vec<u32> = self.streams.keys().copied().collect();
        ids.sort_unstable();
        for id in ids {
            if let Some(s) = self.streams.get_mut(&id) {
                s.send_window = i64::from(settings.initial_stream_window);
            }
            self.schedule(id);
        }
        self.events.push_back(Event::Connected {
            version: self.version.unwrap_or(VERSIONS.1),
        });
        // A first PING measures the round trip early.
        self.start_ping(now);
    }

    fn is_local(&self, id: u32) -> bool {
        (id % 2 == 1) == (self.config.role == Role::Client)
    }

    /// A stream id that was never opened (by either side).
    fn is_idle(&self, id: u32) -> bool {
        if self.is_local(id) {
            u64::from(id) >= self.next_local_id
        } else {
            id > self.max_peer_id
        }
    }

    /// A frame for a stream we do not know: a protocol error if it never existed, ignored if it is gone.
    fn unknown_stream(&mut self, id: u32, what: &'static str) {
        if self.is_idle(id) {
            self.fatal(code::PROTOCOL_ERROR, what);
        }
    }

    /// Queues a control frame caused by the peer, closing the connection if the peer causes too many.
    fn queue_for_peer(&mut self, frame: Frame) {
        if self.control.len() >= MAX_CONTROL_QUEUE {
            self.fatal(code::ENHANCE_YOUR_CALM, "too many control frames queued");
        } else {
            self.control.push_back(frame);
        }
    }

    fn metadata_limit(&self) -> usize {
        self.config
            .max_metadata
            .min(MIN_MAX_FRAME_SIZE as usize - OPEN_FIXED_LEN)
    }

    fn on_open(
        &mut self,
        now: Instant,
        id: u32,
        kind: u16,
        priority: u8,
        deadline_ms: u32,
        metadata: Bytes,
    ) {
        if self.is_local(id) {
            self.fatal(
                code::PROTOCOL_ERROR,
                "peer opened a stream id of our parity",
            );
            return;
        }
        if id <= self.max_peer_id {
            self.fatal(code::PROTOCOL_ERROR, "peer reused or lowered a stream id");
            return;
        }
        self.max_peer_id = id;
        if metadata.len() > self.config.max_metadata {
            self.fatal(code::PROTOCOL_ERROR, "OPEN metadata exceeds the limit");
            return;
        }
        if self.local_goaway.is_some() {
            let reason = Bytes::from_static(b"connection is shutting down");
            self.queue_for_peer(Frame::Refuse {
                stream: StreamId(id),
                code: code::SHUTDOWN,
                reason,
            });
            return;
        }
        if self.shedding(now) {
            self.stats.shed_streams += 1;
            let reason = Bytes::from_static(
                b"shedding load: too many streams were reset right after opening; retry in a second",
            );
            self.queue_for_peer(Frame::Refuse {
                stream: StreamId(id),
                code: code::OVERLOADED,
                reason,
            });
            return;
        }
        if self.peer_count >= self.config.max_concurrent_streams {
            let reason = Bytes::from_static(b"too many concurrent streams");
            let frame = Frame::Refuse {
                stream: StreamId(id),
                code: code::REFUSED_TOO_MANY_STREAMS,
                reason,
            };
            self.queue_for_peer(frame);
            return;
        }
        let priority = if priority == 0 {
            Priority::Control
        } else {
            Priority::Normal
        };
        let send_window = self.peer.map_or(0, |p| i64::from(p.initial_stream_window));
        let stream = Stream::new(
            false,
            priority,
            Answer::Offered,
            now,
            send_window,
            self.config.initial_stream_window,
        );
        self.streams.insert(id, stream);
        self.peer_count += 1;
        let deadline = (deadline_ms > 0)
            .then(|| now.checked_add(Duration::from_millis(deadline_ms.into())))
            .flatten();
        self.events.push_back(Event::StreamOpened {
            id: StreamId(id),
            kind,
            priority,
            deadline,
            metadata,
        });
    }

    fn on_accept(&mut self, id: u32, metadata: Bytes) {
        if metadata.len() > self.config.max_metadata {
            self.fatal(code::PROTOCOL_ERROR, "ACCEPT metadata exceeds the limit");
            return;
        }
        let Some(s) = self.streams.get_mut(&id) else {
            return self.unknown_stream(id, "ACCEPT for a stream never opened");
        };
        let Answer::Opening { deadline } = s.answer else {
            return self.fatal(code::PROTOCOL_ERROR, "ACCEPT for a stream not awaiting one");
        };
        if !s.local {
            return self.fatal(code::PROTOCOL_ERROR, "ACCEPT for a stream the peer opened");
        }
        s.answer = Answer::Accepted;
        if let Some(d) = deadline {
            self.deadlines.remove(&(d, id));
        }
        self.events.push_back(Event::StreamAccepted {
            id: StreamId(id),
            metadata,
        });
        self.maybe_forget(id);
    }

    fn on_refuse(&mut self, id: u32, code: u32, reason: &[u8]) {
        let Some(s) = self.streams.get(&id) else {
            return self.unknown_stream(id, "REFUSE for a stream never opened");
        };
        if !s.local || !matches!(s.answer, Answer::Opening { .. }) {
            return self.fatal(
                code::PROTOCOL_ERROR,
                "REFUSE for a stream not awaiting an answer",
            );
        }
        self.remove_stream(id, Tomb::Reset(code));
        let reason = String::from_utf8_lossy(reason).into_owned();
        self.events.push_back(Event::StreamRefused {
            id: StreamId(id),
            code,
            reason,
        });
    }

    fn on_data(&mut self, id: u32, fin: bool, payload: Bytes, input_len: usize) {
        let len = len_u32(payload.len());
        if len > self.conn_recv_window {
            return self.fatal(
                code::FLOW_CONTROL_ERROR,
                "peer exceeded the connection window",
            );
        }
        self.conn_recv_window -= len;
        let Some(s) = self.streams.get_mut(&id) else {
            // Data in flight for a stream we reset or refused: drop it and give the credit back.
            self.release_conn_credit(payload.len());
            return self.unknown_stream(id, "DATA for a stream never opened");
        };
        if s.recv_half != RecvHalf::Open {
            return self.fatal(code::PROTOCOL_ERROR, "DATA after FIN");
        }
        if len > s.recv_window {
            return self.fatal(code::FLOW_CONTROL_ERROR, "peer exceeded a stream window");
        }
        s.recv_window -= len;
        let n = payload.len();
        if n > 0 {
            s.receive(payload, input_len);
        }
        if fin {
            s.recv_half = RecvHalf::FinReceived;
        }
        if (len > 0 || fin) && !s.readable_notified {
            s.readable_notified = true;
            self.events.push_back(Event::Readable { id: StreamId(id) });
        }
        if n > 0 {
            // Within its stream's window the data is the stream's to hold: its connection credit goes back
            // at once, so a stream whose reader stalls holds its own window and never the connection's
            // (memory is bounded by the stream windows, see `Config::connection_window`).
            self.release_conn_credit(n);
        }
    }

    fn on_window_update(&mut self, id: u32, increment: u32) {
        if id == 0 {
            let window = self.conn_send_window + i64::from(increment);
            if window > i64::from(MAX_WINDOW) {
                return self.fatal(code::FLOW_CONTROL_ERROR, "connection window above 2^31-1");
            }
            self.conn_send_window = window;
            return;
        }
        let Some(s) = self.streams.get_mut(&id) else {
            return self.unknown_stream(id, "WINDOW_UPDATE for a stream never opened");
        };
        let window = s.send_window + i64::from(increment);
        if window > i64::from(MAX_WINDOW) {
            return self.fatal(code::FLOW_CONTROL_ERROR, "stream window above 2^31-1");
        }
        s.send_window = window;
        self.schedule(id);
    }

    fn on_reset(&mut self, now: Instant, id: u32, code: u32) {
        let Some(s) = self.streams.get(&id) else {
            return self.unknown_stream(id, "RESET for a stream never opened");
        };
        // The rapid-reset attack makes us start work and cancels it at once. A peer that resets a stream we have
        // already answered in full (the relay does this at the end of every ordinary request) costs nothing.
        // The relay resets a stream whenever its user goes away, so many early resets are what users do, not a
        // protocol violation: past the bound we shed (refuse new streams for a moment), never close the tunnel.
        if !s.local
            && s.send == SendHalf::Open
            && now.saturating_duration_since(s.opened_at) < RAPID_RESET_AGE
        {
            if now.saturating_duration_since(self.rapid_reset_window_start) >= RAPID_RESET_WINDOW {
                self.rapid_reset_window_start = now;
                self.rapid_resets = 0;
            }
            self.rapid_resets += 1;
            if self.rapid_resets > RAPID_RESET_LIMIT {
                self.rapid_resets = 0;
                self.rapid_reset_window_start = now;
                self.shed_until = now.checked_add(SHED_PERIOD);
                self.stats.shed_periods += 1;
            }
        }
        self.remove_stream(id, Tomb::Reset(code));
        self.events.push_back(Event::StreamReset {
            id: StreamId(id),
            code,
        });
    }

    fn on_ping(&mut self, now: Instant, ack: bool, data: [u8; 8]) {
        if !ack {
            self.pending_pongs += 1;
            if self.pending_pongs > MAX_PENDING_PONGS {
                return self.fatal(code::ENHANCE_YOUR_CALM, "PING flood");
            }
            self.queue_for_peer(Frame::Ping { ack: true, data });
            return;
        }
        let Some(ping) = self.ping.filter(|p| p.data == data) else {
            return;
        };
        self.ping = None;
        if let Some(sent) = ping.sent {
            let sample = now.saturating_duration_since(sent);
            self.srtt = Some(match self.srtt {
                None => sample,
                Some(srtt) => (srtt * 7 + sample) / 8,
            });
        }
    }

    fn on_goaway(&mut self, last_stream: StreamId, code: u32, reason: &[u8]) {
        let reason = String::from_utf8_lossy(reason).into_owned();
        if code != code::NO_ERROR && code != code::SHUTDOWN {
            // An error GOAWAY ends the connection at once.
            self.control.clear();
            self.shut_keeping_received(Some(ConnectionError::ClosedByPeer { code, reason }));
            return;
        }
        let mut failed: Vec<u32> = self
            .streams
            .keys()
            .copied()
            .filter(|&id| self.is_local(id) && id > last_stream.0)
            .collect();
        failed.sort_unstable();
        for id in failed {
            self.remove_stream(id, Tomb::Reset(code::SHUTDOWN));
            self.events.push_back(Event::StreamReset {
                id: StreamId(id),
                code: code::SHUTDOWN,
            });
        }
        self.peer_goaway = Some((last_stream, code, reason.clone()));
        self.events.push_back(Event::GoAway {
            last_stream,
            code,
            reason,
        });
    }

    /// Tells the session that time has passed (call at or after [`Session::poll_timeout`]).
    pub fn handle_timeout(&mut self, now: Instant) {
        if self.phase == Phase::Closed {
            return;
        }
        if self.phase == Phase::Handshaking
            && self
                .created
                .checked_add(self.config.handshake_timeout)
                .is_some_and(|t| now >= t)
        {
            self.shut(
                Some((code::TIMEOUT, "handshake timed out")),
                Some(ConnectionError::HandshakeTimedOut),
            );
            return;
        }
        if self
            .last_recv
            .checked_add(self.config.idle_timeout)
            .is_some_and(|t| now >= t)
        {
            let error = ConnectionError::TimedOut(self.config.idle_timeout);
            self.shut(Some((code::TIMEOUT, "idle timeout")), Some(error));
            return;
        }
        if self.phase == Phase::Open && self.keepalive_at().is_some_and(|t| now >= t) {
            self.start_ping(now);
        }
        while let Some(&(deadline, id)) = self.deadlines.first() {
            if deadline > now {
                break;
            }
            self.deadlines.pop_first();
            if self.remove_stream(id, Tomb::Reset(code::TIMEOUT)).is_some() {
                self.control.push_back(Frame::Reset {
                    stream: StreamId(id),
                    code: code::TIMEOUT,
                });
                self.events
                    .push_back(Event::StreamTimedOut { id: StreamId(id) });
            }
        }
        self.after_op();
    }

    fn start_ping(&mut self, now: Instant) {
        self.ping_counter += 1;
        let data = self.ping_counter.to_be_bytes();
        self.ping = Some(PingState {
            data,
            queued: now,
            sent: None,
        });
        self.control.push_back(Frame::Ping { ack: false, data });
    }

    /// When the next keepalive PING is due: a keepalive interval after the last input, and after the last
    /// PING if that one is still unanswered.
    fn keepalive_at(&self) -> Option<Instant> {
        let since = match self.ping {
            Some(p) => self.last_recv.max(p.queued),
            None => self.last_recv,
        };
        since.checked_add(self.config.keepalive_interval)
    }

    /// Tells the session the transport is gone (EOF or error).
    ///
    /// Streams whose data the peer finished sending stay readable until drained; the others are failed.
    pub fn handle_transport_closed(&mut self) {
        self.control.clear();
        self.pending_pongs = 0;
        if self.phase == Phase::Closed {
            return;
        }
        // After a graceful GOAWAY, a transport that ends once every stream is complete on the wire is a
        // clean close, even if our application has not read everything yet.
        let complete = self
            .streams
            .values()
            .all(|s| s.send == SendHalf::FinSent && s.recv_half != RecvHalf::Open);
        let error = match &self.peer_goaway {
            Some(_) if complete => None,
            Some((_, code, reason)) => Some(ConnectionError::ClosedByPeer {
                code: *code,
                reason: reason.clone(),
            }),
            None => Some(ConnectionError::TransportClosed),
        };
        self.shut_keeping_received(error);
    }

    /// The next chunk of bytes to write to the transport, or None when there is nothing to send.
    /// Control frames come first, then control-priority stream data, then normal stream data round-robin.
    ///
    /// A chunk is either a batch of control frames or exactly one DATA frame. A DATA frame that carries a
    /// whole send chunk is that chunk (its header written into reserved headroom): no copy. Only a chunk split
    /// by flow control or by the peer's frame size is copied, and only the part sent.
    pub fn poll_transmit(&mut self, now: Instant) -> Option<Bytes> {
        self.release_deferred(now);
        if let Some(batch) = self.transmit_control(now) {
            return Some(batch);
        }
        if self.phase != Phase::Open {
            return None;
        }
        let chunk = self
            .transmit_data(Priority::Control)
            .or_else(|| self.transmit_data(Priority::Normal));
        self.after_op();
        chunk
    }

    /// Moves the deferred ACCEPTs ahead of the other control frames once anything else is to be sent (a frame
    /// for their stream can only follow them) or the first of them is due.
    fn release_deferred(&mut self, now: Instant) {
        let Some(due) = self.deferred_due else {
            return;
        };
        if due <= now
            || !self.control.is_empty()
            || !self.ready_control.is_empty()
            || !self.ready_normal.is_empty()
        {
            while let Some(frame) = self.deferred.pop() {
                self.control.push_front(frame);
            }
            self.deferred_due = None;
        }
    }

    fn transmit_control(&mut self, now: Instant) -> Option<Bytes> {
        let mut buf = BytesMut::new();
        while let Some(frame) = self.control.front() {
            let handshake_frame = matches!(frame, Frame::Hello { .. } | Frame::Settings(_));
            // Until the peer's SETTINGS arrive we know none of its limits: only HELLO and SETTINGS go out.
            if (self.phase == Phase::Handshaking && !handshake_frame) || buf.len() >= CONTROL_BATCH
            {
                break;
            }
            let Some(frame) = self.control.pop_front() else {
                break;
            };
            match &frame {
                Frame::Ping { ack: true, .. } => {
                    self.pending_pongs = self.pending_pongs.saturating_sub(1)
                }
                Frame::Ping { ack: false, data } => {
                    if let Some(ping) = self.ping.as_mut().filter(|p| p.data == *data) {
                        ping.sent = Some(now);
                    }
                }
                _ => {}
            }
            buf.reserve(frame.encoded_len());
            frame.encode(&mut buf);
            self.stats.frames_out += 1;
        }
        if buf.is_empty() {
            return None;
        }
        self.stats.bytes_out += buf.len() as u64;
        Some(buf.freeze())
    }

    fn transmit_data(&mut self, class: Priority) -> Option<Bytes> {
        let peer_max = self.peer.map_or(MIN_MAX_FRAME_SIZE, |p| p.max_frame_size) as usize;
        let turns = match class {
            Priority::Control => self.ready_control.len(),
            Priority::Normal => self.ready_normal.len(),
        };
        for _ in 0..turns {
            let queue = match class {
                Priority::Control => &mut self.ready_control,
                Priority::Normal => &mut self.ready_normal,
            };
            let Some(id) = queue.pop_front() else { break };
            let Some(s) = self.streams.get_mut(&id) else {
                continue;
            };
            s.queued = false;
            if !s.sendable() {
                // Out of stream credit: WINDOW_UPDATE puts it back.
                continue;
            }
            let last_chunk = s.chunks.len() == 1;
            let frame = if let Some(front) = s.chunks.front_mut() {
                if self.conn_send_window <= 0 {
                    // Out of connection credit: every stream waits, keep its turn.
                    s.queued = true;
                    queue.push_back(id);
                    continue;
                }
                let payload = front.len() - FrameHeader::LEN;
                let credit = usize::try_from(s.send_window.min(self.conn_send_window)).unwrap_or(0);
                let n = payload.min(credit).min(peer_max);
                let whole = n == payload;
                let fin = whole && last_chunk && s.send == SendHalf::FinQueued;
                let header = FrameHeader {
                    length: len_u32(n),
                    kind: ty::DATA,
                    flags: if fin { FLAG_FIN } else { 0 },
                    stream: StreamId(id),
                }
                .to_bytes();
                let bytes = if whole {
                    front[..FrameHeader::LEN].copy_from_slice(&header);
                    let Some(chunk) = s.chunks.pop_front() else {
                        continue;
                    };
                    chunk.freeze()
                } else {
                    let mut out = BytesMut::with_capacity(FrameHeader::LEN + n);
                    out.put_slice(&header);
                    out.put_slice(&front[FrameHeader::LEN..FrameHeader::LEN + n]);
                    // The sent bytes become the headroom of what is left: the chunk keeps its layout.
                    front.advance(n);
                    out.freeze()
                };
                s.send_buffered -= n;
                s.send_window -= len_i64(n);
                self.conn_send_window -= len_i64(n);
                if fin {
                    s.send = SendHalf::FinSent;
                }
                bytes
            } else {
                s.send = SendHalf::FinSent;
                let mut out = BytesMut::with_capacity(FrameHeader::LEN);
                FrameHeader {
                    length: 0,
                    kind: ty::DATA,
                    flags: FLAG_FIN,
                    stream: StreamId(id),
                }
                .encode(&mut out);
                out.freeze()
            };
            if s.want_writable
                && s.send == SendHalf::Open
                && s.send_buffered < self.config.send_buffer
            {
                s.want_writable = false;
                self.events.push_back(Event::Writable { id: StreamId(id) });
            }
            if s.sendable() {
                s.queued = true;
                queue.push_back(id);
            }
            self.stats.frames_out += 1;
            self.stats.bytes_out += frame.len() as u64;
            self.maybe_forget(id);
            return Some(frame);
        }
        None
    }

    /// The next event for the application.
    pub fn poll_event(&mut self) -> Option<Event> {
        self.events.pop_front()
    }

    /// When [`Session::handle_timeout`] must be called next.
    pub fn poll_timeout(&self) -> Option<Instant> {
        if self.phase == Phase::Closed {
            return None;
        }
        let mut next = self.last_recv.checked_add(self.config.idle_timeout);
        let mut consider = |t: Option<Instant>| {
            if let Some(t) = t {
                next = Some(next.map_or(t, |n| n.min(t)));
            }
        };
        if self.phase == Phase::Handshaking {
            consider(self.created.checked_add(self.config.handshake_timeout));
        }
        if self.phase == Phase::Open {
            consider(self.keepalive_at());
        }
        consider(self.deadlines.first().map(|&(d, _)| d));
        consider(self.deferred_due);
        next
    }

    /// Opens a stream. Data may be written at once, before the peer accepts.
    ///
    /// Streams opened before the handshake completes are announced as soon as it does. `deadline` is how
    /// long to wait for ACCEPT or REFUSE (sent to the peer in whole milliseconds, at least 1).
    pub fn open_stream(
        &mut self,
        now: Instant,
        kind: u16,
        priority: Priority,
        deadline: Option<Duration>,
        metadata: Bytes,
    ) -> Result<StreamId, OpenError> {
        if self.phase == Phase::Closed || self.local_goaway.is_some() || self.peer_goaway.is_some()
        {
            return Err(OpenError::Closing);
        }
        if metadata.len() > self.metadata_limit() {
            return Err(OpenError::MetadataTooLarge);
        }
        let limit = self.peer.unwrap_or_default().max_concurrent_streams;
        if self.local_count >= limit {
            return Err(OpenError::TooManyStreams(limit));
        }
        let id = match u32::try_from(self.next_local_id) {
            Ok(id) if id <= MAX_STREAM_ID => id,
            _ => return Err(OpenError::IdsExhausted),
        };
        self.next_local_id += 2;
        let deadline_at = deadline.and_then(|d| now.checked_add(d));
        let deadline_ms = deadline.map_or(0, |d| {
            u32::try_from(d.as_millis()).unwrap_or(u32::MAX).max(1)
        });
        self.control.push_back(Frame::Open {
            stream: StreamId(id),
            kind,
            priority: match priority {
                Priority::Control => 0,
                Priority::Normal => 1,
            },
            deadline_ms,
            metadata,
        });
        let send_window = self.peer.map_or(0, |p| i64::from(p.initial_stream_window));
        let answer = Answer::Opening {
            deadline: deadline_at,
        };
        let stream = Stream::new(
            true,
            priority,
            answer,
            now,
            send_window,
            self.config.initial_stream_window,
        );
        self.streams.insert(id, stream);
        if let Some(d) = deadline_at {
            self.deadlines.insert((d, id));
        }
        self.local_count += 1;
        Ok(StreamId(id))
    }

    /// Looks up a live stream, or says why there is none.
    fn live(&mut self, id: StreamId) -> Result<&mut Stream, StreamError> {
        // The map first: every read and write of a live stream comes here, and scanning the tombstones on
        // each call cost a tenth of the agent's instructions per request (docs/BENCHMARKS.md).
        match self.streams.get_mut(&id.0) {
            Some(s) => Ok(s),
            None => Err(gone(&self.tombstones, self.phase == Phase::Closed, id)),
        }
    }

    /// Accepts a stream the peer opened.
    pub fn accept_stream(&mut self, id: StreamId, metadata: Bytes) -> Result<(), StreamError> {
        self.accept(id, metadata, None)
    }

    /// Accepts a stream the peer opened, holding the ACCEPT frame back until other output is sent (the
    /// stream's first data, another stream's, any control frame) or `send_by` comes, whichever is first: an
    /// answer that follows the acceptance shortly (an HTTP response) then leaves in the same transport write,
    /// and the peer is woken once instead of twice. The stream is accepted at once on our side; the peer
    /// learns it at the latest at `send_by`, which should be well within the stream's deadline.
    /// [`Session::poll_timeout`] includes `send_by`.
    pub fn accept_stream_deferred(
        &mut self,
        id: StreamId,
        metadata: Bytes,
        send_by: Instant,
    ) -> Result<(), StreamError> {
        self.accept(id, metadata, Some(send_by))
    }

    fn accept(
        &mut self,
        id: StreamId,
        metadata: Bytes,
        send_by: Option<Instant>,
    ) -> Result<(), StreamError> {
        if self.phase == Phase::Closed {
            return Err(StreamError::ConnectionClosed);
        }
        let limit = self.metadata_limit();
        let s = self.live(id)?;
        if s.local || s.answer != Answer::Offered {
            return Err(StreamError::InvalidState(
                "not a peer stream awaiting an answer",
            ));
        }
        if metadata.len() > limit {
            return Err(StreamError::InvalidState("metadata too large"));
        }
        s.answer = Answer::Accepted;
        let frame = Frame::Accept {
            stream: id,
            metadata,
        };
        match send_by {
            Some(at) => {
                self.deferred.push(frame);
                self.deferred_due = Some(self.deferred_due.map_or(at, |due| due.min(at)));
            }
            None => self.control.push_back(frame),
        }
        self.schedule(id.0);
        self.maybe_forget(id.0);
        self.after_op();
        Ok(())
    }

    /// Refuses a stream the peer opened.
    pub fn refuse_stream(
        &mut self,
        id: StreamId,
        code: u32,
        reason: &str,
    ) -> Result<(), StreamError> {
        if self.phase == Phase::Closed {
            return Err(StreamError::ConnectionClosed);
        }
        let s = self.live(id)?;
        if s.local || s.answer != Answer::Offered {
            return Err(StreamError::InvalidState(
                "not a peer stream awaiting an answer",
            ));
        }
        self.remove_stream(id.0, Tomb::Reset(code));
        self.control.push_back(Frame::Refuse {
            stream: id,
            code,
            reason: reason_bytes(reason),
        });
        self.after_op();
        Ok(())
    }

    /// Buffers bytes for sending; returns how many were taken (0 = buffer full, wait for
    /// [`Event::Writable`]).
    ///
    /// The bytes are copied once, into chunks that become DATA frames without another copy. At most
    /// `send_buffer` bytes are buffered per stream; when not everything fits, [`Event::Writable`] follows once
    /// there is room.
    pub fn write(&mut self, id: StreamId, data: &[u8]) -> Result<usize, StreamError> {
        let limit = self.config.send_buffer;
        if self.phase == Phase::Closed {
            return Err(StreamError::ConnectionClosed);
        }
        let s = self.live(id)?;
        if s.send != SendHalf::Open {
            return Err(StreamError::Finished);
        }
        let n = data.len().min(limit.saturating_sub(s.send_buffered));
        if n < data.len() {
            s.want_writable = true;
        }
        if n == 0 {
            return Ok(0);
        }
        s.buffer(&data[..n]);
        self.schedule(id.0);
        Ok(n)
    }

    /// Half-closes our side of the stream (FIN after the buffered data). Finishing twice is harmless.
    pub fn finish(&mut self, id: StreamId) -> Result<(), StreamError> {
        if self.phase == Phase::Closed {
            return Err(StreamError::ConnectionClosed);
        }
        let s = match self.live(id) {
            Err(StreamError::Finished) => return Ok(()),
            other => other?,
        };
        if s.send == SendHalf::Open {
            s.send = SendHalf::FinQueued;
            s.want_writable = false;
        }
        self.schedule(id.0);
        Ok(())
    }

    /// Takes up to `max` received bytes from the stream; grants the peer credit as the application reads
    /// (more credit to a reader fast enough that the window holds it back: [`Config::max_stream_window`]).
    ///
    /// After [`ReadResult::Finished`] further reads keep returning it, also for a while after the stream is
    /// forgotten.
    pub fn read(
        &mut self,
        now: Instant,
        id: StreamId,
        max: usize,
    ) -> Result<ReadResult, StreamError> {
        let max_window = self.config.max_stream_window;
        let fast = self
            .srtt
            .map_or(TUNE_PERIOD, |rtt| (rtt * 2).max(TUNE_PERIOD));
        let budget = (self.config.connection_window / 2).saturating_sub(self.grown);
        let mut grew = 0;
        let s = match self.live(id) {
            Err(StreamError::Finished) => return Ok(ReadResult::Finished),
            other => other?,
        };
        if s.recv.is_empty() && !s.recv_tail.is_empty() {
            let tail = s.recv_tail.split().freeze();
            s.recv.push_back(tail);
        }
        let Some(front) = s.recv.front_mut() else {
            if s.recv_half == RecvHalf::Open {
                s.readable_notified = false;
                return Ok(ReadResult::Blocked);
            }
            s.recv_half = RecvHalf::FinRead;
            if self.phase == Phase::Closed {
                self.remove_stream(id.0, Tomb::Done);
            } else {
                self.maybe_forget(id.0);
                self.after_op();
            }
            return Ok(ReadResult::Finished);
        };
        let data = if front.len() <= max {
            s.recv.pop_front().unwrap_or_default()
        } else {
            front.split_to(max)
        };
        s.recv_buffered -= data.len();
        let mut grant = None;
        if s.recv_half == RecvHalf::Open {
            if s.recv.is_empty() && s.recv_tail.is_empty() {
                s.readable_notified = false;
            }
            // No credit after FIN: the peer sends nothing more on this stream.
            s.recv_unacked = s.recv_unacked.saturating_add(len_u32(data.len()));
            if s.recv_unacked >= (s.recv_target / 2).max(1) {
                let mut increment = s.recv_unacked;
                // Half the window read within two round trips: the window, not the reader, is the limit.
                if s.recv_target < max_window && now.saturating_duration_since(s.last_grant) < fast
                {
                    grew = s.recv_target.min(max_window - s.recv_target).min(budget);
                    s.recv_target += grew;
                    increment = increment.saturating_add(grew);
                }
                s.last_grant = now;
                grant = Some(increment);
                s.recv_window = s.recv_window.saturating_add(increment);
                s.recv_unacked = 0;
            }
        }
        self.grown += grew;
        if let Some(increment) = grant {
            self.control.push_back(Frame::WindowUpdate {
                stream: id,
                increment,
            });
        }
        Ok(ReadResult::Data(data))
    }

    /// Abruptly ends the stream in both directions and forgets it.
    pub fn reset(&mut self, id: StreamId, code: u32) {
        if self.remove_stream(id.0, Tomb::Reset(code)).is_some() && self.phase != Phase::Closed {
            self.control.push_back(Frame::Reset { stream: id, code });
        }
        self.after_op();
    }

    /// Graceful shutdown: GOAWAY is sent, no new streams are accepted, open streams may finish; the session
    /// closes when the last stream is done.
    ///
    /// Use code NO_ERROR or SHUTDOWN: the peer treats any other GOAWAY code as an immediate close. We open no
    /// new streams either.
    pub fn go_away(&mut self, code: u32, reason: &str) {
        if self.phase == Phase::Closed || self.local_goaway.is_some() {
            return;
        }
        let last_stream = StreamId(self.max_peer_id);
        self.local_goaway = Some(last_stream);
        self.control.push_back(Frame::GoAway {
            last_stream,
            code,
            reason: reason_bytes(reason),
        });
        self.after_op();
    }

    /// Immediate close: GOAWAY with `code`, every stream failed.
    pub fn close(&mut self, code: u32, reason: &str) {
        let error = (code != code::NO_ERROR).then(|| ConnectionError::ClosedLocally {
            code,
            reason: reason.to_owned(),
        });
        self.shut(Some((code, reason)), error);
    }

    /// True once the session is over and nothing remains to be sent.
    pub fn is_closed(&self) -> bool {
        self.phase == Phase::Closed && self.control.is_empty()
    }

    /// Smoothed round-trip time measured by PING, if any was answered.
    pub fn rtt(&self) -> Option<Duration> {
        self.srtt
    }

    /// Counters.
    pub fn stats(&self) -> Stats {
        Stats {
            open_streams: len_u32(self.streams.len()),
            ..self.stats
        }
    }

    /// The protocol version agreed with the peer, once its HELLO arrived.
    pub fn version(&self) -> Option<u16> {
        self.version
    }

    /// The peer's SETTINGS, once received.
    pub fn peer_settings(&self) -> Option<Settings> {
        self.peer
    }

    /// True while new peer streams are refused with [`code::OVERLOADED`] (see [`SHED_PERIOD`]).
    pub fn shedding(&self, now: Instant) -> bool {
        self.shed_until.is_some_and(|until| now < until)
    }

    /// Where a stream is in its life; None once it is forgotten (or never existed).
    pub fn stream_state(&self, id: StreamId) -> Option<StreamState> {
        self.streams.get(&id.0).map(Stream::state)
    }

    /// Puts a stream in its ready queue if the scheduler could send something for it.
    fn schedule(&mut self, id: u32) {
        let Some(s) = self.streams.get_mut(&id) else {
            return;
        };
        if s.queued || !s.sendable() {
            return;
        }
        s.queued = true;
        match s.priority {
            Priority::Control => self.ready_control.push_back(id),
            Priority::Normal => self.ready_normal.push_back(id),
        }
    }

    fn maybe_forget(&mut self, id: u32) {
        if self.streams.get(&id).is_some_and(Stream::is_done) {
            self.remove_stream(id, Tomb::Done);
        }
    }

    /// Forgets a stream (its unread data's connection credit was returned when the data arrived).
    fn remove_stream(&mut self, id: u32, tomb: Tomb) -> Option<Stream> {
        let s = self.streams.remove(&id)?;
        self.grown = self.grown.saturating_sub(
            s.recv_target
                .saturating_sub(self.config.initial_stream_window),
        );
        if s.local {
            self.local_count = self.local_count.saturating_sub(1);
        } else {
            self.peer_count = self.peer_count.saturating_sub(1);
        }
        if let Answer::Opening { deadline: Some(d) } = s.answer {
            self.deadlines.remove(&(d, id));
        }
        if self.tombstones.len() >= TOMBSTONES {
            self.tombstones.pop_front();
        }
        self.tombstones.push_back((id, tomb));
        Some(s)
    }

    /// Counts `n` received bytes as consumed and grants connection credit back once half the window is.
    fn release_conn_credit(&mut self, n: usize) {
        self.conn_recv_unacked = self.conn_recv_unacked.saturating_add(len_u32(n));
        if self.conn_recv_unacked >= (self.config.connection_window / 2).max(1)
            && self.phase != Phase::Closed
        {
            let increment = self.conn_recv_unacked;
            self.conn_recv_unacked = 0;
            self.conn_recv_window = self.conn_recv_window.saturating_add(increment);
            self.control.push_back(Frame::WindowUpdate {
                stream: StreamId(0),
                increment,
            });
        }
    }

    /// Closes the session once a GOAWAY (sent or received) has drained every stream.
    fn after_op(&mut self) {
        let draining = self.local_goaway.is_some() || self.peer_goaway.is_some();
        if self.phase != Phase::Closed && draining && self.streams.is_empty() {
            self.phase = Phase::Closed;
            self.events.push_back(Event::Closed { error: None });
        }
    }

    fn fatal(&mut self, code: u32, reason: &str) {
        let error = ConnectionError::ProtocolViolation {
            code,
            reason: reason.to_owned(),
        };
        self.shut(Some((code, reason)), Some(error));
    }

    /// Ends the session because the peer went away: like [`Session::shut`] without a GOAWAY, except that
    /// streams whose peer FIN arrived keep their received data for the application to read.
    fn shut_keeping_received(&mut self, error: Option<ConnectionError>) {
        let keep: Vec<(u32, Stream)> = self
            .streams
            .drain()
            .filter(|(_, s)| s.recv_half == RecvHalf::FinReceived)
            .map(|(id, mut s)| {
                s.chunks.clear();
                s.send_buffered = 0;
                s.send = SendHalf::FinSent;
                (id, s)
            })
            .collect();
        self.shut(None, error);
        self.streams.extend(keep);
    }

    /// Ends the session now: queued control frames other than the handshake are dropped, `goaway` is queued,
    /// every stream is failed and [`Event::Closed`] is the last event.
    fn shut(&mut self, goaway: Option<(u32, &str)>, error: Option<ConnectionError>) {
        if self.phase == Phase::Closed {
            return;
        }
        self.phase = Phase::Closed;
        self.control
            .retain(|f| matches!(f, Frame::Hello { .. } | Frame::Settings(_)));
        // Every ending but a drained GOAWAY comes here (that one leaves no live stream to accept).
        self.deferred.clear();
        self.deferred_due = None;
        self.pending_pongs = 0;
        if let Some((code, reason)) = goaway {
            let last_stream = StreamId(self.max_peer_id);
            self.control.push_back(Frame::GoAway {
                last_stream,
                code,
                reason: reason_bytes(reason),
            });
        }
        self.streams.clear();
        self.grown = 0;
        self.deadlines.clear();
        self.ready_control.clear();
        self.ready_normal.clear();
        self.rx = BytesMut::new();
        self.events.push_back(Event::Closed { error });
    }
}

/// Why stream `id`, not in the map, cannot be used: finished, reset, the connection closed, or never seen.
fn gone(tombstones: &VecDeque<(u32, Tomb)>, closed: bool, id: StreamId) -> StreamError {
    let tomb = tombstones
        .iter()
        .rev()
        .find(|(t, _)| *t == id.0)
        .map(|&(_, tomb)| tomb);
    match tomb {
        Some(Tomb::Done) => StreamError::Finished,
        _ if closed => StreamError::ConnectionClosed,
        Some(Tomb::Reset(code)) => StreamError::Reset(code),
        None => StreamError::UnknownStream(id),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn connected_client(peer: Settings) -> (Session, Instant) {
        let now = Instant::now();
        let mut s = Session::new(Config::new(Role::Client), now);
        let mut wire = BytesMut::new();
        Frame::Hello {
            min_version: 1,
            max_version: 1,
        }
        .encode(&mut wire);
        Frame::Settings(peer).encode(&mut wire);
        s.handle_input(now, wire.freeze());
        while s.poll_transmit(now).is_some() {}
        (s, now)
    }

    #[test]
    fn whole_chunks_are_sent_without_a_copy() {
        let (mut s, now) = connected_client(Settings::default());
        let id = s
            .open_stream(now, 1, Priority::Normal, None, Bytes::new())
            .expect("open");
        assert!(s.poll_transmit(now).is_some(), "OPEN");
        s.write(id, &[7; 1000]).expect("write");
        let chunk_ptr = s.streams[&id.0].chunks[0].as_ptr() as usize;
        let frame = s.poll_transmit(now).expect("DATA");
        assert_eq!(frame.len(), FrameHeader::LEN + 1000);
        assert_eq!(
            frame.as_ptr() as usize,
            chunk_ptr,
            "the frame is the chunk, header in its headroom"
        );
    }

    #[test]
    fn small_writes_coalesce_and_big_ones_split_at_the_quantum() {
        let (mut s, now) = connected_client(Settings::default());
        let id = s
            .open_stream(now, 1, Priority::Normal, None, Bytes::new())
            .expect("open");
        for _ in 0..10 {
            s.write(id, b"0123456789").expect("write");
        }
        assert_eq!(s.streams[&id.0].chunks.len(), 1);
        s.write(id, &[0; 100_000]).expect("write");
        let sizes: Vec<usize> = s.streams[&id.0]
            .chunks
            .iter()
            .map(|c| c.len() - FrameHeader::LEN)
            .collect();
        assert!(sizes.iter().all(|&n| n <= QUANTUM), "{sizes:?}");
        assert_eq!(sizes.iter().sum::<usize>(), 100_100);
    }

    #[test]
    fn a_chunk_split_by_credit_keeps_its_headroom() {
        let peer = Settings {
            initial_stream_window: 300,
            ..Settings::default()
        };
        let (mut s, now) = connected_client(peer);
        let id = s
            .open_stream(now, 1, Priority::Normal, None, Bytes::new())
            .expect("open");
        assert!(s.poll_transmit(now).is_some(), "OPEN");
        let data: Vec<u8> = (0..1000u32).map(|i| i as u8).collect();
        s.write(id, &data).expect("write");
        s.finish(id).expect("finish");
        let mut wire = s.poll_transmit(now).expect("first 300 bytes");
        assert_eq!(s.poll_transmit(now), None, "out of stream credit");
        let mut wu = BytesMut::new();
        Frame::WindowUpdate {
            stream: id,
            increment: 700,
        }
        .encode(&mut wu);
        s.handle_input(now, wu.freeze());
        let chunk_ptr = s.streams[&id.0].chunks[0].as_ptr() as usize;
        let rest = s.poll_transmit(now).expect("rest");
        assert_eq!(
            rest.as_ptr() as usize,
            chunk_ptr,
            "the remainder went out without a copy"
        );
        let mut got = Vec::new();
        let mut fin = false;
        for mut bytes in [wire.split_off(0), rest] {
            while let Some(Frame::Data {
                payload, fin: f, ..
            }) = Frame::decode(&mut bytes, 1 << 20).expect("decode")
            {
                got.extend_from_slice(&payload);
                fin = f;
            }
        }
        assert_eq!(got, data);
        assert!(fin);
    }

    #[test]
    fn frames_respect_the_peer_max_frame_size() {
        let peer = Settings {
            max_frame_size: MIN_MAX_FRAME_SIZE,
            ..Settings::default()
        };
        let (mut s, now) = connected_client(peer);
        let id = s
            .open_stream(now, 1, Priority::Normal, None, Bytes::new())
            .expect("open");
        s.write(id, &[1; 200_000]).expect("write");
        while let Some(mut chunk) = s.poll_transmit(now) {
            while let Some(f) =
                Frame::decode(&mut chunk, MIN_MAX_FRAME_SIZE).expect("within the peer's limit")
            {
                assert!(f.encoded_len() - FrameHeader::LEN <= MIN_MAX_FRAME_SIZE as usize);
            }
        }
    }
}
