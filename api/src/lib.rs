//! The typed contract between Tether's programs, used by both sides of each exchange so they cannot drift:
//!
//! - [`admin`]: the admin REST API's request and response bodies (the relay serializes them, `tether`
//!   deserializes them).
//! - [`control`]: the messages relay and agent exchange on a tunnel's control stream (hello, heartbeat, metadata,
//!   health, renewal, guard snapshots, group overage, draining) and their framing.
//! - [`reconnect`]: how an agent paces its reconnects, including its reading of the relay's `draining` window (the
//!   load generator's simulated agents use the same code).
//! - [`refusal`]: the HTTP status in a relay's refusal of a QUIC tunnel (agent and load generator read it alike).
//!
//! What it does not do: open connections or streams, decide who sends what when (relay and agent do), or serve HTTP.

pub mod admin;
pub mod control;
pub mod reconnect;
pub mod refusal;
