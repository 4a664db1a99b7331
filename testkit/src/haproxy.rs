//! A real HAProxy in front of several HTTPS backends, for the local relay fleet (`tether up --replicas N`) and
//! its tests.
//!
//! TCP mode: TLS passes through untouched, so each backend terminates it and sees its clients' certificates (an
//! agent's identity). Connections go round robin to the backends that pass an HTTPS health check (`GET
//! /readyz` by default, the backend's certificate verified against a CA and a host name) every
//! `check_interval`; one failed check, or one refused connection, takes a backend out of rotation, so a
//! draining or dead backend stops getting new connections within about one interval, while the connections it
//! already holds keep running (a draining relay finishes its watches). A connection refused by a dead backend
//! is retried on another one.
//!
//! The binary is `$TETHER_HAPROXY`, else `haproxy` on `PATH`, else `/usr/sbin/haproxy` (Debian's package
//! `haproxy`). It runs in the foreground as the caller's child (`-db`), killed when the [`HaProxy`] value is
//! dropped; its configuration and log are in the directory given. Server states come from its stats socket
//! (`show stat`, read-only level `user`, on a loopback port).
//!
//! ```no_run
//! # async fn demo(ca: std::path::PathBuf) -> Result<(), tether_testkit::haproxy::HaProxyError> {
//! use tether_testkit::haproxy::{Backend, HaProxy, HaProxyOptions};
//! let Some(bin) = HaProxy::binary_or_skip("my test") else { return Ok(()) };
//! let backends = vec![Backend::new("relay-1", "127.0.0.1:9001".parse().unwrap())];
//! let options = HaProxyOptions::new("/tmp/lb".into(), "127.0.0.1:0".parse().unwrap(), backends, ca);
//! let lb = HaProxy::start(&bin, options).await?;
//! lb.wait_servers("relay-1 up", std::time::Duration::from_secs(10), |s| s.iter().all(|s| s.is_up())).await?;
//! # Ok(()) }
//! ```

use std::net::{Ipv4Addr, SocketAddr, TcpListener};
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;

use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
use tokio::process::{Child, Command};

/// Why HAProxy could not be found, configured, started or asked; the text includes its output.
#[derive(Debug, thiserror::Error)]
#[error("HAProxy: {0}")]
pub struct HaProxyError(String);

fn error(message: impl Into<String>) -> HaProxyError {
    HaProxyError(message.into())
}

/// One server behind the load balancer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Backend {
    /// Its name in HAProxy's configuration and stats (letters, digits, `-`, `_`, `.`).
    pub name: String,
    /// Where it listens (HTTPS).
    pub addr: SocketAddr,
}

impl Backend {
    /// A backend named `name` at `addr`.
    pub fn new(name: impl Into<String>, addr: SocketAddr) -> Backend {
        Backend {
            name: name.into(),
            addr,
        }
    }
}

/// How to run HAProxy.
#[derive(Debug, Clone)]
pub struct HaProxyOptions {
    /// Where `haproxy.cfg` and `haproxy.log` are written (created if missing).
    pub dir: PathBuf,
    /// The address clients connect to; port 0 picks a free port.
    pub listen: SocketAddr,
    /// The servers.
    pub backends: Vec<Backend>,
    /// The health check's path (`GET`, HTTP/1.1, over TLS).
    pub health_path: String,
    /// The CA the backends' certificates must chain to (the health check verifies them).
    pub health_ca: PathBuf,
    /// The name the health check sends (SNI and `Host`) and verifies in the backends' certificates.
    pub health_host: String,
    /// How often each backend is checked.
    pub check_interval: Duration,
    /// Consecutive good checks before a backend that was out comes back into rotation.
    pub rise: u32,
    /// Consecutive failed checks before a backend leaves rotation.
    pub fall: u32,
}

impl HaProxyOptions {
    /// `GET /readyz` verified for `localhost` every 500 ms; out after 1 failure, back after 2 successes.
    pub fn new(
        dir: PathBuf,
        listen: SocketAddr,
        backends: Vec<Backend>,
        health_ca: PathBuf,
    ) -> HaProxyOptions {
        HaProxyOptions {
            dir,
            listen,
            backends,
            health_path: "/readyz".into(),
            health_ca,
            health_host: "localhost".into(),
            check_interval: Duration::from_millis(500),
            rise: 2,
            fall: 1,
        }
    }

