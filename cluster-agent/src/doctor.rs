//! `tether-agent doctor`: checks, in the order the agent needs them, everything between this agent and a
//! working tunnel, with the agent's own configuration (the same flags and `TETHER_*` variables), and says
//! for each what it found and, when it fails, what to do.
//!
//! The checks, in order (a check whose prerequisite failed is skipped, saying which):
//!
//! 1. `dns`: the relay's name resolves (with a proxy for the relay: the proxy's name; the proxy resolves the
//!    relay's);
//! 2. `tcp`: a TCP connection to the relay (or the proxy) opens;
//! 3. `proxy`: the proxy, if one applies to the relay, accepts `CONNECT relay:port` (skipped without one);
//! 4. `tls`: the TLS handshake with the relay succeeds and its certificate verifies against `--relay-ca`
//!    (plus `--proxy-cert`), or the public roots;
//! 5. `quic`: a QUIC handshake over UDP with the relay's address and port succeeds (skipped with a proxy: the
//!    agent then uses WebSocket only);
//! 6. `clock`: this node's clock is within `--max-clock-skew` of the relay's (its HTTP `Date` header);
//! 7. `identity`: the cluster's identity is stored (state directory or `--state-secret`), names this cluster
//!    and relay, has not expired, and the relay accepts it (`GET /agent/v1/check`: the tunnel's
//!    authentication without opening a tunnel, so a running agent is not disturbed);
//! 8. `apiserver`: `GET /version` through kube-rs with the agent's own credentials, as the agent does.
//!
//! What it does not do: it never onboards (an onboarding token is single-use), never opens a tunnel, and
//! never prints key material or tokens (a proxy URL shows its password as `***`).

use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::{HeaderValue, Request, StatusCode, header};
use http_body_util::{BodyExt, Empty, Limited};
use hyper_util::rt::TokioIo;
use serde::Serialize;
use tether_runtime::tls;
use tether_tunnel::proxy::{self, Proxy, ProxyConfig};
use time::OffsetDateTime;
use time::format_description::well_known::Rfc3339;

use crate::config::Config;
use crate::identity::{self, Identity};
use crate::state_secret::SecretStore;

/// Largest response body read from the relay.
const MAX_BODY: usize = 64 * 1024;

/// The `tether-agent doctor` command line: the agent's own flags, plus the doctor's.
#[derive(Debug, clap::Parser)]
#[command(
    name = "tether-agent doctor",
    bin_name = "tether-agent doctor",
    version,
    about = "Checks what the agent needs, in order: DNS, TCP to the relay, the proxy, TLS and the relay CA, \
             QUIC over UDP, clock skew, the identity, the apiserver; one line per check, exit 1 on any failure"
)]
pub struct Args {
    /// The agent's configuration, exactly as the agent takes it.
    #[command(flatten)]
    pub config: Config,
    /// Output format: text (one line per check) or json.
    #[arg(short = 'o', long = "output", default_value = "text", value_parser = ["text", "json"])]
    pub output: String,
    /// Largest difference between this node's clock and the relay's that passes.
    #[arg(long, default_value = "30s", value_parser = tether_runtime::parse_duration)]
    pub max_clock_skew: Duration,
    /// Format of the logs on stderr (warnings only unless RUST_LOG says otherwise): text or json. Taken so
    /// that the agent's whole command line works here.
    #[arg(long, env = "TETHER_LOG_FORMAT", default_value = "text")]
    pub log_format: tether_runtime::process::LogFormat,
}

/// What the doctor may tolerate or must know besides the agent's configuration.
#[derive(Debug, Clone)]
pub struct Options {
    /// Largest clock difference with the relay that passes the `clock` check.
    pub max_clock_skew: Duration,
}

impl Default for Options {
    fn default() -> Self {
        Self {
            max_clock_skew: Duration::from_secs(30),
        }
    }
}

/// The outcome of one check.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Status {
    /// It works.
    Ok,
    /// It does not: the agent cannot work until it is fixed.
    Fail,
    /// Not run: not applicable, or a check it depends on failed (the detail says which).
    Skip,
}

impl Status {
    fn label(self) -> &'static str {
        match self {
            Status::Ok => "ok",
            Status::Fail => "FAIL",
            Status::Skip => "skip",
        }
    }
}

/// One check's result.
#[derive(Debug, Clone, Serialize)]
pub struct Check {
    /// The check's name (`dns`, `tcp`, `proxy`, `tls`, `quic`, `clock`, `identity`, `apiserver`).
    pub name: &'static str,
    /// Its outcome.
    pub status: Status,
    /// What it found.
    pub detail: String,
    /// What to do about a failure.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub fix: Option<String>,
    /// The relay URL the check is about, when the agent has several (`None` with one, and for `apiserver`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub relay: Option<String>,
    /// Skipped because a check it needs did not pass (later checks needing this one are skipped too).
    #[serde(skip)]
    blocked: bool,
}

/// Every check's result, in order.
#[derive(Debug, Clone, Serialize)]
pub struct Report {
    /// No check failed.
    pub ok: bool,
    /// The checks, in the order they ran.
    pub checks: Vec<Check>,
}

impl Report {
    /// The check named `name`.
    pub fn check(&self, name: &str) -> Option<&Check> {
        self.checks.iter().find(|c| c.name == name)
    }

