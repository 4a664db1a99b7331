//! Runs the real `kubectl` binary for tests, isolated from the machine's own configuration.
//!
//! Each [`Kubectl`] owns a scratch directory used as `HOME` and as `--cache-dir` (kubectl caches discovery per
//! server URL, so a shared cache would leak between tests), and always passes `--kubeconfig`. Commands are async
//! (tokio::process), run with stdin closed unless given, and are killed if they outlive their deadline.
//!
//! ```no_run
//! # async fn demo(kubeconfig: &std::path::Path) -> Result<(), tether_testkit::TestkitError> {
//! use std::time::Duration;
//! use tether_testkit::kubectl::Kubectl;
//! let kubectl = Kubectl::new(kubeconfig)?;
//! let out = kubectl.run(&["get", "namespaces", "-o", "name"]).await?;
//! assert!(out.success(), "{out}");
//! let mut watch = kubectl.spawn(&["get", "configmaps", "--watch"])?;
//! let line = watch.wait_for_line(Duration::from_secs(30), |l| l.contains("my-cm")).await?;
//! # let _ = line; Ok(()) }
//! ```

use std::path::{Path, PathBuf};
use std::process::{ExitStatus, Stdio};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::io::{AsyncBufReadExt as _, AsyncReadExt as _, AsyncWriteExt as _, BufReader, Lines};
use tokio::process::{Child, ChildStdout, Command};

use crate::TestkitError;

/// Where the Google Cloud SDK keeps one kubectl per minor version (`/usr/bin/kubectl` there is a dispatcher).
const SDK_BIN: &str = "/usr/lib/google-cloud-sdk/bin";

/// `kubectl.1.NN` of the Google Cloud SDK, if installed (e.g. 1.29, the last kubectl that port-forwards over SPDY
/// without trying a WebSocket first).
pub fn versioned(minor: u32) -> Option<PathBuf> {
    let path = Path::new(SDK_BIN).join(format!("kubectl.1.{minor}"));
    path.is_file().then_some(path)
}

/// The kubectl binary to use: `$TETHER_KUBECTL` if set; else the newest `kubectl.1.NN` of the Google Cloud SDK;
/// else `kubectl` from `PATH`.
pub fn binary() -> PathBuf {
    if let Some(path) = std::env::var_os("TETHER_KUBECTL").filter(|p| !p.is_empty()) {
        return PathBuf::from(path);
    }
    newest_versioned(Path::new(SDK_BIN)).unwrap_or_else(|| PathBuf::from("kubectl"))
}

/// The `kubectl.1.NN` with the highest NN in `dir`.
fn newest_versioned(dir: &Path) -> Option<PathBuf> {
    std::fs::read_dir(dir)
        .ok()?
        .filter_map(Result::ok)
        .filter_map(|entry| {
            let name = entry.file_name().into_string().ok()?;
            let minor: u32 = name.strip_prefix("kubectl.1.")?.parse().ok()?;
            Some((minor, entry.path()))
        })
        .max_by_key(|(minor, _)| *minor)
        .map(|(_, path)| path)
}

/// The result of a finished kubectl command.
#[derive(Debug, Clone)]
pub struct Output {
    /// The exit status.
    pub status: ExitStatus,
    /// Standard output, lossily decoded as UTF-8.
    pub stdout: String,
    /// Standard error, lossily decoded as UTF-8.
    pub stderr: String,
}

impl Output {
    /// True if kubectl exited with status 0.
    pub fn success(&self) -> bool {
        self.status.success()
    }

    /// The exit code, None if killed by a signal.
    pub fn code(&self) -> Option<i32> {
        self.status.code()
    }
}

impl std::fmt::Display for Output {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "kubectl {}\n--- stdout ---\n{}\n--- stderr ---\n{}",
            self.status, self.stdout, self.stderr
        )
    }
}

/// A kubectl bound to one kubeconfig, with its own HOME and discovery cache.
#[derive(Debug)]
pub struct Kubectl {
    binary: PathBuf,
    kubeconfig: PathBuf,
    scratch: tempfile::TempDir,
    request_timeout: Duration,
    deadline: Duration,
}

