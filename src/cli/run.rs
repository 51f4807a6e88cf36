//! `leasehold run`: runs a command while holding a lock and/or seats, and stops it when the
//! lease is lost.
//!
//! The order of events is the guarantee: the child starts only after every grant is held,
//! and when the session is lost (a heartbeat answers `session_gone`, or the local deadline
//! passes without a good heartbeat — which is before the server can end the session) the
//! child's process group gets SIGTERM, then SIGKILL after `--kill-grace`. The child runs in a
//! process group of its own so that its own children are stopped with it, and so that a
//! terminal's Ctrl-C reaches it once, forwarded, rather than twice.

use std::process::ExitCode;
use std::time::Duration;

use clap::{ArgGroup, Args};
use tokio::sync::mpsc;
use tokio::time::Instant;

use crate::client::{Client, Error, LockGuard, SeatGuard, Session};

/// Exit codes of `leasehold run` itself; any other code is the child's. Kept apart from the
/// small codes commands usually return, so a wrapper can tell "did not run" from "failed".
pub mod exit {
    /// Bad arguments (the argument parser's own code, like every `leasehold` command), or a
    /// request the server refused as invalid (a bad key, an unknown pool).
    pub const USAGE: u8 = 2;
    /// The server could not be reached or would not open a session.
    pub const UNREACHABLE: u8 = 69;
    /// The lock or a seat was not obtained within `--wait`.
    pub const NOT_OBTAINED: u8 = 75;
    /// The lease was lost while the command ran (or while waiting); the command was stopped.
    pub const LEASE_LOST: u8 = 79;
    /// The command was found but could not be started.
    pub const CANNOT_RUN: u8 = 126;
    /// The command was not found.
    pub const NOT_FOUND: u8 = 127;
}

#[derive(Args)]
#[command(group(ArgGroup::new("grant").required(true).multiple(true).args(["lock", "seats"])))]
#[command(after_help = "\
The command gets LEASEHOLD_TOKEN and LEASEHOLD_FENCING_TOKEN (the lock's fencing token, or the
first seat's), LEASEHOLD_KEY, LEASEHOLD_SESSION and, with --seat, LEASEHOLD_SEAT_TOKENS.

Exit status: the command's own, or 128+N if signal N ended it; otherwise
  2    bad arguments, or a key or pool the server refused
  69   the server could not be reached or would not open a session
  75   the lock or a seat was not obtained within --wait
  79   the lease was lost and the command was stopped
  126  the command could not be started;  127  the command was not found")]
pub struct RunArgs {
    /// The server's base URL.
    #[arg(
        long,
        env = "LEASEHOLD_SERVER",
        default_value = "http://127.0.0.1:7878"
    )]
    server: String,
    /// API token, sent as `Authorization: Bearer …`.
    #[arg(long, env = "LEASEHOLD_API_TOKEN", hide_env_values = true)]
    token: Option<String>,
    #[command(flatten)]
    tls: super::TlsArgs,
    /// The lock to hold while the command runs.
    #[arg(long)]
    lock: Option<String>,
    /// A seat pool to hold a seat of while the command runs (repeatable).
    #[arg(long = "seat", value_name = "POOL")]
    seats: Vec<String>,
    /// How long to wait for the lock and seats (e.g. 30s, 500ms, 2m); 0 tries once.
    #[arg(long, default_value = "0s", value_parser = parse_duration)]
    wait: Duration,
    /// The session's TTL; heartbeats go every third of it.
    #[arg(long, default_value = "15s", value_parser = parse_duration)]
    ttl: Duration,
    /// How long the command has to exit after SIGTERM before it gets SIGKILL.
    #[arg(long, default_value = "10s", value_parser = parse_duration)]
    kill_grace: Duration,
    /// The session's owner [default: leasehold-run@HOSTNAME]
    #[arg(long)]
    owner: Option<String>,
    /// The command and its arguments, after `--`.
    #[arg(last = true, required = true, value_name = "COMMAND")]
    command: Vec<String>,
}

/// `30s`, `500ms`, `2m`, `1h`; a bare number is seconds.
pub fn parse_duration(text: &str) -> Result<Duration, String> {
    let text = text.trim();
    let split = text
        .find(|c: char| !c.is_ascii_digit() && c != '.')
        .unwrap_or(text.len());
    let (number, unit) = text.split_at(split);
    let value: f64 = number
        .parse()
        .map_err(|_| format!("{text:?} is not a duration (like 30s, 500ms, 2m)"))?;
    let scale = match unit {
        "ms" => 0.001,
        "" | "s" => 1.0,
        "m" => 60.0,
        "h" => 3600.0,
        _ => {
            return Err(format!(
                "unknown unit {unit:?} in {text:?} (use ms, s, m or h)"
            ));
        }
    };
    Duration::try_from_secs_f64(value * scale).map_err(|e| format!("{text:?}: {e}"))
}

