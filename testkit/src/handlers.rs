//! Routing and the resource handlers: discovery, GET, LIST (selectors, paging), WATCH, POST, PUT, PATCH, DELETE.
//! Errors become `Status` responses in exactly one place, [`error_response`].

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::{HeaderValue, Method, Request, Response, StatusCode, header};
use http_body_util::BodyExt as _;
use hyper::body::Incoming;
use serde_json::{Value, json};
use tokio::sync::{broadcast, mpsc};

use crate::auth::{Attributes, User};
use crate::body::Body;
use crate::objects::{bump_generation, create_object_with, keep_status, place};
use crate::resources::{self, IncludeObject, Resource};
use crate::selector::{FieldSelector, LabelSelector};
use crate::server::{BODY_READ_TIMEOUT, MAX_BODY, Shared};
use crate::status::{ApiError, FieldError};
use crate::store::{Event, EventType};
use crate::{patch, util};

type Result<T, E = ApiError> = std::result::Result<T, E>;

/// The namespaces kube-apiserver refuses to delete.
const PROTECTED_NAMESPACES: [&str; 3] = ["default", "kube-system", "kube-public"];

/// A JSON response.
pub(crate) fn json_response(status: StatusCode, value: &Value) -> Response<Body> {
    let mut bytes = serde_json::to_vec(value).unwrap_or_default();
    bytes.push(b'\n');
    let mut response = Response::new(Body::full(bytes));
    *response.status_mut() = status;
    let headers = response.headers_mut();
    headers.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    headers.insert(
        header::CACHE_CONTROL,
        HeaderValue::from_static("no-cache, private"),
    );
    response
}

/// The `Status` response for an error: the one place errors become HTTP.
pub(crate) fn error_response(error: &ApiError) -> Response<Body> {
    let status = StatusCode::from_u16(error.code).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    json_response(status, &error.to_status())
}

fn text_response(text: &'static str) -> Response<Body> {
    let mut response = Response::new(Body::full(text));
    response.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("text/plain; charset=utf-8"),
    );
    response
}

/// Which object a resource request addresses.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Target {
    pub(crate) resource: Resource,
    pub(crate) namespace: Option<String>,
    pub(crate) name: Option<String>,
    pub(crate) subresource: Option<String>,
}

/// Parses the part of a path after `/api/v1/` (group "") or `/apis/GROUP/v1/`.
fn parse_target(group: &str, rest: &[&str]) -> Option<Target> {
    let target = |r: &str, ns: Option<&str>, name: Option<&str>, sub: Option<&str>| {
        Some(Target {
            resource: Resource::from_plural(group, r)?,
            namespace: ns.map(str::to_string),
            name: name.map(str::to_string),
            subresource: sub.map(str::to_string),
        })
    };
    let namespaced_under = rest.len() >= 3
        && rest[0] == "namespaces"
        && Resource::from_plural(group, rest[2]).is_some_and(Resource::namespaced);
    let t = match rest {
        _ if namespaced_under => match rest {
            [_, ns, r] => target(r, Some(ns), None, None),
            [_, ns, r, name] => target(r, Some(ns), Some(name), None),
            [_, ns, r, name, sub] => target(r, Some(ns), Some(name), Some(sub)),
            _ => None,
        },
        [r] => target(r, None, None, None),
        [r, name] => target(r, None, Some(name), None),
        [r, name, sub] => target(r, None, Some(name), Some(sub)),
        _ => None,
    }?;
    // Namespaced resources are addressed without a namespace only as the all-namespaces collection.
    let ok = if t.resource.namespaced() {
        t.namespace.is_some() || t.name.is_none()
    } else {
        t.namespace.is_none()
    };
    ok.then_some(t)
}

/// The parsed query string.
struct Query(Vec<(String, String)>);

impl Query {
    fn get(&self, key: &str) -> Option<&str> {
        self.0
            .iter()
            .find(|(k, _)| k == key)
            .map(|(_, v)| v.as_str())
    }

    fn flag(&self, key: &str) -> bool {
        matches!(self.get(key), Some("true" | "1"))
    }

    fn dry_run(&self) -> Result<bool> {
        match self.get("dryRun") {
            None | Some("") => Ok(false),
            Some("All") => Ok(true),
            Some(other) => Err(ApiError::bad_request(format!(
                "Invalid dry run value: {other:?}: supported values: \"All\""
            ))),
        }
    }
}

/// How GET, LIST and WATCH render objects, from the Accept header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Output {
    Json,
    Table(IncludeObject),
    Partial,
}

fn output(headers: &http::HeaderMap, query: &Query) -> Result<Output> {
    let accept = headers
        .get(header::ACCEPT)
        .and_then(|v| v.to_str().ok())
        .unwrap_or("");
    let include = match query.get("includeObject") {
        None | Some("") | Some("Metadata") => IncludeObject::Metadata,
        Some("Object") => IncludeObject::Object,
        Some("None") => IncludeObject::None,
        Some(other) => {
            return Err(ApiError::bad_request(format!(
                "unsupported includeObject value {other:?}"
            )));
        }
    };
    let mut json_ok = accept.is_empty();
    for media in accept.split(',') {
        let params: Vec<&str> = media.split(';').map(str::trim).collect();
        let kind = params.first().copied().unwrap_or("");
        let param = |k: &str| {
            params
                .iter()
                .find_map(|p| p.strip_prefix(k).and_then(|v| v.strip_prefix('=')))
        };
        if !matches!(kind, "application/json" | "application/*" | "*/*") {
            continue;
        }
        match (param("as"), param("g")) {
            (Some("Table"), Some("meta.k8s.io")) => return Ok(Output::Table(include)),
            (Some("PartialObjectMetadata" | "PartialObjectMetadataList"), Some("meta.k8s.io")) => {
                return Ok(Output::Partial);
            }
            (None, _) => json_ok = true,
            _ => {}
        }
    }
    if json_ok {
        Ok(Output::Json)
    } else {
        Err(ApiError::not_acceptable(format!(
            "only the following media types are accepted: application/json, application/yaml; got {accept:?}"
        )))
    }
}

