//! Upstream connections that grow with load (issue 17).
//!
//! A single pooled HTTP/2 connection serves at most the apiserver's `SETTINGS_MAX_CONCURRENT_STREAMS` requests
//! at once (kube-apiserver: 100); past that, requests would wait in the client's queue without any deadline. So
//! the agent keeps several slots, each holding one HTTP/2 connection ([`crate::upstream`]), and counts the
//! requests open on each (a request stays open until its response body is finished or dropped):
//!
//! - a request goes to the first connection with fewer than `--upstream-streams-per-connection` open (default
//!   100, kube-apiserver's default; set it to what the apiserver advertises when that is lower — hyper does not
//!   expose the peer's setting), else to a new connection, as Go's transport does;
//! - long-running requests (watches, `follow=true` logs) use connections of their own, so short requests never
//!   queue behind them; upgrades (exec, attach, port-forward) already have one HTTP/1.1 connection each;
//! - at most `--upstream-max-connections` connections in all (one always left for short requests); past that a
//!   request waits up to `--upstream-queue-timeout` for a free stream, then gets a Kubernetes `Status` 503 with
//!   `Retry-After`;
//! - a connection with no request open for the idle timeout is closed, extra ones included; its slot stays and
//!   connects again when next used.
//!
//! A request whose tunnel stream goes away while it waits is dropped with its stream, before it is sent.
//! One already sent on a pooled connection waits for its response head before it is cancelled
//! (`forward::send_pooled`): resets of requests the apiserver has not taken up yet are what HTTP/2 servers
//! count against the whole connection, so one user's cancellations could otherwise close it for everyone.

use std::pin::Pin;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use clap::{Args as _, FromArgMatches as _};
use http::{Method, Uri};
use hyper::body::{Body, Frame, SizeHint};
use tether_runtime::parse_duration;
use tether_runtime::serve::BoxError;
use tokio::sync::Notify;

use crate::upstream::RespBody;

/// How the upstream connections grow (`--upstream-*`). Every default is written once, in the `#[arg]`s.
#[derive(Debug, Clone, PartialEq, Eq, clap::Args)]
pub struct PoolOptions {
    /// Requests open at once on one HTTP/2 connection to the apiserver before another is opened (the server's
    /// SETTINGS_MAX_CONCURRENT_STREAMS; kube-apiserver's default is 100).
    #[arg(long = "upstream-streams-per-connection", env = "TETHER_UPSTREAM_STREAMS_PER_CONNECTION", default_value_t = 100, value_parser = clap::value_parser!(u32).range(1..))]
    pub streams_per_connection: u32,
    /// Connections to the apiserver at most (upgrades not counted: each has its own). The default lets one
    /// tunnel carry 10,000 watches at kube-apiserver's 100 streams per connection, with room for short requests.
    #[arg(long = "upstream-max-connections", env = "TETHER_UPSTREAM_MAX_CONNECTIONS", default_value_t = 128, value_parser = clap::value_parser!(u32).range(2..))]
    pub max_connections: u32,
    /// How long a request waits for a free stream when every connection is full, before a 503.
    #[arg(long = "upstream-queue-timeout", env = "TETHER_UPSTREAM_QUEUE_TIMEOUT", default_value = "5s", value_parser = parse_duration)]
    pub queue_timeout: Duration,
}

impl Default for PoolOptions {
    fn default() -> Self {
        let parsed = Self::augment_args(clap::Command::new("tether-agent"))
            .mut_args(|arg| arg.env(None))
            .try_get_matches_from(["tether-agent"])
            .and_then(|matches| Self::from_arg_matches(&matches));
        #[allow(clippy::expect_used)]
        parsed.expect("every upstream option has a default")
    }
}

/// Whether a request stays open for long: a watch, or logs followed.
pub(crate) fn is_long_running(method: &Method, uri: &Uri) -> bool {
    if method != Method::GET {
        return false;
    }
    let truthy = |key: &str| {
        uri.query().is_some_and(|q| {
            url::form_urlencoded::parse(q.as_bytes())
                .any(|(k, v)| k == key && (v == "true" || v == "1"))
        })
    };
    let path = uri.path();
    truthy("watch") || path.contains("/watch/") || (path.ends_with("/log") && truthy("follow"))
}

/// One client (one HTTP/2 connection) and the requests open on it.
struct Slot<C> {
    client: C,
    open: Arc<AtomicUsize>,
}

