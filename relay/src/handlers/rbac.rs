//! `/api/v1/roledefinitions`, `/api/v1/roleassignments`, `/api/v1/denyassignments` and
//! `/api/v1/directory/users/OID`: HTTP in and out of the [`crate::rbac`] domain service.

use http::{Method, Request, Response, StatusCode};
use hyper::body::Incoming;
use tether_api::admin;
use tether_auth::rbac::{self as model, RoleDefinition};
use time::OffsetDateTime;

use super::{body_limit, require_admin};
use crate::api_error::ApiError;
use crate::body::Body;
use crate::rbac::{self, NewAssignment, NewDeny};
use crate::respond;
use crate::state::Shared;
use crate::store::{DenyAssignmentRecord, DirectoryEntry, RoleAssignmentRecord};

fn rfc3339(t: OffsetDateTime) -> Option<String> {
    t.format(&time::format_description::well_known::Rfc3339)
        .ok()
}

/// A role definition as the API shows it.
pub(crate) fn role_view(role: &RoleDefinition, builtin: bool) -> admin::RoleDefinition {
    admin::RoleDefinition {
        built_in: builtin,
        data_actions: role.data_actions.clone(),
        description: role.description.clone(),
        id: role.id.clone(),
        name: role.name.clone(),
        not_data_actions: role.not_data_actions.clone(),
    }
}

/// A role assignment as the API (and an export) shows it.
pub(crate) fn assignment_view(
    a: &RoleAssignmentRecord,
    custom: &[RoleDefinition],
) -> admin::RoleAssignment {
    admin::RoleAssignment {
        cluster: a.cluster.clone(),
        created_at: rfc3339(a.created_at),
        id: a.id.clone(),
        namespace: a.namespace.clone(),
        principal_id: a.principal_id.clone(),
        role_id: a.role_id.clone(),
        role_name: model::find_role(custom, &a.role_id).map(|r| r.name.clone()),
    }
}

/// A deny assignment as the API (and an export) shows it.
pub(crate) fn deny_view(d: &DenyAssignmentRecord) -> admin::DenyAssignment {
    admin::DenyAssignment {
        cluster: d.cluster.clone(),
        created_at: rfc3339(d.created_at),
        data_actions: d.data_actions.clone(),
        exclude_principals: d.exclude_principals.clone(),
        id: d.id.clone(),
        name: d.name.clone(),
        namespace: d.namespace.clone(),
        not_data_actions: d.not_data_actions.clone(),
        principals: d.principals.clone(),
    }
}

fn directory_view(e: DirectoryEntry) -> admin::DirectoryEntry {
    admin::DirectoryEntry {
        groups: e.groups,
        oid: e.oid,
        tid: e.tid,
        updated_at: rfc3339(e.updated_at),
    }
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

/// `%XX` escapes decoded; `None` for a malformed escape (which `percent-encoding` would keep as it is) or bytes
/// that are not UTF-8.
fn percent_decode(s: &str) -> Option<String> {
    let well_formed = s.match_indices('%').all(|(i, _)| {
        s.as_bytes()
            .get(i + 1..i + 3)
            .is_some_and(|hex| hex.iter().all(u8::is_ascii_hexdigit))
    });
    if !well_formed {
        return None;
    }
    percent_encoding::percent_decode_str(s)
        .decode_utf8()
        .ok()
        .map(std::borrow::Cow::into_owned)
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
            Ok(respond::json(StatusCode::CREATED, &role_view(&role, false)))
        }
        (Method::GET, None) => {
            let custom = rbac.custom_roles().await?;
            let items = model::builtin_roles()
                .iter()
                .map(|r| role_view(r, true))
                .chain(custom.iter().map(|r| role_view(r, false)))
                .collect();
            Ok(respond::json(StatusCode::OK, &admin::List { items }))
        }
        (Method::GET, Some(id)) => {
            let role = rbac.role(id).await?;
            Ok(respond::json(
                StatusCode::OK,
                &role_view(&role, rbac::is_builtin(&role.id)),
            ))
        }
        (Method::DELETE, Some(id)) => {
            rbac.delete_role(id).await?;
            Ok(respond::no_content())
        }
        _ => Err(ApiError::method_not_allowed()),
    }
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
            let body: admin::NewRoleAssignment =
                respond::read_json(req.into_body(), body_limit(shared)).await?;
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
                &assignment_view(&record, &custom),
            ))
        }
        (Method::GET, None) => {
            let cluster = cluster_filter(req.uri().query())?;
            let records = rbac.assignments(cluster.as_deref()).await?;
            let custom = rbac.custom_roles().await?;
            let items = records
                .iter()
                .map(|a| assignment_view(a, &custom))
                .collect();
            Ok(respond::json(StatusCode::OK, &admin::List { items }))
        }
        (Method::GET, Some(id)) => {
            let custom = rbac.custom_roles().await?;
            let a = rbac.assignment(id).await?;
            Ok(respond::json(StatusCode::OK, &assignment_view(&a, &custom)))
        }
        (Method::DELETE, Some(id)) => {
            rbac.unassign(id).await?;
            Ok(respond::no_content())
        }
        _ => Err(ApiError::method_not_allowed()),
    }
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
            let body: admin::NewDenyAssignment =
                respond::read_json(req.into_body(), body_limit(shared)).await?;
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
            Ok(respond::json(StatusCode::CREATED, &deny_view(&record)))
        }
        (Method::GET, None) => {
            let cluster = cluster_filter(req.uri().query())?;
            let items = rbac
                .denies(cluster.as_deref())
                .await?
                .iter()
                .map(deny_view)
                .collect();
            Ok(respond::json(StatusCode::OK, &admin::List { items }))
        }
        (Method::GET, Some(id)) => {
            let d = rbac.deny_assignment(id).await?;
            Ok(respond::json(StatusCode::OK, &deny_view(&d)))
        }
        (Method::DELETE, Some(id)) => {
            rbac.undeny(id).await?;
            Ok(respond::no_content())
        }
        _ => Err(ApiError::method_not_allowed()),
    }
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
            let body: admin::SetGroups =
                respond::read_json(req.into_body(), body_limit(shared)).await?;
            let entry = rbac.set_groups(&oid, &body.groups, body.tid).await?;
            Ok(respond::json(StatusCode::OK, &directory_view(entry)))
        }
        Method::GET => {
            let entry = rbac.directory_entry(&oid).await?;
            Ok(respond::json(StatusCode::OK, &directory_view(entry)))
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
