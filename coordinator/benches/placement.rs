//! Placement benchmark: simulated fleets of 10,000 and 100,000 nodes (Apple
//! chips from the table, some with measured bandwidth, 2% of them in pods of
//! four) and 100,000 queued jobs (models from 135M to 671B parameters, 100
//! accounts, three priorities).
//!
//! Prints, per fleet size:
//! - decision latency p50 / p99 / max (one `Fleet::decide` on a half-loaded
//!   fleet, reason string included);
//! - placements/s of the decision alone (queue passes with `schedule`,
//!   decide + commit to the in-memory fleet; running jobs end between passes);
//! - placements/s committed to the SQLite database (the same passes, each
//!   pass's placements then written with `Store::assign_many`, one
//!   transaction per pass, WAL, synchronous=NORMAL as the coordinator runs it).
//!
//! Goals: >= 5,000 committed placements/s at 10,000 nodes; p99 decision
//! <= 1 ms at 100,000 nodes.
//!
//! Run: `cargo bench -p mlxnet-coordinator --bench placement` (optionally
//! `-- --nodes 10000,100000 --jobs 100000`).

#![allow(
    clippy::expect_used,
    reason = "a bench binary: a failed step ends the run"
)]

use std::time::{Duration, Instant};

use anyhow::Context;
use ed25519_dalek::SigningKey;
use mlxnet_coordinator::{
    domain::NewJob,
    scheduler::{
        self, Decision, Fleet, JobShape, Measured, Mode, ModelShape, NodeSpec, PodSpec, Policy,
        Queue, Target,
    },
    store::{AnyStore, Store},
};
use mlxnet_proto::{
    chips::CHIPS,
    ids::{JobId, NodeId},
    v1::{job_input, JobInput, SamplingParams},
};
use rand::{rngs::StdRng, Rng, SeedableRng};

const GIB: u64 = 1 << 30;

fn models() -> Vec<ModelShape> {
    let m = |id: &str, d: u8, p: u64, a: u64, w: u64, l: u32, kvh: u32, hd: u32, h: u32, e: u32| {
        ModelShape {
            id: id.into(),
            sha256: [d; 32],
            parameters: p,
            active_parameters: a,
            weights_bytes: w,
            layers: l,
            kv_heads: kvh,
            head_dim: hd,
            hidden_size: h,
            kv_element_bytes: e,
            context_length: 32_768,
        }
    };
    vec![
        m(
            "smollm2-135m",
            1,
            134_515_008,
            0,
            98_362_432,
            30,
            3,
            64,
            576,
            4,
        ),
        m(
            "llama-3.1-8b",
            2,
            8_030_000_000,
            0,
            4_920_000_000,
            32,
            8,
            128,
            4096,
            2,
        ),
        m(
            "qwen2.5-32b",
            3,
            32_800_000_000,
            0,
            19_900_000_000,
            64,
            8,
            128,
            5120,
            2,
        ),
        m(
            "qwen2.5-72b",
            4,
            72_700_000_000,
            0,
            47_400_000_000,
            80,
            8,
            128,
            8192,
            2,
        ),
        m(
            "llama-3.1-405b",
            5,
            405_000_000_000,
            0,
            243_000_000_000,
            126,
            8,
            128,
            16384,
            2,
        ),
        m(
            "deepseek-v3-671b",
            6,
            671_000_000_000,
            37_000_000_000,
            404_000_000_000,
            61,
            1,
            288,
            7168,
            2,
        ),
    ]
}

fn node_id(i: u64) -> NodeId {
    let mut seed = [0u8; 32];
    seed[..8].copy_from_slice(&i.to_le_bytes());
    NodeId::from_key(&SigningKey::from_bytes(&seed).verifying_key())
}

