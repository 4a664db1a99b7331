//! The resources the sample apiserver serves (all in the core group `v1`): their names, discovery documents,
//! validation and defaulting on write, and the server-side table columns `kubectl get` prints.

use serde_json::{Map, Value, json};

use crate::status::{ApiError, FieldError};
use crate::util;

/// The Kubernetes version the sample apiserver reports.
pub(crate) const GIT_VERSION: &str = "v1.33.0-tether-sample";
/// The name of the one node.
pub(crate) const NODE_NAME: &str = "sample-node-1";

/// A served resource.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub(crate) enum Resource {
    ClusterRoleBindings,
    ClusterRoles,
    ConfigMaps,
    CustomResourceDefinitions,
    Deployments,
    Events,
    Namespaces,
    Nodes,
    Pods,
    ReplicaSets,
    RoleBindings,
    Roles,
    Secrets,
    ServiceAccounts,
    Services,
}

impl Resource {
    pub(crate) const ALL: [Resource; 15] = [
        Resource::ClusterRoleBindings,
        Resource::ClusterRoles,
        Resource::ConfigMaps,
        Resource::CustomResourceDefinitions,
        Resource::Deployments,
        Resource::Events,
        Resource::Namespaces,
        Resource::Nodes,
        Resource::Pods,
        Resource::ReplicaSets,
        Resource::RoleBindings,
        Resource::Roles,
        Resource::Secrets,
        Resource::ServiceAccounts,
        Resource::Services,
    ];

    /// The resource named `plural` in API group `group` ("" for the core group).
    pub(crate) fn from_plural(group: &str, plural: &str) -> Option<Resource> {
        Resource::ALL
            .into_iter()
            .find(|r| r.plural() == plural && r.group() == group)
    }

    /// The API group: "" for core, `apps`, `rbac.authorization.k8s.io`, `apiextensions.k8s.io`.
    pub(crate) fn group(self) -> &'static str {
        match self {
            Resource::Deployments | Resource::ReplicaSets => APPS_GROUP,
            Resource::Roles
            | Resource::RoleBindings
            | Resource::ClusterRoles
            | Resource::ClusterRoleBindings => RBAC_GROUP,
            Resource::CustomResourceDefinitions => APIEXTENSIONS_GROUP,
            _ => "",
        }
    }

    /// `v1` for the core group, `GROUP/v1` otherwise (every served group has only v1).
    pub(crate) fn api_version(self) -> &'static str {
        match self.group() {
            APPS_GROUP => "apps/v1",
            RBAC_GROUP => "rbac.authorization.k8s.io/v1",
            APIEXTENSIONS_GROUP => "apiextensions.k8s.io/v1",
            _ => "v1",
        }
    }

    pub(crate) fn plural(self) -> &'static str {
        match self {
            Resource::ClusterRoleBindings => "clusterrolebindings",
            Resource::ClusterRoles => "clusterroles",
            Resource::ConfigMaps => "configmaps",
            Resource::CustomResourceDefinitions => "customresourcedefinitions",
            Resource::Deployments => "deployments",
            Resource::ReplicaSets => "replicasets",
            Resource::RoleBindings => "rolebindings",
            Resource::Roles => "roles",
            Resource::Events => "events",
            Resource::Namespaces => "namespaces",
            Resource::Nodes => "nodes",
            Resource::Pods => "pods",
            Resource::Secrets => "secrets",
            Resource::ServiceAccounts => "serviceaccounts",
            Resource::Services => "services",
        }
    }

    pub(crate) fn singular(self) -> &'static str {
        match self {
            Resource::ClusterRoleBindings => "clusterrolebinding",
            Resource::ClusterRoles => "clusterrole",
            Resource::ConfigMaps => "configmap",
            Resource::CustomResourceDefinitions => "customresourcedefinition",
            Resource::Deployments => "deployment",
            Resource::ReplicaSets => "replicaset",
            Resource::RoleBindings => "rolebinding",
            Resource::Roles => "role",
            Resource::Events => "event",
            Resource::Namespaces => "namespace",
            Resource::Nodes => "node",
            Resource::Pods => "pod",
            Resource::Secrets => "secret",
            Resource::ServiceAccounts => "serviceaccount",
            Resource::Services => "service",
        }
    }

    pub(crate) fn kind(self) -> &'static str {
        match self {
            Resource::ClusterRoleBindings => "ClusterRoleBinding",
            Resource::ClusterRoles => "ClusterRole",
            Resource::ConfigMaps => "ConfigMap",
            Resource::CustomResourceDefinitions => "CustomResourceDefinition",
            Resource::Deployments => "Deployment",
            Resource::ReplicaSets => "ReplicaSet",
            Resource::RoleBindings => "RoleBinding",
            Resource::Roles => "Role",
            Resource::Events => "Event",
            Resource::Namespaces => "Namespace",
            Resource::Nodes => "Node",
            Resource::Pods => "Pod",
            Resource::Secrets => "Secret",
            Resource::ServiceAccounts => "ServiceAccount",
            Resource::Services => "Service",
        }
    }

    pub(crate) fn short_names(self) -> &'static [&'static str] {
        match self {
            Resource::ConfigMaps => &["cm"],
            Resource::CustomResourceDefinitions => &["crd", "crds"],
            Resource::Deployments => &["deploy"],
            Resource::ReplicaSets => &["rs"],
            Resource::ClusterRoleBindings
            | Resource::ClusterRoles
            | Resource::RoleBindings
            | Resource::Roles => &[],
            Resource::Events => &["ev"],
            Resource::Namespaces => &["ns"],
            Resource::Nodes => &["no"],
            Resource::Pods => &["po"],
            Resource::Secrets => &[],
            Resource::ServiceAccounts => &["sa"],
            Resource::Services => &["svc"],
        }
    }

    pub(crate) fn namespaced(self) -> bool {
        !matches!(
            self,
            Resource::Namespaces
                | Resource::Nodes
                | Resource::ClusterRoles
                | Resource::ClusterRoleBindings
                | Resource::CustomResourceDefinitions
        )
    }

    /// Whether the kind has a `status` that writes to the main resource leave alone.
    pub(crate) fn has_status(self) -> bool {
        matches!(
            self,
            Resource::Namespaces
                | Resource::Nodes
                | Resource::Pods
                | Resource::Services
                | Resource::Deployments
                | Resource::ReplicaSets
                | Resource::CustomResourceDefinitions
        )
    }

    fn verbs(self) -> &'static [&'static str] {
        match self {
            Resource::Namespaces => &[
                "create", "delete", "get", "list", "patch", "update", "watch",
            ],
            _ => &[
                "create",
                "delete",
                "deletecollection",
                "get",
                "list",
                "patch",
                "update",
                "watch",
            ],
        }
    }

    /// Names must be DNS-1123 labels for namespaces, subdomains for the rest.
    fn name_is_label(self) -> bool {
        self == Resource::Namespaces
    }
}

/// The `apps` group (Deployments, ReplicaSets).
pub(crate) const APPS_GROUP: &str = "apps";
/// RBAC objects (stored; the built-in authorizer stays [`crate::RbacRule`]s).
pub(crate) const RBAC_GROUP: &str = "rbac.authorization.k8s.io";
/// CustomResourceDefinitions.
pub(crate) const APIEXTENSIONS_GROUP: &str = "apiextensions.k8s.io";

