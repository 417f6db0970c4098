//! The simulator's own guarantees: a seed replays exactly (the same trace
//! hash twice), a handful of seeds keep every invariant (CI's smaller run;
//! the README shows the 10,000), and a guard turned off on purpose is
//! caught (the mutation check).
#![allow(clippy::unwrap_used, reason = "test code")]

use mlxnet_sim::{run_seed, Mutation, Options};

fn small() -> Options {
    Options {
        nodes: 40,
        steps: 400,
        ..Options::default()
    }
}

#[test]
fn the_same_seed_gives_the_same_trace_twice() {
    let options = small();
    for seed in [7, 1234] {
        let a = run_seed(seed, &options).unwrap();
        let b = run_seed(seed, &options).unwrap();
        assert_eq!(a.trace, b.trace, "seed {seed} did not replay exactly");
        assert_eq!(a.steps, b.steps);
        assert!(a.steps > 0 && a.jobs > 0, "seed {seed} ran nothing: {a:?}");
    }
    let other = run_seed(8, &options).unwrap();
    assert_ne!(
        other.trace,
        run_seed(7, &options).unwrap().trace,
        "different seeds must differ (else the hash sees nothing)"
    );
}

#[test]
fn a_few_seeds_keep_every_invariant() {
    let options = small();
    for seed in 0..6 {
        let r = run_seed(seed, &options).unwrap();
        assert!(
            r.violations.is_empty(),
            "seed {seed}: {:#?}\nreplay: {}",
            r.violations,
            mlxnet_sim::replay_command(seed, &options)
        );
    }
}

#[test]
fn recording_results_without_their_check_is_caught() {
    let options = Options {
        mutation: Some(Mutation::SkipResultCheck),
        ..small()
    };
    let caught = (0..40).find(|&seed| !run_seed(seed, &options).unwrap().violations.is_empty());
    assert!(
        caught.is_some(),
        "no seed of 40 caught results recorded unchecked"
    );
}

#[test]
fn a_cancel_drawn_before_any_job_was_accepted_does_not_panic() {
    // Seed 149 at the default size drew a client cancel while no job had
    // been accepted yet (a sample from an empty range: a panic).
    let r = run_seed(149, &Options::default()).unwrap();
    assert!(r.violations.is_empty(), "{:#?}", r.violations);
}
