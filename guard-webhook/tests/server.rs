//! The webhook server over real HTTPS with client certificates: TokenReview and SubjectAccessReview in v1 and
//! v1beta1, caller authentication, snapshot pushes, cache hits in metrics, and audit lines without tokens.

mod support;

use std::sync::{Arc, Mutex};

use serde_json::{Value, json};
use support::{AUDIENCE, Idp, TENANT};
use tether_auth::Authenticator;
use tether_auth::jwks::HttpsFetcher;
use tether_guard::audit::AuditSink;
use tether_guard::server::{Callers, Limits, ServerConfig, server_tls_for};
use tether_guard::{Guard, GuardOptions, SnapshotStore};
use tether_runtime::Secret;
use tether_testkit::certs::{Ca, CertifiedPem};
use tokio::sync::oneshot;

const PUSH_TOKEN: &str = "push-token-0123456789abcdef";
const ALICE_OID: &str = "aaaaaaaa-0000-0000-0000-000000000001";
const ALICE_GROUP: &str = "gggggggg-0000-0000-0000-000000000002";

struct Harness {
    url: String,
    ca: Ca,
    apiserver: CertifiedPem,
    audit: Arc<Mutex<Vec<String>>>,
    guard: Arc<Guard>,
    snapshot_path: std::path::PathBuf,
    stop: Option<oneshot::Sender<()>>,
    task: tokio::task::JoinHandle<Result<(), tether_guard::server::ServeError>>,
    _dir: tempfile::TempDir,
}

impl Harness {
    async fn start(authenticator: Option<Arc<Authenticator>>) -> anyhow::Result<Harness> {
        Self::start_with(authenticator, Callers::default()).await
    }

    async fn start_with(
        authenticator: Option<Arc<Authenticator>>,
        callers: Callers,
    ) -> anyhow::Result<Harness> {
        tether_runtime::tls::install_crypto_provider();
        let ca = Ca::new("guard test ca")?;
        let server = ca.issue_server(&["127.0.0.1".to_owned()])?;
        let apiserver = ca.issue_client("kube-apiserver", &[])?;
        let tls = server_tls_for(
            server.cert_pem.as_bytes(),
            server.key_pem.as_bytes(),
            ca.cert_pem().as_bytes(),
            &callers,
        )?;
        let dir = tempfile::tempdir()?;
        let snapshot_path = dir.path().join("snapshot.json");
        let store = Arc::new(SnapshotStore::open(&snapshot_path)?);
        let (sink, audit) = AuditSink::memory();
        let guard = Arc::new(Guard::new(
            authenticator,
            store,
            GuardOptions {
                audit: sink,
                ..GuardOptions::default()
            },
        ));
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
        let url = format!("https://{}", listener.local_addr()?);
        let (stop, stopped) = oneshot::channel::<()>();
        let config = ServerConfig {
            tls,
            limits: Limits {
                callers,
                ..Limits::default()
            },
            snapshot_push_token: Some(Secret::new(PUSH_TOKEN)),
        };
        let task = tokio::spawn(tether_guard::run(
            guard.clone(),
            config,
            listener,
            async move {
                let _ = stopped.await;
            },
        ));
        Ok(Harness {
            url,
            ca,
            apiserver,
            audit,
            guard,
            snapshot_path,
            stop: Some(stop),
            task,
            _dir: dir,
        })
    }

    async fn post(
        &self,
        path: &str,
        body: &Value,
        with_cert: bool,
    ) -> anyhow::Result<(u16, Value)> {
        let client =
            support::https_client(self.ca.cert_pem(), with_cert.then_some(&self.apiserver))?;
        let (status, bytes) = support::send(
            &client,
            "POST",
            &format!("{}{path}", self.url),
            &[],
            serde_json::to_vec(body)?,
        )
        .await?;
        Ok((
            status,
            serde_json::from_slice(&bytes).unwrap_or(Value::Null),
        ))
    }

