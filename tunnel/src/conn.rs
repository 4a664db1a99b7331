//! Transport-independent connection and stream handles, and the task that drives a [`Session`].
//!
//! A [`SessionConnection`] is an `Arc` of one shared state (the session behind a mutex, plus per-stream wakers and
//! status) and one driver task per connection. SessionStream operations lock the state, call the session, and
//! wake the driver when the session may have something to send; the driver pumps bytes between the session
//! and a [`Transport`], fires the session timer, and turns session events into wake-ups. The mutex is never
//! held across an `.await`.

use std::collections::VecDeque;
use std::future::Future;
use std::io;
use std::pin::Pin;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::task::{Context, Poll, Waker, ready};
use std::time::{Duration, Instant};

use bytes::Bytes;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::sync::Notify;
use tokio::time::Sleep;

use tether_proto::{
    ConnectionError, Event, OpenError, Priority, ReadResult, Session, StreamError, StreamId,
    StreamMap, code,
};

use crate::SessionConfig;
use crate::cork::Cork;

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
    /// True when trying again (on this or a new tunnel) may succeed: too many streams, a closed tunnel, and
    /// a reset or refusal because the peer is shutting down (or, for a refusal, has too many streams or is
    /// shedding load).
    pub fn is_retryable(&self) -> bool {
        match self {
            TunnelError::TooManyStreams | TunnelError::Closed(_) => true,
            TunnelError::Reset(c) => *c == code::SHUTDOWN,
            TunnelError::Refused { code: c, .. } => {
                *c == code::SHUTDOWN
                    || *c == code::REFUSED_TOO_MANY_STREAMS
                    || *c == code::OVERLOADED
            }
            TunnelError::TimedOut(_) => false,
        }
    }

    fn from_stream_error(e: StreamError, closed: &Option<CloseInfo>) -> Self {
        match e {
            StreamError::Reset(c) => TunnelError::Reset(c),
            StreamError::ConnectionClosed => TunnelError::Closed(close_reason(closed)),
            // The session forgot the stream; the reason was recorded when its event arrived, so reaching
            // this means it vanished without one: report it as cancelled.
            StreamError::UnknownStream(_) => TunnelError::Reset(code::CANCEL),
            StreamError::Finished => TunnelError::Closed("stream already finished".to_owned()),
            StreamError::InvalidState(what) => {
                TunnelError::Closed(format!("invalid stream state: {what}"))
            }
        }
    }
}

impl From<TunnelError> for io::Error {
    fn from(e: TunnelError) -> Self {
        let kind = match e {
            TunnelError::Reset(_) => io::ErrorKind::ConnectionReset,
            TunnelError::Refused { .. } => io::ErrorKind::ConnectionRefused,
            TunnelError::TimedOut(_) => io::ErrorKind::TimedOut,
            TunnelError::Closed(_) => io::ErrorKind::ConnectionAborted,
            TunnelError::TooManyStreams => io::ErrorKind::Other,
        };
        io::Error::new(kind, e)
    }
}

