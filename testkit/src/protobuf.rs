//! Decoding of Kubernetes protobuf request bodies (`application/vnd.kubernetes.protobuf`) into JSON values.
//!
//! kubectl's typed clients send protobuf when they write (`kubectl create configmap`, `create namespace`, `run`),
//! while accepting JSON answers. So only decoding is needed, and only for the kinds kubectl's `create`
//! subcommands write: ConfigMap, Namespace, Secret, ServiceAccount, Service, the parts of Pod that `kubectl
//! run` fills in, and the SelfSubjectAccessReview/SelfSubjectRulesReview of `kubectl auth can-i`. Fields not in the schemas below are skipped, as any protobuf
//! reader skips unknown fields. Field numbers come from `k8s.io/api/core/v1/generated.proto` and
//! `k8s.io/apimachinery/pkg/apis/meta/v1/generated.proto`.
//!
//! The envelope is the 4-byte magic `k8s\0` followed by a `runtime.Unknown` message
//! (`typeMeta` = 1 {apiVersion = 1, kind = 2}, `raw` = 2, `contentEncoding` = 3, `contentType` = 4).

use serde_json::{Map, Value, json};

use crate::status::ApiError;

const MAGIC: &[u8; 4] = b"k8s\0";

/// How a field's bytes become JSON.
#[derive(Clone, Copy)]
enum Kind {
    String,
    Bytes,
    Int,
    Bool,
    Quantity,
    Message(&'static [Field]),
    /// `intstr.IntOrString` {type = 1, intVal = 2, strVal = 3}: a number or a string in JSON.
    IntOrString,
    StringMap,
    BytesMap,
    QuantityMap,
}

/// One field of a message: number, JSON name, kind, repeated.
type Field = (u64, &'static str, Kind, bool);

const OBJECT_META: &[Field] = &[
    (1, "name", Kind::String, false),
    (2, "generateName", Kind::String, false),
    (3, "namespace", Kind::String, false),
    (5, "uid", Kind::String, false),
    (6, "resourceVersion", Kind::String, false),
    (7, "generation", Kind::Int, false),
    (11, "labels", Kind::StringMap, false),
    (12, "annotations", Kind::StringMap, false),
    (14, "finalizers", Kind::String, true),
];

const CONFIG_MAP: &[Field] = &[
    (1, "metadata", Kind::Message(OBJECT_META), false),
    (2, "data", Kind::StringMap, false),
    (3, "binaryData", Kind::BytesMap, false),
    (4, "immutable", Kind::Bool, false),
];

const NAMESPACE_SPEC: &[Field] = &[(1, "finalizers", Kind::String, true)];
const NAMESPACE: &[Field] = &[
    (1, "metadata", Kind::Message(OBJECT_META), false),
    (2, "spec", Kind::Message(NAMESPACE_SPEC), false),
];

const CONTAINER_PORT: &[Field] = &[
    (1, "name", Kind::String, false),
    (2, "hostPort", Kind::Int, false),
    (3, "containerPort", Kind::Int, false),
    (4, "protocol", Kind::String, false),
    (5, "hostIP", Kind::String, false),
];
const ENV_VAR: &[Field] = &[
    (1, "name", Kind::String, false),
    (2, "value", Kind::String, false),
];
const RESOURCES: &[Field] = &[
    (1, "limits", Kind::QuantityMap, false),
    (2, "requests", Kind::QuantityMap, false),
];
const CONTAINER: &[Field] = &[
    (1, "name", Kind::String, false),
    (2, "image", Kind::String, false),
    (3, "command", Kind::String, true),
    (4, "args", Kind::String, true),
    (5, "workingDir", Kind::String, false),
    (6, "ports", Kind::Message(CONTAINER_PORT), true),
    (7, "env", Kind::Message(ENV_VAR), true),
    (8, "resources", Kind::Message(RESOURCES), false),
    (13, "terminationMessagePath", Kind::String, false),
    (14, "imagePullPolicy", Kind::String, false),
    (16, "stdin", Kind::Bool, false),
    (17, "stdinOnce", Kind::Bool, false),
    (18, "tty", Kind::Bool, false),
    (20, "terminationMessagePolicy", Kind::String, false),
];
const POD_SPEC: &[Field] = &[
    (2, "containers", Kind::Message(CONTAINER), true),
    (3, "restartPolicy", Kind::String, false),
    (4, "terminationGracePeriodSeconds", Kind::Int, false),
    (5, "activeDeadlineSeconds", Kind::Int, false),
    (6, "dnsPolicy", Kind::String, false),
    (7, "nodeSelector", Kind::StringMap, false),
    (8, "serviceAccountName", Kind::String, false),
    (10, "nodeName", Kind::String, false),
    (11, "hostNetwork", Kind::Bool, false),
    (20, "initContainers", Kind::Message(CONTAINER), true),
];
const POD: &[Field] = &[
    (1, "metadata", Kind::Message(OBJECT_META), false),
    (2, "spec", Kind::Message(POD_SPEC), false),
];

const SECRET: &[Field] = &[
    (1, "metadata", Kind::Message(OBJECT_META), false),
    (2, "data", Kind::BytesMap, false),
    (3, "type", Kind::String, false),
    (4, "stringData", Kind::StringMap, false),
    (5, "immutable", Kind::Bool, false),
];

const OBJECT_REFERENCE: &[Field] = &[
    (1, "kind", Kind::String, false),
    (2, "namespace", Kind::String, false),
    (3, "name", Kind::String, false),
];
const SERVICE_ACCOUNT: &[Field] = &[
    (1, "metadata", Kind::Message(OBJECT_META), false),
    (2, "secrets", Kind::Message(OBJECT_REFERENCE), true),
    (3, "imagePullSecrets", Kind::Message(OBJECT_REFERENCE), true),
    (4, "automountServiceAccountToken", Kind::Bool, false),
];

const SERVICE_PORT: &[Field] = &[
    (1, "name", Kind::String, false),
    (2, "protocol", Kind::String, false),
    (3, "port", Kind::Int, false),
    (4, "targetPort", Kind::IntOrString, false),
    (5, "nodePort", Kind::Int, false),
];
const SERVICE_SPEC: &[Field] = &[
    (1, "ports", Kind::Message(SERVICE_PORT), true),
    (2, "selector", Kind::StringMap, false),
    (3, "clusterIP", Kind::String, false),
    (4, "type", Kind::String, false),
    (11, "externalName", Kind::String, false),
];
const SERVICE: &[Field] = &[
    (1, "metadata", Kind::Message(OBJECT_META), false),
    (2, "spec", Kind::Message(SERVICE_SPEC), false),
];
const INT_OR_STRING: &[Field] = &[
    (1, "type", Kind::Int, false),
    (2, "intVal", Kind::Int, false),
    (3, "strVal", Kind::String, false),
];

const LABEL_SELECTOR: &[Field] = &[(1, "matchLabels", Kind::StringMap, false)];
const POD_TEMPLATE_SPEC: &[Field] = &[
    (1, "metadata", Kind::Message(OBJECT_META), false),
    (2, "spec", Kind::Message(POD_SPEC), false),
];
const DEPLOYMENT_SPEC: &[Field] = &[
    (1, "replicas", Kind::Int, false),
    (2, "selector", Kind::Message(LABEL_SELECTOR), false),
    (3, "template", Kind::Message(POD_TEMPLATE_SPEC), false),
];
const DEPLOYMENT: &[Field] = &[
    (1, "metadata", Kind::Message(OBJECT_META), false),
    (2, "spec", Kind::Message(DEPLOYMENT_SPEC), false),
];

const POLICY_RULE: &[Field] = &[
    (1, "verbs", Kind::String, true),
    (2, "apiGroups", Kind::String, true),
    (3, "resources", Kind::String, true),
    (4, "resourceNames", Kind::String, true),
    (5, "nonResourceURLs", Kind::String, true),
];
const ROLE: &[Field] = &[
    (1, "metadata", Kind::Message(OBJECT_META), false),
    (2, "rules", Kind::Message(POLICY_RULE), true),
];
const RBAC_SUBJECT: &[Field] = &[
    (1, "kind", Kind::String, false),
    (2, "apiGroup", Kind::String, false),
    (3, "name", Kind::String, false),
    (4, "namespace", Kind::String, false),
];
const ROLE_REF: &[Field] = &[
    (1, "apiGroup", Kind::String, false),
    (2, "kind", Kind::String, false),
    (3, "name", Kind::String, false),
];
const ROLE_BINDING: &[Field] = &[
    (1, "metadata", Kind::Message(OBJECT_META), false),
    (2, "subjects", Kind::Message(RBAC_SUBJECT), true),
    (3, "roleRef", Kind::Message(ROLE_REF), false),
];

const RESOURCE_ATTRIBUTES: &[Field] = &[
    (1, "namespace", Kind::String, false),
    (2, "verb", Kind::String, false),
    (3, "group", Kind::String, false),
    (4, "version", Kind::String, false),
    (5, "resource", Kind::String, false),
    (6, "subresource", Kind::String, false),
    (7, "name", Kind::String, false),
];
const NON_RESOURCE_ATTRIBUTES: &[Field] = &[
    (1, "path", Kind::String, false),
    (2, "verb", Kind::String, false),
];
const SELF_SUBJECT_ACCESS_REVIEW_SPEC: &[Field] = &[
    (
        1,
        "resourceAttributes",
        Kind::Message(RESOURCE_ATTRIBUTES),
        false,
    ),
    (
        2,
        "nonResourceAttributes",
        Kind::Message(NON_RESOURCE_ATTRIBUTES),
        false,
    ),
];
const SELF_SUBJECT_ACCESS_REVIEW: &[Field] = &[
    (1, "metadata", Kind::Message(OBJECT_META), false),
    (
        2,
        "spec",
        Kind::Message(SELF_SUBJECT_ACCESS_REVIEW_SPEC),
        false,
    ),
];
const SELF_SUBJECT_RULES_REVIEW_SPEC: &[Field] = &[(1, "namespace", Kind::String, false)];
const SELF_SUBJECT_RULES_REVIEW: &[Field] = &[
    (1, "metadata", Kind::Message(OBJECT_META), false),
    (
        2,
        "spec",
        Kind::Message(SELF_SUBJECT_RULES_REVIEW_SPEC),
        false,
    ),
];

const TYPE_META: &[Field] = &[
    (1, "apiVersion", Kind::String, false),
    (2, "kind", Kind::String, false),
];
const UNKNOWN: &[Field] = &[
    (1, "typeMeta", Kind::Message(TYPE_META), false),
    (2, "raw", Kind::Bytes, false),
    (3, "contentEncoding", Kind::String, false),
];
const QUANTITY: &[Field] = &[(1, "string", Kind::String, false)];
const MAP_ENTRY_STRING: &[Field] = &[
    (1, "key", Kind::String, false),
    (2, "value", Kind::String, false),
];
const MAP_ENTRY_BYTES: &[Field] = &[
    (1, "key", Kind::String, false),
    (2, "value", Kind::Bytes, false),
];
const MAP_ENTRY_QUANTITY: &[Field] = &[
    (1, "key", Kind::String, false),
    (2, "value", Kind::Quantity, false),
];

fn malformed(what: &str) -> ApiError {
    ApiError::bad_request(format!("unable to decode the protobuf body: {what}"))
}

/// Decodes a protobuf request body into the JSON form of the object, with apiVersion and kind.
pub(crate) fn decode(body: &[u8]) -> Result<Value, ApiError> {
    let rest = body
        .strip_prefix(MAGIC)
        .ok_or_else(|| malformed("missing the k8s protobuf prefix"))?;
    let envelope = message(rest, UNKNOWN, 0)?;
    let api_version = envelope["typeMeta"]["apiVersion"]
        .as_str()
        .unwrap_or_default()
        .to_string();
    let kind = envelope["typeMeta"]["kind"]
        .as_str()
        .unwrap_or_default()
        .to_string();
    if !envelope["contentEncoding"]
        .as_str()
        .unwrap_or_default()
        .is_empty()
    {
        return Err(malformed("content encodings are not supported"));
    }
    let raw = envelope["raw"]
        .as_str()
        .map(base64_decode)
        .transpose()?
        .unwrap_or_default();
    let schema = match (api_version.as_str(), kind.as_str()) {
        ("v1", "ConfigMap") => CONFIG_MAP,
        ("v1", "Namespace") => NAMESPACE,
        ("v1", "Pod") => POD,
        ("v1", "Secret") => SECRET,
        ("v1", "ServiceAccount") => SERVICE_ACCOUNT,
        ("v1", "Service") => SERVICE,
        ("apps/v1", "Deployment") => DEPLOYMENT,
        ("rbac.authorization.k8s.io/v1", "Role" | "ClusterRole") => ROLE,
        ("rbac.authorization.k8s.io/v1", "RoleBinding" | "ClusterRoleBinding") => ROLE_BINDING,
        ("authorization.k8s.io/v1", "SelfSubjectAccessReview") => SELF_SUBJECT_ACCESS_REVIEW,
        ("authorization.k8s.io/v1", "SelfSubjectRulesReview") => SELF_SUBJECT_RULES_REVIEW,
        _ => {
            return Err(ApiError::unsupported_media_type(&format!(
                "application/vnd.kubernetes.protobuf ({api_version}, Kind={kind}: only ConfigMap, Namespace, Pod, Secret, Service, ServiceAccount, Deployment, RBAC objects and self subject reviews are decoded)"
            )));
        }
    };
    let mut object = message(&raw, schema, 0)?;
    if let Some(map) = object.as_object_mut() {
        map.insert("apiVersion".into(), json!(api_version));
        map.insert("kind".into(), json!(kind));
    }
    Ok(object)
}

fn base64_encode(bytes: &[u8]) -> String {
    use base64::Engine as _;
    base64::engine::general_purpose::STANDARD.encode(bytes)
}

fn base64_decode(text: &str) -> Result<Vec<u8>, ApiError> {
    use base64::Engine as _;
    base64::engine::general_purpose::STANDARD
        .decode(text)
        .map_err(|_| malformed("bad bytes"))
}

/// A reader over protobuf wire data.
struct Reader<'a> {
    data: &'a [u8],
}

impl<'a> Reader<'a> {
    fn varint(&mut self) -> Result<u64, ApiError> {
        let mut value = 0u64;
        for shift in (0..64).step_by(7) {
            let (&byte, rest) = self
                .data
                .split_first()
                .ok_or_else(|| malformed("truncated varint"))?;
            self.data = rest;
            value |= u64::from(byte & 0x7f) << shift;
            if byte & 0x80 == 0 {
                return Ok(value);
            }
        }
        Err(malformed("varint too long"))
    }

