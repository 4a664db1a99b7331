//! Arbitrary bytes fed to a Server session after a valid handshake, cut into pieces and interleaved with the
//! application's calls and the poll_* methods. It must never panic, and what it buffers must stay bounded.

#![no_main]

use std::time::{Duration, Instant};

use bytes::{Bytes, BytesMut};
use libfuzzer_sys::fuzz_target;
use tether_proto::{Config, Event, Frame, Priority, Role, Session, Settings, StreamId};

fuzz_target!(|data: &[u8]| {
    let mut now = Instant::now();
    let mut config = Config::new(Role::Server);
    config.initial_stream_window = 4096;
    config.connection_window = 16 * 1024;
    config.max_concurrent_streams = 8;
    let mut session = Session::new(config, now);
    let mut hello = BytesMut::new();
    Frame::Hello { min_version: 1, max_version: 1 }.encode(&mut hello);
    Frame::Settings(Settings::default()).encode(&mut hello);
    session.handle_input(now, hello.freeze());

    let mut input = data;
    let mut streams: Vec<StreamId> = Vec::new();
    while let Some((&op, rest)) = input.split_first() {
        input = rest;
        match op % 8 {
            // Feed the next piece of input, of a size taken from the op byte.
            0..=3 => {
                let n = (usize::from(op >> 3) + 1).min(input.len());
                let (piece, rest) = input.split_at(n);
                input = rest;
                session.handle_input(now, Bytes::copy_from_slice(piece));
            }
            4 => {
                while let Some(chunk) = session.poll_transmit(now) {
                    assert!(!chunk.is_empty());
                }
            }
            5 => {
                now += Duration::from_millis(u64::from(op) * 100);
                if session.poll_timeout().is_some_and(|t| t <= now) {
                    session.handle_timeout(now);
                }
            }
            6 => {
                if let Some(&id) = streams.get(usize::from(op >> 3) % streams.len().max(1)) {
                    let _ = session.read(now, id, usize::from(op) * 16);
                    let _ = session.write(id, &[op; 300]);
                    if op & 0x40 != 0 {
                        let _ = session.finish(id);
                    }
                    if op & 0x80 != 0 && op & 0x20 != 0 {
                        session.reset(id, 8);
                    }
                }
            }
            _ => {
                if op & 0x80 != 0 {
                    if let Ok(id) = session.open_stream(now, 1, Priority::Normal, Some(Duration::from_secs(1)), Bytes::new()) {
                        streams.push(id);
                    }
                } else if op == 0x7f {
                    session.go_away(0, "fuzz");
                }
            }
        }
        while let Some(event) = session.poll_event() {
            if let Event::StreamOpened { id, .. } = event {
                if op & 1 == 0 {
                    let _ = session.accept_stream(id, Bytes::new());
                } else {
                    let _ = session.refuse_stream(id, 11, "no");
                }
                streams.push(id);
            }
        }
        streams.truncate(64);
        // Ours are bounded by the peer's limit (the default 1024), the peer's by ours (8).
        assert!(session.stats().open_streams <= 8 + 1024, "streams beyond the limits");
    }
    session.handle_transport_closed();
    assert!(session.is_closed());
});
