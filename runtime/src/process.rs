//! What every Tether program's `main` does the same way: its async runtime, logging to stderr and waiting for a
//! stop signal.

use std::io::IsTerminal as _;
use std::str::FromStr;

/// How logs are written.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LogFormat {
    /// Human-readable lines (colours only when stderr is a terminal).
    Text,
    /// One JSON object per line, for log collectors.
    Json,
}

impl FromStr for LogFormat {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "text" => Ok(LogFormat::Text),
            "json" => Ok(LogFormat::Json),
            other => Err(format!("unknown log format {other:?} (use text or json)")),
        }
    }
}

/// The process's Tokio runtime (I/O and timers enabled) with `worker_threads` worker threads; 0: one per CPU
/// (or `TOKIO_WORKER_THREADS`).
///
/// Fewer workers cost less CPU per request: each hand-off of work between workers parks one thread and wakes
/// another (docs/BENCHMARKS.md measured ~20 % of the CPU per small request in relay and agent), while one worker
/// caps the process at one core.
pub fn runtime(worker_threads: usize) -> std::io::Result<tokio::runtime::Runtime> {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(worker_count(worker_threads))
        .enable_all()
        .build()
}

/// How many workers [`runtime`] starts for `worker_threads`: itself, else `TOKIO_WORKER_THREADS` when it is a
/// positive number, else one per CPU.
pub fn worker_count(worker_threads: usize) -> usize {
    if worker_threads > 0 {
        return worker_threads;
    }
    std::env::var("TOKIO_WORKER_THREADS")
        .ok()
        .and_then(|v| v.trim().parse::<usize>().ok())
        .filter(|&n| n > 0)
        .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, usize::from))
}

/// Logs to stderr, filtered by `RUST_LOG` (default `info`).
pub fn init_tracing(format: LogFormat) {
    init_tracing_with_default(format, "info");
}

/// Logs to stderr, filtered by `RUST_LOG`, else by `default` (an `EnvFilter` directive such as
/// `warn,tether_cli=info`). A second call keeps the first setup.
pub fn init_tracing_with_default(format: LogFormat, default: &str) {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(default));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(std::io::stderr().is_terminal());
    let _ = match format {
        LogFormat::Text => builder.try_init(),
        LogFormat::Json => builder.json().try_init(),
    };
}

/// Resolves on SIGINT or SIGTERM.
pub async fn shutdown_signal() {
    let interrupt = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    #[cfg(unix)]
    let terminate = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut signal) => {
                signal.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    #[cfg(not(unix))]
    let terminate = std::future::pending::<()>();
    tokio::select! {
        () = interrupt => {}
        () = terminate => {}
    }
    tracing::info!("shutdown signal received");
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn log_formats_parse() {
        assert_eq!("text".parse(), Ok(LogFormat::Text));
        assert_eq!("json".parse(), Ok(LogFormat::Json));
        assert!("yaml".parse::<LogFormat>().is_err());
    }
}
