//! The admin REST API for clusters: `/api/v1/clusters[/NAME[/export]]`, `/api/v1/clusters/import`, bearer
//! admin token. Role definitions, assignments and the directory are in [`super::rbac`].

use std::collections::{BTreeMap, HashMap};

use http::{Method, Request, Response, StatusCode};
use hyper::body::Incoming;
use serde_json::Value;
use tether_api::admin::{self, EXPORT_API_VERSION, EXPORT_KIND};
use time::OffsetDateTime;
use time::format_description::well_known::Rfc3339;

use super::rbac::{assignment_view, deny_view, role_view};
use super::{body_limit, require_admin};
use crate::api_error::ApiError;
use crate::auth;
use crate::body::Body;
use crate::rbac::{ImportRequest, Imported, NewDeny};
use crate::respond;
use crate::revocation;
use crate::state::Shared;
use crate::status::{self, ConnectivityStatus, LiveTunnel};
use crate::store::{ClusterRecord, NewCluster, TokenHash, TunnelRoute};

/// Handles `/api/v1/clusters` (`name` = `None`) and `/api/v1/clusters/{name}` (`NAME`, `NAME/export`, `import`).
pub(crate) async fn handle(
    shared: &Shared,
    req: Request<Incoming>,
    name: Option<&str>,
) -> Result<Response<Body>, ApiError> {
    require_admin(shared, req.headers())?;
    let (name, sub) = match name.map(|n| n.split_once('/').unwrap_or((n, ""))) {
        Some((n, sub)) => (Some(n), sub),
        None => (None, ""),
    };
    match (req.method().clone(), name, sub) {
        (Method::POST, None, _) => create(shared, req).await,
        (Method::GET, None, _) => {
            let query = req.uri().query().unwrap_or_default().to_owned();
            list(shared, &query).await
        }
        (Method::POST, Some("import"), "") => import(shared, req).await,
        (Method::GET, Some(name), "") => show(shared, name).await,
        (Method::GET, Some(name), "export") => export(shared, name).await,
        (Method::DELETE, Some(name), "") => delete(shared, name).await,
        (_, None, _) | (_, Some(_), "" | "export") => Err(ApiError::method_not_allowed()),
        (_, Some(name), sub) => Err(ApiError::not_found(format!(
            "clusters \"{name}\" have no {sub:?} subresource"
        ))),
    }
}

fn check_registration(name: &str, tags: &BTreeMap<String, String>) -> Result<(), ApiError> {
    if !auth::valid_cluster_name(name) {
        return Err(ApiError::invalid(format!(
            "invalid cluster name {name:?}: must be a DNS-1123 label (at most 63 characters: a-z, 0-9 and '-', \
             starting and ending with a letter or digit)"
        )));
    }
    if let Some(key) = tags
        .keys()
        .find(|k| k.is_empty() || k.len() > 253 || k.contains('='))
    {
        return Err(ApiError::invalid(format!(
            "invalid tag key {key:?}: must be 1 to 253 characters without '='"
        )));
    }
    Ok(())
}

/// Registers a cluster (with the assignments of an import) and answers 201 with it and its onboarding token.
async fn register(
    shared: &Shared,
    name: String,
    tags: BTreeMap<String, String>,
    imported: Option<Imported>,
) -> Result<Response<Body>, ApiError> {
    check_registration(&name, &tags)?;
    let token = auth::generate_token();
    let new = NewCluster {
        name,
        tags,
        onboarding_token_hash: TokenHash::of(token.expose()),
        created_at: OffsetDateTime::now_utc(),
    };
    let (record, how) = match &imported {
        None => (shared.store.create_cluster(&new).await?, "created"),
        Some(i) => (
            shared
                .store
                .import_cluster(&new, &i.roles, &i.assignments, &i.denies)
                .await?,
            "imported",
        ),
    };
    shared.activity.forget(&record.name);
    tracing::info!(cluster = %record.name, how, "cluster registered");
    // The only time the onboarding token is ever shown.
    let created = admin::Created {
        // Just registered: no tunnel yet.
        cluster: cluster_view(shared, record, Vec::new(), OffsetDateTime::now_utc()),
        onboarding_token: token.expose().to_owned(),
    };
    Ok(respond::json(StatusCode::CREATED, &created))
}

async fn create(shared: &Shared, req: Request<Incoming>) -> Result<Response<Body>, ApiError> {
    let body: admin::NewCluster = respond::read_json(req.into_body(), body_limit(shared)).await?;
    register(shared, body.name, body.tags, None).await
}

