//! The agent's side of the control channel: one stream of kind `CONTROL` at control priority per tunnel,
//! opened right after connecting.
//!
//! `hello` (the agent's version, its process's random `instance` and how many tunnels it keeps) → `welcome`
//! (which sets the heartbeat interval and names the relay replica holding the tunnel, and how many replicas
//! are live — both go to the supervisor), then: `metadata` at once and whenever it changes, `health` at once
//! and with every `heartbeat`, and, when the identity is due for renewal, `renew` with a CSR for a new key,
//! answered by `certificate` (stored atomically, used by every dial from then on, and announced to the
//! supervisor, which moves the other tunnels onto it) or `error` (retried with backoff). The renewal is the
//! agent's, not each tunnel's: one channel at a time holds it ([`Shared`]), and another takes over if that
//! channel ends first. The relay's `guardSnapshot`s go to the snapshot pusher ([`crate::guard_push`]);
//! `resolveGroups` questions from the authentication proxy go out and their `groups` answers come back
//! through [`crate::directory`]; `draining` goes to the supervisor. Unknown messages are ignored. When the
//! channel ends or fails, [`run`] returns why, and the caller closes the tunnel.

use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
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
use crate::event::{Event, Events, TunnelId};
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

/// What every control channel of the agent shares (one per agent process).
pub(crate) struct Shared {
    /// Where a renewed identity is stored.
    store: Arc<IdentityStore>,
    /// The identity in use; replaced by a renewal.
    identity: watch::Sender<Identity>,
    /// Cluster metadata as the metadata task last published it.
    metadata: watch::Receiver<Option<Metadata>>,
    /// When the agent started (for `uptimeSeconds`).
    started: Instant,
    /// Tunnels re-established after one was lost.
    reconnects: AtomicU64,
    /// The newest agent version the relay offers, from the last `welcome`.
    latest_agent_version: Mutex<Option<String>>,
    /// The relay's directory as the authentication proxy sees it; each channel attaches to it.
    directory: Arc<RelayDirectory>,
    /// Where guard snapshots go; `None` when no guard is configured.
    snapshots: Option<SnapshotSink>,
    /// Random per agent process (`hello.instance`).
    instance: String,
    /// How many tunnels the agent keeps now (`hello.tunnels`).
    tunnels: AtomicU32,
    /// The renewal: when, and which channel is doing it.
    renewal: Mutex<Renewal>,
    /// Bumped whenever `renewal` changes, so waiting channels look again.
    renewal_changed: watch::Sender<u64>,
    /// Channel numbers, for the renewal claim.
    next_channel: AtomicU64,
}

/// When to renew next, how the last attempts went, and who is renewing.
struct Renewal {
    due: Instant,
    failures: u32,
    last_error: Option<String>,
    /// The channel holding the renewal, until it is answered, fails or the channel ends.
    holder: Option<u64>,
}

impl Shared {
    pub(crate) fn new(
        store: Arc<IdentityStore>,
        identity: Identity,
        metadata: watch::Receiver<Option<Metadata>>,
        directory: Arc<RelayDirectory>,
        snapshots: Option<SnapshotSink>,
        tunnels: u32,
    ) -> Self {
        let due = renewal_due(&identity);
        let mut instance = [0u8; 16];
        rand::rng().fill(&mut instance);
        Self {
            store,
            identity: watch::channel(identity).0,
            metadata,
            started: Instant::now(),
            reconnects: AtomicU64::new(0),
            latest_agent_version: Mutex::new(None),
            directory,
            snapshots,
            instance: hex::encode(instance),
            tunnels: AtomicU32::new(tunnels),
            renewal: Mutex::new(Renewal {
                due,
                failures: 0,
                last_error: None,
                holder: None,
            }),
            renewal_changed: watch::channel(0).0,
            next_channel: AtomicU64::new(0),
        }
    }

    /// The identity in use now.
    pub(crate) fn identity(&self) -> Identity {
        self.identity.borrow().clone()
    }

    /// Counts a tunnel re-established after one was lost.
    pub(crate) fn reconnected(&self) {
        self.reconnects.fetch_add(1, Ordering::Relaxed);
    }

    /// Sets how many tunnels `hello` announces.
    pub(crate) fn set_tunnels(&self, tunnels: u32) {
        self.tunnels.store(tunnels, Ordering::Relaxed);
    }

    fn renewal(&self) -> MutexGuard<'_, Renewal> {
        self.renewal.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn renewal_updated(&self) {
        self.renewal_changed.send_modify(|n| *n = n.wrapping_add(1));
    }

    /// Takes the renewal for `channel` if it is due and nobody holds it.
    fn claim_renewal(&self, channel: u64) -> bool {
        let mut renewal = self.renewal();
        if renewal.holder.is_some() || Instant::now() < renewal.due {
            return false;
        }
        renewal.holder = Some(channel);
        true
    }

