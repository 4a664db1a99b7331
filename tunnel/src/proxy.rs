//! Outbound HTTP CONNECT proxies: the dial step shared by the tunnel ([`crate::ws::connect_with_proxy`]) and
//! any other request the agent makes to the relay (onboarding).
//!
//! [`dial`] opens a TCP connection to `host:port`, either directly or, when a [`ProxyConfig`] applies to
//! that host, through the proxy: TCP to the proxy, `CONNECT host:port HTTP/1.1` (with
//! `Proxy-Authorization: Basic …` when the proxy URL carries credentials), a bounded read of the proxy's
//! response header, and then the raw tunnelled stream, on which the caller runs TLS end to end with the
//! relay. The proxy never sees the TLS session's contents, only the target's name and port.
//!
//! Proxy URLs are `http://[user:password@]host[:port]` (port 80 by default; a URL without a scheme is taken as
//! `http://`). A TLS connection *to* the proxy (`https://` proxy URLs) is not supported. The password is
//! kept in a [`Secret`]: `Display` and `Debug` print `***` in its place.
//!
//! The bypass list ([`NoProxy`], from `NO_PROXY` or `--proxy-skip-range`) is comma-separated; each entry is
//! - `*`: every host bypasses the proxy;
//! - a CIDR, `10.0.0.0/8` or `fd00::/8`: IP-address hosts inside it;
//! - an IP address, `10.1.2.3` or `::1` / `[::1]`, optionally with a port (`10.1.2.3:443`, `[::1]:443`);
//! - a domain, `example.com`: that name and every name under it (`a.example.com`);
//! - `.example.com` or `*.example.com`: only names under it, not `example.com` itself;
//! - a domain with a port, `example.com:8443`: as above, for that port only.
//!
//! Matching is case-insensitive and ignores a trailing dot. Names are not resolved: a CIDR only matches a
//! host given as an IP address. Loopback is not bypassed implicitly; list `localhost,127.0.0.0/8` if wanted.
//!
//! Why not hyper-util's matcher (`hyper_util::client::proxy::matcher`, 0.1.21): run against this module's test
//! list it decides 6 of 22 cases differently and has no way to refuse a bad entry. It never matches an entry with
//! a port (`api.example.org:6443`, `[::1]:8443`: Arc's `--proxy-skip-range` takes them), never matches
//! `*.svc.local` (only a leading dot counts), lets `.internal.corp` bypass `internal.corp` itself, misses
//! `EXAMPLE.com.` (trailing dot) and an IPv4-mapped `::ffff:10.9.9.9` inside `10.0.0.0/8`, and takes
//! `10.0.0.0/33`, `host:0` or `bad host` silently as names that match nothing, where an operator's typo should be
//! an error at start. Its proxy half (a URL per scheme) is not what the tunnel's CONNECT dial needs either.

use std::fmt;
use std::net::IpAddr;
use std::time::Duration;

use base64::Engine as _;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::TcpStream;

use tether_runtime::Secret;

/// The largest proxy response header read for a CONNECT; a longer one is an error.
pub const MAX_RESPONSE_HEADER: usize = 8 * 1024;

