//! Transport selection against the real relay (in this process: WebSocket on its HTTPS port, QUIC on UDP at
//! the same port number) with real kubectl and the `tether-agent` binary:
//!
//! - the kubectl battery (get, list, watch, apply, delete, logs -f, exec) through a QUIC tunnel
//!   (`--transport quic`) and through a WebSocket one (`--transport wss`), the relay's admin API showing the
//!   transport; with the default `--tunnels 2`, the relay (which reports no fleet) gets one tunnel;
//! - in a network namespace whose firewall drops UDP to the relay: `--transport auto` is connected over
//!   WebSocket within 3 s (the bound, printed), logs why (the QUIC error), and once the rule is
//!   removed moves to QUIC at its next re-probe, make-before-break, with no failed request from a client
//!   running GETs throughout.

mod common;

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context as _, Result, bail, ensure};
use base64::Engine as _;
use bytes::Bytes;
use common::real_relay::RelayProcess;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use tether_testkit::kubectl::Kubectl;
use tether_testkit::netns;
use tether_testkit::tools::{self, Tool};
use tether_testkit::{SampleApiserver, SampleOptions};

const DEADLINE: Duration = Duration::from_secs(30);

/// A kubeconfig for a user of cluster `prod` through the relay.
fn user_kubeconfig(dir: &Path, relay: &RelayProcess, token: &str) -> Result<PathBuf> {
    let ca = base64::engine::general_purpose::STANDARD.encode(relay.ca_pem.as_bytes());
    let yaml = format!(
        "apiVersion: v1\nkind: Config\nclusters:\n- name: prod\n  cluster:\n    server: {url}/clusters/prod\n    certificate-authority-data: {ca}\nusers:\n- name: user\n  user:\n    token: {token}\ncontexts:\n- name: prod\n  context:\n    cluster: prod\n    user: user\n    namespace: default\ncurrent-context: prod\n",
        url = relay.url(),
    );
    let path = dir.join("user.kubeconfig");
    std::fs::write(&path, yaml)?;
    Ok(path)
}

/// The `tether-agent` binary for cluster `prod`, with `extra` flags.
fn agent_command(
    program: tokio::process::Command,
    relay_url: &str,
    relay_ca: &Path,
    state: &Path,
    kubeconfig: &Path,
    log: &Path,
    extra: &[&str],
) -> Result<tokio::process::Command> {
    let mut command = program;
    command
        .args(["--relay", relay_url, "--cluster", "prod"])
        .arg("--relay-ca")
        .arg(relay_ca)
        .arg("--state-dir")
        .arg(state)
        .arg("--kubeconfig")
        .arg(kubeconfig)
        .args(extra)
        .env_remove("HTTPS_PROXY")
        .env_remove("https_proxy")
        .env("RUST_LOG", "tether_agent=info")
        .stdin(Stdio::null())
        .stdout(std::fs::File::create(log)?)
        .stderr(std::fs::File::create(log.with_extension("err"))?)
        .kill_on_drop(true);
    Ok(command)
}

fn agent_log(log: &Path) -> String {
    let mut text = std::fs::read_to_string(log).unwrap_or_default();
    text.push_str(&std::fs::read_to_string(log.with_extension("err")).unwrap_or_default());
    text
}

/// The relay's view of cluster `prod`'s tunnels: their transports.
async fn transports(relay: &RelayProcess) -> Vec<String> {
    relay
        .cluster("prod")
        .await
        .ok()
        .and_then(|c| {
            c["tunnels"].as_array().map(|t| {
                t.iter()
                    .filter_map(|t| t["transport"].as_str().map(str::to_owned))
                    .collect()
            })
        })
        .unwrap_or_default()
}

