//! A client of the relay's admin REST API (`docs/API.md`).

use std::collections::BTreeMap;
use std::time::Duration;

use bytes::Bytes;
use http::{Method, Request, StatusCode, header};
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use serde::Serialize;
use serde::de::DeserializeOwned;
use serde_json::Value;
use tether_api::admin;
use tether_runtime::Secret;

use crate::config::ResolvedConfig;

/// Why a request to the relay failed.
#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    /// TLS could not be set up.
    #[error("cannot set up TLS for the relay: {0}")]
    Tls(String),
    /// The relay could not be reached.
    #[error("cannot reach the relay at {url}: {message}")]
    Unreachable {
        /// The relay URL.
        url: String,
        /// What went wrong.
        message: String,
    },
    /// The relay answered with an error status.
    #[error("the relay answered {status}: {message}")]
    Status {
        /// HTTP status.
        status: StatusCode,
        /// The relay's message.
        message: String,
    },
    /// The relay's answer was not what the API promises.
    #[error("unexpected answer from the relay: {0}")]
    Decode(String),
    /// The request could not be built (a bad name, say).
    #[error("invalid request: {0}")]
    InvalidRequest(String),
}

impl ClientError {
    /// The HTTP status, when the relay answered.
    pub fn status(&self) -> Option<StatusCode> {
        match self {
            ClientError::Status { status, .. } => Some(*status),
            _ => None,
        }
    }
}

/// A registered cluster, as returned by `POST /api/v1/clusters`.
#[derive(Debug, Clone)]
pub struct CreatedCluster {
    /// The cluster's name.
    pub name: String,
    /// The one-time onboarding token.
    pub onboarding_token: Secret,
    /// The relay's whole answer.
    pub raw: admin::Created,
}

impl CreatedCluster {
    fn from_answer(raw: admin::Created) -> Self {
        CreatedCluster {
            name: raw.cluster.name.clone(),
            onboarding_token: Secret::new(raw.onboarding_token.clone()),
            raw,
        }
    }
}

#[derive(Clone)]
pub struct RelayClient {
    base: String,
    token: Secret,
    http: Client<hyper_rustls::HttpsConnector<HttpConnector>, Full<Bytes>>,
}

/// No request body.
const NO_BODY: Option<&Value> = None;

const TIMEOUT: Duration = Duration::from_secs(30);
const MAX_ANSWER: usize = 16 * 1024 * 1024;

impl RelayClient {
    /// A client for the configured relay (the config must hold an admin token).
    pub fn new(config: &ResolvedConfig) -> Result<Self, ClientError> {
        let token = config
            .admin_token
            .clone()
            .ok_or_else(|| ClientError::Tls("no admin token".into()))?;
        Self::with_token(&config.relay_url, config.ca_pem.as_deref(), token)
    }

    /// A client for `base` trusting `ca_pem` (or web PKI roots), authenticating with `token`.
    pub fn with_token(
        base: &str,
        ca_pem: Option<&[u8]>,
        token: Secret,
    ) -> Result<Self, ClientError> {
        let tls = tether_runtime::tls::client_config(ca_pem, &[])
            .map_err(|e| ClientError::Tls(e.to_string()))?;
        let connector = hyper_rustls::HttpsConnectorBuilder::new()
            .with_tls_config((*tls).clone())
            .https_only()
            .enable_http1()
            .build();
        let http = Client::builder(TokioExecutor::new()).build(connector);
        Ok(Self {
            base: base.trim_end_matches('/').to_string(),
            token,
            http,
        })
    }

    /// Registers a cluster.
    pub async fn create_cluster(
        &self,
        name: &str,
        tags: &BTreeMap<String, String>,
    ) -> Result<CreatedCluster, ClientError> {
        let body = admin::NewCluster {
            name: name.to_owned(),
            tags: tags.clone(),
        };
        let raw = self
            .call(Method::POST, "/api/v1/clusters", Some(&body))
            .await?;
        Ok(CreatedCluster::from_answer(raw))
    }

    /// Lists clusters.
    pub async fn list_clusters(&self) -> Result<Vec<admin::Cluster>, ClientError> {
        self.list_clusters_matching(&[], &[]).await
    }

    /// Lists the clusters whose `connectivityStatus` is one of `statuses` (any status when empty) and that carry
    /// every tag filter in `tags` (`KEY=VALUE`, or `KEY` for any value).
    pub async fn list_clusters_matching(
        &self,
        statuses: &[&str],
        tags: &[String],
    ) -> Result<Vec<admin::Cluster>, ClientError> {
        let mut query = url::form_urlencoded::Serializer::new(String::new());
        for status in statuses {
            query.append_pair("status", status);
        }
        for tag in tags {
            query.append_pair("tag", tag);
        }
        let query = query.finish();
        let path = if query.is_empty() {
            "/api/v1/clusters".to_string()
        } else {
            format!("/api/v1/clusters?{query}")
        };
        let answer: admin::List<admin::Cluster> = self.call(Method::GET, &path, NO_BODY).await?;
        Ok(answer.items)
    }

