//! The relay's TLS identity: given files, or a CA and server certificate generated once into the data dir.
//!
//! Files written (keys 0600): `ca.pem`, `ca-key.pem`, `server.pem`, `server-key.pem`, and
//! `server-cert.json` (the hostnames and expiry the server certificate was made for, so that a restart with
//! other hostnames, or near expiry, re-issues it from the same CA).

use std::io::Write;
use std::path::Path;
use std::sync::Arc;

use rcgen::{
    BasicConstraints, CertificateParams, DistinguishedName, DnType, ExtendedKeyUsagePurpose, IsCa,
    Issuer, KeyPair, KeyUsagePurpose,
};
use rustls::server::danger::ClientCertVerifier;
use serde::{Deserialize, Serialize};
use time::{Duration, OffsetDateTime};

use crate::config::Config;
use crate::error::RelayError;

const CA_CERT: &str = "ca.pem";
const CA_KEY: &str = "ca-key.pem";
const SERVER_CERT: &str = "server.pem";
const SERVER_KEY: &str = "server-key.pem";
const SERVER_META: &str = "server-cert.json";

const CA_VALIDITY: Duration = Duration::days(3650);
const SERVER_VALIDITY: Duration = Duration::days(397);
/// A server certificate with less than this left is re-issued at startup.
const RENEW_BEFORE: Duration = Duration::days(30);

/// What the HTTPS listener serves.
pub(crate) struct TlsIdentity {
    pub(crate) server_config: Arc<rustls::ServerConfig>,
    /// The generated CA, `None` when certificate files were given.
    pub(crate) ca_pem: Option<String>,
}

#[derive(Serialize, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
struct ServerMeta {
    hostnames: Vec<String>,
    not_after: i64,
}

/// A server config from PEM certificate chain and key, with ALPN `h2` and `http/1.1`, asking clients for a
/// certificate through `client_verifier`.
fn server_config(
    cert_pem: &[u8],
    key_pem: &[u8],
    client_verifier: Arc<dyn ClientCertVerifier>,
) -> Result<Arc<rustls::ServerConfig>, String> {
    let certs = rustls_pemfile::certs(&mut &cert_pem[..])
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| format!("malformed certificate PEM: {e}"))?;
    if certs.is_empty() {
        return Err("no certificate found (expected a PEM block \"BEGIN CERTIFICATE\")".to_owned());
    }
    let key = rustls_pemfile::private_key(&mut &key_pem[..])
        .map_err(|e| format!("malformed private key PEM: {e}"))?
        .ok_or_else(|| {
            "no private key found (expected a PEM block \"BEGIN PRIVATE KEY\")".to_owned()
        })?;
    let provider = Arc::new(rustls::crypto::aws_lc_rs::default_provider());
    let mut config = rustls::ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|e| e.to_string())?
        .with_client_cert_verifier(client_verifier)
        .with_single_cert(certs, key)
        .map_err(|e| e.to_string())?;
    config.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
    Ok(Arc::new(config))
}

/// Loads the configured certificate, or loads/generates the relay's own CA and server certificate. Client
/// certificates are checked by `client_verifier` (see [`crate::identity`]).
pub(crate) fn load(
    config: &Config,
    client_verifier: Arc<dyn ClientCertVerifier>,
) -> Result<TlsIdentity, RelayError> {
    if let (Some(cert), Some(key)) = (&config.tls_cert, &config.tls_key) {
        let cert_pem =
            tether_runtime::tls::read_file(cert).map_err(|e| RelayError::Tls(e.to_string()))?;
        let key_pem =
            tether_runtime::tls::read_file(key).map_err(|e| RelayError::Tls(e.to_string()))?;
        let server_config = server_config(&cert_pem, &key_pem, client_verifier)
            .map_err(|e| RelayError::Tls(format!("{} / {}: {e}", cert.display(), key.display())))?;
        return Ok(TlsIdentity {
            server_config,
            ca_pem: None,
        });
    }
    let dir = &config.data_dir;
    let now = OffsetDateTime::now_utc();
    let (ca_pem, ca_key) = load_or_generate_ca(dir, now)?;
    let issuer = Issuer::new(ca_params(now), ca_key);

    let wanted = ServerMeta {
        hostnames: config.hostnames.clone(),
        not_after: 0,
    };
    let meta: Option<ServerMeta> = std::fs::read(dir.join(SERVER_META))
        .ok()
        .and_then(|b| serde_json::from_slice(&b).ok());
    let reuse = meta.is_some_and(|m| {
        m.hostnames == wanted.hostnames && m.not_after > (now + RENEW_BEFORE).unix_timestamp()
    }) && dir.join(SERVER_CERT).is_file()
        && dir.join(SERVER_KEY).is_file();

    let (cert_pem, key_pem) = if reuse {
        (read(dir, SERVER_CERT)?, read(dir, SERVER_KEY)?)
    } else {
        issue_server_cert(dir, &config.hostnames, &issuer, now)?
    };
    let server_config = server_config(cert_pem.as_bytes(), key_pem.as_bytes(), client_verifier)
        .map_err(|e| RelayError::Tls(format!("generated certificate in {}: {e}", dir.display())))?;
    Ok(TlsIdentity {
        server_config,
        ca_pem: Some(ca_pem),
    })
}

