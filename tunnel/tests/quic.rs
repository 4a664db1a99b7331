//! The QUIC transport on loopback UDP: the shared stream cases (`common/cases.rs`), mutual TLS with the
//! runtime's TLS helpers, ALPN, the relay-side handshake (identity and HELLO before any stream), idle
//! timeout, and peers that abuse stream headers or the stream limit.

mod common;

use std::future::Future as _;
use std::net::SocketAddr;
use std::sync::Arc;
use std::task::{Context, Waker};
use std::time::Duration;

use anyhow::Context as _;
use bytes::{BufMut, Bytes, BytesMut};
use common::cases::stream_cases;
use common::{Harness, Pair, open_options, round_trip, spawn_echo_server, within};
use http::{HeaderMap, HeaderValue};
use rustls::pki_types::{CertificateDer, PrivateKeyDer, PrivatePkcs8KeyDer};
use tether_tunnel::quic::{self, Listener, PendingTunnel, QuicError};
use tether_tunnel::{
    Connection, ConnectionError, Role, SessionConfig, TransportKind, TunnelError, code,
};
use tokio::io::AsyncReadExt as _;
use tokio::net::UdpSocket;
use tokio::sync::mpsc;
use tokio::task::JoinHandle;

/// A relay CA (server certificate for localhost/127.0.0.1) and an agent CA (client identities).
struct Pki {
    relay_ca_pem: String,
    server_chain: Vec<CertificateDer<'static>>,
    server_key: PrivatePkcs8KeyDer<'static>,
    agent_ca: rcgen::CertifiedIssuer<'static, rcgen::KeyPair>,
    agent_ca_der: CertificateDer<'static>,
}

fn ca(name: &str) -> anyhow::Result<rcgen::CertifiedIssuer<'static, rcgen::KeyPair>> {
    let key = rcgen::KeyPair::generate()?;
    let mut params = rcgen::CertificateParams::new(Vec::<String>::new())?;
    params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
    params
        .distinguished_name
        .push(rcgen::DnType::CommonName, name);
    Ok(rcgen::CertifiedIssuer::self_signed(params, key)?)
}

fn pki() -> anyhow::Result<Pki> {
    let relay_ca = ca("relay CA")?;
    let key = rcgen::KeyPair::generate()?;
    let params =
        rcgen::CertificateParams::new(vec!["localhost".to_owned(), "127.0.0.1".to_owned()])?;
    let cert = params.signed_by(&key, &relay_ca)?;
    let agent_ca = ca("agent CA")?;
    Ok(Pki {
        relay_ca_pem: relay_ca.pem(),
        server_chain: vec![cert.der().clone()],
        server_key: PrivatePkcs8KeyDer::from(key.serialize_der()),
        agent_ca_der: agent_ca.der().clone(),
        agent_ca,
    })
}

/// A cluster identity as the relay issues it: `CN=NAME`, SAN `URI:tether://cluster/NAME`, clientAuth.
fn identity(
    issuer: &rcgen::CertifiedIssuer<'static, rcgen::KeyPair>,
    cluster: &str,
) -> anyhow::Result<(String, String)> {
    let key = rcgen::KeyPair::generate()?;
    let mut params = rcgen::CertificateParams::new(Vec::<String>::new())?;
    params
        .distinguished_name
        .push(rcgen::DnType::CommonName, cluster);
    params.subject_alt_names = vec![rcgen::SanType::URI(
        format!("tether://cluster/{cluster}").try_into()?,
    )];
    params.extended_key_usages = vec![rcgen::ExtendedKeyUsagePurpose::ClientAuth];
    let cert = params.signed_by(&key, issuer)?;
    Ok((cert.pem(), key.serialize_pem()))
}

/// The relay's QUIC TLS config: its server certificate, client certificates required from the agent CA.
fn server_tls(pki: &Pki) -> anyhow::Result<Arc<rustls::ServerConfig>> {
    let provider = Arc::new(rustls::crypto::aws_lc_rs::default_provider());
    let mut roots = rustls::RootCertStore::empty();
    roots.add(pki.agent_ca_der.clone())?;
    let verifier = rustls::server::WebPkiClientVerifier::builder_with_provider(
        Arc::new(roots),
        provider.clone(),
    )
    .build()?;
    let config = rustls::ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()?
        .with_client_cert_verifier(verifier)
        .with_single_cert(
            pki.server_chain.clone(),
            PrivateKeyDer::Pkcs8(pki.server_key.clone_key()),
        )?;
    Ok(Arc::new(config))
}

