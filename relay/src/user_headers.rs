//! What a user request's headers must look like before anything enters a tunnel, and what the relay removes
//! and adds: the credential pre-check's shape rule and header hygiene (pure functions, no I/O).
//!
//! Order matters, and [`sanitize`] runs first: hop-by-hop headers (those the `Connection` header names
//! included) are removed *before* the credential is checked, so nothing later can remove a header after it
//! was checked; `Authorization` is never treated as hop-by-hop (`Connection: authorization` names a header
//! that stays). Identity headers a user could forge for the apiserver's audit or an authenticating proxy
//! (`X-Remote-*`, `X-Forwarded-*`, `Forwarded`, `X-Real-Ip`) are dropped, and the relay adds the real client
//! address as `X-Forwarded-For`. `Impersonate-*` headers pass: the apiserver authorizes impersonation against
//! the caller's own credential, and the agent's authentication proxy replaces them for Entra-style tokens.
//!
//! Not done here: validating a token (the [`crate::entra`] check and the cluster do that).

use std::net::SocketAddr;

use http::header::{self, AUTHORIZATION, HeaderMap, HeaderName, HeaderValue};

/// The longest bearer token accepted (Entra tokens with many groups stay well below; the header limit of
/// the listener bounds it too).
pub(crate) const MAX_TOKEN_BYTES: usize = 16 * 1024;

/// Headers that describe one hop (RFC 9110 §7.6.1, plus the legacy proxy ones); `Connection` and `Upgrade`
/// are handled apart.
static HOP_BY_HOP: [HeaderName; 6] = [
    HeaderName::from_static("keep-alive"),
    HeaderName::from_static("proxy-connection"),
    header::PROXY_AUTHENTICATE,
    header::PROXY_AUTHORIZATION,
    header::TE,
    header::TRAILER,
];

/// Prefixes of headers that carry identity or client-address claims a user must not make.
const IDENTITY_PREFIXES: [&str; 2] = ["x-remote-", "x-forwarded-"];

/// Single identity headers a user must not send.
static IDENTITY_HEADERS: [HeaderName; 2] =
    [header::FORWARDED, HeaderName::from_static("x-real-ip")];

/// Removes hop-by-hop and forged identity headers from a user request and adds `X-Forwarded-For: PEER`.
/// Keeps `Connection: upgrade` with `Upgrade` when the request asks to upgrade (the forwarder needs them), and
/// never removes `Authorization`, whatever `Connection` names.
pub(crate) fn sanitize(headers: &mut HeaderMap, forwarded_for: &HeaderValue) {
    let mut upgrade = false;
    let named: Vec<HeaderName> = headers
        .get_all(header::CONNECTION)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .map(str::trim)
        .filter(|t| !t.is_empty())
        .filter(|t| {
            let is_upgrade = t.eq_ignore_ascii_case("upgrade");
            upgrade |= is_upgrade;
            !is_upgrade
        })
        .filter_map(|t| HeaderName::from_bytes(t.as_bytes()).ok())
        .filter(|name| *name != AUTHORIZATION && *name != header::HOST)
        .collect();
    let keep_upgrade = upgrade && headers.contains_key(header::UPGRADE);
    // One pass over the names the request has (usually none of these) instead of a hashed removal of each
    // name it might have.
    let doomed: Vec<HeaderName> = headers
        .keys()
        .filter(|name| {
            *name == header::CONNECTION
                || (*name == header::UPGRADE && !keep_upgrade)
                || HOP_BY_HOP.contains(name)
                || named.contains(name)
                || IDENTITY_HEADERS.contains(name)
                || IDENTITY_PREFIXES
                    .iter()
                    .any(|p| name.as_str().starts_with(p))
        })
        .cloned()
        .collect();
    for name in &doomed {
        headers.remove(name);
    }
    if keep_upgrade {
        headers.insert(header::CONNECTION, HeaderValue::from_static("upgrade"));
    }
    headers.insert(
        HeaderName::from_static("x-forwarded-for"),
        forwarded_for.clone(),
    );
}

/// The `X-Forwarded-For` value for a client at `peer` (its IP; computed once per connection).
pub(crate) fn forwarded_for(peer: SocketAddr) -> HeaderValue {
    HeaderValue::try_from(peer.ip().to_string())
        .unwrap_or_else(|_| HeaderValue::from_static("unknown"))
}

/// Why a request's credential is not even plausible (the handler answers 401).
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub(crate) enum CredentialError {
    /// No `Authorization` header, or an empty one.
    #[error(
        "no credentials: requests through the relay must carry the cluster's own Authorization header"
    )]
    Missing,
    /// More than one `Authorization` header.
    #[error("more than one Authorization header")]
    Ambiguous,
    /// Not `Bearer TOKEN` (Kubernetes accepts no other scheme from users).
    #[error("the Authorization header must be `Bearer TOKEN`")]
    NotBearer,
    /// The token is not token68 (RFC 9110 §11.2).
    #[error("the bearer token is malformed")]
    Malformed,
    /// The token is longer than any token the relay forwards (the same words as tether-auth's limit).
    #[error("token refused: {len} bytes is more than the {max}-byte limit")]
    TooLarge {
        /// The token's length.
        len: usize,
        /// [`MAX_TOKEN_BYTES`].
        max: usize,
    },
}

