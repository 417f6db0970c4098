//! Readiness and the drain of a requested stop (SIGTERM), against a real
//! coordinator and hand-made nodes.

use std::time::Duration;

use mlxnet_proto::v1::coordinator_control;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use crate::{
    domain::liveness_lease,
    store::Store,
    test_utils::{http_get, spawn_app, FakeNode},
};

/// A guard against a hang, never a verdict on speed.
const DEADLINE: Duration = Duration::from_secs(120);

/// A drain tells each node to move (with half the drain timeout as the
/// grace of its running jobs), answers 503 on `/readyz` meanwhile, and
/// waits for its nodes to leave before it stops.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_draining_replica_tells_its_nodes_to_move_is_not_ready_and_waits_for_them() {
    let app = spawn_app(|c| {
        c.drain_timeout_ms = 600_000;
        c.heartbeat_timeout_ms = 600_000;
    })
    .await;
    let http = app.http_addr;
    let mut node = FakeNode::register(&app, 1).await;
    let ready = http_get(http, "/readyz").await;
    assert!(ready.starts_with("HTTP/1.1 200"), "{ready}");

    let stopping = tokio::spawn(app.stop());
    let hint = tokio::time::timeout(DEADLINE, async {
        loop {
            if let Some(coordinator_control::Msg::Reconnect(r)) = node.control_reply().await.msg {
                return r;
            }
        }
    })
    .await
    .expect("a reconnect hint");
    assert_eq!(hint.grace_ms, 300_000);
    let draining = http_get(http, "/readyz").await;
    assert!(draining.starts_with("HTTP/1.1 503"), "{draining}");
    assert!(draining.ends_with("draining\n"), "{draining}");
    // The node has not left: the replica is still draining, not stopped.
    assert!(!stopping.is_finished());
    node.conn.close(0u32.into(), b"moved");
    tokio::time::timeout(DEADLINE, stopping)
        .await
        .expect("the replica stops once its node left")
        .unwrap();
}

/// A replica that does not hold its liveness lease (it lapsed, or another
/// replica's sweep counted it dead) is not ready.
#[tokio::test]
async fn readyz_answers_503_while_the_replica_does_not_hold_its_liveness_lease() {
    let app = spawn_app(|c| c.replica_id = Some("replica-r".into())).await;
    let ready = http_get(app.http_addr, "/readyz").await;
    assert!(ready.starts_with("HTTP/1.1 200"), "{ready}");
    let store = app.ledger.store();
    let lease = store
        .lease(&liveness_lease("replica-r"))
        .await
        .unwrap()
        .expect("taken at start-up");
    assert!(store.release_lease(&lease).await.unwrap());
    let lapsed = http_get(app.http_addr, "/readyz").await;
    assert!(lapsed.starts_with("HTTP/1.1 503"), "{lapsed}");
    assert!(lapsed.ends_with("liveness lease\n"), "{lapsed}");
    app.stop().await;
}

/// Open World streams take the HTTP in-flight slots; readiness does not
/// share them (issue 16: a busy World page made `/readyz` answer 429 and a
/// load balancer take a healthy replica out).
#[tokio::test]
async fn open_world_streams_do_not_make_readyz_answer_429() {
    let app = spawn_app(|c| c.limits.max_http_in_flight = 1).await;
    let mut stream = tokio::net::TcpStream::connect(app.http_addr).await.unwrap();
    stream
        .write_all(b"GET /api/world/events HTTP/1.1\r\nhost: x\r\n\r\n")
        .await
        .unwrap();
    let mut head = Vec::new();
    while !head.windows(4).any(|w| w == b"\r\n\r\n") {
        let mut buf = [0u8; 512];
        let n = tokio::time::timeout(DEADLINE, stream.read(&mut buf))
            .await
            .unwrap()
            .unwrap();
        assert!(n > 0, "the stream closed");
        head.extend_from_slice(&buf[..n]);
    }
    assert!(head.starts_with(b"HTTP/1.1 200"), "{head:?}");
    // The one slot is the stream's: other requests are refused...
    let other = http_get(app.http_addr, "/metrics").await;
    assert!(other.starts_with("HTTP/1.1 429"), "{other}");
    // ...but not readiness.
    let ready = http_get(app.http_addr, "/readyz").await;
    assert!(ready.starts_with("HTTP/1.1 200"), "{ready}");
    drop(stream);
    app.stop().await;
}