struct Sets<C> {
    short: Vec<Arc<Slot<C>>>,
    long: Vec<Arc<Slot<C>>>,
}

/// Makes a client, given the count of requests open on it.
type MakeClient<C> = Box<dyn Fn(&Arc<AtomicUsize>) -> C + Send + Sync>;

/// Clients made on demand by `make`, bounded and counted as the module docs say.
pub(crate) struct Pool<C> {
    make: MakeClient<C>,
    sets: Mutex<Sets<C>>,
    freed: Arc<Notify>,
    options: PoolOptions,
}

/// A stream taken on a client; given back when dropped.
pub(crate) struct Lease<C> {
    slot: Arc<Slot<C>>,
    freed: Arc<Notify>,
}

impl<C> Lease<C> {
    /// The client to send on.
    pub(crate) fn client(&self) -> &C {
        &self.slot.client
    }
}

impl<C> Drop for Lease<C> {
    fn drop(&mut self) {
        self.slot.open.fetch_sub(1, Ordering::AcqRel);
        self.freed.notify_waiters();
    }
}

/// Upstream connections and requests in use (the agent's `/metrics`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct Usage {
    /// Connections with at least one request open.
    pub(crate) connections: usize,
    /// Requests open (sent, or waiting to be sent, whose response body is not finished).
    pub(crate) requests: usize,
}

impl std::ops::Add for Usage {
    type Output = Usage;

    fn add(self, other: Usage) -> Usage {
        Usage {
            connections: self.connections + other.connections,
            requests: self.requests + other.requests,
        }
    }
}

/// Every connection is full and none may be added.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Busy;

impl<C> Pool<C> {
    pub(crate) fn new(
        options: PoolOptions,
        make: impl Fn(&Arc<AtomicUsize>) -> C + Send + Sync + 'static,
    ) -> Self {
        Self {
            make: Box::new(make),
            sets: Mutex::new(Sets {
                short: Vec::new(),
                long: Vec::new(),
            }),
            freed: Arc::new(Notify::new()),
            options,
        }
    }

    /// A stream for a request, waiting up to the queue timeout when every connection is full.
    pub(crate) async fn acquire(&self, long_running: bool) -> Result<Lease<C>, Busy> {
        let deadline = tokio::time::Instant::now() + self.options.queue_timeout;
        loop {
            let freed = self.freed.notified();
            tokio::pin!(freed);
            freed.as_mut().enable();
            if let Some(lease) = self.try_acquire(long_running) {
                return Ok(lease);
            }
            if tokio::time::timeout_at(deadline, freed).await.is_err() {
                return Err(Busy);
            }
        }
    }

    fn try_acquire(&self, long_running: bool) -> Option<Lease<C>> {
        let cap = self.options.streams_per_connection as usize;
        let max = self.options.max_connections as usize;
        let mut sets = self.sets.lock().unwrap_or_else(|p| p.into_inner());
        let total = sets.short.len() + sets.long.len();
        let set = if long_running {
            &mut sets.long
        } else {
            &mut sets.short
        };
        let free = set.iter().find(|slot| {
            slot.open
                .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
                    (n < cap).then_some(n + 1)
                })
                .is_ok()
        });
        let slot = match free {
            Some(slot) => slot.clone(),
            None => {
                // One connection is always left for short requests.
                let room = if long_running {
                    total < max && set.len() < max - 1
                } else {
                    total < max || set.is_empty()
                };
                if !room {
                    return None;
                }
                let open = Arc::new(AtomicUsize::new(1));
                let slot = Arc::new(Slot {
                    client: (self.make)(&open),
                    open,
                });
                set.push(slot.clone());
                slot
            }
        };
        Some(Lease {
            slot,
            freed: self.freed.clone(),
        })
    }

    /// What is in use now: connections with at least one request open, and requests open, over both sets.
    /// A connection with no request open counts as unused (it is closed after the idle timeout).
    pub(crate) fn usage(&self) -> Usage {
        let sets = self.sets.lock().unwrap_or_else(|p| p.into_inner());
        let mut usage = Usage::default();
        for slot in sets.short.iter().chain(sets.long.iter()) {
            let open = slot.open.load(Ordering::Acquire);
            usage.requests += open;
            usage.connections += usize::from(open > 0);
        }
        usage
    }

    /// Connections (clients) made so far: short, long-running.
    #[cfg(test)]
    fn connections(&self) -> (usize, usize) {
        let sets = self.sets.lock().unwrap_or_else(|p| p.into_inner());
        (sets.short.len(), sets.long.len())
    }
}

