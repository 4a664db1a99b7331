//! Guard's RBAC at the relay, driven over HTTPS and a real tunnel with mTLS: role definitions, role and deny
//! assignments (admin API), the snapshot a connected fake agent receives at hello and after each change, cluster
//! deletion and export/import, the group directory over the control channel, and the relay's own check of
//! Entra-style tokens (minted here with jsonwebtoken and, independently, with PyJWT) before anything enters a
//! tunnel. Every wait is on a condition with a deadline.

mod common;

use std::collections::BTreeSet;
use std::convert::Infallible;

use std::process::Command;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use anyhow::{Context as _, anyhow};
use base64::Engine as _;
use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use bytes::Bytes;
use common::{Admin, AgentIdentity, Reply, TestRelay, dial};
use http::{Method, Response, StatusCode};
use http_body_util::Full;
use hyper::service::service_fn;
use hyper_util::rt::TokioIo;
use serde_json::{Value, json};
use tether_api::control::{self, Groups, Hello, Message, Reader, ResolveGroups};
use tether_auth::Snapshot;
use tether_tunnel::{Connection, OpenOptions, Priority, Stream, kind};
use tokio::io::{ReadHalf, WriteHalf};

const VIEWER: &str = "63f0a09d-1495-4db4-a681-037d84835eb4";
const WRITER: &str = "5b999177-9696-4545-85c7-50de3797e5a1";
const ALICE: &str = "aaaaaaaa-0000-4000-8000-000000000001";
const BOB: &str = "bbbbbbbb-0000-4000-8000-000000000002";
const DEVS: &str = "dddddddd-0000-4000-8000-000000000003";
const TENANT: &str = "72f988bf-86f1-41af-91ab-2d7cd011db47";
const OTHER_TENANT: &str = "00000000-dead-beef-0000-000000000000";
const AUDIENCE: &str = "api://tether";

async fn within<T>(what: &str, fut: impl Future<Output = T>) -> anyhow::Result<T> {
    tokio::time::timeout(Duration::from_secs(20), fut)
        .await
        .map_err(|_| anyhow!("timed out waiting for {what}"))
}

/// A request to the admin API with the admin token (or `token`), a JSON body when given.
async fn call(
    admin: &Admin,
    method: Method,
    path: &str,
    body: Option<&Value>,
) -> anyhow::Result<Reply> {
    let req = admin
        .client
        .request(false, method, path)
        .header(
            http::header::AUTHORIZATION,
            format!("Bearer {}", admin.token),
        )
        .header(http::header::CONTENT_TYPE, "application/json")
        .body(Full::new(Bytes::from(
            body.map(Value::to_string).unwrap_or_default(),
        )))?;
    admin.client.send(false, req).await
}

/// `call`, expecting `status`; returns the JSON body (Null for an empty one).
async fn expect(
    admin: &Admin,
    method: Method,
    path: &str,
    body: Option<&Value>,
    status: u16,
) -> anyhow::Result<Value> {
    let reply = call(admin, method.clone(), path, body).await?;
    anyhow::ensure!(
        reply.status.as_u16() == status,
        "{method} {path}: expected {status}, got {} {}",
        reply.status,
        String::from_utf8_lossy(&reply.body)
    );
    if reply.body.is_empty() {
        return Ok(Value::Null);
    }
    reply.json()
}

/// A fake agent: a tunnel with mTLS, its control channel after hello/welcome, and an HTTP server on every
/// stream the relay opens (counted).
struct Agent {
    conn: Connection,
    reader: Reader<ReadHalf<Stream>>,
    writer: WriteHalf<Stream>,
    http_streams: Arc<AtomicUsize>,
}

impl Agent {
    /// Connects and says hello; returns the agent and the snapshot the relay sends right after `welcome`.
    async fn connect(
        relay: &TestRelay,
        identity: &AgentIdentity,
    ) -> anyhow::Result<(Agent, Snapshot)> {
        let conn = dial(relay, identity).await?;
        let http_streams = Arc::new(AtomicUsize::new(0));
        let (c, n) = (conn.clone(), http_streams.clone());
        tokio::spawn(async move {
            while let Some(incoming) = c.accept().await {
                n.fetch_add(1, Ordering::SeqCst);
                let Ok(stream) = incoming.accept(Bytes::new()) else {
                    continue;
                };
                tokio::spawn(async move {
                    let svc = service_fn(|req: http::Request<hyper::body::Incoming>| async move {
                        let auth = req.headers().contains_key(http::header::AUTHORIZATION);
                        let body = json!({ "reachedAgent": true, "authorization": auth });
                        Ok::<_, Infallible>(Response::new(Full::new(Bytes::from(body.to_string()))))
                    });
                    let _ = hyper::server::conn::http1::Builder::new()
                        .serve_connection(TokioIo::new(stream), svc)
                        .await;
                });
            }
        });
        let stream = conn.open(OpenOptions {
            kind: kind::CONTROL,
            priority: Priority::Control,
            deadline: Some(Duration::from_secs(10)),
            metadata: Bytes::new(),
        })?;
        within("the control stream", stream.control().accepted()).await??;
        let (rd, writer) = tokio::io::split(stream);
        let mut agent = Agent {
            conn,
            reader: Reader::new(rd),
            writer,
            http_streams,
        };
        agent
            .send(Message::Hello(Hello {
                agent_version: "0.1.0".into(),
                ..Hello::default()
            }))
            .await?;
        match agent.recv().await? {
            Message::Welcome(_) => {}
            other => anyhow::bail!("expected welcome, got {other:?}"),
        }
        let snapshot = agent.snapshot().await?;
        Ok((agent, snapshot))
    }

