//! Kubernetes client traffic through one URL with every outcome recorded and timed: continuous GETs, and open
//! watches that re-list and watch again whenever their watch ends, as an informer does. The relay-fleet tests and
//! `tether-loadtest failover` run it through the load balancer while replicas are killed or rolled, then read
//! what failed, when, and how each watch ended.
//!
//! A watch ends one of three ways ([`WatchEnd`]): cleanly (the response ends; the client re-lists), with an
//! `ERROR` event, or broken (a transport error or a non-200 answer). One that stays open but no longer delivers
//! events (hangs) shows in [`Watches::wait_seen_by_all`]: the caller changes an object and every watcher must see
//! the change, by an event or by its next list.
//!
//! Two connection styles ([`Connection`]): `Reused` keeps HTTP/2 connections and multiplexes requests over them
//! (client-go, kube-rs, one kubectl process); `Fresh` opens a new TCP and TLS connection per request (many short
//! kubectl runs), so each request is placed anew by a load balancer.

use std::collections::BTreeSet;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use http::{Request, Response, StatusCode, header};
use http_body_util::{BodyExt as _, Empty};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use serde_json::Value;
use tokio::task::JoinSet;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

/// Why traffic could not be set up.
#[derive(Debug, thiserror::Error)]
#[error("traffic: {0}")]
pub struct TrafficError(String);

/// How long one GET or list may take before it counts as failed.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(10);
/// Largest list answer read.
const MAX_LIST: usize = 16 * 1024 * 1024;
/// Longest watch event line kept.
const MAX_EVENT: usize = 1024 * 1024;

/// Where the traffic goes.
#[derive(Clone)]
pub struct Target {
    /// The base URL requests are made under, e.g. `https://127.0.0.1:8443/clusters/demo`.
    pub base: String,
    /// The CA (PEM) the server's certificate chains to.
    pub ca_pem: String,
    /// The bearer token sent with every request.
    pub token: String,
}

impl std::fmt::Debug for Target {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Target")
            .field("base", &self.base)
            .field("token", &"***")
            .finish_non_exhaustive()
    }
}

/// How requests use connections.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Connection {
    /// HTTP/2 connections kept and shared (client-go, kube-rs).
    Reused,
    /// A new HTTP/1.1 connection per request (short kubectl runs).
    Fresh,
}

type HttpClient = Client<hyper_rustls::HttpsConnector<HttpConnector>, Empty<Bytes>>;

fn client(target: &Target, connection: Connection) -> Result<HttpClient, TrafficError> {
    let tls = crate::certs::client_config(target.ca_pem.as_bytes(), &[])
        .map_err(|e| TrafficError(e.to_string()))?;
    let builder = hyper_rustls::HttpsConnectorBuilder::new()
        .with_tls_config((*tls).clone())
        .https_only();
    match connection {
        Connection::Reused => {
            let connector = builder.enable_http2().build();
            Ok(Client::builder(TokioExecutor::new())
                .http2_only(true)
                .build(connector))
        }
        Connection::Fresh => {
            let connector = builder.enable_http1().build();
            Ok(Client::builder(TokioExecutor::new())
                .pool_max_idle_per_host(0)
                .build(connector))
        }
    }
}

fn get(target: &Target, path_and_query: &str) -> Result<Request<Empty<Bytes>>, String> {
    Request::get(format!("{}{path_and_query}", target.base))
        .header(header::AUTHORIZATION, format!("Bearer {}", target.token))
        .header(header::ACCEPT, "application/json")
        .body(Empty::new())
        .map_err(|e| e.to_string())
}

/// Sends a GET of `path_and_query`, once more if the server refused it unprocessed by closing the HTTP/2
/// connection gracefully as it was sent (GOAWAY with NO_ERROR or REFUSED_STREAM: a replica draining), as
/// client-go and kubectl do.
async fn send(
    client: &HttpClient,
    target: &Target,
    path_and_query: &str,
) -> Result<Response<hyper::body::Incoming>, String> {
    let mut retried = false;
    loop {
        match client.request(get(target, path_and_query)?).await {
            Err(e) if !retried && refused_by_goaway(&e) => retried = true,
            result => return result.map_err(|e| chain(&e)),
        }
    }
}

