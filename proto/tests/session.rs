//! Two sessions driven against each other in virtual time.

mod harness;

use std::time::Duration;

use bytes::Bytes;
use harness::{Pair, Raw, Rng, config};
use tether_proto::{
    ConnectionError, Event, Frame, OpenError, Priority, ReadResult, Role, Settings, StreamError,
    StreamId, StreamState, code, kind,
};

fn pattern(seed: u64, len: usize) -> Vec<u8> {
    let mut rng = Rng::new(seed);
    (0..len).map(|_| rng.next() as u8).collect()
}

/// Writes all of `data` on `id` from `side` (client or server), pumping as needed, and finishes.
fn send_all(pair: &mut Pair, from_client: bool, id: StreamId, data: &[u8], finish: bool) {
    let mut off = 0;
    while off < data.len() {
        let side = if from_client {
            &mut pair.client
        } else {
            &mut pair.server
        };
        let n = side.session.write(id, &data[off..]).expect("write");
        off += n;
        if n == 0 {
            pair.run();
        }
    }
    if finish {
        let side = if from_client {
            &mut pair.client
        } else {
            &mut pair.server
        };
        side.session.finish(id).expect("finish");
    }
}

#[test]
fn handshake_agrees_on_version_and_settings() {
    let mut server_cfg = config(Role::Server);
    server_cfg.max_concurrent_streams = 7;
    let pair = Pair::connected_with(config(Role::Client), server_cfg);
    assert_eq!(pair.client.session.version(), Some(1));
    assert_eq!(pair.server.session.version(), Some(1));
    assert_eq!(
        pair.client
            .session
            .peer_settings()
            .map(|s| s.max_concurrent_streams),
        Some(7)
    );
    assert_eq!(
        pair.server.session.peer_settings(),
        Some(Settings::default())
    );
    let sent = pair.client.sent_frames();
    assert!(matches!(
        sent[0],
        Frame::Hello {
            min_version: 1,
            max_version: 1
        }
    ));
    assert!(matches!(sent[1], Frame::Settings(_)));
    assert!(pair.client.session.stats().frames_out >= 2);
    assert_eq!(
        pair.client.session.stats().bytes_out,
        pair.server.session.stats().bytes_in
    );
}

#[test]
fn open_accept_data_fin_both_ways() {
    let mut pair = Pair::connected();
    let now = pair.now;
    let id = pair
        .client
        .session
        .open_stream(
            now,
            kind::HTTP,
            Priority::Normal,
            None,
            Bytes::from_static(b"GET /"),
        )
        .expect("open");
    assert_eq!(id, StreamId(1));
    assert_eq!(
        pair.client.session.stream_state(id),
        Some(StreamState::Opening)
    );
    pair.run();
    let Some(Event::StreamOpened {
        id: sid,
        kind: k,
        priority,
        deadline,
        metadata,
    }) = pair
        .server
        .take(|e| matches!(e, Event::StreamOpened { .. }))
    else {
        panic!("no StreamOpened: {:?}", pair.server.events);
    };
    assert_eq!(
        (sid, k, priority, deadline, &metadata[..]),
        (id, kind::HTTP, Priority::Normal, None, &b"GET /"[..])
    );
    assert_eq!(
        pair.server.session.stream_state(id),
        Some(StreamState::Offered)
    );
    pair.server
        .session
        .accept_stream(id, Bytes::from_static(b"ok"))
        .expect("accept");
    pair.run();
    assert_eq!(
        pair.client
            .take(|e| matches!(e, Event::StreamAccepted { .. })),
        Some(Event::StreamAccepted {
            id,
            metadata: Bytes::from_static(b"ok")
        })
    );

    send_all(&mut pair, true, id, b"request body", true);
    pair.run();
    assert!(pair.server.take(|e| *e == Event::Readable { id }).is_some());
    assert_eq!(pair.server.read_all(id), (b"request body".to_vec(), true));
    assert_eq!(
        pair.server.session.stream_state(id),
        Some(StreamState::HalfClosedRemote)
    );
    assert_eq!(
        pair.client.session.stream_state(id),
        Some(StreamState::HalfClosedLocal)
    );

    send_all(&mut pair, false, id, b"response", true);
    pair.run();
    assert!(pair.client.take(|e| *e == Event::Readable { id }).is_some());
    assert_eq!(pair.client.read_all(id), (b"response".to_vec(), true));

    // Both sides are done with the stream: it is forgotten, late reads still say Finished.
    assert_eq!(pair.client.session.stream_state(id), None);
    assert_eq!(pair.server.session.stream_state(id), None);
    assert_eq!(pair.client.session.stats().open_streams, 0);
    assert_eq!(
        pair.client.session.read(pair.now, id, 10),
        Ok(ReadResult::Finished)
    );
    assert_eq!(
        pair.client.session.write(id, b"x"),
        Err(StreamError::Finished)
    );
    assert_eq!(
        pair.client.session.read(pair.now, StreamId(99), 10),
        Err(StreamError::UnknownStream(StreamId(99)))
    );
}

#[test]
fn server_opens_even_ids_client_odd() {
    let mut pair = Pair::connected();
    let now = pair.now;
    let s1 =
        pair.server
            .session
            .open_stream(now, kind::CONTROL, Priority::Control, None, Bytes::new());
    let s2 =
        pair.server
            .session
            .open_stream(now, kind::CONTROL, Priority::Control, None, Bytes::new());
    let c1 = pair
        .client
        .session
        .open_stream(now, kind::HTTP, Priority::Normal, None, Bytes::new());
    assert_eq!(
        (s1, s2, c1),
        (Ok(StreamId(2)), Ok(StreamId(4)), Ok(StreamId(1)))
    );
    pair.run();
    assert!(pair.client.has(|e| matches!(
        e,
        Event::StreamOpened {
            id: StreamId(2),
            priority: Priority::Control,
            ..
        }
    )));
    assert!(pair.client.has(|e| matches!(
        e,
        Event::StreamOpened {
            id: StreamId(4),
            ..
        }
    )));
    assert!(pair.server.has(|e| matches!(
        e,
        Event::StreamOpened {
            id: StreamId(1),
            ..
        }
    )));
}

