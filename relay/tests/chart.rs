//! The Helm charts in `deploy/charts` checked with the real tools: `helm lint --strict` with every `ci/` values
//! file, the rendered objects validated offline against the Kubernetes schemas of the oldest (1.27) and newest
//! versions `kubernetes-validate` ships, the restricted Pod Security Standard, narrow RBAC, egress-only network
//! policy, the plain manifests being what `deploy/render.sh` renders, the Dockerfiles running the binaries the
//! charts run — and the relay's DRIFT test: the container command, args and env of the rendered Deployment run
//! the real `tether-relay` built for this test run until its probes answer.
//!
//! Needs helm and kubernetes-validate (scripts/install-test-deps.sh); without them each test fails under `CI`
//! and skips otherwise.

#[path = "../../deploy/tests/support.rs"]
mod support;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use anyhow::{Context as _, Result, bail, ensure};
use serde_yaml::Value;
use support::{
    NAMESPACE, PodProcess, Render, at, chart_dir, ci_values, helm, http_get, key_of, kind_name,
    kubernetes_validate, object, of_kind, repo_root, run, str_at, wait_until,
};

const CHARTS: [&str; 2] = ["tether-agent", "tether-relay"];
const DEADLINE: Duration = Duration::from_secs(60);

/// Renders `chart` with one values file, as release `chart` in [`NAMESPACE`].
fn render(helm: &Path, chart: &str, values: &Path) -> Result<Vec<Value>> {
    Render {
        chart,
        release: chart,
        values: vec![values.to_path_buf()],
        ..Render::default()
    }
    .objects(helm)
    .with_context(|| format!("rendering {chart} with {}", values.display()))
}

/// Every (chart, values file, rendered objects).
fn every_rendering(helm: &Path) -> Result<Vec<(&'static str, PathBuf, Vec<Value>)>> {
    let mut out = Vec::new();
    for chart in CHARTS {
        for values in ci_values(chart)? {
            let objects = render(helm, chart, &values)?;
            out.push((chart, values, objects));
        }
    }
    Ok(out)
}

#[test]
fn helm_lint_strict_passes_with_every_ci_values_file() -> Result<()> {
    let Some(helm) = helm()? else { return Ok(()) };
    for chart in CHARTS {
        for values in ci_values(chart)? {
            let out = run(Command::new(&helm)
                .args(["lint", "--strict"])
                .arg(chart_dir(chart))
                .arg("--values")
                .arg(&values))?;
            ensure!(
                out.contains("0 chart(s) failed"),
                "{chart} {}: {out}",
                values.display()
            );
        }
    }
    Ok(())
}

#[test]
fn the_values_schema_refuses_unknown_and_malformed_values() -> Result<()> {
    let Some(helm) = helm()? else { return Ok(()) };
    for (chart, key, value) in [
        ("tether-agent", "replicas", "2"), // a typo of replicaCount
        ("tether-agent", "relay.urls[0]", "http://relay.example.com"), // not HTTPS
        ("tether-agent", "clusterName", "Prod_EU"), // not a DNS label
        ("tether-agent", "logFormat", "xml"),
        ("tether-agent", "entra.groupsPrefix", "System:"), // Kubernetes' reserved names
        ("tether-agent", "guard.pushClientCert.commonName", ""),
        ("tether-relay", "workerThreads", "many"), // an integer or auto
        ("tether-relay", "workerThreads", "-1"),
        ("tether-relay", "workerThreads", "1.5"),
    ] {
        let out = Command::new(&helm)
            .args(["lint", "--strict"])
            .arg(chart_dir(chart))
            .arg("--values")
            .arg(chart_dir(chart).join("ci/default-values.yaml"))
            .args(["--set", &format!("{key}={value}")])
            .output()?;
        ensure!(
            !out.status.success(),
            "helm lint accepted {chart} {key}={value}"
        );
    }
    Ok(())
}

