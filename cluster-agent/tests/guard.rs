//! The agent's guard wiring, end to end against the stand-in relay and the test apiserver:
//!
//! - the in-cluster authentication proxy with Entra-shaped tokens minted by PyJWT and keys served by a local
//!   Entra-shaped identity provider: a valid token is forwarded on the agent's own credentials with
//!   impersonation headers (the user's `Authorization` and `Impersonate-*` gone), invalid ones get 401 and
//!   never reach the apiserver, group overage is resolved through the relay's directory, and a
//!   service-account token passes through unchanged;
//! - guard snapshots from the relay reaching a real `tether_guard` server (in process) through `PUT /snapshot`
//!   with the push token and the agent's push certificate (guard's `--snapshot-client-ca`), including a guard
//!   that is down when the first snapshot arrives; an agent without the push certificate, or with another,
//!   gets nothing applied.

mod common;

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use anyhow::{Context as _, Result};
use base64::Engine as _;
use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use bytes::Bytes;
use common::harness::{DEADLINE, Env, Running, env, request};
use common::idp::{self, ALICE, ALICE_GROUPS, ALICE_OID, Idp, Minted, TENANT};
use common::{AgentCreds, Seen, eventually};
use http::{Request, StatusCode};
use http_body_util::{BodyExt, Empty};
use hyper_util::rt::TokioIo;
use serde_json::{Value, json};
use tether_agent::{Backoff, GuardConfig, Secret};
use tether_guard::{Guard, GuardOptions, SnapshotStore};
use tether_testkit::certs::{Ca, CertifiedPem};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;
use tokio::sync::oneshot;

/// The token the agent's own kubeconfig user holds.
const AGENT_TOKEN: &str = "agent-own-token";
/// The built-in "Azure Arc Kubernetes Viewer" role.
const VIEWER: &str = "63f0a09d-1495-4db4-a681-037d84835eb4";

struct ProxySetup {
    env: Env,
    _idp: Idp,
    minted: Minted,
    _agent: Running,
    conn: tether_tunnel::Connection,
}

/// The agent with the authentication proxy on (trusting the local IdP) and its own token and client
/// certificate in its kubeconfig; `None` (test skipped) without PyJWT.
async fn proxy_setup() -> Result<Option<ProxySetup>> {
    proxy_setup_with_token(AGENT_TOKEN).await
}

/// As [`proxy_setup`], with `agent_token` as the agent's token (empty: client certificate only).
async fn proxy_setup_with_token(agent_token: &str) -> Result<Option<ProxySetup>> {
    if !idp::pyjwt_available() {
        return Ok(None);
    }
    let mut env = env(Some("onb-1")).await?;
    let creds = AgentCreds {
        token: agent_token.into(),
        client: env.api.ca.issue(&["system:tether-agent"])?,
    };
    common::write_kubeconfig(
        env.dir.path(),
        &env.api.url(),
        &env.api.ca.pem(),
        Some(&creds),
    )?;
    let idp = Idp::start().await?;
    let minted = idp::mint(&idp)?;
    let mut config = env.config(Some("onb-1"));
    config.entra = Some(idp::entra_config(&idp, env.dir.path())?);
    let agent = Running::start(config);
    let conn = env.next_tunnel().await?;
    Ok(Some(ProxySetup {
        env,
        _idp: idp,
        minted,
        _agent: agent,
        conn,
    }))
}

fn get_with(path: &str, headers: &[(&str, &str)]) -> Result<Request<Empty<Bytes>>> {
    let mut req = Request::get(path);
    for (name, value) in headers {
        req = req.header(*name, *value);
    }
    Ok(req.body(Empty::new())?)
}

fn bearer(token: &str) -> String {
    format!("Bearer {token}")
}

fn values<'a>(seen: &'a Seen, name: &str) -> Vec<&'a str> {
    seen.headers
        .get_all(name)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .collect()
}

