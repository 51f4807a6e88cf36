//! Acquire requests waiting for a held lock, first come, first served.
//!
//! Owned by the writer thread: when a key is freed the writer hands it to the first waiter
//! in the same batch, before any later request can take it, so a newcomer never overtakes
//! a waiter.

use std::collections::{BTreeSet, HashMap, VecDeque};

use tokio::sync::oneshot;

use super::EngineError;
use super::Granted;
use crate::domain::{LockKey, Mono, SessionId};

pub type GrantReply = oneshot::Sender<Result<Granted, EngineError>>;

pub struct Waiter {
    pub id: u64,
    pub session: SessionId,
    pub deadline: Mono,
    pub reply: GrantReply,
}

#[derive(Default)]
pub struct Waiters {
    next_id: u64,
    by_key: HashMap<LockKey, VecDeque<Waiter>>,
    /// (deadline, waiter id, key): the next timeout is the first entry.
    deadlines: BTreeSet<(Mono, u64, LockKey)>,
    len: usize,
}

impl Waiters {
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn next_deadline(&self) -> Option<Mono> {
        self.deadlines.first().map(|(d, _, _)| *d)
    }

    /// Queues a waiter at the back of `key`'s line.
    pub fn push(&mut self, key: LockKey, session: SessionId, deadline: Mono, reply: GrantReply) {
        self.next_id += 1;
        let id = self.next_id;
        self.deadlines.insert((deadline, id, key.clone()));
        self.by_key.entry(key).or_default().push_back(Waiter {
            id,
            session,
            deadline,
            reply,
        });
        self.len += 1;
    }

    /// The first waiter for `key`, removed from the line.
    pub fn pop(&mut self, key: &LockKey) -> Option<Waiter> {
        let line = self.by_key.get_mut(key)?;
        let waiter = line.pop_front();
        if line.is_empty() {
            self.by_key.remove(key);
        }
        if let Some(w) = &waiter {
            self.deadlines.remove(&(w.deadline, w.id, key.clone()));
            self.len -= 1;
        }
        waiter
    }

    /// Removes and returns every waiter whose deadline is at or before `now`.
    pub fn expire(&mut self, now: Mono) -> Vec<Waiter> {
        let mut out = Vec::new();
        while let Some((deadline, id, key)) = self.deadlines.first().cloned() {
            if deadline > now {
                break;
            }
            self.deadlines.pop_first();
            if let Some(line) = self.by_key.get_mut(&key) {
                if let Some(pos) = line.iter().position(|w| w.id == id) {
                    out.extend(line.remove(pos));
                    self.len -= 1;
                }
                if line.is_empty() {
                    self.by_key.remove(&key);
                }
            }
        }
        out
    }

    /// Removes every waiter, for shutdown or fail-stop.
    pub fn drain(&mut self) -> Vec<Waiter> {
        self.deadlines.clear();
        self.len = 0;
        self.by_key.drain().flat_map(|(_, line)| line).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(s: &str) -> LockKey {
        LockKey::parse("key", s).unwrap()
    }

    #[test]
    fn first_come_first_served_per_key() {
        let mut w = Waiters::default();
        let (a, b, c) = (
            SessionId::random(),
            SessionId::random(),
            SessionId::random(),
        );
        w.push(key("k"), a, Mono(100), oneshot::channel().0);
        w.push(key("other"), c, Mono(50), oneshot::channel().0);
        w.push(key("k"), b, Mono(10), oneshot::channel().0);
        assert_eq!(w.len(), 3);
        assert_eq!(w.next_deadline(), Some(Mono(10)));
        assert_eq!(w.pop(&key("k")).unwrap().session, a);
        assert_eq!(w.pop(&key("k")).unwrap().session, b);
        assert!(w.pop(&key("k")).is_none());
        assert_eq!(w.len(), 1);
        assert_eq!(w.next_deadline(), Some(Mono(50)));
    }

    #[test]
    fn expire_removes_only_due_waiters() {
        let mut w = Waiters::default();
        let (a, b) = (SessionId::random(), SessionId::random());
        w.push(key("k"), a, Mono(100), oneshot::channel().0);
        w.push(key("k"), b, Mono(200), oneshot::channel().0);
        assert!(w.expire(Mono(99)).is_empty());
        let gone = w.expire(Mono(150));
        assert_eq!(gone.len(), 1);
        assert_eq!(gone[0].session, a);
        assert_eq!(w.pop(&key("k")).unwrap().session, b);
        assert_eq!(w.len(), 0);
        assert_eq!(w.next_deadline(), None);
    }
}
