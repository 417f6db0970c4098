//! The node-link handshake, bound to the TLS session.
//!
//! The coordinator sends a fresh random nonce; the node signs
//! [`transcript`]`(nonce, exporter)`, where `exporter` is TLS keying material
//! exported from *this* QUIC connection with [`EXPORTER_LABEL`]. Both ends
//! compute the same exporter value; no other connection can, so a proof
//! captured on one connection is useless on any other.

/// ALPN protocol id of the node link.
pub const ALPN: &[u8] = b"mlxnet/1";
/// Label for the TLS keying-material exporter (RFC 5705 / RFC 8446 7.5).
pub const EXPORTER_LABEL: &[u8] = b"EXPORTER-mlxnet-node-auth";
/// Bytes of exported keying material.
pub const EXPORTER_LEN: usize = 32;
/// Bytes of the coordinator's nonce.
pub const NONCE_LEN: usize = 32;

const DOMAIN: &[u8] = b"mlxnet/node-auth/v1\0";

/// The bytes a node signs to prove its key on one connection.
pub fn transcript(nonce: &[u8], exporter: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(DOMAIN.len() + 8 + nonce.len() + exporter.len());
    out.extend_from_slice(DOMAIN);
    out.extend_from_slice(&(nonce.len() as u32).to_le_bytes());
    out.extend_from_slice(nonce);
    out.extend_from_slice(&(exporter.len() as u32).to_le_bytes());
    out.extend_from_slice(exporter);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn transcripts_differ_per_nonce_and_per_session() {
        let a = transcript(&[1; 32], &[2; 32]);
        assert_ne!(a, transcript(&[1; 32], &[3; 32]));
        assert_ne!(a, transcript(&[4; 32], &[2; 32]));
        assert_eq!(a, transcript(&[1; 32], &[2; 32]));
    }
}
