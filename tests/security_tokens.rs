//! API tokens: every role against every endpoint (allowed, 401, 403), a session of another
//! token answering 404, prefix scopes, per-token rate and waiter limits, reloading the
//! tokens file (in process and on SIGHUP) with revocation taking effect without a restart,
//! the loopback-only rule without tokens, and the `tokens` and client commands.
//!
//! Embedded backend only: the rules sit above the backend seam, in the API layer, and the
//! session binding lives in the session id, which every backend stores as it is given.
mod common;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use common::*;
use leasehold::auth::{self, Role, TokenEntry, TokensFile};
use leasehold::client::{Client, Reply, segment};
use serde_json::{Value, json};

struct Tok {
    name: &'static str,
    role: Role,
    keys: Option<Vec<String>>,
    pools: Option<Vec<String>>,
    queues: Option<Vec<String>>,
}

fn tok(name: &'static str, role: Role) -> Tok {
    Tok {
        name,
        role,
        keys: None,
        pools: None,
        queues: None,
    }
}

/// Writes a tokens file with `tokens`; returns the secrets by name.
fn write_tokens(path: &Path, tokens: &[Tok]) -> Vec<(&'static str, String)> {
    let mut file = TokensFile::default();
    let mut secrets = Vec::new();
    for t in tokens {
        let secret = auth::new_secret();
        file.token.push(TokenEntry {
            name: t.name.into(),
            role: t.role,
            hash: auth::hash_text(&auth::hash(&secret)),
            keys: t.keys.clone(),
            pools: t.pools.clone(),
            queues: t.queues.clone(),
            cert_subject: None,
            created_at: 0,
        });
        secrets.push((t.name, secret));
    }
    file.write(path).unwrap();
    secrets
}

