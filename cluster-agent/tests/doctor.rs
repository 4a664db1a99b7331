//! `tether-agent doctor` with real processes: the relay (in this process, QUIC on UDP at its HTTPS port
//! number), the `tether-agent` binary (to onboard, then as `tether-agent doctor`) and an HTTPS apiserver.
//!
//! A healthy setup passes every check (exit 0); each failure the doctor detects shows on its own line with
//! the exit code 1: wrong relay CA, UDP blocked (a network namespace whose firewall drops UDP to the relay),
//! relay unreachable, expired identity, apiserver unreachable. Nothing secret is ever printed.

mod common;

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;

use anyhow::{Context as _, Result, bail, ensure};
use common::TestApiserver;
use common::proxy::ConnectProxy;
use common::real_relay::RelayProcess;
use serde_json::Value;
use tether_testkit::netns;

const DEADLINE: Duration = Duration::from_secs(30);

/// The relay, its stand-in QUIC listener, an apiserver, and an onboarded identity in `state`.
struct Setup {
    dir: tempfile::TempDir,
    relay: Option<RelayProcess>,
    relay_url: String,
    api: TestApiserver,
    kubeconfig: PathBuf,
    relay_ca: PathBuf,
    token: String,
}

impl Setup {
    /// Everything on `ip` (127.0.0.1, or the root end of a veth pair).
    async fn start(ip: IpAddr, adjust: impl FnOnce(&mut tether_relay::Config)) -> Result<Self> {
        tether_runtime::tls::install_crypto_provider();
        let dir = tempfile::tempdir()?;
        let api = TestApiserver::start_on(SocketAddr::new(ip, 0)).await?;
        let kubeconfig = common::write_kubeconfig(dir.path(), &api.url(), &api.ca.pem(), None)?;
        let data = dir.path().join("relay");
        let relay = RelayProcess::start_with(&data, SocketAddr::new(ip, 0), |c| {
            c.hostnames = vec!["127.0.0.1".to_owned(), ip.to_string()];
            adjust(c);
        })
        .await?;
        let relay_ca = dir.path().join("relay-ca.pem");
        std::fs::write(&relay_ca, &relay.ca_pem)?;
        let token = relay.register("prod").await?;
        let setup = Self {
            dir,
            relay_url: relay.url(),
            relay: Some(relay),
            api,
            kubeconfig,
            relay_ca,
            token,
        };
        setup.onboard().await?;
        Ok(setup)
    }

    fn state_dir(&self) -> PathBuf {
        self.dir.path().join("agent-state")
    }

