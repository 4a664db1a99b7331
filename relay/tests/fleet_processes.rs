//! The relay fleet with real processes (issue 11): two `tether-relay` processes on one real PostgreSQL
//! (`tether_testkit::postgres`), sharing the agent CA, the server CA and the admin token as the Helm chart's
//! "fleet" values have them share; the real `tether-agent` with the sample apiserver
//! (`tether-sample-apiserver`) connected to replica A only; the real kubectl through replica B.
//!
//! Shows: kubectl `get`, `get -w` (an event arrives) and `exec` through B reach the cluster whose only tunnel
//! is on A (peer forwarding); a role assignment made at A reaches an agent connected to B (its
//! `guardSnapshot`) within 2 s; after SIGKILL of A, B stops routing to A's tunnels within 10 s (its lease
//! lapses; the seconds measured are printed as `FLEET …` lines), and kubectl through B then gets a prompt
//! "not connected" instead of hanging. Every wait has a deadline; PostgreSQL and kubectl missing fail under CI.

mod common;

use std::net::{Ipv4Addr, SocketAddr};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{Context as _, bail};
use base64::Engine as _;
use bytes::Bytes;
use common::{Admin, AgentIdentity, Client};
use http::StatusCode;
use tether_api::control::{self as wire, Hello, Message, Reader};
use tether_testkit::child::Child;
use tether_testkit::kubectl::Kubectl;
use tether_testkit::postgres::Postgres;
use tether_testkit::tools::{self, Tool};
use tether_tunnel::{OpenOptions, Priority, kind};

/// A deadline for each step (a bound on waiting, not a timing assertion).
const WAIT: Duration = Duration::from_secs(60);

/// Children log at this level.
const RUST_LOG: &str = "info,sqlx=warn";

fn free_port() -> anyhow::Result<u16> {
    Ok(std::net::TcpListener::bind((Ipv4Addr::LOCALHOST, 0))?
        .local_addr()?
        .port())
}

/// A `tether-relay` process, one replica of the fleet.
struct RelayProc {
    proc: Child,
    addr: SocketAddr,
    ca_pem: String,
    admin: Admin,
}

