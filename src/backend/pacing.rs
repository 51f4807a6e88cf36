//! How many sessions a background reaper pass may end: as many as fit in its share of the
//! writer's (or the shared store's) time, learned from the passes so far.

use std::time::Duration;

/// Sizes reaper passes so that one adds about its budget to the batch it rides.
///
/// A pass rides a group commit with whatever live requests are queued, so what it costs
/// them is what it adds to that batch: its in-memory work and what its changes add to the
/// commit (the B-tree writes and the pages they dirty). The commit a batch pays anyway —
/// measured on batches that carried no pass — is not charged to the pass: charging a share
/// of the whole commit, sync included, made every pass look as slow as a sync, and on a
/// disk whose sync takes longer than the budget a storm crawled at the smallest pass, one
/// sync per 64 sessions.
///
/// The budget is `reaper_pass_ms`, or the commit of a batch without a pass when that is
/// longer: a pass then at most about doubles what a live request waits for its batch,
/// whatever the disk, and a slow disk works a storm off in larger passes instead of more
/// syncs. Only batches without a pass teach that commit time, so the budget cannot feed on
/// the passes it sizes. Costs are smoothed so one slow pass (a busy core) shrinks the next
/// without collapsing it, and the size stays within `[MIN_PASS, max]`: a pass always makes
/// progress, and never ends more than the configured batch.
#[derive(Debug, Clone)]
pub struct PassSizer {
    budget: Duration,
    max: usize,
    /// Smoothed cost a pass adds per session it ends, in nanoseconds; `None` before the
    /// first pass.
    per_session_ns: Option<f64>,
    /// Smoothed commit time of batches without a pass, in nanoseconds.
    commit_ns: Option<f64>,
    /// The quickest commit seen, in nanoseconds: what a batch costs at the least, standing
    /// in for `commit_ns` before any batch without a pass has committed.
    quickest_ns: Option<f64>,
}

/// What a paced pass did in the batch that committed it.
#[derive(Debug, Clone, Copy)]
pub struct PassCost {
    /// Sessions it ended.
    pub sessions: usize,
    /// Its in-memory work, before the commit.
    pub domain: Duration,
    /// Its part of the batch's changes, from 0 to 1.
    pub share: f64,
}

/// The fewest sessions a pass asks for, however slow the last ones were.
pub const MIN_PASS: usize = 64;

fn smooth(old: Option<f64>, sample: f64) -> f64 {
    match old {
        None => sample,
        Some(old) => 0.5 * old + 0.5 * sample,
    }
}

impl PassSizer {
    pub fn new(budget: Duration, max: usize) -> PassSizer {
        PassSizer {
            budget,
            max: max.max(1),
            per_session_ns: None,
            commit_ns: None,
            quickest_ns: None,
        }
    }

    /// What a batch's commit costs without a pass, as far as known.
    fn baseline_ns(&self) -> f64 {
        self.commit_ns.or(self.quickest_ns).unwrap_or(0.0)
    }

    /// How long the next pass may add to its batch: the configured budget, or the commit of
    /// a batch without a pass when that takes longer.
    pub fn budget(&self) -> Duration {
        self.budget
            .max(Duration::from_nanos(self.baseline_ns() as u64))
    }

    /// How many sessions the next pass asks for. The first pass is modest, so that a
    /// storm's first pass does not hold the writer for the whole of a large batch.
    pub fn next(&self) -> usize {
        let want = match self.per_session_ns {
            None => MIN_PASS * 4,
            Some(ns) => (self.budget().as_nanos() as f64 / ns.max(1.0)) as usize,
        };
        want.clamp(MIN_PASS.min(self.max), self.max)
    }

