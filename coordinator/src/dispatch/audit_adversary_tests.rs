//! The adversary suite, audit part: a real coordinator, hand-made nodes on
//! the real QUIC wire, one honest node serving a job and the others
//! auditing it. A lying auditor (one that fails every audit) must not void
//! an honest node's pay nor get it banned, and a node that never placed
//! itself (it reports no memory) is never asked to audit.
//!
//! Each step waits on an event: an auditor's next assignment, the audit's
//! recorded state. Waits are bounded ([`WAIT`]) only so that a broken
//! coordinator fails the test instead of hanging it. The audit window is
//! long ([`WINDOW_MS`]) and the pay is settled explicitly at a time past
//! it, so no verdict depends on how fast this machine is.

use std::time::Duration;

use mlxnet_proto::{
    claim,
    frame::{read_frame, write_frame},
    v1::{
        job_event, job_update, jobs_client::JobsClient, Assignment, AuditVerdict, JobUpdate,
        SignedClaim, WatchJobRequest,
    },
};

use crate::{
    audit::{AuditConfig, Audits, NodeRecord},
    ledger::settle::Settlement,
    test_utils::{books, prompt_job, spawn_app, tokens_of, Books, FakeNode, TestApp},
    util::now_ms,
};

/// The honest node's record after its one job's audit passed.
const PASSED_ONCE: NodeRecord = NodeRecord {
    clean: 1,
    failed: 0,
    banned: false,
};

/// The bound on any one wait (a failure, never a verdict).
const WAIT: Duration = Duration::from_secs(20);
/// The test coordinator's audit window.
const WINDOW_MS: i64 = 10 * 60 * 1000;

/// A coordinator that audits every job and bans at the first counted
/// failure: one unchecked failing verdict would ban the honest node.
async fn app() -> TestApp {
    spawn_app(|c| {
        c.audit = AuditConfig {
            rate_new: 1.0,
            rate_floor: 1.0,
            window_ms: WINDOW_MS,
            ban_after: 1,
            ..AuditConfig::default()
        };
        c.ledger.sweep_interval_ms = 3_600_000;
    })
    .await
}

fn hex_of(node: &FakeNode) -> String {
    hex::encode(node.key.verifying_key().to_bytes())
}

/// `node` takes its next assignment, which must be the audit of `job`,
/// and answers it with a signed verdict `passed`; returns once the
/// coordinator has ended the audit's stream (it read the verdict).
async fn answer_audit(node: &FakeNode, job: &str, passed: bool) {
    let never = || format!("auditor {} was never asked", &hex_of(node)[..8]);
    let (mut send, mut recv) = match tokio::time::timeout(WAIT, node.conn.accept_bi()).await {
        Ok(Ok(streams)) => streams,
        Ok(Err(e)) => panic!("{}: its connection ended ({e})", never()),
        Err(_) => panic!("{}", never()),
    };
    let a: Assignment = read_frame(&mut recv).await.unwrap();
    assert_eq!(a.job_id, job);
    let audited: SignedClaim = a
        .audit
        .and_then(|t| t.claim)
        .expect("the assignment is an audit");
    let verdict = AuditVerdict {
        job_id: a.job_id.clone(),
        claim_signature: audited.signature,
        passed,
        findings: if passed {
            vec![]
        } else {
            vec!["every token is wrong".into()]
        },
        auditor_id: node.key.verifying_key().to_bytes().to_vec(),
        ..Default::default()
    };
    let update = JobUpdate {
        msg: Some(job_update::Msg::Verdict(claim::sign_verdict(
            verdict, &node.key,
        ))),
    };
    write_frame(&mut send, &update).await.unwrap();
    let mut buf = [0u8; 64];
    let ended = tokio::time::timeout(WAIT, async {
        while let Ok(Some(_)) = recv.read(&mut buf).await {}
    })
    .await;
    assert!(
        ended.is_ok(),
        "the coordinator never ended the audit stream"
    );
}

/// The honest node holding a job it has not answered yet.
struct Served {
    honest: FakeNode,
    operator: String,
    job: String,
    send: quinn::SendStream,
    signed: SignedClaim,
    /// The books once the job's hold is placed.
    before: Books,
}

/// Registers the honest node, submits a job and has the honest node take
/// it (it answers in [`Served::finish`], once the auditors a test wants
/// are online).
async fn honest_node_takes_a_job(app: &TestApp) -> Served {
    let honest = FakeNode::register(app, 62).await;
    let operator = app.ledger.link_node(&hex_of(&honest), "").await.unwrap();
    let mut jobs = JobsClient::new(app.grpc().await);
    let job = jobs
        .submit(prompt_job("The capital of France is", 8))
        .await
        .unwrap()
        .into_inner()
        .id;
    let (send, _recv, a) = honest.next_assignment().await;
    assert_eq!(a.job_id, job);
    let before = books(&app.ledger, &app.client_account, &operator).await;
    let signed = claim::sign(honest.claim(&a, vec![7, 8], " Paris"), &honest.key);
    Served {
        honest,
        operator,
        job,
        send,
        signed,
        before,
    }
}

impl Served {
    /// The honest node streams and signs its answer; returns once the job
    /// completed.
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
            if let Some(job_event::Event::Failed(f)) = e.event {
                panic!("the job failed: {}", f.reason);
            }
        }
    }
}

