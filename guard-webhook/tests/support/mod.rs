//! Test support: a local HTTPS identity provider shaped like Entra (discovery documents and a JWKS), tokens minted
//! by PyJWT, and an HTTPS client with or without a client certificate.

#![allow(dead_code, unreachable_pub)]

use std::convert::Infallible;
use std::net::SocketAddr;
use std::process::Command;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use anyhow::Context as _;
use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper_util::rt::{TokioExecutor, TokioIo};
use serde_json::{Value, json};
use tether_testkit::certs::{self, Ca};
use tokio::net::TcpListener;
use tokio_rustls::TlsAcceptor;

pub const TENANT: &str = "72f988bf-86f1-41af-91ab-2d7cd011db47";
pub const OTHER_TENANT: &str = "00000000-dead-beef-0000-000000000000";
pub const AUDIENCE: &str = "api://tether-guard";

/// Whether PyJWT is available; prints why not.
pub fn pyjwt_available() -> bool {
    let ok = Command::new("python3")
        .args(["-c", "import jwt, cryptography"])
        .output()
        .map(|o| o.status.success())
        .unwrap_or(false);
    if !ok {
        eprintln!(
            "SKIPPED: python3 with PyJWT and cryptography is not installed \
             (pip install pyjwt cryptography)"
        );
    }
    ok
}

/// A local identity provider over HTTPS.
pub struct Idp {
    pub addr: SocketAddr,
    pub ca: Ca,
    keys: Arc<Mutex<Vec<Value>>>,
    reachable: Arc<AtomicBool>,
    key_fetches: Arc<AtomicU64>,
}

impl Idp {
    pub fn base(&self) -> String {
        format!("https://{}", self.addr)
    }
    /// The v2 authority (`--authority`).
    pub fn v2_authority(&self) -> String {
        format!("{}/login", self.base())
    }
    /// The v1 authority (`--v1-authority`).
    pub fn v1_authority(&self) -> String {
        format!("{}/sts", self.base())
    }
    pub fn v2_issuer(&self, tid: &str) -> String {
        format!("{}/{tid}/v2.0", self.v2_authority())
    }
    pub fn v1_issuer(&self, tid: &str) -> String {
        format!("{}/{tid}/", self.v1_authority())
    }
    pub fn set_keys(&self, keys: Vec<Value>) {
        if let Ok(mut k) = self.keys.lock() {
            *k = keys;
        }
    }
    pub fn set_reachable(&self, up: bool) {
        self.reachable.store(up, Ordering::SeqCst);
    }
    pub fn key_fetches(&self) -> u64 {
        self.key_fetches.load(Ordering::SeqCst)
    }

    pub async fn start() -> anyhow::Result<Idp> {
        let ca = Ca::new("test idp ca")?;
        let server = ca.issue_server(&["127.0.0.1".to_owned(), "localhost".to_owned()])?;
        let tls = certs::server_config(vec![server.cert_der()], server.key_der())?;
        let listener = TcpListener::bind("127.0.0.1:0").await?;
        let addr = listener.local_addr()?;
        let keys = Arc::new(Mutex::new(Vec::new()));
        let reachable = Arc::new(AtomicBool::new(true));
        let key_fetches = Arc::new(AtomicU64::new(0));
        let state = (keys.clone(), reachable.clone(), key_fetches.clone());
        let acceptor = TlsAcceptor::from(tls);
        tokio::spawn(async move {
            loop {
                let Ok((tcp, _)) = listener.accept().await else {
                    return;
                };
                let acceptor = acceptor.clone();
                let state = state.clone();
                tokio::spawn(async move {
                    let Ok(tls) = acceptor.accept(tcp).await else {
                        return;
                    };
                    let svc = service_fn(move |req: hyper::Request<Incoming>| {
                        let state = state.clone();
                        async move { Ok::<_, Infallible>(idp_route(addr, &state, req.uri().path())) }
                    });
                    let _ = hyper_util::server::conn::auto::Builder::new(TokioExecutor::new())
                        .serve_connection(TokioIo::new(tls), svc)
                        .await;
                });
            }
        });
        Ok(Idp {
            addr,
            ca,
            keys,
            reachable,
            key_fetches,
        })
    }
}

