//! The owner's view: what the running node is doing, written where
//! `mlx-node status` reads it, and that view itself.
//!
//! The running node keeps a [`Board`]: its state and why ("lending",
//! "paused: you are using the Mac"), the models it holds and where they
//! compute, the jobs running now with their tokens/s. A task writes it to
//! `<data dir>/status.json` whenever it changes (and every few seconds, so a
//! reader can tell a live node from a dead one). Every finished job appends
//! one line to `<data dir>/journal.jsonl` (tokens, energy), from which the
//! view sums today's and this week's work and energy.
//!
//! `mlx-node status` reads both, asks the coordinator for the operator
//! account's earnings (with the owner's API key), and redraws the screen
//! once a second ([`run_view`]); [`render`] is the pure function behind it.
//! Earnings net of energy subtract the jobs' measured energy at the owner's
//! `energy.price_micro_mlx_per_kwh`.
//!
//! # Invariants
//! - `status.json` is replaced atomically (written aside, then renamed), so
//!   a reader never sees half a file.
//! - Days and weeks are UTC, as the coordinator's earnings are.
//!
//! # Failure
//! Writing the board or the journal never fails a job: errors are logged.
//! The view shows "not running" for a missing or stale board, and the
//! coordinator's error instead of earnings when it cannot be asked.

use std::fmt::Write as _;
use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use serde::{Deserialize, Serialize};
use tokio::sync::watch;

/// File name of the board inside the data directory.
pub const STATUS_FILE: &str = "status.json";
/// File name of the journal inside the data directory.
pub const JOURNAL_FILE: &str = "journal.jsonl";
/// The board is rewritten at least this often while the node runs.
const REFRESH: Duration = Duration::from_secs(2);
/// A board older than this is a node that is not running.
const STALE_MS: u64 = 15_000;

/// Milliseconds since the Unix epoch.
pub fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

/// A model the node holds.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct HeldModelView {
    pub id: String,
    pub parameters: u64,
    /// The model file's size (what one decoded token reads).
    #[serde(default)]
    pub size_bytes: u64,
    /// "cpu", "metal", "cuda", "candle-cpu".
    pub backend: String,
}

/// A job running now.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct RunningJob {
    pub job_id: String,
    pub model: String,
    pub started_ms: u64,
    pub tokens: u64,
    /// Tokens per second since its first token.
    pub tokens_per_s: f64,
    #[serde(skip)]
    first_token_ms: u64,
}

/// What the running node publishes.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Snapshot {
    pub node_id: String,
    pub name: String,
    pub version: String,
    pub pid: u32,
    pub updated_ms: u64,
    /// "connecting", "lending", "paused", "disconnected".
    pub state: String,
    /// Why (the pause reason, the link error); empty when lending.
    pub reason: String,
    pub coordinator: String,
    pub mode: String,
    pub models: Vec<HeldModelView>,
    pub jobs: Vec<RunningJob>,
    /// The energy meter in use ("rapl", "powermetrics"), empty for none.
    pub energy_meter: String,
    /// The network's prices and demand for the models served, as the
    /// coordinator said at registration (its `Welcome`).
    #[serde(default)]
    pub outlook: Vec<OutlookView>,
}

/// One served model's prices and the network's demand at registration.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct OutlookView {
    pub model: String,
    pub price_output_micro_mlx_per_mtok: u64,
    pub nodes_serving: u32,
    /// Jobs queued or running per 1,000 job slots online, at most 1,000.
    pub demand_permille: u32,
}

/// The running node's board, shared by the link and its jobs.
#[derive(Debug)]
pub struct Board {
    snapshot: Mutex<Snapshot>,
    changed: watch::Sender<u64>,
    journal: Option<PathBuf>,
}

impl Board {
    /// A board for `snapshot` whose journal lives in `data_dir` (`None`: no
    /// journal, for tests of the link alone).
    pub fn new(snapshot: Snapshot, data_dir: Option<&Path>) -> Arc<Self> {
        Arc::new(Self {
            snapshot: Mutex::new(snapshot),
            changed: watch::channel(0).0,
            journal: data_dir.map(|d| d.join(JOURNAL_FILE)),
        })
    }

    fn update(&self, f: impl FnOnce(&mut Snapshot)) {
        let mut s = self.snapshot.lock().unwrap_or_else(PoisonError::into_inner);
        f(&mut s);
        drop(s);
        self.changed.send_modify(|n| *n += 1);
    }

    /// A copy of the board now.
    pub fn snapshot(&self) -> Snapshot {
        self.snapshot
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }

