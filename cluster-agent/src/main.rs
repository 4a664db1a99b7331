//! `tether-agent`: parses flags (or their environment variables), validates, and runs the agent until SIGINT or
//! SIGTERM. Exit status: 0 after a clean drain, 64 for a bad configuration, 1 for a fatal error.

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use anyhow::Context as _;
use clap::Parser;
use tether_agent::{AgentError, Config, EntraConfig, GuardConfig, Secret};
use tether_runtime::process::{LogFormat, init_tracing, shutdown_signal};
use tether_tunnel::proxy::ProxyConfig;

/// Exit status for a configuration that cannot be used (EX_USAGE).
const EXIT_USAGE: u8 = 64;

#[derive(Parser)]
#[command(
    name = "tether-agent",
    version,
    about = "Tether cluster agent: dials the relay and serves its apiserver"
)]
struct Args {
    /// The relay's URL, e.g. https://relay.example:8443.
    #[arg(long = "relay", env = "TETHER_RELAY")]
    relay: String,
    /// This cluster's name at the relay.
    #[arg(long, env = "TETHER_CLUSTER")]
    cluster: String,
    /// The one-time onboarding token from `tether cluster connect` (needed only the first time).
    #[arg(
        long,
        env = "TETHER_ONBOARDING_TOKEN",
        hide_env_values = true,
        conflicts_with = "onboarding_token_file"
    )]
    onboarding_token: Option<String>,
    /// A file holding the onboarding token.
    #[arg(long, env = "TETHER_ONBOARDING_TOKEN_FILE")]
    onboarding_token_file: Option<PathBuf>,
    /// Where the agent keeps its identity (identity.json and identity-key.pem, mode 0600).
    #[arg(
        long,
        env = "TETHER_STATE_DIR",
        default_value = "/var/lib/tether-agent"
    )]
    state_dir: PathBuf,
    /// A PEM CA bundle to trust for the relay (default: the public web PKI roots).
    #[arg(long, env = "TETHER_RELAY_CA")]
    relay_ca: Option<PathBuf>,
    /// An HTTP proxy to reach the relay through with CONNECT, http://[user:password@]host:port
    /// (default: HTTPS_PROXY, else https_proxy).
    #[arg(long, env = "TETHER_PROXY_HTTPS", hide_env_values = true)]
    proxy_https: Option<String>,
    /// A PEM CA bundle trusted for the relay connection in addition to --relay-ca, for a proxy that
    /// inspects TLS.
    #[arg(long, env = "TETHER_PROXY_CERT")]
    proxy_cert: Option<PathBuf>,
    /// Hosts that bypass the proxy: comma-separated names (a name covers its subdomains), .suffix
    /// domains, IP addresses, CIDRs, or * (default: NO_PROXY, else no_proxy).
    #[arg(long, env = "TETHER_PROXY_SKIP_RANGE")]
    proxy_skip_range: Option<String>,
    /// The kubeconfig naming the apiserver (default: KUBECONFIG, ~/.kube/config, else in-cluster).
    #[arg(long, env = "TETHER_KUBECONFIG")]
    kubeconfig: Option<PathBuf>,
    /// Entra tenant id whose tokens the in-cluster authentication proxy validates and impersonates
    /// (repeatable or comma-separated; with --entra-audience).
    #[arg(
        long = "entra-tenant",
        env = "TETHER_ENTRA_TENANTS",
        value_delimiter = ','
    )]
    entra_tenants: Vec<String>,
    /// Accepted audience of Entra tokens (repeatable or comma-separated; with --entra-tenant).
    #[arg(
        long = "entra-audience",
        env = "TETHER_ENTRA_AUDIENCES",
        value_delimiter = ','
    )]
    entra_audiences: Vec<String>,
    /// Base URL of the Entra issuer and its discovery documents (default https://login.microsoftonline.com).
    #[arg(long, env = "TETHER_ENTRA_AUTHORITY")]
    entra_authority: Option<String>,
    /// A PEM CA trusted (instead of the public roots) for the authority's discovery and keys: development
    /// issuers and tests.
    #[arg(long, env = "TETHER_ENTRA_AUTHORITY_CA")]
    entra_authority_ca: Option<PathBuf>,
    /// Guard's snapshot endpoint, https://HOST:PORT/snapshot: RBAC snapshots from the relay are pushed there
    /// (with --guard-push-token-file).
    #[arg(long, env = "TETHER_GUARD_URL")]
    guard_url: Option<String>,
    /// A file holding the bearer token guard accepts for snapshot pushes.
    #[arg(long, env = "TETHER_GUARD_PUSH_TOKEN_FILE")]
    guard_push_token_file: Option<PathBuf>,
    /// A PEM CA bundle to trust for guard's certificate (default: the public web PKI roots).
    #[arg(long, env = "TETHER_GUARD_CA")]
    guard_ca: Option<PathBuf>,
    /// Seconds open streams may keep running after a shutdown signal.
    #[arg(long, env = "TETHER_DRAIN_TIMEOUT", default_value_t = 20)]
    drain_timeout: u64,
    /// Log format.
    #[arg(long, env = "TETHER_LOG_FORMAT", default_value = "text")]
    log_format: LogFormat,
}

