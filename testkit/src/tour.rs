//! The short tour `tether up` prints: what to try against the sample cluster through the relay, and, with guard,
//! what a Viewer may and may not do (configmaps yes; secrets, port-forward no) and how `kubectl auth can-i` tells.
//! Every command in it is exercised by the end-to-end tests (`cli/tests/sample_cluster*.rs`).

use std::fmt::Write as _;
use std::path::Path;

/// What the tour needs to know about a running quickstart.
#[derive(Debug, Clone, Copy)]
pub struct TourOptions<'a> {
    /// The admin kubeconfig through the relay.
    pub kubeconfig: &'a Path,
    /// The `tether` configuration file (`tether --config`).
    pub config: &'a Path,
    /// The cluster's name at the relay.
    pub cluster: &'a str,
    /// Where the per-user files of the guard part go (tokens, kubeconfigs).
    pub state_dir: &'a Path,
    /// Whether guard and the development issuer are wired in (adds the access-control part).
    pub guard: bool,
}

/// The user of the guard part of the tour.
pub const TOUR_USER: &str = "alice@contoso.com";

/// The tour text, one command per line with a comment saying what to expect; ends with a newline.
pub fn tour(opts: &TourOptions<'_>) -> String {
    let k = opts.kubeconfig.display();
    let config = opts.config.display();
    let cluster = opts.cluster;
    let mut out = String::new();
    let mut line = |text: String| {
        let _ = writeln!(out, "{text}");
    };
    line("Try:".into());
    line(format!(
        "  kubectl --kubeconfig {k} get pods,services,secrets"
    ));
    line(format!(
        "  kubectl --kubeconfig {k} port-forward pod/demo 18080:80     # then: curl http://127.0.0.1:18080/"
    ));
    line(format!(
        "  kubectl --kubeconfig {k} exec demo -- echo hello from the pod"
    ));
    line(format!(
        "  kubectl --kubeconfig {k} cp ./some-file demo:/tmp/some-file"
    ));
    line(format!("  kubectl --kubeconfig {k} auth can-i --list"));
    line(format!("  tether --config {config} cluster list"));
    if opts.guard {
        let dir = opts.state_dir.display();
        let oid = crate::dev_issuer::object_id(TOUR_USER);
        let alice = format!("kubectl --kubeconfig {dir}/alice.kubeconfig");
        line(String::new());
        line(format!(
            "Access control (guard): {TOUR_USER} as a Viewer of namespace default reads configmaps, not secrets:"
        ));
        line(format!(
            "  tether --config {config} token --user {TOUR_USER} > {dir}/alice.token   # DEVELOPMENT ONLY token"
        ));
        line(format!(
            "  tether --config {config} kubeconfig {cluster} --token-file {dir}/alice.token -f {dir}/alice.kubeconfig"
        ));
        line(format!(
            "  tether --config {config} role assign --role Viewer --principal {oid} --cluster {cluster} --namespace default"
        ));
        line(format!(
            "  {alice} get configmaps                       # allowed"
        ));
        line(format!(
            "  {alice} get secrets                          # Forbidden: a Viewer cannot read secrets"
        ));
        line(format!(
            "  {alice} auth can-i get secrets               # no"
        ));
        line(format!(
            "  {alice} port-forward pod/demo 18080:80       # Forbidden: nor reach into pods"
        ));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_tour_shows_port_forward_and_can_i() {
        let opts = TourOptions {
            kubeconfig: Path::new("/s/kubeconfig"),
            config: Path::new("/s/config.json"),
            cluster: "sample",
            state_dir: Path::new("/s"),
            guard: true,
        };
        let text = tour(&opts);
        assert!(text.contains("kubectl --kubeconfig /s/kubeconfig port-forward pod/demo 18080:80"));
        assert!(text.contains("/s/alice.kubeconfig auth can-i get secrets"));
        assert!(text.contains("get secrets                          # Forbidden"));
        assert!(text.contains(&crate::dev_issuer::object_id(TOUR_USER)));
        assert!(text.ends_with('\n'));
        let without_guard = tour(&TourOptions {
            guard: false,
            ..opts
        });
        assert!(!without_guard.contains("alice"));
        assert!(without_guard.contains("auth can-i --list"));
    }
}
