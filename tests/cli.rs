//! The command line against a real server: the client commands print the API's answers and
//! exit non-zero on an error, and `check` and `serve` refuse bad input with a clear message.
mod common;

use std::process::Command;

use common::TestServer;

fn leasehold(args: &[&str]) -> (i32, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_leasehold"))
        .args(args)
        .env_remove("LEASEHOLD_SERVER")
        .output()
        .expect("the binary runs");
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn client_commands_talk_to_a_running_server() {
    let s = TestServer::start().await;
    let url = s.url();
    let a = s.open("alice", 60_000).await;
    assert_eq!(s.acquire("db/migrate", &a).await.status, 200);
    let run = |args: Vec<String>| {
        tokio::task::spawn_blocking(move || {
            let args: Vec<&str> = args.iter().map(String::as_str).collect();
            leasehold(&args)
        })
    };
    let cmd = |parts: &[&str]| {
        let mut v: Vec<String> = parts.iter().map(|p| p.to_string()).collect();
        v.push("--server".into());
        v.push(url.clone());
        v
    };

    let (code, out, _) = run(cmd(&["sessions", "list"])).await.unwrap();
    assert_eq!(code, 0);
    assert!(out.contains(&a) && out.contains("alice"), "{out}");
    let (code, out, _) = run(cmd(&["locks", "show", "db/migrate"])).await.unwrap();
    assert_eq!(code, 0);
    assert!(out.contains(&a), "{out}");
    let (code, _, err) = run(cmd(&["locks", "show", "free"])).await.unwrap();
    assert_eq!(code, 1);
    assert!(err.contains("404 lock_free"), "{err}");
    let (code, out, _) = run(cmd(&["pools", "put", "cad", "--capacity", "3"]))
        .await
        .unwrap();
    assert_eq!(code, 0, "{out}");
    let (code, out, _) = run(cmd(&["pools", "show", "cad"])).await.unwrap();
    assert_eq!(code, 0);
    assert!(out.contains("\"capacity\": 3"), "{out}");
    let (code, out, _) = run(cmd(&["jobs", "queue", "builds"])).await.unwrap();
    assert_eq!(code, 0);
    assert!(out.contains("\"queued\": 0"), "{out}");
    s.advance(60_000).await;
    let (code, out, _) = run(cmd(&["reap", "--dry-run"])).await.unwrap();
    assert_eq!(code, 0);
    assert!(out.contains(&a) && out.contains("db/migrate"), "{out}");
    let (code, out, _) = run(cmd(&["reap"])).await.unwrap();
    assert_eq!(code, 0);
    assert!(out.contains("\"sessions_ended\": 1"), "{out}");
    let (code, out, _) = run(cmd(&["events"])).await.unwrap();
    assert_eq!(code, 0);
    assert!(out.contains("session_expired"), "{out}");
    s.stop().await;
}

#[test]
fn unreachable_server_is_a_clear_error() {
    let (code, _, err) = leasehold(&["sessions", "list", "--server", "http://127.0.0.1:1"]);
    assert_eq!(code, 1);
    assert!(err.contains("cannot reach"), "{err}");
    let (code, _, err) = leasehold(&["sessions", "list", "--server", "ftp://x"]);
    assert_eq!(code, 1);
    assert!(err.contains("invalid server URL"), "{err}");
}

#[test]
fn serve_refuses_bad_settings_naming_them() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().to_str().unwrap();
    let (code, _, err) = leasehold(&["serve", "--data-dir", data, "--reaper-interval-ms", "1"]);
    assert_eq!(code, 2);
    assert!(
        err.contains("reaper_interval_ms = 1") && err.contains("milliseconds"),
        "{err}"
    );
    let config = dir.path().join("leasehold.toml");
    std::fs::write(&config, "reaper_intervall_ms = 500\n").unwrap();
    let (code, _, err) = leasehold(&["serve", "--config", config.to_str().unwrap()]);
    assert_eq!(code, 2);
    assert!(err.contains("reaper_intervall_ms"), "{err}");
}

/// A listing read through a pipe whose reader has gone (`leasehold ... | head`) ends the way
/// Unix tools do, by SIGPIPE, not with a panic and its backtrace hint.
#[test]
fn a_closed_pipe_ends_a_listing_quietly() {
    use std::os::unix::process::ExitStatusExt;

    let dir = tempfile::tempdir().unwrap();
    // A pipe with no reader: the first write to it fails, whatever the output's size.
    let (reader, writer) = std::io::pipe().unwrap();
    drop(reader);
    let out = Command::new(env!("CARGO_BIN_EXE_leasehold"))
        .args(["generate", "completions", "--out"])
        .arg(dir.path())
        .stdout(writer)
        .output()
        .expect("the binary runs");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!err.contains("panicked"), "{err}");
    assert_eq!(
        out.status.signal(),
        Some(libc::SIGPIPE),
        "{:?}: {err}",
        out.status
    );
    // The work before the output was done: the files are there.
    assert!(std::fs::read_dir(dir.path()).unwrap().count() > 0);
}

#[test]
fn check_of_a_missing_data_file_says_so() {
    let dir = tempfile::tempdir().unwrap();
    let (code, _, err) = leasehold(&["check", "--data-dir", dir.path().to_str().unwrap()]);
    assert_eq!(code, 2);
    assert!(err.contains("no data file"), "{err}");
}

