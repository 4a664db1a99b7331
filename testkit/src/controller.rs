//! The trivial controllers of the sample cluster, run after every write to Deployments, ReplicaSets and Pods:
//! a Deployment owns one ReplicaSet named after its pod template (`NAME-HASH`, older ones are deleted, no rolling
//! update), a ReplicaSet owns `spec.replicas` pods (created from the template, extras deleted), objects whose owner
//! is gone are collected, and the status fields kubectl prints are kept up to date. Pods run at once.
//!
//! Domain code: it writes through [`crate::objects`] and the store, never through a handler.

use serde_json::{Value, json};
use sha2::Digest as _;

use crate::objects::create_object;
use crate::resources::Resource;
use crate::store::Store;

/// The most objects one reconcile pass creates (a bound, not a limit anyone should meet).
const MAX_CREATES: usize = 10_000;

/// The owner reference an object of `kind` with `owner`'s metadata puts on what it controls.
fn owner_ref(kind: &str, api_version: &str, owner: &Value) -> Value {
    json!({"apiVersion": api_version, "kind": kind, "name": owner["metadata"]["name"],
           "uid": owner["metadata"]["uid"], "controller": true, "blockOwnerDeletion": true})
}

/// The uid of the controller owner of `obj`, if any.
fn controller_uid(obj: &Value) -> Option<&str> {
    obj["metadata"]["ownerReferences"]
        .as_array()?
        .iter()
        .find(|r| r["controller"] == true)?["uid"]
        .as_str()
}

fn all(store: &Store, resource: Resource) -> Vec<Value> {
    store.list(resource, None, &|_| true, None, None).items
}

fn key(obj: &Value) -> (String, String) {
    (
        obj["metadata"]["namespace"]
            .as_str()
            .unwrap_or_default()
            .to_string(),
        obj["metadata"]["name"]
            .as_str()
            .unwrap_or_default()
            .to_string(),
    )
}

/// A short stable hash of a pod template (`pod-template-hash`).
fn template_hash(template: &Value) -> String {
    const ALPHABET: &[u8] = b"bcdfghjklmnpqrstvwxz2456789";
    let digest = sha2::Sha256::digest(template.to_string().as_bytes());
    digest
        .iter()
        .take(10)
        .map(|b| ALPHABET[usize::from(*b) % ALPHABET.len()] as char)
        .collect()
}

/// Writes `status` on an object unless it already has it (no resourceVersion churn).
fn set_status(store: &Store, resource: Resource, obj: &Value, status: Value) {
    if obj["status"] == status {
        return;
    }
    let (ns, name) = key(obj);
    let result = store.update(resource, &ns, &name, false, |cur| {
        let mut next = cur.clone();
        next["status"] = status;
        // Let the update through whatever the version: the controller owns status.
        if let Some(meta) = next.get_mut("metadata").and_then(Value::as_object_mut) {
            meta.remove("resourceVersion");
        }
        Ok(next)
    });
    if let Err(e) = result {
        tracing::debug!(name, error = %e.message, "status update lost a race");
    }
}

fn delete(store: &Store, resource: Resource, obj: &Value) {
    let (ns, name) = key(obj);
    let _ = store.delete(resource, &ns, &name, false, |_| Ok(()));
}

/// One pass of every controller.
pub(crate) fn reconcile(store: &Store) {
    let mut budget = MAX_CREATES;
    deployments(store, &mut budget);
    replica_sets(store, &mut budget);
    collect_orphans(store);
}

