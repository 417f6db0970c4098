//! Energy per token end to end: a node reading RAPL counters runs a real
//! job; its signed claim carries the job's joules and joules per token, the
//! coordinator accepts and stores it, the node's journal and the owner's
//! view (`mlx-node status`) show the same joules and the earnings net of
//! the owner's electricity price, and the World page's totals show the
//! network's tokens per joule.
//!
//! This machine's kernel does not let the node read RAPL (no
//! `/sys/class/powercap`), so the counters are files the test advances at
//! a fixed 50 W, in the kernel's layout (`intel-rapl:0/energy_uj`,
//! `max_energy_range_uj`) under the node's `[energy] rapl_root`. Everything
//! else is real: coordinator, node, model, QUIC, the RAPL reader.

use std::{
    path::{Path, PathBuf},
    sync::{
        atomic::{AtomicBool, Ordering},
        Arc,
    },
    time::Duration,
};

use anyhow::Context;
use mlx_node::config::MeterKind;
use mlxnet_coordinator::test_utils::webdriver::http_get;
use mlxnet_proto::{claim, v1::JobState};
use mlxnet_tests::{
    chat_job, coordinator_config, spawn_coordinator, spawn_node, state, test_model, within,
};
use serde_json::Value;

use crate::handoff::claim_of;

/// Microjoules the fake package counter gains every 5 ms: 50 W.
const STEP_UJ: u64 = 250_000;