#[test]
fn values_that_cannot_work_are_refused_with_a_message() -> Result<()> {
    let Some(helm) = helm()? else { return Ok(()) };
    let cases: [(&str, &str, &[&str], &str); 6] = [
        (
            "tether-agent",
            "ci/default-values.yaml",
            &["clusterName="],
            "clusterName is required",
        ),
        (
            "tether-agent",
            "ci/default-values.yaml",
            &["identity.stateSecret.enabled=false"],
            "replicaCount > 1 needs identity.stateSecret.enabled",
        ),
        (
            "tether-agent",
            "ci/default-values.yaml",
            &["guard.enabled=true"],
            "guard.enabled needs guard.tls",
        ),
        (
            "tether-agent",
            "ci/default-values.yaml",
            &["entra.usernamePrefix=entra:"],
            "they need entra.tenants",
        ),
        (
            "tether-relay",
            "ci/default-values.yaml",
            &["replicaCount=3"],
            "replicaCount > 1 needs PostgreSQL",
        ),
        (
            "tether-relay",
            "ci/fleet-values.yaml",
            &["agentCa.existingSecret="],
            "replicaCount > 1 needs agentCa.existingSecret",
        ),
    ];
    for (chart, values, sets, message) in cases {
        let mut render = Render {
            chart,
            release: chart,
            values: vec![chart_dir(chart).join(values)],
            ..Render::default()
        };
        for set in sets {
            let (k, v) = set.split_once('=').context("bad case")?;
            render.set.push((k.to_owned(), v.to_owned()));
        }
        let out = render.command(&helm).output()?;
        let stderr = String::from_utf8_lossy(&out.stderr);
        ensure!(!out.status.success(), "{chart} rendered with {sets:?}");
        ensure!(
            stderr.contains(message),
            "{chart} {sets:?}: expected {message:?} in {stderr}"
        );
    }
    Ok(())
}

/// Runs kubernetes-validate on `file` (`version` None: the newest it ships); returns the version it checked.
/// Only cert-manager's Certificate may lack a schema (it is a CRD, not part of Kubernetes).
fn validate(tool: &Path, file: &Path, version: Option<&str>) -> Result<String> {
    let mut cmd = Command::new(tool);
    cmd.arg("--strict");
    if let Some(version) = version {
        cmd.args(["-k", version]);
    }
    let out = run(cmd.arg(file)).with_context(|| format!("validating {}", file.display()))?;
    let mut checked = None;
    for line in out.lines() {
        if line.contains("Couldn't find schema") {
            ensure!(
                line.contains("kind Certificate with api version cert-manager.io/v1"),
                "{line}"
            );
        } else if let Some(rest) = line.split(" against version ").nth(1) {
            ensure!(
                line.starts_with("INFO") && line.contains(" passed "),
                "{line}"
            );
            checked = Some(rest.trim().to_owned());
        } else if !line.trim().is_empty() {
            bail!("unexpected kubernetes-validate output: {line}");
        }
    }
    checked.with_context(|| format!("kubernetes-validate checked nothing in {}", file.display()))
}

#[test]
fn rendered_objects_validate_against_kubernetes_1_27_and_the_newest_schemas() -> Result<()> {
    let Some(helm) = helm()? else { return Ok(()) };
    let Some(tool) = kubernetes_validate()? else {
        return Ok(());
    };
    let dir = tempfile::tempdir()?;
    let mut files = Vec::new();
    for chart in CHARTS {
        for values in ci_values(chart)? {
            let name = format!(
                "{chart}-{}",
                values
                    .file_name()
                    .context("values file name")?
                    .to_string_lossy()
            );
            let file = dir.path().join(name);
            std::fs::write(
                &file,
                Render {
                    chart,
                    release: chart,
                    values: vec![values.clone()],
                    ..Render::default()
                }
                .yaml(&helm)?,
            )?;
            files.push(file);
        }
    }
    for manifest in std::fs::read_dir(repo_root().join("deploy/manifests"))? {
        let path = manifest?.path();
        if path.extension().is_some_and(|e| e == "yaml") {
            files.push(path);
        }
    }
    for file in &files {
        let oldest = validate(&tool, file, Some("1.27.0"))?;
        ensure!(oldest == "1.27", "checked against {oldest}");
        let newest = validate(&tool, file, None)?;
        let minor: u32 = newest
            .strip_prefix("1.")
            .and_then(|m| m.parse().ok())
            .with_context(|| format!("version {newest}"))?;
        ensure!(
            minor >= 33,
            "the newest schemas kubernetes-validate ships are {newest}; expected 1.33 or later"
        );
    }
    Ok(())
}

#[test]
fn plain_manifests_are_what_render_sh_renders() -> Result<()> {
    let Some(_helm) = helm()? else { return Ok(()) };
    let dir = tempfile::tempdir()?;
    run(Command::new("bash")
        .arg(repo_root().join("deploy/render.sh"))
        .arg(dir.path()))?;
    let mut rendered = 0;
    for entry in std::fs::read_dir(dir.path())? {
        let path = entry?.path();
        let name = path.file_name().context("file name")?;
        let committed = repo_root().join("deploy/manifests").join(name);
        let want = std::fs::read_to_string(&path)?;
        let have = std::fs::read_to_string(&committed)
            .with_context(|| format!("{} is missing: run deploy/render.sh", committed.display()))?;
        ensure!(
            want == have,
            "{} is stale: run deploy/render.sh and commit the result",
            committed.display()
        );
        rendered += 1;
    }
    ensure!(rendered == 2, "render.sh wrote {rendered} files");
    Ok(())
}

