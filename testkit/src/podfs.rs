//! A pod's filesystem for `kubectl cp`: a scratch directory per pod (`DIR/pods/NAMESPACE_NAME`, with `tmp/`) in
//! which exec's `tar` runs the machine's real GNU tar, and `test -d/-f/-e` looks.
//!
//! Confinement, because the paths come from the client: absolute pod paths are mapped under the scratch root;
//! `..` components are refused; every path that exists is canonicalized and must stay under the root (a symlink
//! uploaded earlier cannot lead tar outside); only the tar options kubectl sends are accepted (no `-P`, `-h`,
//! `--to-command`, `-I`, `-T`, `-F`, ...), and the archive must be `-` (stdin or stdout). GNU tar itself strips
//! leading `/` from member names, refuses `..` members and does not extract through symlinks it created.

use std::path::{Component, Path, PathBuf};

/// The scratch root of pod `namespace/name` under `pods_dir`, created with `tmp/` if missing.
pub(crate) fn root(pods_dir: &Path, namespace: &str, name: &str) -> std::io::Result<PathBuf> {
    let root = pods_dir.join(format!("{namespace}_{name}"));
    std::fs::create_dir_all(root.join("tmp"))?;
    root.canonicalize()
}

/// `path` (a pod path, absolute or relative to `cwd` in the pod) as a host path under `root`; refused if it has
/// `..` or, once symlinks are resolved, leaves `root`.
pub(crate) fn resolve(root: &Path, cwd: &Path, path: &str) -> Result<PathBuf, String> {
    let pod_path = Path::new(path);
    if pod_path
        .components()
        .any(|c| matches!(c, Component::ParentDir))
    {
        return Err(format!("{path}: '..' is not allowed in the sample cluster"));
    }
    let relative: PathBuf = pod_path
        .components()
        .filter(|c| matches!(c, Component::Normal(_) | Component::CurDir))
        .collect();
    let host = if pod_path.is_absolute() {
        root.join(relative)
    } else {
        cwd.join(relative)
    };
    // The longest existing ancestor decides where the path really goes.
    let mut existing = host.as_path();
    while !existing.exists() {
        match existing.parent() {
            Some(parent) => existing = parent,
            None => break,
        }
    }
    let real = existing
        .canonicalize()
        .map_err(|e| format!("{path}: {e}"))?;
    if !real.starts_with(root) {
        return Err(format!("{path}: leads outside the pod's filesystem"));
    }
    Ok(host)
}

/// `test -d|-f|-e PATH`: the exit code.
pub(crate) fn test(root: &Path, args: &[String]) -> i32 {
    let (op, path) = match args {
        [op, path] => (op.as_str(), path.as_str()),
        [path] => ("-n", path.as_str()),
        _ => return 2,
    };
    if op == "-n" {
        return i32::from(path.is_empty());
    }
    let Ok(host) = resolve(root, root, path) else {
        return 1;
    };
    let yes = match op {
        "-d" => host.is_dir(),
        "-f" => host.is_file(),
        "-e" => host.exists(),
        _ => return 2,
    };
    i32::from(!yes)
}

/// Options that take no argument and are safe: the bundled letters kubectl uses, plus a few GNU spellings.
const SAFE_LETTERS: &str = "cxtvmpo";
const SAFE_LONG: &[&str] = &[
    "--no-same-permissions",
    "--no-same-owner",
    "--touch",
    "--verbose",
];

