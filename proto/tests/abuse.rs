//! Each abuse bound ends the connection with GOAWAY (except early resets of streams, which users cause: those
//! make the session shed new streams for a moment) (ENHANCE_YOUR_CALM, PROTOCOL_ERROR, FLOW_CONTROL_ERROR or
//! FRAME_SIZE_ERROR), and memory stays bounded by configuration, not by what the peer sends.

mod harness;

use bytes::{Bytes, BytesMut};
use harness::{Raw, config};
use tether_proto::{
    ConnectionError, Event, Frame, FrameHeader, MAX_WINDOW, Role, Settings, StreamId, code,
};

fn open(id: u32) -> Frame {
    Frame::Open {
        stream: StreamId(id),
        kind: 1,
        priority: 1,
        deadline_ms: 0,
        metadata: Bytes::new(),
    }
}

fn data(id: u32, len: usize, fin: bool) -> Frame {
    Frame::Data {
        stream: StreamId(id),
        fin,
        payload: Bytes::from(vec![0xab; len]),
    }
}

fn server() -> Raw {
    Raw::connected(config(Role::Server))
}

/// Asserts the session closed itself with GOAWAY `code` and reported the violation.
#[track_caller]
fn assert_violation(raw: &Raw, expected: u32) {
    assert_eq!(
        raw.goaway_code(),
        Some(expected),
        "frames sent: {:?}",
        raw.out
    );
    match raw.closed() {
        Some(Some(ConnectionError::ProtocolViolation { code, .. })) => assert_eq!(code, expected),
        other => panic!("expected a protocol violation, got {other:?}"),
    }
    assert!(raw.session.is_closed());
    assert!(
        matches!(raw.events.last(), Some(Event::Closed { .. })),
        "Closed is the last event"
    );
}

/// After a violation, further input is ignored: no events, nothing sent.
fn assert_deaf(mut raw: Raw) {
    let (events, out) = (raw.events.len(), raw.out.len());
    raw.feed(&[
        open(100_001),
        Frame::Ping {
            ack: false,
            data: [1; 8],
        },
    ]);
    assert_eq!((raw.events.len(), raw.out.len()), (events, out));
}

#[test]
fn ping_flood() {
    let mut raw = server();
    let pings: Vec<Frame> = (0..32u64)
        .map(|i| Frame::Ping {
            ack: false,
            data: i.to_be_bytes(),
        })
        .collect();
    // 32 unanswered pongs are tolerated...
    raw.feed_no_drain(&pings);
    assert!(raw.session.poll_event().is_none(), "closed at 32 pings");
    // ...and answered once transmitted.
    raw.drain();
    assert_eq!(
        raw.out
            .iter()
            .filter(|f| matches!(f, Frame::Ping { ack: true, .. }))
            .count(),
        32
    );
    // More than 32 queued at once is a flood.
    let pings: Vec<Frame> = (0..33u64)
        .map(|i| Frame::Ping {
            ack: false,
            data: i.to_be_bytes(),
        })
        .collect();
    raw.feed_no_drain(&pings);
    raw.drain();
    assert_violation(&raw, code::ENHANCE_YOUR_CALM);
}

#[test]
fn rapid_reset_flood_sheds_and_never_closes() {
    // Users who give up on their requests make the relay reset streams right after opening them. Past the bound
    // the session sheds new streams for a moment (REFUSE code OVERLOADED), and the tunnel stays up.
    let mut raw = server();
    let mut frames = Vec::new();
    for i in 0..1000u32 {
        let id = 2 * i + 1;
        frames.push(open(id));
        frames.push(Frame::Reset {
            stream: StreamId(id),
            code: code::CANCEL,
        });
    }
    raw.feed(&frames);
    assert!(raw.closed().is_none(), "1000 rapid resets are tolerated");
    assert!(!raw.session.shedding(raw.now));
    raw.feed(&[
        open(2001),
        Frame::Reset {
            stream: StreamId(2001),
            code: code::CANCEL,
        },
    ]);
    assert!(raw.closed().is_none(), "resets never close the tunnel");
    assert!(raw.session.shedding(raw.now));
    // While shedding, new streams are refused with OVERLOADED; nothing is offered to the application.
    let before = raw.events.len();
    raw.feed(&[open(2003)]);
    assert!(
        raw.out.iter().any(|f| matches!(
            f,
            Frame::Refuse { stream: StreamId(2003), code: c, .. } if *c == code::OVERLOADED
        )),
        "frames sent: {:?}",
        raw.out
    );
    assert!(
        !raw.events[before..]
            .iter()
            .any(|e| matches!(e, Event::StreamOpened { .. })),
        "a shed stream is not offered"
    );
    assert_eq!(raw.goaway_code(), None);
    // A moment later streams are served again, and the connection was never closed.
    raw.now += tether_proto::SHED_PERIOD;
    assert!(!raw.session.shedding(raw.now));
    raw.feed(&[open(2005)]);
    assert!(
        raw.events.iter().any(|e| matches!(
            e,
            Event::StreamOpened {
                id: StreamId(2005),
                ..
            }
        )),
        "served again after the shed period"
    );
    let stats = raw.session.stats();
    assert_eq!((stats.shed_periods, stats.shed_streams), (1, 1));
    assert!(raw.closed().is_none());
}

