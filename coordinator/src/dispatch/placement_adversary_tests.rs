//! The adversary suite, placement part: a real coordinator and hand-made
//! nodes on the real QUIC wire. Hostile nodes must not get a job again
//! once they failed it while another node could run it (busy or not), and
//! must not keep getting jobs while an audit of their work stands against
//! them.
//!
//! Each step waits on an event (an assignment, a job event, an audit's
//! second auditor being asked); the bound on a wait ([`WAIT`]) only turns
//! a broken coordinator into a failure instead of a hang. No verdict
//! depends on how fast this machine is: where a test shows that a node was
//! *not* given a job, it does so by what the next assignment is once a
//! later job has been placed, never by waiting a while for nothing.

use std::time::Duration;

use mlxnet_proto::{
    claim,
    frame::write_frame,
    v1::{
        job_event, job_update, jobs_client::JobsClient, Assignment, AuditVerdict, JobEvent,
        JobUpdate, SignedClaim, WatchJobRequest,
    },
};

use crate::{
    audit::{AuditConfig, Audits},
    test_utils::{books, node_hex, prompt_job, spawn_app, tokens_of, Authed, FakeNode, TestApp},
    util::now_ms,
};

/// The bound on any one wait (a failure, never a verdict).
const WAIT: Duration = Duration::from_secs(30);

/// Seeds of the honest, trusted nodes of these tests.
const HONEST: [u64; 3] = [81, 82, 83];
/// Seeds of the hostile nodes (new keys unless a test trusts them).
const HOSTILE: [u64; 2] = [91, 92];

fn hex_of(node: &FakeNode) -> String {
    hex::encode(node.key.verifying_key().to_bytes())
}

fn failure() -> JobUpdate {
    JobUpdate {
        msg: Some(job_update::Msg::Failure(job_update::Failure {
            reason: "out of memory".into(),
            retryable: true,
        })),
    }
}

/// The next assignment of any of `nodes`: which one (its index) got it,
/// and it.
async fn next_of(nodes: &[&FakeNode]) -> (usize, quinn::SendStream, quinn::RecvStream, Assignment) {
    let waits = nodes.iter().map(|n| Box::pin(n.next_assignment()));
    let got = tokio::time::timeout(WAIT, futures::future::select_all(waits)).await;
    let ((send, recv, a), which, _) = got.expect("no node was assigned a job");
    (which, send, recv, a)
}

async fn submit(jobs: &mut JobsClient<Authed>, prompt: &str) -> String {
    jobs.submit(prompt_job(prompt, 8))
        .await
        .unwrap()
        .into_inner()
        .id
}

async fn watch(jobs: &mut JobsClient<Authed>, job: &str) -> tonic::Streaming<JobEvent> {
    jobs.watch(WatchJobRequest {
        job_id: job.to_owned(),
    })
    .await
    .unwrap()
    .into_inner()
}

/// Waits on `events` until the job is queued again for attempt `attempt`
/// (the store has recorded the previous attempt's failure).
async fn requeued_for(events: &mut tonic::Streaming<JobEvent>, attempt: u32) {
    tokio::time::timeout(WAIT, async {
        while let Some(e) = events.message().await.unwrap() {
            if let Some(job_event::Event::Queued(q)) = e.event {
                if q.attempt == attempt {
                    return;
                }
            }
        }
        panic!("the job's events ended before attempt {attempt} was queued");
    })
    .await
    .expect("the job was requeued");
}

/// `node` streams and signs the answer ` Paris` to assignment `a` on
/// `send`; returns once the job completed.
async fn answer(app: &TestApp, node: &FakeNode, a: &Assignment, send: &mut quinn::SendStream) {
    let mut jobs = JobsClient::new(app.grpc().await);
    let mut events = watch(&mut jobs, &a.job_id).await;
    let signed = claim::sign(node.claim(a, vec![7, 8], " Paris"), &node.key);
    let c = signed.claim.clone().unwrap();
    write_frame(send, &tokens_of(0, &c)).await.unwrap();
    let result = JobUpdate {
        msg: Some(job_update::Msg::Result(signed)),
    };
    write_frame(send, &result).await.unwrap();
    tokio::time::timeout(WAIT, async {
        while let Some(e) = events.message().await.unwrap() {
            match e.event {
                Some(job_event::Event::Failed(f)) => panic!("the job failed: {}", f.reason),
                Some(job_event::Event::Completed(_)) => return,
                _ => {}
            }
        }
    })
    .await
    .expect("the job completed");
}

