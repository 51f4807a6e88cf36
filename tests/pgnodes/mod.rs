//! What the multi-node PostgreSQL tests share: a fresh schema per test, real `leasehold serve`
//! processes on the PostgreSQL backend, bounded HTTP calls, the audit log read to its end, and
//! a private PostgreSQL cluster that a test may stop and start.
//!
//! The scenarios that need no private cluster run on Redis too: with
//! `LEASEHOLD_NODES_BACKEND=redis` every node of [`Cluster::start`] is `--backend redis` on the
//! machine's Redis (`LEASEHOLD_TEST_REDIS_URL`, by default `redis://127.0.0.1:6379/0`) under a
//! fresh namespace, whose keys are deleted afterwards (`scripts/test` runs them so).
#![allow(dead_code)]

pub mod ledger;

use std::fs::OpenOptions;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use hyper::Method;
use leasehold::client::{Client, ClientError, Reply};
use serde_json::{Value, json};

/// The shared PostgreSQL server of the test machine.
pub const PG_HOST: &str = "127.0.0.1";
pub const PG_PORT: u16 = 5432;
pub const PG_DB: &str = "test";
/// Any single HTTP request taking longer than this is a failure in itself.
pub const REQUEST_TIMEOUT: Duration = Duration::from_secs(10);
const READY_TIMEOUT: Duration = Duration::from_secs(30);
const PSQL_TIMEOUT: Duration = Duration::from_secs(20);

pub fn pg_url(port: u16, db: &str) -> String {
    format!("postgres://postgres@{PG_HOST}:{port}/{db}")
}

/// The backend the nodes of a [`Cluster`] share.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Store {
    Postgres,
    Redis,
}

/// `LEASEHOLD_NODES_BACKEND`: `postgres` (the default) or `redis`.
pub fn store() -> Store {
    match std::env::var("LEASEHOLD_NODES_BACKEND").as_deref() {
        Ok("redis") => Store::Redis,
        Ok("postgres") | Err(_) => Store::Postgres,
        Ok(other) => panic!("LEASEHOLD_NODES_BACKEND must be postgres or redis, not {other:?}"),
    }
}

pub fn redis_url() -> String {
    std::env::var("LEASEHOLD_TEST_REDIS_URL")
        .unwrap_or_else(|_| "redis://127.0.0.1:6379/0".to_string())
}

/// xorshift64*, seeded through splitmix64 so that small seeds are fine.
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Rng {
        let mut z = seed.wrapping_add(0x9E37_79B9_7F4A_7C15);
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^= z >> 31;
        Rng(if z == 0 { 1 } else { z })
    }

    pub fn next(&mut self) -> u64 {
        let mut x = self.0;
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        self.0 = x;
        x.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }

    pub fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }

    pub fn between(&mut self, lo: u64, hi: u64) -> u64 {
        lo + self.below(hi - lo + 1)
    }
}

/// The seed of a randomised test: `PG_NODES_SEED` replays one.
pub fn seed() -> u64 {
    match std::env::var("PG_NODES_SEED") {
        Ok(s) => s
            .trim()
            .parse()
            .unwrap_or_else(|_| panic!("PG_NODES_SEED must be a u64, got {s:?}")),
        Err(_) => std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos() as u64)
            .unwrap_or(1),
    }
}

/// A free port on 127.0.0.1 (free when asked; the caller retries if someone takes it).
pub fn free_port() -> u16 {
    let l = std::net::TcpListener::bind("127.0.0.1:0").expect("bind 127.0.0.1:0");
    l.local_addr().unwrap().port()
}

/// The last part of a log file, for failure messages.
pub fn tail(path: &Path) -> String {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let start = text.len().saturating_sub(3_000);
    let start = (start..text.len())
        .find(|i| text.is_char_boundary(*i))
        .unwrap_or(text.len());
    text[start..].to_string()
}

