//! Authorization and impersonation, the way kube-apiserver does them.
//!
//! Without an authorization configuration every authenticated request is allowed (`--authorization-mode=
//! AlwaysAllow`, kube-apiserver's default). With one (the structured `AuthorizationConfiguration` YAML of
//! `--authorization-config`, as shipped in `deploy/guard/`), members of `system:masters` are allowed first (kube's
//! privileged-group authorizer), then the configured authorizers are asked in order:
//!
//! - `Webhook`: a SubjectAccessReview (`authorization.k8s.io/v1`, or `v1beta1` where the groups field is `group`)
//!   POSTed through the webhook kubeconfig (client certificate included), within `timeout`; answers cached by the
//!   review's spec for `authorizedTTL` / `unauthorizedTTL`; `failurePolicy` (`NoOpinion` or `Deny`) when the call
//!   fails; `matchConditions` decide whether the webhook is asked at all. The CEL expressions are simplified to the
//!   forms the shipped config uses: `request.user.startsWith('…')`, `has(request.extra)`, `'K' in request.extra`,
//!   `'G' in request.groups`, `request.user == '…'`, each optionally negated with `!`, joined by `&&`. Anything
//!   else is a configuration error, never silently true.
//! - `RBAC`: a tiny built-in RBAC: kube's discovery and self-review bootstrap rules for `system:authenticated`, and
//!   the [`RbacRule`]s added with [`crate::SampleApiserver::allow`] (the sample's agent identity gets `*`).
//!   Everyone else gets no opinion.
//! - `Node` is skipped (there are no kubelets); `AlwaysAllow` and `AlwaysDeny` do what they say.
//!
//! The first Allow or Deny ends the chain; when nobody decides, the request is forbidden with every reason given,
//! joined by newlines (kube's union authorizer).
//!
//! Impersonation (`Impersonate-User`, `Impersonate-Group`, `Impersonate-Uid`, `Impersonate-Extra-KEY`): the real
//! user must be allowed verb `impersonate` on `users` (or the service account), each of `groups`,
//! `authentication.k8s.io` `uids` and `userextras/KEY`, through the same chain; then the request acts as the
//! impersonated user (with `system:authenticated` added).

use std::collections::{BTreeMap, HashMap};
use std::path::Path;
use std::sync::RwLock;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use http::HeaderMap;
use serde_json::{Map, Value, json};

use crate::auth::{Attributes, User, forbidden};
use crate::status::ApiError;
use crate::webhook::{WebhookClient, WebhookError};

/// Most cached SubjectAccessReview answers per webhook; the cache is emptied when full.
const MAX_CACHED_DECISIONS: usize = 10_000;
/// kube-apiserver's defaults for a webhook authorizer's cache.
const DEFAULT_AUTHORIZED_TTL: Duration = Duration::from_secs(300);
const DEFAULT_UNAUTHORIZED_TTL: Duration = Duration::from_secs(30);
const DEFAULT_WEBHOOK_TIMEOUT: Duration = Duration::from_secs(30);

/// What one authorizer says.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Verdict {
    Allow,
    Deny,
    NoOpinion,
}

/// Who a built-in RBAC rule applies to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Subject {
    /// A user name (`system:serviceaccount:NS:NAME` for a service account).
    User(String),
    /// A group.
    Group(String),
}

/// One rule of the sample apiserver's tiny built-in RBAC (a role and its binding in one): `subject` may use
/// `verbs` on `resources` (plural names, `RESOURCE/SUBRESOURCE`, or `*`) in `namespace` (all namespaces and
/// cluster-scoped objects when `None`), and on the non-resource paths `non_resource_urls` (`/version`, or a
/// prefix ending in `*`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RbacRule {
    /// Who.
    pub subject: Subject,
    /// get, list, watch, create, update, patch, delete, deletecollection, impersonate, or `*`.
    pub verbs: Vec<String>,
    /// Resources, `RESOURCE/SUBRESOURCE`, or `*`.
    pub resources: Vec<String>,
    /// The namespace, or `None` for everywhere.
    pub namespace: Option<String>,
    /// Non-resource paths (`*` suffix for a prefix).
    pub non_resource_urls: Vec<String>,
}

impl RbacRule {
    /// `subject` may do `verbs` on `resources` in `namespace` (everywhere when `None`).
    pub fn new(
        subject: Subject,
        verbs: &[&str],
        resources: &[&str],
        namespace: Option<&str>,
    ) -> RbacRule {
        RbacRule {
            subject,
            verbs: verbs.iter().map(|s| s.to_string()).collect(),
            resources: resources.iter().map(|s| s.to_string()).collect(),
            namespace: namespace.map(str::to_string),
            non_resource_urls: Vec::new(),
        }
    }

