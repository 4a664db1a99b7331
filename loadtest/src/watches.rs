//! Many open watches through the relay, as watch-heavy clients hold them: groups of watches, each group one
//! principal from a loopback address of its own, either multiplexed on one HTTP/2 connection (client-go's
//! informers in k9s, Lens, Argo CD) or one HTTP/1.1 connection per watch (kube-rs's default client, `kubectl
//! get -w`). Each watch is read line by line as it streams; what is kept is how it went: whether its head and
//! its first event arrived, when it ended, and the message of a final `ERROR` event, if one came.

use std::net::IpAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use anyhow::{Context as _, bail};
use bytes::{Buf as _, Bytes, BytesMut};
use http::{Request, StatusCode, header};
use http_body_util::{BodyExt as _, Empty};
use hyper::body::Incoming;
use hyper_util::rt::{TokioExecutor, TokioIo};
use tokio::sync::Semaphore;
use tokio::task::JoinSet;
use tokio::time::Instant;

use crate::cluster::SampleCluster;

/// Connections in their TLS handshake at once from one address (the relay's `--max-handshakes-per-ip`
/// default is 64: more would only wait their turn there).
const HANDSHAKES_PER_ADDRESS: usize = 64;
/// Longest watch line kept while looking for its end (an event is one line; a larger one is skipped).
const MAX_LINE: usize = 1024 * 1024;

/// Watches held by one principal.
#[derive(Debug, Clone)]
pub struct Group {
    /// A name for messages.
    pub name: String,
    /// Its bearer token.
    pub token: String,
    /// The loopback address it connects from.
    pub from: IpAddr,
    /// How many watches.
    pub watches: usize,
    /// One HTTP/2 connection for all of them (else one HTTP/1.1 connection each).
    pub http2: bool,
}

/// How one watch ended.
#[derive(Debug, Clone)]
pub struct Ended {
    /// When its body ended (or broke).
    pub at: Instant,
    /// The message of its final `ERROR` event, if it had one.
    pub error_event: Option<String>,
    /// The body's own error, if it broke rather than ended.
    pub broke: Option<String>,
}

#[derive(Debug, Default)]
struct Log {
    /// Watches whose head (200) and first event have arrived.
    answered: AtomicUsize,
    /// Watches that could not be opened, with why.
    failed: Mutex<Vec<String>>,
    /// Watches whose body has ended.
    ended: Mutex<Vec<Ended>>,
}

/// Open watches; closed (their connections dropped) by [`Watches::close`] or when dropped.
pub struct Watches {
    log: Arc<Log>,
    tasks: JoinSet<()>,
    total: usize,
}

impl std::fmt::Debug for Watches {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Watches")
            .field("total", &self.total)
            .field("answered", &self.answered())
            .finish_non_exhaustive()
    }
}

