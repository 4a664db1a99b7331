//! Clear ends when the path breaks (issue 17, item 4), with the real kubectl through the relay: the cluster
//! `faults` is served by a separate `tether-agent` process, SIGKILLed while kubectl holds a long-running
//! request. Each request ends; `get -w`, `exec` and `port-forward` (over SPDY in a WebSocket, and over plain
//! SPDY) say which cluster and why. A kube-rs `watcher` (an informer) through the relay resumes by
//! itself once the agent is back and sees every change made while it was down.

mod common;

use std::process::Stdio;
use std::time::Duration;

use anyhow::Context as _;
use common::{Env, onboarding_token};
use k8s_openapi::api::core::v1::ConfigMap;
use tether_testkit::kubectl::{Kubectl, KubectlChild};

/// A deadline for each step (not a timing assertion).
const WAIT: Duration = Duration::from_secs(60);

/// The quickstart plus a cluster `faults` whose agent is a separate process that can be SIGKILLed.
struct Faults {
    env: Env,
    agent: tokio::process::Child,
    /// The onboarding token the agent was started with (used once; the agent keeps its identity after).
    token: String,
    kubectl: Kubectl,
}

/// The `tether-agent` command line of the cluster `faults` (its identity is in the state dir after the first
/// run, so the same command restarts it).
fn agent_command(env: &Env, token: &str) -> anyhow::Result<tokio::process::Command> {
    let mut command = tokio::process::Command::new(common::sibling_binary("tether-agent")?);
    command
        .args(["--relay", &env.up.relay_url, "--cluster", "faults"])
        // The relay learns of a SIGKILL at once over WebSocket (the kernel closes the TCP connection);
        // over QUIC only the tunnel's idle timeout tells it (see the faults test over QUIC).
        .args(["--transport", "wss"])
        .arg("--relay-ca")
        .arg(env.relay_ca_file())
        .arg("--state-dir")
        .arg(env.dir.path().join("faults-agent"))
        .arg("--kubeconfig")
        .arg(env.sample()?.kubeconfig_path())
        .env("TETHER_ONBOARDING_TOKEN", token)
        .env_remove("HTTPS_PROXY")
        .env_remove("https_proxy")
        .stdout(Stdio::null())
        .kill_on_drop(true);
    Ok(command)
}

impl Faults {
    async fn start() -> anyhow::Result<Faults> {
        let env = Env::start().await?;
        let token = onboarding_token(
            &env.tether_ok(&["cluster", "connect", "faults", "-o", "json"])
                .await?,
        )?;
        let agent = agent_command(&env, &token)?
            .spawn()
            .context("starting tether-agent")?;
        env.wait_cluster("faults", WAIT, |c| c["connected"] == true)
            .await
            .map_err(|last| anyhow::anyhow!("faults never connected: {last}"))?;
        let user_token = env.up.user_token.clone();
        let kubectl = Kubectl::new(&env.kubeconfig_for("faults", user_token.as_deref())?)?;
        Ok(Faults {
            env,
            agent,
            token,
            kubectl,
        })
    }

    /// Starts the agent again with the identity it stored, and waits until the relay has its tunnel.
    async fn restart_agent(&mut self) -> anyhow::Result<()> {
        self.agent = agent_command(&self.env, &self.token)?
            .spawn()
            .context("restarting tether-agent")?;
        self.env
            .wait_cluster("faults", WAIT, |c| c["connected"] == true)
            .await
            .map_err(|last| anyhow::anyhow!("faults never came back: {last}"))?;
        Ok(())
    }

    /// SIGKILLs the agent (no GOAWAY, no drain: the tunnel just drops).
    async fn kill_agent(&mut self) -> anyhow::Result<()> {
        self.agent.start_kill()?;
        self.agent.wait().await?;
        Ok(())
    }

    async fn stop(self) -> anyhow::Result<()> {
        self.env.up.shutdown().await?;
        Ok(())
    }
}

/// Waits for kubectl to end by itself; its stderr.
async fn ended(child: KubectlChild) -> anyhow::Result<String> {
    let stderr_before = child.stderr();
    child.wait(WAIT).await.with_context(|| {
        format!("kubectl did not end after the agent was killed; stderr: {stderr_before}")
    })?;
    // The stderr reader may trail the exit by a moment.
    Ok(stderr_before)
}

