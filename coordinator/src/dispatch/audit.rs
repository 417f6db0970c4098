//! Running audits: after a job completes, maybe pick it for audit, find
//! another node to re-score it, send the audit assignment and count the
//! signed verdict.
//!
//! # Invariants
//! - The auditor is an online, unbanned node other than the one that
//!   served the job, holding the job's model file, with a free job slot
//!   (taken for the audit's length, so placement does not over-fill it).
//! - A verdict counts only if it verifies, is signed by the node it was sent
//!   to, and names this job and the audited claim's signature.
//!
//! # Failure
//! Anything that goes wrong with one auditor (unreachable, refused, bad
//! verdict) is logged and another is tried, until the audit window closes;
//! then the audit is `missed` and the job is paid as usual.

use std::{sync::Arc, time::Duration};

use mlxnet_proto::{
    claim,
    frame::FrameError,
    ids::NodeId,
    v1::{job_update, Assignment, AuditTask, SignedClaim, SignedVerdict},
};
use tracing::{debug, info, warn};

use super::{input_bytes, Dispatcher};
use crate::{
    audit::{audit_rate, Ended},
    catalogue::Model,
    domain::JobRecord,
    ledger,
    link::{
        job::{JobStream, CODE_REFUSED},
        session::Session,
    },
    util::{error_chain, now_ms},
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
        // A resumed attempt's claim covers only the tokens after the ones
        // earlier attempts streamed (its prompt digest binds those too); an
        // audit re-scores a whole answer from the job's input, so jobs that
        // were handed off are not audited.
        let whole = signed
            .claim
            .as_ref()
            .is_some_and(|c| c.prompt_sha256 == claim::input_digest(&job.input));
        if !whole {
            return;
        }
        let record = match self.audits.record(node).await {
            Ok(r) => r,
            Err(e) => {
                warn!(error = %error_chain(&e), "reading the node's audit record failed");
                return;
            }
        };
        let rate = audit_rate(&self.audits.config, &record);
        if rate <= 0.0 || rand::random::<f64>() >= rate {
            return;
        }
        match self.audits.begin(&job.id.to_string(), node, now_ms()).await {
            Ok(true) => {}
            Ok(false) => return,
            Err(e) => {
                warn!(error = %error_chain(&e), "recording the audit failed");
                return;
            }
        }
        let Ok(served_by) = node.parse::<NodeId>() else {
            return;
        };
        debug!(job_id = %job.id, node = %served_by.short(), rate, "job picked for audit");
        let this = Arc::clone(self);
        let (job, signed) = (job.clone(), signed.clone());
        self.spawn(async move { this.run_audit(job, model, signed, served_by).await });
    }

    /// Finds auditors and sends them the audit until a verdict counts or
    /// the window closes.
    async fn run_audit(
        self: Arc<Self>,
        job: JobRecord,
        model: Model,
        signed: SignedClaim,
        served_by: NodeId,
    ) {
        // The audit must end while the pay is still held; without a window
        // (pay not held) it may take as long as a job.
        let window = match self.audits.config.window_ms {
            w if w > 0 => Duration::from_millis(w as u64),
            _ => Duration::from_millis(self.config.job_timeout_ms),
        };
        let deadline = tokio::time::Instant::now() + window;
        let job_id = job.id.to_string();
        while tokio::time::Instant::now() < deadline {
            let auditor = self.sessions.all().into_iter().find(|s| {
                s.node_id != served_by
                    && s.pod.is_none()
                    && !self.audits.is_banned(&s.node_id)
                    && s.models.contains(&model.sha256)
                    && s.running_jobs() < s.max_concurrent_jobs
            });
            let Some(auditor) = auditor else {
                tokio::select! {
                    _ = self.shutdown_token().cancelled() => return,
                    _ = tokio::time::sleep(AUDITOR_POLL) => {}
                }
                continue;
            };
            let shape = model.job(input_bytes(&job.input), job.sampling.max_tokens);
            let reservation = auditor.reserve(shape.memory_needed());
            let verdict = tokio::select! {
                _ = self.shutdown_token().cancelled() => return,
                v = self.ask(&job, &model, &signed, &auditor) => v,
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
            let ended = self
                .audits
                .finish(
                    &job_id,
                    &auditor.node_id.to_string(),
                    &verdict,
                    passed,
                    now_ms(),
                )
                .await;
            match ended {
                Ok(Ended::Counted(record)) => {
                    let findings = verdict
                        .verdict
                        .as_ref()
                        .map(|v| v.findings.join("; "))
                        .unwrap_or_default();
                    info!(job_id = %job.id, node = %served_by.short(), auditor = %auditor.node_id.short(), passed, %findings, ?record, "audit ended");
                    if !passed {
                        // Voids the hold now; a passed audit's pay waits for
                        // the window (the sweep).
                        ledger::settle_logged(&self.ledger, job.id).await;
                    }
                    if record.banned {
                        warn!(node = %served_by, "node banned from placement after failed audits");
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
        info!(job_id = %job.id, "no auditor within the window; audit missed");
    }

    /// Sends the audit of `signed` to `auditor` and returns its verdict, if
    /// it is one that counts.
    async fn ask(
        &self,
        job: &JobRecord,
        model: &Model,
        signed: &SignedClaim,
        auditor: &Session,
    ) -> Result<SignedVerdict, String> {
        let assignment = Assignment {
            job_id: job.id.to_string(),
            attempt: job.attempt,
            model: job.model.clone(),
            model_sha256: model.sha256.to_vec(),
            input: Some(job.input.clone()),
            sampling: Some(job.sampling.clone()),
            resume: None,
            audit: Some(AuditTask {
                claim: Some(signed.clone()),
            }),
        };
        let mut stream = JobStream::open(&auditor.connection, &assignment)
            .await
            .map_err(|e| format!("could not reach the auditor: {e}"))?;
        let limit = Duration::from_millis(self.config.job_timeout_ms);
        let answer = tokio::time::timeout(limit, async {
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
        .await
        .map_err(|_| format!("no verdict within {limit:?}"))?;
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
