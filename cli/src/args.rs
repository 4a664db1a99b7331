//! Command-line arguments.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use clap::{Args, Parser, Subcommand, ValueEnum};
use tether_runtime::parse_duration;

use crate::usage::ConfigError;

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
    /// Register, list, show, delete, export and import clusters.
    Cluster {
        /// What to do.
        #[command(subcommand)]
        command: ClusterCommand,
    },
    /// Write a kubeconfig that reaches a cluster through the relay.
    Kubeconfig(KubeconfigArgs),
    /// Decide who may do what in a cluster: role assignments, custom roles, deny assignments (enforced in the
    /// cluster by tether-guard).
    Role {
        /// What to do.
        #[command(subcommand)]
        command: RoleCommand,
    },
    /// DEVELOPMENT ONLY: mint an Entra-shaped token from the development issuer of `tether up`.
    #[command(
        long_about = "DEVELOPMENT ONLY: mint an Entra-shaped access token from the development issuer that \
                      `tether up` runs (its key is in DIR/dev-issuer). Real clusters take tokens from Entra ID \
                      (az account get-access-token, kubelogin); this command exists for the quickstart and tests."
    )]
    Token(TokenArgs),
    /// The relay's directory of group memberships, used for tokens whose groups overflow (group overage).
    Directory {
        /// What to do.
        #[command(subcommand)]
        command: DirectoryCommand,
    },
}

/// `tether role …`
#[derive(Debug, Subcommand)]
pub enum RoleCommand {
    /// Assign a role to a user or group (by object id) on a cluster, or on one namespace of it.
    Assign(AssignArgs),
    /// List role assignments.
    List(AssignmentListArgs),
    /// Delete a role assignment (it stops working in the cluster within seconds).
    Delete(IdArgs),
    /// Create a custom role from a JSON file (this form, `az role definition`'s, or ARM's):
    /// {"Name": "Pod Reader", "DataActions": ["Microsoft.Kubernetes/connectedClusters/pods/read"]}.
    Define(DefineArgs),
    /// List role definitions: the four built-ins (Viewer, Writer, Admin, Cluster Admin) and custom ones.
    Definitions(OutputArgs),
    /// Delete a custom role definition (refused while it is assigned).
    DeleteDefinition(IdArgs),
    /// Deny assignments: data actions refused to principals whatever their roles grant.
    Deny {
        /// What to do.
        #[command(subcommand)]
        command: DenyCommand,
    },
}

/// `tether role deny …`
#[derive(Debug, Subcommand)]
pub enum DenyCommand {
    /// Create a deny assignment.
    Add(DenyArgs),
    /// List deny assignments.
    List(AssignmentListArgs),
    /// Delete a deny assignment.
    Delete(IdArgs),
}

/// `tether role assign`
#[derive(Debug, Args)]
pub struct AssignArgs {
    /// The role: Viewer, Writer, Admin, Cluster Admin, or a custom role's id or name.
    #[arg(long)]
    pub role: String,
    /// The user's or group's object id (a token's `oid`, or a group id in its `groups`).
    #[arg(long)]
    pub principal: String,
    /// The cluster.
    #[arg(long)]
    pub cluster: String,
    /// Only this namespace (default: the whole cluster).
    #[arg(long)]
    pub namespace: Option<String>,
    /// Output format.
    #[arg(short, long, value_enum, default_value_t)]
    pub output: OutputFormat,
}

/// `tether role list`, `tether role deny list`
#[derive(Debug, Args)]
pub struct AssignmentListArgs {
    /// Only this cluster's.
    #[arg(long)]
    pub cluster: Option<String>,
    /// Output format.
    #[arg(short, long, value_enum, default_value_t)]
    pub output: OutputFormat,
}

/// Commands that take one id.
#[derive(Debug, Args)]
pub struct IdArgs {
    /// The id.
    pub id: String,
}

/// Commands that only print.
#[derive(Debug, Args)]
pub struct OutputArgs {
    /// Output format.
    #[arg(short, long, value_enum, default_value_t)]
    pub output: OutputFormat,
}

/// `tether role define`
#[derive(Debug, Args)]
pub struct DefineArgs {
    /// The role definition (JSON; `-` reads stdin).
    #[arg(short = 'f', long)]
    pub file: PathBuf,
    /// Output format.
    #[arg(short, long, value_enum, default_value_t)]
    pub output: OutputFormat,
}

