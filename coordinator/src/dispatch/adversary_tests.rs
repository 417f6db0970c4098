//! The adversary suite, dispatch part: a real coordinator, a hostile node
//! speaking the real wire frame by frame, then an honest node. Each test
//! has the hostile node try one way of being paid for work it did not do
//! (or of putting unsigned text into a job's result), and checks that:
//! its attempt is refused, no balance moved, `Ledger::violations` is
//! empty, and the honest node that comes next is placed and paid, with the
//! job's result exactly what the honest node streamed and signed.
//!
//! The hostile node leaves (closes its connection) once refused, so the
//! honest node, which registers after it, gets the job's next attempt.

use mlxnet_proto::{
    claim,
    frame::write_frame,
    v1::{
        job_event, job_update, jobs_client::JobsClient, Assignment, Job, JobState, JobUpdate,
        NodeControl, ResultClaim, SignedClaim, WatchJobRequest,
    },
};

use crate::{
    test_utils::{books, books_once, prompt_job, spawn_app, Authed, Books, FakeNode, TestApp},
    util::now_ms,
};

fn tokens(index: u32, token_ids: Vec<u32>, text: &str) -> JobUpdate {
    JobUpdate {
        msg: Some(job_update::Msg::Tokens(job_update::Tokens {
            index,
            token_ids,
            text: text.into(),
            logprobs: Vec::new(),
        })),
    }
}

fn result(signed: SignedClaim) -> JobUpdate {
    JobUpdate {
        msg: Some(job_update::Msg::Result(signed)),
    }
}

/// The honest answer to every test job.
const HONEST_IDS: [u32; 2] = [7, 8];
const HONEST_TEXT: &str = " Paris";

/// A coordinator, a client, and a hostile node holding job `job`'s first
/// attempt (nothing else is online).
struct Scene {
    app: TestApp,
    jobs: JobsClient<Authed>,
    hostile: FakeNode,
    job: String,
    send: quinn::SendStream,
    recv: quinn::RecvStream,
    a: Assignment,
    /// The books once the job's hold is placed, before the hostile act.
    before: Books,
    hostile_operator: String,
}

async fn scene(max_tokens: u32) -> Scene {
    let app = spawn_app(|c| c.limits.max_attempts = 10).await;
    let mut jobs = JobsClient::new(app.grpc().await);
    let hostile = FakeNode::register(&app, 61).await;
    let hostile_operator = app
        .ledger
        .link_node(&hex::encode(hostile.key.verifying_key().to_bytes()), "")
        .await
        .unwrap();
    let job = jobs
        .submit(prompt_job("The capital of France is", max_tokens))
        .await
        .unwrap()
        .into_inner()
        .id;
    let (send, recv, a) = hostile.next_assignment().await;
    assert_eq!(a.job_id, job);
    let before = books(&app.ledger, &app.client_account, &hostile_operator).await;
    assert!(before.client.debits_pending > 0, "the job holds its price");
    Scene {
        app,
        jobs,
        hostile,
        job,
        send,
        recv,
        a,
        before,
        hostile_operator,
    }
}

/// Waits until the coordinator resets the attempt's stream (its refusal).
async fn refused(recv: &mut quinn::RecvStream) {
    let mut buf = [0u8; 64];
    loop {
        match recv.read(&mut buf).await {
            Err(quinn::ReadError::Reset(_)) => return,
            Ok(Some(_)) => continue,
            other => panic!("expected the coordinator to refuse the attempt, got {other:?}"),
        }
    }
}

