//! `failover`: the local relay fleet of `tether up --replicas N` (relay processes on one PostgreSQL behind
//! HAProxy, the sample apiserver, a `tether-agent` process at the load balancer) under continuous GETs and open
//! watches through the load balancer.
//!
//! Phase 1 kills one replica holding a tunnel (SIGKILL) and measures the GETs that failed, when new GETs
//! succeeded again, and how long the dead replica's routes stayed in the admin API. Phase 2 rolls every replica
//! (SIGTERM one at a time, wait for it to exit, start it again, wait until it is back in rotation and the agent
//! has its tunnels again, next) and measures failed GETs and how each watch ended: cleanly (the client re-lists),
//! with an error, or not at all (a watch that hangs: after the roll a new object must reach every watcher).
//! Every step has a deadline; the scenario stops by itself.

use std::time::Duration;

use anyhow::Context as _;
use serde_json::Value;
use tether_cli::fleet::{DatabaseHome, Fleet, FleetBinaries, FleetOptions};
use tether_testkit::traffic::{self, Connection, Gets, Outcome, Target, WatchEnd, Watches};
use tokio::time::Instant;

use crate::cli::FailoverArgs;
use crate::report::{Figure, Report, RunResult, TargetCheck};
use crate::scenario::Env;

/// The collection the traffic reads and watches.
const CONFIGMAPS: &str = "/api/v1/namespaces/default/configmaps";
/// Width of the GET-rate bins in the plots.
const BIN: Duration = Duration::from_millis(250);

/// Runs the scenario.
pub async fn run(env: &Env, args: &FailoverArgs) -> anyhow::Result<Report> {
    let mut report = Report::new("failover");
    report.setting("replicas", args.replicas);
    report.setting("tunnels", args.tunnels);
    report.setting("clients", args.clients);
    report.setting("pause", format!("{:?}", args.pause));
    report.setting("watches", args.watches);
    report.setting("drain_timeout", format!("{:?}", args.drain_timeout));
    anyhow::ensure!(args.clients >= 2, "--clients must be at least 2");
    anyhow::ensure!(args.watches >= 1, "--watches must be at least 1");

    let bins = env.binaries()?;
    let binaries = FleetBinaries {
        relay: bins.relay,
        agent: bins.agent,
        haproxy: match &env.common.haproxy {
            Some(haproxy) => haproxy.clone(),
            None => tether_cli::fleet::haproxy_binary()?,
        },
    };
    let mut options = FleetOptions::for_tests(&env.dir("fleet")?, binaries);
    options.replicas = args.replicas;
    options.tunnels = args.tunnels;
    options.drain_timeout = args.drain_timeout;
    options.database = DatabaseHome::Temporary;
    options.log_level = env.common.log_level.clone();
    env.say(&format!(
        "starting the fleet: {} replicas on PostgreSQL behind HAProxy",
        args.replicas
    ));
    let mut fleet = Fleet::start(options).await?;
    let result = measure(env, args, &mut fleet, &mut report).await;
    fleet.shutdown().await?;
    result?;
    Ok(report)
}

