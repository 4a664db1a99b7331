//! The cluster's identity: a client certificate issued by the relay's agent CA for a key pair the agent made
//! itself, presented as the TLS client certificate on every connection to the relay (mutual TLS).
//!
//! Files in the state directory (0700), both mode 0600:
//! - `identity.json`: `{"relay", "cluster", "certificate" (PEM), "notAfter" (RFC 3339), "issuedAt"}`;
//! - `identity-key.pem`: the private key (ECDSA P-256, PKCS#8 PEM). It never leaves the agent: the relay gets
//!   a certificate signing request (CSR) signed with it, at onboarding and at each renewal.
//!
//! The pair is replaced atomically, as one unit, with a small commit protocol: the new key and the new JSON
//! are each written to a temporary file, synced and renamed to `identity-key.pem.new` and then
//! `identity.json.new` (the commit point), then renamed over the live files. [`load`] finishes an interrupted
//! replacement first: with `identity.json.new` present it rolls forward, otherwise it discards a lone
//! `identity-key.pem.new`. A crash therefore leaves either the old pair or the new one, never a certificate
//! with someone else's key. (An older agent's `credential.json` is ignored.)

use std::fs;
use std::io::{self, Write};
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};

use rcgen::{CertificateParams, DistinguishedName, DnType, KeyPair, PublicKeyData};
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use tether_runtime::Secret;
use time::OffsetDateTime;
use time::format_description::well_known::Rfc3339;

/// The identity file inside the state directory.
pub const FILE_NAME: &str = "identity.json";
/// The private key file inside the state directory.
pub const KEY_FILE_NAME: &str = "identity-key.pem";
/// The SAN URI prefix naming a cluster in its certificate.
const CLUSTER_URI_PREFIX: &str = "tether://cluster/";

/// A certificate the relay issued to this cluster, with the agent's private key.
#[derive(Clone, PartialEq, Eq)]
pub struct Identity {
    /// The relay URL it was issued by (as configured).
    pub relay: String,
    /// The cluster name.
    pub cluster: String,
    /// The certificate, PEM.
    pub certificate: String,
    /// The private key, PKCS#8 PEM.
    pub key: Secret,
    /// Start of the certificate's validity.
    pub not_before: OffsetDateTime,
    /// End of the certificate's validity.
    pub not_after: OffsetDateTime,
    /// When the agent received it (its own clock); renewal is timed from here, or from `not_before` when
    /// that is later. Relays usually backdate `not_before` a little for skewed clocks, which would make a
    /// short-lived certificate look older than it is.
    pub issued_at: OffsetDateTime,
    /// SHA-256 of the certificate's DER, lowercase hex (what the relay shows as the identity's fingerprint).
    pub fingerprint: String,
}

impl std::fmt::Debug for Identity {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Identity")
            .field("relay", &self.relay)
            .field("cluster", &self.cluster)
            .field("fingerprint", &self.fingerprint)
            .field("not_before", &self.not_before)
            .field("not_after", &self.not_after)
            .field("issued_at", &self.issued_at)
            .finish_non_exhaustive()
    }
}

/// Why an identity could not be made, checked, read or written.
#[derive(Debug, thiserror::Error)]
pub enum IdentityError {
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
    /// A stored file is not what the agent writes.
    #[error("{path} is not a valid identity file: {reason}")]
    Corrupt {
        /// The path.
        path: String,
        /// What is wrong.
        reason: String,
    },
    /// The certificate the relay sent cannot be used with our key for this cluster.
    #[error("the relay's certificate is unusable: {0}")]
    InvalidCertificate(String),
    /// A key pair or CSR could not be generated.
    #[error("cannot generate a key pair and certificate request: {0}")]
    Generate(#[source] rcgen::Error),
}

/// A fresh private key and a CSR for it, before the relay has answered.
pub struct KeyRequest {
    /// The private key, PKCS#8 PEM.
    pub key: Secret,
    /// The certificate signing request, PEM.
    pub csr: String,
}

impl std::fmt::Debug for KeyRequest {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KeyRequest").finish_non_exhaustive()
    }
}

