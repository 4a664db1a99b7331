//! Smoke tests: each scenario runs for about a second with tiny sizes against the real relay and agent
//! binaries, and must produce a report. Nothing here asserts a timing: the figures are whatever this machine
//! gives; the tests check that each scenario measures what it says (runs, counts, files).

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;

use anyhow::{Context as _, bail};
use serde_json::Value;

/// Builds tether-relay and tether-agent (same profile as this test) once, and returns their directory.
fn binaries() -> anyhow::Result<PathBuf> {
    static BUILT: OnceLock<Result<PathBuf, String>> = OnceLock::new();
    BUILT
        .get_or_init(|| {
            let exe = PathBuf::from(env!("CARGO_BIN_EXE_tether-loadtest"));
            let dir = exe.parent().map(Path::to_path_buf).ok_or("no bin dir")?;
            let mut build = Command::new(env!("CARGO"));
            build.args([
                "build",
                "-p",
                "tether-relay",
                "-p",
                "tether-agent",
                "--bins",
            ]);
            if dir.ends_with("release") {
                build.arg("--release");
            }
            let status = build
                .current_dir(env!("CARGO_MANIFEST_DIR"))
                .status()
                .map_err(|e| format!("cannot run cargo: {e}"))?;
            if !status.success() {
                return Err(format!(
                    "building tether-relay and tether-agent failed: {status}"
                ));
            }
            Ok(dir)
        })
        .clone()
        .map_err(anyhow::Error::msg)
}

/// Runs `tether-loadtest ARGS…` with its output in a fresh directory and returns the scenario's JSON report.
fn run(scenario: &str, args: &[&str]) -> anyhow::Result<(Value, tempfile::TempDir)> {
    let bin_dir = binaries()?;
    let dir = tempfile::tempdir()?;
    let out = dir.path().join("out");
    let output = Command::new(env!("CARGO_BIN_EXE_tether-loadtest"))
        .arg("--out")
        .arg(&out)
        .arg("--work-dir")
        .arg(dir.path().join("work"))
        .arg("--bin-dir")
        .arg(&bin_dir)
        .arg("--no-progress")
        .arg(scenario)
        .args(args)
        .output()?;
    if !output.status.success() {
        bail!(
            "tether-loadtest {scenario} failed ({}):\n{}\n{}",
            output.status,
            String::from_utf8_lossy(&output.stdout),
            String::from_utf8_lossy(&output.stderr)
        );
    }
    let json = std::fs::read(out.join(format!("{scenario}.json")))
        .with_context(|| format!("no {scenario}.json"))?;
    let table = std::fs::read_to_string(out.join(format!("{scenario}.txt")))?;
    assert!(table.contains(&format!("== {scenario}")), "{table}");
    // The readable table is also printed.
    assert!(String::from_utf8_lossy(&output.stdout).contains(&format!("== {scenario}")));
    Ok((serde_json::from_slice(&json)?, dir))
}

/// `requests` for a second after a short warm-up, two clients, with `extra` arguments.
fn short_requests(extra: &[&str]) -> anyhow::Result<(Value, tempfile::TempDir)> {
    let mut args = vec![
        "--duration",
        "1s",
        "--warmup",
        "300ms",
        "--concurrency",
        "2",
    ];
    args.extend_from_slice(extra);
    run("requests", &args)
}

fn run_labelled<'a>(report: &'a Value, label: &str) -> Option<&'a Value> {
    report["runs"]
        .as_array()?
        .iter()
        .find(|r| r["label"] == label)
}

fn figure(report: &Value, name: &str) -> Option<f64> {
    report["figures"]
        .as_array()?
        .iter()
        .find(|f| f["name"] == name)
        .and_then(|f| f["value"].as_f64())
}

