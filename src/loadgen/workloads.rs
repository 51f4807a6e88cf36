//! The workloads: what one operation of each is, and how each is set up and torn down.

use std::sync::Arc;
use std::sync::atomic::AtomicBool;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use serde_json::{Value, json};

use super::cpu::{self, CpuMark};
use super::wire::{Conn, Reply};
use super::{BenchError, Options, Progress, Report, drive, histogram, report, spawn_progress};
use crate::client::{Client, segment};

#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Workload {
    /// Each client has a session and loops acquire (random key) + release. Unit: a pair;
    /// latency: the acquire.
    LockChurn,
    /// Open, three heartbeats, close. Unit: the five requests; latency: each request.
    SessionChurn,
    /// `--sessions` live sessions heartbeated round-robin. Unit and latency: a heartbeat.
    Heartbeat,
    /// `--sessions` sessions each holding a lock stop heartbeating at the same instant:
    /// time from the last deadline until every lock is free (polled through the API), and
    /// the acquire latency of live clients during the storm against before it.
    MassExpiry,
    /// Each client takes a seat and gives it back. Unit: a pair; latency: the acquire.
    SeatChurn,
    /// Enqueue, claim, complete. Unit: the three; latency: each request.
    JobChurn,
}

impl Workload {
    pub fn name(self) -> &'static str {
        match self {
            Workload::LockChurn => "lock-churn",
            Workload::SessionChurn => "session-churn",
            Workload::Heartbeat => "heartbeat",
            Workload::MassExpiry => "mass-expiry",
            Workload::SeatChurn => "seat-churn",
            Workload::JobChurn => "job-churn",
        }
    }
}

/// Sessions that live through a whole run.
const LONG_TTL_MS: u64 = 600_000;

fn wall_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap_or_default()
        .as_millis() as u64
}

/// A small, fast, seedable generator for key choice (not for anything secret).
#[derive(Clone)]
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Rng {
        Rng(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1)
    }

    pub fn below(&mut self, n: usize) -> usize {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        (self.0 % n.max(1) as u64) as usize
    }
}

fn ok(r: &Reply<'_>, status: u16) -> Result<(), ()> {
    if r.status == status { Ok(()) } else { Err(()) }
}

/// Sends one request on a [`Conn`]: `send!(conn, "POST", (path format), (body format))`
/// gives the time from the request's formatting to its whole reply, and the reply (or
/// `Err(())`). The formatting is its own statement so that no `fmt::Arguments` lives across
/// the await.
macro_rules! send {
    ($c:expr, $method:literal, ($($path:tt)*), ($($body:tt)*)) => {{
        let t = Instant::now();
        $c.prepare($method, format_args!($($path)*), format_args!($($body)*));
        let r = $c.exchange().await.map_err(|_| ());
        (t.elapsed(), r)
    }};
}

async fn open(client: &Client, owner: &str, ttl_ms: u64) -> Result<(String, u64), BenchError> {
    let r = client
        .post("/v1/sessions", &json!({"owner": owner, "ttl_ms": ttl_ms}))
        .await?;
    if r.status.as_u16() != 201 {
        return Err(BenchError::Setup(format!(
            "open session: {} {}",
            r.status, r.text
        )));
    }
    let id = r.body["session_id"]
        .as_str()
        .unwrap_or_default()
        .to_string();
    let expires = r.body["expires_at"].as_u64().unwrap_or_default();
    Ok((id, expires))
}

/// Opens `n` sessions with `concurrency` requests in flight.
async fn open_many(
    server: &str,
    n: usize,
    concurrency: usize,
    ttl_ms: u64,
) -> Result<Vec<String>, BenchError> {
    let per = n.div_ceil(concurrency.max(1));
    let mut tasks = Vec::new();
    for c in 0..concurrency.max(1) {
        let count = per.min(n.saturating_sub(c * per));
        let client = Client::new(server)?;
        tasks.push(tokio::spawn(async move {
            let mut ids = Vec::with_capacity(count);
            for _ in 0..count {
                ids.push(open(&client, "bench", ttl_ms).await?.0);
            }
            Ok::<_, BenchError>(ids)
        }));
    }
    let mut all = Vec::with_capacity(n);
    for t in tasks {
        all.extend(t.await.map_err(|e| BenchError::Setup(e.to_string()))??);
    }
    Ok(all)
}

