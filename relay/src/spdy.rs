//! Just enough SPDY/3.1 for the relay to end a broken `kubectl port-forward` the way the kubelet ends a failed
//! one, so that kubectl prints which cluster and why instead of only "lost connection to pod".
//!
//! kubectl forwards each local connection over a pair of SPDY streams it opens (`streamType: error` and
//! `streamType: data`, same `requestID`); whatever the server writes on the error stream before ending it,
//! kubectl prints as "an error occurred forwarding LOCAL -> REMOTE: MESSAGE" once the data stream has ended
//! too. kubectl ≥ 1.30 carries the SPDY byte stream in binary WebSocket messages (`SPDY/3.1+portforward.k8s.io`),
//! older ones speak SPDY on the upgraded connection itself.
//!
//! [`PortForward`] watches both directions of such a pipe without changing a byte: the user's frames (every
//! header block is inflated, in order, with the one zlib context SPDY shares per direction, to read each
//! SYN_STREAM's `streamType` and `requestID`), and the cluster's frames (only their boundaries, replies, FINs
//! and resets). When the cluster's side breaks, [`PortForward::farewell`] gives the bytes that end every
//! forwarded connection still open: a DATA frame with the message and FIN on its error stream, an empty FIN
//! on its data stream — framed as one WebSocket message when tunnelled — but only when the cluster's side
//! stopped between two frames (else nothing can be injected and the pipe just closes).
//!
//! Anything the relay does not understand (another SPDY version, a frame or header block over the bounds,
//! corrupt zlib data, too many streams) turns the watcher off for that pipe: forwarding never depends on it.
//! Not done: exec and attach over SPDY (kubectl ≥ 1.30 uses WebSocket there, which [`crate::ends`] handles),
//! flow control, or anything the relay would have to say while the path is still up.

use std::collections::HashMap;

use bytes::{BufMut as _, BytesMut};
use flate2::{Decompress, FlushDecompress, Status};
use http::header::{self, HeaderMap};

/// The SPDY/3 header compression dictionary (draft-mbelshe-httpbis-spdy-00, section 2.6.10.1), 1423 bytes.
const DICTIONARY: &[u8] = include_bytes!("spdy_dictionary.bin");
/// The subprotocol of SPDY tunnelled in a WebSocket (kubectl ≥ 1.30 port-forward).
const TUNNELED: &str = "SPDY/3.1+portforward.k8s.io";
/// The port-forward protocol of a plain SPDY upgrade (`X-Stream-Protocol-Version`).
const PORT_FORWARD: &str = "portforward.k8s.io";
/// Largest control frame payload read (a SYN_STREAM's header block; spdystream's are ~100 bytes).
const MAX_CONTROL: usize = 64 * 1024;
/// Largest header block once inflated.
const MAX_HEADER_BLOCK: usize = 64 * 1024;
/// Most streams tracked in one pipe (two per forwarded connection).
const MAX_STREAMS: usize = 4096;

const SYN_STREAM: u16 = 1;
const SYN_REPLY: u16 = 2;
const RST_STREAM: u16 = 3;
const HEADERS: u16 = 8;
const FLAG_FIN: u8 = 0x01;

/// What one stream of a port-forward is for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    /// Where the server writes why forwarding failed.
    Error,
    /// The forwarded bytes.
    Data,
}

#[derive(Debug)]
struct Stream {
    kind: Kind,
    request: String,
    /// The server answered the SYN_STREAM.
    replied: bool,
    /// The server has ended its half (FIN).
    server_done: bool,
}

/// Watches a port-forward's SPDY pipe; see the module docs.
pub(crate) struct PortForward {
    websocket: Option<(WsReader, WsReader)>,
    user: FrameReader,
    agent: FrameReader,
    inflate: Decompress,
    streams: HashMap<u32, Stream>,
    /// Something was not understood: say nothing.
    off: bool,
}

impl std::fmt::Debug for PortForward {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PortForward")
            .field("websocket", &self.websocket.is_some())
            .field("streams", &self.streams.len())
            .field("off", &self.off)
            .finish_non_exhaustive()
    }
}

