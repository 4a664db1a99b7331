//! The agent's side of the control channel: one stream of kind `CONTROL` at control priority per tunnel,
//! opened right after connecting.
//!
//! `hello` → `welcome` (which sets the heartbeat interval), then: `metadata` at once and whenever it
//! changes, `health` at once and with every `heartbeat`, and, when the identity is due for renewal, `renew`
//! with a CSR for a new key, answered by `certificate` (stored atomically and used from the next connection
//! on; the tunnel and its streams stay up) or `error` (retried with backoff). The relay's `guardSnapshot`s go
//! to the snapshot pusher ([`crate::guard_push`]); `resolveGroups` questions from the authentication proxy go
//! out and their `groups` answers come back through [`crate::directory`]. Unknown messages are ignored.
//! When the channel ends or fails, [`run`] returns why, and the caller closes the tunnel and reconnects.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use rand::RngExt as _;
use tether_api::control::{self, Heartbeat, Hello, Message, Metadata, Reader, Renew};
use tether_tunnel::{Connection, OpenOptions, Priority, kind};
use time::OffsetDateTime;
use tokio::io::WriteHalf;
use tokio::sync::watch;
use tokio::time::Instant;

use crate::directory::RelayDirectory;
use crate::guard_push::SnapshotSink;
use crate::health;
use crate::identity::{self, Identity, KeyRequest};
use crate::store::IdentityStore;
use tether_api::reconnect::Backoff;

/// How long the relay has to accept the control stream and answer `hello`.
const WELCOME_TIMEOUT: Duration = Duration::from_secs(30);
/// How long the relay has to answer `renew`.
const RENEW_TIMEOUT: Duration = Duration::from_secs(30);
/// Heartbeat interval used when the relay's `welcome` says 0.
const DEFAULT_HEARTBEAT: Duration = Duration::from_secs(30);
/// Pacing of renewal retries after a failure.
const RENEW_BACKOFF: Backoff = Backoff {
    base: Duration::from_secs(1),
    cap: Duration::from_secs(300),
    stable: Duration::MAX,
    recovery: Duration::ZERO,
    recovery_cap: Duration::from_secs(300),
};

/// What the control channel needs and keeps across tunnels.
pub(crate) struct State {
    /// Where a renewed identity is stored.
    pub(crate) store: Arc<IdentityStore>,
    /// The identity in use; replaced by a renewal (and used from the next connection on).
    pub(crate) identity: Identity,
    /// Cluster metadata as the metadata task last published it.
    pub(crate) metadata: watch::Receiver<Option<Metadata>>,
    /// When the agent started (for `uptimeSeconds`).
    pub(crate) started: Instant,
    /// Tunnels established since the agent started.
    pub(crate) connections: u64,
    /// The newest agent version the relay offers, from the last `welcome`.
    pub(crate) latest_agent_version: Option<String>,
    /// The relay's directory as the authentication proxy sees it; each channel attaches to it.
    pub(crate) directory: Arc<RelayDirectory>,
    /// Where guard snapshots go; `None` when no guard is configured.
    pub(crate) snapshots: Option<SnapshotSink>,
    /// The reconnect window from the relay's last `draining` message; taken when the tunnel ends.
    pub(crate) reconnect_window: Option<Duration>,
    renewal: Renewal,
}

/// When to renew next, and how the last attempts went.
struct Renewal {
    due: Instant,
    failures: u32,
    last_error: Option<String>,
}

impl State {
    pub(crate) fn new(
        store: Arc<IdentityStore>,
        identity: Identity,
        metadata: watch::Receiver<Option<Metadata>>,
    ) -> Self {
        let due = renewal_due(&identity);
        Self {
            store,
            identity,
            metadata,
            started: Instant::now(),
            connections: 0,
            latest_agent_version: None,
            reconnect_window: None,
            directory: Arc::default(),
            snapshots: None,
            renewal: Renewal {
                due,
                failures: 0,
                last_error: None,
            },
        }
    }

    fn reconnects(&self) -> u64 {
        self.connections.saturating_sub(1)
    }

    /// Records a failed renewal attempt and schedules the next one.
    fn renewal_failed(&mut self, error: String) {
        let delay = RENEW_BACKOFF.delay(self.renewal.failures, &mut rand::rng());
        self.renewal.failures = self.renewal.failures.saturating_add(1);
        self.renewal.due = Instant::now() + delay;
        if self.renewal.last_error.as_deref() == Some(error.as_str()) {
            tracing::debug!(%error, retry_in = ?delay, attempt = self.renewal.failures, "identity renewal failed");
        } else {
            tracing::warn!(%error, retry_in = ?delay, not_after = %rfc3339(self.identity.not_after), "identity renewal failed; retrying with backoff");
            self.renewal.last_error = Some(error);
        }
    }

