//! Upgrades keep data. `tests/fixtures/v0.1.0` is a data directory written by release 0.1.0,
//! with what that release's API answered about it (`expected.json`). A copy of it must open
//! with this build, pass `leasehold check`, and hold every session, lock and its token, pool,
//! seat, job, audit event and the token counter as 0.1.0 left them; the next token issued must
//! be above every token 0.1.0 issued.
//!
//! Record formats only ever add versions: a file stamped with a schema newer than this build
//! reads, or holding a record in a newer format, is refused with a message that names the
//! version, and refusing it loses nothing.
mod common;

use std::path::{Path, PathBuf};
use std::process::Command;

use common::*;
use leasehold::app::App;
use leasehold::clock::ManualClock;
use leasehold::domain::UnixMs;
use redb::ReadableTable;
use serde_json::Value;
use tempfile::TempDir;

const DATA_FILE: &str = "leasehold.redb";
const META: redb::TableDefinition<&str, u64> = redb::TableDefinition::new("meta");
const SESSIONS: redb::TableDefinition<u128, &[u8]> = redb::TableDefinition::new("sessions");

fn fixture() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/v0.1.0")
}

fn expected() -> Value {
    let text = std::fs::read_to_string(fixture().join("expected.json")).unwrap();
    serde_json::from_str(&text).unwrap()
}

/// A fresh copy of the 0.1.0 data directory; the fixture itself is never opened.
fn fixture_copy() -> TempDir {
    let dir = tempfile::tempdir().unwrap();
    std::fs::copy(
        fixture().join("data").join(DATA_FILE),
        dir.path().join(DATA_FILE),
    )
    .unwrap();
    dir
}

