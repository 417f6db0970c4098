//! Refused claims pay nobody: against a real coordinator, a node sends, one
//! attempt at a time, a claim tampered in each field, claims replayed from
//! another job and another attempt, claims about another input or model
//! file, claims signed by the wrong key or by another node, and a claim
//! billing more tokens than it lists. Each is refused, the job is requeued,
//! and no balance moves; the one honest claim at the end is paid.

use ed25519_dalek::SigningKey;
use mlxnet_proto::{
    claim,
    frame::write_frame,
    v1::{
        job_event, job_update, jobs_client::JobsClient, GetJobRequest, JobState, JobUpdate,
        ResultClaim, SignedClaim, WatchJobRequest,
    },
};
use rand::{rngs::StdRng, SeedableRng};

use crate::test_utils::{books, books_once, claim_for, prompt_job, spawn_app, tokens_of, FakeNode};

/// What forged claims borrow from elsewhere.
struct Others {
    /// Job A's input digest.
    input_a: Vec<u8>,
    /// Another node's id.
    thief: Vec<u8>,
}

fn send_result(signed: SignedClaim) -> JobUpdate {
    JobUpdate {
        msg: Some(job_update::Msg::Result(signed)),
    }
}

/// Streams the tokens `signed` lists (a claim covers what its attempt
/// streamed), then sends it.
async fn stream_and_send(send: &mut quinn::SendStream, signed: SignedClaim) {
    if let Some(c) = &signed.claim {
        write_frame(send, &tokens_of(0, c)).await.unwrap();
    }
    write_frame(send, &send_result(signed)).await.unwrap();
}

