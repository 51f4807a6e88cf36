//! Leasehold: sessions, fenced locks and a reaper, in one binary with one data directory.
pub mod api;
pub mod app;
pub mod cli;
pub mod client;
pub mod clock;
pub mod config;
pub mod domain;
pub mod engine;
pub mod loadgen;
pub mod metrics;
pub mod server;
pub mod store;