    /// One line per check: status, name, what it found and, for a failure, what to do.
    pub fn text(&self) -> String {
        let mut out = String::new();
        for check in &self.checks {
            let on = check
                .relay
                .as_deref()
                .map(|relay| format!("{relay}: "))
                .unwrap_or_default();
            out.push_str(&format!(
                "{:<4}  {:<9}  {on}{}",
                check.status.label(),
                check.name,
                one_line(&check.detail)
            ));
            if let Some(fix) = &check.fix {
                out.push_str(" -- fix: ");
                out.push_str(&one_line(fix));
            }
            out.push('\n');
        }
        out
    }

    /// The report as JSON: `{"ok": bool, "checks": [{"name", "status", "detail", "fix"?}]}`.
    pub fn json(&self) -> String {
        serde_json::to_string_pretty(self).unwrap_or_else(|e| format!("{{\"error\":\"{e}\"}}"))
    }
}

fn one_line(s: &str) -> String {
    s.split_whitespace().collect::<Vec<_>>().join(" ")
}

/// The checks as they run: each knows which earlier ones it needs.
#[derive(Default)]
struct Checks {
    done: Vec<Check>,
    /// The relay the checks being run are about (with several relays).
    relay: Option<String>,
}

impl Checks {
    fn record(
        &mut self,
        name: &'static str,
        status: Status,
        detail: String,
        fix: Option<String>,
        blocked: bool,
    ) {
        self.done.push(Check {
            name,
            status,
            detail,
            fix,
            relay: self.relay.clone(),
            blocked,
        });
    }

    fn push(&mut self, name: &'static str, status: Status, detail: String, fix: Option<String>) {
        self.record(name, status, detail, fix, false);
    }

    fn ok(&mut self, name: &'static str, detail: String) {
        self.push(name, Status::Ok, detail, None);
    }

    fn fail(&mut self, name: &'static str, detail: String, fix: String) {
        self.push(name, Status::Fail, detail, Some(fix));
    }

    /// Not applicable here (does not block later checks).
    fn not_applicable(&mut self, name: &'static str, detail: String) {
        self.push(name, Status::Skip, detail, None);
    }

    /// Why `name` cannot run: the first of `needs` that failed or was itself skipped for that reason.
    fn blocker(&self, needs: &[&str]) -> Option<String> {
        needs.iter().find_map(|need| {
            let check = self
                .done
                .iter()
                .find(|c| c.name == *need && c.relay == self.relay)?;
            match (check.status, check.blocked) {
                (Status::Fail, _) => Some(format!("needs {need}, which failed")),
                (Status::Skip, true) => Some(format!("needs {need}, which was skipped")),
                _ => None,
            }
        })
    }

    /// Records `name` as skipped when one of `needs` did not pass; true when it was.
    fn skip_unless(&mut self, name: &'static str, needs: &[&str]) -> bool {
        match self.blocker(needs) {
            Some(why) => {
                self.record(name, Status::Skip, why, None, true);
                true
            }
            None => false,
        }
    }
}

/// Where the relay is, and how the agent reaches it.
struct Target {
    /// The relay's host (IPv6 without brackets).
    host: String,
    port: u16,
    /// `host[:port]` as in the URL, for `Host:` headers.
    authority: String,
    /// The relay URL's path, without a trailing slash (`""` or `/prefix`).
    base_path: String,
    proxy_config: Option<ProxyConfig>,
    /// The proxy the relay is reached through, if one applies to it.
    proxy: Option<Proxy>,
}

/// The relay's answer to one HTTPS request.
struct Answer {
    status: StatusCode,
    date: Option<String>,
    body: Bytes,
    /// The local clock when the answer arrived.
    received: OffsetDateTime,
}

/// Why an HTTPS request to the relay failed.
enum Failure {
    /// Dialling (directly or through the proxy).
    Dial(String),
    /// The TLS handshake.
    Tls(std::io::Error),
    /// The HTTP exchange after the handshake.
    Http(String),
}

/// Runs every check with the agent's `config` (already validated, except that no identity is required).
pub async fn run(config: &Config, options: &Options) -> Report {
    tls::install_crypto_provider();
    let mut checks = Checks::default();

    // Loaded up front: the QUIC probe presents the identity, and a --state-secret is read through the
    // apiserver; each is reported by its own check.
    let kube = kube_client(config).await;
    let material = Material {
        stored: load_identity(config, kube.as_ref().ok().map(|(client, _)| client)).await,
        relay_ca: config.relay_ca.as_deref().map(tls::read_file).transpose(),
        proxy_ca: config.proxy_ca.as_deref().map(tls::read_file).transpose(),
    };
    let relays = relay_urls(config);
    let several = relays.len() > 1;
    for relay in &relays {
        checks.relay = several.then(|| relay.clone());
        relay_checks(&mut checks, config, options, relay, &material).await;
    }
    checks.relay = None;
    apiserver_check(&mut checks, kube, config.connect_timeout).await;
    finish(checks)
}

/// What the relay checks share: the stored identity and the CA files, read once.
struct Material {
    stored: Result<Option<Identity>, String>,
    relay_ca: Result<Option<Vec<u8>>, tls::TlsError>,
    proxy_ca: Result<Option<Vec<u8>>, tls::TlsError>,
}

