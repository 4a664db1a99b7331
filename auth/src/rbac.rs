//! Azure-RBAC-style authorization for one connected cluster, as pure functions.
//!
//! A SubjectAccessReview becomes data actions the way Azure's guard does
//! (`Microsoft.Kubernetes/connectedClusters/[GROUP/]RESOURCE/{read|write|delete}`, `VERB/action` for
//! bind/escalate/use/impersonate, non-resource paths), except that exec, attach, port-forward, proxy and
//! service-account tokens get their own `…/action` whatever the verb ([`subresource_action`]); then a
//! [`Snapshot`] of role definitions, role assignments and deny assignments decides. Deny assignments win; an
//! action is granted when one assignment of the principal (its object id or one of its groups) at a scope
//! covering the request has a role whose `dataActions` cover it and whose `notDataActions` do not touch it.
//! Matching is ASCII case-insensitive and `*` matches any run of characters, as in Azure.
//!
//! A namespace-scoped deny also covers requests across all namespaces (`list secrets -A`), and a [`Protection`]
//! keeps the agent's namespace to cluster administrators whatever the snapshot says and keeps the agent's own
//! identity from impersonating `system:` users and groups or service accounts ([`agent_impersonation`]).
//!
//! Guard only has opinions on Entra identities: `system:` users and users without an `oid` extra get "no
//! opinion", so Kubernetes RBAC still applies to them. Not granted is `allowed=false, denied=false` (other
//! authorizers may still allow); a deny assignment or a request that maps to no action is `denied=true`.

use std::collections::{BTreeMap, BTreeSet, HashSet};
use std::sync::OnceLock;

use serde::{Deserialize, Serialize};
use serde_json::Value;

/// The prefix of every data action of a connected cluster.
pub const CONNECTED_CLUSTERS: &str = "Microsoft.Kubernetes/connectedClusters";

/// The Azure "Everyone" principal id; in a deny assignment it matches every principal.
pub const EVERYONE: &str = "00000000-0000-0000-0000-000000000000";

/// Longest data action or pattern considered; longer requests are denied.
const MAX_ACTION_LEN: usize = 512;

/// Why a role definition or snapshot is unusable.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RbacError {
    /// The JSON is not a role definition.
    #[error("invalid role definition: {0}")]
    InvalidRole(String),
    /// The snapshot is inconsistent.
    #[error("invalid snapshot: {0}")]
    InvalidSnapshot(String),
}

/// A role: what data actions it grants.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct RoleDefinition {
    /// Stable id (a GUID for the built-ins).
    pub id: String,
    /// Display name.
    pub name: String,
    /// What the role is for.
    #[serde(default)]
    pub description: String,
    /// Granted data action patterns.
    #[serde(default)]
    pub data_actions: Vec<String>,
    /// Patterns subtracted from `data_actions`.
    #[serde(default)]
    pub not_data_actions: Vec<String>,
}

impl RoleDefinition {
    /// Parses a custom role from JSON: this crate's form (`id`, `name`, `dataActions`, …), the `az role definition`
    /// form (`Name`, `DataActions`, …) or the ARM form (`roleName`, `permissions: [{dataActions, …}]`, optionally
    /// under `properties`). Keys are matched case-insensitively. Management-plane `actions` are ignored.
    pub fn from_json(text: &str) -> Result<Self, RbacError> {
        let value: Value = serde_json::from_str(text)
            .map_err(|e| RbacError::InvalidRole(format!("not JSON: {e}")))?;
        let mut obj = value
            .as_object()
            .cloned()
            .ok_or_else(|| RbacError::InvalidRole("expected a JSON object".to_owned()))?;
        if let Some(Value::Object(props)) = field(&obj, "properties").cloned() {
            for (k, v) in props {
                obj.entry(k).or_insert(v);
            }
        }
        let string = |key: &str| field(&obj, key).and_then(Value::as_str).map(str::to_owned);
        let name = string("roleName")
            .or_else(|| string("name"))
            .filter(|n| !n.trim().is_empty())
            .ok_or_else(|| RbacError::InvalidRole("no name".to_owned()))?;
        let id = string("id")
            .map(|id| id.rsplit('/').next().unwrap_or_default().to_owned())
            .filter(|id| !id.is_empty())
            .or_else(|| {
                // ARM: `name` is the GUID when `roleName` carries the display name.
                string("roleName").and(string("name"))
            })
            .unwrap_or_else(|| slug(&name));
        let mut role = RoleDefinition {
            id,
            name,
            description: string("description").unwrap_or_default(),
            data_actions: strings(field(&obj, "dataActions"))?,
            not_data_actions: strings(field(&obj, "notDataActions"))?,
        };
        if let Some(perms) = field(&obj, "permissions") {
            let perms = perms
                .as_array()
                .ok_or_else(|| RbacError::InvalidRole("permissions must be an array".to_owned()))?;
            for p in perms {
                let p = p.as_object().ok_or_else(|| {
                    RbacError::InvalidRole("permissions entries must be objects".to_owned())
                })?;
                role.data_actions.extend(strings(field(p, "dataActions"))?);
                role.not_data_actions
                    .extend(strings(field(p, "notDataActions"))?);
            }
        }
        role.validate()?;
        Ok(role)
    }

    /// Checks the id, name and patterns (each must be a connected-cluster data action pattern).
    pub fn validate(&self) -> Result<(), RbacError> {
        let bad = |m: String| Err(RbacError::InvalidRole(m));
        if self.id.trim().is_empty() || self.name.trim().is_empty() {
            return bad("id and name must not be empty".to_owned());
        }
        if self.data_actions.is_empty() {
            return bad(format!("role {:?} has no dataActions", self.name));
        }
        for p in self.data_actions.iter().chain(&self.not_data_actions) {
            validate_pattern(p).map_err(RbacError::InvalidRole)?;
        }
        Ok(())
    }

    /// Whether the role grants `action` (a concrete action or a wildcard request).
    pub fn grants(&self, action: &str) -> bool {
        self.data_actions.iter().any(|p| covers(p, action))
            && !self.not_data_actions.iter().any(|n| overlaps(n, action))
    }
}

fn field<'a>(obj: &'a serde_json::Map<String, Value>, key: &str) -> Option<&'a Value> {
    obj.iter()
        .find(|(k, _)| k.eq_ignore_ascii_case(key))
        .map(|(_, v)| v)
}

fn strings(v: Option<&Value>) -> Result<Vec<String>, RbacError> {
    match v {
        None | Some(Value::Null) => Ok(Vec::new()),
        Some(Value::Array(items)) => items
            .iter()
            .map(|i| {
                i.as_str()
                    .map(str::to_owned)
                    .ok_or_else(|| RbacError::InvalidRole("action lists hold strings".to_owned()))
            })
            .collect(),
        Some(_) => Err(RbacError::InvalidRole(
            "dataActions/notDataActions must be arrays".to_owned(),
        )),
    }
}

fn slug(name: &str) -> String {
    name.chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() {
                c.to_ascii_lowercase()
            } else {
                '-'
            }
        })
        .collect()
}

fn validate_pattern(p: &str) -> Result<(), String> {
    if p.is_empty() || p.len() > MAX_ACTION_LEN || p.chars().any(|c| c.is_whitespace()) {
        return Err(format!("{p:?} is not a data action pattern"));
    }
    if !overlaps(p, &format!("{CONNECTED_CLUSTERS}/*")) {
        return Err(format!("{p:?} is not a {CONNECTED_CLUSTERS} data action"));
    }
    Ok(())
}

