//! `SelfSubjectAccessReview` and `SelfSubjectRulesReview` (`authorization.k8s.io/v1`): what `kubectl auth can-i`
//! asks. Access reviews go through the same authorizer chain as real requests (so with guard as the webhook, the
//! answer is guard's); rules reviews list what the chain can list and say `incomplete` when a webhook is in it.

use serde_json::{Value, json};

use crate::auth::{Attributes, User};
use crate::authz::{Authorizer, Verdict};
use crate::status::{ApiError, FieldError};

fn check_kind(body: &Value, kind: &str) -> Result<(), ApiError> {
    match (body["apiVersion"].as_str(), body["kind"].as_str()) {
        (None | Some("authorization.k8s.io/v1"), None) => Ok(()),
        (None | Some("authorization.k8s.io/v1"), Some(k)) if k == kind => Ok(()),
        _ => Err(ApiError::bad_request(format!(
            "the body of the request is not an authorization.k8s.io/v1 {kind}"
        ))),
    }
}

/// Answers a SelfSubjectAccessReview for `user`.
pub(crate) async fn access_review(
    authz: &Authorizer,
    user: &User,
    body: Value,
) -> Result<Value, ApiError> {
    check_kind(&body, "SelfSubjectAccessReview")?;
    let spec = &body["spec"];
    let s = |v: &Value| v.as_str().unwrap_or_default().to_string();
    let attrs = match (
        spec["resourceAttributes"].as_object(),
        spec["nonResourceAttributes"].as_object(),
    ) {
        (Some(_), None) => {
            let r = &spec["resourceAttributes"];
            Attributes {
                verb: s(&r["verb"]),
                resource_request: true,
                api_group: s(&r["group"]),
                api_version: s(&r["version"]),
                resource: s(&r["resource"]),
                subresource: s(&r["subresource"]),
                namespace: s(&r["namespace"]),
                name: s(&r["name"]),
                path: String::new(),
            }
        }
        (None, Some(_)) => {
            let n = &spec["nonResourceAttributes"];
            Attributes {
                verb: s(&n["verb"]),
                resource_request: false,
                api_group: String::new(),
                api_version: String::new(),
                resource: String::new(),
                subresource: String::new(),
                namespace: String::new(),
                name: String::new(),
                path: s(&n["path"]),
            }
        }
        _ => {
            return Err(ApiError::invalid(
                "SelfSubjectAccessReview",
                "",
                &[FieldError::invalid(
                    "spec.resourceAttributes",
                    "",
                    "exactly one of nonResourceAttributes or resourceAttributes must be specified",
                )],
            ));
        }
    };
    let (verdict, reason) = authz.authorize(user, &attrs).await;
    let mut status = json!({"allowed": verdict == Verdict::Allow});
    if verdict == Verdict::Deny {
        status["denied"] = json!(true);
    }
    if !reason.is_empty() {
        status["reason"] = json!(reason);
    }
    Ok(json!({
        "kind": "SelfSubjectAccessReview",
        "apiVersion": "authorization.k8s.io/v1",
        "metadata": {"creationTimestamp": null},
        "spec": spec,
        "status": status,
    }))
}

/// Answers a SelfSubjectRulesReview for `user`.
pub(crate) fn rules_review(
    authz: &Authorizer,
    user: &User,
    body: Value,
) -> Result<Value, ApiError> {
    check_kind(&body, "SelfSubjectRulesReview")?;
    let namespace = body["spec"]["namespace"].as_str().unwrap_or_default();
    Ok(json!({
        "kind": "SelfSubjectRulesReview",
        "apiVersion": "authorization.k8s.io/v1",
        "metadata": {"creationTimestamp": null},
        "spec": {"namespace": namespace},
        "status": authz.rules_for(user, namespace),
    }))
}
