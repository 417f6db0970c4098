//! What the World keeps of nodes that lie or leave: a pod reference is
//! clipped (id length, member count, member ids well formed) whatever the
//! caller passes, and an identity offline for longer than the stale TTL
//! with no verified work is forgotten, while one that did work stays.

use std::time::{Duration, Instant};

use super::*;

fn id(i: u32) -> String {
    format!("{i:064x}")
}

fn mac(i: u32) -> NodeView {
    NodeView::new(id(i), &format!("mac-{i}"), "Apple M2", 16 << 30).at("Lyon", 45.76, 4.83)
}

#[test]
fn a_pod_reference_is_clipped_before_it_is_stored() {
    let w = World::new();
    let mut v = mac(1);
    v.pod = Some(PodRef {
        pod_id: "x".repeat(10_000),
        members: (0..5_000)
            .map(id)
            .chain(["not a node id".repeat(1_000)])
            .collect(),
    });
    w.upsert_node(v).unwrap();
    let pod = w.node(&id(1)).unwrap().pod.unwrap();
    assert!(pod.pod_id.chars().count() <= model::MAX_TEXT_CHARS);
    assert_eq!(pod.members.len(), MAX_POD_MEMBERS);
    assert!(pod.members.iter().all(|m| check_id(m).is_ok()));
}

#[test]
fn an_identity_offline_past_the_ttl_with_no_verified_work_is_forgotten() {
    let ttl = Duration::from_secs(3600);
    let w = World::with_stale_ttl(ttl);
    for i in 1..=3 {
        w.upsert_node(mac(i)).unwrap();
    }
    w.record_job(&id(2), 10).unwrap();
    w.set_status(&id(1), Status::Offline).unwrap();
    w.set_status(&id(2), Status::Offline).unwrap();
    let mut changes = w.subscribe();
    let now = Instant::now();
    assert_eq!(w.forget_stale(now + ttl / 2), 0, "forgotten before its TTL");
    assert_eq!(w.len(), 3);
    assert_eq!(w.forget_stale(now + ttl * 2), 1);
    assert!(w.node(&id(1)).is_none(), "the idle identity stayed");
    assert!(
        w.node(&id(2)).is_some(),
        "a node with verified work was dropped"
    );
    assert!(w.node(&id(3)).is_some(), "an online node was dropped");
    assert_eq!(changes.try_recv().unwrap(), Change::Gone(id(1)));
    // Back online before the sweep: its clock starts again.
    w.set_status(&id(2), Status::Idle).unwrap();
    w.set_status(&id(2), Status::Offline).unwrap();
    assert_eq!(w.totals().macs_known, 2);
}