impl PortForward {
    /// A watcher for the upgraded pipe whose `101` carried `headers`, when it is a port-forward over SPDY
    /// (plain, or tunnelled in a WebSocket).
    pub(crate) fn for_upgrade(headers: &HeaderMap) -> Option<Self> {
        let value = |name: &str| {
            headers
                .get(name)
                .and_then(|v| v.to_str().ok())
                .map(str::trim)
                .unwrap_or_default()
        };
        let upgrade = value(header::UPGRADE.as_str());
        let websocket = if upgrade.eq_ignore_ascii_case("websocket")
            && value(header::SEC_WEBSOCKET_PROTOCOL.as_str()) == TUNNELED
        {
            Some((WsReader::new(true), WsReader::new(false)))
        } else if upgrade.eq_ignore_ascii_case("SPDY/3.1")
            && value("x-stream-protocol-version") == PORT_FORWARD
        {
            None
        } else {
            return None;
        };
        Some(Self {
            websocket,
            user: FrameReader::default(),
            agent: FrameReader::default(),
            inflate: Decompress::new(true),
            streams: HashMap::new(),
            off: false,
        })
    }

    /// Bytes the user sent towards the cluster.
    pub(crate) fn handle_user_bytes(&mut self, bytes: &[u8]) {
        if self.off {
            return;
        }
        let mut frames = Vec::new();
        let ok = match &mut self.websocket {
            Some((user, _)) => user.feed(bytes, |payload| self.user.feed(payload, &mut frames)),
            None => self.user.feed(bytes, &mut frames),
        };
        if !ok {
            self.off = true;
            return;
        }
        for frame in frames {
            if !self.on_user_frame(frame) {
                self.off = true;
                return;
            }
        }
    }

    /// Bytes the cluster sent towards the user.
    pub(crate) fn handle_agent_bytes(&mut self, bytes: &[u8]) {
        if self.off {
            return;
        }
        let mut frames = Vec::new();
        let ok = match &mut self.websocket {
            Some((_, agent)) => agent.feed(bytes, |payload| self.agent.feed(payload, &mut frames)),
            None => self.agent.feed(bytes, &mut frames),
        };
        if !ok {
            self.off = true;
            return;
        }
        for frame in frames {
            match frame {
                Frame::Control {
                    kind: SYN_REPLY,
                    payload,
                    ..
                } => {
                    if let Some(s) = stream_id(&payload).and_then(|id| self.streams.get_mut(&id)) {
                        s.replied = true;
                    }
                }
                Frame::Control {
                    kind: RST_STREAM,
                    payload,
                    ..
                } => {
                    if let Some(id) = stream_id(&payload) {
                        self.streams.remove(&id);
                    }
                }
                Frame::Data { stream, fin: true } => {
                    if let Some(s) = self.streams.get_mut(&stream) {
                        s.server_done = true;
                    }
                }
                _ => {}
            }
        }
    }

    /// The bytes that end every forwarded connection still open with `message` on its error stream, or
    /// `None` when there is none or they cannot be sent (see the module docs).
    pub(crate) fn farewell(&self, message: &str) -> Option<Vec<u8>> {
        let at_boundary = self.agent.at_boundary()
            && self
                .websocket
                .as_ref()
                .is_none_or(|(_, agent)| agent.at_boundary());
        if self.off || !at_boundary {
            return None;
        }
        let open = |s: &&Stream| s.replied && !s.server_done;
        let failing: Vec<&str> = self
            .streams
            .values()
            .filter(open)
            .filter(|s| s.kind == Kind::Error)
            .map(|s| s.request.as_str())
            .collect();
        if failing.is_empty() {
            return None;
        }
        let mut ids: Vec<(&u32, &Stream)> = self
            .streams
            .iter()
            .filter(|(_, s)| open(s) && failing.contains(&s.request.as_str()))
            .collect();
        // The error streams first: kubectl reads the message once the data stream has ended.
        ids.sort_by_key(|(id, s)| (s.kind == Kind::Data, **id));
        let mut spdy = BytesMut::new();
        for (id, s) in ids {
            let payload = match s.kind {
                Kind::Error => message.as_bytes(),
                Kind::Data => &[],
            };
            data_frame(*id, payload, &mut spdy);
        }
        Some(match self.websocket {
            Some(_) => {
                let mut out = Vec::with_capacity(spdy.len() + 10);
                crate::ends::push_frame(&mut out, 0x2, &spdy);
                out
            }
            None => spdy.to_vec(),
        })
    }

