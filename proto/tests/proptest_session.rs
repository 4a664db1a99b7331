//! Random operations on two sessions, with random windows, delays and chunking: every byte written on a stream
//! arrives, in order, on the other side.

mod harness;

use std::time::Duration;

use bytes::Bytes;
use harness::{Pair, Rng, config};
use proptest::prelude::*;
use tether_proto::{Event, Priority, ReadResult, Role, StreamError, StreamId, kind};

#[derive(Debug, Clone)]
enum Op {
    Open {
        by_client: bool,
        control: bool,
    },
    Write {
        stream: usize,
        by_opener: bool,
        len: usize,
    },
    Finish {
        stream: usize,
        by_opener: bool,
    },
    Read {
        stream: usize,
        by_opener: bool,
        max: usize,
    },
    Pump,
    Advance(u64),
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        2 => (any::<bool>(), any::<bool>()).prop_map(|(by_client, control)| Op::Open { by_client, control }),
        6 => (any::<usize>(), any::<bool>(), 0usize..100_000).prop_map(|(stream, by_opener, len)| Op::Write { stream, by_opener, len }),
        1 => (any::<usize>(), any::<bool>()).prop_map(|(stream, by_opener)| Op::Finish { stream, by_opener }),
        4 => (any::<usize>(), any::<bool>(), 1usize..70_000).prop_map(|(stream, by_opener, max)| Op::Read { stream, by_opener, max }),
        3 => Just(Op::Pump),
        2 => (0u64..20).prop_map(Op::Advance),
    ]
}

#[derive(Debug, Default)]
struct Model {
    id: Option<StreamId>,
    by_client: bool,
    /// Index 0: written by the opener; 1: by the acceptor.
    sent: [Vec<u8>; 2],
    received: [Vec<u8>; 2],
    finished: [bool; 2],
    fin_seen: [bool; 2],
}

struct Harness {
    pair: Pair,
    streams: Vec<Model>,
    rng: Rng,
}

impl Harness {
    fn side(&mut self, client: bool) -> &mut tether_proto::Session {
        if client {
            &mut self.pair.client.session
        } else {
            &mut self.pair.server.session
        }
    }

    /// Accepts offered streams; any failure event is a bug.
    fn handle_events(&mut self) {
        for client in [true, false] {
            let side = if client {
                &mut self.pair.client
            } else {
                &mut self.pair.server
            };
            while let Some(e) = side.events.pop_front() {
                match e {
                    Event::StreamOpened { id, .. } => side
                        .session
                        .accept_stream(id, Bytes::new())
                        .expect("accept"),
                    Event::StreamAccepted { .. }
                    | Event::Readable { .. }
                    | Event::Writable { .. } => {}
                    other => panic!(
                        "unexpected event on the {} side: {other:?}",
                        if client { "client" } else { "server" }
                    ),
                }
            }
        }
    }

    /// The side (client?) that plays `by_opener` for stream `i`.
    fn actor(&self, i: usize, by_opener: bool) -> bool {
        self.streams[i].by_client == by_opener
    }

    fn apply(&mut self, op: Op) {
        match op {
            Op::Open { by_client, control } => {
                let now = self.pair.now;
                let priority = if control {
                    Priority::Control
                } else {
                    Priority::Normal
                };
                let id = self
                    .side(by_client)
                    .open_stream(now, kind::HTTP, priority, None, Bytes::new())
                    .expect("open");
                self.streams.push(Model {
                    id: Some(id),
                    by_client,
                    ..Model::default()
                });
            }
            Op::Write {
                stream,
                by_opener,
                len,
            } => {
                if self.streams.is_empty() {
                    return;
                }
                let i = stream % self.streams.len();
                let client = self.actor(i, by_opener);
                let dir = usize::from(!by_opener);
                let Some(id) = self.streams[i].id else { return };
                if self.streams[i].finished[dir] || self.side(client).stream_state(id).is_none() {
                    return;
                }
                let data: Vec<u8> = (0..len).map(|_| self.rng.next() as u8).collect();
                let n = self.side(client).write(id, &data).expect("write");
                self.streams[i].sent[dir].extend_from_slice(&data[..n]);
            }
            Op::Finish { stream, by_opener } => {
                if self.streams.is_empty() {
                    return;
                }
                let i = stream % self.streams.len();
                self.finish(i, by_opener);
            }
            Op::Read {
                stream,
                by_opener,
                max,
            } => {
                if self.streams.is_empty() {
                    return;
                }
                let i = stream % self.streams.len();
                self.read(i, by_opener, max);
            }
            Op::Pump => self.pair.run(),
            Op::Advance(ms) => self.pair.advance(Duration::from_millis(ms)),
        }
        self.handle_events();
    }

