//! The `tether-loadtest` command line: bad flags exit 64 with clap's message; `--help` exits 0.

use std::process::Command;

#[test]
fn bad_flags_exit_64_and_help_exits_0() -> anyhow::Result<()> {
    let bin = env!("CARGO_BIN_EXE_tether-loadtest");
    let out = Command::new(bin).arg("--no-such-flag").output()?;
    assert_eq!(out.status.code(), Some(64));
    assert!(!out.stderr.is_empty(), "no message for a bad flag");
    // A storm faster than the load generator can pace is refused before anything starts.
    let out = Command::new(bin)
        .args(["requests", "--storm-rate", "200000"])
        .output()?;
    assert_eq!(out.status.code(), Some(64));
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("--storm-rate"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let out = Command::new(bin).arg("--help").output()?;
    assert_eq!(out.status.code(), Some(0));
    assert!(!out.stdout.is_empty(), "--help printed nothing");
    Ok(())
}
