//! `bulk`: large streamed responses over one stream and over many, on each path, beside iperf3's raw
//! loopback figure.

use std::time::Duration;

use crate::cli::BulkArgs;
use crate::client::{self, Kind, LoadPlan};
use crate::peers;
use crate::report::{Figure, Report, TargetCheck};
use crate::scenario::{Env, WindowMeter, stop_upstream, transport_labels};
use crate::upstream::paths;

/// The label of a bulk run.
fn label(path: &str, streams: usize) -> String {
    format!("{path} ×{streams}")
}

/// Runs the scenario.
pub async fn run(env: &Env, args: &BulkArgs) -> anyhow::Result<Report> {
    let mut report = Report::new("bulk");
    report.setting("size", format!("{} MiB", args.size >> 20));
    report.setting(
        "streams",
        args.streams
            .iter()
            .map(usize::to_string)
            .collect::<Vec<_>>()
            .join(","),
    );
    report.setting("duration", format!("{:?}", args.duration));
    report.setting("protocol", args.protocol);
    report.setting("rathole_transport", env.common.rathole_transport);

    let up = env.upstream(1).await?;
    let paths = env.paths(&up, &args.paths, &mut report).await?;
    let targets = paths.targets(&up);
    for &streams in &args.streams {
        let plan = LoadPlan {
            concurrency: streams.max(1),
            warmup: args.warmup,
            duration: args.duration,
            schedule: vec![Kind {
                name: "bulk".into(),
                path: format!("{}{}", paths::BULK, args.size),
            }],
            request_timeout: args.warmup + args.duration + Duration::from_secs(60),
            interval: Duration::from_millis(250),
            timeline_bytes: true,
        };
        for (target, procs) in &targets {
            let client = paths.client(&up, args.protocol)?;
            let bar = env.bar(
                args.duration.as_secs(),
                &format!("bulk via {} ×{streams}", target.label),
            );
            let meter = WindowMeter::start(procs, &plan);
            let (outcome, timeline) = client::run_load(&client, target, &plan, Some(&bar)).await?;
            bar.finish_and_clear();
            let result = outcome.into_result(&label(&target.label, streams), &plan, &timeline);
            env.say(&format!(
                "bulk via {} ×{streams}: {:.0} MB/s, {} errors",
                target.label, result.mb_per_sec, result.errors
            ));
            // CPU per megabyte: divide by MB instead of requests.
            let mb = (result.bytes / 1_000_000).max(1);
            for (name, cpu) in meter.finish().await {
                report.figures.push(Figure::new(
                    format!("{}: {name} CPU per MB", result.label),
                    cpu.as_secs_f64() * 1e6 / mb as f64,
                    "µs",
                ));
            }
            report.runs.push(result);
        }
        if args.iperf_time.as_secs() > 0 {
            match env.iperf3_binary() {
                Some(bin) => {
                    match peers::iperf3(&bin, &env.work, args.iperf_time.as_secs(), streams).await {
                        Ok(mbps) => {
                            env.say(&format!("iperf3 ×{streams}: {mbps:.0} MB/s"));
                            report.figures.push(Figure::new(
                                format!("iperf3 ×{streams}"),
                                mbps,
                                "MB/s",
                            ));
                        }
                        Err(e) => report
                            .notes
                            .push(format!("iperf3 ×{streams} failed: {e:#}")),
                    }
                }
                None => report.notes.push(
                    "iperf3 not found (apt-get install iperf3): raw loopback figure skipped".into(),
                ),
            }
        }
    }
    ratios_and_targets(&mut report, &args.streams);
    paths.stop().await;
    stop_upstream(up).await;
    Ok(report)
}