/// The agent's TLS config, built the way the agent builds it (`tether_runtime::tls`).
fn client_tls(
    pki: &Pki,
    identity: Option<&(String, String)>,
) -> anyhow::Result<Arc<rustls::ClientConfig>> {
    Ok(tether_runtime::tls::client_config_with(
        &tether_runtime::tls::ClientOptions {
            ca_pem: Some(pki.relay_ca_pem.as_bytes()),
            identity: identity.map(|(cert, key)| tether_runtime::tls::ClientIdentity {
                cert_pem: cert.as_bytes(),
                key_pem: key.as_bytes(),
            }),
            ..Default::default()
        },
    )?)
}

fn hello_headers(cluster: &str) -> anyhow::Result<HeaderMap> {
    let mut headers = HeaderMap::new();
    headers.insert("tether-cluster", HeaderValue::from_str(cluster)?);
    headers.insert("tether-agent-version", HeaderValue::from_static("test"));
    Ok(headers)
}

/// What the test relay learnt before answering a tunnel.
#[derive(Debug)]
struct Seen {
    cluster: Option<String>,
    leaf: Option<CertificateDer<'static>>,
}

/// Serves `listener` like the relay would: handshake, look at the identity and HELLO, accept when the HELLO
/// names `cluster`, refuse otherwise.
fn serve(
    listener: Listener,
    cluster: &'static str,
    accepted: mpsc::UnboundedSender<Connection>,
    seen: mpsc::UnboundedSender<Seen>,
) -> JoinHandle<()> {
    tokio::spawn(async move {
        while let Some(handshake) = listener.accept().await {
            let accepted = accepted.clone();
            let seen = seen.clone();
            tokio::spawn(async move {
                let Ok(pending) = handshake.finish().await else {
                    return;
                };
                let named = pending
                    .headers()
                    .get("tether-cluster")
                    .and_then(|v| v.to_str().ok())
                    .map(str::to_owned);
                let _ = seen.send(Seen {
                    cluster: named.clone(),
                    leaf: pending.peer_certificates().first().cloned(),
                });
                answer(pending, named.as_deref() == Some(cluster), &accepted).await;
            });
        }
    })
}

async fn answer(pending: PendingTunnel, ok: bool, accepted: &mpsc::UnboundedSender<Connection>) {
    if !ok {
        pending.refuse(code::REFUSED, "the identity does not name this cluster");
        return;
    }
    if let Ok(conn) = pending.accept().await {
        let _ = accepted.send(conn);
    }
}

/// Forwards UDP between one client and `server`; aborting the task is a dead path.
async fn udp_link(server: SocketAddr) -> anyhow::Result<(SocketAddr, JoinHandle<()>)> {
    let front = UdpSocket::bind("127.0.0.1:0").await?;
    let back = UdpSocket::bind("127.0.0.1:0").await?;
    back.connect(server).await?;
    let addr = front.local_addr()?;
    let task = tokio::spawn(async move {
        let mut client: Option<SocketAddr> = None;
        let mut a = vec![0u8; 65536];
        let mut b = vec![0u8; 65536];
        loop {
            tokio::select! {
                r = front.recv_from(&mut a) => {
                    let Ok((n, from)) = r else { return };
                    client = Some(from);
                    let _ = back.send(&a[..n]).await;
                }
                r = back.recv(&mut b) => {
                    let Ok(n) = r else { return };
                    if let Some(to) = client {
                        let _ = front.send_to(&b[..n], to).await;
                    }
                }
            }
        }
    });
    Ok((addr, task))
}

struct Quic;

impl Harness for Quic {
    const RTT_FROM_HANDSHAKE: bool = true;
    // Real time: quinn reads the system clock, so tokio's paused clock cannot drive it.
    const QUIET: Duration = Duration::from_secs(3);

    async fn pair_with(client: SessionConfig, server: SessionConfig) -> anyhow::Result<Pair> {
        let pki = pki()?;
        let listener = Listener::bind("127.0.0.1:0".parse()?, server_tls(&pki)?, server)?;
        let (link_addr, link) = udp_link(listener.local_addr()?).await?;
        let (tx, mut rx) = mpsc::unbounded_channel();
        let (seen_tx, _seen_rx) = mpsc::unbounded_channel();
        serve(listener, "prod", tx, seen_tx);
        let id = identity(&pki.agent_ca, "prod")?;
        let client = quic::connect_addr(
            link_addr,
            "localhost",
            client_tls(&pki, Some(&id))?,
            hello_headers("prod")?,
            client,
        )
        .await?;
        let server = within("server connection", rx.recv())
            .await?
            .context("the server did not start a connection")?;
        Ok(Pair {
            client,
            server,
            link,
        })
    }

    fn quick_liveness(config: &mut SessionConfig) {
        config.keepalive_interval = Duration::from_millis(300);
        config.idle_timeout = Duration::from_secs(2);
    }
}

stream_cases!(Quic);

