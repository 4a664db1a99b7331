//! Shared support for the end-to-end tests: a running quickstart (relay + agent + sample apiserver, wired by the
//! same `tether_cli::up` code as `tether up`) and the real kubectl pointed at it.

#![allow(dead_code, unreachable_pub)]

use std::path::PathBuf;
use std::time::{Duration, Instant};

use tether_cli::up::{Up, UpOptions};

/// A quickstart in a temporary directory.
pub struct Env {
    pub up: Up,
    pub dir: tempfile::TempDir,
}

impl Env {
    pub async fn start() -> anyhow::Result<Env> {
        tether_tunnel::tls::install_crypto_provider();
        let dir = tempfile::tempdir()?;
        let up = Up::start(UpOptions::for_tests(&dir.path().join("up"))).await?;
        Ok(Env { up, dir })
    }

    pub fn kubectl(&self) -> anyhow::Result<tether_testkit::kubectl::Kubectl> {
        Ok(tether_testkit::kubectl::Kubectl::new(
            &self.up.kubeconfig_path,
        )?)
    }

    pub fn sample(&self) -> anyhow::Result<&tether_testkit::SampleApiserver> {
        self.up
            .sample
            .as_ref()
            .ok_or_else(|| anyhow::anyhow!("the test quickstart runs the sample apiserver"))
    }

    /// A kubeconfig like the quickstart's but for another cluster name (to reach an unknown cluster).
    pub fn kubeconfig_for(&self, cluster: &str, token: Option<&str>) -> anyhow::Result<PathBuf> {
        let path = self.dir.path().join(format!("{cluster}.kubeconfig"));
        let text = tether_cli::kubeconfig::render(&tether_cli::kubeconfig::KubeconfigSpec {
            relay_url: &self.up.relay_url,
            cluster,
            ca_pem: Some(self.up.ca_pem.as_bytes()),
            token,
        })?;
        tether_cli::kubeconfig::write_private(&path, &text)?;
        Ok(path)
    }
}

/// A binary built beside the test binary by `cargo test --workspace` (tether-agent, tether-sample-apiserver, …).
pub fn sibling_binary(name: &str) -> anyhow::Result<PathBuf> {
    let tether = PathBuf::from(env!("CARGO_BIN_EXE_tether"));
    let path = tether.with_file_name(name);
    anyhow::ensure!(
        path.is_file(),
        "{} is not built: run the tests with `cargo test --workspace`",
        path.display()
    );
    Ok(path)
}

/// Polls `check` until it returns true or `limit` passes.
pub async fn eventually<F, Fut>(limit: Duration, mut check: F) -> bool
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let deadline = Instant::now() + limit;
    loop {
        if check().await {
            return true;
        }
        if Instant::now() >= deadline {
            return false;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}
