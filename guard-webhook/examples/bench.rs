//! Micro benchmark of guard's hot paths, single-threaded, for docs/BENCHMARKS.md:
//! authorization decisions per second and p99 latency (uncached and cached) and JWT verifications per second.
//!
//! `cargo run --release -p tether-guard --example bench [-- ITERATIONS]`
//!
//! The snapshot has 1,000 role assignments (users and groups, cluster and namespace scope) and 20 deny
//! assignments; requests cycle through 1,000 users × 8 verbs/resources × 5 namespaces. Tokens are RS256 (2048-bit)
//! with keys already cached, so the JWT figure is signature and claim checking, not network.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use anyhow::Context as _;
use bytes::Bytes;
use hdrhistogram::Histogram;
use tether_auth::jwks::{Fetch, FetchError, FetchFuture};
use tether_auth::rbac::{
    self, AccessRequest, DenyAssignment, ResourceAttributes, RoleAssignment, Scope, Snapshot,
};
use tether_auth::{Authenticator, TokenConfig};
use tether_guard::{Guard, GuardOptions, SnapshotStore};

const TENANT: &str = "72f988bf-86f1-41af-91ab-2d7cd011db47";
const VERBS: [(&str, &str, &str); 8] = [
    ("get", "", "pods"),
    ("list", "", "pods"),
    ("create", "apps", "deployments"),
    ("delete", "", "secrets"),
    ("watch", "", "configmaps"),
    ("patch", "", "services"),
    ("create", "", "pods"),
    ("get", "rbac.authorization.k8s.io", "roles"),
];

fn snapshot() -> Snapshot {
    let roles = ["Viewer", "Writer", "Admin", "Cluster Admin"];
    let mut assignments = Vec::new();
    for i in 0..1000 {
        let role = rbac::find_role(&[], roles[i % 4])
            .map(|r| r.id.clone())
            .unwrap_or_default();
        let principal = if i % 5 == 0 {
            format!("group-{}", i % 50)
        } else {
            format!("user-{i}")
        };
        let scope = if i % 3 == 0 {
            Scope::Cluster
        } else {
            Scope::Namespace(format!("ns-{}", i % 5))
        };
        assignments.push(RoleAssignment {
            id: format!("a{i}"),
            role_id: role,
            principal_id: principal,
            scope,
        });
    }
    let deny_assignments = (0..20)
        .map(|i| DenyAssignment {
            id: format!("d{i}"),
            name: format!("deny {i}"),
            data_actions: vec![format!("{}/secrets/*", rbac::CONNECTED_CLUSTERS)],
            not_data_actions: vec![],
            principals: vec![format!("user-{}", i * 7)],
            exclude_principals: vec![],
            scope: Scope::Namespace("ns-1".to_owned()),
        })
        .collect();
    Snapshot {
        version: 1,
        roles: vec![],
        assignments,
        deny_assignments,
    }
}

fn requests() -> Vec<AccessRequest> {
    let mut out = Vec::new();
    for u in 0..1000 {
        for (i, (verb, group, resource)) in VERBS.iter().enumerate() {
            let ns = format!("ns-{}", (u + i) % 5);
            out.push(AccessRequest {
                user: format!("user-{u}@contoso.example"),
                uid: format!("user-{u}"),
                groups: vec![
                    format!("group-{}", u % 50),
                    "system:authenticated".to_owned(),
                ],
                extra: BTreeMap::from([("oid".to_owned(), vec![format!("user-{u}")])]),
                resource: Some(ResourceAttributes {
                    namespace: ns,
                    verb: (*verb).to_owned(),
                    group: (*group).to_owned(),
                    version: "v1".to_owned(),
                    resource: (*resource).to_owned(),
                    ..Default::default()
                }),
                non_resource: None,
            });
        }
    }
    out
}

fn report(name: &str, hist: &Histogram<u64>, count: u64, elapsed: Duration) {
    println!(
        "{name:<34} {:>10.0}/s   p50 {:>7.2} µs   p99 {:>7.2} µs   max {:>8.2} µs   (n={count})",
        count as f64 / elapsed.as_secs_f64(),
        hist.value_at_quantile(0.50) as f64 / 1000.0,
        hist.value_at_quantile(0.99) as f64 / 1000.0,
        hist.max() as f64 / 1000.0,
    );
}

