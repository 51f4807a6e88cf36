//! TLS: a handshake and a request over it, a certificate reload (as on SIGHUP) that new
//! connections see while an established one keeps serving, and plain HTTP on the TLS port
//! refused with an answer the client can read; client certificates verified against
//! `tls_client_ca` acting as the token whose `cert_subject` they carry, and revoked by a
//! reload. Certificates are made with the `openssl` command. Embedded backend only: TLS is
//! the server's, in front of every backend.
mod common;

use std::path::Path;
use std::process::Command;
use std::sync::Arc;
use std::time::Duration;

use common::*;
use http_body_util::{BodyExt, Empty};
use hyper::body::Bytes;
use leasehold::auth::{self, Role, TokenEntry, TokensFile};
use leasehold::config::ClientAuth;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio_rustls::TlsConnector;

/// A self-signed certificate for 127.0.0.1 with common name `cn`, written to `cert`/`key`.
fn make_cert(dir: &Path, cn: &str, cert: &Path, key: &Path) {
    let tmp_cert = dir.join(format!("{cn}.crt"));
    let tmp_key = dir.join(format!("{cn}.key"));
    let st = Command::new("openssl")
        .args([
            "req",
            "-x509",
            "-newkey",
            "ec",
            "-pkeyopt",
            "ec_paramgen_curve:prime256v1",
        ])
        .args(["-nodes", "-days", "2", "-subj", &format!("/CN={cn}")])
        .args(["-addext", "subjectAltName=IP:127.0.0.1"])
        .args(["-addext", "basicConstraints=critical,CA:FALSE"])
        .args(["-addext", "extendedKeyUsage=serverAuth"])
        .arg("-keyout")
        .arg(&tmp_key)
        .arg("-out")
        .arg(&tmp_cert)
        .stderr(std::process::Stdio::null())
        .status()
        .expect("openssl runs");
    assert!(st.success());
    // Renamed into place, as a certificate manager does.
    std::fs::rename(&tmp_key, key).unwrap();
    std::fs::rename(&tmp_cert, cert).unwrap();
}

fn der(cert: &Path) -> CertificateDer<'static> {
    CertificateDer::from_pem_file(cert).unwrap()
}

fn connector(trusted: &[CertificateDer<'static>]) -> TlsConnector {
    let mut roots = rustls::RootCertStore::empty();
    for c in trusted {
        roots.add(c.clone()).unwrap();
    }
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let config = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_root_certificates(roots)
        .with_no_client_auth();
    TlsConnector::from(Arc::new(config))
}

/// An HTTP/1.1 connection over TLS; returns the sender and the certificate the server
/// presented.
async fn https(
    s: &TestServer,
    tls: &TlsConnector,
) -> (
    hyper::client::conn::http1::SendRequest<Empty<Bytes>>,
    CertificateDer<'static>,
) {
    let tcp = TcpStream::connect(addr(s)).await.unwrap();
    let name = ServerName::IpAddress(std::net::Ipv4Addr::LOCALHOST.into());
    let stream = tls
        .connect(name, tcp)
        .await
        .expect("the TLS handshake succeeds");
    let presented = stream.get_ref().1.peer_certificates().unwrap()[0].clone();
    let (send, conn) = hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(stream))
        .await
        .unwrap();
    tokio::spawn(conn);
    (send, presented)
}

async fn healthz(send: &mut hyper::client::conn::http1::SendRequest<Empty<Bytes>>) -> String {
    let req = hyper::Request::builder()
        .uri("/healthz")
        .header("host", "127.0.0.1")
        .body(Empty::new())
        .unwrap();
    let resp = tokio::time::timeout(Duration::from_secs(10), send.send_request(req))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(resp.status(), 200);
    String::from_utf8(
        resp.into_body()
            .collect()
            .await
            .unwrap()
            .to_bytes()
            .to_vec(),
    )
    .unwrap()
}

