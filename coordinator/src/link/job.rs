//! One job attempt on a node: the bidirectional stream the coordinator opens
//! (Assignment in; Started, Tokens..., then Result or Failure out), and the
//! checks a result must pass before it counts.
//!
//! # Invariants
//! - A result is accepted only if its claim verifies, was signed by the node
//!   this session authenticated, names exactly this job, attempt, model
//!   digest, input digest and grammar digest (the job's, or none for a job
//!   without a grammar), lists as many tokens as it bills, bills no
//!   more completion tokens than the attempt has left of the job's
//!   `max_tokens` and no more prompt tokens than the coordinator's own bound
//!   of the input ([`check_result`]), and covers exactly what the attempt
//!   streamed ([`check_streamed`]): the text the client watched is the
//!   signed text. A hand-off claim counts only from a node that drained.
//!   Whether the tokens are the model's is the audit's question.
//! - A token chunk's log-probabilities ([`check_logprobs`]) are one entry
//!   per streamed id, only when the job asked for them, with at most the
//!   alternatives it asked for, every value finite and <= 0, most probable
//!   first and consistent with the chosen token's: an entry belongs to the
//!   id beside it, so a node cannot report logprobs for a token it did not
//!   stream. The signed claim binds the ids, not these values (they are
//!   floats of the node's arithmetic, and the client receives them live):
//!   an audit re-scores each position from the same logits and could
//!   compare them, were they stored with the job.
//!
//! # Failure
//! Stream errors surface as [`FrameError`] / [`quinn::ConnectionError`]; a
//! refused result as [`ResultError`] naming the failed check.

use mlxnet_proto::{
    claim::{self, ClaimError},
    frame::{read_frame, write_frame, FrameError},
    ids::NodeId,
    v1::{job_update, Assignment, JobUpdate, SignedClaim, TokenLogprob},
};

use crate::domain::Segment;

/// Stream error code: the coordinator cancelled the job.
pub const CODE_CANCELLED: u32 = 1;
/// Stream error code: the coordinator refused the node's result or update.
pub const CODE_REFUSED: u32 = 2;
/// Stream error code: the attempt ran past its deadline.
pub const CODE_TIMEOUT: u32 = 3;

/// Why a result was refused.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[non_exhaustive]
pub enum ResultError {
    #[error("claim does not verify: {0}")]
    Claim(#[from] ClaimError),
    #[error("claim signed by node {signer}, but the job was assigned to {assigned}")]
    WrongNode { signer: String, assigned: String },
    #[error("claim is about job {claimed}, not {assigned}")]
    WrongJob { claimed: String, assigned: String },
    #[error("claim is about attempt {claimed}, not {assigned}")]
    WrongAttempt { claimed: u32, assigned: u32 },
    #[error("claim names another model file")]
    WrongModel,
    #[error("claim is about another input")]
    WrongInput,
    #[error("claim binds another grammar than the job's (or none)")]
    WrongGrammar,
    #[error("hand-off claim covers {claimed} tokens, not the {streamed} streamed")]
    HandoffMismatch { claimed: usize, streamed: usize },
    #[error("hand-off claim from a node that did not drain")]
    UnaskedHandoff,
    #[error("claim covers {claimed} tokens and {claimed_bytes} bytes of text, the attempt streamed {streamed} tokens and {streamed_bytes} bytes")]
    NotStreamed {
        claimed: usize,
        claimed_bytes: usize,
        streamed: usize,
        streamed_bytes: usize,
    },
    #[error("claim counts {counted} completion tokens but lists {listed}")]
    TokenCount { counted: u32, listed: usize },
    #[error("claim has {claimed} completion tokens, the job allows {max}")]
    TooManyTokens { claimed: u32, max: u32 },
    #[error("claim bills {claimed} prompt tokens, the input can make at most {max}")]
    TooManyPromptTokens { claimed: u32, max: u64 },
    #[error("claim lists token id {id}, outside the model's vocabulary of {vocab} tokens")]
    OutOfVocabulary { id: u32, vocab: u32 },
    #[error(
        "claim says {claimed} microjoules per token, but its energy over its tokens is {expected}"
    )]
    EnergyPerToken { claimed: u64, expected: u64 },
    #[error("claim says the attempt used {claimed} microjoules, more than the {MAX_ENERGY_MICROJOULES} any attempt can")]
    TooMuchEnergy { claimed: u64 },
}