    async fn send(&mut self, m: Message) -> anyhow::Result<()> {
        control::send(&mut self.writer, &m).await?;
        Ok(())
    }

    async fn recv(&mut self) -> anyhow::Result<Message> {
        within("a control message", self.reader.recv())
            .await??
            .ok_or_else(|| anyhow!("the control channel ended"))
    }

    /// The next message, which must be a valid guard snapshot.
    async fn snapshot(&mut self) -> anyhow::Result<Snapshot> {
        match self.recv().await? {
            Message::GuardSnapshot(g) => {
                let snapshot: Snapshot = g.snapshot;
                snapshot
                    .validate()
                    .map_err(|e| anyhow!("guard would refuse the snapshot: {e}"))?;
                Ok(snapshot)
            }
            other => anyhow::bail!("expected guardSnapshot, got {other:?}"),
        }
    }

    fn http_streams(&self) -> usize {
        self.http_streams.load(Ordering::SeqCst)
    }
}

fn assign_body(role: &str, principal: &str, cluster: &str, ns: Option<&str>) -> Value {
    let mut v = json!({ "role": role, "principalId": principal, "cluster": cluster });
    if let Some(ns) = ns {
        v["namespace"] = json!(ns);
    }
    v
}

async fn assign(
    admin: &Admin,
    role: &str,
    principal: &str,
    cluster: &str,
    ns: Option<&str>,
) -> anyhow::Result<Value> {
    expect(
        admin,
        Method::POST,
        "/api/v1/roleassignments",
        Some(&assign_body(role, principal, cluster, ns)),
        201,
    )
    .await
}

fn id(v: &Value) -> anyhow::Result<String> {
    v["id"]
        .as_str()
        .map(str::to_owned)
        .ok_or_else(|| anyhow!("no id in {v}"))
}

fn pod_reader() -> Value {
    // The `az role definition` form.
    json!({
        "Name": "Pod Reader",
        "Description": "reads pods",
        "Actions": [],
        "DataActions": ["Microsoft.Kubernetes/connectedClusters/pods/*"],
        "NotDataActions": ["Microsoft.Kubernetes/connectedClusters/pods/exec/action"],
        "AssignableScopes": ["/subscriptions/x"]
    })
}

#[tokio::test]
async fn role_definitions_are_created_listed_and_deleted_and_built_ins_are_immutable()
-> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let relay = TestRelay::start(dir.path()).await?;
    let admin = relay.admin()?;
    admin.create_ok("edge").await?;

    let listed = expect(&admin, Method::GET, "/api/v1/roledefinitions", None, 200).await?;
    let builtins: Vec<&str> = listed["items"]
        .as_array()
        .ok_or_else(|| anyhow!("no items"))?
        .iter()
        .filter(|r| r["builtIn"] == true)
        .filter_map(|r| r["name"].as_str())
        .collect();
    assert_eq!(
        builtins,
        [
            "Azure Arc Kubernetes Viewer",
            "Azure Arc Kubernetes Writer",
            "Azure Arc Kubernetes Admin",
            "Azure Arc Kubernetes Cluster Admin"
        ]
    );

    let created = expect(
        &admin,
        Method::POST,
        "/api/v1/roledefinitions",
        Some(&pod_reader()),
        201,
    )
    .await?;
    assert_eq!(created["id"], "pod-reader", "{created}");
    assert_eq!(created["builtIn"], false);
    assert_eq!(
        created["notDataActions"],
        json!(["Microsoft.Kubernetes/connectedClusters/pods/exec/action"])
    );
    let shown = expect(
        &admin,
        Method::GET,
        "/api/v1/roledefinitions/pod-reader",
        None,
        200,
    )
    .await?;
    assert_eq!(shown["name"], "Pod Reader");
    let viewer = expect(
        &admin,
        Method::GET,
        "/api/v1/roledefinitions/Viewer",
        None,
        200,
    )
    .await?;
    assert_eq!(
        (viewer["id"].as_str(), &viewer["builtIn"]),
        (Some(VIEWER), &json!(true))
    );

    // Same id or name again, a built-in's name or id, an invalid definition.
    let conflicts = [
        pod_reader(),
        json!({"id": "other", "name": "pod reader", "dataActions": ["Microsoft.Kubernetes/connectedClusters/pods/read"]}),
        json!({"name": "Viewer", "dataActions": ["Microsoft.Kubernetes/connectedClusters/pods/read"]}),
        json!({"id": VIEWER, "name": "Mine", "dataActions": ["Microsoft.Kubernetes/connectedClusters/pods/read"]}),
    ];
    for body in &conflicts {
        expect(
            &admin,
            Method::POST,
            "/api/v1/roledefinitions",
            Some(body),
            409,
        )
        .await?;
    }
    for body in [
        json!({"name": "No actions"}),
        json!({"name": "Elsewhere", "dataActions": ["Microsoft.Storage/storageAccounts/*"]}),
        json!({"id": "has space", "name": "Bad id", "dataActions": ["Microsoft.Kubernetes/connectedClusters/pods/read"]}),
        json!(["not", "an", "object"]),
    ] {
        expect(
            &admin,
            Method::POST,
            "/api/v1/roledefinitions",
            Some(&body),
            400,
        )
        .await?;
    }
    for name in [VIEWER, "Cluster Admin"] {
        let path = format!("/api/v1/roledefinitions/{}", name.replace(' ', "%20"));
        let msg = call(&admin, Method::DELETE, &path, None)
            .await?
            .status_message(409)?;
        assert!(msg.contains("built-in"), "{msg}");
    }

    // Assigned: 409 until the assignment goes.
    let a = assign(&admin, "Pod Reader", ALICE, "edge", None).await?;
    assert_eq!(a["roleId"], "pod-reader");
    let msg = call(
        &admin,
        Method::DELETE,
        "/api/v1/roledefinitions/pod-reader",
        None,
    )
    .await?
    .status_message(409)?;
    assert!(msg.contains("assigned"), "{msg}");
    expect(
        &admin,
        Method::DELETE,
        &format!("/api/v1/roleassignments/{}", id(&a)?),
        None,
        204,
    )
    .await?;
    expect(
        &admin,
        Method::DELETE,
        "/api/v1/roledefinitions/pod-reader",
        None,
        204,
    )
    .await?;
    expect(
        &admin,
        Method::GET,
        "/api/v1/roledefinitions/pod-reader",
        None,
        404,
    )
    .await?;
    expect(
        &admin,
        Method::DELETE,
        "/api/v1/roledefinitions/pod-reader",
        None,
        404,
    )
    .await?;

    // Everything needs the admin token.
    let anonymous = admin.client.get("/api/v1/roledefinitions", None).await?;
    anonymous.status_message(401)?;
    relay.stop().await
}