/// `GET /api`.
pub(crate) fn api_versions(server_address: &str) -> Value {
    json!({
        "kind": "APIVersions",
        "versions": ["v1"],
        "serverAddressByClientCIDRs": [{"clientCIDR": "0.0.0.0/0", "serverAddress": server_address}],
    })
}

/// The one API group besides the core group: `authentication.k8s.io/v1`, for `kubectl auth whoami`.
pub(crate) const AUTHENTICATION_GROUP: &str = "authentication.k8s.io";

fn authentication_group() -> Value {
    let version = json!({"groupVersion": "authentication.k8s.io/v1", "version": "v1"});
    json!({"name": AUTHENTICATION_GROUP, "versions": [version], "preferredVersion": version})
}

/// `authorization.k8s.io/v1`, for `kubectl auth can-i`.
pub(crate) const AUTHORIZATION_GROUP: &str = "authorization.k8s.io";

fn authorization_group() -> Value {
    let version = json!({"groupVersion": "authorization.k8s.io/v1", "version": "v1"});
    json!({"name": AUTHORIZATION_GROUP, "versions": [version], "preferredVersion": version})
}

/// `GET /apis/authorization.k8s.io`.
pub(crate) fn authorization_api_group() -> Value {
    let mut group = authorization_group();
    group["kind"] = json!("APIGroup");
    group["apiVersion"] = json!("v1");
    group
}

/// `GET /apis/authorization.k8s.io/v1`.
pub(crate) fn authorization_resource_list() -> Value {
    let review = |name: &str, kind: &str| {
        json!({"name": name, "singularName": name.trim_end_matches('s'), "namespaced": false, "kind": kind,
               "verbs": ["create"]})
    };
    json!({
        "kind": "APIResourceList",
        "apiVersion": "v1",
        "groupVersion": "authorization.k8s.io/v1",
        "resources": [review("selfsubjectaccessreviews", "SelfSubjectAccessReview"),
                      review("selfsubjectrulesreviews", "SelfSubjectRulesReview")],
    })
}

fn served_group(name: &str) -> Value {
    let version = json!({"groupVersion": format!("{name}/v1"), "version": "v1"});
    json!({"name": name, "versions": [version], "preferredVersion": version})
}

/// The groups of built-in resources besides core.
pub(crate) const RESOURCE_GROUPS: [&str; 3] = [APPS_GROUP, RBAC_GROUP, APIEXTENSIONS_GROUP];

/// `GET /apis`.
pub(crate) fn api_group_list() -> Value {
    let mut groups = vec![authentication_group(), authorization_group()];
    groups.extend(RESOURCE_GROUPS.iter().map(|g| served_group(g)));
    json!({"kind": "APIGroupList", "apiVersion": "v1", "groups": groups})
}

/// `GET /apis/GROUP` for a group of [`RESOURCE_GROUPS`].
pub(crate) fn api_group(name: &str) -> Value {
    let mut group = served_group(name);
    group["kind"] = json!("APIGroup");
    group["apiVersion"] = json!("v1");
    group
}

/// `GET /apis/authentication.k8s.io`.
pub(crate) fn authentication_api_group() -> Value {
    let mut group = authentication_group();
    group["kind"] = json!("APIGroup");
    group["apiVersion"] = json!("v1");
    group
}

/// `GET /apis/authentication.k8s.io/v1`.
pub(crate) fn authentication_resource_list() -> Value {
    json!({
        "kind": "APIResourceList",
        "apiVersion": "v1",
        "groupVersion": "authentication.k8s.io/v1",
        "resources": [{"name": "selfsubjectreviews", "singularName": "selfsubjectreview", "namespaced": false,
                       "kind": "SelfSubjectReview", "verbs": ["create"]}],
    })
}

/// The answer to `POST /apis/authentication.k8s.io/v1/selfsubjectreviews`: who the server thinks the caller is.
pub(crate) fn self_subject_review(user: &crate::auth::User) -> Value {
    json!({
        "kind": "SelfSubjectReview",
        "apiVersion": "authentication.k8s.io/v1",
        "metadata": {"creationTimestamp": null},
        "status": {"userInfo": {"username": user.name, "uid": user.uid, "groups": user.groups, "extra": user.extra}},
    })
}

/// `GET /api/v1` (group "") or `GET /apis/GROUP/v1`.
pub(crate) fn api_resource_list(group: &str) -> Value {
    let mut resources: Vec<Value> = Vec::new();
    for r in Resource::ALL.into_iter().filter(|r| r.group() == group) {
        let mut entry = json!({
            "name": r.plural(),
            "singularName": r.singular(),
            "namespaced": r.namespaced(),
            "kind": r.kind(),
            "verbs": r.verbs(),
            "shortNames": r.short_names(),
        });
        if matches!(
            r,
            Resource::Pods | Resource::Services | Resource::Deployments | Resource::ReplicaSets
        ) {
            entry["categories"] = json!(["all"]);
        }
        resources.push(entry);
        if matches!(r, Resource::Deployments | Resource::ReplicaSets) {
            resources.push(json!({"name": format!("{}/scale", r.plural()), "singularName": "", "namespaced": true,
                "group": "autoscaling", "version": "v1", "kind": "Scale", "verbs": ["get", "patch", "update"]}));
            resources.push(json!({"name": format!("{}/status", r.plural()), "singularName": "", "namespaced": true,
                "kind": r.kind(), "verbs": ["get", "patch", "update"]}));
        }
        if r == Resource::Pods {
            resources.push(json!({"name": "pods/exec", "singularName": "", "namespaced": true, "kind": "PodExecOptions", "verbs": ["create", "get"]}));
            resources.push(json!({"name": "pods/log", "singularName": "", "namespaced": true, "kind": "Pod", "verbs": ["get"]}));
            resources.push(json!({"name": "pods/portforward", "singularName": "", "namespaced": true, "kind": "PodPortForwardOptions", "verbs": ["create", "get"]}));
        }
    }
    let group_version = if group.is_empty() {
        "v1".to_string()
    } else {
        format!("{group}/v1")
    };
    json!({"kind": "APIResourceList", "groupVersion": group_version, "resources": resources})
}

/// `GET /version`.
pub(crate) fn version() -> Value {
    json!({
        "major": "1",
        "minor": "33",
        "emulationMajor": "1",
        "emulationMinor": "33",
        "minCompatibilityMajor": "1",
        "minCompatibilityMinor": "32",
        "gitVersion": GIT_VERSION,
        "gitCommit": "0000000000000000000000000000000000000000",
        "gitTreeState": "clean",
        "buildDate": "2026-01-01T00:00:00Z",
        "goVersion": "rust",
        "compiler": "rustc",
        "platform": format!("{}/{}", std::env::consts::OS, go_arch()),
    })
}

fn go_arch() -> &'static str {
    match std::env::consts::ARCH {
        "x86_64" => "amd64",
        "aarch64" => "arm64",
        other => other,
    }
}

const DNS1123_LABEL_MSG: &str = "a lowercase RFC 1123 label must consist of lower case alphanumeric characters or '-', and must start and end with an alphanumeric character (e.g. 'my-name',  or '123-abc', regex used for validation is '[a-z0-9]([-a-z0-9]*[a-z0-9])?')";
const DNS1123_SUBDOMAIN_MSG: &str = "a lowercase RFC 1123 subdomain must consist of lower case alphanumeric characters, '-' or '.', and must start and end with an alphanumeric character (e.g. 'example.com', regex used for validation is '[a-z0-9]([-a-z0-9]*[a-z0-9])?(\\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*')";

