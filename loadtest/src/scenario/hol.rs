//! `hol`: head-of-line blocking. Parallel GETs through the tunnel, first alone (baseline), then beside one
//! principal whose clients asked for large responses and stopped reading them (`--stalled-readers`, each on its
//! own connection, the same tunnel), then alone again, then beside another principal's open/cancel burst
//! (`--burst-clients` clients opening watches over HTTP/1.1 and dropping each within 10–50 ms). A tunnel
//! without per-stream flow control would stall every stream behind the unread ones, and one whose agent closes
//! the tunnel on early resets would fail every GET during the burst; Tether's should do neither.
//!
//! The load generator lifts the relay's per-client bounds; `--relay-arg=--principal-early-cancel-rate=10`
//! (and `…-burst=100`) keeps the relay's default early-cancellation bound for the burst's principal, and the
//! report says how many of the burst's watches the relay refused (429) and how many reached the cluster.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use anyhow::{Context as _, ensure};
use http::{Request, Uri, header};
use http_body_util::{BodyExt, Empty};
use tokio::sync::oneshot;

use crate::cli::{HolArgs, PathKind};
use crate::client::{self, Kind, LoadPlan, Protocol};
use crate::report::{Figure, Report, TargetCheck};
use crate::scenario::{Env, stop_upstream, transport_labels};
use crate::upstream::paths;

const BASELINE: &str = "baseline";
const STALLED: &str = "+ stalled readers";
const AFTER: &str = "baseline again";
const BURST: &str = "+ open/cancel burst";

/// A phase's run label on the Tether path `path` (`tether baseline`, `tether quic + stalled readers`, …).
fn phase_label(path: &str, phase: &str) -> String {
    format!("{path} {phase}")
}

/// Runs the scenario.
pub async fn run(env: &Env, args: &HolArgs) -> anyhow::Result<Report> {
    let mut report = Report::new("hol");
    report.setting("concurrency", args.concurrency);
    report.setting("duration", format!("{:?}", args.duration));
    report.setting("stall_size", format!("{} MiB", args.stall_size >> 20));
    report.setting("stalled_readers", args.stalled_readers);
    report.setting("burst_clients", args.burst_clients);
    report.setting("protocol", args.protocol);

    let up = env.upstream(1).await?;
    let paths = env.paths(&up, &[PathKind::Tether], &mut report).await?;
    ensure!(!paths.tether.is_empty(), "no tether path");
    let _loss = match args.tunnel_loss {
        Some(share) => {
            let loss = crate::loss::TunnelLoss::apply(&paths.tether, share)?;
            report.setting("tunnel_loss", share);
            report.notes.push(format!(
                "{:.1} % of the tunnel's packets dropped, both ways (iptables statistic match, {} rules); the \
                 client's and the upstream's hops without loss",
                share * 100.0,
                loss.rules()
            ));
            Some(loss)
        }
        None => None,
    };
    for tether in &paths.tether {
        measure(env, args, &up, &paths, tether, &mut report).await?;
    }
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
    let labels: Vec<String> = paths.tether.iter().map(|t| t.label.clone()).collect();
    for label in &labels {
        ratios_and_targets(&mut report, label);
    }
    transport_ratios(&mut report);
    paths.stop().await;
    stop_upstream(up).await;
    Ok(report)
}