#[test]
fn a_sustained_reset_flood_only_ever_sheds() {
    // Ten seconds of open-and-reset at 2,000 streams a second: periods of shedding, never a GOAWAY.
    let mut raw = server();
    let mut id = 1u32;
    for _ in 0..200 {
        let mut frames = Vec::new();
        for _ in 0..100 {
            frames.push(open(id));
            frames.push(Frame::Reset {
                stream: StreamId(id),
                code: code::CANCEL,
            });
            id += 2;
        }
        raw.feed(&frames);
        raw.now += std::time::Duration::from_millis(50);
        assert!(raw.closed().is_none());
    }
    assert_eq!(raw.goaway_code(), None);
    assert!(raw.session.stats().shed_periods >= 1);
    assert!(raw.session.stats().shed_streams >= 1);
    // Genuine misbehaviour still ends in GOAWAY: a RESET for a stream never opened.
    raw.feed(&[Frame::Reset {
        stream: StreamId(id + 1000),
        code: code::CANCEL,
    }]);
    assert_violation(&raw, code::PROTOCOL_ERROR);
}

#[test]
fn resets_after_a_finished_answer_are_not_a_flood() {
    // The relay ends every ordinary request by dropping its stream once the answer is in, so the agent sees a
    // RESET right after it finished answering, thousands of times a second under load. Not an attack.
    let mut raw = server();
    for i in 0..2000u32 {
        let id = 2 * i + 1;
        raw.feed(&[open(id), data(id, 10, true)]);
        assert_eq!(
            raw.session.accept_stream(StreamId(id), Bytes::new()),
            Ok(())
        );
        assert_eq!(raw.session.write(StreamId(id), b"answer"), Ok(6));
        assert_eq!(raw.session.finish(StreamId(id)), Ok(()));
        raw.feed(&[Frame::Reset {
            stream: StreamId(id),
            code: code::CANCEL,
        }]);
    }
    assert!(
        raw.closed().is_none(),
        "ordinary request endings were taken for a rapid-reset flood"
    );
}

#[test]
fn resets_of_old_streams_are_not_a_flood() {
    let mut raw = server();
    let mut frames: Vec<Frame> = (0..1001u32).map(|i| open(2 * i + 1)).collect();
    raw.feed(&frames);
    raw.now += std::time::Duration::from_secs(2);
    frames = (0..1001u32)
        .map(|i| Frame::Reset {
            stream: StreamId(2 * i + 1),
            code: code::CANCEL,
        })
        .collect();
    raw.feed(&frames);
    assert!(raw.closed().is_none());
    assert_eq!(
        raw.events
            .iter()
            .filter(|e| matches!(e, Event::StreamReset { .. }))
            .count(),
        1001
    );
}

#[test]
fn settings_twice() {
    let mut raw = server();
    raw.feed(&[Frame::Settings(Settings::default())]);
    assert_violation(&raw, code::PROTOCOL_ERROR);
    assert_deaf(raw);
}

#[test]
fn hello_twice() {
    let mut raw = server();
    raw.feed(&[Frame::Hello {
        min_version: 1,
        max_version: 1,
    }]);
    assert_violation(&raw, code::PROTOCOL_ERROR);
}

#[test]
fn frame_before_hello() {
    let mut raw = Raw::new(config(Role::Server));
    raw.feed(&[Frame::Ping {
        ack: false,
        data: [0; 8],
    }]);
    assert_violation(&raw, code::PROTOCOL_ERROR);
}

#[test]
fn hello_not_followed_by_settings() {
    let mut raw = Raw::new(config(Role::Server));
    raw.feed(&[
        Frame::Hello {
            min_version: 1,
            max_version: 1,
        },
        open(1),
    ]);
    assert_violation(&raw, code::PROTOCOL_ERROR);
}

