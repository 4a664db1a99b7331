//! The control channel: typed messages between agent and relay on one stream of kind
//! `tether_proto::kind::CONTROL` per tunnel.
//!
//! Framing: each message is a `u32` big-endian length, then that many bytes of UTF-8 JSON, at most
//! [`MAX_MESSAGE_LEN`] bytes. Every message is a JSON object with a `"type"` field; a type this version does not
//! know decodes to [`Message::Unknown`], which receivers ignore (forward compatibility). A message longer than
//! the cap is an error for the receiver, which then resets the stream.
//!
//! [`send`] and [`Reader`] work over any `AsyncWrite`/`AsyncRead` (a tunnel `Stream`, one half of
//! `tokio::io::split`, or an in-memory duplex in tests); the framing is `tokio_util`'s [`LengthDelimitedCodec`].
//! [`Reader::recv`] is cancel-safe, so it may sit in a `select!`.
//!
//! This module only encodes and decodes. It does not decide who sends what when (the agent and the relay do),
//! does not open or reset streams, and has no timers.

use bytes::{Bytes, BytesMut};
use futures_util::StreamExt as _;
use serde::{Deserialize, Serialize};
use tokio::io::{AsyncRead, AsyncWrite, AsyncWriteExt};
use tokio_util::codec::{Decoder, Encoder as _, FramedRead, LengthDelimitedCodec};

/// The largest message body (the JSON, without the 4-byte length) either side sends or accepts: 1 MiB.
pub const MAX_MESSAGE_LEN: usize = 1024 * 1024;

/// One control-channel message. Serialized as a JSON object whose `"type"` is the variant name in camelCase
/// (`hello`, `welcome`, …) and whose other fields are the payload's, in camelCase.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "camelCase")]
pub enum Message {
    /// agent → relay, the first message on the channel.
    Hello(Hello),
    /// relay → agent, the answer to `hello`.
    Welcome(Welcome),
    /// agent → relay, every heartbeat interval.
    Heartbeat(Heartbeat),
    /// agent → relay, at connect and whenever the cluster's facts change.
    Metadata(Metadata),
    /// agent → relay, the agent's own health, every heartbeat interval or every few.
    Health(Health),
    /// agent → relay, a request for a new identity certificate.
    Renew(Renew),
    /// relay → agent, the certificate issued for a `renew`.
    Certificate(Certificate),
    /// relay → agent, why a request (today: `renew`) failed.
    Error(ErrorMessage),
    /// relay → agent, the cluster's guard RBAC snapshot: at each `hello` and after every change to the cluster's
    /// role assignments, deny assignments or the custom roles they use.
    GuardSnapshot(GuardSnapshot),
    /// agent → relay, a request for a user's groups from the relay's directory (group overage).
    ResolveGroups(ResolveGroups),
    /// relay → agent, the answer to a `resolveGroups` with the same `requestId`.
    Groups(Groups),
    /// relay → agent, sent as the relay goes away (shutdown, restart), just before the channel ends: when to
    /// come back, so a fleet of agents does not reconnect all at once.
    Draining(Draining),
    /// A message whose type this version does not know. Receivers ignore it; it is never sent (sending it
    /// writes `{"type":"unknown"}`).
    #[serde(other)]
    Unknown,
}

/// Payload of [`Message::Hello`].
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", default)]
pub struct Hello {
    /// The agent's version (semver, e.g. `0.1.0`).
    pub agent_version: String,
    /// A random id of the agent process, the same on each of its tunnels: tells the tunnels of two agent
    /// replicas sharing one identity apart (empty from older agents).
    #[serde(skip_serializing_if = "String::is_empty")]
    pub instance: String,
    /// How many tunnels this agent process keeps to the relay fleet (its K; 0 from older agents, read as 1).
    /// A cluster with fewer live tunnels than its agent keeps shows as `Degraded`.
    #[serde(skip_serializing_if = "is_zero")]
    pub tunnels: u32,
}

