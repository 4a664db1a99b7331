//! The relay's configuration: where it keeps its state, its TLS identity, and the limits it enforces.

use std::path::PathBuf;
use std::time::Duration;

use tether_tunnel::{Role, SessionConfig};

/// Everything the relay needs to run. Build it with [`Config::new`], adjust fields, then [`Config::validate`]
/// (also done by [`crate::Relay::new`]).
#[derive(Debug, Clone)]
pub struct Config {
    /// Where the SQLite database, the generated TLS material and the admin token live (created 0700).
    pub data_dir: PathBuf,
    /// PEM certificate chain to serve; with `tls_key`. When both are `None` a CA and a server certificate are
    /// generated into `data_dir`.
    pub tls_cert: Option<PathBuf>,
    /// PEM private key for `tls_cert`.
    pub tls_key: Option<PathBuf>,
    /// Subject alternative names of the generated server certificate (DNS names or IP addresses).
    pub hostnames: Vec<String>,
    /// File holding the admin token. When `None`, `DATA_DIR/admin-token` is generated once (0600) and reused.
    pub admin_token_file: Option<PathBuf>,
    /// How long an agent has to accept a stream before the user gets a 504.
    pub open_timeout: Duration,
    /// Database URL; `None` means `sqlite://DATA_DIR/relay.db`. Only `sqlite:` URLs are supported today.
    pub database_url: Option<String>,
    /// Connection and request limits.
    pub limits: Limits,
    /// Session settings for agent tunnels (the role is always forced to [`Role::Server`]).
    pub tunnel: SessionConfig,
    /// How often agents send heartbeats (told to them in `welcome`; whole seconds, at least 1).
    pub heartbeat_interval: Duration,
    /// A cluster not heard from (heartbeat or connect) for this long is `Offline`.
    pub offline_threshold: Duration,
    /// How long an issued cluster identity (client certificate) is valid.
    pub identity_validity: Duration,
    /// The newest agent version this relay offers (semver); older agents show `upgradeAvailable`.
    pub latest_agent_version: String,
    /// Relay-side validation of Entra-style tokens; `None`: every token passes through to the cluster.
    pub entra: Option<EntraConfig>,
}

/// Which Entra-style tokens the relay validates before anything enters a tunnel.
///
/// A bearer token that is a JWT whose `iss` lies under one of the configured authorities
/// (`{authority}/…/v2.0` or `https://sts.windows.net/…/`) must validate (signature, tenant, audience,
/// lifetime: `tether_auth::token::Authenticator`), else the request is refused with 401. Other tokens
/// (Kubernetes service-account tokens, opaque tokens) pass through to the cluster unchanged.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct EntraConfig {
    /// Accepted tenant ids (`tid`); at least one.
    pub tenants: Vec<String>,
    /// Accepted audiences (`aud`); at least one.
    pub audiences: Vec<String>,
    /// Base URL of v2 issuers and of discovery (default `https://login.microsoftonline.com`); https only.
    pub authority: Option<String>,
    /// PEM CA bundle trusted for discovery and JWKS fetches in addition to the public roots (development
    /// and tests, where the authority is a local issuer).
    pub authority_ca: Option<PathBuf>,
}

impl EntraConfig {
    /// The guard crate's token settings for this configuration.
    pub fn token_config(&self) -> tether_auth::TokenConfig {
        let mut config =
            tether_auth::TokenConfig::new(self.tenants.clone(), self.audiences.clone());
        if let Some(authority) = &self.authority {
            config.v2_authority = authority.trim_end_matches('/').to_owned();
        }
        config
    }
}

