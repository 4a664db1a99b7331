//! The agent's configuration and its validation.

use std::ffi::OsString;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use clap::{Args as _, FromArgMatches as _};
use tether_api::reconnect::Backoff;
use tether_runtime::{Secret, parse_duration};
use tether_tunnel::proxy::{NoProxy, Proxy, ProxyConfig, ProxyError};

use crate::identity;
use crate::pool::PoolOptions;
use crate::state_secret::SecretRef;

/// Everything the agent needs to run: the `tether-agent` command line itself (`clap` parses flags and their
/// `TETHER_*` environment variables straight into it; every default is written once, in the `#[arg]`
/// attributes below, and [`Config::new`] takes the same defaults). Adjust fields, then [`Config::validate`].
#[derive(Debug, Clone, clap::Args)]
pub struct Config {
    /// The relay's URL, e.g. https://relay.example:8443; the agent derives `wss://…/agent/v1/tunnel`,
    /// `https://…/agent/v1/onboard` and the QUIC address (the same host and port, over UDP) from it. Repeat
    /// it (or separate URLs with commas in TETHER_RELAY) for the replicas of a relay fleet: the agent spreads
    /// its tunnels over them. The identity belongs to the first URL (onboarding goes there).
    #[arg(
        long = "relay",
        env = "TETHER_RELAY",
        value_name = "URL",
        value_delimiter = ',',
        required = true,
        num_args = 1
    )]
    pub relays: Vec<String>,
    /// How tunnels reach the relay: `auto` races QUIC (UDP) against WebSocket (TCP) and keeps QUIC when it
    /// completes, falling back to WebSocket (and trying QUIC again every --quic-reprobe-interval); `quic` or
    /// `wss` use only that transport. With an HTTP proxy for the relay, only `wss` works (`auto` uses it).
    #[arg(
        long,
        env = "TETHER_TRANSPORT",
        value_enum,
        default_value_t = TransportMode::Auto
    )]
    pub transport: TransportMode,
    /// With --transport auto, how often a tunnel on WebSocket tries QUIC again (and moves over, new tunnel
    /// first, when it works).
    #[arg(
        long,
        env = "TETHER_QUIC_REPROBE_INTERVAL",
        default_value = "10m",
        value_parser = parse_duration
    )]
    pub quic_reprobe_interval: Duration,
    /// How many tunnels the agent keeps, each to a distinct relay replica (at most as many as the relay
    /// fleet has live replicas; one against a relay without a fleet).
    #[arg(
        long,
        env = "TETHER_TUNNELS",
        default_value_t = 2,
        value_parser = clap::value_parser!(u32).range(1..=MAX_TUNNELS as i64)
    )]
    pub tunnels: u32,
    /// This cluster's name at the relay.
    #[arg(long, env = "TETHER_CLUSTER")]
    pub cluster: String,
    /// The one-time onboarding token from `tether cluster connect` (needed only while no identity is stored
    /// for this relay and cluster).
    #[arg(
        long,
        env = "TETHER_ONBOARDING_TOKEN",
        hide_env_values = true,
        value_parser = Quiet(parse_secret),
        conflicts_with = "onboarding_token_file"
    )]
    pub onboarding_token: Option<Secret>,
    /// A file holding the onboarding token (read once, at start).
    #[arg(
        long = "onboarding-token-file",
        env = "TETHER_ONBOARDING_TOKEN_FILE",
        value_name = "FILE",
        value_parser = Quiet(read_secret_file)
    )]
    pub onboarding_token_file: Option<Secret>,
    /// Where the agent keeps its identity (identity.json and identity-key.pem, files 0600, directory 0700).
    #[arg(
        long,
        env = "TETHER_STATE_DIR",
        default_value = "/var/lib/tether-agent"
    )]
    pub state_dir: PathBuf,
    /// Keep the identity in this Kubernetes Secret, NAMESPACE/NAME, instead of --state-dir, through the
    /// apiserver with the agent's own credentials (get, create, update on that Secret): a pod keeps its identity
    /// on another node, and replicas share it (one onboards, the others wait and read).
    #[arg(long, env = "TETHER_STATE_SECRET", value_name = "NAMESPACE/NAME")]
    pub state_secret: Option<SecretRef>,
    /// A PEM CA bundle to trust for the relay (default: the public web PKI roots).
    #[arg(long, env = "TETHER_RELAY_CA", value_name = "FILE")]
    pub relay_ca: Option<PathBuf>,
    /// An HTTP proxy to reach the relay through with CONNECT, http://[user:password@]host:port (default:
    /// HTTPS_PROXY, else https_proxy, applied by [`Config::with_proxy_env`]).
    #[arg(
        long = "proxy-https",
        env = "TETHER_PROXY_HTTPS",
        hide_env_values = true,
        value_name = "URL",
        value_parser = Quiet(|v| Proxy::parse(v).map_err(|e| e.to_string()))
    )]
    pub proxy: Option<Proxy>,
    /// Hosts that bypass the proxy: comma-separated names (a name covers its subdomains), .suffix domains,
    /// IP addresses, CIDRs, or * (default: NO_PROXY, else no_proxy).
    #[arg(
        long = "proxy-skip-range",
        env = "TETHER_PROXY_SKIP_RANGE",
        value_name = "LIST",
        value_parser = Quiet(|v| NoProxy::parse(v).map_err(|e| e.to_string()))
    )]
    pub no_proxy: Option<NoProxy>,
    /// A PEM CA bundle trusted for the relay connection in addition to --relay-ca, for a proxy that inspects
    /// TLS.
    #[arg(long = "proxy-cert", env = "TETHER_PROXY_CERT", value_name = "FILE")]
    pub proxy_ca: Option<PathBuf>,
    /// The kubeconfig naming the apiserver (default: KUBECONFIG, ~/.kube/config, else in-cluster).
    #[arg(long, env = "TETHER_KUBECONFIG", value_name = "FILE")]
    pub kubeconfig: Option<PathBuf>,
    /// Serve Kubernetes probes here, plain HTTP: GET /readyz (200 only while a tunnel to the relay is up) and
    /// GET /livez (200 while the agent runs); nothing else. Off unless set (the Helm chart sets 0.0.0.0:8080).
    #[arg(long, env = "TETHER_HEALTH_LISTEN", value_name = "ADDR")]
    pub health_listen: Option<SocketAddr>,
    /// Reconnect pacing (not a flag).
    #[arg(skip)]
    pub backoff: Backoff,
    /// On shutdown, how long open streams may keep running after GOAWAY.
    #[arg(long, env = "TETHER_DRAIN_TIMEOUT", default_value = "20s", value_parser = parse_duration)]
    pub drain_timeout: Duration,
    /// Timeout of each attempt to reach the relay (TCP, TLS, WebSocket and onboarding request).
    #[arg(long, env = "TETHER_CONNECT_TIMEOUT", default_value = "15s", value_parser = parse_duration)]
    pub connect_timeout: Duration,
    /// A tunnel the relay has been silent on this long gets a PING (e.g. 15s, 1s).
    #[arg(long, env = "TETHER_TUNNEL_KEEPALIVE", default_value = "15s", value_parser = parse_duration)]
    pub tunnel_keepalive: Duration,
    /// A tunnel the relay has been silent on this long (PINGs unanswered: a network partition) is declared
    /// dead and the agent reconnects (e.g. 45s, 2s).
    #[arg(long, env = "TETHER_TUNNEL_TIMEOUT", default_value = "45s", value_parser = parse_duration)]
    pub tunnel_timeout: Duration,
    /// A QUIC tunnel the agent has sent nothing on this long gets a PING (QUIC's own, one small datagram;
    /// e.g. 1s, 250ms). Replaces --tunnel-keepalive for QUIC tunnels.
    #[arg(long, env = "TETHER_QUIC_KEEPALIVE", default_value = "1s", value_parser = parse_duration)]
    pub quic_keepalive: Duration,
    /// A QUIC tunnel the relay has been silent on this long is dead and the agent reconnects (e.g. 3s, 1s).
    /// Short, because UDP has no connection reset: a relay that was killed or lost is noticed only by its
    /// silence. QUIC uses the shorter of the two sides' timeouts, and never less than three round trips; a
    /// dead peer is noticed about --quic-keepalive + --quic-timeout after it went silent. Replaces
    /// --tunnel-timeout for QUIC tunnels.
    #[arg(long, env = "TETHER_QUIC_TIMEOUT", default_value = "3s", value_parser = parse_duration)]
    pub quic_timeout: Duration,
    /// How the connections to the apiserver grow with load (`--upstream-*`, [`crate::pool`]).
    #[command(flatten)]
    pub upstream: PoolOptions,
    /// The in-cluster authentication proxy: Entra-style tokens are validated here and forwarded with
    /// impersonation on the agent's own credentials; `None` (no --entra-* flag) passes every token through
    /// unchanged.
    #[command(flatten)]
    pub entra: Option<EntraConfig>,
    /// Where the guard RBAC snapshots the relay sends are pushed; `None` (no --guard-* flag) ignores them.
    #[command(flatten)]
    pub guard: Option<GuardConfig>,
}