fn main() -> ExitCode {
    let args = match Args::try_parse() {
        Ok(args) => args,
        Err(e) => {
            let usage_error = e.use_stderr();
            let _ = e.print();
            return if usage_error {
                ExitCode::from(EXIT_USAGE)
            } else {
                ExitCode::SUCCESS
            };
        }
    };
    init_tracing(args.log_format);
    let config = match config_from(args) {
        Ok(config) => config,
        Err(e) => {
            eprintln!("tether-agent: {e:#}");
            return ExitCode::from(EXIT_USAGE);
        }
    };
    if let Err(e) = config.validate() {
        eprintln!("tether-agent: invalid configuration: {e}");
        return ExitCode::from(EXIT_USAGE);
    }
    tether_runtime::tls::install_crypto_provider();

    let runtime = match tokio::runtime::Runtime::new() {
        Ok(runtime) => runtime,
        Err(e) => {
            eprintln!("tether-agent: cannot start the runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    match runtime.block_on(tether_agent::run(config, shutdown_signal())) {
        Ok(()) => {
            tracing::info!("stopped");
            ExitCode::SUCCESS
        }
        Err(e @ AgentError::Config(_)) => {
            eprintln!("tether-agent: {e}");
            ExitCode::from(EXIT_USAGE)
        }
        Err(e) => {
            tracing::error!(error = %e, "fatal");
            eprintln!("tether-agent: {e}");
            ExitCode::FAILURE
        }
    }
}

fn config_from(args: Args) -> anyhow::Result<Config> {
    let mut config = Config::new(args.relay, args.cluster, args.state_dir);
    config.onboarding_token = match (args.onboarding_token, args.onboarding_token_file) {
        (Some(token), _) => Some(Secret::new(token.trim())),
        (None, Some(path)) => {
            let text = std::fs::read_to_string(&path).with_context(|| {
                format!("cannot read the onboarding token file {}", path.display())
            })?;
            Some(Secret::new(text.trim()))
        }
        (None, None) => None,
    };
    config.relay_ca = args.relay_ca;
    let proxy_url = args
        .proxy_https
        .or_else(|| env_value("HTTPS_PROXY"))
        .or_else(|| env_value("https_proxy"))
        .filter(|v| !v.trim().is_empty());
    let skip = args
        .proxy_skip_range
        .or_else(|| env_value("NO_PROXY"))
        .or_else(|| env_value("no_proxy"));
    config.proxy = proxy_url
        .map(|url| ProxyConfig::parse(&url, skip.as_deref()))
        .transpose()
        .context("invalid proxy settings")?;
    config.proxy_ca = args.proxy_cert;
    config.kubeconfig = args.kubeconfig;
    config.drain_timeout = Duration::from_secs(args.drain_timeout);
    let entra_given = !args.entra_tenants.is_empty()
        || !args.entra_audiences.is_empty()
        || args.entra_authority.is_some()
        || args.entra_authority_ca.is_some();
    if entra_given {
        // Incomplete settings (a tenant without an audience) fail validation with exit 64.
        config.entra = Some(EntraConfig {
            tenants: args.entra_tenants,
            audiences: args.entra_audiences,
            authority: args.entra_authority,
            authority_ca: args.entra_authority_ca,
        });
    }
    config.guard = match (args.guard_url, args.guard_push_token_file) {
        (Some(url), Some(path)) => {
            let token = std::fs::read_to_string(&path).with_context(|| {
                format!("cannot read the guard push token file {}", path.display())
            })?;
            let mut guard = GuardConfig::new(url, Secret::new(token.trim()));
            guard.ca = args.guard_ca;
            Some(guard)
        }
        (Some(_), None) => anyhow::bail!("--guard-url needs --guard-push-token-file"),
        (None, Some(_)) => anyhow::bail!("--guard-push-token-file needs --guard-url"),
        (None, None) if args.guard_ca.is_some() => anyhow::bail!("--guard-ca needs --guard-url"),
        (None, None) => None,
    };
    Ok(config)
}

fn env_value(name: &str) -> Option<String> {
    std::env::var(name).ok()
}
