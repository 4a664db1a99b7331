//! The object lifecycle shared by every writer (HTTP handlers, the controllers, seeding): placing a decoded
//! object (apiVersion, kind, namespace), the create pipeline (name generation, validation, defaulting, store),
//! and what updates keep (status, generation). Domain code: it imports the store and the resource rules, never a
//! handler, and fails with [`ApiError`] values that the handlers turn into `Status` responses.

use serde_json::{Value, json};

use crate::resources::{self, Resource};
use crate::status::{ApiError, FieldError};
use crate::store::Store;
use crate::util;

type Result<T, E = ApiError> = std::result::Result<T, E>;

/// Makes a freshly decoded body fit its place: apiVersion/kind, and the namespace of the URL (400 on mismatch).
pub(crate) fn place(resource: Resource, obj: &mut Value, namespace: Option<&str>) -> Result<()> {
    let Some(map) = obj.as_object_mut() else {
        return Err(ApiError::bad_request(
            "the body of the request must be a JSON object",
        ));
    };
    map.insert("apiVersion".into(), json!(resource.api_version()));
    map.insert("kind".into(), json!(resource.kind()));
    let meta = map.entry("metadata").or_insert_with(|| json!({}));
    if meta.is_null() {
        *meta = json!({});
    }
    let Some(meta) = meta.as_object_mut() else {
        return Err(ApiError::bad_request("metadata must be an object"));
    };
    match namespace {
        Some(ns) if resource.namespaced() => {
            let given = meta.get("namespace").and_then(Value::as_str).unwrap_or("");
            if !given.is_empty() && given != ns {
                return Err(ApiError::bad_request(
                    "the namespace of the provided object does not match the namespace sent on the request",
                ));
            }
            meta.insert("namespace".into(), json!(ns));
        }
        _ => {
            meta.remove("namespace");
        }
    }
    Ok(())
}

/// The create pipeline shared by POST and in-process seeding: name generation, validation, defaulting, store.
pub(crate) fn create_object(store: &Store, resource: Resource, obj: Value) -> Result<Value> {
    create_object_with(store, resource, obj, false)
}

pub(crate) fn create_object_with(
    store: &Store,
    resource: Resource,
    mut obj: Value,
    dry_run: bool,
) -> Result<Value> {
    resources::check_decodable(resource, &obj)?;
    let namespace = obj["metadata"]["namespace"].as_str().map(str::to_string);
    place(resource, &mut obj, namespace.as_deref())?;
    if resource.namespaced() && namespace.as_deref().is_none_or(str::is_empty) {
        return Err(ApiError::bad_request(
            "the namespace of the object is required",
        ));
    }
    let meta = &obj["metadata"];
    let name = meta["name"].as_str().unwrap_or("").to_string();
    let generate = meta["generateName"].as_str().unwrap_or("").to_string();
    if !meta["resourceVersion"].as_str().unwrap_or("").is_empty() {
        return Err(ApiError::bad_request(
            "resourceVersion should not be set on objects to be created",
        ));
    }
    let name = match (name.is_empty(), generate.is_empty()) {
        (false, _) => name,
        (true, false) => format!("{generate}{}", util::name_suffix()),
        (true, true) => {
            return Err(ApiError::invalid(
                resource.kind(),
                "",
                &[FieldError::required(
                    "metadata.name",
                    "name or generateName is required",
                )],
            ));
        }
    };
    if let Some(meta) = obj["metadata"].as_object_mut() {
        meta.insert("name".into(), json!(name));
        for server_set in [
            "uid",
            "creationTimestamp",
            "deletionTimestamp",
            "deletionGracePeriodSeconds",
            "managedFields",
        ] {
            meta.remove(server_set);
        }
    }
    resources::normalize(resource, &mut obj);
    resources::validate(resource, &obj)?;
    resources::default_on_create(
        resource,
        &mut obj,
        &util::timestamp(time::OffsetDateTime::now_utc()),
    );
    let created = store.create(resource, obj, dry_run)?;
    if resource == Resource::Namespaces && !dry_run {
        // The service account controller's job in a real cluster.
        let sa = resources::default_service_account(&name);
        if let Err(e) = create_object(store, Resource::ServiceAccounts, sa) {
            tracing::debug!(namespace = %name, error = %e.message, "no default service account");
        }
    }
    Ok(created)
}

/// `metadata.generation` counts spec changes, as kube-apiserver does for workloads and CRDs.
pub(crate) fn bump_generation(next: &mut Value, current: &Value) {
    let Some(generation) = current["metadata"]["generation"].as_i64() else {
        return;
    };
    let changed = next["spec"] != current["spec"];
    if let Some(meta) = next.get_mut("metadata").and_then(Value::as_object_mut) {
        meta.insert("generation".into(), json!(generation + i64::from(changed)));
    }
}

/// Status is owned by controllers (and the status subresource), not by writes to the main resource.
pub(crate) fn keep_status(resource: Resource, next: &mut Value, current: &Value) {
    if resource == Resource::Services {
        // spec.clusterIP is immutable and allocated once; an update that leaves it out keeps it.
        for field in ["clusterIP", "clusterIPs"] {
            if next["spec"][field].is_null()
                && let (Some(spec), Some(v)) = (
                    next.get_mut("spec").and_then(Value::as_object_mut),
                    current["spec"].get(field),
                )
            {
                spec.insert(field.into(), v.clone());
            }
        }
    }
    bump_generation(next, current);
    if !resource.has_status() {
        return;
    }
    if let Some(map) = next.as_object_mut() {
        match current.get("status") {
            Some(status) => map.insert("status".into(), status.clone()),
            None => map.remove("status"),
        };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn create_pipeline_generates_names_and_validates() -> Result<()> {
        let store = Store::new();
        create_object(
            &store,
            Resource::Namespaces,
            json!({"metadata": {"name": "default"}}),
        )?;
        let made = create_object(
            &store,
            Resource::ConfigMaps,
            json!({"metadata": {"generateName": "x-", "namespace": "default"}}),
        )?;
        let name = made["metadata"]["name"].as_str().unwrap_or_default();
        assert!(name.starts_with("x-") && name.len() == 7, "{name}");
        assert_eq!(made["kind"], "ConfigMap");
        let missing = create_object(
            &store,
            Resource::ConfigMaps,
            json!({"metadata": {"namespace": "default"}}),
        );
        assert_eq!(missing.map_err(|e| e.code), Err(422));
        let ns = create_object(
            &store,
            Resource::Namespaces,
            json!({"metadata": {"name": "team-a"}}),
        )?;
        assert_eq!(ns["status"]["phase"], "Active");
        Ok(())
    }
}
