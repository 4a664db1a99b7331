//! `tether-sample-apiserver`: runs the sample Kubernetes apiserver until Ctrl-C or SIGTERM.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use anyhow::Context as _;
use clap::Parser;
use tether_testkit::{SampleApiserver, SampleOptions, TestkitError};

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
    /// TokenReview webhook kubeconfig, asked for tokens that are not static ones (as kube-apiserver's flag).
    #[arg(long, env = "TETHER_SAMPLE_AUTHN_WEBHOOK")]
    authentication_token_webhook_config_file: Option<PathBuf>,
    /// How long TokenReview answers are cached (Go duration, e.g. 2m).
    #[arg(long, default_value = "2m", value_parser = parse_duration)]
    authentication_token_webhook_cache_ttl: Duration,
    /// Structured AuthorizationConfiguration YAML (as kube-apiserver's flag); without it every authenticated
    /// request is allowed.
    #[arg(long, env = "TETHER_SAMPLE_AUTHZ_CONFIG")]
    authorization_config: Option<PathBuf>,
    /// HTTP/2 concurrent streams per connection (as kube-apiserver's flag; 0 means its default, 100).
    #[arg(long, default_value_t = tether_testkit::DEFAULT_HTTP2_MAX_STREAMS)]
    http2_max_streams_per_connection: u32,
}

fn parse_duration(s: &str) -> Result<Duration, String> {
    tether_testkit::authz::parse_duration(s)
        .ok_or_else(|| format!("invalid duration {s:?} (e.g. 2m, 30s)"))
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
        authn_webhook: args.authentication_token_webhook_config_file,
        authn_cache_ttl: args.authentication_token_webhook_cache_ttl,
        authz_config: args.authorization_config,
        http2_max_streams_per_connection: args.http2_max_streams_per_connection,
    })
    .await;
    let server = match server {
        Err(TestkitError::Webhook(e)) => {
            eprintln!("error: {e}");
            std::process::exit(64);
        }
        other => other.context("starting the sample apiserver")?,
    };
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
