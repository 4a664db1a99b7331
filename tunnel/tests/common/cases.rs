//! Stream and connection behaviour every transport must show, written once and run for each transport
//! (`streams.rs` for WebSocket, `quic.rs` for QUIC) through [`Harness`] and the `stream_cases!` macro.

use std::time::Duration;

use anyhow::Context as _;
use bytes::Bytes;
use tether_tunnel::{ConnectionError, Priority, Role, SessionConfig, TunnelError, code, kind};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use super::{
    Harness, accept, echo, open_held, open_options, pattern, round_trip, spawn_echo_server,
    tunnel_error, within,
};

pub(crate) async fn open_accept_and_echo_both_directions<H: Harness>() -> anyhow::Result<()> {
    let p = H::pair().await?;

    // Client → server, with metadata both ways.
    let mut stream = p.client.open(open_options("GET /version"))?;
    let control = stream.control();
    let incoming = within("accept", p.server.accept())
        .await?
        .context("no incoming stream")?;
    assert_eq!(incoming.kind, kind::HTTP);
    assert_eq!(incoming.priority, Priority::Normal);
    assert_eq!(incoming.metadata, Bytes::from_static(b"GET /version"));
    assert!(incoming.deadline.is_some());
    let served = incoming.accept(Bytes::from_static(b"ok"))?;
    assert_eq!(
        within("accepted", control.accepted()).await??,
        Bytes::from_static(b"ok")
    );
    assert_eq!(
        served.control().accepted().await?,
        Bytes::from_static(b"ok")
    );
    let echoing = tokio::spawn(echo(served));
    stream.write_all(b"hello over the tunnel").await?;
    let mut reply = [0u8; 21];
    within("reply", stream.read_exact(&mut reply)).await??;
    assert_eq!(&reply, b"hello over the tunnel");
    stream.shutdown().await?;
    let mut rest = Vec::new();
    within("eof", stream.read_to_end(&mut rest)).await??;
    assert!(rest.is_empty());
    within("echo task", echoing).await???;

    // Server → client.
    let echo_client = spawn_echo_server(p.client.clone());
    let stream = p.server.open(open_options("control"))?;
    let received = within("round trip", round_trip(stream, b"from the relay".to_vec())).await??;
    assert_eq!(received, b"from the relay");
    echo_client.abort();
    Ok(())
}

/// An answer deferred for longer than the test waits leaves with the stream's first bytes: the opener reads
/// both, and learns the stream was accepted, as soon as the acceptor writes.
pub(crate) async fn a_deferred_answer_leaves_with_the_first_bytes<H: Harness>() -> anyhow::Result<()>
{
    let p = H::pair().await?;
    let (mut stream, control, mut served) = open_held(
        &p.client,
        &p.server,
        "GET /healthz",
        b"ok",
        Duration::from_secs(3600),
    )
    .await?;
    served.write_all(b"the reply").await?;
    served.shutdown().await?;
    let mut reply = Vec::new();
    within("reply", stream.read_to_end(&mut reply)).await??;
    assert_eq!(reply, b"the reply");
    assert_eq!(
        within("accepted", control.accepted()).await??,
        Bytes::from_static(b"ok")
    );
    Ok(())
}

/// An answer deferred for longer than the test waits also leaves with the stream's end when nothing was
/// written: the opener learns the stream was accepted and reads an empty reply.
pub(crate) async fn a_deferred_answer_leaves_with_the_finish<H: Harness>() -> anyhow::Result<()> {
    let p = H::pair().await?;
    let (mut stream, control, mut served) = open_held(
        &p.client,
        &p.server,
        "HEAD /healthz",
        b"ok",
        Duration::from_secs(3600),
    )
    .await?;
    served.shutdown().await?;
    let mut reply = Vec::new();
    within("reply", stream.read_to_end(&mut reply)).await??;
    assert!(reply.is_empty(), "{reply:?}");
    assert_eq!(
        within("accepted", control.accepted()).await??,
        Bytes::from_static(b"ok")
    );
    Ok(())
}

pub(crate) async fn eight_mib_transfer_keeps_every_byte<H: Harness>() -> anyhow::Result<()> {
    let p = H::pair().await?;
    let _server = spawn_echo_server(p.server.clone());
    let data = pattern(8 * 1024 * 1024, 7);
    let stream = p.client.open(open_options("bulk"))?;
    let received = within("8 MiB echo", round_trip(stream, data.clone())).await??;
    assert_eq!(received.len(), data.len());
    assert!(received == data, "echoed bytes differ");
    let stats = p.client.stats();
    assert!(
        stats.bytes_out >= data.len() as u64 && stats.bytes_in >= data.len() as u64,
        "{stats:?}"
    );
    Ok(())
}

