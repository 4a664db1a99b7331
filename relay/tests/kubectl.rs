//! The real `kubectl` through the relay and a real tunnel to a fake agent that answers discovery and one
//! list, as a minimal apiserver would. Skipped (with a note) when no kubectl binary is installed.

mod common;

use std::convert::Infallible;
use std::path::{Path, PathBuf};

use base64::Engine as _;
use bytes::Bytes;
use common::{AgentIdentity, TestRelay};
use http::{HeaderValue, Request, Response, StatusCode};
use http_body_util::Full;
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper_util::rt::TokioIo;
use serde_json::json;
use tether_testkit::tools::{self, Tool};
use tether_tunnel::Connection;

const KUBE_TOKEN: &str = "kube-user-token";

/// The few endpoints `kubectl get namespaces` needs, with the apiserver's bearer-token check.
fn apiserver(req: &Request<Incoming>) -> (StatusCode, serde_json::Value) {
    let authorized = req
        .headers()
        .get("authorization")
        .and_then(|v| v.to_str().ok())
        == Some(&format!("Bearer {KUBE_TOKEN}"));
    if !authorized {
        return (
            StatusCode::UNAUTHORIZED,
            json!({"kind":"Status","apiVersion":"v1","metadata":{},"status":"Failure","message":"Unauthorized","reason":"Unauthorized","code":401}),
        );
    }
    match req.uri().path() {
        "/api" => (
            StatusCode::OK,
            json!({"kind":"APIVersions","versions":["v1"],
            "serverAddressByClientCIDRs":[{"clientCIDR":"0.0.0.0/0","serverAddress":"10.0.0.1:6443"}]}),
        ),
        "/apis" => (
            StatusCode::OK,
            json!({"kind":"APIGroupList","apiVersion":"v1","groups":[]}),
        ),
        "/api/v1" => (
            StatusCode::OK,
            json!({"kind":"APIResourceList","groupVersion":"v1","resources":[
            {"name":"namespaces","singularName":"namespace","namespaced":false,"kind":"Namespace",
             "verbs":["get","list"],"shortNames":["ns"]}]}),
        ),
        "/api/v1/namespaces" => (
            StatusCode::OK,
            json!({"kind":"NamespaceList","apiVersion":"v1",
            "metadata":{"resourceVersion":"7"},
            "items":[{"metadata":{"name":"through-the-tunnel","uid":"1","resourceVersion":"7"}}]}),
        ),
        other => (
            StatusCode::NOT_FOUND,
            json!({"kind":"Status","apiVersion":"v1","metadata":{},"status":"Failure",
                   "message":format!("{other} not found"),"reason":"NotFound","code":404}),
        ),
    }
}

async fn connect_agent(relay: &TestRelay, identity: &AgentIdentity) -> anyhow::Result<Connection> {
    let conn = common::dial(relay, identity).await?;
    let c = conn.clone();
    tokio::spawn(async move {
        while let Some(incoming) = c.accept().await {
            let Ok(stream) = incoming.accept(Bytes::new()) else {
                continue;
            };
            tokio::spawn(async move {
                let svc = service_fn(|req: Request<Incoming>| async move {
                    let (status, body) = apiserver(&req);
                    let mut resp = Response::new(Full::new(Bytes::from(body.to_string())));
                    *resp.status_mut() = status;
                    resp.headers_mut()
                        .insert("content-type", HeaderValue::from_static("application/json"));
                    Ok::<_, Infallible>(resp)
                });
                let _ = hyper::server::conn::http1::Builder::new()
                    .serve_connection(TokioIo::new(stream), svc)
                    .await;
            });
        }
    });
    Ok(conn)
}

fn write_kubeconfig(
    dir: &Path,
    relay: &TestRelay,
    cluster: &str,
    token: Option<&str>,
) -> anyhow::Result<PathBuf> {
    let ca = base64::engine::general_purpose::STANDARD.encode(relay.ca_pem.as_bytes());
    let user = match token {
        Some(t) => format!("    token: {t}\n"),
        None => "    {}\n".to_owned(),
    };
    let text = format!(
        "apiVersion: v1\nkind: Config\nclusters:\n- name: relay\n  cluster:\n    server: https://localhost:{port}/clusters/{cluster}\n    certificate-authority-data: {ca}\n\
         users:\n- name: u\n  user:\n{user}contexts:\n- name: c\n  context:\n    cluster: relay\n    user: u\ncurrent-context: c\n",
        port = relay.addr.port(),
    );
    let path = dir.join(format!("kubeconfig-{cluster}-{}", token.is_some()));
    std::fs::write(&path, text)?;
    Ok(path)
}

async fn run_kubectl(
    bin: &Path,
    home: &Path,
    kubeconfig: &Path,
    args: &[&str],
) -> anyhow::Result<std::process::Output> {
    let out = tokio::process::Command::new(bin)
        .env("HOME", home)
        .env_remove("KUBECONFIG")
        .arg("--kubeconfig")
        .arg(kubeconfig)
        .arg("--cache-dir")
        .arg(home.join("cache"))
        .arg("--request-timeout=20s")
        .args(args)
        .output()
        .await?;
    Ok(out)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kubectl_lists_namespaces_through_the_tunnel() -> anyhow::Result<()> {
    let Some(bin) = tools::require(Tool::Kubectl) else {
        return Ok(());
    };
    let dir = tempfile::tempdir()?;
    let relay = TestRelay::start(&dir.path().join("relay")).await?;
    let admin = relay.admin()?;
    let identity = admin.onboarded("edge").await?;
    admin.create_ok("idle").await?;
    let _agent = connect_agent(&relay, &identity).await?;
    admin.wait_connected("edge", true).await?;
    let home = dir.path().join("home");
    std::fs::create_dir_all(&home)?;

    let kubeconfig = write_kubeconfig(dir.path(), &relay, "edge", Some(KUBE_TOKEN))?;
    let out = run_kubectl(
        &bin,
        &home,
        &kubeconfig,
        &["get", "namespaces", "-o", "name"],
    )
    .await?;
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "kubectl failed: {stderr}");
    assert_eq!(stdout.trim(), "namespace/through-the-tunnel", "{stderr}");

    // The apiserver's own refusal comes back through the tunnel unchanged.
    let wrong = write_kubeconfig(dir.path(), &relay, "edge", Some("wrong-token"))?;
    let out = run_kubectl(&bin, &home, &wrong, &["get", "namespaces", "-o", "name"]).await?;
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("Unauthorized"), "{stderr}");

    // The relay's own refusals: not connected. Discovery reads only the status code (client-go's `Raw()`), so
    // kubectl says "ServiceUnavailable"; a plain request shows the relay's message.
    let idle = write_kubeconfig(dir.path(), &relay, "idle", Some(KUBE_TOKEN))?;
    let out = run_kubectl(&bin, &home, &idle, &["get", "namespaces", "-o", "name"]).await?;
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("ServiceUnavailable"), "{stderr}");
    let out = run_kubectl(
        &bin,
        &home,
        &idle,
        &["get", "--raw", "/clusters/idle/api/v1/namespaces"],
    )
    .await?;
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains(
            "Error from server (ServiceUnavailable): cluster idle is not connected to the relay"
        ),
        "{stderr}"
    );
    let out = run_kubectl(&bin, &home, &idle, &["get", "--raw", "/clusters/ghost/api"]).await?;
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("Error from server (NotFound): clusters \"ghost\" not found"),
        "{stderr}"
    );
    relay.stop().await
}