/// Item 1 of the mixed-fleet findings: a job failed by A, then by B, is
/// not handed back to A (free) while the honest node C, which could run
/// it, is busy: it waits for C. Before, placement's last pass ("anyone",
/// used when no node that had not failed the job had room) gave A the
/// third attempt, and in the 200-job run every job that failed for good
/// had all three attempts on hostile nodes, several as A, B, A.
///
/// How "not given to A or B" is shown without waiting for nothing: once
/// the job is queued for its third attempt, a second job is submitted;
/// the pass that places it also sees the retried job (which goes first),
/// so when A or B gets the second job, the retried one was already
/// placed or passed over. C then finishes its job, and the retried job's
/// next assignment must be C's.
#[tokio::test]
async fn a_retried_job_waits_for_a_busy_honest_node_rather_than_go_back_to_one_that_failed_it() {
    let trusted = HONEST
        .iter()
        .chain(&HOSTILE)
        .map(|&s| node_hex(s))
        .collect();
    let app = spawn_app(|c| {
        c.audit = AuditConfig {
            trusted,
            ..AuditConfig::off()
        };
    })
    .await;
    let mut jobs = JobsClient::new(app.grpc().await);
    // C (honest, one slot) is busy with another job before A and B join.
    let c = FakeNode::register(&app, HONEST[0]).await;
    let busy = submit(&mut jobs, "Count to ten").await;
    let (mut c_send, _c_recv, c_job) = c.next_assignment().await;
    assert_eq!(c_job.job_id, busy);
    let a = FakeNode::register(&app, HOSTILE[0]).await;
    let b = FakeNode::register(&app, HOSTILE[1]).await;
    let job = submit(&mut jobs, "The capital of France is").await;
    let mut events = watch(&mut jobs, &job).await;
    let mut by = Vec::new();
    let mut held = Vec::new();
    for attempt in 1..=2u32 {
        let (which, mut send, recv, got) = next_of(&[&a, &b]).await;
        assert_eq!((got.job_id.as_str(), got.attempt), (job.as_str(), attempt));
        by.push(which);
        write_frame(&mut send, &failure()).await.unwrap();
        held.push((send, recv));
    }
    assert_ne!(
        by[0], by[1],
        "attempt 2 went back to the node that failed attempt 1"
    );
    requeued_for(&mut events, 3).await;
    let other = submit(&mut jobs, "Name a colour").await;
    let (which, _send, _recv, got) = next_of(&[&a, &b]).await;
    assert_eq!(
        (got.job_id.as_str(), got.attempt),
        (other.as_str(), 1),
        "attempt {} of the job went back to node {} (attempts so far by {by:?}; 0: A, 1: B) while C, which could run it, was busy",
        got.attempt,
        ["A", "B"][which],
    );
    answer(&app, &c, &c_job, &mut c_send).await;
    let (which, _send, _recv, got) = next_of(&[&a, &b, &c]).await;
    assert_eq!(
        (which, got.job_id.as_str(), got.attempt),
        (2, job.as_str(), 3),
        "the third attempt went to {} (0: A, 1: B, 2: C)",
        which
    );
    let broken = app.ledger.violations(now_ms()).await.unwrap();
    assert!(broken.is_empty(), "{broken:?}");
    drop(held);
    app.stop().await;
}

