//! `ws::connect_with_proxy` and `proxy::dial` against an in-test HTTP CONNECT proxy on 127.0.0.1: the
//! CONNECT request (target, Basic credentials), tunnelling, refusals (407), malformed and over-long answers,
//! and the bypass list.

mod common;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::Context as _;
use base64::Engine as _;
use common::{ServerOptions, open_options, pki, round_trip, spawn_echo_server, tls_server, within};
use http::HeaderMap;
use tether_runtime::tls;
use tether_tunnel::proxy::{self, ProxyConfig, ProxyError};
use tether_tunnel::ws::{self, ConnectError};
use tether_tunnel::{Role, SessionConfig};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::mpsc;

/// How the fake proxy answers a CONNECT.
#[derive(Clone)]
enum Answer {
    /// `200 Connection established`, then pipe bytes to the requested target.
    Tunnel,
    /// This status line and header, then close.
    Raw(Vec<u8>),
}

/// A CONNECT proxy: records each request header, requires `Proxy-Authorization` when `auth` is set (407
/// otherwise), answers with `answer`.
struct FakeProxy {
    port: u16,
    requests: Arc<Mutex<Vec<String>>>,
    accepted: Arc<AtomicUsize>,
}

impl FakeProxy {
    async fn start(answer: Answer, auth: Option<(&str, &str)>) -> anyhow::Result<Self> {
        let listener = TcpListener::bind("127.0.0.1:0").await?;
        let port = listener.local_addr()?.port();
        let requests = Arc::new(Mutex::new(Vec::new()));
        let accepted = Arc::new(AtomicUsize::new(0));
        let expected = auth.map(|(u, p)| {
            format!(
                "proxy-authorization: basic {}",
                base64::engine::general_purpose::STANDARD.encode(format!("{u}:{p}"))
            )
            .to_ascii_lowercase()
        });
        tokio::spawn({
            let requests = requests.clone();
            let accepted = accepted.clone();
            async move {
                while let Ok((tcp, _)) = listener.accept().await {
                    accepted.fetch_add(1, Ordering::SeqCst);
                    let requests = requests.clone();
                    let answer = answer.clone();
                    let expected = expected.clone();
                    tokio::spawn(async move {
                        let _ = serve(tcp, answer, expected, requests).await;
                    });
                }
            }
        });
        Ok(Self {
            port,
            requests,
            accepted,
        })
    }

    fn url(&self, userinfo: &str) -> String {
        format!("http://{userinfo}127.0.0.1:{}", self.port)
    }

    fn requests(&self) -> Vec<String> {
        self.requests.lock().map(|r| r.clone()).unwrap_or_default()
    }
}

