//! A DEVELOPMENT-ONLY token issuer shaped like Entra ID, for `tether up`, `tether token` and the tests.
//!
//! It holds one RSA-2048 key (`DIR/key.pem`, mode 0600, kept across restarts), serves over HTTPS (its own CA,
//! `DIR/ca.pem`) the two documents a token validator fetches — the OpenID discovery document at
//! `/{tid}/v2.0/.well-known/openid-configuration` and the JWKS at `/{tid}/discovery/v2.0/keys` — for the fixed
//! tenant [`DEV_TENANT`], and mints v2 access tokens (`iss` = `{authority}/{tid}/v2.0`, `aud`, `oid`, `tid`, `upn`
//! and `preferred_username`, `groups`, one hour) signed RS256 with that key. `DIR/issuer.json` records the
//! authority, tenant, audience and key id so that another process (`tether token`) can mint with the same key.
//!
//! What it is not: an identity provider. Anyone who can read `key.pem` can mint a token for anyone; there are no
//! users, passwords, consent or refresh tokens. Never point a real cluster's guard at it.

use std::convert::Infallible;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use http_body_util::Full;
use hyper::body::Incoming;
use jsonwebtoken::jwk::{AlgorithmParameters, Jwk};
use jsonwebtoken::{Algorithm, EncodingKey, Header};
use serde::{Deserialize, Serialize};
use serde_json::{Value, json};
use sha2::{Digest as _, Sha256};
use tether_runtime::serve;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::{TestkitError, certs};

/// The fixed tenant id of the development issuer.
pub const DEV_TENANT: &str = "7e7e7e7e-0000-4000-8000-00000000de70";
/// The audience development tokens carry unless told otherwise (the "application id URI" of the cluster API).
pub const DEV_AUDIENCE: &str = "api://tether-dev";
/// How long a development token is valid.
pub const TOKEN_LIFETIME: Duration = Duration::from_secs(3600);
/// The client id development tokens name as `azp` (the app that asked for them).
pub const DEV_CLIENT_ID: &str = "7e7e7e7e-0000-4000-8000-0000000c11e7";

/// What `DIR/issuer.json` holds: enough for another process to mint tokens this issuer's validators accept.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct IssuerInfo {
    /// Always true: a reminder in the file itself.
    pub development_only: bool,
    /// `https://127.0.0.1:PORT`: the base of the issuer and discovery URLs (a validator's `--authority`).
    pub authority: String,
    /// The tenant id.
    pub tenant: String,
    /// The default audience.
    pub audience: String,
    /// The signing key's id (`kid`).
    pub kid: String,
}

impl IssuerInfo {
    /// The v2 issuer URL, `{authority}/{tenant}/v2.0`.
    pub fn issuer(&self) -> String {
        format!("{}/{}/v2.0", self.authority, self.tenant)
    }
}

/// What to put in a development token.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TokenRequest {
    /// The user name (`upn` and `preferred_username`), e.g. `alice@contoso.com`.
    pub user: String,
    /// Group ids for the `groups` claim (omitted when empty, as Entra does).
    pub groups: Vec<String>,
    /// The object id; `None` derives a stable one from the user name ([`object_id`]).
    pub oid: Option<String>,
    /// The audience; `None` uses the issuer's.
    pub audience: Option<String>,
    /// How long the token is valid.
    pub lifetime: Duration,
}

impl TokenRequest {
    /// A one-hour token for `user` with no groups.
    pub fn user(user: &str) -> TokenRequest {
        TokenRequest {
            user: user.to_string(),
            groups: Vec::new(),
            oid: None,
            audience: None,
            lifetime: TOKEN_LIFETIME,
        }
    }

    /// The same request with `groups`.
    pub fn with_groups(mut self, groups: &[&str]) -> TokenRequest {
        self.groups = groups.iter().map(|g| g.to_string()).collect();
        self
    }
}

/// A minted token and the identity it carries.
#[derive(Clone, PartialEq, Eq)]
pub struct MintedToken {
    /// The compact JWS.
    pub token: String,
    /// Its `oid`.
    pub oid: String,
    /// Its `tid`.
    pub tenant: String,
    /// Its user name.
    pub user: String,
    /// Its groups.
    pub groups: Vec<String>,
    /// Its `exp` (seconds since the epoch).
    pub expires_at: u64,
}

impl std::fmt::Debug for MintedToken {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MintedToken")
            .field("token", &"***")
            .field("oid", &self.oid)
            .field("user", &self.user)
            .field("groups", &self.groups)
            .finish_non_exhaustive()
    }
}

