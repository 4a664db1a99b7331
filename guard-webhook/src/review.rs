//! The Kubernetes webhook wire formats: TokenReview (authentication.k8s.io v1 and v1beta1) and SubjectAccessReview
//! (authorization.k8s.io v1 and v1beta1, where the groups field is named `group`). Answers carry the version the
//! request used. Hand-written serde types so each version's field names are exact.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};
use serde_json::{Value, json};

use tether_auth::rbac::{AccessRequest, Decision, NonResourceAttributes, ResourceAttributes};
use tether_auth::token::Identity;

/// The TokenReview API versions served.
pub const TOKEN_REVIEW_VERSIONS: [&str; 2] =
    ["authentication.k8s.io/v1", "authentication.k8s.io/v1beta1"];
/// The SubjectAccessReview API versions served.
pub const ACCESS_REVIEW_VERSIONS: [&str; 2] =
    ["authorization.k8s.io/v1", "authorization.k8s.io/v1beta1"];

/// Why a review body was refused (answered 400).
#[derive(Debug, thiserror::Error)]
pub enum ReviewError {
    /// Not JSON, or not the expected shape.
    #[error("malformed review: {0}")]
    Malformed(String),
    /// Wrong `kind` or an `apiVersion` not served.
    #[error("unsupported review: {0}")]
    Unsupported(String),
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct TypeMeta {
    #[serde(default)]
    api_version: String,
    #[serde(default)]
    kind: String,
}

fn type_meta(body: &[u8], kind: &str, versions: &[&str]) -> Result<String, ReviewError> {
    let meta: TypeMeta =
        serde_json::from_slice(body).map_err(|e| ReviewError::Malformed(e.to_string()))?;
    if meta.kind != kind {
        return Err(ReviewError::Unsupported(format!(
            "expected kind {kind}, got {:?}",
            meta.kind
        )));
    }
    if !versions.contains(&meta.api_version.as_str()) {
        return Err(ReviewError::Unsupported(format!(
            "apiVersion {:?} is not one of {versions:?}",
            meta.api_version
        )));
    }
    Ok(meta.api_version)
}

/// A parsed TokenReview request. `Debug` hides the token.
pub struct TokenReviewRequest {
    /// The apiVersion to answer in.
    pub api_version: String,
    /// The bearer token.
    pub token: String,
    /// `spec.audiences` (informational: guard checks its own configured audiences).
    pub audiences: Vec<String>,
}

impl std::fmt::Debug for TokenReviewRequest {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TokenReviewRequest")
            .field("api_version", &self.api_version)
            .field("token", &"***")
            .field("audiences", &self.audiences)
            .finish()
    }
}

#[derive(Deserialize)]
struct TokenReviewBody {
    #[serde(default)]
    spec: TokenReviewSpec,
}

#[derive(Deserialize, Default)]
struct TokenReviewSpec {
    #[serde(default)]
    token: String,
    #[serde(default)]
    audiences: Vec<String>,
}

impl TokenReviewRequest {
    /// Parses a TokenReview of a served version.
    pub fn parse(body: &[u8]) -> Result<Self, ReviewError> {
        let api_version = type_meta(body, "TokenReview", &TOKEN_REVIEW_VERSIONS)?;
        let parsed: TokenReviewBody =
            serde_json::from_slice(body).map_err(|e| ReviewError::Malformed(e.to_string()))?;
        Ok(Self {
            api_version,
            token: parsed.spec.token,
            audiences: parsed.spec.audiences,
        })
    }
}

/// The TokenReview answer for an authenticated identity.
pub fn token_review_authenticated(api_version: &str, identity: &Identity) -> Value {
    json!({
        "apiVersion": api_version,
        "kind": "TokenReview",
        "status": {
            "authenticated": true,
            "user": {
                "username": identity.username,
                "uid": identity.uid,
                "groups": identity.groups,
                "extra": identity.extra,
            }
        }
    })
}

/// The TokenReview answer for a refused token; `error` is shown in the apiserver's log.
pub fn token_review_refused(api_version: &str, error: &str) -> Value {
    json!({
        "apiVersion": api_version,
        "kind": "TokenReview",
        "status": { "authenticated": false, "error": error }
    })
}

#[derive(Deserialize)]
struct AccessReviewBody {
    #[serde(default)]
    spec: AccessReviewSpec,
}

#[derive(Deserialize, Default)]
#[serde(rename_all = "camelCase", default)]
struct AccessReviewSpec {
    resource_attributes: Option<ResourceAttributes>,
    non_resource_attributes: Option<NonResourceAttributes>,
    user: String,
    groups: Option<Vec<String>>,
    group: Option<Vec<String>>,
    extra: BTreeMap<String, Vec<String>>,
    uid: String,
}