pub(crate) fn is_dns1123_label(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= 63
        && s.bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
        && !s.starts_with('-')
        && !s.ends_with('-')
}

fn is_dns1123_subdomain(s: &str) -> bool {
    s.len() <= 253 && s.split('.').all(is_dns1123_label)
}

/// Checks a name given in a URL path or a body: the same rule the resource's validation applies.
pub(crate) fn validate_name(resource: Resource, name: &str) -> Option<FieldError> {
    if resource.name_is_label() {
        (!is_dns1123_label(name))
            .then(|| FieldError::invalid("metadata.name", name, DNS1123_LABEL_MSG))
    } else {
        (!is_dns1123_subdomain(name))
            .then(|| FieldError::invalid("metadata.name", name, DNS1123_SUBDOMAIN_MSG))
    }
}

/// Checks the shape clients send (400 on what would not even decode in kube-apiserver): an object, with matching
/// apiVersion/kind if present, string maps for labels and annotations.
pub(crate) fn check_decodable(resource: Resource, body: &Value) -> Result<(), ApiError> {
    let Value::Object(map) = body else {
        return Err(ApiError::bad_request(
            "the body of the request must be a JSON object",
        ));
    };
    if let Some(v) = map
        .get("apiVersion")
        .filter(|v| v.as_str() != Some(resource.api_version()))
    {
        return Err(ApiError::bad_request(format!(
            "the API version in the data ({}) does not match the expected API version ({})",
            v.as_str().unwrap_or_default(),
            resource.api_version()
        )));
    }
    if let Some(k) = map
        .get("kind")
        .filter(|k| k.as_str() != Some(resource.kind()))
    {
        return Err(ApiError::bad_request(format!(
            "{} in version \"{}\" cannot be handled as a {}: the object provided is unrecognized",
            k.as_str().unwrap_or_default(),
            resource.api_version(),
            resource.kind()
        )));
    }
    let meta = map.get("metadata");
    if meta.is_some_and(|m| !m.is_object() && !m.is_null()) {
        return Err(ApiError::bad_request(format!(
            "{} in version \"v1\" cannot be handled as a {}: metadata must be an object",
            resource.kind(),
            resource.kind()
        )));
    }
    for field in ["labels", "annotations"] {
        if let Some(v) = meta.and_then(|m| m.get(field)) {
            string_map(v, &format!("ObjectMeta.metadata.{field}"), resource)?;
        }
    }
    for field in [
        "name",
        "namespace",
        "generateName",
        "resourceVersion",
        "uid",
    ] {
        if meta
            .and_then(|m| m.get(field))
            .is_some_and(|v| !v.is_string() && !v.is_null())
        {
            return Err(decode_error(
                resource,
                &format!("ObjectMeta.metadata.{field}"),
            ));
        }
    }
    let string_maps: &[&str] = match resource {
        Resource::ConfigMaps => &["data", "binaryData"],
        Resource::Secrets => &["data", "stringData"],
        _ => &[],
    };
    for field in string_maps {
        if let Some(v) = map.get(*field) {
            string_map(v, &format!("{}.{field}", resource.kind()), resource)?;
        }
    }
    if resource == Resource::Secrets
        && map
            .get("type")
            .is_some_and(|t| !t.is_string() && !t.is_null())
    {
        return Err(decode_error(resource, "Secret.type"));
    }
    Ok(())
}

/// What kube-apiserver's conversion does to every write before validation: a Secret's `stringData` is merged
/// into `data` (base64) and dropped, and its `type` defaults to `Opaque`.
pub(crate) fn normalize(resource: Resource, obj: &mut Value) {
    if resource != Resource::Secrets {
        return;
    }
    use base64::Engine as _;
    let string_data = obj
        .as_object_mut()
        .and_then(|m| m.remove("stringData"))
        .and_then(|v| match v {
            Value::Object(m) => Some(m),
            _ => None,
        });
    if let Some(string_data) = string_data
        && let Some(data) = ensure_object(obj, "data")
    {
        for (k, v) in string_data {
            let text = v.as_str().unwrap_or_default();
            data.insert(
                k,
                json!(base64::engine::general_purpose::STANDARD.encode(text)),
            );
        }
    }
    if obj["type"].as_str().is_none_or(str::is_empty) {
        set(obj, "type", json!("Opaque"));
    }
}

/// A configmap or secret key: `[-._a-zA-Z0-9]+`, at most 253 characters.
fn is_config_key(k: &str) -> bool {
    !k.is_empty()
        && k.len() <= 253
        && k.bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.'))
}

const CONFIG_KEY_MSG: &str = "a valid config key must consist of alphanumeric characters, '-', '_' or '.' (e.g. 'key.name',  or 'KEY_NAME',  or 'key-name', regex used for validation is '[-._a-zA-Z0-9]+')";

fn decode_error(resource: Resource, field: &str) -> ApiError {
    ApiError::bad_request(format!(
        "{} in version \"v1\" cannot be handled as a {}: json: cannot unmarshal value into Go struct field {field} of type string",
        resource.kind(),
        resource.kind()
    ))
}

fn string_map(v: &Value, field: &str, resource: Resource) -> Result<(), ApiError> {
    match v {
        Value::Null => Ok(()),
        Value::Object(m) if m.values().all(|x| x.is_string()) => Ok(()),
        _ => Err(decode_error(resource, field)),
    }
}