#[tokio::test]
async fn quic_handles_can_move_between_tasks() -> anyhow::Result<()> {
    fn send_sync<T: Send + Sync>(_: &T) {}
    fn send<T: Send>(_: &T) {}
    let p = Quic::pair().await?;
    send_sync(&p.client);
    send(&p.client.accept());
    send(&p.client.closed());
    let stream = p.client.open(open_options("types"))?;
    send_sync(&stream);
    let control = stream.control();
    send_sync(&control);
    send(&control.accepted());
    let incoming = within("accept", p.server.accept())
        .await?
        .context("no stream")?;
    send_sync(&incoming);
    Ok(())
}

#[tokio::test]
async fn unanswered_stream_times_out_at_its_deadline() -> anyhow::Result<()> {
    common::cases::unanswered_stream_times_out_at_its_deadline::<Quic>().await
}

#[tokio::test]
async fn a_lone_reader_times_out_at_the_deadline() -> anyhow::Result<()> {
    common::cases::a_lone_reader_times_out_at_the_deadline::<Quic>().await
}

#[tokio::test]
async fn idle_connection_stays_up_through_keepalives() -> anyhow::Result<()> {
    common::cases::idle_connection_stays_up_through_keepalives::<Quic>().await
}

/// A deferred answer waits for its stream's first bytes, while other streams' packets come and go (over
/// WebSocket any other output carries it; over QUIC only its own stream's bytes, in the same packet); with
/// nothing to carry it, it goes when its hold ends, and never so late that the opener's deadline runs out
/// first. Real time: quinn reads the system clock.
#[tokio::test]
async fn a_deferred_answer_waits_for_its_own_bytes_or_its_hold() -> anyhow::Result<()> {
    let p = Quic::pair().await?;
    let (mut held, held_control, mut served) = common::open_held(
        &p.server,
        &p.client,
        "GET /held",
        b"held",
        Duration::from_secs(3600),
    )
    .await?;
    // Ordered after the deferral: a round trip on another stream, both ways through the same connection.
    let other = p.server.open(open_options("GET /other"))?;
    let echoed = within("accept", p.client.accept())
        .await?
        .context("no incoming stream")?
        .accept(Bytes::new())?;
    tokio::spawn(common::echo(echoed));
    assert_eq!(
        within("round trip", round_trip(other, b"ping".to_vec())).await??,
        b"ping"
    );
    let mut accepted = std::pin::pin!(held_control.accepted());
    assert!(
        accepted
            .as_mut()
            .poll(&mut Context::from_waker(Waker::noop()))
            .is_pending(),
        "the answer left before its stream wrote anything"
    );
    tokio::io::AsyncWriteExt::write_all(&mut served, b"reply").await?;
    tokio::io::AsyncWriteExt::shutdown(&mut served).await?;
    assert_eq!(
        within("accepted", accepted).await??,
        Bytes::from_static(b"held")
    );
    let mut reply = Vec::new();
    within("reply", held.read_to_end(&mut reply)).await??;
    assert_eq!(reply, b"reply");

    // Nothing to carry it: the answer goes at its hold (no sooner), or at half the opener's time.
    for (deadline, hold) in [
        (None, Duration::from_millis(300)),
        (Some(Duration::from_secs(2)), Duration::from_secs(3600)),
    ] {
        let stream = p.server.open(tether_tunnel::OpenOptions {
            deadline,
            ..open_options("GET /slow")
        })?;
        let control = stream.control();
        let incoming = within("accept", p.client.accept())
            .await?
            .context("no incoming stream")?;
        let start = tokio::time::Instant::now();
        let _served = incoming.accept_deferred(Bytes::from_static(b"later"), hold)?;
        // With the hour's hold and no cap, the opener's deadline would fail the stream first.
        assert_eq!(
            within("accepted", control.accepted()).await??,
            Bytes::from_static(b"later"),
            "deadline {deadline:?}, hold {hold:?}"
        );
        if deadline.is_none() {
            assert!(start.elapsed() >= hold, "the answer left before its hold");
        }
    }
    Ok(())
}

