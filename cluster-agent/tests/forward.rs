//! Serving a stream (here a `tokio::io::duplex`, as the tunnel's `Stream` would be) against a real HTTPS
//! upstream: what reaches the apiserver, and what cannot.

mod common;

use std::time::Duration;

use anyhow::{Context as _, Result, ensure};
use bytes::Bytes;
use common::{AgentCreds, TestApiserver};
use http::{Request, StatusCode, Version};
use http_body_util::{BodyExt, Empty, Full};
use hyper::body::Incoming;
use hyper_util::rt::TokioIo;
use tether_agent::forward::{Upstream, serve_heads, serve_stream};
use tether_tunnel::heads;
use tokio::io::{AsyncReadExt, AsyncWriteExt, DuplexStream};

const DEADLINE: Duration = Duration::from_secs(10);

/// One stream: the agent side is served by `serve_stream`, the returned end is the relay's.
fn stream(
    upstream: &Upstream,
) -> (
    DuplexStream,
    tokio::task::JoinHandle<Result<(), hyper::Error>>,
) {
    let (relay_end, agent_end) = tokio::io::duplex(64 * 1024);
    let served = tokio::spawn(serve_stream(agent_end, upstream.clone()));
    (relay_end, served)
}

/// Sends one request over a fresh stream with a hyper HTTP/1.1 client, as the relay does.
async fn send<B>(upstream: &Upstream, req: Request<B>) -> Result<http::Response<Incoming>>
where
    B: hyper::body::Body + Send + 'static,
    B::Data: Send,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    let (relay_end, _served) = stream(upstream);
    let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(relay_end)).await?;
    tokio::spawn(conn.with_upgrades());
    Ok(sender.send_request(req).await?)
}

/// Writes a raw request and reads the raw response until the agent closes the stream.
async fn raw(upstream: &Upstream, request: &str) -> Result<String> {
    let (mut relay_end, _served) = stream(upstream);
    relay_end.write_all(request.as_bytes()).await?;
    let mut out = Vec::new();
    tokio::time::timeout(DEADLINE, relay_end.read_to_end(&mut out)).await??;
    Ok(String::from_utf8_lossy(&out).into_owned())
}

async fn body_json(resp: http::Response<Incoming>) -> Result<serde_json::Value> {
    let bytes = resp.into_body().collect().await?.to_bytes();
    Ok(serde_json::from_slice(&bytes)?)
}

async fn setup() -> Result<(TestApiserver, Upstream, tempfile::TempDir)> {
    tether_runtime::tls::install_crypto_provider();
    let api = TestApiserver::start().await?;
    let dir = tempfile::tempdir()?;
    // The agent's own kubeconfig user has a token and a client certificate: forwarding must use neither.
    let creds = AgentCreds {
        token: "agent-own-token".into(),
        client: api.ca.issue(&["system:tether-agent"])?,
    };
    let kube_config = api.kube_config(dir.path(), Some(&creds)).await?;
    let upstream = Upstream::from_kube_config(&kube_config)?;
    Ok((api, upstream, dir))
}

