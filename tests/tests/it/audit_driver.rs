//! The audit driver's paths (`dispatch::audit`) on the real QUIC wire, with
//! hand-made nodes (the coordinator's `FakeNode`) so each test controls
//! every frame an auditor sends:
//! - a verdict that must not count (signed by another key than the
//!   auditor's, about another job, about another claim) is refused, and
//!   the audit is sent to another auditor, whose verdict decides it;
//! - an auditor that fails the audit (its engine reports a failure) is not
//!   counted against, and the audit goes to another auditor;
//! - an auditor that takes the audit and never answers holds it no longer
//!   than the audit window: the audit ends `missed` when the window closes
//!   and the job is paid.
//!
//! The honest node (seed [`HONEST`]) serves one job; every job is audited
//! (`rate_new` 1) and one counted failure bans (`ban_after` 1), so a bad
//! verdict that counted would show in the records. Every step waits on an
//! event (an auditor's assignment, the audit's recorded state); [`WAIT`]
//! bounds each wait only so a broken coordinator fails instead of hanging.

use std::time::Duration;

use mlxnet_coordinator::{
    audit::{AuditConfig, Audits, NodeRecord},
    ledger::settle::Settlement,
    test_utils::{books, node_hex, node_key, prompt_job, spawn_app, tokens_of, FakeNode, TestApp},
    util::now_ms,
};
use mlxnet_proto::{
    claim,
    frame::{read_frame, write_frame},
    v1::{
        job_event, job_update, jobs_client::JobsClient, node_control, Assignment, AuditVerdict,
        Heartbeat, JobUpdate, NodeControl, SignedClaim, WatchJobRequest,
    },
};

/// The node that serves the audited job.
const HONEST: u64 = 81;
/// The auditor that misbehaves.
const BAD: u64 = 82;
/// The honest auditor.
const GOOD: u64 = 83;
/// A key no node of the test uses: what a forged verdict is signed with.
const STRANGER: u64 = 89;

/// The bound on any one wait (a failure, never a verdict).
const WAIT: Duration = Duration::from_secs(60);
/// The audit window where nothing should reach it.
const LONG_WINDOW_MS: i64 = 10 * 60 * 1000;

/// A coordinator that audits every job, bans at the first counted failure
/// and trusts the auditors (so both may be drawn); `window_ms` is its audit
/// window. A job (and an audit's exchange with one auditor) may take ten
/// minutes: far past [`WAIT`].
async fn app(window_ms: i64) -> TestApp {
    spawn_app(|c| {
        c.audit = AuditConfig {
            rate_new: 1.0,
            rate_floor: 1.0,
            window_ms,
            ban_after: 1,
            trusted: vec![node_hex(BAD), node_hex(GOOD)],
            ..AuditConfig::default()
        };
        c.job_timeout_ms = 10 * 60 * 1000;
        c.ledger.sweep_interval_ms = 3_600_000;
    })
    .await
}

fn hex_of(node: &FakeNode) -> String {
    hex::encode(node.key.verifying_key().to_bytes())
}

/// The honest node holding its job, not yet answered.
struct Served {
    honest: FakeNode,
    job: String,
    operator: String,
    send: quinn::SendStream,
    signed: SignedClaim,
}

/// The honest node registers and takes a job (it answers in
/// [`Served::finish`], once the auditors a test wants are online: an
/// auditor online before would be as able to take the job itself).
async fn honest_takes_a_job(app: &TestApp) -> Served {
    let honest = FakeNode::register(app, HONEST).await;
    let operator = app.ledger.link_node(&hex_of(&honest), "").await.unwrap();
    let mut jobs = JobsClient::new(app.grpc().await);
    let job = jobs
        .submit(prompt_job("The capital of France is", 8))
        .await
        .unwrap()
        .into_inner()
        .id;
    let (send, _recv, a) = tokio::time::timeout(WAIT, honest.next_assignment())
        .await
        .expect("the honest node was given the job");
    assert_eq!(a.job_id, job);
    let signed = claim::sign(honest.claim(&a, vec![7, 8], " Paris"), &honest.key);
    Served {
        honest,
        job,
        operator,
        send,
        signed,
    }
}

