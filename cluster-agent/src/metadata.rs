//! Cluster metadata (the role of Arc's metadata operator): Kubernetes version, node count, total CPU and
//! memory capacity, distribution and infrastructure, read with the agent's own kube credentials.
//!
//! Nodes are followed with a watch ([`kube::runtime::watcher`]), not by polling: one LIST, then a WATCH the
//! apiserver keeps open; the version (`GET /version`) is read at start, after every re-list and every
//! [`VERSION_REFRESH`]. Changes are debounced ([`DEBOUNCE`]) and published on a [`watch`] channel only when
//! the summary actually changed, so a node's status updates (every few seconds on a real cluster) cost
//! nothing on the tunnel.
//!
//! The classifiers ([`distribution`], [`infrastructure`]) and [`parse_quantity`] are pure functions.

use std::collections::{BTreeMap, HashMap};
use std::time::Duration;

use futures_util::StreamExt as _;
use k8s_openapi::api::core::v1::Node;
use kube::runtime::WatchStreamExt as _;
use kube::runtime::watcher;
use tether_api::control::Metadata;
use tokio::sync::watch;

/// Quiet time after a node event before the summary is recomputed.
pub const DEBOUNCE: Duration = Duration::from_secs(1);
/// How often the apiserver version is read again without a re-list.
pub const VERSION_REFRESH: Duration = Duration::from_secs(600);

/// What the classifiers and totals need from one node.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct NodeFacts {
    /// `metadata.name`.
    pub name: String,
    /// `metadata.labels`.
    pub labels: BTreeMap<String, String>,
    /// `spec.providerID`.
    pub provider_id: Option<String>,
    /// `status.nodeInfo.kubeletVersion`.
    pub kubelet_version: String,
    /// `status.nodeInfo.osImage`.
    pub os_image: String,
    /// `status.capacity["cpu"]` in millicores (0 when absent or unreadable).
    pub cpu_millis: u64,
    /// `status.capacity["memory"]` in bytes (0 when absent or unreadable).
    pub memory_bytes: u64,
}

impl NodeFacts {
    /// Extracts the facts from a Node object.
    pub fn from_node(node: &Node) -> Self {
        let capacity = node.status.as_ref().and_then(|s| s.capacity.as_ref());
        let quantity = |name: &str| {
            capacity
                .and_then(|c| c.get(name))
                .and_then(|q| parse_quantity(&q.0))
        };
        let info = node.status.as_ref().and_then(|s| s.node_info.as_ref());
        Self {
            name: node.metadata.name.clone().unwrap_or_default(),
            labels: node.metadata.labels.clone().unwrap_or_default(),
            provider_id: node.spec.as_ref().and_then(|s| s.provider_id.clone()),
            kubelet_version: info.map(|i| i.kubelet_version.clone()).unwrap_or_default(),
            os_image: info.map(|i| i.os_image.clone()).unwrap_or_default(),
            cpu_millis: quantity("cpu").map_or(0, |q| q.ceil_scaled(3)),
            memory_bytes: quantity("memory").map_or(0, |q| q.ceil_scaled(0)),
        }
    }
}

/// The summary pushed to the relay, from the version and the nodes.
pub fn summarize(kubernetes_version: &str, nodes: &[NodeFacts]) -> Metadata {
    Metadata {
        kubernetes_version: kubernetes_version.to_owned(),
        node_count: nodes.len() as u64,
        total_cpu_millis: nodes
            .iter()
            .map(|n| n.cpu_millis)
            .fold(0, u64::saturating_add),
        total_memory_bytes: nodes
            .iter()
            .map(|n| n.memory_bytes)
            .fold(0, u64::saturating_add),
        distribution: distribution(kubernetes_version, nodes).to_owned(),
        infrastructure: infrastructure(nodes).to_owned(),
        agent_version: env!("CARGO_PKG_VERSION").to_owned(),
    }
}

