//! The node link's TLS identity: a self-signed certificate created on first
//! start in the data directory and reused after, pinned by nodes through its
//! SHA-256 fingerprint.
//!
//! # Invariants
//! - `key.der` is written with mode 0600 (created that way, never widened).
//! - The fingerprint is the lowercase hex SHA-256 of the certificate's DER,
//!   exactly what a node pins.
//! - Only TLS 1.3 with the ring provider (installed explicitly, never taken
//!   from process defaults) and ALPN `mlxnet/1`.
//!
//! # Failure
//! [`TlsError`]: the files cannot be read or written, or do not hold a usable
//! certificate and key (delete both to get a fresh pair).

use std::{
    io::Write,
    path::{Path, PathBuf},
    sync::Arc,
};

use mlxnet_proto::auth::ALPN;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, PrivatePkcs8KeyDer};
use sha2::{Digest, Sha256};

/// The certificate's file in the data directory (DER).
pub const CERT_FILE: &str = "cert.der";
/// The private key's file in the data directory (PKCS#8 DER, mode 0600).
pub const KEY_FILE: &str = "key.der";

/// Why the certificate could not be loaded or created.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum TlsError {
    #[error("reading or writing {path}")]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{cert} exists without {key} (or the reverse): delete both to regenerate")]
    HalfPair { cert: PathBuf, key: PathBuf },
    #[error("generating the certificate")]
    Generate(#[from] rcgen::Error),
    #[error("the certificate or key is unusable")]
    Rustls(#[from] rustls::Error),
    #[error("QUIC needs TLS 1.3 with an AES-128-GCM suite")]
    Quic(#[from] quinn::crypto::rustls::NoInitialCipherSuite),
}

/// The coordinator's certificate and key.
pub struct Identity {
    pub cert: CertificateDer<'static>,
    key: PrivatePkcs8KeyDer<'static>,
}

impl std::fmt::Debug for Identity {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Identity")
            .field("fingerprint", &self.fingerprint())
            .field("key", &"<redacted>")
            .finish()
    }
}

impl Identity {
    /// Loads `cert.der` and `key.der` from `dir`, creating them on first start.
    pub fn load_or_create(dir: &Path) -> Result<Self, TlsError> {
        let cert_path = dir.join(CERT_FILE);
        let key_path = dir.join(KEY_FILE);
        let io = |path: &Path| {
            let path = path.to_path_buf();
            move |source| TlsError::Io { path, source }
        };
        match (cert_path.exists(), key_path.exists()) {
            (true, true) => {
                let cert = std::fs::read(&cert_path).map_err(io(&cert_path))?;
                let key = std::fs::read(&key_path).map_err(io(&key_path))?;
                Ok(Self {
                    cert: CertificateDer::from(cert),
                    key: PrivatePkcs8KeyDer::from(key),
                })
            }
            (false, false) => {
                let certified = rcgen::generate_simple_self_signed(vec![
                    "localhost".to_owned(),
                    "mlxnet-coordinator".to_owned(),
                ])?;
                let cert = certified.cert.der().to_vec();
                let key = certified.key_pair.serialize_der();
                write_private(&key_path, &key).map_err(io(&key_path))?;
                std::fs::write(&cert_path, &cert).map_err(io(&cert_path))?;
                Ok(Self {
                    cert: CertificateDer::from(cert),
                    key: PrivatePkcs8KeyDer::from(key),
                })
            }
            _ => Err(TlsError::HalfPair {
                cert: cert_path,
                key: key_path,
            }),
        }
    }

    /// Lowercase hex SHA-256 of the certificate DER.
    pub fn fingerprint(&self) -> String {
        fingerprint(&self.cert)
    }

    /// The QUIC server config: TLS 1.3, ring, ALPN `mlxnet/1`, nodes may open
    /// only their control stream. Abuse limits: a connection silent for
    /// `idle_timeout` is closed (nodes heartbeat far more often); at most
    /// `max_connections` connections in their handshake; a stream may have
    /// [`STREAM_WINDOW`] and a connection [`CONNECTION_WINDOW`] unread bytes
    /// in flight, so a node cannot make the coordinator buffer more (frames
    /// are capped at [`mlxnet_proto::frame::MAX_FRAME_LEN`] before allocation).
    pub fn server_config(
        &self,
        idle_timeout: std::time::Duration,
        max_connections: usize,
    ) -> Result<quinn::ServerConfig, TlsError> {
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let mut tls = rustls::ServerConfig::builder_with_provider(provider)
            .with_protocol_versions(&[&rustls::version::TLS13])?
            .with_no_client_auth()
            .with_single_cert(
                vec![self.cert.clone()],
                PrivateKeyDer::Pkcs8(self.key.clone_key()),
            )?;
        tls.alpn_protocols = vec![ALPN.to_vec()];
        tls.max_early_data_size = 0;
        let crypto = quinn::crypto::rustls::QuicServerConfig::try_from(tls)?;
        let mut config = quinn::ServerConfig::with_crypto(Arc::new(crypto));
        let mut transport = quinn::TransportConfig::default();
        transport
            .max_concurrent_bidi_streams(1u8.into())
            .max_concurrent_uni_streams(0u8.into())
            .max_idle_timeout(quinn::IdleTimeout::try_from(idle_timeout).ok())
            .stream_receive_window(quinn::VarInt::from_u32(STREAM_WINDOW))
            .receive_window(quinn::VarInt::from_u32(CONNECTION_WINDOW));
        config.transport_config(Arc::new(transport));
        config.max_incoming(max_connections.max(1));
        Ok(config)
    }
}

/// Unread bytes a node may have in flight on one stream: two largest frames.
pub const STREAM_WINDOW: u32 = 2 * mlxnet_proto::frame::MAX_FRAME_LEN as u32 + 8;
/// Unread bytes a node may have in flight on one connection.
pub const CONNECTION_WINDOW: u32 = 4 * STREAM_WINDOW;

/// Lowercase hex SHA-256 of `cert`.
pub fn fingerprint(cert: &CertificateDer<'_>) -> String {
    hex::encode(Sha256::digest(cert.as_ref()))
}

fn write_private(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    let mut options = std::fs::OpenOptions::new();
    options.write(true).create_new(true);
    #[cfg(unix)]
    {
        use std::os::unix::fs::OpenOptionsExt;
        options.mode(0o600);
    }
    let mut file = options.open(path)?;
    file.write_all(bytes)?;
    file.sync_all()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn created_once_then_reused_with_a_private_key_file() {
        let dir = tempfile::tempdir().unwrap();
        let first = Identity::load_or_create(dir.path()).unwrap();
        let again = Identity::load_or_create(dir.path()).unwrap();
        assert_eq!(first.fingerprint(), again.fingerprint());
        assert_eq!(first.fingerprint().len(), 64);
        assert!(!format!("{first:?}").contains(&hex::encode(first.key.secret_pkcs8_der())));
        #[cfg(unix)]
        {
            use std::os::unix::fs::PermissionsExt;
            let mode = std::fs::metadata(dir.path().join(KEY_FILE))
                .unwrap()
                .permissions()
                .mode();
            assert_eq!(mode & 0o777, 0o600);
        }
        first
            .server_config(std::time::Duration::from_secs(30), 16)
            .unwrap();

        std::fs::remove_file(dir.path().join(KEY_FILE)).unwrap();
        assert!(matches!(
            Identity::load_or_create(dir.path()),
            Err(TlsError::HalfPair { .. })
        ));
    }
}