/// Why a proxy setting is unusable, or a dial failed.
#[derive(Debug, thiserror::Error)]
pub enum ProxyError {
    /// The proxy URL cannot be used.
    #[error("invalid proxy URL {url}: {reason}")]
    InvalidUrl {
        /// The URL, with any password replaced by `***`.
        url: String,
        /// What is wrong with it.
        reason: String,
    },
    /// An entry of the bypass list cannot be used.
    #[error("invalid proxy bypass entry {entry:?}: {reason}")]
    InvalidBypass {
        /// The entry.
        entry: String,
        /// What is wrong with it.
        reason: String,
    },
    /// The target could not be reached directly (TCP connect or DNS failed).
    #[error("cannot reach {addr}: {source}")]
    Connect {
        /// host:port dialled.
        addr: String,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
    /// The proxy itself could not be reached.
    #[error("cannot reach the proxy {proxy}: {source}")]
    ConnectProxy {
        /// The proxy URL (password hidden).
        proxy: String,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
    /// The proxy answered the CONNECT with a non-2xx status.
    #[error("proxy refused CONNECT: {status} {reason} (proxy {proxy}, target {target}){hint}")]
    Refused {
        /// The proxy URL (password hidden).
        proxy: String,
        /// host:port asked for.
        target: String,
        /// The status code.
        status: u16,
        /// The reason phrase.
        reason: String,
        /// What to do about it, if known (starts with "; ").
        hint: &'static str,
    },
    /// The proxy's answer was not an HTTP response, or its header was too long.
    #[error("bad answer from the proxy {proxy} to CONNECT {target}: {reason}")]
    BadResponse {
        /// The proxy URL (password hidden).
        proxy: String,
        /// host:port asked for.
        target: String,
        /// What was wrong.
        reason: String,
    },
    /// Reading or writing the CONNECT exchange failed.
    #[error("CONNECT through the proxy {proxy} failed: {source}")]
    Io {
        /// The proxy URL (password hidden).
        proxy: String,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
    /// The connection (direct or through the proxy, CONNECT included) took longer than allowed.
    #[error("timed out connecting to {addr}{via}")]
    TimedOut {
        /// host:port dialled.
        addr: String,
        /// `" through the proxy …"` or empty.
        via: String,
    },
}

/// Basic credentials for the proxy.
#[derive(Clone, PartialEq, Eq)]
struct Credentials {
    user: String,
    password: Secret,
}

/// An HTTP proxy reached with CONNECT. `Display`/`Debug` show the URL with the password as `***`.
#[derive(Clone, PartialEq, Eq)]
pub struct Proxy {
    host: String,
    port: u16,
    credentials: Option<Credentials>,
}

impl Proxy {
    /// Parses `http://[user:password@]host[:port]` (user and password percent-encoded as in any URL).
    pub fn parse(url: &str) -> Result<Self, ProxyError> {
        let url = url.trim();
        let with_scheme = if url.contains("://") {
            url.to_owned()
        } else {
            format!("http://{url}")
        };
        let invalid = |reason: &str| ProxyError::InvalidUrl {
            url: redact(&with_scheme),
            reason: reason.to_owned(),
        };
        let parsed = url::Url::parse(&with_scheme).map_err(|e| invalid(&e.to_string()))?;
        match parsed.scheme() {
            "http" => {}
            "https" => {
                return Err(invalid(
                    "TLS to the proxy is not supported; use http://host:port (the tunnel inside is still TLS end to end)",
                ));
            }
            other => {
                return Err(invalid(&format!(
                    "unsupported scheme {other:?}, use http://"
                )));
            }
        }
        let host = match parsed.host() {
            Some(url::Host::Domain(d)) if !d.is_empty() => d.to_owned(),
            Some(url::Host::Ipv4(ip)) => ip.to_string(),
            Some(url::Host::Ipv6(ip)) => ip.to_string(),
            _ => return Err(invalid("no host")),
        };
        if !matches!(parsed.path(), "" | "/") || parsed.query().is_some() {
            return Err(invalid("a path or query is not allowed"));
        }
        let port = parsed.port_or_known_default().unwrap_or(80);
        let credentials = if parsed.username().is_empty() && parsed.password().is_none() {
            None
        } else {
            let user = percent_decode(parsed.username())
                .ok_or_else(|| invalid("the user name is not valid percent-encoded UTF-8"))?;
            let password = percent_decode(parsed.password().unwrap_or(""))
                .ok_or_else(|| invalid("the password is not valid percent-encoded UTF-8"))?;
            Some(Credentials {
                user,
                password: Secret::new(password),
            })
        };
        Ok(Self {
            host,
            port,
            credentials,
        })
    }

    /// The proxy's host name or IP address (IPv6 without brackets).
    pub fn host(&self) -> &str {
        &self.host
    }

    /// The proxy's port.
    pub fn port(&self) -> u16 {
        self.port
    }

    /// The user name sent in `Proxy-Authorization`, if any.
    pub fn user(&self) -> Option<&str> {
        self.credentials.as_ref().map(|c| c.user.as_str())
    }

    fn authorization(&self) -> Option<String> {
        self.credentials.as_ref().map(|c| {
            let raw = format!("{}:{}", c.user, c.password.expose());
            format!(
                "Basic {}",
                base64::engine::general_purpose::STANDARD.encode(raw)
            )
        })
    }
}

impl fmt::Display for Proxy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("http://")?;
        if let Some(c) = &self.credentials {
            write!(f, "{}:***@", c.user)?;
        }
        write!(f, "{}", host_port(&self.host, self.port))
    }
}

impl fmt::Debug for Proxy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Proxy({self})")
    }
}

