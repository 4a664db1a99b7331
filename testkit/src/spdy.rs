//! A minimal SPDY/3.1 framing layer (draft-mbelshe-httpbis-spdy-00 as spoken by Go's `moby/spdystream`), enough
//! for the server side of `kubectl port-forward`: frames are decoded from and encoded into byte buffers, with no
//! I/O here. Header blocks are zlib streams with SPDY's preset dictionary, one compression context per direction
//! for the whole session.
//!
//! What it does not do: flow control (spdystream never sends WINDOW_UPDATE and ignores the ones it gets, so
//! neither side may wait for one), server push, priorities, or SETTINGS beyond ignoring them. No crate on
//! crates.io implements the server side of SPDY/3.1 (the one that exists opens stream pairs as a client), so this
//! is hand-written and kept small.

use bytes::{Buf, BufMut, Bytes, BytesMut};
use flate2::{Compress, Compression, Decompress, FlushCompress, FlushDecompress, Status};

/// The SPDY/3 header compression dictionary (section 2.6.10.1 of the draft), 1423 bytes.
const DICTIONARY: &[u8] = include_bytes!("spdy_dictionary.bin");
/// SPDY version 3 (3.1 differs only in flow control).
const VERSION: u16 = 3;
/// FLAG_FIN on SYN_STREAM, SYN_REPLY, HEADERS and DATA.
const FLAG_FIN: u8 = 0x01;
/// Largest header block accepted after decompression (a zip bomb stops here).
const MAX_HEADER_BLOCK: usize = 64 * 1024;
/// Largest frame payload accepted (DATA frames from Go are at most 32 KiB; the field allows 16 MiB).
const MAX_FRAME: usize = 1024 * 1024;

const SYN_STREAM: u16 = 1;
const SYN_REPLY: u16 = 2;
const RST_STREAM: u16 = 3;
const PING: u16 = 6;
const GOAWAY: u16 = 7;

/// A decoded frame. Control frames this server never acts on are [`Frame::Ignored`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Frame {
    /// A peer opened a stream.
    SynStream {
        /// The new stream.
        stream_id: u32,
        /// The peer will send nothing more on it.
        fin: bool,
        /// Its headers, names lowercase, multi-values joined by NUL as on the wire.
        headers: Vec<(String, String)>,
    },
    /// The answer to a SYN_STREAM.
    SynReply {
        /// The stream.
        stream_id: u32,
        /// No more data from the sender.
        fin: bool,
    },
    /// A stream was reset.
    RstStream {
        /// The stream.
        stream_id: u32,
        /// The status code.
        status: u32,
    },
    /// A ping, answered with the same id.
    Ping(u32),
    /// The peer is going away.
    GoAway,
    /// Data on a stream.
    Data {
        /// The stream.
        stream_id: u32,
        /// The last frame of the stream from this side.
        fin: bool,
        /// The payload.
        data: Bytes,
    },
    /// SETTINGS, HEADERS, WINDOW_UPDATE and unknown control frames.
    Ignored,
}

/// Why a byte stream is not SPDY/3.
#[derive(Debug, Clone, thiserror::Error, PartialEq, Eq)]
pub(crate) enum SpdyError {
    /// A control frame of another SPDY version.
    #[error("unsupported SPDY version {0}")]
    Version(u16),
    /// A frame longer than we accept.
    #[error("frame of {0} bytes is too large")]
    TooLarge(usize),
    /// A control frame shorter than its fixed fields.
    #[error("truncated control frame of type {0}")]
    Truncated(u16),
    /// The header block does not decompress or does not parse.
    #[error("bad header block: {0}")]
    HeaderBlock(&'static str),
}

/// Decodes frames from the peer; keeps the peer's header compression context.
pub(crate) struct Decoder {
    inflate: Decompress,
}

impl Decoder {
    pub(crate) fn new() -> Decoder {
        Decoder {
            inflate: Decompress::new(true),
        }
    }

