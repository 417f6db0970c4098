//! The coordinator restarts on the same SQLite file: jobs survive, nodes come
//! back by themselves and take new work.

use mlxnet_proto::v1::{GetJobRequest, JobState, NetworkStatsRequest};
use mlxnet_tests::{chat_job, coordinator_config, spawn_coordinator, spawn_node, state};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn completed_jobs_survive_a_restart_and_nodes_reconnect() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let coord = spawn_coordinator(coordinator_config(&dir.path().join("coord"))).await?;
    let mut node = spawn_node(coord.node_config(&dir.path().join("n"), "n")).await?;
    node.registered().await?;

    let before = coord
        .client()
        .await?
        .run_job(chat_job("What is the capital of France?", 16))
        .await?;
    assert_eq!(state(&before.job), JobState::Completed);

    let config = coord.stop().await?;
    node.disconnected().await?;
    let coord = spawn_coordinator(config).await?;

    let mut client = coord.client().await?;
    let stored = client
        .jobs
        .get(GetJobRequest {
            job_id: before.job_id.clone(),
        })
        .await?
        .into_inner();
    assert_eq!(state(&stored), JobState::Completed);
    assert_eq!(stored.output_text, before.job.output_text);
    assert_eq!(
        stored.result, before.job.result,
        "the signed claim survives"
    );

    node.registered().await?;
    let stats = client
        .network
        .stats(NetworkStatsRequest {})
        .await?
        .into_inner();
    assert_eq!(stats.nodes_online, 1);
    assert_eq!(stats.jobs_completed, 1);

    let after = client.run_job(chat_job("Name a fruit.", 8)).await?;
    assert_eq!(state(&after.job), JobState::Completed);
    assert_eq!(after.job.node_id, node.id.to_string());
    Ok(())
}