/// The pod specs of every Deployment in `objects`, with the Deployment's name.
fn pod_specs(objects: &[Value]) -> Vec<(String, &Value)> {
    of_kind(objects, "Deployment")
        .into_iter()
        .filter_map(|d| Some((kind_name(d).1, at(d, &["spec", "template", "spec"])?)))
        .collect()
}

fn bool_at(value: &Value, path: &[&str]) -> Option<bool> {
    at(value, path).and_then(Value::as_bool)
}

#[test]
fn every_pod_meets_the_restricted_pod_security_standard() -> Result<()> {
    let Some(helm) = helm()? else { return Ok(()) };
    for (chart, values, objects) in every_rendering(&helm)? {
        let ctx = format!("{chart} with {}", values.display());
        let pods = pod_specs(&objects);
        ensure!(!pods.is_empty(), "{ctx}: no Deployment");
        for (name, pod) in pods {
            let ctx = format!("{ctx}, Deployment {name}");
            for host in ["hostNetwork", "hostPID", "hostIPC"] {
                ensure!(bool_at(pod, &[host]) != Some(true), "{ctx}: {host}");
            }
            ensure!(
                bool_at(pod, &["securityContext", "runAsNonRoot"]) == Some(true),
                "{ctx}: runAsNonRoot"
            );
            ensure!(
                str_at(pod, &["securityContext", "seccompProfile", "type"])
                    == Some("RuntimeDefault"),
                "{ctx}: seccomp"
            );
            for volume in at(pod, &["volumes"])
                .and_then(Value::as_sequence)
                .into_iter()
                .flatten()
            {
                ensure!(
                    at(volume, &["hostPath"]).is_none(),
                    "{ctx}: hostPath volume"
                );
            }
            // Only the agent talks to the Kubernetes API; no other pod gets a service-account token.
            let token = bool_at(pod, &["automountServiceAccountToken"]);
            if name == "tether-agent" {
                ensure!(token == Some(true), "{ctx}: the agent needs its token");
            } else {
                ensure!(
                    token == Some(false),
                    "{ctx}: a service-account token it does not need"
                );
            }
            let grace = at(pod, &["terminationGracePeriodSeconds"]).and_then(Value::as_u64);
            for container in at(pod, &["containers"])
                .and_then(Value::as_sequence)
                .into_iter()
                .flatten()
            {
                let sc = at(container, &["securityContext"])
                    .with_context(|| format!("{ctx}: no securityContext"))?;
                ensure!(
                    bool_at(sc, &["allowPrivilegeEscalation"]) == Some(false),
                    "{ctx}: privilege escalation"
                );
                ensure!(
                    bool_at(sc, &["readOnlyRootFilesystem"]) == Some(true),
                    "{ctx}: writable root"
                );
                ensure!(
                    bool_at(sc, &["runAsNonRoot"]) == Some(true),
                    "{ctx}: container runAsNonRoot"
                );
                ensure!(
                    at(sc, &["runAsUser"])
                        .and_then(Value::as_u64)
                        .is_some_and(|u| u != 0),
                    "{ctx}: uid 0"
                );
                ensure!(
                    bool_at(sc, &["privileged"]) != Some(true),
                    "{ctx}: privileged"
                );
                let drop: Vec<&str> = at(sc, &["capabilities", "drop"])
                    .and_then(Value::as_sequence)
                    .map(|d| d.iter().filter_map(Value::as_str).collect())
                    .unwrap_or_default();
                ensure!(drop == ["ALL"], "{ctx}: capabilities.drop {drop:?}");
                ensure!(
                    at(sc, &["capabilities", "add"]).is_none(),
                    "{ctx}: capabilities added"
                );
                ensure!(
                    at(container, &["resources", "limits", "memory"]).is_some(),
                    "{ctx}: no memory limit"
                );
                // The pod outlives the drain it asks for.
                for arg in at(container, &["args"])
                    .and_then(Value::as_sequence)
                    .into_iter()
                    .flatten()
                {
                    if let Some(drain) = arg
                        .as_str()
                        .and_then(|a| a.strip_prefix("--drain-timeout="))
                    {
                        let drain: u64 = drain.parse()?;
                        ensure!(
                            grace.is_some_and(|g| g > drain),
                            "{ctx}: grace {grace:?} <= drain {drain}"
                        );
                    }
                }
            }
        }
        for sa in of_kind(&objects, "ServiceAccount") {
            ensure!(
                bool_at(sa, &["automountServiceAccountToken"]) == Some(false),
                "{ctx}: SA automounts"
            );
        }
    }
    Ok(())
}

