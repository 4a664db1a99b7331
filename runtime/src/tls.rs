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
/// `alpn` is set as given. No client certificate; see [`client_config_with`] for more.
pub fn client_config(
    ca_pem: Option<&[u8]>,
    alpn: &[&[u8]],
) -> Result<Arc<rustls::ClientConfig>, TlsError> {
    client_config_with(&ClientOptions {
        ca_pem,
        alpn,
        ..ClientOptions::default()
    })
}

/// A TLS client identity: a PEM certificate chain (leaf first) and its PEM private key. `Debug` does not
/// print the key.
#[derive(Clone, Copy)]
pub struct ClientIdentity<'a> {
    /// The certificate chain, PEM.
    pub cert_pem: &'a [u8],
    /// The private key (PKCS#8, SEC1 or PKCS#1), PEM.
    pub key_pem: &'a [u8],
}

impl std::fmt::Debug for ClientIdentity<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ClientIdentity")
            .field("cert_pem", &String::from_utf8_lossy(self.cert_pem))
            .field("key_pem", &"***")
            .finish()
    }
}

/// What [`client_config_with`] builds.
#[derive(Debug, Default, Clone, Copy)]
pub struct ClientOptions<'a> {
    /// CA certificates (PEM) to trust for the server; `None` trusts the webpki roots.
    pub ca_pem: Option<&'a [u8]>,
    /// More CA certificates (PEM) trusted in addition to the above, e.g. the CA of a TLS-inspecting proxy.
    pub extra_ca_pem: Option<&'a [u8]>,
    /// A certificate and key presented when the server asks for one (mutual TLS).
    pub identity: Option<ClientIdentity<'a>>,
    /// ALPN protocols, in order of preference.
    pub alpn: &'a [&'a [u8]],
}

/// A client config from `options`. A client identity whose key does not match its certificate is an error
/// here, not at handshake time.
pub fn client_config_with(
    options: &ClientOptions<'_>,
) -> Result<Arc<rustls::ClientConfig>, TlsError> {
    let mut roots = RootCertStore::empty();
    match options.ca_pem {
        Some(pem) => add_roots(&mut roots, pem, "CA")?,
        None => roots.extend(webpki_roots::TLS_SERVER_ROOTS.iter().cloned()),
    }
    if let Some(pem) = options.extra_ca_pem {
        add_roots(&mut roots, pem, "extra CA")?;
    }
    let builder = rustls::ClientConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()?
        .with_root_certificates(roots);
    let mut config = match options.identity {
        Some(identity) => {
            let chain = parse_certs(identity.cert_pem, "client")?;
            let key = parse_key(identity.key_pem)?;
            builder.with_client_auth_cert(chain, key)?
        }
        None => builder.with_no_client_auth(),
    };
    config.alpn_protocols = options.alpn.iter().map(|p| p.to_vec()).collect();
    Ok(Arc::new(config))
}

fn add_roots(roots: &mut RootCertStore, pem: &[u8], what: &str) -> Result<(), TlsError> {
    for cert in parse_certs(pem, what)? {
        roots
            .add(cert)
            .map_err(|e| TlsError::Invalid(format!("unusable {what} certificate: {e}")))?;
    }
    Ok(())
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
    fn client_identity_and_extra_roots() -> anyhow::Result<()> {
        let (cert, key) = self_signed()?;
        let (other_cert, other_key) = self_signed()?;
        let with_identity = client_config_with(&ClientOptions {
            ca_pem: Some(cert.as_bytes()),
            extra_ca_pem: Some(other_cert.as_bytes()),
            identity: Some(ClientIdentity {
                cert_pem: cert.as_bytes(),
                key_pem: key.as_bytes(),
            }),
            alpn: &[b"http/1.1"],
        })?;
        assert!(with_identity.client_auth_cert_resolver.has_certs());
        assert_eq!(with_identity.alpn_protocols, vec![b"http/1.1".to_vec()]);
        assert!(
            !client_config(None, &[])?
                .client_auth_cert_resolver
                .has_certs()
        );

        // A key that is not the certificate's is refused when the config is built.
        let err = error_text(client_config_with(&ClientOptions {
            identity: Some(ClientIdentity {
                cert_pem: cert.as_bytes(),
                key_pem: other_key.as_bytes(),
            }),
            ..ClientOptions::default()
        }));
        assert!(err.contains("TLS configuration rejected"), "{err}");
        let err = error_text(client_config_with(&ClientOptions {
            extra_ca_pem: Some(b"nothing"),
            ..ClientOptions::default()
        }));
        assert!(err.contains("no extra CA certificate found"), "{err}");

        let shown = format!(
            "{:?}",
            ClientIdentity {
                cert_pem: cert.as_bytes(),
                key_pem: key.as_bytes(),
            }
        );
        assert!(
            !shown.contains("PRIVATE KEY") && shown.contains("***"),
            "{shown}"
        );
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