/// Runs a command to its end, killing it if it takes longer than `limit`: exit success and
/// the output.
pub fn run_bounded(cmd: &mut Command, limit: Duration) -> (bool, String) {
    let dir = tempfile::tempdir().expect("a temporary directory");
    let out_path = dir.path().join("out");
    let out = std::fs::File::create(&out_path).expect("create the output file");
    let err = out.try_clone().expect("clone the output file");
    let mut child = cmd
        .stdin(Stdio::null())
        .stdout(out)
        .stderr(err)
        .spawn()
        .unwrap_or_else(|e| panic!("spawn {cmd:?}: {e}"));
    let deadline = Instant::now() + limit;
    let status = loop {
        if let Some(status) = child.try_wait().expect("try_wait") {
            break Some(status);
        }
        if Instant::now() >= deadline {
            let _ = child.kill();
            let _ = child.wait();
            break None;
        }
        std::thread::sleep(Duration::from_millis(10));
    };
    let text = std::fs::read_to_string(&out_path).unwrap_or_default();
    match status {
        Some(s) => (s.success(), text),
        None => (false, format!("{text}\n(killed after {limit:?})")),
    }
}

/// One SQL script through `psql`, bounded in time; panics with psql's output on failure.
pub fn psql(url: &str, sql: &str) -> String {
    let (ok, out) = run_bounded(
        Command::new("psql")
            .args([
                "-X",
                "-q",
                "-A",
                "-t",
                "-v",
                "ON_ERROR_STOP=1",
                "-d",
                url,
                "-c",
                sql,
            ])
            .env("PGCONNECT_TIMEOUT", "5")
            .env(
                "PGOPTIONS",
                "-c statement_timeout=15000 -c lock_timeout=15000",
            ),
        PSQL_TIMEOUT,
    );
    assert!(ok, "psql {sql:?} on {url}: {out}");
    out
}

/// A fresh schema (or Redis namespace) `t_<hex>` for one test, dropped when the guard goes.
pub struct Schema {
    pub name: String,
    pub url: String,
    pub store: Store,
}

impl Schema {
    pub fn new(url: &str) -> Schema {
        let name = format!("t_{}", uuid::Uuid::new_v4().simple());
        Schema {
            name,
            url: url.to_string(),
            store: Store::Postgres,
        }
    }

    /// A fresh namespace on the Redis at `url`.
    pub fn redis(url: &str) -> Schema {
        Schema {
            name: format!("t_{}", uuid::Uuid::new_v4().simple()),
            url: url.to_string(),
            store: Store::Redis,
        }
    }

    /// On the shared server of the test machine, of the backend [`store`] names.
    pub fn shared() -> Schema {
        match store() {
            Store::Postgres => Schema::new(&pg_url(PG_PORT, PG_DB)),
            Store::Redis => Schema::redis(&redis_url()),
        }
    }
}

impl Drop for Schema {
    fn drop(&mut self) {
        if self.store == Store::Redis {
            let (ok, out) = run_bounded(
                Command::new("redis-cli").args([
                    "-u",
                    &self.url,
                    "EVAL",
                    "local n = 0 for _, k in ipairs(redis.call('KEYS', ARGV[1])) do \
                     redis.call('DEL', k) n = n + 1 end return n",
                    "0",
                    &format!("{}:*", self.name),
                ]),
                PSQL_TIMEOUT,
            );
            if !ok && !std::thread::panicking() {
                eprintln!("could not delete the keys of {}: {out}", self.name);
            }
            return;
        }
        let sql = format!("DROP SCHEMA IF EXISTS {} CASCADE", self.name);
        let (ok, out) = run_bounded(
            Command::new("psql")
                .args([
                    "-X",
                    "-q",
                    "-v",
                    "ON_ERROR_STOP=1",
                    "-d",
                    &self.url,
                    "-c",
                    &sql,
                ])
                .env("PGCONNECT_TIMEOUT", "5")
                .env(
                    "PGOPTIONS",
                    "-c statement_timeout=15000 -c lock_timeout=15000",
                ),
            PSQL_TIMEOUT,
        );
        if !ok && !std::thread::panicking() {
            eprintln!("could not drop schema {}: {out}", self.name);
        }
    }
}

/// How to start one node.
#[derive(Clone)]
pub struct NodeSpec {
    pub name: String,
    pub store: Store,
    pub url: String,
    pub namespace: String,
    pub reaper: bool,
    pub reaper_interval_ms: u64,
    /// Connections the node may open: the shared server serves other tests too.
    pub pool_size: usize,
    pub extra: Vec<String>,
    pub log: PathBuf,
    pub data_dir: PathBuf,
}

impl NodeSpec {
    pub fn new(name: &str, schema: &Schema, logs: &Path) -> NodeSpec {
        NodeSpec {
            name: name.to_string(),
            store: schema.store,
            url: schema.url.clone(),
            namespace: schema.name.clone(),
            reaper: false,
            reaper_interval_ms: 1000,
            pool_size: 6,
            extra: Vec::new(),
            log: logs.join(format!("{name}.log")),
            data_dir: logs.join(format!("{name}-data")),
        }
    }

