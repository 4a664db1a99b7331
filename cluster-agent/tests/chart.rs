//! The agent's DRIFT test: render `deploy/charts/tether-agent`, take the container's command, args and env from
//! the rendered Deployment (the kubelet's `$(VAR)` expansion, Secret and ConfigMap mounts and `secretKeyRef`
//! resolved from the rendered objects; see deploy/tests/support.rs), and run the real `tether-agent` built for
//! this test run with exactly those against the real relay and the sample apiserver until it connects. The
//! in-cluster service account is the one stand-in: `KUBECONFIG` points at the sample apiserver's agent identity
//! (`system:serviceaccount:tether-system:tether-agent`, the release's service account).
//!
//! Needs helm (scripts/install-test-deps.sh); without it each test fails under `CI` and skips otherwise.

mod common;
#[path = "../../deploy/tests/support.rs"]
mod support;

use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{Context as _, Result, ensure};
use common::real_relay::RelayProcess;
use http::StatusCode;
use serde_yaml::Value;
use support::{PodProcess, Render, chart_dir, helm, http_get, object, str_at, wait_until};
use tether_testkit::{SampleApiserver, SampleOptions};

const DEADLINE: Duration = Duration::from_secs(60);
const AGENT: &str = env!("CARGO_BIN_EXE_tether-agent");

/// A relay, the sample apiserver, and the agent chart rendered with `values` pointed at them.
struct Setup {
    dir: tempfile::TempDir,
    relay: RelayProcess,
    sample: SampleApiserver,
    objects: Vec<Value>,
    cluster: String,
}

impl Setup {
    async fn start(helm: &Path, values: &str) -> Result<Setup> {
        tether_runtime::tls::install_crypto_provider();
        let dir = tempfile::tempdir()?;
        let sample =
            SampleApiserver::start(SampleOptions::new(dir.path().join("apiserver"))).await?;
        // The bearer token RelayProcess::user_get sends; the sample apiserver allows what it authenticates.
        sample.add_token("user-token", "alice", &[]);
        // A killed pod's QUIC tunnels are ended by the QUIC timeout (no kernel closes them): shorter here
        // than the 3 s default.
        let relay =
            RelayProcess::start_with(&dir.path().join("relay"), "127.0.0.1:0".parse()?, |c| {
                c.tunnel_keepalive = Duration::from_millis(500);
                c.tunnel_timeout = Duration::from_secs(2);
                c.quic_keepalive = Duration::from_millis(500);
                c.quic_timeout = Duration::from_secs(2);
            })
            .await?;
        let values = chart_dir("tether-agent").join(values);
        let file: Value = serde_yaml::from_str(&std::fs::read_to_string(&values)?)?;
        let cluster = str_at(&file, &["clusterName"])
            .context("clusterName")?
            .to_owned();
        let token = relay.register(&cluster).await?;
        let ca = dir.path().join("relay-ca.pem");
        std::fs::write(&ca, &relay.ca_pem)?;
        // What `tether cluster connect` sets: the relay URL, its CA and the onboarding token.
        let objects = Render {
            chart: "tether-agent",
            release: "tether-agent",
            values: vec![values],
            set: vec![
                ("relay.urls[0]".into(), relay.url()),
                ("onboarding.token".into(), token),
            ],
            set_file: vec![("relay.caCert".into(), ca)],
        }
        .objects(helm)?;
        Ok(Setup {
            dir,
            relay,
            sample,
            objects,
            cluster,
        })
    }

    /// A new pod of the Deployment: an empty filesystem of its own under `name`.
    fn pod(&self, name: &str) -> Result<PodProcess> {
        PodProcess::prepare(
            &self.objects,
            "tether-agent",
            "agent",
            &self.dir.path().join(name),
            &[],
        )
    }

