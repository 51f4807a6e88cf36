//! The load generator's own HTTP/1.1 client for plain `http://` servers: one persistent TCP
//! connection (TCP_NODELAY) per simulated client, each request written from a reused buffer
//! and each reply read into another, the JSON body searched only for the fields a workload
//! needs. It exists so that the driver's cost per request stays below the server's and the
//! peers' client libraries': a comparison must measure the server, not the driver.
//!
//! A reply must carry `Content-Length` (Leasehold's always do), or be one that has no body
//! (1xx, 204, 304); chunked or close-delimited replies are refused as malformed. After any
//! error the connection is dropped and the next request opens a new one: a request is never
//! sent twice, since acquires and enqueues are not idempotent.

use std::fmt;
use std::io::Write as _;
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// No single request of a workload waits longer than this (the workloads never long-poll).
const TIMEOUT: Duration = Duration::from_secs(60);
/// A reply head longer than this is malformed (Leasehold's are about 100 bytes).
const MAX_HEAD: usize = 16 * 1024;
/// A reply body longer than this is malformed (the workloads' replies are under 1 KiB).
const MAX_BODY: usize = 16 * 1024 * 1024;

#[derive(Debug, thiserror::Error)]
pub enum WireError {
    #[error("invalid server URL {0:?}: {1}")]
    Url(String, String),
    #[error("cannot reach {0}: {1}")]
    Connect(String, std::io::Error),
    #[error("connection to {0}: {1}")]
    Io(String, std::io::Error),
    #[error("{0} closed the connection before a whole reply")]
    Closed(String),
    #[error("no reply from {0} within {TIMEOUT:?}")]
    Timeout(String),
    #[error("malformed reply from {0}: {1}")]
    Malformed(String, &'static str),
}

/// Where to connect and what to name in `Host`, from `http://HOST:PORT` (no path).
fn parse_url(server: &str) -> Result<String, WireError> {
    let bad = |why: &str| WireError::Url(server.to_string(), why.to_string());
    let rest = server.trim_end_matches('/');
    let authority = match rest.split_once("://") {
        Some(("http", a)) => a,
        Some(("https", _)) => {
            return Err(bad(
                "the load generator speaks plain http:// only; run it against a plain listener",
            ));
        }
        _ => return Err(bad("expected http://HOST:PORT")),
    };
    if authority.is_empty() || authority.contains(['/', '?', '#', '@', ' ']) {
        return Err(bad("expected http://HOST:PORT with no path"));
    }
    // `[::1]:7878`, `host:7878`, or a host alone (port 80).
    let has_port = match authority.rfind(']') {
        Some(close) => authority[close + 1..].starts_with(':'),
        None => authority.contains(':'),
    };
    Ok(if has_port {
        authority.to_string()
    } else {
        format!("{authority}:80")
    })
}

/// One persistent connection and its buffers.
pub struct Conn {
    /// `host:port`, connected to and sent as `Host`.
    authority: String,
    /// `Authorization` header line, with its CRLF, or empty.
    auth: String,
    stream: Option<TcpStream>,
    /// The next request, head and body.
    out: Vec<u8>,
    /// Scratch for the body, so its length can be written ahead of it.
    body: Vec<u8>,
    /// Bytes read; a reply lives at `buf[..used]` once `exchange` returns.
    buf: Vec<u8>,
}

/// A reply: status and body, borrowed from the connection's buffer until the next request.
#[derive(Debug, PartialEq, Eq)]
pub struct Reply<'a> {
    pub status: u16,
    pub body: &'a [u8],
}

impl Reply<'_> {
    /// The unsigned integer member `key` of the top-level JSON object.
    pub fn u64(&self, key: &str) -> Option<u64> {
        let v = top_level(self.body, key)?;
        let end = v
            .iter()
            .position(|b| !b.is_ascii_digit())
            .unwrap_or(v.len());
        std::str::from_utf8(&v[..end]).ok()?.parse().ok()
    }

    /// The string member `key` of the top-level JSON object, when it holds no escape.
    pub fn str(&self, key: &str) -> Option<&str> {
        let v = top_level(self.body, key)?.strip_prefix(b"\"")?;
        let end = v.iter().position(|&b| b == b'"' || b == b'\\')?;
        (v[end] == b'"')
            .then(|| std::str::from_utf8(&v[..end]).ok())
            .flatten()
    }
}

impl Conn {
    /// A connection to `server` (`http://HOST:PORT`), sending `token` as a bearer token when
    /// set. Nothing is connected until the first request.
    pub fn new(server: &str, token: Option<&str>) -> Result<Conn, WireError> {
        let authority = parse_url(server)?;
        let auth = match token.filter(|t| !t.is_empty()) {
            Some(t) if t.bytes().all(|b| b.is_ascii_graphic()) => {
                format!("authorization: Bearer {t}\r\n")
            }
            Some(_) => {
                return Err(WireError::Url(
                    server.to_string(),
                    "the API token holds a character not allowed in an HTTP header".into(),
                ));
            }
            None => String::new(),
        };
        Ok(Conn {
            authority,
            auth,
            stream: None,
            out: Vec::with_capacity(512),
            body: Vec::with_capacity(256),
            buf: Vec::with_capacity(4096),
        })
    }

