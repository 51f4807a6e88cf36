//! The server's log output: formatted where the event happens, written to stderr by a
//! thread of its own.
//!
//! Lines are logged from the store writer (a close's `session ended`, the reaper's batch
//! line) and from the request tasks. Written straight to stderr, a reader that stops
//! reading — a stalled journal, a full pipe, a terminal held by `Ctrl-S` — would block the
//! thread that logged, and a blocked writer holds up every commit. So lines go through a
//! bounded queue to the `leasehold-log` thread; when the queue is full a line is dropped
//! and counted (`leasehold_log_lines_dropped_total`), never waited for.

use std::sync::OnceLock;

use tracing_appender::non_blocking::{ErrorCounter, NonBlockingBuilder, WorkerGuard};
use tracing_subscriber::EnvFilter;

use crate::config::{Config, LogFormat};

/// Lines queued for stderr at most; beyond it a line is dropped. At about 200 bytes a line
/// this bounds the queue to some 25 MB, and it rides out a stall of over ten seconds at a
/// line per close of a session-churn run (about 7 000 a second on 2 cores).
const QUEUED_LINES: usize = 128_000;

static DROPPED: OnceLock<ErrorCounter> = OnceLock::new();

/// Installs the global subscriber (`LEASEHOLD_LOG` if set, else `log_level`) writing
/// through the log thread. Keep the guard until the process ends: dropping it writes out
/// what is still queued.
pub fn init(config: &Config) -> WorkerGuard {
    let filter = EnvFilter::try_from_env("LEASEHOLD_LOG")
        .unwrap_or_else(|_| EnvFilter::new(&config.log_level));
    let (writer, guard) = NonBlockingBuilder::default()
        .lossy(true)
        .buffered_lines_limit(QUEUED_LINES)
        .thread_name("leasehold-log")
        .finish(std::io::stderr());
    let _ = DROPPED.set(writer.error_counter());
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(writer);
    match config.log_format {
        LogFormat::Json => builder.json().init(),
        // No colours: under systemd the journal would store the escape codes.
        LogFormat::Text => builder.with_ansi(false).init(),
    }
    guard
}

/// Lines dropped because the queue to stderr was full (0 before [`init`]).
pub fn dropped_lines() -> u64 {
    DROPPED.get().map_or(0, |c| c.dropped_lines() as u64)
}
