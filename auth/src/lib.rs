//! Who a caller is and what they may do, as Tether's relay, agent and guard all decide it.
//!
//! - [`token`]: Entra-style (Azure AD) JWT validation — v1 and v2 issuers, tenant, audience, lifetime, algorithm
//!   allow-list, key-type checks — as pure functions, and [`token::Authenticator`], which adds the signing keys from
//!   [`jwks`] (OIDC discovery, JWKS cache, rate-limited refetch, last-known-good) and group-overage resolution.
//! - [`rbac`]: Kubernetes requests → Azure data actions, role definitions (the Azure Arc built-ins and custom roles
//!   from JSON), role and deny assignments, the per-cluster [`rbac::Snapshot`], and
//!   `decide(&Snapshot, &AccessRequest) -> Decision`, all pure.
//!
//! One implementation, so the relay's pre-check, the agent's in-cluster check and guard's webhook can never disagree
//! about what a token is or what a role allows.
//!
//! What it does not do: serve HTTP (guard's webhook server is `tether-guard`), store assignments (the relay does),
//! issue tokens, talk to Microsoft Graph (group overage goes through a [`token::GroupResolver`] the caller
//! provides), or implement Kubernetes RBAC.

pub mod jwks;
pub mod rbac;
pub mod token;

pub use rbac::{AccessRequest, Decision, Snapshot, decide};
pub use token::{Authenticator, Identity, TokenConfig, TokenError};
