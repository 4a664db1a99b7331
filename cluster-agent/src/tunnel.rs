//! One tunnel's life in the agent, from connected to closed: its control channel ([`crate::control`]), the
//! HTTP streams the relay opens (each served by [`crate::forward`] in a task of the tunnel's own), and its
//! end.
//!
//! A tunnel ends in one of two ways:
//! - **down**: the relay sent GOAWAY or closed it, or its control channel ended. The supervisor hears it at
//!   once ([`Event::Down`], after a `draining` that arrives within [`DRAINING_WAIT`] of a GOAWAY) and dials
//!   again; the streams already accepted keep running while the connection lasts.
//! - **retired** by the supervisor ([`Tunnel::retire`]): a replacement is up (make-before-break), the tunnel
//!   is a surplus one, or the agent shuts down. The agent sends GOAWAY (the relay opens nothing new on it;
//!   a stream it opened meanwhile is refused with SHUTDOWN, retryable on another tunnel), ends the control
//!   channel, lets the open streams finish for up to the drain timeout, cuts the rest and closes.
//!
//! Either way the task ends with [`Event::Finished`].

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use tether_api::reconnect::DRAINING_WAIT;
use tether_tunnel::{Connection, Incoming, code, kind};
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;
use tokio_util::task::{AbortOnDropHandle, TaskTracker};

use crate::control;
use crate::event::{Event, Events, TunnelId};
use crate::forward::{Upstream, serve_heads, serve_stream};
use crate::probes::Probes;

/// How long a retired tunnel whose streams are done may take to close by itself.
const CLOSE_LINGER: Duration = Duration::from_secs(2);

/// Why the supervisor retires a tunnel: the GOAWAY code and reason.
#[derive(Debug, Clone)]
pub(crate) struct Retire {
    pub(crate) code: u32,
    pub(crate) reason: String,
}

/// The supervisor's handle on a running tunnel.
pub(crate) struct Tunnel {
    pub(crate) conn: Connection,
    retire: watch::Sender<Option<Retire>>,
}

impl Tunnel {
    /// GOAWAY, drain, close (once; later calls are ignored).
    pub(crate) fn retire(&self, code: u32, reason: impl Into<String>) {
        let reason = reason.into();
        self.retire.send_if_modified(|current| {
            if current.is_some() {
                return false;
            }
            *current = Some(Retire { code, reason });
            true
        });
    }

    /// Closes at once (every stream fails): for a fatal error.
    pub(crate) fn close(&self, reason: &str) {
        self.conn.close(code::CANCEL, reason);
    }
}

/// What every tunnel task needs.
#[derive(Clone)]
pub(crate) struct Context {
    pub(crate) upstream: Upstream,
    pub(crate) probes: Probes,
    pub(crate) shared: Arc<control::Shared>,
    pub(crate) events: Events,
    pub(crate) drain_timeout: Duration,
}

/// Starts serving `conn` as tunnel `id`.
pub(crate) fn spawn(id: TunnelId, conn: Connection, cx: Context) -> Tunnel {
    let (retire, retired) = watch::channel(None);
    tokio::spawn(run(id, conn.clone(), cx, retired));
    Tunnel { conn, retire }
}

async fn run(
    id: TunnelId,
    conn: Connection,
    cx: Context,
    mut retired: watch::Receiver<Option<Retire>>,
) {
    // The streams' tasks: counted (to drain them) but not joined one by one — a set that is reaped wakes this
    // task once per finished stream. `cut` ends those still running at the drain timeout, or when this task
    // is dropped.
    let streams = Streams {
        tracker: TaskTracker::new(),
        cut: CancellationToken::new(),
    };
    let _cut_on_drop = streams.cut.clone().drop_guard();
    // The control channel runs in a task of its own: polled inside the `select!` below, its whole future (a
    // `select!` of its own over the channel's reads, timers and watches) was polled again on every stream
    // the relay opened and every stream that finished — ~8,000 instructions per request (docs/BENCHMARKS.md).
    let mut control = AbortOnDropHandle::new(tokio::spawn({
        let (conn, shared, events) = (conn.clone(), Arc::clone(&cx.shared), cx.events.clone());
        async move { control::run(&conn, &shared, id, &events).await }
    }));
    let retire = loop {
        tokio::select! {
            incoming = conn.accept() => match incoming {
                Some(incoming) => handle_incoming(incoming, &conn, &cx, &streams),
                None => {
                    // GOAWAY or closed. A relay that is going away says on the control channel when to come
                    // back (`draining`), right after GOAWAY; give that message a moment to arrive.
                    let _ = tokio::time::timeout(DRAINING_WAIT, &mut control).await;
                    let reason = if conn.is_closed() {
                        match conn.closed().await.error {
                            Some(error) => error.to_string(),
                            None => "the relay closed the tunnel".to_owned(),
                        }
                    } else {
                        "the relay sent GOAWAY".to_owned()
                    };
                    cx.events.send(Event::Down { tunnel: id, reason });
                    break None;
                }
            },
            ended = &mut control => {
                let reason = match ended {
                    Ok(reason) => format!("control channel ended: {reason}"),
                    Err(e) => format!("control channel ended: its task failed: {e}"),
                };
                if !conn.is_closed() {
                    conn.close(code::NO_ERROR, "control channel ended");
                }
                cx.events.send(Event::Down { tunnel: id, reason });
                break None;
            }
            Ok(()) = retired.changed() => {
                if let Some(retire) = retired.borrow_and_update().clone() {
                    break Some(retire);
                }
            }
        }
    };
    // The control channel ends with the tunnel's service (a replacement, if any, has its own): dropping the
    // handle aborts its task.
    drop(control);
    // No stream is accepted from here on: `wait` resolves once those running are done.
    streams.tracker.close();
    // Streams already accepted keep running while the connection lasts, until the agent retires the tunnel.
    let retire = match retire {
        Some(retire) => Some(retire),
        None => loop {
            tokio::select! {
                () = streams.tracker.wait() => break None,
                Ok(()) = retired.changed() => {
                    if let Some(retire) = retired.borrow_and_update().clone() {
                        break Some(retire);
                    }
                }
                _ = conn.closed() => {
                    // The streams see the close and end at once.
                    streams.tracker.wait().await;
                    break None;
                }
            }
        },
    };
    if let Some(Retire { code, reason }) = retire {
        tracing::debug!(tunnel = id, open_streams = streams.tracker.len(), %reason, "retiring the tunnel: GOAWAY, then draining its streams");
        conn.go_away(code, &reason);
        drain(&streams, cx.drain_timeout).await;
        // After GOAWAY the connection closes by itself once its last stream is done on both sides; closing
        // it outright could cut the last bytes of a stream that just finished.
        if tokio::time::timeout(CLOSE_LINGER, conn.closed())
            .await
            .is_err()
        {
            conn.close(code::NO_ERROR, &reason);
        }
    }
    cx.events.send(Event::Finished { tunnel: id });
}

