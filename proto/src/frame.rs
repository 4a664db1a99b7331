//! Frames and their codec.
//!
//! Every frame is a 9-byte [`FrameHeader`] followed by `length` payload bytes. Decoding is zero-copy: payloads
//! are [`Bytes`] slices of the input. Unknown frame types are skipped (after the length check), so new frame
//! types can be added without a version bump. See `docs/PROTOCOL.md` for the layout of every payload.

use bytes::{Buf, BufMut, Bytes};

use crate::StreamId;

/// Frame type codes.
pub(crate) mod ty {
    pub(crate) const HELLO: u8 = 0;
    pub(crate) const SETTINGS: u8 = 1;
    pub(crate) const OPEN: u8 = 2;
    pub(crate) const ACCEPT: u8 = 3;
    pub(crate) const REFUSE: u8 = 4;
    pub(crate) const DATA: u8 = 5;
    pub(crate) const WINDOW_UPDATE: u8 = 6;
    pub(crate) const RESET: u8 = 7;
    pub(crate) const PING: u8 = 8;
    pub(crate) const GOAWAY: u8 = 9;
}

/// DATA flag: the sender's last frame on this stream.
pub const FLAG_FIN: u8 = 0x1;
/// PING flag: this PING is the answer to one received.
pub const FLAG_ACK: u8 = 0x1;

/// Largest payload length the 24-bit length field can express.
pub const MAX_FRAME_SIZE_LIMIT: u32 = (1 << 24) - 1;
/// Smallest maximum frame size a peer may announce. Every control frame we build fits in it.
pub const MIN_MAX_FRAME_SIZE: u32 = 32 * 1024;
/// Largest flow-control window (and largest WINDOW_UPDATE increment): 2^31-1.
pub const MAX_WINDOW: u32 = (1 << 31) - 1;
/// Largest REFUSE/GOAWAY reason, in bytes.
pub const MAX_REASON_LEN: usize = 1024;
/// Most entries a SETTINGS frame may carry.
pub const MAX_SETTINGS_ENTRIES: usize = 16;
/// Fixed part of an OPEN payload (kind, priority, deadline) before the metadata.
pub(crate) const OPEN_FIXED_LEN: usize = 7;

const STREAM_ID_MASK: u32 = 0x7fff_ffff;

/// The fixed header every frame starts with (9 bytes: 24-bit length, type, flags, 32-bit stream id).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FrameHeader {
    /// Payload length in bytes.
    pub length: u32,
    /// Frame type.
    pub kind: u8,
    /// Type-specific flags.
    pub flags: u8,
    /// Stream the frame belongs to (0 = connection).
    pub stream: StreamId,
}

impl FrameHeader {
    /// Encoded size of a header.
    pub const LEN: usize = 9;

    /// Parses a header from the first [`FrameHeader::LEN`] bytes of `bytes`, or None if there are fewer. The
    /// reserved high bit of the stream id is cleared.
    pub fn parse(bytes: &[u8]) -> Option<FrameHeader> {
        let h: &[u8; Self::LEN] = bytes.get(..Self::LEN)?.try_into().ok()?;
        Some(FrameHeader {
            length: u32::from_be_bytes([0, h[0], h[1], h[2]]),
            kind: h[3],
            flags: h[4],
            stream: StreamId(u32::from_be_bytes([h[5], h[6], h[7], h[8]]) & STREAM_ID_MASK),
        })
    }

    /// The header's wire form. `length` must be at most [`MAX_FRAME_SIZE_LIMIT`] (higher bits are dropped).
    pub fn to_bytes(&self) -> [u8; Self::LEN] {
        let l = self.length.to_be_bytes();
        let s = (self.stream.0 & STREAM_ID_MASK).to_be_bytes();
        [
            l[1], l[2], l[3], self.kind, self.flags, s[0], s[1], s[2], s[3],
        ]
    }

    /// Appends the header to `buf`.
    pub fn encode(&self, buf: &mut impl BufMut) {
        buf.put_slice(&self.to_bytes());
    }
}

/// Identifiers of the values a SETTINGS frame can carry.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SettingId {
    /// Initial per-stream receive window the sender grants.
    InitialStreamWindow,
    /// Initial connection receive window the sender grants.
    ConnectionWindow,
    /// Largest frame payload the sender accepts.
    MaxFrameSize,
    /// Most concurrent streams the sender lets its peer open.
    MaxConcurrentStreams,
}