/// Bounds on what one client can make the relay hold.
#[derive(Debug, Clone)]
pub struct Limits {
    /// Most TCP connections served at once (upgraded tunnels and exec sessions included); further
    /// connections wait in the kernel backlog.
    pub max_connections: usize,
    /// Time allowed for the TLS handshake.
    pub tls_handshake_timeout: Duration,
    /// Time allowed to receive a request's headers (HTTP/1.1).
    pub header_read_timeout: Duration,
    /// Largest request head accepted (HTTP/1.1 read buffer; HTTP/2 header list size).
    pub max_header_bytes: usize,
    /// Most concurrent HTTP/2 streams per client connection.
    pub h2_max_concurrent_streams: u32,
    /// Largest JSON body accepted by the admin and agent endpoints.
    pub max_control_body_bytes: usize,
    /// On shutdown, how long in-flight requests and tunnels get to finish before they are cut.
    pub shutdown_grace: Duration,
    /// Tunnels per second the relay expects to accept right after a restart. On shutdown each agent is told
    /// (`draining`) to come back within `tunnels / reconnect_rate` seconds (at least 1 s), at a uniformly
    /// random moment, so a fleet does not reconnect all at once.
    pub reconnect_rate: u32,
    /// How often heartbeats and health reports gathered in memory are written to the store, all clusters in
    /// one transaction.
    pub last_seen_interval: Duration,
}

impl Default for Limits {
    fn default() -> Self {
        Self {
            max_connections: 50_000,
            tls_handshake_timeout: Duration::from_secs(10),
            header_read_timeout: Duration::from_secs(30),
            max_header_bytes: 64 * 1024,
            h2_max_concurrent_streams: 250,
            max_control_body_bytes: 64 * 1024,
            shutdown_grace: Duration::from_secs(10),
            reconnect_rate: 1_000,
            last_seen_interval: Duration::from_secs(5),
        }
    }
}

/// Why a [`Config`] cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// Only one of `tls_cert` and `tls_key` was given.
    #[error("--tls-cert and --tls-key must be given together")]
    IncompleteTls,
    /// A hostname for the generated certificate is not a DNS name or an IP address.
    #[error("invalid hostname {0:?}: expected a DNS name or an IP address")]
    InvalidHostname(String),
    /// No hostname for the generated certificate.
    #[error("at least one hostname is needed for the generated certificate")]
    NoHostnames,
    /// The open timeout is zero.
    #[error("open timeout must be greater than zero")]
    ZeroOpenTimeout,
    /// The database URL names a backend this build does not support.
    #[error("unsupported database URL {0:?}: only sqlite: URLs are supported")]
    UnsupportedDatabase(String),
    /// A lifecycle setting (heartbeat interval, offline threshold, identity validity) is out of range.
    #[error("invalid {name}: {why}")]
    InvalidSetting {
        /// Which setting.
        name: &'static str,
        /// What is wrong with it.
        why: &'static str,
    },
    /// The latest agent version is not a semantic version.
    #[error("invalid latest agent version {0:?}: expected a semantic version such as 1.4.0")]
    InvalidAgentVersion(String),
    /// The Entra token settings are unusable.
    #[error("invalid Entra settings: {0}")]
    InvalidEntra(String),
    /// A limit is zero or out of range.
    #[error("invalid limit {name}: {why}")]
    InvalidLimit {
        /// Which limit.
        name: &'static str,
        /// What is wrong with it.
        why: &'static str,
    },
}

impl Config {
    /// Defaults for everything but the data directory.
    pub fn new(data_dir: PathBuf) -> Self {
        Self {
            data_dir,
            tls_cert: None,
            tls_key: None,
            hostnames: vec!["localhost".into(), "127.0.0.1".into(), "::1".into()],
            admin_token_file: None,
            open_timeout: Duration::from_secs(10),
            database_url: None,
            limits: Limits::default(),
            tunnel: SessionConfig::new(Role::Server),
            heartbeat_interval: Duration::from_secs(30),
            offline_threshold: Duration::from_secs(15 * 60),
            identity_validity: Duration::from_secs(90 * 24 * 3600),
            latest_agent_version: env!("CARGO_PKG_VERSION").to_owned(),
            entra: None,
        }
    }