fn close_reason(closed: &Option<CloseInfo>) -> String {
    match closed {
        Some(CloseInfo { error: Some(e) }) => e.to_string(),
        Some(CloseInfo { error: None }) => "connection closed".to_owned(),
        None => "connection closing".to_owned(),
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

/// What the driver needs from a byte transport. The WebSocket transport implements it in [`crate::ws`];
/// a message-oriented transport maps one message to one chunk.
pub(crate) trait Transport: Send + Unpin + 'static {
    /// Largest chunk [`Transport::start_send`] accepts; larger session output is split (the peer's decoder
    /// is streaming, so chunk boundaries do not matter).
    const MAX_CHUNK: usize;

    /// The next chunk of bytes from the peer, or why there is none.
    fn poll_recv(&mut self, cx: &mut Context<'_>) -> Poll<Recv>;

    /// Ready to take a chunk with [`Transport::start_send`].
    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<()>>;

    /// Queues one chunk (at most [`Transport::MAX_CHUNK`] bytes).
    fn start_send(&mut self, chunk: Bytes) -> io::Result<()>;

    /// Writes out everything queued.
    fn poll_flush(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<()>>;

    /// Closes the transport in an orderly way (sending `violation` as the reason if the peer misbehaved at
    /// the transport level), discarding anything still received. Errors are not interesting at this point.
    fn poll_close(&mut self, cx: &mut Context<'_>, violation: Option<&str>) -> Poll<()>;
}

/// What [`Transport::poll_recv`] found.
pub(crate) enum Recv {
    /// Bytes for the session.
    Data(Bytes),
    /// The peer closed the transport (orderly close or EOF).
    Closed,
    /// The transport failed.
    Failed(String),
    /// The peer broke the transport's rules (e.g. a text WebSocket message).
    Violation(String),
}

/// How long the driver keeps trying to close the transport politely once the session is over.
const CLOSE_LINGER: Duration = Duration::from_secs(5);

/// How many transport reads the driver handles in one poll before yielding to other tasks.
const READ_BUDGET: usize = 64;

fn now() -> Instant {
    tokio::time::Instant::now().into_std()
}

/// Per-stream state kept beside the session (which forgets streams once they end).
struct Slot {
    read_waker: Option<Waker>,
    write_waker: Option<Waker>,
    /// Resolves [`SessionStreamControl::accepted`] waiters.
    notify: Arc<Notify>,
    answer: Answer,
    /// Set once the stream can no longer be used: reads and writes fail with it.
    failed: Option<TunnelError>,
    /// The deadline we asked for, to report [`TunnelError::TimedOut`].
    deadline: Option<Duration>,
}

enum Answer {
    Pending,
    Accepted(Bytes),
    Failed(TunnelError),
}

impl Slot {
    fn new(answer: Answer, deadline: Option<Duration>) -> Self {
        Self {
            read_waker: None,
            write_waker: None,
            notify: Arc::new(Notify::new()),
            answer,
            failed: None,
            deadline,
        }
    }

    fn fail(&mut self, error: TunnelError) {
        if self.failed.is_none() {
            self.failed = Some(error.clone());
        }
        if matches!(self.answer, Answer::Pending) {
            self.answer = Answer::Failed(error);
        }
        // Wakes both `accepted` and `failed` waiters.
        self.notify.notify_waiters();
        self.wake();
    }

    fn wake(&mut self) {
        if let Some(w) = self.read_waker.take() {
            w.wake();
        }
        if let Some(w) = self.write_waker.take() {
            w.wake();
        }
    }
}

/// A stream the peer opened that nobody took with [`SessionConnection::accept`] yet.
struct Queued {
    id: StreamId,
    kind: u16,
    priority: Priority,
    deadline: Option<Instant>,
    metadata: Bytes,
}

struct State {
    session: Session,
    streams: StreamMap<StreamId, Slot>,
    incoming: VecDeque<Queued>,
    /// Registered by the driver at the start of each poll; taken (and woken) by whoever gives the session
    /// something to do.
    driver_waker: Option<Waker>,
    /// We stopped taking new streams (local go-away or close).
    going_away: bool,
    /// The peer sent GOAWAY: it will not open new streams.
    peer_going_away: bool,
    /// The session reported [`Event::Closed`].
    closed: Option<CloseInfo>,
    /// The driver is done: the session is closed and the transport flushed and closed (or dead).
    finished: bool,
}

impl State {
    fn wake_driver(&mut self) {
        if let Some(w) = self.driver_waker.take() {
            w.wake();
        }
    }

    /// Refuses every queued incoming stream (we are going away or nobody is left to accept them).
    fn refuse_queued(&mut self, reason: &str) {
        while let Some(q) = self.incoming.pop_front() {
            let _ = self.session.refuse_stream(q.id, code::SHUTDOWN, reason);
        }
    }

    fn handle_event(&mut self, event: Event, notify: &Notify) {
        match event {
            Event::Connected { version } => tracing::debug!(version, "tunnel session established"),
            Event::StreamOpened {
                id,
                kind,
                priority,
                deadline,
                metadata,
            } => {
                if self.going_away {
                    let _ =
                        self.session
                            .refuse_stream(id, code::SHUTDOWN, "connection is going away");
                } else {
                    self.incoming.push_back(Queued {
                        id,
                        kind,
                        priority,
                        deadline,
                        metadata,
                    });
                    notify.notify_waiters();
                }
            }
            Event::StreamAccepted { id, metadata } => {
                if let Some(slot) = self.streams.get_mut(&id)
                    && matches!(slot.answer, Answer::Pending)
                {
                    slot.answer = Answer::Accepted(metadata);
                    slot.notify.notify_waiters();
                }
            }
            Event::StreamRefused { id, code, reason } => {
                self.fail_stream(id, TunnelError::Refused { code, reason })
            }
            Event::StreamTimedOut { id } => {
                let waited = self
                    .streams
                    .get(&id)
                    .and_then(|s| s.deadline)
                    .unwrap_or_default();
                self.fail_stream(id, TunnelError::TimedOut(waited));
            }
            Event::StreamReset { id, code } => self.fail_stream(id, TunnelError::Reset(code)),
            Event::Readable { id } => {
                if let Some(w) = self.streams.get_mut(&id).and_then(|s| s.read_waker.take()) {
                    w.wake();
                }
            }
            Event::Writable { id } => {
                if let Some(w) = self.streams.get_mut(&id).and_then(|s| s.write_waker.take()) {
                    w.wake();
                }
            }
            Event::GoAway {
                last_stream,
                code,
                reason,
            } => {
                tracing::debug!(?last_stream, code, %reason, "peer is going away");
                self.peer_going_away = true;
                notify.notify_waiters();
            }
            Event::Closed { error } => {
                match &error {
                    None => tracing::debug!("tunnel session closed"),
                    Some(e) => tracing::debug!(error = %e, "tunnel session closed with an error"),
                }
                self.closed = Some(CloseInfo { error });
                self.fail_dead_streams();
                notify.notify_waiters();
            }
        }
    }

    /// Once the session is closed, fails every stream it no longer knows. Streams whose data all arrived
    /// (the peer finished) are kept by the session and stay readable to the end.
    fn fail_dead_streams(&mut self) {
        self.incoming.clear();
        let reason = close_reason(&self.closed);
        let session = &self.session;
        for (id, slot) in self.streams.iter_mut() {
            if session.stream_state(*id).is_none() {
                slot.fail(TunnelError::Closed(reason.clone()));
            } else {
                slot.wake();
            }
        }
    }

    fn fail_stream(&mut self, id: StreamId, error: TunnelError) {
        if let Some(slot) = self.streams.get_mut(&id) {
            slot.fail(error);
        } else {
            // Not taken by `accept` yet: forget it.
            self.incoming.retain(|q| q.id != id);
        }
    }
}

/// The state shared by handles and the driver.
struct Shared {
    state: Mutex<State>,
    /// Wakes `accept()` waiters (a stream arrived, the connection is going away or closed).
    notify: Notify,
    /// Wakes `closed()` waiters, once, when the connection has ended. Apart from `notify` because every
    /// stream's task may wait in `closed()`: waking them all at each new stream cost O(open streams) per
    /// stream opened (3,000 idle watches made each GET wake 3,000 tasks).
    closed_notify: Notify,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, State> {
        // A panic while holding the lock leaves the session in some state; later calls report whatever
        // that state says rather than propagating the panic to every handle.
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

/// One per connection, shared by `SessionConnection` clones, streams and incoming streams: when the last one goes,
/// nobody can use the connection any more and it is shut down.
struct Handle {
    shared: Arc<Shared>,
}

impl Drop for Handle {
    fn drop(&mut self) {
        let mut st = self.shared.lock();
        if st.closed.is_none() {
            st.refuse_queued("connection dropped");
            if !st.going_away {
                st.going_away = true;
                st.session.go_away(code::NO_ERROR, "connection dropped");
            }
            st.wake_driver();
        }
    }
}

/// A tunnel connection. Cheap to clone; all clones are the same connection. Dropping every clone and every
/// stream closes it.
#[derive(Clone)]
pub(crate) struct SessionConnection {
    handle: Arc<Handle>,
}

impl SessionConnection {
    /// Starts a connection: a session with `config` and a driver task pumping it over the transport that
    /// `transport` resolves to. Must be called within a Tokio runtime.
    pub(crate) fn spawn<T, F>(config: SessionConfig, transport: F) -> SessionConnection
    where
        T: Transport,
        F: Future<Output = T> + Send + 'static,
    {
        let state = State {
            session: Session::new(config, now()),
            streams: StreamMap::default(),
            incoming: VecDeque::new(),
            driver_waker: None,
            going_away: false,
            peer_going_away: false,
            closed: None,
            finished: false,
        };
        let shared = Arc::new(Shared {
            state: Mutex::new(state),
            notify: Notify::new(),
            closed_notify: Notify::new(),
        });
        let driver_shared = shared.clone();
        tokio::spawn(async move {
            let transport = transport.await;
            Driver::new(driver_shared, transport).await;
        });
        SessionConnection {
            handle: Arc::new(Handle { shared }),
        }
    }

    fn shared(&self) -> &Shared {
        &self.handle.shared
    }

    /// Opens a stream. Returns at once: data may be written before the peer accepts. Use
    /// [`SessionStreamControl::accepted`] to wait for the answer.
    pub(crate) fn open(&self, options: OpenOptions) -> Result<SessionStream, TunnelError> {
        let mut st = self.shared().lock();
        let opened = st.session.open_stream(
            now(),
            options.kind,
            options.priority,
            options.deadline,
            options.metadata,
        );
        let id = match opened {
            Ok(id) => id,
            Err(OpenError::TooManyStreams(_)) => return Err(TunnelError::TooManyStreams),
            Err(OpenError::Closing) => return Err(TunnelError::Closed(close_reason(&st.closed))),
            Err(OpenError::IdsExhausted) => {
                return Err(TunnelError::Closed(
                    "stream ids exhausted, open a new connection".to_owned(),
                ));
            }
            Err(OpenError::MetadataTooLarge) => {
                return Err(TunnelError::Refused {
                    code: code::REFUSED,
                    reason: "stream metadata larger than the session allows".to_owned(),
                });
            }
        };
        let slot = Slot::new(Answer::Pending, options.deadline);
        let notify = slot.notify.clone();
        st.streams.insert(id, slot);
        st.wake_driver();
        drop(st);
        Ok(SessionStream::new(self.handle.clone(), id, notify))
    }

    /// The next stream the peer opened, or `None` once the connection is closed or going away.
    pub(crate) async fn accept(&self) -> Option<SessionIncoming> {
        loop {
            let notified = self.shared().notify.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            {
                let mut st = self.shared().lock();
                if let Some(q) = st.incoming.pop_front() {
                    let slot = Slot::new(Answer::Pending, None);
                    let notify = slot.notify.clone();
                    st.streams.insert(q.id, slot);
                    drop(st);
                    return Some(SessionIncoming {
                        kind: q.kind,
                        priority: q.priority,
                        deadline: q.deadline,
                        metadata: q.metadata,
                        id: q.id,
                        inner: Some(Arc::new(StreamInner {
                            id: q.id,
                            handle: self.handle.clone(),
                            notify,
                        })),
                    });
                }
                if st.going_away || st.peer_going_away || st.closed.is_some() {
                    return None;
                }
            }
            notified.await;
        }
    }

    /// Graceful shutdown: no new streams; resolves [`SessionConnection::closed`] once open streams finish. Streams
    /// the peer opened that were not accepted yet are refused with code SHUTDOWN (retryable elsewhere).
    pub(crate) fn go_away(&self, code: u32, reason: &str) {
        let mut st = self.shared().lock();
        if st.closed.is_none() && !st.going_away {
            st.going_away = true;
            st.refuse_queued(reason);
            st.session.go_away(code, reason);
        }
        st.wake_driver();
        drop(st);
        self.shared().notify.notify_waiters();
    }

    /// Immediate close: every stream fails.
    pub(crate) fn close(&self, code: u32, reason: &str) {
        let mut st = self.shared().lock();
        st.going_away = true;
        st.session.close(code, reason);
        st.wake_driver();
        drop(st);
        self.shared().notify.notify_waiters();
    }

    /// Resolves when the connection has ended: the session is closed and what it had to send was flushed
    /// (or the transport died).
    pub(crate) async fn closed(&self) -> CloseInfo {
        loop {
            let notified = self.shared().closed_notify.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            {
                let st = self.shared().lock();
                if st.finished {
                    return st.closed.clone().unwrap_or(CloseInfo {
                        error: Some(ConnectionError::TransportClosed),
                    });
                }
            }
            notified.await;
        }
    }

    /// True once the connection has ended.
    pub(crate) fn is_closed(&self) -> bool {
        let st = self.shared().lock();
        st.finished || st.closed.is_some()
    }

    /// Smoothed round-trip time measured by the protocol's pings.
    pub(crate) fn rtt(&self) -> Option<Duration> {
        self.shared().lock().session.rtt()
    }

    /// Number of streams currently open.
    pub(crate) fn open_streams(&self) -> usize {
        self.shared().lock().session.stats().open_streams as usize
    }

    /// Protocol counters (frames and bytes in and out, open streams).
    pub(crate) fn stats(&self) -> tether_proto::Stats {
        self.shared().lock().session.stats()
    }
}

impl std::fmt::Debug for SessionConnection {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SessionConnection").finish_non_exhaustive()
    }
}

/// What `SessionStream`, `SessionStreamControl` and `SessionIncoming` share; the stream's slot goes when the last one does.
struct StreamInner {
    id: StreamId,
    handle: Arc<Handle>,
    notify: Arc<Notify>,
}

impl StreamInner {
    fn shared(&self) -> &Shared {
        &self.handle.shared
    }
}

impl Drop for StreamInner {
    fn drop(&mut self) {
        self.shared().lock().streams.remove(&self.id);
    }
}

/// A stream the peer opened, waiting for an answer. Dropping it unanswered refuses it (code REFUSED).
pub(crate) struct SessionIncoming {
    /// Its kind (see [`crate::kind`]).
    pub(crate) kind: u16,
    /// Its scheduling class.
    pub(crate) priority: Priority,
    /// When the opener stops waiting.
    pub(crate) deadline: Option<Instant>,
    /// Opaque metadata from the opener.
    pub(crate) metadata: Bytes,
    id: StreamId,
    /// `None` once answered.
    inner: Option<Arc<StreamInner>>,
}

impl SessionIncoming {
    /// The stream id (for logs).
    pub(crate) fn id(&self) -> StreamId {
        self.id
    }

    /// Accepts the stream; with `hold`, the ACCEPT waits up to that long for other output to leave with
    /// ([`tether_proto::Session::accept_stream_deferred`]).
    pub(crate) fn accept(
        mut self,
        metadata: Bytes,
        hold: Option<Duration>,
    ) -> Result<SessionStream, TunnelError> {
        let Some(inner) = self.inner.take() else {
            return Err(TunnelError::Closed("stream already answered".to_owned()));
        };
        let mut st = inner.shared().lock();
        let closed = st.closed.clone();
        let failed = st.streams.get(&inner.id).and_then(|s| s.failed.clone());
        if let Some(e) = failed {
            return Err(e);
        }
        let accepted = match hold {
            Some(hold) => {
                st.session
                    .accept_stream_deferred(inner.id, metadata.clone(), now() + hold)
            }
            None => st.session.accept_stream(inner.id, metadata.clone()),
        };
        if let Err(e) = accepted {
            return Err(TunnelError::from_stream_error(e, &closed));
        }
        if let Some(slot) = st.streams.get_mut(&inner.id) {
            slot.answer = Answer::Accepted(metadata);
        }
        st.wake_driver();
        drop(st);
        Ok(SessionStream {
            inner,
            finished: false,
            eof: false,
        })
    }

    /// Refuses the stream with a code and reason.
    pub(crate) fn refuse(mut self, code: u32, reason: &str) {
        if let Some(inner) = self.inner.take() {
            refuse(&inner, code, reason);
        }
    }
}

fn refuse(inner: &StreamInner, code: u32, reason: &str) {
    let mut st = inner.shared().lock();
    let _ = st.session.refuse_stream(inner.id, code, reason);
    st.wake_driver();
}

impl Drop for SessionIncoming {
    fn drop(&mut self) {
        if let Some(inner) = self.inner.take() {
            refuse(&inner, code::REFUSED, "not accepted");
        }
    }
}

impl std::fmt::Debug for SessionIncoming {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SessionIncoming")
            .field("id", &self.id())
            .field("kind", &self.kind)
            .field("priority", &self.priority)
            .field("deadline", &self.deadline)
            .field("metadata_len", &self.metadata.len())
            .finish()
    }
}

/// One logical byte stream. `shutdown()` half-closes our side (the peer reads EOF); dropping a stream that
/// was not finished and fully read resets it (code CANCEL).
///
/// `poll_flush` returns at once: written bytes are in the session, which sends them without further calls
/// (as quinn's streams do).
pub(crate) struct SessionStream {
    inner: Arc<StreamInner>,
    /// We called `finish` (shutdown).
    finished: bool,
    /// We read the peer's end of data.
    eof: bool,
}

impl SessionStream {
    fn new(handle: Arc<Handle>, id: StreamId, notify: Arc<Notify>) -> Self {
        Self {
            inner: Arc::new(StreamInner { id, handle, notify }),
            finished: false,
            eof: false,
        }
    }

    /// A handle to watch or reset the stream while another task owns the reader/writer.
    pub(crate) fn control(&self) -> SessionStreamControl {
        SessionStreamControl {
            inner: self.inner.clone(),
        }
    }

    /// The stream id (for logs).
    pub(crate) fn id(&self) -> StreamId {
        self.inner.id
    }
}

impl std::fmt::Debug for SessionStream {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SessionStream")
            .field("id", &self.inner.id)
            .field("finished", &self.finished)
            .field("eof", &self.eof)
            .finish()
    }
}

impl Drop for SessionStream {
    fn drop(&mut self) {
        if self.finished && self.eof {
            return;
        }
        let mut st = self.inner.shared().lock();
        let already_failed = st
            .streams
            .get(&self.inner.id)
            .is_some_and(|s| s.failed.is_some());
        if !already_failed {
            // After a close this only frees data the session kept for us; nothing is sent.
            st.session.reset(self.inner.id, code::CANCEL);
            st.wake_driver();
        }
    }
}

/// A handle on a stream that does not own its bytes. Cheap to clone.
#[derive(Clone)]
pub(crate) struct SessionStreamControl {
    inner: Arc<StreamInner>,
}

impl SessionStreamControl {
    /// Waits for the peer's answer to a stream we opened: accept metadata, or why it failed
    /// (refused, timed out, reset, tunnel closed). Resolves at once for streams the peer opened (with the
    /// metadata we accepted them with).
    pub(crate) async fn accepted(&self) -> Result<Bytes, TunnelError> {
        loop {
            let notified = self.inner.notify.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            {
                let st = self.inner.shared().lock();
                match st.streams.get(&self.inner.id).map(|s| &s.answer) {
                    Some(Answer::Accepted(metadata)) => return Ok(metadata.clone()),
                    Some(Answer::Failed(e)) => return Err(e.clone()),
                    Some(Answer::Pending) => {}
                    None => return Err(TunnelError::Reset(code::CANCEL)),
                }
            }
            notified.await;
        }
    }

    /// Waits until the stream can no longer be used — reset (by the peer or by us), refused, timed out, or
    /// its tunnel closed — and returns why. Stays pending while the stream is usable, and forever once it
    /// has ended normally and is gone. Lets a task that waits on something else (an upstream answer) stop as
    /// soon as nobody is left to give the answer to.
    pub(crate) async fn failed(&self) -> TunnelError {
        loop {
            let notified = self.inner.notify.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            let failed = {
                let st = self.inner.shared().lock();
                st.streams
                    .get(&self.inner.id)
                    .map(|slot| slot.failed.clone())
            };
            match failed {
                Some(Some(e)) => return e,
                Some(None) => {}
                None => return std::future::pending().await,
            }
            notified.await;
        }
    }

    /// Resets the stream: both directions fail at once, here with [`TunnelError::Reset`], at the peer too.
    pub(crate) fn reset(&self, code: u32) {
        let mut st = self.inner.shared().lock();
        let Some(slot) = st.streams.get_mut(&self.inner.id) else {
            return;
        };
        if slot.failed.is_some() {
            return;
        }
        slot.fail(TunnelError::Reset(code));
        if st.closed.is_none() {
            st.session.reset(self.inner.id, code);
            st.wake_driver();
        }
    }

    /// The stream id (for logs).
    pub(crate) fn id(&self) -> StreamId {
        self.inner.id
    }
}

impl std::fmt::Debug for SessionStreamControl {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SessionStreamControl")
            .field("id", &self.inner.id)
            .finish()
    }
}

impl SessionStream {
    /// Takes up to `max` received bytes as the session holds them (slices of the tunnel's messages, no
    /// copy); empty at the end of the stream. What [`AsyncRead::poll_read`] copies out of.
    pub(crate) fn poll_take(
        &mut self,
        cx: &mut Context<'_>,
        max: usize,
    ) -> Poll<io::Result<Bytes>> {
        if self.eof || max == 0 {
            return Poll::Ready(Ok(Bytes::new()));
        }
        let id = self.inner.id;
        let mut guard = self.inner.shared().lock();
        let st = &mut *guard;
        let Some(slot) = st.streams.get_mut(&id) else {
            return Poll::Ready(Err(TunnelError::Reset(code::CANCEL).into()));
        };
        if let Some(e) = &slot.failed {
            return Poll::Ready(Err(e.clone().into()));
        }
        match st.session.read(now(), id, max) {
            Ok(ReadResult::Data(data)) => {
                // Reading grants the peer credit: the session may have a window update to send.
                st.wake_driver();
                Poll::Ready(Ok(data))
            }
            Ok(ReadResult::Finished) => {
                self.eof = true;
                st.wake_driver();
                Poll::Ready(Ok(Bytes::new()))
            }
            Ok(ReadResult::Blocked) => {
                set_waker(&mut slot.read_waker, cx);
                Poll::Pending
            }
            Err(e) => Poll::Ready(Err(TunnelError::from_stream_error(e, &st.closed).into())),
        }
    }
}

impl AsyncRead for SessionStream {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let data = ready!(self.get_mut().poll_take(cx, buf.remaining()))?;
        buf.put_slice(&data);
        Poll::Ready(Ok(()))
    }
}

fn set_waker(slot: &mut Option<Waker>, cx: &Context<'_>) {
    match slot {
        Some(w) if w.will_wake(cx.waker()) => {}
        _ => *slot = Some(cx.waker().clone()),
    }
}

impl AsyncWrite for SessionStream {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        if buf.is_empty() {
            return Poll::Ready(Ok(0));
        }
        if this.finished {
            return Poll::Ready(Err(io::Error::new(
                io::ErrorKind::BrokenPipe,
                "write after shutdown",
            )));
        }
        let id = this.inner.id;
        let mut guard = this.inner.shared().lock();
        let st = &mut *guard;
        let Some(slot) = st.streams.get_mut(&id) else {
            return Poll::Ready(Err(TunnelError::Reset(code::CANCEL).into()));
        };
        if let Some(e) = &slot.failed {
            return Poll::Ready(Err(e.clone().into()));
        }
        match st.session.write(id, buf) {
            // We did not finish it: the session did, as the connection ended.
            Err(StreamError::Finished) => {
                Poll::Ready(Err(TunnelError::Closed(close_reason(&st.closed)).into()))
            }
            Ok(0) => {
                set_waker(&mut slot.write_waker, cx);
                Poll::Pending
            }
            Ok(n) => {
                st.wake_driver();
                Poll::Ready(Ok(n))
            }
            Err(e) => Poll::Ready(Err(TunnelError::from_stream_error(e, &st.closed).into())),
        }
    }

    fn poll_flush(self: Pin<&mut Self>, _cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Poll::Ready(Ok(()))
    }

    fn poll_shutdown(self: Pin<&mut Self>, _cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        if this.finished {
            return Poll::Ready(Ok(()));
        }
        let id = this.inner.id;
        let mut st = this.inner.shared().lock();
        if let Some(e) = st.streams.get(&id).and_then(|s| s.failed.clone()) {
            return Poll::Ready(Err(e.into()));
        }
        match st.session.finish(id) {
            Ok(()) | Err(StreamError::Finished) => {
                this.finished = true;
                st.wake_driver();
                Poll::Ready(Ok(()))
            }
            Err(e) => Poll::Ready(Err(TunnelError::from_stream_error(e, &st.closed).into())),
        }
    }
}

