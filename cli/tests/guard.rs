//! Guard end to end: the real kubectl through the relay, the tunnel and the agent's authentication proxy to the
//! sample apiserver, which asks tether-guard (TokenReview and SubjectAccessReview webhooks) the way kube-apiserver
//! does. Role assignments are made with the real `tether` binary at the relay and pushed to guard through the
//! agent. Tokens come from the development issuer (`tether token`) and from PyJWT, an independent JWT
//! implementation.

mod common;

use std::path::PathBuf;
use std::process::Command;
use std::time::{Duration, Instant};

use anyhow::Context as _;
use common::Env;
use serde_json::{Value, json};
use tether_testkit::dev_issuer::{DEV_TENANT, object_id};
use tether_testkit::kubectl::{Kubectl, Output};
use tether_testkit::{RbacRule, Subject};

/// How long the setup steps may take (a deadline, not a timing assertion).
const WAIT: Duration = Duration::from_secs(30);
/// The contract: a removed assignment stops working in the cluster within this long.
const REVOCATION_DEADLINE: Duration = Duration::from_secs(5);
const EVERYONE: &str = "00000000-0000-0000-0000-000000000000";
const SRE_GROUP: &str = "5e000000-0000-4000-8000-0000000000aa";
const OTHER_TENANT: &str = "0badc0de-0000-4000-8000-000000000000";

const ALICE: &str = "alice@contoso.com";
const CAROL: &str = "carol@contoso.com";
const DAVE: &str = "dave@contoso.com";

/// Whether PyJWT is here; under CI its absence is a failure, elsewhere a printed skip.
fn pyjwt_available() -> anyhow::Result<bool> {
    Ok(tether_testkit::tools::require(tether_testkit::tools::Tool::PyJwt).is_some())
}

/// Tokens from PyJWT.
struct PyTokens {
    users: serde_json::Map<String, Value>,
    attacks: serde_json::Map<String, Value>,
    service_account: String,
}

impl PyTokens {
    fn user(&self, name: &str) -> anyhow::Result<String> {
        self.users
            .get(name)
            .and_then(Value::as_str)
            .map(str::to_string)
            .with_context(|| format!("no PyJWT token for {name}"))
    }
}

fn mint_with_pyjwt(env: &Env, users: &[(&str, &[&str])]) -> anyhow::Result<PyTokens> {
    mint_with_pyjwt_overage(env, users, &[])
}

/// Like [`mint_with_pyjwt`]; the users named in `overage` get a group-overage token (no `groups` claim).
fn mint_with_pyjwt_overage(
    env: &Env,
    users: &[(&str, &[&str])],
    overage: &[&str],
) -> anyhow::Result<PyTokens> {
    let issuer = env.up.issuer.as_ref().context("guard is wired in")?;
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)?
        .as_secs();
    let users: Vec<Value> = users
        .iter()
        .map(|(name, groups)| {
            json!({"name": name, "oid": object_id(name), "groups": groups, "overage": overage.contains(name)})
        })
        .collect();
    let params = json!({
        "now": now,
        "iss": issuer.issuer(),
        "other_iss": format!("{}/{OTHER_TENANT}/v2.0", issuer.authority()),
        "tid": DEV_TENANT,
        "other_tid": OTHER_TENANT,
        "aud": issuer.info().audience,
        "kid": issuer.info().kid,
        "key_file": issuer.key_file(),
        "users": users,
    });
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/mint_tokens.py");
    let out = Command::new("python3")
        .arg(script)
        .arg(params.to_string())
        .output()
        .context("running python3")?;
    anyhow::ensure!(
        out.status.success(),
        "mint_tokens.py failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: Value = serde_json::from_slice(&out.stdout)?;
    let object = |k: &str| {
        v[k].as_object()
            .cloned()
            .with_context(|| format!("mint_tokens.py printed no {k}"))
    };
    Ok(PyTokens {
        users: object("users")?,
        attacks: object("attacks")?,
        service_account: v["service_account"]
            .as_str()
            .context("no service account token")?
            .to_string(),
    })
}

