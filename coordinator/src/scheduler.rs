//! Placement: which node or pod runs each queued job, by memory, bandwidth
//! and locality, and why.
//!
//! A pure module: decisions read an in-memory [`Fleet`] and [`Queue`] and do
//! no I/O, so they are property-tested and benchmarked without a network or a
//! database. The dispatcher builds the fleet from its live sessions, runs a
//! pass, then records each placement in the store.
//!
//! # Layout
//! - [`affinity`]: which nodes last ran a prefix of a job's input (chat
//!   turns, prompt chunks), kept honest by the nodes' prefix-cache reports.
//! - [`capability`]: what a node or pod can do; measured figures win over
//!   the chip table ([`mlxnet_proto::chips`]), and what a node has shown
//!   ([`Evidence`]: decayed reliability, observed speed) caps them.
//! - [`cost`]: memory needed and estimated completion of a job on a target.
//! - [`fleet`]: the indexed fleet and the decision rule (feasibility, cached
//!   first, dedicated before idle-time for long jobs, lowest completion with
//!   best-fit on memory, pods gang-scheduled).
//! - [`queue`]: priorities, fair share across accounts, bounded size.
//!
//! # Invariants
//! - A job is placed only where [`Fleet::commit`] accepted it, so memory is
//!   never overcommitted on any node or pod member.
//! - Within one pass, once a job of a model could not be placed, no later job
//!   of that model needing at least as much memory is tried: the fleet only
//!   loses capacity during a pass, so it could not be placed either.

pub mod affinity;
pub mod capability;
pub mod cost;
pub mod fleet;
pub mod queue;

#[cfg(test)]
mod tests;

use std::collections::HashMap;

use mlxnet_proto::ids::NodeId;

pub use affinity::{Affinity, Prefix, Report};
pub use capability::{memory_cap, Capability, Evidence, Measured, Mode, NodeSpec, PodSpec};
pub use cost::{BatchCurve, Estimate, JobShape, ModelShape};
pub use fleet::{Decision, Fleet, FleetError, Placement, Policy, Target};
pub use queue::{Offer, Queue, QueueError};

/// Runs one placement pass of `queue` against `fleet`, committing each
/// placement to the fleet. `shape` gives a job's shape (None: the job cannot
/// be placed by this fleet, e.g. its model left the catalogue). Returns the
/// placed jobs with their placements, in placement order.
pub fn schedule<'m, T>(
    queue: &mut Queue<T>,
    fleet: &mut Fleet,
    mut shape: impl FnMut(&T) -> Option<JobShape<'m>>,
) -> Vec<(T, Placement)> {
    schedule_with(queue, fleet, |job| shape(job).map(|s| (s, Vec::new())))
}

/// [`schedule`], with each job's shape and the nodes that last ran a
/// prefix of its input (see [`Fleet::decide_with`]).
pub fn schedule_with<'m, T>(
    queue: &mut Queue<T>,
    fleet: &mut Fleet,
    mut shape: impl FnMut(&T) -> Option<(JobShape<'m>, Vec<(NodeId, u64)>)>,
) -> Vec<(T, Placement)> {
    let mut placements = Vec::new();
    let mut blocked: HashMap<[u8; 32], u64> = HashMap::new();
    let jobs = queue.pass(|job| {
        let Some((s, affinity)) = shape(job) else {
            return Offer::Blocked;
        };
        let need = s.memory_needed();
        if blocked.get(&s.model.sha256).is_some_and(|&b| need >= b) {
            return Offer::Blocked;
        }
        match fleet.decide_with(&s, &affinity) {
            Decision::Place(p) if fleet.commit(&p).is_ok() => {
                placements.push(p);
                Offer::Placed
            }
            _ => {
                let b = blocked.entry(s.model.sha256).or_insert(u64::MAX);
                *b = (*b).min(need);
                Offer::Blocked
            }
        }
    });
    jobs.into_iter().zip(placements).collect()
}