/// The message and exit code of a failure before the command started.
fn refusal(e: &Error, what: &str) -> (String, u8) {
    match e {
        Error::Transport(t) => (t.to_string(), exit::UNREACHABLE),
        Error::Lost(loss) => (
            format!("the lease was lost while waiting for {what}: {loss}"),
            exit::LEASE_LOST,
        ),
        Error::Api { code, .. } if code == "lock_held" || code == "pool_exhausted" => (
            format!("{what} was not obtained in time ({e})"),
            exit::NOT_OBTAINED,
        ),
        Error::Api { status: 400, .. } => (e.to_string(), exit::USAGE),
        Error::Api { code, .. } if code == "pool_not_found" => (e.to_string(), exit::USAGE),
        _ => (e.to_string(), exit::UNREACHABLE),
    }
}

fn fail(message: &str, code: u8) -> ExitCode {
    eprintln!("leasehold run: {message}");
    ExitCode::from(code)
}

pub fn run(args: RunArgs) -> ExitCode {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("a current-thread runtime starts");
    runtime.block_on(run_async(args))
}

/// Signals passed on to the child (and that end `run` early if they come before it starts).
const FORWARDED: [libc::c_int; 6] = [
    libc::SIGINT,
    libc::SIGTERM,
    libc::SIGHUP,
    libc::SIGQUIT,
    libc::SIGUSR1,
    libc::SIGUSR2,
];

/// One task per forwarded signal, all feeding one channel.
fn listen_for_signals() -> std::io::Result<mpsc::UnboundedReceiver<libc::c_int>> {
    use tokio::signal::unix::{SignalKind, signal};
    let (tx, rx) = mpsc::unbounded_channel();
    for sig in FORWARDED {
        let mut stream = signal(SignalKind::from_raw(sig))?;
        let tx = tx.clone();
        tokio::spawn(async move {
            while stream.recv().await.is_some() {
                if tx.send(sig).is_err() {
                    return;
                }
            }
        });
    }
    Ok(rx)
}

fn hostname() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .ok()
        .map(|h| h.trim().to_string())
        .filter(|h| !h.is_empty())
        .unwrap_or_else(|| "localhost".into())
}

async fn run_async(args: RunArgs) -> ExitCode {
    if args.ttl.is_zero() {
        return fail("--ttl must be above zero", exit::USAGE);
    }
    let client = match Client::new(&args.server)
        .and_then(|c| c.with_tls(&args.tls.files()))
        .and_then(|c| c.with_token(args.token))
    {
        Ok(c) => c,
        Err(e) => return fail(&e.to_string(), exit::USAGE),
    };
    let mut signals = match listen_for_signals() {
        Ok(s) => s,
        Err(e) => return fail(&format!("cannot listen for signals: {e}"), exit::CANNOT_RUN),
    };
    let owner = args
        .owner
        .unwrap_or_else(|| format!("leasehold-run@{}", hostname()));
    let session = match Session::builder(client, owner)
        .ttl(args.ttl)
        .metadata(serde_json::json!({"command": args.command[0]}))
        .open()
        .await
    {
        Ok(s) => s,
        Err(e) => {
            let (message, code) = match &e {
                Error::Api { status: 400, .. } => (e.to_string(), exit::USAGE),
                _ => (format!("cannot open a session: {e}"), exit::UNREACHABLE),
            };
            return fail(&message, code);
        }
    };

    let grants = tokio::select! {
        g = take_grants(&session, args.lock.as_deref(), &args.seats, args.wait) => g,
        Some(sig) = signals.recv() => {
            let _ = close(session, args.ttl).await;
            return ExitCode::from(128u8.saturating_add(sig as u8));
        }
    };
    let (lock, seats) = match grants {
        Ok(g) => g,
        Err((message, code)) => {
            let _ = close(session, args.ttl).await;
            return fail(&message, code);
        }
    };

    let mut command = std::process::Command::new(&args.command[0]);
    command.args(&args.command[1..]);
    let token = lock
        .as_ref()
        .map(LockGuard::token)
        .or_else(|| seats.first().map(SeatGuard::token))
        .expect("a lock or a seat is required");
    command
        .env("LEASEHOLD_TOKEN", token.to_string())
        .env("LEASEHOLD_FENCING_TOKEN", token.to_string())
        .env("LEASEHOLD_SESSION", session.id());
    if let Some(l) = &lock {
        command.env("LEASEHOLD_KEY", l.key());
    } else {
        command.env_remove("LEASEHOLD_KEY");
    }
    if !seats.is_empty() {
        let tokens: Vec<String> = seats.iter().map(|s| s.token().to_string()).collect();
        command.env("LEASEHOLD_SEAT_TOKENS", tokens.join(" "));
    }
    std::os::unix::process::CommandExt::process_group(&mut command, 0);
    let mut child = match command.spawn() {
        Ok(c) => c,
        Err(e) => {
            let _ = close(session, args.ttl).await;
            let code = if e.kind() == std::io::ErrorKind::NotFound {
                exit::NOT_FOUND
            } else {
                exit::CANNOT_RUN
            };
            return fail(&format!("cannot run {:?}: {e}", args.command[0]), code);
        }
    };
    let group = child.id() as libc::pid_t;
    // The process group is signalled only while the child is not yet reaped: `exited` has not
    // fired, so its id cannot have been reused.
    let signal_group = |sig: libc::c_int| {
        // SAFETY: kill(2) takes plain integers and touches no memory of ours.
        unsafe { libc::kill(-group, sig) };
    };
    let (done, mut exited) = tokio::sync::oneshot::channel();
    std::thread::spawn(move || {
        let _ = done.send(child.wait());
    });

    let lost = session.loss_signal();
    let status = loop {
        tokio::select! {
            status = &mut exited => break status,
            Some(sig) = signals.recv() => signal_group(sig),
            loss = lost.lost() => {
                eprintln!("leasehold run: the lease is lost ({loss}); stopping the command with SIGTERM");
                signal_group(libc::SIGTERM);
                tokio::select! {
                    _ = &mut exited => {}
                    _ = tokio::time::sleep(args.kill_grace) => {
                        eprintln!(
                            "leasehold run: the command did not exit within {:?} of SIGTERM; sending SIGKILL",
                            args.kill_grace
                        );
                        signal_group(libc::SIGKILL);
                        let _ = (&mut exited).await;
                    }
                }
                let _ = close(session, args.ttl).await;
                return ExitCode::from(exit::LEASE_LOST);
            }
        }
    };
    // Everything is released by the close, in one transaction; the guards live until after it
    // so that they queue no releases of their own.
    let closed = close(session, args.ttl).await;
    drop((lock, seats));
    if let Err(e) = closed {
        eprintln!("leasehold run: the session could not be closed ({e}); it ends at its TTL");
    }
    match status {
        Ok(Ok(status)) => {
            use std::os::unix::process::ExitStatusExt;
            match (status.code(), status.signal()) {
                (Some(code), _) => ExitCode::from(code as u8),
                (None, Some(sig)) => ExitCode::from(128u8.saturating_add(sig as u8)),
                _ => ExitCode::FAILURE,
            }
        }
        _ => fail("lost track of the command", exit::CANNOT_RUN),
    }
}