#[tokio::test]
async fn refused_claims_change_no_balance_and_the_honest_one_is_paid() {
    let app = spawn_app(|c| c.limits.max_attempts = 40).await;
    let mut jobs = JobsClient::new(app.grpc().await);
    let node = FakeNode::register(&app, 31).await;
    let node_hex = hex::encode(node.key.verifying_key().to_bytes());
    let operator = app.ledger.link_node(&node_hex, "").await.unwrap();
    let thief = SigningKey::generate(&mut StdRng::seed_from_u64(32));

    // Job A, completed honestly: its signed claim is what a replay reuses.
    let request_a = prompt_job("The capital of France is", 8);
    jobs.submit(request_a).await.unwrap().into_inner();
    let (mut send, _recv, a) = node.next_assignment().await;
    let claim_a = claim::sign(node.claim(&a, vec![7, 8], " Paris"), &node.key);
    stream_and_send(&mut send, claim_a.clone()).await;

    // Job B: every refused claim arrives on one attempt of it.
    let request_b = prompt_job("The capital of Italy is", 8);
    let job_b = jobs.submit(request_b).await.unwrap().into_inner();
    let (mut send, mut recv, mut assignment) = node.next_assignment().await;
    let paid_a = books_once(&app.ledger, &app.client_account, &operator, |b| {
        b.operator.balance() > 0
    })
    .await;
    assert!(paid_a.operator.balance() > 0, "job A was paid: {paid_a:?}");
    assert!(paid_a.client.debits_pending > 0, "job B holds its price");

    let first_b = assignment.clone();
    let key = node.key.clone();
    let honest = move |attempt: u32| ResultClaim {
        attempt,
        prefill_micros: 100,
        decode_micros: 200,
        ..claim_for(&key, &first_b, vec![9, 10, 11], " Rome")
    };
    type Forge = Box<dyn Fn(u32) -> SignedClaim>;
    let tamper = |edit: fn(&mut ResultClaim)| -> Forge {
        let honest = honest.clone();
        let key = node.key.clone();
        Box::new(move |attempt| {
            let mut signed = claim::sign(honest(attempt), &key);
            edit(signed.claim.as_mut().unwrap());
            signed
        })
    };
    // Claims that verify as signatures, made by `key` after `edit`.
    let signed_by = |key: &SigningKey, edit: fn(&mut ResultClaim, &Others)| -> Forge {
        let honest = honest.clone();
        let key = key.clone();
        let others = Others {
            input_a: claim_a.claim.as_ref().unwrap().prompt_sha256.clone(),
            thief: thief.verifying_key().to_bytes().to_vec(),
        };
        Box::new(move |attempt| {
            let mut c = honest(attempt);
            edit(&mut c, &others);
            claim::sign(c, &key)
        })
    };
    let replayed_a = claim_a.clone();
    let forgeries: Vec<(&str, Forge)> = vec![
        ("tampered job id", tamper(|c| c.job_id = "x".into())),
        ("tampered attempt", tamper(|c| c.attempt += 1)),
        ("tampered model digest", tamper(|c| c.model_sha256[0] ^= 1)),
        (
            "tampered prompt digest",
            tamper(|c| c.prompt_sha256[0] ^= 1),
        ),
        ("tampered token ids", tamper(|c| c.output_token_ids[0] += 1)),
        ("tampered text", tamper(|c| c.output_text.push('!'))),
        (
            "tampered prompt tokens",
            tamper(|c| c.prompt_tokens += 1000),
        ),
        (
            "tampered completion tokens",
            tamper(|c| c.completion_tokens += 1),
        ),
        ("tampered prefill time", tamper(|c| c.prefill_micros += 1)),
        ("tampered decode time", tamper(|c| c.decode_micros += 1)),
        ("tampered node id", tamper(|c| c.node_id[0] ^= 1)),
        (
            "tampered finish",
            tamper(|c| c.finish_reason = "length".into()),
        ),
        ("replayed from job A", Box::new(move |_| replayed_a.clone())),
        (
            "replayed from the previous attempt",
            signed_by(&node.key, |c, _| c.attempt -= 1),
        ),
        (
            "about job A's input",
            signed_by(&node.key, |c, o| c.prompt_sha256 = o.input_a.clone()),
        ),
        (
            "about another model file",
            signed_by(&node.key, |c, _| c.model_sha256 = vec![1; 32]),
        ),
        (
            "names the node, signed by another key",
            signed_by(&thief, |_, _| {}),
        ),
        (
            "signed by another node, naming itself",
            signed_by(&thief, |c, o| c.node_id = o.thief.clone()),
        ),
        (
            "bills more tokens than it lists",
            signed_by(&node.key, |c, _| c.completion_tokens = 8),
        ),
        // Found by the mixed-fleet run (`tests/tests/it/fleet.rs`): a
        // claim listing ids past the model's vocabulary completed (shown
        // to the client as verified) until its audit failed.
        (
            "lists a token id outside the vocabulary",
            signed_by(&node.key, |c, _| c.output_token_ids[0] = u32::MAX),
        ),
    ];
    for (what, forge) in &forgeries {
        let attempt = assignment.attempt;
        stream_and_send(&mut send, forge(attempt)).await;
        // The refusal resets the stream; the job comes back as the next attempt.
        let mut buf = [0u8; 8];
        let read = recv.read(&mut buf).await;
        assert!(
            matches!(read, Err(quinn::ReadError::Reset(_))),
            "{what}: {read:?}"
        );
        (send, recv, assignment) = node.next_assignment().await;
        assert_eq!(assignment.attempt, attempt + 1, "{what}");
        let now = jobs
            .get(GetJobRequest {
                job_id: job_b.id.clone(),
            })
            .await
            .unwrap()
            .into_inner();
        assert!(now.result.is_none(), "{what}: a result was stored");
        assert_ne!(now.state, JobState::Completed as i32, "{what}");
        assert_eq!(
            books(&app.ledger, &app.client_account, &operator).await,
            paid_a,
            "{what}: a balance moved"
        );
    }
    assert!(app
        .ledger
        .violations(crate::util::now_ms())
        .await
        .unwrap()
        .is_empty());

    // The honest claim for the current attempt is accepted and paid.
    let attempt = assignment.attempt;
    stream_and_send(&mut send, claim::sign(honest(attempt), &node.key)).await;
    let mut watch = jobs
        .watch(WatchJobRequest {
            job_id: job_b.id.clone(),
        })
        .await
        .unwrap()
        .into_inner();
    let mut done = None;
    while let Some(e) = watch.message().await.unwrap() {
        if let Some(job_event::Event::Completed(c)) = e.event {
            done = c.job;
        }
    }
    let done = done.expect("job B completed");
    drop(recv);
    assert_eq!(done.result.unwrap().claim.unwrap().attempt, attempt);
    // Watch can report the stored completion before settlement commits (a
    // watcher that arrives late reads the job from the store).
    let paid_b = books_once(&app.ledger, &app.client_account, &operator, |b| {
        b.operator.balance() > paid_a.operator.balance()
    })
    .await;
    assert!(
        paid_b.operator.balance() > paid_a.operator.balance(),
        "job B was paid: {paid_b:?}"
    );
    assert_eq!(paid_b.client.debits_pending, 0);
    app.stop().await;
}
