//! The one identity provider of Tether's tests: a local HTTPS server shaped like Entra ID (per-tenant v2 and v1
//! OpenID discovery documents and a JWKS), and tokens minted for it by PyJWT — a JWT implementation independent of
//! `tether-auth` — with `mint_tokens.py` beside this file.
//!
//! Layout, with `base` = `https://127.0.0.1:PORT`: the v2 authority is `base/login` (issuer
//! `base/login/{tid}/v2.0`), the v1 authority `base/sts` (issuer `base/sts/{tid}/`), and the keys are at
//! `base/login/discovery/v2.0/keys`. Tests publish keys ([`Idp::set_keys`], [`Idp::publish`]), can make the IdP
//! answer 503 ([`Idp::set_reachable`]) and count key fetches ([`Idp::key_fetches`]).

use std::convert::Infallible;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use bytes::Bytes;
use http_body_util::Full;
use hyper::body::Incoming;
use hyper::service::service_fn;
use serde_json::{Value, json};
use tether_runtime::serve;
use tokio::net::TcpListener;

use crate::certs::{self, Ca, CertError};

/// Why the identity provider could not start or tokens could not be minted.
#[derive(Debug, thiserror::Error)]
pub enum IdpError {
    /// Certificates or TLS configuration failed.
    #[error(transparent)]
    Certs(#[from] CertError),
    /// A socket or file operation failed.
    #[error("{what}: {source}")]
    Io {
        /// What was being done.
        what: &'static str,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
    /// `mint_tokens.py` could not run or failed.
    #[error("mint_tokens.py: {0}")]
    Mint(String),
}

/// The tenant the minted tokens belong to.
pub const TENANT: &str = "72f988bf-86f1-41af-91ab-2d7cd011db47";
/// A tenant nobody trusts.
pub const OTHER_TENANT: &str = "00000000-dead-beef-0000-000000000000";
/// The `oid` of the user in the minted `valid_v2` token.
pub const ALICE_OID: &str = "aaaaaaaa-0000-0000-0000-000000000001";
/// That user's `preferred_username`.
pub const ALICE: &str = "alice@contoso.example";
/// That user's `groups` claim.
pub const ALICE_GROUPS: [&str; 2] = [
    "gggggggg-0000-0000-0000-000000000001",
    "gggggggg-0000-0000-0000-000000000002",
];

#[derive(Default)]
struct State {
    keys: Mutex<Vec<Value>>,
    unreachable: AtomicBool,
    key_fetches: AtomicU64,
}

/// The running identity provider; stops when dropped.
pub struct Idp {
    addr: SocketAddr,
    ca: Ca,
    state: Arc<State>,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for Idp {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl std::fmt::Debug for Idp {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Idp").field("addr", &self.addr).finish()
    }
}

impl Idp {
    /// Starts the IdP on a free loopback port, with a certificate from its own CA ([`Idp::ca_pem`]).
    ///
    /// # Errors
    /// When certificates cannot be made or the port cannot be bound.
    pub async fn start() -> Result<Idp, IdpError> {
        let ca = Ca::new("test idp ca")?;
        let server = ca.issue_server(&["127.0.0.1".to_owned(), "localhost".to_owned()])?;
        let tls = certs::server_config(vec![server.cert_der()], server.key_der())?;
        let io = |what| move |source| IdpError::Io { what, source };
        let listener = TcpListener::bind("127.0.0.1:0")
            .await
            .map_err(io("binding a loopback port"))?;
        let addr = listener
            .local_addr()
            .map_err(io("reading the bound address"))?;
        let state = Arc::new(State::default());
        let served = state.clone();
        let make_service = move |_conn: serve::Conn| {
            let state = served.clone();
            service_fn(move |req: hyper::Request<Incoming>| {
                let response = route(addr, &state, req.uri().path());
                async move { Ok::<_, Infallible>(response) }
            })
        };
        // Runs until the Idp is dropped (the task is aborted then).
        let task = tokio::spawn(async move {
            let _draining = serve::serve(
                listener,
                tls,
                serve::Limits::default(),
                make_service,
                std::future::pending::<()>(),
            )
            .await;
        });
        Ok(Idp {
            addr,
            ca,
            state,
            task,
        })
    }

    /// Where it listens.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// `https://127.0.0.1:PORT`.
    pub fn base(&self) -> String {
        format!("https://{}", self.addr)
    }

    /// The v2 authority (what `--entra-authority` takes).
    pub fn v2_authority(&self) -> String {
        format!("{}/login", self.base())
    }

    /// The v1 authority.
    pub fn v1_authority(&self) -> String {
        format!("{}/sts", self.base())
    }

    /// The v2 issuer of tenant `tid`.
    pub fn v2_issuer(&self, tid: &str) -> String {
        format!("{}/{tid}/v2.0", self.v2_authority())
    }

    /// The v1 issuer of tenant `tid`.
    pub fn v1_issuer(&self, tid: &str) -> String {
        format!("{}/{tid}/", self.v1_authority())
    }

    /// The CA of the IdP's server certificate, PEM.
    pub fn ca_pem(&self) -> &str {
        self.ca.cert_pem()
    }

    /// The CA that issued the IdP's certificate (tests also issue client certificates from it).
    pub fn ca(&self) -> &Ca {
        &self.ca
    }

    /// Writes [`Idp::ca_pem`] to `dir/idp-ca.pem` (what `--entra-authority-ca` takes); its path.
    ///
    /// # Errors
    /// When the file cannot be written.
    pub fn write_ca(&self, dir: &Path) -> Result<PathBuf, IdpError> {
        let path = dir.join("idp-ca.pem");
        std::fs::write(&path, self.ca_pem()).map_err(|source| IdpError::Io {
            what: "writing idp-ca.pem",
            source,
        })?;
        Ok(path)
    }

    /// Publishes exactly `keys` (public JWKs) from now on.
    pub fn set_keys(&self, keys: Vec<Value>) {
        if let Ok(mut k) = self.state.keys.lock() {
            *k = keys;
        }
    }

    /// Publishes one more key.
    pub fn publish(&self, key: Value) {
        if let Ok(mut k) = self.state.keys.lock() {
            k.push(key);
        }
    }

    /// Whether the IdP answers (false: every request gets 503).
    pub fn set_reachable(&self, up: bool) {
        self.state.unreachable.store(!up, Ordering::SeqCst);
    }

    /// How many times the key set was fetched.
    pub fn key_fetches(&self) -> u64 {
        self.state.key_fetches.load(Ordering::SeqCst)
    }
}

fn route(addr: SocketAddr, state: &State, path: &str) -> hyper::Response<Full<Bytes>> {
    let respond = |code: hyper::StatusCode, v: Value| {
        let mut r = hyper::Response::new(Full::new(Bytes::from(v.to_string())));
        *r.status_mut() = code;
        r.headers_mut().insert(
            http::header::CONTENT_TYPE,
            http::HeaderValue::from_static("application/json"),
        );
        r
    };
    if state.unreachable.load(Ordering::SeqCst) {
        return respond(
            hyper::StatusCode::SERVICE_UNAVAILABLE,
            json!({"error": "temporarily_unavailable"}),
        );
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
        ["login", tid, "v2.0", ".well-known", "openid-configuration"] => respond(
            hyper::StatusCode::OK,
            discovery(format!("{base}/login/{tid}/v2.0")),
        ),
        ["login", tid, ".well-known", "openid-configuration"] => respond(
            hyper::StatusCode::OK,
            discovery(format!("{base}/sts/{tid}/")),
        ),
        ["login", "discovery", "v2.0", "keys"] => {
            state.key_fetches.fetch_add(1, Ordering::SeqCst);
            let keys = state.keys.lock().map(|k| k.clone()).unwrap_or_default();
            respond(hyper::StatusCode::OK, json!({ "keys": keys }))
        }
        _ => respond(hyper::StatusCode::NOT_FOUND, json!({"error": "not found"})),
    }
}

/// Tokens and public keys minted by PyJWT (`mint_tokens.py` says which cases there are).
#[derive(Debug, Clone)]
pub struct Minted {
    /// Public JWKs by key id (`k1`, `k2` — a key published later, for rotation —, `e1`).
    pub jwks: serde_json::Map<String, Value>,
    /// Compact JWS tokens by case (`valid_v2`, `valid_v1`, `app`, `none`, `hs256_confusion`, `wrong_audience`,
    /// `wrong_tenant`, `tid_mismatch`, `expired`, `nbf_future`, `unknown_kid`, `oversized`, `es256`,
    /// `rs256_with_ec_kid`, `group_overage`, `no_exp`).
    pub tokens: serde_json::Map<String, Value>,
}

impl Minted {
    /// The token of `case` (empty if there is none).
    pub fn token(&self, case: &str) -> String {
        self.tokens
            .get(case)
            .and_then(Value::as_str)
            .unwrap_or_default()
            .to_owned()
    }

    /// The public key `kid` (null if there is none).
    pub fn key(&self, kid: &str) -> Value {
        self.jwks.get(kid).cloned().unwrap_or(Value::Null)
    }
}

/// Mints the test token set for tenant [`TENANT`] at `idp`, for `audience`, with PyJWT; the keys are made by the
/// script (the Rust side only ever sees public JWKs). Publishes nothing: callers choose which keys the IdP serves.
///
/// # Errors
/// When python3 or PyJWT is missing (see [`crate::tools::require`]) or the script fails.
pub fn mint(idp: &Idp, audience: &str) -> Result<Minted, IdpError> {
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or_default();
    let params = json!({
        "now": now,
        "tid": TENANT,
        "other_tid": OTHER_TENANT,
        "aud": audience,
        "v2_iss": idp.v2_issuer(TENANT),
        "v1_iss": idp.v1_issuer(TENANT),
        "other_iss": idp.v2_issuer(OTHER_TENANT),
    });
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/src/mint_tokens.py");
    let failed = IdpError::Mint;
    let out = Command::new("python3")
        .arg(script)
        .arg(params.to_string())
        .output()
        .map_err(|e| failed(format!("cannot run python3: {e}")))?;
    if !out.status.success() {
        return Err(failed(String::from_utf8_lossy(&out.stderr).into_owned()));
    }
    let v: Value = serde_json::from_slice(&out.stdout).map_err(|e| failed(e.to_string()))?;
    let obj = |k: &str| {
        v.get(k)
            .and_then(Value::as_object)
            .cloned()
            .ok_or_else(|| failed(format!("its output lacks {k}")))
    };
    Ok(Minted {
        jwks: obj("jwks")?,
        tokens: obj("tokens")?,
    })
}