/// The four built-in roles, with the data actions of Azure's "Azure Arc Kubernetes Viewer", "Writer", "Admin" and
/// "Cluster Admin" built-in roles (same GUIDs). Source: Microsoft's published built-in role definitions
/// (azure-docs, role-based-access-control/built-in-roles/containers.md).
pub fn builtin_roles() -> &'static [RoleDefinition] {
    static ROLES: OnceLock<Vec<RoleDefinition>> = OnceLock::new();
    ROLES.get_or_init(|| {
        let cc = |suffixes: &[&str]| -> Vec<String> {
            suffixes
                .iter()
                .map(|s| format!("{CONNECTED_CLUSTERS}/{s}"))
                .collect()
        };
        const VIEWER: &[&str] = &[
            "apps/controllerrevisions/read",
            "apps/daemonsets/read",
            "apps/deployments/read",
            "apps/replicasets/read",
            "apps/statefulsets/read",
            "autoscaling/horizontalpodautoscalers/read",
            "batch/cronjobs/read",
            "batch/jobs/read",
            "configmaps/read",
            "endpoints/read",
            "events.k8s.io/events/read",
            "events/read",
            "extensions/daemonsets/read",
            "extensions/deployments/read",
            "extensions/ingresses/read",
            "extensions/networkpolicies/read",
            "extensions/replicasets/read",
            "limitranges/read",
            "namespaces/read",
            "networking.k8s.io/ingresses/read",
            "networking.k8s.io/networkpolicies/read",
            "persistentvolumeclaims/read",
            "pods/read",
            "policy/poddisruptionbudgets/read",
            "replicationcontrollers/read",
            "resourcequotas/read",
            "serviceaccounts/read",
            "services/read",
        ];
        const WRITER: &[&str] = &[
            "apps/controllerrevisions/read",
            "apps/daemonsets/*",
            "apps/deployments/*",
            "apps/replicasets/*",
            "apps/statefulsets/*",
            "autoscaling/horizontalpodautoscalers/*",
            "batch/cronjobs/*",
            "batch/jobs/*",
            "configmaps/*",
            "endpoints/*",
            "events.k8s.io/events/read",
            "events/read",
            "extensions/daemonsets/*",
            "extensions/deployments/*",
            "extensions/ingresses/*",
            "extensions/networkpolicies/*",
            "extensions/replicasets/*",
            "limitranges/read",
            "namespaces/read",
            "networking.k8s.io/ingresses/*",
            "networking.k8s.io/networkpolicies/*",
            "persistentvolumeclaims/*",
            "pods/*",
            "policy/poddisruptionbudgets/*",
            "replicationcontrollers/*",
            "resourcequotas/read",
            "secrets/*",
            "serviceaccounts/*",
            "services/*",
        ];
        const ADMIN_EXTRA: &[&str] = &[
            "authorization.k8s.io/localsubjectaccessreviews/write",
            "rbac.authorization.k8s.io/rolebindings/*",
            "rbac.authorization.k8s.io/roles/*",
        ];
        let mut admin = cc(WRITER);
        admin.extend(cc(ADMIN_EXTRA));
        admin.sort();
        vec![
            RoleDefinition {
                id: "63f0a09d-1495-4db4-a681-037d84835eb4".to_owned(),
                name: "Azure Arc Kubernetes Viewer".to_owned(),
                description: "Lets you view all resources in cluster/namespace, except secrets.".to_owned(),
                data_actions: cc(VIEWER),
                not_data_actions: Vec::new(),
            },
            RoleDefinition {
                id: "5b999177-9696-4545-85c7-50de3797e5a1".to_owned(),
                name: "Azure Arc Kubernetes Writer".to_owned(),
                description: "Lets you update everything in cluster/namespace, except (cluster)roles and \
                              (cluster)role bindings."
                    .to_owned(),
                data_actions: cc(WRITER),
                not_data_actions: Vec::new(),
            },
            RoleDefinition {
                id: "dffb1e0c-446f-4dde-a09f-99eb5cc68b96".to_owned(),
                name: "Azure Arc Kubernetes Admin".to_owned(),
                description: "Lets you manage all resources under cluster/namespace, except update or delete \
                              resource quotas and namespaces."
                    .to_owned(),
                data_actions: admin,
                not_data_actions: Vec::new(),
            },
            RoleDefinition {
                id: "8393591c-06b9-48a2-a542-1bd6b377f6a2".to_owned(),
                name: "Azure Arc Kubernetes Cluster Admin".to_owned(),
                description: "Lets you manage all resources in the cluster.".to_owned(),
                data_actions: vec![format!("{CONNECTED_CLUSTERS}/*")],
                not_data_actions: Vec::new(),
            },
        ]
    })
}

/// Finds a role by id, by name, or by the short built-in names `Viewer`, `Writer`, `Admin`, `Cluster Admin`
/// (case-insensitive), among `custom` roles first, then the built-ins.
pub fn find_role<'a>(custom: &'a [RoleDefinition], id_or_name: &str) -> Option<&'a RoleDefinition> {
    let wanted = id_or_name.trim();
    let long = format!("Azure Arc Kubernetes {wanted}");
    let matches = |r: &&RoleDefinition| {
        r.id.eq_ignore_ascii_case(wanted)
            || r.name.eq_ignore_ascii_case(wanted)
            || r.name.eq_ignore_ascii_case(&long)
    };
    custom
        .iter()
        .find(matches)
        .or_else(|| builtin_roles().iter().find(matches))
}

/// Where an assignment applies.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub enum Scope {
    /// The whole cluster (JSON `"cluster"`).
    Cluster,
    /// One namespace (JSON `{"namespace": "NAME"}`).
    Namespace(String),
}

impl Scope {
    /// Whether an assignment at this scope applies to a request in `namespace` (`None`: cluster-scoped request).
    pub fn applies_to(&self, namespace: Option<&str>) -> bool {
        match self {
            Scope::Cluster => true,
            Scope::Namespace(ns) => namespace == Some(ns.as_str()),
        }
    }
}

impl std::fmt::Display for Scope {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Scope::Cluster => f.write_str("cluster"),
            Scope::Namespace(ns) => write!(f, "namespace {ns:?}"),
        }
    }
}

/// A role given to a principal at a scope.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct RoleAssignment {
    /// Stable id.
    pub id: String,
    /// The role's id (a built-in GUID or a custom role's id).
    pub role_id: String,
    /// A user's or service principal's object id, or a group's object id.
    pub principal_id: String,
    /// Where it applies.
    pub scope: Scope,
}

/// Data actions refused to principals at a scope, whatever their roles say.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct DenyAssignment {
    /// Stable id.
    pub id: String,
    /// Display name.
    #[serde(default)]
    pub name: String,
    /// Denied data action patterns.
    pub data_actions: Vec<String>,
    /// Patterns carved out of `data_actions`.
    #[serde(default)]
    pub not_data_actions: Vec<String>,
    /// Object ids of users, service principals or groups ([`EVERYONE`] or `*` for all).
    pub principals: Vec<String>,
    /// Object ids the deny does not apply to.
    #[serde(default)]
    pub exclude_principals: Vec<String>,
    /// Where it applies.
    pub scope: Scope,
}

impl DenyAssignment {
    /// Whether this deny's scope covers the request: a cluster-scoped deny covers everything; a namespace-scoped
    /// deny covers requests in its namespace **and** requests across all namespaces (a cluster-wide list or
    /// watch would otherwise return the denied namespace's objects; guard denies such a request rather than
    /// filtering the response, which only the apiserver could do).
    pub fn covers_request(&self, req: &Prepared) -> bool {
        match &self.scope {
            Scope::Cluster => true,
            Scope::Namespace(ns) => match &req.namespace {
                Some(n) => n == ns,
                None => req.spans_namespaces,
            },
        }
    }

    fn applies_to(&self, principal: &Principal) -> bool {
        let is = |id: &String| id == &principal.oid || principal.groups.binary_search(id).is_ok();
        let included = self
            .principals
            .iter()
            .any(|p| p == "*" || p == EVERYONE || is(p));
        included && !self.exclude_principals.iter().any(is)
    }

    /// Whether this deny touches `action` (any overlap denies, unless a carve-out covers the whole request).
    pub fn denies(&self, action: &str) -> bool {
        self.data_actions.iter().any(|p| overlaps(p, action))
            && !self.not_data_actions.iter().any(|n| covers(n, action))
    }
}

/// Everything guard needs to decide for one cluster; what the relay pushes. Serializable as JSON (camelCase).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Snapshot {
    /// Monotonic version; a store only accepts newer versions, and the decision cache is dropped on change.
    pub version: u64,
    /// Custom role definitions (the built-ins are always available and need not be listed).
    #[serde(default)]
    pub roles: Vec<RoleDefinition>,
    /// Role assignments.
    #[serde(default)]
    pub assignments: Vec<RoleAssignment>,
    /// Deny assignments.
    #[serde(default)]
    pub deny_assignments: Vec<DenyAssignment>,
}

