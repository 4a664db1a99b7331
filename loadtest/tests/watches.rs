//! Issue 17, "must show": 3,000 open watches through one tunnel, with real processes — `tether-relay` with its
//! product defaults for every per-client bound, `tether-agent`, and `tether-sample-apiserver` at
//! kube-apiserver's default of 100 HTTP/2 streams per connection. 2,000 watches come from 20 principals (100
//! each, multiplexed on one HTTP/2 connection, as client-go informers hold them) and 1,000 from one principal
//! (one HTTP/1.1 connection each, as kube-rs holds them); each principal is an Entra-style identity of its own
//! that the relay validates and counts by its `oid`, connecting from a loopback address of its own. Every
//! watch gets its head and its first event; `kubectl get ns` answers while they are open; and when the agent
//! is SIGKILLed every one of them ends with an `ERROR` event naming the cluster.
//!
//! Waits have deadlines (bounds, not timing assertions). Needs kubectl: fails under CI without it.

use std::net::{IpAddr, Ipv4Addr};
use std::time::Duration;

use anyhow::Context as _;
use serde_json::json;
use tether_loadtest::cluster::{CLUSTER, ClusterOptions, SampleCluster};
use tether_loadtest::tether::Binaries;
use tether_loadtest::watches::{Group, Watches};
use tether_testkit::tools::{Tool, require, workspace_binary};

/// A bound on each step (opening thousands of watches on two shared cores takes a while).
const WAIT: Duration = Duration::from_secs(300);

fn address(a: u8, b: u8) -> IpAddr {
    IpAddr::V4(Ipv4Addr::new(127, 0, a, b))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_thousand_watches_through_one_tunnel_are_answered_and_kubectl_still_answers()
-> anyhow::Result<()> {
    if require(Tool::Kubectl).is_none() {
        return Ok(());
    }
    tether_runtime::tls::install_crypto_provider();
    // One descriptor per HTTP/1.1 watch here and at the relay (children inherit the limit).
    tether_loadtest::procs::raise_nofile_limit();
    let relay_bin = workspace_binary("tether-relay").map_err(anyhow::Error::msg)?;
    workspace_binary("tether-sample-apiserver").map_err(anyhow::Error::msg)?;
    let bins = Binaries::locate(relay_bin.parent())?;
    let dir = tempfile::tempdir()?;
    let started = std::time::Instant::now();
    let step = |what: &str| eprintln!("WATCHES {what} at {:.1}s", started.elapsed().as_secs_f64());
    let mut cluster = SampleCluster::start(
        &bins,
        dir.path(),
        &ClusterOptions {
            log_level: "warn".into(),
            ..ClusterOptions::default()
        },
    )
    .await?;

    // Something for every watch's first event.
    let admin_of_default = cluster.principal("setup@loadtest.example")?;
    let (status, body) = cluster
        .request(
            address(0, 1),
            &admin_of_default,
            http::Method::POST,
            "/api/v1/namespaces/default/configmaps",
            Some(json!({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "watched"}})),
        )
        .await?;
    anyhow::ensure!(status == http::StatusCode::CREATED, "{status}: {body:?}");

    step("cluster up");
    let mut groups = Vec::new();
    for i in 0..20u8 {
        groups.push(Group {
            name: format!("informer-{i}"),
            token: cluster.principal(&format!("informer-{i}@loadtest.example"))?,
            from: address(1, i + 1),
            watches: 100,
            http2: true,
        });
    }
    groups.push(Group {
        name: "controller".into(),
        token: cluster.principal("controller@loadtest.example")?,
        from: address(2, 1),
        watches: 1_000,
        http2: false,
    });
    let watches = Watches::open(
        &cluster,
        &groups,
        "/api/v1/namespaces/default/configmaps?watch=1",
        WAIT,
    )
    .await?;
    step("watches open");
    let failures = watches.failures();
    assert!(
        failures.is_empty(),
        "{} watches failed, e.g. {:?}",
        failures.len(),
        &failures[..failures.len().min(5)]
    );
    assert_eq!(watches.answered(), 3_000);
    // They are all open at once, through the one tunnel, on more than one upstream connection.
    assert!(cluster.relay_open_streams().await? > 3_000);
    let upstream = cluster
        .agent_gauge("tether_agent_upstream_connections")
        .await?;
    assert!(
        upstream >= 30,
        "3,000 watches at 100 streams per apiserver connection need 30 connections; the agent has {upstream}"
    );

    // An ordinary request from yet another user is answered while they are open.
    let kubeconfig = dir.path().join("user.kubeconfig");
    tether_loadtest::tether::write_kubeconfig_with_token(
        &kubeconfig,
        &format!("{}{}", cluster.relay.url, cluster.prefix()),
        &cluster.relay.ca_pem,
        &cluster.principal("someone-else@loadtest.example")?,
    )?;
    let kubectl = tether_testkit::kubectl::Kubectl::new(&kubeconfig)?;
    let out = kubectl
        .run(&["get", "ns", "--request-timeout", "60s"])
        .await?;
    assert!(out.success(), "kubectl get ns: {out}");
    assert!(out.stdout.contains("default"), "{}", out.stdout);
    assert_eq!(watches.ended().len(), 0, "watches ended while open");

    step("kubectl answered");
    // The agent dies: every watch ends, each saying which cluster and why.
    cluster.kill_agent().await.context("no agent to kill")?;
    let ended = watches.wait_ended(3_000, WAIT).await;
    assert_eq!(ended, 3_000, "watches still open after the agent died");
    step("watches ended");
    let unclear: Vec<_> = watches
        .ended()
        .into_iter()
        .filter(|e| {
            !e.error_event
                .as_deref()
                .is_some_and(|m| m.contains(&format!("cluster {CLUSTER}")))
        })
        .collect();
    assert!(
        unclear.is_empty(),
        "{} watches ended without an ERROR event naming the cluster, e.g. {:?}",
        unclear.len(),
        unclear.first()
    );
    watches.close().await;
    cluster.stop().await;
    Ok(())
}
