//! `tether-agent`: parses flags (or their environment variables) straight into [`tether_agent::Config`],
//! validates, and runs the agent until SIGINT or SIGTERM. Exit status: 0 after a clean drain, 64 for a bad
//! configuration (flags included), 1 for a fatal error.

use std::process::ExitCode;

use clap::Parser;
use tether_agent::{AgentError, Config};
use tether_runtime::cli::EX_USAGE;
use tether_runtime::process::{LogFormat, init_tracing, shutdown_signal};

#[derive(Parser)]
#[command(
    name = "tether-agent",
    version,
    about = "Tether cluster agent: dials the relay and serves its apiserver"
)]
struct Cli {
    #[command(flatten)]
    config: Config,
    /// Log format: text or json.
    #[arg(long, env = "TETHER_LOG_FORMAT", default_value = "text")]
    log_format: LogFormat,
}

#[tokio::main]
async fn main() -> ExitCode {
    let cli: Cli = tether_runtime::cli::parse();
    init_tracing(cli.log_format);
    let config = match cli.config.with_proxy_env() {
        Ok(config) => config,
        Err(e) => return usage(&format!("invalid proxy settings: {e}")),
    };
    if let Err(e) = config.validate() {
        return usage(&format!("invalid configuration: {e}"));
    }
    match tether_agent::run(config, shutdown_signal()).await {
        Ok(()) => {
            tracing::info!("stopped");
            ExitCode::SUCCESS
        }
        Err(e @ AgentError::Config(_)) => usage(&e.to_string()),
        Err(e) => {
            tracing::error!(error = %e, "fatal");
            eprintln!("tether-agent: {e}");
            ExitCode::FAILURE
        }
    }
}

fn usage(message: &str) -> ExitCode {
    eprintln!("tether-agent: {message}");
    ExitCode::from(EX_USAGE)
}
