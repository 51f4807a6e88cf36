//! Backup and restore keep fencing safe. A backup taken with `leasehold backup` while a
//! writer takes locks throughout, restored with `leasehold restore` into a new directory and
//! started: every lock acknowledged before the backup began is there with its holder and
//! token, `leasehold check` passes, and the first new token is greater than every token
//! issued before the restore — including those issued after the backup, which it never saw.
//!
//! The writer's acquire latency before, during and after the backup is printed (run with
//! `--nocapture`); it is a measurement, not an assertion.
mod common;

use std::path::Path;
use std::process::Command;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use common::*;
use leasehold::client::{Client, segment};
use parking_lot::Mutex;
use serde_json::json;

fn leasehold(args: &[&str]) -> (i32, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_leasehold"))
        .args(args)
        .env_remove("LEASEHOLD_SERVER")
        .env_remove("LEASEHOLD_DATA_DIR")
        .output()
        .expect("the binary runs");
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

async fn run(args: Vec<String>) -> (i32, String, String) {
    tokio::task::spawn_blocking(move || {
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        leasehold(&args)
    })
    .await
    .unwrap()
}

fn path_arg(p: &Path) -> String {
    p.to_str().unwrap().to_string()
}

/// `leasehold backup --server URL --out FILE`: its exit code, stdout and stderr.
async fn backup(s: &TestServer, file: &Path) -> (i32, String, String) {
    run(vec![
        "backup".into(),
        "--server".into(),
        s.url(),
        "--out".into(),
        path_arg(file),
    ])
    .await
}

/// One acknowledged grant of the writer, and how long the acquire took.
#[derive(Clone)]
struct Ack {
    key: String,
    session: String,
    token: u64,
    took: Duration,
    /// The phase (0 before the backup, 1 while it runs, 2 after it) when the acquire was
    /// sent, and when its answer came.
    sent: usize,
    answered: usize,
}

/// Takes fresh locks one after another until told to stop, recording each acknowledgement.
async fn writer(
    client: Client,
    acks: Arc<Mutex<Vec<Ack>>>,
    stop: Arc<AtomicBool>,
    phase: Arc<AtomicUsize>,
) {
    let mut session = String::new();
    let mut i = 0u64;
    while !stop.load(Ordering::SeqCst) {
        if i.is_multiple_of(1000) {
            let r = client
                .post(
                    "/v1/sessions",
                    &json!({"owner": "writer", "ttl_ms": 3_600_000}),
                )
                .await
                .unwrap();
            assert_eq!(r.status, 201, "{}", r.text);
            session = r.body["session_id"].as_str().unwrap().to_string();
        }
        let key = format!("load/{i}");
        let sent_phase = phase.load(Ordering::SeqCst);
        let started = Instant::now();
        let r = client
            .post(
                &format!("/v1/locks/{}/acquire", segment(&key)),
                &json!({"session_id": session}),
            )
            .await
            .unwrap();
        let took = started.elapsed();
        assert_eq!(r.status, 200, "{}", r.text);
        let answered = phase.load(Ordering::SeqCst);
        acks.lock().push(Ack {
            key,
            session: session.clone(),
            token: r.body["token"].as_u64().unwrap(),
            took,
            sent: sent_phase,
            answered,
        });
        i += 1;
    }
}

fn percentile(mut v: Vec<Duration>, p: f64) -> Duration {
    if v.is_empty() {
        return Duration::ZERO;
    }
    v.sort_unstable();
    v[((v.len() - 1) as f64 * p).round() as usize]
}

fn summary(label: &str, v: Vec<Duration>) {
    eprintln!(
        "writer acquire latency {label}: n={} p50={:?} p99={:?} max={:?}",
        v.len(),
        percentile(v.clone(), 0.5),
        percentile(v.clone(), 0.99),
        v.iter().max().copied().unwrap_or_default()
    );
}

/// Fills the server with `sessions` × `per_session` held locks, 32 requests at a time, so
/// that the backup has something to copy while the writer runs.
async fn prefill(s: &TestServer, sessions: usize, per_session: usize) {
    let mut tasks = Vec::new();
    for n in 0..sessions {
        let client = s.client.clone();
        let owner = format!("prefill-{n}");
        tasks.push(tokio::spawn(async move {
            let r = client
                .post(
                    "/v1/sessions",
                    &json!({"owner": owner, "ttl_ms": 3_600_000}),
                )
                .await
                .unwrap();
            let id = r.body["session_id"].as_str().unwrap().to_string();
            for k in 0..per_session {
                let key = format!("prefill/{n}/{k}");
                let r = client
                    .post(
                        &format!("/v1/locks/{}/acquire", segment(&key)),
                        &json!({"session_id": id}),
                    )
                    .await
                    .unwrap();
                assert_eq!(r.status, 200, "{}", r.text);
            }
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }
}

/// Waits until the writer has `n` acknowledgements.
async fn until_acks(acks: &Mutex<Vec<Ack>>, n: usize) {
    while acks.lock().len() < n {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn backup_under_write_load_restores_with_every_new_token_above_all_issued() {
    let s = TestServer::start().await;
    prefill(&s, 32, 300).await;

    let acks = Arc::new(Mutex::new(Vec::new()));
    let stop = Arc::new(AtomicBool::new(false));
    // 0 before the backup, 1 while it runs, 2 after it.
    let phase = Arc::new(AtomicUsize::new(0));
    let w = tokio::spawn(writer(
        s.client.clone(),
        acks.clone(),
        stop.clone(),
        phase.clone(),
    ));
    until_acks(&acks, 200).await;

    let out = tempfile::tempdir().unwrap();
    let file = out.path().join("snapshot.redb");
    phase.store(1, Ordering::SeqCst);
    let started = Instant::now();
    let (code, stdout, stderr) = backup(&s, &file).await;
    let backup_took = started.elapsed();
    phase.store(2, Ordering::SeqCst);
    assert_eq!(code, 0, "{stdout}{stderr}");
    assert!(!out.path().join("snapshot.redb.partial").exists());
    let during = acks.lock().len();
    // Tokens issued after the backup: the backup never sees them.
    until_acks(&acks, during + 200).await;
    stop.store(true, Ordering::SeqCst);
    w.await.unwrap();
    let acks = acks.lock().clone();
    s.stop().await;

    // Acknowledged before the backup was asked for, so committed before its snapshot.
    let before: Vec<&Ack> = acks.iter().filter(|a| a.answered == 0).collect();
    let overlapping: Vec<Duration> = acks
        .iter()
        .filter(|a| a.sent <= 1 && a.answered == 1)
        .map(|a| a.took)
        .collect();
    eprintln!("backup of 9 600 prefilled locks took {backup_took:?}: {stdout}");
    summary("before the backup", before.iter().map(|a| a.took).collect());
    summary("while the backup ran", overlapping);
    summary(
        "after the backup",
        acks.iter()
            .filter(|a| a.sent == 2)
            .map(|a| a.took)
            .collect(),
    );
    let highest = acks.iter().map(|a| a.token).max().unwrap();
    let backup_revision: u64 = stdout
        .split("revision ")
        .nth(1)
        .and_then(|t| t.split_whitespace().next())
        .and_then(|t| t.parse().ok())
        .unwrap_or_else(|| panic!("no revision in {stdout}"));
    assert!(
        highest > backup_revision,
        "the writer issued no token after the snapshot; the test would prove nothing"
    );

    // Restore into a new directory; it passes the check.
    let restored = tempfile::tempdir().unwrap();
    let dir = restored.path().join("data");
    let (code, stdout, stderr) = run(vec![
        "restore".into(),
        "--data-dir".into(),
        path_arg(&dir),
        path_arg(&file),
    ])
    .await;
    assert_eq!(code, 0, "{stdout}{stderr}");
    let (code, stdout, stderr) =
        run(vec!["check".into(), "--data-dir".into(), path_arg(&dir)]).await;
    assert_eq!(code, 0, "{stdout}{stderr}");

    let dir_for = dir.clone();
    let r = TestServer::start_with(move |c| c.data_dir = dir_for).await;
    for a in &before {
        let lock = holder(&r, &a.key).await;
        assert_eq!(lock.status, 200, "{} is missing: {}", a.key, lock.text);
        assert_eq!(lock.body["token"], a.token, "{}", a.key);
        assert_eq!(lock.body["session_id"], a.session.as_str(), "{}", a.key);
    }
    for n in [0, 31] {
        assert_eq!(holder(&r, &format!("prefill/{n}/299")).await.status, 200);
    }
    let fresh = r.open("after-restore", 60_000).await;
    let first = take(&r, "after/restore", &fresh).await;
    assert!(
        first > highest,
        "first token after the restore {first} is not above {highest}, issued before it"
    );
    r.stop().await;
}

/// Without the margin, a restore knows only the backup's revision: the first new token can
/// repeat one the lost server issued after the backup. This is why the margin is the default,
/// and `--token-floor` with the last token issued is the way to do without it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_a_margin_only_the_last_token_issued_keeps_tokens_new() {
    let s = TestServer::start().await;
    let a = s.open("a", 60_000).await;
    take(&s, "before", &a).await;
    let out = tempfile::tempdir().unwrap();
    let file = out.path().join("b.redb");
    let (code, stdout, stderr) = backup(&s, &file).await;
    assert_eq!(code, 0, "{stdout}{stderr}");
    let mut last = 0;
    for i in 0..5 {
        last = take(&s, &format!("after/{i}"), &a).await;
    }
    s.stop().await;

    let restore = |dir: &Path, extra: &[&str]| {
        let mut args = vec![
            "restore".to_string(),
            "--data-dir".into(),
            path_arg(dir),
            path_arg(&file),
        ];
        args.extend(extra.iter().map(|x| x.to_string()));
        run(args)
    };
    let first_token = |dir: std::path::PathBuf| async move {
        let r = TestServer::start_with(move |c| c.data_dir = dir).await;
        let id = r.open("x", 60_000).await;
        let t = take(&r, "new", &id).await;
        r.stop().await;
        t
    };

    let unsafe_dir = out.path().join("unsafe");
    let (code, o, e) = restore(&unsafe_dir, &["--token-margin", "0"]).await;
    assert_eq!(code, 0, "{o}{e}");
    let t = first_token(unsafe_dir).await;
    assert!(
        t <= last,
        "with no margin the token {t} repeats one of 0..={last}"
    );

    let known = out.path().join("known");
    let (code, o, e) = restore(
        &known,
        &["--token-margin", "0", "--token-floor", &last.to_string()],
    )
    .await;
    assert_eq!(code, 0, "{o}{e}");
    let t = first_token(known).await;
    assert!(t > last, "{t} is not above the last token {last}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn restore_refuses_what_it_cannot_restore_safely_and_loses_nothing() {
    // A data directory that outlives the server (the harness's own goes with it).
    let live = tempfile::tempdir().unwrap();
    let live_dir = live.path().to_path_buf();
    let d = live_dir.clone();
    let s = TestServer::start_with(move |c| c.data_dir = d).await;
    let a = s.open("a", 60_000).await;
    take(&s, "k", &a).await;
    let out = tempfile::tempdir().unwrap();
    let file = out.path().join("b.redb");
    let (code, o, e) = backup(&s, &file).await;
    assert_eq!(code, 0, "{o}{e}");
    s.stop().await;

    // A data directory in use is not replaced without --force, and is left as it was.
    let before = std::fs::read(live_dir.join("leasehold.redb")).unwrap();
    let (code, _, err) = run(vec![
        "restore".into(),
        "--data-dir".into(),
        path_arg(&live_dir),
        path_arg(&file),
    ])
    .await;
    assert_eq!(code, 1);
    assert!(
        err.contains("not empty") && err.contains("--force"),
        "{err}"
    );
    assert!(std::fs::read(live_dir.join("leasehold.redb")).unwrap() == before);

    // A data file is not a backup.
    let (code, _, err) = run(vec![
        "restore".into(),
        "--data-dir".into(),
        path_arg(&out.path().join("x")),
        path_arg(&live_dir.join("leasehold.redb")),
    ])
    .await;
    assert_eq!(code, 1);
    assert!(err.contains("not a Leasehold backup"), "{err}");
    assert!(!out.path().join("x").join("leasehold.redb").exists());

    // A truncated file is refused.
    let cut = out.path().join("cut.redb");
    let bytes = std::fs::read(&file).unwrap();
    std::fs::write(&cut, &bytes[..bytes.len() / 2]).unwrap();
    let (code, _, err) = run(vec![
        "restore".into(),
        "--data-dir".into(),
        path_arg(&out.path().join("y")),
        path_arg(&cut),
    ])
    .await;
    assert_eq!(code, 1, "{err}");
    assert!(!out.path().join("y").join("leasehold.redb").exists());

    // A floor beyond the highest allowed is refused before anything is written.
    let (code, _, err) = run(vec![
        "restore".into(),
        "--data-dir".into(),
        path_arg(&out.path().join("z")),
        path_arg(&file),
        "--token-floor".into(),
        (1u64 << 62).to_string(),
    ])
    .await;
    assert_eq!(code, 1);
    assert!(err.contains("above the highest allowed"), "{err}");

    // With --force the old data file is kept beside the restored one.
    let (code, o, e) = run(vec![
        "restore".into(),
        "--data-dir".into(),
        path_arg(&live_dir),
        path_arg(&file),
        "--force".into(),
    ])
    .await;
    assert_eq!(code, 0, "{o}{e}");
    let kept: Vec<_> = std::fs::read_dir(&live_dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .filter(|n| n.starts_with("leasehold.redb.replaced-"))
        .collect();
    assert_eq!(kept.len(), 1, "{kept:?}");
    assert!(std::fs::read(live_dir.join(&kept[0])).unwrap() == before);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn raise_floor_ratchets_and_is_audited_on_every_backend() {
    for kind in [
        BackendKind::Embedded,
        BackendKind::Postgres,
        BackendKind::Redis,
    ] {
        let s = TestServer::start_on(kind, |_| {}).await;
        let a = s.open("a", 60_000).await;
        let t0 = take(&s, "k0", &a).await;

        let (code, o, e) = run(vec![
            "tokens".into(),
            "raise-floor".into(),
            "5000".into(),
            "--server".into(),
            s.url(),
        ])
        .await;
        assert_eq!(code, 0, "{kind:?}: {o}{e}");
        let answer: serde_json::Value = serde_json::from_str(&o).unwrap();
        assert_eq!(answer["floor"], 5000);
        assert_eq!(answer["previous"], t0);
        assert_eq!(answer["raised"], true);
        let t1 = take(&s, "k1", &a).await;
        assert!(t1 > 5000, "{kind:?}: {t1}");

        // Lower floors move nothing back.
        let r = s.post("/v1/admin/tokens/floor", json!({"floor": 10})).await;
        assert_eq!(r.status, 200, "{}", r.text);
        assert_eq!(r.body["raised"], false);
        let t2 = take(&s, "k2", &a).await;
        assert!(t2 > t1, "{kind:?}: {t2} after {t1}");

        // Bad input is refused with the field named, and changes nothing.
        for body in [
            json!({"floor": (1u64 << 62) + 1}),
            json!({"floor": -1}),
            json!({}),
            json!({"floor": 1, "x": 2}),
        ] {
            let r = s.post("/v1/admin/tokens/floor", body.clone()).await;
            assert_eq!(r.status, 400, "{kind:?} {body}: {}", r.text);
        }
        let r = s
            .post("/v1/admin/tokens/floor", json!({"floor": (1u64 << 62) + 1}))
            .await;
        assert_invalid(&r, "floor");
        let t3 = take(&s, "k3", &a).await;
        assert!(t3 > t2 && t3 < 6000, "{kind:?}: {t3}");

        let events = all_events(&s).await;
        let raised: Vec<_> = of_kind(&events, "token_floor_raised")
            .into_iter()
            .map(|e| e["detail"].as_str().unwrap().to_string())
            .collect();
        assert_eq!(
            raised,
            vec![
                format!("floor 5000, counter was {t0}"),
                format!("floor 10, counter was {t1}")
            ],
            "{kind:?}"
        );

        // Backup is the embedded backend's; the others say what to use instead.
        let r = raw(&s, hyper::Method::POST, "/v1/admin/backup", Vec::new()).await;
        match kind {
            BackendKind::Embedded => assert_eq!(r.status, 200),
            BackendKind::Postgres | BackendKind::Redis => {
                assert_eq!(r.status, 501, "{}", r.text);
                assert_eq!(r.body["error"], "not_supported");
                assert!(r.body["message"].as_str().unwrap().contains("raise-floor"));
            }
        }
        s.stop().await;
    }
}

/// Raises racing grants: floors just above the counter, raised while takers grant and release
/// locks as fast as they can, must never make a token repeat, and a grant asked for after a
/// raise answered is above its floor. On PostgreSQL this is what the sequence lock is for:
/// without it a draw between reading the counter and `setval` could be issued again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn floors_raised_under_concurrent_grants_never_repeat_a_token() {
    for kind in [
        BackendKind::Embedded,
        BackendKind::Postgres,
        BackendKind::Redis,
    ] {
        let s = TestServer::start_on(kind, |_| {}).await;
        let stop = Arc::new(AtomicBool::new(false));
        let mut takers = Vec::new();
        for n in 0..4 {
            let client = s.client.clone();
            let stop = stop.clone();
            takers.push(tokio::spawn(async move {
                let r = client
                    .post("/v1/sessions", &json!({"owner": "t", "ttl_ms": 600_000}))
                    .await
                    .unwrap();
                let id = r.body["session_id"].as_str().unwrap().to_string();
                let key = format!("race/{n}");
                let mut tokens = Vec::new();
                while !stop.load(Ordering::SeqCst) {
                    let r = client
                        .post(
                            &format!("/v1/locks/{}/acquire", segment(&key)),
                            &json!({"session_id": id}),
                        )
                        .await
                        .unwrap();
                    assert_eq!(r.status, 200, "{}", r.text);
                    let t = r.body["token"].as_u64().unwrap();
                    tokens.push(t);
                    let r = client
                        .post(
                            &format!("/v1/locks/{}/release", segment(&key)),
                            &json!({"session_id": id, "token": t}),
                        )
                        .await
                        .unwrap();
                    assert_eq!(r.status, 200, "{}", r.text);
                }
                tokens
            }));
        }
        let a = s.open("raiser", 600_000).await;
        let mut raises = 0;
        for _ in 0..40 {
            // Just above the counter, so that concurrent draws pass it while it is raised.
            let r = s.post("/v1/admin/tokens/floor", json!({"floor": 0})).await;
            assert_eq!(r.status, 200, "{}", r.text);
            let floor = r.body["revision"].as_u64().unwrap() + 3;
            let r = s
                .post("/v1/admin/tokens/floor", json!({"floor": floor}))
                .await;
            assert_eq!(r.status, 200, "{}", r.text);
            raises += 1;
            let t = take(&s, &format!("after/{raises}"), &a).await;
            assert!(t > floor, "{kind:?}: token {t} after a raise to {floor}");
        }
        stop.store(true, Ordering::SeqCst);
        let mut all = Vec::new();
        for t in takers {
            all.extend(t.await.unwrap());
        }
        assert!(
            all.len() > 40,
            "{kind:?}: the takers barely ran ({})",
            all.len()
        );
        let n = all.len();
        all.sort_unstable();
        all.dedup();
        assert_eq!(all.len(), n, "{kind:?}: a token was issued twice");
        s.stop().await;
    }
}
