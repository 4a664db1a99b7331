//! The cluster lifecycle at the relay, driven by fake agents built from `tether_tunnel`: identity issuance and
//! checks, the control channel (hello, heartbeats, metadata, health, renewal), connectivity status and its
//! persistence, inventory filters, export/import. Thresholds are short configured values; every wait is on a
//! condition with a deadline.

mod common;

use std::convert::Infallible;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context as _, anyhow};
use bytes::Bytes;
use common::{AgentIdentity, TestRelay, dial, new_csr};
use http::{Method, Request, Response, StatusCode};
use http_body_util::combinators::BoxBody;
use http_body_util::{BodyExt, Full, StreamBody};
use hyper::body::{Frame, Incoming};
use hyper::service::service_fn;
use hyper_util::rt::{TokioExecutor, TokioIo};
use serde_json::{Value, json};
use tether_api::control::{
    self, Certificate, ControlError, Draining, Health, Heartbeat, Hello, Message, Metadata, Reader,
    Renew, Welcome,
};
use tether_testkit::tools;
use tether_tunnel::{Connection, OpenOptions, Priority, Stream, TunnelError, code, kind, ws};
use tokio::io::{AsyncWriteExt, ReadHalf, WriteHalf};
use tokio::sync::mpsc;

type BoxError = Box<dyn std::error::Error + Send + Sync>;

async fn within<T>(what: &str, fut: impl Future<Output = T>) -> anyhow::Result<T> {
    tokio::time::timeout(Duration::from_secs(20), fut)
        .await
        .map_err(|_| anyhow!("timed out waiting for {what}"))
}

/// A fake agent: a tunnel, its control channel, and (optionally) an HTTP server for relay-opened streams.
struct Agent {
    conn: Connection,
    reader: Reader<ReadHalf<Stream>>,
    writer: WriteHalf<Stream>,
    welcome: Welcome,
}

impl Agent {
    /// Dials as `identity`, opens the control channel and says hello.
    async fn connect(
        relay: &TestRelay,
        identity: &AgentIdentity,
        version: &str,
    ) -> anyhow::Result<Agent> {
        let conn = dial(relay, identity).await?;
        let mut agent = Self::open_control(conn).await?;
        agent
            .send(Message::Hello(Hello {
                agent_version: version.into(),
                ..Hello::default()
            }))
            .await?;
        match agent.recv().await? {
            Message::Welcome(w) => agent.welcome = w,
            other => anyhow::bail!("expected welcome, got {other:?}"),
        }
        // Every hello is followed by the cluster's guard snapshot (tests/guard.rs looks at its contents).
        match agent.recv().await? {
            Message::GuardSnapshot(_) => {}
            other => anyhow::bail!("expected guardSnapshot, got {other:?}"),
        }
        Ok(agent)
    }

    async fn open_control(conn: Connection) -> anyhow::Result<Agent> {
        let stream = conn.open(OpenOptions {
            kind: kind::CONTROL,
            priority: Priority::Control,
            deadline: Some(Duration::from_secs(10)),
            metadata: Bytes::new(),
        })?;
        within(
            "the control stream to be accepted",
            stream.control().accepted(),
        )
        .await??;
        let (rd, writer) = tokio::io::split(stream);
        Ok(Agent {
            conn,
            reader: Reader::new(rd),
            writer,
            welcome: Welcome::default(),
        })
    }

    async fn send(&mut self, m: Message) -> anyhow::Result<()> {
        control::send(&mut self.writer, &m).await?;
        Ok(())
    }

    async fn recv(&mut self) -> anyhow::Result<Message> {
        within("a control message", self.reader.recv())
            .await??
            .ok_or_else(|| anyhow!("the control channel ended"))
    }

    async fn heartbeat(&mut self, seq: u64) -> anyhow::Result<()> {
        self.send(Message::Heartbeat(Heartbeat { seq })).await
    }