/// A seeded fleet of `n` nodes.
fn fleet(n: usize, models: &[ModelShape], rng: &mut StdRng) -> Fleet {
    let mut fleet = Fleet::new(Policy::default());
    let memories = [16u64, 24, 32, 36, 48, 64, 96, 128, 192, 256, 512];
    let mut pod_members = Vec::new();
    for i in 0..n {
        let chip = CHIPS[rng.gen_range(0..CHIPS.len())];
        let gib = memories[rng.gen_range(0..memories.len())];
        let measured = Measured {
            memory_bandwidth: rng
                .gen_bool(0.3)
                .then(|| chip.memory_bandwidth_bytes_per_s() as f64 * rng.gen_range(0.6..0.9)),
            internet: rng.gen_bool(0.5).then(|| rng.gen_range(5e6..200e6)),
            ..Measured::default()
        };
        let mode = if rng.gen_bool(0.3) {
            Mode::Dedicated
        } else {
            Mode::IdleTime
        };
        let id = node_id(i as u64);
        let mut spec = NodeSpec::new(id, chip.name, gib * GIB, mode, &measured);
        spec.max_concurrent_jobs = rng.gen_range(1..=2);
        spec.reliability = if rng.gen_bool(0.8) {
            1.0
        } else {
            rng.gen_range(0.7..1.0)
        };
        spec.cached = models
            .iter()
            .filter(|m| m.weights_bytes < gib * GIB && rng.gen_bool(0.4))
            .map(|m| m.sha256)
            .collect();
        fleet.add_node(spec).expect("unique ids");
        if rng.gen_bool(0.02) {
            pod_members.push(id);
            if pod_members.len() == 4 {
                let members = std::mem::take(&mut pod_members);
                fleet
                    .add_pod(PodSpec::typical(
                        &format!("pod-{i}"),
                        members,
                        chip.thunderbolt5,
                    ))
                    .expect("fresh members");
            }
        }
    }
    fleet
}

#[derive(Clone, Copy)]
struct Job {
    index: u32,
    model: u8,
    prompt: u32,
    max_tokens: u32,
}

fn jobs(n: usize, models: &[ModelShape], rng: &mut StdRng) -> Vec<(String, u8, Job)> {
    // Mostly small models, as a real network would see.
    let weights = [40u32, 30, 15, 10, 3, 2];
    let total: u32 = weights.iter().sum();
    (0..n)
        .map(|i| {
            let mut r = rng.gen_range(0..total);
            let mut model = 0;
            while r >= weights[model] {
                r -= weights[model];
                model += 1;
            }
            let model = model.min(models.len() - 1);
            (
                format!("acct{}", rng.gen_range(0..100)),
                rng.gen_range(0..3),
                Job {
                    index: i as u32,
                    model: model as u8,
                    prompt: rng.gen_range(10..4_000),
                    max_tokens: rng.gen_range(16..2_048),
                },
            )
        })
        .collect()
}

fn shape<'m>(models: &'m [ModelShape], j: &Job) -> JobShape<'m> {
    JobShape {
        model: &models[j.model as usize],
        prompt_tokens: j.prompt,
        max_tokens: j.max_tokens,
    }
}

fn percentile(sorted: &[Duration], p: f64) -> Duration {
    sorted[((sorted.len() - 1) as f64 * p).round() as usize]
}

fn fmt_us(d: Duration) -> String {
    format!("{:.1} us", d.as_secs_f64() * 1e6)
}

/// Queue passes until every job is placed or `limit` passes ran; running
/// jobs end between passes. Calls `commit` with each pass's placements and
/// returns (placed, time spent deciding, time spent committing).
async fn run_passes<F, Fut>(
    models: &[ModelShape],
    fleet: &mut Fleet,
    queue: &mut Queue<Job>,
    mut commit: F,
) -> (usize, Duration, Duration)
where
    F: FnMut(Vec<(Job, NodeId)>) -> Fut,
    Fut: std::future::Future<Output = ()>,
{
    let mut placed = 0;
    let mut deciding = Duration::ZERO;
    let mut committing = Duration::ZERO;
    for _ in 0..1_000 {
        if queue.is_empty() {
            break;
        }
        let t = Instant::now();
        let pass = scheduler::schedule(queue, fleet, |j| Some(shape(models, j)));
        deciding += t.elapsed();
        if pass.is_empty() {
            break;
        }
        placed += pass.len();
        let batch: Vec<(Job, NodeId)> = pass
            .iter()
            .map(|(j, p)| {
                let node = match &p.target {
                    Target::Node(id) => *id,
                    Target::Pod { members, .. } => members[0],
                };
                (*j, node)
            })
            .collect();
        let t = Instant::now();
        commit(batch).await;
        committing += t.elapsed();
        for (_, p) in &pass {
            fleet.release(p);
        }
    }
    (placed, deciding, committing)
}

fn queue_of(jobs: &[(String, u8, Job)]) -> Queue<Job> {
    let mut q = Queue::new(jobs.len());
    for (account, priority, job) in jobs {
        q.push(account, *priority, *job).expect("sized to fit");
    }
    q
}

