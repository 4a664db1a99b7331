//! Test support for the Helm charts in `deploy/charts`, shared by `relay/tests/chart.rs` and
//! `cluster-agent/tests/chart.rs` (each includes this file with `#[path]`; `deploy/` is not a crate).
//!
//! It finds the real tools (helm, kubernetes-validate), renders a chart, and turns one container of a rendered
//! Deployment into a process this machine can run: its command, its args and env exactly as rendered — `$(VAR)`
//! expanded as the kubelet does, `fieldRef` and `secretKeyRef`/`configMapKeyRef` resolved from the rendered
//! objects — with each volume mount materialised under a temp dir (Secret and ConfigMap keys written as files,
//! emptyDir and PVC as empty dirs), absolute paths under a mount prefixed with that dir, and each
//! `0.0.0.0:PORT` listen address moved to a free port on 127.0.0.1. Nothing else is changed, so a flag the
//! binary does not know, a file the chart forgets to mount or an env var that points nowhere fails the test.

#![allow(dead_code, unreachable_pub)]

use std::collections::{BTreeMap, HashMap};
use std::net::{Ipv4Addr, SocketAddr, TcpListener};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context as _, Result, anyhow, bail, ensure};
use base64::Engine as _;
use serde_yaml::Value;
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};

/// The namespace every test renders into (the one `deploy/manifests/namespace.yaml` creates).
pub const NAMESPACE: &str = "tether-system";

/// The repository root.
pub fn repo_root() -> PathBuf {
    let manifest = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    manifest.parent().map(Path::to_path_buf).unwrap_or(manifest)
}

/// `deploy/charts/NAME`.
pub fn chart_dir(name: &str) -> PathBuf {
    repo_root().join("deploy/charts").join(name)
}

/// The values files in `deploy/charts/NAME/ci/`, sorted.
pub fn ci_values(chart: &str) -> Result<Vec<PathBuf>> {
    let dir = chart_dir(chart).join("ci");
    let mut files: Vec<PathBuf> = std::fs::read_dir(&dir)
        .with_context(|| format!("cannot list {}", dir.display()))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|e| e == "yaml"))
        .collect();
    files.sort();
    ensure!(!files.is_empty(), "no values files in {}", dir.display());
    Ok(files)
}

/// A tool the test needs: `Ok(Some(path))` when found; when missing, an error under `CI` and `Ok(None)`
/// (after printing why the test is skipped) otherwise.
pub fn require_tool(name: &str, found: Option<PathBuf>) -> Result<Option<PathBuf>> {
    match found {
        Some(path) => Ok(Some(path)),
        None if std::env::var_os("CI").is_some() => Err(anyhow!(
            "{name} is missing (CI is set, so this test fails instead of skipping): run scripts/install-test-deps.sh"
        )),
        None => {
            eprintln!(
                "SKIPPED: {name} is missing; run scripts/install-test-deps.sh (CI would fail here)"
            );
            Ok(None)
        }
    }
}

fn on_path(program: &str) -> Option<PathBuf> {
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path)
        .map(|dir| dir.join(program))
        .find(|candidate| candidate.is_file())
}

/// The `helm` binary (Helm 3), if installed.
pub fn helm() -> Result<Option<PathBuf>> {
    let found = on_path("helm").filter(|helm| {
        Command::new(helm)
            .args(["version", "--short"])
            .output()
            .is_ok_and(|o| {
                o.status.success() && String::from_utf8_lossy(&o.stdout).starts_with("v3.")
            })
    });
    require_tool("helm (Helm 3)", found)
}

/// The `kubernetes-validate` command (PyPI package of the same name), if installed.
pub fn kubernetes_validate() -> Result<Option<PathBuf>> {
    let found = on_path("kubernetes-validate").filter(|tool| {
        Command::new(tool)
            .arg("--version")
            .output()
            .is_ok_and(|o| o.status.success())
    });
    require_tool("kubernetes-validate", found)
}

