//! Heartbeats and health reports, gathered in memory and written to the store in batches.
//!
//! Every agent sends a heartbeat each interval; writing each one would cost a transaction per cluster per
//! interval. Instead the latest facts per cluster wait here and [`ActivityLog::flush`] writes them all in one
//! transaction every `limits.last_seen_interval` (and once more at shutdown). Reads overlay the waiting facts
//! on the stored record, so the API is never behind the agents.

use std::collections::HashMap;
use std::sync::{Mutex, MutexGuard, PoisonError};

use time::OffsetDateTime;

use crate::store::{Activity, AgentHealth, ClusterRecord, Store, StoreError};

#[derive(Debug, Default)]
struct Maps {
    /// Facts not yet handed to the store.
    pending: HashMap<String, Activity>,
    /// Facts being written right now (still shown by reads until the write commits).
    in_flight: HashMap<String, Activity>,
}

/// The in-memory side of connectivity tracking.
#[derive(Debug, Default)]
pub(crate) struct ActivityLog {
    maps: Mutex<Maps>,
}

fn merge(into: &mut Activity, newer: Activity) {
    if newer.seen_at > into.seen_at {
        into.seen_at = newer.seen_at;
    }
    if newer.health.is_some() {
        into.health = newer.health;
    }
    if newer.agent_version.is_some() {
        into.agent_version = newer.agent_version;
    }
}

impl ActivityLog {
    fn lock(&self) -> MutexGuard<'_, Maps> {
        // Plain maps: a panic while holding the lock cannot leave them half-updated.
        self.maps.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn record(&self, activity: Activity) {
        let mut maps = self.lock();
        match maps.pending.get_mut(&activity.name) {
            Some(existing) => merge(existing, activity),
            None => {
                maps.pending.insert(activity.name.clone(), activity);
            }
        }
    }

    /// The agent of `cluster` was heard from at `at` (a heartbeat or any other message).
    pub(crate) fn touch(&self, cluster: &str, at: OffsetDateTime) {
        self.record(Activity {
            name: cluster.to_owned(),
            seen_at: at,
            health: None,
            agent_version: None,
        });
    }

    /// The agent of `cluster` reported its version (in `hello`).
    pub(crate) fn agent_version(&self, cluster: &str, version: String, at: OffsetDateTime) {
        self.record(Activity {
            name: cluster.to_owned(),
            seen_at: at,
            health: None,
            agent_version: Some(version),
        });
    }

    /// The agent of `cluster` reported its health.
    pub(crate) fn health(&self, cluster: &str, health: AgentHealth, version: String) {
        self.record(Activity {
            name: cluster.to_owned(),
            seen_at: health.reported_at,
            health: Some(health),
            agent_version: Some(version),
        });
    }

    /// Drops what is waiting for `cluster` (it was deleted).
    pub(crate) fn forget(&self, cluster: &str) {
        let mut maps = self.lock();
        maps.pending.remove(cluster);
        maps.in_flight.remove(cluster);
    }

    /// `record` with the facts not yet in the store applied.
    pub(crate) fn overlay(&self, record: &mut ClusterRecord) {
        let maps = self.lock();
        for waiting in [
            maps.in_flight.get(&record.name),
            maps.pending.get(&record.name),
        ]
        .into_iter()
        .flatten()
        {
            if record.last_seen.is_none_or(|t| t < waiting.seen_at) {
                record.last_seen = Some(waiting.seen_at);
            }
            if let Some(h) = &waiting.health {
                record.health = Some(h.clone());
            }
            if let Some(v) = &waiting.agent_version {
                record.agent_version = Some(v.clone());
            }
        }
    }

    /// Writes everything waiting in one store call. On failure the facts wait for the next flush.
    pub(crate) async fn flush(&self, store: &dyn Store) -> Result<usize, StoreError> {
        let batch: Vec<Activity> = {
            let mut maps = self.lock();
            if maps.pending.is_empty() {
                return Ok(0);
            }
            let taken = std::mem::take(&mut maps.pending);
            maps.in_flight = taken;
            maps.in_flight.values().cloned().collect()
        };
        let result = store.record_activity(&batch).await;
        let mut maps = self.lock();
        let done = std::mem::take(&mut maps.in_flight);
        if result.is_err() {
            for (name, activity) in done {
                match maps.pending.remove(&name) {
                    Some(newer) => {
                        let mut merged = activity;
                        merge(&mut merged, newer);
                        maps.pending.insert(name, merged);
                    }
                    None => {
                        maps.pending.insert(name, activity);
                    }
                }
            }
        }
        result.map(|()| batch.len())
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use super::*;
    use crate::store::{NewCluster, SqliteStore, TokenHash};

    fn at(secs: i64) -> OffsetDateTime {
        OffsetDateTime::from_unix_timestamp(1_800_000_000 + secs)
            .unwrap_or(OffsetDateTime::UNIX_EPOCH)
    }

    #[tokio::test]
    async fn heartbeats_are_shown_at_once_and_written_in_one_batch() -> anyhow::Result<()> {
        let store = SqliteStore::open("sqlite::memory:").await?;
        for name in ["a", "b"] {
            store
                .create_cluster(&NewCluster {
                    name: name.into(),
                    tags: BTreeMap::new(),
                    onboarding_token_hash: TokenHash::of(name),
                    created_at: at(0),
                })
                .await?;
        }
        let log = ActivityLog::default();
        for i in 1..=100 {
            log.touch("a", at(i));
        }
        log.touch("b", at(7));
        log.agent_version("b", "0.1.0".into(), at(5));

        let mut a = store
            .cluster("a")
            .await?
            .ok_or_else(|| anyhow::anyhow!("a"))?;
        assert_eq!(a.last_seen, None, "nothing written yet");
        log.overlay(&mut a);
        assert_eq!(a.last_seen, Some(at(100)));

        assert_eq!(
            log.flush(&store).await?,
            2,
            "one entry per cluster, not per heartbeat"
        );
        let b = store
            .cluster("b")
            .await?
            .ok_or_else(|| anyhow::anyhow!("b"))?;
        assert_eq!(
            (b.last_seen, b.agent_version.as_deref()),
            (Some(at(7)), Some("0.1.0"))
        );
        assert_eq!(log.flush(&store).await?, 0);

        log.touch("a", at(200));
        log.forget("a");
        assert_eq!(log.flush(&store).await?, 0);
        Ok(())
    }

    #[tokio::test]
    async fn a_failed_flush_keeps_the_facts() -> anyhow::Result<()> {
        let store = SqliteStore::open("sqlite::memory:").await?;
        store.close().await?;
        let log = ActivityLog::default();
        log.touch("a", at(1));
        assert!(log.flush(&store).await.is_err());
        log.touch("a", at(2));
        let mut record = ClusterRecord {
            name: "a".into(),
            tags: BTreeMap::new(),
            created_at: at(0),
            onboarded: true,
            connected_since: None,
            last_seen: None,
            agent_version: None,
            identity: None,
            metadata: None,
            health: None,
        };
        log.overlay(&mut record);
        assert_eq!(record.last_seen, Some(at(2)));
        assert_eq!(log.lock().pending.len(), 1);
        Ok(())
    }
}
