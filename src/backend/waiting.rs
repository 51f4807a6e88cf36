//! Waiting for a resource — a held lock, a full pool, an empty queue — for backends whose
//! authority is a shared database: first come, first served among the requests of this
//! node.
//!
//! Each resource has a node-local line. Only the head of a line asks the database again,
//! when the resource may have been freed (a wake from this node's own commits or from the
//! database's notifications) and otherwise at least every `recheck`, so a lost notification
//! delays a waiter but never strands it. A newcomer that finds others in line may not take
//! the resource ahead of them: its first attempt is made with `may_take` false (it may still
//! get back what it already holds, or learn that its session is gone). Deadlines are judged
//! on the injected [`Clock`], polled at least every [`POLL`].

use std::collections::{HashMap, VecDeque};
use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use parking_lot::Mutex;
use prometheus_client::metrics::gauge::Gauge;
use tokio::sync::{Notify, watch};

use crate::backend::{BackendError, Granted};
use crate::clock::Clock;
use crate::domain::{LockKey, Mono, PoolName, QueueName};
use crate::metrics::Metrics;

/// How often a waiter looks at the clock for its deadline.
pub const POLL: Duration = Duration::from_millis(100);

/// The longest a request that does not wait stands behind the line for its turn.
pub const TURN: Duration = Duration::from_secs(2);

/// What a waiter waits for.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum Resource {
    Lock(LockKey),
    Pool(PoolName),
    Queue(QueueName),
}

impl Resource {
    /// The text that names this resource in a notification: `lock:KEY`, `pool:NAME`,
    /// `queue:NAME`.
    pub fn to_payload(&self) -> String {
        match self {
            Resource::Lock(k) => format!("lock:{k}"),
            Resource::Pool(p) => format!("pool:{p}"),
            Resource::Queue(q) => format!("queue:{q}"),
        }
    }

    pub fn from_payload(text: &str) -> Option<Resource> {
        let (kind, name) = text.split_once(':')?;
        let name = LockKey::parse("key", name).ok()?;
        match kind {
            "lock" => Some(Resource::Lock(name)),
            "pool" => Some(Resource::Pool(name)),
            "queue" => Some(Resource::Queue(name)),
            _ => None,
        }
    }
}

/// One attempt's outcome: done (granted, or an answer that ends the wait), or busy with what
/// to answer should the wait end now.
#[derive(Debug)]
pub enum Step<T, B> {
    Done(T),
    Busy(B),
    /// Not taken because others wait ahead, though there may be room once they are served:
    /// even a request that does not wait takes its turn behind them before it is answered.
    Room(B),
}

struct Line {
    waiters: VecDeque<(u64, Arc<Notify>)>,
}

#[derive(Default)]
struct Lines {
    next_id: u64,
    lines: HashMap<Resource, Line>,
    len: usize,
}

/// The node's waiting lines. Cheap to share behind an `Arc`.
pub struct Waiting {
    lines: Mutex<Lines>,
    clock: Arc<dyn Clock>,
    recheck: Duration,
    draining: AtomicBool,
    drain: watch::Sender<bool>,
    gauge: Gauge,
}

impl Waiting {
    /// `gauge` counts the waiters (the `waiters` metric).
    pub fn new(clock: Arc<dyn Clock>, recheck: Duration, gauge: Gauge) -> Waiting {
        Waiting {
            lines: Mutex::new(Lines::default()),
            clock,
            recheck,
            draining: AtomicBool::new(false),
            drain: watch::channel(false).0,
            gauge,
        }
    }

    /// How many wait for `resource` on this node.
    pub fn waiting(&self, resource: &Resource) -> usize {
        self.lines
            .lock()
            .lines
            .get(resource)
            .map_or(0, |l| l.waiters.len())
    }

