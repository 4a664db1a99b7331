//! What the commands print.

use std::io::{self, Write};

use serde_json::Value;
use time::OffsetDateTime;
use time::format_description::well_known::Rfc3339;

use crate::client::CreatedCluster;
use crate::config::ResolvedConfig;

pub(crate) fn json(out: &mut impl Write, value: &impl serde::Serialize) -> io::Result<()> {
    serde_json::to_writer_pretty(&mut *out, value).map_err(io::Error::other)?;
    writeln!(out)
}

/// The JSON forms of a list of typed answers.
pub(crate) fn values<T: serde::Serialize>(items: &[T]) -> Vec<Value> {
    items.iter().map(value).collect()
}

/// The JSON form of typed answers, for the table printers (they read fields by their API names).
pub(crate) fn value(typed: &impl serde::Serialize) -> Value {
    serde_json::to_value(typed).unwrap_or_default()
}

pub(crate) fn line(out: &mut impl Write, text: &str) -> io::Result<()> {
    writeln!(out, "{text}")
}

pub(crate) fn connect_instructions(
    out: &mut impl Write,
    config: &ResolvedConfig,
    created: &CreatedCluster,
) -> io::Result<()> {
    writeln!(
        out,
        "Cluster \"{}\" registered at {}.",
        created.name, config.relay_url
    )?;
    writeln!(out)?;
    agent_instructions(out, config, created)
}

pub(crate) fn import_instructions(
    out: &mut impl Write,
    config: &ResolvedConfig,
    created: &CreatedCluster,
) -> io::Result<()> {
    let tags = tags(&value(&created.raw));
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

fn field<'a>(cluster: &'a Value, name: &str) -> &'a str {
    cluster.get(name).and_then(Value::as_str).unwrap_or("")
}

fn number(cluster: &Value, name: &str) -> Option<f64> {
    cluster.get(name).and_then(Value::as_f64)
}

/// A timestamp field, parsed (RFC 3339).
fn timestamp(cluster: &Value, name: &str) -> Option<OffsetDateTime> {
    cluster
        .get(name)
        .and_then(Value::as_str)
        .and_then(|s| OffsetDateTime::parse(s, &Rfc3339).ok())
}

fn status(cluster: &Value) -> String {
    if let Some(s) = cluster.get("connectivityStatus").and_then(Value::as_str) {
        return s.to_string();
    }
    let connected = cluster
        .get("connected")
        .and_then(Value::as_bool)
        .unwrap_or(false);
    let onboarded = cluster
        .get("onboarded")
        .and_then(Value::as_bool)
        .unwrap_or(false);
    match (connected, onboarded) {
        (true, _) => "Connected",
        (false, false) => "Connecting",
        (false, true) => "Offline",
    }
    .to_string()
}

fn tags(cluster: &Value) -> String {
    match cluster.get("tags") {
        Some(Value::Object(map)) => map
            .iter()
            .map(|(k, v)| format!("{k}={}", v.as_str().unwrap_or("")))
            .collect::<Vec<_>>()
            .join(","),
        _ => String::new(),
    }
}