    /// Writes the next request into the buffer: `method`, `path` and a JSON `body` (empty
    /// for none). Formatting happens here so that no formatting state is held across the
    /// exchange's awaits.
    pub fn prepare(&mut self, method: &str, path: fmt::Arguments<'_>, body: fmt::Arguments<'_>) {
        self.body.clear();
        // Writing into a Vec cannot fail.
        let _ = self.body.write_fmt(body);
        self.out.clear();
        let _ = write!(
            self.out,
            "{method} {path} HTTP/1.1\r\nhost: {}\r\n",
            self.authority
        );
        self.out.extend_from_slice(self.auth.as_bytes());
        if !self.body.is_empty() {
            self.out
                .extend_from_slice(b"content-type: application/json\r\n");
        }
        let _ = write!(self.out, "content-length: {}\r\n\r\n", self.body.len());
        self.out.extend_from_slice(&self.body);
    }

    /// Sends the prepared request and reads its reply. On any error the connection is
    /// closed; the next request opens a new one.
    pub async fn exchange(&mut self) -> Result<Reply<'_>, WireError> {
        let result = tokio::time::timeout(TIMEOUT, self.round_trip()).await;
        let (status, body, keep) = match result {
            Ok(Ok(parts)) => parts,
            Ok(Err(e)) => {
                self.stream = None;
                return Err(e);
            }
            Err(_) => {
                self.stream = None;
                return Err(WireError::Timeout(self.authority.clone()));
            }
        };
        if !keep {
            self.stream = None;
        }
        Ok(Reply {
            status,
            body: &self.buf[body],
        })
    }

    async fn round_trip(&mut self) -> Result<(u16, std::ops::Range<usize>, bool), WireError> {
        let stream = match &mut self.stream {
            Some(s) => s,
            None => {
                let s = TcpStream::connect(&self.authority)
                    .await
                    .map_err(|e| WireError::Connect(self.authority.clone(), e))?;
                s.set_nodelay(true)
                    .map_err(|e| WireError::Connect(self.authority.clone(), e))?;
                self.stream.insert(s)
            }
        };
        let io = |e| WireError::Io(self.authority.clone(), e);
        stream.write_all(&self.out).await.map_err(io)?;
        self.buf.clear();
        loop {
            match parse(&self.buf) {
                Ok(Some(head)) => return Ok((head.status, head.body, head.keep_alive)),
                Ok(None) => {}
                Err(why) => return Err(WireError::Malformed(self.authority.clone(), why)),
            }
            if self.buf.capacity() - self.buf.len() < 1024 {
                self.buf.reserve(self.buf.capacity().max(4096));
            }
            let n = stream
                .read_buf(&mut self.buf)
                .await
                .map_err(|e| WireError::Io(self.authority.clone(), e))?;
            if n == 0 {
                return Err(WireError::Closed(self.authority.clone()));
            }
        }
    }
}

/// A whole reply found at the start of a buffer.
#[derive(Debug, PartialEq, Eq)]
struct Head {
    status: u16,
    /// Where the body is in the buffer.
    body: std::ops::Range<usize>,
    /// False when the server said `connection: close`.
    keep_alive: bool,
}

