//! The agent reaches the relay only through a real HTTP CONNECT proxy (Debian's tinyproxy) with Basic auth.
//!
//! Topology: the relay listens on 127.0.0.1 in the root namespace. The "cluster" (sample apiserver + agent
//! binaries) lives in a network namespace whose own 127.0.0.1 is its own, so the relay cannot be reached from
//! there directly; tinyproxy listens on the root namespace's end of the veth pair and may CONNECT only to the
//! relay's port. The tests show the direct path fails (also when the relay is put on the proxy's skip list), a
//! wrong proxy password is a clear agent error, and with the right one (from `--proxy-https` or `HTTPS_PROXY`)
//! the agent onboards, connects, and kubectl reaches the cluster through the relay; the password is never
//! logged.
//!
//! Needs root, `ip`, `iptables` and `tinyproxy`. Where they are missing the test prints why and passes without
//! asserting, except under CI (`CI` set), where it fails.

mod common;

use std::net::{Ipv4Addr, SocketAddr};
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tether_cli::client::RelayClient;
use tether_cli::kubeconfig::{self, KubeconfigSpec};
use tether_testkit::netns::{self, Netns};
use tokio::io::{AsyncBufReadExt, AsyncRead, BufReader};

const PROXY_USER: &str = "tether";
const PROXY_PASSWORD: &str = "proxy-pass-5b1e";
const WRONG_PASSWORD: &str = "wrong-pass-93c4";
const WAIT: Duration = Duration::from_secs(60);

fn tinyproxy() -> Result<PathBuf, String> {
    ["/usr/bin/tinyproxy", "/usr/sbin/tinyproxy"]
        .into_iter()
        .map(PathBuf::from)
        .find(|p| p.is_file())
        .ok_or_else(|| "tinyproxy is not installed (apt-get install tinyproxy)".to_string())
}

/// Every line a child process writes to one of its pipes, collected as it comes.
#[derive(Clone, Default)]
struct Lines(Arc<Mutex<Vec<String>>>);

impl Lines {
    fn follow(reader: impl AsyncRead + Unpin + Send + 'static) -> Lines {
        let lines = Lines::default();
        let sink = lines.clone();
        tokio::spawn(async move {
            let mut reader = BufReader::new(reader).lines();
            while let Ok(Some(line)) = reader.next_line().await {
                if let Ok(mut all) = sink.0.lock() {
                    all.push(line);
                }
            }
        });
        lines
    }

    fn text(&self) -> String {
        self.0.lock().map(|l| l.join("\n")).unwrap_or_default()
    }

    fn find(&self, pred: &impl Fn(&str) -> bool) -> Option<String> {
        self.0
            .lock()
            .ok()
            .and_then(|all| all.iter().find(|l| pred(l)).cloned())
    }

    /// Waits for a line matching `pred`; returns it.
    async fn wait_for(
        &self,
        limit: Duration,
        pred: impl Fn(&str) -> bool,
    ) -> anyhow::Result<String> {
        let found = tether_testkit::wait::eventually("a matching line", limit, || {
            let line = self.find(&pred);
            async move { line }
        })
        .await;
        found.map_err(|e| anyhow::anyhow!("{e}; got:\n{}", self.text()))
    }
}

/// tinyproxy in the foreground (`-d`) on `ip` with Basic auth, allowed to CONNECT only to `connect_port`.
struct Tinyproxy {
    addr: SocketAddr,
    log: Lines,
    _child: tokio::process::Child,
}