impl SettingId {
    /// The identifier on the wire.
    pub fn code(self) -> u16 {
        match self {
            SettingId::InitialStreamWindow => 1,
            SettingId::ConnectionWindow => 2,
            SettingId::MaxFrameSize => 3,
            SettingId::MaxConcurrentStreams => 4,
        }
    }

    /// The setting for a wire identifier, or None for an unknown one (which receivers ignore).
    pub fn from_code(code: u16) -> Option<SettingId> {
        match code {
            1 => Some(SettingId::InitialStreamWindow),
            2 => Some(SettingId::ConnectionWindow),
            3 => Some(SettingId::MaxFrameSize),
            4 => Some(SettingId::MaxConcurrentStreams),
            _ => None,
        }
    }
}

/// The values announced by a SETTINGS frame.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Settings {
    /// Initial per-stream receive window.
    pub initial_stream_window: u32,
    /// Initial connection receive window.
    pub connection_window: u32,
    /// Largest frame payload accepted.
    pub max_frame_size: u32,
    /// Most concurrent peer-opened streams.
    pub max_concurrent_streams: u32,
}

impl Default for Settings {
    /// The protocol defaults, which also apply to any value a SETTINGS frame leaves out.
    fn default() -> Self {
        Settings {
            initial_stream_window: 256 * 1024,
            connection_window: 16 * 1024 * 1024,
            max_frame_size: 64 * 1024,
            max_concurrent_streams: 1024,
        }
    }
}

impl Settings {
    fn set(&mut self, id: SettingId, value: u32) -> Result<(), DecodeError> {
        let bad = |reason| {
            Err(DecodeError::Malformed {
                kind: "SETTINGS",
                reason,
            })
        };
        match id {
            SettingId::InitialStreamWindow if value == 0 || value > MAX_WINDOW => {
                return bad("stream window out of range");
            }
            SettingId::ConnectionWindow if value == 0 || value > MAX_WINDOW => {
                return bad("connection window out of range");
            }
            SettingId::MaxFrameSize
                if !(MIN_MAX_FRAME_SIZE..=MAX_FRAME_SIZE_LIMIT).contains(&value) =>
            {
                return bad("max frame size out of range");
            }
            _ => {}
        }
        match id {
            SettingId::InitialStreamWindow => self.initial_stream_window = value,
            SettingId::ConnectionWindow => self.connection_window = value,
            SettingId::MaxFrameSize => self.max_frame_size = value,
            SettingId::MaxConcurrentStreams => self.max_concurrent_streams = value,
        }
        Ok(())
    }

    fn entries(&self) -> [(SettingId, u32); 4] {
        [
            (SettingId::InitialStreamWindow, self.initial_stream_window),
            (SettingId::ConnectionWindow, self.connection_window),
            (SettingId::MaxFrameSize, self.max_frame_size),
            (SettingId::MaxConcurrentStreams, self.max_concurrent_streams),
        ]
    }
}

/// One protocol frame. Payload-carrying variants hold [`Bytes`] that share the input buffer (no copy).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Frame {
    /// Sent first by both sides: magic and the range of versions spoken.
    Hello {
        /// Lowest version spoken.
        min_version: u16,
        /// Highest version spoken.
        max_version: u16,
    },
    /// The sender's limits.
    Settings(Settings),
    /// Opens a stream.
    Open {
        /// The new stream.
        stream: StreamId,
        /// What the stream carries (see [`crate::kind`]).
        kind: u16,
        /// Scheduling class.
        priority: u8,
        /// Milliseconds the opener waits for ACCEPT; 0 = no deadline.
        deadline_ms: u32,
        /// Opaque metadata for the acceptor.
        metadata: Bytes,
    },
    /// Accepts a stream.
    Accept {
        /// The stream.
        stream: StreamId,
        /// Opaque metadata for the opener.
        metadata: Bytes,
    },
    /// Refuses a stream.
    Refuse {
        /// The stream.
        stream: StreamId,
        /// Why (see [`crate::code`]).
        code: u32,
        /// Human-readable reason.
        reason: Bytes,
    },
    /// Stream bytes; `fin` half-closes the sender's side.
    Data {
        /// The stream.
        stream: StreamId,
        /// Set on the last frame the sender sends on this stream.
        fin: bool,
        /// The bytes.
        payload: Bytes,
    },
    /// Grants flow-control credit (stream 0 = connection window).
    WindowUpdate {
        /// The stream, or 0 for the connection.
        stream: StreamId,
        /// Bytes of credit granted.
        increment: u32,
    },
    /// Abruptly ends a stream in both directions.
    Reset {
        /// The stream.
        stream: StreamId,
        /// Why (see [`crate::code`]).
        code: u32,
    },
    /// Liveness probe (`ack` = the answer).
    Ping {
        /// Set on the answer.
        ack: bool,
        /// Echoed opaque data.
        data: [u8; 8],
    },
    /// No new streams above `last_stream`; the connection ends once open streams finish.
    GoAway {
        /// Highest peer-opened stream the sender processed.
        last_stream: StreamId,
        /// Why (see [`crate::code`]).
        code: u32,
        /// Human-readable reason.
        reason: Bytes,
    },
}

