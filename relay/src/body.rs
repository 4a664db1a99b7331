//! The response body type every handler returns.

use bytes::Bytes;
use http_body_util::combinators::BoxBody;
use http_body_util::{BodyExt, Empty, Full};

/// Errors from a streamed body (the tunnel broke, the client went away, ...).
pub(crate) type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// A boxed, streamable body: small JSON answers and forwarded apiserver responses alike.
pub(crate) type Body = BoxBody<Bytes, BoxError>;

/// A body holding `data` in one piece.
pub(crate) fn full(data: impl Into<Bytes>) -> Body {
    Full::new(data.into())
        .map_err(|never| match never {})
        .boxed()
}

/// An empty body.
pub(crate) fn empty() -> Body {
    Empty::<Bytes>::new()
        .map_err(|never| match never {})
        .boxed()
}
