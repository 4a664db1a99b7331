//! `requests`: N concurrent clients making kubectl-like requests (get, list, watch) on each path in turn.

use std::collections::HashMap;
use std::time::Duration;

use crate::cli::RequestsArgs;
use crate::client::{self, Kind, LoadPlan};
use crate::report::{Figure, Report, TargetCheck};
use crate::scenario::{Env, WindowMeter, stop_upstream, transport_labels};
use crate::sim::{self, Storm, StormOutcome};
use crate::upstream::paths;

/// The request kinds of a mix.
pub fn kinds(mix: &[(String, u32)]) -> Vec<(Kind, u32)> {
    mix.iter()
        .map(|(name, w)| {
            let path = match name.as_str() {
                "list" => paths::LIST,
                "watch" => paths::WATCH,
                _ => paths::GET,
            };
            (
                Kind {
                    name: name.clone(),
                    path: path.to_owned(),
                },
                *w,
            )
        })
        .collect()
}

/// Runs the scenario.
pub async fn run(env: &Env, args: &RequestsArgs) -> anyhow::Result<Report> {
    let mut report = Report::new("requests");
    report.setting("concurrency", args.concurrency);
    report.setting("duration", format!("{:?}", args.duration));
    report.setting("warmup", format!("{:?}", args.warmup));
    report.setting("protocol", args.protocol);
    report.setting(
        "mix",
        args.mix
            .0
            .iter()
            .map(|(k, w)| format!("{k}={w}"))
            .collect::<Vec<_>>()
            .join(","),
    );
    report.setting("list_items", args.list_items);
    report.setting("rathole_transport", env.common.rathole_transport);
    if args.storm_rate > 0 {
        report.setting("storm_rate", args.storm_rate);
        report.setting("storm_agents", args.storm_agents);
        report.setting("storm_transport", "wss");
    }

    let up = env.upstream(args.list_items).await?;
    let paths = env.paths(&up, &args.paths, &mut report).await?;
    let plan = LoadPlan {
        concurrency: args.concurrency,
        warmup: args.warmup,
        duration: args.duration,
        schedule: client::schedule(&kinds(&args.mix.0)),
        request_timeout: Duration::from_secs(10),
        interval: Duration::from_millis(250),
        timeline_bytes: false,
    };
    let targets = paths.targets(&up);
    // The storm's agents, onboarded at each Tether path's relay before anything is measured.
    let mut storm_agents = HashMap::new();
    if args.storm_rate > 0 {
        for t in &paths.tether {
            let agents =
                sim::onboard_many(&t.relay, "storm", args.storm_agents.max(1), 8, None).await?;
            storm_agents.insert(t.label.clone(), agents);
        }
    }
    for (target, procs) in &targets {
        let client = paths.client(&up, args.protocol)?;
        let storm = match storm_agents.get(&target.label) {
            Some(agents) => Some(Storm::start(agents.clone(), args.storm_rate)?),
            None => None,
        };
        let bar = env.bar(
            args.duration.as_secs(),
            &format!("requests via {}", target.label),
        );
        // CPU over the measured window only, where the run counts its requests.
        let meter = WindowMeter::start(procs, &plan);
        let (outcome, timeline) = client::run_load(&client, target, &plan, Some(&bar)).await?;
        bar.finish_and_clear();
        let result = outcome.into_result(&target.label, &plan, &timeline);
        env.say(&format!(
            "requests via {}: {:.0} req/s, p99 {:.2} ms, {} errors",
            target.label,
            result.requests_per_sec,
            result.latency.as_ref().map_or(f64::NAN, |l| l.p99_ms),
            result.errors
        ));
        meter
            .per_request_figures(&mut report, &target.label, result.requests)
            .await;
        if let Some(storm) = storm {
            storm_figures(&mut report, &target.label, storm.stop().await?);
        }
        report.runs.push(result);
    }
    for t in &paths.tether {
        // "agent RSS after the run" with the default agent, "tether quic: agent RSS …" per transport.
        let prefix = match t.label.as_str() {
            "tether" => String::new(),
            label => format!("{label}: "),
        };
        if let Some(kib) = t.agent.process().rss_kib() {
            report.figures.push(Figure::new(
                format!("{prefix}agent RSS after the run"),
                kib as f64 / 1024.0,
                "MiB",
            ));
        }
        if let Some(kib) = t.relay.process().rss_kib() {
            report.figures.push(Figure::new(
                format!("{prefix}relay RSS after the run"),
                kib as f64 / 1024.0,
                "MiB",
            ));
        }
    }
    ratios_and_targets(&mut report);
    paths.stop().await;
    stop_upstream(up).await;
    Ok(report)
}

