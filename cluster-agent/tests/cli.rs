//! The `tether-agent` binary: configuration errors exit 64 with a clear message, before anything else happens.

use std::process::Command;

use anyhow::Result;

fn agent() -> Command {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_tether-agent"));
    for var in [
        "TETHER_RELAY",
        "TETHER_CLUSTER",
        "TETHER_ONBOARDING_TOKEN",
        "TETHER_ONBOARDING_TOKEN_FILE",
        "TETHER_PROXY_HTTPS",
        "TETHER_PROXY_CERT",
        "TETHER_PROXY_SKIP_RANGE",
        "HTTPS_PROXY",
        "https_proxy",
        "NO_PROXY",
        "no_proxy",
        "TETHER_ENTRA_TENANTS",
        "TETHER_ENTRA_AUDIENCES",
        "TETHER_ENTRA_AUTHORITY",
        "TETHER_ENTRA_AUTHORITY_CA",
        "TETHER_GUARD_URL",
        "TETHER_GUARD_PUSH_TOKEN_FILE",
        "TETHER_GUARD_CA",
    ] {
        cmd.env_remove(var);
    }
    cmd
}

#[test]
fn bad_configuration_exits_64_with_a_clear_message() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let state = dir.path().join("state");
    let state = state.to_str().unwrap_or_default();

    let out = agent()
        .args([
            "--relay",
            "http://relay.example",
            "--cluster",
            "prod",
            "--state-dir",
            state,
        ])
        .output()?;
    assert_eq!(out.status.code(), Some(64));
    assert!(String::from_utf8_lossy(&out.stderr).contains("the scheme must be https"));

    let out = agent()
        .args([
            "--relay",
            "https://relay.example",
            "--cluster",
            "Prod_1",
            "--state-dir",
            state,
        ])
        .output()?;
    assert_eq!(out.status.code(), Some(64));
    assert!(String::from_utf8_lossy(&out.stderr).contains("invalid cluster name"));

    // First start without a token: nothing to authenticate with.
    let out = agent()
        .args([
            "--relay",
            "https://relay.example",
            "--cluster",
            "prod",
            "--state-dir",
            state,
        ])
        .output()?;
    assert_eq!(out.status.code(), Some(64));
    assert!(String::from_utf8_lossy(&out.stderr).contains("no onboarding token"));

    // Missing required flags are usage errors too.
    let out = agent().output()?;
    assert_eq!(out.status.code(), Some(64));
    Ok(())
}

#[test]
fn the_token_is_never_echoed() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let state = dir.path().join("state");
    // Valid except for the kubeconfig: the run stops at validation, after the token was parsed.
    let out = agent()
        .args([
            "--relay",
            "https://relay.example",
            "--cluster",
            "prod",
            "--kubeconfig",
            "/nonexistent/kubeconfig",
        ])
        .arg("--state-dir")
        .arg(&state)
        .env("TETHER_ONBOARDING_TOKEN", "super-secret-onboarding-token")
        .output()?;
    assert_eq!(out.status.code(), Some(64));
    let all = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(all.contains("kubeconfig"), "{all}");
    assert!(!all.contains("super-secret-onboarding-token"), "{all}");
    Ok(())
}