impl Served {
    /// Streams and signs the answer; returns once the job completed.
    async fn finish(&mut self, app: &TestApp) {
        let mut jobs = JobsClient::new(app.grpc().await);
        let mut watch = jobs
            .watch(WatchJobRequest {
                job_id: self.job.clone(),
            })
            .await
            .unwrap()
            .into_inner();
        let c = self.signed.claim.clone().unwrap();
        write_frame(&mut self.send, &tokens_of(0, &c))
            .await
            .unwrap();
        let result = JobUpdate {
            msg: Some(job_update::Msg::Result(self.signed.clone())),
        };
        write_frame(&mut self.send, &result).await.unwrap();
        while let Some(e) = watch.message().await.unwrap() {
            match e.event {
                Some(job_event::Event::Completed(_)) => return,
                Some(job_event::Event::Failed(f)) => panic!("the job failed: {}", f.reason),
                _ => {}
            }
        }
        panic!("the watch ended before the job completed");
    }
}

/// How an auditor misbehaves.
#[derive(Clone, Copy, Debug)]
enum Bad {
    /// A failing verdict signed by another key (named as the auditor).
    OtherSigner,
    /// A failing verdict, its own, about another job.
    OtherJob,
    /// A failing verdict, its own, about another claim of this job.
    OtherClaim,
    /// No verdict: the audit fails on its side.
    Fails,
    /// Takes the audit and never answers.
    Silent,
}

/// What `node` sends for audit assignment `a` when it misbehaves as `bad`
/// (`None`: nothing).
fn bad_answer(node: &FakeNode, a: &Assignment, bad: Bad) -> Option<JobUpdate> {
    let audited: SignedClaim = a.audit.clone().and_then(|t| t.claim).expect("an audit");
    let mut verdict = AuditVerdict {
        job_id: a.job_id.clone(),
        claim_signature: audited.signature,
        passed: false,
        findings: vec!["every token is wrong".into()],
        auditor_id: node.key.verifying_key().to_bytes().to_vec(),
        ..Default::default()
    };
    let mut key = node.key.clone();
    match bad {
        Bad::OtherSigner => {
            key = node_key(STRANGER);
            verdict.auditor_id = key.verifying_key().to_bytes().to_vec();
        }
        Bad::OtherJob => verdict.job_id = mlxnet_proto::ids::JobId::new().to_string(),
        Bad::OtherClaim => verdict.claim_signature = vec![0x5a; 64],
        Bad::Fails => {
            return Some(JobUpdate {
                msg: Some(job_update::Msg::Failure(job_update::Failure {
                    reason: "out of memory".into(),
                    retryable: true,
                })),
            })
        }
        Bad::Silent => return None,
    }
    Some(JobUpdate {
        msg: Some(job_update::Msg::Verdict(claim::sign_verdict(verdict, &key))),
    })
}

/// Serves every assignment `node` gets as `bad`; reports each job id it
/// was sent on `asked`. A silent auditor keeps each stream open. All along
/// the node heartbeats (once a second, well inside the coordinator's
/// timeout): it is online and responsive, only its answers are bad.
fn misbehave(
    mut node: FakeNode,
    bad: Bad,
    asked: tokio::sync::mpsc::UnboundedSender<String>,
) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        let conn = node.conn.clone();
        let beat = NodeControl {
            msg: Some(node_control::Msg::Heartbeat(Heartbeat {
                free_memory_bytes: 8 << 30,
                ..Default::default()
            })),
        };
        let mut tick = tokio::time::interval(Duration::from_secs(1));
        let mut held = Vec::new();
        loop {
            tokio::select! {
                streams = conn.accept_bi() => {
                    let Ok((mut send, mut recv)) = streams else {
                        break;
                    };
                    let Ok(a) = read_frame::<_, Assignment>(&mut recv).await else {
                        break;
                    };
                    let _ = asked.send(a.job_id.clone());
                    match bad_answer(&node, &a, bad) {
                        Some(update) => {
                            let _ = write_frame(&mut send, &update).await;
                        }
                        None => held.push((send, recv)),
                    }
                }
                _ = tick.tick() => {
                    node.control(&beat).await;
                    node.control_reply().await;
                }
            }
        }
        drop(held);
    })
}

