//! `tether-relay`: parses the configuration, sets up logging, binds, and serves until SIGINT/SIGTERM.

use std::net::SocketAddr;
use std::process::ExitCode;

use tether_relay::Config;
use tether_runtime::cli::EX_USAGE;
use tether_runtime::process::{LogFormat, init_tracing, shutdown_signal};
use tether_runtime::shards::Shards;

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
    /// Worker threads of the async runtime; 0: one per CPU. Each one more lets the relay use one more core.
    #[arg(long, env = "TETHER_RELAY_WORKER_THREADS", default_value_t = 0)]
    worker_threads: usize,
    /// With more than one worker, serve connections on one single-threaded runtime per worker (shards)
    /// instead of all workers: each user's connection on the shard that drives its cluster's tunnel, so a
    /// request never changes threads between them (a quarter to a third less CPU per request where measured,
    /// docs/BENCHMARKS.md). Off: every connection on the shared workers.
    #[arg(long, env = "TETHER_RELAY_SHARDS", default_value = "on", value_parser = ["on", "off"])]
    shards: String,
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
    let workers = tether_runtime::process::worker_count(args.worker_threads);
    let runtime = match tether_runtime::process::runtime(workers) {
        Ok(runtime) => runtime,
        Err(e) => {
            eprintln!("tether-relay: cannot start the async runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    let shards = if workers > 1 && args.shards == "on" {
        match Shards::start(workers, "relay") {
            Ok(shards) => Some(shards),
            Err(e) => {
                eprintln!("tether-relay: cannot start the shards' runtimes: {e}");
                return ExitCode::FAILURE;
            }
        }
    } else {
        None
    };
    let result = runtime.block_on(tether_relay::run_on(
        args.config,
        args.listen,
        shards.clone(),
        shutdown_signal(),
    ));
    // What is left on the shards (connections cut at the drain timeout) stops with them.
    drop(shards);
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) if e.is_usage() => {
            eprintln!("tether-relay: invalid configuration: {e}");
            ExitCode::from(EX_USAGE)
        }
        Err(e) => {
            tracing::error!("{e}");
            eprintln!("tether-relay: {e}");
            ExitCode::FAILURE
        }
    }
}
