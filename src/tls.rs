//! TLS with rustls (ring provider): a certificate chain and a private key from PEM files,
//! loaded at start and again on SIGHUP. A reload swaps the configuration new handshakes
//! use; connections already established keep theirs, so none is dropped.
//!
//! With `tls_client_ca`, client certificates are verified against those CAs in the
//! handshake (rustls's WebPKI verifier: chain, validity dates, client-auth usage). The DNS
//! names of a verified certificate's subjectAltName are what a token's `cert_subject`
//! matches; the subject's common name is never used, as it is not a checked name.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use parking_lot::RwLock;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use tokio::io::AsyncWriteExt;
use tokio::net::TcpStream;
use tokio_rustls::TlsAcceptor;
use tokio_rustls::server::TlsStream;

#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    #[error("tls_cert_file {path}: {message}")]
    Cert { path: PathBuf, message: String },
    #[error("tls_key_file {path}: {message}")]
    Key { path: PathBuf, message: String },
    #[error("tls_client_ca {path}: {message}")]
    ClientCa { path: PathBuf, message: String },
    #[error("tls_cert_file and tls_key_file do not make a usable TLS configuration: {0}")]
    Config(String),
}

/// The first byte of every TLS handshake record.
const HANDSHAKE: u8 = 0x16;

/// The answer to plain HTTP on the TLS port, in plain HTTP so the client can read it.
const TLS_REQUIRED: &[u8] = b"HTTP/1.1 400 Bad Request\r\ncontent-type: application/json\r\nconnection: close\r\ncontent-length: 65\r\n\r\n{\"error\":\"tls_required\",\"message\":\"this port speaks HTTPS (TLS)\"}";

/// The names a verified client certificate stands for: the DNS names of its
/// subjectAltName, lowercased.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClientCert {
    pub names: Vec<String>,
}

impl ClientCert {
    fn of(conn: &rustls::ServerConnection) -> Option<ClientCert> {
        // rustls hands out peer certificates only after the verifier accepted them.
        let end_entity = conn.peer_certificates()?.first()?;
        let cert = webpki::EndEntityCert::try_from(end_entity).ok()?;
        let names = cert
            .valid_dns_names()
            .map(|n| n.to_ascii_lowercase())
            .collect();
        Some(ClientCert { names })
    }
}

/// Where client certificates are verified, and whether one is required.
#[derive(Debug, Clone)]
pub struct ClientCa {
    pub path: PathBuf,
    pub required: bool,
}

pub struct Tls {
    cert: PathBuf,
    key: PathBuf,
    client_ca: Option<ClientCa>,
    acceptor: RwLock<TlsAcceptor>,
}

fn client_verifier(
    ca: &ClientCa,
    provider: Arc<rustls::crypto::CryptoProvider>,
) -> Result<Arc<dyn rustls::server::danger::ClientCertVerifier>, TlsError> {
    let err = |message: String| TlsError::ClientCa {
        path: ca.path.clone(),
        message,
    };
    let certs = CertificateDer::pem_file_iter(&ca.path)
        .and_then(|it| it.collect::<Result<Vec<_>, _>>())
        .map_err(|e| err(e.to_string()))?;
    if certs.is_empty() {
        return Err(err("no PEM certificate in the file".into()));
    }
    let mut roots = rustls::RootCertStore::empty();
    for c in certs {
        roots.add(c).map_err(|e| err(e.to_string()))?;
    }
    let builder =
        rustls::server::WebPkiClientVerifier::builder_with_provider(Arc::new(roots), provider);
    let builder = if ca.required {
        builder
    } else {
        builder.allow_unauthenticated()
    };
    builder.build().map_err(|e| err(e.to_string()))
}

fn acceptor(
    cert: &Path,
    key: &Path,
    client_ca: Option<&ClientCa>,
) -> Result<TlsAcceptor, TlsError> {
    let chain = CertificateDer::pem_file_iter(cert)
        .and_then(|it| it.collect::<Result<Vec<_>, _>>())
        .map_err(|e| TlsError::Cert {
            path: cert.to_path_buf(),
            message: e.to_string(),
        })?;
    if chain.is_empty() {
        return Err(TlsError::Cert {
            path: cert.to_path_buf(),
            message: "no PEM certificate in the file".into(),
        });
    }
    let key_der = PrivateKeyDer::from_pem_file(key).map_err(|e| TlsError::Key {
        path: key.to_path_buf(),
        message: e.to_string(),
    })?;
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let builder = rustls::ServerConfig::builder_with_provider(provider.clone())
        .with_safe_default_protocol_versions()
        .map_err(|e| TlsError::Config(e.to_string()))?;
    let builder = match client_ca {
        None => builder.with_no_client_auth(),
        Some(ca) => builder.with_client_cert_verifier(client_verifier(ca, provider)?),
    };
    let mut config = builder
        .with_single_cert(chain, key_der)
        .map_err(|e| TlsError::Config(e.to_string()))?;
    config.alpn_protocols = vec![b"http/1.1".to_vec()];
    Ok(TlsAcceptor::from(Arc::new(config)))
}

impl Tls {
    pub fn load(cert: &Path, key: &Path, client_ca: Option<ClientCa>) -> Result<Tls, TlsError> {
        Ok(Tls {
            cert: cert.to_path_buf(),
            key: key.to_path_buf(),
            acceptor: RwLock::new(acceptor(cert, key, client_ca.as_ref())?),
            client_ca,
        })
    }

    /// Reads the certificate, key and client CAs again. On an error the configuration in
    /// force stays.
    pub fn reload(&self) -> Result<(), TlsError> {
        let fresh = acceptor(&self.cert, &self.key, self.client_ca.as_ref())?;
        *self.acceptor.write() = fresh;
        Ok(())
    }

    /// The handshake, within `deadline`. Plain HTTP (a first byte that cannot start a TLS
    /// record) is answered `400 tls_required` in plain HTTP and closed. With the stream
    /// comes the verified client certificate, if the client presented one.
    pub async fn accept(
        &self,
        mut stream: TcpStream,
        deadline: Duration,
        peer: SocketAddr,
    ) -> Option<(TlsStream<TcpStream>, Option<ClientCert>)> {
        let acceptor = self.acceptor.read().clone();
        let handshake = async {
            let mut first = [0u8; 1];
            match stream.peek(&mut first).await {
                Ok(1) if first[0] == HANDSHAKE => {}
                Ok(1) => {
                    let _ = stream.write_all(TLS_REQUIRED).await;
                    let _ = stream.shutdown().await;
                    tracing::debug!(%peer, "plain HTTP on the TLS port refused");
                    return None;
                }
                _ => return None,
            }
            match acceptor.accept(stream).await {
                Ok(s) => {
                    let client = ClientCert::of(s.get_ref().1);
                    Some((s, client))
                }
                Err(e) => {
                    tracing::debug!(%peer, error = %e, "TLS handshake failed");
                    None
                }
            }
        };
        tokio::time::timeout(deadline, handshake)
            .await
            .unwrap_or_else(|_| {
                tracing::debug!(%peer, "TLS handshake not finished within the header read timeout");
                None
            })
    }
}