/// The CA's parameters. Only its name, key usages and key-id method matter when it signs, so rebuilding them
/// from constants next to the stored key gives an issuer equivalent to the one that made `ca.pem`.
fn ca_params(now: OffsetDateTime) -> CertificateParams {
    ca_params_named("Tether relay CA", now, CA_VALIDITY)
}

/// Parameters of one of the relay's CAs (the server CA, the agent CA): only the common name and validity
/// differ.
pub(crate) fn ca_params_named(
    common_name: &str,
    now: OffsetDateTime,
    validity: Duration,
) -> CertificateParams {
    let mut params = CertificateParams::default();
    let mut dn = DistinguishedName::new();
    dn.push(DnType::OrganizationName, "Tether");
    dn.push(DnType::CommonName, common_name);
    params.distinguished_name = dn;
    params.is_ca = IsCa::Ca(BasicConstraints::Constrained(0));
    params.key_usages = vec![
        KeyUsagePurpose::KeyCertSign,
        KeyUsagePurpose::CrlSign,
        KeyUsagePurpose::DigitalSignature,
    ];
    params.not_before = now - Duration::hours(1);
    params.not_after = now + validity;
    params
}

fn load_or_generate_ca(dir: &Path, now: OffsetDateTime) -> Result<(String, KeyPair), RelayError> {
    if dir.join(CA_CERT).is_file() && dir.join(CA_KEY).is_file() {
        let cert = read(dir, CA_CERT)?;
        let key_pem = read(dir, CA_KEY)?;
        let key = KeyPair::from_pem(&key_pem)
            .map_err(|e| RelayError::Tls(format!("{}: {e}", dir.join(CA_KEY).display())))?;
        return Ok((cert, key));
    }
    let key =
        KeyPair::generate().map_err(|e| RelayError::Tls(format!("generating the CA key: {e}")))?;
    let cert = ca_params(now)
        .self_signed(&key)
        .map_err(|e| RelayError::Tls(format!("signing the CA: {e}")))?;
    let cert_pem = cert.pem();
    write_file(dir, CA_KEY, key.serialize_pem().as_bytes(), 0o600)?;
    write_file(dir, CA_CERT, cert_pem.as_bytes(), 0o644)?;
    // A new CA invalidates any server certificate signed by an older one.
    let _ = std::fs::remove_file(dir.join(SERVER_META));
    Ok((cert_pem, key))
}