fn ratios_and_targets(report: &mut Report, streams: &[usize]) {
    let suffix = |n: usize| format!(" ×{n}");
    let mut tether: Vec<String> = report
        .runs
        .iter()
        .filter(|r| r.label.starts_with("tether"))
        .filter_map(|r| {
            streams
                .iter()
                .find_map(|&n| r.label.strip_suffix(&suffix(n)).map(str::to_owned))
        })
        .collect();
    tether.sort();
    tether.dedup();
    if tether.is_empty() {
        tether.push("tether".to_owned());
    }
    for &n in streams {
        let mbps = |r: &Report, path: &str| r.run(&label(path, n)).map(|x| x.mb_per_sec);
        let iperf = report
            .figures
            .iter()
            .find(|f| f.name == format!("iperf3 ×{n}"))
            .map(|f| f.value);
        let (d, r) = (mbps(report, "direct"), mbps(report, "rathole"));
        // Only when asked for with `--paths …,haproxy`.
        let h = mbps(report, "haproxy");
        for path in &tether {
            let t = mbps(report, path);
            report.ratio(&format!("MB/s ×{n} {path}/direct"), t, d);
            let vs_rathole = report.ratio(&format!("MB/s ×{n} {path}/rathole"), t, r);
            report.ratio(&format!("MB/s ×{n} {path}/haproxy"), t, h);
            report.ratio(&format!("MB/s ×{n} {path}/iperf3"), t, iperf);
            let who = match path.as_str() {
                "tether" => String::new(),
                path => format!("{path}: "),
            };
            report.targets.push(TargetCheck::compare(
                format!("{who}bulk ×{n} ≥ 1.0× rathole"),
                vs_rathole,
                1.0,
                true,
                "×",
            ));
        }
        report.ratio(&format!("MB/s ×{n} direct/iperf3"), d, iperf);
        report.ratio(&format!("MB/s ×{n} rathole/iperf3"), r, iperf);
        report.ratio(&format!("MB/s ×{n} haproxy/iperf3"), h, iperf);
        if let (Some(quic), Some(wss)) = transport_labels(report) {
            report.ratio(
                &format!("MB/s ×{n} quic/wss"),
                mbps(report, &quic),
                mbps(report, &wss),
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::report::RunResult;

    #[test]
    fn each_transport_gets_its_ratios_once() {
        let mut r = Report::new("bulk");
        for (l, mbps) in [
            ("tether quic ×1", 300.0),
            ("tether wss ×1", 200.0),
            ("tether quic ×8", 400.0),
            ("tether wss ×8", 400.0),
        ] {
            r.runs.push(RunResult {
                label: l.into(),
                mb_per_sec: mbps,
                ..RunResult::default()
            });
        }
        ratios_and_targets(&mut r, &[1, 8]);
        let names: Vec<&str> = r.ratios.iter().map(|f| f.name.as_str()).collect();
        assert_eq!(names, ["MB/s ×1 quic/wss", "MB/s ×8 quic/wss"], "{names:?}");
        assert_eq!(r.ratios[0].value, 1.5);
        assert_eq!(r.targets.len(), 4);
    }

    #[test]
    fn haproxy_runs_get_their_ratios() {
        let mut r = Report::new("bulk");
        for (l, mbps) in [("tether ×1", 300.0), ("haproxy ×1", 600.0)] {
            r.runs.push(RunResult {
                label: l.into(),
                mb_per_sec: mbps,
                ..RunResult::default()
            });
        }
        r.figures.push(Figure::new("iperf3 ×1", 3000.0, "MB/s"));
        ratios_and_targets(&mut r, &[1]);
        let get = |n: &str| r.ratios.iter().find(|f| f.name == n).map(|f| f.value);
        assert_eq!(get("MB/s ×1 tether/haproxy"), Some(0.5));
        assert_eq!(get("MB/s ×1 haproxy/iperf3"), Some(0.2));
        // A reference, not a target: only the rathole target, not measurable here.
        assert_eq!(r.targets.iter().map(|t| t.met).collect::<Vec<_>>(), [None]);
    }

    #[test]
    fn ratios_use_matching_stream_counts() {
        let mut r = Report::new("bulk");
        for (l, mbps) in [
            ("tether ×1", 300.0),
            ("rathole ×1", 600.0),
            ("tether ×8", 700.0),
            ("rathole ×8", 700.0),
        ] {
            r.runs.push(RunResult {
                label: l.into(),
                mb_per_sec: mbps,
                ..RunResult::default()
            });
        }
        r.figures.push(Figure::new("iperf3 ×1", 3000.0, "MB/s"));
        ratios_and_targets(&mut r, &[1, 8]);
        let get = |n: &str| r.ratios.iter().find(|f| f.name == n).map(|f| f.value);
        assert_eq!(get("MB/s ×1 tether/rathole"), Some(0.5));
        assert_eq!(get("MB/s ×1 tether/iperf3"), Some(0.1));
        assert_eq!(get("MB/s ×8 tether/rathole"), Some(1.0));
        assert_eq!(get("MB/s ×8 tether/iperf3"), None);
        assert!(!r.ratios.iter().any(|f| f.name.contains("haproxy")));
        assert_eq!(
            r.targets.iter().map(|t| t.met).collect::<Vec<_>>(),
            [Some(false), Some(true)]
        );
    }
}