    fn validate(&self) -> Result<(), HaProxyError> {
        if self.backends.is_empty() {
            return Err(error("no backend to balance over"));
        }
        let name_ok = |n: &str| {
            !n.is_empty()
                && n.bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b"-_.".contains(&b))
        };
        if let Some(bad) = self.backends.iter().find(|b| !name_ok(&b.name)) {
            return Err(error(format!(
                "backend name {:?}: use letters, digits, '-', '_' and '.'",
                bad.name
            )));
        }
        let path_ok = self.health_path.starts_with('/')
            && self.health_path.bytes().all(|b| b.is_ascii_graphic());
        if !path_ok {
            return Err(error(format!(
                "health check path {:?} must start with '/' and have no spaces",
                self.health_path
            )));
        }
        if !name_ok(&self.health_host) {
            return Err(error(format!(
                "health check host {:?} must be a host name",
                self.health_host
            )));
        }
        if self.rise == 0 || self.fall == 0 || self.check_interval.is_zero() {
            return Err(error(
                "check interval, rise and fall must be greater than zero",
            ));
        }
        for path in [&self.dir, &self.health_ca] {
            if path.to_str().is_none_or(|p| p.contains(['"', '\\', '\n'])) {
                return Err(error(format!(
                    "{}: HAProxy's configuration cannot name this path (quotes, backslashes, newlines or \
                     non-UTF-8)",
                    path.display()
                )));
            }
        }
        Ok(())
    }
}

/// A backend as HAProxy sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ServerStatus {
    /// The backend's name.
    pub name: String,
    /// HAProxy's status: `UP`, `DOWN`, `UP 1/2` (going down), `DOWN 1/2` (coming up), `MAINT`, `no check`…
    pub status: String,
    /// The last health check's result (`L7OK`, `L4CON`, `L7STS`…), empty before the first.
    pub check: String,
}

impl ServerStatus {
    /// True while HAProxy sends it new connections (`UP`, also while going down).
    pub fn is_up(&self) -> bool {
        self.status.starts_with("UP")
    }
}

/// A running HAProxy, killed on drop.
#[derive(Debug)]
pub struct HaProxy {
    child: Child,
    pid: u32,
    addr: SocketAddr,
    stats: SocketAddr,
    config: PathBuf,
    log: PathBuf,
}

/// How long HAProxy has to start listening.
const START_WAIT: Duration = Duration::from_secs(15);

impl HaProxy {
    /// The HAProxy binary, if installed: `$TETHER_HAPROXY`, else `haproxy` on `PATH`, else
    /// `/usr/sbin/haproxy`.
    pub fn binary() -> Option<PathBuf> {
        if let Some(path) = std::env::var_os("TETHER_HAPROXY").filter(|p| !p.is_empty()) {
            return Some(PathBuf::from(path));
        }
        std::env::var_os("PATH")
            .iter()
            .flat_map(std::env::split_paths)
            .chain([PathBuf::from("/usr/sbin"), PathBuf::from("/usr/local/sbin")])
            .map(|dir| dir.join("haproxy"))
            .find(|p| p.is_file())
    }

    /// The binary, or — where HAProxy is not installed — a panic under `CI` and `None` (after printing why)
    /// elsewhere (see [`crate::tools::require`]).
    ///
    /// # Panics
    /// Under CI, when HAProxy is missing: `scripts/install-test-deps.sh` installs it.
    pub fn binary_or_skip(test: &str) -> Option<PathBuf> {
        match Self::binary() {
            Some(bin) => Some(bin),
            None => crate::tools::skip_or_fail(&format!(
                "{test} needs HAProxy (the Debian package `haproxy`), which is not installed"
            )),
        }
    }

