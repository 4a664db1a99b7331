//! The agent-facing side of the relay, attacked the way a stolen or replayed token would be.

mod common;

use bytes::Bytes;
use common::Env;
use http::{Method, Request, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;

/// A certificate request made with rcgen, as any agent could: the relay must not care who built it.
fn csr() -> anyhow::Result<String> {
    let key = rcgen::KeyPair::generate()?;
    let params = rcgen::CertificateParams::new(vec!["ignored.example".to_string()])?;
    Ok(params.serialize_request(&key)?.pem()?)
}

async fn post_onboard(
    env: &Env,
    cluster: &str,
    token: &str,
) -> anyhow::Result<(StatusCode, String)> {
    let tls = tether_runtime::tls::client_config(Some(env.up.ca_pem.as_bytes()), &[])?;
    let connector = hyper_rustls::HttpsConnectorBuilder::new()
        .with_tls_config((*tls).clone())
        .https_only()
        .enable_http1()
        .build();
    let client: Client<_, Full<Bytes>> = Client::builder(TokioExecutor::new()).build(connector);
    let body = serde_json::to_vec(
        &serde_json::json!({ "cluster": cluster, "token": token, "csr": csr()? }),
    )?;
    let request = Request::builder()
        .method(Method::POST)
        .uri(format!("{}/agent/v1/onboard", env.up.relay_url))
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from(body)))?;
    let response = client.request(request).await?;
    let status = response.status();
    let body = response.into_body().collect().await?.to_bytes();
    Ok((status, String::from_utf8_lossy(&body).into_owned()))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_onboarding_token_cannot_be_used_twice() -> anyhow::Result<()> {
    let env = Env::start().await?;
    let client = env.up.client()?;
    let created = client.create_cluster("edge-1", &Default::default()).await?;
    let token = created.onboarding_token.expose().to_string();

    let (status, body) = post_onboard(&env, "edge-1", &token).await?;
    assert_eq!(status, StatusCode::OK, "{body}");
    let answer: serde_json::Value = serde_json::from_str(&body)?;
    assert_eq!(answer["cluster"], "edge-1", "{body}");
    assert!(
        answer["certificate"]
            .as_str()
            .is_some_and(|c| c.starts_with("-----BEGIN CERTIFICATE-----")),
        "{body}"
    );
    assert!(answer["notAfter"].as_str().is_some(), "{body}");
    assert!(
        answer.get("credential").is_none(),
        "bearer credentials are gone: {body}"
    );
    let shown = serde_json::to_value(client.show_cluster("edge-1").await?)?;
    assert_eq!(shown["onboarded"], serde_json::Value::Bool(true));
    assert_eq!(shown["identity"]["notAfter"], answer["notAfter"], "{shown}");

    let (status, body) = post_onboard(&env, "edge-1", &token).await?;
    assert_eq!(status, StatusCode::UNAUTHORIZED, "{body}");
    // The token of one cluster is no good for another either.
    client.create_cluster("edge-2", &Default::default()).await?;
    let (status, _) = post_onboard(&env, "edge-2", &token).await?;
    assert_eq!(status, StatusCode::UNAUTHORIZED);

    let shown = serde_json::to_value(client.show_cluster("edge-2").await?)?;
    assert_eq!(shown["onboarded"], serde_json::Value::Bool(false));
    assert!(
        shown.get("onboardingToken").is_none(),
        "the token must be shown only once: {shown}"
    );
    env.up.shutdown().await?;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn deleting_a_cluster_closes_its_tunnel() -> anyhow::Result<()> {
    let env = Env::start().await?;
    let kubectl = env.kubectl()?;
    let out = kubectl.run(&["get", "namespaces"]).await?;
    anyhow::ensure!(out.status.success(), "{}", out.stderr);
    env.up.client()?.delete_cluster("demo").await?;
    let out = kubectl.run(&["get", "namespaces"]).await?;
    assert!(!out.status.success());
    assert!(out.stderr.contains("not found"), "{}", out.stderr);
    env.up.shutdown().await.ok();
    Ok(())
}
