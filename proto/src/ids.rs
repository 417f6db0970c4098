//! Identifiers shared by the coordinator, nodes and clients.
//!
//! A node's id *is* its ed25519 public key (32 bytes), shown as lowercase hex.
//! A job id is a UUIDv7 (time-ordered), shown in its hyphenated form.
//!
//! # Failure
//! Parsing returns [`IdError`] naming what was wrong; nothing panics.

use std::{fmt, str::FromStr};

use ed25519_dalek::VerifyingKey;

/// Why a string or byte slice is not an id.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[non_exhaustive]
pub enum IdError {
    #[error("node id must be 32 bytes, got {0}")]
    NodeIdLength(usize),
    #[error("node id is not lowercase hex: {0}")]
    NodeIdHex(String),
    #[error("node id is not a valid ed25519 public key")]
    NodeIdKey,
    #[error("job id is not a UUID: {0}")]
    JobId(String),
}

/// A node's identity: its ed25519 public key.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct NodeId([u8; 32]);

impl NodeId {
    /// The id of a public key.
    pub fn from_key(key: &VerifyingKey) -> Self {
        Self(key.to_bytes())
    }

    /// An id from the 32 raw bytes on the wire; checks they are a valid key.
    pub fn from_bytes(bytes: &[u8]) -> Result<Self, IdError> {
        let arr: [u8; 32] = bytes
            .try_into()
            .map_err(|_| IdError::NodeIdLength(bytes.len()))?;
        VerifyingKey::from_bytes(&arr).map_err(|_| IdError::NodeIdKey)?;
        Ok(Self(arr))
    }

    pub fn as_bytes(&self) -> &[u8; 32] {
        &self.0
    }

    /// The public key this id names.
    pub fn verifying_key(&self) -> Result<VerifyingKey, IdError> {
        VerifyingKey::from_bytes(&self.0).map_err(|_| IdError::NodeIdKey)
    }

    /// First 8 hex digits, for logs.
    pub fn short(&self) -> String {
        hex::encode(&self.0[..4])
    }
}

impl fmt::Display for NodeId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&hex::encode(self.0))
    }
}

impl fmt::Debug for NodeId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "NodeId({})", self.short())
    }
}

impl FromStr for NodeId {
    type Err = IdError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let bytes = hex::decode(s).map_err(|_| IdError::NodeIdHex(truncate(s)))?;
        Self::from_bytes(&bytes)
    }
}

/// A job's id.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct JobId(uuid::Uuid);

impl JobId {
    /// A fresh, time-ordered id.
    pub fn new() -> Self {
        Self(uuid::Uuid::now_v7())
    }
}

impl Default for JobId {
    fn default() -> Self {
        Self::new()
    }
}

impl fmt::Display for JobId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.hyphenated().fmt(f)
    }
}

impl fmt::Debug for JobId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "JobId({self})")
    }
}

impl FromStr for JobId {
    type Err = IdError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        uuid::Uuid::parse_str(s)
            .map(Self)
            .map_err(|_| IdError::JobId(truncate(s)))
    }
}

fn truncate(s: &str) -> String {
    s.chars().take(80).collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use ed25519_dalek::SigningKey;

    #[test]
    fn node_id_round_trips_through_hex() {
        let key = SigningKey::generate(&mut rand::rngs::OsRng);
        let id = NodeId::from_key(&key.verifying_key());
        let text = id.to_string();
        assert_eq!(text.len(), 64);
        assert_eq!(text.parse::<NodeId>().unwrap(), id);
    }

    #[test]
    fn bad_node_ids_are_refused() {
        assert_eq!(NodeId::from_bytes(&[1; 31]), Err(IdError::NodeIdLength(31)));
        assert!(matches!("zz".parse::<NodeId>(), Err(IdError::NodeIdHex(_))));
    }

    #[test]
    fn job_ids_parse_and_refuse_garbage() {
        let id = JobId::new();
        assert_eq!(id.to_string().parse::<JobId>().unwrap(), id);
        assert!(matches!(
            "not-a-job".parse::<JobId>(),
            Err(IdError::JobId(_))
        ));
    }
}
