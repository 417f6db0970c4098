//! Canonical bytes of a result claim and of a job's input, and claim
//! verification.
//!
//! A node signs [`canonical_bytes`] of its [`ResultClaim`] with its ed25519
//! key; the coordinator and any client verify with [`verify`]. The encoding is
//! defined here, by hand, once: a domain tag, then every field in a fixed
//! order, integers little-endian, strings and byte strings prefixed by their
//! u32 length, lists by their u32 count. It never depends on protobuf encoding
//! details, so any implementation can reproduce it. Fields added later
//! (`grammar_sha256`, 13; the energy, 14 and 15) are appended only when
//! set, each after its field number as one byte, so every claim without
//! them keeps its bytes.
//!
//! # Invariants
//! - Every field of the claim is covered: changing any field changes the bytes.
//! - The job input's digest ([`input_digest`]) binds a claim to the exact
//!   prompt or chat messages the client submitted; a job's grammar
//!   ([`crate::grammar::claim_digest`]) binds it to the constraint its
//!   tokens were generated under (structured output, tool calls), and a
//!   claim for a job without one carries none.
//!
//! A job resumed after hand-offs is a chain: each drained node's partial
//! claim covers its segment of the output, bound to the input plus every
//! token before it ([`resumed_input_digest`]), and the result's claim covers
//! the rest. [`verify_chain`] checks the whole chain offline.
//!
//! An auditor's verdict on a claim ([`verdict_bytes`], [`sign_verdict`],
//! [`verify_verdict`]) is encoded and signed the same way, under its own
//! domain tag, and names the claim by its signature.
//!
//! # Failure
//! [`verify`] returns [`ClaimError`] saying which check failed;
//! [`verify_chain`] returns [`ChainError`] naming the broken segment.

use ed25519_dalek::{Signature, Signer, SigningKey, Verifier};
use sha2::{Digest, Sha256};

use crate::{
    ids::{IdError, NodeId},
    v1::{job_input, AuditVerdict, JobInput, JobSegment, ResultClaim, SignedClaim, SignedVerdict},
};

const CLAIM_DOMAIN: &[u8] = b"mlxnet/claim/v1\0";
const INPUT_DOMAIN: &[u8] = b"mlxnet/input/v1\0";
const RESUME_DOMAIN: &[u8] = b"mlxnet/resume/v1\0";
/// The tag before `grammar_sha256` in the canonical bytes (its field number).
const GRAMMAR_FIELD: u8 = 13;
/// The tag before the energy (`energy_microjoules` then
/// `microjoules_per_token`, both little-endian u64) in the canonical bytes.
const ENERGY_FIELD: u8 = 14;

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
    if !claim.grammar_sha256.is_empty() {
        out.push(GRAMMAR_FIELD);
        put_bytes(&mut out, &claim.grammar_sha256);
    }
    // A claim with no energy but a per-token figure is refused by the
    // coordinator; it still signs differently from one without either.
    if claim.energy_microjoules != 0 || claim.microjoules_per_token != 0 {
        out.push(ENERGY_FIELD);
        out.extend_from_slice(&claim.energy_microjoules.to_le_bytes());
        out.extend_from_slice(&claim.microjoules_per_token.to_le_bytes());
    }
    out
}

/// The per-token energy a claim of `energy_microjoules` over
/// `completion_tokens` tokens must carry (`microjoules_per_token`).
pub fn microjoules_per_token(energy_microjoules: u64, completion_tokens: u32) -> u64 {
    energy_microjoules / u64::from(completion_tokens.max(1))
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
    /// The job's grammar's digest ([`crate::grammar::claim_digest`] of its
    /// `SamplingParams.grammar`), None for a job without one: the claim
    /// must carry exactly this.
    pub grammar_sha256: Option<[u8; 32]>,
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
    #[error("the claim binds another grammar than the job's (or none)")]
    OtherGrammar,
}

/// Checks offline that `signed` is a valid claim about exactly the job
/// `facts` describes; returns the signing node.
pub fn verify_result(signed: &SignedClaim, facts: &JobFacts<'_>) -> Result<NodeId, ResultMismatch> {
    check_claim(signed, facts, &input_digest(facts.input))
}