#[tokio::test]
async fn role_and_deny_assignments_are_validated_listed_and_deleted() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let relay = TestRelay::start(dir.path()).await?;
    let admin = relay.admin()?;
    admin.create_ok("edge").await?;
    admin.create_ok("core").await?;

    // Built-ins by short name, full name or id; principals are object ids (GUIDs lowercased) or group names.
    let a1 = assign(&admin, "Viewer", &ALICE.to_uppercase(), "edge", Some("dev")).await?;
    assert_eq!(a1["roleId"], VIEWER);
    assert_eq!(a1["roleName"], "Azure Arc Kubernetes Viewer");
    assert_eq!(a1["principalId"], ALICE);
    assert_eq!(a1["namespace"], "dev");
    assert_eq!(a1["cluster"], "edge");
    let a2 = assign(&admin, "azure arc kubernetes writer", DEVS, "edge", None).await?;
    assert_eq!(a2["roleId"], WRITER);
    assert!(a2.get("namespace").is_none(), "cluster scope: {a2}");
    let a3 = assign(&admin, VIEWER, "sre-team", "core", None).await?;
    assert_ne!(id(&a1)?, id(&a2)?);

    // Validation.
    let bad: [(Value, u16, &str); 8] = [
        (
            assign_body("Reader", ALICE, "edge", None),
            404,
            "role \"Reader\" not found",
        ),
        (
            assign_body("Viewer", ALICE, "ghost", None),
            404,
            "clusters \"ghost\" not found",
        ),
        (
            assign_body("Viewer", "alice@contoso.com", "edge", None),
            400,
            "object id",
        ),
        (
            assign_body("Viewer", "system:masters", "edge", None),
            400,
            "system:",
        ),
        (assign_body("Viewer", "", "edge", None), 400, "empty"),
        (
            assign_body("Viewer", ALICE, "edge", Some("Not_A_Label")),
            400,
            "namespace",
        ),
        (
            assign_body("Viewer", ALICE, "edge", Some("dev")),
            409,
            "already has role",
        ),
        (
            json!({"role": "Viewer", "principalId": ALICE, "cluster": "edge", "scope": "x"}),
            400,
            "unknown field",
        ),
    ];
    for (body, status, words) in bad {
        let reply = call(&admin, Method::POST, "/api/v1/roleassignments", Some(&body)).await?;
        let msg = reply
            .status_message(status)
            .with_context(|| format!("{body}"))?;
        assert!(msg.contains(words), "{body}: {msg}");
    }

    // Lists: all, one cluster, an unknown cluster, a bad query.
    let all = expect(&admin, Method::GET, "/api/v1/roleassignments", None, 200).await?;
    assert_eq!(all["items"].as_array().map(Vec::len), Some(3), "{all}");
    let edge = expect(
        &admin,
        Method::GET,
        "/api/v1/roleassignments?cluster=edge",
        None,
        200,
    )
    .await?;
    let ids: BTreeSet<String> = edge["items"]
        .as_array()
        .ok_or_else(|| anyhow!("no items"))?
        .iter()
        .map(id)
        .collect::<Result<_, _>>()?;
    assert_eq!(ids, BTreeSet::from([id(&a1)?, id(&a2)?]));
    expect(
        &admin,
        Method::GET,
        "/api/v1/roleassignments?cluster=ghost",
        None,
        404,
    )
    .await?;
    expect(
        &admin,
        Method::GET,
        "/api/v1/roleassignments?colour=red",
        None,
        400,
    )
    .await?;
    let one = expect(
        &admin,
        Method::GET,
        &format!("/api/v1/roleassignments/{}", id(&a3)?),
        None,
        200,
    )
    .await?;
    assert_eq!(one["principalId"], "sre-team");

    // Deny assignments: guard's pattern rules, principals or Everyone, exclusions.
    let deny = json!({
        "name": "no secrets in prod",
        "dataActions": ["Microsoft.Kubernetes/connectedClusters/secrets/*"],
        "principals": ["00000000-0000-0000-0000-000000000000"],
        "excludePrincipals": [BOB],
        "cluster": "edge",
        "namespace": "prod"
    });
    let d = expect(
        &admin,
        Method::POST,
        "/api/v1/denyassignments",
        Some(&deny),
        201,
    )
    .await?;
    assert_eq!(d["excludePrincipals"], json!([BOB]));
    assert_eq!(d["namespace"], "prod");
    for (patch, status) in [
        (json!({"dataActions": ["Microsoft.Compute/*"]}), 400),
        (json!({"dataActions": []}), 400),
        (json!({"principals": []}), 400),
        (json!({"principals": ["bob@contoso.com"]}), 400),
        (json!({"cluster": "ghost"}), 404),
    ] {
        let mut body = deny.clone();
        for (k, v) in patch.as_object().into_iter().flatten() {
            body[k] = v.clone();
        }
        expect(
            &admin,
            Method::POST,
            "/api/v1/denyassignments",
            Some(&body),
            status,
        )
        .await
        .with_context(|| format!("{patch}"))?;
    }
    let denies = expect(
        &admin,
        Method::GET,
        "/api/v1/denyassignments?cluster=edge",
        None,
        200,
    )
    .await?;
    assert_eq!(denies["items"].as_array().map(Vec::len), Some(1));
    let path = format!("/api/v1/denyassignments/{}", id(&d)?);
    expect(&admin, Method::GET, &path, None, 200).await?;
    expect(&admin, Method::DELETE, &path, None, 204).await?;
    expect(&admin, Method::DELETE, &path, None, 404).await?;

    // Deleting an assignment; then it is gone.
    let path = format!("/api/v1/roleassignments/{}", id(&a1)?);
    expect(&admin, Method::DELETE, &path, None, 204).await?;
    expect(&admin, Method::DELETE, &path, None, 404).await?;
    expect(&admin, Method::GET, &path, None, 404).await?;
    expect(&admin, Method::PUT, "/api/v1/roleassignments", None, 405).await?;
    relay.stop().await
}