#[test]
fn data_sent_before_accept_is_delivered() {
    let mut pair = Pair::connected();
    let now = pair.now;
    let id = pair
        .client
        .session
        .open_stream(now, kind::HTTP, Priority::Normal, None, Bytes::new())
        .expect("open");
    send_all(&mut pair, true, id, b"early bytes", true);
    // Nothing run yet: OPEN and DATA leave together.
    pair.run();
    assert!(pair.server.has(|e| matches!(e, Event::StreamOpened { .. })));
    assert_eq!(pair.server.read_all(id), (b"early bytes".to_vec(), true));
    // The acceptor's own data waits for its ACCEPT, which then precedes it on the wire.
    pair.server
        .session
        .write(id, b"late")
        .expect("write before accept buffers");
    pair.run();
    assert_eq!(pair.client.read_all(id), (Vec::new(), false));
    pair.server
        .session
        .accept_stream(id, Bytes::new())
        .expect("accept");
    pair.run();
    assert_eq!(pair.client.read_all(id), (b"late".to_vec(), false));
}

#[test]
fn streams_opened_before_the_handshake_are_sent_after_it() {
    let mut pair = Pair::new(config(Role::Client), config(Role::Server));
    let now = pair.now;
    let id = pair
        .client
        .session
        .open_stream(now, kind::HTTP, Priority::Normal, None, Bytes::new())
        .expect("open");
    pair.client.session.write(id, b"queued").expect("write");
    // Only HELLO and SETTINGS may leave before the peer's SETTINGS arrived.
    let first = pair.client.session.poll_transmit(now).expect("handshake");
    assert_eq!(pair.client.session.poll_transmit(now), None);
    pair.client.sent.push(first.clone());
    let frames = pair.client.sent_frames();
    assert_eq!(frames.len(), 2, "{frames:?}");
    pair.server.session.handle_input(now, first);
    pair.run();
    assert!(pair.server.has(|e| matches!(e, Event::StreamOpened { .. })));
    assert_eq!(pair.server.read_all(id), (b"queued".to_vec(), false));
}

#[test]
fn refuse_ends_the_stream() {
    let mut pair = Pair::connected();
    let now = pair.now;
    let id = pair
        .client
        .session
        .open_stream(now, kind::HTTP, Priority::Normal, None, Bytes::new())
        .expect("open");
    send_all(&mut pair, true, id, &[7; 1000], false);
    pair.run();
    pair.server
        .session
        .refuse_stream(id, code::REFUSED, "forbidden: no such cluster")
        .expect("refuse");
    assert_eq!(pair.server.session.stream_state(id), None);
    pair.run();
    assert_eq!(
        pair.client
            .take(|e| matches!(e, Event::StreamRefused { .. })),
        Some(Event::StreamRefused {
            id,
            code: code::REFUSED,
            reason: "forbidden: no such cluster".into()
        })
    );
    assert_eq!(
        pair.client.session.write(id, b"more"),
        Err(StreamError::Reset(code::REFUSED))
    );
    assert_eq!(pair.client.session.stats().open_streams, 0);
    // Accepting it now is an error on the acceptor side too.
    assert_eq!(
        pair.server.session.accept_stream(id, Bytes::new()),
        Err(StreamError::Reset(code::REFUSED))
    );
}

#[test]
fn accept_and_refuse_only_apply_to_offered_peer_streams() {
    let mut pair = Pair::connected();
    let id = pair.open_accepted(Priority::Normal);
    assert!(matches!(
        pair.client.session.accept_stream(id, Bytes::new()),
        Err(StreamError::InvalidState(_))
    ));
    assert!(matches!(
        pair.server.session.accept_stream(id, Bytes::new()),
        Err(StreamError::InvalidState(_))
    ));
    assert!(matches!(
        pair.server.session.refuse_stream(id, 1, ""),
        Err(StreamError::InvalidState(_))
    ));
}

#[test]
fn unanswered_stream_times_out_at_its_deadline() {
    let mut pair = Pair::connected();
    let now = pair.now;
    let id = pair
        .client
        .session
        .open_stream(
            now,
            kind::HTTP,
            Priority::Normal,
            Some(Duration::from_secs(5)),
            Bytes::new(),
        )
        .expect("open");
    pair.run();
    let Some(Event::StreamOpened { deadline, .. }) = pair
        .server
        .take(|e| matches!(e, Event::StreamOpened { .. }))
    else {
        panic!("not opened");
    };
    assert_eq!(deadline, Some(now + Duration::from_secs(5)));
    assert_eq!(
        pair.client.session.poll_timeout(),
        Some(now + Duration::from_secs(5))
    );
    pair.advance(Duration::from_millis(4999));
    assert!(
        !pair
            .client
            .has(|e| matches!(e, Event::StreamTimedOut { .. }))
    );
    pair.advance(Duration::from_millis(1));
    assert!(
        pair.client
            .take(|e| *e == Event::StreamTimedOut { id })
            .is_some()
    );
    assert_eq!(pair.client.session.stream_state(id), None);
    assert!(
        pair.server
            .take(|e| *e
                == Event::StreamReset {
                    id,
                    code: code::TIMEOUT
                })
            .is_some()
    );
    // A late ACCEPT is ignored, not an error.
    assert_eq!(
        pair.server.session.accept_stream(id, Bytes::new()),
        Err(StreamError::Reset(code::TIMEOUT))
    );
    assert!(pair.client.closed().is_none());
}