/// Parses the reply at the start of `buf`: `Ok(None)` while it is incomplete.
fn parse(buf: &[u8]) -> Result<Option<Head>, &'static str> {
    let Some(head_len) = buf.windows(4).position(|w| w == b"\r\n\r\n") else {
        return if buf.len() > MAX_HEAD {
            Err("a reply head over 16 KiB")
        } else {
            Ok(None)
        };
    };
    let head = std::str::from_utf8(&buf[..head_len]).map_err(|_| "a head that is not UTF-8")?;
    let mut lines = head.split("\r\n");
    let status_line = lines.next().unwrap_or_default();
    let rest = status_line
        .strip_prefix("HTTP/1.1 ")
        .or_else(|| status_line.strip_prefix("HTTP/1.0 "))
        .ok_or("a status line that is not HTTP/1.x")?;
    let code = rest.get(..3).ok_or("a status line without a status")?;
    if !code.bytes().all(|b| b.is_ascii_digit())
        || rest.as_bytes().get(3).is_some_and(|&b| b != b' ')
    {
        return Err("a status that is not three digits");
    }
    let status: u16 = code
        .parse()
        .map_err(|_| "a status that is not three digits")?;
    let mut length = None;
    let mut keep_alive = status_line.starts_with("HTTP/1.1");
    for line in lines {
        let (name, value) = line.split_once(':').ok_or("a header line without ':'")?;
        let value = value.trim();
        if name.eq_ignore_ascii_case("content-length") {
            let n: usize = value
                .parse()
                .map_err(|_| "a Content-Length that is not a number")?;
            if length.is_some_and(|l| l != n) {
                return Err("two different Content-Lengths");
            }
            length = Some(n);
        } else if name.eq_ignore_ascii_case("transfer-encoding") {
            return Err("a Transfer-Encoding (only Content-Length bodies are read)");
        } else if name.eq_ignore_ascii_case("connection") {
            if value.eq_ignore_ascii_case("close") {
                keep_alive = false;
            } else if value.eq_ignore_ascii_case("keep-alive") {
                keep_alive = true;
            }
        }
    }
    let bodyless = status < 200 || status == 204 || status == 304;
    let length = match length {
        _ if bodyless => 0,
        Some(n) if n > MAX_BODY => return Err("a body over 16 MiB"),
        Some(n) => n,
        None => return Err("no Content-Length"),
    };
    let start = head_len + 4;
    if buf.len() < start + length {
        return Ok(None);
    }
    if buf.len() > start + length {
        return Err("bytes after the reply it did not ask for");
    }
    Ok(Some(Head {
        status,
        body: start..start + length,
        keep_alive,
    }))
}

