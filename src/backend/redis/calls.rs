//! The node's path to Redis: the library of functions that carries every operation (loaded
//! again whenever Redis lacks it), and the calls of concurrent requests sent together.
//!
//! Calls go through one task ([`Batcher`]). A request is sent at once, alone, while no call
//! to Redis is unanswered; while calls are, the requests that arrive meanwhile wait and go
//! together as one `FCALL` of the batch operation (see `REQUESTS`). So a lone request
//! costs one round trip as before, and a busy node pays Redis's per-command
//! cost (the parse, the function call, the reply, the append-only file's wrapping) once per
//! batch rather than once per request. Each operation of a batch still runs whole and alone,
//! in arrival order, and fails alone.

use std::sync::Arc;
use std::sync::LazyLock;

use ::redis::aio::{ConnectionLike, ConnectionManager};
use ::redis::{RedisError, Value};

use crate::backend::batch::{Batcher, Limits};

/// How requests go: the first at once; while calls are unanswered, the requests that arrive
/// meanwhile gather, and a call goes beside the ones unanswered only for a batch worth it.
/// At most 256 operations a call, so a batch holds Redis for a bounded time.
const REQUESTS: Limits = Limits {
    in_flight: 4,
    max_batch: 256,
    extra_from: 16,
};
/// The library of Redis Functions that carries every operation (`leasehold.lua`), named
/// after a digest of its text: nodes of different versions sharing one Redis each load and
/// call their own, never another's.
pub struct Library {
    /// The library's name, which is also its one function's.
    pub name: String,
    /// What `FUNCTION LOAD` is given: the name line, then the text.
    code: String,
}

pub static LIBRARY: LazyLock<Library> = LazyLock::new(|| {
    use sha2::Digest;
    let text = include_str!("leasehold.lua");
    let digest = sha2::Sha256::digest(text.as_bytes());
    let version: String = digest[..8].iter().map(|b| format!("{b:02x}")).collect();
    let name = format!("leasehold_{version}");
    let code = format!("#!lua name={name}\nlocal FUNCTION = '{name}'\n{text}");
    Library { name, code }
});

/// Redis ran nothing: it does not have the function (forgotten, or never loaded there).
fn missing(e: &RedisError) -> bool {
    e.to_string().contains("Function not found")
}

impl Library {
    /// Loads the library (again: `REPLACE`, as another node of this version may have).
    pub async fn load<C: ConnectionLike>(&self, conn: &mut C) -> Result<(), RedisError> {
        ::redis::cmd("FUNCTION")
            .arg("LOAD")
            .arg("REPLACE")
            .arg(&self.code)
            .query_async::<String>(conn)
            .await
            .map(drop)
    }

    /// Sends `fcall`, loading the library first and sending it again when Redis says it
    /// lacks it (`FUNCTION FLUSH`, a restart without persistence, a fail-over to a replica
    /// that never had it): that answer means nothing ran.
    async fn send<C: ConnectionLike>(
        &self,
        conn: &mut C,
        fcall: &::redis::Cmd,
    ) -> Result<Value, RedisError> {
        let first = conn.req_packed_command(fcall).await;
        let lacking = match &first {
            Err(e) => missing(e),
            Ok(Value::ServerError(e)) => missing(&RedisError::from(e.clone())),
            Ok(_) => false,
        };
        if !lacking {
            return first;
        }
        self.load(conn).await?;
        conn.req_packed_command(fcall).await
    }

    /// Runs `op` in `namespace` with `args`, alone, and returns its answer.
    pub async fn call<C: ConnectionLike>(
        &self,
        conn: &mut C,
        namespace: &str,
        op: &str,
        args: &[String],
    ) -> Result<String, RedisError> {
        let mut fcall = ::redis::cmd("FCALL");
        fcall
            .arg(&self.name)
            .arg(0)
            .arg(namespace)
            .arg(op)
            .arg(args);
        text(self.send(conn, &fcall).await?)
    }
}

/// One operation's answer: the text the function returned, or the error it raised.
fn text(v: Value) -> Result<String, RedisError> {
    Ok(::redis::from_redis_value(v.extract_error()?)?)
}

/// One operation waiting to go: its name and arguments.
type Request = (String, Vec<String>);
/// One operation's answer: the text the function returned, or the error it raised.
type Answer = Result<String, RedisError>;

