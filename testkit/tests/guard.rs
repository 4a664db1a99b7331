//! The sample apiserver calling a real tether-guard (in process, over HTTPS with client certificates) the way
//! kube-apiserver does, driven by the real kubectl directly (no relay): TokenReview for tokens from the
//! development issuer, SubjectAccessReview through the shipped authorization configuration, the built-in RBAC
//! fallback, impersonation checked against the real user, and kube's exact Forbidden message with guard's reason.

mod support;

use std::net::SocketAddr;
use std::sync::Arc;

use anyhow::{Context as _, ensure};
use http::{Method, StatusCode};
use support::Client;
use tether_auth::Snapshot;
use tether_auth::rbac::{DenyAssignment, RoleAssignment, Scope};
use tether_guard::{Guard, GuardOptions, SnapshotStore};
use tether_testkit::dev_issuer::{DEV_AUDIENCE, DEV_TENANT, DevIssuer, TokenRequest};
use tether_testkit::kubectl::Kubectl;
use tether_testkit::{RbacRule, SampleApiserver, SampleOptions, Subject, certs, webhook};
use tokio::sync::oneshot;

const VIEWER: &str = "63f0a09d-1495-4db4-a681-037d84835eb4";
const WRITER: &str = "5b999177-9696-4545-85c7-50de3797e5a1";
const SRE_GROUP: &str = "5e000000-0000-4000-8000-000000000001";

struct Fixture {
    sample: SampleApiserver,
    issuer: DevIssuer,
    guard: Arc<Guard>,
    _stop_guard: oneshot::Sender<()>,
    _dir: tempfile::TempDir,
}

impl Fixture {
    async fn start() -> anyhow::Result<Fixture> {
        let dir = tempfile::tempdir()?;
        let issuer = DevIssuer::start(
            &dir.path().join("issuer"),
            SocketAddr::from(([127, 0, 0, 1], 0)),
            DEV_AUDIENCE,
        )
        .await?;

        // Guard: its own serving CA; the apiserver's client certificate from another CA.
        let guard_ca = certs::Ca::new("guard ca")?;
        let serving = guard_ca.issue_server(&["127.0.0.1".to_string()])?;
        let client_ca = certs::Ca::new("apiserver client ca")?;
        let client = client_ca.issue_client("kube-apiserver", &[])?;
        let mut token = tether_auth::TokenConfig::new(
            vec![DEV_TENANT.to_string()],
            vec![DEV_AUDIENCE.to_string()],
        );
        token.v2_authority = issuer.authority().to_string();
        let fetch = tether_auth::jwks::HttpsFetcher::new(Some(issuer.ca_pem().as_bytes()))?;
        let authenticator = tether_auth::Authenticator::new(token, Arc::new(fetch))?;
        // As `tether-guard` runs by default: the agent's namespace is tether-system (the sample's agent identity
        // is a service account there).
        let guard = Arc::new(Guard::new(
            Some(Arc::new(authenticator)),
            Arc::new(SnapshotStore::in_memory(Snapshot::default())),
            GuardOptions {
                protection: tether_auth::rbac::Protection {
                    agent_namespace: Some("tether-system".to_owned()),
                },
                ..GuardOptions::default()
            },
        ));
        let tls = tether_guard::server_tls(
            serving.cert_pem.as_bytes(),
            serving.key_pem.as_bytes(),
            client_ca.cert_pem().as_bytes(),
        )?;
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
        let guard_addr = listener.local_addr()?;
        let (stop, stopped) = oneshot::channel::<()>();
        tokio::spawn(tether_guard::run(
            guard.clone(),
            tether_guard::ServerConfig {
                tls,
                limits: tether_guard::Limits::default(),
                snapshot_push_token: None,
            },
            listener,
            async move {
                let _ = stopped.await;
            },
        ));

        let configs = webhook::write_guard_configs(
            &dir.path().join("webhooks"),
            &format!("https://{guard_addr}"),
            guard_ca.cert_pem(),
            &client,
        )?;
        let mut options = SampleOptions::new(dir.path().join("sample"));
        options.authn_webhook = Some(configs.authn_webhook);
        options.authz_config = Some(configs.authz_config);
        let sample = SampleApiserver::start(options).await?;
        sample.create_configmaps("dev", "cm-", 2);
        sample.create_configmaps("prod", "cm-", 2);
        Ok(Fixture {
            sample,
            issuer,
            guard,
            _stop_guard: stop,
            _dir: dir,
        })
    }

