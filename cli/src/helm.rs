//! The `helm upgrade --install` line `tether cluster connect` prints (as `az connectedk8s connect` installs Azure
//! Arc's agents): the agent chart's values for the new cluster. The secrets — the one-time onboarding token and
//! a proxy URL holding credentials — go to files created with mode 0600 and reach helm by `--set-file`, so they
//! land neither in shell history nor in `ps` output; the relay CA goes to a file next to them.
//!
//! It does not run helm and does not talk to any cluster: the operator runs the printed line where their
//! kubeconfig points at the cluster.

use std::fs::OpenOptions;
use std::io::{self, Write};
use std::path::{Path, PathBuf};

use crate::args::ConnectArgs;
use crate::client::CreatedCluster;
use crate::config::{ConfigError, ResolvedConfig};

/// What goes into the helm line besides the cluster's own values, checked before the cluster is registered.
#[derive(Debug)]
pub(crate) struct HelmPlan {
    chart: String,
    namespace: String,
    files_dir: PathBuf,
    proxy_https: Option<String>,
    proxy_skip_range: Option<String>,
    proxy_cert: Option<PathBuf>,
    entra_tenants: Vec<String>,
    entra_audiences: Vec<String>,
}

impl HelmPlan {
    /// Checks the options (the proxy CA must be readable, the files directory must exist).
    pub(crate) fn new(args: &ConnectArgs) -> Result<HelmPlan, ConfigError> {
        let proxy_cert = match &args.proxy_cert {
            Some(path) => {
                Some(
                    std::fs::canonicalize(path).map_err(|source| ConfigError::Read {
                        path: path.clone(),
                        source,
                    })?,
                )
            }
            None => None,
        };
        if !args.files_dir.is_dir() {
            return Err(ConfigError::Invalid(format!(
                "--files-dir {} is not a directory",
                args.files_dir.display()
            )));
        }
        if let Some(url) = &args.proxy_https
            && !url.starts_with("http://")
        {
            return Err(ConfigError::Invalid(format!(
                "--proxy-https must be an http:// URL (the agent reaches the proxy with CONNECT), not {}",
                redact_userinfo(url)
            )));
        }
        Ok(HelmPlan {
            chart: args.chart.clone(),
            namespace: args.namespace.clone(),
            files_dir: args.files_dir.clone(),
            proxy_https: args.proxy_https.clone(),
            proxy_skip_range: args.proxy_skip_range.clone(),
            proxy_cert,
            entra_tenants: args.entra_tenants.clone(),
            entra_audiences: args.entra_audiences.clone(),
        })
    }

    /// Writes the files the line refers to and returns the line (one `\`-continued shell command).
    pub(crate) fn write(
        &self,
        config: &ResolvedConfig,
        created: &CreatedCluster,
    ) -> io::Result<String> {
        let name = &created.name;
        let mut lines = vec![
            format!(
                "helm upgrade --install tether-agent {}",
                sh_quote(&self.chart)
            ),
            format!(
                "--namespace {} --create-namespace",
                sh_quote(&self.namespace)
            ),
            set_string("clusterName", name),
            set_string("relay.urls[0]", &config.relay_url),
        ];
        if let Some(ca) = &config.ca_pem {
            let path = self.files_dir.join(format!("{name}-relay-ca.pem"));
            write_private(&path, ca)?;
            lines.push(set_file("relay.caCert", &path));
        }
        let token = self.files_dir.join(format!("{name}-onboarding-token"));
        write_private(&token, created.onboarding_token.expose().as_bytes())?;
        lines.push(set_file("onboarding.token", &token));
        if let Some(url) = &self.proxy_https {
            if has_userinfo(url) {
                let path = self.files_dir.join(format!("{name}-https-proxy"));
                write_private(&path, url.as_bytes())?;
                lines.push(set_file("proxy.httpsProxy", &path));
            } else {
                lines.push(set_string("proxy.httpsProxy", url));
            }
        }
        if let Some(skip) = &self.proxy_skip_range {
            lines.push(set_string("proxy.noProxy", skip));
        }
        if let Some(cert) = &self.proxy_cert {
            lines.push(set_file("proxy.proxyCert", cert));
        }
        for (i, tenant) in self.entra_tenants.iter().enumerate() {
            lines.push(set_string(&format!("entra.tenants[{i}]"), tenant));
        }
        for (i, audience) in self.entra_audiences.iter().enumerate() {
            lines.push(set_string(&format!("entra.audiences[{i}]"), audience));
        }
        Ok(lines.join(" \\\n    "))
    }
}

/// `--set-string 'KEY=VALUE'`: always a string (a cluster named `123` stays one), escaped for helm and the shell.
fn set_string(key: &str, value: &str) -> String {
    format!(
        "--set-string {}",
        sh_quote(&format!("{key}={}", helm_escape(value)))
    )
}

