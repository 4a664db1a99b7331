//! `tether-relay`: parses the configuration, sets up logging, binds, and serves until SIGINT/SIGTERM.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use anyhow::Context as _;
use clap::Parser;
use tether_runtime::parse_duration;
use tether_runtime::process::{LogFormat, init_tracing, shutdown_signal};

/// The Tether relay: agents dial in, kubectl requests go out over their tunnels.
#[derive(Debug, Parser)]
#[command(name = "tether-relay", version)]
struct Args {
    /// Address to listen on (HTTPS).
    #[arg(long, env = "TETHER_RELAY_LISTEN", default_value = "0.0.0.0:8443")]
    listen: SocketAddr,
    /// Directory for the database, generated TLS material and admin token.
    #[arg(
        long,
        env = "TETHER_RELAY_DATA_DIR",
        default_value = "./tether-relay-data"
    )]
    data_dir: PathBuf,
    /// PEM certificate chain to serve (with --tls-key); otherwise a CA and certificate are generated.
    #[arg(long, env = "TETHER_RELAY_TLS_CERT")]
    tls_cert: Option<PathBuf>,
    /// PEM private key for --tls-cert.
    #[arg(long, env = "TETHER_RELAY_TLS_KEY")]
    tls_key: Option<PathBuf>,
    /// Hostname or IP for the generated certificate (repeatable; default localhost, 127.0.0.1, ::1).
    #[arg(
        long = "hostname",
        env = "TETHER_RELAY_HOSTNAMES",
        value_delimiter = ','
    )]
    hostnames: Vec<String>,
    /// File holding the admin token (default: DATA_DIR/admin-token, generated once).
    #[arg(long, env = "TETHER_RELAY_ADMIN_TOKEN_FILE")]
    admin_token_file: Option<PathBuf>,
    /// How long an agent has to accept a request before the user gets a 504 (e.g. 10s, 500ms).
    #[arg(long, env = "TETHER_RELAY_OPEN_TIMEOUT", default_value = "10s", value_parser = parse_duration)]
    open_timeout: Duration,
    /// Most concurrent TCP connections (agent tunnels and user connections together); past it new connections
    /// wait. Size it for the number of clusters plus the users' connections.
    #[arg(long, env = "TETHER_RELAY_MAX_CONNECTIONS", default_value_t = 50_000)]
    max_connections: usize,
    /// Tunnels per second this relay can accept after a restart. On shutdown every agent is told to come back
    /// within TUNNELS / RATE seconds (at least 1 s), at a random moment, so they do not all reconnect at once.
    #[arg(long, env = "TETHER_RELAY_RECONNECT_RATE", default_value_t = 1_000)]
    reconnect_rate: u32,
    /// Database URL (default sqlite://DATA_DIR/relay.db).
    #[arg(long, env = "TETHER_RELAY_DATABASE_URL")]
    database_url: Option<String>,
    /// How often agents send heartbeats (whole seconds, e.g. 30s).
    #[arg(long, env = "TETHER_RELAY_HEARTBEAT_INTERVAL", default_value = "30s", value_parser = parse_duration)]
    heartbeat_interval: Duration,
    /// A cluster not heard from for this long shows as Offline (e.g. 15m).
    #[arg(long, env = "TETHER_RELAY_OFFLINE_THRESHOLD", default_value = "15m", value_parser = parse_duration)]
    offline_threshold: Duration,
    /// Validity of the identity (client certificate) issued to each cluster; agents renew at about 2/3 (e.g. 90d).
    #[arg(long, env = "TETHER_RELAY_IDENTITY_VALIDITY", default_value = "90d", value_parser = parse_duration)]
    identity_validity: Duration,
    /// The newest agent version this relay offers; clusters running an older one show "upgrade available".
    #[arg(long, env = "TETHER_RELAY_LATEST_AGENT_VERSION", default_value = env!("CARGO_PKG_VERSION"))]
    latest_agent_version: String,
    /// Entra tenant id whose tokens the relay validates before forwarding (repeatable; with --entra-audience).
    #[arg(
        long = "entra-tenant",
        env = "TETHER_RELAY_ENTRA_TENANTS",
        value_delimiter = ','
    )]
    entra_tenants: Vec<String>,
    /// Accepted audience of Entra tokens (repeatable; with --entra-tenant).
    #[arg(
        long = "entra-audience",
        env = "TETHER_RELAY_ENTRA_AUDIENCES",
        value_delimiter = ','
    )]
    entra_audiences: Vec<String>,
    /// Base URL of the Entra issuer and its discovery documents (default https://login.microsoftonline.com).
    #[arg(long, env = "TETHER_RELAY_ENTRA_AUTHORITY")]
    entra_authority: Option<String>,
    /// PEM CA trusted for the authority's discovery and keys (development issuers and tests).
    #[arg(long, env = "TETHER_RELAY_ENTRA_AUTHORITY_CA")]
    entra_authority_ca: Option<PathBuf>,
    /// Log format.
    #[arg(long, env = "TETHER_RELAY_LOG_FORMAT", default_value = "text")]
    log_format: LogFormat,
}