/// Which tokens the agent's authentication proxy validates (`--entra-tenant`, `--entra-audience`,
/// `--entra-authority`, `--entra-authority-ca`).
///
/// A bearer token that is a JWT whose `iss` lies under the v2 authority (`{authority}/…`) or Entra's v1
/// authority (`https://sts.windows.net/…`) is validated again in the cluster (`tether_auth`'s
/// `Authenticator`: signature, tenant, audience, lifetime; group overage through the relay's directory) and
/// forwarded on the agent's own credentials with `Impersonate-*` headers, or refused with 401. Other tokens
/// (Kubernetes service-account tokens, opaque tokens) pass through unchanged.
#[derive(Debug, Clone, Default, PartialEq, Eq, clap::Args)]
pub struct EntraConfig {
    /// Entra tenant id whose tokens the in-cluster authentication proxy validates and impersonates
    /// (repeatable or comma-separated; with --entra-audience).
    #[arg(
        long = "entra-tenant",
        env = "TETHER_ENTRA_TENANTS",
        value_delimiter = ',',
        value_name = "TENANT"
    )]
    pub tenants: Vec<String>,
    /// Accepted audience of Entra tokens (repeatable or comma-separated; with --entra-tenant).
    #[arg(
        long = "entra-audience",
        env = "TETHER_ENTRA_AUDIENCES",
        value_delimiter = ',',
        value_name = "AUDIENCE"
    )]
    pub audiences: Vec<String>,
    /// Base URL of the Entra issuer and its discovery documents (default https://login.microsoftonline.com);
    /// https only.
    #[arg(
        long = "entra-authority",
        env = "TETHER_ENTRA_AUTHORITY",
        value_name = "URL"
    )]
    pub authority: Option<String>,
    /// A PEM CA trusted (instead of the public roots) for the authority's discovery and keys: development
    /// issuers and tests.
    #[arg(
        long = "entra-authority-ca",
        env = "TETHER_ENTRA_AUTHORITY_CA",
        value_name = "FILE"
    )]
    pub authority_ca: Option<PathBuf>,
    /// Put before every username an Entra token yields, in the impersonation headers (like guard's
    /// --username-prefix and kube-apiserver's --oidc-username-prefix; set it the same as guard's); default none.
    /// Must not start with "system:".
    #[arg(
        long = "username-prefix",
        env = "TETHER_ENTRA_USERNAME_PREFIX",
        value_name = "PREFIX"
    )]
    pub username_prefix: Option<String>,
    /// Put before every group an Entra token yields (like guard's --groups-prefix; set it the same as guard's,
    /// which removes it when authorizing); default none. Must not start with "system:".
    #[arg(
        long = "groups-prefix",
        env = "TETHER_ENTRA_GROUPS_PREFIX",
        value_name = "PREFIX"
    )]
    pub groups_prefix: Option<String>,
}