    async fn push(&self, snapshot: &Value, token: &str) -> anyhow::Result<(u16, Value)> {
        self.push_as(snapshot, token, None).await
    }

    async fn push_as(
        &self,
        snapshot: &Value,
        token: &str,
        cert: Option<&CertifiedPem>,
    ) -> anyhow::Result<(u16, Value)> {
        let client = support::https_client(self.ca.cert_pem(), cert)?;
        let auth = format!("Bearer {token}");
        let (status, bytes) = support::send(
            &client,
            "PUT",
            &format!("{}/snapshot", self.url),
            &[("authorization", auth.as_str())],
            serde_json::to_vec(snapshot)?,
        )
        .await?;
        Ok((
            status,
            serde_json::from_slice(&bytes).unwrap_or(Value::Null),
        ))
    }

    /// GETs `path` as the apiserver (with its client certificate).
    async fn get_text(&self, path: &str) -> anyhow::Result<(u16, String)> {
        self.get_text_as(path, Some(&self.apiserver)).await
    }

    async fn get_text_as(
        &self,
        path: &str,
        cert: Option<&CertifiedPem>,
    ) -> anyhow::Result<(u16, String)> {
        let client = support::https_client(self.ca.cert_pem(), cert)?;
        let req = hyper::Request::get(format!("{}{path}", self.url))
            .body(http_body_util::Full::new(bytes::Bytes::new()))?;
        let resp = client.request(req).await?;
        let status = resp.status().as_u16();
        let body = http_body_util::BodyExt::collect(resp.into_body())
            .await?
            .to_bytes();
        Ok((status, String::from_utf8_lossy(&body).into_owned()))
    }

    fn audit_lines(&self) -> Vec<String> {
        self.audit.lock().map(|l| l.clone()).unwrap_or_default()
    }

    async fn stop(mut self) -> anyhow::Result<()> {
        if let Some(s) = self.stop.take() {
            let _ = s.send(());
        }
        (&mut self.task).await??;
        Ok(())
    }
}

fn token_review(version: &str, token: &str) -> Value {
    json!({"apiVersion": format!("authentication.k8s.io/{version}"), "kind": "TokenReview",
           "spec": {"token": token, "audiences": ["https://kubernetes.default.svc"]}})
}

fn sar(
    version: &str,
    oid: Option<&str>,
    groups: &[&str],
    verb: &str,
    resource: &str,
    ns: &str,
) -> Value {
    let groups_field = if version == "v1beta1" {
        "group"
    } else {
        "groups"
    };
    let mut spec = json!({
        "user": "alice@contoso.example",
        "uid": oid.unwrap_or("x"),
        "resourceAttributes": {"namespace": ns, "verb": verb, "group": "", "version": "v1", "resource": resource},
    });
    spec[groups_field] = json!(groups);
    if let Some(oid) = oid {
        spec["extra"] = json!({"oid": [oid], "tid": [TENANT]});
    }
    json!({"apiVersion": format!("authorization.k8s.io/{version}"), "kind": "SubjectAccessReview", "spec": spec})
}

fn viewer_snapshot(version: u64, principal: &str, ns: &str) -> Value {
    json!({
        "version": version,
        "assignments": [{"id": "a1", "roleId": "63f0a09d-1495-4db4-a681-037d84835eb4",
                         "principalId": principal, "scope": {"namespace": ns}}],
    })
}

fn metric(text: &str, line_prefix: &str) -> f64 {
    text.lines()
        .find(|l| l.starts_with(line_prefix))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
        .unwrap_or(0.0)
}

