//! The real kubectl through the relay, the tunnel and the agent to the sample apiserver.

mod common;

use std::time::Duration;

use common::{Env, eventually};

const WAIT: Duration = Duration::from_secs(30);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn version_and_namespaces() -> anyhow::Result<()> {
    let env = Env::start().await?;
    let kubectl = env.kubectl()?;
    let out = kubectl.run(&["version", "-o", "json"]).await?;
    anyhow::ensure!(
        out.status.success(),
        "kubectl version failed: {}",
        out.stderr
    );
    let version: serde_json::Value = serde_json::from_str(&out.stdout)?;
    assert!(
        version["serverVersion"]["gitVersion"]
            .as_str()
            .is_some_and(|v| v.starts_with("v1.")),
        "{version}"
    );

    let out = kubectl.run(&["get", "namespaces", "-o", "name"]).await?;
    anyhow::ensure!(
        out.status.success(),
        "kubectl get namespaces failed: {}",
        out.stderr
    );
    assert!(
        out.stdout.lines().any(|l| l == "namespace/default"),
        "{}",
        out.stdout
    );
    assert!(
        out.stdout.lines().any(|l| l == "namespace/kube-system"),
        "{}",
        out.stdout
    );
    env.up.shutdown().await?;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn configmap_create_get_delete() -> anyhow::Result<()> {
    let env = Env::start().await?;
    let kubectl = env.kubectl()?;
    let out = kubectl
        .run(&[
            "create",
            "configmap",
            "greeting",
            "--from-literal=hello=world",
        ])
        .await?;
    anyhow::ensure!(out.status.success(), "create failed: {}", out.stderr);
    let out = kubectl
        .run(&[
            "get",
            "configmap",
            "greeting",
            "-o",
            "jsonpath={.data.hello}",
        ])
        .await?;
    assert_eq!(out.stdout.trim(), "world", "{}", out.stderr);
    let out = kubectl.run(&["delete", "configmap", "greeting"]).await?;
    anyhow::ensure!(out.status.success(), "delete failed: {}", out.stderr);
    let out = kubectl.run(&["get", "configmap", "greeting"]).await?;
    assert!(!out.status.success());
    assert!(out.stderr.contains("not found"), "{}", out.stderr);
    env.up.shutdown().await?;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn apply_twice_with_a_change() -> anyhow::Result<()> {
    let env = Env::start().await?;
    let kubectl = env.kubectl()?;
    let manifest = env.dir.path().join("cm.yaml");
    let write = |value: &str| {
        std::fs::write(
            &manifest,
            format!(
                "apiVersion: v1\nkind: ConfigMap\nmetadata:\n  name: settings\n  namespace: default\ndata:\n  mode: {value}\n"
            ),
        )
    };
    write("blue")?;
    let path = manifest.to_string_lossy().to_string();
    let out = kubectl.run(&["apply", "-f", &path]).await?;
    anyhow::ensure!(out.status.success(), "first apply failed: {}", out.stderr);
    assert!(out.stdout.contains("created"), "{}", out.stdout);
    write("green")?;
    let out = kubectl.run(&["apply", "-f", &path]).await?;
    anyhow::ensure!(out.status.success(), "second apply failed: {}", out.stderr);
    assert!(out.stdout.contains("configured"), "{}", out.stdout);
    let out = kubectl
        .run(&[
            "get",
            "configmap",
            "settings",
            "-o",
            "jsonpath={.data.mode}",
        ])
        .await?;
    assert_eq!(out.stdout.trim(), "green");
    env.up.shutdown().await?;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn watch_sees_an_event_made_by_another_client() -> anyhow::Result<()> {
    let env = Env::start().await?;
    let kubectl = env.kubectl()?;
    let mut watch = kubectl.spawn(&["get", "configmaps", "-w", "-o", "name"])?;
    // The watch is established once the (empty) initial list was printed or the request is in flight; creating
    // the object until it shows up covers both orders.
    let mut seen = false;
    for attempt in 0..10 {
        let name = format!("watched-{attempt}");
        let out = kubectl.run(&["create", "configmap", &name]).await?;
        anyhow::ensure!(out.status.success(), "create failed: {}", out.stderr);
        if watch
            .wait_for_line(Duration::from_secs(5), |l| l.contains("watched-"))
            .await
            .is_ok()
        {
            seen = true;
            break;
        }
    }
    assert!(
        seen,
        "the watch never printed the configmap another client created"
    );
    drop(watch);
    env.up.shutdown().await?;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn logs_follow_streams() -> anyhow::Result<()> {
    let env = Env::start().await?;
    let kubectl = env.kubectl()?;
    let mut logs = kubectl.spawn(&["logs", "-f", "demo"])?;
    let first = logs.wait_for_line(WAIT, |l| l.contains("tick")).await?;
    // A line produced after the first one proves the response is streamed, not buffered until the end.
    let second = logs
        .wait_for_line(WAIT, |l| l.contains("tick") && l != first)
        .await;
    assert!(
        second.is_ok(),
        "logs -f did not stream a second line: {second:?}"
    );
    drop(logs);
    env.up.shutdown().await?;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn exec_with_stdin_prints_and_exits() -> anyhow::Result<()> {
    let env = Env::start().await?;
    let kubectl = env.kubectl()?;
    let out = kubectl
        .run_with_stdin(&["exec", "-i", "demo", "--", "cat"], b"hi\n")
        .await?;
    anyhow::ensure!(out.status.success(), "exec failed: {}", out.stderr);
    assert_eq!(out.stdout, "hi\n");
    let out = kubectl
        .run(&["exec", "demo", "--", "sh", "-c", "exit 3"])
        .await?;
    assert_eq!(out.code(), Some(3), "{}", out.stderr);
    env.up.shutdown().await?;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_list_of_5000_configmaps() -> anyhow::Result<()> {
    let env = Env::start().await?;
    env.sample()?.create_configmaps("default", "bulk", 5000);
    let out = env
        .kubectl()?
        .run(&["get", "configmaps", "-o", "name"])
        .await?;
    anyhow::ensure!(out.status.success(), "list failed: {}", out.stderr);
    let count = out
        .stdout
        .lines()
        .filter(|l| l.starts_with("configmap/bulk"))
        .count();
    assert_eq!(count, 5000);
    env.up.shutdown().await?;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fifty_kubectl_runs_in_parallel() -> anyhow::Result<()> {
    let env = Env::start().await?;
    let kubectl = env.kubectl()?;
    let runs = (0..50).map(|_| kubectl.run(&["get", "namespaces", "-o", "name"]));
    let results = futures_util::future::join_all(runs).await;
    for out in results {
        let out = out?;
        anyhow::ensure!(
            out.status.success(),
            "a parallel run failed: {}",
            out.stderr
        );
        assert!(out.stdout.contains("namespace/default"));
    }
    env.up.shutdown().await?;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unknown_cluster_and_stopped_agent_fail_clearly() -> anyhow::Result<()> {
    let mut env = Env::start().await?;
    let token = env.up.user_token.clone();
    let other = env.kubeconfig_for("no-such-cluster", token.as_deref())?;
    let out = tether_testkit::kubectl::Kubectl::new(&other)?
        .run(&["get", "namespaces"])
        .await?;
    assert!(!out.status.success());
    assert!(
        out.stderr
            .contains("clusters \"no-such-cluster\" not found"),
        "{}",
        out.stderr
    );

    env.up.stop_agent().await?;
    let connected = env.up.client()?.show_cluster("demo").await?;
    assert!(!connected.connected, "{connected:?}");
    let out = env.kubectl()?.run(&["get", "namespaces"]).await?;
    assert!(!out.status.success());
    assert!(out.stderr.contains("not connected"), "{}", out.stderr);
    env.up.shutdown().await?;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn relay_restart_then_the_agent_comes_back_by_itself() -> anyhow::Result<()> {
    let mut env = Env::start().await?;
    let kubectl = env.kubectl()?;
    env.up.stop_relay().await?;
    let out = kubectl.run(&["get", "namespaces"]).await?;
    assert!(!out.status.success(), "kubectl worked with the relay down");
    env.up.start_relay().await?;
    let back = eventually(Duration::from_secs(60), || async {
        kubectl
            .run(&["get", "namespaces", "-o", "name"])
            .await
            .is_ok_and(|o| o.status.success())
    })
    .await;
    assert!(back, "kubectl did not work again after the relay restarted");
    env.up.shutdown().await?;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_without_credential_never_reaches_the_cluster() -> anyhow::Result<()> {
    let env = Env::start().await?;
    let anonymous = env.kubeconfig_for("demo", None)?;
    // The agent's own metadata watch makes requests of its own, so count only the unauthenticated ones.
    assert_eq!(env.sample()?.unauthenticated_requests(), 0);
    let out = tether_testkit::kubectl::Kubectl::new(&anonymous)?
        .run(&["get", "namespaces"])
        .await?;
    // kubectl, answered 401 with no credential configured, asks for a username (as with any apiserver) and
    // fails on the closed stdin; what matters is that nothing reached the cluster.
    assert!(!out.status.success(), "{}", out.stdout);
    assert_eq!(
        env.sample()?.unauthenticated_requests(),
        0,
        "an unauthenticated request reached the apiserver"
    );
    env.up.shutdown().await?;
    Ok(())
}
