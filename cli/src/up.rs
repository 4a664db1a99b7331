//! `tether up`: a relay, a connected cluster and a kubeconfig on one machine — and the harness the end-to-end
//! tests drive, so the quickstart and the tests wire the pieces the same way.
//!
//! Layout of the directory:
//! `relay/` (the relay's data dir: SQLite, generated CAs and certificate, admin token), `agent/` (the agent's state
//! dir: its identity, `identity.json` and `identity-key.pem`), `sample-apiserver/` (only without `--kubeconfig`;
//! `webhooks/` holds its guard webhook configs), `kubeconfig` (for kubectl, through the relay) and `config.json`
//! (for the other `tether` commands).
//!
//! With the sample apiserver (and without `--no-guard`), guard is wired in the way a real cluster would have it:
//! `dev-issuer/` is a DEVELOPMENT-ONLY Entra-shaped token issuer (`tether token` mints with its key), `guard/` is
//! tether-guard's state (its certificate, client CA, push token, last snapshot, audit log). Guard runs in process
//! on its own HTTPS port; the sample apiserver calls it for TokenReview and SubjectAccessReview with a client
//! certificate; the relay and the agent validate the issuer's tokens (tenant, audience, authority); the agent
//! impersonates the users it validated and pushes the relay's RBAC snapshots to guard's `/snapshot`.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
#[cfg(feature = "quickstart")]
use std::sync::Arc;
use std::time::{Duration, Instant};

use tether_runtime::Secret;
#[cfg(feature = "quickstart")]
use tether_testkit::dev_issuer::{DEV_AUDIENCE, DEV_TENANT, DevIssuer};
#[cfg(feature = "quickstart")]
use tether_testkit::{SampleApiserver, SampleOptions, certs};
use tokio::sync::oneshot;
use tokio::task::JoinHandle;

use crate::args::UpArgs;
use crate::client::{ClientError, RelayClient};
use crate::config::ConfigFile;
use crate::kubeconfig::{self, KubeconfigSpec};

/// Without the development issuer there are no development tokens: no audience or tenant to configure.
#[cfg(not(feature = "quickstart"))]
const DEV_AUDIENCE: &str = "";
#[cfg(not(feature = "quickstart"))]
const DEV_TENANT: &str = "";

/// What `tether up` says when asked for a piece this build left out.
#[cfg(not(feature = "quickstart"))]
pub const WITHOUT_QUICKSTART: &str = "built without the quickstart feature (no sample apiserver, no development \
     issuer); use --kubeconfig with a real cluster's kubeconfig";

