//! The relay's side of the control channel: one stream of kind CONTROL per tunnel, opened by the agent.
//!
//! `hello` is answered with `welcome`; heartbeats and health go to the [`crate::activity::ActivityLog`]
//! (batched writes); metadata is written at once (it changes rarely); `renew` is answered with a new
//! certificate or an `error`. Unknown message types are ignored. A message over the size cap or one that
//! does not decode resets the stream (the agent then reconnects).

use std::sync::Arc;

use tether_tunnel::control::{
    self as wire, Certificate, ControlError, ErrorMessage, Message, Reader, Welcome,
};
use tether_tunnel::{Stream, code};
use time::OffsetDateTime;
use time::format_description::well_known::Rfc3339;
use tokio::io::AsyncWriteExt;
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

use crate::identity::IssueError;
use crate::server::Shared;
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

/// Serves the control stream until it ends. Never fails: problems are logged, the stream reset.
pub(crate) async fn serve(mut channel: Channel, stream: Stream) {
    let control = stream.control();
    let (rd, mut wr) = tokio::io::split(stream);
    let mut reader = Reader::new(rd);
    let draining = channel.draining.clone();
    let result = tokio::select! {
        result = run(&mut channel, &mut reader, &mut wr) => result,
        () = draining.cancelled() => {
            // The agent takes the end of its control channel as the signal to reconnect.
            tracing::debug!(cluster = %channel.cluster, "control channel ended: the tunnel is going away");
            control.reset(code::SHUTDOWN);
            return;
        }
    };
    match result {
        Ok(()) => {
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

async fn run<R, W>(
    channel: &mut Channel,
    reader: &mut Reader<R>,
    wr: &mut W,
) -> Result<(), ChannelError>
where
    R: tokio::io::AsyncRead + Unpin,
    W: tokio::io::AsyncWrite + Unpin,
{
    let shared = channel.shared.clone();
    let cluster = channel.cluster.clone();
    let mut welcomed = false;
    let mut last_metadata = None;
    while let Some(message) = reader.recv().await? {
        let now = OffsetDateTime::now_utc();
        match message {
            Message::Hello(hello) => {
                let version = clean(&hello.agent_version);
                tracing::info!(cluster, agent_version = %version, "control channel open");
                shared.activity.agent_version(&cluster, version, now);
                let welcome = Message::Welcome(Welcome {
                    heartbeat_interval_seconds: shared.config.heartbeat_interval.as_secs(),
                    latest_agent_version: Some(shared.config.latest_agent_version.clone()),
                });
                wire::send(wr, &welcome).await?;
                welcomed = true;
            }
            Message::Unknown => {
                tracing::debug!(cluster, "ignoring a control message of an unknown type");
            }
            _ if !welcomed => {
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
                if last_metadata.as_ref() == Some(&m) {
                    continue;
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
                    Ok(()) => last_metadata = Some(m),
                    Err(e) => {
                        tracing::warn!(cluster, error = %e, "cannot store the cluster's metadata")
                    }
                }
            }
            Message::ResolveGroups(_) => {
                // Answered once the relay has a directory (issue 4); ignored like an unknown type until then.
                tracing::debug!(cluster, "ignoring resolveGroups");
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
            | Message::Groups(_) => {
                tracing::debug!(
                    cluster,
                    "ignoring a relay-to-agent message sent by the agent"
                );
            }
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