/// A parsed SubjectAccessReview.
#[derive(Clone, Debug)]
pub struct AccessReviewRequest {
    /// The apiVersion to answer in.
    pub api_version: String,
    /// The question.
    pub request: AccessRequest,
}

impl AccessReviewRequest {
    /// Parses a SubjectAccessReview of a served version (`groups` in v1, `group` in v1beta1).
    pub fn parse(body: &[u8]) -> Result<Self, ReviewError> {
        let api_version = type_meta(body, "SubjectAccessReview", &ACCESS_REVIEW_VERSIONS)?;
        let parsed: AccessReviewBody =
            serde_json::from_slice(body).map_err(|e| ReviewError::Malformed(e.to_string()))?;
        let spec = parsed.spec;
        let groups = if api_version.ends_with("/v1beta1") {
            spec.group
        } else {
            spec.groups
        }
        .unwrap_or_default();
        Ok(Self {
            api_version,
            request: AccessRequest {
                user: spec.user,
                uid: spec.uid,
                groups,
                extra: spec.extra,
                resource: spec.resource_attributes,
                non_resource: spec.non_resource_attributes,
            },
        })
    }
}

#[derive(Serialize)]
#[serde(rename_all = "camelCase")]
struct AccessReviewStatus<'a> {
    allowed: bool,
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    denied: bool,
    #[serde(skip_serializing_if = "str::is_empty")]
    reason: &'a str,
    #[serde(skip_serializing_if = "str::is_empty")]
    evaluation_error: &'a str,
}

/// The SubjectAccessReview answer.
pub fn access_review_answer(
    api_version: &str,
    decision: &Decision,
    evaluation_error: &str,
) -> Value {
    json!({
        "apiVersion": api_version,
        "kind": "SubjectAccessReview",
        "status": AccessReviewStatus {
            allowed: decision.allowed,
            denied: decision.denied,
            reason: &decision.reason,
            evaluation_error,
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn v1beta1_groups_field_is_group() -> anyhow::Result<()> {
        let v1 = br#"{"apiVersion":"authorization.k8s.io/v1","kind":"SubjectAccessReview",
            "spec":{"user":"u","groups":["g1"],"group":["wrong"],"extra":{"oid":["o"]},
                    "resourceAttributes":{"verb":"get","resource":"pods","namespace":"dev"}}}"#;
        let r = AccessReviewRequest::parse(v1)?;
        assert_eq!(r.request.groups, vec!["g1".to_owned()]);
        assert_eq!(
            r.request.resource.map(|r| r.namespace),
            Some("dev".to_owned())
        );
        let beta = br#"{"apiVersion":"authorization.k8s.io/v1beta1","kind":"SubjectAccessReview",
            "spec":{"user":"u","group":["g2"],"nonResourceAttributes":{"path":"/healthz","verb":"get"}}}"#;
        let r = AccessReviewRequest::parse(beta)?;
        assert_eq!(r.api_version, "authorization.k8s.io/v1beta1");
        assert_eq!(r.request.groups, vec!["g2".to_owned()]);
        assert!(r.request.non_resource.is_some());
        Ok(())
    }

    #[test]
    fn wrong_kind_or_version_is_refused() {
        let body = br#"{"apiVersion":"authorization.k8s.io/v2","kind":"SubjectAccessReview"}"#;
        assert!(matches!(
            AccessReviewRequest::parse(body),
            Err(ReviewError::Unsupported(_))
        ));
        let body = br#"{"apiVersion":"authentication.k8s.io/v1","kind":"SubjectAccessReview"}"#;
        assert!(matches!(
            TokenReviewRequest::parse(body),
            Err(ReviewError::Unsupported(_))
        ));
        assert!(matches!(
            TokenReviewRequest::parse(b"{"),
            Err(ReviewError::Malformed(_))
        ));
    }

    #[test]
    fn token_is_not_in_debug_output() -> anyhow::Result<()> {
        let body = br#"{"apiVersion":"authentication.k8s.io/v1","kind":"TokenReview","spec":{"token":"s3cr3t"}}"#;
        let r = TokenReviewRequest::parse(body)?;
        assert_eq!(r.token, "s3cr3t");
        assert!(!format!("{r:?}").contains("s3cr3t"));
        Ok(())
    }

    #[test]
    fn answers() {
        let d = Decision {
            allowed: false,
            denied: true,
            reason: "no".to_owned(),
        };
        let v = access_review_answer("authorization.k8s.io/v1beta1", &d, "");
        assert_eq!(v["apiVersion"], "authorization.k8s.io/v1beta1");
        assert_eq!(v["status"]["denied"], true);
        assert!(v["status"].get("evaluationError").is_none());
        let v = token_review_refused("authentication.k8s.io/v1", "expired");
        assert_eq!(v["status"]["authenticated"], false);
    }
}