/// Checks 1 to 7 for one relay URL.
async fn relay_checks(
    checks: &mut Checks,
    config: &Config,
    options: &Options,
    relay: &str,
    material: &Material,
) {
    let Material {
        stored,
        relay_ca,
        proxy_ca,
    } = material;
    let target = match target(config, relay) {
        Ok(target) => target,
        Err(e) => {
            checks.fail(
                "dns",
                format!("the relay URL is unusable: {e}"),
                "set --relay to https://HOST[:PORT]".to_owned(),
            );
            return;
        }
    };
    let timeout = config.connect_timeout;

    // 1. DNS.
    let (dns_host, dns_port, whose) = match &target.proxy {
        Some(proxy) => (proxy.host().to_owned(), proxy.port(), "the proxy"),
        None => (target.host.clone(), target.port, "the relay"),
    };
    let addrs = match resolve(&dns_host, dns_port, timeout).await {
        Ok(addrs) => {
            let list = addrs
                .iter()
                .map(|a| a.ip().to_string())
                .collect::<Vec<_>>()
                .join(", ");
            let mut detail = if dns_host.parse::<IpAddr>().is_ok() {
                format!("{whose} is an IP address ({dns_host}): nothing to resolve")
            } else {
                format!("{dns_host} ({whose}) resolves to {list}")
            };
            if target.proxy.is_some() && target.host.parse::<IpAddr>().is_err() {
                detail.push_str(&format!("; the proxy resolves {}", target.host));
            }
            checks.ok("dns", detail);
            addrs
        }
        Err(e) => {
            checks.fail(
                "dns",
                format!("cannot resolve {dns_host} ({whose}): {e}"),
                format!(
                    "check the name in {} and this node's DNS (/etc/resolv.conf, CoreDNS); try `nslookup {dns_host}` from the agent's pod",
                    if target.proxy.is_some() { "the proxy URL (--proxy-https, HTTPS_PROXY)" } else { "--relay" }
                ),
            );
            Vec::new()
        }
    };

    // 2. TCP.
    if !checks.skip_unless("tcp", &["dns"]) {
        match connect_any(&addrs, timeout).await {
            Ok((addr, took)) => checks.ok(
                "tcp",
                format!(
                    "connected to {whose} at {addr} in {} ms",
                    took.as_millis()
                ),
            ),
            Err(e) => checks.fail(
                "tcp",
                format!("cannot connect to {whose} at {dns_host}:{dns_port}: {e}"),
                match &target.proxy {
                    Some(_) => "check the proxy URL (--proxy-https, HTTPS_PROXY) and that the proxy runs and is reachable from this node".to_owned(),
                    None => format!(
                        "check that the relay runs and listens on port {dns_port}, and that no firewall or NetworkPolicy blocks egress to {dns_host}:{dns_port}; behind an egress proxy, set --proxy-https"
                    ),
                },
            ),
        }
    }

    // 3. The proxy.
    match &target.proxy {
        None => checks.not_applicable(
            "proxy",
            match &target.proxy_config {
                Some(_) => format!(
                    "{} bypasses the proxy (--proxy-skip-range, NO_PROXY)",
                    target.host
                ),
                None => "no proxy configured (--proxy-https, HTTPS_PROXY)".to_owned(),
            },
        ),
        Some(proxy) => {
            if !checks.skip_unless("proxy", &["tcp"]) {
                match proxy::dial(
                    &target.host,
                    target.port,
                    target.proxy_config.as_ref(),
                    timeout,
                )
                .await
                {
                    Ok(_) => checks.ok(
                        "proxy",
                        format!(
                            "{proxy} opened a CONNECT tunnel to {}",
                            target.authority
                        ),
                    ),
                    Err(e) => checks.fail(
                        "proxy",
                        format!("CONNECT {} through {proxy} failed: {}", target.authority, crate::error_chain(&e)),
                        format!(
                            "allow CONNECT to {} on the proxy; a 407 means the proxy wants credentials (http://user:password@host:port)",
                            target.authority
                        ),
                    ),
                }
            }
        }
    }

    // 4. TLS, and the relay's clock from the same exchange.
    let mut relay_date = None;
    if !checks.skip_unless("tls", &["tcp", "proxy"]) {
        let trust = match &config.relay_ca {
            Some(path) => format!("--relay-ca {}", path.display()),
            None => "the public web PKI roots (no --relay-ca)".to_owned(),
        };
        let client = match (&relay_ca, &proxy_ca) {
            (Err(e), _) | (_, Err(e)) => Err(e.to_string()),
            (Ok(relay_ca), Ok(proxy_ca)) => relay_tls(relay_ca, proxy_ca, None),
        };
        match client {
            Err(e) => checks.fail(
                "tls",
                format!("cannot use the CA files: {e}"),
                "--relay-ca (and --proxy-cert) must be readable PEM CA bundles".to_owned(),
            ),
            Ok(client) => match get(&target, client, "/healthz", None, timeout).await {
                Ok(answer) => {
                    checks.ok(
                        "tls",
                        format!(
                            "the relay's certificate for {} verifies against {trust}",
                            target.host
                        ),
                    );
                    relay_date = Some(answer);
                }
                Err(Failure::Tls(e)) => {
                    let (what, fix) = tls_failure(&e, &target, &trust);
                    checks.fail("tls", what, fix);
                }
                Err(Failure::Dial(e)) => checks.fail(
                    "tls",
                    format!("cannot reach the relay again: {e}"),
                    "the connection worked a moment ago: the relay or the network is unstable"
                        .to_owned(),
                ),
                Err(Failure::Http(e)) => {
                    checks.ok(
                        "tls",
                        format!(
                            "the relay's certificate for {} verifies against {trust} (but GET /healthz failed: {e})",
                            target.host
                        ),
                    );
                }
            },
        }
    }

    // The identity, read once for the QUIC probe and the identity check.
    let now = OffsetDateTime::now_utc();
    let usable = match &stored {
        Ok(Some(id)) if !id.is_expired(now) => Some(id),
        _ => None,
    };

    // 5. QUIC over UDP.
    if config.transport == crate::config::TransportMode::Wss {
        checks.not_applicable(
            "quic",
            "--transport wss: the agent uses WebSocket only".to_owned(),
        );
    } else if target.proxy.is_some() {
        checks.not_applicable(
            "quic",
            "a proxy is configured for the relay: the agent uses WebSocket only".to_owned(),
        );
    } else if !checks.skip_unless("quic", &["dns", "tls"]) {
        let client = match (&relay_ca, &proxy_ca) {
            (Ok(relay_ca), Ok(proxy_ca)) => relay_tls(relay_ca, proxy_ca, usable),
            _ => Err("the CA files are unusable".to_owned()),
        };
        match (client, addrs.first()) {
            (Ok(client), Some(addr)) => {
                let addr = SocketAddr::new(addr.ip(), target.port);
                match tether_tunnel::quic::probe(addr, &target.host, client, timeout).await {
                    Ok(rtt) => checks.ok(
                        "quic",
                        format!(
                            "QUIC handshake with {addr} over UDP (round trip {} ms)",
                            rtt.as_millis()
                        ),
                    ),
                    Err(tether_tunnel::quic::QuicError::TimedOut) => checks.fail(
                        "quic",
                        format!(
                            "no QUIC answer from {addr} over UDP within {}",
                            human(timeout)
                        ),
                        format!(
                            "outbound UDP to port {} looks blocked (or the relay does not listen for QUIC): the agent falls back to WebSocket over TCP; for QUIC, allow UDP egress to {addr}",
                            target.port
                        ),
                    ),
                    Err(e) => checks.fail(
                        "quic",
                        format!("the QUIC handshake with {addr} failed: {e}"),
                        "the relay's QUIC listener refused the handshake: see the relay's log; the agent falls back to WebSocket over TCP meanwhile".to_owned(),
                    ),
                }
            }
            (Err(e), _) => checks.fail(
                "quic",
                format!("cannot set up TLS for QUIC: {e}"),
                "see the tls check".to_owned(),
            ),
            (_, None) => checks.not_applicable("quic", "no address to probe".to_owned()),
        }
    }

    // 6. Clock skew.
    if !checks.skip_unless("clock", &["tls"]) {
        match relay_date
            .as_ref()
            .and_then(|a| a.date.as_deref().map(|d| (d, a.received)))
        {
            None => checks.not_applicable(
                "clock",
                "the relay's answer carried no Date header to compare with".to_owned(),
            ),
            Some((date, received)) => match parse_http_date(date) {
                None => checks.not_applicable(
                    "clock",
                    format!("the relay's Date header {date:?} is not an HTTP date"),
                ),
                Some(relay_now) => {
                    clock_check(checks, received, relay_now, date, options.max_clock_skew);
                }
            },
        }
    }

    // 7. The identity.
    identity_check(checks, config, &target, stored, relay_ca, proxy_ca, timeout).await;
}

