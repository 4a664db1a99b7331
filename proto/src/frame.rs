//! Frames and their codec.

use bytes::{Buf, BufMut, Bytes};

use crate::StreamId;

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

impl Frame {
    /// Decodes one frame from `buf`. Returns `Ok(None)` and consumes nothing when `buf` does not yet hold a
    /// whole frame. `max_payload` bounds the payload length accepted (checked before anything is buffered).
    pub fn decode(buf: &mut Bytes, max_payload: u32) -> Result<Option<Frame>, DecodeError> {
        let _ = (buf, max_payload);
        todo!("implemented by the proto work")
    }

    /// Appends the encoded frame to `buf`.
    pub fn encode(&self, buf: &mut impl BufMut) {
        let _ = buf;
        todo!("implemented by the proto work")
    }
}

#[allow(dead_code)]
fn _buf_is_used(b: &mut impl Buf) -> usize {
    b.remaining()
}