#[tokio::test]
async fn https_handshake_reload_and_plain_http_refused() {
    let dir = tempfile::tempdir().unwrap();
    let (cert, key) = (dir.path().join("tls.crt"), dir.path().join("tls.key"));
    make_cert(dir.path(), "first", &cert, &key);
    let first = der(&cert);
    let (c, k) = (cert.clone(), key.clone());
    let s = TestServer::start_with(move |cfg| {
        cfg.tls_cert_file = Some(c);
        cfg.tls_key_file = Some(k);
    })
    .await;

    // A handshake, and a request over it.
    let (mut kept, presented) = https(&s, &connector(std::slice::from_ref(&first))).await;
    assert_eq!(presented, first);
    assert!(healthz(&mut kept).await.contains("ok"));

    // A client that does not trust the certificate fails the handshake.
    make_cert(
        dir.path(),
        "stranger",
        &dir.path().join("s.crt"),
        &dir.path().join("s.key"),
    );
    let stranger = der(&dir.path().join("s.crt"));
    let tcp = TcpStream::connect(addr(&s)).await.unwrap();
    let name = ServerName::IpAddress(std::net::Ipv4Addr::LOCALHOST.into());
    assert!(connector(&[stranger]).connect(name, tcp).await.is_err());

    // Plain HTTP on the TLS port: refused, in plain HTTP, with the JSON error.
    let mut plain = TcpStream::connect(addr(&s)).await.unwrap();
    plain
        .write_all(b"GET /healthz HTTP/1.1\r\nHost: t\r\n\r\n")
        .await
        .unwrap();
    let mut answer = String::new();
    tokio::time::timeout(Duration::from_secs(10), plain.read_to_string(&mut answer))
        .await
        .unwrap()
        .unwrap();
    assert!(answer.starts_with("HTTP/1.1 400"), "{answer}");
    assert!(answer.contains("\"tls_required\""), "{answer}");

    // A new certificate in the files, then the reload SIGHUP makes.
    make_cert(dir.path(), "second", &cert, &key);
    let second = der(&cert);
    s.app.as_ref().unwrap().reload().unwrap();
    let both = connector(&[first.clone(), second.clone()]);
    let (mut fresh, presented) = https(&s, &both).await;
    assert_eq!(
        presented, second,
        "a new connection gets the new certificate"
    );
    assert!(healthz(&mut fresh).await.contains("ok"));
    // The connection made before the reload was not dropped and still serves.
    assert!(healthz(&mut kept).await.contains("ok"));

    // A broken key file is refused on reload; the certificate in force stays.
    std::fs::write(&key, "not a key").unwrap();
    assert!(s.app.as_ref().unwrap().reload().is_err());
    let (_, presented) = https(&s, &both).await;
    assert_eq!(presented, second);
    s.stop().await;
}

#[test]
fn cert_and_key_go_together() {
    let c = leasehold::config::Config {
        tls_cert_file: Some("/x.crt".into()),
        ..Default::default()
    };
    let err = c.validate().unwrap_err().to_string();
    assert!(err.contains("tls_cert_file and tls_key_file"), "{err}");
}

/// A CA certificate and key, `name.crt` and `name.key` in `dir`.
fn make_ca(dir: &Path, name: &str) {
    openssl_req(dir, name, name, |c| {
        c.args(["-addext", "basicConstraints=critical,CA:TRUE"])
            .args(["-addext", "keyUsage=critical,keyCertSign"]);
    });
}

/// A client certificate signed by CA `ca`, with common name `cn` and subjectAltName DNS
/// name `dns`, written to `name.crt` and `name.key` in `dir`.
fn make_client(dir: &Path, ca: &str, name: &str, cn: &str, dns: &str) {
    openssl_req(dir, name, cn, |c| {
        c.arg("-CA")
            .arg(dir.join(format!("{ca}.crt")))
            .arg("-CAkey")
            .arg(dir.join(format!("{ca}.key")))
            .args(["-addext", &format!("subjectAltName=DNS:{dns}")])
            .args(["-addext", "basicConstraints=critical,CA:FALSE"])
            .args(["-addext", "extendedKeyUsage=clientAuth"]);
    });
}

/// `openssl req -x509` for an EC P-256 key and certificate with common name `cn`, written to
/// `name.crt` and `name.key` in `dir`; `extra` adds the signer and extensions.
fn openssl_req(dir: &Path, name: &str, cn: &str, extra: impl FnOnce(&mut Command)) {
    let mut c = Command::new("openssl");
    c.args(["req", "-x509", "-newkey", "ec"])
        .args(["-pkeyopt", "ec_paramgen_curve:prime256v1"])
        .args(["-nodes", "-days", "2", "-subj", &format!("/CN={cn}")]);
    extra(&mut c);
    let st = c
        .arg("-keyout")
        .arg(dir.join(format!("{name}.key")))
        .arg("-out")
        .arg(dir.join(format!("{name}.crt")))
        .stderr(std::process::Stdio::null())
        .status()
        .expect("openssl runs");
    assert!(st.success());
}

