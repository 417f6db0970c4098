//! TLS for the node link: the coordinator's certificate is pinned by the
//! SHA-256 of its DER encoding (the fingerprint the coordinator prints).
//! Replicas of one coordinator usually share one certificate (one pin);
//! where they do not, the node is given the pin of each.
//!
//! # Invariants
//! - Only a certificate whose DER hashes to one of the pins is accepted;
//!   names, issuers and validity dates are not consulted (the pins are the
//!   trust). A pinned replica is trusted at any of the configured addresses
//!   (a name resolving to several replicas cannot say which is where).
//! - The handshake signatures are still verified with the ring provider's
//!   algorithms, so a peer must hold the pinned certificate's private key:
//!   replaying the certificate alone is not enough.
//! - TLS 1.3 only, ALPN `mlxnet/1`, the ring provider installed explicitly
//!   (no process-wide default is needed or set).
//!
//! # Failure
//! A malformed pin is [`LinkError::Config`] before anything is dialed. A
//! certificate that does not match fails the handshake with a message saying
//! the fingerprint did not match, naming both digests.

use std::{fmt, sync::Arc, time::Duration};

use rustls::{
    client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier},
    crypto::{
        verify_tls12_signature, verify_tls13_signature, CryptoProvider, WebPkiSupportedAlgorithms,
    },
    pki_types::{CertificateDer, ServerName, UnixTime},
    CertificateError, DigitallySignedStruct, OtherError, SignatureScheme,
};
use sha2::{Digest, Sha256};

use super::LinkError;
use crate::config::parse_fingerprint;

/// QUIC keep-alive from the node: keeps NAT mappings open and lets both
/// sides notice a dead peer within [`IDLE_TIMEOUT`].
pub const KEEP_ALIVE: Duration = Duration::from_secs(5);
/// A connection with no traffic (keep-alives included) for this long is dead.
pub const IDLE_TIMEOUT: Duration = Duration::from_secs(20);

/// A QUIC client config that trusts exactly the certificate whose DER has
/// SHA-256 `fingerprint_hex` (64 hex digits).
pub fn client_config(fingerprint_hex: &str) -> Result<quinn::ClientConfig, LinkError> {
    client_config_pinning(&[fingerprint_hex])
}

/// A QUIC client config that trusts exactly the certificates whose DER
/// has one of the SHA-256 `pins` (64 hex digits each; at least one).
pub fn client_config_pinning<S: AsRef<str>>(pins: &[S]) -> Result<quinn::ClientConfig, LinkError> {
    let pins = pins
        .iter()
        .map(|p| parse_fingerprint(p.as_ref()))
        .collect::<Result<Vec<_>, _>>()?;
    if pins.is_empty() {
        return Err(crate::config::ConfigError::MissingFingerprint.into());
    }
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let verifier = PinnedCert {
        pins,
        algorithms: provider.signature_verification_algorithms,
    };
    let mut tls = rustls::ClientConfig::builder_with_provider(provider.clone())
        .with_protocol_versions(&[&rustls::version::TLS13])
        .map_err(LinkError::Tls)?
        .dangerous()
        .with_custom_certificate_verifier(Arc::new(verifier))
        .with_no_client_auth();
    tls.alpn_protocols = vec![mlxnet_proto::auth::ALPN.to_vec()];
    let quic = quinn::crypto::rustls::QuicClientConfig::try_from(tls)
        .map_err(|e| LinkError::QuicTls(e.to_string()))?;
    let mut config = quinn::ClientConfig::new(Arc::new(quic));
    let mut transport = quinn::TransportConfig::default();
    transport.keep_alive_interval(Some(KEEP_ALIVE));
    transport.max_idle_timeout(Some(
        quinn::IdleTimeout::try_from(IDLE_TIMEOUT)
            .map_err(|e| LinkError::QuicTls(e.to_string()))?,
    ));
    config.transport_config(Arc::new(transport));
    Ok(config)
}

/// Lowercase hex SHA-256 of a certificate's DER: the pin format.
pub fn fingerprint(cert_der: &[u8]) -> String {
    hex::encode(Sha256::digest(cert_der))
}

/// Accepts only the pinned certificates; verifies handshake signatures normally.
struct PinnedCert {
    pins: Vec<[u8; 32]>,
    algorithms: WebPkiSupportedAlgorithms,
}

impl fmt::Debug for PinnedCert {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PinnedCert")
            .field(
                "pins",
                &self.pins.iter().map(hex::encode).collect::<Vec<_>>(),
            )
            .finish()
    }
}