fn deployments(store: &Store, budget: &mut usize) {
    for deploy in all(store, Resource::Deployments) {
        let (ns, name) = key(&deploy);
        let uid = deploy["metadata"]["uid"].as_str().unwrap_or_default();
        let template = &deploy["spec"]["template"];
        let hash = template_hash(template);
        let rs_name = format!("{name}-{hash}");
        let replicas = deploy["spec"]["replicas"].as_i64().unwrap_or(1);
        let owned: Vec<Value> = all(store, Resource::ReplicaSets)
            .into_iter()
            .filter(|rs| controller_uid(rs) == Some(uid))
            .collect();
        for old in owned.iter().filter(|rs| key(rs).1 != rs_name) {
            delete(store, Resource::ReplicaSets, old);
        }
        let current = owned.iter().find(|rs| key(rs).1 == rs_name);
        match current {
            Some(rs) if rs["spec"]["replicas"].as_i64() != Some(replicas) => {
                let _ = store.update(Resource::ReplicaSets, &ns, &rs_name, false, |cur| {
                    let mut next = cur.clone();
                    next["spec"]["replicas"] = json!(replicas);
                    if let Some(meta) = next.get_mut("metadata").and_then(Value::as_object_mut) {
                        meta.remove("resourceVersion");
                    }
                    Ok(next)
                });
            }
            Some(_) => {}
            None if *budget > 0 => {
                *budget -= 1;
                let mut template = template.clone();
                template["metadata"]["labels"]["pod-template-hash"] = json!(hash);
                let mut selector = deploy["spec"]["selector"].clone();
                selector["matchLabels"]["pod-template-hash"] = json!(hash);
                let mut labels = template["metadata"]["labels"].clone();
                if !labels.is_object() {
                    labels = json!({});
                }
                let rs = json!({
                    "apiVersion": "apps/v1",
                    "kind": "ReplicaSet",
                    "metadata": {"name": rs_name, "namespace": ns, "labels": labels,
                                 "annotations": {"deployment.kubernetes.io/revision": "1"},
                                 "ownerReferences": [owner_ref("Deployment", "apps/v1", &deploy)]},
                    "spec": {"replicas": replicas, "selector": selector, "template": template},
                });
                if let Err(e) = create_object(store, Resource::ReplicaSets, rs) {
                    tracing::warn!(deployment = %name, error = %e.message, "cannot create replica set");
                }
            }
            None => {}
        }
    }
}

fn replica_sets(store: &Store, budget: &mut usize) {
    let pods = all(store, Resource::Pods);
    for rs in all(store, Resource::ReplicaSets) {
        let (ns, name) = key(&rs);
        let uid = rs["metadata"]["uid"].as_str().unwrap_or_default();
        let wanted = usize::try_from(rs["spec"]["replicas"].as_i64().unwrap_or(1)).unwrap_or(0);
        let mut owned: Vec<&Value> = pods
            .iter()
            .filter(|p| controller_uid(p) == Some(uid))
            .collect();
        while owned.len() > wanted {
            if let Some(extra) = owned.pop() {
                delete(store, Resource::Pods, extra);
            }
        }
        let mut count = owned.len();
        while count < wanted && *budget > 0 {
            *budget -= 1;
            let template = &rs["spec"]["template"];
            let pod = json!({
                "apiVersion": "v1",
                "kind": "Pod",
                "metadata": {"generateName": format!("{name}-"), "namespace": ns,
                             "labels": template["metadata"]["labels"],
                             "ownerReferences": [owner_ref("ReplicaSet", "apps/v1", &rs)]},
                "spec": template["spec"],
            });
            match create_object(store, Resource::Pods, pod) {
                Ok(_) => count += 1,
                Err(e) => {
                    tracing::warn!(replicaset = %name, error = %e.message, "cannot create pod");
                    break;
                }
            }
        }
        let n = json!(count);
        set_status(
            store,
            Resource::ReplicaSets,
            &rs,
            json!({"replicas": n, "fullyLabeledReplicas": n, "readyReplicas": n, "availableReplicas": n,
                   "observedGeneration": rs["metadata"]["generation"]}),
        );
    }
    for deploy in all(store, Resource::Deployments) {
        let uid = deploy["metadata"]["uid"].as_str().unwrap_or_default();
        let ready: i64 = all(store, Resource::ReplicaSets)
            .iter()
            .filter(|rs| controller_uid(rs) == Some(uid))
            .filter_map(|rs| rs["status"]["readyReplicas"].as_i64())
            .sum();
        let mut status = json!({
            "observedGeneration": deploy["metadata"]["generation"],
            "replicas": ready, "updatedReplicas": ready, "readyReplicas": ready, "availableReplicas": ready,
            "conditions": [
                {"type": "Available", "status": "True", "reason": "MinimumReplicasAvailable",
                 "message": "Deployment has minimum availability."},
                {"type": "Progressing", "status": "True", "reason": "NewReplicaSetAvailable",
                 "message": "ReplicaSet has successfully progressed."}],
        });
        // Timestamps would change the status on every pass; keep the first ones.
        if let Some(old) = deploy["status"]["conditions"].as_array() {
            status["conditions"] = json!(old);
        }
        set_status(store, Resource::Deployments, &deploy, status);
    }
}