/// Whether `e` is an HTTP/2 stream the server did not process because the connection went away gracefully.
fn refused_by_goaway(e: &(dyn std::error::Error + 'static)) -> bool {
    let mut cur = Some(e);
    while let Some(err) = cur {
        if let Some(h2) = err.downcast_ref::<h2::Error>() {
            return matches!(
                h2.reason(),
                Some(h2::Reason::NO_ERROR | h2::Reason::REFUSED_STREAM)
            ) && (h2.is_go_away() || h2.is_reset());
        }
        cur = err.source();
    }
    false
}

/// One request's outcome.
#[derive(Debug, Clone)]
pub struct Outcome {
    /// When it started.
    pub started: Instant,
    /// How long it took.
    pub took: Duration,
    /// Why it failed; `None` for a 2xx answer read to its end.
    pub error: Option<String>,
}

impl Outcome {
    /// Whether it succeeded.
    pub fn ok(&self) -> bool {
        self.error.is_none()
    }
}

/// GETs `path` and reads the answer; the body on a 2xx.
async fn get_once(client: &HttpClient, target: &Target, path: &str) -> (Outcome, Option<Bytes>) {
    let started = Instant::now();
    let attempt = async {
        let response = send(client, target, path).await?;
        let status = response.status();
        let body = http_body_util::Limited::new(response.into_body(), MAX_LIST)
            .collect()
            .await
            .map_err(|e| format!("reading the answer: {e}"))?
            .to_bytes();
        if !status.is_success() {
            let text: String = String::from_utf8_lossy(&body).chars().take(300).collect();
            return Err(format!("{status}: {text}"));
        }
        Ok(body)
    };
    let result = match tokio::time::timeout(REQUEST_TIMEOUT, attempt).await {
        Ok(result) => result,
        Err(_) => Err(format!("no answer within {REQUEST_TIMEOUT:?}")),
    };
    let took = started.elapsed();
    match result {
        Ok(body) => (
            Outcome {
                started,
                took,
                error: None,
            },
            Some(body),
        ),
        Err(e) => (
            Outcome {
                started,
                took,
                error: Some(e),
            },
            None,
        ),
    }
}

fn chain(e: &dyn std::error::Error) -> String {
    let mut text = e.to_string();
    let mut source = e.source();
    while let Some(cause) = source {
        text.push_str(": ");
        text.push_str(&cause.to_string());
        source = cause.source();
    }
    text
}

/// Workers GETting one path in a loop until stopped.
pub struct Gets {
    stop: CancellationToken,
    tasks: JoinSet<()>,
    outcomes: Arc<Mutex<Vec<Outcome>>>,
}

impl std::fmt::Debug for Gets {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Gets").finish_non_exhaustive()
    }
}

impl Gets {
    /// Starts `workers` loops, each GETting `path` (under the target's base), pausing `pause` after each answer.
    pub fn start(
        target: &Target,
        path: &str,
        workers: usize,
        connection: Connection,
        pause: Duration,
    ) -> Result<Gets, TrafficError> {
        let stop = CancellationToken::new();
        let outcomes = Arc::new(Mutex::new(Vec::new()));
        let mut tasks = JoinSet::new();
        for _ in 0..workers {
            let client = client(target, connection)?;
            let (target, path, stop, outcomes) = (
                target.clone(),
                path.to_owned(),
                stop.clone(),
                outcomes.clone(),
            );
            tasks.spawn(async move {
                while !stop.is_cancelled() {
                    let run = get_once(&client, &target, &path);
                    let (outcome, _) = tokio::select! {
                        () = stop.cancelled() => break,
                        done = run => done,
                    };
                    lock(&outcomes).push(outcome);
                    tokio::select! {
                        () = stop.cancelled() => break,
                        () = tokio::time::sleep(pause) => {}
                    }
                }
            });
        }
        Ok(Gets {
            stop,
            tasks,
            outcomes,
        })
    }

