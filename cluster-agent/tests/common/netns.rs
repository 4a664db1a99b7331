//! A network namespace joined to the root namespace by a veth pair (a /30): tests put the agent in it and
//! drop some of its traffic with iptables (UDP to the relay, say). Needs root, `ip` and `iptables`.

use std::net::Ipv4Addr;
use std::process::{Command, Stdio};

fn sh(args: &[&str]) -> anyhow::Result<()> {
    let out = Command::new(args[0])
        .args(&args[1..])
        .stdin(Stdio::null())
        .output()?;
    anyhow::ensure!(
        out.status.success(),
        "`{}` failed: {}",
        args.join(" "),
        String::from_utf8_lossy(&out.stderr).trim()
    );
    Ok(())
}

/// Why namespaces cannot be made here, if they cannot.
pub fn available() -> Result<(), String> {
    if Command::new("iptables").arg("-V").output().is_err() {
        return Err("`iptables` is not installed".into());
    }
    // Unique per call: tests in one binary probe at the same time.
    static PROBES: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
    let n = PROBES.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let probe = format!("tether-agentprobe-{}-{n}", std::process::id());
    match Command::new("ip").args(["netns", "add", &probe]).output() {
        Ok(out) if out.status.success() => {
            let _ = Command::new("ip").args(["netns", "del", &probe]).status();
            Ok(())
        }
        Ok(out) => Err(format!(
            "`ip netns add` failed: {}",
            String::from_utf8_lossy(&out.stderr).trim()
        )),
        Err(e) => Err(format!("`ip` (iproute2) could not run: {e}")),
    }
}

/// The namespace and veth pair; removed on drop. `tag` (three letters) keeps tests apart.
pub struct Netns {
    pub name: String,
    host_if: String,
}

impl Netns {
    pub fn create(tag: &str, host_ip: Ipv4Addr, ns_ip: Ipv4Addr) -> anyhow::Result<Netns> {
        let id = std::process::id() % 100_000;
        let netns = Netns {
            name: format!("tether-{tag}-{id}"),
            host_if: format!("{tag}{id}h"),
        };
        let ns_if = format!("{tag}{id}c");
        sh(&["ip", "netns", "add", &netns.name])?;
        sh(&[
            "ip",
            "link",
            "add",
            &netns.host_if,
            "type",
            "veth",
            "peer",
            "name",
            &ns_if,
        ])?;
        sh(&["ip", "link", "set", &ns_if, "netns", &netns.name])?;
        sh(&[
            "ip",
            "addr",
            "add",
            &format!("{host_ip}/30"),
            "dev",
            &netns.host_if,
        ])?;
        sh(&["ip", "link", "set", &netns.host_if, "up"])?;
        netns.exec_ok(&["ip", "addr", "add", &format!("{ns_ip}/30"), "dev", &ns_if])?;
        netns.exec_ok(&["ip", "link", "set", &ns_if, "up"])?;
        netns.exec_ok(&["ip", "link", "set", "lo", "up"])?;
        Ok(netns)
    }

    /// Runs a command inside the namespace; it must succeed.
    pub fn exec_ok(&self, rest: &[&str]) -> anyhow::Result<()> {
        let mut args = vec!["ip", "netns", "exec", self.name.as_str()];
        args.extend_from_slice(rest);
        sh(&args)
    }

    /// A command for `program` inside the namespace, killed when dropped.
    pub fn command(&self, program: &std::path::Path) -> tokio::process::Command {
        let mut command = tokio::process::Command::new("ip");
        command
            .args(["netns", "exec", &self.name])
            .arg(program)
            .kill_on_drop(true);
        command
    }
}

impl Drop for Netns {
    fn drop(&mut self) {
        let _ = Command::new("ip")
            .args(["link", "del", &self.host_if])
            .status();
        let _ = Command::new("ip")
            .args(["netns", "del", &self.name])
            .status();
    }
}
