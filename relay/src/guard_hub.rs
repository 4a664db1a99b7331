//! The hub that tells a cluster's control channel when its guard snapshot changed.

use std::collections::HashMap;
use std::sync::Mutex;

use tokio::sync::watch;

/// Wakes the control channel of a cluster when its guard snapshot changed.
#[derive(Debug, Default)]
pub(crate) struct GuardHub {
    clusters: Mutex<HashMap<String, watch::Sender<u64>>>,
}

impl GuardHub {
    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, watch::Sender<u64>>> {
        // The map holds no invariant a panicking holder could break half-way.
        self.clusters
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// A receiver that changes whenever `cluster`'s snapshot version moves on.
    pub(crate) fn subscribe(&self, cluster: &str) -> watch::Receiver<u64> {
        self.lock()
            .entry(cluster.to_owned())
            .or_insert_with(|| watch::channel(0).0)
            .subscribe()
    }

    /// `cluster`'s snapshot is now at `version`.
    pub(crate) fn changed(&self, cluster: &str, version: u64) {
        if let Some(tx) = self.lock().get(cluster) {
            tx.send_if_modified(|v| {
                let newer = version > *v;
                if newer {
                    *v = version;
                }
                newer
            });
        }
    }

    /// The cluster is gone.
    pub(crate) fn forget(&self, cluster: &str) {
        self.lock().remove(cluster);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hub_wakes_subscribers_only_for_newer_versions() {
        let hub = GuardHub::default();
        hub.changed("a", 5); // no subscriber: nothing kept
        let mut rx = hub.subscribe("a");
        assert!(!rx.has_changed().unwrap_or(true));
        hub.changed("a", 7);
        assert!(rx.has_changed().unwrap_or(false));
        assert_eq!(*rx.borrow_and_update(), 7);
        hub.changed("a", 6);
        assert!(!rx.has_changed().unwrap_or(true));
        hub.changed("b", 9);
        assert!(!rx.has_changed().unwrap_or(true));
        hub.forget("a");
        assert!(rx.has_changed().is_err(), "the sender is gone");
    }
}
