//! Authentication: static bearer tokens first, then (when configured) a TokenReview webhook, the way
//! kube-apiserver's `--token-auth-file` and `--authentication-token-webhook-config-file` work together; plus the
//! request [`Attributes`] and kube's exact Forbidden message. Authorization and impersonation are in
//! [`crate::authz`].
//!
//! The webhook is called with `authentication.k8s.io/v1` TokenReview over the webhook kubeconfig's TLS (client
//! certificate included). Answers are cached by the SHA-256 of the token (never the token) for the configured
//! TTL, 2 minutes by default like `--authentication-token-webhook-cache-ttl`; failed calls are not cached and
//! answer 401, as kube-apiserver does. Users the webhook authenticates get `system:authenticated` added.

use std::collections::{BTreeMap, HashMap};
use std::sync::RwLock;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use http::HeaderMap;
use serde_json::{Value, json};
use sha2::{Digest as _, Sha256};

use crate::status::ApiError;
use crate::webhook::WebhookClient;

/// kube-apiserver's default `--authentication-token-webhook-cache-ttl`.
pub const DEFAULT_AUTHN_CACHE_TTL: Duration = Duration::from_secs(120);
/// How long a TokenReview call may take.
const TOKEN_REVIEW_TIMEOUT: Duration = Duration::from_secs(10);
/// Most cached TokenReview answers; the cache is emptied when full.
const MAX_CACHED_REVIEWS: usize = 10_000;

/// An authenticated identity, as Kubernetes describes one (`user.Info`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct User {
    /// The user name, e.g. `admin`.
    pub name: String,
    /// A unique id for the user.
    pub uid: String,
    /// The groups, e.g. `system:masters`, `system:authenticated`.
    pub groups: Vec<String>,
    /// Extra attributes (scopes, the Entra object id and tenant id, and the like).
    pub extra: BTreeMap<String, Vec<String>>,
}

/// What a request wants to do, in Kubernetes authorization terms (`authorizer.Attributes`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Attributes {
    /// The verb: get, list, watch, create, update, patch, delete, deletecollection, impersonate; or the
    /// lower-case HTTP method for non-resource requests.
    pub verb: String,
    /// True for requests on API resources, false for paths like `/version` or `/healthz`.
    pub resource_request: bool,
    /// The API group ("" for the core group).
    pub api_group: String,
    /// The API version (`v1`).
    pub api_version: String,
    /// The resource, e.g. `configmaps`.
    pub resource: String,
    /// The subresource, e.g. `log` or `exec`.
    pub subresource: String,
    /// The namespace, "" for cluster-scoped requests.
    pub namespace: String,
    /// The object name, "" for collections.
    pub name: String,
    /// The request path.
    pub path: String,
}

/// The outcome of authorization.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Decision {
    /// The request may proceed.
    Allow,
    /// The request is refused, with a reason for the message.
    Deny(String),
}

/// The Forbidden error kube-apiserver returns for a denied request (`responsewriters.Forbidden`):
/// `RESOURCE[.GROUP] ["NAME"] is forbidden: User "U" cannot VERB resource "RESOURCE[/SUB]" in API group "G"
/// (in the namespace "NS" | at the cluster scope)[: REASON]`, or `forbidden: User "U" cannot VERB path "P"`.
pub(crate) fn forbidden(user: &User, attrs: &Attributes, reason: &str) -> ApiError {
    let mut why = if !attrs.resource_request {
        format!(
            "User \"{}\" cannot {} path \"{}\"",
            user.name, attrs.verb, attrs.path
        )
    } else {
        let resource = if attrs.subresource.is_empty() {
            attrs.resource.clone()
        } else {
            format!("{}/{}", attrs.resource, attrs.subresource)
        };
        let scope = if attrs.namespace.is_empty() {
            "at the cluster scope".to_string()
        } else {
            format!("in the namespace \"{}\"", attrs.namespace)
        };
        format!(
            "User \"{}\" cannot {} resource \"{resource}\" in API group \"{}\" {scope}",
            user.name, attrs.verb, attrs.api_group
        )
    };
    if !reason.is_empty() {
        why.push_str(": ");
        why.push_str(reason);
    }
    let qualified = match (attrs.resource_request, attrs.api_group.as_str()) {
        (false, _) => String::new(),
        (true, "") => attrs.resource.clone(),
        (true, group) => format!("{}.{group}", attrs.resource),
    };
    let message = if qualified.is_empty() {
        format!("forbidden: {why}")
    } else if attrs.name.is_empty() {
        format!("{qualified} is forbidden: {why}")
    } else {
        format!("{qualified} \"{}\" is forbidden: {why}", attrs.name)
    };
    let details = (!qualified.is_empty()).then(|| {
        let mut d = json!({"kind": attrs.resource});
        if !attrs.name.is_empty() {
            d["name"] = json!(attrs.name);
        }
        if !attrs.api_group.is_empty() {
            d["group"] = json!(attrs.api_group);
        }
        d
    });
    ApiError::forbidden_with(message, details)
}

