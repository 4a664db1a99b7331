//! Authentication (static bearer tokens) and the authorization step.
//!
//! Authentication maps `Authorization: Bearer TOKEN` to a [`User`]. Authorization is a single function,
//! [`authorize`], called with the user and the request's [`Attributes`] before any handler runs; today it allows
//! every authenticated request. A later issue adds webhook authorization (SubjectAccessReview) and impersonation
//! (`Impersonate-User` / `Impersonate-Group` headers, checked with verb `impersonate`): both belong here.

use std::collections::{BTreeMap, HashMap};
use std::sync::RwLock;

use http::HeaderMap;

use crate::status::ApiError;

/// An authenticated identity, as Kubernetes describes one (`user.Info`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct User {
    /// The user name, e.g. `admin`.
    pub name: String,
    /// A unique id for the user.
    pub uid: String,
    /// The groups, e.g. `system:masters`, `system:authenticated`.
    pub groups: Vec<String>,
    /// Extra attributes (scopes and the like).
    pub extra: BTreeMap<String, Vec<String>>,
}

/// What a request wants to do, in Kubernetes authorization terms (`authorizer.Attributes`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Attributes {
    /// The verb: get, list, watch, create, update, patch, delete, deletecollection; or the lower-case HTTP method
    /// for non-resource requests.
    pub verb: String,
    /// True for requests on API resources, false for paths like `/version` or `/healthz`.
    pub resource_request: bool,
    /// The API group ("" for the core group).
    pub api_group: String,
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

/// The outcome of [`authorize`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Decision {
    /// The request may proceed.
    Allow,
    /// The request is refused, with a reason for the message.
    Deny(String),
}

/// Decides whether `user` may do what `attrs` describe. Every authenticated user is allowed for now; webhook
/// authorization will be consulted here.
pub fn authorize(user: &User, attrs: &Attributes) -> Decision {
    let _ = (user, attrs);
    Decision::Allow
}

/// The Forbidden error kube-apiserver returns for a denied request.
pub(crate) fn forbidden(user: &User, attrs: &Attributes, reason: &str) -> ApiError {
    let mut message = if !attrs.resource_request {
        format!(
            "forbidden: User \"{}\" cannot {} path \"{}\"",
            user.name, attrs.verb, attrs.path
        )
    } else {
        let resource = if attrs.subresource.is_empty() {
            attrs.resource.clone()
        } else {
            format!("{}/{}", attrs.resource, attrs.subresource)
        };
        let subject = if attrs.name.is_empty() {
            resource.clone()
        } else {
            format!("{resource} \"{}\"", attrs.name)
        };
        let scope = if attrs.namespace.is_empty() {
            "at the cluster scope".to_string()
        } else {
            format!("in the namespace \"{}\"", attrs.namespace)
        };
        format!(
            "{subject} is forbidden: User \"{}\" cannot {} resource \"{resource}\" in API group \"{}\" {scope}",
            user.name, attrs.verb, attrs.api_group
        )
    };
    if !reason.is_empty() {
        message.push_str(": ");
        message.push_str(reason);
    }
    ApiError::forbidden(message)
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

    /// The user for the request's bearer token, or 401.
    pub(crate) fn authenticate(&self, headers: &HeaderMap) -> Result<User, ApiError> {
        let token = headers
            .get(http::header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .and_then(bearer)
            .ok_or_else(ApiError::unauthorized)?;
        let users = self
            .users
            .read()
            .map_err(|_| ApiError::internal("token table poisoned"))?;
        users.get(token).cloned().ok_or_else(ApiError::unauthorized)
    }
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
        let attrs = Attributes {
            verb: "get".into(),
            resource_request: true,
            api_group: String::new(),
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
        assert_eq!(authorize(&user("bob", &[]), &attrs), Decision::Allow);
    }
}