pub(crate) async fn a_hundred_concurrent_streams<H: Harness>() -> anyhow::Result<()> {
    let p = H::pair().await?;
    let _server = spawn_echo_server(p.server.clone());
    let mut tasks = Vec::new();
    for i in 0..100u64 {
        let stream = p.client.open(open_options("many"))?;
        let data = pattern(16 * 1024 + i as usize * 37, i);
        tasks.push(tokio::spawn(async move {
            let received = round_trip(stream, data.clone()).await?;
            anyhow::ensure!(received == data, "stream {i} got different bytes back");
            Ok(())
        }));
    }
    assert!(p.client.open_streams() > 0);
    for task in tasks {
        within("stream", task).await???;
    }
    // Every stream ended cleanly on both sides: the session forgets them.
    within("streams to be forgotten", async {
        while p.client.open_streams() != 0 || p.server.open_streams() != 0 {
            tokio::task::yield_now().await;
        }
    })
    .await?;
    Ok(())
}

pub(crate) async fn half_close_still_reads_the_reply<H: Harness>() -> anyhow::Result<()> {
    let p = H::pair().await?;
    let mut stream = p.client.open(open_options("half-close"))?;
    stream.write_all(b"request body").await?;
    stream.shutdown().await?;
    // Writing after shutdown is refused locally.
    assert!(stream.write_all(b"more").await.is_err());

    let mut served = within("accept", accept(&p.server)).await??;
    let mut request = Vec::new();
    within("request to EOF", served.read_to_end(&mut request)).await??;
    assert_eq!(request, b"request body");
    // The server writes its reply only after seeing our EOF.
    served.write_all(b"response after EOF").await?;
    served.shutdown().await?;

    let mut reply = Vec::new();
    within("reply", stream.read_to_end(&mut reply)).await??;
    assert_eq!(reply, b"response after EOF");
    Ok(())
}

pub(crate) async fn dropping_an_unfinished_stream_resets_it_at_the_peer<H: Harness>()
-> anyhow::Result<()> {
    let p = H::pair().await?;
    let mut stream = p.client.open(open_options("dropped"))?;
    stream.write_all(b"partial").await?;
    let mut served = within("accept", accept(&p.server)).await??;
    let mut first = [0u8; 7];
    within("first bytes", served.read_exact(&mut first)).await??;
    drop(stream);

    let err = within("read after reset", async {
        let mut buf = [0u8; 64];
        loop {
            match served.read(&mut buf).await {
                Ok(0) => return None,
                Ok(_) => continue,
                Err(e) => return Some(e),
            }
        }
    })
    .await?
    .context("the peer saw EOF instead of a reset")?;
    assert!(
        matches!(tunnel_error(&err), Some(TunnelError::Reset(code::CANCEL))),
        "{err:?}"
    );
    // Writing fails too.
    assert!(served.write_all(b"late").await.is_err());
    Ok(())
}

pub(crate) async fn explicit_reset_through_the_control_handle<H: Harness>() -> anyhow::Result<()> {
    let p = H::pair().await?;
    let stream = p.client.open(open_options("reset"))?;
    let control = stream.control();
    let (mut reader, _writer) = tokio::io::split(stream);
    let mut served = within("accept", accept(&p.server)).await??;
    control.reset(code::INTERNAL_ERROR);
    let mut buf = [0u8; 8];
    let err = reader
        .read(&mut buf)
        .await
        .err()
        .context("local read should fail after reset")?;
    assert!(
        matches!(
            tunnel_error(&err),
            Some(TunnelError::Reset(code::INTERNAL_ERROR))
        ),
        "{err:?}"
    );
    let err = within("peer read", served.read(&mut buf))
        .await?
        .err()
        .context("peer read should fail")?;
    assert!(
        matches!(
            tunnel_error(&err),
            Some(TunnelError::Reset(code::INTERNAL_ERROR))
        ),
        "{err:?}"
    );
    Ok(())
}

