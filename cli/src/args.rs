//! Command-line arguments.

use std::net::SocketAddr;
use std::path::PathBuf;

use clap::{Args, Parser, Subcommand, ValueEnum};

use crate::config::ConfigError;

/// Tether: reach Kubernetes clusters that accept no inbound connection.
#[derive(Debug, Parser)]
#[command(name = "tether", version, about, long_about = None)]
pub struct Cli {
    /// Options shared by every command.
    #[command(flatten)]
    pub global: GlobalArgs,
    /// More logging.
    #[arg(short, long, global = true)]
    pub verbose: bool,
    /// The command.
    #[command(subcommand)]
    pub command: Command,
}

/// Where the relay is and how to authenticate to it.
#[derive(Debug, Clone, Default, Args)]
pub struct GlobalArgs {
    /// Config file written by `tether up` (or by hand): relay URL, CA file, admin token file.
    #[arg(long, env = "TETHER_CONFIG", global = true)]
    pub config: Option<PathBuf>,
    /// Relay URL, e.g. https://relay.example.com (overrides the config file).
    #[arg(long, env = "TETHER_RELAY", global = true)]
    pub relay: Option<String>,
    /// PEM file with the CA that signed the relay's certificate (overrides the config file).
    #[arg(long, env = "TETHER_RELAY_CA", global = true)]
    pub relay_ca: Option<PathBuf>,
    /// File holding the relay's admin token (overrides the config file).
    #[arg(long, env = "TETHER_ADMIN_TOKEN_FILE", global = true)]
    pub admin_token_file: Option<PathBuf>,
}

/// The subcommands.
#[derive(Debug, Subcommand)]
pub enum Command {
    /// Quickstart: run a relay, a sample (or your) cluster and its agent here, and write a kubeconfig.
    Up(UpArgs),
    /// Register, list, show and delete clusters.
    Cluster {
        /// What to do.
        #[command(subcommand)]
        command: ClusterCommand,
    },
    /// Write a kubeconfig that reaches a cluster through the relay.
    Kubeconfig(KubeconfigArgs),
}

/// `tether cluster …`
#[derive(Debug, Subcommand)]
pub enum ClusterCommand {
    /// Register a cluster and print the agent command (with its one-time onboarding token).
    Connect(ConnectArgs),
    /// List clusters.
    List(ListArgs),
    /// Show one cluster.
    Show(NameArgs),
    /// Delete a cluster: revokes its agent's credential and closes its tunnel.
    Delete(NameArgs),
}

/// Output formats.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, ValueEnum)]
pub enum OutputFormat {
    /// A table for people.
    #[default]
    Table,
    /// JSON for scripts.
    Json,
}

/// `tether cluster connect`
#[derive(Debug, Args)]
pub struct ConnectArgs {
    /// Cluster name (DNS label: lowercase letters, digits, '-', at most 63 characters).
    pub name: String,
    /// Tag as KEY=VALUE; repeatable.
    #[arg(long = "tag", value_name = "KEY=VALUE")]
    pub tags: Vec<String>,
    /// Output format.
    #[arg(short, long, value_enum, default_value_t)]
    pub output: OutputFormat,
}

impl ConnectArgs {
    /// The tags as a map; a tag without `=` or with an empty key is a usage error.
    pub fn parsed_tags(&self) -> Result<std::collections::BTreeMap<String, String>, ConfigError> {
        let mut tags = std::collections::BTreeMap::new();
        for tag in &self.tags {
            match tag.split_once('=') {
                Some((key, value)) if !key.is_empty() => {
                    tags.insert(key.to_string(), value.to_string());
                }
                _ => {
                    return Err(ConfigError::Invalid(format!(
                        "tag {tag:?} is not KEY=VALUE"
                    )));
                }
            }
        }
        Ok(tags)
    }
}

/// `tether cluster list`
#[derive(Debug, Args)]
pub struct ListArgs {
    /// Output format.
    #[arg(short, long, value_enum, default_value_t)]
    pub output: OutputFormat,
}

/// Commands that take one cluster name.
#[derive(Debug, Args)]
pub struct NameArgs {
    /// Cluster name.
    pub name: String,
    /// Output format.
    #[arg(short, long, value_enum, default_value_t)]
    pub output: OutputFormat,
}

/// `tether kubeconfig`
#[derive(Debug, Args)]
pub struct KubeconfigArgs {
    /// Cluster name.
    pub name: String,
    /// Write to this file (mode 0600) instead of stdout.
    #[arg(short = 'f', long)]
    pub file: Option<PathBuf>,
    /// Bearer token to put in the kubeconfig's user (passed through to the cluster's apiserver).
    #[arg(
        long,
        env = "TETHER_USER_TOKEN",
        hide_env_values = true,
        conflicts_with = "token_file"
    )]
    pub token: Option<String>,
    /// File holding the bearer token to put in the kubeconfig's user.
    #[arg(long)]
    pub token_file: Option<PathBuf>,
}

/// `tether up`
#[derive(Debug, Clone, Args)]
pub struct UpArgs {
    /// Directory for everything the quickstart writes (relay data, agent state, kubeconfig, config).
    #[arg(long, default_value = "./tether-up")]
    pub dir: PathBuf,
    /// Connect this cluster (its kubeconfig) instead of starting the sample apiserver.
    #[arg(long)]
    pub kubeconfig: Option<PathBuf>,
    /// Name of the cluster at the relay.
    #[arg(long, default_value = "demo")]
    pub cluster: String,
    /// Address the relay listens on.
    #[arg(long, default_value = "127.0.0.1:8443")]
    pub listen: SocketAddr,
}