#[test]
fn accepted_stream_has_no_deadline_any_more() {
    let mut pair = Pair::connected();
    let now = pair.now;
    let id = pair
        .client
        .session
        .open_stream(
            now,
            kind::HTTP,
            Priority::Normal,
            Some(Duration::from_secs(1)),
            Bytes::new(),
        )
        .expect("open");
    pair.run();
    pair.server
        .session
        .accept_stream(id, Bytes::new())
        .expect("accept");
    pair.advance(Duration::from_secs(5));
    assert!(
        !pair
            .client
            .has(|e| matches!(e, Event::StreamTimedOut { .. }))
    );
    assert_eq!(
        pair.client.session.stream_state(id),
        Some(StreamState::Open)
    );
}

#[test]
fn one_mib_with_small_windows_and_random_chunking() {
    let mut client = config(Role::Client);
    let mut server = config(Role::Server);
    for c in [&mut client, &mut server] {
        c.initial_stream_window = 5000;
        c.connection_window = 12_000;
        c.send_buffer = 7000;
    }
    let mut pair = Pair::connected_with(client, server);
    let id = pair.open_accepted(Priority::Normal);
    pair.delay = Duration::from_millis(3);
    pair.split = Some((Rng::new(42), 3000));
    let data = pattern(1, 1 << 20);
    let mut got = Vec::new();
    let mut off = 0;
    let mut fin = false;
    let mut max_buffered_frame = 0;
    while !fin {
        if off < data.len() {
            let n = pair
                .client
                .session
                .write(id, &data[off..(off + 3333).min(data.len())])
                .expect("write");
            off += n;
            if off == data.len() {
                pair.client.session.finish(id).expect("finish");
            }
        }
        pair.advance(Duration::from_millis(1));
        loop {
            match pair.server.session.read(pair.now, id, 1500).expect("read") {
                ReadResult::Data(d) => {
                    max_buffered_frame = max_buffered_frame.max(d.len());
                    got.extend_from_slice(&d);
                }
                ReadResult::Finished => {
                    fin = true;
                    break;
                }
                ReadResult::Blocked => break,
            }
        }
    }
    assert_eq!(got.len(), data.len());
    assert!(got == data, "payload corrupted");
    assert!(max_buffered_frame <= 1500);
    // No DATA frame was larger than the stream window.
    for f in pair.client.sent_frames() {
        if let Frame::Data { payload, .. } = f {
            assert!(payload.len() <= 5000);
        }
    }
}

#[test]
fn many_streams_interleave_in_both_directions() {
    let mut pair = Pair::connected();
    pair.split = Some((Rng::new(7), 50_000));
    let ids: Vec<StreamId> = (0..64)
        .map(|_| pair.open_accepted(Priority::Normal))
        .collect();
    for (i, id) in ids.iter().enumerate() {
        let up = pattern(i as u64, 20_000 + i * 1000);
        let down = pattern(1000 + i as u64, 40_000 - i * 100);
        assert_eq!(pair.client.session.write(*id, &up), Ok(up.len()));
        pair.client.session.finish(*id).expect("finish");
        assert_eq!(pair.server.session.write(*id, &down), Ok(down.len()));
        pair.server.session.finish(*id).expect("finish");
    }
    // Round-robin: the first DATA frames of the client alternate between streams.
    pair.run();
    let mut order = Vec::new();
    for f in pair.client.sent_frames() {
        if let Frame::Data { stream, .. } = f {
            order.push(stream);
        }
    }
    assert_eq!(&order[..3], &[ids[0], ids[1], ids[2]]);
    for (i, id) in ids.iter().enumerate() {
        let (up, up_fin) = pair.server.read_all(*id);
        let (down, down_fin) = pair.client.read_all(*id);
        assert!(up_fin && down_fin);
        assert!(up == pattern(i as u64, 20_000 + i * 1000));
        assert!(down == pattern(1000 + i as u64, 40_000 - i * 100));
    }
    pair.run();
    assert_eq!(pair.client.session.stats().open_streams, 0);
    assert_eq!(pair.server.session.stats().open_streams, 0);
}

#[test]
fn stalled_reader_does_not_block_another_stream() {
    let mut pair = Pair::connected();
    let stalled = pair.open_accepted(Priority::Normal);
    let live = pair.open_accepted(Priority::Normal);
    // The server sends far more than a stream window on `stalled`; the client never reads it.
    let mut pushed = 0;
    for _ in 0..20 {
        pushed += pair
            .server
            .session
            .write(stalled, &[1; 100_000])
            .expect("write");
        pair.run();
    }
    let window = 256 * 1024;
    assert!(
        pushed <= window + 256 * 1024,
        "sender buffered beyond window + send buffer: {pushed}"
    );
    // `live` still flows both ways while `stalled` is stuck.
    let big = pattern(9, 2 << 20);
    let mut off = 0;
    let mut got = Vec::new();
    while got.len() < big.len() {
        if off < big.len() {
            off += pair.server.session.write(live, &big[off..]).expect("write");
        }
        pair.run();
        got.extend(pair.client.read_all(live).0);
    }
    assert!(got == big);
    // The stalled stream holds exactly one stream window of data at the receiver.
    let (stuck, _) = pair.client.read_all(stalled);
    assert_eq!(stuck.len(), window);
}

