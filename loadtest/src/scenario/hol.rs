//! `hol`: head-of-line blocking. Parallel GETs through the tunnel, first alone (baseline), then beside one
//! client that asked for a large response and stopped reading it (its own connection, the same tunnel),
//! then alone again. A tunnel without per-stream flow control would stall every stream behind the unread
//! one; Tether's should not.

use std::time::Duration;

use anyhow::Context as _;
use http::{Request, Uri, header};
use http_body_util::{BodyExt, Empty};
use tokio::sync::oneshot;

use crate::cli::{HolArgs, PathKind};
use crate::client::{self, Kind, LoadPlan, Protocol};
use crate::report::{Figure, Report, TargetCheck};
use crate::scenario::{CpuMeter, Env, stop_upstream};
use crate::upstream::paths;

const BASELINE: &str = "tether baseline";
const STALLED: &str = "tether + stalled reader";
const AFTER: &str = "tether baseline again";

/// Runs the scenario.
pub async fn run(env: &Env, args: &HolArgs) -> anyhow::Result<Report> {
    let mut report = Report::new("hol");
    report.setting("concurrency", args.concurrency);
    report.setting("duration", format!("{:?}", args.duration));
    report.setting("stall_size", format!("{} MiB", args.stall_size >> 20));
    report.setting("protocol", args.protocol);

    let up = env.upstream(1).await?;
    let paths = env.paths(&up, &[PathKind::Tether], &mut report).await?;
    let (target, procs) = paths
        .targets(&up)
        .into_iter()
        .find(|(t, _)| t.label == "tether")
        .context("no tether path")?;
    let tether = paths.tether.as_ref().context("no tether path")?;
    let plan = LoadPlan {
        concurrency: args.concurrency,
        warmup: args.warmup,
        duration: args.duration,
        schedule: vec![Kind {
            name: "get".into(),
            path: paths::GET.into(),
        }],
        request_timeout: Duration::from_secs(10),
        interval: Duration::from_millis(250),
        timeline_bytes: false,
    };

    let phase = |label: &'static str| {
        let client = paths.client(&up, args.protocol);
        let target = target.clone();
        let plan = plan.clone();
        let procs = procs.clone();
        let bar = env.bar(args.duration.as_secs(), label);
        async move {
            let client = client?;
            let meter = CpuMeter::start(&procs);
            let (outcome, timeline) = client::run_load(&client, &target, &plan, Some(&bar)).await?;
            bar.finish_and_clear();
            let result = outcome.into_result(label, &plan, &timeline);
            anyhow::Ok((result, meter))
        }
    };

    let (baseline, _) = phase(BASELINE).await?;
    report.runs.push(baseline);

    // The stalled reader: its own HTTP/1.1 connection, reads the head and the first chunk, then stops.
    let stall_client = paths.client(&up, Protocol::H1)?;
    let uri: Uri = format!("{}{}{}", target.base, paths::BULK, args.stall_size).parse()?;
    let (got_tx, got_rx) = oneshot::channel::<anyhow::Result<u64>>();
    let (release_tx, release_rx) = oneshot::channel::<()>();
    let stalled = tokio::spawn(async move {
        // Retried for a while: a tunnel that just failed under the baseline load may still be reconnecting.
        let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
        let result = loop {
            let attempt = async {
                let req = Request::get(uri.clone())
                    .header(header::AUTHORIZATION, "Bearer loadtest")
                    .body(Empty::new())?;
                let resp = stall_client.request(req).await?;
                anyhow::ensure!(
                    resp.status().is_success(),
                    "stalled request: HTTP {}",
                    resp.status()
                );
                let mut body = resp.into_body();
                let mut got = 0u64;
                while got == 0 {
                    match body.frame().await {
                        Some(frame) => got += frame?.into_data().map_or(0, |d| d.len() as u64),
                        None => anyhow::bail!("the stalled response ended early"),
                    }
                }
                anyhow::Ok((got, body))
            }
            .await;
            match attempt {
                Err(_) if tokio::time::Instant::now() < deadline => {
                    tokio::time::sleep(Duration::from_millis(200)).await;
                }
                other => break other,
            }
        };
        match result {
            Ok((got, body)) => {
                let _ = got_tx.send(Ok(got));
                // Hold the unread body until released.
                let _ = release_rx.await;
                drop(body);
            }
            Err(e) => {
                let _ = got_tx.send(Err(e));
            }
        }
    });
    let first_bytes = tokio::time::timeout(Duration::from_secs(40), got_rx)
        .await
        .context("the stalled reader got no data within 40 s")??
        .context("stalled reader")?;
    let relay_before = tether.relay.process().rss_kib();
    let agent_before = tether.agent.process().rss_kib();
    let (with_stall, _) = phase(STALLED).await?;
    let relay_during = tether.relay.process().rss_kib();
    let agent_during = tether.agent.process().rss_kib();
    let _ = release_tx.send(());
    let _ = stalled.await;
    report.runs.push(with_stall);
    report.figures.push(Figure::new(
        "bytes the stalled reader read before stopping",
        first_bytes as f64,
        "B",
    ));
    for (name, before, during) in [
        ("relay", relay_before, relay_during),
        ("agent", agent_before, agent_during),
    ] {
        if let (Some(b), Some(d)) = (before, during) {
            report.figures.push(Figure::new(
                format!("{name} RSS growth while the reader was stalled"),
                (d as f64 - b as f64) / 1024.0,
                "MiB",
            ));
        }
    }

    let (after, _) = phase(AFTER).await?;
    report.runs.push(after);
    let failed: Vec<String> = report
        .runs
        .iter()
        .filter(|r| r.errors > 0)
        .map(|r| {
            format!(
                "{}: {} failed GETs ({})",
                r.label,
                r.errors,
                r.error_samples.join("; ")
            )
        })
        .collect();
    if !failed.is_empty() {
        report.notes.push(format!(
            "requests failed, so the percentiles cover successes only: {}",
            failed.join(" / ")
        ));
    }
    for r in &report.runs {
        env.say(&format!(
            "{}: {:.0} req/s, p99 {:.2} ms",
            r.label,
            r.requests_per_sec,
            r.latency.as_ref().map_or(f64::NAN, |l| l.p99_ms)
        ));
    }
    ratios_and_targets(&mut report);
    paths.stop().await;
    stop_upstream(up).await;
    Ok(report)
}