    /// Sends heartbeats, as a live agent does, until the relay shows `status` (so a slow test machine cannot
    /// miss a short Connected window).
    async fn beat_until(
        &mut self,
        admin: &common::Admin,
        cluster: &str,
        status: &str,
    ) -> anyhow::Result<Value> {
        let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
        for seq in 0.. {
            self.heartbeat(seq).await?;
            let v = admin.show(cluster).await?.json()?;
            if v["connectivityStatus"] == status {
                return Ok(v);
            }
            anyhow::ensure!(
                tokio::time::Instant::now() < deadline,
                "{cluster} never became {status}: {v}"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        unreachable!("the loop only ends by returning")
    }

    /// Renews with a new key: returns the new identity, or the relay's error message.
    async fn renew(&mut self, cluster: &str) -> anyhow::Result<Result<AgentIdentity, String>> {
        let (key_pem, csr) = new_csr(cluster)?;
        self.send(Message::Renew(Renew { csr })).await?;
        Ok(match self.recv().await? {
            Message::Certificate(Certificate {
                certificate,
                not_after,
            }) => Ok(AgentIdentity {
                cluster: cluster.into(),
                cert_pem: certificate,
                key_pem,
                not_after,
            }),
            Message::Error(e) => Err(e.message),
            other => anyhow::bail!("unexpected answer to renew: {other:?}"),
        })
    }
}

/// Serves relay-opened HTTP streams on `conn`: `/watch` streams whatever `events` yields; anything else 200 "ok".
fn serve_http(conn: Connection, events: mpsc::Receiver<Bytes>) {
    let events = Arc::new(tokio::sync::Mutex::new(Some(events)));
    tokio::spawn(async move {
        while let Some(incoming) = conn.accept().await {
            let Ok(stream) = incoming.accept(Bytes::new()) else {
                continue;
            };
            let events = events.clone();
            tokio::spawn(async move {
                let svc = service_fn(move |req: Request<Incoming>| {
                    let events = events.clone();
                    async move {
                        let body: BoxBody<Bytes, BoxError> = if req.uri().path() == "/watch" {
                            let rx = events.lock().await.take();
                            let stream = futures_util::stream::unfold(rx, |rx| async move {
                                let mut rx = rx?;
                                let chunk = rx.recv().await?;
                                Some((Ok::<_, BoxError>(Frame::data(chunk)), Some(rx)))
                            });
                            BodyExt::boxed(StreamBody::new(stream))
                        } else {
                            Full::new(Bytes::from_static(b"ok"))
                                .map_err(|never| match never {})
                                .boxed()
                        };
                        Ok::<_, Infallible>(Response::new(body))
                    }
                });
                let _ = hyper::server::conn::http1::Builder::new()
                    .serve_connection(TokioIo::new(stream), svc)
                    .await;
            });
        }
    });
}

fn short_config(dir: &std::path::Path) -> tether_relay::Config {
    let mut config = tether_relay::Config::new(dir.to_path_buf());
    config.heartbeat_interval = Duration::from_secs(1);
    config.offline_threshold = Duration::from_secs(2);
    config
}

fn rejected(result: Result<Connection, ws::ConnectError>) -> anyhow::Result<(StatusCode, Value)> {
    match result {
        Err(ws::ConnectError::Rejected { status, body }) => Ok((
            status,
            serde_json::from_str(&body).unwrap_or(Value::String(body)),
        )),
        Err(other) => anyhow::bail!("expected an HTTP refusal, got {other}"),
        Ok(_) => anyhow::bail!("expected a refusal, the tunnel connected"),
    }
}

fn openssl(args: &[&str]) -> anyhow::Result<Option<String>> {
    match std::process::Command::new("openssl").args(args).output() {
        Ok(out) => {
            let text = format!(
                "{}{}",
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            );
            anyhow::ensure!(out.status.success(), "openssl {args:?}: {text}");
            Ok(Some(text))
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(e.into()),
    }
}

#[tokio::test]
async fn the_identity_is_issued_for_the_agents_key_and_verifies_with_openssl() -> anyhow::Result<()>
{
    let dir = tempfile::tempdir()?;
    let mut config = tether_relay::Config::new(dir.path().join("relay"));
    config.identity_validity = Duration::from_secs(3600);
    let relay = TestRelay::start_with(config).await?;
    let admin = relay.admin()?;
    let before = time::OffsetDateTime::now_utc();
    let identity = admin.onboarded("edge").await?;
    let not_after = time::OffsetDateTime::parse(
        &identity.not_after,
        &time::format_description::well_known::Rfc3339,
    )?;
    let expected = before + time::Duration::hours(1);
    assert!(
        (not_after - expected).abs() <= time::Duration::seconds(5),
        "notAfter {not_after} is not about an hour from now"
    );
    let shown = admin.show("edge").await?.json()?;
    assert_eq!(shown["identity"]["notAfter"], identity.not_after.as_str());
    assert_eq!(shown["connectivityStatus"], "Connecting");
    let der = rustls_pemfile::certs(&mut identity.cert_pem.as_bytes())
        .next()
        .ok_or_else(|| anyhow!("no certificate"))??;
    assert_eq!(
        shown["identity"]["fingerprint"],
        hex::encode(<sha2::Sha256 as sha2::Digest>::digest(&der))
    );

    // An independent implementation checks the chain, the purpose, the names and the key.
    let files = dir.path();
    std::fs::write(files.join("cert.pem"), &identity.cert_pem)?;
    std::fs::write(files.join("key.pem"), &identity.key_pem)?;
    std::fs::write(files.join("agent-ca.pem"), &relay.agent_ca_pem)?;
    let path = |name: &str| files.join(name).display().to_string();
    let Some(verified) = openssl(&[
        "verify",
        "-CAfile",
        &path("agent-ca.pem"),
        "-purpose",
        "sslclient",
        &path("cert.pem"),
    ])?
    else {
        tools::skip_or_fail::<()>(
            "openssl is not installed: the independent certificate checks cannot run",
        );
        return relay.stop().await;
    };
    assert!(verified.contains(": OK"), "{verified}");
    let text = openssl(&["x509", "-in", &path("cert.pem"), "-noout", "-text"])?.unwrap_or_default();
    assert!(
        text.contains("Subject: CN=edge") || text.contains("Subject: CN = edge"),
        "{text}"
    );
    assert!(text.contains("URI:tether://cluster/edge"), "{text}");
    assert!(text.contains("TLS Web Client Authentication"), "{text}");
    assert!(
        !text.contains("whatever-the-agent-asks-for"),
        "the CSR's subject was kept: {text}"
    );
    let cert_key = openssl(&["x509", "-in", &path("cert.pem"), "-noout", "-pubkey"])?;
    let own_key = openssl(&["pkey", "-in", &path("key.pem"), "-pubout"])?;
    assert_eq!(
        cert_key, own_key,
        "the certificate is not for the agent's key"
    );
    // The server CA does not vouch for agents.
    std::fs::write(files.join("server-ca.pem"), &relay.ca_pem)?;
    assert!(
        openssl(&[
            "verify",
            "-CAfile",
            &path("server-ca.pem"),
            &path("cert.pem")
        ])
        .is_err(),
        "the agent CA must be separate from the server CA"
    );
    relay.stop().await
}

#[tokio::test]
async fn status_goes_connecting_connected_offline_and_back() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let mut config = short_config(dir.path());
    config.replica_id = Some("relay-test-0".into());
    let relay = TestRelay::start_with(config).await?;
    let admin = relay.admin()?;
    admin.create_ok("quiet").await?;
    assert_eq!(
        admin.show("quiet").await?.json()?["connectivityStatus"],
        "Connecting"
    );
    assert!(admin.show("quiet").await?.json()?["lastConnectivityTime"].is_null());

    let identity = admin.onboarded("edge").await?;
    assert_eq!(
        admin.show("edge").await?.json()?["connectivityStatus"],
        "Connecting"
    );
    let mut agent = Agent::connect(&relay, &identity, "0.1.0").await?;
    assert_eq!(agent.welcome.heartbeat_interval_seconds, 1);
    // One relay: the welcome names it and counts one live replica.
    assert_eq!(agent.welcome.replica, "relay-test-0");
    assert_eq!(agent.welcome.replicas, 1);
    let shown = agent.beat_until(&admin, "edge", "Connected").await?;
    assert_eq!(shown["connected"], true);
    assert_eq!(shown["tunnels"][0]["replica"], "relay-test-0", "{shown}");
    assert!(shown["lastConnectivityTime"].is_string(), "{shown}");

    // Silence on the control channel (the tunnel itself stays up): Offline after the threshold.
    let shown = admin.wait_status("edge", "Offline").await?;
    assert_eq!(shown["connected"], true, "{shown}");
    let silent_since = shown["lastConnectivityTime"].clone();

    // A heartbeat brings it back.
    let shown = agent.beat_until(&admin, "edge", "Connected").await?;
    assert_ne!(shown["lastConnectivityTime"], silent_since);
    // And it ends Offline again once the agent is gone for good.
    agent.conn.close(code::NO_ERROR, "agent stopping");
    let shown = admin.wait_status("edge", "Offline").await?;
    assert_eq!(shown["connected"], false);
    relay.stop().await
}

#[tokio::test]
async fn heartbeats_are_written_in_batches_and_survive_a_restart() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let mut config = tether_relay::Config::new(dir.path().to_path_buf());
    config.limits.last_seen_interval = Duration::from_millis(200);
    let relay = TestRelay::start_with(config).await?;
    let admin = relay.admin()?;
    let identity = admin.onboarded("edge").await?;
    let mut agent = Agent::connect(&relay, &identity, "0.1.0").await?;
    let connected = admin.wait_status("edge", "Connected").await?;
    let t0 = connected["lastConnectivityTime"].clone();

    // Heartbeat until the recorded time moves past the connect (timestamps have whole seconds).
    let mut seq = 0;
    let shown = loop {
        seq += 1;
        agent.heartbeat(seq).await?;
        let v = admin.show("edge").await?.json()?;
        if v["lastConnectivityTime"] != t0 {
            break v;
        }
        anyhow::ensure!(seq < 2000, "lastConnectivityTime never moved: {v}");
        tokio::time::sleep(Duration::from_millis(10)).await;
    };
    let t1 = shown["lastConnectivityTime"].clone();
    let t1_time = time::OffsetDateTime::parse(
        t1.as_str().unwrap_or_default(),
        &time::format_description::well_known::Rfc3339,
    )?;

    // The batch reaches the database while the relay runs (read it with a second store handle).
    let url = format!("sqlite://{}", dir.path().join("relay.db").display());
    let store = tether_relay::store::SqliteStore::open(&url).await?;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    loop {
        use tether_relay::store::Store as _;
        let stored = store.cluster("edge").await?.and_then(|c| c.last_seen);
        if stored.is_some_and(|t| t >= t1_time) {
            break;
        }
        anyhow::ensure!(
            tokio::time::Instant::now() < deadline,
            "never flushed: {stored:?}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    tether_relay::store::Store::close(&store).await?;

    agent.heartbeat(seq + 1).await?;
    relay.stop().await?;
    within("the tunnel to close", agent.conn.closed()).await?;

    // After a restart the status comes from what was persisted.
    let relay = TestRelay::start(dir.path()).await?;
    let shown = relay.admin()?.show("edge").await?.json()?;
    assert_eq!(shown["connectivityStatus"], "Connected", "{shown}");
    assert_eq!(shown["connected"], false);
    let after = time::OffsetDateTime::parse(
        shown["lastConnectivityTime"].as_str().unwrap_or_default(),
        &time::format_description::well_known::Rfc3339,
    )?;
    assert!(
        after >= t1_time,
        "{after} < {t1_time}: a heartbeat was lost"
    );
    relay.stop().await?;
    // The same facts with a short threshold: Offline once it passes.
    let relay = TestRelay::start_with(short_config(dir.path())).await?;
    relay.admin()?.wait_status("edge", "Offline").await?;
    relay.stop().await
}

#[tokio::test]
async fn metadata_and_health_are_shown_with_upgrade_availability() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let mut config = tether_relay::Config::new(dir.path().to_path_buf());
    config.latest_agent_version = "0.2.0".into();
    let relay = TestRelay::start_with(config).await?;
    let admin = relay.admin()?;
    let identity = admin.onboarded("edge").await?;
    let mut agent = Agent::connect(&relay, &identity, "0.1.0").await?;
    assert_eq!(agent.welcome.latest_agent_version.as_deref(), Some("0.2.0"));
    assert_eq!(agent.welcome.heartbeat_interval_seconds, 30);
    let metadata = |nodes: u64| {
        Message::Metadata(Metadata {
            kubernetes_version: "v1.33.1+k3s1".into(),
            node_count: nodes,
            total_cpu_millis: 4000 * nodes,
            total_memory_bytes: (8 << 30) * nodes,
            distribution: "k3s".into(),
            infrastructure: "aws".into(),
            agent_version: "0.1.0".into(),
        })
    };
    agent.send(metadata(3)).await?;
    agent
        .send(Message::Health(Health {
            agent_version: "0.1.0".into(),
            uptime_seconds: 42,
            memory_bytes: 30 << 20,
            cpu_seconds: 1.5,
            reconnects: 2,
            tunnel_rtt_millis: Some(0.8),
        }))
        .await?;
    let shown = admin
        .wait_for("edge", "reported", |v| {
            v["nodeCount"] == 3 && v["agentHealth"]["uptimeSeconds"] == 42
        })
        .await?;
    assert_eq!(shown["kubernetesVersion"], "v1.33.1+k3s1");
    assert_eq!(shown["totalCpuMillis"], 12000);
    assert_eq!(shown["totalMemoryBytes"], 3u64 * (8 << 30));
    assert_eq!(shown["distribution"], "k3s");
    assert_eq!(shown["infrastructure"], "aws");
    assert_eq!(shown["agentVersion"], "0.1.0");
    assert_eq!(shown["latestAgentVersion"], "0.2.0");
    assert_eq!(shown["upgradeAvailable"], true);
    let health = &shown["agentHealth"];
    assert_eq!(health["memoryBytes"], 30 << 20);
    assert_eq!(health["cpuSeconds"], 1.5);
    assert_eq!(health["reconnects"], 2);
    assert_eq!(health["tunnelRttMillis"], 0.8);
    assert!(health["reportedAt"].is_string());

    // A node joins: the next report replaces the old one.
    agent.send(metadata(4)).await?;
    admin
        .wait_for("edge", "4 nodes", |v| v["nodeCount"] == 4)
        .await?;

    // An agent at the latest version has no upgrade waiting.
    agent.conn.close(code::NO_ERROR, "upgrading");
    let _new = Agent::connect(&relay, &identity, "0.2.0").await?;
    admin
        .wait_for("edge", "upgraded", |v| {
            v["agentVersion"] == "0.2.0" && v["upgradeAvailable"] == false
        })
        .await?;
    relay.stop().await
}

#[tokio::test]
async fn renewal_over_the_control_channel_keeps_the_tunnel_and_its_streams() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let relay = TestRelay::start(dir.path()).await?;
    let admin = relay.admin()?;
    let old = admin.onboarded("edge").await?;
    let mut agent = Agent::connect(&relay, &old, "0.1.0").await?;
    let (events, rx) = mpsc::channel::<Bytes>(1);
    serve_http(agent.conn.clone(), rx);

    // A watch through the relay, open across the renewal.
    let client = relay.client()?;
    let io = TokioIo::new(client.raw_tls(b"h2").await?);
    let (mut sender, conn) =
        hyper::client::conn::http2::handshake(TokioExecutor::new(), io).await?;
    tokio::spawn(conn);
    let req = client
        .request(true, Method::GET, "/clusters/edge/watch")
        .header(http::header::AUTHORIZATION, "Bearer t")
        .body(Full::<Bytes>::default())?;
    let resp = sender.send_request(req).await?;
    assert_eq!(resp.status(), StatusCode::OK);
    let mut body = resp.into_body();
    let mut next_event = async |n: u32| -> anyhow::Result<()> {
        let event = Bytes::from(format!("{{\"type\":\"ADDED\",\"n\":{n}}}\n"));
        events.send(event.clone()).await?;
        let mut got = Vec::new();
        while got.len() < event.len() {
            let frame = within("a watch event", body.frame())
                .await?
                .ok_or_else(|| anyhow!("the watch ended"))??;
            if let Ok(data) = frame.into_data() {
                got.extend_from_slice(&data);
            }
        }
        anyhow::ensure!(got == event, "event {n} changed");
        Ok(())
    };
    next_event(1).await?;

    let garbage = {
        agent
            .send(Message::Renew(Renew {
                csr: "garbage".into(),
            }))
            .await?;
        agent.recv().await?
    };
    assert!(
        matches!(&garbage, Message::Error(e) if e.message.contains("certificate signing request")),
        "{garbage:?}"
    );
    let renewed = agent
        .renew("edge")
        .await?
        .map_err(|e| anyhow!("renew: {e}"))?;
    assert_ne!(renewed.cert_pem, old.cert_pem);
    let shown = admin.show("edge").await?.json()?;
    assert_eq!(shown["identity"]["notAfter"], renewed.not_after.as_str());
    next_event(2).await?;
    assert!(!agent.conn.is_closed(), "the renewal closed the tunnel");
    next_event(3).await?;

    drop(body);
    drop(sender);

    // The replaced certificate stops working at once: a stolen copy opens no tunnel and passes no identity
    // check, and the refusal says why.
    let (status, body) = rejected(dial(&relay, &old).await)?;
    assert_eq!(status, StatusCode::UNAUTHORIZED, "{body}");
    assert!(
        body["message"]
            .as_str()
            .is_some_and(|m| m.contains("replaced by a renewal")),
        "{body}"
    );
    let check = identity_check(&relay, &old).await?;
    assert!(
        check.status_message(401)?.contains("replaced by a renewal"),
        "{check:?}"
    );
    assert_eq!(
        identity_check(&relay, &renewed).await?.status,
        StatusCode::OK
    );
    let _new = dial(&relay, &renewed)
        .await
        .context("the renewed certificate")?;
    // The renewing tunnel holds the new certificate: it stays.
    assert!(!agent.conn.is_closed(), "the renewing tunnel was closed");
    relay.stop().await
}

/// `GET /agent/v1/check` as `identity`'s agent.
async fn identity_check(
    relay: &TestRelay,
    identity: &AgentIdentity,
) -> anyhow::Result<common::Reply> {
    let client = relay.client_as(identity)?;
    let req = client
        .request(false, Method::GET, "/agent/v1/check")
        .header("tether-cluster", identity.cluster.as_str())
        .body(Full::default())?;
    client.send(false, req).await
}

#[tokio::test]
async fn tunnels_still_up_with_a_replaced_certificate_are_closed_after_the_grace()
-> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let mut config = tether_relay::Config::new(dir.path().to_path_buf());
    config.replaced_identity_grace = Duration::from_secs(1);
    let relay = TestRelay::start_with(config).await?;
    let admin = relay.admin()?;
    let old = admin.onboarded("edge").await?;
    let mut agent = Agent::connect(&relay, &old, "0.1.0").await?;
    // A second tunnel with the same certificate: the agent's other tunnel, or a thief's with a stolen copy.
    let other = dial(&relay, &old).await?;
    let renewed = agent
        .renew("edge")
        .await?
        .map_err(|e| anyhow!("renew: {e}"))?;
    // The other tunnel gets the grace to move, then is closed; a new one with the old certificate is refused
    // meanwhile.
    let (status, body) = rejected(dial(&relay, &old).await)?;
    assert_eq!(status, StatusCode::UNAUTHORIZED, "{body}");
    let info = within("the other tunnel to be closed", other.closed()).await?;
    assert!(
        info.error
            .as_ref()
            .is_some_and(|e| e.to_string().contains("replaced by a renewal")),
        "{info:?}"
    );
    // The renewing tunnel stays, and the agent's control channel still works on it.
    assert!(!agent.conn.is_closed(), "the renewing tunnel was closed");
    agent.heartbeat(1).await?;
    let shown = admin.show("edge").await?.json()?;
    assert_eq!(
        shown["tunnels"].as_array().map(Vec::len),
        Some(1),
        "{shown}"
    );
    // A renewal through the replaced certificate is not possible either: its tunnel is gone, and a new one is
    // refused, so only the holder of the new certificate can renew again.
    let _new = dial(&relay, &renewed).await?;
    relay.stop().await
}

