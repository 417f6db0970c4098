//! Availability rewards end to end: real dedicated nodes heartbeat to a
//! real coordinator, its ledger sweep pays each ended epoch from the reward
//! pool, and the operator sees the rewards in its history and earnings. A
//! node off probation (the operator's trusted node) that has served a job
//! is paid for its online time, within what its memory and the epoch
//! allow; a node on probation (a new key), online beside it as long, earns
//! nothing.
//!
//! Short epochs ([`EPOCH_MS`]) and a fast sweep make a few epochs end during
//! the test. Every wait is for an event (rewards paid, read through the
//! client API) with the harness deadline as its bound; the one clock read is
//! an upper bound of the time the node was online, which only grows on a
//! slow machine.

use std::time::{Duration, Instant};

use mlx_node::identity::Identity;
use mlxnet_coordinator::ledger::REWARD_POOL;
use mlxnet_proto::v1::{
    EarningsRequest, HistoryRequest, JobState, LedgerEntry, NetworkStatsRequest,
};
use mlxnet_tests::{
    chat_job, coordinator_config, spawn_coordinator, spawn_node, state, test_model, within,
};

/// The reward epoch of the test's coordinator.
const EPOCH_MS: i64 = 1_000;
/// Micro-MLX per GiB-hour: one per GiB-millisecond.
const PER_GIB_HOUR: u64 = 3_600_000;
/// The heartbeat timeout: the most one heartbeat's interval is paid for.
const HEARTBEAT_TIMEOUT_MS: u64 = 5_000;
/// Epochs the test waits to see paid.
const EPOCHS: usize = 2;

/// What `memory` bytes online for `ms` earn.
fn owed(memory: u64, ms: u64) -> i64 {
    (u128::from(memory) * u128::from(ms) * u128::from(PER_GIB_HOUR) / ((1u128 << 30) * 3_600_000))
        as i64
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dedicated_node_off_probation_is_paid_for_its_online_time_and_a_new_one_is_not(
) -> anyhow::Result<()> {
    test_model();
    let dir = tempfile::tempdir()?;
    // The trusted node's key, made before the coordinator that trusts it.
    let trusted_dir = dir.path().join("trusted");
    let trusted_id = Identity::load_or_create(&trusted_dir)?
        .node_id()
        .to_string();
    let mut config = coordinator_config(&dir.path().join("coord"));
    config.heartbeat_interval_ms = 200;
    config.heartbeat_timeout_ms = HEARTBEAT_TIMEOUT_MS;
    config.ledger.reward_epoch_ms = EPOCH_MS;
    config.ledger.reward_per_gib_hour = PER_GIB_HOUR;
    config.ledger.reward_pool_per_epoch = 1_000_000_000_000;
    config.ledger.sweep_interval_ms = 200;
    config.audit.trusted = vec![trusted_id.clone()];
    let coord = spawn_coordinator(config).await?;
    coord
        .ledger
        .grant("fund-pool", REWARD_POOL, 1_000_000_000_000, "reward pool")
        .await?;

    let started = Instant::now();
    let mut trusted = spawn_node(coord.node_config(&trusted_dir, "trusted")).await?;
    trusted.registered().await?;
    assert_eq!(trusted.id.to_string(), trusted_id);
    let mut operator = coord
        .client_with(Some(&coord.accounts.operator_key))
        .await?;
    // Alone online: the network's memory is the trusted node's.
    let memory = operator
        .network
        .stats(NetworkStatsRequest {})
        .await?
        .into_inner()
        .memory_bytes_online;
    assert!(memory >= 1 << 30, "the node offers {memory} bytes");
    // Rewards pay only for capacity a node has shown (a model it served
    // verified work for): the trusted node serves one job, alone online.
    let served = coord
        .client()
        .await?
        .run_job(chat_job("What is the capital of France?", 4))
        .await?;
    assert_eq!(state(&served.job), JobState::Completed, "{:?}", served.job);
    let mut new = spawn_node(coord.node_config(&dir.path().join("new"), "new")).await?;
    new.registered().await?;
    let new_id = new.id.to_string();

    // Both earn into the test's operator account; wait for its rewards.
    let rewards = within("rewards for ended epochs", async {
        loop {
            let entries = operator
                .accounts
                .history(HistoryRequest { limit: 200 })
                .await?
                .into_inner()
                .entries;
            let rewards: Vec<LedgerEntry> =
                entries.into_iter().filter(|e| e.memo == "reward").collect();
            if rewards.len() >= EPOCHS {
                return anyhow::Ok(rewards);
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    })
    .await??;
    let online_at_most = started.elapsed().as_millis() as u64 + HEARTBEAT_TIMEOUT_MS;

    let mut epochs = Vec::new();
    for r in &rewards {
        assert_eq!(
            r.node_id, trusted_id,
            "only the trusted node is paid: {r:?}"
        );
        assert_eq!(r.counterparty, REWARD_POOL, "{r:?}");
        assert!(r.amount_micro_mlx > 0, "{r:?}");
        // An epoch pays at most its length plus one heartbeat interval
        // (capped at the timeout) that began before it.
        assert!(
            r.amount_micro_mlx <= owed(memory, EPOCH_MS as u64 + HEARTBEAT_TIMEOUT_MS),
            "{r:?} is more than {memory} bytes earn in one epoch"
        );
        let epoch = r
            .transfer_id
            .strip_prefix("reward:")
            .and_then(|t| t.split(':').next())
            .unwrap_or_else(|| panic!("a reward's id names its epoch: {r:?}"))
            .to_owned();
        epochs.push(epoch);
    }
    let paid: i64 = rewards.iter().map(|r| r.amount_micro_mlx).sum();
    assert!(
        paid <= owed(memory, online_at_most),
        "{paid} paid is more than {memory} bytes online for {online_at_most} ms earn"
    );
    let mut distinct = epochs.clone();
    distinct.sort();
    distinct.dedup();
    assert_eq!(
        distinct.len(),
        epochs.len(),
        "an epoch paid twice: {epochs:?}"
    );

    // The operator's earnings: the rewards, all the trusted node's; the new
    // node, on probation, earned nothing.
    let earnings = operator
        .accounts
        .earnings(EarningsRequest {})
        .await?
        .into_inner();
    let of = |node: &str| {
        earnings
            .nodes
            .iter()
            .find(|n| n.node_id == node)
            .and_then(|n| n.all_time)
            .map_or(0, |p| p.micro_mlx)
    };
    assert!(of(&trusted_id) >= paid, "{earnings:?}");
    assert_eq!(of(&new_id), 0, "a node on probation earned a reward");
    let new_rewards = operator
        .accounts
        .history(HistoryRequest { limit: 200 })
        .await?
        .into_inner()
        .entries
        .into_iter()
        .filter(|e| e.node_id == new_id)
        .count();
    assert_eq!(new_rewards, 0, "a node on probation was paid");

    new.stop().await?;
    trusted.stop().await?;
    let broken = coord.ledger.violations(mlxnet_tests::now_ms()).await?;
    assert!(broken.is_empty(), "{broken:?}");
    coord.stop().await?;
    Ok(())
}
