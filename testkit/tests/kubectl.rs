//! The real kubectl against the sample apiserver.

mod support;

use anyhow::{Context as _, ensure};
use serde_json::Value;
use support::{DEADLINE, start};
use tether_testkit::kubectl::Kubectl;

fn kubectl(fixture: &support::Fixture) -> anyhow::Result<Kubectl> {
    Ok(Kubectl::new(&fixture.server.kubeconfig_path())?)
}

#[tokio::test]
async fn version_reports_the_sample_server() -> anyhow::Result<()> {
    let fx = start().await?;
    let out = kubectl(&fx)?.run(&["version", "-o", "json"]).await?;
    ensure!(out.success(), "{out}");
    let v: Value = serde_json::from_str(&out.stdout)?;
    assert_eq!(v["serverVersion"]["gitVersion"], "v1.33.0-tether-sample");
    assert_eq!(v["serverVersion"]["minor"], "33");
    Ok(())
}

#[tokio::test]
async fn get_namespaces_lists_the_seeded_ones() -> anyhow::Result<()> {
    let fx = start().await?;
    let out = kubectl(&fx)?
        .run(&["get", "namespaces", "-o", "name"])
        .await?;
    ensure!(out.success(), "{out}");
    let names: Vec<&str> = out.stdout.lines().collect();
    assert_eq!(
        names,
        [
            "namespace/default",
            "namespace/kube-public",
            "namespace/kube-system"
        ]
    );
    // The human-readable table comes from the server's Table rendering.
    let out = kubectl(&fx)?.run(&["get", "pods"]).await?;
    ensure!(out.success(), "{out}");
    let row = out
        .stdout
        .lines()
        .find(|l| l.starts_with("demo"))
        .context("no demo row")?;
    assert_eq!(
        row.split_whitespace().take(4).collect::<Vec<_>>(),
        ["demo", "1/1", "Running", "0"]
    );
    Ok(())
}

#[tokio::test]
async fn create_get_delete_configmap() -> anyhow::Result<()> {
    let fx = start().await?;
    let k = kubectl(&fx)?;
    // `kubectl create configmap` writes protobuf.
    let out = k
        .run(&["create", "configmap", "x", "--from-literal=a=b"])
        .await?;
    ensure!(out.success(), "{out}");
    assert_eq!(out.stdout.trim(), "configmap/x created");
    let out = k.run(&["get", "configmap", "x", "-o", "json"]).await?;
    ensure!(out.success(), "{out}");
    let cm: Value = serde_json::from_str(&out.stdout)?;
    assert_eq!(cm["data"]["a"], "b");
    assert_eq!(cm["metadata"]["namespace"], "default");
    assert!(
        cm["metadata"]["generateName"].is_null(),
        "empty protobuf fields must not show: {cm}"
    );
    let out = k
        .run(&["create", "configmap", "x", "--from-literal=a=c"])
        .await?;
    assert!(!out.success());
    assert!(
        out.stderr.contains("configmaps \"x\" already exists"),
        "{out}"
    );
    let out = k.run(&["delete", "configmap", "x"]).await?;
    ensure!(out.success(), "{out}");
    assert_eq!(out.stdout.trim(), "configmap \"x\" deleted");
    let out = k.run(&["get", "configmap", "x"]).await?;
    assert!(!out.success());
    assert!(
        out.stderr
            .contains("Error from server (NotFound): configmaps \"x\" not found"),
        "{out}"
    );
    Ok(())
}

#[tokio::test]
async fn apply_twice_reports_configured() -> anyhow::Result<()> {
    let fx = start().await?;
    let k = kubectl(&fx)?;
    let file = fx.dir.path().join("cm.yaml");
    let manifest = |value: &str| {
        format!(
            "apiVersion: v1\nkind: ConfigMap\nmetadata:\n  name: applied\n  labels:\n    v: \"{value}\"\ndata:\n  key: \"{value}\"\n  stays: \"yes\"\n"
        )
    };
    std::fs::write(&file, manifest("1"))?;
    let path = file.to_string_lossy().into_owned();
    let out = k.run(&["apply", "-f", &path]).await?;
    ensure!(out.success(), "{out}");
    assert_eq!(out.stdout.trim(), "configmap/applied created");
    let out = k.run(&["apply", "-f", &path]).await?;
    ensure!(out.success(), "{out}");
    assert_eq!(out.stdout.trim(), "configmap/applied unchanged");
    std::fs::write(&file, manifest("2").replace("  stays: \"yes\"\n", ""))?;
    let out = k.run(&["apply", "-f", &path]).await?;
    ensure!(out.success(), "{out}");
    assert_eq!(out.stdout.trim(), "configmap/applied configured");
    let out = k
        .run(&["get", "configmap", "applied", "-o", "json"])
        .await?;
    let cm: Value = serde_json::from_str(&out.stdout)?;
    assert_eq!(
        cm["data"],
        serde_json::json!({"key": "2"}),
        "removed keys must be gone: {cm}"
    );
    assert_eq!(cm["metadata"]["labels"]["v"], "2");
    Ok(())
}

