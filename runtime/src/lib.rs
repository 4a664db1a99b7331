//! What every Tether program does the same way, so each `main` only wires: one way to parse flags, exiting 64 on
//! bad ones ([`cli::parse`]), one duration syntax ([`parse_duration`]), one type for secrets ([`Secret`], whose
//! `Debug` prints `***`), one logging setup and one stop signal ([`process`]), and one way to build TLS
//! configurations with the one crypto provider, aws-lc-rs ([`tls`]), and one TLS + HTTP/1.1 + HTTP/2 accept loop
//! ([`serve`]), optionally serving each connection on a shard, a single-threaded runtime, placed by its first
//! request ([`shards`]).
//!
//! What it does not do: know about tunnels, routes, Kubernetes or any one program's configuration.

pub mod cli;
mod duration;
pub mod process;
mod secret;
pub mod serve;
pub mod shards;
pub mod tls;

pub use duration::parse_duration;
pub use secret::Secret;
