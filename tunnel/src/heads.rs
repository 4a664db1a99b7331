//! HTTP exchanges on streams of kind [`crate::kind::HTTP_HEADS`]: the binary head blocks of
//! [`tether_proto::head`] in `http` types, reading a block off a stream, a stream shared between a body reader
//! and a writer, and a response or request body read from a stream.
//!
//! The relay opens such streams (request head, request body, finish; then reads the response head and body)
//! and the agent serves them; both validate what they decode as an HTTP/1.1 parser would: a method and target
//! that `http` accepts, header names and values that are legal, a status in 100..=999.

use std::io;
use std::pin::Pin;
use std::sync::{Arc, Mutex, PoisonError};
use std::task::{Context, Poll};

use bytes::{Bytes, BytesMut};
use http::header::{HeaderMap, HeaderName, HeaderValue};
use http::{Method, StatusCode};
use tether_proto::head::{self, BODY, HeadError, LENGTH_PREFIX};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, ReadBuf};

/// Why a head could not be read or made sense of.
#[derive(Debug, thiserror::Error)]
pub enum BadHead {
    /// The stream failed while the head was read (the tunnel's error is inside).
    #[error("{0}")]
    Io(#[from] io::Error),
    /// The stream ended part-way through the head.
    #[error("the stream ended in the middle of the head")]
    Truncated,
    /// The head's length prefix announces more than the reader accepts.
    #[error("head of {0} bytes is larger than the {1} bytes allowed")]
    TooLarge(usize, usize),
    /// The block does not decode.
    #[error("malformed head: {0}")]
    Malformed(#[from] HeadError),
    /// A part decoded but is not valid HTTP.
    #[error("invalid {0} in head")]
    Invalid(&'static str),
}

/// A request as carried on the stream.
#[derive(Debug)]
pub struct RequestHead {
    /// The method.
    pub method: Method,
    /// Path and query (origin form), validated as a URI.
    pub target: http::Uri,
    /// Header fields.
    pub headers: HeaderMap,
    /// Whether body bytes follow the head.
    pub body: bool,
}

/// A response as carried on the stream.
#[derive(Debug)]
pub struct ResponseHead {
    /// The status.
    pub status: StatusCode,
    /// Header fields.
    pub headers: HeaderMap,
    /// Whether body bytes follow the head.
    pub body: bool,
}

fn fields(headers: &HeaderMap) -> impl Iterator<Item = (&[u8], &[u8])> {
    headers
        .iter()
        .map(|(n, v)| (n.as_str().as_bytes(), v.as_bytes()))
}

fn flags(body: bool) -> u8 {
    if body { BODY } else { 0 }
}

/// The request head block (length prefix included) for `method target` with `headers`.
pub fn encode_request(
    method: &Method,
    target: &str,
    headers: &HeaderMap,
    body: bool,
) -> Result<Bytes, HeadError> {
    encode_request_fields(method, target, || fields(headers), body)
}

/// The request head block (length prefix included) for `method target` with the header fields (name, value)
/// that `fields` walks, for a caller that drops or adds fields as it encodes rather than editing a copy of its
/// headers. `fields` is called twice: once to size the block.
pub fn encode_request_fields<'a, I>(
    method: &Method,
    target: &str,
    fields: impl Fn() -> I,
    body: bool,
) -> Result<Bytes, HeadError>
where
    I: Iterator<Item = (&'a [u8], &'a [u8])>,
{
    head::encode_request(
        flags(body),
        method.as_str().as_bytes(),
        target.as_bytes(),
        fields(),
        head::fields_len(fields()),
    )
}

/// The response head block (length prefix included).
pub fn encode_response(
    status: StatusCode,
    headers: &HeaderMap,
    body: bool,
) -> Result<Bytes, HeadError> {
    head::encode_response(
        flags(body),
        status.as_u16(),
        fields(headers),
        head::fields_len(fields(headers)),
    )
}

fn header_map(fields: Vec<(Bytes, Bytes)>) -> Result<HeaderMap, BadHead> {
    let mut headers = HeaderMap::with_capacity(fields.len());
    for (name, value) in fields {
        let name = HeaderName::from_bytes(&name).map_err(|_| BadHead::Invalid("header name"))?;
        let value =
            HeaderValue::from_maybe_shared(value).map_err(|_| BadHead::Invalid("header value"))?;
        headers.append(name, value);
    }
    Ok(headers)
}

/// Decodes and validates a request head block.
pub fn decode_request(block: Bytes) -> Result<RequestHead, BadHead> {
    let h = head::decode_request(block)?;
    let method = Method::from_bytes(&h.method).map_err(|_| BadHead::Invalid("method"))?;
    if !h.target.starts_with(b"/") {
        return Err(BadHead::Invalid("target (not a path)"));
    }
    let target = http::Uri::from_maybe_shared(h.target).map_err(|_| BadHead::Invalid("target"))?;
    Ok(RequestHead {
        method,
        target,
        headers: header_map(h.fields)?,
        body: h.flags & BODY != 0,
    })
}

/// Decodes and validates a response head block.
pub fn decode_response(block: Bytes) -> Result<ResponseHead, BadHead> {
    let h = head::decode_response(block)?;
    let status = StatusCode::from_u16(h.status).map_err(|_| BadHead::Invalid("status"))?;
    Ok(ResponseHead {
        status,
        headers: header_map(h.fields)?,
        body: h.flags & BODY != 0,
    })
}

/// Reads one length-prefixed head block, at most `max` bytes long. `Ok(None)`: the stream ended cleanly
/// before its first byte. Reads exactly the block: the bytes after it stay in the stream.
pub async fn read_block<R: AsyncRead + Unpin>(
    r: &mut R,
    max: usize,
) -> Result<Option<Bytes>, BadHead> {
    let mut prefix = [0u8; LENGTH_PREFIX];
    let mut got = 0;
    while got < LENGTH_PREFIX {
        match r.read(&mut prefix[got..]).await? {
            0 if got == 0 => return Ok(None),
            0 => return Err(BadHead::Truncated),
            n => got += n,
        }
    }
    let len = head::block_length(prefix);
    if len > max {
        return Err(BadHead::TooLarge(len, max));
    }
    let mut block = vec![0u8; len];
    match r.read_exact(&mut block).await {
        Ok(_) => Ok(Some(Bytes::from(block))),
        Err(e) if e.kind() == io::ErrorKind::UnexpectedEof => Err(BadHead::Truncated),
        Err(e) => Err(e.into()),
    }
}

/// A reader that can hand out what it holds as `Bytes` without copying it (a WebSocket tunnel's stream: the
/// received frames' payloads are slices of the tunnel's messages). [`BodyReader`] takes a body this way when it
/// can, and reads it into buffers of its own otherwise.
pub trait ReadChunk: AsyncRead + Unpin {
    /// Takes up to `max` bytes (`max` > 0) as they are held; an empty chunk at the end of the stream. `None`:
    /// this reader cannot, read it with [`AsyncRead::poll_read`].
    fn poll_chunk(&mut self, cx: &mut Context<'_>, max: usize) -> Option<Poll<io::Result<Bytes>>> {
        let _ = (cx, max);
        None
    }
}

impl ReadChunk for Box<dyn ReadChunk + Send> {
    fn poll_chunk(&mut self, cx: &mut Context<'_>, max: usize) -> Option<Poll<io::Result<Bytes>>> {
        (**self).poll_chunk(cx, max)
    }
}

/// An in-memory pipe (tests) hands out no chunks of its own: bodies read from it are copied.
impl ReadChunk for tokio::io::DuplexStream {}

impl<IO: ReadChunk> ReadChunk for SharedStream<IO> {
    fn poll_chunk(&mut self, cx: &mut Context<'_>, max: usize) -> Option<Poll<io::Result<Bytes>>> {
        self.with(|io| io.poll_chunk(cx, max))
    }
}

/// A writer that can take `Bytes` as they are instead of copying them (a QUIC stream: quinn queues the
/// chunks themselves; a WebSocket tunnel's session copies into the stream's send buffer either way).
/// [`write_all_chunks`] hands its chunks to a writer that keeps them, and writes them into any other with
/// `write_all`.
pub trait WriteChunk: AsyncWrite + Unpin {
    /// Whether [`WriteChunk::poll_write_chunks`] keeps the chunks themselves rather than copying them.
    fn takes_chunks(&self) -> bool {
        false
    }

    /// Takes what it can from the front of `chunks`: a chunk taken whole is left empty, one taken in part keeps
    /// what is left. Yields the bytes taken, more than 0 when a chunk is not empty. By default the first chunk
    /// that is not empty is written with [`AsyncWrite::poll_write`] (copied).
    fn poll_write_chunks(
        &mut self,
        cx: &mut Context<'_>,
        chunks: &mut [Bytes],
    ) -> Poll<io::Result<usize>> {
        poll_write_first(self, cx, chunks)
    }
}

/// Writes the first chunk of `chunks` that is not empty with [`AsyncWrite::poll_write`] (a copy) and advances
/// it past what was written; 0 when all are empty.
pub(crate) fn poll_write_first<W: AsyncWrite + Unpin + ?Sized>(
    writer: &mut W,
    cx: &mut Context<'_>,
    chunks: &mut [Bytes],
) -> Poll<io::Result<usize>> {
    use bytes::Buf as _;
    let Some(chunk) = chunks.iter_mut().find(|c| !c.is_empty()) else {
        return Poll::Ready(Ok(0));
    };
    let n = std::task::ready!(Pin::new(writer).poll_write(cx, chunk))?;
    chunk.advance(n.min(chunk.len()));
    Poll::Ready(Ok(n))
}

/// An in-memory pipe (tests) takes no chunks: what is written to it is copied.
impl WriteChunk for tokio::io::DuplexStream {}

impl<IO: WriteChunk> WriteChunk for SharedStream<IO> {
    fn takes_chunks(&self) -> bool {
        self.with(|io| io.takes_chunks())
    }

    fn poll_write_chunks(
        &mut self,
        cx: &mut Context<'_>,
        chunks: &mut [Bytes],
    ) -> Poll<io::Result<usize>> {
        self.with(|io| io.poll_write_chunks(cx, chunks))
    }
}

/// Chunks smaller than this are copied before a writer keeps them: a small slice can pin a much larger buffer
/// (an HTTP/2 connection's read buffer) for as long as the stream's send window holds it.
const MIN_KEPT_CHUNK: usize = 4 * 1024;

/// Writes all of `chunks` in order and leaves the vector empty: kept as they are by a writer that
/// [takes chunks](WriteChunk::takes_chunks) (those under 4 KiB copied first, so a small slice cannot pin a much
/// larger buffer), copied otherwise.
pub async fn write_all_chunks<W: WriteChunk>(
    writer: &mut W,
    chunks: &mut Vec<Bytes>,
) -> io::Result<()> {
    if !writer.takes_chunks() {
        for chunk in chunks.drain(..) {
            tokio::io::AsyncWriteExt::write_all(writer, &chunk).await?;
        }
        return Ok(());
    }
    for chunk in chunks.iter_mut().filter(|c| c.len() < MIN_KEPT_CHUNK) {
        *chunk = Bytes::copy_from_slice(chunk);
    }
    let mut next = 0;
    while next < chunks.len() {
        if chunks[next].is_empty() {
            next += 1;
            continue;
        }
        let taken =
            std::future::poll_fn(|cx| writer.poll_write_chunks(cx, &mut chunks[next..])).await?;
        if taken == 0 {
            return Err(io::ErrorKind::WriteZero.into());
        }
    }
    chunks.clear();
    Ok(())
}

/// One stream shared by several users in turn or at once (a request body being read while the response is
/// written): each poll locks it briefly. The stream is dropped with the last clone.
pub struct SharedStream<IO>(Arc<Mutex<IO>>);

impl<IO> Clone for SharedStream<IO> {
    fn clone(&self) -> Self {
        Self(self.0.clone())
    }
}

impl<IO> SharedStream<IO> {
    /// Shares `io`.
    pub fn new(io: IO) -> Self {
        Self(Arc::new(Mutex::new(io)))
    }

    fn with<R>(&self, f: impl FnOnce(&mut IO) -> R) -> R {
        f(&mut self.0.lock().unwrap_or_else(PoisonError::into_inner))
    }
}

impl<IO: AsyncRead + Unpin> AsyncRead for SharedStream<IO> {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        self.with(|io| Pin::new(io).poll_read(cx, buf))
    }
}

impl<IO: AsyncWrite + Unpin> AsyncWrite for SharedStream<IO> {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        self.with(|io| Pin::new(io).poll_write(cx, buf))
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        self.with(|io| Pin::new(io).poll_flush(cx))
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        self.with(|io| Pin::new(io).poll_shutdown(cx))
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        self.with(|io| Pin::new(io).poll_write_vectored(cx, bufs))
    }

