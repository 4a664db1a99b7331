//! Arbitrary bytes through the frame decoder: it must never panic, must consume only whole frames, and every
//! frame it returns must re-encode to bytes that decode to the same frame.

#![no_main]

use bytes::{Bytes, BytesMut};
use libfuzzer_sys::fuzz_target;
use tether_proto::Frame;

fuzz_target!(|data: &[u8]| {
    // The first byte picks the maximum payload, so that both the size check and large frames are explored.
    let (max, rest) = match data.split_first() {
        Some((m, rest)) => (u32::from(*m) * 257, rest),
        None => return,
    };
    let mut buf = Bytes::copy_from_slice(rest);
    loop {
        let before = buf.len();
        match Frame::decode(&mut buf, max) {
            Ok(Some(frame)) => {
                assert!(buf.len() < before, "a frame consumed nothing");
                let mut wire = BytesMut::new();
                frame.encode(&mut wire);
                assert_eq!(wire.len(), frame.encoded_len());
                let mut wire = wire.freeze();
                let again = Frame::decode(&mut wire, u32::MAX).expect("re-encoded frame decodes");
                assert_eq!(again.as_ref(), Some(&frame));
                assert!(wire.is_empty());
            }
            Ok(None) => break,
            Err(_) => break,
        }
    }
});
