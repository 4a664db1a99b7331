//! Passing guard RBAC snapshots on: the relay sends `guardSnapshot` over the control channel (at each `hello`
//! and after every change to the cluster's assignments), and the agent PUTs it to guard's `/snapshot` with the
//! push token — and its push certificate as the TLS client certificate, when configured (guard's
//! `--snapshot-client-ca`) — retrying with backoff until guard accepts it.
//!
//! Only the newest snapshot is kept pending: a newer one replaces one not yet delivered (and is tried at once),
//! an older one is dropped. Guard itself accepts only strictly newer versions (an equal one is answered as
//! already current), validates, and persists the snapshot. Logs name versions, never contents or the token.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::{Method, Request, StatusCode, header};
use http_body_util::{BodyExt, Full, Limited};
use hyper_rustls::HttpsConnector;
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use serde_json::Value;
use tether_auth::Snapshot;
use tokio::sync::watch;
use tokio::task::JoinHandle;

use crate::config::GuardConfig;

/// Largest answer read from guard.
const MAX_ANSWER_BYTES: usize = 64 * 1024;

/// One snapshot waiting to be delivered.
#[derive(Clone, Debug)]
struct Pending {
    version: u64,
    body: Bytes,
}

/// The control channel's side: hands snapshots to the pusher task. Cheap to clone.
#[derive(Clone, Debug)]
pub(crate) struct SnapshotSink {
    pending: Arc<watch::Sender<Option<Pending>>>,
}

impl SnapshotSink {
    /// Queues `snapshot` (the guard snapshot the relay sent) unless a newer one is already pending.
    pub(crate) fn offer(&self, snapshot: &Snapshot) {
        let version = snapshot.version;
        let body = match serde_json::to_vec(snapshot) {
            Ok(body) => Bytes::from(body),
            Err(e) => {
                tracing::warn!(version, error = %e, "cannot serialize a guard snapshot");
                return;
            }
        };
        let queued = self.pending.send_if_modified(|slot| match slot {
            Some(p) if p.version > version => false,
            _ => {
                *slot = Some(Pending { version, body });
                true
            }
        });
        if queued {
            tracing::debug!(version, "guard snapshot received from the relay");
        } else {
            tracing::debug!(
                version,
                "ignoring a guard snapshot older than the one pending"
            );
        }
    }

    /// The version of the newest snapshot offered (0 when none).
    #[cfg(test)]
    fn pending_version(&self) -> u64 {
        self.pending.borrow().as_ref().map_or(0, |p| p.version)
    }
}

/// The running pusher; stops when dropped.
#[derive(Debug)]
pub(crate) struct SnapshotPusher {
    task: JoinHandle<()>,
}