impl Scene {
    /// After the hostile act: the attempt was refused, the hostile node
    /// leaves, an honest node joins and gets the job without any of the
    /// hostile tokens, streams and signs its answer and is paid; no balance
    /// moved for the hostile node. Returns the finished job.
    async fn honest_node_finishes(mut self) -> Job {
        refused(&mut self.recv).await;
        let mid = books(
            &self.app.ledger,
            &self.app.client_account,
            &self.hostile_operator,
        )
        .await;
        assert_eq!(mid, self.before, "a balance moved for the refused attempt");
        self.hostile.conn.close(0u32.into(), b"leaving");

        let honest = FakeNode::register(&self.app, 62).await;
        let honest_operator = self
            .app
            .ledger
            .link_node(&hex::encode(honest.key.verifying_key().to_bytes()), "")
            .await
            .unwrap();
        let (mut send, _recv, a) = honest.next_assignment().await;
        assert_eq!(a.job_id, self.job);
        assert!(a.attempt > 1);
        assert_eq!(
            a.resume, None,
            "the honest node was asked to resume after the hostile node's unsigned tokens"
        );
        let mut watch = self
            .jobs
            .watch(WatchJobRequest {
                job_id: self.job.clone(),
            })
            .await
            .unwrap()
            .into_inner();
        write_frame(&mut send, &tokens(0, HONEST_IDS.to_vec(), HONEST_TEXT))
            .await
            .unwrap();
        let c = honest.claim(&a, HONEST_IDS.to_vec(), HONEST_TEXT);
        write_frame(&mut send, &result(claim::sign(c, &honest.key)))
            .await
            .unwrap();
        let mut done = None;
        while let Some(e) = watch.message().await.unwrap() {
            match e.event {
                Some(job_event::Event::Completed(c)) => done = c.job,
                Some(job_event::Event::Failed(f)) => panic!("the job failed: {}", f.reason),
                _ => {}
            }
        }
        let done = done.expect("the job completed");
        assert_eq!(done.state, JobState::Completed as i32);
        assert_eq!(
            done.output_text, HONEST_TEXT,
            "the result is the honest text"
        );
        let signer = claim::verify(done.result.as_ref().unwrap()).unwrap();
        assert_eq!(signer.to_string(), done.node_id);

        let paid = books_once(
            &self.app.ledger,
            &self.app.client_account,
            &honest_operator,
            |b| b.operator.balance() > 0 && b.client.debits_pending == 0,
        )
        .await;
        assert!(paid.operator.balance() > 0, "the honest node was paid");
        assert_eq!(paid.client.debits_pending, 0, "the hold was settled");
        let hostile = self
            .app
            .ledger
            .account(&self.hostile_operator)
            .await
            .unwrap()
            .unwrap();
        assert_eq!(hostile, self.before.operator, "the hostile node was paid");
        // The client paid exactly the honest claim: prompt and 2 tokens.
        let spent = self.before.client.balance() - paid.client.balance();
        assert_eq!(
            spent,
            paid.operator.balance() + paid.fee.balance() - self.before.fee.balance(),
            "what the client paid went to the honest node and the fee"
        );
        assert!(self
            .app
            .ledger
            .violations(now_ms())
            .await
            .unwrap()
            .is_empty());
        self.app.stop().await;
        done
    }
}

/// Hole 1: a node that never drained streams junk, signs a "handoff" claim
/// of it, and would finish with an empty claim on the next attempt.
#[tokio::test]
async fn a_self_declared_handoff_is_refused_and_its_tokens_are_not_resumed() {
    let mut s = scene(8).await;
    let junk: Vec<u32> = vec![100, 101, 102, 103];
    write_frame(&mut s.send, &tokens(0, junk.clone(), "junk"))
        .await
        .unwrap();
    let handoff = ResultClaim {
        finish_reason: claim::FINISH_HANDOFF.into(),
        ..s.hostile.claim(&s.a, junk, "junk")
    };
    write_frame(&mut s.send, &result(claim::sign(handoff, &s.hostile.key)))
        .await
        .unwrap();
    s.honest_node_finishes().await;
}

/// Hole 4: a claim billing `prompt_tokens = u32::MAX` would bill the
/// client the whole hold.
#[tokio::test]
async fn a_claim_billing_more_prompt_tokens_than_the_input_can_make_is_refused() {
    let mut s = scene(8).await;
    write_frame(&mut s.send, &tokens(0, HONEST_IDS.to_vec(), HONEST_TEXT))
        .await
        .unwrap();
    let greedy = ResultClaim {
        prompt_tokens: u32::MAX,
        ..s.hostile.claim(&s.a, HONEST_IDS.to_vec(), HONEST_TEXT)
    };
    write_frame(&mut s.send, &result(claim::sign(greedy, &s.hostile.key)))
        .await
        .unwrap();
    s.honest_node_finishes().await;
}

/// Hole 3: unsigned tokens streamed by an attempt that then fails were
/// kept and became part of the "verified" result.
#[tokio::test]
async fn unsigned_tokens_of_a_failed_attempt_are_not_part_of_the_result() {
    let mut s = scene(8).await;
    write_frame(&mut s.send, &tokens(0, vec![100, 101, 102], "BUY NOW"))
        .await
        .unwrap();
    let failure = JobUpdate {
        msg: Some(job_update::Msg::Failure(job_update::Failure {
            reason: "x".repeat((1 << 20) - 1024),
            retryable: true,
        })),
    };
    write_frame(&mut s.send, &failure).await.unwrap();
    // The coordinator ends the failed stream as it ends a refused one.
    s.honest_node_finishes().await;
}

/// Hole 8: the live stream was never compared with the signed claim, so a
/// client watched one text and was told another was verified.
#[tokio::test]
async fn a_claim_of_other_text_than_the_node_streamed_is_refused() {
    let mut s = scene(8).await;
    write_frame(&mut s.send, &tokens(0, HONEST_IDS.to_vec(), " Rome"))
        .await
        .unwrap();
    let c = s.hostile.claim(&s.a, HONEST_IDS.to_vec(), HONEST_TEXT);
    write_frame(&mut s.send, &result(claim::sign(c, &s.hostile.key)))
        .await
        .unwrap();
    s.honest_node_finishes().await;
}

