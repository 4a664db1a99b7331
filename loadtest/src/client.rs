//! The load client: hyper (HTTP/1.1 keep-alive or h2) over rustls, and a worker pool that runs a request
//! schedule for a warm-up then a measured period, recording latency (HdrHistogram) and a timeline.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use clap::ValueEnum;
use http::{Request, Uri, header};
use http_body_util::{BodyExt, Empty};
use hyper_rustls::HttpsConnector;
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use indicatif::ProgressBar;
use serde::Serialize;
use tokio::time::Instant;

use crate::certs;
use crate::report::RunResult;
use crate::stats::{Latency, Timeline};

/// The HTTP version the load client speaks.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Protocol {
    /// HTTP/1.1 with keep-alive: one connection per concurrent worker.
    H1,
    /// HTTP/2: all workers share one connection per target.
    H2,
}

impl std::fmt::Display for Protocol {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Protocol::H1 => "h1",
            Protocol::H2 => "h2",
        })
    }
}

/// A pooled HTTPS client.
pub type HttpClient = Client<HttpsConnector<HttpConnector>, Empty<Bytes>>;

/// A client trusting the CAs in `ca_pems`, speaking `protocol`.
pub fn http_client(ca_pems: &[&str], protocol: Protocol) -> anyhow::Result<HttpClient> {
    let tls = (*certs::client_config(ca_pems, &[], None)?).clone();
    let mut http = HttpConnector::new();
    http.set_nodelay(true);
    http.enforce_http(false);
    let builder = hyper_rustls::HttpsConnectorBuilder::new()
        .with_tls_config(tls)
        .https_only();
    let mut client = Client::builder(TokioExecutor::new());
    client
        .pool_idle_timeout(Duration::from_secs(120))
        .pool_max_idle_per_host(usize::MAX);
    Ok(match protocol {
        Protocol::H1 => client.build(builder.enable_http1().wrap_connector(http)),
        Protocol::H2 => {
            client
                .http2_only(true)
                .http2_initial_stream_window_size(1024 * 1024)
                .http2_initial_connection_window_size(16 * 1024 * 1024);
            client.build(builder.enable_http2().wrap_connector(http))
        }
    })
}

/// Where requests go: a label and a base URL the request paths are appended to.
#[derive(Debug, Clone)]
pub struct Target {
    /// "tether", "direct", "rathole" or "haproxy".
    pub label: String,
    /// `https://127.0.0.1:PORT` (direct, rathole, haproxy) or `https://127.0.0.1:PORT/clusters/NAME` (through
    /// the relay).
    pub base: String,
}

/// Sends a GET for `uri` with a bearer token (the relay requires one; the upstream ignores it) and reads
/// the whole body, calling `on_data` with the size of each chunk. Returns the body size, or a short
/// description of the failure.
pub async fn fetch(
    client: &HttpClient,
    uri: Uri,
    mut on_data: impl FnMut(usize),
) -> Result<u64, String> {
    let req = Request::get(uri)
        .header(header::AUTHORIZATION, "Bearer loadtest")
        .header(header::ACCEPT, "application/json")
        .body(Empty::new())
        .map_err(|e| e.to_string())?;
    let resp = client.request(req).await.map_err(|e| error_chain(&e))?;
    let status = resp.status();
    let mut body = resp.into_body();
    let mut total = 0u64;
    while let Some(frame) = body.frame().await {
        let frame = frame.map_err(|e| format!("body: {}", error_chain(&e)))?;
        if let Ok(data) = frame.into_data() {
            total += data.len() as u64;
            on_data(data.len());
        }
    }
    if !status.is_success() {
        return Err(format!("HTTP {}", status.as_u16()));
    }
    Ok(total)
}

