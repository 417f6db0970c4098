//! Running audits: after a job completes, maybe pick it for audit, draw
//! auditors to re-score it, send them the audit assignment and count their
//! signed verdicts once they settle it.
//!
//! A resumed job is audited like any other: its claims form a chain (each
//! drained node's hand-off segment under its partial claim, then the
//! result), each picked by its own node's audit rate, and one of those
//! picked is audited ([`audit_chain`]). The audit assignment carries that
//! claim and, as its resumed prefix, every token before it: the auditor
//! replays input + prefix and scores the claim's own tokens, which are
//! bound to that prefix (`claim::resumed_input_digest`). So a node that
//! fabricates a segment and hands off is audited at its own rate, and a
//! confirmed failure voids the job's pay and counts against that node.
//!
//! # Invariants
//! - Each auditor is drawn at random ([`draw`], seeded per audit from the
//!   coordinator's own randomness, never from anything a node sent),
//!   weighted by reputation, among online, established (never on
//!   probation), unbanned, undrained nodes holding the job's model file that
//!   report the memory the job needs (a node that never placed itself is
//!   no auditor) and have a free job slot (taken for the audit's length,
//!   so placement does not over-fill it); never the node that served the
//!   job nor another node of its operator, and never one that already
//!   gave a verdict on this audit.
//! - A verdict counts only if it verifies, is signed by the node it was sent
//!   to, and names this job and the audited claim's signature.
//! - The verdicts end the audit only once [`decide`](crate::audit::decide)
//!   settles them: a failing verdict is confirmed by a second auditor (a
//!   third on disagreement) before pay is voided or anyone is counted
//!   against.
//!
//! # Failure
//! Anything that goes wrong with one auditor (unreachable, refused, bad
//! verdict) is logged and another is drawn, until the audit window closes;
//! then an undecided audit is `missed` and the job is paid as usual. An
//! auditor that takes the audit and never answers is waited for no longer
//! than the window.

use std::{sync::Arc, time::Duration};

use mlxnet_proto::{
    claim,
    frame::FrameError,
    ids::NodeId,
    v1::{job_update, Assignment, AuditTask, JobInput, Resume, SignedClaim, SignedVerdict},
};
use rand::{rngs::StdRng, SeedableRng};
use tracing::{debug, info, warn};

use super::{input_bytes, Dispatcher};
use crate::{
    audit::{audit_rate, draw, Candidate, Ended, InProgress, Verdict},
    catalogue::Model,
    domain::{JobRecord, Segment},
    link::{
        job::{JobStream, CODE_REFUSED},
        session::{Session, MAX_REASON_CHARS},
        CLOSE_BANNED,
    },
    store::Store,
    util::{clip, error_chain, now_ms},
};

/// How often a pending audit looks for a free auditor.
const AUDITOR_POLL: Duration = Duration::from_millis(200);

impl Dispatcher {
    /// Decides whether the job `node` just completed with `signed` is
    /// audited (by the node's record), and if so starts the audit.
    pub(crate) async fn maybe_audit(
        self: &Arc<Self>,
        job: &JobRecord,
        node: &str,
        signed: &SignedClaim,
    ) {
        let Some(model) = self.catalogue.get(&job.model).cloned() else {
            return;
        };
        // A resumed job is a chain of claims: each drained node's hand-off
        // segment, then the result. Each is picked by its own node's audit
        // rate, and one of those picked is audited, bound to the tokens
        // before it (the auditor replays input + those and scores its own).
        let segments = match self.store.segments(job.id).await {
            Ok(s) => s,
            Err(e) => {
                warn!(error = %error_chain(&e), "reading the job's segments for its audit failed");
                return;
            }
        };
        let Some(chain) = audit_chain(&job.input, &segments, node, signed) else {
            warn!(job_id = %job.id, "a claim of the job is not bound to the tokens before it; not audited");
            return;
        };
        let mut picked = Vec::new();
        for part in chain {
            let record = match self.audits.record(&part.node).await {
                Ok(r) => r,
                Err(e) => {
                    warn!(error = %error_chain(&e), "reading the node's audit record failed");
                    return;
                }
            };
            let rate = audit_rate(&self.audits.config, &record);
            if rate > 0.0 && rand::random::<f64>() < rate {
                picked.push((part, rate));
            }
        }
        if picked.is_empty() {
            return;
        }
        let (part, rate) = picked.swap_remove(rand::random::<usize>() % picked.len());
        match self
            .audits
            .begin(&job.id.to_string(), &part.node, now_ms())
            .await
        {
            Ok(true) => {}
            Ok(false) => return,
            Err(e) => {
                warn!(error = %error_chain(&e), "recording the audit failed");
                return;
            }
        }
        let Ok(served_by) = part.node.parse::<NodeId>() else {
            return;
        };
        // The auditors' draw: the coordinator's own randomness, per audit
        // (logged, so a draw can be replayed).
        let seed = rand::random::<u64>();
        debug!(job_id = %job.id, node = %served_by.short(), rate, seed, resumed = part.resume.token_ids.len(), "job picked for audit");
        let this = Arc::clone(self);
        let job = job.clone();
        self.spawn(async move {
            let mut standing = None;
            this.run_audit(job, model, part, served_by, seed, &mut standing)
                .await;
            // The audit ended (or the window closed): a node it held back
            // may be placed again.
            if standing.take().is_some() {
                this.wake();
            }
        });
    }