#[test]
fn the_relay_pod_outlives_its_drain() -> Result<()> {
    let Some(helm) = helm()? else { return Ok(()) };
    for values in ci_values("tether-relay")? {
        let objects = render(&helm, "tether-relay", &values)?;
        let file: Value = serde_yaml::from_str(&std::fs::read_to_string(&values)?)?;
        let defaults: Value = serde_yaml::from_str(&std::fs::read_to_string(
            chart_dir("tether-relay").join("values.yaml"),
        )?)?;
        let drain = at(&file, &["drainTimeoutSeconds"])
            .or_else(|| at(&defaults, &["drainTimeoutSeconds"]))
            .and_then(Value::as_u64)
            .context("drainTimeoutSeconds")?;
        let deploy = object(&objects, "Deployment", "tether-relay")?;
        let grace = at(
            deploy,
            &["spec", "template", "spec", "terminationGracePeriodSeconds"],
        )
        .and_then(Value::as_u64)
        .context("no terminationGracePeriodSeconds")?;
        ensure!(
            grace > drain,
            "{}: grace {grace} <= drain {drain}",
            values.display()
        );
        ensure!(
            of_kind(&objects, "PodDisruptionBudget").len() == 1,
            "{}: no PDB",
            values.display()
        );
    }
    Ok(())
}

/// Every rule of a Role or ClusterRole.
fn rules(role: &Value) -> Vec<&Value> {
    at(role, &["rules"])
        .and_then(Value::as_sequence)
        .map(|r| r.iter().collect())
        .unwrap_or_default()
}

fn strings(value: &Value, key: &str) -> Vec<String> {
    at(value, &[key])
        .and_then(Value::as_sequence)
        .map(|s| {
            s.iter()
                .filter_map(Value::as_str)
                .map(str::to_owned)
                .collect()
        })
        .unwrap_or_default()
}

#[test]
fn the_agent_rbac_is_as_narrow_as_the_agent_needs() -> Result<()> {
    let Some(helm) = helm()? else { return Ok(()) };
    let allowed_cluster: [(&str, &str, &[&str]); 6] = [
        ("", "users", &["impersonate"]),
        ("", "groups", &["impersonate"]),
        ("authentication.k8s.io", "uids", &["impersonate"]),
        ("authentication.k8s.io", "userextras/oid", &["impersonate"]),
        ("authentication.k8s.io", "userextras/tid", &["impersonate"]),
        ("", "nodes", &["get", "list", "watch"]),
    ];
    for values in ci_values("tether-agent")? {
        let ctx = values.display().to_string();
        let objects = render(&helm, "tether-agent", &values)?;
        let file: Value = serde_yaml::from_str(&std::fs::read_to_string(&values)?)?;
        let cluster_role = object(&objects, "ClusterRole", "tether-agent")?;
        for rule in rules(cluster_role) {
            let verbs = strings(rule, "verbs");
            ensure!(!verbs.iter().any(|v| v == "*"), "{ctx}: wildcard verb");
            if let Some(urls) = at(rule, &["nonResourceURLs"]) {
                ensure!(
                    serde_yaml::to_string(urls)?.trim() == "- /version" && verbs == ["get"],
                    "{ctx}: non-resource rule {rule:?}"
                );
                continue;
            }
            let groups = strings(rule, "apiGroups");
            for resource in strings(rule, "resources") {
                let ok = allowed_cluster.iter().any(|(g, r, vs)| {
                    groups.iter().all(|group| group == g)
                        && resource == *r
                        && verbs.iter().all(|v| vs.contains(&v.as_str()))
                });
                ensure!(
                    ok,
                    "{ctx}: the agent's ClusterRole grants {verbs:?} on {groups:?}/{resource}"
                );
            }
        }
        // Narrowing from values: listed groups and tenants become resourceNames.
        let names_for = |resource: &str| -> Vec<String> {
            rules(cluster_role)
                .into_iter()
                .find(|r| strings(r, "resources") == [resource])
                .map(|r| strings(r, "resourceNames"))
                .unwrap_or_default()
        };
        let listed = |path: &[&str]| -> Vec<String> {
            at(&file, path)
                .and_then(Value::as_sequence)
                .map(|s| {
                    s.iter()
                        .filter_map(Value::as_str)
                        .map(str::to_owned)
                        .collect()
                })
                .unwrap_or_default()
        };
        ensure!(
            names_for("groups") == listed(&["rbac", "impersonation", "groups"]),
            "{ctx}: groups"
        );
        ensure!(
            names_for("userextras/tid") == listed(&["entra", "tenants"]),
            "{ctx}: tid"
        );

        // Its own Secret, by name, and nothing else namespaced.
        let secret_name = str_at(&file, &["identity", "stateSecret", "name"])
            .unwrap_or("tether-agent-identity")
            .to_owned();
        let state_in_secret =
            bool_at(&file, &["identity", "stateSecret", "enabled"]) != Some(false);
        let roles = of_kind(&objects, "Role");
        if state_in_secret {
            ensure!(roles.len() == 1, "{ctx}: {} Roles", roles.len());
            object(&objects, "Secret", &secret_name)?;
            for rule in rules(roles[0]) {
                ensure!(strings(rule, "resources") == ["secrets"], "{ctx}: {rule:?}");
                ensure!(
                    strings(rule, "resourceNames") == [secret_name.clone()],
                    "{ctx}: {rule:?}"
                );
                let verbs = strings(rule, "verbs");
                ensure!(
                    verbs
                        .iter()
                        .all(|v| ["get", "watch", "update", "patch"].contains(&v.as_str())),
                    "{ctx}: verbs {verbs:?} on its Secret"
                );
            }
        } else {
            ensure!(roles.is_empty(), "{ctx}: a Role without a state Secret");
        }
    }
    Ok(())
}

