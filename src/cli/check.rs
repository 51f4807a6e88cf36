//! `leasehold check`: the offline integrity check of a data directory.

use std::path::Path;
use std::process::ExitCode;

use crate::backend::embedded::store::Store;
use crate::backend::embedded::store::embedded::DATA_FILE;

pub fn run(data_dir: &Path) -> ExitCode {
    if !data_dir.join(DATA_FILE).exists() {
        eprintln!(
            "leasehold check: no data file at {}",
            data_dir.join(DATA_FILE).display()
        );
        return ExitCode::from(2);
    }
    let store = match Store::open(data_dir, 16 * 1024 * 1024) {
        Ok(s) => s,
        Err(e) => {
            eprintln!("leasehold check: cannot open {}: {e}", data_dir.display());
            return ExitCode::from(2);
        }
    };
    match store.check() {
        Ok(report) => {
            println!(
                "sessions: {}\nlocks: {}\nevents: {}\nrevision: {}",
                report.sessions, report.locks, report.events, report.revision
            );
            if report.problems.is_empty() {
                println!("ok: every invariant holds");
                ExitCode::SUCCESS
            } else {
                println!("{} problem(s):", report.problems.len());
                for p in &report.problems {
                    println!("- {p}");
                }
                ExitCode::FAILURE
            }
        }
        Err(e) => {
            eprintln!("leasehold check: {e}");
            ExitCode::FAILURE
        }
    }
}
