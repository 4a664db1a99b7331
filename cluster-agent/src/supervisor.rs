//! The tunnel supervisor: keeps the agent's K tunnels (`--tunnels`) up, each on a distinct relay replica,
//! over the best transport that works, and moves them make-before-break when it must.
//!
//! **Slots.** There are K slots; slot *i* is wanted while *i* < min(K, live replicas) — the relay's
//! `welcome` says how many replicas the fleet has (`replicas`; a relay without a fleet says nothing, which
//! counts as 1, so such a relay gets one tunnel). A slot that has no tunnel dials (after a backoff of its
//! own when its last attempt failed or its tunnel was lost), round-robin over the `--relay` URLs. Losing one
//! tunnel touches no other.
//!
//! **Distinct replicas.** A new tunnel is kept only once the relay has welcomed it on a replica that no other
//! slot's tunnel holds (`welcome.replica`); otherwise it is retired and the slot dials again with backoff.
//!
//! **Transport.** Per dial ([`crate::dial`]): `--transport quic` or `wss` alone; `auto` races QUIC against
//! WebSocket, or dials WebSocket alone once QUIC was seen failing (and always through an HTTP proxy). While
//! a tunnel is on WebSocket under `auto`, QUIC is tried again every `--quic-reprobe-interval`.
//!
//! **Make-before-break moves.** A slot whose tunnel must go gets its replacement first; once the relay has
//! welcomed the replacement, the old tunnel is retired (GOAWAY, its streams finish, closed). Three things ask
//! for a move: `draining` with `makeBeforeBreak` from the relay (dial at once: the draining replica takes no
//! new tunnels), a renewed identity (every tunnel still on the previous certificate moves onto the new one;
//! the relay refuses a replaced certificate), and QUIC working again for a tunnel on WebSocket (a QUIC tunnel
//! replaces a WebSocket one in its slot whenever one connects). Without `makeBeforeBreak`, a relay going
//! away is left to end the tunnel, and the slot redials within the relay's reconnect window. A move off a
//! draining replica retries on its own short pacing (`Reconnect::move_delay`), not the slot's backoff: the
//! replica waits for the move to end its watches cleanly, and a rolling restart moves a tunnel once per
//! replica, which would otherwise grow the backoff past the drain timeout.
//!
//! On shutdown every tunnel is retired at once and the supervisor returns when their streams are done (at
//! most the drain timeout).

use std::collections::HashMap;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use rand::RngExt as _;
use tether_api::reconnect::{Backoff, MOVE_RETRIES, Reconnect};
use tether_tunnel::{TransportKind, code};
use tokio::sync::mpsc;
use tokio::task::AbortHandle;
use tokio::time::Instant;

use crate::config::{RelayEndpoint, TransportMode};
use crate::dial::{Dialer, Mode};
use crate::error::AgentError;
use crate::event::{DialId, Event, TunnelId};
use crate::tunnel::{self, Tunnel};

/// The supervisor's settings.
pub(crate) struct Settings {
    /// K.
    pub(crate) tunnels: u32,
    pub(crate) transport: TransportMode,
    pub(crate) quic_reprobe_interval: Duration,
    pub(crate) backoff: Backoff,
    pub(crate) drain_timeout: Duration,
}

/// Why a slot wants a replacement for its tunnel.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Move {
    /// The relay replica is draining and asked for make-before-break.
    Drain,
    /// The identity was renewed and the tunnel still presents the previous certificate.
    Renewal,
}

impl Move {
    fn as_str(self) -> &'static str {
        match self {
            Move::Drain => "the relay replica is draining",
            Move::Renewal => "the identity was renewed",
        }
    }
}

/// What a dial is for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Purpose {
    /// A tunnel for a slot without one, or a move.
    Fill,
    /// QUIC again for a slot on WebSocket.
    Reprobe,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    /// Connected; the relay has not welcomed it yet.
    Joining,
    /// Its slot's tunnel.
    Active,
    /// Retired by the agent: GOAWAY sent, its streams finishing.
    Retiring,
    /// Lost or going away on the relay's side; its streams may still run.
    Down,
}

