//! `watches`: thousands of open watches through one tunnel (issue 17), with real processes end to end — the
//! relay with its product bounds, the agent, and the test kit's sample apiserver at kube-apiserver's 100 HTTP/2
//! streams per connection ([`crate::cluster`]). By default 2,000 watches come from 20 principals (100 each on
//! one HTTP/2 connection, like client-go informers) and 1,000 from one more (one HTTP/1.1 connection each,
//! like a kube-rs controller), each principal an Entra-style identity from a loopback address of its own.
//!
//! Phases, in one run so the figures compare: GETs (`/api/v1/namespaces`, what `kubectl get ns` asks) at a
//! fixed rate from yet another principal with nothing else open; the watches opened; the same GETs beside
//! them; `kubectl get ns` once (when kubectl is installed); the watches closed by their clients and the
//! agent's memory read once its tables are empty and again after `--settle`; the watches opened again and
//! the agent SIGKILLed, timing each watch's end from the signal.

use std::net::{IpAddr, Ipv4Addr};
use std::time::Duration;

use anyhow::Context as _;
use http::{Request, header};
use http_body_util::{BodyExt as _, Empty};
use hyper_util::rt::{TokioExecutor, TokioIo};
use serde_json::json;
use tokio::task::JoinSet;
use tokio::time::Instant;

use crate::cli::WatchesArgs;
use crate::cluster::{CLUSTER, ClusterOptions, SampleCluster};
use crate::procs;
use crate::report::{Figure, Report, RunResult, TargetCheck};
use crate::scenario::{CpuMeter, Env};
use crate::stats::Latency;
use crate::watches::{Group, Watches};

const IDLE: &str = "GET, no watch open";
const BESIDE: &str = "GET beside the open watches";
/// What the watches watch (the namespace holds one config map, so each gets a first event at once).
const WATCH_PATH: &str = "/api/v1/namespaces/default/configmaps?watch=1";
/// A bound on opening every watch, and on their ends.
const WAIT: Duration = Duration::from_secs(300);

fn address(a: u8, b: u8) -> IpAddr {
    IpAddr::V4(Ipv4Addr::new(127, 0, a, b))
}

/// Memory and tables at one moment.
#[derive(Debug, Clone, Copy, Default)]
struct Memory {
    relay_kib: u64,
    agent_kib: u64,
    sample_kib: u64,
}

fn memory(cluster: &SampleCluster) -> Memory {
    Memory {
        relay_kib: procs::rss_kib(cluster.relay.pid()).unwrap_or(0),
        agent_kib: cluster
            .agent()
            .and_then(|a| a.process().rss_kib())
            .unwrap_or(0),
        sample_kib: procs::rss_kib(cluster.sample_pid()).unwrap_or(0),
    }
}