/// The most energy one attempt may claim: a kilowatt-hour (6 kW for the
/// 10 minutes a job may run by default; a Mac Studio draws under 0.5 kW).
/// The figure is self-reported and pays nothing; the bound keeps one
/// claim from swamping the network's energy figure.
pub const MAX_ENERGY_MICROJOULES: u64 = 3_600_000_000_000;

/// The most bytes a token (chosen or alternative) may carry in its logprobs.
pub const MAX_TOKEN_BYTES: usize = 256;

/// Why a token chunk's log-probabilities were refused.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[non_exhaustive]
pub enum LogprobsError {
    #[error("{sent} logprob entries for a job that asked for none")]
    Unasked { sent: usize },
    #[error("{sent} logprob entries for {tokens} streamed tokens")]
    Count { sent: usize, tokens: usize },
    #[error("token {at}: {sent} alternatives, the job asked for {asked}")]
    Alternatives { at: u32, sent: usize, asked: u32 },
    #[error("token {at}: a log-probability that is not a finite number <= 0")]
    Value { at: u32 },
    #[error("token {at}: alternatives out of order, or inconsistent with the chosen token")]
    Inconsistent { at: u32 },
    #[error("token {at}: a token of more than {MAX_TOKEN_BYTES} bytes")]
    TokenBytes { at: u32 },
}

/// Accepts the logprobs of a token chunk `t` of a job that asked for
/// `asked` alternatives per token (`None`: no logprobs).
pub fn check_logprobs(t: &job_update::Tokens, asked: Option<u32>) -> Result<(), LogprobsError> {
    let Some(k) = asked else {
        return match t.logprobs.len() {
            0 => Ok(()),
            sent => Err(LogprobsError::Unasked { sent }),
        };
    };
    if t.logprobs.len() != t.token_ids.len() {
        return Err(LogprobsError::Count {
            sent: t.logprobs.len(),
            tokens: t.token_ids.len(),
        });
    }
    for (i, (l, &id)) in t.logprobs.iter().zip(&t.token_ids).enumerate() {
        let at = t.index.saturating_add(i as u32);
        check_entry(l, id, k, at)?;
    }
    Ok(())
}

fn check_entry(l: &TokenLogprob, id: u32, k: u32, at: u32) -> Result<(), LogprobsError> {
    if l.top.len() > k as usize {
        return Err(LogprobsError::Alternatives {
            at,
            sent: l.top.len(),
            asked: k,
        });
    }
    let fine = |v: f32| v.is_finite() && v <= 0.0;
    if !fine(l.logprob) || !l.top.iter().all(|a| fine(a.logprob)) {
        return Err(LogprobsError::Value { at });
    }
    if l.token.len() > MAX_TOKEN_BYTES || l.top.iter().any(|a| a.token.len() > MAX_TOKEN_BYTES) {
        return Err(LogprobsError::TokenBytes { at });
    }
    // Most probable first; the first at least as probable as the chosen
    // token; the chosen token, where listed, with its own value.
    let ordered = l.top.windows(2).all(|w| w[0].logprob >= w[1].logprob);
    let above_chosen = l.top.first().is_none_or(|a| a.logprob >= l.logprob);
    let same = l
        .top
        .iter()
        .all(|a| a.token_id != id || a.logprob == l.logprob);
    if !ordered || !above_chosen || !same {
        return Err(LogprobsError::Inconsistent { at });
    }
    Ok(())
}

