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