fn impersonation_headers(seen: &Seen) -> Vec<String> {
    seen.headers
        .keys()
        .map(|k| k.as_str().to_owned())
        .filter(|k| k.starts_with("impersonate-"))
        .collect()
}

async fn body_json(resp: http::Response<hyper::body::Incoming>) -> Result<Value> {
    let bytes = resp.into_body().collect().await?.to_bytes();
    serde_json::from_slice(&bytes).with_context(|| String::from_utf8_lossy(&bytes).into_owned())
}

/// The same token with one claim changed and the signature kept.
fn tampered(token: &str, claim: &str, value: Value) -> Result<String> {
    let mut parts = token.split('.');
    let (Some(header), Some(payload), Some(signature)) = (parts.next(), parts.next(), parts.next())
    else {
        anyhow::bail!("not a JWT");
    };
    let mut claims: Value = serde_json::from_slice(&URL_SAFE_NO_PAD.decode(payload)?)?;
    claims[claim] = value;
    let payload = URL_SAFE_NO_PAD.encode(serde_json::to_vec(&claims)?);
    Ok(format!("{header}.{payload}.{signature}"))
}

#[tokio::test]
async fn a_valid_entra_token_is_forwarded_as_the_agent_impersonating_the_user() -> Result<()> {
    let Some(s) = proxy_setup().await? else {
        return Ok(());
    };
    let token = s.minted.token("valid_v2");
    let auth = bearer(&token);
    let resp = request(
        &s.conn,
        get_with(
            "/api/v1/namespaces/default/pods?limit=1",
            &[
                ("authorization", auth.as_str()),
                // The user may not choose whom the agent impersonates.
                ("impersonate-user", "system:admin"),
                ("impersonate-group", "system:masters"),
                ("impersonate-uid", "0"),
                ("impersonate-extra-scopes", "everything"),
                ("accept", "application/json"),
            ],
        )?,
    )
    .await?;
    assert_eq!(resp.status(), StatusCode::OK);
    let json = body_json(resp).await?;
    assert_eq!(json["path"], "/api/v1/namespaces/default/pods");
    assert_eq!(json["query"], "limit=1");

    let seen = s.env.api.seen();
    assert_eq!(seen.len(), 1, "{seen:?}");
    let s0 = &seen[0];
    // The user's token never reaches the apiserver; the agent's own credentials do.
    assert_eq!(values(s0, "authorization"), [bearer(AGENT_TOKEN)]);
    assert!(
        s0.client_cert,
        "the agent's own client certificate is presented"
    );
    assert!(!format!("{:?}", s0.headers).contains(&token));
    assert_eq!(values(s0, "impersonate-user"), [ALICE]);
    assert_eq!(values(s0, "impersonate-group"), ALICE_GROUPS);
    assert_eq!(values(s0, "impersonate-uid"), [ALICE_OID]);
    assert_eq!(values(s0, "impersonate-extra-oid"), [ALICE_OID]);
    assert_eq!(values(s0, "impersonate-extra-tid"), [TENANT]);
    let mut names = impersonation_headers(s0);
    names.sort();
    names.dedup();
    assert_eq!(
        names,
        [
            "impersonate-extra-oid",
            "impersonate-extra-tid",
            "impersonate-group",
            "impersonate-uid",
            "impersonate-user"
        ]
    );
    assert_eq!(values(s0, "accept"), ["application/json"]);

    // An upgrade (exec, attach, port-forward) goes the same way, on the upgrade client.
    let stream = common::harness::http_stream(&s.conn)?;
    let (mut sender, connection) =
        hyper::client::conn::http1::handshake(TokioIo::new(stream)).await?;
    tokio::spawn(connection.with_upgrades());
    let req = Request::get("/upgrade")
        .header("authorization", auth.as_str())
        .header("impersonate-user", "system:admin")
        .header("connection", "Upgrade")
        .header("upgrade", "tether-test")
        .body(Empty::<Bytes>::new())?;
    let resp = tokio::time::timeout(DEADLINE, sender.send_request(req)).await??;
    assert_eq!(resp.status(), StatusCode::SWITCHING_PROTOCOLS);
    let mut io = TokioIo::new(hyper::upgrade::on(resp).await?);
    io.write_all(b"ping").await?;
    io.shutdown().await?;
    let mut reply = Vec::new();
    tokio::time::timeout(DEADLINE, io.read_to_end(&mut reply)).await??;
    assert_eq!(reply, b"bye:ping");
    let seen = s.env.api.seen();
    let up = seen
        .iter()
        .find(|r| r.uri.ends_with("/upgrade"))
        .context("the upgrade request reached the apiserver")?;
    assert_eq!(values(up, "authorization"), [bearer(AGENT_TOKEN)]);
    assert!(up.client_cert);
    assert_eq!(values(up, "impersonate-user"), [ALICE]);
    assert_eq!(values(up, "impersonate-group"), ALICE_GROUPS);
    Ok(())
}