impl EntraConfig {
    /// The token-check settings for this configuration.
    pub fn token_config(&self) -> tether_auth::TokenConfig {
        let mut config =
            tether_auth::TokenConfig::new(self.tenants.clone(), self.audiences.clone());
        if let Some(authority) = &self.authority {
            config.v2_authority = authority.trim_end_matches('/').to_owned();
        }
        config.username_prefix = self.username_prefix.clone().unwrap_or_default();
        config.groups_prefix = self.groups_prefix.clone().unwrap_or_default();
        config
    }
}

/// The most tunnels `--tunnels` accepts.
pub const MAX_TUNNELS: u32 = 16;

/// How the agent's tunnels reach the relay (`--transport`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum TransportMode {
    /// QUIC when it completes, else WebSocket (re-probing QUIC periodically); WebSocket through a proxy.
    Auto,
    /// QUIC (UDP) only.
    Quic,
    /// WebSocket over TLS (TCP) only.
    Wss,
}

impl TransportMode {
    /// `auto`, `quic` or `wss`, as on the command line.
    pub fn as_str(self) -> &'static str {
        match self {
            TransportMode::Auto => "auto",
            TransportMode::Quic => "quic",
            TransportMode::Wss => "wss",
        }
    }
}

/// How long one push to guard may take, flags or not.
const GUARD_PUSH_TIMEOUT: Duration = Duration::from_secs(10);