/// Where the driver is in its life.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    /// Pumping bytes both ways.
    Running,
    /// The session is over; closing the transport politely, at most until the linger timer fires.
    Closing,
    /// Done.
    Finished,
}

/// The task that pumps one session over one transport. Hand-written rather than a `select!` loop because
/// reading, writing, the timer and wake-ups all need the transport or the session at once; polling each
/// source in turn from one `poll` is the same thing without the borrow juggling.
struct Driver<T: Transport> {
    shared: Arc<Shared>,
    transport: T,
    phase: Phase,
    /// The session timer, or the close linger in [`Phase::Closing`].
    timer: Pin<Box<Sleep>>,
    timer_armed: Option<Instant>,
    /// The transport said the peer is gone; nothing more to read.
    input_done: bool,
    /// A session chunk, or the rest of one larger than the transport's message limit, waiting for the sink.
    pending: Option<Bytes>,
    /// Chunks were queued since the last flush.
    unflushed: bool,
    /// The peer broke the transport's rules: close with this reason.
    violation: Option<String>,
    /// Holds a batch's first write back until the worker has run what else is ready.
    cork: Cork,
}

impl<T: Transport> Driver<T> {
    fn new(shared: Arc<Shared>, transport: T) -> Self {
        Self {
            shared,
            transport,
            phase: Phase::Running,
            timer: Box::pin(tokio::time::sleep(Duration::ZERO)),
            timer_armed: None,
            input_done: false,
            pending: None,
            unflushed: false,
            violation: None,
            cork: Cork::new(),
        }
    }

