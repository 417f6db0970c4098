//! macOS signals: parsers for `ioreg -c IOHIDSystem -d 4` (`HIDIdleTime`,
//! nanoseconds since the last keyboard, mouse or trackpad input),
//! `pmset -g batt` (the power source) and `pmset -g therm` (thermal and CPU
//! speed limits), and (on macOS only) running them. None of them needs root.
//!
//! The parsers are pure and compiled everywhere; they are tested on recorded
//! output in `policy/samples/`.
//!
//! # Thermal levels
//! `pmset -g therm` prints "No thermal warning level has been recorded" or a
//! recorded level (IOKit's kIOPMThermalWarningLevel: 0 normal, 5 danger,
//! 10 crisis), and, once the CPU was limited, `CPU_Speed_Limit` (percent).
//! They map onto the thermal states macOS apps know (ProcessInfo's nominal,
//! fair, serious, critical): warning level >= 10 or a speed limit under 50%
//! is critical; level >= 5 or a limit under 80% serious; any limit under
//! 100% fair.
//!
//! # Failure
//! Output without the figure a parser looks for is [`SignalError::Parse`]
//! naming the command.

use std::time::Duration;

use super::{Power, SignalError, Thermal};

/// `HIDIdleTime` from `ioreg -c IOHIDSystem -d 4` (the first one printed).
pub fn parse_ioreg_idle(text: &str) -> Result<Duration, SignalError> {
    text.lines()
        .filter_map(|l| {
            let (key, value) = l.split_once('=')?;
            key.contains("\"HIDIdleTime\"").then(|| value.trim())
        })
        .find_map(|v| v.parse::<u64>().ok())
        .map(Duration::from_nanos)
        .ok_or(SignalError::Parse {
            command: "ioreg -c IOHIDSystem",
            reason: "no numeric HIDIdleTime".into(),
        })
}

/// The power source from `pmset -g batt`: its first line says "Now drawing
/// from 'AC Power'" (or 'Battery Power', 'UPS Power'); a battery line
/// carries the charge ("\t85%; discharging; ...").
pub fn parse_pmset_batt(text: &str) -> Result<Power, SignalError> {
    let bad = |reason: &str| SignalError::Parse {
        command: "pmset -g batt",
        reason: reason.into(),
    };
    let source = text
        .lines()
        .find_map(|l| l.trim().strip_prefix("Now drawing from"))
        .ok_or_else(|| bad("no `Now drawing from` line"))?
        .trim()
        .trim_matches('\'')
        .to_ascii_lowercase();
    let percent = text
        .lines()
        .filter(|l| l.contains("InternalBattery"))
        .find_map(|l| {
            let (before, _) = l.split_once('%')?;
            before
                .rsplit(|c: char| !c.is_ascii_digit())
                .next()?
                .parse::<u8>()
                .ok()
        });
    if source.starts_with("ac power") {
        Ok(Power::Ac)
    } else if source.starts_with("battery power") || source.starts_with("ups power") {
        Ok(Power::Battery { percent })
    } else {
        Err(bad("unknown power source"))
    }
}

/// The thermal state from `pmset -g therm` (see the module header).
pub fn parse_pmset_therm(text: &str) -> Result<Thermal, SignalError> {
    let mut warning: Option<u32> = None;
    let mut speed_limit: Option<u32> = None;
    let mut understood = false;
    for line in text.lines() {
        let l = line.trim();
        let lower = l.to_ascii_lowercase();
        if lower.contains("thermal warning level") {
            understood = true;
            if !lower.contains("no thermal warning level") {
                warning = l
                    .split(|c: char| !c.is_ascii_digit())
                    .rfind(|s| !s.is_empty())
                    .and_then(|s| s.parse().ok());
            }
        } else if let Some(rest) = l.strip_prefix("CPU_Speed_Limit") {
            understood = true;
            speed_limit = rest.trim().trim_start_matches('=').trim().parse().ok();
        } else if lower.contains("performance warning level") || l.starts_with("CPU_") {
            understood = true;
        }
    }
    if !understood {
        return Err(SignalError::Parse {
            command: "pmset -g therm",
            reason: "no thermal or CPU speed lines".into(),
        });
    }
    let level = warning.unwrap_or(0);
    let limit = speed_limit.unwrap_or(100);
    Ok(if level >= 10 || limit < 50 {
        Thermal::Critical
    } else if level >= 5 || limit < 80 {
        Thermal::Serious
    } else if limit < 100 {
        Thermal::Fair
    } else {
        Thermal::Nominal
    })
}

/// Reads the three signals by running the commands. Blocking.
#[cfg(target_os = "macos")]
pub fn read() -> (
    Result<Duration, SignalError>,
    Result<Power, SignalError>,
    Result<Thermal, SignalError>,
) {
    let idle = super::run_command("ioreg", &["-c", "IOHIDSystem", "-d", "4"])
        .and_then(|t| parse_ioreg_idle(&t));
    let power = super::run_command("pmset", &["-g", "batt"]).and_then(|t| parse_pmset_batt(&t));
    let thermal = super::run_command("pmset", &["-g", "therm"]).and_then(|t| parse_pmset_therm(&t));
    (idle, power, thermal)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample(name: &str) -> String {
        let path = format!("{}/src/policy/samples/{name}", env!("CARGO_MANIFEST_DIR"));
        std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{path}: {e}"))
    }

    #[test]
    fn idle_time_is_read_from_ioreg() {
        assert_eq!(
            parse_ioreg_idle(&sample("ioreg-idle-away.txt")).unwrap(),
            Duration::from_nanos(912_345_678_901)
        );
        assert!(
            parse_ioreg_idle(&sample("ioreg-idle-active.txt")).unwrap() < Duration::from_secs(1)
        );
        assert!(parse_ioreg_idle("+-o Root  <class IORegistryEntry>").is_err());
        assert!(parse_ioreg_idle("\"HIDIdleTime\" = <not a number>").is_err());
    }

    #[test]
    fn power_source_is_read_from_pmset_batt() {
        assert_eq!(
            parse_pmset_batt(&sample("pmset-batt-ac.txt")).unwrap(),
            Power::Ac
        );
        assert_eq!(
            parse_pmset_batt(&sample("pmset-batt-battery.txt")).unwrap(),
            Power::Battery { percent: Some(85) }
        );
        // A Mac Studio or mini has no battery line at all.
        assert_eq!(
            parse_pmset_batt(&sample("pmset-batt-desktop.txt")).unwrap(),
            Power::Ac
        );
        assert!(parse_pmset_batt("").is_err());
        assert!(parse_pmset_batt("Now drawing from 'Solar'").is_err());
    }

    #[test]
    fn thermal_state_is_read_from_pmset_therm() {
        assert_eq!(
            parse_pmset_therm(&sample("pmset-therm-nominal.txt")).unwrap(),
            Thermal::Nominal
        );
        assert_eq!(
            parse_pmset_therm(&sample("pmset-therm-limited.txt")).unwrap(),
            Thermal::Critical
        );
        assert_eq!(
            parse_pmset_therm(&sample("pmset-therm-warning.txt")).unwrap(),
            Thermal::Serious
        );
        assert_eq!(
            parse_pmset_therm("CPU_Speed_Limit \t= 90\n").unwrap(),
            Thermal::Fair
        );
        assert!(parse_pmset_therm("hello").is_err());
    }
}
