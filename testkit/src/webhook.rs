//! Calling a webhook the way kube-apiserver does: the webhook's address and credentials come from a kubeconfig
//! file (`clusters[].cluster.server` is the full URL, `certificate-authority[-data]` the CA to trust,
//! `users[].user.client-certificate[-data]`/`client-key[-data]` the client certificate the apiserver presents, or
//! `token`/`tokenFile`), and each review is one JSON POST with a deadline.
//!
//! Relative file paths in the kubeconfig are relative to the kubeconfig's folder, as kubectl and kube-apiserver
//! resolve them. `insecure-skip-tls-verify` and plain `http://` servers are refused.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt as _, Full, Limited};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use serde_json::Value;

use crate::certs;

/// Largest webhook answer read.
const MAX_ANSWER: usize = 1024 * 1024;

/// Why a webhook configuration could not be loaded or a webhook call failed.
#[derive(Debug, thiserror::Error)]
pub enum WebhookError {
    /// A file could not be read.
    #[error("cannot read {path}: {source}")]
    Read {
        /// The file.
        path: PathBuf,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
    /// The configuration is not usable.
    #[error("{path}: {message}")]
    Config {
        /// The file.
        path: PathBuf,
        /// What is wrong.
        message: String,
    },
    /// The call failed (connection, TLS, timeout, HTTP status, malformed answer).
    #[error("webhook {url}: {message}")]
    Call {
        /// The webhook's URL.
        url: String,
        /// What went wrong.
        message: String,
    },
}

/// A webhook endpoint and the credentials to call it, from a webhook kubeconfig.
#[derive(Clone)]
pub struct WebhookClient {
    url: http::Uri,
    bearer: Option<String>,
    http: Client<hyper_rustls::HttpsConnector<HttpConnector>, Full<Bytes>>,
}

impl std::fmt::Debug for WebhookClient {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("WebhookClient")
            .field("url", &self.url)
            .field("bearer", &self.bearer.as_ref().map(|_| "***"))
            .finish_non_exhaustive()
    }
}

impl WebhookClient {
    /// Loads a webhook kubeconfig (its current context, else its only cluster and user).
    pub fn from_kubeconfig(path: &Path) -> Result<WebhookClient, WebhookError> {
        let text = std::fs::read_to_string(path).map_err(|source| WebhookError::Read {
            path: path.to_path_buf(),
            source,
        })?;
        let invalid = |message: String| WebhookError::Config {
            path: path.to_path_buf(),
            message,
        };
        let doc: serde_yaml::Value =
            serde_yaml::from_str(&text).map_err(|e| invalid(format!("not a kubeconfig: {e}")))?;
        let base = path.parent().unwrap_or_else(|| Path::new("."));

        let current = doc["current-context"].as_str().unwrap_or_default();
        let context = doc["contexts"]
            .as_sequence()
            .and_then(|cs| cs.iter().find(|c| c["name"].as_str() == Some(current)))
            .map(|c| &c["context"]);
        let named = |list: &str, wanted: Option<&str>| -> Option<serde_yaml::Value> {
            let items = doc[list].as_sequence()?;
            match wanted {
                Some(name) => items
                    .iter()
                    .find(|i| i["name"].as_str() == Some(name))
                    .cloned(),
                None if items.len() == 1 => items.first().cloned(),
                None => None,
            }
        };
        let cluster = named("clusters", context.and_then(|c| c["cluster"].as_str()))
            .ok_or_else(|| invalid("no cluster for the current context".into()))?;
        let cluster = &cluster["cluster"];
        let user = named("users", context.and_then(|c| c["user"].as_str()));
        let user = user.as_ref().map(|u| &u["user"]);

        let server = cluster["server"]
            .as_str()
            .ok_or_else(|| invalid("the cluster has no server".into()))?;
        let url: http::Uri = server
            .parse()
            .map_err(|_| invalid(format!("invalid server URL {server:?}")))?;
        if url.scheme_str() != Some("https") {
            return Err(invalid(format!(
                "the webhook server must be an https:// URL, not {server:?}"
            )));
        }
        if cluster["insecure-skip-tls-verify"].as_bool() == Some(true) {
            return Err(invalid(
                "insecure-skip-tls-verify is not supported: give certificate-authority".into(),
            ));
        }
        let ca_pem = pem_field(cluster, "certificate-authority", base, path)?
            .ok_or_else(|| invalid("the cluster has no certificate-authority".into()))?;

        let mut roots = rustls::RootCertStore::empty();
        for cert in certs::parse_certs(&ca_pem).map_err(|e| invalid(e.to_string()))? {
            roots.add(cert).map_err(|e| invalid(e.to_string()))?;
        }
        let provider = Arc::new(rustls::crypto::aws_lc_rs::default_provider());
        let builder = rustls::ClientConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .map_err(|e| invalid(e.to_string()))?
            .with_root_certificates(roots);
        let (cert, key) = match user {
            Some(u) => (
                pem_field(u, "client-certificate", base, path)?,
                pem_field(u, "client-key", base, path)?,
            ),
            None => (None, None),
        };
        let tls = match (cert, key) {
            (Some(cert), Some(key)) => {
                let chain = certs::parse_certs(&cert).map_err(|e| invalid(e.to_string()))?;
                let key = certs::parse_key(&key).map_err(|e| invalid(e.to_string()))?;
                builder
                    .with_client_auth_cert(chain, key)
                    .map_err(|e| invalid(format!("unusable client certificate: {e}")))?
            }
            (None, None) => builder.with_no_client_auth(),
            _ => {
                return Err(invalid(
                    "client-certificate and client-key must be given together".into(),
                ));
            }
        };
        let bearer = match user {
            Some(u) => match (u["token"].as_str(), u["tokenFile"].as_str()) {
                (Some(t), _) => Some(t.to_string()),
                (None, Some(file)) => {
                    let file = resolve(base, file);
                    let t = std::fs::read_to_string(&file)
                        .map_err(|source| WebhookError::Read { path: file, source })?;
                    Some(t.trim().to_string())
                }
                (None, None) => None,
            },
            None => None,
        };
        let connector = hyper_rustls::HttpsConnectorBuilder::new()
            .with_tls_config(tls)
            .https_only()
            .enable_http1()
            .enable_http2()
            .build();
        let http = Client::builder(TokioExecutor::new())
            .pool_idle_timeout(Duration::from_secs(90))
            .build(connector);
        Ok(WebhookClient { url, bearer, http })
    }