/// Validation on create and update (422 Invalid).
pub(crate) fn validate(resource: Resource, obj: &Value) -> Result<(), ApiError> {
    let name = obj["metadata"]["name"].as_str().unwrap_or_default();
    let mut errors = Vec::new();
    if let Some(e) = validate_name(resource, name) {
        errors.push(e);
    }
    match resource {
        Resource::ConfigMaps => {
            let mut total = 0usize;
            for field in ["data", "binaryData"] {
                if let Some(map) = obj[field].as_object() {
                    for (k, v) in map {
                        total += v.as_str().map_or(0, str::len);
                        if !is_config_key(k) {
                            errors.push(FieldError::invalid(
                                &format!("{field}[{k}]"),
                                k,
                                CONFIG_KEY_MSG,
                            ));
                        }
                        if field == "binaryData"
                            && v.as_str().is_some_and(|s| base64_decode(s).is_none())
                        {
                            errors.push(FieldError::invalid(
                                &format!("binaryData[{k}]"),
                                "<binary>",
                                "must be base64 encoded",
                            ));
                        }
                        if field == "binaryData" && obj["data"].get(k).is_some() {
                            errors.push(FieldError::invalid(
                                &format!("data[{k}]"),
                                k,
                                "duplicate of key present in binaryData",
                            ));
                        }
                    }
                }
            }
            if total > 1024 * 1024 {
                errors.push(FieldError::too_long("data", 1024 * 1024));
            }
        }
        Resource::Pods => {
            if let Err(e) = validate_pod_spec(obj, "") {
                errors.extend(e);
            }
        }
        Resource::Secrets => {
            let mut total = 0usize;
            for (k, v) in obj["data"].as_object().into_iter().flatten() {
                if !is_config_key(k) {
                    errors.push(FieldError::invalid(
                        &format!("data[{k}]"),
                        k,
                        CONFIG_KEY_MSG,
                    ));
                }
                match v.as_str().map(base64_decode) {
                    Some(Some(bytes)) => total += bytes.len(),
                    _ => errors.push(FieldError::invalid(
                        &format!("data[{k}]"),
                        "<secret contents redacted>",
                        "illegal base64 data",
                    )),
                }
            }
            if total > 1024 * 1024 {
                errors.push(FieldError::too_long("data", 1024 * 1024));
            }
        }
        Resource::Services => {
            let headless = obj["spec"]["clusterIP"] == "None";
            let external_name = obj["spec"]["type"] == "ExternalName";
            match obj["spec"]["ports"].as_array() {
                Some(ports) if !ports.is_empty() => {
                    for (i, p) in ports.iter().enumerate() {
                        if !p["port"].as_u64().is_some_and(|n| (1..=65535).contains(&n)) {
                            errors.push(FieldError::invalid(
                                &format!("spec.ports[{i}].port"),
                                &p["port"].to_string(),
                                "must be between 1 and 65535, inclusive",
                            ));
                        }
                    }
                }
                _ if headless || external_name => {}
                _ => errors.push(FieldError::required("spec.ports", "")),
            }
        }
        Resource::Deployments | Resource::ReplicaSets => {
            let selector = &obj["spec"]["selector"]["matchLabels"];
            let labels = &obj["spec"]["template"]["metadata"]["labels"];
            match selector.as_object() {
                Some(m) if !m.is_empty() => {
                    if m.iter().any(|(k, v)| labels.get(k) != Some(v)) {
                        errors.push(FieldError::invalid(
                            "spec.template.metadata.labels",
                            &labels.to_string(),
                            "`selector` does not match template `labels`",
                        ));
                    }
                }
                _ => errors.push(FieldError::required("spec.selector", "")),
            }
            if obj["spec"]["replicas"]
                .as_i64()
                .is_some_and(|n| !(0..=10_000).contains(&n))
            {
                errors.push(FieldError::invalid(
                    "spec.replicas",
                    &obj["spec"]["replicas"].to_string(),
                    "must be between 0 and 10000 in the sample cluster",
                ));
            }
            let pod = json!({"spec": obj["spec"]["template"]["spec"]});
            if let Err(e) = validate_pod_spec(&pod, "spec.template.") {
                errors.extend(e);
            }
        }
        Resource::RoleBindings | Resource::ClusterRoleBindings => {
            for field in ["kind", "name"] {
                if obj["roleRef"][field].as_str().is_none_or(str::is_empty) {
                    errors.push(FieldError::required(&format!("roleRef.{field}"), ""));
                }
            }
        }
        Resource::CustomResourceDefinitions => {
            let spec = &obj["spec"];
            let group = spec["group"].as_str().unwrap_or_default();
            let plural = spec["names"]["plural"].as_str().unwrap_or_default();
            if name != format!("{plural}.{group}") {
                errors.push(FieldError::invalid(
                    "metadata.name",
                    name,
                    "must be spec.names.plural+\".\"+spec.group",
                ));
            }
            if spec["names"]["kind"].as_str().is_none_or(str::is_empty) {
                errors.push(FieldError::required("spec.names.kind", ""));
            }
            if !matches!(spec["scope"].as_str(), Some("Namespaced" | "Cluster")) {
                errors.push(FieldError::required(
                    "spec.scope",
                    "must be Namespaced or Cluster",
                ));
            }
            if !spec["versions"]
                .as_array()
                .is_some_and(|v| v.iter().any(|v| v["served"] == true))
            {
                errors.push(FieldError::required(
                    "spec.versions",
                    "at least one served version",
                ));
            }
        }
        Resource::Namespaces
        | Resource::Nodes
        | Resource::ServiceAccounts
        | Resource::Events
        | Resource::Roles
        | Resource::ClusterRoles => {}
    }
    if errors.is_empty() {
        Ok(())
    } else {
        Err(ApiError::invalid(resource.kind(), name, &errors))
    }
}

/// The containers of a pod (or pod template) spec; `prefix` goes before `spec.` in field paths.
fn validate_pod_spec(obj: &Value, prefix: &str) -> Result<(), Vec<FieldError>> {
    let mut errors = Vec::new();
    match obj["spec"]["containers"].as_array() {
        Some(containers) if !containers.is_empty() => {
            for (i, c) in containers.iter().enumerate() {
                let field = format!("{prefix}spec.containers[{i}]");
                match c["name"].as_str() {
                    None | Some("") => {
                        errors.push(FieldError::required(&format!("{field}.name"), ""))
                    }
                    Some(n) if !is_dns1123_label(n) => {
                        errors.push(FieldError::invalid(
                            &format!("{field}.name"),
                            n,
                            DNS1123_LABEL_MSG,
                        ));
                    }
                    Some(_) => {}
                }
                if c["image"].as_str().is_none_or(str::is_empty) {
                    errors.push(FieldError::required(&format!("{field}.image"), ""));
                }
            }
        }
        _ => errors.push(FieldError::required(
            &format!("{prefix}spec.containers"),
            "",
        )),
    }
    if errors.is_empty() {
        Ok(())
    } else {
        Err(errors)
    }
}

fn base64_decode(s: &str) -> Option<Vec<u8>> {
    use base64::Engine as _;
    base64::engine::general_purpose::STANDARD.decode(s).ok()
}

/// The map under `key` in `v`, made an empty map first if missing or not a map; None if `v` is not an object.
fn ensure_object<'a>(v: &'a mut Value, key: &str) -> Option<&'a mut Map<String, Value>> {
    let slot = v
        .as_object_mut()?
        .entry(key)
        .or_insert_with(|| Value::Object(Map::new()));
    if !slot.is_object() {
        *slot = Value::Object(Map::new());
    }
    slot.as_object_mut()
}

/// Sets `key` in `v` if `v` is an object.
fn set(v: &mut Value, key: &str, value: Value) {
    if let Some(map) = v.as_object_mut() {
        map.insert(key.to_string(), value);
    }
}