/// `node` takes its next assignment, which must be the audit of `job`, and
/// answers it with its own signed passing verdict.
async fn pass(node: &FakeNode, job: &str) {
    let (mut send, mut recv) = tokio::time::timeout(WAIT, node.conn.accept_bi())
        .await
        .expect("the good auditor was sent the audit")
        .unwrap();
    let a: Assignment = read_frame(&mut recv).await.unwrap();
    assert_eq!(a.job_id, job);
    let audited: SignedClaim = a.audit.and_then(|t| t.claim).expect("an audit");
    let verdict = AuditVerdict {
        job_id: a.job_id,
        claim_signature: audited.signature,
        passed: true,
        auditor_id: node.key.verifying_key().to_bytes().to_vec(),
        ..Default::default()
    };
    let update = JobUpdate {
        msg: Some(job_update::Msg::Verdict(claim::sign_verdict(
            verdict, &node.key,
        ))),
    };
    write_frame(&mut send, &update).await.unwrap();
    // The coordinator ends the stream once it read the verdict.
    let mut buf = [0u8; 64];
    while let Ok(Some(_)) = recv.read(&mut buf).await {}
}

async fn audits(app: &TestApp) -> Audits {
    Audits::of_store(app.ledger.store(), AuditConfig::default())
        .await
        .unwrap()
}

/// Waits until `job`'s audit is no longer pending; returns how it ended.
async fn audit_ended(app: &TestApp, job: &str) -> String {
    let audits = audits(app).await;
    tokio::time::timeout(WAIT, async {
        loop {
            match audits.state(job).await.unwrap().as_deref() {
                Some("pending") | None => tokio::time::sleep(Duration::from_millis(20)).await,
                Some(s) => return s.to_owned(),
            }
        }
    })
    .await
    .unwrap_or_else(|_| panic!("the audit of {job} did not end within {WAIT:?}"))
}

/// Past the window, the job's hold settles as a payment to the honest
/// node's operator, and the books hold.
async fn paid(app: &TestApp, job: &str, operator: &str, window_ms: i64) {
    let id: mlxnet_proto::ids::JobId = job.parse().unwrap();
    let settled = app
        .ledger
        .settle_job(id, now_ms() + window_ms + 1_000)
        .await
        .unwrap();
    assert!(
        matches!(settled, Settlement::Paid { .. }),
        "the honest node's job was not paid: {settled:?}"
    );
    let b = books(&app.ledger, &app.client_account, operator).await;
    assert!(b.operator.balance() > 0, "the honest node was paid");
    let broken = app.ledger.violations(now_ms()).await.unwrap();
    assert!(broken.is_empty(), "{broken:?}");
}