/// Generates an ECDSA P-256 key pair and a CSR for it (CN = `cluster`, SAN URI `tether://cluster/NAME`; the
/// relay decides the certificate's contents anyway and keeps only the public key).
pub fn new_key_request(cluster: &str) -> Result<KeyRequest, IdentityError> {
    let key =
        KeyPair::generate_for(&rcgen::PKCS_ECDSA_P256_SHA256).map_err(IdentityError::Generate)?;
    let mut params = CertificateParams::default();
    let mut name = DistinguishedName::new();
    name.push(DnType::CommonName, cluster);
    params.distinguished_name = name;
    if let Ok(uri) = format!("{CLUSTER_URI_PREFIX}{cluster}").try_into() {
        params.subject_alt_names = vec![rcgen::SanType::URI(uri)];
    }
    let csr = params
        .serialize_request(&key)
        .and_then(|csr| csr.pem())
        .map_err(IdentityError::Generate)?;
    Ok(KeyRequest {
        key: Secret::new(key.serialize_pem()),
        csr,
    })
}

impl Identity {
    /// Checks a certificate received for `key` and builds the identity: it must be one PEM certificate, for
    /// this key, naming `cluster` (CN or SAN URI), and currently valid or not yet expired.
    pub fn new(
        relay: &str,
        cluster: &str,
        certificate: &str,
        key: Secret,
        issued_at: OffsetDateTime,
    ) -> Result<Self, IdentityError> {
        let invalid = |reason: String| IdentityError::InvalidCertificate(reason);
        let (_, pem) = x509_parser::pem::parse_x509_pem(certificate.as_bytes())
            .map_err(|e| invalid(format!("not a PEM certificate: {e}")))?;
        if pem.label != "CERTIFICATE" {
            return Err(invalid(format!(
                "a PEM {:?} block, not a CERTIFICATE",
                pem.label
            )));
        }
        let cert = pem
            .parse_x509()
            .map_err(|e| invalid(format!("malformed certificate: {e}")))?;
        let key_pair = KeyPair::from_pem(key.expose())
            .map_err(|e| invalid(format!("our private key is unreadable: {e}")))?;
        if cert.public_key().raw != key_pair.subject_public_key_info().as_slice() {
            return Err(invalid(
                "it certifies another public key than the one we asked for".to_owned(),
            ));
        }
        if !names_cluster(&cert, cluster) {
            return Err(invalid(format!(
                "it does not name cluster {cluster:?} (CN or SAN URI {CLUSTER_URI_PREFIX}{cluster})"
            )));
        }
        let validity = cert.validity();
        let not_before = validity.not_before.to_datetime();
        let not_after = validity.not_after.to_datetime();
        if not_after <= not_before {
            return Err(invalid("its validity period is empty".to_owned()));
        }
        let fingerprint = hex::encode(Sha256::digest(&pem.contents));
        Ok(Self {
            relay: relay.to_owned(),
            cluster: cluster.to_owned(),
            certificate: certificate.to_owned(),
            key,
            not_before,
            not_after,
            issued_at,
            fingerprint,
        })
    }

    /// When to renew: about two thirds into the lifetime, counted from the later of `not_before` and
    /// `issued_at`, shifted by `jitter` (in -1.0..=1.0) times 5 % of the lifetime.
    pub fn renew_at(&self, jitter: f64) -> OffsetDateTime {
        let start = self.not_before.max(self.issued_at).min(self.not_after);
        let lifetime = self.not_after - start;
        let fraction = 2.0 / 3.0 + 0.05 * jitter.clamp(-1.0, 1.0);
        start + lifetime * fraction
    }

    /// Whether the certificate has expired at `now`.
    pub fn is_expired(&self, now: OffsetDateTime) -> bool {
        now >= self.not_after
    }
}

fn names_cluster(cert: &x509_parser::certificate::X509Certificate<'_>, cluster: &str) -> bool {
    let uri = format!("{CLUSTER_URI_PREFIX}{cluster}");
    let by_san = cert
        .subject_alternative_name()
        .ok()
        .flatten()
        .is_some_and(|san| {
            san.value.general_names.iter().any(
                |name| matches!(name, x509_parser::extensions::GeneralName::URI(u) if *u == uri),
            )
        });
    let by_cn = cert
        .subject()
        .iter_common_name()
        .any(|cn| cn.as_str().is_ok_and(|cn| cn == cluster));
    by_san || by_cn
}