/// Where and how the agent pushes guard snapshots (`--guard-url`, `--guard-push-token-file`, `--guard-ca`,
/// `--guard-client-cert`, `--guard-client-key`).
#[derive(Debug, Clone, clap::Args)]
pub struct GuardConfig {
    /// Guard's snapshot endpoint, https://HOST:PORT/snapshot: RBAC snapshots from the relay are pushed there
    /// (with --guard-push-token-file).
    #[arg(
        long = "guard-url",
        env = "TETHER_GUARD_URL",
        value_name = "URL",
        required = false,
        requires = "push_token"
    )]
    pub url: String,
    /// A file holding the bearer token guard accepts for snapshot pushes (read once, at start).
    #[arg(
        long = "guard-push-token-file",
        env = "TETHER_GUARD_PUSH_TOKEN_FILE",
        value_name = "FILE",
        value_parser = Quiet(read_secret_file),
        required = false,
        requires = "url"
    )]
    pub push_token: Secret,
    /// A PEM CA bundle to trust for guard's certificate (default: the public web PKI roots).
    #[arg(
        long = "guard-ca",
        env = "TETHER_GUARD_CA",
        value_name = "FILE",
        requires = "url"
    )]
    pub ca: Option<PathBuf>,
    /// The push certificate (PEM) presented to guard on every push, besides the token (with
    /// --guard-client-key): guard requires one with --snapshot-client-ca/--snapshot-client-cn. Read at start.
    #[arg(
        long = "guard-client-cert",
        env = "TETHER_GUARD_CLIENT_CERT",
        value_name = "FILE",
        requires = "url",
        requires = "client_key"
    )]
    pub client_cert: Option<PathBuf>,
    /// The private key (PEM) of --guard-client-cert.
    #[arg(
        long = "guard-client-key",
        env = "TETHER_GUARD_CLIENT_KEY",
        value_name = "FILE",
        requires = "client_cert"
    )]
    pub client_key: Option<PathBuf>,
    /// Pacing of retries while guard is unreachable or refuses (not a flag; default 500 ms..30 s).
    #[arg(skip)]
    pub backoff: Backoff,
    /// Timeout of one push (connect, TLS, request and answer; not a flag; 10 s).
    #[arg(skip = GUARD_PUSH_TIMEOUT)]
    pub timeout: Duration,
}

impl GuardConfig {
    /// Pushes to `url` with `push_token`, trusting the public web roots, with the default pacing.
    pub fn new(url: impl Into<String>, push_token: Secret) -> Self {
        Self {
            url: url.into(),
            push_token,
            ca: None,
            client_cert: None,
            client_key: None,
            backoff: Backoff::default(),
            timeout: GUARD_PUSH_TIMEOUT,
        }
    }
}

/// A secret given on the command line or in the environment, without surrounding whitespace.
fn parse_secret(value: &str) -> Result<Secret, String> {
    Ok(Secret::new(value.trim()))
}

/// A secret read from a file (a token file ends with a newline more often than not).
fn read_secret_file(path: &str) -> Result<Secret, String> {
    std::fs::read_to_string(path)
        .map(|text| Secret::new(text.trim()))
        .map_err(|e| format!("cannot read the file {path}: {e}"))
}

/// A value parser whose errors never repeat the value: clap's own message quotes it, and a proxy URL or a
/// token may carry a password.
#[derive(Clone)]
struct Quiet<T>(fn(&str) -> Result<T, String>);

impl<T: Clone + Send + Sync + 'static> clap::builder::TypedValueParser for Quiet<T> {
    type Value = T;

    fn parse_ref(
        &self,
        _cmd: &clap::Command,
        arg: Option<&clap::Arg>,
        value: &std::ffi::OsStr,
    ) -> Result<T, clap::Error> {
        let name = arg
            .and_then(clap::Arg::get_long)
            .map_or_else(String::new, |long| format!("--{long}: "));
        let invalid = |kind, message: String| clap::Error::raw(kind, format!("{name}{message}\n"));
        let text = value.to_str().ok_or_else(|| {
            invalid(
                clap::error::ErrorKind::InvalidUtf8,
                "not valid UTF-8".to_owned(),
            )
        })?;
        (self.0)(text).map_err(|e| invalid(clap::error::ErrorKind::ValueValidation, e))
    }
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
    /// No relay URL was given.
    #[error("no relay URL: pass --relay https://relay.example")]
    NoRelay,
    /// The same relay URL was given twice.
    #[error("the relay URL {0:?} is given twice")]
    DuplicateRelay(String),
    /// `--transport quic` with an HTTP proxy for the relay: a CONNECT proxy carries TCP only.
    #[error(
        "--transport quic cannot reach {relay} through the HTTP proxy (it carries TCP only): use --transport auto or wss, or list the relay in --proxy-skip-range"
    )]
    QuicThroughProxy {
        /// The relay URL the proxy applies to.
        relay: String,
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
    /// `--tunnels` is out of range.
    #[error("--tunnels must be between 1 and {MAX_TUNNELS}, not {0}")]
    InvalidTunnels(u32),
    /// The Entra (authentication proxy) settings are unusable.
    #[error("invalid Entra settings: {0}")]
    InvalidEntra(String),
    /// The guard settings are unusable.
    #[error("invalid guard settings: {0}")]
    InvalidGuard(String),
}