/// The rule has a floor: when no node but those that failed a job could
/// ever run it (here the only node online), the retry goes back to it, so
/// a one-node network still retries a job after a passing failure.
#[tokio::test]
async fn a_job_failed_by_the_only_node_that_can_run_it_is_retried_there() {
    let app = spawn_app(|_| {}).await;
    let mut jobs = JobsClient::new(app.grpc().await);
    let only = FakeNode::register(&app, HONEST[1]).await;
    let job = submit(&mut jobs, "The capital of France is").await;
    let (mut send, _recv, got) = only.next_assignment().await;
    assert_eq!((got.job_id.as_str(), got.attempt), (job.as_str(), 1));
    write_frame(&mut send, &failure()).await.unwrap();
    let (_, mut send, _recv, got) = next_of(&[&only]).await;
    assert_eq!((got.job_id.as_str(), got.attempt), (job.as_str(), 2));
    answer(&app, &only, &got, &mut send).await;
    let broken = app.ledger.violations(now_ms()).await.unwrap();
    assert!(broken.is_empty(), "{broken:?}");
    app.stop().await;
}

/// `node`'s signed verdict `passed` on the audit assignment `a`.
fn verdict_on(node: &FakeNode, a: &Assignment, passed: bool) -> JobUpdate {
    let audited: SignedClaim = a
        .audit
        .clone()
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
    JobUpdate {
        msg: Some(job_update::Msg::Verdict(claim::sign_verdict(
            verdict, &node.key,
        ))),
    }
}

/// Waits until `job`'s audit is no longer pending; returns its state.
async fn audit_ended(app: &TestApp, job: &str) -> String {
    let audits = Audits::of_store(app.ledger.store(), AuditConfig::default())
        .await
        .unwrap();
    tokio::time::timeout(WAIT, async {
        loop {
            match audits.state(job).await.unwrap().as_deref() {
                Some("pending") | None => tokio::time::sleep(Duration::from_millis(20)).await,
                Some(s) => return s.to_owned(),
            }
        }
    })
    .await
    .expect("the audit ended")
}

