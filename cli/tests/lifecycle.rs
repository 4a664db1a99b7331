//! A cluster's life as a user meets it, end to end: the relay, agents and the sample apiserver in this process,
//! the real `tether` binary and the real kubectl driving them. Thresholds are configured short (seconds) and every
//! wait is a condition polled until a deadline: nothing asserts how long anything took.

mod common;

use std::collections::BTreeSet;
use std::time::Duration;

use common::{Env, eventually, names, onboarding_token};
use serde_json::Value;
use tether_cli::up::UpError;
use tether_runtime::Secret;

/// Generous: the machine running the tests may be slow and busy.
const WAIT: Duration = Duration::from_secs(60);

fn secs(n: u64) -> Option<Duration> {
    Some(Duration::from_secs(n))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn status_goes_connecting_connected_offline_and_connected_again() -> anyhow::Result<()> {
    let env = Env::start_with(|o| {
        o.heartbeat_interval = secs(1);
        o.offline_threshold = secs(4);
    })
    .await?;
    let state = env.dir.path().join("edge-agent");

    // Registered, agent not started: Connecting, never seen.
    let token = onboarding_token(
        &env.tether_ok(&["cluster", "connect", "edge", "-o", "json"])
            .await?,
    )?;
    let edge = env.cluster("edge").await?;
    assert_eq!(edge["connectivityStatus"], "Connecting", "{edge}");
    assert_eq!(edge["lastConnectivityTime"], Value::Null, "{edge}");
    let listed = env
        .tether_ok(&["cluster", "list", "--status", "Connecting", "-o", "json"])
        .await?;
    assert_eq!(names(&listed)?, ["edge"]);

    // The agent onboards and heartbeats: Connected, and the last connectivity time moves on.
    let agent = env.agent("edge", Some(&token), &state)?;
    let connected = env.wait_status("edge", "Connected", WAIT).await?;
    let first_seen = connected["lastConnectivityTime"].clone();
    assert!(first_seen.is_string(), "{connected}");
    env.wait_cluster("edge", WAIT, |c| {
        c["lastConnectivityTime"].is_string() && c["lastConnectivityTime"] != first_seen
    })
    .await
    .map_err(|last| anyhow::anyhow!("no heartbeat moved lastConnectivityTime: {last}"))?;

    // The agent stops: after the offline threshold, Offline.
    agent.stop().await?;
    let offline = env.wait_status("edge", "Offline", WAIT).await?;
    assert_eq!(offline["connected"], false, "{offline}");
    assert!(offline["lastConnectivityTime"].is_string(), "{offline}");
    let table = env
        .tether_ok(&["cluster", "list", "--status", "offline"])
        .await?;
    let rows: Vec<&str> = table.lines().collect();
    assert_eq!(rows.len(), 2, "{table}");
    assert!(
        rows[1].starts_with("edge") && rows[1].contains("Offline") && !rows[1].ends_with("never"),
        "{table}"
    );

    // It comes back with its stored identity: Connected again.
    let agent = env.agent("edge", None, &state)?;
    env.wait_status("edge", "Connected", WAIT).await?;
    agent.stop().await?;
    env.up.shutdown().await?;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_expired_identity_is_refused_and_the_cluster_recovers_by_connecting_again()
-> anyhow::Result<()> {
    let mut env = Env::start_with(|o| {
        o.heartbeat_interval = secs(1);
        o.offline_threshold = secs(30);
        o.identity_validity = secs(8);
    })
    .await?;
    let kubectl = env.kubectl()?;
    let old = env.cluster("demo").await?;

    // The agent is stopped, so nothing renews the identity: it expires.
    env.up.stop_agent().await?;
    let expired = env.wait_status("demo", "Expired", WAIT).await?;
    assert_eq!(expired["connected"], false, "{expired}");
    let shown = env.tether_ok(&["cluster", "show", "demo"]).await?;
    assert!(
        shown
            .lines()
            .any(|l| l.starts_with("Status:") && l.ends_with("Expired")),
        "{shown}"
    );
    assert!(
        shown.contains("delete the cluster and connect it again"),
        "{shown}"
    );
    let listed = env
        .tether_ok(&["cluster", "list", "--status", "Expired", "-o", "json"])
        .await?;
    assert_eq!(names(&listed)?, ["demo"]);

    // The agent, started again, is refused with the reason and gives up.
    match env.up.start_agent().await {
        Err(UpError::Agent(message)) => {
            assert!(message.contains("identity expired"), "{message}");
            assert!(
                message.contains("delete it at the relay and connect it again"),
                "{message}"
            );
        }
        other => anyhow::bail!("the agent with an expired identity: {other:?}"),
    }
    let out = kubectl.run(&["get", "namespaces"]).await?;
    assert!(!out.status.success(), "kubectl reached an expired cluster");

    // Recovery, as a user does it: delete, connect again, run the agent with the new token.
    env.tether_ok(&["cluster", "delete", "demo"]).await?;
    let token = onboarding_token(
        &env.tether_ok(&["cluster", "connect", "demo", "-o", "json"])
            .await?,
    )?;
    env.up.onboard_agent(Secret::new(token)).await?;
    let back = env.wait_status("demo", "Connected", WAIT).await?;
    assert_ne!(
        back["identity"]["fingerprint"], old["identity"]["fingerprint"],
        "{back}"
    );
    let out = kubectl.run(&["get", "namespaces", "-o", "name"]).await?;
    anyhow::ensure!(
        out.status.success(),
        "kubectl after recovery: {}",
        out.stderr
    );
    env.up.shutdown().await?;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_renewal_keeps_the_tunnel_and_an_open_watch_streaming() -> anyhow::Result<()> {
    let env = Env::start_with(|o| {
        o.heartbeat_interval = secs(1);
        o.offline_threshold = secs(30);
        // Renewed at about two thirds: every 6 s or so.
        o.identity_validity = secs(9);
    })
    .await?;
    let kubectl = env.kubectl()?;
    let before = env
        .wait_cluster("demo", WAIT, |c| c["agentHealth"]["reconnects"].is_u64())
        .await
        .map_err(|last| anyhow::anyhow!("no agent health reported: {last}"))?;
    let fingerprint = before["identity"]["fingerprint"].clone();
    let identity_file = env.up.agent_state_dir().join("identity.json");
    let stored_before = std::fs::read_to_string(&identity_file)?;

    // An open watch, proven established by an event it streams.
    let mut watch = kubectl.spawn(&["get", "configmaps", "-w", "-o", "name"])?;
    let mut established = false;
    for attempt in 0..10 {
        let name = format!("before-renewal-{attempt}");
        let out = kubectl.run(&["create", "configmap", &name]).await?;
        anyhow::ensure!(out.status.success(), "create failed: {}", out.stderr);
        if watch
            .wait_for_line(Duration::from_secs(5), |l| l.contains("before-renewal-"))
            .await
            .is_ok()
        {
            established = true;
            break;
        }
    }
    anyhow::ensure!(established, "the watch never streamed the first configmap");

    // The identity is renewed in-band.
    let renewed = env
        .wait_cluster("demo", WAIT, |c| {
            c["identity"]["fingerprint"].is_string() && c["identity"]["fingerprint"] != fingerprint
        })
        .await
        .map_err(|last| anyhow::anyhow!("the identity was not renewed: {last}"))?;
    let renewed_at = time::OffsetDateTime::now_utc();
    assert!(
        eventually(WAIT, || async {
            std::fs::read_to_string(&identity_file).is_ok_and(|now| now != stored_before)
        })
        .await,
        "the agent did not store the renewed identity"
    );

    // The open watch still streams, over the same tunnel.
    let out = kubectl
        .run(&["create", "configmap", "after-renewal"])
        .await?;
    anyhow::ensure!(out.status.success(), "create failed: {}", out.stderr);
    watch
        .wait_for_line(Duration::from_secs(30), |l| l.contains("after-renewal"))
        .await
        .map_err(|e| {
            anyhow::anyhow!(
                "the watch stopped streaming after the renewal: {e}; stderr: {}",
                watch.stderr()
            )
        })?;
    assert_eq!(
        renewed["connectedSince"], before["connectedSince"],
        "the tunnel was reconnected: {renewed}"
    );
    let reconnects = before["agentHealth"]["reconnects"].clone();
    let later = env
        .wait_cluster("demo", WAIT, |c| {
            c["agentHealth"]["reportedAt"]
                .as_str()
                .and_then(|t| {
                    time::OffsetDateTime::parse(t, &time::format_description::well_known::Rfc3339)
                        .ok()
                })
                .is_some_and(|t| t > renewed_at)
        })
        .await
        .map_err(|last| anyhow::anyhow!("no health report after the renewal: {last}"))?;
    assert_eq!(later["agentHealth"]["reconnects"], reconnects, "{later}");
    assert_eq!(later["connectedSince"], before["connectedSince"], "{later}");
    drop(watch);
    env.up.shutdown().await?;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn deleting_a_cluster_revokes_it_and_its_agent_stops() -> anyhow::Result<()> {
    let mut env = Env::start().await?;
    let kubectl = env.kubectl()?;
    let out = kubectl.run(&["get", "namespaces"]).await?;
    anyhow::ensure!(out.status.success(), "{}", out.stderr);

    let said = env.tether_ok(&["cluster", "delete", "demo"]).await?;
    assert!(said.contains("deleted"), "{said}");
    match env.up.wait_agent_stopped(WAIT).await {
        Some(Err(message)) => assert!(
            message.contains("rejected this cluster's identity") && message.contains("revoked"),
            "{message}"
        ),
        other => anyhow::bail!("the agent of a deleted cluster: {other:?}"),
    }
    let out = kubectl.run(&["get", "namespaces"]).await?;
    assert!(!out.status.success());
    assert!(out.stderr.contains("not found"), "{}", out.stderr);
    let out = env.tether(&["cluster", "show", "demo"]).await?;
    assert_eq!(out.code, Some(1), "{out:?}");
    assert!(out.stderr.contains("404"), "{}", out.stderr);
    env.up.shutdown().await?;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metadata_follows_a_node_added_to_the_cluster() -> anyhow::Result<()> {
    let env = Env::start().await?;
    let first = env
        .wait_cluster("demo", WAIT, |c| c["nodeCount"] == 1)
        .await
        .map_err(|last| anyhow::anyhow!("no metadata: {last}"))?;
    assert_eq!(first["totalCpuMillis"], 4000, "{first}");
    assert_eq!(first["totalMemoryBytes"], 8u64 << 30, "{first}");
    assert!(
        first["kubernetesVersion"]
            .as_str()
            .is_some_and(|v| v.starts_with("v1.")),
        "{first}"
    );
    assert!(
        first["distribution"]
            .as_str()
            .is_some_and(|d| !d.is_empty()),
        "{first}"
    );
    assert_eq!(first["agentVersion"], env!("CARGO_PKG_VERSION"), "{first}");
    assert_eq!(first["upgradeAvailable"], false, "{first}");

    env.sample()?.add_node(
        "worker-2",
        "8",
        "16Gi",
        &[("node.kubernetes.io/instance-type", "m5.2xlarge")],
        "aws:///eu-west-1a/i-0123456789abcdef0",
    )?;
    let second = env
        .wait_cluster("demo", WAIT, |c| c["nodeCount"] == 2)
        .await
        .map_err(|last| anyhow::anyhow!("the new node never showed: {last}"))?;
    assert_eq!(second["totalCpuMillis"], 12_000, "{second}");
    assert_eq!(second["totalMemoryBytes"], 24u64 << 30, "{second}");

    let shown = env.tether_ok(&["cluster", "show", "demo"]).await?;
    let line = |label: &str| {
        shown
            .lines()
            .find(|l| l.starts_with(label))
            .map(|l| l[label.len()..].trim().to_string())
    };
    assert_eq!(line("Nodes:").as_deref(), Some("2"), "{shown}");
    assert_eq!(line("vCPU:").as_deref(), Some("12"), "{shown}");
    assert_eq!(line("Memory:").as_deref(), Some("24 GiB"), "{shown}");
    assert!(
        line("Kubernetes version:").is_some_and(|v| v.starts_with("v1.")),
        "{shown}"
    );
    assert!(
        line("Identity:").is_some_and(|v| v.starts_with("expires ")),
        "{shown}"
    );
    env.up.shutdown().await?;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tags_and_filters_through_the_cli() -> anyhow::Result<()> {
    let env = Env::start_with(|o| {
        o.tags.insert("team".into(), "platform".into());
        o.latest_agent_version = Some("99.0.0".into());
    })
    .await?;
    for (name, tags) in [
        ("prod-eu", ["env=prod", "region=eu"]),
        ("prod-us", ["env=prod", "region=us"]),
        ("dev-eu", ["env=dev", "region=eu"]),
    ] {
        let said = env
            .tether_ok(&[
                "cluster", "connect", name, "--tag", tags[0], "--tag", tags[1],
            ])
            .await?;
        assert!(said.contains("TETHER_ONBOARDING_TOKEN="), "{said}");
        assert!(said.contains(&format!("--cluster {name}")), "{said}");
    }
    let list = |args: &'static [&'static str]| {
        let env = &env;
        async move {
            let mut all = vec!["cluster", "list", "-o", "json"];
            all.extend_from_slice(args);
            names(&env.tether_ok(&all).await?)
        }
    };
    assert_eq!(list(&["--tag", "env=prod"]).await?, ["prod-eu", "prod-us"]);
    assert_eq!(
        list(&["--tag", "env=prod", "--tag", "region=eu"]).await?,
        ["prod-eu"]
    );
    assert_eq!(
        list(&["--tag", "region"]).await?,
        ["dev-eu", "prod-eu", "prod-us"]
    );
    assert_eq!(list(&["--tag", "team=platform"]).await?, ["demo"]);
    assert_eq!(list(&["--tag", "env=staging"]).await?, Vec::<String>::new());
    assert_eq!(
        list(&["--status", "Connecting"]).await?,
        ["dev-eu", "prod-eu", "prod-us"]
    );
    assert_eq!(list(&["--status", "connected"]).await?, ["demo"]);
    assert_eq!(
        list(&[
            "--status",
            "Connected",
            "--status",
            "Connecting",
            "--tag",
            "region=eu"
        ])
        .await?,
        ["dev-eu", "prod-eu"]
    );

    // The table: the inventory columns, the upgrade hint, a relative last-seen time.
    let table = env.tether_ok(&["cluster", "list"]).await?;
    let mut lines = table.lines();
    let header: Vec<&str> = lines
        .next()
        .unwrap_or_default()
        .split("   ")
        .map(str::trim)
        .filter(|c| !c.is_empty())
        .collect();
    assert_eq!(
        header,
        [
            "NAME",
            "STATUS",
            "K8S VERSION",
            "NODES",
            "AGENT VERSION",
            "LAST SEEN"
        ],
        "{table}"
    );
    let demo = table
        .lines()
        .find(|l| l.starts_with("demo "))
        .unwrap_or_default();
    assert!(demo.contains("Connected"), "{table}");
    assert!(demo.contains(" (upgrade available)"), "{table}");
    assert!(
        demo.ends_with(" ago") || demo.ends_with("just now"),
        "{table}"
    );
    let rows: BTreeSet<&str> = lines.filter_map(|l| l.split_whitespace().next()).collect();
    assert_eq!(
        rows,
        BTreeSet::from(["demo", "dev-eu", "prod-eu", "prod-us"])
    );
    let none = env
        .tether_ok(&["cluster", "list", "--tag", "env=staging"])
        .await?;
    assert_eq!(none.trim(), "No clusters match.");

    let shown = env.tether_ok(&["cluster", "show", "prod-eu"]).await?;
    assert!(
        shown
            .lines()
            .any(|l| l.starts_with("Tags:") && l.ends_with("env=prod,region=eu")),
        "{shown}"
    );
    assert!(
        shown
            .lines()
            .any(|l| l.starts_with("Status:") && l.ends_with("Connecting")),
        "{shown}"
    );
    let demo = env.tether_ok(&["cluster", "show", "demo"]).await?;
    assert!(demo.contains("(upgrade available: 99.0.0)"), "{demo}");

    // Bad filters are usage errors, caught before the relay is asked.
    let out = env
        .tether(&["cluster", "list", "--status", "Sleeping"])
        .await?;
    assert_ne!(out.code, Some(0), "{out:?}");
    assert!(out.stderr.contains("Connecting"), "{}", out.stderr);
    let out = env.tether(&["cluster", "list", "--tag", "=prod"]).await?;
    assert_eq!(out.code, Some(64), "{out:?}");
    let out = env
        .tether(&["cluster", "connect", "x", "--tag", "novalue"])
        .await?;
    assert_eq!(out.code, Some(64), "{out:?}");
    env.up.shutdown().await?;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn export_and_import_move_a_cluster_to_a_second_relay() -> anyhow::Result<()> {
    let old = Env::start().await?;
    let new = Env::start().await?;
    let state = old.dir.path().join("moving-agent");

    // A tagged cluster connected at the old relay.
    let token = onboarding_token(
        &old.tether_ok(&[
            "cluster",
            "connect",
            "moving",
            "--tag",
            "env=prod",
            "--tag",
            "team=blue",
            "-o",
            "json",
        ])
        .await?,
    )?;
    let agent = old.agent("moving", Some(&token), &state)?;
    old.wait_status("moving", "Connected", WAIT).await?;

    // Export there, import here.
    let exported = old.tether_ok(&["cluster", "export", "moving"]).await?;
    let document: Value = serde_json::from_str(&exported)?;
    assert_eq!(document["kind"], "ClusterExport", "{document}");
    assert_eq!(document["apiVersion"], "tether.dev/v1", "{document}");
    assert_eq!(document["name"], "moving", "{document}");
    let file = old.dir.path().join("moving.json");
    std::fs::write(&file, &exported)?;
    let file = file.to_string_lossy().to_string();
    let said = new.tether_ok(&["cluster", "import", &file]).await?;
    assert!(
        said.contains(&format!("--relay {}", new.up.relay_url)),
        "{said}"
    );
    assert!(said.contains("env=prod,team=blue"), "{said}");
    let new_token = said
        .split_whitespace()
        .find_map(|w| w.strip_prefix("TETHER_ONBOARDING_TOKEN="))
        .ok_or_else(|| anyhow::anyhow!("no agent command in {said}"))?
        .to_string();
    let again = new.tether(&["cluster", "import", &file]).await?;
    assert_eq!(again.code, Some(1), "{again:?}");
    assert!(again.stderr.contains("409"), "{}", again.stderr);

    let imported = new.cluster("moving").await?;
    assert_eq!(imported["connectivityStatus"], "Connecting", "{imported}");
    assert_eq!(
        imported["tags"],
        serde_json::json!({"env": "prod", "team": "blue"}),
        "{imported}"
    );
    assert_eq!(
        imported["identity"],
        Value::Null,
        "no identity moves: {imported}"
    );

    // The agent is pointed at the new relay with the new token; it onboards again there.
    agent.stop().await?;
    let agent = common::TestAgent::start(
        &new.up.relay_url,
        &new.relay_ca_file(),
        &old.sample()?.kubeconfig_path(),
        "moving",
        Some(&new_token),
        &state,
    )?;
    let moved = new.wait_status("moving", "Connected", WAIT).await?;
    assert!(moved["identity"]["fingerprint"].is_string(), "{moved}");
    let kubeconfig = new.kubeconfig_for("moving", Some(old.sample()?.token()))?;
    let out = tether_testkit::kubectl::Kubectl::new(&kubeconfig)?
        .run(&["get", "namespaces", "-o", "name"])
        .await?;
    anyhow::ensure!(
        out.status.success(),
        "kubectl through the new relay: {}",
        out.stderr
    );
    assert!(out.stdout.contains("namespace/default"), "{}", out.stdout);

    // Done moving: it goes from the old relay.
    old.tether_ok(&["cluster", "delete", "moving"]).await?;
    let listed = old.tether_ok(&["cluster", "list", "-o", "json"]).await?;
    assert_eq!(names(&listed)?, ["demo"]);
    agent.stop().await?;
    new.up.shutdown().await?;
    old.up.shutdown().await?;
    Ok(())
}
