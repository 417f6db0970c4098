//! A job submitted by a client runs on a real node and comes back signed.

use mlxnet_proto::{claim, ids::NodeId, v1::JobState};
use mlxnet_tests::{
    chat_job, coordinator_config, spawn_coordinator, spawn_node, state, test_model,
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
