//! The token floor: an operator's promise that every token issued from now on is above a
//! number, whatever the counter says. Restoring a backup (which never saw the tokens issued
//! after it was taken) or a database from its own backup needs it, so that no resource is
//! ever handed a token it has already seen.

use super::State;
use crate::domain::change::{Change, EventKind};
use crate::domain::limits::InvalidInput;
use crate::domain::state::{At, Effects};

/// The highest floor an operator may ask for: 2^62. It leaves 2^62 tokens of headroom below
/// the largest a PostgreSQL `bigint` holds (2^63 − 1), so a mistyped floor cannot exhaust
/// the counter.
pub const MAX_TOKEN_FLOOR: u64 = 1 << 62;

/// What raising the floor did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FloorRaised {
    /// The floor asked for: every later token is above it.
    pub floor: u64,
    /// The last revision (and so the highest token) issued before the raise.
    pub previous: u64,
    /// The revision the raise itself committed at: above both `floor` and `previous`.
    pub revision: u64,
}

impl FloorRaised {
    /// Whether the counter moved: false when it was already at or above the floor.
    pub fn moved(&self) -> bool {
        self.floor > self.previous
    }
}

/// Refuses a floor above [`MAX_TOKEN_FLOOR`].
pub fn validate_token_floor(floor: u64) -> Result<(), InvalidInput> {
    if floor > MAX_TOKEN_FLOOR {
        return Err(InvalidInput::new(
            "floor",
            format!("must be at most {MAX_TOKEN_FLOOR} (2^62)"),
        ));
    }
    Ok(())
}

impl State {
    /// Raises the revision counter to at least `floor`; the raise takes the next revision, so
    /// every token issued after it is above `floor`. The counter only ratchets: a floor at or
    /// below it changes nothing but the revision the raise itself draws. Audited either way
    /// as `token_floor_raised`, with the floor and the counter it found in `detail`.
    pub fn raise_token_floor(
        &mut self,
        floor: u64,
        at: At,
        fx: &mut Effects,
    ) -> Result<FloorRaised, InvalidInput> {
        validate_token_floor(floor)?;
        let previous = self.revision;
        self.revision = self.revision.max(floor);
        let revision = self.next_revision();
        let mut event = self.event(at.wall, EventKind::TokenFloorRaised);
        event.detail = Some(floor_detail(floor, previous));
        fx.changes.push(Change::Event(event));
        Ok(FloorRaised {
            floor,
            previous,
            revision,
        })
    }
}

/// The `detail` of a `token_floor_raised` event: `floor N, counter was M`.
pub fn floor_detail(floor: u64, previous: u64) -> String {
    format!("floor {floor}, counter was {previous}")
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::domain::limits::Limits;
    use crate::domain::time::{Mono, UnixMs};
    use crate::domain::{LockKey, SessionId};

    fn at() -> At {
        At {
            now: Mono(0),
            wall: UnixMs(1_700_000_000_000),
        }
    }

    fn limits() -> Limits {
        Limits::default()
    }

    #[test]
    fn the_next_token_is_above_the_floor_and_the_floor_only_ratchets() {
        let mut state = State::new(limits());
        let mut fx = Effects::default();
        let raised = state.raise_token_floor(1_000, at(), &mut fx).unwrap();
        assert_eq!((raised.previous, raised.revision), (0, 1_001));
        assert!(raised.moved());
        let id = SessionId::random();
        state
            .open(id, "a".into(), None, String::new(), at(), &mut fx)
            .unwrap();
        let key = LockKey::parse("key", "k").unwrap();
        let token = state.acquire(id, &key, at(), &mut fx).unwrap().token;
        assert!(token.0 > 1_000, "token {token:?} is not above the floor");

        // A lower floor moves nothing back: the raise draws the next revision only.
        let before = state.revision();
        let lower = state.raise_token_floor(5, at(), &mut fx).unwrap();
        assert!(!lower.moved());
        assert_eq!(lower.previous, before);
        assert_eq!(lower.revision, before + 1);

        let events: Vec<_> = fx
            .changes
            .iter()
            .filter_map(|c| match c {
                Change::Event(e) if e.kind == EventKind::TokenFloorRaised => e.detail.clone(),
                _ => None,
            })
            .collect();
        assert_eq!(
            events,
            vec![
                "floor 1000, counter was 0".to_string(),
                format!("floor 5, counter was {before}")
            ]
        );
    }

    #[test]
    fn a_floor_above_the_maximum_is_refused_and_changes_nothing() {
        let mut state = State::new(limits());
        let mut fx = Effects::default();
        let e = state
            .raise_token_floor(MAX_TOKEN_FLOOR + 1, at(), &mut fx)
            .unwrap_err();
        assert_eq!(e.field, "floor");
        assert_eq!(state.revision(), 0);
        assert!(fx.changes.is_empty());
        assert!(
            state
                .raise_token_floor(MAX_TOKEN_FLOOR, at(), &mut fx)
                .is_ok()
        );
    }
}