    pub fn len(&self) -> usize {
        self.lines.lock().len
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// `resource` may have been freed: its first waiter asks again.
    pub fn wake(&self, resource: &Resource) {
        if let Some(line) = self.lines.lock().lines.get(resource)
            && let Some((_, n)) = line.waiters.front()
        {
            n.notify_one();
        }
    }

    /// Anything may have been freed (notifications may have been lost): every first waiter
    /// asks again.
    pub fn wake_all(&self) {
        for line in self.lines.lock().lines.values() {
            if let Some((_, n)) = line.waiters.front() {
                n.notify_one();
            }
        }
    }

    /// From now on every waiter, present or future, is answered `ShuttingDown`.
    pub fn drain(&self) {
        self.draining.store(true, Ordering::SeqCst);
        self.drain.send_replace(true);
    }

    fn is_draining(&self) -> bool {
        self.draining.load(Ordering::SeqCst)
    }

    fn join(&self, resource: &Resource) -> Ticket<'_> {
        let mut lines = self.lines.lock();
        lines.next_id += 1;
        let id = lines.next_id;
        let notify = Arc::new(Notify::new());
        lines
            .lines
            .entry(resource.clone())
            .or_insert_with(|| Line {
                waiters: VecDeque::new(),
            })
            .waiters
            .push_back((id, notify.clone()));
        lines.len += 1;
        self.gauge.set(lines.len as i64);
        Ticket {
            waiting: self,
            resource: resource.clone(),
            id,
            notify,
        }
    }

    /// A lock acquire in its key's line: the grant, or `LockHeld` when the wait ends without
    /// it. For backends whose attempts go to a shared store (PostgreSQL, Redis).
    pub async fn lock<F, Fut>(
        &self,
        key: LockKey,
        deadline: Option<Mono>,
        attempt: F,
    ) -> Result<Granted, BackendError>
    where
        F: FnMut(bool) -> Fut,
        Fut: Future<Output = Result<Step<Granted, ()>, BackendError>>,
    {
        match self.run(Resource::Lock(key), deadline, attempt).await? {
            Step::Done(g) => Ok(g),
            Step::Busy(()) | Step::Room(()) => Err(BackendError::LockHeld),
        }
    }

    /// A seat request in its pool's line: the grant (its wait observed in `seat_wait_seconds`),
    /// or `PoolExhausted` with what the last try saw (counted in `seats_refused`).
    pub async fn seat<F, Fut>(
        &self,
        pool: PoolName,
        deadline: Option<Mono>,
        metrics: &Metrics,
        attempt: F,
    ) -> Result<Granted, BackendError>
    where
        F: FnMut(bool) -> Fut,
        Fut: Future<Output = Result<Step<Granted, (u32, usize)>, BackendError>>,
    {
        let started = Instant::now();
        match self.run(Resource::Pool(pool), deadline, attempt).await? {
            Step::Done(g) => {
                metrics
                    .seat_wait_seconds
                    .observe(started.elapsed().as_secs_f64());
                Ok(g)
            }
            Step::Busy((capacity, in_use)) | Step::Room((capacity, in_use)) => {
                metrics.seats_refused.inc();
                Err(BackendError::PoolExhausted { capacity, in_use })
            }
        }
    }

    /// A claim in its queue's line: the job (its wait observed in `claim_wait_seconds`), or
    /// `None` when the wait ends with nothing to claim.
    pub async fn claim<T, F, Fut>(
        &self,
        queue: QueueName,
        deadline: Option<Mono>,
        metrics: &Metrics,
        attempt: F,
    ) -> Result<Option<T>, BackendError>
    where
        F: FnMut(bool) -> Fut,
        Fut: Future<Output = Result<Step<T, ()>, BackendError>>,
    {
        let started = Instant::now();
        match self.run(Resource::Queue(queue), deadline, attempt).await? {
            Step::Done(c) => {
                metrics
                    .claim_wait_seconds
                    .observe(started.elapsed().as_secs_f64());
                Ok(Some(c))
            }
            Step::Busy(()) | Step::Room(()) => Ok(None),
        }
    }