    /// Everything, everywhere (cluster-admin).
    pub fn everything(subject: Subject) -> RbacRule {
        RbacRule {
            non_resource_urls: vec!["*".into()],
            ..RbacRule::new(subject, &["*"], &["*"], None)
        }
    }

    fn applies_to(&self, user: &User) -> bool {
        match &self.subject {
            Subject::User(name) => *name == user.name,
            Subject::Group(group) => user.groups.iter().any(|g| g == group),
        }
    }

    fn allows(&self, attrs: &Attributes) -> bool {
        let verb = self.verbs.iter().any(|v| v == "*" || *v == attrs.verb);
        if !verb {
            return false;
        }
        if !attrs.resource_request {
            return self
                .non_resource_urls
                .iter()
                .any(|u| match u.strip_suffix('*') {
                    Some(prefix) => attrs.path.starts_with(prefix),
                    None => *u == attrs.path,
                });
        }
        let namespace = self
            .namespace
            .as_ref()
            .is_none_or(|ns| *ns == attrs.namespace);
        let full = if attrs.subresource.is_empty() {
            attrs.resource.clone()
        } else {
            format!("{}/{}", attrs.resource, attrs.subresource)
        };
        namespace && self.resources.iter().any(|r| r == "*" || *r == full)
    }
}

/// Kube's bootstrap policy for every authenticated user: discovery, version, health, OpenAPI, and self reviews.
fn bootstrap_rules() -> Vec<RbacRule> {
    let authenticated = || Subject::Group("system:authenticated".into());
    let discovery = RbacRule {
        non_resource_urls: [
            "/api",
            "/api/*",
            "/apis",
            "/apis/*",
            "/version",
            "/version/",
            "/healthz",
            "/livez",
            "/readyz",
            "/openapi",
            "/openapi/*",
            "/.well-known/openid-configuration",
            "/openid/v1/jwks",
        ]
        .iter()
        .map(|s| s.to_string())
        .collect(),
        ..RbacRule::new(authenticated(), &["get", "head"], &[], None)
    };
    let self_reviews = RbacRule::new(
        authenticated(),
        &["create"],
        &[
            "selfsubjectreviews",
            "selfsubjectaccessreviews",
            "selfsubjectrulesreviews",
        ],
        None,
    );
    vec![discovery, self_reviews]
}

/// The built-in RBAC's rules.
pub(crate) struct Rbac {
    rules: RwLock<Vec<RbacRule>>,
}

impl Rbac {
    fn new() -> Rbac {
        Rbac {
            rules: RwLock::new(bootstrap_rules()),
        }
    }

    pub(crate) fn add(&self, rule: RbacRule) {
        if let Ok(mut rules) = self.rules.write() {
            rules.push(rule);
        }
    }

    fn decide(&self, user: &User, attrs: &Attributes) -> Verdict {
        let allowed = self
            .rules
            .read()
            .map(|rules| rules.iter().any(|r| r.applies_to(user) && r.allows(attrs)))
            .unwrap_or(false);
        if allowed {
            Verdict::Allow
        } else {
            Verdict::NoOpinion
        }
    }
}

/// The SubjectAccessReview version a webhook is called with.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum SarVersion {
    V1,
    V1beta1,
}

/// One simplified CEL match condition.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Condition {
    UserStartsWith(String),
    UserIs(String),
    HasExtra,
    ExtraKey(String),
    InGroups(String),
    Not(Box<Condition>),
}

impl Condition {
    fn parse_all(expression: &str) -> Result<Vec<Condition>, String> {
        expression.split("&&").map(Condition::parse).collect()
    }

