//! The client API against a real coordinator: bad input is refused with a
//! clear status and creates no job; a job runs on a (hand-made) node, streams
//! its tokens and completes only with a result that verifies.

use mlxnet_proto::{
    claim,
    frame::write_frame,
    v1::{
        job_event, job_input, job_update, jobs_client::JobsClient, models_client::ModelsClient,
        ChatMessage, ChatMessages, GetJobRequest, JobInput, JobState, JobUpdate, ListJobsRequest,
        ListModelsRequest, ResultClaim, WatchJobRequest,
    },
};
use tonic::Code;

use crate::test_utils::{prompt_job, spawn_app, Authed, FakeNode, TestApp};

async fn jobs(app: &TestApp) -> JobsClient<Authed> {
    JobsClient::new(app.grpc().await)
}

async fn job_count(client: &mut JobsClient<Authed>) -> usize {
    client
        .list(ListJobsRequest { limit: 200 })
        .await
        .unwrap()
        .into_inner()
        .jobs
        .len()
}

#[tokio::test]
async fn bad_submissions_get_a_clear_status_and_create_no_job() {
    let app = spawn_app(|_| {}).await;
    let mut client = jobs(&app).await;

    let mut unknown = prompt_job("hi", 8);
    unknown.model = "gpt-17".into();
    let err = client.submit(unknown).await.unwrap_err();
    assert_eq!(err.code(), Code::NotFound, "{err:?}");
    assert!(err.message().contains("unknown model"), "{}", err.message());

    let err = client.submit(prompt_job("   ", 8)).await.unwrap_err();
    assert_eq!(err.code(), Code::InvalidArgument, "{err:?}");
    assert!(
        err.message().contains("prompt is empty"),
        "{}",
        err.message()
    );

    let mut empty_chat = prompt_job("x", 8);
    empty_chat.input = Some(JobInput {
        kind: Some(job_input::Kind::Chat(ChatMessages { messages: vec![] })),
    });
    assert_eq!(
        client.submit(empty_chat).await.unwrap_err().code(),
        Code::InvalidArgument
    );

    let err = client.submit(prompt_job("hi", 4097)).await.unwrap_err();
    assert_eq!(err.code(), Code::InvalidArgument, "{err:?}");
    assert!(
        err.message()
            .contains("max_tokens 4097 exceeds the limit of 4096"),
        "{}",
        err.message()
    );

    let mut hot = prompt_job("hi", 8);
    hot.sampling.as_mut().unwrap().temperature = f32::NAN;
    assert_eq!(
        client.submit(hot).await.unwrap_err().code(),
        Code::InvalidArgument
    );

    let mut bad_role = prompt_job("x", 8);
    bad_role.input = Some(JobInput {
        kind: Some(job_input::Kind::Chat(ChatMessages {
            messages: vec![ChatMessage {
                role: "root".into(),
                content: "hi".into(),
            }],
        })),
    });
    assert_eq!(
        client.submit(bad_role).await.unwrap_err().code(),
        Code::InvalidArgument
    );

    // Over the prompt limit, under the request limit: a clear InvalidArgument.
    let err = client
        .submit(prompt_job(&"a".repeat(100 * 1024), 8))
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::InvalidArgument, "{err:?}");
    assert!(
        err.message().contains("the limit is 65536"),
        "{}",
        err.message()
    );

    // Over the request limit: refused before decoding.
    let err = client
        .submit(prompt_job(&"a".repeat(2 << 20), 8))
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::OutOfRange, "{err:?}");
    assert!(err.message().contains("too large"), "{}", err.message());

    assert_eq!(
        job_count(&mut client).await,
        0,
        "a refused request created a job"
    );

    // A good one is accepted, with defaults and a seed recorded.
    let job = client
        .submit(prompt_job("hi", 0))
        .await
        .unwrap()
        .into_inner();
    let sampling = job.sampling.unwrap();
    assert_eq!(sampling.max_tokens, 256);
    assert!(sampling.seed.is_some());
    assert_eq!(job.state, JobState::Queued as i32);
    assert_eq!(job_count(&mut client).await, 1);

    let err = client
        .get(GetJobRequest {
            job_id: "nope".into(),
        })
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::InvalidArgument);
    app.stop().await;
}