/// Runs a command, failing with its output unless it exits 0; returns stdout.
pub fn run(command: &mut Command) -> Result<String> {
    let output = command
        .stdin(Stdio::null())
        .output()
        .with_context(|| format!("cannot run {command:?}"))?;
    if !output.status.success() {
        bail!(
            "{command:?} failed ({}):\n{}\n{}",
            output.status,
            String::from_utf8_lossy(&output.stdout),
            String::from_utf8_lossy(&output.stderr)
        );
    }
    Ok(String::from_utf8(output.stdout)?)
}

/// How to render a chart.
#[derive(Debug, Default)]
pub struct Render<'a> {
    pub chart: &'a str,
    pub release: &'a str,
    pub values: Vec<PathBuf>,
    pub set: Vec<(String, String)>,
    pub set_file: Vec<(String, PathBuf)>,
}

impl Render<'_> {
    /// The `helm template` command for these settings.
    pub fn command(&self, helm: &Path) -> Command {
        let mut cmd = Command::new(helm);
        cmd.arg("template")
            .arg(self.release)
            .arg(chart_dir(self.chart))
            .args(["--namespace", NAMESPACE]);
        for file in &self.values {
            cmd.arg("--values").arg(file);
        }
        for (key, value) in &self.set {
            cmd.arg("--set").arg(format!("{key}={value}"));
        }
        for (key, file) in &self.set_file {
            cmd.arg("--set-file")
                .arg(format!("{key}={}", file.display()));
        }
        cmd
    }

    /// The rendered YAML.
    pub fn yaml(&self, helm: &Path) -> Result<String> {
        run(&mut self.command(helm))
    }

    /// The rendered objects.
    pub fn objects(&self, helm: &Path) -> Result<Vec<Value>> {
        documents(&self.yaml(helm)?)
    }
}

/// The objects of a multi-document YAML stream (empty documents dropped).
pub fn documents(yaml: &str) -> Result<Vec<Value>> {
    let mut out = Vec::new();
    for doc in serde_yaml::Deserializer::from_str(yaml) {
        let value = <Value as serde::Deserialize>::deserialize(doc)?;
        if !value.is_null() {
            out.push(value);
        }
    }
    Ok(out)
}

/// `kind` and `metadata.name` of an object.
pub fn kind_name(object: &Value) -> (String, String) {
    (
        str_at(object, &["kind"]).unwrap_or_default().to_owned(),
        str_at(object, &["metadata", "name"])
            .unwrap_or_default()
            .to_owned(),
    )
}

/// The value at a path of mapping keys.
pub fn at<'a>(value: &'a Value, path: &[&str]) -> Option<&'a Value> {
    path.iter().try_fold(value, |v, key| v.get(*key))
}

/// The string at a path of mapping keys.
pub fn str_at<'a>(value: &'a Value, path: &[&str]) -> Option<&'a str> {
    at(value, path).and_then(Value::as_str)
}

/// The objects of one kind.
pub fn of_kind<'a>(objects: &'a [Value], kind: &str) -> Vec<&'a Value> {
    objects
        .iter()
        .filter(|o| str_at(o, &["kind"]) == Some(kind))
        .collect()
}

/// The one object of `kind` named `name`.
pub fn object<'a>(objects: &'a [Value], kind: &str, name: &str) -> Result<&'a Value> {
    objects
        .iter()
        .find(|o| kind_name(o) == (kind.to_owned(), name.to_owned()))
        .ok_or_else(|| anyhow!("the chart rendered no {kind} {name}"))
}