    /// Keeps what the coordinator's `Welcome` said of the served models.
    pub fn set_outlook(&self, outlook: &[mlxnet_proto::v1::ModelOutlook]) {
        let views = outlook
            .iter()
            .map(|o| OutlookView {
                model: o.model.chars().take(128).collect(),
                price_output_micro_mlx_per_mtok: o.price_output_micro_mlx_per_mtok,
                nodes_serving: o.nodes_serving,
                demand_permille: o.demand_permille.min(1000),
            })
            .take(64)
            .collect();
        self.update(|s| s.outlook = views);
    }

    pub fn set_state(&self, state: &str, reason: &str) {
        self.update(|s| {
            s.state = state.to_owned();
            s.reason = reason.to_owned();
        });
    }

    pub fn job_started(&self, job_id: &str, model: &str) {
        self.update(|s| {
            s.jobs.retain(|j| j.job_id != job_id);
            s.jobs.push(RunningJob {
                job_id: job_id.to_owned(),
                model: model.to_owned(),
                started_ms: now_ms(),
                ..RunningJob::default()
            });
        });
    }

    pub fn job_tokens(&self, job_id: &str, n: usize) {
        let now = now_ms();
        self.update(|s| {
            if let Some(j) = s.jobs.iter_mut().find(|j| j.job_id == job_id) {
                if j.tokens == 0 {
                    j.first_token_ms = now;
                }
                j.tokens += n as u64;
                let secs = now.saturating_sub(j.first_token_ms) as f64 / 1e3;
                if secs > 0.0 {
                    j.tokens_per_s = (j.tokens.saturating_sub(1)) as f64 / secs;
                }
            }
        });
    }

    /// The job ended; `entry` (when it was signed) goes into the journal.
    pub fn job_finished(&self, job_id: &str, entry: Option<JournalEntry>) {
        self.update(|s| s.jobs.retain(|j| j.job_id != job_id));
        if let (Some(path), Some(entry)) = (&self.journal, entry) {
            if let Err(e) = append_journal(path, &entry) {
                tracing::warn!(path = %path.display(), error = %e, "cannot write the journal");
            }
        }
    }

    /// Writes the board to `path` on every change and every [`REFRESH`],
    /// until `stop`.
    pub async fn write_until(
        self: Arc<Self>,
        path: PathBuf,
        stop: tokio_util::sync::CancellationToken,
    ) {
        let mut changed = self.changed.subscribe();
        loop {
            let mut s = self.snapshot();
            s.updated_ms = now_ms();
            let p = path.clone();
            let written = tokio::task::spawn_blocking(move || write_atomic(&p, &s)).await;
            if let Ok(Err(e)) = written {
                tracing::warn!(path = %path.display(), error = %e, "cannot write the status board");
            }
            tokio::select! {
                _ = stop.cancelled() => break,
                _ = changed.changed() => {
                    // Coalesce bursts (a token batch per frame) into one write.
                    tokio::time::sleep(Duration::from_millis(200)).await;
                }
                _ = tokio::time::sleep(REFRESH) => {}
            }
        }
        self.update(|s| {
            s.state = "stopped".into();
            s.reason = String::new();
            s.jobs.clear();
        });
        let mut s = self.snapshot();
        s.updated_ms = now_ms();
        let _ = tokio::task::spawn_blocking(move || write_atomic(&path, &s)).await;
    }
}

fn write_atomic(path: &Path, s: &Snapshot) -> std::io::Result<()> {
    let tmp = path.with_extension("json.tmp");
    let bytes = serde_json::to_vec_pretty(s).map_err(std::io::Error::other)?;
    std::fs::write(&tmp, bytes)?;
    std::fs::rename(&tmp, path)
}

/// One finished (signed) job attempt.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct JournalEntry {
    pub ts_ms: u64,
    pub job_id: String,
    pub attempt: u32,
    pub model: String,
    pub prompt_tokens: u64,
    pub tokens: u64,
    pub finish: String,
    /// Measured energy of the attempt; absent without a meter.
    pub joules: Option<f64>,
}

fn append_journal(path: &Path, e: &JournalEntry) -> std::io::Result<()> {
    let mut line = serde_json::to_vec(e).map_err(std::io::Error::other)?;
    line.push(b'\n');
    std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(path)?
        .write_all(&line)
}

/// Jobs, tokens and energy over a period, from the journal.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Totals {
    pub jobs: u64,
    pub tokens: u64,
    pub joules: f64,
    /// Jobs in the period that carried an energy figure.
    pub metered_jobs: u64,
}