/// Payload of [`Message::Welcome`].
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", default)]
pub struct Welcome {
    /// How often the agent sends `heartbeat` (and `health`), in seconds.
    pub heartbeat_interval_seconds: u64,
    /// The newest agent version this relay offers, when it says.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub latest_agent_version: Option<String>,
    /// The id of the relay replica that holds this tunnel (empty from older relays). An agent keeping several
    /// tunnels spreads them over distinct replicas.
    #[serde(skip_serializing_if = "String::is_empty")]
    pub replica: String,
    /// How many relay replicas are live in the fleet, this one included (0 from older relays, read as 1):
    /// an agent keeps at most this many tunnels on distinct replicas.
    #[serde(skip_serializing_if = "is_zero")]
    pub replicas: u32,
}

/// Payload of [`Message::Heartbeat`].
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", default)]
pub struct Heartbeat {
    /// Counts up from 0 on each control channel.
    pub seq: u64,
}

/// Payload of [`Message::Metadata`]: what the agent found out about its cluster.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", default)]
pub struct Metadata {
    /// The apiserver's `gitVersion`, e.g. `v1.33.1+k3s1`.
    pub kubernetes_version: String,
    /// Number of nodes.
    pub node_count: u64,
    /// Sum of the nodes' CPU capacity, in millicores.
    pub total_cpu_millis: u64,
    /// Sum of the nodes' memory capacity, in bytes.
    pub total_memory_bytes: u64,
    /// `k3s`, `eks`, `gke`, `aks`, `openshift`, `kind`, … or `generic`.
    pub distribution: String,
    /// `aws`, `gcp`, `azure`, `vsphere`, … or `generic`.
    pub infrastructure: String,
    /// The agent's version.
    pub agent_version: String,
}

/// Payload of [`Message::Health`]: the agent process and its tunnel.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", default)]
pub struct Health {
    /// The agent's version.
    pub agent_version: String,
    /// Seconds since the agent process started.
    pub uptime_seconds: u64,
    /// Resident memory of the agent process, in bytes.
    pub memory_bytes: u64,
    /// CPU time the agent process used (user + system), in seconds.
    pub cpu_seconds: f64,
    /// How many times the agent reconnected its tunnel since it started.
    pub reconnects: u64,
    /// The tunnel's measured round-trip time in milliseconds, once known.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tunnel_rtt_millis: Option<f64>,
}

/// Payload of [`Message::Renew`].
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", default)]
pub struct Renew {
    /// A PEM certificate signing request for the agent's new key.
    pub csr: String,
}

/// Payload of [`Message::Certificate`].
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", default)]
pub struct Certificate {
    /// The new client certificate, PEM.
    pub certificate: String,
    /// Its expiry, RFC 3339.
    pub not_after: String,
}

/// Payload of [`Message::Error`].
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", default)]
pub struct ErrorMessage {
    /// What went wrong, for people.
    pub message: String,
}

/// Payload of [`Message::GuardSnapshot`].
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct GuardSnapshot {
    /// The cluster's snapshot (`version`, `roles`, `assignments`, `denyAssignments`), for this cluster only. The
    /// agent hands it to guard (`PUT /snapshot`), which validates it again.
    pub snapshot: tether_auth::Snapshot,
}

/// Payload of [`Message::ResolveGroups`].
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", default)]
pub struct ResolveGroups {
    /// Chosen by the agent, unique among its outstanding requests on this channel; echoed in the answer.
    pub request_id: u64,
    /// The user's tenant id (`tid`).
    pub tid: String,
    /// The user's object id (`oid`).
    pub oid: String,
}

/// Payload of [`Message::Groups`]: exactly one of `groups` and `error` is set.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", default)]
pub struct Groups {
    /// The `requestId` of the `resolveGroups` this answers.
    pub request_id: u64,
    /// The user's group ids, when the directory knows the user.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub groups: Option<Vec<String>>,
    /// Why there are no groups (unknown user, directory unavailable), for people.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
}

