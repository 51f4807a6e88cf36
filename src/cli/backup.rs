//! `leasehold backup`: an online snapshot of a running embedded server, written atomically to
//! a file; `leasehold restore`: that file made the data directory of a stopped server, with
//! the token counter raised above every token the lost server may have issued.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::ExitCode;

use clap::Args;
use http_body_util::{BodyExt, Full};
use hyper::body::Bytes;
use hyper::{Method, Request};
use hyper_util::client::legacy::Client as HyperClient;
use hyper_util::rt::TokioExecutor;

use crate::backend::embedded::store::backup::{BackupInfo, inspect};
use crate::backend::embedded::store::embedded::DATA_FILE;
use crate::backend::embedded::store::{CheckReport, Store};
use crate::clock::{Clock, SystemClock};
use crate::domain::state::MAX_TOKEN_FLOOR;

/// What a restore adds to the highest token it knows of, by default: 2^40. The backup does
/// not see the tokens the server issued after it was taken; this many more would take 127
/// days at 100 000 tokens a second, 2.8 times the embedded backend's fastest measured rate
/// (17 800 acquire + release pairs a second, 35 600 tokens, docs/benchmarks.md), so a restore
/// from any backup younger than that is safe without knowing the lost server's last token. Tokens are opaque and may have gaps, so the
/// jump costs nothing; 2^62 (the highest floor) leaves room for millions of restores.
pub const DEFAULT_TOKEN_MARGIN: u64 = 1 << 40;

#[derive(Args)]
pub struct BackupArgs {
    /// The running embedded server.
    #[arg(
        long,
        env = "LEASEHOLD_SERVER",
        default_value = "http://127.0.0.1:7878"
    )]
    server: String,
    /// Where to write the backup; written to FILE.partial, fsynced, then renamed over FILE.
    #[arg(long)]
    out: PathBuf,
}

#[derive(Args)]
pub struct RestoreArgs {
    /// The data directory to restore into; must be empty or absent unless --force.
    #[arg(long, env = "LEASEHOLD_DATA_DIR")]
    data_dir: PathBuf,
    /// The file `leasehold backup` wrote.
    file: PathBuf,
    /// Restore into a directory that already holds a data file; it is kept beside the
    /// restored one as leasehold.redb.replaced-<unix ms>.
    #[arg(long)]
    force: bool,
    /// The highest token the lost server may have issued, when known (for example the highest
    /// token a fenced resource has recorded). The floor is the higher of this and the
    /// backup's revision, plus --token-margin.
    #[arg(long)]
    token_floor: Option<u64>,
    /// Added to the highest known token to cover tokens issued after the backup that no one
    /// recorded [default: 2^40]. 0 only when --token-floor is exactly the last token issued.
    #[arg(long, default_value_t = DEFAULT_TOKEN_MARGIN)]
    token_margin: u64,
}

fn fail(command: &str, message: impl std::fmt::Display) -> ExitCode {
    eprintln!("leasehold {command}: {message}");
    ExitCode::FAILURE
}

pub fn backup(args: BackupArgs) -> ExitCode {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("a current-thread runtime starts");
    match runtime.block_on(download(&args.server, &args.out)) {
        Ok(info) => {
            println!(
                "wrote {}: revision {} (every token in it is at most this), {} rows, taken at {} (Unix ms)",
                args.out.display(),
                info.revision,
                info.rows,
                info.taken_at.0
            );
            ExitCode::SUCCESS
        }
        Err(message) => fail("backup", message),
    }
}

/// `FILE.partial` beside `FILE`: the same directory, so the final rename is atomic.
fn partial_path(out: &Path) -> PathBuf {
    let mut name = out.file_name().unwrap_or_default().to_os_string();
    name.push(".partial");
    out.with_file_name(name)
}

/// Fsyncs the directory holding `path`, so that a rename into it is durable.
fn sync_dir_of(path: &Path) -> std::io::Result<()> {
    let dir = match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => p,
        _ => Path::new("."),
    };
    std::fs::File::open(dir)?.sync_all()
}

async fn download(server: &str, out: &Path) -> Result<BackupInfo, String> {
    let base = server.trim_end_matches('/');
    let http = HyperClient::builder(TokioExecutor::new()).build_http::<Full<Bytes>>();
    let req = Request::builder()
        .method(Method::POST)
        .uri(format!("{base}/v1/admin/backup"))
        .body(Full::new(Bytes::new()))
        .map_err(|e| format!("invalid server URL {server:?}: {e}"))?;
    let resp = http
        .request(req)
        .await
        .map_err(|e| format!("cannot reach {base}: {e}"))?;
    let status = resp.status();
    let expected_len: Option<u64> = resp
        .headers()
        .get(hyper::header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok()?.parse().ok());
    let mut body = resp.into_body();
    if !status.is_success() {
        let bytes = body
            .collect()
            .await
            .map(|b| b.to_bytes())
            .unwrap_or_default();
        let v: serde_json::Value = serde_json::from_slice(&bytes).unwrap_or_default();
        return Err(format!(
            "{} {}: {}",
            status.as_u16(),
            v["error"].as_str().unwrap_or("error"),
            v["message"]
                .as_str()
                .map(str::to_string)
                .unwrap_or_else(|| String::from_utf8_lossy(&bytes).into_owned())
        ));
    }
    let partial = partial_path(out);
    let io = |what: &str, e: std::io::Error| format!("{what} {}: {e}", partial.display());
    let result = async {
        let mut file = std::fs::File::create(&partial).map_err(|e| io("cannot create", e))?;
        let mut written = 0u64;
        while let Some(frame) = body.frame().await {
            let frame = frame.map_err(|e| format!("the backup stream broke off: {e}"))?;
            if let Some(data) = frame.data_ref() {
                file.write_all(data).map_err(|e| io("cannot write", e))?;
                written += data.len() as u64;
            }
        }
        if let Some(len) = expected_len
            && written != len
        {
            return Err(format!(
                "the backup stream ended after {written} of {len} bytes"
            ));
        }
        file.sync_all().map_err(|e| io("cannot fsync", e))?;
        drop(file);
        // Read back before it replaces anything: a file that does not open as a backup
        // never takes FILE's place.
        let info = inspect(&partial).map_err(|e| e.to_string())?;
        std::fs::rename(&partial, out)
            .map_err(|e| format!("cannot rename to {}: {e}", out.display()))?;
        sync_dir_of(out)
            .map_err(|e| format!("cannot fsync the directory of {}: {e}", out.display()))?;
        Ok(info)
    }
    .await;
    if result.is_err() {
        let _ = std::fs::remove_file(&partial);
    }
    result
}

