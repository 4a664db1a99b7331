//! Drives two sessions against each other in virtual time, with no sockets.
//!
//! Output of one side's `poll_transmit` is delivered to the other's `handle_input` after `delay`, optionally
//! cut into pieces of random size. Time only moves when a test calls [`Pair::advance`]. When a side's session
//! is closed and its last bytes are delivered, the other side is told the transport closed, as the tunnel does.

#![allow(dead_code, unreachable_pub)]

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use bytes::{Bytes, BytesMut};
use tether_proto::{Config, Event, Frame, ReadResult, Role, Session, StreamId};

/// A tiny deterministic generator (xorshift64*), so test runs are reproducible.
#[derive(Debug, Clone)]
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Self {
        Rng(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1)
    }

    pub fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }

    /// Uniform in `lo..=hi`.
    pub fn range(&mut self, lo: usize, hi: usize) -> usize {
        lo + (self.next() % (hi - lo + 1) as u64) as usize
    }
}

pub struct Side {
    pub session: Session,
    /// The time of the last input delivered to this side.
    pub now: Instant,
    /// Events not yet looked at by the test.
    pub events: VecDeque<Event>,
    /// Bytes on their way to this side, with their arrival time.
    inflight: VecDeque<(Instant, Bytes)>,
    transport_closed: bool,
    /// Every chunk this side transmitted.
    pub sent: Vec<Bytes>,
}

impl Side {
    fn new(session: Session, now: Instant) -> Self {
        Side {
            session,
            now,
            events: VecDeque::new(),
            inflight: VecDeque::new(),
            transport_closed: false,
            sent: Vec::new(),
        }
    }

    fn collect_events(&mut self) {
        while let Some(e) = self.session.poll_event() {
            self.events.push_back(e);
        }
    }

    /// Removes and returns the first event matching `pred`.
    pub fn take(&mut self, pred: impl Fn(&Event) -> bool) -> Option<Event> {
        let i = self.events.iter().position(pred)?;
        self.events.remove(i)
    }

    pub fn has(&self, pred: impl Fn(&Event) -> bool) -> bool {
        self.events.iter().any(pred)
    }

    /// The error of the Closed event, if the session closed.
    pub fn closed(&self) -> Option<Option<tether_proto::ConnectionError>> {
        self.events.iter().find_map(|e| match e {
            Event::Closed { error } => Some(error.clone()),
            _ => None,
        })
    }

    /// Reads everything currently buffered on `id`: the bytes and whether FIN was seen.
    pub fn read_all(&mut self, id: StreamId) -> (Vec<u8>, bool) {
        let mut out = Vec::new();
        loop {
            match self.session.read(self.now, id, usize::MAX).expect("read") {
                ReadResult::Data(d) => out.extend_from_slice(&d),
                ReadResult::Finished => return (out, true),
                ReadResult::Blocked => return (out, false),
            }
        }
    }

    /// Every frame this side sent so far, decoded.
    pub fn sent_frames(&self) -> Vec<Frame> {
        let mut wire = BytesMut::new();
        for chunk in &self.sent {
            wire.extend_from_slice(chunk);
        }
        let mut wire = wire.freeze();
        let mut frames = Vec::new();
        while let Some(f) = Frame::decode(&mut wire, 1 << 24).expect("own output decodes") {
            frames.push(f);
        }
        frames
    }
}

pub struct Pair {
    pub now: Instant,
    pub client: Side,
    pub server: Side,
    /// One-way delay.
    pub delay: Duration,
    /// When set, deliveries are cut into random pieces of at most this many bytes.
    pub split: Option<(Rng, usize)>,
}

pub fn config(role: Role) -> Config {
    Config::new(role)
}

impl Pair {
    pub fn new(client: Config, server: Config) -> Self {
        let now = Instant::now();
        Pair {
            now,
            client: Side::new(Session::new(client, now), now),
            server: Side::new(Session::new(server, now), now),
            delay: Duration::ZERO,
            split: None,
        }
    }

    /// A pair with default configs, handshake done and Connected events consumed.
    pub fn connected() -> Self {
        Self::connected_with(config(Role::Client), config(Role::Server))
    }

    pub fn connected_with(client: Config, server: Config) -> Self {
        let mut pair = Self::new(client, server);
        pair.run();
        assert!(
            pair.client
                .take(|e| matches!(e, Event::Connected { version: 1 }))
                .is_some(),
            "client connected"
        );
        assert!(
            pair.server
                .take(|e| matches!(e, Event::Connected { version: 1 }))
                .is_some(),
            "server connected"
        );
        pair
    }

    /// Transmits and delivers until nothing moves at the current time.
    pub fn run(&mut self) {
        for _ in 0..10_000_000 {
            if !self.step() {
                return;
            }
        }
        panic!("sessions never went quiet");
    }

    /// (client, server) when `client_first`, else (server, client).
    fn sides(&mut self, client_first: bool) -> (&mut Side, &mut Side) {
        if client_first {
            (&mut self.client, &mut self.server)
        } else {
            (&mut self.server, &mut self.client)
        }
    }