#[tokio::test]
async fn token_reviews_in_both_versions_and_no_token_in_the_audit_log() -> anyhow::Result<()> {
    if !support::pyjwt_available() {
        return Ok(());
    }
    tether_runtime::tls::install_crypto_provider();
    let idp = Idp::start().await?;
    let minted = support::mint(&idp)?;
    idp.set_keys(vec![minted.key("k1")]);
    let fetcher = HttpsFetcher::new(Some(idp.ca_pem().as_bytes()))?;
    let auth = Authenticator::new(support::token_config(&idp), Arc::new(fetcher))?;
    let h = Harness::start(Some(Arc::new(auth))).await?;
    let token = minted.token("valid_v2");

    let (status, body) = h
        .post("/authenticate", &token_review("v1", &token), true)
        .await?;
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["apiVersion"], "authentication.k8s.io/v1");
    assert_eq!(body["kind"], "TokenReview");
    let status_obj = &body["status"];
    assert_eq!(status_obj["authenticated"], true, "{body}");
    assert_eq!(status_obj["user"]["username"], "alice@contoso.example");
    assert_eq!(status_obj["user"]["uid"], ALICE_OID);
    assert_eq!(status_obj["user"]["extra"]["oid"][0], ALICE_OID);
    assert_eq!(
        status_obj["user"]["groups"].as_array().map(Vec::len),
        Some(2)
    );

    let (status, body) = h
        .post("/authenticate", &token_review("v1beta1", &token), true)
        .await?;
    assert_eq!(status, 200);
    assert_eq!(body["apiVersion"], "authentication.k8s.io/v1beta1");
    assert_eq!(body["status"]["authenticated"], true);

    let expired = minted.token("expired");
    let (status, body) = h
        .post("/authenticate", &token_review("v1", &expired), true)
        .await?;
    assert_eq!(status, 200);
    assert_eq!(body["status"]["authenticated"], false);
    assert!(
        body["status"]["error"]
            .as_str()
            .unwrap_or_default()
            .contains("expired"),
        "{body}"
    );

    // The caller must present a certificate from the client CA.
    let (status, body) = h
        .post("/authenticate", &token_review("v1", &token), false)
        .await?;
    assert_eq!(status, 401, "{body}");
    assert_eq!(body["kind"], "Status");

    let (status, _) = h
        .post(
            "/authenticate",
            &json!({"apiVersion": "authentication.k8s.io/v2", "kind": "TokenReview"}),
            true,
        )
        .await?;
    assert_eq!(status, 400);

    let lines = h.audit_lines();
    assert!(lines.len() >= 4, "{lines:?}");
    for line in &lines {
        let v: Value = serde_json::from_str(line)?;
        assert!(
            v["requestId"].is_string() || v["request_id"].is_string(),
            "{line}"
        );
        for t in [&token, &expired] {
            let signature = t.rsplit('.').next().unwrap_or_default();
            assert!(
                !line.contains(signature) && !line.contains(&t[..40]),
                "token in audit: {line}"
            );
        }
    }
    assert!(
        lines
            .iter()
            .any(|l| l.contains(ALICE_OID) && l.contains("\"authenticated\""))
    );
    let _ = AUDIENCE;
    h.stop().await
}