    /// One step of input: returns true if something happened.
    fn poll_input(&mut self, cx: &mut Context<'_>) -> bool {
        if self.input_done {
            return false;
        }
        let Poll::Ready(recv) = self.transport.poll_recv(cx) else {
            return false;
        };
        let mut st = self.shared.lock();
        match recv {
            Recv::Data(bytes) => {
                let shed = st.session.stats().shed_periods;
                st.session.handle_input(now(), bytes);
                if st.session.stats().shed_periods > shed {
                    tracing::warn!(
                        period = ?tether_proto::SHED_PERIOD,
                        "the peer reset too many streams right after opening them (users cancelling requests): \
                         refusing new streams for a moment; the tunnel stays up"
                    );
                }
            }
            Recv::Closed => {
                self.input_done = true;
                st.session.handle_transport_closed();
            }
            Recv::Failed(reason) => {
                tracing::debug!(%reason, "tunnel transport failed");
                self.input_done = true;
                st.session.handle_transport_closed();
            }
            Recv::Violation(reason) => {
                tracing::debug!(%reason, "peer broke the transport rules");
                self.input_done = true;
                st.session.close(code::PROTOCOL_ERROR, &reason);
                self.violation = Some(reason);
            }
        }
        true
    }

    /// Sends what the session has while the transport takes it (never pulling more from the session while
    /// the transport is not ready), then flushes. A transport failure is reported to the session.
    fn poll_output(&mut self, cx: &mut Context<'_>) {
        loop {
            match self.transport.poll_ready(cx) {
                Poll::Pending => return,
                Poll::Ready(Err(e)) => return self.output_failed(e),
                Poll::Ready(Ok(())) => {}
            }
            let chunk = match self.pending.take() {
                Some(chunk) => Some(chunk),
                None => self.shared.lock().session.poll_transmit(now()),
            };
            let Some(mut chunk) = chunk else { break };
            if !self.unflushed && self.cork.hold(cx) {
                self.pending = Some(chunk);
                return;
            }
            if chunk.len() > T::MAX_CHUNK {
                self.pending = Some(chunk.split_off(T::MAX_CHUNK));
            }
            if let Err(e) = self.transport.start_send(chunk) {
                return self.output_failed(e);
            }
            self.unflushed = true;
        }
        if self.unflushed {
            match self.transport.poll_flush(cx) {
                Poll::Ready(Ok(())) => self.unflushed = false,
                Poll::Ready(Err(e)) => self.output_failed(e),
                Poll::Pending => {}
            }
        }
    }

