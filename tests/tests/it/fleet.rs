//! The mixed fleet: a real coordinator, four honest real nodes (the
//! SmolLM2 test model, the coordinator's trusted nodes, so there are
//! established auditors) and four hostile nodes speaking the real wire
//! (hand-made, `mlxnet_coordinator::test_utils::FakeNode`), serving a run
//! of jobs submitted a few at a time.
//!
//! Each hostile node lies in its Hello (a huge measured bandwidth and
//! compute, or `i64::MAX` memory, or both: drawn at random) and, for each
//! job it is given, draws one of the holes at random
//! ([`Lie`]): fabricated tokens and text, a self-declared hand-off
//! without `Drain`, an inflated `prompt_tokens`, out-of-vocabulary ids, or
//! a failed job (after streaming junk tokens). Asked to audit, it fails
//! the claim (a lying auditor; as new keys on probation they should never
//! be asked). Every hostile node is a new key: audited on every job.
//!
//! What must hold, and is asserted: every completed job's output is
//! covered by signed claims and verifies offline with the real
//! `mlxnet verify <job>` binary; no honest node is banned; every hostile
//! operator account ends with zero earnings (nothing posted, nothing
//! pending); every hold is resolved; `Ledger::violations` is empty. The
//! run prints a table: per node, its kind and behaviour, attempts
//! assigned, jobs completed, audits passed and failed, banned or not, and
//! its operator's net earnings; totals of jobs completed and failed, jobs
//! voided by a failed audit, claims verified offline.
//!
//! The normal suite runs [`CI_JOBS`] jobs; the full run is ignored:
//! `MIXED_FLEET_JOBS=200 cargo nextest run -p mlxnet-coordinator -p
//! mlxnet-tests --run-ignored only -E 'test(a_mixed_fleet_of_200_jobs)'
//! --no-capture` (the job count defaults to 200; `MIXED_FLEET_SEED` fixes
//! the hostile nodes' draws, printed otherwise).
//!
//! Every wait is on an event (a node registered, a job's end, the
//! holds resolved), bounded by the harness deadline. The audit window
//! ([`WINDOW_MS`]) is the product's own clock: an audit must end inside
//! it, so it is wide beside one audit of a few tokens on this machine.

use std::{
    collections::BTreeMap,
    fmt::Write as _,
    process::Command,
    sync::{Arc, Mutex},
    time::Duration,
};

use anyhow::{ensure, Context};
use mlxnet_coordinator::{
    audit::{AuditConfig, Audits, NodeRecord},
    store::{AnyStore, Store},
    test_utils::{claim_for, tokens_of, FakeNode},
};
use mlxnet_proto::{
    claim,
    frame::{read_frame, write_frame},
    v1::{job_update, Assignment, AuditVerdict, BalanceRequest, JobState, JobUpdate},
};
use mlxnet_tests::{
    chat_job, coordinator_config, mlxnet_binary, now_ms, spawn_coordinator, spawn_node, state,
    test_model, within, Client, JobRun, TestCoordinator,
};
use rand::{rngs::StdRng, Rng, SeedableRng};

/// Jobs of the run in the normal suite.
const CI_JOBS: usize = 24;
/// Jobs in flight at once.
const IN_FLIGHT: usize = 6;
/// Most tokens per job (small: the run is about the rules, not the model).
const MAX_TOKENS: u32 = 4;
/// The audit window.
const WINDOW_MS: i64 = 30_000;
/// The hostile nodes' key seeds (new keys).
const HOSTILE_SEEDS: [u64; 4] = [9001, 9002, 9003, 9004];
const HONEST: usize = 4;
/// Tokens in the test model's vocabulary.
const VOCAB: u32 = 49_152;

/// What a hostile node does with one job it is given.
#[derive(Clone, Copy, Debug)]
enum Lie {
    /// Random in-vocabulary ids and made-up text, signed as a completion.
    Fabricate,
    /// Junk tokens signed as a hand-off segment, with no `Drain` sent.
    SelfHandoff,
    /// Junk tokens with `prompt_tokens = u32::MAX`.
    InflatedPrompt,
    /// Ids past the vocabulary (`u32::MAX`).
    OutOfVocabulary,
    /// Streams junk tokens, then fails the attempt.
    Fail,
}

