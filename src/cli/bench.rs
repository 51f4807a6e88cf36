//! `leasehold bench`: the load generator's command line.

use std::process::ExitCode;
use std::time::Duration;

use clap::Args;

use crate::loadgen::{self, Options, Workload};

#[derive(Args)]
pub struct BenchArgs {
    /// The server's base URL, plain `http://HOST:PORT`: the timed requests go over the load
    /// generator's own lean HTTP/1.1 client (one persistent connection per client), which
    /// speaks no TLS, so an `https://` server is refused; bench a plain listener instead.
    #[arg(
        long,
        env = "LEASEHOLD_SERVER",
        default_value = "http://127.0.0.1:7878"
    )]
    server: String,
    /// What to run.
    #[arg(long, value_enum, default_value = "lock-churn")]
    workload: Workload,
    /// Concurrent clients, each with its own connection.
    #[arg(long, default_value_t = 64)]
    clients: usize,
    /// Seconds of load before measuring.
    #[arg(long, default_value_t = 2.0)]
    warmup: f64,
    /// Seconds of measured load.
    #[arg(long, default_value_t = 10.0)]
    duration: f64,
    /// Keys lock-churn picks from.
    #[arg(long, default_value_t = 10_000)]
    keys: usize,
    /// Live sessions (heartbeat) or dying sessions (mass-expiry).
    #[arg(long, default_value_t = 100_000)]
    sessions: usize,
    /// Total target rate in operations per second; without it each client runs flat out.
    #[arg(long)]
    rate: Option<f64>,
    /// Least TTL of the dying sessions in mass-expiry, in ms.
    #[arg(long, default_value_t = 3_000)]
    ttl_ms: u64,
    /// Print the result as one JSON line.
    #[arg(long)]
    json: bool,
    /// No progress line.
    #[arg(long)]
    quiet: bool,
    /// The server's process id, when it runs on this machine: its CPU time per operation
    /// over the measured window is reported (`server_cpu_us_per_op`, and split into user and
    /// system time: `server_user_us_per_op`, `server_system_us_per_op`).
    #[arg(long)]
    server_pid: Option<u32>,
}

pub fn run(args: BenchArgs) -> ExitCode {
    if !(args.warmup >= 0.0 && args.duration > 0.0) || args.clients == 0 {
        eprintln!(
            "leasehold bench: --duration must be above 0, --warmup at least 0, --clients at least 1"
        );
        return ExitCode::from(2);
    }
    if args.rate.is_some_and(|r| r <= 0.0) {
        eprintln!("leasehold bench: --rate must be above 0 operations per second");
        return ExitCode::from(2);
    }
    let opts = Options {
        server: args.server,
        workload: args.workload,
        clients: args.clients,
        warmup: Duration::from_secs_f64(args.warmup),
        duration: Duration::from_secs_f64(args.duration),
        keys: args.keys,
        sessions: args.sessions,
        rate: args.rate,
        ttl_ms: args.ttl_ms,
        progress: !args.quiet && !args.json,
        server_pid: args.server_pid,
    };
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .expect("the runtime starts");
    match runtime.block_on(loadgen::run(opts)) {
        Ok(report) => {
            if args.json {
                println!(
                    "{}",
                    serde_json::to_string(&report).expect("a report serializes")
                );
            } else {
                print!("{}", report.table());
            }
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("leasehold bench: {e}");
            ExitCode::FAILURE
        }
    }
}
