//! A throwaway PostgreSQL server for tests: `initdb` in a temporary directory, `postgres` on a free loopback
//! port (and a Unix socket in that directory), databases made with `createdb`, and the server stopped when the
//! [`Postgres`] value is dropped (also when a test panics).
//!
//! [`Postgres::start_kept`] is the same server with its data kept in a directory of the caller's (the local
//! relay fleet of `tether up --replicas N`): `initdb` the first time, the same data on every later start, stopped
//! on drop but never removed. It lives longer than a test and other users of the machine can reach its port, so
//! it requires a password (SCRAM), generated at `initdb` into `DIR/password` (0600).
//!
//! The binaries are found in `$TETHER_PG_BINDIR`, else `pg_config --bindir`, else the newest
//! `/usr/lib/postgresql/NN/bin` (Debian's layout), else `PATH`. PostgreSQL refuses to run as root, so when the
//! tests run as root the server runs as the `postgres` user (`runuser`), and the directory is given to it.
//!
//! ```no_run
//! # fn demo() -> Result<(), tether_testkit::postgres::PostgresError> {
//! use tether_testkit::postgres::Postgres;
//! // `None`: PostgreSQL is not installed and `CI` is unset (the reason was printed); under `CI`, an error.
//! let Some(pg) = Postgres::start_or_skip("my test")? else { return Ok(()) };
//! let url = pg.create_database("relay")?; // postgres://postgres@127.0.0.1:PORT/relay
//! # let _ = url; Ok(()) }
//! ```
//!
//! Authentication of the temporary server is `trust` on loopback: it is reachable only from this machine, for the
//! test's life.

use std::net::{Ipv4Addr, TcpListener};
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};

/// Why the test PostgreSQL could not be found, started or used; the text includes the tool's output.
#[derive(Debug, thiserror::Error)]
#[error("test PostgreSQL: {0}")]
pub struct PostgresError(String);

/// The user `initdb` creates as superuser, and the one the server runs as when the tests run as root.
const SUPERUSER: &str = "postgres";

/// A running PostgreSQL server, stopped on drop.
#[derive(Debug)]
pub struct Postgres {
    bindir: PathBuf,
    /// Holds the data directory (`data/`) and the server log.
    home: Home,
    port: u16,
    /// Run the PostgreSQL binaries as this user (`runuser`), when the tests run as root.
    run_as: Option<String>,
    /// The superuser's password (kept servers); `None`: `trust`.
    password: Option<tether_runtime::Secret>,
}

/// The file of a kept server's directory holding its superuser's password.
const PASSWORD_FILE: &str = "password";

/// Where a server's files live.
#[derive(Debug)]
enum Home {
    /// A temporary directory, removed after the server stopped; also holds the Unix socket.
    Temporary(tempfile::TempDir),
    /// A directory of the caller's, kept; no Unix socket (its path could pass the 107-byte limit).
    Kept(PathBuf),
}

impl Home {
    fn path(&self) -> &Path {
        match self {
            Home::Temporary(dir) => dir.path(),
            Home::Kept(dir) => dir,
        }
    }
}

impl Postgres {
    /// Starts a server, or returns `Ok(None)` after printing why when PostgreSQL is not installed and the
    /// environment variable `CI` is unset. Under `CI` a missing PostgreSQL is an error: tests never pass
    /// without running.
    pub fn start_or_skip(test: &str) -> Result<Option<Postgres>, PostgresError> {
        start_found(bindir(), std::env::var_os("CI").is_some(), test)
    }

    /// Starts a server with the binaries in `bindir`.
    pub fn start_in(bindir: PathBuf) -> Result<Postgres, PostgresError> {
        let dir = tempfile::Builder::new()
            .prefix("tether-pg-")
            .tempdir()
            .map_err(|e| harness(format!("cannot create a temporary directory: {e}")))?;
        Self::start_home(bindir, Home::Temporary(dir))
    }

    /// Starts a server whose files live in `dir` (created 0700 if missing), kept after it stops: `initdb`
    /// runs only when `dir` holds no data yet, so a second start serves the same databases. The port is a
    /// free one each time. When run as root, `dir` is given to the `postgres` user, which must be able to
    /// reach it (no parent directory closed to other users): see [`kept_dir_for`].
    pub fn start_kept(bindir: PathBuf, dir: &Path) -> Result<Postgres, PostgresError> {
        std::fs::create_dir_all(dir)
            .map_err(|e| harness(format!("cannot create {}: {e}", dir.display())))?;
        restrict(dir)?;
        let dir = std::fs::canonicalize(dir)
            .map_err(|e| harness(format!("cannot resolve {}: {e}", dir.display())))?;
        Self::start_home(bindir, Home::Kept(dir))
    }

