//! The admin REST API (`/api/v1/…`, `docs/API.md`): the request and response bodies, serialized by the relay and
//! deserialized by the `tether` command.
//!
//! Fields are declared in alphabetical order of their JSON names, so the relay writes objects with their keys in
//! the same order as before these types existed (it used `serde_json::json!`, whose maps are sorted). Timestamps
//! are RFC 3339 strings (`null` when unknown). Optional fields the API leaves out when unset are marked so.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

/// `apiVersion` of an exported cluster.
pub const EXPORT_API_VERSION: &str = "tether.dev/v1";
/// `kind` of an exported cluster.
pub const EXPORT_KIND: &str = "ClusterExport";

/// A list answer: `{"items": [...]}`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct List<T> {
    /// The items.
    pub items: Vec<T>,
}

/// `POST /api/v1/clusters`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NewCluster {
    /// The cluster's name (a DNS-1123 label).
    pub name: String,
    /// Free-form tags.
    #[serde(default)]
    pub tags: BTreeMap<String, String>,
}

/// What an agent last reported about itself.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct AgentHealth {
    /// Cumulative CPU time of the agent process.
    pub cpu_seconds: f64,
    /// Resident memory of the agent process.
    pub memory_bytes: u64,
    /// Tunnel reconnects since the agent started.
    pub reconnects: u64,
    /// When the relay received the report.
    pub reported_at: Option<String>,
    /// The last measured tunnel round trip.
    pub tunnel_rtt_millis: Option<f64>,
    /// Seconds since the agent started.
    pub uptime_seconds: u64,
}

/// The cluster's identity (client certificate) as the relay knows it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Identity {
    /// SHA-256 fingerprint of the certificate.
    pub fingerprint: String,
    /// When it expires.
    pub not_after: Option<String>,
}

/// A cluster as `GET /api/v1/clusters[/NAME]` shows it; `POST` answers are a [`Created`].
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Cluster {
    /// The agent's last health report.
    pub agent_health: Option<AgentHealth>,
    /// The agent's version.
    pub agent_version: Option<String>,
    /// Whether a tunnel is up now.
    pub connected: bool,
    /// Since when the oldest live tunnel is up.
    pub connected_since: Option<String>,
    /// `Connecting`, `Connected`, `Degraded` (connected with fewer live tunnels than its agent keeps),
    /// `Offline` or `Expired` (see `docs/API.md`).
    pub connectivity_status: String,
    /// When the cluster was registered.
    pub created_at: Option<String>,
    /// The distribution the agent detected.
    pub distribution: Option<String>,
    /// The cluster's identity, once onboarded.
    pub identity: Option<Identity>,
    /// The infrastructure the agent detected.
    pub infrastructure: Option<String>,
    /// The apiserver's version.
    pub kubernetes_version: Option<String>,
    /// When the agent was last heard from (the name Azure Arc uses).
    pub last_connectivity_time: Option<String>,
    /// When the agent was last heard from.
    pub last_seen: Option<String>,
    /// The newest agent version the relay offers.
    pub latest_agent_version: String,
    /// When the metadata was reported.
    pub metadata_reported_at: Option<String>,
    /// The cluster's name.
    pub name: String,
    /// Nodes in the cluster.
    pub node_count: Option<u64>,
    /// Whether the onboarding token was redeemed.
    pub onboarded: bool,
    /// Streams open on the cluster's tunnels at the relay replica that answered, control streams included
    /// (`None` without a tunnel there): requests in flight, watches, exec sessions — what the fault-injection
    /// tests watch for leaks.
    #[serde(default)]
    pub open_streams: Option<u64>,
    /// Tags.
    pub tags: BTreeMap<String, String>,
    /// Allocatable CPU over all nodes, in millicores.
    pub total_cpu_millis: Option<u64>,
    /// Allocatable memory over all nodes.
    pub total_memory_bytes: Option<u64>,
    /// The live tunnels of the cluster across the relay fleet, each with the replica holding it (empty when
    /// not connected).
    #[serde(default)]
    pub tunnels: Vec<Tunnel>,
    /// Whether the agent is older than `latestAgentVersion`.
    pub upgrade_available: bool,
}

/// One live tunnel of a cluster, as the relay measures it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Tunnel {
    /// The agent's address as the relay replica holding the tunnel sees it.
    #[serde(default)]
    pub agent_address: Option<String>,
    /// The agent process holding the tunnel (its `hello.instance`), when the agent says: tells the tunnels of
    /// two agent replicas sharing one identity apart.
    #[serde(default)]
    pub agent_instance: Option<String>,
    /// Since when this tunnel is up.
    pub connected_since: Option<String>,
    /// True once the tunnel got GOAWAY (the agent is moving it, or the replica drains): it takes no new
    /// requests while its streams in flight finish.
    #[serde(default)]
    pub going_away: bool,
    /// The relay replica holding the tunnel.
    #[serde(default)]
    pub replica: Option<String>,
    /// Smoothed round trip of the tunnel seen from the relay: QUIC's own estimate, or the WebSocket
    /// transport's keepalive ping; `None` before the first measurement, and for tunnels held by another
    /// replica than the one that answered.
    pub rtt_millis: Option<f64>,
    /// `quic` or `wss`.
    pub transport: String,
}

/// The answer to `POST /api/v1/clusters` and `POST /api/v1/clusters/import`: the cluster and its one-time
/// onboarding token (shown only here).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Created {
    /// The cluster.
    #[serde(flatten)]
    pub cluster: Cluster,
    /// The one-time onboarding token.
    pub onboarding_token: String,
}

