//! Producing jobs: [`Client::enqueue`], retried safely under one `request_id`.

use serde_json::{Value, json};

use super::http::{Client, segment};
use super::session::{Backoff, Error, post_retried, request_id};

/// A job to enqueue: its payload and the options the server defaults when left `None`.
#[derive(Debug, Clone, Default)]
pub struct NewJob {
    pub payload: Value,
    /// Whether running it twice is harmless: a job whose worker died is then recovered
    /// rather than failed.
    pub idempotent: Option<bool>,
    pub max_recoveries: Option<u32>,
    pub kind: Option<String>,
    /// Retries on transport errors and `503`s.
    pub backoff: Backoff,
}

impl NewJob {
    pub fn new(payload: Value) -> NewJob {
        NewJob {
            payload,
            ..NewJob::default()
        }
    }
}

/// The server's answer to an enqueue.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Enqueued {
    pub job_id: String,
    pub queue: String,
    pub revision: u64,
}

impl Client {
    /// Enqueues `job` on `queue`. Retried with the job's backoff on transport errors and
    /// `503`s under one `request_id`, so a retry after a lost answer gets the first answer
    /// back and the job is never enqueued twice. Any other refusal is [`Error::Api`].
    pub async fn enqueue(&self, queue: &str, job: &NewJob) -> Result<Enqueued, Error> {
        let mut body = json!({"payload": job.payload, "request_id": request_id()});
        if let Some(v) = job.idempotent {
            body["idempotent"] = json!(v);
        }
        if let Some(v) = job.max_recoveries {
            body["max_recoveries"] = json!(v);
        }
        if let Some(v) = &job.kind {
            body["kind"] = json!(v);
        }
        let path = format!("/v1/queues/{}/jobs", segment(queue));
        let r = post_retried(self, &job.backoff, &path, &body, || true).await?;
        if r.status.as_u16() != 201 {
            return Err(Error::from_reply(&r));
        }
        let b = &r.body;
        match (
            b["job_id"].as_str(),
            b["queue"].as_str(),
            b["revision"].as_u64(),
        ) {
            (Some(job_id), Some(queue), Some(revision)) => Ok(Enqueued {
                job_id: job_id.to_string(),
                queue: queue.to_string(),
                revision,
            }),
            _ => Err(Error::Unexpected(r.text.clone())),
        }
    }
}
