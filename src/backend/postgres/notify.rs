//! The node's one LISTEN connection: notifications of freed keys, seats and jobs wake this
//! node's waiters. After every (re)connect every line's head asks again, since what was
//! sent while the connection was down is lost; the waiters' periodic re-check covers any
//! other loss.
//!
//! The same connection sends this node's notifications, after the commits that freed what
//! they name (`Postgres::announce`): whatever has gathered goes in one statement, so under
//! load many releases share one, and no writing transaction holds the database's
//! notification lock through its commit. A statement that fails loses what it carried,
//! which delays other nodes' waiters to their next re-check, never strands them.

use std::time::Duration;

use tokio::sync::mpsc;
use tokio_postgres::{AsyncMessage, NoTls};

use super::Postgres;
use crate::backend::waiting::Resource;

/// Sends every payload of $2 on channel $1.
const SEND: &str = "SELECT pg_notify($1, p) FROM unnest($2::text[]) AS p";

pub(super) async fn listen(pg: Postgres) {
    let mut stop = pg.inner.stop.subscribe();
    let mut backoff = Duration::from_millis(100);
    loop {
        match connect(&pg).await {
            Ok((client, mut rx)) => {
                backoff = Duration::from_millis(100);
                pg.waiting().wake_all();
                let send = client.prepare(SEND).await;
                if let Err(e) = &send {
                    tracing::debug!(error = %e, "cannot prepare the notification statement");
                }
                while let Ok(send) = &send {
                    tokio::select! {
                        _ = pg.inner.outbox_ready.notified() => {
                            let payloads = pg.take_outbox();
                            if payloads.is_empty() {
                                continue;
                            }
                            if let Err(e) = client.execute(send, &[&pg.channel(), &payloads]).await {
                                tracing::debug!(error = %e, "cannot send notifications");
                                if e.is_closed() {
                                    break;
                                }
                            }
                        }
                        payload = rx.recv() => {
                            let Some(p) = payload else { break };
                            // A commit freed something, perhaps by ending a session: the
                            // watches read the log.
                            pg.inner.ends.notify_one();
                            if p == "*" {
                                pg.waiting().wake_all();
                            } else {
                                match Resource::from_payload(&p) {
                                    Some(r) => pg.waiting().wake(&r),
                                    None => pg.waiting().wake_all(),
                                }
                            }
                        }
                        _ = stop.changed() => return,
                    }
                }
                drop(client);
                tracing::warn!("lost the PostgreSQL notification connection; reconnecting");
            }
            Err(e) => {
                tracing::debug!(error = %e, "cannot open the PostgreSQL notification connection");
            }
        }
        tokio::select! {
            _ = tokio::time::sleep(backoff) => {}
            _ = stop.changed() => return,
        }
        backoff = (backoff * 2).min(Duration::from_secs(5));
    }
}

/// Opens a connection, starts listening, and returns the notification payloads as they
/// come; the channel closes when the connection does.
async fn connect(
    pg: &Postgres,
) -> Result<(tokio_postgres::Client, mpsc::UnboundedReceiver<String>), tokio_postgres::Error> {
    let (client, mut connection) = pg.inner.pg_config.connect(NoTls).await?;
    let (tx, rx) = mpsc::unbounded_channel();
    tokio::spawn(async move {
        loop {
            match std::future::poll_fn(|cx| connection.poll_message(cx)).await {
                Some(Ok(AsyncMessage::Notification(n))) => {
                    if tx.send(n.payload().to_string()).is_err() {
                        return;
                    }
                }
                Some(Ok(_)) => {}
                Some(Err(_)) | None => return,
            }
        }
    });
    client
        .batch_execute(&format!("LISTEN \"{}\"", pg.channel()))
        .await?;
    Ok((client, rx))
}