/// Routes an authenticated request.
pub(crate) async fn route(
    shared: &Arc<Shared>,
    user: User,
    req: Request<Incoming>,
) -> Response<Body> {
    match dispatch(shared, &user, req).await {
        Ok(response) => response,
        Err(error) => error_response(&error),
    }
}

async fn dispatch(
    shared: &Arc<Shared>,
    user: &User,
    req: Request<Incoming>,
) -> Result<Response<Body>> {
    let path = req.uri().path().to_string();
    let segments: Vec<&str> = path.split('/').filter(|s| !s.is_empty()).collect();
    let query = Query(util::query_pairs(req.uri().query()));
    let method = req.method().clone();

    let target = match segments.as_slice() {
        ["api", "v1", rest @ ..] if !rest.is_empty() => {
            Some(parse_target("", rest).ok_or_else(ApiError::path_not_found)?)
        }
        ["apis", group, "v1", rest @ ..]
            if !rest.is_empty() && resources::RESOURCE_GROUPS.contains(group) =>
        {
            Some(parse_target(group, rest).ok_or_else(ApiError::path_not_found)?)
        }
        _ => None,
    };
    let self_review = match segments.as_slice() {
        ["apis", group, "v1", resource]
            if matches!(
                (*group, *resource),
                (resources::AUTHENTICATION_GROUP, "selfsubjectreviews")
                    | (
                        resources::AUTHORIZATION_GROUP,
                        "selfsubjectaccessreviews" | "selfsubjectrulesreviews"
                    )
            ) =>
        {
            Some((group.to_string(), resource.to_string()))
        }
        _ => None,
    };
    let mut attrs = attributes(&method, &path, target.as_ref(), &query);
    if let Some((group, resource)) = &self_review {
        attrs = Attributes {
            verb: "create".into(),
            resource_request: true,
            api_group: group.clone(),
            api_version: "v1".into(),
            resource: resource.clone(),
            ..attrs
        };
    }
    shared.authz.check(user, &attrs).await?;
    if let Some((_, resource)) = self_review {
        if method != Method::POST {
            return Err(ApiError::method_not_allowed(format!(
                "the server does not allow this method on the requested resource: {method}"
            )));
        }
        let (headers, body) = read_body(req).await?;
        let answer = match resource.as_str() {
            // The body (a SelfSubjectReview, protobuf from kubectl) carries nothing the answer depends on.
            "selfsubjectreviews" => resources::self_subject_review(user),
            "selfsubjectaccessreviews" => {
                crate::reviews::access_review(&shared.authz, user, decode(&headers, &body)?).await?
            }
            _ => crate::reviews::rules_review(&shared.authz, user, decode(&headers, &body)?)?,
        };
        return Ok(json_response(StatusCode::CREATED, &answer));
    }

    let Some(target) = target else {
        if method != Method::GET && method != Method::HEAD {
            return Err(ApiError::method_not_allowed(format!(
                "the server does not allow this method on the requested resource: {method}"
            )));
        }
        return match segments.as_slice() {
            [] => Ok(json_response(
                StatusCode::OK,
                &json!({"paths": ["/api", "/api/v1", "/apis", "/healthz", "/livez", "/openapi/v2", "/openapi/v3", "/readyz", "/version"]}),
            )),
            ["version"] => Ok(json_response(StatusCode::OK, &resources::version())),
            ["healthz" | "livez" | "readyz", ..] => Ok(text_response("ok")),
            ["api"] => Ok(json_response(
                StatusCode::OK,
                &resources::api_versions(&shared.addr.to_string()),
            )),
            ["api", "v1"] => Ok(json_response(
                StatusCode::OK,
                &resources::api_resource_list(""),
            )),
            ["apis", group] if resources::RESOURCE_GROUPS.contains(group) => {
                Ok(json_response(StatusCode::OK, &resources::api_group(group)))
            }
            ["apis", group, "v1"] if resources::RESOURCE_GROUPS.contains(group) => Ok(
                json_response(StatusCode::OK, &resources::api_resource_list(group)),
            ),
            ["apis"] => Ok(json_response(StatusCode::OK, &resources::api_group_list())),
            ["apis", resources::AUTHENTICATION_GROUP] => Ok(json_response(
                StatusCode::OK,
                &resources::authentication_api_group(),
            )),
            ["apis", resources::AUTHENTICATION_GROUP, "v1"] => Ok(json_response(
                StatusCode::OK,
                &resources::authentication_resource_list(),
            )),
            ["apis", resources::AUTHORIZATION_GROUP] => Ok(json_response(
                StatusCode::OK,
                &resources::authorization_api_group(),
            )),
            ["apis", resources::AUTHORIZATION_GROUP, "v1"] => Ok(json_response(
                StatusCode::OK,
                &resources::authorization_resource_list(),
            )),
            ["openapi", rest @ ..] => crate::openapi::handle(rest, req.uri().query()),
            _ => Err(ApiError::path_not_found()),
        };
    };

    let resource = target.resource;
    let result = match (
        target.subresource.as_deref(),
        &method,
        target.name.is_some(),
    ) {
        (None, &Method::GET, true) => get(shared, &target, req.headers(), &query),
        (None, &Method::GET, false) if query.flag("watch") => {
            watch(shared, &target, req.headers(), &query)
        }
        (None, &Method::GET, false) => list(shared, &target, req.headers(), &query),
        (None, &Method::POST, false) => {
            let (headers, body) = read_body(req).await?;
            create(shared, &target, &headers, &body, &query)
        }
        (None, &Method::PUT, true) => {
            let (headers, body) = read_body(req).await?;
            update(shared, &target, &headers, &body, &query)
        }
        (None, &Method::PATCH, true) => {
            let (headers, body) = read_body(req).await?;
            patch(shared, &target, &headers, &body, &query)
        }
        (None, &Method::DELETE, true) => {
            let (_, body) = read_body(req).await?;
            delete(shared, &target, &body, &query)
        }
        (None, &Method::DELETE, false) if resource != Resource::Namespaces => {
            let (_, body) = read_body(req).await?;
            delete_collection(shared, &target, &body, &query)
        }
        (Some("status"), &Method::GET, true) => get(shared, &target, req.headers(), &query),
        (Some("scale"), &Method::GET | &Method::PUT | &Method::PATCH, true)
            if matches!(resource, Resource::Deployments | Resource::ReplicaSets) =>
        {
            let (headers, body) = read_body(req).await?;
            let response = scale(shared, &target, &method, &headers, &body, &query)?;
            crate::controller::reconcile(&shared.store);
            Ok(response)
        }
        (Some("log"), &Method::GET, true) if resource == Resource::Pods => {
            crate::logs::handle(shared, &target, &query.0)
        }
        (Some("exec" | "attach"), &Method::GET | &Method::POST, true)
            if resource == Resource::Pods =>
        {
            crate::exec::handle(shared, &target, &query.0, req)
        }
        (Some("portforward"), &Method::GET | &Method::POST, true) if resource == Resource::Pods => {
            crate::portforward::handle(shared, &target, req)
        }
        (
            Some("attach" | "proxy" | "eviction" | "binding" | "ephemeralcontainers" | "resize"),
            _,
            true,
        ) if resource == Resource::Pods => Err(ApiError::method_not_allowed(
            "this subresource is not implemented by the sample apiserver",
        )),
        (Some(_), _, _) => Err(ApiError::path_not_found()),
        _ => Err(ApiError::method_not_allowed(format!(
            "the server does not allow this method on the requested resource: {method}"
        ))),
    };
    // The controllers' turn: Deployments make ReplicaSets, ReplicaSets make pods, orphans are collected.
    if method != Method::GET
        && matches!(
            resource,
            Resource::Deployments | Resource::ReplicaSets | Resource::Pods
        )
    {
        crate::controller::reconcile(&shared.store);
    }
    result
}

