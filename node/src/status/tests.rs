//! The owner's view: the board a node keeps, its journal's sums, and the
//! frame `mlx-node status` draws from them.

use mlxnet_proto::v1::{EarningsPeriod, EarningsResponse};

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
    }
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
