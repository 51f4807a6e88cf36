//! The writer's copy of the remembered request ids (see `crate::backend::requests`): loaded
//! from the store at start, checked before a call with a `request_id` acts, added to in the
//! batch of the change it answers, and forgotten past their retention in bounded passes.
//!
//! Owned by the writer thread alone, like the state: a check and the record it leads to are
//! in one batch, so two calls with one id cannot both act.

use std::collections::{BTreeSet, HashMap};

use crate::backend::requests::{Answer, Request, RequestCheck};
use crate::domain::{Change, RequestRecord, UnixMs};

#[derive(Default)]
pub struct Requests {
    records: HashMap<String, RequestRecord>,
    /// `(expires_at, key)` of every record, for the purge.
    by_expiry: BTreeSet<(UnixMs, String)>,
}

impl Requests {
    pub fn load(rows: Vec<(String, RequestRecord)>) -> Requests {
        let mut r = Requests::default();
        for (key, record) in rows {
            r.by_expiry.insert((record.expires_at, key.clone()));
            r.records.insert(key, record);
        }
        r
    }

    pub fn check(&self, request: &Request, now: UnixMs) -> RequestCheck {
        let record = self
            .records
            .get(&request.key)
            .map(|r| (r.fingerprint.as_str(), r.answer.as_str(), r.expires_at));
        RequestCheck::of(request, record, now)
    }

    /// Remembers `answer` for `request` until `now + retention_ms`, in the batch's commit.
    /// A live record is kept as it is: the first answer is the one retries get.
    pub fn remember(
        &mut self,
        request: Request,
        answer: &Answer,
        now: UnixMs,
        retention_ms: u64,
        changes: &mut Vec<Change>,
    ) {
        if matches!(self.check(&request, now), RequestCheck::Replay(_)) {
            return;
        }
        let record = RequestRecord {
            fingerprint: request.fingerprint,
            answer: answer.to_json(),
            expires_at: UnixMs(now.0.saturating_add(retention_ms)),
        };
        if let Some(old) = self.records.insert(request.key.clone(), record.clone()) {
            self.by_expiry
                .remove(&(old.expires_at, request.key.clone()));
        }
        self.by_expiry
            .insert((record.expires_at, request.key.clone()));
        changes.push(Change::PutRequest {
            key: request.key,
            record,
        });
    }

    /// Forgets at most `limit` records expired by `now`, oldest first; returns how many.
    pub fn purge(&mut self, now: UnixMs, limit: usize, changes: &mut Vec<Change>) -> usize {
        let due: Vec<(UnixMs, String)> = self
            .by_expiry
            .iter()
            .take_while(|(at, _)| *at <= now)
            .take(limit)
            .cloned()
            .collect();
        for entry in &due {
            self.by_expiry.remove(entry);
            self.records.remove(&entry.1);
            changes.push(Change::DeleteRequest {
                key: entry.1.clone(),
            });
        }
        due.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn req(key: &str, fp: &str) -> Request {
        Request {
            key: key.into(),
            fingerprint: fp.into(),
        }
    }

    #[test]
    fn remembers_the_first_answer_and_purges_in_bounded_passes() {
        let mut r = Requests::default();
        let mut changes = Vec::new();
        let a = Answer::Released { revision: 1 };
        r.remember(req("k1", "f"), &a, UnixMs(0), 100, &mut changes);
        // A second answer for a live id does not replace the first.
        r.remember(
            req("k1", "f"),
            &Answer::Released { revision: 2 },
            UnixMs(10),
            100,
            &mut changes,
        );
        r.remember(req("k2", "f"), &a, UnixMs(50), 100, &mut changes);
        assert_eq!(changes.len(), 2);
        assert_eq!(
            r.check(&req("k1", "f"), UnixMs(99)),
            RequestCheck::Replay(a)
        );
        assert_eq!(r.check(&req("k1", "g"), UnixMs(99)), RequestCheck::Reused);
        assert_eq!(r.check(&req("k1", "f"), UnixMs(100)), RequestCheck::New);

        changes.clear();
        assert_eq!(r.purge(UnixMs(1_000), 1, &mut changes), 1);
        assert_eq!(changes, vec![Change::DeleteRequest { key: "k1".into() }]);
        assert_eq!(r.purge(UnixMs(120), 10, &mut changes), 0);
        assert_eq!(r.purge(UnixMs(150), 10, &mut changes), 1);
        assert!(r.records.is_empty() && r.by_expiry.is_empty());

        let loaded = Requests::load(vec![(
            "k3".into(),
            RequestRecord {
                fingerprint: "f".into(),
                answer: Answer::Released { revision: 5 }.to_json(),
                expires_at: UnixMs(10),
            },
        )]);
        assert_eq!(
            loaded.check(&req("k3", "f"), UnixMs(9)),
            RequestCheck::Replay(Answer::Released { revision: 5 })
        );
    }
}