#[tokio::main(flavor = "current_thread")]
async fn main() -> anyhow::Result<()> {
    let args: Vec<String> = std::env::args().collect();
    let arg = |name: &str| {
        args.iter()
            .position(|a| a == name)
            .and_then(|i| args.get(i + 1).cloned())
    };
    let sizes: Vec<usize> = arg("--nodes")
        .unwrap_or_else(|| "10000,100000".into())
        .split(',')
        .map(|s| s.parse().context("--nodes"))
        .collect::<Result<_, _>>()?;
    let n_jobs: usize = arg("--jobs")
        .map_or(Ok(100_000), |s| s.parse())
        .context("--jobs")?;
    let models = models();

    for &n in &sizes {
        let mut rng = StdRng::seed_from_u64(n as u64);
        let t = Instant::now();
        let base = fleet(n, &models, &mut rng);
        println!(
            "== {n} nodes, {n_jobs} queued jobs (fleet built in {:.2?})",
            t.elapsed()
        );
        let jobs = jobs(n_jobs, &models, &mut rng);

        // Decision latency on a half-loaded fleet.
        let mut loaded = base.clone();
        let mut lat = Vec::with_capacity(20_000);
        let mut outcomes = [0usize; 3];
        for (i, (_, _, j)) in jobs.iter().take(20_000).enumerate() {
            let s = shape(&models, j);
            let t = Instant::now();
            let d = loaded.decide(&s);
            lat.push(t.elapsed());
            match d {
                Decision::Place(p) => {
                    outcomes[0] += 1;
                    if i % 2 == 0 {
                        loaded.commit(&p).expect("fresh decision");
                    }
                }
                Decision::Wait(_) => outcomes[1] += 1,
                Decision::Never(_) => outcomes[2] += 1,
            }
        }
        lat.sort();
        println!(
            "decision latency: p50 {}, p99 {}, max {} over {} decisions ({} place, {} wait, {} never)",
            fmt_us(percentile(&lat, 0.50)),
            fmt_us(percentile(&lat, 0.99)),
            fmt_us(*lat.last().expect("non-empty")),
            lat.len(),
            outcomes[0],
            outcomes[1],
            outcomes[2]
        );

        // Decision alone.
        let mut f = base.clone();
        let mut q = queue_of(&jobs);
        let (placed, deciding, _) = run_passes(&models, &mut f, &mut q, |_| async {}).await;
        println!(
            "decision alone: {placed} placements in {:.2?} = {:.0} placements/s ({} left queued: never fit)",
            deciding,
            placed as f64 / deciding.as_secs_f64(),
            q.len()
        );

        // Committed to SQLite.
        let dir = tempfile::tempdir()?;
        let store =
            AnyStore::connect(&format!("sqlite://{}/bench.db", dir.path().display())).await?;
        let ids: Vec<JobId> = (0..jobs.len()).map(|_| JobId::new()).collect();
        let t = Instant::now();
        for (i, _) in jobs.iter().enumerate() {
            store
                .insert_job(&NewJob {
                    id: ids[i],
                    model: "bench".into(),
                    input: JobInput {
                        kind: Some(job_input::Kind::Prompt("hello".into())),
                    },
                    sampling: SamplingParams {
                        max_tokens: 16,
                        seed: Some(1),
                        ..SamplingParams::default()
                    },
                    priority: 0,
                })
                .await?;
        }
        println!(
            "(queued {} jobs in the database in {:.2?})",
            jobs.len(),
            t.elapsed()
        );
        let mut f = base.clone();
        let mut q = queue_of(&jobs);
        let store_ref = &store;
        let ids_ref = &ids;
        let (placed, deciding, committing) =
            run_passes(&models, &mut f, &mut q, |batch| async move {
                let rows: Vec<_> = batch
                    .iter()
                    .map(|(j, node)| (ids_ref[j.index as usize], 1, node.to_string()))
                    .collect();
                let done = store_ref.assign_many(&rows).await.expect("store");
                assert!(done.iter().all(|&d| d), "every placement assigned once");
            })
            .await;
        let total = deciding + committing;
        println!(
            "committed to SQLite: {placed} placements in {:.2?} (decide {:.2?} + commit {:.2?}) = {:.0} placements/s",
            total,
            deciding,
            committing,
            placed as f64 / total.as_secs_f64()
        );
        store.close().await;
    }
    Ok(())
}
