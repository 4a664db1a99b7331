//! Guard's RBAC at the relay: the admin API for role definitions, role assignments, deny assignments and the
//! group directory; each cluster's guard snapshot; and the hub that tells a cluster's control channel when its
//! snapshot changed.
//!
//! Assignments are validated with the guard crate (`find_role`, `RoleDefinition::from_json`, snapshot
//! validation), so what the relay accepts is what guard accepts. Every change to a cluster's assignments raises
//! its snapshot version in the same store transaction; the hub then wakes that cluster's control channel, which
//! reads the snapshot back and pushes it (`guardSnapshot`). The relay never evaluates a decision itself.

use std::collections::HashMap;
use std::sync::Mutex;

use http::{Method, Request, Response, StatusCode};
use hyper::body::Incoming;
use serde::Deserialize;
use serde_json::{Value, json};
use tether_api::control::{self, ControlError, GuardSnapshot, Message};
use tether_auth::rbac::{
    self, DenyAssignment, EVERYONE, RoleAssignment, RoleDefinition, Scope, Snapshot,
};
use time::OffsetDateTime;
use tokio::sync::watch;

use crate::api;
use crate::body::Body;
use crate::error::ApiError;
use crate::server::{self, Shared};
use crate::store::{DenyAssignmentRecord, DirectoryEntry, GuardState, RoleAssignmentRecord, Store};

/// Longest principal id, role reference, role id or deny-assignment name accepted.
const MAX_ID_LEN: usize = 128;
/// Most groups a directory entry may hold.
const MAX_DIRECTORY_GROUPS: usize = 2048;

/// Wakes the control channel of a cluster when its guard snapshot changed.
#[derive(Debug, Default)]
pub(crate) struct GuardHub {
    clusters: Mutex<HashMap<String, watch::Sender<u64>>>,
}

