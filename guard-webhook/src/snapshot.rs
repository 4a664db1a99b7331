//! The current RBAC [`Snapshot`]: held in memory, persisted to disk as last-known-good (written atomically),
//! loaded at start, and replaced only by newer versions. Updates come from anything that calls
//! [`SnapshotStore::update`]: the `PUT /snapshot` endpoint, an in-process caller, or a [`SnapshotSource`] driven by
//! [`run_source`]. While a source is unreachable, decisions keep using the snapshot held.

use std::future::Future;
use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::sync::{Arc, RwLock};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

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
    /// The version is further ahead of guard's clock than [`MAX_VERSION_AHEAD`] (versions are the relay's Unix
    /// time in milliseconds or a little more); accepting it would refuse every later snapshot.
    #[error(
        "snapshot version {version} is more than {} h ahead of this guard's clock (Unix time {now_ms} ms); refused",
        MAX_VERSION_AHEAD.as_secs() / 3600
    )]
    VersionTooFarAhead {
        /// The version offered.
        version: u64,
        /// Guard's clock, in Unix milliseconds.
        now_ms: u64,
    },
}

/// How far ahead of guard's clock a snapshot version may be. The relay versions snapshots with its Unix time in
/// milliseconds (bumped past the previous version); a version further ahead would freeze RBAC until then.
pub const MAX_VERSION_AHEAD: Duration = Duration::from_secs(24 * 3600);

fn unix_ms(t: SystemTime) -> u64 {
    t.duration_since(UNIX_EPOCH)
        .map(|d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
        .unwrap_or(0)
}

fn check_version(version: u64, now: SystemTime) -> Result<(), SnapshotError> {
    let now_ms = unix_ms(now);
    let limit =
        now_ms.saturating_add(u64::try_from(MAX_VERSION_AHEAD.as_millis()).unwrap_or(u64::MAX));
    if version > limit {
        return Err(SnapshotError::VersionTooFarAhead { version, now_ms });
    }
    Ok(())
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
                check_version(snapshot.version, SystemTime::now())?;
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
    /// A version more than [`MAX_VERSION_AHEAD`] ahead of the clock is refused. On a write error the current
    /// snapshot stays.
    pub fn update(&self, snapshot: Snapshot) -> Result<UpdateOutcome, SnapshotError> {
        snapshot.validate()?;
        check_version(snapshot.version, SystemTime::now())?;
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
    // An unpredictable name, created exclusively (O_EXCL), never through a symlink (O_NOFOLLOW), readable by
    // guard only: a local user who can write to the directory cannot redirect or read the write.
    let mut suffix = [0u8; 8];
    rand::fill(&mut suffix);
    let tmp = dir.join(format!(".{file_name}.{}.tmp", hex::encode(suffix)));
    let mut options = std::fs::OpenOptions::new();
    options.write(true).create_new(true);
    #[cfg(unix)]
    {
        use std::os::unix::fs::OpenOptionsExt as _;
        options.mode(0o600).custom_flags(libc::O_NOFOLLOW);
    }
    let written = options.open(&tmp).and_then(|mut f| {
        f.write_all(&bytes)?;
        f.sync_all()
    });
    if let Err(e) = written.and_then(|()| std::fs::rename(&tmp, path)) {
        let _ = std::fs::remove_file(&tmp);
        return Err(io(e));
    }
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

    #[test]
    fn a_version_far_ahead_cannot_freeze_rbac() -> anyhow::Result<()> {
        // One push of u64::MAX used to be accepted and made every later (real) version "stale" for good.
        let dir = tempfile::tempdir()?;
        let path = dir.path().join("snapshot.json");
        let store = SnapshotStore::open(&path)?;
        let now = u64::try_from(SystemTime::now().duration_since(UNIX_EPOCH)?.as_millis())?;
        let refused = store.update(snap(u64::MAX)).map_err(|e| e.to_string());
        assert!(
            refused.as_ref().is_err_and(|e| e.contains("ahead")),
            "{refused:?}"
        );
        let two_days = now + 2 * 24 * 3600 * 1000;
        assert!(store.update(snap(two_days)).is_err());
        assert_eq!(store.version(), 0);
        assert_eq!(store.update(snap(now))?, UpdateOutcome::Applied);
        let in_an_hour = now + 3600 * 1000;
        assert_eq!(store.update(snap(in_an_hour))?, UpdateOutcome::Applied);
        // A poisoned file (written by an older guard) is refused at start rather than trusted.
        std::fs::write(&path, serde_json::to_vec(&snap(u64::MAX))?)?;
        assert!(SnapshotStore::open(&path).is_err());
        Ok(())
    }

    #[cfg(unix)]
    #[test]
    fn the_snapshot_file_is_written_privately_and_not_through_a_planted_symlink()
    -> anyhow::Result<()> {
        use std::os::unix::fs::PermissionsExt as _;
        let dir = tempfile::tempdir()?;
        let path = dir.path().join("snapshot.json");
        let victim = dir.path().join("victim");
        std::fs::write(&victim, b"precious")?;
        // The temp name the old code used, planted as a symlink to another file.
        std::os::unix::fs::symlink(&victim, dir.path().join(".snapshot.json.tmp"))?;
        let store = SnapshotStore::open(&path)?;
        assert_eq!(store.update(snap(1))?, UpdateOutcome::Applied);
        assert_eq!(std::fs::read(&victim)?, b"precious");
        let mode = std::fs::metadata(&path)?.permissions().mode() & 0o777;
        assert_eq!(mode, 0o600, "mode {mode:o}");
        assert_eq!(SnapshotStore::open(&path)?.version(), 1);
        let leftovers = std::fs::read_dir(dir.path())?
            .filter_map(Result::ok)
            .filter(|e| e.file_name().to_string_lossy().ends_with(".tmp"))
            .count();
        assert_eq!(leftovers, 1, "only the planted symlink remains");
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