    /// Draws auditors and sends them the audit until their verdicts
    /// settle it ([`decide`](crate::audit::decide)) or the window closes.
    /// From the first auditor asked, the audit is counted in progress in
    /// `standing` (and placement may hold the audited node back:
    /// [`Audits::held`](crate::audit::Audits::held)) until the caller drops it.
    async fn run_audit(
        self: &Arc<Self>,
        job: JobRecord,
        model: Model,
        part: ChainPart,
        served_by: NodeId,
        seed: u64,
        standing: &mut Option<InProgress>,
    ) {
        // The audit must end while the pay is still held; without a window
        // (pay not held) it may take as long as a job.
        let window = match self.audits.config.window_ms {
            w if w > 0 => Duration::from_millis(w as u64),
            _ => Duration::from_millis(self.config.job_timeout_ms),
        };
        let deadline = tokio::time::Instant::now() + window;
        let job_id = job.id.to_string();
        let shape = model.job(input_bytes(&job.input), job.sampling.max_tokens);
        let operator = self.operator_of(&served_by).await;
        let mut rng = StdRng::seed_from_u64(seed);
        let mut verdicts: Vec<Verdict> = Vec::new();
        let mut asked: Vec<NodeId> = Vec::new();
        while tokio::time::Instant::now() < deadline {
            let sessions = self.sessions.all();
            let candidates: Vec<Candidate> = sessions
                .iter()
                .map(|s| Candidate {
                    node: s.node_id,
                    operator: s.operator.clone(),
                    able: s.pod.is_none()
                        && !s.is_draining()
                        && !self.audits.is_banned(&s.node_id)
                        && s.models.contains(&model.sha256)
                        && s.memory_bytes > 0
                        && s.memory_bytes >= shape.memory_needed()
                        && s.running_jobs() < s.max_concurrent_jobs,
                    reputation: self.audits.reputation(&s.node_id),
                })
                .collect();
            let drawn = draw(&candidates, &served_by, &operator, &asked, &mut rng);
            let Some(auditor) = drawn.and_then(|id| sessions.into_iter().find(|s| s.node_id == id))
            else {
                tokio::select! {
                    _ = self.shutdown_token().cancelled() => return,
                    _ = tokio::time::sleep(AUDITOR_POLL) => {}
                }
                continue;
            };
            standing.get_or_insert_with(|| self.audits.in_progress(served_by));
            let reservation = auditor.reserve(shape.memory_needed());
            let verdict = tokio::select! {
                _ = self.shutdown_token().cancelled() => return,
                v = self.ask(&job, &model, &part, &auditor, deadline) => v,
            };
            drop(reservation);
            self.wake();
            let verdict = match verdict {
                Ok(v) => v,
                Err(why) => {
                    warn!(job_id = %job.id, auditor = %auditor.node_id.short(), %why, "audit attempt failed");
                    tokio::select! {
                        _ = self.shutdown_token().cancelled() => return,
                        _ = tokio::time::sleep(AUDITOR_POLL) => {}
                    }
                    continue;
                }
            };
            let passed = verdict.verdict.as_ref().is_some_and(|v| v.passed);
            let findings = verdict
                .verdict
                .as_ref()
                .map(|v| clip(&v.findings.join("; "), MAX_REASON_CHARS).to_owned())
                .unwrap_or_default();
            info!(job_id = %job.id, node = %served_by.short(), auditor = %auditor.node_id.short(), passed, %findings, "audit verdict");
            asked.push(auditor.node_id);
            verdicts.push(Verdict {
                auditor: auditor.node_id.to_string(),
                signed: verdict,
                passed,
            });
            match self.audits.conclude(&job_id, &verdicts, now_ms()).await {
                Ok(Ended::Undecided) => {
                    // A failing verdict awaits confirmation: the node is
                    // held back from placement until the audit ends.
                    if !passed {
                        if let Some(s) = standing.as_mut() {
                            s.accuse();
                        }
                    }
                    continue;
                }
                Ok(Ended::Counted {
                    passed,
                    record,
                    against,
                }) => {
                    info!(job_id = %job.id, node = %served_by.short(), passed, ?record, verdicts = verdicts.len(), "audit ended");
                    for (a, r) in &against {
                        warn!(job_id = %job.id, auditor = %a, record = ?r, "auditor in the minority counted against");
                        if r.banned {
                            if let Ok(id) = a.parse::<NodeId>() {
                                self.close_banned(&id);
                            }
                        }
                    }
                    if !passed {
                        // Voids the hold now; a passed audit's pay waits for
                        // the window (the sweep).
                        self.settle(job.id).await;
                    }
                    if record.banned {
                        warn!(node = %served_by, "node banned from placement after failed audits");
                        self.close_banned(&served_by);
                    }
                }
                Ok(Ended::AlreadyEnded) => {}
                Err(e) => warn!(error = %error_chain(&e), "recording the verdict failed"),
            }
            return;
        }
        if let Err(e) = self.audits.miss(&job_id, now_ms()).await {
            warn!(error = %error_chain(&e), "recording the missed audit failed");
        }
        info!(job_id = %job.id, verdicts = verdicts.len(), "audit undecided within the window; missed");
    }