    fn renewed(&mut self, identity: Identity) {
        tracing::info!(
            fingerprint = %identity.fingerprint,
            not_after = %rfc3339(identity.not_after),
            previous = %self.identity.fingerprint,
            after_failures = self.renewal.failures,
            "identity renewed; it is used from the next connection"
        );
        self.renewal = Renewal {
            due: renewal_due(&identity),
            failures: 0,
            last_error: None,
        };
        self.identity = identity;
    }
}

/// The tokio instant at which `identity` is due for renewal (jittered), now if that is past.
fn renewal_due(identity: &Identity) -> Instant {
    let jitter: f64 = rand::rng().random_range(-1.0..=1.0);
    let at = identity.renew_at(jitter);
    let wait = at - OffsetDateTime::now_utc();
    let wait = Duration::try_from(wait).unwrap_or(Duration::ZERO);
    tracing::debug!(renew_at = %rfc3339(at), ?wait, "identity renewal scheduled");
    Instant::now() + wait
}

fn rfc3339(t: OffsetDateTime) -> String {
    t.format(&time::format_description::well_known::Rfc3339)
        .unwrap_or_default()
}

/// Runs the control channel on `conn` until it ends; returns why (for the log).
pub(crate) async fn run(conn: &Connection, state: &mut State) -> String {
    let mut attached = None;
    let result = run_inner(conn, state, &mut attached).await;
    if let Some(generation) = attached {
        state.directory.detach(generation);
    }
    match result {
        Ok(()) => "the relay closed the control channel".to_owned(),
        Err(reason) => reason,
    }
}

