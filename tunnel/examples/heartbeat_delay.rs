//! How long a small control message (a heartbeat) waits behind a bulk transfer on the same tunnel.
//!
//! Two `Connection`s over a real WebSocket on loopback TCP. A "heartbeat" stream sends a timestamp every 20 ms
//! and the receiver records the one-way delay (same process, same clock). Three runs, side by side:
//! idle tunnel; tunnel saturated by one bulk stream, heartbeats on the control lane (`Priority::Control`, as the
//! agent sends them); the same saturation with heartbeats on the normal lane (what a protocol without a priority
//! lane would give). Reports p50/p99/max in microseconds.
//!
//! `cargo run --release -p tether-tunnel --example heartbeat_delay`

use std::time::{Duration, Instant};

use bytes::Bytes;
use tether_tunnel::{Connection, OpenOptions, Priority, Role, SessionConfig, kind, ws};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

const BEATS: usize = 150;
const EVERY: Duration = Duration::from_millis(20);

async fn pair() -> anyhow::Result<(Connection, Connection)> {
    let listener = TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    let server = tokio::spawn(async move {
        let (tcp, _) = listener.accept().await?;
        tcp.set_nodelay(true)?;
        let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
        let service =
            hyper::service::service_fn(move |mut req: http::Request<hyper::body::Incoming>| {
                let tx = tx.clone();
                async move {
                    let response = ws::upgrade_response(&req).map_err(anyhow::Error::msg)?;
                    let on_upgrade = hyper::upgrade::on(&mut req);
                    tokio::spawn(async move {
                        if let Ok(upgraded) = on_upgrade.await {
                            let conn = ws::accept_upgraded(
                                hyper_util::rt::TokioIo::new(upgraded),
                                SessionConfig::new(Role::Server),
                            );
                            let _ = tx.send(conn);
                        }
                    });
                    anyhow::Ok(response.map(|()| http_body_util::Empty::<Bytes>::new()))
                }
            });
        tokio::spawn(
            hyper::server::conn::http1::Builder::new()
                .serve_connection(hyper_util::rt::TokioIo::new(tcp), service)
                .with_upgrades(),
        );
        rx.recv().await.ok_or_else(|| anyhow::anyhow!("no upgrade"))
    });
    let tcp = TcpStream::connect(addr).await?;
    tcp.set_nodelay(true)?;
    let client = ws::connect_over(
        tcp,
        &format!("wss://{addr}/agent/v1/tunnel"),
        Default::default(),
        SessionConfig::new(Role::Client),
    )
    .await?;
    let server = server.await??;
    Ok((client, server))
}

fn options(priority: Priority) -> OpenOptions {
    OpenOptions {
        kind: kind::HTTP,
        priority,
        deadline: None,
        metadata: Bytes::new(),
    }
}

/// Runs one measurement; returns sorted one-way delays.
async fn run(bulk: bool, priority: Priority) -> anyhow::Result<Vec<Duration>> {
    let (client, server) = pair().await?;
    let start = Instant::now();
    let mut bulk_task = None;
    if bulk {
        let mut sender = client.open(options(Priority::Normal))?;
        let mut receiver = server
            .accept()
            .await
            .ok_or_else(|| anyhow::anyhow!("no bulk stream"))?
            .accept(Bytes::new())?;
        bulk_task = Some(tokio::spawn(async move {
            let chunk = vec![7u8; 256 * 1024];
            let writer = async move {
                loop {
                    if sender.write_all(&chunk).await.is_err() {
                        break;
                    }
                }
            };
            let reader = async move {
                let mut buf = vec![0u8; 256 * 1024];
                let mut total = 0u64;
                while let Ok(n) = receiver.read(&mut buf).await {
                    if n == 0 {
                        break;
                    }
                    total += n as u64;
                }
                total
            };
            tokio::select! { () = writer => 0, total = reader => total }
        }));
        tokio::time::sleep(Duration::from_millis(300)).await; // let the bulk stream fill every window
    }
    let mut beat = client.open(options(priority))?;
    let mut beat_in = server
        .accept()
        .await
        .ok_or_else(|| anyhow::anyhow!("no heartbeat stream"))?
        .accept(Bytes::new())?;
    let receiver = tokio::spawn(async move {
        let mut delays = Vec::with_capacity(BEATS);
        let mut buf = [0u8; 16];
        for _ in 0..BEATS {
            if beat_in.read_exact(&mut buf).await.is_err() {
                break;
            }
            let sent = u128::from_be_bytes(buf);
            let now = start.elapsed().as_nanos();
            delays.push(Duration::from_nanos(
                u64::try_from(now.saturating_sub(sent)).unwrap_or(u64::MAX),
            ));
        }
        delays
    });
    let mut ticker = tokio::time::interval(EVERY);
    for _ in 0..BEATS {
        ticker.tick().await;
        beat.write_all(&start.elapsed().as_nanos().to_be_bytes())
            .await?;
    }
    let mut delays = receiver.await?;
    if let Some(task) = bulk_task {
        task.abort();
    }
    client.close(tether_tunnel::code::NO_ERROR, "done");
    delays.sort();
    Ok(delays)
}

fn pct(sorted: &[Duration], p: f64) -> u128 {
    if sorted.is_empty() {
        return 0;
    }
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[i.min(sorted.len() - 1)].as_micros()
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    tether_runtime::tls::install_crypto_provider();
    println!("{BEATS} heartbeats every {EVERY:?}; one-way delay in µs (p50 / p99 / max)");
    let runs = [
        ("idle tunnel, control lane", false, Priority::Control),
        ("saturated tunnel, control lane", true, Priority::Control),
        ("saturated tunnel, normal lane", true, Priority::Normal),
    ];
    let mut p99s = Vec::new();
    for (name, bulk, priority) in runs {
        let d = run(bulk, priority).await?;
        println!(
            "{name:<32} {:>8} {:>8} {:>8}   ({} received)",
            pct(&d, 0.5),
            pct(&d, 0.99),
            pct(&d, 1.0),
            d.len()
        );
        p99s.push(pct(&d, 0.99).max(1));
    }
    println!(
        "p99 ratios: saturated/idle on the control lane {:.1}x; normal lane / control lane under saturation {:.1}x",
        p99s[1] as f64 / p99s[0] as f64,
        p99s[2] as f64 / p99s[1] as f64
    );
    Ok(())
}