/// Runs the scenario.
pub async fn run(env: &Env, args: &WatchesArgs) -> anyhow::Result<Report> {
    let mut report = Report::new("watches");
    report.setting("principals", args.principals);
    report.setting("watches_per_principal", args.watches_per_principal);
    report.setting("controller_watches", args.controller_watches);
    report.setting("get_rate", args.get_rate);
    report.setting("duration", format!("{:?}", args.duration));
    report.setting("settle", format!("{:?}", args.settle));
    report.setting("relay_args", env.common.relay_args.join(" "));
    report.setting(
        "agent_args",
        env.agent_args(env.common.transport.first().copied())
            .join(" "),
    );
    let bins = env.binaries()?;
    let mut cluster = SampleCluster::start(
        &bins,
        &env.dir("watches")?,
        &ClusterOptions {
            log_level: env.common.log_level.clone(),
            relay_args: env.common.relay_args.clone(),
            agent_args: env.agent_args(env.common.transport.first().copied()),
        },
    )
    .await?;
    let setup = cluster.principal("setup@loadtest.example")?;
    let (status, body) = cluster
        .request(
            address(0, 1),
            &setup,
            http::Method::POST,
            "/api/v1/namespaces/default/configmaps",
            Some(json!({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "watched"}})),
        )
        .await?;
    anyhow::ensure!(
        status.is_success(),
        "creating the watched config map: {status} {body:?}"
    );
    let prober = cluster.principal("prober@loadtest.example")?;
    let groups = groups(&cluster, args)?;
    let total: usize = groups.iter().map(|g| g.watches).sum();

    env.say("warm-up GETs");
    probe(
        &cluster,
        &prober,
        args.get_rate,
        Duration::from_secs(2),
        "warm-up",
    )
    .await?;
    let before = memory(&cluster);
    let mut pids = vec![
        ("relay".to_owned(), cluster.relay.pid()),
        ("sample apiserver".to_owned(), cluster.sample_pid()),
    ];
    if let Some(agent) = cluster.agent() {
        pids.push(("agent".to_owned(), agent.process().pid()));
    }
    env.say(&format!(
        "{IDLE}: {} s at {}/s",
        args.duration.as_secs(),
        args.get_rate
    ));
    let meter = CpuMeter::start(&pids);
    let idle = probe(&cluster, &prober, args.get_rate, args.duration, IDLE).await?;
    cpu_figures(&mut report, &meter, IDLE, idle.seconds);
    report.runs.push(idle);

    env.say(&format!("opening {total} watches"));
    let opening = Instant::now();
    let watches = Watches::open(&cluster, &groups, WATCH_PATH, WAIT).await?;
    let open_secs = opening.elapsed().as_secs_f64();
    let failures = watches.failures();
    if !failures.is_empty() {
        report.notes.push(format!(
            "{} of {total} watches failed to open, e.g. {:?}",
            failures.len(),
            &failures[..failures.len().min(3)]
        ));
    }
    let answered = watches.answered();
    let open = memory(&cluster);
    let upstream_connections = cluster
        .agent_gauge("tether_agent_upstream_connections")
        .await?;
    let upstream_requests = cluster
        .agent_gauge("tether_agent_upstream_requests")
        .await?;
    let relay_streams = cluster.relay_open_streams().await?;
    env.say(&format!(
        "{answered} of {total} answered in {open_secs:.1} s; {BESIDE}: {} s",
        args.duration.as_secs()
    ));
    let meter = CpuMeter::start(&pids);
    let beside = probe(&cluster, &prober, args.get_rate, args.duration, BESIDE).await?;
    cpu_figures(&mut report, &meter, BESIDE, beside.seconds);
    report.runs.push(beside);
    let during = memory(&cluster);
    let kubectl = kubectl_get_ns(env, &cluster).await;
    let still_open = watches.ended().is_empty();

    env.say("closing the watches");
    watches.close().await;
    let drained = Instant::now();
    let tables_empty = tables_empty(&cluster, relay_streams.saturating_sub(total as u64)).await;
    let drain_secs = drained.elapsed().as_secs_f64();
    let after = memory(&cluster);
    tokio::time::sleep(args.settle).await;
    let settled = memory(&cluster);

    env.say(&format!(
        "opening {total} watches again, then SIGKILL to the agent"
    ));
    let watches = Watches::open(&cluster, &groups, WATCH_PATH, WAIT).await?;
    let reopened = watches.answered();
    let again = memory(&cluster);
    let killed = cluster.kill_agent().await.context("no agent to kill")?;
    let ended = watches.wait_ended(reopened, WAIT).await;
    let mut end_latency = Latency::new();
    let mut clear = 0usize;
    let name = format!("cluster {CLUSTER}");
    for e in watches.ended() {
        end_latency.record(e.at.saturating_duration_since(killed));
        clear += usize::from(e.error_event.as_deref().is_some_and(|m| m.contains(&name)));
    }
    watches.close().await;
    cluster.stop().await;

    let kib_per_watch =
        |during: u64, before: u64| (during as f64 - before as f64) / answered.max(1) as f64;
    let relay_per_watch = kib_per_watch(open.relay_kib, before.relay_kib);
    let agent_per_watch = kib_per_watch(open.agent_kib, before.agent_kib);
    let mib = |kib: u64| kib as f64 / 1024.0;
    let ends = end_latency.summary();
    let figures = [
        (
            "watches answered (head and first event)",
            answered as f64,
            "",
        ),
        ("seconds to open them all", open_secs, "s"),
        (
            "watches still open after the GET phase and kubectl",
            f64::from(u8::from(still_open)),
            "yes=1",
        ),
        (
            "relay tunnel streams with the watches open (control included)",
            relay_streams as f64,
            "",
        ),
        (
            "agent upstream connections with the watches open",
            upstream_connections as f64,
            "",
        ),
        (
            "agent upstream requests with the watches open",
            upstream_requests as f64,
            "",
        ),
        ("relay memory per open watch", relay_per_watch, "KiB"),
        ("agent memory per open watch", agent_per_watch, "KiB"),
        (
            "sample apiserver memory per open watch",
            kib_per_watch(open.sample_kib, before.sample_kib),
            "KiB",
        ),
        ("relay RSS before", mib(before.relay_kib), "MiB"),
        (
            "relay RSS with the watches open",
            mib(open.relay_kib),
            "MiB",
        ),
        (
            "relay RSS after the GET phase beside them",
            mib(during.relay_kib),
            "MiB",
        ),
        (
            "relay RSS after the watches closed",
            mib(after.relay_kib),
            "MiB",
        ),
        ("agent RSS before", mib(before.agent_kib), "MiB"),
        (
            "agent RSS with the watches open",
            mib(open.agent_kib),
            "MiB",
        ),
        (
            "agent RSS after the GET phase beside them",
            mib(during.agent_kib),
            "MiB",
        ),
        (
            "agent RSS once its tables were empty",
            mib(after.agent_kib),
            "MiB",
        ),
        ("agent RSS after settling", mib(settled.agent_kib), "MiB"),
        (
            "agent RSS with the watches open again (memory reused, not leaked, if ≈ the first time)",
            mib(again.agent_kib),
            "MiB",
        ),
        (
            "relay RSS with the watches open again",
            mib(again.relay_kib),
            "MiB",
        ),
        (
            "seconds until the tables were empty after the clients closed",
            drain_secs,
            "s",
        ),
        (
            "watches open when the agent was killed",
            reopened as f64,
            "",
        ),
        ("watches ended after the kill", ended as f64, ""),
        (
            "of which with an ERROR event naming the cluster",
            clear as f64,
            "",
        ),
    ];
    for (name, value, unit) in figures {
        report.figures.push(Figure::new(name, value, unit));
    }
    if let Some(s) = &ends {
        for (name, value) in [
            ("watch end after agent SIGKILL, p50", s.p50_ms),
            ("watch end after agent SIGKILL, p99", s.p99_ms),
            ("watch end after agent SIGKILL, max", s.max_ms),
        ] {
            report.figures.push(Figure::new(name, value / 1000.0, "s"));
        }
    }
    match kubectl {
        Ok(secs) => {
            report
                .figures
                .push(Figure::new("kubectl get ns beside the watches", secs, "s"))
        }
        Err(e) => report.notes.push(format!("kubectl get ns: {e:#}")),
    }
    if !tables_empty {
        report
            .notes
            .push("the agent's and relay's stream tables did not empty within 60 s".to_owned());
    }
    let p99 = |r: &Report, l: &str| r.run(l).and_then(|x| x.latency.as_ref()).map(|s| s.p99_ms);
    let p50 = |r: &Report, l: &str| r.run(l).and_then(|x| x.latency.as_ref()).map(|s| s.p50_ms);
    let (idle99, beside99) = (p99(&report, IDLE), p99(&report, BESIDE));
    report.ratio(
        "GET p50 beside the watches / idle",
        p50(&report, BESIDE),
        p50(&report, IDLE),
    );
    let ratio = report.ratio("GET p99 beside the watches / idle", beside99, idle99);
    let back = report.ratio(
        "agent RSS after settling / before",
        Some(settled.agent_kib as f64),
        Some(before.agent_kib as f64),
    );
    report.targets.push(TargetCheck::compare(
        "GET p99 with the watches open ≤ 1.5× idle",
        ratio,
        1.5,
        false,
        "×",
    ));
    for (who, value) in [("relay", relay_per_watch), ("agent", agent_per_watch)] {
        report.targets.push(TargetCheck::compare(
            format!("{who} memory per open watch ≤ 32 KiB"),
            Some(value),
            32.0,
            false,
            " KiB",
        ));
    }
    report.targets.push(TargetCheck::compare(
        "every watch ends ≤ 1 s after the agent's SIGKILL (max)",
        ends.as_ref().map(|s| s.max_ms / 1000.0),
        1.0,
        false,
        " s",
    ));
    report.targets.push(TargetCheck::compare(
        "agent memory back within 20 % after the load",
        back,
        1.2,
        false,
        "×",
    ));
    env.say(&format!(
        "GET p99 {:.2} ms idle, {:.2} ms beside {answered} watches; {relay_per_watch:.1} KiB (relay) and \
         {agent_per_watch:.1} KiB (agent) per watch on {upstream_connections} upstream connections; agent RSS \
         {:.1} -> {:.1} -> {:.1} MiB; watch ends after SIGKILL: max {:.3} s",
        idle99.unwrap_or(f64::NAN),
        beside99.unwrap_or(f64::NAN),
        mib(before.agent_kib),
        mib(open.agent_kib),
        mib(settled.agent_kib),
        ends.as_ref().map_or(f64::NAN, |s| s.max_ms / 1000.0),
    ));
    Ok(report)
}

