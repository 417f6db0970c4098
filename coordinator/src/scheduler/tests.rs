//! Scheduler tests: table tests on hand-built fleets (each pick printed with
//! its reason; run with `--nocapture` to read them) and seeded property tests
//! of the invariants.

use std::collections::HashMap;

use ed25519_dalek::SigningKey;
use mlxnet_proto::ids::NodeId;
use rand::{rngs::StdRng, Rng, SeedableRng};

use super::*;

const GB: u64 = 1_000_000_000;
const GIB: u64 = 1 << 30;

fn id(seed: u64) -> NodeId {
    let key = SigningKey::generate(&mut StdRng::seed_from_u64(seed));
    NodeId::from_key(&key.verifying_key())
}

#[allow(clippy::too_many_arguments)]
fn model(
    name: &str,
    digest: u8,
    params: u64,
    active: u64,
    weights: u64,
    layers: u32,
    kv_heads: u32,
    head_dim: u32,
    hidden: u32,
    kv_element_bytes: u32,
) -> ModelShape {
    ModelShape {
        id: name.into(),
        sha256: [digest; 32],
        parameters: params,
        active_parameters: active,
        weights_bytes: weights,
        layers,
        kv_heads,
        head_dim,
        hidden_size: hidden,
        kv_element_bytes,
        context_length: 32_768,
    }
}