impl Kubectl {
    /// A kubectl using [`binary()`] and `kubeconfig`, with a fresh scratch directory.
    pub fn new(kubeconfig: &Path) -> Result<Kubectl, TestkitError> {
        let scratch = tempfile::Builder::new()
            .prefix("tether-kubectl-")
            .tempdir()
            .map_err(|e| {
                TestkitError::Kubectl(format!("cannot create a scratch directory: {e}"))
            })?;
        Ok(Kubectl {
            binary: binary(),
            kubeconfig: kubeconfig.to_path_buf(),
            scratch,
            request_timeout: Duration::from_secs(30),
            deadline: Duration::from_secs(120),
        })
    }

    /// Uses another kubectl binary.
    pub fn with_binary(mut self, binary: impl Into<PathBuf>) -> Kubectl {
        self.binary = binary.into();
        self
    }

    /// `--request-timeout` for [`Kubectl::run`] (default 30 s). Not applied to [`Kubectl::spawn`], whose
    /// commands (watches, `logs -f`) are meant to outlive it.
    pub fn with_request_timeout(mut self, timeout: Duration) -> Kubectl {
        self.request_timeout = timeout;
        self
    }

    /// How long [`Kubectl::run`] lets a command live before killing it (default 120 s).
    pub fn with_deadline(mut self, deadline: Duration) -> Kubectl {
        self.deadline = deadline;
        self
    }

    /// The kubectl binary in use.
    pub fn binary(&self) -> &Path {
        &self.binary
    }

    /// The kubeconfig passed to every command.
    pub fn kubeconfig(&self) -> &Path {
        &self.kubeconfig
    }

    /// The scratch directory (HOME, and the discovery cache under `cache/`).
    pub fn scratch_dir(&self) -> &Path {
        self.scratch.path()
    }

    /// A command with the isolation flags and environment set; `args` come after the global flags.
    pub fn command(&self, args: &[&str], request_timeout: Option<Duration>) -> Command {
        let mut cmd = Command::new(&self.binary);
        cmd.arg(format!("--kubeconfig={}", self.kubeconfig.display()))
            .arg(format!(
                "--cache-dir={}",
                self.scratch.path().join("cache").display()
            ));
        if let Some(timeout) = request_timeout {
            cmd.arg(format!("--request-timeout={}s", timeout.as_secs().max(1)));
        }
        cmd.args(args)
            .env("HOME", self.scratch.path())
            .env_remove("KUBECONFIG")
            .env_remove("KUBECTL_KUBERC")
            .env("NO_COLOR", "1")
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .kill_on_drop(true);
        // Test servers listen on loopback; a proxy from the environment is never the way there.
        for var in [
            "HTTPS_PROXY",
            "https_proxy",
            "HTTP_PROXY",
            "http_proxy",
            "ALL_PROXY",
            "all_proxy",
        ] {
            cmd.env_remove(var);
        }
        cmd
    }

    /// Runs `kubectl ARGS` to completion.
    pub async fn run(&self, args: &[&str]) -> Result<Output, TestkitError> {
        self.run_inner(args, None).await
    }

    /// Runs `kubectl ARGS` with `stdin` as its standard input (closed after it is written).
    pub async fn run_with_stdin(
        &self,
        args: &[&str],
        stdin: &[u8],
    ) -> Result<Output, TestkitError> {
        self.run_inner(args, Some(stdin)).await
    }

