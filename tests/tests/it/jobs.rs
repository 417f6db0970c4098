//! A job submitted by a client runs on a real node and comes back signed;
//! a client's higher-priority job runs before its older lower-priority one.

use mlxnet_proto::{
    claim,
    ids::NodeId,
    v1::{job_event, JobState, WatchJobRequest},
};
use mlxnet_tests::{
    chat_job, coordinator_config, prompt_job, spawn_coordinator, spawn_node, state, test_model,
    within, Client,
};

const MODEL_SHA256: &str = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_nodes_stream_real_answers_with_verifiable_claims() -> anyhow::Result<()> {
    test_model();
    let dir = tempfile::tempdir()?;
    let coord = spawn_coordinator(coordinator_config(&dir.path().join("coord"))).await?;
    // One job at a time each (a node batches several by default), so the
    // two jobs must land on the two nodes.
    let one_slot = |name: &str| {
        let mut c = coord.node_config(&dir.path().join(name), name);
        c.max_concurrent_jobs = Some(1);
        c
    };
    let mut a = spawn_node(one_slot("a")).await?;
    let mut b = spawn_node(one_slot("b")).await?;
    a.registered().await?;
    b.registered().await?;

    let mut client = coord.client().await?;
    let first = chat_job("What is the capital of France?", 48);
    let second = chat_job("Name a color of the sky.", 48);
    let sent = [first.input.clone().unwrap(), second.input.clone().unwrap()];
    // Both are submitted before either can finish: each node takes one job at
    // a time, so the two jobs must land on the two nodes.
    let j1 = client.jobs.submit(first).await?.into_inner();
    let j2 = client.jobs.submit(second).await?.into_inner();
    let (mut c1, mut c2) = (client.clone(), client.clone());
    let (r1, r2) = tokio::join!(c1.follow(j1.id), c2.follow(j2.id));
    let runs = [r1?, r2?];

    let nodes = [a.id, b.id];
    let mut ran_on = Vec::new();
    for (run, input) in runs.iter().zip(&sent) {
        assert_eq!(state(&run.job), JobState::Completed, "job {:?}", run.job);
        assert!(!run.streamed_ids.is_empty(), "no tokens were streamed");
        assert_eq!(
            run.streamed_text, run.job.output_text,
            "stream and result differ"
        );

        let signed = run
            .job
            .result
            .clone()
            .expect("completed job has a signed claim");
        let signer = claim::verify(&signed).expect("stored claim verifies");
        assert!(nodes.contains(&signer), "claim signed by an unknown node");
        assert_eq!(run.job.node_id, signer.to_string());
        let c = signed.claim.unwrap();
        assert_eq!(c.job_id, run.job_id);
        assert_eq!(c.output_token_ids, run.streamed_ids);
        assert_eq!(c.output_text, run.job.output_text);
        assert_eq!(c.prompt_sha256, claim::input_digest(input).to_vec());
        assert_eq!(hex::encode(&c.model_sha256), MODEL_SHA256);
        assert!(c.prompt_tokens > 5 && c.completion_tokens as usize == c.output_token_ids.len());
        ran_on.push(signer);
    }
    assert!(
        runs[0].job.output_text.contains("Paris"),
        "the model's answer: {:?}",
        runs[0].job.output_text
    );
    assert_ne!(ran_on[0], ran_on[1], "both jobs ran on one node");
    let _: Vec<NodeId> = ran_on;
    Ok(())
}

/// Job priority through the API: a client queues a priority-0 job, then a
/// priority-3 one, while no node is online. The one node that then comes
/// (one job at a time) is given the priority-3 job first, although it was
/// submitted second; the older job runs once the node is free again.
///
/// Ordered by events: the node can hold one job, so the second assignment
/// is made only after the first job's attempt ended; the test reads the
/// order in which the two watches saw their assignments.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_higher_priority_job_is_placed_before_an_older_lower_one() -> anyhow::Result<()> {
    test_model();
    let dir = tempfile::tempdir()?;
    let coord = spawn_coordinator(coordinator_config(&dir.path().join("coord"))).await?;
    let client = coord.client().await?;
    let mut low = prompt_job("The capital of France is", 8);
    low.priority = 0;
    let mut high = prompt_job("The capital of Italy is", 8);
    high.priority = 3;
    let low = client.jobs.clone().submit(low).await?.into_inner();
    let high = client.jobs.clone().submit(high).await?.into_inner();
    assert_eq!(high.priority, 3, "the job records its priority");
    for j in [&low, &high] {
        assert_eq!(state(j), JobState::Queued, "no node is online yet");
    }
    // Both watches are open before any node can take a job.
    let (seen, mut order) = tokio::sync::mpsc::unbounded_channel();
    let mut watches = Vec::new();
    for (name, id) in [("low", low.id.clone()), ("high", high.id.clone())] {
        let events = watch(&client, &id).await?;
        let seen = seen.clone();
        watches.push(tokio::spawn(follow(events, name, seen)));
    }
    drop(seen);

    let mut config = coord.node_config(&dir.path().join("node"), "one-slot");
    config.max_concurrent_jobs = Some(1);
    let mut node = spawn_node(config).await?;
    node.registered().await?;
    let mut assigned = Vec::new();
    within("both jobs to be assigned", async {
        while assigned.len() < 2 {
            match order.recv().await {
                Some(name) => assigned.push(name),
                None => break,
            }
        }
    })
    .await?;
    assert_eq!(
        assigned,
        ["high", "low"],
        "the priority-3 job goes first on the freed node"
    );
    for w in watches {
        let end = within("the job's end", w).await??;
        assert_eq!(end?, JobState::Completed);
    }
    node.stop().await?;
    coord.stop().await?;
    Ok(())
}

async fn watch(
    client: &Client,
    id: &str,
) -> anyhow::Result<tonic::Streaming<mlxnet_proto::v1::JobEvent>> {
    Ok(client
        .jobs
        .clone()
        .watch(WatchJobRequest {
            job_id: id.to_owned(),
        })
        .await?
        .into_inner())
}

/// Follows a job's events, sending `name` once when it is first assigned;
/// returns its final state.
async fn follow(
    mut events: tonic::Streaming<mlxnet_proto::v1::JobEvent>,
    name: &'static str,
    seen: tokio::sync::mpsc::UnboundedSender<&'static str>,
) -> anyhow::Result<JobState> {
    let mut told = false;
    while let Some(e) = events.message().await? {
        match e.event {
            Some(job_event::Event::Assigned(_)) if !told => {
                told = true;
                let _ = seen.send(name);
            }
            Some(job_event::Event::Completed(_)) => return Ok(JobState::Completed),
            Some(job_event::Event::Failed(f)) => anyhow::bail!("{name} failed: {}", f.reason),
            Some(job_event::Event::Cancelled(_)) => return Ok(JobState::Cancelled),
            _ => {}
        }
    }
    anyhow::bail!("{name}'s watch ended before the job did")
}