#[tokio::test]
async fn an_agent_with_a_client_certificate_only_sends_no_authorization_at_all() -> Result<()> {
    let Some(s) = proxy_setup_with_token("").await? else {
        return Ok(());
    };
    let auth = bearer(&s.minted.token("valid_v2"));
    let resp = request(
        &s.conn,
        get_with("/api/v1/pods", &[("authorization", auth.as_str())])?,
    )
    .await?;
    assert_eq!(resp.status(), StatusCode::OK);
    let seen = s.env.api.seen();
    assert_eq!(seen.len(), 1);
    assert!(seen[0].headers.get("authorization").is_none(), "{seen:?}");
    assert!(seen[0].client_cert);
    assert_eq!(values(&seen[0], "impersonate-user"), [ALICE]);
    Ok(())
}

#[tokio::test]
async fn invalid_entra_tokens_get_401_and_never_reach_the_apiserver() -> Result<()> {
    let Some(s) = proxy_setup().await? else {
        return Ok(());
    };
    let valid = s.minted.token("valid_v2");
    let cases = [
        (
            "wrong audience",
            s.minted.token("wrong_audience"),
            "audience",
        ),
        ("expired", s.minted.token("expired"), "expired"),
        ("alg none", s.minted.token("none"), "\"none\""),
        (
            "HS256 keyed with the RSA public key",
            s.minted.token("hs256_confusion"),
            "\"HS256\"",
        ),
        (
            "wrong tenant",
            s.minted.token("wrong_tenant"),
            "not trusted",
        ),
        (
            "nbf in the future",
            s.minted.token("nbf_future"),
            "not valid yet",
        ),
        (
            "tampered payload",
            tampered(&valid, "oid", json!("someone-else"))?,
            "signature",
        ),
        ("oversized", s.minted.token("oversized"), "limit"),
    ];
    for (case, token, reason) in cases {
        let auth = bearer(&token);
        let resp = request(
            &s.conn,
            get_with("/api/v1/secrets", &[("authorization", auth.as_str())])?,
        )
        .await?;
        assert_eq!(resp.status(), StatusCode::UNAUTHORIZED, "{case}");
        let status = body_json(resp).await?;
        assert_eq!(status["kind"], "Status", "{case}");
        assert_eq!(status["reason"], "Unauthorized", "{case}");
        assert_eq!(status["code"], 401, "{case}");
        let message = status["message"].as_str().unwrap_or_default();
        assert!(
            message.contains(reason),
            "{case}: {message:?} should mention {reason:?}"
        );
        assert!(!message.contains(&token), "{case}: the token is echoed");
    }
    // Two credentials, one of them Entra-style: which one would count is not the agent's to guess.
    let auth = bearer(&valid);
    let req = Request::get("/api/v1/secrets")
        .header("authorization", auth.as_str())
        .header("authorization", "Bearer opaque")
        .body(Empty::<Bytes>::new())?;
    let resp = request(&s.conn, req).await?;
    assert_eq!(resp.status(), StatusCode::UNAUTHORIZED);

    assert!(
        s.env.api.seen().is_empty(),
        "a refused token reached the apiserver: {:?}",
        s.env.api.seen()
    );
    Ok(())
}