/// 8. The apiserver, with the agent's own credentials, as the agent's client reaches it.
async fn apiserver_check(
    checks: &mut Checks,
    kube: Result<(kube::Client, String), String>,
    timeout: Duration,
) {
    match kube {
        Err(e) => checks.fail(
            "apiserver",
            format!("cannot load the Kubernetes configuration: {e}"),
            "set --kubeconfig (or KUBECONFIG), or run the agent in a pod with its service account".to_owned(),
        ),
        Ok((client, url)) => {
            match tokio::time::timeout(timeout, client.apiserver_version()).await {
                Ok(Ok(version)) => checks.ok(
                    "apiserver",
                    format!(
                        "{url} answers GET /version with the agent's own credentials: {}",
                        version.git_version
                    ),
                ),
                Ok(Err(kube::Error::Api(status))) if status.code == 401 || status.code == 403 => {
                    checks.fail(
                        "apiserver",
                        format!(
                            "{url} refused the agent's credentials (HTTP {}): {}",
                            status.code, status.message
                        ),
                        "the agent's service account token or client certificate is invalid or lacks access to GET /version (ClusterRole system:discovery): check the kubeconfig or the Helm chart's RBAC".to_owned(),
                    );
                }
                Ok(Err(e)) => checks.fail(
                    "apiserver",
                    format!("GET {url}/version failed: {}", crate::error_chain(&e)),
                    "check the apiserver address and CA in the kubeconfig (in a pod: KUBERNETES_SERVICE_HOST/PORT), and that no NetworkPolicy blocks the agent from it".to_owned(),
                ),
                Err(_) => checks.fail(
                    "apiserver",
                    format!("GET {url}/version: no answer within {}", human(timeout)),
                    "check the apiserver address in the kubeconfig and that no NetworkPolicy or firewall blocks the agent from it".to_owned(),
                ),
            }
        }
    }
}