#[derive(Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
struct OnDisk {
    relay: String,
    cluster: String,
    certificate: String,
    #[serde(with = "time::serde::rfc3339")]
    not_after: OffsetDateTime,
    #[serde(default, with = "time::serde::rfc3339::option")]
    issued_at: Option<OffsetDateTime>,
}

fn io_err<'a>(
    action: &'static str,
    path: &'a Path,
) -> impl FnOnce(io::Error) -> IdentityError + 'a {
    move |source| IdentityError::Io {
        action,
        path: path.display().to_string(),
        source,
    }
}

/// The identity file's path in `state_dir`.
pub fn path(state_dir: &Path) -> PathBuf {
    state_dir.join(FILE_NAME)
}

/// The key file's path in `state_dir`.
pub fn key_path(state_dir: &Path) -> PathBuf {
    state_dir.join(KEY_FILE_NAME)
}

fn staged(path: &Path) -> PathBuf {
    let mut name = path.as_os_str().to_owned();
    name.push(".new");
    PathBuf::from(name)
}

/// Two relay URLs name the same relay when they differ only by a trailing slash.
fn same_relay(a: &str, b: &str) -> bool {
    a.trim_end_matches('/') == b.trim_end_matches('/')
}

/// The stored identity for this relay and cluster, if there is one (after finishing an interrupted
/// replacement). An identity for another relay or cluster is ignored (`None`), so that re-pointing an agent
/// onboards again.
pub fn load(
    state_dir: &Path,
    relay: &str,
    cluster: &str,
) -> Result<Option<Identity>, IdentityError> {
    recover(state_dir)?;
    let path = path(state_dir);
    let text = match fs::read(&path) {
        Ok(text) => text,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(io_err("cannot read", &path)(e)),
    };
    let key_path = key_path(state_dir);
    let where_ = path.display().to_string();
    decode(
        &text,
        || fs::read_to_string(&key_path).map_err(io_err("cannot read", &key_path)),
        relay,
        cluster,
        &where_,
    )
}

/// The stored form of an identity: `identity.json` (relay, cluster, certificate, notAfter, issuedAt) and the
/// key PEM, as kept in the state directory and in a Kubernetes Secret (`--state-secret`).
pub(crate) fn encode(identity: &Identity) -> Result<Vec<u8>, IdentityError> {
    let on_disk = OnDisk {
        relay: identity.relay.clone(),
        cluster: identity.cluster.clone(),
        certificate: identity.certificate.clone(),
        not_after: identity.not_after,
        issued_at: Some(identity.issued_at),
    };
    serde_json::to_vec_pretty(&on_disk).map_err(|e| IdentityError::Corrupt {
        path: FILE_NAME.to_owned(),
        reason: e.to_string(),
    })
}

/// The identity in a stored `identity.json` and its key (read only when the identity is for `relay` and
/// `cluster`); `None` when it belongs to another relay or cluster. `where_` names the store in errors.
pub(crate) fn decode(
    json: &[u8],
    key: impl FnOnce() -> Result<String, IdentityError>,
    relay: &str,
    cluster: &str,
    where_: &str,
) -> Result<Option<Identity>, IdentityError> {
    let corrupt = |reason: String| IdentityError::Corrupt {
        path: where_.to_owned(),
        reason,
    };
    let on_disk: OnDisk = serde_json::from_slice(json).map_err(|e| corrupt(e.to_string()))?;
    if !same_relay(&on_disk.relay, relay) || on_disk.cluster != cluster {
        tracing::info!(
            stored_relay = %on_disk.relay,
            stored_cluster = %on_disk.cluster,
            "the stored identity is for another relay or cluster; ignoring it"
        );
        return Ok(None);
    }
    let mut identity = Identity::new(
        &on_disk.relay,
        &on_disk.cluster,
        &on_disk.certificate,
        Secret::new(key()?),
        on_disk.issued_at.unwrap_or(OffsetDateTime::UNIX_EPOCH),
    )
    .map_err(|e| corrupt(e.to_string()))?;
    if identity.not_after != on_disk.not_after {
        return Err(corrupt(format!(
            "notAfter {} does not match the certificate's {}",
            on_disk.not_after.format(&Rfc3339).unwrap_or_default(),
            identity.not_after.format(&Rfc3339).unwrap_or_default()
        )));
    }
    // Keep what was stored rather than the certificate's encoding of it (identical in practice).
    identity.not_after = on_disk.not_after;
    Ok(Some(identity))
}

