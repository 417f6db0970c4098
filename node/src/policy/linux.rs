//! Linux signals: the owner's idle time from logind's idle hints
//! (`loginctl show-session`), and the power source from
//! `/sys/class/power_supply`. (Linux has no thermal state to read here:
//! the thermal rule never pauses a Linux node.)
//!
//! # Idle time
//! logind keeps, per session, `IdleHint` (the desktop or, for a text
//! console, logind itself says the session is idle) and `IdleSinceHint`
//! (microseconds since the epoch when that last changed). The owner is away
//! for as long as every user session is idle: the idle time is the shortest
//! `now - IdleSinceHint` over them, zero if any one is active. A machine
//! without user sessions (a server nobody is logged in to) is idle for good.
//!
//! # Power
//! On mains when a `Mains` (or `USB`) supply is online, or no supply exists
//! at all (a desktop or a server); on battery when a battery discharges and
//! no mains supply is online.
//!
//! # Failure
//! A session block without `IdleHint`, or a supply directory whose files
//! cannot be read, is a [`SignalError`].

use std::path::Path;
use std::time::Duration;

use super::{Power, SignalError};

/// One session from `loginctl show-session -p Id -p Class -p IdleHint -p IdleSinceHint`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LogindSession {
    pub id: String,
    /// "user", "greeter", "lock-screen", "background", ...
    pub class: String,
    pub idle_hint: bool,
    /// Microseconds since the Unix epoch; 0 when never set.
    pub idle_since_us: u64,
}

/// Parses `loginctl show-session ID... -p ...`: `Key=Value` lines, one
/// blank-line-separated block per session.
pub fn parse_logind_sessions(text: &str) -> Result<Vec<LogindSession>, SignalError> {
    let bad = |reason: String| SignalError::Parse {
        command: "loginctl show-session",
        reason,
    };
    let mut out = Vec::new();
    for block in text.split("\n\n").filter(|b| !b.trim().is_empty()) {
        let mut s = (String::new(), String::new(), None, 0u64);
        for line in block.lines() {
            let Some((k, v)) = line.trim().split_once('=') else {
                continue;
            };
            match k {
                "Id" => s.0 = v.to_owned(),
                "Class" => s.1 = v.to_owned(),
                "IdleHint" => s.2 = Some(v == "yes"),
                "IdleSinceHint" => {
                    s.3 = v
                        .parse()
                        .map_err(|_| bad(format!("IdleSinceHint {v:?} is not a number")))?
                }
                _ => {}
            }
        }
        let idle_hint =
            s.2.ok_or_else(|| bad(format!("session {:?} has no IdleHint", s.0)))?;
        out.push(LogindSession {
            id: s.0,
            class: s.1,
            idle_hint,
            idle_since_us: s.3,
        });
    }
    Ok(out)
}

/// Session ids from `loginctl list-sessions --no-legend` (first column).
pub fn parse_session_ids(text: &str) -> Vec<String> {
    text.lines()
        .filter_map(|l| l.split_whitespace().next())
        .map(str::to_owned)
        .collect()
}

/// How long the owner has been away at `now_us` (see the module header).
pub fn idle_time(sessions: &[LogindSession], now_us: u64) -> Duration {
    let users: Vec<&LogindSession> = sessions.iter().filter(|s| s.class == "user").collect();
    if users.is_empty() {
        return Duration::MAX;
    }
    users
        .iter()
        .map(|s| {
            if s.idle_hint {
                Duration::from_micros(now_us.saturating_sub(s.idle_since_us))
            } else {
                Duration::ZERO
            }
        })
        .min()
        .unwrap_or(Duration::ZERO)
}

/// One entry of `/sys/class/power_supply`.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Supply {
    pub name: String,
    /// `type`: "Mains", "Battery", "USB", "UPS", ...
    pub kind: String,
    /// `online` (mains, USB): 1 when connected.
    pub online: Option<bool>,
    /// `status` (batteries): "Charging", "Discharging", "Full", "Not charging".
    pub status: Option<String>,
    /// `capacity` (batteries): percent.
    pub capacity: Option<u8>,
}

