//! Time as the domain sees it: two kinds that must never be mixed up.

use serde::{Deserialize, Serialize};

/// Milliseconds on the server's monotonic clock since an arbitrary origin fixed at start-up.
///
/// Every deadline lives on this clock, so a wall-clock step (NTP, an operator) can neither
/// expire a session nor keep one alive. It is never persisted: its origin changes with every
/// process.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Mono(pub u64);

impl Mono {
    pub fn plus_ms(self, ms: u64) -> Mono {
        Mono(self.0.saturating_add(ms))
    }

    /// Milliseconds from `earlier` to `self`, zero when `earlier` is later.
    pub fn since(self, earlier: Mono) -> u64 {
        self.0.saturating_sub(earlier.0)
    }
}

/// Unix time in milliseconds: shown to people and written in records, never used to decide
/// whether a session is alive.
#[derive(
    Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize,
)]
pub struct UnixMs(pub u64);

/// Converts a monotonic instant to the wall clock, given one reading of both clocks.
pub fn to_wall(at: Mono, now: Mono, wall_now: UnixMs) -> UnixMs {
    if at >= now {
        UnixMs(wall_now.0.saturating_add(at.0 - now.0))
    } else {
        UnixMs(wall_now.0.saturating_sub(now.0 - at.0))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn wall_conversion_goes_both_ways() {
        let now = Mono(10_000);
        let wall = UnixMs(1_700_000_000_000);
        assert_eq!(to_wall(Mono(12_500), now, wall), UnixMs(1_700_000_002_500));
        assert_eq!(to_wall(Mono(7_000), now, wall), UnixMs(1_699_999_997_000));
        assert_eq!(to_wall(now, now, wall), wall);
    }

    #[test]
    fn since_saturates() {
        assert_eq!(Mono(5).since(Mono(9)), 0);
        assert_eq!(Mono(9).since(Mono(5)), 4);
    }
}