async fn measure(
    env: &Env,
    args: &FailoverArgs,
    fleet: &mut Fleet,
    report: &mut Report,
) -> anyhow::Result<()> {
    let features = fleet.features;
    let fleet_work = features.relay_peering && features.agent_tunnels;
    if !fleet_work {
        report.notes.push(format!(
            "these builds lack the fleet work of issue 11 (relay peer link: {}, agent --tunnels: {}): requests \
             reach the cluster only through the replica holding its one tunnel, so most requests through the \
             load balancer fail",
            features.relay_peering, features.agent_tunnels
        ));
    }
    let k = usize::try_from(args.tunnels)
        .unwrap_or(usize::MAX)
        .min(args.replicas);
    wait_tunnels(fleet, k, fleet_work, args.step_timeout).await?;

    let target = Target {
        base: format!("{}/clusters/{}", fleet.lb_url, fleet.cluster()),
        ca_pem: fleet.ca_pem.clone(),
        token: fleet
            .user_token
            .clone()
            .context("the sample cluster's token")?,
    };
    let reused_clients = args.clients / 2;
    let reused = Gets::start(
        &target,
        CONFIGMAPS,
        reused_clients,
        Connection::Reused,
        args.pause,
    )?;
    let fresh = Gets::start(
        &target,
        CONFIGMAPS,
        args.clients - reused_clients,
        Connection::Fresh,
        args.pause,
    )?;
    let watches = Watches::start(
        &target,
        CONFIGMAPS,
        args.watches,
        (args.watches / 10).max(1),
        Connection::Reused,
    )?;
    let load_started = Instant::now();
    if let Err(e) = watches.wait_open(args.watches, args.step_timeout).await {
        report.notes.push(format!(
            "not every watch opened before the kill ({e}); {} open",
            watches.open()
        ));
    }
    tokio::time::sleep(args.settle).await;

    // Phase 1: SIGKILL of a replica holding a tunnel.
    let victim = victim(fleet).await;
    let victim_id = fleet.replicas()[victim].id.clone();
    env.say(&format!("phase 1: SIGKILL of {victim_id}"));
    let killed = Instant::now();
    fleet.kill_replica(victim).await?;
    let routes_gone = routes_gone(fleet, &victim_id, args.step_timeout).await;
    tokio::time::sleep_until(killed + args.settle.max(Duration::from_secs(2))).await;
    fleet.start_replica(victim).await?;
    wait_rotation(fleet, args.step_timeout).await?;
    wait_tunnels(fleet, k, fleet_work, args.step_timeout).await?;
    tokio::time::sleep(args.settle).await;

    // Phase 2: roll every replica.
    let rolled = Instant::now();
    for i in 0..fleet.replicas().len() {
        let id = fleet.replicas()[i].id.clone();
        env.say(&format!("phase 2: SIGTERM of {id}"));
        let started = Instant::now();
        fleet.terminate_replica(i).await?;
        let status = fleet
            .wait_replica_exit(i, args.drain_timeout + args.step_timeout)
            .await?;
        let exited = started.elapsed();
        fleet.start_replica(i).await?;
        wait_rotation(fleet, args.step_timeout).await?;
        wait_tunnels(fleet, k, fleet_work, args.step_timeout).await?;
        report.figures.push(Figure::new(
            format!("roll: {id} exited after SIGTERM ({status})"),
            exited.as_secs_f64(),
            "s",
        ));
        report.figures.push(Figure::new(
            format!("roll: {id} back in rotation with K tunnels, after SIGTERM"),
            started.elapsed().as_secs_f64(),
            "s",
        ));
    }
    let roll_done = Instant::now();

    // No watch may hang: an object made now reaches every watcher, by an event or by its next list.
    let sample = fleet
        .sample
        .as_ref()
        .context("the fleet runs the sample apiserver")?;
    sample.create_configmaps("default", "after-roll-", 1);
    let hung = watches
        .wait_seen_by_all("after-roll-0", args.settle.max(Duration::from_secs(10)))
        .await
        .err()
        .unwrap_or_default();
    let mut outcomes = reused.stop().await;
    outcomes.extend(fresh.stop().await);
    let watch_report = watches.stop().await;
    let ended = Instant::now();

    // Phase 1 figures.
    let phase1: Vec<Outcome> = within(&outcomes, killed, rolled);
    let kill = traffic::recovery(&phase1, killed);
    let recovered = if kill.failed == 0 {
        Some(0.0)
    } else {
        kill.succeeding_again.map(|d| d.as_secs_f64())
    };
    report.runs.push(run_result(
        &format!("phase 1: SIGKILL of {victim_id}"),
        &outcomes,
        load_started,
        killed,
        rolled,
    ));
    report
        .figures
        .push(Figure::new("kill: GETs failed", kill.failed as f64, ""));
    if let Some(last) = kill.last_failure {
        report.figures.push(Figure::new(
            "kill: last failed GET started after the kill",
            last.as_secs_f64(),
            "s",
        ));
    }
    if let Some(s) = recovered {
        report
            .figures
            .push(Figure::new("kill: new GETs succeed again after", s, "s"));
    }
    match routes_gone {
        Some(d) => report.figures.push(Figure::new(
            "kill: the dead replica's routes gone after",
            d.as_secs_f64(),
            "s",
        )),
        None => report.notes.push(format!(
            "the dead replica's routes were still listed {:?} after the kill (or the admin API lists no \
             tunnels[].replica)",
            args.step_timeout
        )),
    }
    let kill_ends = ends_within(&watch_report.ended, killed, rolled);
    report.figures.push(Figure::new(
        "kill: watches ended cleanly",
        kill_ends.0 as f64,
        "",
    ));
    report.figures.push(Figure::new(
        "kill: watches ended with an error",
        kill_ends.1 as f64,
        "",
    ));

    // Phase 2 figures.
    let phase2 = within(&outcomes, rolled, ended);
    let roll_failed = phase2.iter().filter(|o| !o.ok()).count();
    report.runs.push(run_result(
        "phase 2: rolling restart",
        &outcomes,
        load_started,
        rolled,
        ended,
    ));
    report.figures.push(Figure::new(
        "roll: took",
        (roll_done - rolled).as_secs_f64(),
        "s",
    ));
    report
        .figures
        .push(Figure::new("roll: GETs", phase2.len() as f64, ""));
    report
        .figures
        .push(Figure::new("roll: GETs failed", roll_failed as f64, ""));
    let roll_ends = ends_within(&watch_report.ended, rolled, ended);
    report.figures.push(Figure::new(
        "roll: watches ended cleanly (re-listed)",
        roll_ends.0 as f64,
        "",
    ));
    report.figures.push(Figure::new(
        "roll: watches ended with an ERROR event",
        roll_ends.2 as f64,
        "",
    ));
    report.figures.push(Figure::new(
        "roll: watches broken (transport error or refused)",
        (roll_ends.1 - roll_ends.2) as f64,
        "",
    ));
    report
        .figures
        .push(Figure::new("roll: watches hung", hung.len() as f64, ""));
    let lists = within(&watch_report.lists, rolled, ended);
    report.figures.push(Figure::new(
        "roll: watch lists (re-lists)",
        lists.len() as f64,
        "",
    ));
    report.figures.push(Figure::new(
        "roll: watch lists failed",
        lists.iter().filter(|o| !o.ok()).count() as f64,
        "",
    ));
    for e in watch_report.errors().iter().take(5) {
        report
            .notes
            .push(format!("a watch ended badly: {:?}", e.how));
    }

    report.targets.push(TargetCheck::compare(
        format!(
            "new requests succeed again within 1 s of a SIGKILL (K={})",
            args.tunnels
        ),
        recovered,
        1.0,
        false,
        " s",
    ));
    report.targets.push(TargetCheck::compare(
        "the dead replica's routes gone within 10 s",
        routes_gone.map(|d| d.as_secs_f64()),
        10.0,
        false,
        " s",
    ));
    report.targets.push(TargetCheck::compare(
        "0 failed GETs during a rolling restart",
        Some(roll_failed as f64),
        0.0,
        false,
        "",
    ));
    report.targets.push(TargetCheck::compare(
        "every watch ends cleanly during a rolling restart",
        Some(roll_ends.1 as f64),
        0.0,
        false,
        " ended badly",
    ));
    report.targets.push(TargetCheck::compare(
        "no watch hangs",
        Some(hung.len() as f64),
        0.0,
        false,
        " hung",
    ));
    Ok(())
}