fn problems(report: &CheckReport) -> Option<String> {
    (!report.problems.is_empty()).then(|| {
        let mut s = format!("{} problem(s):", report.problems.len());
        for p in &report.problems {
            s.push_str("\n- ");
            s.push_str(p);
        }
        s
    })
}

pub fn restore(args: RestoreArgs) -> ExitCode {
    match restore_into(&args) {
        Ok(done) => {
            println!("{done}");
            ExitCode::SUCCESS
        }
        Err(message) => fail("restore", message),
    }
}

fn restore_into(args: &RestoreArgs) -> Result<String, String> {
    let info = inspect(&args.file).map_err(|e| e.to_string())?;
    let known = info.revision.max(args.token_floor.unwrap_or(0));
    let floor = known
        .checked_add(args.token_margin)
        .filter(|f| *f <= MAX_TOKEN_FLOOR)
        .ok_or_else(|| {
            format!(
                "the token floor {known} + margin {} is above the highest allowed, {MAX_TOKEN_FLOOR}",
                args.token_margin
            )
        })?;
    let dir = &args.data_dir;
    let target = dir.join(DATA_FILE);
    match std::fs::read_dir(dir) {
        Ok(mut entries) => {
            if entries.next().is_some() && !args.force {
                return Err(format!(
                    "{} is not empty; restore into an empty directory, or pass --force to \
                     replace its data file (kept as {DATA_FILE}.replaced-<unix ms>)",
                    dir.display()
                ));
            }
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            std::fs::create_dir_all(dir)
                .map_err(|e| format!("cannot create {}: {e}", dir.display()))?;
        }
        Err(e) => return Err(format!("cannot read {}: {e}", dir.display())),
    }

    // Everything happens on a copy in a staging directory inside DIR; only a copy that
    // checks clean with its floor raised is renamed into place.
    let staging = dir.join(format!(".restore-{}", uuid::Uuid::new_v4().simple()));
    let result = stage(args, &staging, floor);
    let revision = match result {
        Ok(r) => r,
        Err(e) => {
            let _ = std::fs::remove_dir_all(&staging);
            return Err(e);
        }
    };
    let now = SystemClock::new().wall().0;
    if target.exists() {
        let kept = dir.join(format!("{DATA_FILE}.replaced-{now}"));
        std::fs::rename(&target, &kept)
            .map_err(|e| format!("cannot move the old data file aside: {e}"))?;
    }
    std::fs::rename(staging.join(DATA_FILE), &target)
        .map_err(|e| format!("cannot move the restored file into place: {e}"))?;
    sync_dir_of(&target).map_err(|e| format!("cannot fsync {}: {e}", dir.display()))?;
    let _ = std::fs::remove_dir_all(&staging);
    Ok(format!(
        "restored {} into {}\nbackup: revision {}, taken at {} (Unix ms)\ntoken floor: {floor} \
         (the higher of the backup's revision and --token-floor, plus a margin of {}); \
         the counter is now {revision} and every new token is above it\nok: every invariant holds",
        args.file.display(),
        dir.display(),
        info.revision,
        info.taken_at.0,
        args.token_margin,
    ))
}

/// Copies the backup into `staging`, checks it, raises its floor and checks it again;
/// returns the counter it ends at.
fn stage(args: &RestoreArgs, staging: &Path, floor: u64) -> Result<u64, String> {
    std::fs::create_dir(staging)
        .map_err(|e| format!("cannot create {}: {e}", staging.display()))?;
    let copy = staging.join(DATA_FILE);
    std::fs::copy(&args.file, &copy)
        .map_err(|e| format!("cannot copy {}: {e}", args.file.display()))?;
    std::fs::File::open(&copy)
        .and_then(|f| f.sync_all())
        .map_err(|e| format!("cannot fsync {}: {e}", copy.display()))?;
    let store = Store::open(staging, 16 * 1024 * 1024)
        .map_err(|e| format!("cannot open the backup: {e}"))?;
    let report = store.check().map_err(|e| e.to_string())?;
    if let Some(p) = problems(&report) {
        return Err(format!(
            "the backup fails the integrity check, nothing restored: {p}"
        ));
    }
    let revision = store
        .raise_for_restore(floor, SystemClock::new().wall())
        .map_err(|e| format!("cannot raise the token floor: {e}"))?;
    let report = store.check().map_err(|e| e.to_string())?;
    if let Some(p) = problems(&report) {
        return Err(format!("the restored file fails the integrity check: {p}"));
    }
    Ok(revision)
}
