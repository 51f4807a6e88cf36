//! The harness the integration tests share: a real server on port 0, in this process, on a
//! fresh data directory, driven by a manual clock.
#![allow(dead_code)]

use std::sync::Arc;

use leasehold::app::App;
use leasehold::backend::embedded::store::Store;
use leasehold::backend::embedded::store::fault::FaultSwitch;
use leasehold::client::{Client, Reply, segment};
use leasehold::clock::{Clock, ManualClock, SystemClock};
use leasehold::config::Config;
use leasehold::domain::UnixMs;
use serde_json::{Value, json};
use tempfile::TempDir;

pub struct TestServer {
    pub app: Option<App>,
    pub client: Client,
    /// The manual clock, when the server runs on one.
    pub clock: Option<ManualClock>,
    pub config: Config,
    pub dir: TempDir,
}

/// A configuration for tests: port 0, a fresh directory, and no background reaper, so that
/// expiry happens only when a test advances the clock and asks for it.
pub fn test_config(dir: &TempDir) -> Config {
    Config {
        listen: "127.0.0.1:0".parse().unwrap(),
        data_dir: dir.path().to_path_buf(),
        reaper_enabled: false,
        cache_size_bytes: 4 * 1024 * 1024,
        ..Config::default()
    }
}

impl TestServer {
    /// A server on a manual clock.
    pub async fn start() -> TestServer {
        TestServer::start_with(|_| {}).await
    }

    pub async fn start_with(tweak: impl FnOnce(&mut Config)) -> TestServer {
        let dir = tempfile::tempdir().unwrap();
        let mut config = test_config(&dir);
        tweak(&mut config);
        let clock = ManualClock::new(UnixMs(1_700_000_000_000));
        let app = App::start(&config, Arc::new(clock.clone())).await.unwrap();
        TestServer::wrap(app, Some(clock), config, dir)
    }

    /// A server on the real clock (for waits measured in real time).
    pub async fn start_real(tweak: impl FnOnce(&mut Config)) -> TestServer {
        let dir = tempfile::tempdir().unwrap();
        let mut config = test_config(&dir);
        tweak(&mut config);
        let app = App::start(&config, Arc::new(SystemClock::new()))
            .await
            .unwrap();
        TestServer::wrap(app, None, config, dir)
    }

    /// A server whose storage writes can be made to fail.
    pub async fn start_faulty() -> (TestServer, FaultSwitch) {
        let dir = tempfile::tempdir().unwrap();
        let config = test_config(&dir);
        let (store, switch) =
            Store::open_with_faults(&config.data_dir, config.cache_size_bytes).unwrap();
        let clock = ManualClock::new(UnixMs(1_700_000_000_000));
        let app = App::start_with_store(&config, Arc::new(clock.clone()), store)
            .await
            .unwrap();
        (TestServer::wrap(app, Some(clock), config, dir), switch)
    }

    fn wrap(app: App, clock: Option<ManualClock>, config: Config, dir: TempDir) -> TestServer {
        let client = Client::new(&app.url()).unwrap();
        TestServer {
            app: Some(app),
            client,
            clock,
            config,
            dir,
        }
    }

    pub fn url(&self) -> String {
        self.app.as_ref().unwrap().url()
    }

    pub fn clock(&self) -> &ManualClock {
        self.clock
            .as_ref()
            .expect("this server runs on a manual clock")
    }

    pub fn advance(&self, ms: u64) {
        self.clock().advance(ms);
    }

    /// Stops the server and starts it again on the same data directory (and clock).
    pub async fn restart(&mut self) {
        self.app.take().unwrap().shutdown().await;
        let clock: Arc<dyn Clock> = match &self.clock {
            Some(c) => Arc::new(c.clone()),
            None => Arc::new(SystemClock::new()),
        };
        let app = App::start(&self.config, clock).await.unwrap();
        self.client = Client::new(&app.url()).unwrap();
        self.app = Some(app);
    }

    pub async fn stop(mut self) {
        if let Some(app) = self.app.take() {
            app.shutdown().await;
        }
    }

    pub async fn get(&self, path: &str) -> Reply {
        self.client.get(path).await.unwrap()
    }

    pub async fn post(&self, path: &str, body: Value) -> Reply {
        self.client.post(path, &body).await.unwrap()
    }

    pub async fn delete(&self, path: &str) -> Reply {
        self.client.delete(path).await.unwrap()
    }

    /// Opens a session and returns its id.
    pub async fn open(&self, owner: &str, ttl_ms: u64) -> String {
        let r = self
            .post("/v1/sessions", json!({"owner": owner, "ttl_ms": ttl_ms}))
            .await;
        assert_eq!(r.status, 201, "{}", r.text);
        r.body["session_id"].as_str().unwrap().to_string()
    }

    pub async fn acquire(&self, key: &str, session: &str) -> Reply {
        self.post(
            &format!("/v1/locks/{}/acquire", segment(key)),
            json!({"session_id": session}),
        )
        .await
    }

    pub async fn release(&self, key: &str, session: &str, token: u64) -> Reply {
        self.post(
            &format!("/v1/locks/{}/release", segment(key)),
            json!({"session_id": session, "token": token}),
        )
        .await
    }

    pub async fn heartbeat(&self, session: &str) -> Reply {
        self.post(&format!("/v1/sessions/{session}/heartbeat"), json!({}))
            .await
    }

    pub async fn reap(&self) -> Reply {
        self.post("/v1/admin/reap", json!({"dry_run": false})).await
    }
}

// Helpers the HTTP suites share.

pub fn assert_error(r: &Reply, status: u16, code: &str) {
    assert_eq!(r.status, status, "{}", r.text);
    assert_eq!(r.body["error"], code, "{}", r.text);
    assert!(
        r.body["message"].as_str().is_some_and(|m| !m.is_empty()),
        "an error carries a message: {}",
        r.text
    );
}

/// A 400 `invalid_request` whose `field` names `field`.
pub fn assert_invalid(r: &Reply, field: &str) {
    assert_error(r, 400, "invalid_request");
    assert_eq!(r.body["field"], field, "{}", r.text);
}

/// Every audit event, read page by page.
pub async fn all_events(s: &TestServer) -> Vec<Value> {
    let mut out = Vec::new();
    let mut after = 0;
    loop {
        let r = s.get(&format!("/v1/events?after={after}&limit=1000")).await;
        assert_eq!(r.status, 200, "{}", r.text);
        let page = r.body["events"].as_array().unwrap().clone();
        if page.is_empty() {
            return out;
        }
        after = r.body["next"].as_u64().unwrap();
        out.extend(page);
    }
}

pub fn of_kind<'a>(events: &'a [Value], kind: &str) -> Vec<&'a Value> {
    events.iter().filter(|e| e["kind"] == kind).collect()
}

pub async fn session(s: &TestServer, id: &str) -> Reply {
    s.get(&format!("/v1/sessions/{id}")).await
}

pub fn random_id() -> String {
    uuid::Uuid::new_v4().to_string()
}