pub(crate) async fn refused_stream_reports_code_and_reason<H: Harness>() -> anyhow::Result<()> {
    let p = H::pair().await?;
    let mut stream = p.client.open(open_options("forbidden thing"))?;
    let incoming = within("accept", p.server.accept())
        .await?
        .context("no incoming stream")?;
    incoming.refuse(code::REFUSED, "forbidden by policy");
    let err = within("answer", stream.control().accepted())
        .await?
        .err()
        .context("expected a refusal")?;
    match &err {
        TunnelError::Refused { code: c, reason } => {
            assert_eq!(*c, code::REFUSED);
            assert_eq!(reason, "forbidden by policy");
        }
        other => anyhow::bail!("expected Refused, got {other:?}"),
    }
    assert!(!err.is_retryable());
    let mut buf = [0u8; 1];
    let read = stream
        .read(&mut buf)
        .await
        .err()
        .context("reading a refused stream should fail")?;
    assert!(
        matches!(tunnel_error(&read), Some(TunnelError::Refused { .. })),
        "{read:?}"
    );

    // Dropping an Incoming without answering refuses it too.
    let stream = p.client.open(open_options("ignored"))?;
    drop(
        within("accept", p.server.accept())
            .await?
            .context("no incoming stream")?,
    );
    let err = within("answer", stream.control().accepted())
        .await?
        .err()
        .context("expected a refusal")?;
    assert!(
        matches!(
            err,
            TunnelError::Refused {
                code: code::REFUSED,
                ..
            }
        ),
        "{err:?}"
    );
    Ok(())
}

pub(crate) async fn unanswered_stream_times_out_at_its_deadline<H: Harness>() -> anyhow::Result<()>
{
    let p = H::pair().await?;
    let mut options = open_options("nobody answers");
    options.deadline = Some(Duration::from_secs(3));
    let stream = p.client.open(options)?;
    // The server never calls accept(); virtual time runs to the deadline.
    let err = stream
        .control()
        .accepted()
        .await
        .err()
        .context("expected a timeout")?;
    assert!(
        matches!(err, TunnelError::TimedOut(d) if d == Duration::from_secs(3)),
        "{err:?}"
    );
    assert!(!err.is_retryable());
    // The connection itself is fine.
    let _server = spawn_echo_server(p.server.clone());
    let fresh = p.client.open(open_options("after timeout"))?;
    assert_eq!(
        round_trip(fresh, b"still alive".to_vec()).await?,
        b"still alive"
    );
    Ok(())
}

/// A reader waiting for the answer, with no `accepted` call to time it, still fails at the stream's deadline.
pub(crate) async fn a_lone_reader_times_out_at_the_deadline<H: Harness>() -> anyhow::Result<()> {
    let p = H::pair().await?;
    let mut options = open_options("nobody answers");
    options.deadline = Some(Duration::from_secs(2));
    let mut stream = p.client.open(options)?;
    // The server never calls accept(); virtual time runs to the deadline where the transport allows it.
    let mut buf = Vec::new();
    let err = within("read", stream.read_to_end(&mut buf))
        .await?
        .err()
        .context("expected a timeout")?;
    let err = tunnel_error(&err).with_context(|| format!("not a tunnel error: {err:?}"))?;
    assert!(
        matches!(err, TunnelError::TimedOut(d) if d == Duration::from_secs(2)),
        "{err:?}"
    );
    Ok(())
}

pub(crate) async fn go_away_by_the_server_drains_open_streams_then_closes<H: Harness>()
-> anyhow::Result<()> {
    go_away_drains::<H>(true).await
}

pub(crate) async fn go_away_by_the_client_drains_open_streams_then_closes<H: Harness>()
-> anyhow::Result<()> {
    go_away_drains::<H>(false).await
}

