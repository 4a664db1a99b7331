//! What the commands print.

use std::io::{self, Write};

use std::collections::BTreeMap;

use tether_api::admin;
use time::OffsetDateTime;
use time::format_description::well_known::Rfc3339;

use crate::client::CreatedCluster;
use crate::config::ResolvedConfig;
use crate::helm::HelmPlan;

pub(crate) fn json(out: &mut impl Write, value: &impl serde::Serialize) -> io::Result<()> {
    serde_json::to_writer_pretty(&mut *out, value).map_err(io::Error::other)?;
    writeln!(out)
}

pub(crate) fn line(out: &mut impl Write, text: &str) -> io::Result<()> {
    writeln!(out, "{text}")
}

pub(crate) fn connect_instructions(
    out: &mut impl Write,
    config: &ResolvedConfig,
    created: &CreatedCluster,
    helm: &HelmPlan,
) -> io::Result<()> {
    writeln!(
        out,
        "Cluster \"{}\" registered at {}.",
        created.name, config.relay_url
    )?;
    writeln!(out)?;
    agent_instructions(out, config, created)?;
    let line = helm.write(config, created)?;
    writeln!(out)?;
    writeln!(
        out,
        "Or install it in the cluster with Helm (the token and the relay CA are in the 0600 files it names):"
    )?;
    writeln!(out)?;
    writeln!(out, "  {line}")
}

pub(crate) fn import_instructions(
    out: &mut impl Write,
    config: &ResolvedConfig,
    created: &CreatedCluster,
) -> io::Result<()> {
    let tags = tags(&created.raw.cluster.tags);
    writeln!(
        out,
        "Cluster \"{}\" imported at {}{}.",
        created.name,
        config.relay_url,
        if tags.is_empty() {
            String::new()
        } else {
            format!(" with tags {tags}")
        }
    )?;
    writeln!(out)?;
    writeln!(
        out,
        "Its identity stays with the old relay: restart the agent against this relay so it onboards again here."
    )?;
    agent_instructions(out, config, created)?;
    writeln!(
        out,
        "Once it shows Connected here (tether cluster list), delete it at the old relay: tether cluster delete {}",
        created.name
    )
}

fn agent_instructions(
    out: &mut impl Write,
    config: &ResolvedConfig,
    created: &CreatedCluster,
) -> io::Result<()> {
    writeln!(
        out,
        "Run the agent where it can reach the cluster's apiserver (it dials out; no inbound port is needed)."
    )?;
    writeln!(out, "The onboarding token works once:")?;
    writeln!(out)?;
    writeln!(out, "{}", agent_command(config, created))?;
    writeln!(out)?;
    writeln!(
        out,
        "Behind an HTTP proxy, add --proxy-https http://[USER:PASSWORD@]HOST:PORT (or set HTTPS_PROXY)."
    )?;
    writeln!(
        out,
        "Then: tether kubeconfig {} -f {}.kubeconfig",
        created.name, created.name
    )
}

/// The exact agent command for a newly registered cluster.
pub(crate) fn agent_command(config: &ResolvedConfig, created: &CreatedCluster) -> String {
    let mut command = format!(
        "  TETHER_ONBOARDING_TOKEN={} tether-agent \\\n    --relay {} \\\n    --cluster {}",
        created.onboarding_token.expose(),
        config.relay_url,
        created.name
    );
    if let Some(ca) = &config.ca_file {
        let ca = std::fs::canonicalize(ca).unwrap_or_else(|_| ca.clone());
        command.push_str(&format!(" \\\n    --relay-ca {}", ca.display()));
    }
    command.push_str(" \\\n    --state-dir /var/lib/tether-agent");
    command
}

/// A text field as shown: `-` when absent or empty.
fn or_dash(value: Option<&str>) -> String {
    value.filter(|v| !v.is_empty()).unwrap_or("-").to_string()
}

/// A timestamp field, parsed (RFC 3339).
fn timestamp(value: Option<&str>) -> Option<OffsetDateTime> {
    value.and_then(|s| OffsetDateTime::parse(s, &Rfc3339).ok())
}

