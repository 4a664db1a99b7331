//! The Tether cluster agent.
//!
//! It runs inside a cluster that accepts no inbound connection: it makes its own key pair and trades a
//! one-time onboarding token and a CSR for the cluster's client certificate ([`identity`], stored in its state
//! directory), dials OUT to the relay over WebSocket/TLS with that certificate (mutual TLS;
//! [`tether_tunnel::ws::connect_with_proxy`], through an HTTP CONNECT proxy when configured), and serves every
//! logical stream the relay opens as one HTTP/1.1 exchange with its own apiserver ([`forward`]).
//!
//! Next to the streams, each tunnel carries one control channel ([`tether_tunnel::control`]): heartbeats,
//! cluster metadata read with the agent's own kube credentials ([`metadata`], a watch on nodes), the agent's
//! health, and the in-band renewal of its certificate at about two thirds of its lifetime. It reconnects
//! with full-jitter exponential backoff ([`Backoff`]) and, on shutdown, sends GOAWAY and lets open streams
//! finish before closing.
//!
//! What it does not do: it is never an open proxy. The upstream URL, CA and TLS server name come from the kube
//! config only, never from a request; forwarded requests carry the user's own `Authorization` (pass-through)
//! and no credential of the agent's. It does not listen on any port.
//!
//! Entry point: [`run`] with a [`Config`], as called by the `tether-agent` binary and by `tether up`.

mod agent;
pub mod backoff;
mod config;
mod control;
pub mod forward;
mod health;
pub mod identity;
pub mod metadata;
mod onboard;

pub use agent::{AgentError, IDENTITY_EXPIRED_REASON, run};
pub use backoff::Backoff;
pub use config::{Config, ConfigError};
pub use tether_tunnel::Secret;

/// An error and its causes on one line, for logs and Status messages.
pub(crate) fn error_chain(e: &(dyn std::error::Error + 'static)) -> String {
    let mut out = e.to_string();
    let mut cur = e.source();
    while let Some(err) = cur {
        let next = err.to_string();
        // Many errors repeat their source's message in their own; do not print it twice.
        if !out.ends_with(&next) {
            out.push_str(": ");
            out.push_str(&next);
        }
        cur = err.source();
    }
    out
}
