//! Shared support for the end-to-end tests: a running quickstart (relay + agent + sample apiserver, wired by the
//! same `tether_cli::up` code as `tether up`) and the real kubectl pointed at it.

#![allow(dead_code, unreachable_pub)]

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use tether_cli::up::{Up, UpOptions};

/// A quickstart in a temporary directory.
pub struct Env {
    pub up: Up,
    pub dir: tempfile::TempDir,
}

impl Env {
    pub async fn start() -> anyhow::Result<Env> {
        Self::start_with(|_| {}).await
    }

    /// A quickstart with options adjusted by `adjust` (short lifecycle settings, tags, …).
    pub async fn start_with(adjust: impl FnOnce(&mut UpOptions)) -> anyhow::Result<Env> {
        tether_runtime::tls::install_crypto_provider();
        let dir = tempfile::tempdir()?;
        let mut options = UpOptions::for_tests(&dir.path().join("up"));
        adjust(&mut options);
        let up = Up::start(options).await?;
        Ok(Env { up, dir })
    }

    /// The relay's CA file.
    pub fn relay_ca_file(&self) -> PathBuf {
        self.up.dir().join("relay").join("ca.pem")
    }

    /// Runs the real `tether` binary with `--config` pointing at this quickstart, in this quickstart's directory.
    pub async fn tether(&self, args: &[&str]) -> anyhow::Result<CliOutput> {
        let mut command = tokio::process::Command::new(env!("CARGO_BIN_EXE_tether"));
        command
            .arg("--config")
            .arg(&self.up.config_path)
            .args(args)
            .env_remove("TETHER_RELAY")
            .env_remove("TETHER_RELAY_CA")
            .env_remove("TETHER_ADMIN_TOKEN_FILE")
            // `cluster connect` writes the helm line's 0600 files to the current directory: keep them here.
            .current_dir(self.dir.path())
            .stdin(std::process::Stdio::null())
            .kill_on_drop(true);
        let out = tokio::time::timeout(Duration::from_secs(60), command.output()).await??;
        Ok(CliOutput {
            code: out.status.code(),
            stdout: String::from_utf8_lossy(&out.stdout).into_owned(),
            stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
        })
    }

    /// `tether …` that must succeed; its stdout.
    pub async fn tether_ok(&self, args: &[&str]) -> anyhow::Result<String> {
        let out = self.tether(args).await?;
        anyhow::ensure!(
            out.code == Some(0),
            "`tether {}` failed ({:?}): {}",
            args.join(" "),
            out.code,
            out.stderr
        );
        Ok(out.stdout)
    }

    /// `tether role …` with JSON output; the created object's id.
    pub async fn role(&self, args: &[&str]) -> anyhow::Result<String> {
        let mut full = vec!["role"];
        full.extend_from_slice(args);
        full.extend(["-o", "json"]);
        let out = self.tether_ok(&full).await?;
        let v: serde_json::Value = serde_json::from_str(&out)?;
        v["id"]
            .as_str()
            .map(str::to_string)
            .ok_or_else(|| anyhow::anyhow!("no id in {out}"))
    }

    /// Waits up to `limit` until guard holds `assignments` role assignments and `denies` deny assignments.
    pub async fn wait_snapshot(
        &self,
        limit: Duration,
        assignments: usize,
        denies: usize,
    ) -> anyhow::Result<()> {
        let guard = self
            .up
            .guard()
            .ok_or_else(|| anyhow::anyhow!("guard is not wired in"))?;
        let reached = eventually(limit, || async {
            let s = guard.store().current();
            s.assignments.len() == assignments && s.deny_assignments.len() == denies
        })
        .await;
        anyhow::ensure!(
            reached,
            "guard did not get the snapshot: {:?}",
            guard.store().current()
        );
        Ok(())
    }

    /// The cluster as `GET /api/v1/clusters/NAME` returns it.
    pub async fn cluster(&self, name: &str) -> anyhow::Result<serde_json::Value> {
        let cluster = self.up.client()?.show_cluster(name).await?;
        Ok(serde_json::to_value(cluster)?)
    }

