//! Links the release `tether-agent` with its code laid out by use (`link-order.txt`, written by
//! `scripts/link-order.sh`): the functions an agent runs sit together at the start of `.text`. Without it they
//! are spread over the whole binary and the kernel, mapping 64 KiB of the cached file around every page an
//! agent touches, keeps nearly all of it resident: an idle agent's RSS followed the binary's size (18.3 MB),
//! not what it runs (11.9 MB with the order; docs/BENCHMARKS.md).
//!
//! Only where rustc links with its bundled LLD (x86_64-unknown-linux-gnu, the default since Rust 1.90), and
//! only for release-like profiles. `TETHER_LINK_ORDER=0` turns it off (for a build that links with GNU ld or
//! gold, which do not take `--symbol-ordering-file`). A stale file costs memory, never correctness: names it
//! lists that the binary lacks are skipped.

use std::env;
use std::path::PathBuf;

fn main() {
    println!("cargo:rerun-if-changed=link-order.txt");
    println!("cargo:rerun-if-env-changed=TETHER_LINK_ORDER");
    let wanted = env::var("TETHER_LINK_ORDER").map_or(true, |v| v != "0");
    let release = env::var("PROFILE").is_ok_and(|p| p == "release");
    let lld_target = env::var("TARGET").is_ok_and(|t| t == "x86_64-unknown-linux-gnu");
    let Some(dir) = env::var_os("CARGO_MANIFEST_DIR") else {
        return;
    };
    let order = PathBuf::from(dir).join("link-order.txt");
    if wanted && release && lld_target && order.is_file() {
        println!(
            "cargo:rustc-link-arg-bin=tether-agent=-Wl,--symbol-ordering-file={}",
            order.display()
        );
        println!("cargo:rustc-link-arg-bin=tether-agent=-Wl,--no-warn-symbol-ordering");
    }
}