fn ratios_and_targets(report: &mut Report) {
    let p99 = |r: &Report, l: &str| r.run(l).and_then(|x| x.latency.as_ref()).map(|s| s.p99_ms);
    let baseline = match (p99(report, BASELINE), p99(report, AFTER)) {
        (Some(a), Some(b)) => Some((a + b) / 2.0),
        (a, b) => a.or(b),
    };
    let stalled = p99(report, STALLED);
    report.ratio(
        "GET p99 baseline again / baseline (noise)",
        p99(report, AFTER),
        p99(report, BASELINE),
    );
    let ratio = report.ratio("GET p99 stalled / mean baseline", stalled, baseline);
    report.targets.push(TargetCheck::compare(
        "HOL: GET p99 within 10 % of its baseline (≤ 1.10×)",
        ratio,
        1.10,
        false,
        "×",
    ));
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::report::RunResult;
    use crate::stats::LatencySummary;

    fn run(label: &str, p99: f64) -> RunResult {
        RunResult {
            label: label.into(),
            latency: Some(LatencySummary {
                count: 1,
                min_ms: 0.0,
                mean_ms: 0.0,
                p50_ms: 0.0,
                p90_ms: 0.0,
                p99_ms: p99,
                p999_ms: 0.0,
                max_ms: 0.0,
                curve: Vec::new(),
            }),
            ..RunResult::default()
        }
    }

    #[test]
    fn stalled_p99_is_compared_with_the_mean_baseline() {
        let mut r = Report::new("hol");
        r.runs = vec![run(BASELINE, 2.0), run(STALLED, 3.6), run(AFTER, 4.0)];
        ratios_and_targets(&mut r);
        let ratio = r
            .ratios
            .iter()
            .find(|f| f.name.starts_with("GET p99 stalled"))
            .map(|f| f.value);
        assert_eq!(ratio, Some(1.2));
        assert_eq!(r.targets[0].met, Some(false));
        r.runs[1] = run(STALLED, 3.0);
        r.ratios.clear();
        r.targets.clear();
        ratios_and_targets(&mut r);
        assert_eq!(r.targets[0].met, Some(true));
    }
}