#[tokio::test]
async fn access_reviews_snapshot_pushes_and_the_cache() -> anyhow::Result<()> {
    let h = Harness::start(None).await?;

    // Nothing assigned yet: no opinion for alice.
    let (status, body) = h
        .post(
            "/authorize",
            &sar("v1", Some(ALICE_OID), &[], "list", "pods", "dev"),
            true,
        )
        .await?;
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["status"]["allowed"], false);

    // Pushing needs the token.
    let (status, _) = h
        .push(
            &viewer_snapshot(1, ALICE_OID, "dev"),
            "wrong-token-0123456789",
        )
        .await?;
    assert_eq!(status, 401);
    let (status, body) = h
        .push(&viewer_snapshot(1, ALICE_OID, "dev"), PUSH_TOKEN)
        .await?;
    assert_eq!(
        (status, body["applied"].clone()),
        (200, json!(true)),
        "{body}"
    );
    assert!(
        std::fs::read_to_string(&h.snapshot_path)?.contains(ALICE_OID),
        "persisted"
    );
    let (status, body) = h
        .push(
            &json!({"version": 2, "assignments": [{"id": "x", "roleId": "nope",
        "principalId": "p", "scope": "cluster"}]}),
            PUSH_TOKEN,
        )
        .await?;
    assert_eq!(status, 400, "an inconsistent snapshot is refused: {body}");

    let review = sar("v1", Some(ALICE_OID), &[], "list", "pods", "dev");
    let (_, body) = h.post("/authorize", &review, true).await?;
    assert_eq!(body["apiVersion"], "authorization.k8s.io/v1");
    assert_eq!(body["status"]["allowed"], true, "{body}");
    let (_, metrics) = h.get_text("/metrics").await?;
    let cache_before = metric(
        &metrics,
        "tether_guard_decision_sources_total{source=\"cache\"}",
    );
    let (_, body) = h.post("/authorize", &review, true).await?;
    assert_eq!(body["status"]["allowed"], true);
    let (status, metrics) = h.get_text("/metrics").await?;
    assert_eq!(status, 200);
    assert_eq!(
        metric(
            &metrics,
            "tether_guard_decision_sources_total{source=\"cache\"}"
        ),
        cache_before + 1.0,
        "{metrics}"
    );
    assert!(
        metric(
            &metrics,
            "tether_guard_decision_sources_total{source=\"evaluation\"}"
        ) >= 2.0
    );
    assert!(
        metrics.contains("tether_guard_latency_seconds_bucket"),
        "{metrics}"
    );
    assert_eq!(
        metric(&metrics, "tether_guard_snapshot_version"),
        1.0,
        "{metrics}"
    );

    // Other namespace, forbidden verb: not allowed, with the action in the reason.
    let (_, body) = h
        .post(
            "/authorize",
            &sar("v1", Some(ALICE_OID), &[], "delete", "pods", "dev"),
            true,
        )
        .await?;
    assert_eq!(body["status"]["allowed"], false);
    assert!(
        body["status"]["reason"]
            .as_str()
            .unwrap_or_default()
            .contains("pods/delete"),
        "{body}"
    );

    // v1beta1 names the groups field `group`; a group assignment is matched through it.
    let (status, _) = h
        .push(&viewer_snapshot(2, ALICE_GROUP, "dev"), PUSH_TOKEN)
        .await?;
    assert_eq!(status, 200);
    let beta = sar(
        "v1beta1",
        Some(ALICE_OID),
        &[ALICE_GROUP],
        "get",
        "pods",
        "dev",
    );
    let (_, body) = h.post("/authorize", &beta, true).await?;
    assert_eq!(body["apiVersion"], "authorization.k8s.io/v1beta1");
    assert_eq!(body["status"]["allowed"], true, "{body}");
    // The new snapshot dropped alice's direct assignment: the cached allow is gone too.
    let (_, body) = h.post("/authorize", &review, true).await?;
    assert_eq!(
        body["status"]["allowed"], false,
        "a removed assignment stops working at once: {body}"
    );

    // Non-Entra and system: users get no opinion; unmapped verbs are denied.
    let (_, body) = h
        .post(
            "/authorize",
            &sar("v1", None, &[], "get", "pods", "dev"),
            true,
        )
        .await?;
    assert_eq!(
        (
            body["status"]["allowed"].clone(),
            body["status"].get("denied").cloned()
        ),
        (json!(false), None)
    );
    let (_, body) = h
        .post(
            "/authorize",
            &sar("v1", Some(ALICE_OID), &[], "frobnicate", "pods", "dev"),
            true,
        )
        .await?;
    assert_eq!(body["status"]["denied"], true, "{body}");

    // Without a client certificate: 401.
    let (status, _) = h.post("/authorize", &review, false).await?;
    assert_eq!(status, 401);

    let lines = h.audit_lines();
    let allowed: Vec<Value> = lines
        .iter()
        .filter_map(|l| serde_json::from_str::<Value>(l).ok())
        .filter(|v| v["webhook"] == "authorize" && v["decision"] == "allowed")
        .collect();
    assert!(allowed.len() >= 3);
    let first = &allowed[0];
    assert_eq!(first["oid"], ALICE_OID);
    assert_eq!(first["scope"], "namespace/dev");
    assert_eq!(
        first["actions"][0],
        "Microsoft.Kubernetes/connectedClusters/pods/read"
    );
    assert!(
        first["groups_hash"].is_string() && first["latency_us"].is_u64(),
        "{first}"
    );
    assert!(
        !lines.iter().any(|l| l.contains("alice@contoso.example")),
        "no usernames in the audit log"
    );

    // The store reloads from disk as last-known-good.
    let reloaded = SnapshotStore::open(&h.snapshot_path)?;
    assert_eq!(reloaded.version(), 2);
    assert_eq!(h.guard.store().version(), 2);
    h.stop().await
}

