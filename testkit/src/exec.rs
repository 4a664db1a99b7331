//! `…/pods/NAME/exec` over WebSocket, with a tiny built-in command set instead of a container runtime.
//!
//! Subprotocols `v5.channel.k8s.io` (preferred) and `v4.channel.k8s.io`, as kube-apiserver negotiates them. Every
//! binary message starts with a channel byte: 0 stdin, 1 stdout, 2 stderr, 3 error (a JSON `Status`: Success, or
//! Failure with reason NonZeroExitCode and the exit code in `details.causes[ExitCode]`), 4 resize. v5 adds the
//! close signal `[255, CHANNEL]`, which is how `echo hi | kubectl exec -i demo -- cat` ends when stdin closes.
//!
//! SPDY (`Upgrade: SPDY/3.1`) is not supported: kubectl ≥ 1.30 uses WebSockets for exec and only falls back to
//! SPDY when the WebSocket upgrade fails. The older channel protocols (v1–v3, base64) are refused too.
//!
//! Commands: `cat` (stdin to stdout until stdin closes, or a few known files), `echo [-n] ARGS…`, `true`, `false`,
//! `env`, `hostname`, `pwd`, `whoami`, `uname`, `sleep N`, and `sh`/`bash` with `-c SCRIPT` (commands joined by
//! `;` or `&&`, plus `exit N`) or reading commands from stdin (with a prompt and line editing when `tty=true`).
//! Anything else exits 127 with the message a container runtime gives.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use futures_util::{SinkExt as _, StreamExt as _};
use http::{HeaderValue, Request, Response, StatusCode, header};
use hyper::body::Incoming;
use hyper_util::rt::TokioIo;
use serde_json::{Value, json};
use tokio::sync::mpsc;
use tokio_tungstenite::WebSocketStream;
use tokio_tungstenite::tungstenite::Message;
use tokio_tungstenite::tungstenite::protocol::frame::coding::CloseCode;
use tokio_tungstenite::tungstenite::protocol::{CloseFrame, Role};

use crate::body::Body;
use crate::resources::Resource;
use crate::state::Shared;
use crate::status::ApiError;
use crate::target::Target;

const STDIN: u8 = 0;
const STDOUT: u8 = 1;
const STDERR: u8 = 2;
const ERROR: u8 = 3;
const RESIZE: u8 = 4;
const CLOSE: u8 = 255;

/// The negotiated channel protocol.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Protocol {
    V4,
    V5,
}

impl Protocol {
    fn name(self) -> &'static str {
        match self {
            Protocol::V4 => "v4.channel.k8s.io",
            Protocol::V5 => "v5.channel.k8s.io",
        }
    }
}

/// What the client asked for.
#[derive(Debug, Clone)]
struct ExecRequest {
    command: Vec<String>,
    stdin: bool,
    stdout: bool,
    stderr: bool,
    tty: bool,
    pod: String,
    /// The pod's scratch filesystem (`tar`, `test`); None in unit tests.
    root: Option<std::path::PathBuf>,
}

fn parse(query: &[(String, String)], pod: &str) -> Result<ExecRequest, ApiError> {
    let flag = |k: &str| {
        query
            .iter()
            .any(|(key, v)| key == k && (v == "true" || v == "1"))
    };
    let command: Vec<String> = query
        .iter()
        .filter(|(k, _)| k == "command")
        .map(|(_, v)| v.clone())
        .collect();
    let req = ExecRequest {
        command,
        stdin: flag("stdin"),
        stdout: flag("stdout"),
        stderr: flag("stderr"),
        tty: flag("tty"),
        pod: pod.to_string(),
        root: None,
    };
    if req.command.is_empty() {
        return Err(ApiError::bad_request(
            "you must specify at least one command for the container",
        ));
    }
    if !req.stdin && !req.stdout && !req.stderr {
        return Err(ApiError::bad_request(
            "you must specify at least 1 of stdin, stdout, stderr",
        ));
    }
    if req.tty && req.stderr {
        return Err(ApiError::bad_request("tty and stderr cannot both be true"));
    }
    Ok(req)
}

fn header_has_token(headers: &http::HeaderMap, name: header::HeaderName, token: &str) -> bool {
    headers
        .get_all(name)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .any(|t| t.trim().eq_ignore_ascii_case(token))
}

