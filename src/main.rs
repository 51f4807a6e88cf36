//! Wiring only: parse the command line and hand it to `leasehold::cli`.

use clap::Parser;

/// The request path allocates many small, short-lived buffers (JSON, headers, records);
/// mimalloc serves them faster than the system allocator (measured in docs/benchmarks.md).
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn main() -> std::process::ExitCode {
    leasehold::cli::run(leasehold::cli::Cli::parse())
}