/// Item 2 of the mixed-fleet findings: a node is not placed while the
/// audits of its work still pending could ban it. Before, a hostile node
/// failed up to 6 audits before its ban (at 2) took effect, because it
/// kept getting jobs while its audits were pending.
///
/// Here `ban_after` is 2. The hostile node H reports a far faster chip
/// than the three honest trusted nodes, so it wins every job it has room
/// for. It fabricates job 1 and job 2; their audits are held by two
/// honest auditors. With two audits pending, either of which (with the
/// other) would ban it, H must not get job 3: the free honest node does.
/// Then both audits fail (each confirmed by a second auditor): H is banned
/// with exactly 2 failed audits, earned nothing, and the honest node that
/// ran job 3 is paid for it.
#[tokio::test]
async fn a_node_whose_pending_audits_could_ban_it_gets_no_new_job_until_they_end() {
    let trusted = HONEST.iter().map(|&s| node_hex(s)).collect();
    let app = spawn_app(|c| {
        c.audit = AuditConfig {
            rate_new: 1.0,
            rate_floor: 1.0,
            window_ms: 10 * 60 * 1000,
            ban_after: 2,
            trusted,
            ..AuditConfig::default()
        };
        c.ledger.sweep_interval_ms = 3_600_000;
    })
    .await;
    let mut jobs = JobsClient::new(app.grpc().await);
    let h = FakeNode::register_with(&app, HOSTILE[0], |hello| {
        if let Some(hw) = hello.hardware.as_mut() {
            hw.measured_memory_bandwidth_bytes_per_s = 100_000_000_000_000;
        }
    })
    .await;
    let h_operator = app.ledger.link_node(&hex_of(&h), "").await.unwrap();
    let honest = [
        FakeNode::register(&app, HONEST[0]).await,
        FakeNode::register(&app, HONEST[1]).await,
        FakeNode::register(&app, HONEST[2]).await,
    ];
    let [t1, t2, t3] = &honest;
    let before = books(&app.ledger, &app.client_account, &h_operator).await;

    // H takes jobs 1 and 2 and fabricates both; an honest auditor takes
    // each one's audit and holds it.
    let mut audits = Vec::new();
    let mut fabricated = Vec::new();
    let mut busy = [false; 3];
    for i in 1..=2 {
        let job = submit(&mut jobs, &format!("Fabricated answer {i}")).await;
        let (which, mut send, _recv, a) = next_of(&[&h, t1, t2, t3]).await;
        assert_eq!(
            (which, a.job_id.as_str()),
            (0, job.as_str()),
            "the fastest node (H, index 0) took job {i}"
        );
        answer(&app, &h, &a, &mut send).await;
        fabricated.push(job.clone());
        let free: Vec<&FakeNode> = (0..3).filter(|&k| !busy[k]).map(|k| &honest[k]).collect();
        let (k, send, recv, audit) = next_of(&free).await;
        let k = (0..3).filter(|&k| !busy[k]).nth(k).unwrap();
        assert_eq!(audit.job_id, job, "the audit of job {i}");
        busy[k] = true;
        audits.push((k, send, recv, audit));
    }

    // Job 3: H has two audits pending, either of which would ban it with
    // the other: it must not be placed.
    let job3 = submit(&mut jobs, "The capital of France is").await;
    let free = busy.iter().position(|b| !b).unwrap();
    let (which, mut send3, _recv3, a3) = next_of(&[&h, &honest[free]]).await;
    assert_eq!(
        (which, a3.job_id.as_str()),
        (1, job3.as_str()),
        "job 3 went to H (index 0) while two audits that could ban it were pending"
    );

    // Both audits fail, each confirmed by the other auditor (the only
    // free established node not yet asked about it: the third runs job 3).
    let mut held = Vec::new();
    let first_auditors: Vec<usize> = audits.iter().map(|(k, ..)| *k).collect();
    for (k, mut send, recv, a) in audits.drain(..) {
        write_frame(&mut send, &verdict_on(&honest[k], &a, false))
            .await
            .unwrap();
        held.push((send, recv));
    }
    for (i, job) in fabricated.iter().enumerate() {
        let k = first_auditors[1 - i];
        let (mut send, recv, a) = tokio::time::timeout(WAIT, honest[k].next_assignment())
            .await
            .expect("the failing verdict was sent to a second auditor");
        assert_eq!(&a.job_id, job, "the confirmation of job {}'s audit", i + 1);
        write_frame(&mut send, &verdict_on(&honest[k], &a, false))
            .await
            .unwrap();
        held.push((send, recv));
    }
    let auditors: Vec<&FakeNode> = first_auditors.iter().map(|&k| &honest[k]).collect();
    for job in &fabricated {
        assert_eq!(audit_ended(&app, job).await, "failed");
    }
    let record = Audits::of_store(app.ledger.store(), AuditConfig::default())
        .await
        .unwrap()
        .record(&hex_of(&h))
        .await
        .unwrap();
    assert_eq!(
        (record.failed, record.banned),
        (2, true),
        "H is banned at exactly ban_after failed audits: {record:?}"
    );
    let after = books(&app.ledger, &app.client_account, &h_operator).await;
    assert_eq!(
        after.operator, before.operator,
        "H earned from fabricated work"
    );

    // The honest node that ran job 3 is paid for it once its audit passes.
    answer(&app, &honest[free], &a3, &mut send3).await;
    let (k, mut send, recv, a) = next_of(&auditors).await;
    assert_eq!(a.job_id, job3);
    write_frame(&mut send, &verdict_on(auditors[k], &a, true))
        .await
        .unwrap();
    held.push((send, recv));
    assert_eq!(audit_ended(&app, &job3).await, "passed");
    let operator = app
        .ledger
        .link_node(&hex_of(&honest[free]), "")
        .await
        .unwrap();
    let id: mlxnet_proto::ids::JobId = job3.parse().unwrap();
    let settled = app
        .ledger
        .settle_job(id, now_ms() + 11 * 60 * 1000)
        .await
        .unwrap();
    assert!(
        matches!(settled, crate::ledger::settle::Settlement::Paid { .. }),
        "{settled:?}"
    );
    let paid = books(&app.ledger, &app.client_account, &operator).await;
    assert!(paid.operator.balance() > 0, "the honest node was paid");
    let broken = app.ledger.violations(now_ms()).await.unwrap();
    assert!(broken.is_empty(), "{broken:?}");
    drop(held);
    app.stop().await;
}