async fn close_all(server: &str, ids: &[String]) {
    if let Ok(client) = Client::new(server) {
        for id in ids {
            let _ = client.delete(&format!("/v1/sessions/{id}")).await;
        }
    }
}

pub async fn run(opts: Options) -> Result<Report, BenchError> {
    // The timed requests go over the load generator's own client: refuse a URL it cannot
    // speak to before any setup.
    Conn::new(&opts.server, None)?;
    match opts.workload {
        Workload::MassExpiry => mass_expiry(opts).await,
        w => steady(opts, w).await,
    }
}

/// The closed- or fixed-rate-loop workloads.
async fn steady(opts: Options, workload: Workload) -> Result<Report, BenchError> {
    let run_id = wall_ms() % 1_000_000_007;
    let progress = Arc::new(Progress::default());
    let done = Arc::new(AtomicBool::new(false));
    let client = Client::new(&opts.server)?;
    let clients = opts.clients.max(1);
    let sessions = match workload {
        Workload::SessionChurn => Vec::new(),
        Workload::Heartbeat => {
            open_many(
                &opts.server,
                opts.sessions.max(clients),
                clients,
                LONG_TTL_MS,
            )
            .await?
        }
        _ => open_many(&opts.server, clients, clients, LONG_TTL_MS).await?,
    };
    let pool = format!("bench-seats-{run_id}");
    let queue = format!("bench-jobs-{run_id}");
    if workload == Workload::SeatChurn {
        let r = client
            .call(
                hyper::Method::PUT,
                &format!("/v1/pools/{}", segment(&pool)),
                Some(&json!({"capacity": clients})),
            )
            .await?;
        if !r.status.is_success() {
            return Err(BenchError::Setup(format!(
                "create pool: {} {}",
                r.status, r.text
            )));
        }
    }
    let ticker = opts
        .progress
        .then(|| spawn_progress(workload.name().into(), progress.clone(), done.clone()));
    // One persistent connection per client, made before the clock starts.
    let conns = (0..clients)
        .map(|_| Conn::new(&opts.server, None))
        .collect::<Result<Vec<_>, _>>()?;
    let started = Instant::now();
    let measured = match workload {
        Workload::LockChurn => {
            let keys = opts.keys.max(1);
            let states = conns
                .into_iter()
                .zip(&sessions)
                .enumerate()
                .map(|(i, (c, s))| (c, s.clone(), Rng::new(i as u64 + run_id)))
                .collect();
            drive(
                &opts,
                states,
                move |(mut c, sid, mut rng)| async move {
                    let r = lock_pair(&mut c, &sid, &mut rng, keys, run_id).await;
                    ((c, sid, rng), r)
                },
                progress.clone(),
            )
            .await
        }
        Workload::SessionChurn => {
            drive(
                &opts,
                conns,
                |mut c| async move {
                    let r = session_cycle(&mut c).await;
                    (c, r)
                },
                progress.clone(),
            )
            .await
        }
        Workload::Heartbeat => {
            let per = sessions.len().div_ceil(clients);
            let states = conns
                .into_iter()
                .zip(sessions.chunks(per.max(1)))
                .map(|(c, chunk)| (c, Arc::new(chunk.to_vec()), 0usize))
                .collect();
            drive(
                &opts,
                states,
                |(mut c, ids, i): (Conn, Arc<Vec<String>>, usize)| async move {
                    let id = &ids[i % ids.len()];
                    let (t, r) = send!(c, "POST", ("/v1/sessions/{id}/heartbeat"), ("{{}}"));
                    let r = r.and_then(|r| ok(&r, 200)).map(|()| vec![t]);
                    ((c, ids, i + 1), r)
                },
                progress.clone(),
            )
            .await
        }
        Workload::SeatChurn | Workload::JobChurn => {
            let path: Arc<str> = if workload == Workload::SeatChurn {
                format!("/v1/pools/{}", segment(&pool)).into()
            } else {
                format!("/v1/queues/{}", segment(&queue)).into()
            };
            let states = conns
                .into_iter()
                .zip(&sessions)
                .map(|(c, s)| (c, s.clone(), path.clone()))
                .collect();
            drive(
                &opts,
                states,
                move |(mut c, sid, path): (Conn, String, Arc<str>)| async move {
                    let r = if workload == Workload::SeatChurn {
                        seat_pair(&mut c, &sid, &path).await
                    } else {
                        job_cycle(&mut c, &sid, &path).await
                    };
                    ((c, sid, path), r)
                },
                progress.clone(),
            )
            .await
        }
        Workload::MassExpiry => unreachable!("handled by mass_expiry"),
    };
    let seconds = started.elapsed().saturating_sub(opts.warmup).as_secs_f64();
    done.store(true, std::sync::atomic::Ordering::Relaxed);
    if let Some(t) = ticker {
        let _ = t.await;
    }
    close_all(&opts.server, &sessions).await;
    if workload == Workload::SeatChurn {
        let _ = client
            .delete(&format!("/v1/pools/{}", segment(&pool)))
            .await;
    }
    Ok(report(workload.name(), clients, seconds, measured).with_cpu(&progress))
}

