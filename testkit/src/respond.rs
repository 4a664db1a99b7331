//! Building responses: JSON bodies, and the one place an [`ApiError`] becomes an HTTP `Status` response.

use http::{HeaderValue, Response, StatusCode, header};
use serde_json::Value;

use crate::body::Body;
use crate::status::ApiError;

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

pub(crate) fn text_response(text: &'static str) -> Response<Body> {
    let mut response = Response::new(Body::full(text));
    response.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("text/plain; charset=utf-8"),
    );
    response
}
