//! What an operator watches, against the real binary: the metrics the packaged alert rules
//! and dashboard use are really exported, labelled counters exist from start-up at zero,
//! systemd hears READY=1 and STOPPING=1, and the logs (text or JSON) have a line per
//! session end and per request at debug without ever carrying a whole session id or a token,
//! and the server runs without transparent huge pages.
//!
//! Every wait here is a bound on a poll (the server is up, a datagram came), never a timing
//! assertion.

use std::collections::BTreeSet;
use std::io::{Read, Write};
use std::net::TcpStream;
use std::os::unix::net::UnixDatagram;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

const READY_TIMEOUT: Duration = Duration::from_secs(30);

struct Server {
    child: Child,
    port: u16,
    log: PathBuf,
}

impl Server {
    /// Starts `leasehold serve` on a free port with `extra` flags, stderr into `log`, and
    /// `NOTIFY_SOCKET` pointing at `notify` when given; waits (bounded) for /readyz.
    fn start(dir: &Path, log: &Path, notify: Option<&Path>, extra: &[&str]) -> Server {
        let stderr = || Stdio::from(std::fs::File::create(log).unwrap());
        let early_log = || std::fs::read_to_string(log).unwrap_or_default();
        let mut server = Server::launch(dir, stderr, early_log, notify, extra);
        server.log = log.to_path_buf();
        server
    }

    /// As [`Server::start`] without a notify socket, with stderr a pipe: the server writes
    /// into it, the test reads the other end (or does not) through the returned reader.
    fn start_piped(dir: &Path, extra: &[&str]) -> (Server, std::io::PipeReader) {
        let reader = std::cell::RefCell::new(None);
        let stderr = || {
            let (r, w) = std::io::pipe().unwrap();
            *reader.borrow_mut() = Some(r);
            Stdio::from(w)
        };
        let early_log = || {
            let mut text = String::new();
            let _ = reader
                .borrow_mut()
                .as_mut()
                .unwrap()
                .read_to_string(&mut text);
            text
        };
        let server = Server::launch(dir, stderr, early_log, None, extra);
        let reader = reader.into_inner().unwrap();
        (server, reader)
    }

    /// Spawns the server with `stderr()` until it gets a free port; `early_log()` is what it
    /// wrote if it exited before answering /readyz.
    fn launch(
        dir: &Path,
        stderr: impl Fn() -> Stdio,
        early_log: impl Fn() -> String,
        notify: Option<&Path>,
        extra: &[&str],
    ) -> Server {
        for _ in 0..20 {
            let port = {
                let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
                l.local_addr().unwrap().port()
            };
            let mut cmd = Command::new(env!("CARGO_BIN_EXE_leasehold"));
            cmd.arg("serve")
                .arg("--listen")
                .arg(format!("127.0.0.1:{port}"))
                .arg("--data-dir")
                .arg(dir.join("data"))
                .args(["--cache-size-bytes", "4194304"])
                .args(extra)
                .stdin(Stdio::null())
                .stdout(Stdio::null())
                .stderr(stderr())
                .env_remove("NOTIFY_SOCKET");
            for (name, _) in std::env::vars_os() {
                if name.to_string_lossy().starts_with("LEASEHOLD_") {
                    cmd.env_remove(name);
                }
            }
            if let Some(path) = notify {
                cmd.env("NOTIFY_SOCKET", path);
            }
            // `cmd` holds the parent's copy of a pipe's write end: dropped with it below, so
            // that the reader sees the end of the stream when the server exits.
            let child = cmd.spawn().expect("spawn leasehold serve");
            drop(cmd);
            let mut server = Server {
                child,
                port,
                log: PathBuf::new(),
            };
            let deadline = Instant::now() + READY_TIMEOUT;
            loop {
                if let Some(status) = server.child.try_wait().unwrap() {
                    let text = early_log();
                    if text.contains("cannot listen") {
                        break;
                    }
                    panic!("leasehold serve exited with {status}:\n{text}");
                }
                if matches!(server.request("GET", "/readyz", None), Ok((200, _))) {
                    return server;
                }
                assert!(Instant::now() < deadline, "not ready in {READY_TIMEOUT:?}");
                std::thread::sleep(Duration::from_millis(20));
            }
        }
        panic!("found no free port in 20 attempts");
    }