#[tokio::test]
async fn watch_sees_a_create_from_another_client() -> anyhow::Result<()> {
    let fx = start().await?;
    let k = kubectl(&fx)?;
    let out = k.run(&["create", "configmap", "before"]).await?;
    ensure!(out.success(), "{out}");
    let mut watch = k.spawn(&["get", "configmaps", "--watch"])?;
    // The initial list is printed first; anything after it comes from the watch.
    watch
        .wait_for_line(DEADLINE, |l| l.starts_with("before"))
        .await?;
    let other = kubectl(&fx)?;
    let out = other
        .run(&[
            "create",
            "configmap",
            "made-elsewhere",
            "--from-literal=k=v",
        ])
        .await?;
    ensure!(out.success(), "{out}");
    let line = watch
        .wait_for_line(DEADLINE, |l| l.starts_with("made-elsewhere"))
        .await?;
    assert_eq!(
        line.split_whitespace().nth(1),
        Some("1"),
        "DATA column: {line}"
    );
    watch.kill().await?;
    Ok(())
}

#[tokio::test]
async fn logs_follow_streams_ticks() -> anyhow::Result<()> {
    let fx = start().await?;
    let k = kubectl(&fx)?;
    let mut logs = k.spawn(&["logs", "-f", "demo"])?;
    let first = logs
        .wait_for_line(DEADLINE, |l| l.starts_with("tick "))
        .await?;
    let second = logs
        .wait_for_line(DEADLINE, |l| l.starts_with("tick "))
        .await?;
    let n = |l: &str| {
        l.split_whitespace()
            .nth(1)
            .and_then(|n| n.parse::<u64>().ok())
    };
    assert_eq!(n(&second), n(&first).map(|n| n + 1), "{first} / {second}");
    logs.kill().await?;
    let out = k.run(&["logs", "demo", "--tail=1", "--timestamps"]).await?;
    ensure!(out.success(), "{out}");
    assert_eq!(out.stdout.lines().count(), 1, "{out}");
    Ok(())
}

#[tokio::test]
async fn exec_cat_echoes_stdin_and_exits_zero() -> anyhow::Result<()> {
    let fx = start().await?;
    let out = kubectl(&fx)?
        .run_with_stdin(&["exec", "-i", "demo", "--", "cat"], b"hi\n")
        .await?;
    ensure!(out.success(), "{out}");
    assert_eq!(out.stdout, "hi\n");
    Ok(())
}

#[tokio::test]
async fn exec_exit_status_is_kubectls_exit_status() -> anyhow::Result<()> {
    let fx = start().await?;
    let k = kubectl(&fx)?;
    let out = k.run(&["exec", "demo", "--", "sh", "-c", "exit 3"]).await?;
    assert_eq!(out.code(), Some(3), "{out}");
    let out = k.run(&["exec", "demo", "--", "no-such-command"]).await?;
    assert_eq!(out.code(), Some(127), "{out}");
    let out = k
        .run(&[
            "exec",
            "demo",
            "--",
            "sh",
            "-c",
            "echo to-out; echo to-err >&2",
        ])
        .await?;
    ensure!(out.success(), "{out}");
    assert_eq!(
        (out.stdout.as_str(), out.stderr.as_str()),
        ("to-out\n", "to-err\n")
    );
    Ok(())
}

#[tokio::test]
async fn chunked_list_of_5000_configmaps() -> anyhow::Result<()> {
    let fx = start().await?;
    fx.server.create_configmaps("bulk", "cm-", 5000);
    let out = kubectl(&fx)?
        .run(&[
            "get",
            "configmaps",
            "-n",
            "bulk",
            "--chunk-size=500",
            "-o",
            "name",
            "-v=6",
        ])
        .await?;
    ensure!(
        out.success(),
        "{}",
        out.stderr.lines().last().unwrap_or_default()
    );
    let names: std::collections::BTreeSet<&str> = out.stdout.lines().collect();
    assert_eq!(out.stdout.lines().count(), 5000);
    assert_eq!(names.len(), 5000, "no duplicates");
    // Ten pages: the first, then nine that follow continue tokens.
    let pages = out
        .stderr
        .lines()
        .filter(|l| l.contains("limit=500"))
        .count();
    let continued = out
        .stderr
        .lines()
        .filter(|l| l.contains("continue="))
        .count();
    assert_eq!((pages, continued), (10, 9));
    Ok(())
}

