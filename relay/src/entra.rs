//! The relay's own check of Entra-style tokens, before anything enters a tunnel.
//!
//! A bearer token is *Entra-style* when it is a compact JWT whose (unverified) `iss` lies under one of the
//! configured authorities: `{authority}/…` (v2, and the authority the dev issuer and tests use) or
//! `https://sts.windows.net/…` (v1). Such a token must pass guard's full validation (algorithm allow-list,
//! trusted issuer and tenant, signature from the issuer's JWKS, lifetime, audience, group overage resolved from
//! the relay's directory), or the request is refused with 401. Every other token — Kubernetes service-account
//! tokens, opaque tokens, JWTs of other issuers — passes through untouched: the cluster decides. The agent
//! validates again in the cluster; this check only keeps refused tokens out of tunnels.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;

use base64::Engine as _;
use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use http::HeaderMap;
use tether_auth::jwks::HttpsFetcher;
use tether_auth::token::GroupResolver;
use tether_auth::{Authenticator, TokenConfig, TokenError};

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

/// Whether `token` is a compact JWT whose `iss` is under one of `config`'s authorities (not verified).
pub(crate) fn is_entra_style(config: &TokenConfig, token: &str) -> bool {
    let mut parts = token.split('.');
    let (Some(_), Some(payload), Some(_), None) =
        (parts.next(), parts.next(), parts.next(), parts.next())
    else {
        return false;
    };
    let Ok(bytes) = URL_SAFE_NO_PAD.decode(payload.trim_end_matches('=')) else {
        return false;
    };
    #[derive(serde::Deserialize)]
    struct Iss {
        iss: Option<String>,
    }
    let Ok(Iss { iss: Some(iss) }) = serde_json::from_slice::<Iss>(&bytes) else {
        return false;
    };
    [&config.v2_authority, &config.v1_authority]
        .iter()
        .any(|authority| {
            iss.strip_prefix(authority.trim_end_matches('/'))
                .is_some_and(|rest| rest.starts_with('/'))
        })
}

/// Refuses a request whose bearer token is Entra-style and does not validate (the handler answers 401); lets
/// every other request through.
pub(crate) async fn check(
    authenticator: &Authenticator,
    headers: &HeaderMap,
) -> Result<(), TokenError> {
    let Some(token) = auth::bearer(headers) else {
        return Ok(());
    };
    if !is_entra_style(authenticator.config(), token.expose()) {
        return Ok(());
    }
    match authenticator.authenticate(token.expose()).await {
        Ok(identity) => {
            tracing::debug!(oid = %identity.oid(), "Entra token validated at the relay");
            Ok(())
        }
        Err(e) => {
            tracing::info!(reason = e.label(), "Entra token refused at the relay");
            Err(e)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn jwt(payload: &str) -> String {
        format!(
            "{}.{}.sig",
            URL_SAFE_NO_PAD.encode(br#"{"alg":"RS256","kid":"k"}"#),
            URL_SAFE_NO_PAD.encode(payload.as_bytes())
        )
    }

    #[test]
    fn entra_style_is_decided_by_the_issuer_authority() {
        let mut config = TokenConfig::new(vec!["t".into()], vec!["a".into()]);
        config.v2_authority = "https://127.0.0.1:8443".into();
        for yes in [
            r#"{"iss":"https://127.0.0.1:8443/t/v2.0"}"#,
            r#"{"iss":"https://127.0.0.1:8443/other-tenant/v2.0"}"#,
            r#"{"iss":"https://sts.windows.net/t/"}"#,
        ] {
            assert!(is_entra_style(&config, &jwt(yes)), "{yes}");
        }
        for no in [
            r#"{"iss":"https://kubernetes.default.svc.cluster.local"}"#,
            r#"{"iss":"https://127.0.0.1:84430/t/v2.0"}"#,
            r#"{"iss":"https://login.microsoftonline.com/t/v2.0"}"#,
            r#"{"sub":"x"}"#,
            r#"{"iss":5}"#,
            "not json",
        ] {
            assert!(!is_entra_style(&config, &jwt(no)), "{no}");
        }
        assert!(!is_entra_style(&config, "opaque-token"));
        assert!(!is_entra_style(&config, "a.b"));
        assert!(!is_entra_style(&config, "a.b.c.d"));
        assert!(!is_entra_style(&config, "a.!!!.c"));
    }
}
