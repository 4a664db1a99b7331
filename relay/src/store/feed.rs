//! [`ChangeFeed`]: follows a store's change log so that a replica learns of changes made at other replicas.
//!
//! The log is the truth; notifications only say when to look. The feed re-reads the log after every wake-up
//! (PostgreSQL `NOTIFY`, sent in the same transaction as the change) and at least every `resync_every` in any
//! case, so a notification lost with a dropped listener connection delays a change by at most one period.
//!
//! How a relay replica uses it (one task per replica):
//!
//! ```no_run
//! # use std::{sync::Arc, time::Duration};
//! # use tether_relay::store::{ChangeFeed, ChangeKind, FeedEvent, Store, StoreError};
//! # async fn follow(store: Arc<dyn Store>) -> Result<(), StoreError> {
//! let mut feed = ChangeFeed::subscribe(store.clone(), Duration::from_secs(2)).await?;
//! loop {
//!     match feed.next().await? {
//!         FeedEvent::Changes(changes) => {
//!             for change in changes {
//!                 match change.kind {
//!                     // Push store.guard_state(&change.cluster) to the cluster's agents held here, if its
//!                     // version is newer than the one they were sent.
//!                     ChangeKind::Guard(_version) => {}
//!                     // Close the cluster's tunnels held here and refuse its identity from now on.
//!                     ChangeKind::Deleted => {}
//!                     // Close, after a grace, the tunnels held here with the certificate it replaced.
//!                     ChangeKind::Identity => {}
//!                     // Reload store.cluster(&change.cluster) for whatever caches its tags.
//!                     ChangeKind::Tags | ChangeKind::Created => {}
//!                 }
//!             }
//!         }
//!         // Re-check every cluster held here against store.list_clusters() and store.guard_state().
//!         FeedEvent::Resync => {}
//!     }
//! }
//! # }
//! ```
//!
//! Changes made by this replica come back through the feed too; acting on them twice must be harmless (guard
//! keeps only newer snapshot versions). Someone must also call [`Store::prune_changes`] now and then (say,
//! hourly with `now - 1h`); any replica may, concurrently.

use std::sync::Arc;
use std::time::Duration;

use futures_util::StreamExt;
use tokio::time::{Interval, MissedTickBehavior};

use super::{ChangeSignals, ClusterChange, Store, StoreError};

/// How many log entries one read returns at most.
const PAGE: u32 = 500;

/// What [`ChangeFeed::next`] yields.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum FeedEvent {
    /// New log entries, oldest first (never empty).
    Changes(Vec<ClusterChange>),
    /// The log no longer holds everything since the feed's cursor (it was pruned while this replica was not
    /// reading, or the database was replaced): reload the state of every cluster of interest.
    Resync,
}

/// Follows a store's change log from the moment it is subscribed.
pub struct ChangeFeed {
    store: Arc<dyn Store>,
    cursor: u64,
    signals: Option<ChangeSignals>,
    resync: Interval,
}

impl std::fmt::Debug for ChangeFeed {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChangeFeed")
            .field("cursor", &self.cursor)
            .field("push", &self.signals.is_some())
            .field("resync", &self.resync.period())
            .finish_non_exhaustive()
    }
}

impl ChangeFeed {
    /// Subscribes to `store`'s changes made from now on, re-reading the log at least every `resync_every`
    /// (at least 10 ms).
    pub async fn subscribe(
        store: Arc<dyn Store>,
        resync_every: Duration,
    ) -> Result<ChangeFeed, StoreError> {
        // Listen first, then read the head: a change committed in between is both after the cursor and
        // signalled (or read at the next period), never skipped.
        let signals = store.change_signals().await?;
        let cursor = store.changes_since(u64::MAX, 0).await?.head;
        let mut resync = tokio::time::interval(resync_every.max(Duration::from_millis(10)));
        resync.set_missed_tick_behavior(MissedTickBehavior::Delay);
        Ok(ChangeFeed {
            store,
            cursor,
            signals,
            resync,
        })
    }

    /// The sequence number of the last entry returned (or of the head when subscribed or reset).
    pub fn cursor(&self) -> u64 {
        self.cursor
    }

    /// True while push notifications are available (otherwise the feed only polls).
    pub fn has_push(&self) -> bool {
        self.signals.is_some()
    }

    /// Waits for the next changes. Cancel-safe: dropping the future loses nothing (the cursor moves only when
    /// entries are returned). Store errors are returned; calling again retries from the same cursor.
    pub async fn next(&mut self) -> Result<FeedEvent, StoreError> {
        loop {
            let page = self.store.changes_since(self.cursor, PAGE).await?;
            if page.reset {
                self.cursor = page.head;
                return Ok(FeedEvent::Resync);
            }
            if let Some(last) = page.changes.last() {
                self.cursor = last.seq;
                return Ok(FeedEvent::Changes(page.changes));
            }
            match &mut self.signals {
                Some(signals) => {
                    tokio::select! {
                        signal = signals.next() => {
                            if signal.is_none() {
                                tracing::warn!("store change notifications ended; polling only");
                                self.signals = None;
                            }
                        }
                        _ = self.resync.tick() => {}
                    }
                }
                None => {
                    self.resync.tick().await;
                }
            }
        }
    }
}