fn bench_decisions(iterations: usize) -> anyhow::Result<()> {
    let reqs = requests();
    for (label, ttl) in [
        ("authorize, uncached (evaluation)", Duration::ZERO),
        ("authorize, cached", Duration::from_secs(3600)),
    ] {
        let store = Arc::new(SnapshotStore::in_memory(snapshot()));
        let guard = Guard::new(
            None,
            store,
            GuardOptions {
                cache_ttl: ttl,
                ..GuardOptions::default()
            },
        );
        // Warm the cache (and the CPU) with one pass.
        for r in &reqs {
            guard.authorize(r, "bench");
        }
        let mut hist = Histogram::<u64>::new_with_bounds(1, 60_000_000_000, 3)?;
        let started = Instant::now();
        let mut allowed = 0u64;
        for i in 0..iterations {
            let r = &reqs[i % reqs.len()];
            let t = Instant::now();
            let d = guard.authorize(r, "bench");
            hist.record(t.elapsed().as_nanos().max(1) as u64)?;
            allowed += u64::from(d.allowed);
        }
        let elapsed = started.elapsed();
        report(label, &hist, iterations as u64, elapsed);
        eprintln!("  ({allowed} of {iterations} allowed)");
    }
    Ok(())
}

struct StaticIdp {
    jwks: Bytes,
}

impl Fetch for StaticIdp {
    fn get<'a>(&'a self, url: &'a str) -> FetchFuture<'a> {
        let body = if url.ends_with("openid-configuration") {
            Ok(Bytes::from(
                serde_json::json!({
                    "issuer": format!("https://login.example/{TENANT}/v2.0"),
                    "jwks_uri": "https://login.example/keys",
                })
                .to_string(),
            ))
        } else if url.ends_with("/keys") {
            Ok(self.jwks.clone())
        } else {
            Err(FetchError(format!("no {url}")))
        };
        Box::pin(async move { body })
    }
}

async fn bench_jwt(iterations: usize) -> anyhow::Result<()> {
    let key = rcgen::KeyPair::generate_for(&rcgen::PKCS_RSA_SHA256).context("RSA key")?;
    let encoding = jsonwebtoken::EncodingKey::from_rsa_pem(key.serialize_pem().as_bytes())?;
    let mut jwk =
        jsonwebtoken::jwk::Jwk::from_encoding_key(&encoding, jsonwebtoken::Algorithm::RS256)?;
    jwk.common.key_id = Some("bench".to_owned());
    let jwks = Bytes::from(serde_json::to_vec(&serde_json::json!({ "keys": [jwk] }))?);
    let now = SystemTime::now().duration_since(UNIX_EPOCH)?.as_secs();
    let claims = serde_json::json!({
        "iss": format!("https://login.example/{TENANT}/v2.0"), "tid": TENANT, "aud": "api://tether",
        "iat": now, "nbf": now, "exp": now + 3600, "oid": "user-1", "preferred_username": "u@contoso.example",
        "groups": (0..20).map(|i| format!("group-{i}")).collect::<Vec<_>>(),
    });
    let mut header = jsonwebtoken::Header::new(jsonwebtoken::Algorithm::RS256);
    header.kid = Some("bench".to_owned());
    let token = jsonwebtoken::encode(&header, &claims, &encoding)?;
    let mut config = TokenConfig::new(vec![TENANT.to_owned()], vec!["api://tether".to_owned()]);
    config.v2_authority = "https://login.example".to_owned();
    let auth = Authenticator::new(config, Arc::new(StaticIdp { jwks }))?;
    auth.authenticate(&token).await?;
    let mut hist = Histogram::<u64>::new_with_bounds(1, 60_000_000_000, 3)?;
    let started = Instant::now();
    for _ in 0..iterations {
        let t = Instant::now();
        auth.authenticate(&token).await?;
        hist.record(t.elapsed().as_nanos().max(1) as u64)?;
    }
    report(
        "JWT verification (RS256, keys cached)",
        &hist,
        iterations as u64,
        started.elapsed(),
    );
    Ok(())
}

#[tokio::main(flavor = "current_thread")]
async fn main() -> anyhow::Result<()> {
    let iterations: usize = std::env::args()
        .nth(1)
        .map(|a| a.parse())
        .transpose()?
        .unwrap_or(400_000);
    println!(
        "tether-guard micro benchmark: one thread, {iterations} decisions, {} verifications",
        iterations / 20
    );
    bench_decisions(iterations)?;
    bench_jwt(iterations / 20).await?;
    Ok(())
}
