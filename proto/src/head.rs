//! HTTP heads as compact binary blocks, for streams of kind [`crate::kind::HTTP_HEADS`].
//!
//! A stream of that kind carries one HTTP exchange without any HTTP/1.1 text on the tunnel: the opener writes
//! a request **head block**, then the request body's bytes as they are (no chunked encoding), then finishes
//! its side; the acceptor answers with a response head block, then the response body's bytes, then finishes.
//! A body ends where its side of the stream ends. After a `101 Switching Protocols` answer the stream's bytes
//! both ways are the upgraded protocol's, untouched (the opener does not finish its side after an upgrade
//! request's head).
//!
//! Each head block is framed by a 4-byte big-endian length, then:
//!
//! ```text
//! request:  flags u8 | method len u8  | method | target len u16 | target (path and query) | fields
//! response: flags u8 | status u16                                                         | fields
//! fields:   count u16 | count × (name len u8 | name | value len u16 | value)
//! ```
//!
//! `flags` bit 0 ([`BODY`]) says a body follows the head; without it the body is empty and the reader need
//! not wait for the end of the stream to know it. Other bits must be zero. Names are sent as they are
//! (lowercase, as HTTP/2 requires, is the sender's business); neither names nor values are checked here
//! beyond their lengths: the HTTP layer that turns them into headers validates them.
//!
//! This module only encodes and decodes bytes (sans-IO).

use bytes::{Buf, BufMut, Bytes, BytesMut};

/// Flag: a body follows the head.
pub const BODY: u8 = 0x01;

/// Length of the frame before a head block.
pub const LENGTH_PREFIX: usize = 4;

/// Why a head block was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum HeadError {
    /// The block ends before a field it announces.
    #[error("head block truncated")]
    Truncated,
    /// Bytes left over after the last field.
    #[error("{0} bytes after the head block's last field")]
    Trailing(usize),
    /// Flag bits this version does not know.
    #[error("unknown head flags {0:#04x}")]
    UnknownFlags(u8),
    /// A name, method or target longer than its length field allows (encoding only).
    #[error("{0} too long for a head block")]
    TooLong(&'static str),
}

/// A decoded request head. The byte fields share the block's allocation.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RequestHead {
    /// [`BODY`] or 0.
    pub flags: u8,
    /// The method, e.g. `GET`.
    pub method: Bytes,
    /// Path and query, e.g. `/api/v1/namespaces?limit=500`.
    pub target: Bytes,
    /// Header fields in order (a name may repeat).
    pub fields: Vec<(Bytes, Bytes)>,
}

/// A decoded response head. The byte fields share the block's allocation.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ResponseHead {
    /// [`BODY`] or 0.
    pub flags: u8,
    /// The status code as sent (the HTTP layer checks its range).
    pub status: u16,
    /// Header fields in order (a name may repeat).
    pub fields: Vec<(Bytes, Bytes)>,
}

/// The bytes `fields` take in a head block: what [`encode_request`] and [`encode_response`] take as
/// `fields_len`, so that a block is one allocation of its size.
pub fn fields_len<'a>(fields: impl Iterator<Item = (&'a [u8], &'a [u8])>) -> usize {
    fields
        .map(|(name, value)| 3 + name.len() + value.len())
        .sum()
}

/// Encodes a request head block, length prefix included. `fields_len` is what the fields take
/// ([`fields_len`]): the block is allocated at its size up front (a wrong figure costs a reallocation, never
/// correctness).
pub fn encode_request<'a>(
    flags: u8,
    method: &[u8],
    target: &[u8],
    fields: impl Iterator<Item = (&'a [u8], &'a [u8])>,
    fields_len: usize,
) -> Result<Bytes, HeadError> {
    let method_len = u8::try_from(method.len()).map_err(|_| HeadError::TooLong("method"))?;
    let target_len = u16::try_from(target.len()).map_err(|_| HeadError::TooLong("target"))?;
    let mut buf = BytesMut::with_capacity(request_len(method, target, fields_len));
    buf.put_u32(0);
    buf.put_u8(flags);
    buf.put_u8(method_len);
    buf.put_slice(method);
    buf.put_u16(target_len);
    buf.put_slice(target);
    put_fields(&mut buf, fields)?;
    finish(buf)
}