/// Payload of [`Message::Draining`].
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", default)]
pub struct Draining {
    /// The agent picks its first reconnect attempt uniformly at random within this many milliseconds (the
    /// relay's tunnel count divided by the accept rate it expects after a restart). Agents clamp it to a
    /// bound of their own.
    pub reconnect_within_ms: u64,
    /// Make before break: the relay keeps serving the streams of this tunnel, and opens new ones on it, until
    /// the agent has opened its replacement (to another replica) and sent GOAWAY on this tunnel, or until the
    /// relay's drain timeout. The agent dials the replacement at once (`reconnect_within_ms` does not apply).
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub make_before_break: bool,
}

fn is_zero(n: &u32) -> bool {
    *n == 0
}

/// Why a control message could not be sent or received.
#[derive(Debug, thiserror::Error)]
pub enum ControlError {
    /// Reading or writing the stream failed.
    #[error("control stream I/O failed: {0}")]
    Io(#[from] std::io::Error),
    /// A message is longer than [`MAX_MESSAGE_LEN`]; the receiver should reset the stream.
    #[error("control message of {0} bytes exceeds the {MAX_MESSAGE_LEN}-byte limit")]
    TooLarge(usize),
    /// The stream ended in the middle of a message.
    #[error("control stream ended in the middle of a message")]
    Truncated,
    /// The bytes were not a JSON object with a known shape for its `type`.
    #[error("malformed control message: {0}")]
    Malformed(#[source] serde_json::Error),
}

/// The framing: a 4-byte big-endian length, then the body, at most [`MAX_MESSAGE_LEN`] bytes.
fn codec() -> LengthDelimitedCodec {
    LengthDelimitedCodec::builder()
        .length_field_length(4)
        .big_endian()
        .max_frame_length(MAX_MESSAGE_LEN)
        .new_codec()
}

/// Encodes `message` with its length prefix.
pub fn encode(message: &Message) -> Result<Vec<u8>, ControlError> {
    let json = serde_json::to_vec(message).map_err(ControlError::Malformed)?;
    if json.len() > MAX_MESSAGE_LEN {
        return Err(ControlError::TooLarge(json.len()));
    }
    let mut out = BytesMut::with_capacity(4 + json.len());
    codec().encode(Bytes::from(json), &mut out)?;
    Ok(out.to_vec())
}

/// Decodes one message body (without the length prefix). Unknown types give [`Message::Unknown`].
pub fn decode(body: &[u8]) -> Result<Message, ControlError> {
    serde_json::from_slice(body).map_err(ControlError::Malformed)
}

/// Writes one message (length prefix and JSON) and flushes. A message over [`MAX_MESSAGE_LEN`] is refused
/// before anything is written.
pub async fn send<W>(stream: &mut W, message: &Message) -> Result<(), ControlError>
where
    W: AsyncWrite + Unpin + ?Sized,
{
    let frame = encode(message)?;
    stream.write_all(&frame).await?;
    stream.flush().await?;
    Ok(())
}

/// [`LengthDelimitedCodec`] with the control channel's errors: the length of a frame over the cap, and a stream
/// that ends inside a frame.
#[derive(Debug)]
struct Frames {
    codec: LengthDelimitedCodec,
    /// The codec took a frame's length prefix off the buffer and waits for its body.
    in_frame: bool,
}

impl Decoder for Frames {
    type Item = BytesMut;
    type Error = ControlError;

    fn decode(&mut self, src: &mut BytesMut) -> Result<Option<BytesMut>, ControlError> {
        let before = src.len();
        let frame = self.codec.decode(src).map_err(|e| {
            if e.kind() == std::io::ErrorKind::InvalidData {
                // The codec refuses before consuming the prefix, so it is still there to report.
                let len = src
                    .get(..4)
                    .map_or(0, |p| u32::from_be_bytes([p[0], p[1], p[2], p[3]]) as usize);
                ControlError::TooLarge(len)
            } else {
                ControlError::Io(e)
            }
        })?;
        self.in_frame = match frame {
            Some(_) => false,
            None => self.in_frame || src.len() < before,
        };
        Ok(frame)
    }

    fn decode_eof(&mut self, src: &mut BytesMut) -> Result<Option<BytesMut>, ControlError> {
        match self.decode(src)? {
            Some(frame) => Ok(Some(frame)),
            None if src.is_empty() && !self.in_frame => Ok(None),
            None => Err(ControlError::Truncated),
        }
    }
}

/// Receives control messages: keeps partly read messages across calls, so [`Reader::recv`] may sit in a
/// `tokio::select!` next to timers.
#[derive(Debug)]
pub struct Reader<R> {
    frames: FramedRead<R, Frames>,
}

impl<R: AsyncRead + Unpin> Reader<R> {
    /// Wraps the read side of a control stream.
    pub fn new(inner: R) -> Self {
        Self {
            frames: FramedRead::new(
                inner,
                Frames {
                    codec: codec(),
                    in_frame: false,
                },
            ),
        }
    }

    /// Reads the next message. `Ok(None)` when the stream ended cleanly between messages;
    /// [`ControlError::Truncated`] when it ended inside one; [`ControlError::TooLarge`] (without reading the body)
    /// when the length is over the cap; [`ControlError::Malformed`] for a frame that is not a message (the next
    /// call reads the frame after it). Cancel-safe: dropping the future loses nothing.
    pub async fn recv(&mut self) -> Result<Option<Message>, ControlError> {
        match self.frames.next().await {
            None => Ok(None),
            Some(frame) => decode(&frame?).map(Some),
        }
    }

    /// Gives back the wrapped reader (with any buffered bytes of the next message lost).
    pub fn into_inner(self) -> R {
        self.frames.into_inner()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::AsyncWriteExt;

    fn samples() -> Vec<Message> {
        vec![
            Message::Hello(Hello {
                agent_version: "0.1.0".into(),
                instance: "5f0c".into(),
                tunnels: 2,
            }),
            Message::Welcome(Welcome {
                heartbeat_interval_seconds: 30,
                latest_agent_version: Some("0.2.0".into()),
                replica: "relay-0".into(),
                replicas: 3,
            }),
            Message::Heartbeat(Heartbeat { seq: 7 }),
            Message::Metadata(Metadata {
                kubernetes_version: "v1.33.1+k3s1".into(),
                node_count: 3,
                total_cpu_millis: 12_000,
                total_memory_bytes: 48 << 30,
                distribution: "k3s".into(),
                infrastructure: "aws".into(),
                agent_version: "0.1.0".into(),
            }),
            Message::Health(Health {
                agent_version: "0.1.0".into(),
                uptime_seconds: 12,
                memory_bytes: 30 << 20,
                cpu_seconds: 0.5,
                reconnects: 1,
                tunnel_rtt_millis: Some(1.25),
            }),
            Message::Renew(Renew {
                csr: "-----BEGIN CERTIFICATE REQUEST-----".into(),
            }),
            Message::Certificate(Certificate {
                certificate: "-----BEGIN CERTIFICATE-----".into(),
                not_after: "2027-01-01T00:00:00Z".into(),
            }),
            Message::Error(ErrorMessage {
                message: "nope".into(),
            }),
            Message::GuardSnapshot(GuardSnapshot {
                snapshot: tether_auth::Snapshot {
                    version: 3,
                    ..Default::default()
                },
            }),
            Message::ResolveGroups(ResolveGroups {
                request_id: 1,
                tid: "t".into(),
                oid: "o".into(),
            }),
            Message::Groups(Groups {
                request_id: 1,
                groups: Some(vec!["g1".into()]),
                error: None,
            }),
            Message::Groups(Groups {
                request_id: 2,
                groups: None,
                error: Some("unknown user".into()),
            }),
            Message::Draining(Draining {
                reconnect_within_ms: 10_000,
                make_before_break: true,
            }),
        ]
    }

    #[tokio::test]
    async fn round_trip_over_a_pipe() -> anyhow::Result<()> {
        let (mut a, b) = tokio::io::duplex(64);
        let sent = samples();
        let writer = {
            let sent = sent.clone();
            tokio::spawn(async move {
                for m in &sent {
                    send(&mut a, m).await?;
                }
                a.shutdown().await?;
                anyhow::Ok(())
            })
        };
        let mut got = Vec::new();
        let mut b = Reader::new(b);
        while let Some(m) = b.recv().await? {
            got.push(m);
        }
        writer.await??;
        assert_eq!(got, sent);
        Ok(())
    }

    #[tokio::test]
    async fn reader_round_trip_and_clean_end() -> anyhow::Result<()> {
        let mut bytes = Vec::new();
        for m in samples() {
            bytes.extend(encode(&m)?);
        }
        let mut reader = Reader::new(&bytes[..]);
        let mut got = Vec::new();
        while let Some(m) = reader.recv().await? {
            got.push(m);
        }
        assert_eq!(got, samples());
        Ok(())
    }

    #[test]
    fn wire_format_is_camel_case_with_a_type() -> anyhow::Result<()> {
        let frame = encode(&Message::Welcome(Welcome {
            heartbeat_interval_seconds: 30,
            ..Welcome::default()
        }))?;
        let json = r#"{"type":"welcome","heartbeatIntervalSeconds":30}"#;
        assert_eq!(&frame[..4], &(json.len() as u32).to_be_bytes());
        assert_eq!(std::str::from_utf8(&frame[4..])?, json);
        let health: serde_json::Value = serde_json::from_slice(
            &encode(&Message::Health(Health {
                tunnel_rtt_millis: Some(2.0),
                ..Health::default()
            }))?[4..],
        )?;
        assert_eq!(health["type"], "health");
        assert_eq!(health["tunnelRttMillis"], 2.0);
        assert!(health.get("uptimeSeconds").is_some());
        Ok(())
    }

    #[test]
    fn guard_messages_wire_format() -> anyhow::Result<()> {
        let frame = encode(&Message::ResolveGroups(ResolveGroups {
            request_id: 5,
            tid: "t".into(),
            oid: "o".into(),
        }))?;
        assert_eq!(
            std::str::from_utf8(&frame[4..])?,
            r#"{"type":"resolveGroups","requestId":5,"tid":"t","oid":"o"}"#
        );
        let frame = encode(&Message::Groups(Groups {
            request_id: 5,
            groups: None,
            error: Some("no".into()),
        }))?;
        assert_eq!(
            std::str::from_utf8(&frame[4..])?,
            r#"{"type":"groups","requestId":5,"error":"no"}"#
        );
        let m = decode(br#"{"type":"guardSnapshot","snapshot":{"version":2}}"#)?;
        assert_eq!(
            m,
            Message::GuardSnapshot(GuardSnapshot {
                snapshot: tether_auth::Snapshot {
                    version: 2,
                    ..Default::default()
                }
            })
        );
        Ok(())
    }

    #[tokio::test]
    async fn unknown_type_is_decoded_as_unknown_and_the_stream_goes_on() -> anyhow::Result<()> {
        let mut bytes = Vec::new();
        let unknown = br#"{"type":"roleAssignments","items":[{"a":1}]}"#;
        bytes.extend((unknown.len() as u32).to_be_bytes());
        bytes.extend(unknown);
        bytes.extend(encode(&Message::Heartbeat(Heartbeat { seq: 1 }))?);
        let mut r = Reader::new(&bytes[..]);
        assert_eq!(r.recv().await?, Some(Message::Unknown));
        assert_eq!(
            r.recv().await?,
            Some(Message::Heartbeat(Heartbeat { seq: 1 }))
        );
        assert_eq!(r.recv().await?, None);
        Ok(())
    }

    #[test]
    fn extra_and_missing_fields_are_tolerated() -> anyhow::Result<()> {
        let m = decode(br#"{"type":"hello","agentVersion":"1.2.3","future":true}"#)?;
        assert_eq!(
            m,
            Message::Hello(Hello {
                agent_version: "1.2.3".into(),
                ..Hello::default()
            })
        );
        let m = decode(br#"{"type":"heartbeat"}"#)?;
        assert_eq!(m, Message::Heartbeat(Heartbeat { seq: 0 }));
        Ok(())
    }

    #[test]
    fn malformed_json_and_missing_type_are_errors() {
        assert!(matches!(
            decode(b"not json"),
            Err(ControlError::Malformed(_))
        ));
        assert!(matches!(
            decode(br#"{"seq":1}"#),
            Err(ControlError::Malformed(_))
        ));
    }

    #[tokio::test]
    async fn oversize_is_refused_on_both_sides() -> anyhow::Result<()> {
        let big = Message::Error(ErrorMessage {
            message: "x".repeat(MAX_MESSAGE_LEN),
        });
        let mut sink = Vec::new();
        assert!(matches!(
            send(&mut sink, &big).await,
            Err(ControlError::TooLarge(_))
        ));
        assert!(sink.is_empty(), "nothing written for a refused message");

        let prefix = ((MAX_MESSAGE_LEN + 1) as u32).to_be_bytes();
        let mut r = Reader::new(&prefix[..]);
        assert!(matches!(
            r.recv().await,
            Err(ControlError::TooLarge(n)) if n == MAX_MESSAGE_LEN + 1
        ));
        let mut reader = Reader::new(&prefix[..]);
        assert!(matches!(
            reader.recv().await,
            Err(ControlError::TooLarge(_))
        ));

        // Exactly at the cap is fine.
        let json = format!(
            r#"{{"type":"error","message":"{}"}}"#,
            "y".repeat(MAX_MESSAGE_LEN - 30)
        );
        let mut frame = (json.len() as u32).to_be_bytes().to_vec();
        frame.extend(json.as_bytes());
        assert!(json.len() <= MAX_MESSAGE_LEN);
        let mut r = Reader::new(&frame[..]);
        assert!(matches!(r.recv().await?, Some(Message::Error(_))));
        Ok(())
    }

    #[tokio::test]
    async fn truncated_prefix_or_body_is_an_error() -> anyhow::Result<()> {
        let frame = encode(&Message::Heartbeat(Heartbeat { seq: 3 }))?;
        for cut in [1, 3, 4, frame.len() - 1] {
            let mut r = Reader::new(&frame[..cut]);
            assert!(
                matches!(r.recv().await, Err(ControlError::Truncated)),
                "cut at {cut}"
            );
            let mut reader = Reader::new(&frame[..cut]);
            assert!(
                matches!(reader.recv().await, Err(ControlError::Truncated)),
                "reader cut at {cut}"
            );
        }
        let empty: &[u8] = &[];
        assert!(Reader::new(empty).recv().await?.is_none());
        Ok(())
    }

    #[tokio::test]
    async fn a_malformed_frame_does_not_end_the_reader() -> anyhow::Result<()> {
        let mut bytes = Vec::new();
        bytes.extend(4u32.to_be_bytes());
        bytes.extend(b"{bad");
        bytes.extend(encode(&Message::Heartbeat(Heartbeat { seq: 2 }))?);
        let mut r = Reader::new(&bytes[..]);
        assert!(matches!(r.recv().await, Err(ControlError::Malformed(_))));
        assert_eq!(
            r.recv().await?,
            Some(Message::Heartbeat(Heartbeat { seq: 2 }))
        );
        assert_eq!(r.recv().await?, None);
        Ok(())
    }

    #[tokio::test]
    async fn reader_survives_cancellation_mid_message() -> anyhow::Result<()> {
        let (mut a, b) = tokio::io::duplex(1024);
        let mut reader = Reader::new(b);
        let frame = encode(&Message::Heartbeat(Heartbeat { seq: 9 }))?;
        a.write_all(&frame[..5]).await?;
        // The receive cannot finish yet; dropping it must keep the five bytes.
        let pending = tokio::time::timeout(std::time::Duration::ZERO, reader.recv()).await;
        assert!(pending.is_err());
        a.write_all(&frame[5..]).await?;
        assert_eq!(
            reader.recv().await?,
            Some(Message::Heartbeat(Heartbeat { seq: 9 }))
        );
        Ok(())
    }
}
