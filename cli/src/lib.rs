//! The `tether` command: manage clusters at a relay, write kubeconfigs for users, and run the quickstart.
//!
//! Every subcommand is a thin client of the relay's admin REST API (`docs/API.md`), except `tether up`, which runs
//! a relay, a cluster agent and (unless a real cluster is given) the testkit's sample apiserver in one process.
//! The [`up`] module is also the harness the end-to-end tests use, so the quickstart and the tests exercise the
//! same wiring; `fleet` (`tether up --replicas N`: relay processes on PostgreSQL behind HAProxy) is the harness
//! of the relay-fleet tests and of `tether-loadtest failover`.
//!
//! It does not talk to clusters itself: kubectl does, through the relay.

pub mod args;
pub mod client;
pub mod config;
#[cfg(feature = "quickstart")]
pub mod fleet;
mod helm;
pub mod kubeconfig;
mod output;
pub mod up;
mod usage;

use std::error::Error as _;

pub use args::Cli;

#[cfg(feature = "quickstart")]
use args::TokenFormat;
use args::{
    ClusterCommand, Command, DenyCommand, DirectoryCommand, OutputFormat, RoleCommand, TokenArgs,
};
use client::{ClientError, RelayClient};
use config::{ConfigError, ResolvedConfig};

/// Everything that can make a `tether` command fail.
#[derive(Debug, thiserror::Error)]
pub enum CliError {
    /// The CLI configuration (flags, env, config file) is unusable.
    #[error(transparent)]
    Config(#[from] ConfigError),
    /// The relay could not be reached or refused the request.
    #[error(transparent)]
    Client(#[from] ClientError),
    /// The quickstart failed.
    #[error(transparent)]
    Up(#[from] up::UpError),
    /// Writing the kubeconfig failed.
    #[error(transparent)]
    Kubeconfig(#[from] kubeconfig::KubeconfigError),
    /// Writing to stdout failed.
    #[error("cannot write output: {0}")]
    Output(#[source] std::io::Error),
}

impl CliError {
    /// The process exit status: 64 for bad usage or configuration (sysexits EX_USAGE), 1 otherwise.
    pub fn exit_code(&self) -> u8 {
        match self {
            CliError::Config(_) => 64,
            CliError::Up(e) if e.is_config() => 64,
            _ => 1,
        }
    }

    /// The message with its causes, each said once.
    pub fn chain_message(&self) -> String {
        let mut message = self.to_string();
        let mut source = self.source();
        while let Some(cause) = source {
            let text = cause.to_string();
            if !message.contains(&text) {
                message.push_str(": ");
                message.push_str(&text);
            }
            source = cause.source();
        }
        message
    }
}

/// Sets up logging to stderr: `RUST_LOG` if set, else info (debug with `-v`).
pub fn init_tracing(verbose: bool) {
    let default = if verbose {
        "info,tether=debug"
    } else {
        "warn,tether_cli=info"
    };
    tether_runtime::process::init_tracing_with_default(
        tether_runtime::process::LogFormat::Text,
        default,
    );
}

/// Runs one `tether` command.
pub async fn run(cli: Cli) -> Result<(), CliError> {
    tether_runtime::tls::install_crypto_provider();
    match cli.command {
        Command::Up(args) if args.replicas > 1 => up_fleet(args).await,
        Command::Up(args) => up::run_foreground(args).await.map_err(CliError::from),
        Command::Cluster { command } => {
            let config = ResolvedConfig::resolve(&cli.global)?;
            let client = RelayClient::new(&config)?;
            cluster_command(&client, &config, command).await
        }
        Command::Kubeconfig(args) => {
            let config = ResolvedConfig::resolve_without_admin(&cli.global)?;
            // Make sure the cluster exists when we can check; a kubeconfig for a typo helps nobody.
            if config.admin_token.is_some() {
                let client = RelayClient::new(&config)?;
                client.show_cluster(&args.name).await?;
            }
            kubeconfig::write_for_args(&config, &args)?;
            Ok(())
        }
        Command::Role { command } => {
            let config = ResolvedConfig::resolve(&cli.global)?;
            let client = RelayClient::new(&config)?;
            role_command(&client, command).await
        }
        Command::Directory { command } => {
            let config = ResolvedConfig::resolve(&cli.global)?;
            let client = RelayClient::new(&config)?;
            directory_command(&client, command).await
        }
        Command::Token(args) => token_command(&cli.global, &args),
    }
}

/// `tether up --replicas N`: the local relay fleet.
#[cfg(feature = "quickstart")]
async fn up_fleet(args: args::UpArgs) -> Result<(), CliError> {
    fleet::run_foreground(args).await.map_err(CliError::from)
}

#[cfg(not(feature = "quickstart"))]
async fn up_fleet(_args: args::UpArgs) -> Result<(), CliError> {
    Err(ConfigError::Invalid(format!(
        "--replicas: {} (the local fleet runs PostgreSQL and HAProxy through the test kit)",
        up::WITHOUT_QUICKSTART
    ))
    .into())
}

/// The longest lifetime `tether token` gives a development token.
#[cfg(feature = "quickstart")]
const MAX_DEV_TOKEN_LIFETIME: std::time::Duration = std::time::Duration::from_secs(24 * 3600);

#[cfg(not(feature = "quickstart"))]
fn token_command(_global: &args::GlobalArgs, _args: &TokenArgs) -> Result<(), CliError> {
    Err(ConfigError::Invalid(
        "built without the quickstart feature: `tether token` mints tokens of the development issuer, which this \
         build leaves out; use tokens from Entra ID (and tether up --kubeconfig for a real cluster)"
            .into(),
    )
    .into())
}

#[cfg(feature = "quickstart")]
fn token_command(global: &args::GlobalArgs, args: &TokenArgs) -> Result<(), CliError> {
    if args.lifetime.is_zero() || args.lifetime > MAX_DEV_TOKEN_LIFETIME {
        return Err(ConfigError::Invalid("--lifetime must be between 1s and 24h".into()).into());
    }
    let dir = match (&args.dir, &global.config) {
        (Some(dir), _) => dir.clone(),
        (None, Some(config)) => config
            .parent()
            .map(std::path::Path::to_path_buf)
            .unwrap_or_default(),
        (None, None) => std::path::PathBuf::from("./tether-up"),
    };
    let issuer_dir = dir.join(up::DEV_ISSUER_DIR);
    if !issuer_dir.join("issuer.json").is_file() {
        return Err(ConfigError::Invalid(format!(
            "no development issuer in {}: run `tether up` first (or pass --dir with its directory)",
            issuer_dir.display()
        ))
        .into());
    }
    let request = tether_testkit::dev_issuer::TokenRequest {
        user: args.user.clone(),
        groups: args.groups.clone(),
        oid: args.oid.clone(),
        audience: args.audience.clone(),
        lifetime: args.lifetime,
    };
    let minted = tether_testkit::dev_issuer::mint_from_dir(&issuer_dir, &request)
        .map_err(|e| ConfigError::Invalid(e.to_string()))?;
    eprintln!(
        "DEVELOPMENT ONLY: token for {} (oid {}, tenant {}) from the development issuer of `tether up`, valid {}. \
         Real clusters use tokens from Entra ID.",
        minted.user,
        minted.oid,
        minted.tenant,
        output::human_duration(args.lifetime.as_secs()),
    );
    let mut out = std::io::stdout().lock();
    match args.output {
        TokenFormat::Token => output::line(&mut out, &minted.token),
        TokenFormat::Json => output::json(
            &mut out,
            &serde_json::json!({
                "developmentOnly": true,
                "token": minted.token,
                "user": minted.user,
                "oid": minted.oid,
                "tenant": minted.tenant,
                "groups": minted.groups,
                "expiresAt": minted.expires_at,
            }),
        ),
    }
    .map_err(CliError::Output)
}

async fn role_command(client: &RelayClient, command: RoleCommand) -> Result<(), CliError> {
    let mut out = std::io::stdout().lock();
    match command {
        RoleCommand::Assign(args) => {
            let created = client
                .assign_role(
                    &args.role,
                    &args.principal,
                    &args.cluster,
                    args.namespace.as_deref(),
                )
                .await?;
            match args.output {
                OutputFormat::Json => output::json(&mut out, &created),
                OutputFormat::Table => output::assigned(&mut out, &created),
            }
        }
        RoleCommand::List(args) => {
            let items = client.role_assignments(args.cluster.as_deref()).await?;
            match args.output {
                OutputFormat::Json => {
                    output::json(&mut out, &serde_json::json!({ "items": items }))
                }
                OutputFormat::Table => output::assignment_table(&mut out, &items),
            }
        }
        RoleCommand::Delete(args) => {
            client.delete_role_assignment(&args.id).await?;
            output::line(&mut out, &format!("role assignment {} deleted", args.id))
        }
        RoleCommand::Define(args) => {
            let definition = read_json_object(&args.file, "a role definition")?;
            let created = client.define_role(&definition).await?;
            match args.output {
                OutputFormat::Json => output::json(&mut out, &created),
                OutputFormat::Table => output::line(
                    &mut out,
                    &format!("role \"{}\" defined (id {})", created.name, created.id),
                ),
            }
        }
        RoleCommand::Definitions(args) => {
            let items = client.role_definitions().await?;
            match args.output {
                OutputFormat::Json => {
                    output::json(&mut out, &serde_json::json!({ "items": items }))
                }
                OutputFormat::Table => output::role_table(&mut out, &items),
            }
        }
        RoleCommand::DeleteDefinition(args) => {
            client.delete_role_definition(&args.id).await?;
            output::line(&mut out, &format!("role definition {} deleted", args.id))
        }
        RoleCommand::Deny { command } => match command {
            DenyCommand::Add(args) => {
                let body = tether_api::admin::NewDenyAssignment {
                    cluster: args.cluster.clone(),
                    data_actions: args.actions.clone(),
                    exclude_principals: args.exclude.clone(),
                    name: args.name.clone(),
                    namespace: args.namespace.clone(),
                    not_data_actions: args.not_actions.clone(),
                    principals: args.principals.clone(),
                };
                let created = client.create_deny_assignment(&body).await?;
                match args.output {
                    OutputFormat::Json => output::json(&mut out, &created),
                    OutputFormat::Table => output::line(
                        &mut out,
                        &format!(
                            "deny assignment \"{}\" created (id {})",
                            args.name, created.id
                        ),
                    ),
                }
            }
            DenyCommand::List(args) => {
                let items = client.deny_assignments(args.cluster.as_deref()).await?;
                match args.output {
                    OutputFormat::Json => {
                        output::json(&mut out, &serde_json::json!({ "items": items }))
                    }
                    OutputFormat::Table => output::deny_table(&mut out, &items),
                }
            }
            DenyCommand::Delete(args) => {
                client.delete_deny_assignment(&args.id).await?;
                output::line(&mut out, &format!("deny assignment {} deleted", args.id))
            }
        },
    }
    .map_err(CliError::Output)
}

async fn directory_command(
    client: &RelayClient,
    command: DirectoryCommand,
) -> Result<(), CliError> {
    let mut out = std::io::stdout().lock();
    match command {
        DirectoryCommand::SetGroups { oid, groups } => {
            let entry = client.set_groups(&oid, &groups).await?;
            output::json(&mut out, &entry)
        }
        DirectoryCommand::Show { oid } => {
            let entry = client.directory_entry(&oid).await?;
            output::json(&mut out, &entry)
        }
        DirectoryCommand::Delete { oid } => {
            client.delete_directory_entry(&oid).await?;
            output::line(&mut out, &format!("{oid} removed from the directory"))
        }
    }
    .map_err(CliError::Output)
}

/// Reads a JSON object from a file (`-` is stdin).
fn read_json_object(path: &std::path::Path, what: &str) -> Result<serde_json::Value, ConfigError> {
    use std::io::Read as _;
    let mut text = Vec::new();
    let name = if path.as_os_str() == "-" {
        std::io::stdin()
            .read_to_end(&mut text)
            .map_err(|source| ConfigError::Read {
                path: path.to_path_buf(),
                source,
            })?;
        "stdin".to_string()
    } else {
        text = std::fs::read(path).map_err(|source| ConfigError::Read {
            path: path.to_path_buf(),
            source,
        })?;
        path.display().to_string()
    };
    match serde_json::from_slice::<serde_json::Value>(&text) {
        Ok(value @ serde_json::Value::Object(_)) => Ok(value),
        Ok(_) => Err(ConfigError::Invalid(format!(
            "{name} is not {what}: expected a JSON object"
        ))),
        Err(e) => Err(ConfigError::Invalid(format!(
            "{name} is not {what} (JSON): {e}"
        ))),
    }
}

async fn cluster_command(
    client: &RelayClient,
    config: &ResolvedConfig,
    command: ClusterCommand,
) -> Result<(), CliError> {
    let mut out = std::io::stdout().lock();
    match command {
        ClusterCommand::Connect(args) => {
            let tags = args.parsed_tags()?;
            let helm = helm::HelmPlan::new(&args)?;
            let created = client.create_cluster(&args.name, &tags).await?;
            match args.output {
                OutputFormat::Json => output::json(&mut out, &created.raw),
                OutputFormat::Table => {
                    output::connect_instructions(&mut out, config, &created, &helm)
                }
            }
        }
        ClusterCommand::List(args) => {
            let tags = args.tag_filters()?;
            let statuses: Vec<&str> = args.statuses.iter().map(|s| s.as_str()).collect();
            let filtered = !statuses.is_empty() || !tags.is_empty();
            let clusters = client.list_clusters_matching(&statuses, &tags).await?;
            match args.output {
                OutputFormat::Json => {
                    output::json(&mut out, &serde_json::json!({ "items": clusters }))
                }
                OutputFormat::Table => output::cluster_table(
                    &mut out,
                    &clusters,
                    filtered,
                    time::OffsetDateTime::now_utc(),
                ),
            }
        }
        ClusterCommand::Show(args) => {
            let cluster = client.show_cluster(&args.name).await?;
            match args.output {
                OutputFormat::Json => output::json(&mut out, &cluster),
                OutputFormat::Table => {
                    output::cluster_details(&mut out, &cluster, time::OffsetDateTime::now_utc())
                }
            }
        }
        ClusterCommand::Export(args) => {
            let document = client.export_cluster(&args.name).await?;
            output::json(&mut out, &document)
        }
        ClusterCommand::Import(args) => {
            let document = read_export(&args.file)?;
            let created = client.import_cluster(&document).await?;
            match args.output {
                OutputFormat::Json => output::json(&mut out, &created.raw),
                OutputFormat::Table => output::import_instructions(&mut out, config, &created),
            }
        }
        ClusterCommand::Delete(args) => {
            client.delete_cluster(&args.name).await?;
            output::line(
                &mut out,
                &format!(
                    "cluster \"{}\" deleted: its identity is revoked and its tunnel closed",
                    args.name
                ),
            )
        }
    }
    .map_err(CliError::Output)
}

/// Reads an export document (`-` is stdin) and checks it is a JSON object; the relay checks the rest.
fn read_export(path: &std::path::Path) -> Result<serde_json::Value, ConfigError> {
    use std::io::Read as _;
    let read_error = |source| ConfigError::Read {
        path: path.to_path_buf(),
        source,
    };
    let mut text = Vec::new();
    let stdin = path.as_os_str() == "-";
    let name = if stdin {
        "stdin".to_string()
    } else {
        path.display().to_string()
    };
    if stdin {
        std::io::stdin()
            .read_to_end(&mut text)
            .map_err(read_error)?;
    } else {
        text = std::fs::read(path).map_err(read_error)?;
    }
    match serde_json::from_slice::<serde_json::Value>(&text) {
        Ok(value @ serde_json::Value::Object(_)) => Ok(value),
        Ok(_) => Err(ConfigError::Invalid(format!(
            "{name} is not a cluster export: expected a JSON object from `tether cluster export`"
        ))),
        Err(e) => Err(ConfigError::Invalid(format!(
            "{name} is not a cluster export (JSON from `tether cluster export`): {e}"
        ))),
    }
}
