//! Concurrent calls of one kind sent together: while [`Batcher`]'s limit of calls is
//! unanswered, the requests that arrive meanwhile wait and go together as one call.
//!
//! A lone request is sent at once, alone (a batch of one), so it costs what it cost before;
//! a busy node pays the store's per-call cost (a statement, a commit, a wake-up of the
//! server) once per batch rather than once per request. Nothing here knows the store: the
//! `send` function given at the start answers a batch with one answer per request, in
//! order, and decides what a batch of one is.

use std::future::Future;
use std::sync::Arc;

use tokio::sync::{Semaphore, mpsc, oneshot};

type Pending<Q, A> = (Q, oneshot::Sender<A>);

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
    pub fn start<F, Fut>(in_flight: usize, max_batch: usize, send: F) -> Batcher<Q, A>
    where
        F: Fn(Vec<Q>) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = Vec<A>> + Send + 'static,
    {
        let (tx, rx) = mpsc::unbounded_channel();
        tokio::spawn(gather(rx, in_flight.max(1), max_batch.max(1), send));
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
    in_flight: usize,
    max_batch: usize,
    send: F,
) where
    Q: Send + 'static,
    A: Send + 'static,
    F: Fn(Vec<Q>) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = Vec<A>> + Send + 'static,
{
    let slots = Arc::new(Semaphore::new(in_flight));
    loop {
        // Waiting for a free slot first lets requests gather in the channel meanwhile.
        let Ok(permit) = slots.clone().acquire_owned().await else {
            return;
        };
        let Some(first) = rx.recv().await else {
            return;
        };
        let mut batch = vec![first];
        while batch.len() < max_batch {
            match rx.try_recv() {
                Ok(p) => batch.push(p),
                Err(_) => break,
            }
        }
        let (requests, replies): (Vec<Q>, Vec<oneshot::Sender<A>>) = batch.into_iter().unzip();
        let answering = send(requests);
        tokio::spawn(async move {
            let answers = answering.await;
            drop(permit);
            for (reply, answer) in replies.into_iter().zip(answers) {
                let _ = reply.send(answer);
            }
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};

    #[tokio::test]
    async fn every_request_gets_its_own_answer_and_busy_calls_go_together() {
        // Guards against answers crossed between requests, requests lost while they wait,
        // and a batcher that never batches.
        let most = Arc::new(AtomicUsize::new(0));
        let seen = most.clone();
        let batcher = Batcher::start(1, 64, move |batch: Vec<u32>| {
            seen.fetch_max(batch.len(), Ordering::SeqCst);
            async move {
                tokio::time::sleep(std::time::Duration::from_millis(5)).await;
                batch.into_iter().map(|n| n * 2).collect()
            }
        });
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
    async fn a_short_answer_leaves_the_rest_unanswered() {
        let batcher = Batcher::start(1, 8, |batch: Vec<u32>| async move {
            batch.into_iter().take(0).collect::<Vec<u32>>()
        });
        assert_eq!(batcher.call(1).await, None);
    }
}