/// A connector trusting `server` that presents the client certificate `name` from `dir`.
fn connector_as(server: &CertificateDer<'static>, dir: &Path, name: &str) -> TlsConnector {
    let mut roots = rustls::RootCertStore::empty();
    roots.add(server.clone()).unwrap();
    let chain = vec![der(&dir.join(format!("{name}.crt")))];
    let key = PrivateKeyDer::from_pem_file(dir.join(format!("{name}.key"))).unwrap();
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let config = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_root_certificates(roots)
        .with_client_auth_cert(chain, key)
        .unwrap();
    TlsConnector::from(Arc::new(config))
}

type Sender = hyper::client::conn::http1::SendRequest<Empty<Bytes>>;

/// An HTTP/1.1 connection over TLS, or the error of the handshake or of the first
/// request (in TLS 1.3 the server checks the client certificate after the client finished
/// its side of the handshake, so a refusal surfaces on the first read).
async fn try_https(s: &TestServer, tls: &TlsConnector) -> Result<Sender, String> {
    let tcp = TcpStream::connect(addr(s)).await.unwrap();
    let name = ServerName::IpAddress(std::net::Ipv4Addr::LOCALHOST.into());
    let stream = tls.connect(name, tcp).await.map_err(|e| e.to_string())?;
    let (mut send, conn) =
        hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(stream))
            .await
            .map_err(|e| e.to_string())?;
    tokio::spawn(conn);
    call(&mut send, "GET", "/healthz", None)
        .await
        .map_err(|e| e.to_string())?;
    Ok(send)
}

/// A request with an empty body; the status and the JSON `error` code, if any.
async fn call(
    send: &mut Sender,
    method: &str,
    path: &str,
    bearer: Option<&str>,
) -> Result<(u16, Option<String>), hyper::Error> {
    let mut req = hyper::Request::builder()
        .method(method)
        .uri(path)
        .header("host", "127.0.0.1");
    if let Some(b) = bearer {
        req = req.header("authorization", format!("Bearer {b}"));
    }
    let resp = tokio::time::timeout(
        Duration::from_secs(10),
        send.send_request(req.body(Empty::new()).unwrap()),
    )
    .await
    .unwrap()?;
    let status = resp.status().as_u16();
    let body = resp.into_body().collect().await?.to_bytes();
    let code = serde_json::from_slice::<serde_json::Value>(&body)
        .ok()
        .and_then(|v| v["error"].as_str().map(str::to_owned));
    Ok((status, code))
}

async fn status(send: &mut Sender, method: &str, path: &str, bearer: Option<&str>) -> u16 {
    let (status, code) = call(send, method, path, bearer).await.unwrap();
    if status == 401 {
        assert_eq!(code.as_deref(), Some("unauthorized"));
    }
    status
}

/// Writes a tokens file: (name, role, cert_subject); returns the secrets in that order.
fn write_tokens(path: &Path, tokens: &[(&str, Role, Option<&str>)]) -> Vec<String> {
    let mut file = TokensFile::default();
    let mut secrets = Vec::new();
    for (name, role, subject) in tokens {
        let secret = auth::new_secret();
        file.token.push(TokenEntry {
            name: (*name).into(),
            role: *role,
            hash: auth::hash_text(&auth::hash(&secret)),
            keys: None,
            pools: None,
            queues: None,
            cert_subject: subject.map(str::to_owned),
            created_at: 0,
        });
        secrets.push(secret);
    }
    file.write(path).unwrap();
    secrets
}

struct Mtls {
    s: TestServer,
    dir: tempfile::TempDir,
    server: CertificateDer<'static>,
    tokens: std::path::PathBuf,
}