impl RelayProc {
    /// Starts replica `id` with its data in `dir` on the database `url`, its peer link on a loopback port.
    async fn start(dir: &Path, id: &str, url: &str) -> anyhow::Result<RelayProc> {
        std::fs::create_dir_all(dir)?;
        let addr = SocketAddr::from((Ipv4Addr::LOCALHOST, free_port()?));
        let peer = SocketAddr::from((Ipv4Addr::LOCALHOST, free_port()?));
        let mut command = tokio::process::Command::new(env!("CARGO_BIN_EXE_tether-relay"));
        command
            .arg("--listen")
            .arg(addr.to_string())
            .arg("--data-dir")
            .arg(dir)
            .args(["--hostname", "localhost,127.0.0.1"])
            .args(["--database-url", url])
            .args(["--replica-id", id])
            .arg("--peer-listen")
            .arg(peer.to_string())
            .arg("--no-quic");
        let mut proc = Child::spawn("tether-relay", command, &dir.join("relay.log"), RUST_LOG)?;
        let deadline = Instant::now() + WAIT;
        loop {
            proc.check_running()?;
            if let (Ok(ca_pem), Ok(token)) = (
                std::fs::read_to_string(dir.join("ca.pem")),
                std::fs::read_to_string(dir.join("admin-token")),
            ) {
                let admin = Admin {
                    client: Client::new(addr, ca_pem.as_bytes(), "localhost")?,
                    token: token.trim().to_owned(),
                };
                if admin.list().await.is_ok_and(|r| r.status == StatusCode::OK) {
                    return Ok(RelayProc {
                        proc,
                        addr,
                        ca_pem,
                        admin,
                    });
                }
            }
            if Instant::now() > deadline {
                bail!("replica {id} did not answer within {WAIT:?}");
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    fn url(&self) -> String {
        format!("https://127.0.0.1:{}", self.addr.port())
    }
}

/// What the replicas of one fleet share (the chart's "fleet" values): the agent CA, the server CA and the
/// admin token.
fn share(from: &Path, to: &Path) -> anyhow::Result<()> {
    std::fs::create_dir_all(to)?;
    for file in [
        "agent-ca.pem",
        "agent-ca-key.pem",
        "ca.pem",
        "ca-key.pem",
        "admin-token",
    ] {
        std::fs::copy(from.join(file), to.join(file)).with_context(|| format!("copying {file}"))?;
    }
    Ok(())
}

/// The sample apiserver.
struct Sample {
    _proc: Child,
    dir: PathBuf,
}

impl Sample {
    async fn start(root: &Path) -> anyhow::Result<Sample> {
        let bin = tools::workspace_binary("tether-sample-apiserver").map_err(anyhow::Error::msg)?;
        let dir = root.join("sample");
        std::fs::create_dir_all(&dir)?;
        let listen = format!("127.0.0.1:{}", free_port()?);
        let proc = Child::sample_apiserver(
            tokio::process::Command::new(bin),
            &dir,
            &listen,
            &root.join("sample.log"),
            RUST_LOG,
            WAIT,
        )
        .await?;
        Ok(Sample { _proc: proc, dir })
    }

    fn token(&self) -> anyhow::Result<String> {
        Ok(std::fs::read_to_string(self.dir.join("token"))?
            .trim()
            .to_owned())
    }
}

/// A kubeconfig for `cluster` through `relay`, with `token`.
fn kubeconfig(
    dir: &Path,
    relay: &RelayProc,
    cluster: &str,
    token: &str,
) -> anyhow::Result<PathBuf> {
    let ca = base64::engine::general_purpose::STANDARD.encode(relay.ca_pem.as_bytes());
    let text = format!(
        "apiVersion: v1\nkind: Config\nclusters:\n- name: relay\n  cluster:\n    server: https://localhost:{port}/clusters/{cluster}\n    certificate-authority-data: {ca}\n\
         users:\n- name: u\n  user:\n    token: {token}\ncontexts:\n- name: c\n  context:\n    cluster: relay\n    user: u\n    namespace: default\ncurrent-context: c\n",
        port = relay.addr.port(),
    );
    let path = dir.join(format!("kubeconfig-{cluster}-{}", relay.addr.port()));
    std::fs::write(&path, text)?;
    Ok(path)
}

/// The cluster as `relay` shows it.
async fn show(relay: &RelayProc, cluster: &str) -> anyhow::Result<serde_json::Value> {
    let reply = relay.admin.show(cluster).await?;
    anyhow::ensure!(reply.status == StatusCode::OK, "{reply:?}");
    reply.json()
}

/// Dials `relay` as `identity`'s agent, opens the control channel and says hello; the control reader.
async fn control_agent(
    relay: &RelayProc,
    identity: &AgentIdentity,
) -> anyhow::Result<(
    tether_tunnel::Connection,
    Reader<tokio::io::ReadHalf<tether_tunnel::Stream>>,
    tokio::io::WriteHalf<tether_tunnel::Stream>,
)> {
    let tls = tether_runtime::tls::client_config_with(&tether_runtime::tls::ClientOptions {
        ca_pem: Some(relay.ca_pem.as_bytes()),
        identity: Some(tether_runtime::tls::ClientIdentity {
            cert_pem: identity.cert_pem.as_bytes(),
            key_pem: identity.key_pem.as_bytes(),
        }),
        alpn: &[b"http/1.1"],
        ..Default::default()
    })?;
    let mut headers = http::HeaderMap::new();
    headers.insert("tether-cluster", identity.cluster.parse()?);
    let conn = tether_tunnel::ws::connect(
        &format!("wss://localhost:{}/agent/v1/tunnel", relay.addr.port()),
        tls,
        headers,
        tether_tunnel::SessionConfig::new(tether_tunnel::Role::Client),
    )
    .await?;
    let stream = conn.open(OpenOptions {
        kind: kind::CONTROL,
        priority: Priority::Control,
        deadline: Some(Duration::from_secs(10)),
        metadata: Bytes::new(),
    })?;
    tokio::time::timeout(WAIT, stream.control().accepted()).await??;
    let (rd, mut wr) = tokio::io::split(stream);
    wire::send(
        &mut wr,
        &Message::Hello(Hello {
            agent_version: "0.1.0".into(),
            ..Hello::default()
        }),
    )
    .await?;
    Ok((conn, Reader::new(rd), wr))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kubectl_through_replica_b_reaches_the_tunnel_on_replica_a_and_a_dead_replica_is_dropped()
-> anyhow::Result<()> {
    let Some(pg) = Postgres::start_or_skip("the relay fleet with real processes")? else {
        return Ok(());
    };
    let Some(kubectl_bin) = tools::require(Tool::Kubectl) else {
        return Ok(());
    };
    tether_runtime::tls::install_crypto_provider();
    let root = tempfile::tempdir()?;
    let url = pg.fresh_database()?;
    let mut a = RelayProc::start(&root.path().join("a"), "relay-a", &url).await?;
    share(&root.path().join("a"), &root.path().join("b"))?;
    let b = RelayProc::start(&root.path().join("b"), "relay-b", &url).await?;
    let sample = Sample::start(root.path()).await?;

    // The real agent, connected to A only.
    let token = a.admin.create_ok("edge").await?;
    let state = root.path().join("agent");
    std::fs::create_dir_all(&state)?;
    std::fs::write(state.join("onboarding-token"), token)?;
    let mut agent_command = tokio::process::Command::new(
        tools::workspace_binary("tether-agent").map_err(anyhow::Error::msg)?,
    );
    agent_command
        .args(["--relay", &a.url(), "--cluster", "edge"])
        .arg("--onboarding-token-file")
        .arg(state.join("onboarding-token"))
        .arg("--state-dir")
        .arg(&state)
        .arg("--relay-ca")
        .arg(root.path().join("a").join("ca.pem"))
        .arg("--kubeconfig")
        .arg(sample.dir.join("kubeconfig"));
    let mut agent = Child::spawn(
        "tether-agent",
        agent_command,
        &root.path().join("agent.log"),
        RUST_LOG,
    )?;
    let deadline = Instant::now() + WAIT;
    loop {
        agent.check_running()?;
        let shown = show(&b, "edge").await?;
        if shown["tunnels"]
            .as_array()
            .is_some_and(|t| t.iter().any(|t| t["replica"] == "relay-a"))
        {
            anyhow::ensure!(shown["connected"] == true, "{shown}");
            break;
        }
        anyhow::ensure!(
            Instant::now() < deadline,
            "B never saw the tunnel on A: {shown}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }

    // kubectl through B: the only tunnel is on A.
    let kubectl = Kubectl::new(&kubeconfig(root.path(), &b, "edge", &sample.token()?)?)?
        .with_binary(&kubectl_bin);
    let out = kubectl.run(&["get", "namespaces", "-o", "name"]).await?;
    anyhow::ensure!(out.success(), "get through B failed: {}", out.stderr);
    assert!(out.stdout.contains("namespace/default"), "{}", out.stdout);
    let mut watch = kubectl.spawn(&["get", "configmaps", "-w", "-o", "name"])?;
    let out = kubectl
        .run(&["create", "configmap", "made-through-b"])
        .await?;
    anyhow::ensure!(out.success(), "create through B failed: {}", out.stderr);
    watch
        .wait_for_line(WAIT, |l| l.contains("made-through-b"))
        .await
        .context("the watch through B saw no event")?;
    let out = kubectl
        .run(&["exec", "demo", "--", "sh", "-c", "echo hello-from-a"])
        .await?;
    anyhow::ensure!(out.success(), "exec through B failed: {}", out.stderr);
    assert!(out.stdout.contains("hello-from-a"), "{}", out.stdout);

    // A role assignment made at A reaches an agent connected to B.
    let beta_token = a.admin.create_ok("beta").await?;
    let beta = b.admin.onboard("beta", &beta_token).await?;
    let (_beta_conn, mut beta_reader, _beta_writer) = control_agent(&b, &beta).await?;
    loop {
        match tokio::time::timeout(WAIT, beta_reader.recv()).await?? {
            Some(Message::GuardSnapshot(_)) => break,
            Some(_) => continue,
            None => bail!("B ended the control channel"),
        }
    }
    let started = Instant::now();
    let body = serde_json::json!({
        "cluster": "beta",
        "principalId": "00000000-0000-0000-0000-0000000000bb",
        "role": "Azure Arc Kubernetes Viewer",
    });
    let made = a
        .admin
        .client
        .post_json("/api/v1/roleassignments", Some(&a.admin.token), &body)
        .await?;
    anyhow::ensure!(made.status == StatusCode::CREATED, "{made:?}");
    let limit = tokio::time::Instant::now() + Duration::from_secs(2);
    loop {
        match tokio::time::timeout_at(limit, beta_reader.recv()).await {
            Ok(Ok(Some(Message::GuardSnapshot(s)))) if s.snapshot.assignments.len() == 1 => break,
            Ok(Ok(Some(_))) => continue,
            other => bail!("the agent at B got no snapshot within 2 s: {other:?}"),
        }
    }
    println!(
        "FLEET role assignment at replica A reached the agent at replica B in {:.3} s",
        started.elapsed().as_secs_f64()
    );

    // SIGKILL of A: B stops routing to A's tunnel once A's lease lapses (--lease-ttl, 5 s by default).
    a.proc.kill().await?;
    let killed = Instant::now();
    let limit = Duration::from_secs(10);
    loop {
        let shown = show(&b, "edge").await?;
        let on_a = shown["tunnels"]
            .as_array()
            .is_some_and(|t| t.iter().any(|t| t["replica"] == "relay-a"));
        if !on_a {
            anyhow::ensure!(shown["connected"] == false, "{shown}");
            break;
        }
        anyhow::ensure!(
            killed.elapsed() < limit,
            "B still routes to the dead replica after {limit:?}: {shown}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    println!(
        "FLEET routes of the SIGKILLed replica gone at replica B after {:.3} s",
        killed.elapsed().as_secs_f64()
    );
    // kubectl through B now gets a prompt answer that the cluster is not connected.
    let out = kubectl
        .run(&["get", "--raw", "/clusters/edge/api/v1/namespaces"])
        .await?;
    assert!(!out.success());
    assert!(
        out.stderr.contains("cluster edge is not connected"),
        "{}",
        out.stderr
    );
    let _ = watch.kill().await;
    drop(agent);
    drop(b);
    pg.stop();
    Ok(())
}