/// Fills what a fresh object gets in a real cluster (status from controllers and the "kubelet" included, so the
/// demo looks alive): namespaces become Active, pods Running on the one node.
pub(crate) fn default_on_create(resource: Resource, obj: &mut Value, now: &str) {
    match resource {
        Resource::Namespaces => {
            if let Some(spec) = ensure_object(obj, "spec") {
                spec.entry("finalizers").or_insert(json!(["kubernetes"]));
            }
            set(obj, "status", json!({"phase": "Active"}));
            let name = obj["metadata"]["name"].clone();
            if let Some(labels) = ensure_object(obj, "metadata").and_then(|m| {
                let slot = m
                    .entry("labels")
                    .or_insert_with(|| Value::Object(Map::new()));
                slot.as_object_mut()
            }) {
                labels.insert("kubernetes.io/metadata.name".into(), name);
            }
        }
        Resource::Pods => default_pod(obj, now),
        Resource::Services => default_service(obj),
        Resource::Events => {
            let involved = obj["involvedObject"].clone();
            if let Some(meta) = ensure_object(obj, "metadata")
                && !meta.contains_key("namespace")
            {
                meta.insert("namespace".into(), involved["namespace"].clone());
            }
            for field in ["firstTimestamp", "lastTimestamp"] {
                if obj[field].is_null() {
                    set(obj, field, json!(now));
                }
            }
            if obj["count"].is_null() {
                set(obj, "count", json!(1));
            }
        }
        Resource::Deployments | Resource::ReplicaSets => {
            if let Some(spec) = ensure_object(obj, "spec") {
                spec.entry("replicas").or_insert(json!(1));
                spec.entry("revisionHistoryLimit").or_insert(json!(10));
                if resource == Resource::Deployments {
                    spec.entry("progressDeadlineSeconds").or_insert(json!(600));
                    spec.entry("strategy")
                        .or_insert(json!({"type": "RollingUpdate",
                        "rollingUpdate": {"maxSurge": "25%", "maxUnavailable": "25%"}}));
                }
            }
            if let Some(meta) = ensure_object(obj, "metadata") {
                meta.insert("generation".into(), json!(1));
            }
            set(obj, "status", json!({}));
        }
        Resource::CustomResourceDefinitions => {
            let names = obj["spec"]["names"].clone();
            set(
                obj,
                "status",
                json!({"acceptedNames": names, "storedVersions": [obj["spec"]["versions"][0]["name"]],
                       "conditions": [
                           {"type": "NamesAccepted", "status": "True", "reason": "NoConflicts", "lastTransitionTime": now},
                           {"type": "Established", "status": "True", "reason": "InitialNamesAccepted", "lastTransitionTime": now}]}),
            );
        }
        Resource::ConfigMaps
        | Resource::Nodes
        | Resource::Secrets
        | Resource::ServiceAccounts
        | Resource::Roles
        | Resource::RoleBindings
        | Resource::ClusterRoles
        | Resource::ClusterRoleBindings => {}
    }
}

fn default_service(obj: &mut Value) {
    let Some(spec) = ensure_object(obj, "spec") else {
        return;
    };
    spec.entry("type").or_insert(json!("ClusterIP"));
    spec.entry("sessionAffinity").or_insert(json!("None"));
    if spec.get("type") != Some(&json!("ExternalName")) {
        let ip = spec
            .entry("clusterIP")
            .or_insert_with(|| {
                json!(format!(
                    "10.96.{}.{}",
                    rand::random_range(0..255u8),
                    rand::random_range(2..255u8)
                ))
            })
            .clone();
        spec.entry("clusterIPs").or_insert(json!([ip]));
        spec.entry("ipFamilies").or_insert(json!(["IPv4"]));
        spec.entry("ipFamilyPolicy").or_insert(json!("SingleStack"));
        spec.entry("internalTrafficPolicy")
            .or_insert(json!("Cluster"));
    }
    if let Some(ports) = spec.get_mut("ports").and_then(Value::as_array_mut) {
        for p in ports.iter_mut().filter_map(Value::as_object_mut) {
            p.entry("protocol").or_insert(json!("TCP"));
            let port = p.get("port").cloned().unwrap_or(Value::Null);
            p.entry("targetPort").or_insert(port);
        }
    }
    set(obj, "status", json!({"loadBalancer": {}}));
}

fn default_pod(obj: &mut Value, now: &str) {
    if let Some(spec) = ensure_object(obj, "spec") {
        spec.entry("nodeName").or_insert(json!(NODE_NAME));
        spec.entry("restartPolicy").or_insert(json!("Always"));
        spec.entry("dnsPolicy").or_insert(json!("ClusterFirst"));
        spec.entry("schedulerName")
            .or_insert(json!("default-scheduler"));
        spec.entry("terminationGracePeriodSeconds")
            .or_insert(json!(30));
        if let Some(containers) = spec.get_mut("containers").and_then(Value::as_array_mut) {
            for c in containers.iter_mut().filter_map(Value::as_object_mut) {
                c.entry("imagePullPolicy").or_insert(json!("IfNotPresent"));
                c.entry("terminationMessagePath")
                    .or_insert(json!("/dev/termination-log"));
                c.entry("terminationMessagePolicy").or_insert(json!("File"));
            }
        }
    }
    let statuses: Vec<Value> = obj["spec"]["containers"]
        .as_array()
        .map(|cs| {
            cs.iter()
                .map(|c| {
                    json!({
                        "name": c["name"],
                        "image": c["image"],
                        "imageID": format!("sample://{}", c["image"].as_str().unwrap_or_default()),
                        "containerID": format!("sample://{}", util::random_token()),
                        "ready": true,
                        "started": true,
                        "restartCount": 0,
                        "state": {"running": {"startedAt": now}},
                    })
                })
                .collect()
        })
        .unwrap_or_default();
    let condition = |t: &str| json!({"type": t, "status": "True", "lastProbeTime": null, "lastTransitionTime": now});
    let pod_ip = format!("10.244.0.{}", rand::random_range(2..250u8));
    set(
        obj,
        "status",
        json!({
            "phase": "Running",
            "hostIP": "10.0.0.11",
            "hostIPs": [{"ip": "10.0.0.11"}],
            "podIP": pod_ip,
            "podIPs": [{"ip": pod_ip}],
            "startTime": now,
            "qosClass": "BestEffort",
            "conditions": [condition("PodReadyToStartContainers"), condition("Initialized"), condition("Ready"),
                           condition("ContainersReady"), condition("PodScheduled")],
            "containerStatuses": statuses,
        }),
    );
}

/// The one node of the sample cluster.
pub(crate) fn sample_node() -> Value {
    let mut node = node(
        NODE_NAME,
        "4",
        "8Gi",
        &[
            ("node.kubernetes.io/instance-type", "sample"),
            ("topology.kubernetes.io/region", "sample-region"),
            ("topology.kubernetes.io/zone", "sample-zone-a"),
        ],
        &format!("sample://{NODE_NAME}"),
    );
    node["spec"]["podCIDR"] = json!("10.244.0.0/24");
    node["status"]["addresses"] = json!([{"type": "InternalIP", "address": "10.0.0.11"}, {"type": "Hostname", "address": NODE_NAME}]);
    node
}

/// A Ready node with `cpu` and `memory` (Kubernetes quantities) as capacity and allocatable, the standard
/// hostname/os/arch labels plus `labels`, and `provider_id` (none when empty).
pub(crate) fn node(
    name: &str,
    cpu: &str,
    memory: &str,
    labels: &[(&str, &str)],
    provider_id: &str,
) -> Value {
    let mut all = Map::new();
    all.insert("kubernetes.io/hostname".into(), json!(name));
    all.insert("kubernetes.io/os".into(), json!("linux"));
    all.insert("kubernetes.io/arch".into(), json!(go_arch()));
    for (k, v) in labels {
        all.insert((*k).to_string(), json!(v));
    }
    let mut spec = Map::new();
    if !provider_id.is_empty() {
        spec.insert("providerID".into(), json!(provider_id));
    }
    json!({
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {"name": name, "labels": all},
        "spec": spec,
        "status": {
            "capacity": {"cpu": cpu, "memory": memory, "pods": "110", "ephemeral-storage": "100Gi"},
            "allocatable": {"cpu": cpu, "memory": memory, "pods": "110", "ephemeral-storage": "100Gi"},
            "conditions": [{"type": "Ready", "status": "True", "reason": "KubeletReady", "message": "kubelet is posting ready status"}],
            "addresses": [{"type": "Hostname", "address": name}],
            "nodeInfo": {
                "kubeletVersion": GIT_VERSION,
                "osImage": "Tether Sample OS",
                "kernelVersion": "6.0.0-sample",
                "containerRuntimeVersion": "sample://1.0.0",
                "operatingSystem": "linux",
                "architecture": go_arch(),
                "machineID": "", "systemUUID": "", "bootID": "", "kubeProxyVersion": "",
            },
        },
    })
}