type IdpState = (Arc<Mutex<Vec<Value>>>, Arc<AtomicBool>, Arc<AtomicU64>);

fn idp_route(addr: SocketAddr, state: &IdpState, path: &str) -> hyper::Response<Full<Bytes>> {
    let (keys, reachable, fetches) = state;
    let respond = |code: u16, v: Value| {
        let mut r = hyper::Response::new(Full::new(Bytes::from(v.to_string())));
        *r.status_mut() = hyper::StatusCode::from_u16(code).unwrap_or(hyper::StatusCode::OK);
        r
    };
    if !reachable.load(Ordering::SeqCst) {
        return respond(503, json!({"error": "temporarily_unavailable"}));
    }
    let base = format!("https://{addr}");
    let discovery = |issuer: String| {
        // The fields Entra's documents carry, so the parser sees a realistic document.
        json!({
            "token_endpoint": format!("{base}/login/token"),
            "token_endpoint_auth_methods_supported": ["client_secret_post", "private_key_jwt", "client_secret_basic"],
            "jwks_uri": format!("{base}/login/discovery/v2.0/keys"),
            "response_modes_supported": ["query", "fragment", "form_post"],
            "subject_types_supported": ["pairwise"],
            "id_token_signing_alg_values_supported": ["RS256"],
            "response_types_supported": ["code", "id_token", "code id_token", "id_token token"],
            "scopes_supported": ["openid", "profile", "email", "offline_access"],
            "issuer": issuer,
            "request_uri_parameter_supported": false,
            "userinfo_endpoint": "https://graph.microsoft.com/oidc/userinfo",
            "authorization_endpoint": format!("{base}/login/authorize"),
            "http_logout_supported": true,
            "frontchannel_logout_supported": true,
            "claims_supported": ["sub", "iss", "aud", "exp", "iat", "nbf", "name", "oid", "tid", "ver"],
            "tenant_region_scope": "WW",
            "cloud_instance_name": "microsoftonline.com",
        })
    };
    let parts: Vec<&str> = path.trim_start_matches('/').split('/').collect();
    match parts.as_slice() {
        ["login", tid, "v2.0", ".well-known", "openid-configuration"] => {
            respond(200, discovery(format!("{base}/login/{tid}/v2.0")))
        }
        ["login", tid, ".well-known", "openid-configuration"] => {
            respond(200, discovery(format!("{base}/sts/{tid}/")))
        }
        ["login", "discovery", "v2.0", "keys"] => {
            fetches.fetch_add(1, Ordering::SeqCst);
            let keys = keys.lock().map(|k| k.clone()).unwrap_or_default();
            respond(200, json!({ "keys": keys }))
        }
        _ => respond(404, json!({"error": "not found"})),
    }
}

/// Tokens and public keys from PyJWT.
pub struct Minted {
    pub jwks: serde_json::Map<String, Value>,
    pub tokens: serde_json::Map<String, Value>,
}

impl Minted {
    pub fn token(&self, case: &str) -> String {
        self.tokens
            .get(case)
            .and_then(Value::as_str)
            .unwrap_or_default()
            .to_owned()
    }
    pub fn key(&self, kid: &str) -> Value {
        self.jwks.get(kid).cloned().unwrap_or(Value::Null)
    }
}

pub fn mint(idp: &Idp) -> anyhow::Result<Minted> {
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)?
        .as_secs();
    let params = json!({
        "now": now,
        "tid": TENANT,
        "other_tid": OTHER_TENANT,
        "aud": AUDIENCE,
        "v2_iss": idp.v2_issuer(TENANT),
        "v1_iss": idp.v1_issuer(TENANT),
        "other_iss": idp.v2_issuer(OTHER_TENANT),
    });
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/mint_tokens.py");
    let out = Command::new("python3")
        .arg(script)
        .arg(params.to_string())
        .output()
        .context("running python3")?;
    anyhow::ensure!(
        out.status.success(),
        "mint_tokens.py failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: Value = serde_json::from_slice(&out.stdout)?;
    let obj = |k: &str| {
        v.get(k)
            .and_then(Value::as_object)
            .cloned()
            .ok_or_else(|| anyhow::anyhow!("mint output lacks {k}"))
    };
    Ok(Minted {
        jwks: obj("jwks")?,
        tokens: obj("tokens")?,
    })
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
