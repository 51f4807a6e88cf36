//! The workloads against etcd (v3 API through its JSON gateway over HTTP/1.1, one persistent
//! connection per client): a session is a lease, a lock is a key put with the holder's lease
//! when its create revision is 0 (the revision of that put is the token, as in etcd's own
//! `concurrency.Mutex`), released by deleting it while its create revision is still the
//! token; a heartbeat is a lease keep-alive.

use std::sync::Arc;
use std::time::{Duration, Instant};

use leasehold::client::Client;
use leasehold::loadgen::{self, Options, Progress, Workload, drive, report};
use serde_json::{Value, json};

const KEYS: usize = 10_000;
const SESSIONS: usize = 100_000;
const TTL_S: u64 = 600;

/// Standard base64 with padding, for the gateway's `bytes` fields.
fn b64(bytes: &[u8]) -> String {
    const ABC: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let mut out = String::with_capacity(bytes.len().div_ceil(3) * 4);
    for chunk in bytes.chunks(3) {
        let b = [
            chunk[0],
            *chunk.get(1).unwrap_or(&0),
            *chunk.get(2).unwrap_or(&0),
        ];
        let n = (u32::from(b[0]) << 16) | (u32::from(b[1]) << 8) | u32::from(b[2]);
        for i in 0..4 {
            if i <= chunk.len() {
                out.push(ABC[(n >> (18 - 6 * i) & 63) as usize] as char);
            } else {
                out.push('=');
            }
        }
    }
    out
}

/// An int64 of the gateway's JSON, which writes them as strings.
fn int(v: &Value) -> Option<i64> {
    match v {
        Value::String(s) => s.parse().ok(),
        Value::Number(n) => n.as_i64(),
        _ => None,
    }
}

async fn grant(c: &Client, ttl_s: u64) -> Result<String, ()> {
    let r = c
        .post("/v3/lease/grant", &json!({"TTL": ttl_s}))
        .await
        .map_err(|_| ())?;
    r.body["ID"].as_str().map(str::to_string).ok_or(())
}

/// A keep-alive; fails for a lease that is gone (etcd answers it without a TTL).
async fn keepalive(c: &Client, id: &str) -> Result<(), ()> {
    let r = c
        .post("/v3/lease/keepalive", &json!({"ID": id}))
        .await
        .map_err(|_| ())?;
    match int(&r.body["result"]["TTL"]) {
        Some(ttl) if ttl > 0 => Ok(()),
        _ => Err(()),
    }
}

async fn revoke(c: &Client, id: &str) -> Result<(), ()> {
    let r = c
        .post("/v3/lease/revoke", &json!({"ID": id}))
        .await
        .map_err(|_| ())?;
    if r.status.is_success() {
        Ok(())
    } else {
        Err(())
    }
}

/// Takes `key` for the lease if nobody holds it: the token, or `None` when held.
async fn acquire(c: &Client, key: &str, lease: &str) -> Result<Option<i64>, ()> {
    let k = b64(key.as_bytes());
    let body = json!({
        "compare": [{"key": k, "target": "CREATE", "create_revision": "0"}],
        "success": [{"request_put": {"key": k, "value": b64(lease.as_bytes()), "lease": lease}}],
    });
    let r = c.post("/v3/kv/txn", &body).await.map_err(|_| ())?;
    if !r.status.is_success() {
        return Err(());
    }
    if r.body["succeeded"].as_bool() == Some(true) {
        int(&r.body["header"]["revision"]).map(Some).ok_or(())
    } else {
        Ok(None)
    }
}

/// Deletes `key` if it is still the grant of `token`.
async fn release(c: &Client, key: &str, token: i64) -> Result<(), ()> {
    let k = b64(key.as_bytes());
    let body = json!({
        "compare": [{"key": k, "target": "CREATE", "create_revision": token.to_string()}],
        "success": [{"request_delete_range": {"key": k}}],
    });
    let r = c.post("/v3/kv/txn", &body).await.map_err(|_| ())?;
    if r.body["succeeded"].as_bool() == Some(true) {
        Ok(())
    } else {
        Err(())
    }
}

