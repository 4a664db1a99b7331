//! `tether-guard`: parse flags, validate them (exit 64 when unusable), then serve until SIGINT/SIGTERM.

use std::process::ExitCode;

use clap::Parser;
use tether_guard::config::Config;

/// Exit status for unusable configuration (EX_USAGE).
const EXIT_CONFIG: u8 = 64;

#[tokio::main]
async fn main() -> ExitCode {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .with_writer(std::io::stderr)
        .init();
    tether_runtime::tls::install_crypto_provider();
    let config = match Config::try_parse() {
        Ok(c) => c,
        Err(e) if e.use_stderr() => {
            let _ = e.print();
            return ExitCode::from(EXIT_CONFIG);
        }
        Err(e) => {
            let _ = e.print();
            return ExitCode::SUCCESS;
        }
    };
    let loaded = match config.load() {
        Ok(l) => l,
        Err(e) => {
            eprintln!("tether-guard: invalid configuration: {e}");
            return ExitCode::from(EXIT_CONFIG);
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

async fn run(loaded: tether_guard::config::Loaded) -> anyhow::Result<()> {
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

async fn shutdown_signal() {
    let ctrl_c = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    #[cfg(unix)]
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    #[cfg(not(unix))]
    let term = std::future::pending::<()>();
    tokio::select! {
        () = ctrl_c => {},
        () = term => {},
    }
}