    /// Lets go of the renewal `channel` holds (its channel ended before the answer): another takes it now.
    fn release_renewal(&self, channel: u64) {
        let mut renewal = self.renewal();
        if renewal.holder == Some(channel) {
            renewal.holder = None;
            drop(renewal);
            self.renewal_updated();
        }
    }

    /// Records a failed renewal attempt and schedules the next one.
    fn renewal_failed(&self, error: String) {
        let mut renewal = self.renewal();
        let delay = RENEW_BACKOFF.delay(renewal.failures, &mut rand::rng());
        renewal.failures = renewal.failures.saturating_add(1);
        renewal.due = Instant::now() + delay;
        renewal.holder = None;
        let not_after = rfc3339(self.identity.borrow().not_after);
        if renewal.last_error.as_deref() == Some(error.as_str()) {
            tracing::debug!(%error, retry_in = ?delay, attempt = renewal.failures, "identity renewal failed");
        } else {
            tracing::warn!(%error, retry_in = ?delay, %not_after, "identity renewal failed; retrying with backoff");
            renewal.last_error = Some(error);
        }
        drop(renewal);
        self.renewal_updated();
    }

    fn renewed(&self, identity: Identity) {
        let mut renewal = self.renewal();
        tracing::info!(
            fingerprint = %identity.fingerprint,
            not_after = %rfc3339(identity.not_after),
            previous = %self.identity.borrow().fingerprint,
            after_failures = renewal.failures,
            "identity renewed; the other tunnels move onto it"
        );
        *renewal = Renewal {
            due: renewal_due(&identity),
            failures: 0,
            last_error: None,
            holder: None,
        };
        self.identity.send_replace(identity);
        drop(renewal);
        self.renewal_updated();
    }

    /// When this channel should next look at the renewal: its due time, unless another channel holds it
    /// (then only when that changes).
    fn renewal_wait(&self) -> Option<Instant> {
        let renewal = self.renewal();
        renewal.holder.is_none().then_some(renewal.due)
    }
}

/// Lets go of the renewal claim when the channel ends, whatever way it ends.
struct Claim<'a> {
    shared: &'a Shared,
    channel: u64,
}