/// One bypass-list entry.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Bypass {
    /// `*`.
    All,
    /// An address block.
    Cidr { net: IpAddr, prefix: u8 },
    /// One address, optionally one port.
    Ip { ip: IpAddr, port: Option<u16> },
    /// A domain (lowercase, no trailing dot); `subdomains_only` for `.example.com`.
    Domain {
        name: String,
        subdomains_only: bool,
        port: Option<u16>,
    },
}

/// The hosts that bypass the proxy (`NO_PROXY`); see the [module docs](self) for the syntax.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct NoProxy {
    entries: Vec<Bypass>,
}

impl NoProxy {
    /// Parses a comma-separated list (whitespace around entries and empty entries are ignored).
    pub fn parse(list: &str) -> Result<Self, ProxyError> {
        let entries = list
            .split(',')
            .map(str::trim)
            .filter(|e| !e.is_empty())
            .map(parse_bypass)
            .collect::<Result<Vec<_>, _>>()?;
        Ok(Self { entries })
    }

    /// Whether the list is empty.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// Whether a connection to `host:port` bypasses the proxy. `host` is a name or an IP address (IPv6
    /// with or without brackets).
    pub fn matches(&self, host: &str, port: u16) -> bool {
        let host = host
            .trim_start_matches('[')
            .trim_end_matches(']')
            .trim_end_matches('.')
            .to_ascii_lowercase();
        let ip = host.parse::<IpAddr>().ok().map(canonical);
        let port_ok = |wanted: &Option<u16>| wanted.is_none_or(|p| p == port);
        self.entries.iter().any(|entry| match entry {
            Bypass::All => true,
            Bypass::Cidr { net, prefix } => ip.is_some_and(|ip| in_cidr(ip, *net, *prefix)),
            Bypass::Ip { ip: want, port: p } => ip == Some(*want) && port_ok(p),
            Bypass::Domain {
                name,
                subdomains_only,
                port: p,
            } => {
                ip.is_none()
                    && port_ok(p)
                    && ((!subdomains_only && host == *name)
                        || host
                            .strip_suffix(name.as_str())
                            .is_some_and(|rest| rest.ends_with('.')))
            }
        })
    }
}

/// A proxy and the hosts that bypass it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ProxyConfig {
    /// The proxy.
    pub proxy: Proxy,
    /// Hosts reached directly.
    pub no_proxy: NoProxy,
}

impl ProxyConfig {
    /// Parses a proxy URL and an optional bypass list.
    pub fn parse(url: &str, no_proxy: Option<&str>) -> Result<Self, ProxyError> {
        Ok(Self {
            proxy: Proxy::parse(url)?,
            no_proxy: no_proxy
                .map(NoProxy::parse)
                .transpose()?
                .unwrap_or_default(),
        })
    }

    /// The proxy to use for `host:port`, or `None` when it bypasses the proxy.
    pub fn proxy_for(&self, host: &str, port: u16) -> Option<&Proxy> {
        (!self.no_proxy.matches(host, port)).then_some(&self.proxy)
    }
}

/// Opens a TCP connection to `host:port` (IPv6 without brackets), directly or through the proxy that
/// `proxy` names for this host, all within `timeout`. Nagle is disabled on the returned socket.
pub async fn dial(
    host: &str,
    port: u16,
    proxy: Option<&ProxyConfig>,
    timeout: Duration,
) -> Result<TcpStream, ProxyError> {
    let addr = host_port(host, port);
    match proxy.and_then(|p| p.proxy_for(host, port)) {
        None => {
            let tcp = tokio::time::timeout(timeout, TcpStream::connect((host, port)))
                .await
                .map_err(|_| ProxyError::TimedOut {
                    addr: addr.clone(),
                    via: String::new(),
                })?
                .map_err(|source| ProxyError::Connect {
                    addr: addr.clone(),
                    source,
                })?;
            // Tunnel frames are small and latency matters more than packet count.
            let _ = tcp.set_nodelay(true);
            tracing::debug!(%addr, "tcp connected");
            Ok(tcp)
        }
        Some(proxy) => {
            let via = async {
                let mut tcp = TcpStream::connect((proxy.host.as_str(), proxy.port))
                    .await
                    .map_err(|source| ProxyError::ConnectProxy {
                        proxy: proxy.to_string(),
                        source,
                    })?;
                let _ = tcp.set_nodelay(true);
                connect_tunnel(&mut tcp, proxy, host, port).await?;
                Ok(tcp)
            };
            let tcp =
                tokio::time::timeout(timeout, via)
                    .await
                    .map_err(|_| ProxyError::TimedOut {
                        addr: addr.clone(),
                        via: format!(" through the proxy {proxy}"),
                    })??;
            tracing::debug!(%addr, %proxy, "tcp connected through the proxy");
            Ok(tcp)
        }
    }
}

