//! The embedded backend's own errors, and how the domain's errors read above the seam.

use super::store::StoreError;
use crate::backend::BackendError;
use crate::domain::{AcquireError, JobError, PoolError, RestoreError, SeatError};

#[derive(Debug, thiserror::Error)]
pub enum StartError {
    #[error(transparent)]
    Store(#[from] StoreError),
    #[error("the data file is inconsistent ({0}); run `leasehold check` for a full report")]
    Inconsistent(#[from] RestoreError),
    #[error("cannot start a thread: {0}")]
    Thread(#[from] std::io::Error),
}

pub fn acquire_error(e: AcquireError) -> BackendError {
    match e {
        AcquireError::SessionGone => BackendError::SessionGone,
        AcquireError::Held { .. } => BackendError::LockHeld,
        AcquireError::TooManyLocks(n) => BackendError::TooManyLocks(n),
    }
}

pub fn seat_error(e: SeatError) -> BackendError {
    match e {
        SeatError::SessionGone => BackendError::SessionGone,
        SeatError::PoolNotFound => BackendError::PoolNotFound,
        SeatError::Exhausted { capacity, in_use } => {
            BackendError::PoolExhausted { capacity, in_use }
        }
        SeatError::Invalid(i) => BackendError::Invalid(i),
    }
}

pub fn pool_error(e: PoolError) -> BackendError {
    match e {
        PoolError::NotFound => BackendError::PoolNotFound,
        PoolError::InUse(n) => BackendError::PoolInUse(n),
        PoolError::NotHolder => BackendError::NotHolder,
    }
}

pub fn job_error(e: JobError) -> BackendError {
    match e {
        JobError::NotFound => BackendError::JobNotFound,
        JobError::StaleToken => BackendError::StaleToken,
        JobError::NotFailed => BackendError::JobNotFailed,
        JobError::Invalid(i) => BackendError::Invalid(i),
    }
}
