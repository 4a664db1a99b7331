//! The `tether` command: manage clusters at a relay, write kubeconfigs for users, and run the quickstart.
//!
//! Every subcommand is a thin client of the relay's admin REST API (`docs/API.md`), except `tether up`, which runs
//! a relay, a cluster agent and (unless a real cluster is given) the testkit's sample apiserver in one process.
//! The [`up`] module is also the harness the end-to-end tests use, so the quickstart and the tests exercise the
//! same wiring.
//!
//! It does not talk to clusters itself: kubectl does, through the relay.

pub mod args;
pub mod client;
pub mod config;
pub mod kubeconfig;
mod output;
pub mod up;

use std::error::Error as _;

pub use args::Cli;

use args::{ClusterCommand, Command, OutputFormat};
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
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(default));
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .try_init();
}

/// Runs one `tether` command.
pub async fn run(cli: Cli) -> Result<(), CliError> {
    tether_tunnel::tls::install_crypto_provider();
    match cli.command {
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
            let created = client.create_cluster(&args.name, &tags).await?;
            match args.output {
                OutputFormat::Json => output::json(&mut out, &created.raw),
                OutputFormat::Table => output::connect_instructions(&mut out, config, &created),
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