    fn spawn(&self, pod: &PodProcess, name: &str) -> Result<tokio::process::Child> {
        ensure!(
            pod.image_program == "/usr/local/bin/tether-agent",
            "{}",
            pod.image_program
        );
        let kubeconfig = self.sample.agent_kubeconfig_path();
        let kubeconfig = kubeconfig.to_str().context("kubeconfig path")?;
        Ok(pod
            .command(Path::new(AGENT), &[("KUBECONFIG", kubeconfig)], name)?
            .spawn()?)
    }

    /// Waits until the relay shows the cluster Connected, then sends a request through the tunnel.
    async fn wait_connected(
        &self,
        child: &mut tokio::process::Child,
        pod: &PodProcess,
        name: &str,
    ) -> Result<()> {
        wait_until(
            child,
            || pod.log(name),
            DEADLINE,
            "Connected at the relay",
            || async {
                let cluster = self.relay.cluster(&self.cluster).await.ok()?;
                (cluster["connectivityStatus"] == "Connected").then_some(())
            },
        )
        .await?;
        let (status, body) = self.relay.user_get(&self.cluster, "/version").await?;
        ensure!(
            status == StatusCode::OK,
            "{status}: {}",
            String::from_utf8_lossy(&body)
        );
        let version: serde_json::Value = serde_json::from_slice(&body)?;
        ensure!(
            version["gitVersion"]
                .as_str()
                .is_some_and(|v| v.contains("tether-sample")),
            "{version}"
        );
        Ok(())
    }
}

/// Today's agent flags: one replica, identity on the pod's emptyDir, no health port, an outbound proxy that
/// the relay's address bypasses (noProxy), the relay CA from the chart's ConfigMap, the token from its Secret.
#[tokio::test]
async fn the_agent_charts_command_connects_with_its_state_on_an_empty_dir() -> Result<()> {
    let Some(helm) = helm()? else { return Ok(()) };
    let setup = Setup::start(&helm, "ci/state-dir-values.yaml").await?;
    let pod = setup.pod("pod-1")?;
    ensure!(
        pod.env
            .iter()
            .any(|(k, v)| k == "TETHER_PROXY_HTTPS" && v.starts_with("http://proxy.invalid")),
        "the proxy URL reaches the agent from the chart's Secret: {:?}",
        pod.env
    );
    let mut child = setup.spawn(&pod, "agent")?;
    setup.wait_connected(&mut child, &pod, "agent").await?;
    let state: PathBuf = pod.root.join("var/lib/tether-agent");
    ensure!(
        state.join("identity.json").is_file(),
        "no identity in the mounted state dir"
    );
    child.kill().await?;
    setup.relay.stop().await?;
    setup.sample.shutdown().await;
    Ok(())
}

