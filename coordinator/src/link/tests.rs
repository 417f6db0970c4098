//! The handshake against a real QUIC client on 127.0.0.1: a node's own proof
//! is welcome; a proof signed by another key, or made on another connection,
//! is refused and the node never shows as online.

use ed25519_dalek::SigningKey;
use mlxnet_proto::{
    frame::{read_frame, write_frame},
    v1::{
        coordinator_control, network_client::NetworkClient, node_control, CoordinatorControl,
        Heartbeat, NetworkStatsRequest, NodeControl,
    },
};
use rand::{rngs::StdRng, SeedableRng};

use crate::test_utils::{spawn_app, Dialer, TestApp};

async fn nodes_online(app: &TestApp) -> u32 {
    let mut client = NetworkClient::new(app.grpc().await);
    client
        .stats(NetworkStatsRequest {})
        .await
        .unwrap()
        .into_inner()
        .nodes_online
}

fn keys() -> (SigningKey, SigningKey) {
    let mut rng = StdRng::seed_from_u64(5);
    (
        SigningKey::generate(&mut rng),
        SigningKey::generate(&mut rng),
    )
}

#[tokio::test]
async fn a_node_proving_its_own_key_is_welcomed_and_heartbeats_are_acknowledged() {
    let app = spawn_app(|_| {}).await;
    let (node, _) = keys();
    let mut d = Dialer::connect(&app).await;
    let proof = d.proof(&node);
    let reply = d.hello(&node, proof).await;
    let Some(coordinator_control::Msg::Welcome(w)) = reply else {
        panic!("expected Welcome, got {reply:?}");
    };
    assert_eq!(w.node_id, hex::encode(node.verifying_key().to_bytes()));
    assert!(w.heartbeat_interval_ms > 0);
    assert_eq!(nodes_online(&app).await, 1);

    let hb = NodeControl {
        msg: Some(node_control::Msg::Heartbeat(Heartbeat {
            free_memory_bytes: 1 << 30,
            running_jobs: 0,
            ..Default::default()
        })),
    };
    write_frame(&mut d.send, &hb).await.unwrap();
    let ack: CoordinatorControl = read_frame(&mut d.recv).await.unwrap();
    assert!(
        matches!(ack.msg, Some(coordinator_control::Msg::HeartbeatAck(_))),
        "{ack:?}"
    );

    app.stop().await;
}

#[tokio::test]
async fn a_proof_signed_by_another_key_is_refused() {
    let app = spawn_app(|_| {}).await;
    let (node, thief) = keys();
    let mut d = Dialer::connect(&app).await;
    let forged = d.proof(&thief);
    let reply = d.hello(&node, forged).await;
    let Some(coordinator_control::Msg::Rejected(r)) = reply else {
        panic!("expected Rejected, got {reply:?}");
    };
    assert!(r.reason.contains("proof"), "{}", r.reason);
    // The coordinator closes the connection after refusing.
    let closed = d.conn.closed().await;
    assert!(
        matches!(closed, quinn::ConnectionError::ApplicationClosed(_)),
        "{closed:?}"
    );
    assert_eq!(nodes_online(&app).await, 0);
    app.stop().await;
}

#[tokio::test]
async fn a_proof_replayed_from_another_connection_is_refused() {
    let app = spawn_app(|_| {}).await;
    let (node, _) = keys();
    let first = Dialer::connect(&app).await;
    let proof = first.proof(&node);
    let mut second = Dialer::connect(&app).await;
    let reply = second.hello(&node, proof.clone()).await;
    assert!(
        matches!(reply, Some(coordinator_control::Msg::Rejected(_))),
        "{reply:?}"
    );
    assert_eq!(nodes_online(&app).await, 0);

    // The same proof is good on the connection it was made for.
    let mut first = first;
    let reply = first.hello(&node, proof).await;
    assert!(
        matches!(reply, Some(coordinator_control::Msg::Welcome(_))),
        "{reply:?}"
    );
    assert_eq!(nodes_online(&app).await, 1);
    app.stop().await;
}

#[tokio::test]
async fn a_silent_node_goes_offline_and_a_reconnect_replaces_the_old_session() {
    let app = spawn_app(|c| {
        c.heartbeat_interval_ms = 100;
        c.heartbeat_timeout_ms = 300;
    })
    .await;
    let (node, _) = keys();
    let mut old = Dialer::connect(&app).await;
    let proof = old.proof(&node);
    assert!(matches!(
        old.hello(&node, proof).await,
        Some(coordinator_control::Msg::Welcome(_))
    ));

    let mut new = Dialer::connect(&app).await;
    let proof = new.proof(&node);
    assert!(matches!(
        new.hello(&node, proof).await,
        Some(coordinator_control::Msg::Welcome(_))
    ));
    // The old session is closed by the coordinator; the new one stays.
    let closed = old.conn.closed().await;
    assert!(
        matches!(closed, quinn::ConnectionError::ApplicationClosed(_)),
        "{closed:?}"
    );
    assert_eq!(nodes_online(&app).await, 1);

    // Silence past the heartbeat timeout: the coordinator closes the link.
    let closed = new.conn.closed().await;
    assert!(
        matches!(closed, quinn::ConnectionError::ApplicationClosed(ref c) if c.reason.as_ref() == b"heartbeat timeout"),
        "{closed:?}"
    );
    app.stop().await;
}

/// The outlook's demand: jobs per 1,000 slots, capped at all of them, and
/// no slots (no node online) is no demand figure's division by zero.
#[test]
fn demand_is_jobs_per_thousand_slots_capped_at_every_slot() {
    assert_eq!(super::demand_permille(0, 0), 0);
    assert_eq!(super::demand_permille(5, 10), 500);
    assert_eq!(super::demand_permille(1, 3), 333);
    assert_eq!(super::demand_permille(30, 10), 1000);
    assert_eq!(super::demand_permille(u64::MAX, 1), 1000);
    assert_eq!(super::demand_permille(3, 0), 1000);
}
