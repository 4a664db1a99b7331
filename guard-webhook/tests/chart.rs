//! Guard's DRIFT test: render `deploy/charts/tether-agent` with guard on, take the guard container's command,
//! args and env from the rendered Deployment (deploy/tests/support.rs), and run the real `tether-guard` built for
//! this test run with exactly those until its probes answer over HTTPS with the certificate from its Secret.
//! The Secrets the operator creates (serving certificate, apiserver client CA) are made here; the push token
//! Secret is the one the chart generates.
//!
//! Needs helm (scripts/install-test-deps.sh); without it the test fails under `CI` and skips otherwise.

#[path = "../../deploy/tests/support.rs"]
mod support;

use std::path::Path;
use std::time::Duration;

use anyhow::{Result, ensure};
use serde_yaml::Value;
use support::{NAMESPACE, PodProcess, Render, chart_dir, helm, http_get, wait_until};
use tether_testkit::certs::Ca;

const DEADLINE: Duration = Duration::from_secs(60);

/// A Secret (`stringData`) or ConfigMap (`data`) the operator would create.
fn external(kind: &str, name: &str, keys: &[(&str, &str)]) -> Result<Value> {
    let mut data = serde_yaml::Mapping::new();
    for (k, v) in keys {
        data.insert(Value::from(*k), Value::from(*v));
    }
    let mut object: Value = serde_yaml::from_str(&format!(
        "{{apiVersion: v1, kind: {kind}, metadata: {{name: {name}, namespace: {NAMESPACE}}}}}"
    ))?;
    let field = if kind == "Secret" {
        "stringData"
    } else {
        "data"
    };
    if let Value::Mapping(map) = &mut object {
        map.insert(Value::from(field), Value::Mapping(data));
    }
    Ok(object)
}

#[tokio::test]
async fn the_guard_container_of_the_agent_chart_runs_and_answers_its_probes() -> Result<()> {
    let Some(helm) = helm()? else { return Ok(()) };
    tether_runtime::tls::install_crypto_provider();
    let dir = tempfile::tempdir()?;
    let objects = Render {
        chart: "tether-agent",
        release: "tether-agent",
        values: vec![chart_dir("tether-agent").join("ci/guard-entra-values.yaml")],
        ..Render::default()
    }
    .objects(&helm)?;

    // The name the agent pushes snapshots to (its --guard-url) is the one guard's certificate must carry.
    let service = format!("tether-agent-guard.{NAMESPACE}.svc");
    let ca = Ca::new("guard test CA")?;
    let serving = ca.issue_server(std::slice::from_ref(&service))?;
    let client_ca = Ca::new("apiserver client CA")?;
    let operator_objects = [
        external(
            "Secret",
            "tether-guard-tls",
            &[
                ("tls.crt", &serving.cert_pem),
                ("tls.key", &serving.key_pem),
                ("ca.crt", ca.cert_pem()),
            ],
        )?,
        external(
            "Secret",
            "tether-apiserver-client-ca",
            &[("ca.crt", client_ca.cert_pem())],
        )?,
        // What the agent container mounts besides guard's CA: the onboarding token and the relay CA.
        external(
            "Secret",
            "tether-onboarding",
            &[("onboarding-token", "token")],
        )?,
        external("ConfigMap", "tether-relay-ca", &[("ca.crt", ca.cert_pem())])?,
    ];
    let agent = PodProcess::prepare(
        &objects,
        "tether-agent",
        "agent",
        &dir.path().join("agent"),
        &operator_objects,
    )?;
    let guard_url = format!("--guard-url=https://{service}:8443/snapshot");
    ensure!(
        agent.args.contains(&guard_url),
        "the agent pushes elsewhere: {:?}",
        agent.args
    );

    let pod = PodProcess::prepare(
        &objects,
        "tether-agent-guard",
        "guard",
        &dir.path().join("guard"),
        &operator_objects,
    )?;
    ensure!(
        pod.image_program == "/usr/local/bin/tether-guard",
        "{}",
        pod.image_program
    );
    let mut child = pod
        .command(Path::new(env!("CARGO_BIN_EXE_tether-guard")), &[], "guard")?
        .spawn()?;
    let tls = tether_runtime::tls::client_config(Some(ca.cert_pem().as_bytes()), &[])?;
    for probe in ["readinessProbe", "livenessProbe"] {
        let (path, port, https) = pod.http_probe(probe)?;
        ensure!(https, "{probe} is not HTTPS");
        let (status, body) = wait_until(
            &mut child,
            || pod.log("guard"),
            DEADLINE,
            probe,
            || {
                let (tls, path, host) = (tls.clone(), path.clone(), service.clone());
                async move { http_get(port, &host, &path, Some(tls), None).await.ok() }
            },
        )
        .await?;
        ensure!(status == 200, "{probe} {path}: {status} {body}");
    }
    child.kill().await?;
    Ok(())
}
