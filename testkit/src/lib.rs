//! Test support for Tether: certificates ([`certs`]), a sample Kubernetes apiserver ([`SampleApiserver`], also the
//! `tether-sample-apiserver` binary and the demo cluster of `tether up`), and a harness for the real `kubectl`
//! binary ([`kubectl`]).
//!
//! The sample apiserver implements the part of the Kubernetes API our tests and the quickstart exercise, the way
//! kube-apiserver does where real clients (kubectl, kube-rs, python-kubernetes) look: bearer-token authentication
//! (static tokens, then a TokenReview webhook), authorization (AlwaysAllow, or a structured authorization
//! configuration with SubjectAccessReview webhooks and a tiny built-in RBAC, see [`authz`]), impersonation,
//! discovery, namespaces, nodes, pods and configmaps with CRUD, paging, selectors, patches and watches, pod logs,
//! and exec over WebSocket (`v5.channel.k8s.io` / `v4.channel.k8s.io`). It serves HTTPS only, HTTP/1.1 and h2.
//! [`dev_issuer`] is a development-only token issuer shaped like Entra ID, for the quickstart and tests.
//!
//! Also secrets, services, service accounts and events; `apps/v1` Deployments and ReplicaSets (with `scale` and
//! a trivial controller that makes their pods); RBAC objects (stored only); CustomResourceDefinitions whose
//! resources are served, discovered and listed; `kubectl port-forward` over SPDY/3.1
//! and over SPDY tunneled in a WebSocket (pod ports are answered by loopback servers: HTTP on 80, echo elsewhere);
//! `kubectl cp` (exec's `tar` is the machine's GNU tar confined to a scratch directory per pod) and `kubectl
//! attach`; SelfSubjectAccessReview/SelfSubjectRulesReview decided by the authorizer chain (`kubectl auth can-i`).
//!
//! What it does not do: persistence (everything lives in memory), CRD schemas, conversion and subresources (one
//! served version per CRD, objects stored as sent), aggregated discovery, admission, rolling updates, RBAC objects as an authorizer
//! (only [`RbacRule`]s added in code decide), real CEL, protobuf answers, exec over SPDY (kubectl ≥ 1.30 uses
//! WebSockets for exec). It is test support, never used by the relay or the agent.

pub mod auth;
pub mod authz;
mod body;
pub mod certs;
pub mod child;
mod controller;
mod custom;
pub mod dev_issuer;
mod exec;
mod flags;
mod handlers;
pub mod haproxy;
pub mod idp;
mod kinds;
pub mod kubectl;
mod logs;
pub mod netns;
mod objects;
mod openapi;
mod patch;
mod podfs;
mod podnet;
mod portforward;
pub mod postgres;
mod protobuf;
mod resources;
mod respond;
mod reviews;
mod selector;
mod server;
mod spdy;
mod state;
mod status;
mod store;
mod target;
pub mod tools;
mod tour;
pub mod traffic;
mod util;
pub mod wait;
pub mod webhook;

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use serde_json::json;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

pub use auth::User;
pub use authz::{RbacRule, Subject};
pub use flags::SampleFlags;
use resources::Resource;
use state::Shared;
pub use tour::{TOUR_USER, TourOptions, tour};