#[tokio::test]
async fn a_connected_agent_gets_its_own_snapshot_at_hello_and_after_every_change()
-> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let relay = TestRelay::start(dir.path()).await?;
    let admin = relay.admin()?;
    let edge = admin.onboarded("edge").await?;
    let core = admin.onboarded("core").await?;
    expect(
        &admin,
        Method::POST,
        "/api/v1/roledefinitions",
        Some(&pod_reader()),
        201,
    )
    .await?;

    let (mut agent, first) = Agent::connect(&relay, &edge).await?;
    assert!(first.assignments.is_empty() && first.deny_assignments.is_empty());
    assert!(first.version > 0);
    let (mut other, _) = Agent::connect(&relay, &core).await?;

    // Each change reaches the agent as a new snapshot with a strictly greater version.
    let mut version = first.version;
    let mut next = async |agent: &mut Agent| -> anyhow::Result<Snapshot> {
        let s = within("the next snapshot", agent.snapshot()).await??;
        anyhow::ensure!(s.version > version, "version {} after {version}", s.version);
        version = s.version;
        Ok(s)
    };
    let a1 = assign(&admin, "Viewer", ALICE, "edge", Some("dev")).await?;
    let s = next(&mut agent).await?;
    assert_eq!(s.assignments.len(), 1);
    assert_eq!(s.assignments[0].id, id(&a1)?);
    assert_eq!(s.assignments[0].role_id, VIEWER);
    assert_eq!(
        s.assignments[0].scope,
        tether_auth::rbac::Scope::Namespace("dev".into())
    );
    assert!(s.roles.is_empty(), "built-ins are not listed");

    // A change to another cluster goes to that cluster's agent only; this one's next snapshot does not hold it.
    let elsewhere = assign(&admin, "Pod Reader", BOB, "core", None).await?;
    let s_other = within("core's snapshot", other.snapshot()).await??;
    assert_eq!(
        s_other
            .assignments
            .iter()
            .map(|a| a.id.clone())
            .collect::<Vec<_>>(),
        [id(&elsewhere)?]
    );
    assert_eq!(
        s_other.roles.len(),
        1,
        "the custom role it uses travels with it"
    );

    let a2 = assign(&admin, "Pod Reader", DEVS, "edge", None).await?;
    let s = next(&mut agent).await?;
    let ids: BTreeSet<String> = s.assignments.iter().map(|a| a.id.clone()).collect();
    assert_eq!(ids, BTreeSet::from([id(&a1)?, id(&a2)?]));
    assert_eq!(
        s.roles.iter().map(|r| r.id.as_str()).collect::<Vec<_>>(),
        ["pod-reader"]
    );

    let deny = json!({
        "name": "no exec",
        "dataActions": ["Microsoft.Kubernetes/connectedClusters/pods/exec/action"],
        "principals": ["*"],
        "cluster": "edge"
    });
    let d = expect(
        &admin,
        Method::POST,
        "/api/v1/denyassignments",
        Some(&deny),
        201,
    )
    .await?;
    let s = next(&mut agent).await?;
    assert_eq!(s.deny_assignments.len(), 1);
    assert_eq!(s.deny_assignments[0].id, id(&d)?);
    assert_eq!(s.deny_assignments[0].name, "no exec");

    expect(
        &admin,
        Method::DELETE,
        &format!("/api/v1/roleassignments/{}", id(&a1)?),
        None,
        204,
    )
    .await?;
    let s = next(&mut agent).await?;
    assert_eq!(
        s.assignments
            .iter()
            .map(|a| a.id.clone())
            .collect::<Vec<_>>(),
        [id(&a2)?]
    );
    expect(
        &admin,
        Method::DELETE,
        &format!("/api/v1/denyassignments/{}", id(&d)?),
        None,
        204,
    )
    .await?;
    let s = next(&mut agent).await?;
    assert!(s.deny_assignments.is_empty());

    // A new tunnel (an agent restart) gets the current snapshot at hello, same version.
    let (_again, current) = Agent::connect(&relay, &edge).await?;
    assert_eq!(current.version, version);
    assert_eq!(current, s);
    drop(agent);
    relay.stop().await
}