/// Models from 135M to 671B parameters (Q4 GGUF sizes).
fn models() -> Vec<ModelShape> {
    vec![
        model(
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
        model(
            "llama-3.1-8b",
            2,
            8_030_000_000,
            0,
            4_920 * GB / 1000,
            32,
            8,
            128,
            4096,
            2,
        ),
        model(
            "qwen2.5-72b",
            3,
            72_700_000_000,
            0,
            47_400 * GB / 1000,
            80,
            8,
            128,
            8192,
            2,
        ),
        model(
            "llama-3.1-405b",
            4,
            405_000_000_000,
            0,
            243 * GB,
            126,
            8,
            128,
            16384,
            2,
        ),
        // Mixture of experts, 37B active; MLA's latent KV (576 per layer) as
        // one "head" of 288 dims, k and v.
        model(
            "deepseek-v3-671b",
            5,
            671_000_000_000,
            37_000_000_000,
            404 * GB,
            61,
            1,
            288,
            7168,
            2,
        ),
    ]
}

struct Built {
    fleet: Fleet,
    names: HashMap<NodeId, &'static str>,
}

impl Built {
    fn name(&self, t: &Target) -> String {
        match t {
            Target::Node(id) => self.names[id].to_string(),
            Target::Pod { name, .. } => name.clone(),
        }
    }
}

/// The hand-built fleet: an M3 Ultra 512 GB, an M4 Max 128 GB, an M4 Pro
/// 64 GB, and a pod of four M4 Max 128 GB Mac Studios over Thunderbolt 5.
/// `cached` lists (node name, model digest); `idle` names idle-time nodes.
fn fleet(cached: &[(&str, u8)], idle: &[&str]) -> Built {
    let all: [(&'static str, &str, u64); 7] = [
        ("ultra", "Apple M3 Ultra", 512),
        ("max", "Apple M4 Max", 128),
        ("pro", "Apple M4 Pro", 64),
        ("pod-0", "Apple M4 Max", 128),
        ("pod-1", "Apple M4 Max", 128),
        ("pod-2", "Apple M4 Max", 128),
        ("pod-3", "Apple M4 Max", 128),
    ];
    let mut fleet = Fleet::new(Policy::default());
    let mut names = HashMap::new();
    for (i, (name, chip, gib)) in all.iter().enumerate() {
        let mode = if idle.contains(name) {
            Mode::IdleTime
        } else {
            Mode::Dedicated
        };
        let mut spec = NodeSpec::new(id(i as u64), chip, gib * GIB, mode, &Measured::default());
        spec.cached = cached
            .iter()
            .filter(|(n, _)| n == name || (*n == "pod" && name.starts_with("pod-")))
            .map(|(_, d)| [*d; 32])
            .collect();
        names.insert(spec.id, *name);
        fleet.add_node(spec).unwrap();
    }
    let members = (3..7).map(id).collect();
    fleet
        .add_pod(PodSpec::typical("studio-pod", members, true))
        .unwrap();
    Built { fleet, names }
}

fn everything_cached() -> Vec<(&'static str, u8)> {
    let mut c = Vec::new();
    for n in ["ultra", "max", "pro", "pod"] {
        for d in 1..=5 {
            c.push((n, d));
        }
    }
    c
}

fn pick(
    b: &Built,
    m: &ModelShape,
    prompt: u32,
    max_tokens: u32,
) -> Result<(String, String), String> {
    let job = JobShape {
        model: m,
        prompt_tokens: prompt,
        max_tokens,
    };
    match b.fleet.decide(&job) {
        Decision::Place(p) => Ok((b.name(&p.target), p.reason)),
        Decision::Wait(r) => Err(format!("wait: {r}")),
        Decision::Never(r) => Err(format!("never: {r}")),
    }
}

#[test]
fn table_every_model_on_the_hand_built_fleet() {
    let ms = models();
    let b = fleet(&everything_cached(), &[]);
    // (model, prompt tokens, max tokens, expected pick)
    let rows: [(usize, u32, u32, &str); 7] = [
        // Every Mac finishes a 135M job well within a second of the fastest:
        // the smallest one that fits takes it, the big ones stay free.
        (0, 200, 256, "pro"),
        // 8B: the M4 Pro and M4 Max are more than 1 s slower than the pod;
        // the M3 Ultra is within a second, as tight a fit as the pod, and
        // one Mac rather than four.
        (1, 500, 512, "ultra"),
        // 72B, long answer: the pod's four memories read in parallel.
        (2, 2_000, 2_048, "studio-pod"),
        // 405B: 267 GB fits the Ultra or the pod; the pod is twice as fast.
        (3, 1_000, 512, "studio-pod"),
        // 671B mixture of experts: ~445 GB; the pod (111 GB a member) again.
        (4, 1_000, 512, "studio-pod"),
        // A short 8B job: within a second everywhere but the M4 Pro.
        (1, 50, 16, "pro"),
        // 72B, short answer: still the pod.
        (2, 100, 64, "studio-pod"),
    ];
    for (m, prompt, max, want) in rows {
        let (got, reason) = pick(&b, &ms[m], prompt, max).unwrap();
        println!(
            "{} (prompt {prompt}, max {max}) -> {got}: {reason}",
            ms[m].id
        );
        assert_eq!(got, want, "{}: {reason}", ms[m].id);
    }
}

#[test]
fn table_locality_mode_gangs_and_limits() {
    let ms = models();
    let show = |what: &str, r: &Result<(String, String), String>| match r {
        Ok((got, reason)) => println!("{what} -> {got}: {reason}"),
        Err(e) => println!("{what} -> {e}"),
    };

    // Cached strongly preferred: 72B held only by the slow M4 Pro goes there
    // rather than downloading 47 GB to a faster Mac.
    let b = fleet(&[("pro", 3)], &[]);
    let r = pick(&b, &ms[2], 100, 256);
    show("72B cached only on the M4 Pro", &r);
    assert_eq!(r.unwrap().0, "pro");

    // Nobody holds it: the download (an hour at 100 Mbit/s) dominates every
    // estimate, so they are all near-best and the tightest fit takes it.
    let b = fleet(&[], &[]);
    let r = pick(&b, &ms[2], 100, 256);
    show("72B cached nowhere", &r);
    let (got, reason) = r.unwrap();
    assert_eq!(got, "pro");
    assert!(reason.contains("download 3792.0 s"), "{reason}");

    // Dedicated before idle-time for long jobs: the Ultra is faster for an
    // 8B job, but idle-time, and the job runs longer than a minute.
    let b = fleet(&everything_cached(), &["ultra", "pod-0"]);
    let r = pick(&b, &ms[1], 2_000, 16_384);
    show("long 8B job, Ultra and pod idle-time", &r);
    assert_eq!(r.unwrap().0, "max");
    // A short job may use the idle-time Ultra.
    let r = pick(&b, &ms[1], 500, 512);
    show("short 8B job, Ultra idle-time", &r);
    assert_eq!(r.unwrap().0, "ultra");

    // Gang scheduling: one pod member running a job of its own makes the
    // pod unavailable; the 405B job goes to the Ultra instead.
    let mut b = fleet(&everything_cached(), &[]);
    let small = JobShape {
        model: &ms[0],
        prompt_tokens: 10,
        max_tokens: 10,
    };
    let pod1 = id(4);
    let mut busy = None;
    for _ in 0..10 {
        // Fill nodes until a pod member takes a solo job.
        let Decision::Place(p) = b.fleet.decide(&small) else {
            panic!("small job should place")
        };
        b.fleet.commit(&p).unwrap();
        if p.target == Target::Node(pod1) {
            busy = Some(p);
            break;
        }
    }
    assert!(busy.is_some(), "a pod member took a solo job");
    let r = pick(&b, &ms[3], 1_000, 512);
    show("405B while a pod member runs a solo job", &r);
    assert_eq!(r.unwrap().0, "ultra");
    if let Some(p) = busy {
        b.fleet.release(&p);
    }

    // Nothing could ever hold it: 671B with a full context needs more than
    // the largest Mac or pod.
    let b = Built {
        fleet: {
            let mut f = Fleet::new(Policy::default());
            f.add_node(NodeSpec::new(
                id(9),
                "Apple M4 Pro",
                24 * GB,
                Mode::Dedicated,
                &Measured::default(),
            ))
            .unwrap();
            f
        },
        names: HashMap::new(),
    };
    let r = pick(&b, &ms[2], 100, 256);
    show("72B on a 24 GB fleet", &r);
    let e = r.unwrap_err();
    assert!(e.starts_with("never: needs 5"), "{e}");
    assert!(e.ends_with("largest node or pod has 24.0 GB"), "{e}");
}

#[test]
fn measured_figures_win_over_the_chip_table() {
    let table = Capability::resolve("Apple M4 Pro", &Measured::default());
    assert_eq!(table.memory_bandwidth.value, 273e9);
    assert_eq!(table.memory_bandwidth.source, capability::Source::Table);
    let measured = Capability::resolve(
        "Apple M4 Pro",
        &Measured {
            memory_bandwidth: Some(190e9),
            compute: Some(f64::NAN),
            internet: Some(50e6),
        },
    );
    assert_eq!(measured.memory_bandwidth.value, 190e9);
    assert_eq!(
        measured.memory_bandwidth.source,
        capability::Source::Measured
    );
    // A bad measurement is ignored, not used.
    assert_eq!(measured.compute.source, capability::Source::Table);
    let unknown = Capability::resolve("AMD EPYC 9B14", &Measured::default());
    assert_eq!(unknown.memory_bandwidth.source, capability::Source::Assumed);

    // The reason says which figure the estimate used.
    let ms = models();
    let mut f = Fleet::new(Policy::default());
    let mut spec = NodeSpec::new(
        id(1),
        "Apple M4 Pro",
        64 * GIB,
        Mode::Dedicated,
        &Measured {
            memory_bandwidth: Some(190e9),
            ..Measured::default()
        },
    );
    spec.cached = vec![ms[1].sha256];
    f.add_node(spec).unwrap();
    let job = JobShape {
        model: &ms[1],
        prompt_tokens: 100,
        max_tokens: 100,
    };
    let Decision::Place(p) = f.decide(&job) else {
        panic!("should place")
    };
    println!("{}", p.reason);
    assert!(p.reason.contains("GB/s measured"), "{}", p.reason);
    // 190 GB/s on the 5% grid is within 2.5% of 190.
    let bw = job.bytes_per_token() / p.estimate.per_token_s;
    assert!((bw / 190e9 - 1.0).abs() < 0.025, "{bw}");
}

#[test]
fn memory_formula_is_weights_plus_kv_plus_overhead() {
    let ms = models();
    let job = JobShape {
        model: &ms[1],
        prompt_tokens: 1000,
        max_tokens: 1000,
    };
    // Llama 3.1 8B, f16 KV: 2 x 32 x 8 x 128 x 2 = 131072 bytes per token.
    assert_eq!(ms[1].kv_bytes_per_token(), 131_072);
    let raw = ms[1].weights_bytes + 2000 * 131_072;
    assert_eq!(job.memory_needed(), raw + raw / 10);
    assert_eq!(job.memory_per_member(4), (raw + raw / 10).div_ceil(4));
}

// ---- property tests (seeded) ----

const CHIPS: [(&str, u64); 6] = [
    ("Apple M3 Ultra", 512),
    ("Apple M4 Max", 128),
    ("Apple M4 Pro", 64),
    ("Apple M2 Max", 96),
    ("Apple M4", 16),
    ("Intel(R) Xeon(R)", 32),
];

/// A random fleet: nodes of random chips, memory, mode and caches, some of
/// them grouped into pods. Returns the fleet and each node's total memory.
fn random_fleet(
    rng: &mut StdRng,
    ms: &[ModelShape],
    downloads: bool,
) -> (Fleet, Vec<(NodeId, u64)>, Vec<Vec<NodeId>>) {
    let mut fleet = Fleet::new(Policy {
        downloads,
        ..Policy::default()
    });
    let n = rng.gen_range(1..24);
    let mut nodes = Vec::new();
    for i in 0..n {
        let (chip, gib) = CHIPS[rng.gen_range(0..CHIPS.len())];
        let mode = if rng.gen_bool(0.5) {
            Mode::Dedicated
        } else {
            Mode::IdleTime
        };
        let measured = Measured {
            memory_bandwidth: rng.gen_bool(0.3).then(|| rng.gen_range(50e9..900e9)),
            ..Measured::default()
        };
        let mut spec = NodeSpec::new(id(1000 + i), chip, gib * GIB, mode, &measured);
        spec.free_memory_bytes = gib * GIB - rng.gen_range(0..gib * GIB / 4);
        spec.max_concurrent_jobs = rng.gen_range(1..4);
        spec.reliability = rng.gen_range(0.5..=1.0);
        spec.cached = ms
            .iter()
            .filter(|_| rng.gen_bool(0.5))
            .map(|m| m.sha256)
            .collect();
        nodes.push((spec.id, spec.free_memory_bytes));
        fleet.add_node(spec).unwrap();
    }
    let mut pods = Vec::new();
    let mut next = 0;
    while next + 2 <= nodes.len() && rng.gen_bool(0.5) {
        let size = rng.gen_range(2..=4).min(nodes.len() - next);
        let members: Vec<NodeId> = nodes[next..next + size].iter().map(|n| n.0).collect();
        fleet
            .add_pod(PodSpec::typical(
                &format!("pod{next}"),
                members.clone(),
                rng.gen_bool(0.5),
            ))
            .unwrap();
        pods.push(members);
        next += size;
    }
    (fleet, nodes, pods)
}

fn small_models() -> Vec<ModelShape> {
    // The whole range, scaled so random fleets can hold most of them.
    models()
}

/// What the test itself knows is running: per node, reserved bytes and
/// whether each reservation was solo or for a pod.
#[derive(Default)]
struct Ledger {
    reserved: HashMap<NodeId, u64>,
    solo: HashMap<NodeId, u32>,
    pod: HashMap<NodeId, u32>,
}

impl Ledger {
    fn apply(&mut self, p: &Placement, sign: i64) {
        let ids: Vec<NodeId> = match &p.target {
            Target::Node(id) => vec![*id],
            Target::Pod { members, .. } => members.clone(),
        };
        for id in ids {
            let r = self.reserved.entry(id).or_default();
            *r = (*r as i64 + sign * p.memory_per_member as i64) as u64;
            let c = match p.target {
                Target::Node(_) => self.solo.entry(id).or_default(),
                Target::Pod { .. } => self.pod.entry(id).or_default(),
            };
            *c = (*c as i64 + sign) as u32;
        }
    }
}

#[test]
fn property_no_overcommit_pods_only_when_all_free_and_everything_feasible_gets_placed() {
    let ms = small_models();
    let mut placed_total = 0;
    for seed in 0..150u64 {
        let mut rng = StdRng::seed_from_u64(seed);
        let downloads = rng.gen_bool(0.5);
        let (mut fleet, nodes, pods) = random_fleet(&mut rng, &ms, downloads);
        let free_at_start: HashMap<NodeId, u64> = nodes.iter().copied().collect();
        let empty = fleet.clone();
        let mut queue: Queue<(usize, u32, u32, u32)> = Queue::new(10_000);
        let mut ledger = Ledger::default();
        let mut running: Vec<Placement> = Vec::new();
        let mut submitted = 0u32;
        let mut done = 0u32;
        let jobs = rng.gen_range(1..60);
        for step in 0..400 {
            // Arrivals for a while, then none.
            if submitted < jobs {
                for _ in 0..rng.gen_range(0..4) {
                    let m = rng.gen_range(0..ms.len());
                    let shape = JobShape {
                        model: &ms[m],
                        prompt_tokens: rng.gen_range(1..4000),
                        max_tokens: rng.gen_range(1..4000),
                    };
                    // Feasible: placeable on the fleet with nothing running
                    // (the API refuses at submit what could never fit).
                    if !matches!(empty.decide(&shape), Decision::Place(_)) {
                        continue;
                    }
                    let account = rng.gen_range(0..3);
                    queue
                        .push(
                            &format!("acct{account}"),
                            rng.gen_range(0..2),
                            (m, shape.prompt_tokens, shape.max_tokens, submitted),
                        )
                        .unwrap();
                    submitted += 1;
                }
            }
            let placed = schedule(&mut queue, &mut fleet, |&(m, p, t, _)| {
                Some(JobShape {
                    model: &ms[m],
                    prompt_tokens: p,
                    max_tokens: t,
                })
            });
            for (_, p) in placed {
                if let Target::Pod { members, .. } = &p.target {
                    assert!(pods.contains(members), "seed {seed}: not a pod");
                    for m in members {
                        assert_eq!(
                            ledger.solo.get(m).copied().unwrap_or(0),
                            0,
                            "seed {seed}: pod member busy"
                        );
                        assert_eq!(
                            ledger.pod.get(m).copied().unwrap_or(0),
                            0,
                            "seed {seed}: pod already busy"
                        );
                    }
                } else if let Target::Node(id) = &p.target {
                    assert_eq!(
                        ledger.pod.get(id).copied().unwrap_or(0),
                        0,
                        "seed {seed}: solo job on a pod at work"
                    );
                }
                ledger.apply(&p, 1);
                for (id, r) in &ledger.reserved {
                    assert!(*r <= free_at_start[id], "seed {seed}: node overcommitted");
                }
                running.push(p);
                placed_total += 1;
            }
            // Some running jobs end.
            let mut i = 0;
            while i < running.len() {
                if rng.gen_bool(0.3) {
                    let p = running.swap_remove(i);
                    fleet.release(&p);
                    ledger.apply(&p, -1);
                    done += 1;
                } else {
                    i += 1;
                }
            }
            if submitted >= jobs && queue.is_empty() && running.is_empty() {
                break;
            }
            assert!(
                step < 399,
                "seed {seed}: {} feasible jobs never placed",
                queue.len()
            );
        }
        assert_eq!(done, submitted, "seed {seed}");
        // Everything released: the fleet is back to where it started.
        for (id, free) in &free_at_start {
            assert_eq!(fleet.node_state(id), Some((*free, 0, false)), "seed {seed}");
        }
    }
    assert!(placed_total > 1000, "{placed_total}");
}

#[test]
fn property_fair_share_within_one_placement() {
    // Accounts continuously backlogged with same-shaped jobs at one priority:
    // their placement counts never differ by more than one, however unevenly
    // they submitted.
    let ms = models();
    for seed in 0..60u64 {
        let mut rng = StdRng::seed_from_u64(seed);
        let (mut fleet, _, _) = random_fleet(&mut rng, &ms, true);
        let shape = JobShape {
            model: &ms[rng.gen_range(0..2)],
            prompt_tokens: 100,
            max_tokens: 100,
        };
        let accounts = rng.gen_range(2..6);
        let mut queue: Queue<usize> = Queue::new(100_000);
        // Account k submits 200 x (k + 1) jobs, account 0 first.
        for a in 0..accounts {
            for _ in 0..200 * (a + 1) {
                queue.push(&format!("acct{a}"), 0, a).unwrap();
            }
        }
        let mut served = vec![0u32; accounts];
        let mut running: Vec<Placement> = Vec::new();
        for _ in 0..100 {
            for (a, p) in schedule(&mut queue, &mut fleet, |_| Some(shape)) {
                served[a] += 1;
                running.push(p);
                // Among the accounts still backlogged (an account that ran out
                // of jobs simply stops being served).
                let backlogged = || {
                    (0..accounts)
                        .filter(|&a| served[a] < 200 * (a as u32 + 1))
                        .map(|a| served[a])
                };
                let max = backlogged().max().unwrap_or(0);
                let min = backlogged().min().unwrap_or(0);
                assert!(max - min <= 1, "seed {seed}: {served:?}");
            }
            for p in running.drain(..) {
                fleet.release(&p);
            }
        }
        assert!(served.iter().sum::<u32>() > 0, "seed {seed}");
    }
}

#[test]
fn decisions_are_deterministic_and_commit_refuses_stale_placements() {
    let ms = models();
    let mut b = fleet(&everything_cached(), &[]);
    let job = JobShape {
        model: &ms[3],
        prompt_tokens: 1000,
        max_tokens: 512,
    };
    let (Decision::Place(a), Decision::Place(again)) = (b.fleet.decide(&job), b.fleet.decide(&job))
    else {
        panic!("should place")
    };
    assert_eq!(a, again);
    b.fleet.commit(&a).unwrap();
    // The same placement twice would overcommit the pod: refused, unchanged.
    assert!(matches!(b.fleet.commit(&a), Err(FleetError::Stale(_))));
    b.fleet.release(&a);
    b.fleet.commit(&a).unwrap();
    // Draining one member takes the pod out; the Ultra is next.
    b.fleet.release(&a);
    assert!(b.fleet.set_draining(&id(5), true));
    let Decision::Place(p) = b.fleet.decide(&job) else {
        panic!("should place")
    };
    assert_eq!(b.name(&p.target), "ultra");
    // Bad pods are refused.
    let mut f = Fleet::new(Policy::default());
    f.add_node(NodeSpec::new(
        id(1),
        "Apple M4 Pro",
        GIB,
        Mode::Dedicated,
        &Measured::default(),
    ))
    .unwrap();
    assert!(matches!(
        f.add_pod(PodSpec::typical("p", vec![id(1), id(2)], true)),
        Err(FleetError::UnknownMember { .. })
    ));
    assert!(matches!(
        f.add_pod(PodSpec::typical("p", vec![id(1)], true)),
        Err(FleetError::TooFewMembers(_))
    ));
    assert!(matches!(
        f.add_node(NodeSpec::new(
            id(1),
            "Apple M4 Pro",
            GIB,
            Mode::Dedicated,
            &Measured::default()
        )),
        Err(FleetError::DuplicateNode(_))
    ));
}

#[test]
fn the_batch_curve_drops_unusable_points_interpolates_and_is_flat_past_its_end() {
    use cost::BatchCurve;
    let c = BatchCurve::new([
        (4, 180.0),
        (0, 500.0),
        (2, 110.0),
        (8, f64::NAN),
        (8, 240.0),
        (1, 60.0),
        (2, 999.0),
        (16, -1.0),
    ]);
    assert!(!c.is_empty());
    assert_eq!(c.slowdown(1), 1.0);
    assert_eq!(c.slowdown(0), 1.0);
    assert!((c.slowdown(2) - 2.0 * 60.0 / 110.0).abs() < 1e-12);
    // Between 2 and 4 streams: 145 tok/s at 3.
    assert!((c.slowdown(3) - 3.0 * 60.0 / 145.0).abs() < 1e-12);
    // Past the last point the aggregate stays at 240 tok/s.
    assert!((c.slowdown(16) - 16.0 * 60.0 / 240.0).abs() < 1e-12);
    // Without a point at one stream there is no base: no curve.
    let headless = BatchCurve::new([(2, 110.0), (4, 180.0)]);
    assert!(headless.is_empty());
    assert_eq!(headless.slowdown(3), 3.0);
    // More streams each faster than one alone is noise: never below 1.
    assert_eq!(BatchCurve::new([(1, 60.0), (2, 200.0)]).slowdown(2), 1.0);
}

#[test]
fn a_second_job_goes_to_a_busy_node_when_its_batch_is_faster_than_an_idle_slow_node() {
    let ms = models();
    let model = &ms[1];
    let node = |seed: u64, bandwidth: f64| {
        let mut spec = NodeSpec::new(
            id(seed),
            "a box",
            64 * GIB,
            Mode::Dedicated,
            &Measured {
                memory_bandwidth: Some(bandwidth),
                compute: Some(10e12),
                internet: None,
            },
        );
        spec.cached = vec![model.sha256];
        spec.max_concurrent_jobs = 8;
        spec
    };
    let curve = cost::BatchCurve::new([(1, 60.0), (2, 110.0), (4, 180.0), (8, 240.0)]);
    let job = JobShape {
        model,
        prompt_tokens: 100,
        max_tokens: 512,
    };
    // The fast node (300 GB/s) already runs `running` jobs; the slow one
    // (200 GB/s, 1.5x the time alone) is idle.
    let place = |running: u32, curve: &cost::BatchCurve| {
        let mut f = Fleet::new(Policy::default());
        let mut fast = node(1, 300e9);
        fast.running_jobs = running;
        fast.batch = curve.clone();
        f.add_node(fast).unwrap();
        f.add_node(node(2, 200e9)).unwrap();
        let Decision::Place(p) = f.decide(&job) else {
            panic!("should place")
        };
        println!("{running} running: {}", p.reason);
        (p.target == Target::Node(id(1)), p)
    };
    // One job running: by its curve a second stream costs 1.09x: the busy
    // fast node wins.
    let (fast, p) = place(1, &curve);
    assert!(fast, "{}", p.reason);
    assert!(p
        .reason
        .contains("beside 1 running: x1.09/token by its batch curve"));
    // Seven running: the eighth stream costs 2x, slower than the idle node.
    let (fast, p) = place(7, &curve);
    assert!(!fast, "{}", p.reason);
    // No curve: no batching gain is assumed, so one running job already
    // doubles the time and the idle node wins.
    let (fast, p) = place(1, &cost::BatchCurve::default());
    assert!(!fast, "{}", p.reason);
    // Idle, the fast node wins whatever its curve says.
    let (fast, p) = place(0, &cost::BatchCurve::default());
    assert!(fast, "{}", p.reason);

    // Jobs the fleet itself places count too: the second of a pass sees
    // the first.
    let mut f = Fleet::new(Policy::default());
    let mut fast = node(1, 300e9);
    fast.batch = curve.clone();
    f.add_node(fast).unwrap();
    let Decision::Place(first) = f.decide(&job) else {
        panic!("should place")
    };
    assert!(!first.reason.contains("running"), "{}", first.reason);
    f.commit(&first).unwrap();
    let Decision::Place(second) = f.decide(&job) else {
        panic!("should place")
    };
    assert!(
        second.reason.contains("beside 1 running"),
        "{}",
        second.reason
    );
    assert!(second.estimate.per_token_s > first.estimate.per_token_s);
}

/// Hole 5: placement learns from evidence, not the Hello alone. Two M4 Max
/// nodes holding the model; the liar's Hello reports a thousand times the
/// chip's bandwidth. Unshown, neither ranks above its chip's table figure;
/// once the liar has failed attempts (or its claims showed it slow) and
/// the honest node showed its speed, the honest node wins every time.
#[test]
fn a_node_ranks_by_what_it_has_shown_not_by_its_hello() {
    let models = models();
    let job = JobShape {
        model: &models[1],
        prompt_tokens: 200,
        max_tokens: 400,
    };
    let (honest, liar) = (id(901), id(902));
    let spec = |node: NodeId, bandwidth: Option<f64>| {
        let mut s = NodeSpec::new(
            node,
            "Apple M4 Max",
            128 * GIB,
            Mode::Dedicated,
            &Measured {
                memory_bandwidth: bandwidth,
                ..Measured::default()
            },
        );
        s.cached = vec![models[1].sha256];
        s
    };
    let table = spec(honest, None).capability.memory_bandwidth.value;
    let pick = |shown_honest: &Evidence, shown_liar: &Evidence| {
        let mut fleet = Fleet::new(Policy::default());
        // The liar is added first: on a tie it would win.
        fleet
            .add_node(spec(liar, Some(table * 1000.0)).with_evidence(shown_liar))
            .unwrap();
        fleet
            .add_node(spec(honest, Some(table)).with_evidence(shown_honest))
            .unwrap();
        match fleet.decide(&job) {
            Decision::Place(p) => {
                println!("{}", p.reason);
                p.target
            }
            other => panic!("not placed: {other:?}"),
        }
    };
    // Nothing shown: the liar's Hello figure is capped at the table's.
    let new = Evidence::default();
    let capped = spec(liar, Some(table * 1000.0)).with_evidence(&new);
    assert_eq!(capped.capability.memory_bandwidth.value, table);

    // The honest node completed one job at its chip's speed.
    let bytes_per_token = job.bytes_per_token();
    let mut shown = Evidence::default();
    shown.attempt(true);
    shown.decoded(400, 400.0 * bytes_per_token / table, bytes_per_token);
    assert!((shown.bandwidth.unwrap() / table - 1.0).abs() < 1e-9);

    // The liar failed its last two attempts.
    let mut failing = Evidence::default();
    failing.attempt(false);
    failing.attempt(false);
    assert_eq!(pick(&shown, &failing), Target::Node(honest));

    // The liar completes, but its own claims show it at a tenth of the
    // chip's speed: it ranks at that, not at its Hello.
    let mut slow = Evidence::default();
    slow.attempt(true);
    slow.decoded(
        400,
        400.0 * bytes_per_token / (table / 10.0),
        bytes_per_token,
    );
    assert_eq!(pick(&shown, &slow), Target::Node(honest));

    // Alone, the failing liar still runs the job (a fleet of one runs).
    let mut fleet = Fleet::new(Policy::default());
    fleet
        .add_node(spec(liar, Some(table * 1000.0)).with_evidence(&failing))
        .unwrap();
    assert!(matches!(fleet.decide(&job), Decision::Place(_)));

    // Old evidence decays: after two clean attempts the failures weigh a
    // sixteenth, and the node is reliable again.
    failing.attempt(true);
    failing.attempt(true);
    assert!(failing.reliability >= 0.75, "{}", failing.reliability);
}

#[test]
fn a_nodes_memory_is_believed_up_to_its_chips_largest_configuration() {
    assert_eq!(memory_cap("Apple M1"), 16 * GIB);
    assert_eq!(memory_cap("apple m3 ultra"), 512 * GIB);
    assert_eq!(memory_cap("M2 Max"), 96 * GIB);
    // A chip the table does not know (a Linux box's CPU name): the assumed cap.
    assert_eq!(
        memory_cap("Intel(R) Xeon(R) Gold 6338"),
        capability::ASSUMED_MAX_MEMORY
    );
    // An honest 16 GB M1 reports 16 GiB: believed whole.
    assert_eq!((16 * GIB).min(memory_cap("Apple M1")), 16 * GIB);
}

fn chat_input(turns: &[(&str, &str)]) -> mlxnet_proto::v1::JobInput {
    use mlxnet_proto::v1::{job_input, ChatMessage, ChatMessages, JobInput};
    JobInput {
        kind: Some(job_input::Kind::Chat(ChatMessages {
            messages: turns
                .iter()
                .map(|(role, content)| ChatMessage {
                    role: (*role).into(),
                    content: (*content).into(),
                })
                .collect(),
        })),
    }
}

/// Issue 25: the second turn of a conversation goes to the node that ran
/// the first when that node is as good as the best, and not when it is
/// clearly busier or slower, however long a prefix it holds.
#[test]
fn the_next_turn_goes_to_the_node_holding_its_prefix_only_when_it_is_near_best() {
    let ms = models();
    let model = &ms[1];
    let node = |seed: u64, bandwidth: f64| {
        let mut spec = NodeSpec::new(
            id(seed),
            "a box",
            64 * GIB,
            Mode::Dedicated,
            &Measured {
                memory_bandwidth: Some(bandwidth),
                compute: Some(10e12),
                internet: None,
            },
        );
        spec.cached = vec![model.sha256];
        spec.max_concurrent_jobs = 8;
        spec
    };
    let system = ("system", "You are a patient tutor. Explain every step.");
    let turn1 = affinity::prefixes(
        &model.sha256,
        &chat_input(&[system, ("user", "What is a monad?")]),
    );
    let turn2 = affinity::prefixes(
        &model.sha256,
        &chat_input(&[
            system,
            ("user", "What is a monad?"),
            ("assistant", "A monoid in the category of endofunctors."),
            ("user", "Say it simply."),
        ]),
    );
    let job = JobShape {
        model,
        prompt_tokens: 2000,
        max_tokens: 512,
    };
    let mut aff = Affinity::new(1024);

    // Turn 1 on two equal idle nodes: the first added wins the tie.
    let mut f = Fleet::new(Policy::default());
    f.add_node(node(1, 300e9)).unwrap();
    f.add_node(node(2, 300e9)).unwrap();
    let Decision::Place(p1) = f.decide_with(&job, &aff.matches(&turn1)) else {
        panic!("should place")
    };
    assert_eq!(p1.target, Target::Node(id(1)), "{}", p1.reason);
    assert_eq!(p1.prefix_match, 0);
    aff.record(id(1), &turn1);

    // Turn 2, on a fleet that lists node 2 first, so that a plain tie
    // would go to node 2.
    let place = |first: NodeSpec, affinity: &[(NodeId, u64)]| {
        let mut f = Fleet::new(Policy::default());
        f.add_node(node(2, 300e9)).unwrap();
        f.add_node(first).unwrap();
        let Decision::Place(p) = f.decide_with(&job, affinity) else {
            panic!("should place")
        };
        println!("{}", p.reason);
        p
    };
    let matches = aff.matches(&turn2);
    assert_eq!(matches, vec![(id(1), turn1[1].depth)]);
    let plain = place(node(1, 300e9), &[]);
    assert_eq!(plain.target, Target::Node(id(2)), "{}", plain.reason);
    let p2 = place(node(1, 300e9), &matches);
    assert_eq!(p2.target, Target::Node(id(1)), "{}", p2.reason);
    assert_eq!(p2.prefix_match, turn1[1].depth);
    assert!(
        p2.reason.contains("bytes of the input's prefix"),
        "{}",
        p2.reason
    );
    // A little slower (within the near-best band) still wins by its prefix.
    let p = place(node(1, 280e9), &matches);
    assert_eq!(p.target, Target::Node(id(1)), "{}", p.reason);

    // Much busier: three jobs running and no batch curve, so the fourth
    // stream takes four times as long. The idle node wins.
    let mut busy = node(1, 300e9);
    busy.running_jobs = 3;
    let p = place(busy, &matches);
    assert_eq!(p.target, Target::Node(id(2)), "{}", p.reason);
    // Much slower: half the bandwidth. However long a prefix it is said to
    // hold, the faster node wins.
    let p = place(node(1, 150e9), &[(id(1), u64::MAX)]);
    assert_eq!(p.target, Target::Node(id(2)), "{}", p.reason);
    assert_eq!(p.prefix_match, 0);

    // The affine node need not be its class's best fit: with less memory
    // free, node 2 fits tighter and is the class's first pick, yet node 1
    // (same class) is looked at for its prefix.
    let mut roomy = node(1, 300e9);
    roomy.free_memory_bytes = 64 * GIB;
    let mut f = Fleet::new(Policy::default());
    let mut tight = node(2, 300e9);
    tight.free_memory_bytes = 16 * GIB;
    f.add_node(tight).unwrap();
    f.add_node(roomy).unwrap();
    let Decision::Place(p) = f.decide_with(&job, &matches) else {
        panic!("should place")
    };
    assert_eq!(p.target, Target::Node(id(1)), "{}", p.reason);

    // Through a whole pass: the second turn follows the first.
    let mut q = Queue::new(4);
    q.push("alice", 0, turn2.clone()).unwrap();
    let mut f = Fleet::new(Policy::default());
    f.add_node(node(2, 300e9)).unwrap();
    f.add_node(node(1, 300e9)).unwrap();
    let placed = schedule_with(&mut q, &mut f, |keys| Some((job, aff.matches(keys))));
    assert_eq!(placed.len(), 1);
    assert_eq!(placed[0].1.target, Target::Node(id(1)));
}

/// Issue 25 (and a test that failed under load, issue 23): a node holding
/// most of the input's prefix prefills only the rest, so a node that is
/// slower at prefill but holds the prefix wins; without the prefix the
/// faster node wins by more than the near-best band.
#[test]
fn a_node_holding_the_prefix_is_credited_with_the_prefill_it_saves() {
    let ms = models();
    let model = &ms[1];
    let node = |seed: u64, compute: f64| {
        let mut spec = NodeSpec::new(
            id(seed),
            "a box",
            64 * GIB,
            Mode::Dedicated,
            &Measured {
                memory_bandwidth: Some(300e9),
                compute: Some(compute),
                internet: None,
            },
        );
        spec.cached = vec![model.sha256];
        spec
    };
    // A long prompt and one token to generate: the prefill is the job.
    let job = JobShape {
        model,
        prompt_tokens: 4000,
        max_tokens: 1,
    };
    let place = |affinity: &[(NodeId, u64)]| {
        let mut f = Fleet::new(Policy::default());
        // Node 1 computes at a quarter of node 2's speed.
        f.add_node(node(1, 2.5e12)).unwrap();
        f.add_node(node(2, 10e12)).unwrap();
        let Decision::Place(p) = f.decide_with(&job, affinity) else {
            panic!("should place")
        };
        println!("{}", p.reason);
        p
    };
    let plain = place(&[]);
    assert_eq!(plain.target, Target::Node(id(2)), "{}", plain.reason);
    // Node 1 ran 3,900 of the 4,000 bytes: it prefills 100.
    let held = place(&[(id(1), 3900)]);
    assert_eq!(held.target, Target::Node(id(1)), "{}", held.reason);
    assert_eq!(held.prefix_match, 3900);
    // Holding only a sliver, it is still the slower one.
    let sliver = place(&[(id(1), 200)]);
    assert_eq!(sliver.target, Target::Node(id(2)), "{}", sliver.reason);
    // A claim of more than the whole input counts as the whole input.
    let all = place(&[(id(1), u64::MAX)]);
    assert_eq!(all.target, Target::Node(id(1)), "{}", all.reason);
}