impl Snapshot {
    /// Checks custom roles and deny patterns, and that every assignment names a known role.
    pub fn validate(&self) -> Result<(), RbacError> {
        let bad = |m: String| Err(RbacError::InvalidSnapshot(m));
        let mut ids = HashSet::new();
        for r in &self.roles {
            r.validate()
                .map_err(|e| RbacError::InvalidSnapshot(e.to_string()))?;
            if !ids.insert(r.id.to_ascii_lowercase()) {
                return bad(format!("role id {:?} appears twice", r.id));
            }
        }
        for a in &self.assignments {
            if self.role(&a.role_id).is_none() {
                return bad(format!(
                    "assignment {:?} names unknown role {:?}",
                    a.id, a.role_id
                ));
            }
            if a.principal_id.trim().is_empty() {
                return bad(format!("assignment {:?} has no principal", a.id));
            }
        }
        for d in &self.deny_assignments {
            if d.data_actions.is_empty() || d.principals.is_empty() {
                return bad(format!(
                    "deny assignment {:?} needs dataActions and principals",
                    d.id
                ));
            }
            for p in d.data_actions.iter().chain(&d.not_data_actions) {
                validate_pattern(p).map_err(RbacError::InvalidSnapshot)?;
            }
        }
        Ok(())
    }

    /// The role with this id: custom roles first, then the built-ins.
    pub fn role(&self, id: &str) -> Option<&RoleDefinition> {
        self.roles
            .iter()
            .find(|r| r.id.eq_ignore_ascii_case(id))
            .or_else(|| {
                builtin_roles()
                    .iter()
                    .find(|r| r.id.eq_ignore_ascii_case(id))
            })
    }
}

/// The resource part of a SubjectAccessReview.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", default)]
pub struct ResourceAttributes {
    /// Namespace; empty for cluster-scoped requests.
    pub namespace: String,
    /// Kubernetes verb.
    pub verb: String,
    /// API group; empty for the core group.
    pub group: String,
    /// API version.
    pub version: String,
    /// Resource.
    pub resource: String,
    /// Subresource.
    pub subresource: String,
    /// Object name.
    pub name: String,
}

/// The non-resource part of a SubjectAccessReview.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", default)]
pub struct NonResourceAttributes {
    /// URL path.
    pub path: String,
    /// HTTP verb, lower case.
    pub verb: String,
}

/// An access question, independent of the SubjectAccessReview version.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct AccessRequest {
    /// Username.
    pub user: String,
    /// User uid.
    pub uid: String,
    /// Groups.
    pub groups: Vec<String>,
    /// Extra attributes (guard's authenticator puts the object id under `oid`).
    pub extra: BTreeMap<String, Vec<String>>,
    /// Resource attributes, if a resource request.
    pub resource: Option<ResourceAttributes>,
    /// Non-resource attributes, if a non-resource request.
    pub non_resource: Option<NonResourceAttributes>,
}

/// An authorization answer, in SubjectAccessReview terms. Neither allowed nor denied is "no opinion".
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Decision {
    /// Allowed.
    pub allowed: bool,
    /// Denied outright (no other authorizer is asked).
    pub denied: bool,
    /// Why; shown to the user by kubectl.
    pub reason: String,
}

impl Decision {
    fn allow(reason: String) -> Self {
        Self {
            allowed: true,
            denied: false,
            reason,
        }
    }

    fn deny(reason: String) -> Self {
        Self {
            allowed: false,
            denied: true,
            reason,
        }
    }

    fn no_opinion(reason: String) -> Self {
        Self {
            allowed: false,
            denied: false,
            reason,
        }
    }

    /// A short label for metrics and audit: `allowed`, `denied` or `no_opinion`.
    pub fn label(&self) -> &'static str {
        match (self.allowed, self.denied) {
            (true, _) => "allowed",
            (false, true) => "denied",
            (false, false) => "no_opinion",
        }
    }
}

/// Who is asking, for authorization: an object id and sorted, de-duplicated group ids.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Principal {
    /// Object id.
    pub oid: String,
    /// Group ids, sorted, without `system:` groups.
    pub groups: Vec<String>,
}

/// A request reduced to what decides it: principal, data actions and namespace. This is also the cache key
/// material (never the username).
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Prepared {
    /// Who.
    pub principal: Principal,
    /// What (data actions, all required).
    pub actions: Vec<String>,
    /// Where: the namespace, `None` for cluster-scoped requests.
    pub namespace: Option<String>,
    /// Whether a request without a namespace reaches into every namespace (list, watch or deletecollection of a
    /// resource that may be namespaced, as `kubectl get secrets -A` does); namespace-scoped deny assignments
    /// apply to such requests.
    pub spans_namespaces: bool,
}

impl Prepared {
    /// The scope label used in reasons and audit lines.
    pub fn scope_label(&self) -> String {
        match &self.namespace {
            Some(ns) => format!("namespace {ns:?}"),
            None => "cluster scope".to_owned(),
        }
    }
}

/// Maps a Kubernetes verb to the action suffix Azure uses; `None` if it maps to nothing.
pub fn verb_action(verb: &str) -> Option<&'static str> {
    Some(match verb {
        "get" | "list" | "watch" => "read",
        "create" | "update" | "patch" => "write",
        "delete" | "deletecollection" => "delete",
        "bind" => "bind/action",
        "escalate" => "escalate/action",
        "use" => "use/action",
        "impersonate" => "impersonate/action",
        "*" => "*",
        _ => return None,
    })
}

/// The action of a subresource that is not its resource's read/write: what lets a caller run code in, talk to,
/// or take credentials from a workload. `pods/exec/action` is Azure's published data action; the others follow
/// its form (Azure folds them into the resource; see docs/GUARD.md). `None`: authorized as the resource.
pub fn subresource_action(resource: &str, subresource: &str) -> Option<&'static str> {
    Some(match (resource, subresource) {
        ("pods", "exec") => "exec/action",
        ("pods", "attach") => "attach/action",
        ("pods", "portforward") => "portforward/action",
        ("pods" | "services" | "nodes", "proxy") => "proxy/action",
        ("serviceaccounts", "token") => "token/action",
        _ => return None,
    })
}

fn non_resource_verb_action(verb: &str) -> Option<&'static str> {
    Some(match verb {
        "get" | "head" | "list" | "watch" => "read",
        "post" | "put" | "patch" | "create" | "update" => "write",
        "delete" => "delete",
        "*" => "*",
        _ => return None,
    })
}

fn valid_segment(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= 253
        && s.bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'.' | b'_' | b'*'))
}

/// The data actions a request needs, or the reason it maps to none (which is a denial).
pub fn data_actions(
    resource: Option<&ResourceAttributes>,
    non_resource: Option<&NonResourceAttributes>,
) -> Result<Vec<String>, String> {
    let action = if let Some(r) = resource {
        let suffix = verb_action(&r.verb).ok_or_else(|| {
            format!(
                "verb {:?} maps to no Azure data action",
                truncate(&r.verb, 40)
            )
        })?;
        if !valid_segment(&r.resource) {
            return Err(format!(
                "resource {:?} cannot be named as a data action",
                truncate(&r.resource, 60)
            ));
        }
        if !r.group.is_empty() && !valid_segment(&r.group) {
            return Err(format!(
                "API group {:?} cannot be named as a data action",
                truncate(&r.group, 60)
            ));
        }
        let mut action = CONNECTED_CLUSTERS.to_owned();
        if !r.group.is_empty() {
            action.push('/');
            action.push_str(&r.group);
        }
        action.push('/');
        action.push_str(&r.resource);
        if let Some(sub) = subresource_action(&r.resource, &r.subresource) {
            // Whatever the verb: WebSocket exec/attach/port-forward arrive as `get` on clusters up to 1.34, and
            // a proxy request carries the proxied HTTP method as its verb.
            action.push('/');
            action.push_str(sub);
        } else {
            action.push('/');
            action.push_str(suffix);
        }
        action
    } else if let Some(n) = non_resource {
        let suffix = non_resource_verb_action(&n.verb).ok_or_else(|| {
            format!(
                "verb {:?} maps to no Azure data action",
                truncate(&n.verb, 40)
            )
        })?;
        let path = n.path.trim_end_matches('/');
        let segments: Vec<&str> = path.split('/').skip(1).collect();
        let well_formed = n.path.starts_with('/')
            && segments
                .iter()
                .all(|s| valid_segment(s) && *s != "." && *s != "..");
        if !well_formed && n.path != "/" {
            return Err(format!(
                "path {:?} cannot be named as a data action",
                truncate(&n.path, 60)
            ));
        }
        format!("{CONNECTED_CLUSTERS}{path}/{suffix}")
    } else {
        return Err("the review has neither resource nor non-resource attributes".to_owned());
    };
    if action.len() > MAX_ACTION_LEN {
        return Err("the request's data action is too long".to_owned());
    }
    Ok(vec![action])
}