impl Config {
    /// A configuration with the command line's defaults (no onboarding token, webpki roots for the relay, the
    /// inferred kube config, backoff 500 ms..30 s, drain 20 s, connect timeout 15 s), as if `tether-agent` ran
    /// with only `--relay`, `--cluster` and `--state-dir` and no `TETHER_*` variable set.
    pub fn new(
        relay_url: impl Into<String>,
        cluster: impl Into<String>,
        state_dir: impl Into<PathBuf>,
    ) -> Self {
        let mut relay = OsString::from("--relay=");
        relay.push(relay_url.into());
        let mut cluster_arg = OsString::from("--cluster=");
        cluster_arg.push(cluster.into());
        let mut state = OsString::from("--state-dir=");
        state.push(state_dir.into());
        // The process environment must not leak into a configuration built in code.
        let command =
            Self::augment_args(clap::Command::new("tether-agent")).mut_args(|arg| arg.env(None));
        let parsed = command
            .try_get_matches_from([OsString::from("tether-agent"), relay, cluster_arg, state])
            .and_then(|matches| Self::from_arg_matches(&matches));
        #[allow(clippy::expect_used)]
        parsed.expect("the built-in defaults parse, and --flag=value takes any value")
    }

    /// Fills the proxy settings from the conventional `HTTPS_PROXY`/`https_proxy` and `NO_PROXY`/`no_proxy`
    /// variables where no flag (or `TETHER_PROXY_*` variable) set them. Called by the `tether-agent` binary;
    /// an embedding program decides for itself.
    pub fn with_proxy_env(mut self) -> Result<Self, ProxyError> {
        let env = |names: [&str; 2]| {
            names
                .iter()
                .find_map(|name| std::env::var(name).ok())
                .filter(|v| !v.trim().is_empty())
        };
        if self.proxy.is_none()
            && let Some(url) = env(["HTTPS_PROXY", "https_proxy"])
        {
            self.proxy = Some(Proxy::parse(&url)?);
        }
        if self.no_proxy.is_none()
            && let Some(list) = env(["NO_PROXY", "no_proxy"])
        {
            self.no_proxy = Some(NoProxy::parse(&list)?);
        }
        Ok(self)
    }

    /// The onboarding token, from `--onboarding-token` or else `--onboarding-token-file`.
    pub fn onboarding_secret(&self) -> Option<&Secret> {
        self.onboarding_token
            .as_ref()
            .or(self.onboarding_token_file.as_ref())
    }

    /// The proxy and its bypass list, when a proxy is set.
    pub fn proxy_config(&self) -> Option<ProxyConfig> {
        self.proxy.clone().map(|proxy| ProxyConfig {
            proxy,
            no_proxy: self.no_proxy.clone().unwrap_or_default(),
        })
    }

    /// Checks everything that can be checked without the network: URL, name, files, durations, and that an
    /// identity or an onboarding token is available.
    pub fn validate(&self) -> Result<(), ConfigError> {
        if self.relays.is_empty() {
            return Err(ConfigError::NoRelay);
        }
        let mut seen = Vec::new();
        for relay in &self.relays {
            let base = relay_base(relay)?;
            if seen.contains(&base) {
                return Err(ConfigError::DuplicateRelay(relay.clone()));
            }
            if self.transport == TransportMode::Quic && self.proxy_for(&base).is_some() {
                return Err(ConfigError::QuicThroughProxy {
                    relay: relay.clone(),
                });
            }
            seen.push(base);
        }
        if self.quic_reprobe_interval < Duration::from_secs(1) {
            return Err(ConfigError::InvalidDuration(
                "the QUIC re-probe interval must be at least 1s",
            ));
        }
        if self.tunnels == 0 || self.tunnels > MAX_TUNNELS {
            return Err(ConfigError::InvalidTunnels(self.tunnels));
        }
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
        // Each transport's liveness: (keepalive, timeout, what is wrong with either).
        let liveness = [
            (
                self.tunnel_keepalive,
                self.tunnel_timeout,
                "the tunnel keepalive must be at least 100ms",
                "the tunnel timeout must be longer than the tunnel keepalive",
            ),
            (
                self.quic_keepalive,
                self.quic_timeout,
                "the QUIC keepalive must be at least 100ms",
                "the QUIC timeout must be longer than the QUIC keepalive",
            ),
        ];
        for (keepalive, timeout, too_short, not_longer) in liveness {
            if keepalive < Duration::from_millis(100) {
                return Err(ConfigError::InvalidDuration(too_short));
            }
            if timeout <= keepalive {
                return Err(ConfigError::InvalidDuration(not_longer));
            }
        }
        if let Some(entra) = &self.entra {
            entra
                .token_config()
                .validate()
                .map_err(|e| ConfigError::InvalidEntra(e.to_string()))?;
            if let Some(path) = &entra.authority_ca
                && !path.is_file()
            {
                return Err(ConfigError::MissingFile {
                    what: "Entra authority CA file",
                    path: path.display().to_string(),
                });
            }
        }
        if let Some(guard) = &self.guard {
            guard.validate()?;
        }
        match self.onboarding_secret() {
            Some(token) if token.expose().trim().is_empty() => {
                return Err(ConfigError::EmptyOnboardingToken);
            }
            Some(_) => {}
            // Read at run time, through the apiserver.
            None if self.state_secret.is_some() => {}
            None => {
                if identity::load(&self.state_dir, self.relay_url(), &self.cluster)?.is_none() {
                    return Err(ConfigError::MissingOnboardingToken {
                        relay: self.relay_url().to_owned(),
                        cluster: self.cluster.clone(),
                        state_dir: self.state_dir.display().to_string(),
                    });
                }
            }
        }
        Ok(())
    }