/// A TLS server with tokens and client CA `ca`; certificates: `worker` (DNS
/// worker.example, CN other.example), `stranger` (DNS nobody.example, CN
/// worker.example: a common name is never an identity) and `rogue` (DNS worker.example,
/// signed by a CA the server does not trust).
async fn mtls(tokens: &[(&str, Role, Option<&str>)], auth: ClientAuth) -> (Mtls, Vec<String>) {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let (cert, key) = (d.join("tls.crt"), d.join("tls.key"));
    make_cert(d, "server", &cert, &key);
    make_ca(d, "ca");
    make_ca(d, "other-ca");
    make_client(d, "ca", "worker", "other.example", "worker.example");
    make_client(d, "ca", "stranger", "worker.example", "nobody.example");
    make_client(d, "other-ca", "rogue", "worker.example", "worker.example");
    let tokens_path = d.join("tokens.toml");
    let secrets = write_tokens(&tokens_path, tokens);
    let (c, k, ca, t) = (cert.clone(), key, d.join("ca.crt"), tokens_path.clone());
    let s = TestServer::start_with(move |cfg| {
        cfg.tls_cert_file = Some(c);
        cfg.tls_key_file = Some(k);
        cfg.tls_client_ca = Some(ca);
        cfg.tls_client_auth = auth;
        cfg.tokens_file = Some(t);
    })
    .await;
    let server = der(&cert);
    (
        Mtls {
            s,
            dir,
            server,
            tokens: tokens_path,
        },
        secrets,
    )
}

#[tokio::test]
async fn client_certificates_act_as_their_tokens() {
    let (m, secrets) = mtls(
        &[
            ("worker", Role::Reader, Some("Worker.Example")),
            ("ops", Role::Operator, None),
        ],
        ClientAuth::Optional,
    )
    .await;
    let (worker, ops) = (&secrets[0], &secrets[1]);
    let d = m.dir.path();

    // A mapped certificate acts with its token's role, without a bearer header (names are
    // compared without regard to case).
    let mut w = try_https(&m.s, &connector_as(&m.server, d, "worker"))
        .await
        .unwrap();
    assert_eq!(status(&mut w, "GET", "/v1/sessions", None).await, 200);
    assert_eq!(status(&mut w, "POST", "/v1/sessions", None).await, 403);
    assert_eq!(status(&mut w, "POST", "/v1/admin/reap", None).await, 403);
    // Its own token's bearer agrees; another token's is refused, never the higher role.
    assert_eq!(
        status(&mut w, "GET", "/v1/sessions", Some(worker)).await,
        200
    );
    assert_eq!(
        status(&mut w, "POST", "/v1/admin/reap", Some(ops)).await,
        401
    );
    assert_eq!(
        status(&mut w, "GET", "/v1/sessions", Some("lh_nope")).await,
        401
    );

    // A valid certificate no token names (its CN is a mapped name, but the CN is never
    // used): nothing without a bearer, and a bearer alone decides.
    let mut st = try_https(&m.s, &connector_as(&m.server, d, "stranger"))
        .await
        .unwrap();
    assert_eq!(status(&mut st, "GET", "/v1/sessions", None).await, 401);
    assert_eq!(
        status(&mut st, "POST", "/v1/admin/reap", Some(ops)).await,
        200
    );

    // Without a certificate (optional mode) the bearer works as before.
    let (mut plain, _) = https(&m.s, &connector(std::slice::from_ref(&m.server))).await;
    assert_eq!(status(&mut plain, "GET", "/v1/sessions", None).await, 401);
    assert_eq!(
        status(&mut plain, "GET", "/v1/sessions", Some(ops)).await,
        200
    );

    // A certificate from a CA the server does not trust is refused at the handshake.
    assert!(
        try_https(&m.s, &connector_as(&m.server, d, "rogue"))
            .await
            .is_err()
    );

    // Revocation: the mapping leaves the tokens file; the reload SIGHUP makes applies it
    // to new connections and to the one already open.
    write_tokens(&m.tokens, &[("ops", Role::Operator, None)]);
    m.s.app.as_ref().unwrap().reload().unwrap();
    assert_eq!(status(&mut w, "GET", "/v1/sessions", None).await, 401);
    let mut again = try_https(&m.s, &connector_as(&m.server, d, "worker"))
        .await
        .unwrap();
    assert_eq!(status(&mut again, "GET", "/v1/sessions", None).await, 401);

    // Mapped to another token by a reload, the certificate acts as that one.
    write_tokens(
        &m.tokens,
        &[("ops", Role::Operator, Some("worker.example"))],
    );
    m.s.app.as_ref().unwrap().reload().unwrap();
    assert_eq!(
        status(&mut again, "POST", "/v1/admin/reap", None).await,
        200
    );
    m.s.stop().await;
}