    /// A cluster's export document (`kind: ClusterExport`): what `import` needs at another relay.
    pub async fn export_cluster(&self, name: &str) -> Result<admin::ClusterExport, ClientError> {
        self.call(
            Method::GET,
            &format!("{}/export", cluster_path(name)?),
            NO_BODY,
        )
        .await
    }

    /// Registers a cluster from an export document; like [`RelayClient::create_cluster`], the answer carries a
    /// new onboarding token.
    pub async fn import_cluster(&self, document: &Value) -> Result<CreatedCluster, ClientError> {
        let raw = self
            .call(Method::POST, "/api/v1/clusters/import", Some(document))
            .await?;
        Ok(CreatedCluster::from_answer(raw))
    }

    /// Shows one cluster.
    pub async fn show_cluster(&self, name: &str) -> Result<admin::Cluster, ClientError> {
        self.call(Method::GET, &cluster_path(name)?, NO_BODY).await
    }

    /// Shows one cluster as the relay's JSON, fields this client's types do not name included.
    pub async fn show_cluster_json(&self, name: &str) -> Result<Value, ClientError> {
        self.call(Method::GET, &cluster_path(name)?, NO_BODY).await
    }

    /// `GET path` (a probe such as `/readyz`): the status and the body, whatever the status.
    pub async fn get_raw(&self, path: &str) -> Result<(StatusCode, Bytes), ClientError> {
        self.send(Method::GET, path, Bytes::new()).await
    }

    /// Deletes a cluster.
    pub async fn delete_cluster(&self, name: &str) -> Result<(), ClientError> {
        self.delete(&cluster_path(name)?).await
    }

    /// Assigns `role` (id or name, built-ins included) to `principal` (an object id) on `cluster`, or on one
    /// `namespace` of it; the created assignment.
    pub async fn assign_role(
        &self,
        role: &str,
        principal: &str,
        cluster: &str,
        namespace: Option<&str>,
    ) -> Result<admin::RoleAssignment, ClientError> {
        let body = admin::NewRoleAssignment {
            cluster: cluster.to_owned(),
            namespace: namespace.map(str::to_owned),
            principal_id: principal.to_owned(),
            role: role.to_owned(),
        };
        self.call(Method::POST, "/api/v1/roleassignments", Some(&body))
            .await
    }

    /// Role assignments, of one cluster or all.
    pub async fn role_assignments(
        &self,
        cluster: Option<&str>,
    ) -> Result<Vec<admin::RoleAssignment>, ClientError> {
        self.items("/api/v1/roleassignments", cluster).await
    }

    /// Deletes a role assignment.
    pub async fn delete_role_assignment(&self, id: &str) -> Result<(), ClientError> {
        let path = format!("/api/v1/roleassignments/{}", segment(id)?);
        self.delete(&path).await
    }

    /// Creates a custom role definition from its JSON (any form `tether_auth::rbac::RoleDefinition::from_json`
    /// accepts: this one, `az role definition`'s, or ARM's).
    pub async fn define_role(
        &self,
        definition: &Value,
    ) -> Result<admin::RoleDefinition, ClientError> {
        self.call(Method::POST, "/api/v1/roledefinitions", Some(definition))
            .await
    }

    /// Role definitions: the built-ins, then the custom ones.
    pub async fn role_definitions(&self) -> Result<Vec<admin::RoleDefinition>, ClientError> {
        self.items("/api/v1/roledefinitions", None).await
    }

    /// Deletes a custom role definition (refused while it is assigned).
    pub async fn delete_role_definition(&self, id: &str) -> Result<(), ClientError> {
        let path = format!("/api/v1/roledefinitions/{}", segment(id)?);
        self.delete(&path).await
    }

    /// Creates a deny assignment (`{name, dataActions, notDataActions, principals, excludePrincipals, cluster,
    /// namespace?}`).
    pub async fn create_deny_assignment(
        &self,
        body: &admin::NewDenyAssignment,
    ) -> Result<admin::DenyAssignment, ClientError> {
        self.call(Method::POST, "/api/v1/denyassignments", Some(body))
            .await
    }

    /// Deny assignments, of one cluster or all.
    pub async fn deny_assignments(
        &self,
        cluster: Option<&str>,
    ) -> Result<Vec<admin::DenyAssignment>, ClientError> {
        self.items("/api/v1/denyassignments", cluster).await
    }

    /// Deletes a deny assignment.
    pub async fn delete_deny_assignment(&self, id: &str) -> Result<(), ClientError> {
        let path = format!("/api/v1/denyassignments/{}", segment(id)?);
        self.delete(&path).await
    }

    /// Records the groups of user `oid` in the relay's directory (used when a token carries a group overage).
    pub async fn set_groups(
        &self,
        oid: &str,
        groups: &[String],
    ) -> Result<admin::DirectoryEntry, ClientError> {
        let path = format!("/api/v1/directory/users/{}", segment(oid)?);
        let body = admin::SetGroups {
            groups: groups.to_vec(),
            tid: None,
        };
        self.call(Method::PUT, &path, Some(&body)).await
    }

