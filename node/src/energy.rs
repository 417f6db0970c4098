//! The energy the machine uses while it runs a job: RAPL counters under
//! `/sys/class/powercap` on Linux (when readable; since 2020 kernels make
//! `energy_uj` root-only), `powermetrics`' power samples on macOS (when the
//! node may run it, i.e. as root). Both parsers are pure functions tested on
//! recorded samples (`energy/samples/`).
//!
//! A meter is a cumulative counter ([`EnergyMeter::joules`]); a job's energy
//! is the difference between its end and its start ([`Span`]). It is the
//! whole package's (CPU + GPU + memory controller on Apple silicon, the CPU
//! packages under RAPL) energy over the job, idle draw included: what the
//! owner pays for while the job runs. With several jobs at once each span
//! sees all of it; the node divides by the jobs running at the end.
//!
//! # Failure
//! [`EnergyError`] says which file or command failed. A meter that cannot
//! be opened is no meter: jobs then carry no energy, and `mlx-node doctor`
//! says why.

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use crate::config::{EnergySettings, MeterKind};

/// Why energy cannot be measured.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum EnergyError {
    #[error("no RAPL package domain under {0}")]
    NoRapl(PathBuf),
    #[error("cannot read {path}: {source}")]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{path}: {reason}")]
    Parse { path: PathBuf, reason: String },
    #[error("cannot run powermetrics: {0}")]
    Powermetrics(String),
    #[error("the {0} meter does not exist on this system")]
    Unsupported(&'static str),
}

/// A cumulative energy counter.
pub trait EnergyMeter: Send + Sync {
    /// Joules since the meter was opened.
    fn joules(&self) -> Result<f64, EnergyError>;
    /// "rapl" or "powermetrics".
    fn name(&self) -> &'static str;
}

/// A job's energy so far: the meter's reading when it started.
pub struct Span {
    meter: Arc<dyn EnergyMeter>,
    start: f64,
}

impl Span {
    pub fn start(meter: &Arc<dyn EnergyMeter>) -> Option<Self> {
        match meter.joules() {
            Ok(start) => Some(Self {
                meter: meter.clone(),
                start,
            }),
            Err(e) => {
                tracing::warn!(error = %e, "energy meter unreadable");
                None
            }
        }
    }

    /// Joules since the start (0 if the meter stopped answering).
    pub fn joules(&self) -> f64 {
        self.meter
            .joules()
            .map(|j| (j - self.start).max(0.0))
            .unwrap_or(0.0)
    }

    pub fn meter_name(&self) -> &'static str {
        self.meter.name()
    }
}

/// Opens the meter the settings ask for; `None` (with the reason logged)
/// when there is none.
pub fn open(settings: &EnergySettings) -> Option<Arc<dyn EnergyMeter>> {
    let r: Result<Arc<dyn EnergyMeter>, EnergyError> = match settings.meter {
        MeterKind::None => return None,
        MeterKind::Rapl => Rapl::open(&settings.rapl_root).map(|m| Arc::new(m) as _),
        MeterKind::Powermetrics => open_powermetrics(),
        MeterKind::Auto => {
            if cfg!(target_os = "macos") {
                open_powermetrics()
            } else {
                Rapl::open(&settings.rapl_root).map(|m| Arc::new(m) as _)
            }
        }
    };
    match r {
        Ok(m) => {
            tracing::info!(meter = m.name(), "measuring the energy of jobs");
            Some(m)
        }
        Err(e) => {
            tracing::info!(reason = %e, "not measuring energy");
            None
        }
    }
}

// ------------------------------------------------------------------ RAPL

/// One RAPL package domain: its counter and the value it wraps at.
#[derive(Debug)]
struct Domain {
    counter: PathBuf,
    max_range_uj: u64,
    /// Last raw reading.
    last_uj: u64,
}

/// Linux RAPL (`intel-rapl:N/energy_uj`, the package domains; their
/// sub-domains `intel-rapl:N:M` are parts of them and not added again).
#[derive(Debug)]
pub struct Rapl {
    domains: Mutex<(Vec<Domain>, f64)>,
}