#[tokio::test]
async fn a_wrong_token_is_unauthorized() -> anyhow::Result<()> {
    let fx = start().await?;
    let text = std::fs::read_to_string(fx.server.kubeconfig_path())?;
    let bad = text.replace(fx.server.token(), "not-the-token");
    ensure!(bad != text);
    let path = fx.dir.path().join("bad-kubeconfig");
    std::fs::write(&path, bad)?;
    let k = Kubectl::new(&path)?;
    let seen = fx.server.requests_seen();
    let out = k.run(&["get", "--raw", "/api/v1/namespaces"]).await?;
    assert!(!out.success());
    assert!(
        out.stderr
            .contains("error: You must be logged in to the server (Unauthorized)"),
        "{out}"
    );
    let out = k.run(&["get", "configmaps"]).await?;
    assert!(!out.success());
    assert!(
        out.stderr.contains("You must be logged in to the server"),
        "{out}"
    );
    assert!(fx.server.requests_seen() > seen);
    Ok(())
}

#[tokio::test]
async fn run_creates_a_pod_that_logs_and_execs() -> anyhow::Result<()> {
    let fx = start().await?;
    let k = kubectl(&fx)?;
    // `kubectl run` writes the pod as protobuf.
    let out = k
        .run(&[
            "run",
            "web",
            "--image=nginx:1.27",
            "--labels=app=web",
            "--env=A=b",
        ])
        .await?;
    ensure!(out.success(), "{out}");
    let out = k
        .run(&[
            "get",
            "pods",
            "-l",
            "app=web",
            "-o",
            "jsonpath={.items[*].status.phase}",
        ])
        .await?;
    assert_eq!(out.stdout, "Running", "{out}");
    let out = k.run(&["logs", "web"]).await?;
    assert_eq!(
        out.stdout, "started container web (image nginx:1.27)\n",
        "{out}"
    );
    let out = k.run(&["exec", "web", "--", "hostname"]).await?;
    assert_eq!(out.stdout, "web\n", "{out}");
    let out = k.run(&["delete", "pod", "web"]).await?;
    ensure!(out.success(), "{out}");
    Ok(())
}

#[tokio::test]
async fn auth_whoami_names_the_token_user() -> anyhow::Result<()> {
    let fx = start().await?;
    let out = kubectl(&fx)?.run(&["auth", "whoami", "-o", "json"]).await?;
    ensure!(out.success(), "{out}");
    let review: Value = serde_json::from_str(&out.stdout)?;
    assert_eq!(review["status"]["userInfo"]["username"], "admin");
    assert_eq!(
        review["status"]["userInfo"]["groups"],
        serde_json::json!(["system:masters", "system:authenticated"])
    );

    fx.server.add_token("bob-token", "bob", &["dev"]);
    let text = std::fs::read_to_string(fx.server.kubeconfig_path())?
        .replace(fx.server.token(), "bob-token");
    let path = fx.dir.path().join("bob-kubeconfig");
    std::fs::write(&path, text)?;
    let out = Kubectl::new(&path)?
        .run(&[
            "auth",
            "whoami",
            "-o",
            "jsonpath={.status.userInfo.username}",
        ])
        .await?;
    ensure!(out.success(), "{out}");
    assert_eq!(out.stdout, "bob");
    Ok(())
}