#[test]
fn nothing_may_connect_to_the_agent() -> Result<()> {
    let Some(helm) = helm()? else { return Ok(()) };
    for values in ci_values("tether-agent")? {
        let objects = render(&helm, "tether-agent", &values)?;
        let policy = object(&objects, "NetworkPolicy", "tether-agent")?;
        ensure!(strings(&policy["spec"], "policyTypes") == ["Ingress", "Egress"]);
        let ingress = at(policy, &["spec", "ingress"]).and_then(Value::as_sequence);
        ensure!(
            ingress.is_some_and(|i| i.is_empty()),
            "ingress rules for the agent"
        );
        ensure!(
            str_at(
                policy,
                &[
                    "spec",
                    "podSelector",
                    "matchLabels",
                    "app.kubernetes.io/name"
                ]
            ) == Some("tether-agent")
        );
        let deploy = object(&objects, "Deployment", "tether-agent")?;
        let replicas = at(deploy, &["spec", "replicas"])
            .and_then(Value::as_u64)
            .context("replicas")?;
        if replicas > 1 {
            ensure!(
                at(
                    deploy,
                    &["spec", "template", "spec", "affinity", "podAntiAffinity"]
                )
                .is_some()
                    || at(
                        deploy,
                        &["spec", "template", "spec", "topologySpreadConstraints"]
                    )
                    .is_some()
            );
            ensure!(
                of_kind(&objects, "PodDisruptionBudget").len() == 1,
                "no PDB"
            );
        }
    }
    Ok(())
}

#[test]
fn dockerfiles_run_the_binaries_the_charts_run() -> Result<()> {
    let Some(helm) = helm()? else { return Ok(()) };
    let agent = render(
        &helm,
        "tether-agent",
        &chart_dir("tether-agent").join("ci/guard-entra-values.yaml"),
    )?;
    let relay = render(
        &helm,
        "tether-relay",
        &chart_dir("tether-relay").join("ci/default-values.yaml"),
    )?;
    let command = |objects: &[Value], deployment: &str| -> Result<String> {
        let deploy = object(objects, "Deployment", deployment)?;
        let container = at(deploy, &["spec", "template", "spec", "containers"])
            .and_then(|c| c.get(0))
            .context("no container")?;
        Ok(str_at(container, &["command"])
            .map(str::to_owned)
            .unwrap_or_else(|| {
                at(container, &["command"])
                    .and_then(|c| c.get(0))
                    .and_then(Value::as_str)
                    .unwrap_or_default()
                    .to_owned()
            }))
    };
    let expected = [
        ("tether-relay", Some(command(&relay, "tether-relay")?)),
        ("tether-agent", Some(command(&agent, "tether-agent")?)),
        ("tether-guard", Some(command(&agent, "tether-agent-guard")?)),
        ("tether", None),
    ];
    for (bin, chart_command) in expected {
        let (entrypoint, user, base, built) = support::dockerfile(bin)?;
        let path = format!("/usr/local/bin/{bin}");
        ensure!(
            entrypoint == [path.clone()],
            "{bin}: ENTRYPOINT {entrypoint:?}"
        );
        if let Some(chart_command) = chart_command {
            ensure!(
                chart_command == path,
                "{bin}: the chart runs {chart_command}, the image has {path}"
            );
        }
        ensure!(user == "65532:65532", "{bin}: USER {user}");
        ensure!(
            base.contains("distroless") && base.ends_with(":nonroot"),
            "{bin}: runtime base {base}"
        );
        ensure!(built == bin, "{bin}: the build stage builds {built}");
        let text =
            std::fs::read_to_string(repo_root().join(format!("deploy/docker/{bin}.Dockerfile")))?;
        ensure!(
            text.contains(&format!("COPY --from=build /out/{bin} {path}")),
            "{bin}: COPY"
        );
    }
    Ok(())
}