fn negotiate(headers: &http::HeaderMap) -> Result<Protocol, ApiError> {
    let offered: Vec<String> = headers
        .get_all(header::SEC_WEBSOCKET_PROTOCOL)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .map(|p| p.trim().to_string())
        .collect();
    [Protocol::V5, Protocol::V4]
        .into_iter()
        .find(|p| offered.iter().any(|o| o == p.name()))
        .ok_or_else(|| {
            ApiError::bad_request(format!(
                "requested protocol(s) are not supported: {offered:?}; supports [\"v5.channel.k8s.io\" \"v4.channel.k8s.io\"]"
            ))
        })
}

pub(crate) fn handle(
    shared: &Arc<Shared>,
    t: &Target,
    query: &[(String, String)],
    mut req: Request<Incoming>,
) -> Result<Response<Body>, ApiError> {
    let attach = t.subresource.as_deref() == Some("attach");
    let namespace = t.namespace.clone().unwrap_or_default();
    let name = t.name.clone().unwrap_or_default();
    let pod = shared.store.get(Resource::Pods, &namespace, &name)?;
    let requested = query
        .iter()
        .find(|(k, _)| k == "container")
        .map(|(_, v)| v.as_str());
    crate::logs::pick_container(&pod, requested)?;
    if matches!(
        pod["status"]["phase"].as_str(),
        Some("Succeeded" | "Failed")
    ) {
        return Err(ApiError::bad_request(
            "cannot exec into a container in a completed pod",
        ));
    }
    let mut exec = if attach {
        // Attach joins the container's main process: here a `cat` when stdin is attached (what you type comes
        // back), otherwise a process that prints nothing until the client leaves.
        let mut query = query.to_vec();
        let stdin = query
            .iter()
            .any(|(k, v)| k == "stdin" && (v == "true" || v == "1"));
        let main: &[&str] = if stdin { &["cat"] } else { &["sleep", "86400"] };
        query.retain(|(k, _)| k != "command");
        query.extend(main.iter().map(|c| ("command".to_string(), c.to_string())));
        parse(&query, &name)?
    } else {
        parse(query, &name)?
    };
    exec.root = match crate::podfs::root(&shared.pods_dir, &namespace, &name) {
        Ok(root) => Some(root),
        Err(error) => {
            tracing::warn!(%error, "no scratch filesystem for the pod");
            None
        }
    };

    let headers = req.headers();
    let upgrade = headers
        .get(header::UPGRADE)
        .and_then(|v| v.to_str().ok())
        .unwrap_or("");
    if upgrade.to_ascii_lowercase().starts_with("spdy") {
        return Err(ApiError::bad_request(
            "SPDY is not supported by the sample apiserver; exec needs a WebSocket client (kubectl >= 1.30)",
        ));
    }
    if !upgrade.eq_ignore_ascii_case("websocket")
        || !header_has_token(headers, header::CONNECTION, "upgrade")
    {
        return Err(ApiError::bad_request("Upgrade request required"));
    }
    if headers
        .get(header::SEC_WEBSOCKET_VERSION)
        .and_then(|v| v.to_str().ok())
        != Some("13")
    {
        return Err(ApiError::bad_request(
            "unsupported WebSocket version (want 13)",
        ));
    }
    let key = headers
        .get(header::SEC_WEBSOCKET_KEY)
        .ok_or_else(|| ApiError::bad_request("missing Sec-WebSocket-Key"))?;
    let accept = tokio_tungstenite::tungstenite::handshake::derive_accept_key(key.as_bytes());
    let protocol = negotiate(headers)?;

    let on_upgrade = hyper::upgrade::on(&mut req);
    let shutdown = shared.shutdown.clone();
    shared.tracker.spawn(async move {
        let upgraded = match on_upgrade.await {
            Ok(upgraded) => upgraded,
            Err(error) => {
                tracing::debug!(%error, "exec upgrade failed");
                return;
            }
        };
        let ws = WebSocketStream::from_raw_socket(TokioIo::new(upgraded), Role::Server, None).await;
        tracing::debug!(pod = %exec.pod, command = ?exec.command, protocol = protocol.name(), "exec session");
        tokio::select! {
            _ = shutdown.cancelled() => {}
            _ = session(ws, protocol, exec) => {}
        }
    });

    let mut response = Response::new(Body::empty());
    *response.status_mut() = StatusCode::SWITCHING_PROTOCOLS;
    let h = response.headers_mut();
    h.insert(header::UPGRADE, HeaderValue::from_static("websocket"));
    h.insert(header::CONNECTION, HeaderValue::from_static("Upgrade"));
    if let Ok(v) = HeaderValue::from_str(&accept) {
        h.insert(header::SEC_WEBSOCKET_ACCEPT, v);
    }
    h.insert(
        header::SEC_WEBSOCKET_PROTOCOL,
        HeaderValue::from_static(protocol.name()),
    );
    Ok(response)
}