/// [`verify_result`] with the prompt digest the claim must bind given:
/// the input's, or the input plus the tokens before a resumed attempt.
fn check_claim(
    signed: &SignedClaim,
    facts: &JobFacts<'_>,
    prompt_sha256: &[u8; 32],
) -> Result<NodeId, ResultMismatch> {
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
    if c.prompt_sha256 != prompt_sha256 {
        return Err(ResultMismatch::OtherInput);
    }
    if facts
        .model_sha256
        .is_some_and(|m| m != c.model_sha256.as_slice())
    {
        return Err(ResultMismatch::OtherModel);
    }
    if c.grammar_sha256.as_slice() != facts.grammar_sha256.as_ref().map_or(&[][..], |d| &d[..]) {
        return Err(ResultMismatch::OtherGrammar);
    }
    Ok(signer)
}

/// Why a job's chain of signed claims (its hand-off segments, then its
/// result) does not cover the job. Names the segment (1-based, in stream
/// order) that breaks it.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[non_exhaustive]
pub enum ChainError {
    #[error("segment {segment} (node {node}): {source}")]
    Segment {
        segment: usize,
        node: String,
        source: ResultMismatch,
    },
    #[error("segment {segment} carries no signed partial claim")]
    Unsigned { segment: usize },
    #[error("segment {segment} starts at token {first}, but the segments before it end at token {expected} (a gap)")]
    Gap {
        segment: usize,
        first: u32,
        expected: usize,
    },
    #[error("segment {segment} starts at token {first}, but the segments before it end at token {expected} (an overlap)")]
    Overlap {
        segment: usize,
        first: u32,
        expected: usize,
    },
    #[error("segment {segment}'s token ids are not the ones its claim signs")]
    Tokens { segment: usize },
    #[error("segment {segment}'s claim ends with {reason:?}, not a hand-off")]
    NotHandoff { segment: usize, reason: String },
    #[error("segment {segment} is attempt {attempt}, not after attempt {previous}")]
    Order {
        segment: usize,
        attempt: u32,
        previous: u32,
    },
    #[error("the result: {0}")]
    Result(ResultMismatch),
    #[error("the result is attempt {attempt}, not after the last segment's attempt {previous}")]
    ResultOrder { attempt: u32, previous: u32 },
    #[error("the result's claim ends with a hand-off: the job did not finish")]
    ResultIsHandoff,
}

/// What a verified chain covers: every token of the job, in order, and its
/// text, each signed by the node named beside it.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Chain {
    /// `(signer, first token index, token count)` per signed part, the
    /// segments first, the result last.
    pub parts: Vec<(NodeId, usize, usize)>,
    /// The job's whole output, segments' then the result's.
    pub token_ids: Vec<u32>,
    pub text: String,
    /// The last claim's finish reason.
    pub finish_reason: String,
}

impl Chain {
    /// The node that signed the result (the last part).
    pub fn finisher(&self) -> Option<&NodeId> {
        self.parts.last().map(|(n, _, _)| n)
    }
}