#[tokio::test]
async fn path_and_query_reach_the_apiserver_with_the_users_authorization_only() -> Result<()> {
    let (api, upstream, _dir) = setup().await?;
    let req = Request::get("/api/v1/namespaces/default/pods?labelSelector=app%3Dweb&limit=2")
        .header("host", "relay.example")
        .header("authorization", "Bearer user-token-123")
        .header("impersonate-user", "alice")
        .header("connection", "keep-alive, x-hop")
        .header("x-hop", "drop me")
        .body(Empty::<Bytes>::new())?;
    let resp = send(&upstream, req).await?;
    assert_eq!(resp.status(), StatusCode::OK);
    // One exchange per stream.
    assert_eq!(resp.headers()["connection"], "close");
    let json = body_json(resp).await?;
    assert_eq!(json["path"], "/api/v1/namespaces/default/pods");
    assert_eq!(json["query"], "labelSelector=app%3Dweb&limit=2");

    let seen = api.seen();
    assert_eq!(seen.len(), 1);
    let s = &seen[0];
    assert_eq!(s.headers["authorization"], "Bearer user-token-123");
    assert_eq!(s.headers.get_all("authorization").iter().count(), 1);
    assert_eq!(s.headers["impersonate-user"], "alice");
    assert!(
        s.headers.get("x-hop").is_none(),
        "a header named by Connection is hop-by-hop"
    );
    assert!(
        !s.client_cert,
        "the agent must not present its own client certificate"
    );
    // Ordinary requests use the pooled client, which negotiates h2 with an apiserver that offers it.
    assert_eq!(s.version, Version::HTTP_2);
    // Host (or :authority on h2) is the apiserver's, never the relay's.
    let host = s
        .headers
        .get("host")
        .and_then(|h| h.to_str().ok())
        .map(str::to_string);
    let authority = s
        .uri
        .parse::<http::Uri>()?
        .authority()
        .map(|a| a.to_string());
    let expected = format!("127.0.0.1:{}", api.addr.port());
    assert!(
        host.as_deref() == Some(expected.as_str())
            || authority.as_deref() == Some(expected.as_str())
    );
    Ok(())
}

#[tokio::test]
async fn no_agent_credential_is_added_when_the_user_sends_none() -> Result<()> {
    let (api, upstream, _dir) = setup().await?;
    let resp = send(
        &upstream,
        Request::get("/version").body(Empty::<Bytes>::new())?,
    )
    .await?;
    assert_eq!(resp.status(), StatusCode::OK);
    let seen = api.seen();
    assert_eq!(seen.len(), 1);
    assert!(seen[0].headers.get("authorization").is_none());
    assert!(!seen[0].client_cert);
    Ok(())
}

