//! Persistence. The embedded redb store is the only backend today; it owns the file
//! format (`codec`), the table layout (`embedded`) and fault injection for tests (`fault`).

pub mod codec;
pub mod embedded;
pub mod fault;

pub use embedded::{Batch, CheckReport, Store, StoreError};