/// Authorization attributes for a request (`authorizer.AttributesRecord`).
fn attributes(method: &Method, path: &str, target: Option<&Target>, query: &Query) -> Attributes {
    let Some(t) = target else {
        return Attributes {
            verb: method.as_str().to_ascii_lowercase(),
            resource_request: false,
            api_group: String::new(),
            api_version: String::new(),
            resource: String::new(),
            subresource: String::new(),
            namespace: String::new(),
            name: String::new(),
            path: path.to_string(),
        };
    };
    let verb = match (method, t.name.is_some()) {
        (&Method::GET | &Method::HEAD, true) => "get",
        (&Method::GET | &Method::HEAD, false) if query.flag("watch") => "watch",
        (&Method::GET | &Method::HEAD, false) => "list",
        (&Method::POST, _) => "create",
        (&Method::PUT, _) => "update",
        (&Method::PATCH, _) => "patch",
        (&Method::DELETE, true) => "delete",
        (&Method::DELETE, false) => "deletecollection",
        _ => "",
    };
    // kube-apiserver authorizes exec, attach and portforward as "create" whatever the method (KEP-4006: a
    // WebSocket upgrade is a GET, and still needs `create`).
    let verb = if matches!(
        t.subresource.as_deref(),
        Some("exec" | "attach" | "portforward")
    ) {
        "create"
    } else {
        verb
    };
    // For a namespace object, the namespace attribute is its own name.
    let namespace = match (&t.namespace, t.resource) {
        (Some(ns), _) => ns.clone(),
        (None, Resource::Namespaces) => t.name.clone().unwrap_or_default(),
        (None, _) => String::new(),
    };
    Attributes {
        verb: verb.into(),
        resource_request: true,
        api_group: t.resource.group().into(),
        api_version: "v1".into(),
        resource: t.resource.plural().into(),
        subresource: t.subresource.clone().unwrap_or_default(),
        namespace,
        name: t.name.clone().unwrap_or_default(),
        path: path.to_string(),
    }
}