/// How a command ended.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Exit {
    Code(i32),
    /// The executable does not exist (exit 127 with this message).
    NotFound(String),
}

/// The status written on channel 3.
fn exit_status(command: &[String], exit: &Exit) -> Value {
    let (code, cause) = match exit {
        Exit::Code(0) => return json!({"metadata": {}, "status": "Success"}),
        Exit::Code(code) => (
            *code,
            format!(
                "error executing command [{}], exit code {code}",
                command.join(" ")
            ),
        ),
        Exit::NotFound(message) => (127, message.clone()),
    };
    json!({
        "metadata": {},
        "status": "Failure",
        "message": format!("command terminated with non-zero exit code: {cause}"),
        "reason": "NonZeroExitCode",
        "details": {"causes": [{"reason": "ExitCode", "message": code.to_string()}]},
    })
}

type Ws = WebSocketStream<TokioIo<hyper::upgrade::Upgraded>>;

/// How long the sample takes to start a command, as a container runtime does (runc exec takes tens of
/// milliseconds). Nothing is written to the socket before then, and that matters to kubectl: client-go reads the
/// socket in one goroutine and creates its channels in another, and a message that arrives before its channel
/// exists is dropped ("Unknown stream id 3, discarding message"). A command that ends at once would otherwise lose
/// its status, and if the close frame also came first, the exec fails; `kubectl cp` then takes a directory for a
/// file ("tar: tmp: Cannot open: File exists").
const RUNTIME_START: Duration = Duration::from_millis(100);

async fn session(mut ws: Ws, protocol: Protocol, exec: ExecRequest) {
    tokio::time::sleep(RUNTIME_START).await;
    let (stdin_tx, stdin_rx) = mpsc::channel::<Bytes>(16);
    let (out_tx, mut out_rx) = mpsc::channel::<(u8, Bytes)>(16);
    let mut stdin_tx = exec.stdin.then_some(stdin_tx);
    let io = Io {
        stdin: stdin_rx,
        out: out_tx,
        exec: exec.clone(),
        stdout_to_stderr: false,
        depth: 0,
    };
    let program = run_program(exec.command.clone(), io);
    tokio::pin!(program);
    let mut exit = None;
    let mut pending: Option<Bytes> = None;

    while exit.is_none() {
        let permit_tx = stdin_tx.clone();
        tokio::select! {
            code = &mut program => exit = Some(code),
            Some((channel, data)) = out_rx.recv() => {
                if send(&mut ws, channel, &data).await.is_err() {
                    return;
                }
            }
            // Stdin is handed over one message at a time; while the program is not reading, the socket is not
            // read either (backpressure) but output keeps flowing, so nothing deadlocks.
            permit = async move { permit_tx?.reserve_owned().await.ok() }, if pending.is_some() => {
                let closed = match permit {
                    Some(permit) => {
                        if let Some(data) = pending.take() {
                            permit.send(data);
                        }
                        false
                    }
                    None => true,
                };
                if closed {
                    stdin_tx = None;
                    pending = None;
                }
            }
            message = ws.next(), if pending.is_none() => match message {
                Some(Ok(Message::Binary(data))) => match (data.first().copied(), protocol) {
                    (Some(STDIN), _) if data.len() > 1 && stdin_tx.is_some() => pending = Some(data.slice(1..)),
                    (Some(CLOSE), Protocol::V5) if data.get(1) == Some(&STDIN) => stdin_tx = None,
                    (Some(RESIZE), _) => {}
                    _ => {}
                },
                Some(Ok(Message::Close(_))) | None | Some(Err(_)) => return,
                Some(Ok(_)) => {}
            },
        }
    }
    // The program is done and has dropped its sender: flush what it wrote, then the status, then close.
    while let Some((channel, data)) = out_rx.recv().await {
        if send(&mut ws, channel, &data).await.is_err() {
            return;
        }
    }
    let status = exit
        .map(|e| exit_status(&exec.command, &e))
        .unwrap_or(Value::Null);
    if send(&mut ws, ERROR, status.to_string().as_bytes())
        .await
        .is_err()
    {
        return;
    }
    // A normal closure reads as end-of-stream on every channel in client-go; "no status" (1005) reads as an error.
    let _ = ws
        .close(Some(CloseFrame {
            code: CloseCode::Normal,
            reason: "".into(),
        }))
        .await;
    // Let the client see the close frame before the connection drops, but do not wait on it forever.
    let _ = tokio::time::timeout(Duration::from_secs(5), async {
        while let Some(Ok(_)) = ws.next().await {}
    })
    .await;
}