fn truncate(s: &str, max: usize) -> String {
    s.chars().take(max).collect()
}

/// Built-in resources that are cluster-scoped, so a request for them without a namespace does not reach into
/// namespaces. Anything else (custom resources included) is assumed to be possibly namespaced.
fn is_cluster_scoped(group: &str, resource: &str) -> bool {
    const CLUSTER_SCOPED: &[(&str, &str)] = &[
        ("", "namespaces"),
        ("", "nodes"),
        ("", "persistentvolumes"),
        ("", "componentstatuses"),
        ("rbac.authorization.k8s.io", "clusterroles"),
        ("rbac.authorization.k8s.io", "clusterrolebindings"),
        ("storage.k8s.io", "storageclasses"),
        ("storage.k8s.io", "csidrivers"),
        ("storage.k8s.io", "csinodes"),
        ("storage.k8s.io", "volumeattachments"),
        ("apiextensions.k8s.io", "customresourcedefinitions"),
        ("apiregistration.k8s.io", "apiservices"),
        ("scheduling.k8s.io", "priorityclasses"),
        ("node.k8s.io", "runtimeclasses"),
        ("networking.k8s.io", "ingressclasses"),
        ("certificates.k8s.io", "certificatesigningrequests"),
        (
            "admissionregistration.k8s.io",
            "mutatingwebhookconfigurations",
        ),
        (
            "admissionregistration.k8s.io",
            "validatingwebhookconfigurations",
        ),
        ("flowcontrol.apiserver.k8s.io", "flowschemas"),
        (
            "flowcontrol.apiserver.k8s.io",
            "prioritylevelconfigurations",
        ),
    ];
    CLUSTER_SCOPED.contains(&(group, resource))
}

/// Reduces a request to a [`Prepared`] one, or answers it at once: no opinion for `system:` and non-Entra users,
/// a denial when it maps to no data action (pure). Groups are taken as they are; see [`prepare_with_prefix`].
pub fn prepare(req: &AccessRequest) -> Result<Prepared, Decision> {
    prepare_with_prefix(req, "")
}

/// [`prepare`] for identities whose groups carry `groups_prefix` (the token configuration's): only groups with
/// the prefix are Entra groups, and the prefix is removed before matching assignments; other groups (from
/// another authenticator) are ignored. An empty prefix takes every group as it is.
pub fn prepare_with_prefix(req: &AccessRequest, groups_prefix: &str) -> Result<Prepared, Decision> {
    if req.user.starts_with("system:") {
        return Err(Decision::no_opinion(
            "tether guard has no opinion on system: users".to_owned(),
        ));
    }
    let oid = req
        .extra
        .get(crate::token::EXTRA_OID)
        .and_then(|v| v.first())
        .filter(|o| !o.is_empty())
        .ok_or_else(|| {
            Decision::no_opinion("tether guard has no opinion on non-Entra identities".to_owned())
        })?;
    let groups: BTreeSet<&str> = req
        .groups
        .iter()
        .filter_map(|g| g.strip_prefix(groups_prefix))
        .filter(|g| !g.starts_with("system:") && !g.is_empty())
        .collect();
    let actions = data_actions(req.resource.as_ref(), req.non_resource.as_ref())
        .map_err(|r| Decision::deny(format!("tether guard: {r}")))?;
    let namespace = req
        .resource
        .as_ref()
        .map(|r| r.namespace.clone())
        .filter(|ns| !ns.is_empty());
    let spans_namespaces = namespace.is_none()
        && req.resource.as_ref().is_some_and(|r| {
            matches!(r.verb.as_str(), "list" | "watch" | "deletecollection" | "*")
                && !is_cluster_scoped(&r.group, &r.resource)
        });
    Ok(Prepared {
        principal: Principal {
            oid: oid.clone(),
            groups: groups.into_iter().map(str::to_owned).collect(),
        },
        actions,
        namespace,
        spans_namespaces,
    })
}

/// Decides a prepared request against a snapshot (pure). Deny assignments win; every action must be granted.
pub fn evaluate(snapshot: &Snapshot, req: &Prepared) -> Decision {
    let ns = req.namespace.as_deref();
    for d in &snapshot.deny_assignments {
        if d.covers_request(req)
            && d.applies_to(&req.principal)
            && let Some(a) = req.actions.iter().find(|a| d.denies(a))
        {
            let name = if d.name.is_empty() { &d.id } else { &d.name };
            let across = if ns.is_none() && d.scope != Scope::Cluster {
                " (a request across all namespaces includes it)"
            } else {
                ""
            };
            return Decision::deny(format!(
                "tether guard: {a} is denied by deny assignment {name:?} at {}{across}",
                d.scope
            ));
        }
    }
    let mut grants = Vec::with_capacity(req.actions.len());
    for action in &req.actions {
        let grant = snapshot.assignments.iter().find(|asg| {
            asg.scope.applies_to(ns)
                && (asg.principal_id == req.principal.oid
                    || req
                        .principal
                        .groups
                        .binary_search(&asg.principal_id)
                        .is_ok())
                && snapshot
                    .role(&asg.role_id)
                    .is_some_and(|r| r.grants(action))
        });
        match grant {
            Some(g) => grants.push(g),
            None => {
                return Decision::no_opinion(format!(
                    "tether guard: no role assignment grants {action} at {}",
                    req.scope_label()
                ));
            }
        }
    }
    let why: Vec<String> = grants
        .iter()
        .map(|g| {
            let role = snapshot
                .role(&g.role_id)
                .map_or(g.role_id.as_str(), |r| r.name.as_str());
            format!("role {role:?} at {} (assignment {})", g.scope, g.id)
        })
        .collect();
    Decision::allow(format!("tether guard: allowed by {}", why.join(", ")))
}

/// What guard protects whatever the snapshot says (its own configuration, not the relay's).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Protection {
    /// The namespace the Tether agent runs in (its service account, its Secrets, its pods). Only principals with
    /// a cluster-scope assignment of a role granting `Microsoft.Kubernetes/connectedClusters/*` (Cluster Admin)
    /// may read Secrets there or do anything but read: create tokens for its service accounts, exec/attach/
    /// port-forward/proxy into its pods, create pods (which could mount its service account), change its
    /// workloads or bindings. Requests across all namespaces that include it (`get secrets -A`) count too.
    pub agent_namespace: Option<String>,
}

/// Whether `req` is one of the agent namespace's service accounts (the agent's identity) impersonating what the
/// agent never needs to: a user or group whose name starts with `system:` (any case: `system:masters`,
/// `system:admin`, `system:node:…`) or any service account. The agent impersonates only the Entra users and groups
/// it validated itself (and those refuse `system:` names), but its service account is allowed `impersonate` on
/// every user and group (Kubernetes RBAC cannot say "any but `system:*`"), so a stolen agent token would otherwise
/// be `system:masters`. `Some(denied)` for such a request; `None` (guard has no opinion, RBAC decides) for
/// everything else and without an agent namespace. Pure.
///
/// kube-apiserver asks guard about the agent's service account only with the second webhook authorizer of the
/// shipped `deploy/guard/authorization-config.yaml`, which matches that namespace's service accounts.
pub fn agent_impersonation(req: &AccessRequest, protection: &Protection) -> Option<Decision> {
    let ns = protection
        .agent_namespace
        .as_deref()
        .filter(|n| !n.is_empty())?;
    let rest = req.user.strip_prefix("system:serviceaccount:")?;
    if rest.split_once(':').map(|(n, _)| n) != Some(ns) {
        return None;
    }
    let r = req.resource.as_ref().filter(|r| r.verb == "impersonate")?;
    let reserved = r.name.to_ascii_lowercase().starts_with("system:");
    let what = match (r.group.as_str(), r.resource.as_str()) {
        ("", "users") if reserved => format!("the user {:?}", truncate(&r.name, 80)),
        ("", "groups") if reserved => format!("the group {:?}", truncate(&r.name, 80)),
        ("", "serviceaccounts") => format!(
            "the service account {:?} in namespace {:?}",
            truncate(&r.name, 80),
            truncate(&r.namespace, 80)
        ),
        _ => return None,
    };
    Some(Decision::deny(format!(
        "tether guard: the agent's identity ({}) may impersonate Entra users and groups only, not {what}",
        truncate(&req.user, 120)
    )))
}

