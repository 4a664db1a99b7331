//! Guard policy end to end (issue 10): the real kubectl through the relay, the tunnel and the agent to the sample
//! apiserver, which asks tether-guard. A namespace-scoped deny assignment also refuses the same request across all
//! namespaces (`kubectl get … -A`), and a token claiming a `system:` group is refused rather than becoming
//! `system:masters`; a Viewer cannot attach, port-forward or exec. (sample_cluster_guard.rs has the Viewer and
//! Writer tour, proxy included.)

mod common;

use std::path::PathBuf;
use std::time::Duration;

use common::Env;
use tether_testkit::dev_issuer::object_id;
use tether_testkit::kubectl::{Kubectl, Output};

/// How long the setup steps may take (a deadline, not a timing assertion).
const WAIT: Duration = Duration::from_secs(30);
const EVERYONE: &str = "00000000-0000-0000-0000-000000000000";
const CAROL: &str = "carol@contoso.com";

/// A development token from the real `tether token` binary.
async fn dev_token(env: &Env, user: &str, groups: &[&str]) -> anyhow::Result<String> {
    let mut args = vec!["token", "--user", user];
    for g in groups {
        args.extend(["--group", g]);
    }
    let out = env.tether(&args).await?;
    anyhow::ensure!(out.code == Some(0), "tether token failed: {}", out.stderr);
    Ok(out.stdout.trim().to_string())
}

/// kubectl through the relay carrying `token` (a kubeconfig written by `tether kubeconfig`).
async fn kubectl_as(env: &Env, name: &str, token: &str) -> anyhow::Result<Kubectl> {
    let token_file = env.dir.path().join(format!("{name}.token"));
    std::fs::write(&token_file, token)?;
    let path: PathBuf = env.dir.path().join(format!("{name}.kubeconfig"));
    let token_arg = token_file.display().to_string();
    let path_arg = path.display().to_string();
    env.tether_ok(&[
        "kubeconfig",
        env.up.cluster(),
        "--token-file",
        &token_arg,
        "-f",
        &path_arg,
    ])
    .await?;
    Ok(Kubectl::new(&path)?)
}

