//! `tether-agent`: parses flags (or their environment variables) straight into [`tether_agent::Config`],
//! validates, and runs the agent until SIGINT or SIGTERM. Exit status: 0 after a clean drain, 64 for a bad
//! configuration (flags included), 1 for a fatal error.
//!
//! `tether-agent doctor [the same flags] [-o json]` runs [`tether_agent::doctor`] instead: one line per check,
//! exit status 0 when no check failed, 1 when one did, 64 for a bad configuration.

use std::process::ExitCode;

use clap::Parser;
use tether_agent::{AgentError, Config, ConfigError};
use tether_runtime::cli::EX_USAGE;
use tether_runtime::process::{LogFormat, init_tracing, shutdown_signal};

#[derive(Parser)]
#[command(
    name = "tether-agent",
    version,
    about = "Tether cluster agent: dials the relay and serves its apiserver",
    after_help = "`tether-agent doctor` with the same flags checks what the agent needs (see `tether-agent doctor --help`)."
)]
struct Cli {
    #[command(flatten)]
    config: Config,
    /// Log format: text or json.
    #[arg(long, env = "TETHER_LOG_FORMAT", default_value = "text")]
    log_format: LogFormat,
    /// Worker threads of the async runtime; 0: one per CPU. The default, one, carries the tunnel (one
    /// connection whose frames one task drives) without hand-offs between threads: about a quarter less CPU per
    /// request than two workers, and bulk transfers no slower on the machines measured (docs/BENCHMARKS.md).
    /// More can pay on a large node with CPU to spare when bulk transfers (`kubectl cp`, port-forward) must pass
    /// one core's worth of TLS.
    #[arg(long, env = "TETHER_WORKER_THREADS", default_value_t = 1)]
    worker_threads: usize,
}

fn main() -> ExitCode {
    let mut args: Vec<std::ffi::OsString> = std::env::args_os().collect();
    if args.get(1).is_some_and(|a| a == "doctor") {
        args.remove(1);
        let args = tether_runtime::cli::parse_from(args);
        return match tether_runtime::process::runtime(1) {
            Ok(runtime) => runtime.block_on(doctor(args)),
            Err(e) => cannot_start(&e),
        };
    }
    let cli: Cli = tether_runtime::cli::parse_from(args);
    match tether_runtime::process::runtime(cli.worker_threads) {
        Ok(runtime) => runtime.block_on(agent(cli)),
        Err(e) => cannot_start(&e),
    }
}

fn cannot_start(e: &std::io::Error) -> ExitCode {
    eprintln!("tether-agent: cannot start the async runtime: {e}");
    ExitCode::FAILURE
}

/// Runs the agent until SIGINT or SIGTERM.
async fn agent(cli: Cli) -> ExitCode {
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

/// `tether-agent doctor`: the report on stdout; no identity is required (the identity check reports it).
async fn doctor(args: tether_agent::doctor::Args) -> ExitCode {
    tether_runtime::process::init_tracing_with_default(args.log_format, "warn");
    let config = match args.config.with_proxy_env() {
        Ok(config) => config,
        Err(e) => return usage(&format!("invalid proxy settings: {e}")),
    };
    match config.validate() {
        Ok(()) | Err(ConfigError::MissingOnboardingToken { .. }) => {}
        Err(e) => return usage(&format!("invalid configuration: {e}")),
    }
    let options = tether_agent::doctor::Options {
        max_clock_skew: args.max_clock_skew,
    };
    let report = tether_agent::doctor::run(&config, &options).await;
    if args.output == "json" {
        println!("{}", report.json());
    } else {
        print!("{}", report.text());
    }
    if report.ok {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    }
}

fn usage(message: &str) -> ExitCode {
    eprintln!("tether-agent: {message}");
    ExitCode::from(EX_USAGE)
}