const LIES: [Lie; 5] = [
    Lie::Fabricate,
    Lie::SelfHandoff,
    Lie::InflatedPrompt,
    Lie::OutOfVocabulary,
    Lie::Fail,
];

impl Lie {
    fn name(self) -> &'static str {
        match self {
            Lie::Fabricate => "fabricate",
            Lie::SelfHandoff => "self-handoff",
            Lie::InflatedPrompt => "prompt-tokens",
            Lie::OutOfVocabulary => "oov-ids",
            Lie::Fail => "fail",
        }
    }
}

/// How many times a hostile node did each thing (lies drawn, audits
/// asked of it).
type Tally = Arc<Mutex<BTreeMap<&'static str, u32>>>;

/// The lie each hostile attempt drew, by job id and attempt (shared by
/// the hostile nodes).
type Drawn = Arc<Mutex<BTreeMap<(String, u32), &'static str>>>;

fn count(tally: &Tally, what: &'static str) {
    *tally
        .lock()
        .expect("the tally lock")
        .entry(what)
        .or_default() += 1;
}

/// A hostile node's work on its connection until the coordinator closes
/// it (a ban closes it) or the run ends.
fn hostile_actor(
    node: &FakeNode,
    seed: u64,
    tally: Tally,
    drawn: Drawn,
) -> tokio::task::JoinHandle<()> {
    let key = node.key.clone();
    let conn = node.conn.clone();
    tokio::spawn(async move {
        let mut rng = StdRng::seed_from_u64(seed);
        while let Ok((mut send, mut recv)) = conn.accept_bi().await {
            let Ok(a) = read_frame::<_, Assignment>(&mut recv).await else {
                continue;
            };
            let update = if let Some(audited) = a.audit.as_ref().and_then(|t| t.claim.clone()) {
                count(&tally, "asked to audit");
                let verdict = AuditVerdict {
                    job_id: a.job_id.clone(),
                    claim_signature: audited.signature,
                    passed: false,
                    findings: vec!["every token is wrong".into()],
                    auditor_id: key.verifying_key().to_bytes().to_vec(),
                    ..Default::default()
                };
                job_update::Msg::Verdict(claim::sign_verdict(verdict, &key))
            } else {
                let lie = LIES[rng.gen_range(0..LIES.len())];
                count(&tally, lie.name());
                drawn
                    .lock()
                    .expect("the drawn lock")
                    .insert((a.job_id.clone(), a.attempt), lie.name());
                let resumed = a.resume.clone().unwrap_or_default().token_ids;
                let ids: Vec<u32> = (0..MAX_TOKENS)
                    .map(|_| match lie {
                        Lie::OutOfVocabulary => u32::MAX,
                        _ => rng.gen_range(100..40_000),
                    })
                    .collect();
                let mut c = claim_for(&key, &a, ids, " lorem ipsum dolor sit");
                c.prompt_sha256 =
                    claim::resumed_input_digest(&a.input.clone().unwrap_or_default(), &resumed)
                        .to_vec();
                c.finish_reason = "length".into();
                match lie {
                    Lie::SelfHandoff => c.finish_reason = claim::FINISH_HANDOFF.into(),
                    Lie::InflatedPrompt => c.prompt_tokens = u32::MAX,
                    _ => {}
                }
                let _ = write_frame(&mut send, &tokens_of(resumed.len() as u32, &c)).await;
                if matches!(lie, Lie::Fail) {
                    job_update::Msg::Failure(job_update::Failure {
                        reason: "out of memory".into(),
                        retryable: true,
                    })
                } else {
                    job_update::Msg::Result(claim::sign(c, &key))
                }
            };
            let _ = write_frame(&mut send, &JobUpdate { msg: Some(update) }).await;
            let _ = send.finish();
            let mut buf = [0u8; 64];
            while let Ok(Some(_)) = recv.read(&mut buf).await {}
        }
    })
}

