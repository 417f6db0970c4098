//! The owner's view: the board a node keeps, its journal's sums, and the
//! frame `mlx-node status` draws from them.

use mlxnet_proto::v1::{EarningsPeriod, EarningsResponse, NodeEarnings};

use super::*;

/// 2024-12-04 (a Wednesday) 10:00 UTC.
const WED_10H: u64 = 1_733_306_400_000;

fn entry(ts_ms: u64, tokens: u64, joules: Option<f64>) -> JournalEntry {
    JournalEntry {
        ts_ms,
        job_id: format!("job-{ts_ms}"),
        attempt: 1,
        model: "smollm2-135m-instruct".into(),
        prompt_tokens: 10,
        tokens,
        finish: "eos".into(),
        joules,
    }
}

fn journal(entries: &[JournalEntry]) -> String {
    entries
        .iter()
        .map(|e| serde_json::to_string(e).unwrap() + "\n")
        .collect()
}

#[test]
fn journal_totals_split_at_utc_midnight_and_monday() {
    let midnight = WED_10H - 10 * 3_600_000;
    let monday = midnight - 2 * DAY_MS;
    let text = journal(&[
        entry(monday - 1, 1000, None),     // last Sunday: all time only
        entry(monday, 100, Some(5.0)),     // this week
        entry(midnight - 1, 10, None),     // this week, yesterday
        entry(midnight, 20, Some(2.0)),    // today
        entry(WED_10H - 5, 30, Some(3.0)), // today
    ]) + "not json\n";
    let t = journal_totals(&text, WED_10H);
    assert_eq!((t.today.jobs, t.today.tokens), (2, 50));
    assert_eq!((t.today.joules, t.today.metered_jobs), (5.0, 2));
    assert_eq!(
        (t.week.jobs, t.week.tokens, t.week.metered_jobs),
        (4, 160, 3)
    );
    assert_eq!((t.all_time.jobs, t.all_time.tokens), (5, 1160));
}

fn live_snapshot() -> Snapshot {
    Snapshot {
        node_id: "8f3a2b1c9d".into(),
        name: "studio-in-lyon".into(),
        version: "mlx-node/0.1.0".into(),
        pid: 42,
        updated_ms: WED_10H - 1_000,
        state: "lending".into(),
        coordinator: "coord.example:7071".into(),
        mode: "idle".into(),
        models: vec![HeldModelView {
            id: "smollm2-135m-instruct".into(),
            parameters: 134_515_008,
            size_bytes: 100_000_000,
            backend: "metal".into(),
        }],
        jobs: vec![RunningJob {
            job_id: "0193a1b2".into(),
            model: "smollm2-135m-instruct".into(),
            started_ms: WED_10H - 3_000,
            tokens: 61,
            tokens_per_s: 30.0,
            first_token_ms: 0,
        }],
        energy_meter: "powermetrics".into(),
        ..Snapshot::default()
    }
}

fn earnings() -> EarningsResponse {
    let p = |m, j, t| {
        Some(EarningsPeriod {
            micro_mlx: m,
            jobs: j,
            tokens: t,
        })
    };
    EarningsResponse {
        account_id: "acct_1".into(),
        today: p(1_500_000, 2, 50),
        week: p(2_000_000, 4, 160),
        all_time: p(9_000_000, 5, 1160),
        nodes: vec![],
        next_reward_epoch_ms: 0,
    }
}

/// The owner sees this node's audit record (not another node's of the
/// same account) and when the reward epoch ends.
#[test]
fn the_frame_shows_this_nodes_audit_record_and_the_reward_epochs_end() {
    let totals = journal_totals("", WED_10H);
    let mut r = earnings();
    r.nodes = vec![
        NodeEarnings {
            node_id: "0000000000".into(),
            audits_passed: 99,
            audits_failed: 9,
            ..Default::default()
        },
        NodeEarnings {
            node_id: "8f3a2b1c9d".into(),
            audits_passed: 7,
            audits_failed: 1,
            ..Default::default()
        },
    ];
    r.next_reward_epoch_ms = (WED_10H + 50 * 60_000 - 30_000) as i64;
    let frame = render(
        Some(&live_snapshot()),
        &totals,
        Some(&Ok(r.clone())),
        0,
        WED_10H,
    );
    assert!(
        frame.contains("  audits     7 passed, 1 failed\n"),
        "{frame}"
    );
    assert!(
        frame.contains("  rewards    this epoch ends in 50m (10:49 UTC), paid after it\n"),
        "{frame}"
    );
    r.nodes[1].banned = true;
    r.next_reward_epoch_ms = (WED_10H + 90 * 60_000) as i64;
    let frame = render(Some(&live_snapshot()), &totals, Some(&Ok(r)), 0, WED_10H);
    assert!(
        frame.contains("  audits     7 passed, 1 failed - banned: never placed again\n"),
        "{frame}"
    );
    assert!(frame.contains("ends in 1h 30m (11:30 UTC)"), "{frame}");
    // The account's earnings only: no record of this node, no epoch.
    let frame = render(
        Some(&live_snapshot()),
        &totals,
        Some(&Ok(earnings())),
        0,
        WED_10H,
    );
    assert!(!frame.contains("audits"), "{frame}");
    assert!(!frame.contains("rewards"), "{frame}");
}

