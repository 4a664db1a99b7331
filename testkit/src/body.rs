//! The response body type: a whole buffer, or a stream of chunks fed by a task through a channel (watches, logs).
//! When the client goes away hyper drops the body, the channel closes, and the feeding task sees it and stops.

use std::convert::Infallible;
use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::Bytes;
use http_body::{Frame, SizeHint};
use tokio::sync::mpsc;

/// A response body.
#[derive(Debug)]
pub(crate) enum Body {
    /// The whole body (None once sent).
    Full(Option<Bytes>),
    /// Chunks as they are produced; the end of the channel is the end of the body.
    Stream(mpsc::Receiver<Bytes>),
}

impl Body {
    pub(crate) fn full(bytes: impl Into<Bytes>) -> Body {
        Body::Full(Some(bytes.into()))
    }

    pub(crate) fn empty() -> Body {
        Body::Full(None)
    }

    /// A streaming body and the sender that feeds it.
    pub(crate) fn channel() -> (mpsc::Sender<Bytes>, Body) {
        // A few chunks of slack: a client that stops reading stalls its producer instead of growing a buffer.
        let (tx, rx) = mpsc::channel(16);
        (tx, Body::Stream(rx))
    }
}

impl http_body::Body for Body {
    type Data = Bytes;
    type Error = Infallible;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Infallible>>> {
        match self.get_mut() {
            Body::Full(bytes) => Poll::Ready(bytes.take().map(|b| Ok(Frame::data(b)))),
            Body::Stream(rx) => rx
                .poll_recv(cx)
                .map(|chunk| chunk.map(|b| Ok(Frame::data(b)))),
        }
    }

    fn is_end_stream(&self) -> bool {
        matches!(self, Body::Full(None))
    }

    fn size_hint(&self) -> SizeHint {
        match self {
            Body::Full(Some(b)) => SizeHint::with_exact(b.len() as u64),
            Body::Full(None) => SizeHint::with_exact(0),
            Body::Stream(_) => SizeHint::default(),
        }
    }
}