/// Parses a counter file (`energy_uj`, `max_energy_range_uj`): a decimal
/// number of microjoules and a newline.
pub fn parse_counter(path: &Path, text: &str) -> Result<u64, EnergyError> {
    text.trim().parse().map_err(|_| EnergyError::Parse {
        path: path.to_owned(),
        reason: format!("{:?} is not a number of microjoules", text.trim()),
    })
}

fn read_counter(path: &Path) -> Result<u64, EnergyError> {
    let text = std::fs::read_to_string(path).map_err(|source| EnergyError::Read {
        path: path.to_owned(),
        source,
    })?;
    parse_counter(path, &text)
}

/// Microjoules from `last` to `now` on a counter that wraps at `max_range`.
pub fn counter_delta(last: u64, now: u64, max_range: u64) -> u64 {
    if now >= last {
        now - last
    } else {
        max_range.saturating_sub(last) + now
    }
}

impl Rapl {
    /// Finds the package domains under `root` and reads each once (so an
    /// unreadable counter fails here, not mid-job).
    pub fn open(root: &Path) -> Result<Self, EnergyError> {
        let entries = std::fs::read_dir(root).map_err(|source| EnergyError::Read {
            path: root.to_owned(),
            source,
        })?;
        let mut dirs: Vec<PathBuf> = entries
            .flatten()
            .map(|e| e.path())
            .filter(|p| {
                p.file_name()
                    .and_then(|n| n.to_str())
                    .and_then(|n| n.strip_prefix("intel-rapl:"))
                    .is_some_and(|rest| !rest.contains(':'))
            })
            .collect();
        dirs.sort();
        let mut domains = Vec::new();
        for dir in dirs {
            let counter = dir.join("energy_uj");
            let last_uj = read_counter(&counter)?;
            let max_range_uj = read_counter(&dir.join("max_energy_range_uj"))?;
            domains.push(Domain {
                counter,
                max_range_uj,
                last_uj,
            });
        }
        if domains.is_empty() {
            return Err(EnergyError::NoRapl(root.to_owned()));
        }
        Ok(Self {
            domains: Mutex::new((domains, 0.0)),
        })
    }
}

impl EnergyMeter for Rapl {
    fn joules(&self) -> Result<f64, EnergyError> {
        let mut guard = self.domains.lock().unwrap_or_else(PoisonError::into_inner);
        let (domains, total) = &mut *guard;
        for d in domains.iter_mut() {
            let now = read_counter(&d.counter)?;
            *total += counter_delta(d.last_uj, now, d.max_range_uj) as f64 / 1e6;
            d.last_uj = now;
        }
        Ok(*total)
    }

    fn name(&self) -> &'static str {
        "rapl"
    }
}

// ------------------------------------------------------------------ powermetrics

/// One `powermetrics` sample: how long it covered and the average combined
/// (CPU + GPU + ANE) power over it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct PowerSample {
    pub elapsed: Duration,
    pub milliwatts: f64,
}

impl PowerSample {
    pub fn joules(&self) -> f64 {
        self.milliwatts / 1e3 * self.elapsed.as_secs_f64()
    }
}

/// Reads `powermetrics --samplers cpu_power,gpu_power` text output line by
/// line. Each sample starts with `*** Sampled system activity (<date>)
/// (<ms>ms elapsed) ***`; its power is the `Combined Power (CPU + GPU +
/// ANE): N mW` line, or the sum of the `CPU Power`, `GPU Power` and `ANE
/// Power` lines on machines that print no combined figure.
#[derive(Debug, Default)]
pub struct PowermetricsParser {
    elapsed: Option<Duration>,
    parts: [Option<f64>; 3],
}

fn milliwatts(rest: &str) -> Option<f64> {
    let v = rest.trim().strip_suffix("mW")?.trim();
    v.parse().ok()
}