fn secret<'a>(secrets: &'a [(&'static str, String)], name: &str) -> &'a str {
    &secrets.iter().find(|(n, _)| *n == name).unwrap().1
}

struct Secured {
    s: TestServer,
    path: PathBuf,
    secrets: Vec<(&'static str, String)>,
}

impl Secured {
    async fn start(tokens: &[Tok], tweak: impl FnOnce(&mut leasehold::config::Config)) -> Secured {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.keep().join("tokens.toml");
        let secrets = write_tokens(&path, tokens);
        let p = path.clone();
        let s = TestServer::start_with(move |c| {
            c.tokens_file = Some(p);
            tweak(c);
        })
        .await;
        Secured { s, path, secrets }
    }

    fn as_(&self, name: &str) -> Client {
        Client::new(&self.s.url())
            .unwrap()
            .with_token(Some(secret(&self.secrets, name).to_string()))
            .unwrap()
    }

    fn anonymous(&self) -> Client {
        Client::new(&self.s.url()).unwrap()
    }
}

async fn call(c: &Client, method: &str, path: &str, body: Option<Value>) -> Reply {
    let m = hyper::Method::from_bytes(method.as_bytes()).unwrap();
    c.call(m, path, body.as_ref()).await.unwrap()
}

async fn open(c: &Client, owner: &str) -> String {
    let r = c
        .post("/v1/sessions", &json!({"owner": owner, "ttl_ms": 60_000}))
        .await
        .unwrap();
    assert_eq!(r.status, 201, "{}", r.text);
    r.body["session_id"].as_str().unwrap().to_string()
}

const ROLES: [(&str, Role); 4] = [
    ("reader", Role::Reader),
    ("client", Role::Client),
    ("operator", Role::Operator),
    ("admin", Role::Admin),
];

fn all_roles() -> Vec<Tok> {
    ROLES.iter().map(|(n, r)| tok(n, *r)).collect()
}

#[tokio::test]
async fn every_role_against_every_endpoint() {
    let sec = Secured::start(&all_roles(), |_| {}).await;
    let admin = sec.as_("admin");
    // Fixtures made by the admin: a pool and a job.
    assert_eq!(
        call(&admin, "PUT", "/v1/pools/p", Some(json!({"capacity": 100})))
            .await
            .status,
        201
    );
    let job = call(
        &admin,
        "POST",
        "/v1/queues/q/jobs",
        Some(json!({"payload": {}})),
    )
    .await;
    assert_eq!(job.status, 201, "{}", job.text);
    let job = job.body["job_id"].as_str().unwrap().to_string();

    for (name, role) in ROLES {
        let c = sec.as_(name);
        // A session of this token's own where it may open one; a reader uses the admin's.
        let sid = if role >= Role::Client {
            open(&c, name).await
        } else {
            open(&admin, "for-reader").await
        };
        let key = format!("k-{name}");
        let pool = format!("p-{name}");
        let s = json!({"session_id": sid});
        let endpoints: Vec<(&str, String, Option<Value>, Role)> = vec![
            ("GET", "/metrics".into(), None, Role::Reader),
            ("GET", "/v1/sessions".into(), None, Role::Reader),
            ("GET", format!("/v1/sessions/{sid}"), None, Role::Reader),
            (
                "POST",
                "/v1/sessions".into(),
                Some(json!({"owner": "x"})),
                Role::Client,
            ),
            (
                "POST",
                format!("/v1/sessions/{sid}/heartbeat"),
                Some(json!({})),
                Role::Client,
            ),
            (
                "POST",
                format!("/v1/locks/{key}/acquire"),
                Some(s.clone()),
                Role::Client,
            ),
            ("GET", "/v1/locks".into(), None, Role::Reader),
            ("GET", format!("/v1/locks/{key}"), None, Role::Reader),
            (
                "GET",
                format!("/v1/fence/{key}?token=1"),
                None,
                Role::Reader,
            ),
            (
                "POST",
                format!("/v1/locks/{key}/release"),
                Some(json!({"session_id": sid, "token": 1})),
                Role::Client,
            ),
            (
                "PUT",
                format!("/v1/pools/{pool}"),
                Some(json!({"capacity": 1})),
                Role::Operator,
            ),
            ("GET", "/v1/pools".into(), None, Role::Reader),
            ("GET", "/v1/pools/p".into(), None, Role::Reader),
            (
                "POST",
                "/v1/pools/p/acquire".into(),
                Some(s.clone()),
                Role::Client,
            ),
            (
                "POST",
                "/v1/pools/p/release".into(),
                Some(json!({"session_id": sid, "seat_token": 1})),
                Role::Client,
            ),
            ("DELETE", format!("/v1/pools/{pool}"), None, Role::Operator),
            (
                "POST",
                "/v1/queues/q/jobs".into(),
                Some(json!({"payload": 1})),
                Role::Client,
            ),
            ("GET", "/v1/queues/q".into(), None, Role::Reader),
            ("GET", "/v1/queues/q/jobs".into(), None, Role::Reader),
            (
                "POST",
                "/v1/queues/q/claim".into(),
                Some(s.clone()),
                Role::Client,
            ),
            ("GET", format!("/v1/jobs/{job}"), None, Role::Reader),
            (
                "POST",
                format!("/v1/jobs/{job}/release"),
                Some(json!({"session_id": sid, "token": 1})),
                Role::Client,
            ),
            ("GET", "/v1/events".into(), None, Role::Reader),
            (
                "POST",
                "/v1/admin/reap".into(),
                Some(json!({"dry_run": true})),
                Role::Operator,
            ),
            (
                "POST",
                format!("/v1/admin/jobs/{job}/requeue"),
                None,
                Role::Operator,
            ),
            (
                "POST",
                format!("/v1/admin/sessions/{sid}/end"),
                None,
                Role::Operator,
            ),
            ("DELETE", format!("/v1/sessions/{sid}"), None, Role::Client),
        ];
        for (method, path, body, needs) in endpoints {
            // Without a token, and with a wrong one: 401 everywhere.
            let r = call(&sec.anonymous(), method, &path, body.clone()).await;
            assert_error(&r, 401, "unauthorized");
            let wrong = sec
                .anonymous()
                .with_token(Some(auth::new_secret()))
                .unwrap();
            assert_error(
                &call(&wrong, method, &path, body.clone()).await,
                401,
                "unauthorized",
            );
            let r = call(&c, method, &path, body).await;
            if role >= needs {
                assert!(
                    r.status != 401 && r.status != 403,
                    "{name} {method} {path}: {} {}",
                    r.status,
                    r.text
                );
            } else {
                assert_error(&r, 403, "forbidden");
            }
        }
    }
    // The probes need no token.
    assert_eq!(sec.anonymous().get("/healthz").await.unwrap().status, 200);
    assert_eq!(sec.anonymous().get("/readyz").await.unwrap().status, 200);
    sec.s.stop().await;
}

#[tokio::test]
async fn another_tokens_session_is_404_never_403() {
    let mut tokens = all_roles();
    tokens.push(tok("client2", Role::Client));
    let sec = Secured::start(&tokens, |_| {}).await;
    let (a, b) = (sec.as_("client"), sec.as_("client2"));
    let sid = open(&a, "a").await;
    assert_eq!(
        call(
            &a,
            "POST",
            "/v1/locks/k/acquire",
            Some(json!({"session_id": sid}))
        )
        .await
        .status,
        200
    );
    let unknown = random_id();
    for id in [&sid, &unknown] {
        let tries = [
            call(&b, "GET", &format!("/v1/sessions/{id}"), None).await,
            call(
                &b,
                "POST",
                &format!("/v1/sessions/{id}/heartbeat"),
                Some(json!({})),
            )
            .await,
            call(&b, "DELETE", &format!("/v1/sessions/{id}"), None).await,
            call(
                &b,
                "POST",
                "/v1/locks/k2/acquire",
                Some(json!({"session_id": id})),
            )
            .await,
            call(
                &b,
                "POST",
                "/v1/locks/k/release",
                Some(json!({"session_id": id, "token": 1})),
            )
            .await,
            call(
                &b,
                "POST",
                "/v1/queues/q/claim",
                Some(json!({"session_id": id})),
            )
            .await,
            // An operator acting through someone else's session is told the same.
            call(
                &sec.as_("operator"),
                "POST",
                &format!("/v1/sessions/{id}/heartbeat"),
                Some(json!({})),
            )
            .await,
        ];
        for r in tries {
            assert_error(&r, 404, "session_gone");
        }
    }
    // The session is untouched, its owner still acts through it, and readers may see it.
    assert_eq!(
        call(
            &a,
            "POST",
            &format!("/v1/sessions/{sid}/heartbeat"),
            Some(json!({}))
        )
        .await
        .status,
        200
    );
    let seen = call(
        &sec.as_("reader"),
        "GET",
        &format!("/v1/sessions/{sid}"),
        None,
    )
    .await;
    assert_eq!(seen.status, 200, "{}", seen.text);
    assert_eq!(seen.body["locks"][0]["key"], "k");
    // Force-ending any session is the operator's.
    let r = call(
        &sec.as_("operator"),
        "POST",
        &format!("/v1/admin/sessions/{sid}/end"),
        None,
    )
    .await;
    assert_eq!(r.status, 200, "{}", r.text);
    assert_eq!(r.body["released"], 1);
    sec.s.stop().await;
}

#[tokio::test]
async fn prefix_scopes_keep_one_team_off_anothers_locks_pools_and_queues() {
    let team_a = Tok {
        name: "team-a",
        role: Role::Operator,
        keys: Some(vec!["team-a/".into()]),
        pools: Some(vec!["team-a-".into()]),
        queues: Some(vec!["team-a.".into()]),
    };
    let sec = Secured::start(&[team_a, tok("admin", Role::Admin)], |_| {}).await;
    let a = sec.as_("team-a");
    let admin = sec.as_("admin");
    let sid = open(&a, "a").await;
    let s = json!({"session_id": sid});
    let ok = |r: &Reply| assert!(r.status.is_success(), "{} {}", r.status, r.text);
    ok(&call(
        &a,
        "POST",
        &format!("/v1/locks/{}/acquire", segment("team-a/db")),
        Some(s.clone()),
    )
    .await);
    let r = call(
        &a,
        "POST",
        &format!("/v1/locks/{}/acquire", segment("team-b/db")),
        Some(s.clone()),
    )
    .await;
    assert_error(&r, 403, "forbidden");
    assert_eq!(r.body["field"], "key");
    assert_error(
        &call(
            &a,
            "GET",
            &format!("/v1/locks/{}", segment("team-b/db")),
            None,
        )
        .await,
        403,
        "forbidden",
    );
    assert_error(
        &call(&a, "GET", "/v1/fence/team-b%2Fdb?token=1", None).await,
        403,
        "forbidden",
    );
    // Listing: under an allowed prefix only.
    ok(&call(&a, "GET", "/v1/locks?prefix=team-a/", None).await);
    let r = call(&a, "GET", "/v1/locks?prefix=team-", None).await;
    assert_error(&r, 403, "forbidden");
    assert_eq!(r.body["field"], "prefix");
    assert_error(&call(&a, "GET", "/v1/locks", None).await, 403, "forbidden");
    // Pools: its own may be made and used; another's not, and the list shows its own only.
    ok(&call(
        &a,
        "PUT",
        "/v1/pools/team-a-cad",
        Some(json!({"capacity": 2})),
    )
    .await);
    ok(&call(
        &admin,
        "PUT",
        "/v1/pools/team-b-cad",
        Some(json!({"capacity": 2})),
    )
    .await);
    let r = call(
        &a,
        "PUT",
        "/v1/pools/team-b-cad",
        Some(json!({"capacity": 9})),
    )
    .await;
    assert_error(&r, 403, "forbidden");
    assert_eq!(r.body["field"], "pool");
    assert_error(
        &call(&a, "POST", "/v1/pools/team-b-cad/acquire", Some(s.clone())).await,
        403,
        "forbidden",
    );
    assert_error(
        &call(&a, "DELETE", "/v1/pools/team-b-cad", None).await,
        403,
        "forbidden",
    );
    let listed = call(&a, "GET", "/v1/pools", None).await;
    assert_eq!(
        listed.body["pools"].as_array().unwrap().len(),
        1,
        "{}",
        listed.text
    );
    assert_eq!(listed.body["pools"][0]["pool"], "team-a-cad");
    // Queues, and a job of another team's queue reads as absent.
    ok(&call(
        &a,
        "POST",
        "/v1/queues/team-a.build/jobs",
        Some(json!({"payload": 1})),
    )
    .await);
    let r = call(
        &a,
        "POST",
        "/v1/queues/team-b.build/jobs",
        Some(json!({"payload": 1})),
    )
    .await;
    assert_error(&r, 403, "forbidden");
    assert_eq!(r.body["field"], "queue");
    let theirs = call(
        &admin,
        "POST",
        "/v1/queues/team-b.build/jobs",
        Some(json!({"payload": 1})),
    )
    .await;
    let theirs = theirs.body["job_id"].as_str().unwrap().to_string();
    assert_error(
        &call(&a, "GET", &format!("/v1/jobs/{theirs}"), None).await,
        404,
        "job_not_found",
    );
    assert_error(
        &call(
            &a,
            "POST",
            &format!("/v1/admin/jobs/{theirs}/requeue"),
            None,
        )
        .await,
        404,
        "job_not_found",
    );
    // What spans every scope needs an unscoped token.
    assert_error(&call(&a, "GET", "/v1/events", None).await, 403, "forbidden");
    assert_error(
        &call(&a, "POST", "/v1/admin/reap", Some(json!({}))).await,
        403,
        "forbidden",
    );
    // The other team's pool is as the admin left it.
    let p = call(&admin, "GET", "/v1/pools/team-b-cad", None).await;
    assert_eq!(p.body["capacity"], 2);
    sec.s.stop().await;
}

#[tokio::test]
async fn a_token_over_its_rate_gets_429_with_retry_after() {
    let sec = Secured::start(&[tok("r", Role::Reader), tok("other", Role::Reader)], |c| {
        c.rate_limit_per_s = 0.001;
        c.rate_limit_burst = 3;
    })
    .await;
    let r = sec.as_("r");
    for _ in 0..3 {
        assert_eq!(r.get("/v1/pools").await.unwrap().status, 200);
    }
    let refused = r.get("/v1/pools").await.unwrap();
    assert_error(&refused, 429, "rate_limited");
    // The header, read on a raw request.
    let http = hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
        .build_http::<http_body_util::Full<hyper::body::Bytes>>();
    let req = hyper::Request::builder()
        .uri(format!("{}/v1/pools", sec.s.url()))
        .header(
            "authorization",
            format!("Bearer {}", secret(&sec.secrets, "r")),
        )
        .body(http_body_util::Full::new(hyper::body::Bytes::new()))
        .unwrap();
    let resp = http.request(req).await.unwrap();
    assert_eq!(resp.status(), 429);
    let retry: u64 = resp.headers()["retry-after"]
        .to_str()
        .unwrap()
        .parse()
        .unwrap();
    assert!(retry >= 1);
    // Another token, and the probes, are not held back.
    assert_eq!(sec.as_("other").get("/v1/pools").await.unwrap().status, 200);
    assert_eq!(sec.anonymous().get("/healthz").await.unwrap().status, 200);
    sec.s.stop().await;
}

#[tokio::test]
async fn a_tokens_waiters_are_bounded() {
    let sec = Secured::start(&[tok("c", Role::Client), tok("d", Role::Client)], |c| {
        c.max_waiters_per_token = 2;
        // The harness counts waiters from /metrics, without a token.
        c.metrics_open = true;
    })
    .await;
    let (c, d) = (sec.as_("c"), sec.as_("d"));
    let holder = open(&d, "holder").await;
    for k in ["a", "b", "x"] {
        let r = call(
            &d,
            "POST",
            &format!("/v1/locks/{k}/acquire"),
            Some(json!({"session_id": holder})),
        )
        .await;
        assert_eq!(r.status, 200);
    }
    let mut waits = Vec::new();
    for k in ["a", "b"] {
        let id = open(&c, k).await;
        let c = c.clone();
        waits.push(tokio::spawn(async move {
            acquire_wait(&c, k, &id, 30_000).await
        }));
    }
    until_waiters(&sec.s, 2).await;
    let id = open(&c, "third").await;
    let r = acquire_wait(&c, "x", &id, 30_000).await;
    assert_error(&r, 429, "too_many_waiters");
    // Another token may still wait.
    let other = open(&d, "other").await;
    let h = {
        let d = d.clone();
        tokio::spawn(async move { acquire_wait(&d, "x", &other, 30_000).await })
    };
    until_waiters(&sec.s, 3).await;
    drop(h);
    drop(waits);
    sec.s.stop().await;
}

#[tokio::test]
async fn reload_adds_and_revokes_tokens_without_a_restart() {
    let sec = Secured::start(&[tok("old", Role::Reader)], |_| {}).await;
    let old = sec.as_("old");
    assert_eq!(old.get("/v1/pools").await.unwrap().status, 200);
    // A new file: `old` is gone, `new` is in. Nothing changes until the reload.
    let secrets = write_tokens(&sec.path, &[tok("new", Role::Reader)]);
    let new = sec
        .anonymous()
        .with_token(Some(secret(&secrets, "new").to_string()))
        .unwrap();
    assert_eq!(new.get("/v1/pools").await.unwrap().status, 401);
    assert_eq!(old.get("/v1/pools").await.unwrap().status, 200);
    sec.s.app.as_ref().unwrap().reload().unwrap();
    assert_eq!(new.get("/v1/pools").await.unwrap().status, 200);
    assert_error(&old.get("/v1/pools").await.unwrap(), 401, "unauthorized");
    // A broken file is refused and the tokens in force stay.
    std::fs::write(&sec.path, "[[token]]\nname = 1\n").unwrap();
    assert!(sec.s.app.as_ref().unwrap().reload().is_err());
    assert_eq!(new.get("/v1/pools").await.unwrap().status, 200);
    sec.s.stop().await;
}

#[test]
fn without_tokens_only_loopback_is_served() {
    let mut c = leasehold::config::Config {
        listen: "0.0.0.0:7878".parse().unwrap(),
        ..Default::default()
    };
    let err = c.validate().unwrap_err().to_string();
    assert!(
        err.contains("not a loopback address") && err.contains("tokens_file"),
        "{err}"
    );
    c.listen = "[::]:7878".parse().unwrap();
    assert!(c.validate().is_err());
    c.listen = "[::1]:7878".parse().unwrap();
    c.validate().unwrap();
    c.listen = "0.0.0.0:7878".parse().unwrap();
    c.tokens_file = Some("/etc/leasehold/tokens.toml".into());
    c.validate().unwrap();
}

// ---------------------------------------------------------------------------------------------
// The binary: serve's refusal, SIGHUP, and the tokens and client commands
// ---------------------------------------------------------------------------------------------

fn leasehold(args: &[&str], env: &[(&str, &str)]) -> (i32, String, String) {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_leasehold"));
    cmd.args(args)
        .env_remove("LEASEHOLD_SERVER")
        .env_remove("LEASEHOLD_API_TOKEN");
    for (k, v) in env {
        cmd.env(k, v);
    }
    let out = cmd.output().expect("the binary runs");
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[test]
fn serve_refuses_a_non_loopback_address_without_tokens() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    let (code, _, err) = leasehold(
        &[
            "serve",
            "--listen",
            "0.0.0.0:0",
            "--data-dir",
            data.to_str().unwrap(),
        ],
        &[],
    );
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("not a loopback address"), "{err}");
}

/// A free loopback port.
fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tokens_commands_and_sighup_on_a_running_server() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("tokens.toml");
    let f = file.to_str().unwrap().to_string();
    let run = |args: Vec<String>, env: Vec<(String, String)>| {
        tokio::task::spawn_blocking(move || {
            let args: Vec<&str> = args.iter().map(String::as_str).collect();
            let env: Vec<(&str, &str)> =
                env.iter().map(|(a, b)| (a.as_str(), b.as_str())).collect();
            leasehold(&args, &env)
        })
    };
    let v = |parts: &[&str]| parts.iter().map(|p| p.to_string()).collect::<Vec<_>>();
    let (code, ops, err) = run(
        v(&[
            "tokens", "--file", &f, "create", "ops", "--role", "operator",
        ]),
        vec![],
    )
    .await
    .unwrap();
    assert_eq!(code, 0, "{err}");
    let ops = ops.trim().to_string();
    assert!(ops.starts_with("lh_") && ops.len() == 67, "{ops}");
    // The file holds the hash, never the secret.
    let text = std::fs::read_to_string(&file).unwrap();
    assert!(!text.contains(&ops) && text.contains("sha256:"), "{text}");
    let (code, _, err) = run(
        v(&["tokens", "--file", &f, "create", "ops", "--role", "reader"]),
        vec![],
    )
    .await
    .unwrap();
    assert_eq!(code, 1);
    assert!(err.contains("exists"), "{err}");

    let port = free_port();
    let server = format!("http://127.0.0.1:{port}");
    let data = dir.path().join("data");
    let mut child = Command::new(env!("CARGO_BIN_EXE_leasehold"))
        .args([
            "serve",
            "--listen",
            &format!("127.0.0.1:{port}"),
            "--data-dir",
            data.to_str().unwrap(),
            "--tokens-file",
            &f,
        ])
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let probe = Client::new(&server).unwrap();
    let mut up = false;
    for _ in 0..200 {
        if probe.get("/healthz").await.is_ok() {
            up = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(up, "the server did not come up");

    // Client commands: without a token 401, with --token or LEASEHOLD_API_TOKEN they work.
    let (code, _, err) = run(v(&["pools", "list", "--server", &server]), vec![])
        .await
        .unwrap();
    assert_eq!(code, 1);
    assert!(err.contains("401 unauthorized"), "{err}");
    let (code, out, err) = run(
        v(&["pools", "list", "--server", &server, "--token", &ops]),
        vec![],
    )
    .await
    .unwrap();
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("\"pools\""), "{out}");
    let (code, _, err) = run(
        v(&[
            "pools",
            "put",
            "cad",
            "--capacity",
            "2",
            "--server",
            &server,
        ]),
        vec![("LEASEHOLD_API_TOKEN".into(), ops.clone())],
    )
    .await
    .unwrap();
    assert_eq!(code, 0, "{err}");

    // A new reader token works after SIGHUP; revoking ops takes effect after the next.
    let (code, reader, _) = run(
        v(&["tokens", "--file", &f, "create", "dash", "--role", "reader"]),
        vec![],
    )
    .await
    .unwrap();
    assert_eq!(code, 0);
    let reader = reader.trim().to_string();
    let as_reader = Client::new(&server)
        .unwrap()
        .with_token(Some(reader.clone()))
        .unwrap();
    assert_eq!(as_reader.get("/v1/pools").await.unwrap().status, 401);
    let hup = || {
        let st = Command::new("kill")
            .args(["-HUP", &child.id().to_string()])
            .status()
            .unwrap();
        assert!(st.success());
    };
    hup();
    let mut loaded = false;
    for _ in 0..200 {
        if as_reader.get("/v1/pools").await.unwrap().status == 200 {
            loaded = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    assert!(loaded, "SIGHUP did not load the new token");
    let (code, out, _) = run(v(&["tokens", "--file", &f, "list"]), vec![])
        .await
        .unwrap();
    assert_eq!(code, 0);
    assert!(
        out.contains("\"dash\"") && out.contains("\"operator\"") && !out.contains("lh_"),
        "{out}"
    );
    let (code, _, _) = run(v(&["tokens", "--file", &f, "revoke", "ops"]), vec![])
        .await
        .unwrap();
    assert_eq!(code, 0);
    let as_ops = Client::new(&server)
        .unwrap()
        .with_token(Some(ops.clone()))
        .unwrap();
    hup();
    let mut revoked = false;
    for _ in 0..200 {
        if as_ops.get("/v1/pools").await.unwrap().status == 401 {
            revoked = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    assert!(revoked, "SIGHUP did not revoke the token");
    // Still the same process, still serving the others.
    assert!(
        child.try_wait().unwrap().is_none(),
        "the server exited on SIGHUP"
    );
    assert_eq!(as_reader.get("/v1/pools/cad").await.unwrap().status, 200);
    let _ = Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status();
    let _ = child.wait();
}

/// Request ids are scoped per token: the same id sent by two tokens names two calls, so
/// neither can read the other's answer (a job id it was never meant to learn) nor block the
/// other's call as a "reuse".
#[tokio::test]
async fn request_ids_of_two_tokens_never_collide() {
    let sec = Secured::start(
        &[tok("client", Role::Client), tok("client2", Role::Client)],
        |_| {},
    )
    .await;
    let (a, b) = (sec.as_("client"), sec.as_("client2"));
    let enq = |c: Client, payload: Value| async move {
        call(
            &c,
            "POST",
            "/v1/queues/q/jobs",
            Some(json!({"payload": payload, "request_id": "same-id"})),
        )
        .await
    };
    let first = enq(a.clone(), json!(1)).await;
    assert_eq!(first.status, 201, "{}", first.text);
    // Another token, the same id and body: its own call, its own job.
    let other = enq(b.clone(), json!(1)).await;
    assert_eq!(other.status, 201, "{}", other.text);
    assert_ne!(other.body["job_id"], first.body["job_id"]);
    // Another token, the same id, another body: not a reuse of the first token's id.
    let b2 = enq(b.clone(), json!(2)).await;
    assert_eq!(b2.status, 409, "{}", b2.text);
    assert_eq!(b2.body["error"], "request_id_reused");
    // Each token's retry gets its own first answer.
    assert_eq!(enq(a, json!(1)).await.body, first.body);
    assert_eq!(enq(b, json!(1)).await.body, other.body);
}

#[tokio::test]
async fn a_client_token_watches_only_its_own_sessions_within_its_cap() {
    let tokens = [
        tok("a", Role::Client),
        tok("b", Role::Client),
        tok("reader", Role::Reader),
    ];
    let sec = Secured::start(&tokens, |c| c.max_watches_per_token = 1).await;
    let a = sec.as_("a");
    let sid = open(&a, "alice").await;
    let path = format!("/v1/sessions/{sid}/watch");
    // Another client's token is told the session is gone, as for one that never existed.
    assert_error(
        &call(&sec.as_("b"), "GET", &path, None).await,
        404,
        "session_gone",
    );
    let unknown = format!("/v1/sessions/{}/watch", random_id());
    assert_error(
        &call(&sec.as_("b"), "GET", &unknown, None).await,
        404,
        "session_gone",
    );
    assert_error(
        &call(&sec.anonymous(), "GET", &path, None).await,
        401,
        "unauthorized",
    );
    // Its owner and a reader may watch it.
    for who in ["a", "reader"] {
        let mut w = sec
            .as_(who)
            .watch(&sid)
            .await
            .unwrap()
            .expect("the watch opens");
        let first = tokio::time::timeout(Duration::from_secs(20), w.next())
            .await
            .unwrap()
            .unwrap()
            .unwrap();
        assert_eq!(first.event, "snapshot", "{who}");
        if who == "a" {
            // One watch per token here: a second is 429 with Retry-After.
            let second = sec.as_("a").watch(&sid).await.unwrap();
            let r = second
                .err()
                .expect("a second watch of the token is refused");
            assert_error(&r, 429, "too_many_watches");
        }
    }
    sec.s.stop().await;
}
