//! Test support: the shared test identity provider (`tether_testkit::idp`) for guard's audience, and an HTTPS
//! client with or without a client certificate.

#![allow(dead_code, unreachable_pub)]

use std::sync::Arc;

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper_util::rt::TokioExecutor;
use tether_testkit::certs;

pub use tether_testkit::idp::{Idp, Minted, TENANT};

pub const AUDIENCE: &str = "api://tether-guard";

/// Whether python3 with PyJWT is here: under CI its absence fails the test, elsewhere a printed skip.
pub fn pyjwt_available() -> bool {
    tether_testkit::tools::require(tether_testkit::tools::Tool::PyJwt).is_some()
}

/// Mints the test token set for guard's audience (see [`tether_testkit::idp::mint`]).
pub fn mint(idp: &Idp) -> anyhow::Result<Minted> {
    Ok(tether_testkit::idp::mint(idp, AUDIENCE)?)
}

/// A token configuration trusting the local IdP.
pub fn token_config(idp: &Idp) -> tether_auth::TokenConfig {
    let mut c = tether_auth::TokenConfig::new(vec![TENANT.to_owned()], vec![AUDIENCE.to_owned()]);
    c.v2_authority = idp.v2_authority();
    c.v1_authority = idp.v1_authority();
    c
}

/// An HTTPS client for `ca_pem`, presenting `client` (cert, key) when given.
pub fn https_client(
    ca_pem: &str,
    client: Option<&certs::CertifiedPem>,
) -> anyhow::Result<
    hyper_util::client::legacy::Client<
        hyper_rustls::HttpsConnector<hyper_util::client::legacy::connect::HttpConnector>,
        Full<Bytes>,
    >,
> {
    let mut roots = rustls::RootCertStore::empty();
    for c in certs::parse_certs(ca_pem.as_bytes())? {
        roots.add(c)?;
    }
    let provider = Arc::new(rustls::crypto::aws_lc_rs::default_provider());
    let builder = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()?
        .with_root_certificates(roots);
    let config = match client {
        Some(c) => builder.with_client_auth_cert(vec![c.cert_der()], c.key_der())?,
        None => builder.with_no_client_auth(),
    };
    let connector = hyper_rustls::HttpsConnectorBuilder::new()
        .with_tls_config(config)
        .https_only()
        .enable_http1()
        .enable_http2()
        .build();
    Ok(hyper_util::client::legacy::Client::builder(TokioExecutor::new()).build(connector))
}

/// POSTs or PUTs JSON; returns status and parsed body.
pub async fn send(
    client: &hyper_util::client::legacy::Client<
        hyper_rustls::HttpsConnector<hyper_util::client::legacy::connect::HttpConnector>,
        Full<Bytes>,
    >,
    method: &str,
    url: &str,
    headers: &[(&str, &str)],
    body: Vec<u8>,
) -> anyhow::Result<(u16, Bytes)> {
    let mut req = hyper::Request::builder().method(method).uri(url);
    for (k, v) in headers {
        req = req.header(*k, *v);
    }
    let req = req
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from(body)))?;
    let resp = client.request(req).await?;
    let status = resp.status().as_u16();
    let body = resp.into_body().collect().await?.to_bytes();
    Ok((status, body))
}