    fn parse(term: &str) -> Result<Condition, String> {
        let term = term.trim();
        if let Some(rest) = term.strip_prefix('!') {
            let rest = rest.trim();
            let inner = rest
                .strip_prefix('(')
                .and_then(|r| r.strip_suffix(')'))
                .unwrap_or(rest);
            return Ok(Condition::Not(Box::new(Condition::parse(inner)?)));
        }
        let quoted = |s: &str| -> Option<String> {
            let s = s.trim();
            let q = s.chars().next().filter(|c| *c == '\'' || *c == '"')?;
            let inner = s.strip_prefix(q)?.strip_suffix(q)?;
            (!inner.contains(q)).then(|| inner.to_string())
        };
        if term == "has(request.extra)" {
            return Ok(Condition::HasExtra);
        }
        if let Some(arg) = term
            .strip_prefix("request.user.startsWith(")
            .and_then(|r| r.strip_suffix(')'))
            .and_then(quoted)
        {
            return Ok(Condition::UserStartsWith(arg));
        }
        if let Some(value) = term
            .strip_prefix("request.user")
            .and_then(|r| r.trim_start().strip_prefix("==").and_then(quoted))
        {
            return Ok(Condition::UserIs(value));
        }
        if let Some((left, right)) = term.split_once(" in ")
            && let Some(key) = quoted(left)
        {
            match right.trim() {
                "request.extra" => return Ok(Condition::ExtraKey(key)),
                "request.groups" => return Ok(Condition::InGroups(key)),
                _ => {}
            }
        }
        Err(format!(
            "unsupported match condition {term:?} (the sample apiserver understands request.user.startsWith('…'), \
             request.user == '…', has(request.extra), 'K' in request.extra, 'G' in request.groups, ! and &&)"
        ))
    }

    fn eval(&self, user: &User) -> bool {
        match self {
            Condition::UserStartsWith(p) => user.name.starts_with(p.as_str()),
            Condition::UserIs(u) => user.name == *u,
            Condition::HasExtra => !user.extra.is_empty(),
            Condition::ExtraKey(k) => user.extra.contains_key(k),
            Condition::InGroups(g) => user.groups.iter().any(|x| x == g),
            Condition::Not(c) => !c.eval(user),
        }
    }
}

/// A SubjectAccessReview webhook with kube's decision cache.
struct WebhookAuthorizer {
    name: String,
    client: WebhookClient,
    timeout: Duration,
    version: SarVersion,
    authorized_ttl: Duration,
    unauthorized_ttl: Duration,
    fail_closed: bool,
    conditions: Vec<Condition>,
    cache: RwLock<HashMap<String, (Instant, Verdict, String)>>,
    calls: AtomicU64,
}

impl WebhookAuthorizer {
    async fn decide(&self, user: &User, attrs: &Attributes) -> (Verdict, String) {
        if !self.conditions.iter().all(|c| c.eval(user)) {
            return (Verdict::NoOpinion, String::new());
        }
        let review = subject_access_review(self.version, user, attrs);
        let key = review["spec"].to_string();
        if let Ok(cache) = self.cache.read()
            && let Some((at, verdict, reason)) = cache.get(&key)
        {
            let ttl = if *verdict == Verdict::Allow {
                self.authorized_ttl
            } else {
                self.unauthorized_ttl
            };
            if at.elapsed() < ttl {
                return (*verdict, reason.clone());
            }
        }
        self.calls.fetch_add(1, Ordering::Relaxed);
        let answer = match self.client.post(&review, self.timeout).await {
            Ok(answer) => answer,
            Err(error) => {
                tracing::warn!(authorizer = %self.name, %error, "SubjectAccessReview webhook failed");
                let verdict = if self.fail_closed {
                    Verdict::Deny
                } else {
                    Verdict::NoOpinion
                };
                return (verdict, String::new());
            }
        };
        let status = &answer["status"];
        let allowed = status["allowed"].as_bool() == Some(true);
        let denied = status["denied"].as_bool() == Some(true);
        let reason = status["reason"].as_str().unwrap_or_default().to_string();
        if let Some(error) = status["evaluationError"].as_str().filter(|e| !e.is_empty()) {
            tracing::debug!(authorizer = %self.name, error, "webhook evaluation error");
        }
        let verdict = match (allowed, denied) {
            (_, true) => Verdict::Deny,
            (true, false) => Verdict::Allow,
            (false, false) => Verdict::NoOpinion,
        };
        let ttl = if verdict == Verdict::Allow {
            self.authorized_ttl
        } else {
            self.unauthorized_ttl
        };
        if !ttl.is_zero()
            && let Ok(mut cache) = self.cache.write()
        {
            if cache.len() >= MAX_CACHED_DECISIONS {
                cache.clear();
            }
            cache.insert(key, (Instant::now(), verdict, reason.clone()));
        }
        (verdict, reason)
    }
}