/// Encodes a response head block, length prefix included; `fields_len` as for [`encode_request`].
pub fn encode_response<'a>(
    flags: u8,
    status: u16,
    fields: impl Iterator<Item = (&'a [u8], &'a [u8])>,
    fields_len: usize,
) -> Result<Bytes, HeadError> {
    let mut buf = BytesMut::with_capacity(response_len(fields_len));
    buf.put_u32(0);
    buf.put_u8(flags);
    buf.put_u16(status);
    put_fields(&mut buf, fields)?;
    finish(buf)
}

/// Decodes a request head block (without its length prefix).
pub fn decode_request(block: Bytes) -> Result<RequestHead, HeadError> {
    let mut r = Reader { buf: block, at: 0 };
    let flags = flags(r.u8()?)?;
    let method_len = usize::from(r.u8()?);
    let method = r.take(method_len)?;
    let target_len = usize::from(r.u16()?);
    let target = r.take(target_len)?;
    let fields = r.fields()?;
    r.end()?;
    Ok(RequestHead {
        flags,
        method,
        target,
        fields,
    })
}

/// Decodes a response head block (without its length prefix).
pub fn decode_response(block: Bytes) -> Result<ResponseHead, HeadError> {
    let mut r = Reader { buf: block, at: 0 };
    let flags = flags(r.u8()?)?;
    let status = r.u16()?;
    let fields = r.fields()?;
    r.end()?;
    Ok(ResponseHead {
        flags,
        status,
        fields,
    })
}

/// The length a block's 4-byte prefix announces.
pub fn block_length(prefix: [u8; LENGTH_PREFIX]) -> usize {
    u32::from_be_bytes(prefix) as usize
}

fn flags(flags: u8) -> Result<u8, HeadError> {
    if flags & !BODY != 0 {
        return Err(HeadError::UnknownFlags(flags));
    }
    Ok(flags)
}

/// A request block's size, prefix included: flags, method length, method, target length, target, field count,
/// fields.
fn request_len(method: &[u8], target: &[u8], fields_len: usize) -> usize {
    LENGTH_PREFIX + 1 + 1 + method.len() + 2 + target.len() + 2 + fields_len
}

/// A response block's size, prefix included: flags, status, field count, fields.
fn response_len(fields_len: usize) -> usize {
    LENGTH_PREFIX + 1 + 2 + 2 + fields_len
}

fn put_fields<'a>(
    buf: &mut BytesMut,
    fields: impl Iterator<Item = (&'a [u8], &'a [u8])>,
) -> Result<(), HeadError> {
    let count_at = buf.len();
    buf.put_u16(0);
    let mut count: u16 = 0;
    for (name, value) in fields {
        count = count
            .checked_add(1)
            .ok_or(HeadError::TooLong("header list"))?;
        let name_len = u8::try_from(name.len()).map_err(|_| HeadError::TooLong("header name"))?;
        let value_len =
            u16::try_from(value.len()).map_err(|_| HeadError::TooLong("header value"))?;
        buf.put_u8(name_len);
        buf.put_slice(name);
        buf.put_u16(value_len);
        buf.put_slice(value);
    }
    buf[count_at..count_at + 2].copy_from_slice(&count.to_be_bytes());
    Ok(())
}

fn finish(mut buf: BytesMut) -> Result<Bytes, HeadError> {
    let len = u32::try_from(buf.len() - LENGTH_PREFIX).map_err(|_| HeadError::TooLong("head"))?;
    buf[..LENGTH_PREFIX].copy_from_slice(&len.to_be_bytes());
    Ok(buf.freeze())
}

struct Reader {
    buf: Bytes,
    at: usize,
}

impl Reader {
    fn take(&mut self, n: usize) -> Result<Bytes, HeadError> {
        let end = self.at.checked_add(n).ok_or(HeadError::Truncated)?;
        if end > self.buf.len() {
            return Err(HeadError::Truncated);
        }
        let out = self.buf.slice(self.at..end);
        self.at = end;
        Ok(out)
    }

    fn u8(&mut self) -> Result<u8, HeadError> {
        Ok(self.take(1)?.get_u8())
    }

    fn u16(&mut self) -> Result<u16, HeadError> {
        Ok(self.take(2)?.get_u16())
    }

