//! The quickstart's promise with guard: a Viewer reads configmaps but not secrets, cannot port-forward, exec or
//! attach; a Writer can; and `kubectl auth can-i` (SelfSubjectAccessReview through the sample apiserver's
//! authorizer chain, i.e. guard) says the same as what happens. Real kubectl through relay, tunnel and agent;
//! roles assigned with the real `tether` binary; tokens from `tether token`.
//!
//! The expectations are those of Azure's built-in roles (Azure Arc Kubernetes Viewer: no secrets, no
//! exec/attach/portforward/proxy; Writer: both).

mod common;

use std::path::PathBuf;
use std::time::Duration;

use anyhow::ensure;
use common::{Env, eventually};
use serde_json::Value;
use tether_testkit::dev_issuer::object_id;
use tether_testkit::kubectl::{Kubectl, Output};
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};

/// A deadline for each step (not a timing assertion).
const WAIT: Duration = Duration::from_secs(60);
const VIOLET: &str = "violet.viewer@contoso.com";
const WREN: &str = "wren.writer@contoso.com";

async fn token(env: &Env, user: &str) -> anyhow::Result<String> {
    let out = env.tether(&["token", "--user", user]).await?;
    ensure!(out.code == Some(0), "tether token failed: {}", out.stderr);
    Ok(out.stdout.trim().to_string())
}

/// kubectl through the relay as `user` (a kubeconfig written by `tether kubeconfig`).
async fn kubectl_as(env: &Env, user: &str) -> anyhow::Result<Kubectl> {
    let name = user.split('@').next().unwrap_or(user);
    let token_file = env.dir.path().join(format!("{name}.token"));
    std::fs::write(&token_file, token(env, user).await?)?;
    let path: PathBuf = env.dir.path().join(format!("{name}.kubeconfig"));
    env.tether_ok(&[
        "kubeconfig",
        env.up.cluster(),
        "--token-file",
        &token_file.display().to_string(),
        "-f",
        &path.display().to_string(),
    ])
    .await?;
    Ok(Kubectl::new(&path)?)
}

async fn assign(env: &Env, role: &str, user: &str) -> anyhow::Result<()> {
    let out = env
        .tether_ok(&[
            "role",
            "assign",
            "--role",
            role,
            "--principal",
            &object_id(user),
            "--cluster",
            env.up.cluster(),
            "-o",
            "json",
        ])
        .await?;
    let v: Value = serde_json::from_str(&out)?;
    ensure!(v["id"].is_string(), "no assignment id in {out}");
    Ok(())
}

fn forbidden(out: &Output, what: &str) -> anyhow::Result<()> {
    ensure!(
        !out.success() && (out.stderr.contains("Forbidden") || out.stderr.contains("forbidden")),
        "{what} should be Forbidden: {out}"
    );
    Ok(())
}

/// `kubectl auth can-i ARGS`: true for "yes" (exit 0), false for "no" (exit 1); anything else is an error.
async fn can_i(kubectl: &Kubectl, args: &[&str]) -> anyhow::Result<bool> {
    let mut full = vec!["auth", "can-i"];
    full.extend_from_slice(args);
    let out = kubectl.run(&full).await?;
    match (out.code(), out.stdout.trim()) {
        (Some(0), answer) if answer.starts_with("yes") => Ok(true),
        (Some(1), answer) if answer.starts_with("no") => Ok(false),
        _ => anyhow::bail!("unexpected `kubectl {}`: {out}", full.join(" ")),
    }
}