    /// Waits until `name` shows `connectivityStatus == status`; returns the cluster then.
    pub async fn wait_status(
        &self,
        name: &str,
        status: &str,
        limit: Duration,
    ) -> anyhow::Result<serde_json::Value> {
        self.wait_cluster(name, limit, |c| c["connectivityStatus"] == status)
            .await
            .map_err(|last| {
                anyhow::anyhow!(
                    "{name} did not become {status} within {limit:?}; last seen: {last}"
                )
            })
    }

    /// Waits until the cluster satisfies `check`; on timeout, the last state seen as the error.
    pub async fn wait_cluster(
        &self,
        name: &str,
        limit: Duration,
        mut check: impl FnMut(&serde_json::Value) -> bool,
    ) -> Result<serde_json::Value, String> {
        let deadline = Instant::now() + limit;
        loop {
            let last = match self.cluster(name).await {
                Ok(cluster) if check(&cluster) => return Ok(cluster),
                Ok(cluster) => cluster.to_string(),
                Err(e) => e.to_string(),
            };
            if Instant::now() >= deadline {
                return Err(last);
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// An agent (in this process) for another cluster at this quickstart's relay, serving the same sample
    /// apiserver.
    pub fn agent(
        &self,
        cluster: &str,
        onboarding_token: Option<&str>,
        state_dir: &Path,
    ) -> anyhow::Result<TestAgent> {
        TestAgent::start(
            &self.up.relay_url,
            &self.relay_ca_file(),
            &self.sample()?.kubeconfig_path(),
            cluster,
            onboarding_token,
            state_dir,
        )
    }

    pub fn kubectl(&self) -> anyhow::Result<tether_testkit::kubectl::Kubectl> {
        Ok(tether_testkit::kubectl::Kubectl::new(
            &self.up.kubeconfig_path,
        )?)
    }

    pub fn sample(&self) -> anyhow::Result<&tether_testkit::SampleApiserver> {
        self.up
            .sample
            .as_ref()
            .ok_or_else(|| anyhow::anyhow!("the test quickstart runs the sample apiserver"))
    }

    /// A kubeconfig like the quickstart's but for another cluster name (to reach an unknown cluster).
    pub fn kubeconfig_for(&self, cluster: &str, token: Option<&str>) -> anyhow::Result<PathBuf> {
        let path = self.dir.path().join(format!("{cluster}.kubeconfig"));
        let text = tether_cli::kubeconfig::render(&tether_cli::kubeconfig::KubeconfigSpec {
            relay_url: &self.up.relay_url,
            cluster,
            ca_pem: Some(self.up.ca_pem.as_bytes()),
            token,
        })?;
        tether_cli::kubeconfig::write_private(&path, &text)?;
        Ok(path)
    }
}

/// A workspace binary (tether-agent, tether-sample-apiserver, …) built for this run, never a stale one.
pub fn sibling_binary(name: &str) -> anyhow::Result<PathBuf> {
    tether_testkit::tools::workspace_binary(name).map_err(anyhow::Error::msg)
}

/// Polls `check` until it returns true or `limit` passes.
pub async fn eventually<F, Fut>(limit: Duration, check: F) -> bool
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    tether_testkit::wait::until("condition", limit, check)
        .await
        .is_ok()
}

/// What a `tether` run printed, and its exit status.
#[derive(Debug)]
pub struct CliOutput {
    pub code: Option<i32>,
    pub stdout: String,
    pub stderr: String,
}

/// A `tether_agent::run` in a task, stopped (drained) by [`TestAgent::stop`].
pub struct TestAgent {
    shutdown: tokio::sync::oneshot::Sender<()>,
    join: tokio::task::JoinHandle<Result<(), tether_agent::AgentError>>,
}

impl TestAgent {
    pub fn start(
        relay_url: &str,
        relay_ca: &Path,
        kubeconfig: &Path,
        cluster: &str,
        onboarding_token: Option<&str>,
        state_dir: &Path,
    ) -> anyhow::Result<TestAgent> {
        let mut config = tether_agent::Config::new(relay_url, cluster, state_dir);
        config.onboarding_token = onboarding_token.map(tether_agent::Secret::new);
        config.relay_ca = Some(relay_ca.to_path_buf());
        config.kubeconfig = Some(kubeconfig.to_path_buf());
        config.drain_timeout = Duration::from_secs(5);
        let (shutdown, stopped) = tokio::sync::oneshot::channel::<()>();
        let join = tokio::spawn(tether_agent::run(config, async move {
            let _ = stopped.await;
        }));
        Ok(TestAgent { shutdown, join })
    }

    pub fn is_finished(&self) -> bool {
        self.join.is_finished()
    }

    /// Stops the agent; its own error if it had already failed.
    pub async fn stop(self) -> anyhow::Result<()> {
        let _ = self.shutdown.send(());
        Ok(self.join.await??)
    }
}

/// Starts `kubectl exec demo` of a shell that prints `ready` and then sleeps, and waits up to `wait` for that
/// line. It comes a second after the start: kubectl's WebSocket executor can drop output that arrives before it
/// has set up its streams ("Unknown stream id 1, discarding message"), seen once on a loaded CI machine.
pub async fn exec_until_ready(
    kubectl: &tether_testkit::kubectl::Kubectl,
    wait: Duration,
) -> anyhow::Result<tether_testkit::kubectl::KubectlChild> {
    let mut exec = kubectl.spawn(&[
        "exec",
        "demo",
        "--",
        "sh",
        "-c",
        "sleep 1; echo ready; sleep 600",
    ])?;
    exec.wait_for_line(wait, |l| l.contains("ready")).await?;
    Ok(exec)
}

/// Waits until `kubectl get configmaps -w` (started in the kubeconfig's namespace) holds its watch: a line
/// naming `listed` only says the list before the watch was answered, and the watch request may still be on its
/// way. Creates the config map `open-watch` and waits for the watch to print it.
pub async fn watch_is_open(
    kubectl: &tether_testkit::kubectl::Kubectl,
    watch: &mut tether_testkit::kubectl::KubectlChild,
    listed: &str,
    wait: Duration,
) -> anyhow::Result<()> {
    watch.wait_for_line(wait, |l| l.contains(listed)).await?;
    let out = kubectl.run(&["create", "configmap", "open-watch"]).await?;
    anyhow::ensure!(out.status.success(), "create failed: {}", out.stderr);
    watch
        .wait_for_line(wait, |l| l.contains("open-watch"))
        .await?;
    Ok(())
}

/// kubectl's stderr once it names `what` (its reader may trail the exit a moment), or as it is after 10 s
/// (stderr has nothing to wait on but its growth).
pub async fn stderr_naming(child: &tether_testkit::kubectl::KubectlChild, what: &str) -> String {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    loop {
        let text = child.stderr();
        if text.contains(what) || tokio::time::Instant::now() >= deadline {
            return text;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// What kubectl said after the lines already read: the rest of its stdout (a watch's final ERROR event is a
/// row there), then its stderr, waited for until one of them names `name`.
pub async fn said_at_the_end(
    child: &mut tether_testkit::kubectl::KubectlChild,
    name: &str,
) -> String {
    let mut said = String::new();
    while let Ok(Some(line)) = child.next_line(Duration::from_secs(5)).await {
        said.push_str(&line);
        said.push('\n');
    }
    let wanted = if said.contains(name) { "" } else { name };
    said.push_str(&stderr_naming(child, wanted).await);
    said
}

/// The `onboardingToken` of a `tether cluster connect|import -o json` answer.
pub fn onboarding_token(json: &str) -> anyhow::Result<String> {
    let answer: serde_json::Value = serde_json::from_str(json)?;
    answer["onboardingToken"]
        .as_str()
        .map(str::to_string)
        .ok_or_else(|| anyhow::anyhow!("no onboardingToken in {json}"))
}

/// The names in a `tether cluster list -o json` answer, sorted.
pub fn names(json: &str) -> anyhow::Result<Vec<String>> {
    let answer: serde_json::Value = serde_json::from_str(json)?;
    let items = answer["items"]
        .as_array()
        .ok_or_else(|| anyhow::anyhow!("no items in {json}"))?;
    let mut names: Vec<String> = items
        .iter()
        .filter_map(|c| c["name"].as_str().map(str::to_string))
        .collect();
    names.sort();
    Ok(names)
}