/// `--set-file 'KEY=PATH'`.
fn set_file(key: &str, path: &Path) -> String {
    format!(
        "--set-file {}",
        sh_quote(&format!(
            "{key}={}",
            helm_escape(&path.display().to_string())
        ))
    )
}

/// Helm's `--set` parser splits on `,` and takes `\` as an escape.
fn helm_escape(value: &str) -> String {
    let mut out = String::with_capacity(value.len());
    for c in value.chars() {
        if c == '\\' || c == ',' {
            out.push('\\');
        }
        out.push(c);
    }
    out
}

/// One POSIX shell word: single quotes, a `'` inside written as `'\''`.
fn sh_quote(value: &str) -> String {
    format!("'{}'", value.replace('\'', r"'\''"))
}

/// Whether `url` carries `user[:password]@` before its host.
fn has_userinfo(url: &str) -> bool {
    let rest = url.split_once("://").map_or(url, |(_, rest)| rest);
    let authority = rest.split(['/', '?', '#']).next().unwrap_or("");
    authority.contains('@')
}

/// The URL with any `user:password@` replaced by `***@`, for messages.
fn redact_userinfo(url: &str) -> String {
    if !has_userinfo(url) {
        return url.to_owned();
    }
    let (scheme, rest) = url.split_once("://").unwrap_or(("", url));
    let host = rest.rsplit_once('@').map_or(rest, |(_, host)| host);
    format!("{scheme}://***@{host}")
}

/// Writes `contents` to a new file readable by its owner only. An existing file (or symlink) at `path` is
/// removed first, so neither an old file's wider mode nor a planted symlink's target receives the secret.
fn write_private(path: &Path, contents: &[u8]) -> io::Result<()> {
    let fail =
        |e: io::Error| io::Error::new(e.kind(), format!("cannot write {}: {e}", path.display()));
    match std::fs::remove_file(path) {
        Ok(()) => {}
        Err(e) if e.kind() == io::ErrorKind::NotFound => {}
        Err(e) => return Err(fail(e)),
    }
    let mut options = OpenOptions::new();
    options.write(true).create_new(true);
    #[cfg(unix)]
    {
        use std::os::unix::fs::OpenOptionsExt as _;
        options.mode(0o600);
    }
    let mut file = options.open(path).map_err(fail)?;
    file.write_all(contents).map_err(fail)?;
    file.sync_all().map_err(fail)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn values_are_escaped_for_helm_then_quoted_for_the_shell() {
        assert_eq!(
            set_string("proxy.noProxy", ".svc,10.0.0.0/8"),
            r"--set-string 'proxy.noProxy=.svc\,10.0.0.0/8'"
        );
        assert_eq!(set_string("a", r"x\y"), r"--set-string 'a=x\\y'");
        assert_eq!(set_string("a", "it's"), r"--set-string 'a=it'\''s'");
        assert_eq!(
            set_file("onboarding.token", Path::new("./t")),
            "--set-file 'onboarding.token=./t'"
        );
    }

    #[test]
    fn credentials_in_a_proxy_url_are_found_and_redacted() {
        assert!(has_userinfo("http://u:p@proxy:3128"));
        assert!(has_userinfo("http://u@proxy:3128/x"));
        assert!(!has_userinfo("http://proxy:3128"));
        assert!(!has_userinfo("http://proxy:3128/a@b"));
        assert_eq!(
            redact_userinfo("http://u:p@proxy:3128"),
            "http://***@proxy:3128"
        );
        assert_eq!(redact_userinfo("http://proxy:3128"), "http://proxy:3128");
    }

    #[cfg(unix)]
    #[test]
    fn private_files_are_0600_and_replace_a_planted_symlink() -> io::Result<()> {
        use std::os::unix::fs::PermissionsExt as _;
        let dir = tempfile::tempdir()?;
        let target = dir.path().join("elsewhere");
        std::fs::write(&target, "untouched")?;
        let path = dir.path().join("token");
        std::os::unix::fs::symlink(&target, &path)?;
        write_private(&path, b"secret")?;
        assert_eq!(std::fs::read_to_string(&target)?, "untouched");
        assert_eq!(std::fs::read_to_string(&path)?, "secret");
        let meta = std::fs::symlink_metadata(&path)?;
        assert!(meta.file_type().is_file());
        assert_eq!(meta.permissions().mode() & 0o777, 0o600);
        // An older, wider file is replaced, not reused with its mode.
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o644))?;
        write_private(&path, b"again")?;
        let meta = std::fs::metadata(&path)?;
        assert_eq!(meta.permissions().mode() & 0o777, 0o600);
        Ok(())
    }
}
