//! Lending policy: whether this machine takes jobs right now, and why not.
//!
//! The owner picks a mode ([`NodeMode`]): `dedicated` (always), `idle`
//! (only while the owner is away for `min_idle_s`) or `schedule` (the weekly
//! windows of `lending.schedule`), plus rules that hold in every mode: only
//! on AC power (`ac_only`), pause while the thermal state is serious or
//! critical (`thermal_pause`). The memory cap and the CPU/GPU shares limit
//! how much is lent; they are applied where the node reports memory and
//! runs the engine, not here.
//!
//! [`Policy::decide`] is a pure function of the [`Signals`]; the signals are
//! read by a [`SignalSource`]: the operating system ([`SystemSignals`]:
//! `ioreg`/`pmset` on macOS, logind and `/sys/class/power_supply` on Linux,
//! each parsed by a pure function in [`macos`] / [`linux`]), or values a
//! test or an embedding program injects ([`InjectedSignals`]). [`run`] polls
//! the source and publishes each new [`Decision`]; the link (`crate::link`)
//! stops taking jobs on a pause, hands running ones off after
//! `lending.grace_ms` and leaves, and comes back when lending resumes.
//!
//! # Invariants
//! - A signal that cannot be read never makes the node lend where it would
//!   not: an unknown idle time pauses `idle` mode; an unknown power source
//!   or thermal state pauses nothing (a desktop has no battery and Linux no
//!   thermal state).
//!
//! # Failure
//! [`SignalError`] says which command or file failed; it is logged once per
//! change, and the signal counts as unknown.

use std::path::PathBuf;
use std::time::Duration;

use tokio::sync::watch;

use crate::config::{LendingSettings, NodeMode};

pub mod linux;
pub mod macos;
mod schedule;

pub use schedule::{LocalTime, Schedule, ScheduleError};

/// Where the machine draws power from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Power {
    Ac,
    Battery { percent: Option<u8> },
}

/// The thermal state, as macOS names it (ProcessInfo.ThermalState).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Thermal {
    Nominal,
    Fair,
    Serious,
    Critical,
}

impl Thermal {
    pub fn as_str(&self) -> &'static str {
        match self {
            Thermal::Nominal => "nominal",
            Thermal::Fair => "fair",
            Thermal::Serious => "serious",
            Thermal::Critical => "critical",
        }
    }
}

/// What the policy decides from; `None` where the signal is unknown.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Signals {
    /// Time since the owner's last input.
    pub idle: Option<Duration>,
    pub power: Option<Power>,
    pub thermal: Option<Thermal>,
    pub now: LocalTime,
}

impl Signals {
    /// An owner away for good, on AC, cool, at `now`.
    pub fn away(now: LocalTime) -> Self {
        Self {
            idle: Some(Duration::MAX),
            power: Some(Power::Ac),
            thermal: Some(Thermal::Nominal),
            now,
        }
    }
}

/// Why lending is paused.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PauseReason {
    /// Idle mode: input less than `min_idle_s` ago.
    OwnerActive,
    /// Idle mode: the idle time cannot be read.
    IdleUnknown,
    OnBattery {
        percent: Option<u8>,
    },
    Hot(Thermal),
    /// Schedule mode: outside every window.
    OutsideSchedule,
}

impl std::fmt::Display for PauseReason {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let machine = if cfg!(target_os = "macos") {
            "the Mac"
        } else {
            "this machine"
        };
        match self {
            PauseReason::OwnerActive => write!(f, "you are using {machine}"),
            PauseReason::IdleUnknown => {
                write!(f, "cannot tell whether you are using {machine}")
            }
            PauseReason::OnBattery { percent: Some(p) } => write!(f, "on battery power ({p}%)"),
            PauseReason::OnBattery { percent: None } => f.write_str("on battery power"),
            PauseReason::Hot(t) => write!(f, "{machine} is hot (thermal state {})", t.as_str()),
            PauseReason::OutsideSchedule => f.write_str("outside the lending schedule"),
        }
    }
}

/// Lend, or pause and why.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Decision {
    Lend,
    Pause(PauseReason),
}

impl Decision {
    pub fn is_lend(&self) -> bool {
        matches!(self, Decision::Lend)
    }
}

/// The mode and the rules, ready to decide.
#[derive(Debug, Clone, PartialEq)]
pub struct Policy {
    mode: NodeMode,
    min_idle: Duration,
    ac_only: bool,
    thermal_pause: bool,
    schedule: Schedule,
}

impl Policy {
    pub fn new(mode: NodeMode, s: &LendingSettings) -> Result<Self, ScheduleError> {
        Ok(Self {
            mode,
            min_idle: Duration::from_secs(s.min_idle_s),
            ac_only: s.ac_only,
            thermal_pause: s.thermal_pause,
            schedule: Schedule::parse(&s.schedule)?,
        })
    }

    /// The decision for `s` (pure; see the module header).
    pub fn decide(&self, s: &Signals) -> Decision {
        if self.thermal_pause {
            if let Some(t @ (Thermal::Serious | Thermal::Critical)) = s.thermal {
                return Decision::Pause(PauseReason::Hot(t));
            }
        }
        if self.ac_only {
            if let Some(Power::Battery { percent }) = s.power {
                return Decision::Pause(PauseReason::OnBattery { percent });
            }
        }
        match self.mode {
            NodeMode::Dedicated => Decision::Lend,
            NodeMode::Idle => match s.idle {
                None => Decision::Pause(PauseReason::IdleUnknown),
                Some(idle) if idle < self.min_idle => Decision::Pause(PauseReason::OwnerActive),
                Some(_) => Decision::Lend,
            },
            NodeMode::Schedule => {
                if self.schedule.contains(s.now) {
                    Decision::Lend
                } else {
                    Decision::Pause(PauseReason::OutsideSchedule)
                }
            }
        }
    }
}