/// What the coordinator assigned, for checking the result against.
#[derive(Clone, Debug)]
pub struct Expected {
    pub job_id: String,
    pub attempt: u32,
    pub node_id: NodeId,
    pub model_sha256: [u8; 32],
    pub input_sha256: [u8; 32],
    /// The job's grammar's digest (`grammar::claim_digest`), None for a job
    /// without one: the claim must carry exactly this.
    pub grammar_sha256: Option<[u8; 32]>,
    /// What the attempt has left of the job's `max_tokens` (a resumed
    /// attempt continues after the tokens earlier attempts streamed): no
    /// claim may bill more.
    pub max_tokens: u32,
    /// The most prompt tokens the attempt's input (with the resumed tokens)
    /// can make: no claim may bill more.
    pub max_prompt_tokens: u64,
    /// Tokens in the model's vocabulary (0 = unknown): no claimed id may
    /// be past it.
    pub vocab_size: u32,
}

/// Accepts `signed` only if it is this node's signed claim about exactly this
/// assignment.
pub fn check_result(signed: &SignedClaim, expected: &Expected) -> Result<(), ResultError> {
    let signer = claim::verify(signed)?;
    let c = signed.claim.as_ref().ok_or(ClaimError::Missing)?;
    if signer != expected.node_id {
        return Err(ResultError::WrongNode {
            signer: signer.to_string(),
            assigned: expected.node_id.to_string(),
        });
    }
    if c.job_id != expected.job_id {
        return Err(ResultError::WrongJob {
            claimed: c.job_id.chars().take(64).collect(),
            assigned: expected.job_id.clone(),
        });
    }
    if c.attempt != expected.attempt {
        return Err(ResultError::WrongAttempt {
            claimed: c.attempt,
            assigned: expected.attempt,
        });
    }
    if c.model_sha256 != expected.model_sha256 {
        return Err(ResultError::WrongModel);
    }
    if c.prompt_sha256 != expected.input_sha256 {
        return Err(ResultError::WrongInput);
    }
    let grammar = expected.grammar_sha256.as_ref().map_or(&[][..], |d| &d[..]);
    if c.grammar_sha256 != grammar {
        return Err(ResultError::WrongGrammar);
    }
    if c.completion_tokens as usize != c.output_token_ids.len() {
        return Err(ResultError::TokenCount {
            counted: c.completion_tokens,
            listed: c.output_token_ids.len(),
        });
    }
    if c.completion_tokens > expected.max_tokens {
        return Err(ResultError::TooManyTokens {
            claimed: c.completion_tokens,
            max: expected.max_tokens,
        });
    }
    if u64::from(c.prompt_tokens) > expected.max_prompt_tokens {
        return Err(ResultError::TooManyPromptTokens {
            claimed: c.prompt_tokens,
            max: expected.max_prompt_tokens,
        });
    }
    let per_token = claim::microjoules_per_token(c.energy_microjoules, c.completion_tokens);
    if c.microjoules_per_token != per_token {
        return Err(ResultError::EnergyPerToken {
            claimed: c.microjoules_per_token,
            expected: per_token,
        });
    }
    if c.energy_microjoules > MAX_ENERGY_MICROJOULES {
        return Err(ResultError::TooMuchEnergy {
            claimed: c.energy_microjoules,
        });
    }
    if expected.vocab_size > 0 {
        if let Some(&id) = c
            .output_token_ids
            .iter()
            .find(|&&id| id >= expected.vocab_size)
        {
            return Err(ResultError::OutOfVocabulary {
                id,
                vocab: expected.vocab_size,
            });
        }
    }
    Ok(())
}

/// Whether `signed` is a hand-off claim (its node stopped mid-job and a
/// later attempt resumes after its tokens).
pub fn is_handoff(signed: &SignedClaim) -> bool {
    signed
        .claim
        .as_ref()
        .is_some_and(|c| c.finish_reason == claim::FINISH_HANDOFF)
}