    /// Alice: Viewer in `dev`. The SRE group: Writer on the cluster, but a deny assignment on secrets and
    /// configmap deletes in `prod` for everyone.
    fn assign(&self, version: u64) -> anyhow::Result<()> {
        let alice = tether_testkit::dev_issuer::object_id("alice@contoso.com");
        let snapshot = Snapshot {
            version,
            roles: Vec::new(),
            assignments: vec![
                RoleAssignment {
                    id: "a1".into(),
                    role_id: VIEWER.into(),
                    principal_id: alice,
                    scope: Scope::Namespace("dev".into()),
                },
                RoleAssignment {
                    id: "a2".into(),
                    role_id: WRITER.into(),
                    principal_id: SRE_GROUP.into(),
                    scope: Scope::Cluster,
                },
            ],
            deny_assignments: vec![DenyAssignment {
                id: "d1".into(),
                name: "no deletes in prod".into(),
                data_actions: vec![
                    "Microsoft.Kubernetes/connectedClusters/configmaps/delete".into(),
                ],
                not_data_actions: Vec::new(),
                principals: vec![tether_auth::rbac::EVERYONE.into()],
                exclude_principals: Vec::new(),
                scope: Scope::Namespace("prod".into()),
            }],
        };
        self.guard.store().update(snapshot)?;
        Ok(())
    }

    /// kubectl against the sample apiserver directly, as whoever `token` says.
    fn kubectl(&self, token: &str) -> anyhow::Result<KubectlAs> {
        Ok(KubectlAs {
            kubectl: Kubectl::new(&self.sample.kubeconfig_path())?,
            token: token.to_string(),
        })
    }

    fn token(&self, user: &str, groups: &[&str]) -> anyhow::Result<String> {
        Ok(self
            .issuer
            .mint(&TokenRequest::user(user).with_groups(groups))?
            .token)
    }
}

struct KubectlAs {
    kubectl: Kubectl,
    token: String,
}