    async fn run_inner(&self, args: &[&str], stdin: Option<&[u8]>) -> Result<Output, TestkitError> {
        let mut cmd = self.command(args, Some(self.request_timeout));
        if stdin.is_some() {
            cmd.stdin(Stdio::piped());
        }
        let mut child = cmd.spawn().map_err(|e| spawn_error(&self.binary, e))?;
        if let (Some(bytes), Some(mut pipe)) = (stdin, child.stdin.take()) {
            let bytes = bytes.to_vec();
            // Written concurrently: a large input must not block while kubectl fills its output pipes.
            tokio::spawn(async move {
                let _ = pipe.write_all(&bytes).await;
                let _ = pipe.shutdown().await;
            });
        }
        let described = args.join(" ");
        match tokio::time::timeout(self.deadline, child.wait_with_output()).await {
            Ok(Ok(out)) => Ok(Output {
                status: out.status,
                stdout: String::from_utf8_lossy(&out.stdout).into_owned(),
                stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
            }),
            Ok(Err(e)) => Err(TestkitError::Kubectl(format!(
                "waiting for `kubectl {described}`: {e}"
            ))),
            // Dropping the future drops the child, which kill_on_drop kills.
            Err(_) => Err(TestkitError::Timeout(format!(
                "`kubectl {described}` still running after {:?}",
                self.deadline
            ))),
        }
    }

    /// Starts a long-running `kubectl ARGS` (`get -w`, `logs -f`); its stdout lines can be awaited.
    pub fn spawn(&self, args: &[&str]) -> Result<KubectlChild, TestkitError> {
        let mut child = self
            .command(args, None)
            .spawn()
            .map_err(|e| spawn_error(&self.binary, e))?;
        let stdout = child
            .stdout
            .take()
            .ok_or_else(|| TestkitError::Kubectl("no stdout pipe".into()))?;
        let stderr_text = Arc::new(Mutex::new(String::new()));
        if let Some(mut stderr) = child.stderr.take() {
            let sink = stderr_text.clone();
            tokio::spawn(async move {
                let mut buf = [0u8; 4096];
                while let Ok(n) = stderr.read(&mut buf).await {
                    if n == 0 {
                        break;
                    }
                    if let Ok(mut text) = sink.lock() {
                        text.push_str(&String::from_utf8_lossy(&buf[..n]));
                    }
                }
            });
        }
        Ok(KubectlChild {
            child,
            lines: BufReader::new(stdout).lines(),
            seen: Vec::new(),
            stderr: stderr_text,
            command: args.join(" "),
        })
    }
}

fn spawn_error(binary: &Path, e: std::io::Error) -> TestkitError {
    TestkitError::Kubectl(format!("cannot start {}: {e}", binary.display()))
}

/// A running kubectl whose stdout is read line by line. Killed when dropped.
#[derive(Debug)]
pub struct KubectlChild {
    child: Child,
    lines: Lines<BufReader<ChildStdout>>,
    seen: Vec<String>,
    stderr: Arc<Mutex<String>>,
    command: String,
}

impl KubectlChild {
    /// The next stdout line, None at end of output; an error if none comes within `timeout`.
    pub async fn next_line(&mut self, timeout: Duration) -> Result<Option<String>, TestkitError> {
        match tokio::time::timeout(timeout, self.lines.next_line()).await {
            Ok(Ok(Some(line))) => {
                self.seen.push(line.clone());
                Ok(Some(line))
            }
            Ok(Ok(None)) => Ok(None),
            Ok(Err(e)) => Err(TestkitError::Kubectl(format!(
                "reading `kubectl {}`: {e}",
                self.command
            ))),
            Err(_) => Err(self.timeout_error(timeout, "no line")),
        }
    }

