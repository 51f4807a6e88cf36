//! The only place that reads time. Everything else receives `Mono` and `UnixMs` values, so
//! tests drive expiry by advancing a [`ManualClock`] instead of sleeping.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Instant, SystemTime, UNIX_EPOCH};

use crate::domain::{Mono, UnixMs};

pub trait Clock: Send + Sync + 'static {
    /// Milliseconds on a monotonic clock; never goes back.
    fn now(&self) -> Mono;
    /// Unix time in milliseconds, for display and records only.
    fn wall(&self) -> UnixMs;
}

/// The real clocks: `Instant` for deadlines, `SystemTime` for timestamps.
#[derive(Debug, Clone)]
pub struct SystemClock {
    origin: Instant,
}

impl SystemClock {
    pub fn new() -> SystemClock {
        SystemClock {
            origin: Instant::now(),
        }
    }
}

impl Default for SystemClock {
    fn default() -> Self {
        SystemClock::new()
    }
}

impl Clock for SystemClock {
    fn now(&self) -> Mono {
        Mono(self.origin.elapsed().as_millis() as u64)
    }

    fn wall(&self) -> UnixMs {
        let since = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .unwrap_or_default();
        UnixMs(since.as_millis() as u64)
    }
}

/// A clock that moves only when told to. Both readings advance together; `step_wall` moves
/// the wall clock alone, as an NTP step would.
#[derive(Debug, Clone)]
pub struct ManualClock {
    mono: Arc<AtomicU64>,
    wall: Arc<AtomicU64>,
}

impl ManualClock {
    pub fn new(wall: UnixMs) -> ManualClock {
        ManualClock {
            mono: Arc::new(AtomicU64::new(0)),
            wall: Arc::new(AtomicU64::new(wall.0)),
        }
    }

    pub fn advance(&self, ms: u64) {
        self.mono.fetch_add(ms, Ordering::SeqCst);
        self.wall.fetch_add(ms, Ordering::SeqCst);
    }

    /// Moves the wall clock by `delta_ms` (either way) without moving the monotonic one.
    pub fn step_wall(&self, delta_ms: i64) {
        let w = self.wall.load(Ordering::SeqCst) as i64;
        self.wall
            .store((w + delta_ms).max(0) as u64, Ordering::SeqCst);
    }
}

impl Clock for ManualClock {
    fn now(&self) -> Mono {
        Mono(self.mono.load(Ordering::SeqCst))
    }

    fn wall(&self) -> UnixMs {
        UnixMs(self.wall.load(Ordering::SeqCst))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn manual_clock_moves_only_when_told() {
        let c = ManualClock::new(UnixMs(1_000_000));
        assert_eq!(c.now(), Mono(0));
        c.advance(250);
        assert_eq!(c.now(), Mono(250));
        assert_eq!(c.wall(), UnixMs(1_000_250));
        c.step_wall(-3_600_000);
        assert_eq!(c.now(), Mono(250));
        assert_eq!(c.wall(), UnixMs(0));
    }

    #[test]
    fn system_clock_is_monotonic() {
        let c = SystemClock::new();
        let a = c.now();
        let b = c.now();
        assert!(b >= a);
        assert!(c.wall().0 > 1_600_000_000_000);
    }
}
