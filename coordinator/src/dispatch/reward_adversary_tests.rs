//! The adversary suite, rewards part (hole 6): a real coordinator, nodes
//! made by hand on the real QUIC wire, availability rewards paid from a
//! funded pool. Every node here is established (the operator trusts it), so
//! probation is not what stops the liars: a dedicated node earns only for
//! capacity it has shown (models it holds and served verified work for),
//! never above its chip table's memory, and nothing while draining.
//!
//! Each step waits on an event (the job's end, a heartbeat's ack); the
//! rewards are paid explicitly at a time past their epoch, so no verdict
//! depends on how fast this machine is.

use mlxnet_proto::{
    claim,
    frame::write_frame,
    v1::{
        job_event, job_update, jobs_client::JobsClient, node_control, Drain, Heartbeat, Hello,
        JobUpdate, NodeControl, WatchJobRequest,
    },
};

use crate::{
    audit::AuditConfig,
    ledger::REWARD_POOL,
    test_utils::{books_once, node_hex, prompt_job, spawn_app, tokens_of, FakeNode, TestApp},
    util::now_ms,
};

/// The honest dedicated node, and the two liars (all trusted).
const HONEST: u64 = 91;
const DRAINER: u64 = 92;
const HOARDER: u64 = 93;

/// A coordinator with audits off, trusting every node here, paying
/// rewards per millisecond online (epochs of 1 s), from a pool of 1,000 MLX.
async fn app() -> TestApp {
    let trusted = [HONEST, DRAINER, HOARDER]
        .iter()
        .map(|&s| node_hex(s))
        .collect();
    let app = spawn_app(|c| {
        c.audit = AuditConfig {
            trusted,
            ..AuditConfig::off()
        };
        c.ledger.reward_epoch_ms = 1_000;
        c.ledger.reward_per_gib_hour = 3_600_000_000;
        c.ledger.reward_pool_per_epoch = 1_000_000_000;
        c.ledger.sweep_interval_ms = 3_600_000;
        c.heartbeat_interval_ms = 600_000;
        c.heartbeat_timeout_ms = 1_200_000;
    })
    .await;
    app.ledger
        .grant("pool", REWARD_POOL, 1_000_000_000, "fund")
        .await
        .unwrap();
    app
}

/// A dedicated node's Hello on `chip` with `memory` bytes.
fn dedicated(chip: &'static str, memory: u64) -> impl FnOnce(&mut Hello) {
    move |h: &mut Hello| {
        h.mode = "dedicated".into();
        if let Some(hw) = h.hardware.as_mut() {
            hw.chip = chip.into();
            hw.memory_bytes = memory;
        }
    }
}

fn hex_of(node: &FakeNode) -> String {
    hex::encode(node.key.verifying_key().to_bytes())
}

async fn balance(app: &TestApp, account: &str) -> i64 {
    app.ledger
        .account(account)
        .await
        .unwrap()
        .map_or(0, |a| a.balance())
}

/// `node` serves one job honestly (streams its tokens, signs its claim);
/// returns once the job completed.
async fn serve_a_job(app: &TestApp, node: &FakeNode) {
    let mut jobs = JobsClient::new(app.grpc().await);
    let job = jobs
        .submit(prompt_job("The capital of France is", 8))
        .await
        .unwrap()
        .into_inner()
        .id;
    let mut watch = jobs
        .watch(WatchJobRequest {
            job_id: job.clone(),
        })
        .await
        .unwrap()
        .into_inner();
    let (mut send, _recv, a) = node.next_assignment().await;
    assert_eq!(a.job_id, job);
    let signed = claim::sign(node.claim(&a, vec![7, 8], " Paris"), &node.key);
    let c = signed.claim.clone().unwrap();
    write_frame(&mut send, &tokens_of(0, &c)).await.unwrap();
    let result = JobUpdate {
        msg: Some(job_update::Msg::Result(signed)),
    };
    write_frame(&mut send, &result).await.unwrap();
    while let Some(e) = watch.message().await.unwrap() {
        if let Some(job_event::Event::Failed(f)) = e.event {
            panic!("the job failed: {}", f.reason);
        }
    }
}

/// Two heartbeats, both acknowledged (the control loop reads one frame at
/// a time, so the second is read only after the first one's writes).
async fn beat(node: &mut FakeNode) {
    let beat = NodeControl {
        msg: Some(node_control::Msg::Heartbeat(Heartbeat {
            free_memory_bytes: 8 << 30,
            ..Default::default()
        })),
    };
    node.control(&beat).await;
    node.control(&beat).await;
    node.control_reply().await;
    node.control_reply().await;
}

