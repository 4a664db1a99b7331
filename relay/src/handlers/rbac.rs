//! `/api/v1/roledefinitions`, `/api/v1/roleassignments`, `/api/v1/denyassignments` and
//! `/api/v1/directory/users/OID`: HTTP in and out of the [`crate::rbac`] domain service.

use http::{Method, Request, Response, StatusCode};
use hyper::body::Incoming;
use serde::Deserialize;
use serde_json::{Value, json};
use tether_auth::rbac::{self as model, RoleDefinition};
use time::OffsetDateTime;

use super::{body_limit, require_admin};
use crate::api_error::ApiError;
use crate::body::Body;
use crate::rbac::{self, NewAssignment, NewDeny};
use crate::respond;
use crate::state::Shared;
use crate::store::{DenyAssignmentRecord, DirectoryEntry, RoleAssignmentRecord};

fn rfc3339(t: OffsetDateTime) -> Value {
    t.format(&time::format_description::well_known::Rfc3339)
        .map_or(Value::Null, Value::String)
}

pub(crate) fn role_json(role: &RoleDefinition, builtin: bool) -> Value {
    json!({
        "id": role.id,
        "name": role.name,
        "description": role.description,
        "dataActions": role.data_actions,
        "notDataActions": role.not_data_actions,
        "builtIn": builtin,
    })
}

/// A role assignment as the API (and an export) shows it.
pub(crate) fn assignment_json(a: &RoleAssignmentRecord, custom: &[RoleDefinition]) -> Value {
    let mut v = json!({
        "id": a.id,
        "roleId": a.role_id,
        "roleName": model::find_role(custom, &a.role_id).map(|r| r.name.as_str()),
        "principalId": a.principal_id,
        "cluster": a.cluster,
        "createdAt": rfc3339(a.created_at),
    });
    if let (Some(ns), Some(obj)) = (&a.namespace, v.as_object_mut()) {
        obj.insert("namespace".into(), Value::String(ns.clone()));
    }
    v
}

/// A deny assignment as the API (and an export) shows it.
pub(crate) fn deny_json(d: &DenyAssignmentRecord) -> Value {
    let mut v = json!({
        "id": d.id,
        "name": d.name,
        "dataActions": d.data_actions,
        "notDataActions": d.not_data_actions,
        "principals": d.principals,
        "excludePrincipals": d.exclude_principals,
        "cluster": d.cluster,
        "createdAt": rfc3339(d.created_at),
    });
    if let (Some(ns), Some(obj)) = (&d.namespace, v.as_object_mut()) {
        obj.insert("namespace".into(), Value::String(ns.clone()));
    }
    v
}

fn directory_json(e: &DirectoryEntry) -> Value {
    json!({
        "oid": e.oid,
        "tid": e.tid,
        "groups": e.groups,
        "updatedAt": rfc3339(e.updated_at),
    })
}

/// Splits `rest` (what follows the collection's path) into an optional item id, percent-decoded (so
/// `Cluster%20Admin` names the built-in); more segments are a 404.
fn item(collection: &str, rest: Option<&str>) -> Result<Option<String>, ApiError> {
    let Some(rest) = rest else {
        return Ok(None);
    };
    match percent_decode(rest) {
        Some(id) if !id.is_empty() && !id.contains('/') => Ok(Some(id)),
        _ => Err(ApiError::not_found(format!(
            "the relay serves no /api/v1/{collection}/{rest}"
        ))),
    }
}

/// `%XX` escapes decoded; `None` for a malformed escape or bytes that are not UTF-8.
fn percent_decode(s: &str) -> Option<String> {
    let mut out = Vec::with_capacity(s.len());
    let mut bytes = s.bytes();
    while let Some(b) = bytes.next() {
        if b == b'%' {
            let hi = (bytes.next()? as char).to_digit(16)?;
            let lo = (bytes.next()? as char).to_digit(16)?;
            out.push(u8::try_from(hi * 16 + lo).ok()?);
        } else {
            out.push(b);
        }
    }
    String::from_utf8(out).ok()
}

