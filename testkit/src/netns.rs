//! Test support: a network namespace joined to the root namespace by a veth pair (a /30), for tests that put
//! the agent behind a firewall — one that accepts no inbound connection ([`Netns::refusing_inbound`]), or one
//! whose rules the test adds (UDP to the relay dropped, say). Needs root, `ip` and `iptables`.

use std::net::Ipv4Addr;
use std::path::Path;
use std::process::{Command, Stdio};

/// Runs `args`; it must succeed.
pub fn sh(args: &[&str]) -> anyhow::Result<()> {
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
    if Command::new("ip").arg("-V").output().is_err() {
        return Err("`ip` (iproute2) is not installed".into());
    }
    if Command::new("iptables").arg("-V").output().is_err() {
        return Err("`iptables` is not installed".into());
    }
    // Unique per call: tests in one binary probe at the same time.
    static PROBES: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
    let n = PROBES.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let probe = format!("tether-probe-{}-{n}", std::process::id());
    match Command::new("ip").args(["netns", "add", &probe]).output() {
        Ok(out) if out.status.success() => {
            let _ = Command::new("ip").args(["netns", "del", &probe]).status();
            Ok(())
        }
        Ok(out) => Err(format!(
            "`ip netns add` failed: {}",
            String::from_utf8_lossy(&out.stderr).trim()
        )),
        Err(e) => Err(format!("`ip netns add` could not run: {e}")),
    }
}

/// The namespace and veth pair; removed on drop.
pub struct Netns {
    /// The namespace's name (`ip netns exec NAME …`).
    pub name: String,
    host_if: String,
}

impl Netns {
    /// `tag` (three letters) keeps names apart between test binaries running at once; `host_ip` is the root
    /// namespace's end of the veth, `cluster_ip` the namespace's (same /30).
    pub fn create(tag: &str, host_ip: Ipv4Addr, cluster_ip: Ipv4Addr) -> anyhow::Result<Netns> {
        let id = std::process::id() % 100_000;
        let netns = Netns {
            name: format!("tether-{tag}-{id}"),
            host_if: format!("{tag}{id}h"),
        };
        let cluster_if = format!("{tag}{id}c");
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
            &cluster_if,
        ])?;
        sh(&["ip", "link", "set", &cluster_if, "netns", &netns.name])?;
        sh(&[
            "ip",
            "addr",
            "add",
            &format!("{host_ip}/30"),
            "dev",
            &netns.host_if,
        ])?;
        sh(&["ip", "link", "set", &netns.host_if, "up"])?;
        netns.exec_ok(&[
            "ip",
            "addr",
            "add",
            &format!("{cluster_ip}/30"),
            "dev",
            &cluster_if,
        ])?;
        netns.exec_ok(&["ip", "link", "set", &cluster_if, "up"])?;
        netns.exec_ok(&["ip", "link", "set", "lo", "up"])?;
        Ok(netns)
    }

    /// [`Netns::create`] with the firewall of a cluster that accepts no inbound connection: its INPUT chain
    /// drops every connection it did not open itself.
    pub fn refusing_inbound(
        tag: &str,
        host_ip: Ipv4Addr,
        cluster_ip: Ipv4Addr,
    ) -> anyhow::Result<Netns> {
        let netns = Self::create(tag, host_ip, cluster_ip)?;
        netns.exec_ok(&["iptables", "-A", "INPUT", "-i", "lo", "-j", "ACCEPT"])?;
        netns.exec_ok(&[
            "iptables",
            "-A",
            "INPUT",
            "-m",
            "conntrack",
            "--ctstate",
            "ESTABLISHED,RELATED",
            "-j",
            "ACCEPT",
        ])?;
        netns.exec_ok(&["iptables", "-P", "INPUT", "DROP"])?;
        Ok(netns)
    }

    /// Runs a command inside the namespace; it must succeed.
    pub fn exec_ok(&self, rest: &[&str]) -> anyhow::Result<()> {
        let mut args = vec!["ip", "netns", "exec", self.name.as_str()];
        args.extend_from_slice(rest);
        sh(&args)
    }

    /// A command for `program` inside the namespace, killed when dropped.
    pub fn command(&self, program: &Path) -> tokio::process::Command {
        let mut command = tokio::process::Command::new("ip");
        command
            .args(["netns", "exec", &self.name])
            .arg(program)
            .kill_on_drop(true);
        command
    }

    /// True when a TCP connection from inside the namespace to `addr` succeeds within a few seconds.
    pub async fn can_connect(&self, addr: std::net::SocketAddr) -> anyhow::Result<bool> {
        let script = format!("exec 3<>/dev/tcp/{}/{}", addr.ip(), addr.port());
        let mut command = tokio::process::Command::new("ip");
        command
            .args([
                "netns", "exec", &self.name, "timeout", "5", "bash", "-c", &script,
            ])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .kill_on_drop(true);
        Ok(command.status().await?.success())
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