#[tokio::test]
async fn service_account_and_opaque_tokens_pass_through_unchanged() -> Result<()> {
    let Some(s) = proxy_setup().await? else {
        return Ok(());
    };
    // Shaped like a Kubernetes service-account token (not signed by anyone the agent knows: not its to judge).
    let part = |v: Value| URL_SAFE_NO_PAD.encode(v.to_string());
    let sa = format!(
        "{}.{}.c2lnbmF0dXJl",
        part(json!({"alg": "RS256", "kid": "sa-key"})),
        part(json!({
            "iss": "https://kubernetes.default.svc.cluster.local",
            "sub": "system:serviceaccount:ci:deployer",
            "aud": ["https://kubernetes.default.svc.cluster.local"],
            "exp": 4_000_000_000u64,
        }))
    );
    for token in [sa.as_str(), "opaque-static-token"] {
        let auth = bearer(token);
        let resp = request(
            &s.conn,
            get_with(
                "/api/v1/namespaces",
                &[
                    ("authorization", auth.as_str()),
                    ("impersonate-user", "bob"),
                ],
            )?,
        )
        .await?;
        assert_eq!(resp.status(), StatusCode::OK, "{token}");
        let seen = s.env.api.seen();
        let last = seen.last().context("the request reached the apiserver")?;
        assert_eq!(values(last, "authorization"), [auth.as_str()]);
        assert!(!last.client_cert, "no credential of the agent's is added");
        // Kubernetes decides whether this identity may impersonate.
        assert_eq!(impersonation_headers(last), ["impersonate-user"]);
        assert_eq!(values(last, "impersonate-user"), ["bob"]);
    }
    Ok(())
}

#[tokio::test]
async fn group_overage_is_resolved_through_the_relays_directory() -> Result<()> {
    let Some(s) = proxy_setup().await? else {
        return Ok(());
    };
    let auth = bearer(&s.minted.token("group_overage"));
    // Unknown to the directory: refused with the directory's reason, never an empty group list.
    let resp = request(
        &s.conn,
        get_with("/api/v1/pods", &[("authorization", auth.as_str())])?,
    )
    .await?;
    assert_eq!(resp.status(), StatusCode::UNAUTHORIZED);
    let message = body_json(resp).await?["message"]
        .as_str()
        .unwrap_or_default()
        .to_owned();
    assert!(message.contains("not in the directory"), "{message}");
    assert!(s.env.api.seen().is_empty());

    s.env
        .relay
        .set_groups(ALICE_OID, &["directory-group-1", "directory-group-2"]);
    let asked = s.env.relay.state.resolve_requests.load(Ordering::SeqCst);
    for _ in 0..2 {
        let resp = request(
            &s.conn,
            get_with("/api/v1/pods", &[("authorization", auth.as_str())])?,
        )
        .await?;
        assert_eq!(resp.status(), StatusCode::OK);
    }
    let seen = s.env.api.seen();
    assert_eq!(seen.len(), 2);
    for r in &seen {
        assert_eq!(
            values(r, "impersonate-group"),
            ["directory-group-1", "directory-group-2"]
        );
        assert_eq!(values(r, "impersonate-user"), [ALICE]);
    }
    // The answer is reused for the second request.
    assert_eq!(
        s.env.relay.state.resolve_requests.load(Ordering::SeqCst),
        asked + 1
    );
    Ok(())
}

/// The subject guard pins for the push certificate (the Helm chart's).
const PUSH_SUBJECT: &str = "tether-agent";