impl Drop for Claim<'_> {
    fn drop(&mut self) {
        self.shared.release_renewal(self.channel);
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

/// Runs the control channel of tunnel `tunnel` on `conn` until it ends; returns why (for the log).
pub(crate) async fn run(
    conn: &Connection,
    shared: &Shared,
    tunnel: TunnelId,
    events: &Events,
) -> String {
    let mut attached = None;
    let channel = shared.next_channel.fetch_add(1, Ordering::Relaxed);
    let claim = Claim { shared, channel };
    let result = run_inner(conn, shared, &claim, tunnel, events, &mut attached).await;
    if let Some(generation) = attached {
        shared.directory.detach(generation);
    }
    match result {
        Ok(()) => "the relay closed the control channel".to_owned(),
        Err(reason) => reason,
    }
}

async fn run_inner(
    conn: &Connection,
    shared: &Shared,
    claim: &Claim<'_>,
    tunnel: TunnelId,
    events: &Events,
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
            instance: shared.instance.clone(),
            tunnels: shared.tunnels.load(Ordering::Relaxed),
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
    note_latest_version(shared, welcome.latest_agent_version.as_ref());
    let mut fleet = (welcome.replica.clone(), welcome.replicas);
    events.send(Event::Welcome {
        tunnel,
        replica: welcome.replica,
        replicas: welcome.replicas,
    });
    tracing::debug!(heartbeat = ?interval, replica = %fleet.0, replicas = fleet.1, "control channel up");

    let (generation, mut outgoing) = shared.directory.attach();
    *attached = Some(generation);

    let mut metadata = shared.metadata.clone();
    let mut sent_metadata: Option<Metadata> = None;
    let current = metadata.borrow_and_update().clone();
    if let Some(current) = current {
        send(&mut write, &Message::Metadata(current.clone())).await?;
        sent_metadata = Some(current);
    }
    send_health(&mut write, conn, shared).await?;

    let mut heartbeat = tokio::time::interval_at(Instant::now() + interval, interval);
    heartbeat.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut seq: u64 = 0;
    let mut metadata_open = true;
    let mut renewal_changed = shared.renewal_changed.subscribe();
    // A renewal in flight on this channel: the new key and when to give up waiting.
    let mut pending: Option<(KeyRequest, Instant)> = None;

    loop {
        let renew_at = match &pending {
            Some((_, deadline)) => Some(*deadline),
            None => shared.renewal_wait(),
        };
        tokio::select! {
            message = reader.recv() => match message {
                Ok(Some(Message::Certificate(cert))) => {
                    let Some((request, _)) = pending.take() else {
                        tracing::debug!("ignoring a certificate nobody asked for");
                        continue;
                    };
                    tracing::debug!(not_after = %cert.not_after, "certificate received");
                    match accept_certificate(shared, &cert.certificate, request).await {
                        Ok(identity) => {
                            let fingerprint = identity.fingerprint.clone();
                            shared.renewed(identity);
                            events.send(Event::Renewed { tunnel, fingerprint });
                        }
                        Err(e) => shared.renewal_failed(e),
                    }
                }
                Ok(Some(Message::Error(error))) => {
                    if pending.take().is_some() {
                        shared.renewal_failed(format!("the relay refused: {}", error.message));
                    } else {
                        tracing::warn!(message = %error.message, "error from the relay on the control channel");
                    }
                }
                Ok(Some(Message::Welcome(welcome))) => {
                    note_latest_version(shared, welcome.latest_agent_version.as_ref());
                    if (&welcome.replica, welcome.replicas) != (&fleet.0, fleet.1) {
                        fleet = (welcome.replica.clone(), welcome.replicas);
                        events.send(Event::Welcome {
                            tunnel,
                            replica: welcome.replica,
                            replicas: welcome.replicas,
                        });
                    }
                }
                Ok(Some(Message::GuardSnapshot(snapshot))) => match &shared.snapshots {
                    Some(sink) => sink.offer(&snapshot.snapshot),
                    None => tracing::debug!(
                        version = snapshot.snapshot.version,
                        "no guard configured (--guard-url); ignoring a guard snapshot"
                    ),
                },
                Ok(Some(Message::Groups(groups))) => shared.directory.answer(groups),
                Ok(Some(Message::Draining(draining))) => {
                    let window = Duration::from_millis(draining.reconnect_within_ms);
                    tracing::info!(
                        reconnect_within = ?window,
                        make_before_break = draining.make_before_break,
                        replica = %fleet.0,
                        "the relay is going away"
                    );
                    events.send(Event::Draining {
                        tunnel,
                        window,
                        make_before_break: draining.make_before_break,
                    });
                }
                Ok(Some(other)) => tracing::debug!(?other, "ignoring a control message"),
                Ok(None) => return Ok(()),
                Err(e) => return Err(failed("failed", e)),
            },
            Some(message) = outgoing.recv() => send(&mut write, &message).await?,
            _ = heartbeat.tick() => {
                send(&mut write, &Message::Heartbeat(Heartbeat { seq })).await?;
                seq += 1;
                send_health(&mut write, conn, shared).await?;
            }
            changed = metadata.changed(), if metadata_open => {
                if changed.is_err() {
                    metadata_open = false;
                    continue;
                }
                let current = metadata.borrow_and_update().clone();
                if let Some(current) = current
                    && sent_metadata.as_ref() != Some(&current)
                {
                    send(&mut write, &Message::Metadata(current.clone())).await?;
                    sent_metadata = Some(current);
                }
            }
            // Another channel took, finished or gave up the renewal: look again.
            Ok(()) = renewal_changed.changed(), if pending.is_none() => {}
            () = sleep_until_some(renew_at), if renew_at.is_some() => {
                if pending.take().is_some() {
                    shared.renewal_failed(format!("no answer to renew within {RENEW_TIMEOUT:?}"));
                    continue;
                }
                if !shared.claim_renewal(claim.channel) {
                    continue;
                }
                let identity = shared.identity();
                let request = match identity::new_key_request(&identity.cluster) {
                    Ok(request) => request,
                    Err(e) => {
                        shared.renewal_failed(e.to_string());
                        continue;
                    }
                };
                tracing::info!(not_after = %rfc3339(identity.not_after), "renewing the cluster identity");
                send(&mut write, &Message::Renew(Renew { csr: request.csr.clone() })).await?;
                pending = Some((request, Instant::now() + RENEW_TIMEOUT));
            }
        }
    }
}

async fn sleep_until_some(at: Option<Instant>) {
    match at {
        Some(at) => tokio::time::sleep_until(at).await,
        None => std::future::pending().await,
    }
}

fn note_latest_version(shared: &Shared, latest: Option<&String>) {
    let Some(latest) = latest else { return };
    let mut known = shared
        .latest_agent_version
        .lock()
        .unwrap_or_else(PoisonError::into_inner);
    if known.as_ref() != Some(latest) {
        if latest != env!("CARGO_PKG_VERSION") {
            tracing::info!(latest = %latest, running = env!("CARGO_PKG_VERSION"), "the relay offers another agent version");
        }
        *known = Some(latest.clone());
    }
}

/// Checks the certificate against the new key and stores the pair; the new identity on success.
async fn accept_certificate(
    shared: &Shared,
    certificate: &str,
    request: KeyRequest,
) -> Result<Identity, String> {
    let current = shared.identity();
    let identity = Identity::new(
        &current.relay,
        &current.cluster,
        certificate,
        request.key,
        OffsetDateTime::now_utc(),
    )
    .map_err(|e| e.to_string())?;
    shared.store.store(&identity).await?;
    Ok(identity)
}

async fn send_health(
    write: &mut WriteHalf<tether_tunnel::Stream>,
    conn: &Connection,
    shared: &Shared,
) -> Result<(), String> {
    let report = health::report(
        shared.started,
        shared.reconnects.load(Ordering::Relaxed),
        conn.rtt(),
    );
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