/// The SubjectAccessReview kube-apiserver sends for `user` doing `attrs` (empty fields omitted).
fn subject_access_review(version: SarVersion, user: &User, attrs: &Attributes) -> Value {
    let mut spec = Map::new();
    let put = |m: &mut Map<String, Value>, k: &str, v: &str| {
        if !v.is_empty() {
            m.insert(k.into(), json!(v));
        }
    };
    if attrs.resource_request {
        let mut r = Map::new();
        put(&mut r, "namespace", &attrs.namespace);
        put(&mut r, "verb", &attrs.verb);
        put(&mut r, "group", &attrs.api_group);
        put(&mut r, "version", &attrs.api_version);
        put(&mut r, "resource", &attrs.resource);
        put(&mut r, "subresource", &attrs.subresource);
        put(&mut r, "name", &attrs.name);
        spec.insert("resourceAttributes".into(), Value::Object(r));
    } else {
        spec.insert(
            "nonResourceAttributes".into(),
            json!({"path": attrs.path, "verb": attrs.verb}),
        );
    }
    put(&mut spec, "user", &user.name);
    if !user.groups.is_empty() {
        let field = match version {
            SarVersion::V1 => "groups",
            SarVersion::V1beta1 => "group",
        };
        spec.insert(field.into(), json!(user.groups));
    }
    if !user.extra.is_empty() {
        spec.insert("extra".into(), json!(user.extra));
    }
    put(&mut spec, "uid", &user.uid);
    let api_version = match version {
        SarVersion::V1 => "authorization.k8s.io/v1",
        SarVersion::V1beta1 => "authorization.k8s.io/v1beta1",
    };
    json!({
        "apiVersion": api_version,
        "kind": "SubjectAccessReview",
        "metadata": {"creationTimestamp": null},
        "spec": spec,
        "status": {"allowed": false},
    })
}

enum Link {
    Webhook(Box<WebhookAuthorizer>),
    Rbac,
    AlwaysAllow,
    AlwaysDeny,
}

/// The authorizer chain of a sample apiserver.
pub(crate) struct Authorizer {
    /// `None`: AlwaysAllow (no configuration).
    chain: Option<Vec<Link>>,
    pub(crate) rbac: Rbac,
}

impl Authorizer {
    /// Every authenticated request is allowed.
    pub(crate) fn always_allow() -> Authorizer {
        Authorizer {
            chain: None,
            rbac: Rbac::new(),
        }
    }

    /// The chain of an `AuthorizationConfiguration` file (`apiserver.config.k8s.io/v1`, `v1beta1` or `v1alpha1`).
    pub(crate) fn from_config(path: &Path) -> Result<Authorizer, WebhookError> {
        let text = std::fs::read_to_string(path).map_err(|source| WebhookError::Read {
            path: path.to_path_buf(),
            source,
        })?;
        let invalid = |message: String| WebhookError::Config {
            path: path.to_path_buf(),
            message,
        };
        let doc: serde_yaml::Value =
            serde_yaml::from_str(&text).map_err(|e| invalid(format!("not YAML: {e}")))?;
        if doc["kind"].as_str() != Some("AuthorizationConfiguration") {
            return Err(invalid("kind must be AuthorizationConfiguration".into()));
        }
        let api_version = doc["apiVersion"].as_str().unwrap_or_default();
        if !matches!(
            api_version,
            "apiserver.config.k8s.io/v1"
                | "apiserver.config.k8s.io/v1beta1"
                | "apiserver.config.k8s.io/v1alpha1"
        ) {
            return Err(invalid(format!("unsupported apiVersion {api_version:?}")));
        }
        let base = path.parent().unwrap_or_else(|| Path::new("."));
        let authorizers = doc["authorizers"]
            .as_sequence()
            .ok_or_else(|| invalid("no authorizers".into()))?;
        let mut chain = Vec::new();
        for (i, a) in authorizers.iter().enumerate() {
            let kind = a["type"].as_str().unwrap_or_default();
            let name = a["name"].as_str().unwrap_or(kind).to_string();
            match kind {
                "Node" => {}
                "RBAC" => chain.push(Link::Rbac),
                "AlwaysAllow" => chain.push(Link::AlwaysAllow),
                "AlwaysDeny" => chain.push(Link::AlwaysDeny),
                "Webhook" => {
                    let w = &a["webhook"];
                    let at = |what: &str| format!("authorizers[{i}] ({name}): {what}");
                    let duration =
                        |field: &str, default: Duration| -> Result<Duration, WebhookError> {
                            match w[field].as_str() {
                                None => Ok(default),
                                Some(s) => parse_go_duration(s)
                                    .ok_or_else(|| invalid(at(&format!("invalid {field} {s:?}")))),
                            }
                        };
                    let version = match w["subjectAccessReviewVersion"].as_str() {
                        Some("v1") | None => SarVersion::V1,
                        Some("v1beta1") => SarVersion::V1beta1,
                        Some(other) => {
                            return Err(invalid(at(&format!(
                                "unsupported subjectAccessReviewVersion {other:?}"
                            ))));
                        }
                    };
                    let fail_closed = match w["failurePolicy"].as_str() {
                        Some("NoOpinion") => false,
                        Some("Deny") | None => true,
                        Some(other) => {
                            return Err(invalid(at(&format!(
                                "failurePolicy {other:?} is not NoOpinion or Deny"
                            ))));
                        }
                    };
                    let connection = &w["connectionInfo"];
                    if connection["type"].as_str() != Some("KubeConfigFile") {
                        return Err(invalid(at(
                            "connectionInfo.type must be KubeConfigFile (no in-cluster config here)",
                        )));
                    }
                    let file = connection["kubeConfigFile"]
                        .as_str()
                        .ok_or_else(|| invalid(at("connectionInfo.kubeConfigFile is missing")))?;
                    let file = if Path::new(file).is_absolute() {
                        Path::new(file).to_path_buf()
                    } else {
                        base.join(file)
                    };
                    let client = WebhookClient::from_kubeconfig(&file)?;
                    let mut conditions = Vec::new();
                    for c in w["matchConditions"].as_sequence().into_iter().flatten() {
                        let expression = c["expression"].as_str().unwrap_or_default();
                        conditions
                            .extend(Condition::parse_all(expression).map_err(|e| invalid(at(&e)))?);
                    }
                    chain.push(Link::Webhook(Box::new(WebhookAuthorizer {
                        timeout: duration("timeout", DEFAULT_WEBHOOK_TIMEOUT)?,
                        authorized_ttl: duration("authorizedTTL", DEFAULT_AUTHORIZED_TTL)?,
                        unauthorized_ttl: duration("unauthorizedTTL", DEFAULT_UNAUTHORIZED_TTL)?,
                        name,
                        client,
                        version,
                        fail_closed,
                        conditions,
                        cache: RwLock::new(HashMap::new()),
                        calls: AtomicU64::new(0),
                    })));
                }
                other => {
                    return Err(invalid(format!(
                        "authorizers[{i}]: unsupported type {other:?}"
                    )));
                }
            }
        }
        Ok(Authorizer {
            chain: Some(chain),
            rbac: Rbac::new(),
        })
    }