async fn run(kubectl: &Kubectl, args: &[&str]) -> anyhow::Result<Output> {
    Ok(kubectl.run(args).await?)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_namespace_deny_refuses_the_all_namespaces_list() -> anyhow::Result<()> {
    let env = Env::start().await?;
    let sample = env.sample()?;
    sample.create_configmaps("dev", "cm-", 2);
    sample.create_configmaps("prod", "secret-cm-", 2);
    let cluster = env.up.cluster().to_string();
    env.role(&[
        "assign",
        "--role",
        "Writer",
        "--principal",
        &object_id(CAROL),
        "--cluster",
        &cluster,
    ])
    .await?;
    env.role(&[
        "deny",
        "add",
        "--name",
        "nothing of prod's configmaps",
        "--action",
        "Microsoft.Kubernetes/connectedClusters/configmaps/*",
        "--principal",
        EVERYONE,
        "--cluster",
        &cluster,
        "--namespace",
        "prod",
    ])
    .await?;
    env.wait_snapshot(WAIT, 1, 1).await?;

    let carol = kubectl_as(&env, "carol", &dev_token(&env, CAROL, &[]).await?).await?;
    let out = run(&carol, &["get", "configmaps", "-n", "dev", "-o", "name"]).await?;
    assert!(
        out.success() && out.stdout.contains("configmap/cm-0"),
        "{out}"
    );
    let out = run(&carol, &["get", "configmaps", "-n", "prod"]).await?;
    assert!(!out.success() && out.stderr.contains("Forbidden"), "{out}");
    // The attack: the same objects through a list across all namespaces.
    for args in [
        &["get", "configmaps", "-A", "-o", "name"][..],
        &["get", "configmaps", "--all-namespaces", "--watch=false"][..],
    ] {
        let out = run(&carol, args).await?;
        assert!(
            !out.success() && !out.stdout.contains("secret-cm-"),
            "kubectl {}: {out}",
            args.join(" ")
        );
        assert!(
            out.stderr.contains("Forbidden") && out.stderr.contains("all namespaces"),
            "kubectl {}: {out}",
            args.join(" ")
        );
    }
    Ok(())
}

/// The finding as reported: a deny of `prod`'s Secrets, and `kubectl get secrets -A` returned them anyway.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_namespace_deny_refuses_get_secrets_across_all_namespaces() -> anyhow::Result<()> {
    let env = Env::start().await?;
    // The cluster's own administrator (not an Entra identity: guard has no say) makes the Secrets.
    let admin = Kubectl::new(&env.sample()?.kubeconfig_path())?;
    for ns in ["dev", "prod"] {
        for args in [
            &["create", "namespace", ns][..],
            &[
                "-n",
                ns,
                "create",
                "secret",
                "generic",
                &format!("{ns}-db"),
                "--from-literal=password=hunter2",
            ][..],
        ] {
            let out = run(&admin, args).await?;
            assert!(
                out.success() || out.stderr.contains("AlreadyExists"),
                "{out}"
            );
        }
    }
    let cluster = env.up.cluster().to_string();
    env.role(&[
        "assign",
        "--role",
        "Writer",
        "--principal",
        &object_id(CAROL),
        "--cluster",
        &cluster,
    ])
    .await?;
    env.role(&[
        "deny",
        "add",
        "--name",
        "nothing of prod's secrets",
        "--action",
        "Microsoft.Kubernetes/connectedClusters/secrets/*",
        "--principal",
        EVERYONE,
        "--cluster",
        &cluster,
        "--namespace",
        "prod",
    ])
    .await?;
    env.wait_snapshot(WAIT, 1, 1).await?;

    let carol = kubectl_as(&env, "carol", &dev_token(&env, CAROL, &[]).await?).await?;
    let out = run(&carol, &["get", "secrets", "-n", "dev", "-o", "name"]).await?;
    assert!(
        out.success() && out.stdout.contains("secret/dev-db"),
        "{out}"
    );
    let out = run(&carol, &["get", "secrets", "-n", "prod"]).await?;
    assert!(!out.success() && out.stderr.contains("Forbidden"), "{out}");
    for args in [
        &["get", "secrets", "-A"][..],
        &["get", "secrets", "--all-namespaces", "-o", "yaml"][..],
    ] {
        let out = run(&carol, args).await?;
        assert!(
            !out.success() && !out.stdout.contains("prod-db") && !out.stdout.contains("aHVudGVyMg"),
            "kubectl {}: {out}",
            args.join(" ")
        );
        assert!(
            out.stderr.contains("Forbidden"),
            "kubectl {}: {out}",
            args.join(" ")
        );
    }
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_token_claiming_system_masters_is_refused() -> anyhow::Result<()> {
    let env = Env::start().await?;
    env.sample()?.create_configmaps("dev", "cm-", 1);
    let sample = env.sample()?;
    let seen = sample.requests_with_user_agent("kubectl");
    for (name, user, groups) in [
        ("masters", "mallory@contoso.com", &["system:masters"][..]),
        ("system-user", "system:admin", &[][..]),
    ] {
        let token = dev_token(&env, user, groups).await?;
        let kubectl = kubectl_as(&env, name, &token).await?;
        let out = run(&kubectl, &["get", "configmaps", "-n", "dev"]).await?;
        assert!(!out.success(), "{name} was accepted: {out}");
        assert!(
            out.stderr.contains("Unauthorized") || out.stderr.contains("logged in"),
            "{name}: {out}"
        );
        assert!(out.stderr.contains("system:"), "{name}: the reason: {out}");
    }
    assert_eq!(
        sample.requests_with_user_agent("kubectl"),
        seen,
        "refused before the tunnel"
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_viewer_cannot_attach_port_forward_or_exec() -> anyhow::Result<()> {
    // kubectl's WebSocket attach and port-forward ask for `get` of the subresource (clusters up to 1.34 authorize
    // that verb), which used to map to pods/read: every Viewer could attach and port-forward.
    let env = Env::start().await?;
    let cluster = env.up.cluster().to_string();
    env.role(&[
        "assign",
        "--role",
        "Viewer",
        "--principal",
        &object_id(CAROL),
        "--cluster",
        &cluster,
    ])
    .await?;
    env.wait_snapshot(WAIT, 1, 0).await?;
    let carol = kubectl_as(&env, "carol", &dev_token(&env, CAROL, &[]).await?).await?;
    let out = run(&carol, &["get", "pod", "demo", "-o", "name"]).await?;
    assert!(out.success(), "a Viewer reads pods: {out}");
    for (args, action) in [
        (&["attach", "demo"][..], "pods/attach/action"),
        (
            &["port-forward", "pod/demo", ":80"][..],
            "pods/portforward/action",
        ),
        (
            &["exec", "demo", "--", "echo", "hi"][..],
            "pods/exec/action",
        ),
    ] {
        let out = run(&carol, args).await?;
        assert!(
            !out.success() && out.stderr.contains(action),
            "kubectl {}: {out}",
            args.join(" ")
        );
    }
    Ok(())
}