#[tokio::test]
async fn required_client_certificates_and_a_reloaded_ca() {
    let (m, _) = mtls(
        &[("worker", Role::Reader, Some("worker.example"))],
        ClientAuth::Required,
    )
    .await;
    let d = m.dir.path();
    // Without a certificate: no connection.
    assert!(
        try_https(&m.s, &connector(std::slice::from_ref(&m.server)))
            .await
            .is_err()
    );
    let mut w = try_https(&m.s, &connector_as(&m.server, d, "worker"))
        .await
        .unwrap();
    assert_eq!(status(&mut w, "GET", "/v1/sessions", None).await, 200);

    // The CA file is read again on reload: another CA replaces it, and the certificates of
    // the old one stop getting new connections; the open one keeps serving.
    std::fs::copy(d.join("other-ca.crt"), d.join("ca.crt")).unwrap();
    m.s.app.as_ref().unwrap().reload().unwrap();
    assert!(
        try_https(&m.s, &connector_as(&m.server, d, "worker"))
            .await
            .is_err()
    );
    let mut rogue = try_https(&m.s, &connector_as(&m.server, d, "rogue"))
        .await
        .unwrap();
    assert_eq!(status(&mut rogue, "GET", "/v1/sessions", None).await, 200);
    assert_eq!(status(&mut w, "GET", "/v1/sessions", None).await, 200);

    // A CA file with no certificate is refused on reload; the CAs in force stay.
    std::fs::write(d.join("ca.crt"), "not a certificate").unwrap();
    assert!(m.s.app.as_ref().unwrap().reload().is_err());
    assert!(
        try_https(&m.s, &connector_as(&m.server, d, "rogue"))
            .await
            .is_ok()
    );
    m.s.stop().await;
}

#[test]
fn client_ca_settings_are_validated() {
    let c = leasehold::config::Config {
        tls_client_ca: Some("/ca.crt".into()),
        ..Default::default()
    };
    let err = c.validate().unwrap_err().to_string();
    assert!(err.contains("tls_client_ca needs tls_cert_file"), "{err}");
    let c = leasehold::config::Config {
        tls_client_auth: ClientAuth::Required,
        ..Default::default()
    };
    let err = c.validate().unwrap_err().to_string();
    assert!(err.contains("needs tls_client_ca"), "{err}");
}

#[test]
fn cert_subjects_are_validated() {
    let entry = |name: &str, subject: &str| TokenEntry {
        name: name.into(),
        role: Role::Reader,
        hash: auth::hash_text(&auth::hash(name)),
        keys: None,
        pools: None,
        queues: None,
        cert_subject: Some(subject.into()),
        created_at: 0,
    };
    for bad in ["", "*.example", "a..b", "-a.example", "a b", "a/b"] {
        let f = TokensFile {
            token: vec![entry("a", bad)],
        };
        let err = f.validate().unwrap_err();
        assert!(err.contains("must be a DNS name"), "{bad:?}: {err}");
    }
    let f = TokensFile {
        token: vec![entry("a", "w.example"), entry("b", "W.example")],
    };
    assert!(f.validate().unwrap_err().contains("another token's too"));
    let f = TokensFile {
        token: vec![entry("a", "w.example"), entry("b", "x.example")],
    };
    assert!(f.validate().is_ok());
}

/// The server's base URL with https:// (the server itself prints http:// in tests).
fn https_url(s: &TestServer) -> String {
    s.url().replacen("http://", "https://", 1)
}

fn leasehold() -> Command {
    Command::new(env!("CARGO_BIN_EXE_leasehold"))
}