/// A stream header that cannot be written at once (the opener's send window is a few bytes, so quinn takes
/// the header a few bytes per acknowledgement) is written by whichever of the stream's writer and its opening
/// task quinn wakes, in either order of arrival; the other is woken when it is done. The opening task then
/// reads the answer, and the writer's bytes follow the header.
#[tokio::test]
async fn a_header_written_in_pieces_wakes_both_the_writer_and_the_opening_task()
-> anyhow::Result<()> {
    let client = SessionConfig::new(Role::Client);
    let mut server = SessionConfig::new(Role::Server);
    server.connection_window = 4;
    let p = Quic::pair_with(client, server).await?;
    for writer_first in [true, false] {
        let mut stream = p.server.open(tether_tunnel::OpenOptions {
            deadline: None,
            ..open_options("GET /a-header-longer-than-the-send-window")
        })?;
        let control = stream.control();
        if !writer_first {
            // The opening task polls first and is left waiting on quinn; the writer comes after it.
            tokio::task::yield_now().await;
        }
        let wrote = tokio::spawn(async move {
            tokio::io::AsyncWriteExt::write_all(&mut stream, b"request").await?;
            tokio::io::AsyncWriteExt::shutdown(&mut stream).await?;
            anyhow::Ok(stream)
        });
        let mut served = within("accept", p.client.accept())
            .await?
            .context("no incoming stream")?
            .accept(Bytes::from_static(b"ok"))?;
        assert_eq!(
            within("accepted", control.accepted()).await??,
            Bytes::from_static(b"ok"),
            "writer first: {writer_first}"
        );
        let mut request = Vec::new();
        within("request", served.read_to_end(&mut request)).await??;
        assert_eq!(request, b"request");
        tokio::io::AsyncWriteExt::shutdown(&mut served).await?;
        let mut stream = within("write", wrote).await???;
        let mut reply = Vec::new();
        within("reply", stream.read_to_end(&mut reply)).await??;
        assert!(reply.is_empty());
    }
    Ok(())
}

/// A listener and what it saw, for tests that dial it themselves.
struct Relay {
    pki: Pki,
    addr: SocketAddr,
    accepted: mpsc::UnboundedReceiver<Connection>,
    seen: mpsc::UnboundedReceiver<Seen>,
    _task: JoinHandle<()>,
}

async fn relay(config: SessionConfig) -> anyhow::Result<Relay> {
    let pki = pki()?;
    let listener = Listener::bind("127.0.0.1:0".parse()?, server_tls(&pki)?, config)?;
    let addr = listener.local_addr()?;
    let (tx, accepted) = mpsc::unbounded_channel();
    let (seen_tx, seen) = mpsc::unbounded_channel();
    let task = serve(listener, "prod", tx, seen_tx);
    Ok(Relay {
        pki,
        addr,
        accepted,
        seen,
        _task: task,
    })
}

#[tokio::test]
async fn relay_sees_identity_and_cluster_before_accepting() -> anyhow::Result<()> {
    let mut relay = relay(SessionConfig::new(Role::Server)).await?;
    let id = identity(&relay.pki.agent_ca, "prod")?;
    let conn = quic::connect(
        &format!("quic://localhost:{}", relay.addr.port()),
        client_tls(&relay.pki, Some(&id))?,
        hello_headers("prod")?,
        SessionConfig::new(Role::Client),
    )
    .await?;
    assert_eq!(conn.transport(), TransportKind::Quic);
    assert_eq!(conn.transport().as_str(), "quic");
    let seen = within("seen", relay.seen.recv())
        .await?
        .context("no tunnel")?;
    assert_eq!(seen.cluster.as_deref(), Some("prod"));
    let leaf = seen
        .leaf
        .context("no client certificate reached the relay")?;
    let expected = rustls_pemfile_first(&id.0)?;
    assert_eq!(leaf, expected);
    let server = within("accepted", relay.accepted.recv())
        .await?
        .context("not accepted")?;
    assert_eq!(server.peer_certificates().first(), Some(&expected));
    let _echo = spawn_echo_server(server);
    let stream = conn.open(open_options("after auth"))?;
    assert_eq!(round_trip(stream, b"hi".to_vec()).await?, b"hi");

    // An identity for another cluster is refused by the relay's check, with its reason.
    let other = identity(&relay.pki.agent_ca, "staging")?;
    let err = quic::connect_addr(
        relay.addr,
        "localhost",
        client_tls(&relay.pki, Some(&other))?,
        hello_headers("staging")?,
        SessionConfig::new(Role::Client),
    )
    .await
    .err()
    .context("a tunnel for the wrong cluster was accepted")?;
    match err {
        QuicError::Rejected { code: c, reason } => {
            assert_eq!(c, code::REFUSED);
            assert!(reason.contains("does not name this cluster"), "{reason}");
        }
        other => anyhow::bail!("expected Rejected, got {other:?}"),
    }
    Ok(())
}

fn rustls_pemfile_first(pem: &str) -> anyhow::Result<CertificateDer<'static>> {
    Ok(rustls_pemfile::certs(&mut pem.as_bytes())
        .next()
        .context("no certificate in PEM")??)
}