/// The agent version, with "(upgrade available)" when the relay offers a newer one.
fn agent_version(cluster: &Value) -> String {
    let version = field(cluster, "agentVersion");
    if version.is_empty() {
        return "-".into();
    }
    if cluster.get("upgradeAvailable").and_then(Value::as_bool) == Some(true) {
        format!("{version} (upgrade available)")
    } else {
        version.to_string()
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
    clusters: &[Value],
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
            let k8s = field(c, "kubernetesVersion");
            [
                field(c, "name").to_string(),
                status(c),
                if k8s.is_empty() { "-" } else { k8s }.to_string(),
                c.get("nodeCount")
                    .and_then(Value::as_u64)
                    .map_or_else(|| "-".to_string(), |n| n.to_string()),
                agent_version(c),
                timestamp(c, "lastConnectivityTime")
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
    cluster: &Value,
    now: OffsetDateTime,
) -> io::Result<()> {
    let mut rows: Vec<(&str, String)> = vec![
        ("Name", field(cluster, "name").into()),
        ("Status", status(cluster)),
    ];
    let onboarded = cluster.get("onboarded").and_then(Value::as_bool);
    let tunnel = match (
        cluster.get("connected").and_then(Value::as_bool),
        timestamp(cluster, "connectedSince"),
    ) {
        (Some(true), Some(since)) => format!("connected since {}", time_and_age(since, now)),
        (Some(true), None) => "connected".into(),
        _ if onboarded == Some(false) => {
            "never connected: run the agent command `tether cluster connect` printed".into()
        }
        _ => "not connected".into(),
    };
    rows.push(("Tunnel", tunnel));
    let tags = tags(cluster);
    rows.push(("Tags", if tags.is_empty() { "-".into() } else { tags }));
    if let Some(t) = timestamp(cluster, "createdAt") {
        rows.push(("Created", time_and_age(t, now)));
    }
    rows.push((
        "Last seen",
        timestamp(cluster, "lastConnectivityTime")
            .map_or_else(|| "never".into(), |t| time_and_age(t, now)),
    ));

    let text = |name: &str| {
        let v = field(cluster, name);
        if v.is_empty() {
            "-".into()
        } else {
            v.to_string()
        }
    };
    rows.push(("Kubernetes version", text("kubernetesVersion")));
    rows.push(("Distribution", text("distribution")));
    rows.push(("Infrastructure", text("infrastructure")));
    rows.push((
        "Nodes",
        cluster
            .get("nodeCount")
            .and_then(Value::as_u64)
            .map_or_else(|| "-".into(), |n| n.to_string()),
    ));
    rows.push((
        "vCPU",
        number(cluster, "totalCpuMillis").map_or_else(|| "-".into(), vcpus),
    ));
    rows.push((
        "Memory",
        number(cluster, "totalMemoryBytes").map_or_else(|| "-".into(), bytes),
    ));

    let latest = field(cluster, "latestAgentVersion");
    let mut version = agent_version(cluster);
    if cluster.get("upgradeAvailable").and_then(Value::as_bool) == Some(true) && !latest.is_empty()
    {
        version = format!(
            "{} (upgrade available: {latest})",
            field(cluster, "agentVersion")
        );
    }
    rows.push(("Agent version", version));
    match cluster.get("agentHealth") {
        Some(health @ Value::Object(_)) => {
            rows.push(("Agent health", String::new()));
            let seconds = |name: &str| number(health, name).map(|s| s.max(0.0) as u64);
            rows.push((
                "  Uptime",
                seconds("uptimeSeconds").map_or_else(|| "-".into(), human_duration),
            ));
            rows.push((
                "  Memory",
                number(health, "memoryBytes").map_or_else(|| "-".into(), bytes),
            ));
            rows.push((
                "  CPU time",
                number(health, "cpuSeconds").map_or_else(|| "-".into(), |s| format!("{s:.1}s")),
            ));
            rows.push((
                "  Reconnects",
                health
                    .get("reconnects")
                    .and_then(Value::as_u64)
                    .map_or_else(|| "-".into(), |n| n.to_string()),
            ));
            rows.push((
                "  Tunnel RTT",
                number(health, "tunnelRttMillis").map_or_else(
                    || "-".into(),
                    |ms| {
                        if ms < 10.0 {
                            format!("{ms:.1} ms")
                        } else {
                            format!("{ms:.0} ms")
                        }
                    },
                ),
            ));
            if let Some(t) = timestamp(health, "reportedAt") {
                rows.push(("  Reported", time_and_age(t, now)));
            }
        }
        _ => rows.push(("Agent health", "not reported yet".into())),
    }

    match cluster.get("identity") {
        Some(identity @ Value::Object(_)) => {
            let expiry = match timestamp(identity, "notAfter") {
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
            rows.push(("  Fingerprint", text_of(identity, "fingerprint")));
        }
        _ => rows.push(("Identity", "none (the agent has not onboarded)".into())),
    }

    let width = rows.iter().map(|(k, _)| k.len()).max().unwrap_or(0) + 1;
    for (key, value) in rows {
        let line = format!("{:<width$} {value}", format!("{key}:"));
        writeln!(out, "{}", line.trim_end())?;
    }
    Ok(())
}

fn text_of(value: &Value, name: &str) -> String {
    let v = field(value, name);
    if v.is_empty() {
        "-".into()
    } else {
        v.to_string()
    }
}

fn scope(item: &Value) -> String {
    match item.get("namespace").and_then(Value::as_str) {
        Some(ns) => format!("namespace {ns}"),
        None => "cluster".to_string(),
    }
}

fn list(item: &Value, name: &str) -> String {
    item.get(name)
        .and_then(Value::as_array)
        .map(|a| {
            a.iter()
                .filter_map(Value::as_str)
                .collect::<Vec<_>>()
                .join(",")
        })
        .unwrap_or_default()
}

/// What `tether role assign` prints.
pub(crate) fn assigned(out: &mut impl Write, created: &Value) -> io::Result<()> {
    let role = created["roleName"]
        .as_str()
        .or_else(|| created["roleId"].as_str())
        .unwrap_or_default();
    writeln!(
        out,
        "Role \"{role}\" assigned to {} on cluster \"{}\" ({}): id {}",
        field(created, "principalId"),
        field(created, "cluster"),
        scope(created),
        field(created, "id"),
    )
}

/// `tether role list`.
pub(crate) fn assignment_table(out: &mut impl Write, items: &[Value]) -> io::Result<()> {
    let header = ["ID", "ROLE", "PRINCIPAL", "CLUSTER", "SCOPE"].map(String::from);
    let rows: Vec<[String; 5]> = items
        .iter()
        .map(|a| {
            [
                field(a, "id").to_string(),
                a["roleName"]
                    .as_str()
                    .unwrap_or_else(|| field(a, "roleId"))
                    .to_string(),
                field(a, "principalId").to_string(),
                field(a, "cluster").to_string(),
                scope(a),
            ]
        })
        .collect();
    table(out, &header, &rows)
}

/// `tether role deny list`.
pub(crate) fn deny_table(out: &mut impl Write, items: &[Value]) -> io::Result<()> {
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
                field(d, "id").to_string(),
                field(d, "name").to_string(),
                list(d, "dataActions"),
                list(d, "principals"),
                list(d, "excludePrincipals"),
                field(d, "cluster").to_string(),
                scope(d),
            ]
        })
        .collect();
    table(out, &header, &rows)
}