/// [`evaluate`] under a [`Protection`]: a protected request by a principal that is not a cluster administrator
/// is denied before the snapshot is consulted (pure).
pub fn evaluate_protected(
    snapshot: &Snapshot,
    req: &Prepared,
    protection: &Protection,
) -> Decision {
    if let Some(ns) = protection
        .agent_namespace
        .as_deref()
        .filter(|n| !n.is_empty())
        && let Some(d) = protect_agent(snapshot, req, ns)
    {
        return d;
    }
    evaluate(snapshot, req)
}

fn protect_agent(snapshot: &Snapshot, req: &Prepared, ns: &str) -> Option<Decision> {
    let in_scope = match &req.namespace {
        Some(n) => n == ns,
        None => req.spans_namespaces,
    };
    if !in_scope {
        return None;
    }
    let secrets = format!("{CONNECTED_CLUSTERS}/secrets/*");
    let reads = format!("{CONNECTED_CLUSTERS}/*/read");
    let action = req
        .actions
        .iter()
        .find(|a| overlaps(&secrets, a) || !covers(&reads, a))?;
    let everything = format!("{CONNECTED_CLUSTERS}/*");
    let cluster_admin = snapshot.assignments.iter().any(|asg| {
        asg.scope == Scope::Cluster
            && (asg.principal_id == req.principal.oid
                || req
                    .principal
                    .groups
                    .binary_search(&asg.principal_id)
                    .is_ok())
            && snapshot
                .role(&asg.role_id)
                .is_some_and(|r| r.grants(&everything))
    });
    if cluster_admin {
        return None;
    }
    let across = if req.namespace.is_none() {
        " (a request across all namespaces includes it)"
    } else {
        ""
    };
    Some(Decision::deny(format!(
        "tether guard: {action} in namespace {ns:?}{across} is reserved to cluster administrators: it holds \
         the Tether agent's credentials"
    )))
}

/// Decides a request against a snapshot (pure): [`prepare`] then [`evaluate`].
pub fn decide(snapshot: &Snapshot, req: &AccessRequest) -> Decision {
    match prepare(req) {
        Ok(p) => evaluate(snapshot, &p),
        Err(d) => d,
    }
}

fn eq(a: u8, b: u8) -> bool {
    a.eq_ignore_ascii_case(&b)
}

/// Whether `pattern` (with `*` wildcards) matches every string `request` can stand for: `request`'s own `*` are
/// matched literally, so a wildcard request is covered only by a pattern at least as broad. O(n·m).
pub fn covers(pattern: &str, request: &str) -> bool {
    let (p, t) = (pattern.as_bytes(), request.as_bytes());
    // Greedy matching with one backtrack point: linear in practice, O(n·m) worst case, no recursion.
    let (mut pi, mut ti) = (0usize, 0usize);
    let mut star: Option<(usize, usize)> = None;
    while ti < t.len() {
        if pi < p.len() && p[pi] == b'*' {
            star = Some((pi, ti));
            pi += 1;
        } else if pi < p.len() && eq(p[pi], t[ti]) {
            pi += 1;
            ti += 1;
        } else if let Some((sp, st)) = star {
            pi = sp + 1;
            ti = st + 1;
            star = Some((sp, st + 1));
        } else {
            return false;
        }
    }
    p[pi..].iter().all(|c| *c == b'*')
}

/// Whether two patterns (both with `*` wildcards) match at least one common string. O(n·m) time and memory.
pub fn overlaps(a: &str, b: &str) -> bool {
    let (a, b) = (a.as_bytes(), b.as_bytes());
    let (n, m) = (a.len(), b.len());
    if n > MAX_ACTION_LEN * 2 || m > MAX_ACTION_LEN * 2 {
        return true; // Conservative: callers use overlap to deny.
    }
    // f[i][j]: a[i..] and b[j..] overlap. Two rows suffice, filled from the end.
    let mut next = vec![false; m + 1]; // row i + 1
    let mut cur = vec![false; m + 1];
    for i in (0..=n).rev() {
        for j in (0..=m).rev() {
            cur[j] = if i == n && j == m {
                true
            } else if i < n && a[i] == b'*' {
                next[j] || (j < m && cur[j + 1])
            } else if j < m && b[j] == b'*' {
                cur[j + 1] || (i < n && next[j])
            } else if i < n && j < m {
                eq(a[i], b[j]) && next[j + 1]
            } else {
                false
            };
        }
        std::mem::swap(&mut next, &mut cur);
    }
    next[0]
}

#[cfg(test)]
mod tests {
    use super::*;

    fn res(verb: &str, group: &str, resource: &str, sub: &str, ns: &str) -> ResourceAttributes {
        ResourceAttributes {
            namespace: ns.to_owned(),
            verb: verb.to_owned(),
            group: group.to_owned(),
            resource: resource.to_owned(),
            subresource: sub.to_owned(),
            ..Default::default()
        }
    }

    fn action(verb: &str, group: &str, resource: &str, sub: &str) -> Result<String, String> {
        data_actions(Some(&res(verb, group, resource, sub, "")), None).map(|v| v.join(","))
    }

    const CC: &str = CONNECTED_CLUSTERS;

    #[test]
    fn verb_to_action_table() {
        let table: &[(&str, &str, &str, &str, &str)] = &[
            ("get", "", "pods", "", "pods/read"),
            ("list", "", "pods", "", "pods/read"),
            ("watch", "", "pods", "", "pods/read"),
            (
                "create",
                "apps",
                "deployments",
                "",
                "apps/deployments/write",
            ),
            (
                "update",
                "apps",
                "deployments",
                "",
                "apps/deployments/write",
            ),
            ("patch", "apps", "deployments", "", "apps/deployments/write"),
            ("delete", "", "secrets", "", "secrets/delete"),
            ("deletecollection", "", "secrets", "", "secrets/delete"),
            (
                "bind",
                "rbac.authorization.k8s.io",
                "roles",
                "",
                "rbac.authorization.k8s.io/roles/bind/action",
            ),
            (
                "escalate",
                "rbac.authorization.k8s.io",
                "clusterroles",
                "",
                "rbac.authorization.k8s.io/clusterroles/escalate/action",
            ),
            (
                "use",
                "policy",
                "podsecuritypolicies",
                "",
                "policy/podsecuritypolicies/use/action",
            ),
            ("impersonate", "", "users", "", "users/impersonate/action"),
            ("create", "", "pods", "exec", "pods/exec/action"),
            ("get", "", "pods", "exec", "pods/exec/action"),
            ("get", "", "pods", "log", "pods/read"),
            (
                "create",
                "",
                "pods",
                "portforward",
                "pods/portforward/action",
            ),
            (
                "get",
                "stable.example.com",
                "crontabs",
                "",
                "stable.example.com/crontabs/read",
            ),
            ("*", "", "pods", "", "pods/*"),
            ("get", "*", "*", "", "*/*/read"),
            ("*", "", "*", "", "*/*"),
        ];
        for (verb, group, resource, sub, want) in table {
            assert_eq!(
                action(verb, group, resource, sub),
                Ok(format!("{CC}/{want}")),
                "{verb} {group}/{resource}/{sub}"
            );
        }
    }