    /// Runs `attempt` until it is done or `deadline` (on the injected clock) has passed;
    /// `None` asks once and does not wait for the resource (though it may wait its turn behind
    /// the line, see [`Step::Room`]). `attempt(may_take)` must not take the resource when
    /// `may_take` is false. Returns the last busy outcome when the wait ends without it.
    pub async fn run<T, B, F, Fut>(
        &self,
        resource: Resource,
        deadline: Option<Mono>,
        mut attempt: F,
    ) -> Result<Step<T, B>, BackendError>
    where
        F: FnMut(bool) -> Fut,
        Fut: Future<Output = Result<Step<T, B>, BackendError>>,
    {
        // While draining nobody starts to wait: a request is answered at once.
        let deadline = deadline.filter(|_| !self.is_draining());
        let ahead = self.waiting(&resource) > 0;
        let (mut last, room) = match attempt(!ahead).await? {
            Step::Done(t) => return Ok(Step::Done(t)),
            Step::Busy(b) => (b, false),
            Step::Room(b) => (b, true),
        };
        // A request that does not wait but found room behind the line waits its turn, and
        // no longer than TURN, then asks once.
        let turn = (deadline.is_none() && room).then(|| Instant::now() + TURN);
        if deadline.is_none() && turn.is_none() {
            return Ok(Step::Busy(last));
        }
        let ticket = self.join(&resource);
        let mut drain = self.drain.subscribe();
        let mut asked = Instant::now();
        let over = |last_now: Instant| {
            deadline.is_some_and(|d| self.clock.now() >= d) || turn.is_some_and(|t| last_now >= t)
        };
        // A drain answers every waiter at once; one only waiting its turn is answered as if
        // it had not waited.
        let drained = |last| match turn {
            Some(_) => Ok(Step::Busy(last)),
            None => Err(BackendError::ShuttingDown),
        };
        loop {
            if self.is_draining() {
                return drained(last);
            }
            if over(Instant::now()) {
                return Ok(Step::Busy(last));
            }
            let woken = tokio::select! {
                _ = ticket.notify.notified() => true,
                _ = tokio::time::sleep(POLL) => false,
                _ = drain.changed() => false,
            };
            if self.is_draining() {
                return drained(last);
            }
            if over(Instant::now()) {
                return Ok(Step::Busy(last));
            }
            if ticket.is_head() && (woken || turn.is_some() || asked.elapsed() >= self.recheck) {
                asked = Instant::now();
                match attempt(true).await? {
                    Step::Done(t) => return Ok(Step::Done(t)),
                    Step::Busy(b) | Step::Room(b) if turn.is_some() => return Ok(Step::Busy(b)),
                    Step::Busy(b) | Step::Room(b) => last = b,
                }
            }
        }
    }
}

/// A place in a line; leaving it (by drop: done, timed out, or the client went away) hands
/// the head to the next waiter and wakes it, since what was not taken may be there for it.
struct Ticket<'a> {
    waiting: &'a Waiting,
    resource: Resource,
    id: u64,
    notify: Arc<Notify>,
}

impl Ticket<'_> {
    fn is_head(&self) -> bool {
        self.waiting
            .lines
            .lock()
            .lines
            .get(&self.resource)
            .and_then(|l| l.waiters.front())
            .is_some_and(|(id, _)| *id == self.id)
    }
}