/// The keys of a rendered Secret (`data` decoded, `stringData` as is) or ConfigMap.
fn keys_of(object: &Value) -> Result<BTreeMap<String, Vec<u8>>> {
    let mut keys = BTreeMap::new();
    if let Some(data) = at(object, &["data"]).and_then(Value::as_mapping) {
        let secret = str_at(object, &["kind"]) == Some("Secret");
        for (k, v) in data {
            let key = k.as_str().context("non-string key")?.to_owned();
            let text = v.as_str().context("non-string data value")?;
            let bytes = if secret {
                base64::engine::general_purpose::STANDARD.decode(text)?
            } else {
                text.as_bytes().to_vec()
            };
            keys.insert(key, bytes);
        }
    }
    if let Some(data) = at(object, &["stringData"]).and_then(Value::as_mapping) {
        for (k, v) in data {
            let key = k.as_str().context("non-string key")?.to_owned();
            keys.insert(
                key,
                v.as_str().context("non-string value")?.as_bytes().to_vec(),
            );
        }
    }
    Ok(keys)
}

/// A container of a rendered Deployment, ready to run here.
#[derive(Debug)]
pub struct PodProcess {
    /// `command[0]` as rendered (the path inside the image).
    pub image_program: String,
    /// Args, expanded and remapped.
    pub args: Vec<String>,
    /// Env, resolved, in order.
    pub env: Vec<(String, String)>,
    /// Container port (as rendered) → the loopback port it was moved to.
    pub ports: HashMap<u16, u16>,
    /// Named container ports, as rendered.
    pub port_names: HashMap<String, u16>,
    /// The container, as rendered.
    pub container: Value,
    /// Where the mounts live: container path `/x/y` is `root/x/y`.
    pub root: PathBuf,
    mounts: Vec<String>,
}

/// A free port on 127.0.0.1 (bound and released; the process under test binds it next).
pub fn free_port() -> Result<u16> {
    let listener = TcpListener::bind((Ipv4Addr::LOCALHOST, 0))?;
    Ok(listener.local_addr()?.port())
}

