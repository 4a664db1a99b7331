//! Connection and stream behaviour over real WebSockets (tungstenite client handshake, hyper server upgrade)
//! on in-memory pipes. The cases are shared with the QUIC transport (`common/cases.rs`).

mod common;

use common::Ws;
use common::cases::stream_cases;

stream_cases!(Ws);

#[tokio::test(start_paused = true)]
async fn unanswered_stream_times_out_at_its_deadline() -> anyhow::Result<()> {
    common::cases::unanswered_stream_times_out_at_its_deadline::<Ws>().await
}

#[tokio::test(start_paused = true)]
async fn idle_connection_stays_up_through_keepalives() -> anyhow::Result<()> {
    common::cases::idle_connection_stays_up_through_keepalives::<Ws>().await
}
