//! Guard's DRIFT test: render `deploy/charts/tether-agent` with guard on, take the guard container's command,
//! args and env from the rendered Deployment (deploy/tests/support.rs), and run the real `tether-guard` built for
//! this test run with exactly those until its probes answer over HTTPS with the certificate from its Secret.
//! Then it pushes an RBAC snapshot as the rendered agent would — the push token and push certificate files the
//! agent container mounts, from the Secrets the chart generates — and checks that guard takes it, and refuses the
//! same push without the certificate or with a certificate of the apiserver's client CA carrying the same name.
//! The Secrets the operator creates (serving certificate, apiserver client CA) are made here.
//!
//! Needs helm (scripts/install-test-deps.sh); without it the test fails under `CI` and skips otherwise.

#[path = "../../deploy/tests/support.rs"]
mod support;

use std::path::Path;
use std::time::Duration;

use anyhow::{Context as _, Result, ensure};
use serde_yaml::Value;
use support::{NAMESPACE, PodProcess, Render, chart_dir, helm, http_get, wait_until};
use tether_testkit::certs::Ca;
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};

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
async fn the_guard_container_of_the_agent_chart_answers_its_probes_and_takes_only_the_agents_push()
-> Result<()> {
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
    // Guard and the agent's authentication proxy make the same identities from a token: the same prefixes.
    for prefix in ["--username-prefix=entra:", "--groups-prefix=entra:"] {
        ensure!(
            pod.args.iter().any(|a| a == prefix) && agent.args.iter().any(|a| a == prefix),
            "{prefix} must reach guard and the agent: {:?} / {:?}",
            pod.args,
            agent.args
        );
    }
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

    // The agent's push: the files its container mounts, as its flags name them.
    let flag = |name: &str| -> Result<String> {
        agent
            .args
            .iter()
            .find_map(|a| a.strip_prefix(&format!("--{name}=")))
            .map(str::to_owned)
            .with_context(|| format!("the agent has no --{name}: {:?}", agent.args))
    };
    let token = std::fs::read_to_string(flag("guard-push-token-file")?)?;
    let push_cert = std::fs::read(flag("guard-client-cert")?)?;
    let push_key = std::fs::read(flag("guard-client-key")?)?;
    let port = pod.http_probe("readinessProbe")?.1;
    let now_ms = u64::try_from(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)?
            .as_millis(),
    )?;
    let snapshot = serde_json::json!({"version": now_ms, "roles": [], "assignments": [], "denyAssignments": []});
    let client = |identity: Option<(&[u8], &[u8])>| {
        tether_runtime::tls::client_config_with(&tether_runtime::tls::ClientOptions {
            ca_pem: Some(ca.cert_pem().as_bytes()),
            identity: identity.map(|(cert_pem, key_pem)| tether_runtime::tls::ClientIdentity {
                cert_pem,
                key_pem,
            }),
            ..Default::default()
        })
    };
    let same_name = client_ca.issue_client("tether-agent", &[])?;
    for (identity, what) in [
        (None, "the push token alone"),
        (
            Some((same_name.cert_pem.as_bytes(), same_name.key_pem.as_bytes())),
            "a certificate of the apiserver's client CA named tether-agent",
        ),
    ] {
        let (status, body) =
            put(port, &service, client(identity)?, token.trim(), &snapshot).await?;
        ensure!(status == 401, "{what}: {status} {body}");
    }
    let (status, body) = put(
        port,
        &service,
        client(Some((&push_cert, &push_key)))?,
        token.trim(),
        &snapshot,
    )
    .await?;
    ensure!(
        status == 200 && body.contains("\"applied\":true"),
        "the agent's push: {status} {body}\n{}",
        pod.log("guard")
    );
    child.kill().await?;
    Ok(())
}

/// One HTTP/1.1 `PUT /snapshot` to 127.0.0.1:`port` over TLS (SNI `host`) with `token`: status and body.
async fn put(
    port: u16,
    host: &str,
    tls: std::sync::Arc<rustls::ClientConfig>,
    token: &str,
    snapshot: &serde_json::Value,
) -> Result<(u16, String)> {
    let tcp = tokio::net::TcpStream::connect(("127.0.0.1", port)).await?;
    let name = rustls::pki_types::ServerName::try_from(host.to_owned())?;
    let mut stream = tokio_rustls::TlsConnector::from(tls)
        .connect(name, tcp)
        .await?;
    let body = serde_json::to_vec(snapshot)?;
    let head = format!(
        "PUT /snapshot HTTP/1.1\r\nHost: {host}\r\nAuthorization: Bearer {token}\r\nContent-Type: application/json\r\n\
         Content-Length: {}\r\nConnection: close\r\n\r\n",
        body.len()
    );
    stream.write_all(head.as_bytes()).await?;
    stream.write_all(&body).await?;
    let mut response = Vec::new();
    let _ = stream.read_to_end(&mut response).await;
    let text = String::from_utf8_lossy(&response);
    let status = text
        .split(' ')
        .nth(1)
        .and_then(|s| s.parse::<u16>().ok())
        .with_context(|| format!("not an HTTP response: {text:?}"))?;
    let body = text
        .split_once("\r\n\r\n")
        .map(|(_, b)| b.to_owned())
        .unwrap_or_default();
    Ok((status, body))
}