/// Finishes or discards an interrupted [`store`].
fn recover(state_dir: &Path) -> Result<(), IdentityError> {
    let key_new = staged(&key_path(state_dir));
    if staged(&path(state_dir)).exists() {
        commit(state_dir)?;
        tracing::info!(state_dir = %state_dir.display(), "finished an interrupted identity update");
    } else if key_new.exists() {
        fs::remove_file(&key_new).map_err(io_err("cannot remove", &key_new))?;
        tracing::info!(state_dir = %state_dir.display(), "discarded an unfinished identity update");
    }
    Ok(())
}

/// Moves the staged files (the key first, if still staged) over the live ones.
fn commit(state_dir: &Path) -> Result<(), IdentityError> {
    let (json, key) = (path(state_dir), key_path(state_dir));
    let (json_new, key_new) = (staged(&json), staged(&key));
    if key_new.exists() {
        fs::rename(&key_new, &key).map_err(io_err("cannot rename into", &key))?;
    }
    fs::rename(&json_new, &json).map_err(io_err("cannot rename into", &json))?;
    sync_dir(state_dir);
    Ok(())
}

/// Writes the identity (JSON and key) atomically, each file 0600, creating `state_dir` (0700) if needed.
pub fn store(state_dir: &Path, identity: &Identity) -> Result<(), IdentityError> {
    fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(state_dir)
        .map_err(io_err("cannot create the state directory", state_dir))?;
    let (json, key) = (path(state_dir), key_path(state_dir));
    let bytes = encode(identity)?;
    // Stage both, the JSON last: its staged name appearing is the commit point.
    write_private(state_dir, &staged(&key), identity.key.expose().as_bytes())?;
    write_private(state_dir, &staged(&json), &bytes)?;
    commit(state_dir)
}

/// Writes `bytes` to `dest` through a synced temporary file and a rename, mode 0600.
fn write_private(state_dir: &Path, dest: &Path, bytes: &[u8]) -> Result<(), IdentityError> {
    let mut tmp = dest.as_os_str().to_owned();
    tmp.push(format!(".{}.tmp", std::process::id()));
    let tmp = PathBuf::from(tmp);
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
        file.write_all(bytes)
            .map_err(io_err("cannot write", &tmp))?;
        file.sync_all().map_err(io_err("cannot sync", &tmp))?;
        fs::rename(&tmp, dest).map_err(io_err("cannot rename into", dest))?;
        sync_dir(state_dir);
        Ok(())
    })();
    if result.is_err() {
        let _ = fs::remove_file(&tmp);
    }
    result
}

/// Makes renames in `dir` durable (best effort).
fn sync_dir(dir: &Path) {
    if let Ok(dir) = fs::File::open(dir) {
        let _ = dir.sync_all();
    }
}

/// Signs a certificate for `request`'s key the way the relay does (CN = `cn`, backdated 5 minutes).
#[cfg(test)]
#[allow(clippy::unwrap_used)]
pub(crate) fn issue(request: &KeyRequest, cn: &str, lifetime: time::Duration) -> String {
    use rcgen::{BasicConstraints, CertifiedIssuer, IsCa};
    let mut ca = CertificateParams::new(Vec::<String>::new()).unwrap();
    ca.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    let ca = CertifiedIssuer::self_signed(ca, KeyPair::generate().unwrap()).unwrap();
    let key = KeyPair::from_pem(request.key.expose()).unwrap();
    let mut params = CertificateParams::new(Vec::<String>::new()).unwrap();
    params.distinguished_name.push(DnType::CommonName, cn);
    let now = OffsetDateTime::now_utc();
    params.not_before = now - time::Duration::minutes(5);
    params.not_after = now + lifetime;
    params.signed_by(&key, &ca).unwrap().pem()
}

