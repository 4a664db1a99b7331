//! `tether-guard`: parses flags straight into [`tether_guard::config::Config`], validates them (exit 64 when
//! unusable, flags included), then serves until SIGINT/SIGTERM.

use std::process::ExitCode;

use clap::Parser;
use tether_guard::config::{Config, Loaded};
use tether_runtime::process::{LogFormat, init_tracing, shutdown_signal};

/// Exit status for unusable configuration (EX_USAGE).
const EXIT_USAGE: u8 = 64;

#[derive(Parser)]
#[command(
    name = "tether-guard",
    version,
    about = "Kubernetes authentication and authorization webhooks for Entra-style tokens and Azure-RBAC-style role assignments"
)]
struct Cli {
    #[command(flatten)]
    config: Config,
    /// Log format: text or json.
    #[arg(long, env = "TETHER_GUARD_LOG_FORMAT", default_value = "text")]
    log_format: LogFormat,
}

#[tokio::main]
async fn main() -> ExitCode {
    let cli = match Cli::try_parse() {
        Ok(cli) => cli,
        Err(e) => {
            let _ = e.print();
            return ExitCode::from(if e.use_stderr() { EXIT_USAGE } else { 0 });
        }
    };
    init_tracing(cli.log_format);
    tether_runtime::tls::install_crypto_provider();
    let loaded = match cli.config.load() {
        Ok(loaded) => loaded,
        Err(e) => {
            eprintln!("tether-guard: invalid configuration: {e}");
            return ExitCode::from(EXIT_USAGE);
        }
    };
    match run(loaded).await {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("tether-guard: {e:#}");
            ExitCode::FAILURE
        }
    }
}

async fn run(loaded: Loaded) -> anyhow::Result<()> {
    let listener = tokio::net::TcpListener::bind(loaded.listen)
        .await
        .map_err(|e| anyhow::anyhow!("cannot listen on {}: {e}", loaded.listen))?;
    if let Some(addr) = loaded.metrics_listen {
        let metrics = tokio::net::TcpListener::bind(addr)
            .await
            .map_err(|e| anyhow::anyhow!("cannot listen on {addr} for metrics: {e}"))?;
        let guard = loaded.guard.clone();
        tokio::spawn(async move {
            if let Err(e) =
                tether_guard::server::run_metrics(guard, metrics, shutdown_signal()).await
            {
                tracing::error!(error = %e, "the metrics listener stopped");
            }
        });
    }
    tether_guard::run(loaded.guard, loaded.server, listener, shutdown_signal()).await?;
    Ok(())
}