/// Acquire a random free key, then release it; the latency is the acquire's.
async fn lock_pair(
    c: &mut Conn,
    sid: &str,
    rng: &mut Rng,
    keys: usize,
    run_id: u64,
) -> Result<Vec<Duration>, ()> {
    for _ in 0..16 {
        // The key `bench/{run_id}/{k}`, its slashes percent-encoded as `segment` does.
        let k = rng.below(keys);
        let (t, r) = send!(
            c,
            "POST",
            ("/v1/locks/bench%2F{run_id}%2F{k}/acquire"),
            ("{{\"session_id\":\"{sid}\"}}")
        );
        let r = r?;
        match r.status {
            200 => {
                let token = r.u64("token").ok_or(())?;
                let (_, rel) = send!(
                    c,
                    "POST",
                    ("/v1/locks/bench%2F{run_id}%2F{k}/release"),
                    ("{{\"session_id\":\"{sid}\",\"token\":{token}}}")
                );
                ok(&rel?, 200)?;
                return Ok(vec![t]);
            }
            // Another client holds this key: try another, as a real contender would.
            409 => continue,
            _ => return Err(()),
        }
    }
    Err(())
}

async fn session_cycle(c: &mut Conn) -> Result<Vec<Duration>, ()> {
    let mut lat = Vec::with_capacity(5);
    let (t, r) = send!(
        c,
        "POST",
        ("/v1/sessions"),
        ("{{\"owner\":\"bench\",\"ttl_ms\":60000}}")
    );
    let r = r?;
    ok(&r, 201)?;
    lat.push(t);
    let id = r.str("session_id").ok_or(())?.to_string();
    for _ in 0..3 {
        let (t, r) = send!(c, "POST", ("/v1/sessions/{id}/heartbeat"), ("{{}}"));
        ok(&r?, 200)?;
        lat.push(t);
    }
    let (t, r) = send!(c, "DELETE", ("/v1/sessions/{id}"), (""));
    ok(&r?, 200)?;
    lat.push(t);
    Ok(lat)
}

async fn seat_pair(c: &mut Conn, sid: &str, path: &str) -> Result<Vec<Duration>, ()> {
    let (t, r) = send!(
        c,
        "POST",
        ("{path}/acquire"),
        ("{{\"session_id\":\"{sid}\"}}")
    );
    let r = r?;
    ok(&r, 200)?;
    let token = r.u64("seat_token").ok_or(())?;
    let (_, rel) = send!(
        c,
        "POST",
        ("{path}/release"),
        ("{{\"session_id\":\"{sid}\",\"seat_token\":{token}}}")
    );
    ok(&rel?, 200)?;
    Ok(vec![t])
}

async fn job_cycle(c: &mut Conn, sid: &str, path: &str) -> Result<Vec<Duration>, ()> {
    let (t1, r) = send!(
        c,
        "POST",
        ("{path}/jobs"),
        ("{{\"payload\":{{\"n\":1}},\"idempotent\":true}}")
    );
    ok(&r?, 201)?;
    let (t2, r) = send!(
        c,
        "POST",
        ("{path}/claim"),
        ("{{\"session_id\":\"{sid}\"}}")
    );
    let r = r?;
    if r.status == 204 {
        // Another client took the job this one queued; the queue is never starved for long.
        return Ok(vec![t1, t2]);
    }
    ok(&r, 200)?;
    let job = r.str("job_id").ok_or(())?.to_string();
    let token = r.u64("token").ok_or(())?;
    let (t3, r) = send!(
        c,
        "POST",
        ("/v1/jobs/{job}/complete"),
        ("{{\"session_id\":\"{sid}\",\"token\":{token}}}")
    );
    ok(&r?, 200)?;
    Ok(vec![t1, t2, t3])
}

