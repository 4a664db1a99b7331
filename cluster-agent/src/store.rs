//! Where the identity is kept: the state directory ([`crate::identity`]'s files) or a Kubernetes Secret
//! ([`crate::state_secret`]).

use std::path::PathBuf;

use crate::identity::{self, Identity};
use crate::state_secret::SecretStore;

/// The identity's home.
pub(crate) enum IdentityStore {
    /// `identity.json` and `identity-key.pem` in this directory.
    Dir(PathBuf),
    /// A Secret, shared by replicas.
    Secret(Box<SecretStore>),
}

impl IdentityStore {
    /// Keeps a new or renewed identity.
    pub(crate) async fn store(&self, identity: &Identity) -> Result<(), String> {
        match self {
            IdentityStore::Dir(dir) => identity::store(dir, identity).map_err(|e| e.to_string()),
            IdentityStore::Secret(secret) => {
                secret.store(identity).await.map_err(|e| e.to_string())
            }
        }
    }

    /// Names the store in logs.
    pub(crate) fn describe(&self) -> String {
        match self {
            IdentityStore::Dir(dir) => format!("state dir {}", dir.display()),
            IdentityStore::Secret(secret) => format!("Secret {}", secret.name()),
        }
    }
}
