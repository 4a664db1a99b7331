//! `tether cluster connect` prints the `helm upgrade --install` line for the agent chart. The line printed by the
//! real `tether` binary is run by the real shell with the real helm (`helm template` in place of
//! `helm upgrade --install`, the one change), so the test proves the line is valid: quoting, helm's `--set`
//! escaping, the files it refers to, and the chart's schema. The rendered objects must carry this cluster's
//! values. Secrets (the onboarding token, a proxy password) reach helm through 0600 files, never the line.
//!
//! Needs helm (scripts/install-test-deps.sh); without it the test fails under `CI` and skips otherwise.

mod common;
#[path = "../../deploy/tests/support.rs"]
mod support;

use std::path::Path;

use anyhow::{Context as _, Result, ensure};
use common::Env;
use serde_yaml::Value;

/// The `helm …` command in `tether cluster connect`'s output: from `helm upgrade --install` to the first line
/// that does not end in `\`.
fn helm_line(out: &str) -> Result<String> {
    let start = out
        .find("helm upgrade --install")
        .with_context(|| format!("no helm line in:\n{out}"))?;
    let mut line = String::new();
    for part in out[start..].lines() {
        line.push_str(part);
        line.push('\n');
        if !part.trim_end().ends_with('\\') {
            break;
        }
    }
    Ok(line)
}

fn args_of(objects: &[Value]) -> Result<Vec<String>> {
    let deployment = support::object(objects, "Deployment", "tether-agent")?;
    let containers = support::at(deployment, &["spec", "template", "spec", "containers"])
        .and_then(Value::as_sequence)
        .context("containers")?;
    let agent = containers
        .iter()
        .find(|c| support::str_at(c, &["name"]) == Some("agent"))
        .context("agent container")?;
    Ok(support::at(agent, &["args"])
        .and_then(Value::as_sequence)
        .context("args")?
        .iter()
        .filter_map(|a| a.as_str().map(str::to_owned))
        .collect())
}