/// Every `leasehold bench` workload, briefly, against a real server: the load generator is
/// part of the product, and a workload that errors or measures nothing must fail here.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_bench_workload_runs_and_reports() {
    let s = TestServer::start_real(|c| {
        c.reaper_enabled = true;
        c.reaper_interval_ms = 50;
    })
    .await;
    let url = s.url();
    for workload in [
        "lock-churn",
        "session-churn",
        "heartbeat",
        "seat-churn",
        "job-churn",
        "mass-expiry",
    ] {
        let args: Vec<String> = [
            "bench",
            "--server",
            &url,
            "--workload",
            workload,
            "--clients",
            "4",
            "--warmup",
            "0.2",
            "--duration",
            "1",
            "--sessions",
            "200",
            "--keys",
            "50",
            "--ttl-ms",
            "1000",
            "--json",
        ]
        .iter()
        .map(|a| a.to_string())
        .collect();
        let (code, out, err) = tokio::task::spawn_blocking(move || {
            let args: Vec<&str> = args.iter().map(String::as_str).collect();
            leasehold(&args)
        })
        .await
        .unwrap();
        assert_eq!(code, 0, "{workload}: {err}");
        let report: serde_json::Value = serde_json::from_str(out.trim())
            .unwrap_or_else(|e| panic!("{workload}: not one JSON line ({e}): {out}"));
        assert_eq!(report["workload"], workload);
        assert_eq!(report["errors"], 0, "{workload}: {out}");
        assert!(report["ops"].as_u64().unwrap() > 0, "{workload}: {out}");
        assert!(report["p99_us"].as_u64().unwrap() >= report["p50_us"].as_u64().unwrap());
        for field in ["clients", "seconds", "ops_per_s", "p50_us", "p999_us"] {
            assert!(report.get(field).is_some(), "{workload}: no {field}: {out}");
        }
        if workload == "mass-expiry" {
            assert_eq!(report["sessions"], 200, "{out}");
            assert!(report["free_after_ms"].is_u64(), "{out}");
        }
    }
    s.stop().await;
}

/// `migrate` and `check --backend postgres` against the real database, in a namespace of
/// their own.
#[test]
fn migrate_and_check_a_postgres_namespace() {
    let url = std::env::var("LEASEHOLD_TEST_POSTGRES_URL")
        .unwrap_or_else(|_| "host=127.0.0.1 port=5432 user=postgres dbname=test".into());
    let ns = format!("t_{:032x}", uuid::Uuid::new_v4().as_u128());
    let psql = |sql: String| {
        let url = url.clone();
        std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .unwrap();
            rt.block_on(async {
                let (c, conn) = tokio_postgres::connect(&url, tokio_postgres::NoTls)
                    .await
                    .unwrap();
                tokio::spawn(conn);
                c.batch_execute(&sql).await.unwrap();
            })
        })
        .join()
        .unwrap()
    };
    let args = |cmd: &str| {
        vec![
            cmd.to_string(),
            "--postgres-url".into(),
            url.clone(),
            "--namespace".into(),
            ns.clone(),
        ]
    };
    let run = |a: Vec<String>, extra: &[&str]| {
        let mut all: Vec<&str> = a.iter().map(String::as_str).collect();
        all.extend(extra);
        leasehold(&all)
    };
    let (code, out, err) = run(args("migrate"), &[]);
    assert_eq!(code, 0, "{err}");
    let newest = leasehold::backend::postgres::schema::VERSION;
    assert!(
        out.contains(&format!("from version 0 to {newest}")),
        "{out}"
    );
    let (code, out, _) = run(args("migrate"), &[]);
    assert_eq!(code, 0);
    assert!(
        out.contains(&format!("already at version {newest}")),
        "{out}"
    );
    let (code, out, err) = run(args("check"), &["--backend", "postgres"]);
    assert_eq!(code, 0, "{out}{err}");
    assert!(out.contains("every invariant holds"), "{out}");
    // A grant with a token the revision sequence never issued.
    psql(format!(
        "INSERT INTO \"{ns}\".session (id, owner, ttl_ms, expires_at)
         VALUES ('00000000-0000-4000-8000-000000000001', 'x', 1000, \"{ns}\".db_now() + interval '1 hour');
         INSERT INTO \"{ns}\".lock (key, session_id, token)
         VALUES ('k', '00000000-0000-4000-8000-000000000001', 99);"
    ));
    let (code, out, _) = run(args("check"), &["--backend", "postgres"]);
    assert_eq!(code, 1, "{out}");
    assert!(
        out.contains("lock k has token 99 above the revision"),
        "{out}"
    );
    psql(format!(
        "INSERT INTO \"{ns}\".schema_version VALUES (99, now())"
    ));
    let (code, _, err) = run(args("migrate"), &[]);
    assert_eq!(code, 1);
    assert!(
        err.contains("newer than the newest this build knows"),
        "{err}"
    );
    psql(format!("DROP SCHEMA \"{ns}\" CASCADE"));
    let (code, _, err) = leasehold(&[
        "migrate",
        "--postgres-url",
        "postgres://u:secret@127.0.0.1:1/x",
    ]);
    assert_eq!(code, 2);
    assert!(err.contains("u:***@") && !err.contains("secret"), "{err}");
}