/// Reads a request body (at most [`MAX_BODY`] bytes, within [`BODY_READ_TIMEOUT`]).
async fn read_body(req: Request<Incoming>) -> Result<(http::HeaderMap, Bytes)> {
    let declared = req
        .headers()
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    if declared.is_some_and(|n| n > MAX_BODY as u64) {
        return Err(ApiError::too_large(MAX_BODY));
    }
    let (parts, body) = req.into_parts();
    let limited = http_body_util::Limited::new(body, MAX_BODY);
    match tokio::time::timeout(BODY_READ_TIMEOUT, limited.collect()).await {
        Ok(Ok(collected)) => Ok((parts.headers, collected.to_bytes())),
        Ok(Err(error)) if error.is::<http_body_util::LengthLimitError>() => {
            Err(ApiError::too_large(MAX_BODY))
        }
        Ok(Err(error)) => Err(ApiError::bad_request(format!(
            "unable to read the request body: {error}"
        ))),
        Err(_) => Err(ApiError::timeout("timed out reading the request body")),
    }
}

fn content_type(headers: &http::HeaderMap) -> String {
    headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.split(';').next())
        .unwrap_or("")
        .trim()
        .to_ascii_lowercase()
}

/// Decodes a JSON or YAML body into a value.
fn decode(headers: &http::HeaderMap, body: &[u8]) -> Result<Value> {
    let ct = content_type(headers);
    if ct == "application/vnd.kubernetes.protobuf" {
        crate::protobuf::decode(body)
    } else if ct.contains("yaml") {
        serde_yaml::from_slice(body).map_err(|e| {
            ApiError::bad_request(format!("couldn't get version/kind; yaml parse error: {e}"))
        })
    } else if ct.is_empty() || ct.contains("json") {
        serde_json::from_slice(body).map_err(|e| {
            ApiError::bad_request(format!("couldn't get version/kind; json parse error: {e}"))
        })
    } else {
        Err(ApiError::unsupported_media_type(&ct))
    }
}

fn get(
    shared: &Shared,
    t: &Target,
    headers: &http::HeaderMap,
    query: &Query,
) -> Result<Response<Body>> {
    let name = t.name.as_deref().unwrap_or_default();
    let obj = shared
        .store
        .get(t.resource, t.namespace.as_deref().unwrap_or(""), name)?;
    let body = match output(headers, query)? {
        Output::Json => obj,
        Output::Partial => resources::partial_metadata(&obj),
        Output::Table(include) => {
            let rv = obj["metadata"]["resourceVersion"].clone();
            resources::table(
                t.resource,
                &[obj],
                json!({"resourceVersion": rv}),
                include,
                true,
            )
        }
    };
    Ok(json_response(StatusCode::OK, &body))
}

/// A continue token: where the next page starts, and the resourceVersion of the first page.
fn encode_continue(rv: u64, next: &(String, String)) -> String {
    use base64::Engine as _;
    let token = json!({"v": "meta.k8s.io/v1", "rv": rv, "ns": next.0, "name": next.1});
    base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(token.to_string())
}

fn decode_continue(token: &str) -> Result<(u64, (String, String))> {
    use base64::Engine as _;
    let invalid = || ApiError::bad_request(format!("continue key is not valid: {token:?}"));
    let bytes = base64::engine::general_purpose::URL_SAFE_NO_PAD
        .decode(token.trim_end_matches('='))
        .map_err(|_| invalid())?;
    let v: Value = serde_json::from_slice(&bytes).map_err(|_| invalid())?;
    match (v["rv"].as_u64(), v["ns"].as_str(), v["name"].as_str()) {
        (Some(rv), Some(ns), Some(name)) => Ok((rv, (ns.to_string(), name.to_string()))),
        _ => Err(invalid()),
    }
}

fn selectors(query: &Query) -> Result<(LabelSelector, FieldSelector)> {
    Ok((
        LabelSelector::parse(query.get("labelSelector").unwrap_or(""))?,
        FieldSelector::parse(query.get("fieldSelector").unwrap_or(""))?,
    ))
}

fn list(
    shared: &Shared,
    t: &Target,
    headers: &http::HeaderMap,
    query: &Query,
) -> Result<Response<Body>> {
    let out = output(headers, query)?;
    let (labels, fields) = selectors(query)?;
    let limit = match query.get("limit") {
        None | Some("") => None,
        Some(l) => match l.parse::<i64>() {
            Ok(n) if n > 0 => Some(usize::try_from(n).unwrap_or(usize::MAX)),
            Ok(_) => None,
            Err(_) => return Err(ApiError::bad_request(format!("invalid limit {l:?}"))),
        },
    };
    let (first_rv, after) = match query.get("continue") {
        None | Some("") => (None, None),
        Some(token) => {
            let (rv, after) = decode_continue(token)?;
            (Some(rv), Some(after))
        }
    };
    let filter = |o: &Value| labels.matches(o) && fields.matches(o);
    let page = shared
        .store
        .list(t.resource, t.namespace.as_deref(), &filter, limit, after);
    let rv = first_rv.unwrap_or(page.rv);
    let mut meta = json!({"resourceVersion": rv.to_string()});
    if let Some(next) = &page.next {
        meta["continue"] = json!(encode_continue(rv, next));
        meta["remainingItemCount"] = json!(page.remaining);
    }
    let body = match out {
        Output::Table(include) => resources::table(t.resource, &page.items, meta, include, true),
        Output::Partial => json!({
            "kind": "PartialObjectMetadataList",
            "apiVersion": "meta.k8s.io/v1",
            "metadata": meta,
            "items": page.items.iter().map(resources::partial_metadata).collect::<Vec<_>>(),
        }),
        Output::Json => json!({
            "kind": format!("{}List", t.resource.kind()),
            "apiVersion": t.resource.api_version(),
            "metadata": meta,
            "items": page.items.into_iter().map(strip_type_meta).collect::<Vec<_>>(),
        }),
    };
    Ok(json_response(StatusCode::OK, &body))
}