impl Totals {
    fn add(&mut self, e: &JournalEntry) {
        self.jobs += 1;
        self.tokens += e.tokens;
        if let Some(j) = e.joules {
            self.joules += j;
            self.metered_jobs += 1;
        }
    }
}

/// Today's (UTC) and this week's (since Monday 00:00 UTC) totals.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct JournalTotals {
    pub today: Totals,
    pub week: Totals,
    pub all_time: Totals,
}

const DAY_MS: u64 = 86_400_000;

/// Sums the journal's lines at `now_ms`; unreadable lines are skipped.
pub fn journal_totals(text: &str, now_ms: u64) -> JournalTotals {
    let today = now_ms - now_ms % DAY_MS;
    // 1970-01-01 was a Thursday: days since a Monday = (days + 3) % 7.
    let days = now_ms / DAY_MS;
    let monday = (days - (days + 3) % 7) * DAY_MS;
    let mut t = JournalTotals::default();
    for e in text
        .lines()
        .filter_map(|l| serde_json::from_str::<JournalEntry>(l).ok())
    {
        t.all_time.add(&e);
        if e.ts_ms >= monday {
            t.week.add(&e);
        }
        if e.ts_ms >= today {
            t.today.add(&e);
        }
    }
    t
}

/// Reads the board and the journal of `data_dir`.
pub fn read(data_dir: &Path) -> (Option<Snapshot>, JournalTotals) {
    let snapshot = std::fs::read(data_dir.join(STATUS_FILE))
        .ok()
        .and_then(|b| serde_json::from_slice(&b).ok());
    let journal = std::fs::read_to_string(data_dir.join(JOURNAL_FILE)).unwrap_or_default();
    (snapshot, journal_totals(&journal, now_ms()))
}

/// Earnings as the view shows them: the coordinator's answer or why not.
pub type EarningsView = Result<mlxnet_proto::v1::EarningsResponse, String>;

/// `micro` micro-MLX as MLX with six decimals.
pub fn mlx(micro: i64) -> String {
    let sign = if micro < 0 { "-" } else { "" };
    let m = micro.unsigned_abs();
    format!("{sign}{}.{:06}", m / 1_000_000, m % 1_000_000)
}

/// What `energy` joules cost at `price` micro-MLX per kWh, in micro-MLX.
pub fn energy_cost_micro(joules: f64, price_micro_per_kwh: u64) -> i64 {
    (joules / 3.6e6 * price_micro_per_kwh as f64).round() as i64
}

