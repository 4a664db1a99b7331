//! Kubeconfig files that reach a cluster through the relay.

use std::io::Write;
use std::path::{Path, PathBuf};

use base64::Engine;
use serde::Serialize;

use crate::args::KubeconfigArgs;
use crate::config::ResolvedConfig;

/// Why a kubeconfig could not be written.
#[derive(Debug, thiserror::Error)]
pub enum KubeconfigError {
    /// Reading the token file or writing the kubeconfig failed.
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
    /// Serialization failed.
    #[error("cannot encode the kubeconfig: {0}")]
    Encode(String),
}

/// What goes into a kubeconfig for one cluster.
#[derive(Debug, Clone)]
pub struct KubeconfigSpec<'a> {
    /// Relay base URL.
    pub relay_url: &'a str,
    /// Cluster name at the relay (also the context name).
    pub cluster: &'a str,
    /// Relay CA (PEM), embedded; None trusts the system roots.
    pub ca_pem: Option<&'a [u8]>,
    /// Bearer token for the user, passed through to the cluster.
    pub token: Option<&'a str>,
}

#[derive(Serialize)]
#[serde(rename_all = "kebab-case")]
struct Kubeconfig<'a> {
    api_version: &'static str,
    kind: &'static str,
    clusters: Vec<Named<'a, ClusterEntry>>,
    users: Vec<Named<'a, UserEntry>>,
    contexts: Vec<Named<'a, ContextEntry<'a>>>,
    current_context: &'a str,
}

#[derive(Serialize)]
struct Named<'a, T> {
    name: &'a str,
    #[serde(flatten)]
    value: T,
}

#[derive(Serialize)]
struct ClusterEntry {
    cluster: ClusterFields,
}

#[derive(Serialize)]
#[serde(rename_all = "kebab-case")]
struct ClusterFields {
    server: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    certificate_authority_data: Option<String>,
}

#[derive(Serialize)]
struct UserEntry {
    user: UserFields,
}

#[derive(Serialize)]
struct UserFields {
    #[serde(skip_serializing_if = "Option::is_none")]
    token: Option<String>,
}

#[derive(Serialize)]
struct ContextEntry<'a> {
    context: ContextFields<'a>,
}

#[derive(Serialize)]
struct ContextFields<'a> {
    cluster: &'a str,
    user: &'a str,
}

/// Renders the kubeconfig YAML.
pub fn render(spec: &KubeconfigSpec<'_>) -> Result<String, KubeconfigError> {
    let user = format!("{}-user", spec.cluster);
    let config = Kubeconfig {
        api_version: "v1",
        kind: "Config",
        clusters: vec![Named {
            name: spec.cluster,
            value: ClusterEntry {
                cluster: ClusterFields {
                    server: format!(
                        "{}/clusters/{}",
                        spec.relay_url.trim_end_matches('/'),
                        spec.cluster
                    ),
                    certificate_authority_data: spec
                        .ca_pem
                        .map(|pem| base64::engine::general_purpose::STANDARD.encode(pem)),
                },
            },
        }],
        users: vec![Named {
            name: &user,
            value: UserEntry {
                user: UserFields {
                    token: spec.token.map(str::to_string),
                },
            },
        }],
        contexts: vec![Named {
            name: spec.cluster,
            value: ContextEntry {
                context: ContextFields {
                    cluster: spec.cluster,
                    user: &user,
                },
            },
        }],
        current_context: spec.cluster,
    };
    serde_yaml::to_string(&config).map_err(|e| KubeconfigError::Encode(e.to_string()))
}

/// Writes `text` to `path` with mode 0600 (it may hold a token).
pub fn write_private(path: &Path, text: &str) -> Result<(), KubeconfigError> {
    let io = |source| KubeconfigError::Io {
        path: path.to_path_buf(),
        source,
    };
    let mut options = std::fs::OpenOptions::new();
    options.write(true).create(true).truncate(true);
    #[cfg(unix)]
    {
        use std::os::unix::fs::OpenOptionsExt;
        options.mode(0o600);
    }
    let mut file = options.open(path).map_err(io)?;
    file.write_all(text.as_bytes()).map_err(io)?;
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600)).map_err(io)?;
    }
    Ok(())
}

/// `tether kubeconfig NAME`.
pub fn write_for_args(
    config: &ResolvedConfig,
    args: &KubeconfigArgs,
) -> Result<(), KubeconfigError> {
    let token = match (&args.token, &args.token_file) {
        (Some(token), _) => Some(token.trim().to_string()),
        (None, Some(path)) => Some(
            std::fs::read_to_string(path)
                .map_err(|source| KubeconfigError::Io {
                    path: path.clone(),
                    source,
                })?
                .trim()
                .to_string(),
        ),
        (None, None) => None,
    };
    let text = render(&KubeconfigSpec {
        relay_url: &config.relay_url,
        cluster: &args.name,
        ca_pem: config.ca_pem.as_deref(),
        token: token.as_deref(),
    })?;
    match &args.file {
        Some(path) => {
            write_private(path, &text)?;
            eprintln!("wrote {}", path.display());
        }
        None => print!("{text}"),
    }
    if token.is_none() {
        eprintln!(
            "note: the kubeconfig has no user credential. Tether passes your own credential through to the \
             cluster: add it with `kubectl config set-credentials {}-user --token=…` (or pass --token-file).",
            args.name
        );
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn renders_a_kubeconfig_kubectl_reads() -> anyhow::Result<()> {
        let text = render(&KubeconfigSpec {
            relay_url: "https://relay:8443/",
            cluster: "prod",
            ca_pem: Some(b"PEM"),
            token: Some("t0k"),
        })?;
        let value: serde_yaml::Value = serde_yaml::from_str(&text)?;
        assert_eq!(
            value["clusters"][0]["cluster"]["server"].as_str(),
            Some("https://relay:8443/clusters/prod")
        );
        assert_eq!(
            value["clusters"][0]["cluster"]["certificate-authority-data"].as_str(),
            Some("UEVN")
        );
        assert_eq!(value["users"][0]["user"]["token"].as_str(), Some("t0k"));
        assert_eq!(value["current-context"].as_str(), Some("prod"));
        assert_eq!(
            value["contexts"][0]["context"]["user"].as_str(),
            Some("prod-user")
        );
        Ok(())
    }
}