/// Expected earnings: the bandwidth-bound decode speed at the output
/// price, times the share of the network's job slots busy.
#[test]
fn expected_earnings_are_speed_times_price_times_demand() {
    let o = OutlookView {
        model: "smollm2-135m-instruct".into(),
        price_output_micro_mlx_per_mtok: 2_000_000,
        nodes_serving: 3,
        demand_permille: 500,
    };
    // 1 GB/s over a 100 MB file: 10 tokens/s, 36,000 tokens an hour,
    // 0.072 MLX at 2 MLX per million, half of it at 50% demand.
    let line = expected_earnings(&o, 1_000_000_000, 100_000_000);
    assert!(
        line.starts_with("expected about 0.036000 MLX/hour"),
        "{line}"
    );
    assert!(line.contains("(2.000000 MLX per million tokens)"), "{line}");
    assert!(
        line.contains("50% of the network's job slots busy; 3 nodes serve it"),
        "{line}"
    );
    let idle = OutlookView {
        demand_permille: 0,
        ..o.clone()
    };
    assert!(expected_earnings(&idle, 1_000_000_000, 100_000_000)
        .starts_with("expected about 0.000000 MLX/hour"));
    // Unknown speed: the price and demand only.
    let line = expected_earnings(&o, 0, 100_000_000);
    assert!(
        line.starts_with("earnings: 2.000000 MLX per million tokens"),
        "{line}"
    );

    // The first-run summary carries it for each served model in the outlook.
    let mut s = live_snapshot();
    s.outlook = vec![o];
    let hw = mlxnet_proto::v1::HardwareProfile {
        chip: "Apple M4 Max".into(),
        memory_bytes: 64 << 30,
        measured_memory_bandwidth_bytes_per_s: 1_000_000_000,
        ..Default::default()
    };
    let summary = first_run_summary(&s, &hw);
    assert!(summary.contains("MLX/hour at today's price"), "{summary}");
}

#[test]
fn the_frame_shows_state_the_running_job_and_earnings_net_of_energy() {
    let totals = journal_totals(
        &journal(&[entry(WED_10H - 60_000, 50, Some(3_600_000.0))]),
        WED_10H,
    );
    // 1 kWh used today at 0.2 MLX per kWh.
    let frame = render(
        Some(&live_snapshot()),
        &totals,
        Some(&Ok(earnings())),
        200_000,
        WED_10H,
    );
    assert!(frame.contains("state      lending\n"), "{frame}");
    assert!(
        frame.contains("job        0193a1b2 on smollm2-135m-instruct: 61 tokens, 30.0 tokens/s"),
        "{frame}"
    );
    assert!(
        frame.contains("smollm2-135m-instruct (134M, metal)"),
        "{frame}"
    );
    let today = frame
        .lines()
        .find(|l| l.contains("today") && l.contains("MLX"))
        .unwrap();
    assert!(today.contains("1.500000 MLX"), "{today}");
    assert!(
        today.contains("net of energy 1.300000 MLX (energy 0.200000 MLX)"),
        "{today}"
    );
    assert!(frame.contains("3600000.0 J (72000.000 J/token)"), "{frame}");

    // Paused, with the reason; no price: no net figure; no key: a hint.
    let mut paused = live_snapshot();
    paused.state = "paused".into();
    paused.reason = "you are using the Mac".into();
    paused.jobs.clear();
    let frame = render(Some(&paused), &totals, None, 0, WED_10H);
    assert!(
        frame.contains("state      paused: you are using the Mac"),
        "{frame}"
    );
    assert!(frame.contains("job        none running"), "{frame}");
    assert!(frame.contains("pass --api-key"), "{frame}");
    assert!(!frame.contains("net of energy"), "{frame}");
    let frame = render(
        Some(&paused),
        &totals,
        Some(&Err("unauthenticated".into())),
        0,
        WED_10H,
    );
    assert!(
        frame.contains("cannot read them: unauthenticated"),
        "{frame}"
    );
}

#[test]
fn a_stale_or_stopped_board_is_a_node_that_is_not_running() {
    let mut s = live_snapshot();
    s.updated_ms = WED_10H - STALE_MS - 1;
    let frame = render(Some(&s), &JournalTotals::default(), None, 0, WED_10H);
    assert!(
        frame.contains("studio-in-lyon (8f3a2b1c): not running"),
        "{frame}"
    );
    assert!(!frame.contains("0193a1b2"), "{frame}");
    let frame = render(None, &JournalTotals::default(), None, 0, WED_10H);
    assert!(frame.contains("not running"), "{frame}");
    assert!(frame.contains("energy not measured"), "{frame}");
}

#[tokio::test]
async fn the_board_follows_jobs_writes_the_journal_and_its_file() {
    let dir = tempfile::tempdir().unwrap();
    let board = Board::new(live_snapshot(), Some(dir.path()));
    board.job_started("j2", "m");
    board.job_tokens("j2", 1);
    board.job_tokens("j2", 4);
    let s = board.snapshot();
    let j = s.jobs.iter().find(|j| j.job_id == "j2").unwrap();
    assert_eq!(j.tokens, 5);
    board.job_finished("j2", Some(entry(now_ms(), 5, Some(1.5))));
    board.job_finished("0193a1b2", None);
    assert!(board.snapshot().jobs.is_empty());
    let path = dir.path().join(STATUS_FILE);
    let stop = tokio_util::sync::CancellationToken::new();
    let writer = tokio::spawn(board.clone().write_until(path.clone(), stop.clone()));
    stop.cancel();
    writer.await.unwrap();
    let (snapshot, totals) = read(dir.path());
    let snapshot = snapshot.unwrap();
    assert_eq!((snapshot.state.as_str(), snapshot.pid), ("stopped", 42));
    assert_eq!(
        (totals.today.jobs, totals.today.tokens, totals.today.joules),
        (1, 5, 1.5)
    );
    assert!(!dir.path().join("status.json.tmp").exists());
}