/// List items carry no apiVersion/kind, as in kube-apiserver's responses.
fn strip_type_meta(mut obj: Value) -> Value {
    if let Some(map) = obj.as_object_mut() {
        map.remove("apiVersion");
        map.remove("kind");
    }
    obj
}

fn create(
    shared: &Shared,
    t: &Target,
    headers: &http::HeaderMap,
    body: &[u8],
    query: &Query,
) -> Result<Response<Body>> {
    let mut obj = decode(headers, body)?;
    resources::check_decodable(t.resource, &obj)?;
    if t.resource.namespaced() && t.namespace.is_none() {
        return Err(ApiError::method_not_allowed(
            "create of a namespaced resource needs a namespace in the path",
        ));
    }
    place(t.resource, &mut obj, t.namespace.as_deref())?;
    let created = create_object_with(&shared.store, t.resource, obj, query.dry_run()?)?;
    Ok(json_response(StatusCode::CREATED, &created))
}

/// `…/deployments/NAME/scale` and `…/replicasets/NAME/scale`: an `autoscaling/v1` Scale view of `spec.replicas`.
fn scale(
    shared: &Shared,
    t: &Target,
    method: &Method,
    headers: &http::HeaderMap,
    body: &[u8],
    query: &Query,
) -> Result<Response<Body>> {
    let name = t.name.as_deref().unwrap_or_default();
    let namespace = t.namespace.as_deref().unwrap_or_default();
    let as_scale = |obj: &Value| {
        let selector = obj["spec"]["selector"]["matchLabels"]
            .as_object()
            .into_iter()
            .flatten()
            .map(|(k, v)| format!("{k}={}", v.as_str().unwrap_or_default()))
            .collect::<Vec<_>>()
            .join(",");
        let meta = &obj["metadata"];
        json!({
            "kind": "Scale",
            "apiVersion": "autoscaling/v1",
            "metadata": {"name": meta["name"], "namespace": meta["namespace"], "uid": meta["uid"],
                         "resourceVersion": meta["resourceVersion"], "creationTimestamp": meta["creationTimestamp"]},
            "spec": {"replicas": obj["spec"]["replicas"].as_i64().unwrap_or(0)},
            "status": {"replicas": obj["status"]["replicas"].as_i64().unwrap_or(0), "selector": selector},
        })
    };
    if method == Method::GET {
        let obj = shared.store.get(t.resource, namespace, name)?;
        return Ok(json_response(StatusCode::OK, &as_scale(&obj)));
    }
    let wanted = if method == Method::PUT {
        decode(headers, body)?
    } else {
        let current = as_scale(&shared.store.get(t.resource, namespace, name)?);
        let document: Value = serde_json::from_slice(body)
            .map_err(|e| ApiError::bad_request(format!("error decoding patch: {e}")))?;
        let mut next = current;
        match content_type(headers).as_str() {
            "application/json-patch+json" => patch::json_patch(&mut next, &document)?,
            "application/merge-patch+json" | "application/strategic-merge-patch+json" => {
                patch::merge_patch(&mut next, &document)
            }
            other => return Err(ApiError::unsupported_media_type(other)),
        }
        next
    };
    let replicas = wanted["spec"]["replicas"]
        .as_i64()
        .filter(|n| (0..=10_000).contains(n))
        .ok_or_else(|| {
            ApiError::invalid(
                "Scale",
                name,
                &[FieldError::invalid(
                    "spec.replicas",
                    &wanted["spec"]["replicas"].to_string(),
                    "must be between 0 and 10000 in the sample cluster",
                )],
            )
        })?;
    let rv = wanted["metadata"]["resourceVersion"].clone();
    let updated = shared
        .store
        .update(t.resource, namespace, name, query.dry_run()?, |cur| {
            let mut next = cur.clone();
            next["spec"]["replicas"] = json!(replicas);
            if rv.as_str().is_some_and(|rv| !rv.is_empty()) {
                next["metadata"]["resourceVersion"] = rv;
            }
            bump_generation(&mut next, cur);
            Ok(next)
        })?;
    Ok(json_response(StatusCode::OK, &as_scale(&updated)))
}