fn assert_names_cluster_and_cause(stderr: &str) {
    assert!(stderr.contains("cluster faults"), "{stderr}");
    assert!(
        stderr.contains("lost") || stderr.contains("agent") || stderr.contains("closed"),
        "no cause in: {stderr}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn watch_ends_with_the_cluster_and_the_cause_when_the_agent_is_killed() -> anyhow::Result<()>
{
    let mut faults = Faults::start().await?;
    let out = faults
        .kubectl
        .run(&["create", "configmap", "before"])
        .await?;
    anyhow::ensure!(out.status.success(), "create failed: {}", out.stderr);
    // kubectl (1.33) prints a watch's final ERROR event as a row of the table on stdout (with `-o name` only
    // as `status/<unknown>`), so the default output it is.
    let mut watch = faults.kubectl.spawn(&["get", "configmaps", "-w"])?;
    // Past the list, with the watch open and delivering: the kill breaks an answer under way, which the relay
    // ends with an ERROR event (a watch still waiting for its head gets a 503 naming the cause instead).
    common::watch_is_open(&faults.kubectl, &mut watch, "before", WAIT).await?;
    faults.kill_agent().await?;
    let said = common::said_at_the_end(&mut watch, "cluster faults").await;
    let _ = ended(watch).await?;
    assert_names_cluster_and_cause(&said);
    faults.stop().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn exec_ends_with_the_cluster_and_the_cause_when_the_agent_is_killed() -> anyhow::Result<()> {
    let mut faults = Faults::start().await?;
    let exec = common::exec_until_ready(&faults.kubectl, WAIT).await?;
    faults.kill_agent().await?;
    let stderr = common::stderr_naming(&exec, "cluster faults").await;
    let _ = ended(exec).await?;
    assert_names_cluster_and_cause(&stderr);
    faults.stop().await
}

/// `kubectl port-forward` with one forwarded connection open when the agent is killed: kubectl prints the
/// relay's message (which cluster, why) for that connection, then "lost connection to pod", and ends.
async fn port_forward_names_the_cluster_and_the_cause(
    faults: &mut Faults,
    binary: Option<std::path::PathBuf>,
) -> anyhow::Result<String> {
    let token = faults.env.up.user_token.clone();
    let mut kubectl = Kubectl::new(&faults.env.kubeconfig_for("faults", token.as_deref())?)?;
    if let Some(binary) = binary {
        kubectl = kubectl.with_binary(binary);
    }
    let mut forward = kubectl.spawn(&["port-forward", "pod/demo", ":7"])?;
    let echo = forward.forwarded_address(WAIT).await?;
    // One connection through and still open, so kubectl holds its error stream when the path breaks.
    let mut tcp = tokio::net::TcpStream::connect(echo).await?;
    {
        use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
        tcp.write_all(b"ping").await?;
        let mut back = [0u8; 4];
        tokio::time::timeout(WAIT, tcp.read_exact(&mut back)).await??;
        assert_eq!(&back, b"ping");
    }
    faults.kill_agent().await?;
    let stderr = common::stderr_naming(&forward, "lost connection").await;
    let _ = ended(forward).await?;
    assert!(stderr.contains("lost connection"), "{stderr}");
    assert_names_cluster_and_cause(&stderr);
    drop(tcp);
    Ok(stderr)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn port_forward_ends_with_the_cluster_and_the_cause_when_the_agent_is_killed()
-> anyhow::Result<()> {
    // kubectl ≥ 1.30: SPDY tunnelled in a WebSocket.
    let mut faults = Faults::start().await?;
    let stderr = port_forward_names_the_cluster_and_the_cause(&mut faults, None).await?;
    println!("kubectl port-forward printed: {stderr}");
    faults.stop().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn port_forward_over_plain_spdy_ends_with_the_cluster_and_the_cause() -> anyhow::Result<()> {
    // kubectl 1.29: SPDY on the upgraded connection itself.
    let Some(kubectl_1_29) = tether_testkit::kubectl::versioned(29) else {
        anyhow::ensure!(
            std::env::var_os("CI").is_none(),
            "kubectl 1.29 is missing: port-forward over plain SPDY cannot be tested"
        );
        eprintln!("skipping: no kubectl 1.29 (it port-forwards over plain SPDY)");
        return Ok(());
    };
    let mut faults = Faults::start().await?;
    let stderr =
        port_forward_names_the_cluster_and_the_cause(&mut faults, Some(kubectl_1_29)).await?;
    println!("kubectl 1.29 port-forward printed: {stderr}");
    faults.stop().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn logs_follow_ends_when_the_agent_is_killed() -> anyhow::Result<()> {
    let mut faults = Faults::start().await?;
    let mut logs = faults.kubectl.spawn(&["logs", "-f", "demo"])?;
    logs.wait_for_line(WAIT, |l| l.contains("tick")).await?;
    faults.kill_agent().await?;
    let _ = ended(logs).await?;
    faults.stop().await
}

/// What a kube-rs `watcher` has told its user so far, applied the way a reflector applies it.
#[derive(Debug, Default)]
struct Seen {
    /// name → resourceVersion of every object the watcher says exists.
    objects: std::collections::BTreeMap<String, String>,
    /// Objects of a relist in progress (between `Init` and `InitDone`).
    relisting: Option<std::collections::BTreeMap<String, String>>,
    /// Every event, in order: `apply NAME RV`, `delete NAME RV`, `init`, `init-done`.
    events: Vec<String>,
    /// Errors the watcher reported (it goes on by itself after each).
    errors: Vec<String>,
}

impl Seen {
    fn apply(&mut self, event: kube::runtime::watcher::Event<ConfigMap>) {
        use kube::runtime::watcher::Event;
        let key = |cm: &ConfigMap| {
            (
                cm.metadata.name.clone().unwrap_or_default(),
                cm.metadata.resource_version.clone().unwrap_or_default(),
            )
        };
        match event {
            Event::Apply(cm) => {
                let (name, rv) = key(&cm);
                self.events.push(format!("apply {name} {rv}"));
                self.objects.insert(name, rv);
            }
            Event::Delete(cm) => {
                let (name, rv) = key(&cm);
                self.events.push(format!("delete {name} {rv}"));
                self.objects.remove(&name);
            }
            Event::Init => {
                self.events.push("init".into());
                self.relisting = Some(Default::default());
            }
            Event::InitApply(cm) => {
                let (name, rv) = key(&cm);
                if let Some(list) = &mut self.relisting {
                    list.insert(name, rv);
                }
            }
            Event::InitDone => {
                self.events.push("init-done".into());
                if let Some(list) = self.relisting.take() {
                    self.objects = list;
                }
            }
        }
    }
}

/// A kube-rs client from a kubeconfig file.
async fn kube_client(path: &std::path::Path) -> anyhow::Result<kube::Client> {
    let kubeconfig = kube::config::Kubeconfig::read_from(path)?;
    let options = kube::config::KubeConfigOptions::default();
    let config = kube::Config::from_custom_kubeconfig(kubeconfig, &options).await?;
    Ok(kube::Client::try_from(config)?)
}

/// A config map named `name` with `data`.
fn configmap(name: &str, value: &str) -> ConfigMap {
    let mut cm = ConfigMap::default();
    cm.metadata.name = Some(name.into());
    cm.data = Some([("k".to_string(), value.to_string())].into());
    cm
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kube_rs_watcher_resumes_after_the_agent_restarts_with_no_missed_event()
-> anyhow::Result<()> {
    use futures_util::StreamExt as _;
    use kube::api::{Api, DeleteParams, PostParams};
    use kube::runtime::{WatchStreamExt as _, watcher};

    let mut faults = Faults::start().await?;
    let through_relay = kube_client(
        &faults
            .env
            .kubeconfig_for("faults", faults.env.up.user_token.as_deref())?,
    )
    .await?;
    // Changes are made straight at the apiserver, never through the relay (which is down for this cluster).
    let direct = kube_client(&faults.env.sample()?.kubeconfig_path()).await?;
    let direct: Api<ConfigMap> = Api::namespaced(direct, "resume");
    let namespaces: Api<k8s_openapi::api::core::v1::Namespace> =
        Api::all(kube_client(&faults.env.sample()?.kubeconfig_path()).await?);
    let mut ns = k8s_openapi::api::core::v1::Namespace::default();
    ns.metadata.name = Some("resume".into());
    namespaces.create(&PostParams::default(), &ns).await?;
    let pp = PostParams::default();
    direct.create(&pp, &configmap("kept", "v1")).await?;
    direct.create(&pp, &configmap("doomed", "v1")).await?;

    // The informer: kube-rs's watcher with its default backoff, as a controller runs it.
    let seen = std::sync::Arc::new(std::sync::Mutex::new(Seen::default()));
    let informer = tokio::spawn({
        let seen = seen.clone();
        let api: Api<ConfigMap> = Api::namespaced(through_relay, "resume");
        async move {
            let mut stream = watcher(api, watcher::Config::default())
                .default_backoff()
                .boxed();
            while let Some(item) = stream.next().await {
                let mut seen = seen.lock().unwrap_or_else(|p| p.into_inner());
                match item {
                    Ok(event) => seen.apply(event),
                    Err(e) => seen.errors.push(e.to_string()),
                }
            }
        }
    });
    let seen_now = |check: &dyn Fn(&Seen) -> bool| {
        let seen = seen.lock().unwrap_or_else(|p| p.into_inner());
        check(&seen)
    };
    let wait_seen = |what: &'static str, check: fn(&Seen) -> bool| {
        let seen = seen.clone();
        async move {
            let reached = tether_testkit::wait::until(what, WAIT, || {
                let ok = check(&seen.lock().unwrap_or_else(|p| p.into_inner()));
                async move { ok }
            })
            .await;
            reached.map_err(|e| {
                anyhow::anyhow!(
                    "{e}; watcher saw {:?}",
                    seen.lock().map(|s| format!("{s:?}"))
                )
            })
        }
    };
    wait_seen("the initial list", |s| {
        s.events.iter().any(|e| e == "init-done") && s.objects.len() == 2
    })
    .await?;
    // Its watch is open and streaming (it delivered an event), so the kill breaks an open watch.
    direct.create(&pp, &configmap("marker", "v1")).await?;
    wait_seen("the watch streaming", |s| s.objects.contains_key("marker")).await?;

    faults.kill_agent().await?;
    // The watch ends with the relay's ERROR event, which kube-rs reports as an error naming the cluster.
    wait_seen("the watch's end", |s| {
        s.errors.iter().any(|e| e.contains("cluster faults"))
    })
    .await?;

    // While the agent is down: a new object, an update and a deletion.
    let born = direct.create(&pp, &configmap("born", "v1")).await?;
    let mut kept = direct.get("kept").await?;
    kept.data = configmap("kept", "v2").data;
    let kept = direct.replace("kept", &pp, &kept).await?;
    direct.delete("doomed", &DeleteParams::default()).await?;
    let rv = |cm: &ConfigMap| cm.metadata.resource_version.clone().unwrap_or_default();
    let (born_rv, kept_rv) = (rv(&born), rv(&kept));
    assert!(
        seen_now(&|s| !s.events.iter().any(|e| e.starts_with("apply born"))),
        "the watcher saw a change while the agent was down"
    );

    faults.restart_agent().await?;
    // The watcher resumes by itself (kube-rs retries the 503 "not connected" its watch gets meanwhile) and sees
    // each change as its own event, from the resourceVersion it had reached: nothing missed, nothing relisted.
    wait_seen("every change made while the agent was down", |s| {
        s.events.iter().any(|e| e.starts_with("delete doomed")) && s.objects.contains_key("born")
    })
    .await?;
    let (events, objects, errors) = {
        let s = seen.lock().unwrap_or_else(|p| p.into_inner());
        (s.events.clone(), s.objects.clone(), s.errors.clone())
    };
    informer.abort();
    assert!(
        events.contains(&format!("apply born {born_rv}")),
        "{events:?}"
    );
    assert!(
        events.contains(&format!("apply kept {kept_rv}")),
        "{events:?}"
    );
    assert_eq!(
        events.iter().filter(|e| *e == "init-done").count(),
        1,
        "the watcher had to relist instead of resuming: {events:?}"
    );
    // What the watcher holds is what the apiserver holds.
    let server: std::collections::BTreeMap<String, String> = direct
        .list(&Default::default())
        .await?
        .items
        .iter()
        .map(|cm| (cm.metadata.name.clone().unwrap_or_default(), rv(cm)))
        .collect();
    assert_eq!(objects, server, "events: {events:?}; errors: {errors:?}");
    faults.stop().await
}