    fn on_user_frame(&mut self, frame: Frame) -> bool {
        match frame {
            Frame::Control {
                kind: SYN_STREAM,
                payload,
                ..
            } => {
                let (Some(id), Some(block)) = (stream_id(&payload), payload.get(10..)) else {
                    return false;
                };
                let Some(headers) = self.header_block(block) else {
                    return false;
                };
                let find = |name: &str| {
                    headers
                        .iter()
                        .find(|(n, _)| n.eq_ignore_ascii_case(name))
                        .map(|(_, v)| v.clone())
                };
                let kind = match find("streamtype").as_deref() {
                    Some("error") => Kind::Error,
                    Some("data") => Kind::Data,
                    _ => return true,
                };
                if self.streams.len() >= MAX_STREAMS {
                    return false;
                }
                self.streams.insert(
                    id,
                    Stream {
                        kind,
                        request: find("requestid").unwrap_or_default(),
                        replied: false,
                        server_done: false,
                    },
                );
                true
            }
            // Its header block is inflated to keep the shared context in step.
            Frame::Control {
                kind: HEADERS,
                payload,
                ..
            } => payload
                .get(4..)
                .is_some_and(|block| self.header_block(block).is_some()),
            Frame::Control {
                kind: RST_STREAM,
                payload,
                ..
            } => {
                if let Some(id) = stream_id(&payload) {
                    self.streams.remove(&id);
                }
                true
            }
            _ => true,
        }
    }

    /// Inflates one header block with the user's context; its (name, value) pairs.
    fn header_block(&mut self, compressed: &[u8]) -> Option<Vec<(String, String)>> {
        let mut out = Vec::with_capacity(1024);
        let mut input = compressed;
        while !input.is_empty() {
            if out.len() >= MAX_HEADER_BLOCK {
                return None;
            }
            out.reserve(4096.min(MAX_HEADER_BLOCK - out.len()).max(1));
            let (read, written) = (self.inflate.total_in(), out.len());
            let result = self
                .inflate
                .decompress_vec(input, &mut out, FlushDecompress::Sync);
            let used = usize::try_from(self.inflate.total_in() - read).ok()?;
            input = input.get(used..)?;
            match result {
                Ok(Status::StreamEnd) => return None,
                Ok(_) if used == 0 && out.len() == written => return None,
                Ok(_) => {}
                Err(e) if e.needs_dictionary().is_some() => {
                    self.inflate.set_dictionary(DICTIONARY).ok()?;
                }
                Err(_) => return None,
            }
        }
        parse_headers(&out)
    }
}

/// The (name, value) pairs of an inflated header block.
fn parse_headers(mut block: &[u8]) -> Option<Vec<(String, String)>> {
    fn take<'a>(block: &mut &'a [u8], n: usize) -> Option<&'a [u8]> {
        let (head, rest) = (block.get(..n)?, block.get(n..)?);
        *block = rest;
        Some(head)
    }
    fn number(block: &mut &[u8]) -> Option<usize> {
        let b = take(block, 4)?;
        usize::try_from(u32::from_be_bytes([b[0], b[1], b[2], b[3]])).ok()
    }
    fn string(block: &mut &[u8]) -> Option<String> {
        let len = number(block)?;
        Some(String::from_utf8_lossy(take(block, len)?).into_owned())
    }
    let count = number(&mut block)?;
    let mut headers = Vec::new();
    for _ in 0..count {
        let name = string(&mut block)?;
        let value = string(&mut block)?;
        headers.push((name, value));
    }
    Some(headers)
}

/// The stream id at the start of a control frame's payload.
fn stream_id(payload: &[u8]) -> Option<u32> {
    let b = payload.get(..4)?;
    Some(u32::from_be_bytes([b[0], b[1], b[2], b[3]]) & 0x7fff_ffff)
}