async fn import(shared: &Shared, req: Request<Incoming>) -> Result<Response<Body>, ApiError> {
    let doc: admin::ClusterExport = respond::read_json(req.into_body(), body_limit(shared)).await?;
    if doc.api_version != EXPORT_API_VERSION || doc.kind != EXPORT_KIND {
        return Err(ApiError::invalid(format!(
            "expected apiVersion {EXPORT_API_VERSION:?} and kind {EXPORT_KIND:?}, got {:?} and {:?}",
            doc.api_version, doc.kind
        )));
    }
    check_registration(&doc.name, &doc.tags)?;
    let request = import_request(&doc)?;
    let imported = shared.rbac().prepare_import(&doc.name, request).await?;
    register(shared, doc.name, doc.tags, Some(imported)).await
}

async fn export(shared: &Shared, name: &str) -> Result<Response<Body>, ApiError> {
    let record = shared
        .store
        .cluster(name)
        .await?
        .ok_or_else(|| ApiError::cluster_not_found(name))?;
    let state = shared.rbac().export(name).await?;
    let items = |values: Vec<Result<Value, serde_json::Error>>| {
        values
            .into_iter()
            .collect::<Result<Vec<_>, _>>()
            .map_err(|e| ApiError::internal(format!("cannot encode the export: {e}")))
    };
    let document = admin::ClusterExport {
        api_version: EXPORT_API_VERSION.to_owned(),
        deny_assignments: items(
            state
                .deny_assignments
                .iter()
                .map(|d| serde_json::to_value(deny_view(d)))
                .collect(),
        )?,
        kind: EXPORT_KIND.to_owned(),
        name: record.name,
        role_assignments: items(
            state
                .assignments
                .iter()
                .map(|a| serde_json::to_value(assignment_view(a, &state.roles)))
                .collect(),
        )?,
        role_definitions: items(
            state
                .roles
                .iter()
                .map(|r| serde_json::to_value(role_view(r, false)))
                .collect(),
        )?,
        tags: record.tags,
    };
    Ok(respond::json(StatusCode::OK, &document))
}

/// The guard part of an export document, read for the RBAC service.
fn import_request(doc: &admin::ClusterExport) -> Result<ImportRequest, ApiError> {
    let mut assignments = Vec::new();
    for value in &doc.role_assignments {
        let a: admin::RoleAssignment = serde_json::from_value(value.clone()).map_err(|e| {
            ApiError::invalid(format!("invalid role assignment in the export: {e}"))
        })?;
        assignments.push((a.role_id, a.principal_id, a.namespace));
    }
    let mut denies = Vec::new();
    for value in &doc.deny_assignments {
        let d: admin::DenyAssignment = serde_json::from_value(value.clone()).map_err(|e| {
            ApiError::invalid(format!("invalid deny assignment in the export: {e}"))
        })?;
        denies.push(NewDeny {
            name: d.name,
            data_actions: d.data_actions,
            not_data_actions: d.not_data_actions,
            principals: d.principals,
            exclude_principals: d.exclude_principals,
            cluster: doc.name.clone(),
            namespace: d.namespace,
        });
    }
    Ok(ImportRequest {
        roles: doc.role_definitions.iter().map(Value::to_string).collect(),
        assignments,
        denies,
    })
}

/// `?status=S` (repeatable: any of them) and `?tag=KEY=VALUE` or `?tag=KEY` (repeatable: all of them).
#[derive(Debug, Default, PartialEq)]
struct Filters {
    statuses: Vec<ConnectivityStatus>,
    tags: Vec<(String, Option<String>)>,
}

impl Filters {
    fn parse(query: &str) -> Result<Self, ApiError> {
        let mut filters = Filters::default();
        for (key, value) in url::form_urlencoded::parse(query.as_bytes()) {
            match &*key {
                "status" => {
                    let status = ConnectivityStatus::parse(&value).ok_or_else(|| {
                        ApiError::invalid(format!(
                            "invalid status {value:?}: expected one of {}",
                            ConnectivityStatus::ALL
                                .map(ConnectivityStatus::as_str)
                                .join(", ")
                        ))
                    })?;
                    filters.statuses.push(status);
                }
                "tag" => {
                    let (k, v) = match value.split_once('=') {
                        Some((k, v)) => (k, Some(v.to_owned())),
                        None => (&*value, None),
                    };
                    if k.is_empty() {
                        return Err(ApiError::invalid(format!(
                            "invalid tag filter {value:?}: expected KEY=VALUE or KEY"
                        )));
                    }
                    filters.tags.push((k.to_owned(), v));
                }
                other => {
                    return Err(ApiError::invalid(format!(
                        "unknown query parameter {other:?}: the cluster list takes status and tag"
                    )));
                }
            }
        }
        Ok(filters)
    }

    fn matches(&self, record: &ClusterRecord, status: ConnectivityStatus) -> bool {
        (self.statuses.is_empty() || self.statuses.contains(&status))
            && self
                .tags
                .iter()
                .all(|(k, v)| match (record.tags.get(k), v) {
                    (Some(have), Some(want)) => have == want,
                    (Some(_), None) => true,
                    (None, _) => false,
                })
    }
}