async fn battery(transport: &str) -> Result<()> {
    if tools::require(Tool::Kubectl).is_none() {
        return Ok(());
    }
    tether_runtime::tls::install_crypto_provider();
    let dir = tempfile::tempdir()?;
    let api = SampleApiserver::start(SampleOptions::new(dir.path().join("api"))).await?;
    let relay = RelayProcess::start(&dir.path().join("relay"), "127.0.0.1:0".parse()?).await?;
    let token = relay.register("prod").await?;
    let relay_ca = dir.path().join("relay-ca.pem");
    std::fs::write(&relay_ca, &relay.ca_pem)?;
    let log = dir.path().join("agent.log");
    let probes = SocketAddr::from((
        Ipv4Addr::LOCALHOST,
        std::net::TcpListener::bind("127.0.0.1:0")?
            .local_addr()?
            .port(),
    ));
    let mut agent = agent_command(
        tokio::process::Command::new(env!("CARGO_BIN_EXE_tether-agent")),
        &relay.url(),
        &relay_ca,
        &dir.path().join("agent"),
        &api.kubeconfig_path(),
        &log,
        &[
            "--transport",
            transport,
            "--health-listen",
            &probes.to_string(),
        ],
    )?
    .env("TETHER_ONBOARDING_TOKEN", &token)
    .spawn()?;
    tether_testkit::wait::until("the tunnel up at the relay", DEADLINE, || async {
        !transports(&relay).await.is_empty()
    })
    .await
    .with_context(|| agent_log(&log))?;
    let expected = if transport == "quic" { "quic" } else { "wss" };
    ensure!(
        transports(&relay).await == [expected],
        "{:?}\n{}",
        transports(&relay).await,
        agent_log(&log)
    );

    let kubectl = Kubectl::new(&user_kubeconfig(dir.path(), &relay, api.token())?)?;
    // get and list
    let out = kubectl.run(&["get", "pods", "-o", "name"]).await?;
    ensure!(out.success(), "{out}");
    ensure!(out.stdout.lines().any(|l| l.trim() == "pod/demo"), "{out}");
    let out = kubectl.run(&["get", "namespaces", "-o", "name"]).await?;
    ensure!(
        out.success() && out.stdout.contains("namespace/default"),
        "{out}"
    );
    // watch: an object another client creates shows up
    let mut watch = kubectl.spawn(&["get", "configmaps", "-w", "-o", "name"])?;
    let mut seen = false;
    for attempt in 0..10 {
        let name = format!("watched-{attempt}");
        let out = kubectl.run(&["create", "configmap", &name]).await?;
        ensure!(out.success(), "{out}");
        if watch
            .wait_for_line(Duration::from_secs(5), |l| l.contains("watched-"))
            .await
            .is_ok()
        {
            seen = true;
            break;
        }
    }
    ensure!(seen, "the watch never printed the configmap");
    drop(watch);
    // apply twice, then delete
    let manifest = dir.path().join("cm.yaml");
    for (mode, verb) in [("blue", "created"), ("green", "configured")] {
        std::fs::write(
            &manifest,
            format!(
                "apiVersion: v1\nkind: ConfigMap\nmetadata:\n  name: settings\n  namespace: default\ndata:\n  mode: {mode}\n"
            ),
        )?;
        let out = kubectl
            .run(&["apply", "-f", &manifest.to_string_lossy()])
            .await?;
        ensure!(out.success() && out.stdout.contains(verb), "{out}");
    }
    let out = kubectl
        .run(&[
            "get",
            "configmap",
            "settings",
            "-o",
            "jsonpath={.data.mode}",
        ])
        .await?;
    ensure!(out.stdout.trim() == "green", "{out}");
    let out = kubectl.run(&["delete", "configmap", "settings"]).await?;
    ensure!(out.success(), "{out}");
    let out = kubectl.run(&["get", "configmap", "settings"]).await?;
    ensure!(!out.success() && out.stderr.contains("not found"), "{out}");
    // logs -f streams
    let mut follow = kubectl.spawn(&["logs", "-f", "demo", "--tail=1"])?;
    let first = follow
        .wait_for_line(DEADLINE, |l| l.contains("tick"))
        .await?;
    follow
        .wait_for_line(DEADLINE, |l| l.contains("tick") && l != first)
        .await?;
    drop(follow);
    // exec, with stdin and an exit code
    let out = kubectl
        .run_with_stdin(
            &["exec", "-i", "demo", "--", "cat"],
            b"line one\nline two\n",
        )
        .await?;
    ensure!(
        out.success() && out.stdout == "line one\nline two\n",
        "{out}"
    );
    let out = kubectl
        .run(&["exec", "demo", "--", "sh", "-c", "exit 3"])
        .await?;
    ensure!(out.code() == Some(3), "{out}");

    // Still on the same single tunnel: the relay reports no fleet, so `--tunnels 2` keeps one, and nothing
    // reconnected.
    ensure!(transports(&relay).await == [expected]);
    let cluster = relay.cluster("prod").await?;
    ensure!(cluster["agentHealth"]["reconnects"] == 0, "{cluster}");
    let metrics = http_get_plain(probes, "/metrics").await?;
    ensure!(
        metrics.contains(&format!(
            "tether_agent_tunnels{{transport=\"{expected}\"}} 1"
        )),
        "{metrics}"
    );
    agent.kill().await?;
    relay.stop().await?;
    api.shutdown().await;
    Ok(())
}