impl PodProcess {
    /// Prepares container `container` of Deployment `deployment` from `objects`, with mounts under `root`.
    /// `external` supplies Secrets and ConfigMaps the chart references but does not render (by name).
    pub fn prepare(
        objects: &[Value],
        deployment: &str,
        container: &str,
        root: &Path,
        external: &[Value],
    ) -> Result<PodProcess> {
        let deploy = object(objects, "Deployment", deployment)?;
        let pod = at(deploy, &["spec", "template", "spec"]).context("no pod spec")?;
        let spec = at(pod, &["containers"])
            .and_then(Value::as_sequence)
            .and_then(|cs| cs.iter().find(|c| str_at(c, &["name"]) == Some(container)))
            .with_context(|| format!("no container {container} in Deployment {deployment}"))?;
        let source = |kind: &str, name: &str| -> Result<BTreeMap<String, Vec<u8>>> {
            let found = objects
                .iter()
                .chain(external)
                .find(|o| kind_name(o) == (kind.to_owned(), name.to_owned()))
                .with_context(|| {
                    format!("{kind} {name} is neither rendered by the chart nor given by the test")
                })?;
            keys_of(found)
        };

        // Volumes.
        let volumes: HashMap<&str, &Value> = at(pod, &["volumes"])
            .and_then(Value::as_sequence)
            .map(|vs| {
                vs.iter()
                    .filter_map(|v| str_at(v, &["name"]).map(|n| (n, v)))
                    .collect()
            })
            .unwrap_or_default();
        let mut mounts = Vec::new();
        for mount in at(spec, &["volumeMounts"])
            .and_then(Value::as_sequence)
            .into_iter()
            .flatten()
        {
            let name = str_at(mount, &["name"]).context("volumeMount without name")?;
            let path = str_at(mount, &["mountPath"]).context("volumeMount without mountPath")?;
            ensure!(path.starts_with('/'), "mountPath {path} is not absolute");
            let host = root.join(path.trim_start_matches('/'));
            let volume = volumes
                .get(name)
                .with_context(|| format!("volumeMount {name} names no volume"))?;
            let sub_path = str_at(mount, &["subPath"]);
            let files = if let Some(secret) = at(volume, &["secret"]) {
                let name =
                    str_at(secret, &["secretName"]).context("secret volume without secretName")?;
                Some((source("Secret", name)?, secret))
            } else if let Some(config_map) = at(volume, &["configMap"]) {
                let name =
                    str_at(config_map, &["name"]).context("configMap volume without name")?;
                Some((source("ConfigMap", name)?, config_map))
            } else if at(volume, &["emptyDir"]).is_some()
                || at(volume, &["persistentVolumeClaim"]).is_some()
            {
                ensure!(
                    sub_path.is_none(),
                    "subPath on a directory volume is not supported here"
                );
                std::fs::create_dir_all(&host)?;
                None
            } else {
                bail!(
                    "volume {name}: only secret, configMap, emptyDir and persistentVolumeClaim are supported"
                );
            };
            if let Some((keys, spec)) = files {
                // items (key → path) when given, else every key under its own name.
                let items: Vec<(String, String)> =
                    match at(spec, &["items"]).and_then(Value::as_sequence) {
                        Some(items) => items
                            .iter()
                            .map(|i| {
                                Ok((
                                    str_at(i, &["key"]).context("item without key")?.to_owned(),
                                    str_at(i, &["path"])
                                        .context("item without path")?
                                        .to_owned(),
                                ))
                            })
                            .collect::<Result<_>>()?,
                        None => keys.keys().map(|k| (k.clone(), k.clone())).collect(),
                    };
                let mut written = HashMap::new();
                for (key, file) in items {
                    let bytes = keys
                        .get(&key)
                        .with_context(|| format!("volume {name} has no key {key}"))?;
                    written.insert(file, bytes.clone());
                }
                match sub_path {
                    Some(sub) => {
                        let bytes = written.get(sub).with_context(|| {
                            format!("volume {name} has no file {sub} (subPath)")
                        })?;
                        if let Some(parent) = host.parent() {
                            std::fs::create_dir_all(parent)?;
                        }
                        std::fs::write(&host, bytes)?;
                    }
                    None => {
                        std::fs::create_dir_all(&host)?;
                        for (file, bytes) in written {
                            std::fs::write(host.join(file), bytes)?;
                        }
                    }
                }
            }
            mounts.push(path.to_owned());
        }
        // Longest mount first, so that a file mounted inside a mounted dir maps to its own place (same here).
        mounts.sort_by_key(|m| std::cmp::Reverse(m.len()));

        // Env, in order; $(VAR) refers to earlier entries, as the kubelet expands it.
        let mut env: Vec<(String, String)> = Vec::new();
        for entry in at(spec, &["env"])
            .and_then(Value::as_sequence)
            .into_iter()
            .flatten()
        {
            let name = str_at(entry, &["name"])
                .context("env without name")?
                .to_owned();
            let value = if let Some(value) = str_at(entry, &["value"]) {
                expand(value, &env)
            } else if let Some(from) = at(entry, &["valueFrom"]) {
                if let Some(path) = str_at(from, &["fieldRef", "fieldPath"]) {
                    match path {
                        "metadata.namespace" => NAMESPACE.to_owned(),
                        "metadata.name" => format!("{deployment}-0"),
                        other => bail!("env {name}: fieldRef {other} is not supported here"),
                    }
                } else if let Some(r) = at(from, &["secretKeyRef"]) {
                    let keys = source(
                        "Secret",
                        str_at(r, &["name"]).context("secretKeyRef without name")?,
                    )?;
                    let key = str_at(r, &["key"]).context("secretKeyRef without key")?;
                    String::from_utf8(
                        keys.get(key)
                            .with_context(|| format!("env {name}: no key {key}"))?
                            .clone(),
                    )?
                } else if let Some(r) = at(from, &["configMapKeyRef"]) {
                    let keys = source(
                        "ConfigMap",
                        str_at(r, &["name"]).context("configMapKeyRef without name")?,
                    )?;
                    let key = str_at(r, &["key"]).context("configMapKeyRef without key")?;
                    String::from_utf8(
                        keys.get(key)
                            .with_context(|| format!("env {name}: no key {key}"))?
                            .clone(),
                    )?
                } else if let Some(r) = at(from, &["resourceFieldRef"]) {
                    resource_field(spec, container, r).with_context(|| format!("env {name}"))?
                } else {
                    bail!("env {name}: unsupported valueFrom");
                }
            } else {
                String::new()
            };
            env.push((name, value));
        }

        let command: Vec<&str> = at(spec, &["command"])
            .and_then(Value::as_sequence)
            .context("the container sets no command")?
            .iter()
            .map(|c| c.as_str().context("non-string command"))
            .collect::<Result<_>>()?;
        ensure!(
            command.len() == 1,
            "expected the command to be just the binary: {command:?}"
        );

        let mut ports = HashMap::new();
        let mut args = Vec::new();
        for arg in at(spec, &["args"])
            .and_then(Value::as_sequence)
            .into_iter()
            .flatten()
        {
            let arg = expand(arg.as_str().context("non-string arg")?, &env);
            let (flag, value) = match arg.split_once('=') {
                Some((flag, value)) if flag.starts_with("--") => {
                    (Some(flag.to_owned()), value.to_owned())
                }
                _ => (None, arg.clone()),
            };
            let value = if let Ok(addr) = value.parse::<SocketAddr>()
                && addr.ip().is_unspecified()
            {
                let port = free_port()?;
                ports.insert(addr.port(), port);
                format!("127.0.0.1:{port}")
            } else if value.starts_with('/') {
                match mounts
                    .iter()
                    .find(|m| value == **m || value.starts_with(&format!("{m}/")))
                {
                    Some(_) => root
                        .join(value.trim_start_matches('/'))
                        .display()
                        .to_string(),
                    None => value,
                }
            } else {
                value
            };
            args.push(match flag {
                Some(flag) => format!("{flag}={value}"),
                None => value,
            });
        }

        let port_names = at(spec, &["ports"])
            .and_then(Value::as_sequence)
            .into_iter()
            .flatten()
            .filter_map(|p| {
                let name = str_at(p, &["name"])?.to_owned();
                let port = u16::try_from(at(p, &["containerPort"])?.as_u64()?).ok()?;
                Some((name, port))
            })
            .collect();

        Ok(PodProcess {
            image_program: command[0].to_owned(),
            args,
            env,
            ports,
            port_names,
            container: spec.clone(),
            root: root.to_path_buf(),
            mounts,
        })
    }