/// The stable object id the development issuer gives `user` when none is chosen: a GUID made from the SHA-256
/// of the name, so `tether token --user alice` and `tether role assign --principal …` agree across runs.
pub fn object_id(user: &str) -> String {
    let digest = Sha256::digest(format!("tether-dev-user:{user}").as_bytes());
    let mut b = [0u8; 16];
    b.copy_from_slice(&digest[..16]);
    crate::util::uuid_v4(b)
}

/// The signing key and what it takes to mint.
struct Signer {
    info: IssuerInfo,
    key: EncodingKey,
}

impl Signer {
    fn mint(&self, req: &TokenRequest) -> Result<MintedToken, TestkitError> {
        let now = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_err(|e| TestkitError::Issuer(e.to_string()))?
            .as_secs();
        let oid = req.oid.clone().unwrap_or_else(|| object_id(&req.user));
        let exp = now + req.lifetime.as_secs();
        let mut claims = json!({
            "aud": req.audience.clone().unwrap_or_else(|| self.info.audience.clone()),
            "iss": self.info.issuer(),
            "iat": now,
            "nbf": now,
            "exp": exp,
            "azp": DEV_CLIENT_ID,
            "azpacr": "0",
            "name": req.user,
            "oid": oid,
            "preferred_username": req.user,
            "upn": req.user,
            "scp": "user_impersonation",
            "sub": format!("dev-{}", &oid[..8]),
            "tid": self.info.tenant,
            "uti": crate::util::random_token(),
            "ver": "2.0",
        });
        if !req.groups.is_empty() {
            claims["groups"] = json!(req.groups);
        }
        let mut header = Header::new(Algorithm::RS256);
        header.kid = Some(self.info.kid.clone());
        let token = jsonwebtoken::encode(&header, &claims, &self.key)
            .map_err(|e| TestkitError::Issuer(format!("cannot sign: {e}")))?;
        Ok(MintedToken {
            token,
            oid,
            tenant: self.info.tenant.clone(),
            user: req.user.clone(),
            groups: req.groups.clone(),
            expires_at: exp,
        })
    }
}

/// The public JWK (Entra's fields: `kty`, `use`, `kid`, `n`, `e`, `issuer`) of an RSA key.
fn public_jwk(key: &EncodingKey, kid: &str, issuer: &str) -> Result<Value, TestkitError> {
    let jwk = Jwk::from_encoding_key(key, Algorithm::RS256)
        .map_err(|e| TestkitError::Issuer(format!("cannot derive the public key: {e}")))?;
    let AlgorithmParameters::RSA(rsa) = jwk.algorithm else {
        return Err(TestkitError::Issuer("the key is not an RSA key".into()));
    };
    Ok(json!({"kty": "RSA", "use": "sig", "kid": kid, "n": rsa.n, "e": rsa.e, "issuer": issuer}))
}

fn read(path: &Path) -> Result<Vec<u8>, TestkitError> {
    std::fs::read(path).map_err(|e| TestkitError::Issuer(format!("{}: {e}", path.display())))
}

/// Loads `DIR/key.pem`, or makes and writes a new RSA-2048 key.
fn load_or_create_key(dir: &Path) -> Result<(String, EncodingKey), TestkitError> {
    let path = dir.join("key.pem");
    let pem = if path.exists() {
        String::from_utf8(read(&path)?)
            .map_err(|_| TestkitError::Issuer(format!("{} is not PEM", path.display())))?
    } else {
        let key = rcgen::KeyPair::generate_for(&rcgen::PKCS_RSA_SHA256)
            .map_err(|e| TestkitError::Issuer(format!("cannot generate an RSA key: {e}")))?;
        let pem = key.serialize_pem();
        certs::write_private(&path, pem.as_bytes())?;
        pem
    };
    let key = EncodingKey::from_rsa_pem(pem.as_bytes())
        .map_err(|e| TestkitError::Issuer(format!("{}: {e}", path.display())))?;
    Ok((pem, key))
}

/// The key id of an RSA key: the first 16 hex digits of the SHA-256 of its modulus.
fn key_id(key: &EncodingKey) -> Result<String, TestkitError> {
    let jwk = public_jwk(key, "", "")?;
    let n = jwk["n"].as_str().unwrap_or_default();
    let digest = Sha256::digest(n.as_bytes());
    Ok(digest[..8].iter().map(|b| format!("{b:02x}")).collect())
}

/// Mints a token with the key and settings an issuer left in `dir` (`key.pem`, `issuer.json`); what
/// `tether token` does. The issuer need not be running to mint, only for the token to be validated.
pub fn mint_from_dir(dir: &Path, req: &TokenRequest) -> Result<MintedToken, TestkitError> {
    let info: IssuerInfo = serde_json::from_slice(&read(&dir.join("issuer.json"))?)
        .map_err(|e| TestkitError::Issuer(format!("{}: {e}", dir.join("issuer.json").display())))?;
    let pem = read(&dir.join("key.pem"))?;
    let key = EncodingKey::from_rsa_pem(&pem)
        .map_err(|e| TestkitError::Issuer(format!("{}: {e}", dir.join("key.pem").display())))?;
    Signer { info, key }.mint(req)
}