    /// Checks the configuration without touching the filesystem or the network.
    pub fn validate(&self) -> Result<(), ConfigError> {
        if self.tls_cert.is_some() != self.tls_key.is_some() {
            return Err(ConfigError::IncompleteTls);
        }
        if self.tls_cert.is_none() {
            if self.hostnames.is_empty() {
                return Err(ConfigError::NoHostnames);
            }
            for h in &self.hostnames {
                if !valid_hostname(h) {
                    return Err(ConfigError::InvalidHostname(h.clone()));
                }
            }
        }
        if self.open_timeout.is_zero() {
            return Err(ConfigError::ZeroOpenTimeout);
        }
        if let Some(url) = &self.database_url
            && !url.starts_with("sqlite:")
        {
            return Err(ConfigError::UnsupportedDatabase(url.clone()));
        }
        let l = &self.limits;
        let checks: [(&'static str, bool, &'static str); 7] = [
            (
                "max_connections",
                l.max_connections == 0,
                "must be at least 1",
            ),
            (
                "reconnect_rate",
                l.reconnect_rate == 0,
                "must be at least 1",
            ),
            (
                "h2_max_concurrent_streams",
                l.h2_max_concurrent_streams == 0,
                "must be at least 1",
            ),
            (
                "max_header_bytes",
                l.max_header_bytes < 8192,
                "must be at least 8192",
            ),
            (
                "max_control_body_bytes",
                l.max_control_body_bytes == 0,
                "must be at least 1",
            ),
            (
                "tls_handshake_timeout",
                l.tls_handshake_timeout.is_zero(),
                "must be greater than zero",
            ),
            (
                "header_read_timeout",
                l.header_read_timeout.is_zero(),
                "must be greater than zero",
            ),
        ];
        for (name, bad, why) in checks {
            if bad {
                return Err(ConfigError::InvalidLimit { name, why });
            }
        }
        if l.last_seen_interval.is_zero() {
            return Err(ConfigError::InvalidLimit {
                name: "last_seen_interval",
                why: "must be greater than zero",
            });
        }
        let settings: [(&'static str, bool, &'static str); 3] = [
            (
                "heartbeat interval",
                self.heartbeat_interval < Duration::from_secs(1)
                    || self.heartbeat_interval.subsec_nanos() != 0,
                "must be a whole number of seconds, at least 1s",
            ),
            (
                "offline threshold",
                self.offline_threshold <= self.heartbeat_interval,
                "must be longer than the heartbeat interval",
            ),
            (
                "identity validity",
                self.identity_validity < Duration::from_secs(1)
                    || self.identity_validity > Duration::from_secs(100 * 365 * 24 * 3600),
                "must be between 1s and 100 years",
            ),
        ];
        for (name, bad, why) in settings {
            if bad {
                return Err(ConfigError::InvalidSetting { name, why });
            }
        }
        if semver::Version::parse(self.latest_agent_version.trim_start_matches('v')).is_err() {
            return Err(ConfigError::InvalidAgentVersion(
                self.latest_agent_version.clone(),
            ));
        }
        if let Some(entra) = &self.entra {
            entra
                .token_config()
                .validate()
                .map_err(|e| ConfigError::InvalidEntra(e.to_string()))?;
        }
        Ok(())
    }

    /// The database URL actually used.
    pub(crate) fn effective_database_url(&self) -> String {
        match &self.database_url {
            Some(url) => url.clone(),
            None => format!("sqlite://{}", self.data_dir.join("relay.db").display()),
        }
    }
}

