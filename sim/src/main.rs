//! `mlxnet-sim`: runs the deterministic simulator over many seeds (or one,
//! to replay it) and prints seeds, steps, faults per kind and violations;
//! each failing seed with the one-line command that replays it. Exits 1 if
//! any seed broke an invariant.
#![allow(clippy::print_stdout, reason = "a command-line tool's output")]

use std::{
    collections::BTreeMap,
    panic::{catch_unwind, AssertUnwindSafe},
    sync::{
        atomic::{AtomicUsize, Ordering},
        Mutex,
    },
    time::Instant,
};

use clap::Parser;
use mlxnet_sim::{replay_command, run_seed, Fault, Mutation, Options, Report};

#[derive(Parser, Debug)]
#[command(about = "Deterministic simulation of the mlx-network coordinator under faults")]
struct Args {
    /// Seeds to run (seeds FIRST..FIRST+N).
    #[arg(long, default_value_t = 100)]
    seeds: u64,
    /// The first seed.
    #[arg(long, default_value_t = 0)]
    first: u64,
    /// Run only this seed (a replay), printing its trace hash.
    #[arg(long)]
    seed: Option<u64>,
    /// Most nodes in a seed's world.
    #[arg(long, default_value_t = Options::default().nodes)]
    nodes: u32,
    /// Events per seed while faults are injected.
    #[arg(long, default_value_t = Options::default().steps)]
    steps: u32,
    /// Threads running seeds (default: the machine's cores).
    #[arg(long)]
    threads: Option<usize>,
    /// Turn a guard off on purpose: skip-result-check, skip-lease.
    #[arg(long)]
    mutate: Option<Mutation>,
}

fn main() -> std::process::ExitCode {
    let args = Args::parse();
    let options = Options {
        nodes: args.nodes,
        steps: args.steps,
        mutation: args.mutate,
        ..Options::default()
    };
    let seeds: Vec<u64> = match args.seed {
        Some(s) => vec![s],
        None => (args.first..args.first.saturating_add(args.seeds)).collect(),
    };
    let threads = args
        .threads
        .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get()))
        .clamp(1, seeds.len().max(1));
    let started = Instant::now();
    let run = |seed: u64| run_seed(seed, &options).map_err(|e| format!("seed {seed}: {e:?}"));
    let reports = run_all(&seeds, threads, &run);
    let mut steps = 0u64;
    let mut jobs = (0u64, 0u64, 0u64, 0u64);
    let mut nodes = 0u64;
    let mut faults: BTreeMap<Fault, u64> = BTreeMap::new();
    let mut failing = Vec::new();
    let mut errors = 0;
    for (seed, r) in &reports {
        match r {
            Ok(r) => {
                steps += r.steps;
                nodes += u64::from(r.nodes);
                jobs.0 += r.jobs;
                jobs.1 += r.completed;
                jobs.2 += r.failed;
                jobs.3 += r.cancelled;
                for (f, n) in &r.faults {
                    *faults.entry(*f).or_default() += n;
                }
                if !r.violations.is_empty() {
                    failing.push(r);
                }
                if args.seed.is_some() {
                    println!("seed {} trace {}", r.seed, r.trace);
                }
            }
            Err(e) => {
                errors += 1;
                println!("error: {e}");
                println!("  replay: {}", replay_command(*seed, &options));
            }
        }
    }
    let violations: usize = failing.iter().map(|r| r.violations.len()).sum();
    println!(
        "seeds {} | steps {steps} | nodes {nodes} | jobs {} (completed {}, failed {}, cancelled {}) | {:.1} s on {threads} threads",
        reports.len(),
        jobs.0,
        jobs.1,
        jobs.2,
        jobs.3,
        started.elapsed().as_secs_f64()
    );
    let kinds: Vec<String> = faults
        .iter()
        .map(|(f, n)| format!("{} {n}", f.as_str()))
        .collect();
    println!("faults: {}", kinds.join(", "));
    println!("violations {violations} in {} seeds", failing.len());
    for r in &failing {
        for v in r.violations.iter().take(3) {
            println!("  seed {}: {v}", r.seed);
        }
        println!("  replay: {}", replay_command(r.seed, &options));
    }
    if violations > 0 || errors > 0 {
        std::process::ExitCode::FAILURE
    } else {
        std::process::ExitCode::SUCCESS
    }
}

/// Runs `run` on every seed with `threads` workers, each report (or error)
/// once, in seed order. A seed that panics is an error naming it (the panic
/// message and, through `run`'s errors, its replay line are printed by the
/// caller), never a report that silently goes missing, and the worker goes
/// on with the next seed.
fn run_all<F>(seeds: &[u64], threads: usize, run: &F) -> Vec<(u64, Result<Report, String>)>
where
    F: Fn(u64) -> Result<Report, String> + Sync,
{
    let next = AtomicUsize::new(0);
    let reports: Mutex<Vec<(u64, Result<Report, String>)>> = Mutex::default();
    std::thread::scope(|scope| {
        for _ in 0..threads.max(1) {
            scope.spawn(|| loop {
                let Some(&seed) = seeds.get(next.fetch_add(1, Ordering::SeqCst)) else {
                    return;
                };
                let r = catch_unwind(AssertUnwindSafe(|| run(seed))).unwrap_or_else(|panic| {
                    let what = panic
                        .downcast_ref::<&str>()
                        .map(|s| (*s).to_owned())
                        .or_else(|| panic.downcast_ref::<String>().cloned())
                        .unwrap_or_else(|| "a panic".to_owned());
                    Err(format!("seed {seed} panicked: {what}"))
                });
                reports
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .push((seed, r));
            });
        }
    });
    let mut reports = reports.into_inner().unwrap_or_else(|p| p.into_inner());
    reports.sort_by_key(|(seed, _)| *seed);
    reports
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A panicking seed is reported as an error, and the seeds after it
    /// still run on the same (single) worker.
    #[test]
    fn a_panicking_seed_is_an_error_and_the_run_goes_on() {
        let options = Options {
            nodes: 8,
            steps: 40,
            ..Options::default()
        };
        let run = |seed: u64| {
            assert!(seed != 1, "seed 1 breaks on purpose");
            run_seed(seed, &options).map_err(|e| format!("{e:?}"))
        };
        let reports = run_all(&[0, 1, 2], 1, &run);
        let seeds: Vec<u64> = reports.iter().map(|(seed, _)| *seed).collect();
        assert_eq!(seeds, [0, 1, 2]);
        assert_eq!(reports[0].1.as_ref().map(|r| r.seed).ok(), Some(0));
        let err = reports[1].1.as_ref().err().cloned().unwrap_or_default();
        assert!(
            err.contains("seed 1 panicked: seed 1 breaks on purpose"),
            "{err}"
        );
        assert_eq!(reports[2].1.as_ref().map(|r| r.seed).ok(), Some(2));
    }
}
