//! Leasehold: sessions, fenced locks and a reaper, in one binary with one data directory.
pub mod domain;
