//! The client commands: they talk to a running server over its HTTP API.

use std::future::Future;
use std::process::ExitCode;
use std::time::Duration;

use serde_json::{Value, json};

use super::{JobsAction, LocksAction, PoolsAction, ServerArg, SessionsAction};
use crate::client::{Client, ClientError, Reply, segment};

/// A client for the server named by `--server`, calling with `--token` when one is given
/// and verifying an https:// server with `--ca-file`.
pub(super) fn connect(server: &ServerArg) -> Result<Client, ClientError> {
    Client::new(&server.server)?
        .with_tls(&server.tls.files())?
        .with_token(server.token.clone())
}

pub fn block_on(fut: impl Future<Output = Result<(), ClientError>>) -> ExitCode {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("a current-thread runtime starts");
    match runtime.block_on(fut) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("leasehold: {e}");
            ExitCode::FAILURE
        }
    }
}

/// Writes one line to stdout. A closed pipe (`leasehold events | head`) ends the command
/// quietly, as it does for other Unix tools, instead of panicking.
fn out(line: &str) {
    use std::io::Write;
    let mut stdout = std::io::stdout().lock();
    if writeln!(stdout, "{line}").is_err() {
        std::process::exit(0);
    }
}

/// Prints a reply: pretty JSON on success, the error on stderr (and exit status 1).
pub(super) fn print(reply: Reply) -> Result<(), ClientError> {
    if reply.status.is_success() {
        out(&serde_json::to_string_pretty(&reply.body).unwrap_or(reply.text));
        Ok(())
    } else {
        let code = reply.body["error"].as_str().unwrap_or("error");
        let message = reply.body["message"].as_str().unwrap_or(&reply.text);
        eprintln!("leasehold: {} {code}: {message}", reply.status.as_u16());
        std::process::exit(1);
    }
}

fn query(pairs: &[(&str, &str)]) -> String {
    let mut s = form_urlencoded::Serializer::new(String::new());
    for (k, v) in pairs {
        if !v.is_empty() {
            s.append_pair(k, v);
        }
    }
    s.finish()
}

pub async fn sessions(server: &ServerArg, action: SessionsAction) -> Result<(), ClientError> {
    let client = connect(server)?;
    match action {
        SessionsAction::List { owner, limit } => {
            let limit = limit.to_string();
            let q = query(&[("owner", owner.as_deref().unwrap_or("")), ("limit", &limit)]);
            print(client.get(&format!("/v1/sessions?{q}")).await?)
        }
        SessionsAction::Show { id } => print(
            client
                .get(&format!("/v1/sessions/{}", segment(&id)))
                .await?,
        ),
        SessionsAction::End { id } => print(
            client
                .post(
                    &format!("/v1/admin/sessions/{}/end", segment(&id)),
                    &json!({}),
                )
                .await?,
        ),
    }
}

pub async fn locks(server: &ServerArg, action: LocksAction) -> Result<(), ClientError> {
    let client = connect(server)?;
    match action {
        LocksAction::List { prefix, limit } => {
            let limit = limit.to_string();
            let q = query(&[("prefix", &prefix), ("limit", &limit)]);
            print(client.get(&format!("/v1/locks?{q}")).await?)
        }
        LocksAction::Show { key } => {
            print(client.get(&format!("/v1/locks/{}", segment(&key))).await?)
        }
    }
}

pub async fn pools(server: &ServerArg, action: PoolsAction) -> Result<(), ClientError> {
    let client = connect(server)?;
    match action {
        PoolsAction::List => print(client.get("/v1/pools").await?),
        PoolsAction::Show { pool } => {
            print(client.get(&format!("/v1/pools/{}", segment(&pool))).await?)
        }
        PoolsAction::Put { pool, capacity } => print(
            client
                .call(
                    hyper::Method::PUT,
                    &format!("/v1/pools/{}", segment(&pool)),
                    Some(&json!({ "capacity": capacity })),
                )
                .await?,
        ),
        PoolsAction::Delete { pool } => print(
            client
                .delete(&format!("/v1/pools/{}", segment(&pool)))
                .await?,
        ),
    }
}

pub async fn jobs(server: &ServerArg, action: JobsAction) -> Result<(), ClientError> {
    let client = connect(server)?;
    match action {
        JobsAction::Show { id } => print(client.get(&format!("/v1/jobs/{}", segment(&id))).await?),
        JobsAction::Queue { queue } => print(
            client
                .get(&format!("/v1/queues/{}", segment(&queue)))
                .await?,
        ),
        JobsAction::Failed { queue, limit } => print(
            client
                .get(&format!(
                    "/v1/queues/{}/jobs?state=failed&limit={limit}",
                    segment(&queue)
                ))
                .await?,
        ),
        JobsAction::Requeue { id } => print(
            client
                .post(
                    &format!("/v1/admin/jobs/{}/requeue", segment(&id)),
                    &json!({}),
                )
                .await?,
        ),
    }
}

pub async fn events(
    server: &ServerArg,
    after: u64,
    limit: usize,
    follow: bool,
) -> Result<(), ClientError> {
    let client = connect(server)?;
    let mut after = after;
    loop {
        let reply = client
            .get(&format!("/v1/events?after={after}&limit={limit}"))
            .await?;
        if !reply.status.is_success() {
            return print(reply);
        }
        let events = reply.body["events"].as_array().cloned().unwrap_or_default();
        for e in &events {
            out(&e.to_string());
        }
        after = reply.body["next"].as_u64().unwrap_or(after);
        if !follow {
            return Ok(());
        }
        if events.is_empty() {
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
    }
}

pub async fn reap(server: &ServerArg, dry_run: bool) -> Result<(), ClientError> {
    let client = connect(server)?;
    let body: Value = json!({ "dry_run": dry_run });
    print(client.post("/v1/admin/reap", &body).await?)
}
