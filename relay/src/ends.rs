//! How a long-running response ends when its path breaks (agent gone, tunnel lost, stream reset): the way
//! kube-apiserver ends a watch that fails, with a final `{"type":"ERROR","object":<Status>}` event naming the
//! cluster and the cause, then a clean end of the body — instead of a transport error that clients print as
//! noise (`unable to decode an event from the watch stream: stream error …`).
//!
//! Only JSON watches get the event: a protobuf watch (`application/vnd.kubernetes.protobuf;stream=watch`)
//! frames its events in binary and just ends.

use std::pin::Pin;
use std::task::{Context, Poll, ready};

use bytes::Bytes;
use http::header::{self, HeaderMap};
use http_body::{Body, Frame, SizeHint};
use serde_json::json;

use crate::body::BoxError;

/// Whether a request is a watch: `?watch=1|true` or a `/watch/` path (the legacy watch endpoints).
///
/// Asked of every successful response, so it reads bytes: the separators are ASCII, which UTF-8 never uses
/// inside a longer character, and `str`'s character searchers cost the relay ~1,900 instructions per GET here
/// (docs/BENCHMARKS.md, twentieth pass).
pub(crate) fn is_watch_request(path_and_query: &str) -> bool {
    let (path, query) = split_at_byte(path_and_query.as_bytes(), b'?');
    let watch_param = query.split(|&b| b == b'&').any(|kv| {
        let (k, v) = split_at_byte(kv, b'=');
        k == b"watch" && (v == b"1" || v.eq_ignore_ascii_case(b"true"))
    });
    let mut segments = path.split(|&b| b == b'/').filter(|s| !s.is_empty());
    let watch_path = match segments.next() {
        // /api/v1/watch/…, /apis/GROUP/VERSION/watch/…
        Some(b"api") => segments.nth(1) == Some(b"watch"),
        Some(b"apis") => segments.nth(2) == Some(b"watch"),
        _ => false,
    };
    watch_param || watch_path
}

/// `bytes` before and after the first `sep` (all of it and nothing without one).
fn split_at_byte(bytes: &[u8], sep: u8) -> (&[u8], &[u8]) {
    match bytes.iter().position(|&b| b == sep) {
        Some(i) => (&bytes[..i], &bytes[i + 1..]),
        None => (bytes, &[]),
    }
}

/// Whether a response is a JSON event stream (what kubectl, client-go and kube-rs ask for by default).
pub(crate) fn is_json(headers: &HeaderMap) -> bool {
    headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.trim_start().starts_with("application/json"))
}

/// The final event of a watch whose path broke: a `Status` 503 (the watch may be retried; informers
/// relist or resume) naming the cluster and the cause.
pub(crate) fn error_event(cluster: &str, cause: &str, at_line_start: bool) -> Bytes {
    let status = json!({
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Failure",
        "message": format!("the watch through the relay to cluster {cluster} ended: {cause}"),
        "reason": "ServiceUnavailable",
        "code": 503,
    });
    let event = json!({"type": "ERROR", "object": status});
    // Starts on a line of its own (the event stream is newline-delimited JSON), without an empty line before
    // it when the last event was whole: strict line readers take an empty line for a broken event.
    if at_line_start {
        Bytes::from(format!("{event}\n"))
    } else {
        Bytes::from(format!("\n{event}\n"))
    }
}

/// A watch's response body that turns a failure of the path into [`error_event`] and a clean end.
pub(crate) struct WatchBody<B> {
    inner: B,
    cluster: String,
    /// Describes a failure of the inner body in the user's terms.
    explain: fn(&str, &BoxError) -> String,
    done: bool,
    /// The last byte passed on was a newline (or none was): the next event starts a line.
    at_line_start: bool,
    /// Resolves when the watch is to end cleanly at its next event boundary ([`WatchBody::ending_with`]).
    end: Option<Pin<Box<tokio_util::sync::WaitForCancellationFutureOwned>>>,
    /// `end` resolved.
    ending: bool,
}

impl<B> WatchBody<B> {
    /// Wraps `inner`, the body of a JSON watch on `cluster`.
    pub(crate) fn new(inner: B, cluster: &str, explain: fn(&str, &BoxError) -> String) -> Self {
        Self {
            inner,
            cluster: cluster.to_owned(),
            explain,
            done: false,
            at_line_start: true,
            end: None,
            ending: false,
        }
    }