/// `--sessions` sessions, each holding one lock, stop heartbeating at one instant.
/// Connections that open mass-expiry's dying sessions, at the least.
const SETUP_CONNECTIONS: usize = 64;

async fn mass_expiry(opts: Options) -> Result<Report, BenchError> {
    let run_id = wall_ms() % 1_000_000_007;
    let prefix = format!("mass-expiry/{run_id}/");
    let n = opts.sessions.max(1);
    let clients = opts.clients.max(1);
    // The setup is not measured, so it is not held to the live clients' count: a storm
    // watched by a few live clients still takes no longer than a minute or so to prepare.
    let setup = clients.max(SETUP_CONNECTIONS);
    let setup_started = Instant::now();
    // 1. The dying sessions, each with its lock, opened with a long TTL.
    let per = n.div_ceil(setup);
    let mut tasks = Vec::new();
    for c in 0..setup {
        let range = (c * per)..((c + 1) * per).min(n);
        let client = Client::new(&opts.server)?;
        let prefix = prefix.clone();
        tasks.push(tokio::spawn(async move {
            let mut ids = Vec::with_capacity(range.len());
            for i in range {
                let (id, _) = open(&client, "mass-expiry", LONG_TTL_MS).await?;
                let key = format!("{prefix}{i}");
                let r = client
                    .post(
                        &format!("/v1/locks/{}/acquire", segment(&key)),
                        &json!({"session_id": id}),
                    )
                    .await?;
                if r.status.as_u16() != 200 {
                    return Err(BenchError::Setup(format!(
                        "acquire: {} {}",
                        r.status, r.text
                    )));
                }
                ids.push(id);
            }
            Ok::<_, BenchError>(ids)
        }));
    }
    let mut dying = Vec::with_capacity(n);
    for t in tasks {
        dying.extend(t.await.map_err(|e| BenchError::Setup(e.to_string()))??);
    }
    // 2. One heartbeat each, with a TTL chosen so every deadline lands on the same instant.
    let wave = setup_started.elapsed().as_millis() as u64 / 2;
    let target = wall_ms() + (2 * wave).max(opts.ttl_ms).max(3_000);
    let chunks: Vec<Vec<String>> = dying.chunks(per.max(1)).map(<[String]>::to_vec).collect();
    let mut tasks = Vec::new();
    for chunk in chunks {
        let client = Client::new(&opts.server)?;
        tasks.push(tokio::spawn(async move {
            let (mut first, mut last) = (u64::MAX, 0u64);
            for id in chunk {
                let ttl = target.saturating_sub(wall_ms()).max(1_000);
                let r = client
                    .post(
                        &format!("/v1/sessions/{id}/heartbeat"),
                        &json!({"ttl_ms": ttl}),
                    )
                    .await?;
                let at = r.body["expires_at"].as_u64().ok_or_else(|| {
                    BenchError::Setup(format!("heartbeat: {} {}", r.status, r.text))
                })?;
                first = first.min(at);
                last = last.max(at);
            }
            Ok::<_, BenchError>((first, last))
        }));
    }
    let (mut first_deadline, mut last_deadline) = (u64::MAX, 0u64);
    for t in tasks {
        let (f, l) = t.await.map_err(|e| BenchError::Setup(e.to_string()))??;
        first_deadline = first_deadline.min(f);
        last_deadline = last_deadline.max(l);
    }
    // 3. Live clients churn other locks through the storm; samples keep their wall time.
    let live = open_many(&opts.server, clients, clients, LONG_TTL_MS).await?;
    let stop = Arc::new(AtomicBool::new(false));
    let mut churners = Vec::new();
    for (i, sid) in live.iter().enumerate() {
        let mut conn = Conn::new(&opts.server, None)?;
        let (sid, stop) = (sid.clone(), stop.clone());
        let keys = opts.keys.max(1);
        churners.push(tokio::spawn(async move {
            let mut rng = Rng::new(i as u64 + run_id);
            let mut samples = Vec::new();
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                let lat = lock_pair(&mut conn, &sid, &mut rng, keys, run_id).await;
                samples.push((wall_ms(), lat.ok().map(|l| l[0].as_micros() as u64)));
            }
            samples
        }));
    }
    // 4. Poll until every dying lock is free.
    let client = Client::new(&opts.server)?;
    let poll = format!("/v1/locks?prefix={}&limit=1", segment(&prefix));
    let mut storm_began = None;
    let (free_at, storm_cpu) = loop {
        tokio::time::sleep(Duration::from_millis(2)).await;
        if wall_ms() < first_deadline {
            continue;
        }
        let began = *storm_began.get_or_insert_with(|| CpuMark::now(opts.server_pid));
        let r = client.get(&poll).await?;
        if r.body["locks"].as_array().is_some_and(Vec::is_empty) {
            let mut extra = serde_json::Map::new();
            // The server's CPU from the first deadline to all free, per dying session: the
            // reaper's work, plus the live clients' churn and this poll meanwhile.
            cpu::per_op(began, CpuMark::now(opts.server_pid), n as u64, &mut extra);
            break (wall_ms(), extra);
        }
        if wall_ms() > last_deadline + 120_000 {
            return Err(BenchError::Setup(
                "locks still held two minutes after their deadline".into(),
            ));
        }
    };
    tokio::time::sleep(Duration::from_millis(200)).await;
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let mut samples = Vec::new();
    for t in churners {
        samples.extend(t.await.unwrap_or_default());
    }
    close_all(&opts.server, &live).await;
    Ok(storm_report(
        Storm {
            sessions: n,
            clients,
            first_deadline,
            last_deadline,
            free_at,
            samples,
        },
        storm_cpu,
    ))
}

