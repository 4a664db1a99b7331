//! The sample cluster a newcomer meets, through the relay, the tunnel and the agent with the real kubectl:
//! secrets, services, describe, apply, and `kubectl port-forward` over a WebSocket (kubectl 1.33) and over SPDY
//! (kubectl 1.29) carrying 10 MiB byte-exact.

mod common;

use std::net::SocketAddr;
use std::time::Duration;

use anyhow::{Context as _, ensure};
use common::Env;
use tether_testkit::kubectl::{Kubectl, Output};
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};

/// A deadline for each step (not a timing assertion).
const WAIT: Duration = Duration::from_secs(60);

async fn ok(kubectl: &Kubectl, args: &[&str]) -> anyhow::Result<Output> {
    let out = kubectl.run(args).await?;
    ensure!(out.success(), "kubectl {} failed: {out}", args.join(" "));
    Ok(out)
}

/// The data row of `kubectl get` output whose first cell is `name`, split into cells.
fn row(out: &Output, name: &str) -> anyhow::Result<Vec<String>> {
    out.stdout
        .lines()
        .map(|l| l.split_whitespace().map(str::to_string).collect::<Vec<_>>())
        .find(|cells| cells.first().is_some_and(|c| c == name))
        .with_context(|| format!("no row {name} in {out}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn secrets_services_describe_and_apply_through_the_relay() -> anyhow::Result<()> {
    let env = Env::start().await?;
    let k = env.kubectl()?;
    let out = ok(
        &k,
        &[
            "create",
            "secret",
            "generic",
            "db",
            "--from-literal=password=hunter2",
        ],
    )
    .await?;
    assert_eq!(out.stdout.trim(), "secret/db created");
    let out = ok(&k, &["get", "secrets"]).await?;
    assert_eq!(row(&out, "db")?[..3], ["db", "Opaque", "1"]);
    assert_eq!(row(&out, "demo-credentials")?[1], "Opaque");
    let out = ok(
        &k,
        &["get", "secret", "db", "-o", "jsonpath={.data.password}"],
    )
    .await?;
    assert_eq!(out.stdout.trim(), "aHVudGVyMg==");
    let out = ok(&k, &["describe", "secret", "db"]).await?;
    assert!(out.stdout.contains("password:  7 bytes"), "{out}");

    let out = ok(&k, &["get", "svc"]).await?;
    let demo = row(&out, "demo")?;
    assert_eq!(demo[1], "ClusterIP");
    assert_eq!(demo[4], "80/TCP,7/TCP");
    let out = ok(&k, &["describe", "pod", "demo"]).await?;
    assert!(
        out.stdout.contains("Status:") && out.stdout.contains("Running"),
        "{out}"
    );

    // apply creates, then patches what changed.
    let manifest = env.dir.path().join("app.yaml");
    let write = |replicas: &str| {
        std::fs::write(
            &manifest,
            format!(
                "apiVersion: v1\nkind: ConfigMap\nmetadata:\n  name: app\ndata:\n  replicas: \"{replicas}\"\n---\n\
                 apiVersion: v1\nkind: Service\nmetadata:\n  name: app\nspec:\n  selector:\n    app: app\n  ports:\n  - port: 8080\n"
            ),
        )
    };
    write("1")?;
    let file = manifest.display().to_string();
    let out = ok(&k, &["apply", "-f", &file]).await?;
    assert!(out.stdout.contains("configmap/app created"), "{out}");
    assert!(out.stdout.contains("service/app created"), "{out}");
    write("3")?;
    let out = ok(&k, &["apply", "-f", &file]).await?;
    assert!(out.stdout.contains("configmap/app configured"), "{out}");
    assert!(out.stdout.contains("service/app unchanged"), "{out}");
    let out = ok(&k, &["get", "cm", "app", "-o", "jsonpath={.data.replicas}"]).await?;
    assert_eq!(out.stdout.trim(), "3");
    let out = ok(&k, &["get", "svc", "app", "-o", "yaml"]).await?;
    assert!(out.stdout.contains("clusterIP: 10.96."), "{out}");
    ok(&k, &["delete", "-f", &file]).await?;
    env.up.shutdown().await?;
    Ok(())
}

/// Sends `data` through `addr`, half-closes, and returns everything that came back.
async fn through(addr: SocketAddr, data: &[u8]) -> anyhow::Result<Vec<u8>> {
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
    let (sent, back) = tokio::time::timeout(WAIT, async { tokio::join!(send, receive) })
        .await
        .context("nothing came back through the port-forward in time")?;
    sent?;
    back
}

async fn port_forward_through_the_relay(kubectl: Kubectl) -> anyhow::Result<()> {
    let mut child = kubectl.spawn(&["port-forward", "pod/demo", ":7", ":80"])?;
    let echo = child.forwarded_address(WAIT).await?;
    let data: Vec<u8> = (0..10 * 1024 * 1024u32)
        .map(|i| (i.wrapping_mul(2_654_435_761) >> 11) as u8)
        .collect();
    let back = through(echo, &data).await?;
    assert_eq!(back.len(), data.len(), "stderr: {}", child.stderr());
    assert!(back == data, "the 10 MiB came back altered");
    let http = child.forwarded_address(WAIT).await?;
    let reply = through(http, b"GET /tour HTTP/1.1\r\nHost: demo\r\n\r\n").await?;
    let reply = String::from_utf8_lossy(&reply);
    assert!(reply.starts_with("HTTP/1.1 200 OK"), "{reply}");
    assert!(reply.contains("GET /tour"), "{reply}");
    child.kill().await?;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn port_forward_over_websocket_through_the_relay() -> anyhow::Result<()> {
    let env = Env::start().await?;
    port_forward_through_the_relay(env.kubectl()?).await?;
    env.up.shutdown().await?;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn port_forward_over_spdy_through_the_relay() -> anyhow::Result<()> {
    let Some(kubectl_1_29) = tether_testkit::kubectl::versioned(29) else {
        ensure!(
            std::env::var_os("CI").is_none(),
            "kubectl 1.29 is missing: SPDY port-forward cannot be tested"
        );
        eprintln!("skipping: no kubectl 1.29 (it port-forwards over SPDY only)");
        return Ok(());
    };
    let env = Env::start().await?;
    port_forward_through_the_relay(env.kubectl()?.with_binary(kubectl_1_29)).await?;
    env.up.shutdown().await?;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cp_5_mib_both_ways_and_attach_through_the_relay() -> anyhow::Result<()> {
    let env = Env::start().await?;
    let k = env.kubectl()?;
    let upload = env.dir.path().join("upload.bin");
    let data: Vec<u8> = (0..5 * 1024 * 1024u32)
        .map(|i| (i.wrapping_mul(2_246_822_519) >> 9) as u8)
        .collect();
    std::fs::write(&upload, &data)?;
    ok(
        &k,
        &["cp", &upload.display().to_string(), "demo:/tmp/upload.bin"],
    )
    .await?;
    let download = env.dir.path().join("download.bin");
    ok(
        &k,
        &[
            "cp",
            "demo:/tmp/upload.bin",
            &download.display().to_string(),
        ],
    )
    .await?;
    let back = std::fs::read(&download)?;
    assert_eq!(back.len(), data.len());
    assert!(back == data, "the 5 MiB file came back altered");
    let out = k
        .run_with_stdin(&["attach", "-i", "demo"], b"through the tunnel\n")
        .await?;
    ensure!(out.success(), "attach: {out}");
    assert!(out.stdout.contains("through the tunnel"), "{out}");
    env.up.shutdown().await?;
    Ok(())
}