/// The only query parameter of the assignment lists: `cluster`.
fn cluster_filter(query: Option<&str>) -> Result<Option<String>, ApiError> {
    let mut cluster = None;
    for (key, value) in url::form_urlencoded::parse(query.unwrap_or_default().as_bytes()) {
        match &*key {
            "cluster" => cluster = Some(value.into_owned()),
            other => {
                return Err(ApiError::invalid(format!(
                    "unknown query parameter {other:?}: the list takes cluster"
                )));
            }
        }
    }
    Ok(cluster)
}

/// `/api/v1/roledefinitions[/ID]`.
pub(crate) async fn role_definitions(
    shared: &Shared,
    req: Request<Incoming>,
    rest: Option<&str>,
) -> Result<Response<Body>, ApiError> {
    require_admin(shared, req.headers())?;
    let id = item("roledefinitions", rest)?;
    let rbac = shared.rbac();
    match (req.method().clone(), id.as_deref()) {
        (Method::POST, None) => {
            let body = respond::read_body(req.into_body(), body_limit(shared)).await?;
            let text = std::str::from_utf8(&body)
                .map_err(|_| ApiError::bad_request("the role definition is not UTF-8"))?;
            let role = rbac.create_role(text).await?;
            Ok(respond::json(StatusCode::CREATED, &role_json(&role, false)))
        }
        (Method::GET, None) => {
            let custom = rbac.custom_roles().await?;
            let items: Vec<Value> = model::builtin_roles()
                .iter()
                .map(|r| role_json(r, true))
                .chain(custom.iter().map(|r| role_json(r, false)))
                .collect();
            Ok(respond::json(StatusCode::OK, &json!({ "items": items })))
        }
        (Method::GET, Some(id)) => {
            let role = rbac.role(id).await?;
            Ok(respond::json(
                StatusCode::OK,
                &role_json(&role, rbac::is_builtin(&role.id)),
            ))
        }
        (Method::DELETE, Some(id)) => {
            rbac.delete_role(id).await?;
            Ok(respond::no_content())
        }
        _ => Err(ApiError::method_not_allowed()),
    }
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct AssignBody {
    role: String,
    principal_id: String,
    cluster: String,
    #[serde(default)]
    namespace: Option<String>,
}

/// `/api/v1/roleassignments[/ID]`.
pub(crate) async fn role_assignments(
    shared: &Shared,
    req: Request<Incoming>,
    rest: Option<&str>,
) -> Result<Response<Body>, ApiError> {
    require_admin(shared, req.headers())?;
    let id = item("roleassignments", rest)?;
    let rbac = shared.rbac();
    match (req.method().clone(), id.as_deref()) {
        (Method::POST, None) => {
            let body: AssignBody = respond::read_json(req.into_body(), body_limit(shared)).await?;
            let record = rbac
                .assign(NewAssignment {
                    role: body.role,
                    principal_id: body.principal_id,
                    cluster: body.cluster,
                    namespace: body.namespace,
                })
                .await?;
            let custom = rbac.custom_roles().await?;
            Ok(respond::json(
                StatusCode::CREATED,
                &assignment_json(&record, &custom),
            ))
        }
        (Method::GET, None) => {
            let cluster = cluster_filter(req.uri().query())?;
            let records = rbac.assignments(cluster.as_deref()).await?;
            let custom = rbac.custom_roles().await?;
            let items: Vec<Value> = records
                .iter()
                .map(|a| assignment_json(a, &custom))
                .collect();
            Ok(respond::json(StatusCode::OK, &json!({ "items": items })))
        }
        (Method::GET, Some(id)) => {
            let custom = rbac.custom_roles().await?;
            let a = rbac.assignment(id).await?;
            Ok(respond::json(StatusCode::OK, &assignment_json(&a, &custom)))
        }
        (Method::DELETE, Some(id)) => {
            rbac.unassign(id).await?;
            Ok(respond::no_content())
        }
        _ => Err(ApiError::method_not_allowed()),
    }
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct DenyBody {
    #[serde(default)]
    name: String,
    data_actions: Vec<String>,
    #[serde(default)]
    not_data_actions: Vec<String>,
    principals: Vec<String>,
    #[serde(default)]
    exclude_principals: Vec<String>,
    cluster: String,
    #[serde(default)]
    namespace: Option<String>,
}

/// `/api/v1/denyassignments[/ID]`.
pub(crate) async fn deny_assignments(
    shared: &Shared,
    req: Request<Incoming>,
    rest: Option<&str>,
) -> Result<Response<Body>, ApiError> {
    require_admin(shared, req.headers())?;
    let id = item("denyassignments", rest)?;
    let rbac = shared.rbac();
    match (req.method().clone(), id.as_deref()) {
        (Method::POST, None) => {
            let body: DenyBody = respond::read_json(req.into_body(), body_limit(shared)).await?;
            let record = rbac
                .deny(NewDeny {
                    name: body.name,
                    data_actions: body.data_actions,
                    not_data_actions: body.not_data_actions,
                    principals: body.principals,
                    exclude_principals: body.exclude_principals,
                    cluster: body.cluster,
                    namespace: body.namespace,
                })
                .await?;
            Ok(respond::json(StatusCode::CREATED, &deny_json(&record)))
        }
        (Method::GET, None) => {
            let cluster = cluster_filter(req.uri().query())?;
            let items: Vec<Value> = rbac
                .denies(cluster.as_deref())
                .await?
                .iter()
                .map(deny_json)
                .collect();
            Ok(respond::json(StatusCode::OK, &json!({ "items": items })))
        }
        (Method::GET, Some(id)) => {
            let d = rbac.deny_assignment(id).await?;
            Ok(respond::json(StatusCode::OK, &deny_json(&d)))
        }
        (Method::DELETE, Some(id)) => {
            rbac.undeny(id).await?;
            Ok(respond::no_content())
        }
        _ => Err(ApiError::method_not_allowed()),
    }
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct SetGroups {
    groups: Vec<String>,
    #[serde(default)]
    tid: Option<String>,
}

/// `/api/v1/directory/users/OID`: the groups of users whose tokens carry a group overage.
pub(crate) async fn directory(
    shared: &Shared,
    req: Request<Incoming>,
    oid: &str,
) -> Result<Response<Body>, ApiError> {
    require_admin(shared, req.headers())?;
    let Some(oid) = item("directory/users", Some(oid))? else {
        return Err(ApiError::method_not_allowed());
    };
    let oid = rbac::principal(&oid, "object id")?;
    let rbac = shared.rbac();
    match req.method().clone() {
        Method::PUT => {
            let body: SetGroups = respond::read_json(req.into_body(), body_limit(shared)).await?;
            let entry = rbac.set_groups(&oid, &body.groups, body.tid).await?;
            Ok(respond::json(StatusCode::OK, &directory_json(&entry)))
        }
        Method::GET => {
            let entry = rbac.directory_entry(&oid).await?;
            Ok(respond::json(StatusCode::OK, &directory_json(&entry)))
        }
        Method::DELETE => {
            rbac.delete_directory_entry(&oid).await?;
            Ok(respond::no_content())
        }
        _ => Err(ApiError::method_not_allowed()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn item_ids_are_percent_decoded() {
        assert_eq!(
            percent_decode("Cluster%20Admin").as_deref(),
            Some("Cluster Admin")
        );
        assert_eq!(percent_decode("plain").as_deref(), Some("plain"));
        assert_eq!(percent_decode("%2f").as_deref(), Some("/"));
        assert!(percent_decode("%zz").is_none() && percent_decode("%4").is_none());
        assert!(percent_decode("%ff").is_none(), "not UTF-8");
        assert!(
            item("x", Some("a%2Fb")).is_err(),
            "a decoded slash is not an id"
        );
    }
}
