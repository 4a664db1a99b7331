//! A minimal stand-in for the relay's agent endpoints, built on `tether_tunnel`'s server side: onboarding with
//! a one-time token, and the tunnel upgrade with credential checks. Tests get each tunnel as a `Connection`.

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use anyhow::Result;
use bytes::Bytes;
use http::{Request, Response, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper_util::rt::{TokioExecutor, TokioIo};
use tether_tunnel::{Connection, Role, SessionConfig, ws};
use tokio::net::TcpListener;
use tokio::sync::mpsc;

use super::TestCa;

pub const CREDENTIAL: &str = "cred-for-prod";

/// What the fake relay checks and counts.
pub struct RelayState {
    pub onboarding_token: Mutex<Option<String>>,
    pub onboard_calls: AtomicUsize,
    pub tunnel_attempts: AtomicUsize,
    /// When set, the tunnel endpoint answers 401 as for a deleted cluster.
    pub revoked: AtomicBool,
    /// Headers of each tunnel request.
    pub tunnel_headers: Mutex<Vec<http::HeaderMap>>,
    tunnels: mpsc::UnboundedSender<Connection>,
}

pub struct FakeRelay {
    pub addr: SocketAddr,
    pub ca: Arc<TestCa>,
    pub state: Arc<RelayState>,
    pub tunnels: mpsc::UnboundedReceiver<Connection>,
    task: tokio::task::JoinHandle<()>,
    /// Every connection task, aborted on stop so that the port and the tunnels really go away.
    conns: Arc<Mutex<Vec<tokio::task::AbortHandle>>>,
}

impl Drop for FakeRelay {
    fn drop(&mut self) {
        self.stop();
    }
}

impl FakeRelay {
    /// Starts on `addr` (`127.0.0.1:0` for a fresh port) with the given one-time onboarding token.
    pub async fn start(
        addr: SocketAddr,
        ca: Arc<TestCa>,
        onboarding_token: Option<&str>,
    ) -> Result<Self> {
        let (tx, rx) = mpsc::unbounded_channel();
        let state = Arc::new(RelayState {
            onboarding_token: Mutex::new(onboarding_token.map(str::to_string)),
            onboard_calls: AtomicUsize::new(0),
            tunnel_attempts: AtomicUsize::new(0),
            revoked: AtomicBool::new(false),
            tunnel_headers: Mutex::new(Vec::new()),
            tunnels: tx,
        });
        Self::start_with(addr, ca, state, rx).await
    }

    async fn start_with(
        addr: SocketAddr,
        ca: Arc<TestCa>,
        state: Arc<RelayState>,
        tunnels: mpsc::UnboundedReceiver<Connection>,
    ) -> Result<Self> {
        let listener = TcpListener::bind(addr).await?;
        let addr = listener.local_addr()?;
        let tls = tokio_rustls::TlsAcceptor::from(ca.server_config(&["localhost", "127.0.0.1"])?);
        let conns: Arc<Mutex<Vec<tokio::task::AbortHandle>>> = Arc::new(Mutex::new(Vec::new()));
        let task = {
            let state = state.clone();
            let conns = conns.clone();
            tokio::spawn(async move {
                while let Ok((tcp, _)) = listener.accept().await {
                    let tls = tls.clone();
                    let state = state.clone();
                    let handle = tokio::spawn(async move {
                        let Ok(stream) = tls.accept(tcp).await else {
                            return;
                        };
                        let service = hyper::service::service_fn(move |req| {
                            let state = state.clone();
                            async move { Ok::<_, Infallible>(handle(req, &state).await) }
                        });
                        let _ = hyper_util::server::conn::auto::Builder::new(TokioExecutor::new())
                            .serve_connection_with_upgrades(TokioIo::new(stream), service)
                            .await;
                    });
                    if let Ok(mut conns) = conns.lock() {
                        conns.push(handle.abort_handle());
                    }
                }
            })
        };
        Ok(Self {
            addr,
            ca,
            state,
            tunnels,
            task,
            conns,
        })
    }

    pub fn url(&self) -> String {
        format!("https://127.0.0.1:{}", self.addr.port())
    }

    /// Stops listening and drops every connection (as a crashed relay would).
    pub fn stop(&self) {
        self.task.abort();
        if let Ok(conns) = self.conns.lock() {
            for c in conns.iter() {
                c.abort();
            }
        }
    }

    /// Stops this relay and starts a new one on the same port with the same state.
    pub async fn restart(mut self) -> Result<Self> {
        self.stop();
        // The listener is dropped once its task has been cancelled; wait for that before binding again.
        let task = std::mem::replace(&mut self.task, tokio::spawn(async {}));
        let _ = task.await;
        let (tx, rx) = mpsc::unbounded_channel();
        let old = Arc::clone(&self.state);
        let state = Arc::new(RelayState {
            onboarding_token: Mutex::new(old.onboarding_token.lock().ok().and_then(|t| t.clone())),
            onboard_calls: AtomicUsize::new(old.onboard_calls.load(Ordering::SeqCst)),
            tunnel_attempts: AtomicUsize::new(0),
            revoked: AtomicBool::new(old.revoked.load(Ordering::SeqCst)),
            tunnel_headers: Mutex::new(Vec::new()),
            tunnels: tx,
        });
        Self::start_with(self.addr, self.ca.clone(), state, rx).await
    }
}

fn status(code: StatusCode, message: &str) -> Response<Full<Bytes>> {
    let body = serde_json::json!({
        "kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
        "message": message, "code": code.as_u16(),
    });
    let mut resp = Response::new(Full::new(Bytes::from(body.to_string())));
    *resp.status_mut() = code;
    resp
}

async fn handle(req: Request<Incoming>, state: &RelayState) -> Response<Full<Bytes>> {
    match req.uri().path() {
        "/agent/v1/onboard" => {
            state.onboard_calls.fetch_add(1, Ordering::SeqCst);
            let Ok(body) = req.into_body().collect().await else {
                return status(StatusCode::BAD_REQUEST, "bad body");
            };
            let Ok(json) = serde_json::from_slice::<serde_json::Value>(&body.to_bytes()) else {
                return status(StatusCode::BAD_REQUEST, "bad json");
            };
            let Ok(mut token) = state.onboarding_token.lock() else {
                return status(StatusCode::INTERNAL_SERVER_ERROR, "poisoned");
            };
            if json["cluster"] != "prod"
                || token.is_none()
                || json["token"].as_str() != token.as_deref()
            {
                return status(
                    StatusCode::UNAUTHORIZED,
                    "onboarding token invalid or already used",
                );
            }
            *token = None;
            let body = serde_json::json!({"cluster": "prod", "credential": CREDENTIAL});
            Response::new(Full::new(Bytes::from(body.to_string())))
        }
        "/agent/v1/tunnel" => {
            state.tunnel_attempts.fetch_add(1, Ordering::SeqCst);
            if let Ok(mut seen) = state.tunnel_headers.lock() {
                seen.push(req.headers().clone());
            }
            let authorized = req
                .headers()
                .get("authorization")
                .and_then(|v| v.to_str().ok())
                == Some(&format!("Bearer {CREDENTIAL}"))
                && req
                    .headers()
                    .get("tether-cluster")
                    .and_then(|v| v.to_str().ok())
                    == Some("prod");
            if !authorized || state.revoked.load(Ordering::SeqCst) {
                return status(StatusCode::UNAUTHORIZED, "unknown credential");
            }
            let response = match ws::upgrade_response(&req) {
                Ok(response) => response,
                Err(e) => return status(StatusCode::BAD_REQUEST, &e),
            };
            let tunnels = state.tunnels.clone();
            tokio::spawn(async move {
                if let Ok(upgraded) = hyper::upgrade::on(req).await {
                    let conn = ws::accept_upgraded(
                        TokioIo::new(upgraded),
                        SessionConfig::new(Role::Server),
                    );
                    let _ = tunnels.send(conn);
                }
            });
            let (parts, ()) = response.into_parts();
            Response::from_parts(parts, Full::new(Bytes::new()))
        }
        _ => status(StatusCode::NOT_FOUND, "not found"),
    }
}