/// A running development issuer. Stops on [`DevIssuer::shutdown`] or when dropped.
pub struct DevIssuer {
    signer: Arc<Signer>,
    dir: PathBuf,
    ca_pem: String,
    shutdown: CancellationToken,
    tracker: TaskTracker,
}

impl std::fmt::Debug for DevIssuer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DevIssuer")
            .field("info", &self.signer.info)
            .finish_non_exhaustive()
    }
}

impl DevIssuer {
    /// Loads or makes the key in `dir`, makes a CA and serving certificate, binds `listen`, serves, and writes
    /// `DIR/ca.pem` and `DIR/issuer.json`.
    pub async fn start(
        dir: &Path,
        listen: SocketAddr,
        audience: &str,
    ) -> Result<DevIssuer, TestkitError> {
        std::fs::create_dir_all(dir).map_err(|source| TestkitError::Write {
            path: dir.to_path_buf(),
            source,
        })?;
        let (_pem, key) = load_or_create_key(dir)?;
        let kid = key_id(&key)?;
        let ca = certs::Ca::new("tether development issuer CA (DEVELOPMENT ONLY)")?;
        let serving =
            ca.issue_server(&["127.0.0.1".to_string(), "localhost".into(), "::1".into()])?;
        let tls = certs::server_config(vec![serving.cert_der()], serving.key_der())?;
        let (listener, addr) = crate::bind(listen).await?;
        let host = if addr.ip().is_unspecified() {
            "127.0.0.1".to_string()
        } else {
            addr.ip().to_string()
        };
        let info = IssuerInfo {
            development_only: true,
            authority: format!("https://{host}:{}", addr.port()),
            tenant: DEV_TENANT.to_string(),
            audience: audience.to_string(),
            kid,
        };
        certs::write_private(&dir.join("ca.pem"), ca.cert_pem().as_bytes())?;
        let text =
            serde_json::to_vec_pretty(&info).map_err(|e| TestkitError::Issuer(e.to_string()))?;
        certs::write_private(&dir.join("issuer.json"), &text)?;
        let jwk = public_jwk(&key, &info.kid, &info.issuer())?;
        let signer = Arc::new(Signer { info, key });

        let shutdown = CancellationToken::new();
        let tracker = TaskTracker::new();
        let routes = Arc::new(Routes {
            info: signer.info.clone(),
            keys: json!({ "keys": [jwk] }),
        });
        tracker.spawn(serve(listener, tls, routes, shutdown.clone()));
        tracing::info!(authority = %signer.info.authority, "development token issuer listening (DEVELOPMENT ONLY)");
        Ok(DevIssuer {
            signer,
            dir: dir.to_path_buf(),
            ca_pem: ca.cert_pem().to_string(),
            shutdown,
            tracker,
        })
    }

    /// The issuer's settings (also in `DIR/issuer.json`).
    pub fn info(&self) -> &IssuerInfo {
        &self.signer.info
    }

    /// The authority (`https://127.0.0.1:PORT`).
    pub fn authority(&self) -> &str {
        &self.signer.info.authority
    }

    /// The v2 issuer URL.
    pub fn issuer(&self) -> String {
        self.signer.info.issuer()
    }

    /// The CA (PEM) that signed the issuer's serving certificate.
    pub fn ca_pem(&self) -> &str {
        &self.ca_pem
    }

    /// `DIR/ca.pem`.
    pub fn ca_file(&self) -> PathBuf {
        self.dir.join("ca.pem")
    }

    /// `DIR/key.pem`: the signing key (PKCS#8 PEM), for minting with another JWT library.
    pub fn key_file(&self) -> PathBuf {
        self.dir.join("key.pem")
    }

    /// Mints a token.
    pub fn mint(&self, req: &TokenRequest) -> Result<MintedToken, TestkitError> {
        self.signer.mint(req)
    }

    /// Stops serving and waits for the connections to end.
    pub async fn shutdown(self) {
        self.shutdown.cancel();
        self.tracker.close();
        self.tracker.wait().await;
    }
}

impl Drop for DevIssuer {
    fn drop(&mut self) {
        self.shutdown.cancel();
    }
}

struct Routes {
    info: IssuerInfo,
    keys: Value,
}