async fn send(
    ws: &mut Ws,
    channel: u8,
    data: &[u8],
) -> Result<(), tokio_tungstenite::tungstenite::Error> {
    let mut frame = Vec::with_capacity(data.len() + 1);
    frame.push(channel);
    frame.extend_from_slice(data);
    ws.send(Message::Binary(Bytes::from(frame))).await
}

/// A running command's view of the session.
struct Io {
    stdin: mpsc::Receiver<Bytes>,
    out: mpsc::Sender<(u8, Bytes)>,
    exec: ExecRequest,
    /// `>&2` in a shell command: stdout goes to stderr.
    stdout_to_stderr: bool,
    /// How many shells deep we are (bounded: each level is a nested future).
    depth: usize,
}

/// The session is gone; stop.
struct Hangup;

impl Io {
    async fn write(&self, channel: u8, text: &str) -> Result<(), Hangup> {
        let channel = if self.stdout_to_stderr {
            STDERR
        } else {
            channel
        };
        let wanted = match channel {
            STDOUT => self.exec.stdout,
            _ => self.exec.stderr || self.exec.tty,
        };
        if !wanted || text.is_empty() {
            return Ok(());
        }
        // With a TTY there is one output stream, and the terminal wants CRLF.
        let (channel, text) = if self.exec.tty {
            (STDOUT, text.replace("\r\n", "\n").replace('\n', "\r\n"))
        } else {
            (channel, text.to_string())
        };
        self.out
            .send((channel, Bytes::from(text)))
            .await
            .map_err(|_| Hangup)
    }

    async fn stdout(&self, text: &str) -> Result<(), Hangup> {
        self.write(STDOUT, text).await
    }

    async fn stderr(&self, text: &str) -> Result<(), Hangup> {
        self.write(STDERR, text).await
    }
}

async fn run_program(argv: Vec<String>, mut io: Io) -> Exit {
    run(&argv, &mut io, false).await.unwrap_or(Exit::Code(137))
}

/// How deeply shells may nest (`sh` run from `sh`).
const MAX_SHELL_DEPTH: usize = 8;

/// The base name of a program path: `/bin/sh` → `sh`.
fn base(program: &str) -> &str {
    program.rsplit('/').next().unwrap_or(program)
}

fn env_lines(exec: &ExecRequest) -> String {
    let mut env = vec![
        "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin".to_string(),
        format!("HOSTNAME={}", exec.pod),
        "HOME=/root".into(),
        "KUBERNETES_SERVICE_HOST=10.96.0.1".into(),
        "KUBERNETES_SERVICE_PORT=443".into(),
    ];
    if exec.tty {
        env.push("TERM=xterm".into());
    }
    env.iter().map(|l| format!("{l}\n")).collect()
}

fn file(path: &str, exec: &ExecRequest) -> Option<String> {
    match path {
        "/etc/hostname" => Some(format!("{}\n", exec.pod)),
        "/etc/os-release" => {
            Some("NAME=\"Tether Sample OS\"\nID=tether-sample\nVERSION_ID=1.0\n".into())
        }
        _ => None,
    }
}