fn update(
    shared: &Shared,
    t: &Target,
    headers: &http::HeaderMap,
    body: &[u8],
    query: &Query,
) -> Result<Response<Body>> {
    let name = t.name.as_deref().unwrap_or_default();
    let mut obj = decode(headers, body)?;
    resources::check_decodable(t.resource, &obj)?;
    place(t.resource, &mut obj, t.namespace.as_deref())?;
    let given = obj["metadata"]["name"].as_str().unwrap_or("").to_string();
    if given.is_empty() {
        if let Some(meta) = obj["metadata"].as_object_mut() {
            meta.insert("name".into(), json!(name));
        }
    } else if given != name {
        return Err(ApiError::bad_request(format!(
            "the name of the object ({given}) does not match the name on the URL ({name})"
        )));
    }
    let resource = t.resource;
    let updated = shared.store.update(
        resource,
        t.namespace.as_deref().unwrap_or(""),
        name,
        query.dry_run()?,
        |cur| {
            let mut next = obj;
            keep_status(resource, &mut next, cur);
            resources::normalize(resource, &mut next);
            resources::validate(resource, &next)?;
            Ok(next)
        },
    )?;
    Ok(json_response(StatusCode::OK, &updated))
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum PatchKind {
    Json,
    Merge,
    Strategic,
    Apply,
}

fn patch(
    shared: &Shared,
    t: &Target,
    headers: &http::HeaderMap,
    body: &[u8],
    query: &Query,
) -> Result<Response<Body>> {
    let ct = content_type(headers);
    let kind = match ct.as_str() {
        "application/json-patch+json" => PatchKind::Json,
        "application/merge-patch+json" => PatchKind::Merge,
        "application/strategic-merge-patch+json" => PatchKind::Strategic,
        "application/apply-patch+yaml" | "application/apply-patch+json" => PatchKind::Apply,
        other => return Err(ApiError::unsupported_media_type(other)),
    };
    let document: Value = if kind == PatchKind::Apply {
        serde_yaml::from_slice(body)
            .map_err(|e| ApiError::bad_request(format!("error decoding YAML: {e}")))?
    } else {
        serde_json::from_slice(body)
            .map_err(|e| ApiError::bad_request(format!("error decoding patch: {e}")))?
    };
    let name = t.name.as_deref().unwrap_or_default();
    let namespace = t.namespace.as_deref().unwrap_or("");
    let dry_run = query.dry_run()?;
    if kind == PatchKind::Apply {
        // Server-side apply, approximated: create when missing, merge when present; no field ownership.
        resources::check_decodable(t.resource, &document)?;
        if !shared.store.exists(t.resource, namespace, name) {
            let mut obj = document;
            place(t.resource, &mut obj, t.namespace.as_deref())?;
            if let Some(meta) = obj["metadata"].as_object_mut() {
                meta.insert("name".into(), json!(name));
            }
            let created = create_object_with(&shared.store, t.resource, obj, dry_run)?;
            return Ok(json_response(StatusCode::CREATED, &created));
        }
    }
    let resource = t.resource;
    let patched = shared
        .store
        .update(resource, namespace, name, dry_run, |cur| {
            let mut next = cur.clone();
            match kind {
                PatchKind::Json => patch::json_patch(&mut next, &document)?,
                PatchKind::Merge => patch::merge_patch(&mut next, &document),
                PatchKind::Strategic | PatchKind::Apply => {
                    patch::strategic_merge_patch(&mut next, &document)?
                }
            }
            resources::check_decodable(resource, &next)?;
            place(resource, &mut next, t.namespace.as_deref())?;
            keep_status(resource, &mut next, cur);
            resources::normalize(resource, &mut next);
            resources::validate(resource, &next)?;
            Ok(next)
        })?;
    Ok(json_response(StatusCode::OK, &patched))
}

/// `DeleteOptions` fields that matter here.
struct DeleteOptions {
    dry_run: bool,
    uid: Option<String>,
    resource_version: Option<String>,
}

fn delete_options(body: &[u8], query: &Query) -> Result<DeleteOptions> {
    let mut opts = DeleteOptions {
        dry_run: query.dry_run()?,
        uid: None,
        resource_version: None,
    };
    if body.iter().all(u8::is_ascii_whitespace) {
        return Ok(opts);
    }
    let v: Value = serde_json::from_slice(body)
        .map_err(|e| ApiError::bad_request(format!("invalid DeleteOptions: {e}")))?;
    if v["dryRun"]
        .as_array()
        .is_some_and(|a| a.iter().any(|x| x == "All"))
    {
        opts.dry_run = true;
    }
    opts.uid = v["preconditions"]["uid"].as_str().map(str::to_string);
    opts.resource_version = v["preconditions"]["resourceVersion"]
        .as_str()
        .map(str::to_string);
    Ok(opts)
}

fn delete(shared: &Shared, t: &Target, body: &[u8], query: &Query) -> Result<Response<Body>> {
    let name = t.name.as_deref().unwrap_or_default();
    let opts = delete_options(body, query)?;
    if t.resource == Resource::Namespaces && PROTECTED_NAMESPACES.contains(&name) {
        return Err(ApiError::forbidden(format!(
            "namespaces \"{name}\" is forbidden: this namespace may not be deleted"
        )));
    }
    let plural = t.resource.plural();
    let deleted = shared.store.delete(t.resource, t.namespace.as_deref().unwrap_or(""), name, opts.dry_run, |cur| {
        let meta = &cur["metadata"];
        if let Some(uid) = &opts.uid {
            let have = meta["uid"].as_str().unwrap_or("");
            if uid != have {
                return Err(ApiError::precondition_failed(plural, name, &format!(
                    "Precondition failed: UID in precondition: {uid}, UID in object meta: {have}"
                )));
            }
        }
        if let Some(rv) = &opts.resource_version {
            let have = meta["resourceVersion"].as_str().unwrap_or("");
            if rv != have {
                return Err(ApiError::precondition_failed(plural, name, &format!(
                    "Precondition failed: ResourceVersion in precondition: {rv}, ResourceVersion in meta: {have}"
                )));
            }
        }
        Ok(())
    })?;
    Ok(json_response(StatusCode::OK, &deleted))
}

fn delete_collection(
    shared: &Shared,
    t: &Target,
    body: &[u8],
    query: &Query,
) -> Result<Response<Body>> {
    let opts = delete_options(body, query)?;
    let (labels, fields) = selectors(query)?;
    let filter = |o: &Value| labels.matches(o) && fields.matches(o);
    let page = shared
        .store
        .list(t.resource, t.namespace.as_deref(), &filter, None, None);
    let mut deleted = Vec::new();
    for item in page.items {
        let ns = item["metadata"]["namespace"].as_str().unwrap_or("");
        let name = item["metadata"]["name"].as_str().unwrap_or("");
        match shared
            .store
            .delete(t.resource, ns, name, opts.dry_run, |_| Ok(()))
        {
            Ok(obj) => deleted.push(strip_type_meta(obj)),
            Err(e) if e.code == 404 => {}
            Err(e) => return Err(e),
        }
    }
    let list = json!({
        "kind": format!("{}List", t.resource.kind()),
        "apiVersion": t.resource.api_version(),
        "metadata": {"resourceVersion": shared.store.current_rv().to_string()},
        "items": deleted,
    });
    Ok(json_response(StatusCode::OK, &list))
}

/// How a watch renders and filters events.
struct WatchSpec {
    resource: Resource,
    labels: LabelSelector,
    fields: FieldSelector,
    out: Output,
    /// sendInitialEvents=true: a bookmark marks the end of the initial ADDED events.
    initial_events_bookmark: bool,
    deadline: tokio::time::Instant,
}

fn watch(
    shared: &Arc<Shared>,
    t: &Target,
    headers: &http::HeaderMap,
    query: &Query,
) -> Result<Response<Body>> {
    let out = output(headers, query)?;
    let (labels, fields) = selectors(query)?;
    let send_initial = query.flag("sendInitialEvents");
    if send_initial && !query.flag("allowWatchBookmarks") {
        return Err(ApiError::invalid(
            "ListOptions",
            "",
            &[FieldError::invalid(
                "allowWatchBookmarks",
                "false",
                "allowWatchBookmarks must be set to true when sendInitialEvents is set",
            )],
        ));
    }
    let since = match query.get("resourceVersion") {
        _ if send_initial => None,
        None | Some("") | Some("0") => None,
        Some(rv) => Some(rv.parse::<u64>().map_err(|_| {
            ApiError::invalid(
                "ListOptions",
                "",
                &[FieldError::invalid(
                    "resourceVersion",
                    rv,
                    "must be a non-negative integer",
                )],
            )
        })?),
    };
    let timeout = match query.get("timeoutSeconds").map(str::parse::<u64>) {
        None => Duration::from_secs(rand::random_range(1800..3600)),
        Some(Ok(0)) => Duration::from_secs(rand::random_range(1800..3600)),
        Some(Ok(s)) => Duration::from_secs(s),
        Some(Err(_)) => return Err(ApiError::bad_request("timeoutSeconds must be an integer")),
    };
    let spec = WatchSpec {
        resource: t.resource,
        labels,
        fields,
        out,
        initial_events_bookmark: send_initial,
        deadline: tokio::time::Instant::now() + timeout,
    };
    let start = shared
        .store
        .watch(t.resource, t.namespace.as_deref(), since);
    let (tx, body) = Body::channel();
    let task_shared = shared.clone();
    let namespace = t.namespace.clone();
    shared.tracker.spawn(async move {
        let shared = task_shared;
        let result = match start {
            Ok(start) => run_watch(&shared, &spec, namespace.as_deref(), start, &tx).await,
            Err(error) => {
                send_line(&tx, &json!({"type": "ERROR", "object": error.to_status()})).await
            }
        };
        if result.is_err() {
            tracing::debug!("watch client went away");
        }
    });
    let mut response = Response::new(body);
    response.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    response.headers_mut().insert(
        header::CACHE_CONTROL,
        HeaderValue::from_static("no-cache, private"),
    );
    Ok(response)
}

/// The client is gone.
struct Gone;

async fn send_line(tx: &mpsc::Sender<Bytes>, value: &Value) -> Result<(), Gone> {
    let mut bytes = serde_json::to_vec(value).unwrap_or_default();
    bytes.push(b'\n');
    tx.send(Bytes::from(bytes)).await.map_err(|_| Gone)
}

async fn run_watch(
    shared: &Shared,
    spec: &WatchSpec,
    namespace: Option<&str>,
    start: crate::store::WatchStart,
    tx: &mpsc::Sender<Bytes>,
) -> Result<(), Gone> {
    let mut first = true;
    let mut last_rv = start.rv;
    for event in &start.initial {
        send_event(spec, event, &mut first, tx).await?;
    }
    if spec.initial_events_bookmark {
        let bookmark = json!({"type": "BOOKMARK", "object": {
            "kind": spec.resource.kind(), "apiVersion": spec.resource.api_version(),
            "metadata": {"resourceVersion": last_rv.to_string(), "annotations": {"k8s.io/initial-events-end": "true"}},
        }});
        send_line(tx, &bookmark).await?;
    }
    let mut live = start.live;
    let in_scope =
        |e: &Event| e.resource == spec.resource && namespace.is_none_or(|ns| ns == e.namespace);
    loop {
        let received = tokio::select! {
            _ = shared.shutdown.cancelled() => return Ok(()),
            _ = tx.closed() => return Err(Gone),
            _ = tokio::time::sleep_until(spec.deadline) => return Ok(()),
            received = live.recv() => received,
        };
        let events = match received {
            Ok(event) => vec![event],
            Err(broadcast::error::RecvError::Closed) => return Ok(()),
            Err(broadcast::error::RecvError::Lagged(_)) => match shared.store.events_since(last_rv)
            {
                Ok(events) => events,
                Err(error) => {
                    return send_line(tx, &json!({"type": "ERROR", "object": error.to_status()}))
                        .await;
                }
            },
        };
        for event in events {
            if event.rv <= last_rv {
                continue;
            }
            last_rv = event.rv;
            if in_scope(&event) {
                send_event(spec, &event, &mut first, tx).await?;
            }
        }
    }
}

/// Sends one event through the watch's selectors (a MODIFIED that enters or leaves the selection becomes an
/// ADDED or DELETED, as kube-apiserver does) in the watch's output format.
async fn send_event(
    spec: &WatchSpec,
    event: &Event,
    first: &mut bool,
    tx: &mpsc::Sender<Bytes>,
) -> Result<(), Gone> {
    let matches = |o: &Value| spec.labels.matches(o) && spec.fields.matches(o);
    let now = matches(&event.object);
    let kind = match event.kind {
        EventType::Modified => match (event.prev.as_ref().map(matches).unwrap_or(true), now) {
            (true, true) => EventType::Modified,
            (false, true) => EventType::Added,
            (true, false) => EventType::Deleted,
            (false, false) => return Ok(()),
        },
        other if now => other,
        _ => return Ok(()),
    };
    let object = match spec.out {
        Output::Json => event.object.clone(),
        Output::Partial => resources::partial_metadata(&event.object),
        Output::Table(include) => {
            let meta = json!({"resourceVersion": event.rv.to_string()});
            // Column definitions only in the first event: kubectl reuses them for the following ones.
            resources::table(
                spec.resource,
                std::slice::from_ref(&event.object),
                meta,
                include,
                *first,
            )
        }
    };
    *first = false;
    send_line(tx, &json!({"type": kind.as_str(), "object": object})).await
}

#[cfg(test)]
mod tests {
    use super::*;

    fn target(path: &str) -> Option<Target> {
        let segs: Vec<&str> = path.split('/').filter(|s| !s.is_empty()).collect();
        parse_target("", &segs)
    }

    #[test]
    fn paths_parse_like_kube() {
        let t = target("namespaces/default/configmaps/x");
        assert_eq!(
            t.as_ref()
                .map(|t| (t.resource, t.namespace.as_deref(), t.name.as_deref())),
            Some((Resource::ConfigMaps, Some("default"), Some("x")))
        );
        let t = target("namespaces/default");
        assert_eq!(
            t.as_ref().map(|t| (t.resource, t.name.as_deref())),
            Some((Resource::Namespaces, Some("default")))
        );
        let t = target("namespaces/default/pods/demo/log");
        assert_eq!(t.and_then(|t| t.subresource), Some("log".to_string()));
        assert!(target("configmaps").is_some());
        assert!(target("configmaps/x").is_none());
        assert!(target("namespaces/default/nodes/n").is_none());
        assert!(target("nodes/sample-node-1").is_some());
        assert!(target("widgets").is_none());
        assert_eq!(
            target("namespaces/x/status").and_then(|t| t.subresource),
            Some("status".into())
        );
    }

    #[test]
    fn continue_tokens_round_trip_and_reject_garbage() -> Result<()> {
        let token = encode_continue(42, &("default".into(), "cm-9".into()));
        assert_eq!(
            decode_continue(&token)?,
            (42, ("default".to_string(), "cm-9".to_string()))
        );
        assert_eq!(decode_continue("!!!").map_err(|e| e.code), Err(400));
        Ok(())
    }

    #[test]
    fn accept_header_picks_the_output() -> Result<()> {
        let q = Query(Vec::new());
        let mut h = http::HeaderMap::new();
        assert_eq!(output(&h, &q)?, Output::Json);
        h.insert(header::ACCEPT, HeaderValue::from_static("application/json;as=Table;v=v1;g=meta.k8s.io,application/json;as=Table;v=v1beta1;g=meta.k8s.io,application/json"));
        assert_eq!(output(&h, &q)?, Output::Table(IncludeObject::Metadata));
        h.insert(
            header::ACCEPT,
            HeaderValue::from_static("application/vnd.kubernetes.protobuf, */*"),
        );
        assert_eq!(output(&h, &q)?, Output::Json);
        h.insert(
            header::ACCEPT,
            HeaderValue::from_static("application/vnd.kubernetes.protobuf"),
        );
        assert_eq!(output(&h, &q).map_err(|e| e.code), Err(406));
        Ok(())
    }
}