#[tokio::test]
async fn deleting_a_cluster_deletes_its_assignments_and_versions_keep_growing() -> anyhow::Result<()>
{
    let dir = tempfile::tempdir()?;
    let relay = TestRelay::start(dir.path()).await?;
    let admin = relay.admin()?;
    let edge = admin.onboarded("edge").await?;
    admin.create_ok("core").await?;
    assign(&admin, "Viewer", ALICE, "edge", None).await?;
    let kept = assign(&admin, "Viewer", ALICE, "core", None).await?;
    let deny = json!({"dataActions": ["Microsoft.Kubernetes/connectedClusters/*"], "principals": [BOB], "cluster": "edge"});
    expect(
        &admin,
        Method::POST,
        "/api/v1/denyassignments",
        Some(&deny),
        201,
    )
    .await?;
    let (agent, before) = Agent::connect(&relay, &edge).await?;
    assert_eq!(
        (before.assignments.len(), before.deny_assignments.len()),
        (1, 1)
    );

    assert_eq!(admin.delete("edge").await?.status, StatusCode::NO_CONTENT);
    within("the deleted cluster's tunnel to close", agent.conn.closed()).await?;
    let all = expect(&admin, Method::GET, "/api/v1/roleassignments", None, 200).await?;
    let left: Vec<String> = all["items"]
        .as_array()
        .into_iter()
        .flatten()
        .map(id)
        .collect::<Result<_, _>>()?;
    assert_eq!(left, [id(&kept)?]);
    let denies = expect(&admin, Method::GET, "/api/v1/denyassignments", None, 200).await?;
    assert_eq!(denies["items"], json!([]));
    expect(
        &admin,
        Method::GET,
        "/api/v1/roleassignments?cluster=edge",
        None,
        404,
    )
    .await?;

    // Registered again under the same name: nothing carried over, and a version its guard (which keeps the
    // last snapshot on disk) still takes.
    let edge = admin.onboarded("edge").await?;
    let (_agent, after) = Agent::connect(&relay, &edge).await?;
    assert!(after.assignments.is_empty() && after.deny_assignments.is_empty());
    assert!(
        after.version > before.version,
        "{} <= {}",
        after.version,
        before.version
    );
    relay.stop().await
}

