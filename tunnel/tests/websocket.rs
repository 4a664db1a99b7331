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
