//! The `tether-sample-apiserver` binary: starts, serves kubectl, stops on SIGTERM; refuses bad configuration.

use std::process::Stdio;

use anyhow::{Context as _, ensure};
use tether_testkit::kubectl::Kubectl;
use tokio::io::{AsyncBufReadExt as _, BufReader};
use tokio::process::Command;

const DEADLINE: std::time::Duration = std::time::Duration::from_secs(60);

#[tokio::test]
async fn serves_until_sigterm() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let mut child = Command::new(env!("CARGO_BIN_EXE_tether-sample-apiserver"))
        .arg("--dir")
        .arg(dir.path())
        .args(["--listen", "127.0.0.1:0", "--token", "fixed-token"])
        .env("RUST_LOG", "warn")
        .stdout(Stdio::piped())
        .kill_on_drop(true)
        .spawn()?;
    let stdout = child.stdout.take().context("stdout")?;
    let line = tokio::time::timeout(DEADLINE, BufReader::new(stdout).lines().next_line())
        .await??
        .context("no banner")?;
    ensure!(
        line.starts_with("sample apiserver at https://127.0.0.1:"),
        "{line}"
    );
    assert_eq!(
        std::fs::read_to_string(dir.path().join("token"))?.trim(),
        "fixed-token"
    );
    assert!(std::fs::read_to_string(dir.path().join("ca.pem"))?.contains("BEGIN CERTIFICATE"));

    let out = Kubectl::new(&dir.path().join("kubeconfig"))?
        .run(&["get", "pods", "-o", "name"])
        .await?;
    ensure!(out.success(), "{out}");
    assert_eq!(out.stdout.trim(), "pod/demo");

    let pid = child.id().context("pid")?.to_string();
    let kill = Command::new("kill").args(["-TERM", &pid]).status().await?;
    ensure!(kill.success());
    let status = tokio::time::timeout(DEADLINE, child.wait()).await??;
    assert!(status.success(), "{status}");
    Ok(())
}

#[tokio::test]
async fn an_empty_token_is_a_configuration_error() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let out = Command::new(env!("CARGO_BIN_EXE_tether-sample-apiserver"))
        .arg("--dir")
        .arg(dir.path())
        .args(["--listen", "127.0.0.1:0", "--token", ""])
        .output()
        .await?;
    assert_eq!(out.status.code(), Some(64));
    assert!(!dir.path().join("kubeconfig").exists());
    Ok(())
}

#[tokio::test]
async fn unusable_webhook_configuration_is_a_configuration_error() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let config = dir.path().join("authz.yaml");
    // A webhook authorizer whose kubeconfig does not exist: refused before anything listens.
    std::fs::write(
        &config,
        "apiVersion: apiserver.config.k8s.io/v1\nkind: AuthorizationConfiguration\nauthorizers:\n\
         - type: Webhook\n  name: w\n  webhook:\n    timeout: 3s\n    subjectAccessReviewVersion: v1\n\
         \x20   failurePolicy: NoOpinion\n    connectionInfo: {type: KubeConfigFile, kubeConfigFile: missing.kubeconfig}\n",
    )?;
    let out = Command::new(env!("CARGO_BIN_EXE_tether-sample-apiserver"))
        .arg("--dir")
        .arg(dir.path())
        .args(["--listen", "127.0.0.1:0", "--authorization-config"])
        .arg(&config)
        .output()
        .await?;
    assert_eq!(out.status.code(), Some(64));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("missing.kubeconfig"), "{stderr}");
    Ok(())
}

#[tokio::test]
async fn bad_flags_exit_64_and_help_exits_0() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    for bad in [
        &["--listen", "not-an-address"][..],
        &["--authentication-token-webhook-cache-ttl", "1d"],
        &["--http2-max-streams-per-connection", "-1"],
        &["--no-such-flag"],
    ] {
        let out = Command::new(env!("CARGO_BIN_EXE_tether-sample-apiserver"))
            .arg("--dir")
            .arg(dir.path())
            .args(bad)
            .output()
            .await?;
        assert_eq!(out.status.code(), Some(64), "{bad:?}");
        ensure!(!out.stderr.is_empty(), "{bad:?} gave no message");
    }
    let out = Command::new(env!("CARGO_BIN_EXE_tether-sample-apiserver"))
        .arg("--help")
        .output()
        .await?;
    assert_eq!(out.status.code(), Some(0));
    let help = String::from_utf8_lossy(&out.stdout);
    assert!(
        help.contains("--http2-max-streams-per-connection"),
        "{help}"
    );
    Ok(())
}
