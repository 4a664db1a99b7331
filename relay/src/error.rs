//! Why the relay could not start or stopped. Request errors are [`crate::api_error::ApiError`].

use crate::config::ConfigError;
use crate::store::StoreError;

/// Why the relay could not start or stopped abnormally.
#[derive(Debug, thiserror::Error)]
pub enum RelayError {
    /// The configuration is invalid.
    #[error(transparent)]
    Config(#[from] ConfigError),
    /// The data directory or a file in it could not be created, read or written.
    #[error("{what} {path}: {source}")]
    Io {
        /// What was being done.
        what: &'static str,
        /// The file or directory.
        path: String,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
    /// The store could not be opened or migrated.
    #[error("cannot open the store: {0}")]
    Store(#[source] StoreError),
    /// TLS material could not be loaded or generated.
    #[error("TLS setup failed: {0}")]
    Tls(String),
}

impl RelayError {
    pub(crate) fn io(what: &'static str, path: &std::path::Path, source: std::io::Error) -> Self {
        Self::Io {
            what,
            path: path.display().to_string(),
            source,
        }
    }
}

impl RelayError {
    /// Whether the error is the operator's to fix in the configuration (the program exits 64).
    pub fn is_usage(&self) -> bool {
        matches!(self, RelayError::Config(_) | RelayError::Tls(_))
    }
}
