//! Kubernetes `Status` errors: every failure the sample apiserver reports goes through [`ApiError`], and
//! [`ApiError::to_status`] is the one place that turns it into the JSON body clients expect.

use serde_json::{Value, json};

/// An API failure with its HTTP code, Kubernetes reason and message (what kube-apiserver would say).
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct ApiError {
    pub(crate) code: u16,
    pub(crate) reason: &'static str,
    pub(crate) message: String,
    pub(crate) details: Option<Value>,
}

impl ApiError {
    fn new(code: u16, reason: &'static str, message: impl Into<String>) -> ApiError {
        ApiError {
            code,
            reason,
            message: message.into(),
            details: None,
        }
    }

    fn with_details(mut self, details: Value) -> ApiError {
        self.details = Some(details);
        self
    }

    pub(crate) fn unauthorized() -> ApiError {
        ApiError::new(401, "Unauthorized", "Unauthorized")
    }

    pub(crate) fn forbidden(message: impl Into<String>) -> ApiError {
        ApiError::new(403, "Forbidden", message)
    }

    /// 403 with kube's details (`name`, `group`, `kind`) when the request named a resource.
    pub(crate) fn forbidden_with(message: impl Into<String>, details: Option<Value>) -> ApiError {
        ApiError {
            details,
            ..ApiError::new(403, "Forbidden", message)
        }
    }

    pub(crate) fn not_found(resource: &str, name: &str) -> ApiError {
        ApiError::new(404, "NotFound", format!("{resource} \"{name}\" not found"))
            .with_details(json!({"name": name, "kind": resource}))
    }

    pub(crate) fn path_not_found() -> ApiError {
        ApiError::new(404, "NotFound", "the server could not find the requested resource")
            .with_details(json!({"causes": [{"reason": "UnexpectedServerResponse", "message": "404 page not found"}]}))
    }

    pub(crate) fn already_exists(resource: &str, name: &str) -> ApiError {
        ApiError::new(
            409,
            "AlreadyExists",
            format!("{resource} \"{name}\" already exists"),
        )
        .with_details(json!({"name": name, "kind": resource}))
    }

    pub(crate) fn conflict(resource: &str, name: &str) -> ApiError {
        ApiError::new(
            409,
            "Conflict",
            format!(
                "Operation cannot be fulfilled on {resource} \"{name}\": the object has been modified; please apply \
                 your changes to the latest version and try again"
            ),
        )
        .with_details(json!({"name": name, "kind": resource}))
    }

    pub(crate) fn precondition_failed(resource: &str, name: &str, what: &str) -> ApiError {
        ApiError::new(
            409,
            "Conflict",
            format!("Operation cannot be fulfilled on {resource} \"{name}\": {what}"),
        )
        .with_details(json!({"name": name, "kind": resource}))
    }

    /// 422: `kind "name" is invalid: field: detail`, one cause per field error.
    pub(crate) fn invalid(kind: &str, name: &str, errors: &[FieldError]) -> ApiError {
        let list: Vec<String> = errors
            .iter()
            .map(|e| format!("{}: {}", e.field, e.message))
            .collect();
        let message = if list.len() == 1 {
            format!("{kind} \"{name}\" is invalid: {}", list[0])
        } else {
            format!("{kind} \"{name}\" is invalid: [{}]", list.join(", "))
        };
        let causes: Vec<Value> = errors
            .iter()
            .map(|e| json!({"reason": e.reason, "message": e.message, "field": e.field}))
            .collect();
        ApiError::new(422, "Invalid", message)
            .with_details(json!({"name": name, "kind": kind, "causes": causes}))
    }

    /// 422 without field causes (a JSON patch that does not apply, for example).
    pub(crate) fn unprocessable(message: impl Into<String>) -> ApiError {
        ApiError::new(422, "Invalid", message)
    }

    pub(crate) fn bad_request(message: impl Into<String>) -> ApiError {
        ApiError::new(400, "BadRequest", message)
    }

    pub(crate) fn method_not_allowed(message: impl Into<String>) -> ApiError {
        ApiError::new(405, "MethodNotAllowed", message)
    }

    pub(crate) fn not_acceptable(message: impl Into<String>) -> ApiError {
        ApiError::new(406, "NotAcceptable", message)
    }

    pub(crate) fn gone(message: impl Into<String>) -> ApiError {
        ApiError::new(410, "Expired", message)
    }

    pub(crate) fn too_large(limit: usize) -> ApiError {
        ApiError::new(
            413,
            "RequestEntityTooLarge",
            format!("Request entity too large: limit is {limit}"),
        )
    }

    pub(crate) fn unsupported_media_type(content_type: &str) -> ApiError {
        ApiError::new(
            415,
            "UnsupportedMediaType",
            format!(
                "the body of the request was in an unknown format - accepted media types include: application/json-patch+json, application/merge-patch+json, application/strategic-merge-patch+json; got {content_type:?}"
            ),
        )
    }

    pub(crate) fn timeout(message: impl Into<String>) -> ApiError {
        ApiError::new(408, "Timeout", message)
    }

    /// The `Status` object kube-apiserver sends for this error.
    pub(crate) fn to_status(&self) -> Value {
        let mut status = json!({
            "kind": "Status",
            "apiVersion": "v1",
            "metadata": {},
            "status": "Failure",
            "message": self.message,
            "reason": self.reason,
            "code": self.code,
        });
        if let (Some(details), Some(map)) = (&self.details, status.as_object_mut()) {
            map.insert("details".into(), details.clone());
        }
        status
    }
}

/// One field validation failure inside a 422 Invalid.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct FieldError {
    pub(crate) field: String,
    pub(crate) reason: &'static str,
    pub(crate) message: String,
}

impl FieldError {
    pub(crate) fn required(field: &str, detail: &str) -> FieldError {
        let message = if detail.is_empty() {
            "Required value".to_string()
        } else {
            format!("Required value: {detail}")
        };
        FieldError {
            field: field.into(),
            reason: "FieldValueRequired",
            message,
        }
    }

    pub(crate) fn invalid(field: &str, value: &str, detail: &str) -> FieldError {
        FieldError {
            field: field.into(),
            reason: "FieldValueInvalid",
            message: format!("Invalid value: {value:?}: {detail}"),
        }
    }

    pub(crate) fn too_long(field: &str, max: usize) -> FieldError {
        FieldError {
            field: field.into(),
            reason: "FieldValueTooLong",
            message: format!("Too long: may not be more than {max} bytes"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn not_found_matches_kube_apiserver() {
        let status = ApiError::not_found("configmaps", "x").to_status();
        assert_eq!(status["kind"], "Status");
        assert_eq!(status["apiVersion"], "v1");
        assert_eq!(status["status"], "Failure");
        assert_eq!(status["reason"], "NotFound");
        assert_eq!(status["code"], 404);
        assert_eq!(status["message"], "configmaps \"x\" not found");
        assert_eq!(status["details"]["kind"], "configmaps");
    }

    #[test]
    fn invalid_lists_every_cause() {
        let errors = [
            FieldError::required("metadata.name", ""),
            FieldError::too_long("data", 10),
        ];
        let status = ApiError::invalid("ConfigMap", "x", &errors).to_status();
        assert_eq!(status["code"], 422);
        assert_eq!(
            status["details"]["causes"].as_array().map(Vec::len),
            Some(2)
        );
        assert!(
            status["message"]
                .as_str()
                .is_some_and(|m| m.starts_with("ConfigMap \"x\" is invalid: ["))
        );
    }
}