#[tokio::test]
async fn export_and_import_carry_assignments_and_the_roles_they_use() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let old_relay = TestRelay::start(&dir.path().join("old")).await?;
    let new_relay = TestRelay::start(&dir.path().join("new")).await?;
    let old = old_relay.admin()?;
    let new = new_relay.admin()?;
    old.create_ok("edge").await?;
    expect(
        &old,
        Method::POST,
        "/api/v1/roledefinitions",
        Some(&pod_reader()),
        201,
    )
    .await?;
    assign(&old, "Viewer", ALICE, "edge", Some("dev")).await?;
    assign(&old, "Pod Reader", DEVS, "edge", None).await?;
    let deny = json!({"name": "no secrets", "dataActions": ["Microsoft.Kubernetes/connectedClusters/secrets/*"],
                      "principals": ["*"], "excludePrincipals": [BOB], "cluster": "edge", "namespace": "prod"});
    expect(
        &old,
        Method::POST,
        "/api/v1/denyassignments",
        Some(&deny),
        201,
    )
    .await?;

    let doc = expect(&old, Method::GET, "/api/v1/clusters/edge/export", None, 200).await?;
    assert_eq!(
        doc["roleAssignments"].as_array().map(Vec::len),
        Some(2),
        "{doc}"
    );
    assert_eq!(
        doc["denyAssignments"].as_array().map(Vec::len),
        Some(1),
        "{doc}"
    );
    assert_eq!(doc["roleDefinitions"][0]["id"], "pod-reader", "{doc}");

    // A role of the same id but other actions at the target is a conflict; nothing is registered.
    let clash = json!({"id": "pod-reader", "name": "Pod Reader", "dataActions": ["Microsoft.Kubernetes/connectedClusters/*"]});
    expect(
        &new,
        Method::POST,
        "/api/v1/roledefinitions",
        Some(&clash),
        201,
    )
    .await?;
    expect(
        &new,
        Method::POST,
        "/api/v1/clusters/import",
        Some(&doc),
        409,
    )
    .await?;
    assert_eq!(new.show("edge").await?.status, StatusCode::NOT_FOUND);
    expect(
        &new,
        Method::DELETE,
        "/api/v1/roledefinitions/pod-reader",
        None,
        204,
    )
    .await?;
    // An assignment whose role exists nowhere is invalid.
    let mut orphan = doc.clone();
    orphan["roleDefinitions"] = json!([]);
    expect(
        &new,
        Method::POST,
        "/api/v1/clusters/import",
        Some(&orphan),
        400,
    )
    .await?;

    let imported = expect(
        &new,
        Method::POST,
        "/api/v1/clusters/import",
        Some(&doc),
        201,
    )
    .await?;
    assert!(imported["onboardingToken"].is_string());
    let triples = |v: &Value| -> BTreeSet<(String, String, String)> {
        v["items"]
            .as_array()
            .into_iter()
            .flatten()
            .map(|a| {
                let s = |k: &str| a[k].as_str().unwrap_or_default().to_owned();
                (s("roleId"), s("principalId"), s("namespace"))
            })
            .collect()
    };
    let here = expect(
        &new,
        Method::GET,
        "/api/v1/roleassignments?cluster=edge",
        None,
        200,
    )
    .await?;
    let there = expect(
        &old,
        Method::GET,
        "/api/v1/roleassignments?cluster=edge",
        None,
        200,
    )
    .await?;
    assert_eq!(triples(&here), triples(&there));
    let denies = expect(
        &new,
        Method::GET,
        "/api/v1/denyassignments?cluster=edge",
        None,
        200,
    )
    .await?;
    assert_eq!(denies["items"][0]["excludePrincipals"], json!([BOB]));
    assert_eq!(denies["items"][0]["namespace"], "prod");
    let role = expect(
        &new,
        Method::GET,
        "/api/v1/roledefinitions/pod-reader",
        None,
        200,
    )
    .await?;
    assert_eq!(
        role["dataActions"],
        json!(["Microsoft.Kubernetes/connectedClusters/pods/*"])
    );

    // The agent onboarding at the new relay gets them in its first snapshot.
    let token = imported["onboardingToken"].as_str().unwrap_or_default();
    let identity = new.onboard("edge", token).await?;
    let (_agent, snapshot) = Agent::connect(&new_relay, &identity).await?;
    assert_eq!(
        (
            snapshot.assignments.len(),
            snapshot.deny_assignments.len(),
            snapshot.roles.len()
        ),
        (2, 1, 1)
    );
    old_relay.stop().await?;
    new_relay.stop().await
}

#[tokio::test]
async fn resolve_groups_answers_from_the_directory() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let relay = TestRelay::start(dir.path()).await?;
    let admin = relay.admin()?;
    let edge = admin.onboarded("edge").await?;
    let set = expect(
        &admin,
        Method::PUT,
        &format!("/api/v1/directory/users/{ALICE}"),
        Some(&json!({"groups": [DEVS, "sre-team", DEVS], "tid": TENANT})),
        200,
    )
    .await?;
    assert_eq!(
        set["groups"],
        json!([DEVS, "sre-team"]),
        "sorted, without duplicates"
    );
    expect(
        &admin,
        Method::PUT,
        &format!("/api/v1/directory/users/{BOB}"),
        Some(&json!({"groups": ["bob@contoso.com"]})),
        400,
    )
    .await?;
    expect(
        &admin,
        Method::PUT,
        "/api/v1/directory/users/alice@contoso.com",
        Some(&json!({"groups": []})),
        400,
    )
    .await?;
    let shown = expect(
        &admin,
        Method::GET,
        &format!("/api/v1/directory/users/{ALICE}"),
        None,
        200,
    )
    .await?;
    assert_eq!(shown["tid"], TENANT);

    let (mut agent, _) = Agent::connect(&relay, &edge).await?;
    let mut ask = async |request_id: u64, tid: &str, oid: &str| -> anyhow::Result<Groups> {
        agent
            .send(Message::ResolveGroups(ResolveGroups {
                request_id,
                tid: tid.into(),
                oid: oid.into(),
            }))
            .await?;
        match agent.recv().await? {
            Message::Groups(g) => Ok(g),
            other => anyhow::bail!("expected groups, got {other:?}"),
        }
    };
    let found = ask(7, TENANT, ALICE).await?;
    assert_eq!(found.request_id, 7);
    assert_eq!(
        found.groups,
        Some(vec![DEVS.to_owned(), "sre-team".to_owned()])
    );
    assert!(found.error.is_none());
    for (n, tid, oid) in [(8, OTHER_TENANT, ALICE), (9, TENANT, BOB)] {
        let missing = ask(n, tid, oid).await?;
        assert_eq!(missing.request_id, n);
        assert!(missing.groups.is_none());
        assert!(
            missing
                .error
                .as_deref()
                .is_some_and(|e| e.contains("not in the relay's directory")),
            "{missing:?}"
        );
    }
    expect(
        &admin,
        Method::DELETE,
        &format!("/api/v1/directory/users/{ALICE}"),
        None,
        204,
    )
    .await?;
    assert!(ask(10, TENANT, ALICE).await?.groups.is_none());
    expect(
        &admin,
        Method::DELETE,
        &format!("/api/v1/directory/users/{ALICE}"),
        None,
        404,
    )
    .await?;
    relay.stop().await
}