    /// A user's directory entry.
    pub async fn directory_entry(&self, oid: &str) -> Result<admin::DirectoryEntry, ClientError> {
        let path = format!("/api/v1/directory/users/{}", segment(oid)?);
        self.call(Method::GET, &path, NO_BODY).await
    }

    /// Removes a user from the relay's directory.
    pub async fn delete_directory_entry(&self, oid: &str) -> Result<(), ClientError> {
        let path = format!("/api/v1/directory/users/{}", segment(oid)?);
        self.delete(&path).await
    }

    async fn items<T: DeserializeOwned>(
        &self,
        path: &str,
        cluster: Option<&str>,
    ) -> Result<Vec<T>, ClientError> {
        let path = match cluster {
            Some(c) => format!(
                "{path}?{}",
                url::form_urlencoded::Serializer::new(String::new())
                    .append_pair("cluster", c)
                    .finish()
            ),
            None => path.to_string(),
        };
        let answer: admin::List<T> = self.call(Method::GET, &path, NO_BODY).await?;
        Ok(answer.items)
    }

    async fn delete(&self, path: &str) -> Result<(), ClientError> {
        self.call::<serde::de::IgnoredAny>(Method::DELETE, path, NO_BODY)
            .await
            .map(|_| ())
    }

    /// Sends `body` as JSON and reads the answer as a `T` (an empty answer reads as JSON `null`).
    async fn call<T: DeserializeOwned>(
        &self,
        method: Method,
        path: &str,
        body: Option<&(impl Serialize + ?Sized)>,
    ) -> Result<T, ClientError> {
        let body = match body {
            Some(v) => Bytes::from(
                serde_json::to_vec(v).map_err(|e| ClientError::InvalidRequest(e.to_string()))?,
            ),
            None => Bytes::new(),
        };
        let (status, bytes) = self.send(method, path, body).await?;
        if !status.is_success() {
            let message = serde_json::from_slice::<Value>(&bytes)
                .ok()
                .and_then(|v| v.get("message").and_then(Value::as_str).map(str::to_string))
                .unwrap_or_else(|| String::from_utf8_lossy(&bytes).chars().take(500).collect());
            return Err(ClientError::Status { status, message });
        }
        let bytes: &[u8] = if bytes.is_empty() { b"null" } else { &bytes };
        serde_json::from_slice(bytes).map_err(|e| ClientError::Decode(e.to_string()))
    }

    /// Sends one request with the admin token; the status and the whole answer (bounded).
    async fn send(
        &self,
        method: Method,
        path: &str,
        body: Bytes,
    ) -> Result<(StatusCode, Bytes), ClientError> {
        let url = format!("{}{}", self.base, path);
        let request = Request::builder()
            .method(method)
            .uri(&url)
            .header(
                header::AUTHORIZATION,
                format!("Bearer {}", self.token.expose()),
            )
            .header(header::ACCEPT, "application/json")
            .header(header::CONTENT_TYPE, "application/json")
            .body(Full::new(body))
            .map_err(|e| ClientError::InvalidRequest(e.to_string()))?;
        let unreachable = |message: String| ClientError::Unreachable {
            url: self.base.clone(),
            message,
        };
        let response = tokio::time::timeout(TIMEOUT, self.http.request(request))
            .await
            .map_err(|_| unreachable(format!("no answer within {TIMEOUT:?}")))?
            .map_err(|e| unreachable(error_chain(&e)))?;
        let status = response.status();
        let limited = http_body_util::Limited::new(response.into_body(), MAX_ANSWER);
        let bytes = tokio::time::timeout(TIMEOUT, limited.collect())
            .await
            .map_err(|_| unreachable(format!("answer not complete within {TIMEOUT:?}")))?
            .map_err(|e| ClientError::Decode(e.to_string()))?
            .to_bytes();
        Ok((status, bytes))
    }
}

fn cluster_path(name: &str) -> Result<String, ClientError> {
    if name.is_empty()
        || !name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'.' || b == b'_')
    {
        return Err(ClientError::InvalidRequest(format!(
            "{name:?} is not a valid cluster name"
        )));
    }
    Ok(format!("/api/v1/clusters/{name}"))
}

/// One path segment, percent-encoded (ids are opaque to the client).
fn segment(id: &str) -> Result<String, ClientError> {
    if id.is_empty() {
        return Err(ClientError::InvalidRequest("an empty id".into()));
    }
    // Everything but RFC 3986's unreserved characters.
    const ESCAPED: &percent_encoding::AsciiSet = &percent_encoding::NON_ALPHANUMERIC
        .remove(b'-')
        .remove(b'.')
        .remove(b'_')
        .remove(b'~');
    Ok(percent_encoding::utf8_percent_encode(id, ESCAPED).to_string())
}

fn error_chain(e: &dyn std::error::Error) -> String {
    let mut message = e.to_string();
    let mut source = e.source();
    while let Some(cause) = source {
        message.push_str(": ");
        message.push_str(&cause.to_string());
        source = cause.source();
    }
    message
}