impl Routes {
    fn answer(&self, path: &str) -> (u16, Value) {
        let a = &self.info.authority;
        let t = &self.info.tenant;
        let parts: Vec<&str> = path.trim_start_matches('/').split('/').collect();
        match parts.as_slice() {
            [tid, "v2.0", ".well-known", "openid-configuration"] if *tid == t => (
                200,
                json!({
                    "token_endpoint": format!("{a}/{t}/oauth2/v2.0/token"),
                    "token_endpoint_auth_methods_supported": ["client_secret_post", "private_key_jwt", "client_secret_basic"],
                    "jwks_uri": format!("{a}/{t}/discovery/v2.0/keys"),
                    "response_modes_supported": ["query", "fragment", "form_post"],
                    "subject_types_supported": ["pairwise"],
                    "id_token_signing_alg_values_supported": ["RS256"],
                    "response_types_supported": ["code", "id_token", "code id_token", "id_token token"],
                    "scopes_supported": ["openid", "profile", "email", "offline_access"],
                    "issuer": self.info.issuer(),
                    "request_uri_parameter_supported": false,
                    "authorization_endpoint": format!("{a}/{t}/oauth2/v2.0/authorize"),
                    "claims_supported": ["sub", "iss", "aud", "exp", "iat", "nbf", "name", "oid", "tid", "ver", "upn", "preferred_username", "groups"],
                    "tenant_region_scope": "WW",
                    "cloud_instance_name": "tether.invalid",
                    "x_development_only": true,
                }),
            ),
            [tid, "discovery", "v2.0", "keys"] if *tid == t => (200, self.keys.clone()),
            [_, "v2.0", ".well-known", "openid-configuration"]
            | [_, "discovery", "v2.0", "keys"] => (
                400,
                json!({"error": "invalid_tenant", "error_description": "the development issuer serves one tenant only"}),
            ),
            _ => (404, json!({"error": "not_found"})),
        }
    }
}

/// Serves the issuer's documents until `shutdown`, then drops every connection still open.
async fn serve(
    listener: tokio::net::TcpListener,
    tls: Arc<rustls::ServerConfig>,
    routes: Arc<Routes>,
    shutdown: CancellationToken,
) {
    let limits = serve::Limits {
        // No connection limit, hyper's 200 streams and no HTTP/2 pings, as before. New: the shared 64 KiB limit on
        // request heads and 30 s header-read timeout.
        max_connections: usize::MAX,
        h2_max_concurrent_streams: 200,
        h2_keep_alive_interval: None,
        ..serve::Limits::default()
    };
    let make_service = move |_conn: serve::Conn| {
        let routes = routes.clone();
        hyper::service::service_fn(move |req: hyper::Request<Incoming>| {
            let routes = routes.clone();
            async move { Ok::<_, Infallible>(respond(&routes, &req)) }
        })
    };
    let draining = serve::serve(
        listener,
        tls,
        limits,
        make_service,
        shutdown.cancelled_owned(),
    )
    .await;
    draining.cut();
    draining.wait().await;
}

/// The answer to one request: JSON, `GET` only.
fn respond(routes: &Routes, req: &hyper::Request<Incoming>) -> hyper::Response<Full<Bytes>> {
    let (code, body) = if req.method() == http::Method::GET {
        routes.answer(req.uri().path())
    } else {
        (405, json!({"error": "method_not_allowed"}))
    };
    let mut response = hyper::Response::new(Full::new(Bytes::from(body.to_string())));
    *response.status_mut() = http::StatusCode::from_u16(code).unwrap_or(http::StatusCode::OK);
    response.headers_mut().insert(
        http::header::CONTENT_TYPE,
        http::HeaderValue::from_static("application/json; charset=utf-8"),
    );
    response
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn object_ids_are_stable_guids() {
        let a = object_id("alice@contoso.com");
        assert_eq!(a, object_id("alice@contoso.com"));
        assert_ne!(a, object_id("bob@contoso.com"));
        assert_eq!(a.len(), 36);
        assert_eq!(a.as_bytes()[14], b'4');
    }

    #[test]
    fn routes_serve_one_tenant() {
        let info = IssuerInfo {
            development_only: true,
            authority: "https://127.0.0.1:1".into(),
            tenant: DEV_TENANT.into(),
            audience: DEV_AUDIENCE.into(),
            kid: "k".into(),
        };
        let routes = Routes {
            info: info.clone(),
            keys: json!({"keys": []}),
        };
        let (code, doc) = routes.answer(&format!(
            "/{DEV_TENANT}/v2.0/.well-known/openid-configuration"
        ));
        assert_eq!(code, 200);
        assert_eq!(doc["issuer"], info.issuer());
        assert_eq!(
            doc["jwks_uri"],
            format!("https://127.0.0.1:1/{DEV_TENANT}/discovery/v2.0/keys")
        );
        assert_eq!(routes.answer("/other/discovery/v2.0/keys").0, 400);
        assert_eq!(routes.answer("/").0, 404);
    }
}
