//! `churn`: stream open/close cycles through one tunnel (issue 10, fault injection), then the relay's and the
//! agent's memory (RSS) and stream tables against their baseline. Nine cycles in ten are a GET read to the
//! end over a keep-alive connection; one in ten is a watch dropped as soon as its head arrived (the stream is
//! reset mid-response, its connection closed). A leak of streams, upstream requests or per-stream memory
//! shows as tables that do not return to their baseline or RSS that keeps what the cycles took.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::time::Duration;

use anyhow::Context as _;
use http::{Request, Uri, header};
use http_body_util::{BodyExt, Empty};
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
use tokio::time::Instant;

use crate::cli::ChurnArgs;
use crate::client::{self, Protocol};
use crate::procs;
use crate::report::{Figure, Report};
use crate::scenario::{Env, stop_upstream};
use crate::tether::{AgentOptions, AgentProcess, RelayProcess};
use crate::upstream::paths;

const CLUSTER: &str = "loadtest";

/// What the tables and memory look like at one moment.
#[derive(Debug, Clone, Copy)]
struct Snapshot {
    relay_rss_kib: u64,
    agent_rss_kib: u64,
    relay_streams: u64,
    agent_streams: u64,
    agent_upstream_requests: u64,
}

/// Runs the scenario.
pub async fn run(env: &Env, args: &ChurnArgs) -> anyhow::Result<Report> {
    let mut report = Report::new("churn");
    report.setting("cycles", args.cycles);
    report.setting("concurrency", args.concurrency);
    report.setting("warmup_cycles", args.warmup_cycles);
    report.setting("cancel_every", args.cancel_every);

    let up = env.upstream(1).await?;
    let bins = env.binaries()?;
    let relay = env.relay("relay", None).await?;
    let token = relay.register(CLUSTER).await?;
    let kubeconfig = up.dir.join("kubeconfig");
    crate::tether::write_kubeconfig(&kubeconfig, &format!("https://{}", up.addr), &up.ca_pem)?;
    let metrics = SocketAddr::from(([127, 0, 0, 1], procs::free_port()?));
    let agent = AgentProcess::start(
        &bins.agent,
        &relay,
        CLUSTER,
        &token,
        &kubeconfig,
        &env.dir("agent")?,
        &AgentOptions {
            wrapper: env.common.agent_wrapper.clone(),
            log_level: env.common.log_level.clone(),
            extra_args: vec!["--health-listen".into(), metrics.to_string()],
        },
    )
    .await?;
    let client = client::http_client(&[&relay.ca_pem], Protocol::H1)?;
    let base = format!("{}/clusters/{CLUSTER}", relay.url);

    let idle = snapshot(&relay, &agent, metrics).await?;
    env.say(&format!("warm-up: {} cycles", args.warmup_cycles));
    cycles(env, &client, &base, args.warmup_cycles, args).await?;
    let before = settled(&relay, &agent, metrics, idle).await?;
    let started = Instant::now();
    let errors = cycles(env, &client, &base, args.cycles, args).await?;
    let secs = started.elapsed().as_secs_f64();
    drop(client);
    let after = settled(&relay, &agent, metrics, idle).await?;

    report.figures.push(Figure::new(
        "cycles per second",
        args.cycles as f64 / secs,
        "/s",
    ));
    report
        .figures
        .push(Figure::new("failed cycles", errors as f64, ""));
    for (name, value, unit) in [
        (
            "relay RSS before",
            before.relay_rss_kib as f64 / 1024.0,
            "MiB",
        ),
        (
            "relay RSS after",
            after.relay_rss_kib as f64 / 1024.0,
            "MiB",
        ),
        (
            "agent RSS before",
            before.agent_rss_kib as f64 / 1024.0,
            "MiB",
        ),
        (
            "agent RSS after",
            after.agent_rss_kib as f64 / 1024.0,
            "MiB",
        ),
        (
            "relay tunnel streams before (control stream included)",
            before.relay_streams as f64,
            "",
        ),
        ("relay tunnel streams after", after.relay_streams as f64, ""),
        ("agent open streams before", before.agent_streams as f64, ""),
        ("agent open streams after", after.agent_streams as f64, ""),
        (
            "agent upstream requests after",
            after.agent_upstream_requests as f64,
            "",
        ),
    ] {
        report.figures.push(Figure::new(name, value, unit));
    }
    let tables_back = after.relay_streams == idle.relay_streams
        && after.agent_streams == 0
        && after.agent_upstream_requests == 0;
    report.notes.push(if tables_back {
        "stream tables back to baseline after the cycles".to_owned()
    } else {
        format!("stream tables NOT back to baseline: idle {idle:?}, after {after:?}")
    });
    env.say(&format!(
        "{} cycles in {secs:.1} s; relay RSS {:.1} -> {:.1} MiB, agent RSS {:.1} -> {:.1} MiB; tables {}",
        args.cycles,
        before.relay_rss_kib as f64 / 1024.0,
        after.relay_rss_kib as f64 / 1024.0,
        before.agent_rss_kib as f64 / 1024.0,
        after.agent_rss_kib as f64 / 1024.0,
        if tables_back { "at baseline" } else { "NOT at baseline" },
    ));
    agent.stop(Duration::from_secs(5)).await;
    relay.stop(Duration::from_secs(5)).await;
    stop_upstream(up).await;
    Ok(report)
}