    #[test]
    fn unmapped_requests_are_refused_with_a_reason() {
        let err = action("frobnicate", "", "pods", "")
            .err()
            .unwrap_or_default();
        assert!(err.contains("frobnicate"), "{err}");
        assert!(action("", "", "pods", "").is_err());
        assert!(action("get", "", "", "").is_err());
        assert!(
            action("get", "a/b", "pods", "").is_err(),
            "a slash would forge another action"
        );
        assert!(action("get", "", "pods/../secrets", "").is_err());
        assert!(data_actions(None, None).is_err());
    }

    #[test]
    fn non_resource_urls() {
        let nr = |verb: &str, path: &str| {
            data_actions(
                None,
                Some(&NonResourceAttributes {
                    path: path.to_owned(),
                    verb: verb.to_owned(),
                }),
            )
            .map(|v| v.join(","))
        };
        assert_eq!(nr("get", "/healthz"), Ok(format!("{CC}/healthz/read")));
        assert_eq!(
            nr("get", "/apis/apps/v1/"),
            Ok(format!("{CC}/apis/apps/v1/read"))
        );
        assert_eq!(nr("post", "/logs"), Ok(format!("{CC}/logs/write")));
        assert_eq!(nr("get", "/metrics/*"), Ok(format!("{CC}/metrics/*/read")));
        assert!(nr("get", "/a/../b").is_err());
        assert!(nr("get", "healthz").is_err());
        assert!(nr("options", "/healthz").is_err());
    }

    #[test]
    fn wildcard_matching() {
        assert!(covers(&format!("{CC}/*"), &format!("{CC}/pods/read")));
        assert!(covers(
            &format!("{CC}/pods/*"),
            &format!("{CC}/pods/exec/action")
        ));
        assert!(covers(
            "microsoft.kubernetes/CONNECTEDCLUSTERS/pods/read",
            &format!("{CC}/pods/read")
        ));
        assert!(
            !covers(&format!("{CC}/pods/read"), &format!("{CC}/pods/*")),
            "a wildcard request needs a wildcard grant"
        );
        assert!(covers(&format!("{CC}/pods/*"), &format!("{CC}/pods/*")));
        assert!(!covers(
            &format!("{CC}/pods/*"),
            &format!("{CC}/podsx/read")
        ));
        assert!(overlaps(
            &format!("{CC}/secrets/*"),
            &format!("{CC}/*/read")
        ));
        assert!(!overlaps(
            &format!("{CC}/secrets/*"),
            &format!("{CC}/pods/read")
        ));
        assert!(overlaps("a*b*c", "*"));
        // Many stars stay cheap.
        let many = "*a".repeat(200);
        assert!(!covers(&many, &"b".repeat(400)));
        assert!(!overlaps(
            &format!("{many}c"),
            &format!("{}b", "a".repeat(400))
        ));
    }

    fn builtin(name: &str) -> RoleDefinition {
        find_role(&[], name)
            .cloned()
            .unwrap_or_else(|| RoleDefinition {
                id: String::new(),
                name: String::new(),
                description: String::new(),
                data_actions: vec![],
                not_data_actions: vec![],
            })
    }

    #[test]
    fn builtin_roles_match_azure() {
        let viewer = builtin("Viewer");
        assert_eq!(viewer.id, "63f0a09d-1495-4db4-a681-037d84835eb4");
        assert!(viewer.grants(&format!("{CC}/pods/read")));
        assert!(
            !viewer.grants(&format!("{CC}/secrets/read")),
            "viewers cannot read secrets"
        );
        assert!(!viewer.grants(&format!("{CC}/pods/exec/action")));
        let writer = builtin("writer");
        assert!(writer.grants(&format!("{CC}/secrets/read")));
        assert!(writer.grants(&format!("{CC}/pods/exec/action")));
        assert!(!writer.grants(&format!("{CC}/rbac.authorization.k8s.io/roles/write")));
        let admin = builtin("Azure Arc Kubernetes Admin");
        assert!(admin.grants(&format!(
            "{CC}/rbac.authorization.k8s.io/rolebindings/write"
        )));
        assert!(!admin.grants(&format!("{CC}/namespaces/write")));
        assert!(!admin.grants(&format!(
            "{CC}/rbac.authorization.k8s.io/clusterroles/write"
        )));
        let cluster_admin = builtin("Cluster Admin");
        assert!(cluster_admin.grants(&format!("{CC}/nodes/delete")));
        assert!(cluster_admin.grants(&format!("{CC}/*")));
        assert!(find_role(&[], "8393591c-06b9-48a2-a542-1bd6b377f6a2").is_some());
        assert!(find_role(&[], "Owner").is_none());
    }