    fn is_write_vectored(&self) -> bool {
        self.with(|io| io.is_write_vectored())
    }
}

/// The smallest and largest read a [`BodyReader`] asks for.
const MIN_READ: usize = 4 * 1024;
const MAX_READ: usize = 64 * 1024;

/// A body read from a stream until its end, as an [`http_body::Body`] of `Bytes` chunks. Starts with small
/// reads and doubles them while they come back full (a watch's events stay in small buffers, a bulk
/// transfer gets large ones). A stream error ends the body with that error (the tunnel's error inside).
///
/// With a known length ([`BodyReader::with_length`], from `Content-Length`) the body ends after that many
/// bytes without waiting for the end of the stream (HTTP servers stop polling a body whose length is reached),
/// reports its exact size, and fails if the stream ends short of it or carries more.
pub struct BodyReader<R> {
    reader: R,
    buf: BytesMut,
    read_size: usize,
    done: bool,
    remaining: Option<u64>,
}

impl<R> BodyReader<R> {
    /// A body of what `reader` yields until EOF. With `empty`, the body is empty at once and `reader` is
    /// not read.
    pub fn new(reader: R, empty: bool) -> Self {
        Self {
            reader,
            buf: BytesMut::new(),
            read_size: MIN_READ,
            done: empty,
            remaining: None,
        }
    }

