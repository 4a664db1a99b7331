//! Guard's RBAC at the relay, as a domain service: role definitions, role assignments, deny assignments and the
//! group directory; each cluster's guard snapshot and the checks that keep it valid and small enough for one
//! control message.
//!
//! Assignments are validated with the auth crate (`find_role`, `RoleDefinition::from_json`, snapshot
//! validation), so what the relay accepts is what guard accepts. Every change to a cluster's assignments raises
//! its snapshot version in the same store transaction; the [`GuardHub`] then wakes that cluster's control
//! channel, which reads the snapshot back and pushes it (`guardSnapshot`). The relay never evaluates a decision
//! itself.
//!
//! It knows nothing of HTTP: it returns [`RbacError`], which the handlers turn into a Kubernetes `Status`.

use tether_api::control::{self, ControlError, GuardSnapshot, Message};
use tether_auth::rbac::{
    self, DenyAssignment, EVERYONE, RoleAssignment, RoleDefinition, Scope, Snapshot,
};
use time::OffsetDateTime;

use crate::auth::valid_cluster_name;
use crate::guard_hub::GuardHub;
use crate::store::{
    DenyAssignmentRecord, DirectoryEntry, GuardState, RoleAssignmentRecord, Store, StoreError,
};

/// Longest principal id, role reference, role id or deny-assignment name accepted.
const MAX_ID_LEN: usize = 128;
/// Most groups a directory entry may hold.
pub(crate) const MAX_DIRECTORY_GROUPS: usize = 2048;