    /// The webhook's URL.
    pub fn url(&self) -> String {
        self.url.to_string()
    }

    /// POSTs `body` as JSON and returns the JSON answer; any status but 200/201 is an error.
    pub async fn post(&self, body: &Value, timeout: Duration) -> Result<Value, WebhookError> {
        let fail = |message: String| WebhookError::Call {
            url: self.url.to_string(),
            message,
        };
        let bytes = serde_json::to_vec(body).map_err(|e| fail(e.to_string()))?;
        let mut request = http::Request::post(self.url.clone())
            .header(http::header::CONTENT_TYPE, "application/json")
            .header(http::header::ACCEPT, "application/json");
        if let Some(token) = &self.bearer {
            request = request.header(http::header::AUTHORIZATION, format!("Bearer {token}"));
        }
        let request = request
            .body(Full::new(Bytes::from(bytes)))
            .map_err(|e| fail(e.to_string()))?;
        let work = async {
            let response = self
                .http
                .request(request)
                .await
                .map_err(|e| fail(error_chain(&e)))?;
            let status = response.status();
            let body = Limited::new(response.into_body(), MAX_ANSWER)
                .collect()
                .await
                .map_err(|e| fail(format!("reading the answer: {e}")))?
                .to_bytes();
            if !status.is_success() {
                let text: String = String::from_utf8_lossy(&body).chars().take(300).collect();
                return Err(fail(format!("HTTP {status}: {text}")));
            }
            serde_json::from_slice(&body).map_err(|e| fail(format!("malformed answer: {e}")))
        };
        tokio::time::timeout(timeout, work)
            .await
            .map_err(|_| fail(format!("no answer within {timeout:?}")))?
    }
}

/// A PEM value given inline (`NAME-data`, base64) or as a file (`NAME`, relative to `base`).
fn pem_field(
    section: &serde_yaml::Value,
    name: &str,
    base: &Path,
    config: &Path,
) -> Result<Option<Vec<u8>>, WebhookError> {
    use base64::Engine as _;
    if let Some(data) = section[format!("{name}-data").as_str()].as_str() {
        return base64::engine::general_purpose::STANDARD
            .decode(data.trim())
            .map(Some)
            .map_err(|e| WebhookError::Config {
                path: config.to_path_buf(),
                message: format!("{name}-data is not base64: {e}"),
            });
    }
    match section[name].as_str() {
        Some(file) => {
            let file = resolve(base, file);
            std::fs::read(&file)
                .map(Some)
                .map_err(|source| WebhookError::Read { path: file, source })
        }
        None => Ok(None),
    }
}

fn resolve(base: &Path, file: &str) -> PathBuf {
    let p = Path::new(file);
    if p.is_absolute() {
        p.to_path_buf()
    } else {
        base.join(p)
    }
}

fn error_chain(e: &dyn std::error::Error) -> String {
    let mut message = e.to_string();
    let mut source = e.source();
    while let Some(cause) = source {
        let text = cause.to_string();
        if !message.contains(&text) {
            message.push_str(": ");
            message.push_str(&text);
        }
        source = cause.source();
    }
    message
}