/// Hole 6: two established dedicated nodes report `i64::MAX` bytes of
/// memory; one drains at once and only heartbeats, the other heartbeats
/// and never serves. Neither earns any reward; the honest dedicated node
/// beside them, which served a job, earns its reward (not scaled down by
/// the liars' claims) and its job's pay, and the pool pays nobody else.
#[tokio::test]
async fn a_dedicated_node_lying_about_its_memory_takes_no_reward_pool() {
    let app = app().await;
    let mut honest =
        FakeNode::register_with(&app, HONEST, dedicated("Apple M2 Max", 64 << 30)).await;
    let honest_op = app.ledger.link_node(&hex_of(&honest), "").await.unwrap();
    serve_a_job(&app, &honest).await;
    let paid = books_once(&app.ledger, &app.client_account, &honest_op, |b| {
        b.operator.balance() > 0
    })
    .await;
    assert!(paid.operator.balance() > 0, "the honest node was paid");

    let huge = i64::MAX as u64;
    let mut drainer = FakeNode::register_with(&app, DRAINER, dedicated("Apple M1", huge)).await;
    let mut hoarder =
        FakeNode::register_with(&app, HOARDER, dedicated("Apple M5 Ultra", huge)).await;
    let drainer_op = app.ledger.link_node(&hex_of(&drainer), "").await.unwrap();
    let hoarder_op = app.ledger.link_node(&hex_of(&hoarder), "").await.unwrap();
    drainer
        .control(&NodeControl {
            msg: Some(node_control::Msg::Drain(Drain {
                reason: "owner is back".into(),
            })),
        })
        .await;
    // Some online time to be paid for (the reward counts milliseconds).
    tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    for node in [&mut honest, &mut drainer, &mut hoarder] {
        beat(node).await;
    }

    let before = [
        balance(&app, &honest_op).await,
        balance(&app, &drainer_op).await,
        balance(&app, &hoarder_op).await,
        balance(&app, REWARD_POOL).await,
    ];
    assert!(app.ledger.pay_rewards(now_ms() + 10_000).await.unwrap() > 0);
    let after = [
        balance(&app, &honest_op).await,
        balance(&app, &drainer_op).await,
        balance(&app, &hoarder_op).await,
        balance(&app, REWARD_POOL).await,
    ];
    assert_eq!(after[1] - before[1], 0, "the draining node earned a reward");
    assert_eq!(
        after[2] - before[2],
        0,
        "the node that never served earned a reward for its reported memory"
    );
    let earned = after[0] - before[0];
    assert!(earned > 0, "the honest node earned no reward");
    assert_eq!(
        before[3] - after[3],
        earned,
        "the pool paid someone besides the honest node"
    );
    let broken = app.ledger.violations(now_ms()).await.unwrap();
    assert!(broken.is_empty(), "{broken:?}");
    app.stop().await;
}

/// Hole 10 (reported figures): two nodes each reporting `u64::MAX` bytes of
/// memory. The network's totals (the client API's stats, the World page's
/// totals) saturate instead of overflowing (a panic in a debug build, a
/// wrapped total in release), and an honest node is still placed and paid.
#[tokio::test]
async fn nodes_reporting_u64_max_memory_break_no_total() {
    let app = spawn_app(|_| {}).await;
    let huge = |h: &mut Hello| {
        if let Some(hw) = h.hardware.as_mut() {
            hw.memory_bytes = u64::MAX;
            hw.free_memory_bytes = u64::MAX;
        }
    };
    let mut a = FakeNode::register_with(&app, DRAINER, huge).await;
    let mut b = FakeNode::register_with(&app, HOARDER, huge).await;
    let mut network = mlxnet_proto::v1::network_client::NetworkClient::new(app.grpc().await);
    let stats = network
        .stats(mlxnet_proto::v1::NetworkStatsRequest {})
        .await
        .expect("the network's stats")
        .into_inner();
    assert_eq!(stats.memory_bytes_online, u64::MAX);
    let totals = crate::test_utils::http_get(app.http_addr, "/api/world/totals").await;
    assert!(totals.starts_with("HTTP/1.1 200"), "{totals}");
    // They drain (an acknowledged heartbeat after the drain: the control
    // loop read it), so the next job is the honest node's.
    for node in [&mut a, &mut b] {
        node.control(&NodeControl {
            msg: Some(node_control::Msg::Drain(Drain {
                reason: "leaving".into(),
            })),
        })
        .await;
        node.control(&NodeControl {
            msg: Some(node_control::Msg::Heartbeat(Heartbeat::default())),
        })
        .await;
        node.control_reply().await;
    }

    // An honest node is still placed and paid.
    let honest = FakeNode::register(&app, HONEST).await;
    let operator = app.ledger.link_node(&hex_of(&honest), "").await.unwrap();
    serve_a_job(&app, &honest).await;
    let paid = books_once(&app.ledger, &app.client_account, &operator, |b| {
        b.operator.balance() > 0
    })
    .await;
    assert!(paid.operator.balance() > 0, "the honest node was paid");
    let broken = app.ledger.violations(now_ms()).await.unwrap();
    assert!(broken.is_empty(), "{broken:?}");
    app.stop().await;
}