    fn take(&mut self, n: usize) -> Result<&'a [u8], ApiError> {
        if n > self.data.len() {
            return Err(malformed("truncated field"));
        }
        let (head, rest) = self.data.split_at(n);
        self.data = rest;
        Ok(head)
    }
}

/// Nesting deeper than this is refused (the schemas are shallow; this bounds hostile input).
const MAX_DEPTH: usize = 16;

fn message(data: &[u8], schema: &[Field], depth: usize) -> Result<Value, ApiError> {
    if depth > MAX_DEPTH {
        return Err(malformed("nested too deeply"));
    }
    let mut out = Map::new();
    let mut r = Reader { data };
    while !r.data.is_empty() {
        let tag = r.varint()?;
        let (number, wire) = (tag >> 3, tag & 7);
        let field = schema.iter().find(|f| f.0 == number);
        let value = match wire {
            0 => Wire::Varint(r.varint()?),
            1 => Wire::Bytes(r.take(8)?),
            2 => {
                let len =
                    usize::try_from(r.varint()?).map_err(|_| malformed("length too large"))?;
                Wire::Bytes(r.take(len)?)
            }
            5 => Wire::Bytes(r.take(4)?),
            _ => return Err(malformed("unsupported wire type")),
        };
        let Some(&(_, name, kind, repeated)) = field else {
            continue;
        };
        let slot = out.entry(name.to_string());
        match kind {
            Kind::StringMap | Kind::BytesMap | Kind::QuantityMap => {
                let entry_schema = match kind {
                    Kind::StringMap => MAP_ENTRY_STRING,
                    Kind::BytesMap => MAP_ENTRY_BYTES,
                    _ => MAP_ENTRY_QUANTITY,
                };
                let entry = message(value.bytes()?, entry_schema, depth + 1)?;
                let map = slot.or_insert_with(|| Value::Object(Map::new()));
                if let (Some(map), Some(key)) = (map.as_object_mut(), entry["key"].as_str()) {
                    map.insert(
                        key.to_string(),
                        entry.get("value").cloned().unwrap_or(json!("")),
                    );
                }
            }
            _ => {
                let v = scalar(kind, &value, depth)?;
                if repeated {
                    if let Some(items) = slot
                        .or_insert_with(|| Value::Array(Vec::new()))
                        .as_array_mut()
                    {
                        items.push(v);
                    }
                } else {
                    match slot {
                        serde_json::map::Entry::Occupied(mut e) => {
                            *e.get_mut() = v;
                        }
                        serde_json::map::Entry::Vacant(e) => {
                            e.insert(v);
                        }
                    }
                }
            }
        }
    }
    // Go's generated protobuf code writes empty scalars that its JSON encoding would omit (`omitempty`).
    out.retain(|_, v| match v {
        Value::String(s) => !s.is_empty(),
        Value::Number(n) => n.as_i64() != Some(0),
        Value::Bool(b) => *b,
        Value::Object(m) => !m.is_empty(),
        Value::Array(a) => !a.is_empty(),
        Value::Null => false,
    });
    Ok(Value::Object(out))
}