fn tags(tags: &BTreeMap<String, String>) -> String {
    tags.iter()
        .map(|(k, v)| format!("{k}={v}"))
        .collect::<Vec<_>>()
        .join(",")
}

/// The agent version, with "(upgrade available)" when the relay offers a newer one.
fn agent_version(cluster: &admin::Cluster) -> String {
    match cluster.agent_version.as_deref() {
        None | Some("") => "-".into(),
        Some(version) if cluster.upgrade_available => format!("{version} (upgrade available)"),
        Some(version) => version.to_string(),
    }
}

/// `1h2m`, `3d4h`, `45s`: the two largest units.
pub(crate) fn human_duration(seconds: u64) -> String {
    let (d, h, m, s) = (
        seconds / 86_400,
        seconds % 86_400 / 3600,
        seconds % 3600 / 60,
        seconds % 60,
    );
    match (d, h, m) {
        (0, 0, 0) => format!("{s}s"),
        (0, 0, _) if s == 0 => format!("{m}m"),
        (0, 0, _) => format!("{m}m{s}s"),
        (0, _, 0) => format!("{h}h"),
        (0, _, _) => format!("{h}h{m}m"),
        (_, 0, _) => format!("{d}d"),
        _ => format!("{d}d{h}h"),
    }
}

/// How long ago `t` was, in the largest whole unit: `12s ago`, `5m ago`, `3h ago`, `2d ago`.
pub(crate) fn age(t: OffsetDateTime, now: OffsetDateTime) -> String {
    let seconds = (now - t).whole_seconds();
    if seconds < 1 {
        return "just now".into();
    }
    let seconds = seconds.unsigned_abs();
    let text = match seconds {
        0..60 => format!("{seconds}s"),
        60..3600 => format!("{}m", seconds / 60),
        3600..172_800 => format!("{}h", seconds / 3600),
        _ => format!("{}d", seconds / 86_400),
    };
    format!("{text} ago")
}

/// Bytes in binary units, one decimal unless whole: `8 GiB`, `1.5 GiB`, `640 MiB`.
pub(crate) fn bytes(n: f64) -> String {
    let units = ["B", "KiB", "MiB", "GiB", "TiB", "PiB"];
    let mut value = n;
    let mut unit = 0;
    while value >= 1024.0 && unit + 1 < units.len() {
        value /= 1024.0;
        unit += 1;
    }
    let rounded = (value * 10.0).round() / 10.0;
    if rounded.fract() == 0.0 {
        format!("{rounded:.0} {}", units[unit])
    } else {
        format!("{rounded:.1} {}", units[unit])
    }
}

/// Millicores as vCPUs: `12`, `4.5`, `0.25`.
pub(crate) fn vcpus(millis: f64) -> String {
    let text = format!("{:.3}", millis / 1000.0);
    text.trim_end_matches('0').trim_end_matches('.').to_string()
}

fn time_and_age(t: OffsetDateTime, now: OffsetDateTime) -> String {
    let text = t.format(&Rfc3339).unwrap_or_else(|_| t.to_string());
    format!("{text} ({})", age(t, now))
}

pub(crate) fn cluster_table(
    out: &mut impl Write,
    clusters: &[admin::Cluster],
    filtered: bool,
    now: OffsetDateTime,
) -> io::Result<()> {
    if clusters.is_empty() {
        return if filtered {
            writeln!(out, "No clusters match.")
        } else {
            writeln!(
                out,
                "No clusters. Register one with: tether cluster connect NAME"
            )
        };
    }
    let header = [
        "NAME",
        "STATUS",
        "K8S VERSION",
        "NODES",
        "AGENT VERSION",
        "LAST SEEN",
    ]
    .map(str::to_string);
    let rows: Vec<[String; 6]> = clusters
        .iter()
        .map(|c| {
            [
                c.name.clone(),
                c.connectivity_status.clone(),
                or_dash(c.kubernetes_version.as_deref()),
                c.node_count
                    .map_or_else(|| "-".to_string(), |n| n.to_string()),
                agent_version(c),
                timestamp(c.last_connectivity_time.as_deref())
                    .map_or_else(|| "never".to_string(), |t| age(t, now)),
            ]
        })
        .collect();
    table(out, &header, &rows)
}