/// A DATA frame with FIN on `stream`.
fn data_frame(stream: u32, payload: &[u8], out: &mut BytesMut) {
    out.put_u32(stream & 0x7fff_ffff);
    out.put_u8(FLAG_FIN);
    let len = payload.len().min(0xff_ffff);
    out.put_uint(len as u64, 3);
    out.put_slice(&payload[..len]);
}

/// A frame as far as the relay reads it.
#[derive(Debug, PartialEq, Eq)]
enum Frame {
    /// A control frame of a kind whose payload is kept (SYN_STREAM, SYN_REPLY, RST_STREAM, HEADERS).
    Control { kind: u16, payload: Vec<u8> },
    /// A DATA frame (payload not kept).
    Data { stream: u32, fin: bool },
    /// Any other frame.
    Other,
}

/// Where a [`FrameReader`] is in the byte stream.
#[derive(Debug)]
enum Reading {
    /// In a frame's 8-byte header (`have` bytes so far).
    Head { buf: [u8; 8], have: usize },
    /// In a frame's payload.
    Body {
        /// What the frame will be once its payload is in (`Control` payloads fill as they come).
        frame: Frame,
        remaining: usize,
    },
}

impl Default for Reading {
    fn default() -> Self {
        Reading::Head {
            buf: [0; 8],
            have: 0,
        }
    }
}

/// Splits one direction's SPDY byte stream into frames, keeping only the payloads it needs.
#[derive(Debug, Default)]
struct FrameReader {
    state: Reading,
}

impl FrameReader {
    /// Between two frames.
    fn at_boundary(&self) -> bool {
        matches!(self.state, Reading::Head { have: 0, .. })
    }

    /// Reads `bytes`, appending each frame completed to `out`; false on something that is not SPDY/3.
    fn feed(&mut self, mut bytes: &[u8], out: &mut Vec<Frame>) -> bool {
        while !bytes.is_empty() {
            match &mut self.state {
                Reading::Head { buf, have } => {
                    let n = (8 - *have).min(bytes.len());
                    buf[*have..*have + n].copy_from_slice(&bytes[..n]);
                    *have += n;
                    bytes = &bytes[n..];
                    if *have < 8 {
                        continue;
                    }
                    let first = u32::from_be_bytes([buf[0], buf[1], buf[2], buf[3]]);
                    let flags = buf[4];
                    let length =
                        usize::from(buf[5]) << 16 | usize::from(buf[6]) << 8 | usize::from(buf[7]);
                    let frame = if first & 0x8000_0000 == 0 {
                        Frame::Data {
                            stream: first & 0x7fff_ffff,
                            fin: flags & FLAG_FIN != 0,
                        }
                    } else {
                        if (first >> 16) & 0x7fff != 3 {
                            return false;
                        }
                        let kind = (first & 0xffff) as u16;
                        if matches!(kind, SYN_STREAM | SYN_REPLY | RST_STREAM | HEADERS) {
                            if length > MAX_CONTROL {
                                return false;
                            }
                            Frame::Control {
                                kind,
                                payload: Vec::with_capacity(length),
                            }
                        } else {
                            Frame::Other
                        }
                    };
                    self.state = Reading::Body {
                        frame,
                        remaining: length,
                    };
                    self.finish_if_done(out);
                }
                Reading::Body { frame, remaining } => {
                    let n = (*remaining).min(bytes.len());
                    if let Frame::Control { payload, .. } = frame {
                        payload.extend_from_slice(&bytes[..n]);
                    }
                    *remaining -= n;
                    bytes = &bytes[n..];
                    self.finish_if_done(out);
                }
            }
        }
        true
    }

    fn finish_if_done(&mut self, out: &mut Vec<Frame>) {
        if matches!(self.state, Reading::Body { remaining: 0, .. })
            && let Reading::Body { frame, .. } = std::mem::take(&mut self.state)
        {
            out.push(frame);
        }
    }
}

/// How many bytes of extended payload length follow the second header byte.
fn extended_length(b1: u8) -> usize {
    match b1 & 0x7f {
        126 => 2,
        127 => 8,
        _ => 0,
    }
}