async fn serve(
    mut tcp: TcpStream,
    answer: Answer,
    expected_auth: Option<String>,
    requests: Arc<Mutex<Vec<String>>>,
) -> anyhow::Result<()> {
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
    if let Some(expected) = expected_auth
        && !head
            .to_ascii_lowercase()
            .lines()
            .any(|l| l.trim() == expected)
    {
        tcp.write_all(
            b"HTTP/1.1 407 Proxy Authentication Required\r\nProxy-Authenticate: Basic realm=\"t\"\r\nContent-Length: 0\r\n\r\n",
        )
        .await?;
        return Ok(());
    }
    match answer {
        Answer::Raw(bytes) => {
            tcp.write_all(&bytes).await?;
            Ok(())
        }
        Answer::Tunnel => {
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
    }
}

/// A TLS tunnel server; returns its port and the channel of server-side connections.
async fn relay() -> anyhow::Result<(
    common::Pki,
    u16,
    mpsc::UnboundedReceiver<tether_tunnel::Connection>,
)> {
    let pki = pki()?;
    let (tx, rx) = mpsc::unbounded_channel();
    let port = tls_server(&pki, ServerOptions::new(), tx).await?;
    Ok((pki, port, rx))
}

async fn connect(
    pki: &common::Pki,
    url: &str,
    proxy: Option<&ProxyConfig>,
) -> Result<tether_tunnel::Connection, ConnectError> {
    let client_tls = tls::client_config(Some(pki.ca_pem.as_bytes()), &[])
        .map_err(|e| ConnectError::Handshake(e.to_string()))?;
    ws::connect_with_proxy(
        url,
        client_tls,
        HeaderMap::new(),
        SessionConfig::new(Role::Client),
        proxy,
    )
    .await
}

#[tokio::test]
async fn tunnel_through_a_proxy_with_basic_auth() -> anyhow::Result<()> {
    let (pki, port, mut accepted) = relay().await?;
    let fake = FakeProxy::start(Answer::Tunnel, Some(("agent", "p@ss:word"))).await?;
    let config = ProxyConfig::parse(&fake.url("agent:p%40ss%3Aword@"), None)?;

    let url = format!("wss://localhost:{port}/agent/v1/tunnel");
    let client = within("connect", connect(&pki, &url, Some(&config))).await??;
    let server = within("server", accepted.recv())
        .await?
        .context("no server connection")?;
    let _echo = spawn_echo_server(server);
    let stream = client.open(open_options("via proxy"))?;
    assert_eq!(
        within("echo", round_trip(stream, b"through the proxy".to_vec())).await??,
        b"through the proxy"
    );

    let requests = fake.requests();
    assert_eq!(requests.len(), 1);
    let request = &requests[0];
    assert!(
        request.starts_with(&format!("CONNECT localhost:{port} HTTP/1.1\r\n")),
        "{request}"
    );
    assert!(
        request.contains(&format!("\r\nHost: localhost:{port}\r\n")),
        "{request}"
    );
    let basic = base64::engine::general_purpose::STANDARD.encode("agent:p@ss:word");
    assert!(
        request.contains(&format!("\r\nProxy-Authorization: Basic {basic}\r\n")),
        "{request}"
    );
    Ok(())
}

#[tokio::test]
async fn proxy_auth_required_is_a_clear_407_error() -> anyhow::Result<()> {
    let (pki, port, _accepted) = relay().await?;
    let fake = FakeProxy::start(Answer::Tunnel, Some(("agent", "right"))).await?;
    let url = format!("wss://localhost:{port}/");

    for (userinfo, hint) in [
        ("", "the proxy wants credentials"),
        ("agent:wrong@", "check the proxy user name and password"),
    ] {
        let config = ProxyConfig::parse(&fake.url(userinfo), None)?;
        let err = within("connect", connect(&pki, &url, Some(&config)))
            .await?
            .err()
            .context("the proxy must refuse")?;
        assert!(
            matches!(
                &err,
                ConnectError::Proxy(ProxyError::Refused { status: 407, .. })
            ),
            "{err:?}"
        );
        let text = err.to_string();
        assert!(
            text.starts_with("proxy refused CONNECT: 407 Proxy Authentication Required"),
            "{text}"
        );
        assert!(text.contains(hint), "{text}");
        assert!(
            !text.contains("wrong"),
            "the password must not be printed: {text}"
        );
    }
    Ok(())
}

#[tokio::test]
async fn other_refusals_and_bad_answers() -> anyhow::Result<()> {
    let cases: Vec<(Vec<u8>, &str)> = vec![
        (
            b"HTTP/1.1 403 Forbidden\r\nContent-Length: 0\r\n\r\n".to_vec(),
            "proxy refused CONNECT: 403 Forbidden",
        ),
        // tinyproxy answers a CONNECT with bad or missing credentials with 401, not 407.
        (
            b"HTTP/1.1 401 Unauthorized\r\nContent-Length: 0\r\n\r\n".to_vec(),
            "proxy refused CONNECT: 401 Unauthorized (proxy http://127.0.0.1:",
        ),
        (
            b"SSH-2.0-OpenSSH_9.6\r\n\r\n".to_vec(),
            "not an HTTP response",
        ),
        (
            b"HTTP/1.1 200 OK\r\n".to_vec(),
            "in the middle of its response",
        ),
        (Vec::new(), "closed the connection without answering"),
        (
            {
                // A header that never ends within the bound.
                let mut long = b"HTTP/1.1 200 OK\r\n".to_vec();
                while long.len() <= proxy::MAX_RESPONSE_HEADER {
                    long.extend_from_slice(
                        b"X-Padding: aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa\r\n",
                    );
                }
                long
            },
            "longer than 8192 bytes",
        ),
    ];
    for (answer, expected) in cases {
        let fake = FakeProxy::start(Answer::Raw(answer), None).await?;
        let config = ProxyConfig::parse(&fake.url(""), None)?;
        let err = within(
            "dial",
            proxy::dial("relay.example", 443, Some(&config), Duration::from_secs(30)),
        )
        .await?
        .err()
        .context("dial must fail")?;
        assert!(err.to_string().contains(expected), "{expected}: {err}");
        if expected.contains("401") {
            assert!(
                err.to_string().contains("the proxy wants credentials"),
                "{err}"
            );
        }
        assert_eq!(fake.requests().len(), 1);
    }
    Ok(())
}

#[tokio::test]
async fn bypassed_hosts_are_dialled_directly() -> anyhow::Result<()> {
    let (pki, port, mut accepted) = relay().await?;
    let fake = FakeProxy::start(Answer::Tunnel, None).await?;
    let config = ProxyConfig::parse(&fake.url(""), Some("example.org, localhost"))?;
    let client = within(
        "connect",
        connect(&pki, &format!("wss://localhost:{port}/"), Some(&config)),
    )
    .await??;
    within("server", accepted.recv())
        .await?
        .context("no server connection")?;
    drop(client);
    assert_eq!(fake.accepted.load(Ordering::SeqCst), 0);

    // 127.0.0.1 is not in the list: through the proxy.
    let _client = within(
        "connect",
        connect(&pki, &format!("wss://127.0.0.1:{port}/"), Some(&config)),
    )
    .await??;
    assert_eq!(fake.accepted.load(Ordering::SeqCst), 1);
    assert!(fake.requests()[0].starts_with(&format!("CONNECT 127.0.0.1:{port} ")));
    Ok(())
}

#[tokio::test]
async fn unreachable_proxy_names_the_proxy() -> anyhow::Result<()> {
    let port = TcpListener::bind("127.0.0.1:0").await?.local_addr()?.port();
    let config = ProxyConfig::parse(&format!("http://u:secret@127.0.0.1:{port}"), None)?;
    let err = proxy::dial("relay.example", 443, Some(&config), Duration::from_secs(30))
        .await
        .err()
        .context("dial must fail")?;
    assert!(matches!(err, ProxyError::ConnectProxy { .. }), "{err:?}");
    let text = err.to_string();
    assert!(
        text.contains(&format!(
            "cannot reach the proxy http://u:***@127.0.0.1:{port}"
        )),
        "{text}"
    );
    assert!(!text.contains("secret"), "{text}");
    Ok(())
}