/// The bad auditor is the only one online when the job completes and is
/// sent the audit (at least once); then the good auditor joins, is sent it,
/// passes it, and that decides it: `passed` on one passing verdict, the
/// honest node clean and paid, nobody counted against. Had the bad answer
/// counted as a failing verdict, the audit would wait for a third auditor
/// that never comes (the test fails at [`WAIT`]) and the bad auditor would
/// be counted against.
async fn a_bad_answer_is_not_counted_and_another_auditor_decides(bad: Bad) {
    let app = app(LONG_WINDOW_MS).await;
    let mut served = honest_takes_a_job(&app).await;
    let job = served.job.clone();
    let (asked_tx, mut asked) = tokio::sync::mpsc::unbounded_channel();
    let liar = FakeNode::register(&app, BAD).await;
    let liar_hex = hex_of(&liar);
    let liar = misbehave(liar, bad, asked_tx);
    served.finish(&app).await;
    let first = tokio::time::timeout(WAIT, asked.recv())
        .await
        .expect("the bad auditor, alone, was sent the audit");
    assert_eq!(first.as_deref(), Some(job.as_str()));
    let good = FakeNode::register(&app, GOOD).await;
    pass(&good, &job).await;
    assert_eq!(audit_ended(&app, &job).await, "passed", "{bad:?}");
    let audits = audits(&app).await;
    assert_eq!(
        audits.record(&hex_of(&served.honest)).await.unwrap(),
        NodeRecord {
            clean: 1,
            jobs: 1,
            ..NodeRecord::default()
        },
        "{bad:?}: the honest node passed one audit"
    );
    for auditor in [liar_hex, hex_of(&good), node_hex(STRANGER)] {
        assert_eq!(
            audits.record(&auditor).await.unwrap(),
            NodeRecord::default(),
            "{bad:?}: an auditor was counted (for or against)"
        );
    }
    paid(&app, &job, &served.operator, LONG_WINDOW_MS).await;
    liar.abort();
    drop(good);
    app.stop().await;
}

/// A verdict signed by another key than the auditor's it was sent to.
#[tokio::test]
async fn a_verdict_signed_by_another_key_is_refused_and_another_auditor_decides() {
    a_bad_answer_is_not_counted_and_another_auditor_decides(Bad::OtherSigner).await;
}

/// A verdict, the auditor's own, about another job.
#[tokio::test]
async fn a_verdict_about_another_job_is_refused_and_another_auditor_decides() {
    a_bad_answer_is_not_counted_and_another_auditor_decides(Bad::OtherJob).await;
}

/// A verdict, the auditor's own, about another claim than the audited one.
#[tokio::test]
async fn a_verdict_about_another_claim_is_refused_and_another_auditor_decides() {
    a_bad_answer_is_not_counted_and_another_auditor_decides(Bad::OtherClaim).await;
}

/// An auditor whose audit fails on its side (no verdict).
#[tokio::test]
async fn an_auditor_that_fails_the_audit_is_not_counted_and_another_decides() {
    a_bad_answer_is_not_counted_and_another_auditor_decides(Bad::Fails).await;
}

/// The audit window of [`a_silent_auditor_holds_the_audit_no_longer_than_its_window`].
const SHORT_WINDOW_MS: i64 = 3_000;

/// No verdict in time: the only auditor online takes the audit and never
/// answers (its stream stays open, it heartbeats all along; a job may take
/// ten minutes). The audit
/// ends `missed` once its window ([`SHORT_WINDOW_MS`]) has closed, not when
/// the auditor's ten minutes are up: the pay is held only for the window,
/// and an audit still open after it could void pay already paid. The job
/// is paid, and nobody is counted for or against.
#[tokio::test]
async fn a_silent_auditor_holds_the_audit_no_longer_than_its_window() {
    let app = app(SHORT_WINDOW_MS).await;
    let mut served = honest_takes_a_job(&app).await;
    let job = served.job.clone();
    let (asked_tx, mut asked) = tokio::sync::mpsc::unbounded_channel();
    let silent = FakeNode::register(&app, BAD).await;
    let silent_hex = hex_of(&silent);
    let silent = misbehave(silent, Bad::Silent, asked_tx);
    served.finish(&app).await;
    let first = tokio::time::timeout(WAIT, asked.recv())
        .await
        .expect("the silent auditor was sent the audit");
    assert_eq!(first.as_deref(), Some(job.as_str()));
    assert_eq!(audit_ended(&app, &job).await, "missed");
    let audits = audits(&app).await;
    assert_eq!(
        audits.record(&hex_of(&served.honest)).await.unwrap(),
        NodeRecord {
            jobs: 1,
            ..NodeRecord::default()
        }
    );
    assert_eq!(
        audits.record(&silent_hex).await.unwrap(),
        NodeRecord::default()
    );
    paid(&app, &job, &served.operator, SHORT_WINDOW_MS).await;
    silent.abort();
    app.stop().await;
}