async fn list(shared: &Shared, query: &str) -> Result<Response<Body>, ApiError> {
    let filters = Filters::parse(query)?;
    let now = OffsetDateTime::now_utc();
    let mut routes: HashMap<String, Vec<TunnelRoute>> = HashMap::new();
    for route in shared.store.tunnel_routes(None).await? {
        routes
            .entry(route.tunnel.cluster.clone())
            .or_default()
            .push(route);
    }
    let mut items = Vec::new();
    for mut record in shared.store.list_clusters().await? {
        shared.activity.overlay(&mut record);
        let tunnels = live_tunnels(
            shared,
            &record.name,
            routes.get(&record.name).map_or(&[][..], Vec::as_slice),
        );
        if filters.matches(&record, connectivity(shared, &record, &tunnels, now)) {
            items.push(cluster_view(shared, record, tunnels, now));
        }
    }
    Ok(respond::json(StatusCode::OK, &admin::List { items }))
}

async fn show(shared: &Shared, name: &str) -> Result<Response<Body>, ApiError> {
    let Some(record) = shared.store.cluster(name).await? else {
        return Err(ApiError::cluster_not_found(name));
    };
    let routes = shared.store.tunnel_routes(Some(name)).await?;
    let tunnels = live_tunnels(shared, name, &routes);
    Ok(respond::json(
        StatusCode::OK,
        &cluster_view(shared, record, tunnels, OffsetDateTime::now_utc()),
    ))
}

/// One live tunnel of a cluster, anywhere in the fleet, as the API shows it and the status counts it.
struct Live {
    api: admin::Tunnel,
    since: OffsetDateTime,
    instance: String,
    keeps: u32,
    usable: bool,
}

/// The cluster's live tunnels across the fleet: this replica's from its registry (current, with their RTT),
/// the other live replicas' from the store's `routes` (of any cluster; the cluster's are picked).
fn live_tunnels(shared: &Shared, cluster: &str, routes: &[TunnelRoute]) -> Vec<Live> {
    let me = &shared.fleet.replica_id;
    let mut live: Vec<Live> = shared
        .registry
        .tunnels(cluster)
        .iter()
        .map(|t| {
            let instance = t.info.instance();
            Live {
                api: admin::Tunnel {
                    agent_address: Some(t.info.peer.to_string()),
                    agent_instance: Some(instance.clone()).filter(|i| !i.is_empty()),
                    connected_since: rfc3339(Some(t.since)),
                    going_away: !t.is_usable(),
                    replica: Some(me.clone()),
                    rtt_millis: t.conn.rtt().map(|rtt| rtt.as_secs_f64() * 1000.0),
                    transport: t.conn.transport().as_str().to_owned(),
                },
                since: t.since,
                instance,
                keeps: t.info.said_tunnels(),
                usable: t.is_usable(),
            }
        })
        .collect();
    for r in routes
        .iter()
        .filter(|r| r.tunnel.cluster == cluster && &r.tunnel.replica != me)
    {
        let t = &r.tunnel;
        live.push(Live {
            api: admin::Tunnel {
                agent_address: Some(t.agent_address.clone()),
                agent_instance: Some(t.agent_instance.clone()).filter(|i| !i.is_empty()),
                connected_since: rfc3339(Some(t.connected_since)),
                going_away: !t.usable,
                replica: Some(t.replica.clone()),
                rtt_millis: None,
                transport: t.transport.clone(),
            },
            since: t.connected_since,
            instance: t.agent_instance.clone(),
            keeps: t.agent_tunnels,
            usable: t.usable,
        });
    }
    live.sort_by(|a, b| (&a.api.replica, a.since).cmp(&(&b.api.replica, b.since)));
    live
}

async fn delete(shared: &Shared, name: &str) -> Result<Response<Body>, ApiError> {
    // Deleting the row revokes the identity (its fingerprint is gone); then the live tunnel goes.
    if !shared.store.delete_cluster(name).await? {
        return Err(ApiError::cluster_not_found(name));
    }
    revocation::close_deleted(shared, name);
    tracing::info!(cluster = %name, "cluster deleted");
    Ok(respond::no_content())
}

/// RFC 3339 in whole seconds (what the store keeps), so a value does not change when it is written.
fn rfc3339(t: Option<OffsetDateTime>) -> Option<String> {
    t.and_then(|t| t.replace_nanosecond(0).ok())
        .and_then(|t| t.format(&Rfc3339).ok())
}