    #[test]
    fn custom_roles_from_json() {
        let az = r#"{"Name": "Pod Reader", "IsCustom": true, "Description": "reads pods",
            "Actions": ["Microsoft.Kubernetes/connectedClusters/read"],
            "DataActions": ["Microsoft.Kubernetes/connectedClusters/pods/*"],
            "NotDataActions": ["Microsoft.Kubernetes/connectedClusters/pods/exec/action"],
            "AssignableScopes": ["/subscriptions/x"]}"#;
        let role = RoleDefinition::from_json(az).map_err(|e| e.to_string());
        let role = role.as_ref().ok();
        assert_eq!(role.map(|r| r.id.as_str()), Some("pod-reader"));
        assert!(role.is_some_and(|r| r.grants(&format!("{CC}/pods/read"))));
        assert!(
            role.is_some_and(|r| !r.grants(&format!("{CC}/pods/exec/action"))),
            "notDataActions subtract"
        );
        assert!(
            role.is_some_and(|r| !r.grants(&format!("{CC}/pods/*"))),
            "wildcard request touches the carve-out"
        );
        let arm = r#"{"id": "/providers/Microsoft.Authorization/roleDefinitions/1234", "name": "1234",
            "properties": {"roleName": "X", "permissions": [{"dataActions": ["Microsoft.Kubernetes/connectedClusters/*"],
            "notDataActions": []}]}}"#;
        let role = RoleDefinition::from_json(arm).ok();
        assert_eq!(
            role.map(|r| (r.id, r.name)),
            Some(("1234".to_owned(), "X".to_owned()))
        );
        let bad = r#"{"name": "x", "dataActions": ["Microsoft.Storage/storageAccounts/*"]}"#;
        assert!(RoleDefinition::from_json(bad).is_err());
        assert!(RoleDefinition::from_json(r#"{"name": "x", "dataActions": []}"#).is_err());
        assert!(RoleDefinition::from_json("[]").is_err());
    }

    const ALICE: &str = "11111111-aaaa";
    const TEAM: &str = "22222222-gggg";

    fn req(user: &str, oid: Option<&str>, groups: &[&str], r: ResourceAttributes) -> AccessRequest {
        let mut extra = BTreeMap::new();
        if let Some(oid) = oid {
            extra.insert("oid".to_owned(), vec![oid.to_owned()]);
        }
        AccessRequest {
            user: user.to_owned(),
            uid: String::new(),
            groups: groups.iter().map(|g| (*g).to_owned()).collect(),
            extra,
            resource: Some(r),
            non_resource: None,
        }
    }

    fn assign(id: &str, role: &str, principal: &str, scope: Scope) -> RoleAssignment {
        RoleAssignment {
            id: id.to_owned(),
            role_id: builtin(role).id,
            principal_id: principal.to_owned(),
            scope,
        }
    }

    #[test]
    fn namespace_and_cluster_scope() {
        let snap = Snapshot {
            version: 1,
            assignments: vec![assign(
                "a1",
                "Viewer",
                ALICE,
                Scope::Namespace("dev".to_owned()),
            )],
            ..Default::default()
        };
        let alice = |r| req("alice@x", Some(ALICE), &[], r);
        let d = decide(&snap, &alice(res("list", "", "pods", "", "dev")));
        assert!(d.allowed, "{d:?}");
        assert!(
            d.reason.contains("Azure Arc Kubernetes Viewer"),
            "{}",
            d.reason
        );
        let d = decide(&snap, &alice(res("list", "", "pods", "", "prod")));
        assert_eq!((d.allowed, d.denied), (false, false));
        assert!(
            d.reason.contains("pods/read") && d.reason.contains("prod"),
            "{}",
            d.reason
        );
        let d = decide(&snap, &alice(res("list", "", "pods", "", "")));
        assert!(
            !d.allowed,
            "a namespace assignment does not grant cluster-wide lists"
        );
        let d = decide(&snap, &alice(res("create", "", "pods", "", "dev")));
        assert!(!d.allowed);

        let snap = Snapshot {
            version: 2,
            assignments: vec![assign("a2", "Writer", ALICE, Scope::Cluster)],
            ..Default::default()
        };
        assert!(decide(&snap, &alice(res("create", "", "pods", "", "prod"))).allowed);
        assert!(decide(&snap, &alice(res("list", "", "namespaces", "", ""))).allowed);
    }

    #[test]
    fn group_assignments_and_deny_wins() {
        let mut snap = Snapshot {
            version: 1,
            assignments: vec![assign("a1", "Cluster Admin", TEAM, Scope::Cluster)],
            ..Default::default()
        };
        let alice = |r| req("alice@x", Some(ALICE), &["system:authenticated", TEAM], r);
        assert!(decide(&snap, &alice(res("delete", "", "secrets", "", "prod"))).allowed);
        let bob = req(
            "bob@x",
            Some("bob-oid"),
            &["other"],
            res("get", "", "pods", "", "prod"),
        );
        assert!(!decide(&snap, &bob).allowed);

        snap.deny_assignments.push(DenyAssignment {
            id: "d1".to_owned(),
            name: "no secrets in prod".to_owned(),
            data_actions: vec![format!("{CC}/secrets/*")],
            not_data_actions: vec![],
            principals: vec![EVERYONE.to_owned()],
            exclude_principals: vec!["breakglass".to_owned()],
            scope: Scope::Namespace("prod".to_owned()),
        });
        let d = decide(&snap, &alice(res("get", "", "secrets", "", "prod")));
        assert_eq!((d.allowed, d.denied), (false, true), "{d:?}");
        assert!(d.reason.contains("no secrets in prod"), "{}", d.reason);
        assert!(decide(&snap, &alice(res("get", "", "secrets", "", "dev"))).allowed);
        assert!(decide(&snap, &alice(res("get", "", "pods", "", "prod"))).allowed);
        let d = decide(&snap, &alice(res("*", "", "*", "", "prod")));
        assert!(d.denied, "a wildcard request that touches a deny is denied");
        let glass = req(
            "bg",
            Some("breakglass"),
            &[TEAM],
            res("get", "", "secrets", "", "prod"),
        );
        assert!(
            decide(&snap, &glass).allowed,
            "excluded principals are not denied"
        );
    }

    #[test]
    fn no_opinion_for_system_and_non_entra_users() {
        let snap = Snapshot {
            version: 1,
            assignments: vec![assign("a1", "Cluster Admin", ALICE, Scope::Cluster)],
            ..Default::default()
        };
        let d = decide(
            &snap,
            &req(
                "system:kube-scheduler",
                Some(ALICE),
                &[],
                res("get", "", "pods", "", ""),
            ),
        );
        assert_eq!((d.allowed, d.denied), (false, false));
        assert!(d.reason.contains("system:"));
        let d = decide(
            &snap,
            &req("jane", None, &[], res("get", "", "pods", "", "")),
        );
        assert_eq!((d.allowed, d.denied), (false, false));
        assert!(d.reason.contains("non-Entra"));
    }

    #[test]
    fn unmapped_verb_is_denied_not_malformed() {
        let snap = Snapshot {
            version: 1,
            assignments: vec![assign("a1", "Cluster Admin", ALICE, Scope::Cluster)],
            ..Default::default()
        };
        let d = decide(
            &snap,
            &req(
                "alice",
                Some(ALICE),
                &[],
                res("approve", "", "pods", "", ""),
            ),
        );
        assert_eq!((d.allowed, d.denied), (false, true));
        assert!(d.reason.contains("approve"), "{}", d.reason);
    }

    #[test]
    fn snapshot_json_round_trip_and_validation() {
        let snap = Snapshot {
            version: 7,
            roles: vec![RoleDefinition {
                id: "pod-reader".to_owned(),
                name: "Pod Reader".to_owned(),
                description: String::new(),
                data_actions: vec![format!("{CC}/pods/read")],
                not_data_actions: vec![],
            }],
            assignments: vec![
                RoleAssignment {
                    id: "a".to_owned(),
                    role_id: "pod-reader".to_owned(),
                    principal_id: ALICE.to_owned(),
                    scope: Scope::Namespace("dev".to_owned()),
                },
                assign("b", "Viewer", TEAM, Scope::Cluster),
            ],
            deny_assignments: vec![],
        };
        let text = serde_json::to_string(&snap).unwrap_or_default();
        assert!(text.contains(r#""scope":{"namespace":"dev"}"#), "{text}");
        assert!(text.contains(r#""scope":"cluster""#), "{text}");
        assert!(text.contains(r#""roleId""#), "{text}");
        let back: Snapshot = serde_json::from_str(&text).unwrap_or_default();
        assert_eq!(back, snap);
        assert!(snap.validate().is_ok());
        let mut broken = snap.clone();
        broken.assignments[0].role_id = "missing".to_owned();
        assert!(broken.validate().is_err());
    }

    // --- Attacks on the policy (issue 10): each failed before the fix it names. ---

    fn deny(id: &str, actions: &[&str], ns: &str) -> DenyAssignment {
        DenyAssignment {
            id: id.to_owned(),
            name: id.to_owned(),
            data_actions: actions.iter().map(|a| format!("{CC}/{a}")).collect(),
            not_data_actions: vec![],
            principals: vec![EVERYONE.to_owned()],
            exclude_principals: vec![],
            scope: Scope::Namespace(ns.to_owned()),
        }
    }

    #[test]
    fn namespace_deny_covers_requests_across_all_namespaces() {
        // `kubectl get secrets -A` is `list secrets` with no namespace: it returns prod's secrets too.
        let snap = Snapshot {
            version: 1,
            assignments: vec![assign("a1", "Writer", ALICE, Scope::Cluster)],
            deny_assignments: vec![deny("no-prod-secrets", &["secrets/*"], "prod")],
            ..Default::default()
        };
        let alice = |r| req("alice@x", Some(ALICE), &[], r);
        for verb in ["list", "watch", "deletecollection", "*"] {
            let d = decide(&snap, &alice(res(verb, "", "secrets", "", "")));
            assert_eq!((d.allowed, d.denied), (false, true), "{verb}: {d:?}");
            assert!(d.reason.contains("all namespaces"), "{}", d.reason);
        }
        let d = decide(&snap, &alice(res("*", "*", "*", "", "")));
        assert!(
            d.denied,
            "a wildcard cluster-wide request spans prod: {d:?}"
        );
        // Other namespaces, other resources and cluster-scoped resources are untouched.
        assert!(decide(&snap, &alice(res("list", "", "secrets", "", "dev"))).allowed);
        assert!(decide(&snap, &alice(res("list", "", "pods", "", ""))).allowed);
        let snap = Snapshot {
            deny_assignments: vec![deny("no-prod-anything", &["*"], "prod")],
            assignments: vec![assign("a1", "Cluster Admin", ALICE, Scope::Cluster)],
            ..snap
        };
        assert!(decide(&snap, &alice(res("list", "", "nodes", "", ""))).allowed);
        assert!(decide(&snap, &alice(res("list", "", "namespaces", "", ""))).allowed);
        assert!(decide(&snap, &alice(res("get", "", "nodes", "", ""))).allowed);
        let d = decide(
            &snap,
            &alice(res("list", "stable.example.com", "crontabs", "", "")),
        );
        assert!(d.denied, "custom resources may be namespaced: {d:?}");
    }

    #[test]
    fn subresources_map_to_their_own_actions_whatever_the_verb() {
        // WebSocket exec/attach/port-forward arrive as `get` on clusters up to 1.34; proxy carries the HTTP verb.
        let table: &[(&str, &str, &str, &str)] = &[
            ("get", "pods", "exec", "pods/exec/action"),
            ("create", "pods", "exec", "pods/exec/action"),
            ("get", "pods", "attach", "pods/attach/action"),
            ("create", "pods", "attach", "pods/attach/action"),
            ("get", "pods", "portforward", "pods/portforward/action"),
            ("create", "pods", "portforward", "pods/portforward/action"),
            ("get", "pods", "proxy", "pods/proxy/action"),
            ("delete", "pods", "proxy", "pods/proxy/action"),
            ("get", "services", "proxy", "services/proxy/action"),
            ("get", "nodes", "proxy", "nodes/proxy/action"),
            (
                "create",
                "serviceaccounts",
                "token",
                "serviceaccounts/token/action",
            ),
            ("get", "pods", "log", "pods/read"),
            ("patch", "pods", "status", "pods/write"),
            ("update", "deployments", "scale", "deployments/write"),
        ];
        for (verb, resource, sub, want) in table {
            assert_eq!(
                action(verb, "", resource, sub),
                Ok(format!("{CC}/{want}")),
                "{verb} {resource}/{sub}"
            );
        }
    }

    #[test]
    fn viewer_cannot_attach_port_forward_exec_or_proxy() {
        let snap = Snapshot {
            version: 1,
            assignments: vec![
                assign("v", "Viewer", ALICE, Scope::Cluster),
                assign("w", "Writer", "bob", Scope::Cluster),
            ],
            ..Default::default()
        };
        let alice = |r| req("alice@x", Some(ALICE), &[], r);
        let bob = |r| req("bob@x", Some("bob"), &[], r);
        for (verb, resource, sub) in [
            ("get", "pods", "attach"),
            ("create", "pods", "attach"),
            ("get", "pods", "portforward"),
            ("create", "pods", "portforward"),
            ("get", "pods", "exec"),
            ("create", "pods", "exec"),
            ("get", "pods", "proxy"),
            ("get", "services", "proxy"),
            ("create", "serviceaccounts", "token"),
        ] {
            let d = decide(&snap, &alice(res(verb, "", resource, sub, "dev")));
            assert!(!d.allowed, "Viewer {verb} {resource}/{sub}: {d:?}");
            // Writer's `pods/*`, `services/*` and `serviceaccounts/*` (Microsoft's definition) grant them.
            let d = decide(&snap, &bob(res(verb, "", resource, sub, "dev")));
            assert!(d.allowed, "Writer {verb} {resource}/{sub}: {d:?}");
        }
        assert!(decide(&snap, &alice(res("get", "", "pods", "log", "dev"))).allowed);
        assert!(!decide(&snap, &bob(res("get", "", "nodes", "proxy", ""))).allowed);
    }

    #[test]
    fn the_agents_identity_cannot_impersonate_reserved_names_or_service_accounts() {
        let protection = Protection {
            agent_namespace: Some("tether-system".to_owned()),
        };
        let imp = |user: &str, group: &str, resource: &str, name: &str, ns: &str| AccessRequest {
            user: user.to_owned(),
            resource: Some(ResourceAttributes {
                name: name.to_owned(),
                ..res("impersonate", group, resource, "", ns)
            }),
            ..Default::default()
        };
        let agent = "system:serviceaccount:tether-system:tether-agent";
        for (group, resource, name, ns) in [
            ("", "users", "system:admin", ""),
            ("", "users", "System:Kube-Controller-Manager", ""),
            ("", "groups", "system:masters", ""),
            ("", "groups", "system:nodes", ""),
            ("", "serviceaccounts", "default", "kube-system"),
        ] {
            let d = agent_impersonation(&imp(agent, group, resource, name, ns), &protection);
            assert!(
                d.as_ref().is_some_and(|d| d.denied && !d.allowed),
                "{resource} {name}: {d:?}"
            );
        }
        // What the agent does impersonate, and everyone else, is left to Kubernetes RBAC.
        for (user, group, resource, name) in [
            (agent, "", "users", "alice@contoso.com"),
            (agent, "", "groups", "5e000000-0000-4000-8000-000000000001"),
            (agent, "authentication.k8s.io", "userextras/oid", "0000"),
            (agent, "authentication.k8s.io", "uids", "0000"),
            (
                "system:serviceaccount:other:tether-agent",
                "",
                "groups",
                "system:masters",
            ),
            (
                "system:serviceaccount:tether-system-2:x",
                "",
                "groups",
                "system:masters",
            ),
            ("admin", "", "groups", "system:masters"),
        ] {
            assert_eq!(
                agent_impersonation(&imp(user, group, resource, name, ""), &protection),
                None,
                "{user} {resource} {name}"
            );
        }
        let mut get = imp(agent, "", "groups", "system:masters", "");
        if let Some(r) = &mut get.resource {
            r.verb = "get".to_owned();
        }
        assert_eq!(agent_impersonation(&get, &protection), None);
        assert_eq!(
            agent_impersonation(
                &imp(agent, "", "groups", "system:masters", ""),
                &Protection::default()
            ),
            None
        );
    }

    #[test]
    fn non_admins_cannot_obtain_the_agents_credentials() {
        let snap = Snapshot {
            version: 1,
            assignments: vec![
                assign("w", "Writer", "alice", Scope::Cluster),
                assign("a", "Admin", "ann", Scope::Cluster),
                assign("c", "Cluster Admin", TEAM, Scope::Cluster),
                assign(
                    "wn",
                    "Writer",
                    "nina",
                    Scope::Namespace("tether-system".to_owned()),
                ),
            ],
            ..Default::default()
        };
        let protection = Protection {
            agent_namespace: Some("tether-system".to_owned()),
        };
        let check = |user: &str, groups: &[&str], r: ResourceAttributes| match prepare(&req(
            user,
            Some(user),
            groups,
            r,
        )) {
            Ok(p) => evaluate_protected(&snap, &p, &protection),
            Err(d) => d,
        };
        let ns = "tether-system";
        let attacks = [
            res("get", "", "secrets", "", ns),
            res("list", "", "secrets", "", ns),
            res("list", "", "secrets", "", ""),
            res("watch", "", "secrets", "", ""),
            res("create", "", "serviceaccounts", "token", ns),
            res("get", "", "pods", "exec", ns),
            res("create", "", "pods", "exec", ns),
            res("create", "", "pods", "attach", ns),
            res("create", "", "pods", "portforward", ns),
            res("create", "", "pods", "", ns),
            res("patch", "apps", "deployments", "", ns),
            res("impersonate", "", "serviceaccounts", "", ns),
            res(
                "create",
                "rbac.authorization.k8s.io",
                "rolebindings",
                "",
                ns,
            ),
        ];
        for who in ["alice", "ann", "nina"] {
            for a in &attacks {
                let d = check(who, &[], a.clone());
                assert_eq!((d.allowed, d.denied), (false, true), "{who} {a:?}: {d:?}");
            }
        }
        assert!(
            check(
                "alice",
                &[],
                res("create", "", "serviceaccounts", "token", "dev")
            )
            .allowed,
            "other namespaces keep Microsoft's Writer definition"
        );
        // Reads stay open; other namespaces are untouched; cluster admins keep everything.
        assert!(check("alice", &[], res("list", "", "pods", "", ns)).allowed);
        assert!(check("alice", &[], res("list", "", "pods", "", "")).allowed);
        assert!(check("alice", &[], res("get", "", "secrets", "", "dev")).allowed);
        assert!(check("alice", &[], res("create", "", "pods", "exec", "dev")).allowed);
        for a in &attacks {
            assert!(check("carol", &[TEAM], a.clone()).allowed, "{a:?}");
        }
        // Without the protection a Writer gets the agent's secrets (what this closes).
        let p = prepare(&req(
            "alice",
            Some("alice"),
            &[],
            res("get", "", "secrets", "", ns),
        ));
        assert!(p.is_ok_and(|p| evaluate_protected(&snap, &p, &Protection::default()).allowed));
    }

    #[test]
    fn a_groups_prefix_is_removed_and_unprefixed_groups_are_ignored() {
        let snap = Snapshot {
            version: 1,
            assignments: vec![assign("a", "Viewer", TEAM, Scope::Cluster)],
            ..Default::default()
        };
        let with = |groups: &[&str], prefix: &str| match prepare_with_prefix(
            &req("a@x", Some("a"), groups, res("get", "", "pods", "", "dev")),
            prefix,
        ) {
            Ok(p) => evaluate(&snap, &p),
            Err(d) => d,
        };
        assert!(with(&["aad-group:22222222-gggg"], "aad-group:").allowed);
        assert!(!with(&[TEAM], "aad-group:").allowed, "not from our tokens");
        assert!(with(&[TEAM], "").allowed);
    }
}
