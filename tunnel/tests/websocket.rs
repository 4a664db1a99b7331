//! The WebSocket layer against a plain tungstenite peer: upgrade checks and transport-level rules.

mod common;

use anyhow::Context as _;
use common::{ServerOptions, serve_upgrade, within};
use futures_util::{SinkExt, StreamExt};
use http::{HeaderMap, StatusCode};
use tether_tunnel::ws::{self, ConnectError, SUBPROTOCOL};
use tether_tunnel::{Role, SessionConfig};
use tokio::sync::mpsc;
use tokio_tungstenite::tungstenite::client::IntoClientRequest;
use tokio_tungstenite::tungstenite::protocol::frame::coding::CloseCode;
use tokio_tungstenite::tungstenite::{Error as WsError, Message};

#[tokio::test]
async fn text_message_closes_the_tunnel_with_a_protocol_error() -> anyhow::Result<()> {
    let (client_io, server_io) = tokio::io::duplex(64 * 1024);
    let (tx, mut rx) = mpsc::unbounded_channel();
    tokio::spawn(serve_upgrade(server_io, ServerOptions::new(), tx));
    let mut request = "ws://relay.test/agent/v1/tunnel".into_client_request()?;
    request.headers_mut().insert(
        http::header::SEC_WEBSOCKET_PROTOCOL,
        http::HeaderValue::from_static(SUBPROTOCOL),
    );
    let (mut raw, response) = tokio_tungstenite::client_async(request, client_io).await?;
    assert_eq!(
        response.headers()[http::header::SEC_WEBSOCKET_PROTOCOL],
        SUBPROTOCOL
    );
    let server = within("server connection", rx.recv())
        .await?
        .context("no server connection")?;

    raw.send(Message::text("not binary")).await?;
    // The relay side sends its session bytes (binary) and then a close frame saying why.
    let close = within("close frame", async {
        while let Some(message) = raw.next().await {
            if let Message::Close(frame) = message? {
                return Ok(frame);
            }
        }
        anyhow::bail!("stream ended without a close frame")
    })
    .await??;
    assert_eq!(close.map(|f| f.code), Some(CloseCode::Protocol));
    // Keep reading so that tungstenite sends its close reply and the server can finish its close.
    tokio::spawn(async move { while raw.next().await.is_some() {} });
    let end = within("server closed", server.closed()).await?;
    assert!(end.error.is_some());
    Ok(())
}

#[tokio::test]
async fn upgrade_without_the_subprotocol_is_refused() -> anyhow::Result<()> {
    let (client_io, server_io) = tokio::io::duplex(64 * 1024);
    let (tx, _rx) = mpsc::unbounded_channel();
    tokio::spawn(serve_upgrade(server_io, ServerOptions::new(), tx));
    let err = tokio_tungstenite::client_async("ws://relay.test/agent/v1/tunnel", client_io)
        .await
        .err()
        .context("upgrade should be refused")?;
    let WsError::Http(response) = err else {
        anyhow::bail!("expected an HTTP answer, got {err:?}")
    };
    assert_eq!(response.status(), StatusCode::BAD_REQUEST);
    let body = String::from_utf8_lossy(response.body().as_deref().unwrap_or_default()).into_owned();
    assert!(body.contains(SUBPROTOCOL), "{body}");
    Ok(())
}

#[tokio::test]
async fn non_101_answer_is_rejected_with_status_over_any_io() -> anyhow::Result<()> {
    let (client_io, server_io) = tokio::io::duplex(64 * 1024);
    let (tx, _rx) = mpsc::unbounded_channel();
    let mut options = ServerOptions::new();
    options.require_auth = Some("Bearer x");
    tokio::spawn(serve_upgrade(server_io, options, tx));
    let err = ws::connect_over(
        client_io,
        "ws://relay.test/agent/v1/tunnel",
        HeaderMap::new(),
        SessionConfig::new(Role::Client),
    )
    .await
    .err()
    .context("connect should be refused")?;
    assert!(
        matches!(&err, ConnectError::Rejected { status, body } if *status == StatusCode::UNAUTHORIZED && body.contains("bad credential")),
        "{err:?}"
    );
    Ok(())
}

#[tokio::test]
async fn server_that_ignores_the_subprotocol_is_refused() -> anyhow::Result<()> {
    // A plain WebSocket server that does not echo `tether.v1`.
    let (client_io, server_io) = tokio::io::duplex(64 * 1024);
    tokio::spawn(async move {
        let _ = tokio_tungstenite::accept_async(server_io).await;
    });
    let err = ws::connect_over(
        client_io,
        "ws://relay.test/agent/v1/tunnel",
        HeaderMap::new(),
        SessionConfig::new(Role::Client),
    )
    .await
    .err()
    .context("connect should fail")?;
    assert!(
        matches!(&err, ConnectError::Handshake(m) if m.contains(SUBPROTOCOL)),
        "{err:?}"
    );
    Ok(())
}

/// A network partition: the pipes stay open but nothing crosses them any more. Both ends learn the tunnel is
/// over — `closed()` resolves with `TimedOut` — once the idle timeout passes, not a close-linger later: a silent
/// peer will not answer a polite close either, and the relay's registry and the agent's reconnect loop wait on
/// `closed()` (virtual time).
#[tokio::test(start_paused = true)]
async fn a_partitioned_peer_is_given_up_at_the_idle_timeout() -> anyhow::Result<()> {
    let keepalive = std::time::Duration::from_secs(1);
    let idle = std::time::Duration::from_secs(2);
    let config = |role| {
        let mut c = SessionConfig::new(role);
        c.keepalive_interval = keepalive;
        c.idle_timeout = idle;
        c
    };
    let (client_io, mut link_a) = tokio::io::duplex(64 * 1024);
    let (mut link_b, server_io) = tokio::io::duplex(64 * 1024);
    let (cut, cut_rx) = tokio::sync::oneshot::channel::<()>();
    tokio::spawn(async move {
        tokio::select! {
            _ = tokio::io::copy_bidirectional(&mut link_a, &mut link_b) => {}
            _ = cut_rx => {
                // Partitioned: both pipes stay open, nothing is read or written.
                std::future::pending::<()>().await;
            }
        }
    });
    let (tx, mut rx) = mpsc::unbounded_channel();
    tokio::spawn(serve_upgrade(
        server_io,
        ServerOptions {
            config: config(Role::Server),
            require_auth: None,
        },
        tx,
    ));
    let client = ws::connect_over(
        client_io,
        "ws://relay.test/agent/v1/tunnel",
        HeaderMap::new(),
        config(Role::Client),
    )
    .await?;
    let server = within("server connection", rx.recv())
        .await?
        .context("no server connection")?;
    // Up through a few keepalives, then cut.
    tokio::time::sleep(idle * 3).await;
    assert!(!client.is_closed() && !server.is_closed());
    let _ = cut.send(());
    let cut_at = tokio::time::Instant::now();
    for (side, conn) in [("relay", &server), ("agent", &client)] {
        let end = within("the silent peer given up", conn.closed()).await?;
        assert!(
            matches!(end.error, Some(tether_tunnel::ConnectionError::TimedOut(d)) if d == idle),
            "{side}: {:?}",
            end.error
        );
        let after = cut_at.elapsed();
        assert!(
            after <= idle + keepalive,
            "{side} reported the tunnel closed {after:?} after the cut (idle timeout {idle:?})"
        );
    }
    Ok(())
}
