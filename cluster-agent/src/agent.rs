//! The agent's life: onboard once (key pair + CSR → certificate), then hand over to the tunnel supervisor
//! ([`crate::supervisor`]: K tunnels, transport selection, make-before-break moves, drain on shutdown) with
//! everything the tunnels share (the apiserver connections, the identity, metadata, guard pushes, probes).

use std::future::Future;
use std::path::Path;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use http::HeaderValue;
use tether_runtime::tls;
use tether_tunnel::proxy::ProxyConfig;
use time::OffsetDateTime;

use crate::auth_proxy::AuthProxy;
use crate::config::{Config, ConfigError};
use crate::control;
use crate::dial::{self, Dialer, RelayTls};
use crate::directory::RelayDirectory;
use crate::error::AgentError;
use crate::event::Events;
use crate::forward::Upstream;
use crate::guard_push;
use crate::identity::{self, Identity};
use crate::metadata;
use crate::onboard::{OnboardError, Onboarding};
use crate::probes::{self, Probes};
use crate::state_secret::{Acquired, SecretStore, StateSecretError};
use crate::store::IdentityStore;
use crate::supervisor::{self, Settings};
use crate::tunnel;
use tether_api::reconnect::Reconnect;

/// Most streams the relay may open at once on this agent's tunnel (the protocol's default is 1024): one
/// tunnel carries every user's requests to the cluster, long-running ones (watches, `logs -f`, exec) included,
/// and must carry at least 10,000 (issue 17). A stream costs a few KiB until it carries data.
pub(crate) const TUNNEL_MAX_STREAMS: u32 = 16_384;

type Shutdown = Pin<Box<dyn Future<Output = ()> + Send>>;

