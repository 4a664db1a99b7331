//! A relay fleet in one process: relays sharing one real PostgreSQL (`tether_testkit::postgres`) and one agent
//! CA, each with its peer link on a loopback port. A cluster's tunnel is on replica A; requests through
//! replica B reach it over the peer link (plain, with a body, a watch, an upgrade), with the client's real
//! address added once; a route to a replica that cannot be reached is skipped; and the peer link refuses
//! anything but a replica of this fleet (no client certificate, an agent's certificate, another CA's).
//!
//! The same with real processes, real kubectl and SIGKILL: `tests/fleet_processes.rs`.

mod common;

use std::convert::Infallible;
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context as _, anyhow};
use bytes::Bytes;
use common::{AgentIdentity, TestRelay};
use http::{HeaderValue, Method, Request, Response, StatusCode};
use http_body_util::{BodyExt, Full, StreamBody};
use hyper::body::{Frame, Incoming};
use hyper::service::service_fn;
use hyper_util::rt::TokioIo;
use tether_api::control::{self as wire, Draining, Hello, Message, Reader, Welcome};
use tether_relay::Config;
use tether_relay::store::{self, ReplicaLease, Store, TunnelRecord};
use tether_testkit::postgres::Postgres;
use tether_tunnel::{Connection, OpenOptions, Priority, Stream, code, kind};
use tokio::io::{AsyncReadExt, AsyncWriteExt, ReadHalf, WriteHalf};
use tokio::sync::mpsc;

type BoxError = Box<dyn std::error::Error + Send + Sync>;

const WAIT: Duration = Duration::from_secs(20);

async fn within<T>(what: &str, fut: impl Future<Output = T>) -> anyhow::Result<T> {
    tokio::time::timeout(WAIT, fut)
        .await
        .map_err(|_| anyhow!("timed out waiting for {what}"))
}

/// Relays on one database, sharing the first one's agent CA.
struct Fleet {
    relays: Vec<TestRelay>,
    ids: Vec<String>,
    store: Arc<dyn Store>,
    _dir: tempfile::TempDir,
}

impl Fleet {
    async fn start(url: &str, ids: &[&str]) -> anyhow::Result<Fleet> {
        Self::start_with(url, ids, |_| {}).await
    }

    /// Relays whose configuration `adjust` changes.
    async fn start_with(
        url: &str,
        ids: &[&str],
        adjust: impl Fn(&mut Config),
    ) -> anyhow::Result<Fleet> {
        let dir = tempfile::tempdir()?;
        let mut relays = Vec::new();
        for (i, id) in ids.iter().enumerate() {
            let data = dir.path().join(id);
            if i > 0 {
                std::fs::create_dir_all(&data)?;
                for file in ["agent-ca.pem", "agent-ca-key.pem"] {
                    std::fs::copy(dir.path().join(ids[0]).join(file), data.join(file))?;
                }
            }
            let mut config = Config::new(data);
            config.database_url = Some(url.to_owned());
            config.replica_id = Some((*id).to_owned());
            config.peer_listen = Some(SocketAddr::from((Ipv4Addr::LOCALHOST, 0)));
            config.lease_ttl = Duration::from_secs(2);
            adjust(&mut config);
            relays.push(TestRelay::start_with(config).await?);
        }
        Ok(Fleet {
            relays,
            ids: ids.iter().map(|s| (*s).to_owned()).collect(),
            store: store::open(url).await?,
            _dir: dir,
        })
    }

    /// Where replica `i`'s peer link is, as the store says.
    async fn peer_address(&self, i: usize) -> anyhow::Result<SocketAddr> {
        let replicas = self.store.live_replicas().await?;
        let address = replicas
            .iter()
            .find(|r| r.id == self.ids[i])
            .and_then(|r| r.peer_address.clone())
            .with_context(|| format!("no peer address for {}", self.ids[i]))?;
        Ok(address.parse()?)
    }

    fn agent_ca_dir(&self) -> std::path::PathBuf {
        self._dir.path().join(&self.ids[0])
    }

    async fn stop(self) -> anyhow::Result<()> {
        for relay in self.relays {
            relay.stop().await?;
        }
        Ok(())
    }
}

