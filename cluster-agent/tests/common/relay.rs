//! A minimal stand-in for the relay's agent endpoints, built on `tether_tunnel`'s server side: onboarding with
//! a one-time token and a CSR (signed by a test agent CA), the tunnel upgrade with client-certificate checks,
//! and the control channel (welcome, renewals, the guard snapshot after each hello, answers to
//! `resolveGroups` from a small directory, and messages tests push). Tests get each tunnel as a `Connection`
//! and every control message the agent sent.
//!
//! It can also stand in for a relay fleet behind one load balancer: with [`FakeRelay::set_replicas`] each
//! tunnel is "held" by one of several replica ids (handed out round-robin, after an optional plan), named in
//! its `welcome` with the fleet's size, and tests push messages to the tunnels of one replica
//! ([`FakeRelay::send_to_replica`]); [`FakeRelay::tunnel_records`] tells which tunnels the agent still uses.

use std::collections::{HashMap, VecDeque};
use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use anyhow::Result;
use bytes::Bytes;
use http::{Request, Response, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper_util::rt::{TokioExecutor, TokioIo};
use rustls::pki_types::CertificateDer;
use sha2::{Digest, Sha256};
use tether_api::control::{self, Message, Welcome};
use tether_tunnel::{Connection, Role, SessionConfig, code, kind, ws};
use tokio::net::TcpListener;
use tokio::sync::{broadcast, mpsc};

use super::TestCa;

/// How the stand-in answers `renew`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RenewMode {
    /// Issue a certificate.
    Issue,
    /// Answer `error` with this message.
    Refuse(String),
    /// Do not answer.
    Ignore,
}

/// What the fake relay checks and counts.
pub struct RelayState {
    pub onboarding_token: Mutex<Option<String>>,
    pub onboard_calls: AtomicUsize,
    /// Bodies of onboarding requests (JSON).
    pub onboard_bodies: Mutex<Vec<serde_json::Value>>,
    pub tunnel_attempts: AtomicUsize,
    /// When set, the tunnel endpoint answers 401 as for a deleted cluster.
    pub revoked: AtomicBool,
    /// When set, the tunnel endpoint answers 401 with reason IdentityExpired.
    pub expired: AtomicBool,
    /// Headers of each tunnel request.
    pub tunnel_headers: Mutex<Vec<http::HeaderMap>>,
    /// SHA-256 of the client certificate presented on each tunnel request (None: none presented).
    pub presented: Mutex<Vec<Option<String>>>,
    /// Fingerprints the tunnel accepts: the current identity and, during a renewal, the previous one.
    pub accepted_fingerprints: Mutex<Vec<String>>,
    /// Lifetime of issued certificates.
    pub validity: Mutex<time::Duration>,
    pub heartbeat_seconds: AtomicU64,
    pub renew_mode: Mutex<RenewMode>,
    pub renew_requests: AtomicUsize,
    /// Every control stream accepted, to reset from tests.
    pub control_streams: Mutex<Vec<tether_tunnel::StreamControl>>,
    /// The guard snapshot sent right after each `welcome`, as the real relay does at `hello`.
    pub guard_snapshot: Mutex<Option<tether_auth::Snapshot>>,
    /// The directory `resolveGroups` is answered from: user oid → group ids (unknown users get an error).
    pub directory: Mutex<HashMap<String, Vec<String>>>,
    /// How many `resolveGroups` the agents asked.
    pub resolve_requests: AtomicUsize,
    /// Messages for the live control channels ([`FakeRelay::send_to_agents`]): for every channel, or for
    /// those of one replica.
    push: broadcast::Sender<(Option<String>, Message)>,
    /// The fleet: replica ids handed out round-robin (none: a relay without a fleet).
    pub replica_ids: Mutex<Vec<String>>,
    /// Replica ids handed out first, in order, before the round-robin.
    pub replica_plan: Mutex<VecDeque<String>>,
    /// Replicas out of the load balancer (draining): the round-robin skips them.
    pub draining_replicas: Mutex<Vec<String>>,
    /// How many replicas `welcome` says are live (0: a relay without a fleet says nothing).
    pub replicas_reported: AtomicU32,
    next_replica: AtomicUsize,
    /// Every tunnel established, in order.
    pub records: Mutex<Vec<TunnelRecord>>,
    ca: Arc<TestCa>,
    tunnels: mpsc::UnboundedSender<Connection>,
    messages: mpsc::UnboundedSender<Message>,
}