// ---- Entra-style tokens at the relay ----

use tether_testkit::idp::Idp;

/// Signs tokens with jsonwebtoken and a fresh RSA key published at the IdP as `kid` "rs1".
struct Minter {
    key: jsonwebtoken::EncodingKey,
    issuer: String,
}

impl Minter {
    fn new(idp: &Idp) -> anyhow::Result<Minter> {
        let rsa = rcgen::KeyPair::generate_for(&rcgen::PKCS_RSA_SHA256)?;
        let key = jsonwebtoken::EncodingKey::from_rsa_pem(rsa.serialize_pem().as_bytes())?;
        let mut jwk =
            jsonwebtoken::jwk::Jwk::from_encoding_key(&key, jsonwebtoken::Algorithm::RS256)?;
        jwk.common.key_id = Some("rs1".into());
        jwk.common.public_key_use = Some(jsonwebtoken::jwk::PublicKeyUse::Signature);
        idp.publish(serde_json::to_value(jwk)?);
        Ok(Minter {
            key,
            issuer: idp.v2_issuer(TENANT),
        })
    }

    fn claims(&self, extra: Value) -> Value {
        let now = now();
        let mut c = json!({
            "iss": self.issuer, "tid": TENANT, "aud": AUDIENCE, "iat": now - 60, "nbf": now - 60,
            "exp": now + 3600, "oid": ALICE, "preferred_username": "alice@contoso.example",
            "groups": [DEVS], "ver": "2.0",
        });
        for (k, v) in extra.as_object().into_iter().flatten() {
            if v.is_null() {
                c.as_object_mut().map(|o| o.remove(k));
            } else {
                c[k] = v.clone();
            }
        }
        c
    }

    fn token(&self, extra: Value) -> anyhow::Result<String> {
        let mut header = jsonwebtoken::Header::new(jsonwebtoken::Algorithm::RS256);
        header.kid = Some("rs1".into());
        Ok(jsonwebtoken::encode(
            &header,
            &self.claims(extra),
            &self.key,
        )?)
    }

    /// The classic `alg: none` token: no signature at all.
    fn unsigned(&self) -> String {
        let b64 = |v: Value| URL_SAFE_NO_PAD.encode(v.to_string());
        format!(
            "{}.{}.",
            b64(json!({"alg": "none", "typ": "JWT", "kid": "rs1"})),
            b64(self.claims(json!({})))
        )
    }
}

fn now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or_default()
}

/// Tokens minted by PyJWT (with its own keys, published at the IdP), or `None` with a printed reason.
fn pyjwt_tokens(idp: &Idp) -> anyhow::Result<Option<tether_testkit::idp::Minted>> {
    if tether_testkit::tools::require(tether_testkit::tools::Tool::PyJwt).is_none() {
        return Ok(None);
    }
    let minted = tether_testkit::idp::mint(idp, AUDIENCE)?;
    idp.publish(minted.key("k1"));
    Ok(Some(minted))
}

async fn user_get(relay: &TestRelay, token: &str) -> anyhow::Result<Reply> {
    relay
        .client()?
        .get("/clusters/edge/api/v1/namespaces", Some(token))
        .await
}

