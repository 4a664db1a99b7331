//! Dialing one tunnel, and the transport it takes.
//!
//! - [`Mode::Wss`]: WebSocket over TLS (TCP), through the HTTP proxy when one applies to the relay.
//! - [`Mode::Quic`]: QUIC (UDP) to the relay URL's host and port.
//! - [`Mode::Race`]: QUIC first; WebSocket starts when QUIC has not connected within [`QUIC_HEAD_START`] (or at
//!   once when QUIC fails outright), and whichever connects first is used at once. Once both were started,
//!   both run to their end, so a handshake the relay already completed is never cut: a QUIC tunnel that
//!   connects after WebSocket won is delivered too (the supervisor moves over to it), and when QUIC fails its
//!   error is reported ([`Event::QuicFailed`]) — the reason the agent logs for running on WebSocket.
//!
//! Each attempt runs in its own task and reports through [`Events`]; every attempt ends with
//! [`Event::DialDone`]. The identity presented is the one given to [`Dialer::spawn`].

use std::sync::Arc;
use std::time::Duration;

use http::{HeaderMap, HeaderValue, StatusCode};
use tether_runtime::tls;
use tether_tunnel::proxy::ProxyConfig;
use tether_tunnel::quic::{self, QuicError};
use tether_tunnel::ws::{self, ConnectError};
use tether_tunnel::{Connection, Role, SessionConfig, kind};
use tokio::task::AbortHandle;

use crate::config::RelayEndpoint;
use crate::error::{AgentError, refusal};
use crate::event::{DialId, Event, Events};
use crate::identity::Identity;

/// How long QUIC has to connect alone before WebSocket is dialled beside it. QUIC needs about two round trips
/// (its handshake, then the tunnel's HELLO and WELCOME), so this leaves it room on paths up to ~400 ms while
/// an agent whose UDP is blocked is on WebSocket a second later.
pub(crate) const QUIC_HEAD_START: Duration = Duration::from_secs(1);

/// Which transports an attempt may use.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Mode {
    /// QUIC with a head start, WebSocket beside it.
    Race,
    /// QUIC only.
    Quic,
    /// WebSocket only.
    Wss,
}

/// TLS material for the relay: its CA (or the platform roots) plus the proxy's CA, and the identity.
pub(crate) struct RelayTls {
    pub(crate) relay_ca: Option<Vec<u8>>,
    pub(crate) proxy_ca: Option<Vec<u8>>,
}

impl RelayTls {
    /// A client configuration presenting `identity`, if any.
    pub(crate) fn config(
        &self,
        identity: Option<&Identity>,
    ) -> Result<Arc<rustls::ClientConfig>, tls::TlsError> {
        tls::client_config_with(&tls::ClientOptions {
            ca_pem: self.relay_ca.as_deref(),
            extra_ca_pem: self.proxy_ca.as_deref(),
            identity: identity.map(|id| tls::ClientIdentity {
                cert_pem: id.certificate.as_bytes(),
                key_pem: id.key.expose().as_bytes(),
            }),
            alpn: &[b"http/1.1"],
        })
    }
}

/// Everything an attempt needs but the relay, the identity and the mode.
pub(crate) struct Dialer {
    pub(crate) tls: RelayTls,
    /// `Tether-Cluster`, `Tether-Agent-Version` (WebSocket request headers, QUIC HELLO).
    pub(crate) headers: HeaderMap,
    /// The tunnel's session settings (streams, keepalive, idle timeout).
    pub(crate) session: SessionConfig,
    /// A QUIC tunnel's keepalive and idle timeout, which replace the session's: QUIC tunnels learn of a dead
    /// peer only by its silence (see `--quic-timeout`).
    pub(crate) quic_liveness: (Duration, Duration),
    /// Bound of each transport's attempt.
    pub(crate) connect_timeout: Duration,
    pub(crate) proxy: Option<ProxyConfig>,
}

/// How one transport's attempt ended badly.
enum Failure {
    /// The relay refused the identity: fatal (unless it was replaced meanwhile).
    Refused(AgentError),
    /// Anything else; worth another attempt.
    Failed(String),
}