/// Where a [`WsReader`] is in the byte stream.
#[derive(Debug)]
enum WsState {
    /// In a frame header (2 to 14 bytes; `have` so far).
    Head { buf: [u8; 14], have: usize },
    /// In a frame's payload.
    Body {
        remaining: u64,
        mask: Option<[u8; 4]>,
        offset: usize,
        /// A data frame (binary or continuation), whose payload is the SPDY byte stream.
        data: bool,
        fin: bool,
    },
}

/// Takes the payloads of one direction's WebSocket data frames out of the byte stream (unmasking the
/// client's), and knows whether it is between two messages.
#[derive(Debug)]
struct WsReader {
    /// Frames in this direction are masked (client to server).
    masked: bool,
    state: WsState,
    /// Inside a fragmented message.
    in_message: bool,
    scratch: Vec<u8>,
}

impl WsReader {
    fn new(masked: bool) -> Self {
        Self {
            masked,
            state: WsState::Head {
                buf: [0; 14],
                have: 0,
            },
            in_message: false,
            scratch: Vec::new(),
        }
    }

    /// Between two messages.
    fn at_boundary(&self) -> bool {
        matches!(self.state, WsState::Head { have: 0, .. }) && !self.in_message
    }

    /// Reads `bytes`, handing every data payload byte to `payload` (which says whether it understood them);
    /// false when something is not a WebSocket stream of this direction or `payload` said so.
    fn feed(&mut self, mut bytes: &[u8], mut payload: impl FnMut(&[u8]) -> bool) -> bool {
        loop {
            match &mut self.state {
                WsState::Head { buf, have } => {
                    let need = if *have < 2 {
                        2
                    } else {
                        2 + extended_length(buf[1]) + if buf[1] & 0x80 != 0 { 4 } else { 0 }
                    };
                    if *have < need {
                        if bytes.is_empty() {
                            return true;
                        }
                        let n = (need - *have).min(bytes.len());
                        buf[*have..*have + n].copy_from_slice(&bytes[..n]);
                        *have += n;
                        bytes = &bytes[n..];
                        continue;
                    }
                    let (b0, b1) = (buf[0], buf[1]);
                    if (b1 & 0x80 != 0) != self.masked {
                        return false;
                    }
                    let (len, at) = match b1 & 0x7f {
                        126 => (u64::from(u16::from_be_bytes([buf[2], buf[3]])), 4),
                        127 => {
                            let mut b = [0u8; 8];
                            b.copy_from_slice(&buf[2..10]);
                            (u64::from_be_bytes(b), 10)
                        }
                        n => (u64::from(n), 2),
                    };
                    let mask = self
                        .masked
                        .then(|| [buf[at], buf[at + 1], buf[at + 2], buf[at + 3]]);
                    let opcode = b0 & 0x0f;
                    let data = matches!(opcode, 0x0..=0x2);
                    if data && opcode != 0 {
                        self.in_message = true;
                    }
                    self.state = WsState::Body {
                        remaining: len,
                        mask,
                        offset: 0,
                        data,
                        fin: b0 & 0x80 != 0,
                    };
                    self.finish_if_done();
                }
                WsState::Body {
                    remaining,
                    mask,
                    offset,
                    data,
                    ..
                } => {
                    if bytes.is_empty() {
                        return true;
                    }
                    let n = usize::try_from(*remaining)
                        .unwrap_or(usize::MAX)
                        .min(bytes.len());
                    if *data {
                        self.scratch.clear();
                        self.scratch.extend_from_slice(&bytes[..n]);
                        if let Some(key) = mask {
                            for (i, b) in self.scratch.iter_mut().enumerate() {
                                *b ^= key[(*offset + i) % 4];
                            }
                        }
                        if !payload(&self.scratch) {
                            return false;
                        }
                    }
                    *offset += n;
                    *remaining -= n as u64;
                    bytes = &bytes[n..];
                    self.finish_if_done();
                }
            }
        }
    }

    fn finish_if_done(&mut self) {
        if let WsState::Body {
            remaining: 0,
            data,
            fin,
            ..
        } = self.state
        {
            if data && fin {
                self.in_message = false;
            }
            self.state = WsState::Head {
                buf: [0; 14],
                have: 0,
            };
        }
    }
}

#[cfg(test)]
mod tests {
    use flate2::{Compress, Compression, FlushCompress};
    use http::HeaderValue;

    use super::*;

