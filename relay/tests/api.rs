//! The relay over real HTTPS: admin API, onboarding, user-endpoint refusals, restarts, TLS, config errors.

mod common;

use bytes::Bytes;
use common::TestRelay;
use http::{Method, StatusCode};
use http_body_util::Full;
use serde_json::json;

#[tokio::test]
async fn healthz_needs_no_auth() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let relay = TestRelay::start(dir.path()).await?;
    let reply = relay.client()?.get("/healthz", None).await?;
    assert_eq!(reply.status, StatusCode::OK);
    assert_eq!(&reply.body[..], b"ok");
    relay.stop().await
}

#[tokio::test]
async fn admin_api_refuses_missing_or_wrong_token_and_changes_nothing() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let relay = TestRelay::start(dir.path()).await?;
    let client = relay.client()?;
    let admin = relay.admin()?;

    for token in [None, Some("wrong"), Some("")] {
        let reply = client
            .post_json("/api/v1/clusters", token, &json!({ "name": "sneaky" }))
            .await?;
        let msg = reply.status_message(401)?;
        assert!(msg.contains("admin token"), "{msg}");
        client
            .get("/api/v1/clusters", token)
            .await?
            .status_message(401)?;
        client
            .get("/api/v1/clusters/sneaky", token)
            .await?
            .status_message(401)?;
    }
    // Another scheme carrying the right token is not accepted either.
    let req = client
        .request(false, Method::GET, "/api/v1/clusters")
        .header(
            http::header::AUTHORIZATION,
            format!("Basic {}", relay.admin_token.expose()),
        )
        .body(Full::default())?;
    client.send(false, req).await?.status_message(401)?;

    admin.create_ok("keep").await?;
    for token in [None, Some("wrong")] {
        let req = client
            .request(false, Method::DELETE, "/api/v1/clusters/keep")
            .header(
                http::header::AUTHORIZATION,
                format!("Bearer {}", token.unwrap_or_default()),
            )
            .body(Full::default())?;
        client.send(false, req).await?.status_message(401)?;
    }
    let items = admin.list().await?.json()?;
    let names: Vec<_> = items["items"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|c| c["name"].as_str())
        .collect();
    assert_eq!(names, ["keep"], "a refused request changed the state");
    relay.stop().await
}

#[tokio::test]
async fn create_list_show_delete() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let relay = TestRelay::start(dir.path()).await?;
    let admin = relay.admin()?;
    let client = relay.client()?;

    let reply = client
        .post_json(
            "/api/v1/clusters",
            Some(&admin.token),
            &json!({ "name": "prod-eu", "tags": { "env": "prod" } }),
        )
        .await?;
    assert_eq!(reply.status, StatusCode::CREATED);
    let created = reply.json()?;
    assert_eq!(created["name"], "prod-eu");
    assert_eq!(created["tags"]["env"], "prod");
    assert_eq!(created["onboarded"], false);
    assert_eq!(created["connected"], false);
    assert!(
        created["connectedSince"].is_null()
            && created["lastSeen"].is_null()
            && created["agentVersion"].is_null()
    );
    let created_at = created["createdAt"].as_str().unwrap_or_default();
    assert!(
        time::OffsetDateTime::parse(created_at, &time::format_description::well_known::Rfc3339)
            .is_ok(),
        "{created_at}"
    );
    let token = created["onboardingToken"].as_str().unwrap_or_default();
    assert_eq!(token.len(), 43);

    // The token is shown once only.
    let shown = admin.show("prod-eu").await?;
    assert_eq!(shown.status, StatusCode::OK);
    let shown = shown.json()?;
    assert!(shown.get("onboardingToken").is_none());
    assert_eq!(shown["createdAt"], created["createdAt"]);
    admin.create_ok("dev").await?;
    let list = admin.list().await?.json()?;
    let names: Vec<_> = list["items"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|c| c["name"].as_str())
        .collect();
    assert_eq!(names, ["dev", "prod-eu"]);
    assert!(
        list["items"]
            .as_array()
            .into_iter()
            .flatten()
            .all(|c| c.get("onboardingToken").is_none())
    );
    assert!(!list.to_string().contains(token));

    let msg = admin.create("prod-eu").await?.status_message(409)?;
    assert!(msg.contains("already exists"), "{msg}");

    let reply = admin.delete("prod-eu").await?;
    assert_eq!(reply.status, StatusCode::NO_CONTENT);
    let msg = admin.show("prod-eu").await?.status_message(404)?;
    assert_eq!(msg, "clusters \"prod-eu\" not found");
    admin.delete("prod-eu").await?.status_message(404)?;

    // Unsupported method on a known path.
    let req = client
        .request(false, Method::PUT, "/api/v1/clusters/dev")
        .header(
            http::header::AUTHORIZATION,
            format!("Bearer {}", admin.token),
        )
        .body(Full::default())?;
    client.send(false, req).await?.status_message(405)?;
    relay.stop().await
}

