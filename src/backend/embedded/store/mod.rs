//! Persistence for the embedded backend: one redb file in the data directory.
//!
//! Every write is one transaction with immediate durability (fsync) that also writes the
//! counters, so a token is never acknowledged before the counter that issued it is durable.
//! After any failed write the store refuses every later one (fail-stop).
//!
//! - `tables`: the table layout and the row helpers every reader shares;
//! - `db`: the handle, opening the file and the fail-stop flag;
//! - `load`: the start-up load; `write`: a [`Batch`] in one write transaction; `read`: point
//!   and range reads; `check`: the integrity check; `migrate`: the versioned migrations of
//!   older files, run at open;
//! - `endlog`: the session ends reaper passes deferred, applied in later batches; `held`:
//!   the committed locks in key order, in memory, which lock reads answer from;
//! - [`codec`]: the file format of records; [`fault`]: fault injection for tests.

pub mod backup;
mod chain;
mod check;
pub mod codec;
mod db;
mod endlog;
mod error;
pub mod fault;
mod held;
mod load;
mod migrate;
mod read;
mod tables;
#[cfg(test)]
mod tests;
mod write;

pub use crate::backend::CheckReport;
pub use db::{DATA_FILE, Store};
pub use endlog::Ended;
pub use error::StoreError;
pub use tables::ALL as TABLES;
pub use write::{Batch, Committed};

/// The data file's name under the path it was first published at.
pub mod embedded {
    pub use super::DATA_FILE;
}
