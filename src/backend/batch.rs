//! Concurrent calls of one kind sent together: while a call is unanswered, the requests that
//! arrive meanwhile wait and go together as one call; another call goes beside it only for
//! a batch worth a call of its own ([`Limits`]).
//!
//! A lone request is sent at once, alone (a batch of one), so it costs what it cost before;
//! a busy node pays the store's per-call cost (a statement, a commit, a wake-up of the
//! server) once per batch rather than once per request. Nothing here knows the store: the
//! `send` function given at the start answers a batch with one answer per request, in
//! order, and decides what a batch of one is.

use std::collections::VecDeque;
use std::future::Future;

use tokio::sync::{mpsc, oneshot};

type Pending<Q, A> = (Q, oneshot::Sender<A>);

/// How a [`Batcher`] sends: at most `in_flight` calls unanswered at once, each of at most
/// `max_batch` requests. The first call goes as soon as a request waits; a call beside others
/// already unanswered goes only once `extra_from` requests wait, so a second slot never takes
/// a few requests alone while a full batch could form behind the call in flight.
#[derive(Clone, Copy, Debug)]
pub struct Limits {
    pub in_flight: usize,
    pub max_batch: usize,
    pub extra_from: usize,
}

/// Gathers requests `Q` into batches and hands each its answer `A`. Cheap to clone; the task
/// that gathers ends when the last clone is dropped.
pub struct Batcher<Q, A> {
    tx: mpsc::UnboundedSender<Pending<Q, A>>,
}

impl<Q, A> Clone for Batcher<Q, A> {
    fn clone(&self) -> Self {
        Batcher {
            tx: self.tx.clone(),
        }
    }
}

impl<Q: Send + 'static, A: Send + 'static> Batcher<Q, A> {
    /// Starts the gathering task: at most `in_flight` batches of at most `max_batch`
    /// requests are unanswered at once. `send` must answer every request of its batch, in
    /// order (a shorter answer leaves the last requests unanswered, which [`Batcher::call`]
    /// reports as `None`).
    pub fn start<F, Fut>(limits: Limits, send: F) -> Batcher<Q, A>
    where
        F: Fn(Vec<Q>) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = Vec<A>> + Send + 'static,
    {
        let (tx, rx) = mpsc::unbounded_channel();
        let limits = Limits {
            in_flight: limits.in_flight.max(1),
            max_batch: limits.max_batch.max(1),
            extra_from: limits.extra_from.max(1),
        };
        tokio::spawn(gather(rx, limits, send));
        Batcher { tx }
    }

    /// Sends `request` with whatever else is waiting and returns its answer; `None` when no
    /// answer came (the gathering task is gone, or `send` answered too few).
    pub async fn call(&self, request: Q) -> Option<A> {
        let (reply, answer) = oneshot::channel();
        self.tx.send((request, reply)).ok()?;
        answer.await.ok()
    }
}

