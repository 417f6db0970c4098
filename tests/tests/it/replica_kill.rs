//! SIGKILL one of three coordinator replica processes in the middle of 50
//! running jobs (issue 21's fault test): its node moves to another replica,
//! its jobs go back to the queue once its liveness lease lapses and run on
//! the others, every client sees every job end through a live replica, and
//! the database shows none lost, none paid twice and every hold resolved
//! once (`Ledger::violations`, as the load run's kill check judges).
//!
//! Three replicas ([`ReplicaProcess`]: this test binary run again) share
//! one fresh PostgreSQL database; three real SmolLM2 nodes (in this
//! process, the real node code) each name all three replicas, node `i`
//! starting with replica `i`, and batch [`SLOTS`] jobs each, so all 50 run
//! at once. Jobs are submitted and watched round-robin through the
//! replicas; a watcher whose replica died watches again through the next.

use std::{collections::HashSet, sync::Arc, time::Duration};

use mlx_node::link::LinkStatus;
use mlxnet_coordinator::{
    ledger::{Ledger, LedgerConfig},
    store::{AnyStore, Store},
};
use mlxnet_proto::{
    claim,
    v1::{job_event, GetJobRequest, Job, JobState, WatchJobRequest},
};
use mlxnet_tests::{
    failover::{
        fresh_database,
        process::{child_main, ReplicaProcess},
        registered_with, Replica,
    },
    node_config_for, now_ms, prompt_job, spawn_node, state, within, Client, TestNode,
};
use tokio::{sync::watch, task::JoinSet};

/// Jobs running when the replica is killed.
const JOBS: usize = 50;
/// Jobs each node batches at once: three nodes hold all [`JOBS`].
const SLOTS: u32 = 17;
/// Tokens per job: the test model writes a story to the end of its budget
/// (greedy), so every job is still running when the last one starts.
const MAX_TOKENS: u32 = 32;
/// The libtest name of [`replica_child`].
const CHILD: &str = "replica_kill::replica_child";

/// A replica process of this file's test. Run any other way
/// (`--include-ignored`) it does nothing.
#[test]
#[ignore = "run as a child process by a_replica_killed_under_50_running_jobs_loses_none_and_pays_none_twice"]
fn replica_child() -> anyhow::Result<()> {
    child_main()
}

/// What the watchers have seen of one job.
#[derive(Clone, Debug, Default)]
struct Seen {
    /// The node of its latest assignment.
    node: Option<String>,
    /// Tokens streamed since that assignment.
    running: bool,
    /// The job as it ended.
    end: Option<Job>,
}

/// Every job's [`Seen`], by submit order.
type Board = Arc<watch::Sender<Vec<Seen>>>;

/// Watches job `i` (`id`) through replica `r`, and through the next one
/// whenever a watch breaks (its replica died), until it ends.
async fn follow(
    i: usize,
    id: String,
    clients: Vec<Client>,
    mut r: usize,
    board: Board,
) -> anyhow::Result<Job> {
    for _ in 0..30 {
        let mut client = clients[r].clone();
        if let Ok(Some(job)) = watch_once(i, &id, &mut client, &board).await {
            board.send_modify(|b| b[i].end = Some(job.clone()));
            return Ok(job);
        }
        r = (r + 1) % clients.len();
    }
    anyhow::bail!("job {id}: every watch broke")
}

/// One watch of job `i`: its end, or `None` when the stream broke first.
async fn watch_once(
    i: usize,
    id: &str,
    client: &mut Client,
    board: &Board,
) -> anyhow::Result<Option<Job>> {
    let mut events = client
        .jobs
        .watch(WatchJobRequest {
            job_id: id.to_owned(),
        })
        .await?
        .into_inner();
    while let Some(e) = events.message().await? {
        match e.event {
            Some(job_event::Event::Assigned(a)) => board.send_modify(|b| {
                b[i].node = Some(a.node_id);
                b[i].running = false;
            }),
            Some(job_event::Event::Tokens(t)) if !t.token_ids.is_empty() => {
                board.send_if_modified(|b| !std::mem::replace(&mut b[i].running, true));
            }
            Some(job_event::Event::Completed(c)) => return Ok(c.job),
            Some(job_event::Event::Failed(_) | job_event::Event::Cancelled(_)) => {
                let job = client.jobs.get(GetJobRequest {
                    job_id: id.to_owned(),
                });
                return Ok(Some(job.await?.into_inner()));
            }
            _ => {}
        }
    }
    Ok(None)
}

