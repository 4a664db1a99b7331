//! The peers measured beside Tether: rathole (a well-known reverse tunnel, carrying the same TCP traffic to the
//! same upstream, so the client's TLS goes end to end through it) and iperf3 (raw loopback TCP, the physical
//! limit for bulk transfers).

use std::net::SocketAddr;
use std::path::Path;
use std::time::Duration;

use anyhow::{Context as _, bail};
use clap::ValueEnum;
use serde::Serialize;
use tokio::process::Command;
use tokio::time::Instant;

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
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            server.check_running()?;
            rclient.check_running()?;
            let probe =
                tokio::time::timeout(Duration::from_secs(2), fetch(client, uri.clone(), |_| {}))
                    .await;
            if matches!(probe, Ok(Ok(_))) {
                break;
            }
            if Instant::now() > deadline {
                bail!("rathole did not forward a request within 20 s: {probe:?}");
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
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
    fn genkey_output_is_parsed() {
        let out = "Private Key:\nAAA=\n\nPublic Key:\nBBB=\n";
        assert_eq!(parse_genkey(out), Some(("AAA=".into(), "BBB=".into())));
        assert_eq!(parse_genkey("nothing"), None);
    }
}
