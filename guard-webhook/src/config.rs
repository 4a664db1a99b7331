//! The `tether-guard` program's configuration: flags with environment variables, validated (files read, settings
//! checked) before any port is bound.

use std::future::Future;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

use tether_runtime::{Secret, parse_duration};

use crate::audit::AuditSink;
use crate::engine::{Guard, GuardOptions};
use crate::server::{Callers, Limits, ServeError, ServerConfig, pem_certs, server_tls_for};
use crate::snapshot::SnapshotStore;
use tether_auth::jwks::HttpsFetcher;
use tether_auth::token::{
    Algorithm, Authenticator, DEFAULT_V1_AUTHORITY, DEFAULT_V2_AUTHORITY, TokenConfig,
};

/// Flags of `tether-guard` (the binary flattens them into its command line; every default is written here,
/// once).
#[derive(Clone, Debug, clap::Args)]
pub struct Config {
    /// Address to listen on.
    #[arg(long, env = "TETHER_GUARD_LISTEN", default_value = "0.0.0.0:8443")]
    pub listen: SocketAddr,
    /// Server certificate chain (PEM).
    #[arg(long, env = "TETHER_GUARD_TLS_CERT")]
    pub tls_cert: PathBuf,
    /// Server private key (PEM).
    #[arg(long, env = "TETHER_GUARD_TLS_KEY")]
    pub tls_key: PathBuf,
    /// CA that issued the apiserver's client certificate (PEM); required on the webhook paths. May hold several
    /// CAs. The agent's push certificate has its own CA: --snapshot-client-ca.
    #[arg(long, env = "TETHER_GUARD_CLIENT_CA")]
    pub client_ca: PathBuf,
    /// Subject common names allowed to call /authenticate and /authorize (repeat or comma-separate); the
    /// apiserver's client certificate in deploy/guard/ is `kube-apiserver`.
    #[arg(
        long = "client-cn",
        env = "TETHER_GUARD_CLIENT_CN",
        value_delimiter = ',',
        default_value = crate::server::DEFAULT_WEBHOOK_SUBJECT
    )]
    pub client_cn: Vec<String>,
    /// When set, PUT/GET /snapshot also needs a client certificate with one of these subject common names,
    /// besides the push token: the agent's push certificate (the Helm chart's is `tether-agent`).
    #[arg(
        long = "snapshot-client-cn",
        env = "TETHER_GUARD_SNAPSHOT_CLIENT_CN",
        value_delimiter = ','
    )]
    pub snapshot_client_cn: Vec<String>,
    /// CA certificate(s) (PEM) of the agent's push certificate, used for nothing else: PUT/GET /snapshot then
    /// needs a certificate issued directly by one of them (with a --snapshot-client-cn subject, required with
    /// this flag), and their certificates open no other path. Must not be a --client-ca certificate.
    #[arg(
        long,
        env = "TETHER_GUARD_SNAPSHOT_CLIENT_CA",
        requires = "snapshot_client_cn"
    )]
    pub snapshot_client_ca: Option<PathBuf>,
    /// Extra subject common names allowed to read /metrics on the webhook port (e.g. a Prometheus certificate).
    #[arg(
        long = "metrics-client-cn",
        env = "TETHER_GUARD_METRICS_CLIENT_CN",
        value_delimiter = ','
    )]
    pub metrics_client_cn: Vec<String>,
    /// Also serve /metrics and /healthz in plain HTTP, without a certificate, on this address (keep it on
    /// loopback, e.g. 127.0.0.1:9443). Off by default: /metrics then needs a client certificate.
    #[arg(long, env = "TETHER_GUARD_METRICS_LISTEN")]
    pub metrics_listen: Option<SocketAddr>,
    /// Serve /metrics on the webhook port to anyone, without a certificate (weakens guard; not advised).
    #[arg(long, env = "TETHER_GUARD_DANGER_PUBLIC_METRICS")]
    pub danger_public_metrics: bool,
    /// Accepted tenant ids (repeat or comma-separate). Without tenants and audiences, guard only authorizes.
    #[arg(long = "tenant", env = "TETHER_GUARD_TENANTS", value_delimiter = ',')]
    pub tenants: Vec<String>,
    /// Accepted token audiences (repeat or comma-separate); required with tenants.
    #[arg(
        long = "audience",
        env = "TETHER_GUARD_AUDIENCES",
        value_delimiter = ','
    )]
    pub audiences: Vec<String>,
    /// Accepted signature algorithms: RS256, ES256.
    #[arg(
        long = "algorithm",
        env = "TETHER_GUARD_ALGORITHMS",
        value_delimiter = ',',
        default_value = "RS256"
    )]
    pub algorithms: Vec<String>,
    /// Clock-skew leeway for exp/nbf (at most 60s; a bare number is seconds).
    #[arg(
        long,
        alias = "leeway-seconds",
        env = "TETHER_GUARD_LEEWAY_SECONDS",
        default_value = "30s",
        value_parser = parse_duration
    )]
    pub leeway: Duration,
    /// Base URL of v2 issuers and of discovery documents.
    #[arg(long, env = "TETHER_GUARD_AUTHORITY", default_value = DEFAULT_V2_AUTHORITY)]
    pub authority: String,
    /// Base URL of v1 issuers.
    #[arg(long, env = "TETHER_GUARD_V1_AUTHORITY", default_value = DEFAULT_V1_AUTHORITY)]
    pub v1_authority: String,
    /// CA certificates (PEM) to trust when fetching discovery documents and keys, instead of the public roots.
    #[arg(long, env = "TETHER_GUARD_AUTHORITY_CA")]
    pub authority_ca: Option<PathBuf>,
    /// Tokens longer than this many bytes are refused unparsed.
    #[arg(long, env = "TETHER_GUARD_MAX_TOKEN_BYTES", default_value_t = tether_auth::token::DEFAULT_MAX_TOKEN_BYTES)]
    pub max_token_bytes: usize,
    /// Put before every username a token yields (like kube-apiserver's --oidc-username-prefix); default none.
    /// Usernames and groups starting with "system:" are refused whatever the prefixes.
    #[arg(long, env = "TETHER_GUARD_USERNAME_PREFIX", default_value = "")]
    pub username_prefix: String,
    /// Put before every group a token yields (like --oidc-groups-prefix); default none. Guard also removes it
    /// when authorizing, and ignores groups without it.
    #[arg(long, env = "TETHER_GUARD_GROUPS_PREFIX", default_value = "")]
    pub groups_prefix: String,
    /// Where the last-known-good RBAC snapshot is kept.
    #[arg(long, env = "TETHER_GUARD_SNAPSHOT_FILE")]
    pub snapshot_file: PathBuf,
    /// File holding the bearer token allowed to PUT /snapshot; without it the endpoint is off.
    #[arg(long, env = "TETHER_GUARD_SNAPSHOT_PUSH_TOKEN_FILE")]
    pub snapshot_push_token_file: Option<PathBuf>,
    /// How long an authorization decision is cached (0: no cache; a bare number is seconds).
    #[arg(
        long,
        alias = "cache-ttl-seconds",
        env = "TETHER_GUARD_CACHE_TTL_SECONDS",
        default_value = "60s",
        value_parser = parse_duration
    )]
    pub cache_ttl: Duration,
    /// Audit log file (one JSON line per decision); `-` for standard output.
    #[arg(long, env = "TETHER_GUARD_AUDIT_LOG")]
    pub audit_log: Option<PathBuf>,
    /// The namespace the Tether agent runs in: only Cluster Admins may read its Secrets or do anything but read
    /// there (tokens for its service account, exec/attach/port-forward/proxy into its pods, new pods, edits).
    /// Empty turns the protection off.
    #[arg(
        long,
        env = "TETHER_GUARD_AGENT_NAMESPACE",
        default_value = "tether-system"
    )]
    pub agent_namespace: String,
}

