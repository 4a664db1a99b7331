//! `tunnels`: M simulated agents hold idle tunnels to one relay. Measures the relay's RSS per tunnel, its CPU
//! for heartbeats over an idle period, the connect rate, and (with one real `tether-agent` beside them) the
//! RSS of an idle agent.

use std::sync::Arc;
use std::time::Duration;

use crate::cli::TunnelsArgs;
use crate::report::{Figure, Report, RunResult, TargetCheck};
use crate::scenario::{CpuMeter, Env, stop_upstream};
use tether_api::reconnect::Backoff;

use crate::sim::{self, Fleet, SimStats};
use crate::stats::Timeline;
use crate::tether::{AgentOptions, AgentProcess};

/// The scale target.
const TARGET_TUNNELS: usize = 10_000;

/// Runs the scenario.
pub async fn run(env: &Env, args: &TunnelsArgs) -> anyhow::Result<Report> {
    let mut report = Report::new("tunnels");
    report.setting("count", args.count);
    report.setting("idle", format!("{:?}", args.idle));
    report.setting(
        "heartbeat_interval",
        format!("{:?}", args.heartbeat_interval),
    );
    report.setting("connect_concurrency", args.connect_concurrency);
    let transport = sim::SimTransport::from_flag(env.common.transport.first().copied())?;
    report.setting("sim_transport", transport.as_str());
    let nofile = crate::procs::raise_nofile_limit();
    report.setting("nofile_limit", nofile);
    if (nofile as usize) < args.count + 200 {
        report.notes.push(format!(
            "open-files limit {nofile} is below {} tunnels + margin: raise `ulimit -n`",
            args.count
        ));
    }

    let bins = env.binaries()?;
    let relay = env.relay("relay", Some(args.heartbeat_interval)).await?;
    if !crate::tether::relay_supports(&bins.relay, "--heartbeat-interval") {
        report.notes.push(
            "this relay has no --heartbeat-interval flag: agents beat at the relay's default (or keepalive only)"
                .into(),
        );
    }

    // One real agent, idle, for the "idle agent RSS" figure.
    let mut real = None;
    if !args.no_real_agent {
        let up = env.upstream(1).await?;
        let kubeconfig = up.dir.join("kubeconfig");
        crate::tether::write_kubeconfig(&kubeconfig, &format!("https://{}", up.addr), &up.ca_pem)?;
        let token = relay.register("real-agent").await?;
        let agent = AgentProcess::start(
            &bins.agent,
            &relay,
            "real-agent",
            &token,
            &kubeconfig,
            &env.dir("agent")?,
            &AgentOptions {
                wrapper: env.common.agent_wrapper.clone(),
                log_level: env.common.log_level.clone(),
                extra_args: env.agent_args(env.common.transport.first().copied()),
            },
        )
        .await?;
        real = Some((up, agent));
    }
    let sims = args.count.saturating_sub(usize::from(real.is_some()));

    let bar = env.bar(sims as u64, "registering and onboarding");
    let started = tokio::time::Instant::now();
    let agents =
        sim::onboard_many(&relay, "sim", sims, args.onboard_concurrency, Some(&bar)).await?;
    bar.finish_and_clear();
    let onboard_secs = started.elapsed().as_secs_f64();
    report.figures.push(Figure::new(
        "registrations + onboardings per second (admin API + /agent/v1/onboard)",
        sims as f64 / onboard_secs,
        "/s",
    ));
    if let Some(a) = agents.first() {
        report.setting(
            "agent_identity",
            if a.uses_certificate() {
                "client certificate"
            } else {
                "bearer credential"
            },
        );
    }

    let relay_base = relay.process().rss_kib();
    // What a tunnel's connect costs the relay (TCP and TLS handshake, upgrade, registration, the control
    // stream's hello) and this process (the simulated agents' side). The heartbeats of the tunnels already up
    // fall in the same window, so a slower ramp reads a little higher.
    let meter = CpuMeter::start(&[("relay".to_owned(), relay.pid())]);
    let timeline = Arc::new(Timeline::new(
        Duration::from_millis(250),
        Duration::from_secs(600),
    ));
    let fleet = Fleet::start(
        &agents,
        transport,
        Backoff::default(),
        args.heartbeat_interval,
        Some(args.connect_concurrency),
        // Counted from the first task on: spawning thousands of tasks takes long enough for early connects.
        Some(timeline.clone()),
    );
    let bar = env.bar(sims as u64, "connecting tunnels");
    let limit = Duration::from_secs(120).max(Duration::from_millis(30 * sims as u64));
    let target = sims as u64;
    let connect_time = fleet
        .wait_for(limit, Some(&bar), |s| SimStats::get(&s.connected) >= target)
        .await?;
    bar.finish_and_clear();
    // Wait until every control stream has its answer, so the idle period really is idle.
    fleet
        .wait_for(Duration::from_secs(60), None, |s| {
            SimStats::get(&s.control_accepted) + SimStats::get(&s.control_refused) >= target
        })
        .await?;
    for (name, cpu) in meter.finish() {
        report.figures.push(Figure::new(
            format!("{name} CPU per tunnel connect"),
            cpu.as_secs_f64() * 1e6 / sims.max(1) as f64,
            "µs",
        ));
    }
    report.setting(
        "sim_transport_at_relay",
        sim::transport_at_relay(&relay, &agents).await,
    );
    let connect_rate = sims as f64 / connect_time.as_secs_f64();
    env.say(&format!(
        "{sims} tunnels up in {connect_time:.2?} ({connect_rate:.0}/s)"
    ));
    // A few failed first attempts retry after a backoff and stretch the total; the ramp's own rate is the
    // relay's accept rate.
    let rates = timeline.rates(connect_time + Duration::from_millis(250), 1.0);
    let mut cumulative = 0.0;
    let upto99 = rates.iter().position(|r| {
        cumulative += r * 0.25;
        cumulative >= 0.99 * sims as f64
    });
    if let Some(i) = upto99 {
        let secs = (i + 1) as f64 * 0.25;
        report.figures.push(Figure::new(
            "tunnel connect rate up to 99 % connected",
            0.99 * sims as f64 / secs,
            "connects/s",
        ));
    }
    let errors = SimStats::get(&fleet.stats().connect_errors);
    if errors > 0 {
        let first = fleet
            .stats()
            .first_error
            .lock()
            .ok()
            .and_then(|e| e.clone())
            .unwrap_or_default();
        report.notes.push(format!(
            "{errors} connect attempts failed and were retried with the agent's backoff (first: {first})"
        ));
    }
    report.runs.push(RunResult {
        label: "tunnel connects".into(),
        seconds: connect_time.as_secs_f64(),
        requests: sims as u64,
        errors: SimStats::get(&fleet.stats().connect_errors),
        requests_per_sec: connect_rate,
        timeline_interval_ms: 250,
        timeline_unit: "connects/s".into(),
        timeline: rates,
        ..RunResult::default()
    });
    let relay_connected = relay.process().rss_kib();
    let cpu_before = relay.process().cpu();
    let beats_before = SimStats::get(&fleet.stats().heartbeats);
    let own_before = crate::procs::rss_kib(std::process::id());

    let bar = env.bar(args.idle.as_secs(), "idle (heartbeats only)");
    let idle_start = tokio::time::Instant::now();
    while idle_start.elapsed() < args.idle {
        tokio::time::sleep(Duration::from_secs(1).min(args.idle)).await;
        bar.set_position(idle_start.elapsed().as_secs());
    }
    bar.finish_and_clear();
    let idle_secs = idle_start.elapsed().as_secs_f64();
    let cpu_after = relay.process().cpu();
    let beats = SimStats::get(&fleet.stats().heartbeats) - beats_before;
    let relay_idle = relay.process().rss_kib();
    let still_up = SimStats::get(&fleet.stats().connected);

    let mib = |kib: u64| kib as f64 / 1024.0;
    if let Some(b) = relay_base {
        report
            .figures
            .push(Figure::new("relay RSS before the tunnels", mib(b), "MiB"));
    }
    if let Some(c) = relay_connected {
        report
            .figures
            .push(Figure::new("relay RSS with the tunnels up", mib(c), "MiB"));
    }
    let per_tunnel = match (relay_base, relay_idle) {
        (Some(b), Some(i)) if sims > 0 => {
            report.figures.push(Figure::new(
                "relay RSS after the idle period",
                mib(i),
                "MiB",
            ));
            let per = (i as f64 - b as f64) / sims as f64;
            report
                .figures
                .push(Figure::new("relay RSS per tunnel", per, "KiB"));
            Some(per)
        }
        _ => None,
    };
    if let (Some(a), Some(b)) = (own_before, crate::procs::rss_kib(std::process::id())) {
        report.figures.push(Figure::new(
            "load client RSS per simulated agent",
            a.max(b) as f64 / sims.max(1) as f64,
            "KiB",
        ));
    }
    report.figures.push(Figure::new(
        "tunnel connect rate (all connected, retries included)",
        connect_rate,
        "connects/s",
    ));
    report.figures.push(Figure::new(
        "tunnels still up after the idle period",
        still_up as f64,
        "",
    ));
    report.figures.push(Figure::new(
        "heartbeats sent during the idle period",
        beats as f64,
        "",
    ));
    let control_refused = SimStats::get(&fleet.stats().control_refused);
    if control_refused > 0 {
        report.notes.push(format!(
            "the relay refused {control_refused} control streams (no control channel in this build): tunnels were \
             held by protocol keepalives only, so 'heartbeat CPU' is keepalive CPU"
        ));
    }
    if let (Some(a), Some(b)) = (cpu_before, cpu_after) {
        let cpu = b.saturating_sub(a).as_secs_f64();
        report.figures.push(Figure::new(
            "relay CPU while idle",
            cpu / idle_secs * 100.0,
            "% of a core",
        ));
        if beats > 0 {
            report.figures.push(Figure::new(
                "relay CPU per heartbeat",
                cpu * 1e6 / beats as f64,
                "µs",
            ));
        }
        report.figures.push(Figure::new(
            "relay CPU per tunnel per minute idle",
            cpu * 1e6 / sims.max(1) as f64 / (idle_secs / 60.0),
            "µs",
        ));
    }
    let agent_rss = real.as_ref().and_then(|(_, a)| a.process().rss_kib());
    if let Some(kib) = agent_rss {
        report
            .figures
            .push(Figure::new("idle tether-agent RSS", mib(kib), "MiB"));
    }
    let at = if sims + usize::from(real.is_some()) >= TARGET_TUNNELS {
        String::new()
    } else {
        format!(" (measured at {} tunnels)", args.count)
    };
    report.targets.push(TargetCheck::compare(
        format!("10,000 idle tunnels at ≤ 64 KiB relay RSS each{at}"),
        per_tunnel,
        64.0,
        false,
        " KiB",
    ));
    report.targets.push(TargetCheck::compare(
        "an idle agent ≤ 15 MB RSS",
        agent_rss.map(|k| k as f64 * 1024.0 / 1e6),
        15.0,
        false,
        " MB",
    ));

    fleet.shutdown().await;
    if let Some((up, agent)) = real {
        agent.stop(Duration::from_secs(5)).await;
        stop_upstream(up).await;
    }
    relay.stop(Duration::from_secs(15)).await;
    Ok(report)
}