/// A RAPL package domain whose counter a thread advances until dropped.
struct FakeRapl {
    root: PathBuf,
    stop: Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl FakeRapl {
    fn start(root: &Path) -> anyhow::Result<Self> {
        let domain = root.join("intel-rapl:0");
        std::fs::create_dir_all(&domain)?;
        std::fs::write(domain.join("max_energy_range_uj"), "262143328850\n")?;
        std::fs::write(domain.join("energy_uj"), "0\n")?;
        let stop = Arc::new(AtomicBool::new(false));
        let thread = std::thread::spawn({
            let stop = stop.clone();
            move || {
                let mut uj = 0u64;
                while !stop.load(Ordering::Relaxed) {
                    std::thread::sleep(Duration::from_millis(5));
                    uj += STEP_UJ;
                    // Whole files only: a reader never sees a half-written one.
                    let tmp = domain.join("energy_uj.tmp");
                    if std::fs::write(&tmp, format!("{uj}\n")).is_ok() {
                        let _ = std::fs::rename(&tmp, domain.join("energy_uj"));
                    }
                }
            }
        });
        Ok(Self {
            root: root.to_owned(),
            stop,
            thread: Some(thread),
        })
    }
}

impl Drop for FakeRapl {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_metered_jobs_claim_carries_its_energy_to_the_journal_the_owner_and_the_world_page(
) -> anyhow::Result<()> {
    test_model();
    let dir = tempfile::tempdir()?;
    let rapl = FakeRapl::start(&dir.path().join("powercap"))?;
    let coord = spawn_coordinator(coordinator_config(&dir.path().join("coord"))).await?;
    let node_dir = dir.path().join("node");
    let mut config = coord.node_config(&node_dir, "metered-mac");
    config.energy.meter = MeterKind::Rapl;
    config.energy.rapl_root = rapl.root.clone();
    let mut node = spawn_node(config).await?;
    node.registered().await?;
    let mut client = coord.client().await?;

    let run = client
        .run_job(chat_job("What is the capital of France?", 16))
        .await?;
    assert_eq!(state(&run.job), JobState::Completed);
    let c = claim_of(&run)?;
    assert!(c.completion_tokens > 0);
    // The job took milliseconds at least: at 50 W that is joules' worth.
    assert!(c.energy_microjoules >= STEP_UJ, "{c:?}");
    assert_eq!(
        c.microjoules_per_token,
        c.energy_microjoules / u64::from(c.completion_tokens)
    );
    // Signed: the stored result verifies, and not with the energy changed.
    let signed = run.job.result.clone().context("no result")?;
    claim::verify(&signed)?;
    let mut forged = signed.clone();
    if let Some(f) = forged.claim.as_mut() {
        f.energy_microjoules /= 2;
        f.microjoules_per_token =
            claim::microjoules_per_token(f.energy_microjoules, f.completion_tokens);
    }
    assert!(claim::verify(&forged).is_err());

    // The node's journal has the claim's joules.
    let journal = std::fs::read_to_string(node_dir.join(mlx_node::status::JOURNAL_FILE))?;
    let entry: mlx_node::status::JournalEntry =
        serde_json::from_str(journal.lines().next().context("an empty journal")?)?;
    assert_eq!(entry.job_id, run.job_id);
    assert_eq!(entry.joules, Some(c.energy_microjoules as f64 / 1e6));

    // The owner's view: today's joules, and the earnings net of the energy
    // at 1 MLX per kWh.
    let earnings = mlx_node::earnings::fetch(
        &format!("http://{}", coord.grpc_addr),
        &coord.accounts.operator_key,
    )
    .await
    .map_err(|e| e.to_string());
    let (snapshot, totals) = mlx_node::status::read(&node_dir);
    let price = 1_000_000;
    let frame = mlx_node::status::render(
        snapshot.as_ref(),
        &totals,
        Some(&earnings),
        price,
        mlx_node::status::now_ms(),
    );
    let joules = c.energy_microjoules as f64 / 1e6;
    let work_today = frame
        .lines()
        .find(|l| l.trim_start().starts_with("today") && l.contains("tokens"))
        .context("no work line")?;
    assert!(
        work_today.contains(&format!("{joules:.1} J")),
        "{work_today}\n{frame}"
    );
    let paid_today = frame
        .lines()
        .find(|l| l.trim_start().starts_with("today") && l.contains(" MLX "))
        .context("no earnings line")?;
    let cost = mlx_node::status::energy_cost_micro(joules, price);
    assert!(
        paid_today.contains(&format!("(energy {} MLX)", mlx_node::status::mlx(cost))),
        "{paid_today}\n{frame}"
    );
    assert!(paid_today.contains("net of energy"), "{paid_today}");
    // This node's audit record and the reward epoch's end, from the
    // coordinator (audits are off by default: none yet).
    assert!(
        frame.contains("  audits     0 passed, 0 failed\n"),
        "{frame}"
    );
    assert!(
        frame.contains("  rewards    this epoch ends in "),
        "{frame}"
    );

    // The first-run summary: the coordinator's Welcome said what the model
    // pays and how busy the network is.
    // (The board is written 200 ms after a change: wait for that write.)
    let snapshot = within("the board with the outlook", async {
        loop {
            match mlx_node::status::read(&node_dir).0 {
                Some(s) if !s.outlook.is_empty() => return s,
                _ => tokio::time::sleep(Duration::from_millis(50)).await,
            }
        }
    })
    .await?;
    let o = snapshot
        .outlook
        .iter()
        .find(|o| o.model == mlxnet_tests::TEST_MODEL_ID)
        .with_context(|| format!("no outlook for the model: {:?}", snapshot.outlook))?;
    assert!(o.price_output_micro_mlx_per_mtok > 0, "{o:?}");
    assert_eq!(o.nodes_serving, 1, "{o:?}");
    let hw = mlxnet_proto::v1::HardwareProfile {
        measured_memory_bandwidth_bytes_per_s: 10_000_000_000,
        ..Default::default()
    };
    let summary = mlx_node::status::first_run_summary(&snapshot, &hw);
    assert!(summary.contains("MLX/hour at today's price"), "{summary}");

    // The World page: this one job's tokens per joule.
    let (status, body, _) = http_get(coord.http_addr, "/api/world/totals").await?;
    let body = String::from_utf8_lossy(&body);
    assert_eq!(status, 200, "{body}");
    let totals: Value = serde_json::from_str(&body).context(body.to_string())?;
    let tpj = totals["tokens_per_joule"]
        .as_f64()
        .with_context(|| format!("no tokens_per_joule in {body}"))?;
    let want = f64::from(c.completion_tokens) * 1e6 / c.energy_microjoules as f64;
    assert!((tpj - want).abs() < 1e-9 * want, "{tpj} vs {want}");

    node.stop().await?;
    drop(rapl);
    Ok(())
}