/// One tunnel as the stand-in relay saw it.
#[derive(Clone)]
pub struct TunnelRecord {
    /// The replica that "holds" it (empty without a fleet).
    pub replica: String,
    pub conn: Connection,
    /// The agent stopped taking streams on it (its GOAWAY) or it closed.
    pub ended: Arc<AtomicBool>,
    /// Fingerprint of the certificate it was opened with.
    pub presented: Option<String>,
}

impl TunnelRecord {
    /// The agent still takes streams on it.
    pub fn live(&self) -> bool {
        !self.ended.load(Ordering::SeqCst) && !self.conn.is_closed()
    }
}

pub struct FakeRelay {
    pub addr: SocketAddr,
    pub ca: Arc<TestCa>,
    pub state: Arc<RelayState>,
    pub tunnels: mpsc::UnboundedReceiver<Connection>,
    /// Every control message agents sent, in order, across tunnels.
    pub messages: mpsc::UnboundedReceiver<Message>,
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
    /// Starts on `addr` (`127.0.0.1:0` for a fresh port) with the given one-time onboarding token. `ca`
    /// serves the relay's certificate and issues (and verifies) agent certificates.
    pub async fn start(
        addr: SocketAddr,
        ca: Arc<TestCa>,
        onboarding_token: Option<&str>,
    ) -> Result<Self> {
        let (tx, rx) = mpsc::unbounded_channel();
        let (mtx, mrx) = mpsc::unbounded_channel();
        let state = Arc::new(RelayState {
            onboarding_token: Mutex::new(onboarding_token.map(str::to_string)),
            onboard_calls: AtomicUsize::new(0),
            onboard_bodies: Mutex::new(Vec::new()),
            tunnel_attempts: AtomicUsize::new(0),
            revoked: AtomicBool::new(false),
            expired: AtomicBool::new(false),
            tunnel_headers: Mutex::new(Vec::new()),
            presented: Mutex::new(Vec::new()),
            accepted_fingerprints: Mutex::new(Vec::new()),
            validity: Mutex::new(time::Duration::days(1)),
            heartbeat_seconds: AtomicU64::new(30),
            renew_mode: Mutex::new(RenewMode::Issue),
            renew_requests: AtomicUsize::new(0),
            control_streams: Mutex::new(Vec::new()),
            guard_snapshot: Mutex::new(None),
            directory: Mutex::new(HashMap::new()),
            resolve_requests: AtomicUsize::new(0),
            push: broadcast::channel(64).0,
            replica_ids: Mutex::new(Vec::new()),
            replica_plan: Mutex::new(VecDeque::new()),
            draining_replicas: Mutex::new(Vec::new()),
            replicas_reported: AtomicU32::new(0),
            next_replica: AtomicUsize::new(0),
            records: Mutex::new(Vec::new()),
            ca: ca.clone(),
            tunnels: tx,
            messages: mtx,
        });
        Self::start_with(addr, ca, state, rx, mrx).await
    }