/// The certificate presented is not the pinned one.
#[derive(thiserror::Error)]
#[error(
    "coordinator certificate fingerprint {got} does not match the pinned fingerprint {expected}"
)]
pub struct PinMismatch {
    pub expected: String,
    pub got: String,
}

/// rustls shows certificate errors with `Debug`; this makes that the
/// sentence a user can act on.
impl fmt::Debug for PinMismatch {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(self, f)
    }
}

impl ServerCertVerifier for PinnedCert {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        _intermediates: &[CertificateDer<'_>],
        _server_name: &ServerName<'_>,
        _ocsp_response: &[u8],
        _now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        let got: [u8; 32] = Sha256::digest(end_entity.as_ref()).into();
        if self.pins.contains(&got) {
            Ok(ServerCertVerified::assertion())
        } else {
            Err(rustls::Error::InvalidCertificate(CertificateError::Other(
                OtherError(Arc::new(PinMismatch {
                    expected: self
                        .pins
                        .iter()
                        .map(hex::encode)
                        .collect::<Vec<_>>()
                        .join(" or "),
                    got: hex::encode(got),
                })),
            )))
        }
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        verify_tls12_signature(message, cert, dss, &self.algorithms)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        verify_tls13_signature(message, cert, dss, &self.algorithms)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.algorithms.supported_schemes()
    }
}

/// The provider the node link uses, for servers in tests and tools.
pub fn provider() -> Arc<CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use std::net::{Ipv4Addr, SocketAddr};

    /// A QUIC server on 127.0.0.1:0 with a fresh self-signed certificate,
    /// speaking ALPN mlxnet/1. Returns the endpoint and the certificate's pin.
    pub(crate) fn test_server() -> (quinn::Endpoint, String) {
        let cert = rcgen::generate_simple_self_signed(vec!["localhost".into()]).unwrap();
        let der = cert.cert.der().clone();
        let pin = fingerprint(&der);
        let key = rustls::pki_types::PrivateKeyDer::Pkcs8(cert.key_pair.serialize_der().into());
        let mut tls = rustls::ServerConfig::builder_with_provider(provider())
            .with_protocol_versions(&[&rustls::version::TLS13])
            .unwrap()
            .with_no_client_auth()
            .with_single_cert(vec![der], key)
            .unwrap();
        tls.alpn_protocols = vec![mlxnet_proto::auth::ALPN.to_vec()];
        let quic = quinn::crypto::rustls::QuicServerConfig::try_from(tls).unwrap();
        let config = quinn::ServerConfig::with_crypto(Arc::new(quic));
        let endpoint =
            quinn::Endpoint::server(config, SocketAddr::from((Ipv4Addr::LOCALHOST, 0))).unwrap();
        (endpoint, pin)
    }

    async fn dial(
        server: &quinn::Endpoint,
        pin: &str,
    ) -> Result<quinn::Connection, quinn::ConnectionError> {
        let mut client =
            quinn::Endpoint::client(SocketAddr::from((Ipv4Addr::LOCALHOST, 0))).unwrap();
        client.set_default_client_config(client_config(pin).unwrap());
        client
            .connect(server.local_addr().unwrap(), "localhost")
            .unwrap()
            .await
    }

    #[tokio::test]
    async fn the_pinned_certificate_connects_and_another_is_refused_clearly() {
        let (server, pin) = test_server();
        let accept = {
            let server = server.clone();
            tokio::spawn(async move {
                // Accept both attempts; the second fails on the client side.
                let first = server.accept().await.unwrap().await;
                let second = server.accept().await.unwrap().await;
                (first.is_ok(), second.is_ok())
            })
        };

        let conn = dial(&server, &pin).await.expect("right pin connects");
        assert_eq!(
            conn.handshake_data()
                .unwrap()
                .downcast::<quinn::crypto::rustls::HandshakeData>()
                .unwrap()
                .protocol
                .as_deref(),
            Some(mlxnet_proto::auth::ALPN)
        );

        let (_other, other_pin) = test_server();
        let err = dial(&server, &other_pin)
            .await
            .expect_err("wrong pin must fail");
        let text = err.to_string();
        assert!(
            text.contains("does not match the pinned fingerprint"),
            "{text}"
        );
        assert!(text.contains(&other_pin), "{text}");
        let (first_ok, second_ok) = accept.await.unwrap();
        assert!(first_ok && !second_ok);
    }

    #[test]
    fn malformed_pins_are_refused_before_dialing() {
        for bad in ["", "abc", &"g".repeat(64), &"ab".repeat(33)] {
            assert!(
                matches!(client_config(bad), Err(LinkError::Config(_))),
                "{bad:?}"
            );
        }
    }
}