#[tokio::test]
async fn request_bodies_are_forwarded() -> Result<()> {
    let (api, upstream, _dir) = setup().await?;
    let req = Request::post("/api/v1/namespaces/default/configmaps")
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from_static(br#"{"kind":"ConfigMap"}"#)))?;
    let resp = send(&upstream, req).await?;
    assert_eq!(resp.status(), StatusCode::OK);
    assert_eq!(body_json(resp).await?["method"], "POST");
    assert_eq!(api.seen()[0].headers["content-length"], "20");
    Ok(())
}

/// Bodies larger than the apiserver's HTTP/2 windows, sent on either kind of stream: the agent sends them as the
/// windows open, and every byte arrives in order.
#[tokio::test]
async fn request_bodies_larger_than_the_http2_windows_arrive_whole() -> Result<()> {
    let (api, upstream, _dir) = setup().await?;
    let body: Vec<u8> = (0..5 * 1024 * 1024 + 7)
        .map(|i: u32| (i.wrapping_mul(31) % 251) as u8)
        .collect();
    let want = serde_json::json!({"length": body.len(), "digest": common::digest(&body)});

    let req = Request::post("/digest").body(Full::new(Bytes::from(body.clone())))?;
    let resp = tokio::time::timeout(DEADLINE, send(&upstream, req)).await??;
    assert_eq!(resp.status(), StatusCode::OK);
    let got = tokio::time::timeout(DEADLINE, body_json(resp)).await??;
    assert_eq!(got, want, "through a stream of kind HTTP");

    let (head, mut io) = heads_exchange(
        &upstream,
        http::Method::POST,
        "/digest",
        http::HeaderMap::new(),
        Some(&body),
    )
    .await?;
    assert_eq!(head.status, StatusCode::OK);
    let got: serde_json::Value = serde_json::from_slice(&read_rest(&mut io).await?)?;
    assert_eq!(got, want, "through a stream of kind HTTP_HEADS");

    let seen = api.seen();
    assert_eq!(seen.len(), 2);
    assert!(seen.iter().all(|s| s.version == Version::HTTP_2));
    Ok(())
}

#[tokio::test]
async fn absolute_uri_naming_another_host_is_refused() -> Result<()> {
    let (api, upstream, _dir) = setup().await?;
    // Another HTTPS server the agent can reach: it must never see a request.
    let other = TestApiserver::start().await?;
    let request = format!(
        "GET https://127.0.0.1:{port}/api/v1/secrets HTTP/1.1\r\nhost: 127.0.0.1:{port}\r\n\r\n",
        port = other.addr.port()
    );
    let response = raw(&upstream, &request).await?;
    assert!(response.starts_with("HTTP/1.1 400"), "{response}");
    assert!(response.contains(r#""kind":"Status""#), "{response}");
    assert!(other.seen().is_empty());
    assert!(api.seen().is_empty());

    // A Host header naming the other server changes nothing: the request goes to the apiserver.
    let request = format!(
        "GET /version HTTP/1.1\r\nhost: 127.0.0.1:{}\r\n\r\n",
        other.addr.port()
    );
    let response = raw(&upstream, &request).await?;
    assert!(response.starts_with("HTTP/1.1 200"), "{response}");
    assert!(other.seen().is_empty());
    assert_eq!(api.seen().len(), 1);

    // Absolute-form naming the apiserver itself is served.
    let request = format!("GET {}/version HTTP/1.1\r\nhost: x\r\n\r\n", api.url());
    let response = raw(&upstream, &request).await?;
    assert!(response.starts_with("HTTP/1.1 200"), "{response}");
    Ok(())
}

#[tokio::test]
async fn connect_is_refused() -> Result<()> {
    let (api, upstream, _dir) = setup().await?;
    let other = TestApiserver::start().await?;
    let request = format!(
        "CONNECT 127.0.0.1:{p} HTTP/1.1\r\nhost: 127.0.0.1:{p}\r\n\r\n",
        p = other.addr.port()
    );
    let response = raw(&upstream, &request).await?;
    assert!(response.starts_with("HTTP/1.1 405"), "{response}");
    assert!(other.seen().is_empty());
    assert!(api.seen().is_empty());
    Ok(())
}

#[tokio::test]
async fn streaming_response_is_delivered_chunk_by_chunk() -> Result<()> {
    let (_api, upstream, _dir) = setup().await?;
    let feed = _api.stream_sender();
    let resp = send(
        &upstream,
        Request::get("/stream?follow=true").body(Empty::<Bytes>::new())?,
    )
    .await?;
    assert_eq!(resp.status(), StatusCode::OK);
    let mut body = resp.into_body();

    // Each chunk is read before the next one exists upstream: nothing is buffered whole.
    for i in 0..3 {
        let chunk = format!("line {i}\n");
        feed.send(Bytes::from(chunk.clone())).await?;
        let mut got = Vec::new();
        while got.len() < chunk.len() {
            let frame = tokio::time::timeout(DEADLINE, body.frame())
                .await?
                .context("body ended early")??;
            if let Some(data) = frame.data_ref() {
                got.extend_from_slice(data);
            }
        }
        assert_eq!(String::from_utf8(got)?, chunk);
    }
    drop(feed);
    drop(_api);
    Ok(())
}

#[tokio::test]
async fn upgrade_becomes_a_byte_pipe_with_half_close() -> Result<()> {
    let (api, upstream, _dir) = setup().await?;
    let req = Request::get("/upgrade")
        .header("connection", "Upgrade")
        .header("upgrade", "tether-test")
        .header("authorization", "Bearer user-token")
        .body(Empty::<Bytes>::new())?;
    let mut resp = send(&upstream, req).await?;
    assert_eq!(resp.status(), StatusCode::SWITCHING_PROTOCOLS);
    assert_eq!(resp.headers()["x-upstream"], "yes");
    assert_eq!(resp.headers()["upgrade"], "tether-test");
    // `close` on a 101 makes WebSocket clients (kubectl exec) reject the handshake.
    let connection: Vec<_> = resp.headers().get_all("connection").iter().collect();
    assert!(connection.iter().all(|v| {
        !v.to_str()
            .unwrap_or("")
            .to_ascii_lowercase()
            .contains("close")
    }));

    let upgraded = hyper::upgrade::on(&mut resp).await?;
    let mut io = TokioIo::new(upgraded);
    io.write_all(b"hello over the pipe").await?;
    // Half-close: the apiserver side reads EOF, and can still answer afterwards.
    io.shutdown().await?;
    let mut reply = Vec::new();
    tokio::time::timeout(DEADLINE, io.read_to_end(&mut reply)).await??;
    assert_eq!(reply, b"bye:hello over the pipe");

    let seen = api.seen();
    assert_eq!(seen.len(), 1);
    // Upgrades go over HTTP/1.1 (an h2 connection cannot upgrade).
    assert_eq!(seen[0].version, Version::HTTP_11);
    assert_eq!(seen[0].headers["upgrade"], "tether-test");
    assert_eq!(seen[0].headers["authorization"], "Bearer user-token");
    assert!(!seen[0].client_cert);
    Ok(())
}

#[tokio::test]
async fn stream_serving_ends_after_the_upgraded_pipe_ends() -> Result<()> {
    let (_api, upstream, _dir) = setup().await?;
    let (relay_end, served) = stream(&upstream);
    let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(relay_end)).await?;
    tokio::spawn(conn.with_upgrades());
    let req = Request::get("/upgrade")
        .header("connection", "Upgrade")
        .header("upgrade", "tether-test")
        .body(Empty::<Bytes>::new())?;
    let mut resp = sender.send_request(req).await?;
    let mut io = TokioIo::new(hyper::upgrade::on(&mut resp).await?);
    assert!(
        !served.is_finished(),
        "the pipe is open, the stream is still being served"
    );
    io.shutdown().await?;
    let mut reply = Vec::new();
    io.read_to_end(&mut reply).await?;
    drop(io);
    tokio::time::timeout(DEADLINE, served).await???;
    Ok(())
}

#[tokio::test]
async fn unreachable_apiserver_is_a_502_status() -> Result<()> {
    tether_runtime::tls::install_crypto_provider();
    let port = {
        let listener = std::net::TcpListener::bind("127.0.0.1:0")?;
        listener.local_addr()?.port()
    };
    let upstream = Upstream::from_kube_config(&kube::Config::new(
        format!("https://127.0.0.1:{port}").parse()?,
    ))?;
    let resp = send(&upstream, Request::get("/api").body(Empty::<Bytes>::new())?).await?;
    assert_eq!(resp.status(), StatusCode::BAD_GATEWAY);
    let json = body_json(resp).await?;
    assert_eq!(json["kind"], "Status");
    assert_eq!(json["code"], 502);
    let message = json["message"].as_str().unwrap_or_default();
    ensure!(message.contains("cannot reach the apiserver"), "{message}");
    Ok(())
}

#[tokio::test]
async fn apiserver_connect_timeout_is_a_504_status() -> Result<()> {
    tether_runtime::tls::install_crypto_provider();
    // Accepts TCP but never answers the TLS handshake.
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let port = listener.local_addr()?.port();
    let hold = tokio::spawn(async move {
        let mut held = Vec::new();
        while let Ok((tcp, _)) = listener.accept().await {
            held.push(tcp);
        }
    });
    let mut config = kube::Config::new(format!("https://127.0.0.1:{port}").parse()?);
    config.connect_timeout = Some(Duration::from_millis(200));
    let upstream = Upstream::from_kube_config(&config)?;
    let resp = send(&upstream, Request::get("/api").body(Empty::<Bytes>::new())?).await?;
    assert_eq!(resp.status(), StatusCode::GATEWAY_TIMEOUT);
    let json = body_json(resp).await?;
    assert_eq!(json["code"], 504);
    hold.abort();
    Ok(())
}

#[tokio::test]
async fn untrusted_apiserver_certificate_is_a_502() -> Result<()> {
    tether_runtime::tls::install_crypto_provider();
    let api = TestApiserver::start().await?;
    // Trusts another CA than the one that issued the apiserver's certificate.
    let mut config = kube::Config::new(api.url().parse()?);
    config.root_cert = Some(vec![common::TestCa::new()?.der()]);
    let upstream = Upstream::from_kube_config(&config)?;
    let resp = send(&upstream, Request::get("/api").body(Empty::<Bytes>::new())?).await?;
    assert_eq!(resp.status(), StatusCode::BAD_GATEWAY);
    assert!(api.seen().is_empty());
    Ok(())
}

#[tokio::test]
async fn the_authentication_proxy_needs_credentials_of_the_agents_own() -> Result<()> {
    tether_runtime::tls::install_crypto_provider();
    let api = TestApiserver::start().await?;
    let dir = tempfile::tempdir()?;
    let entra = tether_agent::EntraConfig {
        tenants: vec!["72f988bf-86f1-41af-91ab-2d7cd011db47".into()],
        audiences: vec!["api://tether".into()],
        ..Default::default()
    };
    let proxy = tether_agent::auth_proxy::AuthProxy::new(&entra, None)?;

    let anonymous = api.kube_config(dir.path(), None).await?;
    let refused = Upstream::with_auth_proxy(&anonymous, proxy.clone());
    assert!(
        matches!(
            refused,
            Err(tether_agent::forward::UpstreamError::NoOwnCredentials)
        ),
        "{refused:?}"
    );

    let creds = AgentCreds {
        token: "agent-own-token".into(),
        client: api.ca.issue(&["system:tether-agent"])?,
    };
    let own = api.kube_config(dir.path(), Some(&creds)).await?;
    let upstream = Upstream::with_auth_proxy(&own, proxy)?;
    assert!(upstream.impersonates());
    // Without an Entra token, nothing changes: the user's credential only.
    let req = Request::get("/api")
        .header("authorization", "Bearer user-token")
        .body(Empty::<Bytes>::new())?;
    assert_eq!(send(&upstream, req).await?.status(), StatusCode::OK);
    let seen = api.seen();
    assert_eq!(seen[0].headers["authorization"], "Bearer user-token");
    assert!(!seen[0].client_cert);
    Ok(())
}

/// The upstream follows a rotation of the cluster CA the way kube-rs's own client does: the CA file the kube
/// config names (`root_cert_file`, in-cluster the service-account `ca.crt` the kubelet rewrites) is read again
/// (kube-rs: about every 60 s), so an apiserver serving a certificate from the new CA is trusted without
/// restarting the agent. With the CA read once at start, the requests after the rotation would fail forever.
#[tokio::test]
async fn the_upstream_follows_a_cluster_ca_rotation() -> Result<()> {
    use std::sync::{Arc, Mutex};
    tether_runtime::tls::install_crypto_provider();
    let dir = tempfile::tempdir()?;
    let ca_file = dir.path().join("ca.crt");
    let (old, new) = (common::TestCa::new()?, common::TestCa::new()?);
    std::fs::write(&ca_file, old.pem())?;
    // HTTP/1.1 without keep-alive: every request is a new TLS handshake against the current certificate.
    let server_config = |ca: &common::TestCa| -> Result<Arc<rustls::ServerConfig>> {
        let mut config = (*ca.server_config(&["127.0.0.1", "localhost"])?).clone();
        config.alpn_protocols = vec![b"http/1.1".to_vec()];
        Ok(Arc::new(config))
    };
    let acceptor = Arc::new(Mutex::new(tokio_rustls::TlsAcceptor::from(server_config(
        &old,
    )?)));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let port = listener.local_addr()?.port();
    let server = {
        let acceptor = acceptor.clone();
        tokio::spawn(async move {
            while let Ok((tcp, _)) = listener.accept().await {
                let tls = acceptor.lock().map(|a| a.clone());
                let Ok(tls) = tls else { return };
                tokio::spawn(async move {
                    let Ok(stream) = tls.accept(tcp).await else {
                        return;
                    };
                    let service = hyper::service::service_fn(|_req| async {
                        Ok::<_, std::convert::Infallible>(http::Response::new(Full::new(
                            Bytes::from_static(b"{}"),
                        )))
                    });
                    let _ = hyper::server::conn::http1::Builder::new()
                        .keep_alive(false)
                        .serve_connection(TokioIo::new(stream), service)
                        .await;
                });
            }
        })
    };
    let mut config = kube::Config::new(format!("https://127.0.0.1:{port}").parse()?);
    config.root_cert_file = Some(ca_file.clone());
    let upstream = Upstream::from_kube_config(&config)?;
    let get = || Request::get("/version").body(Empty::<Bytes>::new());
    assert_eq!(send(&upstream, get()?).await?.status(), StatusCode::OK);

    // Rotation: the apiserver serves a certificate from the new CA, and the CA file says so.
    *acceptor.lock().map_err(|_| anyhow::anyhow!("poisoned"))? =
        tokio_rustls::TlsAcceptor::from(server_config(&new)?);
    std::fs::write(&ca_file, new.pem())?;
    let give_up = tokio::time::Instant::now() + Duration::from_secs(150);
    loop {
        if send(&upstream, get()?).await?.status() == StatusCode::OK {
            break;
        }
        ensure!(
            tokio::time::Instant::now() < give_up,
            "the new CA was never trusted"
        );
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
    server.abort();
    Ok(())
}

// Streams of kind HTTP_HEADS: the same guarantees with binary heads instead of HTTP/1.1 on the stream.

/// One exchange on a stream of kind `HTTP_HEADS` served by `serve_heads`: writes the request head (and body,
/// then finishes unless it is an upgrade) and reads the response head; the relay's end is returned for the rest.
async fn heads_exchange(
    upstream: &Upstream,
    method: http::Method,
    target: &str,
    headers: http::HeaderMap,
    body: Option<&[u8]>,
) -> Result<(heads::ResponseHead, DuplexStream)> {
    let (mut relay_end, agent_end) = tokio::io::duplex(64 * 1024);
    tokio::spawn(serve_heads(agent_end, upstream.clone(), || {}));
    let upgrade = headers.contains_key("upgrade");
    let block = heads::encode_request(&method, target, &headers, body.is_some())?;
    relay_end.write_all(&block).await?;
    if let Some(body) = body {
        relay_end.write_all(body).await?;
    }
    if !upgrade {
        relay_end.shutdown().await?;
    }
    let block = tokio::time::timeout(DEADLINE, heads::read_block(&mut relay_end, 1 << 20))
        .await??
        .context("the agent sent no response head")?;
    Ok((heads::decode_response(block)?, relay_end))
}

async fn read_rest(io: &mut DuplexStream) -> Result<Vec<u8>> {
    let mut out = Vec::new();
    tokio::time::timeout(DEADLINE, io.read_to_end(&mut out)).await??;
    Ok(out)
}

#[tokio::test]
async fn heads_path_query_and_body_reach_the_apiserver_with_the_users_authorization_only()
-> Result<()> {
    let (api, upstream, _dir) = setup().await?;
    let mut headers = http::HeaderMap::new();
    headers.insert("host", "relay.example".parse()?);
    headers.insert("authorization", "Bearer user-token-123".parse()?);
    headers.insert("content-type", "application/json".parse()?);
    let (head, mut io) = heads_exchange(
        &upstream,
        http::Method::POST,
        "/api/v1/namespaces/default/configmaps?dryRun=All",
        headers,
        Some(br#"{"kind":"ConfigMap"}"#),
    )
    .await?;
    assert_eq!(head.status, StatusCode::OK);
    assert!(head.body);
    assert!(head.headers.get("connection").is_none());
    let json: serde_json::Value = serde_json::from_slice(&read_rest(&mut io).await?)?;
    assert_eq!(json["method"], "POST");
    assert_eq!(json["path"], "/api/v1/namespaces/default/configmaps");
    assert_eq!(json["query"], "dryRun=All");
    let seen = api.seen();
    assert_eq!(seen.len(), 1);
    assert_eq!(seen[0].headers["authorization"], "Bearer user-token-123");
    assert!(!seen[0].client_cert);
    assert_eq!(seen[0].version, Version::HTTP_2);
    Ok(())
}

#[tokio::test]
async fn heads_naming_another_host_or_connect_never_leave_the_apiserver() -> Result<()> {
    let (api, upstream, _dir) = setup().await?;
    let other = TestApiserver::start().await?;
    let elsewhere = format!("https://127.0.0.1:{}/api/v1/secrets", other.addr.port());
    // An absolute target is not a path: refused before anything is sent anywhere.
    let (head, mut io) = heads_exchange(
        &upstream,
        http::Method::GET,
        &elsewhere,
        http::HeaderMap::new(),
        None,
    )
    .await?;
    assert_eq!(head.status, StatusCode::BAD_REQUEST);
    let text = String::from_utf8(read_rest(&mut io).await?)?;
    assert!(text.contains(r#""kind":"Status""#), "{text}");
    let (head, _) = heads_exchange(
        &upstream,
        http::Method::CONNECT,
        "/",
        http::HeaderMap::new(),
        None,
    )
    .await?;
    assert_eq!(head.status, StatusCode::METHOD_NOT_ALLOWED);
    assert!(other.seen().is_empty());
    assert!(api.seen().is_empty());
    Ok(())
}

#[tokio::test]
async fn heads_that_do_not_decode_or_are_too_large_get_a_400_and_nothing_is_sent() -> Result<()> {
    let (api, upstream, _dir) = setup().await?;
    let too_large = (1u32 << 20).to_be_bytes();
    for bad in [
        &b"GET / HTTP/1.1\r\n\r\n"[..], // HTTP/1.1 text: an absurd length
        &too_large[..],                 // a 1 MiB head announced
        &b"\0\0\0\x05\0\x03GE"[..],     // truncated, then the stream ends
        &b"\0\0\0\x0a\0\x03G T\0\x01/\0\0"[..], // a method with a space
    ] {
        let (mut relay_end, agent_end) = tokio::io::duplex(64 * 1024);
        let served = tokio::spawn(serve_heads(agent_end, upstream.clone(), || {}));
        relay_end.write_all(bad).await?;
        relay_end.shutdown().await?;
        let block = tokio::time::timeout(DEADLINE, heads::read_block(&mut relay_end, 1 << 20))
            .await??
            .with_context(|| format!("{bad:?}: no answer"))?;
        let answer = heads::decode_response(block)?;
        assert_eq!(answer.status, StatusCode::BAD_REQUEST, "{bad:?}");
        read_rest(&mut relay_end).await?;
        tokio::time::timeout(DEADLINE, served).await???;
    }
    assert!(api.seen().is_empty());
    Ok(())
}

#[tokio::test]
async fn heads_upgrade_becomes_a_byte_pipe_with_half_close() -> Result<()> {
    let (api, upstream, _dir) = setup().await?;
    let mut headers = http::HeaderMap::new();
    headers.insert("connection", "upgrade".parse()?);
    headers.insert("upgrade", "tether-test".parse()?);
    let (head, mut io) =
        heads_exchange(&upstream, http::Method::GET, "/upgrade", headers, None).await?;
    assert_eq!(head.status, StatusCode::SWITCHING_PROTOCOLS);
    assert_eq!(head.headers["upgrade"], "tether-test");
    io.write_all(b"hello over the pipe").await?;
    io.shutdown().await?;
    assert_eq!(read_rest(&mut io).await?, b"bye:hello over the pipe");
    assert_eq!(api.seen()[0].version, Version::HTTP_11);
    Ok(())
}