/// A fake agent answering each stream: `/watch` streams what `events` yields (JSON lines), `/exec` upgrades
/// and echoes, anything else describes the request it got (method, path, body length, X-Forwarded-For).
fn serve_agent(conn: Connection, events: mpsc::Receiver<Bytes>) {
    serve_agent_as(conn, events, "agent");
}

/// [`serve_agent`], saying `tag` in its descriptions (which tunnel served a request).
fn serve_agent_as(conn: Connection, events: mpsc::Receiver<Bytes>, tag: &'static str) {
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
                    async move { Ok::<_, Infallible>(answer(req, events, tag).await) }
                });
                let _ = hyper::server::conn::http1::Builder::new()
                    .serve_connection(TokioIo::new(stream), svc)
                    .with_upgrades()
                    .await;
            });
        }
    });
}

type AgentBody = http_body_util::combinators::BoxBody<Bytes, BoxError>;

async fn answer(
    mut req: Request<Incoming>,
    events: Arc<tokio::sync::Mutex<Option<mpsc::Receiver<Bytes>>>>,
    tag: &'static str,
) -> Response<AgentBody> {
    let json = |v: serde_json::Value| {
        let mut resp = Response::new(
            Full::new(Bytes::from(v.to_string()))
                .map_err(|never| match never {})
                .boxed(),
        );
        resp.headers_mut()
            .insert("content-type", HeaderValue::from_static("application/json"));
        resp
    };
    match req.uri().path() {
        "/watch" => {
            let rx = events.lock().await.take();
            let stream = futures_util::stream::unfold(rx, |rx| async move {
                let mut rx = rx?;
                let line = rx.recv().await?;
                Some((Ok::<_, BoxError>(Frame::data(line)), Some(rx)))
            });
            let mut resp = Response::new(BodyExt::boxed(StreamBody::new(stream)));
            resp.headers_mut()
                .insert("content-type", HeaderValue::from_static("application/json"));
            resp
        }
        "/exec" => {
            let on = hyper::upgrade::on(&mut req);
            tokio::spawn(async move {
                let Ok(upgraded) = on.await else { return };
                let mut io = TokioIo::new(upgraded);
                let mut all = Vec::new();
                let _ = io.read_to_end(&mut all).await;
                let _ = io.write_all(&all).await;
                let _ = io.shutdown().await;
            });
            let mut resp = Response::new(Full::new(Bytes::new()).map_err(|n| match n {}).boxed());
            *resp.status_mut() = StatusCode::SWITCHING_PROTOCOLS;
            resp.headers_mut()
                .insert("connection", HeaderValue::from_static("Upgrade"));
            resp.headers_mut()
                .insert("upgrade", HeaderValue::from_static("SPDY/3.1"));
            resp
        }
        _ => {
            let (parts, body) = req.into_parts();
            let body = body
                .collect()
                .await
                .map(|c| c.to_bytes())
                .unwrap_or_default();
            let forwarded: Vec<String> = parts
                .headers
                .get_all("x-forwarded-for")
                .iter()
                .filter_map(|v| v.to_str().ok().map(str::to_owned))
                .collect();
            json(serde_json::json!({
                "method": parts.method.as_str(),
                "uri": parts.uri.to_string(),
                "bodyLen": body.len(),
                "xForwardedFor": forwarded,
                "tunnel": tag,
            }))
        }
    }
}

/// An HTTP/1.1 connection to `relay` from the loopback address `from`.
async fn h1_from(
    relay: &TestRelay,
    from: IpAddr,
) -> anyhow::Result<hyper::client::conn::http1::SendRequest<Full<Bytes>>> {
    let client = relay.client()?;
    let io = TokioIo::new(client.raw_tls_from(b"http/1.1", Some(from)).await?);
    let (sender, conn) = hyper::client::conn::http1::handshake(io).await?;
    tokio::spawn(conn.with_upgrades());
    Ok(sender)
}

