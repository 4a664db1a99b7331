//! `tether-loadtest`: parses the command line, sets up logging, and runs the chosen scenario.

use std::process::ExitCode;

use clap::Parser;
use tether_loadtest::cli::Cli;

fn main() -> ExitCode {
    let cli = Cli::parse();
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn")),
        )
        .with_writer(std::io::stderr)
        .init();
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("tether-loadtest: cannot start the async runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    match runtime.block_on(tether_loadtest::run(cli)) {
        Ok(_) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("tether-loadtest: {e:#}");
            ExitCode::FAILURE
        }
    }
}