async fn run_inner(
    conn: &Connection,
    state: &mut State,
    attached: &mut Option<u64>,
) -> Result<(), String> {
    let stream = conn
        .open(OpenOptions {
            kind: kind::CONTROL,
            priority: Priority::Control,
            deadline: Some(WELCOME_TIMEOUT),
            metadata: Bytes::new(),
        })
        .map_err(|e| format!("cannot open the control channel: {e}"))?;
    let (read, mut write) = tokio::io::split(stream);
    let mut reader = Reader::new(read);
    let failed = |what: &str, e: control::ControlError| format!("control channel {what}: {e}");

    send(
        &mut write,
        &Message::Hello(Hello {
            agent_version: env!("CARGO_PKG_VERSION").to_owned(),
            ..Hello::default()
        }),
    )
    .await?;
    let welcome = tokio::time::timeout(WELCOME_TIMEOUT, async {
        loop {
            match reader.recv().await {
                Ok(Some(Message::Welcome(welcome))) => return Ok(welcome),
                Ok(Some(other)) => {
                    tracing::debug!(?other, "ignoring a control message before welcome");
                }
                Ok(None) => {
                    return Err("the relay closed the control channel before welcome".to_owned());
                }
                Err(e) => return Err(failed("failed before welcome", e)),
            }
        }
    })
    .await
    .map_err(|_| format!("no welcome from the relay within {WELCOME_TIMEOUT:?}"))??;

    let interval = match welcome.heartbeat_interval_seconds {
        0 => DEFAULT_HEARTBEAT,
        s => Duration::from_secs(s),
    };
    if let Some(latest) = &welcome.latest_agent_version
        && state.latest_agent_version.as_ref() != Some(latest)
    {
        if latest != env!("CARGO_PKG_VERSION") {
            tracing::info!(latest = %latest, running = env!("CARGO_PKG_VERSION"), "the relay offers another agent version");
        }
        state.latest_agent_version = Some(latest.clone());
    }
    tracing::debug!(heartbeat = ?interval, "control channel up");

    let (generation, mut outgoing) = state.directory.attach();
    *attached = Some(generation);

    let mut sent_metadata: Option<Metadata> = None;
    let current = state.metadata.borrow_and_update().clone();
    if let Some(metadata) = current {
        send(&mut write, &Message::Metadata(metadata.clone())).await?;
        sent_metadata = Some(metadata);
    }
    send_health(&mut write, conn, state).await?;

    let mut heartbeat = tokio::time::interval_at(Instant::now() + interval, interval);
    heartbeat.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut seq: u64 = 0;
    let mut metadata_open = true;
    // A renewal in flight: the new key and when to give up waiting.
    let mut pending: Option<(KeyRequest, Instant)> = None;

    loop {
        let renew_at = match &pending {
            Some((_, deadline)) => *deadline,
            None => state.renewal.due,
        };
        tokio::select! {
            message = reader.recv() => match message {
                Ok(Some(Message::Certificate(cert))) => {
                    let Some((request, _)) = pending.take() else {
                        tracing::debug!("ignoring a certificate nobody asked for");
                        continue;
                    };
                    tracing::debug!(not_after = %cert.not_after, "certificate received");
                    match accept_certificate(state, &cert.certificate, request).await {
                        Ok(identity) => state.renewed(identity),
                        Err(e) => state.renewal_failed(e),
                    }
                }
                Ok(Some(Message::Error(error))) => {
                    if pending.take().is_some() {
                        state.renewal_failed(format!("the relay refused: {}", error.message));
                    } else {
                        tracing::warn!(message = %error.message, "error from the relay on the control channel");
                    }
                }
                Ok(Some(Message::Welcome(welcome))) => {
                    if let Some(latest) = welcome.latest_agent_version {
                        state.latest_agent_version = Some(latest);
                    }
                }
                Ok(Some(Message::GuardSnapshot(snapshot))) => match &state.snapshots {
                    Some(sink) => sink.offer(&snapshot.snapshot),
                    None => tracing::debug!(
                        version = snapshot.snapshot.version,
                        "no guard configured (--guard-url); ignoring a guard snapshot"
                    ),
                },
                Ok(Some(Message::Groups(groups))) => state.directory.answer(groups),
                Ok(Some(Message::Draining(draining))) => {
                    let window = Duration::from_millis(draining.reconnect_within_ms);
                    tracing::info!(reconnect_within = ?window, "the relay is going away");
                    state.reconnect_window = Some(window);
                }
                Ok(Some(other)) => tracing::debug!(?other, "ignoring a control message"),
                Ok(None) => return Ok(()),
                Err(e) => return Err(failed("failed", e)),
            },
            Some(message) = outgoing.recv() => send(&mut write, &message).await?,
            _ = heartbeat.tick() => {
                send(&mut write, &Message::Heartbeat(Heartbeat { seq })).await?;
                seq += 1;
                send_health(&mut write, conn, state).await?;
            }
            changed = state.metadata.changed(), if metadata_open => {
                if changed.is_err() {
                    metadata_open = false;
                    continue;
                }
                let current = state.metadata.borrow_and_update().clone();
                if let Some(metadata) = current
                    && sent_metadata.as_ref() != Some(&metadata)
                {
                    send(&mut write, &Message::Metadata(metadata.clone())).await?;
                    sent_metadata = Some(metadata);
                }
            }
            () = tokio::time::sleep_until(renew_at) => {
                if pending.take().is_some() {
                    state.renewal_failed(format!("no answer to renew within {RENEW_TIMEOUT:?}"));
                    continue;
                }
                let request = match identity::new_key_request(&state.identity.cluster) {
                    Ok(request) => request,
                    Err(e) => {
                        state.renewal_failed(e.to_string());
                        continue;
                    }
                };
                tracing::info!(not_after = %rfc3339(state.identity.not_after), "renewing the cluster identity");
                send(&mut write, &Message::Renew(Renew { csr: request.csr.clone() })).await?;
                pending = Some((request, Instant::now() + RENEW_TIMEOUT));
            }
        }
    }
}

/// Checks the certificate against the new key and stores the pair; the new identity on success.
async fn accept_certificate(
    state: &State,
    certificate: &str,
    request: KeyRequest,
) -> Result<Identity, String> {
    let identity = Identity::new(
        &state.identity.relay,
        &state.identity.cluster,
        certificate,
        request.key,
        OffsetDateTime::now_utc(),
    )
    .map_err(|e| e.to_string())?;
    state.store.store(&identity).await?;
    Ok(identity)
}

async fn send_health(
    write: &mut WriteHalf<tether_tunnel::Stream>,
    conn: &Connection,
    state: &State,
) -> Result<(), String> {
    let report = health::report(state.started, state.reconnects(), conn.rtt());
    send(write, &Message::Health(report)).await
}

async fn send(
    write: &mut WriteHalf<tether_tunnel::Stream>,
    message: &Message,
) -> Result<(), String> {
    control::send(write, message)
        .await
        .map_err(|e| format!("control channel failed: {e}"))
}