/// A real node named `name` in `dir`, given every replica, `first` first.
async fn node(
    dir: &std::path::Path,
    replicas: &[ReplicaProcess],
    first: usize,
    name: &str,
) -> anyhow::Result<TestNode> {
    let order: Vec<&ReplicaProcess> = (0..replicas.len())
        .map(|k| &replicas[(first + k) % replicas.len()])
        .collect();
    let addresses: Vec<String> = order.iter().map(|r| r.quic_addr.to_string()).collect();
    let pins: Vec<&str> = order.iter().map(|r| r.fingerprint.as_str()).collect();
    let mut config = node_config_for(
        dir,
        &addresses.join(","),
        &pins.join(","),
        &replicas[0].operator_account,
        name,
    );
    config.batch_slots = Some(SLOTS);
    config.max_concurrent_jobs = Some(SLOTS);
    let mut node = spawn_node(config).await?;
    registered_with(&mut node.status, replicas[first].quic_addr).await?;
    Ok(node)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_killed_under_50_running_jobs_loses_none_and_pays_none_twice(
) -> anyhow::Result<()> {
    let Some(db) = fresh_database().await? else {
        return Ok(());
    };
    let dir = tempfile::tempdir()?;
    let at = |name: &str| dir.path().join(name);
    let a = ReplicaProcess::start(CHILD, &at("a"), &db, "replica-a").await?;
    Replica::share_accounts(&at("a"), &at("b"))?;
    Replica::share_accounts(&at("a"), &at("c"))?;
    let (b_dir, c_dir) = (at("b"), at("c"));
    let (b, c) = tokio::try_join!(
        ReplicaProcess::start(CHILD, &b_dir, &db, "replica-b"),
        ReplicaProcess::start(CHILD, &c_dir, &db, "replica-c"),
    )?;
    let mut replicas = vec![a, b, c];
    let mut nodes = Vec::new();
    for i in 0..replicas.len() {
        nodes.push(node(&at(&format!("node-{i}")), &replicas, i, &format!("n{i}")).await?);
    }

    // 50 jobs, submitted and watched round-robin through the replicas.
    let mut clients = Vec::new();
    for r in &replicas {
        clients.push(Client::connect(r.grpc_addr, Some(&r.client_key)).await?);
    }
    let board: Board = Arc::new(watch::channel(vec![Seen::default(); JOBS]).0);
    let mut followers = JoinSet::new();
    let mut submitted = HashSet::new();
    for j in 0..JOBS {
        let r = j % clients.len();
        let prompt = format!("Once upon a time, in a village by the sea, lived {j} cats.");
        let id = clients[r]
            .jobs
            .submit(prompt_job(&prompt, MAX_TOKENS))
            .await?
            .into_inner()
            .id;
        submitted.insert(id.clone());
        followers.spawn(follow(j, id, clients.clone(), r, board.clone()));
    }

    // Every job is running (or already done), some of them on A's node:
    // then A is killed, with no drain and no goodbye.
    let victim_node = nodes[0].id.to_string();
    let running_on_a = |b: &[Seen]| {
        b.iter()
            .filter(|s| {
                s.end.is_none() && s.running && s.node.as_deref() == Some(victim_node.as_str())
            })
            .count()
    };
    let mut seen = board.subscribe();
    let at_kill = within(
        "every job running or ended",
        seen.wait_for(|b| b.iter().all(|s| s.running || s.end.is_some())),
    )
    .await??
    .clone();
    let a = replicas.remove(0);
    let a_quic = a.quic_addr;
    a.kill()?;
    let (ended_before, on_a) = (
        at_kill.iter().filter(|s| s.end.is_some()).count(),
        running_on_a(&at_kill[..]),
    );
    eprintln!("killed replica-a: {on_a} jobs running on its node, {ended_before} of {JOBS} ended");
    assert!(
        on_a > 0,
        "nothing ran on A's node when it was killed: {at_kill:?}"
    );

    // A's node moves to another replica (the next it names, B, unless a
    // handshake there failed and it went on to C).
    within(
        "A's node registered with another replica",
        nodes[0].status.wait_for(
            |s| matches!(s, LinkStatus::Registered { coordinator, .. } if *coordinator != a_quic),
        ),
    )
    .await?
    .map_err(|_| anyhow::anyhow!("A's node stopped"))?;

    // Every watcher sees its job end, through a live replica.
    let mut ends = Vec::new();
    within("every job's end", async {
        while let Some(joined) = followers.join_next().await {
            ends.push(joined??);
        }
        anyhow::Ok(())
    })
    .await??;

    // The database judges: every hold resolved (the sweep settles what the
    // kill left), then the books, then every job.
    let store = AnyStore::connect(&db).await?;
    let ledger = Ledger::new(store.clone(), LedgerConfig::default());
    within("every hold resolved", async {
        while ledger.totals().await?.open_holds > 0 {
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        anyhow::Ok(())
    })
    .await??;
    let violations = ledger.violations(now_ms()).await?;
    assert!(violations.is_empty(), "the books broke: {violations:?}");
    let jobs = store.list_jobs(u32::MAX).await?;
    let held: HashSet<String> = jobs.iter().map(|j| j.id.to_string()).collect();
    assert_eq!(
        held, submitted,
        "the database holds exactly the jobs submitted"
    );
    let mut completed = 0;
    for job in &ends {
        let stored = jobs
            .iter()
            .find(|j| j.id.to_string() == job.id)
            .expect("held");
        match state(job) {
            JobState::Completed => {
                let signed = job.result.as_ref().expect("a completed job has its claim");
                let signer = claim::verify(signed)?;
                assert_eq!(signer.to_string(), job.node_id, "the claim is its node's");
                assert_eq!(
                    signed.claim.as_ref().map(|c| c.job_id.as_str()),
                    Some(job.id.as_str())
                );
                completed += 1;
            }
            JobState::Failed => assert!(!job.error.is_empty(), "failed without a reason: {job:?}"),
            other => panic!("job {} ended {other:?}", job.id),
        }
        let watched = match state(job) {
            JobState::Completed => "completed",
            JobState::Failed => "failed",
            _ => "other",
        };
        assert_eq!(
            stored.state.as_str(),
            watched,
            "the watcher's end is the database's"
        );
    }
    let requeued = jobs.iter().filter(|j| j.attempt > 1).count();
    eprintln!("{completed} of {JOBS} completed, the rest failed cleanly; {requeued} ran again after the kill");
    assert!(requeued > 0, "no job of the killed replica ran again");
    store.close().await;

    for node in nodes {
        node.stop().await?;
    }
    for replica in replicas {
        replica.stop().await?;
    }
    Ok(())
}
