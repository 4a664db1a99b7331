//! The peers measured beside Tether: rathole (a well-known reverse tunnel, carrying the same TCP traffic to the
//! same upstream, so the client's TLS goes end to end through it), HAProxy (one HTTP-aware proxy that terminates
//! the client's TLS and opens its own to the upstream: the floor for an HTTP-aware gateway, which Tether is twice
//! over plus a tunnel) and iperf3 (raw loopback TCP, the physical limit for bulk transfers).

use std::net::SocketAddr;
use std::path::Path;
use std::time::Duration;

use anyhow::{Context as _, bail};
use clap::ValueEnum;
use serde::Serialize;
use tokio::process::Command;
use tokio::time::Instant;

use crate::certs::ServerTls;
use crate::client::{HttpClient, fetch};
use crate::procs::{self, Proc};

/// How rathole's server and client talk to each other.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum RatholeTransport {
    /// Plain TCP (rathole's default; the client's TLS still runs end to end inside it).
    Tcp,
    /// Noise protocol encryption between rathole's client and server.
    Noise,
}

impl std::fmt::Display for RatholeTransport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            RatholeTransport::Tcp => "tcp",
            RatholeTransport::Noise => "noise",
        })
    }
}

/// A running rathole server and client forwarding `service` to the upstream.
#[derive(Debug)]
pub struct Rathole {
    /// rathole's server process.
    pub server: Proc,
    /// rathole's client process.
    pub client: Proc,
    /// Where visitors connect (the server's service port).
    pub service: SocketAddr,
}

/// rathole's server and client configuration files for one service.
pub fn rathole_configs(
    control: SocketAddr,
    service: SocketAddr,
    upstream: SocketAddr,
    transport: RatholeTransport,
    keys: Option<(&str, &str)>,
) -> (String, String) {
    let token = "tether-loadtest";
    let (server_transport, client_transport) = match (transport, keys) {
        (RatholeTransport::Noise, Some((private, public))) => (
            format!(
                "\n[server.transport]\ntype = \"noise\"\n[server.transport.noise]\nlocal_private_key = \"{private}\"\n"
            ),
            format!(
                "\n[client.transport]\ntype = \"noise\"\n[client.transport.noise]\nremote_public_key = \"{public}\"\n"
            ),
        ),
        _ => (String::new(), String::new()),
    };
    let server = format!(
        "[server]\nbind_addr = \"{control}\"\n{server_transport}\n[server.services.upstream]\ntoken = \"{token}\"\nbind_addr = \"{service}\"\nnodelay = true\n"
    );
    let client = format!(
        "[client]\nremote_addr = \"{control}\"\n{client_transport}\n[client.services.upstream]\ntoken = \"{token}\"\nlocal_addr = \"{upstream}\"\nnodelay = true\n"
    );
    (server, client)
}

/// Parses `rathole --genkey` output into (private, public).
fn parse_genkey(out: &str) -> Option<(String, String)> {
    let mut lines = out.lines().map(str::trim);
    let mut private = None;
    let mut public = None;
    while let Some(l) = lines.next() {
        if l.starts_with("Private Key") {
            private = lines.next().map(str::to_owned);
        } else if l.starts_with("Public Key") {
            public = lines.next().map(str::to_owned);
        }
    }
    Some((private?, public?))
}