#[test]
fn requests_measures_each_path() -> anyhow::Result<()> {
    let (report, dir) = short_requests(&["--paths", "direct,tether,rathole"])?;
    for label in ["direct", "tether"] {
        let r =
            run_labelled(&report, label).with_context(|| format!("no {label} run: {report}"))?;
        assert!(r["requests"].as_u64().is_some_and(|n| n > 0), "{r}");
        assert!(
            r["latency"]["p99_ms"].as_f64().is_some_and(|p| p > 0.0),
            "{r}"
        );
        // get, list and watch were all made.
        assert_eq!(r["by_kind"].as_object().map(|k| k.len()), Some(3), "{r}");
    }
    // The report says which transport the agent's own choice (`auto`) ran on.
    let shown = report["settings"]["tunnel_transport"].as_str();
    assert!(
        matches!(shown, Some("tether=quic" | "tether=wss")),
        "{report}"
    );
    // rathole is measured when installed, else the report says why not.
    let has_rathole = run_labelled(&report, "rathole").is_some();
    let noted = report["notes"].to_string().contains("rathole");
    assert!(has_rathole || noted, "{report}");
    assert!(
        report["ratios"].to_string().contains("req/s tether/direct"),
        "{report}"
    );
    assert_eq!(report["targets"].as_array().map(Vec::len), Some(2));
    assert!(dir.path().join("out/requests-latency.svg").is_file());
    assert!(dir.path().join("out/requests-throughput.svg").is_file());
    Ok(())
}

#[test]
fn transports_are_measured_side_by_side() -> anyhow::Result<()> {
    let (report, _dir) = short_requests(&["--transport", "quic,wss", "--paths", "tether"])?;
    for label in ["tether quic", "tether wss"] {
        let r =
            run_labelled(&report, label).with_context(|| format!("no {label} run: {report}"))?;
        assert!(r["requests"].as_u64().is_some_and(|n| n > 0), "{r}");
    }
    assert_eq!(
        report["settings"]["tunnel_transport"], "tether quic=quic,tether wss=wss",
        "{report}"
    );
    for ratio in [
        "req/s quic/wss",
        "p50 latency quic/wss",
        "p99 latency quic/wss",
    ] {
        assert!(
            report["ratios"].to_string().contains(ratio),
            "{ratio}: {report}"
        );
    }
    Ok(())
}

#[test]
fn a_reconnect_storm_runs_beside_the_tether_path_only() -> anyhow::Result<()> {
    let (report, _dir) = short_requests(&[
        "--paths",
        "direct,tether",
        "--storm-rate",
        "20",
        "--storm-agents",
        "3",
    ])?;
    for label in ["direct", "tether"] {
        let r =
            run_labelled(&report, label).with_context(|| format!("no {label} run: {report}"))?;
        assert!(r["requests"].as_u64().is_some_and(|n| n > 0), "{r}");
    }
    // Tunnels came up and went again beside the Tether path's requests, each one through the relay's whole
    // accept path (TLS, upgrade, registration), and none failed.
    assert!(
        figure(&report, "tether: storm tunnel connects").is_some_and(|rate| rate > 0.0),
        "{report}"
    );
    assert!(
        figure(&report, "tether: storm connect p50").is_some_and(|ms| ms > 0.0),
        "{report}"
    );
    assert_eq!(
        figure(&report, "tether: storm connect errors"),
        Some(0.0),
        "{report}"
    );
    // The direct path has no relay to storm.
    assert!(
        !report["figures"].to_string().contains("direct: storm"),
        "{report}"
    );
    assert_eq!(report["settings"]["storm_rate"], "20", "{report}");
    Ok(())
}

#[test]
fn bulk_counts_bytes_per_stream_count() -> anyhow::Result<()> {
    let (report, _dir) = run(
        "bulk",
        &[
            "--size",
            "2MiB",
            "--streams",
            "1,2",
            "--duration",
            "1s",
            "--warmup",
            "200ms",
            "--paths",
            "direct,tether",
            "--iperf-seconds",
            "1",
        ],
    )?;
    for label in ["direct ×1", "tether ×1", "direct ×2", "tether ×2"] {
        let r =
            run_labelled(&report, label).with_context(|| format!("no {label} run: {report}"))?;
        assert!(r["bytes"].as_u64().is_some_and(|b| b > 0), "{r}");
        assert!(r["mb_per_sec"].as_f64().is_some_and(|m| m > 0.0), "{r}");
    }
    assert!(
        report["ratios"]
            .to_string()
            .contains("MB/s ×2 tether/direct"),
        "{report}"
    );
    Ok(())
}