/// Runs one command. `in_shell`: called from `sh`, which reports unknown commands itself (exit 127).
fn run<'a>(
    argv: &'a [String],
    io: &'a mut Io,
    in_shell: bool,
) -> std::pin::Pin<Box<dyn std::future::Future<Output = Result<Exit, Hangup>> + Send + 'a>> {
    Box::pin(async move {
        let Some(program) = argv.first() else {
            return Ok(Exit::Code(0));
        };
        let args = &argv[1..];
        match base(program) {
            "cat" if args.is_empty() || args == ["-"] => {
                while let Some(data) = io.stdin.recv().await {
                    let channel = if io.stdout_to_stderr { STDERR } else { STDOUT };
                    if io.exec.stdout || channel == STDERR {
                        io.out.send((channel, data)).await.map_err(|_| Hangup)?;
                    }
                }
                Ok(Exit::Code(0))
            }
            "cat" => {
                let mut code = 0;
                for path in args {
                    match file(path, &io.exec) {
                        Some(text) => io.stdout(&text).await?,
                        None => {
                            io.stderr(&format!("cat: {path}: No such file or directory\n"))
                                .await?;
                            code = 1;
                        }
                    }
                }
                Ok(Exit::Code(code))
            }
            "echo" => {
                let (newline, words) = match args.first().map(String::as_str) {
                    Some("-n") => (false, &args[1..]),
                    _ => (true, args),
                };
                let mut text = words.join(" ");
                if newline {
                    text.push('\n');
                }
                io.stdout(&text).await?;
                Ok(Exit::Code(0))
            }
            "tar" => tar(args, io).await,
            "test" | "[" => {
                let args: Vec<String> = args.iter().filter(|a| *a != "]").cloned().collect();
                let code = match &io.exec.root {
                    Some(root) => crate::podfs::test(root, &args),
                    None => 1,
                };
                Ok(Exit::Code(code))
            }
            "true" => Ok(Exit::Code(0)),
            "false" => Ok(Exit::Code(1)),
            "env" | "printenv" => {
                io.stdout(&env_lines(&io.exec)).await?;
                Ok(Exit::Code(0))
            }
            "hostname" => {
                io.stdout(&format!("{}\n", io.exec.pod)).await?;
                Ok(Exit::Code(0))
            }
            "pwd" => io.stdout("/\n").await.map(|_| Exit::Code(0)),
            "whoami" => io.stdout("root\n").await.map(|_| Exit::Code(0)),
            "uname" => io.stdout("Linux\n").await.map(|_| Exit::Code(0)),
            "sleep" => match args
                .first()
                .and_then(|s| s.parse::<f64>().ok())
                .filter(|s| s.is_finite() && *s >= 0.0)
            {
                Some(secs) => {
                    tokio::time::sleep(Duration::from_secs_f64(secs.min(86_400.0))).await;
                    Ok(Exit::Code(0))
                }
                None => {
                    io.stderr("sleep: invalid time interval\n").await?;
                    Ok(Exit::Code(1))
                }
            },
            "sh" | "bash" if io.depth >= MAX_SHELL_DEPTH => {
                io.stderr("sh: too many nested shells\n").await?;
                Ok(Exit::Code(2))
            }
            "sh" | "bash" => {
                io.depth += 1;
                let exit = shell(args, io).await;
                io.depth -= 1;
                exit
            }
            other => {
                if in_shell {
                    io.stderr(&format!("sh: 1: {other}: not found\n")).await?;
                    return Ok(Exit::Code(127));
                }
                Ok(Exit::NotFound(format!(
                    "exec: \"{program}\": executable file not found in $PATH"
                )))
            }
        }
    })
}