    /// Ends the watch cleanly (the body just ends, at an event boundary) once `end` is cancelled.
    pub(crate) fn ending_with(mut self, end: Option<&tokio_util::sync::CancellationToken>) -> Self {
        self.end = end.map(|t| Box::pin(t.clone().cancelled_owned()));
        self
    }
}

impl<B> Body for WatchBody<B>
where
    B: Body<Data = Bytes> + Unpin,
    B::Error: Into<BoxError>,
{
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        if self.done {
            return Poll::Ready(None);
        }
        if !self.ending
            && let Some(end) = self.end.as_mut()
            && end.as_mut().poll(cx).is_ready()
        {
            self.ending = true;
        }
        let polled = Pin::new(&mut self.inner).poll_frame(cx);
        if self.ending && self.at_line_start && !matches!(polled, Poll::Ready(Some(_))) {
            // Nothing more in hand (a failure, which a tunnel that broke rather than went away gracefully
            // has already shown, is reported below instead): end cleanly at this event boundary.
            self.done = true;
            tracing::debug!(cluster = %self.cluster, "watch ended cleanly: this replica stops serving");
            return Poll::Ready(None);
        }
        match ready!(polled) {
            Some(Ok(frame)) => {
                if let Some(&last) = frame.data_ref().and_then(|d| d.last()) {
                    self.at_line_start = last == b'\n';
                }
                Poll::Ready(Some(Ok(frame)))
            }
            Some(Err(e)) => {
                self.done = true;
                let e: BoxError = e.into();
                let cause = (self.explain)(&self.cluster, &e);
                tracing::info!(cluster = %self.cluster, %cause, "watch ended by a broken path; sent an ERROR event");
                let event = error_event(&self.cluster, &cause, self.at_line_start);
                Poll::Ready(Some(Ok(Frame::data(event))))
            }
            None => {
                self.done = true;
                Poll::Ready(None)
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        self.done
    }

    fn size_hint(&self) -> SizeHint {
        SizeHint::default()
    }
}

/// What the relay can say on an upgraded WebSocket (exec, attach, port-forward) when the agent's side of the
/// pipe breaks, from the 101's `Upgrade` and negotiated `Sec-WebSocket-Protocol`; `None` for anything else
/// (plain SPDY). Port-forwards over SPDY, plain or tunnelled, are also told on each forwarded connection's
/// error stream ([`crate::spdy`]), before this close.
///
/// - `v4.channel.k8s.io`, `v5.channel.k8s.io` (exec, attach): a binary frame on the error channel (3) holding
///   a `Status`, which kubectl prints, then a close frame;
/// - any other WebSocket subprotocol (port-forward's `portforward.k8s.io`, `SPDY/3.1+portforward.k8s.io`,
///   the base64 variants): a close frame with code 1011 and the cause as its reason (kubectl prints it).
pub(crate) fn websocket_break(headers: &HeaderMap, cluster: &str, cause: &str) -> Option<Vec<u8>> {
    let websocket = headers
        .get(header::UPGRADE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.trim().eq_ignore_ascii_case("websocket"));
    if !websocket {
        return None;
    }
    let protocol = headers
        .get(header::SEC_WEBSOCKET_PROTOCOL)
        .and_then(|v| v.to_str().ok())
        .map(str::trim)
        .unwrap_or_default();
    let message = format!("cluster {cluster}: {cause}");
    let mut out = Vec::new();
    if protocol == "v4.channel.k8s.io" || protocol == "v5.channel.k8s.io" {
        let status = json!({
            "metadata": {},
            "status": "Failure",
            "message": message,
            "reason": "ServiceUnavailable",
            "code": 503,
        });
        let mut payload = vec![3u8];
        payload.extend_from_slice(status.to_string().as_bytes());
        push_frame(&mut out, 0x2, &payload);
    }
    // Close: 1011 (the server hit a condition it cannot go on with), reason at most 123 bytes.
    let mut reason = message.as_str();
    while reason.len() > 123 {
        let mut cut = 123.min(reason.len() - 1);
        while !reason.is_char_boundary(cut) {
            cut -= 1;
        }
        reason = &reason[..cut];
    }
    let mut payload = 1011u16.to_be_bytes().to_vec();
    payload.extend_from_slice(reason.as_bytes());
    push_frame(&mut out, 0x8, &payload);
    Some(out)
}

/// One unmasked (server-to-client) WebSocket frame with FIN set.
pub(crate) fn push_frame(out: &mut Vec<u8>, opcode: u8, payload: &[u8]) {
    out.push(0x80 | opcode);
    match payload.len() {
        n @ 0..=125 => out.push(n as u8),
        n @ 126..=0xffff => {
            out.push(126);
            out.extend_from_slice(&(n as u16).to_be_bytes());
        }
        n => {
            out.push(127);
            out.extend_from_slice(&(n as u64).to_be_bytes());
        }
    }
    out.extend_from_slice(payload);
}

#[cfg(test)]
mod tests {
    use http_body_util::{BodyExt, StreamBody};

    use super::*;

    /// All of a watch body, as text.
    async fn text_of<B>(body: WatchBody<B>) -> anyhow::Result<String>
    where
        B: Body<Data = Bytes> + Unpin,
        B::Error: Into<BoxError>,
    {
        let all = body
            .collect()
            .await
            .map_err(|e| anyhow::anyhow!("{e}"))?
            .to_bytes();
        Ok(String::from_utf8(all.to_vec())?)
    }

    #[test]
    fn watches_are_recognised() {
        for yes in [
            "/api/v1/configmaps?watch=1",
            "/api/v1/namespaces/a/pods?labelSelector=x&watch=true",
            "/apis/apps/v1/deployments?watch=True&resourceVersion=3",
            "/api/v1/watch/namespaces/a/pods",
            "/apis/apps/v1/watch/deployments",
            "/api/v1/namespaces/é/pods?x=%26&watch=TRUE",
            "/api/v1/pods?watch=1&watch=0",
        ] {
            assert!(is_watch_request(yes), "{yes}");
        }
        for no in [
            "/api/v1/configmaps",
            "/api/v1/configmaps?watch=0",
            "/api/v1/configmaps?watch=false",
            "/api/v1/namespaces/watch",
            "/apis/watch/v1/things",
            "/api/v1/namespaces/a/pods/p/log?follow=true",
            "/api/v1/pods?watch",
            "/api/v1/pods?watchx=1&xwatch=1",
            "/api/v1/pods?watch=1?x",
            "/api/v1/pods/watch?x=1",
            "/apis/watch",
            "",
        ] {
            assert!(!is_watch_request(no), "{no}");
        }
    }

    #[test]
    fn exec_over_websocket_gets_a_status_on_channel_3_then_a_close() -> anyhow::Result<()> {
        let mut headers = HeaderMap::new();
        headers.insert(header::UPGRADE, "websocket".parse()?);
        headers.insert(header::SEC_WEBSOCKET_PROTOCOL, "v5.channel.k8s.io".parse()?);
        let bytes = websocket_break(&headers, "prod", "agent gone")
            .ok_or_else(|| anyhow::anyhow!("none"))?;
        assert_eq!(bytes[0], 0x82);
        let len = usize::from(bytes[1]);
        assert!(len < 126);
        assert_eq!(bytes[2], 3, "error channel");
        let status: serde_json::Value = serde_json::from_slice(&bytes[3..2 + len])?;
        assert_eq!(status["status"], "Failure");
        assert_eq!(status["message"], "cluster prod: agent gone");
        let close = &bytes[2 + len..];
        assert_eq!(close[0], 0x88);
        assert_eq!(&close[2..4], &1011u16.to_be_bytes());
        assert_eq!(&close[4..], b"cluster prod: agent gone");

        headers.insert(
            header::SEC_WEBSOCKET_PROTOCOL,
            "SPDY/3.1+portforward.k8s.io".parse()?,
        );
        let long = "x".repeat(300);
        let bytes =
            websocket_break(&headers, "prod", &long).ok_or_else(|| anyhow::anyhow!("none"))?;
        assert_eq!(bytes[0], 0x88, "port-forward: only a close");
        assert_eq!(usize::from(bytes[1]), bytes.len() - 2);
        assert!(bytes.len() - 2 <= 125);

        headers.insert(header::UPGRADE, "SPDY/3.1".parse()?);
        assert!(websocket_break(&headers, "prod", "x").is_none());
        Ok(())
    }

    #[tokio::test]
    async fn a_watch_ends_cleanly_at_an_event_boundary_when_the_replica_stops_serving()
    -> anyhow::Result<()> {
        let (tx, mut rx) = tokio::sync::mpsc::channel::<Result<Frame<Bytes>, BoxError>>(4);
        let inner = StreamBody::new(futures_util::stream::poll_fn(move |cx| rx.poll_recv(cx)));
        let end = tokio_util::sync::CancellationToken::new();
        let mut body = WatchBody::new(inner, "prod", |_, e| e.to_string()).ending_with(Some(&end));
        // Half an event is through when the replica stops serving: the rest of it still goes out, then the
        // body ends.
        tx.send(Ok(Frame::data(Bytes::from_static(b"{\"type\":\"ADDED\","))))
            .await?;
        let first = body
            .frame()
            .await
            .ok_or_else(|| anyhow::anyhow!("no first frame"))?
            .map_err(|e| anyhow::anyhow!("{e}"))?;
        end.cancel();
        tx.send(Ok(Frame::data(Bytes::from_static(b"\"object\":{}}\n"))))
            .await?;
        let rest = tokio::time::timeout(std::time::Duration::from_secs(5), body.collect())
            .await?
            .map_err(|e| anyhow::anyhow!("{e}"))?
            .to_bytes();
        let mut all = first
            .into_data()
            .map_err(|_| anyhow::anyhow!("not data"))?
            .to_vec();
        all.extend_from_slice(&rest);
        assert_eq!(&all[..], b"{\"type\":\"ADDED\",\"object\":{}}\n");
        // The inner body is still open (the sender lives): the end came from the token, with no ERROR event.
        drop(tx);
        Ok(())
    }

    #[tokio::test]
    async fn a_broken_watch_ends_with_an_error_event_naming_cluster_and_cause() -> anyhow::Result<()>
    {
        let chunks: Vec<Result<Frame<Bytes>, BoxError>> = vec![
            Ok(Frame::data(Bytes::from_static(
                b"{\"type\":\"ADDED\",\"object\":{}}\n",
            ))),
            Err("tunnel closed".into()),
            Ok(Frame::data(Bytes::from_static(b"never seen"))),
        ];
        let inner = StreamBody::new(futures_util::stream::iter(chunks));
        let body = WatchBody::new(inner, "prod", |cluster, e| {
            format!("agent of {cluster} gone ({e})")
        });
        let text = text_of(body).await?;
        // Every line is an event: no empty line before the ERROR event after a whole one.
        let events: Vec<serde_json::Value> = text
            .lines()
            .map(serde_json::from_str)
            .collect::<Result<_, _>>()?;
        assert_eq!(events.len(), 2, "{text}");
        assert_eq!(events[0]["type"], "ADDED");
        assert_eq!(events[1]["type"], "ERROR");
        let status = &events[1]["object"];
        assert_eq!(status["kind"], "Status");
        assert_eq!(status["code"], 503);
        let message = status["message"].as_str().unwrap_or_default();
        assert!(message.contains("cluster prod"), "{message}");
        assert!(
            message.contains("agent of prod gone (tunnel closed)"),
            "{message}"
        );
        Ok(())
    }

    #[tokio::test]
    async fn a_tunnel_that_broke_and_went_away_at_once_still_gets_its_error_event()
    -> anyhow::Result<()> {
        // The tunnel's `gone` token and the stream's failure arrive together (an agent killed): the failure
        // is what the user is told, not a clean end.
        let chunks: Vec<Result<Frame<Bytes>, BoxError>> = vec![Err("tunnel lost".into())];
        let inner = StreamBody::new(futures_util::stream::iter(chunks));
        let end = tokio_util::sync::CancellationToken::new();
        end.cancel();
        let body = WatchBody::new(inner, "prod", |_, e| e.to_string()).ending_with(Some(&end));
        let text = text_of(body).await?;
        assert!(text.contains("\"type\":\"ERROR\""), "{text}");
        assert!(text.contains("tunnel lost"), "{text}");
        Ok(())
    }
}
