//! Canonical bytes of a result claim and of a job's input, and claim
//! verification.
//!
//! A node signs [`canonical_bytes`] of its [`ResultClaim`] with its ed25519
//! key; the coordinator and any client verify with [`verify`]. The encoding is
//! defined here, by hand, once: a domain tag, then every field in a fixed
//! order, integers little-endian, strings and byte strings prefixed by their
//! u32 length, lists by their u32 count. It never depends on protobuf encoding
//! details, so any implementation can reproduce it.
//!
//! # Invariants
//! - Every field of the claim is covered: changing any field changes the bytes.
//! - The job input's digest ([`input_digest`]) binds a claim to the exact
//!   prompt or chat messages the client submitted.
//!
//! # Failure
//! [`verify`] returns [`ClaimError`] saying which check failed.

use ed25519_dalek::{Signature, Signer, SigningKey, Verifier};
use sha2::{Digest, Sha256};

use crate::{
    ids::{IdError, NodeId},
    v1::{job_input, JobInput, ResultClaim, SignedClaim},
};

const CLAIM_DOMAIN: &[u8] = b"mlxnet/claim/v1\0";
const INPUT_DOMAIN: &[u8] = b"mlxnet/input/v1\0";
const RESUME_DOMAIN: &[u8] = b"mlxnet/resume/v1\0";

/// `finish_reason` of a partial claim: a draining node stopped here and the
/// job resumes elsewhere.
pub const FINISH_HANDOFF: &str = "handoff";

