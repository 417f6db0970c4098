//! mlx-network's deterministic simulator (VOPR-style): the coordinator's
//! real code under a seeded world, with invariants checked at every step.
//!
//! What runs for real: the SQLite store (every guarded job transition, the
//! claims of placement, orphan requeue), the ledger (group-commit submits,
//! holds, settlement, the expiry sweep), start-up recovery
//! (`app::recover`), the scheduler (fleet, fair-share queue, the decision
//! rule), audits (records, verdicts, bans) and the link's claim checks
//! (`check_result`, `check_handoff` against `dispatch::expected`), with
//! signed ed25519 claims. What is simulated: the clock (a `ManualClock`
//! installed as the coordinator's, see `util::clock`), the network between
//! the coordinator and its nodes (delays, lost links, late and duplicated
//! deliveries), the nodes (honest, slow, crashing, stalling, hostile), the
//! clients (Poisson arrivals), and the dispatcher's attempt driving, which
//! in the coordinator runs over QUIC streams: [`world`] replays its
//! sequence of store and ledger calls (and its retries) event by event.
//!
//! # Determinism
//! One seed is one thread, one current-thread Tokio runtime and one fresh
//! database; every random choice comes from the seed's `StdRng`; events
//! run one at a time, each to completion, in (time, sequence) order. The
//! trace hash (SHA-256 over every event and its outcome) is the proof: the
//! same seed gives the same hash (`tests/determinism.rs`).
//!
//! # Failure
//! A run reports its violations (broken invariants, with the step and
//! time) and the one-line command that replays its seed; an error of the
//! simulator itself (the database could not be opened) is a [`SimError`].

pub mod world;

use std::{collections::BTreeMap, path::PathBuf};

pub use world::{run_seed, Fault};

/// What a run is made of.
#[derive(Clone, Debug)]
pub struct Options {
    /// Most nodes in a seed's world (each seed draws between a quarter of
    /// this and all of it).
    pub nodes: u32,
    /// Events run while faults are injected (then the world goes quiet and
    /// must drain: liveness).
    pub steps: u32,
    /// Where each seed's database lives (deleted after the seed).
    pub dir: PathBuf,
    /// Turns one guard of the simulated dispatcher off, to show the
    /// invariants catch it (see [`Mutation`]).
    pub mutation: Option<Mutation>,
}

impl Default for Options {
    fn default() -> Self {
        let shm = PathBuf::from("/dev/shm");
        Self {
            nodes: 200,
            steps: 1_500,
            dir: if shm.is_dir() {
                shm
            } else {
                std::env::temp_dir()
            },
            mutation: None,
        }
    }
}

/// A guard the simulator can turn off on purpose, to show that the
/// invariants catch its absence (the mutation check).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mutation {
    /// Results are recorded without `check_result` (a node may claim any
    /// tokens, for any attempt).
    SkipResultCheck,
    /// A lease that runs out does not fail its attempt (the job stays with
    /// a node that stopped answering).
    SkipLease,
}

impl std::str::FromStr for Mutation {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "skip-result-check" => Ok(Self::SkipResultCheck),
            "skip-lease" => Ok(Self::SkipLease),
            other => Err(format!(
                "unknown mutation {other:?} (skip-result-check, skip-lease)"
            )),
        }
    }
}

impl Mutation {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::SkipResultCheck => "skip-result-check",
            Self::SkipLease => "skip-lease",
        }
    }
}

/// What one seed did.
#[derive(Clone, Debug, Default)]
pub struct Report {
    pub seed: u64,
    /// Events run (fault phase and drain).
    pub steps: u64,
    pub nodes: u32,
    /// Jobs accepted (their hold placed), and how they ended.
    pub jobs: u64,
    pub completed: u64,
    pub failed: u64,
    pub cancelled: u64,
    /// Faults injected, per kind.
    pub faults: BTreeMap<Fault, u64>,
    /// Broken invariants, each with when it was seen.
    pub violations: Vec<String>,
    /// SHA-256 (hex) over every event and its outcome.
    pub trace: String,
}

/// The command that replays `seed` exactly.
pub fn replay_command(seed: u64, options: &Options) -> String {
    let mut cmd = format!(
        "cargo run -p mlxnet-sim --release -- --seed {seed} --nodes {} --steps {}",
        options.nodes, options.steps
    );
    if let Some(m) = options.mutation {
        cmd.push_str(" --mutate ");
        cmd.push_str(m.as_str());
    }
    cmd
}

/// Why the simulator itself could not run a seed.
#[derive(Debug, thiserror::Error)]
pub enum SimError {
    #[error("opening the seed's database")]
    Store(#[from] mlxnet_coordinator::store::StoreError),
    #[error("the seed's runtime")]
    Runtime(#[from] std::io::Error),
    #[error("setting the world up: {0}")]
    Setup(String),
}