impl PowermetricsParser {
    /// Feeds one line; returns a sample when one is complete.
    pub fn line(&mut self, line: &str) -> Option<PowerSample> {
        let l = line.trim();
        if l.starts_with("*** Sampled system activity") {
            let done = self.flush();
            self.elapsed = l
                .rsplit_once("ms elapsed")
                .and_then(|(before, _)| before.rsplit_once('('))
                .and_then(|(_, ms)| ms.trim().parse::<f64>().ok())
                .map(|ms| Duration::from_secs_f64(ms / 1e3));
            return done;
        }
        if let Some(rest) = l.strip_prefix("Combined Power (CPU + GPU + ANE):") {
            let mw = milliwatts(rest)?;
            let elapsed = self.elapsed.take()?;
            self.parts = [None; 3];
            return Some(PowerSample {
                elapsed,
                milliwatts: mw,
            });
        }
        for (i, key) in ["CPU Power:", "GPU Power:", "ANE Power:"]
            .iter()
            .enumerate()
        {
            if let Some(rest) = l.strip_prefix(key) {
                if self.parts[i].is_none() {
                    self.parts[i] = milliwatts(rest);
                }
            }
        }
        None
    }

    /// The sample in progress, if its power lines were seen (at the end of
    /// the output, or when the next sample starts).
    pub fn flush(&mut self) -> Option<PowerSample> {
        let parts = std::mem::take(&mut self.parts);
        let elapsed = self.elapsed.take()?;
        if parts.iter().all(Option::is_none) {
            return None;
        }
        Some(PowerSample {
            elapsed,
            milliwatts: parts.iter().flatten().sum(),
        })
    }
}

/// Every sample in a recorded `powermetrics` output.
pub fn parse_powermetrics(text: &str) -> Vec<PowerSample> {
    let mut p = PowermetricsParser::default();
    let mut out: Vec<PowerSample> = text.lines().filter_map(|l| p.line(l)).collect();
    out.extend(p.flush());
    out
}

/// The energy `powermetrics` has reported so far (fed by its reader thread).
#[derive(Debug, Default)]
pub struct SampledEnergy {
    joules: Mutex<f64>,
}

impl SampledEnergy {
    pub fn add(&self, s: &PowerSample) {
        *self.joules.lock().unwrap_or_else(PoisonError::into_inner) += s.joules();
    }
}

impl EnergyMeter for SampledEnergy {
    fn joules(&self) -> Result<f64, EnergyError> {
        Ok(*self.joules.lock().unwrap_or_else(PoisonError::into_inner))
    }

    fn name(&self) -> &'static str {
        "powermetrics"
    }
}

/// Starts `powermetrics` sampling every 500 ms and a thread adding its
/// samples up. It runs as long as the node.
#[cfg(target_os = "macos")]
fn open_powermetrics() -> Result<Arc<dyn EnergyMeter>, EnergyError> {
    use std::io::{BufRead, BufReader};
    let mut child = std::process::Command::new("powermetrics")
        .args(["--samplers", "cpu_power,gpu_power", "-i", "500"])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .map_err(|e| EnergyError::Powermetrics(e.to_string()))?;
    let stdout = child
        .stdout
        .take()
        .ok_or_else(|| EnergyError::Powermetrics("no output".into()))?;
    let mut lines = BufReader::new(stdout).lines();
    // The first line says whether it may run at all (it needs root).
    let mut parser = PowermetricsParser::default();
    match lines.next() {
        Some(Ok(first)) => {
            let _ = parser.line(&first);
        }
        _ => {
            let mut err = String::new();
            if let Some(mut e) = child.stderr.take() {
                let _ = std::io::Read::read_to_string(&mut e, &mut err);
            }
            let _ = child.wait();
            return Err(EnergyError::Powermetrics(if err.trim().is_empty() {
                "it printed nothing (it needs root)".into()
            } else {
                err.trim().to_owned()
            }));
        }
    }
    let meter = Arc::new(SampledEnergy::default());
    let sink = meter.clone();
    std::thread::spawn(move || {
        for line in lines.map_while(Result::ok) {
            if let Some(s) = parser.line(&line) {
                sink.add(&s);
            }
        }
        let _ = child.wait();
    });
    Ok(meter)
}

#[cfg(not(target_os = "macos"))]
fn open_powermetrics() -> Result<Arc<dyn EnergyMeter>, EnergyError> {
    Err(EnergyError::Unsupported("powermetrics"))
}

#[cfg(test)]
mod tests;