/// Streamed bytes are bounded by `max_tokens`: a node streaming past them
/// is refused as it streams, before it is buffered further.
#[tokio::test]
async fn a_node_streaming_past_max_tokens_is_refused_as_it_streams() {
    let mut s = scene(4).await;
    for i in 0..8u32 {
        // The coordinator may reset the stream while these are in flight.
        if write_frame(&mut s.send, &tokens(i, vec![100 + i], "z"))
            .await
            .is_err()
        {
            break;
        }
    }
    s.honest_node_finishes().await;
}

/// Hole 7 (strings): a megabyte drain reason is clipped before it is logged,
/// and the node is still a node (its drain counts).
#[tokio::test]
async fn a_drain_with_a_megabyte_reason_only_drains() {
    let mut s = scene(8).await;
    s.hostile
        .control(&NodeControl {
            msg: Some(mlxnet_proto::v1::node_control::Msg::Drain(
                mlxnet_proto::v1::Drain {
                    reason: "y".repeat((1 << 20) - 1024),
                },
            )),
        })
        .await;
    // A drained node's hand-off is honoured: the partial claim covers the
    // streamed tokens, and the next attempt resumes after them.
    write_frame(&mut s.send, &tokens(0, vec![7], " Par"))
        .await
        .unwrap();
    let handoff = ResultClaim {
        finish_reason: claim::FINISH_HANDOFF.into(),
        ..s.hostile.claim(&s.a, vec![7], " Par")
    };
    write_frame(&mut s.send, &result(claim::sign(handoff, &s.hostile.key)))
        .await
        .unwrap();
    let honest = FakeNode::register(&s.app, 62).await;
    let (_send, _recv, a) = honest.next_assignment().await;
    assert_eq!(a.job_id, s.job);
    let resume = a
        .resume
        .expect("a drained node's hand-off is resumed after");
    assert_eq!((resume.token_ids, resume.text.as_str()), (vec![7], " Par"));
    assert!(s.app.ledger.violations(now_ms()).await.unwrap().is_empty());
    s.app.stop().await;
}

/// The value of counter `name` on the coordinator's `/metrics`.
async fn counter(app: &TestApp, name: &str) -> u64 {
    let text = crate::test_utils::http_get(app.http_addr, "/metrics").await;
    text.lines()
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.parse().ok())
        .unwrap_or_else(|| panic!("no {name} in {text}"))
}

/// Hole 7 (heartbeats): each heartbeat was one or two fsynced writes and a
/// placement pass, unlimited. A flood of them is answered (an ack each)
/// but written at most once per half interval; the node is still placed
/// and paid.
#[tokio::test]
async fn a_heartbeat_flood_is_answered_but_written_once_per_interval() {
    // A long interval: the whole flood falls inside one half of it.
    let app = spawn_app(|c| {
        c.heartbeat_interval_ms = 600_000;
        c.heartbeat_timeout_ms = 1_200_000;
    })
    .await;
    let mut jobs = JobsClient::new(app.grpc().await);
    let mut node = FakeNode::register(&app, 62).await;
    let operator = app
        .ledger
        .link_node(&hex::encode(node.key.verifying_key().to_bytes()), "")
        .await
        .unwrap();
    const FLOOD: u64 = 1_000;
    let beat = NodeControl {
        msg: Some(mlxnet_proto::v1::node_control::Msg::Heartbeat(
            mlxnet_proto::v1::Heartbeat {
                free_memory_bytes: 8 << 30,
                ..Default::default()
            },
        )),
    };
    for _ in 0..FLOOD {
        node.control(&beat).await;
    }
    for _ in 0..FLOOD {
        let ack = node.control_reply().await;
        assert!(
            matches!(
                ack.msg,
                Some(mlxnet_proto::v1::coordinator_control::Msg::HeartbeatAck(_))
            ),
            "{ack:?}"
        );
    }
    assert_eq!(
        counter(&app, "mlxnet_node_heartbeats_written_total").await,
        1,
        "a heartbeat flood was written to the store beat by beat"
    );
    assert_eq!(
        counter(&app, "mlxnet_node_heartbeats_coalesced_total").await,
        FLOOD - 1
    );

    // The node is still placed and paid.
    let job = jobs
        .submit(prompt_job("The capital of France is", 8))
        .await
        .unwrap()
        .into_inner()
        .id;
    let (mut send, _recv, a) = node.next_assignment().await;
    assert_eq!(a.job_id, job);
    let c = node.claim(&a, HONEST_IDS.to_vec(), HONEST_TEXT);
    write_frame(&mut send, &tokens(0, HONEST_IDS.to_vec(), HONEST_TEXT))
        .await
        .unwrap();
    write_frame(&mut send, &result(claim::sign(c, &node.key)))
        .await
        .unwrap();
    let paid = books_once(&app.ledger, &app.client_account, &operator, |b| {
        b.operator.balance() > 0 && b.client.debits_pending == 0
    })
    .await;
    assert!(paid.operator.balance() > 0, "the node was paid");
    assert!(app.ledger.violations(now_ms()).await.unwrap().is_empty());
    app.stop().await;
}
