//! `tether-sample-apiserver`: runs the sample Kubernetes apiserver until Ctrl-C or SIGTERM. Bad flags exit 64.

use clap::Parser as _;
use tether_testkit::{SampleApiserver, SampleFlags, TestkitError};

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let flags = match SampleFlags::try_parse() {
        Ok(flags) => flags,
        Err(e) if e.use_stderr() => {
            let _ = e.print();
            std::process::exit(64);
        }
        Err(e) => e.exit(), // --help, --version
    };
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    tracing_subscriber::fmt().with_env_filter(filter).init();
    let server = match SampleApiserver::start(flags.into_options()).await {
        Err(TestkitError::Webhook(e)) => {
            eprintln!("error: {e}");
            std::process::exit(64);
        }
        other => other?,
    };
    println!(
        "sample apiserver at {}; kubeconfig: {}",
        server.url(),
        server.kubeconfig_path().display()
    );
    tether_testkit::shutdown_signal().await;
    server.shutdown().await;
    Ok(())
}