/// One tunnel, as the supervisor sees it.
struct Rec {
    slot: usize,
    handle: Tunnel,
    transport: TransportKind,
    relay: usize,
    /// The identity it presented.
    fingerprint: String,
    state: State,
    replica: String,
    /// The relay's reconnect window from its `draining`.
    window: Option<Duration>,
    /// The relay asked this tunnel to move make-before-break.
    make_before_break: bool,
}

/// One dial attempt in flight.
struct DialRec {
    slot: usize,
    relay: usize,
    fingerprint: String,
    purpose: Purpose,
    mode: Mode,
    abort: AbortHandle,
}

/// One of the K tunnels the agent keeps.
struct Slot {
    current: Option<TunnelId>,
    /// The dial that will give this slot its next tunnel; cleared once it delivered one or failed.
    dial: Option<DialId>,
    /// Dial no earlier than this (backoff); `None`: as soon as the slot needs a tunnel.
    retry_at: Option<Instant>,
    moving: Option<Move>,
    /// While the slot moves off a draining replica: the failed attempts of that move so far.
    move_retries: Option<u32>,
    reconnect: Reconnect,
    /// The next relay URL (index) to dial.
    relay: usize,
    /// The slot lost its tunnel: the next one counts as a reconnect.
    lost: bool,
    /// The slot's tunnel went away while its replacement was on its way: why it moved.
    moving_since_down: Option<&'static str>,
    last_failure: Option<String>,
}

impl Slot {
    /// A slot with no tunnel yet, dialling `relay` (an index into the `--relay` URLs) first.
    fn new(backoff: Backoff, relay: usize) -> Slot {
        Slot {
            current: None,
            dial: None,
            retry_at: None,
            moving: None,
            move_retries: None,
            reconnect: Reconnect::new(backoff),
            relay,
            lost: false,
            moving_since_down: None,
            last_failure: None,
        }
    }

    /// How long to wait before dialling again after a failed attempt: during a move off a draining replica,
    /// its first [`MOVE_RETRIES`] retries are paced by [`Reconnect::move_delay`]; otherwise the slot's backoff.
    fn retry_delay(&mut self) -> Duration {
        match &mut self.move_retries {
            Some(n) if *n < MOVE_RETRIES => {
                let delay = self.reconnect.move_delay(*n);
                *n += 1;
                delay
            }
            _ => self.reconnect.next_delay(),
        }
    }
}

type Shutdown = Pin<Box<dyn Future<Output = ()> + Send>>;

/// Runs the tunnels until `shutdown` resolves (then retires them all and waits for their streams) or a
/// fatal error.
pub(crate) async fn run(
    settings: Settings,
    relays: Vec<RelayEndpoint>,
    dialer: Arc<Dialer>,
    cx: tunnel::Context,
    events: mpsc::UnboundedReceiver<Event>,
    mut shutdown: Shutdown,
) -> Result<(), AgentError> {
    let mut supervisor = Supervisor::new(settings, relays, dialer, cx);
    let mut events = events;
    let result = loop {
        supervisor.schedule();
        let wake = supervisor.next_wake();
        tokio::select! {
            event = events.recv() => {
                let Some(event) = event else { break Ok(()) };
                if let Err(e) = supervisor.handle(event) {
                    break Err(e);
                }
            }
            () = sleep_until_some(wake) => {}
            () = shutdown.as_mut() => break Ok(()),
        }
    };
    match result {
        Ok(()) => {
            supervisor.stop(&mut events).await;
            Ok(())
        }
        Err(e) => {
            tracing::error!(error = %e, "giving up");
            supervisor.abort();
            Err(e)
        }
    }
}

async fn sleep_until_some(at: Option<Instant>) {
    match at {
        Some(at) => tokio::time::sleep_until(at).await,
        None => std::future::pending().await,
    }
}

struct Supervisor {
    settings: Settings,
    relays: Vec<RelayEndpoint>,
    dialer: Arc<Dialer>,
    cx: tunnel::Context,
    slots: Vec<Slot>,
    tunnels: HashMap<TunnelId, Rec>,
    dials: HashMap<DialId, DialRec>,
    next_id: u64,
    /// Live replicas, as the relay last said (at least 1).
    fleet: u32,
    /// QUIC failed on the last try (auto mode dials WebSocket alone until a re-probe works).
    quic_blocked: bool,
    reprobe_at: Option<Instant>,
}

