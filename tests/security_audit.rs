//! The audit log's hash chain in the embedded data file: a log written by the server
//! verifies, an event edited in the file is reported by the integrity check (the library's
//! and `leasehold check`'s), and trimming old events leaves a chain that still verifies.
//! Embedded only: the chain is the embedded store's; PostgreSQL has its own.
mod common;

use std::process::Command;

use common::*;
use leasehold::backend::embedded::store::Store;
use redb::{ReadableTable, TableDefinition};

/// The events table as the store defines it.
const EVENTS: TableDefinition<u64, &[u8]> = TableDefinition::new("events");

fn data_file(dir: &std::path::Path) -> std::path::PathBuf {
    std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .find(|p| p.extension().is_some_and(|e| e == "redb"))
        .expect("a redb data file")
}

#[tokio::test]
async fn an_edited_event_is_detected() {
    let data = tempfile::tempdir().unwrap();
    let dir = data.path().to_path_buf();
    let s = TestServer::start_with(|c| c.data_dir = dir.clone()).await;
    for owner in ["alice", "bob", "carol"] {
        let id = s.open(owner, 10_000).await;
        assert_eq!(s.acquire(&format!("k/{owner}"), &id).await.status, 200);
    }
    s.stop().await;

    // As written, the chain verifies.
    let report = Store::open(&dir, 4 << 20).unwrap().check().unwrap();
    assert!(report.problems.is_empty(), "{:?}", report.problems);
    assert!(report.events >= 6, "{}", report.events);

    // Someone edits bob's event in the file, keeping it well-formed: "bob" becomes "bov".
    let edited = {
        let db = redb::Database::open(data_file(&dir)).unwrap();
        let txn = db.begin_write().unwrap();
        let mut edited = None;
        {
            let mut events = txn.open_table(EVENTS).unwrap();
            let rows: Vec<(u64, Vec<u8>)> = events
                .iter()
                .unwrap()
                .map(|r| {
                    let (k, v) = r.unwrap();
                    (k.value(), v.value().to_vec())
                })
                .collect();
            for (seq, mut bytes) in rows {
                if let Some(i) = bytes.windows(3).position(|w| w == b"bob") {
                    bytes[i + 2] = b'v';
                    events.insert(seq, bytes.as_slice()).unwrap();
                    edited = Some(seq);
                    break;
                }
            }
        }
        txn.commit().unwrap();
        edited.expect("an event names bob")
    };

    let report = Store::open(&dir, 4 << 20).unwrap().check().unwrap();
    assert_eq!(report.problems.len(), 1, "{:?}", report.problems);
    assert!(
        report.problems[0].contains(&format!("event {edited} does not match its hash")),
        "{:?}",
        report.problems
    );
    // The command says so too, with exit status 1.
    let out = Command::new(env!("CARGO_BIN_EXE_leasehold"))
        .args(["check", "--data-dir", dir.to_str().unwrap()])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    let text =
        String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
    assert!(text.contains("does not match its hash"), "{text}");
}

#[tokio::test]
async fn trimming_keeps_the_chain_verifiable() {
    let data = tempfile::tempdir().unwrap();
    let dir = data.path().to_path_buf();
    let s = TestServer::start_with(|c| {
        c.data_dir = dir.clone();
        c.event_retention_ms = 1_000;
    })
    .await;
    for i in 0..5 {
        s.open(&format!("old{i}"), 10_000).await;
    }
    // Past the retention: a reap trims the old events.
    s.advance(20_000).await;
    assert_eq!(s.reap().await.status, 200);
    let trimmed = metric(&s, "leasehold_events_trimmed_total")
        .await
        .unwrap_or(0.0);
    assert!(trimmed >= 5.0, "{trimmed} events trimmed");
    for i in 0..3 {
        s.open(&format!("new{i}"), 10_000).await;
    }
    s.stop().await;
    let report = Store::open(&dir, 4 << 20).unwrap().check().unwrap();
    assert!(report.problems.is_empty(), "{:?}", report.problems);
    let events = report.events;
    assert!(events > 0);
    // Deleting an event in the middle of what is kept breaks the chain after it.
    {
        let db = redb::Database::open(data_file(&dir)).unwrap();
        let txn = db.begin_write().unwrap();
        {
            let mut t = txn.open_table(EVENTS).unwrap();
            let seqs: Vec<u64> = t.iter().unwrap().map(|r| r.unwrap().0.value()).collect();
            assert!(seqs.len() >= 3, "{seqs:?}");
            t.remove(seqs[seqs.len() / 2]).unwrap();
        }
        txn.commit().unwrap();
    }
    let report = Store::open(&dir, 4 << 20).unwrap().check().unwrap();
    assert!(
        report
            .problems
            .iter()
            .any(|p| p.contains("does not match its hash")),
        "{:?}",
        report.problems
    );
}