    async fn start_with(
        addr: SocketAddr,
        ca: Arc<TestCa>,
        state: Arc<RelayState>,
        tunnels: mpsc::UnboundedReceiver<Connection>,
        messages: mpsc::UnboundedReceiver<Message>,
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
                        let presented = stream
                            .get_ref()
                            .1
                            .peer_certificates()
                            .and_then(|c| c.first())
                            .map(fingerprint);
                        let service = hyper::service::service_fn(move |req| {
                            let state = state.clone();
                            let presented = presented.clone();
                            async move { Ok::<_, Infallible>(handle(req, &state, presented).await) }
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
            messages,
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
        let (mtx, mrx) = mpsc::unbounded_channel();
        let old = Arc::clone(&self.state);
        let copy =
            |m: &Mutex<Vec<String>>| Mutex::new(m.lock().map(|v| v.clone()).unwrap_or_default());
        let state = Arc::new(RelayState {
            onboarding_token: Mutex::new(old.onboarding_token.lock().ok().and_then(|t| t.clone())),
            onboard_calls: AtomicUsize::new(old.onboard_calls.load(Ordering::SeqCst)),
            onboard_bodies: Mutex::new(Vec::new()),
            tunnel_attempts: AtomicUsize::new(0),
            revoked: AtomicBool::new(old.revoked.load(Ordering::SeqCst)),
            expired: AtomicBool::new(old.expired.load(Ordering::SeqCst)),
            tunnel_headers: Mutex::new(Vec::new()),
            presented: Mutex::new(Vec::new()),
            accepted_fingerprints: copy(&old.accepted_fingerprints),
            validity: Mutex::new(
                old.validity
                    .lock()
                    .map(|v| *v)
                    .unwrap_or(time::Duration::days(1)),
            ),
            heartbeat_seconds: AtomicU64::new(old.heartbeat_seconds.load(Ordering::SeqCst)),
            renew_mode: Mutex::new(
                old.renew_mode
                    .lock()
                    .map(|m| m.clone())
                    .unwrap_or(RenewMode::Issue),
            ),
            renew_requests: AtomicUsize::new(0),
            control_streams: Mutex::new(Vec::new()),
            guard_snapshot: Mutex::new(old.guard_snapshot.lock().ok().and_then(|s| s.clone())),
            directory: Mutex::new(old.directory.lock().map(|d| d.clone()).unwrap_or_default()),
            resolve_requests: AtomicUsize::new(0),
            push: broadcast::channel(64).0,
            replica_ids: Mutex::new(
                old.replica_ids
                    .lock()
                    .map(|v| v.clone())
                    .unwrap_or_default(),
            ),
            replica_plan: Mutex::new(VecDeque::new()),
            draining_replicas: Mutex::new(Vec::new()),
            replicas_reported: AtomicU32::new(old.replicas_reported.load(Ordering::SeqCst)),
            next_replica: AtomicUsize::new(0),
            records: Mutex::new(Vec::new()),
            ca: old.ca.clone(),
            tunnels: tx,
            messages: mtx,
        });
        Self::start_with(self.addr, self.ca.clone(), state, rx, mrx).await
    }

    /// Sends `message` on every control channel open now; how many received it.
    pub fn send_to_agents(&self, message: Message) -> usize {
        self.state.push.send((None, message)).unwrap_or(0)
    }

    /// Sends `message` on the control channels of the tunnels `replica` holds.
    pub fn send_to_replica(&self, replica: &str, message: Message) {
        let _ = self.state.push.send((Some(replica.to_owned()), message));
    }

    /// Makes this relay a fleet of `ids` (welcome reports their number); `plan` is handed out first.
    pub fn set_replicas(&self, ids: &[&str], plan: &[&str]) {
        if let Ok(mut v) = self.state.replica_ids.lock() {
            *v = ids.iter().map(|s| (*s).to_owned()).collect();
        }
        if let Ok(mut v) = self.state.replica_plan.lock() {
            *v = plan.iter().map(|s| (*s).to_owned()).collect();
        }
        self.state
            .replicas_reported
            .store(ids.len() as u32, Ordering::SeqCst);
    }

    /// Takes `replica` out of the round-robin (a draining replica takes no new tunnels).
    pub fn drain_replica(&self, replica: &str) {
        if let Ok(mut v) = self.state.draining_replicas.lock() {
            v.push(replica.to_owned());
        }
    }

    /// Every tunnel established so far.
    pub fn tunnel_records(&self) -> Vec<TunnelRecord> {
        self.state.tunnel_records()
    }

    /// The replicas of the tunnels the agent still uses, sorted.
    pub fn live_replicas(&self) -> Vec<String> {
        self.state.live_replicas()
    }

    /// Sets the snapshot sent after each `hello` and sends it to the agents connected now.
    pub fn set_guard_snapshot(&self, snapshot: serde_json::Value) -> usize {
        let snapshot: tether_auth::Snapshot =
            serde_json::from_value(snapshot).expect("a test snapshot in guard's JSON form");
        if let Ok(mut s) = self.state.guard_snapshot.lock() {
            *s = Some(snapshot.clone());
        }
        self.send_to_agents(Message::GuardSnapshot(control::GuardSnapshot { snapshot }))
    }

    /// Sets the groups the directory answers for `oid`.
    pub fn set_groups(&self, oid: &str, groups: &[&str]) {
        if let Ok(mut d) = self.state.directory.lock() {
            d.insert(
                oid.to_owned(),
                groups.iter().map(|g| (*g).to_owned()).collect(),
            );
        }
    }

    pub fn presented(&self) -> Vec<Option<String>> {
        self.state
            .presented
            .lock()
            .map(|p| p.clone())
            .unwrap_or_default()
    }
}

/// SHA-256 of a DER certificate, lowercase hex.
pub fn fingerprint(der: &CertificateDer<'_>) -> String {
    hex::encode(Sha256::digest(der.as_ref()))
}

/// SHA-256 of the (first) certificate in a PEM text.
pub fn pem_fingerprint(pem: &str) -> Option<String> {
    use rustls::pki_types::pem::PemObject;
    CertificateDer::pem_slice_iter(pem.as_bytes())
        .next()?
        .ok()
        .map(|der| fingerprint(&der))
}

impl RelayState {
    /// Every tunnel established so far.
    pub fn tunnel_records(&self) -> Vec<TunnelRecord> {
        self.records.lock().map(|r| r.clone()).unwrap_or_default()
    }

    /// The replicas of the tunnels the agent still uses, sorted.
    pub fn live_replicas(&self) -> Vec<String> {
        let mut live: Vec<String> = self
            .tunnel_records()
            .into_iter()
            .filter(TunnelRecord::live)
            .map(|r| r.replica)
            .collect();
        live.sort();
        live
    }

    /// The replica the next tunnel lands on: the plan first, then round-robin over the replicas not draining.
    fn next_replica(&self) -> String {
        if let Some(next) = self
            .replica_plan
            .lock()
            .ok()
            .and_then(|mut p| p.pop_front())
        {
            return next;
        }
        let draining = self
            .draining_replicas
            .lock()
            .map(|d| d.clone())
            .unwrap_or_default();
        let ids: Vec<String> = self
            .replica_ids
            .lock()
            .map(|ids| {
                ids.iter()
                    .filter(|id| !draining.contains(id))
                    .cloned()
                    .collect()
            })
            .unwrap_or_default();
        if ids.is_empty() {
            return String::new();
        }
        ids[self.next_replica.fetch_add(1, Ordering::SeqCst) % ids.len()].clone()
    }

    /// Signs `csr` for cluster `prod` (CN and SAN URI, backdated 5 minutes like the real relay) and makes it
    /// the accepted identity, keeping the previous one acceptable too.
    fn issue(&self, csr: &str) -> Result<(String, String), String> {
        let mut params =
            rcgen::CertificateSigningRequestParams::from_pem(csr).map_err(|e| e.to_string())?;
        let validity = self
            .validity
            .lock()
            .map(|v| *v)
            .unwrap_or(time::Duration::days(1));
        let now = time::OffsetDateTime::now_utc();
        params.params.distinguished_name = rcgen::DistinguishedName::new();
        params
            .params
            .distinguished_name
            .push(rcgen::DnType::CommonName, "prod");
        params.params.subject_alt_names = vec![rcgen::SanType::URI(
            "tether://cluster/prod"
                .try_into()
                .map_err(|e: rcgen::Error| e.to_string())?,
        )];
        params.params.not_before = now - time::Duration::minutes(5);
        params.params.not_after = now + validity;
        let cert = self.ca.sign_csr(&params).map_err(|e| e.to_string())?;
        let fp = fingerprint(cert.der());
        if let Ok(mut accepted) = self.accepted_fingerprints.lock() {
            let previous = accepted.last().cloned();
            *accepted = previous.into_iter().chain([fp]).collect();
        }
        let not_after = params
            .params
            .not_after
            .format(&time::format_description::well_known::Rfc3339)
            .unwrap_or_default();
        Ok((cert.pem(), not_after))
    }
}

fn status(code: StatusCode, reason: &str, message: &str) -> Response<Full<Bytes>> {
    let body = serde_json::json!({
        "kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
        "message": message, "reason": reason, "code": code.as_u16(),
    });
    let mut resp = Response::new(Full::new(Bytes::from(body.to_string())));
    *resp.status_mut() = code;
    resp
}

async fn handle(
    req: Request<Incoming>,
    state: &Arc<RelayState>,
    presented: Option<String>,
) -> Response<Full<Bytes>> {
    match req.uri().path() {
        "/agent/v1/onboard" => {
            state.onboard_calls.fetch_add(1, Ordering::SeqCst);
            let Ok(body) = req.into_body().collect().await else {
                return status(StatusCode::BAD_REQUEST, "BadRequest", "bad body");
            };
            let Ok(json) = serde_json::from_slice::<serde_json::Value>(&body.to_bytes()) else {
                return status(StatusCode::BAD_REQUEST, "BadRequest", "bad json");
            };
            if let Ok(mut bodies) = state.onboard_bodies.lock() {
                bodies.push(json.clone());
            }
            {
                let Ok(mut token) = state.onboarding_token.lock() else {
                    return status(
                        StatusCode::INTERNAL_SERVER_ERROR,
                        "InternalError",
                        "poisoned",
                    );
                };
                if json["cluster"] != "prod"
                    || token.is_none()
                    || json["token"].as_str() != token.as_deref()
                {
                    return status(
                        StatusCode::UNAUTHORIZED,
                        "Unauthorized",
                        "onboarding token invalid or already used",
                    );
                }
                *token = None;
            }
            let csr = json["csr"].as_str().unwrap_or_default();
            match state.issue(csr) {
                Ok((certificate, not_after)) => {
                    let body = serde_json::json!({"cluster": "prod", "certificate": certificate, "notAfter": not_after});
                    Response::new(Full::new(Bytes::from(body.to_string())))
                }
                Err(e) => status(StatusCode::BAD_REQUEST, "BadRequest", &e),
            }
        }
        "/agent/v1/tunnel" => {
            state.tunnel_attempts.fetch_add(1, Ordering::SeqCst);
            if let Ok(mut seen) = state.tunnel_headers.lock() {
                seen.push(req.headers().clone());
            }
            if let Ok(mut p) = state.presented.lock() {
                p.push(presented.clone());
            }
            let known = presented.as_ref().is_some_and(|fp| {
                state
                    .accepted_fingerprints
                    .lock()
                    .is_ok_and(|a| a.contains(fp))
            });
            let for_prod = req
                .headers()
                .get("tether-cluster")
                .and_then(|v| v.to_str().ok())
                == Some("prod");
            if state.expired.load(Ordering::SeqCst) {
                return status(
                    StatusCode::UNAUTHORIZED,
                    "IdentityExpired",
                    "the identity of cluster prod expired at 2020-01-01T00:00:00Z: delete the cluster and connect it again",
                );
            }
            if !known || !for_prod || state.revoked.load(Ordering::SeqCst) {
                return status(StatusCode::UNAUTHORIZED, "Unauthorized", "unknown identity");
            }
            // The agent connected with its newest identity: forget the previous one.
            if let (Some(fp), Ok(mut accepted)) = (&presented, state.accepted_fingerprints.lock())
                && accepted.last() == Some(fp)
            {
                accepted.retain(|a| a == fp);
            }
            let response = match ws::upgrade_response(&req) {
                Ok(response) => response,
                Err(e) => return status(StatusCode::BAD_REQUEST, "BadRequest", &e),
            };
            let state = state.clone();
            tokio::spawn(async move {
                if let Ok(upgraded) = hyper::upgrade::on(req).await {
                    let conn = ws::accept_upgraded(
                        TokioIo::new(upgraded),
                        SessionConfig::new(Role::Server),
                    );
                    let record = TunnelRecord {
                        replica: state.next_replica(),
                        conn: conn.clone(),
                        ended: Arc::default(),
                        presented,
                    };
                    if let Ok(mut records) = state.records.lock() {
                        records.push(record.clone());
                    }
                    tokio::spawn(serve_control(record, state.clone()));
                    let _ = state.tunnels.send(conn);
                }
            });
            let (parts, ()) = response.into_parts();
            Response::from_parts(parts, Full::new(Bytes::new()))
        }
        _ => status(StatusCode::NOT_FOUND, "NotFound", "not found"),
    }
}

/// Accepts the agent's control streams on the tunnel: answers `hello` with `welcome`, `renew` per the renew
/// mode, and forwards every message to the test. Marks the tunnel ended when the agent stops taking streams.
async fn serve_control(record: TunnelRecord, state: Arc<RelayState>) {
    let conn = record.conn.clone();
    let replica = record.replica.clone();
    while let Some(incoming) = conn.accept().await {
        if incoming.kind != kind::CONTROL {
            incoming.refuse(
                code::UNSUPPORTED_KIND,
                "the relay serves only control streams",
            );
            continue;
        }
        let Ok(stream) = incoming.accept(Bytes::new()) else {
            continue;
        };
        if let Ok(mut streams) = state.control_streams.lock() {
            streams.push(stream.control());
        }
        let state = state.clone();
        let replica = replica.clone();
        let mut pushed = state.push.subscribe();
        tokio::spawn(async move {
            let (read, mut write) = tokio::io::split(stream);
            let mut reader = control::Reader::new(read);
            loop {
                let message = tokio::select! {
                    message = reader.recv() => match message {
                        Ok(Some(message)) => message,
                        _ => return,
                    },
                    pushed = pushed.recv() => match pushed {
                        Ok((Some(to), _)) if to != replica => continue,
                        Ok((_, message)) => {
                            if control::send(&mut write, &message).await.is_err() {
                                return;
                            }
                            continue;
                        }
                        Err(broadcast::error::RecvError::Lagged(_)) => continue,
                        Err(broadcast::error::RecvError::Closed) => return,
                    },
                };
                let _ = state.messages.send(message.clone());
                if let Message::ResolveGroups(question) = &message {
                    state.resolve_requests.fetch_add(1, Ordering::SeqCst);
                    let known = state
                        .directory
                        .lock()
                        .ok()
                        .and_then(|d| d.get(&question.oid).cloned());
                    let answer = control::Groups {
                        request_id: question.request_id,
                        error: known
                            .is_none()
                            .then(|| "the user is not in the directory".to_owned()),
                        groups: known,
                    };
                    if control::send(&mut write, &Message::Groups(answer))
                        .await
                        .is_err()
                    {
                        return;
                    }
                    continue;
                }
                if let Message::Hello(_) = &message {
                    let welcome = Message::Welcome(Welcome {
                        heartbeat_interval_seconds: state.heartbeat_seconds.load(Ordering::SeqCst),
                        latest_agent_version: Some("9.9.9".to_owned()),
                        replica: replica.clone(),
                        replicas: state.replicas_reported.load(Ordering::SeqCst),
                    });
                    if control::send(&mut write, &welcome).await.is_err() {
                        return;
                    }
                    let snapshot = state.guard_snapshot.lock().ok().and_then(|s| s.clone());
                    if let Some(snapshot) = snapshot
                        && control::send(
                            &mut write,
                            &Message::GuardSnapshot(control::GuardSnapshot { snapshot }),
                        )
                        .await
                        .is_err()
                    {
                        return;
                    }
                    continue;
                }
                let reply = match message {
                    Message::Renew(renew) => {
                        state.renew_requests.fetch_add(1, Ordering::SeqCst);
                        let mode = state
                            .renew_mode
                            .lock()
                            .map(|m| m.clone())
                            .unwrap_or(RenewMode::Issue);
                        match mode {
                            RenewMode::Issue => match state.issue(&renew.csr) {
                                Ok((certificate, not_after)) => {
                                    Some(Message::Certificate(control::Certificate {
                                        certificate,
                                        not_after,
                                    }))
                                }
                                Err(message) => {
                                    Some(Message::Error(control::ErrorMessage { message }))
                                }
                            },
                            RenewMode::Refuse(message) => {
                                Some(Message::Error(control::ErrorMessage { message }))
                            }
                            RenewMode::Ignore => None,
                        }
                    }
                    _ => None,
                };
                if let Some(reply) = reply
                    && control::send(&mut write, &reply).await.is_err()
                {
                    return;
                }
            }
        });
    }
    record.ended.store(true, Ordering::SeqCst);
}