/// `tether role deny add`
#[derive(Debug, Args)]
pub struct DenyArgs {
    /// A name saying why (shown in the Forbidden message).
    #[arg(long)]
    pub name: String,
    /// A data action to deny (wildcards allowed), e.g. Microsoft.Kubernetes/connectedClusters/secrets/*;
    /// repeatable.
    #[arg(long = "action", required = true)]
    pub actions: Vec<String>,
    /// A data action carved out of the denied ones; repeatable.
    #[arg(long = "not-action")]
    pub not_actions: Vec<String>,
    /// Who is denied: object ids, or 00000000-0000-0000-0000-000000000000 for everyone; repeatable.
    #[arg(long = "principal", required = true)]
    pub principals: Vec<String>,
    /// Who is exempt (object ids); repeatable.
    #[arg(long = "exclude")]
    pub exclude: Vec<String>,
    /// The cluster.
    #[arg(long)]
    pub cluster: String,
    /// Only this namespace (default: the whole cluster).
    #[arg(long)]
    pub namespace: Option<String>,
    /// Output format.
    #[arg(short, long, value_enum, default_value_t)]
    pub output: OutputFormat,
}

/// `tether directory …`
#[derive(Debug, Subcommand)]
pub enum DirectoryCommand {
    /// Set a user's groups (object ids), replacing what was there.
    SetGroups {
        /// The user's object id.
        oid: String,
        /// The group ids.
        #[arg(required = true)]
        groups: Vec<String>,
    },
    /// Show a user's groups.
    Show {
        /// The user's object id.
        oid: String,
    },
    /// Remove a user from the directory.
    Delete {
        /// The user's object id.
        oid: String,
    },
}

/// How `tether token` prints.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, ValueEnum)]
pub enum TokenFormat {
    /// Only the token, for `$(tether token …)`.
    #[default]
    Token,
    /// The token with its identity (oid, tenant, groups, expiry) as JSON.
    Json,
}

/// `tether token`
#[derive(Debug, Args)]
pub struct TokenArgs {
    /// The user name (upn / preferred_username), e.g. alice@contoso.com.
    #[arg(long)]
    pub user: String,
    /// A group id for the groups claim; repeatable.
    #[arg(long = "group")]
    pub groups: Vec<String>,
    /// The object id (default: a stable id derived from the user name).
    #[arg(long)]
    pub oid: Option<String>,
    /// The audience (default: the one `tether up` configured).
    #[arg(long)]
    pub audience: Option<String>,
    /// How long the token is valid (at most 24h).
    #[arg(long, default_value = "1h", value_parser = parse_duration)]
    pub lifetime: Duration,
    /// The `tether up` directory (default: the folder of --config, else ./tether-up).
    #[arg(long)]
    pub dir: Option<PathBuf>,
    /// Output format.
    #[arg(short, long, value_enum, default_value_t)]
    pub output: TokenFormat,
}

/// `tether cluster …`
#[derive(Debug, Subcommand)]
pub enum ClusterCommand {
    /// Register a cluster and print the agent command (with its one-time onboarding token).
    Connect(ConnectArgs),
    /// List clusters.
    List(ListArgs),
    /// Show one cluster: status, Kubernetes metadata, agent health, identity expiry.
    Show(NameArgs),
    /// Delete a cluster: revokes its identity and closes its tunnel.
    Delete(NameArgs),
    /// Print a cluster's registration and configuration (name, tags, role assignments) as JSON, for
    /// `tether cluster import` at another relay.
    Export(ExportArgs),
    /// Register a cluster at this relay from a file written by `tether cluster export`, and print the agent
    /// command (the agent onboards again here with a new token).
    Import(ImportArgs),
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
    /// Outbound proxy the agent reaches the relay through, http://[USER:PASSWORD@]HOST:PORT (as Azure Arc's
    /// `--proxy-https`); a URL with credentials goes to a 0600 file, not onto the printed line.
    #[arg(long, value_name = "URL")]
    pub proxy_https: Option<String>,
    /// Hosts that bypass the proxy, comma-separated (as Azure Arc's `--proxy-skip-range`).
    #[arg(long, value_name = "LIST")]
    pub proxy_skip_range: Option<String>,
    /// PEM CA of a TLS-inspecting proxy (as Azure Arc's `--proxy-cert`).
    #[arg(long, value_name = "FILE")]
    pub proxy_cert: Option<PathBuf>,
    /// Entra tenant whose tokens the cluster validates; repeatable.
    #[arg(long = "entra-tenant", value_name = "ID")]
    pub entra_tenants: Vec<String>,
    /// Entra audience the cluster accepts; repeatable.
    #[arg(long = "entra-audience", value_name = "AUDIENCE")]
    pub entra_audiences: Vec<String>,
    /// The agent chart in the printed `helm upgrade --install` line (a path or a chart reference).
    #[arg(
        long,
        value_name = "CHART",
        default_value = "deploy/charts/tether-agent"
    )]
    pub chart: String,
    /// The namespace in the printed helm line.
    #[arg(long, value_name = "NAMESPACE", default_value = "tether-system")]
    pub namespace: String,
    /// Where the relay CA, the onboarding token and a proxy URL with credentials are written (mode 0600) for
    /// the helm line's `--set-file`.
    #[arg(long, value_name = "DIR", default_value = ".")]
    pub files_dir: PathBuf,
}

