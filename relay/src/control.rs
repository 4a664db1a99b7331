//! The relay's side of the control channel: one stream of kind CONTROL per tunnel, opened by the agent.
//!
//! `hello` is answered with `welcome` and the cluster's guard snapshot (`guardSnapshot`), which is sent again
//! whenever the admin API changes the cluster's assignments (the [`crate::guard_hub::GuardHub`] wakes the channel;
//! the snapshot is read back from the store, so only the newest of several quick changes is sent). Heartbeats
//! and health go to the [`crate::activity::ActivityLog`] (batched writes); metadata is written at once (it
//! changes rarely); `renew` is answered with a new certificate or an `error`; `resolveGroups` with `groups`
//! from the directory. Unknown message types are ignored. A message over the size cap or one that
//! does not decode resets the stream (the agent then reconnects).

use std::sync::Arc;

use std::time::Duration;

use tether_api::control::{
    self as wire, Certificate, ControlError, ErrorMessage, Groups, Message, Reader, Welcome,
};
use tether_tunnel::{Stream, code};
use time::OffsetDateTime;
use time::format_description::well_known::Rfc3339;
use tokio::io::AsyncWriteExt;
use tokio::sync::watch;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use crate::identity::IssueError;
use crate::rbac;
use crate::registry::Tunnel;
use crate::replicas;
use crate::revocation;
use crate::state::Shared;
use crate::store::{AgentHealth, ClusterMetadata, NewIdentity};

/// Longest string the relay keeps from an agent report (versions, distribution names, …).
const MAX_TEXT: usize = 128;

/// What one control channel knows about its tunnel.
pub(crate) struct Channel {
    pub(crate) shared: Arc<Shared>,
    pub(crate) cluster: String,
    /// The certificate the agent holds: the one the tunnel was authenticated with, then the last one issued
    /// on this channel.
    pub(crate) held_fingerprint: String,
    /// Until when the tunnel's identity is valid; moved forward by each renewal.
    pub(crate) valid_until: watch::Sender<OffsetDateTime>,
    /// Cancelled when the tunnel gets GOAWAY (relay shutdown, a newer tunnel): the channel ends at once.
    pub(crate) draining: CancellationToken,
    /// The tunnel: what `hello` says and the certificate held after a renewal go to its shared facts.
    pub(crate) tunnel: Tunnel,
}

