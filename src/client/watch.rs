//! A session's watch (`GET /v1/sessions/{id}/watch`): the server's own loss signal, read as
//! server-sent events.

use http_body_util::{BodyExt, Empty};
use hyper::body::{Bytes, Incoming};
use hyper::{Method, Request};
use hyper_util::client::legacy::Client as HyperClient;
use hyper_util::rt::TokioExecutor;
use serde_json::Value;

use super::http::{Client, ClientError, Reply};

/// One event of a watch: its name (`snapshot`, `grace`, `active`, `lock_lost`, `seat_lost`,
/// then one of `expired`, `ended_by_admin`, `closed`, `gone`, `shutting_down`), its number
/// in the stream, and its data.
#[derive(Debug, Clone, PartialEq)]
pub struct WatchEvent {
    pub id: Option<u64>,
    pub event: String,
    pub data: Value,
}

impl WatchEvent {
    /// Whether the stream ends after this event: the session ended (or the server is
    /// shutting down, when the session itself is not affected: watch again elsewhere).
    pub fn is_final(&self) -> bool {
        matches!(
            self.event.as_str(),
            "expired" | "ended_by_admin" | "closed" | "gone" | "shutting_down"
        )
    }

    /// Whether the event says the session is gone.
    pub fn is_loss(&self) -> bool {
        matches!(
            self.event.as_str(),
            "expired" | "ended_by_admin" | "closed" | "gone"
        )
    }
}

/// An open watch. [`Watch::next`] returns its events in order, and `None` once the server
/// has ended the stream.
pub struct Watch {
    body: Incoming,
    buf: Vec<u8>,
}

impl Client {
    /// Opens a watch of session `id`: the stream, or the server's refusal (`404
    /// session_gone`, `429`/`503 too_many_watches`) as a [`Reply`]. The client's timeout
    /// bounds the answer's head only: a watch lasts as long as its session.
    pub async fn watch(&self, id: &str) -> Result<Result<Watch, Reply>, ClientError> {
        let http = HyperClient::builder(TokioExecutor::new()).build_http::<Empty<Bytes>>();
        let mut req = Request::builder()
            .method(Method::GET)
            .uri(format!("{}/v1/sessions/{id}/watch", self.base()))
            .header("accept", "text/event-stream");
        if let Some(token) = self.bearer() {
            req = req.header("authorization", format!("Bearer {token}"));
        }
        let req = req
            .body(Empty::new())
            .map_err(|e| ClientError::Url(id.to_string(), e.to_string()))?;
        let resp = tokio::time::timeout(self.timeout(), http.request(req))
            .await
            .map_err(|_| ClientError::Timeout(self.timeout()))?
            .map_err(|e| ClientError::Connect {
                server: self.base().to_string(),
                message: format!("{e:?}"),
            })?;
        let status = resp.status();
        if status.as_u16() != 200 {
            let bytes = resp
                .into_body()
                .collect()
                .await
                .map_err(|e| ClientError::Connect {
                    server: self.base().to_string(),
                    message: e.to_string(),
                })?
                .to_bytes();
            let text = String::from_utf8_lossy(&bytes).into_owned();
            let body = serde_json::from_slice(&bytes).unwrap_or(Value::Null);
            return Ok(Err(Reply { status, body, text }));
        }
        Ok(Ok(Watch {
            body: resp.into_body(),
            buf: Vec::new(),
        }))
    }
}

impl Watch {
    /// The next event, skipping keep-alive comments; `None` when the stream has ended.
    pub async fn next(&mut self) -> Result<Option<WatchEvent>, ClientError> {
        loop {
            if let Some(end) = find_blank_line(&self.buf) {
                let block: Vec<u8> = self.buf.drain(..end.1).collect();
                if let Some(e) = parse_block(&String::from_utf8_lossy(&block[..end.0])) {
                    return Ok(Some(e));
                }
                continue;
            }
            match self.body.frame().await {
                None => return Ok(None),
                Some(Err(e)) => {
                    return Err(ClientError::Connect {
                        server: "the watch stream".into(),
                        message: e.to_string(),
                    });
                }
                Some(Ok(frame)) => {
                    if let Ok(data) = frame.into_data() {
                        self.buf.extend_from_slice(&data);
                    }
                }
            }
        }
    }
}

/// Where the first event block ends: (end of its text, end of the blank line after it).
fn find_blank_line(buf: &[u8]) -> Option<(usize, usize)> {
    (0..buf.len()).find_map(|i| {
        if buf[i..].starts_with(b"\n\n") {
            Some((i, i + 2))
        } else if buf[i..].starts_with(b"\r\n\r\n") {
            Some((i, i + 4))
        } else {
            None
        }
    })
}

/// One event block; `None` for a block of comments only.
fn parse_block(text: &str) -> Option<WatchEvent> {
    let mut event = None;
    let mut id = None;
    let mut data: Vec<&str> = Vec::new();
    for line in text.lines() {
        if line.starts_with(':') {
            continue;
        }
        let (field, value) = line.split_once(':').unwrap_or((line, ""));
        let value = value.strip_prefix(' ').unwrap_or(value);
        match field {
            "event" => event = Some(value.to_string()),
            "id" => id = value.parse().ok(),
            "data" => data.push(value),
            _ => {}
        }
    }
    if event.is_none() && data.is_empty() {
        return None;
    }
    let data = data.join("\n");
    Some(WatchEvent {
        id,
        event: event.unwrap_or_else(|| "message".into()),
        data: serde_json::from_str(&data).unwrap_or(Value::String(data)),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn blocks_parse_and_comments_are_skipped() {
        assert_eq!(parse_block(": keep-alive"), None);
        let e = parse_block("id: 3\nevent: grace\ndata: {\"a\":1}").unwrap();
        assert_eq!(e.id, Some(3));
        assert_eq!(e.event, "grace");
        assert_eq!(e.data["a"], 1);
        assert!(!e.is_final());
        let buf = b": keep-alive\n\nevent: closed\ndata: {}\n\n";
        assert_eq!(find_blank_line(buf), Some((12, 14)));
    }
}