/// A development token from the real `tether token` binary.
async fn dev_token(env: &Env, user: &str, groups: &[&str]) -> anyhow::Result<String> {
    let mut args = vec!["token", "--user", user];
    for g in groups {
        args.extend(["--group", g]);
    }
    let out = env.tether(&args).await?;
    anyhow::ensure!(out.code == Some(0), "tether token failed: {}", out.stderr);
    anyhow::ensure!(
        out.stderr.contains("DEVELOPMENT ONLY"),
        "tether token must say it is for development: {}",
        out.stderr
    );
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

async fn ok(kubectl: &Kubectl, args: &[&str]) -> anyhow::Result<Output> {
    let out = kubectl.run(args).await?;
    anyhow::ensure!(out.success(), "kubectl {} failed: {out}", args.join(" "));
    Ok(out)
}

async fn forbidden(kubectl: &Kubectl, args: &[&str], message: &str) -> anyhow::Result<Output> {
    let out = kubectl.run(args).await?;
    anyhow::ensure!(
        !out.success() && out.stderr.contains(message),
        "kubectl {} should be Forbidden with {message:?}: {out}",
        args.join(" ")
    );
    Ok(out)
}

async fn start() -> anyhow::Result<Env> {
    let env = Env::start().await?;
    let sample = env.sample()?;
    sample.create_configmaps("dev", "cm-", 2);
    sample.create_configmaps("prod", "cm-", 2);
    Ok(env)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn access_follows_assignments_through_the_relay() -> anyhow::Result<()> {
    if !pyjwt_available()? {
        return Ok(());
    }
    let env = start().await?;
    let cluster = env.up.cluster().to_string();
    let alice_oid = object_id(ALICE);
    let carol_oid = object_id(CAROL);
    // Namespace scope, cluster scope, a group, and a deny assignment that wins over carol's Writer role.
    env.role(&[
        "assign",
        "--role",
        "Viewer",
        "--principal",
        &alice_oid,
        "--cluster",
        &cluster,
        "--namespace",
        "dev",
    ])
    .await?;
    env.role(&[
        "assign",
        "--role",
        "Writer",
        "--principal",
        &carol_oid,
        "--cluster",
        &cluster,
    ])
    .await?;
    env.role(&[
        "assign",
        "--role",
        "Viewer",
        "--principal",
        SRE_GROUP,
        "--cluster",
        &cluster,
    ])
    .await?;
    env.role(&[
        "deny",
        "add",
        "--name",
        "no configmap deletes in prod",
        "--action",
        "Microsoft.Kubernetes/connectedClusters/configmaps/delete",
        "--principal",
        EVERYONE,
        "--cluster",
        &cluster,
        "--namespace",
        "prod",
    ])
    .await?;
    env.wait_snapshot(WAIT, 3, 1).await?;

    let py = mint_with_pyjwt(&env, &[(ALICE, &[]), (CAROL, &[]), (DAVE, &[SRE_GROUP])])?;
    for (source, alice_token) in [
        ("tether token", dev_token(&env, ALICE, &[]).await?),
        ("PyJWT", py.user(ALICE)?),
    ] {
        let alice = kubectl_as(
            &env,
            &format!("alice-{}", source.replace(' ', "-")),
            &alice_token,
        )
        .await?;
        let out = ok(&alice, &["get", "configmaps", "-n", "dev", "-o", "name"]).await?;
        assert!(out.stdout.contains("configmap/cm-0"), "{source}: {out}");
        let out = forbidden(
            &alice,
            &["get", "configmaps", "-n", "prod"],
            "configmaps is forbidden: User \"alice@contoso.com\" cannot list resource \"configmaps\" in API group \"\" \
             in the namespace \"prod\": tether guard: no role assignment grants \
             Microsoft.Kubernetes/connectedClusters/configmaps/read at namespace \"prod\"",
        )
        .await?;
        assert!(
            !out.stderr.contains(&alice_token),
            "the token must never be printed"
        );
        forbidden(
            &alice,
            &["create", "configmap", "x", "-n", "dev", "--from-literal=a=b"],
            "configmaps is forbidden: User \"alice@contoso.com\" cannot create resource \"configmaps\"",
        )
        .await?;
        // The agent validated the token in the cluster and impersonated alice: the apiserver sees her oid and tid.
        let out = ok(&alice, &["auth", "whoami", "-o", "json"]).await?;
        let who: Value = serde_json::from_str(&out.stdout)?;
        assert_eq!(who["status"]["userInfo"]["username"], ALICE, "{who}");
        assert_eq!(
            who["status"]["userInfo"]["extra"]["oid"][0],
            alice_oid.as_str(),
            "{who}"
        );
        assert_eq!(
            who["status"]["userInfo"]["extra"]["tid"][0], DEV_TENANT,
            "{who}"
        );
    }

    // Cluster scope: carol writes anywhere, but the deny assignment wins for deletes in prod.
    let carol = kubectl_as(&env, "carol", &py.user(CAROL)?).await?;
    ok(
        &carol,
        &[
            "create",
            "configmap",
            "from-carol",
            "-n",
            "prod",
            "--from-literal=a=b",
        ],
    )
    .await?;
    ok(
        &carol,
        &[
            "create",
            "configmap",
            "from-carol",
            "-n",
            "dev",
            "--from-literal=a=b",
        ],
    )
    .await?;
    ok(&carol, &["delete", "configmap", "from-carol", "-n", "dev"]).await?;
    forbidden(
        &carol,
        &["delete", "configmap", "from-carol", "-n", "prod"],
        "configmaps \"from-carol\" is forbidden: User \"carol@contoso.com\" cannot delete resource \"configmaps\" \
         in API group \"\" in the namespace \"prod\": ",
    )
    .await
    .and_then(|out| {
        anyhow::ensure!(out.stderr.contains("no configmap deletes in prod"), "{out}");
        Ok(())
    })?;
    // Writer is namespaced work only: nodes are not part of it.
    forbidden(
        &carol,
        &["get", "nodes"],
        "nodes is forbidden: User \"carol@contoso.com\" cannot list resource \"nodes\" in API group \"\" at the \
         cluster scope: tether guard: ",
    )
    .await?;

    // Group-based: dave has no assignment of his own, his group has Viewer on the cluster.
    let dave = kubectl_as(&env, "dave", &py.user(DAVE)?).await?;
    ok(&dave, &["get", "configmaps", "-n", "prod"]).await?;
    ok(&dave, &["get", "configmaps", "-n", "dev"]).await?;
    forbidden(
        &dave,
        &["delete", "configmap", "cm-0", "-n", "dev"],
        "cannot delete resource \"configmaps\"",
    )
    .await?;
    let dev_dave = kubectl_as(
        &env,
        "dave-dev",
        &dev_token(&env, DAVE, &[SRE_GROUP]).await?,
    )
    .await?;
    ok(&dev_dave, &["get", "configmaps", "-n", "prod"]).await?;
    // The same person without the group: nothing.
    let dave_alone = kubectl_as(&env, "dave-alone", &dev_token(&env, DAVE, &[]).await?).await?;
    forbidden(
        &dave_alone,
        &["get", "configmaps", "-n", "prod"],
        "User \"dave@contoso.com\" cannot list",
    )
    .await?;

    // What the relay holds, as `tether role list` shows it.
    let listed = env
        .tether_ok(&["role", "list", "--cluster", &cluster])
        .await?;
    assert!(
        listed.contains(&alice_oid) && listed.contains("namespace dev"),
        "{listed}"
    );
    let denies = env.tether_ok(&["role", "deny", "list"]).await?;
    assert!(denies.contains("no configmap deletes in prod"), "{denies}");
    env.up.shutdown().await?;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_removed_assignment_stops_working_within_5s() -> anyhow::Result<()> {
    let env = start().await?;
    let cluster = env.up.cluster().to_string();
    let id = env
        .role(&[
            "assign",
            "--role",
            "Viewer",
            "--principal",
            &object_id(ALICE),
            "--cluster",
            &cluster,
            "--namespace",
            "dev",
        ])
        .await?;
    env.wait_snapshot(WAIT, 1, 0).await?;
    let alice = kubectl_as(&env, "alice", &dev_token(&env, ALICE, &[]).await?).await?;
    ok(&alice, &["get", "configmaps", "-n", "dev"]).await?;

    env.tether_ok(&["role", "delete", &id]).await?;
    let removed = Instant::now();
    loop {
        let out = alice.run(&["get", "configmaps", "-n", "dev"]).await?;
        if !out.success() && out.stderr.contains("(Forbidden)") {
            break;
        }
        anyhow::ensure!(
            removed.elapsed() < REVOCATION_DEADLINE,
            "alice could still read {REVOCATION_DEADLINE:?} after her assignment was deleted: {out}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    eprintln!(
        "assignment removal took effect after {:?}",
        removed.elapsed()
    );
    env.up.shutdown().await?;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn attacks_are_refused_before_the_tunnel_and_service_accounts_pass() -> anyhow::Result<()> {
    if !pyjwt_available()? {
        return Ok(());
    }
    let env = start().await?;
    let cluster = env.up.cluster().to_string();
    env.role(&[
        "assign",
        "--role",
        "Viewer",
        "--principal",
        &object_id(ALICE),
        "--cluster",
        &cluster,
    ])
    .await?;
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
    env.wait_snapshot(WAIT, 2, 0).await?;
    let py = mint_with_pyjwt(&env, &[(ALICE, &[]), (CAROL, &[])])?;
    let sample = env.sample()?;

    // Control: a good token reaches the apiserver (and is counted there).
    let seen = sample.requests_with_user_agent("kubectl");
    ok(
        &kubectl_as(&env, "alice", &py.user(ALICE)?).await?,
        &["get", "configmaps", "-n", "dev"],
    )
    .await?;
    assert!(sample.requests_with_user_agent("kubectl") > seen);

    // Each case with the reason the relay gives (kubectl prints the relay's Warning header).
    let cases = [
        ("alg_none", "algorithm \"none\" is not allowed"),
        ("hs256_confusion", "algorithm \"HS256\" is not allowed"),
        ("wrong_audience", "audience is not accepted"),
        ("wrong_tenant", "is not trusted"),
        ("expired", "expired"),
        ("nbf_future", "not valid yet"),
        ("unknown_kid", "no signing key with id \"not-published\""),
        ("tampered_payload", "invalid signature"),
        ("oversized", "16384-byte limit"),
    ];
    let seen = sample.requests_with_user_agent("kubectl");
    let unauthenticated = sample.unauthenticated_requests();
    for (case, reason) in cases {
        let token = py
            .attacks
            .get(case)
            .and_then(Value::as_str)
            .with_context(|| format!("no {case} token"))?;
        let kubectl = kubectl_as(&env, case, token).await?;
        let out = kubectl.run(&["get", "configmaps", "-n", "dev"]).await?;
        assert!(!out.success(), "{case} was accepted: {out}");
        assert!(
            out.stderr.contains("You must be logged in to the server"),
            "{case} should be refused as unauthenticated: {out}"
        );
        assert!(
            out.stderr.contains("tether relay: token refused: ") && out.stderr.contains(reason),
            "{case} should be refused by the relay with {reason:?}: {out}"
        );
        assert!(
            !out.stderr.contains(token),
            "{case}: the token must never be printed"
        );
    }
    assert_eq!(
        sample.requests_with_user_agent("kubectl"),
        seen,
        "a refused token reached the apiserver"
    );
    assert_eq!(sample.unauthenticated_requests(), unauthenticated);

    // A Kubernetes service-account token (a JWT from the cluster's own issuer) passes through unchanged: the
    // apiserver authenticates it itself and Kubernetes RBAC decides.
    sample.add_token(
        &py.service_account,
        "system:serviceaccount:dev:ci",
        &["system:serviceaccounts"],
    );
    sample.allow(RbacRule::new(
        Subject::User("system:serviceaccount:dev:ci".into()),
        &["get", "list"],
        &["configmaps"],
        Some("dev"),
    ));
    let ci = kubectl_as(&env, "ci", &py.service_account).await?;
    ok(&ci, &["get", "configmaps", "-n", "dev"]).await?;
    let out = ok(&ci, &["auth", "whoami", "-o", "json"]).await;
    // whoami needs selfsubjectreviews, which every authenticated user may create.
    let who: Value = serde_json::from_str(&out?.stdout)?;
    assert_eq!(
        who["status"]["userInfo"]["username"],
        "system:serviceaccount:dev:ci"
    );
    forbidden(
        &ci,
        &["get", "configmaps", "-n", "prod"],
        "User \"system:serviceaccount:dev:ci\" cannot list resource \"configmaps\" in API group \"\" in the namespace \"prod\"",
    )
    .await?;
    env.up.shutdown().await?;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn guard_keeps_deciding_from_its_last_snapshot_without_the_relay() -> anyhow::Result<()> {
    let mut env = start().await?;
    let cluster = env.up.cluster().to_string();
    env.role(&[
        "assign",
        "--role",
        "Viewer",
        "--principal",
        &object_id(ALICE),
        "--cluster",
        &cluster,
        "--namespace",
        "dev",
    ])
    .await?;
    env.wait_snapshot(WAIT, 1, 0).await?;
    let token = dev_token(&env, ALICE, &[]).await?;
    env.up.stop_relay().await?;

    // Straight to the sample apiserver (the relay is gone): TokenReview and SubjectAccessReview go to guard.
    let direct = Kubectl::new(&env.sample()?.kubeconfig_path())?;
    let check = |direct: Kubectl, token: String| async move {
        ok(
            &direct,
            &["--token", &token, "get", "configmaps", "-n", "dev"],
        )
        .await?;
        forbidden(
            &direct,
            &["--token", &token, "get", "configmaps", "-n", "prod"],
            "tether guard: no role assignment grants Microsoft.Kubernetes/connectedClusters/configmaps/read",
        )
        .await?;
        anyhow::Ok(direct)
    };
    let direct = check(direct, token.clone()).await?;
    // A guard restarted while the relay is away loads the snapshot it kept on disk.
    env.up.restart_guard().await?;
    assert_eq!(
        env.up
            .guard()
            .map(|g| g.store().current().assignments.len()),
        Some(1)
    );
    check(direct, token).await?;
    env.up.shutdown().await?;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn custom_roles_and_group_overage_through_the_cli() -> anyhow::Result<()> {
    if !pyjwt_available()? {
        return Ok(());
    }
    let env = start().await?;
    let cluster = env.up.cluster().to_string();
    let erin = "erin@contoso.com";
    let frank = "frank@contoso.com";

    // A custom role in the `az role definition` form, from a file.
    let file = env.dir.path().join("pod-reader.json");
    std::fs::write(
        &file,
        json!({
            "Name": "Pod Reader",
            "Description": "reads pods and their logs",
            "Actions": [],
            "DataActions": ["Microsoft.Kubernetes/connectedClusters/pods/read"],
            "NotDataActions": [],
        })
        .to_string(),
    )?;
    let file_arg = file.display().to_string();
    let role_id = env.role(&["define", "-f", &file_arg]).await?;
    let listed = env.tether_ok(&["role", "definitions"]).await?;
    assert!(
        listed.contains("Pod Reader") && listed.contains("Azure Arc Kubernetes Viewer"),
        "{listed}"
    );
    env.role(&[
        "assign",
        "--role",
        "Pod Reader",
        "--principal",
        &object_id(erin),
        "--cluster",
        &cluster,
    ])
    .await?;
    // Frank's token has too many groups to carry them; the relay's directory knows them.
    env.role(&[
        "assign",
        "--role",
        "Viewer",
        "--principal",
        SRE_GROUP,
        "--cluster",
        &cluster,
    ])
    .await?;
    env.wait_snapshot(WAIT, 2, 0).await?;

    // A role in use cannot be deleted.
    let out = env.tether(&["role", "delete-definition", &role_id]).await?;
    assert_eq!(out.code, Some(1), "{out:?}");

    let py = mint_with_pyjwt_overage(&env, &[(erin, &[]), (frank, &[])], &[frank])?;
    let erin_kubectl = kubectl_as(&env, "erin", &py.user(erin)?).await?;
    ok(&erin_kubectl, &["get", "pods", "-n", "default"]).await?;
    forbidden(
        &erin_kubectl,
        &["get", "configmaps", "-n", "default"],
        "User \"erin@contoso.com\" cannot list resource \"configmaps\"",
    )
    .await?;

    env.tether_ok(&["directory", "set-groups", &object_id(frank), SRE_GROUP])
        .await?;
    let frank_kubectl = kubectl_as(&env, "frank", &py.user(frank)?).await?;
    let out = ok(&frank_kubectl, &["auth", "whoami", "-o", "json"]).await?;
    let who: Value = serde_json::from_str(&out.stdout)?;
    assert!(
        who["status"]["userInfo"]["groups"]
            .as_array()
            .is_some_and(|g| g.iter().any(|g| g == SRE_GROUP)),
        "{who}"
    );
    ok(&frank_kubectl, &["get", "configmaps", "-n", "prod"]).await?;
    env.up.shutdown().await?;
    Ok(())
}

#[tokio::test]
async fn tether_token_without_a_development_issuer_is_a_usage_error() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let out = tokio::process::Command::new(env!("CARGO_BIN_EXE_tether"))
        .args(["token", "--user", "alice@contoso.com", "--dir"])
        .arg(dir.path())
        .env_remove("TETHER_CONFIG")
        .output()
        .await?;
    assert_eq!(out.status.code(), Some(64));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("run `tether up` first"), "{stderr}");
    assert!(out.stdout.is_empty());
    let out = tokio::process::Command::new(env!("CARGO_BIN_EXE_tether"))
        .args(["token", "--help"])
        .output()
        .await?;
    assert!(String::from_utf8_lossy(&out.stdout).contains("DEVELOPMENT ONLY"));
    Ok(())
}
