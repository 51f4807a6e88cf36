//! `leasehold check`: the offline integrity check of a data directory or of a PostgreSQL or
//! Redis namespace; `leasehold migrate`: the PostgreSQL schema migrations.

use std::path::Path;
use std::process::ExitCode;

use crate::backend::CheckReport;
use crate::backend::embedded::store::Store;
use crate::backend::embedded::store::embedded::DATA_FILE;
use crate::backend::postgres;

pub fn run(data_dir: &Path) -> ExitCode {
    let store = match open_stopped("check", data_dir) {
        Ok(s) => s,
        Err(code) => return code,
    };
    match store.check() {
        Ok(report) => {
            let file = std::fs::metadata(data_dir.join(DATA_FILE)).map(|m| m.len());
            print(&report, file.ok())
        }
        Err(e) => {
            eprintln!("leasehold check: {e}");
            ExitCode::FAILURE
        }
    }
}

/// `leasehold compact`: gives the embedded data file's free space back to the file system,
/// offline (redb locks the file, so a running server's directory is refused), and checks the
/// result.
pub fn compact(data_dir: &Path) -> ExitCode {
    let path = data_dir.join(DATA_FILE);
    let size = || std::fs::metadata(&path).map(|m| m.len()).unwrap_or(0);
    let started = std::time::Instant::now();
    let mut store = match open_stopped("compact", data_dir) {
        Ok(s) => s,
        Err(code) => return code,
    };
    let before = size();
    if let Err(e) = store.compact() {
        eprintln!("leasehold compact: {e}");
        return ExitCode::FAILURE;
    }
    let after = size();
    println!(
        "compacted {}: {:.1} MiB -> {:.1} MiB in {} ms",
        path.display(),
        mib(before),
        mib(after),
        started.elapsed().as_millis()
    );
    match store.check() {
        Ok(report) => print(&report, Some(after)),
        Err(e) => {
            eprintln!("leasehold compact: the check after compacting failed: {e}");
            ExitCode::FAILURE
        }
    }
}

/// Opens the embedded store of a stopped server's `data_dir` for the offline `command`; exit
/// status 2, said on stderr, when there is no data file or it cannot be opened (a running
/// server holds it).
fn open_stopped(command: &str, data_dir: &Path) -> Result<Store, ExitCode> {
    let path = data_dir.join(DATA_FILE);
    if !path.exists() {
        eprintln!("leasehold {command}: no data file at {}", path.display());
        return Err(ExitCode::from(2));
    }
    Store::open(data_dir, 16 * 1024 * 1024).map_err(|e| {
        eprintln!(
            "leasehold {command}: cannot open {}: {e}",
            data_dir.display()
        );
        ExitCode::from(2)
    })
}

/// The report; `file` is the embedded data file's size.
fn print(report: &CheckReport, file: Option<u64>) -> ExitCode {
    println!(
        "sessions: {}\nlocks: {}\nevents: {}\nrevision: {}",
        report.sessions, report.locks, report.events, report.revision
    );
    if !report.space.is_empty() {
        println!("space (MiB): table, rows, pages, stored, free inside pages");
        for t in report.space.iter().filter(|t| t.rows > 0 || t.bytes > 0) {
            println!(
                "  {:<18} {:>10} {:>9.1} {:>9.1} {:>9.1}",
                t.table,
                t.rows,
                mib(t.bytes),
                mib(t.stored),
                mib(t.free)
            );
        }
    }
    if let Some(len) = file {
        let pages: u64 = report.space.iter().map(|t| t.bytes).sum();
        println!(
            "file: {:.1} MiB, {:.1} MiB of it tables' pages (the rest: free pages, and room \
             the file grew by)",
            mib(len),
            mib(pages)
        );
    }
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

fn mib(bytes: u64) -> f64 {
    bytes as f64 / (1024.0 * 1024.0)
}

/// Connects to PostgreSQL for a one-off command; exit code 2 and a message naming the URL
/// (without its password) when that fails.
fn with_postgres(
    command: &str,
    url: Option<&str>,
    namespace: &str,
    run: impl AsyncFnOnce(&mut tokio_postgres::Client) -> ExitCode,
) -> ExitCode {
    let Some(url) = url else {
        eprintln!("leasehold {command}: --postgres-url (or LEASEHOLD_POSTGRES_URL) is needed");
        return ExitCode::from(2);
    };
    if !crate::config::valid_namespace(namespace) {
        eprintln!(
            "leasehold {command}: namespace {namespace:?} must be 1 to 48 characters of a-z, 0-9 and _, starting with a letter or _"
        );
        return ExitCode::from(2);
    }
    let runtime = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(r) => r,
        Err(e) => {
            eprintln!("leasehold {command}: cannot start the runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    runtime.block_on(async {
        let connected = match url.parse::<tokio_postgres::Config>() {
            Ok(mut config) => {
                config.connect_timeout(std::time::Duration::from_secs(5));
                config.connect(tokio_postgres::NoTls).await
            }
            Err(e) => Err(e),
        };
        let (mut client, connection) = match connected {
            Ok(c) => c,
            Err(e) => {
                eprintln!(
                    "leasehold {command}: cannot connect to PostgreSQL at {}: {}",
                    postgres::redact(url),
                    postgres::chain(&e)
                );
                return ExitCode::from(2);
            }
        };
        let driver = tokio::spawn(connection);
        let code = run(&mut client).await;
        drop(client);
        let _ = driver.await;
        code
    })
}

/// `leasehold check --backend postgres`: every invariant of a namespace's tables.
pub fn run_postgres(url: Option<&str>, namespace: &str) -> ExitCode {
    with_postgres(
        "check",
        url,
        namespace,
        async |client| match postgres::check(client, namespace).await {
            Ok(report) => print(&report, None),
            Err(e) => {
                eprintln!("leasehold check: {e}");
                ExitCode::FAILURE
            }
        },
    )
}

/// `leasehold check --backend redis`: every invariant of a namespace's keys, read in one
/// script (atomically, so a running cluster can be checked).
pub fn run_redis(url: Option<&str>, namespace: &str) -> ExitCode {
    let Some(url) = url else {
        eprintln!("leasehold check: --redis-url (or LEASEHOLD_REDIS_URL) is needed");
        return ExitCode::from(2);
    };
    let runtime = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(r) => r,
        Err(e) => {
            eprintln!("leasehold check: cannot start a runtime: {e}");
            return ExitCode::from(2);
        }
    };
    runtime.block_on(async {
        match crate::backend::redis::check(url, namespace).await {
            Ok(report) => print(&report, None),
            Err(e) => {
                eprintln!("leasehold check: cannot check Redis at {e}");
                ExitCode::from(2)
            }
        }
    })
}

/// `leasehold migrate`: brings a namespace's schema to the version this build knows.
pub fn migrate(url: Option<&str>, namespace: &str) -> ExitCode {
    with_postgres(
        "migrate",
        url,
        namespace,
        async |client| match postgres::schema::migrate(client, namespace).await {
            Ok(found) if found == postgres::schema::VERSION => {
                println!("namespace {namespace}: schema already at version {found}");
                ExitCode::SUCCESS
            }
            Ok(found) => {
                println!(
                    "namespace {namespace}: schema migrated from version {found} to {}",
                    postgres::schema::VERSION
                );
                ExitCode::SUCCESS
            }
            Err(e) => {
                eprintln!("leasehold migrate: {e}");
                ExitCode::FAILURE
            }
        },
    )
}
