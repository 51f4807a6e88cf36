//! The settings every backend takes from the validated configuration.

use crate::domain::Limits;

/// The engine's settings: limits, waiting, the reaper, retention and the writer's batching.
#[derive(Debug, Clone)]
pub struct EngineConfig {
    pub limits: Limits,
    pub max_wait_ms: u64,
    pub reaper_enabled: bool,
    pub reaper_interval_ms: u64,
    pub reaper_batch: usize,
    pub reaper_pass_ms: u64,
    pub event_retention_ms: u64,
    pub event_trim_batch: usize,
    pub job_retention_ms: u64,
    /// How long a `request_id`'s first answer is kept for its retries.
    pub request_id_retention_ms: u64,
    pub max_batch: usize,
    pub queue_capacity: usize,
}

impl Default for EngineConfig {
    fn default() -> Self {
        EngineConfig {
            limits: Limits::default(),
            max_wait_ms: 60_000,
            reaper_enabled: true,
            reaper_interval_ms: 1_000,
            reaper_batch: 10_000,
            reaper_pass_ms: 2,
            event_retention_ms: 7 * 24 * 3_600_000,
            event_trim_batch: 10_000,
            job_retention_ms: 7 * 24 * 3_600_000,
            request_id_retention_ms: 24 * 3_600_000,
            max_batch: 4_096,
            queue_capacity: 65_536,
        }
    }
}
