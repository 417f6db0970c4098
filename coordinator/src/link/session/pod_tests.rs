//! Pod membership is confirmed both ways: a leader's report counts only
//! when every member it names reports the same pod, members and its rank.

use std::collections::HashMap;

use mlxnet_proto::ids::NodeId;

use super::{pod_confirmed, PodMembership};
use crate::test_utils::node_key;

fn id(seed: u64) -> NodeId {
    NodeId::from_key(&node_key(seed).verifying_key())
}

fn report(name: &str, rank: u32, members: &[NodeId]) -> PodMembership {
    PodMembership {
        name: name.into(),
        rank,
        members: members.to_vec(),
        link_latency_s: 0.0,
        link_bandwidth: 0.0,
    }
}

#[test]
fn a_fake_leader_cannot_claim_an_honest_pods_members() {
    let (leader, a, b, fake) = (id(1), id(2), id(3), id(4));
    let honest = [leader, a, b];
    let mut reports: HashMap<NodeId, PodMembership> = HashMap::new();
    for (rank, m) in honest.iter().enumerate() {
        reports.insert(*m, report("pod", rank as u32, &honest));
    }
    let claimed = report("pod", 0, &[fake, a, b]);
    reports.insert(fake, claimed.clone());
    let lookup = |n: &NodeId| reports.get(n);
    assert!(pod_confirmed(&leader, &reports[&leader], lookup));
    assert!(
        !pod_confirmed(&fake, &claimed, lookup),
        "a leader whose members name another leader was confirmed"
    );
    // A member missing, at another rank, or in another pod: not confirmed.
    let without_b = |n: &NodeId| reports.get(n).filter(|_| *n != b);
    assert!(!pod_confirmed(&leader, &reports[&leader], without_b));
    let swapped = report("pod", 0, &[leader, b, a]);
    assert!(!pod_confirmed(&leader, &swapped, lookup));
    let other_name = report("other", 0, &honest);
    assert!(!pod_confirmed(&leader, &other_name, lookup));
    // Not rank 0 or not first in its own list: not a leader.
    assert!(!pod_confirmed(&a, &reports[&a], lookup));
}
