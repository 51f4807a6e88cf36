//! TLS: a handshake and a request over it, a certificate reload (as on SIGHUP) that new
//! connections see while an established one keeps serving, and plain HTTP on the TLS port
//! refused with an answer the client can read. Certificates are made with the `openssl`
//! command. Embedded backend only: TLS is the server's, in front of every backend.
mod common;

use std::path::Path;
use std::process::Command;
use std::sync::Arc;
use std::time::Duration;

use common::*;
use http_body_util::{BodyExt, Empty};
use hyper::body::Bytes;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, ServerName};
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