    /// The body is `length` bytes long (`None`: until the end of the stream).
    pub fn with_length(mut self, length: Option<u64>) -> Self {
        if !self.done {
            self.remaining = length;
            if length == Some(0) {
                self.done = true;
            }
        }
        self
    }

    /// The reader back.
    pub fn into_inner(self) -> R {
        self.reader
    }
}

impl<R: ReadChunk> BodyReader<R> {
    /// Once the announced length is read: takes the end of the stream too if it is already there, so the
    /// stream is finished cleanly rather than reset when the body is dropped. Anything else (more bytes, or
    /// nothing yet) is left alone.
    fn take_end(&mut self, cx: &mut Context<'_>) {
        if self.reader.poll_chunk(cx, 1).is_some() {
            return;
        }
        let mut one = [0u8; 1];
        let mut probe = ReadBuf::new(&mut one);
        let _ = Pin::new(&mut self.reader).poll_read(cx, &mut probe);
    }

    /// What the body does with `n` more bytes read: counts them against the announced length, and ends the
    /// body once it is reached.
    fn took(&mut self, cx: &mut Context<'_>, n: usize) {
        if let Some(r) = &mut self.remaining {
            *r = r.saturating_sub(n as u64);
            if *r == 0 {
                self.done = true;
                self.take_end(cx);
            }
        }
    }