    pub fn reaper(mut self, interval_ms: u64) -> NodeSpec {
        self.reaper = true;
        self.reaper_interval_ms = interval_ms;
        self
    }
}

/// A running `leasehold serve --backend postgres`. Dropping it kills the process.
pub struct Node {
    pub spec: NodeSpec,
    child: Child,
    pub client: Client,
    pub port: u16,
}

impl Node {
    /// Starts the binary on a free port and waits (bounded) until `/readyz` answers 200.
    pub async fn start(spec: &NodeSpec) -> Node {
        Node::launch(spec, true).await
    }

    /// Starts the binary on a free port and waits (bounded) until it answers HTTP, ready or
    /// not.
    pub async fn start_serving(spec: &NodeSpec) -> Node {
        Node::launch(spec, false).await
    }

    async fn launch(spec: &NodeSpec, want_ready: bool) -> Node {
        for _ in 0..20 {
            let port = free_port();
            let log = OpenOptions::new()
                .create(true)
                .append(true)
                .open(&spec.log)
                .expect("open the node log");
            let mut cmd = Command::new(env!("CARGO_BIN_EXE_leasehold"));
            cmd.arg("serve");
            match spec.store {
                Store::Postgres => cmd
                    .args(["--backend", "postgres"])
                    .args(["--postgres-url", &spec.url])
                    .args(["--postgres-pool-size", &spec.pool_size.to_string()]),
                // The machine's Redis keeps nothing on disk.
                Store::Redis => cmd
                    .args(["--backend", "redis"])
                    .args(["--redis-url", &spec.url])
                    .args(["--redis-allow-volatile", "true"]),
            };
            cmd.args(["--namespace", &spec.namespace])
                .args(["--listen", &format!("127.0.0.1:{port}")])
                .arg("--data-dir")
                .arg(&spec.data_dir)
                .args([
                    "--reaper-enabled",
                    if spec.reaper { "true" } else { "false" },
                ])
                .args(["--reaper-interval-ms", &spec.reaper_interval_ms.to_string()])
                .args(["--log-level", "info"])
                .args(&spec.extra)
                .stdin(Stdio::null())
                .stdout(Stdio::null())
                .stderr(log);
            // Settings from the environment would change what is being tested.
            for (name, _) in std::env::vars_os() {
                if name.to_string_lossy().starts_with("LEASEHOLD_") {
                    cmd.env_remove(name);
                }
            }
            let child = cmd.spawn().expect("spawn leasehold serve");
            let client = Client::new(&format!("http://127.0.0.1:{port}")).unwrap();
            let mut node = Node {
                spec: spec.clone(),
                child,
                client,
                port,
            };
            let deadline = Instant::now() + READY_TIMEOUT;
            loop {
                if let Some(status) = node.child.try_wait().expect("try_wait") {
                    let log = tail(&spec.log);
                    if log.contains("cannot listen") || log.contains("Address already in use") {
                        break; // someone took the port meanwhile: try another
                    }
                    panic!(
                        "node {} exited with {status} before it was ready:\n{log}",
                        spec.name
                    );
                }
                let probe =
                    tokio::time::timeout(Duration::from_secs(2), node.client.get("/readyz"));
                if let Ok(Ok(r)) = probe.await
                    && (r.status == 200 || !want_ready)
                {
                    return node;
                }
                assert!(
                    Instant::now() < deadline,
                    "node {} was not ready within {READY_TIMEOUT:?}:\n{}",
                    spec.name,
                    tail(&spec.log)
                );
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        }
        panic!("found no free port in 20 attempts");
    }

    pub fn name(&self) -> &str {
        &self.spec.name
    }

    /// True while the process has not exited.
    pub fn running(&mut self) -> bool {
        self.child.try_wait().expect("try_wait").is_none()
    }

    /// SIGKILL (`kill -9`), then reap the process.
    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    fn fail(&self, what: String) -> ! {
        panic!(
            "{what}\nlog of node {}:\n{}",
            self.spec.name,
            tail(&self.spec.log)
        )
    }

    /// A request that must be answered (any status) within [`REQUEST_TIMEOUT`].
    pub async fn call(&self, method: Method, path: &str, body: Option<Value>) -> Reply {
        let m = method.clone();
        match tokio::time::timeout(
            REQUEST_TIMEOUT,
            self.client.call(method, path, body.as_ref()),
        )
        .await
        {
            Err(_) => self.fail(format!("{m} {path} on {} hung", self.spec.name)),
            Ok(Err(e)) => self.fail(format!("{m} {path} on {}: {e}", self.spec.name)),
            Ok(Ok(r)) => r,
        }
    }

    pub async fn get(&self, path: &str) -> Reply {
        self.call(Method::GET, path, None).await
    }

    pub async fn post(&self, path: &str, body: Value) -> Reply {
        self.call(Method::POST, path, Some(body)).await
    }

    pub async fn put(&self, path: &str, body: Value) -> Reply {
        self.call(Method::PUT, path, Some(body)).await
    }

    pub async fn delete(&self, path: &str) -> Reply {
        self.call(Method::DELETE, path, None).await
    }

    /// Opens a session and returns its id.
    pub async fn open(&self, owner: &str, ttl_ms: u64) -> String {
        let r = self
            .post("/v1/sessions", json!({"owner": owner, "ttl_ms": ttl_ms}))
            .await;
        assert_eq!(r.status, 201, "open on {}: {}", self.spec.name, r.text);
        r.body["session_id"].as_str().unwrap().to_string()
    }
}

impl Drop for Node {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The nodes of one test on one fresh schema, and their logs. On a panic the logs' tails are
/// printed; the nodes are killed before the schema is dropped.
pub struct Cluster {
    pub nodes: Vec<Node>,
    pub logs: tempfile::TempDir,
    pub schema: Schema,
}

impl Cluster {
    /// Nodes named A, B, … on a fresh schema of the shared server; `reaper` gives every node a
    /// background reaper with that interval.
    pub async fn start(n: usize, reaper: Option<u64>) -> Cluster {
        let schema = Schema::shared();
        let logs = tempfile::tempdir().unwrap();
        let mut nodes = Vec::with_capacity(n);
        for i in 0..n {
            let name = ((b'A' + i as u8) as char).to_string();
            let mut spec = NodeSpec::new(&name, &schema, logs.path());
            if let Some(ms) = reaper {
                spec = spec.reaper(ms);
            }
            nodes.push(Node::start(&spec).await);
        }
        Cluster {
            nodes,
            logs,
            schema,
        }
    }

