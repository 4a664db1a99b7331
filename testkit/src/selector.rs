//! Label and field selectors (`labelSelector=`, `fieldSelector=` query parameters).
//!
//! Labels: `k=v`, `k==v`, `k!=v`, `k`, `!k`, `k in (a,b)`, `k notin (a,b)`, comma-separated (all must hold).
//! Fields: `path=v`, `path==v`, `path!=v` where path is a dotted JSON path into the object
//! (`metadata.name`, `metadata.namespace`, `spec.nodeName`, `status.phase`, ...).

use serde_json::Value;

use crate::status::ApiError;

#[derive(Debug, Clone, PartialEq)]
enum Requirement {
    Equals(String, String),
    NotEquals(String, String),
    Exists(String),
    NotExists(String),
    In(String, Vec<String>),
    NotIn(String, Vec<String>),
}

/// A parsed label selector; the empty selector matches everything.
#[derive(Debug, Clone, Default, PartialEq)]
pub(crate) struct LabelSelector(Vec<Requirement>);

impl LabelSelector {
    pub(crate) fn parse(text: &str) -> Result<LabelSelector, ApiError> {
        let mut reqs = Vec::new();
        for part in split_top_level(text) {
            let part = part.trim();
            if part.is_empty() {
                continue;
            }
            reqs.push(parse_label_requirement(part).ok_or_else(|| {
                ApiError::bad_request(format!(
                    "unable to parse requirement: found '{part}', expected a valid selector"
                ))
            })?);
        }
        Ok(LabelSelector(reqs))
    }

    pub(crate) fn matches(&self, object: &Value) -> bool {
        let labels = &object["metadata"]["labels"];
        let get = |k: &str| labels.get(k).and_then(Value::as_str);
        self.0.iter().all(|req| match req {
            Requirement::Equals(k, v) => get(k) == Some(v.as_str()),
            Requirement::NotEquals(k, v) => get(k) != Some(v.as_str()),
            Requirement::Exists(k) => get(k).is_some(),
            Requirement::NotExists(k) => get(k).is_none(),
            Requirement::In(k, vs) => get(k).is_some_and(|l| vs.iter().any(|v| v == l)),
            Requirement::NotIn(k, vs) => get(k).is_none_or(|l| vs.iter().all(|v| v != l)),
        })
    }
}

/// Splits on commas that are not inside parentheses.
fn split_top_level(text: &str) -> Vec<&str> {
    let mut parts = Vec::new();
    let (mut depth, mut start) = (0i32, 0);
    for (i, c) in text.char_indices() {
        match c {
            '(' => depth += 1,
            ')' => depth -= 1,
            ',' if depth == 0 => {
                parts.push(&text[start..i]);
                start = i + 1;
            }
            _ => {}
        }
    }
    parts.push(&text[start..]);
    parts
}

fn valid_key(k: &str) -> bool {
    !k.is_empty()
        && k.len() <= 317
        && k.chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.' | '/'))
}

fn valid_value(v: &str) -> bool {
    v.len() <= 63
        && v.chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))
}

fn parse_label_requirement(part: &str) -> Option<Requirement> {
    if let Some(key) = part.strip_prefix('!') {
        let key = key.trim();
        return valid_key(key).then(|| Requirement::NotExists(key.into()));
    }
    for (op, negate) in [("!=", true), ("==", false), ("=", false)] {
        if let Some((k, v)) = part.split_once(op) {
            let (k, v) = (k.trim(), v.trim());
            if !valid_key(k) || !valid_value(v) {
                return None;
            }
            return Some(if negate {
                Requirement::NotEquals(k.into(), v.into())
            } else {
                Requirement::Equals(k.into(), v.into())
            });
        }
    }
    if let Some(open) = part.find('(') {
        let close = part.rfind(')')?;
        if close != part.len() - 1 || close < open {
            return None;
        }
        let head: Vec<&str> = part[..open].split_whitespace().collect();
        let values: Vec<String> = part[open + 1..close]
            .split(',')
            .map(|v| v.trim().to_string())
            .collect();
        if values.iter().any(|v| !valid_value(v)) {
            return None;
        }
        return match head.as_slice() {
            [k, "in"] if valid_key(k) => Some(Requirement::In((*k).into(), values)),
            [k, "notin"] if valid_key(k) => Some(Requirement::NotIn((*k).into(), values)),
            _ => None,
        };
    }
    valid_key(part).then(|| Requirement::Exists(part.into()))
}

/// A parsed field selector; the empty selector matches everything.
#[derive(Debug, Clone, Default, PartialEq)]
pub(crate) struct FieldSelector(Vec<(String, bool, String)>);

impl FieldSelector {
    pub(crate) fn parse(text: &str) -> Result<FieldSelector, ApiError> {
        let mut reqs = Vec::new();
        for part in text.split(',') {
            let part = part.trim();
            if part.is_empty() {
                continue;
            }
            let parsed = [("!=", false), ("==", true), ("=", true)]
                .iter()
                .find_map(|(op, eq)| {
                    part.split_once(op)
                        .map(|(k, v)| (k.trim().to_string(), *eq, v.trim().to_string()))
                });
            match parsed {
                Some((k, eq, v)) if !k.is_empty() => reqs.push((k, eq, v)),
                _ => {
                    return Err(ApiError::bad_request(format!(
                        "invalid selector: '{part}'; can't understand '{part}'"
                    )));
                }
            }
        }
        Ok(FieldSelector(reqs))
    }

    pub(crate) fn matches(&self, object: &Value) -> bool {
        self.0.iter().all(|(path, eq, want)| {
            let mut v = object;
            for seg in path.split('.') {
                v = &v[seg];
            }
            let have = match v {
                Value::String(s) => s.clone(),
                Value::Null => String::new(),
                other => other.to_string(),
            };
            (have == *want) == *eq
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn obj() -> Value {
        json!({"metadata": {"name": "a", "namespace": "default", "labels": {"app": "web", "tier": "front"}},
               "status": {"phase": "Running"}})
    }

    #[test]
    fn label_selectors() -> Result<(), ApiError> {
        let o = obj();
        for (sel, want) in [
            ("", true),
            ("app=web", true),
            ("app==web", true),
            ("app=db", false),
            ("app!=db", true),
            ("app", true),
            ("!app", false),
            ("!missing", true),
            ("app in (web, db)", true),
            ("app notin (web)", false),
            ("missing notin (x)", true),
            ("app=web,tier=front", true),
            ("app=web,tier=back", false),
            ("app in (db,x),tier=front", false),
        ] {
            assert_eq!(LabelSelector::parse(sel)?.matches(&o), want, "{sel}");
        }
        assert!(LabelSelector::parse("app in web").is_err());
        assert!(LabelSelector::parse("a b").is_err());
        Ok(())
    }

    #[test]
    fn field_selectors() -> Result<(), ApiError> {
        let o = obj();
        assert!(FieldSelector::parse("metadata.name=a")?.matches(&o));
        assert!(!FieldSelector::parse("metadata.name!=a")?.matches(&o));
        assert!(
            FieldSelector::parse("metadata.namespace==default,status.phase=Running")?.matches(&o)
        );
        assert!(FieldSelector::parse("spec.nodeName=")?.matches(&o));
        assert_eq!(FieldSelector::parse("")?, FieldSelector::default());
        assert!(FieldSelector::parse("nonsense").is_err());
        Ok(())
    }
}