#[tokio::test]
async fn mtls_refuses_a_client_from_another_ca_or_without_a_certificate() -> anyhow::Result<()> {
    let mut relay = relay(SessionConfig::new(Role::Server)).await?;
    let rogue_ca = ca("rogue CA")?;
    let rogue = identity(&rogue_ca, "prod")?;
    let err = quic::connect_addr(
        relay.addr,
        "localhost",
        client_tls(&relay.pki, Some(&rogue))?,
        hello_headers("prod")?,
        SessionConfig::new(Role::Client),
    )
    .await
    .err()
    .context("a certificate from another CA was accepted")?;
    assert!(
        matches!(err, QuicError::Handshake(_) | QuicError::Rejected { .. }),
        "{err:?}"
    );
    let err = quic::connect_addr(
        relay.addr,
        "localhost",
        client_tls(&relay.pki, None)?,
        hello_headers("prod")?,
        SessionConfig::new(Role::Client),
    )
    .await
    .err()
    .context("a client without a certificate was accepted")?;
    assert!(
        matches!(err, QuicError::Handshake(_) | QuicError::Rejected { .. }),
        "{err:?}"
    );
    // Neither got as far as the relay's identity checks.
    assert!(relay.seen.try_recv().is_err());
    assert!(relay.accepted.try_recv().is_err());
    Ok(())
}

#[tokio::test]
async fn alpn_mismatch_is_refused() -> anyhow::Result<()> {
    let relay = relay(SessionConfig::new(Role::Server)).await?;
    let id = identity(&relay.pki.agent_ca, "prod")?;
    let mut tls = (*client_tls(&relay.pki, Some(&id))?).clone();
    tls.alpn_protocols = vec![b"h3".to_vec()];
    let crypto = quinn::crypto::rustls::QuicClientConfig::try_from(Arc::new(tls))?;
    let endpoint = quinn::Endpoint::client("127.0.0.1:0".parse()?)?;
    let connecting = endpoint.connect_with(
        quinn::ClientConfig::new(Arc::new(crypto)),
        relay.addr,
        "localhost",
    )?;
    let err = within("handshake", connecting)
        .await?
        .err()
        .context("a client offering only h3 was accepted")?;
    assert!(
        err.to_string()
            .to_lowercase()
            .contains("application protocol")
            || matches!(err, quinn::ConnectionError::ConnectionClosed(_)),
        "{err:?}"
    );
    Ok(())
}

#[tokio::test]
async fn idle_timeout_closes_a_dead_peer() -> anyhow::Result<()> {
    let mut client = SessionConfig::new(Role::Client);
    let mut server = SessionConfig::new(Role::Server);
    Quic::quick_liveness(&mut client);
    Quic::quick_liveness(&mut server);
    let p = Quic::pair_with(client, server).await?;
    p.link.abort();
    let end = within("server gives up on the silent client", p.server.closed()).await?;
    assert!(
        matches!(end.error, Some(ConnectionError::TimedOut(d)) if d == Duration::from_secs(2)),
        "{:?}",
        end.error
    );
    let end = within("client gives up on the silent server", p.client.closed()).await?;
    assert!(
        matches!(end.error, Some(ConnectionError::TimedOut(_))),
        "{:?}",
        end.error
    );
    Ok(())
}

// ---------------------------------------------------------------------------------------------------------
// Abuse: a raw quinn client that speaks the documented wire format (docs/PROTOCOL.md, "QUIC transport").

/// Connects with quinn directly, sends the session stream's version byte and HELLO by hand, and waits for
/// WELCOME.
async fn raw_client(relay: &Relay) -> anyhow::Result<quinn::Connection> {
    let (conn, session) = raw_hello(&relay.pki, relay.addr).await?;
    let mut peer = conn.accept_uni().await?;
    let mut welcome = [0u8; 6];
    peer.read_exact(&mut welcome).await?;
    anyhow::ensure!(welcome == [1, 2, 0, 0, 0, 0], "not a WELCOME: {welcome:?}");
    // Keep both session streams open for the life of the connection.
    tokio::spawn(async move {
        let _keep = (session, peer);
        std::future::pending::<()>().await;
    });
    Ok(conn)
}

/// The QUIC handshake and the HELLO (one header, `tether-cluster: prod`), by hand.
async fn raw_hello(
    pki: &Pki,
    addr: SocketAddr,
) -> anyhow::Result<(quinn::Connection, quinn::SendStream)> {
    let id = identity(&pki.agent_ca, "prod")?;
    let mut tls = (*client_tls(pki, Some(&id))?).clone();
    tls.alpn_protocols = vec![quic::ALPN.to_vec()];
    let crypto = quinn::crypto::rustls::QuicClientConfig::try_from(Arc::new(tls))?;
    let endpoint = quinn::Endpoint::client("127.0.0.1:0".parse()?)?;
    let conn = endpoint
        .connect_with(
            quinn::ClientConfig::new(Arc::new(crypto)),
            addr,
            "localhost",
        )?
        .await?;
    let mut session = conn.open_uni().await?;
    let mut hello = BytesMut::new();
    hello.put_u8(1); // one header
    hello.put_u8(14);
    hello.put_slice(b"tether-cluster");
    hello.put_u16(4);
    hello.put_slice(b"prod");
    let mut first = BytesMut::new();
    first.put_u8(quic::VERSION);
    first.put_u8(1); // HELLO
    first.put_u32(u32::try_from(hello.len())?);
    first.put_slice(&hello);
    session.write_all(&first).await?;
    Ok((conn, session))
}