/// Guard in process, serving `PUT /snapshot` with `push_token` on `listener`; with `push_ca`, pushes also need a
/// certificate of that CA named [`PUSH_SUBJECT`].
struct TestGuard {
    store: Arc<SnapshotStore>,
    stop: Option<oneshot::Sender<()>>,
    task: tokio::task::JoinHandle<()>,
}

impl TestGuard {
    fn start(
        listener: TcpListener,
        ca: &common::TestCa,
        store: Arc<SnapshotStore>,
        push_token: &str,
        push_ca: Option<&Ca>,
    ) -> Result<Self> {
        let server = ca.issue(&["localhost", "127.0.0.1"])?;
        let callers = tether_guard::Callers {
            snapshot_subjects: push_ca
                .map(|_| vec![PUSH_SUBJECT.to_owned()])
                .unwrap_or_default(),
            snapshot_cas: push_ca
                .map(|c| c.certified().cert_der())
                .into_iter()
                .collect(),
            ..tether_guard::Callers::default()
        };
        let tls = tether_guard::server_tls_for(
            server.cert_pem.as_bytes(),
            server.key_pem.as_bytes(),
            ca.pem().as_bytes(),
            &callers,
        )?;
        let guard = Arc::new(Guard::new(None, store.clone(), GuardOptions::default()));
        let config = tether_guard::ServerConfig {
            tls,
            limits: tether_guard::Limits {
                callers,
                ..tether_guard::Limits::default()
            },
            snapshot_push_token: Some(Secret::new(push_token)),
        };
        let (stop, stopped) = oneshot::channel::<()>();
        let task = tokio::spawn(async move {
            let _ = tether_guard::run(guard, config, listener, async {
                let _ = stopped.await;
            })
            .await;
        });
        Ok(Self {
            store,
            stop: Some(stop),
            task,
        })
    }

    /// Waits until guard holds snapshot `version`.
    async fn wait_version(&self, version: u64) -> Result<()> {
        let mut versions = self.store.subscribe();
        tokio::time::timeout(DEADLINE, versions.wait_for(|v| *v == version))
            .await
            .with_context(|| {
                format!(
                    "guard did not get snapshot {version} (holds {})",
                    self.store.version()
                )
            })??;
        Ok(())
    }
}

impl Drop for TestGuard {
    fn drop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        self.task.abort();
    }
}

fn snapshot(version: u64, principal: &str) -> Value {
    json!({
        "version": version,
        "roles": [],
        "assignments": [
            {"id": format!("a{version}"), "roleId": VIEWER, "principalId": principal, "scope": {"namespace": "dev"}}
        ],
        "denyAssignments": [],
    })
}

/// Settings pushing to guard at `addr`, trusting `ca`, retrying quickly; presenting `push_cert` when given.
fn guard_config(
    env: &Env,
    addr: std::net::SocketAddr,
    ca: &common::TestCa,
    push_cert: Option<&CertifiedPem>,
) -> Result<GuardConfig> {
    let ca_path = env.dir.path().join("guard-ca.pem");
    std::fs::write(&ca_path, ca.pem())?;
    let mut guard = GuardConfig::new(
        format!("https://127.0.0.1:{}/snapshot", addr.port()),
        Secret::new("push-secret"),
    );
    guard.ca = Some(ca_path);
    if let Some(cert) = push_cert {
        let (cert_path, key_path) = (
            env.dir.path().join("push.crt"),
            env.dir.path().join("push.key"),
        );
        std::fs::write(&cert_path, &cert.cert_pem)?;
        std::fs::write(&key_path, &cert.key_pem)?;
        guard.client_cert = Some(cert_path);
        guard.client_key = Some(key_path);
    }
    guard.backoff = Backoff {
        base: Duration::from_millis(20),
        cap: Duration::from_millis(200),
        ..Backoff::default()
    };
    guard.timeout = Duration::from_secs(5);
    Ok(guard)
}

