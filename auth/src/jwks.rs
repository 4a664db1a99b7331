//! Signing keys: OpenID discovery → `jwks_uri` → JWKS, cached per issuer.
//!
//! Keys are used for `keys_ttl`, then fetched again. A token with an unknown `kid` triggers a refetch (a key
//! rotation), but at most one fetch per issuer per `min_refetch_interval`, so a stream of tokens with made-up key
//! ids cannot turn guard into a load generator against the issuer. A failed fetch keeps the keys already held
//! (last-known-good), so guard keeps working while the issuer is unreachable. Fetching goes through the [`Fetch`]
//! trait; [`HttpsFetcher`] is the real one.

use std::collections::HashMap;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Empty, Limited};
use hyper_rustls::HttpsConnector;
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use jsonwebtoken::jwk::Jwk;
use serde::Deserialize;
use tokio::time::Instant;

/// Entra token format versions.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TokenVersion {
    /// `https://sts.windows.net/{tid}/`.
    V1,
    /// `https://login.microsoftonline.com/{tid}/v2.0`.
    V2,
}

/// One trusted issuer.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Issuer {
    /// The exact `iss` value.
    pub url: String,
    /// The tenant the issuer belongs to; the token's `tid` must equal it.
    pub tenant: String,
    /// Token format version.
    pub version: TokenVersion,
    /// Where its OpenID configuration is fetched from.
    pub discovery_url: String,
}

/// Why no key could be had for a token. The token checks turn it into their own error.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum KeyError {
    /// The issuer publishes no signing key with this id (at most 64 characters of it).
    #[error("the issuer publishes no signing key with id {0:?}")]
    Unknown(String),
    /// The keys could not be fetched and none are cached.
    #[error("the issuer's signing keys are unavailable ({0})")]
    Unavailable(String),
}

/// The largest discovery document or JWKS accepted.
pub const MAX_DOCUMENT_BYTES: usize = 1024 * 1024;
/// How long one fetch may take.
pub const FETCH_TIMEOUT: Duration = Duration::from_secs(10);

/// Why a document could not be fetched.
#[derive(Debug, Clone, thiserror::Error)]
#[error("{0}")]
pub struct FetchError(pub String);

/// A future returned by [`Fetch::get`].
pub type FetchFuture<'a> = Pin<Box<dyn Future<Output = Result<Bytes, FetchError>> + Send + 'a>>;

/// Fetches a document over HTTPS.
pub trait Fetch: Send + Sync {
    /// The body of a `200 OK` answer to `GET url`.
    fn get<'a>(&'a self, url: &'a str) -> FetchFuture<'a>;
}

/// The real [`Fetch`]: HTTPS only (HTTP/1.1), a timeout and a size limit.
#[derive(Clone)]
pub struct HttpsFetcher {
    client: Client<HttpsConnector<HttpConnector>, Empty<Bytes>>,
}

impl std::fmt::Debug for HttpsFetcher {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HttpsFetcher").finish_non_exhaustive()
    }
}

impl HttpsFetcher {
    /// A fetcher trusting the CA certificates in `ca_pem` (PEM), or the public web roots when `None`.
    pub fn new(ca_pem: Option<&[u8]>) -> Result<Self, tether_runtime::tls::TlsError> {
        // hyper-rustls sets ALPN itself (and panics when it is preset).
        let tls = tether_runtime::tls::client_config(ca_pem, &[])?;
        let connector = hyper_rustls::HttpsConnectorBuilder::new()
            .with_tls_config(Arc::unwrap_or_clone(tls))
            .https_only()
            .enable_http1()
            .build();
        let client = Client::builder(TokioExecutor::new())
            .pool_idle_timeout(Duration::from_secs(30))
            .build(connector);
        Ok(Self { client })
    }
}