/// A Kubernetes resource quantity (`"4"`, `"500m"`, `"8Gi"`, `"16384Ki"`, `"1.5"`, `"1e3"`, …), exactly:
/// `digits × 10^exp10 × 1024^exp1024`. Negative quantities are not represented (capacities never are).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Quantity {
    digits: u128,
    exp10: i32,
    exp1024: u32,
}

/// Parses a quantity in the Kubernetes syntax; `None` when it is malformed or negative.
pub fn parse_quantity(text: &str) -> Option<Quantity> {
    let text = text.trim();
    let unsigned = text.strip_prefix('+').unwrap_or(text);
    if unsigned.starts_with('-') {
        return None;
    }
    let number_end = unsigned
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(unsigned.len());
    let (number, suffix) = unsigned.split_at(number_end);
    let (whole, fraction) = number.split_once('.').unwrap_or((number, ""));
    if whole.is_empty() && fraction.is_empty() || fraction.contains('.') {
        return None;
    }
    let mut digits: u128 = 0;
    let mut exp10: i32 = 0;
    for (i, c) in whole.chars().chain(fraction.chars()).enumerate() {
        let d = u128::from(c.to_digit(10)?);
        match digits.checked_mul(10).and_then(|v| v.checked_add(d)) {
            Some(v) => digits = v,
            // Past u128's precision: drop the digit, scale instead (only ever rounds down the tail).
            None if i < whole.len() => exp10 = exp10.checked_add(1)?,
            None => continue,
        }
        if i >= whole.len() {
            exp10 = exp10.checked_sub(1)?;
        }
    }
    let (more10, exp1024) = match suffix {
        "" => (0, 0),
        "n" => (-9, 0),
        "u" => (-6, 0),
        "m" => (-3, 0),
        "k" => (3, 0),
        "M" => (6, 0),
        "G" => (9, 0),
        "T" => (12, 0),
        "P" => (15, 0),
        "E" => (18, 0),
        "Ki" => (0, 1),
        "Mi" => (0, 2),
        "Gi" => (0, 3),
        "Ti" => (0, 4),
        "Pi" => (0, 5),
        "Ei" => (0, 6),
        s if s.starts_with(['e', 'E']) => {
            let exp = &s[1..];
            let body = exp.strip_prefix(['+', '-']).unwrap_or(exp);
            if body.is_empty() || !body.chars().all(|c| c.is_ascii_digit()) {
                return None;
            }
            (exp.parse::<i32>().ok()?, 0)
        }
        _ => return None,
    };
    Some(Quantity {
        digits,
        exp10: exp10.checked_add(more10)?,
        exp1024,
    })
}

impl Quantity {
    /// The value times `10^scale`, rounded up to an integer (as Kubernetes rounds), saturating at `u64::MAX`.
    /// `ceil_scaled(3)` gives millicores, `ceil_scaled(0)` bytes.
    pub fn ceil_scaled(&self, scale: i32) -> u64 {
        let mut value = self.digits;
        for _ in 0..self.exp1024 {
            value = match value.checked_mul(1024) {
                Some(v) => v,
                None => return u64::MAX,
            };
        }
        let exp = self.exp10.saturating_add(scale);
        let value = if exp >= 0 {
            let mut v = value;
            for _ in 0..exp {
                v = match v.checked_mul(10) {
                    Some(v) => v,
                    None => return u64::MAX,
                };
                if v == 0 {
                    break;
                }
            }
            v
        } else {
            let divisor_exp = exp.unsigned_abs();
            if divisor_exp > 38 {
                u128::from(value > 0)
            } else {
                let divisor = 10u128.pow(divisor_exp);
                value.div_ceil(divisor)
            }
        };
        u64::try_from(value).unwrap_or(u64::MAX)
    }
}

