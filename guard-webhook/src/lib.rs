//! Tether guard: the Kubernetes authentication and authorization webhooks that let Entra (Azure AD) identities and
//! Azure-RBAC-style role assignments decide what a person may do in a cluster.
//!
//! Token validation and the RBAC model are `tether-auth`'s (shared with the relay and the agent); this crate is the
//! webhook server around them:
//! - [`cache`]: the decision cache (keyed by object id, group-set hash, actions and scope; emptied on a new
//!   snapshot version). [`snapshot`]: the snapshot store (persisted atomically, last-known-good, newer versions
//!   only) and the pluggable [`snapshot::SnapshotSource`].
//! - [`engine::Guard`]: authentication and authorization with cache, [`metrics`] and [`audit`] lines, callable in
//!   process; [`server`]: the HTTPS webhook server (`/authenticate`, `/authorize`, `/snapshot`, `/metrics`,
//!   `/healthz`) with client-certificate authentication of the apiserver; [`review`]: the webhook wire formats.
//!
//! What it does not do: it does not talk to Azure or Microsoft Graph (group overages go through a
//! `tether_auth::token::GroupResolver` the caller provides), does not store role assignments (the relay does, and pushes
//! snapshots), does not issue tokens, and does not implement Kubernetes RBAC (it answers "no opinion" for
//! `system:` and non-Entra users so the apiserver's other authorizers decide).

pub mod audit;
pub mod cache;
pub mod config;
pub mod engine;
pub mod metrics;
pub mod review;
pub mod server;
pub mod snapshot;

pub use engine::{Guard, GuardOptions};
pub use server::{Callers, Limits, ServerConfig, run, server_tls, server_tls_for};
pub use snapshot::SnapshotStore;