    /// Reads lines until one satisfies `matches` (returned) within `timeout` overall; an error (with every line
    /// and the stderr seen so far) on timeout or end of output.
    pub async fn wait_for_line(
        &mut self,
        timeout: Duration,
        mut matches: impl FnMut(&str) -> bool,
    ) -> Result<String, TestkitError> {
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            let left = deadline.saturating_duration_since(tokio::time::Instant::now());
            match self.next_line(left).await {
                Ok(Some(line)) if matches(&line) => return Ok(line),
                Ok(Some(_)) => {}
                Ok(None) => {
                    return Err(self.timeout_error(timeout, "output ended before a matching line"));
                }
                Err(TestkitError::Timeout(_)) => {
                    return Err(self.timeout_error(timeout, "no matching line"));
                }
                Err(e) => return Err(e),
            }
        }
    }

    /// For `kubectl port-forward … :REMOTE`: waits for `Forwarding from 127.0.0.1:LOCAL -> REMOTE` and returns
    /// the local address.
    pub async fn forwarded_address(
        &mut self,
        timeout: Duration,
    ) -> Result<std::net::SocketAddr, TestkitError> {
        let line = self
            .wait_for_line(timeout, |l| l.starts_with("Forwarding from 127.0.0.1:"))
            .await?;
        line.strip_prefix("Forwarding from ")
            .and_then(|rest| rest.split_whitespace().next())
            .and_then(|addr| addr.parse().ok())
            .ok_or_else(|| TestkitError::Kubectl(format!("unexpected port-forward line {line:?}")))
    }

    /// Every stdout line read so far.
    pub fn lines_seen(&self) -> &[String] {
        &self.seen
    }

    /// Standard error so far.
    pub fn stderr(&self) -> String {
        self.stderr.lock().map(|s| s.clone()).unwrap_or_default()
    }

    /// Kills kubectl and waits for it to exit; returns the exit status.
    pub async fn kill(mut self) -> Result<ExitStatus, TestkitError> {
        let _ = self.child.start_kill();
        self.child.wait().await.map_err(|e| {
            TestkitError::Kubectl(format!("waiting for `kubectl {}`: {e}", self.command))
        })
    }

    /// Waits for kubectl to exit by itself within `timeout`.
    pub async fn wait(mut self, timeout: Duration) -> Result<ExitStatus, TestkitError> {
        self.wait_exit(timeout).await
    }

    /// Like [`KubectlChild::wait`], keeping the child (its stderr stays readable afterwards).
    pub async fn wait_exit(&mut self, timeout: Duration) -> Result<ExitStatus, TestkitError> {
        match tokio::time::timeout(timeout, self.child.wait()).await {
            Ok(Ok(status)) => Ok(status),
            Ok(Err(e)) => Err(TestkitError::Kubectl(format!(
                "waiting for `kubectl {}`: {e}",
                self.command
            ))),
            Err(_) => Err(self.timeout_error(timeout, "still running")),
        }
    }

    fn timeout_error(&self, timeout: Duration, what: &str) -> TestkitError {
        TestkitError::Timeout(format!(
            "`kubectl {}`: {what} within {timeout:?}; stdout so far: {:?}; stderr: {:?}",
            self.command,
            self.seen,
            self.stderr()
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn picks_the_newest_versioned_binary() -> std::io::Result<()> {
        let dir = tempfile::tempdir()?;
        for name in [
            "kubectl",
            "kubectl.1.9",
            "kubectl.1.33",
            "kubectl.1.30",
            "kubectl.1.x",
        ] {
            std::fs::write(dir.path().join(name), b"")?;
        }
        assert_eq!(
            newest_versioned(dir.path()),
            Some(dir.path().join("kubectl.1.33"))
        );
        assert_eq!(newest_versioned(&dir.path().join("missing")), None);
        Ok(())
    }

    #[tokio::test]
    async fn commands_are_isolated() -> Result<(), TestkitError> {
        let kubectl = Kubectl::new(Path::new("/nonexistent/kubeconfig"))?.with_binary("env");
        let out = kubectl.run(&[]).await;
        // `env` rejects kubectl's flags; what matters is that the command was built and run with our HOME.
        let cmd = kubectl.command(&["get", "pods"], Some(Duration::from_secs(5)));
        let args: Vec<String> = cmd
            .as_std()
            .get_args()
            .map(|a| a.to_string_lossy().into_owned())
            .collect();
        assert_eq!(args[0], "--kubeconfig=/nonexistent/kubeconfig");
        assert!(args[1].starts_with("--cache-dir=") && args[1].ends_with("/cache"));
        assert_eq!(args[2], "--request-timeout=5s");
        assert_eq!(&args[3..], ["get", "pods"]);
        let home = cmd
            .as_std()
            .get_envs()
            .find(|(k, _)| *k == "HOME")
            .and_then(|(_, v)| v.map(PathBuf::from));
        assert_eq!(home.as_deref(), Some(kubectl.scratch_dir()));
        assert!(out.is_ok());
        Ok(())
    }
}