fn connectivity(
    shared: &Shared,
    c: &ClusterRecord,
    tunnels: &[Live],
    now: OffsetDateTime,
) -> ConnectivityStatus {
    let status = status::connectivity_status(
        c.identity.as_ref().map(|i| i.not_after),
        c.last_seen,
        now,
        shared.config.offline_threshold,
    );
    let counted: Vec<LiveTunnel<'_>> = tunnels
        .iter()
        .map(|t| LiveTunnel {
            instance: &t.instance,
            keeps: t.keeps,
            usable: t.usable,
        })
        .collect();
    status::with_tunnels(status, &counted, shared.fleet.live_replicas())
}

/// The cluster as the API shows it. `connected`, `connectedSince` and `tunnels` come from the fleet's live
/// tunnels; heartbeats not yet written to the store are applied first.
fn cluster_view(
    shared: &Shared,
    mut c: ClusterRecord,
    tunnels: Vec<Live>,
    now: OffsetDateTime,
) -> admin::Cluster {
    shared.activity.overlay(&mut c);
    let local = shared.registry.tunnels(&c.name);
    let status = connectivity(shared, &c, &tunnels, now);
    let latest = &shared.config.latest_agent_version;
    let metadata = c.metadata.as_ref();
    admin::Cluster {
        agent_health: c.health.as_ref().map(|h| admin::AgentHealth {
            cpu_seconds: h.cpu_seconds,
            memory_bytes: h.memory_bytes,
            reconnects: h.reconnects,
            reported_at: rfc3339(Some(h.reported_at)),
            tunnel_rtt_millis: h.tunnel_rtt_millis,
            uptime_seconds: h.uptime_seconds,
        }),
        upgrade_available: status::upgrade_available(c.agent_version.as_deref(), latest),
        agent_version: c.agent_version.clone(),
        connected: !tunnels.is_empty(),
        connected_since: rfc3339(tunnels.iter().map(|t| t.since).min()),
        connectivity_status: status.as_str().to_owned(),
        created_at: rfc3339(Some(c.created_at)),
        distribution: metadata.map(|m| m.distribution.clone()),
        identity: c.identity.as_ref().map(|i| admin::Identity {
            fingerprint: i.fingerprint.clone(),
            not_after: rfc3339(Some(i.not_after)),
        }),
        infrastructure: metadata.map(|m| m.infrastructure.clone()),
        kubernetes_version: metadata.map(|m| m.kubernetes_version.clone()),
        last_connectivity_time: rfc3339(c.last_seen),
        last_seen: rfc3339(c.last_seen),
        latest_agent_version: latest.clone(),
        metadata_reported_at: rfc3339(metadata.map(|m| m.reported_at)),
        node_count: metadata.map(|m| m.node_count),
        onboarded: c.onboarded,
        open_streams: (!local.is_empty())
            .then(|| local.iter().map(|t| t.conn.open_streams() as u64).sum()),
        total_cpu_millis: metadata.map(|m| m.total_cpu_millis),
        total_memory_bytes: metadata.map(|m| m.total_memory_bytes),
        name: c.name,
        tags: c.tags,
        tunnels: tunnels.into_iter().map(|t| t.api).collect(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn list_filters() {
        let f = Filters::parse("status=Connected&tag=env%3Dprod&tag=team&status=offline")
            .unwrap_or_default();
        assert_eq!(
            f,
            Filters {
                statuses: vec![ConnectivityStatus::Connected, ConnectivityStatus::Offline],
                tags: vec![("env".into(), Some("prod".into())), ("team".into(), None)],
            }
        );
        // `=` inside the value is the tag's: only the first one splits.
        let f = Filters::parse("tag=url=a=b").unwrap_or_default();
        assert_eq!(f.tags, vec![("url".into(), Some("a=b".into()))]);
        assert!(Filters::parse("status=Gone").is_err());
        assert!(Filters::parse("tag==x").is_err());
        assert!(Filters::parse("colour=red").is_err());
        assert_eq!(Filters::parse("").unwrap_or_default(), Filters::default());

        let record = ClusterRecord {
            name: "a".into(),
            tags: BTreeMap::from([
                ("env".to_string(), "prod".to_string()),
                ("team".to_string(), "x".to_string()),
            ]),
            created_at: OffsetDateTime::UNIX_EPOCH,
            onboarded: true,
            connected_since: None,
            last_seen: None,
            agent_version: None,
            identity: None,
            metadata: None,
            health: None,
        };
        let f = Filters::parse("tag=env=prod&tag=team").unwrap_or_default();
        assert!(f.matches(&record, ConnectivityStatus::Offline));
        let f = Filters::parse("tag=env=prod&tag=region").unwrap_or_default();
        assert!(!f.matches(&record, ConnectivityStatus::Offline));
        let f = Filters::parse("tag=env=dev").unwrap_or_default();
        assert!(!f.matches(&record, ConnectivityStatus::Offline));
        let f = Filters::parse("status=Connected").unwrap_or_default();
        assert!(!f.matches(&record, ConnectivityStatus::Offline));
        assert!(f.matches(&record, ConnectivityStatus::Connected));
    }
}
