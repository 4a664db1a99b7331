//! `ws::connect` over real TCP and TLS on 127.0.0.1 against a hyper server doing the upgrade.

mod common;

use anyhow::Context as _;
use common::{ServerOptions, open_options, pki, round_trip, spawn_echo_server, tls_server, within};
use http::{HeaderMap, HeaderValue, StatusCode};
use tether_runtime::tls;
use tether_tunnel::ws::{self, ConnectError};
use tether_tunnel::{Role, SessionConfig};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::sync::mpsc;

fn auth_headers(token: &str) -> anyhow::Result<HeaderMap> {
    let mut headers = HeaderMap::new();
    headers.insert(
        http::header::AUTHORIZATION,
        HeaderValue::from_str(&format!("Bearer {token}"))?,
    );
    headers.insert("tether-cluster", HeaderValue::from_static("prod"));
    Ok(headers)
}

#[tokio::test]
async fn tunnel_over_tls_with_a_private_ca() -> anyhow::Result<()> {
    let pki = pki()?;
    let (tx, mut rx) = mpsc::unbounded_channel();
    let mut options = ServerOptions::new();
    options.require_auth = Some("Bearer s3cret");
    let port = tls_server(&pki, options, tx).await?;
    // The caller's ALPN (h2 here) must not break the HTTP/1.1 upgrade.
    let client_tls = tls::client_config(Some(pki.ca_pem.as_bytes()), &[b"h2", b"http/1.1"])?;

    for host in ["localhost", "127.0.0.1"] {
        let url = format!("wss://{host}:{port}/agent/v1/tunnel");
        let client = within(
            "connect",
            ws::connect(
                &url,
                client_tls.clone(),
                auth_headers("s3cret")?,
                SessionConfig::new(Role::Client),
            ),
        )
        .await??;
        let server = within("server connection", rx.recv())
            .await?
            .context("no server connection")?;

        // Both directions.
        let _echo = spawn_echo_server(server.clone());
        let stream = client.open(open_options("over tls"))?;
        assert_eq!(
            within("echo", round_trip(stream, b"through rustls".to_vec())).await??,
            b"through rustls"
        );

        let served_by_client = tokio::spawn({
            let client = client.clone();
            async move {
                let incoming = client.accept().await.context("no stream from the relay")?;
                let mut stream = incoming.accept(bytes::Bytes::new())?;
                let mut request = Vec::new();
                stream.read_to_end(&mut request).await?;
                stream.write_all(&request).await?;
                stream.shutdown().await?;
                anyhow::Ok(())
            }
        });
        let stream = server.open(open_options("relay to agent"))?;
        assert_eq!(
            within("reverse echo", round_trip(stream, b"reverse".to_vec())).await??,
            b"reverse"
        );
        within("agent side", served_by_client).await???;

        client.go_away(tether_tunnel::code::NO_ERROR, "done");
        let end = within("client closed", client.closed()).await?;
        assert!(end.error.is_none(), "{:?}", end.error);
        within("server closed", server.closed()).await?;
    }
    Ok(())
}

#[tokio::test]
async fn untrusted_certificate_is_a_tls_error() -> anyhow::Result<()> {
    let pki_server = pki()?;
    let other_ca = pki()?;
    let (tx, _rx) = mpsc::unbounded_channel();
    let port = tls_server(&pki_server, ServerOptions::new(), tx).await?;
    let client_tls = tls::client_config(Some(other_ca.ca_pem.as_bytes()), &[])?;
    let url = format!("wss://localhost:{port}/agent/v1/tunnel");
    let err = within(
        "connect",
        ws::connect(
            &url,
            client_tls,
            HeaderMap::new(),
            SessionConfig::new(Role::Client),
        ),
    )
    .await?
    .err()
    .context("connect should fail")?;
    assert!(matches!(err, ConnectError::Tls(_)), "{err:?}");
    Ok(())
}

#[tokio::test]
async fn refused_upgrade_reports_status_and_body() -> anyhow::Result<()> {
    let pki = pki()?;
    let (tx, _rx) = mpsc::unbounded_channel();
    let mut options = ServerOptions::new();
    options.require_auth = Some("Bearer right");
    let port = tls_server(&pki, options, tx).await?;
    let client_tls = tls::client_config(Some(pki.ca_pem.as_bytes()), &[])?;
    let url = format!("https://localhost:{port}/agent/v1/tunnel");
    let err = within(
        "connect",
        ws::connect(
            &url,
            client_tls,
            auth_headers("wrong")?,
            SessionConfig::new(Role::Client),
        ),
    )
    .await?
    .err()
    .context("connect should be refused")?;
    match &err {
        ConnectError::Rejected { status, body } => {
            assert_eq!(*status, StatusCode::UNAUTHORIZED);
            assert_eq!(body, "bad credential for this cluster");
        }
        other => anyhow::bail!("expected Rejected, got {other:?}"),
    }
    assert_eq!(
        err.to_string(),
        "relay refused the tunnel: HTTP 401 Unauthorized: bad credential for this cluster"
    );
    Ok(())
}