impl Watches {
    /// Opens every group's watches of `path` (under the cluster's prefix) and returns once each has its first
    /// event or has failed, or `limit` has passed.
    pub async fn open(
        cluster: &SampleCluster,
        groups: &[Group],
        path: &str,
        limit: Duration,
    ) -> anyhow::Result<Watches> {
        let log = Arc::new(Log::default());
        let mut tasks = JoinSet::new();
        let total = groups.iter().map(|g| g.watches).sum();
        let uri = format!("{}{}{path}", cluster.relay.url, cluster.prefix());
        let mut opening = JoinSet::new();
        for group in groups {
            if group.http2 {
                let tls = cluster.connect(group.from, true).await?;
                let (sender, conn) =
                    hyper::client::conn::http2::handshake(TokioExecutor::new(), TokioIo::new(tls))
                        .await
                        .with_context(|| format!("{}: HTTP/2 handshake", group.name))?;
                tasks.spawn(async move {
                    let _ = conn.await;
                });
                for _ in 0..group.watches {
                    let (mut sender, log) = (sender.clone(), log.clone());
                    let req = watch_request(&uri, &group.token)?;
                    let name = group.name.clone();
                    opening.spawn(async move {
                        let head = async {
                            sender.ready().await?;
                            anyhow::Ok(sender.send_request(req).await?)
                        };
                        (name, head.await, log, None)
                    });
                }
            } else {
                let handshakes = Arc::new(Semaphore::new(HANDSHAKES_PER_ADDRESS));
                let connector = cluster.connector();
                for _ in 0..group.watches {
                    let (log, handshakes, connector) =
                        (log.clone(), handshakes.clone(), connector.clone());
                    let req = watch_request(&uri, &group.token)?;
                    let (name, from) = (group.name.clone(), group.from);
                    opening.spawn(async move {
                        let mut conn_task = None;
                        let head = async {
                            let tls = {
                                let _permit = handshakes.acquire_owned().await?;
                                connector.connect(from, false).await?
                            };
                            let (mut sender, conn) =
                                hyper::client::conn::http1::handshake(TokioIo::new(tls)).await?;
                            conn_task = Some(AbortOnDrop(tokio::spawn(async move {
                                let _ = conn.await;
                            })));
                            anyhow::Ok(sender.send_request(req).await?)
                        };
                        let head = head.await;
                        (name, head, log, conn_task)
                    });
                }
            }
        }
        let deadline = Instant::now() + limit;
        loop {
            let next = tokio::time::timeout_at(deadline, opening.join_next()).await;
            let Ok(Some(done)) = next else {
                if next.is_err() {
                    opening.abort_all();
                    bail!("watches still opening after {limit:?}");
                }
                break;
            };
            let (name, head, log, conn) = done?;
            match head {
                Ok(resp) if resp.status() == StatusCode::OK => {
                    tasks.spawn(read(resp.into_body(), log, conn));
                }
                Ok(resp) => {
                    let status = resp.status();
                    let body = resp
                        .into_body()
                        .collect()
                        .await
                        .map(|b| String::from_utf8_lossy(&b.to_bytes()).into_owned())
                        .unwrap_or_default();
                    push(&log.failed, format!("{name}: {status} {body}"));
                }
                Err(e) => push(&log.failed, format!("{name}: {e:#}")),
            }
        }
        let watches = Watches { log, tasks, total };
        // Every head is in; now their first events.
        while watches.answered() + watches.failures().len() < total {
            if Instant::now() > deadline {
                bail!(
                    "{} of {total} watches answered within {limit:?} ({} failed)",
                    watches.answered(),
                    watches.failures().len()
                );
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        Ok(watches)
    }

    /// Watches asked for.
    pub fn total(&self) -> usize {
        self.total
    }

    /// Watches whose head and first event arrived.
    pub fn answered(&self) -> usize {
        self.log.answered.load(Ordering::SeqCst)
    }

    /// Why the watches that failed to open failed.
    pub fn failures(&self) -> Vec<String> {
        self.log
            .failed
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }

    /// How the watches that have ended so far ended.
    pub fn ended(&self) -> Vec<Ended> {
        self.log
            .ended
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }

    /// Waits until `n` watches have ended, or `limit` passes; how many had then.
    pub async fn wait_ended(&self, n: usize, limit: Duration) -> usize {
        let deadline = Instant::now() + limit;
        loop {
            let ended = self.ended().len();
            if ended >= n || Instant::now() > deadline {
                return ended;
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }

    /// Drops every watch and its connection.
    pub async fn close(mut self) {
        self.tasks.shutdown().await;
    }
}

fn push(list: &Mutex<Vec<String>>, item: String) {
    list.lock()
        .unwrap_or_else(PoisonError::into_inner)
        .push(item);
}

fn watch_request(uri: &str, token: &str) -> anyhow::Result<Request<Empty<Bytes>>> {
    let uri: http::Uri = uri.parse()?;
    let host = uri.authority().map(|a| a.to_string()).unwrap_or_default();
    Ok(Request::get(uri)
        .header(header::HOST, host)
        .header(header::AUTHORIZATION, format!("Bearer {token}"))
        .header(header::ACCEPT, "application/json")
        .body(Empty::new())?)
}

/// A task aborted when this is dropped (a watch's HTTP/1.1 connection lives as long as its reader).
struct AbortOnDrop(tokio::task::JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// Reads a watch's events until its body ends or breaks, then logs how it ended; `_conn` is its connection's
/// task when it has one of its own.
async fn read(mut body: Incoming, log: Arc<Log>, _conn: Option<AbortOnDrop>) {
    let mut line = BytesMut::new();
    let mut first = true;
    let mut error_event = None;
    let broke = loop {
        match body.frame().await {
            Some(Ok(frame)) => {
                let Ok(mut data) = frame.into_data() else {
                    continue;
                };
                while data.has_remaining() {
                    match data.iter().position(|b| *b == b'\n') {
                        Some(end) => {
                            if line.len() + end <= MAX_LINE {
                                line.extend_from_slice(&data[..end]);
                            }
                            data.advance(end + 1);
                            let event = std::mem::take(&mut line);
                            match event_of(&event) {
                                Some(Event::Error(message)) => error_event = Some(message),
                                Some(Event::Other) if first => {
                                    first = false;
                                    log.answered.fetch_add(1, Ordering::SeqCst);
                                }
                                _ => {}
                            }
                        }
                        None => {
                            if line.len() + data.len() <= MAX_LINE {
                                line.extend_from_slice(&data);
                            }
                            data.clear();
                        }
                    }
                }
            }
            Some(Err(e)) => break Some(crate::client::error_chain(&e)),
            None => break None,
        }
    };
    log.ended
        .lock()
        .unwrap_or_else(PoisonError::into_inner)
        .push(Ended {
            at: Instant::now(),
            error_event,
            broke,
        });
}

enum Event {
    Error(String),
    Other,
}

fn event_of(line: &[u8]) -> Option<Event> {
    if line.iter().all(u8::is_ascii_whitespace) {
        return None;
    }
    let value: serde_json::Value = serde_json::from_slice(line).ok()?;
    Some(match value["type"].as_str() {
        Some("ERROR") => Event::Error(
            value["object"]["message"]
                .as_str()
                .unwrap_or_default()
                .to_owned(),
        ),
        _ => Event::Other,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn events_are_told_apart() {
        assert!(matches!(
            event_of(br#"{"type":"ADDED","object":{}}"#),
            Some(Event::Other)
        ));
        match event_of(br#"{"type":"ERROR","object":{"message":"cluster x: gone"}}"#) {
            Some(Event::Error(m)) => assert_eq!(m, "cluster x: gone"),
            _ => panic!("not an error event"),
        }
        assert!(event_of(b"  ").is_none());
        assert!(event_of(b"{not json").is_none());
    }
}