/// Compares this node's clock (`received`, when the answer arrived) with the relay's (`relay_now`, from its
/// `Date` header, whose resolution is one second: hence one second of slack over `max`).
fn clock_check(
    checks: &mut Checks,
    received: OffsetDateTime,
    relay_now: OffsetDateTime,
    date: &str,
    max: Duration,
) {
    let skew = received - relay_now;
    let secs = skew.whole_seconds();
    let direction = if secs >= 0 { "ahead of" } else { "behind" };
    let found = format!(
        "this node's clock is {} s {direction} the relay's (relay: {date})",
        secs.abs()
    );
    if skew.unsigned_abs() > max + Duration::from_secs(1) {
        checks.fail(
            "clock",
            format!("{found}; more than {} allowed", human(max)),
            "synchronise this node's clock (NTP: chrony, systemd-timesyncd): the agent checks the relay's certificate and times its renewals on it, the relay checks the agent's certificate on its own".to_owned(),
        );
    } else {
        checks.ok("clock", found);
    }
}

fn finish(checks: Checks) -> Report {
    Report {
        ok: checks.done.iter().all(|c| c.status != Status::Fail),
        checks: checks.done,
    }
}

/// The identity check: stored, names this cluster and relay, not expired (local clock), accepted by the relay.
async fn identity_check(
    checks: &mut Checks,
    config: &Config,
    target: &Target,
    stored: &Result<Option<Identity>, String>,
    relay_ca: &Result<Option<Vec<u8>>, tls::TlsError>,
    proxy_ca: &Result<Option<Vec<u8>>, tls::TlsError>,
    timeout: Duration,
) {
    let store = match &config.state_secret {
        Some(secret) => format!("the Secret {secret}"),
        None => config.state_dir.display().to_string(),
    };
    let identity = match stored {
        Err(e) => {
            checks.fail(
                "identity",
                format!("cannot read the identity in {store}: {e}"),
                "check the state's permissions (or, with --state-secret, the agent's access to the Secret); if it is corrupt, delete the cluster at the relay and connect it again (`tether cluster delete`, `tether cluster connect`)".to_owned(),
            );
            return;
        }
        Ok(None) if config.onboarding_secret().is_some() => {
            checks.not_applicable(
                "identity",
                format!(
                    "no identity for cluster {} at {} in {store} yet: the agent will onboard with the given onboarding token (doctor does not use it: it works once)",
                    config.cluster, config.relay_url()
                ),
            );
            return;
        }
        Ok(None) => {
            checks.fail(
                "identity",
                format!(
                    "no identity for cluster {} at {} in {store}{}",
                    config.cluster,
                    config.relay_url(),
                    other_identity(config).unwrap_or_default()
                ),
                format!(
                    "give the agent the onboarding token from `tether cluster connect {}` (--onboarding-token-file), or point --state-dir/--state-secret at the state it stored",
                    config.cluster
                ),
            );
            return;
        }
        Ok(Some(identity)) => identity,
    };
    let fingerprint: String = identity.fingerprint.chars().take(16).collect();
    let not_after = identity
        .not_after
        .format(&Rfc3339)
        .unwrap_or_else(|_| identity.not_after.to_string());
    let now = OffsetDateTime::now_utc();
    if identity.is_expired(now) {
        checks.fail(
            "identity",
            format!(
                "the certificate of cluster {} (sha256 {fingerprint}…) in {store} expired at {not_after}",
                config.cluster
            ),
            format!(
                "the agent could not renew it in time (offline too long): delete the cluster at the relay and connect it again (`tether cluster delete {c}`, `tether cluster connect {c}`), then start the agent with the new onboarding token",
                c = config.cluster
            ),
        );
        return;
    }
    let found = format!(
        "cluster {} (sha256 {fingerprint}…) in {store}, valid until {not_after}",
        config.cluster
    );
    if let Some(why) = checks.blocker(&["tls"]) {
        checks.record(
            "identity",
            Status::Skip,
            format!("{found}; not confirmed with the relay: {why}"),
            None,
            true,
        );
        return;
    }
    let client = match (relay_ca, proxy_ca) {
        (Ok(relay_ca), Ok(proxy_ca)) => relay_tls(relay_ca, proxy_ca, Some(identity)),
        _ => Err("the CA files are unusable".to_owned()),
    };
    let client = match client {
        Ok(client) => client,
        Err(e) => {
            checks.fail(
                "identity",
                format!("{found}; unusable as a TLS client certificate: {e}"),
                "the stored key does not match the certificate: delete the cluster at the relay and connect it again".to_owned(),
            );
            return;
        }
    };
    let cluster = HeaderValue::try_from(config.cluster.as_str()).ok();
    match get(target, client, "/agent/v1/check", cluster, timeout).await {
        Ok(answer) if answer.status == StatusCode::OK => {
            checks.ok("identity", format!("{found}, accepted by the relay"));
        }
        Ok(answer) if answer.status == StatusCode::NOT_FOUND => checks.ok(
            "identity",
            format!("{found} (not confirmed: the relay predates /agent/v1/check)"),
        ),
        Ok(answer)
            if answer.status == StatusCode::UNAUTHORIZED
                || answer.status == StatusCode::FORBIDDEN =>
        {
            let message = crate::onboard::status_message(&answer.body);
            let expired = serde_json::from_slice::<serde_json::Value>(&answer.body)
                .ok()
                .and_then(|v| v.get("reason").and_then(|r| r.as_str()).map(str::to_owned))
                .is_some_and(|r| r == crate::IDENTITY_EXPIRED_REASON);
            let fix = if expired {
                format!(
                    "by the relay's clock it expired (see the clock check): delete the cluster at the relay and connect it again (`tether cluster delete {c}`, `tether cluster connect {c}`)",
                    c = config.cluster
                )
            } else {
                format!(
                    "the relay no longer accepts this identity (the cluster was deleted, or its identity revoked or replaced): connect it again (`tether cluster delete {c}`, `tether cluster connect {c}`) and start the agent with the new token",
                    c = config.cluster
                )
            };
            checks.fail(
                "identity",
                format!(
                    "{found}; the relay refused it (HTTP {}): {message}",
                    answer.status.as_u16()
                ),
                fix,
            );
        }
        Ok(answer) => checks.fail(
            "identity",
            format!(
                "{found}; the relay answered HTTP {}: {}",
                answer.status.as_u16(),
                crate::onboard::status_message(&answer.body)
            ),
            "the relay could not check the identity: see its log and retry".to_owned(),
        ),
        Err(Failure::Tls(e)) => checks.fail(
            "identity",
            format!("{found}; the TLS handshake with it as client certificate failed: {}", tls_error_text(&e)),
            "the relay refused the certificate during TLS: it is not issued by this relay's agent CA; delete the cluster and connect it again".to_owned(),
        ),
        Err(Failure::Dial(e) | Failure::Http(e)) => checks.fail(
            "identity",
            format!("{found}; cannot ask the relay to check it: {e}"),
            "the relay was reachable a moment ago: the relay or the network is unstable".to_owned(),
        ),
    }
}

