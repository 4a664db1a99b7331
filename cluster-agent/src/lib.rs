//! The Tether cluster agent.
//!
//! It runs inside a cluster that accepts no inbound connection: it makes its own key pair and trades a
//! one-time onboarding token and a CSR for the cluster's client certificate ([`identity`], stored in its state
//! directory or, with `--state-secret`, in a Kubernetes Secret shared by replicas: [`state_secret`]), dials OUT to the relay over WebSocket/TLS with that certificate (mutual TLS;
//! [`tether_tunnel::ws::connect_with_proxy`], through an HTTP CONNECT proxy when configured), and serves every
//! logical stream the relay opens as one HTTP/1.1 exchange with its own apiserver ([`forward`]).
//!
//! Next to the streams, each tunnel carries one control channel ([`tether_api::control`]): heartbeats,
//! cluster metadata read with the agent's own kube credentials ([`metadata`], a watch on nodes), the agent's
//! health, and the in-band renewal of its certificate at about two thirds of its lifetime. It reconnects
//! with full-jitter exponential backoff ([`tether_api::reconnect::Backoff`]) and, on shutdown, sends GOAWAY and lets open streams
//! finish before closing.
//!
//! With `--entra-tenant`/`--entra-audience` it is also the in-cluster authentication proxy ([`auth_proxy`]):
//! a request carrying an Entra-style token is validated again in the cluster (the cluster never trusts the
//! relay blindly), refused with 401 if invalid, and otherwise forwarded on the agent's own credentials with
//! `Impersonate-*` headers for the validated user; group overages are resolved through the relay's directory
//! over the control channel. With `--guard-url` it passes the guard RBAC snapshots the relay sends on to
//! tether-guard (`PUT /snapshot`, retried with backoff until accepted).
//!
//! What it does not do: it is never an open proxy. The upstream URL, CA and TLS server name come from the kube
//! config only, never from a request; every request without an Entra-style token carries the user's own
//! `Authorization` (pass-through) and no credential of the agent's. It does not authorize (guard, called by
//! the apiserver, does), and it does not listen on any port but, with `--health-listen`, the plain-HTTP probe
//! port ([`probes`]: `/readyz`, `/livez`, nothing else).
//!
//! Entry point: [`run`] with a [`Config`], as called by the `tether-agent` binary and by `tether up`.
//! `tether-agent doctor` ([`doctor::run`]) checks, with the same configuration, what the agent needs.

mod agent;
pub mod auth_proxy;
mod config;
mod control;
mod dial;
mod directory;
pub mod doctor;
mod error;
mod event;
pub mod forward;
mod guard_push;
mod health;
pub mod identity;
pub mod metadata;
mod onboard;
pub mod pool;
pub mod probes;
pub mod state_secret;
mod store;
mod supervisor;
mod tunnel;
mod upstream;

pub use agent::run;
pub use config::{Config, ConfigError, EntraConfig, GuardConfig, MAX_TUNNELS, TransportMode};
pub use error::{AgentError, IDENTITY_EXPIRED_REASON};
pub use tether_api::reconnect::Backoff;
pub use tether_runtime::Secret;

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

/// Whether `e` or one of its causes is a `T`.
pub(crate) fn chain_has<T: std::error::Error + 'static>(
    e: &(dyn std::error::Error + 'static),
) -> bool {
    let mut cur = Some(e);
    while let Some(err) = cur {
        if err.is::<T>() {
            return true;
        }
        cur = err.source();
    }
    false
}