#[tokio::test]
async fn no_stream_can_be_opened_before_the_relay_accepts() -> anyhow::Result<()> {
    let pki = Arc::new(pki()?);
    let listener = Listener::bind(
        "127.0.0.1:0".parse()?,
        server_tls(&pki)?,
        SessionConfig::new(Role::Server),
    )?;
    let addr = listener.local_addr()?;
    let client_pki = pki.clone();
    let client = tokio::spawn(async move { raw_hello(&client_pki, addr).await });
    let handshake = within("attempt", listener.accept())
        .await?
        .context("listener closed")?;
    let pending = within("handshake", handshake.finish()).await??;
    assert_eq!(
        pending
            .headers()
            .get("tether-cluster")
            .map(|v| v.as_bytes()),
        Some(&b"prod"[..])
    );
    assert_eq!(pending.peer_certificates().len(), 1);
    let (conn, _session) = within("client", client).await???;
    // The relay has not answered: the client has no stream credit at all.
    {
        let mut open = std::pin::pin!(conn.open_bi());
        assert!(
            open.as_mut()
                .poll(&mut Context::from_waker(Waker::noop()))
                .is_pending()
        );
    }
    let server = within("accept", pending.accept()).await??;
    let _echo = spawn_echo_server(server);
    let (mut send, mut recv) = within("open after WELCOME", conn.open_bi()).await??;
    send.write_all(&header(1, 1, 0, b"")).await?;
    send.write_all(b"now").await?;
    send.finish()?;
    let reply = within("reply", recv.read_to_end(1024)).await??;
    assert_eq!(reply, [&[1u8, 0, 0, 0, 0, 0][..], b"now"].concat());
    Ok(())
}

fn header(version: u8, priority: u8, metadata_len: u32, metadata: &[u8]) -> Bytes {
    let mut h = BytesMut::new();
    h.put_u8(version);
    h.put_u16(tether_tunnel::kind::HTTP);
    h.put_u8(priority);
    h.put_u32(30_000);
    h.put_u32(metadata_len);
    h.put_slice(metadata);
    h.freeze()
}

/// Reads until the stream ends or fails; the reset code if it was reset.
async fn reset_code(recv: &mut quinn::RecvStream) -> Option<u32> {
    let mut buf = [0u8; 256];
    loop {
        match recv.read(&mut buf).await {
            Ok(Some(_)) => continue,
            Ok(None) => return None,
            Err(quinn::ReadError::Reset(c)) => return u32::try_from(c.into_inner()).ok(),
            Err(_) => return None,
        }
    }
}

/// A relay with `config`, a raw quinn client connected to it (HELLO sent), and the relay's side of that tunnel.
async fn raw_tunnel(
    config: SessionConfig,
) -> anyhow::Result<(Relay, quinn::Connection, Connection)> {
    let mut relay = relay(config).await?;
    let conn = raw_client(&relay).await?;
    let server = within("accepted", relay.accepted.recv())
        .await?
        .context("not accepted")?;
    Ok((relay, conn, server))
}

#[tokio::test]
async fn malformed_stream_headers_are_reset_and_the_tunnel_lives_on() -> anyhow::Result<()> {
    let (_relay, conn, server) = raw_tunnel(SessionConfig::new(Role::Server)).await?;
    for (what, bytes) in [
        ("wrong version", header(9, 1, 0, b"")),
        ("unknown priority", header(1, 7, 0, b"")),
        ("metadata above the limit", header(1, 1, 1 << 30, b"")),
        ("stream ends inside the header", Bytes::from_static(&[1, 0])),
    ] {
        let (mut send, mut recv) = conn.open_bi().await?;
        send.write_all(&bytes).await?;
        send.finish()?;
        let code = within(what, reset_code(&mut recv)).await?;
        assert_eq!(code, Some(code::PROTOCOL_ERROR), "{what}");
    }
    // None reached the application; a well-formed stream still works.
    let _echo = spawn_echo_server(server.clone());
    let (mut send, mut recv) = conn.open_bi().await?;
    send.write_all(&header(1, 1, 2, b"ok")).await?;
    send.write_all(b"ping").await?;
    send.finish()?;
    let reply = within("reply", recv.read_to_end(1024)).await??;
    // ACCEPT (version, type 0, empty metadata), then the echoed bytes.
    assert_eq!(reply, [&[1u8, 0, 0, 0, 0, 0][..], b"ping"].concat());
    Ok(())
}

