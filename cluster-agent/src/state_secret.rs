//! The identity in a Kubernetes Secret (`--state-secret NAMESPACE/NAME`) instead of the state directory, so a
//! pod can move to another node and keep it, and replicas share it.
//!
//! The Secret holds `identity.json` and `identity-key.pem` (the same content as the state directory's files),
//! written through the apiserver with the agent's own credentials (it needs `get`, `create` and `update` on
//! that one Secret). Replicas coordinate with the apiserver's optimistic concurrency only:
//!
//! - **Onboarding, once.** An agent that finds no usable identity *claims* onboarding: it creates the Secret
//!   with a claim (holder and time, in annotations) — or, when the Secret exists without a usable identity and
//!   without a live claim, replaces it with the `resourceVersion` it read. The loser of that race gets 409
//!   (`AlreadyExists` or `Conflict`) and waits, reading the Secret until the identity appears. The holder
//!   refreshes its claim while it onboards; a claim not refreshed for [`CLAIM_STALE`] (its holder died) can be
//!   taken over the same way.
//! - **Renewals** replace the Secret with the `resourceVersion` read just before; on 409 `Conflict` the agent
//!   reads it again and retries (a few times), and never overwrites an identity that lasts longer than its own.
//!
//! What it does not do: create the namespace or any RBAC, or read Secrets other than the one named.

use std::collections::BTreeMap;
use std::fmt;
use std::str::FromStr;
use std::time::Duration;

use k8s_openapi::ByteString;
use k8s_openapi::api::core::v1::Secret as KubeSecret;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kube::api::{Api, PostParams};
use time::OffsetDateTime;
use time::format_description::well_known::Rfc3339;

use crate::identity::{self, Identity, IdentityError};

/// A claim not refreshed for this long is taken to be abandoned (its holder died while onboarding).
pub const CLAIM_STALE: Duration = Duration::from_secs(120);
/// Attempts at a write that keeps meeting 409 `Conflict`.
const WRITE_ATTEMPTS: usize = 5;

const CLAIM_HOLDER: &str = "tether.dev/onboarding-holder";
const CLAIM_RENEWED: &str = "tether.dev/onboarding-renewed";
const MANAGED_BY: (&str, &str) = ("app.kubernetes.io/managed-by", "tether-agent");

/// `NAMESPACE/NAME` of the Secret (`--state-secret`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SecretRef {
    /// The namespace.
    pub namespace: String,
    /// The Secret's name.
    pub name: String,
}

impl FromStr for SecretRef {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        let (namespace, name) = s
            .split_once('/')
            .ok_or_else(|| format!("expected NAMESPACE/NAME, not {s:?}"))?;
        if !is_dns_label(namespace) {
            return Err(format!("invalid namespace {namespace:?}"));
        }
        if !is_dns_subdomain(name) {
            return Err(format!("invalid Secret name {name:?}"));
        }
        Ok(Self {
            namespace: namespace.to_owned(),
            name: name.to_owned(),
        })
    }
}

impl fmt::Display for SecretRef {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.namespace, self.name)
    }
}

/// Why the Secret could not be read or written.
#[derive(Debug, thiserror::Error)]
pub enum StateSecretError {
    /// The apiserver refused or failed a request.
    #[error("cannot {action} the Secret {secret}: {source}")]
    Api {
        /// What was being done.
        action: &'static str,
        /// The Secret.
        secret: String,
        /// The cause.
        #[source]
        source: kube::Error,
    },
    /// The Secret holds something that is not an identity.
    #[error(transparent)]
    Identity(#[from] IdentityError),
    /// Writes kept meeting newer versions.
    #[error(
        "the Secret {0} kept changing under this agent's writes (409 Conflict {WRITE_ATTEMPTS} times)"
    )]
    Contended(String),
}

/// What [`SecretStore::acquire`] found.
#[derive(Debug)]
pub(crate) enum Acquired {
    /// An identity this agent may use.
    Identity(Identity),
    /// This agent holds the onboarding claim: it onboards and then [`SecretStore::store`]s.
    Claimed,
    /// Another agent holds a live claim: read again in a moment.
    Wait,
}

/// The Secret holding the identity.
pub(crate) struct SecretStore {
    api: Api<KubeSecret>,
    secret: SecretRef,
    /// Names this agent in its claims.
    holder: String,
}

impl SecretStore {
    /// The store for `secret`, reached with `client` (the agent's own credentials).
    pub(crate) fn new(client: kube::Client, secret: &SecretRef) -> Self {
        let holder = format!(
            "{}-{:016x}",
            std::env::var("HOSTNAME").unwrap_or_else(|_| "agent".to_owned()),
            rand::random::<u64>()
        );
        Self {
            api: Api::namespaced(client, &secret.namespace),
            secret: secret.clone(),
            holder,
        }
    }