/// Acquire a free key of `KEYS` (another client may hold one: try the next), then release
/// it; the latency is the acquire's.
async fn lock_pair(c: &Client, lease: &str, client: usize, i: usize) -> Result<Duration, ()> {
    for attempt in 0..16 {
        let key = format!(
            "cmp/lock/{}",
            (client * 7919 + (i * 16 + attempt) * 104_729) % KEYS
        );
        let t = Instant::now();
        if let Some(token) = acquire(c, &key, lease).await? {
            let latency = t.elapsed();
            release(c, &key, token).await?;
            return Ok(latency);
        }
    }
    Err(())
}

async fn session_cycle(c: &Client) -> Result<Vec<Duration>, ()> {
    let mut latencies = Vec::with_capacity(5);
    let t = Instant::now();
    let id = grant(c, TTL_S).await?;
    latencies.push(t.elapsed());
    for _ in 0..3 {
        let t = Instant::now();
        keepalive(c, &id).await?;
        latencies.push(t.elapsed());
    }
    let t = Instant::now();
    revoke(c, &id).await?;
    latencies.push(t.elapsed());
    Ok(latencies)
}

pub async fn run(url: &str, workload: Workload, opts: Options) -> loadgen::Report {
    let clients = opts.clients;
    let setup = Client::new(url).expect("an etcd URL");
    let leases = match workload {
        Workload::Heartbeat => SESSIONS,
        Workload::SessionChurn => 0,
        _ => clients,
    };
    // Granted from several connections at once: etcd commits each grant through Raft.
    let mut granting = tokio::task::JoinSet::new();
    let per = leases.div_ceil(64).max(1);
    for part in 0..leases.div_ceil(per) {
        let c = Client::new(url).expect("an etcd URL");
        let n = per.min(leases - part * per);
        granting.spawn(async move {
            let mut ids = Vec::with_capacity(n);
            for _ in 0..n {
                ids.push(grant(&c, TTL_S).await.expect("lease grant"));
            }
            ids
        });
    }
    let mut ids = Vec::with_capacity(leases);
    while let Some(part) = granting.join_next().await {
        ids.extend(part.expect("granting"));
    }
    drop(setup);
    let ids = Arc::new(ids);
    let states: Vec<(Client, usize, usize)> = (0..clients)
        .map(|c| (Client::new(url).expect("an etcd URL"), c, 0))
        .collect();
    let progress = Arc::new(Progress::default());
    let started = Instant::now();
    let measured = drive(
        &opts,
        states,
        move |(c, client, mut i): (Client, usize, usize)| {
            let ids = ids.clone();
            async move {
                i += 1;
                let r = match workload {
                    Workload::Heartbeat => {
                        let id = &ids[(client + i * clients) % ids.len()];
                        let t = Instant::now();
                        keepalive(&c, id).await.map(|()| vec![t.elapsed()])
                    }
                    Workload::SessionChurn => session_cycle(&c).await,
                    _ => lock_pair(&c, &ids[client], client, i)
                        .await
                        .map(|latency| vec![latency]),
                };
                ((c, client, i), r)
            }
        },
        progress.clone(),
    )
    .await;
    let seconds = started.elapsed().saturating_sub(opts.warmup).as_secs_f64();
    report(workload.name(), clients, seconds, measured).with_cpu(&progress)
}

#[cfg(test)]
mod tests {
    #[test]
    fn base64_as_the_gateway_reads_it() {
        assert_eq!(super::b64(b"cmp/k1"), "Y21wL2sx");
        assert_eq!(super::b64(b"x"), "eA==");
        assert_eq!(super::b64(b"ab"), "YWI=");
        assert_eq!(super::b64(b""), "");
    }
}