#[test]
fn control_priority_data_overtakes_bulk_data() {
    let mut pair = Pair::connected();
    let bulk = pair.open_accepted(Priority::Normal);
    let ctl = pair.open_accepted(Priority::Control);
    let now = pair.now;
    assert_eq!(pair.client.session.write(bulk, &[0; 200_000]), Ok(200_000));
    let first = pair.client.session.poll_transmit(now).expect("bulk frame");
    assert!(first.len() > 1000);
    pair.client.session.write(ctl, b"heartbeat").expect("write");
    let next = pair
        .client
        .session
        .poll_transmit(now)
        .expect("control frame");
    let mut next = next;
    assert_eq!(
        Frame::decode(&mut next, 1 << 24),
        Ok(Some(Frame::Data {
            stream: ctl,
            fin: false,
            payload: Bytes::from_static(b"heartbeat")
        }))
    );
    // A RESET (a control frame) goes before the remaining bulk data too.
    pair.client.session.reset(ctl, code::CANCEL);
    let mut reset = pair.client.session.poll_transmit(now).expect("reset");
    assert_eq!(
        Frame::decode(&mut reset, 1 << 24),
        Ok(Some(Frame::Reset {
            stream: ctl,
            code: code::CANCEL
        }))
    );
}

#[test]
fn write_returns_zero_when_full_then_writable() {
    let mut client = config(Role::Client);
    client.send_buffer = 10_000;
    let mut server = config(Role::Server);
    server.initial_stream_window = 4000;
    let mut pair = Pair::connected_with(client, server);
    let id = pair.open_accepted(Priority::Normal);
    assert_eq!(pair.client.session.write(id, &[1; 12_000]), Ok(10_000));
    assert_eq!(pair.client.session.write(id, &[1; 10]), Ok(0));
    pair.run();
    // 4000 bytes went out (the window), so there is room again.
    assert!(pair.client.take(|e| *e == Event::Writable { id }).is_some());
    assert_eq!(pair.client.session.write(id, &[1; 5000]), Ok(4000));
    // Reading on the server grants credit, the rest flows.
    let mut total = 0;
    for _ in 0..10 {
        total += pair.server.read_all(id).0.len();
        pair.run();
    }
    assert_eq!(total, 14_000);
}

#[test]
fn reset_by_peer_is_reported_and_remembered() {
    let mut pair = Pair::connected();
    let id = pair.open_accepted(Priority::Normal);
    send_all(&mut pair, false, id, &[3; 5000], false);
    pair.run();
    pair.client.session.reset(id, code::CANCEL);
    pair.run();
    assert!(
        pair.server
            .take(|e| *e
                == Event::StreamReset {
                    id,
                    code: code::CANCEL
                })
            .is_some()
    );
    assert_eq!(
        pair.server.session.write(id, b"x"),
        Err(StreamError::Reset(code::CANCEL))
    );
    assert_eq!(
        pair.client.session.read(pair.now, id, 10),
        Err(StreamError::Reset(code::CANCEL))
    );
    assert_eq!(pair.server.session.stats().open_streams, 0);
    // Resetting again or an unknown stream is a no-op.
    pair.client.session.reset(id, code::CANCEL);
    pair.client.session.reset(StreamId(1001), code::CANCEL);
    pair.run();
    assert!(pair.server.closed().is_none() && pair.client.closed().is_none());
}

#[test]
fn unread_data_of_a_reset_stream_returns_connection_credit() {
    let mut client = config(Role::Client);
    client.connection_window = 100_000;
    let mut pair = Pair::connected_with(client, config(Role::Server));
    // Fill most of the client's connection window on one stream, then reset it unread.
    for round in 0..5 {
        let id = pair.open_accepted(Priority::Normal);
        send_all(&mut pair, false, id, &[round; 90_000], false);
        pair.run();
        pair.client.session.reset(id, code::CANCEL);
        pair.run();
    }
    // Had the credit leaked, this stream could not deliver anything.
    let id = pair.open_accepted(Priority::Normal);
    send_all(&mut pair, false, id, &[9; 90_000], true);
    pair.run();
    assert_eq!(pair.client.read_all(id).0.len(), 90_000);
}

#[test]
fn streams_nobody_reads_cannot_freeze_the_connection() {
    // 64 large answers the relay's users never read (e.g. `GET /openapi/v2`) hold 64 full stream windows, the
    // whole 16 MiB connection window: another stream on the same connection is still answered, because
    // connection credit comes back as soon as data sits in a stream within that stream's own window.
    let mut pair = Pair::connected();
    let window = config(Role::Server).initial_stream_window as usize;
    let big = vec![3u8; 2 * window];
    let mut unread = Vec::new();
    for _ in 0..64 {
        let id = pair.open_accepted(Priority::Normal);
        // The server answers on a stream the client opened: the relay opens, the agent answers.
        let _ = pair.server.session.write(id, &big).expect("write");
        unread.push(id);
    }
    pair.advance(Duration::from_millis(10));
    let id = pair.open_accepted(Priority::Normal);
    let data = pattern(5, 1 << 20);
    let mut got = Vec::new();
    let mut off = 0;
    for _ in 0..10_000 {
        if got.len() == data.len() {
            break;
        }
        if off < data.len() {
            off += pair.server.session.write(id, &data[off..]).expect("write");
        }
        pair.advance(Duration::from_micros(100));
        got.extend_from_slice(&pair.client.read_all(id).0);
    }
    assert_eq!(got.len(), data.len(), "the other stream froze");
    assert_eq!(got, data);
    // Each unread stream holds no more than its own window.
    for id in unread {
        let (held, _) = pair.client.read_all(id);
        assert_eq!(held.len(), window);
    }
}

#[test]
fn ping_measures_rtt_and_keeps_alive() {
    let mut pair = Pair::new(config(Role::Client), config(Role::Server));
    pair.delay = Duration::from_millis(40);
    pair.advance(Duration::from_millis(200));
    // The first PING goes out when the handshake completes.
    assert_eq!(pair.client.session.rtt(), Some(Duration::from_millis(80)));
    assert_eq!(pair.server.session.rtt(), Some(Duration::from_millis(80)));
    // Idle for several keepalive intervals: PINGs keep both sides alive.
    pair.advance(Duration::from_secs(120));
    assert!(pair.client.closed().is_none(), "{:?}", pair.client.events);
    assert!(pair.server.closed().is_none());
    let pings = pair
        .client
        .sent_frames()
        .iter()
        .filter(|f| matches!(f, Frame::Ping { ack: false, .. }))
        .count();
    assert!(pings >= 120 / 15, "only {pings} pings");
    assert_eq!(pair.client.session.rtt(), Some(Duration::from_millis(80)));
}