/// The phases on one Tether path.
async fn measure(
    env: &Env,
    args: &HolArgs,
    up: &crate::scenario::UpstreamProcess,
    paths: &crate::scenario::Paths,
    tether: &crate::scenario::TetherPath,
    report: &mut Report,
) -> anyhow::Result<()> {
    let (target, _) = paths
        .targets(up)
        .into_iter()
        .find(|(t, _)| t.label == tether.label)
        .context("no tether path")?;
    let named = |phase: &str| phase_label(&tether.label, phase);
    // Figures of a path other than the default one say which.
    let prefix = match tether.label.as_str() {
        "tether" => String::new(),
        label => format!("{label}: "),
    };
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

    let phase = |label: String| {
        let client = paths.client(up, args.protocol);
        let target = target.clone();
        let plan = plan.clone();
        let bar = env.bar(args.duration.as_secs(), &label);
        async move {
            let client = client?;
            let (outcome, timeline) = client::run_load(&client, &target, &plan, Some(&bar)).await?;
            bar.finish_and_clear();
            anyhow::Ok(outcome.into_result(&label, &plan, &timeline))
        }
    };

    let baseline = phase(named(BASELINE)).await?;
    report.runs.push(baseline);

    // The stalled readers: each on its own HTTP/1.1 connection, reads the head and the first chunk, then stops.
    let uri: Uri = format!("{}{}{}", target.base, paths::BULK, args.stall_size).parse()?;
    let mut releases = Vec::new();
    let mut stalled = Vec::new();
    let mut got = Vec::new();
    for _ in 0..args.stalled_readers.max(1) {
        let stall_client = paths.client(up, Protocol::H1)?;
        let (got_tx, got_rx) = oneshot::channel::<anyhow::Result<u64>>();
        let (release_tx, release_rx) = oneshot::channel::<()>();
        stalled.push(tokio::spawn(stall(
            stall_client,
            uri.clone(),
            got_tx,
            release_rx,
        )));
        releases.push(release_tx);
        got.push(got_rx);
    }
    let mut first_bytes = 0;
    for got_rx in got {
        first_bytes += tokio::time::timeout(Duration::from_secs(40), got_rx)
            .await
            .context("a stalled reader got no data within 40 s")??
            .context("stalled reader")?;
    }
    let relay_before = tether.relay.process().rss_kib();
    let agent_before = tether.agent.process().rss_kib();
    let with_stall = phase(named(STALLED)).await?;
    let relay_during = tether.relay.process().rss_kib();
    let agent_during = tether.agent.process().rss_kib();
    for release in releases {
        let _ = release.send(());
    }
    for task in stalled {
        let _ = task.await;
    }
    report.runs.push(with_stall);
    report.figures.push(Figure::new(
        format!("{prefix}bytes the stalled readers read before stopping, together"),
        first_bytes as f64,
        "B",
    ));
    for (name, before, during) in [
        ("relay", relay_before, relay_during),
        ("agent", agent_before, agent_during),
    ] {
        if let (Some(b), Some(d)) = (before, during) {
            report.figures.push(Figure::new(
                format!("{prefix}{name} RSS growth while the reader was stalled"),
                (d as f64 - b as f64) / 1024.0,
                "MiB",
            ));
        }
    }

    let after = phase(named(AFTER)).await?;
    report.runs.push(after);

    if args.burst_clients > 0 {
        // Another principal's open/cancel burst, for the whole measured phase.
        let stop = Arc::new(AtomicBool::new(false));
        let opened = Arc::new(AtomicU64::new(0));
        let refused = Arc::new(AtomicU64::new(0));
        let reached = Arc::new(AtomicU64::new(0));
        let watch: Uri = format!("{}{}", target.base, paths::WATCH).parse()?;
        let mut burst = Vec::new();
        for seed in 0..args.burst_clients {
            let client = paths.client(up, Protocol::H1)?;
            burst.push(tokio::spawn(open_and_cancel(
                client,
                watch.clone(),
                seed,
                stop.clone(),
                BurstCounts {
                    opened: opened.clone(),
                    refused: refused.clone(),
                    reached: reached.clone(),
                },
            )));
        }
        let started = tokio::time::Instant::now();
        let with_burst = phase(named(BURST)).await?;
        stop.store(true, Ordering::Relaxed);
        let elapsed = started.elapsed().as_secs_f64();
        for task in burst {
            let _ = task.await;
        }
        report.runs.push(with_burst);
        let opened = opened.load(Ordering::Relaxed);
        report.figures.push(Figure::new(
            format!("{prefix}watches opened and dropped by the burst"),
            opened as f64,
            "",
        ));
        report.figures.push(Figure::new(
            format!("{prefix}burst rate (watches opened and dropped per second)"),
            opened as f64 / elapsed.max(0.001),
            "/s",
        ));
        let refused = refused.load(Ordering::Relaxed);
        let reached = reached.load(Ordering::Relaxed);
        report.figures.push(Figure::new(
            format!("{prefix}burst watches refused with 429 (by the relay's bounds or the agent's shedding)"),
            refused as f64,
            "",
        ));
        report.figures.push(Figure::new(
            format!("{prefix}burst watches that reached the cluster (200 head) per second"),
            reached as f64 / elapsed.max(0.001),
            "/s",
        ));
    }
    Ok(())
}