#[tokio::test]
async fn unreachable_relay_is_a_connect_error() -> anyhow::Result<()> {
    // Bind then drop to get a port nobody listens on.
    let port = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await?
        .local_addr()?
        .port();
    let client_tls = tls::client_config(None, &[])?;
    let err = ws::connect(
        &format!("wss://127.0.0.1:{port}/"),
        client_tls,
        HeaderMap::new(),
        SessionConfig::new(Role::Client),
    )
    .await
    .err()
    .context("connect should fail")?;
    assert!(matches!(err, ConnectError::Connect { .. }), "{err:?}");
    Ok(())
}

/// The client identity from `tls::client_config_with` reaches a server that asks for client certificates.
#[tokio::test]
async fn client_certificate_is_presented_when_asked() -> anyhow::Result<()> {
    use rustls::pki_types::CertificateDer;
    use rustls::pki_types::pem::PemObject;
    use std::sync::Arc;

    let pki = pki()?;
    // A client CA and an identity it issued, as the relay's agent CA would.
    let ca_key = rcgen::KeyPair::generate()?;
    let mut ca_params = rcgen::CertificateParams::new(Vec::<String>::new())?;
    ca_params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
    let client_ca = rcgen::CertifiedIssuer::self_signed(ca_params, ca_key)?;
    let client_key = rcgen::KeyPair::generate()?;
    let mut params = rcgen::CertificateParams::new(Vec::<String>::new())?;
    params
        .distinguished_name
        .push(rcgen::DnType::CommonName, "prod");
    let client_cert = params.signed_by(&client_key, &client_ca)?;

    let provider = Arc::new(rustls::crypto::aws_lc_rs::default_provider());
    let mut roots = rustls::RootCertStore::empty();
    roots.add(client_ca.der().clone())?;
    let verifier = rustls::server::WebPkiClientVerifier::builder_with_provider(
        Arc::new(roots),
        provider.clone(),
    )
    .allow_unauthenticated()
    .build()?;
    let chain =
        CertificateDer::pem_slice_iter(pki.cert_pem.as_bytes()).collect::<Result<Vec<_>, _>>()?;
    let key = rustls::pki_types::PrivateKeyDer::from_pem_slice(pki.key_pem.as_bytes())?;
    let server = rustls::ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()?
        .with_client_cert_verifier(verifier)
        .with_single_cert(chain, key)?;
    let acceptor = tokio_rustls::TlsAcceptor::from(Arc::new(server));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let port = listener.local_addr()?.port();
    let (seen_tx, mut seen_rx) = mpsc::unbounded_channel();
    tokio::spawn(async move {
        while let Ok((tcp, _)) = listener.accept().await {
            let acceptor = acceptor.clone();
            let seen_tx = seen_tx.clone();
            tokio::spawn(async move {
                if let Ok(mut tls) = acceptor.accept(tcp).await {
                    let presented = tls
                        .get_ref()
                        .1
                        .peer_certificates()
                        .and_then(|c| c.first().cloned());
                    let _ = seen_tx.send(presented);
                    let _ = tls.shutdown().await;
                }
            });
        }
    });

    let (cert_pem, key_pem) = (client_cert.pem(), client_key.serialize_pem());
    for with_identity in [true, false] {
        let identity = tls::ClientIdentity {
            cert_pem: cert_pem.as_bytes(),
            key_pem: key_pem.as_bytes(),
        };
        let config = tls::client_config_with(&tls::ClientOptions {
            ca_pem: Some(pki.ca_pem.as_bytes()),
            identity: with_identity.then_some(identity),
            ..tls::ClientOptions::default()
        })?;
        let tcp = tokio::net::TcpStream::connect(("127.0.0.1", port)).await?;
        let name = rustls::pki_types::ServerName::try_from("localhost")?;
        let _tls = within(
            "handshake",
            tokio_rustls::TlsConnector::from(config).connect(name, tcp),
        )
        .await??;
        let presented = within("server side", seen_rx.recv())
            .await?
            .context("server saw nothing")?;
        match presented {
            Some(cert) => {
                assert!(with_identity);
                assert_eq!(cert.as_ref(), client_cert.der().as_ref());
            }
            None => assert!(!with_identity),
        }
    }
    Ok(())
}