    pub fn spec(&self, name: &str) -> NodeSpec {
        NodeSpec::new(name, &self.schema, self.logs.path())
    }

    /// The tails of every log, for a failure message.
    pub fn logs(&self) -> String {
        let mut out = String::new();
        for n in &self.nodes {
            out.push_str(&format!(
                "\n--- log of node {} ---\n{}",
                n.spec.name,
                tail(&n.spec.log)
            ));
        }
        out
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        if std::thread::panicking() {
            eprintln!("schema {}{}", self.schema.name, self.logs());
        }
        for n in &mut self.nodes {
            n.kill();
        }
    }
}

/// What became of one request.
pub enum Outcome {
    Reply(Reply),
    /// The connection was refused: the request never reached a server.
    NotSent,
    /// Sent, but no answer came back: it may or may not have happened.
    InDoubt(String),
}

/// One request, bounded by [`REQUEST_TIMEOUT`], whose failure is an outcome, not a panic.
pub async fn send(client: &Client, method: Method, path: &str, body: Option<&Value>) -> Outcome {
    match tokio::time::timeout(REQUEST_TIMEOUT, client.call(method, path, body)).await {
        Err(_) => Outcome::InDoubt(format!("no answer within {REQUEST_TIMEOUT:?}")),
        Ok(Ok(r)) => Outcome::Reply(r),
        // hyper's connect error: no byte of the request was written.
        Ok(Err(ClientError::Connect { message, .. }))
            if message.starts_with("hyper_util::client::legacy::Error(Connect") =>
        {
            Outcome::NotSent
        }
        Ok(Err(e)) => Outcome::InDoubt(e.to_string()),
    }
}

/// Every audit event, read page by page (`limit` per page) to the end of the log; checks
/// that `seq` strictly increases across pages.
pub async fn all_events(node: &Node, limit: usize) -> Vec<Value> {
    let mut out: Vec<Value> = Vec::new();
    let mut after = 0u64;
    for _ in 0..100_000 {
        let r = node
            .get(&format!("/v1/events?after={after}&limit={limit}"))
            .await;
        assert_eq!(r.status, 200, "events after {after}: {}", r.text);
        let page = r.body["events"].as_array().cloned().unwrap_or_default();
        if page.is_empty() {
            return out;
        }
        assert!(
            page.len() <= limit,
            "a page of {} > limit {limit}",
            page.len()
        );
        for e in &page {
            let seq = e["seq"].as_u64().expect("an event has a seq");
            assert!(seq > after, "event seq {seq} after cursor {after}: {e}");
            after = seq;
        }
        assert_eq!(
            r.body["next"].as_u64(),
            Some(after),
            "next is the last seq of the page"
        );
        out.extend(page);
    }
    panic!("the audit log did not end within 100 000 pages");
}

/// A private PostgreSQL cluster (initdb in a temporary directory, on a free port), which a
/// test can stop and start. Dropping it stops the server (immediate mode) and removes it.
pub struct PrivateCluster {
    dir: tempfile::TempDir,
    pub port: u16,
    as_postgres: bool,
}

const PG_BIN: &str = "/usr/lib/postgresql/15/bin";

impl PrivateCluster {
    pub fn new() -> PrivateCluster {
        let dir = tempfile::tempdir().expect("a temporary directory");
        // PostgreSQL refuses to run as root: as root, the cluster belongs to `postgres`.
        let as_postgres = std::fs::metadata("/proc/self")
            .map(|m| m.uid())
            .unwrap_or(1)
            == 0;
        if as_postgres {
            let (ok, out) = run_bounded(
                Command::new("chown")
                    .arg("postgres:postgres")
                    .arg(dir.path()),
                PSQL_TIMEOUT,
            );
            assert!(ok, "chown the cluster directory to postgres: {out}");
        }
        let mut cluster = PrivateCluster {
            dir,
            port: 0,
            as_postgres,
        };
        let data = cluster.data();
        let (ok, out) = run_bounded(
            cluster.command("initdb").arg("-D").arg(&data).args([
                "-A",
                "trust",
                "-U",
                "postgres",
                "--no-sync",
                "-E",
                "UTF8",
            ]),
            Duration::from_secs(60),
        );
        assert!(ok, "initdb: {out}");
        cluster.port = free_port();
        cluster
    }

