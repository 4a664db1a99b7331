//! What the commands print.

use std::io::{self, Write};

use serde_json::Value;

use crate::client::CreatedCluster;
use crate::config::ResolvedConfig;

pub(crate) fn json(out: &mut impl Write, value: &Value) -> io::Result<()> {
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
) -> io::Result<()> {
    writeln!(
        out,
        "Cluster \"{}\" registered at {}.",
        created.name, config.relay_url
    )?;
    writeln!(out)?;
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
        (false, true) => "Disconnected",
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

pub(crate) fn cluster_table(out: &mut impl Write, clusters: &[Value]) -> io::Result<()> {
    if clusters.is_empty() {
        return writeln!(
            out,
            "No clusters. Register one with: tether cluster connect NAME"
        );
    }
    let header = ["NAME", "STATUS", "AGENT VERSION", "LAST SEEN", "TAGS"].map(str::to_string);
    let rows: Vec<[String; 5]> = clusters
        .iter()
        .map(|c| {
            [
                field(c, "name").to_string(),
                status(c),
                field(c, "agentVersion").to_string(),
                field(c, "lastSeen").to_string(),
                tags(c),
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

pub(crate) fn cluster_details(out: &mut impl Write, cluster: &Value) -> io::Result<()> {
    let mut rows: Vec<(String, String)> = vec![
        ("Name".into(), field(cluster, "name").into()),
        ("Status".into(), status(cluster)),
    ];
    let labels = [
        ("createdAt", "Created"),
        ("onboarded", "Onboarded"),
        ("connectedSince", "Connected since"),
        ("lastSeen", "Last seen"),
        ("agentVersion", "Agent version"),
    ];
    for (key, label) in labels {
        match cluster.get(key) {
            Some(Value::String(s)) => rows.push((label.into(), s.clone())),
            Some(Value::Bool(b)) => rows.push((label.into(), if *b { "yes" } else { "no" }.into())),
            _ => {}
        }
    }
    let tags = tags(cluster);
    if !tags.is_empty() {
        rows.push(("Tags".into(), tags));
    }
    let width = rows.iter().map(|(k, _)| k.len()).max().unwrap_or(0) + 1;
    for (key, value) in rows {
        writeln!(out, "{:<width$} {value}", format!("{key}:"))?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn table_aligns_columns() -> anyhow::Result<()> {
        let clusters = vec![
            serde_json::json!({"name":"prod","connected":true,"onboarded":true,"agentVersion":"0.1.0","tags":{"env":"prod"}}),
            serde_json::json!({"name":"edge-cluster-7","connected":false,"onboarded":false}),
        ];
        let mut out = Vec::new();
        cluster_table(&mut out, &clusters)?;
        let text = String::from_utf8(out)?;
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(lines.len(), 3);
        assert!(lines[0].starts_with("NAME             STATUS"), "{text}");
        assert!(lines[1].starts_with("prod             Connected"), "{text}");
        assert!(lines[1].ends_with("env=prod"), "{text}");
        assert!(
            lines[2].starts_with("edge-cluster-7   Connecting"),
            "{text}"
        );
        Ok(())
    }
}