#[tokio::test]
async fn entra_style_tokens_are_checked_before_anything_enters_the_tunnel() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let idp = Idp::start().await?;
    let minter = Minter::new(&idp)?;
    // Minted now, so its key is published before the relay first fetches the JWKS (an unknown kid refetches
    // at most every 30 s).
    let py = pyjwt_tokens(&idp)?;
    let mut config = tether_relay::Config::new(dir.path().join("relay"));
    config.entra = Some(tether_relay::EntraConfig {
        tenants: vec![TENANT.into()],
        audiences: vec![AUDIENCE.into()],
        authority: Some(idp.v2_authority()),
        authority_ca: Some(idp.write_ca(dir.path())?),
    });
    let relay = TestRelay::start_with(config).await?;
    let admin = relay.admin()?;
    let edge = admin.onboarded("edge").await?;
    let (agent, _) = Agent::connect(&relay, &edge).await?;

    let mut passed = 0;
    let mut passes = async |token: &str, what: &str| -> anyhow::Result<()> {
        let reply = user_get(&relay, token).await?;
        anyhow::ensure!(reply.status == StatusCode::OK, "{what}: {reply:?}");
        anyhow::ensure!(reply.json()?["reachedAgent"] == true, "{what}: {reply:?}");
        passed += 1;
        anyhow::ensure!(
            agent.http_streams() == passed,
            "{what}: one stream per passing request"
        );
        Ok(())
    };
    passes(&minter.token(json!({}))?, "a valid token").await?;
    passes("opaque-service-account-token", "an opaque token").await?;
    let sa = format!(
        "{}.{}.c2ln",
        URL_SAFE_NO_PAD.encode(br#"{"alg":"RS256","kid":"sa"}"#),
        URL_SAFE_NO_PAD.encode(br#"{"iss":"https://kubernetes.default.svc.cluster.local","sub":"system:serviceaccount:default:app"}"#)
    );
    passes(&sa, "a Kubernetes service-account JWT").await?;

    let refused = async |token: &str, words: &str| -> anyhow::Result<()> {
        let before = agent.http_streams();
        let msg = user_get(&relay, token).await?.status_message(401)?;
        anyhow::ensure!(msg.contains(words), "expected {words:?} in {msg:?}");
        anyhow::ensure!(
            agent.http_streams() == before,
            "{words}: a stream was opened"
        );
        Ok(())
    };
    refused(
        &minter.token(json!({"aud": "api://someone-else"}))?,
        "audience",
    )
    .await?;
    refused(&minter.unsigned(), "algorithm \"none\"").await?;
    refused(
        &minter.token(json!({"iat": now() - 7200, "nbf": now() - 7200, "exp": now() - 3600}))?,
        "expired",
    )
    .await?;
    refused(
        &minter.token(json!({"iss": idp.v2_issuer(OTHER_TENANT), "tid": OTHER_TENANT}))?,
        "not trusted",
    )
    .await?;
    let mut tampered: Vec<String> = minter
        .token(json!({}))?
        .split('.')
        .map(str::to_owned)
        .collect();
    tampered[1] = URL_SAFE_NO_PAD.encode(minter.claims(json!({"oid": BOB})).to_string());
    refused(&tampered.join("."), "signature").await?;

    // Group overage: refused until the relay's directory knows the user.
    let overage = minter.token(json!({
        "groups": null,
        "_claim_names": {"groups": "src1"},
        "_claim_sources": {"src1": {"endpoint": "https://graph.windows.net/x/users/y/getMemberObjects"}}
    }))?;
    refused(&overage, "not in the relay's directory").await?;
    expect(
        &admin,
        Method::PUT,
        &format!("/api/v1/directory/users/{ALICE}"),
        Some(&json!({"groups": [DEVS]})),
        200,
    )
    .await?;
    passes(&overage, "a group overage the directory resolves").await?;

    // An independent implementation's tokens get the same treatment.
    if let Some(py) = py {
        let token = |case: &str| py.token(case);
        passes(&token("valid_v2"), "a valid PyJWT token").await?;
        refused(&token("wrong_audience"), "audience").await?;
        refused(&token("none"), "algorithm").await?;
        refused(&token("expired"), "expired").await?;
    }
    relay.stop().await
}

#[tokio::test]
async fn without_entra_settings_every_token_passes_through() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let relay = TestRelay::start(dir.path()).await?;
    let edge = relay.admin()?.onboarded("edge").await?;
    let (agent, _) = Agent::connect(&relay, &edge).await?;
    let b64 = |v: Value| URL_SAFE_NO_PAD.encode(v.to_string());
    let expired_entra = format!(
        "{}.{}.c2ln",
        b64(json!({"alg": "none"})),
        b64(json!({"iss": format!("https://login.microsoftonline.com/{TENANT}/v2.0"), "exp": 1}))
    );
    let reply = user_get(&relay, &expired_entra).await?;
    assert_eq!(reply.status, StatusCode::OK, "{reply:?}");
    assert_eq!(reply.json()?["authorization"], true);
    assert_eq!(agent.http_streams(), 1);
    relay.stop().await
}

#[test]
fn binary_exits_64_on_incomplete_entra_settings() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    for args in [
        &["--entra-tenant", TENANT][..],
        &["--entra-audience", AUDIENCE][..],
        &[
            "--entra-tenant",
            TENANT,
            "--entra-audience",
            AUDIENCE,
            "--entra-authority",
            "http://idp",
        ][..],
    ] {
        let out = Command::new(env!("CARGO_BIN_EXE_tether-relay"))
            .arg("--data-dir")
            .arg(dir.path())
            .args(["--listen", "127.0.0.1:0"])
            .args(args)
            .env_remove("RUST_LOG")
            .output()?;
        assert_eq!(out.status.code(), Some(64), "{args:?}");
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(
            stderr.contains("invalid Entra settings"),
            "{args:?}: {stderr}"
        );
    }
    Ok(())
}
