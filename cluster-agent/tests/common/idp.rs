//! A focused local identity provider shaped like Entra (v2 discovery document and JWKS over HTTPS), and
//! tokens minted by PyJWT (an implementation independent of ours) with guard's own minting script,
//! `guard-webhook/tests/mint_tokens.py`, so both crates test against the same token shapes.

use std::convert::Infallible;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::{Arc, Mutex};

use anyhow::{Context as _, Result};
use bytes::Bytes;
use http_body_util::Full;
use hyper::body::Incoming;
use hyper_util::rt::{TokioExecutor, TokioIo};
use serde_json::{Value, json};
use tokio::net::TcpListener;

use super::TestCa;

pub const TENANT: &str = "72f988bf-86f1-41af-91ab-2d7cd011db47";
pub const OTHER_TENANT: &str = "00000000-dead-beef-0000-000000000000";
pub const AUDIENCE: &str = "api://tether-guard";
/// The `oid` of the user in the minted tokens.
pub const ALICE_OID: &str = "aaaaaaaa-0000-0000-0000-000000000001";
/// The `preferred_username` of that user.
pub const ALICE: &str = "alice@contoso.example";
/// The `groups` claim of that user.
pub const ALICE_GROUPS: [&str; 2] = [
    "gggggggg-0000-0000-0000-000000000001",
    "gggggggg-0000-0000-0000-000000000002",
];

/// Whether python3 with PyJWT is available; prints why not.
pub fn pyjwt_available() -> bool {
    let ok = Command::new("python3")
        .args(["-c", "import jwt, cryptography"])
        .output()
        .map(|o| o.status.success())
        .unwrap_or(false);
    if !ok {
        eprintln!(
            "SKIPPED: python3 with PyJWT and cryptography is not installed \
             (scripts/install-test-deps.sh, or pip install pyjwt cryptography)"
        );
    }
    ok
}

/// The identity provider: `/login/{tid}/v2.0/.well-known/openid-configuration` and
/// `/login/discovery/v2.0/keys`.
pub struct Idp {
    pub addr: SocketAddr,
    pub ca: TestCa,
    keys: Arc<Mutex<Vec<Value>>>,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for Idp {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl Idp {
    pub async fn start() -> Result<Self> {
        let ca = TestCa::new()?;
        let tls = tokio_rustls::TlsAcceptor::from(ca.server_config(&["localhost", "127.0.0.1"])?);
        let listener = TcpListener::bind("127.0.0.1:0").await?;
        let addr = listener.local_addr()?;
        let keys = Arc::new(Mutex::new(Vec::new()));
        let task = {
            let keys = keys.clone();
            tokio::spawn(async move {
                while let Ok((tcp, _)) = listener.accept().await {
                    let tls = tls.clone();
                    let keys = keys.clone();
                    tokio::spawn(async move {
                        let Ok(stream) = tls.accept(tcp).await else {
                            return;
                        };
                        let service = hyper::service::service_fn(move |req| {
                            let keys = keys.clone();
                            async move { Ok::<_, Infallible>(route(addr, &keys, &req)) }
                        });
                        let _ = hyper_util::server::conn::auto::Builder::new(TokioExecutor::new())
                            .serve_connection(TokioIo::new(stream), service)
                            .await;
                    });
                }
            })
        };
        Ok(Self {
            addr,
            ca,
            keys,
            task,
        })
    }

    /// The v2 authority (`--entra-authority`).
    pub fn authority(&self) -> String {
        format!("https://{}/login", self.addr)
    }

    pub fn v2_issuer(&self, tid: &str) -> String {
        format!("{}/{tid}/v2.0", self.authority())
    }

    pub fn set_keys(&self, keys: Vec<Value>) {
        if let Ok(mut k) = self.keys.lock() {
            *k = keys;
        }
    }

    /// Writes the IdP's CA to `dir` (`--entra-authority-ca`).
    pub fn write_ca(&self, dir: &Path) -> Result<PathBuf> {
        let path = dir.join("idp-ca.pem");
        std::fs::write(&path, self.ca.pem())?;
        Ok(path)
    }
}

fn route(
    addr: SocketAddr,
    keys: &Mutex<Vec<Value>>,
    req: &hyper::Request<Incoming>,
) -> hyper::Response<Full<Bytes>> {
    let base = format!("https://{addr}/login");
    let respond = |code: hyper::StatusCode, v: Value| {
        let mut r = hyper::Response::new(Full::new(Bytes::from(v.to_string())));
        *r.status_mut() = code;
        r.headers_mut().insert(
            "content-type",
            http::HeaderValue::from_static("application/json"),
        );
        r
    };
    let parts: Vec<&str> = req
        .uri()
        .path()
        .trim_start_matches('/')
        .split('/')
        .collect();
    match parts.as_slice() {
        ["login", tid, "v2.0", ".well-known", "openid-configuration"] => respond(
            hyper::StatusCode::OK,
            // The fields of Entra's document that matter, with its shape.
            json!({
                "issuer": format!("{base}/{tid}/v2.0"),
                "jwks_uri": format!("{base}/discovery/v2.0/keys"),
                "token_endpoint": format!("{base}/{tid}/oauth2/v2.0/token"),
                "authorization_endpoint": format!("{base}/{tid}/oauth2/v2.0/authorize"),
                "id_token_signing_alg_values_supported": ["RS256"],
                "response_types_supported": ["code", "id_token", "code id_token", "id_token token"],
                "subject_types_supported": ["pairwise"],
                "scopes_supported": ["openid", "profile", "email", "offline_access"],
                "claims_supported": ["sub", "iss", "aud", "exp", "iat", "nbf", "name", "oid", "tid", "ver"],
                "tenant_region_scope": "WW",
                "cloud_instance_name": "microsoftonline.com",
            }),
        ),
        ["login", "discovery", "v2.0", "keys"] => {
            let keys = keys.lock().map(|k| k.clone()).unwrap_or_default();
            respond(hyper::StatusCode::OK, json!({ "keys": keys }))
        }
        _ => respond(hyper::StatusCode::NOT_FOUND, json!({"error": "not found"})),
    }
}

/// Tokens and public keys from PyJWT.
pub struct Minted {
    jwks: serde_json::Map<String, Value>,
    tokens: serde_json::Map<String, Value>,
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

/// Mints guard's test token set for this IdP (keys made by the script; the IdP is given the public ones).
pub fn mint(idp: &Idp) -> Result<Minted> {
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)?
        .as_secs();
    let params = json!({
        "now": now,
        "tid": TENANT,
        "other_tid": OTHER_TENANT,
        "aud": AUDIENCE,
        "v2_iss": idp.v2_issuer(TENANT),
        "v1_iss": format!("https://sts.windows.net/{TENANT}/"),
        "other_iss": idp.v2_issuer(OTHER_TENANT),
    });
    let script = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../guard-webhook/tests/mint_tokens.py"
    );
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
            .with_context(|| format!("mint output lacks {k}"))
    };
    let minted = Minted {
        jwks: obj("jwks")?,
        tokens: obj("tokens")?,
    };
    idp.set_keys(vec![minted.key("k1"), minted.key("e1")]);
    Ok(minted)
}

/// The agent's Entra settings for this IdP.
pub fn entra_config(idp: &Idp, dir: &Path) -> Result<tether_agent::EntraConfig> {
    Ok(tether_agent::EntraConfig {
        tenants: vec![TENANT.to_owned()],
        audiences: vec![AUDIENCE.to_owned()],
        authority: Some(idp.authority()),
        authority_ca: Some(idp.write_ca(dir)?),
    })
}
