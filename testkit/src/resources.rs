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
    ConfigMaps,
    Namespaces,
    Nodes,
    Pods,
}

impl Resource {
    pub(crate) const ALL: [Resource; 4] = [
        Resource::ConfigMaps,
        Resource::Namespaces,
        Resource::Nodes,
        Resource::Pods,
    ];

    pub(crate) fn from_plural(plural: &str) -> Option<Resource> {
        Resource::ALL.into_iter().find(|r| r.plural() == plural)
    }

    pub(crate) fn plural(self) -> &'static str {
        match self {
            Resource::ConfigMaps => "configmaps",
            Resource::Namespaces => "namespaces",
            Resource::Nodes => "nodes",
            Resource::Pods => "pods",
        }
    }

    pub(crate) fn singular(self) -> &'static str {
        match self {
            Resource::ConfigMaps => "configmap",
            Resource::Namespaces => "namespace",
            Resource::Nodes => "node",
            Resource::Pods => "pod",
        }
    }

    pub(crate) fn kind(self) -> &'static str {
        match self {
            Resource::ConfigMaps => "ConfigMap",
            Resource::Namespaces => "Namespace",
            Resource::Nodes => "Node",
            Resource::Pods => "Pod",
        }
    }

    pub(crate) fn short_names(self) -> &'static [&'static str] {
        match self {
            Resource::ConfigMaps => &["cm"],
            Resource::Namespaces => &["ns"],
            Resource::Nodes => &["no"],
            Resource::Pods => &["po"],
        }
    }

    pub(crate) fn namespaced(self) -> bool {
        matches!(self, Resource::ConfigMaps | Resource::Pods)
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

/// `GET /apis`.
pub(crate) fn api_group_list() -> Value {
    json!({"kind": "APIGroupList", "apiVersion": "v1", "groups": [authentication_group()]})
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

/// `GET /api/v1`.
pub(crate) fn api_resource_list() -> Value {
    let mut resources: Vec<Value> = Vec::new();
    for r in Resource::ALL {
        let mut entry = json!({
            "name": r.plural(),
            "singularName": r.singular(),
            "namespaced": r.namespaced(),
            "kind": r.kind(),
            "verbs": r.verbs(),
            "shortNames": r.short_names(),
        });
        if r == Resource::Pods {
            entry["categories"] = json!(["all"]);
        }
        resources.push(entry);
        if r == Resource::Pods {
            resources.push(json!({"name": "pods/exec", "singularName": "", "namespaced": true, "kind": "PodExecOptions", "verbs": ["create", "get"]}));
            resources.push(json!({"name": "pods/log", "singularName": "", "namespaced": true, "kind": "Pod", "verbs": ["get"]}));
        }
    }
    json!({"kind": "APIResourceList", "groupVersion": "v1", "resources": resources})
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
    if let Some(v) = map.get("apiVersion").filter(|v| v.as_str() != Some("v1")) {
        return Err(ApiError::bad_request(format!(
            "the API version in the data ({}) does not match the expected API version (v1)",
            v.as_str().unwrap_or_default()
        )));
    }
    if let Some(k) = map
        .get("kind")
        .filter(|k| k.as_str() != Some(resource.kind()))
    {
        return Err(ApiError::bad_request(format!(
            "{} in version \"v1\" cannot be handled as a {}: the object provided is unrecognized",
            k.as_str().unwrap_or_default(),
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
    if resource == Resource::ConfigMaps {
        for field in ["data", "binaryData"] {
            if let Some(v) = map.get(field) {
                string_map(v, &format!("ConfigMap.{field}"), resource)?;
            }
        }
    }
    Ok(())
}

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
                        let key_ok = !k.is_empty()
                            && k.len() <= 253
                            && k.bytes().all(|b| {
                                b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.')
                            });
                        if !key_ok {
                            errors.push(FieldError::invalid(&format!("{field}[{k}]"), k, "a valid config key must consist of alphanumeric characters, '-', '_' or '.' (e.g. 'key.name',  or 'KEY_NAME',  or 'key-name', regex used for validation is '[-._a-zA-Z0-9]+')"));
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
        Resource::Pods => match obj["spec"]["containers"].as_array() {
            Some(containers) if !containers.is_empty() => {
                for (i, c) in containers.iter().enumerate() {
                    match c["name"].as_str() {
                        None | Some("") => errors.push(FieldError::required(
                            &format!("spec.containers[{i}].name"),
                            "",
                        )),
                        Some(n) if !is_dns1123_label(n) => {
                            errors.push(FieldError::invalid(
                                &format!("spec.containers[{i}].name"),
                                n,
                                DNS1123_LABEL_MSG,
                            ));
                        }
                        Some(_) => {}
                    }
                    if c["image"].as_str().is_none_or(str::is_empty) {
                        errors.push(FieldError::required(
                            &format!("spec.containers[{i}].image"),
                            "",
                        ));
                    }
                }
            }
            _ => errors.push(FieldError::required("spec.containers", "")),
        },
        Resource::Namespaces | Resource::Nodes => {}
    }
    if errors.is_empty() {
        Ok(())
    } else {
        Err(ApiError::invalid(resource.kind(), name, &errors))
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
        Resource::ConfigMaps | Resource::Nodes => {}
    }
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
    match resource {
        Resource::ConfigMaps => CONFIGMAPS,
        Resource::Namespaces => NAMESPACES,
        Resource::Nodes => NODES,
        Resource::Pods => PODS,
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