/// Waits up to `drain_timeout` for the streams to finish, then cuts the rest.
async fn drain(streams: &Streams, drain_timeout: Duration) {
    if streams.tracker.is_empty() {
        return;
    }
    let drained = tokio::time::timeout(drain_timeout, streams.tracker.wait());
    if drained.await.is_err() {
        tracing::warn!(
            open_streams = streams.tracker.len(),
            "drain timeout reached; cutting the remaining streams"
        );
        streams.cut.cancel();
        streams.tracker.wait().await;
    }
}

/// How long a binary-heads stream's answer may wait for its response to leave with it: most apiserver answers
/// to short requests come within it, and it is far inside the relay's answer deadline (seconds).
const ACCEPT_HOLD: Duration = Duration::from_millis(20);

/// The tasks serving a tunnel's streams.
struct Streams {
    tracker: TaskTracker,
    /// Cancelled to cut the streams still running.
    cut: CancellationToken,
}

fn handle_incoming(incoming: Incoming, conn: &Connection, cx: &Context, streams: &Streams) {
    let heads = match incoming.kind {
        kind::HTTP => false,
        kind::HTTP_HEADS => true,
        other => {
            tracing::debug!(kind = other, "refusing a stream of unsupported kind");
            incoming.refuse(
                code::UNSUPPORTED_KIND,
                "this agent serves only HTTP streams",
            );
            return;
        }
    };
    // A binary-heads stream's answer waits briefly for the response head to leave with it: the relay is then
    // woken once per request rather than twice, and the request goes upstream before the answer is written
    // (docs/BENCHMARKS.md, tenth pass). A response slower than the hold gets the answer on its own, as before.
    let accepted = if heads {
        incoming.accept_deferred(Bytes::new(), ACCEPT_HOLD)
    } else {
        incoming.accept(Bytes::new())
    };
    let stream = match accepted {
        Ok(stream) => stream,
        Err(e) => {
            tracing::debug!(error = %e, "cannot accept a stream");
            return;
        }
    };
    let upstream = cx.upstream.clone();
    let conn = conn.clone();
    let control = stream.control();
    let counted = cx.probes.stream_opened();
    let cut = streams.cut.clone();
    streams.tracker.spawn(async move {
        let _counted = counted;
        let id = stream.id();
        // A stream whose tunnel is gone ends with it: otherwise a response waiting on the apiserver (a quiet
        // watch, `logs -f`) would hold its upstream connection until the apiserver next sends something.
        // Likewise a stream the relay reset (its user left, or its request deadline passed): cancelling the
        // task drops the upstream request, so one still waiting for an upstream connection or stream is
        // never sent, and one in flight is cancelled. Boxed: the exchange's state machine is large, and held by
        // value it was copied into the task and again when the task finished (~4k instructions per request).
        let served = Box::pin(async {
            if heads {
                let reset = control.clone();
                serve_heads(stream, upstream, move || reset.reset(code::CANCEL))
                    .await
                    .map_err(|e| e.to_string())
            } else {
                serve_stream(stream, upstream)
                    .await
                    .map_err(|e| e.to_string())
            }
        });
        tokio::select! {
            result = served => {
                if let Err(e) = result {
                    tracing::debug!(stream = ?id, error = %e, "stream ended with an error");
                }
            }
            _ = conn.closed() => {
                tracing::debug!(stream = ?id, "tunnel closed; stream cut");
            }
            why = control.failed() => {
                tracing::debug!(stream = ?id, error = %why, "stream reset; request cut");
            }
            () = cut.cancelled() => {
                tracing::debug!(stream = ?id, "drain timeout or tunnel task gone; stream cut");
            }
        }
    });
}