    /// The next complete frame in `buf` (consumed), or None if more bytes are needed.
    pub(crate) fn decode(&mut self, buf: &mut BytesMut) -> Result<Option<Frame>, SpdyError> {
        if buf.len() < 8 {
            return Ok(None);
        }
        let first = u32::from_be_bytes([buf[0], buf[1], buf[2], buf[3]]);
        let flags = buf[4];
        let length = usize::from(buf[5]) << 16 | usize::from(buf[6]) << 8 | usize::from(buf[7]);
        if length > MAX_FRAME {
            return Err(SpdyError::TooLarge(length));
        }
        if buf.len() < 8 + length {
            return Ok(None);
        }
        buf.advance(8);
        let mut payload = buf.split_to(length).freeze();
        let fin = flags & FLAG_FIN != 0;
        if first & 0x8000_0000 == 0 {
            return Ok(Some(Frame::Data {
                stream_id: first & 0x7fff_ffff,
                fin,
                data: payload,
            }));
        }
        let version = ((first >> 16) & 0x7fff) as u16;
        let kind = (first & 0xffff) as u16;
        if version != VERSION {
            return Err(SpdyError::Version(version));
        }
        let need = match kind {
            SYN_STREAM => 10,
            SYN_REPLY | PING => 4,
            RST_STREAM | GOAWAY => 8,
            _ => 0,
        };
        if payload.len() < need {
            return Err(SpdyError::Truncated(kind));
        }
        Ok(Some(match kind {
            SYN_STREAM => {
                let stream_id = payload.get_u32() & 0x7fff_ffff;
                payload.advance(6); // associated stream, priority, slot
                let headers = self.header_block(&payload)?;
                Frame::SynStream {
                    stream_id,
                    fin,
                    headers,
                }
            }
            SYN_REPLY => {
                let stream_id = payload.get_u32() & 0x7fff_ffff;
                // Decompress to keep the shared context in step, even though the headers are not used.
                self.header_block(&payload)?;
                Frame::SynReply { stream_id, fin }
            }
            RST_STREAM => Frame::RstStream {
                stream_id: payload.get_u32() & 0x7fff_ffff,
                status: payload.get_u32(),
            },
            PING => Frame::Ping(payload.get_u32()),
            GOAWAY => Frame::GoAway,
            8 => {
                // HEADERS carries a compressed block too: decompress it to keep the context in step.
                if payload.len() >= 4 {
                    payload.advance(4);
                    self.header_block(&payload)?;
                }
                Frame::Ignored
            }
            _ => Frame::Ignored,
        }))
    }

