//! The agent's configuration and its validation.

use std::path::PathBuf;
use std::time::Duration;

use tether_tunnel::Secret;
use tether_tunnel::proxy::ProxyConfig;

use crate::backoff::Backoff;
use crate::identity;

/// Everything the agent needs to run. Build with [`Config::new`], adjust fields, then [`Config::validate`].
#[derive(Debug, Clone)]
pub struct Config {
    /// The relay's base URL, `https://relay.example:8443`; the agent derives `wss://…/agent/v1/tunnel` and
    /// `https://…/agent/v1/onboard` from it.
    pub relay_url: String,
    /// This cluster's name at the relay.
    pub cluster: String,
    /// The one-time onboarding token; needed only while `state_dir` holds no identity for this relay and
    /// cluster.
    pub onboarding_token: Option<Secret>,
    /// Where the identity lives: `identity.json` and `identity-key.pem` (files 0600, directory 0700).
    pub state_dir: PathBuf,
    /// A PEM CA bundle to trust for the relay; `None` trusts the webpki roots.
    pub relay_ca: Option<PathBuf>,
    /// The HTTP CONNECT proxy to reach the relay through (tunnel and onboarding), with the hosts that bypass
    /// it; `None` connects directly.
    pub proxy: Option<ProxyConfig>,
    /// A PEM CA bundle trusted for the relay connection in addition to `relay_ca`, for proxies that inspect
    /// TLS (`--proxy-cert`).
    pub proxy_ca: Option<PathBuf>,
    /// The kubeconfig naming the apiserver; `None` uses `kube::Config::infer()` (KUBECONFIG, ~/.kube/config,
    /// in-cluster).
    pub kubeconfig: Option<PathBuf>,
    /// Reconnect pacing.
    pub backoff: Backoff,
    /// On shutdown, how long open streams may keep running after GOAWAY (default 20 s).
    pub drain_timeout: Duration,
    /// Timeout for each attempt to reach the relay (TCP, TLS, WebSocket and onboarding request; default 15 s).
    pub connect_timeout: Duration,
}