/// What a mass-expiry run observed, in wall-clock milliseconds: the dying sessions'
/// deadlines, when every lock was seen free, and each live unit as (when it finished, its
/// acquire latency in µs, or `None` when it failed).
pub struct Storm {
    pub sessions: usize,
    pub clients: usize,
    pub first_deadline: u64,
    pub last_deadline: u64,
    pub free_at: u64,
    pub samples: Vec<(u64, Option<u64>)>,
}

/// The mass-expiry report: the time from the last deadline until all free; the live
/// acquires before the first deadline as `baseline_p99_us` and those of the storm (until all
/// free) as p50/p99/p99.9; the live units that failed during the storm as errors. `extra`
/// carries fields of the caller's own.
pub fn storm_report(storm: Storm, mut extra: serde_json::Map<String, Value>) -> Report {
    let Storm {
        sessions,
        clients,
        first_deadline,
        last_deadline,
        free_at,
        samples,
    } = storm;
    let (mut before, mut during) = (histogram(), histogram());
    let mut errors = 0;
    for (at, us) in samples {
        match us {
            Some(us) if at < first_deadline => {
                let _ = before.record(us.clamp(1, 60_000_000));
            }
            Some(us) if at <= free_at => {
                let _ = during.record(us.clamp(1, 60_000_000));
            }
            None if (first_deadline..=free_at).contains(&at) => errors += 1,
            _ => {}
        }
    }
    let free_after_ms = free_at.saturating_sub(last_deadline);
    let seconds = free_after_ms as f64 / 1_000.0;
    extra.insert("sessions".into(), json!(sessions));
    extra.insert(
        "deadline_spread_ms".into(),
        json!(last_deadline.saturating_sub(first_deadline)),
    );
    extra.insert("free_after_ms".into(), json!(free_after_ms));
    extra.insert(
        "baseline_p99_us".into(),
        json!(before.value_at_quantile(0.99)),
    );
    extra.insert("storm_p99_us".into(), json!(during.value_at_quantile(0.99)));
    extra.insert("storm_samples".into(), Value::from(during.len()));
    Report {
        workload: Workload::MassExpiry.name().into(),
        clients,
        ops: sessions as u64,
        seconds,
        ops_per_s: if seconds > 0.0 {
            sessions as f64 / seconds
        } else {
            0.0
        },
        p50_us: during.value_at_quantile(0.50),
        p99_us: during.value_at_quantile(0.99),
        p999_us: during.value_at_quantile(0.999),
        errors,
        extra,
    }
}