impl Rathole {
    /// Starts rathole's server and client in `dir` forwarding to `upstream`, and waits until a GET of
    /// `probe_path` through it succeeds.
    pub async fn start(
        binary: &Path,
        dir: &Path,
        upstream: SocketAddr,
        transport: RatholeTransport,
        client: &HttpClient,
        probe_path: &str,
    ) -> anyhow::Result<Self> {
        std::fs::create_dir_all(dir)?;
        let control = SocketAddr::from(([127, 0, 0, 1], procs::free_port()?));
        let service = SocketAddr::from(([127, 0, 0, 1], procs::free_port()?));
        let keys = match transport {
            RatholeTransport::Noise => {
                let out = Command::new(binary).arg("--genkey").output().await?;
                Some(
                    parse_genkey(&String::from_utf8_lossy(&out.stdout))
                        .context("cannot parse `rathole --genkey` output")?,
                )
            }
            RatholeTransport::Tcp => None,
        };
        let (server_toml, client_toml) = rathole_configs(
            control,
            service,
            upstream,
            transport,
            keys.as_ref().map(|(a, b)| (a.as_str(), b.as_str())),
        );
        let server_path = dir.join("rathole-server.toml");
        let client_path = dir.join("rathole-client.toml");
        std::fs::write(&server_path, server_toml)?;
        std::fs::write(&client_path, client_toml)?;
        let env = [("RUST_LOG", "warn")];
        let mut server = Proc::spawn(
            "rathole server",
            None,
            binary,
            &["--server".to_owned(), server_path.display().to_string()],
            &env,
            &dir.join("rathole-server.log"),
        )?;
        procs::wait_tcp(control, Duration::from_secs(10)).await?;
        let mut rclient = Proc::spawn(
            "rathole client",
            None,
            binary,
            &["--client".to_owned(), client_path.display().to_string()],
            &env,
            &dir.join("rathole-client.log"),
        )?;
        let uri: http::Uri = format!("https://{service}{probe_path}").parse()?;
        wait_forwarding(client, &uri, &mut [&mut server, &mut rclient])
            .await
            .context("rathole did not forward a request")?;
        Ok(Self {
            server,
            client: rclient,
            service,
        })
    }

    /// Stops both processes.
    pub async fn stop(self) {
        self.client.kill().await;
        self.server.kill().await;
    }
}