impl Supervisor {
    fn new(
        settings: Settings,
        relays: Vec<RelayEndpoint>,
        dialer: Arc<Dialer>,
        cx: tunnel::Context,
    ) -> Self {
        let relay_count = relays.len().max(1);
        let slots = (0..settings.tunnels as usize)
            .map(|i| Slot::new(settings.backoff, i % relay_count))
            .collect();
        cx.shared.set_tunnels(settings.tunnels);
        Self {
            settings,
            relays,
            dialer,
            cx,
            slots,
            tunnels: HashMap::new(),
            dials: HashMap::new(),
            next_id: 0,
            fleet: 1,
            quic_blocked: false,
            reprobe_at: None,
        }
    }

    /// How many slots are wanted now.
    fn target(&self) -> usize {
        self.settings.tunnels.min(self.fleet) as usize
    }

    fn id(&mut self) -> u64 {
        self.next_id += 1;
        self.next_id
    }

    fn joining(&self, slot: usize) -> bool {
        self.tunnels
            .values()
            .any(|t| t.slot == slot && t.state == State::Joining)
    }

    /// The transport choice for a fill dial to `relay`.
    fn mode(&self, relay: usize) -> Mode {
        if self.relays.get(relay).is_some_and(|r| r.proxied) {
            return Mode::Wss;
        }
        match self.settings.transport {
            TransportMode::Wss => Mode::Wss,
            TransportMode::Quic => Mode::Quic,
            TransportMode::Auto if self.quic_blocked => Mode::Wss,
            TransportMode::Auto => Mode::Race,
        }
    }

    /// Whether a tunnel on WebSocket to `relay` is worth moving to QUIC.
    fn reprobes(&self, rec: &Rec) -> bool {
        self.settings.transport == TransportMode::Auto
            && rec.transport == TransportKind::WebSocket
            && !self.relays.get(rec.relay).is_some_and(|r| r.proxied)
    }

    /// Starts the dials that are due and arms the re-probe.
    fn schedule(&mut self) {
        let now = Instant::now();
        let target = self.target();
        for index in 0..self.slots.len() {
            let slot = &self.slots[index];
            let wanted = match slot.current {
                None => index < target,
                Some(_) => slot.moving.is_some(),
            };
            if wanted
                && slot.dial.is_none()
                && slot.retry_at.is_none_or(|at| at <= now)
                && !self.joining(index)
            {
                let relay = self.slots[index].relay;
                let mode = self.mode(relay);
                self.start_dial(index, relay, mode, Purpose::Fill);
            }
        }

        let on_websocket: Vec<usize> = self
            .tunnels
            .values()
            .filter(|t| t.state == State::Active && self.reprobes(t))
            .map(|t| t.slot)
            .collect();
        if on_websocket.is_empty() {
            self.reprobe_at = None;
            return;
        }
        match self.reprobe_at {
            None => {
                // ±10% so that a fleet of agents does not probe in step.
                let jitter = rand::rng().random_range(0.9..=1.1);
                self.reprobe_at = Some(now + self.settings.quic_reprobe_interval.mul_f64(jitter));
            }
            Some(at) if at <= now => {
                self.reprobe_at = None;
                for index in on_websocket {
                    let slot = &self.slots[index];
                    let relay = slot
                        .current
                        .and_then(|c| self.tunnels.get(&c))
                        .map(|t| t.relay);
                    // Not while any attempt of this slot is still out (a race's QUIC half included).
                    let dialling = self.dials.values().any(|d| d.slot == index);
                    if let Some(relay) = relay
                        && !dialling
                        && slot.moving.is_none()
                        && !self.joining(index)
                    {
                        tracing::debug!(
                            slot = index,
                            "trying QUIC again for a tunnel on WebSocket"
                        );
                        self.start_dial(index, relay, Mode::Quic, Purpose::Reprobe);
                    }
                }
            }
            Some(_) => {}
        }
    }

    fn start_dial(&mut self, slot: usize, relay: usize, mode: Mode, purpose: Purpose) {
        let id = self.id();
        let identity = self.cx.shared.identity();
        let Some(endpoint) = self.relays.get(relay).cloned() else {
            return;
        };
        let abort = self
            .dialer
            .spawn(id, endpoint, identity.clone(), mode, self.cx.events.clone());
        self.dials.insert(
            id,
            DialRec {
                slot,
                relay,
                fingerprint: identity.fingerprint,
                purpose,
                mode,
                abort,
            },
        );
        if purpose == Purpose::Fill {
            let slot = &mut self.slots[slot];
            slot.dial = Some(id);
            slot.retry_at = None;
        }
    }