impl Drop for Ticket<'_> {
    fn drop(&mut self) {
        let mut lines = self.waiting.lines.lock();
        let Some(line) = lines.lines.get_mut(&self.resource) else {
            return;
        };
        let Some(pos) = line.waiters.iter().position(|(id, _)| *id == self.id) else {
            return;
        };
        line.waiters.remove(pos);
        if pos == 0
            && let Some((_, next)) = line.waiters.front()
        {
            next.notify_one();
        }
        if line.waiters.is_empty() {
            lines.lines.remove(&self.resource);
        }
        lines.len -= 1;
        self.waiting.gauge.set(lines.len as i64);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::clock::ManualClock;
    use crate::domain::UnixMs;
    use std::sync::atomic::AtomicU32;

    fn key(s: &str) -> Resource {
        Resource::Lock(LockKey::parse("key", s).unwrap())
    }

    fn waiting(clock: &ManualClock) -> Arc<Waiting> {
        Arc::new(Waiting::new(
            Arc::new(clock.clone()),
            Duration::from_secs(1),
            Gauge::default(),
        ))
    }

    #[test]
    fn payloads_round_trip() {
        for r in [
            key("a:b"),
            Resource::Pool(LockKey::parse("p", "x").unwrap()),
        ] {
            assert_eq!(Resource::from_payload(&r.to_payload()), Some(r));
        }
        assert_eq!(Resource::from_payload("nope"), None);
        assert_eq!(Resource::from_payload("other:x"), None);
    }

    #[tokio::test]
    async fn served_in_arrival_order_and_times_out_on_the_clock() {
        let clock = ManualClock::new(UnixMs(0));
        let w = waiting(&clock);
        let free = Arc::new(AtomicBool::new(false));
        let order = Arc::new(Mutex::new(Vec::new()));
        let mut tasks = Vec::new();
        for i in 0..3 {
            let (w2, free, order) = (w.clone(), free.clone(), order.clone());
            tasks.push(tokio::spawn(async move {
                let r = w2
                    .run(key("k"), Some(Mono(10_000)), |may_take| {
                        let free = free.clone();
                        let order = order.clone();
                        async move {
                            if may_take && free.swap(false, Ordering::SeqCst) {
                                order.lock().push(i);
                                Ok(Step::Done(i))
                            } else {
                                Ok(Step::Busy(()))
                            }
                        }
                    })
                    .await;
                r.map(|s| matches!(s, Step::Done(_)))
            }));
            // Arrive one after another.
            while w.waiting(&key("k")) < i + 1 {
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
        }
        for _ in 0..2 {
            free.store(true, Ordering::SeqCst);
            w.wake(&key("k"));
            while free.load(Ordering::SeqCst) {
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
        }
        assert_eq!(*order.lock(), vec![0, 1]);
        // The third times out once the clock passes its deadline, without being freed.
        clock.advance(10_000);
        let results: Vec<_> = futures_join(tasks).await;
        assert_eq!(results, vec![true, true, false]);
        assert!(w.is_empty());
    }

    #[tokio::test]
    async fn a_newcomer_may_not_take_ahead_of_the_line_and_drain_answers_at_once() {
        let clock = ManualClock::new(UnixMs(0));
        let w = waiting(&clock);
        let w2 = w.clone();
        let first = tokio::spawn(async move {
            w2.run(key("k"), Some(Mono(60_000)), |_| async {
                Ok::<_, BackendError>(Step::<(), ()>::Busy(()))
            })
            .await
        });
        while w.waiting(&key("k")) == 0 {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        let asked = Arc::new(AtomicU32::new(0));
        let a = asked.clone();
        let r = w
            .run(key("k"), None, move |may_take| {
                assert!(!may_take, "someone waits ahead");
                a.fetch_add(1, Ordering::SeqCst);
                async { Ok::<_, BackendError>(Step::<(), ()>::Busy(())) }
            })
            .await
            .unwrap();
        assert!(matches!(r, Step::Busy(())));
        assert_eq!(asked.load(Ordering::SeqCst), 1);
        w.drain();
        assert!(matches!(
            first.await.unwrap(),
            Err(BackendError::ShuttingDown)
        ));
    }

    async fn futures_join(
        tasks: Vec<tokio::task::JoinHandle<Result<bool, BackendError>>>,
    ) -> Vec<bool> {
        let mut out = Vec::new();
        for t in tasks {
            out.push(t.await.unwrap().unwrap());
        }
        out
    }
}