#[tokio::test]
async fn cluster_names_must_be_dns_labels() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let relay = TestRelay::start(dir.path()).await?;
    let admin = relay.admin()?;
    let long = "a".repeat(64);
    for bad in ["", "Prod", "-a", "a-", "a.b", "a_b", long.as_str()] {
        let msg = admin.create(bad).await?.status_message(400)?;
        assert!(msg.contains("DNS-1123"), "{bad}: {msg}");
    }
    admin.create_ok(&"a".repeat(63)).await?;
    // Malformed bodies are 400 too; oversized ones 413.
    let client = &admin.client;
    client
        .post_json(
            "/api/v1/clusters",
            Some(&admin.token),
            &json!({ "nam": "x" }),
        )
        .await?
        .status_message(400)?;
    let big = json!({ "name": "big", "tags": { "k": "v".repeat(100 * 1024) } });
    client
        .post_json("/api/v1/clusters", Some(&admin.token), &big)
        .await?
        .status_message(413)?;
    assert_eq!(admin.show("big").await?.status, StatusCode::NOT_FOUND);
    relay.stop().await
}

#[tokio::test]
async fn onboarding_token_works_once() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let relay = TestRelay::start(dir.path()).await?;
    let admin = relay.admin()?;
    let client = relay.client()?;
    let token = admin.create_ok("edge").await?;
    let other = admin.create_ok("other").await?;

    let invalid = "onboarding token is invalid or already used";
    // Wrong token, another cluster's token, unknown cluster: one answer for all.
    let (_, any_csr) = common::new_csr("x")?;
    for (cluster, t) in [
        ("edge", "nope"),
        ("edge", other.as_str()),
        ("ghost", token.as_str()),
    ] {
        let reply = client
            .post_json(
                "/agent/v1/onboard",
                None,
                &json!({ "cluster": cluster, "token": t, "csr": any_csr }),
            )
            .await?;
        assert_eq!(reply.status_message(401)?, invalid);
    }
    let (key_pem, csr) = common::new_csr("edge")?;
    // A CSR is required.
    client
        .post_json(
            "/agent/v1/onboard",
            None,
            &json!({ "cluster": "edge", "token": token }),
        )
        .await?
        .status_message(400)?;
    // A garbage CSR is refused without using up the token.
    let msg = client
        .post_json(
            "/agent/v1/onboard",
            None,
            &json!({ "cluster": "edge", "token": token, "csr": "-----BEGIN CERTIFICATE REQUEST-----\nAAAA\n-----END CERTIFICATE REQUEST-----\n" }),
        )
        .await?
        .status_message(400)?;
    assert!(msg.contains("certificate signing request"), "{msg}");
    let first = client
        .post_json(
            "/agent/v1/onboard",
            None,
            &json!({ "cluster": "edge", "token": token, "csr": csr }),
        )
        .await?;
    assert_eq!(first.status, StatusCode::OK);
    let v = first.json()?;
    assert_eq!(v["cluster"], "edge");
    assert!(v.get("credential").is_none(), "{v}");
    assert!(
        v["certificate"]
            .as_str()
            .is_some_and(|c| c.starts_with("-----BEGIN CERTIFICATE-----")),
        "{v}"
    );
    assert!(v["notAfter"].is_string(), "{v}");
    let credential = key_pem.as_str();
    let second = client
        .post_json(
            "/agent/v1/onboard",
            None,
            &json!({ "cluster": "edge", "token": token, "csr": csr }),
        )
        .await?;
    assert_eq!(second.status_message(401)?, invalid);
    assert_eq!(admin.show("edge").await?.json()?["onboarded"], true);
    assert_eq!(admin.show("other").await?.json()?["onboarded"], false);

    // The store holds only hashes: neither the token nor the agent's key appears in the database files.
    relay.stop().await?;
    for entry in std::fs::read_dir(dir.path())? {
        let path = entry?.path();
        if path
            .file_name()
            .and_then(|n| n.to_str())
            .is_some_and(|n| n.starts_with("relay.db"))
        {
            let bytes = std::fs::read(&path)?;
            for secret in [token.as_str(), credential] {
                assert!(
                    !bytes.windows(secret.len()).any(|w| w == secret.as_bytes()),
                    "secret stored in {path:?}"
                );
            }
        }
    }
    Ok(())
}