    /// When the loop should look again without an event.
    fn next_wake(&self) -> Option<Instant> {
        let target = self.target();
        let retries = self.slots.iter().enumerate().filter_map(|(i, s)| {
            let wanted = s.current.map_or(i < target, |_| s.moving.is_some());
            (wanted && s.dial.is_none()).then_some(s.retry_at).flatten()
        });
        retries.chain(self.reprobe_at).min()
    }

    fn handle(&mut self, event: Event) -> Result<(), AgentError> {
        match event {
            Event::Dialed { dial, conn } => self.dialed(dial, conn),
            Event::DialFailed { dial, error } => self.dial_failed(dial, &error),
            Event::DialRefused { dial, error } => {
                let current = self.cx.shared.identity().fingerprint;
                match self.dials.get(&dial) {
                    // Presented the identity a renewal replaced meanwhile: the relay refuses it by design.
                    Some(d) if d.fingerprint != current => self.dial_failed(
                        dial,
                        "the relay refused the previous identity; dialling again with the renewed one",
                    ),
                    _ => return Err(error),
                }
            }
            Event::QuicFailed { dial, error } => self.quic_failed(dial, &error),
            Event::DialDone { dial } => {
                if let Some(d) = self.dials.remove(&dial)
                    && self.slots[d.slot].dial == Some(dial)
                {
                    self.slots[d.slot].dial = None;
                }
            }
            Event::Welcome {
                tunnel,
                replica,
                replicas,
            } => self.welcome(tunnel, replica, replicas),
            Event::Draining {
                tunnel,
                window,
                make_before_break,
            } => self.draining(tunnel, window, make_before_break),
            Event::Renewed {
                tunnel,
                fingerprint,
            } => self.renewed(tunnel, fingerprint),
            Event::Down { tunnel, reason } => self.down(tunnel, &reason),
            Event::Finished { tunnel } => {
                if let Some(rec) = self.tunnels.remove(&tunnel)
                    && matches!(rec.state, State::Active | State::Joining)
                {
                    // Ended without saying it went down first: cannot happen, but the slot must not wait.
                    self.down_rec(tunnel, rec, "the tunnel ended");
                }
                self.publish();
            }
        }
        Ok(())
    }

    fn dialed(&mut self, dial: DialId, conn: tether_tunnel::Connection) {
        let Some(d) = self.dials.get(&dial) else {
            conn.close(code::CANCEL, "dial abandoned");
            return;
        };
        let (slot, relay, fingerprint) = (d.slot, d.relay, d.fingerprint.clone());
        if self.slots[slot].dial == Some(dial) {
            self.slots[slot].dial = None;
        }
        let transport = conn.transport();
        if transport == TransportKind::Quic && self.quic_blocked {
            tracing::info!("QUIC to the relay works again");
            self.quic_blocked = false;
        }
        // Counted before the tunnel's control channel reports health.
        if self.slots[slot].current.is_none() && std::mem::take(&mut self.slots[slot].lost) {
            self.cx.shared.reconnected();
        }
        let id = self.id();
        let handle = tunnel::spawn(id, conn, self.cx.clone());
        tracing::debug!(tunnel = id, slot, transport = transport.as_str(), relay = %self.relays[relay].url, "tunnel connected; waiting for the relay's welcome");
        self.tunnels.insert(
            id,
            Rec {
                slot,
                handle,
                transport,
                relay,
                fingerprint,
                state: State::Joining,
                replica: String::new(),
                window: None,
                make_before_break: false,
            },
        );
    }

