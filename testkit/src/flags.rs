//! The `tether-sample-apiserver` command line, named as kube-apiserver names the same flags, parsed with clap
//! straight into [`SampleOptions`].

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use crate::SampleOptions;

/// A sample Kubernetes apiserver for tests and demos (in memory, HTTPS, bearer tokens).
#[derive(Debug, clap::Parser)]
#[command(name = "tether-sample-apiserver", version)]
pub struct SampleFlags {
    /// Directory for kubeconfig, ca.pem and token (created if missing).
    #[arg(long, env = "TETHER_SAMPLE_DIR")]
    pub dir: PathBuf,
    /// Address to listen on.
    #[arg(long, env = "TETHER_SAMPLE_LISTEN", default_value = "127.0.0.1:6443")]
    pub listen: SocketAddr,
    /// Bearer token of user "admin" (random when not given; never empty).
    #[arg(long, env = "TETHER_SAMPLE_TOKEN", hide_env_values = true, value_parser = clap::builder::NonEmptyStringValueParser::new())]
    pub token: Option<String>,
    /// TokenReview webhook kubeconfig, asked for tokens that are not static ones (as kube-apiserver's flag).
    #[arg(long, env = "TETHER_SAMPLE_AUTHN_WEBHOOK")]
    pub authentication_token_webhook_config_file: Option<PathBuf>,
    /// How long TokenReview answers are cached (a Go duration, e.g. 2m or 1h30m).
    #[arg(long, default_value = "2m", value_parser = go_duration)]
    pub authentication_token_webhook_cache_ttl: Duration,
    /// Structured AuthorizationConfiguration YAML (as kube-apiserver's flag); without it every authenticated
    /// request is allowed.
    #[arg(long, env = "TETHER_SAMPLE_AUTHZ_CONFIG")]
    pub authorization_config: Option<PathBuf>,
    /// HTTP/2 concurrent streams per connection (as kube-apiserver's flag; 0 means its default, 100).
    #[arg(long, default_value_t = crate::DEFAULT_HTTP2_MAX_STREAMS)]
    pub http2_max_streams_per_connection: u32,
}

/// A clap value parser for Go durations.
fn go_duration(s: &str) -> Result<Duration, String> {
    crate::authz::parse_duration(s).ok_or_else(|| format!("not a Go duration: {s:?}"))
}

impl SampleFlags {
    /// The options these flags ask for.
    pub fn into_options(self) -> SampleOptions {
        let mut opts = SampleOptions::new(self.dir);
        opts.listen = self.listen;
        opts.token = self.token;
        opts.authn_webhook = self.authentication_token_webhook_config_file;
        opts.authn_cache_ttl = self.authentication_token_webhook_cache_ttl;
        opts.authz_config = self.authorization_config;
        opts.http2_max_streams_per_connection = self.http2_max_streams_per_connection;
        opts
    }
}