/// The seeded pod `default/demo`.
pub(crate) fn demo_pod() -> Value {
    json!({
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "demo", "namespace": "default", "labels": {"app": "demo"}},
        "spec": {"containers": [{"name": "main", "image": "tether/sample-demo:1.0"}]},
    })
}

/// The `default/kubernetes` service every cluster has.
pub(crate) fn kubernetes_service() -> Value {
    json!({
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": "kubernetes", "namespace": "default",
                     "labels": {"component": "apiserver", "provider": "kubernetes"}},
        "spec": {"clusterIP": "10.96.0.1", "ports": [{"name": "https", "port": 443, "protocol": "TCP", "targetPort": 6443}]},
    })
}

/// The seeded service `default/demo` in front of the demo pod (HTTP on 80, echo on 7).
pub(crate) fn demo_service() -> Value {
    json!({
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": "demo", "namespace": "default", "labels": {"app": "demo"}},
        "spec": {"selector": {"app": "demo"}, "ports": [
            {"name": "http", "port": 80, "protocol": "TCP", "targetPort": 80},
            {"name": "echo", "port": 7, "protocol": "TCP", "targetPort": 7},
        ]},
    })
}

/// The seeded secret `default/demo-credentials`: what a Viewer must not read.
pub(crate) fn demo_secret() -> Value {
    json!({
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {"name": "demo-credentials", "namespace": "default"},
        "type": "Opaque",
        "stringData": {"username": "demo", "password": "sample-password-not-a-secret"},
    })
}

/// The `default` service account a namespace gets when it is created.
pub(crate) fn default_service_account(namespace: &str) -> Value {
    json!({
        "apiVersion": "v1",
        "kind": "ServiceAccount",
        "metadata": {"name": "default", "namespace": namespace},
    })
}

/// One column of a server-side table.
struct Column {
    name: &'static str,
    kind: &'static str,
    format: &'static str,
    priority: u8,
    description: &'static str,
}

const fn col(
    name: &'static str,
    kind: &'static str,
    format: &'static str,
    priority: u8,
    description: &'static str,
) -> Column {
    Column {
        name,
        kind,
        format,
        priority,
        description,
    }
}

fn columns(resource: Resource) -> &'static [Column] {
    const NAME: Column = col(
        "Name",
        "string",
        "name",
        0,
        "Name must be unique within a namespace.",
    );
    const AGE: Column = col(
        "Age",
        "string",
        "",
        0,
        "CreationTimestamp is a timestamp representing the server time when this object was created.",
    );
    const CONFIGMAPS: &[Column] = &[
        NAME,
        col(
            "Data",
            "string",
            "",
            0,
            "Data contains the configuration data.",
        ),
        AGE,
    ];
    const NAMESPACES: &[Column] = &[
        NAME,
        col("Status", "string", "", 0, "The status of the namespace"),
        AGE,
    ];
    const NODES: &[Column] = &[
        NAME,
        col("Status", "string", "", 0, "The status of the node"),
        col("Roles", "string", "", 0, "The roles of the node"),
        AGE,
        col(
            "Version",
            "string",
            "",
            0,
            "Kubelet Version reported by the node.",
        ),
        col(
            "Internal-IP",
            "string",
            "",
            1,
            "List of addresses reachable to the node. Queried from cloud provider, if available.",
        ),
        col(
            "External-IP",
            "string",
            "",
            1,
            "List of addresses reachable to the node. Queried from cloud provider, if available.",
        ),
        col(
            "OS-Image",
            "string",
            "",
            1,
            "OS Image reported by the node from /etc/os-release (e.g. Debian GNU/Linux 7 (wheezy)).",
        ),
        col(
            "Kernel-Version",
            "string",
            "",
            1,
            "Kernel Version reported by the node from 'uname -r' (e.g. 3.16.0-0.bpo.4-amd64).",
        ),
        col(
            "Container-Runtime",
            "string",
            "",
            1,
            "ContainerRuntime Version reported by the node through runtime remote API (e.g. containerd://1.4.2).",
        ),
    ];
    const PODS: &[Column] = &[
        NAME,
        col(
            "Ready",
            "string",
            "",
            0,
            "The aggregate readiness state of this pod for accepting traffic.",
        ),
        col(
            "Status",
            "string",
            "",
            0,
            "The aggregate status of the containers in this pod.",
        ),
        col(
            "Restarts",
            "string",
            "",
            0,
            "The number of times the containers in this pod have been restarted and when the last container in this pod has restarted.",
        ),
        AGE,
        col("IP", "string", "", 1, "The IP address assigned to the pod"),
        col(
            "Node",
            "string",
            "",
            1,
            "The name of the node to which the pod is scheduled",
        ),
        col(
            "Nominated Node",
            "string",
            "",
            1,
            "The name of the node where the pod is nominated to run",
        ),
        col(
            "Readiness Gates",
            "string",
            "",
            1,
            "The readiness gates of this pod",
        ),
    ];
    const SECRETS: &[Column] = &[
        NAME,
        col("Type", "string", "", 0, "The type of the secret"),
        col(
            "Data",
            "string",
            "",
            0,
            "The number of data items in the secret",
        ),
        AGE,
    ];
    const SERVICE_ACCOUNTS: &[Column] = &[
        NAME,
        col(
            "Secrets",
            "string",
            "",
            0,
            "The number of secrets referenced by the service account",
        ),
        AGE,
    ];
    const SERVICES: &[Column] = &[
        NAME,
        col(
            "Type",
            "string",
            "",
            0,
            "The type of the service (ClusterIP, NodePort, LoadBalancer, ExternalName).",
        ),
        col(
            "Cluster-IP",
            "string",
            "",
            0,
            "The IP address assigned to the service in the cluster.",
        ),
        col(
            "External-IP",
            "string",
            "",
            0,
            "The external IP addresses of the service.",
        ),
        col(
            "Port(s)",
            "string",
            "",
            0,
            "The list of ports exposed by the service.",
        ),
        AGE,
        col(
            "Selector",
            "string",
            "",
            1,
            "Route service traffic to pods with label keys and values matching this selector.",
        ),
    ];
    const EVENTS: &[Column] = &[
        col(
            "Last Seen",
            "string",
            "",
            0,
            "The time at which the most recent occurrence of this event was recorded.",
        ),
        col(
            "Type",
            "string",
            "",
            0,
            "Type of this event (Normal, Warning).",
        ),
        col(
            "Reason",
            "string",
            "",
            0,
            "A short, machine understandable string that gives the reason for the transition into the object's current status.",
        ),
        col(
            "Object",
            "string",
            "",
            0,
            "The object that this event is about.",
        ),
        col(
            "Message",
            "string",
            "",
            0,
            "A human-readable description of the status of this operation.",
        ),
        col(
            "Source",
            "string",
            "",
            1,
            "The component reporting this event.",
        ),
        col(
            "First Seen",
            "string",
            "",
            1,
            "The time at which the event was first recorded.",
        ),
        col(
            "Count",
            "string",
            "",
            1,
            "The number of times this event has occurred.",
        ),
        col(
            "Name",
            "string",
            "name",
            1,
            "Name must be unique within a namespace.",
        ),
    ];
    const DEPLOYMENTS: &[Column] = &[
        NAME,
        col(
            "Ready",
            "string",
            "",
            0,
            "Number of the pod with ready state",
        ),
        col(
            "Up-to-date",
            "string",
            "",
            0,
            "Total number of non-terminated pods targeted by this deployment that have the desired template spec.",
        ),
        col(
            "Available",
            "string",
            "",
            0,
            "Total number of available pods (ready for at least minReadySeconds) targeted by this deployment.",
        ),
        AGE,
        col(
            "Containers",
            "string",
            "",
            1,
            "Names of each container in the template.",
        ),
        col(
            "Images",
            "string",
            "",
            1,
            "Images referenced by each container in the template.",
        ),
        col("Selector", "string", "", 1, "Label selector for pods."),
    ];
    const REPLICA_SETS: &[Column] = &[
        NAME,
        col("Desired", "integer", "", 0, "Number of desired pods."),
        col(
            "Current",
            "integer",
            "",
            0,
            "The most recently observed number of replicas.",
        ),
        col(
            "Ready",
            "integer",
            "",
            0,
            "The number of ready replicas for this replica set.",
        ),
        AGE,
        col(
            "Containers",
            "string",
            "",
            1,
            "Names of each container in the template.",
        ),
        col(
            "Images",
            "string",
            "",
            1,
            "Images referenced by each container in the template.",
        ),
        col("Selector", "string", "", 1, "Label selector for pods."),
    ];
    const CREATED_AT: &[Column] = &[
        NAME,
        col(
            "Created At",
            "date",
            "",
            0,
            "CreationTimestamp is a timestamp representing the server time when this object was created.",
        ),
    ];
    const BINDINGS: &[Column] = &[
        NAME,
        col(
            "Role",
            "string",
            "",
            0,
            "RoleRef references the role being granted.",
        ),
        AGE,
        col("Users", "string", "", 1, "Users in the binding."),
        col("Groups", "string", "", 1, "Groups in the binding."),
        col(
            "ServiceAccounts",
            "string",
            "",
            1,
            "ServiceAccounts in the binding.",
        ),
    ];
    match resource {
        Resource::ConfigMaps => CONFIGMAPS,
        Resource::Deployments => DEPLOYMENTS,
        Resource::ReplicaSets => REPLICA_SETS,
        Resource::Roles | Resource::ClusterRoles | Resource::CustomResourceDefinitions => {
            CREATED_AT
        }
        Resource::RoleBindings | Resource::ClusterRoleBindings => BINDINGS,
        Resource::Events => EVENTS,
        Resource::Namespaces => NAMESPACES,
        Resource::Nodes => NODES,
        Resource::Pods => PODS,
        Resource::Secrets => SECRETS,
        Resource::ServiceAccounts => SERVICE_ACCOUNTS,
        Resource::Services => SERVICES,
    }
}

