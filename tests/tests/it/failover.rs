//! Several coordinator replicas on one PostgreSQL database, and a real node
//! given all their addresses: when its replica drains (SIGTERM) or dies,
//! the node moves to another and serves jobs submitted there.

use mlx_node::link::LinkStatus;
use mlxnet_proto::{claim, v1::JobState};
use mlxnet_tests::{
    chat_job,
    failover::{fresh_database, record_statuses, registered_with, replica_config, Replica},
    node_config_for, spawn_node, state, Client,
};

/// A job submitted through `replica` completes on `node` with a claim that
/// verifies as the node's.
async fn a_job_completes_through(
    replica: &Replica,
    node: mlxnet_proto::ids::NodeId,
    question: &str,
) -> anyhow::Result<()> {
    let mut client = Client::connect(replica.grpc_addr, Some(&replica.accounts.client_key)).await?;
    let run = client.run_job(chat_job(question, 8)).await?;
    assert_eq!(state(&run.job), JobState::Completed, "{:?}", run.job);
    let signed = run
        .job
        .result
        .clone()
        .expect("a completed job has its claim");
    assert_eq!(claim::verify(&signed)?, node, "the claim is the node's");
    assert_eq!(
        signed.claim.expect("a claim").output_token_ids,
        run.streamed_ids
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_moves_to_another_replica_when_its_replica_drains_or_dies() -> anyhow::Result<()> {
    let Some(db) = fresh_database().await? else {
        return Ok(());
    };
    let dir = tempfile::tempdir()?;
    let a = Replica::start(replica_config(&dir.path().join("a"), &db, "replica-a")).await?;
    Replica::share_accounts(&dir.path().join("a"), &dir.path().join("b"))?;
    let b = Replica::start(replica_config(&dir.path().join("b"), &db, "replica-b")).await?;
    // Each replica has a certificate of its own here: the node pins both.
    assert_ne!(a.fingerprint, b.fingerprint);
    let config = node_config_for(
        &dir.path().join("node"),
        &format!("{},{}", a.quic_addr, b.quic_addr),
        &format!("{},{}", a.fingerprint, b.fingerprint),
        &a.accounts.operator_account,
        "n",
    );
    let mut node = spawn_node(config).await?;
    registered_with(&mut node.status, a.quic_addr).await?;
    a_job_completes_through(&a, node.id, "What is the capital of France?").await?;

    // A drains (SIGTERM): it tells the node to move, and the node goes to
    // B on the hint, not after losing its link.
    let seen = record_statuses(node.status.clone());
    let a_config = a.drain().await?;
    registered_with(&mut node.status, b.quic_addr).await?;
    let statuses = seen.lock().unwrap().clone();
    assert!(
        !statuses
            .iter()
            .any(|s| matches!(s, LinkStatus::Disconnected { .. })),
        "the node lost its link instead of moving on the hint: {statuses:?}"
    );
    a_job_completes_through(&b, node.id, "Name a colour.").await?;

    // A comes back where the node looks for it; then B dies (no drain, no
    // goodbye): the node notices and moves back to A.
    let a = Replica::start(a_config).await?;
    b.kill();
    registered_with(&mut node.status, a.quic_addr).await?;
    a_job_completes_through(&a, node.id, "Name a fruit.").await?;

    node.stop().await?;
    a.drain().await?;
    Ok(())
}