#[test]
fn hol_runs_three_phases() -> anyhow::Result<()> {
    let (report, _dir) = run(
        "hol",
        &[
            "--duration",
            "1s",
            "--warmup",
            "200ms",
            "--concurrency",
            "2",
            "--stall-size",
            "64MiB",
            // Few enough for a debug build to keep serving GETs beside them within a second.
            "--stalled-readers",
            "8",
            "--burst-clients",
            "8",
        ],
    )?;
    for label in [
        "tether baseline",
        "tether + stalled readers",
        "tether baseline again",
    ] {
        let r =
            run_labelled(&report, label).with_context(|| format!("no {label} run: {report}"))?;
        assert!(r["requests"].as_u64().is_some_and(|n| n > 0), "{r}");
    }
    assert!(
        figure(
            &report,
            "bytes the stalled readers read before stopping, together"
        )
        .is_some_and(|b| b > 0.0)
    );
    assert_eq!(report["targets"].as_array().map(Vec::len), Some(1));
    Ok(())
}

/// `tunnels` with six tunnels (`transport` given to `--transport` when set): five simulated agents and the real
/// one, all connected and still up after the idle period.
fn six_tunnels(transport: Option<&str>) -> anyhow::Result<(Value, tempfile::TempDir)> {
    let mut args = vec![
        "--count",
        "6",
        "--idle",
        "1s",
        "--heartbeat-interval",
        "1s",
        "--onboard-concurrency",
        "2",
    ];
    if let Some(t) = transport {
        args.extend(["--transport", t]);
    }
    let (report, dir) = run("tunnels", &args)?;
    let connects = run_labelled(&report, "tunnel connects").context("no connect run")?;
    // One of the six tunnels is the real agent's.
    assert_eq!(connects["requests"].as_u64(), Some(5), "{connects}");
    assert_eq!(
        figure(&report, "tunnels still up after the idle period"),
        Some(5.0)
    );
    Ok((report, dir))
}

#[test]
fn tunnels_holds_simulated_agents() -> anyhow::Result<()> {
    let (report, _dir) = six_tunnels(None)?;
    assert!(
        figure(&report, "relay RSS per tunnel").is_some(),
        "{report}"
    );
    assert!(
        figure(&report, "idle tether-agent RSS").is_some_and(|m| m > 0.0),
        "{report}"
    );
    Ok(())
}

#[test]
fn tunnels_holds_simulated_agents_over_quic() -> anyhow::Result<()> {
    let (report, _dir) = six_tunnels(Some("quic"))?;
    // The relay itself says the simulated agents' tunnels run on QUIC.
    assert_eq!(report["settings"]["sim_transport"], "quic", "{report}");
    assert_eq!(
        report["settings"]["sim_transport_at_relay"], "quic",
        "{report}"
    );
    assert!(
        figure(&report, "heartbeats sent during the idle period").is_some_and(|b| b > 0.0),
        "{report}"
    );
    Ok(())
}

#[test]
fn simulated_agents_do_not_race_transports() -> anyhow::Result<()> {
    let e = run("tunnels", &["--transport", "auto", "--count", "2"])
        .err()
        .context("tunnels --transport auto ran")?;
    assert!(format!("{e:#}").contains("not auto"), "{e:#}");
    Ok(())
}

/// `reconnect` with four agents (`transport` given to `--transport` when set): every one came back after the
/// relay's restart.
fn four_agents_back(transport: Option<&str>) -> anyhow::Result<(Value, tempfile::TempDir)> {
    let mut args = vec![
        "--count",
        "4",
        "--deadline",
        "60s",
        "--onboard-concurrency",
        "2",
    ];
    if let Some(t) = transport {
        args.extend(["--transport", t]);
    }
    let (report, dir) = run("reconnect", &args)?;
    let r = run_labelled(&report, "reconnects").context("no reconnect run")?;
    assert!(r["requests"].as_u64().is_some_and(|n| n >= 4), "{r}");
    assert!(
        figure(&report, "all agents back, after the new relay started").is_some(),
        "{report}"
    );
    Ok((report, dir))
}

#[test]
fn reconnect_brings_every_agent_back() -> anyhow::Result<()> {
    let (report, _dir) = four_agents_back(None)?;
    assert_eq!(
        report["settings"]["sim_transport_at_relay"], "wss",
        "{report}"
    );
    assert!(
        report["ratios"]
            .to_string()
            .contains("accept rate peak/mean"),
        "{report}"
    );
    Ok(())
}

#[test]
fn reconnect_brings_every_quic_agent_back() -> anyhow::Result<()> {
    let (report, _dir) = four_agents_back(Some("quic"))?;
    // Back on QUIC, as the new relay shows it.
    assert_eq!(
        report["settings"]["sim_transport_at_relay"], "quic",
        "{report}"
    );
    Ok(())
}
