//! Leasehold: sessions, fenced locks, seat pools and job leases in one binary with one data
//! directory.
//!
//! # Architecture
//!
//! Dependencies point one way: `main → cli → app → {api, server} → engine → {domain, store}`,
//! and `domain` depends on nothing of ours.
//!
//! - [`domain`]: the rules, as a pure state machine. Sessions with deadlines on the monotonic
//!   clock, locks, seat pools, job leases, the expiry index and the durable revision counter
//!   every fencing token is drawn from. Time arrives as an argument; every mutation returns
//!   the changes to persist. Never reads a clock, never does I/O.
//! - [`store`]: the embedded redb store. One write transaction (fsynced) per batch of
//!   changes; index tables emulate the cascade; records are one format byte plus postcard;
//!   fail-stop after any write error.
//! - [`engine`]: the one writer thread (group commit: a batch of requests, one commit, then
//!   the replies), FIFO waiters for locks, seats and jobs, the reaper (sleeps until the
//!   earliest deadline, ends due sessions in bounded batches), and the handle the API calls.
//!   Plain heartbeats touch memory only; reads come from redb read transactions.
//! - [`backend`]: the seam the engine dispatches to: the embedded backend above, or
//!   PostgreSQL shared by several nodes (`backend::postgres`: one transaction per
//!   operation, the database clock, a set-based reaper one node at a time, audit numbers
//!   given after commit, node-local waiting lines woken by notifications).
//! - [`api`]: HTTP routes, one file per resource, and the one error → status mapping.
//! - [`server`]: the hyper accept loop with header-read and idle timeouts, a connection
//!   cap and a graceful drain.
//! - [`app`]: wiring of store, engine, router and server; [`cli`]: the command line;
//!   [`config`]: settings validated at start-up; [`clock`]: the only place that reads time;
//!   [`metrics`]: every metric in one place; [`client`] and [`loadgen`]: the HTTP client
//!   and the load generator behind `leasehold bench`.

pub mod api;
pub mod app;
pub mod backend;
pub mod cli;
pub mod client;
pub mod clock;
pub mod config;
pub mod domain;
pub mod engine;
pub mod loadgen;
pub mod metrics;
pub mod server;