/// Node labels that give the distribution away: (key prefix, required value, distribution). With a required
/// value, the key must equal the prefix.
const LABEL_RULES: &[(&str, Option<&str>, &str)] = &[
    ("node.openshift.io/", None, "openshift"),
    ("machineconfiguration.openshift.io/", None, "openshift"),
    ("eks.amazonaws.com/", None, "eks"),
    ("cloud.google.com/gke-", None, "gke"),
    ("kubernetes.azure.com/", None, "aks"),
    ("minikube.k8s.io/", None, "minikube"),
    ("microk8s.io/", None, "microk8s"),
    ("k3s.io/", None, "k3s"),
    ("node.kubernetes.io/instance-type", Some("k3s"), "k3s"),
    ("rke2.io/", None, "rke2"),
    ("node.k0sproject.io/", None, "k0s"),
    ("doks.digitalocean.com/", None, "doks"),
    ("oci.oraclecloud.com/", None, "oke"),
    ("ibm-cloud.kubernetes.io/", None, "iks"),
];

/// The Kubernetes distribution, from the apiserver's `gitVersion` and the nodes: `k3s`, `rke2`, `k0s`, `eks`,
/// `gke`, `aks`, `openshift`, `kind`, `minikube`, `microk8s`, `docker-desktop`, `talos`, `tanzu`, `doks`,
/// `oke`, `iks`, `ack`, … or `generic`.
pub fn distribution(git_version: &str, nodes: &[NodeFacts]) -> &'static str {
    let from_version = |v: &str| -> Option<&'static str> {
        let v = v.to_ascii_lowercase();
        [
            ("+k3s", "k3s"),
            ("+rke2", "rke2"),
            ("+k0s", "k0s"),
            ("-eks-", "eks"),
            ("-gke.", "gke"),
            ("+vmware", "tanzu"),
            ("-aliyun", "ack"),
            ("+iks", "iks"),
        ]
        .into_iter()
        .find(|(marker, _)| v.contains(marker))
        .map(|(_, name)| name)
    };
    if let Some(name) = from_version(git_version) {
        return name;
    }
    let matches =
        |(key, value): (&String, &String), (prefix, wanted): (&str, Option<&str>)| match wanted {
            Some(wanted) => key == prefix && value == wanted,
            None => key.starts_with(prefix),
        };
    if let Some((_, _, name)) = LABEL_RULES.iter().find(|(prefix, wanted, _)| {
        nodes.iter().any(|n| {
            n.labels
                .iter()
                .any(|label| matches(label, (prefix, *wanted)))
        })
    }) {
        return name;
    }
    if let Some(name) = nodes.iter().find_map(|n| from_version(&n.kubelet_version)) {
        return name;
    }
    let any_provider = |scheme: &str| {
        nodes
            .iter()
            .any(|n| n.provider_id.as_deref().and_then(provider_scheme) == Some(scheme))
    };
    if any_provider("kind") {
        return "kind";
    }
    let any_os = |needle: &str| {
        nodes
            .iter()
            .any(|n| n.os_image.to_ascii_lowercase().contains(needle))
    };
    if any_os("coreos") && any_os("red hat") {
        return "openshift";
    }
    if any_os("talos") {
        return "talos";
    }
    if nodes.iter().any(|n| n.name == "docker-desktop") {
        return "docker-desktop";
    }
    if nodes.iter().any(|n| n.name == "minikube") {
        return "minikube";
    }
    "generic"
}