    /// Closes a banned node's session: it is never placed, audits nothing
    /// and earns nothing, so it holds no connection either (the link
    /// refuses it at its next handshake).
    fn close_banned(&self, node: &NodeId) {
        if let Some(s) = self.sessions.get(node) {
            s.connection
                .close(CLOSE_BANNED.into(), b"banned after failed audits");
        }
    }

    /// The operator account `node` earns for: its session's, or (gone) the
    /// ledger's link; empty if neither answers.
    async fn operator_of(&self, node: &NodeId) -> String {
        if let Some(s) = self.sessions.get(node) {
            return s.operator.clone();
        }
        match self.ledger.link_node(&node.to_string(), "").await {
            Ok(a) => a,
            Err(e) => {
                warn!(error = %error_chain(&e), "reading the audited node's operator failed");
                String::new()
            }
        }
    }

    /// Sends the audit of `part` to `auditor` (the claim, and the tokens
    /// before it as the resumed prefix) and returns its verdict, if it is
    /// one that counts and it comes by `deadline` (the audit window's end:
    /// an auditor that never answers holds the audit no longer, since the
    /// pay is held only that long) and within a job's time limit.
    async fn ask(
        &self,
        job: &JobRecord,
        model: &Model,
        part: &ChainPart,
        auditor: &Session,
        deadline: tokio::time::Instant,
    ) -> Result<SignedVerdict, String> {
        let signed = &part.signed;
        let assignment = Assignment {
            job_id: job.id.to_string(),
            attempt: job.attempt,
            model: job.model.clone(),
            model_sha256: model.sha256.to_vec(),
            input: Some(job.input.clone()),
            sampling: Some(job.sampling.clone()),
            resume: (!part.resume.token_ids.is_empty()).then(|| part.resume.clone()),
            audit: Some(AuditTask {
                claim: Some(signed.clone()),
            }),
        };
        let mut stream = JobStream::open(&auditor.connection, &assignment)
            .await
            .map_err(|e| format!("could not reach the auditor: {e}"))?;
        let limit = Duration::from_millis(self.config.job_timeout_ms);
        let until = deadline.min(tokio::time::Instant::now() + limit);
        let answer = tokio::time::timeout_at(until, async {
            loop {
                match stream.next().await {
                    Ok(u) => match u.msg {
                        Some(job_update::Msg::Started(_)) => continue,
                        Some(job_update::Msg::Verdict(v)) => return Ok(v),
                        Some(job_update::Msg::Failure(f)) => {
                            return Err(format!("auditor failed: {}", f.reason))
                        }
                        _ => return Err("unexpected update from the auditor".to_string()),
                    },
                    Err(FrameError::Closed) => return Err("auditor closed the stream".into()),
                    Err(e) => return Err(format!("auditor stream: {e}")),
                }
            }
        })
        .await;
        let Ok(answer) = answer else {
            stream.reset(CODE_REFUSED);
            return Err(
                "no verdict before the audit window closed (or within a job's time limit)".into(),
            );
        };
        let verdict = match answer {
            Ok(v) => v,
            Err(e) => {
                stream.reset(CODE_REFUSED);
                return Err(e);
            }
        };
        let signer = claim::verify_verdict(&verdict).map_err(|e| e.to_string());
        let v = verdict.verdict.as_ref();
        let counts = signer.as_ref().is_ok_and(|s| *s == auditor.node_id)
            && v.is_some_and(|v| v.job_id == assignment.job_id)
            && v.is_some_and(|v| v.claim_signature == signed.signature);
        if !counts {
            stream.reset(CODE_REFUSED);
            return Err(format!("verdict refused (signature: {signer:?})"));
        }
        stream.finish();
        Ok(verdict)
    }
}