/// Closes the session, giving up after `ttl`: by then the server ends it by itself, and a
/// server that does not answer must not keep `run` from returning the command's status.
async fn close(session: Session, ttl: Duration) -> Result<(), String> {
    match tokio::time::timeout(ttl, session.close()).await {
        Ok(Ok(())) => Ok(()),
        Ok(Err(e)) => Err(e.to_string()),
        Err(_) => Err(format!("no answer within {ttl:?}")),
    }
}

type Grants = (Option<LockGuard>, Vec<SeatGuard>);

/// Takes the lock, then each seat in turn, all within one `wait`.
async fn take_grants(
    session: &Session,
    lock: Option<&str>,
    seats: &[String],
    wait: Duration,
) -> Result<Grants, (String, u8)> {
    let until = Instant::now() + wait;
    let lock = match lock {
        Some(key) => Some(
            retry_until(until, |left| session.lock_wait(key, left))
                .await
                .map_err(|e| refusal(&e, &format!("the lock {key:?}")))?,
        ),
        None => None,
    };
    let mut held = Vec::new();
    for pool in seats {
        held.push(
            retry_until(until, |left| session.seat_wait(pool, left, None))
                .await
                .map_err(|e| refusal(&e, &format!("a seat of {pool:?}")))?,
        );
    }
    Ok((lock, held))
}

/// Asks again while the answer is `lock_held` or `pool_exhausted` and time is left: the
/// server caps one wait at its `max_wait_ms`, which may be shorter than `--wait`.
async fn retry_until<T, F, Fut>(until: Instant, mut attempt: F) -> Result<T, Error>
where
    F: FnMut(Duration) -> Fut,
    Fut: std::future::Future<Output = Result<T, Error>>,
{
    loop {
        let started = Instant::now();
        let left = until.saturating_duration_since(started);
        match attempt(left).await {
            Err(e)
                if matches!(e.code(), Some("lock_held" | "pool_exhausted"))
                    && Instant::now() < until =>
            {
                // A server that answers at once although time was left (an older server, or
                // a wait capped to nothing) must not be asked in a tight loop.
                if started.elapsed() < Duration::from_millis(20) {
                    tokio::time::sleep(Duration::from_millis(100).min(left)).await;
                }
            }
            other => return other,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::parse_duration;
    use std::time::Duration;

    #[test]
    fn durations_take_units_and_refuse_nonsense() {
        for (text, ms) in [
            ("30s", 30_000),
            ("500ms", 500),
            ("2m", 120_000),
            ("1h", 3_600_000),
            ("7", 7_000),
            ("1.5s", 1_500),
        ] {
            assert_eq!(
                parse_duration(text),
                Ok(Duration::from_millis(ms)),
                "{text}"
            );
        }
        for bad in ["", "s", "ten", "5 days", "-1s", "3d"] {
            assert!(parse_duration(bad).is_err(), "{bad}");
        }
    }
}
