//! Tokens: generation, bearer extraction, and the cluster-name rule.

use base64::Engine;
use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use http::HeaderMap;
use http::header::AUTHORIZATION;
use tether_runtime::Secret;

/// 32 random bytes from the thread's CSPRNG, base64url without padding (43 characters).
pub(crate) fn generate_token() -> Secret {
    let mut bytes = [0u8; 32];
    rand::fill(&mut bytes);
    Secret::new(URL_SAFE_NO_PAD.encode(bytes))
}

/// The token of an `Authorization: Bearer TOKEN` header. `None` when the header is missing, not valid
/// text, not a bearer token, or empty.
pub(crate) fn bearer(headers: &HeaderMap) -> Option<Secret> {
    let value = headers.get(AUTHORIZATION)?.to_str().ok()?.trim();
    let (scheme, token) = value.split_once(' ')?;
    let token = token.trim();
    (scheme.eq_ignore_ascii_case("bearer") && !token.is_empty()).then(|| Secret::new(token))
}

/// A DNS-1123 label: 1–63 lowercase letters, digits and `-`, starting and ending with a letter or digit.
pub(crate) fn valid_cluster_name(name: &str) -> bool {
    let b = name.as_bytes();
    !b.is_empty()
        && b.len() <= 63
        && b.iter()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || *c == b'-')
        && b.first().is_some_and(u8::is_ascii_alphanumeric)
        && b.last().is_some_and(u8::is_ascii_alphanumeric)
}

#[cfg(test)]
mod tests {
    use http::HeaderValue;

    use super::*;

    #[test]
    fn tokens_are_random_base64url() {
        let a = generate_token();
        let b = generate_token();
        assert_eq!(a.expose().len(), 43);
        assert_ne!(a.expose(), b.expose());
        assert!(
            a.expose()
                .bytes()
                .all(|c| c.is_ascii_alphanumeric() || c == b'-' || c == b'_')
        );
        assert_eq!(
            URL_SAFE_NO_PAD.decode(a.expose()).map(|v| v.len()).ok(),
            Some(32)
        );
    }

    #[test]
    fn bearer_parsing() {
        let mut h = HeaderMap::new();
        assert!(bearer(&h).is_none());
        h.insert(AUTHORIZATION, HeaderValue::from_static("Bearer abc"));
        assert_eq!(
            bearer(&h).map(|s| s.expose().to_owned()).as_deref(),
            Some("abc")
        );
        h.insert(AUTHORIZATION, HeaderValue::from_static("bearer   xyz "));
        assert_eq!(
            bearer(&h).map(|s| s.expose().to_owned()).as_deref(),
            Some("xyz")
        );
        h.insert(AUTHORIZATION, HeaderValue::from_static("Bearer "));
        assert!(bearer(&h).is_none());
        h.insert(
            AUTHORIZATION,
            HeaderValue::from_static("Basic dXNlcjpwdw=="),
        );
        assert!(bearer(&h).is_none());
    }

    #[test]
    fn cluster_names() {
        for ok in ["a", "prod", "prod-eu-1", "0abc", &"a".repeat(63)] {
            assert!(valid_cluster_name(ok), "{ok}");
        }
        for bad in [
            "",
            "-a",
            "a-",
            "Prod",
            "a.b",
            "a_b",
            "a b",
            &"a".repeat(64),
            "ü",
        ] {
            assert!(!valid_cluster_name(bad), "{bad}");
        }
    }
}