/// `leasehold check --data-dir DIR` of this build: exit code, stdout, stderr.
fn check(dir: &Path) -> (i32, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_leasehold"))
        .arg("check")
        .arg("--data-dir")
        .arg(dir)
        .env_remove("LEASEHOLD_DATA_DIR")
        .env_remove("LEASEHOLD_BACKEND")
        .output()
        .expect("the binary runs");
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// Drops the fields that render a deadline on the wall clock at the moment of answering:
/// they are not stored (a restart gives every session a fresh TTL), so they legitimately
/// differ between 0.1.0's answer and this build's.
fn without_deadlines(mut v: Value) -> Value {
    if let Some(o) = v.as_object_mut() {
        for field in ["expires_at", "last_heartbeat_at", "state"] {
            o.remove(field);
        }
    }
    v
}

fn pool_without_deadlines(mut pool: Value) -> Value {
    let holders = pool["holders"].as_array_mut().unwrap();
    for h in holders.iter_mut() {
        *h = without_deadlines(h.take());
    }
    pool
}

/// Every line 0.1.0's own check printed (the counts, the revision, "ok") is in this build's
/// report; a later build may report more.
fn assert_reports_as_recorded(out: &str) {
    let recorded = std::fs::read_to_string(fixture().join("check.txt")).unwrap();
    for line in recorded.lines() {
        assert!(
            out.lines().any(|l| l == line),
            "this build's check does not report {line:?} for the fixture:\n{out}"
        );
    }
}

async fn start_on(dir: &Path) -> TestServer {
    let dir = dir.to_path_buf();
    TestServer::start_with(move |c| c.data_dir = dir).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_0_1_0_data_directory_opens_checks_clean_and_keeps_everything() {
    let want = expected();
    assert_eq!(want["version"], "leasehold 0.1.0");
    let revision = want["revision"].as_u64().unwrap();
    let dir = fixture_copy();

    // The offline check passes and reports what 0.1.0's own check reported.
    let (code, out, err) = check(dir.path());
    assert_eq!(code, 0, "check failed on the 0.1.0 fixture:\n{out}{err}");
    assert_reports_as_recorded(&out);

    let s = start_on(dir.path()).await;

    // Sessions: the live ones with everything they hold, and no others; the ended ones stay
    // gone.
    for session in want["sessions"].as_array().unwrap() {
        let id = session["session_id"].as_str().unwrap();
        let r = common::session(&s, id).await;
        assert_eq!(r.status, 200, "{}", r.text);
        assert_eq!(
            without_deadlines(r.body.clone()),
            without_deadlines(session.clone())
        );
        assert_eq!(r.body["ttl_ms"], session["ttl_ms"]);
    }
    let listed = s.get("/v1/sessions?limit=1000").await;
    assert_eq!(listed.status, 200, "{}", listed.text);
    let mut ids = session_ids(&listed);
    let mut want_ids: Vec<&str> = want["sessions"]
        .as_array()
        .unwrap()
        .iter()
        .map(|x| x["session_id"].as_str().unwrap())
        .collect();
    ids.sort_unstable();
    want_ids.sort_unstable();
    assert_eq!(ids, want_ids);
    for gone in want["gone_sessions"].as_array().unwrap() {
        let r = common::session(&s, gone.as_str().unwrap()).await;
        assert_error(&r, 404, "session_gone");
    }

    // Locks with their holders, tokens and acquisition times.
    let locks = s.get("/v1/locks?limit=1000").await;
    assert_eq!(locks.status, 200, "{}", locks.text);
    assert_eq!(locks.body["locks"], want["locks"]);
    for lock in want["locks"].as_array().unwrap() {
        let key = lock["key"].as_str().unwrap();
        let t = lock["token"].as_u64().unwrap();
        let f = fence(&s, key, t).await;
        assert_eq!(f.body["current"], true, "{key} token {t}: {}", f.text);
    }

    // Pools and their seats.
    let pools = s.get("/v1/pools").await;
    assert_eq!(pools.body["pools"], want["pools"]);
    for (name, detail) in want["pool_details"].as_object().unwrap() {
        let r = pool(&s, name).await;
        assert_eq!(r.status, 200, "{}", r.text);
        assert_eq!(
            pool_without_deadlines(r.body.clone()),
            pool_without_deadlines(detail.clone())
        );
    }

    // Jobs in every state, with payloads, results and failure reasons; queue counts.
    for j in want["jobs"].as_array().unwrap() {
        let r = job(&s, j["job_id"].as_str().unwrap()).await;
        assert_eq!(r.status, 200, "{}", r.text);
        assert_eq!(&r.body, j);
    }
    for (name, counts) in want["queues"].as_object().unwrap() {
        assert_eq!(&queue_info(&s, name).await.body, counts);
    }

    // The audit log, event for event.
    let events = all_events(&s).await;
    assert_eq!(&Value::Array(events.clone()), &want["events"]);
    let last_seq = events.last().unwrap()["seq"].as_u64().unwrap();

    // The token counter: the next grant's token is above every token 0.1.0 issued, and new
    // events continue the log.
    let every_token = want["events"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|e| e["token"].as_u64())
        .max()
        .unwrap();
    assert!(every_token <= revision);
    let a = s.open("after-upgrade", 60_000).await;
    let t = take(&s, "after/upgrade", &a).await;
    assert!(
        t > revision,
        "token {t} is not above 0.1.0's counter {revision}"
    );
    let events = all_events(&s).await;
    assert!(events.last().unwrap()["seq"].as_u64().unwrap() > last_seq);

    // The queued jobs are still served in order: the requeued one, then the never-claimed one.
    let (first, _) = claim_job(&s, "thumbs", &a).await;
    assert_eq!(first, want["jobs"][2]["job_id"].as_str().unwrap());
    let (second, _) = claim_job(&s, "thumbs", &a).await;
    assert_eq!(second, want["jobs"][4]["job_id"].as_str().unwrap());

    s.stop().await;
    let (code, out, err) = check(dir.path());
    assert_eq!(
        code, 0,
        "check failed after writing with this build:\n{out}{err}"
    );
}

/// Sets the schema version stamped in `meta` of the data file in `dir`.
fn stamp_schema(dir: &Path, version: u64) {
    let db = redb::Database::open(dir.join(DATA_FILE)).unwrap();
    let txn = db.begin_write().unwrap();
    txn.open_table(META)
        .unwrap()
        .insert("schema", version)
        .unwrap();
    txn.commit().unwrap();
}

/// Gives the first session record a format byte no release has written yet.
fn bump_first_session_format(dir: &Path, format: u8) {
    let db = redb::Database::open(dir.join(DATA_FILE)).unwrap();
    let txn = db.begin_write().unwrap();
    {
        let mut sessions = txn.open_table(SESSIONS).unwrap();
        let (id, mut bytes) = {
            let first = sessions.first().unwrap().unwrap();
            (first.0.value(), first.1.value().to_vec())
        };
        bytes[0] = format;
        sessions.insert(id, bytes.as_slice()).unwrap();
    }
    txn.commit().unwrap();
}

async fn start_error(dir: &Path) -> String {
    let mut config = test_config(&tempfile::tempdir().unwrap());
    config.data_dir = dir.to_path_buf();
    let clock = std::sync::Arc::new(ManualClock::new(UnixMs(BASE)));
    match App::start(&config, clock).await {
        Ok(app) => {
            app.shutdown().await;
            panic!("the server started on a file newer than it reads")
        }
        Err(e) => e.to_string(),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_file_of_a_newer_schema_is_refused_and_loses_nothing() {
    let dir = fixture_copy();
    stamp_schema(dir.path(), 99);

    let (code, out, err) = check(dir.path());
    assert_eq!(code, 2, "{out}{err}");
    assert!(
        err.contains("schema 99"),
        "the refusal names the version: {err}"
    );
    let message = start_error(dir.path()).await;
    assert!(message.contains("schema 99"), "{message}");

    // Refusing wrote nothing: stamped back, the file checks as 0.1.0 left it. (Its bytes do
    // change: redb rewrites its own header and allocator state on every open and close.)
    stamp_schema(dir.path(), 1);
    let (code, out, err) = check(dir.path());
    assert_eq!(code, 0, "{out}{err}");
    assert_reports_as_recorded(&out);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_record_of_a_newer_format_is_refused_with_its_version() {
    let dir = fixture_copy();
    bump_first_session_format(dir.path(), 200);

    let message = start_error(dir.path()).await;
    assert!(
        message.contains("format 200"),
        "the refusal names the format: {message}"
    );
    let (code, out, err) = check(dir.path());
    assert_ne!(code, 0, "check passed a record it cannot read:\n{out}");
    assert!(
        format!("{out}{err}").contains("format 200"),
        "check names the format: {out}{err}"
    );
    // The records this build does read are untouched: put the byte back and all is well.
    bump_first_session_format(dir.path(), 1);
    let (code, out, err) = check(dir.path());
    assert_eq!(code, 0, "{out}{err}");
}