/// GETs `uri` through a peer just started (its processes `procs`) until one succeeds: at most 20 s, each try 2 s;
/// fails at once if one of the processes exits.
async fn wait_forwarding(
    client: &HttpClient,
    uri: &http::Uri,
    procs: &mut [&mut Proc],
) -> anyhow::Result<()> {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        for proc in procs.iter_mut() {
            proc.check_running()?;
        }
        let probe =
            tokio::time::timeout(Duration::from_secs(2), fetch(client, uri.clone(), |_| {})).await;
        if matches!(probe, Ok(Ok(_))) {
            return Ok(());
        }
        if Instant::now() > deadline {
            bail!("none within 20 s: {probe:?}");
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// A running HAProxy in HTTP mode between the client and the upstream, TLS on both sides.
#[derive(Debug)]
pub struct Haproxy {
    /// HAProxy's process (one, with a thread per CPU).
    pub proc: Proc,
    /// Where clients connect (HTTPS).
    pub addr: SocketAddr,
    /// The CA of HAProxy's certificate, for clients to trust.
    pub ca_pem: String,
}

/// HAProxy's configuration: `listen` terminates the client's TLS with the certificate and key in `pem`, HTTP
/// mode in between, and TLS again to `upstream`, whose certificate is verified against `upstream_ca` for
/// `localhost`. Paths are written in double quotes: they must hold no `"`, `\` or newline.
///
/// h2 to the upstream is the like-for-like choice for requests (the agent's choice too). For `bulk` it is not
/// HAProxy's best: on 2 cores HAProxy 2.6 moved one 64 MiB body over h2 at about half its http/1.1 rate (~100
/// vs ~225 MB/s), with twice its own CPU per MB and five times the upstream's.
pub fn haproxy_config(
    listen: SocketAddr,
    upstream: SocketAddr,
    pem: &str,
    upstream_ca: &str,
) -> String {
    format!(
        "# Written by tether-loadtest for the `haproxy` path: client -> HAProxy -> upstream.
# One HTTP-aware proxy terminating TLS, the floor for an HTTP-aware gateway.
global
    # nbthread is left at its default: one thread per CPU.
    # maxconn is left at its default too, derived from the descriptor limit HAProxy inherits (a fixed one
    # above that limit would stop it from starting).
    # Startup messages, and the requests that failed (below), go to stderr: haproxy.log.
    log stderr format raw local0

defaults
    mode http
    log global
    option httplog
    # Requests that succeeded are not logged: a line per request would add to the CPU measured.
    option dontlog-normal
    timeout connect 5s
    timeout client 60s
    timeout server 60s
    # Upgraded connections (exec, port-forward). A watch is an ordinary response: 60 s of silence ends it.
    timeout tunnel 1h

frontend loadtest
    bind {listen} ssl crt \"{pem}\" alpn h2,http/1.1
    default_backend upstream

backend upstream
    # The upstream offers h2 and http/1.1 by ALPN, as kube-apiserver does, and the agent talks h2 to it:
    # h2 here too, its connections shared by every client connection (http-reuse always), as the agent
    # shares its pool of upstream connections among the tunnel's streams.
    http-reuse always
    server up {upstream} ssl verify required ca-file \"{upstream_ca}\" verifyhost localhost sni str(localhost) alpn h2
"
    )
}

/// The text of `path` for HAProxy's configuration, which quotes it: no `"`, `\`, newline, or non-UTF-8.
fn config_path(path: &Path) -> anyhow::Result<&str> {
    match path.to_str() {
        Some(p) if !p.contains(['"', '\\', '\n']) => Ok(p),
        _ => bail!(
            "{}: HAProxy's configuration cannot name this path (quotes, backslashes, newlines or non-UTF-8)",
            path.display()
        ),
    }
}

impl Haproxy {
    /// Writes HAProxy's configuration in `dir` (its certificate from `tls`, trusting `upstream_ca_pem` for the
    /// upstream), has HAProxy check it, starts it in the foreground (`-db`, its output in `haproxy.log`) and
    /// waits until a GET of `probe_path` through it succeeds; `client` must trust `tls`'s CA.
    pub async fn start(
        binary: &Path,
        dir: &Path,
        upstream: SocketAddr,
        upstream_ca_pem: &str,
        tls: &ServerTls,
        client: &HttpClient,
        probe_path: &str,
    ) -> anyhow::Result<Self> {
        std::fs::create_dir_all(dir)?;
        let addr = SocketAddr::from(([127, 0, 0, 1], procs::free_port()?));
        // HAProxy reads the certificate chain and its key from one file.
        let pem = dir.join("haproxy.pem");
        std::fs::write(&pem, format!("{}{}", tls.cert_pem, tls.key_pem))?;
        let upstream_ca = dir.join("upstream-ca.pem");
        std::fs::write(&upstream_ca, upstream_ca_pem)?;
        let config = dir.join("haproxy.cfg");
        std::fs::write(
            &config,
            haproxy_config(
                addr,
                upstream,
                config_path(&pem)?,
                config_path(&upstream_ca)?,
            ),
        )?;
        let check = Command::new(binary)
            .arg("-c")
            .arg("-f")
            .arg(&config)
            .output()
            .await
            .with_context(|| format!("cannot run {}", binary.display()))?;
        if !check.status.success() {
            bail!(
                "{} rejects {}:\n{}{}",
                binary.display(),
                config.display(),
                String::from_utf8_lossy(&check.stdout),
                String::from_utf8_lossy(&check.stderr)
            );
        }
        let log = dir.join("haproxy.log");
        let mut proc = Proc::spawn(
            "haproxy",
            None,
            binary,
            &[
                "-db".to_owned(),
                "-f".to_owned(),
                config.display().to_string(),
            ],
            &[],
            &log,
        )?;
        let uri: http::Uri = format!("https://{addr}{probe_path}").parse()?;
        if let Err(e) = wait_forwarding(client, &uri, &mut [&mut proc]).await {
            bail!(
                "HAProxy did not forward a request: {e:#}; last lines of {}:\n{}",
                log.display(),
                procs::tail(&log, 15)
            );
        }
        Ok(Self {
            proc,
            addr,
            ca_pem: tls.ca_pem.clone(),
        })
    }

    /// Stops HAProxy.
    pub async fn stop(self) {
        self.proc.kill().await;
    }
}

/// Runs iperf3 on loopback for `seconds` with `parallel` streams and returns the received MB/s.
pub async fn iperf3(
    binary: &Path,
    dir: &Path,
    seconds: u64,
    parallel: usize,
) -> anyhow::Result<f64> {
    let port = procs::free_port()?;
    let server = Proc::spawn(
        "iperf3 server",
        None,
        binary,
        &[
            "-s".to_owned(),
            "-B".to_owned(),
            "127.0.0.1".to_owned(),
            "-p".to_owned(),
            port.to_string(),
        ],
        &[],
        &dir.join("iperf3-server.log"),
    )?;
    procs::wait_tcp(
        SocketAddr::from(([127, 0, 0, 1], port)),
        Duration::from_secs(10),
    )
    .await?;
    let out = tokio::time::timeout(
        Duration::from_secs(seconds + 20),
        Command::new(binary)
            .args(["-c", "127.0.0.1", "-p", &port.to_string(), "-J"])
            .args(["-t", &seconds.to_string(), "-P", &parallel.to_string()])
            .output(),
    )
    .await
    .context("iperf3 client timed out")??;
    server.kill().await;
    let v: serde_json::Value =
        serde_json::from_slice(&out.stdout).context("cannot parse iperf3 -J output")?;
    let bits = v["end"]["sum_received"]["bits_per_second"]
        .as_f64()
        .with_context(|| format!("no end.sum_received in iperf3 output: {}", v["error"]))?;
    Ok(bits / 8.0 / 1e6)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rathole_configs_name_the_same_service_and_token() {
        let a = |p: u16| SocketAddr::from(([127, 0, 0, 1], p));
        let (server, client) = rathole_configs(a(1), a(2), a(3), RatholeTransport::Tcp, None);
        assert!(
            server.contains("[server]\nbind_addr = \"127.0.0.1:1\""),
            "{server}"
        );
        assert!(server.contains("[server.services.upstream]"), "{server}");
        assert!(server.contains("bind_addr = \"127.0.0.1:2\""), "{server}");
        assert!(client.contains("remote_addr = \"127.0.0.1:1\""), "{client}");
        assert!(client.contains("local_addr = \"127.0.0.1:3\""), "{client}");
        assert!(!server.contains("noise"));
        let (server, client) = rathole_configs(
            a(1),
            a(2),
            a(3),
            RatholeTransport::Noise,
            Some(("PRIV", "PUB")),
        );
        assert!(server.contains("local_private_key = \"PRIV\""), "{server}");
        assert!(client.contains("remote_public_key = \"PUB\""), "{client}");
    }

    #[test]
    fn haproxy_config_terminates_tls_on_both_sides_in_http_mode() {
        let a = |p: u16| SocketAddr::from(([127, 0, 0, 1], p));
        let config = haproxy_config(a(1), a(2), "/w/haproxy.pem", "/w/upstream-ca.pem");
        let line = |start: &str| {
            config
                .lines()
                .map(str::trim)
                .find(|l| l.starts_with(start))
                .unwrap_or_default()
        };
        assert_eq!(line("mode "), "mode http", "{config}");
        assert_eq!(
            line("bind "),
            "bind 127.0.0.1:1 ssl crt \"/w/haproxy.pem\" alpn h2,http/1.1",
            "{config}"
        );
        let server = line("server ");
        assert!(server.starts_with("server up 127.0.0.1:2 ssl "), "{config}");
        assert!(
            server.contains("verify required ca-file \"/w/upstream-ca.pem\" verifyhost localhost"),
            "{config}"
        );
        assert!(server.ends_with(" alpn h2"), "{config}");
        for timeout in ["connect 5s", "client 60s", "server 60s", "tunnel 1h"] {
            assert_eq!(
                line(&format!("timeout {timeout}")),
                format!("timeout {timeout}")
            );
        }
        // In the foreground (the process is killed at the end): no daemon, no master-worker; threads and
        // connection bound at HAProxy's defaults.
        for directive in ["daemon", "master-worker", "nbthread", "maxconn"] {
            assert_eq!(line(directive), "", "{config}");
        }
        let sections: Vec<&str> = config
            .lines()
            .filter(|l| !l.starts_with([' ', '#']) && !l.is_empty())
            .collect();
        assert_eq!(
            sections,
            [
                "global",
                "defaults",
                "frontend loadtest",
                "backend upstream"
            ]
        );
    }

    #[test]
    fn haproxy_config_paths_must_be_quotable() {
        assert_eq!(
            config_path(Path::new("/tmp/w/x.pem")).ok(),
            Some("/tmp/w/x.pem")
        );
        assert!(config_path(Path::new("/tmp/a\"b/x.pem")).is_err());
        assert!(config_path(Path::new("/tmp/a\\b/x.pem")).is_err());
        assert!(config_path(Path::new("/tmp/a\nb/x.pem")).is_err());
    }

    #[test]
    fn genkey_output_is_parsed() {
        let out = "Private Key:\nAAA=\n\nPublic Key:\nBBB=\n";
        assert_eq!(parse_genkey(out), Some(("AAA=".into(), "BBB=".into())));
        assert_eq!(parse_genkey("nothing"), None);
    }
}