/// One stalled reader: asks for `uri`, reads the head and a first chunk, reports how much, then holds the unread
/// body until released.
async fn stall(
    client: crate::client::HttpClient,
    uri: Uri,
    got_tx: oneshot::Sender<anyhow::Result<u64>>,
    release_rx: oneshot::Receiver<()>,
) {
    // Retried for a while: a tunnel that just failed under the baseline load may still be reconnecting.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    let result = loop {
        let attempt = async {
            let req = Request::get(uri.clone())
                .header(header::AUTHORIZATION, "Bearer loadtest-stalled")
                .body(Empty::new())?;
            let resp = client.request(req).await?;
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
}

/// What the burst's clients saw.
struct BurstCounts {
    /// Watches asked for.
    opened: Arc<AtomicU64>,
    /// Answered 429 (the relay's per-client bounds, or the agent shedding).
    refused: Arc<AtomicU64>,
    /// Answered with a 2xx head (the watch reached the cluster) before it was dropped.
    reached: Arc<AtomicU64>,
}

/// One client of the open/cancel burst: opens a watch and drops it within 10–50 ms, until `stop`; a 429 does
/// not slow it down (an attacker ignores `Retry-After`).
async fn open_and_cancel(
    client: crate::client::HttpClient,
    uri: Uri,
    seed: usize,
    stop: Arc<AtomicBool>,
    counts: BurstCounts,
) {
    let mut i = 0usize;
    while !stop.load(Ordering::Relaxed) {
        let Ok(req) = Request::get(uri.clone())
            .header(header::AUTHORIZATION, "Bearer loadtest-burst")
            .body(Empty::new())
        else {
            return;
        };
        let linger = Duration::from_millis(10 + ((seed * 31 + i * 17) % 41) as u64);
        counts.opened.fetch_add(1, Ordering::Relaxed);
        // Dropping the request (or the response) closes its HTTP/1.1 connection: the relay resets the stream.
        if let Ok(Ok(resp)) = tokio::time::timeout(linger, client.request(req)).await {
            if resp.status() == http::StatusCode::TOO_MANY_REQUESTS {
                counts.refused.fetch_add(1, Ordering::Relaxed);
            } else if resp.status().is_success() {
                counts.reached.fetch_add(1, Ordering::Relaxed);
            }
            let mut body = resp.into_body();
            let _ = tokio::time::timeout(linger, body.frame()).await;
        }
        i += 1;
    }
}

fn ratios_and_targets(report: &mut Report, path: &str) {
    let p99 = |r: &Report, phase: &str| {
        r.run(&phase_label(path, phase))
            .and_then(|x| x.latency.as_ref())
            .map(|s| s.p99_ms)
    };
    let who = match path {
        "tether" => String::new(),
        path => format!("{path}: "),
    };
    let baseline = match (p99(report, BASELINE), p99(report, AFTER)) {
        (Some(a), Some(b)) => Some((a + b) / 2.0),
        (a, b) => a.or(b),
    };
    let stalled = p99(report, STALLED);
    report.ratio(
        &format!("{who}GET p99 baseline again / baseline (noise)"),
        p99(report, AFTER),
        p99(report, BASELINE),
    );
    let ratio = report.ratio(
        &format!("{who}GET p99 stalled / mean baseline"),
        stalled,
        baseline,
    );
    report.ratio(
        &format!("{who}GET p99 beside the open/cancel burst / mean baseline"),
        p99(report, BURST),
        baseline,
    );
    report.targets.push(TargetCheck::compare(
        format!("{who}HOL: GET p99 within 10 % of its baseline (≤ 1.10×)"),
        ratio,
        1.10,
        false,
        "×",
    ));
}

/// QUIC against WebSocket, phase by phase, when both were measured.
fn transport_ratios(report: &mut Report) {
    let (Some(quic), Some(wss)) = transport_labels(report) else {
        return;
    };
    let p99 = |r: &Report, path: &str, phase: &str| {
        r.run(&phase_label(path, phase))
            .and_then(|x| x.latency.as_ref())
            .map(|s| s.p99_ms)
    };
    let rps = |r: &Report, path: &str, phase: &str| {
        r.run(&phase_label(path, phase)).map(|x| x.requests_per_sec)
    };
    for phase in [BASELINE, STALLED, AFTER, BURST] {
        report.ratio(
            &format!("GET p99 {phase}: quic/wss"),
            p99(report, &quic, phase),
            p99(report, &wss, phase),
        );
        report.ratio(
            &format!("GET req/s {phase}: quic/wss"),
            rps(report, &quic, phase),
            rps(report, &wss, phase),
        );
    }
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
        r.runs = vec![
            run(&phase_label("tether", BASELINE), 2.0),
            run(&phase_label("tether", STALLED), 3.6),
            run(&phase_label("tether", AFTER), 4.0),
        ];
        ratios_and_targets(&mut r, "tether");
        let ratio = r
            .ratios
            .iter()
            .find(|f| f.name.starts_with("GET p99 stalled"))
            .map(|f| f.value);
        assert_eq!(ratio, Some(1.2));
        assert_eq!(r.targets[0].met, Some(false));
        r.runs[1] = run(&phase_label("tether", STALLED), 3.0);
        r.ratios.clear();
        r.targets.clear();
        ratios_and_targets(&mut r, "tether");
        assert_eq!(r.targets[0].met, Some(true));
    }
}