    fn fields(&mut self) -> Result<Vec<(Bytes, Bytes)>, HeadError> {
        let count = usize::from(self.u16()?);
        // Each field takes at least 3 bytes: a count past what is left is a lie, not a reason to allocate.
        if count.saturating_mul(3) > self.buf.len() - self.at {
            return Err(HeadError::Truncated);
        }
        let mut fields = Vec::with_capacity(count);
        for _ in 0..count {
            let name_len = usize::from(self.u8()?);
            let name = self.take(name_len)?;
            let value_len = usize::from(self.u16()?);
            let value = self.take(value_len)?;
            fields.push((name, value));
        }
        Ok(fields)
    }

    fn end(&self) -> Result<(), HeadError> {
        match self.buf.len() - self.at {
            0 => Ok(()),
            n => Err(HeadError::Trailing(n)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fields() -> Vec<(&'static [u8], &'static [u8])> {
        vec![
            (b"accept", b"application/json"),
            (b"x-many", b"1"),
            (b"x-many", b""),
        ]
    }

    #[test]
    fn request_heads_round_trip() {
        let f = fields();
        let fields_len = fields_len(f.iter().map(|(n, v)| (*n, *v)));
        let block = encode_request(
            BODY,
            b"POST",
            b"/api/v1/namespaces?x=1",
            f.iter().map(|(n, v)| (*n, *v)),
            fields_len,
        )
        .expect("encodes");
        let len = block_length(block[..4].try_into().expect("prefix"));
        assert_eq!(len, block.len() - LENGTH_PREFIX);
        // The size allocated up front is the block's.
        assert_eq!(
            block.len(),
            request_len(b"POST", b"/api/v1/namespaces?x=1", fields_len)
        );
        let head = decode_request(block.slice(LENGTH_PREFIX..)).expect("decodes");
        assert_eq!(head.flags, BODY);
        assert_eq!(&head.method[..], b"POST");
        assert_eq!(&head.target[..], b"/api/v1/namespaces?x=1");
        let got: Vec<(&[u8], &[u8])> = head.fields.iter().map(|(n, v)| (&n[..], &v[..])).collect();
        assert_eq!(got, f);
    }

    #[test]
    fn response_heads_round_trip() {
        let f = fields();
        let fields_len = fields_len(f.iter().map(|(n, v)| (*n, *v)));
        let block =
            encode_response(0, 101, f.iter().map(|(n, v)| (*n, *v)), fields_len).expect("encodes");
        assert_eq!(block.len(), response_len(fields_len));
        let head = decode_response(block.slice(LENGTH_PREFIX..)).expect("decodes");
        assert_eq!((head.flags, head.status), (0, 101));
        assert_eq!(head.fields.len(), 3);
    }

    #[test]
    fn every_truncation_and_trailing_byte_is_refused() {
        let f = fields();
        let block = encode_request(0, b"GET", b"/", f.iter().map(|(n, v)| (*n, *v)), 0)
            .expect("encodes")
            .slice(LENGTH_PREFIX..);
        for cut in 0..block.len() {
            assert_eq!(
                decode_request(block.slice(..cut)),
                Err(HeadError::Truncated),
                "cut at {cut}"
            );
        }
        let mut longer = BytesMut::from(&block[..]);
        longer.put_u8(0);
        assert_eq!(decode_request(longer.freeze()), Err(HeadError::Trailing(1)));
    }

    #[test]
    fn unknown_flags_and_lying_counts_are_refused_without_allocating() {
        assert_eq!(
            decode_response(Bytes::from_static(&[0x02, 0, 200, 0, 0])),
            Err(HeadError::UnknownFlags(2))
        );
        // 65,535 fields announced in 5 bytes.
        assert_eq!(
            decode_response(Bytes::from_static(&[0, 0, 200, 0xff, 0xff])),
            Err(HeadError::Truncated)
        );
    }

    #[test]
    fn oversized_parts_are_refused_when_encoding() {
        let long = vec![b'a'; 300];
        assert_eq!(
            encode_request(0, &long, b"/", std::iter::empty(), 0),
            Err(HeadError::TooLong("method"))
        );
        let value = vec![b'v'; 70_000];
        assert_eq!(
            encode_response(0, 200, std::iter::once((&b"x"[..], &value[..])), 0),
            Err(HeadError::TooLong("header value"))
        );
    }
}
