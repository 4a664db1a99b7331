//! The in-cluster authentication proxy (the role of Arc's kube-aad-proxy): the cluster never trusts the relay
//! blindly.
//!
//! For each forwarded request whose bearer token is Entra-style ([`tether_auth::token::is_entra_style`]: a JWT
//! whose `iss` lies under a configured authority), the token is validated again here with guard's
//! [`Authenticator`] (signature against the issuer's published keys, tenant, audience, lifetime, algorithm
//! allow-list; group overage resolved through the relay's directory). A refused token is answered with 401 and
//! never forwarded. An accepted one is replaced: the user's `Authorization` and every `Impersonate-*` header
//! they sent are removed, and the request goes to the apiserver on the agent's OWN credentials with
//! `Impersonate-User`, `Impersonate-Group` (one per group), `Impersonate-Uid`, `Impersonate-Extra-oid` and
//! `Impersonate-Extra-tid` (see [`crate::forward`]). Any other token (a Kubernetes service-account token, an
//! opaque token) is not this proxy's to judge and passes through unchanged.
//!
//! What it does not do: it does not authorize (guard, called by the apiserver, does), and it never forwards a
//! token it refused.

use std::sync::Arc;

use http::header::{self, HeaderMap, HeaderName, HeaderValue};
use tether_auth::jwks::HttpsFetcher;
use tether_auth::token::{EXTRA_OID, EXTRA_TID, GroupResolver, is_entra_style};
use tether_auth::{Authenticator, Identity, TokenError};

use crate::config::EntraConfig;

/// `Impersonate-User`.
pub const IMPERSONATE_USER: &str = "impersonate-user";
/// `Impersonate-Group`, once per group.
pub const IMPERSONATE_GROUP: &str = "impersonate-group";
/// `Impersonate-Uid`.
pub const IMPERSONATE_UID: &str = "impersonate-uid";
/// The prefix of `Impersonate-Extra-{key}` headers.
pub const IMPERSONATE_EXTRA_PREFIX: &str = "impersonate-extra-";
/// The prefix of every impersonation header (all of them are dropped from a user's Entra request).
const IMPERSONATE_PREFIX: &str = "impersonate-";
/// The WebSocket subprotocol in which browser clients carry a bearer token (`base64url.bearer.…{token}`).
const WEBSOCKET_BEARER_PREFIX: &str = "base64url.bearer.authorization.k8s.io.";