fn table<const N: usize>(
    out: &mut impl Write,
    header: &[String; N],
    rows: &[[String; N]],
) -> io::Result<()> {
    let mut widths = header.clone().map(|h| h.len());
    for row in rows {
        for (w, cell) in widths.iter_mut().zip(row) {
            *w = (*w).max(cell.chars().count());
        }
    }
    for row in std::iter::once(header).chain(rows) {
        let mut text = String::new();
        for (i, (cell, w)) in row.iter().zip(widths).enumerate() {
            if i + 1 == N {
                text.push_str(cell);
            } else {
                text.push_str(&format!("{cell:<w$}   "));
            }
        }
        writeln!(out, "{}", text.trim_end())?;
    }
    Ok(())
}

pub(crate) fn cluster_details(
    out: &mut impl Write,
    cluster: &admin::Cluster,
    now: OffsetDateTime,
) -> io::Result<()> {
    let mut rows: Vec<(&str, String)> = vec![
        ("Name", cluster.name.clone()),
        ("Status", cluster.connectivity_status.clone()),
    ];
    let tunnel = match (
        cluster.connected,
        timestamp(cluster.connected_since.as_deref()),
    ) {
        (true, Some(since)) => format!("connected since {}", time_and_age(since, now)),
        (true, None) => "connected".into(),
        _ if !cluster.onboarded => {
            "never connected: run the agent command `tether cluster connect` printed".into()
        }
        _ => "not connected".into(),
    };
    rows.push(("Tunnel", tunnel));
    // One row per tunnel in the fleet: the replica holding it, how, since when, and which agent process.
    for t in &cluster.tunnels {
        let mut line = format!(
            "{}: {} (RTT {})",
            or_dash(t.replica.as_deref()),
            t.transport,
            rtt(t.rtt_millis)
        );
        if let Some(since) = timestamp(t.connected_since.as_deref()) {
            line.push_str(&format!(", since {}", time_and_age(since, now)));
        }
        match (&t.agent_instance, &t.agent_address) {
            (Some(instance), Some(address)) => {
                line.push_str(&format!(", agent {instance} at {address}"))
            }
            (None, Some(address)) => line.push_str(&format!(", agent at {address}")),
            (Some(instance), None) => line.push_str(&format!(", agent {instance}")),
            (None, None) => {}
        }
        if t.going_away {
            line.push_str(", going away");
        }
        rows.push(("  Replica", line));
    }
    let tags = tags(&cluster.tags);
    rows.push(("Tags", if tags.is_empty() { "-".into() } else { tags }));
    if let Some(t) = timestamp(cluster.created_at.as_deref()) {
        rows.push(("Created", time_and_age(t, now)));
    }
    rows.push((
        "Last seen",
        timestamp(cluster.last_connectivity_time.as_deref())
            .map_or_else(|| "never".into(), |t| time_and_age(t, now)),
    ));
    rows.push((
        "Kubernetes version",
        or_dash(cluster.kubernetes_version.as_deref()),
    ));
    rows.push(("Distribution", or_dash(cluster.distribution.as_deref())));
    rows.push(("Infrastructure", or_dash(cluster.infrastructure.as_deref())));
    rows.push((
        "Nodes",
        cluster
            .node_count
            .map_or_else(|| "-".into(), |n| n.to_string()),
    ));
    rows.push((
        "vCPU",
        cluster
            .total_cpu_millis
            .map_or_else(|| "-".into(), |m| vcpus(m as f64)),
    ));
    rows.push((
        "Memory",
        cluster
            .total_memory_bytes
            .map_or_else(|| "-".into(), |b| bytes(b as f64)),
    ));

    let latest = cluster.latest_agent_version.as_str();
    let mut version = agent_version(cluster);
    if cluster.upgrade_available && !latest.is_empty() {
        version = format!(
            "{} (upgrade available: {latest})",
            cluster.agent_version.as_deref().unwrap_or_default()
        );
    }
    rows.push(("Agent version", version));
    match &cluster.agent_health {
        Some(health) => {
            rows.push(("Agent health", String::new()));
            rows.push(("  Uptime", human_duration(health.uptime_seconds)));
            rows.push(("  Memory", bytes(health.memory_bytes as f64)));
            rows.push(("  CPU time", format!("{:.1}s", health.cpu_seconds)));
            rows.push(("  Reconnects", health.reconnects.to_string()));
            rows.push(("  Tunnel RTT", rtt(health.tunnel_rtt_millis)));
            if let Some(t) = timestamp(health.reported_at.as_deref()) {
                rows.push(("  Reported", time_and_age(t, now)));
            }
        }
        None => rows.push(("Agent health", "not reported yet".into())),
    }

    match &cluster.identity {
        Some(identity) => {
            let expiry = match timestamp(identity.not_after.as_deref()) {
                Some(t) if t <= now => format!(
                    "expired at {} — delete the cluster and connect it again",
                    time_and_age(t, now)
                ),
                Some(t) => {
                    let left = (t - now).whole_seconds().max(0).unsigned_abs();
                    let text = t.format(&Rfc3339).unwrap_or_else(|_| t.to_string());
                    format!("expires {text} (in {})", human_duration(left))
                }
                None => "-".into(),
            };
            rows.push(("Identity", expiry));
            rows.push(("  Fingerprint", or_dash(Some(&identity.fingerprint))));
        }
        None => rows.push(("Identity", "none (the agent has not onboarded)".into())),
    }

    let width = rows.iter().map(|(k, _)| k.len()).max().unwrap_or(0) + 1;
    for (key, value) in rows {
        let line = format!("{:<width$} {value}", format!("{key}:"));
        writeln!(out, "{}", line.trim_end())?;
    }
    Ok(())
}

