//! A storage backend that fails on demand, to prove the fail-stop rule: after an I/O error
//! the server refuses writes rather than acknowledge something it may have lost.

use std::fs::File;
use std::io;
use std::ops::Bound;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use redb::backends::FileBackend;
use redb::{BackendError, StorageBackend};

/// Flip it on and every later write or sync of the backend fails.
#[derive(Debug, Clone, Default)]
pub struct FaultSwitch(Arc<AtomicBool>);

impl FaultSwitch {
    pub fn fail_writes(&self) {
        self.0.store(true, Ordering::SeqCst);
    }

    fn failing(&self) -> bool {
        self.0.load(Ordering::SeqCst)
    }
}

#[derive(Debug)]
pub struct FaultyBackend {
    inner: FileBackend,
    switch: FaultSwitch,
}

impl FaultyBackend {
    pub fn new(file: File, switch: FaultSwitch) -> Result<FaultyBackend, redb::DatabaseError> {
        Ok(FaultyBackend {
            inner: FileBackend::new(file)?,
            switch,
        })
    }

    fn check(&self) -> io::Result<()> {
        if self.switch.failing() {
            Err(io::Error::other("injected I/O failure"))
        } else {
            Ok(())
        }
    }
}

impl StorageBackend for FaultyBackend {
    fn len(&self) -> io::Result<u64> {
        self.inner.len()
    }

    fn read(&self, offset: u64, out: &mut [u8]) -> io::Result<()> {
        self.inner.read(offset, out)
    }

    fn set_len(&self, len: u64) -> io::Result<()> {
        self.check()?;
        self.inner.set_len(len)
    }

    fn sync_data(&self) -> io::Result<()> {
        self.check()?;
        self.inner.sync_data()
    }

    fn write(&self, offset: u64, data: &[u8]) -> io::Result<()> {
        self.check()?;
        self.inner.write(offset, data)
    }

    fn close(&self) -> io::Result<()> {
        self.inner.close()
    }

    fn try_lock_range(&self, start: Bound<u64>, end: Bound<u64>) -> Result<bool, BackendError> {
        self.inner.try_lock_range(start, end)
    }

    fn try_lock_shared_range(
        &self,
        start: Bound<u64>,
        end: Bound<u64>,
    ) -> Result<bool, BackendError> {
        self.inner.try_lock_shared_range(start, end)
    }

    fn lock_range(&self, start: Bound<u64>, end: Bound<u64>) -> Result<(), BackendError> {
        self.inner.lock_range(start, end)
    }

    fn lock_shared_range(&self, start: Bound<u64>, end: Bound<u64>) -> Result<(), BackendError> {
        self.inner.lock_shared_range(start, end)
    }

    fn unlock_range(&self, start: Bound<u64>, end: Bound<u64>) -> Result<(), BackendError> {
        self.inner.unlock_range(start, end)
    }

    fn query_lock_range(&self, start: Bound<u64>, end: Bound<u64>) -> Result<bool, BackendError> {
        self.inner.query_lock_range(start, end)
    }
}