/// Why a configuration cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// The relay URL is not an `https://host[:port][/path]` URL.
    #[error("invalid relay URL {url:?}: {reason}")]
    InvalidRelayUrl {
        /// The URL as given.
        url: String,
        /// What is wrong with it.
        reason: String,
    },
    /// The cluster name is not a DNS label.
    #[error(
        "invalid cluster name {0:?}: use 1-63 lowercase letters, digits and '-', starting and ending with a letter or digit"
    )]
    InvalidClusterName(String),
    /// No state directory was given.
    #[error("the state directory must not be empty")]
    EmptyStateDir,
    /// An onboarding token was given but is empty.
    #[error("the onboarding token is empty")]
    EmptyOnboardingToken,
    /// There is neither a stored identity nor an onboarding token.
    #[error(
        "no identity for cluster {cluster:?} at {relay} in {state_dir} and no onboarding token: pass the token printed by `tether cluster connect` (--onboarding-token or TETHER_ONBOARDING_TOKEN)"
    )]
    MissingOnboardingToken {
        /// The relay URL.
        relay: String,
        /// The cluster.
        cluster: String,
        /// The state directory searched.
        state_dir: String,
    },
    /// The stored identity cannot be read.
    #[error(transparent)]
    Identity(#[from] identity::IdentityError),
    /// A file named in the configuration does not exist.
    #[error("{what} {path} does not exist or is not a file")]
    MissingFile {
        /// Which setting.
        what: &'static str,
        /// The path given.
        path: String,
    },
    /// A duration setting is out of range.
    #[error("{0}")]
    InvalidDuration(&'static str),
}

impl Config {
    /// A configuration with defaults: no onboarding token, webpki roots for the relay, the inferred kube
    /// config, backoff 500 ms..30 s (reset after 60 s connected), drain 20 s, connect timeout 15 s.
    pub fn new(
        relay_url: impl Into<String>,
        cluster: impl Into<String>,
        state_dir: impl Into<PathBuf>,
    ) -> Self {
        Self {
            relay_url: relay_url.into(),
            cluster: cluster.into(),
            onboarding_token: None,
            state_dir: state_dir.into(),
            relay_ca: None,
            proxy: None,
            proxy_ca: None,
            kubeconfig: None,
            backoff: Backoff::default(),
            drain_timeout: Duration::from_secs(20),
            connect_timeout: Duration::from_secs(15),
        }
    }

    /// Checks everything that can be checked without the network: URL, name, files, durations, and that an
    /// identity or an onboarding token is available.
    pub fn validate(&self) -> Result<(), ConfigError> {
        self.relay_base()?;
        if !is_dns_label(&self.cluster) {
            return Err(ConfigError::InvalidClusterName(self.cluster.clone()));
        }
        if self.state_dir.as_os_str().is_empty() {
            return Err(ConfigError::EmptyStateDir);
        }
        for (what, path) in [
            ("relay CA file", &self.relay_ca),
            ("proxy CA file", &self.proxy_ca),
            ("kubeconfig", &self.kubeconfig),
        ] {
            if let Some(path) = path
                && !path.is_file()
            {
                return Err(ConfigError::MissingFile {
                    what,
                    path: path.display().to_string(),
                });
            }
        }
        if self.backoff.base.is_zero() {
            return Err(ConfigError::InvalidDuration(
                "the backoff base must be greater than zero",
            ));
        }
        if self.backoff.cap < self.backoff.base {
            return Err(ConfigError::InvalidDuration(
                "the backoff cap must be at least the backoff base",
            ));
        }
        if self.connect_timeout.is_zero() {
            return Err(ConfigError::InvalidDuration(
                "the connect timeout must be greater than zero",
            ));
        }
        match &self.onboarding_token {
            Some(token) if token.expose().trim().is_empty() => {
                return Err(ConfigError::EmptyOnboardingToken);
            }
            Some(_) => {}
            None => {
                if identity::load(&self.state_dir, &self.relay_url, &self.cluster)?.is_none() {
                    return Err(ConfigError::MissingOnboardingToken {
                        relay: self.relay_url.clone(),
                        cluster: self.cluster.clone(),
                        state_dir: self.state_dir.display().to_string(),
                    });
                }
            }
        }
        Ok(())
    }

    /// The relay URL, parsed and checked, without a trailing slash in its path.
    fn relay_base(&self) -> Result<url::Url, ConfigError> {
        let invalid = |reason: &str| ConfigError::InvalidRelayUrl {
            url: self.relay_url.clone(),
            reason: reason.into(),
        };
        let url = url::Url::parse(&self.relay_url).map_err(|e| invalid(&e.to_string()))?;
        if url.scheme() != "https" {
            return Err(invalid("the scheme must be https"));
        }
        if url.host_str().is_none_or(str::is_empty) {
            return Err(invalid("no host"));
        }
        if !url.username().is_empty() || url.password().is_some() {
            return Err(invalid("credentials in the URL are not allowed"));
        }
        if url.query().is_some() || url.fragment().is_some() {
            return Err(invalid("a query or fragment is not allowed"));
        }
        Ok(url)
    }

    /// `https://relay[/base]/agent/v1/onboard`.
    pub(crate) fn onboard_url(&self) -> Result<String, ConfigError> {
        Ok(format!(
            "{}/agent/v1/onboard",
            self.relay_base()?.as_str().trim_end_matches('/')
        ))
    }

    /// `wss://relay[/base]/agent/v1/tunnel`.
    pub(crate) fn tunnel_url(&self) -> Result<String, ConfigError> {
        let base = self.relay_base()?;
        let rest = base
            .as_str()
            .trim_end_matches('/')
            .trim_start_matches("https://");
        Ok(format!("wss://{rest}/agent/v1/tunnel"))
    }
}

fn is_dns_label(name: &str) -> bool {
    let bytes = name.as_bytes();
    let ok_char = |b: &u8| b.is_ascii_lowercase() || b.is_ascii_digit() || *b == b'-';
    let alnum = |b: Option<&u8>| b.is_some_and(|b| b.is_ascii_lowercase() || b.is_ascii_digit());
    (1..=63).contains(&bytes.len())
        && bytes.iter().all(ok_char)
        && alnum(bytes.first())
        && alnum(bytes.last())
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    fn valid(dir: &std::path::Path) -> Config {
        let mut c = Config::new("https://relay.example:8443", "prod-1", dir);
        c.onboarding_token = Some(Secret::new("onb"));
        c
    }

    #[test]
    fn accepts_a_sane_config_and_derives_urls() {
        let tmp = tempfile::tempdir().unwrap();
        let c = valid(tmp.path());
        c.validate().unwrap();
        assert_eq!(
            c.tunnel_url().unwrap(),
            "wss://relay.example:8443/agent/v1/tunnel"
        );
        assert_eq!(
            c.onboard_url().unwrap(),
            "https://relay.example:8443/agent/v1/onboard"
        );

        let mut c = valid(tmp.path());
        c.relay_url = "https://relay.example/tether/".into();
        c.validate().unwrap();
        assert_eq!(
            c.tunnel_url().unwrap(),
            "wss://relay.example/tether/agent/v1/tunnel"
        );
        assert_eq!(
            c.onboard_url().unwrap(),
            "https://relay.example/tether/agent/v1/onboard"
        );
    }

    #[test]
    fn rejects_bad_relay_urls() {
        let tmp = tempfile::tempdir().unwrap();
        for url in [
            "",
            "relay.example",
            "http://relay.example",
            "https://u:p@relay.example",
            "https://r.example/?a=1",
        ] {
            let mut c = valid(tmp.path());
            c.relay_url = url.into();
            assert!(
                matches!(c.validate(), Err(ConfigError::InvalidRelayUrl { .. })),
                "{url}"
            );
        }
    }

    #[test]
    fn rejects_bad_cluster_names() {
        let tmp = tempfile::tempdir().unwrap();
        let long = "a".repeat(64);
        for name in ["", "Prod", "-a", "a-", "a_b", "a.b", long.as_str()] {
            let mut c = valid(tmp.path());
            c.cluster = name.into();
            assert!(
                matches!(c.validate(), Err(ConfigError::InvalidClusterName(_))),
                "{name:?}"
            );
        }
    }

    #[test]
    fn token_is_required_only_without_a_stored_identity() {
        let tmp = tempfile::tempdir().unwrap();
        let mut c = valid(tmp.path());
        c.onboarding_token = None;
        assert!(matches!(
            c.validate(),
            Err(ConfigError::MissingOnboardingToken { .. })
        ));

        c.onboarding_token = Some(Secret::new("  "));
        assert!(matches!(
            c.validate(),
            Err(ConfigError::EmptyOnboardingToken)
        ));

        c.onboarding_token = None;
        // An older agent's credential file does not count.
        std::fs::write(
            tmp.path().join("credential.json"),
            br#"{"relay":"https://relay.example:8443","cluster":"prod-1","credential":"x"}"#,
        )
        .unwrap();
        assert!(matches!(
            c.validate(),
            Err(ConfigError::MissingOnboardingToken { .. })
        ));
        let stored = identity::test_identity(&c.relay_url, &c.cluster, time::Duration::days(1));
        identity::store(tmp.path(), &stored).unwrap();
        c.validate().unwrap();
    }

    #[test]
    fn rejects_missing_files_and_bad_durations() {
        let tmp = tempfile::tempdir().unwrap();
        let mut c = valid(tmp.path());
        c.relay_ca = Some(tmp.path().join("nope.pem"));
        assert!(matches!(
            c.validate(),
            Err(ConfigError::MissingFile {
                what: "relay CA file",
                ..
            })
        ));

        let mut c = valid(tmp.path());
        c.proxy_ca = Some(tmp.path().join("nope.pem"));
        assert!(matches!(
            c.validate(),
            Err(ConfigError::MissingFile {
                what: "proxy CA file",
                ..
            })
        ));

        let mut c = valid(tmp.path());
        c.kubeconfig = Some(tmp.path().join("nope"));
        assert!(matches!(
            c.validate(),
            Err(ConfigError::MissingFile {
                what: "kubeconfig",
                ..
            })
        ));

        let mut c = valid(tmp.path());
        c.backoff.cap = c.backoff.base / 2;
        assert!(matches!(c.validate(), Err(ConfigError::InvalidDuration(_))));

        let mut c = valid(tmp.path());
        c.connect_timeout = Duration::ZERO;
        assert!(matches!(c.validate(), Err(ConfigError::InvalidDuration(_))));

        let mut c = valid(tmp.path());
        c.state_dir = PathBuf::new();
        assert!(matches!(c.validate(), Err(ConfigError::EmptyStateDir)));
    }

    #[test]
    fn debug_never_shows_the_token() {
        let tmp = tempfile::tempdir().unwrap();
        let mut c = valid(tmp.path());
        c.onboarding_token = Some(Secret::new("very-secret-token"));
        assert!(!format!("{c:?}").contains("very-secret-token"));
    }
}
