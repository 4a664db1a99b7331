//! Head blocks from an untrusted peer never panic, and what decodes encodes back to the same bytes.

#![no_main]

use bytes::Bytes;
use libfuzzer_sys::fuzz_target;
use tether_proto::head;

fuzz_target!(|data: &[u8]| {
    let block = Bytes::copy_from_slice(data);
    if let Ok(h) = head::decode_request(block.clone()) {
        let again = head::encode_request(
            h.flags,
            &h.method,
            &h.target,
            h.fields.iter().map(|(n, v)| (&n[..], &v[..])),
            head::fields_len(h.fields.iter().map(|(n, v)| (&n[..], &v[..]))),
        )
        .expect("a decoded head encodes");
        assert_eq!(&again[head::LENGTH_PREFIX..], data);
    }
    if let Ok(h) = head::decode_response(block) {
        let fields = || h.fields.iter().map(|(n, v)| (&n[..], &v[..]));
        let again = head::encode_response(h.flags, h.status, fields(), head::fields_len(fields()))
            .expect("a decoded head encodes");
        assert_eq!(&again[head::LENGTH_PREFIX..], data);
    }
});