enum Wire<'a> {
    Varint(u64),
    Bytes(&'a [u8]),
}

impl<'a> Wire<'a> {
    fn bytes(&self) -> Result<&'a [u8], ApiError> {
        match self {
            Wire::Bytes(b) => Ok(b),
            Wire::Varint(_) => Err(malformed("expected a length-delimited field")),
        }
    }

    fn varint(&self) -> Result<u64, ApiError> {
        match self {
            Wire::Varint(v) => Ok(*v),
            Wire::Bytes(_) => Err(malformed("expected a varint field")),
        }
    }
}

fn scalar(kind: Kind, value: &Wire<'_>, depth: usize) -> Result<Value, ApiError> {
    Ok(match kind {
        Kind::String => {
            json!(
                std::str::from_utf8(value.bytes()?)
                    .map_err(|_| malformed("string is not UTF-8"))?
            )
        }
        Kind::Bytes => json!(base64_encode(value.bytes()?)),
        // Two's complement, as protobuf encodes negative int32/int64 values.
        Kind::Int => json!(value.varint()? as i64),
        Kind::Bool => json!(value.varint()? != 0),
        Kind::Quantity => message(value.bytes()?, QUANTITY, depth + 1)?["string"].clone(),
        Kind::Message(schema) => message(value.bytes()?, schema, depth + 1)?,
        Kind::IntOrString => {
            let v = message(value.bytes()?, INT_OR_STRING, depth + 1)?;
            match v["type"].as_i64() {
                Some(1) => json!(v["strVal"].as_str().unwrap_or_default()),
                _ => json!(v["intVal"].as_i64().unwrap_or(0)),
            }
        }
        Kind::StringMap | Kind::BytesMap | Kind::QuantityMap => Value::Null,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn varint(mut v: u64, out: &mut Vec<u8>) {
        loop {
            let byte = (v & 0x7f) as u8;
            v >>= 7;
            if v == 0 {
                out.push(byte);
                return;
            }
            out.push(byte | 0x80);
        }
    }

    fn field(number: u64, bytes: &[u8]) -> Vec<u8> {
        let mut out = Vec::new();
        varint(number << 3 | 2, &mut out);
        varint(bytes.len() as u64, &mut out);
        out.extend_from_slice(bytes);
        out
    }

    fn entry(key: &str, value: &str) -> Vec<u8> {
        [field(1, key.as_bytes()), field(2, value.as_bytes())].concat()
    }

    fn envelope(kind: &str, raw: &[u8]) -> Vec<u8> {
        let type_meta = [field(1, b"v1"), field(2, kind.as_bytes())].concat();
        [MAGIC.to_vec(), field(1, &type_meta), field(2, raw)].concat()
    }

    #[test]
    fn decodes_a_configmap_like_kubectl_create_sends() -> Result<(), ApiError> {
        let meta = [
            field(1, b"x"),
            field(3, b"default"),
            field(11, &entry("app", "demo")),
        ]
        .concat();
        let raw = [
            field(1, &meta),
            field(2, &entry("a", "b")),
            field(2, &entry("c", "d")),
            field(3, &entry("bin", "\u{1}")),
        ]
        .concat();
        let obj = decode(&envelope("ConfigMap", &raw))?;
        assert_eq!(
            obj,
            json!({"apiVersion": "v1", "kind": "ConfigMap",
                   "metadata": {"name": "x", "namespace": "default", "labels": {"app": "demo"}},
                   "data": {"a": "b", "c": "d"}, "binaryData": {"bin": "AQ=="}})
        );
        Ok(())
    }

    #[test]
    fn decodes_a_pod_like_kubectl_run_sends() -> Result<(), ApiError> {
        let mut grace = Vec::new();
        varint(4 << 3, &mut grace);
        varint(30, &mut grace);
        let container = [
            field(1, b"web"),
            field(2, b"nginx"),
            field(3, b"sleep"),
            field(3, b"10"),
        ]
        .concat();
        let spec = [field(2, &container), field(3, b"Never"), grace].concat();
        let raw = [field(1, &field(1, b"web")), field(2, &spec), field(3, b"")].concat();
        let obj = decode(&envelope("Pod", &raw))?;
        assert_eq!(
            obj["spec"]["containers"][0],
            json!({"name": "web", "image": "nginx", "command": ["sleep", "10"]})
        );
        assert_eq!(obj["spec"]["terminationGracePeriodSeconds"], 30);
        assert_eq!(obj["spec"]["restartPolicy"], "Never");
        Ok(())
    }

    #[test]
    fn rejects_garbage_without_panicking() {
        assert!(decode(b"").is_err());
        assert!(decode(b"k8s\0\x0a\xff\xff\xff").is_err());
        assert_eq!(
            decode(&envelope("StatefulSet", b"")).map_err(|e| e.code),
            Err(415)
        );
        for n in 0..64u8 {
            let mut junk = MAGIC.to_vec();
            junk.extend((0..n).map(|i| i.wrapping_mul(37).wrapping_add(n)));
            let _ = decode(&junk);
        }
    }
}
