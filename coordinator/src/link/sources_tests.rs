//! Per-source budgets against real QUIC clients on 127.0.0.1, with loopback
//! not exempt: a Sybil making new keys from one address is refused past the
//! cap (with a reason saying so) while its known keys still connect; a
//! source past its handshake rate is closed before the handshake; by
//! default loopback is exempt, so tests and the load simulator are not.

use mlxnet_proto::v1::{coordinator_control, network_client::NetworkClient, NetworkStatsRequest};

use crate::{
    config::CoordinatorConfig,
    link::{sources::SourceLimitsConfig, CLOSE_RATE_LIMITED},
    test_utils::{client_config, http_get, node_key, spawn_app, Dialer, FakeNode, TestApp},
};

async fn nodes_online(app: &TestApp) -> u32 {
    let mut client = NetworkClient::new(app.grpc().await);
    client
        .stats(NetworkStatsRequest {})
        .await
        .unwrap()
        .into_inner()
        .nodes_online
}

fn strict(max_handshakes: u32, max_new_identities: u32) -> impl FnOnce(&mut CoordinatorConfig) {
    move |c| {
        c.node_sources = SourceLimitsConfig {
            max_handshakes,
            max_new_identities,
            exempt_loopback: false,
            ..SourceLimitsConfig::default()
        }
    }
}

/// Dials with node key `seed`; the coordinator's reply to its Hello.
async fn hello(app: &TestApp, seed: u64) -> Option<coordinator_control::Msg> {
    let key = node_key(seed);
    let mut d = Dialer::connect(app).await;
    let proof = d.proof(&key);
    d.hello(&key, proof).await
}

#[tokio::test]
async fn a_sybil_making_keys_from_one_address_is_refused_past_the_cap_and_its_known_keys_still_connect(
) {
    let app = spawn_app(strict(0, 3)).await;
    let _first: Vec<FakeNode> = {
        let mut nodes = Vec::new();
        for seed in 1..=3 {
            nodes.push(FakeNode::register(&app, seed).await);
        }
        nodes
    };
    let reply = hello(&app, 4).await;
    let Some(coordinator_control::Msg::Rejected(r)) = reply else {
        panic!("the fourth new key from one address was not refused: {reply:?}");
    };
    assert!(
        r.reason
            .contains("too many new node identities from this address"),
        "{}",
        r.reason
    );
    assert_eq!(nodes_online(&app).await, 3);
    // A key the coordinator knows connects again from the same address
    // (replacing its session), however many new keys were refused.
    assert!(matches!(
        hello(&app, 5).await,
        Some(coordinator_control::Msg::Rejected(_))
    ));
    let again = hello(&app, 2).await;
    assert!(
        matches!(again, Some(coordinator_control::Msg::Welcome(_))),
        "a known key was refused: {again:?}"
    );
    let metrics = http_get(app.http_addr, "/metrics").await;
    assert!(
        metrics.contains("mlxnet_node_identities_refused_total 2\n"),
        "{metrics}"
    );
    app.stop().await;
}

#[tokio::test]
async fn a_source_past_its_handshake_rate_is_closed_before_the_handshake() {
    let app = spawn_app(strict(2, 0)).await;
    let _a = FakeNode::register(&app, 1).await;
    let _b = FakeNode::register(&app, 2).await;
    let mut endpoint = quinn::Endpoint::client("127.0.0.1:0".parse().unwrap()).unwrap();
    endpoint.set_default_client_config(client_config(&app.fingerprint));
    let conn = endpoint
        .connect(app.quic_addr, "localhost")
        .unwrap()
        .await
        .unwrap();
    let closed = conn.closed().await;
    let quinn::ConnectionError::ApplicationClosed(c) = &closed else {
        panic!("the third connection was not closed by the coordinator: {closed:?}");
    };
    assert_eq!(c.error_code, CLOSE_RATE_LIMITED.into());
    let reason = String::from_utf8_lossy(&c.reason);
    assert!(
        reason.contains("too many handshakes from this address"),
        "{reason}"
    );
    let metrics = http_get(app.http_addr, "/metrics").await;
    assert!(
        metrics.contains("mlxnet_node_handshakes_rate_limited_total 1\n"),
        "{metrics}"
    );
    app.stop().await;
}

#[tokio::test]
async fn by_default_loopback_is_exempt_so_many_local_nodes_register() {
    let app = spawn_app(|c| {
        c.node_sources.max_new_identities = 1;
        c.node_sources.max_handshakes = 1;
    })
    .await;
    let mut nodes = Vec::new();
    for seed in 1..=4 {
        nodes.push(FakeNode::register(&app, seed).await);
    }
    assert_eq!(nodes_online(&app).await, 4);
    app.stop().await;
}