/// A configuration that cannot be used (the program exits 64).
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// A file could not be read.
    #[error("cannot read {path}: {source}")]
    Read {
        /// The file.
        path: String,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
    /// A setting is invalid.
    #[error("{0}")]
    Invalid(String),
}

/// Everything [`Config::load`] built.
#[derive(Debug)]
pub struct Loaded {
    /// The engine.
    pub guard: Arc<Guard>,
    /// The server settings.
    pub server: ServerConfig,
    /// Where to listen.
    pub listen: SocketAddr,
    /// Where to serve plain-HTTP metrics, if anywhere.
    pub metrics_listen: Option<SocketAddr>,
}

fn read(path: &PathBuf) -> Result<Vec<u8>, ConfigError> {
    std::fs::read(path).map_err(|source| ConfigError::Read {
        path: path.display().to_string(),
        source,
    })
}

fn names(list: &[String]) -> Vec<String> {
    list.iter()
        .map(|n| n.trim().to_owned())
        .filter(|n| !n.is_empty())
        .collect()
}

impl Config {
    /// Reads every file and checks every setting; binds nothing.
    pub fn load(&self) -> Result<Loaded, ConfigError> {
        let invalid = |e: &dyn std::fmt::Display| ConfigError::Invalid(e.to_string());
        let snapshot_cas = match &self.snapshot_client_ca {
            Some(path) => {
                if names(&self.snapshot_client_cn).is_empty() {
                    return Err(ConfigError::Invalid(
                        "--snapshot-client-ca needs --snapshot-client-cn (the push certificate's subject)"
                            .to_owned(),
                    ));
                }
                pem_certs(&read(path)?, "snapshot client CA").map_err(|e| invalid(&e))?
            }
            None => Vec::new(),
        };
        let callers = Callers {
            webhook_subjects: names(&self.client_cn),
            snapshot_subjects: names(&self.snapshot_client_cn),
            snapshot_cas,
            metrics_subjects: names(&self.metrics_client_cn),
            public_metrics: self.danger_public_metrics,
        };
        let tls = server_tls_for(
            &read(&self.tls_cert)?,
            &read(&self.tls_key)?,
            &read(&self.client_ca)?,
            &callers,
        )
        .map_err(|e| invalid(&e))?;
        if names(&self.client_cn).is_empty() {
            return Err(ConfigError::Invalid(
                "--client-cn needs at least one subject (the apiserver's client certificate)"
                    .to_owned(),
            ));
        }
        for prefix in [&self.username_prefix, &self.groups_prefix] {
            if prefix.to_ascii_lowercase().starts_with("system:") {
                return Err(ConfigError::Invalid(
                    "--username-prefix and --groups-prefix must not start with \"system:\""
                        .to_owned(),
                ));
            }
        }
        let authenticator = if self.tenants.is_empty() && self.audiences.is_empty() {
            None
        } else {
            let mut token = TokenConfig::new(self.tenants.clone(), self.audiences.clone());
            token.algorithms = self
                .algorithms
                .iter()
                .map(|a| a.parse::<Algorithm>())
                .collect::<Result<_, _>>()
                .map_err(|e| invalid(&e))?;
            token.leeway = self.leeway;
            token.v2_authority = self.authority.clone();
            token.v1_authority = self.v1_authority.clone();
            token.max_token_bytes = self.max_token_bytes;
            token.username_prefix = self.username_prefix.clone();
            token.groups_prefix = self.groups_prefix.clone();
            let ca = self.authority_ca.as_ref().map(read).transpose()?;
            let fetcher = HttpsFetcher::new(ca.as_deref()).map_err(|e| invalid(&e))?;
            Some(Arc::new(
                Authenticator::new(token, Arc::new(fetcher)).map_err(|e| invalid(&e))?,
            ))
        };
        let store = SnapshotStore::open(&self.snapshot_file).map_err(|e| invalid(&e))?;
        let push_token = match &self.snapshot_push_token_file {
            Some(p) => {
                let text = String::from_utf8(read(p)?)
                    .map_err(|_| ConfigError::Invalid(format!("{} is not text", p.display())))?;
                let token = text.trim().to_owned();
                if token.len() < 16 {
                    return Err(ConfigError::Invalid(format!(
                        "the snapshot push token in {} must be at least 16 characters",
                        p.display()
                    )));
                }
                Some(Secret::new(token))
            }
            None => None,
        };
        let audit = match &self.audit_log {
            None => AuditSink::Off,
            Some(p) if p.as_os_str() == "-" => AuditSink::Stdout,
            Some(p) => AuditSink::file(p).map_err(|source| ConfigError::Read {
                path: p.display().to_string(),
                source,
            })?,
        };
        let guard = Guard::new(
            authenticator,
            Arc::new(store),
            GuardOptions {
                cache_ttl: self.cache_ttl,
                audit,
                groups_prefix: self.groups_prefix.clone(),
                protection: tether_auth::rbac::Protection {
                    agent_namespace: Some(self.agent_namespace.trim().to_owned())
                        .filter(|ns| !ns.is_empty()),
                },
                ..GuardOptions::default()
            },
        );
        Ok(Loaded {
            guard: Arc::new(guard),
            server: ServerConfig {
                tls,
                limits: Limits {
                    callers,
                    ..Limits::default()
                },
                snapshot_push_token: push_token,
            },
            listen: self.listen,
            metrics_listen: self.metrics_listen,
        })
    }
}