#[test]
fn silent_peer_times_out() {
    let mut raw = Raw::connected(config(Role::Client));
    let start = raw.now;
    let mut pinged_at = None;
    while raw.closed().is_none() {
        let t = raw.session.poll_timeout().expect("a timer");
        raw.now = t;
        raw.session.handle_timeout(t);
        raw.drain();
        if pinged_at.is_none()
            && raw
                .out
                .iter()
                .filter(|f| matches!(f, Frame::Ping { ack: false, .. }))
                .count()
                == 2
        {
            pinged_at = Some(t);
        }
    }
    assert_eq!(pinged_at, Some(start + Duration::from_secs(15)));
    assert_eq!(raw.now, start + Duration::from_secs(45));
    assert_eq!(
        raw.closed(),
        Some(Some(ConnectionError::TimedOut(Duration::from_secs(45))))
    );
    assert_eq!(raw.goaway_code(), Some(code::TIMEOUT));
    assert!(raw.session.is_closed());
    assert_eq!(raw.session.poll_timeout(), None);
}

#[test]
fn handshake_times_out() {
    let mut raw = Raw::new(config(Role::Server));
    let t = raw.session.poll_timeout().expect("timer");
    assert_eq!(t, raw.now + Duration::from_secs(10));
    raw.now = t;
    raw.session.handle_timeout(t);
    raw.drain();
    assert_eq!(raw.closed(), Some(Some(ConnectionError::HandshakeTimedOut)));
}

#[test]
fn version_mismatch_sends_goaway() {
    let mut raw = Raw::new(config(Role::Server));
    raw.feed(&[Frame::Hello {
        min_version: 2,
        max_version: 5,
    }]);
    assert_eq!(raw.goaway_code(), Some(code::VERSION_MISMATCH));
    assert_eq!(
        raw.closed(),
        Some(Some(ConnectionError::VersionMismatch {
            ours: (1, 1),
            theirs: (2, 5)
        }))
    );
    // HELLO and SETTINGS still went out first, so the peer learns our range.
    assert!(matches!(raw.out[0], Frame::Hello { .. }));
    assert!(raw.session.is_closed());
}

#[test]
fn highest_common_version_is_chosen() {
    let mut raw = Raw::new(config(Role::Server));
    raw.feed(&[
        Frame::Hello {
            min_version: 0,
            max_version: 9,
        },
        Frame::Settings(Settings::default()),
    ]);
    assert!(raw.events.contains(&Event::Connected { version: 1 }));
}

#[test]
fn go_away_drains_then_closes() {
    let mut pair = Pair::connected();
    let id = pair.open_accepted(Priority::Normal);
    pair.server
        .session
        .go_away(code::NO_ERROR, "relay restarting");
    pair.run();
    assert_eq!(
        pair.client.take(|e| matches!(e, Event::GoAway { .. })),
        Some(Event::GoAway {
            last_stream: id,
            code: code::NO_ERROR,
            reason: "relay restarting".into()
        })
    );
    let now = pair.now;
    assert_eq!(
        pair.client
            .session
            .open_stream(now, kind::HTTP, Priority::Normal, None, Bytes::new()),
        Err(OpenError::Closing)
    );
    assert_eq!(
        pair.server
            .session
            .open_stream(now, kind::HTTP, Priority::Normal, None, Bytes::new()),
        Err(OpenError::Closing)
    );
    // The open stream still works to the end.
    send_all(&mut pair, true, id, b"last request", true);
    pair.run();
    assert_eq!(pair.server.read_all(id), (b"last request".to_vec(), true));
    send_all(&mut pair, false, id, b"last response", true);
    pair.run();
    // The server is done with its last stream, so it closed and the transport went away before the client
    // application read the response: a clean close, and what arrived stays readable.
    assert_eq!(pair.server.closed(), Some(None));
    assert_eq!(pair.client.closed(), Some(None));
    assert!(pair.client.session.is_closed() && pair.server.session.is_closed());
    assert!(matches!(
        pair.client.events.back(),
        Some(Event::Closed { .. })
    ));
    assert_eq!(pair.client.read_all(id), (b"last response".to_vec(), true));
    assert_eq!(
        pair.client.session.read(pair.now, id, 1),
        Ok(ReadResult::Finished)
    );
    assert_eq!(pair.client.session.stats().open_streams, 0);
}

#[test]
fn goaway_fails_streams_above_last_and_refuses_new_ones() {
    // Client side: the peer's GOAWAY names stream 1 as its last; 3 is failed for retry elsewhere.
    let mut raw = Raw::connected(config(Role::Client));
    let now = raw.now;
    let a = raw
        .session
        .open_stream(now, kind::HTTP, Priority::Normal, None, Bytes::new())
        .expect("open");
    let b = raw
        .session
        .open_stream(now, kind::HTTP, Priority::Normal, None, Bytes::new())
        .expect("open");
    raw.drain();
    raw.feed(&[Frame::GoAway {
        last_stream: a,
        code: code::SHUTDOWN,
        reason: Bytes::from_static(b"bye"),
    }]);
    assert!(raw.events.contains(&Event::StreamReset {
        id: b,
        code: code::SHUTDOWN
    }));
    assert!(raw.events.contains(&Event::GoAway {
        last_stream: a,
        code: code::SHUTDOWN,
        reason: "bye".into()
    }));
    assert_eq!(raw.session.stream_state(a), Some(StreamState::Opening));
    assert!(raw.closed().is_none());

    // Server side: after go_away, a new OPEN is refused with SHUTDOWN and surfaces no event.
    let mut raw = Raw::connected(config(Role::Server));
    raw.feed(&[Frame::Open {
        stream: StreamId(1),
        kind: 1,
        priority: 1,
        deadline_ms: 0,
        metadata: Bytes::new(),
    }]);
    raw.session.go_away(code::NO_ERROR, "");
    raw.drain();
    assert!(raw.out.iter().any(|f| matches!(
        f,
        Frame::GoAway {
            last_stream: StreamId(1),
            ..
        }
    )));
    raw.feed(&[Frame::Open {
        stream: StreamId(3),
        kind: 1,
        priority: 1,
        deadline_ms: 0,
        metadata: Bytes::new(),
    }]);
    assert!(raw.out.iter().any(|f| matches!(
        f,
        Frame::Refuse {
            stream: StreamId(3),
            code: code::SHUTDOWN,
            ..
        }
    )));
    assert!(!raw.events.iter().any(|e| matches!(
        e,
        Event::StreamOpened {
            id: StreamId(3),
            ..
        }
    )));
}