    /// `NAMESPACE/NAME`.
    pub(crate) fn name(&self) -> String {
        self.secret.to_string()
    }

    fn api_error(&self, action: &'static str) -> impl FnOnce(kube::Error) -> StateSecretError + '_ {
        move |source| StateSecretError::Api {
            action,
            secret: self.secret.to_string(),
            source,
        }
    }

    async fn read(&self) -> Result<Option<KubeSecret>, StateSecretError> {
        self.api
            .get_opt(&self.secret.name)
            .await
            .map_err(self.api_error("read"))
    }

    fn identity_in(
        &self,
        secret: &KubeSecret,
        relay: &str,
        cluster: &str,
    ) -> Result<Option<Identity>, StateSecretError> {
        let data = secret.data.as_ref();
        let field = |key: &str| data.and_then(|d| d.get(key)).map(|b| b.0.clone());
        let Some(json) = field(identity::FILE_NAME) else {
            return Ok(None);
        };
        let where_ = format!("Secret {}", self.secret);
        let key = || {
            let bytes = field(identity::KEY_FILE_NAME).ok_or_else(|| IdentityError::Corrupt {
                path: where_.clone(),
                reason: format!("no {}", identity::KEY_FILE_NAME),
            })?;
            String::from_utf8(bytes).map_err(|_| IdentityError::Corrupt {
                path: where_.clone(),
                reason: "the key is not text".to_owned(),
            })
        };
        Ok(identity::decode(&json, key, relay, cluster, &where_)?)
    }

    /// The identity for `relay` and `cluster` the Secret holds, if any, read only (no claim): what
    /// `tether-agent doctor` inspects.
    pub(crate) async fn peek(
        &self,
        relay: &str,
        cluster: &str,
    ) -> Result<Option<Identity>, StateSecretError> {
        match self.read().await? {
            Some(secret) => self.identity_in(&secret, relay, cluster),
            None => Ok(None),
        }
    }

    /// The identity for `relay` and `cluster` when the Secret holds one that `usable` accepts; else a claim to
    /// onboard, or word to wait for another agent's onboarding.
    pub(crate) async fn acquire(
        &self,
        relay: &str,
        cluster: &str,
        usable: impl Fn(&Identity) -> bool,
    ) -> Result<Acquired, StateSecretError> {
        let Some(mut current) = self.read().await? else {
            let fresh = self.claimed(KubeSecret {
                metadata: ObjectMeta {
                    name: Some(self.secret.name.clone()),
                    namespace: Some(self.secret.namespace.clone()),
                    labels: Some(BTreeMap::from([(
                        MANAGED_BY.0.to_owned(),
                        MANAGED_BY.1.to_owned(),
                    )])),
                    ..ObjectMeta::default()
                },
                type_: Some("Opaque".to_owned()),
                ..KubeSecret::default()
            });
            return match self.api.create(&PostParams::default(), &fresh).await {
                Ok(_) => Ok(Acquired::Claimed),
                Err(kube::Error::Api(status)) if status.is_already_exists() => Ok(Acquired::Wait),
                Err(e) => Err(self.api_error("create")(e)),
            };
        };
        if let Some(identity) = self.identity_in(&current, relay, cluster)?
            && usable(&identity)
        {
            return Ok(Acquired::Identity(identity));
        }
        if self.claim_is_live(&current) {
            return Ok(Acquired::Wait);
        }
        current = self.claimed(current);
        match self
            .api
            .replace(&self.secret.name, &PostParams::default(), &current)
            .await
        {
            Ok(_) => Ok(Acquired::Claimed),
            Err(kube::Error::Api(status)) if status.is_conflict() => Ok(Acquired::Wait),
            Err(e) => Err(self.api_error("claim")(e)),
        }
    }

    /// Refreshes this agent's claim while it onboards (a no-op when another agent took it over meanwhile).
    pub(crate) async fn refresh_claim(&self) -> Result<(), StateSecretError> {
        let Some(current) = self.read().await? else {
            return Ok(());
        };
        if self.holder_of(&current) != Some(self.holder.as_str()) {
            tracing::warn!(secret = %self.secret, "another agent took over the onboarding claim");
            return Ok(());
        }
        let refreshed = self.claimed(current);
        match self
            .api
            .replace(&self.secret.name, &PostParams::default(), &refreshed)
            .await
        {
            Ok(_) => Ok(()),
            // Someone wrote meanwhile; the next refresh reads again.
            Err(kube::Error::Api(status)) if status.is_conflict() => Ok(()),
            Err(e) => Err(self.api_error("refresh the claim on")(e)),
        }
    }

    /// Writes `identity` (and drops any claim), with the `resourceVersion` just read; on 409 `Conflict` reads
    /// again. An identity in the Secret that lasts longer than `identity` is kept, not overwritten.
    pub(crate) async fn store(&self, identity: &Identity) -> Result<(), StateSecretError> {
        let json = identity::encode(identity)?;
        for _ in 0..WRITE_ATTEMPTS {
            let current = self.read().await?;
            if let Some(current) = &current
                && let Ok(Some(stored)) =
                    self.identity_in(current, &identity.relay, &identity.cluster)
                && stored.not_after > identity.not_after
            {
                tracing::info!(secret = %self.secret, "the Secret already holds a longer-lived identity; keeping it");
                return Ok(());
            }
            let mut secret = current.unwrap_or_else(|| KubeSecret {
                metadata: ObjectMeta {
                    name: Some(self.secret.name.clone()),
                    namespace: Some(self.secret.namespace.clone()),
                    ..ObjectMeta::default()
                },
                type_: Some("Opaque".to_owned()),
                ..KubeSecret::default()
            });
            if let Some(annotations) = secret.metadata.annotations.as_mut() {
                annotations.remove(CLAIM_HOLDER);
                annotations.remove(CLAIM_RENEWED);
            }
            secret
                .metadata
                .labels
                .get_or_insert_with(BTreeMap::new)
                .insert(MANAGED_BY.0.to_owned(), MANAGED_BY.1.to_owned());
            secret.string_data = None;
            secret.data = Some(BTreeMap::from([
                (identity::FILE_NAME.to_owned(), ByteString(json.clone())),
                (
                    identity::KEY_FILE_NAME.to_owned(),
                    ByteString(identity.key.expose().as_bytes().to_vec()),
                ),
            ]));
            let written = if secret.metadata.resource_version.is_some() {
                self.api
                    .replace(&self.secret.name, &PostParams::default(), &secret)
                    .await
            } else {
                self.api.create(&PostParams::default(), &secret).await
            };
            match written {
                Ok(_) => return Ok(()),
                Err(kube::Error::Api(status))
                    if status.is_conflict() || status.is_already_exists() =>
                {
                    tracing::debug!(secret = %self.secret, "the Secret changed meanwhile; reading it again");
                }
                Err(e) => return Err(self.api_error("write")(e)),
            }
        }
        Err(StateSecretError::Contended(self.secret.to_string()))
    }

    /// `secret` with this agent's claim, refreshed now.
    fn claimed(&self, mut secret: KubeSecret) -> KubeSecret {
        let now = OffsetDateTime::now_utc()
            .format(&Rfc3339)
            .unwrap_or_default();
        let annotations = secret
            .metadata
            .annotations
            .get_or_insert_with(BTreeMap::new);
        annotations.insert(CLAIM_HOLDER.to_owned(), self.holder.clone());
        annotations.insert(CLAIM_RENEWED.to_owned(), now);
        secret
    }

    fn holder_of<'a>(&self, secret: &'a KubeSecret) -> Option<&'a str> {
        secret
            .metadata
            .annotations
            .as_ref()
            .and_then(|a| a.get(CLAIM_HOLDER))
            .map(String::as_str)
    }

    /// Another agent's claim, refreshed within [`CLAIM_STALE`].
    fn claim_is_live(&self, secret: &KubeSecret) -> bool {
        let Some(holder) = self.holder_of(secret) else {
            return false;
        };
        if holder == self.holder {
            return false;
        }
        let renewed = secret
            .metadata
            .annotations
            .as_ref()
            .and_then(|a| a.get(CLAIM_RENEWED))
            .and_then(|t| OffsetDateTime::parse(t, &Rfc3339).ok());
        renewed.is_some_and(|t| OffsetDateTime::now_utc() - t < CLAIM_STALE)
    }
}

fn is_dns_label(s: &str) -> bool {
    let b = s.as_bytes();
    let alnum = |c: Option<&u8>| c.is_some_and(|c| c.is_ascii_lowercase() || c.is_ascii_digit());
    (1..=63).contains(&b.len())
        && b.iter()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || *c == b'-')
        && alnum(b.first())
        && alnum(b.last())
}

fn is_dns_subdomain(s: &str) -> bool {
    s.len() <= 253 && s.split('.').all(is_dns_label)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn secret_refs_parse() {
        assert_eq!(
            "tether-system/tether-agent-identity".parse::<SecretRef>(),
            Ok(SecretRef {
                namespace: "tether-system".into(),
                name: "tether-agent-identity".into()
            })
        );
        assert!("ns/tether.v1".parse::<SecretRef>().is_ok());
        for bad in [
            "", "name", "ns/", "/name", "NS/name", "ns/Name", "ns/a/b", "ns/a_b",
        ] {
            assert!(bad.parse::<SecretRef>().is_err(), "{bad:?}");
        }
    }
}