#[tokio::test]
async fn secrets_services_and_service_accounts_with_kubectl() -> anyhow::Result<()> {
    let fx = start().await?;
    let k = kubectl(&fx)?;
    let ok = |out: &tether_testkit::kubectl::Output| -> anyhow::Result<()> {
        ensure!(out.success(), "{out}");
        Ok(())
    };
    // `create secret` and `create serviceaccount` write protobuf.
    let out = k
        .run(&[
            "create",
            "secret",
            "generic",
            "db",
            "--from-literal=password=hunter2",
        ])
        .await?;
    ok(&out)?;
    assert_eq!(out.stdout.trim(), "secret/db created");
    let out = k.run(&["get", "secrets"]).await?;
    ok(&out)?;
    let row = out
        .stdout
        .lines()
        .find(|l| l.starts_with("db "))
        .context("no db row")?;
    assert_eq!(
        row.split_whitespace().take(3).collect::<Vec<_>>(),
        ["db", "Opaque", "1"]
    );
    let out = k
        .run(&["get", "secret", "db", "-o", "jsonpath={.data.password}"])
        .await?;
    ok(&out)?;
    assert_eq!(out.stdout.trim(), "aHVudGVyMg==");
    let out = k.run(&["describe", "secret", "db"]).await?;
    ok(&out)?;
    assert!(out.stdout.contains("password:  7 bytes"), "{out}");

    let out = k
        .run(&["create", "service", "clusterip", "web", "--tcp=8080:80"])
        .await?;
    ok(&out)?;
    let out = k.run(&["get", "svc"]).await?;
    ok(&out)?;
    let web = out
        .stdout
        .lines()
        .find(|l| l.starts_with("web "))
        .context("no web row")?;
    let cells: Vec<&str> = web.split_whitespace().collect();
    assert_eq!(cells[1], "ClusterIP");
    assert_eq!(cells[4], "8080/TCP");
    assert!(out.stdout.contains("kubernetes "), "{out}");
    let out = k.run(&["describe", "svc", "demo"]).await?;
    ok(&out)?;
    assert!(out.stdout.contains("app=demo"), "{out}");

    let out = k.run(&["create", "serviceaccount", "robot"]).await?;
    ok(&out)?;
    let out = k.run(&["get", "sa", "-o", "name"]).await?;
    ok(&out)?;
    let names: Vec<&str> = out.stdout.lines().collect();
    assert_eq!(names, ["serviceaccount/default", "serviceaccount/robot"]);
    let out = k.run(&["get", "events", "-A"]).await?;
    ok(&out)?;
    Ok(())
}

/// Sends `data` through `addr` (a forwarded echo port), half-closes, and returns what came back.
async fn echo_through(addr: std::net::SocketAddr, data: &[u8]) -> anyhow::Result<Vec<u8>> {
    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
    let tcp = tokio::net::TcpStream::connect(addr).await?;
    let (mut rd, mut wr) = tcp.into_split();
    let send = async {
        wr.write_all(data).await?;
        wr.shutdown().await?;
        anyhow::Ok(())
    };
    let receive = async {
        let mut back = Vec::with_capacity(data.len());
        rd.read_to_end(&mut back).await?;
        anyhow::Ok(back)
    };
    let (sent, back) = tokio::time::timeout(DEADLINE, async { tokio::join!(send, receive) })
        .await
        .context("echo through port-forward timed out")?;
    sent?;
    back
}

async fn port_forward_10_mib(binary: Option<std::path::PathBuf>) -> anyhow::Result<()> {
    let fx = start().await?;
    let mut k = kubectl(&fx)?;
    if let Some(binary) = binary {
        k = k.with_binary(binary);
    }
    let mut child = k.spawn(&["port-forward", "pod/demo", ":7", ":80"])?;
    let echo = child.forwarded_address(DEADLINE).await?;
    let data: Vec<u8> = (0..10 * 1024 * 1024u32)
        .map(|i| (i.wrapping_mul(2_654_435_761) >> 13) as u8)
        .collect();
    let back = echo_through(echo, &data).await?;
    assert_eq!(back.len(), data.len());
    assert!(back == data, "10 MiB came back altered");
    // A second connection through the same session, to the HTTP port.
    let http = child.forwarded_address(DEADLINE).await?;
    let reply = echo_through(
        http,
        b"GET /hello HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n",
    )
    .await?;
    let reply = String::from_utf8_lossy(&reply);
    assert!(
        reply.starts_with("HTTP/1.1 200 OK"),
        "{reply}; stderr: {}",
        child.stderr()
    );
    assert!(reply.contains("GET /hello"), "{reply}");
    child.kill().await?;
    Ok(())
}

#[tokio::test]
async fn port_forward_over_websocket_carries_10_mib_exactly() -> anyhow::Result<()> {
    port_forward_10_mib(None).await
}

#[tokio::test]
async fn port_forward_over_spdy_carries_10_mib_exactly() -> anyhow::Result<()> {
    let Some(old) = tether_testkit::kubectl::versioned(29) else {
        anyhow::ensure!(
            std::env::var_os("CI").is_none(),
            "kubectl 1.29 is missing (scripts/install-test-deps.sh installs the Cloud SDK kubectls)"
        );
        eprintln!("skipping: no kubectl.1.29");
        return Ok(());
    };
    port_forward_10_mib(Some(old)).await
}