/// An error and its causes on one line.
pub fn error_chain(e: &(dyn std::error::Error + 'static)) -> String {
    let mut out = e.to_string();
    let mut cur = e.source();
    while let Some(err) = cur {
        let next = err.to_string();
        if !out.contains(&next) {
            out.push_str(": ");
            out.push_str(&next);
        }
        cur = err.source();
    }
    out
}

/// One kind of request in a schedule.
#[derive(Debug, Clone)]
pub struct Kind {
    /// Short name for the tables ("get", "list", "watch", "bulk").
    pub name: String,
    /// Path and query appended to the target's base URL.
    pub path: String,
}

/// A weighted mix expanded into a fixed round-robin schedule (deterministic: worker `w` starts at offset `w`).
pub fn schedule(mix: &[(Kind, u32)]) -> Vec<Kind> {
    mix.iter()
        .flat_map(|(k, w)| std::iter::repeat_n(k.clone(), *w as usize))
        .collect()
}

/// How to run a load.
#[derive(Debug, Clone)]
pub struct LoadPlan {
    /// Concurrent workers, each with one request in flight.
    pub concurrency: usize,
    /// Time before measuring (connections are set up, caches warm).
    pub warmup: Duration,
    /// Measured time.
    pub duration: Duration,
    /// Request kinds, round-robin.
    pub schedule: Vec<Kind>,
    /// Longest a request may take before it counts as an error.
    pub request_timeout: Duration,
    /// Timeline bucket width.
    pub interval: Duration,
    /// The timeline counts body megabytes (bulk) instead of completed requests.
    pub timeline_bytes: bool,
}

/// What a load measured on one target.
#[derive(Debug, Default)]
pub struct LoadOutcome {
    /// All latencies.
    pub latency: Latency,
    /// Latencies per kind.
    pub by_kind: BTreeMap<String, Latency>,
    /// Completed requests in the measured period.
    pub requests: u64,
    /// Failed requests in the measured period.
    pub errors: u64,
    /// Body bytes received in the measured period.
    pub bytes: u64,
    /// Distinct error messages and their counts.
    pub error_counts: BTreeMap<String, u64>,
}

impl LoadOutcome {
    fn merge(&mut self, other: LoadOutcome) {
        self.latency.merge(&other.latency);
        for (k, v) in other.by_kind {
            self.by_kind.entry(k).or_default().merge(&v);
        }
        self.requests += other.requests;
        self.errors += other.errors;
        self.bytes += other.bytes;
        for (k, v) in other.error_counts {
            *self.error_counts.entry(k).or_default() += v;
        }
    }

    /// The report row for this outcome.
    pub fn into_result(self, label: &str, plan: &LoadPlan, timeline: &Timeline) -> RunResult {
        let secs = plan.duration.as_secs_f64();
        let mut samples: Vec<(String, u64)> = self.error_counts.into_iter().collect();
        samples.sort_by_key(|s| std::cmp::Reverse(s.1));
        RunResult {
            label: label.to_owned(),
            seconds: secs,
            requests: self.requests,
            errors: self.errors,
            bytes: self.bytes,
            requests_per_sec: self.requests as f64 / secs,
            mb_per_sec: self.bytes as f64 / secs / 1e6,
            latency: self.latency.summary(),
            by_kind: if self.by_kind.len() > 1 {
                self.by_kind
                    .iter()
                    .filter_map(|(k, v)| {
                        v.summary().map(|mut s| {
                            s.curve.clear();
                            (k.clone(), s)
                        })
                    })
                    .collect()
            } else {
                BTreeMap::new()
            },
            timeline_interval_ms: u64::try_from(timeline.interval().as_millis())
                .unwrap_or(u64::MAX),
            timeline_unit: if plan.timeline_bytes { "MB/s" } else { "req/s" }.to_owned(),
            timeline: timeline.rates(plan.duration, if plan.timeline_bytes { 1e-6 } else { 1.0 }),
            error_samples: samples
                .into_iter()
                .take(5)
                .map(|(e, n)| format!("{n}× {e}"))
                .collect(),
        }
    }
}

/// Runs `plan` against `target` with `client`; the bar (if any) advances once per measured second.
pub async fn run_load(
    client: &HttpClient,
    target: &Target,
    plan: &LoadPlan,
    progress: Option<&ProgressBar>,
) -> anyhow::Result<(LoadOutcome, Arc<Timeline>)> {
    anyhow::ensure!(!plan.schedule.is_empty(), "empty request schedule");
    let uris: Vec<(String, Uri)> = plan
        .schedule
        .iter()
        .map(|k| {
            Ok((
                k.name.clone(),
                format!("{}{}", target.base, k.path).parse::<Uri>()?,
            ))
        })
        .collect::<anyhow::Result<_>>()?;
    let uris = Arc::new(uris);
    let start = Instant::now();
    let measure_from = start + plan.warmup;
    let end = measure_from + plan.duration;
    let timeline = Arc::new(Timeline::starting_at(
        measure_from,
        plan.interval,
        plan.duration,
    ));
    let mut workers = tokio::task::JoinSet::new();
    for w in 0..plan.concurrency {
        let client = client.clone();
        let uris = uris.clone();
        let timeline = timeline.clone();
        let plan = plan.clone();
        workers.spawn(async move {
            let mut out = LoadOutcome::default();
            let mut n = w;
            loop {
                let t0 = Instant::now();
                if t0 >= end {
                    break;
                }
                let (kind, uri) = &uris[n % uris.len()];
                n += 1;
                let measuring = t0 >= measure_from;
                let mut bytes_in_window = 0u64;
                let on_data = |len: usize| {
                    let now = Instant::now();
                    if now >= measure_from && now < end {
                        bytes_in_window += len as u64;
                        if plan.timeline_bytes {
                            timeline.add_at(now, len as u64);
                        }
                    }
                };
                let mut deadline = t0 + plan.request_timeout;
                if plan.timeline_bytes {
                    // Bulk transfers are cut at the end of the window; their bytes so far count.
                    deadline = deadline.min(end);
                }
                let result =
                    tokio::time::timeout_at(deadline, fetch(&client, uri.clone(), on_data)).await;
                let t1 = Instant::now();
                out.bytes += bytes_in_window;
                let in_window = measuring && t1 <= end;
                match result {
                    Ok(Ok(_)) if in_window => {
                        out.latency.record(t1 - t0);
                        out.by_kind.entry(kind.clone()).or_default().record(t1 - t0);
                        out.requests += 1;
                        if !plan.timeline_bytes {
                            timeline.add_at(t1, 1);
                        }
                    }
                    Ok(Ok(_)) => {}
                    // A bulk transfer cut at the end of the window is not an error.
                    Err(_) if plan.timeline_bytes && t1 >= end => {}
                    Ok(Err(e)) if measuring => {
                        out.errors += 1;
                        *out.error_counts.entry(e).or_default() += 1;
                    }
                    Err(_) if measuring => {
                        out.errors += 1;
                        *out.error_counts.entry("timed out".to_owned()).or_default() += 1;
                    }
                    Ok(Err(_)) | Err(_) => {
                        // Failures in the warm-up are not counted, but do not spin on them.
                        tokio::time::sleep(Duration::from_millis(10)).await;
                    }
                }
            }
            out
        });
    }
    let ticker = progress.cloned().map(|bar| {
        tokio::spawn(async move {
            let mut tick = tokio::time::interval_at(measure_from, Duration::from_secs(1));
            loop {
                tick.tick().await;
                bar.inc(1);
            }
        })
    });
    let mut total = LoadOutcome::default();
    while let Some(res) = workers.join_next().await {
        total.merge(res?);
    }
    if let Some(t) = ticker {
        t.abort();
    }
    Ok((total, timeline))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn schedule_expands_weights_in_order() {
        let k = |n: &str| Kind {
            name: n.into(),
            path: format!("/{n}"),
        };
        let s = schedule(&[(k("get"), 3), (k("list"), 1), (k("watch"), 0)]);
        let names: Vec<&str> = s.iter().map(|k| k.name.as_str()).collect();
        assert_eq!(names, ["get", "get", "get", "list"]);
    }

    #[test]
    fn error_chain_joins_causes_once() {
        let inner = std::io::Error::other("connection refused");
        let outer = std::io::Error::other(inner);
        assert_eq!(error_chain(&outer), "connection refused");
    }
}