/// Garbage collection: ReplicaSets whose Deployment is gone, pods whose ReplicaSet is gone.
fn collect_orphans(store: &Store) {
    let deployments: Vec<String> = all(store, Resource::Deployments)
        .iter()
        .filter_map(|d| d["metadata"]["uid"].as_str().map(str::to_string))
        .collect();
    for rs in all(store, Resource::ReplicaSets) {
        if controller_uid(&rs).is_some_and(|uid| !deployments.iter().any(|d| d == uid)) {
            delete(store, Resource::ReplicaSets, &rs);
        }
    }
    let replica_sets: Vec<String> = all(store, Resource::ReplicaSets)
        .iter()
        .filter_map(|r| r["metadata"]["uid"].as_str().map(str::to_string))
        .collect();
    for pod in all(store, Resource::Pods) {
        if controller_uid(&pod).is_some_and(|uid| !replica_sets.iter().any(|r| r == uid)) {
            delete(store, Resource::Pods, &pod);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn store() -> Result<Store, crate::status::ApiError> {
        let store = Store::new();
        create_object(
            &store,
            Resource::Namespaces,
            json!({"metadata": {"name": "default"}}),
        )?;
        Ok(store)
    }

    fn deployment(replicas: i64) -> Value {
        json!({"apiVersion": "apps/v1", "kind": "Deployment",
               "metadata": {"name": "web", "namespace": "default"},
               "spec": {"replicas": replicas, "selector": {"matchLabels": {"app": "web"}},
                        "template": {"metadata": {"labels": {"app": "web"}},
                                     "spec": {"containers": [{"name": "web", "image": "nginx"}]}}}})
    }

    fn count(store: &Store, resource: Resource) -> usize {
        all(store, resource).len()
    }

    #[test]
    fn deployments_scale_their_pods_and_are_collected() -> Result<(), crate::status::ApiError> {
        let store = store()?;
        create_object(&store, Resource::Deployments, deployment(3))?;
        reconcile(&store);
        assert_eq!(count(&store, Resource::ReplicaSets), 1);
        assert_eq!(count(&store, Resource::Pods), 3);
        let d = store.get(Resource::Deployments, "default", "web")?;
        assert_eq!(d["status"]["readyReplicas"], 3);
        store.update(Resource::Deployments, "default", "web", false, |cur| {
            let mut next = cur.clone();
            next["spec"]["replicas"] = json!(1);
            Ok(next)
        })?;
        reconcile(&store);
        assert_eq!(count(&store, Resource::Pods), 1);
        // A second pass changes nothing.
        let rv = store.current_rv();
        reconcile(&store);
        assert_eq!(store.current_rv(), rv);
        store.delete(Resource::Deployments, "default", "web", false, |_| Ok(()))?;
        reconcile(&store);
        assert_eq!(count(&store, Resource::ReplicaSets), 0);
        assert_eq!(count(&store, Resource::Pods), 0);
        Ok(())
    }
}
