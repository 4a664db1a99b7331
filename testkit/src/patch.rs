//! PATCH bodies: JSON merge patch (RFC 7386) and JSON patch (RFC 6902) from the `json-patch` crate, and a
//! strategic merge patch good enough for `kubectl apply` (no crate implements it without kube's Go schemas).
//!
//! The strategic merge patch here is a merge patch that also understands the directives kubectl emits:
//! `$patch: replace|delete` in maps, `$setElementOrder/…` and `$retainKeys` (ignored), `$deleteFromPrimitiveList/…`,
//! and lists of objects with a `name` key (containers, volumes, env…), which are merged element by element as the
//! real patch strategy does for those fields. Other lists are replaced. That is not the full per-field schema of
//! kube-apiserver, but it gives the same result for what our tests and demos apply.

use serde_json::{Map, Value};

use crate::status::ApiError;

/// RFC 7386 (the `json-patch` crate's `merge`): objects merge recursively, `null` deletes, anything else replaces.
pub(crate) fn merge_patch(target: &mut Value, patch: &Value) {
    json_patch::merge(target, patch);
}

/// A strategic merge patch, as described in the module documentation.
pub(crate) fn strategic_merge_patch(target: &mut Value, patch: &Value) -> Result<(), ApiError> {
    let Value::Object(patch_map) = patch else {
        *target = patch.clone();
        return Ok(());
    };
    match patch_map.get("$patch").and_then(Value::as_str) {
        Some("replace") => {
            let mut replaced = patch_map.clone();
            replaced.remove("$patch");
            *target = Value::Object(replaced);
            return Ok(());
        }
        Some("delete") => {
            *target = Value::Null;
            return Ok(());
        }
        Some("merge") | None => {}
        Some(other) => {
            return Err(ApiError::bad_request(format!(
                "unknown patch type: {other:?}"
            )));
        }
    }
    if !target.is_object() {
        *target = Value::Object(Map::new());
    }
    let Value::Object(target_map) = target else {
        return Ok(());
    };
    for (key, value) in patch_map {
        if key == "$patch" || key == "$retainKeys" || key.starts_with("$setElementOrder/") {
            continue;
        }
        if let Some(field) = key.strip_prefix("$deleteFromPrimitiveList/") {
            if let (Some(Value::Array(items)), Value::Array(remove)) =
                (target_map.get_mut(field), value)
            {
                items.retain(|item| !remove.contains(item));
            }
            continue;
        }
        if value.is_null() {
            target_map.remove(key);
            continue;
        }
        let slot = target_map.entry(key.clone()).or_insert(Value::Null);
        match (&mut *slot, value) {
            (Value::Array(items), Value::Array(patch_items))
                if is_named_list(patch_items) && is_named_list(items) =>
            {
                merge_named_list(items, patch_items)?;
            }
            (_, Value::Object(_)) => {
                strategic_merge_patch(slot, value)?;
                if slot.is_null() {
                    target_map.remove(key);
                }
            }
            (_, Value::Array(patch_items)) => *slot = Value::Array(strip_directives(patch_items)),
            _ => *slot = value.clone(),
        }
    }
    Ok(())
}

fn is_named_list(items: &[Value]) -> bool {
    items
        .iter()
        .all(|i| i.get("name").is_some_and(Value::is_string))
}

fn merge_named_list(items: &mut Vec<Value>, patch_items: &[Value]) -> Result<(), ApiError> {
    for patch_item in patch_items {
        let name = &patch_item["name"];
        let pos = items.iter().position(|i| &i["name"] == name);
        let delete = patch_item.get("$patch").and_then(Value::as_str) == Some("delete");
        match (pos, delete) {
            (Some(pos), true) => {
                items.remove(pos);
            }
            (None, true) => {}
            (Some(pos), false) => strategic_merge_patch(&mut items[pos], patch_item)?,
            (None, false) => {
                let mut fresh = Value::Object(Map::new());
                strategic_merge_patch(&mut fresh, patch_item)?;
                items.push(fresh);
            }
        }
    }
    Ok(())
}

fn strip_directives(items: &[Value]) -> Vec<Value> {
    items
        .iter()
        .map(|item| match item {
            Value::Object(map) => Value::Object(
                map.iter()
                    .filter(|(k, _)| !k.starts_with('$'))
                    .map(|(k, v)| (k.clone(), v.clone()))
                    .collect(),
            ),
            other => other.clone(),
        })
        .collect()
}