    fn start_home(bindir: PathBuf, home: Home) -> Result<Postgres, PostgresError> {
        let run_as = is_root().then(|| SUPERUSER.to_owned());
        let password_file = home.path().join(PASSWORD_FILE);
        let initialized = home.path().join("data").join("PG_VERSION").is_file();
        let password = match &home {
            Home::Temporary(_) => None,
            Home::Kept(_) if initialized => match std::fs::read_to_string(&password_file) {
                Ok(text) => Some(tether_runtime::Secret::new(text.trim())),
                // Made before passwords (trust): it stays so.
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => None,
                Err(e) => {
                    return Err(harness(format!(
                        "cannot read {}: {e}",
                        password_file.display()
                    )));
                }
            },
            Home::Kept(_) => {
                let text = format!("{:032x}", rand::random::<u128>());
                write_private(&password_file, &text)?;
                Some(tether_runtime::Secret::new(text))
            }
        };
        if run_as.is_some() {
            // PostgreSQL will not run as root; its directory must belong to the user it runs as.
            run(Command::new("chown")
                .arg("-R")
                .arg(format!("{SUPERUSER}:"))
                .arg(home.path()))?;
        }
        let mut pg = Postgres {
            bindir,
            home,
            port: 0,
            run_as,
            password,
        };
        if pg.run_as.is_some() {
            // A directory the server's user cannot reach fails later with a confusing message: say why here.
            let reachable = pg.run_tool("pg_ctl", &["--version"]).is_ok()
                && run(Command::new("runuser")
                    .args(["-u", SUPERUSER, "--", "test", "-w"])
                    .arg(pg.home.path()))
                .is_ok();
            if !reachable {
                return Err(harness(format!(
                    "the {SUPERUSER} user (PostgreSQL does not run as root) cannot write to {}: a parent \
                     directory is closed to other users",
                    pg.home.path().display()
                )));
            }
        }
        let data = pg.data_dir();
        if initialized {
            pg.start_on_a_free_port()?;
            return Ok(pg);
        }
        let pwfile = format!("--pwfile={}", path_str(&password_file)?);
        let auth: Vec<&str> = match pg.password {
            Some(_) => vec!["--auth", "scram-sha-256", &pwfile],
            None => vec!["--auth", "trust"],
        };
        let mut args = vec!["--pgdata", path_str(&data)?, "--username", SUPERUSER];
        args.extend(auth);
        args.extend(["--encoding", "UTF8", "--locale", "C", "--no-sync"]);
        pg.run_tool("initdb", &args)?;
        pg.start_on_a_free_port()?;
        Ok(pg)
    }

    /// A port found free may be taken before the server binds it: tries a few.
    fn start_on_a_free_port(&mut self) -> Result<(), PostgresError> {
        let mut last = None;
        for _ in 0..5 {
            self.port = free_port()?;
            match self.start_server() {
                Ok(()) => return Ok(()),
                Err(e) => last = Some(e),
            }
        }
        Err(last.unwrap_or_else(|| harness("PostgreSQL did not start".into())))
    }

    fn data_dir(&self) -> PathBuf {
        self.home.path().join("data")
    }

    /// The server's log file.
    pub fn log_path(&self) -> PathBuf {
        self.home.path().join("server.log")
    }

    fn start_server(&self) -> Result<(), PostgresError> {
        let data = self.data_dir();
        let log = self.log_path();
        let options = match &self.home {
            // Tests: no durability needed, speed wanted.
            Home::Temporary(dir) => format!(
                "-c listen_addresses=127.0.0.1 -p {} -k {} -c fsync=off -c synchronous_commit=off \
                 -c full_page_writes=off -c max_connections=200",
                self.port,
                path_str(dir.path())?
            ),
            Home::Kept(_) => format!(
                "-c listen_addresses=127.0.0.1 -p {} -c unix_socket_directories='' -c max_connections=200",
                self.port
            ),
        };
        let started = self.run_tool(
            "pg_ctl",
            &[
                "--pgdata",
                path_str(&data)?,
                "--log",
                path_str(&log)?,
                "--options",
                &options,
                "--wait",
                "--timeout",
                "60",
                "start",
            ],
        );
        if let Err(e) = started {
            let log = std::fs::read_to_string(&log).unwrap_or_default();
            // pg_ctl may have left a half-started server behind.
            self.stop();
            return Err(harness(format!("{e}\nserver log:\n{log}")));
        }
        Ok(())
    }