    /// One HTTP/1.1 request on its own connection: (status, body).
    fn request(
        &self,
        method: &str,
        path: &str,
        body: Option<&str>,
    ) -> std::io::Result<(u16, String)> {
        let mut s = TcpStream::connect(("127.0.0.1", self.port))?;
        s.set_read_timeout(Some(Duration::from_secs(10)))?;
        let body = body.unwrap_or("");
        write!(
            s,
            "{method} {path} HTTP/1.1\r\nHost: test\r\nConnection: close\r\n\
             Content-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
            body.len()
        )?;
        let mut raw = String::new();
        s.read_to_string(&mut raw)?;
        let status = raw
            .split(' ')
            .nth(1)
            .and_then(|c| c.parse().ok())
            .unwrap_or(0);
        let (head, rest) = raw.split_once("\r\n\r\n").unwrap_or((&raw, ""));
        let body = if head
            .to_ascii_lowercase()
            .contains("transfer-encoding: chunked")
        {
            dechunk(rest)
        } else {
            rest.to_string()
        };
        Ok((status, body))
    }

    fn ok(&self, method: &str, path: &str, body: Option<&str>) -> serde_json::Value {
        let (status, text) = self.request(method, path, body).unwrap();
        assert!(
            (200..300).contains(&status),
            "{method} {path}: {status} {text}"
        );
        serde_json::from_str(&text).unwrap_or(serde_json::Value::Null)
    }

    fn metrics(&self) -> String {
        let (status, text) = self.request("GET", "/metrics", None).unwrap();
        assert_eq!(status, 200, "{text}");
        text
    }

    /// Sends the server a signal (`kill`'s spelling, such as `-STOP`).
    fn signal(&self, signal: &str) {
        let ok = Command::new("kill")
            .args([signal, &self.child.id().to_string()])
            .status()
            .unwrap();
        assert!(ok.success(), "kill {signal}");
    }

    /// SIGTERM, then the exit status (bounded wait) and the log file.
    fn stop(self) -> (ExitStatus, String) {
        let log = self.log.clone();
        let status = self.terminate();
        (status, std::fs::read_to_string(log).unwrap())
    }