/// Runs the CONNECT exchange for `host:port` on `io`, a connection to `proxy`. On success `io` is the
/// tunnelled byte stream (nothing after the proxy's response header has been read from it).
pub async fn connect_tunnel<IO>(
    io: &mut IO,
    proxy: &Proxy,
    host: &str,
    port: u16,
) -> Result<(), ProxyError>
where
    IO: AsyncRead + AsyncWrite + Unpin,
{
    let target = host_port(host, port);
    let io_err = |source| ProxyError::Io {
        proxy: proxy.to_string(),
        source,
    };
    let mut request = format!(
        "CONNECT {target} HTTP/1.1\r\nHost: {target}\r\nUser-Agent: tether/{}\r\n",
        env!("CARGO_PKG_VERSION")
    );
    if let Some(authorization) = proxy.authorization() {
        request.push_str("Proxy-Authorization: ");
        request.push_str(&authorization);
        request.push_str("\r\n");
    }
    request.push_str("\r\n");
    io.write_all(request.as_bytes()).await.map_err(io_err)?;
    io.flush().await.map_err(io_err)?;

    let bad = |reason: String| ProxyError::BadResponse {
        proxy: proxy.to_string(),
        target: target.clone(),
        reason,
    };
    // One byte at a time: the tunnelled bytes right after the header must stay unread, and the header is
    // small and read once per connection.
    let mut head = Vec::with_capacity(256);
    loop {
        if head.ends_with(b"\r\n\r\n") || head.ends_with(b"\n\n") {
            break;
        }
        if head.len() >= MAX_RESPONSE_HEADER {
            return Err(bad(format!(
                "response header longer than {MAX_RESPONSE_HEADER} bytes"
            )));
        }
        let mut byte = [0u8; 1];
        let n = io.read(&mut byte).await.map_err(io_err)?;
        if n == 0 {
            return Err(bad(if head.is_empty() {
                "the proxy closed the connection without answering".to_owned()
            } else {
                "the proxy closed the connection in the middle of its response".to_owned()
            }));
        }
        head.push(byte[0]);
    }
    let (status, reason) = parse_status_line(&head).ok_or_else(|| {
        let first = head.split(|b| *b == b'\n').next().unwrap_or_default();
        bad(format!(
            "not an HTTP response: {:?}",
            String::from_utf8_lossy(&first[..first.len().min(80)])
        ))
    })?;
    if (200..300).contains(&status) {
        return Ok(());
    }
    // 407 is the proxy's way to ask for credentials; some proxies (tinyproxy) answer 401 instead.
    let hint = match (status, proxy.credentials.is_some()) {
        (401 | 407, false) => {
            "; the proxy wants credentials: give them in the proxy URL, http://user:password@host:port"
        }
        (401 | 407, true) => "; check the proxy user name and password",
        _ => "",
    };
    Err(ProxyError::Refused {
        proxy: proxy.to_string(),
        target,
        status,
        reason,
        hint,
    })
}

/// `HTTP/1.x SSS reason` → (SSS, reason).
fn parse_status_line(head: &[u8]) -> Option<(u16, String)> {
    let line = head.split(|b| *b == b'\n').next()?;
    let line = std::str::from_utf8(line).ok()?.trim_end_matches('\r');
    let mut parts = line.splitn(3, ' ');
    let version = parts.next()?;
    if !matches!(version, "HTTP/1.0" | "HTTP/1.1") {
        return None;
    }
    let code = parts.next()?;
    if code.len() != 3 {
        return None;
    }
    let status = code
        .parse::<u16>()
        .ok()
        .filter(|s| (100..600).contains(s))?;
    let reason: String = parts
        .next()
        .unwrap_or("")
        .trim()
        .chars()
        .filter(|c| !c.is_control())
        .take(120)
        .collect();
    Some((status, reason))
}