    /// The loopback port the server listens on.
    pub fn port(&self) -> u16 {
        self.port
    }

    /// The URL of `database` on this server, as the superuser (with the password of a kept server: a secret).
    pub fn url(&self, database: &str) -> String {
        match &self.password {
            Some(password) => format!(
                "postgres://{SUPERUSER}:{}@127.0.0.1:{}/{database}",
                password.expose(),
                self.port
            ),
            None => self.url_without_password(database),
        }
    }

    /// The URL of `database` without the password, to show.
    pub fn url_without_password(&self, database: &str) -> String {
        format!("postgres://{SUPERUSER}@127.0.0.1:{}/{database}", self.port)
    }

    /// Where a kept server's password is (`None` for a temporary server, which trusts loopback).
    pub fn password_file(&self) -> Option<PathBuf> {
        self.password
            .as_ref()
            .map(|_| self.home.path().join(PASSWORD_FILE))
    }

    /// Creates a database and returns its URL.
    pub fn create_database(&self, name: &str) -> Result<String, PostgresError> {
        let port = self.port.to_string();
        self.run_tool(
            "createdb",
            &[
                "--host",
                "127.0.0.1",
                "--port",
                &port,
                "--username",
                SUPERUSER,
                name,
            ],
        )?;
        Ok(self.url(name))
    }

    /// Creates a database unless it exists, and returns its URL.
    pub fn ensure_database(&self, name: &str) -> Result<String, PostgresError> {
        match self.create_database(name) {
            Ok(url) => Ok(url),
            // initdb ran with `--locale C`, and the tools with LC_ALL=C: the message is PostgreSQL's English one.
            Err(PostgresError(text)) if text.contains("already exists") => Ok(self.url(name)),
            Err(e) => Err(e),
        }
    }

    /// Creates a database with a name not used before in this process, and returns its URL.
    pub fn fresh_database(&self) -> Result<String, PostgresError> {
        static NEXT: AtomicU32 = AtomicU32::new(1);
        self.create_database(&format!("test_{}", NEXT.fetch_add(1, Ordering::Relaxed)))
    }

    /// Stops the server now (fast shutdown: sessions are disconnected). Also done on drop.
    pub fn stop(&self) {
        let data = self.data_dir();
        let Some(data) = data.to_str() else { return };
        if !self.data_dir().join("postmaster.pid").exists() {
            return;
        }
        if let Err(e) = self.run_tool(
            "pg_ctl",
            &[
                "--pgdata",
                data,
                "--mode",
                "fast",
                "--wait",
                "--timeout",
                "30",
                "stop",
            ],
        ) {
            eprintln!("stopping the test PostgreSQL failed: {e}");
            // Last resort, so that no server outlives the test.
            let _ = self.run_tool("pg_ctl", &["--pgdata", data, "--mode", "immediate", "stop"]);
        }
    }

    /// Runs one of the PostgreSQL binaries (as the server's user, with the password), failing with its output on
    /// error.
    fn run_tool(&self, tool: &str, args: &[&str]) -> Result<Output, PostgresError> {
        self.run_tool_with(tool, args, self.password.as_ref())
    }

    fn run_tool_with(
        &self,
        tool: &str,
        args: &[&str],
        password: Option<&tether_runtime::Secret>,
    ) -> Result<Output, PostgresError> {
        let program = self.bindir.join(tool);
        let mut command = match &self.run_as {
            Some(user) => {
                let mut c = Command::new("runuser");
                c.args(["-u", user, "--"]).arg(&program);
                c
            }
            None => Command::new(&program),
        };
        command
            .args(args)
            // Keep the caller's PG* settings (PGHOST, PGPASSWORD…) out of it.
            .env_remove("PGHOST")
            .env_remove("PGPORT")
            .env_remove("PGUSER")
            .env_remove("PGDATABASE")
            .env_remove("PGPASSWORD")
            .env("LC_ALL", "C")
            .current_dir(self.home.path());
        if let Some(password) = password {
            // The environment of a process is readable by its user only (unlike its arguments).
            command.env("PGPASSWORD", password.expose());
        }
        run(&mut command)
    }
}

impl Drop for Postgres {
    fn drop(&mut self) {
        self.stop();
    }
}

