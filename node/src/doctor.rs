//! `mlx-node doctor`: what this machine lacks to lend well, in plain lines:
//! macOS too old for RDMA over Thunderbolt (26.2), RDMA not enabled (it is
//! switched on once in macOS Recovery with `rdma_ctl enable`), no
//! Thunderbolt 5, no GPU build, no energy meter, lending signals that cannot
//! be read; with `--pod`, the pod's cabling (`crate::pod::doctor`).
//!
//! The facts are gathered by running the tools (`sw_vers`, `rdma_ctl
//! status`, `ibv_devices`); [`report`] is a pure function of them, tested on
//! recorded output.
//!
//! # Failure
//! Nothing here fails: a tool that cannot run is itself a finding.

/// The first macOS with RDMA over Thunderbolt 5.
pub const RDMA_MACOS: (u32, u32) = (26, 2);

/// What the doctor looks at.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Facts {
    /// `sw_vers -productVersion` (macOS only).
    pub macos_version: Option<String>,
    /// `rdma_ctl status` output (macOS 26.2+), or why it could not run.
    pub rdma_ctl: Option<Result<String, String>>,
    /// `ibv_devices` output, when the tool ran.
    pub ibv_devices: Option<String>,
    /// The chip and whether it has Thunderbolt 5 (chip table).
    pub chip: String,
    pub thunderbolt5: bool,
    /// The devices this build can compute on ("metal", "cuda"), the CPU aside.
    pub gpu_features: Vec<&'static str>,
    /// The energy meter, or why there is none.
    pub energy: Result<String, String>,
    /// Lending signals that could not be read, with why.
    pub unreadable_signals: Vec<String>,
}

/// `26.2` -> (26, 2); `15.7.1` -> (15, 7).
pub fn parse_macos_version(text: &str) -> Option<(u32, u32)> {
    let mut parts = text.trim().split('.');
    let major = parts.next()?.parse().ok()?;
    let minor = parts.next().map_or(Some(0), |m| m.parse().ok())?;
    Some((major, minor))
}

/// Whether `rdma_ctl status` says RDMA is on ("enabled"; "disabled" or
/// "not enabled" is off).
pub fn rdma_enabled(status: &str) -> bool {
    let s = status.to_ascii_lowercase();
    s.contains("enabled") && !s.contains("disabled") && !s.contains("not enabled")
}

/// The report's lines: `ok  ...` or `MISSING  ...` with what to do.
pub fn report(f: &Facts) -> Vec<String> {
    let mut out = Vec::new();
    let ok = |out: &mut Vec<String>, s: String| out.push(format!("ok       {s}"));
    let missing = |out: &mut Vec<String>, s: String| out.push(format!("MISSING  {s}"));
    match f.macos_version.as_deref() {
        Some(v) => match parse_macos_version(v) {
            Some(ver) if ver >= RDMA_MACOS => ok(&mut out, format!("macOS {v} (RDMA over Thunderbolt needs 26.2)")),
            Some(_) => missing(
                &mut out,
                format!("macOS {v} is too old for RDMA over Thunderbolt: update to 26.2 or later (TCP pods still work)"),
            ),
            None => missing(&mut out, format!("cannot read the macOS version {v:?}")),
        },
        None => ok(&mut out, "not a Mac: no Metal, no RDMA over Thunderbolt; the CPU serves".into()),
    }
    if f.thunderbolt5 {
        ok(&mut out, format!("{} has Thunderbolt 5", f.chip));
    } else if f.macos_version.is_some() {
        missing(
            &mut out,
            format!(
                "{} has no Thunderbolt 5: pods run over TCP (pipeline parallel)",
                f.chip
            ),
        );
    }
    let devices = f
        .ibv_devices
        .as_deref()
        .and_then(|t| crate::pod::doctor::parse_ibv_devices(t).ok())
        .unwrap_or_default();
    match &f.rdma_ctl {
        Some(Ok(status)) if rdma_enabled(status) => ok(&mut out, "RDMA is enabled".into()),
        Some(Ok(_)) => missing(
            &mut out,
            "RDMA is not enabled: boot into macOS Recovery and run `rdma_ctl enable`".into(),
        ),
        Some(Err(e)) if f.macos_version.is_some() => {
            missing(&mut out, format!("cannot ask rdma_ctl: {e}"))
        }
        _ => {}
    }
    if devices.is_empty() {
        if f.thunderbolt5 {
            missing(
                &mut out,
                "no RDMA devices (ibv_devices lists none): RDMA off, or no Thunderbolt cable"
                    .into(),
            );
        }
    } else {
        let names: Vec<&str> = devices.iter().map(|d| d.name.as_str()).collect();
        ok(&mut out, format!("RDMA devices: {}", names.join(", ")));
    }
    if f.gpu_features.is_empty() {
        if f.macos_version.is_some() {
            missing(&mut out, "this mlx-node was built without `metal`: the GPU is unused (build with --features metal)".into());
        }
    } else {
        ok(
            &mut out,
            format!("GPU backends built in: {}", f.gpu_features.join(", ")),
        );
    }
    match &f.energy {
        Ok(m) => ok(&mut out, format!("energy measured with {m}")),
        Err(why) => missing(
            &mut out,
            format!("energy not measured ({why}): jobs carry no energy figure"),
        ),
    }
    for s in &f.unreadable_signals {
        missing(&mut out, format!("lending signal unreadable: {s}"));
    }
    out
}

