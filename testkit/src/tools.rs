//! The external tools tests drive (kubectl, python3 with PyJWT, openssl, helm, PostgreSQL, …), and the binaries
//! cargo built for this run.
//!
//! A test that needs a tool calls [`require`]: where the tool is missing, the test fails when the environment
//! variable `CI` is set (CI installs every tool, so a missing one is a broken install, never a pass), and elsewhere
//! prints `SKIPPED: …` and returns `None` so a developer without the tool can still run the rest.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::OnceLock;

/// What a test needs and how to find out whether it is here.
#[derive(Debug, Clone, Copy)]
pub enum Tool {
    /// The real `kubectl` binary ([`crate::kubectl::binary`]).
    Kubectl,
    /// python3 with PyJWT and cryptography (tokens minted by an implementation independent of ours).
    PyJwt,
    /// The `openssl` command (independent certificate checks).
    Openssl,
}

impl Tool {
    fn name(self) -> &'static str {
        match self {
            Tool::Kubectl => "kubectl",
            Tool::PyJwt => "python3 with PyJWT and cryptography",
            Tool::Openssl => "openssl",
        }
    }

    /// The program to run, if the tool is here.
    fn probe(self) -> Option<PathBuf> {
        match self {
            Tool::Kubectl => {
                let bin = crate::kubectl::binary();
                runs(&bin, &["version", "--client"]).then_some(bin)
            }
            Tool::PyJwt => {
                let bin = PathBuf::from("python3");
                runs(&bin, &["-c", "import jwt, cryptography"]).then_some(bin)
            }
            Tool::Openssl => {
                let bin = PathBuf::from("openssl");
                runs(&bin, &["version"]).then_some(bin)
            }
        }
    }
}

/// Whether `bin args…` runs and exits 0.
fn runs(bin: &Path, args: &[&str]) -> bool {
    Command::new(bin)
        .args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

/// Whether this is a CI run (`CI` set and not empty or `false`/`0`).
pub fn in_ci() -> bool {
    std::env::var("CI").is_ok_and(|v| !v.is_empty() && v != "false" && v != "0")
}

/// The program for `tool`, or — where it is missing — a panic under CI and `None` (after printing why) elsewhere.
///
/// # Panics
/// Under CI, when the tool is missing: `scripts/install-test-deps.sh` installs every tool the tests need.
pub fn require(tool: Tool) -> Option<PathBuf> {
    if let Some(path) = tool.probe() {
        return Some(path);
    }
    skip_or_fail(&format!("{} is not installed", tool.name()))
}

/// Where a test cannot run for `reason`: a panic under CI, else prints `SKIPPED: reason` and returns `None`.
///
/// # Panics
/// Under CI.
pub fn skip_or_fail<T>(reason: &str) -> Option<T> {
    assert!(
        !in_ci(),
        "{reason}; under CI this is a failure (scripts/install-test-deps.sh installs what tests need)"
    );
    println!("SKIPPED: {reason} (run scripts/install-test-deps.sh)");
    None
}

/// The path of a workspace binary (`tether-agent`, `tether-sample-apiserver`, …) built for this very run.
///
/// Tests of one package cannot name another package's binaries through `CARGO_BIN_EXE_*`, and a binary left in
/// `target/` by an earlier build may be stale; so the first call asks cargo (the one running these tests) to
/// build the workspace's targets exactly as `scripts/test.sh` does (`--workspace --all-targets`, so the feature
/// resolution is the same and the build is a no-op after `cargo test --workspace --all-targets`), and the binary
/// is then taken from beside the test executable.
///
/// # Errors
/// When cargo cannot build, or the binary is not where cargo puts it.
pub fn workspace_binary(name: &str) -> Result<PathBuf, String> {
    static BUILT: OnceLock<Result<(), String>> = OnceLock::new();
    BUILT.get_or_init(build_workspace_binaries).clone()?;
    let exe =
        std::env::current_exe().map_err(|e| format!("cannot find the test executable: {e}"))?;
    // Test executables live in target/PROFILE/deps; binaries in target/PROFILE.
    let dir = exe
        .parent()
        .and_then(|deps| {
            if deps.ends_with("deps") {
                deps.parent()
            } else {
                Some(deps)
            }
        })
        .ok_or_else(|| format!("unexpected test executable path {}", exe.display()))?;
    let path = dir.join(name);
    if path.is_file() {
        Ok(path)
    } else {
        Err(format!("{} was not built by cargo", path.display()))
    }
}

fn build_workspace_binaries() -> Result<(), String> {
    let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
    let manifest = Path::new(env!("CARGO_MANIFEST_DIR")).join("../Cargo.toml");
    let release = std::env::current_exe()
        .ok()
        .is_some_and(|exe| exe.components().any(|c| c.as_os_str() == "release"));
    let mut command = Command::new(cargo);
    command
        .args([
            "build",
            "--quiet",
            "--workspace",
            "--all-targets",
            "--manifest-path",
        ])
        .arg(&manifest)
        .stdin(Stdio::null());
    if release {
        command.arg("--release");
    }
    let out = command
        .output()
        .map_err(|e| format!("cannot run cargo to build the workspace binaries: {e}"))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(format!(
            "cargo build --workspace --all-targets failed:\n{}",
            String::from_utf8_lossy(&out.stderr)
        ))
    }
}