#[tokio::test]
async fn an_expired_identity_is_refused_with_a_reason_and_recovered_by_connecting_again()
-> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let mut config = tether_relay::Config::new(dir.path().to_path_buf());
    config.identity_validity = Duration::from_secs(4);
    let relay = TestRelay::start_with(config).await?;
    let admin = relay.admin()?;
    let identity = admin.onboarded("edge").await?;
    let agent = Agent::connect(&relay, &identity, "0.1.0").await?;
    admin.wait_status("edge", "Connected").await?;

    // At notAfter the live tunnel is closed and the status says Expired.
    within("the expired tunnel to close", agent.conn.closed()).await?;
    let shown = admin.wait_status("edge", "Expired").await?;
    assert_eq!(shown["identity"]["notAfter"], identity.not_after.as_str());
    let (status, body) = rejected(dial(&relay, &identity).await)?;
    assert_eq!(status, StatusCode::UNAUTHORIZED);
    assert_eq!(body["reason"], "IdentityExpired", "{body}");
    let message = body["message"].as_str().unwrap_or_default();
    assert!(
        message.contains(&format!("expired at {}", identity.not_after))
            && message.contains("delete the cluster and connect it again"),
        "{message}"
    );
    // `status=Expired` finds it.
    assert_eq!(admin.list_names("status=Expired").await?, ["edge"]);

    // Recovery, as the message says: delete, connect again.
    assert_eq!(admin.delete("edge").await?.status, StatusCode::NO_CONTENT);
    let fresh = admin.onboarded("edge").await?;
    let _agent = Agent::connect(&relay, &fresh, "0.1.0").await?;
    admin.wait_status("edge", "Connected").await?;
    relay.stop().await
}

