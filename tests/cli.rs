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