    /// kubectl's side: SYN_STREAMs with compressed headers (one zlib context for the session).
    struct Client {
        deflate: Compress,
    }

    impl Client {
        fn new() -> Self {
            let mut deflate = Compress::new(Compression::default(), true);
            let _ = deflate.set_dictionary(DICTIONARY);
            Self { deflate }
        }

        fn syn_stream(&mut self, id: u32, headers: &[(&str, &str)]) -> Vec<u8> {
            let mut raw = BytesMut::new();
            raw.put_u32(headers.len() as u32);
            for (name, value) in headers {
                raw.put_u32(name.len() as u32);
                raw.put_slice(name.as_bytes());
                raw.put_u32(value.len() as u32);
                raw.put_slice(value.as_bytes());
            }
            let mut block = Vec::with_capacity(raw.len() + 64);
            let mut rest = &raw[..];
            loop {
                block.reserve(64);
                let before = self.deflate.total_in();
                let _ = self
                    .deflate
                    .compress_vec(rest, &mut block, FlushCompress::Sync);
                let used = (self.deflate.total_in() - before) as usize;
                rest = &rest[used..];
                if rest.is_empty() && block.len() < block.capacity() {
                    break;
                }
            }
            let mut out = control(SYN_STREAM, 10 + block.len());
            out.put_u32(id);
            out.put_u32(0);
            out.put_u16(0);
            out.put_slice(&block);
            out.to_vec()
        }

        /// The two streams kubectl opens for one forwarded connection.
        fn connection(&mut self, error: u32, data: u32, request: &str) -> Vec<u8> {
            let mut out = self.syn_stream(
                error,
                &[
                    ("streamtype", "error"),
                    ("port", "7"),
                    ("requestid", request),
                ],
            );
            out.extend(self.syn_stream(
                data,
                &[
                    ("streamtype", "data"),
                    ("port", "7"),
                    ("requestid", request),
                ],
            ));
            out
        }
    }

    fn control(kind: u16, len: usize) -> BytesMut {
        let mut out = BytesMut::new();
        out.put_u16(0x8000 | 3);
        out.put_u16(kind);
        out.put_u8(0);
        out.put_uint(len as u64, 3);
        out
    }

    /// The server's side: replies (an empty, uncompressed-looking block is fine: the relay skips them), data.
    fn syn_reply(id: u32) -> Vec<u8> {
        let mut out = control(SYN_REPLY, 4 + 6);
        out.put_u32(id);
        out.put_slice(&[0x78, 0xbb, 0, 0, 0, 0]);
        out.to_vec()
    }

    fn data(id: u32, fin: bool, payload: &[u8]) -> Vec<u8> {
        let mut out = BytesMut::new();
        out.put_u32(id);
        out.put_u8(if fin { FLAG_FIN } else { 0 });
        out.put_uint(payload.len() as u64, 3);
        out.put_slice(payload);
        out.to_vec()
    }

    fn rst(id: u32) -> Vec<u8> {
        let mut out = control(RST_STREAM, 8);
        out.put_u32(id);
        out.put_u32(5);
        out.to_vec()
    }

    /// Decodes DATA frames: (stream, fin, payload).
    fn data_frames(mut bytes: &[u8]) -> Vec<(u32, bool, Vec<u8>)> {
        let mut out = Vec::new();
        while bytes.len() >= 8 {
            let id = u32::from_be_bytes([bytes[0], bytes[1], bytes[2], bytes[3]]);
            let len =
                usize::from(bytes[5]) << 16 | usize::from(bytes[6]) << 8 | usize::from(bytes[7]);
            out.push((id, bytes[4] & FLAG_FIN != 0, bytes[8..8 + len].to_vec()));
            bytes = &bytes[8 + len..];
        }
        out
    }

    fn plain() -> PortForward {
        let mut headers = HeaderMap::new();
        headers.insert(header::UPGRADE, HeaderValue::from_static("SPDY/3.1"));
        headers.insert(
            "x-stream-protocol-version",
            HeaderValue::from_static("portforward.k8s.io"),
        );
        PortForward::for_upgrade(&headers).unwrap_or_else(|| panic!("not a port-forward"))
    }