    /// Learns from a pass that is one call of its own to a shared store (Redis), not a share
    /// of a batch's commit: `sessions` ended in `held` of the store's own time, in a call
    /// that took `round_trip` from the node's side. What the call took beyond `held` — the
    /// network, the append-only file's sync, the calls queued ahead — every call to that
    /// store pays anyway, so it is the baseline commit: a pass may hold the store about that
    /// long, and a store whose sync is slow works a storm off in larger passes instead of
    /// one sync per few dozen sessions. A live call then waits at most about one more
    /// baseline for a pass. The pass's own sync grows with its size only by the bytes it
    /// writes, far less than its work, so the size settles rather than feeding on itself.
    /// Passes that ended none say nothing about the cost per session.
    pub fn observe_call(&mut self, sessions: usize, held: Duration, round_trip: Duration) {
        if sessions == 0 {
            return;
        }
        let sample = held.as_nanos() as f64 / sessions as f64;
        self.per_session_ns = Some(smooth(self.per_session_ns, sample));
        let beyond = round_trip.saturating_sub(held).as_nanos() as f64;
        self.commit_ns = Some(smooth(self.commit_ns, beyond));
    }

    /// Learns from a batch whose commit took `took`, and the paced pass it carried, if any.
    /// A batch without a pass (or with one that ended no one) teaches what a commit costs
    /// anyway; one with a pass teaches what the pass added per session: its in-memory work
    /// and its share of the commit beyond that.
    pub fn observe_commit(&mut self, took: Duration, pass: Option<PassCost>) {
        let took_ns = took.as_nanos() as f64;
        self.quickest_ns = Some(self.quickest_ns.map_or(took_ns, |q| q.min(took_ns)));
        match pass {
            Some(pass) if pass.sessions > 0 => {
                let added = (took_ns - self.baseline_ns()).max(0.0) * pass.share.clamp(0.0, 1.0);
                let sample = (pass.domain.as_nanos() as f64 + added) / pass.sessions as f64;
                self.per_session_ns = Some(smooth(self.per_session_ns, sample));
            }
            _ => self.commit_ns = Some(smooth(self.commit_ns, took_ns)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pass(sessions: usize, domain: Duration, share: f64) -> Option<PassCost> {
        Some(PassCost {
            sessions,
            domain,
            share,
        })
    }

    #[test]
    fn a_pass_that_is_its_own_call_is_sized_by_it_and_the_round_trip() {
        let mut s = PassSizer::new(Duration::from_millis(2), 10_000);
        s.observe_call(0, Duration::from_secs(1), Duration::from_secs(2));
        assert_eq!(
            s.next(),
            MIN_PASS * 4,
            "a pass that ended no one teaches nothing"
        );
        // 256 sessions held the store for 1 ms, in a call of 1.5 ms: 3.9 µs each, and the
        // 0.5 ms beyond is under the configured budget, so 2 ms fits 512.
        s.observe_call(256, Duration::from_millis(1), Duration::from_micros(1_500));
        assert_eq!(s.budget(), Duration::from_millis(2));
        assert_eq!(s.next(), 512);
    }

    /// Runs `rounds` passes of the sizes `s` asks for, each holding the store 10 µs a session
    /// in a call that takes `beyond(sessions)` more.
    fn calls(s: &mut PassSizer, rounds: usize, beyond: impl Fn(u64) -> Duration) {
        for _ in 0..rounds {
            let n = s.next();
            let held = Duration::from_micros(10 * n as u64);
            s.observe_call(n, held, held + beyond(n as u64));
        }
    }

    #[test]
    fn a_slow_sync_on_every_call_becomes_the_budget_and_settles() {
        let mut s = PassSizer::new(Duration::from_millis(2), 100_000);
        // Every call pays a 4 ms sync beyond the pass's own work of 10 µs a session: the
        // budget becomes that sync, and 4 ms fits 400 sessions.
        calls(&mut s, 40, |_| Duration::from_millis(4));
        assert_eq!(s.budget(), Duration::from_millis(4));
        assert_eq!(s.next(), 400);
        // A sync that grows with the pass (1 µs a session written) raises the budget only
        // to where it settles, 4 ms / (10 µs - 1 µs) = 444, not without end.
        calls(&mut s, 60, |n| {
            Duration::from_millis(4) + Duration::from_micros(n)
        });
        assert!((440..=450).contains(&s.next()), "settled at {}", s.next());
        // The sync getting quick again brings the budget back to the configured one.
        calls(&mut s, 40, |_| Duration::from_micros(100));
        assert_eq!(s.budget(), Duration::from_millis(2));
        assert_eq!(s.next(), 200);
    }

    #[test]
    fn passes_are_sized_to_the_time_budget() {
        let mut s = PassSizer::new(Duration::from_millis(2), 10_000);
        assert_eq!(s.next(), MIN_PASS * 4, "modest before anything is known");
        // 256 sessions in 1 ms, riding a commit that took nothing more: 3.9 µs each, so
        // 2 ms fits 512.
        s.observe_commit(Duration::ZERO, pass(256, Duration::from_millis(1), 1.0));
        assert_eq!(s.next(), 512);
        // Sessions that cost nothing still never exceed the configured batch.
        for _ in 0..40 {
            s.observe_commit(Duration::ZERO, pass(10_000, Duration::from_micros(1), 1.0));
        }
        assert_eq!(s.next(), 10_000);
        // A disk stall shrinks the next passes, but never below the floor.
        for _ in 0..40 {
            s.observe_commit(Duration::ZERO, pass(MIN_PASS, Duration::from_secs(1), 1.0));
        }
        assert_eq!(s.next(), MIN_PASS);
        // A pass that ended no one teaches nothing about the cost per session.
        let before = s.next();
        s.observe_commit(Duration::ZERO, pass(0, Duration::from_secs(5), 1.0));
        assert_eq!(s.next(), before);
    }

    #[test]
    fn the_commit_a_batch_pays_anyway_is_not_the_pass_cost() {
        let mut s = PassSizer::new(Duration::from_millis(2), 100_000);
        // Batches without a pass commit in 1 ms: that much is every batch's.
        for _ in 0..40 {
            s.observe_commit(Duration::from_millis(1), None);
        }
        // A pass of 1 000 sessions: 0.5 ms in memory, and its batch committed in 2 ms, of
        // which the pass made 90 % of the changes. It added 0.5 + 0.9 × (2 − 1) = 1.4 ms,
        // 1.4 µs a session; 2 ms fits 1 428.
        s.observe_commit(
            Duration::from_millis(2),
            pass(1_000, Duration::from_micros(500), 0.9),
        );
        assert_eq!(s.next(), 1_428);
    }

    #[test]
    fn a_commit_slower_than_the_budget_becomes_the_budget() {
        let mut s = PassSizer::new(Duration::from_millis(2), 10_000);
        // Commits without a pass take 5 ms (a slow sync).
        for _ in 0..40 {
            s.observe_commit(Duration::from_millis(5), None);
        }
        assert_eq!(s.budget(), Duration::from_millis(5));
        // A pass adding 1 µs a session beyond that commit: 5 ms fits 5 000.
        s.observe_commit(
            Duration::from_millis(5),
            pass(1_000, Duration::from_millis(1), 1.0),
        );
        assert_eq!(s.next(), 5_000);
        // The passes' own slower commits do not raise the budget: only batches without a
        // pass say what a commit costs anyway.
        for _ in 0..40 {
            s.observe_commit(Duration::from_millis(50), pass(1_000, Duration::ZERO, 0.0));
        }
        assert_eq!(s.budget(), Duration::from_millis(5));
        // Quicker commits bring the budget back to the configured one.
        for _ in 0..40 {
            s.observe_commit(Duration::from_micros(100), None);
        }
        assert_eq!(s.budget(), Duration::from_millis(2));
    }

    #[test]
    fn before_any_batch_without_a_pass_the_quickest_commit_stands_in() {
        let mut s = PassSizer::new(Duration::from_millis(2), 100_000);
        // A storm with no live traffic: every batch carries a pass. The first, of 256, took
        // 3 ms to commit and 0.256 ms in memory; nothing is known of the commit without a
        // pass, so the quickest commit so far (this one) stands in for it, and the pass is
        // charged its memory work only: 1 µs a session, and 3 ms of budget fits 3 000.
        s.observe_commit(
            Duration::from_millis(3),
            pass(256, Duration::from_micros(256), 1.0),
        );
        assert_eq!(s.budget(), Duration::from_millis(3));
        assert_eq!(s.next(), 3_000);
    }

    #[test]
    fn a_small_configured_batch_is_the_ceiling_and_the_floor() {
        let s = PassSizer::new(Duration::from_millis(2), 10);
        assert_eq!(s.next(), 10);
    }
}