/// Why the authentication proxy could not be set up.
#[derive(Debug, thiserror::Error)]
pub enum AuthProxyError {
    /// The Entra settings are unusable.
    #[error("invalid Entra settings: {0}")]
    Config(#[source] tether_auth::token::ConfigError),
    /// The authority CA file could not be read or used.
    #[error("cannot use the Entra authority CA: {0}")]
    AuthorityCa(#[source] tether_runtime::tls::TlsError),
}

/// What the proxy makes of a request's credentials.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Credential<'a> {
    /// No Entra-style token: forward as it is.
    PassThrough,
    /// One Entra-style bearer token, to validate.
    Entra(&'a str),
}

/// Validates Entra-style tokens in the cluster. Cheap to clone.
#[derive(Clone, Debug)]
pub struct AuthProxy {
    authenticator: Arc<Authenticator>,
}

impl AuthProxy {
    /// A proxy for `entra`: discovery and keys are fetched over HTTPS (trusting `authority_ca` when set, the
    /// public web roots otherwise); group overages are resolved with `groups` (the relay's directory), or
    /// refused without one.
    pub fn new(
        entra: &EntraConfig,
        groups: Option<Arc<dyn GroupResolver>>,
    ) -> Result<Self, AuthProxyError> {
        let ca = entra
            .authority_ca
            .as_deref()
            .map(tether_runtime::tls::read_file)
            .transpose()
            .map_err(AuthProxyError::AuthorityCa)?;
        let fetcher = HttpsFetcher::new(ca.as_deref()).map_err(AuthProxyError::AuthorityCa)?;
        let mut authenticator = Authenticator::new(entra.token_config(), Arc::new(fetcher))
            .map_err(AuthProxyError::Config)?;
        if let Some(groups) = groups {
            authenticator = authenticator.with_group_resolver(groups);
        }
        Ok(Self::from_authenticator(Arc::new(authenticator)))
    }

    /// A proxy validating with `authenticator`.
    pub fn from_authenticator(authenticator: Arc<Authenticator>) -> Self {
        Self { authenticator }
    }

    /// Finds the Entra-style bearer token in `headers`, if any. Several `Authorization` headers of which one is
    /// Entra-style are refused: which one the apiserver would read is not ours to guess.
    pub(crate) fn credential<'a>(
        &self,
        headers: &'a HeaderMap,
    ) -> Result<Credential<'a>, &'static str> {
        let config = self.authenticator.config();
        let mut values = headers.get_all(header::AUTHORIZATION).iter();
        let (Some(first), rest) = (values.next(), values.count()) else {
            return Ok(Credential::PassThrough);
        };
        let is_entra = |v: &HeaderValue| bearer(v).is_some_and(|t| is_entra_style(config, t));
        if rest > 0 {
            let any_entra = headers.get_all(header::AUTHORIZATION).iter().any(is_entra);
            return if any_entra {
                Err("more than one Authorization header")
            } else {
                Ok(Credential::PassThrough)
            };
        }
        match bearer(first) {
            Some(token) if is_entra_style(config, token) => Ok(Credential::Entra(token)),
            _ => Ok(Credential::PassThrough),
        }
    }

    /// Validates `token` (signature, issuer and tenant, audience, lifetime, groups).
    pub async fn authenticate(&self, token: &str) -> Result<Identity, TokenError> {
        self.authenticator.authenticate(token).await
    }
}

/// The token of a `Bearer` credential (scheme case-insensitive), if the value is one.
fn bearer(value: &HeaderValue) -> Option<&str> {
    let text = value.to_str().ok()?;
    let (scheme, token) = text.trim().split_once(' ')?;
    let token = token.trim();
    (scheme.eq_ignore_ascii_case("bearer") && !token.is_empty()).then_some(token)
}

/// Rewrites `headers` for an authenticated Entra user: removes `Authorization`, any bearer token carried as a
/// WebSocket subprotocol, and every `Impersonate-*` header, then adds the impersonation headers for `identity`. The agent's own credential is added by the
/// caller. Fails (nothing is forwarded then) when the identity cannot be written as header values.
pub(crate) fn impersonate(
    headers: &mut HeaderMap,
    identity: &Identity,
) -> Result<(), &'static str> {
    headers.remove(header::AUTHORIZATION);
    let user_sent: Vec<HeaderName> = headers
        .keys()
        .filter(|name| name.as_str().starts_with(IMPERSONATE_PREFIX))
        .cloned()
        .collect();
    for name in user_sent {
        headers.remove(&name);
    }
    strip_websocket_bearer(headers);
    // Bytes beyond ASCII (a UPN with accents) are allowed; control characters are not.
    let value = |v: &str| {
        HeaderValue::from_bytes(v.as_bytes())
            .map_err(|_| "the identity cannot be carried in impersonation headers")
    };
    headers.insert(IMPERSONATE_USER, value(&identity.username)?);
    headers.insert(IMPERSONATE_UID, value(&identity.uid)?);
    for group in &identity.groups {
        headers.append(IMPERSONATE_GROUP, value(group)?);
    }
    for key in [EXTRA_OID, EXTRA_TID] {
        let name = HeaderName::try_from(format!("{IMPERSONATE_EXTRA_PREFIX}{key}"))
            .map_err(|_| "the identity cannot be carried in impersonation headers")?;
        for v in identity.extra.get(key).into_iter().flatten() {
            headers.append(name.clone(), value(v)?);
        }
    }
    Ok(())
}

