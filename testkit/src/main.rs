//! `tether-sample-apiserver`: runs the sample Kubernetes apiserver until SIGINT or SIGTERM. Bad flags and unusable
//! webhook configurations exit 64.

use std::process::ExitCode;

use tether_runtime::cli::EX_USAGE;
use tether_runtime::process::{LogFormat, init_tracing, shutdown_signal};
use tether_testkit::{SampleApiserver, SampleFlags, TestkitError};

#[tokio::main]
async fn main() -> ExitCode {
    let flags: SampleFlags = tether_runtime::cli::parse();
    init_tracing(LogFormat::Text);
    let server = match SampleApiserver::start(flags.into_options()).await {
        Ok(server) => server,
        Err(e) => {
            eprintln!("tether-sample-apiserver: {e}");
            return match e {
                TestkitError::Webhook(_) => ExitCode::from(EX_USAGE),
                _ => ExitCode::FAILURE,
            };
        }
    };
    println!(
        "sample apiserver at {}; kubeconfig: {}",
        server.url(),
        server.kubeconfig_path().display()
    );
    shutdown_signal().await;
    server.shutdown().await;
    ExitCode::SUCCESS
}