    fn tunneled() -> PortForward {
        let mut headers = HeaderMap::new();
        headers.insert(header::UPGRADE, HeaderValue::from_static("websocket"));
        headers.insert(
            header::SEC_WEBSOCKET_PROTOCOL,
            HeaderValue::from_static("SPDY/3.1+portforward.k8s.io"),
        );
        PortForward::for_upgrade(&headers).unwrap_or_else(|| panic!("not a port-forward"))
    }

    /// A WebSocket frame; masked (as a client sends) when `mask` is given.
    fn ws_frame(opcode: u8, fin: bool, payload: &[u8], mask: Option<[u8; 4]>) -> Vec<u8> {
        let mut out = vec![if fin { 0x80 } else { 0 } | opcode];
        let m = if mask.is_some() { 0x80 } else { 0 };
        match payload.len() {
            n @ 0..=125 => out.push(m | n as u8),
            n @ 126..=0xffff => {
                out.push(m | 126);
                out.extend((n as u16).to_be_bytes());
            }
            n => {
                out.push(m | 127);
                out.extend((n as u64).to_be_bytes());
            }
        }
        match mask {
            Some(key) => {
                out.extend(key);
                out.extend(payload.iter().enumerate().map(|(i, b)| b ^ key[i % 4]));
            }
            None => out.extend_from_slice(payload),
        }
        out
    }

    #[test]
    fn only_port_forwards_over_spdy_are_watched() {
        let mut headers = HeaderMap::new();
        headers.insert(header::UPGRADE, HeaderValue::from_static("websocket"));
        headers.insert(
            header::SEC_WEBSOCKET_PROTOCOL,
            HeaderValue::from_static("v5.channel.k8s.io"),
        );
        assert!(PortForward::for_upgrade(&headers).is_none());
        headers.insert(header::UPGRADE, HeaderValue::from_static("SPDY/3.1"));
        headers.insert(
            "x-stream-protocol-version",
            HeaderValue::from_static("v4.channel.k8s.io"),
        );
        assert!(PortForward::for_upgrade(&headers).is_none());
        assert!(PortForward::for_upgrade(&HeaderMap::new()).is_none());
    }

    #[test]
    fn each_open_connection_gets_the_message_on_its_error_stream_and_its_data_stream_ends() {
        let mut pf = plain();
        let mut kubectl = Client::new();
        // Three forwarded connections: one still open, one whose server already ended its error stream, one
        // the user reset.
        pf.handle_user_bytes(&kubectl.connection(1, 3, "0"));
        pf.handle_user_bytes(&kubectl.connection(5, 7, "1"));
        pf.handle_user_bytes(&kubectl.connection(9, 11, "2"));
        for id in [1, 3, 5, 7, 9, 11] {
            pf.handle_agent_bytes(&syn_reply(id));
        }
        pf.handle_agent_bytes(&data(3, false, b"echo"));
        pf.handle_agent_bytes(&data(5, true, b""));
        pf.handle_agent_bytes(&data(7, true, b""));
        pf.handle_user_bytes(&rst(9));
        pf.handle_user_bytes(&rst(11));
        let out = pf
            .farewell("cluster prod: agent gone")
            .unwrap_or_else(|| panic!("no farewell"));
        assert_eq!(
            data_frames(&out),
            vec![
                (1, true, b"cluster prod: agent gone".to_vec()),
                (3, true, Vec::new()),
            ]
        );
    }

    #[test]
    fn bytes_in_any_split_give_the_same_result() {
        let mut kubectl = Client::new();
        let mut user = kubectl.connection(1, 3, "0");
        user.extend(kubectl.connection(5, 7, "1"));
        let mut agent = Vec::new();
        for id in [1, 3, 5, 7] {
            agent.extend(syn_reply(id));
        }
        agent.extend(data(3, false, &[7; 300]));
        let mut whole = plain();
        whole.handle_user_bytes(&user);
        whole.handle_agent_bytes(&agent);
        let mut bytewise = plain();
        for b in &user {
            bytewise.handle_user_bytes(std::slice::from_ref(b));
        }
        for b in &agent {
            bytewise.handle_agent_bytes(std::slice::from_ref(b));
        }
        let (a, b) = (whole.farewell("m"), bytewise.farewell("m"));
        assert!(a.is_some());
        assert_eq!(a, b);
        assert_eq!(
            data_frames(&a.unwrap_or_default()).len(),
            4,
            "two connections, two streams each"
        );
    }