/// One node of the fleet, as the table shows it.
struct Row {
    id: String,
    honest: bool,
    behaviour: String,
    assigned: usize,
    completed: usize,
    record: NodeRecord,
    /// Its operator account's posted balance and pending credits.
    earned: i64,
    pending: i64,
}

/// What the run saw.
struct Report {
    rows: Vec<Row>,
    jobs: usize,
    completed: usize,
    failed: usize,
    voided: usize,
    verified_jobs: usize,
    verified_claims: usize,
    violations: usize,
    /// Each failed job's attempts and error.
    failures: Vec<String>,
    /// Completed jobs whose result a hostile node signed, by the lie its
    /// attempt drew, with the largest prompt token count and token id
    /// their claims carry.
    hostile_results: BTreeMap<&'static str, usize>,
    hostile_max_prompt: u32,
    hostile_max_id: u32,
    seed: u64,
}

impl Report {
    fn table(&self) -> String {
        let mut t = String::new();
        let _ = writeln!(
            t,
            "{:<10} {:<8} {:<58} {:>8} {:>9} {:>7} {:>7} {:>6} {:>7} {:>12}",
            "node",
            "kind",
            "behaviour",
            "assigned",
            "completed",
            "aud ok",
            "aud bad",
            "wrong",
            "banned",
            "net µMLX"
        );
        for r in &self.rows {
            let _ = writeln!(
                t,
                "{:<10} {:<8} {:<58} {:>8} {:>9} {:>7} {:>7} {:>6} {:>7} {:>12}",
                &r.id[..8],
                if r.honest { "honest" } else { "hostile" },
                r.behaviour,
                r.assigned,
                r.completed,
                r.record.clean,
                r.record.failed,
                r.record.wrong_verdicts,
                if r.record.banned { "yes" } else { "no" },
                r.earned + r.pending
            );
        }
        let _ = writeln!(
            t,
            "completed jobs a hostile node signed, by its lie: {:?} (largest prompt_tokens {}, \
             largest token id {})",
            self.hostile_results, self.hostile_max_prompt, self.hostile_max_id
        );
        for f in &self.failures {
            let _ = writeln!(t, "failed job: {f}");
        }
        let _ = writeln!(
            t,
            "jobs {}: completed {} (of which {} voided by a failed audit, client refunded), \
             failed {}; completed jobs verified offline by `mlxnet verify`: {} ({} signed claims); \
             Ledger::violations: {}; hostile seed {}",
            self.jobs,
            self.completed,
            self.voided,
            self.failed,
            self.verified_jobs,
            self.verified_claims,
            self.violations,
            self.seed
        );
        t
    }
}

