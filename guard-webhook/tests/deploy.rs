//! The kube-apiserver wiring in deploy/guard/ stays consistent with what the server serves.

use serde_yaml::Value;

fn load(name: &str) -> anyhow::Result<Value> {
    let path = format!("{}/../deploy/guard/{name}", env!("CARGO_MANIFEST_DIR"));
    Ok(serde_yaml::from_str(&std::fs::read_to_string(&path)?)?)
}

fn server(kubeconfig: &Value) -> String {
    kubeconfig["clusters"][0]["cluster"]["server"]
        .as_str()
        .unwrap_or_default()
        .to_owned()
}

#[test]
fn webhook_kubeconfigs_point_at_the_served_paths_with_a_client_certificate() -> anyhow::Result<()> {
    for (file, path) in [
        ("authn-webhook.kubeconfig", "/authenticate"),
        ("authz-webhook.kubeconfig", "/authorize"),
    ] {
        let k = load(file)?;
        let url = server(&k);
        assert!(
            url.starts_with("https://") && url.ends_with(path),
            "{file}: {url}"
        );
        let user = &k["users"][0]["user"];
        assert!(
            user["client-certificate"].is_string() && user["client-key"].is_string(),
            "{file}"
        );
        assert!(
            k["clusters"][0]["cluster"]["certificate-authority"].is_string(),
            "{file}"
        );
    }
    Ok(())
}

#[test]
fn authorization_config_uses_guard_with_short_ttls() -> anyhow::Result<()> {
    let c = load("authorization-config.yaml")?;
    assert_eq!(c["kind"], "AuthorizationConfiguration");
    let authorizers = c["authorizers"].as_sequence().cloned().unwrap_or_default();
    let types: Vec<&str> = authorizers
        .iter()
        .filter_map(|a| a["type"].as_str())
        .collect();
    assert_eq!(types, ["Node", "Webhook", "Webhook", "RBAC"]);
    // The first webhook is asked about the agent's service accounts only (guard denies their impersonating
    // system: names), the second about Entra identities.
    assert_eq!(
        authorizers[1]["webhook"]["matchConditions"][0]["expression"],
        "request.user.startsWith('system:serviceaccount:tether-system:')"
    );
    for webhook in [&authorizers[1]["webhook"], &authorizers[2]["webhook"]] {
        check_webhook(webhook);
    }
    Ok(())
}

fn check_webhook(webhook: &Value) {
    for version in [
        "subjectAccessReviewVersion",
        "matchConditionSubjectAccessReviewVersion",
    ] {
        let v = format!(
            "authorization.k8s.io/{}",
            webhook[version].as_str().unwrap_or_default()
        );
        assert!(
            tether_guard::review::ACCESS_REVIEW_VERSIONS.contains(&v.as_str()),
            "{v}"
        );
    }
    for ttl in ["authorizedTTL", "unauthorizedTTL"] {
        let secs: u64 = webhook[ttl]
            .as_str()
            .and_then(|s| s.strip_suffix('s'))
            .and_then(|s| s.parse().ok())
            .unwrap_or(u64::MAX);
        assert!(secs <= 5, "{ttl} must keep removals effective within 5 s");
    }
    assert_eq!(webhook["connectionInfo"]["type"], "KubeConfigFile");
    assert!(
        webhook["connectionInfo"]["kubeConfigFile"]
            .as_str()
            .is_some_and(|p| p.ends_with("authz-webhook.kubeconfig"))
    );
    assert_eq!(webhook["failurePolicy"], "NoOpinion");
}
