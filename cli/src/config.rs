//! Where the relay is and how to authenticate: flags and env override the config file.
//!
//! The config file is JSON (`tether up` writes one as `DIR/config.json`):
//! `{"relay": "https://127.0.0.1:8443", "caFile": "relay/ca.pem", "adminTokenFile": "relay/admin-token"}`.
//! Relative paths are relative to the file's folder. Without `--config`/`TETHER_CONFIG`, `./tether-up/config.json`
//! is used when it exists, then `$XDG_CONFIG_HOME/tether/config.json` (or `~/.config/tether/config.json`).

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use tether_runtime::Secret;

use crate::args::GlobalArgs;

pub use crate::usage::ConfigError;

/// The config file's contents.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct ConfigFile {
    /// Relay URL.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub relay: Option<String>,
    /// PEM file with the relay's CA.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ca_file: Option<PathBuf>,
    /// File holding the admin token.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub admin_token_file: Option<PathBuf>,
}

impl ConfigFile {
    /// Reads a config file; relative paths inside are resolved against its folder.
    pub fn load(path: &Path) -> Result<Self, ConfigError> {
        let text = std::fs::read(path).map_err(|source| ConfigError::Read {
            path: path.to_path_buf(),
            source,
        })?;
        let mut file: ConfigFile =
            serde_json::from_slice(&text).map_err(|source| ConfigError::Parse {
                path: path.to_path_buf(),
                source,
            })?;
        let base = path.parent().unwrap_or_else(|| Path::new("."));
        for p in [&mut file.ca_file, &mut file.admin_token_file]
            .into_iter()
            .flatten()
        {
            if p.is_relative() {
                *p = base.join(&*p);
            }
        }
        Ok(file)
    }

    /// Writes the file as pretty JSON.
    pub fn save(&self, path: &Path) -> std::io::Result<()> {
        let text = serde_json::to_vec_pretty(self).map_err(std::io::Error::other)?;
        std::fs::write(path, text)
    }
}

/// The configuration after flags, env and file are merged.
#[derive(Debug, Clone)]
pub struct ResolvedConfig {
    /// Relay base URL without a trailing slash.
    pub relay_url: String,
    /// The relay CA file, when one is configured (else the system's web PKI roots are trusted).
    pub ca_file: Option<PathBuf>,
    /// Its PEM contents.
    pub ca_pem: Option<Vec<u8>>,
    /// The admin token, when configured.
    pub admin_token: Option<Secret>,
}

impl ResolvedConfig {
    /// Resolves a configuration that must include an admin token.
    pub fn resolve(args: &GlobalArgs) -> Result<Self, ConfigError> {
        let config = Self::resolve_without_admin(args)?;
        if config.admin_token.is_none() {
            return Err(ConfigError::NoAdminToken);
        }
        Ok(config)
    }

    /// Resolves a configuration where the admin token is optional.
    pub fn resolve_without_admin(args: &GlobalArgs) -> Result<Self, ConfigError> {
        let file = match config_path(args) {
            Some(path) => ConfigFile::load(&path)?,
            None => ConfigFile::default(),
        };
        let relay = args
            .relay
            .clone()
            .or(file.relay)
            .ok_or(ConfigError::NoRelay)?;
        let relay_url = normalize_relay_url(&relay)?;
        let ca_file = args.relay_ca.clone().or(file.ca_file);
        let ca_pem = match &ca_file {
            Some(path) => Some(std::fs::read(path).map_err(|source| ConfigError::Read {
                path: path.clone(),
                source,
            })?),
            None => None,
        };
        let admin_token = match args.admin_token_file.clone().or(file.admin_token_file) {
            Some(path) => {
                let text = std::fs::read_to_string(&path).map_err(|source| ConfigError::Read {
                    path: path.clone(),
                    source,
                })?;
                let token = text.trim();
                if token.is_empty() {
                    return Err(ConfigError::Invalid(format!(
                        "admin token file {} is empty",
                        path.display()
                    )));
                }
                Some(Secret::new(token))
            }
            None => None,
        };
        Ok(Self {
            relay_url,
            ca_file,
            ca_pem,
            admin_token,
        })
    }
}