/// A DNS name (labels of letters, digits, hyphens, optionally a leading `*.`) or an IP address.
fn valid_hostname(h: &str) -> bool {
    if h.parse::<std::net::IpAddr>().is_ok() {
        return true;
    }
    let name = h.strip_prefix("*.").unwrap_or(h);
    !name.is_empty()
        && name.len() <= 253
        && name.split('.').all(|label| {
            !label.is_empty()
                && label.len() <= 63
                && label
                    .bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b == b'-')
                && !label.starts_with('-')
                && !label.ends_with('-')
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_validate() {
        assert!(Config::new("/tmp/x".into()).validate().is_ok());
    }

    #[test]
    fn tls_cert_and_key_go_together() {
        let mut c = Config::new("/tmp/x".into());
        c.tls_cert = Some("cert.pem".into());
        assert!(matches!(c.validate(), Err(ConfigError::IncompleteTls)));
        c.tls_key = Some("key.pem".into());
        assert!(c.validate().is_ok());
    }

    #[test]
    fn hostnames_are_checked() {
        let mut c = Config::new("/tmp/x".into());
        c.hostnames = vec![
            "relay.example.com".into(),
            "10.0.0.1".into(),
            "*.example.org".into(),
        ];
        assert!(c.validate().is_ok());
        c.hostnames.push("bad host".into());
        assert!(matches!(c.validate(), Err(ConfigError::InvalidHostname(_))));
        c.hostnames.clear();
        assert!(matches!(c.validate(), Err(ConfigError::NoHostnames)));
    }

    #[test]
    fn only_sqlite_urls() {
        let mut c = Config::new("/tmp/x".into());
        c.database_url = Some("postgres://db/tether".into());
        assert!(matches!(
            c.validate(),
            Err(ConfigError::UnsupportedDatabase(_))
        ));
        c.database_url = Some("sqlite::memory:".into());
        assert!(c.validate().is_ok());
        c.database_url = None;
        assert_eq!(c.effective_database_url(), "sqlite:///tmp/x/relay.db");
    }

    #[test]
    fn limits_are_checked() {
        let mut c = Config::new("/tmp/x".into());
        c.limits.max_connections = 0;
        assert!(matches!(
            c.validate(),
            Err(ConfigError::InvalidLimit {
                name: "max_connections",
                ..
            })
        ));
        let mut c = Config::new("/tmp/x".into());
        c.open_timeout = Duration::ZERO;
        assert!(matches!(c.validate(), Err(ConfigError::ZeroOpenTimeout)));
    }

    #[test]
    fn lifecycle_settings_are_checked() {
        let mut c = Config::new("/tmp/x".into());
        c.heartbeat_interval = Duration::from_millis(1500);
        assert!(matches!(
            c.validate(),
            Err(ConfigError::InvalidSetting {
                name: "heartbeat interval",
                ..
            })
        ));
        c.heartbeat_interval = Duration::from_secs(1);
        c.offline_threshold = Duration::from_secs(1);
        assert!(matches!(
            c.validate(),
            Err(ConfigError::InvalidSetting {
                name: "offline threshold",
                ..
            })
        ));
        c.offline_threshold = Duration::from_secs(3);
        c.identity_validity = Duration::ZERO;
        assert!(matches!(
            c.validate(),
            Err(ConfigError::InvalidSetting {
                name: "identity validity",
                ..
            })
        ));
        c.identity_validity = Duration::from_secs(5);
        assert!(c.validate().is_ok());
        c.latest_agent_version = "latest".into();
        assert!(matches!(
            c.validate(),
            Err(ConfigError::InvalidAgentVersion(_))
        ));
        c.latest_agent_version = "v1.2.3-rc.1".into();
        assert!(c.validate().is_ok());
    }

    #[test]
    fn entra_settings_are_checked() {
        let mut c = Config::new("/tmp/x".into());
        let good = EntraConfig {
            tenants: vec!["72f988bf-86f1-41af-91ab-2d7cd011db47".into()],
            audiences: vec!["api://tether".into()],
            authority: Some("https://127.0.0.1:8443/".into()),
            authority_ca: None,
        };
        c.entra = Some(good.clone());
        assert!(c.validate().is_ok());
        assert_eq!(
            good.token_config().v2_authority,
            "https://127.0.0.1:8443",
            "a trailing slash would make the issuer URL wrong"
        );
        for bad in [
            EntraConfig {
                tenants: vec![],
                ..good.clone()
            },
            EntraConfig {
                audiences: vec![],
                ..good.clone()
            },
            EntraConfig {
                authority: Some("http://idp.example".into()),
                ..good.clone()
            },
            EntraConfig {
                tenants: vec!["has space".into()],
                ..good.clone()
            },
        ] {
            c.entra = Some(bad.clone());
            assert!(
                matches!(c.validate(), Err(ConfigError::InvalidEntra(_))),
                "{bad:?}"
            );
        }
    }
}