/// RFC 6902 JSON patch (add, remove, replace, move, copy, test) with the `json-patch` crate: 400 when the body is
/// not a patch, 422 when it does not apply (the document is left unchanged, as the crate undoes partial work).
pub(crate) fn json_patch(target: &mut Value, patch: &Value) -> Result<(), ApiError> {
    let ops: json_patch::Patch = serde_json::from_value(patch.clone())
        .map_err(|e| ApiError::bad_request(format!("invalid JSON patch: {e}")))?;
    json_patch::patch(target, &ops).map_err(|e| ApiError::unprocessable(e.to_string()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn merge_patch_follows_rfc_7386() {
        let mut doc = json!({"a": "b", "c": {"d": "e", "f": "g"}});
        merge_patch(&mut doc, &json!({"a": "z", "c": {"f": null}}));
        assert_eq!(doc, json!({"a": "z", "c": {"d": "e"}}));
        let mut doc = json!({"list": [1, 2]});
        merge_patch(&mut doc, &json!({"list": [3]}));
        assert_eq!(doc, json!({"list": [3]}));
    }

    #[test]
    fn strategic_patch_from_kubectl_apply_of_a_configmap() -> Result<(), ApiError> {
        let mut doc = json!({"metadata": {"name": "x", "annotations": {"kubectl.kubernetes.io/last-applied-configuration": "old"}},
                             "data": {"a": "1", "b": "2"}});
        let patch = json!({"data": {"a": "10", "b": null, "c": "3"},
                           "metadata": {"annotations": {"kubectl.kubernetes.io/last-applied-configuration": "new"}}});
        strategic_merge_patch(&mut doc, &patch)?;
        assert_eq!(doc["data"], json!({"a": "10", "c": "3"}));
        assert_eq!(
            doc["metadata"]["annotations"]["kubectl.kubernetes.io/last-applied-configuration"],
            "new"
        );
        Ok(())
    }

    #[test]
    fn strategic_patch_merges_named_lists_and_obeys_directives() -> Result<(), ApiError> {
        let mut doc = json!({"spec": {"containers": [{"name": "main", "image": "a", "tty": true}, {"name": "side", "image": "s"}]}});
        let patch = json!({"spec": {"$setElementOrder/containers": [{"name": "main"}],
                                    "containers": [{"name": "main", "image": "b"}, {"name": "side", "$patch": "delete"}]}});
        strategic_merge_patch(&mut doc, &patch)?;
        assert_eq!(
            doc,
            json!({"spec": {"containers": [{"name": "main", "image": "b", "tty": true}]}})
        );
        let mut doc = json!({"m": {"a": 1, "b": 2}, "l": [1, 2, 3]});
        strategic_merge_patch(
            &mut doc,
            &json!({"m": {"$patch": "replace", "c": 3}, "$deleteFromPrimitiveList/l": [2]}),
        )?;
        assert_eq!(doc, json!({"m": {"c": 3}, "l": [1, 3]}));
        assert!(strategic_merge_patch(&mut doc, &json!({"$patch": "bogus"})).is_err());
        Ok(())
    }

    #[test]
    fn json_patch_ops() -> Result<(), ApiError> {
        let mut doc = json!({"metadata": {"labels": {"a": "1"}}, "list": [1, 2]});
        let patch = json!([
            {"op": "add", "path": "/metadata/labels/b~1c", "value": "2"},
            {"op": "replace", "path": "/metadata/labels/a", "value": "9"},
            {"op": "add", "path": "/list/-", "value": 3},
            {"op": "remove", "path": "/list/0"},
            {"op": "copy", "from": "/list", "path": "/copy"},
            {"op": "move", "from": "/copy", "path": "/moved"},
            {"op": "test", "path": "/moved", "value": [2, 3]}
        ]);
        json_patch(&mut doc, &patch)?;
        assert_eq!(
            doc,
            json!({"metadata": {"labels": {"a": "9", "b/c": "2"}}, "list": [2, 3], "moved": [2, 3]})
        );
        assert_eq!(
            json_patch(&mut doc, &json!([{"op": "remove", "path": "/nope"}])).map_err(|e| e.code),
            Err(422)
        );
        assert_eq!(
            json_patch(
                &mut doc,
                &json!([{"op": "test", "path": "/list", "value": []}])
            )
            .map_err(|e| e.code),
            Err(422)
        );
        assert_eq!(
            json_patch(&mut doc, &json!({"op": "add"})).map_err(|e| e.code),
            Err(400)
        );
        Ok(())
    }
}