/// The replica to kill: one holding a tunnel of the cluster (by the admin API's `tunnels[].replica`, else the
/// replica that reports the cluster connected), else the first.
async fn victim(fleet: &Fleet) -> usize {
    if let Ok(client) = fleet.client()
        && let Ok(cluster) = client.show_cluster_json(fleet.cluster()).await
        && let Some(i) = holders(&cluster)
            .first()
            .and_then(|id| fleet.replica_index(id))
    {
        return i;
    }
    for i in 0..fleet.replicas().len() {
        if fleet
            .cluster_at(i)
            .await
            .is_ok_and(|c| c["connected"] == true)
        {
            return i;
        }
    }
    0
}

fn holders(cluster: &Value) -> Vec<String> {
    cluster["tunnels"]
        .as_array()
        .map(|tunnels| {
            tunnels
                .iter()
                .filter_map(|t| t["replica"].as_str().map(str::to_owned))
                .collect()
        })
        .unwrap_or_default()
}

/// How long until no running replica lists a tunnel on `dead`; `None` past `limit`, or when no replica lists
/// tunnel replicas at all (nothing to measure).
async fn routes_gone(fleet: &Fleet, dead: &str, limit: Duration) -> Option<Duration> {
    let start = Instant::now();
    let mut ever_listed = false;
    while start.elapsed() < limit {
        let mut listed = false;
        for i in 0..fleet.replicas().len() {
            if !fleet.replica_running(i) {
                continue;
            }
            match fleet.cluster_at(i).await {
                Ok(cluster) => {
                    let held = holders(&cluster);
                    ever_listed |= !held.is_empty();
                    listed |= held.iter().any(|h| h == dead);
                }
                Err(_) => listed = true,
            }
        }
        if !listed {
            return ever_listed.then(|| start.elapsed());
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    None
}

async fn wait_rotation(fleet: &Fleet, limit: Duration) -> anyhow::Result<()> {
    let n = fleet.replicas().len();
    Ok(fleet.wait_in_rotation(n, limit).await?)
}

/// With the fleet work: until `k` distinct replicas hold a tunnel; without it: until a replica holds the one.
async fn wait_tunnels(
    fleet: &mut Fleet,
    k: usize,
    fleet_work: bool,
    limit: Duration,
) -> anyhow::Result<()> {
    if !fleet_work {
        return Ok(fleet.wait_connected(limit).await?);
    }
    let deadline = Instant::now() + limit;
    loop {
        let mut held = match fleet.client()?.show_cluster_json(fleet.cluster()).await {
            Ok(cluster) => holders(&cluster),
            Err(_) => Vec::new(),
        };
        held.sort();
        held.dedup();
        if held.len() >= k {
            return Ok(());
        }
        anyhow::ensure!(
            Instant::now() < deadline,
            "the agent did not get {k} tunnels on distinct replicas within {limit:?} (holders: {held:?})"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// The outcomes of requests started in `[from, to)`.
fn within(outcomes: &[Outcome], from: Instant, to: Instant) -> Vec<Outcome> {
    outcomes
        .iter()
        .filter(|o| o.started >= from && o.started < to)
        .cloned()
        .collect()
}

/// Watches that ended in `[from, to)`: (clean, not clean, of which with an ERROR event).
fn ends_within(ended: &[traffic::Ended], from: Instant, to: Instant) -> (usize, usize, usize) {
    let window = ended.iter().filter(|e| e.at >= from && e.at < to);
    let mut counts = (0, 0, 0);
    for e in window {
        match &e.how {
            WatchEnd::Clean => counts.0 += 1,
            WatchEnd::ErrorEvent(_) => {
                counts.1 += 1;
                counts.2 += 1;
            }
            WatchEnd::Broken(_) => counts.1 += 1,
        }
    }
    counts
}

/// A run of the report: the GETs started in `[from, to)`, with the rate of successful ones over the whole load
/// (bins of [`BIN`] from `load_started`) as its timeline.
fn run_result(
    label: &str,
    outcomes: &[Outcome],
    load_started: Instant,
    from: Instant,
    to: Instant,
) -> RunResult {
    let phase = within(outcomes, from, to);
    let errors = phase.iter().filter(|o| !o.ok()).count();
    let seconds = (to - from).as_secs_f64();
    let span = outcomes
        .iter()
        .map(|o| o.started.saturating_duration_since(load_started))
        .max()
        .unwrap_or_default();
    let bins = usize::try_from(span.as_millis() / BIN.as_millis()).unwrap_or(0) + 1;
    let mut timeline = vec![0.0; bins];
    for o in outcomes.iter().filter(|o| o.ok()) {
        let i = usize::try_from(
            o.started
                .saturating_duration_since(load_started)
                .as_millis()
                / BIN.as_millis(),
        )
        .unwrap_or(0);
        if let Some(slot) = timeline.get_mut(i) {
            *slot += 1.0 / BIN.as_secs_f64();
        }
    }
    let mut samples: Vec<String> = phase.iter().filter_map(|o| o.error.clone()).collect();
    samples.sort();
    samples.dedup();
    samples.truncate(5);
    RunResult {
        label: label.to_owned(),
        seconds,
        requests: phase.len() as u64,
        errors: errors as u64,
        requests_per_sec: if seconds > 0.0 {
            phase.len() as f64 / seconds
        } else {
            0.0
        },
        timeline_interval_ms: u64::try_from(BIN.as_millis()).unwrap_or(u64::MAX),
        timeline_unit: "successful GET/s".into(),
        timeline,
        error_samples: samples,
        ..RunResult::default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn outcomes_and_watch_ends_are_split_by_phase() {
        let t0 = Instant::now();
        let at = |ms: u64, ok: bool| Outcome {
            started: t0 + Duration::from_millis(ms),
            took: Duration::from_millis(1),
            error: (!ok).then(|| "refused".to_owned()),
        };
        let outcomes = vec![at(0, true), at(300, false), at(600, true), at(1200, true)];
        let ms = |n| t0 + Duration::from_millis(n);
        assert_eq!(within(&outcomes, ms(250), ms(1000)).len(), 2);
        let run = run_result("p", &outcomes, t0, ms(250), ms(1000));
        assert_eq!((run.requests, run.errors), (2, 1));
        assert_eq!(run.timeline.len(), 5);
        assert_eq!(run.error_samples, vec!["refused".to_owned()]);
        let end = |ms: u64, how: WatchEnd| traffic::Ended {
            watcher: 0,
            opened: t0,
            at: t0 + Duration::from_millis(ms),
            how,
            events: 1,
        };
        let ended = vec![
            end(100, WatchEnd::Clean),
            end(400, WatchEnd::Clean),
            end(500, WatchEnd::ErrorEvent("x".into())),
            end(700, WatchEnd::Broken("reset".into())),
        ];
        assert_eq!(ends_within(&ended, ms(250), ms(1000)), (1, 2, 1));
    }

    #[test]
    fn holders_come_from_the_tunnels_replicas() {
        let cluster =
            serde_json::json!({"tunnels": [{"replica": "relay-1"}, {"transport": "wss"}]});
        assert_eq!(holders(&cluster), vec!["relay-1".to_owned()]);
        assert!(holders(&serde_json::json!({})).is_empty());
    }
}
