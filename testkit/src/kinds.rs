//! The process-wide registry of custom kinds (what a CRD declares), below every other module: names are leaked
//! `&'static str` so [`crate::resources::Resource`] stays `Copy`, and the registry is bounded by [`MAX_KINDS`].

use std::sync::{Arc, RwLock};

use serde_json::Value;

/// The most custom kinds registered in one process (CRD creations beyond it are stored but not served).
pub(crate) const MAX_KINDS: usize = 4096;

/// One served custom kind.
#[derive(Debug)]
pub(crate) struct CustomKind {
    pub(crate) crd: String,
    pub(crate) group: &'static str,
    pub(crate) version: &'static str,
    pub(crate) api_version: &'static str,
    pub(crate) plural: &'static str,
    pub(crate) singular: &'static str,
    pub(crate) kind: &'static str,
    pub(crate) short_names: &'static [&'static str],
    pub(crate) namespaced: bool,
}

static REGISTRY: RwLock<Vec<Arc<CustomKind>>> = RwLock::new(Vec::new());

fn leak(s: &str) -> &'static str {
    Box::leak(s.to_string().into_boxed_str())
}

/// The kind with registry id `id`.
pub(crate) fn kind(id: u32) -> Option<Arc<CustomKind>> {
    REGISTRY
        .read()
        .ok()
        .and_then(|r| r.get(usize::try_from(id).ok()?).cloned())
}

/// Registers the kind a CRD describes; None if the CRD has no served version or the registry is full.
pub(crate) fn register(crd: &Value) -> Option<u32> {
    let spec = &crd["spec"];
    let s = |v: &Value| v.as_str().unwrap_or_default().to_string();
    let version = spec["versions"]
        .as_array()?
        .iter()
        .find(|v| v["served"] == true)?["name"]
        .as_str()?
        .to_string();
    let group = s(&spec["group"]);
    let plural = s(&spec["names"]["plural"]);
    let kind_name = s(&spec["names"]["kind"]);
    let singular = match spec["names"]["singular"].as_str() {
        Some(single) if !single.is_empty() => single.to_string(),
        _ => kind_name.to_ascii_lowercase(),
    };
    let short_names: Vec<&'static str> = spec["names"]["shortNames"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(Value::as_str)
        .map(leak)
        .collect();
    let mut registry = REGISTRY.write().ok()?;
    if registry.len() >= MAX_KINDS {
        tracing::warn!(crd = %s(&crd["metadata"]["name"]), "too many custom kinds; not served");
        return None;
    }
    registry.push(Arc::new(CustomKind {
        crd: s(&crd["metadata"]["name"]),
        api_version: leak(&format!("{group}/{version}")),
        group: leak(&group),
        version: leak(&version),
        plural: leak(&plural),
        singular: leak(&singular),
        kind: leak(&kind_name),
        short_names: Box::leak(short_names.into_boxed_slice()),
        namespaced: spec["scope"] == "Namespaced",
    }));
    u32::try_from(registry.len() - 1).ok()
}
