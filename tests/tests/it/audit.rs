//! Audits end to end: a real coordinator and three real nodes running the
//! real model. An honest node's job is audited by the other honest node
//! (both are the coordinator's trusted nodes; the cheater, a new key, is on
//! probation and never audits), passes,
//! and is paid only once its audit window closed; a cheating node's job
//! (its tokens swapped before signing) is audited by both honest nodes
//! (a failing verdict counts only once a second auditor confirms it),
//! fails, its hold is voided (the client refunded, the operator paid
//! nothing) and the cheater is banned from placement.
//!
//! Every step waits on an event (a node registered, an audit's recorded
//! state, the balances). The one clock is the product's own: the audit
//! window. An audit must end inside it, and job 2's auditors are nodes that
//! start after job 2 completed, so the window ([`WINDOW_MS`]) is a wide
//! margin over a node's start-up plus two audits (a few seconds here,
//! under load), not a race with it.

use std::time::Duration;

use mlxnet_coordinator::{
    audit::{AuditConfig, Audits},
    store::{AnyStore, Store},
};
use mlxnet_proto::v1::{BalanceRequest, JobState};
use mlxnet_tests::{
    chat_job, coordinator_config, now_ms, price_of, spawn_coordinator, spawn_node, state,
    test_model, within, Client, CLIENT_GRANT,
};

/// Polls `check` until it holds (bounded by the harness deadline).
async fn eventually<F, Fut>(what: &str, mut check: F) -> anyhow::Result<()>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = anyhow::Result<bool>>,
{
    within(what, async {
        loop {
            if check().await? {
                return Ok::<_, anyhow::Error>(());
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    })
    .await?
}

async fn balance(client: &mut Client) -> anyhow::Result<(i64, i64)> {
    let b = client
        .accounts
        .balance(BalanceRequest {})
        .await?
        .into_inner();
    Ok((b.balance_micro_mlx, b.held_micro_mlx))
}

/// The audit window of this test's coordinator.
const WINDOW_MS: i64 = 30_000;

async fn audit_state(store: &AnyStore, job: &str) -> anyhow::Result<Option<String>> {
    let audits = Audits::of_store(store, AuditConfig::default()).await?;
    Ok(audits.state(job).await?)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cheaters_job_fails_its_audit_and_is_refunded_an_honest_one_is_paid_after_the_window(
) -> anyhow::Result<()> {
    test_model();
    let dir = tempfile::tempdir()?;
    let mut config = coordinator_config(&dir.path().join("coord"));
    // The honest nodes are the operator's trusted ones (established from
    // the start: new keys never audit); their keys are made before the
    // coordinator starts so its config can name them.
    let trusted = ["honest", "second"]
        .iter()
        .map(|name| {
            let id = mlx_node::identity::Identity::load_or_create(&dir.path().join(name))?;
            Ok(id.node_id().to_string())
        })
        .collect::<anyhow::Result<Vec<String>>>()?;
    config.audit = AuditConfig {
        rate_new: 1.0,
        rate_floor: 1.0,
        window_ms: WINDOW_MS,
        ban_after: 1,
        trusted,
        ..AuditConfig::default()
    };
    config.ledger.sweep_interval_ms = 100;
    let coord = spawn_coordinator(config).await?;
    let store = AnyStore::connect(&coord.config.database_url()).await?;
    let mut client = coord.client().await?;
    let mut operator = coord
        .client_with(Some(&coord.accounts.operator_key))
        .await?;
    let honest_config = coord.node_config(&dir.path().join("honest"), "honest");
    let mut honest = spawn_node(honest_config.clone()).await?;
    honest.registered().await?;

    // The honest node serves job 1 alone; its pay is held for the window.
    let one = client
        .run_job(chat_job("What is the capital of France?", 8))
        .await?;
    assert_eq!(state(&one.job), JobState::Completed);
    assert_eq!(one.job.node_id, honest.id.to_string());
    let (_, held) = balance(&mut client).await?;
    assert!(held > 0, "job 1's pay waits for its audit window");
    assert_eq!(balance(&mut operator).await?.0, 0);

    // The second honest node (its own operator account: a node never
    // audits its operator's other nodes) joins and audits job 1 (the
    // cheater, a new key, would never be drawn: it is on probation).
    let mut second_config = coord.node_config(&dir.path().join("second"), "second");
    second_config.operator_account = String::new();
    let mut second = spawn_node(second_config.clone()).await?;
    second.registered().await?;
    let (db, id_one) = (&store, one.job_id.as_str());
    eventually("job 1's audit", move || async move {
        Ok(audit_state(db, id_one).await?.as_deref() == Some("passed"))
    })
    .await?;

    // The cheater joins (its own operator account); with the honest nodes
    // gone, job 2 runs on it.
    let mut cheat_config = coord.node_config(&dir.path().join("cheat"), "cheat");
    cheat_config.operator_account = String::new();
    cheat_config.test_cheat = true;
    let mut cheater = spawn_node(cheat_config).await?;
    cheater.registered().await?;
    honest.stop().await?;
    second.stop().await?;
    let two = client
        .run_job(chat_job("What is the capital of Italy?", 8))
        .await?;
    assert_eq!(state(&two.job), JobState::Completed);
    assert_eq!(two.job.node_id, cheater.id.to_string());

    // The honest node comes back with the second honest node (neither is
    // the cheater's operator's): one audits job 2 and finds it wrong,
    // the other confirms it (a failing verdict counts only when a second
    // auditor confirms it), and it fails.
    let mut honest = spawn_node(honest_config).await?;
    let mut second = spawn_node(second_config).await?;
    honest.registered().await?;
    second.registered().await?;
    let id_two = two.job_id.as_str();
    eventually("job 2's audit", move || async move {
        Ok(audit_state(db, id_two).await?.as_deref() == Some("failed"))
    })
    .await?;

    // Job 1 is paid once its window closed; job 2's hold was voided.
    let (c, model) = client.claim_and_model(&one.job).await?;
    let (price, fee) = price_of(&c, &model);
    let watcher = client.clone();
    eventually("both holds to be resolved", move || {
        let mut c = watcher.clone();
        async move { Ok(balance(&mut c).await?.1 == 0) }
    })
    .await?;
    assert_eq!(
        balance(&mut client).await?.0,
        CLIENT_GRANT - price,
        "the client paid for job 1 only: job 2 was refunded in full"
    );
    assert_eq!(
        balance(&mut operator).await?.0,
        price - fee,
        "the honest operator earned job 1"
    );

    // The cheater is banned: the next job goes to an honest node.
    let three = client.run_job(chat_job("What is 2 + 2?", 4)).await?;
    assert_ne!(three.job.node_id, cheater.id.to_string());
    let honest_ids = [honest.id.to_string(), second.id.to_string()];
    assert!(honest_ids.contains(&three.job.node_id));

    let ledger =
        mlxnet_coordinator::ledger::Ledger::new(store.clone(), coord.config.ledger_config());
    let broken = ledger.violations(now_ms()).await?;
    assert!(broken.is_empty(), "{broken:?}");
    store.close().await;
    cheater.stop().await?;
    honest.stop().await?;
    second.stop().await?;
    Ok(())
}
