//! TLS configuration helpers (rustls with the aws-lc-rs provider, the only provider in the tree).

use std::path::Path;
use std::sync::Arc;

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

/// A client config trusting the CA certificates in `ca_pem` (PEM text), or the webpki roots when `None`.
/// `alpn` is set as given.
#[allow(unused_variables, clippy::todo)]
pub fn client_config(ca_pem: Option<&[u8]>, alpn: &[&[u8]]) -> Result<Arc<rustls::ClientConfig>, TlsError> {
    todo!()
}

/// A server config from PEM certificate chain and private key, with ALPN `h2` and `http/1.1`.
#[allow(unused_variables, clippy::todo)]
pub fn server_config(cert_pem: &[u8], key_pem: &[u8]) -> Result<Arc<rustls::ServerConfig>, TlsError> {
    todo!()
}

/// Reads a file for one of the functions above, with a clear error.
pub fn read_file(path: &Path) -> Result<Vec<u8>, TlsError> {
    std::fs::read(path).map_err(|source| TlsError::Read { path: path.display().to_string(), source })
}