impl Dialer {
    /// The session settings and request headers of a tunnel for `cluster`.
    pub(crate) fn headers(cluster: &str) -> HeaderMap {
        let mut headers = HeaderMap::new();
        if let Ok(value) = HeaderValue::try_from(cluster) {
            headers.insert("tether-cluster", value);
        }
        headers.insert(
            "tether-agent-version",
            HeaderValue::from_static(env!("CARGO_PKG_VERSION")),
        );
        // The stream kinds this agent serves: HTTP/1.1 streams and binary heads (the relay uses the latter).
        let kinds = format!("{}, {}", kind::HTTP, kind::HTTP_HEADS);
        if let Ok(value) = HeaderValue::try_from(kinds) {
            headers.insert("tether-stream-kinds", value);
        }
        headers
    }

    /// Starts attempt `dial` to `relay` presenting `identity`; its events go to `events`. Aborting the handle
    /// drops the attempt (and any tunnel it has not delivered yet).
    pub(crate) fn spawn(
        self: &Arc<Self>,
        dial: DialId,
        relay: RelayEndpoint,
        identity: Identity,
        mode: Mode,
        events: Events,
    ) -> AbortHandle {
        let dialer = Arc::clone(self);
        tokio::spawn(async move {
            match dialer.tls.config(Some(&identity)) {
                Ok(tls) => dialer.attempt(dial, &relay, tls, mode, &events).await,
                Err(e) => events.send(Event::DialFailed {
                    dial,
                    error: format!("cannot set up TLS to the relay: {e}"),
                }),
            }
            events.send(Event::DialDone { dial });
        })
        .abort_handle()
    }

    async fn attempt(
        &self,
        dial: DialId,
        relay: &RelayEndpoint,
        tls: Arc<rustls::ClientConfig>,
        mode: Mode,
        events: &Events,
    ) {
        let deliver = |result: Result<Connection, Failure>| match result {
            Ok(conn) => events.send(Event::Dialed { dial, conn }),
            Err(Failure::Refused(error)) => events.send(Event::DialRefused { dial, error }),
            Err(Failure::Failed(error)) => events.send(Event::DialFailed { dial, error }),
        };
        match mode {
            Mode::Wss => deliver(self.wss(relay, tls).await),
            Mode::Quic => deliver(self.quic(relay, tls).await),
            Mode::Race => self.race(dial, relay, tls, events).await,
        }
    }

    async fn race(
        &self,
        dial: DialId,
        relay: &RelayEndpoint,
        tls: Arc<rustls::ClientConfig>,
        events: &Events,
    ) {
        let quic = self.quic(relay, tls.clone());
        tokio::pin!(quic);
        let quic_error = tokio::select! {
            result = &mut quic => match result {
                Ok(conn) => return events.send(Event::Dialed { dial, conn }),
                Err(Failure::Refused(error)) => return events.send(Event::DialRefused { dial, error }),
                Err(Failure::Failed(error)) => error,
            },
            () = tokio::time::sleep(QUIC_HEAD_START) => {
                // Both from here on, each to its end.
                let wss = self.wss(relay, tls);
                tokio::pin!(wss);
                let (mut quic_done, mut wss_done) = (false, false);
                let mut delivered = false;
                let mut errors: (Option<String>, Option<String>) = (None, None);
                while !(quic_done && wss_done) {
                    tokio::select! {
                        result = &mut quic, if !quic_done => {
                            quic_done = true;
                            match result {
                                Ok(conn) => {
                                    delivered = true;
                                    events.send(Event::Dialed { dial, conn });
                                }
                                Err(Failure::Refused(error)) if !delivered => {
                                    return events.send(Event::DialRefused { dial, error });
                                }
                                Err(Failure::Refused(error)) => errors.0 = Some(error.to_string()),
                                Err(Failure::Failed(error)) => errors.0 = Some(error),
                            }
                        }
                        result = &mut wss, if !wss_done => {
                            wss_done = true;
                            match result {
                                Ok(conn) => {
                                    delivered = true;
                                    events.send(Event::Dialed { dial, conn });
                                }
                                Err(Failure::Refused(error)) if !delivered => {
                                    return events.send(Event::DialRefused { dial, error });
                                }
                                Err(Failure::Refused(error)) => errors.1 = Some(error.to_string()),
                                Err(Failure::Failed(error)) => errors.1 = Some(error),
                            }
                        }
                    }
                }
                match errors {
                    (Some(quic), Some(wss)) => events.send(Event::DialFailed {
                        dial,
                        error: format!("QUIC: {quic}; WebSocket: {wss}"),
                    }),
                    (Some(error), None) => events.send(Event::QuicFailed { dial, error }),
                    (None, Some(error)) => {
                        tracing::debug!(%error, "WebSocket attempt failed after QUIC connected");
                    }
                    (None, None) => {}
                }
                return;
            }
        };
        // QUIC failed before its head start ran out: WebSocket alone.
        match self.wss(relay, tls).await {
            Ok(conn) => {
                events.send(Event::Dialed { dial, conn });
                events.send(Event::QuicFailed {
                    dial,
                    error: quic_error,
                });
            }
            Err(Failure::Refused(error)) => events.send(Event::DialRefused { dial, error }),
            Err(Failure::Failed(error)) => events.send(Event::DialFailed {
                dial,
                error: format!("QUIC: {quic_error}; WebSocket: {error}"),
            }),
        }
    }

