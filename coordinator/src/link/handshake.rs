//! The coordinator's side of the node-link handshake (see node.proto):
//! the node opens the control stream with `Open`; we send a fresh 32-byte
//! `Challenge`; the node answers with a `Hello` whose signature covers
//! `auth::transcript(nonce, exporter)`, where `exporter` is keying material
//! exported from *this* TLS session. We verify it against the key the Hello
//! names, which is the node's id.
//!
//! # Invariants
//! - The nonce is fresh per connection (OS randomness), and the exporter is
//!   unique to the connection, so a proof made for one connection fails on
//!   any other, and a proof signed by any key but the named one fails.
//! - Nothing about the node is registered before the proof verifies.
//!
//! # Failure
//! [`HandshakeError`] says what was wrong; the caller sends it to the node as
//! `Rejected { reason }` and closes the connection. The caller bounds the
//! whole exchange with the handshake timeout.

use mlxnet_proto::{
    auth,
    frame::{read_frame, write_frame, FrameError},
    ids::{IdError, NodeId},
    v1::{coordinator_control, node_control, Challenge, CoordinatorControl, Hello, NodeControl},
};
use rand::RngCore;

use crate::{catalogue::Catalogue, domain::NodeRecord, util::clip};

/// At most the first `max` bytes of `b`.
fn clip_bytes(b: &[u8], max: usize) -> &[u8] {
    &b[..b.len().min(max)]
}

