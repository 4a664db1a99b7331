//! The agent's stored credential: `state_dir/credential.json`, mode 0600 in a 0700 directory, written
//! atomically (temporary file, fsync, rename) before it is ever used.

use std::fs;
use std::io::{self, Write};
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use tether_tunnel::Secret;

/// The file name inside the state directory.
pub const FILE_NAME: &str = "credential.json";

/// A per-cluster credential issued by a relay.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Credential {
    /// The relay URL it was issued by (as configured).
    pub relay: String,
    /// The cluster name.
    pub cluster: String,
    /// The credential itself.
    pub credential: Secret,
}

#[derive(Serialize, Deserialize)]
struct OnDisk {
    relay: String,
    cluster: String,
    credential: String,
}

/// Why the credential file could not be read or written.
#[derive(Debug, thiserror::Error)]
pub enum CredentialError {
    /// A file system operation failed.
    #[error("{action} {path}: {source}")]
    Io {
        /// What was being done.
        action: &'static str,
        /// The path.
        path: String,
        /// The cause.
        #[source]
        source: io::Error,
    },
    /// The file is not the JSON the agent writes.
    #[error("{path} is not a valid credential file: {source}")]
    Corrupt {
        /// The path.
        path: String,
        /// The cause.
        #[source]
        source: serde_json::Error,
    },
}

fn io_err<'a>(
    action: &'static str,
    path: &'a Path,
) -> impl FnOnce(io::Error) -> CredentialError + 'a {
    move |source| CredentialError::Io {
        action,
        path: path.display().to_string(),
        source,
    }
}

/// The credential file's path in `state_dir`.
pub fn path(state_dir: &Path) -> PathBuf {
    state_dir.join(FILE_NAME)
}

/// Two relay URLs name the same relay when they differ only by a trailing slash.
fn same_relay(a: &str, b: &str) -> bool {
    a.trim_end_matches('/') == b.trim_end_matches('/')
}

/// The stored credential for this relay and cluster, if there is one. A credential for another relay or
/// cluster is ignored (`None`), so that re-pointing an agent onboards again.
pub fn load(
    state_dir: &Path,
    relay: &str,
    cluster: &str,
) -> Result<Option<Credential>, CredentialError> {
    let path = path(state_dir);
    let text = match fs::read(&path) {
        Ok(text) => text,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(io_err("cannot read", &path)(e)),
    };
    let on_disk: OnDisk =
        serde_json::from_slice(&text).map_err(|source| CredentialError::Corrupt {
            path: path.display().to_string(),
            source,
        })?;
    if !same_relay(&on_disk.relay, relay) || on_disk.cluster != cluster {
        tracing::info!(
            stored_relay = %on_disk.relay,
            stored_cluster = %on_disk.cluster,
            "the stored credential is for another relay or cluster; ignoring it"
        );
        return Ok(None);
    }
    Ok(Some(Credential {
        relay: on_disk.relay,
        cluster: on_disk.cluster,
        credential: on_disk.credential.into(),
    }))
}

/// Writes the credential atomically with mode 0600, creating `state_dir` (0700) if needed.
pub fn store(state_dir: &Path, credential: &Credential) -> Result<(), CredentialError> {
    fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(state_dir)
        .map_err(io_err("cannot create the state directory", state_dir))?;
    let path = path(state_dir);
    let tmp = state_dir.join(format!(".{FILE_NAME}.{}.tmp", std::process::id()));
    let on_disk = OnDisk {
        relay: credential.relay.clone(),
        cluster: credential.cluster.clone(),
        credential: credential.credential.expose().to_string(),
    };
    let bytes = serde_json::to_vec_pretty(&on_disk).map_err(|source| CredentialError::Corrupt {
        path: path.display().to_string(),
        source,
    })?;
    let result = (|| {
        let mut file = fs::OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true)
            .mode(0o600)
            .open(&tmp)
            .map_err(io_err("cannot create", &tmp))?;
        // The mode given to open() is filtered by the umask; make sure it is exactly 0600.
        file.set_permissions(fs::Permissions::from_mode(0o600))
            .map_err(io_err("cannot chmod", &tmp))?;
        file.write_all(&bytes)
            .map_err(io_err("cannot write", &tmp))?;
        file.sync_all().map_err(io_err("cannot sync", &tmp))?;
        fs::rename(&tmp, &path).map_err(io_err("cannot rename into", &path))?;
        // Make the rename itself durable.
        if let Ok(dir) = fs::File::open(state_dir) {
            let _ = dir.sync_all();
        }
        Ok(())
    })();
    if result.is_err() {
        let _ = fs::remove_file(&tmp);
    }
    result
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    fn cred(relay: &str, cluster: &str) -> Credential {
        Credential {
            relay: relay.into(),
            cluster: cluster.into(),
            credential: Secret::new("c-123"),
        }
    }

    #[test]
    fn store_then_load_round_trips_with_private_modes() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path().join("state");
        let c = cred("https://relay.example:8443", "prod");
        store(&dir, &c).unwrap();

        let file_mode = fs::metadata(path(&dir)).unwrap().permissions().mode() & 0o777;
        let dir_mode = fs::metadata(&dir).unwrap().permissions().mode() & 0o777;
        assert_eq!(file_mode, 0o600);
        assert_eq!(dir_mode, 0o700);
        // No temporary file left behind.
        assert_eq!(fs::read_dir(&dir).unwrap().count(), 1);

        assert_eq!(
            load(&dir, "https://relay.example:8443/", "prod").unwrap(),
            Some(c.clone())
        );
        let text = fs::read_to_string(path(&dir)).unwrap();
        let json: serde_json::Value = serde_json::from_str(&text).unwrap();
        assert_eq!(json["credential"], "c-123");
        assert_eq!(json["cluster"], "prod");
        assert_eq!(json["relay"], "https://relay.example:8443");

        // Overwriting keeps the mode.
        store(&dir, &cred("https://relay.example:8443", "prod")).unwrap();
        assert_eq!(
            fs::metadata(path(&dir)).unwrap().permissions().mode() & 0o777,
            0o600
        );
    }

    #[test]
    fn other_relay_or_cluster_is_ignored() {
        let tmp = tempfile::tempdir().unwrap();
        store(tmp.path(), &cred("https://a.example", "prod")).unwrap();
        assert_eq!(load(tmp.path(), "https://b.example", "prod").unwrap(), None);
        assert_eq!(
            load(tmp.path(), "https://a.example", "staging").unwrap(),
            None
        );
        assert!(
            load(tmp.path(), "https://a.example", "prod")
                .unwrap()
                .is_some()
        );
    }

    #[test]
    fn missing_is_none_and_garbage_is_an_error() {
        let tmp = tempfile::tempdir().unwrap();
        assert_eq!(load(tmp.path(), "https://a.example", "prod").unwrap(), None);
        fs::write(path(tmp.path()), b"not json").unwrap();
        assert!(matches!(
            load(tmp.path(), "https://a.example", "prod"),
            Err(CredentialError::Corrupt { .. })
        ));
    }
}