    /// How many SubjectAccessReview calls the webhooks got (cache misses).
    pub(crate) fn webhook_calls(&self) -> u64 {
        self.chain
            .iter()
            .flatten()
            .map(|l| match l {
                Link::Webhook(w) => w.calls.load(Ordering::Relaxed),
                _ => 0,
            })
            .sum()
    }

    /// Asks the chain; the reason is the deciding authorizer's, or every reason given when nobody decided.
    pub(crate) async fn authorize(&self, user: &User, attrs: &Attributes) -> (Verdict, String) {
        let Some(chain) = &self.chain else {
            return (Verdict::Allow, String::new());
        };
        if user.groups.iter().any(|g| g == "system:masters") {
            return (Verdict::Allow, String::new());
        }
        let mut reasons: Vec<String> = Vec::new();
        for link in chain {
            let (verdict, reason) = match link {
                Link::Webhook(w) => w.decide(user, attrs).await,
                Link::Rbac => (self.rbac.decide(user, attrs), String::new()),
                Link::AlwaysAllow => (Verdict::Allow, String::new()),
                Link::AlwaysDeny => (Verdict::Deny, String::new()),
            };
            if verdict != Verdict::NoOpinion {
                return (verdict, reason);
            }
            if !reason.is_empty() {
                reasons.push(reason);
            }
        }
        (Verdict::NoOpinion, reasons.join("\n"))
    }

    /// What `user` may do in `namespace`, as a SelfSubjectRulesReview status: the resource rules and
    /// non-resource rules the chain can list, and whether the list is incomplete (a webhook cannot list its rules,
    /// as in kube-apiserver).
    pub(crate) fn rules_for(&self, user: &User, namespace: &str) -> serde_json::Value {
        use serde_json::json;
        let everything = || {
            json!({
                "resourceRules": [{"verbs": ["*"], "apiGroups": ["*"], "resources": ["*"]}],
                "nonResourceRules": [{"verbs": ["*"], "nonResourceURLs": ["*"]}],
                "incomplete": false,
            })
        };
        let Some(chain) = &self.chain else {
            return everything();
        };
        if user.groups.iter().any(|g| g == "system:masters") {
            return everything();
        }
        let mut resource_rules = Vec::new();
        let mut non_resource_rules = Vec::new();
        let mut incomplete = false;
        for link in chain {
            match link {
                Link::AlwaysAllow => return everything(),
                Link::AlwaysDeny => break,
                Link::Webhook(_) => incomplete = true,
                Link::Rbac => {
                    let rules = self
                        .rbac
                        .rules
                        .read()
                        .map(|r| r.clone())
                        .unwrap_or_default();
                    for rule in rules.iter().filter(|r| r.applies_to(user)) {
                        if !rule.resources.is_empty()
                            && rule.namespace.as_deref().is_none_or(|ns| ns == namespace)
                        {
                            resource_rules.push(json!({"verbs": rule.verbs, "apiGroups": ["*"], "resources": rule.resources}));
                        }
                        if !rule.non_resource_urls.is_empty() {
                            non_resource_rules.push(json!({"verbs": rule.verbs, "nonResourceURLs": rule.non_resource_urls}));
                        }
                    }
                }
            }
        }
        json!({"resourceRules": resource_rules, "nonResourceRules": non_resource_rules, "incomplete": incomplete})
    }