    /// The first relay URL: the one the identity belongs to and onboarding goes to.
    pub fn relay_url(&self) -> &str {
        self.relays.first().map_or("", String::as_str)
    }

    /// The proxy the relay at `base` is reached through, if any.
    fn proxy_for(&self, base: &url::Url) -> Option<Proxy> {
        let config = self.proxy_config()?;
        let host = base.host_str()?;
        let port = base.port_or_known_default().unwrap_or(443);
        config.proxy_for(host, port).cloned()
    }

    /// `https://relay[/base]/agent/v1/onboard`, at the first relay.
    pub(crate) fn onboard_url(&self) -> Result<String, ConfigError> {
        Ok(format!(
            "{}/agent/v1/onboard",
            relay_base(self.relay_url())?.as_str().trim_end_matches('/')
        ))
    }

    /// Every relay to keep tunnels to, in the order given.
    pub(crate) fn relay_endpoints(&self) -> Result<Vec<RelayEndpoint>, ConfigError> {
        self.relays
            .iter()
            .map(|relay| {
                let base = relay_base(relay)?;
                let rest = base
                    .as_str()
                    .trim_end_matches('/')
                    .trim_start_matches("https://");
                Ok(RelayEndpoint {
                    url: relay.clone(),
                    tunnel_url: format!("wss://{rest}/agent/v1/tunnel"),
                    proxied: self.proxy_for(&base).is_some(),
                })
            })
            .collect()
    }
}

/// One relay the agent keeps tunnels to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct RelayEndpoint {
    /// The URL as given (`https://host[:port][/base]`); QUIC goes to its host and port.
    pub(crate) url: String,
    /// `wss://host[:port][/base]/agent/v1/tunnel`.
    pub(crate) tunnel_url: String,
    /// Reached through the HTTP proxy (so over WebSocket only).
    pub(crate) proxied: bool,
}