#[tokio::test]
async fn the_control_channel_is_one_per_tunnel_and_robust_to_bad_input() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let relay = TestRelay::start(dir.path()).await?;
    let admin = relay.admin()?;
    let identity = admin.onboarded("edge").await?;
    let mut agent = Agent::connect(&relay, &identity, "0.1.0").await?;

    // A second control stream is refused.
    let second = agent.conn.open(OpenOptions {
        kind: kind::CONTROL,
        priority: Priority::Control,
        deadline: Some(Duration::from_secs(10)),
        metadata: Bytes::new(),
    })?;
    match within("the relay's answer", second.control().accepted()).await? {
        Err(TunnelError::Refused { code, .. }) => assert_eq!(code, code::REFUSED),
        other => anyhow::bail!("expected a refusal, got {other:?}"),
    }

    // A message type from the future is ignored; the channel still answers.
    let future = br#"{"type":"roleAssignments","items":[]}"#;
    agent
        .writer
        .write_all(&(future.len() as u32).to_be_bytes())
        .await?;
    agent.writer.write_all(future).await?;
    let identity = agent
        .renew("edge")
        .await?
        .map_err(|e| anyhow!("renew: {e}"))?;

    // An oversized message resets the stream, without reading a megabyte first.
    agent
        .writer
        .write_all(&((control::MAX_MESSAGE_LEN + 1) as u32).to_be_bytes())
        .await?;
    match within("the reset", agent.reader.recv()).await? {
        Err(ControlError::Io(e)) => assert_eq!(e.kind(), std::io::ErrorKind::ConnectionReset),
        other => anyhow::bail!("expected a reset, got {other:?}"),
    }

    // On a new tunnel, anything before hello is answered with an error ...
    let conn = dial(&relay, &identity).await?;
    let mut early = Agent::open_control(conn).await?;
    early.heartbeat(0).await?;
    match early.recv().await? {
        Message::Error(e) => assert!(e.message.contains("hello"), "{}", e.message),
        other => anyhow::bail!("expected an error, got {other:?}"),
    }
    // ... after which the relay ends the channel.
    assert!(matches!(
        within("the end", early.reader.recv()).await?,
        Ok(None)
    ));
    relay.stop().await
}