fn user_request(
    relay: &TestRelay,
    method: Method,
    path: &str,
) -> anyhow::Result<http::request::Builder> {
    Ok(relay
        .client()?
        .request(false, method, path)
        .header(http::header::AUTHORIZATION, "Bearer user-token"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_through_b_reach_the_tunnel_on_a_over_the_peer_link() -> anyhow::Result<()> {
    let Some(pg) = Postgres::start_or_skip("the relay fleet")? else {
        return Ok(());
    };
    let fleet = Fleet::start(&pg.fresh_database()?, &["relay-a", "relay-b"]).await?;
    let (a, b) = (&fleet.relays[0], &fleet.relays[1]);
    let identity = a.admin()?.onboarded("edge").await?;
    let conn = common::dial(a, &identity).await?;
    let (events, rx) = mpsc::channel::<Bytes>(4);
    serve_agent(conn.clone(), rx);
    // B shows the tunnel A holds.
    let shown = b
        .admin()?
        .wait_for("edge", "connected at relay-a", |v| {
            v["connected"] == true && v["tunnels"][0]["replica"] == "relay-a"
        })
        .await?;
    assert_eq!(
        shown["tunnels"].as_array().map(Vec::len),
        Some(1),
        "{shown}"
    );

    // A plain request, from another client address: the agent sees that address, once.
    let client_ip = IpAddr::V4(Ipv4Addr::new(127, 0, 0, 2));
    let mut sender = h1_from(b, client_ip).await?;
    let req = user_request(b, Method::GET, "/clusters/edge/api/v1/pods?limit=1")?
        .header("x-forwarded-for", "6.6.6.6")
        .body(Full::default())?;
    let resp = sender.send_request(req).await?;
    assert_eq!(resp.status(), StatusCode::OK);
    let v: serde_json::Value =
        serde_json::from_slice(&resp.into_body().collect().await?.to_bytes())?;
    assert_eq!(v["uri"], "/api/v1/pods?limit=1", "{v}");
    assert_eq!(v["xForwardedFor"], serde_json::json!(["127.0.0.2"]), "{v}");

    // A body goes through whole.
    let body = Bytes::from(vec![b'x'; 300_000]);
    let req = user_request(
        b,
        Method::POST,
        "/clusters/edge/api/v1/namespaces/default/configmaps",
    )?
    .body(Full::new(body.clone()))?;
    let reply = b.client()?.send(false, req).await?;
    assert_eq!(reply.status, StatusCode::OK, "{reply:?}");
    assert_eq!(reply.json()?["bodyLen"], 300_000);

    // A watch streams event by event, over HTTP/2 too.
    let client = b.client()?;
    let io = TokioIo::new(client.raw_tls(b"h2").await?);
    let (mut h2, h2conn) =
        hyper::client::conn::http2::handshake(hyper_util::rt::TokioExecutor::new(), io).await?;
    tokio::spawn(h2conn);
    let req = client
        .request(true, Method::GET, "/clusters/edge/watch?watch=true")
        .header(http::header::AUTHORIZATION, "Bearer user-token")
        .body(Full::<Bytes>::default())?;
    let resp = h2.send_request(req).await?;
    assert_eq!(resp.status(), StatusCode::OK);
    let mut watch = resp.into_body();
    for n in 0..3 {
        let line = Bytes::from(format!("{{\"type\":\"ADDED\",\"n\":{n}}}\n"));
        events.send(line.clone()).await?;
        let mut got = Vec::new();
        while got.len() < line.len() {
            let frame = within("a watch event", watch.frame())
                .await?
                .ok_or_else(|| anyhow!("the watch ended"))??;
            if let Ok(data) = frame.into_data() {
                got.extend_from_slice(&data);
            }
        }
        assert_eq!(got, line);
    }

    // An upgrade (exec over SPDY) becomes a byte pipe through both replicas, half-close included.
    let mut sender = h1_from(b, client_ip).await?;
    let req = user_request(b, Method::POST, "/clusters/edge/exec")?
        .header(http::header::CONNECTION, "Upgrade")
        .header(http::header::UPGRADE, "SPDY/3.1")
        .body(Full::default())?;
    let resp = sender.send_request(req).await?;
    assert_eq!(resp.status(), StatusCode::SWITCHING_PROTOCOLS);
    let mut io = TokioIo::new(hyper::upgrade::on(resp).await?);
    let payload: Vec<u8> = (0..500_000u32).map(|i| (i * 13 % 251) as u8).collect();
    let (mut rd, mut wr) = tokio::io::split(&mut io);
    let write = async {
        wr.write_all(&payload).await?;
        wr.shutdown().await
    };
    let read = async {
        let mut back = Vec::new();
        rd.read_to_end(&mut back).await.map(|_| back)
    };
    let (w, back) = within("the byte pipe", async { tokio::join!(write, read) }).await?;
    w?;
    assert!(back? == payload, "bytes changed through the peer link");

    // Requests without a credential are refused at B, before anything is forwarded.
    let reply = b.client()?.get("/clusters/edge/api", None).await?;
    reply.status_message(401)?;
    drop(watch);
    conn.close(tether_tunnel::code::NO_ERROR, "done");
    fleet.stop().await?;
    pg.stop();
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_route_to_an_unreachable_replica_is_skipped() -> anyhow::Result<()> {
    let Some(pg) = Postgres::start_or_skip("the relay fleet")? else {
        return Ok(());
    };
    let fleet = Fleet::start(&pg.fresh_database()?, &["relay-a", "relay-b"]).await?;
    let (a, b) = (&fleet.relays[0], &fleet.relays[1]);
    let identity = a.admin()?.onboarded("edge").await?;
    let conn = common::dial(a, &identity).await?;
    let (_events, rx) = mpsc::channel::<Bytes>(1);
    serve_agent(conn.clone(), rx);
    // A replica whose lease runs but whose peer link is gone (a port nothing listens on) also claims a tunnel.
    let dead = std::net::TcpListener::bind("127.0.0.1:0")?.local_addr()?;
    fleet
        .store
        .register_replica(&ReplicaLease {
            id: "relay-ghost".into(),
            peer_address: Some(dead.to_string()),
            ttl: Duration::from_secs(600),
            draining: false,
        })
        .await?;
    fleet
        .store
        .put_tunnel(&TunnelRecord {
            replica: "relay-ghost".into(),
            tunnel_id: 1,
            cluster: "edge".into(),
            agent_instance: String::new(),
            agent_tunnels: 0,
            transport: "wss".into(),
            agent_address: "10.9.9.9:1".into(),
            connected_since: time::OffsetDateTime::now_utc(),
            usable: true,
        })
        .await?;
    b.admin()?
        .wait_for("edge", "two tunnels in the fleet", |v| {
            v["tunnels"].as_array().map(Vec::len) == Some(2)
        })
        .await?;
    // Whichever route B tries first, every request succeeds: a connection that fails sent nothing.
    for i in 0..12 {
        let req = user_request(b, Method::POST, &format!("/clusters/edge/api/{i}"))?
            .body(Full::new(Bytes::from_static(b"{\"kind\":\"ConfigMap\"}")))?;
        let reply = b.client()?.send(false, req).await?;
        assert_eq!(reply.status, StatusCode::OK, "request {i}: {reply:?}");
        assert_eq!(reply.json()?["bodyLen"], 20);
    }
    fleet.store.remove_replica("relay-ghost").await?;
    conn.close(tether_tunnel::code::NO_ERROR, "done");
    fleet.stop().await?;
    pg.stop();
    Ok(())
}

/// A TLS client for the peer link presenting `identity` (certificate and key, PEM) if any, trusting `ca_pem`
/// for the server, with the server name `name`.
async fn peer_request(
    addr: SocketAddr,
    ca_pem: &str,
    name: &str,
    identity: Option<(&str, &str)>,
    path: &str,
    token: Option<&str>,
) -> anyhow::Result<StatusCode> {
    let config = tether_runtime::tls::client_config_with(&tether_runtime::tls::ClientOptions {
        ca_pem: Some(ca_pem.as_bytes()),
        identity: identity.map(|(cert, key)| tether_runtime::tls::ClientIdentity {
            cert_pem: cert.as_bytes(),
            key_pem: key.as_bytes(),
        }),
        alpn: &[b"http/1.1"],
        ..Default::default()
    })?;
    let tcp = tokio::net::TcpStream::connect(addr).await?;
    let tls = tokio_rustls::TlsConnector::from(config)
        .connect(
            rustls::pki_types::ServerName::try_from(name.to_owned())?,
            tcp,
        )
        .await?;
    let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(tls)).await?;
    tokio::spawn(conn);
    let mut req = Request::builder()
        .uri(path)
        .header(http::header::HOST, name);
    if let Some(token) = token {
        req = req.header(http::header::AUTHORIZATION, format!("Bearer {token}"));
    }
    let resp = sender
        .send_request(req.body(Full::<Bytes>::default())?)
        .await?;
    Ok(resp.status())
}

/// A certificate for `uri` signed by the CA in `dir` (`agent-ca.pem`, `agent-ca-key.pem`), or by a new CA
/// when `dir` is `None`; certificate and key, PEM.
fn replica_cert(dir: Option<&Path>, uri: &str) -> anyhow::Result<(String, String)> {
    let issuer = match dir {
        Some(dir) => {
            let key =
                rcgen::KeyPair::from_pem(&std::fs::read_to_string(dir.join("agent-ca-key.pem"))?)?;
            let pem = std::fs::read_to_string(dir.join("agent-ca.pem"))?;
            rcgen::Issuer::from_ca_cert_pem(&pem, key)?
        }
        None => {
            let key = rcgen::KeyPair::generate()?;
            let mut params = rcgen::CertificateParams::new(Vec::<String>::new())?;
            params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
            params
                .distinguished_name
                .push(rcgen::DnType::CommonName, "Tether agent CA");
            rcgen::Issuer::new(params, key)
        }
    };
    let key = rcgen::KeyPair::generate()?;
    let mut params = rcgen::CertificateParams::new(Vec::<String>::new())?;
    params.subject_alt_names = vec![rcgen::SanType::URI(uri.try_into()?)];
    params.extended_key_usages = vec![
        rcgen::ExtendedKeyUsagePurpose::ClientAuth,
        rcgen::ExtendedKeyUsagePurpose::ServerAuth,
    ];
    let cert = params.signed_by(&key, &issuer)?;
    Ok((cert.pem(), key.serialize_pem()))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_peer_link_refuses_anything_but_a_replica_of_this_fleet() -> anyhow::Result<()> {
    let Some(pg) = Postgres::start_or_skip("the relay fleet")? else {
        return Ok(());
    };
    let fleet = Fleet::start(&pg.fresh_database()?, &["relay-a", "relay-b"]).await?;
    let a = &fleet.relays[0];
    let identity: AgentIdentity = a.admin()?.onboarded("edge").await?;
    let conn = common::dial(a, &identity).await?;
    let (_events, rx) = mpsc::channel::<Bytes>(1);
    serve_agent(conn.clone(), rx);
    a.admin()?.wait_connected("edge", true).await?;
    let peer_a = fleet.peer_address(0).await?;
    let ca = &a.agent_ca_pem;
    let name = "relay-a.replica.tether.invalid";
    let path = "/clusters/edge/api";

    // No client certificate: the handshake or the request fails, nothing is answered.
    let none = peer_request(peer_a, ca, name, None, path, Some("t")).await;
    assert!(
        none.is_err(),
        "served without a client certificate: {none:?}"
    );
    // An agent's identity, from the same CA: not a replica.
    let agent = peer_request(
        peer_a,
        ca,
        name,
        Some((&identity.cert_pem, &identity.key_pem)),
        path,
        Some("t"),
    )
    .await;
    assert!(agent.is_err(), "served an agent's certificate: {agent:?}");
    // A replica URI from another CA.
    let (cert, key) = replica_cert(None, "tether://replica/relay-x")?;
    let foreign = peer_request(peer_a, ca, name, Some((&cert, &key)), path, Some("t")).await;
    assert!(
        foreign.is_err(),
        "served another CA's certificate: {foreign:?}"
    );
    // A certificate of this CA without a replica URI.
    let (cert, key) = replica_cert(Some(&fleet.agent_ca_dir()), "https://relay-x.example")?;
    let no_uri = peer_request(peer_a, ca, name, Some((&cert, &key)), path, Some("t")).await;
    assert!(
        no_uri.is_err(),
        "served a certificate without a replica URI: {no_uri:?}"
    );

    // A replica of this fleet is served, but still needs a plausible credential, and reaches only what the
    // peer link serves.
    let (cert, key) = replica_cert(Some(&fleet.agent_ca_dir()), "tether://replica/relay-x")?;
    let me = Some((cert.as_str(), key.as_str()));
    assert_eq!(
        peer_request(peer_a, ca, name, me, path, None).await?,
        StatusCode::UNAUTHORIZED
    );
    assert_eq!(
        peer_request(peer_a, ca, name, me, path, Some("t")).await?,
        StatusCode::OK
    );
    assert_eq!(
        peer_request(peer_a, ca, name, me, "/api/v1/clusters", Some("t")).await?,
        StatusCode::NOT_FOUND
    );
    // B holds no tunnel of edge: it never forwards a peer's request again.
    let peer_b = fleet.peer_address(1).await?;
    let b_name = "relay-b.replica.tether.invalid";
    assert_eq!(
        peer_request(peer_b, ca, b_name, me, path, Some("t")).await?,
        StatusCode::SERVICE_UNAVAILABLE
    );
    // A client checks the server too: A's certificate does not pass for B.
    let wrong = peer_request(peer_a, ca, b_name, me, path, Some("t")).await;
    assert!(wrong.is_err(), "replica A passed for replica B: {wrong:?}");
    conn.close(tether_tunnel::code::NO_ERROR, "done");
    fleet.stop().await?;
    pg.stop();
    Ok(())
}

/// A fake agent's tunnel with its control channel open and `hello` said.
struct ControlAgent {
    conn: Connection,
    reader: Reader<ReadHalf<Stream>>,
    writer: WriteHalf<Stream>,
    welcome: Welcome,
}

impl ControlAgent {
    /// Dials `relay` as `identity`, opens the control channel, says hello (this agent keeps two tunnels),
    /// reads the welcome and the first guard snapshot; streams the relay opens are served by [`serve_agent_as`].
    async fn connect(
        relay: &TestRelay,
        identity: &AgentIdentity,
        tag: &'static str,
        events: mpsc::Receiver<Bytes>,
    ) -> anyhow::Result<ControlAgent> {
        let conn = common::dial(relay, identity).await?;
        serve_agent_as(conn.clone(), events, tag);
        let stream = conn.open(OpenOptions {
            kind: kind::CONTROL,
            priority: Priority::Control,
            deadline: Some(Duration::from_secs(10)),
            metadata: Bytes::new(),
        })?;
        within("the control stream", stream.control().accepted()).await??;
        let (rd, writer) = tokio::io::split(stream);
        let mut agent = ControlAgent {
            conn,
            reader: Reader::new(rd),
            writer,
            welcome: Welcome::default(),
        };
        wire::send(
            &mut agent.writer,
            &Message::Hello(Hello {
                agent_version: "0.1.0".into(),
                instance: "agent-1".into(),
                tunnels: 2,
            }),
        )
        .await?;
        match agent.recv().await? {
            Message::Welcome(w) => agent.welcome = w,
            other => anyhow::bail!("expected welcome, got {other:?}"),
        }
        match agent.recv().await? {
            Message::GuardSnapshot(_) => {}
            other => anyhow::bail!("expected guardSnapshot, got {other:?}"),
        }
        Ok(agent)
    }

    async fn recv(&mut self) -> anyhow::Result<Message> {
        within("a control message", self.reader.recv())
            .await??
            .ok_or_else(|| anyhow!("the control channel ended"))
    }
}

/// `relay`'s `/readyz`: status and text.
async fn readyz(relay_client: &common::Client) -> anyhow::Result<(StatusCode, String)> {
    let reply = relay_client.get("/readyz", None).await?;
    Ok((
        reply.status,
        String::from_utf8_lossy(&reply.body).into_owned(),
    ))
}

/// Which tunnel served a plain request through `client`.
async fn served_by(client: &common::Client) -> anyhow::Result<String> {
    let reply = client.get("/clusters/edge/api", Some("user-token")).await?;
    anyhow::ensure!(reply.status == StatusCode::OK, "{reply:?}");
    Ok(reply.json()?["tunnel"]
        .as_str()
        .unwrap_or_default()
        .to_owned())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_draining_replica_has_its_agents_move_make_before_break() -> anyhow::Result<()> {
    let Some(pg) = Postgres::start_or_skip("the relay fleet")? else {
        return Ok(());
    };
    let mut fleet = Fleet::start(&pg.fresh_database()?, &["relay-a", "relay-b"]).await?;
    let mut a = fleet.relays.remove(0);
    let (a_client, a_admin) = (a.client()?, a.admin()?);
    let b_client = fleet.relays[0].client()?;
    let identity = a_admin.onboarded("edge").await?;
    // A counts the live replicas at each lease renewal (every third of its TTL): wait until its welcome says
    // two.
    let mut events = None;
    let mut first = None;
    let deadline = tokio::time::Instant::now() + WAIT;
    while first.is_none() {
        let (tx, rx) = mpsc::channel::<Bytes>(4);
        let agent = ControlAgent::connect(&a, &identity, "on-a", rx).await?;
        assert_eq!(agent.welcome.replica, "relay-a");
        if agent.welcome.replicas == 2 {
            (events, first) = (Some(tx), Some(agent));
        } else {
            anyhow::ensure!(
                tokio::time::Instant::now() < deadline,
                "A never counted two replicas"
            );
            agent.conn.close(code::NO_ERROR, "again");
            within("the tunnel to close", agent.conn.closed()).await?;
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
    let (events, mut first) = (events.context("events")?, first.context("agent")?);
    // A watch on the tunnel at A, open across the drain.
    let io = TokioIo::new(a_client.raw_tls(b"h2").await?);
    let (mut h2, h2conn) =
        hyper::client::conn::http2::handshake(hyper_util::rt::TokioExecutor::new(), io).await?;
    tokio::spawn(h2conn);
    let req = a_client
        .request(true, Method::GET, "/clusters/edge/watch?watch=true")
        .header(http::header::AUTHORIZATION, "Bearer user-token")
        .body(Full::<Bytes>::default())?;
    let resp = h2.send_request(req).await?;
    assert_eq!(resp.status(), StatusCode::OK);
    let watch = resp.into_body();
    assert_eq!(readyz(&a_client).await?.0, StatusCode::OK);

    // SIGTERM at A: readiness goes at once, while A still serves.
    a.begin_stop();
    let (status, text) = readyz(&a_client).await?;
    assert_eq!(
        (status, text.as_str()),
        (StatusCode::SERVICE_UNAVAILABLE, "draining")
    );
    // The agent is asked to move; until it does, its tunnel at A keeps taking requests. A welcome telling the
    // fleet's size again may come first (a lease renewal that saw the count change): only the ask counts here.
    let asked = loop {
        match first.recv().await? {
            Message::Welcome(_) => continue,
            other => break other,
        }
    };
    match asked {
        Message::Draining(Draining {
            make_before_break: true,
            ..
        }) => {}
        other => anyhow::bail!("expected draining with make before break, got {other:?}"),
    }
    assert_eq!(served_by(&a_client).await?, "on-a");
    // New tunnels go elsewhere: A refuses them.
    match common::dial(&a, &identity).await {
        Err(tether_tunnel::ws::ConnectError::Rejected { status, .. }) => {
            assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE);
        }
        Err(other) => anyhow::bail!("expected a refusal, got {other}"),
        Ok(_) => anyhow::bail!("a draining replica took a new tunnel"),
    }
    let (_b_events, b_rx) = mpsc::channel::<Bytes>(1);
    let _second = ControlAgent::connect(&fleet.relays[0], &identity, "on-b", b_rx).await?;
    // Make before break: the replacement is up, then GOAWAY on the old tunnel.
    first
        .conn
        .go_away(code::SHUTDOWN, "moved to another replica");
    // New requests for the cluster that reach A go to the replacement at B, over the peer link.
    tether_testkit::wait::until(
        "requests through A to reach the tunnel at B",
        WAIT,
        || async { served_by(&a_client).await.is_ok_and(|t| t == "on-b") },
    )
    .await?;
    assert_eq!(served_by(&b_client).await?, "on-b");
    // The watch on the old tunnel ends cleanly (no ERROR event): its client watches again, from its last
    // resourceVersion, on a tunnel that takes requests.
    let end = within("the watch to end", watch.collect())
        .await?
        .map_err(|e| anyhow!("the watch did not end cleanly: {e}"))?
        .to_bytes();
    assert!(end.is_empty(), "{end:?}");
    // The agent ends its old control channel; the old tunnel closes and A stops.
    drop(events);
    first.writer.shutdown().await?;
    within("A to stop", a.stop()).await??;
    within("the old tunnel to close", first.conn.closed()).await?;
    let live: Vec<String> = fleet
        .store
        .live_replicas()
        .await?
        .into_iter()
        .map(|r| r.id)
        .collect();
    assert_eq!(live, ["relay-b"], "A left the store at exit");
    let shown = fleet.relays[0].admin()?.show("edge").await?.json()?;
    assert_eq!(
        shown["tunnels"].as_array().map(Vec::len),
        Some(1),
        "{shown}"
    );
    assert_eq!(shown["tunnels"][0]["replica"], "relay-b", "{shown}");
    fleet.stop().await?;
    pg.stop();
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn changes_made_at_one_replica_reach_agents_at_another() -> anyhow::Result<()> {
    let Some(pg) = Postgres::start_or_skip("the relay fleet")? else {
        return Ok(());
    };
    let url = pg.fresh_database()?;
    let fleet = Fleet::start_with(&url, &["relay-a", "relay-b"], |c| {
        c.replaced_identity_grace = Duration::from_secs(1);
    })
    .await?;
    let (a, b) = (&fleet.relays[0], &fleet.relays[1]);
    let a_admin = a.admin()?;
    let identity = a_admin.onboarded("edge").await?;
    let (_events, rx) = mpsc::channel::<Bytes>(1);
    let mut on_b = ControlAgent::connect(b, &identity, "on-b", rx).await?;

    // A role assignment made at A: the agent at B gets the new guard snapshot (LISTEN/NOTIFY, else the
    // feed's one-second re-read).
    let started = std::time::Instant::now();
    let body = serde_json::json!({
        "cluster": "edge",
        "principalId": "00000000-0000-0000-0000-0000000000aa",
        "role": "Azure Arc Kubernetes Viewer",
    });
    let made = a_admin
        .client
        .post_json("/api/v1/roleassignments", Some(&a_admin.token), &body)
        .await?;
    assert_eq!(made.status, StatusCode::CREATED, "{made:?}");
    // Bounded by the 2 s: messages are read until the one with the assignment, or the deadline.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(2);
    let snapshot = loop {
        match tokio::time::timeout_at(deadline, on_b.reader.recv()).await {
            Ok(Ok(Some(Message::GuardSnapshot(s)))) if !s.snapshot.assignments.is_empty() => {
                break s;
            }
            Ok(Ok(Some(_))) => continue,
            other => anyhow::bail!("the agent at B got no snapshot within 2 s: {other:?}"),
        }
    };
    println!(
        "FLEET role assignment at A reached the agent at B in {:.3} s",
        started.elapsed().as_secs_f64()
    );
    assert_eq!(snapshot.snapshot.assignments.len(), 1);

    // A renewal through B replaces the certificate everywhere: the agent's tunnel at A, with the old
    // certificate, is closed after the grace (shortened here).
    let on_a = common::dial(a, &identity).await?;
    let (_key_pem, csr) = common::new_csr("edge")?;
    wire::send(
        &mut on_b.writer,
        &Message::Renew(tether_api::control::Renew { csr }),
    )
    .await?;
    loop {
        match on_b.recv().await? {
            Message::Certificate(_) => break,
            Message::GuardSnapshot(_) => continue,
            other => anyhow::bail!("expected certificate, got {other:?}"),
        }
    }
    let closed = within(
        "A to close the tunnel with the replaced certificate",
        on_a.closed(),
    )
    .await?;
    assert!(closed.error.is_some(), "{closed:?}");
    assert!(!on_b.conn.is_closed(), "the renewing tunnel stays");

    // A deletion at A closes the agent's tunnel at B.
    assert_eq!(a_admin.delete("edge").await?.status, StatusCode::NO_CONTENT);
    within(
        "B to close the deleted cluster's tunnel",
        on_b.conn.closed(),
    )
    .await?;
    fleet.stop().await?;
    pg.stop();
    Ok(())
}