    /// Authorizes `attrs` for `user`; the Forbidden error (kube's message) if not allowed.
    pub(crate) async fn check(&self, user: &User, attrs: &Attributes) -> Result<(), ApiError> {
        match self.authorize(user, attrs).await {
            (Verdict::Allow, _) => Ok(()),
            (_, reason) => Err(forbidden(user, attrs, &reason)),
        }
    }
}

/// Applies the request's `Impersonate-*` headers: checks that `user` may impersonate each one and returns the
/// user to act as (or `user` itself when there are none).
pub(crate) async fn impersonate(
    authz: &Authorizer,
    user: User,
    headers: &HeaderMap,
) -> Result<User, ApiError> {
    let values = |name: &str| -> Result<Vec<String>, ApiError> {
        headers
            .get_all(name)
            .iter()
            .map(|v| {
                v.to_str().map(str::to_string).map_err(|_| {
                    ApiError::bad_request(format!("invalid {name} header: not visible ASCII"))
                })
            })
            .collect()
    };
    let users = values("impersonate-user")?;
    let groups = values("impersonate-group")?;
    let uids = values("impersonate-uid")?;
    let mut extra: BTreeMap<String, Vec<String>> = BTreeMap::new();
    for (name, value) in headers {
        if let Some(key) = name.as_str().strip_prefix("impersonate-extra-") {
            let key = percent_decode(key).to_ascii_lowercase();
            let value = value.to_str().map_err(|_| {
                ApiError::bad_request(format!("invalid {name} header: not visible ASCII"))
            })?;
            extra.entry(key).or_default().push(value.to_string());
        }
    }
    if users.is_empty() && groups.is_empty() && uids.is_empty() && extra.is_empty() {
        return Ok(user);
    }
    let Some(target) = users.first().cloned() else {
        return Err(ApiError::bad_request(
            "requested impersonation of groups, a uid or extra fields without impersonating a user",
        ));
    };
    if users.len() > 1 || uids.len() > 1 {
        return Err(ApiError::bad_request(
            "only one Impersonate-User and one Impersonate-Uid may be given",
        ));
    }
    let check =
        |resource: &str, subresource: &str, group: &str, namespace: &str, name: &str| Attributes {
            verb: "impersonate".into(),
            resource_request: true,
            api_group: group.into(),
            api_version: "v1".into(),
            resource: resource.into(),
            subresource: subresource.into(),
            namespace: namespace.into(),
            name: name.into(),
            path: String::new(),
        };
    let service_account = target
        .strip_prefix("system:serviceaccount:")
        .and_then(|rest| rest.split_once(':'));
    let user_attrs = match service_account {
        Some((ns, name)) => check("serviceaccounts", "", "", ns, name),
        None => check("users", "", "", "", &target),
    };
    authz.check(&user, &user_attrs).await?;
    for g in &groups {
        authz.check(&user, &check("groups", "", "", "", g)).await?;
    }
    for (key, vals) in &extra {
        for v in vals {
            authz
                .check(
                    &user,
                    &check("userextras", key, "authentication.k8s.io", "", v),
                )
                .await?;
        }
    }
    for uid in &uids {
        authz
            .check(&user, &check("uids", "", "authentication.k8s.io", "", uid))
            .await?;
    }
    let mut new_groups = groups;
    if new_groups.is_empty()
        && let Some((ns, _)) = service_account
    {
        new_groups.push("system:serviceaccounts".into());
        new_groups.push(format!("system:serviceaccounts:{ns}"));
    }
    if target != "system:anonymous" && !new_groups.iter().any(|g| g == "system:authenticated") {
        new_groups.push("system:authenticated".into());
    }
    tracing::debug!(real = %user.name, acting_as = %target, "impersonating");
    Ok(User {
        name: target,
        uid: uids.into_iter().next().unwrap_or_default(),
        groups: new_groups,
        extra,
    })
}

