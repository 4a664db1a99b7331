//! Child processes (killed when dropped), free loopback ports, and per-process readings from /proc (RSS, CPU).

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;

use anyhow::{Context as _, bail};
use tokio::process::{Child, Command};
use tokio::time::Instant;

/// A child process that is killed when dropped. Its stderr (and stdout unless piped) go to a log file.
#[derive(Debug)]
pub struct Proc {
    name: String,
    child: Child,
    pid: u32,
    log: PathBuf,
}

impl Proc {
    /// Spawns `program args…`, optionally prefixed by a wrapper command line (e.g. `valgrind --tool=callgrind`),
    /// with stdout and stderr appended to `log`.
    pub fn spawn(
        name: &str,
        wrapper: Option<&str>,
        program: &Path,
        args: &[String],
        env: &[(&str, &str)],
        log: &Path,
    ) -> anyhow::Result<Self> {
        let mut command = match wrapper.map(str::split_whitespace) {
            Some(mut words) => match words.next() {
                Some(first) => {
                    let mut c = Command::new(first);
                    c.args(words).arg(program);
                    c
                }
                None => Command::new(program),
            },
            None => Command::new(program),
        };
        command.args(args);
        Self::spawn_command(name, command, env, log, false)
    }

    /// Spawns `command` with the environment additions; stdout is piped when `pipe_stdout`.
    pub fn spawn_command(
        name: &str,
        mut command: Command,
        env: &[(&str, &str)],
        log: &Path,
        pipe_stdout: bool,
    ) -> anyhow::Result<Self> {
        let file = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(log)
            .with_context(|| format!("cannot open {}", log.display()))?;
        let stdout: Stdio = if pipe_stdout {
            Stdio::piped()
        } else {
            file.try_clone()?.into()
        };
        for (k, v) in env {
            command.env(k, v);
        }
        command
            .stdin(Stdio::null())
            .stdout(stdout)
            .stderr(file)
            .kill_on_drop(true);
        let child = command
            .spawn()
            .with_context(|| format!("cannot start {name}"))?;
        let pid = child.id().context("child has no pid")?;
        // For profilers and humans: the pid next to the log (e.g. relay.log → relay.pid).
        let _ = std::fs::write(log.with_extension("pid"), format!("{pid}\n"));
        Ok(Self {
            name: name.to_owned(),
            child,
            pid,
            log: log.to_path_buf(),
        })
    }

    /// The process id.
    pub fn pid(&self) -> u32 {
        self.pid
    }

    /// The child, e.g. to take its piped stdout.
    pub fn child_mut(&mut self) -> &mut Child {
        &mut self.child
    }

    /// Fails with the end of the log if the process has exited.
    pub fn check_running(&mut self) -> anyhow::Result<()> {
        if let Some(status) = self.child.try_wait()? {
            bail!(
                "{} exited ({status}); last log lines:\n{}",
                self.name,
                tail(&self.log, 15)
            );
        }
        Ok(())
    }

    /// Sends SIGTERM, waits up to `grace`, then kills. Returns how long the process took to exit.
    pub async fn stop(mut self, grace: Duration) -> Duration {
        let start = Instant::now();
        signal(self.pid, "TERM").await;
        if tokio::time::timeout(grace, self.child.wait())
            .await
            .is_err()
        {
            let _ = self.child.kill().await;
        }
        start.elapsed()
    }

    /// Kills the process at once (SIGKILL) and reaps it.
    pub async fn kill(mut self) {
        let _ = self.child.kill().await;
    }

    /// Resident set size in KiB.
    pub fn rss_kib(&self) -> Option<u64> {
        rss_kib(self.pid)
    }

    /// User + system CPU time consumed so far.
    pub fn cpu(&self) -> Option<Duration> {
        cpu_time(self.pid)
    }
}

/// Sends `SIG<name>` to `pid` with the `kill` command (no unsafe code here).
pub async fn signal(pid: u32, name: &str) {
    let _ = Command::new("kill")
        .arg(format!("-{name}"))
        .arg(pid.to_string())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .await;
}

/// The last `n` lines of a log file.
pub fn tail(path: &Path, n: usize) -> String {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(n)..].join("\n")
}

