//! Connection and stream behaviour over real WebSockets (tungstenite client handshake, hyper server upgrade)
//! on in-memory pipes. The cases are shared with the QUIC transport (`common/cases.rs`).

mod common;

use std::time::Duration;

use bytes::Bytes;
use common::cases::stream_cases;
use common::{Harness, Ws, open_options, within};
use tether_tunnel::OpenOptions;

stream_cases!(Ws);

#[tokio::test(start_paused = true)]
async fn unanswered_stream_times_out_at_its_deadline() -> anyhow::Result<()> {
    common::cases::unanswered_stream_times_out_at_its_deadline::<Ws>().await
}

#[tokio::test(start_paused = true)]
async fn a_lone_reader_times_out_at_the_deadline() -> anyhow::Result<()> {
    common::cases::a_lone_reader_times_out_at_the_deadline::<Ws>().await
}

#[tokio::test(start_paused = true)]
async fn idle_connection_stays_up_through_keepalives() -> anyhow::Result<()> {
    common::cases::idle_connection_stays_up_through_keepalives::<Ws>().await
}

/// A deferred answer with nothing to leave with goes on its own when its hold is over (the driver's timer),
/// not at the next keepalive, and never later than half the time left before the opener's deadline.
#[tokio::test(start_paused = true)]
async fn a_deferred_answer_with_nothing_to_carry_it_goes_when_its_hold_ends() -> anyhow::Result<()>
{
    let p = Ws::pair().await?;
    for (deadline, hold, expected) in [
        (None, Duration::from_millis(200), Duration::from_millis(200)),
        (
            Some(Duration::from_secs(2)),
            Duration::from_secs(3600),
            Duration::from_secs(1),
        ),
    ] {
        let stream = p.client.open(OpenOptions {
            deadline,
            ..open_options("GET /slow")
        })?;
        let control = stream.control();
        let incoming = within("accept", p.server.accept())
            .await?
            .ok_or_else(|| anyhow::anyhow!("no incoming stream"))?;
        let start = tokio::time::Instant::now();
        let _served = incoming.accept_deferred(Bytes::from_static(b"later"), hold)?;
        assert_eq!(
            within("accepted", control.accepted()).await??,
            Bytes::from_static(b"later")
        );
        let took = start.elapsed();
        // Virtual time: the answer left at its hold, give or take the transport's turns.
        assert!(
            took >= expected && took < expected + Duration::from_millis(100),
            "deadline {deadline:?}, hold {hold:?}: answered after {took:?}, expected {expected:?}"
        );
    }
    Ok(())
}