/// One stream is open when `leaving` calls go_away; it still carries data both ways, and the last bytes
/// reach `staying` even when it reads them only after `leaving` has closed the transport.
pub(crate) async fn go_away_drains<H: Harness>(server_leaves: bool) -> anyhow::Result<()> {
    let p = H::pair().await?;
    let (leaving, staying) = if server_leaves {
        (&p.server, &p.client)
    } else {
        (&p.client, &p.server)
    };
    let mut stream = staying.open(open_options("in flight"))?;
    stream.write_all(b"first half, ").await?;
    let mut served = within("accept", accept(leaving)).await??;

    leaving.go_away(code::NO_ERROR, "restarting");
    assert!(
        within("accept after go_away", leaving.accept())
            .await?
            .is_none()
    );
    assert!(leaving.open(open_options("from the leaving side")).is_err());
    // The other side learns about it: no new streams either way.
    within("accept to end", async {
        while staying.accept().await.is_some() {}
    })
    .await?;
    let err = staying
        .open(open_options("too late"))
        .err()
        .context("a stream opened after GOAWAY")?;
    assert!(err.is_retryable(), "{err:?}");
    assert!(!leaving.is_closed());

    // The open stream still works in both directions.
    stream.write_all(b"second half").await?;
    stream.shutdown().await?;
    let mut request = Vec::new();
    within("request", served.read_to_end(&mut request)).await??;
    assert_eq!(request, b"first half, second half");
    served.write_all(b"done").await?;
    served.shutdown().await?;
    drop(served);
    // The leaving side has nothing left: it closes, and the transport with it.
    let end = within("leaving side closed", leaving.closed()).await?;
    assert!(end.error.is_none(), "{:?}", end.error);

    let mut reply = Vec::new();
    within("reply", stream.read_to_end(&mut reply)).await??;
    assert_eq!(reply, b"done");
    drop(stream);
    let end = within("staying side closed", staying.closed()).await?;
    assert!(end.error.is_none(), "{:?}", end.error);
    assert!(p.server.is_closed() && p.client.is_closed());
    Ok(())
}

pub(crate) async fn transport_death_fails_every_stream_and_closes_with_an_error<H: Harness>()
-> anyhow::Result<()> {
    // A transport that learns of the death only by silence (QUIC over a dropped path) gets short timers.
    let mut client = SessionConfig::new(Role::Client);
    let mut server = SessionConfig::new(Role::Server);
    H::quick_liveness(&mut client);
    H::quick_liveness(&mut server);
    let p = H::pair_with(client, server).await?;
    let mut a = p.client.open(open_options("a"))?;
    let mut b = p.client.open(open_options("b"))?;
    a.write_all(b"x").await?;
    b.write_all(b"y").await?;
    let mut served_a = within("accept", accept(&p.server)).await??;
    let mut served_b = within("accept", accept(&p.server)).await??;
    let mut one = [0u8; 1];
    served_a.read_exact(&mut one).await?;
    served_b.read_exact(&mut one).await?;

    p.link.abort();

    for (name, stream) in [
        ("client a", &mut a),
        ("client b", &mut b),
        ("server a", &mut served_a),
        ("server b", &mut served_b),
    ] {
        let err = within(name, stream.read(&mut one))
            .await?
            .err()
            .with_context(|| format!("{name}: read should fail"))?;
        assert!(
            matches!(tunnel_error(&err), Some(TunnelError::Closed(_))),
            "{name}: {err:?}"
        );
        assert!(
            stream.write_all(b"z").await.is_err(),
            "{name}: write should fail"
        );
    }
    let client_end = within("client closed", p.client.closed()).await?;
    assert!(client_end.error.is_some());
    let server_end = within("server closed", p.server.closed()).await?;
    assert!(server_end.error.is_some());
    let err = p
        .client
        .open(open_options("after death"))
        .err()
        .context("open on a dead connection")?;
    assert!(err.is_retryable(), "{err:?}");
    assert!(
        within("accept on a dead connection", p.client.accept())
            .await?
            .is_none()
    );
    Ok(())
}

pub(crate) async fn a_stalled_reader_does_not_block_other_streams<H: Harness>() -> anyhow::Result<()>
{
    let p = H::pair().await?;
    let stalled = p.client.open(open_options("stalled"))?;
    let stalled_control = stalled.control();
    let stalled_served = within("accept", accept(&p.server)).await??;
    // Far more than the stream window: the writer must block, and nobody on the server reads.
    let stalled_writer = tokio::spawn(async move {
        let mut stalled = stalled;
        let data = pattern(4 * 1024 * 1024, 1);
        stalled.write_all(&data).await
    });

    let _server = spawn_echo_server(p.server.clone());
    let data = pattern(4 * 1024 * 1024, 2);
    let busy = p.client.open(open_options("busy"))?;
    let received = within("busy stream", round_trip(busy, data.clone())).await??;
    assert!(received == data);
    assert!(
        !stalled_writer.is_finished(),
        "the stalled stream cannot have been fully written"
    );

    stalled_control.reset(code::CANCEL);
    let result = within("stalled writer", stalled_writer).await??;
    assert!(result.is_err());
    drop(stalled_served);
    Ok(())
}