    async fn wss(
        &self,
        relay: &RelayEndpoint,
        tls: Arc<rustls::ClientConfig>,
    ) -> Result<Connection, Failure> {
        let connecting = ws::connect_with_proxy(
            &relay.tunnel_url,
            tls,
            self.headers.clone(),
            self.session.clone(),
            self.proxy.as_ref(),
        );
        match tokio::time::timeout(self.connect_timeout, connecting).await {
            Ok(Ok(conn)) => Ok(conn),
            Ok(Err(ConnectError::Rejected { status, body })) => match refusal(status, &body) {
                Some(fatal) => {
                    tracing::debug!(%status, relay_says = %body, "the relay refused the identity");
                    Err(Failure::Refused(fatal))
                }
                None => Err(Failure::Failed(format!(
                    "the relay answered HTTP {status}: {}",
                    crate::onboard::status_message(body.as_bytes())
                ))),
            },
            Ok(Err(e)) => Err(Failure::Failed(crate::error_chain(&e))),
            Err(_) => Err(Failure::Failed(format!(
                "timed out after {:?}",
                self.connect_timeout
            ))),
        }
    }

    async fn quic(
        &self,
        relay: &RelayEndpoint,
        tls: Arc<rustls::ClientConfig>,
    ) -> Result<Connection, Failure> {
        let mut session = self.session.clone();
        session.handshake_timeout = self.connect_timeout;
        (session.keepalive_interval, session.idle_timeout) = self.quic_liveness;
        let connecting = quic::connect(&relay.url, tls, self.headers.clone(), session);
        // quic::connect bounds the tunnel handshake; this bounds the name lookup too.
        match tokio::time::timeout(self.connect_timeout, connecting).await {
            Ok(Ok(conn)) => Ok(conn),
            Ok(Err(QuicError::Rejected { code, reason })) => {
                // The relay's refusal carries the same Kubernetes Status as the WebSocket one.
                let status = tether_api::refusal::status_code(&reason)
                    .and_then(|c| StatusCode::from_u16(c).ok());
                match status.and_then(|status| refusal(status, &reason)) {
                    Some(fatal) => Err(Failure::Refused(fatal)),
                    None => Err(Failure::Failed(format!(
                        "the relay refused the QUIC tunnel (code {code}): {}",
                        crate::onboard::status_message(reason.as_bytes())
                    ))),
                }
            }
            Ok(Err(QuicError::TimedOut)) | Err(_) => Err(Failure::Failed(format!(
                "no QUIC answer within {:?} (is outbound UDP to the relay blocked?)",
                self.connect_timeout
            ))),
            Ok(Err(e)) => Err(Failure::Failed(crate::error_chain(&e))),
        }
    }
}

/// The session settings of every tunnel.
pub(crate) fn session_config(
    max_streams: u32,
    keepalive: Duration,
    idle_timeout: Duration,
) -> SessionConfig {
    let mut session = SessionConfig::new(Role::Client);
    session.max_concurrent_streams = max_streams;
    session.keepalive_interval = keepalive;
    session.idle_timeout = idle_timeout;
    session
}
