//! `tether-sample-apiserver`: runs the sample Kubernetes apiserver until Ctrl-C or SIGTERM.

use std::net::SocketAddr;
use std::path::PathBuf;

use anyhow::Context as _;
use clap::Parser;
use tether_testkit::{SampleApiserver, SampleOptions};

/// A sample Kubernetes apiserver for tests and demos (in memory, HTTPS, bearer tokens).
#[derive(Debug, Parser)]
#[command(name = "tether-sample-apiserver", version)]
struct Args {
    /// Directory for kubeconfig, ca.pem and token (created if missing).
    #[arg(long, env = "TETHER_SAMPLE_DIR")]
    dir: PathBuf,
    /// Address to listen on.
    #[arg(long, env = "TETHER_SAMPLE_LISTEN", default_value = "127.0.0.1:6443")]
    listen: SocketAddr,
    /// Bearer token of user "admin" (random when not given).
    #[arg(long, env = "TETHER_SAMPLE_TOKEN", hide_env_values = true)]
    token: Option<String>,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .init();
    if args.token.as_deref().is_some_and(str::is_empty) {
        eprintln!("error: --token must not be empty");
        std::process::exit(64);
    }
    let server = SampleApiserver::start(SampleOptions {
        dir: args.dir,
        listen: args.listen,
        token: args.token,
    })
    .await
    .context("starting the sample apiserver")?;
    println!(
        "sample apiserver at {}; kubeconfig: {}",
        server.url(),
        server.kubeconfig_path().display()
    );
    shutdown_signal().await;
    server.shutdown().await;
    Ok(())
}

async fn shutdown_signal() {
    #[cfg(unix)]
    {
        let mut term =
            match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
                Ok(term) => term,
                Err(error) => {
                    tracing::warn!(%error, "cannot listen for SIGTERM; Ctrl-C only");
                    let _ = tokio::signal::ctrl_c().await;
                    return;
                }
            };
        tokio::select! {
            _ = tokio::signal::ctrl_c() => {}
            _ = term.recv() => {}
        }
    }
    #[cfg(not(unix))]
    {
        let _ = tokio::signal::ctrl_c().await;
    }
}