#[test]
fn bad_entra_and_guard_settings_exit_64() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let state = dir.path().join("state");
    let token_file = dir.path().join("push-token");
    std::fs::write(&token_file, "very-secret-push-token\n")?;
    let run = |extra: &[&str], env: &[(&str, &str)]| -> Result<String> {
        let mut cmd = agent();
        cmd.args([
            "--relay",
            "https://relay.example",
            "--cluster",
            "prod",
            "--onboarding-token",
            "onb",
        ])
        .arg("--state-dir")
        .arg(&state)
        .args(extra);
        for (k, v) in env {
            cmd.env(k, v);
        }
        let out = cmd.output()?;
        assert_eq!(out.status.code(), Some(64), "{extra:?} {env:?}");
        Ok(format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        ))
    };
    let all = run(
        &["--entra-tenant", "72f988bf-86f1-41af-91ab-2d7cd011db47"],
        &[],
    )?;
    assert!(all.contains("invalid Entra settings"), "{all}");
    assert!(all.contains("audience"), "{all}");
    let all = run(
        &[],
        &[
            ("TETHER_ENTRA_TENANTS", "t1,t2"),
            ("TETHER_ENTRA_AUDIENCES", "api://tether"),
            ("TETHER_ENTRA_AUTHORITY", "http://idp.example"),
        ],
    )?;
    assert!(all.contains("https://"), "{all}");

    let all = run(&["--guard-url", "https://guard.example/snapshot"], &[])?;
    assert!(all.contains("--guard-push-token-file"), "{all}");
    let token = token_file.to_str().unwrap_or_default();
    let all = run(
        &[
            "--guard-url",
            "http://guard.example/snapshot",
            "--guard-push-token-file",
            token,
        ],
        &[],
    )?;
    assert!(all.contains("invalid guard settings"), "{all}");
    assert!(!all.contains("very-secret-push-token"), "{all}");
    let all = run(
        &[],
        &[
            ("TETHER_GUARD_URL", "https://guard.example/snapshot"),
            ("TETHER_GUARD_PUSH_TOKEN_FILE", "/nonexistent/push-token"),
        ],
    )?;
    assert!(
        all.contains("--guard-push-token-file: cannot read"),
        "{all}"
    );
    // The push certificate needs its key.
    let all = run(
        &[
            "--guard-url",
            "https://guard.example/snapshot",
            "--guard-push-token-file",
            token,
            "--guard-client-cert",
            token,
        ],
        &[],
    )?;
    assert!(all.contains("--guard-client-key"), "{all}");
    Ok(())
}

#[test]
fn bad_proxy_settings_exit_64_without_the_password() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let state = dir.path().join("state");
    let base = |cmd: &mut Command| {
        cmd.args(["--relay", "https://relay.example", "--cluster", "prod"])
            .arg("--state-dir")
            .arg(&state)
            .env("TETHER_ONBOARDING_TOKEN", "t");
    };

    let mut cmd = agent();
    base(&mut cmd);
    let out = cmd
        .args(["--proxy-https", "https://user:hunter2@proxy.corp:3128"])
        .output()?;
    assert_eq!(out.status.code(), Some(64));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("invalid proxy URL"), "{stderr}");
    assert!(
        stderr.contains("TLS to the proxy is not supported"),
        "{stderr}"
    );
    assert!(!stderr.contains("hunter2"), "{stderr}");

    // The environment is read when the flag is absent, and NO_PROXY is checked too.
    let mut cmd = agent();
    base(&mut cmd);
    let out = cmd
        .env("HTTPS_PROXY", "http://proxy.corp:3128")
        .env("NO_PROXY", "10.0.0.0/99")
        .output()?;
    assert_eq!(out.status.code(), Some(64));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("invalid proxy bypass entry"), "{stderr}");

    let mut cmd = agent();
    base(&mut cmd);
    let out = cmd
        .env("https_proxy", "http://proxy.corp:3128")
        .args(["--proxy-cert", "/nonexistent/proxy-ca.pem"])
        .output()?;
    assert_eq!(out.status.code(), Some(64));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("proxy CA file"), "{stderr}");
    Ok(())
}

