//! What dial tasks, tunnel tasks and control channels tell the supervisor ([`crate::supervisor`]): one
//! queue, so the supervisor sees each tunnel's story in order (its `draining` before its end, its `welcome`
//! before anything else).

use std::time::Duration;

use tether_tunnel::Connection;
use tokio::sync::mpsc;

use crate::error::AgentError;

/// Tells tunnels apart for the lifetime of the agent process.
pub(crate) type TunnelId = u64;
/// Tells dial attempts apart.
pub(crate) type DialId = u64;

/// One thing that happened.
pub(crate) enum Event {
    /// A dial connected: the tunnel is up at the transport level; its control channel says `hello` next.
    Dialed {
        /// The attempt.
        dial: DialId,
        /// The tunnel. One attempt may deliver two (a race whose both transports connected).
        conn: Connection,
    },
    /// A dial failed; it may be retried.
    DialFailed {
        /// The attempt.
        dial: DialId,
        /// Why, for the log.
        error: String,
    },
    /// The relay refused the identity the attempt presented (401/403). Fatal unless a renewal replaced that
    /// identity meanwhile.
    DialRefused {
        /// The attempt.
        dial: DialId,
        /// What to stop with.
        error: AgentError,
    },
    /// The QUIC half of a race that WebSocket won ended without a tunnel: why (the fallback reason).
    QuicFailed {
        /// The attempt.
        dial: DialId,
        /// QUIC's error.
        error: String,
    },
    /// The attempt's task ended (after every other event of it).
    DialDone {
        /// The attempt.
        dial: DialId,
    },
    /// The relay answered `hello`.
    Welcome {
        /// The tunnel.
        tunnel: TunnelId,
        /// The replica holding it (empty from a relay without a fleet).
        replica: String,
        /// Live replicas in the fleet (0 from a relay without a fleet).
        replicas: u32,
    },
    /// The relay is going away on this tunnel.
    Draining {
        /// The tunnel.
        tunnel: TunnelId,
        /// When to come back (reconnect window), without make-before-break.
        window: Duration,
        /// Open the replacement now, then GOAWAY this tunnel.
        make_before_break: bool,
    },
    /// This tunnel's control channel renewed the identity (stored, and used by every dial from now on).
    Renewed {
        /// The tunnel.
        tunnel: TunnelId,
        /// The new identity's fingerprint.
        fingerprint: String,
    },
    /// The tunnel can no longer take streams (GOAWAY from the relay, closed, control channel ended); the
    /// streams it holds may still run.
    Down {
        /// The tunnel.
        tunnel: TunnelId,
        /// Why, for the log.
        reason: String,
    },
    /// The tunnel's task ended: its streams are done, the connection closed.
    Finished {
        /// The tunnel.
        tunnel: TunnelId,
    },
}

/// Where events go. Sending fails only once the supervisor is gone (the agent is stopping), which senders
/// ignore.
#[derive(Clone)]
pub(crate) struct Events(mpsc::UnboundedSender<Event>);

impl Events {
    /// A new queue.
    pub(crate) fn new() -> (Self, mpsc::UnboundedReceiver<Event>) {
        let (tx, rx) = mpsc::unbounded_channel();
        (Self(tx), rx)
    }

    /// Queues `event`.
    pub(crate) fn send(&self, event: Event) {
        let _ = self.0.send(event);
    }
}
