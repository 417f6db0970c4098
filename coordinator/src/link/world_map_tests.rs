//! What a Sybil's Hello leaves in the World map, against a real coordinator
//! on the real wire: an identity that registered, did no verified work and
//! left is dropped once offline for longer than `world_stale_ttl_ms`; a
//! Hello's pod is clipped before the map keeps it.

use std::time::Duration;

use mlxnet_proto::v1::PodInfo;

use crate::test_utils::{http_get, spawn_app, FakeNode, TestApp};

/// The World's totals, from its HTTP API.
async fn totals(app: &TestApp) -> serde_json::Value {
    let raw = http_get(app.http_addr, "/api/world/totals").await;
    let body = raw.split_once("\r\n\r\n").map_or("", |(_, b)| b);
    serde_json::from_str(body).unwrap_or_else(|e| panic!("{e}: {raw}"))
}

/// Polls the World's totals until `cond` holds (bounded: a test that waits
/// forever is a failure).
async fn until_totals(app: &TestApp, what: &str, cond: impl Fn(&serde_json::Value) -> bool) {
    let wait = async {
        loop {
            if cond(&totals(app).await) {
                return;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    };
    if tokio::time::timeout(Duration::from_secs(10), wait)
        .await
        .is_err()
    {
        panic!("{what}: {}", totals(app).await);
    }
}

#[tokio::test]
async fn an_identity_that_left_without_verified_work_drops_out_of_the_world_map() {
    let app = spawn_app(|c| c.world_stale_ttl_ms = 0).await;
    let sybil = FakeNode::register(&app, 1).await;
    sybil.conn.close(0u32.into(), b"gone");
    until_totals(&app, "the node never showed offline", |t| {
        t["macs_online"] == 0 && t["macs_known"] == 1
    })
    .await;
    // The next registration sweeps the map: the identity that left with no
    // verified work is forgotten, the new one is there.
    let _honest = FakeNode::register(&app, 2).await;
    let t = totals(&app).await;
    assert_eq!(
        (t["macs_known"].as_u64(), t["macs_online"].as_u64()),
        (Some(1), Some(1)),
        "the stale identity is still in the World map: {t}"
    );
    app.stop().await;
}

#[tokio::test]
async fn a_stopped_node_stays_on_the_map_as_offline_by_default() {
    let app = spawn_app(|_| {}).await;
    let node = FakeNode::register(&app, 1).await;
    node.conn.close(0u32.into(), b"stopped");
    until_totals(&app, "the node never showed offline", |t| {
        t["macs_online"] == 0 && t["macs_known"] == 1
    })
    .await;
    let _other = FakeNode::register(&app, 2).await;
    let t = totals(&app).await;
    assert_eq!(t["macs_known"], 2, "{t}");
    app.stop().await;
}

#[tokio::test]
async fn a_hellos_pod_is_clipped_before_the_world_map_keeps_it() {
    let app = spawn_app(|_| {}).await;
    let _node = FakeNode::register_with(&app, 1, |h| {
        h.pod = Some(PodInfo {
            name: "p".repeat(100_000),
            rank: 0,
            members: (0..10_000u32)
                .map(|i| {
                    let mut m = vec![0u8; 32];
                    m[..4].copy_from_slice(&i.to_be_bytes());
                    m
                })
                .chain(std::iter::once(vec![7u8; 100_000]))
                .collect(),
            ..Default::default()
        });
        h.location = Some(mlxnet_proto::v1::Location {
            label: "Lyon".into(),
            latitude: 45.76,
            longitude: 4.83,
            hidden: false,
        });
    })
    .await;
    let id = crate::test_utils::node_hex(1);
    let raw = http_get(app.http_addr, &format!("/api/world/nodes/{id}")).await;
    let body = raw.split_once("\r\n\r\n").map_or("", |(_, b)| b);
    let card: serde_json::Value = serde_json::from_str(body).unwrap_or_else(|e| panic!("{e}"));
    let pod = &card["pod"];
    let name = pod["pod_id"].as_str().unwrap_or_default();
    assert!(name.len() <= 64, "the pod id kept is {} bytes", name.len());
    let listed = pod["members"].as_array().map_or(0, Vec::len) as u64
        + pod["hidden_members"].as_u64().unwrap_or(0);
    assert!(
        listed <= u64::from(crate::world::MAX_POD_MEMBERS as u32),
        "the pod kept {listed} members"
    );
    app.stop().await;
}