/// Why a control channel was cut.
#[derive(Debug, thiserror::Error)]
enum ChannelError {
    /// Reading, writing or decoding failed.
    #[error(transparent)]
    Wire(#[from] ControlError),
    /// The agent broke the channel's rules.
    #[error("{0}")]
    Protocol(&'static str),
}

/// Printable text of bounded length: control characters dropped, cut at [`MAX_TEXT`] characters.
fn clean(s: &str) -> String {
    s.chars()
        .filter(|c| !c.is_control())
        .take(MAX_TEXT)
        .collect()
}

/// How long the relay tries to hand an agent its `draining` message when going away.
const DRAINING_SEND: Duration = Duration::from_secs(1);

/// How a control channel ended without error.
enum End {
    /// The agent closed it.
    AgentClosed,
    /// The tunnel got GOAWAY.
    Draining,
}

/// Serves the control stream until it ends. Never fails: problems are logged, the stream reset.
pub(crate) async fn serve(mut channel: Channel, stream: Stream) {
    let control = stream.control();
    let (rd, mut wr) = tokio::io::split(stream);
    let mut reader = Reader::new(rd);
    let draining = channel.draining.clone();
    let result = tokio::select! {
        result = run(&mut channel, &mut reader, &mut wr) => result,
        // `run` notices GOAWAY between messages; this cuts a channel stuck writing to an agent that stopped
        // reading.
        () = async { draining.cancelled().await; tokio::time::sleep(DRAINING_SEND).await } => {
            control.reset(code::SHUTDOWN);
            return;
        }
    };
    match result {
        Ok(End::Draining) => {
            // The agent takes the end of its control channel as the signal to reconnect; a relay shutting
            // down first says within what window, so its agents do not all come back at the same moment.
            let Some(window) = channel.shared.reconnect_window() else {
                tracing::debug!(cluster = %channel.cluster, "control channel ended: the tunnel is going away");
                control.reset(code::SHUTDOWN);
                return;
            };
            let message = Message::Draining(wire::Draining {
                reconnect_within_ms: u64::try_from(window.as_millis()).unwrap_or(u64::MAX),
                ..wire::Draining::default()
            });
            let sent = tokio::time::timeout(DRAINING_SEND, async {
                wire::send(&mut wr, &message).await?;
                wr.shutdown().await?;
                // Dropping the stream before the agent ends its side would reset it, and a reset can overtake
                // the message; the agent ends its side as soon as it has read it.
                while reader.recv().await?.is_some() {}
                Ok::<_, ControlError>(())
            })
            .await;
            if !matches!(sent, Ok(Ok(()))) {
                control.reset(code::SHUTDOWN);
            }
            tracing::debug!(cluster = %channel.cluster, reconnect_within = ?window, "control channel ended: relay shutting down");
        }
        Ok(End::AgentClosed) => {
            let _ = wr.shutdown().await;
            tracing::debug!(cluster = %channel.cluster, "control channel ended by the agent");
        }
        Err(ChannelError::Protocol(why)) => {
            // The agent was told why; end our side and let it close (a reset could drop that message).
            tracing::info!(cluster = %channel.cluster, error = why, "control channel ended: protocol violation");
            let _ = wr.shutdown().await;
            while let Ok(Some(_)) = reader.recv().await {}
        }
        Err(ChannelError::Wire(e @ (ControlError::TooLarge(_) | ControlError::Malformed(_)))) => {
            tracing::info!(cluster = %channel.cluster, error = %e, "control channel reset: bad message");
            control.reset(code::PROTOCOL_ERROR);
        }
        Err(e) => {
            tracing::debug!(cluster = %channel.cluster, error = %e, "control channel ended");
            control.reset(code::CANCEL);
        }
    }
}

/// How long to wait before trying again to read a snapshot the store could not give.
const SNAPSHOT_RETRY: Duration = Duration::from_secs(1);

async fn run<R, W>(
    channel: &mut Channel,
    reader: &mut Reader<R>,
    wr: &mut W,
) -> Result<End, ChannelError>
where
    R: tokio::io::AsyncRead + Unpin,
    W: tokio::io::AsyncWrite + Unpin,
{
    let shared = channel.shared.clone();
    let cluster = channel.cluster.clone();
    let draining = channel.draining.clone();
    let moving = channel.tunnel.info.moving.clone();
    let mut asked_to_move = false;
    // Subscribed before hello, so no change between the first snapshot and the loop is missed.
    let mut changes = shared.guard.subscribe(&cluster);
    let mut hub_open = true;
    let mut live = shared.fleet.subscribe_live();
    live.mark_unchanged();
    let mut state = State::default();
    loop {
        if state.snapshot_due && state.retry_at.is_none() {
            match push_snapshot(&shared, &cluster, wr, &mut state.last_sent).await? {
                true => state.snapshot_due = false,
                false => state.retry_at = Some(Instant::now() + SNAPSHOT_RETRY),
            }
        }
        let retry_at = state.retry_at;
        tokio::select! {
            biased;
            () = draining.cancelled() => return Ok(End::Draining),
            message = reader.recv() => match message? {
                Some(message) => handle(channel, &mut state, message, wr).await?,
                None => return Ok(End::AgentClosed),
            },
            changed = changes.changed(), if hub_open && state.welcomed() => match changed {
                Ok(()) => state.snapshot_due = true,
                // The cluster was deleted; its tunnel is being closed.
                Err(_) => hub_open = false,
            },
            () = sleep_until_some(retry_at), if retry_at.is_some() => state.retry_at = None,
            // The fleet grew or shrank: the agent keeps as many tunnels as there are live replicas (up to its
            // K), so it is told again — unless its welcome already said this count (read just before the change
            // was announced).
            Ok(()) = live.changed(), if state.welcomed() => {
                let replicas = *live.borrow_and_update();
                if state.told_replicas != Some(replicas) {
                    wire::send(wr, &welcome(&shared, replicas)).await?;
                    state.told_replicas = Some(replicas);
                    tracing::debug!(%cluster, replicas, "told the agent the fleet's new size");
                }
            }
            // The relay drains with peers to move to: the agent opens its replacement tunnel elsewhere, then
            // sends GOAWAY on this one; meanwhile this tunnel and its control channel carry on.
            () = moving.cancelled(), if !asked_to_move && state.welcomed() => {
                asked_to_move = true;
                let window = shared.reconnect_window().unwrap_or_default();
                let message = Message::Draining(wire::Draining {
                    reconnect_within_ms: u64::try_from(window.as_millis()).unwrap_or(u64::MAX),
                    make_before_break: true,
                });
                wire::send(wr, &message).await?;
                tracing::info!(%cluster, tunnel = channel.tunnel.id, "asked the agent to move this tunnel (make before break)");
            }
        }
    }
}

/// The `welcome` this replica says, with `replicas` live replicas in the fleet.
fn welcome(shared: &Shared, replicas: u32) -> Message {
    Message::Welcome(Welcome {
        heartbeat_interval_seconds: shared.config.heartbeat_interval.as_secs(),
        latest_agent_version: Some(shared.config.latest_agent_version.clone()),
        replica: shared.fleet.replica_id.clone(),
        replicas,
    })
}

async fn sleep_until_some(at: Option<Instant>) {
    if let Some(at) = at {
        tokio::time::sleep_until(at).await;
    }
}

/// What one control channel remembers between messages.
#[derive(Default)]
struct State {
    /// The fleet size the agent was last told in a welcome; `None` until its hello was welcomed.
    told_replicas: Option<u32>,
    last_metadata: Option<wire::Metadata>,
    /// A guard snapshot should be (re)sent.
    snapshot_due: bool,
    /// The version of the last snapshot sent on this channel.
    last_sent: Option<u64>,
    /// When to try again after the store failed.
    retry_at: Option<Instant>,
}

impl State {
    fn welcomed(&self) -> bool {
        self.told_replicas.is_some()
    }
}

/// Sends the cluster's current guard snapshot unless this channel already sent that version. `Ok(false)` when
/// the store failed (try again later); a snapshot too large for one message is logged and skipped.
async fn push_snapshot<W>(
    shared: &Shared,
    cluster: &str,
    wr: &mut W,
    last_sent: &mut Option<u64>,
) -> Result<bool, ChannelError>
where
    W: tokio::io::AsyncWrite + Unpin,
{
    let state = match shared.store.guard_state(cluster).await {
        Ok(Some(state)) => state,
        // Deleted: the tunnel is going away.
        Ok(None) => return Ok(true),
        Err(e) => {
            tracing::warn!(cluster, error = %e, "cannot read the guard snapshot; will retry");
            return Ok(false);
        }
    };
    if last_sent.is_some_and(|sent| state.version <= sent) {
        return Ok(true);
    }
    let version = state.version;
    let (assignments, denies) = (state.assignments.len(), state.deny_assignments.len());
    let message = rbac::snapshot_message(&rbac::snapshot(state));
    match wire::send(wr, &message).await {
        Ok(()) => {
            *last_sent = Some(version);
            tracing::info!(
                cluster,
                version,
                assignments,
                denies,
                "guard snapshot pushed"
            );
            Ok(true)
        }
        // Refused before anything was written: the channel is intact. The admin API keeps snapshots under the
        // limit, so this takes a change made around it.
        Err(ControlError::TooLarge(len)) => {
            tracing::error!(
                cluster,
                version,
                len,
                "the guard snapshot is too large for the control channel"
            );
            Ok(true)
        }
        Err(e) => Err(e.into()),
    }
}

async fn handle<W>(
    channel: &mut Channel,
    state: &mut State,
    message: Message,
    wr: &mut W,
) -> Result<(), ChannelError>
where
    W: tokio::io::AsyncWrite + Unpin,
{
    let shared = channel.shared.clone();
    let cluster = channel.cluster.clone();
    let now = OffsetDateTime::now_utc();
    match message {
        Message::Hello(hello) => {
            let version = clean(&hello.agent_version);
            let instance = clean(&hello.instance);
            channel.tunnel.info.hello(&instance, hello.tunnels);
            tracing::info!(cluster, agent_version = %version, %instance, tunnels = channel.tunnel.info.agent_tunnels(), "control channel open");
            // The other replicas show the agent's instance and count its tunnels.
            if replicas::publish(&shared, &cluster, &channel.tunnel)
                .await
                .is_err()
            {
                return Err(ChannelError::Protocol("the cluster was deleted"));
            }
            shared.activity.agent_version(&cluster, version, now);
            let replicas = shared.fleet.live_replicas();
            wire::send(wr, &welcome(&shared, replicas)).await?;
            state.told_replicas = Some(replicas);
            // Every hello gets the current snapshot, even one this channel sent before.
            state.last_sent = None;
            state.snapshot_due = true;
        }
        Message::Unknown => {
            tracing::debug!(cluster, "ignoring a control message of an unknown type");
        }
        _ if !state.welcomed() => {
            let error = Message::Error(ErrorMessage {
                message: "the first control message must be hello".to_owned(),
            });
            wire::send(wr, &error).await?;
            return Err(ChannelError::Protocol("control message before hello"));
        }
        Message::Heartbeat(beat) => {
            tracing::trace!(cluster, seq = beat.seq, "heartbeat");
            shared.activity.touch(&cluster, now);
        }
        Message::Health(h) => {
            let health = AgentHealth {
                uptime_seconds: h.uptime_seconds,
                memory_bytes: h.memory_bytes,
                cpu_seconds: if h.cpu_seconds.is_finite() {
                    h.cpu_seconds.max(0.0)
                } else {
                    0.0
                },
                reconnects: h.reconnects,
                tunnel_rtt_millis: h.tunnel_rtt_millis.filter(|r| r.is_finite() && *r >= 0.0),
                reported_at: now,
            };
            shared
                .activity
                .health(&cluster, health, clean(&h.agent_version));
        }
        Message::Metadata(m) => {
            shared.activity.touch(&cluster, now);
            // Agents report on change, but a repeat costs no write.
            if state.last_metadata.as_ref() == Some(&m) {
                return Ok(());
            }
            let metadata = ClusterMetadata {
                kubernetes_version: clean(&m.kubernetes_version),
                node_count: m.node_count,
                total_cpu_millis: m.total_cpu_millis,
                total_memory_bytes: m.total_memory_bytes,
                distribution: clean(&m.distribution),
                infrastructure: clean(&m.infrastructure),
                reported_at: now,
            };
            match shared
                .store
                .record_metadata(&cluster, &metadata, &clean(&m.agent_version))
                .await
            {
                Ok(()) => state.last_metadata = Some(m),
                Err(e) => {
                    tracing::warn!(cluster, error = %e, "cannot store the cluster's metadata")
                }
            }
        }
        Message::ResolveGroups(request) => {
            let result =
                rbac::resolve_groups(shared.store.as_ref(), &request.tid, &request.oid).await;
            tracing::debug!(
                cluster,
                request_id = request.request_id,
                found = result.is_ok(),
                "resolveGroups"
            );
            let (groups, error) = match result {
                Ok(groups) => (Some(groups), None),
                Err(e) => (None, Some(e)),
            };
            let answer = Message::Groups(Groups {
                request_id: request.request_id,
                groups,
                error,
            });
            match wire::send(wr, &answer).await {
                Err(ControlError::TooLarge(_)) => {
                    let error = Message::Groups(Groups {
                        request_id: request.request_id,
                        groups: None,
                        error: Some(
                            "the user's group list is too large for the control channel".into(),
                        ),
                    });
                    wire::send(wr, &error).await?;
                }
                other => other?,
            }
        }
        Message::Renew(renew) => {
            shared.activity.touch(&cluster, now);
            let reply = renew_identity(channel, &renew.csr, now).await;
            wire::send(wr, &reply).await?;
        }
        Message::Welcome(_)
        | Message::Certificate(_)
        | Message::Error(_)
        | Message::GuardSnapshot(_)
        | Message::Groups(_)
        | Message::Draining(_) => {
            tracing::debug!(
                cluster,
                "ignoring a relay-to-agent message sent by the agent"
            );
        }
    }
    Ok(())
}

async fn renew_identity(channel: &mut Channel, csr: &str, now: OffsetDateTime) -> Message {
    let shared = &channel.shared;
    let cluster = channel.cluster.as_str();
    let error = |message: String| Message::Error(ErrorMessage { message });
    let issued = match shared
        .agent_ca
        .issue(cluster, csr, shared.config.identity_validity, now)
    {
        Ok(issued) => issued,
        Err(e @ IssueError::InvalidCsr(_)) => return error(e.to_string()),
        Err(e @ IssueError::Sign(_)) => {
            tracing::warn!(cluster, error = %e, "cannot issue a renewed identity");
            return error("the relay could not issue a certificate; try again later".into());
        }
    };
    let new = NewIdentity {
        fingerprint: issued.fingerprint.clone(),
        not_after: issued.not_after,
    };
    match shared
        .store
        .renew_identity(cluster, &channel.held_fingerprint, &new)
        .await
    {
        Ok(true) => {}
        Ok(false) => {
            return error(format!(
                "cluster {cluster} has no identity to renew: it was deleted or its identity revoked"
            ));
        }
        Err(e) => {
            tracing::warn!(cluster, error = %e, "cannot store a renewed identity");
            return error("the relay could not store the new identity; try again later".into());
        }
    }
    let not_after = match issued.not_after.format(&Rfc3339) {
        Ok(s) => s,
        Err(e) => return error(format!("cannot format the expiry: {e}")),
    };
    tracing::info!(cluster, not_after, fingerprint = %issued.fingerprint, "identity renewed");
    channel.tunnel.info.renewed(&issued.fingerprint);
    // The agent's other tunnels here still hold the replaced certificate (replicas elsewhere learn of the
    // renewal from the store's change feed).
    revocation::close_replaced(shared, cluster, &issued.fingerprint);
    channel.held_fingerprint = issued.fingerprint;
    channel.valid_until.send_replace(issued.not_after);
    Message::Certificate(Certificate {
        certificate: issued.pem,
        not_after,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn agent_text_is_bounded_and_printable() {
        assert_eq!(clean("v1.33.1+k3s1"), "v1.33.1+k3s1");
        assert_eq!(clean("a\u{0}b\nc"), "abc");
        assert_eq!(clean(&"x".repeat(1000)).len(), MAX_TEXT);
    }
}