/// The infrastructure the nodes run on, from their `spec.providerID` schemes (`aws://`, `gce://`,
/// `azure://`, `vsphere://`, `openstack://`, `kind://` → `docker`, …): the most common one among the nodes
/// that say (ties broken by name). `generic` when nodes exist but none says, `unknown` without nodes.
pub fn infrastructure(nodes: &[NodeFacts]) -> &'static str {
    if nodes.is_empty() {
        return "unknown";
    }
    let mut votes: BTreeMap<&'static str, usize> = BTreeMap::new();
    for node in nodes {
        let Some(scheme) = node.provider_id.as_deref().and_then(provider_scheme) else {
            continue;
        };
        let infra = match scheme {
            "aws" => "aws",
            "gce" => "gcp",
            "azure" => "azure",
            "vsphere" => "vsphere",
            "openstack" => "openstack",
            "kind" => "docker",
            "ibm" => "ibm",
            "alicloud" => "alibaba",
            "digitalocean" => "digitalocean",
            "linode" => "linode",
            "hcloud" => "hetzner",
            "oci" => "oracle",
            "equinixmetal" | "packet" => "equinix",
            "ovirt" => "ovirt",
            "kubevirt" => "kubevirt",
            "cloudstack" => "cloudstack",
            "exoscale" => "exoscale",
            "scaleway" => "scaleway",
            "vultr" => "vultr",
            "proxmox" => "proxmox",
            // k3s and rke2 write their own "k3s://host" IDs: they say nothing about the infrastructure.
            _ => continue,
        };
        *votes.entry(infra).or_default() += 1;
    }
    votes
        .into_iter()
        // max_by_key keeps the last maximum; iterate names in reverse so the first name wins ties.
        .rev()
        .max_by_key(|(_, count)| *count)
        .map_or("generic", |(infra, _)| infra)
}

/// `aws` from `aws:///eu-west-1a/i-0123`, lowercase.
fn provider_scheme(provider_id: &str) -> Option<&str> {
    provider_id
        .split_once("://")
        .map(|(scheme, _)| scheme)
        .filter(|s| !s.is_empty())
}

/// Starts following the cluster; the receiver holds `None` until the first complete picture (or the first
/// failure to list nodes, after which what is known, the version at least, is published). Following stops when
/// the receiver (and its clones) are dropped.
///
/// Node lists are parsed in the task that reads them, and a large cluster's (re-)list is tens of megabytes of
/// JSON (a Node lists its images): on the agent's one-worker runtime that would hold up every request on the
/// tunnel for as long. So the nodes are followed on a thread of their own, with a runtime of its own; `client`'s
/// connections stay on the caller's runtime, which must outlive the receiver.
///
/// # Errors
/// When the thread or its runtime cannot be started.
pub fn spawn(client: kube::Client) -> std::io::Result<watch::Receiver<Option<Metadata>>> {
    let (tx, rx) = watch::channel(None);
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    std::thread::Builder::new()
        .name("tether-metadata".to_owned())
        .spawn(move || runtime.block_on(follow(client, tx)))?;
    Ok(rx)
}

