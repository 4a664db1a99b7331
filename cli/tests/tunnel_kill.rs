//! One user cannot take a cluster's tunnel away from everyone else (issue 10), end to end with real processes:
//! `tether-relay`, `tether-agent` and `tether-sample-apiserver` (its real HTTP/2 server upstream of the agent),
//! and the real kubectl.
//!
//! One principal opens ~2,400 watches over HTTP/1.1 from 48 concurrent clients and drops each connection within
//! ~50 ms (the attack that made the agent close its tunnel, "too many streams reset right after opening", and
//! the sample apiserver close the agent's shared upstream connection, "too_many_resets"). Meanwhile another
//! principal holds a watch and runs GETs. Afterwards that watch is still open and delivers a new event (its
//! upstream connection, shared with the burst's watches, was not closed), every GET succeeded (kubectl retries a
//! 429 with `Retry-After`, which is what an agent shedding load answers), and the agent never reconnected.

mod common;

use std::net::{SocketAddr, TcpListener};
use std::path::Path;
use std::process::Stdio;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context as _, Result, ensure};
use rustls::pki_types::ServerName;
use tether_cli::client::RelayClient;
use tether_cli::kubeconfig::{self, KubeconfigSpec};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::process::{Child, Command};

const CLUSTER: &str = "burst";
/// Concurrent burst clients, and watches each opens and drops.
const CLIENTS: usize = 48;
const WATCHES_EACH: usize = 50;

/// A free loopback port (bound, read, released: the process started next binds it).
fn free_port() -> Result<u16> {
    Ok(TcpListener::bind("127.0.0.1:0")?.local_addr()?.port())
}

/// A child process whose stderr goes to `log`, killed when dropped.
fn spawn(program: &Path, args: &[&str], log: &Path) -> Result<Child> {
    Ok(Command::new(program)
        .args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(log)?)
        .kill_on_drop(true)
        .spawn()?)
}

async fn wait_for_file(path: &Path) -> Result<()> {
    ensure!(
        common::eventually(Duration::from_secs(60), || async { path.is_file() }).await,
        "{} never appeared",
        path.display()
    );
    Ok(())
}

/// The bearer token in a kubeconfig the sample apiserver wrote.
fn kubeconfig_token(path: &Path) -> Result<String> {
    let doc: serde_yaml::Value = serde_yaml::from_str(&std::fs::read_to_string(path)?)?;
    doc["users"][0]["user"]["token"]
        .as_str()
        .map(str::to_owned)
        .with_context(|| format!("no token in {}", path.display()))
}