/// Why bytes could not be decoded as a frame. Every variant is a protocol violation by the peer.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DecodeError {
    /// The frame's length exceeds the maximum frame size.
    #[error("frame of {length} bytes exceeds the maximum of {max}")]
    FrameTooLarge {
        /// Announced length.
        length: u32,
        /// Maximum allowed.
        max: u32,
    },
    /// The payload does not have the layout its type requires.
    #[error("malformed {kind} frame: {reason}")]
    Malformed {
        /// Frame type name.
        kind: &'static str,
        /// What was wrong.
        reason: &'static str,
    },
    /// A HELLO frame did not start with the magic bytes.
    #[error("not a tether peer: bad magic")]
    BadMagic,
}

fn malformed<T>(kind: &'static str, reason: &'static str) -> Result<T, DecodeError> {
    Err(DecodeError::Malformed { kind, reason })
}

/// A reason string as carried by REFUSE and GOAWAY: at most [`MAX_REASON_LEN`] bytes of UTF-8.
fn check_reason(kind: &'static str, reason: &Bytes) -> Result<(), DecodeError> {
    if reason.len() > MAX_REASON_LEN {
        return malformed(kind, "reason longer than 1 KiB");
    }
    if std::str::from_utf8(reason).is_err() {
        return malformed(kind, "reason is not UTF-8");
    }
    Ok(())
}

impl Frame {
    /// Decodes one frame from `buf`. Returns `Ok(None)` and consumes nothing when `buf` does not yet hold a
    /// whole frame. `max_payload` bounds the payload length accepted (checked before anything is buffered).
    ///
    /// Frames of unknown type are consumed and skipped; if what follows them is incomplete the result is
    /// `Ok(None)` with the skipped frames consumed. After an error the buffer position is unspecified: errors
    /// are fatal to the connection.
    pub fn decode(buf: &mut Bytes, max_payload: u32) -> Result<Option<Frame>, DecodeError> {
        loop {
            let Some(header) = FrameHeader::parse(buf) else {
                return Ok(None);
            };
            if header.length > max_payload {
                return Err(DecodeError::FrameTooLarge {
                    length: header.length,
                    max: max_payload,
                });
            }
            let total = FrameHeader::LEN + header.length as usize;
            if buf.len() < total {
                return Ok(None);
            }
            buf.advance(FrameHeader::LEN);
            let payload = buf.split_to(header.length as usize);
            if let Some(frame) = Self::decode_payload(header, payload)? {
                return Ok(Some(frame));
            }
        }
    }