/// A response body that holds its stream's lease until it is finished or dropped.
pub struct Leased {
    body: RespBody,
    _lease: Option<Box<dyn Send + Sync>>,
}

impl Leased {
    pub(crate) fn new<C: Send + Sync + 'static>(body: RespBody, lease: Lease<C>) -> Self {
        Self {
            body,
            _lease: Some(Box::new(lease)),
        }
    }

    /// A body on a connection of its own (an upgrade's client), not counted.
    pub(crate) fn unleased(body: RespBody) -> Self {
        Self { body, _lease: None }
    }
}

impl Body for Leased {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        Pin::new(&mut self.body).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.body.size_hint()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pool(streams: u32, max: u32) -> Pool<usize> {
        let made = AtomicUsize::new(0);
        Pool::new(
            PoolOptions {
                streams_per_connection: streams,
                max_connections: max,
                queue_timeout: Duration::from_millis(50),
            },
            move |_| made.fetch_add(1, Ordering::SeqCst),
        )
    }

    #[test]
    fn defaults_are_the_flags() {
        let d = PoolOptions::default();
        assert_eq!(
            (d.streams_per_connection, d.max_connections, d.queue_timeout),
            (100, 128, Duration::from_secs(5))
        );
    }

    #[test]
    fn long_running_requests_are_recognised() {
        let long = |m: Method, u: &str| is_long_running(&m, &u.parse().unwrap_or_default());
        assert!(long(Method::GET, "/api/v1/namespaces/a/configmaps?watch=1"));
        assert!(long(Method::GET, "/api/v1/pods?labelSelector=x&watch=true"));
        assert!(long(Method::GET, "/api/v1/watch/namespaces/a/pods"));
        assert!(long(
            Method::GET,
            "/api/v1/namespaces/a/pods/p/log?follow=true"
        ));
        assert!(!long(Method::GET, "/api/v1/namespaces/a/pods/p/log"));
        assert!(!long(
            Method::GET,
            "/api/v1/namespaces/a/configmaps?watch=false"
        ));
        assert!(!long(
            Method::GET,
            "/api/v1/namespaces/a/configmaps?resourceVersion=1"
        ));
        assert!(!long(
            Method::POST,
            "/api/v1/namespaces/a/configmaps?watch=1"
        ));
    }

    #[tokio::test]
    async fn grows_at_the_stream_limit_and_keeps_long_requests_apart() -> Result<(), Busy> {
        let pool = pool(2, 4);
        let a = pool.acquire(false).await?;
        let b = pool.acquire(false).await?;
        assert_eq!(a.client(), b.client());
        let c = pool.acquire(false).await?;
        assert_ne!(a.client(), c.client());
        assert_eq!(pool.connections(), (2, 0));
        let w = pool.acquire(true).await?;
        assert_ne!(*w.client(), *a.client());
        assert_ne!(*w.client(), *c.client());
        assert_eq!(pool.connections(), (2, 1));
        // A freed stream is reused before any new connection.
        drop(a);
        let d = pool.acquire(false).await?;
        assert_eq!(d.client(), b.client());
        assert_eq!(pool.connections(), (2, 1));
        Ok(())
    }

    #[tokio::test]
    async fn past_the_bound_requests_wait_then_get_busy_and_short_ones_keep_a_connection()
    -> anyhow::Result<()> {
        let pool = pool(1, 2);
        let w1 = pool
            .acquire(true)
            .await
            .map_err(|_| anyhow::anyhow!("busy"))?;
        // Long-running requests may not take the last connection.
        assert_eq!(pool.acquire(true).await.err(), Some(Busy));
        let s1 = pool
            .acquire(false)
            .await
            .map_err(|_| anyhow::anyhow!("busy"))?;
        assert_ne!(w1.client(), s1.client());
        assert_eq!(pool.acquire(false).await.err(), Some(Busy));

        // A request waiting for a stream gets the one freed while it waits.
        let pool = Arc::new(Pool {
            options: PoolOptions {
                queue_timeout: Duration::from_secs(30),
                ..pool.options.clone()
            },
            ..pool
        });
        let waiter = tokio::spawn({
            let pool = pool.clone();
            async move { pool.acquire(false).await.map(|lease| *lease.client()) }
        });
        tokio::task::yield_now().await;
        let freed = *s1.client();
        drop(s1);
        assert_eq!(waiter.await?, Ok(freed));
        drop(w1);
        Ok(())
    }
}
