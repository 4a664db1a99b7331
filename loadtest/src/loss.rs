//! Packet loss on the tunnel only (`hol --tunnel-loss SHARE`): iptables' statistic match drops that share of the
//! packets of each Tether path's relay↔agent connection, both ways, and of no other connection — the client's
//! and the upstream's hops stay clean, so what the loss shows is how the tunnel carries streams (one TCP
//! connection for WebSocket, independent QUIC streams). `tc netem` would do the same, but is not in every
//! kernel (not in this machine's).
//!
//! The rules name the tunnel's ports: the relay's port and the agent's end of the connection, read from `ss`
//! (its TCP connection to the relay for WebSocket, its UDP sockets for QUIC). They go into the OUTPUT chain of
//! the current network namespace (every loopback packet passes it once) and are removed on drop.

use std::process::Command;

use anyhow::{Context as _, bail};

use crate::scenario::TetherPath;

/// The rules in force; removed when dropped.
#[derive(Debug)]
pub struct TunnelLoss {
    rules: Vec<Vec<String>>,
}

impl TunnelLoss {
    /// Drops `share` of each path's tunnel packets from now on.
    pub fn apply(paths: &[TetherPath], share: f64) -> anyhow::Result<TunnelLoss> {
        let mut loss = TunnelLoss { rules: Vec::new() };
        for path in paths {
            let relay_port = path.relay.addr.port();
            let agent = path.agent.process().pid();
            let ends = agent_ends(agent, relay_port)?;
            if ends.is_empty() {
                bail!(
                    "{}: no tunnel of agent {agent} to the relay's port {relay_port} in `ss`",
                    path.label
                );
            }
            for (proto, agent_port) in ends {
                for (sport, dport) in [(agent_port, relay_port), (relay_port, agent_port)] {
                    let rule: Vec<String> = [
                        "OUTPUT",
                        "-o",
                        "lo",
                        "-p",
                        proto,
                        "--sport",
                        &sport.to_string(),
                        "--dport",
                        &dport.to_string(),
                        "-m",
                        "statistic",
                        "--mode",
                        "random",
                        "--probability",
                        &share.to_string(),
                        "-j",
                        "DROP",
                    ]
                    .map(str::to_owned)
                    .to_vec();
                    iptables("-A", &rule)?;
                    loss.rules.push(rule);
                }
            }
        }
        Ok(loss)
    }

    /// How many rules are in force (two per tunnel socket).
    pub fn rules(&self) -> usize {
        self.rules.len()
    }
}

impl Drop for TunnelLoss {
    fn drop(&mut self) {
        for rule in &self.rules {
            let _ = iptables("-D", rule);
        }
    }
}

fn iptables(op: &str, rule: &[String]) -> anyhow::Result<()> {
    let out = Command::new("iptables")
        .arg(op)
        .args(rule)
        .output()
        .context("cannot run iptables (installed? root?)")?;
    if !out.status.success() {
        bail!(
            "iptables {op} {}: {}",
            rule.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(())
}

/// The agent's ends of its tunnel(s) to the relay's port: its TCP connections to that port, and its UDP
/// sockets (QUIC endpoints are not connected, so every UDP socket of the agent counts).
fn agent_ends(pid: u32, relay_port: u16) -> anyhow::Result<Vec<(&'static str, u16)>> {
    let mut ends = Vec::new();
    let owner = format!("pid={pid},");
    for (proto, flag) in [("tcp", "-Htnp"), ("udp", "-Hunap")] {
        let out = Command::new("ss")
            .arg(flag)
            .output()
            .context("cannot run ss (iproute2)")?;
        for line in String::from_utf8_lossy(&out.stdout).lines() {
            if !line.contains(&owner) {
                continue;
            }
            let fields: Vec<&str> = line.split_whitespace().collect();
            // State, Recv-Q, Send-Q, local, peer, process.
            let (Some(local), Some(peer)) = (fields.get(3), fields.get(4)) else {
                continue;
            };
            let port = |addr: &str| addr.rsplit(':').next().and_then(|p| p.parse::<u16>().ok());
            match proto {
                "tcp" if port(peer) == Some(relay_port) => {
                    if let Some(p) = port(local) {
                        ends.push(("tcp", p));
                    }
                }
                "udp" => {
                    if let Some(p) = port(local) {
                        ends.push(("udp", p));
                    }
                }
                _ => {}
            }
        }
    }
    ends.sort_unstable();
    ends.dedup();
    Ok(ends)
}