/// Sends operations to Redis, together when many are waiting. Cheap to clone; the task that
/// sends ends when the last clone is dropped.
#[derive(Clone)]
pub struct Calls {
    batcher: Batcher<Request, Answer>,
}

impl Calls {
    pub fn start(conn: ConnectionManager, namespace: String) -> Calls {
        let namespace: Arc<str> = Arc::from(namespace);
        let batcher = Batcher::start(REQUESTS, move |batch: Vec<Request>| {
            let (mut conn, namespace) = (conn.clone(), namespace.clone());
            async move { send(&mut conn, &namespace, batch).await }
        });
        Calls { batcher }
    }

    /// Runs `op` with `args` and returns its answer. An error is Redis's or the
    /// connection's; a request whose answer never came (the node stopping) is answered as a
    /// dropped connection.
    pub async fn call(&self, op: &str, args: Vec<String>) -> Answer {
        let gone = || RedisError::from(std::io::Error::from(std::io::ErrorKind::BrokenPipe));
        self.batcher
            .call((op.to_string(), args))
            .await
            .unwrap_or_else(|| Err(gone()))
    }
}

/// Sends one batch and answers each request, in order. A batch of one is a plain call; a
/// larger one is the function's `!batch` operation: `[namespace, "!batch", n, op, args…, n,
/// op, args…]`, each `n` counting the op and its arguments, answered by one answer (or one
/// error) per operation, in order.
async fn send(conn: &mut ConnectionManager, namespace: &str, batch: Vec<Request>) -> Vec<Answer> {
    if let [(op, args)] = batch.as_slice() {
        return vec![LIBRARY.call(conn, namespace, op, args).await];
    }
    let mut fcall = ::redis::cmd("FCALL");
    fcall.arg(&LIBRARY.name).arg(0).arg(namespace).arg("!batch");
    for (op, args) in &batch {
        fcall.arg(args.len() + 1).arg(op).arg(args);
    }
    match LIBRARY.send(conn, &fcall).await {
        Ok(Value::Array(answers)) if answers.len() == batch.len() => {
            answers.into_iter().map(text).collect()
        }
        Ok(other) => {
            let e = RedisError::from((
                ::redis::ErrorKind::UnexpectedReturnType,
                "a batch answered with the wrong shape",
                format!("{other:?}"),
            ));
            vec![Err(e); batch.len()]
        }
        Err(e) => vec![Err(e); batch.len()],
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The machine's Redis (as the integration tests use it), under a namespace of this test.
    async fn redis() -> (ConnectionManager, String) {
        let url = std::env::var("LEASEHOLD_TEST_REDIS_URL")
            .unwrap_or_else(|_| "redis://127.0.0.1:6379/0".to_string());
        let client = ::redis::Client::open(url).unwrap();
        let conn = ConnectionManager::new(client).await.unwrap();
        let ns = format!("calls-test-{}", uuid::Uuid::new_v4().simple());
        (conn, ns)
    }

    fn request(op: &str, args: &[&str]) -> Request {
        (op.to_string(), args.iter().map(|a| a.to_string()).collect())
    }

    #[tokio::test]
    async fn a_batch_answers_each_operation_in_order_and_fails_one_alone() {
        // Guards against a batch whose answers land on the wrong requests, or whose one bad
        // operation fails the others sent with it.
        let (mut conn, ns) = redis().await;
        let batch = vec![
            request("open", &["s1", "alice", "", "60000"]),
            request("no_such_operation", &[]),
            request("revision", &[]),
            request("open", &["s1", "alice", "", "60000"]),
        ];
        let mut answers = send(&mut conn, &ns, batch).await.into_iter();
        assert_eq!(answers.len(), 4);
        let opened: serde_json::Value =
            serde_json::from_str(&answers.next().unwrap().unwrap()).unwrap();
        assert_eq!(opened["revision"], 1, "{opened}");
        let refused = answers.next().unwrap().unwrap_err().to_string();
        assert!(refused.contains("no_such_operation"), "{refused}");
        assert_eq!(answers.next().unwrap().unwrap(), r#"{"revision":1}"#);
        assert_eq!(answers.next().unwrap().unwrap(), r#"{"err":"exists"}"#);
        let _: () = ::redis::cmd("DEL")
            .arg(format!("{ns}:!rev"))
            .arg(format!("{ns}:!evseq"))
            .arg(format!("{ns}:!events"))
            .arg(format!("{ns}:!s:s1"))
            .arg(format!("{ns}:!deadlines"))
            .arg(format!("{ns}:!sessions"))
            .query_async(&mut conn)
            .await
            .unwrap();
    }

    #[tokio::test]
    async fn a_batch_draws_its_revisions_in_order_and_leaves_the_counter_at_the_last() {
        // Guards against the revisions a batch draws in memory: tokens repeated or out of
        // order inside it, a raised floor lost, or the counter written back below a token
        // granted, so that the next call's token would not be greater than every earlier one.
        let (mut conn, ns) = redis().await;
        let batch = vec![
            request("open", &["a", "o", "", "60000"]),
            request("open", &["b", "o", "", "60000"]),
            request("acquire", &["a", "k1", "1", "100"]),
            request("raise_floor", &["1000"]),
            request("acquire", &["b", "k2", "1", "100"]),
        ];
        let answers: Vec<serde_json::Value> = send(&mut conn, &ns, batch)
            .await
            .into_iter()
            .map(|a| serde_json::from_str(&a.unwrap()).unwrap())
            .collect();
        assert_eq!(answers[0]["revision"], 1, "{answers:?}");
        assert_eq!(answers[1]["revision"], 2, "{answers:?}");
        assert_eq!(answers[2]["granted"], 3, "{answers:?}");
        assert_eq!(answers[3]["revision"], 1001, "{answers:?}");
        assert_eq!(answers[4]["granted"], 1002, "{answers:?}");
        let stored: u64 = ::redis::cmd("GET")
            .arg(format!("{ns}:!rev"))
            .query_async(&mut conn)
            .await
            .unwrap();
        assert_eq!(stored, 1002);
        let lone = send(
            &mut conn,
            &ns,
            vec![request("acquire", &["a", "k3", "1", "100"])],
        )
        .await;
        let lone: serde_json::Value = serde_json::from_str(lone[0].as_ref().unwrap()).unwrap();
        assert_eq!(lone["granted"], 1003, "{lone}");
        let mut keys: Vec<String> = ::redis::cmd("KEYS")
            .arg(format!("{ns}:*"))
            .query_async(&mut conn)
            .await
            .unwrap();
        keys.sort();
        let _: () = ::redis::cmd("DEL")
            .arg(keys)
            .query_async(&mut conn)
            .await
            .unwrap();
    }

    #[tokio::test]
    async fn concurrent_calls_all_get_their_own_answer() {
        // Guards against requests lost or crossed while they wait to go together.
        let (conn, ns) = redis().await;
        let calls = Calls::start(conn.clone(), ns.clone());
        let mut tasks = Vec::new();
        for i in 0..300 {
            let calls = calls.clone();
            tasks.push(tokio::spawn(async move {
                let id = format!("s{i}");
                let text = calls
                    .call(
                        "open",
                        vec![id.clone(), "o".into(), "".into(), "60000".into()],
                    )
                    .await
                    .unwrap();
                let again = calls.call("session", vec![id.clone()]).await.unwrap();
                (id, text, again)
            }));
        }
        let mut revisions = Vec::new();
        for t in tasks {
            let (id, text, again) = t.await.unwrap();
            let opened: serde_json::Value = serde_json::from_str(&text).unwrap();
            revisions.push(opened["revision"].as_u64().unwrap());
            let seen: serde_json::Value = serde_json::from_str(&again).unwrap();
            assert_eq!(seen["session"]["id"], id.as_str(), "{seen}");
        }
        revisions.sort();
        assert_eq!(revisions, (1..=300).collect::<Vec<u64>>());
        let mut keys: Vec<String> = (0..300).map(|i| format!("{ns}:!s:s{i}")).collect();
        for k in ["!rev", "!evseq", "!events", "!deadlines", "!sessions"] {
            keys.push(format!("{ns}:{k}"));
        }
        let mut conn = conn;
        let _: () = ::redis::cmd("DEL")
            .arg(&keys)
            .query_async(&mut conn)
            .await
            .unwrap();
    }
}