/// Drops `base64url.bearer.authorization.k8s.io.*` from `Sec-WebSocket-Protocol`, keeping the other
/// subprotocols (the apiserver would otherwise still see the user's token there).
fn strip_websocket_bearer(headers: &mut HeaderMap) {
    let name = header::SEC_WEBSOCKET_PROTOCOL;
    if !headers.contains_key(&name) {
        return;
    }
    let kept: Vec<String> = headers
        .get_all(&name)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .map(str::trim)
        .filter(|p| !p.is_empty() && !p.starts_with(WEBSOCKET_BEARER_PREFIX))
        .map(str::to_owned)
        .collect();
    headers.remove(&name);
    if !kept.is_empty()
        && let Ok(value) = HeaderValue::from_str(&kept.join(", "))
    {
        headers.insert(name, value);
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use std::collections::BTreeMap;

    use base64::Engine as _;
    use base64::engine::general_purpose::URL_SAFE_NO_PAD;
    use tether_auth::TokenConfig;
    use tether_auth::jwks::{Fetch, FetchError, FetchFuture};
    use tether_auth::token::PrincipalKind;

    use super::*;

    struct NoFetch;

    impl Fetch for NoFetch {
        fn get<'a>(&'a self, url: &'a str) -> FetchFuture<'a> {
            Box::pin(async move { Err(FetchError(format!("no network in unit tests: {url}"))) })
        }
    }

    fn proxy() -> AuthProxy {
        let config = TokenConfig::new(vec!["t1".into()], vec!["api://tether".into()]);
        AuthProxy::from_authenticator(Arc::new(
            Authenticator::new(config, Arc::new(NoFetch)).unwrap(),
        ))
    }

    fn jwt(iss: &str) -> String {
        let part = |v: serde_json::Value| URL_SAFE_NO_PAD.encode(v.to_string());
        format!(
            "{}.{}.c2ln",
            part(serde_json::json!({"alg": "RS256", "kid": "k"})),
            part(serde_json::json!({"iss": iss}))
        )
    }

    fn headers(auth: &[&str]) -> HeaderMap {
        let mut h = HeaderMap::new();
        for a in auth {
            h.append(header::AUTHORIZATION, HeaderValue::from_str(a).unwrap());
        }
        h
    }

    #[test]
    fn only_entra_style_bearer_tokens_are_taken() {
        let p = proxy();
        let entra = jwt("https://login.microsoftonline.com/t1/v2.0");
        let sa = jwt("https://kubernetes.default.svc.cluster.local");

        let h = headers(&[&format!("Bearer {entra}")]);
        assert_eq!(p.credential(&h), Ok(Credential::Entra(entra.as_str())));
        let h = headers(&[&format!("bearer   {entra} ")]);
        assert_eq!(p.credential(&h), Ok(Credential::Entra(entra.as_str())));
        // Another tenant under the same authority must be validated (and then refused), not passed on.
        let other = jwt("https://login.microsoftonline.com/other/v2.0");
        let h = headers(&[&format!("Bearer {other}")]);
        assert_eq!(p.credential(&h), Ok(Credential::Entra(other.as_str())));

        for pass in [
            headers(&[]),
            headers(&[&format!("Bearer {sa}")]),
            headers(&["Bearer opaque-token"]),
            headers(&[&format!("Basic {entra}")]),
            headers(&["Bearer a", "Bearer b"]),
        ] {
            assert_eq!(p.credential(&pass), Ok(Credential::PassThrough), "{pass:?}");
        }
        let h = headers(&[&format!("Bearer {sa}"), &format!("Bearer {entra}")]);
        assert!(p.credential(&h).is_err());
    }

    #[test]
    fn impersonation_replaces_the_users_credentials_and_choices() {
        let mut h = HeaderMap::new();
        h.insert(
            header::AUTHORIZATION,
            HeaderValue::from_static("Bearer user"),
        );
        h.insert("impersonate-user", HeaderValue::from_static("system:admin"));
        h.append(
            "impersonate-group",
            HeaderValue::from_static("system:masters"),
        );
        h.insert("impersonate-extra-scopes", HeaderValue::from_static("x"));
        h.insert("impersonate-uid", HeaderValue::from_static("0"));
        h.insert("accept", HeaderValue::from_static("application/json"));
        h.insert(
            header::SEC_WEBSOCKET_PROTOCOL,
            HeaderValue::from_static(
                "v5.channel.k8s.io, base64url.bearer.authorization.k8s.io.dXNlcg",
            ),
        );
        let identity = Identity {
            username: "alice@contoso.example".into(),
            uid: "oid-1".into(),
            groups: vec!["g1".into(), "g2".into()],
            extra: BTreeMap::from([
                ("oid".to_owned(), vec!["oid-1".to_owned()]),
                ("tid".to_owned(), vec!["t1".to_owned()]),
            ]),
            kind: PrincipalKind::User,
        };
        impersonate(&mut h, &identity).unwrap();
        assert!(h.get(header::AUTHORIZATION).is_none());
        assert!(h.get("impersonate-extra-scopes").is_none());
        assert_eq!(h["impersonate-user"], "alice@contoso.example");
        assert_eq!(h["impersonate-uid"], "oid-1");
        let groups: Vec<_> = h.get_all("impersonate-group").iter().collect();
        assert_eq!(groups, ["g1", "g2"]);
        assert_eq!(h["impersonate-extra-oid"], "oid-1");
        assert_eq!(h["impersonate-extra-tid"], "t1");
        assert_eq!(h["accept"], "application/json");
        assert_eq!(h[header::SEC_WEBSOCKET_PROTOCOL], "v5.channel.k8s.io");
        assert_eq!(h.len(), 8);

        let mut only_token = HeaderMap::new();
        only_token.insert(
            header::SEC_WEBSOCKET_PROTOCOL,
            HeaderValue::from_static("base64url.bearer.authorization.k8s.io.dXNlcg"),
        );
        impersonate(&mut only_token, &identity).unwrap();
        assert!(only_token.get(header::SEC_WEBSOCKET_PROTOCOL).is_none());

        let bad = Identity {
            username: "evil\r\nx: y".into(),
            ..identity
        };
        assert!(impersonate(&mut h, &bad).is_err());
    }
}