    fn dial_failed(&mut self, dial: DialId, error: &str) {
        let Some(d) = self.dials.get(&dial) else {
            return;
        };
        let (index, purpose, mode) = (d.slot, d.purpose, d.mode);
        if purpose == Purpose::Reprobe {
            tracing::info!(%error, next_try_in = ?self.settings.quic_reprobe_interval, "QUIC still does not connect; staying on WebSocket");
            self.quic_blocked = true;
            return;
        }
        if mode == Mode::Quic && self.settings.transport == TransportMode::Auto {
            self.quic_blocked = true;
        }
        let relay_count = self.relays.len().max(1);
        let slot = &mut self.slots[index];
        if slot.dial == Some(dial) {
            slot.dial = None;
        }
        let delay = slot.retry_delay();
        slot.retry_at = Some(Instant::now() + delay);
        slot.relay = (slot.relay + 1) % relay_count;
        let relay = &self.relays[d.relay].url;
        if slot.last_failure.as_deref() == Some(error) {
            tracing::debug!(%error, %relay, slot = index, retry_in = ?delay, attempt = slot.reconnect.attempt(), "cannot connect to the relay");
        } else {
            tracing::warn!(%error, %relay, slot = index, retry_in = ?delay, "cannot connect to the relay");
            slot.last_failure = Some(error.to_owned());
        }
    }

    fn quic_failed(&mut self, dial: DialId, error: &str) {
        if self.settings.transport != TransportMode::Auto {
            return;
        }
        let relay = self
            .dials
            .get(&dial)
            .map_or("", |d| self.relays[d.relay].url.as_str());
        if self.quic_blocked {
            tracing::debug!(%error, %relay, "QUIC did not connect; on WebSocket");
        } else {
            tracing::warn!(
                %error,
                %relay,
                reprobe_every = ?self.settings.quic_reprobe_interval,
                "QUIC did not connect: falling back to WebSocket (QUIC is tried again periodically)"
            );
        }
        self.quic_blocked = true;
    }

    fn welcome(&mut self, tunnel: TunnelId, replica: String, replicas: u32) {
        let previous = self.fleet;
        self.fleet = replicas.max(1);
        if self.fleet != previous {
            tracing::info!(
                replicas = self.fleet,
                tunnels = self.target(),
                "the relay fleet's size changed"
            );
        }
        self.cx.shared.set_tunnels(self.target() as u32);
        let Some(rec) = self.tunnels.get_mut(&tunnel) else {
            return;
        };
        rec.replica = replica.clone();
        if rec.state != State::Joining {
            return;
        }
        let index = rec.slot;
        let transport = rec.transport;
        let duplicate = !replica.is_empty()
            && self.tunnels.iter().any(|(id, t)| {
                *id != tunnel && t.slot != index && t.state == State::Active && t.replica == replica
            });
        if duplicate {
            self.retire(
                tunnel,
                code::NO_ERROR,
                "another tunnel of this agent is on this relay replica",
            );
            let relay_count = self.relays.len().max(1);
            let slot = &mut self.slots[index];
            let delay = slot.retry_delay();
            slot.retry_at = Some(Instant::now() + delay);
            slot.relay = (slot.relay + 1) % relay_count;
            tracing::info!(%replica, slot = index, retry_in = ?delay, "the tunnel landed on a replica another tunnel holds; dialling again");
            if slot.moving == Some(Move::Drain)
                && let Some(old) = slot.current.take()
            {
                // The draining replica must be left, and another tunnel is up on the live one.
                slot.moving = None;
                self.retire(old, code::NO_ERROR, "moved: the relay replica is draining");
            }
            self.publish();
            return;
        }
        let slot = &self.slots[index];
        let replaced = match slot
            .current
            .and_then(|c| self.tunnels.get(&c).map(|r| (c, r)))
        {
            None => None,
            Some((old, old_rec)) => {
                let upgrade = transport == TransportKind::Quic
                    && old_rec.transport == TransportKind::WebSocket;
                if slot.moving.is_none() && !upgrade {
                    // Another attempt of this slot got there first.
                    self.retire(tunnel, code::NO_ERROR, "surplus tunnel");
                    self.publish();
                    return;
                }
                Some((old, slot.moving))
            }
        };
        let slot = &mut self.slots[index];
        let moved_after_down = slot.moving_since_down.take();
        slot.current = Some(tunnel);
        slot.moving = None;
        slot.move_retries = None;
        slot.retry_at = None;
        slot.last_failure = None;
        slot.reconnect.connected();
        if let Some(rec) = self.tunnels.get_mut(&tunnel) {
            rec.state = State::Active;
        }
        let relay = self.tunnels.get(&tunnel).map_or(0, |r| r.relay);
        match replaced {
            // The old tunnel went first (the relay sent it GOAWAY when the new one arrived).
            None if moved_after_down.is_some() => tracing::info!(
                transport = transport.as_str(),
                %replica,
                slot = index,
                reason = moved_after_down.unwrap_or_default(),
                "moved to a new tunnel; the old one finishes its streams"
            ),
            None => tracing::info!(
                transport = transport.as_str(),
                %replica,
                relay = %self.relays[relay].url,
                slot = index,
                "connected to the relay"
            ),
            Some((old, why)) => {
                let why = why.map_or("QUIC works: moving off WebSocket", Move::as_str);
                tracing::info!(
                    transport = transport.as_str(),
                    %replica,
                    slot = index,
                    reason = why,
                    "moved to a new tunnel; the old one finishes its streams"
                );
                self.retire(
                    old,
                    code::NO_ERROR,
                    &format!("moved to a new tunnel: {why}"),
                );
            }
        }
        // Dialled before a renewal finished: it presents the previous certificate.
        let current = self.cx.shared.identity().fingerprint;
        if self
            .tunnels
            .get(&tunnel)
            .is_some_and(|r| r.fingerprint != current)
        {
            self.slots[index].moving = Some(Move::Renewal);
        }
        self.publish();
    }