impl Loaded {
    /// Binds the webhook listener (and the metrics one, when configured) and serves until `shutdown` resolves;
    /// what the `tether-guard` program runs.
    pub async fn serve(self, shutdown: impl Future<Output = ()> + Send) -> Result<(), ServeError> {
        let bind = |addr, purpose| async move {
            TcpListener::bind(addr)
                .await
                .map_err(|source| ServeError::Bind {
                    addr,
                    purpose,
                    source,
                })
        };
        let listener = bind(self.listen, "").await?;
        let stop = CancellationToken::new();
        let metrics = match self.metrics_listen {
            Some(addr) => {
                let listener = bind(addr, " for metrics").await?;
                let guard = self.guard.clone();
                let stopped = stop.clone().cancelled_owned();
                Some(tokio::spawn(async move {
                    if let Err(e) = crate::server::run_metrics(guard, listener, stopped).await {
                        tracing::error!(error = %e, "the metrics listener stopped");
                    }
                }))
            }
            None => None,
        };
        let shutdown = async move {
            shutdown.await;
            stop.cancel();
        };
        let result = crate::server::run(self.guard, self.server, listener, shutdown).await;
        if let Some(metrics) = metrics
            && metrics.await.is_err()
        {
            tracing::warn!("the metrics listener panicked");
        }
        result
    }
}