/// The default rendering: two replicas sharing the identity through the Secret the chart creates (agent flag
/// --state-secret), readiness on /readyz (tunnel up) and liveness on /livez (event loop) on --health-listen.
/// Both replicas become ready with one onboarding; then a new pod with an empty filesystem connects with the
/// identity from the Secret (the onboarding token is spent by then).
#[tokio::test]
async fn the_agent_charts_default_command_keeps_its_identity_in_a_secret() -> Result<()> {
    let Some(helm) = helm()? else { return Ok(()) };
    let setup = Setup::start(&helm, "ci/default-values.yaml").await?;
    // The Secret exists before the agent starts: the chart creates it (the agent may not create Secrets).
    let secret = object(&setup.objects, "Secret", "tether-agent-identity")?;
    let kubectl = tether_testkit::kubectl::Kubectl::new(&setup.sample.kubeconfig_path())?;
    let out = kubectl
        .run(&["create", "namespace", support::NAMESPACE])
        .await?;
    ensure!(out.success(), "{}", out.stderr);
    let out = kubectl
        .run_with_stdin(
            &["create", "--validate=false", "-f", "-"],
            serde_yaml::to_string(secret)?.as_bytes(),
        )
        .await?;
    ensure!(out.success(), "{}", out.stderr);

    let mut pods = Vec::new();
    for name in ["pod-1", "pod-2"] {
        let pod = setup.pod(name)?;
        let child = setup.spawn(&pod, name)?;
        pods.push((pod, child, name));
    }
    for (pod, child, name) in &mut pods {
        let (path, port, https) = pod.http_probe("readinessProbe")?;
        ensure!(!https);
        wait_until(
            child,
            || pod.log(name),
            DEADLINE,
            "ready",
            || {
                let path = path.clone();
                async move {
                    http_get(port, "localhost", &path, None, None)
                        .await
                        .ok()
                        .filter(|(s, _)| *s == 200)
                }
            },
        )
        .await?;
        let (path, port, _) = pod.http_probe("livenessProbe")?;
        let (status, _) = http_get(port, "localhost", &path, None, None).await?;
        ensure!(status == 200, "{name} {path}: {status}");
    }
    let (pod, child, name) = &mut pods[0];
    setup.wait_connected(child, pod, name).await?;
    for (_, child, _) in &mut pods {
        child.kill().await?;
    }

    let out = kubectl
        .run(&[
            "-n",
            support::NAMESPACE,
            "get",
            "secret",
            "tether-agent-identity",
            "-o",
            "json",
        ])
        .await?;
    ensure!(out.success(), "{}", out.stderr);
    let stored: serde_json::Value = serde_json::from_str(&out.stdout)?;
    ensure!(
        stored["data"].as_object().is_some_and(|d| !d.is_empty()),
        "the identity Secret is empty"
    );

    // A new pod, empty filesystem: it must come back with the identity from the Secret. It is ready once
    // tunnel is up; a request is sure to reach it once the killed pods' QUIC tunnels are gone (they linger at
    // the relay until the tunnel timeout ends them: a killed process sends no CONNECTION_CLOSE, unlike a TCP
    // socket the kernel closes; meanwhile requests prefer tunnels that answer).
    let pod = setup.pod("pod-3")?;
    let mut child = setup.spawn(&pod, "pod-3")?;
    let (path, port, _) = pod.http_probe("readinessProbe")?;
    wait_until(
        &mut child,
        || pod.log("pod-3"),
        DEADLINE,
        "ready",
        || {
            let path = path.clone();
            async move {
                http_get(port, "localhost", &path, None, None)
                    .await
                    .ok()
                    .filter(|(s, _)| *s == 200)
            }
        },
    )
    .await?;
    // The killed pods' tunnels gone: every tunnel the relay holds is the new pod's.
    wait_until(
        &mut child,
        || pod.log("pod-3"),
        DEADLINE,
        "only the new pod's tunnels at the relay",
        || async {
            let cluster = setup.relay.cluster(&setup.cluster).await.ok()?;
            let instances: std::collections::BTreeSet<&str> = cluster["tunnels"]
                .as_array()?
                .iter()
                .map(|t| t["agentInstance"].as_str().unwrap_or_default())
                .collect();
            (instances.len() == 1).then_some(())
        },
    )
    .await?;
    setup.wait_connected(&mut child, &pod, "pod-3").await?;
    ensure!(
        !pod.root.join("var/lib/tether-agent").exists(),
        "the new pod kept its identity on its filesystem"
    );
    child.kill().await?;
    setup.relay.stop().await?;
    setup.sample.shutdown().await;
    Ok(())
}

#[test]
fn every_tether_variable_the_agent_chart_sets_is_one_the_agent_reads() -> Result<()> {
    let Some(helm) = helm()? else { return Ok(()) };
    let mut seen = Vec::new();
    for values in support::ci_values("tether-agent")? {
        let objects = Render {
            chart: "tether-agent",
            release: "tether-agent",
            values: vec![values],
            ..Render::default()
        }
        .objects(&helm)?;
        let names = support::env_names(&objects, "tether-agent", "agent")?;
        support::check_env_names(Path::new(AGENT), &names)?;
        seen.extend(names);
    }
    // The proxy URL (it may hold a password) comes in through the environment, from a Secret.
    ensure!(seen.iter().any(|n| n == "TETHER_PROXY_HTTPS"), "{seen:?}");
    Ok(())
}