/// A valid identity for `cluster` at `relay`, issued now.
#[cfg(test)]
#[allow(clippy::unwrap_used)]
pub(crate) fn test_identity(relay: &str, cluster: &str, lifetime: time::Duration) -> Identity {
    let request = new_key_request(cluster).unwrap();
    let cert = issue(&request, cluster, lifetime);
    Identity::new(
        relay,
        cluster,
        &cert,
        request.key,
        OffsetDateTime::now_utc(),
    )
    .unwrap()
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use time::Duration;

    fn identity(lifetime: Duration) -> Identity {
        test_identity("https://relay.example", "prod", lifetime)
    }

    #[test]
    fn csr_is_ecdsa_p256_and_names_the_cluster() {
        let request = new_key_request("prod").unwrap();
        assert!(
            request
                .csr
                .starts_with("-----BEGIN CERTIFICATE REQUEST-----")
        );
        assert!(
            request
                .key
                .expose()
                .starts_with("-----BEGIN PRIVATE KEY-----")
        );
        let key = KeyPair::from_pem(request.key.expose()).unwrap();
        assert_eq!(key.algorithm(), &rcgen::PKCS_ECDSA_P256_SHA256);
        let (_, pem) = x509_parser::pem::parse_x509_pem(request.csr.as_bytes()).unwrap();
        let (_, csr) =
            <x509_parser::certification_request::X509CertificationRequest<'_> as x509_parser::prelude::FromDer<'_, _>>::from_der(&pem.contents).unwrap();
        csr.verify_signature().unwrap();
        let cn = csr
            .certification_request_info
            .subject
            .iter_common_name()
            .next()
            .unwrap();
        assert_eq!(cn.as_str().unwrap(), "prod");
        assert!(!format!("{request:?}").contains("PRIVATE"));
    }

    #[test]
    fn certificate_checks() {
        let request = new_key_request("prod").unwrap();
        let now = OffsetDateTime::now_utc();
        let good = issue(&request, "prod", Duration::days(1));
        let id = Identity::new("r", "prod", &good, request.key.clone(), now).unwrap();
        assert_eq!(id.fingerprint.len(), 64);
        assert!(!id.is_expired(now));
        assert!(id.is_expired(id.not_after));

        // Another cluster's name.
        let other = issue(&request, "staging", Duration::days(1));
        let err = Identity::new("r", "prod", &other, request.key.clone(), now).unwrap_err();
        assert!(err.to_string().contains("does not name cluster"), "{err}");
        // Another key.
        let stranger = new_key_request("prod").unwrap();
        let err = Identity::new("r", "prod", &good, stranger.key, now).unwrap_err();
        assert!(err.to_string().contains("another public key"), "{err}");
        // Not a certificate.
        for bad in ["", "garbage", request.csr.as_str()] {
            assert!(Identity::new("r", "prod", bad, request.key.clone(), now).is_err());
        }
    }

    #[test]
    fn renewal_is_two_thirds_in_with_bounded_jitter() {
        let id = identity(Duration::seconds(90));
        let start = id.issued_at;
        let lifetime = id.not_after - start;
        let at = |j: f64| (id.renew_at(j) - start).as_seconds_f64() / lifetime.as_seconds_f64();
        assert!((at(0.0) - 2.0 / 3.0).abs() < 1e-6);
        assert!((at(1.0) - (2.0 / 3.0 + 0.05)).abs() < 1e-6);
        assert!((at(-1.0) - (2.0 / 3.0 - 0.05)).abs() < 1e-6);
        assert!((at(7.0) - at(1.0)).abs() < 1e-9, "jitter is clamped");
        // The backdated not_before (5 minutes) does not count as lifetime: with 90 s, renewal is ~60 s out.
        assert!(id.not_before < start);
        let secs = (id.renew_at(0.0) - start).whole_seconds();
        assert!((55..=65).contains(&secs), "{secs}");
        // Without a known issue time (an older file), not_before is the start.
        let mut old = id.clone();
        old.issued_at = OffsetDateTime::UNIX_EPOCH;
        assert!(old.renew_at(0.0) < id.renew_at(0.0));
    }

    #[test]
    fn store_then_load_round_trips_with_private_modes() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path().join("state");
        let id = identity(Duration::days(90));
        store(&dir, &id).unwrap();

        let mode = |p: &Path| fs::metadata(p).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode(&path(&dir)), 0o600);
        assert_eq!(mode(&key_path(&dir)), 0o600);
        assert_eq!(mode(&dir), 0o700);
        // Nothing staged or temporary left behind.
        let mut names: Vec<_> = fs::read_dir(&dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .collect();
        names.sort();
        assert_eq!(names, vec![KEY_FILE_NAME, FILE_NAME]);

        let loaded = load(&dir, "https://relay.example/", "prod")
            .unwrap()
            .unwrap();
        assert_eq!(loaded.fingerprint, id.fingerprint);
        assert_eq!(loaded.key, id.key);
        assert_eq!(loaded.not_after, id.not_after);
        assert_eq!(
            loaded.issued_at.unix_timestamp(),
            id.issued_at.unix_timestamp()
        );

        let json: serde_json::Value =
            serde_json::from_slice(&fs::read(path(&dir)).unwrap()).unwrap();
        assert_eq!(json["relay"], "https://relay.example");
        assert_eq!(json["cluster"], "prod");
        assert!(
            json["certificate"]
                .as_str()
                .unwrap()
                .contains("BEGIN CERTIFICATE")
        );
        assert!(OffsetDateTime::parse(json["notAfter"].as_str().unwrap(), &Rfc3339).is_ok());
        assert!(
            !String::from_utf8(fs::read(path(&dir)).unwrap())
                .unwrap()
                .contains("PRIVATE KEY")
        );

        // Another relay or cluster: ignored.
        assert!(
            load(&dir, "https://other.example", "prod")
                .unwrap()
                .is_none()
        );
        assert!(
            load(&dir, "https://relay.example", "staging")
                .unwrap()
                .is_none()
        );
    }

    #[test]
    fn interrupted_replacements_leave_one_consistent_pair() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path();
        let old = identity(Duration::days(90));
        let new = identity(Duration::days(90));
        store(dir, &old).unwrap();

        // Crash after staging only the key: the old pair stays.
        fs::write(staged(&key_path(dir)), new.key.expose()).unwrap();
        let loaded = load(dir, "https://relay.example", "prod").unwrap().unwrap();
        assert_eq!(loaded.fingerprint, old.fingerprint);
        assert!(!staged(&key_path(dir)).exists());

        // Crash after the commit point, before (or between) the final renames: the new pair wins.
        store(dir, &old).unwrap();
        let json = serde_json::to_vec(&OnDisk {
            relay: new.relay.clone(),
            cluster: new.cluster.clone(),
            certificate: new.certificate.clone(),
            not_after: new.not_after,
            issued_at: Some(new.issued_at),
        })
        .unwrap();
        fs::write(key_path(dir), new.key.expose()).unwrap(); // the key rename happened…
        fs::write(staged(&path(dir)), &json).unwrap(); // …the JSON rename did not
        let loaded = load(dir, "https://relay.example", "prod").unwrap().unwrap();
        assert_eq!(loaded.fingerprint, new.fingerprint);
        assert_eq!(loaded.key, new.key);

        // A certificate whose key is not the stored key is reported, not used.
        fs::write(key_path(dir), old.key.expose()).unwrap();
        assert!(matches!(
            load(dir, "https://relay.example", "prod"),
            Err(IdentityError::Corrupt { .. })
        ));
    }

    #[test]
    fn garbage_is_an_error_and_missing_is_none() {
        let tmp = tempfile::tempdir().unwrap();
        assert!(
            load(tmp.path(), "https://a.example", "prod")
                .unwrap()
                .is_none()
        );
        // An older agent's credential file is ignored.
        fs::write(
            tmp.path().join("credential.json"),
            br#"{"relay":"https://a.example","cluster":"prod","credential":"x"}"#,
        )
        .unwrap();
        assert!(
            load(tmp.path(), "https://a.example", "prod")
                .unwrap()
                .is_none()
        );
        fs::write(path(tmp.path()), b"not json").unwrap();
        assert!(matches!(
            load(tmp.path(), "https://a.example", "prod"),
            Err(IdentityError::Corrupt { .. })
        ));
    }

    #[test]
    fn debug_hides_the_key() {
        let id = identity(Duration::days(1));
        let shown = format!("{id:?}");
        assert!(!shown.contains("PRIVATE KEY"), "{shown}");
        assert!(shown.contains(&id.fingerprint));
    }
}