#[tokio::test]
async fn a_job_no_online_node_could_ever_hold_is_refused_at_submit_saying_why() {
    // The catalogue's model is 41 GB; the only node online has 16 GiB.
    let app = spawn_app(|c| c.catalogue[0].size_bytes = 41_000_000_000).await;
    let mut client = jobs(&app).await;
    // With no node online the job waits (one may join).
    assert!(client.submit(prompt_job("hi", 8)).await.is_ok());
    assert_eq!(job_count(&mut client).await, 1);
    let _node = FakeNode::register(&app, 12).await;
    let err = client.submit(prompt_job("hi", 8)).await.unwrap_err();
    assert_eq!(err.code(), Code::FailedPrecondition, "{err:?}");
    assert_eq!(
        err.message(),
        "no online node or pod could ever hold this job: \
         needs 45.1 GB, largest node or pod has 17.2 GB"
    );
    assert_eq!(
        job_count(&mut client).await,
        1,
        "the refused job created a row"
    );
    app.stop().await;
}

#[tokio::test]
async fn an_attempt_without_progress_loses_its_lease_and_the_watch_says_so() {
    let app = spawn_app(|c| c.job_lease_ms = 300).await;
    let mut client = jobs(&app).await;
    let node = FakeNode::register(&app, 13).await;
    let job = client
        .submit(prompt_job("The capital of France is", 4))
        .await
        .unwrap()
        .into_inner();
    let mut watch = client
        .watch(WatchJobRequest {
            job_id: job.id.clone(),
        })
        .await
        .unwrap()
        .into_inner();
    // The node takes the job, says it started, then goes silent.
    let (mut send, _recv, a) = node.next_assignment().await;
    assert_eq!(a.attempt, 1);
    let started = JobUpdate {
        msg: Some(job_update::Msg::Started(job_update::Started {})),
    };
    write_frame(&mut send, &started).await.unwrap();
    // The lease runs out: the job comes back as attempt 2.
    let (_send2, _recv2, a2) = node.next_assignment().await;
    assert_eq!((a2.job_id.as_str(), a2.attempt), (job.id.as_str(), 2));
    let mut requeued = None;
    while let Some(event) = watch.message().await.unwrap() {
        match event.event {
            Some(job_event::Event::Queued(q)) if q.attempt == 2 => requeued = Some(q.reason),
            Some(job_event::Event::Assigned(a)) if a.attempt == 2 => break,
            _ => {}
        }
    }
    let reason = requeued.expect("the watch saw the requeue");
    assert!(
        reason.starts_with("lease expired: no progress from the node for 300ms"),
        "{reason}"
    );
    app.stop().await;
}