/// Why the sample apiserver (or a testkit helper) failed.
#[derive(Debug, thiserror::Error)]
pub enum TestkitError {
    /// Certificate generation or TLS configuration failed.
    #[error(transparent)]
    Certs(#[from] certs::CertError),
    /// The listen address could not be bound.
    #[error("cannot listen on {addr}: {source}")]
    Bind {
        /// The address.
        addr: SocketAddr,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
    /// A file in the state directory could not be written.
    #[error("cannot write {path}: {source}")]
    Write {
        /// The file.
        path: PathBuf,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
    /// The kubeconfig could not be rendered.
    #[error("cannot render kubeconfig: {0}")]
    Kubeconfig(#[from] serde_yaml::Error),
    /// A kubectl process could not be started or waited for.
    #[error("kubectl: {0}")]
    Kubectl(String),
    /// An object could not be created in the sample apiserver's store.
    #[error("cannot create the object: {0}")]
    Create(String),
    /// Something did not happen before its deadline.
    #[error("timed out: {0}")]
    Timeout(String),
    /// A webhook configuration (kubeconfig, authorization configuration) is unusable.
    #[error(transparent)]
    Webhook(#[from] webhook::WebhookError),
    /// The development issuer failed.
    #[error("development issuer: {0}")]
    Issuer(String),
}

/// The user name of the sample apiserver's agent identity (the `agent-kubeconfig` it writes): a service account
/// that the built-in RBAC lets do everything, impersonation included, as the agent's Helm chart binds it to
/// cluster-admin.
pub const AGENT_USER: &str = "system:serviceaccount:tether-system:tether-agent";

/// How to start a [`SampleApiserver`].
#[derive(Debug, Clone)]
pub struct SampleOptions {
    /// Where `kubeconfig`, `ca.pem` and `token` are written (created if missing).
    pub dir: PathBuf,
    /// The address to listen on; port 0 picks a free port.
    pub listen: SocketAddr,
    /// The bearer token of user `admin`; None generates a random one.
    pub token: Option<String>,
    /// A TokenReview webhook kubeconfig (`--authentication-token-webhook-config-file`), asked for tokens that are
    /// not static ones.
    pub authn_webhook: Option<PathBuf>,
    /// How long TokenReview answers are cached (`--authentication-token-webhook-cache-ttl`, default 2 min).
    pub authn_cache_ttl: Duration,
    /// A structured `AuthorizationConfiguration` (`--authorization-config`); None allows every authenticated
    /// request.
    pub authz_config: Option<PathBuf>,
    /// HTTP/2 `SETTINGS_MAX_CONCURRENT_STREAMS` per connection (`--http2-max-streams-per-connection`); 0 means
    /// kube-apiserver's default, [`DEFAULT_HTTP2_MAX_STREAMS`].
    pub http2_max_streams_per_connection: u32,
}

/// kube-apiserver's default HTTP/2 concurrent streams per connection (since the rapid-reset fixes).
pub const DEFAULT_HTTP2_MAX_STREAMS: u32 = 100;

impl SampleOptions {
    /// Options for a test: `dir`, `127.0.0.1:0`, a random token.
    pub fn new(dir: impl Into<PathBuf>) -> SampleOptions {
        SampleOptions {
            dir: dir.into(),
            listen: SocketAddr::new(IpAddr::V4(Ipv4Addr::LOCALHOST), 0),
            token: None,
            authn_webhook: None,
            authn_cache_ttl: auth::DEFAULT_AUTHN_CACHE_TTL,
            authz_config: None,
            http2_max_streams_per_connection: DEFAULT_HTTP2_MAX_STREAMS,
        }
    }
}

/// A running sample apiserver. Stops on [`SampleApiserver::shutdown`] or when dropped.
pub struct SampleApiserver {
    shared: Arc<Shared>,
    addr: SocketAddr,
    url: String,
    token: String,
    ca_pem: String,
    kubeconfig: PathBuf,
    agent_kubeconfig: PathBuf,
    shutdown: CancellationToken,
    tracker: TaskTracker,
}

impl std::fmt::Debug for SampleApiserver {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SampleApiserver")
            .field("url", &self.url)
            .field("token", &"***")
            .finish_non_exhaustive()
    }
}

impl SampleApiserver {
    /// Generates a CA and a serving certificate (SANs: localhost, 127.0.0.1, ::1 and the listen IP if it is not
    /// unspecified), loads the webhook configurations, binds, serves in background tasks, and writes
    /// `DIR/kubeconfig` (server URL, CA data embedded, user token), `DIR/agent-kubeconfig` (the same for
    /// [`AGENT_USER`]), `DIR/ca.pem` and `DIR/token`. Returns when ready to serve.
    pub async fn start(opts: SampleOptions) -> Result<SampleApiserver, TestkitError> {
        let authn = auth::Authenticator {
            tokens: auth::Tokens::default(),
            webhook: match &opts.authn_webhook {
                Some(path) => Some(auth::TokenWebhook::new(
                    webhook::WebhookClient::from_kubeconfig(path)?,
                    opts.authn_cache_ttl,
                )),
                None => None,
            },
        };
        let authz = match &opts.authz_config {
            Some(path) => authz::Authorizer::from_config(path)?,
            None => authz::Authorizer::always_allow(),
        };
        let ca = certs::Ca::new("tether-sample-apiserver-ca")?;
        let mut names = vec![
            "localhost".to_string(),
            "127.0.0.1".into(),
            "::1".into(),
            "kubernetes.default.svc".into(),
        ];
        let ip = opts.listen.ip();
        if !ip.is_unspecified() && !names.contains(&ip.to_string()) {
            names.push(ip.to_string());
        }
        let serving = ca.issue_server(&names)?;
        let tls = certs::server_config(
            vec![serving.cert_der(), ca.certified().cert_der()],
            serving.key_der(),
        )?;

        let (listener, addr) = bind(opts.listen).await?;
        let url_ip = if ip.is_unspecified() {
            IpAddr::V4(Ipv4Addr::LOCALHOST)
        } else {
            ip
        };
        let url = format!("https://{}", SocketAddr::new(url_ip, addr.port()));

        let token = opts.token.clone().unwrap_or_else(util::random_token);
        let shutdown = CancellationToken::new();
        let tracker = TaskTracker::new();
        let pod_network = podnet::PodNetwork::start(&shutdown, &tracker)
            .await
            .map_err(|source| TestkitError::Bind {
                addr: SocketAddr::new(IpAddr::V4(Ipv4Addr::LOCALHOST), 0),
                source,
            })?;
        let shared = Arc::new(Shared::new(
            addr,
            shutdown.clone(),
            tracker.clone(),
            authn,
            authz,
            pod_network,
            opts.dir.join("pods"),
        ));
        shared
            .authn
            .tokens
            .add(&token, auth::user("admin", &["system:masters"]));
        let agent_token = util::random_token();
        shared.authn.tokens.add(
            &agent_token,
            auth::user(
                AGENT_USER,
                &[
                    "system:serviceaccounts",
                    "system:serviceaccounts:tether-system",
                ],
            ),
        );
        shared
            .authz
            .rbac
            .add(RbacRule::everything(Subject::User(AGENT_USER.into())));

        let kubeconfig = write_state(&opts.dir, &url, ca.cert_pem(), &token)?;
        let agent_kubeconfig = opts.dir.join("agent-kubeconfig");
        write_kubeconfig(
            &agent_kubeconfig,
            &url,
            ca.cert_pem(),
            "tether-agent",
            &agent_token,
        )?;
        let max_streams = match opts.http2_max_streams_per_connection {
            0 => DEFAULT_HTTP2_MAX_STREAMS,
            n => n,
        };
        tracker.spawn(server::accept_loop(
            listener,
            tls,
            shared.clone(),
            max_streams,
        ));
        tracing::info!(%url, dir = %opts.dir.display(), "sample apiserver listening");
        Ok(SampleApiserver {
            shared,
            addr,
            url,
            token,
            ca_pem: ca.cert_pem().to_string(),
            kubeconfig,
            agent_kubeconfig,
            shutdown,
            tracker,
        })
    }

    /// The bound address (port 0 resolved).
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// `https://IP:PORT`: the listen IP, or 127.0.0.1 when listening on an unspecified address.
    pub fn url(&self) -> String {
        self.url.clone()
    }

    /// The bearer token of user `admin` (groups `system:masters`, `system:authenticated`).
    pub fn token(&self) -> &str {
        &self.token
    }

    /// The CA certificate (PEM) that signed the serving certificate.
    pub fn ca_pem(&self) -> &str {
        &self.ca_pem
    }

    /// `DIR/kubeconfig`.
    pub fn kubeconfig_path(&self) -> PathBuf {
        self.kubeconfig.clone()
    }

    /// `DIR/agent-kubeconfig`: the sample's agent identity ([`AGENT_USER`]), for a cluster agent that
    /// impersonates the users it authenticates.
    pub fn agent_kubeconfig_path(&self) -> PathBuf {
        self.agent_kubeconfig.clone()
    }

    /// Adds an identity: requests with bearer `token` act as `user` in `groups` (plus `system:authenticated`).
    pub fn add_token(&self, token: &str, user: &str, groups: &[&str]) {
        self.shared
            .authn
            .tokens
            .add(token, auth::user(user, groups));
    }

    /// Adds a rule to the built-in RBAC (used when the authorization configuration has an `RBAC` authorizer).
    pub fn allow(&self, rule: RbacRule) {
        self.shared.authz.rbac.add(rule);
    }

    /// How many requests came with a User-Agent whose product (the part before the first `/`) starts with
    /// `prefix`, e.g. `kubectl`.
    pub fn requests_with_user_agent(&self, prefix: &str) -> u64 {
        self.shared
            .user_agents
            .lock()
            .map(|agents| {
                agents
                    .iter()
                    .filter(|(product, _)| product.starts_with(prefix))
                    .map(|(_, n)| n)
                    .sum()
            })
            .unwrap_or(0)
    }

    /// How many TokenReview webhook calls were made (answers not in the cache).
    pub fn token_reviews(&self) -> u64 {
        self.shared.authn.webhook_calls()
    }

    /// How many SubjectAccessReview webhook calls were made (answers not in the cache).
    pub fn access_reviews(&self) -> u64 {
        self.shared.authz.webhook_calls()
    }

    /// Creates `count` configmaps named `{prefix}{i}` (i from 0) in `namespace` directly in the store (creating
    /// the namespace if needed); fast seeding for list and paging tests. Existing names are left alone.
    pub fn create_configmaps(&self, namespace: &str, prefix: &str, count: usize) {
        let store = &self.shared.store;
        if !store.exists(Resource::Namespaces, "", namespace) {
            let ns =
                json!({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": namespace}});
            if let Err(e) = objects::create_object(store, Resource::Namespaces, ns) {
                tracing::warn!(namespace, error = %e.message, "cannot create namespace for seeding");
                return;
            }
        }
        for i in 0..count {
            let cm = json!({
                "apiVersion": "v1",
                "kind": "ConfigMap",
                "metadata": {"name": format!("{prefix}{i}"), "namespace": namespace, "labels": {"seeded": "true"}},
                "data": {"index": i.to_string()},
            });
            match objects::create_object(store, Resource::ConfigMaps, cm) {
                Ok(_) => {}
                Err(e) if e.reason == "AlreadyExists" => {}
                Err(e) => {
                    tracing::warn!(namespace, error = %e.message, "cannot seed configmap");
                    return;
                }
            }
        }
    }

    /// How many requests reached the server (authenticated or not).
    pub fn requests_seen(&self) -> u64 {
        self.shared
            .requests
            .load(std::sync::atomic::Ordering::Relaxed)
    }

    /// How many requests reached the server with no bearer token or an unknown one (each answered 401).
    pub fn unauthenticated_requests(&self) -> u64 {
        self.shared
            .unauthenticated
            .load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Adds a Ready node named `name` with `cpu` and `memory` (Kubernetes quantities such as `"8"`, `"500m"`,
    /// `"16Gi"`) as capacity and allocatable, the standard hostname/os/arch labels plus `labels`, and
    /// `provider_id` as `spec.providerID` (none when empty). Watchers of nodes see it as ADDED. Fails if a node of
    /// that name exists.
    pub fn add_node(
        &self,
        name: &str,
        cpu: &str,
        memory: &str,
        labels: &[(&str, &str)],
        provider_id: &str,
    ) -> Result<(), TestkitError> {
        let node = resources::node(name, cpu, memory, labels, provider_id);
        objects::create_object(&self.shared.store, Resource::Nodes, node)
            .map(|_| ())
            .map_err(|e| TestkitError::Create(e.message))
    }

    /// Stops accepting, ends every connection and stream, and waits for the background tasks.
    pub async fn shutdown(self) {
        self.shutdown.cancel();
        self.tracker.close();
        self.tracker.wait().await;
        tracing::info!(url = %self.url, "sample apiserver stopped");
    }
}

impl Drop for SampleApiserver {
    fn drop(&mut self) {
        self.shutdown.cancel();
    }
}

/// Binds `listen`; returns the listener and its address (port 0 resolved).
async fn bind(listen: SocketAddr) -> Result<(tokio::net::TcpListener, SocketAddr), TestkitError> {
    let bind_error = |source| TestkitError::Bind {
        addr: listen,
        source,
    };
    let listener = tokio::net::TcpListener::bind(listen)
        .await
        .map_err(bind_error)?;
    let addr = listener.local_addr().map_err(bind_error)?;
    Ok((listener, addr))
}

/// Writes `ca.pem`, `token` and `kubeconfig` into `dir`; returns the kubeconfig path.
fn write_state(
    dir: &std::path::Path,
    url: &str,
    ca_pem: &str,
    token: &str,
) -> Result<PathBuf, TestkitError> {
    std::fs::create_dir_all(dir).map_err(|source| TestkitError::Write {
        path: dir.to_path_buf(),
        source,
    })?;
    write_file(&dir.join("ca.pem"), ca_pem.as_bytes())?;
    write_file(&dir.join("token"), format!("{token}\n").as_bytes())?;
    let kubeconfig = dir.join("kubeconfig");
    write_kubeconfig(&kubeconfig, url, ca_pem, "admin", token)?;
    Ok(kubeconfig)
}

/// Writes a kubeconfig for `url` (CA data embedded) whose user `user_name` has bearer `token`.
fn write_kubeconfig(
    path: &std::path::Path,
    url: &str,
    ca_pem: &str,
    user_name: &str,
    token: &str,
) -> Result<(), TestkitError> {
    use base64::Engine as _;
    let kubeconfig = json!({
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "tether-sample", "cluster": {
            "server": url,
            "certificate-authority-data": base64::engine::general_purpose::STANDARD.encode(ca_pem),
        }}],
        "users": [{"name": user_name, "user": {"token": token}}],
        "contexts": [{"name": "tether-sample", "context": {"cluster": "tether-sample", "user": user_name, "namespace": "default"}}],
        "current-context": "tether-sample",
        "preferences": {},
    });
    let text = serde_yaml::to_string(&kubeconfig)?;
    write_file(path, text.as_bytes())
}

fn write_file(path: &std::path::Path, bytes: &[u8]) -> Result<(), TestkitError> {
    certs::write_private(path, bytes).map_err(|e| match e {
        certs::CertError::Io { source, .. } => TestkitError::Write {
            path: path.to_path_buf(),
            source,
        },
        other => TestkitError::Certs(other),
    })
}