/// Why a signal could not be read.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum SignalError {
    #[error("cannot run `{command}`: {source}")]
    Spawn {
        command: String,
        source: std::io::Error,
    },
    #[error("`{command}` failed: {stderr}")]
    Failed { command: String, stderr: String },
    #[error("unexpected output of `{command}`: {reason}")]
    Parse {
        command: &'static str,
        reason: String,
    },
    #[error("cannot read {path}: {source}")]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
}

/// Runs `program args` and returns its stdout.
#[cfg_attr(not(any(target_os = "linux", target_os = "macos")), allow(dead_code))]
fn run_command(program: &str, args: &[&str]) -> Result<String, SignalError> {
    let command = format!("{program} {}", args.join(" "));
    let out = std::process::Command::new(program)
        .args(args)
        .output()
        .map_err(|source| SignalError::Spawn {
            command: command.clone(),
            source,
        })?;
    if !out.status.success() {
        return Err(SignalError::Failed {
            command,
            stderr: String::from_utf8_lossy(&out.stderr).trim().to_owned(),
        });
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// Reads the signals. Called on a blocking thread.
pub trait SignalSource: Send + 'static {
    fn read(&mut self) -> Signals;
}

/// The operating system's signals.
#[derive(Debug)]
pub struct SystemSignals {
    /// `/sys/class/power_supply` (Linux).
    pub power_root: PathBuf,
    /// The last error per signal, so each is logged once, not every poll.
    last_errors: [Option<String>; 3],
}

impl Default for SystemSignals {
    fn default() -> Self {
        Self {
            power_root: PathBuf::from("/sys/class/power_supply"),
            last_errors: Default::default(),
        }
    }
}

impl SystemSignals {
    fn keep<T>(&mut self, slot: usize, what: &str, r: Result<T, SignalError>) -> Option<T> {
        match r {
            Ok(v) => {
                self.last_errors[slot] = None;
                Some(v)
            }
            Err(e) => {
                let text = e.to_string();
                if self.last_errors[slot].as_deref() != Some(&text) {
                    tracing::warn!(signal = what, error = %text, "lending signal unreadable");
                    self.last_errors[slot] = Some(text);
                }
                None
            }
        }
    }
}

impl SignalSource for SystemSignals {
    fn read(&mut self) -> Signals {
        let now = LocalTime::now();
        #[cfg(target_os = "macos")]
        {
            let (idle, power, thermal) = macos::read();
            Signals {
                idle: self.keep(0, "idle", idle),
                power: self.keep(1, "power", power),
                thermal: self.keep(2, "thermal", thermal),
                now,
            }
        }
        #[cfg(target_os = "linux")]
        {
            let (idle, power) = linux::read(&self.power_root);
            Signals {
                idle: self.keep(0, "idle", idle),
                power: self.keep(1, "power", power),
                thermal: None,
                now,
            }
        }
        #[cfg(not(any(target_os = "linux", target_os = "macos")))]
        {
            let _ = self.keep::<()>(
                0,
                "idle",
                Err(SignalError::Parse {
                    command: "none",
                    reason: format!("no idle signal on {}", std::env::consts::OS),
                }),
            );
            Signals {
                idle: None,
                power: None,
                thermal: None,
                now,
            }
        }
    }
}

/// Signals set from outside (tests, or a program embedding the node): the
/// latest value sent on the paired [`watch::Sender`].
#[derive(Debug)]
pub struct InjectedSignals(watch::Receiver<Signals>);

impl InjectedSignals {
    /// A source starting at `first`, and the sender that changes it.
    pub fn new(first: Signals) -> (watch::Sender<Signals>, Self) {
        let (tx, rx) = watch::channel(first);
        (tx, Self(rx))
    }
}

impl SignalSource for InjectedSignals {
    fn read(&mut self) -> Signals {
        *self.0.borrow_and_update()
    }
}

/// The published decision: `None` until the signals were first read.
pub type Lending = watch::Receiver<Option<Decision>>;

/// Reads `source` every `poll` and publishes each changed decision on `tx`,
/// until every receiver is gone or `stop` is cancelled.
pub async fn run(
    policy: Policy,
    mut source: Box<dyn SignalSource>,
    poll: Duration,
    tx: watch::Sender<Option<Decision>>,
    stop: tokio_util::sync::CancellationToken,
) {
    loop {
        let read = tokio::task::spawn_blocking(move || {
            let s = source.read();
            (source, s)
        })
        .await;
        let Ok((back, signals)) = read else {
            tracing::error!("reading the lending signals panicked; lending stays as it was");
            return;
        };
        source = back;
        let decision = policy.decide(&signals);
        tx.send_if_modified(|d| {
            if d.as_ref() == Some(&decision) {
                return false;
            }
            match &decision {
                Decision::Lend => tracing::info!("lending: taking jobs"),
                Decision::Pause(why) => tracing::info!(reason = %why, "lending paused"),
            }
            *d = Some(decision.clone());
            true
        });
        if tx.is_closed() {
            return;
        }
        tokio::select! {
            _ = stop.cancelled() => return,
            _ = tokio::time::sleep(poll) => {}
        }
    }
}

#[cfg(test)]
mod tests;