/// A claim must cover what its attempt streamed, so the text a client
/// watched is the text the node signed:
/// - a hand-off claim (from a node that `drained`, never otherwise) covers
///   exactly the streamed tokens and text: those are what the next attempt
///   resumes after and what the node is paid;
/// - any other claim's text is exactly the streamed text, and it lists as
///   many tokens as were streamed (a node streams the end-of-sequence
///   token's id with the text held back until the end, so one more id may
///   have been streamed than the claim lists). The claim's ids, not the
///   streamed ones, are the result: whether they are the model's is the
///   audit's question.
pub fn check_streamed(
    signed: &SignedClaim,
    streamed: &Segment,
    drained: bool,
) -> Result<(), ResultError> {
    let c = signed.claim.as_ref().ok_or(ClaimError::Missing)?;
    if c.finish_reason == claim::FINISH_HANDOFF {
        if !drained {
            return Err(ResultError::UnaskedHandoff);
        }
        if c.output_token_ids != streamed.token_ids || c.output_text != streamed.text {
            return Err(ResultError::HandoffMismatch {
                claimed: c.output_token_ids.len(),
                streamed: streamed.token_ids.len(),
            });
        }
        return Ok(());
    }
    let ids = streamed.token_ids.len();
    let covered = (c.output_token_ids.len()..=c.output_token_ids.len() + 1).contains(&ids)
        && c.output_text == streamed.text;
    if !covered {
        return Err(ResultError::NotStreamed {
            claimed: c.output_token_ids.len(),
            claimed_bytes: c.output_text.len(),
            streamed: ids,
            streamed_bytes: streamed.text.len(),
        });
    }
    Ok(())
}

/// The coordinator's end of one job stream.
pub struct JobStream {
    send: quinn::SendStream,
    recv: quinn::RecvStream,
}