/// Why an RBAC operation was refused or failed.
#[derive(Debug, thiserror::Error)]
pub(crate) enum RbacError {
    /// The input breaks a rule (a malformed id, an unknown role in an import, an invalid snapshot).
    #[error("{0}")]
    Invalid(String),
    /// The change conflicts with what the relay holds (a built-in role, a snapshot too large, a differing role).
    #[error("{0}")]
    Conflict(String),
    /// The named role, assignment or directory entry does not exist.
    #[error("{0}")]
    NotFound(String),
    /// The named cluster does not exist.
    #[error("clusters \"{0}\" not found")]
    ClusterNotFound(String),
    /// The store failed.
    #[error(transparent)]
    Store(#[from] StoreError),
    /// A snapshot could not be encoded for reasons other than its size (a bug).
    #[error("cannot encode a guard snapshot: {0}")]
    Encode(#[source] ControlError),
}

/// The guard snapshot made of a cluster's stored state.
pub(crate) fn snapshot(state: GuardState) -> Snapshot {
    Snapshot {
        version: state.version,
        roles: state.roles,
        assignments: state.assignments.iter().map(assignment_rule).collect(),
        deny_assignments: state.deny_assignments.iter().map(deny_rule).collect(),
    }
}

fn scope(namespace: &Option<String>) -> Scope {
    namespace.clone().map_or(Scope::Cluster, Scope::Namespace)
}

/// The snapshot form of a stored role assignment.
fn assignment_rule(a: &RoleAssignmentRecord) -> RoleAssignment {
    RoleAssignment {
        id: a.id.clone(),
        role_id: a.role_id.clone(),
        principal_id: a.principal_id.clone(),
        scope: scope(&a.namespace),
    }
}

/// The snapshot form of a stored deny assignment.
fn deny_rule(d: &DenyAssignmentRecord) -> DenyAssignment {
    DenyAssignment {
        id: d.id.clone(),
        name: d.name.clone(),
        data_actions: d.data_actions.clone(),
        not_data_actions: d.not_data_actions.clone(),
        principals: d.principals.clone(),
        exclude_principals: d.exclude_principals.clone(),
        scope: scope(&d.namespace),
    }
}

/// The control message carrying `snapshot`.
pub(crate) fn snapshot_message(snapshot: &Snapshot) -> Message {
    Message::GuardSnapshot(GuardSnapshot {
        snapshot: snapshot.clone(),
    })
}

/// Refuses a change after which `snapshot` would no longer fit in one control message.
fn check_size(cluster: &str, snapshot: &Snapshot) -> Result<(), RbacError> {
    match control::encode(&snapshot_message(snapshot)) {
        Ok(_) => Ok(()),
        Err(ControlError::TooLarge(len)) => Err(RbacError::Conflict(format!(
            "cluster {cluster}'s guard snapshot would be {len} bytes, more than one control message carries ({} \
             bytes): remove assignments, or assign roles to groups instead of many single principals",
            control::MAX_MESSAGE_LEN
        ))),
        Err(e) => Err(RbacError::Encode(e)),
    }
}

/// A random version-4 UUID (the thread's CSPRNG), hyphenated and lowercase.
pub(crate) fn new_id() -> String {
    let mut bytes = [0u8; 16];
    rand::fill(&mut bytes);
    uuid::Builder::from_random_bytes(bytes)
        .into_uuid()
        .hyphenated()
        .to_string()
}

/// An object id: a GUID in its hyphenated form (36 characters, any case).
fn is_guid(s: &str) -> bool {
    s.len() == 36 && uuid::Uuid::try_parse(s).is_ok()
}

/// Checks a principal id and returns it as stored: an object id (GUID, lowercased as Entra writes them in
/// tokens) or another identity provider's id made of letters, digits and `.`, `_`, `-`, `:`. User names
/// (`alice@contoso.com`) and `system:` names are refused: guard matches object ids only, so such an
/// assignment would never apply.
pub(crate) fn principal(id: &str, what: &str) -> Result<String, RbacError> {
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
        Some(why) => Err(RbacError::Invalid(format!("invalid {what} {id:?}: {why}"))),
        None => Ok(id.to_owned()),
    }
}

/// A namespace: a DNS-1123 label.
fn namespace(ns: Option<String>) -> Result<Option<String>, RbacError> {
    match ns {
        None => Ok(None),
        Some(ns) if valid_cluster_name(&ns) => Ok(Some(ns)),
        Some(ns) => Err(RbacError::Invalid(format!(
            "invalid namespace {ns:?}: must be a DNS-1123 label"
        ))),
    }
}

/// Whether `id` names a built-in role (by id).
pub(crate) fn is_builtin(id: &str) -> bool {
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
fn parse_role(text: &str) -> Result<RoleDefinition, RbacError> {
    let role = RoleDefinition::from_json(text).map_err(|e| RbacError::Invalid(e.to_string()))?;
    if !valid_role_id(&role.id) {
        return Err(RbacError::Invalid(format!(
            "invalid role id {:?}: 1 to {MAX_ID_LEN} letters, digits, '.', '_' or '-'",
            role.id
        )));
    }
    if role.name.len() > 256 || role.name.chars().any(char::is_control) {
        return Err(RbacError::Invalid(
            "invalid role name: at most 256 printable characters".into(),
        ));
    }
    for key in [&role.id, &role.name] {
        if let Some(builtin) = rbac::find_role(&[], key) {
            return Err(RbacError::Conflict(format!(
                "{key:?} names the built-in role {:?}: built-in roles cannot be replaced",
                builtin.name
            )));
        }
    }
    Ok(role)
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

/// Checks a deny assignment's fields with guard's rules and stores its principals in their stored form.
fn check_deny(d: &mut DenyAssignmentRecord) -> Result<(), RbacError> {
    if d.name.len() > 256 || d.name.chars().any(char::is_control) {
        return Err(RbacError::Invalid(
            "invalid deny assignment name: at most 256 printable characters".into(),
        ));
    }
    d.principals = d
        .principals
        .iter()
        .map(|p| match p.trim() {
            "*" => Ok("*".to_owned()),
            p if p == EVERYONE => Ok(EVERYONE.to_owned()),
            p => principal(p, "principal"),
        })
        .collect::<Result<Vec<_>, _>>()?;
    d.exclude_principals = d
        .exclude_principals
        .iter()
        .map(|p| principal(p, "excluded principal"))
        .collect::<Result<Vec<_>, _>>()?;
    let probe = Snapshot {
        deny_assignments: vec![DenyAssignment {
            scope: Scope::Cluster,
            ..deny_rule(d)
        }],
        ..Snapshot::default()
    };
    probe
        .validate()
        .map_err(|e| RbacError::Invalid(e.to_string()))
}

/// A new role assignment as requested: the role by id or name, the principal, the cluster and an optional
/// namespace.
pub(crate) struct NewAssignment {
    /// Role id or name.
    pub(crate) role: String,
    /// The principal's object id.
    pub(crate) principal_id: String,
    /// The cluster it applies to.
    pub(crate) cluster: String,
    /// The namespace it is limited to, if any.
    pub(crate) namespace: Option<String>,
}

/// A new deny assignment as requested.
pub(crate) struct NewDeny {
    /// A name for people.
    pub(crate) name: String,
    /// Denied data actions.
    pub(crate) data_actions: Vec<String>,
    /// Data actions taken out of `data_actions`.
    pub(crate) not_data_actions: Vec<String>,
    /// Denied principals (`*` or [`EVERYONE`] for all).
    pub(crate) principals: Vec<String>,
    /// Principals the deny does not apply to.
    pub(crate) exclude_principals: Vec<String>,
    /// The cluster it applies to.
    pub(crate) cluster: String,
    /// The namespace it is limited to, if any.
    pub(crate) namespace: Option<String>,
}

/// A cluster's guard state as an export carries it: assignments, deny assignments and the custom roles used.
pub(crate) type Export = GuardState;

/// An import's guard part, checked and ready for [`Store::import_cluster`].
pub(crate) struct Imported {
    /// Custom roles new to this relay.
    pub(crate) roles: Vec<RoleDefinition>,
    /// The role assignments, with new ids.
    pub(crate) assignments: Vec<RoleAssignmentRecord>,
    /// The deny assignments, with new ids.
    pub(crate) denies: Vec<DenyAssignmentRecord>,
}

/// The guard part of an export document, as read (before any check).
pub(crate) struct ImportRequest {
    /// Role definitions, each in any JSON form guard accepts.
    pub(crate) roles: Vec<String>,
    /// Role assignments: role id, principal id, namespace.
    pub(crate) assignments: Vec<(String, String, Option<String>)>,
    /// Deny assignments (their `cluster` is ignored: the import's name is used).
    pub(crate) denies: Vec<NewDeny>,
}

/// The RBAC operations, over a store and the hub that wakes control channels.
pub(crate) struct Rbac<'a> {
    /// Where RBAC state lives.
    pub(crate) store: &'a dyn Store,
    /// Told about every snapshot version change.
    pub(crate) hub: &'a GuardHub,
}

impl Rbac<'_> {
    /// A cluster named in a request body that must exist.
    async fn existing_cluster(&self, name: &str) -> Result<(), RbacError> {
        if !valid_cluster_name(name) || self.store.cluster(name).await?.is_none() {
            return Err(RbacError::ClusterNotFound(name.to_owned()));
        }
        Ok(())
    }

    /// Builds `cluster`'s snapshot as it would be after `change`, and refuses the change if it would not fit.
    async fn check_change(
        &self,
        cluster: &str,
        change: impl FnOnce(&mut Snapshot),
    ) -> Result<(), RbacError> {
        let state = self
            .store
            .guard_state(cluster)
            .await?
            .ok_or_else(|| RbacError::ClusterNotFound(cluster.to_owned()))?;
        let mut snap = snapshot(state);
        change(&mut snap);
        check_size(cluster, &snap)
    }

    /// The custom role definitions.
    pub(crate) async fn custom_roles(&self) -> Result<Vec<RoleDefinition>, RbacError> {
        Ok(self.store.role_definitions().await?)
    }

    /// A role, built in or custom, by id or name.
    pub(crate) async fn role(&self, id: &str) -> Result<RoleDefinition, RbacError> {
        let custom = self.store.role_definitions().await?;
        rbac::find_role(&custom, id)
            .cloned()
            .ok_or_else(|| RbacError::NotFound(format!("roledefinitions \"{id}\" not found")))
    }

    /// Defines a custom role from its JSON text.
    pub(crate) async fn create_role(&self, text: &str) -> Result<RoleDefinition, RbacError> {
        let role = parse_role(text)?;
        self.store
            .create_role_definition(&role, OffsetDateTime::now_utc())
            .await?;
        tracing::info!(role = %role.id, "role definition created");
        Ok(role)
    }

    /// Deletes a custom role (built-in ones cannot be).
    pub(crate) async fn delete_role(&self, id: &str) -> Result<(), RbacError> {
        if let Some(builtin) = rbac::find_role(&[], id) {
            return Err(RbacError::Conflict(format!(
                "{:?} is a built-in role: built-in roles cannot be deleted",
                builtin.name
            )));
        }
        if !self.store.delete_role_definition(id).await? {
            return Err(RbacError::NotFound(format!(
                "roledefinitions \"{id}\" not found"
            )));
        }
        tracing::info!(role = id, "role definition deleted");
        Ok(())
    }

    /// The role assignments, of one cluster (which must exist) or all.
    pub(crate) async fn assignments(
        &self,
        cluster: Option<&str>,
    ) -> Result<Vec<RoleAssignmentRecord>, RbacError> {
        if let Some(c) = cluster {
            self.existing_cluster(c).await?;
        }
        Ok(self.store.role_assignments(cluster).await?)
    }

    /// One role assignment by id.
    pub(crate) async fn assignment(&self, id: &str) -> Result<RoleAssignmentRecord, RbacError> {
        self.store
            .role_assignments(None)
            .await?
            .into_iter()
            .find(|a| a.id == id)
            .ok_or_else(|| RbacError::NotFound(format!("roleassignments \"{id}\" not found")))
    }

    /// Assigns a role; refused if the cluster's snapshot would grow too large.
    pub(crate) async fn assign(
        &self,
        new: NewAssignment,
    ) -> Result<RoleAssignmentRecord, RbacError> {
        let principal_id = principal(&new.principal_id, "principalId")?;
        let namespace = namespace(new.namespace)?;
        self.existing_cluster(&new.cluster).await?;
        let custom = self.store.role_definitions().await?;
        let role = rbac::find_role(&custom, &new.role).ok_or_else(|| {
            RbacError::NotFound(format!(
                "role {:?} not found: name a custom role (tether role define) or one of Viewer, Writer, Admin, \
                 Cluster Admin",
                new.role
            ))
        })?;
        let record = RoleAssignmentRecord {
            id: new_id(),
            role_id: role.id.clone(),
            principal_id,
            cluster: new.cluster,
            namespace,
            created_at: OffsetDateTime::now_utc(),
        };
        let role_for_size = (!is_builtin(&role.id)).then(|| role.clone());
        self.check_change(&record.cluster, |s| {
            if let Some(role) = role_for_size
                && !s.roles.iter().any(|r| r.id == role.id)
            {
                s.roles.push(role);
            }
            s.assignments.push(assignment_rule(&record));
        })
        .await?;
        let version = self.store.create_role_assignment(&record).await?;
        tracing::info!(
            assignment = %record.id,
            cluster = %record.cluster,
            role = %record.role_id,
            version,
            "role assigned"
        );
        self.hub.changed(&record.cluster, version);
        Ok(record)
    }

    /// Deletes a role assignment.
    pub(crate) async fn unassign(&self, id: &str) -> Result<(), RbacError> {
        let deleted = self.store.delete_role_assignment(id).await?;
        self.deleted("roleassignments", id, deleted)
    }

    /// After a delete: the cluster's snapshot moved to `version`, or nothing had `id`.
    fn deleted(
        &self,
        collection: &str,
        id: &str,
        deleted: Option<(String, u64)>,
    ) -> Result<(), RbacError> {
        let Some((cluster, version)) = deleted else {
            return Err(RbacError::NotFound(format!(
                "{collection} \"{id}\" not found"
            )));
        };
        tracing::info!(collection, id, cluster, version, "assignment deleted");
        self.hub.changed(&cluster, version);
        Ok(())
    }

    /// The deny assignments, of one cluster (which must exist) or all.
    pub(crate) async fn denies(
        &self,
        cluster: Option<&str>,
    ) -> Result<Vec<DenyAssignmentRecord>, RbacError> {
        if let Some(c) = cluster {
            self.existing_cluster(c).await?;
        }
        Ok(self.store.deny_assignments(cluster).await?)
    }

    /// One deny assignment by id.
    pub(crate) async fn deny_assignment(
        &self,
        id: &str,
    ) -> Result<DenyAssignmentRecord, RbacError> {
        self.store
            .deny_assignments(None)
            .await?
            .into_iter()
            .find(|d| d.id == id)
            .ok_or_else(|| RbacError::NotFound(format!("denyassignments \"{id}\" not found")))
    }

    /// Creates a deny assignment; refused if the cluster's snapshot would grow too large.
    pub(crate) async fn deny(&self, new: NewDeny) -> Result<DenyAssignmentRecord, RbacError> {
        let mut record = DenyAssignmentRecord {
            id: new_id(),
            name: new.name.trim().to_owned(),
            data_actions: new.data_actions,
            not_data_actions: new.not_data_actions,
            principals: new.principals,
            exclude_principals: new.exclude_principals,
            cluster: new.cluster,
            namespace: namespace(new.namespace)?,
            created_at: OffsetDateTime::now_utc(),
        };
        check_deny(&mut record)?;
        self.existing_cluster(&record.cluster).await?;
        self.check_change(&record.cluster, |s| {
            s.deny_assignments.push(deny_rule(&record));
        })
        .await?;
        let version = self.store.create_deny_assignment(&record).await?;
        tracing::info!(deny = %record.id, cluster = %record.cluster, version, "deny assignment created");
        self.hub.changed(&record.cluster, version);
        Ok(record)
    }

    /// Deletes a deny assignment.
    pub(crate) async fn undeny(&self, id: &str) -> Result<(), RbacError> {
        let deleted = self.store.delete_deny_assignment(id).await?;
        self.deleted("denyassignments", id, deleted)
    }

    /// What an export carries besides the cluster's registration: its assignments and the custom roles they use.
    pub(crate) async fn export(&self, cluster: &str) -> Result<Export, RbacError> {
        self.store
            .guard_state(cluster)
            .await?
            .ok_or_else(|| RbacError::ClusterNotFound(cluster.to_owned()))
    }

    /// Checks the role definitions and assignments of an export document for `cluster`: the roles must be new
    /// here or identical to the ones here, the assignments valid, and the snapshot small enough. New ids are
    /// given.
    pub(crate) async fn prepare_import(
        &self,
        cluster: &str,
        request: ImportRequest,
    ) -> Result<Imported, RbacError> {
        let existing = self.store.role_definitions().await?;
        let mut new_roles = Vec::new();
        for text in &request.roles {
            let role = parse_role(text)?;
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
                    return Err(RbacError::Conflict(format!(
                        "role definition {:?} ({:?}) differs from the one this relay holds under that id or name",
                        role.id, role.name
                    )));
                }
            }
        }
        let known: Vec<RoleDefinition> = existing.iter().chain(&new_roles).cloned().collect();
        let now = OffsetDateTime::now_utc();
        let mut records = Vec::new();
        for (role_id, principal_id, ns) in request.assignments {
            let role = rbac::find_role(&known, &role_id).ok_or_else(|| {
                RbacError::Invalid(format!(
                    "role assignment names role {role_id:?}, which is neither built in, defined here, nor in the \
                     export"
                ))
            })?;
            records.push(RoleAssignmentRecord {
                id: new_id(),
                role_id: role.id.clone(),
                principal_id: principal(&principal_id, "principalId")?,
                cluster: cluster.to_owned(),
                namespace: namespace(ns)?,
                created_at: now,
            });
        }
        let mut deny_records = Vec::new();
        for d in request.denies {
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
            check_deny(&mut record)?;
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
            .map_err(|e| RbacError::Invalid(e.to_string()))?;
        check_size(cluster, &snap)?;
        Ok(Imported {
            roles: new_roles,
            assignments: records,
            denies: deny_records,
        })
    }