#[tokio::test]
async fn a_header_that_never_completes_is_reset_after_the_handshake_timeout() -> anyhow::Result<()>
{
    let mut config = SessionConfig::new(Role::Server);
    config.handshake_timeout = Duration::from_secs(1);
    let mut relay = relay(config).await?;
    let conn = raw_client(&relay).await?;
    let _server = within("accepted", relay.accepted.recv()).await?;
    let (mut send, mut recv) = conn.open_bi().await?;
    send.write_all(&[1, 0, 1]).await?; // 3 of 12 header bytes, and nothing more
    let code = within("reset", reset_code(&mut recv)).await?;
    assert_eq!(code, Some(code::TIMEOUT));
    Ok(())
}

/// The relay reads a stream's header without a task when it came whole; one that arrives in pieces is read
/// on where the first piece left off (nothing read twice, nothing lost), and a whole one behind it is not held up.
#[tokio::test]
async fn a_header_that_arrives_in_pieces_is_read_whole() -> anyhow::Result<()> {
    let (_relay, conn, server) = raw_tunnel(SessionConfig::new(Role::Server)).await?;
    let whole = header(1, 1, 5, b"split");
    let (mut split_send, _split_recv) = conn.open_bi().await?;
    split_send.write_all(&whole[..3]).await?;
    // A whole header on a second stream is accepted while the first waits for the rest of its own.
    let (mut send, _recv) = conn.open_bi().await?;
    send.write_all(&header(1, 1, 5, b"whole")).await?;
    let first = within("accept", server.accept())
        .await?
        .context("no stream")?;
    assert_eq!(first.metadata, &b"whole"[..]);
    // Streams are taken in order: the split one was read as far as it went before the whole one was queued,
    // so the rest of its header arrives after that read.
    split_send.write_all(&whole[3..]).await?;
    let second = within("accept", server.accept())
        .await?
        .context("no stream")?;
    assert_eq!(second.metadata, &b"split"[..]);
    Ok(())
}

/// An ACCEPT or a REFUSE that arrives in pieces is read whole by the opener, and none of the data behind it
/// is taken; `accepted` (in another task) and the reader both learn the answer.
#[tokio::test]
async fn an_answer_that_arrives_in_pieces_is_read_whole() -> anyhow::Result<()> {
    let (_relay, conn, server) = raw_tunnel(SessionConfig::new(Role::Server)).await?;
    // Our (raw) side answers; "whole" streams from it show the tunnel has read what was sent before them.
    let sent_before = |n: u8| {
        let conn = conn.clone();
        let server = server.clone();
        async move {
            let (mut send, _recv) = conn.open_bi().await?;
            send.write_all(&header(1, 1, 1, &[n])).await?;
            let incoming = within("accept", server.accept())
                .await?
                .context("no stream")?;
            anyhow::ensure!(incoming.metadata == [n][..]);
            Ok::<_, anyhow::Error>(())
        }
    };

    let mut stream = server.open(open_options("accept me"))?;
    let control = stream.control();
    let accepted = tokio::spawn(async move { control.accepted().await });
    let (mut send, mut recv) = within("stream", conn.accept_bi()).await??;
    let mut head = vec![0u8; 12 + "accept me".len()];
    within("header", recv.read_exact(&mut head)).await??;
    let answer = [&[1u8, 0, 0, 0, 0, 3][..], b"abc"].concat();
    send.write_all(&answer[..1]).await?;
    sent_before(1).await?;
    send.write_all(&answer[1..4]).await?;
    sent_before(2).await?;
    send.write_all(&[&answer[4..], &b"the data"[..]].concat())
        .await?;
    send.finish()?;
    let mut data = Vec::new();
    within("data", stream.read_to_end(&mut data)).await??;
    assert_eq!(data, b"the data");
    assert_eq!(within("accepted", accepted).await???, &b"abc"[..]);

    let mut stream = server.open(open_options("refuse me"))?;
    let (mut send, mut recv) = within("stream", conn.accept_bi()).await??;
    let mut head = vec![0u8; 12 + "refuse me".len()];
    within("header", recv.read_exact(&mut head)).await??;
    let mut refusal = vec![1u8, 1];
    refusal.extend_from_slice(&code::REFUSED.to_be_bytes());
    refusal.extend_from_slice(&7u16.to_be_bytes());
    refusal.extend_from_slice(b"go away");
    send.write_all(&refusal[..5]).await?;
    sent_before(3).await?;
    send.write_all(&refusal[5..]).await?;
    let mut data = Vec::new();
    let err = within("refusal", stream.read_to_end(&mut data))
        .await?
        .err()
        .context("expected a refusal")?;
    let err = common::tunnel_error(&err).context("not a tunnel error")?;
    assert!(
        matches!(&err, TunnelError::Refused { code: c, reason } if *c == code::REFUSED && reason == "go away"),
        "{err:?}"
    );
    assert!(data.is_empty());
    Ok(())
}