    fn header_block(&mut self, compressed: &[u8]) -> Result<Vec<(String, String)>, SpdyError> {
        let mut out = Vec::with_capacity(1024);
        let mut input = compressed;
        while !input.is_empty() {
            if out.len() >= MAX_HEADER_BLOCK {
                return Err(SpdyError::HeaderBlock("too large"));
            }
            out.reserve(4096.min(MAX_HEADER_BLOCK - out.len()).max(1));
            let before = self.inflate.total_in();
            let produced_before = out.len();
            let result = self
                .inflate
                .decompress_vec(input, &mut out, FlushDecompress::Sync);
            let used = usize::try_from(self.inflate.total_in() - before).unwrap_or(usize::MAX);
            input = input.get(used..).unwrap_or_default();
            match result {
                Ok(Status::StreamEnd) => return Err(SpdyError::HeaderBlock("stream ended")),
                Ok(_) if used == 0 && out.len() == produced_before => {
                    return Err(SpdyError::HeaderBlock("no progress"));
                }
                Ok(_) => {}
                Err(e) if e.needs_dictionary().is_some() => self
                    .inflate
                    .set_dictionary(DICTIONARY)
                    .map(|_| ())
                    .map_err(|_| SpdyError::HeaderBlock("wrong dictionary"))?,
                Err(_) => return Err(SpdyError::HeaderBlock("corrupt zlib data")),
            }
        }
        parse_headers(&out)
    }
}

fn parse_headers(mut block: &[u8]) -> Result<Vec<(String, String)>, SpdyError> {
    let short = SpdyError::HeaderBlock("truncated");
    let string = |block: &mut &[u8]| -> Result<String, SpdyError> {
        if block.len() < 4 {
            return Err(short.clone());
        }
        let len = block.get_u32() as usize;
        if block.len() < len {
            return Err(short.clone());
        }
        let s = String::from_utf8_lossy(&block[..len]).into_owned();
        block.advance(len);
        Ok(s)
    };
    if block.len() < 4 {
        return Err(SpdyError::HeaderBlock("truncated"));
    }
    let count = block.get_u32();
    let mut headers = Vec::new();
    for _ in 0..count {
        let name = string(&mut block)?;
        let value = string(&mut block)?;
        headers.push((name.to_ascii_lowercase(), value));
    }
    Ok(headers)
}

/// Encodes frames to the peer; keeps our header compression context.
pub(crate) struct Encoder {
    deflate: Compress,
}

impl Encoder {
    pub(crate) fn new() -> Encoder {
        let mut deflate = Compress::new(Compression::default(), true);
        // Setting a dictionary on a fresh zlib stream cannot fail.
        let _ = deflate.set_dictionary(DICTIONARY);
        Encoder { deflate }
    }

    /// A SYN_REPLY with no headers.
    pub(crate) fn syn_reply(&mut self, stream_id: u32, fin: bool, out: &mut BytesMut) {
        let block = self.compress(&0u32.to_be_bytes());
        control_header(
            SYN_REPLY,
            if fin { FLAG_FIN } else { 0 },
            4 + block.len(),
            out,
        );
        out.put_u32(stream_id);
        out.put_slice(&block);
    }

    /// A SYN_STREAM with `headers` (what a client sends; for tests).
    #[cfg(test)]
    pub(crate) fn syn_stream(
        &mut self,
        stream_id: u32,
        fin: bool,
        headers: &[(&str, &str)],
        out: &mut BytesMut,
    ) {
        let mut raw = BytesMut::new();
        raw.put_u32(headers.len() as u32);
        for (name, value) in headers {
            raw.put_u32(name.len() as u32);
            raw.put_slice(name.as_bytes());
            raw.put_u32(value.len() as u32);
            raw.put_slice(value.as_bytes());
        }
        let block = self.compress(&raw);
        control_header(
            SYN_STREAM,
            if fin { FLAG_FIN } else { 0 },
            10 + block.len(),
            out,
        );
        out.put_u32(stream_id);
        out.put_u32(0);
        out.put_u16(0);
        out.put_slice(&block);
    }

