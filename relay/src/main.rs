//! `tether-relay`: parses the configuration, sets up logging, binds, and serves until SIGINT/SIGTERM.

use std::net::SocketAddr;
use std::process::ExitCode;

use anyhow::Context as _;
use tether_relay::{Config, Relay, RelayError};
use tether_runtime::cli::EX_USAGE;
use tether_runtime::process::{LogFormat, init_tracing, shutdown_signal};

/// The Tether relay: agents dial in, kubectl requests go out over their tunnels.
#[derive(Debug, clap::Parser)]
#[command(name = "tether-relay", version)]
struct Args {
    /// Address to listen on (HTTPS).
    #[arg(long, env = "TETHER_RELAY_LISTEN", default_value = "0.0.0.0:8443")]
    listen: SocketAddr,
    /// Log format.
    #[arg(long, env = "TETHER_RELAY_LOG_FORMAT", default_value = "text")]
    log_format: LogFormat,
    #[command(flatten)]
    config: Config,
}

fn main() -> ExitCode {
    let args: Args = tether_runtime::cli::parse();
    init_tracing(args.log_format);
    if let Err(e) = args.config.validate() {
        eprintln!("tether-relay: invalid configuration: {e}");
        return ExitCode::from(EX_USAGE);
    }
    let result = tokio::runtime::Runtime::new()
        .context("cannot start the async runtime")
        .and_then(|runtime| runtime.block_on(run(args)));
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e)
            if matches!(
                e.downcast_ref(),
                Some(RelayError::Config(_) | RelayError::Tls(_))
            ) =>
        {
            eprintln!("tether-relay: invalid configuration: {e:#}");
            ExitCode::from(EX_USAGE)
        }
        Err(e) => {
            tracing::error!("{e:#}");
            eprintln!("tether-relay: {e:#}");
            ExitCode::FAILURE
        }
    }
}

async fn run(args: Args) -> anyhow::Result<()> {
    let ca = args.config.data_dir.join("ca.pem");
    let relay = Relay::new(args.config).await.map_err(|e| match e {
        e @ (RelayError::Config(_) | RelayError::Tls(_)) => anyhow::Error::new(e),
        e => anyhow::Error::new(e).context("cannot start the relay"),
    })?;
    if relay.ca_pem().is_some() {
        tracing::info!(ca = %ca.display(), "serving a generated certificate; agents and kubectl must trust this CA");
    }
    let listener = tokio::net::TcpListener::bind(args.listen)
        .await
        .with_context(|| format!("cannot listen on {}", args.listen))?;
    Ok(relay.serve(listener, shutdown_signal()).await?)
}
