//! Leasehold: sessions, fenced locks, seat pools and job leases in one binary, with the state
//! in an embedded data file or in a shared PostgreSQL database.
//!
//! # Architecture
//!
//! Dependencies point one way: `main → cli → app → {api, server} → engine → backend →
//! domain`, and `domain` depends on nothing of ours. The API knows only the [`engine`]
//! handle, never a backend.
//!
//! - [`domain`]: the rules, as a pure state machine. Sessions with deadlines on the monotonic
//!   clock, locks, seat pools, job leases, the expiry index and the durable revision counter
//!   every fencing token is drawn from. Time arrives as an argument; every mutation returns
//!   the changes to persist. Never reads a clock, never does I/O.
//! - [`engine`]: `Engine`, the one handle the API and the CLI call; it dispatches each
//!   operation to the configured backend. It knows the backends; none of them knows it.
//! - [`backend`]: the seam, the `Backend` trait — every operation, each atomic in its backend,
//!   with its failure contract — the result and error types and settings every backend
//!   shares, and what backends share below the API: `waiting` (node-local first-come,
//!   first-served lines for a backend whose authority is a shared database) and `pacing`
//!   (reaper passes sized by time).
//!   - `backend::embedded` (the default): the in-memory state owned by one writer thread
//!     (group commit: a batch of requests, one fsynced commit, then the replies), FIFO
//!     waiters for locks, seats and jobs, and the reaper thread (sleeps until the earliest
//!     deadline, ends due sessions in paced passes). Plain heartbeats touch memory only;
//!     reads come from redb read transactions. Its `store` is the redb file: index tables
//!     emulate the cascade; records are one format byte plus postcard; fail-stop after any
//!     write error.
//!   - `backend::postgres`: several nodes on one database, the authority. Every operation
//!     is one transaction on the database's clock (`db_now()`); versioned migrations; the
//!     cascade by `ON DELETE CASCADE`; a reaper task (one pass at a time across nodes) and a
//!     `LISTEN` task that wakes the node's waiters.
//! - [`api`]: HTTP routes, one file per resource, and the one error → status mapping.
//! - [`server`]: the hyper accept loop with header-read and idle timeouts, a connection
//!   cap and a graceful drain.
//! - [`app`]: wiring of backend, engine, router and server; [`cli`]: the command line;
//!   [`config`]: settings validated at start-up; [`clock`]: the only place that reads time;
//!   [`logging`]: log lines written to stderr by a thread of their own, never blocking the
//!   one that logged;
//!   [`metrics`]: every metric in one place; [`client`]: the Rust client (the plain HTTP
//!   client, and sessions with a background heartbeat, a local deadline and guards), which
//!   uses none of the server's code; [`loadgen`]: the load generator behind `leasehold bench`.

pub mod api;
pub mod app;
pub mod auth;
pub mod backend;
pub mod cli;
pub mod client;
pub mod clock;
pub mod config;
pub mod domain;
pub mod engine;
pub mod loadgen;
pub mod logging;
pub mod metrics;
pub mod server;
pub mod tls;