#[tokio::test]
async fn a_job_streams_tokens_and_completes_only_with_a_verified_result() {
    let app = spawn_app(|_| {}).await;
    let mut client = jobs(&app).await;
    let node = FakeNode::register(&app, 11).await;
    let models = ModelsClient::new(app.grpc().await)
        .list(ListModelsRequest {})
        .await
        .unwrap()
        .into_inner();
    assert_eq!(models.models[0].nodes_serving, 1);

    let request = prompt_job("The capital of France is", 4);
    let job = client.submit(request).await.unwrap().into_inner();

    // First attempt: tokens, then a result whose signature is broken.
    let (mut send, _recv, a) = node.next_assignment().await;
    assert_eq!((a.job_id.as_str(), a.attempt), (job.id.as_str(), 1));
    assert!(a.sampling.as_ref().unwrap().seed.is_some());
    let claim_for = |attempt: u32| ResultClaim {
        attempt,
        ..node.claim(&a, vec![7, 8], " Paris")
    };
    let tokens = |index: u32, id: u32, text: &str| JobUpdate {
        msg: Some(job_update::Msg::Tokens(job_update::Tokens {
            index,
            token_ids: vec![id],
            text: text.into(),
        })),
    };
    write_frame(&mut send, &tokens(0, 7, " Par")).await.unwrap();
    let mut bad = claim::sign(claim_for(1), &node.key);
    bad.signature[3] ^= 1;
    write_frame(
        &mut send,
        &JobUpdate {
            msg: Some(job_update::Msg::Result(bad)),
        },
    )
    .await
    .unwrap();

    // The job comes back as attempt 2; nothing was stored as completed.
    let (mut send, _recv2, a2) = node.next_assignment().await;
    assert_eq!((a2.job_id.as_str(), a2.attempt), (job.id.as_str(), 2));
    let now = client
        .get(GetJobRequest {
            job_id: job.id.clone(),
        })
        .await
        .unwrap()
        .into_inner();
    assert!(now.result.is_none());
    assert_ne!(now.state, JobState::Completed as i32);

    // The refused attempt's unsigned tokens are not kept: attempt 2 starts
    // from the input (a node still connected hands off only by draining).
    assert_eq!(a2.resume, None, "attempt 2 resumed after refused tokens");
    // A watcher arriving mid-stream replays the tokens so far, then follows.
    let started = JobUpdate {
        msg: Some(job_update::Msg::Started(job_update::Started {})),
    };
    write_frame(&mut send, &started).await.unwrap();
    write_frame(&mut send, &tokens(0, 7, " Par")).await.unwrap();
    let mut watch = client
        .watch(WatchJobRequest {
            job_id: job.id.clone(),
        })
        .await
        .unwrap()
        .into_inner();
    write_frame(&mut send, &tokens(1, 8, "is")).await.unwrap();
    write_frame(
        &mut send,
        &JobUpdate {
            msg: Some(job_update::Msg::Result(claim::sign(
                claim_for(2),
                &node.key,
            ))),
        },
    )
    .await
    .unwrap();

    let mut text = String::new();
    let mut done = None;
    while let Some(event) = watch.message().await.unwrap() {
        match event.event {
            Some(job_event::Event::Tokens(t)) => text.push_str(&t.text),
            Some(job_event::Event::Completed(c)) => {
                done = c.job;
                break;
            }
            Some(job_event::Event::Failed(f)) => panic!("job failed: {}", f.reason),
            _ => {}
        }
    }
    assert_eq!(text, " Paris");
    let done = done.expect("completed event carries the job");
    assert_eq!(done.state, JobState::Completed as i32);
    assert_eq!(done.output_text, " Paris");
    assert_eq!(done.attempt, 2);
    let signer = claim::verify(done.result.as_ref().unwrap()).unwrap();
    assert_eq!(signer.to_string(), done.node_id);

    // A late watcher gets the terminal event straight away.
    let mut late = client
        .watch(WatchJobRequest {
            job_id: job.id.clone(),
        })
        .await
        .unwrap()
        .into_inner();
    let first = late.message().await.unwrap().unwrap();
    assert!(
        matches!(first.event, Some(job_event::Event::Completed(_))),
        "{first:?}"
    );
    assert!(late.message().await.unwrap().is_none());

    // /metrics timed each step: two placements (one per attempt), the
    // refused result, the first token of the first attempt only (attempt
    // 2's tokens are not a first token for the client), one settlement.
    let metrics = crate::test_utils::http_get(app.http_addr, "/metrics").await;
    for line in [
        "mlxnet_placement_seconds_count 2",
        "mlxnet_results_refused_total 1",
        "mlxnet_first_token_seconds_count 1",
        "mlxnet_settlement_seconds_count 1",
        "mlxnet_jobs_completed_total 1",
    ] {
        assert!(
            metrics.contains(&format!("\n{line}\n")),
            "{line}: {metrics}"
        );
    }
    app.stop().await;
}

#[tokio::test]
async fn cancelling_a_running_job_resets_its_stream_and_ends_its_watch() {
    let app = spawn_app(|_| {}).await;
    let mut client = jobs(&app).await;
    let node = FakeNode::register(&app, 12).await;
    let job = client
        .submit(prompt_job("Count to a million", 64))
        .await
        .unwrap()
        .into_inner();
    let (_send, mut recv, a) = node.next_assignment().await;
    assert_eq!(a.job_id, job.id);
    let mut watch = client
        .watch(WatchJobRequest {
            job_id: job.id.clone(),
        })
        .await
        .unwrap()
        .into_inner();

    let cancelled = client
        .cancel(mlxnet_proto::v1::CancelJobRequest {
            job_id: job.id.clone(),
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(cancelled.state, JobState::Cancelled as i32);

    // The node sees its assignment stream reset by the coordinator.
    let mut buf = [0u8; 16];
    let read = recv.read(&mut buf).await;
    assert!(matches!(read, Err(quinn::ReadError::Reset(_))), "{read:?}");

    let mut ended_cancelled = false;
    while let Some(event) = watch.message().await.unwrap() {
        if matches!(event.event, Some(job_event::Event::Cancelled(_))) {
            ended_cancelled = true;
        }
    }
    assert!(ended_cancelled, "the watch did not end with Cancelled");

    // Cancelling again is harmless; the job stays cancelled.
    let again = client
        .cancel(mlxnet_proto::v1::CancelJobRequest {
            job_id: job.id.clone(),
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(again.state, JobState::Cancelled as i32);
    app.stop().await;
}