#[tokio::test]
async fn snapshots_from_the_relay_reach_guard() -> Result<()> {
    let mut env = env(Some("onb-1")).await?;
    let ca = common::TestCa::new()?;
    let listener = TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    let snapshot_file = env.dir.path().join("guard-snapshot.json");
    let store = Arc::new(SnapshotStore::open(&snapshot_file)?);
    // As the Helm chart runs it: pushes need the token and the agent's push certificate.
    let push_ca = Ca::new("tether-agent snapshot push CA")?;
    let push_cert = push_ca.issue_client(PUSH_SUBJECT, &[])?;
    let guard = TestGuard::start(listener, &ca, store.clone(), "push-secret", Some(&push_ca))?;

    // The relay sends the cluster's snapshot right after hello.
    env.relay.set_guard_snapshot(snapshot(1, "user-1"));
    let mut config = env.config(Some("onb-1"));
    config.guard = Some(guard_config(&env, addr, &ca, Some(&push_cert))?);
    let mut agent = Running::start(config);
    let _conn = env.next_tunnel().await?;
    guard.wait_version(1).await?;
    assert_eq!(store.current().assignments[0].principal_id, "user-1");

    // A change at the relay is pushed over the live channel and reaches guard.
    let channels = env.relay.set_guard_snapshot(snapshot(3, "user-3"));
    assert_eq!(channels, 1);
    guard.wait_version(3).await?;
    assert_eq!(store.current().assignments[0].principal_id, "user-3");
    // Guard persisted it (its last-known-good for restarts).
    let on_disk: Value = serde_json::from_slice(&std::fs::read(&snapshot_file)?)?;
    assert_eq!(on_disk["version"], 3);

    // A snapshot guard refuses (an unknown role) does not block the ones after it.
    let mut invalid = snapshot(4, "user-4");
    invalid["assignments"][0]["roleId"] = json!("no-such-role");
    env.relay.set_guard_snapshot(invalid);
    env.relay.set_guard_snapshot(snapshot(5, "user-5"));
    guard.wait_version(5).await?;
    assert_eq!(store.current().assignments[0].principal_id, "user-5");

    // An older snapshot (say, from a relay replica that is behind) does not roll guard back.
    env.relay.set_guard_snapshot(snapshot(2, "user-2"));
    env.relay.set_guard_snapshot(snapshot(6, "user-6"));
    guard.wait_version(6).await?;
    assert_eq!(store.current().assignments[0].principal_id, "user-6");

    agent.shutdown();
    agent.finished().await??;
    Ok(())
}

#[tokio::test]
async fn a_guard_that_is_down_at_first_gets_the_snapshot_once_it_comes_up() -> Result<()> {
    let mut env = env(Some("onb-1")).await?;
    let ca = common::TestCa::new()?;
    // Guard's port answers, but guard is not serving yet: every connection is closed at once, as by a
    // crashing pod.
    let listener = TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    let attempts = Arc::new(AtomicUsize::new(0));
    let (come_up, coming_up) = oneshot::channel::<()>();
    let down = tokio::spawn({
        let attempts = attempts.clone();
        async move {
            tokio::pin!(coming_up);
            loop {
                tokio::select! {
                    accepted = listener.accept() => {
                        if let Ok((tcp, _)) = accepted {
                            attempts.fetch_add(1, Ordering::SeqCst);
                            drop(tcp);
                        }
                    }
                    _ = &mut coming_up => return listener,
                }
            }
        }
    });

    env.relay.set_guard_snapshot(snapshot(7, "user-7"));
    let mut config = env.config(Some("onb-1"));
    config.guard = Some(guard_config(&env, addr, &ca, None)?);
    let mut agent = Running::start(config);
    let _conn = env.next_tunnel().await?;
    // The agent tried, failed, and retried.
    eventually(DEADLINE, || {
        (attempts.load(Ordering::SeqCst) >= 2).then_some(())
    })
    .await?;

    let _ = come_up.send(());
    let listener = down.await?;
    let store = Arc::new(SnapshotStore::in_memory(Default::default()));
    let guard = TestGuard::start(listener, &ca, store.clone(), "push-secret", None)?;
    guard.wait_version(7).await?;
    assert_eq!(store.current().assignments[0].principal_id, "user-7");

    agent.shutdown();
    agent.finished().await??;
    Ok(())
}