    /// Runs the real agent until it has stored its identity, then stops it.
    async fn onboard(&self) -> Result<()> {
        let mut agent = tokio::process::Command::new(env!("CARGO_BIN_EXE_tether-agent"))
            .args(self.agent_args(&self.relay_ca))
            .env("TETHER_ONBOARDING_TOKEN", &self.token)
            .env_remove("HTTPS_PROXY")
            .env_remove("https_proxy")
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .kill_on_drop(true)
            .spawn()
            .context("starting tether-agent")?;
        let identity = self.state_dir().join("identity.json");
        let give_up = tokio::time::Instant::now() + DEADLINE;
        while !identity.exists() {
            if let Some(status) = agent.try_wait()? {
                bail!("the agent exited before onboarding: {status}");
            }
            ensure!(
                tokio::time::Instant::now() < give_up,
                "the agent did not onboard in time"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        agent.kill().await?;
        Ok(())
    }

    fn agent_args(&self, relay_ca: &Path) -> Vec<String> {
        vec![
            "--relay".into(),
            self.relay_url.clone(),
            "--cluster".into(),
            "prod".into(),
            "--relay-ca".into(),
            relay_ca.display().to_string(),
            "--state-dir".into(),
            self.state_dir().display().to_string(),
            "--kubeconfig".into(),
            self.kubeconfig.display().to_string(),
            "--connect-timeout".into(),
            "3s".into(),
        ]
    }

    /// `tether-agent doctor` with the agent's flags plus `extra`.
    fn doctor(&self, extra: &[&str]) -> Doctor {
        self.doctor_with(&self.relay_ca, extra)
    }

    fn doctor_with(&self, relay_ca: &Path, extra: &[&str]) -> Doctor {
        let mut args = vec!["doctor".to_owned()];
        args.extend(self.agent_args(relay_ca));
        args.extend(extra.iter().map(|s| (*s).to_owned()));
        Doctor {
            program: env!("CARGO_BIN_EXE_tether-agent").to_owned(),
            args,
        }
    }
}

/// A doctor command line, run twice: for the text report and for the JSON one.
struct Doctor {
    program: String,
    args: Vec<String>,
}

struct Outcome {
    code: Option<i32>,
    text: String,
    json: Value,
}

impl Doctor {
    /// The same doctor run inside the network namespace `ns`.
    fn in_netns(self, ns: &str) -> Self {
        let mut args = vec![
            "netns".to_owned(),
            "exec".to_owned(),
            ns.to_owned(),
            self.program,
        ];
        args.extend(self.args);
        Self {
            program: "ip".to_owned(),
            args,
        }
    }

    fn command(&self, extra: &[&str]) -> tokio::process::Command {
        let mut command = tokio::process::Command::new(&self.program);
        command.args(&self.args).args(extra);
        for var in [
            "HTTPS_PROXY",
            "https_proxy",
            "NO_PROXY",
            "no_proxy",
            "TETHER_PROXY_HTTPS",
            "TETHER_ONBOARDING_TOKEN",
            "TETHER_STATE_SECRET",
        ] {
            command.env_remove(var);
        }
        command.stdin(Stdio::null()).kill_on_drop(true);
        command
    }

    async fn run(self) -> Result<Outcome> {
        let text_run = tokio::time::timeout(DEADLINE, self.command(&[]).output())
            .await
            .context("doctor took too long")??;
        let json_run = tokio::time::timeout(DEADLINE, self.command(&["-o", "json"]).output())
            .await
            .context("doctor -o json took too long")??;
        let text = String::from_utf8(text_run.stdout)?;
        let json: Value = serde_json::from_slice(&json_run.stdout).with_context(|| {
            format!(
                "doctor -o json printed no JSON: {}{}",
                String::from_utf8_lossy(&json_run.stdout),
                String::from_utf8_lossy(&json_run.stderr)
            )
        })?;
        ensure!(
            text_run.status.code() == json_run.status.code(),
            "text and JSON runs disagree: {text}\n{json}"
        );
        Ok(Outcome {
            code: text_run.status.code(),
            text,
            json,
        })
    }
}

impl Outcome {
    /// The text line of `check`.
    fn line(&self, check: &str) -> &str {
        self.text
            .lines()
            .find(|l| l.split_whitespace().nth(1) == Some(check))
            .unwrap_or("")
    }

    fn status(&self, check: &str) -> &str {
        self.json["checks"]
            .as_array()
            .and_then(|checks| checks.iter().find(|c| c["name"] == check))
            .and_then(|c| c["status"].as_str())
            .unwrap_or("missing")
    }

    /// Asserts each check's status, and that each line starts with its label.
    fn expect(&self, expected: &[(&str, &str)]) {
        eprintln!("{}", self.text);
        let names: Vec<&str> = self.json["checks"]
            .as_array()
            .map(|c| c.iter().filter_map(|c| c["name"].as_str()).collect())
            .unwrap_or_default();
        assert_eq!(
            names,
            [
                "dns",
                "tcp",
                "proxy",
                "tls",
                "quic",
                "clock",
                "identity",
                "apiserver"
            ],
            "{}",
            self.text
        );
        assert_eq!(self.text.lines().count(), 8, "{}", self.text);
        for (check, status) in expected {
            assert_eq!(self.status(check), *status, "{check}:\n{}", self.text);
            let label = if *status == "fail" { "FAIL" } else { status };
            assert!(
                self.line(check).starts_with(label),
                "{check}: {}\n{}",
                self.line(check),
                self.text
            );
        }
        let failed = expected.iter().any(|(_, s)| *s == "fail");
        assert_eq!(self.json["ok"], !failed, "{}", self.text);
        assert_eq!(self.code, Some(i32::from(failed)), "{}", self.text);
        for (check, status) in expected {
            let has_fix = self.line(check).contains(" -- fix: ");
            assert_eq!(has_fix, *status == "fail", "{check}: {}", self.line(check));
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_healthy_setup_passes_every_check() -> Result<()> {
    let setup = Setup::start(Ipv4Addr::LOCALHOST.into(), |_| {}).await?;
    let out = setup.doctor(&[]).run().await?;
    out.expect(&[
        ("dns", "ok"),
        ("tcp", "ok"),
        ("proxy", "skip"),
        ("tls", "ok"),
        ("quic", "ok"),
        ("clock", "ok"),
        ("identity", "ok"),
        ("apiserver", "ok"),
    ]);
    assert!(
        out.line("identity").contains("accepted by the relay"),
        "{}",
        out.text
    );
    assert!(out.line("apiserver").contains("/version"), "{}", out.text);
    assert!(
        out.line("proxy").contains("no proxy configured"),
        "{}",
        out.text
    );
    // The key and the onboarding token are nowhere in the output.
    let key = std::fs::read_to_string(setup.state_dir().join("identity-key.pem"))?;
    let key_body: String = key.lines().nth(1).unwrap_or("missing").to_owned();
    for secret in [key_body.as_str(), "PRIVATE KEY", setup.token.as_str()] {
        assert!(!out.text.contains(secret), "{}", out.text);
        assert!(!out.json.to_string().contains(secret));
    }
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wrong_relay_ca_fails_tls_and_skips_what_needs_it() -> Result<()> {
    let setup = Setup::start(Ipv4Addr::LOCALHOST.into(), |_| {}).await?;
    let other_ca = setup.dir.path().join("other-ca.pem");
    std::fs::write(&other_ca, common::TestCa::new()?.pem())?;
    let out = setup.doctor_with(&other_ca, &[]).run().await?;
    out.expect(&[
        ("dns", "ok"),
        ("tcp", "ok"),
        ("tls", "fail"),
        ("quic", "skip"),
        ("clock", "skip"),
        ("identity", "skip"),
        ("apiserver", "ok"),
    ]);
    assert!(
        out.line("tls").contains("not signed by a CA in --relay-ca")
            && out.line("tls").contains("--relay-ca"),
        "{}",
        out.text
    );
    assert!(
        out.line("clock").contains("needs tls, which failed"),
        "{}",
        out.text
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unreachable_relay_fails_tcp() -> Result<()> {
    let mut setup = Setup::start(Ipv4Addr::LOCALHOST.into(), |_| {}).await?;
    // Nothing listens on the relay's port any more (TCP or UDP).
    if let Some(relay) = setup.relay.take() {
        relay.stop().await?;
    }
    let out = setup.doctor(&[]).run().await?;
    out.expect(&[
        ("dns", "ok"),
        ("tcp", "fail"),
        ("tls", "skip"),
        ("quic", "skip"),
        ("clock", "skip"),
        ("identity", "skip"),
        ("apiserver", "ok"),
    ]);
    assert!(out.line("tcp").contains("refused"), "{}", out.text);
    assert!(
        out.line("tls").contains("needs tcp, which failed"),
        "{}",
        out.text
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_expired_identity_fails_the_identity_check() -> Result<()> {
    // Short-lived identities: the agent is stopped right after onboarding, before any renewal can help.
    let setup = Setup::start(Ipv4Addr::LOCALHOST.into(), |c| {
        c.identity_validity = Duration::from_secs(3);
    })
    .await?;
    let stored: Value =
        serde_json::from_slice(&std::fs::read(setup.state_dir().join("identity.json"))?)?;
    let not_after = time::OffsetDateTime::parse(
        stored["notAfter"].as_str().context("no notAfter")?,
        &time::format_description::well_known::Rfc3339,
    )?;
    ensure!(
        not_after - time::OffsetDateTime::now_utc() < time::Duration::seconds(10),
        "the identity lives too long for this test"
    );
    // Until the certificate has expired by this clock (bounded: it lives 3 s).
    let give_up = tokio::time::Instant::now() + DEADLINE;
    while time::OffsetDateTime::now_utc() <= not_after {
        ensure!(tokio::time::Instant::now() < give_up, "it never expired");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let out = setup.doctor(&[]).run().await?;
    out.expect(&[
        ("dns", "ok"),
        ("tcp", "ok"),
        ("tls", "ok"),
        ("quic", "ok"),
        ("clock", "ok"),
        ("identity", "fail"),
        ("apiserver", "ok"),
    ]);
    assert!(out.line("identity").contains("expired at"), "{}", out.text);
    assert!(
        out.line("identity").contains("tether cluster connect prod"),
        "{}",
        out.text
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unreachable_apiserver_fails_the_apiserver_check() -> Result<()> {
    let setup = Setup::start(Ipv4Addr::LOCALHOST.into(), |_| {}).await?;
    // The agent's kubeconfig now names a port nothing listens on.
    let closed = std::net::TcpListener::bind("127.0.0.1:0")?.local_addr()?;
    let kubeconfig = common::write_kubeconfig(
        setup.dir.path(),
        &format!("https://{closed}"),
        &setup.api.ca.pem(),
        None,
    )?;
    assert_eq!(kubeconfig, setup.kubeconfig);
    let out = setup.doctor(&[]).run().await?;
    out.expect(&[
        ("dns", "ok"),
        ("tcp", "ok"),
        ("tls", "ok"),
        ("quic", "ok"),
        ("clock", "ok"),
        ("identity", "ok"),
        ("apiserver", "fail"),
    ]);
    assert!(
        out.line("apiserver").contains(&closed.to_string()),
        "{}",
        out.text
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn through_a_proxy_quic_is_skipped_and_the_password_never_shown() -> Result<()> {
    let setup = Setup::start(Ipv4Addr::LOCALHOST.into(), |_| {}).await?;
    let proxy = ConnectProxy::start(Some(("doc", "proxy-password-123"))).await?;
    let out = setup
        .doctor(&["--proxy-https", &proxy.url("doc:proxy-password-123@")])
        .run()
        .await?;
    out.expect(&[
        ("dns", "ok"),
        ("tcp", "ok"),
        ("proxy", "ok"),
        ("tls", "ok"),
        ("quic", "skip"),
        ("clock", "ok"),
        ("identity", "ok"),
        ("apiserver", "ok"),
    ]);
    assert!(!out.text.contains("proxy-password-123"), "{}", out.text);
    assert!(!out.json.to_string().contains("proxy-password-123"));
    assert!(out.line("quic").contains("WebSocket only"), "{}", out.text);
    assert!(
        proxy
            .requests()
            .iter()
            .any(|r| r.contains(&setup.relay_url.replace("https://", ""))),
        "the doctor's requests went through the proxy"
    );
    Ok(())
}

/// `GET /agent/v1/check` with `identity` (certificate and key PEM) as the client certificate.
async fn relay_check(
    relay: &RelayProcess,
    identity: Option<(&str, &str)>,
    method: http::Method,
    cluster: &str,
) -> Result<(http::StatusCode, Value)> {
    use http_body_util::BodyExt as _;
    let tls = tether_runtime::tls::client_config_with(&tether_runtime::tls::ClientOptions {
        ca_pem: Some(relay.ca_pem.as_bytes()),
        extra_ca_pem: None,
        identity: identity.map(|(cert, key)| tether_runtime::tls::ClientIdentity {
            cert_pem: cert.as_bytes(),
            key_pem: key.as_bytes(),
        }),
        alpn: &[],
    })?;
    let https = hyper_rustls::HttpsConnectorBuilder::new()
        .with_tls_config((*tls).clone())
        .https_only()
        .enable_http1()
        .build();
    let client: hyper_util::client::legacy::Client<_, http_body_util::Empty<bytes::Bytes>> =
        hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
            .build(https);
    let request = http::Request::builder()
        .method(method)
        .uri(format!("{}/agent/v1/check", relay.url()))
        .header("tether-cluster", cluster)
        .body(http_body_util::Empty::new())?;
    let response = tokio::time::timeout(DEADLINE, client.request(request)).await??;
    let status = response.status();
    let body = response.into_body().collect().await?.to_bytes();
    Ok((status, serde_json::from_slice(&body).unwrap_or(Value::Null)))
}

/// The relay's identity check refuses what the tunnel refuses: no certificate, another cluster's identity, a
/// deleted cluster's identity (and then the doctor says so).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_relay_check_refuses_what_the_tunnel_refuses() -> Result<()> {
    let setup = Setup::start(Ipv4Addr::LOCALHOST.into(), |_| {}).await?;
    let relay = setup.relay.as_ref().context("no relay")?;
    relay.register("other").await?;
    let stored: Value =
        serde_json::from_slice(&std::fs::read(setup.state_dir().join("identity.json"))?)?;
    let cert = stored["certificate"].as_str().context("no certificate")?;
    let key = std::fs::read_to_string(setup.state_dir().join("identity-key.pem"))?;
    let prod = Some((cert, key.as_str()));

    let (status, body) = relay_check(relay, prod, http::Method::GET, "prod").await?;
    assert_eq!(status, http::StatusCode::OK, "{body}");
    assert_eq!(body["cluster"], "prod");
    assert_eq!(
        body["fingerprint"].as_str().map(str::len),
        Some(64),
        "{body}"
    );
    assert!(
        body["relayTime"].is_string() && body["notAfter"].is_string(),
        "{body}"
    );

    let (status, body) = relay_check(relay, None, http::Method::GET, "prod").await?;
    assert_eq!(status, http::StatusCode::UNAUTHORIZED, "{body}");
    assert!(
        body["message"]
            .as_str()
            .unwrap_or("")
            .contains("no client certificate"),
        "{body}"
    );

    let (status, body) = relay_check(relay, prod, http::Method::GET, "other").await?;
    assert_eq!(status, http::StatusCode::UNAUTHORIZED, "{body}");
    assert!(
        body["message"]
            .as_str()
            .unwrap_or("")
            .contains("not an identity of cluster other"),
        "{body}"
    );

    let (status, _) = relay_check(relay, prod, http::Method::POST, "prod").await?;
    assert_eq!(status, http::StatusCode::METHOD_NOT_ALLOWED);

    // Deleting the cluster revokes its identity: the doctor reports the relay's refusal.
    let (status, _) = relay
        .call(
            http::Method::DELETE,
            "/api/v1/clusters/prod",
            &relay.admin_token,
            None,
        )
        .await?;
    assert!(status.is_success(), "{status}");
    let (status, _) = relay_check(relay, prod, http::Method::GET, "prod").await?;
    assert_eq!(status, http::StatusCode::UNAUTHORIZED);
    let out = setup.doctor(&[]).run().await?;
    out.expect(&[
        ("dns", "ok"),
        ("tcp", "ok"),
        ("tls", "ok"),
        ("quic", "ok"),
        ("clock", "ok"),
        ("identity", "fail"),
        ("apiserver", "ok"),
    ]);
    assert!(
        out.line("identity")
            .contains("the relay refused it (HTTP 401)"),
        "{}",
        out.text
    );
    Ok(())
}

/// UDP to the relay dropped by the firewall of a network namespace the doctor runs in: QUIC fails, the
/// rest passes. Without namespaces (not root, no iptables) and outside CI: a relay with --no-quic instead.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn blocked_udp_fails_the_quic_check() -> Result<()> {
    match netns::available() {
        Ok(()) => {}
        Err(why) if std::env::var_os("CI").is_some() => {
            bail!("network namespaces are needed here: {why}")
        }
        Err(why) => {
            eprintln!("no network namespace ({why}): the relay without its QUIC listener instead");
            let setup = Setup::start(Ipv4Addr::LOCALHOST.into(), |c| c.no_quic = true).await?;
            let out = setup.doctor(&[]).run().await?;
            expect_quic_blocked(&out);
            return Ok(());
        }
    }
    let (host_ip, ns_ip) = (Ipv4Addr::new(10, 213, 7, 1), Ipv4Addr::new(10, 213, 7, 2));
    let ns = netns::Netns::create("doc", host_ip, ns_ip)?;
    let setup = Setup::start(host_ip.into(), |_| {}).await?;
    let in_ns = |extra: &[&str]| setup.doctor(extra).in_netns(&ns.name);
    // From the namespace, before the rule: everything passes, QUIC included.
    let out = in_ns(&[]).run().await?;
    out.expect(&[
        ("dns", "ok"),
        ("tcp", "ok"),
        ("tls", "ok"),
        ("quic", "ok"),
        ("clock", "ok"),
        ("identity", "ok"),
        ("apiserver", "ok"),
    ]);
    ns.exec_ok(&[
        "iptables",
        "-A",
        "OUTPUT",
        "-p",
        "udp",
        "-d",
        &host_ip.to_string(),
        "-j",
        "DROP",
    ])?;
    let out = in_ns(&[]).run().await?;
    expect_quic_blocked(&out);
    Ok(())
}

fn expect_quic_blocked(out: &Outcome) {
    out.expect(&[
        ("dns", "ok"),
        ("tcp", "ok"),
        ("tls", "ok"),
        ("quic", "fail"),
        ("clock", "ok"),
        ("identity", "ok"),
        ("apiserver", "ok"),
    ]);
    assert!(out.line("quic").contains("no QUIC answer"), "{}", out.text);
    assert!(out.line("quic").contains("UDP"), "{}", out.text);
}