#[test]
fn close_is_immediate() {
    let mut pair = Pair::connected();
    let id = pair.open_accepted(Priority::Normal);
    pair.client
        .session
        .close(code::INTERNAL_ERROR, "agent crashed");
    assert_eq!(
        pair.client.closed(),
        None,
        "events are only collected by the harness on the next run"
    );
    pair.run();
    assert_eq!(
        pair.client.closed(),
        Some(Some(ConnectionError::ClosedLocally {
            code: code::INTERNAL_ERROR,
            reason: "agent crashed".into()
        }))
    );
    assert_eq!(
        pair.server.closed(),
        Some(Some(ConnectionError::ClosedByPeer {
            code: code::INTERNAL_ERROR,
            reason: "agent crashed".into()
        }))
    );
    assert_eq!(
        pair.server.session.read(pair.now, id, 1),
        Err(StreamError::ConnectionClosed)
    );
    let now = pair.now;
    assert_eq!(
        pair.client
            .session
            .open_stream(now, kind::HTTP, Priority::Normal, None, Bytes::new()),
        Err(OpenError::Closing)
    );
}

#[test]
fn transport_loss_fails_the_session() {
    let mut pair = Pair::connected();
    pair.open_accepted(Priority::Normal);
    pair.client.session.handle_transport_closed();
    assert_eq!(
        pair.client.session.poll_event(),
        Some(Event::Closed {
            error: Some(ConnectionError::TransportClosed)
        })
    );
    assert_eq!(pair.client.session.poll_event(), None);
    assert!(pair.client.session.is_closed());
}

#[test]
fn concurrent_stream_limit_is_enforced_locally_and_remotely() {
    let mut server = config(Role::Server);
    server.max_concurrent_streams = 2;
    let mut pair = Pair::connected_with(config(Role::Client), server);
    let a = pair.open_accepted(Priority::Normal);
    pair.open_accepted(Priority::Normal);
    let now = pair.now;
    assert_eq!(
        pair.client
            .session
            .open_stream(now, kind::HTTP, Priority::Normal, None, Bytes::new()),
        Err(OpenError::TooManyStreams(2))
    );
    pair.client.session.reset(a, code::CANCEL);
    pair.run();
    assert!(
        pair.client
            .session
            .open_stream(now, kind::HTTP, Priority::Normal, None, Bytes::new())
            .is_ok()
    );

    // A peer that ignores our limit gets REFUSE, and the connection survives.
    let mut limited = config(Role::Server);
    limited.max_concurrent_streams = 1;
    let mut raw = Raw::connected(limited);
    let open = |id| Frame::Open {
        stream: StreamId(id),
        kind: 1,
        priority: 1,
        deadline_ms: 0,
        metadata: Bytes::new(),
    };
    raw.feed(&[
        open(1),
        open(3),
        Frame::Data {
            stream: StreamId(3),
            fin: false,
            payload: Bytes::from_static(b"x"),
        },
    ]);
    assert!(raw.out.iter().any(|f| matches!(
        f,
        Frame::Refuse {
            stream: StreamId(3),
            code: code::REFUSED_TOO_MANY_STREAMS,
            ..
        }
    )));
    assert!(raw.closed().is_none());
    assert_eq!(raw.session.stats().open_streams, 1);
}

#[test]
fn metadata_too_large_is_rejected_locally() {
    let mut pair = Pair::connected();
    let now = pair.now;
    let big = Bytes::from(vec![0; 16 * 1024 + 1]);
    assert_eq!(
        pair.client
            .session
            .open_stream(now, kind::HTTP, Priority::Normal, None, big),
        Err(OpenError::MetadataTooLarge)
    );
    let fits = Bytes::from(vec![0; 16 * 1024]);
    let id = pair
        .client
        .session
        .open_stream(now, kind::HTTP, Priority::Normal, None, fits)
        .expect("16 KiB fits");
    pair.run();
    assert!(pair.server.has(|e| matches!(e, Event::StreamOpened { id: i, metadata, .. } if *i == id && metadata.len() == 16 * 1024)));
}

#[test]
fn received_payloads_share_the_input_buffer() {
    let mut raw = Raw::connected(config(Role::Server));
    raw.feed(&[Frame::Open {
        stream: StreamId(1),
        kind: 1,
        priority: 1,
        deadline_ms: 0,
        metadata: Bytes::new(),
    }]);
    let mut wire = bytes::BytesMut::new();
    Frame::Data {
        stream: StreamId(1),
        fin: false,
        payload: Bytes::from(vec![5; 1000]),
    }
    .encode(&mut wire);
    let wire = wire.freeze();
    let range = wire.as_ptr() as usize..wire.as_ptr() as usize + wire.len();
    raw.feed_bytes(wire);
    let Ok(ReadResult::Data(d)) = raw.session.read(raw.now, StreamId(1), 4096) else {
        panic!("no data")
    };
    assert_eq!(d.len(), 1000);
    assert!(range.contains(&(d.as_ptr() as usize)), "payload was copied");
}