#[tokio::test]
async fn concurrent_onboarding_redeems_the_token_exactly_once() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let relay = TestRelay::start(dir.path()).await?;
    let admin = relay.admin()?;
    let token = admin.create_ok("race").await?;
    let (_, csr) = common::new_csr("race")?;
    let mut tasks = Vec::new();
    for _ in 0..8 {
        let client = relay.client()?;
        let token = token.clone();
        let csr = csr.clone();
        tasks.push(tokio::spawn(async move {
            client
                .post_json(
                    "/agent/v1/onboard",
                    None,
                    &json!({ "cluster": "race", "token": token, "csr": csr }),
                )
                .await
        }));
    }
    let mut ok = 0;
    for t in tasks {
        let reply = t.await??;
        match reply.status {
            StatusCode::OK => ok += 1,
            StatusCode::UNAUTHORIZED => {}
            other => anyhow::bail!("unexpected {other}"),
        }
    }
    assert_eq!(ok, 1);
    relay.stop().await
}

#[tokio::test]
async fn user_endpoint_refuses_at_once_without_credentials_unknown_or_disconnected()
-> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let relay = TestRelay::start(dir.path()).await?;
    let admin = relay.admin()?;
    admin.create_ok("idle").await?;
    let client = relay.client()?;

    for h2 in [false, true] {
        // No Authorization header, or an empty one: 401 even for an unknown cluster.
        for auth in [None, Some("")] {
            let mut b = client.request(h2, Method::GET, "/clusters/ghost/api/v1/namespaces");
            if let Some(a) = auth {
                b = b.header(http::header::AUTHORIZATION, a);
            }
            let reply = client.send(h2, b.body(Full::default())?).await?;
            reply.status_message(401)?;
            assert_eq!(reply.headers["tether-error-origin"], "client");
        }
        let req = client
            .request(h2, Method::GET, "/clusters/ghost/api/v1/namespaces")
            .header(http::header::AUTHORIZATION, "Bearer user")
            .body(Full::default())?;
        let reply = client.send(h2, req).await?;
        assert_eq!(reply.status_message(404)?, "clusters \"ghost\" not found");
        if h2 {
            assert_eq!(reply.version, http::Version::HTTP_2);
        }

        let req = client
            .request(
                h2,
                Method::POST,
                "/clusters/idle/api/v1/namespaces?dryRun=All",
            )
            .header(http::header::AUTHORIZATION, "Bearer user")
            .body(Full::new(Bytes::from_static(b"{}")))?;
        let reply = client.send(h2, req).await?;
        assert_eq!(
            reply.status_message(503)?,
            "cluster idle is not connected to the relay"
        );
        assert_eq!(reply.headers["tether-error-origin"], "tunnel");
        assert_eq!(reply.headers["tether-error-retryable"], "true");
        assert_eq!(reply.json()?["reason"], "ServiceUnavailable");
    }
    // The bare cluster path is the user endpoint too.
    let reply = client.get("/clusters/idle", Some("user")).await?;
    reply.status_message(503)?;
    relay.stop().await
}

#[tokio::test]
async fn unknown_paths_are_404_status() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let relay = TestRelay::start(dir.path()).await?;
    relay
        .client()?
        .get("/nope", None)
        .await?
        .status_message(404)?;
    relay
        .client()?
        .get("/agent/v1/onboard", None)
        .await?
        .status_message(405)?;
    relay.stop().await
}