impl Fetch for HttpsFetcher {
    fn get<'a>(&'a self, url: &'a str) -> FetchFuture<'a> {
        Box::pin(async move {
            let uri: http::Uri = url
                .parse()
                .map_err(|_| FetchError(format!("invalid URL {url:?}")))?;
            if uri.scheme_str() != Some("https") {
                return Err(FetchError(format!("{url} is not an https:// URL")));
            }
            let request = http::Request::get(uri)
                .header(http::header::ACCEPT, "application/json")
                .body(Empty::new())
                .map_err(|e| FetchError(e.to_string()))?;
            let work = async {
                let response = self
                    .client
                    .request(request)
                    .await
                    .map_err(|e| FetchError(format!("GET {url}: {}", error_chain(&e))))?;
                if response.status() != http::StatusCode::OK {
                    return Err(FetchError(format!("GET {url}: HTTP {}", response.status())));
                }
                let body = Limited::new(response.into_body(), MAX_DOCUMENT_BYTES)
                    .collect()
                    .await
                    .map_err(|e| FetchError(format!("GET {url}: {e}")))?;
                Ok(body.to_bytes())
            };
            tokio::time::timeout(FETCH_TIMEOUT, work)
                .await
                .map_err(|_| FetchError(format!("GET {url}: timed out")))?
        })
    }
}