/// A loopback port that was free a moment ago (bind to port 0, read it, release it).
pub fn free_port() -> anyhow::Result<u16> {
    let listener = std::net::TcpListener::bind("127.0.0.1:0")?;
    Ok(listener.local_addr()?.port())
}

/// Waits until `addr` accepts TCP connections.
pub async fn wait_tcp(addr: SocketAddr, limit: Duration) -> anyhow::Result<()> {
    let deadline = Instant::now() + limit;
    loop {
        if tokio::net::TcpStream::connect(addr).await.is_ok() {
            return Ok(());
        }
        if Instant::now() >= deadline {
            bail!("{addr} did not accept connections within {limit:?}");
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// VmRSS of `pid` in KiB, from /proc/PID/status.
pub fn rss_kib(pid: u32) -> Option<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    parse_rss_kib(&status)
}

fn parse_rss_kib(status: &str) -> Option<u64> {
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
}

/// utime + stime of `pid`, from /proc/PID/stat.
pub fn cpu_time(pid: u32) -> Option<Duration> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    parse_cpu_ticks(&stat).map(ticks_to_duration)
}

/// utime + stime of this process.
pub fn own_cpu_time() -> Option<Duration> {
    let stat = std::fs::read_to_string("/proc/self/stat").ok()?;
    parse_cpu_ticks(&stat).map(ticks_to_duration)
}

fn parse_cpu_ticks(stat: &str) -> Option<u64> {
    // The command name (field 2) may hold spaces and parentheses: fields are counted after the last ')'.
    let rest = &stat[stat.rfind(')')? + 1..];
    let fields: Vec<&str> = rest.split_whitespace().collect();
    // After ')': state is field 3, so utime (14) and stime (15) are at indices 11 and 12.
    let utime: u64 = fields.get(11)?.parse().ok()?;
    let stime: u64 = fields.get(12)?.parse().ok()?;
    Some(utime + stime)
}

fn ticks_to_duration(ticks: u64) -> Duration {
    Duration::from_secs_f64(ticks as f64 / clock_ticks() as f64)
}

/// Clock ticks per second (`getconf CLK_TCK`, 100 on Linux unless reconfigured).
fn clock_ticks() -> u64 {
    static TICKS: std::sync::OnceLock<u64> = std::sync::OnceLock::new();
    *TICKS.get_or_init(|| {
        std::process::Command::new("getconf")
            .arg("CLK_TCK")
            .output()
            .ok()
            .and_then(|o| String::from_utf8(o.stdout).ok())
            .and_then(|s| s.trim().parse().ok())
            .filter(|t| *t > 0)
            .unwrap_or(100)
    })
}

/// Raises this process's soft open-files limit to its hard limit (tunnels need one descriptor each).
pub fn raise_nofile_limit() -> u64 {
    rlimit::increase_nofile_limit(u64::MAX).unwrap_or(0)
}

/// Finds `name` next to `preferred` (a directory), else on PATH, else in ~/.cargo/bin.
pub fn find_program(name: &str, preferred: Option<&Path>) -> Option<PathBuf> {
    let mut dirs: Vec<PathBuf> = preferred.map(Path::to_path_buf).into_iter().collect();
    if let Some(path) = std::env::var_os("PATH") {
        dirs.extend(std::env::split_paths(&path));
    }
    if let Some(home) = std::env::var_os("HOME") {
        dirs.push(PathBuf::from(home).join(".cargo/bin"));
    }
    dirs.into_iter().map(|d| d.join(name)).find(|p| p.is_file())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_proc_status_and_stat() {
        let status = "Name:\ttether-relay\nVmPeak:\t  100 kB\nVmRSS:\t   12345 kB\nThreads:\t3\n";
        assert_eq!(parse_rss_kib(status), Some(12345));
        assert_eq!(parse_rss_kib("Name: x\n"), None);
        let stat =
            "4242 (tether (relay)) S 1 4242 4242 0 -1 4194560 100 0 0 0 250 50 0 0 20 0 3 0 1 2 3";
        assert_eq!(parse_cpu_ticks(stat), Some(300));
        assert_eq!(parse_cpu_ticks("garbage"), None);
    }

    #[test]
    fn own_process_is_readable() {
        assert!(rss_kib(std::process::id()).is_some_and(|kib| kib > 0));
        assert!(own_cpu_time().is_some());
    }
}