#[tokio::test]
async fn a_certificate_from_another_ca_is_refused_at_the_handshake() -> anyhow::Result<()> {
    let h = Harness::start(None).await?;
    let stranger = Ca::new("someone else's ca")?.issue_client("kube-apiserver", &[])?;
    let client = support::https_client(h.ca.cert_pem(), Some(&stranger))?;
    let review = sar("v1", Some(ALICE_OID), &[], "get", "pods", "dev");
    let result = support::send(
        &client,
        "POST",
        &format!("{}/authorize", h.url),
        &[],
        serde_json::to_vec(&review)?,
    )
    .await;
    assert!(result.is_err(), "{result:?}");
    h.stop().await
}

#[tokio::test]
async fn limits_and_unknown_routes() -> anyhow::Result<()> {
    let h = Harness::start(None).await?;
    let big = json!({"apiVersion": "authorization.k8s.io/v1", "kind": "SubjectAccessReview",
                     "spec": {"user": "x".repeat(100 * 1024)}});
    let (status, _) = h.post("/authorize", &big, true).await?;
    assert_eq!(status, 413);
    let (status, body) = h.post("/nope", &json!({}), true).await?;
    assert_eq!((status, body["kind"].clone()), (404, json!("Status")));
    let (status, text) = h.get_text("/healthz").await?;
    assert_eq!((status, text.as_str()), (200, "ok"));
    h.stop().await
}

async fn post_as(
    h: &Harness,
    path: &str,
    body: &Value,
    cert: &CertifiedPem,
) -> anyhow::Result<(u16, Value)> {
    let client = support::https_client(h.ca.cert_pem(), Some(cert))?;
    let (status, bytes) = support::send(
        &client,
        "POST",
        &format!("{}{path}", h.url),
        &[],
        serde_json::to_vec(body)?,
    )
    .await?;
    Ok((
        status,
        serde_json::from_slice(&bytes).unwrap_or(Value::Null),
    ))
}

#[tokio::test]
async fn only_the_pinned_subject_may_call_the_webhooks() -> anyhow::Result<()> {
    // Any certificate of the client CA used to open the webhooks: an agent's or a node's certificate from the same
    // CA could answer TokenReviews or SubjectAccessReviews itself.
    let h = Harness::start(None).await?;
    let review = sar("v1", Some(ALICE_OID), &[], "get", "pods", "dev");
    for cn in [
        "tether-agent",
        "system:node:worker-1",
        "kube-apiserverx",
        "",
    ] {
        let other = h.ca.issue_client(cn, &[])?;
        let (status, body) = post_as(&h, "/authorize", &review, &other).await?;
        assert_eq!(
            (status, body["kind"].clone()),
            (401, json!("Status")),
            "{cn}: {body}"
        );
        let (status, _) = post_as(&h, "/authenticate", &token_review("v1", "x"), &other).await?;
        assert_eq!(status, 401, "{cn}");
    }
    let (status, _) = h.post("/authorize", &review, true).await?;
    assert_eq!(status, 200);
    let audit = h.audit_lines().join("\n");
    assert!(audit.contains("subject is not allowed"), "{audit}");
    h.stop().await
}