/// Starts `kubectl port-forward pod/demo :7` and sends a few bytes through: Ok(true) if they came back, Ok(false)
/// if kubectl reported the connection refused by the server.
async fn port_forward_works(kubectl: &Kubectl) -> anyhow::Result<(bool, String)> {
    let mut child = kubectl.spawn(&["port-forward", "pod/demo", ":7"])?;
    let addr = match child.forwarded_address(WAIT).await {
        Ok(addr) => addr,
        Err(e) => {
            // kubectl has exited; its stderr is collected in the background.
            eventually(WAIT, || async { !child.stderr().is_empty() }).await;
            return Ok((false, format!("{e}; stderr: {}", child.stderr())));
        }
    };
    let mut tcp = tokio::net::TcpStream::connect(addr).await?;
    tcp.write_all(b"knock knock").await?;
    tcp.shutdown().await?;
    let mut back = Vec::new();
    let read = tokio::time::timeout(WAIT, tcp.read_to_end(&mut back)).await;
    // kubectl stays up after a failed stream; what it printed tells why.
    let _ = tokio::time::timeout(Duration::from_secs(2), child.next_line(WAIT)).await;
    let stderr = child.stderr();
    child.kill().await?;
    Ok((matches!(read, Ok(Ok(_))) && back == b"knock knock", stderr))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn viewer_reads_configmaps_not_secrets_and_cannot_reach_into_pods() -> anyhow::Result<()> {
    let env = Env::start().await?;
    assign(&env, "Viewer", VIOLET).await?;
    let viewer = kubectl_as(&env, VIOLET).await?;
    // The assignment reaches guard through the agent: wait until it works.
    let reached = eventually(WAIT, || async {
        viewer
            .run(&["get", "configmaps"])
            .await
            .is_ok_and(|o| o.success())
    })
    .await;
    ensure!(reached, "the Viewer assignment never took effect");

    let out = viewer.run(&["get", "secrets"]).await?;
    forbidden(&out, "Viewer get secrets")?;
    let out = viewer
        .run(&["get", "secret", "demo-credentials", "-o", "yaml"])
        .await?;
    forbidden(&out, "Viewer get secret")?;
    let out = viewer.run(&["exec", "demo", "--", "echo", "hi"]).await?;
    forbidden(&out, "Viewer exec")?;
    let out = viewer
        .run(&["attach", "demo", "--pod-running-timeout=5s"])
        .await?;
    forbidden(&out, "Viewer attach")?;
    let (works, stderr) = port_forward_works(&viewer).await?;
    ensure!(!works, "Viewer port-forward must not work");
    ensure!(
        stderr.contains("Forbidden") || stderr.contains("forbidden"),
        "Viewer port-forward should be refused as Forbidden: {stderr}"
    );

    // `auth can-i` tells the same story.
    ensure!(can_i(&viewer, &["get", "configmaps"]).await?);
    ensure!(can_i(&viewer, &["list", "pods"]).await?);
    ensure!(!can_i(&viewer, &["get", "secrets"]).await?);
    ensure!(!can_i(&viewer, &["list", "secrets", "-n", "kube-system"]).await?);
    ensure!(!can_i(&viewer, &["create", "pods", "--subresource=exec"]).await?);
    ensure!(!can_i(&viewer, &["create", "pods", "--subresource=attach"]).await?);
    ensure!(!can_i(&viewer, &["create", "pods", "--subresource=portforward"]).await?);
    let out = viewer.run(&["auth", "can-i", "--list"]).await?;
    ensure!(out.success(), "auth can-i --list: {out}");
    env.up.shutdown().await?;
    Ok(())
}

/// Azure Arc Kubernetes Viewer has no proxy data action: `pods/proxy` and `services/proxy` map to their own
/// `…/proxy/action` and are refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn viewer_cannot_proxy_to_pods_or_services() -> anyhow::Result<()> {
    let env = Env::start().await?;
    assign(&env, "Viewer", VIOLET).await?;
    let viewer = kubectl_as(&env, VIOLET).await?;
    let reached = eventually(WAIT, || async {
        viewer
            .run(&["get", "configmaps"])
            .await
            .is_ok_and(|o| o.success())
    })
    .await;
    ensure!(reached, "the Viewer assignment never took effect");
    ensure!(!can_i(&viewer, &["get", "services", "--subresource=proxy"]).await?);
    ensure!(!can_i(&viewer, &["get", "pods", "--subresource=proxy"]).await?);
    // `get --raw` does not add the server URL's path prefix (/clusters/NAME): give the whole path.
    let path = format!(
        "/clusters/{}/api/v1/namespaces/default/pods/demo/proxy/",
        env.up.cluster()
    );
    let out = viewer.run(&["get", "--raw", &path]).await?;
    forbidden(&out, "Viewer pods/proxy")?;
    // `get --raw` does not add the server URL's path prefix (/clusters/NAME): give the whole path.
    let path = format!(
        "/clusters/{}/api/v1/namespaces/default/services/demo/proxy/",
        env.up.cluster()
    );
    let out = viewer.run(&["get", "--raw", &path]).await?;
    forbidden(&out, "Viewer services/proxy")?;
    env.up.shutdown().await?;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn writer_reads_secrets_port_forwards_and_execs() -> anyhow::Result<()> {
    let env = Env::start().await?;
    assign(&env, "Writer", WREN).await?;
    let writer = kubectl_as(&env, WREN).await?;
    let reached = eventually(WAIT, || async {
        writer
            .run(&["get", "configmaps"])
            .await
            .is_ok_and(|o| o.success())
    })
    .await;
    ensure!(reached, "the Writer assignment never took effect");

    let out = writer
        .run(&[
            "get",
            "secret",
            "demo-credentials",
            "-o",
            "jsonpath={.data.username}",
        ])
        .await?;
    ensure!(out.success(), "Writer get secret: {out}");
    assert_eq!(out.stdout.trim(), "ZGVtbw==");
    let out = writer.run(&["exec", "demo", "--", "echo", "hi"]).await?;
    ensure!(out.success(), "Writer exec: {out}");
    assert_eq!(out.stdout.trim(), "hi");
    let (works, stderr) = port_forward_works(&writer).await?;
    ensure!(works, "Writer port-forward must work: {stderr}");

    ensure!(can_i(&writer, &["get", "secrets"]).await?);
    ensure!(can_i(&writer, &["create", "configmaps"]).await?);
    ensure!(can_i(&writer, &["create", "pods", "--subresource=exec"]).await?);
    ensure!(can_i(&writer, &["create", "pods", "--subresource=portforward"]).await?);
    // Writer is namespaced work only, in Azure's definition: no nodes.
    ensure!(!can_i(&writer, &["delete", "nodes"]).await?);
    let out = writer.run(&["delete", "node", "sample-node-1"]).await?;
    forbidden(&out, "Writer delete node")?;
    env.up.shutdown().await?;
    Ok(())
}