#[tokio::test]
async fn the_inventory_filters_by_status_and_tags() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let relay = TestRelay::start(dir.path()).await?;
    let admin = relay.admin()?;
    let create = |name: &'static str, tags: Value| {
        let admin = &admin;
        async move {
            let reply = admin
                .client
                .post_json(
                    "/api/v1/clusters",
                    Some(&admin.token),
                    &json!({ "name": name, "tags": tags }),
                )
                .await?;
            anyhow::ensure!(reply.status == StatusCode::CREATED, "{reply:?}");
            reply.json()?["onboardingToken"]
                .as_str()
                .map(str::to_owned)
                .ok_or_else(|| anyhow!("no token"))
        }
    };
    let token = create("a-prod", json!({"env": "prod", "team": "x"})).await?;
    create("b-prod", json!({"env": "prod"})).await?;
    create("c-dev", json!({"env": "dev", "team": "x"})).await?;
    let identity = admin.onboard("a-prod", &token).await?;
    let _agent = Agent::connect(&relay, &identity, "0.1.0").await?;
    admin.wait_status("a-prod", "Connected").await?;

    let cases: [(&str, &[&str]); 8] = [
        ("", &["a-prod", "b-prod", "c-dev"]),
        ("status=Connected", &["a-prod"]),
        ("status=connecting", &["b-prod", "c-dev"]),
        (
            "status=Connected&status=Connecting",
            &["a-prod", "b-prod", "c-dev"],
        ),
        ("tag=env%3Dprod", &["a-prod", "b-prod"]),
        ("tag=env=prod&tag=team=x", &["a-prod"]),
        ("tag=team", &["a-prod", "c-dev"]),
        ("status=Connecting&tag=env=prod", &["b-prod"]),
    ];
    for (query, want) in cases {
        assert_eq!(admin.list_names(query).await?, want, "?{query}");
    }
    assert!(admin.list_names("status=Offline").await?.is_empty());
    for bad in ["status=Gone", "tag=", "colour=red"] {
        let reply = admin
            .client
            .get(&format!("/api/v1/clusters?{bad}"), Some(&admin.token))
            .await?;
        reply.status_message(400)?;
    }
    relay.stop().await
}

