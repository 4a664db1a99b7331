//! `tether-loadtest`: parses the command line, sets up logging, and runs the chosen scenario. Exit status 64 for
//! bad flags, 1 when a scenario fails.

use std::process::ExitCode;

use tether_loadtest::cli::Cli;
use tether_runtime::process::{LogFormat, init_tracing_with_default};

fn main() -> ExitCode {
    let cli: Cli = tether_runtime::cli::parse();
    // Progress bars own the terminal: only warnings by default.
    init_tracing_with_default(LogFormat::Text, "warn");
    let runtime = match tokio::runtime::Runtime::new() {
        Ok(runtime) => runtime,
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