#[cfg(unix)]
fn mode(path: &Path) -> Result<u32> {
    use std::os::unix::fs::PermissionsExt as _;
    Ok(std::fs::symlink_metadata(path)?.permissions().mode() & 0o777)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connect_prints_a_helm_line_that_the_real_helm_renders_with_the_clusters_values()
-> Result<()> {
    let Some(helm) = support::helm()? else {
        return Ok(());
    };
    let env = Env::start().await?;
    let files = env.dir.path().join("helm files");
    std::fs::create_dir(&files)?;
    let proxy_ca = env.dir.path().join("proxy-ca.pem");
    let proxy_ca_pem = rcgen::generate_simple_self_signed(vec!["proxy.invalid".to_owned()])?
        .cert
        .pem();
    std::fs::write(&proxy_ca, &proxy_ca_pem)?;
    let proxy_url = "http://alice:s3cr%27t@proxy.invalid:3128";
    let no_proxy = ".svc,.cluster.local,10.0.0.0/8";
    let tenant = "72f988bf-86f1-41af-91ab-2d7cd011db47";
    // A comma (helm's separator) and a quote (the shell's) in one value.
    let audience = "api://tether-agent,o'brien";
    let chart = support::chart_dir("tether-agent");
    let out = env
        .tether_ok(&[
            "cluster",
            "connect",
            "edge-1",
            "--files-dir",
            files.to_str().context("path")?,
            "--chart",
            chart.to_str().context("path")?,
            "--proxy-https",
            proxy_url,
            "--proxy-skip-range",
            no_proxy,
            "--proxy-cert",
            proxy_ca.to_str().context("path")?,
            "--entra-tenant",
            tenant,
            "--entra-audience",
            audience,
        ])
        .await?;
    let line = helm_line(&out)?;

    // The secrets are in 0600 files, not on the line.
    let token_file = files.join("edge-1-onboarding-token");
    let token = std::fs::read_to_string(&token_file)?;
    ensure!(!token.is_empty());
    ensure!(
        !line.contains(&token),
        "the token is on the helm line:\n{line}"
    );
    ensure!(
        !line.contains("s3cr"),
        "the proxy password is on the helm line:\n{line}"
    );
    let ca_file = files.join("edge-1-relay-ca.pem");
    let proxy_file = files.join("edge-1-https-proxy");
    #[cfg(unix)]
    for file in [&token_file, &ca_file, &proxy_file] {
        ensure!(
            mode(file)? == 0o600,
            "{}: mode {:o}",
            file.display(),
            mode(file)?
        );
    }
    let relay_ca = std::fs::read_to_string(env.relay_ca_file())?;
    ensure!(std::fs::read_to_string(&ca_file)? == relay_ca);

    // The line, run by the shell from another directory, with `helm template` in place of `helm upgrade --install`.
    let script = line.replacen(
        "helm upgrade --install",
        &format!("'{}' template", helm.display()),
        1,
    );
    let rendered = support::run(
        std::process::Command::new("sh")
            .args(["-c", &script])
            .current_dir(env.dir.path()),
    )
    .with_context(|| format!("the printed line:\n{line}"))?;
    let objects = support::documents(&rendered)?;

    let args = args_of(&objects)?;
    let relay_url = &env.up.relay_url;
    for want in [
        "--cluster=edge-1".to_owned(),
        format!("--relay={relay_url}"),
        "--relay-ca=/etc/tether/relay-ca/ca.crt".to_owned(),
        format!("--proxy-skip-range={no_proxy}"),
        "--proxy-cert=/etc/tether/proxy-ca/proxy-cert.crt".to_owned(),
        format!("--entra-tenant={tenant}"),
        format!("--entra-audience={audience}"),
    ] {
        ensure!(args.contains(&want), "{want} not in {args:?}");
    }
    let deployment = support::object(&objects, "Deployment", "tether-agent")?;
    ensure!(
        support::str_at(deployment, &["metadata", "namespace"]) == Some(support::NAMESPACE),
        "namespace"
    );
    ensure!(
        support::key_of(&objects, "ConfigMap", "tether-agent-relay-ca", "ca.crt")? == relay_ca,
        "the relay CA in the ConfigMap"
    );
    ensure!(
        support::key_of(&objects, "Secret", "tether-agent-onboarding", "token")? == token,
        "the onboarding token in the Secret"
    );
    ensure!(
        support::key_of(&objects, "Secret", "tether-agent-proxy", "https-proxy")? == proxy_url,
        "the proxy URL in the Secret"
    );
    ensure!(
        support::key_of(&objects, "Secret", "tether-agent-proxy", "proxy-cert.crt")?
            == proxy_ca_pem,
        "the proxy CA in the Secret"
    );
    Ok(())
}

/// Without proxy or Entra options the line sets only the cluster's own values; a proxy URL without credentials
/// stays on the line; a bad proxy URL is refused before the cluster is registered.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connect_without_options_prints_the_plain_line_and_refuses_a_bad_proxy_first() -> Result<()>
{
    let Some(helm) = support::helm()? else {
        return Ok(());
    };
    let env = Env::start().await?;
    let files = env.dir.path().join("files");
    std::fs::create_dir(&files)?;
    let out = env
        .tether(&[
            "cluster",
            "connect",
            "edge-2",
            "--files-dir",
            files.to_str().context("path")?,
            "--proxy-https",
            "socks5://proxy.invalid:1080",
        ])
        .await?;
    ensure!(out.code == Some(64), "{:?}: {}", out.code, out.stderr);
    ensure!(
        env.cluster("edge-2").await.is_err(),
        "registered despite a bad option"
    );

    let chart = support::chart_dir("tether-agent");
    let out = env
        .tether_ok(&[
            "cluster",
            "connect",
            "edge-2",
            "--files-dir",
            files.to_str().context("path")?,
            "--chart",
            chart.to_str().context("path")?,
            "--proxy-https",
            "http://proxy.invalid:3128",
        ])
        .await?;
    let line = helm_line(&out)?;
    ensure!(
        line.contains("--set-string 'proxy.httpsProxy=http://proxy.invalid:3128'"),
        "{line}"
    );
    ensure!(!line.contains("entra"), "{line}");
    ensure!(!files.join("edge-2-https-proxy").exists());
    let script = line.replacen(
        "helm upgrade --install",
        &format!("'{}' template", helm.display()),
        1,
    );
    let rendered = support::run(
        std::process::Command::new("sh")
            .args(["-c", &script])
            .current_dir(env.dir.path()),
    )
    .with_context(|| format!("the printed line:\n{line}"))?;
    let objects = support::documents(&rendered)?;
    let args = args_of(&objects)?;
    ensure!(args.contains(&"--cluster=edge-2".to_owned()), "{args:?}");
    ensure!(
        support::key_of(&objects, "Secret", "tether-agent-proxy", "https-proxy")?
            == "http://proxy.invalid:3128"
    );
    Ok(())
}