/// Reads every supply under `root` (normally `/sys/class/power_supply`).
/// A missing root is no supplies.
pub fn read_supplies(root: &Path) -> Result<Vec<Supply>, SignalError> {
    let entries = match std::fs::read_dir(root) {
        Ok(e) => e,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(source) => {
            return Err(SignalError::Read {
                path: root.to_owned(),
                source,
            })
        }
    };
    let mut out = Vec::new();
    for entry in entries.flatten() {
        let dir = entry.path();
        let read = |f: &str| {
            std::fs::read_to_string(dir.join(f))
                .ok()
                .map(|s| s.trim().to_owned())
        };
        let Some(kind) = read("type") else { continue };
        out.push(Supply {
            name: entry.file_name().to_string_lossy().into_owned(),
            kind,
            online: read("online").map(|v| v == "1"),
            status: read("status"),
            capacity: read("capacity").and_then(|v| v.parse().ok()),
        });
    }
    out.sort_by(|a, b| a.name.cmp(&b.name));
    Ok(out)
}

/// The power source the supplies describe (see the module header).
pub fn power_from_supplies(supplies: &[Supply]) -> Power {
    let mains_online = supplies
        .iter()
        .any(|s| matches!(s.kind.as_str(), "Mains" | "USB") && s.online == Some(true));
    let discharging = supplies
        .iter()
        .find(|s| s.kind == "Battery" && s.status.as_deref() == Some("Discharging"));
    match discharging {
        Some(b) if !mains_online => Power::Battery {
            percent: b.capacity,
        },
        _ => Power::Ac,
    }
}

/// Reads idle time and power on this machine. Blocking.
#[cfg(target_os = "linux")]
pub fn read(power_root: &Path) -> (Result<Duration, SignalError>, Result<Power, SignalError>) {
    let idle = super::run_command("loginctl", &["list-sessions", "--no-legend"]).and_then(|list| {
        let ids = parse_session_ids(&list);
        if ids.is_empty() {
            return Ok(Duration::MAX);
        }
        let mut args = vec!["show-session"];
        args.extend(ids.iter().map(String::as_str));
        args.extend([
            "-p",
            "Id",
            "-p",
            "Class",
            "-p",
            "IdleHint",
            "-p",
            "IdleSinceHint",
        ]);
        let sessions = parse_logind_sessions(&super::run_command("loginctl", &args)?)?;
        let now_us = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_micros() as u64)
            .unwrap_or(0);
        Ok(idle_time(&sessions, now_us))
    });
    let power = read_supplies(power_root).map(|s| power_from_supplies(&s));
    (idle, power)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn samples() -> std::path::PathBuf {
        Path::new(env!("CARGO_MANIFEST_DIR")).join("src/policy/samples")
    }

    #[test]
    fn logind_idle_hints_give_the_owners_idle_time() {
        let text = std::fs::read_to_string(samples().join("loginctl-show-session.txt")).unwrap();
        let sessions = parse_logind_sessions(&text).unwrap();
        assert_eq!(sessions.len(), 3);
        assert_eq!(sessions[0].id, "2");
        assert!(sessions[0].idle_hint);
        assert_eq!(sessions[0].idle_since_us, 1_733_050_000_000_000);
        // The greeter does not count; the two user sessions are idle since
        // 1733050000 s and 1733050600 s: away for the shorter of the two.
        let now = 1_733_051_200_000_000;
        assert_eq!(idle_time(&sessions, now), Duration::from_secs(600));
        // One active user session: the owner is here.
        let mut active = sessions.clone();
        active[2].idle_hint = false;
        assert_eq!(idle_time(&active, now), Duration::ZERO);
        // Nobody logged in: a server is idle for good.
        assert_eq!(idle_time(&sessions[1..2], now), Duration::MAX);
        assert_eq!(idle_time(&[], now), Duration::MAX);
        assert!(parse_logind_sessions("Id=4\nClass=user\n").is_err());
        assert!(parse_logind_sessions("Id=4\nIdleHint=no\nIdleSinceHint=soon\n").is_err());
        assert_eq!(
            parse_session_ids("      2   1000 ada  seat0 tty2\n      7   1001 bob        \n"),
            vec!["2", "7"]
        );
    }

    #[test]
    fn power_supplies_say_mains_or_battery() {
        let power = |case: &str| {
            power_from_supplies(&read_supplies(&samples().join("power_supply").join(case)).unwrap())
        };
        assert_eq!(power("laptop-on-ac"), Power::Ac);
        assert_eq!(
            power("laptop-on-battery"),
            Power::Battery { percent: Some(41) }
        );
        // No supplies at all (this VM, a desktop, a server): mains.
        assert_eq!(power("none"), Power::Ac);
        assert_eq!(
            read_supplies(&samples().join("power_supply/absent")).unwrap(),
            Vec::new()
        );
        let s = read_supplies(&samples().join("power_supply/laptop-on-battery")).unwrap();
        assert_eq!(s.len(), 2);
        assert_eq!((s[0].name.as_str(), s[0].kind.as_str()), ("AC", "Mains"));
    }
}