impl KubectlAs {
    async fn run(&self, args: &[&str]) -> anyhow::Result<tether_testkit::kubectl::Output> {
        let mut full = vec!["--token", self.token.as_str()];
        full.extend_from_slice(args);
        Ok(self.kubectl.run(&full).await?)
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn guard_decides_for_entra_users_with_kubes_forbidden_message() -> anyhow::Result<()> {
    let fx = Fixture::start().await?;
    fx.assign(1)?;
    let alice = fx.kubectl(&fx.token("alice@contoso.com", &[])?)?;

    let out = alice
        .run(&["get", "configmaps", "-n", "dev", "-o", "name"])
        .await?;
    ensure!(out.success(), "{out}");
    assert!(out.stdout.contains("configmap/cm-0"), "{out}");

    let out = alice.run(&["get", "configmaps", "-n", "prod"]).await?;
    assert!(!out.success(), "{out}");
    assert!(
        out.stderr.contains(
            "Error from server (Forbidden): configmaps is forbidden: User \"alice@contoso.com\" cannot list \
             resource \"configmaps\" in API group \"\" in the namespace \"prod\": "
        ),
        "{out}"
    );
    // Guard's reason names the missing data action.
    assert!(
        out.stderr
            .contains("Microsoft.Kubernetes/connectedClusters/configmaps/read"),
        "{out}"
    );

    let out = alice
        .run(&[
            "create",
            "configmap",
            "x",
            "-n",
            "dev",
            "--from-literal=a=b",
        ])
        .await?;
    assert!(!out.success(), "{out}");
    assert!(
        out.stderr.contains(
            "configmaps is forbidden: User \"alice@contoso.com\" cannot create resource \"configmaps\" in API group \
             \"\" in the namespace \"dev\""
        ),
        "{out}"
    );

    // A group member writes anywhere, but the deny assignment wins in prod.
    let sre = fx.kubectl(&fx.token("sam@contoso.com", &[SRE_GROUP])?)?;
    let out = sre
        .run(&[
            "create",
            "configmap",
            "x",
            "-n",
            "prod",
            "--from-literal=a=b",
        ])
        .await?;
    ensure!(out.success(), "{out}");
    let out = sre.run(&["delete", "configmap", "x", "-n", "prod"]).await?;
    assert!(!out.success(), "{out}");
    assert!(
        out.stderr.contains(
            "configmaps \"x\" is forbidden: User \"sam@contoso.com\" cannot delete resource \"configmaps\" in API \
             group \"\" in the namespace \"prod\": "
        ),
        "{out}"
    );
    assert!(out.stderr.contains("no deletes in prod"), "{out}");

    // whoami shows what TokenReview said: the oid and tid extras, system:authenticated added.
    let out = alice.run(&["auth", "whoami", "-o", "json"]).await?;
    ensure!(out.success(), "{out}");
    let who: serde_json::Value = serde_json::from_str(&out.stdout)?;
    let info = &who["status"]["userInfo"];
    assert_eq!(info["username"], "alice@contoso.com");
    assert_eq!(info["extra"]["tid"][0], DEV_TENANT);
    assert!(
        info["groups"]
            .as_array()
            .is_some_and(|g| g.iter().any(|g| g == "system:authenticated")),
        "{who}"
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn refused_tokens_are_401_and_answers_are_cached() -> anyhow::Result<()> {
    let fx = Fixture::start().await?;
    fx.assign(1)?;
    let wrong_audience = fx
        .issuer
        .mint(&TokenRequest {
            audience: Some("api://someone-else".into()),
            ..TokenRequest::user("alice@contoso.com")
        })?
        .token;
    let before = fx.sample.unauthenticated_requests();
    let out = fx
        .kubectl(&wrong_audience)?
        .run(&["get", "configmaps", "-n", "dev"])
        .await?;
    assert!(!out.success(), "{out}");
    assert!(
        out.stderr.contains("You must be logged in to the server"),
        "{out}"
    );
    assert!(fx.sample.unauthenticated_requests() > before);

    // Many requests with one token: one TokenReview (kube's 2-minute cache).
    let alice = fx.kubectl(&fx.token("alice@contoso.com", &[])?)?;
    let reviews = fx.sample.token_reviews();
    for _ in 0..3 {
        let out = alice.run(&["get", "configmaps", "-n", "dev"]).await?;
        ensure!(out.success(), "{out}");
    }
    assert_eq!(fx.sample.token_reviews(), reviews + 1);
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn service_accounts_fall_through_to_rbac_without_asking_guard() -> anyhow::Result<()> {
    let fx = Fixture::start().await?;
    let sa = "system:serviceaccount:dev:ci";
    fx.sample
        .add_token("ci-token", sa, &["system:serviceaccounts"]);
    fx.sample.allow(RbacRule::new(
        Subject::User(sa.into()),
        &["get", "list"],
        &["configmaps"],
        Some("dev"),
    ));
    let ci = fx.kubectl("ci-token")?;
    let reviews = fx.sample.access_reviews();
    let out = ci
        .run(&["get", "configmaps", "-n", "dev", "-o", "name"])
        .await?;
    ensure!(out.success(), "{out}");
    let out = ci.run(&["get", "configmaps", "-n", "prod"]).await?;
    assert!(!out.success(), "{out}");
    assert!(
        out.stderr.contains(
            "configmaps is forbidden: User \"system:serviceaccount:dev:ci\" cannot list resource \"configmaps\" in \
             API group \"\" in the namespace \"prod\""
        ),
        "{out}"
    );
    // The match conditions keep system: users away from guard.
    assert_eq!(fx.sample.access_reviews(), reviews);
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn impersonation_is_checked_against_the_real_user() -> anyhow::Result<()> {
    let fx = Fixture::start().await?;
    fx.assign(1)?;
    let alice_oid = tether_testkit::dev_issuer::object_id("alice@contoso.com");

    // A user who may not impersonate is refused with kube's message, before the impersonated user is asked about.
    fx.sample.add_token("bob-token", "bob", &[]);
    let out = fx
        .kubectl("bob-token")?
        .run(&[
            "get",
            "--raw",
            "/api/v1/namespaces/dev/configmaps",
            "--as",
            "alice@contoso.com",
        ])
        .await?;
    assert!(!out.success(), "{out}");
    assert!(
        out.stderr.contains(
            "users \"alice@contoso.com\" is forbidden: User \"bob\" cannot impersonate resource \"users\" in API \
             group \"\" at the cluster scope"
        ),
        "{out}"
    );

    // The agent's identity impersonates alice with her oid extra: guard decides for alice.
    let agent_token = std::fs::read_to_string(fx.sample.agent_kubeconfig_path())?;
    let agent_token = agent_token
        .lines()
        .find_map(|l| l.trim().strip_prefix("token: "))
        .context("no token in the agent kubeconfig")?
        .trim()
        .to_string();
    let mut client = Client::new(&fx.sample, false)?;
    client.token = Some(agent_token);
    let headers = [
        ("impersonate-user", "alice@contoso.com"),
        ("impersonate-uid", alice_oid.as_str()),
        ("impersonate-extra-oid", alice_oid.as_str()),
        ("impersonate-extra-tid", DEV_TENANT),
    ];
    let reply = client
        .request_with(Method::GET, "/api/v1/namespaces/dev/configmaps", &headers)
        .await?;
    assert_eq!(reply.status, StatusCode::OK, "{}", reply.text());
    let reply = client
        .request_with(Method::GET, "/api/v1/namespaces/prod/configmaps", &headers)
        .await?;
    assert_eq!(reply.status, StatusCode::FORBIDDEN, "{}", reply.text());
    let status = reply.json()?;
    let message = status["message"].as_str().unwrap_or_default();
    assert!(
        message.starts_with(
            "configmaps is forbidden: User \"alice@contoso.com\" cannot list resource \"configmaps\" in API group \"\" \
             in the namespace \"prod\": "
        ),
        "{status}"
    );
    assert_eq!(status["reason"], "Forbidden");
    assert_eq!(status["details"]["kind"], "configmaps");

    // Without the oid extra the request is not an Entra identity: guard is not asked and RBAC says no.
    let reply = client
        .request_with(
            Method::GET,
            "/api/v1/namespaces/dev/configmaps",
            &[("impersonate-user", "alice@contoso.com")],
        )
        .await?;
    assert_eq!(reply.status, StatusCode::FORBIDDEN, "{}", reply.text());
    Ok(())
}

/// The finding: the agent's identity could impersonate anyone, `system:masters` included — the Helm chart's
/// ClusterRole grants `impersonate` on every user and group, as Kubernetes RBAC cannot say "any but `system:*`"
/// (the sample's agent identity is allowed everything). The shipped configuration's first webhook asks guard
/// about the agent namespace's service accounts, and guard denies their impersonating `system:` users and groups
/// or service accounts; what the agent really does (an Entra user with her oid) still works.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_agents_identity_cannot_impersonate_system_masters_or_service_accounts()
-> anyhow::Result<()> {
    let fx = Fixture::start().await?;
    fx.assign(1)?;
    let agent_token = std::fs::read_to_string(fx.sample.agent_kubeconfig_path())?;
    let agent_token = agent_token
        .lines()
        .find_map(|l| l.trim().strip_prefix("token: "))
        .context("no token in the agent kubeconfig")?
        .trim()
        .to_string();
    let mut client = Client::new(&fx.sample, false)?;
    client.token = Some(agent_token);
    for headers in [
        &[("impersonate-user", "system:admin")][..],
        &[
            ("impersonate-user", "alice@contoso.com"),
            ("impersonate-group", "system:masters"),
        ][..],
        &[(
            "impersonate-user",
            "system:serviceaccount:kube-system:default",
        )][..],
    ] {
        let reply = client
            .request_with(Method::GET, "/api/v1/namespaces/prod/secrets", headers)
            .await?;
        assert_eq!(
            reply.status,
            StatusCode::FORBIDDEN,
            "{headers:?}: {}",
            reply.text()
        );
        assert!(
            reply
                .text()
                .contains("may impersonate Entra users and groups only"),
            "{headers:?}: {}",
            reply.text()
        );
    }
    // The real kubectl with the agent's kubeconfig, as someone holding its token would.
    let kubectl = Kubectl::new(&fx.sample.agent_kubeconfig_path())?;
    let out = kubectl
        .run(&[
            "get",
            "secrets",
            "-A",
            "--as",
            "alice@contoso.com",
            "--as-group",
            "system:masters",
        ])
        .await?;
    assert!(!out.success(), "{out}");
    assert!(
        out.stderr.contains("Forbidden") || out.stderr.contains("forbidden"),
        "{out}"
    );
    // What the agent does: alice, with her oid, is impersonated and guard decides for her.
    let alice_oid = tether_testkit::dev_issuer::object_id("alice@contoso.com");
    let reply = client
        .request_with(
            Method::GET,
            "/api/v1/namespaces/dev/configmaps",
            &[
                ("impersonate-user", "alice@contoso.com"),
                ("impersonate-uid", alice_oid.as_str()),
                ("impersonate-extra-oid", alice_oid.as_str()),
                ("impersonate-extra-tid", DEV_TENANT),
            ],
        )
        .await?;
    assert_eq!(reply.status, StatusCode::OK, "{}", reply.text());
    Ok(())
}
