//! `tether-loadtest`: measures Tether's throughput, latency and scale on one machine, side by side with the
//! direct path to the same upstream and with rathole (a well-known reverse tunnel), when asked for with HAProxy
//! (one HTTP proxy terminating TLS: the floor for an HTTP-aware gateway), and iperf3's raw loopback figure as
//! the physical limit.
//!
//! Scenarios ([`cli::Command`]): `requests` (kubectl-like get/list/watch from N concurrent clients, with
//! `--storm-rate` beside a reconnect storm of simulated agents' tunnels), `bulk`
//! (large streamed responses over one stream and many), `tunnels` (M idle tunnels on one relay: RSS, heartbeat
//! CPU, connect rate), `reconnect` (the relay restarted under M agents), `hol` (a stalled reader beside
//! parallel GETs on the same tunnel), `churn` (stream open/close cycles: relay and agent RSS and stream tables
//! before and after), `watches` (thousands of open watches from many principals through one tunnel to the
//! sample apiserver: latency beside them, memory per watch, the agent killed under them), `failover` (a local
//! relay fleet under GETs and watches: a replica killed, then all rolled). Each writes a [`report::Report`] as
//! JSON, a readable table and SVG plots.
//!
//! Tether is driven through its binaries (`tether-relay`, `tether-agent`), its admin REST API and its agent
//! endpoints, never by linking the relay or agent crates; simulated agents (for thousands of tunnels) use
//! `tether_tunnel` to dial. The upstream is a minimal HTTPS server in this crate ([`upstream`]) that does no
//! work, run as a child process; `watches` uses the test kit's sample apiserver instead ([`cluster`]), for
//! watches that behave like kube-apiserver's, and its development issuer for principals of their own.
//! `failover` runs the fleet of `tether up --replicas N` (`tether_cli::fleet`: relay and agent processes, a real
//! PostgreSQL and HAProxy, the sample apiserver in this process) and its traffic from `tether_testkit::traffic`.
//! Everything runs on 127.0.0.1, bounded in time and count, and every child
//! process is killed at the end.
//!
//! What it does not do: assert anything about timings (it measures; the targets are reported, not enforced),
//! or talk to anything but loopback.

pub mod certs;
pub mod cli;
pub mod client;
pub mod cluster;
pub mod loss;
pub mod peers;
pub mod plot;
pub mod procs;
pub mod report;
pub mod scenario;
pub mod sim;
pub mod stats;
pub mod tether;
pub mod upstream;
pub mod watches;

use cli::{BulkArgs, Cli, Command, HolArgs, ReconnectArgs, RequestsArgs, TunnelsArgs};
use report::Report;
use scenario::Env;

/// Runs the scenario `cli` names, writes its report(s) under `--out`, and returns them.
pub async fn run(cli: Cli) -> anyhow::Result<Vec<Report>> {
    tether_runtime::tls::install_crypto_provider();
    if let Command::Upstream(args) = &cli.command {
        scenario::serve_upstream(args).await?;
        return Ok(Vec::new());
    }
    procs::raise_nofile_limit();
    let env = Env::new(cli.common.clone())?;
    let mut reports = Vec::new();
    match &cli.command {
        Command::Requests(a) => {
            reports.push(finish(&env, scenario::requests::run(&env, a).await?)?)
        }
        Command::Bulk(a) => reports.push(finish(&env, scenario::bulk::run(&env, a).await?)?),
        Command::Tunnels(a) => reports.push(finish(&env, scenario::tunnels::run(&env, a).await?)?),
        Command::Reconnect(a) => {
            reports.push(finish(&env, scenario::reconnect::run(&env, a).await?)?)
        }
        Command::Hol(a) => reports.push(finish(&env, scenario::hol::run(&env, a).await?)?),
        Command::Churn(a) => reports.push(finish(&env, scenario::churn::run(&env, a).await?)?),
        Command::Watches(a) => reports.push(finish(&env, scenario::watches::run(&env, a).await?)?),
        Command::Failover(a) => {
            reports.push(finish(&env, scenario::failover::run(&env, a).await?)?)
        }
        Command::All => {
            reports.push(finish(
                &env,
                scenario::requests::run(&env, &RequestsArgs::default()).await?,
            )?);
            reports.push(finish(
                &env,
                scenario::bulk::run(&env, &BulkArgs::default()).await?,
            )?);
            reports.push(finish(
                &env,
                scenario::hol::run(&env, &HolArgs::default()).await?,
            )?);
            reports.push(finish(
                &env,
                scenario::tunnels::run(&env, &TunnelsArgs::default()).await?,
            )?);
            reports.push(finish(
                &env,
                scenario::reconnect::run(&env, &ReconnectArgs::default()).await?,
            )?);
        }
        Command::Upstream(_) => {}
    }
    Ok(reports)
}

/// Prints the table and writes the files of one report.
fn finish(env: &Env, report: Report) -> anyhow::Result<Report> {
    println!("{}", report.table());
    let written = report.write(&env.common.out)?;
    let names: Vec<String> = written.iter().map(|p| p.display().to_string()).collect();
    eprintln!("wrote {}", names.join(", "));
    Ok(report)
}