#[tokio::test]
async fn cp_5_mib_both_ways_and_attach() -> anyhow::Result<()> {
    let fx = start().await?;
    let k = kubectl(&fx)?;
    let local = fx.dir.path().join("upload.bin");
    let data: Vec<u8> = (0..5 * 1024 * 1024u32)
        .map(|i| (i.wrapping_mul(2_246_822_519) >> 7) as u8)
        .collect();
    std::fs::write(&local, &data)?;
    let local_arg = local.display().to_string();
    let out = k.run(&["cp", &local_arg, "demo:/tmp/upload.bin"]).await?;
    ensure!(out.success(), "cp to pod: {out}");
    let back = fx.dir.path().join("download.bin");
    let back_arg = back.display().to_string();
    let out = k.run(&["cp", "demo:/tmp/upload.bin", &back_arg]).await?;
    ensure!(out.success(), "cp from pod: {out}");
    let got = std::fs::read(&back)?;
    assert_eq!(got.len(), data.len());
    assert!(got == data, "the 5 MiB file came back altered");
    // Into a directory: the file keeps its name.
    let out = k.run(&["cp", &local_arg, "demo:/tmp"]).await?;
    ensure!(out.success(), "cp into a directory: {out}");
    let out = k
        .run(&["exec", "demo", "--", "test", "-f", "/tmp/upload.bin"])
        .await?;
    ensure!(out.success(), "{out}");

    let out = k
        .run_with_stdin(&["attach", "-i", "demo"], b"hello attach\n")
        .await?;
    ensure!(out.success(), "attach: {out}");
    assert!(out.stdout.contains("hello attach"), "{out}");
    Ok(())
}

/// What a hostile archive or path could do with `kubectl cp`, refused inside the pod's scratch directory.
#[tokio::test]
async fn cp_cannot_escape_the_pod_filesystem() -> anyhow::Result<()> {
    let fx = start().await?;
    let k = kubectl(&fx)?;
    let outside = fx.dir.path().join("outside");
    std::fs::create_dir_all(&outside)?;
    std::fs::write(outside.join("secret"), "host file")?;
    // An archive with a symlink out of the pod, then a file through it.
    let staging = tempfile::tempdir()?;
    std::os::unix::fs::symlink(&outside, staging.path().join("evil"))?;
    let archive = fx.dir.path().join("evil.tar");
    let status = std::process::Command::new("tar")
        .arg("-cf")
        .arg(&archive)
        .arg("-C")
        .arg(staging.path())
        .arg("evil")
        .status()?;
    ensure!(status.success());
    std::fs::remove_file(staging.path().join("evil"))?;
    std::fs::create_dir(staging.path().join("evil"))?;
    std::fs::write(staging.path().join("evil/pwned"), "pwned")?;
    let status = std::process::Command::new("tar")
        .arg("-rf")
        .arg(&archive)
        .arg("-C")
        .arg(staging.path())
        .arg("evil/pwned")
        .status()?;
    ensure!(status.success());
    let tar_bytes = std::fs::read(&archive)?;
    let out = k
        .run_with_stdin(
            &["exec", "-i", "demo", "--", "tar", "-xmf", "-", "-C", "/tmp"],
            &tar_bytes,
        )
        .await?;
    assert!(
        !out.success(),
        "extracting through a symlink must fail: {out}"
    );
    assert!(!outside.join("pwned").exists(), "tar wrote outside the pod");
    // Reading through the planted symlink, or with .., or with options that run programs.
    for args in [
        &["tar", "cf", "-", "/tmp/evil/secret"][..],
        &["tar", "cf", "-", "/tmp/../../outside"],
        &["tar", "-cf", "-", "--to-command=sh", "/tmp"],
        &["tar", "-xf", "/etc/passwd"],
    ] {
        let mut full = vec!["exec", "demo", "--"];
        full.extend_from_slice(args);
        let out = k.run(&full).await?;
        assert!(!out.success(), "{args:?} must fail: {out}");
        assert!(!out.stdout.contains("host file"), "{args:?} leaked: {out}");
    }
    let out = k.run(&["cp", "demo:/tmp/evil/secret", "x"]).await?;
    assert!(!out.success() || !fx.dir.path().join("x").exists(), "{out}");
    Ok(())
}