    fn data(&self) -> PathBuf {
        self.dir.path().join("data")
    }

    pub fn log(&self) -> PathBuf {
        self.dir.path().join("postgres.log")
    }

    fn command(&self, program: &str) -> Command {
        let path = format!("{PG_BIN}/{program}");
        if self.as_postgres {
            let mut c = Command::new("runuser");
            c.args(["-u", "postgres", "--", &path]);
            c
        } else {
            Command::new(path)
        }
    }

    pub fn url(&self) -> String {
        pg_url(self.port, "postgres")
    }

    /// `pg_ctl start`, waiting until it accepts connections.
    pub fn start(&self) {
        let opts = format!(
            "-p {} -k {} -c listen_addresses=127.0.0.1 -c max_connections=100",
            self.port,
            self.dir.path().display()
        );
        let (ok, out) = run_bounded(
            self.command("pg_ctl")
                .arg("-D")
                .arg(self.data())
                .arg("-l")
                .arg(self.log())
                .args(["-o", &opts, "-w", "-t", "30", "start"]),
            Duration::from_secs(40),
        );
        assert!(ok, "pg_ctl start: {out}\n{}", tail(&self.log()));
    }

    /// `pg_ctl stop -m fast`: active connections are cut, the server stops cleanly.
    pub fn stop_fast(&self) {
        let (ok, out) = run_bounded(
            self.command("pg_ctl")
                .arg("-D")
                .arg(self.data())
                .args(["-m", "fast", "-w", "-t", "30", "stop"]),
            Duration::from_secs(40),
        );
        assert!(ok, "pg_ctl stop -m fast: {out}\n{}", tail(&self.log()));
    }
}

impl Drop for PrivateCluster {
    fn drop(&mut self) {
        if std::thread::panicking() {
            eprintln!("--- postgres log ---\n{}", tail(&self.log()));
        }
        if self.data().join("postmaster.pid").exists() {
            let _ = run_bounded(
                self.command("pg_ctl").arg("-D").arg(self.data()).args([
                    "-m",
                    "immediate",
                    "-w",
                    "-t",
                    "20",
                    "stop",
                ]),
                Duration::from_secs(30),
            );
        }
    }
}