/// `tar` in the pod's scratch filesystem: the real GNU tar with checked arguments ([`crate::podfs`]); stdin and
/// stdout are the session's, as `kubectl cp` needs.
async fn tar(args: &[String], io: &mut Io) -> Result<Exit, Hangup> {
    use std::process::Stdio;
    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
    let Some(root) = io.exec.root.clone() else {
        io.stderr("tar: the pod has no filesystem\n").await?;
        return Ok(Exit::Code(2));
    };
    let argv = match crate::podfs::tar_args(&root, args) {
        Ok(argv) => argv,
        Err(message) => {
            io.stderr(&format!("tar: {message}\n")).await?;
            return Ok(Exit::Code(2));
        }
    };
    let child = tokio::process::Command::new("tar")
        .args(&argv)
        .current_dir(&root)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true)
        .spawn();
    let mut child = match child {
        Ok(child) => child,
        Err(error) => {
            io.stderr(&format!(
                "tar: cannot run tar on the sample apiserver's machine: {error}\n"
            ))
            .await?;
            return Ok(Exit::NotFound(
                "exec: \"tar\": executable file not found in $PATH".into(),
            ));
        }
    };
    let (Some(mut stdin), Some(stdout), Some(stderr)) =
        (child.stdin.take(), child.stdout.take(), child.stderr.take())
    else {
        return Ok(Exit::Code(2));
    };
    let Io {
        stdin: input,
        out,
        exec,
        ..
    } = io;
    let feed = async {
        while let Some(data) = input.recv().await {
            if stdin.write_all(&data).await.is_err() {
                break;
            }
        }
        drop(stdin);
    };
    let pump = |channel: u8, wanted: bool| {
        let out = out.clone();
        move |mut reader: Box<dyn tokio::io::AsyncRead + Send + Unpin>| async move {
            let mut buf = vec![0u8; 32 * 1024];
            loop {
                match reader.read(&mut buf).await {
                    Ok(0) | Err(_) => return Ok(()),
                    Ok(n) if wanted => {
                        out.send((channel, Bytes::copy_from_slice(&buf[..n])))
                            .await
                            .map_err(|_| Hangup)?;
                    }
                    Ok(_) => {}
                }
            }
        }
    };
    let to_stdout = pump(STDOUT, exec.stdout)(Box::new(stdout));
    let to_stderr = pump(
        if exec.tty { STDOUT } else { STDERR },
        exec.stderr || exec.tty,
    )(Box::new(stderr));
    let (_, sent_out, sent_err) = tokio::join!(feed, to_stdout, to_stderr);
    sent_out?;
    sent_err?;
    let status = child.wait().await.ok().and_then(|s| s.code()).unwrap_or(2);
    Ok(Exit::Code(status))
}

/// Splits a command line into words: whitespace-separated, with single and double quotes.
fn words(line: &str) -> Vec<String> {
    let mut words = Vec::new();
    let mut current = String::new();
    let mut in_word = false;
    let mut quote: Option<char> = None;
    for c in line.chars() {
        match (quote, c) {
            (Some(q), c) if c == q => quote = None,
            (Some(_), c) => current.push(c),
            (None, '\'' | '"') => {
                quote = Some(c);
                in_word = true;
            }
            (None, c) if c.is_whitespace() => {
                if in_word {
                    words.push(std::mem::take(&mut current));
                    in_word = false;
                }
            }
            (None, c) => {
                current.push(c);
                in_word = true;
            }
        }
    }
    if in_word {
        words.push(current);
    }
    words
}

/// Runs a script: commands separated by `;`, `&&` (stop at the first failure) or newlines; `exit N` ends it.
/// Returns the exit of the last command, and whether the script asked to exit.
async fn script(text: &str, io: &mut Io) -> Result<(Exit, bool), Hangup> {
    let mut last = Exit::Code(0);
    for line in text.split(['\n', ';']) {
        for (i, part) in line.split("&&").enumerate() {
            if i > 0 && last != Exit::Code(0) {
                break;
            }
            let argv = words(part);
            match argv.first().map(String::as_str) {
                None => continue,
                Some("exit") => {
                    let code = match argv.get(1) {
                        None => match last {
                            Exit::Code(c) => c,
                            Exit::NotFound(_) => 127,
                        },
                        Some(n) => n.parse::<i32>().map(|n| n & 0xff).unwrap_or(2),
                    };
                    return Ok((Exit::Code(code), true));
                }
                Some(_) => {
                    let mut argv = argv;
                    let redirect = argv.last().is_some_and(|w| w == ">&2" || w == "1>&2");
                    if redirect {
                        argv.pop();
                    }
                    io.stdout_to_stderr = redirect;
                    last = run(&argv, io, true).await?;
                    io.stdout_to_stderr = false;
                }
            }
        }
    }
    Ok((last, false))
}