impl Drop for SnapshotPusher {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// Starts the pusher task for `config`; returns the sink the control channel offers snapshots to. Fails when
/// the guard CA or the push certificate cannot be read or used (a key that does not match its certificate
/// included).
pub(crate) fn spawn(
    config: &GuardConfig,
) -> Result<(SnapshotSink, SnapshotPusher), tether_runtime::tls::TlsError> {
    use tether_runtime::tls::{ClientIdentity, ClientOptions, read_file};
    let ca = config.ca.as_deref().map(read_file).transpose()?;
    let cert = config.client_cert.as_deref().map(read_file).transpose()?;
    let key = config.client_key.as_deref().map(read_file).transpose()?;
    let identity = match (&cert, &key) {
        (Some(cert_pem), Some(key_pem)) => Some(ClientIdentity { cert_pem, key_pem }),
        _ => None,
    };
    // hyper-rustls sets ALPN itself.
    let tls = tether_runtime::tls::client_config_with(&ClientOptions {
        ca_pem: ca.as_deref(),
        identity,
        ..ClientOptions::default()
    })?;
    let connector = hyper_rustls::HttpsConnectorBuilder::new()
        .with_tls_config(Arc::unwrap_or_clone(tls))
        .https_only()
        .enable_http1()
        .build();
    let client = Client::builder(TokioExecutor::new())
        .pool_idle_timeout(Duration::from_secs(30))
        .build(connector);
    let (tx, rx) = watch::channel(None);
    let task = tokio::spawn(run(
        Target {
            client,
            config: config.clone(),
        },
        rx,
    ));
    Ok((
        SnapshotSink {
            pending: Arc::new(tx),
        },
        SnapshotPusher { task },
    ))
}

struct Target {
    client: Client<HttpsConnector<HttpConnector>, Full<Bytes>>,
    config: GuardConfig,
}

/// What guard made of a push.
#[derive(Debug, PartialEq, Eq)]
enum Outcome {
    /// The snapshot is in use.
    Applied,
    /// Guard already holds this version or a newer one.
    Current(u64),
    /// Guard refused the snapshot itself (invalid, too large): retrying the same one cannot help.
    Rejected(String),
    /// Guard could not be reached, refused the token, or failed: retry.
    Failed(String),
}

async fn run(target: Target, mut pending: watch::Receiver<Option<Pending>>) {
    let mut failures: u32 = 0;
    let mut last_failure: Option<String> = None;
    loop {
        if pending.changed().await.is_err() {
            return;
        }
        loop {
            let Some(snapshot) = pending.borrow_and_update().clone() else {
                break;
            };
            let version = snapshot.version;
            let delay = match target.push(&snapshot).await {
                Outcome::Applied => {
                    tracing::info!(version, after_failures = failures, "guard snapshot pushed");
                    failures = 0;
                    last_failure = None;
                    break;
                }
                Outcome::Current(current) => {
                    tracing::debug!(version, current, "guard already holds this snapshot");
                    failures = 0;
                    last_failure = None;
                    break;
                }
                Outcome::Rejected(reason) => {
                    tracing::error!(version, %reason, "guard refused the snapshot; waiting for the next one");
                    failures = 0;
                    last_failure = None;
                    break;
                }
                Outcome::Failed(reason) => {
                    let delay = target.config.backoff.delay(failures, &mut rand::rng());
                    failures = failures.saturating_add(1);
                    if last_failure.as_deref() == Some(reason.as_str()) {
                        tracing::debug!(version, %reason, retry_in = ?delay, "pushing the guard snapshot failed");
                    } else {
                        tracing::warn!(version, %reason, retry_in = ?delay, "pushing the guard snapshot failed; retrying with backoff");
                        last_failure = Some(reason);
                    }
                    delay
                }
            };
            // A newer snapshot is tried at once; the same one after the delay.
            tokio::select! {
                () = tokio::time::sleep(delay) => {}
                changed = pending.changed() => if changed.is_err() { return },
            }
        }
    }
}

impl Target {
    async fn push(&self, snapshot: &Pending) -> Outcome {
        let request = Request::builder()
            .method(Method::PUT)
            .uri(&self.config.url)
            .header(
                header::AUTHORIZATION,
                format!("Bearer {}", self.config.push_token.expose().trim()),
            )
            .header(header::CONTENT_TYPE, "application/json")
            .header(
                header::USER_AGENT,
                concat!("tether-agent/", env!("CARGO_PKG_VERSION")),
            )
            .body(Full::new(snapshot.body.clone()));
        let request = match request {
            Ok(request) => request,
            Err(e) => return Outcome::Failed(format!("cannot build the request: {e}")),
        };
        let exchange = async {
            let response = self
                .client
                .request(request)
                .await
                .map_err(|e| crate::error_chain(&e))?;
            let status = response.status();
            let body = Limited::new(response.into_body(), MAX_ANSWER_BYTES)
                .collect()
                .await
                .map_err(|e| format!("reading guard's answer: {e}"))?
                .to_bytes();
            Ok::<_, String>((status, body))
        };
        let (status, body) = match tokio::time::timeout(self.config.timeout, exchange).await {
            Ok(Ok(answer)) => answer,
            Ok(Err(e)) => return Outcome::Failed(e),
            Err(_) => {
                return Outcome::Failed(format!("no answer within {:?}", self.config.timeout));
            }
        };
        let json: Option<Value> = serde_json::from_slice(&body).ok();
        let message = json
            .as_ref()
            .and_then(|v| v.get("message"))
            .and_then(Value::as_str)
            .unwrap_or("")
            .to_owned();
        match status {
            StatusCode::OK => {
                let applied = json
                    .as_ref()
                    .and_then(|v| v.get("applied"))
                    .and_then(Value::as_bool);
                let current = json
                    .as_ref()
                    .and_then(|v| v.get("version"))
                    .and_then(Value::as_u64)
                    .unwrap_or(snapshot.version);
                match applied {
                    Some(false) => Outcome::Current(current),
                    _ => Outcome::Applied,
                }
            }
            StatusCode::BAD_REQUEST | StatusCode::PAYLOAD_TOO_LARGE => {
                Outcome::Rejected(format!("HTTP {status}: {message}"))
            }
            StatusCode::UNAUTHORIZED => Outcome::Failed(format!(
                "guard refused the push credentials (HTTP {status}: {message}): check --guard-push-token-file and \
                 --guard-client-cert against guard's --snapshot-client-ca/--snapshot-client-cn"
            )),
            StatusCode::NOT_FOUND => Outcome::Failed(format!(
                "HTTP {status}: is snapshot pushing enabled on guard (--snapshot-push-token-file), and is the URL its /snapshot?"
            )),
            _ => Outcome::Failed(format!("HTTP {status}: {message}")),
        }
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn only_the_newest_snapshot_stays_pending() {
        let (tx, mut rx) = watch::channel(None);
        let sink = SnapshotSink {
            pending: Arc::new(tx),
        };
        let v = |version| Snapshot {
            version,
            ..Snapshot::default()
        };
        sink.offer(&v(3));
        assert_eq!(sink.pending_version(), 3);
        assert!(rx.has_changed().unwrap());
        rx.borrow_and_update();

        sink.offer(&v(2));
        assert_eq!(sink.pending_version(), 3);
        assert!(!rx.has_changed().unwrap());
        // The same version again (the relay re-sends at each hello) is pushed again: guard may have lost it.
        sink.offer(&v(3));
        assert!(rx.has_changed().unwrap());
        sink.offer(&v(5));
        assert_eq!(sink.pending_version(), 5);
        let body = rx.borrow_and_update().clone().unwrap().body;
        let json: Value = serde_json::from_slice(&body).unwrap();
        assert_eq!(json["version"], 5);
    }
}
