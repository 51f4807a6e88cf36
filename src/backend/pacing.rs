//! How many sessions a background reaper pass may end: as many as fit in `reaper_pass_ms`
//! of writer time, learned from the passes so far.

use std::time::Duration;

/// Sizes reaper passes so that one holds the writer for about `budget`.
///
/// The writer reports what each paced pass cost: its in-memory work plus its share of the
/// batch's commit, sync included. That is a fixed part plus a part per session; dividing it
/// by the sessions ended gives a cost per session that carries a share of the fixed part,
/// so the size this converges on makes the whole pass take about the budget. The cost is smoothed so one slow pass (a busy disk) shrinks the next
/// without collapsing it, and the size stays within `[MIN_PASS, max]`: a pass always makes
/// progress, and never ends more than the configured batch.
#[derive(Debug, Clone)]
pub struct PassSizer {
    budget: Duration,
    max: usize,
    /// Smoothed cost of ending one session, in nanoseconds; `None` before the first pass.
    per_session_ns: Option<f64>,
}

/// The fewest sessions a pass asks for, however slow the last ones were.
pub const MIN_PASS: usize = 64;

impl PassSizer {
    pub fn new(budget: Duration, max: usize) -> PassSizer {
        PassSizer {
            budget,
            max: max.max(1),
            per_session_ns: None,
        }
    }

    /// How many sessions the next pass asks for. The first pass is modest, so that a
    /// storm's first pass does not hold the writer for the whole of a large batch.
    pub fn next(&self) -> usize {
        let want = match self.per_session_ns {
            None => MIN_PASS * 4,
            Some(ns) => (self.budget.as_nanos() as f64 / ns.max(1.0)) as usize,
        };
        want.clamp(MIN_PASS.min(self.max), self.max)
    }

    /// Learns from a pass that ended `sessions` in `took`. Passes that ended none say
    /// nothing about the cost per session.
    pub fn observe(&mut self, sessions: usize, took: Duration) {
        if sessions == 0 {
            return;
        }
        let sample = took.as_nanos() as f64 / sessions as f64;
        self.per_session_ns = Some(match self.per_session_ns {
            None => sample,
            Some(old) => 0.5 * old + 0.5 * sample,
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn passes_are_sized_to_the_time_budget() {
        let mut s = PassSizer::new(Duration::from_millis(2), 10_000);
        assert_eq!(s.next(), MIN_PASS * 4, "modest before anything is known");
        // 256 sessions in 1 ms: 3.9 µs each, so 2 ms fits 512.
        s.observe(256, Duration::from_millis(1));
        assert_eq!(s.next(), 512);
        // Sessions that cost nothing still never exceed the configured batch.
        for _ in 0..40 {
            s.observe(10_000, Duration::from_micros(1));
        }
        assert_eq!(s.next(), 10_000);
        // A disk stall shrinks the next passes, but never below the floor.
        for _ in 0..40 {
            s.observe(MIN_PASS, Duration::from_secs(1));
        }
        assert_eq!(s.next(), MIN_PASS);
        // An empty pass teaches nothing.
        let before = s.next();
        s.observe(0, Duration::from_secs(5));
        assert_eq!(s.next(), before);
    }

    #[test]
    fn a_small_configured_batch_is_the_ceiling_and_the_floor() {
        let s = PassSizer::new(Duration::from_millis(2), 10);
        assert_eq!(s.next(), 10);
    }
}