impl Args {
    fn config(&self) -> tether_relay::Config {
        let mut config = tether_relay::Config::new(self.data_dir.clone());
        config.tls_cert = self.tls_cert.clone();
        config.tls_key = self.tls_key.clone();
        if !self.hostnames.is_empty() {
            config.hostnames = self.hostnames.clone();
        }
        config.admin_token_file = self.admin_token_file.clone();
        config.open_timeout = self.open_timeout;
        config.limits.max_connections = self.max_connections;
        config.limits.reconnect_rate = self.reconnect_rate;
        config.database_url = self.database_url.clone();
        config.heartbeat_interval = self.heartbeat_interval;
        config.offline_threshold = self.offline_threshold;
        config.identity_validity = self.identity_validity;
        config.latest_agent_version = self.latest_agent_version.clone();
        let entra_given = !self.entra_tenants.is_empty()
            || !self.entra_audiences.is_empty()
            || self.entra_authority.is_some()
            || self.entra_authority_ca.is_some();
        if entra_given {
            // Incomplete settings (say, a tenant without an audience) fail validation with exit 64.
            config.entra = Some(tether_relay::EntraConfig {
                tenants: self.entra_tenants.clone(),
                audiences: self.entra_audiences.clone(),
                authority: self.entra_authority.clone(),
                authority_ca: self.entra_authority_ca.clone(),
            });
        }
        config
    }
}

/// Why the relay stopped: configuration problems exit 64 (EX_USAGE), the rest 1.
enum Failure {
    Config(anyhow::Error),
    Runtime(anyhow::Error),
}

async fn run(args: Args, config: tether_relay::Config) -> Result<(), Failure> {
    let relay = match tether_relay::Relay::new(config).await {
        Ok(relay) => relay,
        Err(e @ (tether_relay::RelayError::Config(_) | tether_relay::RelayError::Tls(_))) => {
            return Err(Failure::Config(e.into()));
        }
        Err(e) => {
            return Err(Failure::Runtime(
                anyhow::Error::new(e).context("cannot start the relay"),
            ));
        }
    };
    if relay.ca_pem().is_some() {
        tracing::info!(
            ca = %args.data_dir.join("ca.pem").display(),
            "serving a generated certificate; agents and kubectl must trust this CA"
        );
    }
    let listener = tokio::net::TcpListener::bind(args.listen)
        .await
        .with_context(|| format!("cannot listen on {}", args.listen))
        .map_err(Failure::Runtime)?;
    relay
        .serve(listener, shutdown_signal())
        .await
        .map_err(|e| Failure::Runtime(e.into()))
}

fn main() -> ExitCode {
    let args: Args = tether_runtime::cli::parse();
    init_tracing(args.log_format);
    tether_runtime::tls::install_crypto_provider();
    let config = args.config();
    if let Err(e) = config.validate() {
        eprintln!("tether-relay: invalid configuration: {e}");
        return ExitCode::from(64);
    }
    let runtime = match tokio::runtime::Runtime::new() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("tether-relay: cannot start the async runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    match runtime.block_on(run(args, config)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(Failure::Config(e)) => {
            eprintln!("tether-relay: invalid configuration: {e:#}");
            ExitCode::from(64)
        }
        Err(Failure::Runtime(e)) => {
            tracing::error!("{e:#}");
            eprintln!("tether-relay: {e:#}");
            ExitCode::FAILURE
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cli_parses() {
        Args::command_for_test();
    }

    impl Args {
        fn command_for_test() {
            use clap::CommandFactory;
            Args::command().debug_assert();
        }
    }
}
