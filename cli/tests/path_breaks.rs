//! Clear ends when the path breaks (issue 17, item 4), with the real kubectl through the relay: the cluster
//! `faults` is served by a separate `tether-agent` process, SIGKILLed while kubectl holds a long-running
//! request. Each request ends; `get -w` and `exec` say which cluster and why; `port-forward` says only that
//! the connection was lost (see its test).

mod common;

use std::process::Stdio;
use std::time::Duration;

use anyhow::Context as _;
use common::{Env, onboarding_token};
use tether_testkit::kubectl::{Kubectl, KubectlChild};

/// A deadline for each step (not a timing assertion).
const WAIT: Duration = Duration::from_secs(60);

/// The quickstart plus a cluster `faults` whose agent is a separate process that can be SIGKILLed.
struct Faults {
    env: Env,
    agent: tokio::process::Child,
    kubectl: Kubectl,
}

impl Faults {
    async fn start() -> anyhow::Result<Faults> {
        let env = Env::start().await?;
        let token = onboarding_token(
            &env.tether_ok(&["cluster", "connect", "faults", "-o", "json"])
                .await?,
        )?;
        let agent = tokio::process::Command::new(common::sibling_binary("tether-agent")?)
            .args(["--relay", &env.up.relay_url, "--cluster", "faults"])
            // The relay learns of a SIGKILL at once over WebSocket (the kernel closes the TCP connection);
            // over QUIC only the tunnel's idle timeout tells it (see the faults test over QUIC).
            .args(["--transport", "wss"])
            .arg("--relay-ca")
            .arg(env.relay_ca_file())
            .arg("--state-dir")
            .arg(env.dir.path().join("faults-agent"))
            .arg("--kubeconfig")
            .arg(env.sample()?.kubeconfig_path())
            .env("TETHER_ONBOARDING_TOKEN", &token)
            .env_remove("HTTPS_PROXY")
            .env_remove("https_proxy")
            .stdout(Stdio::null())
            .kill_on_drop(true)
            .spawn()
            .context("starting tether-agent")?;
        env.wait_cluster("faults", WAIT, |c| c["connected"] == true)
            .await
            .map_err(|last| anyhow::anyhow!("faults never connected: {last}"))?;
        let user_token = env.up.user_token.clone();
        let kubectl = Kubectl::new(&env.kubeconfig_for("faults", user_token.as_deref())?)?;
        Ok(Faults {
            env,
            agent,
            kubectl,
        })
    }

    /// SIGKILLs the agent (no GOAWAY, no drain: the tunnel just drops).
    async fn kill_agent(&mut self) -> anyhow::Result<()> {
        self.agent.start_kill()?;
        self.agent.wait().await?;
        Ok(())
    }

    async fn stop(self) -> anyhow::Result<()> {
        self.env.up.shutdown().await?;
        Ok(())
    }
}

/// Waits for kubectl to end by itself; its stderr.
async fn ended(child: KubectlChild) -> anyhow::Result<String> {
    let stderr_before = child.stderr();
    child.wait(WAIT).await.with_context(|| {
        format!("kubectl did not end after the agent was killed; stderr: {stderr_before}")
    })?;
    // The stderr reader may trail the exit by a moment.
    Ok(stderr_before)
}

/// What kubectl printed, read until it names the cluster or the output stops growing for a while.
async fn stderr_naming(child: &KubectlChild, what: &str) -> String {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    loop {
        let text = child.stderr();
        if text.contains(what) || tokio::time::Instant::now() >= deadline {
            return text;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

fn assert_names_cluster_and_cause(stderr: &str) {
    assert!(stderr.contains("cluster faults"), "{stderr}");
    assert!(
        stderr.contains("lost") || stderr.contains("agent") || stderr.contains("closed"),
        "no cause in: {stderr}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn watch_ends_with_the_cluster_and_the_cause_when_the_agent_is_killed() -> anyhow::Result<()>
{
    let mut faults = Faults::start().await?;
    let out = faults
        .kubectl
        .run(&["create", "configmap", "before"])
        .await?;
    anyhow::ensure!(out.status.success(), "create failed: {}", out.stderr);
    let mut watch = faults
        .kubectl
        .spawn(&["get", "configmaps", "-w", "-o", "name"])?;
    watch.wait_for_line(WAIT, |l| l.contains("before")).await?;
    faults.kill_agent().await?;
    let stderr = stderr_naming(&watch, "cluster faults").await;
    let _ = ended(watch).await?;
    assert_names_cluster_and_cause(&stderr);
    faults.stop().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn exec_ends_with_the_cluster_and_the_cause_when_the_agent_is_killed() -> anyhow::Result<()> {
    let mut faults = Faults::start().await?;
    let mut exec =
        faults
            .kubectl
            .spawn(&["exec", "demo", "--", "sh", "-c", "echo ready; sleep 600"])?;
    exec.wait_for_line(WAIT, |l| l.contains("ready")).await?;
    faults.kill_agent().await?;
    let stderr = stderr_naming(&exec, "cluster faults").await;
    let _ = ended(exec).await?;
    assert_names_cluster_and_cause(&stderr);
    faults.stop().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn port_forward_ends_when_the_agent_is_killed() -> anyhow::Result<()> {
    let mut faults = Faults::start().await?;
    let mut forward = faults.kubectl.spawn(&["port-forward", "pod/demo", ":7"])?;
    let echo = forward.forwarded_address(WAIT).await?;
    // One connection through, so the WebSocket is up.
    let mut tcp = tokio::net::TcpStream::connect(echo).await?;
    {
        use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
        tcp.write_all(b"ping").await?;
        let mut back = [0u8; 4];
        tokio::time::timeout(WAIT, tcp.read_exact(&mut back)).await??;
        assert_eq!(&back, b"ping");
    }
    faults.kill_agent().await?;
    let stderr = stderr_naming(&forward, "lost connection").await;
    let _ = ended(forward).await?;
    // kubectl (1.30+) tunnels SPDY inside the WebSocket and prints only "lost connection to pod", whatever
    // the close frame's reason says (it carries the cluster and the cause); naming them would need the
    // relay to speak SPDY inside the WebSocket (not done).
    assert!(stderr.contains("lost connection"), "{stderr}");
    faults.stop().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn logs_follow_ends_when_the_agent_is_killed() -> anyhow::Result<()> {
    let mut faults = Faults::start().await?;
    let mut logs = faults.kubectl.spawn(&["logs", "-f", "demo"])?;
    logs.wait_for_line(WAIT, |l| l.contains("tick")).await?;
    faults.kill_agent().await?;
    let _ = ended(logs).await?;
    faults.stop().await
}
