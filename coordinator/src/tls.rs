//! TLS for the coordinator's listener: rustls with the ring provider, certificate and key from
//! PEM files, and optional mutual TLS that admits only devices whose certificate chains to a
//! configured CA.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use rustls::server::WebPkiClientVerifier;

/// Where the listener's TLS material lives.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TlsConfig {
    /// PEM certificate chain, leaf first.
    pub cert: PathBuf,
    /// PEM private key of the leaf (PKCS#8, PKCS#1 or SEC1).
    pub key: PathBuf,
    /// PEM CA certificates; when set, devices must present a certificate chaining to one
    /// (mutual TLS): the fleet API refuses connections without one, and the handshake fails on
    /// one that does not chain. The admin API, dashboard and health checks stay reachable
    /// without a client certificate (they have their own credentials).
    pub client_ca: Option<PathBuf>,
}

/// Why TLS could not be set up.
#[derive(Debug, thiserror::Error)]
#[error("tls: {path}: {why}")]
pub struct TlsError {
    /// The file at fault (or the setting).
    pub path: String,
    /// What is wrong with it.
    pub why: String,
}

fn fail(path: &Path, why: impl ToString) -> TlsError {
    TlsError { path: path.display().to_string(), why: why.to_string() }
}

fn certificates(path: &Path) -> Result<Vec<CertificateDer<'static>>, TlsError> {
    let certs = CertificateDer::pem_file_iter(path)
        .map_err(|e| fail(path, e))?
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| fail(path, e))?;
    if certs.is_empty() {
        return Err(fail(path, "no PEM certificate in the file"));
    }
    Ok(certs)
}

/// The crypto provider every TLS object in this process uses.
pub fn provider() -> Arc<rustls::crypto::CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

/// A rustls server configuration from `config`, speaking HTTP/2 and HTTP/1.1.
pub fn server_config(config: &TlsConfig) -> Result<rustls::ServerConfig, TlsError> {
    let chain = certificates(&config.cert)?;
    let key = PrivateKeyDer::from_pem_file(&config.key).map_err(|e| fail(&config.key, e))?;
    let builder = rustls::ServerConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()
        .map_err(|e| fail(&config.cert, e))?;
    let builder = match &config.client_ca {
        None => builder.with_no_client_auth(),
        Some(ca) => {
            let mut roots = rustls::RootCertStore::empty();
            for cert in certificates(ca)? {
                roots.add(cert).map_err(|e| fail(ca, e))?;
            }
            // Clients without a certificate are admitted by the handshake and refused by the
            // fleet routes (see ClientCertAcceptor); a certificate that does not chain fails it.
            let verifier = WebPkiClientVerifier::builder_with_provider(Arc::new(roots), provider())
                .allow_unauthenticated()
                .build()
                .map_err(|e| fail(ca, e))?;
            builder.with_client_cert_verifier(verifier)
        }
    };
    let mut server = builder
        .with_single_cert(chain, key)
        .map_err(|e| fail(&config.key, format!("certificate and key do not make a pair: {e}")))?;
    server.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
    Ok(server)
}

/// What the TLS layer learned about a connection's client, for the handlers: whether it
/// presented a certificate that chains to the configured device CA.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ClientCertificate {
    /// A certificate was presented and verified during the handshake.
    pub verified: bool,
}

/// The rustls acceptor, plus a [`ClientCertificate`] extension on every request of the
/// connection. Under mutual TLS the handshake admits clients without a certificate (browsers,
/// operators, the health check) but rejects any certificate that does not chain to the CA; the
/// fleet routes then refuse requests whose connection had none.
#[derive(Clone)]
pub struct ClientCertAcceptor {
    inner: axum_server::tls_rustls::RustlsAcceptor,
}

impl ClientCertAcceptor {
    /// Wraps `inner`.
    pub fn new(inner: axum_server::tls_rustls::RustlsAcceptor) -> Self {
        ClientCertAcceptor { inner }
    }
}

impl<I, S> axum_server::accept::Accept<I, S> for ClientCertAcceptor
where
    I: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
    S: Send + 'static,
{
    type Stream = tokio_rustls::server::TlsStream<I>;
    type Service = axum::middleware::AddExtension<S, ClientCertificate>;
    type Future =
        futures_util::future::BoxFuture<'static, std::io::Result<(Self::Stream, Self::Service)>>;

    fn accept(&self, stream: I, service: S) -> Self::Future {
        let acceptor = self.inner.clone();
        Box::pin(async move {
            let (stream, service) = acceptor.accept(stream, service).await?;
            let verified = stream.get_ref().1.peer_certificates().is_some_and(|c| !c.is_empty());
            let service =
                tower::Layer::layer(&axum::Extension(ClientCertificate { verified }), service);
            Ok((stream, service))
        })
    }
}
