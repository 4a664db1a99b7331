//! A minimal OpenAPI v3 document, just what kubectl needs.
//!
//! kubectl's default validation (`--validate=strict`) looks up, in `/openapi/v3/api/v1`, the PATCH operation of the
//! object's kind and checks that it takes the `fieldValidation` query parameter; if so, it leaves validation to the
//! server (it sends `fieldValidation=Strict`) instead of downloading schemas. `--dry-run=server` does the same
//! check for `dryRun`. So the document lists each resource's item path with its operations and those parameters,
//! and no schemas. Its PATCH operations declare no request body, so `kubectl apply` computes strategic merge
//! patches from its compiled-in types rather than from OpenAPI schemas. `/openapi/v2` is 404: kubectl 1.33 only
//! falls back to it for what v3 does not answer, and ignores its absence there. `kubectl explain` does not work.

use http::{Response, StatusCode};
use serde_json::{Map, Value, json};

use crate::body::Body;
use crate::handlers::json_response;
use crate::resources::{GIT_VERSION, RESOURCE_GROUPS, Resource};
use crate::status::ApiError;

/// Changes whenever the document changes (kubectl caches documents by this hash).
const HASH: &str = "7e7e7e0001";

pub(crate) fn handle(rest: &[&str], _query: Option<&str>) -> Result<Response<Body>, ApiError> {
    match rest {
        ["v3"] => {
            let mut paths = Map::new();
            paths.insert(
                "api/v1".into(),
                json!({"serverRelativeURL": format!("/openapi/v3/api/v1?hash={HASH}")}),
            );
            for g in RESOURCE_GROUPS {
                paths.insert(
                    format!("apis/{g}/v1"),
                    json!({"serverRelativeURL": format!("/openapi/v3/apis/{g}/v1?hash={HASH}")}),
                );
            }
            Ok(json_response(StatusCode::OK, &json!({"paths": paths})))
        }
        ["v3", "api", "v1"] => Ok(json_response(StatusCode::OK, &group_v1(""))),
        ["v3", "apis", group, "v1"] if RESOURCE_GROUPS.contains(group) => {
            Ok(json_response(StatusCode::OK, &group_v1(group)))
        }
        _ => Err(ApiError::path_not_found()),
    }
}

fn query_param(name: &str, description: &str) -> Value {
    json!({"name": name, "in": "query", "description": description, "schema": {"type": "string", "uniqueItems": true}})
}

fn operation(resource: Resource, action: &str, with_write_params: bool) -> Value {
    let mut parameters = vec![query_param(
        "pretty",
        "If 'true', then the output is pretty printed.",
    )];
    if with_write_params {
        parameters.push(query_param(
            "dryRun",
            "When present, indicates that modifications should not be persisted.",
        ));
        parameters.push(query_param("fieldManager", "fieldManager is a name associated with the actor or entity that is making these changes."));
        parameters.push(query_param("fieldValidation", "fieldValidation instructs the server on how to handle objects in the request containing unknown or duplicate fields."));
    }
    json!({
        "operationId": format!("{action}{}V1{}", resource.group(), resource.kind()),
        "x-kubernetes-action": action,
        "x-kubernetes-group-version-kind": {"group": resource.group(), "version": "v1", "kind": resource.kind()},
        "parameters": parameters,
        "responses": {"200": {"description": "OK"}, "401": {"description": "Unauthorized"}},
    })
}

/// The document of one group version: "" for `/api/v1`, else `/apis/GROUP/v1`.
fn group_v1(group: &str) -> Value {
    let mut paths = Map::new();
    let prefix = if group.is_empty() {
        "/api/v1".to_string()
    } else {
        format!("/apis/{group}/v1")
    };
    for r in Resource::ALL.into_iter().filter(|r| r.group() == group) {
        let (collection, item) = if r.namespaced() {
            (
                format!("{prefix}/namespaces/{{namespace}}/{}", r.plural()),
                format!("{prefix}/namespaces/{{namespace}}/{}/{{name}}", r.plural()),
            )
        } else {
            (
                format!("{prefix}/{}", r.plural()),
                format!("{prefix}/{}/{{name}}", r.plural()),
            )
        };
        paths.insert(
            collection,
            json!({"get": operation(r, "list", false), "post": operation(r, "post", true)}),
        );
        paths.insert(
            item,
            json!({
                "get": operation(r, "get", false),
                "put": operation(r, "put", true),
                "patch": operation(r, "patch", true),
                "delete": operation(r, "delete", true),
            }),
        );
    }
    json!({
        "openapi": "3.0.0",
        "info": {"title": "Kubernetes", "version": GIT_VERSION},
        "paths": paths,
        "components": {"schemas": {}},
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn patch_operations_take_field_validation() {
        let doc = group_v1("");
        assert!(
            group_v1("apps")["paths"]["/apis/apps/v1/namespaces/{namespace}/deployments/{name}"]
                .is_object()
        );
        let patch = &doc["paths"]["/api/v1/namespaces/{namespace}/configmaps/{name}"]["patch"];
        assert_eq!(
            patch["x-kubernetes-group-version-kind"]["kind"],
            "ConfigMap"
        );
        let names: Vec<&str> = patch["parameters"]
            .as_array()
            .map(|ps| ps.iter().filter_map(|p| p["name"].as_str()).collect())
            .unwrap_or_default();
        assert!(names.contains(&"fieldValidation") && names.contains(&"dryRun"));
        assert!(doc["paths"]["/api/v1/namespaces/{name}"].is_object());
    }
}