    /// The outcomes so far, in the order they finished.
    pub fn outcomes(&self) -> Vec<Outcome> {
        lock(&self.outcomes).clone()
    }

    /// Stops the workers (requests in flight are dropped, not counted); every outcome.
    pub async fn stop(mut self) -> Vec<Outcome> {
        self.stop.cancel();
        while self.tasks.join_next().await.is_some() {}
        self.outcomes()
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// What the GETs after a moment (a replica killed) show.
#[derive(Debug, Clone, PartialEq)]
pub struct Recovery {
    /// Requests started at or after the moment.
    pub requests: usize,
    /// Of those, the ones that failed.
    pub failed: usize,
    /// When the last failed one started, after the moment (`None`: none failed).
    pub last_failure: Option<Duration>,
    /// When the first request that succeeded after the last failure started, after the moment; with no failure,
    /// the first success.
    pub succeeding_again: Option<Duration>,
    /// The failures' messages, deduplicated (at most 10).
    pub errors: Vec<String>,
}

/// How the GETs fared from `since` on.
pub fn recovery(outcomes: &[Outcome], since: Instant) -> Recovery {
    let mut after: Vec<&Outcome> = outcomes.iter().filter(|o| o.started >= since).collect();
    after.sort_by_key(|o| o.started);
    let failed: Vec<&&Outcome> = after.iter().filter(|o| !o.ok()).collect();
    let last_failure = failed.last().map(|o| o.started - since);
    let succeeding_again = after
        .iter()
        .filter(|o| o.ok() && last_failure.is_none_or(|last| o.started - since > last))
        .map(|o| o.started - since)
        .next();
    let errors: BTreeSet<String> = failed
        .iter()
        .filter_map(|o| o.error.clone())
        .take(10)
        .collect();
    Recovery {
        requests: after.len(),
        failed: failed.len(),
        last_failure,
        succeeding_again,
        errors: errors.into_iter().collect(),
    }
}

/// How one watch ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum WatchEnd {
    /// The response ended without error: the client re-lists and watches again.
    Clean,
    /// An `ERROR` event (its message) ended it.
    ErrorEvent(String),
    /// A transport error, or an answer other than 200 (the text says).
    Broken(String),
}

/// One ended watch.
#[derive(Debug, Clone)]
pub struct Ended {
    /// Which watcher.
    pub watcher: usize,
    /// When its watch was established (headers received).
    pub opened: Instant,
    /// When it ended.
    pub at: Instant,
    /// How.
    pub how: WatchEnd,
    /// Events it delivered (bookmarks included).
    pub events: u64,
}

/// What the watchers did.
#[derive(Debug, Clone)]
pub struct WatchReport {
    /// Every watch that ended (not counting the ones stopped at the end).
    pub ended: Vec<Ended>,
    /// Every list made (first ones and re-lists).
    pub lists: Vec<Outcome>,
    /// Watch requests refused or failed before their headers (also in `ended` as broken).
    pub failed_opens: usize,
}

impl WatchReport {
    /// Watches that ended cleanly.
    pub fn clean(&self) -> usize {
        self.ended
            .iter()
            .filter(|e| e.how == WatchEnd::Clean)
            .count()
    }

    /// Watches that ended with an ERROR event or broke.
    pub fn errors(&self) -> Vec<&Ended> {
        self.ended
            .iter()
            .filter(|e| e.how != WatchEnd::Clean)
            .collect()
    }

    /// Lists that failed.
    pub fn failed_lists(&self) -> Vec<&Outcome> {
        self.lists.iter().filter(|o| !o.ok()).collect()
    }
}

#[derive(Default)]
struct WatchState {
    /// Names each watcher has seen (by event or list).
    seen: Vec<Mutex<BTreeSet<String>>>,
    ended: Mutex<Vec<Ended>>,
    lists: Mutex<Vec<Outcome>>,
    open: AtomicUsize,
    failed_opens: AtomicUsize,
}

/// Watchers of one collection, each listing, watching from the list's resourceVersion, and doing it again when
/// the watch ends, until stopped.
pub struct Watches {
    stop: CancellationToken,
    tasks: JoinSet<()>,
    state: Arc<WatchState>,
}

impl std::fmt::Debug for Watches {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Watches")
            .field("open", &self.open())
            .finish_non_exhaustive()
    }
}

