//! Small HTTP helpers shared by the handlers: reading bounded bodies and writing plain or JSON answers.

use http::{Response, StatusCode};
use http_body_util::{BodyExt, Limited};
use hyper::body::Incoming;
use serde::Serialize;
use serde::de::DeserializeOwned;

use crate::api_error::ApiError;
use crate::body::{self, Body};

/// A `text/plain` answer.
pub(crate) fn text(status: StatusCode, s: &'static str) -> Response<Body> {
    let mut resp = Response::new(body::full(s));
    *resp.status_mut() = status;
    resp.headers_mut().insert(
        http::header::CONTENT_TYPE,
        http::HeaderValue::from_static("text/plain; charset=utf-8"),
    );
    resp
}

/// An `application/json` answer.
pub(crate) fn json(status: StatusCode, value: &impl Serialize) -> Response<Body> {
    let text = serde_json::to_string(value).unwrap_or_else(|_| "null".to_owned());
    let mut resp = Response::new(body::full(text));
    *resp.status_mut() = status;
    resp.headers_mut().insert(
        http::header::CONTENT_TYPE,
        http::HeaderValue::from_static("application/json"),
    );
    resp
}

/// `204 No Content`.
pub(crate) fn no_content() -> Response<Body> {
    let mut resp = Response::new(body::empty());
    *resp.status_mut() = StatusCode::NO_CONTENT;
    resp
}

/// Reads a body of at most `limit` bytes.
pub(crate) async fn read_body(body: Incoming, limit: usize) -> Result<bytes::Bytes, ApiError> {
    let bytes = Limited::new(body, limit).collect().await.map_err(|e| {
        if e.is::<http_body_util::LengthLimitError>() {
            ApiError::too_large(limit)
        } else {
            ApiError::bad_request(format!("cannot read the request body: {e}"))
        }
    })?;
    Ok(bytes.to_bytes())
}

/// Reads a JSON body of at most `limit` bytes.
pub(crate) async fn read_json<T: DeserializeOwned>(
    body: Incoming,
    limit: usize,
) -> Result<T, ApiError> {
    let bytes = read_body(body, limit).await?;
    serde_json::from_slice(&bytes)
        .map_err(|e| ApiError::bad_request(format!("invalid JSON body: {e}")))
}
