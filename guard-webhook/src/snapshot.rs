//! The current RBAC [`Snapshot`]: held in memory, persisted to disk as last-known-good (written atomically),
//! loaded at start, and replaced only by newer versions. Updates come from anything that calls
//! [`SnapshotStore::update`]: the `PUT /snapshot` endpoint, an in-process caller, or a [`SnapshotSource`] driven by
//! [`run_source`]. While a source is unreachable, decisions keep using the snapshot held.

use std::future::Future;
use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::sync::{Arc, RwLock};
use std::time::Duration;

use tokio::sync::watch;

use tether_auth::rbac::{RbacError, Snapshot};

/// Why a snapshot could not be loaded, checked or saved.
#[derive(Debug, thiserror::Error)]
pub enum SnapshotError {
    /// The file could not be read or written.
    #[error("snapshot file {path}: {source}")]
    Io {
        /// The file.
        path: String,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
    /// The file or update is not a snapshot.
    #[error("snapshot is not valid JSON: {0}")]
    Parse(#[source] serde_json::Error),
    /// The snapshot is inconsistent.
    #[error(transparent)]
    Invalid(#[from] RbacError),
}

/// What [`SnapshotStore::update`] did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum UpdateOutcome {
    /// The snapshot is now current (and persisted).
    Applied,
    /// Its version was not newer than the current one; nothing changed.
    Stale {
        /// The version held.
        current: u64,
    },
}

/// Holds the current snapshot. Cheap to share behind an `Arc`.
#[derive(Debug)]
pub struct SnapshotStore {
    path: Option<PathBuf>,
    current: RwLock<Arc<Snapshot>>,
    version_tx: watch::Sender<u64>,
    // Serializes update() so two writers cannot interleave file writes.
    write: std::sync::Mutex<()>,
}

impl SnapshotStore {
    /// A store that keeps nothing on disk, starting from `initial`.
    pub fn in_memory(initial: Snapshot) -> Self {
        let (version_tx, _) = watch::channel(initial.version);
        Self {
            path: None,
            current: RwLock::new(Arc::new(initial)),
            version_tx,
            write: std::sync::Mutex::new(()),
        }
    }

    /// A store persisted at `path`: loads the snapshot there if the file exists (an empty version-0 snapshot
    /// otherwise). A file that exists but cannot be parsed is an error, not silently an empty snapshot.
    pub fn open(path: impl Into<PathBuf>) -> Result<Self, SnapshotError> {
        let path = path.into();
        let initial = match std::fs::read(&path) {
            Ok(bytes) => {
                let snapshot: Snapshot =
                    serde_json::from_slice(&bytes).map_err(SnapshotError::Parse)?;
                snapshot.validate()?;
                snapshot
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Snapshot::default(),
            Err(source) => {
                return Err(SnapshotError::Io {
                    path: path.display().to_string(),
                    source,
                });
            }
        };
        let mut store = Self::in_memory(initial);
        store.path = Some(path);
        Ok(store)
    }

    /// The current snapshot.
    pub fn current(&self) -> Arc<Snapshot> {
        self.current
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// The current version.
    pub fn version(&self) -> u64 {
        *self.version_tx.borrow()
    }

    /// Notified with each new version.
    pub fn subscribe(&self) -> watch::Receiver<u64> {
        self.version_tx.subscribe()
    }

    /// Validates `snapshot` and, if newer than the current one, persists it (atomically) and makes it current.
    /// On a write error the current snapshot stays.
    pub fn update(&self, snapshot: Snapshot) -> Result<UpdateOutcome, SnapshotError> {
        snapshot.validate()?;
        let _guard = self.write.lock().unwrap_or_else(|p| p.into_inner());
        let current = self.version();
        if snapshot.version <= current {
            return Ok(UpdateOutcome::Stale { current });
        }
        if let Some(path) = &self.path {
            write_atomically(path, &snapshot)?;
        }
        let version = snapshot.version;
        *self.current.write().unwrap_or_else(|p| p.into_inner()) = Arc::new(snapshot);
        self.version_tx.send_replace(version);
        Ok(UpdateOutcome::Applied)
    }

    /// Parses a JSON snapshot and calls [`SnapshotStore::update`].
    pub fn update_json(&self, json: &[u8]) -> Result<UpdateOutcome, SnapshotError> {
        let snapshot: Snapshot = serde_json::from_slice(json).map_err(SnapshotError::Parse)?;
        self.update(snapshot)
    }
}

fn write_atomically(path: &Path, snapshot: &Snapshot) -> Result<(), SnapshotError> {
    let io = |source| SnapshotError::Io {
        path: path.display().to_string(),
        source,
    };
    let bytes = serde_json::to_vec_pretty(snapshot).map_err(SnapshotError::Parse)?;
    let dir = path
        .parent()
        .filter(|d| !d.as_os_str().is_empty())
        .unwrap_or(Path::new("."));
    let file_name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_else(|| "snapshot.json".to_owned());
    let tmp = dir.join(format!(".{file_name}.tmp"));
    {
        let mut f = std::fs::File::create(&tmp).map_err(io)?;
        f.write_all(&bytes).map_err(io)?;
        f.sync_all().map_err(io)?;
    }
    std::fs::rename(&tmp, path).map_err(io)?;
    // Make the rename itself durable.
    if let Ok(d) = std::fs::File::open(dir) {
        let _ = d.sync_all();
    }
    Ok(())
}

/// A future returned by [`SnapshotSource::next`].
pub type SourceFuture<'a> = Pin<Box<dyn Future<Output = Result<Snapshot, String>> + Send + 'a>>;

/// Something that yields snapshots as they change (the relay, through the agent, later).
pub trait SnapshotSource: Send {
    /// Waits for and returns the next snapshot; an error means the source is unreachable for now.
    fn next(&mut self) -> SourceFuture<'_>;
}

/// Feeds `store` from `source` until `shutdown`: applies each snapshot, and on errors waits (doubling from 1 s to
/// 30 s) and tries again, while the store keeps deciding with what it holds.
pub async fn run_source(
    store: Arc<SnapshotStore>,
    mut source: impl SnapshotSource,
    shutdown: impl Future<Output = ()>,
) {
    tokio::pin!(shutdown);
    let mut backoff = Duration::from_secs(1);
    loop {
        let next = tokio::select! {
            () = &mut shutdown => return,
            next = source.next() => next,
        };
        match next {
            Ok(snapshot) => {
                backoff = Duration::from_secs(1);
                let version = snapshot.version;
                match store.update(snapshot) {
                    Ok(UpdateOutcome::Applied) => tracing::info!(version, "snapshot applied"),
                    Ok(UpdateOutcome::Stale { current }) => {
                        tracing::debug!(version, current, "snapshot not newer; ignored")
                    }
                    Err(e) => tracing::warn!(version, error = %e, "snapshot refused"),
                }
            }
            Err(e) => {
                tracing::warn!(error = %e, retry_in = ?backoff,
                    "snapshot source unreachable; deciding with snapshot {}", store.version());
                tokio::select! {
                    () = &mut shutdown => return,
                    () = tokio::time::sleep(backoff) => {}
                }
                backoff = (backoff * 2).min(Duration::from_secs(30));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::VecDeque;
    use tether_auth::rbac::{RoleAssignment, Scope};

    fn snap(version: u64) -> Snapshot {
        Snapshot {
            version,
            assignments: vec![RoleAssignment {
                id: format!("a{version}"),
                role_id: "63f0a09d-1495-4db4-a681-037d84835eb4".to_owned(),
                principal_id: "oid".to_owned(),
                scope: Scope::Cluster,
            }],
            ..Default::default()
        }
    }

    #[test]
    fn persisted_and_reloaded_only_newer_versions() -> anyhow::Result<()> {
        let dir = tempfile::tempdir()?;
        let path = dir.path().join("snapshot.json");
        let store = SnapshotStore::open(&path)?;
        assert_eq!(store.version(), 0);
        assert_eq!(store.update(snap(3))?, UpdateOutcome::Applied);
        assert_eq!(store.update(snap(2))?, UpdateOutcome::Stale { current: 3 });
        assert_eq!(store.update(snap(3))?, UpdateOutcome::Stale { current: 3 });
        let reopened = SnapshotStore::open(&path)?;
        assert_eq!(reopened.current().as_ref(), &snap(3));
        let mut broken = snap(4);
        broken.assignments[0].role_id = "nope".to_owned();
        assert!(store.update(broken).is_err());
        assert_eq!(store.version(), 3);
        std::fs::write(&path, b"{not json")?;
        assert!(
            SnapshotStore::open(&path).is_err(),
            "a corrupt file is an error, not an empty snapshot"
        );
        Ok(())
    }

    struct Scripted(VecDeque<Result<Snapshot, String>>);

    impl SnapshotSource for Scripted {
        fn next(&mut self) -> SourceFuture<'_> {
            let item = self.0.pop_front();
            Box::pin(async move {
                match item {
                    Some(i) => i,
                    None => std::future::pending().await,
                }
            })
        }
    }

    #[tokio::test(start_paused = true)]
    async fn source_errors_keep_the_last_snapshot() {
        let store = Arc::new(SnapshotStore::in_memory(Snapshot::default()));
        let source = Scripted(VecDeque::from([
            Ok(snap(1)),
            Err("relay unreachable".to_owned()),
            Err("relay unreachable".to_owned()),
            Ok(snap(2)),
        ]));
        let mut versions = store.subscribe();
        let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
        let task = tokio::spawn(run_source(store.clone(), source, async move {
            let _ = stop_rx.await;
        }));
        let _ = versions.wait_for(|v| *v == 1).await;
        assert_eq!(store.version(), 1);
        let _ = versions.wait_for(|v| *v == 2).await;
        assert_eq!(store.current().as_ref(), &snap(2));
        let _ = stop_tx.send(());
        assert!(task.await.is_ok());
    }
}
