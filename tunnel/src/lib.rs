//! Async transports for the Tether tunnel, shared by the relay and the agent.
//!
//! [`Connection`] is the seam between the relay/agent logic and the wire: it opens and accepts logical
//! [`Stream`]s (each an `AsyncRead + AsyncWrite` byte stream with half-close) and says when the tunnel is gone.
//! Two transports sit behind the same `Connection`/`Stream` types: the [`tether_proto::Session`]
//! multiplexer pumped over a WebSocket over TLS ([`ws`]), and QUIC ([`quic`]), where each logical stream is a
//! native QUIC stream. Relay and agent code does not depend on which one carries a tunnel
//! ([`Connection::transport`] says, for display).
//!
//! Also here, because both sides need them: TLS configuration helpers ([`tls`]), the [`Secret`] type, and the
//! control-channel message codec ([`control`]); and, for the agent's outbound connections, HTTP CONNECT proxy
//! support ([`proxy`]).
//!
//! Each [`Connection`] runs one driver task (so it must be created inside a Tokio runtime); stream handles
//! talk to it through a shared, briefly locked session. Timers follow Tokio's clock, so tests may use
//! `tokio::time::pause()`.
//!
//! For streams of kind [`kind::HTTP_HEADS`], [`heads`] turns HTTP heads into the protocol's binary head
//! blocks and back and reads bodies off streams; what a request means is the relay's and agent's business.
//!
//! This crate does not know about Kubernetes or clusters, does not authenticate anyone (the
//! relay's HTTP server checks credentials before calling [`ws::upgrade_response`]) and does not retry or
//! reconnect (the agent does).

mod api;
mod conn;
pub mod cork;
pub mod heads;
pub mod proxy;
pub mod quic;
pub mod ws;

pub use api::{Connection, Incoming, Stream, StreamControl, TransportKind};
pub use conn::{CloseInfo, OpenOptions, TunnelError};
pub use tether_proto::{ConnectionError, Priority, Role, Stats, code, kind};

/// Session configuration, re-exported so callers can tune limits without depending on proto directly.
pub use tether_proto::Config as SessionConfig;
