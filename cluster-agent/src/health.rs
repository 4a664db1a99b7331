//! The agent's own health (the role of Arc's metrics agent): version, uptime, resident memory, CPU time,
//! reconnect count and tunnel round-trip time, as pushed in the control channel's `health` message.
//!
//! Memory and CPU come from procfs (`/proc/self/status` `VmRSS`, `/proc/self/stat` `utime + stime`); elsewhere
//! they read as 0. CPU ticks are converted with the usual `USER_HZ` of 100: the exact value needs
//! `sysconf(_SC_CLK_TCK)`, which is not reachable without unsafe code or another dependency, and Linux
//! fixes `USER_HZ` at 100 on every mainstream architecture.

use std::time::Duration;

use tether_api::control::Health;
use tokio::time::Instant;

/// Clock ticks per second in `/proc/self/stat`.
const USER_HZ: f64 = 100.0;

/// Builds a health report. `started` is when the agent started; `reconnects` how many times its tunnel was
/// re-established; `rtt` the tunnel's current round-trip estimate.
pub(crate) fn report(started: Instant, reconnects: u64, rtt: Option<Duration>) -> Health {
    Health {
        agent_version: env!("CARGO_PKG_VERSION").to_owned(),
        uptime_seconds: started.elapsed().as_secs(),
        memory_bytes: std::fs::read_to_string("/proc/self/status")
            .ok()
            .and_then(|s| rss_bytes(&s))
            .unwrap_or(0),
        cpu_seconds: std::fs::read_to_string("/proc/self/stat")
            .ok()
            .and_then(|s| cpu_seconds(&s))
            .unwrap_or(0.0),
        reconnects,
        tunnel_rtt_millis: rtt.map(|d| d.as_secs_f64() * 1000.0),
    }
}

/// `VmRSS:   12345 kB` → bytes.
fn rss_bytes(status: &str) -> Option<u64> {
    let line = status.lines().find(|l| l.starts_with("VmRSS:"))?;
    let mut parts = line["VmRSS:".len()..].split_whitespace();
    let value: u64 = parts.next()?.parse().ok()?;
    match parts.next() {
        Some("kB") | None => value.checked_mul(1024),
        Some(_) => None,
    }
}

/// Fields 14 and 15 (utime, stime) of `/proc/self/stat`, in seconds. The command name (field 2) is in
/// parentheses and may hold spaces or parentheses itself, so fields are counted after the last `)`.
fn cpu_seconds(stat: &str) -> Option<f64> {
    let (_, rest) = stat.rsplit_once(')')?;
    // rest starts at field 3 (state): utime is field 14, i.e. index 11 here.
    let mut fields = rest.split_whitespace().skip(11);
    let utime: u64 = fields.next()?.parse().ok()?;
    let stime: u64 = fields.next()?.parse().ok()?;
    Some(utime.saturating_add(stime) as f64 / USER_HZ)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_procfs_text() {
        let status = "Name:\ttether-agent\nVmPeak:\t  99999 kB\nVmRSS:\t   20480 kB\nThreads:\t4\n";
        assert_eq!(rss_bytes(status), Some(20 << 20));
        assert_eq!(rss_bytes("Name: x\n"), None);
        assert_eq!(rss_bytes("VmRSS: lots kB\n"), None);

        // A command name with spaces and a parenthesis must not shift the fields.
        let stat = "4242 (tether agent) x) S 1 4242 4242 0 -1 4194560 1234 0 0 0 250 130 0 0 20 0 4 0 100 1000000 500";
        assert_eq!(cpu_seconds(stat), Some(3.8));
        assert_eq!(cpu_seconds("garbage"), None);
        assert_eq!(cpu_seconds("1 (x) S 1 2"), None);
    }

    #[test]
    fn live_report_on_linux() {
        let started = Instant::now();
        let report = report(started, 3, Some(Duration::from_micros(1500)));
        assert_eq!(report.reconnects, 3);
        assert_eq!(report.tunnel_rtt_millis, Some(1.5));
        assert_eq!(report.agent_version, env!("CARGO_PKG_VERSION"));
        if cfg!(target_os = "linux") {
            assert!(report.memory_bytes > 0);
            assert!(report.cpu_seconds >= 0.0);
        }
        assert_eq!(super::report(started, 0, None).tunnel_rtt_millis, None);
    }
}
