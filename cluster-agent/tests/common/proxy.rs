//! A small HTTP CONNECT proxy on 127.0.0.1 for tests: records each CONNECT request head, optionally requires
//! Basic credentials (407 otherwise), then pipes bytes to the target.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use anyhow::{Context as _, Result};
use base64::Engine as _;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

pub struct ConnectProxy {
    pub port: u16,
    requests: Arc<Mutex<Vec<String>>>,
    connections: Arc<AtomicUsize>,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for ConnectProxy {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl ConnectProxy {
    pub async fn start(credentials: Option<(&str, &str)>) -> Result<Self> {
        let listener = TcpListener::bind("127.0.0.1:0").await?;
        let port = listener.local_addr()?.port();
        let requests = Arc::new(Mutex::new(Vec::new()));
        let connections = Arc::new(AtomicUsize::new(0));
        let expected = credentials.map(|(u, p)| {
            format!(
                "proxy-authorization: basic {}",
                base64::engine::general_purpose::STANDARD.encode(format!("{u}:{p}"))
            )
            .to_ascii_lowercase()
        });
        let task = tokio::spawn({
            let requests = requests.clone();
            let connections = connections.clone();
            async move {
                while let Ok((tcp, _)) = listener.accept().await {
                    connections.fetch_add(1, Ordering::SeqCst);
                    let requests = requests.clone();
                    let expected = expected.clone();
                    tokio::spawn(async move {
                        let _ = serve(tcp, expected, requests).await;
                    });
                }
            }
        });
        Ok(Self {
            port,
            requests,
            connections,
            task,
        })
    }

    pub fn url(&self, userinfo: &str) -> String {
        format!("http://{userinfo}127.0.0.1:{}", self.port)
    }

    /// The CONNECT request heads received, in order.
    pub fn requests(&self) -> Vec<String> {
        self.requests.lock().map(|r| r.clone()).unwrap_or_default()
    }

    /// TCP connections accepted.
    pub fn connections(&self) -> usize {
        self.connections.load(Ordering::SeqCst)
    }
}

async fn serve(
    mut tcp: TcpStream,
    expected: Option<String>,
    requests: Arc<Mutex<Vec<String>>>,
) -> Result<()> {
    let mut head = Vec::new();
    while !head.ends_with(b"\r\n\r\n") {
        let mut byte = [0u8; 1];
        if tcp.read(&mut byte).await? == 0 {
            return Ok(());
        }
        head.push(byte[0]);
    }
    let head = String::from_utf8(head)?;
    if let Ok(mut r) = requests.lock() {
        r.push(head.clone());
    }
    if let Some(expected) = expected
        && !head
            .to_ascii_lowercase()
            .lines()
            .any(|l| l.trim() == expected)
    {
        tcp.write_all(b"HTTP/1.1 407 Proxy Authentication Required\r\nContent-Length: 0\r\n\r\n")
            .await?;
        return Ok(());
    }
    let target = head
        .split_whitespace()
        .nth(1)
        .context("no CONNECT target")?
        .to_owned();
    let mut upstream = TcpStream::connect(target).await?;
    tcp.write_all(b"HTTP/1.1 200 Connection established\r\n\r\n")
        .await?;
    tokio::io::copy_bidirectional(&mut tcp, &mut upstream).await?;
    Ok(())
}
