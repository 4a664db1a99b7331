//! The proof that matters most: the cluster (sample apiserver + agent) lives in a network namespace whose
//! firewall drops every inbound connection, and kubectl still reaches it through the relay.
//!
//! Topology: the relay runs in the test process, in the root namespace, on the host end of a veth pair. The
//! "cluster" namespace holds the other end; its INPUT chain drops everything except loopback and replies to
//! connections it opened itself. The test shows a direct connection into the namespace fails, then that kubectl
//! works through the relay.
//!
//! Needs root, `ip` and `iptables`. Where a network namespace cannot be made the test prints why and passes
//! without asserting, except under CI (`CI` set), where it fails: CI runs as root and must make them.

mod common;

use std::net::{Ipv4Addr, SocketAddr};
use std::path::Path;
use std::process::Stdio;
use std::time::Duration;

use tether_cli::client::RelayClient;
use tether_cli::kubeconfig::{self, KubeconfigSpec};
use tether_testkit::netns::{self, Netns};

const HOST_IP: Ipv4Addr = Ipv4Addr::new(10, 231, 0, 1);
const CLUSTER_IP: Ipv4Addr = Ipv4Addr::new(10, 231, 0, 2);

async fn wait_for_file(path: &Path, limit: Duration) -> bool {
    common::eventually(limit, || async { path.is_file() }).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kubectl_reaches_a_cluster_that_accepts_no_inbound_connection() -> anyhow::Result<()> {
    if let Err(reason) = netns::available() {
        // CI must be able to make them: there the proof is not optional.
        tether_testkit::tools::skip_or_fail::<()>(&format!(
            "cannot make network namespaces here: {reason}"
        ));
        return Ok(());
    }
    tether_runtime::tls::install_crypto_provider();
    let agent_bin = common::sibling_binary("tether-agent")?;
    let sample_bin = common::sibling_binary("tether-sample-apiserver")?;
    let netns = Netns::refusing_inbound("tth", HOST_IP, CLUSTER_IP)?;
    let dir = tempfile::tempdir()?;

    // The relay, reachable from the namespace at HOST_IP.
    let mut config = tether_relay::Config::new(dir.path().join("relay"));
    config.hostnames = vec!["localhost".into(), HOST_IP.to_string()];
    let relay = tether_relay::Relay::new(config).await?;
    let ca_pem = relay.ca_pem().map(str::to_string).unwrap_or_default();
    let admin = relay.admin_token().clone();
    let listener = tokio::net::TcpListener::bind(SocketAddr::from((HOST_IP, 0))).await?;
    let relay_url = format!("https://{}", listener.local_addr()?);
    let (stop_relay, stopped) = tokio::sync::oneshot::channel::<()>();
    let relay_task = tokio::spawn(relay.serve(listener, async move {
        let _ = stopped.await;
    }));

    // The cluster: the sample apiserver inside the namespace, listening on every address there.
    let sample_dir = dir.path().join("sample");
    std::fs::create_dir_all(&sample_dir)?;
    let mut sample = netns
        .command(&sample_bin)
        .arg("--dir")
        .arg(&sample_dir)
        .args(["--listen", "0.0.0.0:6443"])
        .stdout(Stdio::null())
        .spawn()?;
    anyhow::ensure!(
        wait_for_file(&sample_dir.join("kubeconfig"), Duration::from_secs(30)).await,
        "sample apiserver did not start"
    );
    let token = std::fs::read_to_string(sample_dir.join("token"))?
        .trim()
        .to_string();

    // Nothing gets in: a direct connection from outside to the cluster's apiserver is dropped.
    let direct = tokio::time::timeout(
        Duration::from_secs(3),
        tokio::net::TcpStream::connect(SocketAddr::from((CLUSTER_IP, 6443))),
    )
    .await;
    assert!(
        !matches!(direct, Ok(Ok(_))),
        "the namespace accepted an inbound connection: the firewall is not in place"
    );

    // Register the cluster and run the agent inside the namespace; it dials out to the relay.
    let client = RelayClient::with_token(&relay_url, Some(ca_pem.as_bytes()), admin)?;
    let created = client.create_cluster("fenced", &Default::default()).await?;
    std::fs::write(dir.path().join("relay-ca.pem"), &ca_pem)?;
    let mut agent = netns
        .command(&agent_bin)
        .args(["--relay", &relay_url, "--cluster", "fenced"])
        .arg("--relay-ca")
        .arg(dir.path().join("relay-ca.pem"))
        .arg("--state-dir")
        .arg(dir.path().join("agent"))
        .arg("--kubeconfig")
        .arg(sample_dir.join("kubeconfig"))
        .env("TETHER_ONBOARDING_TOKEN", created.onboarding_token.expose())
        .stdout(Stdio::null())
        .spawn()?;
    let connected = common::eventually(Duration::from_secs(60), || async {
        client
            .show_cluster("fenced")
            .await
            .is_ok_and(|c| c.connected)
    })
    .await;
    anyhow::ensure!(connected, "the agent inside the namespace never connected");

    // kubectl, outside, reaches the fenced cluster through the relay.
    let kubeconfig_path = dir.path().join("fenced.kubeconfig");
    let text = kubeconfig::render(&KubeconfigSpec {
        relay_url: &relay_url,
        cluster: "fenced",
        ca_pem: Some(ca_pem.as_bytes()),
        token: Some(&token),
    })?;
    kubeconfig::write_private(&kubeconfig_path, &text)?;
    let out = tether_testkit::kubectl::Kubectl::new(&kubeconfig_path)?
        .run(&["get", "namespaces", "-o", "name"])
        .await?;
    anyhow::ensure!(
        out.status.success(),
        "kubectl through the relay failed: {}",
        out.stderr
    );
    assert!(out.stdout.contains("namespace/default"), "{}", out.stdout);

    agent.kill().await.ok();
    sample.kill().await.ok();
    let _ = stop_relay.send(());
    relay_task.await??;
    drop(netns);
    Ok(())
}