/// A directory for [`Postgres::start_kept`] to keep the data that belongs with `dir`: `dir/postgres`, except when
/// running as root — PostgreSQL then runs as the `postgres` user, who usually cannot enter a directory of
/// root's (a home directory, a 0700 state directory) — where it is `/var/lib/tether-up/postgres-HASH`, HASH
/// naming `dir` (so the same `dir` finds the same data again).
pub fn kept_dir_for(dir: &Path) -> PathBuf {
    if !is_root() {
        return dir.join("postgres");
    }
    use sha2::{Digest as _, Sha256};
    let canonical = std::fs::canonicalize(dir).unwrap_or_else(|_| dir.to_path_buf());
    let digest = Sha256::digest(canonical.as_os_str().as_encoded_bytes());
    let hash: String = digest[..8].iter().map(|b| format!("{b:02x}")).collect();
    PathBuf::from("/var/lib/tether-up").join(format!("postgres-{hash}"))
}

/// Writes `text` to a new 0600 file at `path`.
fn write_private(path: &Path, text: &str) -> Result<(), PostgresError> {
    use std::io::Write as _;
    use std::os::unix::fs::OpenOptionsExt as _;
    let mut file = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(path)
        .map_err(|e| harness(format!("cannot create {}: {e}", path.display())))?;
    file.write_all(text.as_bytes())
        .map_err(|e| harness(format!("cannot write {}: {e}", path.display())))
}

/// Sets `dir`'s permissions to 0700 (PostgreSQL refuses a data directory others can read).
fn restrict(dir: &Path) -> Result<(), PostgresError> {
    use std::os::unix::fs::PermissionsExt as _;
    std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o700))
        .map_err(|e| harness(format!("cannot restrict {}: {e}", dir.display())))
}

/// The directory holding `initdb`, `pg_ctl` and `createdb`, if PostgreSQL is installed.
pub fn bindir() -> Option<PathBuf> {
    let has_tools = |dir: &Path| {
        ["initdb", "pg_ctl", "createdb"]
            .iter()
            .all(|t| dir.join(t).is_file())
    };
    if let Some(dir) = std::env::var_os("TETHER_PG_BINDIR").filter(|d| !d.is_empty()) {
        return Some(PathBuf::from(dir));
    }
    let from_pg_config = Command::new("pg_config")
        .arg("--bindir")
        .stderr(Stdio::null())
        .output()
        .ok()
        .filter(|o| o.status.success())
        .map(|o| PathBuf::from(String::from_utf8_lossy(&o.stdout).trim()));
    if let Some(dir) = from_pg_config.filter(|d| has_tools(d)) {
        return Some(dir);
    }
    let debian = std::fs::read_dir("/usr/lib/postgresql")
        .ok()
        .into_iter()
        .flatten()
        .filter_map(Result::ok)
        .filter_map(|e| {
            let major: u32 = e.file_name().to_str()?.parse().ok()?;
            Some((major, e.path().join("bin")))
        })
        .filter(|(_, bin)| has_tools(bin))
        .max_by_key(|(major, _)| *major)
        .map(|(_, bin)| bin);
    if debian.is_some() {
        return debian;
    }
    std::env::var_os("PATH")
        .iter()
        .flat_map(std::env::split_paths)
        .find(|dir| has_tools(dir))
}

/// [`Postgres::start_or_skip`] with what was found and whether `CI` is set.
fn start_found(
    bindir: Option<PathBuf>,
    ci: bool,
    test: &str,
) -> Result<Option<Postgres>, PostgresError> {
    match bindir {
        Some(bindir) => Postgres::start_in(bindir).map(Some),
        None if !ci => {
            eprintln!(
                "skipping {test}: PostgreSQL not found (install the Debian package `postgresql`, or set \
                 TETHER_PG_BINDIR; scripts/install-test-deps.sh does it); with CI set this fails"
            );
            Ok(None)
        }
        None => Err(PostgresError(format!(
            "{test} needs PostgreSQL (initdb, pg_ctl, createdb), which is not installed: run \
             scripts/install-test-deps.sh"
        ))),
    }
}

fn is_root() -> bool {
    // No libc here: ask `id`, which every machine running these tests has.
    Command::new("id")
        .arg("-u")
        .output()
        .ok()
        .is_some_and(|o| String::from_utf8_lossy(&o.stdout).trim() == "0")
}

fn free_port() -> Result<u16, PostgresError> {
    let listener = TcpListener::bind((Ipv4Addr::LOCALHOST, 0))
        .map_err(|e| harness(format!("cannot find a free port: {e}")))?;
    listener
        .local_addr()
        .map(|a| a.port())
        .map_err(|e| harness(format!("cannot find a free port: {e}")))
}