impl ConnectArgs {
    /// The tags as a map; a tag without `=` or with an empty key is a usage error.
    pub fn parsed_tags(&self) -> Result<BTreeMap<String, String>, ConfigError> {
        let mut tags = BTreeMap::new();
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

/// A cluster's connectivity status, as the relay computes it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
#[value(rename_all = "PascalCase")]
pub enum ConnectivityStatus {
    /// Registered, its agent never connected.
    Connecting,
    /// Heard from within the relay's offline threshold.
    Connected,
    /// Connected, with fewer live tunnels than its agent keeps (still reachable).
    Degraded,
    /// Not heard from for the offline threshold.
    Offline,
    /// Its identity expired: delete the cluster and connect it again.
    Expired,
}

impl ConnectivityStatus {
    /// The name the API uses.
    pub fn as_str(self) -> &'static str {
        match self {
            ConnectivityStatus::Connecting => "Connecting",
            ConnectivityStatus::Connected => "Connected",
            ConnectivityStatus::Degraded => "Degraded",
            ConnectivityStatus::Offline => "Offline",
            ConnectivityStatus::Expired => "Expired",
        }
    }
}

/// `tether cluster list`
#[derive(Debug, Args)]
pub struct ListArgs {
    /// Only clusters in this status; repeatable (any of them).
    #[arg(long = "status", value_enum, ignore_case = true, value_name = "STATUS")]
    pub statuses: Vec<ConnectivityStatus>,
    /// Only clusters with this tag (KEY=VALUE, or KEY for any value); repeatable (all of them).
    #[arg(long = "tag", value_name = "KEY=VALUE")]
    pub tags: Vec<String>,
    /// Output format.
    #[arg(short, long, value_enum, default_value_t)]
    pub output: OutputFormat,
}

impl ListArgs {
    /// The tag filters, checked: a filter with an empty key is a usage error.
    pub fn tag_filters(&self) -> Result<Vec<String>, ConfigError> {
        for tag in &self.tags {
            let key = tag.split_once('=').map_or(tag.as_str(), |(k, _)| k);
            if key.is_empty() {
                return Err(ConfigError::Invalid(format!(
                    "tag filter {tag:?} is not KEY=VALUE or KEY"
                )));
            }
        }
        Ok(self.tags.clone())
    }
}

/// `tether cluster export`
#[derive(Debug, Args)]
pub struct ExportArgs {
    /// Cluster name.
    pub name: String,
}

/// `tether cluster import`
#[derive(Debug, Args)]
pub struct ImportArgs {
    /// The file written by `tether cluster export` (`-` reads stdin).
    pub file: PathBuf,
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
    /// How often the agent sends heartbeats (e.g. 30s; default: the relay's, 30s).
    #[arg(long, value_name = "DURATION", value_parser = parse_duration)]
    pub heartbeat_interval: Option<Duration>,
    /// How long without a heartbeat before the cluster shows Offline (e.g. 1m; default: the relay's, 15m).
    #[arg(long, value_name = "DURATION", value_parser = parse_duration)]
    pub offline_threshold: Option<Duration>,
    /// Validity of the identity issued to the agent, renewed at about 2/3 (e.g. 2m to watch renewals;
    /// default: the relay's, 90d).
    #[arg(long, value_name = "DURATION", value_parser = parse_duration)]
    pub identity_validity: Option<Duration>,
    /// The newest agent version the relay offers (older agents show "upgrade available"; default: this
    /// version).
    #[arg(long, value_name = "VERSION")]
    pub latest_agent_version: Option<String>,
    /// Do not wire in guard and the development token issuer (kubectl tokens then only pass through).
    #[arg(long)]
    pub no_guard: bool,
    /// Run a relay fleet instead of one relay: this many `tether-relay` processes (2 to 9) on one local
    /// PostgreSQL, behind HAProxy listening on --listen. Needs tether-relay and tether-agent beside tether, and
    /// the Debian packages postgresql and haproxy.
    #[arg(long, default_value_t = 1, value_name = "N")]
    pub replicas: usize,
    /// With --replicas: how many tunnels the agent keeps, each to a distinct replica.
    #[arg(long, default_value_t = 2, value_name = "K")]
    pub tunnels: u32,
    /// With --replicas: how long a replica stopping (SIGTERM) lets watches, `logs -f` and exec sessions run.
    #[arg(long, default_value = "30s", value_name = "DURATION", value_parser = parse_duration)]
    pub drain_timeout: Duration,
}

#[cfg(test)]
mod tests {
    use clap::Parser as _;