/// Runs the agent until `shutdown` resolves (then drains and returns `Ok`) or a fatal error.
pub async fn run(
    config: Config,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(), AgentError> {
    config.validate()?;
    tls::install_crypto_provider();
    let relays = config.relay_endpoints()?;
    let onboard_url = config.onboard_url()?;
    // Dropped when `run` returns: /livez then answers 503 (or nothing at all once the probe server is gone).
    let (probes, _liveness) = Probes::start();
    let _probe_server = match config.health_listen {
        Some(addr) => {
            let listener = probes::bind(addr)
                .await
                .map_err(|source| AgentError::HealthListen { addr, source })?;
            tracing::info!(%addr, "serving probes (/readyz, /livez, /metrics)");
            Some(probes::serve(listener, probes.clone()))
        }
        None => None,
    };

    let mut kube_config = load_kube_config(config.kubeconfig.as_deref()).await?;
    // The apiserver is reached directly, like the forwarded requests (the proxy settings are for the
    // relay): kube-rs would otherwise take HTTPS_PROXY for its own connections too.
    if kube_config.proxy_url.take().is_some() {
        tracing::info!(
            "ignoring the proxy for the apiserver (from the kubeconfig or HTTPS_PROXY): only the relay is reached through the proxy"
        );
    }
    // Group overages are resolved through the relay, over whichever control channel is up.
    let directory = Arc::new(RelayDirectory::default());
    let auth_proxy = match &config.entra {
        Some(entra) => {
            let resolver: Arc<dyn tether_auth::token::GroupResolver> = directory.clone();
            Some(AuthProxy::new(entra, Some(resolver))?)
        }
        None => None,
    };
    let upstream =
        Upstream::from_kube_config_with(&kube_config, auth_proxy, config.upstream.clone())?;
    probes.set_upstream(&upstream);
    // Dropping the pusher (when `run` returns) stops it.
    let (snapshots, _pusher) = match &config.guard {
        Some(guard) => {
            let (sink, pusher) = guard_push::spawn(guard).map_err(AgentError::GuardTls)?;
            (Some(sink), Some(pusher))
        }
        None => (None, None),
    };
    // Names the agent's own requests in the apiserver's audit log (forwarded requests keep the user's).
    kube_config.headers.push((
        http::header::USER_AGENT,
        HeaderValue::from_static(concat!("tether-agent/", env!("CARGO_PKG_VERSION"))),
    ));
    // The agent's own identity, kept apart from forwarding (which carries only the users' credentials): it
    // reads the cluster's metadata.
    let agent_client = kube::Client::try_from(kube_config).map_err(AgentError::KubeClient)?;

    let relay_ca = config.relay_ca.as_deref().map(tls::read_file).transpose()?;
    let proxy_ca = config.proxy_ca.as_deref().map(tls::read_file).transpose()?;
    let relay_tls = RelayTls { relay_ca, proxy_ca };
    let proxy_config = config.proxy_config();
    let proxy = proxy_config.as_ref();

    tracing::info!(
        relays = %config.relays.join(","),
        cluster = %config.cluster,
        transport = config.transport.as_str(),
        tunnels = config.tunnels,
        apiserver = %upstream.base(),
        proxy = %proxy.map_or_else(|| "none".to_owned(), |p| p.proxy.to_string()),
        auth_proxy = upstream.impersonates(),
        guard = %config.guard.as_ref().map_or("none", |g| g.url.as_str()),
        "agent starting"
    );
    let mut shutdown: Shutdown = Box::pin(shutdown);
    let mut reconnect = Reconnect::new(config.backoff);

    let store = Arc::new(match &config.state_secret {
        Some(secret) => {
            IdentityStore::Secret(Box::new(SecretStore::new(agent_client.clone(), secret)))
        }
        None => IdentityStore::Dir(config.state_dir.clone()),
    });
    let Some(identity) = ensure_identity(
        &config,
        &store,
        &onboard_url,
        &relay_tls.config(None)?,
        proxy,
        &mut reconnect,
        &mut shutdown,
    )
    .await?
    else {
        tracing::info!("shut down before onboarding finished");
        return Ok(());
    };
    let metadata = metadata::spawn(agent_client).map_err(AgentError::MetadataThread)?;
    tracing::info!(identity = %identity.fingerprint, "connecting to the relay");
    let (events, receiver) = Events::new();
    let shared = Arc::new(control::Shared::new(
        store,
        identity,
        metadata,
        directory,
        snapshots,
        config.tunnels,
    ));
    let dialer = Arc::new(Dialer {
        tls: relay_tls,
        headers: Dialer::headers(&config.cluster),
        session: dial::session_config(
            TUNNEL_MAX_STREAMS,
            config.tunnel_keepalive,
            config.tunnel_timeout,
        ),
        quic_liveness: (config.quic_keepalive, config.quic_timeout),
        connect_timeout: config.connect_timeout,
        proxy: proxy_config.clone(),
    });
    let cx = tunnel::Context {
        upstream,
        probes,
        shared,
        events,
        drain_timeout: config.drain_timeout,
    };
    let settings = Settings {
        tunnels: config.tunnels,
        transport: config.transport,
        quic_reprobe_interval: config.quic_reprobe_interval,
        backoff: config.backoff,
        drain_timeout: config.drain_timeout,
    };
    supervisor::run(settings, relays, dialer, cx, receiver, shutdown).await
}

/// Reads the Secret until it holds a usable identity (`Acquired::Identity`) or this agent holds the onboarding
/// claim (`Acquired::Claimed`), waiting while another agent onboards. Apiserver errors are retried with the
/// reconnect pacing. `None` when shutdown came first.
async fn acquire_from_secret(
    config: &Config,
    secret: &SecretStore,
    usable: &impl Fn(&Identity) -> bool,
    reconnect: &mut Reconnect,
    shutdown: &mut Shutdown,
) -> Result<Option<Acquired>, AgentError> {
    let mut waiting_logged = false;
    loop {
        let delay = match secret
            .acquire(config.relay_url(), &config.cluster, usable)
            .await
        {
            Ok(Acquired::Wait) => {
                if !waiting_logged {
                    tracing::info!(secret = %secret.name(), "another agent is onboarding this cluster; waiting for the identity it stores");
                    waiting_logged = true;
                }
                SECRET_POLL
            }
            Ok(done) => return Ok(Some(done)),
            Err(e @ StateSecretError::Api { .. }) => {
                let delay = reconnect.next_delay();
                tracing::warn!(error = %crate::error_chain(&e), retry_in = ?delay, "cannot use the state Secret");
                delay
            }
            Err(e) => return Err(e.into()),
        };
        tokio::select! {
            () = tokio::time::sleep(delay) => {}
            () = shutdown.as_mut() => return Ok(None),
        }
    }
}

/// How often an agent waiting for another's onboarding reads the Secret.
const SECRET_POLL: Duration = Duration::from_millis(500);

/// The stored identity, or a new one from onboarding (stored before it is returned). `None` when shutdown
/// came first.
async fn ensure_identity(
    config: &Config,
    store: &IdentityStore,
    onboard_url: &str,
    relay_tls: &Arc<rustls::ClientConfig>,
    proxy: Option<&ProxyConfig>,
    reconnect: &mut Reconnect,
    shutdown: &mut Shutdown,
) -> Result<Option<Identity>, AgentError> {
    // An expired identity is worth nothing when a new onboarding token is at hand: the recovery the relay tells
    // the user about (delete the cluster, connect it again, start the agent with the new token) needs no
    // hand-emptied store. Without a token it is used anyway, and the relay says what to do.
    let usable = |stored: &Identity| {
        let expired = stored.is_expired(OffsetDateTime::now_utc());
        if expired && config.onboarding_secret().is_some() {
            tracing::warn!(
                "the stored identity has expired; onboarding again with the given onboarding token"
            );
        } else if expired {
            tracing::warn!("the stored identity has expired; the relay will refuse it");
        }
        !expired || config.onboarding_secret().is_none()
    };
    let found = match store {
        IdentityStore::Dir(dir) => identity::load(dir, config.relay_url(), &config.cluster)?
            .filter(|stored| usable(stored)),
        IdentityStore::Secret(secret) => {
            match acquire_from_secret(config, secret, &usable, reconnect, shutdown).await? {
                Some(Acquired::Identity(stored)) => Some(stored),
                Some(_) => None,
                None => return Ok(None),
            }
        }
    };
    if let Some(stored) = found {
        tracing::info!(
            store = %store.describe(),
            fingerprint = %stored.fingerprint,
            not_after = %stored.not_after,
            "using the stored identity"
        );
        return Ok(Some(stored));
    }
    let Some(token) = config.onboarding_secret() else {
        return Err(ConfigError::MissingOnboardingToken {
            relay: config.relay_url().to_owned(),
            cluster: config.cluster.clone(),
            state_dir: store.describe(),
        }
        .into());
    };
    // One key for all attempts: the CSR stays valid, and the key never leaves this process until stored.
    let request = identity::new_key_request(&config.cluster)?;
    let mut last_failure: Option<String> = None;
    loop {
        if let IdentityStore::Secret(secret) = store
            && let Err(e) = secret.refresh_claim().await
        {
            tracing::warn!(error = %e, "cannot refresh the onboarding claim");
        }
        let onboarding = Onboarding {
            url: onboard_url,
            tls: relay_tls,
            proxy,
            cluster: &config.cluster,
            token,
            csr: &request.csr,
            timeout: config.connect_timeout,
        };
        let result = tokio::select! {
            result = onboarding.run() => result,
            () = shutdown.as_mut() => return Ok(None),
        };
        let delay = match result {
            Ok(issued) => {
                let identity = Identity::new(
                    config.relay_url(),
                    &config.cluster,
                    &issued.certificate,
                    request.key.clone(),
                    OffsetDateTime::now_utc(),
                )?;
                match store {
                    IdentityStore::Dir(dir) => identity::store(dir, &identity)?,
                    IdentityStore::Secret(secret) => secret.store(&identity).await?,
                }
                tracing::info!(
                    store = %store.describe(),
                    fingerprint = %identity.fingerprint,
                    not_after = %identity.not_after,
                    "onboarded; identity stored"
                );
                return Ok(Some(identity));
            }
            Err(OnboardError::Refused { status, message }) => {
                return Err(AgentError::OnboardingRefused { status, message });
            }
            Err(e @ OnboardError::Transient { .. }) => {
                let error = e.to_string();
                let delay = reconnect.next_delay();
                if last_failure.as_deref() == Some(error.as_str()) {
                    tracing::debug!(%error, retry_in = ?delay, "onboarding failed");
                } else {
                    tracing::warn!(%error, retry_in = ?delay, "onboarding failed");
                    last_failure = Some(error);
                }
                delay
            }
        };
        tokio::select! {
            () = tokio::time::sleep(delay) => {}
            () = shutdown.as_mut() => return Ok(None),
        }
    }
}

async fn load_kube_config(path: Option<&Path>) -> Result<kube::Config, AgentError> {
    let boxed = |e: Box<dyn std::error::Error + Send + Sync>| AgentError::KubeConfig(e);
    match path {
        Some(path) => {
            let kubeconfig =
                kube::config::Kubeconfig::read_from(path).map_err(|e| boxed(Box::new(e)))?;
            kube::Config::from_custom_kubeconfig(
                kubeconfig,
                &kube::config::KubeConfigOptions::default(),
            )
            .await
            .map_err(|e| boxed(Box::new(e)))
        }
        None => kube::Config::infer().await.map_err(|e| boxed(Box::new(e))),
    }
}