fn config_path(args: &GlobalArgs) -> Option<PathBuf> {
    if let Some(path) = &args.config {
        return Some(path.clone());
    }
    let local = PathBuf::from("tether-up/config.json");
    if local.is_file() {
        return Some(local);
    }
    let home_config = std::env::var_os("XDG_CONFIG_HOME")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".config")))?
        .join("tether/config.json");
    home_config.is_file().then_some(home_config)
}

/// Checks a relay URL is `https://host[:port]` (a trailing slash is dropped; plain http is refused).
pub fn normalize_relay_url(url: &str) -> Result<String, ConfigError> {
    let trimmed = url.trim().trim_end_matches('/');
    let uri: http::Uri = trimmed
        .parse()
        .map_err(|e| ConfigError::Invalid(format!("relay URL {url:?}: {e}")))?;
    if uri.scheme_str() != Some("https") {
        return Err(ConfigError::Invalid(format!(
            "relay URL {url:?} must start with https://"
        )));
    }
    if uri.host().is_none() {
        return Err(ConfigError::Invalid(format!(
            "relay URL {url:?} has no host"
        )));
    }
    if uri.path() != "/" && !uri.path().is_empty() {
        return Err(ConfigError::Invalid(format!(
            "relay URL {url:?} must not have a path"
        )));
    }
    Ok(trimmed.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn relay_urls() {
        assert_eq!(
            normalize_relay_url("https://r.example:8443/")
                .ok()
                .as_deref(),
            Some("https://r.example:8443")
        );
        assert!(normalize_relay_url("http://r.example").is_err());
        assert!(normalize_relay_url("https://r.example/x").is_err());
        assert!(normalize_relay_url("not a url").is_err());
    }

    #[test]
    fn config_file_paths_are_relative_to_the_file() -> anyhow::Result<()> {
        let dir = tempfile::tempdir()?;
        std::fs::write(
            dir.path().join("config.json"),
            br#"{"relay":"https://x","caFile":"relay/ca.pem"}"#,
        )?;
        let file = ConfigFile::load(&dir.path().join("config.json"))?;
        assert_eq!(file.ca_file, Some(dir.path().join("relay/ca.pem")));
        assert_eq!(file.admin_token_file, None);
        Ok(())
    }

    #[test]
    fn flags_override_the_file() -> anyhow::Result<()> {
        let dir = tempfile::tempdir()?;
        let path = dir.path().join("config.json");
        std::fs::write(dir.path().join("token"), "s3cret\n")?;
        ConfigFile {
            relay: Some("https://a:1".into()),
            ca_file: None,
            admin_token_file: Some("token".into()),
        }
        .save(&path)?;
        let args = GlobalArgs {
            config: Some(path),
            relay: Some("https://b:2".into()),
            ..Default::default()
        };
        let resolved = ResolvedConfig::resolve(&args)?;
        assert_eq!(resolved.relay_url, "https://b:2");
        assert_eq!(
            resolved.admin_token.as_ref().map(|t| t.expose()),
            Some("s3cret")
        );
        assert_eq!(format!("{:?}", resolved.admin_token), "Some(***)");
        Ok(())
    }

    #[test]
    fn unreadable_config_file_is_a_clear_error() {
        let args = GlobalArgs {
            relay: Some("https://a".into()),
            config: Some("/nonexistent/x.json".into()),
            ..Default::default()
        };
        let err = ResolvedConfig::resolve(&args)
            .err()
            .map(|e| e.to_string())
            .unwrap_or_default();
        assert!(err.contains("cannot read /nonexistent/x.json"), "{err}");
    }
}