    /// Sets the groups of the user `oid` (optionally only for tenant `tid`).
    pub(crate) async fn set_groups(
        &self,
        oid: &str,
        groups: &[String],
        tid: Option<String>,
    ) -> Result<DirectoryEntry, RbacError> {
        let oid = principal(oid, "object id")?;
        if groups.len() > MAX_DIRECTORY_GROUPS {
            return Err(RbacError::Invalid(format!(
                "at most {MAX_DIRECTORY_GROUPS} groups per user"
            )));
        }
        let mut groups = groups
            .iter()
            .map(|g| principal(g, "group id"))
            .collect::<Result<Vec<_>, _>>()?;
        groups.sort();
        groups.dedup();
        let tid = match tid.map(|t| t.trim().to_owned()) {
            Some(t) if t.is_empty() => None,
            Some(t)
                if t.len() <= MAX_ID_LEN
                    && t.bytes()
                        .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'.') =>
            {
                Some(t)
            }
            Some(t) => return Err(RbacError::Invalid(format!("invalid tenant id {t:?}"))),
            None => None,
        };
        let entry = DirectoryEntry {
            oid,
            tid,
            groups,
            updated_at: OffsetDateTime::now_utc(),
        };
        self.store.set_directory_entry(&entry).await?;
        tracing::info!(oid = %entry.oid, groups = entry.groups.len(), "directory entry set");
        Ok(entry)
    }

    /// The directory entry of `oid`.
    pub(crate) async fn directory_entry(&self, oid: &str) -> Result<DirectoryEntry, RbacError> {
        let oid = principal(oid, "object id")?;
        self.store.directory_entry(&oid).await?.ok_or_else(|| {
            RbacError::NotFound(format!("users \"{oid}\" not found in the directory"))
        })
    }

    /// Removes the directory entry of `oid`.
    pub(crate) async fn delete_directory_entry(&self, oid: &str) -> Result<(), RbacError> {
        let oid = principal(oid, "object id")?;
        if !self.store.delete_directory_entry(&oid).await? {
            return Err(RbacError::NotFound(format!(
                "users \"{oid}\" not found in the directory"
            )));
        }
        Ok(())
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
