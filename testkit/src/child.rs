//! Tether's programs as child processes of a test: output appended to a log file, killed when dropped, SIGKILLed
//! on demand, their memory read from `/proc`.
//!
//! ```no_run
//! # async fn demo() -> Result<(), tether_testkit::child::ChildError> {
//! use tether_testkit::child::Child;
//! let command = tokio::process::Command::new("tether-relay");
//! let mut relay = Child::spawn("tether-relay", command, "/tmp/relay.log".as_ref(), "info")?;
//! relay.check_running()?; // an error quoting the end of its log if it exited
//! relay.kill().await?; // SIGKILL: no drain, no goodbye
//! # Ok(()) }
//! ```

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;

/// A child that could not be started, exited, or could not be read or killed; the text names it and, when it
/// exited, quotes the end of its log.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct ChildError(String);

/// How many lines of the log an exit quotes.
const LOG_TAIL: usize = 30;

/// A child process killed when dropped, its stdout and stderr appended to a log file.
#[derive(Debug)]
pub struct Child {
    name: String,
    child: tokio::process::Child,
    log: PathBuf,
}

impl Child {
    /// Starts `command` as `name` with `RUST_LOG=rust_log`, stdin closed, stdout and stderr appended to `log`,
    /// and no `HTTPS_PROXY` from the test's environment (the children talk to each other on loopback).
    pub fn spawn(
        name: &str,
        mut command: tokio::process::Command,
        log: &Path,
        rust_log: &str,
    ) -> Result<Child, ChildError> {
        let cannot = |e: std::io::Error| ChildError(format!("cannot start {name}: {e}"));
        let file = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(log)
            .map_err(cannot)?;
        command
            .env("RUST_LOG", rust_log)
            .env_remove("HTTPS_PROXY")
            .env_remove("https_proxy")
            .stdin(Stdio::null())
            .stdout(file.try_clone().map_err(cannot)?)
            .stderr(file)
            .kill_on_drop(true);
        let child = command.spawn().map_err(cannot)?;
        Ok(Child {
            name: name.to_owned(),
            child,
            log: log.to_path_buf(),
        })
    }

    /// Starts the sample apiserver: `command` runs `tether-sample-apiserver` (directly, or inside a network
    /// namespace) and is given `--dir dir --listen listen`; returns once the apiserver has written its
    /// kubeconfig and token into `dir`. One that exits first, or has not written them within `limit`, is an
    /// error quoting its log.
    pub async fn sample_apiserver(
        mut command: tokio::process::Command,
        dir: &Path,
        listen: &str,
        log: &Path,
        rust_log: &str,
        limit: Duration,
    ) -> Result<Child, ChildError> {
        command.arg("--dir").arg(dir).args(["--listen", listen]);
        let mut child = Child::spawn("tether-sample-apiserver", command, log, rust_log)?;
        let waited =
            crate::wait::until("the sample apiserver's kubeconfig and token", limit, || {
                let written = dir.join("kubeconfig").is_file() && dir.join("token").is_file();
                let exited = !matches!(child.child.try_wait(), Ok(None));
                async move { written || exited }
            })
            .await;
        child.check_running()?;
        waited.map_err(|e| ChildError(e.to_string()))?;
        Ok(child)
    }

    /// The process id, while it runs.
    pub fn pid(&self) -> Result<u32, ChildError> {
        self.child
            .id()
            .ok_or_else(|| ChildError(format!("{} has exited", self.name)))
    }

    /// Its log file.
    pub fn log(&self) -> &Path {
        &self.log
    }

    /// An error quoting the end of its log if it has exited.
    pub fn check_running(&mut self) -> Result<(), ChildError> {
        let status = self
            .child
            .try_wait()
            .map_err(|e| ChildError(format!("cannot wait for {}: {e}", self.name)))?;
        if let Some(status) = status {
            let log = std::fs::read_to_string(&self.log).unwrap_or_default();
            let tail: Vec<&str> = log.lines().rev().take(LOG_TAIL).collect();
            return Err(ChildError(format!(
                "{} exited ({status}); its log ends:\n{}",
                self.name,
                tail.into_iter().rev().collect::<Vec<_>>().join("\n")
            )));
        }
        Ok(())
    }

    /// SIGKILL, then waits for it: no drain, no GOAWAY, no goodbye; its sockets just close.
    pub async fn kill(&mut self) -> Result<(), ChildError> {
        let failed = |e: std::io::Error| ChildError(format!("cannot kill {}: {e}", self.name));
        self.child.start_kill().map_err(failed)?;
        self.child.wait().await.map_err(failed)?;
        Ok(())
    }

    /// Resident memory (`VmRSS`) in bytes.
    pub fn rss(&self) -> Result<u64, ChildError> {
        let path = format!("/proc/{}/status", self.pid()?);
        let status = std::fs::read_to_string(&path)
            .map_err(|e| ChildError(format!("cannot read {path}: {e}")))?;
        status
            .lines()
            .find_map(|l| l.strip_prefix("VmRSS:"))
            .and_then(|v| v.split_whitespace().next())
            .and_then(|v| v.parse::<u64>().ok())
            .map(|kib| kib * 1024)
            .ok_or_else(|| ChildError(format!("no VmRSS in {path}")))
    }
}
