use std::process::ExitCode;

fn main() -> ExitCode {
    let cli: tether_cli::Cli = tether_runtime::cli::parse();
    tether_cli::init_tracing(cli.verbose);
    let runtime = match tokio::runtime::Runtime::new() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("error: cannot start the async runtime: {e}");
            return ExitCode::from(1);
        }
    };
    match runtime.block_on(tether_cli::run(cli)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {}", e.chain_message());
            ExitCode::from(e.exit_code())
        }
    }
}
