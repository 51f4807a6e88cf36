//! What the handle, the writer and the reaper share: the state, the waiters, the store, the
//! clock and the metrics.

use std::sync::Arc;
use std::sync::atomic::AtomicBool;

use parking_lot::Mutex;

use super::store::Store;
use super::waiters::Waiters;
use crate::backend::EngineConfig;
use crate::clock::Clock;
use crate::domain::State;
use crate::metrics::Metrics;

pub(crate) struct Shared {
    pub config: EngineConfig,
    pub state: Mutex<State>,
    /// Owned by the writer; readers only count waiters. Locked after `state`, never before.
    pub waiters: Mutex<Waiters>,
    pub draining: AtomicBool,
    pub store: Store,
    pub clock: Arc<dyn Clock>,
    pub metrics: Arc<Metrics>,
    /// Fired after a commit that ended sessions (`Backend::ends`).
    pub ends: Arc<tokio::sync::Notify>,
}