    /// Writes the configuration, has HAProxy check it, starts it and waits until it accepts connections.
    /// Backends come into rotation as their health checks pass ([`HaProxy::wait_servers`]).
    pub async fn start(binary: &Path, options: HaProxyOptions) -> Result<HaProxy, HaProxyError> {
        options.validate()?;
        std::fs::create_dir_all(&options.dir)
            .map_err(|e| error(format!("cannot create {}: {e}", options.dir.display())))?;
        let listen = match options.listen.port() {
            0 => SocketAddr::new(options.listen.ip(), free_port()?),
            _ => options.listen,
        };
        let stats = SocketAddr::from((Ipv4Addr::LOCALHOST, free_port()?));
        let config = options.dir.join("haproxy.cfg");
        let log = options.dir.join("haproxy.log");
        std::fs::write(&config, render(&options, listen, stats))
            .map_err(|e| error(format!("cannot write {}: {e}", config.display())))?;

        let check = Command::new(binary)
            .arg("-c")
            .arg("-f")
            .arg(&config)
            .stdin(Stdio::null())
            .output()
            .await
            .map_err(|e| error(format!("cannot run {}: {e}", binary.display())))?;
        if !check.status.success() {
            return Err(error(format!(
                "{} rejects its configuration {}:\n{}{}",
                binary.display(),
                config.display(),
                String::from_utf8_lossy(&check.stdout),
                String::from_utf8_lossy(&check.stderr)
            )));
        }

        let file = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&log)
            .map_err(|e| error(format!("cannot open {}: {e}", log.display())))?;
        let stderr = file
            .try_clone()
            .map_err(|e| error(format!("cannot open {}: {e}", log.display())))?;
        let child = Command::new(binary)
            .arg("-db")
            .arg("-f")
            .arg(&config)
            .stdin(Stdio::null())
            .stdout(file)
            .stderr(stderr)
            // Not in the caller's process group: a Ctrl-C meant for the caller must not stop the load balancer
            // under connections the caller still drains.
            .process_group(0)
            .kill_on_drop(true)
            .spawn()
            .map_err(|e| error(format!("cannot start {}: {e}", binary.display())))?;
        let pid = child.id().ok_or_else(|| error("HAProxy exited at once"))?;
        let mut lb = HaProxy {
            child,
            pid,
            addr: listen,
            stats,
            config,
            log,
        };
        let deadline = tokio::time::Instant::now() + START_WAIT;
        loop {
            if let Ok(Some(status)) = lb.child.try_wait() {
                return Err(error(format!(
                    "HAProxy exited ({status}) before listening on {listen}:\n{}",
                    lb.log_tail()
                )));
            }
            let listening = tokio::net::TcpStream::connect(listen).await.is_ok();
            if listening && lb.servers().await.is_ok() {
                return Ok(lb);
            }
            if tokio::time::Instant::now() >= deadline {
                return Err(error(format!(
                    "HAProxy did not listen on {listen} within {START_WAIT:?}:\n{}",
                    lb.log_tail()
                )));
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// The address clients connect to.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// The process id.
    pub fn pid(&self) -> u32 {
        self.pid
    }

    /// The configuration file.
    pub fn config_path(&self) -> &Path {
        &self.config
    }

    /// The log file (HAProxy's own messages: configuration warnings, backends going up and down).
    pub fn log_path(&self) -> &Path {
        &self.log
    }

    fn log_tail(&self) -> String {
        let text = std::fs::read_to_string(&self.log).unwrap_or_default();
        let lines: Vec<&str> = text.lines().collect();
        lines[lines.len().saturating_sub(20)..].join("\n")
    }

    /// Each backend's status, from the stats socket.
    pub async fn servers(&self) -> Result<Vec<ServerStatus>, HaProxyError> {
        let ask = async {
            let mut socket = tokio::net::TcpStream::connect(self.stats).await?;
            socket.write_all(b"show stat\n").await?;
            let mut text = String::new();
            socket.read_to_string(&mut text).await?;
            Ok::<_, std::io::Error>(text)
        };
        let text = tokio::time::timeout(Duration::from_secs(5), ask)
            .await
            .map_err(|_| error("the stats socket did not answer within 5 s"))?
            .map_err(|e| error(format!("stats socket {}: {e}", self.stats)))?;
        parse_stat(&text)
    }

    /// Waits up to `limit` until the backends' statuses satisfy `check`; the last statuses seen on timeout.
    pub async fn wait_servers(
        &self,
        what: &str,
        limit: Duration,
        mut check: impl FnMut(&[ServerStatus]) -> bool,
    ) -> Result<Vec<ServerStatus>, HaProxyError> {
        let deadline = tokio::time::Instant::now() + limit;
        loop {
            let last = self.servers().await;
            match &last {
                Ok(servers) if check(servers) => return last,
                _ => {}
            }
            if tokio::time::Instant::now() >= deadline {
                return Err(error(format!(
                    "{what}: not within {limit:?}; last seen: {last:?}"
                )));
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// Stops HAProxy (SIGTERM: it closes every connection at once), waiting up to 5 s before killing it.
    pub async fn stop(mut self) {
        let _ = Command::new("kill")
            .arg("-TERM")
            .arg(self.pid.to_string())
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .await;
        if tokio::time::timeout(Duration::from_secs(5), self.child.wait())
            .await
            .is_err()
        {
            let _ = self.child.kill().await;
        }
    }
}

/// The configuration: TCP passthrough, round robin, HTTPS health checks with the backends' certificates
/// verified, a refused connection retried on another backend.
fn render(options: &HaProxyOptions, listen: SocketAddr, stats: SocketAddr) -> String {
    let interval = options.check_interval.as_millis().max(1);
    let mut text = format!(
        "# Written by Tether (local relay fleet); rewritten on every start.\n\
         # TCP mode: TLS passes through to the relays, which see the agents' client certificates.\n\
         global\n\
         \x20   stats socket {stats_bind} level user\n\
         \n\
         defaults\n\
         \x20   mode tcp\n\
         \x20   timeout connect 1s\n\
         \x20   # Watches, logs -f, exec sessions and agent tunnels are long-lived; tunnels ping every 15 s.\n\
         \x20   timeout client 1h\n\
         \x20   timeout server 1h\n\
         \x20   option clitcpka\n\
         \x20   option srvtcpka\n\
         \x20   # A connection refused by a dead backend is tried again on another one.\n\
         \x20   retries 3\n\
         \x20   option redispatch 1\n\
         \n\
         frontend tether\n\
         \x20   bind {listen_bind}\n\
         \x20   default_backend relays\n\
         \n\
         backend relays\n\
         \x20   balance roundrobin\n\
         \x20   # A backend answering anything but 200 (a relay draining, or losing its store) or not\n\
         \x20   # answering leaves rotation after `fall` checks; connections it holds keep running.\n\
         \x20   option httpchk\n\
         \x20   http-check send meth GET uri {path} ver HTTP/1.1 hdr Host {host}\n\
         \x20   http-check expect status 200\n\
         \x20   default-server check check-ssl ca-file \"{ca}\" verify required verifyhost {host} check-sni {host} \
         inter {interval}ms fastinter {interval}ms downinter {interval}ms rise {rise} fall {fall} \
         observe layer4 error-limit 1 on-error mark-down\n",
        stats_bind = bind_address(stats),
        listen_bind = bind_address(listen),
        path = options.health_path,
        host = options.health_host,
        ca = options.health_ca.display(),
        rise = options.rise,
        fall = options.fall,
    );
    for backend in &options.backends {
        text.push_str(&format!(
            "    server {} {}\n",
            backend.name,
            server_address(backend.addr)
        ));
    }
    text
}

/// HAProxy's address syntax, with the family made explicit (`ipv6@::1:8443`).
fn bind_address(addr: SocketAddr) -> String {
    match addr {
        SocketAddr::V4(a) => format!("ipv4@{a}"),
        SocketAddr::V6(a) => format!("ipv6@{}:{}", a.ip(), a.port()),
    }
}

fn server_address(addr: SocketAddr) -> String {
    bind_address(addr)
}

/// The backend servers' rows of `show stat` (CSV whose header line starts with `# `).
fn parse_stat(text: &str) -> Result<Vec<ServerStatus>, HaProxyError> {
    let mut lines = text.lines();
    let header = lines
        .next()
        .and_then(|h| h.strip_prefix("# "))
        .ok_or_else(|| error(format!("unexpected stats answer: {text:?}")))?;
    let columns: Vec<&str> = header.split(',').collect();
    let column = |name: &str| {
        columns
            .iter()
            .position(|c| *c == name)
            .ok_or_else(|| error(format!("no {name} column in the stats header {header:?}")))
    };
    let (sv, status, check) = (
        column("svname")?,
        column("status")?,
        column("check_status")?,
    );
    let mut servers = Vec::new();
    for line in lines.filter(|l| !l.trim().is_empty()) {
        let fields: Vec<&str> = line.split(',').collect();
        let field = |i: usize| fields.get(i).copied().unwrap_or_default().to_owned();
        let name = field(sv);
        if name == "FRONTEND" || name == "BACKEND" {
            continue;
        }
        servers.push(ServerStatus {
            name,
            status: field(status),
            check: field(check),
        });
    }
    Ok(servers)
}

fn free_port() -> Result<u16, HaProxyError> {
    TcpListener::bind((Ipv4Addr::LOCALHOST, 0))
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .map_err(|e| error(format!("cannot find a free port: {e}")))
}

#[cfg(test)]
mod tests {
    use std::convert::Infallible;
    use std::sync::Arc;
    use std::sync::atomic::{AtomicBool, Ordering};

    use http_body_util::{BodyExt as _, Full};
    use hyper_util::client::legacy::Client;
    use hyper_util::rt::TokioExecutor;

    use super::*;
    use crate::certs::{self, Ca};

    #[test]
    fn parses_the_server_rows_of_show_stat() -> Result<(), HaProxyError> {
        let text = "# pxname,svname,qcur,status,check_status,\n\
                    tether,FRONTEND,,OPEN,,\n\
                    relays,relay-1,0,UP,L7OK,\n\
                    relays,relay-2,0,DOWN,L4CON,\n\
                    relays,BACKEND,0,UP,,\n\n";
        let servers = parse_stat(text)?;
        assert_eq!(servers.len(), 2);
        assert!(servers[0].is_up() && servers[0].name == "relay-1" && servers[0].check == "L7OK");
        assert!(!servers[1].is_up());
        assert!(parse_stat("Unknown command\n").is_err());
        Ok(())
    }

    #[test]
    fn refuses_names_and_paths_it_cannot_write_into_its_configuration() {
        let options = |name: &str, ca: &str| {
            HaProxyOptions::new(
                PathBuf::from("/tmp/x"),
                SocketAddr::from((Ipv4Addr::LOCALHOST, 0)),
                vec![Backend::new(
                    name,
                    SocketAddr::from((Ipv4Addr::LOCALHOST, 1)),
                )],
                PathBuf::from(ca),
            )
        };
        assert!(options("relay-1", "/ca.pem").validate().is_ok());
        assert!(options("relay 1", "/ca.pem").validate().is_err());
        assert!(options("relay-1", "/a\"b.pem").validate().is_err());
        let mut empty = options("relay-1", "/ca.pem");
        empty.backends.clear();
        assert!(empty.validate().is_err());
    }

    /// A real HAProxy in front of two HTTPS servers whose `/readyz` follows a switch: both come into rotation;
    /// one leaves it when its readiness turns 503 and comes back when it turns 200; a stopped one leaves it,
    /// and connections through the load balancer keep landing on the other.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn balances_over_ready_backends_only() -> anyhow::Result<()> {
        let Some(bin) = HaProxy::binary_or_skip("the HAProxy harness test") else {
            return Ok(());
        };
        tether_runtime::tls::install_crypto_provider();
        let dir = tempfile::tempdir()?;
        let ca = Ca::new("haproxy test CA")?;
        let ca_file = dir.path().join("ca.pem");
        std::fs::write(&ca_file, ca.cert_pem())?;
        let one = ReadyServer::start(&ca, "one").await?;
        let two = ReadyServer::start(&ca, "two").await?;
        let lb = HaProxy::start(
            &bin,
            HaProxyOptions::new(
                dir.path().join("lb"),
                SocketAddr::from((Ipv4Addr::LOCALHOST, 0)),
                vec![Backend::new("one", one.addr), Backend::new("two", two.addr)],
                ca_file,
            ),
        )
        .await?;
        let all_up = |s: &[ServerStatus]| s.len() == 2 && s.iter().all(ServerStatus::is_up);
        lb.wait_servers("both up", Duration::from_secs(10), all_up)
            .await?;
        let get = Getter::new(&ca, lb.addr().port())?;
        let mut seen = std::collections::BTreeSet::new();
        for _ in 0..6 {
            seen.insert(get.whoami().await?);
        }
        assert_eq!(seen.len(), 2, "round robin over both: {seen:?}");

        one.ready.store(false, Ordering::SeqCst);
        lb.wait_servers("one out", Duration::from_secs(10), |s| {
            s.iter().any(|s| s.name == "one" && !s.is_up())
        })
        .await?;
        for _ in 0..4 {
            assert_eq!(get.whoami().await?, "two");
        }
        one.ready.store(true, Ordering::SeqCst);
        lb.wait_servers("one back", Duration::from_secs(10), all_up)
            .await?;

        two.task.abort();
        lb.wait_servers("two out", Duration::from_secs(10), |s| {
            s.iter().any(|s| s.name == "two" && !s.is_up())
        })
        .await?;
        for _ in 0..4 {
            assert_eq!(get.whoami().await?, "one");
        }
        lb.stop().await;
        Ok(())
    }

    /// An HTTPS server answering `/readyz` (200, or 503 when `ready` is false) and anything else with its name.
    struct ReadyServer {
        addr: SocketAddr,
        ready: Arc<AtomicBool>,
        task: tokio::task::JoinHandle<()>,
    }

    impl ReadyServer {
        async fn start(ca: &Ca, name: &'static str) -> anyhow::Result<ReadyServer> {
            let cert = ca.issue_server(&["localhost".to_string(), "127.0.0.1".into()])?;
            let tls = certs::server_config(vec![cert.cert_der()], cert.key_der())?;
            let listener = tokio::net::TcpListener::bind((Ipv4Addr::LOCALHOST, 0)).await?;
            let addr = listener.local_addr()?;
            let ready = Arc::new(AtomicBool::new(true));
            let flag = ready.clone();
            let make_service = move |_conn: tether_runtime::serve::Conn| {
                let flag = flag.clone();
                hyper::service::service_fn(move |req: hyper::Request<hyper::body::Incoming>| {
                    let (status, text) = match req.uri().path() {
                        "/readyz" if flag.load(Ordering::SeqCst) => (200, "ok"),
                        "/readyz" => (503, "draining"),
                        _ => (200, name),
                    };
                    async move {
                        Ok::<_, Infallible>(
                            hyper::Response::builder()
                                .status(status)
                                .body(Full::new(bytes::Bytes::from_static(text.as_bytes())))
                                .unwrap_or_default(),
                        )
                    }
                })
            };
            let task = tokio::spawn(async move {
                let limits = tether_runtime::serve::Limits::default();
                let draining = tether_runtime::serve::serve(
                    listener,
                    tls,
                    limits,
                    make_service,
                    std::future::pending::<()>(),
                )
                .await;
                draining.cut();
            });
            Ok(ReadyServer { addr, ready, task })
        }
    }

    /// GETs `/whoami` through the load balancer on a new connection each time (so each lands anew).
    struct Getter {
        client: Client<
            hyper_rustls::HttpsConnector<hyper_util::client::legacy::connect::HttpConnector>,
            Full<bytes::Bytes>,
        >,
        url: String,
    }

    impl Getter {
        fn new(ca: &Ca, port: u16) -> anyhow::Result<Getter> {
            let tls = certs::client_config(ca.cert_pem().as_bytes(), &[])?;
            let connector = hyper_rustls::HttpsConnectorBuilder::new()
                .with_tls_config((*tls).clone())
                .https_only()
                .enable_http1()
                .build();
            let client = Client::builder(TokioExecutor::new())
                .pool_max_idle_per_host(0)
                .build(connector);
            Ok(Getter {
                client,
                url: format!("https://localhost:{port}/whoami"),
            })
        }

        async fn whoami(&self) -> anyhow::Result<String> {
            let response = self.client.get(self.url.parse()?).await?;
            anyhow::ensure!(response.status() == 200, "{}", response.status());
            let body = response.into_body().collect().await?.to_bytes();
            Ok(String::from_utf8_lossy(&body).into_owned())
        }
    }
}
