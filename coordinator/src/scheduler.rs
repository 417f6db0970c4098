//! Placement: which online node runs a job. First fit by free memory for now
//! (the placement issue replaces it with estimated completion time).
//!
//! A pure function over a snapshot of the nodes, so it is tested without any
//! network or database.
//!
//! # Invariants
//! - A node is chosen only if it holds the job's model file (by digest), has a
//!   free job slot, and has at least the job's memory need free.
//! - Candidates are tried in the snapshot's order (oldest session first), so
//!   placement is deterministic for a given snapshot.

use mlxnet_proto::ids::NodeId;

/// A node as the scheduler sees it at one moment.
#[derive(Clone, Debug, PartialEq)]
pub struct NodeSnapshot {
    pub id: NodeId,
    /// Reported free memory minus what jobs placed since then reserve.
    pub free_memory_bytes: u64,
    pub running_jobs: u32,
    pub max_concurrent_jobs: u32,
    /// SHA-256 digests of the model files it holds.
    pub models: Vec<[u8; 32]>,
}

/// What one job needs from a node.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Demand {
    pub model_sha256: [u8; 32],
    pub memory_bytes: u64,
}

/// Whether `node` could take the job now.
pub fn fits(node: &NodeSnapshot, demand: &Demand) -> bool {
    node.running_jobs < node.max_concurrent_jobs
        && node.free_memory_bytes >= demand.memory_bytes
        && node.models.contains(&demand.model_sha256)
}

/// The first node that fits, if any.
pub fn place(nodes: &[NodeSnapshot], demand: &Demand) -> Option<NodeId> {
    nodes.iter().find(|n| fits(n, demand)).map(|n| n.id)
}

#[cfg(test)]
mod tests {
    use super::*;
    use ed25519_dalek::SigningKey;
    use rand::{rngs::StdRng, SeedableRng};

    fn node(seed: u64, free: u64, running: u32, models: &[[u8; 32]]) -> NodeSnapshot {
        let key = SigningKey::generate(&mut StdRng::seed_from_u64(seed));
        NodeSnapshot {
            id: NodeId::from_key(&key.verifying_key()),
            free_memory_bytes: free,
            running_jobs: running,
            max_concurrent_jobs: 1,
            models: models.to_vec(),
        }
    }

    const M: [u8; 32] = [1; 32];
    const OTHER: [u8; 32] = [2; 32];

    #[test]
    fn picks_the_first_node_that_holds_the_model_has_memory_and_a_free_slot() {
        let demand = Demand {
            model_sha256: M,
            memory_bytes: 1000,
        };
        let no_model = node(1, 1 << 30, 0, &[OTHER]);
        let too_small = node(2, 999, 0, &[M]);
        let busy = node(3, 1 << 30, 1, &[M]);
        let good = node(4, 1000, 0, &[OTHER, M]);
        let also_good = node(5, 1 << 30, 0, &[M]);
        let nodes = vec![no_model, too_small, busy, good.clone(), also_good];
        assert_eq!(place(&nodes, &demand), Some(good.id));
        assert_eq!(place(&nodes[..3], &demand), None);
        assert_eq!(place(&[], &demand), None);
    }

    #[test]
    fn a_chosen_node_always_fits_for_many_random_snapshots() {
        let mut rng = StdRng::seed_from_u64(42);
        for round in 0..500u64 {
            use rand::Rng;
            let nodes: Vec<_> = (0..rng.gen_range(0..6))
                .map(|i| {
                    let models: &[[u8; 32]] = if rng.gen_bool(0.5) { &[M] } else { &[OTHER] };
                    let mut n = node(
                        round * 10 + i,
                        rng.gen_range(0..2000),
                        rng.gen_range(0..3),
                        models,
                    );
                    n.max_concurrent_jobs = rng.gen_range(0..3);
                    n
                })
                .collect();
            let demand = Demand {
                model_sha256: M,
                memory_bytes: rng.gen_range(0..2000),
            };
            match place(&nodes, &demand) {
                Some(id) => {
                    let first = nodes.iter().position(|n| fits(n, &demand)).unwrap();
                    assert_eq!(nodes[first].id, id, "first fit");
                }
                None => assert!(nodes.iter().all(|n| !fits(n, &demand))),
            }
        }
    }
}