async fn shell(args: &[String], io: &mut Io) -> Result<Exit, Hangup> {
    match args.first().map(String::as_str) {
        Some("-c") => {
            let text = args.get(1).cloned().unwrap_or_default();
            Ok(script(&text, io).await?.0)
        }
        Some(other) => {
            io.stderr(&format!("sh: 0: cannot open {other}: No such file\n"))
                .await?;
            Ok(Exit::Code(2))
        }
        None if io.exec.tty => interactive(io).await,
        None => {
            // Commands from stdin, one per line, until stdin closes.
            let mut buffer = String::new();
            let mut last = Exit::Code(0);
            while let Some(data) = io.stdin.recv().await {
                buffer.push_str(&String::from_utf8_lossy(&data));
                while let Some(end) = buffer.find('\n') {
                    let line: String = buffer.drain(..=end).collect();
                    let (exit, stop) = script(&line, io).await?;
                    if stop {
                        return Ok(exit);
                    }
                    last = exit;
                }
            }
            if !buffer.trim().is_empty() {
                last = script(&buffer, io).await?.0;
            }
            Ok(last)
        }
    }
}

/// An interactive shell on a TTY: echo, backspace, Ctrl-C (drop the line), Ctrl-D (exit on an empty line).
async fn interactive(io: &mut Io) -> Result<Exit, Hangup> {
    const PROMPT: &str = "# ";
    io.stdout(PROMPT).await?;
    let mut line = String::new();
    let mut last = Exit::Code(0);
    while let Some(data) = io.stdin.recv().await {
        for c in String::from_utf8_lossy(&data).chars() {
            match c {
                '\r' | '\n' => {
                    io.stdout("\n").await?;
                    let (exit, stop) = script(&std::mem::take(&mut line), io).await?;
                    if stop {
                        return Ok(exit);
                    }
                    last = exit;
                    io.stdout(PROMPT).await?;
                }
                '\u{7f}' | '\u{8}' if line.pop().is_some() => io.stdout("\u{8} \u{8}").await?,
                '\u{3}' => {
                    line.clear();
                    io.stdout("^C\n").await?;
                    io.stdout(PROMPT).await?;
                }
                '\u{4}' if line.is_empty() => {
                    io.stdout("\n").await?;
                    return Ok(last);
                }
                c if !c.is_control() => {
                    line.push(c);
                    io.stdout(&c.to_string()).await?;
                }
                _ => {}
            }
        }
    }
    Ok(last)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn request(command: &[&str], stdin: bool, tty: bool) -> ExecRequest {
        ExecRequest {
            command: command.iter().map(|s| s.to_string()).collect(),
            stdin,
            stdout: true,
            stderr: !tty,
            tty,
            pod: "demo".into(),
            root: None,
        }
    }

    /// Runs a command with `input` on stdin; returns (stdout, stderr, exit).
    async fn exec(command: &[&str], input: &[&str], tty: bool) -> (String, String, Exit) {
        let (stdin_tx, stdin_rx) = mpsc::channel(16);
        let (out_tx, mut out_rx) = mpsc::channel(1024);
        let chunks: Vec<Bytes> = input.iter().map(|c| Bytes::from(c.to_string())).collect();
        tokio::spawn(async move {
            for chunk in chunks {
                let _ = stdin_tx.send(chunk).await;
            }
        });
        let req = request(command, true, tty);
        let exit = run_program(
            req.command.clone(),
            Io {
                stdin: stdin_rx,
                out: out_tx,
                exec: req,
                stdout_to_stderr: false,
                depth: 0,
            },
        )
        .await;
        let (mut out, mut err) = (String::new(), String::new());
        while let Some((channel, data)) = out_rx.recv().await {
            let text = String::from_utf8_lossy(&data).into_owned();
            if channel == STDOUT {
                out.push_str(&text)
            } else {
                err.push_str(&text)
            }
        }
        (out, err, exit)
    }

    #[tokio::test]
    async fn builtins_behave_like_a_shell() {
        assert_eq!(
            exec(&["cat"], &["hi\n", "there\n"], false).await,
            ("hi\nthere\n".into(), String::new(), Exit::Code(0))
        );
        assert_eq!(exec(&["echo", "a", "b"], &[], false).await.0, "a b\n");
        assert_eq!(exec(&["/bin/echo", "-n", "x"], &[], false).await.0, "x");
        assert_eq!(
            exec(&["sh", "-c", "exit 3"], &[], false).await.2,
            Exit::Code(3)
        );
        assert_eq!(exec(&["false"], &[], false).await.2, Exit::Code(1));
        assert_eq!(exec(&["hostname"], &[], false).await.0, "demo\n");
        assert!(
            exec(&["env"], &[], false)
                .await
                .0
                .contains("HOSTNAME=demo\n")
        );
        assert_eq!(
            exec(
                &["sh", "-c", "echo 'a  b'; false && echo no; echo yes"],
                &[],
                false
            )
            .await
            .0,
            "a  b\nyes\n"
        );
        assert_eq!(
            exec(&["sh", "-c", "echo out; echo err >&2"], &[], false).await,
            ("out\n".into(), "err\n".into(), Exit::Code(0))
        );
        let (_, err, exit) = exec(&["sh", "-c", "nosuch"], &[], false).await;
        assert_eq!(
            (err.as_str(), exit),
            ("sh: 1: nosuch: not found\n", Exit::Code(127))
        );
        assert!(matches!(
            exec(&["nosuch"], &[], false).await.2,
            Exit::NotFound(_)
        ));
        assert_eq!(
            exec(&["sh"], &["echo one\n", "exit 4\n", "echo never\n"], false).await,
            ("one\n".into(), String::new(), Exit::Code(4))
        );
        let (_, err, exit) = exec(&["sh"], &["sh\n"; 20], false).await;
        // The outer shell and seven nested ones reach the limit; the other 13 lines are refused.
        assert_eq!(err, "sh: too many nested shells\n".repeat(13));
        assert_eq!(exit, Exit::Code(2));
        let (out, _, exit) = exec(&["sh"], &["echo hi\r", "exit 0\r"], true).await;
        assert_eq!(exit, Exit::Code(0));
        assert!(out.contains("echo hi\r\nhi\r\n# "), "{out:?}");
    }

    #[test]
    fn statuses_carry_the_exit_code() {
        let cmd = vec!["sh".to_string(), "-c".into(), "exit 3".into()];
        assert_eq!(
            exit_status(&cmd, &Exit::Code(0)),
            json!({"metadata": {}, "status": "Success"})
        );
        let failed = exit_status(&cmd, &Exit::Code(3));
        assert_eq!(failed["reason"], "NonZeroExitCode");
        assert_eq!(
            failed["details"]["causes"][0],
            json!({"reason": "ExitCode", "message": "3"})
        );
        assert_eq!(
            exit_status(&cmd, &Exit::NotFound("x".into()))["details"]["causes"][0]["message"],
            "127"
        );
    }

    #[test]
    fn request_checks_and_negotiation() {
        let q = |pairs: &[(&str, &str)]| {
            pairs
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect::<Vec<_>>()
        };
        assert!(parse(&q(&[("stdout", "true")]), "p").is_err());
        assert!(parse(&q(&[("command", "ls")]), "p").is_err());
        assert!(
            parse(
                &q(&[("command", "ls"), ("tty", "true"), ("stderr", "true")]),
                "p"
            )
            .is_err()
        );
        assert!(parse(&q(&[("command", "ls"), ("stdout", "true")]), "p").is_ok());
        let mut h = http::HeaderMap::new();
        h.insert(
            header::SEC_WEBSOCKET_PROTOCOL,
            HeaderValue::from_static("v4.channel.k8s.io, v5.channel.k8s.io"),
        );
        assert_eq!(negotiate(&h), Ok(Protocol::V5));
        h.insert(
            header::SEC_WEBSOCKET_PROTOCOL,
            HeaderValue::from_static("v4.channel.k8s.io"),
        );
        assert_eq!(negotiate(&h), Ok(Protocol::V4));
        h.insert(
            header::SEC_WEBSOCKET_PROTOCOL,
            HeaderValue::from_static("channel.k8s.io"),
        );
        assert!(negotiate(&h).is_err());
    }

    #[test]
    fn words_split_like_sh() {
        assert_eq!(words(" echo 'a b'  \"c\"d "), vec!["echo", "a b", "cd"]);
        assert_eq!(words("''"), vec![""]);
        assert!(words("   ").is_empty());
    }
}
