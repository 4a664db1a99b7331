//! Shared test helpers: start a sample apiserver in a temp dir; a small raw HTTPS client for what kubectl does not
//! show (status codes, Status bodies, watch streams).

#![allow(dead_code, unreachable_pub)]

use std::time::Duration;

use anyhow::Context as _;
use bytes::Bytes;
use http::{Method, Request, StatusCode};
use http_body_util::{BodyExt as _, Full};
use hyper_util::rt::{TokioExecutor, TokioIo};
use rustls::pki_types::ServerName;
use serde_json::Value;
use tether_testkit::{SampleApiserver, SampleOptions, certs};

/// How long any single step may take before the test fails (a deadline, not a timing assertion).
pub const DEADLINE: Duration = Duration::from_secs(60);

pub struct Fixture {
    pub server: SampleApiserver,
    pub dir: tempfile::TempDir,
}

pub async fn start() -> anyhow::Result<Fixture> {
    let dir = tempfile::tempdir()?;
    let server = SampleApiserver::start(SampleOptions::new(dir.path())).await?;
    Ok(Fixture { server, dir })
}

/// A raw HTTPS client for the sample apiserver (HTTP/1.1 or h2).
pub struct Client {
    pub addr: std::net::SocketAddr,
    pub token: Option<String>,
    pub h2: bool,
    /// An Accept header for every request, if set.
    pub accept: Option<String>,
    tls: std::sync::Arc<rustls::ClientConfig>,
}

pub struct Reply {
    pub status: StatusCode,
    pub headers: http::HeaderMap,
    pub body: Bytes,
}

impl Reply {
    pub fn json(&self) -> anyhow::Result<Value> {
        serde_json::from_slice(&self.body)
            .with_context(|| format!("body is not JSON: {:?}", self.text()))
    }

    pub fn text(&self) -> String {
        String::from_utf8_lossy(&self.body).into_owned()
    }
}

impl Client {
    pub fn new(server: &SampleApiserver, h2: bool) -> anyhow::Result<Client> {
        let alpn: &[&[u8]] = if h2 { &[b"h2"] } else { &[b"http/1.1"] };
        Ok(Client {
            addr: server.addr(),
            token: Some(server.token().to_string()),
            h2,
            accept: None,
            tls: certs::client_config(server.ca_pem().as_bytes(), alpn)?,
        })
    }

    pub fn without_token(mut self) -> Client {
        self.token = None;
        self
    }

    /// Sends one request on a fresh connection and returns the response with its body still streaming.
    pub async fn send(
        &self,
        method: Method,
        path: &str,
        content_type: Option<&str>,
        body: Vec<u8>,
    ) -> anyhow::Result<http::Response<hyper::body::Incoming>> {
        self.send_with(method, path, content_type, body, &[]).await
    }

    /// [`Client::send`] with extra request headers.
    pub async fn send_with(
        &self,
        method: Method,
        path: &str,
        content_type: Option<&str>,
        body: Vec<u8>,
        headers: &[(&str, &str)],
    ) -> anyhow::Result<http::Response<hyper::body::Incoming>> {
        let tcp = tokio::net::TcpStream::connect(self.addr).await?;
        let tls = tokio_rustls::TlsConnector::from(self.tls.clone())
            .connect(ServerName::try_from("localhost")?.to_owned(), tcp)
            .await?;
        let mut req = Request::builder()
            .method(method)
            .uri(path)
            .header("host", "localhost");
        if self.h2 {
            req = req.uri(format!("https://localhost{path}"));
        }
        if let Some(token) = &self.token {
            req = req.header("authorization", format!("Bearer {token}"));
        }
        if let Some(accept) = &self.accept {
            req = req.header("accept", accept);
        }
        if let Some(ct) = content_type {
            req = req.header("content-type", ct);
        }
        for (name, value) in headers {
            req = req.header(*name, *value);
        }
        let req = req.body(Full::new(Bytes::from(body)))?;
        let io = TokioIo::new(tls);
        if self.h2 {
            let (mut sender, conn) =
                hyper::client::conn::http2::handshake(TokioExecutor::new(), io).await?;
            tokio::spawn(conn);
            Ok(sender.send_request(req).await?)
        } else {
            let (mut sender, conn) = hyper::client::conn::http1::handshake(io).await?;
            tokio::spawn(conn);
            Ok(sender.send_request(req).await?)
        }
    }

    pub async fn request(
        &self,
        method: Method,
        path: &str,
        content_type: Option<&str>,
        body: Vec<u8>,
    ) -> anyhow::Result<Reply> {
        let response =
            tokio::time::timeout(DEADLINE, self.send(method, path, content_type, body)).await??;
        let (parts, body) = response.into_parts();
        let body = tokio::time::timeout(DEADLINE, body.collect())
            .await??
            .to_bytes();
        Ok(Reply {
            status: parts.status,
            headers: parts.headers,
            body,
        })
    }

    /// A bodiless request with extra headers.
    pub async fn request_with(
        &self,
        method: Method,
        path: &str,
        headers: &[(&str, &str)],
    ) -> anyhow::Result<Reply> {
        let response = tokio::time::timeout(
            DEADLINE,
            self.send_with(method, path, None, Vec::new(), headers),
        )
        .await??;
        let (parts, body) = response.into_parts();
        let body = tokio::time::timeout(DEADLINE, body.collect())
            .await??
            .to_bytes();
        Ok(Reply {
            status: parts.status,
            headers: parts.headers,
            body,
        })
    }

    pub async fn get(&self, path: &str) -> anyhow::Result<Reply> {
        self.request(Method::GET, path, None, Vec::new()).await
    }

    pub async fn send_json(
        &self,
        method: Method,
        path: &str,
        content_type: &str,
        body: &Value,
    ) -> anyhow::Result<Reply> {
        self.request(method, path, Some(content_type), serde_json::to_vec(body)?)
            .await
    }
}

/// Reads newline-delimited JSON watch events from a streaming body.
pub struct Events {
    body: hyper::body::Incoming,
    buffer: Vec<u8>,
}

impl Events {
    pub fn new(response: http::Response<hyper::body::Incoming>) -> Events {
        Events {
            body: response.into_body(),
            buffer: Vec::new(),
        }
    }

    /// The next event, None when the stream ends.
    pub async fn next(&mut self) -> anyhow::Result<Option<Value>> {
        loop {
            if let Some(end) = self.buffer.iter().position(|b| *b == b'\n') {
                let line: Vec<u8> = self.buffer.drain(..=end).collect();
                return Ok(Some(serde_json::from_slice(&line)?));
            }
            let frame = tokio::time::timeout(DEADLINE, self.body.frame())
                .await
                .context("no watch event in time")?;
            match frame {
                Some(frame) => {
                    if let Ok(data) = frame?.into_data() {
                        self.buffer.extend_from_slice(&data);
                    }
                }
                None => return Ok(None),
            }
        }
    }
}

/// Reads a streaming body until it ends, cleanly or not; an error only if it is still going after [`DEADLINE`].
pub async fn drain(response: http::Response<hyper::body::Incoming>) -> anyhow::Result<()> {
    let mut body = response.into_body();
    tokio::time::timeout(DEADLINE, async {
        while let Some(Ok(_)) = body.frame().await {}
    })
    .await
    .context("the stream did not end")
}