    fn draining(&mut self, tunnel: TunnelId, window: Duration, make_before_break: bool) {
        let Some(rec) = self.tunnels.get_mut(&tunnel) else {
            return;
        };
        rec.window = Some(window);
        if !make_before_break {
            return;
        }
        rec.make_before_break = true;
        let index = rec.slot;
        if rec.state == State::Active && self.slots[index].current == Some(tunnel) {
            let slot = &mut self.slots[index];
            slot.moving = Some(Move::Drain);
            slot.move_retries = Some(0);
            slot.retry_at = None;
            // A draining replica takes no new tunnels: the replacement goes to the next relay URL (the same
            // one behind a load balancer, which no longer sends new connections there).
            slot.relay = (slot.relay + 1) % self.relays.len().max(1);
        }
    }

    fn renewed(&mut self, tunnel: TunnelId, fingerprint: String) {
        if let Some(rec) = self.tunnels.get_mut(&tunnel) {
            rec.fingerprint = fingerprint.clone();
        }
        for index in 0..self.slots.len() {
            let Some(current) = self.slots[index].current else {
                continue;
            };
            if self
                .tunnels
                .get(&current)
                .is_some_and(|r| r.fingerprint != fingerprint)
                && self.slots[index].moving.is_none()
            {
                self.slots[index].moving = Some(Move::Renewal);
                self.slots[index].retry_at = None;
            }
        }
    }

    fn down(&mut self, tunnel: TunnelId, reason: &str) {
        let Some(rec) = self.tunnels.remove(&tunnel) else {
            return;
        };
        let rec = self.down_rec(tunnel, rec, reason);
        self.tunnels.insert(tunnel, rec);
        self.publish();
    }

    /// Marks `rec` down and lets its slot dial again; gives `rec` back.
    fn down_rec(&mut self, tunnel: TunnelId, mut rec: Rec, reason: &str) -> Rec {
        let previous = std::mem::replace(&mut rec.state, State::Down);
        let joining = self.joining(rec.slot);
        let slot = &mut self.slots[rec.slot];
        match previous {
            State::Active if slot.current == Some(tunnel) => {
                slot.current = None;
                // A replacement on its way (a move, or QUIC after WebSocket): nothing was lost.
                let planned = rec.make_before_break || slot.moving.is_some() || joining;
                let why = match slot.moving.take() {
                    Some(why) => why.as_str(),
                    None if rec.make_before_break => Move::Drain.as_str(),
                    None => "QUIC works: moving off WebSocket",
                };
                if planned {
                    slot.moving_since_down = Some(why);
                    slot.retry_at = None;
                    tracing::info!(%reason, replica = %rec.replica, slot = rec.slot, "tunnel going away; its replacement is on its way");
                } else {
                    slot.lost = true;
                    slot.move_retries = None;
                    let delay = slot.reconnect.lost(rec.window.take());
                    slot.retry_at = Some(Instant::now() + delay);
                    tracing::warn!(%reason, replica = %rec.replica, slot = rec.slot, retry_in = ?delay, "disconnected from the relay");
                }
            }
            State::Joining => {
                if slot.current.is_none() && slot.moving_since_down.take().is_some() {
                    // The replacement of a tunnel that went away failed: the slot has lost its tunnel.
                    slot.lost = true;
                }
                let delay = slot.retry_delay();
                slot.retry_at = Some(Instant::now() + delay);
                tracing::warn!(%reason, slot = rec.slot, retry_in = ?delay, "tunnel lost before the relay welcomed it");
            }
            _ => {}
        }
        rec
    }