fn cells(resource: Resource, obj: &Value) -> Vec<Value> {
    let name = json!(obj["metadata"]["name"].as_str().unwrap_or_default());
    let age = json!(util::age(obj["metadata"]["creationTimestamp"].as_str()));
    let s = |v: &Value| json!(v.as_str().unwrap_or("<none>"));
    match resource {
        Resource::ConfigMaps => {
            let count = ["data", "binaryData"]
                .iter()
                .map(|f| obj[*f].as_object().map_or(0, Map::len))
                .sum::<usize>();
            vec![name, json!(count), age]
        }
        Resource::Namespaces => vec![name, s(&obj["status"]["phase"]), age],
        Resource::Deployments | Resource::ReplicaSets => {
            let spec = &obj["spec"];
            let status = &obj["status"];
            let n = |v: &Value| v.as_i64().unwrap_or(0);
            let containers = spec["template"]["spec"]["containers"]
                .as_array()
                .cloned()
                .unwrap_or_default();
            let join = |key: &str| {
                containers
                    .iter()
                    .filter_map(|c| c[key].as_str())
                    .collect::<Vec<_>>()
                    .join(",")
            };
            let selector = spec["selector"]["matchLabels"]
                .as_object()
                .into_iter()
                .flatten()
                .map(|(k, v)| format!("{k}={}", v.as_str().unwrap_or_default()))
                .collect::<Vec<_>>()
                .join(",");
            let mut row = if resource == Resource::Deployments {
                vec![
                    name,
                    json!(format!(
                        "{}/{}",
                        n(&status["readyReplicas"]),
                        n(&spec["replicas"])
                    )),
                    json!(n(&status["updatedReplicas"])),
                    json!(n(&status["availableReplicas"])),
                    age,
                ]
            } else {
                vec![
                    name,
                    json!(n(&spec["replicas"])),
                    json!(n(&status["replicas"])),
                    json!(n(&status["readyReplicas"])),
                    age,
                ]
            };
            row.extend([json!(join("name")), json!(join("image")), json!(selector)]);
            row
        }
        Resource::Roles | Resource::ClusterRoles | Resource::CustomResourceDefinitions => {
            vec![name, obj["metadata"]["creationTimestamp"].clone()]
        }
        Resource::RoleBindings | Resource::ClusterRoleBindings => {
            let of = |kind: &str| {
                let names: Vec<String> = obj["subjects"]
                    .as_array()
                    .into_iter()
                    .flatten()
                    .filter(|s| s["kind"] == kind)
                    .map(|s| match s["namespace"].as_str() {
                        Some(ns) if kind == "ServiceAccount" => {
                            format!("{ns}/{}", s["name"].as_str().unwrap_or_default())
                        }
                        _ => s["name"].as_str().unwrap_or_default().to_string(),
                    })
                    .collect();
                json!(names.join(", "))
            };
            vec![
                name,
                json!(format!(
                    "{}/{}",
                    obj["roleRef"]["kind"].as_str().unwrap_or_default(),
                    obj["roleRef"]["name"].as_str().unwrap_or_default()
                )),
                age,
                of("User"),
                of("Group"),
                of("ServiceAccount"),
            ]
        }
        Resource::Secrets => {
            let count = obj["data"].as_object().map_or(0, Map::len);
            vec![name, s(&obj["type"]), json!(count), age]
        }
        Resource::ServiceAccounts => {
            let count = obj["secrets"].as_array().map_or(0, Vec::len);
            vec![name, json!(count), age]
        }
        Resource::Services => {
            let spec = &obj["spec"];
            let ports: Vec<String> = spec["ports"]
                .as_array()
                .into_iter()
                .flatten()
                .map(|p| {
                    let proto = p["protocol"].as_str().unwrap_or("TCP");
                    match p["nodePort"].as_u64() {
                        Some(node) => format!("{}:{node}/{proto}", p["port"]),
                        None => format!("{}/{proto}", p["port"]),
                    }
                })
                .collect();
            let selector: Vec<String> = spec["selector"]
                .as_object()
                .into_iter()
                .flatten()
                .map(|(k, v)| format!("{k}={}", v.as_str().unwrap_or_default()))
                .collect();
            let join = |v: Vec<String>| {
                if v.is_empty() {
                    "<none>".to_string()
                } else {
                    v.join(",")
                }
            };
            vec![
                name,
                s(&spec["type"]),
                s(&spec["clusterIP"]),
                json!("<none>"),
                json!(join(ports)),
                age,
                json!(join(selector)),
            ]
        }
        Resource::Events => {
            let involved = &obj["involvedObject"];
            let kind = involved["kind"]
                .as_str()
                .unwrap_or_default()
                .to_ascii_lowercase();
            let last = obj["lastTimestamp"].as_str().or(obj["eventTime"].as_str());
            let source = [&obj["source"]["component"], &obj["source"]["host"]]
                .iter()
                .filter_map(|v| v.as_str())
                .collect::<Vec<_>>()
                .join(", ");
            vec![
                json!(util::age(last)),
                s(&obj["type"]),
                s(&obj["reason"]),
                json!(format!(
                    "{kind}/{}",
                    involved["name"].as_str().unwrap_or_default()
                )),
                s(&obj["message"]),
                json!(source),
                json!(util::age(obj["firstTimestamp"].as_str())),
                json!(obj["count"].as_u64().unwrap_or(1).to_string()),
                name,
            ]
        }
        Resource::Nodes => {
            let ready = obj["status"]["conditions"]
                .as_array()
                .and_then(|cs| cs.iter().find(|c| c["type"] == "Ready"))
                .map_or("Unknown", |c| {
                    if c["status"] == "True" {
                        "Ready"
                    } else {
                        "NotReady"
                    }
                });
            let address = |t: &str| {
                obj["status"]["addresses"]
                    .as_array()
                    .and_then(|a| a.iter().find(|x| x["type"] == t))
                    .and_then(|x| x["address"].as_str())
                    .unwrap_or("<none>")
                    .to_string()
            };
            let info = &obj["status"]["nodeInfo"];
            vec![
                name,
                json!(ready),
                json!("<none>"),
                age,
                s(&info["kubeletVersion"]),
                json!(address("InternalIP")),
                json!(address("ExternalIP")),
                s(&info["osImage"]),
                s(&info["kernelVersion"]),
                s(&info["containerRuntimeVersion"]),
            ]
        }
        Resource::Pods => {
            let statuses = obj["status"]["containerStatuses"]
                .as_array()
                .cloned()
                .unwrap_or_default();
            let total = obj["spec"]["containers"].as_array().map_or(0, Vec::len);
            let ready = statuses.iter().filter(|c| c["ready"] == true).count();
            let restarts: u64 = statuses
                .iter()
                .filter_map(|c| c["restartCount"].as_u64())
                .sum();
            let status = if obj["metadata"]["deletionTimestamp"].is_string() {
                "Terminating"
            } else {
                obj["status"]["phase"].as_str().unwrap_or("Pending")
            };
            vec![
                name,
                json!(format!("{ready}/{total}")),
                json!(status),
                json!(restarts.to_string()),
                age,
                s(&obj["status"]["podIP"]),
                s(&obj["spec"]["nodeName"]),
                json!("<none>"),
                json!("<none>"),
            ]
        }
    }
}

