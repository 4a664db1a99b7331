//! The relay's own check of Entra-style tokens, before anything enters a tunnel.
//!
//! A bearer token is *Entra-style* exactly as the agent and guard's authenticator see it
//! ([`tether_auth::token::is_entra_style`], the one function): a JWT whose (unverified) `iss` lies under one of
//! the configured authorities (`{authority}/…`, v2 and v1). Such a token must pass guard's full validation (algorithm allow-list,
//! trusted issuer and tenant, signature from the issuer's JWKS, lifetime, audience, group overage resolved from
//! the relay's directory), or the request is refused with 401. Every other token — Kubernetes service-account
//! tokens, opaque tokens, JWTs of other issuers — passes through untouched: the cluster decides. The agent
//! validates again in the cluster; this check only keeps refused tokens out of tunnels.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;

use http::HeaderMap;
use tether_auth::jwks::HttpsFetcher;
use tether_auth::token::GroupResolver;
use tether_auth::token::is_entra_style;
use tether_auth::{Authenticator, TokenError};

use crate::auth;
use crate::config::{ConfigError, EntraConfig};
use crate::error::RelayError;
use crate::store::Store;

/// Builds the authenticator for `config`: keys fetched over HTTPS (trusting `authority_ca` too), group
/// overage resolved from `store`'s directory.
pub(crate) fn authenticator(
    config: &EntraConfig,
    store: Arc<dyn Store>,
) -> Result<Arc<Authenticator>, RelayError> {
    let ca = match &config.authority_ca {
        Some(path) => Some(
            std::fs::read(path)
                .map_err(|e| RelayError::io("cannot read the Entra authority CA", path, e))?,
        ),
        None => None,
    };
    let fetcher = HttpsFetcher::new(ca.as_deref()).map_err(|e| {
        RelayError::Config(ConfigError::InvalidEntra(format!(
            "unusable authority CA: {e}"
        )))
    })?;
    let authenticator = Authenticator::new(config.token_config(), Arc::new(fetcher))
        .map_err(|e| RelayError::Config(ConfigError::InvalidEntra(e.to_string())))?
        .with_group_resolver(Arc::new(Directory { store }));
    Ok(Arc::new(authenticator))
}

/// Group overage resolved from the relay's own directory.
struct Directory {
    store: Arc<dyn Store>,
}

impl GroupResolver for Directory {
    fn groups<'a>(
        &'a self,
        tid: &'a str,
        oid: &'a str,
    ) -> Pin<Box<dyn Future<Output = Result<Vec<String>, String>> + Send + 'a>> {
        Box::pin(crate::rbac::resolve_groups(self.store.as_ref(), tid, oid))
    }
}

/// Refuses a request whose bearer token is Entra-style and does not validate (the handler answers 401); lets
/// every other request through. Returns the validated token's `oid`, if it was one.
pub(crate) async fn check(
    authenticator: &Authenticator,
    headers: &HeaderMap,
) -> Result<Option<String>, TokenError> {
    let Some(token) = auth::bearer(headers) else {
        return Ok(None);
    };
    if !is_entra_style(authenticator.config(), token.expose()) {
        return Ok(None);
    }
    match authenticator.authenticate(token.expose()).await {
        Ok(identity) => {
            tracing::debug!(oid = %identity.oid(), "Entra token validated at the relay");
            Ok(Some(identity.oid().to_string()))
        }
        Err(e) => {
            tracing::info!(reason = e.label(), "Entra token refused at the relay");
            Err(e)
        }
    }
}