async fn follow(client: kube::Client, tx: watch::Sender<Option<Metadata>>) {
    let api: kube::Api<Node> = kube::Api::all(client.clone());
    let mut events = watcher(api, watcher::Config::default())
        .default_backoff()
        .boxed();
    let mut nodes: HashMap<String, NodeFacts> = HashMap::new();
    let mut relisting: Option<HashMap<String, NodeFacts>> = None;
    let mut version: Option<String> = None;
    let mut version_failed = false;
    let mut watch_failed = false;
    // Publishing waits for the first list (or its failure).
    let mut listed = false;
    let mut dirty = true;
    let mut publish_at: Option<tokio::time::Instant> = None;
    let mut refresh_version = tokio::time::interval(VERSION_REFRESH);
    refresh_version.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);

    loop {
        tokio::select! {
            _ = tx.closed() => return,
            _ = refresh_version.tick() => {
                refresh(&client, &mut version, &mut version_failed).await;
                dirty = true;
                publish_at.get_or_insert_with(|| tokio::time::Instant::now() + DEBOUNCE);
            }
            event = events.next() => {
                match event {
                    None => return,
                    Some(Ok(event)) => {
                        if watch_failed {
                            tracing::info!("watching nodes again");
                            watch_failed = false;
                        }
                        match event {
                            watcher::Event::Init => relisting = Some(HashMap::new()),
                            watcher::Event::InitApply(node) => {
                                let facts = NodeFacts::from_node(&node);
                                relisting.get_or_insert_with(HashMap::new).insert(facts.name.clone(), facts);
                            }
                            watcher::Event::InitDone => {
                                nodes = relisting.take().unwrap_or_default();
                                listed = true;
                                // A re-list may follow an apiserver upgrade.
                                refresh(&client, &mut version, &mut version_failed).await;
                            }
                            watcher::Event::Apply(node) => {
                                let facts = NodeFacts::from_node(&node);
                                nodes.insert(facts.name.clone(), facts);
                            }
                            watcher::Event::Delete(node) => {
                                nodes.remove(node.metadata.name.as_deref().unwrap_or_default());
                            }
                        }
                    }
                    Some(Err(e)) => {
                        if !watch_failed {
                            tracing::warn!(error = %e, "cannot watch nodes (metadata will lack node facts until this works); retrying");
                            watch_failed = true;
                        }
                        listed = true;
                    }
                }
                dirty = true;
                publish_at.get_or_insert_with(|| tokio::time::Instant::now() + DEBOUNCE);
            }
            () = sleep_until(publish_at) => {
                publish_at = None;
                if dirty && listed {
                    dirty = false;
                    if version.is_none() {
                        refresh(&client, &mut version, &mut version_failed).await;
                    }
                    let mut facts: Vec<NodeFacts> = nodes.values().cloned().collect();
                    facts.sort_by(|a, b| a.name.cmp(&b.name));
                    let summary = summarize(version.as_deref().unwrap_or_default(), &facts);
                    tx.send_if_modified(|current| {
                        if current.as_ref() == Some(&summary) {
                            return false;
                        }
                        tracing::info!(
                            kubernetes_version = %summary.kubernetes_version,
                            nodes = summary.node_count,
                            cpu_millis = summary.total_cpu_millis,
                            memory_bytes = summary.total_memory_bytes,
                            distribution = %summary.distribution,
                            infrastructure = %summary.infrastructure,
                            "cluster metadata"
                        );
                        *current = Some(summary);
                        true
                    });
                }
            }
        }
    }
}

async fn sleep_until(deadline: Option<tokio::time::Instant>) {
    match deadline {
        Some(at) => tokio::time::sleep_until(at).await,
        None => std::future::pending().await,
    }
}

