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
//! An auditor's verdict on a claim ([`verdict_bytes`], [`sign_verdict`],
//! [`verify_verdict`]) is encoded and signed the same way, under its own
//! domain tag, and names the claim by its signature.
//!
//! # Failure
//! [`verify`] returns [`ClaimError`] saying which check failed.

use ed25519_dalek::{Signature, Signer, SigningKey, Verifier};
use sha2::{Digest, Sha256};

use crate::{
    ids::{IdError, NodeId},
    v1::{job_input, AuditVerdict, JobInput, ResultClaim, SignedClaim, SignedVerdict},
};

const CLAIM_DOMAIN: &[u8] = b"mlxnet/claim/v1\0";
const INPUT_DOMAIN: &[u8] = b"mlxnet/input/v1\0";
const RESUME_DOMAIN: &[u8] = b"mlxnet/resume/v1\0";

/// `finish_reason` of a partial claim: a draining node stopped here and the
/// job resumes elsewhere.
pub const FINISH_HANDOFF: &str = "handoff";
const VERDICT_DOMAIN: &[u8] = b"mlxnet/verdict/v1\0";

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
    check_signature(&claim.node_id, &canonical_bytes(claim), &signed.signature)
}

/// Checks that `signature` over `bytes` was made by the key `signer` names.
fn check_signature(signer: &[u8], bytes: &[u8], signature: &[u8]) -> Result<NodeId, ClaimError> {
    let node = NodeId::from_bytes(signer)?;
    let sig: [u8; 64] = signature
        .try_into()
        .map_err(|_| ClaimError::SignatureLength(signature.len()))?;
    node.verifying_key()?
        .verify(bytes, &Signature::from_bytes(&sig))
        .map_err(|_| ClaimError::BadSignature)?;
    Ok(node)
}

/// The bytes an auditor signs for `v`.
pub fn verdict_bytes(v: &AuditVerdict) -> Vec<u8> {
    let mut out = Vec::with_capacity(VERDICT_DOMAIN.len() + 256);
    out.extend_from_slice(VERDICT_DOMAIN);
    put_bytes(&mut out, v.job_id.as_bytes());
    put_bytes(&mut out, &v.claim_signature);
    out.push(u8::from(v.passed));
    out.extend_from_slice(&(v.findings.len() as u32).to_le_bytes());
    for f in &v.findings {
        put_bytes(&mut out, f.as_bytes());
    }
    out.extend_from_slice(&v.worst_gap.to_le_bytes());
    out.extend_from_slice(&v.statistic.to_le_bytes());
    out.extend_from_slice(&v.limit.to_le_bytes());
    put_bytes(&mut out, &v.auditor_id);
    out
}

/// Signs `verdict` with `key` (its `auditor_id` must be the key's).
pub fn sign_verdict(verdict: AuditVerdict, key: &SigningKey) -> SignedVerdict {
    let signature = key.sign(&verdict_bytes(&verdict)).to_bytes().to_vec();
    SignedVerdict {
        verdict: Some(verdict),
        signature,
    }
}

/// Checks that `signed` carries a verdict signed by the auditor it names;
/// returns that auditor.
pub fn verify_verdict(signed: &SignedVerdict) -> Result<NodeId, ClaimError> {
    let v = signed.verdict.as_ref().ok_or(ClaimError::Missing)?;
    check_signature(&v.auditor_id, &verdict_bytes(v), &signed.signature)
}

/// What a client knows about a job, to check its signed result against.
#[derive(Clone, Debug)]
pub struct JobFacts<'a> {
    pub job_id: &'a str,
    /// Hex id of the node the coordinator says ran the job.
    pub node_id: &'a str,
    /// The input the client sent (or the coordinator returned).
    pub input: &'a JobInput,
    /// The catalogue's digest of the job's model file, when known.
    pub model_sha256: Option<&'a [u8]>,
}