    /// The end of the stream: the end of the body, or an error when it ends short of its announced length.
    fn ended(&mut self) -> Poll<Option<Result<http_body::Frame<Bytes>, io::Error>>> {
        self.done = true;
        match self.remaining {
            Some(r) if r > 0 => Poll::Ready(Some(Err(io::Error::new(
                io::ErrorKind::UnexpectedEof,
                format!("the body ended {r} bytes short of its Content-Length"),
            )))),
            _ => Poll::Ready(None),
        }
    }
}

impl<R: ReadChunk> http_body::Body for BodyReader<R> {
    type Data = Bytes;
    type Error = io::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<http_body::Frame<Bytes>, io::Error>>> {
        use bytes::BufMut as _;
        let this = self.get_mut();
        if this.done {
            return Poll::Ready(None);
        }
        // What is left of the last buffer may be a sliver: a read into it would take only part of the
        // stream's next chunk (more reads and smaller frames for the same bytes). A body of known length
        // takes no more than it has left: a small response is one small allocation (glibc serves those
        // from its caches; every allocation of 1 KiB and more first sweeps the freed small chunks).
        let limit = this
            .remaining
            .map_or(usize::MAX, |r| usize::try_from(r).unwrap_or(usize::MAX));
        // The stream's own chunks when it hands them out: no copy, no buffer of ours.
        if let Some(chunk) = this.reader.poll_chunk(cx, limit) {
            return match chunk {
                Poll::Pending => Poll::Pending,
                Poll::Ready(Err(e)) => {
                    this.done = true;
                    Poll::Ready(Some(Err(e)))
                }
                Poll::Ready(Ok(data)) if data.is_empty() => this.ended(),
                Poll::Ready(Ok(data)) => {
                    this.took(cx, data.len());
                    Poll::Ready(Some(Ok(http_body::Frame::data(data))))
                }
            };
        }
        let wanted = limit.min(this.read_size);
        if this.buf.capacity() < wanted {
            this.buf.reserve(wanted);
        }
        let asked = this.buf.capacity();
        let read = tokio_util::io::poll_read_buf(
            Pin::new(&mut this.reader),
            cx,
            &mut (&mut this.buf).limit(limit),
        );
        match read {
            Poll::Pending => Poll::Pending,
            Poll::Ready(Err(e)) => {
                this.done = true;
                Poll::Ready(Some(Err(e)))
            }
            Poll::Ready(Ok(0)) => this.ended(),
            Poll::Ready(Ok(n)) => {
                if n == asked {
                    this.read_size = (this.read_size * 2).min(MAX_READ);
                }
                this.took(cx, n);
                Poll::Ready(Some(Ok(http_body::Frame::data(this.buf.split().freeze()))))
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        self.done
    }

    fn size_hint(&self) -> http_body::SizeHint {
        match self.remaining {
            Some(r) if !self.done => http_body::SizeHint::with_exact(r),
            _ if self.done => http_body::SizeHint::with_exact(0),
            _ => http_body::SizeHint::default(),
        }
    }
}

/// The `Content-Length` of `headers`, when there is exactly one valid one.
pub fn content_length(headers: &HeaderMap) -> Option<u64> {
    let mut values = headers.get_all(http::header::CONTENT_LENGTH).iter();
    let value = values.next()?;
    if values.next().is_some() {
        return None;
    }
    value.to_str().ok()?.trim().parse().ok()
}

#[cfg(test)]
mod tests {
    use http_body_util::BodyExt as _;
    use tokio::io::AsyncWriteExt as _;

    use super::*;

    /// A writer that keeps the chunks it takes, at most `per_call` bytes a call.
    struct Keeper {
        kept: Vec<Bytes>,
        per_call: usize,
    }

    impl AsyncWrite for Keeper {
        fn poll_write(
            self: Pin<&mut Self>,
            _: &mut Context<'_>,
            _: &[u8],
        ) -> Poll<io::Result<usize>> {
            Poll::Ready(Err(io::Error::other("a keeper takes chunks, never slices")))
        }

        fn poll_flush(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<io::Result<()>> {
            Poll::Ready(Ok(()))
        }

        fn poll_shutdown(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<io::Result<()>> {
            Poll::Ready(Ok(()))
        }
    }

    impl WriteChunk for Keeper {
        fn takes_chunks(&self) -> bool {
            true
        }

        fn poll_write_chunks(
            &mut self,
            _: &mut Context<'_>,
            chunks: &mut [Bytes],
        ) -> Poll<io::Result<usize>> {
            let mut taken = 0;
            for chunk in chunks.iter_mut().filter(|c| !c.is_empty()) {
                let n = chunk.len().min(self.per_call - taken);
                self.kept.push(chunk.split_to(n));
                taken += n;
                if taken == self.per_call {
                    break;
                }
            }
            Poll::Ready(Ok(taken))
        }
    }

    #[tokio::test]
    async fn chunks_are_kept_as_they_are_or_copied_in_order() -> anyhow::Result<()> {
        let large = Bytes::from(vec![7u8; 3 * MIN_KEPT_CHUNK]);
        let small = Bytes::from_static(b"a small chunk");
        let mut chunks = vec![small.clone(), Bytes::new(), large.clone()];

        // A writer that keeps chunks, taking them in parts: the large one is kept (the same memory), the small
        // one copied, and nothing is lost or reordered.
        let mut keeper = Keeper {
            kept: Vec::new(),
            per_call: MIN_KEPT_CHUNK + 5,
        };
        write_all_chunks(&mut keeper, &mut chunks.clone()).await?;
        let kept: Vec<u8> = keeper.kept.iter().flatten().copied().collect();
        assert_eq!(kept, [&small[..], &large[..]].concat());
        assert_ne!(
            keeper.kept[0].as_ptr(),
            small.as_ptr(),
            "a small chunk is copied"
        );
        let large_parts: Vec<&Bytes> = keeper.kept.iter().filter(|c| c[0] == 7).collect();
        assert_eq!(
            large_parts[0].as_ptr(),
            large.as_ptr(),
            "a large chunk is kept"
        );

        // A writer that copies gets the same bytes through `poll_write`.
        let (mut a, mut b) = tokio::io::duplex(1024);
        let expected = [&small[..], &large[..]].concat();
        let reader = tokio::spawn(async move {
            let mut got = Vec::new();
            b.read_to_end(&mut got).await.map(|_| got)
        });
        write_all_chunks(&mut a, &mut chunks).await?;
        assert!(chunks.is_empty());
        drop(a);
        assert_eq!(reader.await??, expected);
        Ok(())
    }

    #[tokio::test]
    async fn a_block_is_read_exactly_and_the_rest_stays_in_the_stream() -> anyhow::Result<()> {
        let mut headers = HeaderMap::new();
        headers.insert("accept", HeaderValue::from_static("application/json"));
        let block = encode_request(&Method::GET, "/api?x=1", &headers, true)?;
        let (mut a, mut b) = tokio::io::duplex(1024);
        a.write_all(&block).await?;
        a.write_all(b"body").await?;
        a.shutdown().await?;
        let got = read_block(&mut b, 1024).await?.expect("a head");
        let head = decode_request(got)?;
        assert_eq!(
            (head.method, head.target.to_string()),
            (Method::GET, "/api?x=1".into())
        );
        assert_eq!(head.headers["accept"], "application/json");
        assert!(head.body);
        let body = BodyReader::new(b, false).collect().await?.to_bytes();
        assert_eq!(&body[..], b"body");
        Ok(())
    }

    #[tokio::test]
    async fn an_empty_stream_has_no_head_and_a_cut_or_oversized_one_is_refused()
    -> anyhow::Result<()> {
        let (a, mut b) = tokio::io::duplex(64);
        drop(a);
        assert!(read_block(&mut b, 1024).await?.is_none());
        for (bytes, max) in [
            (&b"\0\0"[..], 1024),
            (&b"\0\0\0\x09abc"[..], 1024),
            (&b"\0\0\x04\x01"[..], 1024),
        ] {
            let (mut a, mut b) = tokio::io::duplex(64);
            a.write_all(bytes).await?;
            drop(a);
            match read_block(&mut b, max).await {
                Err(BadHead::Truncated) if bytes.len() < 4 || bytes.len() == 7 => {}
                Err(BadHead::TooLarge(1025, 1024)) => {}
                other => panic!("{bytes:?}: {other:?}"),
            }
        }
        Ok(())
    }

    #[test]
    fn decoded_heads_are_valid_http_or_refused() {
        let bad_name =
            head::encode_response(0, 200, std::iter::once((&b"bad name"[..], &b"v"[..])), 0)
                .expect("encodes");
        assert!(matches!(
            decode_response(bad_name.slice(LENGTH_PREFIX..)),
            Err(BadHead::Invalid("header name"))
        ));
        let bad_value =
            head::encode_response(0, 200, std::iter::once((&b"x"[..], &b"a\nb"[..])), 0)
                .expect("encodes");
        assert!(matches!(
            decode_response(bad_value.slice(LENGTH_PREFIX..)),
            Err(BadHead::Invalid("header value"))
        ));
        let absolute =
            head::encode_request(0, b"GET", b"https://elsewhere/x", std::iter::empty(), 0)
                .expect("encodes");
        assert!(matches!(
            decode_request(absolute.slice(LENGTH_PREFIX..)),
            Err(BadHead::Invalid(_))
        ));
        let status = head::encode_response(0, 1000, std::iter::empty(), 0).expect("encodes");
        assert!(matches!(
            decode_response(status.slice(LENGTH_PREFIX..)),
            Err(BadHead::Invalid("status"))
        ));
    }

    #[tokio::test]
    async fn body_reads_grow_while_they_come_back_full() -> anyhow::Result<()> {
        let (mut a, b) = tokio::io::duplex(1 << 20);
        let data = vec![7u8; 300 * 1024];
        a.write_all(&data).await?;
        drop(a);
        let mut body = BodyReader::new(b, false);
        let mut sizes = Vec::new();
        while let Some(frame) = body.frame().await {
            sizes.push(frame?.into_data().map(|d| d.len()).unwrap_or(0));
        }
        assert_eq!(sizes.iter().sum::<usize>(), data.len());
        assert!(
            sizes.first().is_some_and(|&n| n <= 2 * MIN_READ),
            "{sizes:?}"
        );
        assert!(sizes.iter().any(|&n| n >= MAX_READ / 2), "{sizes:?}");
        Ok(())
    }

    #[tokio::test]
    async fn a_small_body_of_known_length_reads_into_a_buffer_of_its_size() -> anyhow::Result<()> {
        let (mut a, b) = tokio::io::duplex(1024);
        let mut body = BodyReader::new(b, false).with_length(Some(600));
        // Nothing written yet: the first poll sets the buffer up and waits.
        let waker = std::task::Waker::noop();
        let mut cx = Context::from_waker(waker);
        assert!(http_body::Body::poll_frame(Pin::new(&mut body), &mut cx).is_pending());
        assert!(
            (600..MIN_READ).contains(&body.buf.capacity()),
            "{}",
            body.buf.capacity()
        );
        a.write_all(&[1u8; 600]).await?;
        let frame = body.frame().await.expect("a frame")?;
        assert_eq!(frame.into_data().map(|d| d.len()).unwrap_or(0), 600);
        assert!(body.frame().await.is_none());
        Ok(())
    }

    #[tokio::test]
    async fn a_body_of_known_length_ends_with_its_last_byte_and_takes_the_streams_end()
    -> anyhow::Result<()> {
        let (mut a, b) = tokio::io::duplex(1024);
        a.write_all(b"hello").await?;
        a.shutdown().await?;
        let mut body = BodyReader::new(b, false).with_length(Some(5));
        assert_eq!(http_body::Body::size_hint(&body).exact(), Some(5));
        let frame = body.frame().await.expect("a frame")?;
        assert_eq!(frame.into_data().ok().as_deref(), Some(&b"hello"[..]));
        assert!(
            http_body::Body::is_end_stream(&body),
            "done without another poll"
        );
        // The end of the stream was taken as well.
        let mut rest = Vec::new();
        tokio::io::AsyncReadExt::read_to_end(&mut body.into_inner(), &mut rest).await?;
        assert!(rest.is_empty());

        let (mut a, b) = tokio::io::duplex(1024);
        a.write_all(b"hel").await?;
        drop(a);
        let mut body = BodyReader::new(b, false).with_length(Some(5));
        let _ = body.frame().await;
        let err = body.frame().await.expect("an error").expect_err("short");
        assert_eq!(err.kind(), io::ErrorKind::UnexpectedEof);
        Ok(())
    }
}