/// `mlxnet verify <job>` (the real binary): the number of signed claims it
/// checked (segments and the result), or an error with its output.
fn verify_offline(coord: &TestCoordinator, job: &str) -> anyhow::Result<usize> {
    let out = Command::new(mlxnet_binary()?)
        .arg("--coordinator")
        .arg(format!("http://{}", coord.grpc_addr))
        .arg("--api-key")
        .arg(&coord.accounts.client_key)
        .args(["verify", job])
        .output()
        .context("running mlxnet verify")?;
    let stdout = String::from_utf8_lossy(&out.stdout);
    ensure!(
        out.status.success() && stdout.contains("verified: signed by"),
        "`mlxnet verify {job}` did not verify ({}):\n{stdout}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    Ok(1 + stdout.matches("(hand-off)").count())
}

async fn held(client: &mut Client) -> anyhow::Result<i64> {
    Ok(client
        .accounts
        .balance(BalanceRequest {})
        .await?
        .into_inner()
        .held_micro_mlx)
}

/// Runs `jobs` jobs on the mixed fleet; returns what it saw (the caller
/// asserts).
async fn run_fleet(jobs: usize, seed: u64) -> anyhow::Result<Report> {
    test_model();
    let dir = tempfile::tempdir()?;
    let mut config = coordinator_config(&dir.path().join("coord"));
    let names: Vec<String> = (0..HONEST).map(|i| format!("honest{i}")).collect();
    let trusted = names
        .iter()
        .map(|name| {
            let id = mlx_node::identity::Identity::load_or_create(&dir.path().join(name))?;
            Ok(id.node_id().to_string())
        })
        .collect::<anyhow::Result<Vec<String>>>()?;
    config.audit = AuditConfig {
        rate_new: 1.0,
        window_ms: WINDOW_MS,
        trusted,
        ..AuditConfig::default()
    };
    config.ledger.sweep_interval_ms = 100;
    let coord = spawn_coordinator(config).await?;
    let store = AnyStore::connect(&coord.config.database_url()).await?;

    let mut honest = Vec::new();
    for name in &names {
        // Each honest node earns into an account of its own (a node never
        // audits its operator's other nodes).
        let mut c = coord.node_config(&dir.path().join(name), name);
        c.operator_account = String::new();
        c.max_concurrent_jobs = Some(2);
        let mut node = spawn_node(c).await?;
        node.registered().await?;
        honest.push(node);
    }
    let mut rng = StdRng::seed_from_u64(seed);
    let mut hostile = Vec::new();
    let drawn = Drawn::default();
    for &s in &HOSTILE_SEEDS {
        let lie: u8 = rng.gen_range(0..3);
        let node = FakeNode::register_at(coord.quic_addr, &coord.fingerprint, s, |h| {
            if let Some(hw) = h.hardware.as_mut() {
                if lie != 1 {
                    hw.measured_memory_bandwidth_bytes_per_s = 100_000_000_000_000;
                    hw.measured_compute_flops = 1_000_000_000_000_000_000;
                }
                if lie != 0 {
                    hw.memory_bytes = i64::MAX as u64;
                    hw.free_memory_bytes = i64::MAX as u64;
                }
            }
            h.max_concurrent_jobs = 4;
        })
        .await;
        let hello = match lie {
            0 => "hello: huge bandwidth",
            1 => "hello: i64::MAX memory",
            _ => "hello: both",
        };
        let tally = Tally::default();
        let task = hostile_actor(&node, rng.gen(), Arc::clone(&tally), Arc::clone(&drawn));
        hostile.push((node, hello, tally, task));
    }

    // The jobs, a few in flight at a time.
    let client = coord.client().await?;
    let gate = Arc::new(tokio::sync::Semaphore::new(IN_FLIGHT));
    let mut tasks = Vec::new();
    for i in 0..jobs {
        let permit = Arc::clone(&gate).acquire_owned().await?;
        let mut client = client.clone();
        tasks.push(tokio::spawn(async move {
            let run = client
                .run_job(chat_job(
                    &format!("Count from {i} to {}.", i + 3),
                    MAX_TOKENS,
                ))
                .await;
            drop(permit);
            run
        }));
    }
    let mut runs: Vec<JobRun> = Vec::new();
    for t in tasks {
        runs.push(t.await??);
    }

    // Every hold resolved: paid after its window, or refunded.
    let mut watcher = client.clone();
    within("every hold to be resolved", async {
        loop {
            if held(&mut watcher).await? == 0 {
                return Ok::<_, anyhow::Error>(());
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    })
    .await??;

    let audits = Audits::of_store(&store, AuditConfig::default()).await?;
    let (mut completed, mut failed, mut voided, mut verified_jobs, mut verified_claims) =
        (0, 0, 0, 0, 0);
    let mut failures = Vec::new();
    for run in &runs {
        match state(&run.job) {
            JobState::Completed => {
                completed += 1;
                if audits.state(&run.job_id).await?.as_deref() == Some("failed") {
                    voided += 1;
                }
                verified_claims += verify_offline(&coord, &run.job_id)?;
                verified_jobs += 1;
            }
            _ => {
                failed += 1;
                failures.push(format!(
                    "attempt {} by {:?}: {}",
                    run.job.attempt,
                    run.assigned_to
                        .iter()
                        .map(|n| n.get(..8).unwrap_or(n))
                        .collect::<Vec<_>>(),
                    run.job.error
                ));
            }
        }
    }
    let mut hostile_results = BTreeMap::new();
    let (mut hostile_max_prompt, mut hostile_max_id) = (0, 0);
    for run in runs.iter().filter(|r| state(&r.job) == JobState::Completed) {
        let Some(c) = run.job.result.as_ref().and_then(|r| r.claim.as_ref()) else {
            continue;
        };
        let lie = drawn
            .lock()
            .expect("the drawn lock")
            .get(&(run.job_id.clone(), c.attempt))
            .copied();
        if let Some(lie) = lie {
            *hostile_results.entry(lie).or_default() += 1;
            hostile_max_prompt = hostile_max_prompt.max(c.prompt_tokens);
            hostile_max_id =
                hostile_max_id.max(c.output_token_ids.iter().copied().max().unwrap_or(0));
        }
    }
    let mut rows = Vec::new();
    let ids: Vec<(String, bool, String)> = honest
        .iter()
        .map(|n| (n.id.to_string(), true, "real node, SmolLM2".to_string()))
        .chain(hostile.iter().map(|(n, hello, tally, _)| {
            let drawn: Vec<String> = tally
                .lock()
                .expect("the tally lock")
                .iter()
                .map(|(k, v)| format!("{k} {v}"))
                .collect();
            (
                hex::encode(n.key.verifying_key().to_bytes()),
                false,
                format!("{hello}; {}", drawn.join(", ")),
            )
        }))
        .collect();
    for (id, is_honest, behaviour) in ids {
        let operator = coord.ledger.link_node(&id, "").await?;
        let account = coord
            .ledger
            .account(&operator)
            .await?
            .context("the node's operator account")?;
        rows.push(Row {
            assigned: runs
                .iter()
                .map(|r| r.assigned_to.iter().filter(|n| **n == id).count())
                .sum(),
            completed: runs
                .iter()
                .filter(|r| state(&r.job) == JobState::Completed && r.job.node_id == id)
                .count(),
            record: audits.record(&id).await?,
            earned: account.credits_posted - account.debits_posted,
            pending: account.credits_pending,
            id,
            honest: is_honest,
            behaviour,
        });
    }
    let violations = coord.ledger.violations(now_ms()).await?.len();

    for (_, _, _, task) in &hostile {
        task.abort();
    }
    drop(hostile);
    for node in honest {
        node.stop().await?;
    }
    store.close().await;
    coord.stop().await?;
    Ok(Report {
        rows,
        jobs,
        completed,
        failed,
        voided,
        verified_jobs,
        verified_claims,
        violations,
        failures,
        hostile_results,
        hostile_max_prompt,
        hostile_max_id,
        seed,
    })
}

/// The properties of a run.
fn check(report: &Report) {
    for r in &report.rows {
        if r.honest {
            assert!(!r.record.banned, "honest node {} was banned", &r.id[..8]);
        } else {
            assert_eq!(
                (r.earned, r.pending),
                (0, 0),
                "hostile node {} earned (posted, pending)",
                &r.id[..8]
            );
        }
    }
    assert_eq!(report.completed + report.failed, report.jobs);
    assert_eq!(report.verified_jobs, report.completed);
    assert!(report.completed > 0, "no job completed");
    assert!(
        report.rows.iter().any(|r| r.honest && r.earned > 0),
        "no honest node was paid"
    );
    assert_eq!(report.violations, 0, "the ledger's invariants broke");
    assert!(
        report.hostile_max_id < VOCAB,
        "a claim listing an id past the vocabulary completed: {:?}",
        report.hostile_results
    );
}

fn seed() -> u64 {
    std::env::var("MIXED_FLEET_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(rand::random)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_mixed_fleet_of_honest_and_hostile_nodes_pays_only_honest_verified_work(
) -> anyhow::Result<()> {
    let report = run_fleet(CI_JOBS, seed()).await?;
    println!("{}", report.table());
    check(&report);
    Ok(())
}

/// The full run (200 jobs unless `MIXED_FLEET_JOBS` says otherwise).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "the full mixed-fleet run (minutes): MIXED_FLEET_JOBS=200"]
async fn a_mixed_fleet_of_200_jobs() -> anyhow::Result<()> {
    let jobs = std::env::var("MIXED_FLEET_JOBS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(200);
    let started = std::time::Instant::now();
    let report = run_fleet(jobs, seed()).await?;
    println!("{}", report.table());
    println!("wall time {:.0} s", started.elapsed().as_secs_f64());
    check(&report);
    Ok(())
}