/// Static bearer tokens and the users they stand for.
#[derive(Default)]
pub(crate) struct Tokens {
    users: RwLock<HashMap<String, User>>,
}

impl std::fmt::Debug for Tokens {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Tokens(***)")
    }
}

impl Tokens {
    pub(crate) fn add(&self, token: &str, user: User) {
        if let Ok(mut users) = self.users.write() {
            users.insert(token.to_string(), user);
        }
    }

    fn lookup(&self, token: &str) -> Option<User> {
        self.users.read().ok()?.get(token).cloned()
    }

    /// The user for the request's bearer token, or 401.
    #[cfg(test)]
    pub(crate) fn authenticate(&self, headers: &HeaderMap) -> Result<User, ApiError> {
        let token = bearer_of(headers).ok_or_else(ApiError::unauthorized)?;
        self.lookup(token).ok_or_else(ApiError::unauthorized)
    }
}

/// Cached TokenReview answers by token hash: when the answer came, and the user (None: not authenticated).
type ReviewCache = HashMap<[u8; 32], (Instant, Option<User>)>;

/// A TokenReview webhook with kube-apiserver's answer cache.
pub(crate) struct TokenWebhook {
    client: WebhookClient,
    ttl: Duration,
    cache: RwLock<ReviewCache>,
    calls: AtomicU64,
}

impl TokenWebhook {
    pub(crate) fn new(client: WebhookClient, ttl: Duration) -> TokenWebhook {
        TokenWebhook {
            client,
            ttl,
            cache: RwLock::new(HashMap::new()),
            calls: AtomicU64::new(0),
        }
    }

    /// The user the webhook says `token` is, `None` if it is not authenticated (or the call failed).
    async fn review(&self, token: &str) -> Option<User> {
        let key: [u8; 32] = Sha256::digest(token.as_bytes()).into();
        if let Ok(cache) = self.cache.read()
            && let Some((at, answer)) = cache.get(&key)
            && at.elapsed() < self.ttl
        {
            return answer.clone();
        }
        self.calls.fetch_add(1, Ordering::Relaxed);
        let review = json!({
            "apiVersion": "authentication.k8s.io/v1",
            "kind": "TokenReview",
            "metadata": {"creationTimestamp": null},
            "spec": {"token": token},
            "status": {"user": {}},
        });
        let answer = match self.client.post(&review, TOKEN_REVIEW_TIMEOUT).await {
            Ok(answer) => answer,
            Err(error) => {
                tracing::warn!(%error, "TokenReview webhook failed");
                return None;
            }
        };
        let user = token_review_user(&answer);
        if let Some(reason) = answer["status"]["error"]
            .as_str()
            .filter(|_| user.is_none())
        {
            tracing::debug!(reason, "TokenReview refused the token");
        }
        if !self.ttl.is_zero()
            && let Ok(mut cache) = self.cache.write()
        {
            if cache.len() >= MAX_CACHED_REVIEWS {
                cache.clear();
            }
            cache.insert(key, (Instant::now(), user.clone()));
        }
        user
    }
}

/// The user of an authenticated TokenReview answer, with `system:authenticated` added.
fn token_review_user(answer: &Value) -> Option<User> {
    let status = &answer["status"];
    if status["authenticated"].as_bool() != Some(true) {
        return None;
    }
    let u = &status["user"];
    let name = u["username"].as_str().filter(|n| !n.is_empty())?;
    let strings = |v: &Value| -> Vec<String> {
        v.as_array()
            .map(|a| {
                a.iter()
                    .filter_map(|s| s.as_str().map(str::to_string))
                    .collect()
            })
            .unwrap_or_default()
    };
    let mut groups = strings(&u["groups"]);
    if !groups.iter().any(|g| g == "system:authenticated") {
        groups.push("system:authenticated".into());
    }
    let extra = u["extra"]
        .as_object()
        .map(|m| m.iter().map(|(k, v)| (k.clone(), strings(v))).collect())
        .unwrap_or_default();
    Some(User {
        name: name.to_string(),
        uid: u["uid"].as_str().unwrap_or_default().to_string(),
        groups,
        extra,
    })
}

/// Authentication: static tokens, then the TokenReview webhook if there is one.
pub(crate) struct Authenticator {
    pub(crate) tokens: Tokens,
    pub(crate) webhook: Option<TokenWebhook>,
}

impl Authenticator {
    /// The user for the request's bearer token, or 401.
    pub(crate) async fn authenticate(&self, headers: &HeaderMap) -> Result<User, ApiError> {
        let token = bearer_of(headers).ok_or_else(ApiError::unauthorized)?;
        if let Some(user) = self.tokens.lookup(token) {
            return Ok(user);
        }
        match &self.webhook {
            Some(webhook) => webhook
                .review(token)
                .await
                .ok_or_else(ApiError::unauthorized),
            None => Err(ApiError::unauthorized()),
        }
    }

    /// How many TokenReview calls were made (cache misses).
    pub(crate) fn webhook_calls(&self) -> u64 {
        self.webhook
            .as_ref()
            .map_or(0, |w| w.calls.load(Ordering::Relaxed))
    }
}