/// Forwards connections from a fresh loopback port to `to`, counting the bytes the client sent: evidence that the
/// agent kept trying.
async fn counting_forwarder(
    to: std::net::SocketAddr,
) -> Result<(std::net::SocketAddr, Arc<AtomicUsize>)> {
    let listener = TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    let sent = Arc::new(AtomicUsize::new(0));
    let counter = sent.clone();
    tokio::spawn(async move {
        while let Ok((client, _)) = listener.accept().await {
            let counter = counter.clone();
            tokio::spawn(async move {
                let Ok(server) = tokio::net::TcpStream::connect(to).await else {
                    return;
                };
                let (mut client_read, mut client_write) = client.into_split();
                let (mut server_read, mut server_write) = server.into_split();
                let upstream = async {
                    let mut buf = vec![0u8; 16 * 1024];
                    loop {
                        match client_read.read(&mut buf).await {
                            Ok(0) | Err(_) => break,
                            Ok(n) => {
                                counter.fetch_add(n, Ordering::SeqCst);
                                if server_write.write_all(&buf[..n]).await.is_err() {
                                    break;
                                }
                            }
                        }
                    }
                    let _ = server_write.shutdown().await;
                };
                let downstream = async {
                    let _ = tokio::io::copy(&mut server_read, &mut client_write).await;
                    let _ = client_write.shutdown().await;
                };
                tokio::join!(upstream, downstream);
            });
        }
    });
    Ok((addr, sent))
}

/// Guard requires the push certificate: an agent without one, or with a certificate of another CA under the
/// pinned name, keeps trying and gets nothing applied; the agent with the push certificate gets it applied.
#[tokio::test]
async fn guard_refuses_pushes_without_the_agents_push_certificate() -> Result<()> {
    let mut env = env(Some("onb-1")).await?;
    let ca = common::TestCa::new()?;
    let listener = TcpListener::bind("127.0.0.1:0").await?;
    let guard_addr = listener.local_addr()?;
    let store = Arc::new(SnapshotStore::in_memory(Default::default()));
    let push_ca = Ca::new("tether-agent snapshot push CA")?;
    let guard = TestGuard::start(listener, &ca, store.clone(), "push-secret", Some(&push_ca))?;
    env.relay.set_guard_snapshot(snapshot(9, "user-9"));

    let impostor = Ca::new("another CA")?.issue_client(PUSH_SUBJECT, &[])?;
    for push_cert in [None, Some(&impostor)] {
        let (addr, sent) = counting_forwarder(guard_addr).await?;
        let mut config = env.config(Some("onb-1"));
        config.guard = Some(guard_config(&env, addr, &ca, push_cert)?);
        let mut agent = Running::start(config);
        let _conn = env.next_tunnel().await?;
        // Several pushes went out (a handshake and a request are well under 4 KiB; the agent retries every
        // ≤ 200 ms), and none was applied.
        eventually(DEADLINE, || {
            (sent.load(Ordering::SeqCst) > 16 * 1024).then_some(())
        })
        .await?;
        assert_eq!(store.version(), 0, "applied without the push certificate");
        agent.shutdown();
        agent.finished().await??;
    }

    let push_cert = push_ca.issue_client(PUSH_SUBJECT, &[])?;
    let mut config = env.config(Some("onb-1"));
    config.guard = Some(guard_config(&env, guard_addr, &ca, Some(&push_cert))?);
    let mut agent = Running::start(config);
    let _conn = env.next_tunnel().await?;
    guard.wait_version(9).await?;
    agent.shutdown();
    agent.finished().await??;
    Ok(())
}