/// Each process's share of one core over a phase of `seconds`.
fn cpu_figures(report: &mut Report, meter: &CpuMeter, phase: &str, seconds: f64) {
    for (name, cpu) in meter.finish() {
        report.figures.push(Figure::new(
            format!("{name} CPU during \"{phase}\""),
            cpu.as_secs_f64() * 100.0 / seconds.max(0.001),
            "% of a core",
        ));
    }
}

/// The principals and their watches, as the options say.
fn groups(cluster: &SampleCluster, args: &WatchesArgs) -> anyhow::Result<Vec<Group>> {
    let mut groups = Vec::new();
    for i in 0..args.principals {
        let n = u8::try_from(i % 250 + 1).unwrap_or(1);
        let third = u8::try_from(1 + i / 250).unwrap_or(1);
        groups.push(Group {
            name: format!("informer-{i}"),
            token: cluster.principal(&format!("informer-{i}@loadtest.example"))?,
            from: address(third.min(99), n),
            watches: args.watches_per_principal,
            http2: true,
        });
    }
    if args.controller_watches > 0 {
        groups.push(Group {
            name: "controller".into(),
            token: cluster.principal("controller@loadtest.example")?,
            from: address(100, 1),
            watches: args.controller_watches,
            http2: false,
        });
    }
    Ok(groups)
}