#[test]
fn tiny_frames_are_coalesced_not_pinned() {
    let mut raw = Raw::connected(config(Role::Server));
    raw.feed(&[Frame::Open {
        stream: StreamId(1),
        kind: 1,
        priority: 1,
        deadline_ms: 0,
        metadata: Bytes::new(),
    }]);
    // 10 000 one-byte DATA frames in one input.
    let mut wire = bytes::BytesMut::new();
    for i in 0..10_000u32 {
        Frame::Data {
            stream: StreamId(1),
            fin: false,
            payload: Bytes::from(vec![i as u8]),
        }
        .encode(&mut wire);
    }
    raw.feed_bytes(wire.freeze());
    // Then a 1000-byte DATA frame inside a much larger input: copied rather than pinning the input.
    let mut wire = bytes::BytesMut::new();
    Frame::Data {
        stream: StreamId(1),
        fin: false,
        payload: Bytes::from(vec![9; 1000]),
    }
    .encode(&mut wire);
    for _ in 0..1000 {
        Frame::WindowUpdate {
            stream: StreamId(0),
            increment: 1,
        }
        .encode(&mut wire);
    }
    let big = wire.freeze();
    let range = big.as_ptr() as usize..big.as_ptr() as usize + big.len();
    raw.feed_bytes(big);
    assert!(raw.closed().is_none());
    let mut segments = Vec::new();
    while let Ok(ReadResult::Data(d)) = raw.session.read(raw.now, StreamId(1), usize::MAX) {
        segments.push(d);
    }
    assert_eq!(segments.iter().map(Bytes::len).sum::<usize>(), 11_000);
    assert!(
        segments.len() <= 2,
        "{} segments for 10 001 frames",
        segments.len()
    );
    assert!(
        segments
            .iter()
            .all(|d| !range.contains(&(d.as_ptr() as usize)))
    );
    let expected: Vec<u8> = (0..10_000u32)
        .map(|i| i as u8)
        .chain(std::iter::repeat_n(9, 1000))
        .collect();
    assert_eq!(segments.concat(), expected);
}

#[test]
fn chunked_input_one_byte_at_a_time() {
    let mut pair = Pair::connected();
    pair.split = Some((Rng::new(3), 1));
    let id = pair.open_accepted(Priority::Normal);
    send_all(&mut pair, true, id, &pattern(5, 70_000), true);
    pair.run();
    assert_eq!(pair.server.read_all(id), (pattern(5, 70_000), true));
}

/// Sends `total` bytes on a new stream while the server reads everything after each step of `step` virtual time;
/// returns the WINDOW_UPDATE increments the server granted for the stream and the most bytes ever written but
/// not read (held by the server, or still in the client's send buffer).
fn transfer_with_reader(
    total: usize,
    step: Duration,
    stall_after: Option<usize>,
) -> (Vec<u32>, usize) {
    let mut pair = Pair::connected();
    let id = pair.open_accepted(Priority::Normal);
    let chunk = vec![7u8; 64 * 1024];
    let (mut sent, mut read, mut most_unread) = (0usize, 0usize, 0usize);
    for _ in 0..100_000 {
        if sent >= total {
            break;
        }
        let n = pair
            .client
            .session
            .write(id, &chunk[..chunk.len().min(total - sent)])
            .expect("write");
        sent += n;
        pair.advance(step);
        let stalled = stall_after.is_some_and(|at| read >= at);
        most_unread = most_unread.max(sent - read);
        if !stalled {
            let (got, _) = pair.server.read_all(id);
            read += got.len();
        } else if n == 0 {
            break;
        }
    }
    let increments = pair
        .server
        .sent_frames()
        .into_iter()
        .filter_map(|f| match f {
            Frame::WindowUpdate { stream, increment } if stream == id => Some(increment),
            _ => None,
        })
        .collect();
    (increments, most_unread)
}

#[test]
fn a_fast_readers_window_grows_to_the_maximum() {
    let defaults = config(Role::Server);
    // Each step is far shorter than the tuning period: the reader keeps up with anything.
    let (increments, _) = transfer_with_reader(64 << 20, Duration::from_micros(10), None);
    let largest = increments.iter().copied().max().unwrap_or(0);
    // A grant that doubles the window carries the growth on top of what was read.
    assert!(
        largest > defaults.initial_stream_window,
        "no growth: {increments:?}"
    );
    let granted: u64 = increments.iter().map(|&i| u64::from(i)).sum();
    // Credit never exceeds what was read plus the largest window.
    assert!(granted <= (64 << 20) + u64::from(defaults.max_stream_window));
}

#[test]
fn a_slow_reader_keeps_the_initial_window() {
    let defaults = config(Role::Server);
    // Each step is longer than the tuning period: half a window is never read that fast.
    let (increments, _) = transfer_with_reader(8 << 20, Duration::from_millis(5), None);
    assert!(!increments.is_empty());
    for i in &increments {
        // Only what was read comes back: half the window, give or take one read.
        assert!(*i <= defaults.initial_stream_window, "grew: {increments:?}");
    }
}

#[test]
fn a_reader_that_stalls_after_growing_holds_at_most_the_maximum_window() {
    let defaults = config(Role::Server);
    let (_, most_unread) =
        transfer_with_reader(256 << 20, Duration::from_micros(10), Some(32 << 20));
    // The stream's largest window at the server, plus the client's own send buffer.
    assert!(
        most_unread <= defaults.max_stream_window as usize + defaults.send_buffer,
        "{most_unread} bytes held for a stalled reader"
    );
    assert!(most_unread > defaults.initial_stream_window as usize);
}

