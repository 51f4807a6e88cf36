//! Requests waiting for a resource — a held lock, a full pool, an empty queue — first come,
//! first served per resource.
//!
//! Owned by the writer thread: when a resource frees up the writer serves its first waiter
//! in the same batch, before any later request can take it, so a newcomer never overtakes
//! a waiter.

use std::collections::{BTreeSet, HashMap, VecDeque};

use super::commands::{Pending, Reply, pend};
use crate::backend::requests::Request;
use crate::backend::{BackendError, Claimed, Granted};
use crate::domain::{LockKey, Mono, PoolName, QueueName, SessionId};

/// What a waiter waits for.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Resource {
    Lock(LockKey),
    Pool(PoolName),
    Queue(QueueName),
}

/// What a waiter wants, with where its answer goes.
pub enum Want {
    /// With the request to remember the grant for, when the call carried a `request_id`.
    Lock(Reply<Granted>, Option<Request>),
    Seat {
        metadata: String,
        reply: Reply<Granted>,
        request: Option<Request>,
    },
    Claim(Reply<Option<Claimed>>, Option<Request>),
}

impl Want {
    /// The request id the waiting call carried, if any.
    pub fn request(&self) -> Option<&Request> {
        match self {
            Want::Lock(_, r) | Want::Seat { request: r, .. } | Want::Claim(_, r) => r.as_ref(),
        }
    }

    /// The client stopped waiting (its connection closed).
    pub fn abandoned(&self) -> bool {
        match self {
            Want::Lock(r, _) | Want::Seat { reply: r, .. } => r.is_closed(),
            Want::Claim(r, _) => r.is_closed(),
        }
    }

    /// Holds an error back until the batch that decided it has committed (see [`pend`]).
    pub fn fail_later(self, pending: &mut Vec<Pending>, e: BackendError) {
        match self {
            Want::Lock(r, _) | Want::Seat { reply: r, .. } => pend(pending, r, Err(e)),
            Want::Claim(r, _) => pend(pending, r, Err(e)),
        }
    }

    /// Answers with an error at once: one that claims nothing about the state (shutdown,
    /// fail-stop).
    pub fn fail(self, e: BackendError) {
        match self {
            Want::Lock(r, _) | Want::Seat { reply: r, .. } => {
                let _ = r.send(Err(e));
            }
            Want::Claim(r, _) => {
                let _ = r.send(Err(e));
            }
        }
    }
}

pub struct Waiter {
    pub id: u64,
    pub session: SessionId,
    pub deadline: Mono,
    pub want: Want,
}

#[derive(Default)]
pub struct Waiters {
    next_id: u64,
    lines: HashMap<Resource, VecDeque<Waiter>>,
    /// (deadline, waiter id, resource): the next timeout is the first entry.
    deadlines: BTreeSet<(Mono, u64, Resource)>,
    len: usize,
}

impl Waiters {
    pub fn len(&self) -> usize {
        self.len
    }

    /// How many wait for `resource`.
    pub fn waiting(&self, resource: &Resource) -> usize {
        self.lines.get(resource).map_or(0, VecDeque::len)
    }

    pub fn next_deadline(&self) -> Option<Mono> {
        self.deadlines.first().map(|(d, _, _)| *d)
    }

    /// Queues a waiter at the back of `resource`'s line.
    pub fn push(&mut self, resource: Resource, session: SessionId, deadline: Mono, want: Want) {
        self.next_id += 1;
        let id = self.next_id;
        self.deadlines.insert((deadline, id, resource.clone()));
        self.lines.entry(resource).or_default().push_back(Waiter {
            id,
            session,
            deadline,
            want,
        });
        self.len += 1;
    }

    /// Puts a waiter back at the front of its line (it could not be served after all).
    pub fn push_front(&mut self, resource: Resource, waiter: Waiter) {
        self.deadlines
            .insert((waiter.deadline, waiter.id, resource.clone()));
        self.lines.entry(resource).or_default().push_front(waiter);
        self.len += 1;
    }

    /// The first waiter for `resource`, removed from the line.
    pub fn pop(&mut self, resource: &Resource) -> Option<Waiter> {
        let line = self.lines.get_mut(resource)?;
        let waiter = line.pop_front();
        if line.is_empty() {
            self.lines.remove(resource);
        }
        if let Some(w) = &waiter {
            self.deadlines.remove(&(w.deadline, w.id, resource.clone()));
            self.len -= 1;
        }
        waiter
    }

    /// Removes and returns every waiter whose deadline is at or before `now`.
    pub fn expire(&mut self, now: Mono) -> Vec<(Resource, Waiter)> {
        let mut out = Vec::new();
        while let Some((deadline, id, resource)) = self.deadlines.first().cloned() {
            if deadline > now {
                break;
            }
            self.deadlines.pop_first();
            if let Some(line) = self.lines.get_mut(&resource) {
                if let Some(pos) = line.iter().position(|w| w.id == id) {
                    out.extend(line.remove(pos).map(|w| (resource.clone(), w)));
                    self.len -= 1;
                }
                if line.is_empty() {
                    self.lines.remove(&resource);
                }
            }
        }
        out
    }

    /// Removes every waiter of `resource` (a pool that was deleted).
    pub fn take_all(&mut self, resource: &Resource) -> Vec<Waiter> {
        let mut out = Vec::new();
        while let Some(w) = self.pop(resource) {
            out.push(w);
        }
        out
    }

    /// Removes every waiter, for shutdown or fail-stop.
    pub fn drain(&mut self) -> Vec<Waiter> {
        self.deadlines.clear();
        self.len = 0;
        self.lines.drain().flat_map(|(_, line)| line).collect()
    }
}

#[cfg(test)]
mod tests {
    use tokio::sync::oneshot;

    use super::*;

    fn lock(s: &str) -> Resource {
        Resource::Lock(LockKey::parse("key", s).unwrap())
    }

    fn want() -> Want {
        Want::Lock(oneshot::channel().0, None)
    }

    #[test]
    fn first_come_first_served_per_resource() {
        let mut w = Waiters::default();
        let (a, b, c) = (
            SessionId::random(),
            SessionId::random(),
            SessionId::random(),
        );
        w.push(lock("k"), a, Mono(100), want());
        w.push(lock("other"), c, Mono(50), want());
        w.push(lock("k"), b, Mono(10), want());
        assert_eq!(w.len(), 3);
        assert_eq!(w.waiting(&lock("k")), 2);
        assert_eq!(w.next_deadline(), Some(Mono(10)));
        let first = w.pop(&lock("k")).unwrap();
        assert_eq!(first.session, a);
        w.push_front(lock("k"), first);
        assert_eq!(w.pop(&lock("k")).unwrap().session, a);
        assert_eq!(w.pop(&lock("k")).unwrap().session, b);
        assert!(w.pop(&lock("k")).is_none());
        assert_eq!(w.len(), 1);
        assert_eq!(w.next_deadline(), Some(Mono(50)));
    }

    #[test]
    fn expire_removes_only_due_waiters() {
        let mut w = Waiters::default();
        let (a, b) = (SessionId::random(), SessionId::random());
        w.push(lock("k"), a, Mono(100), want());
        w.push(lock("k"), b, Mono(200), want());
        assert!(w.expire(Mono(99)).is_empty());
        let gone = w.expire(Mono(150));
        assert_eq!(gone.len(), 1);
        assert_eq!(gone[0].1.session, a);
        assert_eq!(w.pop(&lock("k")).unwrap().session, b);
        assert_eq!(w.len(), 0);
        assert_eq!(w.next_deadline(), None);
    }
}
