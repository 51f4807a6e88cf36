//! TLS with rustls (ring provider): a certificate chain and a private key from PEM files,
//! loaded at start and again on SIGHUP. A reload swaps the configuration new handshakes
//! use; connections already established keep theirs, so none is dropped.

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
    #[error("tls_cert_file and tls_key_file do not make a usable TLS configuration: {0}")]
    Config(String),
}

/// The first byte of every TLS handshake record.
const HANDSHAKE: u8 = 0x16;

/// The answer to plain HTTP on the TLS port, in plain HTTP so the client can read it.
const TLS_REQUIRED: &[u8] = b"HTTP/1.1 400 Bad Request\r\ncontent-type: application/json\r\nconnection: close\r\ncontent-length: 65\r\n\r\n{\"error\":\"tls_required\",\"message\":\"this port speaks HTTPS (TLS)\"}";

pub struct Tls {
    cert: PathBuf,
    key: PathBuf,
    acceptor: RwLock<TlsAcceptor>,
}

fn acceptor(cert: &Path, key: &Path) -> Result<TlsAcceptor, TlsError> {
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
    let mut config = rustls::ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|e| TlsError::Config(e.to_string()))?
        .with_no_client_auth()
        .with_single_cert(chain, key_der)
        .map_err(|e| TlsError::Config(e.to_string()))?;
    config.alpn_protocols = vec![b"http/1.1".to_vec()];
    Ok(TlsAcceptor::from(Arc::new(config)))
}

impl Tls {
    pub fn load(cert: &Path, key: &Path) -> Result<Tls, TlsError> {
        Ok(Tls {
            cert: cert.to_path_buf(),
            key: key.to_path_buf(),
            acceptor: RwLock::new(acceptor(cert, key)?),
        })
    }

    /// Reads the certificate and key again. On an error the configuration in force stays.
    pub fn reload(&self) -> Result<(), TlsError> {
        let fresh = acceptor(&self.cert, &self.key)?;
        *self.acceptor.write() = fresh;
        Ok(())
    }

    /// The handshake, within `deadline`. Plain HTTP (a first byte that cannot start a TLS
    /// record) is answered `400 tls_required` in plain HTTP and closed.
    pub async fn accept(
        &self,
        mut stream: TcpStream,
        deadline: Duration,
        peer: SocketAddr,
    ) -> Option<TlsStream<TcpStream>> {
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
                Ok(s) => Some(s),
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