    fn output_failed(&mut self, e: io::Error) {
        tracing::debug!(error = %e, "tunnel transport write failed");
        self.pending = None;
        self.unflushed = false;
        self.input_done = true;
        self.shared.lock().session.handle_transport_closed();
    }

    /// Delivers session events and runs the session timer; returns true if anything happened (events may
    /// have queued output, e.g. a refusal).
    fn poll_session(&mut self, cx: &mut Context<'_>) -> bool {
        let mut st = self.shared.lock();
        let mut progress = false;
        while let Some(event) = st.session.poll_event() {
            st.handle_event(event, &self.shared.notify);
            progress = true;
        }
        if st.session.is_closed() {
            // A peer that went silent for the idle timeout (a partition, a dead host) will not answer a polite
            // close either: the tunnel is over now, not after CLOSE_LINGER — so `closed()` callers (the relay's
            // registry, the agent's reconnect loop) learn it within the timeout, as users already did.
            let silent = matches!(
                &st.closed,
                Some(CloseInfo {
                    error: Some(ConnectionError::TimedOut(_))
                })
            );
            drop(st);
            if silent {
                self.pending = None;
                self.finish();
                return true;
            }
            if self.pending.is_none() {
                self.start_closing();
                return true;
            }
            st = self.shared.lock();
        }
        let deadline = st.session.poll_timeout();
        drop(st);
        let Some(deadline) = deadline else {
            self.timer_armed = None;
            return progress;
        };
        // The idle deadline moves with every frame received; re-arming the timer each time would be
        // per-frame work, so a later deadline keeps the earlier sleep, which is re-armed when it fires.
        if self.timer_armed.is_none_or(|armed| deadline < armed) {
            self.timer
                .as_mut()
                .reset(tokio::time::Instant::from_std(deadline));
            self.timer_armed = Some(deadline);
        }
        if self.timer.as_mut().poll(cx).is_ready() {
            self.timer_armed = None;
            let now = now();
            if now >= deadline {
                self.shared.lock().session.handle_timeout(now);
            }
            return true;
        }
        progress
    }