/// The value of member `key` of the JSON object `body`, at the top level only: the bytes
/// from the value's first to the end of the body (callers read as far as they need).
fn top_level<'a>(body: &'a [u8], key: &str) -> Option<&'a [u8]> {
    let mut i = body.iter().position(|b| !b.is_ascii_whitespace())?;
    if body[i] != b'{' {
        return None;
    }
    i += 1;
    // Depth of nesting inside the top-level object, and whether the next string at depth 0
    // is a member name.
    let mut depth = 0usize;
    let mut expect_key = true;
    while i < body.len() {
        match body[i] {
            b'"' => {
                let start = i + 1;
                i = start;
                while i < body.len() && body[i] != b'"' {
                    i += if body[i] == b'\\' { 2 } else { 1 };
                }
                let name = body.get(start..i)?;
                i += 1;
                if depth == 0 && expect_key {
                    let mut j = i;
                    while body.get(j)?.is_ascii_whitespace() {
                        j += 1;
                    }
                    if body[j] != b':' {
                        return None;
                    }
                    j += 1;
                    while body.get(j)?.is_ascii_whitespace() {
                        j += 1;
                    }
                    if name == key.as_bytes() {
                        return Some(&body[j..]);
                    }
                    expect_key = false;
                    i = j;
                }
                continue;
            }
            b'{' | b'[' => depth += 1,
            b'}' | b']' if depth == 0 => return None,
            b'}' | b']' => depth -= 1,
            b',' if depth == 0 => expect_key = true,
            _ => {}
        }
        i += 1;
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    const OK: &[u8] = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 13\r\ndate: x\r\n\r\n{\"token\":42}\n";

    #[test]
    fn a_whole_reply_is_found_and_a_partial_one_waits() {
        let head = parse(OK).unwrap().unwrap();
        assert_eq!(head.status, 200);
        assert_eq!(&OK[head.body.clone()], b"{\"token\":42}\n");
        assert!(head.keep_alive);
        // Every split point short of the end, as reads may deliver it.
        for cut in 0..OK.len() {
            assert_eq!(parse(&OK[..cut]), Ok(None), "cut at {cut}");
        }
    }

    #[test]
    fn bodyless_replies_and_connection_close() {
        let head = parse(b"HTTP/1.1 204 No Content\r\ndate: x\r\n\r\n")
            .unwrap()
            .unwrap();
        assert_eq!(
            (head.status, head.body.len(), head.keep_alive),
            (204, 0, true)
        );
        let head = parse(b"HTTP/1.1 503 Busy\r\nConnection: close\r\nContent-Length: 2\r\n\r\n{}")
            .unwrap()
            .unwrap();
        assert_eq!((head.status, head.keep_alive), (503, false));
        let head = parse(b"HTTP/1.0 200 OK\r\ncontent-length: 0\r\n\r\n")
            .unwrap()
            .unwrap();
        assert!(!head.keep_alive);
    }

    #[test]
    fn malformed_replies_are_errors() {
        for bad in [
            &b"HTTP/2 200 OK\r\n\r\n"[..],
            b"HTTP/1.1 20x OK\r\ncontent-length: 0\r\n\r\n",
            b"HTTP/1.1 2000 OK\r\ncontent-length: 0\r\n\r\n",
            b"HTTP/1.1 200 OK\r\n\r\n",
            b"HTTP/1.1 200 OK\r\ncontent-length: ten\r\n\r\n",
            b"HTTP/1.1 200 OK\r\ncontent-length: 1\r\ncontent-length: 2\r\n\r\n",
            b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n",
            b"HTTP/1.1 200 OK\r\nno colon\r\ncontent-length: 0\r\n\r\n",
            b"HTTP/1.1 200 OK\r\ncontent-length: 1\r\n\r\n{}",
        ] {
            assert!(parse(bad).is_err(), "{}", String::from_utf8_lossy(bad));
        }
        assert!(parse(&vec![b'a'; MAX_HEAD + 1]).is_err());
    }

    #[test]
    fn fields_are_read_at_the_top_level_only() {
        let body = br#"{"lock":{"token":1,"k":"a\"token\":2"},"seat_token":3, "token" : 77,"session_id":"ab-c"}"#;
        let r = Reply { status: 200, body };
        assert_eq!(r.u64("token"), Some(77));
        assert_eq!(r.u64("seat_token"), Some(3));
        assert_eq!(r.str("session_id"), Some("ab-c"));
        assert_eq!(r.u64("missing"), None);
        assert_eq!(r.u64("session_id"), None);
        assert_eq!(r.str("token"), None);
        let escaped = Reply {
            status: 200,
            body: br#"{"id":"a\"b"}"#,
        };
        assert_eq!(escaped.str("id"), None);
        for junk in [&b""[..], b"[1]", b"{\"token\"", b"{\"token\" 1}", b"\"x\""] {
            let r = Reply {
                status: 200,
                body: junk,
            };
            assert_eq!(r.u64("token"), None, "{}", String::from_utf8_lossy(junk));
        }
    }

    #[test]
    fn urls() {
        assert_eq!(
            parse_url("http://127.0.0.1:7878/").unwrap(),
            "127.0.0.1:7878"
        );
        assert_eq!(parse_url("http://[::1]:80").unwrap(), "[::1]:80");
        assert_eq!(parse_url("http://localhost").unwrap(), "localhost:80");
        assert!(parse_url("https://127.0.0.1:7878").is_err());
        assert!(parse_url("127.0.0.1:7878").is_err());
        assert!(parse_url("http://127.0.0.1:7878/v1").is_err());
        assert!(Conn::new("http://a:1", Some("bad token")).is_err());
    }

    #[test]
    fn requests_carry_length_token_and_body() {
        let mut c = Conn::new("http://127.0.0.1:9", Some("s3cret")).unwrap();
        c.prepare(
            "POST",
            format_args!("/v1/sessions/{}/heartbeat", "id"),
            format_args!("{{}}"),
        );
        assert_eq!(
            String::from_utf8(c.out.clone()).unwrap(),
            "POST /v1/sessions/id/heartbeat HTTP/1.1\r\nhost: 127.0.0.1:9\r\nauthorization: Bearer s3cret\r\ncontent-type: application/json\r\ncontent-length: 2\r\n\r\n{}"
        );
        c.prepare("DELETE", format_args!("/x"), format_args!(""));
        assert!(c.out.ends_with(b"content-length: 0\r\n\r\n"));
    }

    /// Keep-alive over a real socket, a reply split over reads, and a server that closes:
    /// an error, then a fresh connection for the next request.
    #[tokio::test]
    async fn keep_alive_split_reads_and_reconnect() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let server = tokio::spawn(async move {
            // First connection: two requests on it, the second reply in two writes; then
            // it reads a third request and closes without answering.
            let (mut s, _) = listener.accept().await.unwrap();
            let mut buf = vec![0u8; 4096];
            let _ = s.read(&mut buf).await.unwrap();
            s.write_all(OK).await.unwrap();
            let _ = s.read(&mut buf).await.unwrap();
            s.write_all(&OK[..20]).await.unwrap();
            s.flush().await.unwrap();
            tokio::time::sleep(Duration::from_millis(20)).await;
            s.write_all(&OK[20..]).await.unwrap();
            let _ = s.read(&mut buf).await.unwrap();
            drop(s);
            // Second connection: answers once.
            let (mut s, _) = listener.accept().await.unwrap();
            let _ = s.read(&mut buf).await.unwrap();
            s.write_all(OK).await.unwrap();
        });
        let mut c = Conn::new(&format!("http://{addr}"), None).unwrap();
        for _ in 0..2 {
            c.prepare("POST", format_args!("/a"), format_args!("{{}}"));
            let r = c.exchange().await.unwrap();
            assert_eq!((r.status, r.u64("token")), (200, Some(42)));
        }
        c.prepare("POST", format_args!("/a"), format_args!("{{}}"));
        assert!(matches!(c.exchange().await, Err(WireError::Closed(_))));
        c.prepare("POST", format_args!("/a"), format_args!("{{}}"));
        assert_eq!(c.exchange().await.unwrap().status, 200);
        server.await.unwrap();
    }
}