impl Watches {
    /// Starts `count` watchers of the collection at `path` (e.g. `/api/v1/namespaces/default/configmaps`),
    /// sharing `connections` clients (with [`Connection::Reused`], that many HTTP/2 connections at a time).
    pub fn start(
        target: &Target,
        path: &str,
        count: usize,
        connections: usize,
        connection: Connection,
    ) -> Result<Watches, TrafficError> {
        let clients = (0..connections.max(1))
            .map(|_| client(target, connection))
            .collect::<Result<Vec<_>, _>>()?;
        let state = Arc::new(WatchState {
            seen: (0..count).map(|_| Mutex::default()).collect(),
            ..WatchState::default()
        });
        let stop = CancellationToken::new();
        let mut tasks = JoinSet::new();
        for watcher in 0..count {
            let client = clients[watcher % clients.len()].clone();
            let (target, path, stop, state) =
                (target.clone(), path.to_owned(), stop.clone(), state.clone());
            tasks.spawn(async move {
                tokio::select! {
                    () = stop.cancelled() => {}
                    () = watch_loop(watcher, client, target, path, state) => {}
                }
            });
        }
        Ok(Watches { stop, tasks, state })
    }

    /// How many watches are established right now.
    pub fn open(&self) -> usize {
        self.state.open.load(Ordering::SeqCst)
    }

    /// Waits up to `limit` until at least `n` watches are established.
    pub async fn wait_open(&self, n: usize, limit: Duration) -> Result<(), crate::wait::TimedOut> {
        crate::wait::until(&format!("{n} open watches"), limit, || async {
            self.open() >= n
        })
        .await
    }

    /// The watchers that have not seen an object named `name` (in an event or a list).
    pub fn not_seen(&self, name: &str) -> Vec<usize> {
        self.state
            .seen
            .iter()
            .enumerate()
            .filter(|(_, seen)| !lock(seen).contains(name))
            .map(|(i, _)| i)
            .collect()
    }