/// What the storm beside a run did: its rate as achieved, how long a tunnel took to come up, what failed.
fn storm_figures(report: &mut Report, label: &str, storm: StormOutcome) {
    let secs = storm.elapsed.as_secs_f64().max(1e-9);
    report.figures.push(Figure::new(
        format!("{label}: storm tunnel connects"),
        storm.connects as f64 / secs,
        "connects/s",
    ));
    if let Some(latency) = storm.latency.summary() {
        report.figures.push(Figure::new(
            format!("{label}: storm connect p50"),
            latency.p50_ms,
            "ms",
        ));
        report.figures.push(Figure::new(
            format!("{label}: storm connect p99"),
            latency.p99_ms,
            "ms",
        ));
    }
    report.figures.push(Figure::new(
        format!("{label}: storm connect errors"),
        storm.errors as f64,
        "",
    ));
    report.figures.push(Figure::new(
        format!("{label}: storm ticks skipped (connects in flight at the bound)"),
        storm.skipped as f64,
        "",
    ));
    if let Some(e) = storm.first_error {
        report.setting(&format!("{label}: storm first error"), e);
    }
}

fn ratios_and_targets(report: &mut Report) {
    let rps = |r: &Report, l: &str| r.run(l).map(|x| x.requests_per_sec);
    let p50 = |r: &Report, l: &str| r.run(l).and_then(|x| x.latency.as_ref()).map(|s| s.p50_ms);
    let p99 = |r: &Report, l: &str| r.run(l).and_then(|x| x.latency.as_ref()).map(|s| s.p99_ms);
    let tether: Vec<String> = report
        .runs
        .iter()
        .map(|r| r.label.clone())
        .filter(|l| l.starts_with("tether"))
        .collect();
    let (d, r) = (rps(report, "direct"), rps(report, "rathole"));
    // HAProxy is measured only when asked for: its ratios appear only then.
    let h = rps(report, "haproxy");
    for label in &tether {
        let t = rps(report, label);
        let vs_direct = report.ratio(&format!("req/s {label}/direct"), t, d);
        let vs_rathole = report.ratio(&format!("req/s {label}/rathole"), t, r);
        report.ratio(&format!("req/s {label}/haproxy"), t, h);
        let (tp50, dp50, rp50) = (
            p50(report, label),
            p50(report, "direct"),
            p50(report, "rathole"),
        );
        report.ratio(&format!("p50 latency {label}/direct"), tp50, dp50);
        report.ratio(&format!("p50 latency {label}/rathole"), tp50, rp50);
        let hp50 = p50(report, "haproxy");
        report.ratio(&format!("p50 latency {label}/haproxy"), tp50, hp50);
        let (tp99, dp99, rp99) = (
            p99(report, label),
            p99(report, "direct"),
            p99(report, "rathole"),
        );
        report.ratio(&format!("p99 latency {label}/direct"), tp99, dp99);
        report.ratio(&format!("p99 latency {label}/rathole"), tp99, rp99);
        let hp99 = p99(report, "haproxy");
        report.ratio(&format!("p99 latency {label}/haproxy"), tp99, hp99);
        let who = match label.as_str() {
            "tether" => String::new(),
            label => format!("{label}: "),
        };
        report.targets.push(TargetCheck::compare(
            format!("{who}requests ≥ 1.0× rathole"),
            vs_rathole,
            1.0,
            true,
            "×",
        ));
        report.targets.push(TargetCheck::compare(
            format!("{who}requests ≥ 0.5× the direct path"),
            vs_direct,
            0.5,
            true,
            "×",
        ));
    }
    report.ratio("req/s rathole/direct", r, d);
    report.ratio("req/s haproxy/direct", h, d);
    if let (Some(quic), Some(wss)) = transport_labels(report) {
        report.ratio("req/s quic/wss", rps(report, &quic), rps(report, &wss));
        report.ratio(
            "p50 latency quic/wss",
            p50(report, &quic),
            p50(report, &wss),
        );
        report.ratio(
            "p99 latency quic/wss",
            p99(report, &quic),
            p99(report, &wss),
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::report::RunResult;

    #[test]
    fn kinds_map_to_upstream_paths() {
        let k = kinds(&[("get".into(), 2), ("list".into(), 1), ("watch".into(), 1)]);
        assert_eq!(k[0].0.path, paths::GET);
        assert_eq!(k[1].0.path, paths::LIST);
        assert_eq!(k[2].0.path, paths::WATCH);
        assert_eq!(k[0].1, 2);
    }

    #[test]
    fn targets_compare_against_both_peers() {
        let mut r = Report::new("requests");
        for (label, rps) in [("direct", 1000.0), ("tether", 600.0), ("rathole", 800.0)] {
            r.runs.push(RunResult {
                label: label.into(),
                requests_per_sec: rps,
                ..RunResult::default()
            });
        }
        ratios_and_targets(&mut r);
        assert_eq!(r.targets.len(), 2);
        assert_eq!(r.targets[0].met, Some(false)); // 0.75× rathole
        assert_eq!(r.targets[1].met, Some(true)); // 0.6× direct
        assert!(
            r.ratios
                .iter()
                .any(|f| f.name == "req/s tether/direct" && (f.value - 0.6).abs() < 1e-9)
        );
    }

    #[test]
    fn haproxy_gets_ratios_only_when_measured() {
        let run = |label: &str, rps: f64, p50_ms: f64| RunResult {
            label: label.into(),
            requests_per_sec: rps,
            latency: Some(crate::stats::LatencySummary {
                count: 1,
                min_ms: p50_ms,
                mean_ms: p50_ms,
                p50_ms,
                p90_ms: p50_ms,
                p99_ms: p50_ms * 2.0,
                p999_ms: p50_ms * 2.0,
                max_ms: p50_ms * 2.0,
                curve: Vec::new(),
            }),
            ..RunResult::default()
        };
        let mut r = Report::new("requests");
        r.runs.push(run("direct", 1000.0, 1.0));
        r.runs.push(run("tether", 600.0, 3.0));
        ratios_and_targets(&mut r);
        assert!(
            !r.ratios.iter().any(|f| f.name.contains("haproxy")),
            "{:?}",
            r.ratios
        );

        r.ratios.clear();
        r.targets.clear();
        r.runs.push(run("haproxy", 800.0, 2.0));
        ratios_and_targets(&mut r);
        let get = |n: &str| r.ratios.iter().find(|f| f.name == n).map(|f| f.value);
        assert_eq!(get("req/s tether/haproxy"), Some(0.75));
        assert_eq!(get("p50 latency tether/haproxy"), Some(1.5));
        assert_eq!(get("p99 latency tether/haproxy"), Some(1.5));
        assert_eq!(get("req/s haproxy/direct"), Some(0.8));
        // A reference, not a target: the targets stay those against direct and rathole.
        assert_eq!(r.targets.len(), 2);
    }

    #[test]
    fn transports_measured_side_by_side_get_their_ratio() {
        let mut r = Report::new("requests");
        for (label, rps) in [
            ("direct", 1000.0),
            ("tether quic", 700.0),
            ("tether wss", 500.0),
        ] {
            r.runs.push(RunResult {
                label: label.into(),
                requests_per_sec: rps,
                ..RunResult::default()
            });
        }
        ratios_and_targets(&mut r);
        let get = |n: &str| r.ratios.iter().find(|f| f.name == n).map(|f| f.value);
        assert_eq!(get("req/s quic/wss"), Some(1.4));
        assert_eq!(get("req/s tether quic/direct"), Some(0.7));
        assert_eq!(get("req/s tether wss/direct"), Some(0.5));
        assert_eq!(r.targets.len(), 4);
    }
}
