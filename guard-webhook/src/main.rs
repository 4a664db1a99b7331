//! `tether-guard`: parses flags straight into [`tether_guard::config::Config`], validates them (exit 64 when
//! unusable, flags included), then serves until SIGINT/SIGTERM.

use std::process::ExitCode;

use tether_guard::config::Config;
use tether_runtime::cli::EX_USAGE;
use tether_runtime::process::{LogFormat, init_tracing, shutdown_signal};

#[derive(clap::Parser)]
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
    let cli: Cli = tether_runtime::cli::parse();
    init_tracing(cli.log_format);
    tether_runtime::tls::install_crypto_provider();
    let loaded = match cli.config.load() {
        Ok(loaded) => loaded,
        Err(e) => {
            eprintln!("tether-guard: invalid configuration: {e}");
            return ExitCode::from(EX_USAGE);
        }
    };
    match loaded.serve(shutdown_signal()).await {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("tether-guard: {e}");
            ExitCode::FAILURE
        }
    }
}