/// `count` cycles over `args.concurrency` workers; the number that failed.
async fn cycles(
    env: &Env,
    client: &client::HttpClient,
    base: &str,
    count: u64,
    args: &ChurnArgs,
) -> anyhow::Result<u64> {
    let get: Uri = format!("{base}{}", paths::GET).parse()?;
    let watch: Uri = format!("{base}{}", paths::WATCH).parse()?;
    let next = Arc::new(AtomicU64::new(0));
    let errors = Arc::new(AtomicU64::new(0));
    let bar = env.bar(count, "churn");
    let done = Arc::new(AtomicUsize::new(0));
    let mut workers = tokio::task::JoinSet::new();
    for _ in 0..args.concurrency.max(1) {
        let (client, get, watch) = (client.clone(), get.clone(), watch.clone());
        let (next, errors, done, bar) = (next.clone(), errors.clone(), done.clone(), bar.clone());
        let cancel_every = args.cancel_every;
        workers.spawn(async move {
            loop {
                let i = next.fetch_add(1, Ordering::Relaxed);
                if i >= count {
                    return;
                }
                let cancel = cancel_every > 0 && i % cancel_every == cancel_every - 1;
                let uri = if cancel { watch.clone() } else { get.clone() };
                let ok = tokio::time::timeout(Duration::from_secs(30), async {
                    let req = Request::get(uri)
                        .header(header::AUTHORIZATION, "Bearer loadtest")
                        .body(Empty::new())?;
                    let resp = client.request(req).await?;
                    anyhow::ensure!(resp.status().is_success(), "HTTP {}", resp.status());
                    if !cancel {
                        resp.into_body().collect().await?;
                    }
                    anyhow::Ok(())
                })
                .await;
                if !matches!(ok, Ok(Ok(()))) {
                    errors.fetch_add(1, Ordering::Relaxed);
                }
                if done.fetch_add(1, Ordering::Relaxed) % 1000 == 999 {
                    bar.inc(1000);
                }
            }
        });
    }
    while workers.join_next().await.is_some() {}
    bar.finish_and_clear();
    Ok(errors.load(Ordering::Relaxed))
}

/// A snapshot once the tables have returned to `idle` (or after 60 s, as they are).
async fn settled(
    relay: &RelayProcess,
    agent: &AgentProcess,
    metrics: SocketAddr,
    idle: Snapshot,
) -> anyhow::Result<Snapshot> {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let now = snapshot(relay, agent, metrics).await?;
        let back = now.relay_streams == idle.relay_streams
            && now.agent_streams == 0
            && now.agent_upstream_requests == 0;
        if back || Instant::now() > deadline {
            return Ok(now);
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

async fn snapshot(
    relay: &RelayProcess,
    agent: &AgentProcess,
    metrics: SocketAddr,
) -> anyhow::Result<Snapshot> {
    let cluster = relay.cluster(CLUSTER).await?;
    let text = agent_metrics(metrics).await?;
    Ok(Snapshot {
        relay_rss_kib: procs::rss_kib(relay.pid()).context("relay RSS")?,
        agent_rss_kib: agent.process().rss_kib().context("agent RSS")?,
        relay_streams: cluster["openStreams"]
            .as_u64()
            .context("the relay shows no openStreams (an older relay?)")?,
        agent_streams: gauge(&text, "tether_agent_open_streams")?,
        agent_upstream_requests: gauge(&text, "tether_agent_upstream_requests")?,
    })
}

/// The agent's `/metrics` text (plain HTTP on its health port).
async fn agent_metrics(addr: SocketAddr) -> anyhow::Result<String> {
    let mut tcp = tokio::net::TcpStream::connect(addr).await?;
    tcp.write_all(b"GET /metrics HTTP/1.0\r\nHost: agent\r\n\r\n")
        .await?;
    let mut text = String::new();
    tokio::time::timeout(Duration::from_secs(10), tcp.read_to_string(&mut text)).await??;
    Ok(text)
}

fn gauge(text: &str, name: &str) -> anyhow::Result<u64> {
    text.lines()
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(' '))
        .and_then(|v| v.trim().parse().ok())
        .with_context(|| format!("no {name} in the agent's /metrics (an older agent?)"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gauges_are_read_from_prometheus_text() {
        let text = "# HELP x\ntether_agent_open_streams 3\ntether_agent_open_streams_total 9\n";
        assert_eq!(gauge(text, "tether_agent_open_streams").ok(), Some(3));
        assert!(gauge(text, "tether_agent_upstream_requests").is_err());
    }
}