    fn finish(&mut self, i: usize, by_opener: bool) {
        let client = self.actor(i, by_opener);
        let dir = usize::from(!by_opener);
        let Some(id) = self.streams[i].id else { return };
        if self.streams[i].finished[dir] || self.side(client).stream_state(id).is_none() {
            return;
        }
        self.side(client).finish(id).expect("finish");
        self.streams[i].finished[dir] = true;
    }

    /// Reads on stream `i` at the side that is the opener (`by_opener`) or the acceptor.
    fn read(&mut self, i: usize, by_opener: bool, max: usize) {
        let client = self.actor(i, by_opener);
        // What the opener reads was sent by the acceptor, and vice versa.
        let dir = usize::from(by_opener);
        let Some(id) = self.streams[i].id else { return };
        let now = self.pair.now;
        loop {
            match self.side(client).read(now, id, max) {
                Ok(ReadResult::Data(d)) => {
                    assert!(d.len() <= max && !d.is_empty());
                    self.streams[i].received[dir].extend_from_slice(&d);
                }
                Ok(ReadResult::Finished) => {
                    self.streams[i].fin_seen[dir] = true;
                    return;
                }
                Ok(ReadResult::Blocked) => return,
                // The acceptor has not seen the OPEN yet.
                Err(StreamError::UnknownStream(_)) if !by_opener => return,
                Err(e) => panic!("read failed: {e}"),
            }
        }
    }
}

fn run(ops: Vec<Op>, seed: u64, windows: (u32, u32, usize), delay_ms: u64, split: usize) {
    let mut client = config(Role::Client);
    let mut server = config(Role::Server);
    for c in [&mut client, &mut server] {
        c.initial_stream_window = windows.0;
        c.connection_window = windows.1;
        c.send_buffer = windows.2;
    }
    let mut pair = Pair::connected_with(client, server);
    pair.delay = Duration::from_millis(delay_ms);
    pair.split = Some((Rng::new(seed), split));
    let mut h = Harness {
        pair,
        streams: Vec::new(),
        rng: Rng::new(seed ^ 0xdead_beef),
    };
    // At least one stream each way, so that every case moves data.
    h.apply(Op::Open {
        by_client: true,
        control: seed.is_multiple_of(2),
    });
    h.apply(Op::Open {
        by_client: false,
        control: false,
    });
    for op in ops {
        h.apply(op);
    }
    // Finish everything, then pump and read until every stream delivered its FIN both ways.
    for round in 0.. {
        assert!(round < 10_000, "streams never completed");
        for i in 0..h.streams.len() {
            h.finish(i, true);
            h.finish(i, false);
            h.read(i, true, usize::MAX);
            h.read(i, false, usize::MAX);
        }
        if h.streams.iter().all(|s| s.fin_seen == [true, true]) {
            break;
        }
        h.pair.advance(Duration::from_millis(5));
        h.handle_events();
    }
    for (i, s) in h.streams.iter().enumerate() {
        assert!(
            s.received[0] == s.sent[0],
            "stream {i}: opener→acceptor bytes differ"
        );
        assert!(
            s.received[1] == s.sent[1],
            "stream {i}: acceptor→opener bytes differ"
        );
    }
    if std::env::var_os("PROTO_PROPTEST_VERBOSE").is_some() {
        let total: usize = h
            .streams
            .iter()
            .map(|s| s.sent[0].len() + s.sent[1].len())
            .sum();
        eprintln!("streams {} bytes {total}", h.streams.len());
    }
    h.pair.advance(Duration::from_millis(100));
    assert_eq!(h.pair.client.session.stats().open_streams, 0);
    assert_eq!(h.pair.server.session.stats().open_streams, 0);
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 64, ..ProptestConfig::default() })]

    #[test]
    fn bytes_written_are_bytes_read(
        ops in proptest::collection::vec(op(), 1..60),
        seed in any::<u64>(),
        stream_window in 1u32..100_000,
        connection_window in 1u32..300_000,
        send_buffer in 1usize..100_000,
        delay_ms in 0u64..4,
        split in 1usize..70_000,
    ) {
        run(ops, seed, (stream_window, connection_window, send_buffer), delay_ms, split);
    }
}