    fn compress(&mut self, input: &[u8]) -> Vec<u8> {
        let mut out = Vec::with_capacity(input.len() + 64);
        let mut rest = input;
        loop {
            out.reserve(64);
            let before = self.deflate.total_in();
            // Compression into a Vec with spare room only fails on a corrupt stream state, never here.
            let _ = self
                .deflate
                .compress_vec(rest, &mut out, FlushCompress::Sync);
            let used = usize::try_from(self.deflate.total_in() - before).unwrap_or(usize::MAX);
            rest = rest.get(used..).unwrap_or_default();
            // Done when all input is in and the flush fit in the space we gave it.
            if rest.is_empty() && out.len() < out.capacity() {
                return out;
            }
        }
    }
}

/// A DATA frame.
pub(crate) fn data(stream_id: u32, fin: bool, payload: &[u8], out: &mut BytesMut) {
    out.put_u32(stream_id & 0x7fff_ffff);
    out.put_u8(if fin { FLAG_FIN } else { 0 });
    let len = payload.len().min(0xff_ffff);
    out.put_uint(len as u64, 3);
    out.put_slice(&payload[..len]);
}

/// A RST_STREAM frame.
pub(crate) fn rst_stream(stream_id: u32, status: u32, out: &mut BytesMut) {
    control_header(RST_STREAM, 0, 8, out);
    out.put_u32(stream_id);
    out.put_u32(status);
}

/// A PING frame.
pub(crate) fn ping(id: u32, out: &mut BytesMut) {
    control_header(PING, 0, 4, out);
    out.put_u32(id);
}

fn control_header(kind: u16, flags: u8, length: usize, out: &mut BytesMut) {
    out.put_u16(0x8000 | VERSION);
    out.put_u16(kind);
    out.put_u8(flags);
    out.put_uint(length as u64, 3);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dictionary_is_the_spdy3_one() {
        assert_eq!(DICTIONARY.len(), 1423);
        assert!(DICTIONARY.starts_with(b"\0\0\0\x07options"));
        assert!(DICTIONARY.ends_with(b"charset=utf-8charset=iso-8859-1,utf-,*,enq=0."));
    }

    #[test]
    fn frames_round_trip_across_many_header_blocks() -> Result<(), SpdyError> {
        let (mut enc, mut dec) = (Encoder::new(), Decoder::new());
        let mut wire = BytesMut::new();
        for id in [1u32, 3, 5] {
            let port = (8000 + id).to_string();
            enc.syn_stream(
                id,
                false,
                &[("streamtype", "data"), ("port", &port)],
                &mut wire,
            );
        }
        data(1, true, b"hello", &mut wire);
        ping(7, &mut wire);
        rst_stream(3, 5, &mut wire);
        enc.syn_reply(9, true, &mut wire);
        let mut frames = Vec::new();
        // Feed the bytes one at a time: partial frames must wait.
        let mut buf = BytesMut::new();
        for b in wire {
            buf.put_u8(b);
            while let Some(frame) = dec.decode(&mut buf)? {
                frames.push(frame);
            }
        }
        assert_eq!(frames.len(), 7);
        assert_eq!(
            frames[2],
            Frame::SynStream {
                stream_id: 5,
                fin: false,
                headers: vec![
                    ("streamtype".into(), "data".into()),
                    ("port".into(), "8005".into())
                ],
            }
        );
        assert_eq!(
            frames[3],
            Frame::Data {
                stream_id: 1,
                fin: true,
                data: Bytes::from_static(b"hello")
            }
        );
        assert_eq!(frames[4], Frame::Ping(7));
        assert_eq!(
            frames[5],
            Frame::RstStream {
                stream_id: 3,
                status: 5
            }
        );
        assert_eq!(
            frames[6],
            Frame::SynReply {
                stream_id: 9,
                fin: true
            }
        );
        Ok(())
    }

    #[test]
    fn garbage_is_an_error_not_a_panic() {
        let mut dec = Decoder::new();
        let mut bad = BytesMut::from(&b"\x80\x02\x00\x01\x00\x00\x00\x00"[..]);
        assert_eq!(dec.decode(&mut bad), Err(SpdyError::Version(2)));
        let mut huge = BytesMut::from(&b"\x00\x00\x00\x01\x00\xff\xff\xff"[..]);
        assert!(matches!(dec.decode(&mut huge), Err(SpdyError::TooLarge(_))));
        let mut junk_headers = BytesMut::new();
        control_header(SYN_STREAM, 0, 14, &mut junk_headers);
        junk_headers.put_slice(&[0, 0, 0, 1, 0, 0, 0, 0, 0, 0, 1, 2, 3, 4]);
        assert!(matches!(
            Decoder::new().decode(&mut junk_headers),
            Err(SpdyError::HeaderBlock(_))
        ));
        for n in 0..200u32 {
            let mut junk = BytesMut::new();
            control_header(SYN_STREAM, 0, 40, &mut junk);
            junk.extend((0..40u32).map(|i| (i.wrapping_mul(n).wrapping_add(31)) as u8));
            let _ = Decoder::new().decode(&mut junk);
        }
    }
}