pub(crate) async fn dropping_every_handle_closes_the_connection<H: Harness>() -> anyhow::Result<()>
{
    let p = H::pair().await?;
    let server = p.server.clone();
    drop(p.client);
    let end = within("server closed", server.closed()).await?;
    assert!(end.error.is_none(), "{:?}", end.error);
    Ok(())
}

pub(crate) async fn control_priority_streams_work<H: Harness>() -> anyhow::Result<()> {
    let p = H::pair().await?;
    let _server = spawn_echo_server(p.server.clone());
    let mut options = open_options("heartbeat");
    options.kind = kind::CONTROL;
    options.priority = Priority::Control;
    options.deadline = None;
    let stream = p.client.open(options)?;
    assert_eq!(
        within("control echo", round_trip(stream, b"ping".to_vec())).await??,
        b"ping"
    );
    Ok(())
}

pub(crate) async fn small_windows_still_move_large_data<H: Harness>() -> anyhow::Result<()> {
    let mut client = SessionConfig::new(Role::Client);
    client.initial_stream_window = 64 * 1024;
    client.send_buffer = 16 * 1024;
    let mut server = SessionConfig::new(Role::Server);
    server.initial_stream_window = 64 * 1024;
    server.send_buffer = 16 * 1024;
    let p = H::pair_with(client, server).await?;
    let _server = spawn_echo_server(p.server.clone());
    let data = pattern(1024 * 1024, 3);
    let stream = p.client.open(open_options("small windows"))?;
    assert!(within("echo", round_trip(stream, data.clone())).await?? == data);
    Ok(())
}

/// Chunks handed over as they are (`heads::write_all_chunks`: QUIC keeps them, the session copies them) arrive
/// whole and in order, small and large, through windows smaller than they are (so the writer takes the large
/// ones in parts).
pub(crate) async fn chunks_written_as_they_are_arrive_in_order<H: Harness>() -> anyhow::Result<()> {
    let mut client = SessionConfig::new(Role::Client);
    let mut server = SessionConfig::new(Role::Server);
    for config in [&mut client, &mut server] {
        config.initial_stream_window = 64 * 1024;
        config.max_stream_window = 64 * 1024;
        config.send_buffer = 16 * 1024;
    }
    let p = H::pair_with(client, server).await?;
    let sizes = [
        10,
        300 * 1024,
        0,
        1,
        4096,
        4095,
        200 * 1024,
        17,
        64 * 1024 + 3,
    ];
    let data = pattern(sizes.iter().sum(), 11);
    let mut chunks = Vec::new();
    let mut at = 0;
    for size in sizes {
        chunks.push(Bytes::copy_from_slice(&data[at..at + size]));
        at += size;
    }
    let mut stream = p.client.open(open_options("chunks"))?;
    let reader = tokio::spawn(async move {
        let incoming = p.server.accept().await.context("no incoming stream")?;
        let mut served = incoming.accept(Bytes::new())?;
        let mut received = Vec::new();
        served.read_to_end(&mut received).await?;
        served.shutdown().await?;
        anyhow::Ok(received)
    });
    within(
        "chunks written",
        tether_tunnel::heads::write_all_chunks(&mut stream, &mut chunks),
    )
    .await??;
    assert!(chunks.is_empty());
    stream.shutdown().await?;
    let received = within("read to the end", reader).await???;
    assert_eq!(received.len(), data.len());
    assert!(received == data, "the bytes differ");
    let mut rest = Vec::new();
    within("eof", stream.read_to_end(&mut rest)).await??;
    assert!(rest.is_empty());
    Ok(())
}

pub(crate) async fn close_fails_every_stream_on_both_sides<H: Harness>() -> anyhow::Result<()> {
    let p = H::pair().await?;
    let mut stream = p.client.open(open_options("doomed"))?;
    stream.write_all(b"x").await?;
    let mut served = within("accept", accept(&p.server)).await??;
    let mut one = [0u8; 1];
    served.read_exact(&mut one).await?;

    p.client
        .close(code::INTERNAL_ERROR, "agent crashed politely");
    let err = stream
        .read(&mut one)
        .await
        .err()
        .context("local read after close")?;
    assert!(
        matches!(tunnel_error(&err), Some(TunnelError::Closed(_))),
        "{err:?}"
    );
    let err = within("peer read", served.read(&mut one))
        .await?
        .err()
        .context("peer read after close")?;
    assert!(
        matches!(tunnel_error(&err), Some(TunnelError::Closed(_))),
        "{err:?}"
    );
    let end = within("server closed", p.server.closed()).await?;
    assert!(
        matches!(&end.error, Some(ConnectionError::ClosedByPeer { code, reason }) if *code == code::INTERNAL_ERROR && reason == "agent crashed politely"),
        "{:?}",
        end.error
    );
    let end = within("client closed", p.client.closed()).await?;
    assert!(
        matches!(end.error, Some(ConnectionError::ClosedLocally { .. })),
        "{:?}",
        end.error
    );
    Ok(())
}