/// The shape check: exactly one `Authorization: Bearer TOKEN` where TOKEN is token68 (letters, digits,
/// `-._~+/`, then optional `=` padding) of at most [`MAX_TOKEN_BYTES`]. Returns the token.
pub(crate) fn plausible_bearer(headers: &HeaderMap) -> Result<&str, CredentialError> {
    let mut values = headers.get_all(AUTHORIZATION).iter();
    let value = values.next().ok_or(CredentialError::Missing)?;
    if values.next().is_some() {
        return Err(CredentialError::Ambiguous);
    }
    let value = value
        .to_str()
        .map_err(|_| CredentialError::Malformed)?
        .trim();
    if value.is_empty() {
        return Err(CredentialError::Missing);
    }
    let (scheme, token) = value.split_once(' ').ok_or(CredentialError::NotBearer)?;
    if !scheme.eq_ignore_ascii_case("bearer") {
        return Err(CredentialError::NotBearer);
    }
    let token = token.trim();
    if token.len() > MAX_TOKEN_BYTES {
        return Err(CredentialError::TooLarge {
            len: token.len(),
            max: MAX_TOKEN_BYTES,
        });
    }
    let body = token.trim_end_matches('=');
    let token68 = !body.is_empty()
        && body
            .bytes()
            .all(|c| c.is_ascii_alphanumeric() || b"-._~+/".contains(&c));
    if token68 {
        Ok(token)
    } else {
        Err(CredentialError::Malformed)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn with_auth(values: &[&'static str]) -> HeaderMap {
        let mut h = HeaderMap::new();
        for v in values {
            h.append(AUTHORIZATION, HeaderValue::from_static(v));
        }
        h
    }

    #[test]
    fn only_plausible_bearer_tokens_pass() {
        for ok in [
            "Bearer abc",
            "bearer   eyJhbGciOi.eyJpc3Mi.sig-_~+/==",
            "BEARER t",
        ] {
            assert!(plausible_bearer(&with_auth(&[ok])).is_ok(), "{ok}");
        }
        let cases: [(&[&'static str], CredentialError); 9] = [
            (&[], CredentialError::Missing),
            (&[""], CredentialError::Missing),
            (&["  "], CredentialError::Missing),
            (&["x"], CredentialError::NotBearer),
            (&["Basic dXNlcjpwdw=="], CredentialError::NotBearer),
            (&["Bearer "], CredentialError::NotBearer),
            (&["Bearer a b"], CredentialError::Malformed),
            (&["Bearer ==="], CredentialError::Malformed),
            (&["Bearer a", "Bearer b"], CredentialError::Ambiguous),
        ];
        for (values, want) in cases {
            assert_eq!(
                plausible_bearer(&with_auth(values)).err(),
                Some(want),
                "{values:?}"
            );
        }
        let long = format!("Bearer {}", "a".repeat(MAX_TOKEN_BYTES + 1));
        let mut h = HeaderMap::new();
        h.insert(
            AUTHORIZATION,
            HeaderValue::from_str(&long).unwrap_or_else(|_| HeaderValue::from_static("")),
        );
        assert_eq!(
            plausible_bearer(&h).err(),
            Some(CredentialError::TooLarge {
                len: MAX_TOKEN_BYTES + 1,
                max: MAX_TOKEN_BYTES
            })
        );
    }

    #[test]
    fn connection_cannot_remove_authorization_and_forged_identity_is_dropped() {
        let peer: SocketAddr = ([192, 0, 2, 7], 5555).into();
        let mut h = with_auth(&["Bearer t"]);
        h.insert(
            header::CONNECTION,
            HeaderValue::from_static("authorization, x-custom, host"),
        );
        h.insert("x-custom", HeaderValue::from_static("1"));
        h.insert(header::HOST, HeaderValue::from_static("relay"));
        h.insert(header::TE, HeaderValue::from_static("trailers"));
        h.insert("x-remote-user", HeaderValue::from_static("admin"));
        h.insert("x-remote-group", HeaderValue::from_static("system:masters"));
        h.insert("x-forwarded-for", HeaderValue::from_static("10.0.0.1"));
        h.insert("x-forwarded-host", HeaderValue::from_static("evil"));
        h.insert(header::FORWARDED, HeaderValue::from_static("for=1.2.3.4"));
        h.insert("impersonate-user", HeaderValue::from_static("bob"));
        h.insert(header::UPGRADE, HeaderValue::from_static("websocket"));
        sanitize(&mut h, &forwarded_for(peer));
        assert_eq!(
            h.get(AUTHORIZATION),
            Some(&HeaderValue::from_static("Bearer t"))
        );
        assert!(h.get(header::HOST).is_some());
        for gone in [
            "connection",
            "x-custom",
            "te",
            "x-remote-user",
            "x-remote-group",
            "x-forwarded-host",
            "forwarded",
            "upgrade",
        ] {
            assert!(h.get(gone).is_none(), "{gone} survived");
        }
        assert_eq!(
            h.get_all("x-forwarded-for").iter().collect::<Vec<_>>(),
            vec![&HeaderValue::from_static("192.0.2.7")]
        );
        assert!(h.get("impersonate-user").is_some());
    }

    #[test]
    fn upgrade_requests_keep_what_asks_to_switch() {
        let mut h = with_auth(&["Bearer t"]);
        h.insert(
            header::CONNECTION,
            HeaderValue::from_static("Upgrade, authorization"),
        );
        h.insert(header::UPGRADE, HeaderValue::from_static("websocket"));
        sanitize(&mut h, &forwarded_for(([127, 0, 0, 1], 1).into()));
        assert_eq!(
            h.get(header::CONNECTION),
            Some(&HeaderValue::from_static("upgrade"))
        );
        assert!(h.get(header::UPGRADE).is_some());
        assert!(h.get(AUTHORIZATION).is_some());
    }
}