#[tokio::test]
async fn metrics_need_a_certificate_on_the_webhook_port() -> anyhow::Result<()> {
    let h = Harness::start(None).await?;
    let (status, _) = h.get_text_as("/metrics", None).await?;
    assert_eq!(status, 401, "open metrics used to be served to anyone");
    let other = h.ca.issue_client("someone", &[])?;
    assert_eq!(h.get_text_as("/metrics", Some(&other)).await?.0, 401);
    let (status, text) = h.get_text("/metrics").await?;
    assert_eq!(status, 200);
    assert!(text.contains("tether_guard_"), "{text}");
    assert_eq!(
        h.get_text_as("/healthz", None).await?.0,
        200,
        "probes need no certificate"
    );
    h.stop().await?;

    // A Prometheus subject may be allowed, or a plain loopback listener used instead.
    let h = Harness::start_with(
        None,
        Callers {
            metrics_subjects: vec!["prometheus".to_owned()],
            ..Callers::default()
        },
    )
    .await?;
    let prometheus = h.ca.issue_client("prometheus", &[])?;
    assert_eq!(h.get_text_as("/metrics", Some(&prometheus)).await?.0, 200);
    let review = sar("v1", Some(ALICE_OID), &[], "get", "pods", "dev");
    assert_eq!(
        post_as(&h, "/authorize", &review, &prometheus).await?.0,
        401
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    let (stop, stopped) = oneshot::channel::<()>();
    let task = tokio::spawn(tether_guard::server::run_metrics(
        h.guard.clone(),
        listener,
        async move {
            let _ = stopped.await;
        },
    ));
    let client = hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
        .build_http::<http_body_util::Full<bytes::Bytes>>();
    let resp = client
        .request(
            hyper::Request::get(format!("http://{addr}/metrics"))
                .body(http_body_util::Full::new(bytes::Bytes::new()))?,
        )
        .await?;
    assert_eq!(resp.status().as_u16(), 200);
    let resp = client
        .request(
            hyper::Request::post(format!("http://{addr}/authorize"))
                .body(http_body_util::Full::new(bytes::Bytes::new()))?,
        )
        .await?;
    assert_eq!(resp.status().as_u16(), 404, "only metrics there");
    let _ = stop.send(());
    task.await??;
    h.stop().await
}

#[tokio::test]
async fn snapshot_pushes_are_bounded_and_can_require_the_agents_certificate() -> anyhow::Result<()>
{
    let h = Harness::start_with(
        None,
        Callers {
            snapshot_subjects: vec!["prod-cluster".to_owned()],
            ..Callers::default()
        },
    )
    .await?;
    let agent = h.ca.issue_client("prod-cluster", &[])?;
    let now_ms = u64::try_from(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)?
            .as_millis(),
    )?;
    // The push token alone is no longer enough, nor the apiserver's certificate.
    let (status, _) = h
        .push(&viewer_snapshot(now_ms, ALICE_OID, "dev"), PUSH_TOKEN)
        .await?;
    assert_eq!(status, 401);
    let (status, _) = h
        .push_as(
            &viewer_snapshot(now_ms, ALICE_OID, "dev"),
            PUSH_TOKEN,
            Some(&h.apiserver),
        )
        .await?;
    assert_eq!(status, 401);
    // The agent's certificate still needs the token.
    let (status, _) = h
        .push_as(
            &viewer_snapshot(now_ms, ALICE_OID, "dev"),
            "wrong-token-0123456789",
            Some(&agent),
        )
        .await?;
    assert_eq!(status, 401);
    // One push of u64::MAX cannot freeze RBAC.
    let (status, body) = h
        .push_as(
            &viewer_snapshot(u64::MAX, ALICE_OID, "dev"),
            PUSH_TOKEN,
            Some(&agent),
        )
        .await?;
    assert_eq!(status, 400, "{body}");
    assert!(
        body["message"]
            .as_str()
            .is_some_and(|m| m.contains("ahead")),
        "{body}"
    );
    let (status, body) = h
        .push_as(
            &viewer_snapshot(now_ms, ALICE_OID, "dev"),
            PUSH_TOKEN,
            Some(&agent),
        )
        .await?;
    assert_eq!(
        (status, body["applied"].clone()),
        (200, json!(true)),
        "{body}"
    );
    assert_eq!(h.guard.store().version(), now_ms);
    h.stop().await
}