    /// Parses the payload of a frame whose header was read; None for an unknown type.
    fn decode_payload(header: FrameHeader, mut p: Bytes) -> Result<Option<Frame>, DecodeError> {
        let stream = header.stream;
        let on_connection = |kind: &'static str| {
            if stream.0 == 0 {
                Ok(())
            } else {
                malformed(kind, "must be sent on stream 0")
            }
        };
        let on_stream = |kind: &'static str| {
            if stream.0 != 0 {
                Ok(())
            } else {
                malformed(kind, "must not be sent on stream 0")
            }
        };
        let frame = match header.kind {
            ty::HELLO => {
                on_connection("HELLO")?;
                // Extra bytes after the version range are reserved for later versions and ignored, so a
                // future HELLO can still be read by this version.
                if p.len() < 8 {
                    return malformed("HELLO", "shorter than 8 bytes");
                }
                if p[..4] != crate::MAGIC {
                    return Err(DecodeError::BadMagic);
                }
                p.advance(4);
                let min_version = p.get_u16();
                let max_version = p.get_u16();
                if min_version > max_version {
                    return malformed("HELLO", "min version above max version");
                }
                Frame::Hello {
                    min_version,
                    max_version,
                }
            }
            ty::SETTINGS => {
                on_connection("SETTINGS")?;
                if !p.len().is_multiple_of(6) {
                    return malformed("SETTINGS", "length is not a multiple of 6");
                }
                if p.len() / 6 > MAX_SETTINGS_ENTRIES {
                    return malformed("SETTINGS", "more than 16 entries");
                }
                let mut settings = Settings::default();
                while p.has_remaining() {
                    let id = p.get_u16();
                    let value = p.get_u32();
                    if let Some(id) = SettingId::from_code(id) {
                        settings.set(id, value)?;
                    }
                }
                Frame::Settings(settings)
            }
            ty::OPEN => {
                on_stream("OPEN")?;
                if p.len() < OPEN_FIXED_LEN {
                    return malformed("OPEN", "shorter than 7 bytes");
                }
                let kind = p.get_u16();
                let priority = p.get_u8();
                let deadline_ms = p.get_u32();
                Frame::Open {
                    stream,
                    kind,
                    priority,
                    deadline_ms,
                    metadata: p,
                }
            }
            ty::ACCEPT => {
                on_stream("ACCEPT")?;
                Frame::Accept {
                    stream,
                    metadata: p,
                }
            }
            ty::REFUSE => {
                on_stream("REFUSE")?;
                if p.len() < 4 {
                    return malformed("REFUSE", "shorter than 4 bytes");
                }
                let code = p.get_u32();
                check_reason("REFUSE", &p)?;
                Frame::Refuse {
                    stream,
                    code,
                    reason: p,
                }
            }
            ty::DATA => {
                on_stream("DATA")?;
                Frame::Data {
                    stream,
                    fin: header.flags & FLAG_FIN != 0,
                    payload: p,
                }
            }
            ty::WINDOW_UPDATE => {
                if p.len() != 4 {
                    return malformed("WINDOW_UPDATE", "length is not 4");
                }
                let increment = p.get_u32();
                if increment == 0 {
                    return malformed("WINDOW_UPDATE", "zero increment");
                }
                if increment > MAX_WINDOW {
                    return malformed("WINDOW_UPDATE", "increment above 2^31-1");
                }
                Frame::WindowUpdate { stream, increment }
            }
            ty::RESET => {
                on_stream("RESET")?;
                if p.len() != 4 {
                    return malformed("RESET", "length is not 4");
                }
                Frame::Reset {
                    stream,
                    code: p.get_u32(),
                }
            }
            ty::PING => {
                on_connection("PING")?;
                let data: [u8; 8] = match p[..].try_into() {
                    Ok(d) => d,
                    Err(_) => return malformed("PING", "length is not 8"),
                };
                Frame::Ping {
                    ack: header.flags & FLAG_ACK != 0,
                    data,
                }
            }
            ty::GOAWAY => {
                on_connection("GOAWAY")?;
                if p.len() < 8 {
                    return malformed("GOAWAY", "shorter than 8 bytes");
                }
                let last_stream = StreamId(p.get_u32() & STREAM_ID_MASK);
                let code = p.get_u32();
                check_reason("GOAWAY", &p)?;
                Frame::GoAway {
                    last_stream,
                    code,
                    reason: p,
                }
            }
            _ => return Ok(None),
        };
        Ok(Some(frame))
    }

    /// The stream this frame is about (0 for connection frames).
    pub fn stream(&self) -> StreamId {
        match self {
            Frame::Hello { .. }
            | Frame::Settings(_)
            | Frame::Ping { .. }
            | Frame::GoAway { .. } => StreamId(0),
            Frame::Open { stream, .. }
            | Frame::Accept { stream, .. }
            | Frame::Refuse { stream, .. }
            | Frame::Data { stream, .. }
            | Frame::WindowUpdate { stream, .. }
            | Frame::Reset { stream, .. } => *stream,
        }
    }

    /// The header this frame is encoded with.
    pub fn header(&self) -> FrameHeader {
        let (kind, flags) = match self {
            Frame::Hello { .. } => (ty::HELLO, 0),
            Frame::Settings(_) => (ty::SETTINGS, 0),
            Frame::Open { .. } => (ty::OPEN, 0),
            Frame::Accept { .. } => (ty::ACCEPT, 0),
            Frame::Refuse { .. } => (ty::REFUSE, 0),
            Frame::Data { fin, .. } => (ty::DATA, if *fin { FLAG_FIN } else { 0 }),
            Frame::WindowUpdate { .. } => (ty::WINDOW_UPDATE, 0),
            Frame::Reset { .. } => (ty::RESET, 0),
            Frame::Ping { ack, .. } => (ty::PING, if *ack { FLAG_ACK } else { 0 }),
            Frame::GoAway { .. } => (ty::GOAWAY, 0),
        };
        let length = u32::try_from(self.payload_len()).unwrap_or(u32::MAX);
        FrameHeader {
            length,
            kind,
            flags,
            stream: self.stream(),
        }
    }

    fn payload_len(&self) -> usize {
        match self {
            Frame::Hello { .. } => 8,
            Frame::Settings(s) => 6 * s.entries().len(),
            Frame::Open { metadata, .. } => OPEN_FIXED_LEN + metadata.len(),
            Frame::Accept { metadata, .. } => metadata.len(),
            Frame::Refuse { reason, .. } => 4 + reason.len(),
            Frame::Data { payload, .. } => payload.len(),
            Frame::WindowUpdate { .. } | Frame::Reset { .. } => 4,
            Frame::Ping { .. } => 8,
            Frame::GoAway { reason, .. } => 8 + reason.len(),
        }
    }

    /// Bytes [`Frame::encode`] appends.
    pub fn encoded_len(&self) -> usize {
        FrameHeader::LEN + self.payload_len()
    }

    /// Appends the encoded frame to `buf`.
    ///
    /// The caller keeps frames within the limits the decoder checks (payload ≤ 2^24-1 and the peer's maximum
    /// frame size, reasons ≤ 1 KiB of UTF-8, non-zero increments): the encoder writes what it is given.
    pub fn encode(&self, buf: &mut impl BufMut) {
        self.header().encode(buf);
        match self {
            Frame::Hello {
                min_version,
                max_version,
            } => {
                buf.put_slice(&crate::MAGIC);
                buf.put_u16(*min_version);
                buf.put_u16(*max_version);
            }
            Frame::Settings(s) => {
                for (id, value) in s.entries() {
                    buf.put_u16(id.code());
                    buf.put_u32(value);
                }
            }
            Frame::Open {
                kind,
                priority,
                deadline_ms,
                metadata,
                ..
            } => {
                buf.put_u16(*kind);
                buf.put_u8(*priority);
                buf.put_u32(*deadline_ms);
                buf.put_slice(metadata);
            }
            Frame::Accept { metadata, .. } => buf.put_slice(metadata),
            Frame::Refuse { code, reason, .. } => {
                buf.put_u32(*code);
                buf.put_slice(reason);
            }
            Frame::Data { payload, .. } => buf.put_slice(payload),
            Frame::WindowUpdate { increment, .. } => buf.put_u32(*increment),
            Frame::Reset { code, .. } => buf.put_u32(*code),
            Frame::Ping { data, .. } => buf.put_slice(data),
            Frame::GoAway {
                last_stream,
                code,
                reason,
            } => {
                buf.put_u32(last_stream.0 & STREAM_ID_MASK);
                buf.put_u32(*code);
                buf.put_slice(reason);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use bytes::BytesMut;
    use proptest::prelude::*;

    const MAX: u32 = 64 * 1024;

    fn encode(frame: &Frame) -> Bytes {
        let mut buf = BytesMut::new();
        frame.encode(&mut buf);
        assert_eq!(buf.len(), frame.encoded_len());
        buf.freeze()
    }

    fn round_trip(frame: Frame) {
        let mut wire = encode(&frame);
        let decoded = Frame::decode(&mut wire, MAX)
            .expect("decodes")
            .expect("complete");
        assert_eq!(decoded, frame);
        assert!(wire.is_empty());
    }

    fn raw(kind: u8, flags: u8, stream: u32, payload: &[u8]) -> Bytes {
        let mut buf = BytesMut::new();
        let length = u32::try_from(payload.len()).expect("small");
        FrameHeader {
            length,
            kind,
            flags,
            stream: StreamId(stream),
        }
        .encode(&mut buf);
        buf.put_slice(payload);
        buf.freeze()
    }

    fn one_of_each() -> Vec<Frame> {
        let s = StreamId(7);
        vec![
            Frame::Hello {
                min_version: 1,
                max_version: 3,
            },
            Frame::Settings(Settings {
                initial_stream_window: 1,
                connection_window: MAX_WINDOW,
                max_frame_size: MIN_MAX_FRAME_SIZE,
                max_concurrent_streams: 0,
            }),
            Frame::Open {
                stream: s,
                kind: crate::kind::HTTP,
                priority: 1,
                deadline_ms: 30_000,
                metadata: Bytes::from_static(b"meta"),
            },
            Frame::Accept {
                stream: s,
                metadata: Bytes::new(),
            },
            Frame::Refuse {
                stream: s,
                code: crate::code::REFUSED,
                reason: Bytes::from_static("nön".as_bytes()),
            },
            Frame::Data {
                stream: s,
                fin: false,
                payload: Bytes::from_static(b"hello"),
            },
            Frame::Data {
                stream: s,
                fin: true,
                payload: Bytes::new(),
            },
            Frame::WindowUpdate {
                stream: StreamId(0),
                increment: MAX_WINDOW,
            },
            Frame::WindowUpdate {
                stream: s,
                increment: 1,
            },
            Frame::Reset {
                stream: s,
                code: crate::code::CANCEL,
            },
            Frame::Ping {
                ack: false,
                data: *b"12345678",
            },
            Frame::Ping {
                ack: true,
                data: [0xff; 8],
            },
            Frame::GoAway {
                last_stream: StreamId(MAX_WINDOW),
                code: crate::code::SHUTDOWN,
                reason: Bytes::from_static(b"bye"),
            },
        ]
    }

    #[test]
    fn every_type_round_trips() {
        for frame in one_of_each() {
            round_trip(frame);
        }
    }

    #[test]
    fn truncated_input_consumes_nothing() {
        for frame in one_of_each() {
            let wire = encode(&frame);
            for cut in 0..wire.len() {
                let mut partial = wire.slice(..cut);
                assert_eq!(
                    Frame::decode(&mut partial, MAX),
                    Ok(None),
                    "{frame:?} cut at {cut}"
                );
                assert_eq!(partial.len(), cut, "consumed bytes of an incomplete frame");
            }
        }
    }

    #[test]
    fn payloads_share_the_input_buffer() {
        let mut wire = raw(ty::DATA, 0, 1, b"zero copy");
        let start = wire.as_ptr() as usize;
        let Some(Frame::Data { payload, .. }) = Frame::decode(&mut wire, MAX).expect("decodes")
        else {
            panic!("not DATA");
        };
        assert_eq!(payload.as_ptr() as usize, start + FrameHeader::LEN);
    }

    #[test]
    fn length_is_checked_from_the_header_alone() {
        let mut header_only = BytesMut::new();
        FrameHeader {
            length: MAX + 1,
            kind: ty::DATA,
            flags: 0,
            stream: StreamId(1),
        }
        .encode(&mut header_only);
        let mut wire = header_only.freeze();
        assert_eq!(
            Frame::decode(&mut wire, MAX),
            Err(DecodeError::FrameTooLarge {
                length: MAX + 1,
                max: MAX
            })
        );
    }

    #[test]
    fn unknown_types_are_skipped_but_bounded() {
        let mut wire = BytesMut::new();
        wire.put_slice(&raw(200, 0xff, 3, b"future stuff"));
        wire.put_slice(&encode(&Frame::Reset {
            stream: StreamId(1),
            code: 8,
        }));
        let mut wire = wire.freeze();
        assert_eq!(
            Frame::decode(&mut wire, MAX),
            Ok(Some(Frame::Reset {
                stream: StreamId(1),
                code: 8
            }))
        );
        assert!(wire.is_empty());

        let mut big = raw(200, 0, 0, &[0; 100]);
        assert!(matches!(
            Frame::decode(&mut big, 99),
            Err(DecodeError::FrameTooLarge { .. })
        ));

        let mut alone = raw(201, 0, 0, b"x");
        assert_eq!(Frame::decode(&mut alone, MAX), Ok(None));
        assert!(alone.is_empty(), "a complete unknown frame is consumed");
    }

    #[test]
    fn reserved_stream_bit_is_ignored() {
        let mut wire = raw(ty::RESET, 0, 0x8000_0005, &[0, 0, 0, 1]);
        assert_eq!(
            Frame::decode(&mut wire, MAX),
            Ok(Some(Frame::Reset {
                stream: StreamId(5),
                code: 1
            }))
        );
    }

    #[test]
    fn settings_ignore_unknown_ids_and_default_missing_ones() {
        let mut payload = Vec::new();
        payload.extend_from_slice(&[0x12, 0x34, 0, 0, 0, 9]);
        payload.extend_from_slice(&[0, 4, 0, 0, 0, 10]);
        let mut wire = raw(ty::SETTINGS, 0, 0, &payload);
        let expected = Settings {
            max_concurrent_streams: 10,
            ..Settings::default()
        };
        assert_eq!(
            Frame::decode(&mut wire, MAX),
            Ok(Some(Frame::Settings(expected)))
        );
    }

    #[test]
    fn malformed_payloads_are_errors() {
        let long_reason = vec![b'x'; MAX_REASON_LEN + 1];
        let mut refuse_long = vec![0, 0, 0, 1];
        refuse_long.extend_from_slice(&long_reason);
        let mut goaway_utf8 = vec![0; 8];
        goaway_utf8.extend_from_slice(&[0xff, 0xfe]);
        let too_many_settings = vec![0; 6 * (MAX_SETTINGS_ENTRIES + 1)];
        let cases: Vec<(&str, Bytes)> = vec![
            ("hello short", raw(ty::HELLO, 0, 0, b"TTHR\0\x01")),
            ("hello on stream", raw(ty::HELLO, 0, 1, b"TTHR\0\x01\0\x01")),
            ("hello min>max", raw(ty::HELLO, 0, 0, b"TTHR\0\x02\0\x01")),
            (
                "settings odd length",
                raw(ty::SETTINGS, 0, 0, &[0, 1, 0, 0, 0]),
            ),
            (
                "settings too many",
                raw(ty::SETTINGS, 0, 0, &too_many_settings),
            ),
            (
                "settings zero window",
                raw(ty::SETTINGS, 0, 0, &[0, 1, 0, 0, 0, 0]),
            ),
            (
                "settings window overflow",
                raw(ty::SETTINGS, 0, 0, &[0, 2, 0x80, 0, 0, 0]),
            ),
            (
                "settings tiny frame size",
                raw(ty::SETTINGS, 0, 0, &[0, 3, 0, 0, 0, 1]),
            ),
            ("open short", raw(ty::OPEN, 0, 1, &[0, 1, 0])),
            ("open on stream 0", raw(ty::OPEN, 0, 0, &[0; 7])),
            ("accept on stream 0", raw(ty::ACCEPT, 0, 0, b"")),
            ("refuse short", raw(ty::REFUSE, 0, 1, &[0, 0])),
            ("refuse long reason", raw(ty::REFUSE, 0, 1, &refuse_long)),
            ("data on stream 0", raw(ty::DATA, 0, 0, b"x")),
            (
                "window update zero",
                raw(ty::WINDOW_UPDATE, 0, 1, &[0, 0, 0, 0]),
            ),
            (
                "window update huge",
                raw(ty::WINDOW_UPDATE, 0, 1, &[0x80, 0, 0, 0]),
            ),
            ("window update short", raw(ty::WINDOW_UPDATE, 0, 1, &[0, 1])),
            ("reset long", raw(ty::RESET, 0, 1, &[0, 0, 0, 0, 0])),
            ("reset on stream 0", raw(ty::RESET, 0, 0, &[0, 0, 0, 0])),
            ("ping short", raw(ty::PING, 0, 0, &[0; 7])),
            ("ping on stream", raw(ty::PING, 0, 1, &[0; 8])),
            ("goaway short", raw(ty::GOAWAY, 0, 0, &[0; 7])),
            ("goaway bad utf8", raw(ty::GOAWAY, 0, 0, &goaway_utf8)),
        ];
        for (name, mut wire) in cases {
            assert!(
                matches!(
                    Frame::decode(&mut wire, MAX),
                    Err(DecodeError::Malformed { .. })
                ),
                "{name} was accepted"
            );
        }
        let mut bad_magic = raw(ty::HELLO, 0, 0, b"HTTP\0\x01\0\x01");
        assert_eq!(
            Frame::decode(&mut bad_magic, MAX),
            Err(DecodeError::BadMagic)
        );
    }

    #[test]
    fn hello_tolerates_trailing_bytes() {
        let mut wire = raw(ty::HELLO, 0, 0, b"TTHR\0\x01\0\x02future");
        assert_eq!(
            Frame::decode(&mut wire, MAX),
            Ok(Some(Frame::Hello {
                min_version: 1,
                max_version: 2
            }))
        );
    }

    fn stream_id() -> impl Strategy<Value = StreamId> {
        (1..=MAX_WINDOW).prop_map(StreamId)
    }

    fn reason() -> impl Strategy<Value = Bytes> {
        ".{0,64}".prop_map(|s: String| {
            let mut s = s;
            while s.len() > MAX_REASON_LEN {
                s.pop();
            }
            Bytes::from(s)
        })
    }

    fn blob() -> impl Strategy<Value = Bytes> {
        proptest::collection::vec(any::<u8>(), 0..300).prop_map(Bytes::from)
    }

    pub(crate) fn arb_frame() -> impl Strategy<Value = Frame> {
        prop_oneof![
            (any::<u16>(), any::<u16>()).prop_map(|(a, b)| Frame::Hello {
                min_version: a.min(b),
                max_version: a.max(b)
            }),
            (
                1..=MAX_WINDOW,
                1..=MAX_WINDOW,
                MIN_MAX_FRAME_SIZE..=MAX_FRAME_SIZE_LIMIT,
                any::<u32>()
            )
                .prop_map(|(w, c, f, n)| Frame::Settings(Settings {
                    initial_stream_window: w,
                    connection_window: c,
                    max_frame_size: f,
                    max_concurrent_streams: n,
                })),
            (stream_id(), any::<u16>(), any::<u8>(), any::<u32>(), blob()).prop_map(
                |(stream, kind, priority, deadline_ms, metadata)| {
                    Frame::Open {
                        stream,
                        kind,
                        priority,
                        deadline_ms,
                        metadata,
                    }
                }
            ),
            (stream_id(), blob()).prop_map(|(stream, metadata)| Frame::Accept { stream, metadata }),
            (stream_id(), any::<u32>(), reason()).prop_map(|(stream, code, reason)| {
                Frame::Refuse {
                    stream,
                    code,
                    reason,
                }
            }),
            (stream_id(), any::<bool>(), blob()).prop_map(|(stream, fin, payload)| Frame::Data {
                stream,
                fin,
                payload
            }),
            ((0..=MAX_WINDOW).prop_map(StreamId), 1..=MAX_WINDOW)
                .prop_map(|(stream, increment)| Frame::WindowUpdate { stream, increment }),
            (stream_id(), any::<u32>()).prop_map(|(stream, code)| Frame::Reset { stream, code }),
            (any::<bool>(), any::<[u8; 8]>()).prop_map(|(ack, data)| Frame::Ping { ack, data }),
            ((0..=MAX_WINDOW).prop_map(StreamId), any::<u32>(), reason()).prop_map(
                |(last_stream, code, reason)| Frame::GoAway {
                    last_stream,
                    code,
                    reason
                }
            ),
        ]
    }

    proptest! {
        #[test]
        fn arbitrary_frames_round_trip(frames in proptest::collection::vec(arb_frame(), 1..8), split in any::<usize>()) {
            let mut wire = BytesMut::new();
            for f in &frames {
                f.encode(&mut wire);
            }
            let wire = wire.freeze();
            // Decoding a prefix yields whole frames only; the rest decodes after the remainder arrives.
            let cut = split % (wire.len() + 1);
            let mut first = wire.slice(..cut);
            let mut decoded = Vec::new();
            while let Some(f) = Frame::decode(&mut first, MAX_FRAME_SIZE_LIMIT).expect("valid") {
                decoded.push(f);
            }
            let consumed = cut - first.len();
            let mut rest = wire.slice(consumed..);
            while let Some(f) = Frame::decode(&mut rest, MAX_FRAME_SIZE_LIMIT).expect("valid") {
                decoded.push(f);
            }
            prop_assert!(rest.is_empty());
            prop_assert_eq!(decoded, frames);
        }

        #[test]
        fn arbitrary_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..512), max in 0u32..1024) {
            let mut buf = Bytes::from(bytes);
            let before = buf.len();
            loop {
                let len = buf.len();
                match Frame::decode(&mut buf, max) {
                    Ok(Some(_)) => prop_assert!(buf.len() < len),
                    Ok(None) | Err(_) => break,
                }
            }
            prop_assert!(buf.len() <= before);
        }
    }
}