fn error_chain(e: &(dyn std::error::Error + 'static)) -> String {
    let mut out = e.to_string();
    let mut source = e.source();
    while let Some(s) = source {
        out.push_str(": ");
        out.push_str(&s.to_string());
        source = s.source();
    }
    out
}

#[derive(Deserialize)]
struct Discovery {
    issuer: String,
    jwks_uri: String,
}

#[derive(Deserialize)]
struct RawJwks {
    keys: Vec<serde_json::Value>,
}

#[derive(Default)]
struct IssuerState {
    keys: HashMap<String, Jwk>,
    fetched_at: Option<Instant>,
    last_attempt: Option<Instant>,
    last_error: Option<String>,
}

/// Counters of the key cache.
#[derive(Debug, Default)]
pub struct KeyStats {
    /// Fetch attempts (discovery + JWKS counts once).
    pub fetches: AtomicU64,
    /// Failed fetch attempts.
    pub fetch_failures: AtomicU64,
}

/// Signing keys per issuer; see the module docs for the refresh rules.
pub struct KeyCache {
    fetch: Arc<dyn Fetch>,
    ttl: Duration,
    min_refetch: Duration,
    issuers: Mutex<HashMap<String, Arc<tokio::sync::Mutex<IssuerState>>>>,
    stats: KeyStats,
}

impl KeyCache {
    /// An empty cache.
    pub fn new(fetch: Arc<dyn Fetch>, ttl: Duration, min_refetch: Duration) -> Self {
        Self {
            fetch,
            ttl,
            min_refetch,
            issuers: Mutex::new(HashMap::new()),
            stats: KeyStats::default(),
        }
    }

    /// Counters.
    pub fn stats(&self) -> &KeyStats {
        &self.stats
    }

    fn state(&self, issuer: &Issuer) -> Arc<tokio::sync::Mutex<IssuerState>> {
        let mut map = self.issuers.lock().unwrap_or_else(|p| p.into_inner());
        map.entry(issuer.url.clone()).or_default().clone()
    }

    /// The key `kid` of `issuer`, fetching the issuer's keys when they are missing, stale or lack `kid` (within the
    /// refetch limit).
    pub async fn key(&self, issuer: &Issuer, kid: &str) -> Result<Jwk, KeyError> {
        let state = self.state(issuer);
        // Held across the fetch on purpose: concurrent requests for one issuer wait for one fetch.
        let mut st = state.lock().await;
        let now = Instant::now();
        let stale = st
            .fetched_at
            .is_none_or(|t| now.duration_since(t) >= self.ttl);
        let known = st.keys.contains_key(kid);
        let may_fetch = st
            .last_attempt
            .is_none_or(|t| now.duration_since(t) >= self.min_refetch);
        if (stale || !known) && may_fetch {
            st.last_attempt = Some(now);
            self.stats.fetches.fetch_add(1, Ordering::Relaxed);
            match self.fetch_keys(issuer).await {
                Ok(keys) => {
                    st.keys = keys;
                    st.fetched_at = Some(now);
                    st.last_error = None;
                }
                Err(e) => {
                    self.stats.fetch_failures.fetch_add(1, Ordering::Relaxed);
                    tracing::warn!(issuer = %issuer.url, error = %e.0, kept = st.keys.len(),
                        "fetching signing keys failed; keeping the last known keys");
                    st.last_error = Some(e.0);
                }
            }
        }
        if let Some(key) = st.keys.get(kid) {
            return Ok(key.clone());
        }
        match (&st.last_error, st.keys.is_empty()) {
            (Some(e), true) => Err(KeyError::Unavailable(e.clone())),
            _ => Err(KeyError::Unknown(kid.chars().take(64).collect())),
        }
    }

    async fn fetch_keys(&self, issuer: &Issuer) -> Result<HashMap<String, Jwk>, FetchError> {
        let body = self.fetch.get(&issuer.discovery_url).await?;
        let discovery: Discovery = serde_json::from_slice(&body).map_err(|e| {
            FetchError(format!(
                "{}: not an OpenID configuration: {e}",
                issuer.discovery_url
            ))
        })?;
        if discovery.issuer != issuer.url {
            return Err(FetchError(format!(
                "{} names issuer {:?}, expected {:?}",
                issuer.discovery_url, discovery.issuer, issuer.url
            )));
        }
        if !discovery.jwks_uri.starts_with("https://") {
            return Err(FetchError(format!(
                "jwks_uri {:?} is not an https:// URL",
                discovery.jwks_uri
            )));
        }
        let body = self.fetch.get(&discovery.jwks_uri).await?;
        let raw: RawJwks = serde_json::from_slice(&body)
            .map_err(|e| FetchError(format!("{}: not a JWKS: {e}", discovery.jwks_uri)))?;
        let mut keys = HashMap::new();
        for value in raw.keys {
            // Keys of types jsonwebtoken cannot parse are skipped, not fatal for the set.
            let Ok(jwk) = serde_json::from_value::<Jwk>(value) else {
                continue;
            };
            if let Some(kid) = jwk.common.key_id.clone() {
                keys.insert(kid, jwk);
            }
        }
        if keys.is_empty() {
            return Err(FetchError(format!(
                "{} holds no usable key",
                discovery.jwks_uri
            )));
        }
        Ok(keys)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicBool;

    struct FakeIdp {
        reachable: AtomicBool,
        kids: Mutex<Vec<String>>,
        calls: AtomicU64,
    }

    impl Fetch for FakeIdp {
        fn get<'a>(&'a self, url: &'a str) -> FetchFuture<'a> {
            self.calls.fetch_add(1, Ordering::SeqCst);
            let reachable = self.reachable.load(Ordering::SeqCst);
            let kids = self.kids.lock().map(|k| k.clone()).unwrap_or_default();
            let url = url.to_owned();
            Box::pin(async move {
                if !reachable {
                    return Err(FetchError("connection refused".to_owned()));
                }
                let body = if url.ends_with("openid-configuration") {
                    serde_json::json!({"issuer": "https://idp/t/v2.0", "jwks_uri": "https://idp/keys"})
                } else {
                    let keys: Vec<_> = kids
                        .iter()
                        .map(|k| serde_json::json!({"kty": "RSA", "use": "sig", "kid": k, "n": "AQAB", "e": "AQAB"}))
                        .collect();
                    serde_json::json!({ "keys": keys })
                };
                Ok(Bytes::from(serde_json::to_vec(&body).unwrap_or_default()))
            })
        }
    }

    fn issuer() -> Issuer {
        Issuer {
            url: "https://idp/t/v2.0".to_owned(),
            tenant: "t".to_owned(),
            version: TokenVersion::V2,
            discovery_url: "https://idp/t/v2.0/.well-known/openid-configuration".to_owned(),
        }
    }

    fn idp(kids: &[&str]) -> Arc<FakeIdp> {
        Arc::new(FakeIdp {
            reachable: AtomicBool::new(true),
            kids: Mutex::new(kids.iter().map(|k| (*k).to_owned()).collect()),
            calls: AtomicU64::new(0),
        })
    }

    fn fetches(cache: &KeyCache) -> u64 {
        cache.stats().fetches.load(Ordering::SeqCst)
    }

    #[tokio::test(start_paused = true)]
    async fn unknown_kid_refetch_is_rate_limited() {
        let idp = idp(&["k1"]);
        let cache = KeyCache::new(
            idp.clone(),
            Duration::from_secs(3600),
            Duration::from_secs(30),
        );
        assert!(cache.key(&issuer(), "k1").await.is_ok());
        assert_eq!(fetches(&cache), 1);
        assert!(cache.key(&issuer(), "k1").await.is_ok());
        assert_eq!(fetches(&cache), 1, "fresh keys are not fetched again");
        // An unknown kid right after a fetch: no new fetch (rate limit), refused.
        assert!(matches!(
            cache.key(&issuer(), "k2").await,
            Err(KeyError::Unknown(_))
        ));
        assert_eq!(fetches(&cache), 1);
        // The issuer rotates; after the interval the unknown kid triggers one refetch that finds it.
        if let Ok(mut kids) = idp.kids.lock() {
            kids.push("k2".to_owned());
        }
        tokio::time::advance(Duration::from_secs(31)).await;
        assert!(cache.key(&issuer(), "k2").await.is_ok());
        assert_eq!(fetches(&cache), 2);
        for _ in 0..10 {
            assert!(cache.key(&issuer(), "made-up").await.is_err());
        }
        assert_eq!(
            fetches(&cache),
            2,
            "a flood of unknown kids causes no fetch storm"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn keys_are_kept_while_the_issuer_is_unreachable() {
        let idp = idp(&["k1"]);
        let cache = KeyCache::new(
            idp.clone(),
            Duration::from_secs(60),
            Duration::from_secs(30),
        );
        assert!(cache.key(&issuer(), "k1").await.is_ok());
        idp.reachable.store(false, Ordering::SeqCst);
        tokio::time::advance(Duration::from_secs(120)).await;
        assert!(
            cache.key(&issuer(), "k1").await.is_ok(),
            "stale keys are kept"
        );
        assert_eq!(cache.stats().fetch_failures.load(Ordering::SeqCst), 1);
        idp.reachable.store(true, Ordering::SeqCst);
        tokio::time::advance(Duration::from_secs(31)).await;
        assert!(cache.key(&issuer(), "k1").await.is_ok());
        assert_eq!(fetches(&cache), 3, "refreshed once the issuer is back");
    }

    #[tokio::test(start_paused = true)]
    async fn unreachable_issuer_without_keys_is_reported() {
        let idp = idp(&["k1"]);
        idp.reachable.store(false, Ordering::SeqCst);
        let cache = KeyCache::new(
            idp.clone(),
            Duration::from_secs(60),
            Duration::from_secs(30),
        );
        assert!(matches!(
            cache.key(&issuer(), "k1").await,
            Err(KeyError::Unavailable(_))
        ));
    }

    #[tokio::test]
    async fn discovery_issuer_must_match() {
        let idp = idp(&["k1"]);
        let cache = KeyCache::new(idp, Duration::from_secs(60), Duration::from_secs(30));
        let mut other = issuer();
        other.url = "https://idp/other/v2.0".to_owned();
        let err = cache
            .key(&other, "k1")
            .await
            .err()
            .map(|e| e.to_string())
            .unwrap_or_default();
        assert!(err.contains("names issuer"), "{err}");
    }
}