async fn refresh(client: &kube::Client, version: &mut Option<String>, failed: &mut bool) {
    match client.apiserver_version().await {
        Ok(info) => {
            *version = Some(info.git_version);
            *failed = false;
        }
        Err(e) => {
            if !*failed {
                tracing::warn!(error = %e, "cannot read the apiserver version; retrying later");
                *failed = true;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn q(text: &str) -> Option<(u64, u64)> {
        parse_quantity(text).map(|q| (q.ceil_scaled(0), q.ceil_scaled(3)))
    }

    #[test]
    fn quantities() {
        // (value rounded up, value in thousandths rounded up)
        assert_eq!(q("4"), Some((4, 4000)));
        assert_eq!(q("500m"), Some((1, 500)));
        assert_eq!(q("1500m"), Some((2, 1500)));
        assert_eq!(q("0.5"), Some((1, 500)));
        assert_eq!(q(".5"), Some((1, 500)));
        assert_eq!(q("2."), Some((2, 2000)));
        assert_eq!(q("+3"), Some((3, 3000)));
        assert_eq!(q("0"), Some((0, 0)));
        assert_eq!(q("8Gi"), Some((8 << 30, (8 << 30) * 1000)));
        assert_eq!(q("16384Ki"), Some((16 << 20, (16 << 20) * 1000)));
        assert_eq!(q("1.5Gi"), Some((1_610_612_736, 1_610_612_736_000)));
        assert_eq!(q("1Mi"), Some((1 << 20, (1 << 20) * 1000)));
        assert_eq!(q("3Ti"), Some((3 << 40, (3 << 40) * 1000)));
        assert_eq!(q("2k"), Some((2000, 2_000_000)));
        assert_eq!(q("1M"), Some((1_000_000, 1_000_000_000)));
        assert_eq!(q("128G"), Some((128_000_000_000, 128_000_000_000_000)));
        assert_eq!(q("1e3"), Some((1000, 1_000_000)));
        assert_eq!(q("1E3"), Some((1000, 1_000_000)));
        assert_eq!(q("15e-1"), Some((2, 1500)));
        assert_eq!(q("1E"), Some((1_000_000_000_000_000_000, u64::MAX)));
        assert_eq!(q("100n"), Some((1, 1)));
        assert_eq!(q("250u"), Some((1, 1)));
        assert_eq!(q("7Ei"), Some((7 << 60, u64::MAX)));
        assert_eq!(q("16Ei"), Some((u64::MAX, u64::MAX)));
        assert_eq!(
            q("0.000000000000000000000000000000000000000001"),
            Some((1, 1))
        );
        assert_eq!(q(" 2 "), Some((2, 2000)));
        // 40 digits: beyond u128's exact range the tail is dropped, the magnitude kept.
        assert_eq!(
            q("1234567890123456789012345678901234567890"),
            Some((u64::MAX, u64::MAX))
        );
        for bad in [
            "", "-1", "abc", "1x", "Gi", "1.2.3", ".", "1e", "1e+", "1ee3", "1Ki2", "1 Gi", "1KI",
            "1e3.5",
        ] {
            assert_eq!(parse_quantity(bad), None, "{bad:?}");
        }
    }

    fn node(name: &str, labels: &[(&str, &str)], provider: Option<&str>) -> NodeFacts {
        NodeFacts {
            name: name.to_owned(),
            labels: labels
                .iter()
                .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
                .collect(),
            provider_id: provider.map(str::to_owned),
            ..NodeFacts::default()
        }
    }

    #[test]
    fn distributions_from_versions() {
        let none: &[NodeFacts] = &[];
        for (version, expected) in [
            ("v1.33.1+k3s1", "k3s"),
            ("v1.28.10+rke2r1", "rke2"),
            ("v1.29.2+k0s", "k0s"),
            ("v1.28.3-eks-4f4795d", "eks"),
            ("v1.27.3-gke.100", "gke"),
            ("v1.26.5+vmware.2", "tanzu"),
            ("v1.30.1-aliyun.1", "ack"),
            ("v1.29.4+IKS", "iks"),
            ("v1.33.1", "generic"),
            ("", "generic"),
        ] {
            assert_eq!(distribution(version, none), expected, "{version}");
        }
    }

    #[test]
    fn distributions_from_nodes() {
        let cases: Vec<(NodeFacts, &str)> = vec![
            (
                node("n", &[("node.openshift.io/os_id", "rhcos")], None),
                "openshift",
            ),
            (
                node(
                    "n",
                    &[("eks.amazonaws.com/nodegroup", "ng-1")],
                    Some("aws:///eu-west-1a/i-1"),
                ),
                "eks",
            ),
            (
                node(
                    "n",
                    &[("cloud.google.com/gke-nodepool", "default-pool")],
                    Some("gce://p/europe-west1-b/n"),
                ),
                "gke",
            ),
            (
                node(
                    "aks-nodepool1-1",
                    &[("kubernetes.azure.com/cluster", "MC_rg")],
                    Some("azure:///subscriptions/x"),
                ),
                "aks",
            ),
            (
                node("minikube", &[("minikube.k8s.io/name", "minikube")], None),
                "minikube",
            ),
            (
                node("m", &[("microk8s.io/cluster", "true")], None),
                "microk8s",
            ),
            (
                node(
                    "k",
                    &[("node.kubernetes.io/instance-type", "k3s")],
                    Some("k3s://k"),
                ),
                "k3s",
            ),
            (node("r", &[("rke2.io/hostname", "r")], None), "rke2"),
            (
                node(
                    "d",
                    &[("doks.digitalocean.com/node-pool", "p")],
                    Some("digitalocean://1"),
                ),
                "doks",
            ),
            (
                node(
                    "kind-control-plane",
                    &[("kubernetes.io/hostname", "kind-control-plane")],
                    Some("kind://docker/kind/kind-control-plane"),
                ),
                "kind",
            ),
            (node("docker-desktop", &[], None), "docker-desktop"),
            (node("minikube", &[], None), "minikube"),
            (
                node(
                    "plain",
                    &[("kubernetes.io/os", "linux")],
                    Some("vsphere://4201"),
                ),
                "generic",
            ),
        ];
        for (n, expected) in cases {
            assert_eq!(
                distribution("v1.33.1", std::slice::from_ref(&n)),
                expected,
                "{n:?}"
            );
        }
        // The kubelet's version when the apiserver's says nothing.
        let mut k = node("x", &[], None);
        k.kubelet_version = "v1.33.1+k3s1".into();
        assert_eq!(distribution("v1.33.1", &[k]), "k3s");
        // OS images.
        let mut o = node("x", &[], None);
        o.os_image = "Red Hat Enterprise Linux CoreOS 415.92".into();
        assert_eq!(distribution("v1.28.6+f67aeb3", &[o]), "openshift");
        let mut t = node("x", &[], None);
        t.os_image = "Talos (v1.7.0)".into();
        assert_eq!(distribution("v1.30.0", &[t]), "talos");
        // The version string wins over labels.
        let labelled = node("n", &[("kubernetes.azure.com/cluster", "x")], None);
        assert_eq!(distribution("v1.33.1+k3s1", &[labelled]), "k3s");
    }

    #[test]
    fn infrastructures() {
        assert_eq!(infrastructure(&[]), "unknown");
        assert_eq!(infrastructure(&[node("a", &[], None)]), "generic");
        assert_eq!(
            infrastructure(&[node("a", &[], Some("k3s://a"))]),
            "generic"
        );
        assert_eq!(
            infrastructure(&[node("a", &[], Some("not a provider id"))]),
            "generic"
        );
        for (id, expected) in [
            ("aws:///us-east-1a/i-0abc", "aws"),
            ("gce://project/zone/name", "gcp"),
            (
                "azure:///subscriptions/s/resourceGroups/r/providers/Microsoft.Compute/virtualMachines/v",
                "azure",
            ),
            ("vsphere://4201ff", "vsphere"),
            ("openstack:///9c1e", "openstack"),
            ("kind://docker/kind/kind-control-plane", "docker"),
            ("ibm://acct///cluster/worker", "ibm"),
            ("alicloud://cn-hangzhou.i-1", "alibaba"),
            ("digitalocean://12345", "digitalocean"),
            ("linode://123", "linode"),
            ("hcloud://123", "hetzner"),
            ("oci://ocid1.instance", "oracle"),
            ("equinixmetal://uuid", "equinix"),
            ("packet://uuid", "equinix"),
        ] {
            assert_eq!(
                infrastructure(&[node("a", &[], Some(id))]),
                expected,
                "{id}"
            );
        }
        // Majority among the nodes that say; ties by name; silent nodes do not vote.
        let mixed = [
            node("a", &[], Some("aws:///a")),
            node("b", &[], Some("vsphere://b")),
            node("c", &[], Some("vsphere://c")),
            node("d", &[], None),
        ];
        assert_eq!(infrastructure(&mixed), "vsphere");
        let tie = [
            node("a", &[], Some("vsphere://a")),
            node("b", &[], Some("aws:///b")),
        ];
        assert_eq!(infrastructure(&tie), "aws");
    }

    #[test]
    fn node_facts_and_summary() -> anyhow::Result<()> {
        let node: Node = serde_json::from_value(serde_json::json!({
            "metadata": {"name": "n1", "labels": {"k3s.io/hostname": "n1"}},
            "spec": {"providerID": "aws:///eu-west-1a/i-1"},
            "status": {
                "capacity": {"cpu": "4", "memory": "16384Ki", "pods": "110"},
                "nodeInfo": {"kubeletVersion": "v1.33.1+k3s1", "osImage": "Ubuntu", "architecture": "amd64",
                    "bootID": "", "containerRuntimeVersion": "", "kernelVersion": "", "kubeProxyVersion": "",
                    "machineID": "", "operatingSystem": "linux", "systemUUID": ""}
            }
        }))?;
        let facts = NodeFacts::from_node(&node);
        assert_eq!((facts.cpu_millis, facts.memory_bytes), (4000, 16 << 20));
        let mut other = facts.clone();
        other.name = "n2".into();
        other.cpu_millis = 500;
        other.memory_bytes = 0;
        let summary = summarize("v1.33.1+k3s1", &[facts, other]);
        assert_eq!(summary.node_count, 2);
        assert_eq!(summary.total_cpu_millis, 4500);
        assert_eq!(summary.total_memory_bytes, 16 << 20);
        assert_eq!(summary.distribution, "k3s");
        assert_eq!(summary.infrastructure, "aws");
        assert_eq!(summary.agent_version, env!("CARGO_PKG_VERSION"));
        // A node without status counts, with zero capacity.
        let bare: Node = serde_json::from_value(serde_json::json!({"metadata": {"name": "b"}}))?;
        let bare = NodeFacts::from_node(&bare);
        assert_eq!(
            (bare.cpu_millis, bare.memory_bytes, bare.provider_id),
            (0, 0, None)
        );
        Ok(())
    }

    /// Threads of this process named as the metadata thread.
    fn metadata_threads() -> usize {
        std::fs::read_dir("/proc/self/task").map_or(0, |tasks| {
            tasks
                .filter_map(Result::ok)
                .filter(|t| {
                    std::fs::read_to_string(t.path().join("comm"))
                        .is_ok_and(|name| name.trim() == "tether-metadata")
                })
                .count()
        })
    }

    /// The nodes are followed on a thread of their own, with the client's connections on the caller's runtime;
    /// the thread publishes the sample cluster's node and ends when the receiver is dropped, so agents started
    /// and stopped in one process leave no thread behind. (The only test of this binary that starts one.)
    #[tokio::test(flavor = "multi_thread", worker_threads = 1)]
    async fn the_metadata_thread_publishes_and_ends_with_its_receiver() -> anyhow::Result<()> {
        let dir = tempfile::tempdir()?;
        let api = tether_testkit::SampleApiserver::start(tether_testkit::SampleOptions::new(
            dir.path().join("api"),
        ))
        .await?;
        let config = kube::Config::from_custom_kubeconfig(
            kube::config::Kubeconfig::read_from(api.agent_kubeconfig_path())?,
            &kube::config::KubeConfigOptions::default(),
        )
        .await?;
        let before = metadata_threads();
        let mut rx = spawn(kube::Client::try_from(config)?)?;
        let published = tokio::time::timeout(
            Duration::from_secs(30),
            rx.wait_for(|m| m.as_ref().is_some_and(|m| m.node_count > 0)),
        )
        .await??
        .clone();
        assert_eq!(published.map(|m| m.node_count), Some(1));
        // Counted once it has published: a new thread names itself only when it starts running.
        assert_eq!(metadata_threads(), before + 1);
        drop(rx);
        let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
        while metadata_threads() > before {
            anyhow::ensure!(
                tokio::time::Instant::now() < deadline,
                "the metadata thread outlived its receiver by 30 s"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        Ok(())
    }
}