/// A relay URL, parsed and checked.
fn relay_base(relay: &str) -> Result<url::Url, ConfigError> {
    let invalid = |reason: &str| ConfigError::InvalidRelayUrl {
        url: relay.to_owned(),
        reason: reason.into(),
    };
    let url = url::Url::parse(relay).map_err(|e| invalid(&e.to_string()))?;
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

impl GuardConfig {
    fn validate(&self) -> Result<(), ConfigError> {
        let invalid = |m: String| Err(ConfigError::InvalidGuard(m));
        let url = match url::Url::parse(&self.url) {
            Ok(url) => url,
            Err(e) => return invalid(format!("invalid guard URL {:?}: {e}", self.url)),
        };
        if url.scheme() != "https" || url.host_str().is_none_or(str::is_empty) {
            return invalid(format!(
                "the guard URL must be https://host[:port]/snapshot, not {:?}",
                self.url
            ));
        }
        if !url.username().is_empty() || url.password().is_some() {
            return invalid("credentials in the guard URL are not allowed".to_owned());
        }
        if self.push_token.expose().trim().is_empty() {
            return invalid("the snapshot push token is empty".to_owned());
        }
        for (what, path) in [
            ("guard CA file", &self.ca),
            ("guard client certificate file", &self.client_cert),
            ("guard client key file", &self.client_key),
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
        if self.client_cert.is_some() != self.client_key.is_some() {
            return invalid("--guard-client-cert and --guard-client-key go together".to_owned());
        }
        if self.backoff.base.is_zero() || self.backoff.cap < self.backoff.base {
            return Err(ConfigError::InvalidDuration(
                "the guard backoff base must be positive and at most its cap",
            ));
        }
        if self.timeout.is_zero() {
            return Err(ConfigError::InvalidDuration(
                "the guard push timeout must be greater than zero",
            ));
        }
        Ok(())
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
            c.relay_endpoints().unwrap(),
            vec![RelayEndpoint {
                url: "https://relay.example:8443".into(),
                tunnel_url: "wss://relay.example:8443/agent/v1/tunnel".into(),
                proxied: false,
            }]
        );
        assert_eq!(
            c.onboard_url().unwrap(),
            "https://relay.example:8443/agent/v1/onboard"
        );

        let mut c = valid(tmp.path());
        c.relays = vec!["https://relay.example/tether/".into()];
        c.validate().unwrap();
        assert_eq!(
            c.relay_endpoints().unwrap()[0].tunnel_url,
            "wss://relay.example/tether/agent/v1/tunnel"
        );
        assert_eq!(
            c.onboard_url().unwrap(),
            "https://relay.example/tether/agent/v1/onboard"
        );
    }

    #[test]
    fn new_takes_the_command_line_defaults() {
        let c = Config::new("https://relay.example", "prod", "/state");
        assert_eq!(c.relay_url(), "https://relay.example");
        assert_eq!(c.relays, vec!["https://relay.example".to_owned()]);
        assert_eq!(c.transport, TransportMode::Auto);
        assert_eq!(c.tunnels, 2);
        assert_eq!(c.quic_reprobe_interval, Duration::from_secs(600));
        assert_eq!(c.cluster, "prod");
        assert_eq!(c.state_dir, PathBuf::from("/state"));
        assert_eq!(c.drain_timeout, Duration::from_secs(20));
        assert_eq!(c.connect_timeout, Duration::from_secs(15));
        assert_eq!(c.backoff, Backoff::default());
        assert!(c.onboarding_secret().is_none() && c.proxy_config().is_none());
        assert!(c.entra.is_none() && c.guard.is_none());
        // A value that looks like a flag is still the value.
        assert_eq!(Config::new("--cluster", "c", "d").relay_url(), "--cluster");
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
            c.relays = vec![url.into()];
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
        let stored = identity::test_identity(c.relay_url(), &c.cluster, time::Duration::days(1));
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
    fn entra_and_guard_settings_are_checked() {
        let tmp = tempfile::tempdir().unwrap();
        let good = EntraConfig {
            tenants: vec!["72f988bf-86f1-41af-91ab-2d7cd011db47".into()],
            audiences: vec!["api://tether".into()],
            authority: Some("https://127.0.0.1:9443/".into()),
            ..Default::default()
        };
        let mut c = valid(tmp.path());
        c.entra = Some(good.clone());
        c.validate().unwrap();
        assert_eq!(good.token_config().v2_authority, "https://127.0.0.1:9443");
        // The prefixes reach the TokenConfig the authentication proxy maps identities with.
        let prefixed = EntraConfig {
            username_prefix: Some("aad:".into()),
            groups_prefix: Some("aad-group:".into()),
            ..good.clone()
        };
        let mut c = valid(tmp.path());
        c.entra = Some(prefixed.clone());
        c.validate().unwrap();
        assert_eq!(prefixed.token_config().username_prefix, "aad:");
        assert_eq!(prefixed.token_config().groups_prefix, "aad-group:");
        assert_eq!(good.token_config().username_prefix, "");
        for bad in [
            EntraConfig {
                tenants: vec![],
                ..good.clone()
            },
            EntraConfig {
                username_prefix: Some("system:".into()),
                ..good.clone()
            },
            EntraConfig {
                groups_prefix: Some("System:masters-".into()),
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
        ] {
            let mut c = valid(tmp.path());
            c.entra = Some(bad.clone());
            assert!(
                matches!(c.validate(), Err(ConfigError::InvalidEntra(_))),
                "{bad:?}"
            );
        }
        let mut c = valid(tmp.path());
        c.entra = Some(EntraConfig {
            authority_ca: Some(tmp.path().join("nope.pem")),
            ..good
        });
        assert!(matches!(
            c.validate(),
            Err(ConfigError::MissingFile {
                what: "Entra authority CA file",
                ..
            })
        ));

        let guard = GuardConfig::new("https://guard.example:8443/snapshot", Secret::new("t"));
        let mut c = valid(tmp.path());
        c.guard = Some(guard.clone());
        c.validate().unwrap();
        for url in [
            "http://guard.example/snapshot",
            "guard:8443",
            "https://u:p@g.example/",
        ] {
            let mut c = valid(tmp.path());
            c.guard = Some(GuardConfig::new(url, Secret::new("t")));
            assert!(
                matches!(c.validate(), Err(ConfigError::InvalidGuard(_))),
                "{url}"
            );
        }
        let mut c = valid(tmp.path());
        c.guard = Some(GuardConfig::new(guard.url.clone(), Secret::new(" ")));
        assert!(matches!(c.validate(), Err(ConfigError::InvalidGuard(_))));
        let mut c = valid(tmp.path());
        c.guard = Some(GuardConfig {
            ca: Some(tmp.path().join("nope.pem")),
            ..guard.clone()
        });
        assert!(matches!(
            c.validate(),
            Err(ConfigError::MissingFile {
                what: "guard CA file",
                ..
            })
        ));
        // The push certificate and its key go together, and both must exist.
        let cert = tmp.path().join("push.crt");
        std::fs::write(&cert, "pem").unwrap();
        let mut c = valid(tmp.path());
        c.guard = Some(GuardConfig {
            client_cert: Some(cert.clone()),
            ..guard.clone()
        });
        assert!(matches!(c.validate(), Err(ConfigError::InvalidGuard(_))));
        let mut c = valid(tmp.path());
        c.guard = Some(GuardConfig {
            client_cert: Some(cert),
            client_key: Some(tmp.path().join("push.key")),
            ..guard
        });
        assert!(matches!(
            c.validate(),
            Err(ConfigError::MissingFile {
                what: "guard client key file",
                ..
            })
        ));
    }

    #[test]
    fn several_relays_transport_and_tunnels() {
        let tmp = tempfile::tempdir().unwrap();
        let mut c = valid(tmp.path());
        c.relays = vec![
            "https://relay.example:8443".into(),
            "https://relay-b.example".into(),
        ];
        c.validate().unwrap();
        let endpoints = c.relay_endpoints().unwrap();
        assert_eq!(endpoints.len(), 2);
        assert_eq!(
            endpoints[1].tunnel_url,
            "wss://relay-b.example/agent/v1/tunnel"
        );
        // Onboarding and the identity go to the first.
        assert_eq!(
            c.onboard_url().unwrap(),
            "https://relay.example:8443/agent/v1/onboard"
        );

        c.relays.push("https://relay-b.example/".into());
        assert!(matches!(c.validate(), Err(ConfigError::DuplicateRelay(_))));
        c.relays.clear();
        assert!(matches!(c.validate(), Err(ConfigError::NoRelay)));

        let mut c = valid(tmp.path());
        c.tunnels = 0;
        assert!(matches!(c.validate(), Err(ConfigError::InvalidTunnels(0))));
        c.tunnels = MAX_TUNNELS + 1;
        assert!(matches!(c.validate(), Err(ConfigError::InvalidTunnels(_))));

        let mut c = valid(tmp.path());
        c.quic_reprobe_interval = Duration::from_millis(10);
        assert!(matches!(c.validate(), Err(ConfigError::InvalidDuration(_))));

        // QUIC cannot go through an HTTP proxy: `quic` is refused, `auto` uses WebSocket for that relay.
        let mut c = valid(tmp.path());
        c.proxy = Some(Proxy::parse("http://proxy.corp:3128").unwrap());
        c.validate().unwrap();
        assert!(c.relay_endpoints().unwrap()[0].proxied);
        c.transport = TransportMode::Quic;
        assert!(matches!(
            c.validate(),
            Err(ConfigError::QuicThroughProxy { .. })
        ));
        // Unless the relay bypasses the proxy.
        c.no_proxy = Some(NoProxy::parse("relay.example").unwrap());
        c.validate().unwrap();
        assert!(!c.relay_endpoints().unwrap()[0].proxied);
    }

    #[test]
    fn flags_parse_repeatable_relays_transport_and_tunnels() {
        let command =
            Config::augment_args(clap::Command::new("tether-agent")).mut_args(|arg| arg.env(None));
        let matches = command
            .try_get_matches_from([
                "tether-agent",
                "--relay",
                "https://a.example",
                "--relay",
                "https://b.example",
                "--cluster",
                "prod",
                "--transport",
                "wss",
                "--tunnels",
                "3",
                "--quic-reprobe-interval",
                "30s",
            ])
            .unwrap();
        let c = Config::from_arg_matches(&matches).unwrap();
        assert_eq!(c.relays, vec!["https://a.example", "https://b.example"]);
        assert_eq!(c.transport, TransportMode::Wss);
        assert_eq!(c.tunnels, 3);
        assert_eq!(c.quic_reprobe_interval, Duration::from_secs(30));
        for bad in [
            &["--transport", "udp"][..],
            &["--tunnels", "0"][..],
            &["--tunnels", "17"][..],
        ] {
            let command = Config::augment_args(clap::Command::new("tether-agent"))
                .mut_args(|arg| arg.env(None));
            let mut args = vec![
                "tether-agent",
                "--relay",
                "https://a.example",
                "--cluster",
                "p",
            ];
            args.extend_from_slice(bad);
            assert!(command.try_get_matches_from(args).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn debug_never_shows_the_token() {
        let tmp = tempfile::tempdir().unwrap();
        let mut c = valid(tmp.path());
        c.onboarding_token = Some(Secret::new("very-secret-token"));
        c.guard = Some(GuardConfig::new(
            "https://guard.example/snapshot",
            Secret::new("very-secret-push-token"),
        ));
        let shown = format!("{c:?}");
        assert!(!shown.contains("very-secret-token"));
        assert!(!shown.contains("very-secret-push-token"));
    }
}