/// One frame of `mlx-node status`.
pub fn render(
    snapshot: Option<&Snapshot>,
    totals: &JournalTotals,
    earnings: Option<&EarningsView>,
    price_micro_per_kwh: u64,
    now_ms: u64,
) -> String {
    let mut out = String::new();
    let live = snapshot
        .filter(|s| s.state != "stopped" && now_ms.saturating_sub(s.updated_ms) <= STALE_MS);
    match (snapshot, live) {
        (_, Some(s)) => {
            let _ = writeln!(
                out,
                "mlx-node {} ({}), {}",
                s.name,
                short(&s.node_id),
                s.version
            );
            let state = if s.reason.is_empty() {
                s.state.clone()
            } else {
                format!("{}: {}", s.state, s.reason)
            };
            let _ = writeln!(out, "state      {state}");
            let _ = writeln!(out, "mode       {}   coordinator {}", s.mode, s.coordinator);
            let models: Vec<String> = s
                .models
                .iter()
                .map(|m| format!("{} ({}, {})", m.id, params(m.parameters), m.backend))
                .collect();
            let _ = writeln!(
                out,
                "models     {}",
                if models.is_empty() {
                    "none".into()
                } else {
                    models.join(", ")
                }
            );
            if s.jobs.is_empty() {
                let _ = writeln!(out, "job        none running");
            }
            for j in &s.jobs {
                let _ = writeln!(
                    out,
                    "job        {} on {}: {} tokens, {:.1} tokens/s",
                    j.job_id, j.model, j.tokens, j.tokens_per_s
                );
            }
            let meter = if s.energy_meter.is_empty() {
                "none"
            } else {
                s.energy_meter.as_str()
            };
            let _ = writeln!(out, "energy     meter {meter}");
        }
        (Some(s), None) => {
            let _ = writeln!(
                out,
                "mlx-node {} ({}): not running",
                s.name,
                short(&s.node_id)
            );
        }
        (None, None) => {
            let _ = writeln!(
                out,
                "mlx-node: not running (no status board in the data directory)"
            );
        }
    }
    let _ = writeln!(out, "\nwork (this node, from its journal; days in UTC)");
    for (label, t) in [
        ("today", totals.today),
        ("this week", totals.week),
        ("all time", totals.all_time),
    ] {
        let energy = if t.metered_jobs == 0 {
            "energy not measured".to_owned()
        } else {
            let per_token = if t.tokens > 0 {
                t.joules / t.tokens as f64
            } else {
                0.0
            };
            format!("{:.1} J ({:.3} J/token)", t.joules, per_token)
        };
        let _ = writeln!(
            out,
            "  {label:<10} {:>6} jobs {:>9} tokens   {energy}",
            t.jobs, t.tokens
        );
    }
    let _ = writeln!(out, "\nearnings (operator account)");
    match earnings {
        None => {
            let _ = writeln!(
                out,
                "  pass --api-key (the operator account's key) to see them"
            );
        }
        Some(Err(e)) => {
            let _ = writeln!(out, "  cannot read them: {e}");
        }
        Some(Ok(r)) => {
            for (label, p, t) in [
                ("today", r.today, totals.today),
                ("this week", r.week, totals.week),
                ("all time", r.all_time, totals.all_time),
            ] {
                let p = p.unwrap_or_default();
                let mut line = format!(
                    "  {label:<10} {:>14} MLX {:>6} jobs",
                    mlx(p.micro_mlx),
                    p.jobs
                );
                if price_micro_per_kwh > 0 && t.metered_jobs > 0 {
                    let cost = energy_cost_micro(t.joules, price_micro_per_kwh);
                    let _ = write!(
                        line,
                        "   net of energy {} MLX (energy {} MLX)",
                        mlx(p.micro_mlx - cost),
                        mlx(cost)
                    );
                }
                let _ = writeln!(out, "{line}");
            }
            let this = snapshot.map(|s| s.node_id.as_str()).unwrap_or_default();
            if let Some(n) = r
                .nodes
                .iter()
                .find(|n| !this.is_empty() && n.node_id == this)
            {
                let _ = writeln!(
                    out,
                    "  audits     {} passed, {} failed{}",
                    n.audits_passed,
                    n.audits_failed,
                    if n.banned {
                        " - banned: never placed again"
                    } else {
                        ""
                    }
                );
            }
            if r.next_reward_epoch_ms > 0 {
                let left = (r.next_reward_epoch_ms as u64).saturating_sub(now_ms);
                let _ = writeln!(
                    out,
                    "  rewards    this epoch ends in {} ({} UTC), paid after it",
                    minutes(left),
                    clock(r.next_reward_epoch_ms as u64)
                );
            }
        }
    }
    out
}

/// `ms` as "1h 05m" or "12m".
fn minutes(ms: u64) -> String {
    let m = ms.div_ceil(60_000);
    if m >= 60 {
        format!("{}h {:02}m", m / 60, m % 60)
    } else {
        format!("{m}m")
    }
}

/// The UTC time of day of `ms` since the Unix epoch, "HH:MM".
fn clock(ms: u64) -> String {
    let m = ms / 60_000 % (24 * 60);
    format!("{:02}:{:02}", m / 60, m % 60)
}

/// What serving `o`'s model could earn per hour: the decode speed the
/// memory bandwidth `bw` allows for a file of `size` bytes, at the model's
/// output price, times the network's demand now (the share of its job
/// slots busy). List price, before the network's fee; an estimate, not a
/// promise.
pub fn expected_earnings(o: &OutlookView, bw: u64, size: u64) -> String {
    let price = format!(
        "{} MLX per million tokens",
        mlx(o.price_output_micro_mlx_per_mtok.min(i64::MAX as u64) as i64)
    );
    let demand = f64::from(o.demand_permille.min(1000)) / 1000.0;
    let served_by = match o.nodes_serving {
        1 => "1 node serves it".to_owned(),
        n => format!("{n} nodes serve it"),
    };
    if bw == 0 || size == 0 {
        return format!(
            "earnings: {price}, demand {:.0}% of the network's job slots, {served_by}",
            demand * 100.0
        );
    }
    let tokens_per_hour = bw as f64 / size as f64 * 3600.0;
    let micro = tokens_per_hour * o.price_output_micro_mlx_per_mtok as f64 / 1e6 * demand;
    format!(
        "expected about {} MLX/hour at today's price ({price}) and demand ({:.0}% of the network's job slots busy; {served_by}), before the network's fee",
        mlx(micro.round() as i64),
        demand * 100.0
    )
}