/// Why a job stream could not be opened or written.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum StreamError {
    #[error("opening the job stream: {0}")]
    Open(#[from] quinn::ConnectionError),
    #[error("sending the assignment: {0}")]
    Send(#[from] FrameError),
}

impl JobStream {
    /// Opens a stream on `conn` and sends `assignment`.
    pub async fn open(
        conn: &quinn::Connection,
        assignment: &Assignment,
    ) -> Result<Self, StreamError> {
        let (mut send, recv) = conn.open_bi().await?;
        write_frame(&mut send, assignment).await?;
        Ok(Self { send, recv })
    }

    /// The node's next update; `FrameError::Closed` if it ended the stream.
    pub async fn next(&mut self) -> Result<JobUpdate, FrameError> {
        read_frame(&mut self.recv).await
    }

    /// Ends the stream normally (after an accepted result).
    pub fn finish(mut self) {
        let _ = self.send.finish();
    }

    /// Aborts the stream in both directions with `code`.
    pub fn reset(mut self, code: u32) {
        let _ = self.send.reset(code.into());
        let _ = self.recv.stop(code.into());
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use ed25519_dalek::SigningKey;
    use mlxnet_proto::v1::ResultClaim;
    use rand::{rngs::StdRng, SeedableRng};

    fn setup() -> (SigningKey, Expected, ResultClaim) {
        let key = SigningKey::generate(&mut StdRng::seed_from_u64(9));
        let expected = Expected {
            job_id: "0193a1b2-0000-7000-8000-000000000001".into(),
            attempt: 2,
            node_id: NodeId::from_key(&key.verifying_key()),
            model_sha256: [7; 32],
            input_sha256: [9; 32],
            grammar_sha256: None,
            max_tokens: 16,
            max_prompt_tokens: 100,
            vocab_size: 1_000,
        };
        let claim = ResultClaim {
            job_id: expected.job_id.clone(),
            attempt: 2,
            model_sha256: vec![7; 32],
            prompt_sha256: vec![9; 32],
            output_token_ids: vec![1, 2],
            output_text: "Paris".into(),
            completion_tokens: 2,
            prompt_tokens: 12,
            node_id: key.verifying_key().to_bytes().to_vec(),
            finish_reason: "eos".into(),
            ..Default::default()
        };
        (key, expected, claim)
    }

    #[test]
    fn only_the_assigned_nodes_signed_claim_about_this_attempt_passes() {
        let (key, expected, good) = setup();
        assert_eq!(
            check_result(&claim::sign(good.clone(), &key), &expected),
            Ok(())
        );

        let mut bad_sig = claim::sign(good.clone(), &key);
        bad_sig.signature[0] ^= 1;
        assert!(matches!(
            check_result(&bad_sig, &expected),
            Err(ResultError::Claim(_))
        ));

        let other = SigningKey::generate(&mut StdRng::seed_from_u64(10));
        let mut foreign = good.clone();
        foreign.node_id = other.verifying_key().to_bytes().to_vec();
        assert!(matches!(
            check_result(&claim::sign(foreign, &other), &expected),
            Err(ResultError::WrongNode { .. })
        ));

        type Edit = Box<dyn Fn(&mut ResultClaim)>;
        let cases: Vec<(Edit, ResultError)> = vec![
            (
                Box::new(|c| c.job_id = "0193a1b2-0000-7000-8000-000000000002".into()),
                ResultError::WrongJob {
                    claimed: "0193a1b2-0000-7000-8000-000000000002".into(),
                    assigned: expected.job_id.clone(),
                },
            ),
            (
                Box::new(|c| c.attempt = 1),
                ResultError::WrongAttempt {
                    claimed: 1,
                    assigned: 2,
                },
            ),
            (
                Box::new(|c| c.model_sha256[0] ^= 1),
                ResultError::WrongModel,
            ),
            (
                Box::new(|c| c.prompt_sha256[0] ^= 1),
                ResultError::WrongInput,
            ),
            (
                Box::new(|c| c.completion_tokens = 3),
                ResultError::TokenCount {
                    counted: 3,
                    listed: 2,
                },
            ),
            (
                Box::new(|c| {
                    c.output_token_ids = vec![1; 17];
                    c.completion_tokens = 17;
                }),
                ResultError::TooManyTokens {
                    claimed: 17,
                    max: 16,
                },
            ),
            (
                Box::new(|c| c.prompt_tokens = u32::MAX),
                ResultError::TooManyPromptTokens {
                    claimed: u32::MAX,
                    max: 100,
                },
            ),
            // Found by the simulator (`mlxnet-sim`, a hostile node that
            // inflates its prompt count): the claim's prompt tokens were
            // billed unchecked, up to the job's whole hold.
            (
                Box::new(|c| c.prompt_tokens = 101),
                ResultError::TooManyPromptTokens {
                    claimed: 101,
                    max: 100,
                },
            ),
            (
                Box::new(|c| c.output_token_ids[1] = 1_000),
                ResultError::OutOfVocabulary {
                    id: 1_000,
                    vocab: 1_000,
                },
            ),
        ];
        for (edit, want) in cases {
            let mut c = good.clone();
            edit(&mut c);
            assert_eq!(check_result(&claim::sign(c, &key), &expected), Err(want));
        }
        let missing = SignedClaim {
            claim: None,
            signature: vec![0; 64],
        };
        assert_eq!(
            check_result(&missing, &expected),
            Err(ResultError::Claim(ClaimError::Missing))
        );
    }

    /// A claim's energy is optional, but when it has one its per-token
    /// figure must be its energy over its tokens, and no attempt may claim
    /// more than [`MAX_ENERGY_MICROJOULES`].
    #[test]
    fn a_claims_energy_must_add_up_and_stay_within_bounds() {
        let (key, expected, good) = setup();
        let with = |energy: u64, per_token: u64| {
            let mut c = good.clone();
            c.energy_microjoules = energy;
            c.microjoules_per_token = per_token;
            check_result(&claim::sign(c, &key), &expected)
        };
        // Two tokens.
        assert_eq!(with(0, 0), Ok(()));
        assert_eq!(with(5_000_001, 2_500_000), Ok(()));
        assert_eq!(
            with(5_000_001, 2_500_001),
            Err(ResultError::EnergyPerToken {
                claimed: 2_500_001,
                expected: 2_500_000
            })
        );
        assert_eq!(
            with(0, 7),
            Err(ResultError::EnergyPerToken {
                claimed: 7,
                expected: 0
            })
        );
        assert_eq!(
            with(5_000_000, 0),
            Err(ResultError::EnergyPerToken {
                claimed: 0,
                expected: 2_500_000
            })
        );
        assert_eq!(
            with(MAX_ENERGY_MICROJOULES, MAX_ENERGY_MICROJOULES / 2),
            Ok(())
        );
        assert_eq!(
            with(MAX_ENERGY_MICROJOULES + 2, MAX_ENERGY_MICROJOULES / 2 + 1),
            Err(ResultError::TooMuchEnergy {
                claimed: MAX_ENERGY_MICROJOULES + 2
            })
        );
    }

    /// The claim binds the job's grammar: a node that generated free text
    /// for a structured-output or tool-call job (and so signs no grammar, or
    /// another one) is refused, and so is a grammar on a job without one.
    #[test]
    fn a_claim_for_a_grammar_job_must_bind_its_grammar() {
        use mlxnet_proto::grammar::{claim_digest, Constraint};
        let (key, mut expected, good) = setup();
        let schema = Constraint::JsonSchema(r#"{"type":"object"}"#.into());
        let digest = claim_digest(Some(&schema.to_wire())).expect("a digest");
        let with = |g: Vec<u8>| {
            let mut c = good.clone();
            c.grammar_sha256 = g;
            claim::sign(c, &key)
        };
        // No grammar on the job: only a claim without one passes.
        assert_eq!(check_result(&with(Vec::new()), &expected), Ok(()));
        assert_eq!(
            check_result(&with(digest.to_vec()), &expected),
            Err(ResultError::WrongGrammar)
        );
        expected.grammar_sha256 = Some(digest);
        assert_eq!(check_result(&with(digest.to_vec()), &expected), Ok(()));
        for wrong in [
            Vec::new(),
            Constraint::JsonObject.digest().to_vec(),
            digest[..16].to_vec(),
        ] {
            assert_eq!(
                check_result(&with(wrong.clone()), &expected),
                Err(ResultError::WrongGrammar),
                "{wrong:?}"
            );
        }
    }

    #[test]
    fn a_claim_covers_what_its_attempt_streamed_and_hands_off_only_after_a_drain() {
        let (key, _, good) = setup();
        let streamed = Segment {
            token_ids: vec![1, 2],
            text: "Paris".into(),
            ..Segment::default()
        };
        let signed = |edit: fn(&mut ResultClaim)| {
            let mut c = good.clone();
            edit(&mut c);
            claim::sign(c, &key)
        };
        assert_eq!(check_streamed(&signed(|_| {}), &streamed, false), Ok(()));
        // The end-of-sequence id streamed with the held-back text.
        let with_eos = Segment {
            token_ids: vec![1, 2, 0],
            ..streamed.clone()
        };
        assert_eq!(check_streamed(&signed(|_| {}), &with_eos, false), Ok(()));
        let not_streamed =
            |e: &Result<(), ResultError>| matches!(e, Err(ResultError::NotStreamed { .. }));
        assert!(not_streamed(&check_streamed(
            &signed(|c| c.output_text = "Rome".into()),
            &streamed,
            false
        )));
        assert!(not_streamed(&check_streamed(
            &signed(|c| {
                c.output_token_ids = vec![1, 2, 3];
                c.completion_tokens = 3;
            }),
            &streamed,
            false
        )));
        assert!(not_streamed(&check_streamed(
            &signed(|_| {}),
            &Segment::default(),
            false
        )));
        let handoff = |c: &mut ResultClaim| c.finish_reason = claim::FINISH_HANDOFF.into();
        assert_eq!(
            check_streamed(&signed(handoff), &streamed, false),
            Err(ResultError::UnaskedHandoff)
        );
        assert_eq!(check_streamed(&signed(handoff), &streamed, true), Ok(()));
        assert!(matches!(
            check_streamed(&signed(handoff), &with_eos, true),
            Err(ResultError::HandoffMismatch { .. })
        ));
    }

    fn lp(logprob: f32, top: &[(u32, f32)]) -> TokenLogprob {
        TokenLogprob {
            logprob,
            token: b"x".to_vec(),
            top: top
                .iter()
                .map(|&(token_id, logprob)| mlxnet_proto::v1::TopLogprob {
                    token_id,
                    logprob,
                    token: b"y".to_vec(),
                })
                .collect(),
        }
    }

    fn tokens(ids: &[u32], logprobs: Vec<TokenLogprob>) -> job_update::Tokens {
        job_update::Tokens {
            index: 4,
            token_ids: ids.to_vec(),
            text: "xx".into(),
            logprobs,
        }
    }

    #[test]
    fn logprobs_must_belong_to_streamed_tokens_and_be_log_probabilities() {
        let good = || vec![lp(-0.5, &[(7, -0.5), (8, -1.0)]), lp(-2.0, &[(1, -0.1)])];
        assert_eq!(check_logprobs(&tokens(&[7, 9], good()), Some(2)), Ok(()));
        assert_eq!(check_logprobs(&tokens(&[7, 9], vec![]), None), Ok(()));
        let refused = |t: job_update::Tokens, k: Option<u32>| check_logprobs(&t, k).unwrap_err();
        // Not asked for, or more (or fewer) entries than streamed ids.
        assert_eq!(
            refused(tokens(&[7, 9], good()), None),
            LogprobsError::Unasked { sent: 2 }
        );
        assert_eq!(
            refused(tokens(&[7], good()), Some(2)),
            LogprobsError::Count { sent: 2, tokens: 1 }
        );
        assert_eq!(
            refused(tokens(&[7, 9, 10], good()), Some(2)),
            LogprobsError::Count { sent: 2, tokens: 3 }
        );
        // More alternatives than asked.
        assert!(matches!(
            refused(tokens(&[7, 9], good()), Some(1)),
            LogprobsError::Alternatives {
                at: 4,
                sent: 2,
                asked: 1
            }
        ));
        // Not a log-probability: positive, NaN, infinite.
        for bad in [0.5, f32::NAN, f32::NEG_INFINITY] {
            let t = tokens(&[7], vec![lp(bad, &[])]);
            assert_eq!(refused(t, Some(0)), LogprobsError::Value { at: 4 });
            let t = tokens(&[7], vec![lp(-1.0, &[(3, bad)])]);
            assert_eq!(refused(t, Some(1)), LogprobsError::Value { at: 4 });
        }
        // Out of order; the chosen token above the most probable; the
        // chosen token listed with another value.
        for top in [
            vec![(1, -2.0), (2, -1.0)],
            vec![(1, -3.0)],
            vec![(7, -0.1), (1, -1.5)],
        ] {
            let t = tokens(&[7], vec![lp(-1.5, &top)]);
            assert_eq!(refused(t, Some(2)), LogprobsError::Inconsistent { at: 4 });
        }
        // A token of more bytes than any real one.
        let mut big = lp(-1.0, &[]);
        big.token = vec![b'a'; MAX_TOKEN_BYTES + 1];
        assert_eq!(
            refused(tokens(&[7], vec![big]), Some(0)),
            LogprobsError::TokenBytes { at: 4 }
        );
    }
}