/// `tether role definitions`.
pub(crate) fn role_table(out: &mut impl Write, items: &[Value]) -> io::Result<()> {
    let header = ["ID", "NAME", "BUILT-IN", "DATA ACTIONS"].map(String::from);
    let rows: Vec<[String; 4]> = items
        .iter()
        .map(|r| {
            let actions = r["dataActions"].as_array().map_or(0, Vec::len);
            let not = r["notDataActions"].as_array().map_or(0, Vec::len);
            [
                field(r, "id").to_string(),
                field(r, "name").to_string(),
                if r["builtIn"].as_bool() == Some(true) {
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
    use serde_json::json;
    use time::macros::datetime;

    use super::*;

    const NOW: OffsetDateTime = datetime!(2026-11-21 12:00:00 UTC);

    #[test]
    fn table_has_the_inventory_columns() -> anyhow::Result<()> {
        let clusters = vec![
            json!({"name":"prod","connectivityStatus":"Connected","kubernetesVersion":"v1.33.1","nodeCount":3,
                   "agentVersion":"0.1.0","upgradeAvailable":true,"lastConnectivityTime":"2026-11-21T11:59:48Z",
                   "tags":{"env":"prod"}}),
            json!({"name":"edge-cluster-7","connectivityStatus":"Connecting","connected":false,"onboarded":false,
                   "kubernetesVersion":null,"nodeCount":null,"agentVersion":null,"lastConnectivityTime":null}),
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
        let cluster = json!({
            "name": "prod", "tags": {"env": "prod", "team": "blue"}, "createdAt": "2026-11-01T00:00:00Z",
            "onboarded": true, "connected": true, "connectedSince": "2026-11-21T10:00:00Z",
            "connectivityStatus": "Connected", "lastConnectivityTime": "2026-11-21T11:59:55Z",
            "kubernetesVersion": "v1.33.1", "nodeCount": 2, "totalCpuMillis": 12000,
            "totalMemoryBytes": 25_769_803_776u64, "distribution": "eks", "infrastructure": "aws",
            "agentVersion": "0.1.0", "latestAgentVersion": "0.2.0", "upgradeAvailable": true,
            "agentHealth": {"uptimeSeconds": 3725, "memoryBytes": 31_457_280, "cpuSeconds": 2.5,
                            "reconnects": 1, "tunnelRttMillis": 3.2, "reportedAt": "2026-11-21T11:59:55Z"},
            "identity": {"notAfter": "2027-02-19T12:00:00Z", "fingerprint": "ab:cd"},
        });
        let mut out = Vec::new();
        cluster_details(&mut out, &cluster, NOW)?;
        let text = String::from_utf8(out)?;
        for expected in [
            "Status:             Connected",
            "Tunnel:             connected since 2026-11-21T10:00:00Z (2h ago)",
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
        let cluster = json!({
            "name": "old", "connectivityStatus": "Expired", "connected": false, "onboarded": true,
            "identity": {"notAfter": "2026-11-21T11:55:00Z", "fingerprint": "ef"},
        });
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