/// Why a node was not admitted.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum HandshakeError {
    #[error("the node did not open its control stream: {0}")]
    Connection(#[from] quinn::ConnectionError),
    #[error("control stream: {0}")]
    Frame(#[from] FrameError),
    #[error("expected {expected} on the control stream")]
    Protocol { expected: &'static str },
    #[error("invalid node id: {0}")]
    NodeId(#[from] IdError),
    #[error("signature must be 64 bytes, got {0}")]
    SignatureLength(usize),
    #[error("the proof does not verify against the node's key for this connection")]
    BadProof,
    #[error("TLS keying material is unavailable for this connection")]
    Exporter,
}

/// Points of a node's batch curve read from its Hello (the rest ignored).
const MAX_BATCH_POINTS: usize = 32;
/// The longest Hello string (name, chip, OS, ...) kept, in characters.
const MAX_HELLO_CHARS: usize = 64;
/// The most reported model files kept in the node's row (a node holds a
/// few; a Hello may list thousands).
const MAX_REPORTED_MODELS: usize = 64;

/// What a verified Hello tells us about the node.
#[derive(Clone, Debug)]
pub struct Registration {
    pub node_id: NodeId,
    pub name: String,
    /// Digests of the reported model files that are in the catalogue.
    pub models: Vec<[u8; 32]>,
    pub max_concurrent_jobs: u32,
    /// Its aggregate decode speed by concurrent streams (from the Hello's
    /// batch capacity; empty when not measured).
    pub batch: crate::scheduler::BatchCurve,
    pub memory_bytes: u64,
    pub free_memory_bytes: u64,
    /// Chip as reported ("Apple M3 Ultra"); the scheduler looks it up.
    pub chip: String,
    pub mode: crate::scheduler::Mode,
    /// Figures from `mlx-node bench` (0 in the Hello = not measured).
    pub measured: crate::scheduler::Measured,
    /// The row the store keeps for it.
    pub record: NodeRecord,
    /// What the World page shows of it (location already snapped).
    pub world: crate::world::NodeView,
    /// Ledger account the node says it earns for (empty: not said).
    pub operator_account: String,
    /// Lent full-time (`mode = "dedicated"`): earns availability rewards.
    pub dedicated: bool,
    /// Set when the node is a pod member.
    pub pod: Option<PodMembership>,
}

/// A pod member's report of its pod (see `PodInfo` in node.proto).
#[derive(Clone, Debug, PartialEq)]
pub struct PodMembership {
    pub name: String,
    pub rank: u32,
    /// Every member's id, by rank (empty when an id does not parse).
    pub members: Vec<NodeId>,
    /// Leader only: slowest link, one way, seconds.
    pub link_latency_s: f64,
    /// Leader only: slowest link, bytes/s.
    pub link_bandwidth: f64,
}

impl PodMembership {
    fn from_wire(p: &mlxnet_proto::v1::PodInfo) -> Self {
        let members: Result<Vec<NodeId>, _> =
            p.members.iter().map(|m| NodeId::from_bytes(m)).collect();
        PodMembership {
            name: p.name.chars().take(64).collect(),
            rank: p.rank,
            members: members.unwrap_or_default(),
            link_latency_s: p.link_latency_s,
            link_bandwidth: p.link_bandwidth,
        }
    }
}

/// A node that proved its key, with its control stream.
pub struct Admitted {
    pub registration: Registration,
    pub send: quinn::SendStream,
    pub recv: quinn::RecvStream,
}

/// Runs the handshake on a fresh connection. On error, `control` (if the
/// stream was opened) is returned so the caller can send `Rejected`.
pub async fn accept(
    conn: &quinn::Connection,
    catalogue: &Catalogue,
) -> Result<Admitted, (HandshakeError, Option<quinn::SendStream>)> {
    let (mut send, mut recv) = conn.accept_bi().await.map_err(|e| (e.into(), None))?;
    match run(conn, catalogue, &mut send, &mut recv).await {
        Ok(registration) => Ok(Admitted {
            registration,
            send,
            recv,
        }),
        Err(e) => Err((e, Some(send))),
    }
}

async fn run(
    conn: &quinn::Connection,
    catalogue: &Catalogue,
    send: &mut quinn::SendStream,
    recv: &mut quinn::RecvStream,
) -> Result<Registration, HandshakeError> {
    let open: NodeControl = read_frame(recv).await?;
    if !matches!(open.msg, Some(node_control::Msg::Open(_))) {
        return Err(HandshakeError::Protocol { expected: "Open" });
    }
    let mut nonce = [0u8; auth::NONCE_LEN];
    rand::rngs::OsRng.fill_bytes(&mut nonce);
    let challenge = CoordinatorControl {
        msg: Some(coordinator_control::Msg::Challenge(Challenge {
            nonce: nonce.to_vec(),
        })),
    };
    write_frame(send, &challenge).await?;
    let hello: NodeControl = read_frame(recv).await?;
    let Some(node_control::Msg::Hello(hello)) = hello.msg else {
        return Err(HandshakeError::Protocol { expected: "Hello" });
    };
    let mut exporter = [0u8; auth::EXPORTER_LEN];
    conn.export_keying_material(&mut exporter, auth::EXPORTER_LABEL, b"")
        .map_err(|_| HandshakeError::Exporter)?;
    let node_id = verify_proof(&hello, &nonce, &exporter)?;
    Ok(registration(node_id, &hello, catalogue))
}

/// Checks `hello`'s signature over the transcript of `nonce` and `exporter`
/// with the key it names; returns that key as the node id.
pub fn verify_proof(
    hello: &Hello,
    nonce: &[u8],
    exporter: &[u8],
) -> Result<NodeId, HandshakeError> {
    let node_id = NodeId::from_bytes(&hello.node_id)?;
    let sig: [u8; 64] = hello
        .signature
        .as_slice()
        .try_into()
        .map_err(|_| HandshakeError::SignatureLength(hello.signature.len()))?;
    node_id
        .verifying_key()?
        .verify_strict(
            &auth::transcript(nonce, exporter),
            &ed25519_dalek::Signature::from_bytes(&sig),
        )
        .map_err(|_| HandshakeError::BadProof)?;
    Ok(node_id)
}

fn registration(node_id: NodeId, hello: &Hello, catalogue: &Catalogue) -> Registration {
    let hw = hello.hardware.clone().unwrap_or_default();
    let mut models: Vec<[u8; 32]> = hello
        .models
        .iter()
        .filter_map(|m| <[u8; 32]>::try_from(m.sha256.as_slice()).ok())
        .filter(|digest| catalogue.models().iter().any(|c| &c.sha256 == digest))
        .collect();
    models.sort_unstable();
    models.dedup();
    // Every string is clipped and the model list capped before the row is
    // written: a Sybil's Hello (up to a 1 MiB frame) leaves a small row.
    let short = |s: &str| clip(s, MAX_HELLO_CHARS).to_owned();
    let hardware = serde_json::json!({
        "chip": short(&hw.chip),
        "os": short(&hw.os),
        "arch": short(&hw.arch),
        "cpu_cores": hw.cpu_cores,
        "performance_cores": hw.performance_cores,
        "gpu_cores": hw.gpu_cores,
        "memory_bytes": hw.memory_bytes,
        "memory_bandwidth_bytes_per_s": hw.memory_bandwidth_bytes_per_s,
        "thunderbolt5": hw.thunderbolt5,
        "measured_memory_bandwidth_bytes_per_s": hw.measured_memory_bandwidth_bytes_per_s,
        "measured_compute_flops": hw.measured_compute_flops,
        "model_name": short(&hw.model_name),
    });
    let reported: Vec<_> = hello
        .models
        .iter()
        .take(MAX_REPORTED_MODELS)
        .map(|m| {
            serde_json::json!({
                "model": short(&m.model),
                "sha256": hex::encode(clip_bytes(&m.sha256, 32)),
                "size_bytes": m.size_bytes,
            })
        })
        .collect();
    let name: String = hello.name.chars().take(64).collect();
    Registration {
        node_id,
        name: name.clone(),
        models,
        max_concurrent_jobs: hello.max_concurrent_jobs,
        batch: crate::scheduler::BatchCurve::new(
            hello
                .batch
                .iter()
                .flat_map(|b| b.throughput.iter().take(MAX_BATCH_POINTS))
                .map(|p| (p.streams, p.tokens_per_s)),
        ),
        memory_bytes: hw.memory_bytes,
        free_memory_bytes: hw.free_memory_bytes,
        chip: hw.chip.chars().take(64).collect(),
        mode: crate::scheduler::Mode::from_hello(&hello.mode),
        measured: crate::scheduler::Measured {
            memory_bandwidth: (hw.measured_memory_bandwidth_bytes_per_s > 0)
                .then_some(hw.measured_memory_bandwidth_bytes_per_s as f64),
            compute: (hw.measured_compute_flops > 0).then_some(hw.measured_compute_flops as f64),
            internet: None,
        },
        record: NodeRecord {
            id: node_id.to_string(),
            name,
            hardware: hardware.to_string(),
            models: serde_json::Value::Array(reported).to_string(),
            version: hello.version.chars().take(64).collect(),
            slots: hello.max_concurrent_jobs.max(1),
        },
        world: crate::world::NodeView::from_hello(node_id.to_string(), hello),
        operator_account: hello.operator_account.chars().take(64).collect(),
        dedicated: hello.mode == "dedicated",
        pod: hello.pod.as_ref().map(PodMembership::from_wire),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use ed25519_dalek::{Signer, SigningKey};
    use rand::{rngs::StdRng, SeedableRng};

    fn hello(key: &SigningKey, signer: &SigningKey, nonce: &[u8], exporter: &[u8]) -> Hello {
        Hello {
            node_id: key.verifying_key().to_bytes().to_vec(),
            signature: signer
                .sign(&auth::transcript(nonce, exporter))
                .to_bytes()
                .to_vec(),
            ..Default::default()
        }
    }

    #[test]
    fn proofs_verify_only_for_their_key_nonce_and_session() {
        let mut rng = StdRng::seed_from_u64(1);
        let key = SigningKey::generate(&mut rng);
        let other = SigningKey::generate(&mut rng);
        let (nonce, exporter) = ([1u8; 32], [2u8; 32]);
        let good = hello(&key, &key, &nonce, &exporter);
        assert_eq!(
            verify_proof(&good, &nonce, &exporter).unwrap(),
            NodeId::from_key(&key.verifying_key())
        );
        assert!(matches!(
            verify_proof(&good, &nonce, &[3; 32]),
            Err(HandshakeError::BadProof)
        ));
        assert!(matches!(
            verify_proof(&good, &[4; 32], &exporter),
            Err(HandshakeError::BadProof)
        ));
        let forged = hello(&key, &other, &nonce, &exporter);
        assert!(matches!(
            verify_proof(&forged, &nonce, &exporter),
            Err(HandshakeError::BadProof)
        ));
        let mut short = good.clone();
        short.signature.truncate(10);
        assert!(matches!(
            verify_proof(&short, &nonce, &exporter),
            Err(HandshakeError::SignatureLength(10))
        ));
        let mut bad_id = good;
        bad_id.node_id.truncate(5);
        assert!(matches!(
            verify_proof(&bad_id, &nonce, &exporter),
            Err(HandshakeError::NodeId(_))
        ));
    }
}