    #[test]
    fn nothing_is_injected_in_the_middle_of_a_frame_or_without_an_open_connection() {
        let mut pf = plain();
        let mut kubectl = Client::new();
        assert_eq!(pf.farewell("m"), None, "no connection yet");
        pf.handle_user_bytes(&kubectl.connection(1, 3, "0"));
        assert_eq!(pf.farewell("m"), None, "not answered yet");
        pf.handle_agent_bytes(&syn_reply(1));
        pf.handle_agent_bytes(&syn_reply(3));
        let frame = data(3, false, b"0123456789");
        pf.handle_agent_bytes(&frame[..12]);
        assert_eq!(pf.farewell("m"), None, "the cluster stopped inside a frame");
        pf.handle_agent_bytes(&frame[12..]);
        assert!(pf.farewell("m").is_some());
    }

    #[test]
    fn tunneled_in_a_websocket_the_farewell_is_one_binary_message() {
        let mut pf = tunneled();
        let mut kubectl = Client::new();
        let user = kubectl.connection(1, 3, "0");
        // kubectl's messages, masked, split at an arbitrary point and fragmented.
        let (a, b) = user.split_at(17);
        let mut wire = ws_frame(0x2, false, a, Some([1, 2, 3, 4]));
        wire.extend(ws_frame(0x9, true, b"ping", Some([5, 6, 7, 8])));
        wire.extend(ws_frame(0x0, true, b, Some([9, 10, 11, 12])));
        pf.handle_user_bytes(&wire);
        let mut agent = syn_reply(1);
        agent.extend(syn_reply(3));
        let long = data(3, false, &[1; 70_000]);
        agent.extend(&long[..40]);
        pf.handle_agent_bytes(&ws_frame(0x2, true, &agent, None));
        assert_eq!(pf.farewell("m"), None, "the SPDY frame is not finished");
        let rest = ws_frame(0x2, false, &long[40..], None);
        pf.handle_agent_bytes(&rest[..100]);
        assert_eq!(pf.farewell("m"), None, "inside a WebSocket frame");
        pf.handle_agent_bytes(&rest[100..]);
        assert_eq!(pf.farewell("m"), None, "inside a fragmented message");
        pf.handle_agent_bytes(&ws_frame(0x0, true, b"", None));
        let out = pf.farewell("cluster prod: gone").unwrap_or_default();
        assert_eq!(out[0], 0x82, "one unmasked, final binary frame");
        let len = usize::from(out[1]);
        assert_eq!(out.len(), 2 + len);
        assert_eq!(
            data_frames(&out[2..]),
            vec![
                (1, true, b"cluster prod: gone".to_vec()),
                (3, true, Vec::new())
            ]
        );
    }

    #[test]
    fn what_is_not_understood_turns_it_off() {
        let mut pf = plain();
        let mut kubectl = Client::new();
        pf.handle_user_bytes(&kubectl.connection(1, 3, "0"));
        pf.handle_agent_bytes(&syn_reply(1));
        // SPDY version 2.
        let mut v2 = control(SYN_REPLY, 4);
        v2[1] = 2;
        v2.put_u32(3);
        pf.handle_agent_bytes(&v2);
        assert_eq!(pf.farewell("m"), None);

        // Corrupt header blocks.
        let mut pf = plain();
        let mut frame = Client::new().syn_stream(1, &[("streamtype", "error")]);
        let last = frame.len() - 3;
        frame[last] ^= 0xff;
        pf.handle_user_bytes(&frame);
        assert!(pf.off);

        // A header block over the bound.
        let mut pf = plain();
        let mut huge = control(SYN_STREAM, MAX_CONTROL + 1);
        huge.put_u32(1);
        pf.handle_user_bytes(&huge);
        assert!(pf.off);

        // An unmasked frame from the user of a tunnel.
        let mut pf = tunneled();
        pf.handle_user_bytes(&ws_frame(0x2, true, b"x", None));
        assert!(pf.off);
    }
}