#[test]
fn not_a_tether_peer() {
    let mut raw = Raw::new(config(Role::Server));
    raw.feed_bytes(Bytes::from_static(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n"));
    assert!(raw.closed().is_some());
    assert!(raw.goaway_code().is_some());
}

#[test]
fn oversize_metadata() {
    let mut raw = server();
    raw.feed(&[Frame::Open {
        stream: StreamId(1),
        kind: 1,
        priority: 1,
        deadline_ms: 0,
        metadata: Bytes::from(vec![0; 16 * 1024 + 1]),
    }]);
    assert_violation(&raw, code::PROTOCOL_ERROR);

    let mut raw = Raw::connected(config(Role::Client));
    let now = raw.now;
    let id = raw
        .session
        .open_stream(now, 1, tether_proto::Priority::Normal, None, Bytes::new())
        .expect("open");
    raw.drain();
    raw.feed(&[Frame::Accept {
        stream: id,
        metadata: Bytes::from(vec![0; 16 * 1024 + 1]),
    }]);
    assert_violation(&raw, code::PROTOCOL_ERROR);
}

#[test]
fn connection_window_overflow() {
    let mut raw = server();
    raw.feed(&[Frame::WindowUpdate {
        stream: StreamId(0),
        increment: MAX_WINDOW,
    }]);
    assert_violation(&raw, code::FLOW_CONTROL_ERROR);
}

#[test]
fn stream_window_overflow() {
    let mut raw = server();
    raw.feed(&[
        open(1),
        Frame::WindowUpdate {
            stream: StreamId(1),
            increment: MAX_WINDOW - 256 * 1024,
        },
    ]);
    assert!(raw.closed().is_none());
    raw.feed(&[Frame::WindowUpdate {
        stream: StreamId(1),
        increment: 1,
    }]);
    assert_violation(&raw, code::FLOW_CONTROL_ERROR);
}

#[test]
fn data_after_fin() {
    let mut raw = server();
    raw.feed(&[open(1), data(1, 10, true)]);
    assert!(raw.closed().is_none());
    raw.feed(&[data(1, 1, false)]);
    assert_violation(&raw, code::PROTOCOL_ERROR);
}

#[test]
fn stream_window_exceeded() {
    let mut raw = server();
    let mut frames = vec![open(1)];
    // 256 KiB is the default stream window: four 64 KiB frames fit, one more byte does not.
    for _ in 0..4 {
        frames.push(data(1, 64 * 1024, false));
    }
    raw.feed(&frames);
    assert!(raw.closed().is_none());
    raw.feed(&[data(1, 1, false)]);
    assert_violation(&raw, code::FLOW_CONTROL_ERROR);
}

#[test]
fn connection_window_exceeded() {
    let mut cfg = config(Role::Server);
    cfg.connection_window = 100_000;
    let mut raw = Raw::connected(cfg);
    // Credit for buffered data comes back once half the window arrived: 40,000 bytes leave 60,000 of credit.
    raw.feed(&[open(1), data(1, 40_000, false)]);
    assert!(raw.closed().is_none());
    raw.feed(&[open(3), data(3, 60_001, false)]);
    assert_violation(&raw, code::FLOW_CONTROL_ERROR);
}

#[test]
fn data_for_a_reset_stream_still_counts_against_the_connection() {
    let mut cfg = config(Role::Server);
    cfg.connection_window = 100_000;
    let mut raw = Raw::connected(cfg);
    raw.feed(&[open(1)]);
    raw.session.reset(StreamId(1), code::CANCEL);
    raw.drain();
    // In-flight data for the reset stream is dropped and its credit returned at once.
    for _ in 0..10 {
        raw.feed(&[data(1, 50_000, false)]);
    }
    assert!(raw.closed().is_none());
    assert!(raw.out.iter().any(|f| matches!(
        f,
        Frame::WindowUpdate {
            stream: StreamId(0),
            ..
        }
    )));
}

#[test]
fn frame_too_large_is_rejected_from_its_header() {
    let mut raw = server();
    let mut header = BytesMut::new();
    FrameHeader {
        length: 64 * 1024 + 1,
        kind: 5,
        flags: 0,
        stream: StreamId(1),
    }
    .encode(&mut header);
    // Only the header arrives (in two pieces): the session does not wait for the payload.
    let header = header.freeze();
    raw.feed_bytes(header.slice(..4));
    assert!(raw.closed().is_none());
    raw.feed_bytes(header.slice(4..));
    assert_violation(&raw, code::FRAME_SIZE_ERROR);
}

#[test]
fn unknown_frame_types_are_skipped() {
    let mut raw = server();
    let mut wire = BytesMut::new();
    FrameHeader {
        length: 3,
        kind: 77,
        flags: 0,
        stream: StreamId(1),
    }
    .encode(&mut wire);
    wire.extend_from_slice(b"new");
    open(1).encode(&mut wire);
    raw.feed_bytes(wire.freeze());
    assert!(raw.closed().is_none());
    assert!(raw.events.iter().any(|e| matches!(
        e,
        Event::StreamOpened {
            id: StreamId(1),
            ..
        }
    )));
}

#[test]
fn stream_id_rules() {
    for (frames, why) in [
        (vec![open(2)], "server-parity id opened by the client"),
        (vec![open(5), open(3)], "lower id"),
        (vec![open(5), open(5)], "reused id"),
        (vec![data(7, 1, false)], "DATA on a stream never opened"),
        (
            vec![Frame::Reset {
                stream: StreamId(9),
                code: 0,
            }],
            "RESET of a stream never opened",
        ),
        (
            vec![Frame::WindowUpdate {
                stream: StreamId(9),
                increment: 1,
            }],
            "WINDOW_UPDATE of a stream never opened",
        ),
        (
            vec![Frame::Accept {
                stream: StreamId(2),
                metadata: Bytes::new(),
            }],
            "ACCEPT of our stream never opened",
        ),
        (
            vec![
                open(1),
                Frame::Accept {
                    stream: StreamId(1),
                    metadata: Bytes::new(),
                },
            ],
            "ACCEPT of the peer's own stream",
        ),
    ] {
        let mut raw = server();
        raw.feed(&frames);
        assert_eq!(raw.goaway_code(), Some(code::PROTOCOL_ERROR), "{why}");
    }
}

#[test]
fn control_queue_is_capped() {
    // Every OPEN is refused (limit 0); a peer that keeps opening while never reading our REFUSEs is cut off.
    let mut cfg = config(Role::Server);
    cfg.max_concurrent_streams = 0;
    let mut raw = Raw::connected(cfg);
    let frames: Vec<Frame> = (0..4096u32).map(|i| open(2 * i + 1)).collect();
    raw.feed_no_drain(&frames);
    assert!(raw.session.poll_event().is_none(), "closed at the cap");
    raw.feed_no_drain(&[open(10_001)]);
    raw.drain();
    assert_violation(&raw, code::ENHANCE_YOUR_CALM);
    // Only the GOAWAY went out: the queued REFUSEs were dropped.
    assert_eq!(
        raw.out
            .iter()
            .filter(|f| matches!(f, Frame::Refuse { .. }))
            .count(),
        0
    );
}

#[test]
fn byte_at_a_time_garbage_is_bounded() {
    let mut raw = server();
    // A header announcing a 64 KiB frame, then its payload one byte at a time: the session holds one frame.
    let mut wire = BytesMut::new();
    data(1, 64 * 1024, false).encode(&mut wire);
    let wire = wire.freeze();
    for i in 0..wire.len() {
        raw.session.handle_input(raw.now, wire.slice(i..=i));
    }
    raw.drain();
    assert_violation(&raw, code::PROTOCOL_ERROR);
}

#[test]
fn error_goaway_from_peer_closes_at_once() {
    let mut raw = server();
    raw.feed(&[open(1)]);
    raw.feed(&[Frame::GoAway {
        last_stream: StreamId(0),
        code: code::PROTOCOL_ERROR,
        reason: Bytes::from_static(b"you broke it"),
    }]);
    assert_eq!(
        raw.closed(),
        Some(Some(ConnectionError::ClosedByPeer {
            code: code::PROTOCOL_ERROR,
            reason: "you broke it".into()
        }))
    );
    assert!(raw.session.is_closed());
    assert_eq!(raw.goaway_code(), None, "no GOAWAY is sent back");
}

#[test]
fn undelivered_events_are_capped() {
    // The application never polls events while the peer keeps opening, feeding and resetting streams (slowly
    // enough not to count as rapid resets): the peer is cut off before the event queue grows without bound.
    let mut cfg = config(Role::Server);
    cfg.max_concurrent_streams = 1;
    let mut raw = Raw::connected(cfg);
    let cap = 4 + 4096;
    for i in 0..2000u32 {
        let id = 2 * i + 1;
        raw.feed_no_drain(&[open(id), data(id, 1, false)]);
        raw.now += std::time::Duration::from_secs(1);
        raw.feed_no_drain(&[Frame::Reset {
            stream: StreamId(id),
            code: code::CANCEL,
        }]);
    }
    // Input stopped being processed once the cap was passed (three events per cycle, three frames per cycle;
    // the two handshake frames count too).
    let processed = raw.session.stats().frames_in as usize - 2;
    assert!(
        processed > cap && processed < 3 * 2000,
        "processed {processed} frames"
    );
    raw.drain();
    assert_violation(&raw, code::ENHANCE_YOUR_CALM);
}