impl GuardHub {
    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, watch::Sender<u64>>> {
        // The map holds no invariant a panicking holder could break half-way.
        self.clusters
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// A receiver that changes whenever `cluster`'s snapshot version moves on.
    pub(crate) fn subscribe(&self, cluster: &str) -> watch::Receiver<u64> {
        self.lock()
            .entry(cluster.to_owned())
            .or_insert_with(|| watch::channel(0).0)
            .subscribe()
    }

    /// `cluster`'s snapshot is now at `version`.
    pub(crate) fn changed(&self, cluster: &str, version: u64) {
        if let Some(tx) = self.lock().get(cluster) {
            tx.send_if_modified(|v| {
                let newer = version > *v;
                if newer {
                    *v = version;
                }
                newer
            });
        }
    }

    /// The cluster is gone.
    pub(crate) fn forget(&self, cluster: &str) {
        self.lock().remove(cluster);
    }
}

/// The guard snapshot made of a cluster's stored state.
pub(crate) fn snapshot(state: GuardState) -> Snapshot {
    let scope = |ns: Option<String>| ns.map_or(Scope::Cluster, Scope::Namespace);
    Snapshot {
        version: state.version,
        roles: state.roles,
        assignments: state
            .assignments
            .into_iter()
            .map(|a| RoleAssignment {
                id: a.id,
                role_id: a.role_id,
                principal_id: a.principal_id,
                scope: scope(a.namespace),
            })
            .collect(),
        deny_assignments: state
            .deny_assignments
            .into_iter()
            .map(|d| DenyAssignment {
                id: d.id,
                name: d.name,
                data_actions: d.data_actions,
                not_data_actions: d.not_data_actions,
                principals: d.principals,
                exclude_principals: d.exclude_principals,
                scope: scope(d.namespace),
            })
            .collect(),
    }
}

/// The control message carrying `snapshot`.
pub(crate) fn snapshot_message(snapshot: &Snapshot) -> Message {
    Message::GuardSnapshot(GuardSnapshot {
        snapshot: snapshot.clone(),
    })
}

/// Refuses a change after which `snapshot` would no longer fit in one control message.
fn check_size(cluster: &str, snapshot: &Snapshot) -> Result<(), ApiError> {
    match control::encode(&snapshot_message(snapshot)) {
        Ok(_) => Ok(()),
        Err(ControlError::TooLarge(len)) => Err(ApiError::conflict(format!(
            "cluster {cluster}'s guard snapshot would be {len} bytes, more than one control message carries ({} \
             bytes): remove assignments, or assign roles to groups instead of many single principals",
            control::MAX_MESSAGE_LEN
        ))),
        Err(e) => Err(ApiError::internal(format!(
            "cannot encode a guard snapshot: {e}"
        ))),
    }
}

/// A random id in the form of a version-4 UUID.
pub(crate) fn new_id() -> String {
    let mut b = [0u8; 16];
    rand::fill(&mut b);
    b[6] = (b[6] & 0x0f) | 0x40;
    b[8] = (b[8] & 0x3f) | 0x80;
    let h = hex::encode(b);
    format!(
        "{}-{}-{}-{}-{}",
        &h[..8],
        &h[8..12],
        &h[12..16],
        &h[16..20],
        &h[20..]
    )
}

fn is_guid(s: &str) -> bool {
    let b = s.as_bytes();
    b.len() == 36
        && b.iter().enumerate().all(|(i, c)| match i {
            8 | 13 | 18 | 23 => *c == b'-',
            _ => c.is_ascii_hexdigit(),
        })
}

/// Checks a principal id and returns it as stored: an object id (GUID, lowercased as Entra writes them in
/// tokens) or another identity provider's id made of letters, digits and `.`, `_`, `-`, `:`. User names
/// (`alice@contoso.com`) and `system:` names are refused: guard matches object ids only, so such an
/// assignment would never apply.
pub(crate) fn principal(id: &str, what: &str) -> Result<String, ApiError> {
    let id = id.trim();
    if is_guid(id) {
        return Ok(id.to_ascii_lowercase());
    }
    let why = if id.is_empty() {
        Some("it is empty")
    } else if id.len() > MAX_ID_LEN {
        Some("it is too long")
    } else if id.contains('@') {
        Some(
            "it looks like a user name; assignments name the user's object id (the token's oid claim)",
        )
    } else if id.starts_with("system:") {
        Some("system: users and groups are left to Kubernetes RBAC")
    } else if !id
        .bytes()
        .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-' | b':'))
    {
        Some("expected an object id (a GUID)")
    } else {
        None
    };
    match why {
        Some(why) => Err(ApiError::invalid(format!("invalid {what} {id:?}: {why}"))),
        None => Ok(id.to_owned()),
    }
}

/// A namespace: a DNS-1123 label.
fn namespace(ns: Option<String>) -> Result<Option<String>, ApiError> {
    match ns {
        None => Ok(None),
        Some(ns) if crate::auth::valid_cluster_name(&ns) => Ok(Some(ns)),
        Some(ns) => Err(ApiError::invalid(format!(
            "invalid namespace {ns:?}: must be a DNS-1123 label"
        ))),
    }
}

/// A cluster named in a request body that must exist.
async fn existing_cluster(shared: &Shared, name: &str) -> Result<(), ApiError> {
    if !crate::auth::valid_cluster_name(name) || shared.store.cluster(name).await?.is_none() {
        return Err(ApiError::cluster_not_found(name));
    }
    Ok(())
}

/// Builds `cluster`'s snapshot as it would be after `change`, and refuses the change if it would not fit.
async fn check_change(
    shared: &Shared,
    cluster: &str,
    change: impl FnOnce(&mut Snapshot),
) -> Result<(), ApiError> {
    let state = shared
        .store
        .guard_state(cluster)
        .await?
        .ok_or_else(|| ApiError::cluster_not_found(cluster))?;
    let mut snap = snapshot(state);
    change(&mut snap);
    check_size(cluster, &snap)
}

fn rfc3339(t: OffsetDateTime) -> Value {
    t.format(&time::format_description::well_known::Rfc3339)
        .map_or(Value::Null, Value::String)
}

fn role_json(role: &RoleDefinition, builtin: bool) -> Value {
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
        "roleName": rbac::find_role(custom, &a.role_id).map(|r| r.name.as_str()),
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

fn no_content() -> Response<Body> {
    let mut resp = Response::new(crate::body::empty());
    *resp.status_mut() = StatusCode::NO_CONTENT;
    resp
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

// ---- role definitions ----

/// `/api/v1/roledefinitions[/ID]`.
pub(crate) async fn role_definitions(
    shared: &Shared,
    req: Request<Incoming>,
    rest: Option<&str>,
) -> Result<Response<Body>, ApiError> {
    api::require_admin(shared, req.headers())?;
    let id = item("roledefinitions", rest)?;
    match (req.method().clone(), id.as_deref()) {
        (Method::POST, None) => create_role(shared, req).await,
        (Method::GET, None) => {
            let custom = shared.store.role_definitions().await?;
            let items: Vec<Value> = rbac::builtin_roles()
                .iter()
                .map(|r| role_json(r, true))
                .chain(custom.iter().map(|r| role_json(r, false)))
                .collect();
            Ok(server::json(StatusCode::OK, &json!({ "items": items })))
        }
        (Method::GET, Some(id)) => {
            let custom = shared.store.role_definitions().await?;
            match rbac::find_role(&custom, id) {
                Some(role) => Ok(server::json(
                    StatusCode::OK,
                    &role_json(role, is_builtin(&role.id)),
                )),
                None => Err(ApiError::not_found(format!(
                    "roledefinitions \"{id}\" not found"
                ))),
            }
        }
        (Method::DELETE, Some(id)) => {
            if let Some(builtin) = rbac::find_role(&[], id) {
                return Err(ApiError::conflict(format!(
                    "{:?} is a built-in role: built-in roles cannot be deleted",
                    builtin.name
                )));
            }
            if !shared.store.delete_role_definition(id).await? {
                return Err(ApiError::not_found(format!(
                    "roledefinitions \"{id}\" not found"
                )));
            }
            tracing::info!(role = id, "role definition deleted");
            Ok(no_content())
        }
        _ => Err(ApiError::method_not_allowed()),
    }
}

fn is_builtin(id: &str) -> bool {
    rbac::builtin_roles()
        .iter()
        .any(|r| r.id.eq_ignore_ascii_case(id))
}

/// Role ids end up in URLs and JSON: 1–128 letters, digits, `.`, `_`, `-`.
fn valid_role_id(id: &str) -> bool {
    !id.is_empty()
        && id.len() <= MAX_ID_LEN
        && id
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'))
}

/// Parses and checks a custom role definition (any JSON form guard accepts).
fn parse_role(text: &str) -> Result<RoleDefinition, ApiError> {
    let role = RoleDefinition::from_json(text).map_err(|e| ApiError::invalid(e.to_string()))?;
    if !valid_role_id(&role.id) {
        return Err(ApiError::invalid(format!(
            "invalid role id {:?}: 1 to {MAX_ID_LEN} letters, digits, '.', '_' or '-'",
            role.id
        )));
    }
    if role.name.len() > 256 || role.name.chars().any(char::is_control) {
        return Err(ApiError::invalid(
            "invalid role name: at most 256 printable characters",
        ));
    }
    for key in [&role.id, &role.name] {
        if let Some(builtin) = rbac::find_role(&[], key) {
            return Err(ApiError::conflict(format!(
                "{key:?} names the built-in role {:?}: built-in roles cannot be replaced",
                builtin.name
            )));
        }
    }
    Ok(role)
}

async fn create_role(shared: &Shared, req: Request<Incoming>) -> Result<Response<Body>, ApiError> {
    let body = server::read_body(shared, req.into_body()).await?;
    let text = std::str::from_utf8(&body)
        .map_err(|_| ApiError::bad_request("the role definition is not UTF-8"))?;
    let role = parse_role(text)?;
    shared
        .store
        .create_role_definition(&role, OffsetDateTime::now_utc())
        .await?;
    tracing::info!(role = %role.id, "role definition created");
    Ok(server::json(StatusCode::CREATED, &role_json(&role, false)))
}

// ---- role assignments ----

#[derive(Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct NewAssignment {
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
    api::require_admin(shared, req.headers())?;
    let id = item("roleassignments", rest)?;
    match (req.method().clone(), id.as_deref()) {
        (Method::POST, None) => assign(shared, req).await,
        (Method::GET, None) => {
            let cluster = cluster_filter(req.uri().query())?;
            if let Some(c) = &cluster {
                existing_cluster(shared, c).await?;
            }
            let custom = shared.store.role_definitions().await?;
            let items: Vec<Value> = shared
                .store
                .role_assignments(cluster.as_deref())
                .await?
                .iter()
                .map(|a| assignment_json(a, &custom))
                .collect();
            Ok(server::json(StatusCode::OK, &json!({ "items": items })))
        }
        (Method::GET, Some(id)) => {
            let custom = shared.store.role_definitions().await?;
            let found = shared
                .store
                .role_assignments(None)
                .await?
                .into_iter()
                .find(|a| a.id == id);
            match found {
                Some(a) => Ok(server::json(StatusCode::OK, &assignment_json(&a, &custom))),
                None => Err(ApiError::not_found(format!(
                    "roleassignments \"{id}\" not found"
                ))),
            }
        }
        (Method::DELETE, Some(id)) => match shared.store.delete_role_assignment(id).await? {
            Some((cluster, version)) => {
                tracing::info!(assignment = id, cluster, version, "role assignment deleted");
                shared.guard.changed(&cluster, version);
                Ok(no_content())
            }
            None => Err(ApiError::not_found(format!(
                "roleassignments \"{id}\" not found"
            ))),
        },
        _ => Err(ApiError::method_not_allowed()),
    }
}

async fn assign(shared: &Shared, req: Request<Incoming>) -> Result<Response<Body>, ApiError> {
    let body: NewAssignment = server::read_json(shared, req.into_body()).await?;
    let principal_id = principal(&body.principal_id, "principalId")?;
    let namespace = namespace(body.namespace)?;
    existing_cluster(shared, &body.cluster).await?;
    let custom = shared.store.role_definitions().await?;
    let role = rbac::find_role(&custom, &body.role).ok_or_else(|| {
        ApiError::not_found(format!(
            "role {:?} not found: name a custom role (tether role define) or one of Viewer, Writer, Admin, \
             Cluster Admin",
            body.role
        ))
    })?;
    let record = RoleAssignmentRecord {
        id: new_id(),
        role_id: role.id.clone(),
        principal_id,
        cluster: body.cluster,
        namespace,
        created_at: OffsetDateTime::now_utc(),
    };
    let role_for_size = (!is_builtin(&role.id)).then(|| role.clone());
    check_change(shared, &record.cluster, |s| {
        if let Some(role) = role_for_size
            && !s.roles.iter().any(|r| r.id == role.id)
        {
            s.roles.push(role);
        }
        s.assignments.push(RoleAssignment {
            id: record.id.clone(),
            role_id: record.role_id.clone(),
            principal_id: record.principal_id.clone(),
            scope: record
                .namespace
                .clone()
                .map_or(Scope::Cluster, Scope::Namespace),
        });
    })
    .await?;
    let version = shared.store.create_role_assignment(&record).await?;
    tracing::info!(
        assignment = %record.id,
        cluster = %record.cluster,
        role = %record.role_id,
        version,
        "role assigned"
    );
    shared.guard.changed(&record.cluster, version);
    Ok(server::json(
        StatusCode::CREATED,
        &assignment_json(&record, &custom),
    ))
}

// ---- deny assignments ----

#[derive(Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct NewDeny {
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

/// Checks a deny assignment's fields with guard's rules; returns the principals as stored.
fn check_deny(d: &DenyAssignmentRecord) -> Result<(Vec<String>, Vec<String>), ApiError> {
    if d.name.len() > 256 || d.name.chars().any(char::is_control) {
        return Err(ApiError::invalid(
            "invalid deny assignment name: at most 256 printable characters",
        ));
    }
    let principals = d
        .principals
        .iter()
        .map(|p| match p.trim() {
            "*" => Ok("*".to_owned()),
            p if p == EVERYONE => Ok(EVERYONE.to_owned()),
            p => principal(p, "principal"),
        })
        .collect::<Result<Vec<_>, _>>()?;
    let excluded = d
        .exclude_principals
        .iter()
        .map(|p| principal(p, "excluded principal"))
        .collect::<Result<Vec<_>, _>>()?;
    let probe = Snapshot {
        deny_assignments: vec![DenyAssignment {
            id: d.id.clone(),
            name: d.name.clone(),
            data_actions: d.data_actions.clone(),
            not_data_actions: d.not_data_actions.clone(),
            principals: principals.clone(),
            exclude_principals: excluded.clone(),
            scope: Scope::Cluster,
        }],
        ..Snapshot::default()
    };
    probe
        .validate()
        .map_err(|e| ApiError::invalid(e.to_string()))?;
    Ok((principals, excluded))
}

/// `/api/v1/denyassignments[/ID]`.
pub(crate) async fn deny_assignments(
    shared: &Shared,
    req: Request<Incoming>,
    rest: Option<&str>,
) -> Result<Response<Body>, ApiError> {
    api::require_admin(shared, req.headers())?;
    let id = item("denyassignments", rest)?;
    match (req.method().clone(), id.as_deref()) {
        (Method::POST, None) => deny(shared, req).await,
        (Method::GET, None) => {
            let cluster = cluster_filter(req.uri().query())?;
            if let Some(c) = &cluster {
                existing_cluster(shared, c).await?;
            }
            let items: Vec<Value> = shared
                .store
                .deny_assignments(cluster.as_deref())
                .await?
                .iter()
                .map(deny_json)
                .collect();
            Ok(server::json(StatusCode::OK, &json!({ "items": items })))
        }
        (Method::GET, Some(id)) => {
            let found = shared
                .store
                .deny_assignments(None)
                .await?
                .into_iter()
                .find(|d| d.id == id);
            match found {
                Some(d) => Ok(server::json(StatusCode::OK, &deny_json(&d))),
                None => Err(ApiError::not_found(format!(
                    "denyassignments \"{id}\" not found"
                ))),
            }
        }
        (Method::DELETE, Some(id)) => match shared.store.delete_deny_assignment(id).await? {
            Some((cluster, version)) => {
                tracing::info!(deny = id, cluster, version, "deny assignment deleted");
                shared.guard.changed(&cluster, version);
                Ok(no_content())
            }
            None => Err(ApiError::not_found(format!(
                "denyassignments \"{id}\" not found"
            ))),
        },
        _ => Err(ApiError::method_not_allowed()),
    }
}

async fn deny(shared: &Shared, req: Request<Incoming>) -> Result<Response<Body>, ApiError> {
    let body: NewDeny = server::read_json(shared, req.into_body()).await?;
    let mut record = DenyAssignmentRecord {
        id: new_id(),
        name: body.name.trim().to_owned(),
        data_actions: body.data_actions,
        not_data_actions: body.not_data_actions,
        principals: body.principals,
        exclude_principals: body.exclude_principals,
        cluster: body.cluster,
        namespace: namespace(body.namespace)?,
        created_at: OffsetDateTime::now_utc(),
    };
    let (principals, excluded) = check_deny(&record)?;
    record.principals = principals;
    record.exclude_principals = excluded;
    existing_cluster(shared, &record.cluster).await?;
    check_change(shared, &record.cluster, |s| {
        s.deny_assignments.push(DenyAssignment {
            id: record.id.clone(),
            name: record.name.clone(),
            data_actions: record.data_actions.clone(),
            not_data_actions: record.not_data_actions.clone(),
            principals: record.principals.clone(),
            exclude_principals: record.exclude_principals.clone(),
            scope: record
                .namespace
                .clone()
                .map_or(Scope::Cluster, Scope::Namespace),
        });
    })
    .await?;
    let version = shared.store.create_deny_assignment(&record).await?;
    tracing::info!(deny = %record.id, cluster = %record.cluster, version, "deny assignment created");
    shared.guard.changed(&record.cluster, version);
    Ok(server::json(StatusCode::CREATED, &deny_json(&record)))
}

// ---- export / import ----

/// What an export carries besides the cluster's registration: its assignments and the custom roles they use.
pub(crate) async fn export(
    shared: &Shared,
    cluster: &str,
) -> Result<(Value, Value, Value), ApiError> {
    let state = shared
        .store
        .guard_state(cluster)
        .await?
        .ok_or_else(|| ApiError::cluster_not_found(cluster))?;
    let assignments: Vec<Value> = state
        .assignments
        .iter()
        .map(|a| assignment_json(a, &state.roles))
        .collect();
    let denies: Vec<Value> = state.deny_assignments.iter().map(deny_json).collect();
    let roles: Vec<Value> = state.roles.iter().map(|r| role_json(r, false)).collect();
    Ok((json!(assignments), json!(denies), json!(roles)))
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct ImportedAssignment {
    role_id: String,
    principal_id: String,
    #[serde(default)]
    namespace: Option<String>,
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct ImportedDeny {
    #[serde(default)]
    name: String,
    data_actions: Vec<String>,
    #[serde(default)]
    not_data_actions: Vec<String>,
    principals: Vec<String>,
    #[serde(default)]
    exclude_principals: Vec<String>,
    #[serde(default)]
    namespace: Option<String>,
}

/// An import's guard part, checked and ready for [`Store::import_cluster`].
pub(crate) struct Imported {
    pub(crate) roles: Vec<RoleDefinition>,
    pub(crate) assignments: Vec<RoleAssignmentRecord>,
    pub(crate) denies: Vec<DenyAssignmentRecord>,
}

/// Checks the role definitions and assignments of an export document for `cluster`: the roles must be new here
/// or identical to the ones here, the assignments valid, and the snapshot small enough. New ids are given.
pub(crate) async fn prepare_import(
    store: &dyn Store,
    cluster: &str,
    roles: &[Value],
    assignments: &[Value],
    denies: &[Value],
) -> Result<Imported, ApiError> {
    let existing = store.role_definitions().await?;
    let mut new_roles = Vec::new();
    for value in roles {
        let role = parse_role(&value.to_string())?;
        let same_id = existing
            .iter()
            .find(|r| r.id.eq_ignore_ascii_case(&role.id));
        let same_name = existing
            .iter()
            .find(|r| r.name.eq_ignore_ascii_case(&role.name));
        match (same_id, same_name) {
            (Some(here), _) if roles_match(here, &role) => {}
            (None, None) => new_roles.push(role),
            _ => {
                return Err(ApiError::conflict(format!(
                    "role definition {:?} ({:?}) differs from the one this relay holds under that id or name",
                    role.id, role.name
                )));
            }
        }
    }
    let known: Vec<RoleDefinition> = existing.iter().chain(&new_roles).cloned().collect();
    let now = OffsetDateTime::now_utc();
    let mut records = Vec::new();
    for value in assignments {
        let a: ImportedAssignment = serde_json::from_value(value.clone()).map_err(|e| {
            ApiError::invalid(format!("invalid role assignment in the export: {e}"))
        })?;
        let role = rbac::find_role(&known, &a.role_id).ok_or_else(|| {
            ApiError::invalid(format!(
                "role assignment names role {:?}, which is neither built in, defined here, nor in the export",
                a.role_id
            ))
        })?;
        records.push(RoleAssignmentRecord {
            id: new_id(),
            role_id: role.id.clone(),
            principal_id: principal(&a.principal_id, "principalId")?,
            cluster: cluster.to_owned(),
            namespace: namespace(a.namespace)?,
            created_at: now,
        });
    }
    let mut deny_records = Vec::new();
    for value in denies {
        let d: ImportedDeny = serde_json::from_value(value.clone()).map_err(|e| {
            ApiError::invalid(format!("invalid deny assignment in the export: {e}"))
        })?;
        let mut record = DenyAssignmentRecord {
            id: new_id(),
            name: d.name,
            data_actions: d.data_actions,
            not_data_actions: d.not_data_actions,
            principals: d.principals,
            exclude_principals: d.exclude_principals,
            cluster: cluster.to_owned(),
            namespace: namespace(d.namespace)?,
            created_at: now,
        };
        let (principals, excluded) = check_deny(&record)?;
        record.principals = principals;
        record.exclude_principals = excluded;
        deny_records.push(record);
    }
    let used: Vec<RoleDefinition> = known
        .iter()
        .filter(|r| records.iter().any(|a| a.role_id == r.id))
        .cloned()
        .collect();
    let snap = snapshot(GuardState {
        version: 1,
        roles: used,
        assignments: records.clone(),
        deny_assignments: deny_records.clone(),
    });
    snap.validate()
        .map_err(|e| ApiError::invalid(e.to_string()))?;
    check_size(cluster, &snap)?;
    Ok(Imported {
        roles: new_roles,
        assignments: records,
        denies: deny_records,
    })
}

fn roles_match(a: &RoleDefinition, b: &RoleDefinition) -> bool {
    let sorted = |v: &[String]| {
        let mut v: Vec<String> = v.iter().map(|s| s.to_ascii_lowercase()).collect();
        v.sort();
        v
    };
    a.name.eq_ignore_ascii_case(&b.name)
        && sorted(&a.data_actions) == sorted(&b.data_actions)
        && sorted(&a.not_data_actions) == sorted(&b.not_data_actions)
}

// ---- directory ----

#[derive(Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct SetGroups {
    groups: Vec<String>,
    #[serde(default)]
    tid: Option<String>,
}

fn directory_json(e: &DirectoryEntry) -> Value {
    json!({
        "oid": e.oid,
        "tid": e.tid,
        "groups": e.groups,
        "updatedAt": rfc3339(e.updated_at),
    })
}

/// `/api/v1/directory/users/OID`: the groups of users whose tokens carry a group overage.
pub(crate) async fn directory(
    shared: &Shared,
    req: Request<Incoming>,
    oid: &str,
) -> Result<Response<Body>, ApiError> {
    api::require_admin(shared, req.headers())?;
    let Some(oid) = item("directory/users", Some(oid))? else {
        return Err(ApiError::method_not_allowed());
    };
    let oid = principal(&oid, "object id")?;
    match req.method().clone() {
        Method::PUT => {
            let body: SetGroups = server::read_json(shared, req.into_body()).await?;
            if body.groups.len() > MAX_DIRECTORY_GROUPS {
                return Err(ApiError::invalid(format!(
                    "at most {MAX_DIRECTORY_GROUPS} groups per user"
                )));
            }
            let mut groups = body
                .groups
                .iter()
                .map(|g| principal(g, "group id"))
                .collect::<Result<Vec<_>, _>>()?;
            groups.sort();
            groups.dedup();
            let tid = match body.tid.map(|t| t.trim().to_owned()) {
                Some(t) if t.is_empty() => None,
                Some(t)
                    if t.len() <= MAX_ID_LEN
                        && t.bytes()
                            .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'.') =>
                {
                    Some(t)
                }
                Some(t) => return Err(ApiError::invalid(format!("invalid tenant id {t:?}"))),
                None => None,
            };
            let entry = DirectoryEntry {
                oid,
                tid,
                groups,
                updated_at: OffsetDateTime::now_utc(),
            };
            shared.store.set_directory_entry(&entry).await?;
            tracing::info!(oid = %entry.oid, groups = entry.groups.len(), "directory entry set");
            Ok(server::json(StatusCode::OK, &directory_json(&entry)))
        }
        Method::GET => match shared.store.directory_entry(&oid).await? {
            Some(e) => Ok(server::json(StatusCode::OK, &directory_json(&e))),
            None => Err(ApiError::not_found(format!(
                "users \"{oid}\" not found in the directory"
            ))),
        },
        Method::DELETE => {
            if !shared.store.delete_directory_entry(&oid).await? {
                return Err(ApiError::not_found(format!(
                    "users \"{oid}\" not found in the directory"
                )));
            }
            Ok(no_content())
        }
        _ => Err(ApiError::method_not_allowed()),
    }
}

/// The groups of `oid` in tenant `tid` from the directory; the error text is shown to the user.
pub(crate) async fn resolve_groups(
    store: &dyn Store,
    tid: &str,
    oid: &str,
) -> Result<Vec<String>, String> {
    let not_found = || "the user is not in the relay's directory".to_owned();
    let Ok(oid) = principal(oid, "object id") else {
        return Err(not_found());
    };
    match store.directory_entry(&oid).await {
        Ok(Some(entry)) if entry.tid.as_deref().is_none_or(|t| t == tid) => Ok(entry.groups),
        Ok(_) => Err(not_found()),
        Err(e) => {
            tracing::warn!(error = %e, "cannot read the directory");
            Err("the relay's directory is unavailable".to_owned())
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_are_random_v4_uuids() {
        let a = new_id();
        assert!(is_guid(&a), "{a}");
        assert_eq!(&a[14..15], "4");
        assert!(matches!(&a[19..20], "8" | "9" | "a" | "b"), "{a}");
        assert_ne!(a, new_id());
    }

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

    #[test]
    fn principals() {
        assert_eq!(
            principal(" 0F1E2D3C-0000-4000-8000-00000000000A ", "p")
                .ok()
                .as_deref(),
            Some("0f1e2d3c-0000-4000-8000-00000000000a")
        );
        assert_eq!(principal("sre-team", "p").ok().as_deref(), Some("sre-team"));
        for bad in [
            "",
            "alice@contoso.com",
            "system:masters",
            "has space",
            "a/b",
            &"x".repeat(129),
        ] {
            assert!(principal(bad, "p").is_err(), "{bad:?}");
        }
    }

    #[test]
    fn hub_wakes_subscribers_only_for_newer_versions() {
        let hub = GuardHub::default();
        hub.changed("a", 5); // no subscriber: nothing kept
        let mut rx = hub.subscribe("a");
        assert!(!rx.has_changed().unwrap_or(true));
        hub.changed("a", 7);
        assert!(rx.has_changed().unwrap_or(false));
        assert_eq!(*rx.borrow_and_update(), 7);
        hub.changed("a", 6);
        assert!(!rx.has_changed().unwrap_or(true));
        hub.changed("b", 9);
        assert!(!rx.has_changed().unwrap_or(true));
        hub.forget("a");
        assert!(rx.has_changed().is_err(), "the sender is gone");
    }

    #[test]
    fn snapshots_from_state_validate_and_carry_scopes() {
        let at = OffsetDateTime::UNIX_EPOCH;
        let state = GuardState {
            version: 9,
            roles: vec![],
            assignments: vec![RoleAssignmentRecord {
                id: "a".into(),
                role_id: "63f0a09d-1495-4db4-a681-037d84835eb4".into(),
                principal_id: "p".into(),
                cluster: "c".into(),
                namespace: Some("dev".into()),
                created_at: at,
            }],
            deny_assignments: vec![DenyAssignmentRecord {
                id: "d".into(),
                name: "n".into(),
                data_actions: vec!["Microsoft.Kubernetes/connectedClusters/*".into()],
                not_data_actions: vec![],
                principals: vec!["*".into()],
                exclude_principals: vec![],
                cluster: "c".into(),
                namespace: None,
                created_at: at,
            }],
        };
        let snap = snapshot(state);
        assert!(snap.validate().is_ok());
        assert_eq!(snap.assignments[0].scope, Scope::Namespace("dev".into()));
        assert_eq!(snap.deny_assignments[0].scope, Scope::Cluster);
        let big = Snapshot {
            assignments: (0..20_000)
                .map(|i| RoleAssignment {
                    id: format!("{i:036}"),
                    role_id: "63f0a09d-1495-4db4-a681-037d84835eb4".into(),
                    principal_id: format!("{i:036}"),
                    scope: Scope::Cluster,
                })
                .collect(),
            ..Snapshot::default()
        };
        assert!(check_size("c", &snap).is_ok());
        assert!(check_size("c", &big).is_err());
    }
}