/// Why a job's signed result is not the result of that job.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[non_exhaustive]
pub enum ResultMismatch {
    #[error("the claim does not verify: {0}")]
    Claim(#[from] ClaimError),
    #[error("the claim is about job {claimed}, not {job}")]
    OtherJob { claimed: String, job: String },
    #[error("the claim is signed by {signer}, but the job ran on {ran_on}")]
    OtherNode { signer: String, ran_on: String },
    #[error("the claim is about another input than the job's")]
    OtherInput,
    #[error("the claim names another model file than the catalogue's")]
    OtherModel,
}

/// Checks offline that `signed` is a valid claim about exactly the job
/// `facts` describes; returns the signing node.
pub fn verify_result(signed: &SignedClaim, facts: &JobFacts<'_>) -> Result<NodeId, ResultMismatch> {
    let signer = verify(signed)?;
    let c = signed.claim.as_ref().ok_or(ClaimError::Missing)?;
    if c.job_id != facts.job_id {
        return Err(ResultMismatch::OtherJob {
            claimed: c.job_id.chars().take(64).collect(),
            job: facts.job_id.to_owned(),
        });
    }
    if signer.to_string() != facts.node_id {
        return Err(ResultMismatch::OtherNode {
            signer: signer.to_string(),
            ran_on: facts.node_id.to_owned(),
        });
    }
    if c.prompt_sha256 != input_digest(facts.input) {
        return Err(ResultMismatch::OtherInput);
    }
    if facts
        .model_sha256
        .is_some_and(|m| m != c.model_sha256.as_slice())
    {
        return Err(ResultMismatch::OtherModel);
    }
    Ok(signer)
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
    fn a_result_verifies_only_against_its_own_job_node_input_and_model() {
        let key = SigningKey::generate(&mut rand::rngs::OsRng);
        let input = JobInput {
            kind: Some(job_input::Kind::Prompt("hi".into())),
        };
        let mut c = sample(&key);
        c.prompt_sha256 = input_digest(&input).to_vec();
        let signed = sign(c.clone(), &key);
        let node = NodeId::from_key(&key.verifying_key()).to_string();
        let facts = JobFacts {
            job_id: &c.job_id,
            node_id: &node,
            input: &input,
            model_sha256: Some(&[7; 32]),
        };
        assert!(verify_result(&signed, &facts).is_ok());
        let other_input = JobInput {
            kind: Some(job_input::Kind::Prompt("ho".into())),
        };
        let cases = [
            JobFacts {
                job_id: "another",
                ..facts.clone()
            },
            JobFacts {
                node_id: "00",
                ..facts.clone()
            },
            JobFacts {
                input: &other_input,
                ..facts.clone()
            },
            JobFacts {
                model_sha256: Some(&[8; 32]),
                ..facts.clone()
            },
        ];
        let got: Vec<_> = cases
            .iter()
            .map(|f| verify_result(&signed, f).unwrap_err())
            .collect();
        assert!(matches!(got[0], ResultMismatch::OtherJob { .. }));
        assert!(matches!(got[1], ResultMismatch::OtherNode { .. }));
        assert_eq!(got[2], ResultMismatch::OtherInput);
        assert_eq!(got[3], ResultMismatch::OtherModel);
        let mut bad = signed.clone();
        bad.signature[0] ^= 1;
        assert_eq!(
            verify_result(&bad, &facts),
            Err(ResultMismatch::Claim(ClaimError::BadSignature))
        );
    }

    #[test]
    fn a_verdict_verifies_only_untouched_and_signed_by_its_auditor() {
        let key = SigningKey::generate(&mut rand::rngs::OsRng);
        let v = AuditVerdict {
            job_id: "j".into(),
            claim_signature: vec![1; 64],
            passed: false,
            findings: vec!["not greedy".into()],
            worst_gap: 3.5,
            statistic: 0.0,
            limit: 0.0,
            auditor_id: key.verifying_key().to_bytes().to_vec(),
        };
        let signed = sign_verdict(v, &key);
        assert_eq!(
            verify_verdict(&signed).unwrap(),
            NodeId::from_key(&key.verifying_key())
        );
        let edits: Vec<fn(&mut AuditVerdict)> = vec![
            |v| v.job_id.push('x'),
            |v| v.claim_signature[0] ^= 1,
            |v| v.passed = true,
            |v| v.findings.clear(),
            |v| v.worst_gap = 0.0,
            |v| v.statistic = 1.0,
            |v| v.limit = 1.0,
        ];
        for (i, edit) in edits.iter().enumerate() {
            let mut bad = signed.clone();
            edit(bad.verdict.as_mut().unwrap());
            assert_eq!(
                verify_verdict(&bad),
                Err(ClaimError::BadSignature),
                "edit {i}"
            );
        }
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
