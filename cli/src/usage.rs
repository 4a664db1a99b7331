//! Why the CLI configuration (flags, environment, config file) is unusable; `tether` exits 64 for these.

use std::path::PathBuf;

/// Why the CLI configuration is unusable.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// A file could not be read.
    #[error("cannot read {path}: {source}")]
    Read {
        /// The file.
        path: PathBuf,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
    /// The config file is not valid JSON of the expected shape.
    #[error("config file {path} is invalid: {source}")]
    Parse {
        /// The file.
        path: PathBuf,
        /// The cause.
        #[source]
        source: serde_json::Error,
    },
    /// No relay URL anywhere.
    #[error(
        "no relay configured: pass --relay URL, set TETHER_RELAY, or point --config at the config.json \
         that `tether up` wrote"
    )]
    NoRelay,
    /// No admin token anywhere.
    #[error(
        "no admin token configured: pass --admin-token-file or use the config.json that `tether up` wrote"
    )]
    NoAdminToken,
    /// Some value is wrong.
    #[error("{0}")]
    Invalid(String),
}