#[tokio::test]
async fn state_tls_and_admin_token_survive_a_restart() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let relay = TestRelay::start(dir.path()).await?;
    let admin = relay.admin()?;
    let token = admin.create_ok("persist").await?;
    let ca = relay.ca_pem.clone();
    let admin_token = relay.admin_token.clone();
    let server_pem = std::fs::read(dir.path().join("server.pem"))?;
    relay.stop().await?;

    let relay = TestRelay::start(dir.path()).await?;
    assert_eq!(relay.ca_pem, ca, "the CA was regenerated");
    assert_eq!(
        relay.admin_token, admin_token,
        "the admin token was regenerated"
    );
    assert_eq!(
        std::fs::read(dir.path().join("server.pem"))?,
        server_pem,
        "the server certificate was regenerated"
    );
    // A client that trusted the old CA still connects.
    let admin = common::Admin {
        client: common::Client::new(relay.addr, ca.as_bytes(), "localhost")?,
        token: admin.token,
    };
    let shown = admin.show("persist").await?;
    assert_eq!(shown.status, StatusCode::OK);
    // The onboarding token issued before the restart still works (once), and the agent CA is the same.
    let agent_ca = std::fs::read(dir.path().join("agent-ca.pem"))?;
    admin.onboard("persist", &token).await?;
    assert_eq!(relay.agent_ca_pem.as_bytes(), &agent_ca[..]);
    relay.stop().await?;

    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        assert_eq!(
            std::fs::metadata(dir.path())?.permissions().mode() & 0o777,
            0o700
        );
        assert_eq!(
            std::fs::metadata(dir.path().join("admin-token"))?
                .permissions()
                .mode()
                & 0o777,
            0o600
        );
        for key in ["ca-key.pem", "agent-ca-key.pem"] {
            assert_eq!(
                std::fs::metadata(dir.path().join(key))?
                    .permissions()
                    .mode()
                    & 0o777,
                0o600,
                "{key}"
            );
        }
    }
    Ok(())
}

#[tokio::test]
async fn new_hostnames_get_a_new_certificate_from_the_same_ca() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let relay = TestRelay::start(dir.path()).await?;
    let ca = relay.ca_pem.clone();
    // "relay.test" is not in the default certificate.
    let strict = common::Client::new(relay.addr, ca.as_bytes(), "relay.test")?;
    assert!(strict.get("/healthz", None).await.is_err());
    relay.stop().await?;

    let mut config = tether_relay::Config::new(dir.path().to_path_buf());
    config.hostnames.push("relay.test".into());
    let relay = TestRelay::start_with(config).await?;
    assert_eq!(relay.ca_pem, ca);
    let strict = common::Client::new(relay.addr, ca.as_bytes(), "relay.test")?;
    assert_eq!(strict.get("/healthz", None).await?.status, StatusCode::OK);
    relay.stop().await
}

#[tokio::test]
async fn given_certificate_and_admin_token_file_are_used() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let certified = rcgen::generate_simple_self_signed(vec!["localhost".to_owned()])?;
    let cert_path = dir.path().join("given.pem");
    let key_path = dir.path().join("given-key.pem");
    std::fs::write(&cert_path, certified.cert.pem())?;
    std::fs::write(&key_path, certified.signing_key.serialize_pem())?;
    let token_path = dir.path().join("token");
    std::fs::write(&token_path, "  operator-chosen-token\n")?;

    let mut config = tether_relay::Config::new(dir.path().join("data"));
    config.tls_cert = Some(cert_path);
    config.tls_key = Some(key_path);
    config.admin_token_file = Some(token_path);
    let relay = TestRelay::start_with(config).await?;
    assert!(
        relay.ca_pem.is_empty(),
        "no CA is generated when a certificate is given"
    );
    assert!(!dir.path().join("data").join("ca.pem").exists());
    assert_eq!(relay.admin_token.expose(), "operator-chosen-token");
    let client = common::Client::new(relay.addr, certified.cert.pem().as_bytes(), "localhost")?;
    let admin = common::Admin {
        client,
        token: "operator-chosen-token".into(),
    };
    assert_eq!(admin.list().await?.status, StatusCode::OK);
    relay.stop().await
}

#[tokio::test]
async fn invalid_config_is_refused_before_anything_starts() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let mut config = tether_relay::Config::new(dir.path().join("data"));
    config.tls_cert = Some(dir.path().join("cert.pem"));
    let err = tether_relay::Relay::new(config)
        .await
        .err()
        .ok_or_else(|| anyhow::anyhow!("accepted"))?;
    assert!(
        matches!(
            err,
            tether_relay::RelayError::Config(tether_relay::ConfigError::IncompleteTls)
        ),
        "{err}"
    );
    assert!(
        !dir.path().join("data").exists(),
        "the data dir was created for an invalid config"
    );
    Ok(())
}