/// Checks and rewrites tar's arguments for running in `root`: `-C DIR` and absolute paths are mapped under it.
pub(crate) fn tar_args(root: &Path, args: &[String]) -> Result<Vec<String>, String> {
    let mut out = Vec::new();
    let mut cwd = root.to_path_buf();
    let mut iter = args.iter().enumerate().peekable();
    let mut archive_next = false;
    let mut saw_mode = false;
    while let Some((i, arg)) = iter.next() {
        if archive_next {
            if arg != "-" {
                return Err("only '-' (stdin/stdout) is supported as the archive".into());
            }
            out.push(arg.clone());
            archive_next = false;
            continue;
        }
        if arg == "-C" || arg == "--directory" {
            let dir = iter
                .next()
                .map(|(_, d)| d)
                .ok_or("option requires an argument -- 'C'")?;
            let host = resolve(root, &cwd, dir)?;
            if !host.is_dir() {
                return Err(format!("{dir}: Cannot open: No such file or directory"));
            }
            out.push("-C".into());
            out.push(host.display().to_string());
            cwd = host;
            continue;
        }
        if SAFE_LONG.contains(&arg.as_str()) {
            out.push(arg.clone());
            continue;
        }
        // Old style (`cf`) only as the first word; otherwise `-xmf`.
        let letters = arg
            .strip_prefix('-')
            .filter(|l| !l.is_empty() && !l.starts_with('-'))
            .or_else(|| (i == 0).then_some(arg.as_str()));
        if let Some(letters) = letters {
            let (flags, has_f) = match letters.strip_suffix('f') {
                Some(rest) => (rest, true),
                None => (letters, false),
            };
            if flags.chars().all(|c| SAFE_LETTERS.contains(c)) {
                saw_mode |= flags.chars().any(|c| matches!(c, 'c' | 'x' | 't'));
                out.push(format!("-{letters}"));
                archive_next = has_f;
                continue;
            }
        }
        if arg.starts_with('-') {
            return Err(format!("{arg}: option not supported by the sample cluster"));
        }
        // A path (member name when extracting).
        let host = resolve(root, &cwd, arg)?;
        let relative = host.strip_prefix(&cwd).unwrap_or(&host).to_path_buf();
        let shown = if relative.as_os_str().is_empty() {
            ".".to_string()
        } else {
            relative.display().to_string()
        };
        out.push(shown);
    }
    if archive_next {
        return Err("option requires an argument -- 'f'".into());
    }
    if !saw_mode {
        return Err(
            "You must specify one of the '-Acdtrux', '--delete' or '--test-label' options".into(),
        );
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn strings(args: &[&str]) -> Vec<String> {
        args.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn kubectl_cp_arguments_are_mapped_under_the_root() -> Result<(), String> {
        let dir = tempfile::tempdir().map_err(|e| e.to_string())?;
        let root = super::root(dir.path(), "default", "demo").map_err(|e| e.to_string())?;
        let x = tar_args(&root, &strings(&["-xmf", "-", "-C", "/tmp"]))?;
        assert_eq!(
            x,
            ["-xmf", "-", "-C", &root.join("tmp").display().to_string()]
        );
        let c = tar_args(&root, &strings(&["cf", "-", "/tmp/file"]))?;
        assert_eq!(c, ["-cf", "-", "tmp/file"]);
        Ok(())
    }

    #[test]
    fn escapes_and_dangerous_options_are_refused() -> Result<(), String> {
        let dir = tempfile::tempdir().map_err(|e| e.to_string())?;
        let root = super::root(dir.path(), "default", "demo").map_err(|e| e.to_string())?;
        std::os::unix::fs::symlink("/etc", root.join("tmp/etc")).map_err(|e| e.to_string())?;
        for bad in [
            &["cf", "-", "/tmp/../../x"][..],
            &["cf", "-", "/tmp/etc/passwd"],
            &["-xmf", "-", "-C", "/tmp/etc"],
            &["-xmf", "/etc/shadow"],
            &["-xPf", "-"],
            &["-cf", "-", "--to-command=sh", "x"],
            &["-c", "-I", "sh", "-f", "-"],
            &["-chf", "-", "tmp"],
            &["-cf", "-", "-T", "/etc/list"],
        ] {
            assert!(tar_args(&root, &strings(bad)).is_err(), "{bad:?}");
        }
        assert_eq!(test(&root, &strings(&["-d", "/tmp"])), 0);
        assert_eq!(test(&root, &strings(&["-d", "/tmp/nope"])), 1);
        assert_eq!(test(&root, &strings(&["-f", "/tmp/etc/passwd"])), 1);
        Ok(())
    }
}
