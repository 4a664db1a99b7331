//! The WebSocket-over-TLS transport: the proto session's bytes ride in binary WebSocket messages.

use std::sync::Arc;

use http::{HeaderMap, Request, Response};
use tokio::io::{AsyncRead, AsyncWrite};

use crate::{Connection, SessionConfig};

/// The WebSocket subprotocol name both sides require.
pub const SUBPROTOCOL: &str = "tether.v1";

/// Why the client could not establish a tunnel.
#[derive(Debug, thiserror::Error)]
pub enum ConnectError {
    /// The relay URL is not usable.
    #[error("invalid relay URL: {0}")]
    InvalidUrl(String),
    /// TCP connect or DNS failed.
    #[error("cannot reach {addr}: {source}")]
    Connect {
        /// host:port dialled.
        addr: String,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
    /// TLS handshake failed (e.g. the relay's certificate is not trusted).
    #[error("TLS handshake with the relay failed: {0}")]
    Tls(#[source] std::io::Error),
    /// The relay answered the upgrade with an HTTP error; `status` and `body` say why.
    #[error("relay refused the tunnel: HTTP {status}: {body}")]
    Rejected {
        /// HTTP status.
        status: http::StatusCode,
        /// Response body (trimmed).
        body: String,
    },
    /// The WebSocket handshake failed otherwise.
    #[error("websocket handshake failed: {0}")]
    Handshake(String),
    /// Timed out.
    #[error("timed out connecting to the relay")]
    TimedOut,
}

/// Dials `url` (`wss://host[:port]/path`) over TLS with `tls`, sends `headers` with the WebSocket upgrade
/// (credentials go here), and starts a client [`Connection`] on success.
#[allow(unused_variables, clippy::todo)]
pub async fn connect(
    url: &str,
    tls: Arc<rustls::ClientConfig>,
    headers: HeaderMap,
    config: SessionConfig,
) -> Result<Connection, ConnectError> {
    todo!()
}

/// Checks that `req` is a WebSocket upgrade asking for [`SUBPROTOCOL`] and builds the 101 response to send.
/// The caller (the relay's HTTP server) authenticates the request first, sends this response, and hands the
/// upgraded IO to [`accept_upgraded`].
#[allow(unused_variables, clippy::todo)]
pub fn upgrade_response<B>(req: &Request<B>) -> Result<Response<()>, String> {
    todo!()
}

/// Starts a server [`Connection`] over an IO already upgraded to WebSocket by [`upgrade_response`].
#[allow(unused_variables, clippy::todo)]
pub fn accept_upgraded<IO>(io: IO, config: SessionConfig) -> Connection
where
    IO: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    todo!()
}

#[allow(dead_code)]
fn _uses(_: HeaderMap) {}