    use super::*;

    #[test]
    fn list_filters_parse() -> anyhow::Result<()> {
        let cli = Cli::try_parse_from([
            "tether",
            "cluster",
            "list",
            "--status",
            "offline",
            "--status",
            "Connected",
            "--tag",
            "env=prod",
            "--tag",
            "team",
        ])?;
        let Command::Cluster {
            command: ClusterCommand::List(args),
        } = cli.command
        else {
            anyhow::bail!("not a list command");
        };
        assert_eq!(
            args.statuses,
            [ConnectivityStatus::Offline, ConnectivityStatus::Connected]
        );
        assert_eq!(args.tag_filters()?, ["env=prod", "team"]);
        assert!(Cli::try_parse_from(["tether", "cluster", "list", "--status", "up"]).is_err());
        let bad = ListArgs {
            statuses: vec![],
            tags: vec!["=x".into()],
            output: OutputFormat::Table,
        };
        assert!(bad.tag_filters().is_err());
        Ok(())
    }

    #[test]
    fn up_takes_short_lifecycle_settings() -> anyhow::Result<()> {
        let cli = Cli::try_parse_from([
            "tether",
            "up",
            "--heartbeat-interval",
            "1s",
            "--offline-threshold",
            "5s",
            "--identity-validity",
            "2m",
        ])?;
        let Command::Up(args) = cli.command else {
            anyhow::bail!("not up");
        };
        assert_eq!(args.heartbeat_interval, Some(Duration::from_secs(1)));
        assert_eq!(args.offline_threshold, Some(Duration::from_secs(5)));
        assert_eq!(args.identity_validity, Some(Duration::from_secs(120)));
        assert_eq!(args.latest_agent_version, None);
        Ok(())
    }

    #[test]
    fn role_and_token_commands_parse() -> anyhow::Result<()> {
        let cli = Cli::try_parse_from([
            "tether",
            "role",
            "assign",
            "--role",
            "Cluster Admin",
            "--principal",
            "5405cf57-9db4-433d-b03e-cedc85623c05",
            "--cluster",
            "demo",
            "--namespace",
            "dev",
        ])?;
        let Command::Role {
            command: RoleCommand::Assign(args),
        } = cli.command
        else {
            anyhow::bail!("not role assign");
        };
        assert_eq!(args.role, "Cluster Admin");
        assert_eq!(args.namespace.as_deref(), Some("dev"));
        let cli = Cli::try_parse_from([
            "tether",
            "role",
            "deny",
            "add",
            "--name",
            "n",
            "--action",
            "a1",
            "--action",
            "a2",
            "--principal",
            "p",
            "--cluster",
            "c",
        ])?;
        let Command::Role {
            command:
                RoleCommand::Deny {
                    command: DenyCommand::Add(args),
                },
        } = cli.command
        else {
            anyhow::bail!("not role deny add");
        };
        assert_eq!(args.actions, ["a1", "a2"]);
        // A deny assignment without actions or principals is a usage error.
        assert!(
            Cli::try_parse_from([
                "tether",
                "role",
                "deny",
                "add",
                "--name",
                "n",
                "--cluster",
                "c"
            ])
            .is_err()
        );
        let cli = Cli::try_parse_from([
            "tether", "token", "--user", "alice", "--group", "g1", "--group", "g2", "-o", "json",
        ])?;
        let Command::Token(args) = cli.command else {
            anyhow::bail!("not token");
        };
        assert_eq!(args.groups, ["g1", "g2"]);
        assert_eq!(args.lifetime, Duration::from_secs(3600));
        assert_eq!(args.output, TokenFormat::Json);
        assert!(Cli::try_parse_from(["tether", "token"]).is_err());
        Ok(())
    }
}