fn bearer_of(headers: &HeaderMap) -> Option<&str> {
    headers
        .get(http::header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(bearer)
}

/// The token of an `Authorization: Bearer TOKEN` header value (scheme case-insensitive, as kube accepts).
fn bearer(value: &str) -> Option<&str> {
    let (scheme, token) = value.trim().split_once(' ')?;
    let token = token.trim();
    (scheme.eq_ignore_ascii_case("bearer") && !token.is_empty()).then_some(token)
}

/// A user with `system:authenticated` appended to its groups, as kube-apiserver does for every token user.
pub(crate) fn user(name: &str, groups: &[&str]) -> User {
    let mut groups: Vec<String> = groups.iter().map(|g| g.to_string()).collect();
    if !groups.iter().any(|g| g == "system:authenticated") {
        groups.push("system:authenticated".into());
    }
    User {
        name: name.into(),
        uid: crate::util::uid(),
        groups,
        extra: BTreeMap::new(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn headers(value: &str) -> HeaderMap {
        let mut headers = HeaderMap::new();
        if let Ok(v) = value.parse() {
            headers.insert(http::header::AUTHORIZATION, v);
        }
        headers
    }

    #[test]
    fn authenticates_known_tokens_only() {
        let tokens = Tokens::default();
        tokens.add("s3cret", user("admin", &["system:masters"]));
        let admin = tokens.authenticate(&headers("Bearer s3cret"));
        assert_eq!(
            admin.map(|u| u.groups),
            Ok(vec![
                "system:masters".to_string(),
                "system:authenticated".into()
            ])
        );
        assert!(tokens.authenticate(&headers("bearer s3cret")).is_ok());
        assert_eq!(
            tokens
                .authenticate(&headers("Bearer nope"))
                .map_err(|e| e.code),
            Err(401)
        );
        assert_eq!(
            tokens
                .authenticate(&headers("Basic s3cret"))
                .map_err(|e| e.code),
            Err(401)
        );
        assert_eq!(
            tokens.authenticate(&HeaderMap::new()).map_err(|e| e.code),
            Err(401)
        );
        assert!(!format!("{tokens:?}").contains("s3cret"));
    }

    #[test]
    fn forbidden_message_reads_like_kube() {
        let mut attrs = Attributes {
            verb: "get".into(),
            resource_request: true,
            api_group: String::new(),
            api_version: "v1".into(),
            resource: "configmaps".into(),
            subresource: String::new(),
            namespace: "default".into(),
            name: "x".into(),
            path: "/api/v1/namespaces/default/configmaps/x".into(),
        };
        let err = forbidden(&user("bob", &[]), &attrs, "");
        assert_eq!(
            err.message,
            "configmaps \"x\" is forbidden: User \"bob\" cannot get resource \"configmaps\" in API group \"\" in the \
             namespace \"default\""
        );
        attrs.verb = "list".into();
        attrs.name = String::new();
        let err = forbidden(&user("alice@contoso.com", &[]), &attrs, "no role grants it");
        assert_eq!(
            err.message,
            "configmaps is forbidden: User \"alice@contoso.com\" cannot list resource \"configmaps\" in API group \"\" \
             in the namespace \"default\": no role grants it"
        );
        let impersonate = Attributes {
            verb: "impersonate".into(),
            api_group: "authentication.k8s.io".into(),
            resource: "userextras".into(),
            subresource: "oid".into(),
            namespace: String::new(),
            name: "1234".into(),
            ..attrs.clone()
        };
        let err = forbidden(&user("bob", &[]), &impersonate, "");
        assert_eq!(
            err.message,
            "userextras.authentication.k8s.io \"1234\" is forbidden: User \"bob\" cannot impersonate resource \
             \"userextras/oid\" in API group \"authentication.k8s.io\" at the cluster scope"
        );
        assert_eq!(err.to_status()["details"]["group"], "authentication.k8s.io");
        let path = Attributes {
            verb: "get".into(),
            resource_request: false,
            path: "/version".into(),
            ..attrs
        };
        assert_eq!(
            forbidden(&user("bob", &[]), &path, "").message,
            "forbidden: User \"bob\" cannot get path \"/version\""
        );
    }

    #[test]
    fn token_review_answers_become_users() {
        let answer = json!({"status": {"authenticated": true, "user": {
            "username": "alice@contoso.com", "uid": "o1", "groups": ["g1"], "extra": {"oid": ["o1"]}}}});
        let user = token_review_user(&answer);
        assert_eq!(
            user.as_ref().map(|u| u.groups.clone()),
            Some(vec!["g1".to_string(), "system:authenticated".into()])
        );
        assert_eq!(
            user.map(|u| u.extra),
            Some(BTreeMap::from([(
                "oid".to_string(),
                vec!["o1".to_string()]
            )]))
        );
        assert_eq!(
            token_review_user(&json!({"status": {"authenticated": false, "error": "expired"}})),
            None
        );
        assert_eq!(
            token_review_user(&json!({"status": {"authenticated": true, "user": {}}})),
            None
        );
    }
}