/// `workerThreads: auto`, the default, gives the relay one async worker per CPU its pod requests, rounded up,
/// through the downward API, and no `--worker-threads` argument (which would win over the variable); an integer
/// is the argument instead. The values the schema refuses are in
/// `the_values_schema_refuses_unknown_and_malformed_values`.
#[test]
fn the_relays_worker_threads_follow_its_cpu_request() -> Result<()> {
    let Some(helm) = helm()? else { return Ok(()) };
    let values = chart_dir("tether-relay").join("ci/default-values.yaml");
    let dir = tempfile::tempdir()?;
    // (--set values, TETHER_RELAY_WORKER_THREADS as resolved, --worker-threads)
    type Case<'a> = (&'a [(&'a str, &'a str)], Option<&'a str>, Option<&'a str>);
    let cases: [Case<'_>; 6] = [
        (&[], Some("1"), None), // the chart's request, 100m
        (&[("resources.requests.cpu", "1500m")], Some("2"), None),
        (&[("resources.requests.cpu", "4")], Some("4"), None),
        (&[("resources.requests", "null")], Some("0"), None), // no request: one per CPU
        (&[("workerThreads", "3")], None, Some("3")),
        (&[("workerThreads", "0")], None, Some("0")),
    ];
    for (sets, env, arg) in cases {
        let mut render = Render {
            chart: "tether-relay",
            release: "tether-relay",
            values: vec![values.clone()],
            ..Render::default()
        };
        for (k, v) in sets {
            render.set.push(((*k).to_owned(), (*v).to_owned()));
        }
        let objects = render.objects(&helm)?;
        let pod = PodProcess::prepare(&objects, "tether-relay", "relay", dir.path(), &[])?;
        let got_env = pod
            .env
            .iter()
            .find(|(k, _)| k == "TETHER_RELAY_WORKER_THREADS")
            .map(|(_, v)| v.as_str());
        let got_arg = pod
            .args
            .iter()
            .find_map(|a| a.strip_prefix("--worker-threads="));
        ensure!(
            (got_env, got_arg) == (env, arg),
            "{sets:?}: env {got_env:?}, argument {got_arg:?}; expected {env:?}, {arg:?}"
        );
    }
    Ok(())
}

/// The `RUN` instructions of a Dockerfile, continuation lines joined, without their `--mount` options.
fn run_steps(dockerfile: &str) -> Result<Vec<String>> {
    let path = repo_root().join("deploy/docker").join(dockerfile);
    let text = std::fs::read_to_string(&path)
        .with_context(|| format!("cannot read {}", path.display()))?;
    let mut steps = Vec::new();
    let mut current: Option<String> = None;
    for line in text.lines().map(str::trim) {
        let mut step = match current.take() {
            Some(step) => step + " " + line,
            None => match line.strip_prefix("RUN ") {
                Some(rest) => rest.to_owned(),
                None => continue,
            },
        };
        if step.ends_with('\\') {
            step.pop();
            current = Some(step);
        } else {
            let words: Vec<&str> = step
                .split_whitespace()
                .filter(|w| !w.starts_with("--mount="))
                .collect();
            steps.push(words.join(" "));
        }
    }
    Ok(steps)
}

