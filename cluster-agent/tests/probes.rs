//! The probe port (`--health-listen`): `/readyz` follows the tunnel, `/livez` the agent's life, and nothing else
//! is served there.

mod common;

use std::net::SocketAddr;
use std::time::Duration;

use anyhow::{Result, ensure};
use common::harness::{DEADLINE, Running, env};
use tether_tunnel::code;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// A loopback address with a port free a moment ago.
fn free_addr() -> Result<SocketAddr> {
    let listener = std::net::TcpListener::bind("127.0.0.1:0")?;
    Ok(listener.local_addr()?)
}

/// One raw HTTP/1.1 exchange; the status code, or `None` when nothing answers.
async fn status(addr: SocketAddr, method: &str, path: &str) -> Option<u16> {
    let exchange = async {
        let mut tcp = TcpStream::connect(addr).await.ok()?;
        let request =
            format!("{method} {path} HTTP/1.1\r\nhost: probe\r\nconnection: close\r\n\r\n");
        tcp.write_all(request.as_bytes()).await.ok()?;
        let mut reply = Vec::new();
        tcp.read_to_end(&mut reply).await.ok()?;
        let text = String::from_utf8_lossy(&reply).into_owned();
        text.split_whitespace().nth(1)?.parse().ok()
    };
    tokio::time::timeout(Duration::from_secs(5), exchange)
        .await
        .ok()
        .flatten()
}

/// Polls until `path` answers `want`.
async fn until(addr: SocketAddr, path: &str, want: Option<u16>) -> Result<()> {
    let give_up = tokio::time::Instant::now() + DEADLINE;
    loop {
        let got = status(addr, "GET", path).await;
        if got == want {
            return Ok(());
        }
        ensure!(
            tokio::time::Instant::now() < give_up,
            "{path}: still {got:?}, wanted {want:?}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test]
async fn readyz_follows_the_tunnel_and_livez_the_agent() -> Result<()> {
    let mut env = env(Some("onb-1")).await?;
    let addr = free_addr()?;
    let mut config = env.config(Some("onb-1"));
    config.health_listen = Some(addr);
    let mut agent = Running::start(config);

    until(addr, "/livez", Some(200)).await?;
    let tunnel = env.next_tunnel().await?;
    until(addr, "/readyz", Some(200)).await?;
    assert_eq!(status(addr, "HEAD", "/readyz").await, Some(200));

    // The relay goes away for good: no tunnel, not ready, still alive (it keeps trying).
    env.relay.stop();
    tunnel.close(code::SHUTDOWN, "relay going away");
    drop(tunnel);
    until(addr, "/readyz", Some(503)).await?;
    assert_eq!(status(addr, "GET", "/livez").await, Some(200));

    // Once the agent stopped, nothing answers on the probe port.
    agent.shutdown();
    agent.finished().await??;
    until(addr, "/livez", None).await?;
    Ok(())
}

#[tokio::test]
async fn the_probe_port_serves_nothing_else() -> Result<()> {
    let mut env = env(Some("onb-1")).await?;
    let addr = free_addr()?;
    let mut config = env.config(Some("onb-1"));
    config.health_listen = Some(addr);
    let mut agent = Running::start(config);
    let _tunnel = env.next_tunnel().await?;
    until(addr, "/readyz", Some(200)).await?;

    // Not a proxy to the apiserver, not a debug endpoint, no other method.
    for path in [
        "/",
        "/api/v1/namespaces",
        "/debug/pprof",
        "/readyz/../api",
        "//livez",
    ] {
        assert_eq!(status(addr, "GET", path).await, Some(404), "{path}");
    }
    // `/metrics` is one gauge (streams being served), naming nothing.
    assert_eq!(status(addr, "GET", "/metrics").await, Some(200));
    assert_eq!(status(addr, "POST", "/readyz").await, Some(405));
    assert_eq!(status(addr, "DELETE", "/livez").await, Some(405));
    assert!(
        env.api.seen().is_empty(),
        "nothing reached the apiserver: {:?}",
        env.api.seen()
    );

    // A client that never sends its request head is cut off rather than held forever.
    let mut idle = TcpStream::connect(addr).await?;
    let mut buf = [0u8; 64];
    let read = tokio::time::timeout(DEADLINE, idle.read(&mut buf)).await;
    ensure!(
        matches!(read, Ok(Ok(_)) | Ok(Err(_))),
        "an idle probe connection stayed open"
    );
    // Many idle connections do not stop the probes from answering once they are cut off.
    let mut idlers = Vec::new();
    for _ in 0..40 {
        idlers.push(TcpStream::connect(addr).await?);
    }
    until(addr, "/livez", Some(200)).await?;
    drop(idlers);

    agent.shutdown();
    agent.finished().await??;
    Ok(())
}

#[tokio::test]
async fn a_probe_port_in_use_is_a_clear_error() -> Result<()> {
    let env = env(Some("onb-1")).await?;
    let taken = std::net::TcpListener::bind("127.0.0.1:0")?;
    let mut config = env.config(Some("onb-1"));
    config.health_listen = Some(taken.local_addr()?);
    let agent = Running::start(config);
    let err = agent
        .finished()
        .await?
        .err()
        .map(|e| e.to_string())
        .unwrap_or_default();
    ensure!(err.contains("cannot listen for probes"), "{err}");
    Ok(())
}
