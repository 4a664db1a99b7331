//! The audit log: one JSON line per decision. It carries the object id, a hash of the group set, the data actions,
//! the scope, the decision, its reason, its source and latency — never a token, never a username.

use std::io::Write as _;
use std::path::Path;
use std::sync::{Arc, Mutex};

use serde::Serialize;

/// One audit line.
#[derive(Clone, Debug, Serialize, PartialEq, Eq)]
pub struct AuditRecord {
    /// Milliseconds since the Unix epoch.
    pub ts_ms: u64,
    /// The request id (the caller's `Audit-ID`/`X-Request-Id` header, else a random one).
    pub request_id: String,
    /// `authenticate` or `authorize`.
    pub webhook: &'static str,
    /// The principal's object id, when known.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub oid: Option<String>,
    /// Hash of the sorted group set ([`crate::cache::hash_groups`]), when known.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub groups_hash: Option<String>,
    /// Data actions (authorization only).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub actions: Vec<String>,
    /// `cluster` or `namespace/NAME` (authorization only).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub scope: Option<String>,
    /// `allowed`, `denied`, `no_opinion`, `authenticated`, `unauthenticated`, `error`.
    pub decision: &'static str,
    /// The reason given to the caller.
    pub reason: String,
    /// `cache`, `evaluation`, `token` or `error`.
    pub source: &'static str,
    /// Time to decide, in microseconds.
    pub latency_us: u64,
}

/// Where audit lines go.
#[derive(Clone, Default)]
pub enum AuditSink {
    /// Nowhere.
    #[default]
    Off,
    /// Standard output.
    Stdout,
    /// Appended to a file, one write per line.
    File(Arc<Mutex<std::fs::File>>),
    /// Kept in memory (tests).
    Memory(Arc<Mutex<Vec<String>>>),
}

impl std::fmt::Debug for AuditSink {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            AuditSink::Off => "Off",
            AuditSink::Stdout => "Stdout",
            AuditSink::File(_) => "File",
            AuditSink::Memory(_) => "Memory",
        })
    }
}

impl AuditSink {
    /// Opens `path` for appending (created with mode 0600 on Unix).
    pub fn file(path: &Path) -> std::io::Result<Self> {
        let mut options = std::fs::OpenOptions::new();
        options.create(true).append(true);
        #[cfg(unix)]
        {
            use std::os::unix::fs::OpenOptionsExt as _;
            options.mode(0o600);
        }
        Ok(AuditSink::File(Arc::new(Mutex::new(options.open(path)?))))
    }

    /// A sink kept in memory, and the lines it receives.
    pub fn memory() -> (Self, Arc<Mutex<Vec<String>>>) {
        let lines = Arc::new(Mutex::new(Vec::new()));
        (AuditSink::Memory(lines.clone()), lines)
    }

    /// Writes one record as a JSON line. Failures are logged, never fatal to the decision.
    pub fn record(&self, record: &AuditRecord) {
        if matches!(self, AuditSink::Off) {
            return;
        }
        let Ok(mut line) = serde_json::to_string(record) else {
            return;
        };
        match self {
            AuditSink::Off => {}
            AuditSink::Stdout => {
                line.push('\n');
                let _ = std::io::stdout().lock().write_all(line.as_bytes());
            }
            AuditSink::File(f) => {
                line.push('\n');
                let mut f = f.lock().unwrap_or_else(|p| p.into_inner());
                if let Err(e) = f.write_all(line.as_bytes()) {
                    tracing::warn!(error = %e, "writing the audit log failed");
                }
            }
            AuditSink::Memory(lines) => {
                lines.lock().unwrap_or_else(|p| p.into_inner()).push(line);
            }
        }
    }
}
