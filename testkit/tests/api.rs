//! The sample apiserver's HTTP behaviour where kubectl does not show it: status codes, Status bodies, discovery,
//! paging, optimistic concurrency, patches, watches and exec framing. Over HTTP/1.1 and h2.

mod support;

use anyhow::Context as _;
use futures_util::StreamExt as _;
use http::{Method, StatusCode};
use serde_json::{Value, json};
use support::{Client, Events, start};

const CM: &str = "/api/v1/namespaces/default/configmaps";

fn cm(name: &str, labels: Value) -> Value {
    json!({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": name, "labels": labels}, "data": {"k": "v"}})
}

#[tokio::test]
async fn unauthenticated_requests_get_a_401_status_on_every_path() -> anyhow::Result<()> {
    let fx = start().await?;
    for h2 in [false, true] {
        let client = Client::new(&fx.server, h2)?.without_token();
        for path in [
            "/version",
            "/healthz",
            "/api",
            "/api/v1/namespaces",
            "/nope",
        ] {
            let reply = client.get(path).await?;
            assert_eq!(reply.status, StatusCode::UNAUTHORIZED, "{path}");
            assert_eq!(
                reply.json()?,
                json!({"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
                       "message": "Unauthorized", "reason": "Unauthorized", "code": 401})
            );
        }
    }
    Ok(())
}

#[tokio::test]
async fn only_requests_without_a_valid_token_count_as_unauthenticated() -> anyhow::Result<()> {
    let fx = start().await?;
    let client = Client::new(&fx.server, false)?;
    assert_eq!(client.get("/version").await?.status, StatusCode::OK);
    assert_eq!(fx.server.unauthenticated_requests(), 0);
    let anonymous = Client::new(&fx.server, false)?.without_token();
    assert_eq!(
        anonymous.get("/version").await?.status,
        StatusCode::UNAUTHORIZED
    );
    let mut wrong = Client::new(&fx.server, true)?;
    wrong.token = Some("not-a-token".into());
    assert_eq!(
        wrong.get("/api/v1/namespaces").await?.status,
        StatusCode::UNAUTHORIZED
    );
    assert_eq!(fx.server.unauthenticated_requests(), 2);
    assert_eq!(client.get("/healthz").await?.status, StatusCode::OK);
    assert_eq!(fx.server.unauthenticated_requests(), 2);
    Ok(())
}

#[tokio::test]
async fn an_added_node_is_listed_and_watchers_see_it_added() -> anyhow::Result<()> {
    let fx = start().await?;
    let client = Client::new(&fx.server, false)?;
    let list = client.get("/api/v1/nodes").await?.json()?;
    let rv = list["metadata"]["resourceVersion"]
        .as_str()
        .context("rv")?
        .to_string();
    let response = client
        .send(
            Method::GET,
            &format!("/api/v1/nodes?watch=1&resourceVersion={rv}"),
            None,
            Vec::new(),
        )
        .await?;
    let mut events = Events::new(response);
    fx.server.add_node(
        "worker-2",
        "8",
        "16Gi",
        &[("eks.amazonaws.com/nodegroup", "ng-1")],
        "aws:///eu-west-1a/i-0123456789abcdef0",
    )?;
    let event = events.next().await?.context("event")?;
    assert_eq!(event["type"], "ADDED");
    let node = &event["object"];
    assert_eq!(node["metadata"]["name"], "worker-2");
    assert_eq!(
        node["metadata"]["labels"]["eks.amazonaws.com/nodegroup"],
        "ng-1"
    );
    assert_eq!(
        node["metadata"]["labels"]["kubernetes.io/hostname"],
        "worker-2"
    );
    assert_eq!(
        node["spec"]["providerID"],
        "aws:///eu-west-1a/i-0123456789abcdef0"
    );
    assert_eq!(node["status"]["capacity"]["cpu"], "8");
    assert_eq!(node["status"]["allocatable"]["memory"], "16Gi");

    let list = client.get("/api/v1/nodes").await?.json()?;
    let names: Vec<&str> = list["items"]
        .as_array()
        .context("items")?
        .iter()
        .filter_map(|n| n["metadata"]["name"].as_str())
        .collect();
    assert_eq!(names, ["sample-node-1", "worker-2"]);
    // The seeded node keeps its shape.
    let seeded = client.get("/api/v1/nodes/sample-node-1").await?.json()?;
    assert_eq!(seeded["spec"]["providerID"], "sample://sample-node-1");
    assert_eq!(seeded["status"]["capacity"]["cpu"], "4");
    assert!(
        fx.server.add_node("worker-2", "1", "1Gi", &[], "").is_err(),
        "a second node of the same name"
    );
    Ok(())
}

#[tokio::test]
async fn extra_tokens_authenticate_and_requests_are_counted() -> anyhow::Result<()> {
    let fx = start().await?;
    fx.server.add_token("bob-token", "bob", &["dev"]);
    let mut client = Client::new(&fx.server, false)?;
    client.token = Some("bob-token".into());
    let before = fx.server.requests_seen();
    assert_eq!(client.get("/healthz").await?.text(), "ok");
    assert_eq!(client.get("/readyz").await?.status, StatusCode::OK);
    assert_eq!(fx.server.requests_seen(), before + 2);
    Ok(())
}

#[tokio::test]
async fn discovery_documents() -> anyhow::Result<()> {
    let fx = start().await?;
    let client = Client::new(&fx.server, true)?;
    let api = client.get("/api").await?.json()?;
    assert_eq!(api["kind"], "APIVersions");
    assert_eq!(api["versions"], json!(["v1"]));
    let v1 = client.get("/api/v1").await?.json()?;
    let resources = v1["resources"].as_array().context("resources")?;
    let cms = resources
        .iter()
        .find(|r| r["name"] == "configmaps")
        .context("configmaps")?;
    assert_eq!(cms["shortNames"], json!(["cm"]));
    assert_eq!(cms["namespaced"], true);
    assert!(
        cms["verbs"]
            .as_array()
            .is_some_and(|v| v.contains(&json!("watch")))
    );
    let nodes = resources
        .iter()
        .find(|r| r["name"] == "nodes")
        .context("nodes")?;
    assert_eq!(nodes["namespaced"], false);
    assert!(resources.iter().any(|r| r["name"] == "pods/exec"));
    assert_eq!(client.get("/apis").await?.json()?["kind"], "APIGroupList");
    let version = client.get("/version").await?.json()?;
    assert_eq!(version["gitVersion"], "v1.33.0-tether-sample");
    let node = client.get("/api/v1/nodes/sample-node-1").await?.json()?;
    assert_eq!(
        node["status"]["capacity"],
        json!({"cpu": "4", "memory": "8Gi", "pods": "110", "ephemeral-storage": "100Gi"})
    );
    assert!(node["spec"]["providerID"].is_string());
    Ok(())
}

#[tokio::test]
async fn create_conflicts_and_validation() -> anyhow::Result<()> {
    let fx = start().await?;
    let client = Client::new(&fx.server, false)?;
    let created = client
        .send_json(Method::POST, CM, "application/json", &cm("a", json!({})))
        .await?;
    assert_eq!(created.status, StatusCode::CREATED);
    let obj = created.json()?;
    assert!(obj["metadata"]["uid"].is_string() && obj["metadata"]["creationTimestamp"].is_string());

    let again = client
        .send_json(Method::POST, CM, "application/json", &cm("a", json!({})))
        .await?;
    assert_eq!(again.status, StatusCode::CONFLICT);
    assert_eq!(again.json()?["reason"], "AlreadyExists");

    let generated = json!({"metadata": {"generateName": "gen-"}, "data": {}});
    let made = client
        .send_json(Method::POST, CM, "application/json", &generated)
        .await?
        .json()?;
    assert!(
        made["metadata"]["name"]
            .as_str()
            .is_some_and(|n| n.starts_with("gen-") && n.len() == 9),
        "{made}"
    );

    let nameless = client
        .send_json(Method::POST, CM, "application/json", &json!({"data": {}}))
        .await?;
    assert_eq!(nameless.status, StatusCode::UNPROCESSABLE_ENTITY);
    assert_eq!(nameless.json()?["reason"], "Invalid");
    let bad_name = client
        .send_json(
            Method::POST,
            CM,
            "application/json",
            &cm("Bad_Name", json!({})),
        )
        .await?;
    assert_eq!(bad_name.status, StatusCode::UNPROCESSABLE_ENTITY);
    let garbage = client
        .request(
            Method::POST,
            CM,
            Some("application/json"),
            b"{not json".to_vec(),
        )
        .await?;
    assert_eq!(garbage.status, StatusCode::BAD_REQUEST);
    let yaml = client
        .request(
            Method::POST,
            CM,
            Some("application/yaml"),
            b"metadata:\n  name: from-yaml\ndata:\n  a: b\n".to_vec(),
        )
        .await?;
    assert_eq!(yaml.status, StatusCode::CREATED, "{}", yaml.text());
    let wrong_ns = json!({"metadata": {"name": "x", "namespace": "kube-system"}});
    assert_eq!(
        client
            .send_json(Method::POST, CM, "application/json", &wrong_ns)
            .await?
            .status,
        StatusCode::BAD_REQUEST
    );
    let no_ns = client
        .send_json(
            Method::POST,
            "/api/v1/namespaces/ghost/configmaps",
            "application/json",
            &cm("x", json!({})),
        )
        .await?;
    assert_eq!(no_ns.status, StatusCode::NOT_FOUND);
    assert_eq!(no_ns.json()?["message"], "namespaces \"ghost\" not found");
    let text = client
        .request(Method::POST, CM, Some("text/plain"), b"x".to_vec())
        .await?;
    assert_eq!(text.status, StatusCode::UNSUPPORTED_MEDIA_TYPE);

    let missing = client.get(&format!("{CM}/nope")).await?;
    assert_eq!(missing.status, StatusCode::NOT_FOUND);
    let status = missing.json()?;
    assert_eq!(
        (status["message"].as_str(), status["reason"].as_str()),
        (Some("configmaps \"nope\" not found"), Some("NotFound"))
    );
    assert_eq!(
        client.get("/api/v1/widgets").await?.status,
        StatusCode::NOT_FOUND
    );
    Ok(())
}

#[tokio::test]
async fn oversized_bodies_are_refused() -> anyhow::Result<()> {
    let fx = start().await?;
    for h2 in [false, true] {
        let client = Client::new(&fx.server, h2)?;
        let big = json!({"metadata": {"name": "big"}, "data": {"k": "x".repeat(4 * 1024 * 1024)}});
        let reply = client
            .send_json(Method::POST, CM, "application/json", &big)
            .await?;
        assert_eq!(reply.status, StatusCode::PAYLOAD_TOO_LARGE);
        assert_eq!(reply.json()?["reason"], "RequestEntityTooLarge");
    }
    Ok(())
}

#[tokio::test]
async fn updates_use_optimistic_concurrency() -> anyhow::Result<()> {
    let fx = start().await?;
    let client = Client::new(&fx.server, false)?;
    let created = client
        .send_json(Method::POST, CM, "application/json", &cm("occ", json!({})))
        .await?
        .json()?;
    let mut next = created.clone();
    next["data"]["k"] = json!("w");
    let updated = client
        .send_json(Method::PUT, &format!("{CM}/occ"), "application/json", &next)
        .await?;
    assert_eq!(updated.status, StatusCode::OK);
    let updated = updated.json()?;
    let rv = |o: &Value| {
        o["metadata"]["resourceVersion"]
            .as_str()
            .and_then(|s| s.parse::<u64>().ok())
    };
    assert!(rv(&updated) > rv(&created));
    assert_eq!(updated["metadata"]["uid"], created["metadata"]["uid"]);

    // `next` still carries the old resourceVersion.
    let stale = client
        .send_json(Method::PUT, &format!("{CM}/occ"), "application/json", &next)
        .await?;
    assert_eq!(stale.status, StatusCode::CONFLICT);
    assert_eq!(stale.json()?["reason"], "Conflict");
    let renamed = json!({"metadata": {"name": "other"}});
    assert_eq!(
        client
            .send_json(
                Method::PUT,
                &format!("{CM}/occ"),
                "application/json",
                &renamed
            )
            .await?
            .status,
        StatusCode::BAD_REQUEST
    );

    let merged = client
        .send_json(
            Method::PATCH,
            &format!("{CM}/occ"),
            "application/merge-patch+json",
            &json!({"data": {"k": null, "n": "1"}}),
        )
        .await?;
    assert_eq!(merged.status, StatusCode::OK);
    assert_eq!(merged.json()?["data"], json!({"n": "1"}));
    let patched = client
        .send_json(
            Method::PATCH,
            &format!("{CM}/occ"),
            "application/json-patch+json",
            &json!([{"op": "add", "path": "/data/j", "value": "2"}]),
        )
        .await?;
    assert_eq!(patched.json()?["data"], json!({"n": "1", "j": "2"}));
    let stale_patch = json!({"metadata": {"resourceVersion": "1"}, "data": {"x": "y"}});
    let reply = client
        .send_json(
            Method::PATCH,
            &format!("{CM}/occ"),
            "application/merge-patch+json",
            &stale_patch,
        )
        .await?;
    assert_eq!(reply.status, StatusCode::CONFLICT);

    let deleted = client
        .request(Method::DELETE, &format!("{CM}/occ"), None, Vec::new())
        .await?;
    assert_eq!(deleted.status, StatusCode::OK);
    assert_eq!(deleted.json()?["metadata"]["name"], "occ");
    let protected = client
        .request(
            Method::DELETE,
            "/api/v1/namespaces/default",
            None,
            Vec::new(),
        )
        .await?;
    assert_eq!(protected.status, StatusCode::FORBIDDEN);
    Ok(())
}

#[tokio::test]
async fn lists_page_and_filter() -> anyhow::Result<()> {
    let fx = start().await?;
    fx.server.create_configmaps("paged", "p-", 25);
    let client = Client::new(&fx.server, true)?;
    let mut names = Vec::new();
    let mut cont = String::new();
    let mut rvs = Vec::new();
    loop {
        let page = client
            .get(&format!(
                "/api/v1/namespaces/paged/configmaps?limit=10&continue={cont}"
            ))
            .await?
            .json()?;
        assert_eq!(page["kind"], "ConfigMapList");
        rvs.push(page["metadata"]["resourceVersion"].clone());
        for item in page["items"].as_array().context("items")? {
            names.push(
                item["metadata"]["name"]
                    .as_str()
                    .unwrap_or_default()
                    .to_string(),
            );
        }
        match page["metadata"]["continue"].as_str() {
            Some(c) => cont = c.to_string(),
            None => break,
        }
    }
    assert_eq!(names.len(), 25);
    assert!(
        rvs.windows(2).all(|w| w[0] == w[1]),
        "pages share the first page's resourceVersion: {rvs:?}"
    );
    assert_eq!(
        client.get(&format!("{CM}?continue=garbage")).await?.status,
        StatusCode::BAD_REQUEST
    );

    client
        .send_json(
            Method::POST,
            CM,
            "application/json",
            &cm("red", json!({"color": "red"})),
        )
        .await?;
    client
        .send_json(
            Method::POST,
            CM,
            "application/json",
            &cm("blue", json!({"color": "blue"})),
        )
        .await?;
    let red = client
        .get(&format!("{CM}?labelSelector=color%3Dred"))
        .await?
        .json()?;
    assert_eq!(red["items"].as_array().map(Vec::len), Some(1));
    let not_red = client
        .get(&format!("{CM}?labelSelector=color!%3Dred,color"))
        .await?
        .json()?;
    assert_eq!(not_red["items"][0]["metadata"]["name"], "blue");
    let by_name = client
        .get(&format!("{CM}?fieldSelector=metadata.name%3Dblue"))
        .await?
        .json()?;
    assert_eq!(by_name["items"].as_array().map(Vec::len), Some(1));
    let all = client.get("/api/v1/configmaps").await?.json()?;
    assert_eq!(all["items"].as_array().map(Vec::len), Some(27));
    Ok(())
}

#[tokio::test]
async fn tables_for_kubectl_get() -> anyhow::Result<()> {
    let fx = start().await?;
    let mut client = Client::new(&fx.server, false)?;
    client.accept = Some("application/json;as=Table;v=v1;g=meta.k8s.io,application/json".into());
    let table = client
        .get("/api/v1/namespaces/default/pods")
        .await?
        .json()?;
    assert_eq!(table["kind"], "Table");
    assert_eq!(table["columnDefinitions"][0]["name"], "Name");
    assert_eq!(table["rows"][0]["cells"][0], "demo");
    assert_eq!(table["rows"][0]["object"]["kind"], "PartialObjectMetadata");
    client.accept = Some("application/vnd.kubernetes.protobuf".into());
    assert_eq!(
        client.get("/api/v1/namespaces").await?.status,
        StatusCode::NOT_ACCEPTABLE
    );
    Ok(())
}

#[tokio::test]
async fn watches_replay_filter_and_end() -> anyhow::Result<()> {
    let fx = start().await?;
    let client = Client::new(&fx.server, false)?;
    let list = client.get(CM).await?.json()?;
    let rv = list["metadata"]["resourceVersion"]
        .as_str()
        .context("rv")?
        .to_string();
    client
        .send_json(
            Method::POST,
            CM,
            "application/json",
            &cm("w", json!({"app": "x"})),
        )
        .await?;

    // Resuming from the list's resourceVersion replays the create that happened since.
    let response = client
        .send(
            Method::GET,
            &format!("{CM}?watch=1&resourceVersion={rv}"),
            None,
            Vec::new(),
        )
        .await?;
    assert_eq!(response.status(), StatusCode::OK);
    let mut events = Events::new(response);
    let event = events.next().await?.context("event")?;
    assert_eq!(
        (
            event["type"].as_str(),
            event["object"]["metadata"]["name"].as_str()
        ),
        (Some("ADDED"), Some("w"))
    );
    assert_eq!(event["object"]["kind"], "ConfigMap");

    // A selector watch sees an object leave the selection as DELETED.
    let response = client
        .send(
            Method::GET,
            &format!("{CM}?watch=true&labelSelector=app%3Dx"),
            None,
            Vec::new(),
        )
        .await?;
    let mut selected = Events::new(response);
    assert_eq!(selected.next().await?.context("initial")?["type"], "ADDED");
    client
        .send_json(
            Method::PATCH,
            &format!("{CM}/w"),
            "application/merge-patch+json",
            &json!({"metadata": {"labels": {"app": "y"}}}),
        )
        .await?;
    assert_eq!(
        events.next().await?.context("modified")?["type"],
        "MODIFIED"
    );
    assert_eq!(selected.next().await?.context("left")?["type"], "DELETED");

    // timeoutSeconds ends the stream.
    let response = client
        .send(
            Method::GET,
            &format!("{CM}?watch=1&timeoutSeconds=1"),
            None,
            Vec::new(),
        )
        .await?;
    let mut short = Events::new(response);
    assert_eq!(short.next().await?.context("initial")?["type"], "ADDED");
    assert!(short.next().await?.is_none());
    Ok(())
}

#[tokio::test]
async fn a_watch_from_a_compacted_resource_version_gets_410() -> anyhow::Result<()> {
    let fx = start().await?;
    // More changes than the store's history keeps.
    fx.server.create_configmaps("churn", "c-", 20_001);
    let client = Client::new(&fx.server, false)?;
    let response = client
        .send(
            Method::GET,
            "/api/v1/namespaces/default/configmaps?watch=1&resourceVersion=2",
            None,
            Vec::new(),
        )
        .await?;
    let mut events = Events::new(response);
    let event = events.next().await?.context("error event")?;
    assert_eq!(event["type"], "ERROR");
    assert_eq!(
        (
            event["object"]["code"].as_u64(),
            event["object"]["reason"].as_str()
        ),
        (Some(410), Some("Expired"))
    );
    Ok(())
}

#[tokio::test]
async fn exec_v4_over_a_raw_websocket() -> anyhow::Result<()> {
    use tokio_tungstenite::tungstenite::{Message, client::IntoClientRequest as _};
    let fx = start().await?;
    let tcp = tokio::net::TcpStream::connect(fx.server.addr()).await?;
    let tls = tether_testkit::certs::client_config(fx.server.ca_pem().as_bytes(), &[b"http/1.1"])?;
    let tls = tokio_rustls::TlsConnector::from(tls)
        .connect(
            rustls::pki_types::ServerName::try_from("localhost")?.to_owned(),
            tcp,
        )
        .await?;
    let url = format!(
        "wss://localhost:{}/api/v1/namespaces/default/pods/demo/exec?command=sh&command=-c&command=echo%20hello%3B%20exit%207&stdout=true&stderr=true",
        fx.server.addr().port()
    );
    let mut request = url.into_client_request()?;
    request.headers_mut().insert(
        "authorization",
        format!("Bearer {}", fx.server.token()).parse()?,
    );
    request
        .headers_mut()
        .insert("sec-websocket-protocol", "v4.channel.k8s.io".parse()?);
    let (mut ws, response) = tokio_tungstenite::client_async(request, tls).await?;
    assert_eq!(
        response
            .headers()
            .get("sec-websocket-protocol")
            .and_then(|v| v.to_str().ok()),
        Some("v4.channel.k8s.io")
    );
    let mut stdout = Vec::new();
    let mut status = None;
    while let Some(message) = tokio::time::timeout(support::DEADLINE, ws.next()).await? {
        match message? {
            Message::Binary(data) if data.first() == Some(&1) => {
                stdout.extend_from_slice(&data[1..])
            }
            Message::Binary(data) if data.first() == Some(&3) => {
                status = Some(serde_json::from_slice::<Value>(&data[1..])?)
            }
            Message::Close(frame) => {
                assert_eq!(frame.map(|f| u16::from(f.code)), Some(1000));
                break;
            }
            _ => {}
        }
    }
    let _ = ws.close(None).await;
    assert_eq!(stdout, b"hello\n");
    let status = status.context("no status on channel 3")?;
    assert_eq!(status["reason"], "NonZeroExitCode");
    assert_eq!(
        status["details"]["causes"][0],
        json!({"reason": "ExitCode", "message": "7"})
    );
    Ok(())
}

#[tokio::test]
async fn shutdown_ends_open_streams_and_stops_listening() -> anyhow::Result<()> {
    let fx = start().await?;
    let client = Client::new(&fx.server, false)?;
    let watch = client
        .send(Method::GET, &format!("{CM}?watch=1"), None, Vec::new())
        .await?;
    let h2 = Client::new(&fx.server, true)?;
    let logs = h2
        .send(
            Method::GET,
            "/api/v1/namespaces/default/pods/demo/log?follow=true",
            None,
            Vec::new(),
        )
        .await?;
    let addr = fx.server.addr();
    tokio::time::timeout(support::DEADLINE, fx.server.shutdown())
        .await
        .context("shutdown hung")?;
    // Both streams end (cleanly or with a connection error) rather than hang.
    support::drain(watch).await?;
    support::drain(logs).await?;
    assert!(
        tokio::net::TcpStream::connect(addr).await.is_err(),
        "still listening"
    );
    Ok(())
}

const SECRETS: &str = "/api/v1/namespaces/default/secrets";

/// What the agent's `--state-secret` relies on: create is first-writer-wins (409 AlreadyExists), and two writers
/// that read the same resourceVersion cannot both replace the secret (one gets 409 Conflict).
#[tokio::test]
async fn secrets_store_base64_data_and_refuse_racing_writers() -> anyhow::Result<()> {
    let fx = start().await?;
    for h2 in [false, true] {
        let client = Client::new(&fx.server, h2)?;
        let name = format!("state-{h2}");
        let secret = json!({"apiVersion": "v1", "kind": "Secret", "metadata": {"name": name},
                            "stringData": {"token": "abc"}, "data": {"raw": "AAEC"}});
        let created = client
            .send_json(Method::POST, SECRETS, "application/json", &secret)
            .await?;
        assert_eq!(created.status, StatusCode::CREATED, "{}", created.text());
        let created = created.json()?;
        assert_eq!(created["type"], "Opaque");
        assert_eq!(created["data"], json!({"raw": "AAEC", "token": "YWJj"}));
        assert!(created.get("stringData").is_none());
        let again = client
            .send_json(Method::POST, SECRETS, "application/json", &secret)
            .await?;
        assert_eq!(again.status, StatusCode::CONFLICT);
        assert_eq!(again.json()?["reason"], "AlreadyExists");

        let path = format!("{SECRETS}/{name}");
        let read = client.get(&path).await?.json()?;
        assert_eq!(read["data"]["token"], "YWJj");
        // Two agents read the same version and race to replace it: exactly one wins.
        let mut a = read.clone();
        a["data"]["owner"] = json!("YQ==");
        let mut b = read.clone();
        b["data"]["owner"] = json!("Yg==");
        let (ra, rb) = tokio::join!(
            client.send_json(Method::PUT, &path, "application/json", &a),
            client.send_json(Method::PUT, &path, "application/json", &b),
        );
        let mut codes = [ra?.status, rb?.status];
        codes.sort();
        assert_eq!(codes, [StatusCode::OK, StatusCode::CONFLICT]);
        let winner = client.get(&path).await?.json()?;
        assert!(
            winner["data"]["owner"] == "YQ==" || winner["data"]["owner"] == "Yg==",
            "{winner}"
        );

        let bad = json!({"metadata": {"name": format!("bad-{h2}")}, "data": {"k": "not base64!"}});
        let reply = client
            .send_json(Method::POST, SECRETS, "application/json", &bad)
            .await?;
        assert_eq!(reply.status, StatusCode::UNPROCESSABLE_ENTITY);
        let list = client.get(SECRETS).await?.json()?;
        assert_eq!(list["kind"], "SecretList");
    }
    let discovery = Client::new(&fx.server, false)?
        .get("/api/v1")
        .await?
        .json()?;
    let names: Vec<&str> = discovery["resources"]
        .as_array()
        .context("resources")?
        .iter()
        .filter_map(|r| r["name"].as_str())
        .collect();
    for wanted in ["secrets", "services", "serviceaccounts", "events"] {
        assert!(names.contains(&wanted), "{names:?}");
    }
    Ok(())
}

/// The server's HTTP/2 SETTINGS_MAX_CONCURRENT_STREAMS, read with a raw h2 client after one request.
async fn max_concurrent_streams(server: &tether_testkit::SampleApiserver) -> anyhow::Result<usize> {
    let tls = tether_testkit::certs::client_config(server.ca_pem().as_bytes(), &[b"h2"])?;
    let tcp = tokio::net::TcpStream::connect(server.addr()).await?;
    let tls = tokio_rustls::TlsConnector::from(tls)
        .connect(
            rustls::pki_types::ServerName::try_from("localhost")?.to_owned(),
            tcp,
        )
        .await?;
    let (client, connection) = h2::client::handshake(tls).await?;
    tokio::spawn(connection);
    let mut client = client.ready().await?;
    let request = http::Request::builder()
        .uri("https://localhost/version")
        .header("authorization", format!("Bearer {}", server.token()))
        .body(())?;
    let (response, _) = client.send_request(request, true)?;
    let response = response.await?;
    assert_eq!(response.status(), StatusCode::OK);
    Ok(client.current_max_send_streams())
}

#[tokio::test]
async fn http2_streams_per_connection_default_to_kube_apiservers_100() -> anyhow::Result<()> {
    let fx = start().await?;
    assert_eq!(max_concurrent_streams(&fx.server).await?, 100);
    let dir = tempfile::tempdir()?;
    let mut opts = tether_testkit::SampleOptions::new(dir.path());
    opts.http2_max_streams_per_connection = 7;
    let seven = tether_testkit::SampleApiserver::start(opts).await?;
    assert_eq!(max_concurrent_streams(&seven).await?, 7);
    seven.shutdown().await;
    Ok(())
}