/// With no usable identity for this relay and cluster: which one the state holds, if another.
fn other_identity(config: &Config) -> Option<String> {
    if config.state_secret.is_some() {
        return None;
    }
    let text = std::fs::read(identity::path(&config.state_dir)).ok()?;
    let value: serde_json::Value = serde_json::from_slice(&text).ok()?;
    let relay = value.get("relay")?.as_str()?;
    let cluster = value.get("cluster")?.as_str()?;
    Some(format!(
        " (it holds the identity of cluster {cluster} at {relay})"
    ))
}

/// The relay URLs the agent dials (each `--relay`).
fn relay_urls(config: &Config) -> Vec<String> {
    config.relays.clone()
}

fn target(config: &Config, relay: &str) -> Result<Target, String> {
    let url = url::Url::parse(relay).map_err(|e| format!("{relay}: {e}"))?;
    let host = match url.host() {
        Some(url::Host::Domain(d)) => d.to_owned(),
        Some(url::Host::Ipv4(ip)) => ip.to_string(),
        Some(url::Host::Ipv6(ip)) => ip.to_string(),
        None => return Err("no host".to_owned()),
    };
    let port = url.port_or_known_default().unwrap_or(443);
    let authority = url[url::Position::BeforeHost..url::Position::AfterPort].to_owned();
    let base_path = url.path().trim_end_matches('/').to_owned();
    let proxy_config = config.proxy_config();
    let proxy = proxy_config
        .as_ref()
        .and_then(|p| p.proxy_for(&host, port))
        .cloned();
    Ok(Target {
        host,
        port,
        authority,
        base_path,
        proxy_config,
        proxy,
    })
}

/// The agent's own Kubernetes client, built as the agent builds it, and the apiserver's URL.
async fn kube_client(config: &Config) -> Result<(kube::Client, String), String> {
    // As the agent loads it (`agent::load_kube_config`): --kubeconfig, else KUBECONFIG/~/.kube, else in-cluster.
    let mut kube_config = match config.kubeconfig.as_deref() {
        Some(path) => {
            let kubeconfig =
                kube::config::Kubeconfig::read_from(path).map_err(|e| crate::error_chain(&e))?;
            kube::Config::from_custom_kubeconfig(
                kubeconfig,
                &kube::config::KubeConfigOptions::default(),
            )
            .await
            .map_err(|e| crate::error_chain(&e))?
        }
        None => kube::Config::infer()
            .await
            .map_err(|e| crate::error_chain(&e))?,
    };
    // As the agent: the apiserver is reached directly, never through the relay's proxy.
    kube_config.proxy_url = None;
    kube_config.headers.push((
        header::USER_AGENT,
        HeaderValue::from_static(concat!("tether-agent/", env!("CARGO_PKG_VERSION"))),
    ));
    let url = kube_config
        .cluster_url
        .to_string()
        .trim_end_matches('/')
        .to_owned();
    let client = kube::Client::try_from(kube_config).map_err(|e| crate::error_chain(&e))?;
    Ok((client, url))
}

