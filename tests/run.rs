//! `leasehold run` against a real server on the real clock: the command runs only while the
//! grant is held, gets the grant in its environment, is stopped when the lease is lost, and
//! its exit code comes back — or `run`'s own documented code when it could not run.
mod common;

use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use common::{TestServer, admin_end, all_events, of_kind};

const RUN: &str = env!("CARGO_BIN_EXE_leasehold");

/// A server on the real clock with its reaper on, so that a session left without
/// heartbeats is ended as it would be in production.
async fn server() -> TestServer {
    TestServer::start_real(|c| {
        c.reaper_enabled = true;
        c.reaper_interval_ms = 50;
    })
    .await
}

fn spawn_run(server: &str, args: &[&str]) -> Child {
    Command::new(RUN)
        .arg("run")
        .args(["--server", server])
        .args(args)
        .env_remove("LEASEHOLD_API_TOKEN")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("the binary runs")
}

/// Waits for a runner; its exit code and stderr.
async fn finish(child: Child) -> (i32, String) {
    tokio::task::spawn_blocking(move || {
        let out = child.wait_with_output().unwrap();
        (
            out.status.code().unwrap_or(-1),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    })
    .await
    .unwrap()
}

async fn run(server: &str, args: &[&str]) -> (i32, String) {
    finish(spawn_run(server, args)).await
}

/// Polls `ready` until it holds; gives up (failing the test) after 30 s, which only a broken
/// build reaches.
async fn eventually(what: &str, mut ready: impl AsyncFnMut() -> bool) {
    for _ in 0..1500 {
        if ready().await {
            return;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    panic!("gave up waiting: {what}");
}

fn read(path: &Path) -> String {
    std::fs::read_to_string(path).unwrap_or_default()
}

fn alive(pid: &str) -> bool {
    Path::new(&format!("/proc/{}", pid.trim())).exists()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn returns_the_commands_exit_code_and_hands_it_the_grant() {
    let s = server().await;
    let dir = tempfile::tempdir().unwrap();
    let env = dir.path().join("env");
    let script = format!(
        "echo \"$LEASEHOLD_TOKEN $LEASEHOLD_FENCING_TOKEN $LEASEHOLD_KEY $LEASEHOLD_SESSION\" > {}; exit 7",
        env.display()
    );
    let (code, err) = run(
        &s.url(),
        &["--lock", "db/migrate", "--", "sh", "-c", &script],
    )
    .await;
    assert_eq!(code, 7, "{err}");
    let seen: Vec<String> = read(&env).split_whitespace().map(String::from).collect();
    let events = all_events(&s).await;
    let granted = of_kind(&events, "lock_acquired");
    assert_eq!(granted.len(), 1);
    let token = granted[0]["token"].as_u64().unwrap().to_string();
    let session = granted[0]["session_id"].as_str().unwrap();
    assert_eq!(seen, [&token, &token, "db/migrate", session]);
    // Released and closed on the way out.
    assert_eq!(s.get("/v1/locks/db%2Fmigrate").await.status, 404);
    let closed = of_kind(&events, "session_closed");
    assert_eq!(closed.len(), 1);
    assert_eq!(closed[0]["session_id"], session);
    s.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn seats_are_held_and_their_tokens_passed() {
    let s = server().await;
    for pool in ["cad", "sim"] {
        let r = s
            .client
            .call(
                hyper::Method::PUT,
                &format!("/v1/pools/{pool}"),
                Some(&serde_json::json!({"capacity": 1})),
            )
            .await
            .unwrap();
        assert_eq!(r.status, 201, "{}", r.text);
    }
    let dir = tempfile::tempdir().unwrap();
    let env = dir.path().join("env");
    let script = format!(
        "echo \"$LEASEHOLD_TOKEN|$LEASEHOLD_SEAT_TOKENS|${{LEASEHOLD_KEY-unset}}\" > {}",
        env.display()
    );
    let (code, err) = run(
        &s.url(),
        &["--seat", "cad", "--seat", "sim", "--", "sh", "-c", &script],
    )
    .await;
    assert_eq!(code, 0, "{err}");
    let events = all_events(&s).await;
    let seats: Vec<String> = of_kind(&events, "seat_acquired")
        .iter()
        .map(|e| e["token"].to_string())
        .collect();
    assert_eq!(seats.len(), 2);
    assert_eq!(
        read(&env).trim(),
        format!("{}|{} {}|unset", seats[0], seats[0], seats[1])
    );
    s.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn refuses_with_its_code_when_the_lock_stays_held_past_the_wait() {
    let s = server().await;
    let holder = s.open("holder", 60_000).await;
    assert_eq!(s.acquire("nightly", &holder).await.status, 200);
    let dir = tempfile::tempdir().unwrap();
    let marker = dir.path().join("ran");
    let script = format!("touch {}", marker.display());
    let (code, err) = run(
        &s.url(),
        &[
            "--lock", "nightly", "--wait", "300ms", "--", "sh", "-c", &script,
        ],
    )
    .await;
    assert_eq!(code, 75, "{err}");
    assert!(err.contains("not obtained in time"), "{err}");
    assert!(
        !marker.exists(),
        "the command must not run without the lock"
    );
    s.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stops_the_command_when_an_operator_ends_the_session() {
    let s = server().await;
    let dir = tempfile::tempdir().unwrap();
    let pid = dir.path().join("pid");
    // The command ignores SIGTERM (and so do the sleeps it starts), so only SIGKILL ends it.
    let script = format!(
        "trap '' TERM; echo $$ > {}; while true; do sleep 0.05; done",
        pid.display()
    );
    let runner = spawn_run(
        &s.url(),
        &[
            "--lock",
            "migrate",
            "--ttl",
            "3s",
            "--kill-grace",
            "200ms",
            "--",
            "sh",
            "-c",
            &script,
        ],
    );
    eventually("the command starts", async || !read(&pid).is_empty()).await;
    let holder = s.get("/v1/locks/migrate").await;
    assert_eq!(holder.status, 200, "{}", holder.text);
    admin_end(&s, holder.body["session_id"].as_str().unwrap()).await;
    let (code, err) = finish(runner).await;
    assert_eq!(code, 79, "{err}");
    assert!(err.contains("the lease is lost"), "{err}");
    assert!(err.contains("SIGKILL"), "{err}");
    assert!(!alive(&read(&pid)), "the command is still running");
    s.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stops_the_command_when_the_runner_was_paused_past_its_ttl() {
    let s = server().await;
    let dir = tempfile::tempdir().unwrap();
    let pid = dir.path().join("pid");
    let script = format!("echo $$ > {}; exec sleep 600", pid.display());
    let runner = spawn_run(
        &s.url(),
        &["--lock", "report", "--ttl", "1s", "--", "sh", "-c", &script],
    );
    eventually("the command starts", async || !read(&pid).is_empty()).await;
    let holder = s.get("/v1/locks/report").await;
    let session = holder.body["session_id"].as_str().unwrap().to_string();
    let runner_pid = runner.id() as libc::pid_t;
    // SAFETY: kill(2) with plain integers.
    unsafe { libc::kill(runner_pid, libc::SIGSTOP) };
    // The paused runner cannot heartbeat: the server reaps its session.
    eventually("the server reaps the paused runner's session", async || {
        s.get(&format!("/v1/sessions/{session}")).await.status == 404
    })
    .await;
    unsafe { libc::kill(runner_pid, libc::SIGCONT) };
    let (code, err) = finish(runner).await;
    assert_eq!(code, 79, "{err}");
    assert!(err.contains("the lease is lost"), "{err}");
    assert!(!alive(&read(&pid)), "the command is still running");
    s.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn runs_of_one_key_never_overlap() {
    let s = server().await;
    let dir = tempfile::tempdir().unwrap();
    let log = dir.path().join("log");
    let script = format!(
        "echo start $(date +%s%N) >> {log}; sleep 0.2; echo end $(date +%s%N) >> {log}",
        log = log.display()
    );
    let runners: Vec<Child> = (0..3)
        .map(|_| {
            spawn_run(
                &s.url(),
                &[
                    "--lock",
                    "exclusive",
                    "--wait",
                    "30s",
                    "--",
                    "sh",
                    "-c",
                    &script,
                ],
            )
        })
        .collect();
    for r in runners {
        let (code, err) = finish(r).await;
        assert_eq!(code, 0, "{err}");
    }
    let lines: Vec<(String, u128)> = read(&log)
        .lines()
        .map(|l| {
            let (what, at) = l.split_once(' ').unwrap();
            (what.to_string(), at.parse().unwrap())
        })
        .collect();
    assert_eq!(lines.len(), 6, "{lines:?}");
    for (i, pair) in lines.chunks(2).enumerate() {
        assert_eq!((pair[0].0.as_str(), pair[1].0.as_str()), ("start", "end"));
        assert!(pair[0].1 <= pair[1].1);
        if i > 0 {
            let previous_end = lines[2 * i - 1].1;
            assert!(pair[0].1 >= previous_end, "intervals overlap: {lines:?}");
        }
    }
    s.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn passes_signals_on_to_the_command() {
    let s = server().await;
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("out");
    let script = format!(
        "trap 'echo got TERM >> {out}; exit 3' TERM; echo ready >> {out}; while true; do sleep 0.05; done",
        out = out.display()
    );
    let runner = spawn_run(&s.url(), &["--lock", "sig", "--", "sh", "-c", &script]);
    eventually("the command starts", async || read(&out).contains("ready")).await;
    // SAFETY: kill(2) with plain integers.
    unsafe { libc::kill(runner.id() as libc::pid_t, libc::SIGTERM) };
    let (code, err) = finish(runner).await;
    assert_eq!(code, 3, "{err}");
    assert!(read(&out).contains("got TERM"));
    assert_eq!(s.get("/v1/locks/sig").await.status, 404);
    s.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_invocations_and_an_unreachable_server_have_their_own_codes() {
    let s = server().await;
    let url = s.url();
    let (code, err) = run(&url, &["--", "true"]).await;
    assert_eq!(code, 2, "no lock or seat: {err}");
    let (code, err) = run(&url, &["--lock", "k", "--wait", "soon", "--", "true"]).await;
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("not a duration"), "{err}");
    let (code, err) = run(&url, &["--seat", "no-such-pool", "--", "true"]).await;
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("pool_not_found"), "{err}");
    let (code, err) = run(&url, &["--lock", "k", "--", "/no/such/command"]).await;
    assert_eq!(code, 127, "{err}");
    let (code, err) = run("http://127.0.0.1:1", &["--lock", "k", "--", "true"]).await;
    assert_eq!(code, 69, "{err}");
    assert!(err.contains("cannot reach"), "{err}");
    // Nothing was left held by the failed runs.
    assert_eq!(s.get("/v1/locks/k").await.status, 404);
    s.stop().await;
}