fn percent_decode(s: &str) -> String {
    let bytes = s.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'%'
            && i + 2 < bytes.len()
            && let Some(b) = std::str::from_utf8(&bytes[i + 1..i + 3])
                .ok()
                .and_then(|h| u8::from_str_radix(h, 16).ok())
        {
            out.push(b);
            i += 3;
        } else {
            out.push(bytes[i]);
            i += 1;
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// Parses a Go duration as Kubernetes configuration files and flags write them (`3s`, `500ms`, `1m30s`, `2h`,
/// `1.5s`, `0`).
pub fn parse_duration(s: &str) -> Option<Duration> {
    parse_go_duration(s)
}

fn parse_go_duration(s: &str) -> Option<Duration> {
    let s = s.trim();
    if s == "0" {
        return Some(Duration::ZERO);
    }
    let mut total = 0f64;
    let mut rest = s;
    if rest.is_empty() {
        return None;
    }
    while !rest.is_empty() {
        let num_end = rest
            .find(|c: char| !(c.is_ascii_digit() || c == '.'))
            .unwrap_or(rest.len());
        let number: f64 = rest[..num_end].parse().ok()?;
        rest = &rest[num_end..];
        let unit_end = rest
            .find(|c: char| c.is_ascii_digit() || c == '.')
            .unwrap_or(rest.len());
        let scale = match &rest[..unit_end] {
            "ns" => 1e-9,
            "us" | "µs" => 1e-6,
            "ms" => 1e-3,
            "s" => 1.0,
            "m" => 60.0,
            "h" => 3600.0,
            _ => return None,
        };
        total += number * scale;
        rest = &rest[unit_end..];
    }
    Duration::try_from_secs_f64(total).ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn alice() -> User {
        User {
            name: "alice@contoso.com".into(),
            uid: "o1".into(),
            groups: vec!["g1".into(), "system:authenticated".into()],
            extra: BTreeMap::from([("oid".to_string(), vec!["o1".to_string()])]),
        }
    }

    fn attrs(verb: &str, resource: &str, namespace: &str) -> Attributes {
        Attributes {
            verb: verb.into(),
            resource_request: true,
            api_group: String::new(),
            api_version: "v1".into(),
            resource: resource.into(),
            subresource: String::new(),
            namespace: namespace.into(),
            name: String::new(),
            path: format!("/api/v1/namespaces/{namespace}/{resource}"),
        }
    }

    #[test]
    fn go_durations() {
        assert_eq!(parse_go_duration("2s"), Some(Duration::from_secs(2)));
        assert_eq!(parse_go_duration("1m30s"), Some(Duration::from_secs(90)));
        assert_eq!(parse_go_duration("500ms"), Some(Duration::from_millis(500)));
        assert_eq!(parse_go_duration("0"), Some(Duration::ZERO));
        assert_eq!(parse_go_duration("1.5s"), Some(Duration::from_millis(1500)));
        assert_eq!(parse_go_duration("3 weeks"), None);
        assert_eq!(parse_go_duration(""), None);
    }

    #[test]
    fn match_conditions_of_the_shipped_config() -> Result<(), String> {
        let not_system = Condition::parse_all("!request.user.startsWith('system:')")?;
        let has_oid = Condition::parse_all("has(request.extra) && 'oid' in request.extra")?;
        let user = alice();
        assert!(not_system.iter().all(|c| c.eval(&user)));
        assert!(has_oid.iter().all(|c| c.eval(&user)));
        let sa = User {
            name: "system:serviceaccount:default:ci".into(),
            extra: BTreeMap::new(),
            ..user
        };
        assert!(!not_system.iter().all(|c| c.eval(&sa)));
        assert!(!has_oid.iter().all(|c| c.eval(&sa)));
        assert!(Condition::parse_all("request.resourceAttributes.namespace == 'x'").is_err());
        assert_eq!(
            Condition::parse("!('system:masters' in request.groups)"),
            Ok(Condition::Not(Box::new(Condition::InGroups(
                "system:masters".into()
            ))))
        );
        Ok(())
    }

    #[test]
    fn reviews_carry_kube_fields() {
        let mut a = attrs("list", "configmaps", "default");
        let v1 = subject_access_review(SarVersion::V1, &alice(), &a);
        assert_eq!(v1["apiVersion"], "authorization.k8s.io/v1");
        assert_eq!(
            v1["spec"]["resourceAttributes"],
            json!({"namespace": "default", "verb": "list", "version": "v1", "resource": "configmaps"})
        );
        assert_eq!(v1["spec"]["groups"][0], "g1");
        assert_eq!(v1["spec"]["extra"]["oid"][0], "o1");
        let beta = subject_access_review(SarVersion::V1beta1, &alice(), &a);
        assert_eq!(beta["spec"]["group"][0], "g1");
        assert!(beta["spec"].get("groups").is_none());
        a.resource_request = false;
        a.path = "/version".into();
        a.verb = "get".into();
        let path = subject_access_review(SarVersion::V1, &alice(), &a);
        assert_eq!(
            path["spec"]["nonResourceAttributes"],
            json!({"path": "/version", "verb": "get"})
        );
    }

    #[test]
    fn built_in_rbac() {
        let rbac = Rbac::new();
        let ci = User {
            name: "system:serviceaccount:default:ci".into(),
            groups: vec!["system:authenticated".into()],
            extra: BTreeMap::new(),
            uid: String::new(),
        };
        let mut version = attrs("get", "", "");
        version.resource_request = false;
        version.path = "/version".into();
        assert_eq!(rbac.decide(&ci, &version), Verdict::Allow);
        assert_eq!(
            rbac.decide(&ci, &attrs("list", "configmaps", "default")),
            Verdict::NoOpinion
        );
        rbac.add(RbacRule::new(
            Subject::User(ci.name.clone()),
            &["get", "list"],
            &["configmaps"],
            Some("default"),
        ));
        assert_eq!(
            rbac.decide(&ci, &attrs("list", "configmaps", "default")),
            Verdict::Allow
        );
        assert_eq!(
            rbac.decide(&ci, &attrs("list", "configmaps", "other")),
            Verdict::NoOpinion
        );
        assert_eq!(
            rbac.decide(&ci, &attrs("delete", "configmaps", "default")),
            Verdict::NoOpinion
        );
        rbac.add(RbacRule::everything(Subject::Group("admins".into())));
        let admin = User {
            groups: vec!["admins".into()],
            ..ci
        };
        assert_eq!(
            rbac.decide(&admin, &attrs("impersonate", "users", "")),
            Verdict::Allow
        );
    }

    #[tokio::test]
    async fn impersonation_needs_permission_and_sets_the_user() {
        let authz = Authorizer {
            chain: Some(vec![Link::Rbac]),
            rbac: Rbac::new(),
        };
        let agent = User {
            name: "system:serviceaccount:tether-system:tether-agent".into(),
            uid: String::new(),
            groups: vec!["system:authenticated".into()],
            extra: BTreeMap::new(),
        };
        let mut headers = HeaderMap::new();
        headers.insert(
            "impersonate-user",
            http::HeaderValue::from_static("alice@contoso.com"),
        );
        headers.append("impersonate-group", http::HeaderValue::from_static("g1"));
        headers.insert(
            "impersonate-extra-oid",
            http::HeaderValue::from_static("o1"),
        );
        headers.insert("impersonate-uid", http::HeaderValue::from_static("o1"));
        let refused = impersonate(&authz, agent.clone(), &headers).await;
        assert_eq!(
            refused.map_err(|e| e.message),
            Err(
                "users \"alice@contoso.com\" is forbidden: User \"system:serviceaccount:tether-system:tether-agent\" \
                 cannot impersonate resource \"users\" in API group \"\" at the cluster scope"
                    .to_string()
            )
        );
        authz
            .rbac
            .add(RbacRule::everything(Subject::User(agent.name.clone())));
        let acting = impersonate(&authz, agent.clone(), &headers).await;
        assert_eq!(
            acting.map_err(|e| e.message),
            Ok(User {
                name: "alice@contoso.com".into(),
                uid: "o1".into(),
                groups: vec!["g1".into(), "system:authenticated".into()],
                extra: BTreeMap::from([("oid".to_string(), vec!["o1".to_string()])]),
            })
        );
        let mut groups_only = HeaderMap::new();
        groups_only.insert("impersonate-group", http::HeaderValue::from_static("g1"));
        assert_eq!(
            impersonate(&authz, agent.clone(), &groups_only)
                .await
                .map_err(|e| e.code),
            Err(400)
        );
        assert_eq!(
            impersonate(&authz, agent.clone(), &HeaderMap::new()).await,
            Ok(agent)
        );
    }

    #[test]
    fn percent_decoding_of_extra_keys() {
        assert_eq!(
            percent_decode("scopes.example.com%2fteam"),
            "scopes.example.com/team"
        );
        assert_eq!(percent_decode("oid"), "oid");
        assert_eq!(percent_decode("bad%zz"), "bad%zz");
    }
}