// The CLI runs as a child process the test waits for: the server needs a thread of
// its own meanwhile.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_rust_client_and_the_cli_verify_a_tls_server() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let (cert, key) = (d.join("tls.crt"), d.join("tls.key"));
    make_cert(d, "server", &cert, &key);
    make_cert(d, "stranger", &d.join("s.crt"), &d.join("s.key"));
    let (c, k) = (cert.clone(), key.clone());
    let s = TestServer::start_with(move |cfg| {
        cfg.tls_cert_file = Some(c);
        cfg.tls_key_file = Some(k);
    })
    .await;
    let url = https_url(&s);
    let trusted = leasehold::client::TlsFiles {
        ca_file: Some(cert.clone()),
        ..Default::default()
    };

    // The Rust client, trusting the server's CA: a session opened and closed over TLS.
    let client = leasehold::client::Client::new(&url)
        .unwrap()
        .with_tls(&trusted)
        .unwrap();
    let opened = client
        .post(
            "/v1/sessions",
            &serde_json::json!({"owner": "tls", "ttl_ms": 10000}),
        )
        .await
        .unwrap();
    assert_eq!(opened.status, 201, "{}", opened.text);

    // A CA that did not sign the server's certificate: refused, naming the server.
    let untrusted = leasehold::client::Client::new(&url)
        .unwrap()
        .with_tls(&leasehold::client::TlsFiles {
            ca_file: Some(d.join("s.crt")),
            ..Default::default()
        })
        .unwrap();
    let err = untrusted.get("/v1/sessions").await.unwrap_err();
    assert!(
        matches!(err, leasehold::client::ClientError::Untrusted { .. }),
        "{err:?}"
    );
    assert!(err.to_string().contains(&url), "{err}");

    // https:// without a CA file, an unreadable CA file, and plain http:// to the TLS
    // port each get their own clear error.
    let bare = leasehold::client::Client::new(&url).unwrap();
    assert!(
        bare.get("/healthz")
            .await
            .unwrap_err()
            .to_string()
            .contains("CA file")
    );
    let missing =
        leasehold::client::Client::new(&url)
            .unwrap()
            .with_tls(&leasehold::client::TlsFiles {
                ca_file: Some(d.join("absent.pem")),
                ..Default::default()
            });
    assert!(
        missing.err().unwrap().to_string().contains("absent.pem"),
        "an unreadable CA file is named"
    );
    let plain = leasehold::client::Client::new(&s.url()).unwrap();
    let reply = plain.get("/healthz").await.unwrap();
    assert_eq!(reply.status, 400);
    assert_eq!(reply.body["error"], "tls_required");

    // The CLI: a client command and `leasehold run` with --ca-file.
    let out = leasehold()
        .args(["sessions", "list", "--server", &url])
        .arg("--ca-file")
        .arg(&cert)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(String::from_utf8_lossy(&out.stdout).contains("tls"));
    let out = leasehold()
        .args(["run", "--server", &url, "--lock", "tls-job", "--ttl", "5s"])
        .env("LEASEHOLD_CA_FILE", &cert)
        .args(["--", "sh", "-c", "test -n \"$LEASEHOLD_TOKEN\" && exit 7"])
        .output()
        .unwrap();
    assert_eq!(
        out.status.code(),
        Some(7),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    // An untrusted server is refused by the CLI with the reason, not a bare failure.
    let out = leasehold()
        .args(["sessions", "list", "--server", &url])
        .arg("--ca-file")
        .arg(d.join("s.crt"))
        .output()
        .unwrap();
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("not trusted"), "{stderr}");
}

// The CLI runs as a child process the test waits for: the server needs a thread of
// its own meanwhile.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_certificate_acts_through_the_cli() {
    let (m, _secrets) = mtls(
        &[("ops", Role::Operator, Some("worker.example"))],
        ClientAuth::Optional,
    )
    .await;
    let d = m.dir.path();
    let url = https_url(&m.s);
    let reap = |cert: Option<&str>| {
        let mut cmd = leasehold();
        cmd.args(["reap", "--dry-run", "--server", &url])
            .arg("--ca-file")
            .arg(d.join("tls.crt"))
            .env_remove("LEASEHOLD_API_TOKEN");
        if let Some(name) = cert {
            cmd.arg("--client-cert")
                .arg(d.join(format!("{name}.crt")))
                .env("LEASEHOLD_CLIENT_KEY", d.join(format!("{name}.key")));
        }
        cmd.output().unwrap()
    };
    // The mapped certificate acts as the operator token, with no bearer.
    let out = reap(Some("worker"));
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    // Without it, or with a certificate no token names, the call is refused.
    assert!(!reap(None).status.success());
    assert!(!reap(Some("stranger")).status.success());
}