/// A round trip in milliseconds, `-` when not measured yet.
fn rtt(millis: Option<f64>) -> String {
    match millis {
        Some(ms) if ms < 10.0 => format!("{ms:.1} ms"),
        Some(ms) => format!("{ms:.0} ms"),
        None => "-".into(),
    }
}

fn scope(namespace: Option<&str>) -> String {
    match namespace {
        Some(ns) => format!("namespace {ns}"),
        None => "cluster".to_string(),
    }
}

/// What `tether role assign` prints.
pub(crate) fn assigned(out: &mut impl Write, created: &admin::RoleAssignment) -> io::Result<()> {
    let role = created.role_name.as_deref().unwrap_or(&created.role_id);
    writeln!(
        out,
        "Role \"{role}\" assigned to {} on cluster \"{}\" ({}): id {}",
        created.principal_id,
        created.cluster,
        scope(created.namespace.as_deref()),
        created.id,
    )
}

/// `tether role list`.
pub(crate) fn assignment_table(
    out: &mut impl Write,
    items: &[admin::RoleAssignment],
) -> io::Result<()> {
    let header = ["ID", "ROLE", "PRINCIPAL", "CLUSTER", "SCOPE"].map(String::from);
    let rows: Vec<[String; 5]> = items
        .iter()
        .map(|a| {
            [
                a.id.clone(),
                a.role_name.clone().unwrap_or_else(|| a.role_id.clone()),
                a.principal_id.clone(),
                a.cluster.clone(),
                scope(a.namespace.as_deref()),
            ]
        })
        .collect();
    table(out, &header, &rows)
}

/// `tether role deny list`.
pub(crate) fn deny_table(out: &mut impl Write, items: &[admin::DenyAssignment]) -> io::Result<()> {
    let header = [
        "ID",
        "NAME",
        "ACTIONS",
        "PRINCIPALS",
        "EXCLUDED",
        "CLUSTER",
        "SCOPE",
    ]
    .map(String::from);
    let rows: Vec<[String; 7]> = items
        .iter()
        .map(|d| {
            [
                d.id.clone(),
                d.name.clone(),
                d.data_actions.join(","),
                d.principals.join(","),
                d.exclude_principals.join(","),
                d.cluster.clone(),
                scope(d.namespace.as_deref()),
            ]
        })
        .collect();
    table(out, &header, &rows)
}