    /// The command to run `binary` (the image's `command[0]`, built by cargo) as the pod would: only the pod's
    /// env (plus `extra_env`), working dir and mounts under `root`, output to `root/NAME.log`.
    pub fn command(
        &self,
        binary: &Path,
        extra_env: &[(&str, &str)],
        log_name: &str,
    ) -> Result<tokio::process::Command> {
        let workdir = self.root.join("home/nonroot");
        std::fs::create_dir_all(&workdir)?;
        let log = std::fs::File::create(self.root.join(format!("{log_name}.log")))?;
        let mut cmd = tokio::process::Command::new(binary);
        cmd.args(&self.args)
            .env_clear()
            .envs(self.env.iter().map(|(k, v)| (k.as_str(), v.as_str())))
            .envs(extra_env.iter().copied())
            .current_dir(workdir)
            .stdin(Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log)
            .kill_on_drop(true);
        Ok(cmd)
    }

    /// What a process run with [`PodProcess::command`] and `log_name` wrote.
    pub fn log(&self, log_name: &str) -> String {
        std::fs::read_to_string(self.root.join(format!("{log_name}.log"))).unwrap_or_default()
    }

    /// A probe's `httpGet`: path, loopback port (remapped), and whether it is HTTPS.
    pub fn http_probe(&self, probe: &str) -> Result<(String, u16, bool)> {
        let get = at(&self.container, &[probe, "httpGet"])
            .with_context(|| format!("no {probe}.httpGet"))?;
        let path = str_at(get, &["path"])
            .context("probe without path")?
            .to_owned();
        let port = match at(get, &["port"]).context("probe without port")? {
            Value::String(name) => *self
                .port_names
                .get(name)
                .with_context(|| format!("probe port {name} names no container port"))?,
            other => u16::try_from(other.as_u64().context("bad probe port")?)?,
        };
        let local = *self.ports.get(&port).with_context(|| {
            format!(
                "probe port {port} is not a port the process listens on (args: {:?})",
                self.args
            )
        })?;
        let https = str_at(get, &["scheme"]) == Some("HTTPS");
        Ok((path, local, https))
    }
}

