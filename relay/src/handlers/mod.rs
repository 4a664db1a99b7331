//! The HTTP handlers: each reads a request, calls the domain services and the store, and answers; errors are
//! [`ApiError`](crate::api_error::ApiError)s, which the router turns into a Kubernetes `Status`.

pub(crate) mod agent;
pub(crate) mod clusters;
pub(crate) mod health;
pub(crate) mod peer;
pub(crate) mod rbac;
pub(crate) mod user;

use http::HeaderMap;

use crate::api_error::ApiError;
use crate::auth;
use crate::state::Shared;
use crate::store::TokenHash;

/// Refuses a request without the admin token.
pub(crate) fn require_admin(shared: &Shared, headers: &HeaderMap) -> Result<(), ApiError> {
    let authorized = auth::bearer(headers)
        .is_some_and(|t| TokenHash::of(t.expose()).ct_eq(&shared.admin_token_hash));
    if authorized {
        Ok(())
    } else {
        Err(ApiError::unauthorized(
            "a valid admin token is required (Authorization: Bearer ADMIN_TOKEN)",
        ))
    }
}

/// The request-body limit of the admin and agent APIs.
pub(crate) fn body_limit(shared: &Shared) -> usize {
    shared.config.limits.max_control_body_bytes
}