/// `tether role definitions`.
pub(crate) fn role_table(out: &mut impl Write, items: &[admin::RoleDefinition]) -> io::Result<()> {
    let header = ["ID", "NAME", "BUILT-IN", "DATA ACTIONS"].map(String::from);
    let rows: Vec<[String; 4]> = items
        .iter()
        .map(|r| {
            let actions = r.data_actions.len();
            let not = r.not_data_actions.len();
            [
                r.id.clone(),
                r.name.clone(),
                if r.built_in {
                    "yes".to_string()
                } else {
                    "no".to_string()
                },
                if not > 0 {
                    format!("{actions} (minus {not})")
                } else {
                    actions.to_string()
                },
            ]
        })
        .collect();
    table(out, &header, &rows)
}

#[cfg(test)]
mod tests {
    use serde_json::{Value, json};
    use time::macros::datetime;

    use super::*;

    const NOW: OffsetDateTime = datetime!(2026-11-21 12:00:00 UTC);

    /// A cluster as the relay would send it: `fields` over an unknown, never-connected cluster.
    fn cluster(fields: Value) -> anyhow::Result<admin::Cluster> {
        let mut value = json!({
            "agentHealth": null, "agentVersion": null, "connected": false, "connectedSince": null,
            "connectivityStatus": "Connecting", "createdAt": null, "distribution": null, "identity": null,
            "infrastructure": null, "kubernetesVersion": null, "lastConnectivityTime": null, "lastSeen": null,
            "latestAgentVersion": "", "metadataReportedAt": null, "name": "", "nodeCount": null,
            "onboarded": false, "tags": {}, "totalCpuMillis": null, "totalMemoryBytes": null,
            "upgradeAvailable": false,
        });
        if let (Some(base), Value::Object(fields)) = (value.as_object_mut(), fields) {
            base.extend(fields);
        }
        Ok(serde_json::from_value(value)?)
    }

    #[test]
    fn table_has_the_inventory_columns() -> anyhow::Result<()> {
        let clusters = vec![
            cluster(
                json!({"name":"prod","connectivityStatus":"Connected","kubernetesVersion":"v1.33.1","nodeCount":3,
                   "agentVersion":"0.1.0","upgradeAvailable":true,"lastConnectivityTime":"2026-11-21T11:59:48Z",
                   "tags":{"env":"prod"}}),
            )?,
            cluster(
                json!({"name":"edge-cluster-7","connectivityStatus":"Connecting","connected":false,"onboarded":false,
                   "kubernetesVersion":null,"nodeCount":null,"agentVersion":null,"lastConnectivityTime":null}),
            )?,
        ];
        let mut out = Vec::new();
        cluster_table(&mut out, &clusters, false, NOW)?;
        let text = String::from_utf8(out)?;
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(lines.len(), 3, "{text}");
        assert_eq!(
            lines[0],
            "NAME             STATUS       K8S VERSION   NODES   AGENT VERSION               LAST SEEN"
        );
        assert_eq!(
            lines[1],
            "prod             Connected    v1.33.1       3       0.1.0 (upgrade available)   12s ago"
        );
        assert_eq!(
            lines[2],
            "edge-cluster-7   Connecting   -             -       -                           never"
        );
        Ok(())
    }

    #[test]
    fn empty_lists_say_why() -> anyhow::Result<()> {
        let mut out = Vec::new();
        cluster_table(&mut out, &[], true, NOW)?;
        assert_eq!(String::from_utf8(out)?, "No clusters match.\n");
        let mut out = Vec::new();
        cluster_table(&mut out, &[], false, NOW)?;
        assert!(String::from_utf8(out)?.contains("tether cluster connect"));
        Ok(())
    }