    /// Waits up to `limit` until every watcher has seen `name`; on timeout, the ones that have not (their watch
    /// hangs, or they cannot list).
    pub async fn wait_seen_by_all(&self, name: &str, limit: Duration) -> Result<(), Vec<usize>> {
        let deadline = Instant::now() + limit;
        loop {
            let missing = self.not_seen(name);
            if missing.is_empty() {
                return Ok(());
            }
            if Instant::now() >= deadline {
                return Err(missing);
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// What happened so far.
    pub fn report(&self) -> WatchReport {
        WatchReport {
            ended: lock(&self.state.ended).clone(),
            lists: lock(&self.state.lists).clone(),
            failed_opens: self.state.failed_opens.load(Ordering::SeqCst),
        }
    }

    /// Stops every watcher (their open watches are dropped, not counted as ended); what happened.
    pub async fn stop(mut self) -> WatchReport {
        self.stop.cancel();
        while self.tasks.join_next().await.is_some() {}
        self.report()
    }
}

async fn watch_loop(
    watcher: usize,
    client: HttpClient,
    target: Target,
    path: String,
    state: Arc<WatchState>,
) {
    let mut failures: u32 = 0;
    loop {
        // List, as an informer does before each watch.
        let (outcome, body) = get_once(&client, &target, &path).await;
        let ok = outcome.ok();
        lock(&state.lists).push(outcome);
        let Some(rv) = body.and_then(|b| {
            let list: Value = serde_json::from_slice(&b).ok()?;
            note_names(&state, watcher, &list["items"]);
            list["metadata"]["resourceVersion"]
                .as_str()
                .map(str::to_owned)
        }) else {
            if ok {
                lock(&state.lists).push(Outcome {
                    started: Instant::now(),
                    took: Duration::ZERO,
                    error: Some("the list has no resourceVersion".into()),
                });
            }
            failures += 1;
            tokio::time::sleep(backoff(failures)).await;
            continue;
        };
        let how = watch_once(watcher, &client, &target, &path, &rv, &state).await;
        if matches!(how, Some(WatchEnd::Broken(_)) | None) {
            failures += 1;
            tokio::time::sleep(backoff(failures)).await;
        } else {
            failures = 0;
        }
    }
}

/// client-go's reflector backs off after failures; a clean end re-lists at once.
fn backoff(failures: u32) -> Duration {
    Duration::from_millis(100 * u64::from(failures.min(10)))
}

/// Runs one watch to its end; records and returns how it ended (`None`: it never opened, recorded as broken).
async fn watch_once(
    watcher: usize,
    client: &HttpClient,
    target: &Target,
    path: &str,
    rv: &str,
    state: &WatchState,
) -> Option<WatchEnd> {
    let separator = if path.contains('?') { '&' } else { '?' };
    let query = format!(
        "{path}{separator}watch=1&allowWatchBookmarks=true&resourceVersion={}",
        url::form_urlencoded::byte_serialize(rv.as_bytes()).collect::<String>()
    );
    let record = |opened: Instant, how: WatchEnd, events: u64| {
        lock(&state.ended).push(Ended {
            watcher,
            opened,
            at: Instant::now(),
            how: how.clone(),
            events,
        });
        how
    };
    let opened = Instant::now();
    let response = match tokio::time::timeout(REQUEST_TIMEOUT, send(client, target, &query)).await {
        Ok(Ok(r)) => r,
        Ok(Err(e)) => {
            state.failed_opens.fetch_add(1, Ordering::SeqCst);
            record(opened, WatchEnd::Broken(e), 0);
            return None;
        }
        Err(_) => {
            state.failed_opens.fetch_add(1, Ordering::SeqCst);
            record(
                opened,
                WatchEnd::Broken(format!("no answer within {REQUEST_TIMEOUT:?}")),
                0,
            );
            return None;
        }
    };
    if response.status() != StatusCode::OK {
        state.failed_opens.fetch_add(1, Ordering::SeqCst);
        let status = response.status();
        let body: String = http_body_util::Limited::new(response.into_body(), MAX_EVENT)
            .collect()
            .await
            .map(|b| {
                String::from_utf8_lossy(&b.to_bytes())
                    .chars()
                    .take(300)
                    .collect()
            })
            .unwrap_or_default();
        record(opened, WatchEnd::Broken(format!("{status}: {body}")), 0);
        return None;
    }
    state.open.fetch_add(1, Ordering::SeqCst);
    let _open = OpenGuard(&state.open);
    let mut body = response.into_body();
    let mut line = Vec::new();
    let mut events = 0u64;
    loop {
        let frame = match body.frame().await {
            None => return Some(record(opened, WatchEnd::Clean, events)),
            Some(Err(e)) => return Some(record(opened, WatchEnd::Broken(chain(&e)), events)),
            Some(Ok(frame)) => frame,
        };
        let Ok(data) = frame.into_data() else {
            continue;
        };
        for &byte in data.iter() {
            if byte != b'\n' {
                if line.len() < MAX_EVENT {
                    line.push(byte);
                }
                continue;
            }
            let event: Value = match serde_json::from_slice(&line) {
                Ok(v) => v,
                Err(e) => {
                    let how = WatchEnd::Broken(format!("not a watch event: {e}"));
                    return Some(record(opened, how, events));
                }
            };
            line.clear();
            events += 1;
            match event["type"].as_str() {
                Some("ERROR") => {
                    let message = event["object"]["message"]
                        .as_str()
                        .unwrap_or("(no message)")
                        .to_owned();
                    return Some(record(opened, WatchEnd::ErrorEvent(message), events));
                }
                Some("ADDED" | "MODIFIED" | "DELETED") => {
                    if let Some(name) = event["object"]["metadata"]["name"].as_str() {
                        lock(&state.seen[watcher]).insert(name.to_owned());
                    }
                }
                _ => {}
            }
        }
    }
}

/// Counts a watch as open for as long as it lives (also when its task is stopped).
struct OpenGuard<'a>(&'a AtomicUsize);

impl Drop for OpenGuard<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}

fn note_names(state: &WatchState, watcher: usize, items: &Value) {
    let Some(items) = items.as_array() else {
        return;
    };
    let mut seen = lock(&state.seen[watcher]);
    for item in items {
        if let Some(name) = item["metadata"]["name"].as_str() {
            seen.insert(name.to_owned());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn outcome(since: Instant, ms: u64, ok: bool) -> Outcome {
        Outcome {
            started: since + Duration::from_millis(ms),
            took: Duration::from_millis(5),
            error: (!ok).then(|| format!("failed at {ms}")),
        }
    }

    #[tokio::test(start_paused = true)]
    async fn recovery_is_measured_from_the_moment() {
        let t = Instant::now() + Duration::from_secs(1);
        let outcomes = vec![
            outcome(t - Duration::from_millis(500), 0, false),
            outcome(t, 10, true),
            outcome(t, 100, false),
            outcome(t, 300, false),
            outcome(t, 350, true),
            outcome(t, 900, true),
        ];
        let r = recovery(&outcomes, t);
        assert_eq!(r.requests, 5);
        assert_eq!(r.failed, 2);
        assert_eq!(r.last_failure, Some(Duration::from_millis(300)));
        assert_eq!(r.succeeding_again, Some(Duration::from_millis(350)));
        assert_eq!(r.errors.len(), 2);
        let clean = recovery(&outcomes[4..], t);
        assert_eq!((clean.failed, clean.last_failure), (0, None));
        assert_eq!(clean.succeeding_again, Some(Duration::from_millis(350)));
    }

    /// Gets and watches against the sample apiserver: lists and watches open, a new object reaches every
    /// watcher, and when the server stops every watch ends (broken: the server went away) and GETs fail.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn watches_see_changes_and_record_how_they_end() -> anyhow::Result<()> {
        tether_runtime::tls::install_crypto_provider();
        let dir = tempfile::tempdir()?;
        let sample = crate::SampleApiserver::start(crate::SampleOptions::new(dir.path())).await?;
        let target = Target {
            base: sample.url(),
            ca_pem: std::fs::read_to_string(dir.path().join("ca.pem"))?,
            token: sample.token().to_owned(),
        };
        let path = "/api/v1/namespaces/default/configmaps";
        let gets = Gets::start(
            &target,
            path,
            2,
            Connection::Fresh,
            Duration::from_millis(20),
        )?;
        let watches = Watches::start(&target, path, 6, 2, Connection::Reused)?;
        watches.wait_open(6, Duration::from_secs(20)).await?;
        sample.create_configmaps("default", "marker-", 1);
        let seen = watches
            .wait_seen_by_all("marker-0", Duration::from_secs(10))
            .await;
        assert_eq!(seen, Ok(()), "every watcher sees the new object");
        crate::wait::until("some GETs", Duration::from_secs(10), || async {
            gets.outcomes().len() >= 5
        })
        .await?;
        assert!(
            gets.outcomes().iter().all(Outcome::ok),
            "{:?}",
            gets.outcomes()
        );

        let stopped = Instant::now();
        sample.shutdown().await;
        crate::wait::until("watches ended", Duration::from_secs(20), || async {
            watches.report().ended.len() >= 6
        })
        .await?;
        let report = watches.stop().await;
        assert!(report.ended.iter().all(|e| e.at >= stopped), "{report:?}");
        crate::wait::until("a failed GET", Duration::from_secs(20), || async {
            recovery(&gets.outcomes(), stopped).failed > 0
        })
        .await?;
        let outcomes = gets.stop().await;
        let r = recovery(&outcomes, stopped);
        assert!(r.failed > 0 && !r.errors.is_empty(), "{r:?}");
        Ok(())
    }
}