/// Checks offline that `segments` (a resumed job's hand-off segments, in
/// stream order) and `result` (its finishing claim) are one unbroken chain
/// of signed claims about exactly the job `facts` describes
/// (`facts.node_id` is the node that finished it): every claim verifies,
/// names the job, the model and the node it is listed under; each segment's
/// claim is a hand-off covering exactly its token ids, bound to the input
/// plus every token before it ([`resumed_input_digest`]); the segments
/// cover the tokens from 0 without gap or overlap, in attempt order; and
/// the result is bound to the input plus all of them and really finished.
/// Without segments it is [`verify_result`].
pub fn verify_chain(
    segments: &[JobSegment],
    result: &SignedClaim,
    facts: &JobFacts<'_>,
) -> Result<Chain, ChainError> {
    let mut chain = Chain::default();
    let mut previous = 0u32;
    let mut model: Option<&[u8]> = facts.model_sha256;
    for (i, s) in segments.iter().enumerate() {
        let segment = i + 1;
        let signed = s.claim.as_ref().ok_or(ChainError::Unsigned { segment })?;
        let at = chain.token_ids.len();
        if s.first_index as usize > at {
            return Err(ChainError::Gap {
                segment,
                first: s.first_index,
                expected: at,
            });
        }
        if (s.first_index as usize) < at {
            return Err(ChainError::Overlap {
                segment,
                first: s.first_index,
                expected: at,
            });
        }
        let on = JobFacts {
            node_id: &s.node_id,
            model_sha256: model,
            ..facts.clone()
        };
        let expect = resumed_input_digest(facts.input, &chain.token_ids);
        let signer = check_claim(signed, &on, &expect).map_err(|source| ChainError::Segment {
            segment,
            node: s.node_id.chars().take(64).collect(),
            source,
        })?;
        let c = signed
            .claim
            .as_ref()
            .ok_or(ChainError::Unsigned { segment })?;
        if c.finish_reason != FINISH_HANDOFF {
            return Err(ChainError::NotHandoff {
                segment,
                reason: c.finish_reason.chars().take(64).collect(),
            });
        }
        if c.output_token_ids != s.token_ids || c.output_token_ids.is_empty() {
            return Err(ChainError::Tokens { segment });
        }
        if c.attempt <= previous {
            return Err(ChainError::Order {
                segment,
                attempt: c.attempt,
                previous,
            });
        }
        previous = c.attempt;
        model = Some(&c.model_sha256);
        chain.parts.push((signer, at, c.output_token_ids.len()));
        chain.token_ids.extend_from_slice(&c.output_token_ids);
        chain.text.push_str(&c.output_text);
    }
    let on = JobFacts {
        model_sha256: model,
        ..facts.clone()
    };
    let expect = resumed_input_digest(facts.input, &chain.token_ids);
    let signer = check_claim(result, &on, &expect).map_err(ChainError::Result)?;
    let c = result
        .claim
        .as_ref()
        .ok_or(ChainError::Result(ResultMismatch::Claim(
            ClaimError::Missing,
        )))?;
    if c.attempt <= previous {
        return Err(ChainError::ResultOrder {
            attempt: c.attempt,
            previous,
        });
    }
    if c.finish_reason == FINISH_HANDOFF {
        return Err(ChainError::ResultIsHandoff);
    }
    chain
        .parts
        .push((signer, chain.token_ids.len(), c.output_token_ids.len()));
    chain.token_ids.extend_from_slice(&c.output_token_ids);
    chain.text.push_str(&c.output_text);
    chain.finish_reason = c.finish_reason.clone();
    Ok(chain)
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
            grammar_sha256: Vec::new(),
            energy_microjoules: 0,
            microjoules_per_token: 0,
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
            grammar_sha256: None,
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

    /// A claim without a grammar keeps the bytes it had before
    /// `grammar_sha256` existed (pinned: the SHA-256 of the canonical bytes
    /// of a fixed claim, computed from the encoding as it was); with one,
    /// the bytes are those followed by the field's tag and the digest.
    #[test]
    fn a_claim_without_a_grammar_keeps_its_bytes_and_a_grammar_is_signed() {
        let mut c = sample(&SigningKey::from_bytes(&[3; 32]));
        c.node_id = vec![3; 32];
        let before = canonical_bytes(&c);
        assert_eq!(
            hex::encode(Sha256::digest(&before)),
            "037746d1798dd0f79dc58557dc85bbd2443b2188f77dbe53eff86eedad4d7c07"
        );
        c.grammar_sha256 = vec![5; 32];
        let with = canonical_bytes(&c);
        let mut tail = vec![13u8, 32, 0, 0, 0];
        tail.extend_from_slice(&[5; 32]);
        assert_eq!(with, [before, tail].concat());
        // The digest is signed: changing or dropping it breaks the signature.
        let key = SigningKey::from_bytes(&[4; 32]);
        let mut c = sample(&key);
        c.grammar_sha256 = vec![5; 32];
        let good = sign(c, &key);
        assert!(verify(&good).is_ok());
        let edits: Vec<fn(&mut ResultClaim)> =
            vec![|c| c.grammar_sha256[0] ^= 1, |c| c.grammar_sha256.clear()];
        for edit in edits {
            let mut bad = good.clone();
            edit(bad.claim.as_mut().unwrap());
            assert_eq!(verify(&bad), Err(ClaimError::BadSignature));
        }
    }

    /// A claim without energy keeps the bytes it had before the energy
    /// fields existed (the pinned digest above); with it, the bytes are
    /// those followed by the tag 14 and both figures; both are signed.
    #[test]
    fn a_claim_without_energy_keeps_its_bytes_and_its_energy_is_signed() {
        let mut c = sample(&SigningKey::from_bytes(&[3; 32]));
        c.node_id = vec![3; 32];
        let before = canonical_bytes(&c);
        c.energy_microjoules = 3_000_000;
        c.microjoules_per_token = microjoules_per_token(3_000_000, c.completion_tokens);
        assert_eq!(c.microjoules_per_token, 1_000_000);
        let mut tail = vec![14u8];
        tail.extend_from_slice(&3_000_000u64.to_le_bytes());
        tail.extend_from_slice(&1_000_000u64.to_le_bytes());
        assert_eq!(canonical_bytes(&c), [before, tail].concat());
        let key = SigningKey::from_bytes(&[4; 32]);
        let mut c = sample(&key);
        c.energy_microjoules = 3_000_000;
        c.microjoules_per_token = 1_000_000;
        let good = sign(c, &key);
        assert!(verify(&good).is_ok());
        let edits: Vec<fn(&mut ResultClaim)> = vec![
            |c| c.energy_microjoules -= 1,
            |c| c.microjoules_per_token += 1,
            |c| {
                c.energy_microjoules = 0;
                c.microjoules_per_token = 0;
            },
        ];
        for (i, edit) in edits.iter().enumerate() {
            let mut bad = good.clone();
            edit(bad.claim.as_mut().unwrap());
            assert_eq!(verify(&bad), Err(ClaimError::BadSignature), "edit {i}");
        }
        // No tokens: the whole energy is the per-token figure.
        assert_eq!(microjoules_per_token(7, 0), 7);
    }

    /// A job with a grammar verifies only with a claim binding that
    /// grammar's digest; a job without one only with a claim binding none.
    #[test]
    fn a_result_verifies_only_with_its_jobs_grammar() {
        use crate::grammar::{claim_digest, Constraint};
        let key = SigningKey::from_bytes(&[6; 32]);
        let input = JobInput {
            kind: Some(job_input::Kind::Prompt("hi".into())),
        };
        let node = NodeId::from_key(&key.verifying_key()).to_string();
        let schema = Constraint::JsonSchema(r#"{"type":"object"}"#.into()).to_wire();
        let digest = claim_digest(Some(&schema));
        assert_eq!(
            digest,
            Some(Constraint::JsonSchema(r#"{"type":"object"}"#.into()).digest())
        );
        assert_eq!(claim_digest(None), None);
        let claim_with = |g: Vec<u8>| {
            let mut c = sample(&key);
            c.prompt_sha256 = input_digest(&input).to_vec();
            c.grammar_sha256 = g;
            sign(c, &key)
        };
        let facts = |g: Option<[u8; 32]>| JobFacts {
            job_id: "0193a1b2-0000-7000-8000-000000000001",
            node_id: &node,
            input: &input,
            model_sha256: None,
            grammar_sha256: g,
        };
        let d = digest.unwrap();
        let other = Constraint::JsonObject.digest();
        assert!(verify_result(&claim_with(d.to_vec()), &facts(digest)).is_ok());
        assert!(verify_result(&claim_with(Vec::new()), &facts(None)).is_ok());
        for (claimed, job) in [
            (Vec::new(), digest),       // the node ignored the grammar
            (other.to_vec(), digest),   // another grammar
            (d[..31].to_vec(), digest), // not a digest
            (d.to_vec(), None),         // a grammar the job did not have
        ] {
            assert_eq!(
                verify_result(&claim_with(claimed.clone()), &facts(job)),
                Err(ResultMismatch::OtherGrammar),
                "{claimed:?} against {job:?}"
            );
        }
        // In a chain too: a segment's claim must bind the job's grammar.
        let seg = claim_with(Vec::new());
        let c = seg.claim.clone().unwrap();
        let mut handoff = c.clone();
        handoff.finish_reason = FINISH_HANDOFF.into();
        handoff.grammar_sha256 = Vec::new();
        let segments = [JobSegment {
            node_id: node.clone(),
            attempt: 1,
            first_index: 0,
            token_ids: c.output_token_ids.clone(),
            claim: Some(sign(handoff, &key)),
        }];
        let mut last = c;
        last.attempt = 2;
        last.prompt_sha256 = resumed_input_digest(&input, &last.output_token_ids).to_vec();
        last.grammar_sha256 = d.to_vec();
        assert!(matches!(
            verify_chain(&segments, &sign(last, &key), &facts(digest)),
            Err(ChainError::Segment {
                segment: 1,
                source: ResultMismatch::OtherGrammar,
                ..
            })
        ));
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

    /// A resumed job's chain: node A signed tokens 1..=3 (attempt 1, a
    /// hand-off), node B tokens 4..=5 (attempt 2, a hand-off), node C the
    /// rest (attempt 4: attempt 3's node vanished and kept nothing).
    struct Resumed {
        keys: [SigningKey; 3],
        input: JobInput,
        segments: Vec<JobSegment>,
        result: SignedClaim,
    }

    fn part(
        key: &SigningKey,
        input: &JobInput,
        before: &[u32],
        attempt: u32,
        ids: &[u32],
        finish: &str,
    ) -> SignedClaim {
        let mut c = sample(key);
        c.attempt = attempt;
        c.prompt_sha256 = resumed_input_digest(input, before).to_vec();
        c.output_token_ids = ids.to_vec();
        c.output_text = ids.iter().map(|i| format!("<{i}>")).collect();
        c.completion_tokens = ids.len() as u32;
        c.finish_reason = finish.into();
        sign(c, key)
    }

    fn segment(key: &SigningKey, first_index: u32, claim: SignedClaim) -> JobSegment {
        let c = claim.claim.clone().unwrap_or_default();
        JobSegment {
            node_id: hex_id(key),
            attempt: c.attempt,
            first_index,
            token_ids: c.output_token_ids,
            claim: Some(claim),
        }
    }

    fn hex_id(key: &SigningKey) -> String {
        NodeId::from_key(&key.verifying_key()).to_string()
    }

    fn resumed() -> Resumed {
        let keys = [1u8, 2, 3].map(|b| SigningKey::from_bytes(&[b; 32]));
        let input = JobInput {
            kind: Some(job_input::Kind::Prompt("Once upon a time".into())),
        };
        let a = part(&keys[0], &input, &[], 1, &[1, 2, 3], FINISH_HANDOFF);
        let b = part(&keys[1], &input, &[1, 2, 3], 2, &[4, 5], FINISH_HANDOFF);
        let result = part(&keys[2], &input, &[1, 2, 3, 4, 5], 4, &[6, 7], "length");
        Resumed {
            segments: vec![segment(&keys[0], 0, a), segment(&keys[1], 3, b)],
            keys,
            input,
            result,
        }
    }

    impl Resumed {
        /// Node C's result re-signed: tokens 6 and 7 after `before`.
        fn refinish(&mut self, before: &[u32], attempt: u32, finish: &str) {
            self.result = part(&self.keys[2], &self.input, before, attempt, &[6, 7], finish);
        }

        fn check(&self) -> Result<Chain, ChainError> {
            let node = hex_id(&self.keys[2]);
            let facts = JobFacts {
                job_id: "0193a1b2-0000-7000-8000-000000000001",
                node_id: &node,
                input: &self.input,
                model_sha256: Some(&[7; 32]),
                grammar_sha256: None,
            };
            verify_chain(&self.segments, &self.result, &facts)
        }
    }

    #[test]
    fn a_resumed_jobs_chain_verifies_whole_and_joins_every_signed_part() {
        let r = resumed();
        let chain = r.check().unwrap();
        assert_eq!(chain.token_ids, [1, 2, 3, 4, 5, 6, 7]);
        assert_eq!(chain.text, "<1><2><3><4><5><6><7>");
        assert_eq!(chain.finish_reason, "length");
        let signers: Vec<_> = r
            .keys
            .iter()
            .map(|k| NodeId::from_key(&k.verifying_key()))
            .collect();
        assert_eq!(
            chain.parts,
            [(signers[0], 0, 3), (signers[1], 3, 2), (signers[2], 5, 2)]
        );
        assert_eq!(chain.finisher(), Some(&signers[2]));
        // Without segments it is `verify_result` on a fresh job.
        let fresh = part(&r.keys[2], &r.input, &[], 1, &[9], "eos");
        let node = hex_id(&r.keys[2]);
        let facts = JobFacts {
            job_id: "0193a1b2-0000-7000-8000-000000000001",
            node_id: &node,
            input: &r.input,
            model_sha256: None,
            grammar_sha256: None,
        };
        assert_eq!(verify_chain(&[], &fresh, &facts).unwrap().token_ids, [9]);
        assert_eq!(
            verify_chain(&[], &r.result, &facts),
            Err(ChainError::Result(ResultMismatch::OtherInput)),
            "a resumed claim alone is about another input"
        );
    }

    /// The error of segment `segment`, listed under node `key` of [`resumed`].
    fn in_segment(segment: usize, key: usize, source: ResultMismatch) -> ChainError {
        ChainError::Segment {
            segment,
            node: hex_id(&resumed().keys[key]),
            source,
        }
    }

    #[test]
    fn a_broken_chain_is_refused_naming_the_segment() {
        let foreign = SigningKey::from_bytes(&[9; 32]);
        type Edit = Box<dyn Fn(&mut Resumed)>;
        let cases: Vec<(&str, Edit, ChainError)> = vec![
            (
                "a gap",
                Box::new(|r| r.segments[1].first_index = 4),
                ChainError::Gap {
                    segment: 2,
                    first: 4,
                    expected: 3,
                },
            ),
            (
                "an overlap",
                Box::new(|r| r.segments[1].first_index = 2),
                ChainError::Overlap {
                    segment: 2,
                    first: 2,
                    expected: 3,
                },
            ),
            (
                "a foreign signature",
                Box::new(move |r| {
                    let c = r.segments[1].claim.clone().unwrap().claim.unwrap();
                    r.segments[1].claim = Some(sign(c, &foreign));
                }),
                in_segment(2, 1, ResultMismatch::Claim(ClaimError::BadSignature)),
            ),
            (
                "a segment listed under another node than its signer",
                Box::new(|r| r.segments[1].node_id = hex_id(&r.keys[0])),
                in_segment(
                    2,
                    0,
                    ResultMismatch::OtherNode {
                        signer: hex_id(&resumed().keys[1]),
                        ran_on: hex_id(&resumed().keys[0]),
                    },
                ),
            ),
            (
                "reordered segments",
                Box::new(|r| {
                    r.segments.swap(0, 1);
                    r.segments[0].first_index = 0;
                    r.segments[1].first_index = 2;
                }),
                in_segment(1, 1, ResultMismatch::OtherInput),
            ),
            (
                "a dropped segment",
                Box::new(|r| {
                    r.segments.remove(0);
                    r.segments[0].first_index = 0;
                }),
                in_segment(1, 1, ResultMismatch::OtherInput),
            ),
            (
                "a segment bound to the bare input",
                Box::new(|r| {
                    let k = r.keys[1].clone();
                    let c = part(&k, &r.input, &[], 2, &[4, 5], FINISH_HANDOFF);
                    r.segments[1] = segment(&k, 3, c);
                }),
                in_segment(2, 1, ResultMismatch::OtherInput),
            ),
            (
                "another input than the job's",
                Box::new(|r| {
                    r.input = JobInput {
                        kind: Some(job_input::Kind::Prompt("Once upon a time,".into())),
                    }
                }),
                in_segment(1, 0, ResultMismatch::OtherInput),
            ),
            (
                "a segment without its claim",
                Box::new(|r| r.segments[0].claim = None),
                ChainError::Unsigned { segment: 1 },
            ),
            (
                "token ids beside the claim that are not the signed ones",
                Box::new(|r| r.segments[0].token_ids[1] = 99),
                ChainError::Tokens { segment: 1 },
            ),
            (
                "a segment whose claim finished",
                Box::new(|r| {
                    let k = r.keys[0].clone();
                    let c = part(&k, &r.input, &[], 1, &[1, 2, 3], "length");
                    r.segments[0] = segment(&k, 0, c);
                }),
                ChainError::NotHandoff {
                    segment: 1,
                    reason: "length".into(),
                },
            ),
            (
                "a segment of a later attempt before an earlier one",
                Box::new(|r| {
                    let k = r.keys[1].clone();
                    let c = part(&k, &r.input, &[1, 2, 3], 1, &[4, 5], FINISH_HANDOFF);
                    r.segments[1] = segment(&k, 3, c);
                }),
                ChainError::Order {
                    segment: 2,
                    attempt: 1,
                    previous: 1,
                },
            ),
            (
                "a segment of another model",
                Box::new(|r| {
                    let k = r.keys[1].clone();
                    let mut c = r.segments[1].claim.clone().unwrap().claim.unwrap();
                    c.model_sha256 = vec![8; 32];
                    r.segments[1].claim = Some(sign(c, &k));
                }),
                in_segment(2, 1, ResultMismatch::OtherModel),
            ),
            (
                "a result bound to the bare input",
                Box::new(|r| r.refinish(&[], 4, "length")),
                ChainError::Result(ResultMismatch::OtherInput),
            ),
            (
                "a result that is itself a hand-off",
                Box::new(|r| r.refinish(&[1, 2, 3, 4, 5], 4, FINISH_HANDOFF)),
                ChainError::ResultIsHandoff,
            ),
            (
                "a result of an earlier attempt than a segment",
                Box::new(|r| r.refinish(&[1, 2, 3, 4, 5], 2, "length")),
                ChainError::ResultOrder {
                    attempt: 2,
                    previous: 2,
                },
            ),
        ];
        for (what, edit, want) in cases {
            let mut r = resumed();
            edit(&mut r);
            assert_eq!(r.check(), Err(want), "{what}");
        }
    }
}