/// The agent's push certificate comes from a CA of its own (the Helm chart makes one and keeps no key of it):
/// guard takes pushes only with a certificate of that CA carrying the pinned subject, besides the token, and such
/// a certificate opens nothing else, whatever its name.
#[tokio::test]
async fn snapshot_pushes_need_the_push_certificate_of_its_own_ca() -> anyhow::Result<()> {
    let push_ca = Ca::new("tether-agent snapshot push CA")?;
    let h = Harness::start_with(
        None,
        Callers {
            snapshot_subjects: vec!["tether-agent".to_owned()],
            snapshot_cas: vec![push_ca.certified().cert_der()],
            ..Callers::default()
        },
    )
    .await?;
    let agent = push_ca.issue_client("tether-agent", &[])?;
    let now_ms = u64::try_from(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)?
            .as_millis(),
    )?;
    let snapshot = viewer_snapshot(now_ms, ALICE_OID, "dev");
    // Refused: the token alone; the apiserver's certificate; a certificate of guard's client CA with the pinned
    // subject (another CA than the push CA); another certificate of the push CA; the push certificate with a
    // wrong token.
    let same_name_other_ca = h.ca.issue_client("tether-agent", &[])?;
    let other_of_push_ca = push_ca.issue_client("tether-agent-2", &[])?;
    for (cert, token, what) in [
        (None, PUSH_TOKEN, "the token alone"),
        (
            Some(&h.apiserver),
            PUSH_TOKEN,
            "the apiserver's certificate",
        ),
        (
            Some(&same_name_other_ca),
            PUSH_TOKEN,
            "the pinned subject from the webhooks' client CA",
        ),
        (
            Some(&other_of_push_ca),
            PUSH_TOKEN,
            "another certificate of the push CA",
        ),
        (Some(&agent), "wrong-token-0123456789", "a wrong token"),
    ] {
        let (status, body) = h.push_as(&snapshot, token, cert).await?;
        assert_eq!(status, 401, "{what}: {body}");
        assert_eq!(h.guard.store().version(), 0, "{what}");
    }
    let (status, body) = h.push_as(&snapshot, PUSH_TOKEN, Some(&agent)).await?;
    assert_eq!(
        (status, body["applied"].clone()),
        (200, json!(true)),
        "{body}"
    );
    assert_eq!(h.guard.store().version(), now_ms);

    // A certificate of the push CA opens nothing else, even one named like the apiserver.
    let posing = push_ca.issue_client(tether_guard::server::DEFAULT_WEBHOOK_SUBJECT, &[])?;
    let review = sar("v1", Some(ALICE_OID), &[], "get", "pods", "dev");
    for cert in [&agent, &posing] {
        assert_eq!(post_as(&h, "/authorize", &review, cert).await?.0, 401);
        assert_eq!(h.get_text_as("/metrics", Some(cert)).await?.0, 401);
    }
    assert_eq!(
        post_as(&h, "/authorize", &review, &h.apiserver).await?.0,
        200
    );
    h.stop().await
}