/// How much of each object a table row carries (`includeObject=`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum IncludeObject {
    None,
    Metadata,
    Object,
}

/// The row `object` for `obj`.
fn row_object(obj: &Value, include: IncludeObject) -> Value {
    match include {
        IncludeObject::None => Value::Null,
        IncludeObject::Metadata => partial_metadata(obj),
        IncludeObject::Object => obj.clone(),
    }
}

/// `obj` as a `PartialObjectMetadata`.
pub(crate) fn partial_metadata(obj: &Value) -> Value {
    json!({"kind": "PartialObjectMetadata", "apiVersion": "meta.k8s.io/v1", "metadata": obj["metadata"]})
}

/// A `meta.k8s.io/v1` Table for `objects`; `list_meta` is the list metadata (resourceVersion, continue).
pub(crate) fn table(
    resource: Resource,
    objects: &[Value],
    list_meta: Value,
    include: IncludeObject,
    with_columns: bool,
) -> Value {
    let column_definitions: Vec<Value> = if with_columns {
        columns(resource)
            .iter()
            .map(|c| json!({"name": c.name, "type": c.kind, "format": c.format, "description": c.description, "priority": c.priority}))
            .collect()
    } else {
        Vec::new()
    };
    let rows: Vec<Value> = objects
        .iter()
        .map(|o| {
            let mut row = json!({"cells": cells(resource, o)});
            let object = row_object(o, include);
            if !object.is_null() {
                row["object"] = object;
            }
            row
        })
        .collect();
    json!({"kind": "Table", "apiVersion": "meta.k8s.io/v1", "metadata": list_meta, "columnDefinitions": column_definitions, "rows": rows})
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_follow_dns_rules() {
        assert!(validate_name(Resource::ConfigMaps, "a.b-c").is_none());
        assert!(validate_name(Resource::Namespaces, "a.b").is_some());
        assert!(validate_name(Resource::ConfigMaps, "Upper").is_some());
        assert!(validate_name(Resource::ConfigMaps, "").is_some());
        assert!(validate_name(Resource::ConfigMaps, "-a").is_some());
        assert!(validate_name(Resource::Pods, &"a".repeat(254)).is_some());
    }

    #[test]
    fn decode_checks_reject_wrong_shapes() {
        let ok = json!({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "x", "labels": {"a": "b"}}, "data": {"k": "v"}});
        assert!(check_decodable(Resource::ConfigMaps, &ok).is_ok());
        for bad in [
            json!([1]),
            json!({"kind": "Pod"}),
            json!({"apiVersion": "apps/v1"}),
            json!({"metadata": {"labels": {"a": 1}}}),
            json!({"metadata": "x"}),
            json!({"data": {"k": 1}}),
            json!({"metadata": {"name": 5}}),
        ] {
            assert_eq!(
                check_decodable(Resource::ConfigMaps, &bad).map_err(|e| e.code),
                Err(400),
                "{bad}"
            );
        }
    }

    #[test]
    fn validation_reports_field_errors() {
        let bad_pod =
            json!({"metadata": {"name": "p"}, "spec": {"containers": [{"name": "Main"}]}});
        let err = validate(Resource::Pods, &bad_pod).err();
        assert_eq!(err.as_ref().map(|e| e.code), Some(422));
        assert_eq!(
            err.and_then(|e| e.details)
                .map(|d| d["causes"].as_array().map_or(0, Vec::len)),
            Some(2)
        );
        let bad_cm = json!({"metadata": {"name": "c"}, "data": {"bad key": "v"}});
        assert!(validate(Resource::ConfigMaps, &bad_cm).is_err());
        let good_cm =
            json!({"metadata": {"name": "c"}, "data": {"k": "v"}, "binaryData": {"b": "aGk="}});
        assert!(validate(Resource::ConfigMaps, &good_cm).is_ok());
    }

    #[test]
    fn pod_table_row() {
        let mut pod = demo_pod();
        pod["metadata"]["creationTimestamp"] =
            json!(util::timestamp(time::OffsetDateTime::now_utc()));
        default_on_create(Resource::Pods, &mut pod, "2026-01-01T00:00:00Z");
        let t = table(
            Resource::Pods,
            &[pod],
            json!({"resourceVersion": "5"}),
            IncludeObject::Metadata,
            true,
        );
        assert_eq!(t["rows"][0]["cells"][0], "demo");
        assert_eq!(t["rows"][0]["cells"][1], "1/1");
        assert_eq!(t["rows"][0]["cells"][2], "Running");
        assert_eq!(t["rows"][0]["object"]["kind"], "PartialObjectMetadata");
        assert_eq!(t["columnDefinitions"].as_array().map(Vec::len), Some(9));
    }
}