async fn load_identity(
    config: &Config,
    kube: Option<&kube::Client>,
) -> Result<Option<Identity>, String> {
    match &config.state_secret {
        None => identity::load(&config.state_dir, config.relay_url(), &config.cluster)
            .map_err(|e| crate::error_chain(&e)),
        Some(secret) => {
            let Some(client) = kube else {
                return Err(
                    "the apiserver client could not be built (see the apiserver check)".to_owned(),
                );
            };
            SecretStore::new(client.clone(), secret)
                .peek(config.relay_url(), &config.cluster)
                .await
                .map_err(|e| crate::error_chain(&e))
        }
    }
}

fn relay_tls(
    relay_ca: &Option<Vec<u8>>,
    proxy_ca: &Option<Vec<u8>>,
    identity: Option<&Identity>,
) -> Result<Arc<rustls::ClientConfig>, String> {
    tls::client_config_with(&tls::ClientOptions {
        ca_pem: relay_ca.as_deref(),
        extra_ca_pem: proxy_ca.as_deref(),
        identity: identity.map(|id| tls::ClientIdentity {
            cert_pem: id.certificate.as_bytes(),
            key_pem: id.key.expose().as_bytes(),
        }),
        alpn: &[b"http/1.1"],
    })
    .map_err(|e| crate::error_chain(&e))
}

async fn resolve(host: &str, port: u16, timeout: Duration) -> Result<Vec<SocketAddr>, String> {
    if let Ok(ip) = host.parse::<IpAddr>() {
        return Ok(vec![SocketAddr::new(ip, port)]);
    }
    match tokio::time::timeout(timeout, tokio::net::lookup_host((host, port))).await {
        Err(_) => Err(format!("no answer within {}", human(timeout))),
        Ok(Err(e)) => Err(e.to_string()),
        Ok(Ok(addrs)) => {
            let addrs: Vec<SocketAddr> = addrs.collect();
            if addrs.is_empty() {
                Err("no address".to_owned())
            } else {
                Ok(addrs)
            }
        }
    }
}

/// Connects to the first address that answers; every address's error otherwise.
async fn connect_any(
    addrs: &[SocketAddr],
    timeout: Duration,
) -> Result<(SocketAddr, Duration), String> {
    let mut errors = Vec::new();
    for addr in addrs {
        let started = Instant::now();
        match tokio::time::timeout(timeout, tokio::net::TcpStream::connect(addr)).await {
            Ok(Ok(_)) => return Ok((*addr, started.elapsed())),
            Ok(Err(e)) => errors.push((addr, e.to_string())),
            Err(_) => errors.push((addr, format!("no answer within {}", human(timeout)))),
        }
    }
    Err(match errors.as_slice() {
        [(_, only)] => only.clone(),
        all => all
            .iter()
            .map(|(addr, e)| format!("{addr}: {e}"))
            .collect::<Vec<_>>()
            .join("; "),
    })
}

/// One `GET base_path + path` to the relay with `tls`, dialled as the agent dials (through the proxy if one
/// applies), with `Tether-Cluster: cluster` when given.
async fn get(
    target: &Target,
    tls: Arc<rustls::ClientConfig>,
    path: &str,
    cluster: Option<HeaderValue>,
    timeout: Duration,
) -> Result<Answer, Failure> {
    let exchange = async {
        let tcp = proxy::dial(
            &target.host,
            target.port,
            target.proxy_config.as_ref(),
            timeout,
        )
        .await
        .map_err(|e| Failure::Dial(crate::error_chain(&e)))?;
        let server_name = rustls::pki_types::ServerName::try_from(target.host.clone())
            .map_err(|e| Failure::Dial(format!("{}: not a TLS server name: {e}", target.host)))?;
        let stream = tokio_rustls::TlsConnector::from(tls)
            .connect(server_name, tcp)
            .await
            .map_err(Failure::Tls)?;
        let (mut sender, connection) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
            .await
            .map_err(|e| Failure::Http(crate::error_chain(&e)))?;
        let connection = tokio::spawn(connection);
        let mut request = Request::get(format!("{}{path}", target.base_path))
            .header(header::HOST, &target.authority)
            .header(
                header::USER_AGENT,
                concat!("tether-agent-doctor/", env!("CARGO_PKG_VERSION")),
            );
        if let Some(cluster) = cluster {
            request = request.header("tether-cluster", cluster);
        }
        let request = request
            .body(Empty::<Bytes>::new())
            .map_err(|e| Failure::Http(e.to_string()))?;
        let result = async {
            let response = sender
                .send_request(request)
                .await
                .map_err(|e| Failure::Http(crate::error_chain(&e)))?;
            let received = OffsetDateTime::now_utc();
            let status = response.status();
            let date = response
                .headers()
                .get(header::DATE)
                .and_then(|v| v.to_str().ok())
                .map(str::to_owned);
            let body = Limited::new(response.into_body(), MAX_BODY)
                .collect()
                .await
                .map_err(|e| Failure::Http(format!("reading the answer: {e}")))?
                .to_bytes();
            Ok(Answer {
                status,
                date,
                body,
                received,
            })
        }
        .await;
        connection.abort();
        result
    };
    tokio::time::timeout(timeout, exchange)
        .await
        .unwrap_or_else(|_| {
            Err(Failure::Dial(format!(
                "no answer within {}",
                human(timeout)
            )))
        })
}