fn short(id: &str) -> &str {
    id.get(..8).unwrap_or(id)
}

fn params(n: u64) -> String {
    match n {
        n if n >= 1_000_000_000 => format!("{:.1}B", n as f64 / 1e9),
        n if n >= 1_000_000 => format!("{}M", n / 1_000_000),
        n => n.to_string(),
    }
}

/// What `mlx-node run` prints once registered: what this machine can
/// serve and at what speed (decode bounded by memory bandwidth: the
/// measured figure of `mlx-node bench --save`, else the chip table's).
pub fn first_run_summary(s: &Snapshot, hw: &mlxnet_proto::v1::HardwareProfile) -> String {
    let mut out = String::new();
    let _ = writeln!(
        out,
        "registered {} ({}) with {}, lending {}",
        s.name,
        short(&s.node_id),
        s.coordinator,
        s.mode
    );
    let gib = hw.memory_bytes as f64 / (1u64 << 30) as f64;
    let _ = writeln!(
        out,
        "this machine: {} ({}), {gib:.0} GiB, {} cores{}",
        hw.chip,
        hw.model_name,
        hw.cpu_cores,
        if hw.gpu_cores > 0 {
            format!(", {}-core GPU", hw.gpu_cores)
        } else {
            String::new()
        }
    );
    let (bw, source) = if hw.measured_memory_bandwidth_bytes_per_s > 0 {
        (hw.measured_memory_bandwidth_bytes_per_s, "measured")
    } else {
        (hw.memory_bandwidth_bytes_per_s, "chip table")
    };
    for m in &s.models {
        let speed = if bw > 0 && m.size_bytes > 0 {
            format!(
                "up to about {:.0} tokens/s decoding ({source} bandwidth {:.0} GB/s)",
                bw as f64 / m.size_bytes as f64,
                bw as f64 / 1e9
            )
        } else {
            "speed unknown: run `mlx-node bench --save <data dir>/bench.json`".into()
        };
        let _ = writeln!(
            out,
            "serves {} ({}, on {}): {speed}",
            m.id,
            params(m.parameters),
            m.backend
        );
        if let Some(o) = s.outlook.iter().find(|o| o.model == m.id) {
            let _ = writeln!(out, "  {}", expected_earnings(o, bw, m.size_bytes));
        }
    }
    if s.models.is_empty() {
        let _ = writeln!(out, "serves no model: pass --model id=path");
    }
    let _ = writeln!(
        out,
        "earnings: `mlx-node status --api-key <operator key>` shows them live"
    );
    out
}

/// What `mlx-node status` needs.
#[derive(Debug, Clone)]
pub struct ViewArgs {
    pub data_dir: PathBuf,
    /// The coordinator's gRPC address and the operator key, for earnings.
    pub grpc: String,
    pub api_key: Option<String>,
    pub price_micro_per_kwh: u64,
    /// Draw one frame and return (no screen clearing).
    pub once: bool,
}

/// Runs the view: a frame a second (earnings asked every 10 s) until
/// Ctrl-C, or one frame with `once`.
pub async fn run_view(args: ViewArgs) -> std::io::Result<()> {
    let mut earnings: Option<EarningsView> = None;
    let mut asked: Option<std::time::Instant> = None;
    loop {
        if let Some(key) = &args.api_key {
            if asked.is_none_or(|t| t.elapsed() >= Duration::from_secs(10)) {
                asked = Some(std::time::Instant::now());
                earnings = Some(
                    crate::earnings::fetch(&args.grpc, key)
                        .await
                        .map_err(|e| e.to_string()),
                );
            }
        }
        let dir = args.data_dir.clone();
        let (snapshot, totals) = tokio::task::spawn_blocking(move || read(&dir))
            .await
            .map_err(std::io::Error::other)?;
        let frame = render(
            snapshot.as_ref(),
            &totals,
            earnings.as_ref(),
            args.price_micro_per_kwh,
            now_ms(),
        );
        let mut stdout = std::io::stdout().lock();
        if args.once {
            stdout.write_all(frame.as_bytes())?;
            return stdout.flush();
        }
        // Home, clear, frame.
        write!(stdout, "\x1b[H\x1b[2J{frame}\n(Ctrl-C to quit)")?;
        stdout.flush()?;
        drop(stdout);
        tokio::select! {
            _ = tokio::signal::ctrl_c() => return Ok(()),
            _ = tokio::time::sleep(Duration::from_secs(1)) => {}
        }
    }
}

#[cfg(test)]
mod tests;
