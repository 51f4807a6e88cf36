//! A job guarded by a lock, with the Rust client: open a session, take the lock (waiting up
//! to 30 s), do the work in steps while the lock is held, and stop at once if the lease is
//! lost. Every write to the guarded resource carries the fencing token.
//!
//! ```sh
//! leasehold serve &
//! cargo run --example guarded_job -- http://127.0.0.1:7878 reports/nightly
//! ```

use std::time::Duration;

use leasehold::client::{Client, Error, Session};

#[tokio::main(flavor = "current_thread")]
async fn main() -> Result<(), Error> {
    let mut args = std::env::args().skip(1);
    let server = args
        .next()
        .unwrap_or_else(|| "http://127.0.0.1:7878".into());
    let key = args.next().unwrap_or_else(|| "reports/nightly".into());
    let token = std::env::var("LEASEHOLD_API_TOKEN").ok();

    let client = Client::new(&server)?.with_token(token)?;
    let session = Session::builder(client, "guarded-job example")
        .ttl(Duration::from_secs(15))
        .open()
        .await?;
    let lock = match session.lock_wait(&key, Duration::from_secs(30)).await {
        Ok(lock) => lock,
        Err(e) if e.code() == Some("lock_held") => {
            eprintln!("{key} is held elsewhere; nothing to do");
            session.close().await?;
            return Ok(());
        }
        Err(e) => return Err(e),
    };
    println!("holding {key} with fencing token {}", lock.token());

    let lost = session.loss_signal();
    let work = async {
        for step in 1..=5 {
            // Right before each write: still safe? (The signal below also interrupts a step
            // that is waiting.)
            session.check()?;
            println!("step {step}: write with token {}", lock.token());
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
        Ok::<(), Error>(())
    };
    tokio::select! {
        done = work => done?,
        loss = lost.lost() => {
            eprintln!("stopped: {loss}");
            return Err(Error::Lost(loss));
        }
    }
    lock.release().await?;
    session.close().await
}