#[test]
fn streams_that_grew_and_stalled_leave_room_for_the_others() {
    let mut pair = Pair::connected();
    let chunk = vec![7u8; 64 * 1024];
    // Twenty streams, each read fast until its window could have grown to the largest, then never read again:
    // without a bound on growth their windows together would be the whole connection window.
    let mut stalled = Vec::new();
    for _ in 0..20 {
        let id = pair.open_accepted(Priority::Normal);
        let mut read = 0;
        while read < 4 << 20 {
            let _ = pair.client.session.write(id, &chunk).expect("write");
            pair.advance(Duration::from_micros(10));
            read += pair.server.read_all(id).0.len();
        }
        stalled.push(id);
    }
    // They keep being written to until the client can send no more on any of them.
    for _ in 0..1000 {
        let mut took = 0;
        for id in &stalled {
            took += pair.client.session.write(*id, &chunk).expect("write");
        }
        pair.advance(Duration::from_micros(10));
        if took == 0 {
            break;
        }
    }
    // A new stream still gets through: the grown windows took at most half the connection window.
    let id = pair.open_accepted(Priority::Normal);
    let data = pattern(9, 1 << 20);
    let mut got = Vec::new();
    let mut off = 0;
    for _ in 0..10_000 {
        if got.len() == data.len() {
            break;
        }
        if off < data.len() {
            off += pair.client.session.write(id, &data[off..]).expect("write");
        }
        pair.advance(Duration::from_micros(10));
        got.extend_from_slice(&pair.server.read_all(id).0);
    }
    assert!(
        got == data,
        "the new stream was stuck behind the stalled ones"
    );
}

/// Opens a stream from the client and has the server accept it with its ACCEPT deferred for `hold`.
fn deferred(pair: &mut Pair, metadata: &'static [u8], hold: Duration) -> StreamId {
    let now = pair.now;
    let id = pair
        .client
        .session
        .open_stream(now, kind::HTTP, Priority::Normal, None, Bytes::new())
        .expect("open");
    pair.run();
    assert!(
        pair.server
            .take(|e| matches!(e, Event::StreamOpened { .. }))
            .is_some()
    );
    pair.server
        .session
        .accept_stream_deferred(id, Bytes::from_static(metadata), now + hold)
        .expect("accept");
    id
}

#[test]
fn a_deferred_accept_leaves_with_the_stream_s_first_data() {
    let mut pair = Pair::connected();
    let id = deferred(&mut pair, b"ok", Duration::from_secs(5));
    let sent_before = pair.server.sent.len();
    let send_by = pair.now + Duration::from_secs(5);
    assert_eq!(
        pair.server.session.stream_state(id),
        Some(StreamState::Open),
        "accepted on our side at once"
    );
    assert!(
        pair.server
            .session
            .poll_timeout()
            .is_some_and(|t| t <= send_by)
    );
    pair.run();
    assert_eq!(
        pair.server.sent.len(),
        sent_before,
        "nothing sent for it alone"
    );
    assert!(
        !pair
            .client
            .has(|e| matches!(e, Event::StreamAccepted { .. }))
    );

    send_all(&mut pair, false, id, b"the response", true);
    // One poll of the server's output: the ACCEPT comes first, the DATA right behind it.
    let now = pair.now;
    let first = pair.server.session.poll_transmit(now).expect("a chunk");
    let second = pair.server.session.poll_transmit(now).expect("a chunk");
    let mut wire = bytes::BytesMut::new();
    wire.extend_from_slice(&first);
    wire.extend_from_slice(&second);
    let mut wire = wire.freeze();
    let mut frames = Vec::new();
    while let Some(f) = Frame::decode(&mut wire, 1 << 20).expect("decode") {
        frames.push(f);
    }
    assert!(
        matches!(
            frames.as_slice(),
            [Frame::Accept { stream, .. }, Frame::Data { stream: d, fin: true, .. }]
                if *stream == id && *d == id
        ),
        "{frames:?}"
    );
}

#[test]
fn a_deferred_accept_goes_alone_at_its_time_and_any_other_frame_takes_it_along() {
    let mut pair = Pair::connected();
    // Nothing else to send: it goes at its time, not before.
    deferred(&mut pair, b"", Duration::from_millis(20));
    pair.advance(Duration::from_millis(19));
    assert!(
        !pair
            .client
            .has(|e| matches!(e, Event::StreamAccepted { .. }))
    );
    pair.advance(Duration::from_millis(2));
    assert!(
        pair.client
            .take(|e| matches!(e, Event::StreamAccepted { .. }))
            .is_some()
    );

    // A reset of the stream (the upstream failed) follows its ACCEPT, which goes at once with it.
    let id = deferred(&mut pair, b"", Duration::from_secs(60));
    pair.server.session.reset(id, code::CANCEL);
    pair.run();
    let frames = pair.server.sent_frames();
    let accept_at = frames
        .iter()
        .position(|f| matches!(f, Frame::Accept { stream, .. } if *stream == id));
    let reset_at = frames
        .iter()
        .position(|f| matches!(f, Frame::Reset { stream, .. } if *stream == id));
    assert!(
        matches!((accept_at, reset_at), (Some(a), Some(r)) if a < r),
        "{frames:?}"
    );
    assert!(
        pair.client
            .take(|e| matches!(e, Event::StreamReset { .. }))
            .is_some()
    );
}

#[test]
fn a_closed_session_drops_its_deferred_accepts() {
    let mut pair = Pair::connected();
    deferred(&mut pair, b"", Duration::from_secs(60));
    pair.server
        .session
        .close(code::INTERNAL_ERROR, "going down");
    assert_eq!(pair.server.session.poll_timeout(), None);
    pair.run();
    let frames = pair.server.sent_frames();
    assert!(
        !frames.iter().any(|f| matches!(f, Frame::Accept { .. })),
        "{frames:?}"
    );
    assert!(frames.iter().any(|f| matches!(f, Frame::GoAway { .. })));
}