#[tokio::test]
async fn a_peer_cannot_open_more_streams_than_allowed() -> anyhow::Result<()> {
    let mut config = SessionConfig::new(Role::Server);
    config.max_concurrent_streams = 4;
    let (_relay, conn, server) = raw_tunnel(config).await?;
    let mut streams = Vec::new();
    for _ in 0..4 {
        let (mut send, recv) = within("open", conn.open_bi()).await??;
        send.write_all(&header(1, 1, 0, b"")).await?;
        streams.push((send, recv));
    }
    // The fifth has no credit: QUIC itself holds the opener back (the relay never sees it).
    {
        let mut fifth = std::pin::pin!(conn.open_bi());
        assert!(
            fifth
                .as_mut()
                .poll(&mut Context::from_waker(Waker::noop()))
                .is_pending()
        );
    }
    let mut incoming = Vec::new();
    for _ in 0..4 {
        incoming.push(
            within("accept", server.accept())
                .await?
                .context("no stream")?,
        );
    }
    // Refusing one gives the credit back.
    incoming
        .pop()
        .context("no stream")?
        .refuse(code::REFUSED, "enough");
    let (send, mut recv) = streams.pop().context("no stream")?;
    let mut answer = Vec::new();
    let mut buf = [0u8; 64];
    while let Some(n) = within("refusal", recv.read(&mut buf)).await?? {
        answer.extend_from_slice(&buf[..n]);
    }
    assert_eq!(&answer[..6], &[1, 1, 0, 0, 0, code::REFUSED as u8]);
    // The refuser stopped our direction; dropping it answers with a reset, which frees the stream.
    drop(send);
    let (mut send, _recv) = within("open after a refusal", conn.open_bi()).await??;
    send.write_all(&header(1, 1, 0, b"")).await?;
    assert!(within("accept", server.accept()).await?.is_some());
    Ok(())
}

/// A raw quinn connection that has done the QUIC/TLS handshake and nothing else.
async fn raw_connect(pki: &Pki, addr: SocketAddr) -> anyhow::Result<quinn::Connection> {
    let id = identity(&pki.agent_ca, "prod")?;
    let mut tls = (*client_tls(pki, Some(&id))?).clone();
    tls.alpn_protocols = vec![quic::ALPN.to_vec()];
    let crypto = quinn::crypto::rustls::QuicClientConfig::try_from(Arc::new(tls))?;
    let endpoint = quinn::Endpoint::client("127.0.0.1:0".parse()?)?;
    Ok(endpoint
        .connect_with(
            quinn::ClientConfig::new(Arc::new(crypto)),
            addr,
            "localhost",
        )?
        .await?)
}

#[tokio::test]
async fn malformed_or_oversized_hello_closes_the_connection_before_the_relay_sees_it()
-> anyhow::Result<()> {
    let mut relay = relay(SessionConfig::new(Role::Server)).await?;
    for (what, bytes) in [
        // HELLO claiming 1 GiB: refused on the length alone.
        ("oversized", vec![1u8, 1, 0x40, 0, 0, 0]),
        // HELLO whose header count promises more than it carries.
        ("truncated", vec![1u8, 1, 0, 0, 0, 2, 3, 1]),
        // Not a HELLO first.
        ("wrong message", vec![1u8, 3, 0, 0, 0, 4, 0, 0, 0, 0]),
        // Unknown version byte.
        ("wrong version", vec![7u8, 1, 0, 0, 0, 1, 0]),
    ] {
        let conn = raw_connect(&relay.pki, relay.addr).await?;
        let mut session = conn.open_uni().await?;
        session.write_all(&bytes).await?;
        let end = within(what, conn.closed()).await?;
        match end {
            quinn::ConnectionError::ApplicationClosed(close) => {
                assert_eq!(
                    close.error_code.into_inner(),
                    u64::from(code::PROTOCOL_ERROR),
                    "{what}"
                )
            }
            other => anyhow::bail!("{what}: expected a PROTOCOL_ERROR close, got {other:?}"),
        }
    }
    assert!(relay.seen.try_recv().is_err());
    Ok(())
}

#[tokio::test]
async fn a_client_that_never_sends_hello_is_dropped_after_the_handshake_timeout()
-> anyhow::Result<()> {
    let mut config = SessionConfig::new(Role::Server);
    config.handshake_timeout = Duration::from_secs(1);
    let mut relay = relay(config).await?;
    let conn = raw_connect(&relay.pki, relay.addr).await?;
    let end = within("relay gives up", conn.closed()).await?;
    assert!(
        !matches!(end, quinn::ConnectionError::LocallyClosed),
        "{end:?}"
    );
    assert!(relay.seen.try_recv().is_err());
    Ok(())
}