/// GETs of `/api/v1/namespaces` at `rate` per second for `duration` on one HTTP/2 connection from a principal
/// and address of their own; each timed from its send to the end of its body.
async fn probe(
    cluster: &SampleCluster,
    token: &str,
    rate: u32,
    duration: Duration,
    label: &str,
) -> anyhow::Result<RunResult> {
    let tls = cluster.connect(address(101, 1), true).await?;
    let (sender, conn) =
        hyper::client::conn::http2::handshake(TokioExecutor::new(), TokioIo::new(tls)).await?;
    let conn = tokio::spawn(conn);
    let uri: http::Uri = format!(
        "{}{}/api/v1/namespaces",
        cluster.relay.url,
        cluster.prefix()
    )
    .parse()?;
    let mut tick = tokio::time::interval(Duration::from_secs_f64(1.0 / f64::from(rate.max(1))));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let started = Instant::now();
    let mut gets = JoinSet::new();
    while started.elapsed() < duration {
        tick.tick().await;
        let mut sender = sender.clone();
        let req = Request::get(uri.clone())
            .header(header::AUTHORIZATION, format!("Bearer {token}"))
            .header(header::ACCEPT, "application/json")
            .body(Empty::<bytes::Bytes>::new())?;
        gets.spawn(async move {
            let sent = Instant::now();
            let result = async {
                let resp = sender.send_request(req).await?;
                let status = resp.status();
                resp.into_body().collect().await?;
                anyhow::ensure!(status.is_success(), "HTTP {status}");
                anyhow::Ok(())
            };
            let result = tokio::time::timeout(Duration::from_secs(60), result).await;
            (sent.elapsed(), result)
        });
    }
    let mut latency = Latency::new();
    let (mut requests, mut errors, mut samples) = (0u64, 0u64, Vec::new());
    while let Some(done) = gets.join_next().await {
        let (took, result) = done?;
        match result {
            Ok(Ok(())) => {
                requests += 1;
                latency.record(took);
            }
            Ok(Err(e)) => {
                errors += 1;
                if samples.len() < 5 {
                    samples.push(format!("{e:#}"));
                }
            }
            Err(_) => {
                errors += 1;
                if samples.len() < 5 {
                    samples.push("no answer within 60 s".to_owned());
                }
            }
        }
    }
    conn.abort();
    let seconds = started.elapsed().as_secs_f64();
    Ok(RunResult {
        label: label.to_owned(),
        seconds,
        requests,
        errors,
        requests_per_sec: requests as f64 / seconds.max(0.001),
        latency: latency.summary(),
        error_samples: samples,
        ..RunResult::default()
    })
}

/// `kubectl get ns` through the relay as yet another principal; the seconds it took.
async fn kubectl_get_ns(env: &Env, cluster: &SampleCluster) -> anyhow::Result<f64> {
    let dir = env.dir("kubectl")?;
    let path = dir.join("kubeconfig");
    crate::tether::write_kubeconfig_with_token(
        &path,
        &format!("{}{}", cluster.relay.url, cluster.prefix()),
        &cluster.relay.ca_pem,
        &cluster.principal("kubectl-user@loadtest.example")?,
    )?;
    let kubectl = tether_testkit::kubectl::Kubectl::new(&path)?;
    let started = Instant::now();
    let out = kubectl
        .run(&["get", "ns", "--request-timeout", "60s"])
        .await?;
    anyhow::ensure!(out.success(), "kubectl get ns failed: {out}");
    Ok(started.elapsed().as_secs_f64())
}

/// Waits (at most 60 s) until the agent serves no stream and holds no upstream request, and the relay's
/// tunnel is back to `relay_baseline` streams.
async fn tables_empty(cluster: &SampleCluster, relay_baseline: u64) -> bool {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let streams = cluster.agent_gauge("tether_agent_open_streams").await;
        let upstream = cluster.agent_gauge("tether_agent_upstream_requests").await;
        let relay = cluster.relay_open_streams().await;
        if matches!((streams, upstream, relay), (Ok(0), Ok(0), Ok(r)) if r <= relay_baseline) {
            return true;
        }
        if Instant::now() > deadline {
            return false;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}