/// Writes a webhook kubeconfig for `url`, trusting `ca_file` and presenting `client_cert_file`/`client_key_file`
/// (paths written as given), in the shape of `deploy/guard/authn-webhook.kubeconfig`.
pub fn write_kubeconfig(
    path: &Path,
    url: &str,
    ca_file: &Path,
    client_cert_file: &Path,
    client_key_file: &Path,
) -> Result<(), WebhookError> {
    let doc = serde_json::json!({
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "tether-guard", "cluster": {
            "certificate-authority": ca_file.display().to_string(),
            "server": url,
        }}],
        "users": [{"name": "kube-apiserver", "user": {
            "client-certificate": client_cert_file.display().to_string(),
            "client-key": client_key_file.display().to_string(),
        }}],
        "contexts": [{"name": "webhook", "context": {"cluster": "tether-guard", "user": "kube-apiserver"}}],
        "current-context": "webhook",
    });
    let text = serde_yaml::to_string(&doc).map_err(|e| WebhookError::Config {
        path: path.to_path_buf(),
        message: e.to_string(),
    })?;
    std::fs::write(path, text).map_err(|source| WebhookError::Read {
        path: path.to_path_buf(),
        source,
    })
}

/// The authorization configuration shipped in `deploy/guard/` (Node → guard → RBAC, its TTLs, match conditions
/// and failure policy); [`write_guard_configs`] points its kubeconfig path at local files.
pub const SHIPPED_AUTHORIZATION_CONFIG: &str =
    include_str!("../../deploy/guard/authorization-config.yaml");

/// The files [`write_guard_configs`] wrote.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GuardConfigs {
    /// The TokenReview webhook kubeconfig (`SampleOptions::authn_webhook`).
    pub authn_webhook: PathBuf,
    /// The authorization configuration (`SampleOptions::authz_config`).
    pub authz_config: PathBuf,
}

/// Writes what a (sample) apiserver needs to call tether-guard at `guard_base` (`https://HOST:PORT`), in the
/// shape of `deploy/guard/`: `guard-ca.crt` (trusted for guard's certificate), `apiserver-client.crt`/`.key` (the
/// client certificate guard requires), `authn-webhook.kubeconfig` (→ `/authenticate`), `authz-webhook.kubeconfig`
/// (→ `/authorize`) and `authorization-config.yaml` (the shipped one, with its kubeconfig path pointing here).
pub fn write_guard_configs(
    dir: &Path,
    guard_base: &str,
    guard_ca_pem: &str,
    client: &certs::CertifiedPem,
) -> Result<GuardConfigs, WebhookError> {
    let io = |path: &Path| {
        let path = path.to_path_buf();
        move |source| WebhookError::Read { path, source }
    };
    std::fs::create_dir_all(dir).map_err(io(dir))?;
    let ca = dir.join("guard-ca.crt");
    let cert = dir.join("apiserver-client.crt");
    let key = dir.join("apiserver-client.key");
    std::fs::write(&ca, guard_ca_pem).map_err(io(&ca))?;
    std::fs::write(&cert, &client.cert_pem).map_err(io(&cert))?;
    certs::write_pem(&key, &client.key_pem).map_err(|e| WebhookError::Config {
        path: key.clone(),
        message: e.to_string(),
    })?;
    let base = guard_base.trim_end_matches('/');
    let authn = dir.join("authn-webhook.kubeconfig");
    let authz = dir.join("authz-webhook.kubeconfig");
    write_kubeconfig(&authn, &format!("{base}/authenticate"), &ca, &cert, &key)?;
    write_kubeconfig(&authz, &format!("{base}/authorize"), &ca, &cert, &key)?;

    let config_path = dir.join("authorization-config.yaml");
    let invalid = |message: String| WebhookError::Config {
        path: config_path.clone(),
        message,
    };
    let mut config: serde_yaml::Value = serde_yaml::from_str(SHIPPED_AUTHORIZATION_CONFIG)
        .map_err(|e| invalid(format!("the shipped authorization config: {e}")))?;
    let authorizers = config["authorizers"]
        .as_sequence_mut()
        .ok_or_else(|| invalid("the shipped authorization config has no authorizers".into()))?;
    for a in authorizers.iter_mut() {
        if a["type"].as_str() == Some("Webhook") {
            a["webhook"]["connectionInfo"]["kubeConfigFile"] =
                serde_yaml::Value::String(authz.display().to_string());
        }
    }
    let text = serde_yaml::to_string(&config).map_err(|e| invalid(e.to_string()))?;
    std::fs::write(&config_path, text).map_err(io(&config_path))?;
    Ok(GuardConfigs {
        authn_webhook: authn,
        authz_config: config_path,
    })
}