async fn audit_state(app: &TestApp, job: &str) -> Option<String> {
    let audits = Audits::of_store(app.ledger.store(), AuditConfig::default())
        .await
        .unwrap();
    audits.state(job).await.unwrap()
}

async fn record(app: &TestApp, node: &FakeNode) -> NodeRecord {
    let audits = Audits::of_store(app.ledger.store(), AuditConfig::default())
        .await
        .unwrap();
    audits.record(&hex_of(node)).await.unwrap()
}

/// Waits until `job`'s audit is no longer pending; returns its state.
async fn audit_ended(app: &TestApp, job: &str) -> String {
    tokio::time::timeout(WAIT, async {
        loop {
            match audit_state(app, job).await.as_deref() {
                Some("pending") | None => tokio::time::sleep(Duration::from_millis(20)).await,
                Some(s) => return s.to_owned(),
            }
        }
    })
    .await
    .expect("the audit ended")
}

/// The job's hold settles past its window: the honest node is paid what it
/// claimed, the client paid that and the fee, and the books hold.
async fn honest_node_is_paid(app: &TestApp, job: &str, operator: &str, before: &Books) {
    let id: mlxnet_proto::ids::JobId = job.parse().unwrap();
    let settled = app
        .ledger
        .settle_job(id, now_ms() + WINDOW_MS + 1_000)
        .await
        .unwrap();
    assert!(
        matches!(settled, Settlement::Paid { .. }),
        "the honest node's job was not paid: {settled:?}"
    );
    let paid = books(&app.ledger, &app.client_account, operator).await;
    assert!(paid.operator.balance() > 0, "the honest node was paid");
    assert_eq!(paid.client.debits_pending, 0, "the hold was settled");
    let spent = before.client.balance() - paid.client.balance();
    assert_eq!(
        spent,
        paid.operator.balance() + paid.fee.balance() - before.fee.balance(),
        "what the client paid went to the honest node and the fee"
    );
    let broken = app.ledger.violations(now_ms()).await.unwrap();
    assert!(broken.is_empty(), "{broken:?}");
}

/// Hole 2: the only other node online fails every audit. Its failing
/// verdict is not taken alone: a second auditor disagrees, a third
/// decides, and the liar (the minority) is the one counted against (and,
/// at `ban_after = 1`, banned); the honest node is paid and not banned.
#[tokio::test]
async fn a_lying_auditor_cannot_void_an_honest_nodes_pay_nor_ban_it() {
    let app = app().await;
    let mut served = honest_node_takes_a_job(&app).await;
    let job = served.job.clone();
    // The liar joins while the honest node holds the job, so the job's
    // audit finds it alone.
    let liar = FakeNode::register(&app, 61).await;
    served.finish(&app).await;
    answer_audit(&liar, &job, false).await;
    assert_eq!(
        record(&app, &served.honest).await,
        NodeRecord::default(),
        "one failing verdict counted against the honest node"
    );
    let second = FakeNode::register(&app, 63).await;
    answer_audit(&second, &job, true).await;
    let third = FakeNode::register(&app, 64).await;
    answer_audit(&third, &job, true).await;
    assert_eq!(audit_ended(&app, &job).await, "passed");

    assert_eq!(
        record(&app, &served.honest).await,
        PASSED_ONCE,
        "the honest node's record is one clean audit"
    );
    assert_eq!(
        record(&app, &liar).await,
        NodeRecord {
            clean: 0,
            failed: 1,
            banned: true
        },
        "the auditor in the minority is counted against"
    );
    for agreed in [&second, &third] {
        assert_eq!(record(&app, agreed).await, NodeRecord::default());
    }
    honest_node_is_paid(&app, &job, &served.operator, &served.before).await;
    app.stop().await;
}

/// Hole 2: a node that connected first but never placed itself (it
/// reports no memory, so no job is ever placed on it) is not drawn as an
/// auditor, even when it is the only other node online.
#[tokio::test]
async fn a_node_that_never_placed_itself_is_not_an_auditor() {
    let app = app().await;
    let mut served = honest_node_takes_a_job(&app).await;
    let job = served.job.clone();
    let idle = FakeNode::register_with(&app, 61, |h| {
        if let Some(hw) = h.hardware.as_mut() {
            hw.memory_bytes = 0;
            hw.free_memory_bytes = 0;
        }
    })
    .await;
    // The idle node reports anything it is sent (and never answers).
    let (asked_tx, mut asked) = tokio::sync::mpsc::unbounded_channel::<String>();
    let idle_conn = idle.conn.clone();
    let idle_task = tokio::spawn(async move {
        while let Ok((_send, mut recv)) = idle_conn.accept_bi().await {
            let a: Assignment = read_frame(&mut recv).await.unwrap();
            let _ = asked_tx.send(a.job_id);
        }
    });
    served.finish(&app).await;
    let auditor = FakeNode::register(&app, 63).await;
    answer_audit(&auditor, &job, true).await;
    assert_eq!(audit_ended(&app, &job).await, "passed");
    assert!(
        asked.try_recv().is_err(),
        "the node that never placed itself was asked to audit"
    );
    assert_eq!(
        record(&app, &served.honest).await,
        PASSED_ONCE,
        "the honest node's record is one clean audit"
    );
    honest_node_is_paid(&app, &job, &served.operator, &served.before).await;
    idle_task.abort();
    drop(idle);
    app.stop().await;
}
