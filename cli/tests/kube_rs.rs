//! kube-rs as a second, independent client through the relay.

mod common;

use std::time::Duration;

use common::Env;
use futures_util::{StreamExt, TryStreamExt};
use k8s_openapi::api::core::v1::{ConfigMap, Namespace, Pod};
use kube::api::{Api, AttachParams, ListParams, PostParams, WatchEvent, WatchParams};
use kube::config::{KubeConfigOptions, Kubeconfig};
use tokio::io::AsyncReadExt;

async fn client(env: &Env) -> anyhow::Result<kube::Client> {
    let kubeconfig = Kubeconfig::read_from(&env.up.kubeconfig_path)?;
    let config =
        kube::Config::from_custom_kubeconfig(kubeconfig, &KubeConfigOptions::default()).await?;
    Ok(kube::Client::try_from(config)?)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kube_rs_lists_creates_watches_and_execs() -> anyhow::Result<()> {
    let env = Env::start().await?;
    let client = client(&env).await?;

    let namespaces: Api<Namespace> = Api::all(client.clone());
    let names: Vec<String> = namespaces
        .list(&ListParams::default())
        .await?
        .items
        .into_iter()
        .filter_map(|n| n.metadata.name)
        .collect();
    assert!(names.contains(&"default".to_string()), "{names:?}");

    let configmaps: Api<ConfigMap> = Api::namespaced(client.clone(), "default");
    let list = configmaps.list(&ListParams::default()).await?;
    let version = list.metadata.resource_version.unwrap_or_default();
    let mut events = configmaps
        .watch(&WatchParams::default().timeout(30), &version)
        .await?
        .boxed();

    let mut cm = ConfigMap::default();
    cm.metadata.name = Some("from-kube-rs".into());
    cm.data = Some([("k".to_string(), "v".to_string())].into());
    configmaps.create(&PostParams::default(), &cm).await?;

    let added = tokio::time::timeout(Duration::from_secs(20), async {
        while let Some(event) = events.try_next().await? {
            if let WatchEvent::Added(cm) = event
                && cm.metadata.name.as_deref() == Some("from-kube-rs")
            {
                return anyhow::Ok(true);
            }
        }
        Ok(false)
    })
    .await??;
    assert!(added, "the watch did not deliver the ADDED event");

    let pods: Api<Pod> = Api::namespaced(client, "default");
    let mut attached = pods
        .exec(
            "demo",
            ["echo", "hello", "tether"],
            &AttachParams::default().stderr(false),
        )
        .await?;
    let mut stdout = attached
        .stdout()
        .ok_or_else(|| anyhow::anyhow!("no stdout"))?;
    let mut text = String::new();
    stdout.read_to_string(&mut text).await?;
    attached.join().await?;
    assert_eq!(text, "hello tether\n");
    env.up.shutdown().await?;
    Ok(())
}