/// Why a signed claim is not acceptable.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[non_exhaustive]
pub enum ClaimError {
    #[error("signed result has no claim")]
    Missing,
    #[error("claim names an invalid node id: {0}")]
    NodeId(#[from] IdError),
    #[error("signature must be 64 bytes, got {0}")]
    SignatureLength(usize),
    #[error("signature does not verify against the claim's node key")]
    BadSignature,
}

/// The bytes a node signs for `claim`.
pub fn canonical_bytes(claim: &ResultClaim) -> Vec<u8> {
    let mut out = Vec::with_capacity(
        CLAIM_DOMAIN.len() + 256 + claim.output_text.len() + 4 * claim.output_token_ids.len(),
    );
    out.extend_from_slice(CLAIM_DOMAIN);
    put_bytes(&mut out, claim.job_id.as_bytes());
    out.extend_from_slice(&claim.attempt.to_le_bytes());
    put_bytes(&mut out, &claim.model_sha256);
    put_bytes(&mut out, &claim.prompt_sha256);
    out.extend_from_slice(&(claim.output_token_ids.len() as u32).to_le_bytes());
    for id in &claim.output_token_ids {
        out.extend_from_slice(&id.to_le_bytes());
    }
    put_bytes(&mut out, claim.output_text.as_bytes());
    out.extend_from_slice(&claim.prompt_tokens.to_le_bytes());
    out.extend_from_slice(&claim.completion_tokens.to_le_bytes());
    out.extend_from_slice(&claim.prefill_micros.to_le_bytes());
    out.extend_from_slice(&claim.decode_micros.to_le_bytes());
    put_bytes(&mut out, &claim.node_id);
    put_bytes(&mut out, claim.finish_reason.as_bytes());
    out
}

/// Signs `claim` with `key`. The claim's `node_id` must already be the key's
/// public key for the result to verify.
pub fn sign(claim: ResultClaim, key: &SigningKey) -> SignedClaim {
    let signature = key.sign(&canonical_bytes(&claim)).to_bytes().to_vec();
    SignedClaim {
        claim: Some(claim),
        signature,
    }
}

/// Checks that `signed` carries a claim signed by the node the claim names.
/// Returns that node's id.
pub fn verify(signed: &SignedClaim) -> Result<NodeId, ClaimError> {
    let claim = signed.claim.as_ref().ok_or(ClaimError::Missing)?;
    let node = NodeId::from_bytes(&claim.node_id)?;
    let sig: [u8; 64] = signed
        .signature
        .as_slice()
        .try_into()
        .map_err(|_| ClaimError::SignatureLength(signed.signature.len()))?;
    node.verifying_key()?
        .verify(&canonical_bytes(claim), &Signature::from_bytes(&sig))
        .map_err(|_| ClaimError::BadSignature)?;
    Ok(node)
}

/// SHA-256 over the canonical bytes of a job's input (prompt or chat
/// messages). An absent input hashes as an empty prompt.
pub fn input_digest(input: &JobInput) -> [u8; 32] {
    let mut h = Sha256::new();
    h.update(INPUT_DOMAIN);
    match &input.kind {
        None => {
            h.update([0u8]);
            h.update(0u32.to_le_bytes());
        }
        Some(job_input::Kind::Prompt(p)) => {
            h.update([0u8]);
            hash_bytes(&mut h, p.as_bytes());
        }
        Some(job_input::Kind::Chat(chat)) => {
            h.update([1u8]);
            h.update((chat.messages.len() as u32).to_le_bytes());
            for m in &chat.messages {
                hash_bytes(&mut h, m.role.as_bytes());
                hash_bytes(&mut h, m.content.as_bytes());
            }
        }
    }
    h.finalize().into()
}

/// What a resumed attempt's claim binds as its prompt: the job's input
/// followed by the tokens earlier attempts produced. Without resumed tokens
/// it is [`input_digest`], so a fresh attempt's claim is unchanged.
pub fn resumed_input_digest(input: &JobInput, resumed: &[u32]) -> [u8; 32] {
    if resumed.is_empty() {
        return input_digest(input);
    }
    let mut h = Sha256::new();
    h.update(RESUME_DOMAIN);
    h.update(input_digest(input));
    h.update((resumed.len() as u32).to_le_bytes());
    for t in resumed {
        h.update(t.to_le_bytes());
    }
    h.finalize().into()
}

fn put_bytes(out: &mut Vec<u8>, b: &[u8]) {
    out.extend_from_slice(&(b.len() as u32).to_le_bytes());
    out.extend_from_slice(b);
}

fn hash_bytes(h: &mut Sha256, b: &[u8]) {
    h.update((b.len() as u32).to_le_bytes());
    h.update(b);
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::v1::{ChatMessage, ChatMessages};

    #[test]
    fn a_resumed_digest_binds_the_resumed_tokens_and_is_the_input_digest_without_them() {
        let input = JobInput {
            kind: Some(job_input::Kind::Prompt("Hello".into())),
        };
        assert_eq!(resumed_input_digest(&input, &[]), input_digest(&input));
        let a = resumed_input_digest(&input, &[1, 2]);
        assert_ne!(a, input_digest(&input));
        assert_ne!(a, resumed_input_digest(&input, &[1, 3]));
        assert_ne!(a, resumed_input_digest(&input, &[1, 2, 0]));
    }

    fn sample(key: &SigningKey) -> ResultClaim {
        ResultClaim {
            job_id: "0193a1b2-0000-7000-8000-000000000001".into(),
            attempt: 1,
            model_sha256: vec![7; 32],
            prompt_sha256: vec![9; 32],
            output_token_ids: vec![1, 2, 3],
            output_text: "Paris".into(),
            prompt_tokens: 12,
            completion_tokens: 3,
            prefill_micros: 1000,
            decode_micros: 2000,
            node_id: key.verifying_key().to_bytes().to_vec(),
            finish_reason: "eos".into(),
        }
    }

    #[test]
    fn a_signed_claim_verifies_and_names_its_node() {
        let key = SigningKey::generate(&mut rand::rngs::OsRng);
        let signed = sign(sample(&key), &key);
        assert_eq!(
            verify(&signed).unwrap(),
            NodeId::from_key(&key.verifying_key())
        );
    }

    #[test]
    fn tampering_with_any_field_breaks_the_signature() {
        let key = SigningKey::generate(&mut rand::rngs::OsRng);
        let good = sign(sample(&key), &key);
        let edits: Vec<fn(&mut ResultClaim)> = vec![
            |c| c.job_id.push('x'),
            |c| c.attempt += 1,
            |c| c.model_sha256[0] ^= 1,
            |c| c.prompt_sha256[0] ^= 1,
            |c| c.output_token_ids[0] += 1,
            |c| c.output_token_ids.push(4),
            |c| c.output_text.push('!'),
            |c| c.prompt_tokens += 1,
            |c| c.completion_tokens += 1,
            |c| c.prefill_micros += 1,
            |c| c.decode_micros += 1,
            |c| c.finish_reason = "length".into(),
        ];
        for (i, edit) in edits.iter().enumerate() {
            let mut bad = good.clone();
            edit(bad.claim.as_mut().unwrap());
            assert_eq!(verify(&bad), Err(ClaimError::BadSignature), "edit {i}");
        }
    }

    #[test]
    fn a_claim_signed_by_another_key_is_refused() {
        let key = SigningKey::generate(&mut rand::rngs::OsRng);
        let other = SigningKey::generate(&mut rand::rngs::OsRng);
        // Names `key` as the node but is signed by `other`.
        let forged = sign(sample(&key), &other);
        assert_eq!(verify(&forged), Err(ClaimError::BadSignature));
        let mut short = sign(sample(&key), &key);
        short.signature.truncate(10);
        assert_eq!(verify(&short), Err(ClaimError::SignatureLength(10)));
    }

    #[test]
    fn input_digest_separates_prompt_and_chat_and_field_boundaries() {
        let prompt = |p: &str| JobInput {
            kind: Some(job_input::Kind::Prompt(p.into())),
        };
        let chat = |msgs: &[(&str, &str)]| JobInput {
            kind: Some(job_input::Kind::Chat(ChatMessages {
                messages: msgs
                    .iter()
                    .map(|(r, c)| ChatMessage {
                        role: (*r).into(),
                        content: (*c).into(),
                    })
                    .collect(),
            })),
        };
        assert_eq!(input_digest(&prompt("hi")), input_digest(&prompt("hi")));
        assert_ne!(input_digest(&prompt("hi")), input_digest(&prompt("hi ")));
        assert_ne!(
            input_digest(&chat(&[("user", "ab")])),
            input_digest(&chat(&[("usera", "b")]))
        );
        assert_ne!(
            input_digest(&prompt("user")),
            input_digest(&chat(&[("user", "")]))
        );
    }
}
