//! Several coordinator replicas on one PostgreSQL database, and a real node
//! given all their addresses: when its replica drains (SIGTERM) or dies,
//! the node moves to another and serves jobs submitted there.

use anyhow::bail;
use mlx_node::link::LinkStatus;
use mlxnet_proto::{
    claim,
    v1::{job_event, Job, JobState, WatchJobRequest},
};
use mlxnet_tests::{
    chat_job,
    failover::{fresh_database, record_statuses, registered_with, replica_config, Replica},
    node_config_for, spawn_node, state, within, Client,
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

/// Follows job `id` through `client` until it ends (its tokens skipped: a
/// watch opened mid-job on another replica starts where that replica's
/// attempt does); the job as its terminal event carries it.
async fn ended(client: &mut Client, id: &str) -> anyhow::Result<Job> {
    let mut events = client
        .jobs
        .watch(WatchJobRequest {
            job_id: id.to_string(),
        })
        .await?
        .into_inner();
    within("the job's end", async {
        while let Some(e) = events.message().await? {
            match e.event {
                Some(job_event::Event::Completed(c)) => {
                    return c.job.ok_or_else(|| anyhow::anyhow!("no job"))
                }
                Some(job_event::Event::Failed(f)) => bail!("the job failed: {f:?}"),
                Some(job_event::Event::Cancelled(_)) => bail!("the job was cancelled"),
                _ => {}
            }
        }
        bail!("the watch ended before the job")
    })
    .await?
}

/// A job running on the node when its replica drains is handed off through
/// the draining replica (which records the node's signed partial claim
/// before it stops) and finished through the replica the node moved to:
/// one verified chain of claims, nothing streamed twice.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_job_running_when_its_replica_drains_is_handed_off_and_finished_through_another(
) -> anyhow::Result<()> {
    let Some(db) = fresh_database().await? else {
        return Ok(());
    };
    let dir = tempfile::tempdir()?;
    let a = Replica::start(replica_config(&dir.path().join("a"), &db, "replica-a")).await?;
    Replica::share_accounts(&dir.path().join("a"), &dir.path().join("b"))?;
    let b = Replica::start(replica_config(&dir.path().join("b"), &db, "replica-b")).await?;
    let mut config = node_config_for(
        &dir.path().join("node"),
        &format!("{},{}", a.quic_addr, b.quic_addr),
        &format!("{},{}", a.fingerprint, b.fingerprint),
        &a.accounts.operator_account,
        "n",
    );
    // On the hint, hand running jobs off at once (no grace to finish).
    config.drain_grace_ms = 0;
    let mut node = spawn_node(config).await?;
    registered_with(&mut node.status, a.quic_addr).await?;

    let key = a.accounts.client_key.clone();
    let mut through_a = Client::connect(a.grpc_addr, Some(&key)).await?;
    let request = crate::handoff::long_job();
    let input = request.input.clone().expect("an input");
    let job = through_a.jobs.submit(request).await?.into_inner();
    let mut events = through_a
        .jobs
        .watch(WatchJobRequest {
            job_id: job.id.clone(),
        })
        .await?
        .into_inner();
    within("the job's first tokens on A's node", async {
        while let Some(e) = events.message().await? {
            match e.event {
                Some(job_event::Event::Tokens(t)) if !t.token_ids.is_empty() => return Ok(()),
                Some(job_event::Event::Completed(_) | job_event::Event::Failed(_)) => {
                    bail!("the job ended before A drained")
                }
                _ => {}
            }
        }
        bail!("the watch ended")
    })
    .await??;

    let draining = tokio::spawn(a.drain());
    registered_with(&mut node.status, b.quic_addr).await?;
    draining.await??;
    let mut through_b = Client::connect(b.grpc_addr, Some(&key)).await?;
    let done = ended(&mut through_b, &job.id).await?;
    assert_eq!(state(&done), JobState::Completed, "{done:?}");
    assert!(
        !done.segments.is_empty(),
        "the job was handed off, not restarted: {done:?}"
    );
    let result = done.result.clone().expect("a completed job has its claim");
    let node_hex = node.id.to_string();
    let chain = claim::verify_chain(
        &done.segments,
        &result,
        &claim::JobFacts {
            job_id: &job.id,
            node_id: &node_hex,
            input: &input,
            model_sha256: None,
            grammar_sha256: None,
        },
    )?;
    assert_eq!(
        chain.text, done.output_text,
        "the job's text is the signed text"
    );
    assert!(chain.parts.len() >= 2, "{:?}", chain.parts);
    node.stop().await?;
    b.drain().await?;
    Ok(())
}