/// Gathers the facts on this machine. Blocking.
pub fn gather(config: &crate::config::NodeConfig) -> Facts {
    let run = |cmd: &str, args: &[&str]| -> Result<String, String> {
        std::process::Command::new(cmd)
            .args(args)
            .output()
            .map_err(|e| format!("{cmd}: {e}"))
            .and_then(|o| {
                if o.status.success() {
                    Ok(String::from_utf8_lossy(&o.stdout).into_owned())
                } else {
                    Err(format!(
                        "{cmd}: {}",
                        String::from_utf8_lossy(&o.stderr).trim()
                    ))
                }
            })
    };
    let mac = cfg!(target_os = "macos");
    let profile = crate::hardware::detect().ok();
    let mut gpu_features = Vec::new();
    if cfg!(feature = "metal") {
        gpu_features.push("metal");
    }
    if cfg!(feature = "cuda") {
        gpu_features.push("cuda");
    }
    let energy = match crate::energy::open(&config.energy) {
        Some(m) => Ok(m.name().to_owned()),
        None => Err(if mac {
            "powermetrics needs root".into()
        } else {
            format!(
                "RAPL under {} is absent or not readable",
                config.energy.rapl_root.display()
            )
        }),
    };
    let mut unreadable_signals = Vec::new();
    let signals = crate::policy::SignalSource::read(&mut crate::policy::SystemSignals::default());
    if signals.idle.is_none() {
        unreadable_signals.push("idle time (idle mode would never lend)".into());
    }
    if mac && signals.power.is_none() {
        unreadable_signals.push("power source".into());
    }
    Facts {
        macos_version: if mac {
            run("sw_vers", &["-productVersion"])
                .ok()
                .map(|v| v.trim().to_owned())
        } else {
            None
        },
        rdma_ctl: mac.then(|| run("rdma_ctl", &["status"])),
        ibv_devices: run("ibv_devices", &[]).ok(),
        chip: profile.as_ref().map(|p| p.chip.clone()).unwrap_or_default(),
        thunderbolt5: profile.as_ref().is_some_and(|p| p.thunderbolt5),
        gpu_features,
        energy,
        unreadable_signals,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn mac() -> Facts {
        Facts {
            macos_version: Some("26.2".into()),
            rdma_ctl: Some(Ok("RDMA is enabled\n".into())),
            ibv_devices: Some(
                "    device          \t   node GUID\n    ------          \t----------------\n    rdma_en2        \t0000000000000000\n    rdma_en3        \t0000000000000000\n"
                    .into(),
            ),
            chip: "Apple M3 Ultra".into(),
            thunderbolt5: true,
            gpu_features: vec!["metal"],
            energy: Ok("powermetrics".into()),
            unreadable_signals: vec![],
        }
    }

    fn missing(f: &Facts) -> Vec<String> {
        report(f)
            .into_iter()
            .filter(|l| l.starts_with("MISSING"))
            .collect()
    }

    #[test]
    fn a_ready_mac_has_nothing_missing() {
        assert_eq!(
            missing(&mac()),
            Vec::<String>::new(),
            "{:?}",
            report(&mac())
        );
        assert!(report(&mac())
            .iter()
            .any(|l| l.contains("rdma_en2, rdma_en3")));
    }

    #[test]
    fn each_gap_is_named_with_its_fix() {
        let old = Facts {
            macos_version: Some("15.7.1".into()),
            ..mac()
        };
        assert!(
            missing(&old)[0].contains("too old for RDMA"),
            "{:?}",
            missing(&old)
        );
        let off = Facts {
            rdma_ctl: Some(Ok("RDMA is disabled\n".into())),
            ibv_devices: None,
            ..mac()
        };
        let m = missing(&off);
        assert!(m.iter().any(|l| l.contains("rdma_ctl enable")), "{m:?}");
        assert!(m.iter().any(|l| l.contains("no RDMA devices")), "{m:?}");
        let mini = Facts {
            chip: "Apple M4".into(),
            thunderbolt5: false,
            gpu_features: vec![],
            energy: Err("powermetrics needs root".into()),
            unreadable_signals: vec!["power source".into()],
            ..mac()
        };
        let m = missing(&mini);
        assert!(m.iter().any(|l| l.contains("no Thunderbolt 5")), "{m:?}");
        assert!(m.iter().any(|l| l.contains("--features metal")), "{m:?}");
        assert!(m.iter().any(|l| l.contains("energy not measured")), "{m:?}");
        assert!(m.iter().any(|l| l.contains("power source")), "{m:?}");
        assert_eq!(parse_macos_version("26.2"), Some((26, 2)));
        assert_eq!(parse_macos_version("27"), Some((27, 0)));
        assert_eq!(parse_macos_version("x"), None);
        assert!(!rdma_enabled("RDMA is not enabled"));
    }

    #[test]
    fn linux_reports_only_what_applies() {
        let linux = Facts {
            macos_version: None,
            rdma_ctl: None,
            ibv_devices: None,
            chip: "AMD EPYC".into(),
            thunderbolt5: false,
            gpu_features: vec![],
            energy: Err("RAPL under /sys/class/powercap is absent or not readable".into()),
            unreadable_signals: vec![],
        };
        let m = missing(&linux);
        assert_eq!(m.len(), 1, "{m:?}");
        assert!(m[0].contains("RAPL"), "{m:?}");
    }
}