/// Why the quickstart failed.
#[derive(Debug, thiserror::Error)]
pub enum UpError {
    /// A bad option.
    #[error("{0}")]
    Config(String),
    /// A file or directory could not be written.
    #[error("{path}: {source}")]
    Io {
        /// The path.
        path: PathBuf,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
    /// The sample apiserver failed to start.
    #[error("cannot start the sample apiserver: {0}")]
    Sample(String),
    /// The relay failed.
    #[error("relay: {0}")]
    Relay(String),
    /// The agent failed.
    #[error("agent: {0}")]
    Agent(String),
    /// Talking to the relay failed.
    #[error(transparent)]
    Client(#[from] ClientError),
    /// Writing the kubeconfig failed.
    #[error(transparent)]
    Kubeconfig(#[from] kubeconfig::KubeconfigError),
    /// The agent did not connect in time.
    #[error("the agent did not connect within {0:?}")]
    NotConnected(Duration),
    /// Guard or the development issuer failed to start.
    #[error("guard: {0}")]
    Guard(String),
    /// The local fleet's PostgreSQL could not be found or started.
    #[error("PostgreSQL: {0}")]
    Postgres(String),
    /// The local fleet's load balancer (HAProxy) could not be found or started.
    #[error("load balancer: {0}")]
    LoadBalancer(String),
    /// A program the local fleet runs as a process is missing.
    #[error("{0}")]
    MissingProgram(String),
    /// A relay replica of the local fleet failed to start, stop or answer.
    #[error("relay replica {id}: {message}")]
    Replica {
        /// The replica's id.
        id: String,
        /// What went wrong (with the end of its log).
        message: String,
    },
}

/// Where `tether up` keeps the development issuer (under its directory); `tether token` reads it.
pub const DEV_ISSUER_DIR: &str = "dev-issuer";
/// Where `tether up` keeps guard's state (under its directory).
pub const GUARD_DIR: &str = "guard";

impl UpError {
    /// True for errors in the user's options.
    pub fn is_config(&self) -> bool {
        matches!(self, UpError::Config(_))
    }
}

/// What to start.
#[derive(Debug, Clone)]
pub struct UpOptions {
    /// Directory for all state.
    pub dir: PathBuf,
    /// A real cluster's kubeconfig; None starts the sample apiserver.
    pub kubeconfig: Option<PathBuf>,
    /// Cluster name at the relay.
    pub cluster: String,
    /// Relay listen address (port 0 picks a free port).
    pub listen: SocketAddr,
    /// Extra names for the relay's generated certificate.
    pub extra_hostnames: Vec<String>,
    /// Tags given to the cluster when it is registered.
    pub tags: BTreeMap<String, String>,
    /// The relay's heartbeat interval (whole seconds); `None` keeps the relay's default (30 s).
    pub heartbeat_interval: Option<Duration>,
    /// The relay's offline threshold; `None` keeps the relay's default (15 min).
    pub offline_threshold: Option<Duration>,
    /// Validity of the identities the relay issues; `None` keeps the relay's default (90 days).
    pub identity_validity: Option<Duration>,
    /// The newest agent version the relay offers; `None` keeps the relay's default (its own version).
    pub latest_agent_version: Option<String>,
    /// Wire in guard and the development token issuer (only with the sample apiserver).
    pub guard: bool,
    /// The audience Entra-style tokens must carry (relay, agent and guard).
    pub audience: String,
}

impl UpOptions {
    /// Options for tests: a fresh directory, the sample apiserver, a free port, the relay's default lifecycle
    /// settings (set the `Option` fields for short ones).
    pub fn for_tests(dir: &Path) -> Self {
        Self {
            dir: dir.to_path_buf(),
            kubeconfig: None,
            cluster: "demo".into(),
            listen: SocketAddr::from(([127, 0, 0, 1], 0)),
            extra_hostnames: Vec::new(),
            tags: BTreeMap::new(),
            heartbeat_interval: None,
            offline_threshold: None,
            identity_validity: None,
            latest_agent_version: None,
            guard: true,
            audience: DEV_AUDIENCE.to_string(),
        }
    }
}

impl From<UpArgs> for UpOptions {
    fn from(args: UpArgs) -> Self {
        Self {
            dir: args.dir,
            kubeconfig: args.kubeconfig,
            cluster: args.cluster,
            listen: args.listen,
            extra_hostnames: vec![],
            tags: BTreeMap::new(),
            heartbeat_interval: args.heartbeat_interval,
            offline_threshold: args.offline_threshold,
            identity_validity: args.identity_validity,
            latest_agent_version: args.latest_agent_version,
            guard: !args.no_guard,
            audience: DEV_AUDIENCE.to_string(),
        }
    }
}

struct Running<E> {
    shutdown: oneshot::Sender<()>,
    join: JoinHandle<Result<(), E>>,
}

impl<E: std::fmt::Display> Running<E> {
    async fn stop(self) -> Result<(), String> {
        let _ = self.shutdown.send(());
        match self.join.await {
            Ok(Ok(())) => Ok(()),
            Ok(Err(e)) => Err(e.to_string()),
            Err(e) => Err(format!("task failed: {e}")),
        }
    }
}

/// A running quickstart.
pub struct Up {
    options: UpOptions,
    /// The relay's address.
    pub relay_addr: SocketAddr,
    /// The relay's URL.
    pub relay_url: String,
    /// The relay's CA (PEM).
    pub ca_pem: String,
    /// The relay's admin token.
    pub admin_token: Secret,
    /// The kubeconfig for kubectl through the relay.
    pub kubeconfig_path: PathBuf,
    /// The config file for `tether` commands.
    pub config_path: PathBuf,
    /// The bearer token the kubeconfig carries (passed through to the cluster).
    pub user_token: Option<String>,
    /// The sample apiserver, when no kubeconfig was given.
    #[cfg(feature = "quickstart")]
    pub sample: Option<SampleApiserver>,
    /// The DEVELOPMENT-ONLY token issuer, when guard is wired in.
    #[cfg(feature = "quickstart")]
    pub issuer: Option<DevIssuer>,
    #[cfg(feature = "quickstart")]
    guard: Option<GuardRuntime>,
    entra: Option<Entra>,
    cluster_kubeconfig: PathBuf,
    relay: Option<Running<tether_relay::RelayError>>,
    agent: Option<Running<tether_agent::AgentError>>,
}

#[cfg(feature = "quickstart")]
/// tether-guard in process: its engine, where it listens, and what the agent needs to push to it.
pub(crate) struct GuardRuntime {
    pub(crate) guard: Arc<tether_guard::Guard>,
    addr: SocketAddr,
    server: tether_guard::ServerConfig,
    push_token: tether_runtime::Secret,
    pub(crate) dir: PathBuf,
    issuer_authority: String,
    issuer_ca: Vec<u8>,
    audience: String,
    running: Option<Running<tether_guard::server::ServeError>>,
}

/// The subject of the agent's snapshot push certificate (guard's `--snapshot-client-cn`), as the Helm chart's.
#[cfg(feature = "quickstart")]
const PUSH_SUBJECT: &str = "tether-agent";

#[cfg(feature = "quickstart")]
impl GuardRuntime {
    /// Makes guard's certificate and the apiserver's client certificate, opens the snapshot file, binds, serves.
    /// Returns guard and the apiserver's client certificate.
    async fn start(
        dir: &Path,
        issuer: &DevIssuer,
        audience: &str,
    ) -> Result<(GuardRuntime, certs::CertifiedPem), UpError> {
        let err = |e: &dyn std::fmt::Display| UpError::Guard(e.to_string());
        create_private_dir(dir)?;
        let ca = certs::Ca::new("tether-guard CA (tether up)").map_err(|e| err(&e))?;
        let serving = ca
            .issue_server(&["127.0.0.1".to_string(), "localhost".into()])
            .map_err(|e| err(&e))?;
        let client_ca =
            certs::Ca::new("kube-apiserver client CA (tether up)").map_err(|e| err(&e))?;
        let client = client_ca
            .issue_client("kube-apiserver", &[])
            .map_err(|e| err(&e))?;
        let write =
            |name: &str, text: &str| certs::write_pem(&dir.join(name), text).map_err(|e| err(&e));
        write("ca.pem", ca.cert_pem())?;
        write("tls.crt", &serving.cert_pem)?;
        write("tls.key", &serving.key_pem)?;
        write("client-ca.pem", client_ca.cert_pem())?;
        // The agent's push certificate, from a CA of its own (as the Helm chart makes one): guard takes
        // snapshot pushes only with it and the token, and it opens nothing else.
        let push_ca =
            certs::Ca::new("tether-agent snapshot push CA (tether up)").map_err(|e| err(&e))?;
        let push_cert = push_ca
            .issue_client(PUSH_SUBJECT, &[])
            .map_err(|e| err(&e))?;
        write("push.crt", &push_cert.cert_pem)?;
        write("push.key", &push_cert.key_pem)?;
        let push_token = {
            let path = dir.join("push-token");
            match std::fs::read_to_string(&path) {
                Ok(t) if t.trim().len() >= 16 => t.trim().to_string(),
                _ => {
                    let t = format!("{:032x}", rand::random::<u128>());
                    write("push-token", &t)?;
                    t
                }
            }
        };
        let callers = tether_guard::Callers {
            snapshot_subjects: vec![PUSH_SUBJECT.to_owned()],
            snapshot_cas: vec![push_ca.certified().cert_der()],
            ..tether_guard::Callers::default()
        };
        let tls = tether_guard::server_tls_for(
            serving.cert_pem.as_bytes(),
            serving.key_pem.as_bytes(),
            client_ca.cert_pem().as_bytes(),
            &callers,
        )
        .map_err(|e| err(&e))?;
        let server = tether_guard::ServerConfig {
            tls,
            limits: tether_guard::Limits {
                callers,
                ..tether_guard::Limits::default()
            },
            snapshot_push_token: Some(tether_runtime::Secret::new(push_token.clone())),
        };
        let listener = tokio::net::TcpListener::bind(SocketAddr::from(([127, 0, 0, 1], 0)))
            .await
            .map_err(|e| err(&e))?;
        let addr = listener.local_addr().map_err(|e| err(&e))?;
        let mut runtime = GuardRuntime {
            guard: Self::engine(
                dir,
                issuer.authority(),
                issuer.ca_pem().as_bytes(),
                audience,
            )?,
            addr,
            server,
            push_token: tether_runtime::Secret::new(push_token),
            dir: dir.to_path_buf(),
            issuer_authority: issuer.authority().to_string(),
            issuer_ca: issuer.ca_pem().as_bytes().to_vec(),
            audience: audience.to_string(),
            running: None,
        };
        runtime.serve(listener);
        Ok((runtime, client))
    }

    /// Guard's engine: the issuer's tokens, the snapshot on disk (last-known-good), the audit log.
    fn engine(
        dir: &Path,
        authority: &str,
        authority_ca: &[u8],
        audience: &str,
    ) -> Result<Arc<tether_guard::Guard>, UpError> {
        let err = |e: &dyn std::fmt::Display| UpError::Guard(e.to_string());
        let mut token =
            tether_auth::TokenConfig::new(vec![DEV_TENANT.to_string()], vec![audience.to_string()]);
        token.v2_authority = authority.to_string();
        let fetch =
            tether_auth::jwks::HttpsFetcher::new(Some(authority_ca)).map_err(|e| err(&e))?;
        let authenticator =
            tether_auth::Authenticator::new(token, Arc::new(fetch)).map_err(|e| err(&e))?;
        let store =
            tether_guard::SnapshotStore::open(dir.join("snapshot.json")).map_err(|e| err(&e))?;
        let audit =
            tether_guard::audit::AuditSink::file(&dir.join("audit.jsonl")).map_err(|e| err(&e))?;
        Ok(Arc::new(tether_guard::Guard::new(
            Some(Arc::new(authenticator)),
            Arc::new(store),
            tether_guard::GuardOptions {
                audit,
                ..tether_guard::GuardOptions::default()
            },
        )))
    }

    fn serve(&mut self, listener: tokio::net::TcpListener) {
        let (tx, rx) = oneshot::channel::<()>();
        let join = tokio::spawn(tether_guard::run(
            self.guard.clone(),
            self.server.clone(),
            listener,
            async move {
                let _ = rx.await;
            },
        ));
        self.running = Some(Running { shutdown: tx, join });
    }

    pub(crate) async fn stop(&mut self) -> Result<(), UpError> {
        match self.running.take() {
            Some(r) => r.stop().await.map_err(UpError::Guard),
            None => Ok(()),
        }
    }

    /// Starts again on the same address with a new engine that loads the snapshot from disk.
    pub(crate) async fn restart(&mut self) -> Result<(), UpError> {
        self.stop().await?;
        self.guard = Self::engine(
            &self.dir,
            &self.issuer_authority,
            &self.issuer_ca,
            &self.audience,
        )?;
        let listener = bind_retrying(self.addr)
            .await
            .map_err(|e| UpError::Guard(e.to_string()))?;
        self.serve(listener);
        Ok(())
    }

    pub(crate) fn url(&self) -> String {
        format!("https://{}", display_addr(self.addr))
    }
}

const CONNECT_WAIT: Duration = Duration::from_secs(60);

impl Up {
    /// Starts everything and waits until the agent is connected.
    pub async fn start(options: UpOptions) -> Result<Up, UpError> {
        validate_name(&options.cluster)?;
        // Bad lifecycle settings are the user's to fix (exit 64), found before anything starts.
        relay_config(&options.dir, &options, None)
            .validate()
            .map_err(|e| UpError::Config(e.to_string()))?;
        let dir = &options.dir;
        create_private_dir(dir)?;
        let dir = std::fs::canonicalize(dir).map_err(|source| UpError::Io {
            path: dir.clone(),
            source,
        })?;

        #[cfg(feature = "quickstart")]
        let (sample, issuer, guard, entra, cluster_kubeconfig, user_token) =
            Self::start_cluster(&dir, &options).await?;
        #[cfg(not(feature = "quickstart"))]
        let (entra, cluster_kubeconfig, user_token) = match &options.kubeconfig {
            Some(path) => (None::<Entra>, path.clone(), bearer_token_of(path)?),
            None => return Err(UpError::Config(WITHOUT_QUICKSTART.into())),
        };

        let relay_config = relay_config(&dir, &options, entra.as_ref());
        let relay = tether_relay::Relay::new(relay_config)
            .await
            .map_err(|e| UpError::Relay(e.to_string()))?;
        let admin_token = relay.admin_token().clone();
        let ca_pem = relay.ca_pem().map(str::to_string).unwrap_or_default();
        let listener = tokio::net::TcpListener::bind(options.listen)
            .await
            .map_err(|e| {
                UpError::Config(format!(
                    "cannot listen on {}: {e} (choose another address with --listen)",
                    options.listen
                ))
            })?;
        let relay_addr = listener
            .local_addr()
            .map_err(|e| UpError::Relay(e.to_string()))?;
        let relay_url = format!("https://{}", display_addr(relay_addr));
        let relay_task = spawn_relay(relay, listener);

        let mut up = Up {
            relay_addr,
            relay_url,
            ca_pem,
            admin_token,
            kubeconfig_path: dir.join("kubeconfig"),
            config_path: dir.join("config.json"),
            user_token,
            #[cfg(feature = "quickstart")]
            sample,
            #[cfg(feature = "quickstart")]
            issuer,
            #[cfg(feature = "quickstart")]
            guard,
            entra,
            cluster_kubeconfig,
            relay: Some(relay_task),
            agent: None,
            options: UpOptions {
                dir: dir.clone(),
                ..options
            },
        };
        let onboarding_token = up.register().await?;
        up.spawn_agent(onboarding_token);
        up.wait_connected(CONNECT_WAIT).await?;
        up.write_files()?;
        Ok(up)
    }

    /// A client of the relay's admin API.
    pub fn client(&self) -> Result<RelayClient, ClientError> {
        RelayClient::with_token(
            &self.relay_url,
            Some(self.ca_pem.as_bytes()),
            self.admin_token.clone(),
        )
    }

    /// The cluster name.
    pub fn cluster(&self) -> &str {
        &self.options.cluster
    }

    /// The state directory.
    pub fn dir(&self) -> &Path {
        &self.options.dir
    }

    /// The cluster side of the quickstart: the development issuer and guard (unless `--no-guard`), and the
    /// sample apiserver unless a kubeconfig was given. The local fleet (`crate::fleet`) starts the same.
    #[cfg(feature = "quickstart")]
    #[allow(clippy::type_complexity)]
    pub(crate) async fn start_cluster(
        dir: &Path,
        options: &UpOptions,
    ) -> Result<
        (
            Option<SampleApiserver>,
            Option<DevIssuer>,
            Option<GuardRuntime>,
            Option<Entra>,
            PathBuf,
            Option<String>,
        ),
        UpError,
    > {
        let (issuer, guard) = if options.guard && options.kubeconfig.is_none() {
            let issuer = DevIssuer::start(
                &dir.join(DEV_ISSUER_DIR),
                SocketAddr::from(([127, 0, 0, 1], 0)),
                &options.audience,
            )
            .await
            .map_err(|e| UpError::Guard(format!("development issuer: {e}")))?;
            let guard =
                GuardRuntime::start(&dir.join(GUARD_DIR), &issuer, &options.audience).await?;
            (Some(issuer), Some(guard))
        } else {
            (None, None)
        };

        let (sample, cluster_kubeconfig, user_token) = match &options.kubeconfig {
            Some(path) => {
                let token = bearer_token_of(path)?;
                (None, path.clone(), token)
            }
            None => {
                let sample_dir = dir.join("sample-apiserver");
                create_private_dir(&sample_dir)?;
                let mut sample_options = SampleOptions::new(sample_dir.clone());
                if let Some((guard, client)) = &guard {
                    let configs = tether_testkit::webhook::write_guard_configs(
                        &sample_dir.join("webhooks"),
                        &guard.url(),
                        &String::from_utf8_lossy(
                            &std::fs::read(dir.join(GUARD_DIR).join("ca.pem")).map_err(
                                |source| UpError::Io {
                                    path: dir.join(GUARD_DIR).join("ca.pem"),
                                    source,
                                },
                            )?,
                        ),
                        client,
                    )
                    .map_err(|e| UpError::Guard(e.to_string()))?;
                    sample_options.authn_webhook = Some(configs.authn_webhook);
                    sample_options.authz_config = Some(configs.authz_config);
                }
                let sample = SampleApiserver::start(sample_options)
                    .await
                    .map_err(|e| UpError::Sample(e.to_string()))?;
                // The agent uses its own identity (allowed to impersonate), not the admin's.
                let kubeconfig = sample.agent_kubeconfig_path();
                let token = Some(sample.token().to_string());
                (Some(sample), kubeconfig, token)
            }
        };
        let guard = guard.map(|(guard, _client)| guard);
        let entra = issuer.as_ref().map(|issuer| Entra {
            authority: issuer.authority().to_string(),
            authority_ca: issuer.ca_file(),
            audience: options.audience.clone(),
        });

        Ok((sample, issuer, guard, entra, cluster_kubeconfig, user_token))
    }

    /// Guard's engine (its snapshot store, cache, metrics), when guard is wired in.
    #[cfg(feature = "quickstart")]
    pub fn guard(&self) -> Option<&Arc<tether_guard::Guard>> {
        self.guard.as_ref().map(|g| &g.guard)
    }

    /// Guard's base URL (`https://127.0.0.1:PORT`), when guard is wired in.
    #[cfg(feature = "quickstart")]
    pub fn guard_url(&self) -> Option<String> {
        self.guard.as_ref().map(GuardRuntime::url)
    }

    /// Stops guard's server (the sample apiserver's webhooks then fail: its failure policy applies).
    #[cfg(feature = "quickstart")]
    pub async fn stop_guard(&mut self) -> Result<(), UpError> {
        match &mut self.guard {
            Some(g) => g.stop().await,
            None => Ok(()),
        }
    }

    /// Restarts guard on the same address with a fresh engine that loads its last snapshot from disk.
    #[cfg(feature = "quickstart")]
    pub async fn restart_guard(&mut self) -> Result<(), UpError> {
        match &mut self.guard {
            Some(g) => g.restart().await,
            None => Err(UpError::Config("guard is not wired in".into())),
        }
    }

    /// The agent's state directory.
    pub fn agent_state_dir(&self) -> PathBuf {
        self.options.dir.join("agent")
    }

    /// True when the agent's state dir holds an unexpired identity for this relay and cluster.
    fn onboarded_here(&self) -> bool {
        match tether_agent::identity::load(
            &self.agent_state_dir(),
            &self.relay_url,
            &self.options.cluster,
        ) {
            Ok(Some(identity)) => !identity.is_expired(time::OffsetDateTime::now_utc()),
            Ok(None) => false,
            Err(e) => {
                tracing::warn!(error = %e, "the agent's stored identity is unusable; onboarding again");
                false
            }
        }
    }

    /// Registers the cluster unless this directory's agent is already onboarded; returns the onboarding token.
    async fn register(&self) -> Result<Option<Secret>, UpError> {
        let client = self.client()?;
        let name = &self.options.cluster;
        let onboarded_here = self.onboarded_here();
        match client.show_cluster(name).await {
            Ok(_) if onboarded_here => return Ok(None),
            Ok(_) => client.delete_cluster(name).await?,
            Err(e) if e.status() == Some(http::StatusCode::NOT_FOUND) => {}
            Err(e) => return Err(e.into()),
        }
        self.remove_agent_state()?;
        let created = client.create_cluster(name, &self.options.tags).await?;
        Ok(Some(created.onboarding_token))
    }

    fn remove_agent_state(&self) -> Result<(), UpError> {
        let state = self.agent_state_dir();
        if state.exists() {
            std::fs::remove_dir_all(&state).map_err(|source| UpError::Io {
                path: state.clone(),
                source,
            })?;
        }
        Ok(())
    }

    fn agent_config(&self, onboarding_token: Option<Secret>) -> tether_agent::Config {
        let mut config = tether_agent::Config::new(
            self.relay_url.clone(),
            self.options.cluster.clone(),
            self.agent_state_dir(),
        );
        config.onboarding_token = onboarding_token;
        config.relay_ca = Some(self.options.dir.join("relay").join("ca.pem"));
        config.kubeconfig = Some(self.cluster_kubeconfig.clone());
        config.drain_timeout = Duration::from_secs(5);
        if let Some(entra) = &self.entra {
            config.entra = Some(tether_agent::EntraConfig {
                tenants: vec![DEV_TENANT.to_string()],
                audiences: vec![entra.audience.clone()],
                authority: Some(entra.authority.clone()),
                authority_ca: Some(entra.authority_ca.clone()),
                ..Default::default()
            });
        }
        #[cfg(feature = "quickstart")]
        if let Some(guard) = &self.guard {
            let mut push = tether_agent::GuardConfig::new(
                format!("{}/snapshot", guard.url()),
                guard.push_token.clone(),
            );
            push.ca = Some(guard.dir.join("ca.pem"));
            push.client_cert = Some(guard.dir.join("push.crt"));
            push.client_key = Some(guard.dir.join("push.key"));
            config.guard = Some(push);
        }
        config
    }

    fn spawn_agent(&mut self, onboarding_token: Option<Secret>) {
        let config = self.agent_config(onboarding_token);
        let (tx, rx) = oneshot::channel::<()>();
        let join = tokio::spawn(async move {
            tether_agent::run(config, async move {
                let _ = rx.await;
            })
            .await
        });
        self.agent = Some(Running { shutdown: tx, join });
    }

    /// Waits until the relay reports the cluster connected, or the agent fails.
    pub async fn wait_connected(&mut self, limit: Duration) -> Result<(), UpError> {
        let client = self.client()?;
        let deadline = Instant::now() + limit;
        loop {
            if let Ok(cluster) = client.show_cluster(&self.options.cluster).await
                && cluster.connected
            {
                return Ok(());
            }
            if let Some(agent) = &self.agent
                && agent.join.is_finished()
                && let Some(agent) = self.agent.take()
            {
                let reason = agent
                    .stop()
                    .await
                    .err()
                    .unwrap_or_else(|| "it stopped".into());
                return Err(UpError::Agent(reason));
            }
            if Instant::now() >= deadline {
                return Err(UpError::NotConnected(limit));
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// Stops the agent (drains its streams).
    pub async fn stop_agent(&mut self) -> Result<(), UpError> {
        match self.agent.take() {
            Some(agent) => agent.stop().await.map_err(UpError::Agent),
            None => Ok(()),
        }
    }

    /// Starts the agent again (it reuses its stored identity).
    pub async fn start_agent(&mut self) -> Result<(), UpError> {
        self.stop_agent().await?;
        self.spawn_agent(None);
        self.wait_connected(CONNECT_WAIT).await
    }

    /// Stops the agent, removes its state (its identity) and starts it with `onboarding_token`, as reinstalling
    /// the agent after `tether cluster connect` does; waits until it is connected.
    pub async fn onboard_agent(&mut self, onboarding_token: Secret) -> Result<(), UpError> {
        self.stop_agent().await?;
        self.remove_agent_state()?;
        self.spawn_agent(Some(onboarding_token));
        self.wait_connected(CONNECT_WAIT).await
    }

    /// Waits up to `limit` for the agent to stop by itself (a fatal error such as a revoked or expired
    /// identity). `None` if it is still running (or was never started); else `Ok(())` for a clean stop or the
    /// agent's error message.
    pub async fn wait_agent_stopped(&mut self, limit: Duration) -> Option<Result<(), String>> {
        let deadline = Instant::now() + limit;
        while self.agent.as_ref().is_some_and(|a| !a.join.is_finished()) {
            if Instant::now() >= deadline {
                return None;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        Some(self.agent.take()?.stop().await)
    }

    /// Stops the relay (graceful: tunnels get GOAWAY).
    pub async fn stop_relay(&mut self) -> Result<(), UpError> {
        match self.relay.take() {
            Some(relay) => relay.stop().await.map_err(UpError::Relay),
            None => Ok(()),
        }
    }

    /// Starts the relay again on the same address and data dir (the agent is left to reconnect by itself).
    pub async fn start_relay(&mut self) -> Result<(), UpError> {
        self.stop_relay().await?;
        let relay = tether_relay::Relay::new(relay_config(
            &self.options.dir,
            &self.options,
            self.entra.as_ref(),
        ))
        .await
        .map_err(|e| UpError::Relay(e.to_string()))?;
        let listener = bind_retrying(self.relay_addr).await?;
        self.relay = Some(spawn_relay(relay, listener));
        Ok(())
    }

    fn write_files(&self) -> Result<(), UpError> {
        write_client_files(
            &self.relay_url,
            &self.options.cluster,
            &self.ca_pem,
            self.user_token.as_deref(),
            &self.kubeconfig_path,
            &self.config_path,
        )
    }

    /// Stops everything: agent (drain), relay, sample apiserver, guard, the development issuer.
    pub async fn shutdown(mut self) -> Result<(), UpError> {
        let agent = self.stop_agent().await;
        let relay = self.stop_relay().await;
        #[cfg(feature = "quickstart")]
        let relay = {
            if let Some(sample) = self.sample.take() {
                sample.shutdown().await;
            }
            let guard = self.stop_guard().await;
            if let Some(issuer) = self.issuer.take() {
                issuer.shutdown().await;
            }
            relay.and(guard)
        };
        agent.and(relay)
    }
}

/// The Entra-style token settings shared by the relay and the agent (the development issuer's).
#[derive(Debug, Clone)]
pub(crate) struct Entra {
    pub(crate) authority: String,
    pub(crate) authority_ca: PathBuf,
    pub(crate) audience: String,
}

pub(crate) fn relay_config(
    dir: &Path,
    options: &UpOptions,
    entra: Option<&Entra>,
) -> tether_relay::Config {
    let mut config = tether_relay::Config::new(dir.join("relay"));
    let mut hostnames = vec![
        "localhost".to_string(),
        "127.0.0.1".to_string(),
        "::1".to_string(),
    ];
    if !options.listen.ip().is_unspecified() && !options.listen.ip().is_loopback() {
        hostnames.push(options.listen.ip().to_string());
    }
    hostnames.extend(options.extra_hostnames.iter().cloned());
    config.hostnames = hostnames;
    if let Some(interval) = options.heartbeat_interval {
        config.heartbeat_interval = interval;
    }
    if let Some(threshold) = options.offline_threshold {
        config.offline_threshold = threshold;
    }
    if let Some(validity) = options.identity_validity {
        config.identity_validity = validity;
    }
    if let Some(version) = &options.latest_agent_version {
        config.latest_agent_version = version.clone();
    }
    if let Some(entra) = entra {
        config.entra = Some(tether_relay::EntraConfig {
            tenants: vec![DEV_TENANT.to_string()],
            audiences: vec![entra.audience.clone()],
            authority: Some(entra.authority.clone()),
            authority_ca: Some(entra.authority_ca.clone()),
        });
    }
    config
}

fn spawn_relay(
    relay: tether_relay::Relay,
    listener: tokio::net::TcpListener,
) -> Running<tether_relay::RelayError> {
    let (tx, rx) = oneshot::channel::<()>();
    let join = tokio::spawn(relay.serve(listener, async move {
        let _ = rx.await;
    }));
    Running { shutdown: tx, join }
}

async fn bind_retrying(addr: SocketAddr) -> Result<tokio::net::TcpListener, UpError> {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        match tokio::net::TcpListener::bind(addr).await {
            Ok(listener) => return Ok(listener),
            Err(e) if Instant::now() >= deadline => {
                return Err(UpError::Relay(format!(
                    "cannot listen on {addr} again: {e}"
                )));
            }
            Err(_) => tokio::time::sleep(Duration::from_millis(100)).await,
        }
    }
}

pub(crate) fn display_addr(addr: SocketAddr) -> String {
    match addr {
        SocketAddr::V4(a) => a.to_string(),
        SocketAddr::V6(a) => format!("[{}]:{}", a.ip(), a.port()),
    }
}

pub(crate) fn validate_name(name: &str) -> Result<(), UpError> {
    let ok = !name.is_empty()
        && name.len() <= 63
        && name
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
        && !name.starts_with('-')
        && !name.ends_with('-');
    if ok {
        Ok(())
    } else {
        Err(UpError::Config(format!(
            "cluster name {name:?} must be a DNS label (a-z, 0-9, '-')"
        )))
    }
}

pub(crate) fn create_private_dir(dir: &Path) -> Result<(), UpError> {
    std::fs::create_dir_all(dir).map_err(|source| UpError::Io {
        path: dir.to_path_buf(),
        source,
    })?;
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o700)).map_err(
            |source| UpError::Io {
                path: dir.to_path_buf(),
                source,
            },
        )?;
    }
    Ok(())
}

/// The bearer token of the current user of a kubeconfig, if it uses one (token or tokenFile).
fn bearer_token_of(path: &Path) -> Result<Option<String>, UpError> {
    let io = |source| UpError::Io {
        path: path.to_path_buf(),
        source,
    };
    let text = std::fs::read_to_string(path).map_err(io)?;
    let config: serde_yaml::Value = serde_yaml::from_str(&text)
        .map_err(|e| UpError::Config(format!("{} is not a kubeconfig: {e}", path.display())))?;
    let current = config["current-context"].as_str().unwrap_or_default();
    let user_name = config["contexts"]
        .as_sequence()
        .and_then(|contexts| {
            contexts
                .iter()
                .find(|c| c["name"].as_str() == Some(current))
        })
        .and_then(|c| c["context"]["user"].as_str());
    let Some(user_name) = user_name else {
        return Ok(None);
    };
    let user = config["users"]
        .as_sequence()
        .and_then(|users| users.iter().find(|u| u["name"].as_str() == Some(user_name)))
        .map(|u| &u["user"]);
    let Some(user) = user else { return Ok(None) };
    if let Some(token) = user["token"].as_str() {
        return Ok(Some(token.to_string()));
    }
    if let Some(file) = user["tokenFile"].as_str() {
        let token = std::fs::read_to_string(file).map_err(|source| UpError::Io {
            path: file.into(),
            source,
        })?;
        return Ok(Some(token.trim().to_string()));
    }
    Ok(None)
}

/// `tether up` in the foreground: start, print what to try, run until Ctrl-C or SIGTERM, shut down. (With
/// `--replicas N`, N ≥ 2, `tether up` runs the local relay fleet instead: `crate::fleet`.)
pub async fn run_foreground(args: UpArgs) -> Result<(), UpError> {
    if args.replicas != 1 {
        return Err(UpError::Config(format!(
            "--replicas {}: 1 runs one relay, 2 to 9 a local fleet",
            args.replicas
        )));
    }
    let up = Up::start(args.into()).await?;
    let kubeconfig = up.kubeconfig_path.display().to_string();
    println!("Tether is up.");
    println!(
        "  relay:    {}  (admin API, agent tunnels, kubectl endpoint)",
        up.relay_url
    );
    #[cfg(feature = "quickstart")]
    let sample_url = up.sample.as_ref().map(SampleApiserver::url);
    #[cfg(not(feature = "quickstart"))]
    let sample_url: Option<String> = None;
    match sample_url {
        Some(url) => println!(
            "  cluster:  \"{}\" — the sample apiserver at {}, connected through an agent",
            up.cluster(),
            url
        ),
        None => println!(
            "  cluster:  \"{}\" — connected through an agent",
            up.cluster()
        ),
    }
    #[cfg(feature = "quickstart")]
    if let (Some(guard), Some(issuer)) = (up.guard_url(), &up.issuer) {
        println!(
            "  guard:    {guard}  (the cluster's authentication and authorization webhooks; audit log: {})",
            up.dir().join(GUARD_DIR).join("audit.jsonl").display()
        );
        println!(
            "  issuer:   {}  DEVELOPMENT ONLY token issuer (tenant {}, audience {})",
            issuer.authority(),
            issuer.info().tenant,
            issuer.info().audience
        );
    }
    println!("  state:    {}", up.dir().display());
    println!();
    let config = up.config_path.display().to_string();
    // The sample cluster gets the full tour (port-forward, exec, cp, auth can-i, and guard's Viewer).
    #[cfg(feature = "quickstart")]
    let toured = match up.sample {
        Some(_) => {
            print!(
                "{}",
                tether_testkit::tour(&tether_testkit::TourOptions {
                    kubeconfig: &up.kubeconfig_path,
                    config: &up.config_path,
                    cluster: up.cluster(),
                    state_dir: up.dir(),
                    guard: up.issuer.is_some(),
                })
            );
            true
        }
        None => false,
    };
    #[cfg(not(feature = "quickstart"))]
    let toured = false;
    if !toured {
        println!("Try:");
        println!("  kubectl --kubeconfig {kubeconfig} get namespaces");
        if up.user_token.is_none() {
            println!(
                "  (the kubeconfig has no user credential; add yours: tether passes it through to the cluster)"
            );
        }
        println!("  tether --config {config} cluster list");
    }
    println!("  tether --config {config} cluster show {}", up.cluster());
    println!();
    println!("Press Ctrl-C to stop.");
    tether_runtime::process::shutdown_signal().await;
    println!("Shutting down…");
    up.shutdown().await
}

/// The kubeconfig (`relay_url`, its CA, `token`) and the `tether` config file (the relay, its CA and admin token
/// files under the directory) that `tether up` and the local fleet write for their users.
pub(crate) fn write_client_files(
    relay_url: &str,
    cluster: &str,
    ca_pem: &str,
    token: Option<&str>,
    kubeconfig_path: &Path,
    config_path: &Path,
) -> Result<(), UpError> {
    let text = kubeconfig::render(&KubeconfigSpec {
        relay_url,
        cluster,
        ca_pem: Some(ca_pem.as_bytes()),
        token,
    })?;
    kubeconfig::write_private(kubeconfig_path, &text)?;
    let config = ConfigFile {
        relay: Some(relay_url.to_owned()),
        ca_file: Some(PathBuf::from("relay/ca.pem")),
        admin_token_file: Some(PathBuf::from("relay/admin-token")),
    };
    config.save(config_path).map_err(|source| UpError::Io {
        path: config_path.to_path_buf(),
        source,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_must_be_dns_labels() {
        assert!(validate_name("demo-1").is_ok());
        assert!(validate_name("Demo").is_err());
        assert!(validate_name("-x").is_err());
        assert!(validate_name(&"a".repeat(64)).is_err());
    }

    #[test]
    fn finds_the_bearer_token_of_the_current_user() -> anyhow::Result<()> {
        let dir = tempfile::tempdir()?;
        let path = dir.path().join("kc");
        std::fs::write(
            &path,
            "apiVersion: v1\nkind: Config\ncurrent-context: b\ncontexts:\n- name: a\n  context: {cluster: c, user: ua}\n\
             - name: b\n  context: {cluster: c, user: ub}\nusers:\n- name: ua\n  user: {token: ta}\n- name: ub\n  user: {token: tb}\n",
        )?;
        assert_eq!(bearer_token_of(&path)?, Some("tb".to_string()));
        Ok(())
    }
}