/// `--build-arg PGO=1` (relay and agent): one step, word for word the same in both Dockerfiles so that a builder
/// keeping its cache runs it once for both images, runs `scripts/pgo-build.sh`. That script, and
/// `scripts/link-order.sh` for the agent, build each binary with the Dockerfile's own cargo command: another
/// command renames the agent's symbols and it loses its link order (docs/BENCHMARKS.md, "Thirteenth pass"). The
/// step's shell, run as the image's `sh` runs it, does nothing without the argument and refuses a value it does
/// not know.
#[test]
fn pgo_images_are_built_by_the_script_with_the_images_own_commands() -> Result<()> {
    let script = std::fs::read_to_string(repo_root().join("scripts/pgo-build.sh"))?;
    let script_build = script
        .lines()
        .map(str::trim)
        .find(|l| l.starts_with("cargo build --profile \"$profile\"") && l.contains("tether-$pkg"))
        .context("pgo-build.sh has no per-binary cargo build")?;
    ensure!(
        script.contains("\nprofile=release\n") && script.contains("for pkg in relay agent; do"),
        "pgo-build.sh: the default profile or the binaries it builds changed"
    );
    let mut pgo_steps = Vec::new();
    for bin in ["tether-relay", "tether-agent"] {
        let steps = run_steps(&format!("{bin}.Dockerfile"))?;
        let [pgo, plain] = steps.as_slice() else {
            bail!(
                "{bin}.Dockerfile: {} RUN steps, not the PGO one and the plain one",
                steps.len()
            );
        };
        ensure!(
            pgo.contains("scripts/pgo-build.sh --out /out"),
            "{bin}: the PGO step is {pgo}"
        );
        // The plain step's cargo command, and the same as the script writes it (`--profile release`).
        let dockerfile_build = plain
            .split(" && ")
            .flat_map(|part| part.split("; then "))
            .find(|part| part.starts_with("cargo build"))
            .with_context(|| format!("{bin}: no cargo build in {plain}"))?;
        let plain_build = dockerfile_build.replace("--release", "--profile release");
        let expected = script_build
            .replace("\"$profile\"", "release")
            .replace("\"tether-$pkg\"", bin)
            .replace(['(', ')'], "");
        let expected = expected
            .split_whitespace()
            .skip_while(|w| *w != "cargo")
            .collect::<Vec<_>>()
            .join(" ");
        ensure!(
            plain_build.split_whitespace().collect::<Vec<_>>().join(" ") == expected,
            "{bin}: the Dockerfile builds `{plain_build}`, scripts/pgo-build.sh `{expected}`"
        );
        if bin == "tether-agent" {
            // The link order is written from the same build (scripts/link-order.sh).
            let link_order = std::fs::read_to_string(repo_root().join("scripts/link-order.sh"))?;
            let builds: Vec<&str> = link_order
                .lines()
                .map(str::trim)
                .filter(|l| l.starts_with("cargo build") && l.contains("tether-agent"))
                .collect();
            ensure!(
                !builds.is_empty() && builds.iter().all(|l| *l == dockerfile_build),
                "scripts/link-order.sh builds the agent with {builds:?}, the Dockerfile with `{dockerfile_build}`"
            );
        }
        ensure!(
            plain.contains(&format!("if [ ! -x /out/{bin} ]"))
                && plain.contains(&format!("target/release/{bin} /out/{bin}")),
            "{bin}: the plain step must keep a binary the PGO step made: {plain}"
        );
        for step in [pgo, plain] {
            let out = Command::new("sh").args(["-n", "-c", step]).output()?;
            ensure!(
                out.status.success(),
                "{bin}: sh -n: {}",
                String::from_utf8_lossy(&out.stderr)
            );
        }
        pgo_steps.push(pgo.clone());
    }
    ensure!(
        pgo_steps[0] == pgo_steps[1],
        "the PGO steps differ, so a builder would run the training twice:\n{}\n{}",
        pgo_steps[0],
        pgo_steps[1]
    );
    let step = &pgo_steps[0];
    let out = Command::new("sh")
        .args(["-c", step])
        .env("PGO", "0")
        .output()?;
    ensure!(
        out.status.success() && out.stdout.is_empty() && out.stderr.is_empty(),
        "PGO=0 must do nothing: {out:?}"
    );
    let out = Command::new("sh")
        .args(["-c", step])
        .env("PGO", "yes")
        .output()?;
    ensure!(
        out.status.code() == Some(64)
            && String::from_utf8_lossy(&out.stderr).contains("PGO must be 0 or 1, not yes"),
        "PGO=yes must be refused: {out:?}"
    );
    Ok(())
}