async fn gather<Q, A, F, Fut>(
    mut rx: mpsc::UnboundedReceiver<Pending<Q, A>>,
    limits: Limits,
    send: F,
) where
    Q: Send + 'static,
    A: Send + 'static,
    F: Fn(Vec<Q>) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = Vec<A>> + Send + 'static,
{
    let (done_tx, mut done) = mpsc::unbounded_channel::<()>();
    let mut waiting: VecDeque<Pending<Q, A>> = VecDeque::new();
    let mut running = 0usize;
    let mut open = true;
    loop {
        // Everything that arrived so far waits in `waiting`, oldest first.
        while let Ok(p) = rx.try_recv() {
            waiting.push_back(p);
        }
        let due = match running {
            0 => !waiting.is_empty(),
            n if n < limits.in_flight => waiting.len() >= limits.extra_from,
            _ => false,
        };
        if due {
            let n = waiting.len().min(limits.max_batch);
            let (requests, replies): (Vec<Q>, Vec<oneshot::Sender<A>>) = waiting.drain(..n).unzip();
            let answering = send(requests);
            let done_tx = done_tx.clone();
            running += 1;
            tokio::spawn(async move {
                let answers = answering.await;
                let _ = done_tx.send(());
                for (reply, answer) in replies.into_iter().zip(answers) {
                    let _ = reply.send(answer);
                }
            });
            continue;
        }
        if !open && waiting.is_empty() && running == 0 {
            return;
        }
        tokio::select! {
            p = rx.recv(), if open => match p {
                Some(p) => waiting.push_back(p),
                None => open = false,
            },
            Some(()) = done.recv(), if running > 0 => running -= 1,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;
    use std::sync::atomic::{AtomicUsize, Ordering};

    #[tokio::test]
    async fn every_request_gets_its_own_answer_and_busy_calls_go_together() {
        // Guards against answers crossed between requests, requests lost while they wait,
        // and a batcher that never batches.
        let most = Arc::new(AtomicUsize::new(0));
        let seen = most.clone();
        let batcher = Batcher::start(
            Limits {
                in_flight: 1,
                max_batch: 64,
                extra_from: 1,
            },
            move |batch: Vec<u32>| {
                seen.fetch_max(batch.len(), Ordering::SeqCst);
                async move {
                    tokio::time::sleep(std::time::Duration::from_millis(5)).await;
                    batch.into_iter().map(|n| n * 2).collect()
                }
            },
        );
        let tasks: Vec<_> = (0..500u32)
            .map(|n| {
                let b = batcher.clone();
                tokio::spawn(async move { (n, b.call(n).await) })
            })
            .collect();
        for t in tasks {
            let (n, answer) = t.await.unwrap();
            assert_eq!(answer, Some(n * 2));
        }
        assert!(
            most.load(Ordering::SeqCst) > 1,
            "no two requests went together"
        );
        assert!(most.load(Ordering::SeqCst) <= 64);
    }

    #[tokio::test]
    async fn a_call_beside_one_unanswered_waits_for_a_batch_worth_it() {
        // Guards against a free slot taking a few requests alone while a call is unanswered,
        // and against requests stranded once enough of them wait or the call answers.
        let (sizes_tx, mut sizes) = mpsc::unbounded_channel::<usize>();
        let gate = Arc::new(tokio::sync::Semaphore::new(0));
        let held = gate.clone();
        let limits = Limits {
            in_flight: 2,
            max_batch: 64,
            extra_from: 4,
        };
        let batcher = Batcher::start(limits, move |batch: Vec<u32>| {
            let _ = sizes_tx.send(batch.len());
            let gate = held.clone();
            async move {
                gate.acquire().await.unwrap().forget();
                batch
            }
        });
        let call = |n: u32| {
            let b = batcher.clone();
            tokio::spawn(async move { b.call(n).await })
        };
        let first = call(0);
        assert_eq!(sizes.recv().await, Some(1), "a lone request goes at once");
        let waiting: Vec<_> = (1..4).map(call).collect();
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
        assert!(
            sizes.try_recv().is_err(),
            "three waiting requests took the second slot"
        );
        let fourth = call(4);
        assert_eq!(
            sizes.recv().await,
            Some(4),
            "four waiting go beside the first"
        );
        let fifth = call(5);
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
        assert!(sizes.try_recv().is_err(), "both slots are taken");
        gate.add_permits(1);
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
        assert!(
            sizes.try_recv().is_err(),
            "one request took the slot beside a call still unanswered"
        );
        gate.add_permits(1);
        assert_eq!(sizes.recv().await, Some(1), "with none unanswered, it goes");
        gate.add_permits(1);
        assert_eq!(first.await.unwrap(), Some(0));
        for (n, t) in (1..4).zip(waiting) {
            assert_eq!(t.await.unwrap(), Some(n));
        }
        assert_eq!(fourth.await.unwrap(), Some(4));
        assert_eq!(fifth.await.unwrap(), Some(5));
    }

    #[tokio::test]
    async fn a_short_answer_leaves_the_rest_unanswered() {
        let batcher = Batcher::start(
            Limits {
                in_flight: 1,
                max_batch: 8,
                extra_from: 1,
            },
            |batch: Vec<u32>| async move { batch.into_iter().take(0).collect::<Vec<u32>>() },
        );
        assert_eq!(batcher.call(1).await, None);
    }
}