    fn start_closing(&mut self) {
        self.phase = Phase::Closing;
        self.timer
            .as_mut()
            .reset(tokio::time::Instant::now() + CLOSE_LINGER);
        self.timer_armed = None;
    }

    fn finish(&mut self) {
        self.phase = Phase::Finished;
        let mut st = self.shared.lock();
        st.finished = true;
        if st.closed.is_none() {
            // The session never reported Closed (e.g. the task is being torn down): the transport is gone.
            st.closed = Some(CloseInfo {
                error: Some(ConnectionError::TransportClosed),
            });
        }
        st.fail_dead_streams();
        drop(st);
        self.shared.notify.notify_waiters();
        self.shared.closed_notify.notify_waiters();
    }
}

impl<T: Transport> Future for Driver<T> {
    type Output = ();

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<()> {
        let this = self.get_mut();
        this.cork.polled();
        if this.phase == Phase::Running {
            // Registered first so that an operation made while this poll runs wakes us again.
            {
                let mut st = this.shared.lock();
                set_waker(&mut st.driver_waker, cx);
            }
            let mut budget = READ_BUDGET;
            loop {
                let mut progress = this.poll_input(cx);
                progress |= this.poll_session(cx);
                if this.phase != Phase::Running {
                    break;
                }
                this.poll_output(cx);
                // Output may have failed the transport, and stream operations may have queued events.
                progress |= this.poll_session(cx);
                if this.phase != Phase::Running || !progress {
                    break;
                }
                budget -= 1;
                if budget == 0 {
                    cx.waker().wake_by_ref();
                    return Poll::Pending;
                }
            }
        }
        if this.phase == Phase::Closing {
            let violation = this.violation.clone();
            let closed = this
                .transport
                .poll_close(cx, violation.as_deref())
                .is_ready();
            if closed || this.timer.as_mut().poll(cx).is_ready() {
                this.finish();
            }
        }
        if this.phase == Phase::Finished {
            Poll::Ready(())
        } else {
            Poll::Pending
        }
    }
}