#[test]
fn binary_exits_64_on_bad_config() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_tether-relay"))
        .arg("--data-dir")
        .arg(dir.path())
        .args(["--listen", "127.0.0.1:0", "--tls-cert", "only-cert.pem"])
        .env_remove("RUST_LOG")
        .output()?;
    assert_eq!(out.status.code(), Some(64));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("--tls-cert and --tls-key must be given together"),
        "{stderr}"
    );
    Ok(())
}

#[tokio::test]
async fn agent_tunnel_is_authenticated_by_client_certificate_before_upgrading() -> anyhow::Result<()>
{
    let dir = tempfile::tempdir()?;
    let relay = TestRelay::start(dir.path()).await?;
    let admin = relay.admin()?;
    let edge = admin.onboarded("edge").await?;
    let other = admin.onboarded("other").await?;
    let upgrade = |client: &common::Client, cluster: &str, bearer: Option<&str>| {
        let mut b = client
            .request(false, Method::GET, "/agent/v1/tunnel")
            .header(http::header::CONNECTION, "Upgrade")
            .header(http::header::UPGRADE, "websocket")
            .header(http::header::SEC_WEBSOCKET_VERSION, "13")
            .header(http::header::SEC_WEBSOCKET_KEY, "dGhlIHNhbXBsZSBub25jZQ==")
            .header(http::header::SEC_WEBSOCKET_PROTOCOL, "tether.v1")
            .header("tether-cluster", cluster);
        if let Some(t) = bearer {
            b = b.header(http::header::AUTHORIZATION, format!("Bearer {t}"));
        }
        b.body(Full::<Bytes>::default())
    };
    let anonymous = relay.client()?;
    let as_edge = relay.client_as(&edge)?;
    let as_other = relay.client_as(&other)?;
    // No certificate (a bearer token does not help: the onboarding token is no credential either).
    let token = admin.create_ok("fresh").await?;
    for (cluster, bearer) in [("edge", None), ("fresh", Some(token.as_str()))] {
        let msg = anonymous
            .send(false, upgrade(&anonymous, cluster, bearer)?)
            .await?
            .status_message(401)?;
        assert!(msg.contains("no client certificate"), "{msg}");
    }
    // One cluster's identity never serves another cluster's name.
    for (client, cluster) in [
        (&as_other, "edge"),
        (&as_edge, "other"),
        (&as_edge, "ghost"),
        (&as_edge, ""),
    ] {
        let reply = client.send(false, upgrade(client, cluster, None)?).await?;
        let msg = reply.status_message(401)?;
        assert_eq!(reply.json()?["reason"], "Unauthorized", "{msg}");
    }
    // The right certificate, but not a WebSocket upgrade: 400, so it did pass authentication.
    let req = as_edge
        .request(false, Method::GET, "/agent/v1/tunnel")
        .header("tether-cluster", "edge")
        .body(Full::default())?;
    as_edge.send(false, req).await?.status_message(400)?;
    // Client certificates mean nothing to the admin API and the user endpoint.
    assert_eq!(
        as_edge.get("/api/v1/clusters", None).await?.status,
        StatusCode::UNAUTHORIZED
    );
    as_edge
        .get("/clusters/edge/api", Some("t"))
        .await?
        .status_message(503)?;
    relay.stop().await
}

#[tokio::test]
async fn oversized_request_heads_are_refused() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let relay = TestRelay::start(dir.path()).await?;
    let client = relay.client()?;
    let req = client
        .request(false, Method::GET, "/clusters/any/api")
        .header(http::header::AUTHORIZATION, "Bearer t")
        .header("x-padding", "p".repeat(100 * 1024))
        .body(Full::default())?;
    let reply = client.send(false, req).await?;
    assert_eq!(reply.status, StatusCode::REQUEST_HEADER_FIELDS_TOO_LARGE);
    // The relay is still serving.
    assert_eq!(client.get("/healthz", None).await?.status, StatusCode::OK);
    relay.stop().await
}

#[test]
fn binary_exits_64_on_an_unreadable_certificate() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_tether-relay"))
        .arg("--data-dir")
        .arg(dir.path().join("data"))
        .args(["--listen", "127.0.0.1:0", "--tls-cert"])
        .arg(dir.path().join("missing.pem"))
        .arg("--tls-key")
        .arg(dir.path().join("missing-key.pem"))
        .env_remove("RUST_LOG")
        .output()?;
    assert_eq!(out.status.code(), Some(64));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("missing.pem"), "{stderr}");
    Ok(())
}
