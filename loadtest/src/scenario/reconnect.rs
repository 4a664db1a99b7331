//! `reconnect`: M simulated agents connected to a relay that is stopped and started again on the same address
//! and data directory. Measures the time until every agent is back and the accept rate over time: its peak
//! against its mean (the agents' full-jitter backoff should flatten the peak).

use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;

use crate::cli::{ReconnectArgs, StopSignal};
use crate::report::{Figure, Report, RunResult, TargetCheck};
use crate::scenario::Env;
use tether_api::reconnect::Backoff;

use crate::sim::{self, Fleet, SimStats};
use crate::stats::{Timeline, peak_and_mean};
use crate::tether::RelayProcess;

/// Runs the scenario.
pub async fn run(env: &Env, args: &ReconnectArgs) -> anyhow::Result<Report> {
    let mut report = Report::new("reconnect");
    report.setting("count", args.count);
    report.setting("signal", format!("{:?}", args.signal).to_lowercase());
    report.setting("bin", format!("{:?}", args.bin));
    let transport = sim::SimTransport::from_flag(env.common.transport.first().copied())?;
    report.setting("sim_transport", transport.as_str());
    let nofile = crate::procs::raise_nofile_limit();
    report.setting("nofile_limit", nofile);

    let bins = env.binaries()?;
    let relay = env.relay("relay", None).await?;
    let (addr, data_dir) = (relay.addr, relay.data_dir.clone());

    let bar = env.bar(args.count as u64, "registering and onboarding");
    let agents = sim::onboard_many(
        &relay,
        "sim",
        args.count,
        args.onboard_concurrency,
        Some(&bar),
    )
    .await?;
    bar.finish_and_clear();
    let heartbeat = Duration::from_secs(30);
    let fleet = Fleet::start(
        &agents,
        transport,
        Backoff::default(),
        heartbeat,
        Some(args.connect_concurrency),
        None,
    );
    let n = args.count as u64;
    let bar = env.bar(n, "connecting tunnels");
    let limit = Duration::from_secs(120).max(Duration::from_millis(30 * n));
    fleet
        .wait_for(limit, Some(&bar), |s| SimStats::get(&s.connected) >= n)
        .await?;
    bar.finish_and_clear();
    fleet
        .wait_for(Duration::from_secs(60), None, |s| {
            SimStats::get(&s.control_accepted) + SimStats::get(&s.control_refused) >= n
        })
        .await?;
    let connects_before = SimStats::get(&fleet.stats().connects);
    let errors_before = SimStats::get(&fleet.stats().connect_errors);

    // Stop the relay; count every connect from now on.
    let span = args.deadline + Duration::from_secs(120);
    let accepts = Arc::new(Timeline::new(args.bin, span));
    fleet.count_accepts_in(accepts.clone());
    let t_stop = Instant::now();
    let signal = match args.signal {
        StopSignal::Term => "SIGTERM",
        StopSignal::Kill => "SIGKILL",
    };
    env.say(&format!("stopping the relay ({signal}) under {n} agents"));
    match args.signal {
        StopSignal::Term => {
            relay.stop(Duration::from_secs(30)).await;
        }
        StopSignal::Kill => relay.kill().await,
    }
    let stopped_in = t_stop.elapsed();
    // The restart is the new process's start: under a reconnect storm its /healthz answers late (it queues
    // behind the agents) while it already accepts tunnels.
    let t_start = Instant::now();
    let relay =
        RelayProcess::start(&bins.relay, &data_dir, Some(addr), &env.relay_options(None)).await?;
    let t_ready = Instant::now();
    let bar = env.bar(n, "agents back");
    let remaining = args.deadline.saturating_sub(t_stop.elapsed());
    let back = fleet
        .wait_for(remaining, Some(&bar), |s| {
            SimStats::get(&s.connected) >= n && SimStats::get(&s.connects) - connects_before >= n
        })
        .await;
    bar.finish_and_clear();
    let t_all = Instant::now();
    report.setting(
        "sim_transport_at_relay",
        sim::transport_at_relay(&relay, &agents).await,
    );
    let stats = fleet.stats();
    let reconnects = SimStats::get(&stats.connects) - connects_before;
    let failed_attempts = SimStats::get(&stats.connect_errors) - errors_before;
    let rejected = SimStats::get(&stats.rejected);
    match &back {
        Ok(_) => env.say(&format!(
            "all {n} agents back {:.2?} after the new relay started ({:.2?} after the stop)",
            t_all - t_start,
            t_all - t_stop
        )),
        Err(e) => report
            .notes
            .push(format!("not every agent came back: {e:#}")),
    }

    let elapsed = t_all - t_stop;
    let rates = accepts.rates(elapsed + args.bin, 1.0);
    let peak_mean = peak_and_mean(&rates);
    report.runs.push(RunResult {
        label: "reconnects".into(),
        seconds: elapsed.as_secs_f64(),
        requests: reconnects,
        errors: failed_attempts,
        requests_per_sec: reconnects as f64 / elapsed.as_secs_f64(),
        timeline_interval_ms: u64::try_from(args.bin.as_millis()).unwrap_or(u64::MAX),
        timeline_unit: "connects/s".into(),
        timeline: rates,
        ..RunResult::default()
    });
    report.figures.push(Figure::new(
        "relay stop took",
        stopped_in.as_secs_f64(),
        "s",
    ));
    report.figures.push(Figure::new(
        "new relay: start → /healthz answered",
        (t_ready - t_start).as_secs_f64(),
        "s",
    ));
    let back_after_start = back.is_ok().then(|| (t_all - t_start).as_secs_f64());
    if let Some(s) = back_after_start {
        report.figures.push(Figure::new(
            "all agents back, after the new relay started",
            s,
            "s",
        ));
        report.figures.push(Figure::new(
            "all agents back, after the stop",
            (t_all - t_stop).as_secs_f64(),
            "s",
        ));
    }
    report.figures.push(Figure::new(
        "failed connect attempts during the restart",
        failed_attempts as f64,
        "",
    ));
    report.figures.push(Figure::new(
        "attempts refused with an HTTP status",
        rejected as f64,
        "",
    ));
    let ratio = peak_mean.map(|(peak, mean)| {
        report.figures.push(Figure::new(
            format!("accept rate peak ({:?} bins)", args.bin),
            peak,
            "connects/s",
        ));
        report.figures.push(Figure::new(
            "accept rate mean (first to last accept)",
            mean,
            "connects/s",
        ));
        peak / mean
    });
    if let Some(r) = ratio {
        report
            .ratios
            .push(Figure::new("accept rate peak/mean", r, "×"));
    }
    // The same without the stragglers' tail: up to the bin where 99 % were back.
    if let Some(run) = report.runs.last() {
        let bin = args.bin.as_secs_f64();
        let mut cumulative = 0.0;
        let upto = run.timeline.iter().position(|r| {
            cumulative += r * bin;
            cumulative >= 0.99 * n as f64
        });
        if let Some(i) = upto {
            let back99 = (i + 1) as f64 * bin;
            let ratio99 = peak_and_mean(&run.timeline[..=i]).map(|(peak, mean)| peak / mean);
            report.figures.push(Figure::new(
                "99 % of agents back, after the stop (bin end)",
                back99,
                "s",
            ));
            if let Some(r) = ratio99 {
                report
                    .ratios
                    .push(Figure::new("accept rate peak/mean up to 99 % back", r, "×"));
            }
        }
    }
    let at = if args.count >= 10_000 {
        String::new()
    } else {
        format!(" (measured with {} agents)", args.count)
    };
    report.targets.push(TargetCheck::compare(
        format!("all agents back within 60 s of a relay restart{at}"),
        back_after_start,
        60.0,
        false,
        " s",
    ));
    report.targets.push(TargetCheck::compare(
        format!("peak accept rate ≤ 3× the mean{at}"),
        ratio,
        3.0,
        false,
        "×",
    ));
    fleet.shutdown().await;
    relay.stop(Duration::from_secs(15)).await;
    Ok(report)
}