/// The rustls error inside a handshake's I/O error, or the error itself.
fn tls_error_text(e: &std::io::Error) -> String {
    match e
        .get_ref()
        .and_then(|inner| inner.downcast_ref::<rustls::Error>())
    {
        Some(tls) => tls.to_string(),
        None => e.to_string(),
    }
}

/// What a failed handshake means and what to do.
fn tls_failure(e: &std::io::Error, target: &Target, trust: &str) -> (String, String) {
    use rustls::CertificateError as C;
    let host = &target.host;
    let text = tls_error_text(e);
    let inner = e
        .get_ref()
        .and_then(|inner| inner.downcast_ref::<rustls::Error>());
    match inner {
        Some(rustls::Error::InvalidCertificate(C::UnknownIssuer | C::BadSignature)) => (
            format!("the relay's certificate is not signed by a CA in {trust}: {text}"),
            "set --relay-ca to the CA bundle that signed the relay's certificate (a generated relay CA is ca.pem in the relay's data directory); behind a TLS-inspecting proxy, add its CA with --proxy-cert".to_owned(),
        ),
        Some(rustls::Error::InvalidCertificate(
            C::NotValidForName | C::NotValidForNameContext { .. },
        )) => (
            format!("the relay's certificate does not name {host}: {text}"),
            format!(
                "use in --relay a name the certificate carries, or reissue it for {host} (relay --hostname, or your own certificate)"
            ),
        ),
        Some(rustls::Error::InvalidCertificate(
            C::Expired | C::ExpiredContext { .. } | C::NotValidYet | C::NotValidYetContext { .. },
        )) => (
            format!("the relay's certificate is outside its validity period by this node's clock: {text}"),
            "renew the relay's certificate, or fix this node's clock if it is wrong".to_owned(),
        ),
        _ => (
            format!("the TLS handshake with {host}:{} failed: {text}", target.port),
            "check that the relay's port speaks TLS (not a plain HTTP port or another service), and that no middlebox interferes".to_owned(),
        ),
    }
}

/// An HTTP date (IMF-fixdate, `Sun, 06 Nov 1994 08:49:37 GMT`).
fn parse_http_date(s: &str) -> Option<OffsetDateTime> {
    let format = time::macros::format_description!(
        "[weekday repr:short], [day] [month repr:short] [year] [hour]:[minute]:[second] GMT"
    );
    time::PrimitiveDateTime::parse(s.trim(), &format)
        .ok()
        .map(time::PrimitiveDateTime::assume_utc)
}

fn human(d: Duration) -> String {
    if d.subsec_millis() == 0 {
        format!("{} s", d.as_secs())
    } else {
        format!("{} ms", d.as_millis())
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn http_dates_parse() {
        let t = parse_http_date("Sun, 06 Nov 1994 08:49:37 GMT").unwrap();
        assert_eq!(t.unix_timestamp(), 784_111_777);
        assert!(parse_http_date("yesterday").is_none());
    }

    #[test]
    fn clock_skew_beyond_the_bound_fails_either_way() {
        let relay = parse_http_date("Wed, 25 Nov 2026 14:00:00 GMT").unwrap();
        let max = Duration::from_secs(30);
        let mut checks = Checks::default();
        let date = "Wed, 25 Nov 2026 14:00:00 GMT";
        clock_check(
            &mut checks,
            relay + time::Duration::seconds(5),
            relay,
            date,
            max,
        );
        clock_check(
            &mut checks,
            relay + time::Duration::seconds(95),
            relay,
            date,
            max,
        );
        clock_check(
            &mut checks,
            relay - time::Duration::seconds(40),
            relay,
            date,
            max,
        );
        let statuses: Vec<Status> = checks.done.iter().map(|c| c.status).collect();
        assert_eq!(statuses, [Status::Ok, Status::Fail, Status::Fail]);
        assert!(checks.done[1].detail.contains("95 s ahead of the relay's"));
        assert!(checks.done[2].detail.contains("40 s behind the relay's"));
        assert!(checks.done[2].fix.as_deref().unwrap_or("").contains("NTP"));
    }

    #[test]
    fn a_failed_check_skips_the_checks_that_need_it() {
        let mut checks = Checks::default();
        checks.fail("dns", "no".into(), "fix it".into());
        assert!(checks.skip_unless("tcp", &["dns"]));
        assert!(checks.skip_unless("tls", &["tcp", "proxy"]));
        checks.not_applicable("proxy", "none".into());
        assert_eq!(checks.blocker(&["proxy"]), None);
        assert_eq!(
            checks.blocker(&["tls"]).as_deref(),
            Some("needs tls, which was skipped")
        );
        let report = finish(checks);
        assert!(!report.ok);
        let text = report.text();
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(lines[0], "FAIL  dns        no -- fix: fix it");
        assert_eq!(lines[1], "skip  tcp        needs dns, which failed");
        let json: serde_json::Value = serde_json::from_str(&report.json()).unwrap();
        assert_eq!(json["checks"][0]["status"], "fail");
        assert!(json["checks"][1].get("fix").is_none());
    }
}