/// The relay DRIFT test: the rendered container, run as the pod would run it, serves its probes and its admin
/// API with the admin token from the rendered Secret.
#[tokio::test]
async fn the_relay_charts_command_runs_and_answers_its_probes() -> Result<()> {
    let Some(helm) = helm()? else { return Ok(()) };
    tether_runtime::tls::install_crypto_provider();
    let dir = tempfile::tempdir()?;
    let values = chart_dir("tether-relay").join("ci/default-values.yaml");
    let objects = render(&helm, "tether-relay", &values)?;
    let pod = PodProcess::prepare(&objects, "tether-relay", "relay", dir.path(), &[])?;
    ensure!(
        pod.image_program == "/usr/local/bin/tether-relay",
        "{}",
        pod.image_program
    );
    let mut child = pod
        .command(Path::new(env!("CARGO_BIN_EXE_tether-relay")), &[], "relay")?
        .spawn()?;
    let log = || pod.log("relay");

    // The chart gives the generated certificate its public name; the CA lands in the data dir (the PVC).
    let host = "relay.example.com";
    let ca = dir.path().join("var/lib/tether-relay/ca.pem");
    let (path, port, https) = pod.http_probe("livenessProbe")?;
    ensure!(https, "the relay serves HTTPS only");
    let tls = wait_until(&mut child, log, DEADLINE, "generated CA", || async {
        let pem = std::fs::read(&ca).ok()?;
        tether_runtime::tls::client_config(Some(&pem), &[]).ok()
    })
    .await?;
    let (status, body) = wait_until(&mut child, log, DEADLINE, "liveness probe answer", || {
        let tls = tls.clone();
        let path = path.clone();
        async move { http_get(port, host, &path, Some(tls), None).await.ok() }
    })
    .await?;
    ensure!(status == 200, "{path}: {status} {body}\n{}", log());
    let (startup_path, startup_port, _) = pod.http_probe("startupProbe")?;
    let (status, _) = http_get(startup_port, host, &startup_path, Some(tls.clone()), None).await?;
    ensure!(status == 200, "{startup_path}: {status}");
    // Readiness: the relay's /readyz (store reachable, not draining) is what the chart probes.
    let (ready_path, ready_port, ready_https) = pod.http_probe("readinessProbe")?;
    ensure!(ready_https, "the readiness probe speaks HTTPS");
    ensure!(ready_path == "/readyz", "readiness probes {ready_path}");
    let (status, body) = http_get(ready_port, host, &ready_path, Some(tls.clone()), None).await?;
    ensure!(status == 200, "{ready_path}: {status} {body}\n{}", log());

    // The admin token the chart generated into a Secret is the one the relay uses.
    let admin = key_of(
        &objects,
        "Secret",
        "tether-relay-admin-token",
        "admin-token",
    )?;
    let (status, body) = http_get(
        port,
        host,
        "/api/v1/clusters",
        Some(tls.clone()),
        Some(&admin),
    )
    .await?;
    ensure!(
        status == 200,
        "admin API with the chart's token: {status} {body}"
    );
    let (status, _) = http_get(
        port,
        host,
        "/api/v1/clusters",
        Some(tls.clone()),
        Some("not-the-token"),
    )
    .await?;
    ensure!(status == 401, "admin API with a wrong token: {status}");
    ensure!(
        std::fs::metadata(dir.path().join("var/lib/tether-relay/relay.db")).is_ok(),
        "no SQLite database in the data dir"
    );

    child.kill().await?;
    Ok(())
}

#[test]
fn every_namespaced_object_renders_in_the_release_namespace() -> Result<()> {
    let Some(helm) = helm()? else { return Ok(()) };
    for (chart, values, objects) in every_rendering(&helm)? {
        for o in &objects {
            let (kind, name) = kind_name(o);
            if kind.starts_with("Cluster") {
                continue;
            }
            ensure!(
                str_at(o, &["metadata", "namespace"]) == Some(NAMESPACE),
                "{chart} {}: {kind} {name} has no namespace",
                values.display()
            );
        }
    }
    Ok(())
}

#[test]
fn every_tether_variable_the_relay_chart_sets_is_one_the_relay_reads() -> Result<()> {
    let Some(helm) = helm()? else { return Ok(()) };
    let mut seen = Vec::new();
    for values in ci_values("tether-relay")? {
        let objects = render(&helm, "tether-relay", &values)?;
        let names = support::env_names(&objects, "tether-relay", "relay")?;
        support::check_env_names(Path::new(env!("CARGO_BIN_EXE_tether-relay")), &names)?;
        seen.extend(names);
    }
    // The fleet's database URL comes in through the environment, from a Secret.
    ensure!(
        seen.iter().any(|n| n == "TETHER_RELAY_DATABASE_URL"),
        "{seen:?}"
    );
    Ok(())
}
