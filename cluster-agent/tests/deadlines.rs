//! No request waits without a deadline (issue 17, item 2), with real processes: the relay (in this process),
//! the `tether-agent` binary, and an HTTPS apiserver that accepts `/hang` requests and never answers them.
//!
//! Each such request gets a Kubernetes `Status` 504 naming the cluster once the relay's request timeout
//! (short here) has passed, and afterwards nothing is left waiting anywhere: the relay's tunnel holds only
//! its control stream, the agent serves no stream, and the apiserver holds no request (the agent cancelled
//! them).

mod common;

use std::net::SocketAddr;
use std::process::Stdio;
use std::time::Duration;

use anyhow::{Context as _, Result};
use common::TestApiserver;
use common::real_relay::RelayProcess;
use http::{Method, StatusCode};
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};

const DEADLINE: Duration = Duration::from_secs(30);
const REQUEST_TIMEOUT: Duration = Duration::from_secs(2);
const HANGING: usize = 8;

fn free_addr() -> Result<SocketAddr> {
    let listener = std::net::TcpListener::bind("127.0.0.1:0")?;
    Ok(listener.local_addr()?)
}

/// `tether_agent_open_streams` from the agent's `/metrics`, or `None` when it does not answer.
async fn agent_open_streams(addr: SocketAddr) -> Option<u64> {
    let exchange = async {
        let mut tcp = tokio::net::TcpStream::connect(addr).await.ok()?;
        tcp.write_all(b"GET /metrics HTTP/1.1\r\nHost: agent\r\nConnection: close\r\n\r\n")
            .await
            .ok()?;
        let mut text = String::new();
        tcp.read_to_string(&mut text).await.ok()?;
        text.lines()
            .find_map(|l| l.strip_prefix("tether_agent_open_streams "))
            .and_then(|n| n.trim().parse().ok())
    };
    tokio::time::timeout(Duration::from_secs(5), exchange)
        .await
        .ok()
        .flatten()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_the_apiserver_never_answers_gets_504_and_leaves_nothing_queued() -> Result<()> {
    tether_runtime::tls::install_crypto_provider();
    let dir = tempfile::tempdir()?;
    let api = TestApiserver::start().await?;
    let kubeconfig = common::write_kubeconfig(dir.path(), &api.url(), &api.ca.pem(), None)?;
    let relay = RelayProcess::start_with(&dir.path().join("relay"), "127.0.0.1:0".parse()?, |c| {
        c.request_timeout = REQUEST_TIMEOUT;
    })
    .await?;
    let token = relay.register("prod").await?;
    let ca_path = dir.path().join("relay-ca.pem");
    std::fs::write(&ca_path, &relay.ca_pem)?;
    let health = free_addr()?;
    let mut agent = tokio::process::Command::new(env!("CARGO_BIN_EXE_tether-agent"))
        .args(["--relay", &relay.url(), "--cluster", "prod"])
        .arg("--relay-ca")
        .arg(&ca_path)
        .arg("--state-dir")
        .arg(dir.path().join("agent-state"))
        .arg("--kubeconfig")
        .arg(&kubeconfig)
        .args(["--health-listen", &health.to_string()])
        .env("TETHER_ONBOARDING_TOKEN", &token)
        .env_remove("HTTPS_PROXY")
        .env_remove("https_proxy")
        .stdout(Stdio::null())
        .kill_on_drop(true)
        .spawn()
        .context("starting tether-agent")?;

    // Up: an ordinary request goes through.
    let (status, body) = relay.user_get("prod", "/api/v1/namespaces").await?;
    assert_eq!(status, StatusCode::OK, "{}", String::from_utf8_lossy(&body));

    // Requests the apiserver accepts and never answers: each ends in a 504 Status naming the cluster.
    let calls =
        (0..HANGING).map(|_| relay.call(Method::GET, "/clusters/prod/hang", "user-token", None));
    let answers = tokio::time::timeout(DEADLINE, futures_util::future::join_all(calls)).await?;
    for answer in answers {
        let (status, body) = answer?;
        assert_eq!(
            status,
            StatusCode::GATEWAY_TIMEOUT,
            "{}",
            String::from_utf8_lossy(&body)
        );
        let json: serde_json::Value = serde_json::from_slice(&body)?;
        assert_eq!(json["kind"], "Status", "{json}");
        assert_eq!(json["code"], 504, "{json}");
        assert_eq!(json["reason"], "Timeout", "{json}");
        let message = json["message"].as_str().unwrap_or_default();
        assert!(message.contains("cluster prod"), "{message}");
    }
    let reached = api
        .seen()
        .iter()
        .filter(|s| s.uri.ends_with("/hang"))
        .count();
    assert_eq!(
        reached, HANGING,
        "every request reached the apiserver before timing out"
    );

    // Nothing left queued or held: the apiserver's requests were cancelled, the agent serves no stream,
    // the relay's tunnel carries only its control stream.
    common::eventually(DEADLINE, || (api.hanging() == 0).then_some(()))
        .await
        .with_context(|| format!("the apiserver still holds {} requests", api.hanging()))?;
    common::eventually(DEADLINE, || {
        (relay.stats.open_streams("prod") == Some(1)).then_some(())
    })
    .await
    .with_context(|| {
        format!(
            "relay tunnel streams: {:?}",
            relay.stats.open_streams("prod")
        )
    })?;
    let give_up = tokio::time::Instant::now() + DEADLINE;
    loop {
        let open = agent_open_streams(health).await;
        if open == Some(0) {
            break;
        }
        anyhow::ensure!(
            tokio::time::Instant::now() < give_up,
            "the agent still serves {open:?} streams"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }

    // And the cluster still answers.
    let (status, _) = relay.user_get("prod", "/api/v1/namespaces").await?;
    assert_eq!(status, StatusCode::OK);

    agent.kill().await.ok();
    relay.stop().await?;
    Ok(())
}
