//! Custom resources: every stored CustomResourceDefinition makes its kind served (`/apis/GROUP/VERSION/…`),
//! discovered and listed, as kube-apiserver's apiextensions server does. One version per CRD is served (the
//! first one marked `served`), objects are stored as they come (no schema validation, no conversion), and the
//! table has Name and Age.
//!
//! A served kind is a [`Resource::Custom`] whose id indexes the registry of [`crate::kinds`]; each store knows
//! which ids are its own, so sample apiservers in one process do not see each other's CRDs.

use std::sync::Arc;

use serde_json::{Value, json};

use crate::kinds::{CustomKind, kind, register};
use crate::resources::Resource;
use crate::store::Store;

/// The custom kinds `store` serves.
pub(crate) fn served(store: &Store) -> Vec<(Resource, Arc<CustomKind>)> {
    store
        .custom_ids()
        .into_iter()
        .filter_map(|id| kind(id).map(|k| (Resource::Custom(id), k)))
        .collect()
}

/// The custom resource `plural` of `group`/`version` served by `store`.
pub(crate) fn find(store: &Store, group: &str, version: &str, plural: &str) -> Option<Resource> {
    served(store)
        .into_iter()
        .find(|(_, k)| k.group == group && k.version == version && k.plural == plural)
        .map(|(r, _)| r)
}

/// The versions of custom group `group` served by `store` (empty if none).
pub(crate) fn group_versions(store: &Store, group: &str) -> Vec<&'static str> {
    let mut versions: Vec<&'static str> = served(store)
        .into_iter()
        .filter(|(_, k)| k.group == group)
        .map(|(_, k)| k.version)
        .collect();
    versions.sort_unstable();
    versions.dedup();
    versions
}

/// The API groups of `store`'s custom kinds, as `APIGroup` documents.
pub(crate) fn groups(store: &Store) -> Vec<Value> {
    let mut names: Vec<&'static str> = served(store).into_iter().map(|(_, k)| k.group).collect();
    names.sort_unstable();
    names.dedup();
    names.into_iter().map(|g| api_group(store, g)).collect()
}

/// `GET /apis/GROUP` for a custom group.
pub(crate) fn api_group(store: &Store, group: &str) -> Value {
    let versions: Vec<Value> = group_versions(store, group)
        .into_iter()
        .map(|v| json!({"groupVersion": format!("{group}/{v}"), "version": v}))
        .collect();
    json!({"kind": "APIGroup", "apiVersion": "v1", "name": group,
           "preferredVersion": versions.first().cloned().unwrap_or(Value::Null), "versions": versions})
}

/// `GET /apis/GROUP/VERSION` for a custom group.
pub(crate) fn resource_list(store: &Store, group: &str, version: &str) -> Value {
    let resources: Vec<Value> = served(store)
        .into_iter()
        .filter(|(_, k)| k.group == group && k.version == version)
        .map(|(_, k)| {
            json!({"name": k.plural, "singularName": k.singular, "namespaced": k.namespaced, "kind": k.kind,
                   "shortNames": k.short_names, "categories": [],
                   "verbs": ["create", "delete", "deletecollection", "get", "list", "patch", "update", "watch"]})
        })
        .collect();
    json!({"kind": "APIResourceList", "apiVersion": "v1", "groupVersion": format!("{group}/{version}"),
           "resources": resources})
}

/// Makes `store` serve exactly the kinds of its stored CRDs: new CRDs are registered, and a deleted CRD's kind
/// stops being served and its objects are deleted (as kube-apiserver does).
pub(crate) fn sync(store: &Store) {
    let crds = store
        .list(
            Resource::CustomResourceDefinitions,
            None,
            &|_| true,
            None,
            None,
        )
        .items;
    let served = served(store);
    for (resource, kind) in &served {
        let still = crds
            .iter()
            .any(|c| c["metadata"]["name"] == kind.crd.as_str());
        if !still && let Resource::Custom(id) = resource {
            store.remove_custom_id(*id);
            for obj in store.list(*resource, None, &|_| true, None, None).items {
                let ns = obj["metadata"]["namespace"].as_str().unwrap_or_default();
                let name = obj["metadata"]["name"].as_str().unwrap_or_default();
                let _ = store.delete(*resource, ns, name, false, |_| Ok(()));
            }
        }
    }
    for crd in &crds {
        let name = crd["metadata"]["name"].as_str().unwrap_or_default();
        if served.iter().any(|(_, k)| k.crd == name) {
            continue;
        }
        if let Some(id) = register(crd) {
            store.add_custom_id(id);
        }
    }
}