impl<T: Transport> Drop for Driver<T> {
    fn drop(&mut self) {
        if self.phase != Phase::Finished {
            self.finish();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn assert_send_sync<T: Send + Sync>(_: &T) {}
    fn assert_send<T: Send>(_: &T) {}

    #[test]
    fn handles_and_futures_can_move_between_tasks() -> anyhow::Result<()> {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()?;
        let _guard = runtime.enter();
        let (io, _peer) = tokio::io::duplex(1024);
        let conn = crate::ws::accept_upgraded(io, SessionConfig::new(tether_proto::Role::Server));
        assert_send_sync(&conn);
        assert_send(&conn.accept());
        assert_send(&conn.closed());
        let stream = conn.open(OpenOptions {
            kind: crate::kind::HTTP,
            priority: Priority::Normal,
            deadline: None,
            metadata: Bytes::new(),
        })?;
        assert_send_sync(&stream);
        let control = stream.control();
        assert_send_sync(&control);
        assert_send(&control.accepted());
        Ok(())
    }

    #[test]
    fn retryable_errors() {
        assert!(TunnelError::TooManyStreams.is_retryable());
        assert!(TunnelError::Closed("gone".to_owned()).is_retryable());
        assert!(TunnelError::Reset(code::SHUTDOWN).is_retryable());
        assert!(
            TunnelError::Refused {
                code: code::SHUTDOWN,
                reason: String::new()
            }
            .is_retryable()
        );
        assert!(!TunnelError::Reset(code::CANCEL).is_retryable());
        assert!(
            !TunnelError::Refused {
                code: code::REFUSED,
                reason: String::new()
            }
            .is_retryable()
        );
        assert!(!TunnelError::TimedOut(Duration::from_secs(1)).is_retryable());
    }
}
