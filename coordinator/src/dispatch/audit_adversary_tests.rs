//! The adversary suite, audit part: a real coordinator, hand-made nodes on
//! the real QUIC wire, one honest node serving a job and the others
//! auditing it. A lying auditor (one that fails every audit) must not void
//! an honest node's pay nor get it banned, and a node that never placed
//! itself (it reports no memory) is never asked to audit. New keys are on
//! probation: never drawn as auditors (so colluding new keys cannot
//! confirm each other's false failures), no availability rewards.
//!
//! The established auditors here are the operator's trusted nodes
//! ([`TRUSTED`]: the bootstrap of a young network); the other seeds are
//! new keys.
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
    ledger::{settle::Settlement, REWARD_POOL},
    test_utils::{books, node_hex, prompt_job, spawn_app, tokens_of, Books, FakeNode, TestApp},
    util::now_ms,
};

/// The honest node's record after its one job's audit passed.
const PASSED_ONCE: NodeRecord = NodeRecord {
    clean: 1,
    failed: 0,
    banned: false,
    jobs: 1,
    failed_attempts: 0,
    wrong_verdicts: 0,
};

/// The seeds of the nodes the test coordinator trusts (established from the
/// start): the honest auditors, the liar of the first test, and the honest
/// established node (62) of the colluders' test.
const TRUSTED: [u64; 3] = [61, 63, 64];
/// New keys (on probation).
const NEW_KEYS: [u64; 2] = [71, 72];

/// The bound on any one wait (a failure, never a verdict).
const WAIT: Duration = Duration::from_secs(20);
/// The test coordinator's audit window.
const WINDOW_MS: i64 = 10 * 60 * 1000;

/// A coordinator that audits every job and bans at the first counted
/// failure: one unchecked failing verdict would ban the honest node.
async fn app() -> TestApp {
    app_trusting(&TRUSTED, WINDOW_MS).await
}