pub(crate) async fn too_many_streams_is_retryable<H: Harness>() -> anyhow::Result<()> {
    let mut server = SessionConfig::new(Role::Server);
    server.max_concurrent_streams = 2;
    let p = H::pair_with(SessionConfig::new(Role::Client), server).await?;
    let first = p.client.open(open_options("1"))?;
    let second = p.client.open(open_options("2"))?;
    let mut a = within("accept", accept(&p.server)).await??;
    let _b = within("accept", accept(&p.server)).await??;
    within("accepted", first.control().accepted()).await??;
    within("accepted", second.control().accepted()).await??;
    let err = p
        .client
        .open(open_options("3"))
        .err()
        .context("a third stream was allowed")?;
    assert!(matches!(err, TunnelError::TooManyStreams), "{err:?}");
    assert!(err.is_retryable());
    // Finishing one makes room again, once the acceptor has seen the reset.
    drop(first);
    let mut buf = [0u8; 1];
    assert!(within("reset seen", a.read(&mut buf)).await?.is_err());
    within("room for a stream", async {
        loop {
            match p.client.open(open_options("3 again")) {
                Ok(stream) => return stream,
                Err(_) => tokio::task::yield_now().await,
            }
        }
    })
    .await?;
    Ok(())
}

pub(crate) async fn idle_connection_stays_up_through_keepalives<H: Harness>() -> anyhow::Result<()>
{
    let mut client = SessionConfig::new(Role::Client);
    let mut server = SessionConfig::new(Role::Server);
    H::quick_liveness(&mut client);
    H::quick_liveness(&mut server);
    let p = H::pair_with(client, server).await?;
    if !H::RTT_FROM_HANDSHAKE {
        assert!(p.client.rtt().is_none());
    }
    // Several keepalive intervals and idle timeouts pass (virtual time where the transport allows it).
    tokio::time::sleep(H::QUIET).await;
    assert!(!p.client.is_closed() && !p.server.is_closed());
    assert!(p.client.rtt().is_some() || p.server.rtt().is_some());
    let _server = spawn_echo_server(p.server.clone());
    let stream = p.client.open(open_options("after a quiet spell"))?;
    assert_eq!(round_trip(stream, b"awake".to_vec()).await?, b"awake");
    Ok(())
}

/// Declares one `#[tokio::test]` per transport-independent case for the harness `$h`. The cases that need
/// virtual time (`unanswered_stream_times_out_at_its_deadline`, `idle_connection_stays_up_through_keepalives`)
/// are declared by each test file, paused or not.
#[allow(unused_macros)] // test files that do not run the cases include this module too
macro_rules! stream_cases {
    ($h:ty; $($case:ident),* $(,)?) => {
        $(
            #[tokio::test]
            async fn $case() -> anyhow::Result<()> {
                common::cases::$case::<$h>().await
            }
        )*
    };
    ($h:ty) => {
        stream_cases!($h;
            open_accept_and_echo_both_directions,
            a_deferred_answer_leaves_with_the_first_bytes,
            a_deferred_answer_leaves_with_the_finish,
            eight_mib_transfer_keeps_every_byte,
            a_hundred_concurrent_streams,
            half_close_still_reads_the_reply,
            dropping_an_unfinished_stream_resets_it_at_the_peer,
            explicit_reset_through_the_control_handle,
            refused_stream_reports_code_and_reason,
            go_away_by_the_server_drains_open_streams_then_closes,
            go_away_by_the_client_drains_open_streams_then_closes,
            transport_death_fails_every_stream_and_closes_with_an_error,
            a_stalled_reader_does_not_block_other_streams,
            dropping_every_handle_closes_the_connection,
            control_priority_streams_work,
            small_windows_still_move_large_data,
            chunks_written_as_they_are_arrive_in_order,
            close_fails_every_stream_on_both_sides,
            too_many_streams_is_retryable,
        );
    };
}
#[allow(unused_imports)]
pub(crate) use stream_cases;
