//! Wiring only: parse the command line and hand it to `leasehold::cli`.

use clap::Parser;

fn main() -> std::process::ExitCode {
    leasehold::cli::run(leasehold::cli::Cli::parse())
}