/// One claim of a job's chain, as an audit sends it: the node that signed
/// it, the claim, and the tokens (and text) before it in the job's stream.
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct ChainPart {
    pub node: String,
    pub signed: SignedClaim,
    pub resume: Resume,
}

/// Every claim of a job whose `segments` (in stream order) were handed off
/// and whose result `signed` (by `node`, hex) completed it: each segment's
/// partial claim, then the result, each with the tokens before it. None
/// when a segment is unsigned or a claim is not bound to the input plus
/// the tokens before it (`claim::resumed_input_digest`): such a chain was
/// never accepted, and an auditor could not replay it.
pub(crate) fn audit_chain(
    input: &JobInput,
    segments: &[Segment],
    node: &str,
    signed: &SignedClaim,
) -> Option<Vec<ChainPart>> {
    let mut parts = Vec::with_capacity(segments.len() + 1);
    let mut before = Resume::default();
    let bound = |c: &SignedClaim, before: &Resume| {
        c.claim.as_ref().is_some_and(|c| {
            c.prompt_sha256 == claim::resumed_input_digest(input, &before.token_ids)
        })
    };
    for s in segments {
        let c = s.claim.as_ref()?;
        if !bound(c, &before) {
            return None;
        }
        parts.push(ChainPart {
            node: s.node_id.clone(),
            signed: c.clone(),
            resume: before.clone(),
        });
        before.token_ids.extend_from_slice(&s.token_ids);
        before.text.push_str(&s.text);
    }
    if !bound(signed, &before) {
        return None;
    }
    parts.push(ChainPart {
        node: node.to_owned(),
        signed: signed.clone(),
        resume: before,
    });
    Some(parts)
}

#[cfg(test)]
mod tests {
    use mlxnet_proto::v1::{job_input, ResultClaim};

    use super::*;

    fn signed(input: &JobInput, before: &[u32]) -> SignedClaim {
        SignedClaim {
            claim: Some(ResultClaim {
                prompt_sha256: claim::resumed_input_digest(input, before).to_vec(),
                ..Default::default()
            }),
            signature: Vec::new(),
        }
    }

    fn segment(node: &str, ids: Vec<u32>, text: &str, claim: Option<SignedClaim>) -> Segment {
        Segment {
            node_id: node.into(),
            token_ids: ids,
            text: text.into(),
            claim,
            ..Segment::default()
        }
    }

    #[test]
    fn each_claim_of_a_resumed_job_is_audited_after_the_tokens_before_it() {
        let input = JobInput {
            kind: Some(job_input::Kind::Prompt("The capital of France is".into())),
        };
        let segments = [
            segment("a", vec![7], " Par", Some(signed(&input, &[]))),
            segment("b", vec![8, 9], "is.", Some(signed(&input, &[7]))),
        ];
        let result = signed(&input, &[7, 8, 9]);
        let chain = audit_chain(&input, &segments, "c", &result).unwrap();
        let seen: Vec<(&str, Vec<u32>, &str)> = chain
            .iter()
            .map(|p| {
                (
                    p.node.as_str(),
                    p.resume.token_ids.clone(),
                    p.resume.text.as_str(),
                )
            })
            .collect();
        assert_eq!(
            seen,
            vec![
                ("a", vec![], ""),
                ("b", vec![7], " Par"),
                ("c", vec![7, 8, 9], " Paris."),
            ]
        );
        assert_eq!(chain[2].signed, result);
        // A job never resumed: its one claim, with no prefix.
        let whole = audit_chain(&input, &[], "c", &signed(&input, &[])).unwrap();
        assert_eq!(whole.len(), 1);
        assert!(whole[0].resume.token_ids.is_empty());
        // An unsigned segment, or a claim bound to other tokens: not audited.
        let unsigned = [segment("a", vec![7], " Par", None)];
        assert!(audit_chain(&input, &unsigned, "c", &signed(&input, &[7])).is_none());
        assert!(audit_chain(&input, &segments, "c", &signed(&input, &[7, 8])).is_none());
        assert!(audit_chain(&input, &segments[1..], "c", &result).is_none());
    }
}