impl Tinyproxy {
    async fn start(
        binary: &Path,
        dir: &Path,
        ip: Ipv4Addr,
        connect_port: u16,
    ) -> anyhow::Result<Tinyproxy> {
        let port = std::net::TcpListener::bind((ip, 0))?.local_addr()?.port();
        let addr = SocketAddr::from((ip, port));
        let config = dir.join("tinyproxy.conf");
        std::fs::write(
            &config,
            format!(
                "Port {port}\nListen {ip}\nTimeout 600\nMaxClients 100\nLogLevel Connect\n\
                 BasicAuth {PROXY_USER} {PROXY_PASSWORD}\nConnectPort {connect_port}\n"
            ),
        )?;
        let mut child = tokio::process::Command::new(binary)
            .arg("-d")
            .arg("-c")
            .arg(&config)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .kill_on_drop(true)
            .spawn()?;
        let out = child
            .stdout
            .take()
            .ok_or_else(|| anyhow::anyhow!("stdout"))?;
        let err = child
            .stderr
            .take()
            .ok_or_else(|| anyhow::anyhow!("stderr"))?;
        let log = Lines::follow(out);
        let errors = Lines::follow(err);
        let deadline = Instant::now() + Duration::from_secs(30);
        while tokio::net::TcpStream::connect(addr).await.is_err() {
            if let Some(status) = child.try_wait()? {
                anyhow::bail!(
                    "tinyproxy exited ({status}): {}\n{}",
                    log.text(),
                    errors.text()
                );
            }
            anyhow::ensure!(
                Instant::now() < deadline,
                "tinyproxy did not listen on {addr}"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        Ok(Tinyproxy {
            addr,
            log,
            _child: child,
        })
    }

    fn url(&self, password: &str) -> String {
        format!("http://{PROXY_USER}:{password}@{}", self.addr)
    }
}

/// A `tether-agent` process inside the namespace, its stderr (the log) collected.
struct AgentProcess {
    child: tokio::process::Child,
    log: Lines,
}

impl AgentProcess {
    /// Waits for a log line matching `pred`; fails at once if the agent exits first.
    async fn wait_for(
        &mut self,
        limit: Duration,
        pred: impl Fn(&str) -> bool,
    ) -> anyhow::Result<String> {
        let deadline = Instant::now() + limit;
        loop {
            if let Some(line) = self.log.find(&pred) {
                return Ok(line);
            }
            if let Some(status) = self.child.try_wait()? {
                // The reader may still hold the last lines.
                if let Ok(line) = self.log.wait_for(Duration::from_secs(2), &pred).await {
                    return Ok(line);
                }
                anyhow::bail!("the agent exited ({status}); its log:\n{}", self.log.text());
            }
            anyhow::ensure!(
                Instant::now() < deadline,
                "no such line within {limit:?}; the agent's log:\n{}",
                self.log.text()
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// Waits until the relay shows `cluster` Connected; fails at once if the agent exits first.
    async fn wait_connected(&mut self, client: &RelayClient, cluster: &str) -> anyhow::Result<()> {
        let deadline = Instant::now() + WAIT;
        loop {
            if client
                .show_cluster(cluster)
                .await
                .is_ok_and(|c| c.connectivity_status == "Connected" && c.connected)
            {
                return Ok(());
            }
            if let Some(status) = self.child.try_wait()? {
                anyhow::bail!("the agent exited ({status}); its log:\n{}", self.log.text());
            }
            anyhow::ensure!(
                Instant::now() < deadline,
                "{cluster} never connected through the proxy; the agent's log:\n{}",
                self.log.text()
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    async fn stop(mut self) -> String {
        self.child.kill().await.ok();
        self.log.text()
    }
}

struct AgentSetup<'a> {
    netns: &'a Netns,
    binary: &'a Path,
    relay_url: &'a str,
    relay_ca: &'a Path,
    kubeconfig: &'a Path,
    dir: &'a Path,
}

impl AgentSetup<'_> {
    /// Starts an agent for `cluster` with `token`; `extra` args and `env` set how it finds the proxy.
    fn start(
        &self,
        cluster: &str,
        token: &str,
        extra: &[&str],
        env: &[(&str, &str)],
    ) -> anyhow::Result<AgentProcess> {
        let mut command = self.netns.command(self.binary);
        command
            .args(["--relay", self.relay_url, "--cluster", cluster])
            .arg("--relay-ca")
            .arg(self.relay_ca)
            .arg("--state-dir")
            .arg(self.dir.join(format!("{cluster}-state")))
            .arg("--kubeconfig")
            .arg(self.kubeconfig)
            .args(extra)
            .env("TETHER_ONBOARDING_TOKEN", token)
            .env("NO_COLOR", "1")
            .env("RUST_LOG", "info")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped());
        for var in [
            "HTTPS_PROXY",
            "https_proxy",
            "HTTP_PROXY",
            "http_proxy",
            "NO_PROXY",
            "no_proxy",
            "TETHER_PROXY_HTTPS",
            "TETHER_PROXY_SKIP_RANGE",
            "TETHER_PROXY_CERT",
        ] {
            command.env_remove(var);
        }
        for (k, v) in env {
            command.env(k, v);
        }
        let mut child = command.spawn()?;
        let err = child
            .stderr
            .take()
            .ok_or_else(|| anyhow::anyhow!("stderr"))?;
        Ok(AgentProcess {
            child,
            log: Lines::follow(err),
        })
    }
}

/// The relay on the root namespace's loopback, tinyproxy on the host end of the veth pair, the sample
/// apiserver inside the namespace.
struct Fixture {
    netns: Netns,
    dir: tempfile::TempDir,
    agent_bin: PathBuf,
    relay_addr: SocketAddr,
    relay_url: String,
    ca_pem: String,
    relay_ca: PathBuf,
    kubeconfig: PathBuf,
    client: RelayClient,
    proxy: Tinyproxy,
    sample_token: String,
    stop_relay: tokio::sync::oneshot::Sender<()>,
    relay_task: tokio::task::JoinHandle<Result<(), tether_relay::RelayError>>,
    _sample: tokio::process::Child,
}

impl Fixture {
    /// `None` (after printing why) where the test cannot run; outside CI only.
    async fn start(
        tag: &str,
        host_ip: Ipv4Addr,
        cluster_ip: Ipv4Addr,
    ) -> anyhow::Result<Option<Fixture>> {
        let tinyproxy = match netns::available().and_then(|()| tinyproxy()) {
            Ok(path) => path,
            Err(reason) => {
                return Ok(tether_testkit::tools::skip_or_fail(&format!(
                    "cannot run the proxy tests: {reason}"
                )));
            }
        };
        tether_runtime::tls::install_crypto_provider();
        let agent_bin = common::sibling_binary("tether-agent")?;
        let sample_bin = common::sibling_binary("tether-sample-apiserver")?;
        let netns = Netns::refusing_inbound(tag, host_ip, cluster_ip)?;
        let dir = tempfile::tempdir()?;

        let relay =
            tether_relay::Relay::new(tether_relay::Config::new(dir.path().join("relay"))).await?;
        let ca_pem = relay.ca_pem().map(str::to_string).unwrap_or_default();
        let relay_ca = dir.path().join("relay-ca.pem");
        std::fs::write(&relay_ca, &ca_pem)?;
        let admin = relay.admin_token().clone();
        let listener =
            tokio::net::TcpListener::bind(SocketAddr::from((Ipv4Addr::LOCALHOST, 0))).await?;
        let relay_addr = listener.local_addr()?;
        let relay_url = format!("https://{relay_addr}");
        let (stop_relay, stopped) = tokio::sync::oneshot::channel::<()>();
        let relay_task = tokio::spawn(relay.serve(listener, async move {
            let _ = stopped.await;
        }));
        let client = RelayClient::with_token(&relay_url, Some(ca_pem.as_bytes()), admin)?;

        let proxy = Tinyproxy::start(&tinyproxy, dir.path(), host_ip, relay_addr.port()).await?;

        let sample_dir = dir.path().join("sample");
        std::fs::create_dir_all(&sample_dir)?;
        let sample = netns
            .command(&sample_bin)
            .arg("--dir")
            .arg(&sample_dir)
            .args(["--listen", "127.0.0.1:6443"])
            .stdout(Stdio::null())
            .spawn()?;
        anyhow::ensure!(
            common::eventually(Duration::from_secs(30), || async {
                sample_dir.join("kubeconfig").is_file()
            })
            .await,
            "sample apiserver did not start"
        );
        let sample_token = std::fs::read_to_string(sample_dir.join("token"))?
            .trim()
            .to_string();

        // From the namespace, the relay is out of reach: not on its loopback, not on the veth address; the
        // proxy is reachable.
        for addr in [relay_addr, SocketAddr::from((host_ip, relay_addr.port()))] {
            anyhow::ensure!(
                !netns.can_connect(addr).await?,
                "the namespace reached {addr} directly"
            );
        }
        anyhow::ensure!(
            netns.can_connect(proxy.addr).await?,
            "the namespace cannot reach the proxy"
        );
        Ok(Some(Fixture {
            netns,
            dir,
            agent_bin,
            relay_addr,
            relay_url,
            ca_pem,
            relay_ca,
            kubeconfig: sample_dir.join("kubeconfig"),
            client,
            proxy,
            sample_token,
            stop_relay,
            relay_task,
            _sample: sample,
        }))
    }

    fn agents(&self) -> AgentSetup<'_> {
        AgentSetup {
            netns: &self.netns,
            binary: &self.agent_bin,
            relay_url: &self.relay_url,
            relay_ca: &self.relay_ca,
            kubeconfig: &self.kubeconfig,
            dir: self.dir.path(),
        }
    }

    async fn register(&self, cluster: &str) -> anyhow::Result<String> {
        let created = self
            .client
            .create_cluster(cluster, &Default::default())
            .await?;
        Ok(created.onboarding_token.expose().to_string())
    }

    /// The proxy saw a CONNECT to the relay.
    async fn proxy_connected_to_the_relay(&self) -> anyhow::Result<()> {
        let target = format!("CONNECT 127.0.0.1:{}", self.relay_addr.port());
        self.proxy
            .log
            .wait_for(WAIT, |l| l.contains(&target))
            .await?;
        Ok(())
    }

    /// kubectl in the root namespace reaches `cluster` through the relay.
    async fn kubectl_works(&self, cluster: &str) -> anyhow::Result<()> {
        let path = self.dir.path().join(format!("{cluster}.kubeconfig"));
        let text = kubeconfig::render(&KubeconfigSpec {
            relay_url: &self.relay_url,
            cluster,
            ca_pem: Some(self.ca_pem.as_bytes()),
            token: Some(&self.sample_token),
        })?;
        kubeconfig::write_private(&path, &text)?;
        let out = tether_testkit::kubectl::Kubectl::new(&path)?
            .run(&["get", "namespaces", "-o", "name"])
            .await?;
        anyhow::ensure!(
            out.status.success(),
            "kubectl through the relay failed: {}",
            out.stderr
        );
        anyhow::ensure!(out.stdout.contains("namespace/default"), "{}", out.stdout);
        Ok(())
    }

    async fn shutdown(self) -> anyhow::Result<()> {
        let _ = self.stop_relay.send(());
        self.relay_task.await??;
        drop(self.proxy);
        drop(self.netns);
        Ok(())
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_agent_reaches_the_relay_only_through_an_authenticating_proxy() -> anyhow::Result<()> {
    let Some(fx) = Fixture::start(
        "ttp",
        Ipv4Addr::new(10, 232, 0, 1),
        Ipv4Addr::new(10, 232, 0, 2),
    )
    .await?
    else {
        return Ok(());
    };
    let agents = fx.agents();
    let right_proxy = fx.proxy.url(PROXY_PASSWORD);

    // The relay on the skip list: the agent dials it directly, and that fails.
    let token = fx.register("bypass").await?;
    let mut agent = agents.start(
        "bypass",
        &token,
        &[
            "--proxy-https",
            &right_proxy,
            "--proxy-skip-range",
            "localhost,127.0.0.0/8",
        ],
        &[],
    )?;
    let direct = format!("cannot reach 127.0.0.1:{}", fx.relay_addr.port());
    let line = agent.wait_for(WAIT, |l| l.contains(&direct)).await?;
    assert!(!line.contains("proxy"), "{line}");
    agent.stop().await;

    // A wrong proxy password: a clear error, and the password is never logged.
    let token = fx.register("wrong-pass").await?;
    let mut agent = agents.start(
        "wrong-pass",
        &token,
        &["--proxy-https", &fx.proxy.url(WRONG_PASSWORD)],
        &[],
    )?;
    // tinyproxy answers a bad password with 401 (others say 407); either way the agent says what to fix.
    let line = agent
        .wait_for(WAIT, |l| l.contains("proxy refused CONNECT"))
        .await?;
    assert!(
        line.contains("check the proxy user name and password"),
        "{line}"
    );
    let log = agent.stop().await;
    assert!(
        !log.contains(WRONG_PASSWORD),
        "the agent logged the proxy password:\n{log}"
    );
    let shown = fx.client.show_cluster("wrong-pass").await?;
    assert!(!shown.onboarded, "{shown:?}");

    // The right password: onboarding and the tunnel go through the proxy, and kubectl works.
    let token = fx.register("proxied").await?;
    let mut agent = agents.start("proxied", &token, &["--proxy-https", &right_proxy], &[])?;
    agent.wait_connected(&fx.client, "proxied").await?;
    fx.proxy_connected_to_the_relay().await?;
    fx.kubectl_works("proxied").await?;
    let log = agent.stop().await;
    assert!(
        !log.contains(PROXY_PASSWORD),
        "the agent logged the proxy password:\n{log}"
    );
    fx.shutdown().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn https_proxy_from_the_environment_with_no_proxy() -> anyhow::Result<()> {
    let Some(fx) = Fixture::start(
        "tte",
        Ipv4Addr::new(10, 232, 0, 5),
        Ipv4Addr::new(10, 232, 0, 6),
    )
    .await?
    else {
        return Ok(());
    };
    let agents = fx.agents();
    let right_proxy = fx.proxy.url(PROXY_PASSWORD);

    // HTTPS_PROXY names the proxy; NO_PROXY keeps the cluster's own apiserver (on the namespace's loopback)
    // off it, as an in-cluster deployment lists the service network.
    let token = fx.register("from-env").await?;
    let mut agent = agents.start(
        "from-env",
        &token,
        &[],
        &[
            ("HTTPS_PROXY", &right_proxy),
            ("NO_PROXY", "kubernetes.default.svc,.svc,10.96.0.0/12"),
        ],
    )?;
    agent.wait_connected(&fx.client, "from-env").await?;
    fx.proxy_connected_to_the_relay().await?;
    fx.kubectl_works("from-env").await?;
    let log = agent.stop().await;
    assert!(
        !log.contains(PROXY_PASSWORD),
        "the agent logged the proxy password:\n{log}"
    );

    // NO_PROXY naming the relay: the agent dials it directly, and that fails.
    let token = fx.register("env-bypass").await?;
    let mut agent = agents.start(
        "env-bypass",
        &token,
        &[],
        &[("HTTPS_PROXY", &right_proxy), ("NO_PROXY", "127.0.0.1")],
    )?;
    let direct = format!("cannot reach 127.0.0.1:{}", fx.relay_addr.port());
    agent.wait_for(WAIT, |l| l.contains(&direct)).await?;
    let log = agent.stop().await;
    assert!(
        !log.contains(PROXY_PASSWORD),
        "the agent logged the proxy password:\n{log}"
    );
    fx.shutdown().await
}