    /// SIGTERM, then the exit status (bounded wait).
    fn terminate(mut self) -> ExitStatus {
        self.signal("-TERM");
        let deadline = Instant::now() + READY_TIMEOUT;
        loop {
            if let Some(status) = self.child.try_wait().unwrap() {
                return status;
            }
            assert!(Instant::now() < deadline, "no exit after SIGTERM");
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn dechunk(mut rest: &str) -> String {
    let mut out = String::new();
    while let Some((size, tail)) = rest.split_once("\r\n") {
        let n = usize::from_str_radix(size.trim(), 16).unwrap_or(0);
        if n == 0 {
            break;
        }
        out.push_str(&tail[..n]);
        rest = &tail[n + 2..];
    }
    out
}

/// Every sample name and every `# TYPE` name in an exposition.
fn exported(text: &str) -> BTreeSet<String> {
    let mut names = BTreeSet::new();
    for line in text.lines() {
        if let Some(rest) = line.strip_prefix("# TYPE ") {
            names.insert(rest.split(' ').next().unwrap().to_string());
        } else if !line.starts_with('#') && !line.is_empty() {
            let end = line.find(['{', ' ']).unwrap_or(line.len());
            names.insert(line[..end].to_string());
        }
    }
    names
}

/// Every `leasehold_…` name in a file.
fn names_in(path: &Path) -> BTreeSet<String> {
    let text = std::fs::read_to_string(path).unwrap();
    let mut names = BTreeSet::new();
    let mut rest = text.as_str();
    while let Some(i) = rest.find("leasehold_") {
        let tail = &rest[i..];
        let end = tail
            .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
            .unwrap_or(tail.len());
        names.insert(tail[..end].to_string());
        rest = &tail[end..];
    }
    names
}

/// The counters of the metrics table in docs/operations.md whose label values are listed
/// (`reason` = `closed` \| `expired` \| `admin`): (metric, label, values).
fn documented_labelled_counters() -> Vec<(String, String, Vec<String>)> {
    let doc = std::fs::read_to_string(manifest().join("docs/operations.md")).unwrap();
    let mut out = Vec::new();
    for row in doc.lines().filter(|l| l.starts_with("| `leasehold_")) {
        let cells: Vec<&str> = row.split(" | ").collect();
        if cells.len() < 3 || cells[1].trim() != "counter" {
            continue;
        }
        let name = cells[0]
            .trim_start_matches("| ")
            .trim_matches('`')
            .to_string();
        let labels = cells[2];
        let Some((label, values)) = labels.split_once("` = ") else {
            continue;
        };
        let values: Vec<String> = values
            .split("\\|")
            .map(|v| v.trim().trim_matches('`').to_string())
            .collect();
        out.push((name, label.trim_matches('`').to_string(), values));
    }
    out
}

fn manifest() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

fn notify_socket(dir: &Path) -> (PathBuf, UnixDatagram) {
    let path = dir.join("notify");
    let sock = UnixDatagram::bind(&path).unwrap();
    sock.set_read_timeout(Some(READY_TIMEOUT)).unwrap();
    (path, sock)
}

fn recv(sock: &UnixDatagram) -> String {
    let mut buf = [0u8; 256];
    let n = sock
        .recv(&mut buf)
        .expect("a notification within the bound");
    String::from_utf8_lossy(&buf[..n]).into_owned()
}

#[test]
fn every_metric_the_rules_and_dashboard_use_is_exported() {
    let dir = tempfile::tempdir().unwrap();
    let (notify, sock) = notify_socket(dir.path());
    let server = Server::start(dir.path(), &dir.path().join("log"), Some(&notify), &[]);
    assert_eq!(recv(&sock), "READY=1");

    // From start-up, before anything happened: every documented labelled counter, at zero.
    let first = server.metrics();
    let documented = documented_labelled_counters();
    assert!(
        documented
            .iter()
            .any(|(n, _, _)| n == "leasehold_sessions_ended_total"),
        "the metrics table in docs/operations.md was not read: {documented:?}"
    );
    for (name, label, values) in &documented {
        for v in values {
            let line = format!("{name}{{{label}=\"{v}\"}} 0");
            assert!(
                first.lines().any(|l| l == line),
                "{line} missing at start-up:\n{first}"
            );
        }
    }
    assert!(first.lines().any(|l| l == "leasehold_ready 1"), "{first}");

    // Per-pool, per-queue and per-route series exist once there is a pool, a queue and a
    // request to report on (the first scrape was one).
    server.ok("PUT", "/v1/pools/licences", Some(r#"{"capacity":2}"#));
    server.ok(
        "POST",
        "/v1/queues/reports/jobs",
        Some(r#"{"payload":null}"#),
    );
    let names = exported(&server.metrics());
    let mut missing = Vec::new();
    for file in [
        "packaging/monitoring/leasehold-rules.yml",
        "packaging/monitoring/leasehold-dashboard.json",
    ] {
        let used = names_in(&manifest().join(file));
        assert!(used.len() > 5, "{file}: only {used:?}");
        for name in used {
            if !names.contains(&name) {
                missing.push(format!("{file}: {name}"));
            }
        }
    }
    assert!(missing.is_empty(), "not exported: {missing:?}\n{names:?}");

    let (status, _) = server.stop();
    assert!(status.success(), "{status}");
    assert_eq!(recv(&sock), "STOPPING=1");
}

/// Opens a session, takes a lock, closes the session; returns the session id.
fn session_with_a_lock(server: &Server) -> String {
    let opened = server.ok("POST", "/v1/sessions", Some(r#"{"owner":"monitoring"}"#));
    let sid = opened["session_id"].as_str().unwrap().to_string();
    let body = format!(r#"{{"session_id":"{sid}"}}"#);
    let grant = server.ok("POST", "/v1/locks/monitoring/acquire", Some(&body));
    assert!(grant["token"].as_u64().is_some(), "{grant}");
    server.ok("DELETE", &format!("/v1/sessions/{sid}"), None);
    sid
}

#[test]
fn json_logs_have_a_line_per_session_end_and_request_and_no_secret() {
    let dir = tempfile::tempdir().unwrap();
    let server = Server::start(
        dir.path(),
        &dir.path().join("log"),
        None,
        &["--log-format", "json", "--log-level", "debug"],
    );
    let sid = session_with_a_lock(&server);
    let (status, log) = server.stop();
    assert!(status.success(), "{status}\n{log}");

    let mut ended = Vec::new();
    let mut requests = Vec::new();
    for line in log.lines() {
        let v: serde_json::Value =
            serde_json::from_str(line).unwrap_or_else(|e| panic!("not JSON ({e}): {line}"));
        let fields = &v["fields"];
        for key in fields.as_object().unwrap().keys() {
            assert!(!key.contains("token"), "a token field in the log: {line}");
        }
        match fields["message"].as_str() {
            Some("session ended") => ended.push(v.clone()),
            Some("request") => requests.push(v.clone()),
            _ => {}
        }
    }
    assert!(
        !log.contains(&sid),
        "the whole session id is in the log:\n{log}"
    );
    assert_eq!(ended.len(), 1, "{log}");
    let e = &ended[0]["fields"];
    assert_eq!(e["reason"], "closed");
    assert_eq!(e["locks"], 1);
    assert_eq!(e["session"], &sid[..8]);
    assert_eq!(ended[0]["level"], "INFO");
    // Requests at debug, by route template: the path with the session id is never logged.
    let closes: Vec<_> = requests
        .iter()
        .filter(|r| r["fields"]["route"] == "/v1/sessions/{id}")
        .collect();
    assert_eq!(closes.len(), 1, "{log}");
    assert_eq!(closes[0]["level"], "DEBUG");
    assert_eq!(closes[0]["fields"]["method"], "DELETE");
}

#[test]
fn text_logs_at_info_leave_requests_out() {
    let dir = tempfile::tempdir().unwrap();
    let server = Server::start(
        dir.path(),
        &dir.path().join("log"),
        None,
        &["--log-format", "text", "--log-level", "info"],
    );
    let sid = session_with_a_lock(&server);
    let (status, log) = server.stop();
    assert!(status.success(), "{status}\n{log}");
    assert!(!log.contains(&sid), "{log}");
    assert!(!log.contains('\u{1b}'), "colour codes in the log: {log:?}");
    let ended: Vec<_> = log
        .lines()
        .filter(|l| l.contains("session ended"))
        .collect();
    assert_eq!(ended.len(), 1, "{log}");
    assert!(ended[0].contains("INFO"), "{}", ended[0]);
    assert!(ended[0].contains("reason=\"closed\"") || ended[0].contains("reason=closed"));
    assert!(!log.contains("DEBUG"), "{log}");
    assert!(log.lines().all(|l| !l.starts_with('{')), "{log}");
}

/// What the reaper ends is logged as one `reaped expired sessions` line per batch, not a line
/// per session: a storm of expiries at the default level writes a few lines, and they add up
/// to every session and lock it ended. A close still has its own line.
#[test]
fn the_reaper_logs_a_line_per_batch_not_per_session() {
    const SESSIONS: usize = 40;
    /// Far longer than opening the sessions takes, so that none lapses before the pause.
    const TTL_MS: u64 = 2_000;
    let dir = tempfile::tempdir().unwrap();
    let server = Server::start(
        dir.path(),
        &dir.path().join("log"),
        None,
        &["--log-format", "json", "--log-level", "info"],
    );
    for i in 0..SESSIONS {
        let opened = server.ok(
            "POST",
            "/v1/sessions",
            Some(&format!(r#"{{"owner":"storm","ttl_ms":{TTL_MS}}}"#)),
        );
        let sid = opened["session_id"].as_str().unwrap();
        let body = format!(r#"{{"session_id":"{sid}"}}"#);
        server.ok("POST", &format!("/v1/locks/storm-{i}/acquire"), Some(&body));
    }
    let closed = session_with_a_lock(&server);
    // Opened one after another, the sessions' deadlines are spread over the time that took,
    // and a reaper woken by each could end them one a pass. The server is paused past every
    // deadline instead, so that they are all due together when it resumes, as in a storm.
    server.signal("-STOP");
    std::thread::sleep(Duration::from_millis(TTL_MS + 300));
    server.signal("-CONT");
    // Nothing touches the lapsing sessions after their acquire, so only the reaper ends them.
    let expired = format!(r#"leasehold_sessions_ended_total{{reason="expired"}} {SESSIONS}"#);
    let deadline = Instant::now() + READY_TIMEOUT;
    while !server.metrics().contains(&expired) {
        assert!(
            Instant::now() < deadline,
            "not all expired:\n{}",
            server.metrics()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    let (status, log) = server.stop();
    assert!(status.success(), "{status}\n{log}");

    let (mut sessions, mut locks, mut lines) = (0, 0, 0);
    let mut ended = Vec::new();
    for line in log.lines() {
        let v: serde_json::Value =
            serde_json::from_str(line).unwrap_or_else(|e| panic!("not JSON ({e}): {line}"));
        let fields = &v["fields"];
        match fields["message"].as_str() {
            Some("reaped expired sessions") => {
                assert_eq!(v["level"], "INFO", "{line}");
                sessions += fields["sessions"].as_u64().unwrap();
                locks += fields["locks"].as_u64().unwrap();
                lines += 1;
            }
            Some("session ended") => ended.push(fields.clone()),
            _ => {}
        }
    }
    assert_eq!(
        (sessions, locks),
        (SESSIONS as u64, SESSIONS as u64),
        "{log}"
    );
    assert!(lines < SESSIONS, "a line per session:\n{log}");
    assert_eq!(ended.len(), 1, "{log}");
    assert_eq!(ended[0]["reason"], "closed");
    assert_eq!(ended[0]["session"], &closed[..8]);
}

/// A reader that stops taking the server's stderr (a stalled journal, a full pipe) holds up
/// no request: the lines wait in the log thread's queue instead of blocking the store writer
/// that logs each close, and once the reader is back every one of them arrives.
#[test]
fn a_stderr_nobody_reads_holds_up_no_request() {
    // A `session ended` line is about 200 bytes: the lines fill a pipe's 64 KiB several times.
    const CLOSES: usize = 1_500;
    let dir = tempfile::tempdir().unwrap();
    let (server, mut reader) =
        Server::start_piped(dir.path(), &["--log-format", "json", "--log-level", "info"]);
    for _ in 0..CLOSES {
        let opened = server.ok("POST", "/v1/sessions", Some(r#"{"owner":"unread"}"#));
        let sid = opened["session_id"].as_str().unwrap();
        // Each request has a 10 s read timeout: a writer blocked on stderr fails it here.
        server.ok("DELETE", &format!("/v1/sessions/{sid}"), None);
    }
    let metrics = server.metrics();
    assert!(
        metrics.contains("leasehold_log_lines_dropped_total 0\n"),
        "{metrics}"
    );
    let drain = std::thread::spawn(move || {
        let mut text = String::new();
        reader.read_to_string(&mut text).unwrap();
        text
    });
    let status = server.terminate();
    let log = drain.join().unwrap();
    assert!(status.success(), "{status}\n{log}");
    let ended = log
        .lines()
        .filter(|l| l.contains(r#""message":"session ended""#))
        .count();
    assert_eq!(ended, CLOSES, "{log}");
}

/// The shared backends log a close as the embedded one does: one `session ended` line, with
/// the id's first eight hex digits only.
#[test]
fn a_close_on_a_shared_backend_has_its_line() {
    let shared: [&[&str]; 2] = [
        &[
            "--backend",
            "redis",
            "--redis-url",
            "redis://127.0.0.1:6379/0",
            "--redis-allow-volatile",
            "true",
        ],
        &[
            "--backend",
            "postgres",
            "--postgres-url",
            "postgres://postgres@127.0.0.1:5432/test",
        ],
    ];
    for backend in shared {
        let dir = tempfile::tempdir().unwrap();
        let mut args = vec![
            "--log-format",
            "json",
            "--log-level",
            "info",
            "--namespace",
            "monitoring_log",
        ];
        args.extend_from_slice(backend);
        let server = Server::start(dir.path(), &dir.path().join("log"), None, &args);
        let sid = session_with_a_lock(&server);
        let (status, log) = server.stop();
        assert!(status.success(), "{backend:?}: {status}\n{log}");
        assert!(!log.contains(&sid), "{backend:?}: the whole id:\n{log}");
        let ended: Vec<serde_json::Value> = log
            .lines()
            .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
            .filter(|v| v["fields"]["message"] == "session ended")
            .collect();
        assert_eq!(ended.len(), 1, "{backend:?}:\n{log}");
        let e = &ended[0]["fields"];
        assert_eq!(e["reason"], "closed", "{backend:?}");
        assert_eq!(e["locks"], 1, "{backend:?}");
        assert_eq!(e["session"], &sid[..8], "{backend:?}");
    }
}

/// `serve` turns transparent huge pages off for its own process (their first-touch zeroing
/// stalled the writer during expiry storms), and the test process that started it, like any
/// other, keeps the system's setting.
#[test]
fn serve_runs_with_transparent_huge_pages_off() {
    let dir = tempfile::tempdir().unwrap();
    let server = Server::start(dir.path(), &dir.path().join("log"), None, &[]);
    let thp = |pid: u32| {
        let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
        status
            .lines()
            .find_map(|l| l.strip_prefix("THP_enabled:"))
            .map(|v| v.trim().to_string())
            .expect("/proc/PID/status has THP_enabled (Linux 5.0 and later)")
    };
    assert_eq!(thp(server.child.id()), "0");
    assert_eq!(thp(std::process::id()), "1");
    let (status, _) = server.stop();
    assert!(status.success(), "{status}");
}