#[tokio::test]
async fn deployments_scale_and_rbac_objects_with_kubectl() -> anyhow::Result<()> {
    let fx = start().await?;
    let k = kubectl(&fx)?;
    let ok = |out: &tether_testkit::kubectl::Output| -> anyhow::Result<()> {
        ensure!(out.success(), "{out}");
        Ok(())
    };
    // `create deployment` writes protobuf.
    let out = k
        .run(&[
            "create",
            "deployment",
            "web",
            "--image=nginx:1.27",
            "--replicas=2",
        ])
        .await?;
    ok(&out)?;
    let out = k.run(&["get", "deploy"]).await?;
    ok(&out)?;
    let row = out
        .stdout
        .lines()
        .find(|l| l.starts_with("web "))
        .context("no web row")?;
    assert_eq!(
        row.split_whitespace().take(4).collect::<Vec<_>>(),
        ["web", "2/2", "2", "2"]
    );
    let out = k.run(&["scale", "deploy", "web", "--replicas=4"]).await?;
    ok(&out)?;
    assert_eq!(out.stdout.trim(), "deployment.apps/web scaled");
    let out = k
        .run(&["get", "pods", "-l", "app=web", "-o", "name"])
        .await?;
    ok(&out)?;
    assert_eq!(out.stdout.lines().count(), 4, "{out}");
    let out = k.run(&["get", "rs", "-o", "name"]).await?;
    ok(&out)?;
    assert_eq!(out.stdout.lines().count(), 1, "{out}");
    let out = k.run(&["describe", "deploy", "web"]).await?;
    ok(&out)?;
    assert!(out.stdout.contains("4 desired"), "{out}");
    let out = k
        .run(&[
            "get",
            "deploy",
            "web",
            "-o",
            "jsonpath={.status.readyReplicas}",
        ])
        .await?;
    ok(&out)?;
    assert_eq!(out.stdout.trim(), "4");
    let out = k.run(&["delete", "deploy", "web"]).await?;
    ok(&out)?;
    let out = k
        .run(&["get", "pods", "-l", "app=web", "-o", "name"])
        .await?;
    ok(&out)?;
    assert_eq!(out.stdout.trim(), "", "pods outlived their deployment");

    // apply a deployment from YAML, then change it.
    let manifest = fx.dir.path().join("api.yaml");
    let write = |replicas: u32| {
        std::fs::write(
            &manifest,
            format!(
                "apiVersion: apps/v1\nkind: Deployment\nmetadata:\n  name: api\nspec:\n  replicas: {replicas}\n  \
                 selector:\n    matchLabels:\n      app: api\n  template:\n    metadata:\n      labels:\n        app: api\n    \
                 spec:\n      containers:\n      - name: api\n        image: api:1\n"
            ),
        )
    };
    write(1)?;
    let file = manifest.display().to_string();
    ok(&k.run(&["apply", "-f", &file]).await?)?;
    write(3)?;
    let out = k.run(&["apply", "-f", &file]).await?;
    ok(&out)?;
    assert!(
        out.stdout.contains("deployment.apps/api configured"),
        "{out}"
    );
    let out = k
        .run(&["get", "pods", "-l", "app=api", "-o", "name"])
        .await?;
    assert_eq!(out.stdout.lines().count(), 3, "{out}");

    // RBAC objects are stored (the built-in authorizer does not read them).
    ok(&k
        .run(&[
            "create",
            "role",
            "pod-reader",
            "--verb=get,list",
            "--resource=pods",
        ])
        .await?)?;
    ok(&k
        .run(&[
            "create",
            "rolebinding",
            "bob-reads",
            "--role=pod-reader",
            "--user=bob",
        ])
        .await?)?;
    ok(&k
        .run(&[
            "create",
            "clusterrole",
            "node-reader",
            "--verb=get",
            "--resource=nodes",
        ])
        .await?)?;
    let out = k.run(&["get", "rolebindings"]).await?;
    ok(&out)?;
    assert!(out.stdout.contains("Role/pod-reader"), "{out}");
    let out = k
        .run(&[
            "get",
            "role",
            "pod-reader",
            "-o",
            "jsonpath={.rules[0].verbs}",
        ])
        .await?;
    ok(&out)?;
    assert!(out.stdout.contains("list"), "{out}");
    let out = k.run(&["get", "clusterroles", "-o", "name"]).await?;
    assert!(
        out.stdout
            .contains("clusterrole.rbac.authorization.k8s.io/node-reader"),
        "{out}"
    );
    Ok(())
}