/// A role definition, built in or custom.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct RoleDefinition {
    /// Whether the role is built in.
    #[serde(default)]
    pub built_in: bool,
    /// Granted data actions.
    pub data_actions: Vec<String>,
    /// What the role is for.
    #[serde(default)]
    pub description: String,
    /// The role's id.
    pub id: String,
    /// The role's name.
    pub name: String,
    /// Data actions taken out of `dataActions`.
    #[serde(default)]
    pub not_data_actions: Vec<String>,
}

/// `POST /api/v1/roleassignments`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct NewRoleAssignment {
    /// The cluster.
    pub cluster: String,
    /// The namespace the assignment is limited to.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub namespace: Option<String>,
    /// The principal's object id.
    pub principal_id: String,
    /// The role, by id or name.
    pub role: String,
}

/// A role assignment. In an export document only `roleId`, `principalId` and `namespace` are read back.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct RoleAssignment {
    /// The cluster.
    #[serde(default)]
    pub cluster: String,
    /// When it was created.
    #[serde(default)]
    pub created_at: Option<String>,
    /// The assignment's id.
    #[serde(default)]
    pub id: String,
    /// The namespace it is limited to (absent: the whole cluster).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub namespace: Option<String>,
    /// The principal's object id.
    pub principal_id: String,
    /// The role's id.
    pub role_id: String,
    /// The role's name, when the relay knows the role.
    #[serde(default)]
    pub role_name: Option<String>,
}

/// `POST /api/v1/denyassignments`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct NewDenyAssignment {
    /// The cluster.
    pub cluster: String,
    /// Denied data actions.
    pub data_actions: Vec<String>,
    /// Principals the deny does not apply to.
    #[serde(default)]
    pub exclude_principals: Vec<String>,
    /// A name for people.
    #[serde(default)]
    pub name: String,
    /// The namespace it is limited to.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub namespace: Option<String>,
    /// Data actions taken out of `dataActions`.
    #[serde(default)]
    pub not_data_actions: Vec<String>,
    /// Denied principals (`*` for everyone).
    pub principals: Vec<String>,
}

/// A deny assignment. In an export document `id`, `cluster` and `createdAt` are not read back.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct DenyAssignment {
    /// The cluster.
    #[serde(default)]
    pub cluster: String,
    /// When it was created.
    #[serde(default)]
    pub created_at: Option<String>,
    /// Denied data actions.
    pub data_actions: Vec<String>,
    /// Principals the deny does not apply to.
    #[serde(default)]
    pub exclude_principals: Vec<String>,
    /// The deny assignment's id.
    #[serde(default)]
    pub id: String,
    /// A name for people.
    #[serde(default)]
    pub name: String,
    /// The namespace it is limited to (absent: the whole cluster).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub namespace: Option<String>,
    /// Data actions taken out of `dataActions`.
    #[serde(default)]
    pub not_data_actions: Vec<String>,
    /// Denied principals.
    pub principals: Vec<String>,
}

/// `GET /api/v1/clusters/NAME/export`, the body of `POST /api/v1/clusters/import`.
///
/// The relay reads an import's items one by one (so it can say which one is wrong, and accept the role-definition
/// forms guard accepts), hence they are kept as JSON here; they have the shapes of [`RoleAssignment`],
/// [`DenyAssignment`] and [`RoleDefinition`].
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct ClusterExport {
    /// [`EXPORT_API_VERSION`].
    pub api_version: String,
    /// Deny assignments.
    #[serde(default)]
    pub deny_assignments: Vec<serde_json::Value>,
    /// [`EXPORT_KIND`].
    pub kind: String,
    /// The cluster's name.
    pub name: String,
    /// Role assignments.
    #[serde(default)]
    pub role_assignments: Vec<serde_json::Value>,
    /// The custom role definitions the assignments use.
    #[serde(default)]
    pub role_definitions: Vec<serde_json::Value>,
    /// Tags.
    #[serde(default)]
    pub tags: BTreeMap<String, String>,
}

/// `PUT /api/v1/directory/users/OID`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct SetGroups {
    /// The user's groups (object ids).
    pub groups: Vec<String>,
    /// The tenant the entry applies to (absent: any).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tid: Option<String>,
}

/// A user's entry in the relay's group directory.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct DirectoryEntry {
    /// The user's groups.
    pub groups: Vec<String>,
    /// The user's object id.
    pub oid: String,
    /// The tenant, if the entry is limited to one.
    pub tid: Option<String>,
    /// When the entry was last set.
    pub updated_at: Option<String>,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_come_out_sorted_and_optional_ones_as_documented() -> Result<(), serde_json::Error> {
        let a = RoleAssignment {
            cluster: "c".into(),
            created_at: None,
            id: "i".into(),
            namespace: None,
            principal_id: "p".into(),
            role_id: "r".into(),
            role_name: None,
        };
        assert_eq!(
            serde_json::to_string(&a)?,
            r#"{"cluster":"c","createdAt":null,"id":"i","principalId":"p","roleId":"r","roleName":null}"#
        );
        let imported: RoleAssignment =
            serde_json::from_str(r#"{"roleId":"r","principalId":"p","namespace":"dev"}"#)?;
        assert_eq!(imported.namespace.as_deref(), Some("dev"));
        Ok(())
    }
}