/// HTTPS_PROXY is for the relay: it must not break (or reach) the agent's own apiserver client, and its
/// password never shows in the logs.
#[test]
fn https_proxy_in_the_environment_is_used_for_the_relay_only() -> Result<()> {
    use std::io::BufRead as _;
    use std::time::{Duration, Instant};

    let dir = tempfile::tempdir()?;
    let kubeconfig = dir.path().join("kubeconfig");
    std::fs::write(
        &kubeconfig,
        "apiVersion: v1\nkind: Config\nclusters:\n- name: c\n  cluster:\n    server: https://127.0.0.1:1\ncontexts:\n- name: c\n  context:\n    cluster: c\n    user: u\nusers:\n- name: u\n  user: {}\ncurrent-context: c\n",
    )?;
    // Nothing listens on these ports: onboarding fails at the proxy and is retried.
    let closed = std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .port();
    let mut child = agent()
        .args(["--cluster", "prod", "--log-format", "json"])
        .arg("--relay")
        .arg(format!("https://relay.example:{closed}"))
        .arg("--state-dir")
        .arg(dir.path().join("state"))
        .arg("--kubeconfig")
        .arg(&kubeconfig)
        .env("TETHER_ONBOARDING_TOKEN", "t")
        .env(
            "HTTPS_PROXY",
            format!("http://u:hunter2@127.0.0.1:{closed}"),
        )
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()?;
    let stderr = child
        .stderr
        .take()
        .ok_or_else(|| anyhow::anyhow!("no stderr"))?;
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in std::io::BufReader::new(stderr)
            .lines()
            .map_while(Result::ok)
        {
            if tx.send(line).is_err() {
                break;
            }
        }
    });
    let deadline = Instant::now() + Duration::from_secs(30);
    let mut seen = Vec::new();
    let found = loop {
        let left = deadline.saturating_duration_since(Instant::now());
        match rx.recv_timeout(left) {
            Ok(line) => {
                let done = line.contains("onboarding failed");
                seen.push(line);
                if done {
                    break true;
                }
            }
            Err(_) => break false,
        }
    };
    let _ = child.kill();
    let _ = child.wait();
    let all = seen.join("\n");
    assert!(found, "{all}");
    assert!(
        all.contains("cannot reach the proxy http://u:***@127.0.0.1"),
        "{all}"
    );
    assert!(
        all.contains("ignoring the proxy for the apiserver"),
        "{all}"
    );
    assert!(!all.contains("hunter2"), "{all}");
    assert!(!all.contains("http-proxy"), "{all}");
    Ok(())
}

#[test]
fn doctor_takes_the_agent_flags_and_checks_them_the_same_way() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let state = dir.path().join("state");
    let state = state.to_str().unwrap_or_default();

    let out = agent()
        .args([
            "doctor",
            "--relay",
            "http://relay.example",
            "--cluster",
            "prod",
        ])
        .args(["--state-dir", state])
        .output()?;
    assert_eq!(out.status.code(), Some(64));
    assert!(String::from_utf8_lossy(&out.stderr).contains("the scheme must be https"));

    let out = agent().args(["doctor", "--help"]).output()?;
    assert_eq!(out.status.code(), Some(0));
    let help = String::from_utf8_lossy(&out.stdout);
    for flag in [
        "--relay",
        "--relay-ca",
        "--proxy-https",
        "--max-clock-skew",
        "--output",
    ] {
        assert!(help.contains(flag), "{flag}: {help}");
    }

    // The agent's whole command line works, --log-format included (the Helm chart passes it).
    let out = agent()
        .args([
            "doctor",
            "--log-format=json",
            "--relay",
            "http://relay.example",
        ])
        .args(["--cluster", "prod", "--state-dir", state])
        .output()?;
    assert_eq!(out.status.code(), Some(64));
    assert!(String::from_utf8_lossy(&out.stderr).contains("the scheme must be https"));

    let out = agent()
        .args(["doctor", "-o", "yaml", "--relay", "https://relay.example"])
        .args(["--cluster", "prod", "--state-dir", state])
        .output()?;
    assert_eq!(out.status.code(), Some(64));
    Ok(())
}

#[test]
fn doctor_never_uses_or_shows_the_onboarding_token() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let state = dir.path().join("state");
    // A closed port: the relay checks fail, the identity check says the agent will onboard.
    let closed = std::net::TcpListener::bind("127.0.0.1:0")?.local_addr()?;
    let out = agent()
        .args([
            "doctor",
            "--relay",
            &format!("https://{closed}"),
            "--cluster",
            "prod",
        ])
        .args(["--connect-timeout", "2s"])
        .arg("--state-dir")
        .arg(&state)
        .env("TETHER_ONBOARDING_TOKEN", "super-secret-onboarding-token")
        .env("KUBECONFIG", dir.path().join("no-kubeconfig"))
        .env_remove("KUBERNETES_SERVICE_HOST")
        .output()?;
    assert_eq!(out.status.code(), Some(1));
    let all = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(!all.contains("super-secret-onboarding-token"), "{all}");
    let identity = all
        .lines()
        .find(|l| l.split_whitespace().nth(1) == Some("identity"))
        .unwrap_or_default();
    assert!(
        identity.starts_with("skip") && identity.contains("will onboard"),
        "{all}"
    );
    assert!(all.lines().any(|l| l.starts_with("FAIL  tcp")), "{all}");
    // Nothing was stored: the doctor does not onboard.
    assert!(!state.join("identity.json").exists());
    Ok(())
}
