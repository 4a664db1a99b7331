//! TLS configuration helpers (rustls with the aws-lc-rs provider, the only provider in the tree).
//!
//! The configs are built with the aws-lc-rs provider explicitly, so they work whether or not
//! [`install_crypto_provider`] was called; other code (hyper-rustls, kube) relies on the process default,
//! hence the helper.

use std::io::BufReader;
use std::path::Path;
use std::sync::Arc;

use rustls::RootCertStore;
use rustls::crypto::CryptoProvider;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};

/// Why TLS material could not be loaded.
#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    /// A file could not be read.
    #[error("cannot read {path}: {source}")]
    Read {
        /// The file.
        path: String,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
    /// The PEM held no usable certificate or key.
    #[error("{0}")]
    Invalid(String),
    /// rustls rejected the configuration.
    #[error("TLS configuration rejected: {0}")]
    Rustls(#[from] rustls::Error),
}

/// Installs aws-lc-rs as the process-wide rustls provider. Idempotent; call at startup.
pub fn install_crypto_provider() {
    let _ = rustls::crypto::aws_lc_rs::default_provider().install_default();
}

fn provider() -> Arc<CryptoProvider> {
    Arc::new(rustls::crypto::aws_lc_rs::default_provider())
}

/// A client config trusting the CA certificates in `ca_pem` (PEM text), or the webpki roots when `None`.
/// `alpn` is set as given.
pub fn client_config(
    ca_pem: Option<&[u8]>,
    alpn: &[&[u8]],
) -> Result<Arc<rustls::ClientConfig>, TlsError> {
    let mut roots = RootCertStore::empty();
    match ca_pem {
        Some(pem) => {
            let certs = parse_certs(pem, "CA")?;
            for cert in certs {
                roots
                    .add(cert)
                    .map_err(|e| TlsError::Invalid(format!("unusable CA certificate: {e}")))?;
            }
        }
        None => roots.extend(webpki_roots::TLS_SERVER_ROOTS.iter().cloned()),
    }
    let mut config = rustls::ClientConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()?
        .with_root_certificates(roots)
        .with_no_client_auth();
    config.alpn_protocols = alpn.iter().map(|p| p.to_vec()).collect();
    Ok(Arc::new(config))
}

/// A server config from PEM certificate chain and private key, with ALPN `h2` and `http/1.1`.
pub fn server_config(
    cert_pem: &[u8],
    key_pem: &[u8],
) -> Result<Arc<rustls::ServerConfig>, TlsError> {
    let certs = parse_certs(cert_pem, "server")?;
    let key = parse_key(key_pem)?;
    let mut config = rustls::ServerConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()?
        .with_no_client_auth()
        .with_single_cert(certs, key)?;
    config.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
    Ok(Arc::new(config))
}

/// Reads a file for one of the functions above, with a clear error.
pub fn read_file(path: &Path) -> Result<Vec<u8>, TlsError> {
    std::fs::read(path).map_err(|source| TlsError::Read {
        path: path.display().to_string(),
        source,
    })
}

fn parse_certs(pem: &[u8], what: &str) -> Result<Vec<CertificateDer<'static>>, TlsError> {
    let certs = rustls_pemfile::certs(&mut BufReader::new(pem))
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| TlsError::Invalid(format!("malformed {what} certificate PEM: {e}")))?;
    if certs.is_empty() {
        return Err(TlsError::Invalid(format!(
            "no {what} certificate found (expected a PEM block \"BEGIN CERTIFICATE\")"
        )));
    }
    Ok(certs)
}

fn parse_key(pem: &[u8]) -> Result<PrivateKeyDer<'static>, TlsError> {
    rustls_pemfile::private_key(&mut BufReader::new(pem))
        .map_err(|e| TlsError::Invalid(format!("malformed private key PEM: {e}")))?
        .ok_or_else(|| {
            TlsError::Invalid(
                "no private key found (expected a PEM block \"BEGIN PRIVATE KEY\")".to_owned(),
            )
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn self_signed() -> anyhow::Result<(String, String)> {
        let cert = rcgen::generate_simple_self_signed(vec!["localhost".to_owned()])?;
        Ok((cert.cert.pem(), cert.signing_key.serialize_pem()))
    }

    fn error_text<T>(r: Result<T, TlsError>) -> String {
        r.err().map(|e| e.to_string()).unwrap_or_default()
    }

    #[test]
    fn empty_or_bad_pem_is_a_clear_error() -> anyhow::Result<()> {
        let err = error_text(client_config(Some(b""), &[]));
        assert!(err.contains("no CA certificate found"), "{err}");
        let (cert, key) = self_signed()?;
        let err = error_text(server_config(cert.as_bytes(), b""));
        assert!(err.contains("no private key found"), "{err}");
        let err = error_text(server_config(b"garbage", key.as_bytes()));
        assert!(err.contains("no server certificate found"), "{err}");
        let err = error_text(client_config(
            Some(b"-----BEGIN CERTIFICATE-----\nnot base64!\n-----END CERTIFICATE-----\n"),
            &[],
        ));
        assert!(err.contains("CA certificate"), "{err}");
        Ok(())
    }

    #[test]
    fn valid_material_builds() -> anyhow::Result<()> {
        let (cert, key) = self_signed()?;
        let server = server_config(cert.as_bytes(), key.as_bytes())?;
        assert_eq!(
            server.alpn_protocols,
            vec![b"h2".to_vec(), b"http/1.1".to_vec()]
        );
        let client = client_config(Some(cert.as_bytes()), &[b"http/1.1"])?;
        assert_eq!(client.alpn_protocols, vec![b"http/1.1".to_vec()]);
        assert!(client_config(None, &[]).is_ok());
        Ok(())
    }

    #[test]
    fn mismatched_key_is_rejected() -> anyhow::Result<()> {
        let (cert, _) = self_signed()?;
        let (_, other_key) = self_signed()?;
        assert!(matches!(
            server_config(cert.as_bytes(), other_key.as_bytes()),
            Err(TlsError::Rustls(_))
        ));
        Ok(())
    }
}
