//! Input rules that depend on configuration: TTL bounds, owner and metadata sizes.

use std::borrow::Cow;

/// A request value that breaks a rule; `field` names it for the client.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{field} {rule}")]
pub struct InvalidInput {
    pub field: &'static str,
    pub rule: Cow<'static, str>,
}

impl InvalidInput {
    pub fn new(field: &'static str, rule: impl Into<Cow<'static, str>>) -> InvalidInput {
        InvalidInput {
            field,
            rule: rule.into(),
        }
    }
}

/// The limits a session request is checked against.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    pub min_ttl_ms: u64,
    pub max_ttl_ms: u64,
    pub default_ttl_ms: u64,
    /// How many locks one session may hold at once; bounds the work of ending it.
    pub max_locks_per_session: usize,
}

impl Default for Limits {
    fn default() -> Limits {
        Limits {
            min_ttl_ms: 1_000,
            max_ttl_ms: 86_400_000,
            default_ttl_ms: 15_000,
            max_locks_per_session: 10_000,
        }
    }
}

pub const MAX_OWNER_BYTES: usize = 256;
pub const MAX_METADATA_BYTES: usize = 4096;

impl Limits {
    pub fn ttl(&self, requested: Option<u64>) -> Result<u64, InvalidInput> {
        let ttl = requested.unwrap_or(self.default_ttl_ms);
        if ttl < self.min_ttl_ms || ttl > self.max_ttl_ms {
            return Err(InvalidInput::new(
                "ttl_ms",
                format!(
                    "must be between {} and {} milliseconds",
                    self.min_ttl_ms, self.max_ttl_ms
                ),
            ));
        }
        Ok(ttl)
    }

    pub fn owner(&self, owner: &str) -> Result<(), InvalidInput> {
        if owner.is_empty() || owner.len() > MAX_OWNER_BYTES {
            return Err(InvalidInput::new(
                "owner",
                format!("must be 1 to {MAX_OWNER_BYTES} bytes"),
            ));
        }
        if owner.chars().any(char::is_control) {
            return Err(InvalidInput::new(
                "owner",
                "must not contain control characters",
            ));
        }
        Ok(())
    }

    /// Metadata arrives as serialized JSON text; it must be an object of at most 4 KiB.
    pub fn metadata(&self, json: &str) -> Result<(), InvalidInput> {
        if json.len() > MAX_METADATA_BYTES {
            return Err(InvalidInput::new(
                "metadata",
                format!("must be at most {MAX_METADATA_BYTES} bytes of JSON"),
            ));
        }
        if !json.trim_start().starts_with('{') {
            return Err(InvalidInput::new("metadata", "must be a JSON object"));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ttl_bounds() {
        let l = Limits::default();
        assert_eq!(l.ttl(None), Ok(15_000));
        assert_eq!(l.ttl(Some(1_000)), Ok(1_000));
        assert_eq!(l.ttl(Some(86_400_000)), Ok(86_400_000));
        assert_eq!(l.ttl(Some(999)).unwrap_err().field, "ttl_ms");
        assert_eq!(l.ttl(Some(86_400_001)).unwrap_err().field, "ttl_ms");
    }

    #[test]
    fn owner_and_metadata() {
        let l = Limits::default();
        assert!(l.owner("alice@laptop").is_ok());
        assert!(l.owner("").is_err());
        assert!(l.owner(&"x".repeat(256)).is_ok());
        assert!(l.owner(&"x".repeat(257)).is_err());
        assert!(l.owner("a\nb").is_err());
        assert!(l.metadata("{\"host\":\"h1\"}").is_ok());
        assert!(l.metadata("[1,2]").is_err());
        assert!(
            l.metadata(&format!("{{\"k\":\"{}\"}}", "v".repeat(4100)))
                .is_err()
        );
    }
}