/// A plain HTTP GET on the agent's probe port; the body.
async fn http_get_plain(addr: SocketAddr, path: &str) -> Result<String> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut tcp = tokio::net::TcpStream::connect(addr).await?;
    tcp.write_all(
        format!("GET {path} HTTP/1.1\r\nhost: probe\r\nconnection: close\r\n\r\n").as_bytes(),
    )
    .await?;
    let mut reply = Vec::new();
    tokio::time::timeout(DEADLINE, tcp.read_to_end(&mut reply)).await??;
    Ok(String::from_utf8_lossy(&reply).into_owned())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kubectl_battery_through_a_quic_tunnel() -> Result<()> {
    battery("quic").await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kubectl_battery_through_a_websocket_tunnel() -> Result<()> {
    battery("wss").await
}

/// GETs through the relay, one after another on kept-alive connections, until told to stop.
struct Gets {
    ok: AtomicUsize,
    failed: AtomicUsize,
    errors: std::sync::Mutex<Vec<String>>,
    stop: AtomicBool,
}

impl Gets {
    fn start(relay: &RelayProcess) -> Result<(Arc<Gets>, tokio::task::JoinHandle<()>)> {
        let tls = tether_runtime::tls::client_config(Some(relay.ca_pem.as_bytes()), &[])?;
        let https = hyper_rustls::HttpsConnectorBuilder::new()
            .with_tls_config((*tls).clone())
            .https_only()
            .enable_http1()
            .build();
        let client: Client<_, Full<Bytes>> = Client::builder(TokioExecutor::new()).build(https);
        let url = format!(
            "{}/clusters/prod/api/v1/namespaces/default/pods",
            relay.url()
        );
        let gets = Arc::new(Gets {
            ok: AtomicUsize::new(0),
            failed: AtomicUsize::new(0),
            errors: std::sync::Mutex::new(Vec::new()),
            stop: AtomicBool::new(false),
        });
        let task = tokio::spawn({
            let gets = gets.clone();
            async move {
                while !gets.stop.load(Ordering::SeqCst) {
                    let request = http::Request::get(url.as_str())
                        .header("authorization", "Bearer user-token")
                        .body(Full::new(Bytes::new()));
                    let outcome = match request {
                        Ok(request) => {
                            match tokio::time::timeout(DEADLINE, client.request(request)).await {
                                Ok(Ok(resp)) => {
                                    let status = resp.status();
                                    let body =
                                        resp.into_body().collect().await.map(|b| b.to_bytes());
                                    match (status, body) {
                                        (http::StatusCode::OK, Ok(_)) => Ok(()),
                                        (status, body) => Err(format!(
                                            "{status}: {}",
                                            body.map(|b| String::from_utf8_lossy(&b).into_owned())
                                                .unwrap_or_else(|e| e.to_string())
                                        )),
                                    }
                                }
                                Ok(Err(e)) => Err(e.to_string()),
                                Err(_) => Err("no answer".to_owned()),
                            }
                        }
                        Err(e) => Err(e.to_string()),
                    };
                    match outcome {
                        Ok(()) => {
                            gets.ok.fetch_add(1, Ordering::SeqCst);
                        }
                        Err(e) => {
                            gets.failed.fetch_add(1, Ordering::SeqCst);
                            if let Ok(mut errors) = gets.errors.lock() {
                                errors.push(e);
                            }
                            tokio::time::sleep(Duration::from_millis(20)).await;
                        }
                    }
                }
            }
        });
        Ok((gets, task))
    }

    async fn at_least(&self, n: usize) -> Result<()> {
        tether_testkit::wait::until("GETs answered", DEADLINE, || {
            let ok = self.ok.load(Ordering::SeqCst);
            async move { ok >= n }
        })
        .await?;
        Ok(())
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn blocked_udp_falls_back_to_websocket_within_3s_and_moves_to_quic_when_it_opens()
-> Result<()> {
    match netns::available() {
        Ok(()) => {}
        Err(why) => {
            tether_testkit::tools::skip_or_fail::<()>(&format!(
                "a network namespace is needed to block UDP: {why}"
            ));
            return Ok(());
        }
    }
    tether_runtime::tls::install_crypto_provider();
    let (host_ip, ns_ip) = (Ipv4Addr::new(10, 213, 8, 1), Ipv4Addr::new(10, 213, 8, 2));
    let ns = netns::Netns::create("trn", host_ip, ns_ip)?;
    let dir = tempfile::tempdir()?;
    let api = common::TestApiserver::start_on(SocketAddr::new(IpAddr::V4(host_ip), 0)).await?;
    let kubeconfig = common::write_kubeconfig(dir.path(), &api.url(), &api.ca.pem(), None)?;
    let relay = RelayProcess::start_with(
        &dir.path().join("relay"),
        SocketAddr::new(IpAddr::V4(host_ip), 0),
        |c| c.hostnames = vec![host_ip.to_string()],
    )
    .await?;
    let token = relay.register("prod").await?;
    let relay_ca = dir.path().join("relay-ca.pem");
    std::fs::write(&relay_ca, &relay.ca_pem)?;
    let state = dir.path().join("agent");
    let program = || ns.command(Path::new(env!("CARGO_BIN_EXE_tether-agent")));

    // Onboard first (over WebSocket: a killed agent's TCP connection ends at once), so that the measured
    // start below is the connection alone.
    let onboard_log = dir.path().join("onboard.log");
    let mut onboarding = agent_command(
        program(),
        &relay.url(),
        &relay_ca,
        &state,
        &kubeconfig,
        &onboard_log,
        &["--transport", "wss"],
    )?
    .env("TETHER_ONBOARDING_TOKEN", &token)
    .spawn()?;
    tether_testkit::wait::until("onboarded and connected", DEADLINE, || async {
        transports(&relay).await == ["wss"]
    })
    .await
    .with_context(|| agent_log(&onboard_log))?;
    onboarding.kill().await?;
    tether_testkit::wait::until("the onboarding agent gone", DEADLINE, || async {
        transports(&relay).await.is_empty()
    })
    .await?;

    // UDP from the namespace to the relay is dropped.
    let rule = [
        "OUTPUT",
        "-p",
        "udp",
        "-d",
        &host_ip.to_string(),
        "-j",
        "DROP",
    ];
    let iptables = |op: &str| {
        let mut args = vec!["iptables", op];
        args.extend_from_slice(&rule);
        ns.exec_ok(&args)
    };
    iptables("-A")?;

    let log = dir.path().join("agent.log");
    let started = Instant::now();
    let mut agent = agent_command(
        program(),
        &relay.url(),
        &relay_ca,
        &state,
        &kubeconfig,
        &log,
        &[
            "--transport",
            "auto",
            "--quic-reprobe-interval",
            "3s",
            // The QUIC attempt that lost the race gives up (and says why) after this.
            "--connect-timeout",
            "3s",
        ],
    )?
    .spawn()?;
    tether_testkit::wait::until(
        "connected over WebSocket",
        Duration::from_secs(10),
        || async { transports(&relay).await == ["wss"] },
    )
    .await
    .with_context(|| agent_log(&log))?;
    let connected_in = started.elapsed();
    println!("UDP blocked: connected over WebSocket {connected_in:?} after the agent started");
    ensure!(
        connected_in < Duration::from_secs(3),
        "the agent took {connected_in:?} to connect over WebSocket with UDP blocked\n{}",
        agent_log(&log)
    );

    // It says why it is on WebSocket: the QUIC error.
    tether_testkit::wait::until("the fallback logged", DEADLINE, || {
        let text = agent_log(&log);
        async move { text.contains("falling back to WebSocket") }
    })
    .await
    .with_context(|| agent_log(&log))?;
    let reason = agent_log(&log)
        .lines()
        .find(|l| l.contains("falling back to WebSocket"))
        .unwrap_or_default()
        .to_owned();
    println!("the agent's log: {reason}");
    ensure!(reason.contains("no QUIC answer"), "{reason}");

    // GETs throughout; then UDP opens, and at its next re-probe the agent moves to QUIC, new tunnel first.
    let (gets, task) = Gets::start(&relay)?;
    gets.at_least(20).await?;
    iptables("-D")?;
    let opened = Instant::now();
    tether_testkit::wait::until("moved to QUIC", DEADLINE, || async {
        transports(&relay).await == ["quic"]
    })
    .await
    .with_context(|| agent_log(&log))?;
    println!(
        "UDP opened: on QUIC {:?} later (re-probe every 3s)",
        opened.elapsed()
    );
    let before = gets.ok.load(Ordering::SeqCst);
    gets.at_least(before + 20).await?;
    gets.stop.store(true, Ordering::SeqCst);
    task.await?;
    let (ok, failed) = (
        gets.ok.load(Ordering::SeqCst),
        gets.failed.load(Ordering::SeqCst),
    );
    println!("GETs during the move: {ok} answered, {failed} failed");
    let errors = gets.errors.lock().map(|e| e.clone()).unwrap_or_default();
    ensure!(failed == 0, "failed GETs: {errors:?}");
    let text = agent_log(&log);
    ensure!(
        text.contains("moved to a new tunnel"),
        "the agent did not log its move:\n{text}"
    );
    if agent.try_wait()?.is_some() {
        bail!("the agent exited:\n{text}");
    }
    agent.kill().await?;
    relay.stop().await?;
    Ok(())
}