/// [`app`] trusting the nodes of `seeds`, with an audit window of
/// `window_ms`.
async fn app_trusting(seeds: &[u64], window_ms: i64) -> TestApp {
    let trusted = seeds.iter().map(|&s| node_hex(s)).collect();
    spawn_app(|c| {
        c.audit = AuditConfig {
            rate_new: 1.0,
            rate_floor: 1.0,
            window_ms,
            ban_after: 1,
            trusted,
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
    let update = verdict_on(node, a, passed).expect("the assignment is an audit");
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

/// `node`'s signed verdict `passed` on audit assignment `a` (None: `a` is
/// not an audit).
fn verdict_on(node: &FakeNode, a: Assignment, passed: bool) -> Option<JobUpdate> {
    let audited: SignedClaim = a.audit.and_then(|t| t.claim)?;
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
    Some(JobUpdate {
        msg: Some(job_update::Msg::Verdict(claim::sign_verdict(
            verdict, &node.key,
        ))),
    })
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
        NodeRecord {
            jobs: 1,
            ..NodeRecord::default()
        },
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
            wrong_verdicts: 1,
            banned: true,
            ..NodeRecord::default()
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

/// Answers every audit `node` is sent with a failing verdict (a hostile
/// node on probation hoping to be drawn); returns how many it was sent.
fn fail_every_audit(node: FakeNode) -> tokio::task::JoinHandle<usize> {
    tokio::spawn(async move {
        let mut asked = 0;
        while let Ok((mut send, mut recv)) = node.conn.accept_bi().await {
            let Ok(a) = read_frame::<_, Assignment>(&mut recv).await else {
                break;
            };
            asked += 1;
            if let Some(update) = verdict_on(&node, a, false) {
                let _ = write_frame(&mut send, &update).await;
            }
        }
        asked
    })
}

/// A short audit window, for the tests where no established auditor is
/// online: the audit ends `missed` when it closes. (Hostile nodes that
/// were drawn would answer within milliseconds, well inside it.)
const SHORT_WINDOW_MS: i64 = 3_000;

/// Probation: a new key online while the honest node's job completes, able
/// to run it (memory, model, free slot) and the only other node, is never
/// sent the audit: with no established auditor the audit waits and is
/// `missed` when the window closes, and the honest node is paid.
#[tokio::test]
async fn a_new_key_is_never_drawn_as_auditor() {
    let app = app_trusting(&[], SHORT_WINDOW_MS).await;
    let mut served = honest_node_takes_a_job(&app).await;
    let job = served.job.clone();
    let stranger = FakeNode::register(&app, NEW_KEYS[0]).await;
    let stranger_hex = hex_of(&stranger);
    let stranger = fail_every_audit(stranger);
    served.finish(&app).await;
    assert_eq!(audit_ended(&app, &job).await, "missed");
    assert_eq!(
        record(&app, &served.honest).await,
        NodeRecord {
            jobs: 1,
            ..NodeRecord::default()
        }
    );
    let audits = Audits::of_store(app.ledger.store(), AuditConfig::default())
        .await
        .unwrap();
    assert_eq!(
        audits.record(&stranger_hex).await.unwrap(),
        NodeRecord::default(),
        "the new key gave no verdict that counted"
    );
    honest_node_is_paid(&app, &job, &served.operator, &served.before).await;
    app.stop().await;
    let asked = tokio::time::timeout(WAIT, stranger).await;
    assert_eq!(
        asked.expect("the new key's connection ended").unwrap(),
        0,
        "the new key was sent an audit (or a job)"
    );
}

/// Hole 2 with colluders: two new keys, the only other nodes online able
/// to audit, fail every audit they are sent (`ban_after = 1`). An
/// established honest node (trusted here) serving a job is neither voided
/// nor banned: the new keys are never drawn (the audit is `missed` when the
/// window closes), the node is paid and placed again.
#[tokio::test]
async fn two_colluding_new_keys_that_fail_every_audit_cannot_ban_an_honest_established_node() {
    let app = app_trusting(&[62], SHORT_WINDOW_MS).await;
    let mut served = honest_node_takes_a_job(&app).await;
    let job = served.job.clone();
    let mut colluders = Vec::new();
    for seed in NEW_KEYS {
        colluders.push(fail_every_audit(FakeNode::register(&app, seed).await));
    }
    served.finish(&app).await;
    assert_eq!(audit_ended(&app, &job).await, "missed");
    let honest = record(&app, &served.honest).await;
    assert_eq!(
        honest,
        NodeRecord {
            jobs: 1,
            ..NodeRecord::default()
        },
        "the honest node is clean, not banned"
    );
    honest_node_is_paid(&app, &job, &served.operator, &served.before).await;
    // The colluders leave; the honest node is placed again.
    for c in colluders {
        c.abort();
        let _ = c.await;
    }
    let mut jobs = JobsClient::new(app.grpc().await);
    let next = jobs
        .submit(prompt_job("The capital of Italy is", 4))
        .await
        .unwrap()
        .into_inner()
        .id;
    let (_send, _recv, a) = tokio::time::timeout(WAIT, served.honest.next_assignment())
        .await
        .expect("the honest node was placed again");
    assert_eq!(a.job_id, next);
    let broken = app.ledger.violations(now_ms()).await.unwrap();
    assert!(broken.is_empty(), "{broken:?}");
    app.stop().await;
}

/// Probation: a dedicated new key that heartbeats earns no availability
/// reward; a dedicated trusted node beside it, online as long, does. Both
/// served a job (a node earns only for a model it has shown it serves).
#[tokio::test]
async fn a_node_on_probation_earns_no_availability_reward() {
    let trusted = vec![node_hex(TRUSTED[1])];
    let app = spawn_app(|c| {
        c.audit = AuditConfig {
            trusted,
            ..AuditConfig::off()
        };
        c.ledger.reward_epoch_ms = 1_000;
        c.ledger.reward_per_gib_hour = 3_600_000_000;
        c.ledger.reward_pool_per_epoch = 1_000_000_000;
        c.ledger.sweep_interval_ms = 3_600_000;
        c.heartbeat_interval_ms = 600_000;
        c.heartbeat_timeout_ms = 1_200_000;
    })
    .await;
    app.ledger
        .grant("pool", REWARD_POOL, 1_000_000_000, "fund")
        .await
        .unwrap();
    let dedicated = |h: &mut mlxnet_proto::v1::Hello| h.mode = "dedicated".into();
    let mut new = FakeNode::register_with(&app, NEW_KEYS[0], dedicated).await;
    let mut old = FakeNode::register_with(&app, TRUSTED[1], dedicated).await;
    let new_op = app.ledger.link_node(&hex_of(&new), "").await.unwrap();
    let old_op = app.ledger.link_node(&hex_of(&old), "").await.unwrap();
    // Each serves one job: the first goes to one, the second (that one
    // busy) to the other.
    let mut jobs = JobsClient::new(app.grpc().await);
    let mut held = Vec::new();
    for _ in 0..2 {
        let job = jobs
            .submit(prompt_job("The capital of France is", 8))
            .await
            .unwrap()
            .into_inner()
            .id;
        let (which, send, _recv, a) = next_of(&[&new, &old]).await;
        assert_eq!(a.job_id, job);
        held.push((which, send, a));
    }
    assert_ne!(held[0].0, held[1].0, "one job each");
    for (which, mut send, a) in held {
        let node = if which == 0 { &new } else { &old };
        let signed = claim::sign(node.claim(&a, vec![7, 8], " Paris"), &node.key);
        let c = signed.claim.clone().unwrap();
        let mut watch = jobs
            .watch(WatchJobRequest {
                job_id: a.job_id.clone(),
            })
            .await
            .unwrap()
            .into_inner();
        write_frame(&mut send, &tokens_of(0, &c)).await.unwrap();
        let result = JobUpdate {
            msg: Some(job_update::Msg::Result(signed)),
        };
        write_frame(&mut send, &result).await.unwrap();
        while let Some(e) = watch.message().await.unwrap() {
            if let Some(job_event::Event::Failed(f)) = e.event {
                panic!("the job failed: {}", f.reason);
            }
        }
    }
    // Some online time to be paid for (the reward counts milliseconds).
    tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    let beat = mlxnet_proto::v1::NodeControl {
        msg: Some(mlxnet_proto::v1::node_control::Msg::Heartbeat(
            mlxnet_proto::v1::Heartbeat {
                free_memory_bytes: 8 << 30,
                ..Default::default()
            },
        )),
    };
    for node in [&mut new, &mut old] {
        // The second beat is read only after the first one's write (the
        // control loop takes one frame at a time).
        node.control(&beat).await;
        node.control(&beat).await;
        node.control_reply().await;
        node.control_reply().await;
    }
    let balance = |op: String| {
        let ledger = app.ledger.clone();
        async move {
            ledger
                .account(&op)
                .await
                .unwrap()
                .map_or(0, |a| a.balance())
        }
    };
    let before = books(&app.ledger, &app.client_account, &new_op).await;
    let old_before = balance(old_op.clone()).await;
    assert!(app.ledger.pay_rewards(now_ms() + 10_000).await.unwrap() > 0);
    assert!(
        balance(old_op).await > old_before,
        "the trusted node earned its reward"
    );
    assert_eq!(
        balance(new_op).await,
        before.operator.balance(),
        "the new key earned a reward on probation"
    );
    let broken = app.ledger.violations(now_ms()).await.unwrap();
    assert!(broken.is_empty(), "{broken:?}");
    app.stop().await;
}

/// The next assignment of any of `nodes`: which one (its index) got it,
/// and it.
async fn next_of(nodes: &[&FakeNode]) -> (usize, quinn::SendStream, quinn::RecvStream, Assignment) {
    let waits = nodes.iter().map(|n| Box::pin(n.next_assignment()));
    let got = tokio::time::timeout(WAIT, futures::future::select_all(waits)).await;
    let ((send, recv, a), which, _) = got.expect("no node was assigned the job");
    (which, send, recv, a)
}

/// Hole 5: a job whose attempt a node just failed is not handed straight
/// back to that node while another node can take it (both nodes alike,
/// so the cost model alone would pick the same node again).
#[tokio::test]
async fn a_job_a_node_just_failed_goes_to_another_node() {
    let app = app().await;
    let a = FakeNode::register(&app, TRUSTED[1]).await;
    let b = FakeNode::register(&app, TRUSTED[2]).await;
    let mut jobs = JobsClient::new(app.grpc().await);
    let job = jobs
        .submit(prompt_job("The capital of France is", 8))
        .await
        .unwrap()
        .into_inner()
        .id;
    let (first, mut send, _recv, got) = next_of(&[&a, &b]).await;
    assert_eq!(got.job_id, job);
    let failure = JobUpdate {
        msg: Some(job_update::Msg::Failure(job_update::Failure {
            reason: "out of memory".into(),
            retryable: true,
        })),
    };
    write_frame(&mut send, &failure).await.unwrap();
    let (second, _send, _recv, again) = next_of(&[&a, &b]).await;
    assert_eq!((again.job_id.as_str(), again.attempt), (job.as_str(), 2));
    assert_ne!(
        first, second,
        "the retry went back to the node that failed it"
    );
    let failed = [&a, &b][first];
    let audits = Audits::of_store(app.ledger.store(), AuditConfig::default())
        .await
        .unwrap();
    assert_eq!(
        audits
            .record(&hex_of(failed))
            .await
            .unwrap()
            .failed_attempts,
        1,
        "the failed attempt is in the node's record"
    );
    let broken = app.ledger.violations(now_ms()).await.unwrap();
    assert!(broken.is_empty(), "{broken:?}");
    app.stop().await;
}

/// A retried job is kept off every node that already failed it, not only
/// the last one, while another node can take it (the mixed-fleet run saw
/// jobs fail for good on attempts by A, B, A). Three nodes alike but for
/// their free memory (A least, C most): best fit prefers A, then B, then C,
/// and one failure leaves a node in the reliable tier, so only the rule
/// keeps the third attempt off A.
#[tokio::test]
async fn a_job_is_not_handed_back_to_any_node_that_failed_it() {
    let app = app().await;
    let free = |gib: u64| {
        move |h: &mut mlxnet_proto::v1::Hello| {
            if let Some(hw) = h.hardware.as_mut() {
                hw.free_memory_bytes = gib << 30;
            }
        }
    };
    let nodes = [
        FakeNode::register_with(&app, TRUSTED[0], free(4)).await,
        FakeNode::register_with(&app, TRUSTED[1], free(6)).await,
        FakeNode::register_with(&app, TRUSTED[2], free(8)).await,
    ];
    let [a, b, c] = &nodes;
    let mut jobs = JobsClient::new(app.grpc().await);
    let job = jobs
        .submit(prompt_job("The capital of France is", 8))
        .await
        .unwrap()
        .into_inner()
        .id;
    let failure = JobUpdate {
        msg: Some(job_update::Msg::Failure(job_update::Failure {
            reason: "out of memory".into(),
            retryable: true,
        })),
    };
    let mut by = Vec::new();
    let mut held = Vec::new();
    for attempt in 1..=3u32 {
        let (which, mut send, recv, got) = next_of(&[a, b, c]).await;
        assert_eq!((got.job_id.as_str(), got.attempt), (job.as_str(), attempt));
        by.push(which);
        if attempt < 3 {
            write_frame(&mut send, &failure).await.unwrap();
        }
        held.push((send, recv));
    }
    let mut distinct = by.clone();
    distinct.sort_unstable();
    distinct.dedup();
    assert_eq!(
        distinct.len(),
        3,
        "attempts by nodes {by:?}: a retry went back to a node that had failed the job"
    );
    let broken = app.ledger.violations(now_ms()).await.unwrap();
    assert!(broken.is_empty(), "{broken:?}");
    drop(held);
    app.stop().await;
}

/// Hole 5: placement learns from evidence. A node whose Hello reports a
/// thousand times the honest node's bandwidth (registered first, so on a
/// tie it wins) fails every attempt it gets; once it has failed one, the
/// next jobs go to the honest node first, which is placed and paid for
/// each (audits off: pay is immediate).
#[tokio::test]
async fn a_node_that_fails_its_jobs_stops_winning_placement_however_fast_its_hello() {
    let app = spawn_app(|c| c.limits.max_attempts = 10).await;
    let hostile = FakeNode::register_with(&app, NEW_KEYS[0], |h| {
        if let Some(hw) = h.hardware.as_mut() {
            hw.measured_memory_bandwidth_bytes_per_s = 100_000_000_000_000;
        }
    })
    .await;
    let mut honest = FakeNode::register(&app, NEW_KEYS[1]).await;
    let hostile_operator = app.ledger.link_node(&hex_of(&hostile), "").await.unwrap();
    let operator = app.ledger.link_node(&hex_of(&honest), "").await.unwrap();
    let before = books(&app.ledger, &app.client_account, &hostile_operator).await;
    let mut jobs = JobsClient::new(app.grpc().await);
    let mut first_attempts = [0usize; 2];
    for i in 0..4 {
        let job = jobs
            .submit(prompt_job(&format!("Count to {i}"), 8))
            .await
            .unwrap()
            .into_inner()
            .id;
        let (mut which, mut send, mut _recv, mut a) = next_of(&[&hostile, &honest]).await;
        first_attempts[which] += 1;
        if which == 0 {
            let failure = JobUpdate {
                msg: Some(job_update::Msg::Failure(job_update::Failure {
                    reason: "out of memory".into(),
                    retryable: true,
                })),
            };
            write_frame(&mut send, &failure).await.unwrap();
            (which, send, _recv, a) = next_of(&[&hostile, &honest]).await;
            assert_eq!(which, 1, "the retry went back to the failing node");
        }
        assert_eq!(a.job_id, job);
        let mut served = Served {
            signed: claim::sign(honest.claim(&a, vec![7, 8], " Paris"), &honest.key),
            honest,
            operator: operator.clone(),
            job,
            send,
            before: books(&app.ledger, &app.client_account, &operator).await,
        };
        served.finish(&app).await;
        honest = served.honest;
    }
    assert_eq!(
        first_attempts,
        [1, 3],
        "[hostile, honest] first attempts: the failing node kept winning placement"
    );
    let paid = books(&app.ledger, &app.client_account, &operator).await;
    assert!(paid.operator.balance() > 0, "the honest node was paid");
    assert_eq!(paid.client.debits_pending, 0, "every hold was settled");
    let after = books(&app.ledger, &app.client_account, &hostile_operator).await;
    assert_eq!(after.operator, before.operator, "the failing node was paid");
    let broken = app.ledger.violations(now_ms()).await.unwrap();
    assert!(broken.is_empty(), "{broken:?}");
    app.stop().await;
}

/// Probation's share of placement: a new key reporting a far faster chip
/// than the established node beside it (the cost model alone would give
/// it every job) runs one job at a time while the established node has
/// room; the rest go to the established node.
#[tokio::test]
async fn a_new_key_takes_one_job_at_a_time_while_an_established_node_has_room() {
    let app = app().await;
    let slots = |h: &mut mlxnet_proto::v1::Hello| h.max_concurrent_jobs = 4;
    let established = FakeNode::register_with(&app, TRUSTED[1], slots).await;
    let fast = FakeNode::register_with(&app, NEW_KEYS[0], |h| {
        h.max_concurrent_jobs = 4;
        if let Some(hw) = h.hardware.as_mut() {
            hw.measured_memory_bandwidth_bytes_per_s = 100_000_000_000_000;
            hw.measured_compute_flops = 1_000_000_000_000_000_000;
        }
    })
    .await;
    let mut jobs = JobsClient::new(app.grpc().await);
    let mut held = Vec::new();
    let mut by_node = [0usize; 2];
    for i in 0..3 {
        jobs.submit(prompt_job(&format!("Count to {i}"), 8))
            .await
            .unwrap();
        let (which, send, recv, _) = next_of(&[&established, &fast]).await;
        by_node[which] += 1;
        held.push((send, recv));
    }
    assert_eq!(
        by_node,
        [2, 1],
        "[established, new key] jobs: the new key took more than its share"
    );
    let broken = app.ledger.violations(now_ms()).await.unwrap();
    assert!(broken.is_empty(), "{broken:?}");
    drop(held);
    app.stop().await;
}

/// What an honest node's task saw: the node (hex) and the assignment.
type Seen = (String, Assignment);

/// An honest node's work, done by a task on `node`'s connection: it
/// answers every job with the honest tokens `[8]` " Paris" (streamed after
/// any resumed prefix, its claim bound to that prefix), and every audit
/// with the truth about it: a claim signed by `liar` is fabricated (fails),
/// any other passes. It reports each assignment on `seen`.
fn honest_actor(
    node: &FakeNode,
    liar: Vec<u8>,
    seen: tokio::sync::mpsc::UnboundedSender<Seen>,
) -> tokio::task::JoinHandle<()> {
    let key = node.key.clone();
    let conn = node.conn.clone();
    let me = hex_of(node);
    tokio::spawn(async move {
        while let Ok((mut send, mut recv)) = conn.accept_bi().await {
            let Ok(a) = read_frame::<_, Assignment>(&mut recv).await else {
                continue;
            };
            let _ = seen.send((me.clone(), a.clone()));
            let update = if let Some(audited) = a.audit.as_ref().and_then(|t| t.claim.clone()) {
                let passed = audited.claim.as_ref().map(|c| &c.node_id) != Some(&liar);
                let verdict = AuditVerdict {
                    job_id: a.job_id.clone(),
                    claim_signature: audited.signature,
                    passed,
                    auditor_id: key.verifying_key().to_bytes().to_vec(),
                    ..Default::default()
                };
                job_update::Msg::Verdict(claim::sign_verdict(verdict, &key))
            } else {
                let resumed = a.resume.clone().unwrap_or_default().token_ids;
                let mut c = crate::test_utils::claim_for(&key, &a, vec![8], " Paris");
                c.prompt_sha256 =
                    claim::resumed_input_digest(&a.input.clone().unwrap_or_default(), &resumed)
                        .to_vec();
                let _ = write_frame(&mut send, &tokens_of(resumed.len() as u32, &c)).await;
                job_update::Msg::Result(claim::sign(c, &key))
            };
            let _ = write_frame(&mut send, &JobUpdate { msg: Some(update) }).await;
            let _ = send.finish();
            let mut buf = [0u8; 64];
            while let Ok(Some(_)) = recv.read(&mut buf).await {}
        }
    })
}

/// `node` drains and hands attempt `a` off after streaming `ids` / `text`
/// (after `resumed` tokens), under a partial claim bound to the input and
/// `resumed`.
async fn drain_and_hand_off(
    node: &mut FakeNode,
    mut send: quinn::SendStream,
    a: &Assignment,
    (resumed, ids, text): (&[u32], Vec<u32>, &str),
) {
    node.control(&mlxnet_proto::v1::NodeControl {
        msg: Some(mlxnet_proto::v1::node_control::Msg::Drain(
            mlxnet_proto::v1::Drain {
                reason: "owner is back".into(),
            },
        )),
    })
    .await;
    let mut c = node.claim(a, ids, text);
    c.finish_reason = claim::FINISH_HANDOFF.into();
    c.prompt_sha256 =
        claim::resumed_input_digest(&a.input.clone().unwrap_or_default(), resumed).to_vec();
    write_frame(&mut send, &tokens_of(resumed.len() as u32, &c))
        .await
        .unwrap();
    let result = JobUpdate {
        msg: Some(job_update::Msg::Result(claim::sign(c, &node.key))),
    };
    write_frame(&mut send, &result).await.unwrap();
    let _ = send.finish();
}

/// Resumed jobs and hand-off segments are audited like any other claim.
/// An honest node drains and hands off after one token; a new key takes
/// the rest, fabricates two tokens, drains and hands off too; an honest
/// node finishes. The segments' nodes and the finisher have clean records
/// (audit rate about 0), the liar is new (rate 1): its segment is audited,
/// sent with the tokens before it as the resumed prefix and its claim
/// bound to that prefix; two honest auditors fail it, so the job's pay is
/// voided (the client gets its whole hold back, the liar nothing) and the
/// liar is banned (`ban_after = 1`). The honest nodes are placed and paid
/// again.
#[tokio::test]
async fn a_node_that_fabricates_a_segment_and_hands_off_is_audited_and_caught() {
    const FIRST: u64 = 64;
    const FINISHER: u64 = 61;
    const AUDITORS: [u64; 2] = [63, 62];
    let trusted = [FIRST, FINISHER, AUDITORS[0], AUDITORS[1]]
        .iter()
        .map(|&s| node_hex(s))
        .collect();
    let app = spawn_app(|c| {
        c.audit = AuditConfig {
            rate_new: 1.0,
            rate_floor: 0.0,
            halve_every: 1,
            window_ms: WINDOW_MS,
            ban_after: 1,
            trusted,
            ..AuditConfig::default()
        };
        c.ledger.sweep_interval_ms = 3_600_000;
        c.limits.max_attempts = 10;
    })
    .await;
    // Clean records: their claims are audited at 0.5^64.
    for seed in [FIRST, FINISHER] {
        let clean = crate::domain::RecordDelta {
            clean: 64,
            ..Default::default()
        };
        crate::store::Store::count_record(app.ledger.store(), &node_hex(seed), &clean)
            .await
            .unwrap();
    }
    let mut jobs = JobsClient::new(app.grpc().await);

    // Attempt 1: the honest first node streams one token and drains.
    let mut first = FakeNode::register(&app, FIRST).await;
    let job = jobs
        .submit(prompt_job("The capital of France is", 8))
        .await
        .unwrap()
        .into_inner()
        .id;
    let mut watch = jobs
        .watch(WatchJobRequest {
            job_id: job.clone(),
        })
        .await
        .unwrap()
        .into_inner();
    let (send, _recv1, a) = first.next_assignment().await;
    assert_eq!(a.job_id, job);
    drain_and_hand_off(&mut first, send, &a, (&[], vec![7], " Par")).await;

    // Attempt 2: the liar, resumed after [7], fabricates two tokens.
    let mut liar = FakeNode::register(&app, NEW_KEYS[0]).await;
    let liar_id = liar.key.verifying_key().to_bytes().to_vec();
    let liar_op = app.ledger.link_node(&hex_of(&liar), "").await.unwrap();
    let (send, _recv2, a) = liar.next_assignment().await;
    assert_eq!(a.job_id, job);
    assert_eq!(
        a.resume.as_ref().map(|r| r.token_ids.clone()),
        Some(vec![7])
    );
    let before = books(&app.ledger, &app.client_account, &liar_op).await;
    drain_and_hand_off(&mut liar, send, &a, (&[7], vec![9000, 9001], "junk")).await;

    // Attempt 3: the finisher, then the auditors; every honest node
    // answers what it is sent.
    let (seen_tx, mut seen) = tokio::sync::mpsc::unbounded_channel::<Seen>();
    let finisher = FakeNode::register(&app, FINISHER).await;
    let mut actors = vec![honest_actor(&finisher, liar_id.clone(), seen_tx.clone())];
    let (who, a) = tokio::time::timeout(WAIT, seen.recv())
        .await
        .expect("the job was resumed")
        .unwrap();
    assert_eq!(
        (who.as_str(), a.job_id.as_str()),
        (hex_of(&finisher).as_str(), job.as_str())
    );
    assert_eq!(a.resume.map(|r| r.token_ids), Some(vec![7, 9000, 9001]));
    while let Some(e) = watch.message().await.unwrap() {
        if let Some(job_event::Event::Failed(f)) = e.event {
            panic!("the job failed: {}", f.reason);
        }
    }
    let mut auditors = Vec::new();
    for seed in AUDITORS {
        let node = FakeNode::register(&app, seed).await;
        actors.push(honest_actor(&node, liar_id.clone(), seen_tx.clone()));
        auditors.push(node);
    }

    // The liar's segment is what is audited, with the tokens before it.
    let (_, audit) = tokio::time::timeout(WAIT, seen.recv())
        .await
        .expect("the resumed job was never audited")
        .unwrap();
    assert_eq!(audit.job_id, job);
    let audited = audit
        .audit
        .and_then(|t| t.claim)
        .and_then(|s| s.claim)
        .expect("an audit assignment");
    assert_eq!(audited.node_id, liar_id, "the liar's segment is audited");
    assert_eq!(audited.output_token_ids, vec![9000, 9001]);
    let resume = audit.resume.expect("the tokens before the segment");
    assert_eq!((resume.token_ids, resume.text.as_str()), (vec![7], " Par"));
    let input = audit.input.clone().unwrap();
    assert_eq!(
        audited.prompt_sha256,
        claim::resumed_input_digest(&input, &[7]).to_vec(),
        "the segment's claim is bound to the input and the tokens before it"
    );
    assert_eq!(audit_ended(&app, &job).await, "failed");
    assert_eq!(
        record(&app, &liar).await,
        NodeRecord {
            failed: 1,
            banned: true,
            ..NodeRecord::default()
        },
        "the liar is counted against and banned"
    );
    // Banned: its session is closed, and it cannot come back.
    let closed = tokio::time::timeout(WAIT, liar.conn.closed()).await;
    assert!(closed.is_ok(), "the banned node kept its session");
    let mut again = crate::test_utils::Dialer::connect(&app).await;
    let proof = again.proof(&liar.key);
    let reply = again.hello(&liar.key, proof).await;
    assert!(
        matches!(
            reply,
            Some(mlxnet_proto::v1::coordinator_control::Msg::Rejected(_))
        ),
        "a banned node was welcomed back: {reply:?}"
    );
    // The pay is voided: the client has its whole hold back, the liar
    // nothing (nor the finisher for this job: its tokens follow junk).
    let id: mlxnet_proto::ids::JobId = job.parse().unwrap();
    let settled = app
        .ledger
        .settle_job(id, now_ms() + WINDOW_MS + 1_000)
        .await
        .unwrap();
    assert!(
        matches!(settled, Settlement::NothingOpen | Settlement::Voided),
        "{settled:?}"
    );
    let after = books(&app.ledger, &app.client_account, &liar_op).await;
    assert_eq!(after.client.balance(), before.client.balance());
    assert_eq!(after.client.debits_pending, 0, "the hold is released");
    assert_eq!(after.operator, before.operator, "the liar was paid");
    assert_eq!(after.fee.balance(), before.fee.balance());
    let broken = app.ledger.violations(now_ms()).await.unwrap();
    assert!(broken.is_empty(), "{broken:?}");

    // The honest nodes are placed and paid again.
    let next = jobs
        .submit(prompt_job("The capital of Italy is", 4))
        .await
        .unwrap()
        .into_inner()
        .id;
    let server = loop {
        let (who, a) = tokio::time::timeout(WAIT, seen.recv())
            .await
            .expect("the next job was placed")
            .unwrap();
        if a.job_id == next && a.audit.is_none() {
            break who;
        }
    };
    assert_ne!(server, hex_of(&liar));
    let mut watch = jobs
        .watch(WatchJobRequest {
            job_id: next.clone(),
        })
        .await
        .unwrap()
        .into_inner();
    while watch.message().await.unwrap().is_some() {}
    let settled = app
        .ledger
        .settle_job(next.parse().unwrap(), now_ms() + WINDOW_MS + 1_000)
        .await
        .unwrap();
    assert!(matches!(settled, Settlement::Paid { .. }), "{settled:?}");
    let server_op = app.ledger.link_node(&server, "").await.unwrap();
    let paid = books(&app.ledger, &app.client_account, &server_op).await;
    assert!(paid.operator.balance() > 0, "the honest node was paid");
    let broken = app.ledger.violations(now_ms()).await.unwrap();
    assert!(broken.is_empty(), "{broken:?}");
    for a in actors {
        a.abort();
    }
    app.stop().await;
}