fn issue_server_cert(
    dir: &Path,
    hostnames: &[String],
    issuer: &Issuer<'_, KeyPair>,
    now: OffsetDateTime,
) -> Result<(String, String), RelayError> {
    let err = |e: rcgen::Error| RelayError::Tls(format!("issuing the server certificate: {e}"));
    let mut params = CertificateParams::new(hostnames.to_vec()).map_err(err)?;
    let mut dn = DistinguishedName::new();
    dn.push(
        DnType::CommonName,
        hostnames
            .first()
            .map(String::as_str)
            .unwrap_or("tether-relay"),
    );
    params.distinguished_name = dn;
    params.key_usages = vec![
        KeyUsagePurpose::DigitalSignature,
        KeyUsagePurpose::KeyEncipherment,
    ];
    params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth];
    params.use_authority_key_identifier_extension = true;
    params.not_before = now - Duration::hours(1);
    params.not_after = now + SERVER_VALIDITY;
    let key = KeyPair::generate().map_err(err)?;
    let cert = params.signed_by(&key, issuer).map_err(err)?;
    let (cert_pem, key_pem) = (cert.pem(), key.serialize_pem());
    write_file(dir, SERVER_KEY, key_pem.as_bytes(), 0o600)?;
    write_file(dir, SERVER_CERT, cert_pem.as_bytes(), 0o644)?;
    let meta = ServerMeta {
        hostnames: hostnames.to_vec(),
        not_after: params.not_after.unix_timestamp(),
    };
    let meta = serde_json::to_vec_pretty(&meta).map_err(|e| RelayError::Tls(e.to_string()))?;
    write_file(dir, SERVER_META, &meta, 0o644)?;
    tracing::info!(hostnames = ?hostnames, dir = %dir.display(), "issued a new relay server certificate");
    Ok((cert_pem, key_pem))
}

fn read(dir: &Path, name: &str) -> Result<String, RelayError> {
    let path = dir.join(name);
    std::fs::read_to_string(&path).map_err(|e| RelayError::io("cannot read", &path, e))
}

/// Writes `name` atomically (temp file + rename) with `mode`.
pub(crate) fn write_file(dir: &Path, name: &str, data: &[u8], mode: u32) -> Result<(), RelayError> {
    let path = dir.join(name);
    let tmp = dir.join(format!(".{name}.tmp"));
    let _ = std::fs::remove_file(&tmp);
    let mut options = std::fs::OpenOptions::new();
    options.write(true).create_new(true);
    #[cfg(unix)]
    {
        use std::os::unix::fs::OpenOptionsExt;
        options.mode(mode);
    }
    #[cfg(not(unix))]
    let _ = mode;
    let mut file = options
        .open(&tmp)
        .map_err(|e| RelayError::io("cannot create", &tmp, e))?;
    file.write_all(data)
        .and_then(|()| file.sync_all())
        .map_err(|e| RelayError::io("cannot write", &tmp, e))?;
    std::fs::rename(&tmp, &path).map_err(|e| RelayError::io("cannot rename to", &path, e))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(dir: &Path) -> Config {
        Config::new(dir.to_path_buf())
    }

    fn load(config: &Config) -> Result<TlsIdentity, RelayError> {
        super::load(
            config,
            rustls::server::WebPkiClientVerifier::no_client_auth(),
        )
    }

    #[test]
    fn generates_once_and_reuses() {
        tether_runtime::tls::install_crypto_provider();
        let dir = tempfile::tempdir().expect("tempdir");
        let first = load(&config(dir.path())).expect("generate");
        let ca = first.ca_pem.expect("generated CA");
        let server = std::fs::read(dir.path().join(SERVER_CERT)).expect("server cert written");
        let second = load(&config(dir.path())).expect("reload");
        assert_eq!(second.ca_pem.as_deref(), Some(ca.as_str()));
        assert_eq!(
            std::fs::read(dir.path().join(SERVER_CERT)).expect("server cert"),
            server
        );
        #[cfg(unix)]
        {
            use std::os::unix::fs::PermissionsExt;
            for key in [CA_KEY, SERVER_KEY] {
                let mode = std::fs::metadata(dir.path().join(key))
                    .expect("key exists")
                    .permissions()
                    .mode();
                assert_eq!(mode & 0o777, 0o600, "{key}");
            }
        }
    }

    #[test]
    fn new_hostnames_reissue_the_server_cert_from_the_same_ca() {
        tether_runtime::tls::install_crypto_provider();
        let dir = tempfile::tempdir().expect("tempdir");
        let first = load(&config(dir.path())).expect("generate");
        let server = std::fs::read(dir.path().join(SERVER_CERT)).expect("server cert written");
        let mut c = config(dir.path());
        c.hostnames.push("relay.example.com".into());
        let second = load(&c).expect("reissue");
        assert_eq!(first.ca_pem, second.ca_pem);
        assert_ne!(
            std::fs::read(dir.path().join(SERVER_CERT)).expect("server cert"),
            server
        );
    }
}