fn parse_bypass(entry: &str) -> Result<Bypass, ProxyError> {
    let invalid = |reason: &str| ProxyError::InvalidBypass {
        entry: entry.to_owned(),
        reason: reason.to_owned(),
    };
    if entry == "*" {
        return Ok(Bypass::All);
    }
    if let Some((net, prefix)) = entry.split_once('/') {
        let net = net
            .trim_start_matches('[')
            .trim_end_matches(']')
            .parse::<IpAddr>()
            .map_err(|_| invalid("not a CIDR (address/prefix)"))?;
        let net = canonical(net);
        let max = if net.is_ipv4() { 32 } else { 128 };
        let prefix = prefix
            .parse::<u8>()
            .ok()
            .filter(|p| *p <= max)
            .ok_or_else(|| invalid(&format!("the prefix length must be 0..={max}")))?;
        return Ok(Bypass::Cidr { net, prefix });
    }
    // Bare IPv6, with or without brackets, and [v6]:port.
    if let Ok(ip) = entry.parse::<IpAddr>() {
        return Ok(Bypass::Ip {
            ip: canonical(ip),
            port: None,
        });
    }
    if let Some(rest) = entry.strip_prefix('[') {
        let (ip, port) = match rest.split_once(']') {
            Some((ip, "")) => (ip, None),
            Some((ip, port)) => (
                ip,
                Some(
                    port.strip_prefix(':')
                        .ok_or_else(|| invalid("expected :port after ]"))?,
                ),
            ),
            None => return Err(invalid("missing ]")),
        };
        let ip = ip
            .parse::<IpAddr>()
            .map_err(|_| invalid("not an IPv6 address"))?;
        let port = port.map(|p| parse_port(p).ok_or_else(|| invalid("bad port")));
        return Ok(Bypass::Ip {
            ip: canonical(ip),
            port: port.transpose()?,
        });
    }
    let (name, port) = match entry.rsplit_once(':') {
        Some((name, port)) => (
            name,
            Some(parse_port(port).ok_or_else(|| invalid("bad port"))?),
        ),
        None => (entry, None),
    };
    if let Ok(ip) = name.parse::<IpAddr>() {
        return Ok(Bypass::Ip {
            ip: canonical(ip),
            port,
        });
    }
    let lower = name.to_ascii_lowercase();
    let (name, subdomains_only) = match lower.strip_prefix("*.").or(lower.strip_prefix('.')) {
        Some(rest) => (rest.to_owned(), true),
        None => (lower.clone(), false),
    };
    let name = name.trim_end_matches('.').to_owned();
    let valid_char = |c: char| c.is_ascii_alphanumeric() || c == '-' || c == '.' || c == '_';
    if name.is_empty() || !name.chars().all(valid_char) || name.contains("..") {
        return Err(invalid("not a host name, IP address or CIDR"));
    }
    Ok(Bypass::Domain {
        name,
        subdomains_only,
        port,
    })
}

fn parse_port(text: &str) -> Option<u16> {
    text.parse::<u16>().ok().filter(|p| *p != 0)
}

/// IPv4-mapped IPv6 addresses compare as IPv4.
fn canonical(ip: IpAddr) -> IpAddr {
    match ip {
        IpAddr::V6(v6) => v6.to_ipv4_mapped().map_or(IpAddr::V6(v6), IpAddr::V4),
        v4 => v4,
    }
}

fn in_cidr(ip: IpAddr, net: IpAddr, prefix: u8) -> bool {
    match (ip, net) {
        (IpAddr::V4(ip), IpAddr::V4(net)) => {
            let mask = u32::MAX.checked_shl(32 - u32::from(prefix)).unwrap_or(0);
            u32::from(ip) & mask == u32::from(net) & mask
        }
        (IpAddr::V6(ip), IpAddr::V6(net)) => {
            let mask = u128::MAX.checked_shl(128 - u32::from(prefix)).unwrap_or(0);
            u128::from(ip) & mask == u128::from(net) & mask
        }
        _ => false,
    }
}