    fn retire(&mut self, tunnel: TunnelId, code: u32, reason: &str) {
        if let Some(rec) = self.tunnels.get_mut(&tunnel) {
            if matches!(rec.state, State::Joining | State::Active) {
                rec.state = State::Retiring;
            }
            rec.handle.retire(code, reason);
        }
    }

    /// Tells the probes (and `hello`) how many tunnels are up.
    fn publish(&self) {
        let up = |kind| {
            self.tunnels
                .values()
                .filter(|t| t.state == State::Active && t.transport == kind)
                .count()
        };
        self.cx
            .probes
            .set_tunnels(up(TransportKind::Quic), up(TransportKind::WebSocket));
    }

    /// Shutdown: stop dialling, retire every tunnel, wait (bounded) until their streams are done.
    async fn stop(&mut self, events: &mut mpsc::UnboundedReceiver<Event>) {
        for (_, d) in self.dials.drain() {
            d.abort.abort();
        }
        let ids: Vec<TunnelId> = self.tunnels.keys().copied().collect();
        let open: usize = self
            .tunnels
            .values()
            .map(|t| t.handle.conn.open_streams())
            .sum();
        tracing::info!(tunnels = ids.len(), open_streams = open, drain_timeout = ?self.settings.drain_timeout, "shutting down: draining streams");
        for id in ids {
            self.retire(id, code::SHUTDOWN, "agent shutting down");
        }
        self.publish();
        // Each tunnel cuts its streams at the drain timeout; the margin covers the close.
        let deadline = Instant::now() + self.settings.drain_timeout + Duration::from_secs(2);
        while !self.tunnels.is_empty() {
            match tokio::time::timeout_at(deadline, events.recv()).await {
                Ok(Some(Event::Finished { tunnel })) => {
                    self.tunnels.remove(&tunnel);
                }
                Ok(Some(Event::Dialed { conn, .. })) => {
                    conn.close(code::SHUTDOWN, "agent shutting down")
                }
                Ok(Some(_)) => {}
                Ok(None) | Err(_) => break,
            }
        }
        if self.tunnels.is_empty() {
            tracing::info!("all streams finished");
        } else {
            for rec in self.tunnels.values() {
                rec.handle.close("agent shut down");
            }
            tracing::warn!(
                tunnels = self.tunnels.len(),
                "tunnels still open after the drain timeout; closed"
            );
        }
    }

    /// Fatal error: cut everything.
    fn abort(&mut self) {
        for (_, d) in self.dials.drain() {
            d.abort.abort();
        }
        for rec in self.tunnels.values() {
            rec.handle.close("agent stopped");
        }
        self.cx.probes.set_tunnels(0, 0);
    }
}

#[cfg(test)]
mod tests {
    use tether_api::reconnect::MOVE_RETRY_CAP;

    use super::*;

    /// A rolling restart moves a tunnel once per replica: the failures of earlier moves must not slow the next
    /// move's retries, nor may a move's own failures grow the slot's backoff.
    #[test]
    fn a_moves_retries_ignore_the_grown_backoff_and_leave_it_as_it_was() {
        let mut slot = Slot::new(Backoff::default(), 0);
        for _ in 0..6 {
            slot.retry_delay();
        }
        assert_eq!(slot.reconnect.attempt(), 6);
        slot.move_retries = Some(0);
        for retry in 0..MOVE_RETRIES {
            let delay = slot.retry_delay();
            assert!(
                delay <= MOVE_RETRY_CAP,
                "retry {retry} of the move: {delay:?}"
            );
        }
        assert_eq!(
            slot.reconnect.attempt(),
            6,
            "the move's failures are its own"
        );
        // A move that keeps failing is a fleet in trouble: the slot's backoff takes over and grows.
        slot.retry_delay();
        assert_eq!(slot.reconnect.attempt(), 7);
    }
}