#[tokio::test]
async fn export_and_import_move_a_cluster_to_another_relay() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let old_relay = TestRelay::start(&dir.path().join("old")).await?;
    let new_relay = TestRelay::start(&dir.path().join("new")).await?;
    let old = old_relay.admin()?;
    let new = new_relay.admin()?;
    let reply = old
        .client
        .post_json(
            "/api/v1/clusters",
            Some(&old.token),
            &json!({ "name": "edge", "tags": {"env": "prod", "region": "eu"} }),
        )
        .await?;
    let token = reply.json()?["onboardingToken"]
        .as_str()
        .map(str::to_owned)
        .ok_or_else(|| anyhow!("no token"))?;
    let old_identity = old.onboard("edge", &token).await?;

    let exported = old
        .client
        .get("/api/v1/clusters/edge/export", Some(&old.token))
        .await?;
    assert_eq!(exported.status, StatusCode::OK);
    let doc = exported.json()?;
    assert_eq!(
        doc,
        json!({"apiVersion": "tether.dev/v1", "kind": "ClusterExport", "name": "edge",
               "tags": {"env": "prod", "region": "eu"}, "roleAssignments": [],
               "denyAssignments": [], "roleDefinitions": []})
    );
    old.client
        .get("/api/v1/clusters/ghost/export", Some(&old.token))
        .await?
        .status_message(404)?;

    let imported = new
        .client
        .post_json("/api/v1/clusters/import", Some(&new.token), &doc)
        .await?;
    assert_eq!(imported.status, StatusCode::CREATED, "{imported:?}");
    let v = imported.json()?;
    assert_eq!(v["name"], "edge");
    assert_eq!(v["tags"], json!({"env": "prod", "region": "eu"}));
    assert_eq!(v["onboarded"], false);
    assert_eq!(v["connectivityStatus"], "Connecting");
    assert!(v["identity"].is_null(), "no identity is carried over: {v}");
    let new_token = v["onboardingToken"]
        .as_str()
        .ok_or_else(|| anyhow!("no onboarding token: {v}"))?
        .to_owned();

    // The name is taken now; a document of another kind is not an export.
    let again = new
        .client
        .post_json("/api/v1/clusters/import", Some(&new.token), &doc)
        .await?;
    again.status_message(409)?;
    let mut wrong = doc.clone();
    wrong["kind"] = json!("Cluster");
    wrong["name"] = json!("other");
    new.client
        .post_json("/api/v1/clusters/import", Some(&new.token), &wrong)
        .await?
        .status_message(400)?;
    new.client
        .post_json("/api/v1/clusters/import", None, &doc)
        .await?
        .status_message(401)?;

    // The old identity means nothing at the new relay (another agent CA); the agent onboards there again.
    assert!(dial(&new_relay, &old_identity).await.is_err());
    let new_identity = new.onboard("edge", &new_token).await?;
    let _agent = Agent::connect(&new_relay, &new_identity, "0.1.0").await?;
    new.wait_status("edge", "Connected").await?;
    old_relay.stop().await?;
    new_relay.stop().await
}