/// `host:port`, with brackets around an IPv6 host.
pub(crate) fn host_port(host: &str, port: u16) -> String {
    if host.contains(':') {
        format!("[{host}]:{port}")
    } else {
        format!("{host}:{port}")
    }
}

/// A URL with the password part of its userinfo replaced by `***`, for error messages.
fn redact(url: &str) -> String {
    let Some((scheme, rest)) = url.split_once("://") else {
        return url.to_owned();
    };
    let authority_end = rest.find('/').unwrap_or(rest.len());
    let (authority, path) = rest.split_at(authority_end);
    match authority.rsplit_once('@') {
        Some((userinfo, host)) => {
            let user = userinfo.split_once(':').map_or(userinfo, |(u, _)| u);
            format!("{scheme}://{user}:***@{host}{path}")
        }
        None => url.to_owned(),
    }
}

/// Decodes `%XX` escapes; `None` if an escape is malformed or the result is not UTF-8.
fn percent_decode(text: &str) -> Option<String> {
    let bytes = text.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'%' {
            let hex = bytes.get(i + 1..i + 3)?;
            let hex = std::str::from_utf8(hex).ok()?;
            out.push(u8::from_str_radix(hex, 16).ok()?);
            i += 3;
        } else {
            out.push(bytes[i]);
            i += 1;
        }
    }
    String::from_utf8(out).ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn no_proxy(list: &str) -> NoProxy {
        match NoProxy::parse(list) {
            Ok(n) => n,
            Err(e) => panic!("{list:?}: {e}"),
        }
    }

    #[test]
    fn proxy_urls_parse_with_hidden_passwords() -> anyhow::Result<()> {
        let p = Proxy::parse("http://alice:s%40cr%3At@proxy.corp:3128")?;
        assert_eq!(
            (p.host(), p.port(), p.user()),
            ("proxy.corp", 3128, Some("alice"))
        );
        // The password is decoded for the header…
        let expected = base64::engine::general_purpose::STANDARD.encode("alice:s@cr:t");
        assert_eq!(p.authorization(), Some(format!("Basic {expected}")));
        // …and never printed.
        for text in [p.to_string(), format!("{p:?}")] {
            assert!(!text.contains("s@cr") && !text.contains("s%40cr"), "{text}");
            assert!(text.contains("alice:***@proxy.corp:3128"), "{text}");
        }

        let p = Proxy::parse("10.0.0.1:8080")?;
        assert_eq!((p.host(), p.port(), p.user()), ("10.0.0.1", 8080, None));
        assert_eq!(p.authorization(), None);
        let p = Proxy::parse("http://[::1]:3128/")?;
        assert_eq!((p.host(), p.port()), ("::1", 3128));
        assert_eq!(p.to_string(), "http://[::1]:3128");
        let p = Proxy::parse("http://proxy.corp")?;
        assert_eq!(p.port(), 80);
        let p = Proxy::parse("http://bob@proxy.corp:1")?;
        assert_eq!(p.user(), Some("bob"));

        for bad in [
            "https://proxy.corp:3128",
            "socks5://proxy.corp:1080",
            "http://proxy.corp:3128/path",
            "http://:3128",
            "http://proxy.corp:99999",
            "http://u:%ZZ@proxy.corp:1",
        ] {
            assert!(Proxy::parse(bad).is_err(), "{bad} should be rejected");
        }
        let err = Proxy::parse("https://u:hunter2@proxy.corp:3128")
            .err()
            .map(|e| e.to_string())
            .unwrap_or_default();
        assert!(
            err.contains("not supported") && !err.contains("hunter2"),
            "{err}"
        );
        Ok(())
    }

    #[test]
    fn no_proxy_matches_hosts_suffixes_ips_and_cidrs() {
        let n = no_proxy(
            " example.com, .internal.corp ,*.svc.local, 10.0.0.0/8, 192.168.1.5, fd00::/8, [::1]:8443, api.example.org:6443,,LOCALHOST ",
        );
        let cases: &[(&str, u16, bool)] = &[
            // A plain domain: itself and its subdomains, not look-alikes.
            ("example.com", 443, true),
            ("EXAMPLE.com.", 443, true),
            ("a.b.example.com", 443, true),
            ("badexample.com", 443, false),
            ("example.com.evil.net", 443, false),
            // Leading dot or "*.": subdomains only.
            ("internal.corp", 443, false),
            ("relay.internal.corp", 443, true),
            ("x.svc.local", 443, true),
            ("svc.local", 443, false),
            // CIDRs match IP hosts only, v4 and v6, mapped addresses included.
            ("10.1.2.3", 443, true),
            ("11.1.2.3", 443, false),
            ("::ffff:10.9.9.9", 443, true),
            ("[fd12::1]", 443, true),
            ("fe80::1", 443, false),
            // Exact IPs, with and without a port.
            ("192.168.1.5", 1, true),
            ("192.168.1.6", 1, false),
            ("::1", 8443, true),
            ("[::1]", 443, false),
            // A domain with a port.
            ("api.example.org", 6443, true),
            ("api.example.org", 443, false),
            ("localhost", 80, true),
            ("relay.example.net", 443, false),
        ];
        for (host, port, expected) in cases {
            assert_eq!(n.matches(host, *port), *expected, "{host}:{port}");
        }
    }

    #[test]
    fn no_proxy_star_empty_and_invalid_entries() {
        assert!(no_proxy("*").matches("anything.example", 1));
        assert!(no_proxy("*").matches("1.2.3.4", 1));
        let empty = no_proxy(" , ");
        assert!(empty.is_empty());
        assert!(!empty.matches("localhost", 80));
        assert!(no_proxy("0.0.0.0/0").matches("8.8.8.8", 53));
        assert!(!no_proxy("0.0.0.0/0").matches("2001:db8::1", 53));
        assert!(no_proxy("::/0").matches("2001:db8::1", 53));
        for bad in [
            "10.0.0.0/33",
            "10.0.0.0/x",
            "fd00::/129",
            "host:0",
            "host:http",
            "[::1",
            "[::1]x",
            "bad host",
            "a..b",
        ] {
            assert!(NoProxy::parse(bad).is_err(), "{bad:?} should be rejected");
        }
    }

    #[test]
    fn proxy_for_applies_the_bypass_list() -> anyhow::Result<()> {
        let config = ProxyConfig::parse("http://proxy:3128", Some(".cluster.local,10.0.0.0/8"))?;
        assert!(config.proxy_for("relay.example.com", 443).is_some());
        assert!(
            config
                .proxy_for("kubernetes.default.svc.cluster.local", 443)
                .is_none()
        );
        assert!(config.proxy_for("10.96.0.1", 443).is_none());
        assert!(
            ProxyConfig::parse("http://proxy:3128", None)?
                .proxy_for("x", 1)
                .is_some()
        );
        assert!(ProxyConfig::parse("http://proxy:3128", Some("bad/cidr")).is_err());
        Ok(())
    }

    #[test]
    fn status_lines() {
        assert_eq!(
            parse_status_line(b"HTTP/1.1 200 Connection established\r\n\r\n"),
            Some((200, "Connection established".to_owned()))
        );
        assert_eq!(
            parse_status_line(b"HTTP/1.0 407 Proxy Authentication Required\r\nX: y\r\n\r\n"),
            Some((407, "Proxy Authentication Required".to_owned()))
        );
        assert_eq!(
            parse_status_line(b"HTTP/1.1 200\n\n"),
            Some((200, String::new()))
        );
        for bad in [
            &b"SSH-2.0-OpenSSH\r\n\r\n"[..],
            b"HTTP/1.1 20 OK\r\n\r\n",
            b"HTTP/2 200 OK\r\n\r\n",
            b"HTTP/1.1 abc OK\r\n\r\n",
            b"HTTP/1.1 999 OK\r\n\r\n",
        ] {
            assert_eq!(
                parse_status_line(bad),
                None,
                "{:?}",
                String::from_utf8_lossy(bad)
            );
        }
    }

    #[test]
    fn redaction_and_decoding() {
        assert_eq!(redact("http://u:p@h:1/x"), "http://u:***@h:1/x");
        assert_eq!(redact("http://h:1"), "http://h:1");
        assert_eq!(redact("http://u@h:1"), "http://u:***@h:1");
        assert_eq!(percent_decode("a%20b%2F"), Some("a b/".to_owned()));
        assert_eq!(percent_decode("%"), None);
        assert_eq!(percent_decode("%ff"), None);
    }
}