    fn step(&mut self) -> bool {
        let now = self.now;
        let delay = self.delay;
        let mut moved = false;
        for dir in [true, false] {
            let (from, to) = self.sides(dir);
            if from.transport_closed {
                continue;
            }
            while let Some(chunk) = from.session.poll_transmit(now) {
                assert!(!chunk.is_empty(), "empty chunk transmitted");
                from.sent.push(chunk.clone());
                to.inflight.push_back((now + delay, chunk));
                moved = true;
            }
            from.collect_events();
        }
        for dir in [true, false] {
            let (from, to) = if dir {
                (&mut self.server, &mut self.client)
            } else {
                (&mut self.client, &mut self.server)
            };
            while to.inflight.front().is_some_and(|(at, _)| *at <= now) {
                let Some((_, chunk)) = to.inflight.pop_front() else {
                    break;
                };
                moved = true;
                if to.transport_closed {
                    continue;
                }
                match &mut self.split {
                    None => {
                        to.now = now;
                        to.session.handle_input(now, chunk)
                    }
                    Some((rng, max)) => {
                        let mut chunk = chunk;
                        while !chunk.is_empty() {
                            let n = rng.range(1, *max).min(chunk.len());
                            to.now = now;
                            to.session.handle_input(now, chunk.split_to(n));
                        }
                    }
                }
                to.collect_events();
            }
            // The peer's session is over and all it sent has arrived: the transport goes away.
            if from.session.is_closed() && to.inflight.is_empty() && !to.transport_closed {
                to.transport_closed = true;
                from.transport_closed = true;
                to.session.handle_transport_closed();
                from.session.handle_transport_closed();
                to.collect_events();
                from.collect_events();
                moved = true;
            }
        }
        moved
    }

    /// Moves virtual time forward by `by`, firing timers and delivering bytes in order.
    pub fn advance(&mut self, by: Duration) {
        let target = self.now + by;
        loop {
            self.run();
            let mut next = target;
            for side in [&self.client, &self.server] {
                if side.transport_closed {
                    continue;
                }
                if let Some(t) = side.session.poll_timeout() {
                    next = next.min(t);
                }
                if let Some((at, _)) = side.inflight.front() {
                    next = next.min(*at);
                }
            }
            self.now = self.now.max(next);
            let now = self.now;
            for side in [&mut self.client, &mut self.server] {
                if !side.transport_closed && side.session.poll_timeout().is_some_and(|t| t <= now) {
                    side.session.handle_timeout(now);
                    side.collect_events();
                }
            }
            self.run();
            if self.now >= target {
                return;
            }
        }
    }

    /// Opens a stream on the client, lets the server see it and accept it.
    pub fn open_accepted(&mut self, priority: tether_proto::Priority) -> StreamId {
        let id = self
            .client
            .session
            .open_stream(
                self.now,
                tether_proto::kind::HTTP,
                priority,
                None,
                Bytes::new(),
            )
            .expect("open");
        self.run();
        let opened = self
            .server
            .take(|e| matches!(e, Event::StreamOpened { id: i, .. } if *i == id));
        assert!(opened.is_some(), "server saw the OPEN");
        self.server
            .session
            .accept_stream(id, Bytes::new())
            .expect("accept");
        self.run();
        assert!(
            self.client
                .take(|e| matches!(e, Event::StreamAccepted { id: i, .. } if *i == id))
                .is_some()
        );
        id
    }
}

/// A single session fed hand-made frames, for abuse and malformed-input tests.
pub struct Raw {
    pub now: Instant,
    pub session: Session,
    pub events: Vec<Event>,
    /// Frames the session sent.
    pub out: Vec<Frame>,
    wire: BytesMut,
}

impl Raw {
    /// A session of `config`; nothing fed yet.
    pub fn new(config: Config) -> Self {
        let now = Instant::now();
        let mut raw = Raw {
            now,
            session: Session::new(config, now),
            events: Vec::new(),
            out: Vec::new(),
            wire: BytesMut::new(),
        };
        raw.drain();
        raw
    }

    /// A session of `config` after the peer's valid HELLO and SETTINGS.
    pub fn connected(config: Config) -> Self {
        let mut raw = Self::new(config);
        raw.feed(&[
            Frame::Hello {
                min_version: 1,
                max_version: 1,
            },
            Frame::Settings(Default::default()),
        ]);
        assert!(
            raw.events
                .iter()
                .any(|e| matches!(e, Event::Connected { .. })),
            "connected: {:?}",
            raw.events
        );
        raw
    }

    pub fn feed(&mut self, frames: &[Frame]) {
        let mut buf = BytesMut::new();
        for f in frames {
            f.encode(&mut buf);
        }
        self.feed_bytes(buf.freeze());
    }

    /// Feeds frames without polling the session's output in between (so nothing it queues is transmitted).
    pub fn feed_no_drain(&mut self, frames: &[Frame]) {
        let mut buf = BytesMut::new();
        for f in frames {
            f.encode(&mut buf);
        }
        self.session.handle_input(self.now, buf.freeze());
    }

    pub fn feed_bytes(&mut self, bytes: Bytes) {
        self.session.handle_input(self.now, bytes);
        self.drain();
    }

    /// Collects events and transmitted frames.
    pub fn drain(&mut self) {
        while let Some(e) = self.session.poll_event() {
            self.events.push(e);
        }
        while let Some(chunk) = self.session.poll_transmit(self.now) {
            self.wire.extend_from_slice(&chunk);
        }
        let mut wire = self.wire.split().freeze();
        while let Some(f) = Frame::decode(&mut wire, 1 << 24).expect("own output decodes") {
            self.out.push(f);
        }
        self.wire.extend_from_slice(&wire);
        while let Some(e) = self.session.poll_event() {
            self.events.push(e);
        }
    }

    /// The code of the GOAWAY the session sent, if any.
    pub fn goaway_code(&self) -> Option<u32> {
        self.out.iter().find_map(|f| match f {
            Frame::GoAway { code, .. } => Some(*code),
            _ => None,
        })
    }

    pub fn closed(&self) -> Option<Option<tether_proto::ConnectionError>> {
        self.events.iter().find_map(|e| match e {
            Event::Closed { error } => Some(error.clone()),
            _ => None,
        })
    }
}