fn path_str(path: &Path) -> Result<&str, PostgresError> {
    path.to_str()
        .ok_or_else(|| harness(format!("non-UTF-8 path {}", path.display())))
}

fn run(command: &mut Command) -> Result<Output, PostgresError> {
    let output = command
        .stdin(Stdio::null())
        .output()
        .map_err(|e| harness(format!("cannot run {command:?}: {e}")))?;
    if !output.status.success() {
        return Err(harness(format!(
            "{command:?} failed ({}):\n{}{}",
            output.status,
            String::from_utf8_lossy(&output.stdout),
            String::from_utf8_lossy(&output.stderr)
        )));
    }
    Ok(output)
}

fn harness(message: String) -> PostgresError {
    PostgresError(message)
}

#[cfg(test)]
mod tests {
    use std::net::TcpStream;

    use super::*;

    #[test]
    fn missing_postgres_fails_under_ci_and_skips_otherwise() {
        assert!(start_found(None, true, "t").is_err());
        assert!(start_found(None, false, "t").expect("skips").is_none());
    }

    #[test]
    fn starts_creates_databases_and_stops_on_drop() {
        let Some(pg) = Postgres::start_or_skip("the PostgreSQL harness test").expect("starts")
        else {
            return;
        };
        let port = pg.port();
        let url = pg.fresh_database().expect("createdb");
        assert!(
            url.starts_with(&format!("postgres://postgres@127.0.0.1:{port}/test_")),
            "{url}"
        );
        assert!(pg.create_database("same").is_ok());
        assert!(
            pg.create_database("same").is_err(),
            "createdb errors are reported"
        );
        let dir = pg.home.path().to_owned();
        assert!(TcpStream::connect((Ipv4Addr::LOCALHOST, port)).is_ok());
        drop(pg);
        assert!(
            TcpStream::connect((Ipv4Addr::LOCALHOST, port)).is_err(),
            "the server is stopped"
        );
        assert!(!dir.exists(), "its directory is removed");
    }

    #[test]
    fn a_kept_server_serves_the_same_data_after_a_restart() {
        let Some(bindir) = bindir() else {
            let _ = crate::tools::skip_or_fail::<()>("PostgreSQL is not installed");
            return;
        };
        let parent = tempfile::tempdir().expect("tempdir");
        // Readable by the postgres user when the tests run as root (tempdir() is 0700).
        std::fs::set_permissions(
            parent.path(),
            std::os::unix::fs::PermissionsExt::from_mode(0o755),
        )
        .expect("chmod");
        let dir = parent.path().join("pg");
        let first = Postgres::start_kept(bindir.clone(), &dir).expect("first start");
        let url = first.ensure_database("kept").expect("createdb");
        assert_eq!(first.ensure_database("kept").expect("exists"), url);
        assert!(
            first.create_database("kept").is_err(),
            "createdb again fails"
        );
        // Another user of the machine, without the password, is refused.
        let port = first.port().to_string();
        let args = [
            "--host",
            "127.0.0.1",
            "--port",
            &port,
            "--username",
            SUPERUSER,
            "--no-password",
            "stranger",
        ];
        let refused = first.run_tool_with("createdb", &args, None).err();
        let refused = refused.map(|e| e.to_string()).unwrap_or_default();
        assert!(refused.contains("password"), "{refused}");
        let password_file = first.password_file().expect("a kept server has a password");
        let password = std::fs::read_to_string(&password_file).expect("password file");
        assert!(
            url.contains(password.trim()),
            "the URL carries the password"
        );
        assert!(!first.url_without_password("kept").contains(password.trim()));
        let mode = std::os::unix::fs::PermissionsExt::mode(
            &std::fs::metadata(&password_file)
                .expect("password file")
                .permissions(),
        );
        assert_eq!(mode & 0o777, 0o600);
        drop(first);
        assert!(
            dir.join("data").join("PG_VERSION").is_file(),
            "the data is kept"
        );
        let second = Postgres::start_kept(bindir, &dir).expect("second start");
        // The database made by the first server is there: creating it again fails.
        let again = second.create_database("kept").err().map(|e| e.to_string());
        assert!(
            again
                .as_deref()
                .is_some_and(|t| t.contains("already exists")),
            "{again:?}"
        );
        drop(second);
    }

    #[test]
    fn kept_data_stays_with_its_directory() {
        let a = kept_dir_for(Path::new("/tmp/a"));
        assert_eq!(a, kept_dir_for(Path::new("/tmp/a")));
        assert_ne!(a, kept_dir_for(Path::new("/tmp/b")));
    }
}