/// `$(VAR)` → the value of an earlier env entry (unknown references stay as written, as the kubelet leaves them).
fn expand(text: &str, env: &[(String, String)]) -> String {
    let mut out = text.to_owned();
    for (name, value) in env.iter().rev() {
        out = out.replace(&format!("$({name})"), value);
    }
    out
}

/// One HTTP/1.1 GET to 127.0.0.1:`port` (over TLS with `tls` and SNI `host` when given): status and body.
pub async fn http_get(
    port: u16,
    host: &str,
    path: &str,
    tls: Option<Arc<rustls::ClientConfig>>,
    bearer: Option<&str>,
) -> Result<(u16, String)> {
    let tcp = tokio::net::TcpStream::connect((Ipv4Addr::LOCALHOST, port)).await?;
    let auth = bearer
        .map(|t| format!("Authorization: Bearer {t}\r\n"))
        .unwrap_or_default();
    let request = format!("GET {path} HTTP/1.1\r\nHost: {host}\r\n{auth}Connection: close\r\n\r\n");
    let mut response = Vec::new();
    match tls {
        Some(config) => {
            let name = rustls::pki_types::ServerName::try_from(host.to_owned())?;
            let mut stream = tokio_rustls::TlsConnector::from(config)
                .connect(name, tcp)
                .await?;
            stream.write_all(request.as_bytes()).await?;
            // A server closing without close_notify still gave us the whole response for Connection: close.
            let _ = stream.read_to_end(&mut response).await;
        }
        None => {
            let mut tcp = tcp;
            tcp.write_all(request.as_bytes()).await?;
            tcp.read_to_end(&mut response).await?;
        }
    }
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

/// Polls `check` every 100 ms until it returns `Some`, `child` exits (an error with its log) or `deadline` passes.
pub async fn wait_until<T, F, Fut>(
    child: &mut tokio::process::Child,
    log: impl Fn() -> String,
    deadline: Duration,
    what: &str,
    mut check: F,
) -> Result<T>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Option<T>>,
{
    let give_up = tokio::time::Instant::now() + deadline;
    loop {
        if let Some(status) = child.try_wait()? {
            bail!("the process exited ({status}) before {what}:\n{}", log());
        }
        if let Some(value) = check().await {
            return Ok(value);
        }
        if tokio::time::Instant::now() >= give_up {
            bail!("no {what} within {deadline:?}:\n{}", log());
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// A `resourceFieldRef`'s value as the kubelet gives it to `container`: its rendered `requests.cpu` or
/// `limits.cpu` divided by the divisor (default 1) and rounded up; an unset request is 0. (An unset limit is the
/// node's allocatable CPUs, which a test has no node for: refused, as are the other resources.)
fn resource_field(spec: &Value, container: &str, r: &Value) -> Result<String> {
    if let Some(name) = str_at(r, &["containerName"]) {
        ensure!(
            name == container,
            "resourceFieldRef of container {name}, not {container}"
        );
    }
    let resource = str_at(r, &["resource"]).context("resourceFieldRef without resource")?;
    let kind = match resource {
        "requests.cpu" => "requests",
        "limits.cpu" => "limits",
        other => bail!("resourceFieldRef {other} is not supported here"),
    };
    let divisor = match at(r, &["divisor"]) {
        Some(d) => millicores(d)?,
        None => 1000,
    };
    ensure!(divisor > 0, "resourceFieldRef divisor 0");
    let milli = match at(spec, &["resources", kind, "cpu"]) {
        Some(q) => millicores(q)?,
        None if kind == "requests" => 0,
        None => bail!("limits.cpu is not set: the kubelet would give the node's CPUs"),
    };
    Ok(milli.div_ceil(divisor).to_string())
}

/// A CPU quantity (`100m`, `1`, `1.5`, or a YAML number) in millicores, rounded up.
fn millicores(q: &Value) -> Result<u64> {
    let text = match q {
        Value::String(s) => s.clone(),
        Value::Number(n) => n.to_string(),
        other => bail!("CPU quantity {other:?}"),
    };
    if let Some(m) = text.strip_suffix('m') {
        return m.parse().with_context(|| format!("CPU quantity {text}"));
    }
    let cores: f64 = text
        .parse()
        .with_context(|| format!("CPU quantity {text}"))?;
    ensure!(cores.is_finite() && cores >= 0.0, "CPU quantity {text}");
    Ok((cores * 1000.0).ceil() as u64)
}

/// The final stage's `ENTRYPOINT` of `deploy/docker/BIN.Dockerfile`, its `USER`, its base and the
/// `cargo build … --bin X` of its build stage.
pub fn dockerfile(bin: &str) -> Result<(Vec<String>, String, String, String)> {
    let path = repo_root()
        .join("deploy/docker")
        .join(format!("{bin}.Dockerfile"));
    let text = std::fs::read_to_string(&path)
        .with_context(|| format!("cannot read {}", path.display()))?;
    let mut entrypoint = None;
    let mut user = None;
    let mut base = None;
    let mut built = None;
    for line in text.lines().map(str::trim) {
        if let Some(rest) = line.strip_prefix("FROM ") {
            base = Some(rest.to_owned());
        } else if let Some(rest) = line.strip_prefix("ENTRYPOINT ") {
            entrypoint = Some(serde_json::from_str::<Vec<String>>(rest)?);
        } else if let Some(rest) = line.strip_prefix("USER ") {
            user = Some(rest.to_owned());
        }
        if let Some(at) = line.find("--bin ") {
            built = line[at + 6..].split_whitespace().next().map(str::to_owned);
        }
    }
    Ok((
        entrypoint.context("no ENTRYPOINT")?,
        user.context("no USER")?,
        base.context("no FROM")?,
        built.context("no cargo build --bin")?,
    ))
}

/// The value of `key` in the rendered Secret or ConfigMap `name`.
pub fn key_of(objects: &[Value], kind: &str, name: &str, key: &str) -> Result<String> {
    let keys = keys_of(object(objects, kind, name)?)?;
    Ok(String::from_utf8(
        keys.get(key)
            .with_context(|| format!("{kind} {name} has no key {key}"))?
            .clone(),
    )?)
}

/// The env var names container `container` of Deployment `deployment` sets.
pub fn env_names(objects: &[Value], deployment: &str, container: &str) -> Result<Vec<String>> {
    let deploy = object(objects, "Deployment", deployment)?;
    let spec = at(deploy, &["spec", "template", "spec", "containers"])
        .and_then(Value::as_sequence)
        .and_then(|cs| cs.iter().find(|c| str_at(c, &["name"]) == Some(container)))
        .with_context(|| format!("no container {container} in Deployment {deployment}"))?;
    Ok(at(spec, &["env"])
        .and_then(Value::as_sequence)
        .into_iter()
        .flatten()
        .filter_map(|e| str_at(e, &["name"]).map(str::to_owned))
        .collect())
}

/// Fails unless every `TETHER_*` variable in `names` is one `binary` reads (its `--help` lists `[env: NAME]`):
/// clap ignores unknown variables, so a renamed one would otherwise be dropped without a word.
pub fn check_env_names(binary: &Path, names: &[String]) -> Result<()> {
    let help = run(Command::new(binary).arg("--help"))?;
    for name in names.iter().filter(|n| n.starts_with("TETHER_")) {
        ensure!(
            help.contains(&format!("[env: {name}]")) || help.contains(&format!("[env: {name}=")),
            "{} does not read {name} (not in its --help)",
            binary.display()
        );
    }
    Ok(())
}