/// Opens a watch over HTTP/1.1 and drops the connection within ~50 ms, `WATCHES_EACH` times.
async fn open_and_drop(
    addr: SocketAddr,
    tls: Arc<rustls::ClientConfig>,
    token: String,
    seed: usize,
) -> Result<()> {
    let connector = tokio_rustls::TlsConnector::from(tls);
    let request = format!(
        "GET /clusters/{CLUSTER}/api/v1/namespaces/default/configmaps?watch=1 HTTP/1.1\r\n\
         Host: localhost\r\nAuthorization: Bearer {token}\r\nAccept: application/json\r\n\r\n"
    );
    for i in 0..WATCHES_EACH {
        let tcp = tokio::net::TcpStream::connect(addr).await?;
        let mut tls = connector
            .connect(ServerName::try_from("localhost")?, tcp)
            .await?;
        tls.write_all(request.as_bytes()).await?;
        // Gone within 10–50 ms: sometimes before the answer, sometimes right after its head.
        let linger = Duration::from_millis(10 + ((seed * 31 + i * 17) % 41) as u64);
        let mut buf = [0u8; 512];
        let _ = tokio::time::timeout(linger, tls.read(&mut buf)).await;
        drop(tls);
    }
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn one_principals_open_and_cancel_burst_leaves_the_tunnel_and_other_users_alone() -> Result<()>
{
    tether_runtime::tls::install_crypto_provider();
    if tether_testkit::tools::require(tether_testkit::tools::Tool::Kubectl).is_none() {
        return Ok(());
    }
    let relay_bin = common::sibling_binary("tether-relay")?;
    let agent_bin = common::sibling_binary("tether-agent")?;
    let sample_bin = common::sibling_binary("tether-sample-apiserver")?;
    let dir = tempfile::tempdir()?;
    let d = dir.path();

    // The cluster: the sample apiserver.
    let sample_dir = d.join("sample");
    std::fs::create_dir_all(&sample_dir)?;
    let sample_listen = format!("127.0.0.1:{}", free_port()?);
    let _sample = spawn(
        &sample_bin,
        &[
            "--dir",
            &sample_dir.to_string_lossy(),
            "--listen",
            &sample_listen,
        ],
        &d.join("sample.log"),
    )?;
    wait_for_file(&sample_dir.join("agent-kubeconfig")).await?;
    // Two principals the apiserver knows: the burst uses one, the other user the other.
    let burst_token = std::fs::read_to_string(sample_dir.join("token"))?
        .trim()
        .to_owned();
    let other_token = kubeconfig_token(&sample_dir.join("agent-kubeconfig"))?;

    // The relay.
    let relay_dir = d.join("relay");
    let relay_addr = SocketAddr::from(([127, 0, 0, 1], free_port()?));
    let relay_url = format!("https://{relay_addr}");
    let _relay = spawn(
        &relay_bin,
        &[
            "--listen",
            &relay_addr.to_string(),
            "--data-dir",
            &relay_dir.to_string_lossy(),
        ],
        &d.join("relay.log"),
    )?;
    wait_for_file(&relay_dir.join("admin-token")).await?;
    let ca_pem = std::fs::read(relay_dir.join("ca.pem"))?;
    let admin = tether_runtime::Secret::new(
        std::fs::read_to_string(relay_dir.join("admin-token"))?
            .trim()
            .to_owned(),
    );
    let client = RelayClient::with_token(&relay_url, Some(&ca_pem), admin)?;
    let registered = common::eventually(Duration::from_secs(30), || async {
        client.list_clusters().await.is_ok()
    })
    .await;
    ensure!(registered, "the relay never answered");
    let created = client.create_cluster(CLUSTER, &Default::default()).await?;

    // The agent.
    let agent_log = d.join("agent.log");
    let mut agent = Command::new(&agent_bin);
    agent
        .args(["--relay", &relay_url, "--cluster", CLUSTER])
        .arg("--relay-ca")
        .arg(relay_dir.join("ca.pem"))
        .arg("--state-dir")
        .arg(d.join("agent"))
        .arg("--kubeconfig")
        .arg(sample_dir.join("kubeconfig"))
        .env("TETHER_ONBOARDING_TOKEN", created.onboarding_token.expose())
        .env("RUST_LOG", "info")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(&agent_log)?)
        .kill_on_drop(true);
    let _agent = agent.spawn()?;
    let connected = common::eventually(Duration::from_secs(60), || async {
        client
            .show_cluster(CLUSTER)
            .await
            .is_ok_and(|c| c.connected)
    })
    .await;
    ensure!(connected, "the agent never connected");

    // The other user: a watch, and GETs, with the real kubectl.
    let other_kubeconfig = d.join("other.kubeconfig");
    kubeconfig::write_private(
        &other_kubeconfig,
        &kubeconfig::render(&KubeconfigSpec {
            relay_url: &relay_url,
            cluster: CLUSTER,
            ca_pem: Some(&ca_pem),
            token: Some(&other_token),
        })?,
    )?;
    let kubectl = tether_testkit::kubectl::Kubectl::new(&other_kubeconfig)?;
    let out = kubectl
        .run(&["create", "configmap", "before-burst", "-n", "default"])
        .await?;
    ensure!(out.success(), "kubectl create failed: {}", out.stderr);
    let mut watch = kubectl.spawn(&[
        "get",
        "configmaps",
        "-n",
        "default",
        "--watch",
        "-o",
        "name",
    ])?;
    watch
        .wait_for_line(Duration::from_secs(30), |l| l.contains("before-burst"))
        .await?;

    // The burst, with the other user's GETs running beside it.
    let tls = tether_runtime::tls::client_config(Some(&ca_pem), &[b"http/1.1"])?;
    let mut burst = tokio::task::JoinSet::new();
    for seed in 0..CLIENTS {
        burst.spawn(open_and_drop(
            relay_addr,
            tls.clone(),
            burst_token.clone(),
            seed,
        ));
    }
    let started = std::time::Instant::now();
    let mut gets = 0;
    while !burst.is_empty() {
        let out = kubectl
            .run(&["get", "configmaps", "-n", "default", "-o", "name"])
            .await?;
        ensure!(
            out.success(),
            "the other user's GET failed during the burst: {}",
            out.stderr
        );
        gets += 1;
        while let Some(done) = burst.try_join_next() {
            done??;
        }
        if gets > 1000 {
            anyhow::bail!("the burst never finished");
        }
    }

    let elapsed = started.elapsed();
    println!(
        "burst: {} watches opened and dropped in {elapsed:?} ({:.0}/s); {gets} GETs of the other user beside it",
        CLIENTS * WATCHES_EACH,
        (CLIENTS * WATCHES_EACH) as f64 / elapsed.as_secs_f64()
    );

    // The other user's watch is still open and still delivers; its GETs still work.
    let out = kubectl
        .run(&["create", "configmap", "after-burst", "-n", "default"])
        .await?;
    ensure!(out.success(), "kubectl create failed: {}", out.stderr);
    watch
        .wait_for_line(Duration::from_secs(30), |l| l.contains("after-burst"))
        .await
        .with_context(|| {
            format!(
                "the other user's watch ended or stalled: {}",
                watch.stderr()
            )
        })?;
    let out = kubectl
        .run(&[
            "get",
            "configmap",
            "after-burst",
            "-n",
            "default",
            "-o",
            "name",
        ])
        .await?;
    ensure!(out.success(), "GET after the burst failed: {}", out.stderr);

    // The agent never lost its tunnel.
    let log = std::fs::read_to_string(&agent_log)?;
    let connects = log.matches("connected to the relay").count();
    println!(
        "agent shed load {} time(s) during the burst",
        log.matches("refusing new streams for a moment").count()
    );
    assert_eq!(
        connects, 1,
        "the agent reconnected during the burst; its log:\n{log}"
    );
    assert!(
        client.show_cluster(CLUSTER).await?.connected,
        "cluster shown disconnected"
    );
    watch.kill().await?;
    Ok(())
}