#[tokio::test]
async fn shutdown_tells_each_agent_when_to_come_back_then_closes_gracefully() -> anyhow::Result<()>
{
    let dir = tempfile::tempdir()?;
    let mut config = tether_relay::Config::new(dir.path().to_path_buf());
    // Long enough that a control channel holding the tunnel open would show as a timeout below.
    config.limits.shutdown_grace = Duration::from_secs(120);
    // Two tunnels at one tunnel per second: come back within two seconds.
    config.limits.reconnect_rate = 1;
    let relay = TestRelay::start_with(config).await?;
    let admin = relay.admin()?;
    let mut agents = Vec::new();
    for name in ["edge", "core"] {
        let identity = admin.onboarded(name).await?;
        agents.push(Agent::connect(&relay, &identity, "0.1.0").await?);
    }
    // Read while the relay stops, as agents do (a relay that gives up on an agent that does not read resets
    // the channel, which discards what that agent had not read).
    let stopping = tokio::spawn(relay.stop());
    for mut agent in agents {
        let draining = agent.recv().await?;
        assert_eq!(
            draining,
            Message::Draining(Draining {
                reconnect_within_ms: 2_000,
                ..Draining::default()
            })
        );
        // Then the channel ends cleanly, and the tunnel with it.
        assert!(matches!(
            within("the control channel to end", agent.reader.recv()).await?,
            Ok(None)
        ));
        drop(agent.reader);
        drop(agent.writer);
        let info = within("the tunnel to close", agent.conn.closed()).await?;
        assert!(info.error.is_none(), "not a graceful close: {info:?}");
    }
    within("the relay to stop", stopping).await???;
    Ok(())
}