    #[test]
    fn details_show_metadata_health_and_identity() -> anyhow::Result<()> {
        let cluster = cluster(json!({
            "name": "prod", "tags": {"env": "prod", "team": "blue"}, "createdAt": "2026-11-01T00:00:00Z",
            "onboarded": true, "connected": true, "connectedSince": "2026-11-21T10:00:00Z",
            "connectivityStatus": "Connected", "lastConnectivityTime": "2026-11-21T11:59:55Z",
            "kubernetesVersion": "v1.33.1", "nodeCount": 2, "totalCpuMillis": 12000,
            "totalMemoryBytes": 25_769_803_776u64, "distribution": "eks", "infrastructure": "aws",
            "agentVersion": "0.1.0", "latestAgentVersion": "0.2.0", "upgradeAvailable": true,
            "agentHealth": {"uptimeSeconds": 3725, "memoryBytes": 31_457_280, "cpuSeconds": 2.5,
                            "reconnects": 1, "tunnelRttMillis": 3.2, "reportedAt": "2026-11-21T11:59:55Z"},
            "identity": {"notAfter": "2027-02-19T12:00:00Z", "fingerprint": "ab:cd"},
            "tunnels": [
                {"transport": "quic", "rttMillis": 0.42, "connectedSince": "2026-11-21T10:00:00Z",
                 "replica": "relay-0", "agentInstance": "agent-7f3a", "agentAddress": "10.0.0.7:51000"},
                {"transport": "wss", "rttMillis": null, "connectedSince": "2026-11-21T11:00:00Z",
                 "replica": "relay-2", "agentInstance": "agent-7f3a", "agentAddress": "10.0.0.7:51002",
                 "goingAway": true}],
        }))?;
        let mut out = Vec::new();
        cluster_details(&mut out, &cluster, NOW)?;
        let text = String::from_utf8(out)?;
        for expected in [
            "Status:             Connected",
            "Tunnel:             connected since 2026-11-21T10:00:00Z (2h ago)",
            "  Replica:          relay-0: quic (RTT 0.4 ms), since 2026-11-21T10:00:00Z (2h ago), agent agent-7f3a at 10.0.0.7:51000",
            "  Replica:          relay-2: wss (RTT -), since 2026-11-21T11:00:00Z (1h ago), agent agent-7f3a at 10.0.0.7:51002, going away",
            "Tags:               env=prod,team=blue",
            "Last seen:          2026-11-21T11:59:55Z (5s ago)",
            "Kubernetes version: v1.33.1",
            "Distribution:       eks",
            "Infrastructure:     aws",
            "Nodes:              2",
            "vCPU:               12",
            "Memory:             24 GiB",
            "Agent version:      0.1.0 (upgrade available: 0.2.0)",
            "  Uptime:           1h2m",
            "  Memory:           30 MiB",
            "  CPU time:         2.5s",
            "  Reconnects:       1",
            "  Tunnel RTT:       3.2 ms",
            "Identity:           expires 2027-02-19T12:00:00Z (in 90d)",
            "  Fingerprint:      ab:cd",
        ] {
            assert!(
                text.lines().any(|l| l == expected),
                "missing {expected:?} in\n{text}"
            );
        }
        Ok(())
    }

    #[test]
    fn details_of_an_expired_cluster_say_how_to_recover() -> anyhow::Result<()> {
        let cluster = cluster(json!({
            "name": "old", "connectivityStatus": "Expired", "connected": false, "onboarded": true,
            "identity": {"notAfter": "2026-11-21T11:55:00Z", "fingerprint": "ef"},
        }))?;
        let mut out = Vec::new();
        cluster_details(&mut out, &cluster, NOW)?;
        let text = String::from_utf8(out)?;
        assert!(text.contains("Status:             Expired"), "{text}");
        assert!(
            text.contains(
                "expired at 2026-11-21T11:55:00Z (5m ago) — delete the cluster and connect it again"
            ),
            "{text}"
        );
        assert!(
            text.contains("Agent health:       not reported yet"),
            "{text}"
        );
        Ok(())
    }

    #[test]
    fn units() {
        assert_eq!(vcpus(4500.0), "4.5");
        assert_eq!(vcpus(250.0), "0.25");
        assert_eq!(vcpus(8000.0), "8");
        assert_eq!(bytes(8.0 * 1024.0 * 1024.0 * 1024.0), "8 GiB");
        assert_eq!(bytes(1536.0 * 1024.0 * 1024.0), "1.5 GiB");
        assert_eq!(bytes(512.0), "512 B");
        assert_eq!(human_duration(45), "45s");
        assert_eq!(human_duration(120), "2m");
        assert_eq!(human_duration(3 * 86_400 + 4 * 3600 + 5), "3d4h");
        assert_eq!(age(NOW, NOW), "just now");
        assert_eq!(age(NOW - time::Duration::minutes(5), NOW), "5m ago");
        assert_eq!(age(NOW - time::Duration::days(3), NOW), "3d ago");
    }
}
