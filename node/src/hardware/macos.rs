//! macOS: parsers for `sysctl -n hw.memsize hw.ncpu hw.perflevel0.physicalcpu
//! machdep.cpu.brand_string`, `system_profiler SPHardwareDataType
//! SPDisplaysDataType -json`, `vm_stat` and `sw_vers -productVersion`, and (on
//! macOS only) running them.
//!
//! `sysctl` gives exact byte and core counts; `system_profiler` gives the
//! marketing names (chip "Apple M3 Ultra", model "Mac Studio") and the GPU
//! core count (`sppci_cores`), which nothing else reports.
//!
//! # Failure
//! Output that lacks a figure we need is a [`HardwareError::Parse`] naming
//! the command and the field; a command that cannot run or exits non-zero is
//! [`HardwareError::Spawn`] / [`HardwareError::CommandFailed`].

use mlxnet_proto::v1::HardwareProfile;
use serde_json::Value;

use super::HardwareError;

/// The `sysctl` figures.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Sysctl {
    pub memory_bytes: u64,
    pub cpu_cores: u32,
    /// `hw.perflevel0.physicalcpu`: absent on Intel Macs.
    pub performance_cores: Option<u32>,
    pub brand: String,
}

/// The `system_profiler` figures.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct SystemProfile {
    /// `chip_type` ("Apple M3 Ultra"); Intel Macs have `cpu_type` instead.
    pub chip: Option<String>,
    /// `machine_name` ("Mac Studio").
    pub model_name: Option<String>,
    /// `sppci_cores` of the built-in GPU.
    pub gpu_cores: Option<u32>,
    /// `number_processors` "proc 32:24:8" -> (total, performance, efficiency).
    pub processors: Option<(u32, u32, u32)>,
}

/// Parses `sysctl -n hw.memsize hw.ncpu hw.perflevel0.physicalcpu
/// machdep.cpu.brand_string`: one value per line, in that order. On Intel
/// Macs the perflevel key is unknown and its line is missing.
pub fn parse_sysctl(text: &str) -> Result<Sysctl, HardwareError> {
    let lines: Vec<&str> = text
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty())
        .collect();
    let what = "sysctl output";
    let num = |s: &str, field: &str| -> Result<u64, HardwareError> {
        s.parse()
            .map_err(|_| HardwareError::parse(what, format!("{field} is not a number: {s:?}")))
    };
    let (mem, ncpu, perf, brand) = match lines.as_slice() {
        [mem, ncpu, perf, brand] => (*mem, *ncpu, Some(*perf), *brand),
        [mem, ncpu, brand] => (*mem, *ncpu, None, *brand),
        _ => {
            return Err(HardwareError::parse(
                what,
                format!("expected 3 or 4 lines, got {}", lines.len()),
            ))
        }
    };
    let to_u32 = |v: u64, field: &str| {
        u32::try_from(v)
            .map_err(|_| HardwareError::parse(what, format!("{field} out of range: {v}")))
    };
    Ok(Sysctl {
        memory_bytes: num(mem, "hw.memsize")?,
        cpu_cores: to_u32(num(ncpu, "hw.ncpu")?, "hw.ncpu")?,
        performance_cores: perf
            .map(|p| {
                num(p, "hw.perflevel0.physicalcpu")
                    .and_then(|v| to_u32(v, "hw.perflevel0.physicalcpu"))
            })
            .transpose()?,
        brand: brand.to_owned(),
    })
}

/// Parses `system_profiler SPHardwareDataType SPDisplaysDataType -json`.
pub fn parse_system_profiler(json: &str) -> Result<SystemProfile, HardwareError> {
    let what = "system_profiler output";
    let root: Value =
        serde_json::from_str(json).map_err(|e| HardwareError::parse(what, e.to_string()))?;
    let hw = root
        .get("SPHardwareDataType")
        .and_then(Value::as_array)
        .and_then(|a| a.first())
        .ok_or_else(|| HardwareError::parse(what, "no SPHardwareDataType entry"))?;
    let text = |v: &Value, key: &str| {
        v.get(key)
            .and_then(Value::as_str)
            .map(str::trim)
            .filter(|s| !s.is_empty())
            .map(str::to_owned)
    };
    let chip = text(hw, "chip_type").or_else(|| text(hw, "cpu_type"));
    let model_name = text(hw, "machine_name");
    let processors = text(hw, "number_processors").and_then(|s| parse_processors(&s));
    // The built-in GPU (Apple silicon has exactly one); else the first with a core count.
    let gpus = root
        .get("SPDisplaysDataType")
        .and_then(Value::as_array)
        .map(Vec::as_slice)
        .unwrap_or_default();
    let cores = |g: &Value| text(g, "sppci_cores").and_then(|c| c.parse::<u32>().ok());
    let gpu_cores = gpus
        .iter()
        .find(|g| text(g, "sppci_bus").as_deref() == Some("spdisplays_builtin"))
        .and_then(cores)
        .or_else(|| gpus.iter().find_map(cores));
    Ok(SystemProfile {
        chip,
        model_name,
        gpu_cores,
        processors,
    })
}

/// "proc 32:24:8" -> (32, 24, 8).
fn parse_processors(s: &str) -> Option<(u32, u32, u32)> {
    let rest = s.strip_prefix("proc ")?;
    let mut it = rest.split(':').map(|p| p.trim().parse::<u32>());
    match (it.next(), it.next(), it.next(), it.next()) {
        (Some(Ok(a)), Some(Ok(b)), Some(Ok(c)), None) => Some((a, b, c)),
        _ => None,
    }
}

/// Memory available without swapping, from `vm_stat`: free + speculative +
/// inactive + purgeable pages, times the page size in its header.
pub fn parse_vm_stat(text: &str) -> Result<u64, HardwareError> {
    let what = "vm_stat output";
    let page_size: u64 = text
        .lines()
        .next()
        .and_then(|l| l.split("page size of ").nth(1))
        .and_then(|s| s.split_whitespace().next())
        .and_then(|n| n.parse().ok())
        .ok_or_else(|| HardwareError::parse(what, "no page size in the header"))?;
    let pages = |name: &str| -> Option<u64> {
        text.lines().find_map(|l| {
            let (k, v) = l.split_once(':')?;
            (k.trim() == name).then(|| v.trim().trim_end_matches('.').parse().ok())?
        })
    };
    let free =
        pages("Pages free").ok_or_else(|| HardwareError::parse(what, "no \"Pages free\" line"))?;
    let total = free
        + pages("Pages speculative").unwrap_or(0)
        + pages("Pages inactive").unwrap_or(0)
        + pages("Pages purgeable").unwrap_or(0);
    Ok(total.saturating_mul(page_size))
}

/// `sw_vers -productVersion` ("26.2") -> "macos 26.2".
pub fn os_name(product_version: &str) -> String {
    format!("macos {}", product_version.trim())
}

/// Assembles a profile: sysctl for exact counts, system_profiler for names
/// and GPU cores, the chip table for bandwidth and Thunderbolt 5.
pub fn profile(
    sysctl: &Sysctl,
    sp: &SystemProfile,
    os: String,
    arch: &str,
    free_memory_bytes: u64,
) -> HardwareProfile {
    let performance_cores = sysctl
        .performance_cores
        .or(sp.processors.map(|(_, p, _)| p))
        .unwrap_or(sysctl.cpu_cores);
    let mut p = HardwareProfile {
        chip: sp.chip.clone().unwrap_or_else(|| sysctl.brand.clone()),
        os,
        arch: arch.to_owned(),
        cpu_cores: sysctl.cpu_cores,
        performance_cores,
        gpu_cores: sp.gpu_cores.unwrap_or(0),
        memory_bytes: sysctl.memory_bytes,
        free_memory_bytes: free_memory_bytes.min(sysctl.memory_bytes),
        memory_bandwidth_bytes_per_s: 0,
        thunderbolt5: false,
        model_name: sp.model_name.clone().unwrap_or_default(),
        // Filled from `mlx-node bench --save` at start-up, if it ran.
        ..HardwareProfile::default()
    };
    super::apply_chip_table(&mut p);
    p
}

#[cfg(target_os = "macos")]
fn run(program: &str, args: &[&str]) -> Result<String, HardwareError> {
    let command = format!("{program} {}", args.join(" "));
    let out = std::process::Command::new(program)
        .args(args)
        .output()
        .map_err(|source| HardwareError::Spawn {
            command: command.clone(),
            source,
        })?;
    // `sysctl` exits non-zero when one key is unknown (perflevel on Intel)
    // but still prints the others: accept output when there is some.
    if !out.status.success() && out.stdout.is_empty() {
        return Err(HardwareError::CommandFailed {
            command,
            status: out.status.to_string(),
            stderr: String::from_utf8_lossy(&out.stderr).trim().to_owned(),
        });
    }
    String::from_utf8(out.stdout).map_err(|_| {
        HardwareError::parse(
            "command output",
            format!("`{command}` printed invalid UTF-8"),
        )
    })
}

/// Profiles this Mac.
#[cfg(target_os = "macos")]
pub fn detect() -> Result<HardwareProfile, HardwareError> {
    let sysctl = parse_sysctl(&run(
        "/usr/sbin/sysctl",
        &[
            "-n",
            "hw.memsize",
            "hw.ncpu",
            "hw.perflevel0.physicalcpu",
            "machdep.cpu.brand_string",
        ],
    )?)?;
    let sp = parse_system_profiler(&run(
        "/usr/sbin/system_profiler",
        &["SPHardwareDataType", "SPDisplaysDataType", "-json"],
    )?)?;
    let os = os_name(&run("/usr/bin/sw_vers", &["-productVersion"])?);
    let free = free_memory_bytes()?;
    Ok(profile(&sysctl, &sp, os, std::env::consts::ARCH, free))
}

/// Available memory now (`vm_stat`).
#[cfg(target_os = "macos")]
pub fn free_memory_bytes() -> Result<u64, HardwareError> {
    parse_vm_stat(&run("/usr/bin/vm_stat", &[])?)
}

#[cfg(test)]
mod tests {
    use super::*;

    const SYSCTL_M3_ULTRA: &str = include_str!("samples/macos_sysctl_m3_ultra.txt");
    const SYSCTL_M4_PRO: &str = include_str!("samples/macos_sysctl_m4_pro.txt");
    const SP_M3_ULTRA: &str = include_str!("samples/macos_system_profiler_m3_ultra.json");
    const SP_M4_PRO: &str = include_str!("samples/macos_system_profiler_m4_pro.json");
    const VM_STAT_M4_PRO: &str = include_str!("samples/macos_vm_stat_m4_pro.txt");
    const SW_VERS: &str = include_str!("samples/macos_sw_vers.txt");

    #[test]
    fn mac_studio_m3_ultra_profile() {
        let s = parse_sysctl(SYSCTL_M3_ULTRA).unwrap();
        assert_eq!(s.memory_bytes, 512 << 30);
        assert_eq!((s.cpu_cores, s.performance_cores), (32, Some(24)));
        let sp = parse_system_profiler(SP_M3_ULTRA).unwrap();
        assert_eq!(sp.chip.as_deref(), Some("Apple M3 Ultra"));
        assert_eq!(sp.model_name.as_deref(), Some("Mac Studio"));
        assert_eq!(sp.gpu_cores, Some(80));
        assert_eq!(sp.processors, Some((32, 24, 8)));

        let p = profile(&s, &sp, os_name(SW_VERS), "aarch64", 480 << 30);
        assert_eq!(p.chip, "Apple M3 Ultra");
        assert_eq!(p.model_name, "Mac Studio");
        assert_eq!(p.os, "macos 26.2");
        assert_eq!(
            (p.cpu_cores, p.performance_cores, p.gpu_cores),
            (32, 24, 80)
        );
        assert_eq!(p.memory_bytes, 549_755_813_888);
        assert_eq!(p.free_memory_bytes, 480 << 30);
        assert_eq!(p.memory_bandwidth_bytes_per_s, 819_000_000_000);
        assert!(p.thunderbolt5);
    }

    #[test]
    fn mac_mini_m4_pro_profile() {
        let s = parse_sysctl(SYSCTL_M4_PRO).unwrap();
        let sp = parse_system_profiler(SP_M4_PRO).unwrap();
        let free = parse_vm_stat(VM_STAT_M4_PRO).unwrap();
        let p = profile(&s, &sp, os_name("15.5\n"), "aarch64", free);
        assert_eq!(p.chip, "Apple M4 Pro");
        assert_eq!(p.model_name, "Mac mini");
        assert_eq!(p.os, "macos 15.5");
        assert_eq!(
            (p.cpu_cores, p.performance_cores, p.gpu_cores),
            (14, 10, 20)
        );
        assert_eq!(p.memory_bytes, 64 << 30);
        assert_eq!(p.memory_bandwidth_bytes_per_s, 273_000_000_000);
        assert!(p.thunderbolt5);
    }

    #[test]
    fn vm_stat_counts_reclaimable_pages() {
        // (95374 free + 19102 speculative + 1179470 inactive + 21877 purgeable) x 16 KiB
        assert_eq!(parse_vm_stat(VM_STAT_M4_PRO).unwrap(), 1_315_823 * 16_384);
        assert!(
            parse_vm_stat("Pages free: 1.\n").is_err(),
            "no page size header"
        );
    }

    #[test]
    fn intel_macs_lack_perflevel_and_chip_type() {
        let s =
            parse_sysctl("17179869184\n16\nIntel(R) Core(TM) i9-9880H CPU @ 2.30GHz\n").unwrap();
        assert_eq!(s.performance_cores, None);
        let sp = parse_system_profiler(
            r#"{"SPHardwareDataType":[{"cpu_type":"8-Core Intel Core i9","machine_name":"MacBook Pro"}],
                "SPDisplaysDataType":[{"sppci_model":"AMD Radeon Pro 5500M","sppci_bus":"spdisplays_pcie_device"}]}"#,
        )
        .unwrap();
        let p = profile(&s, &sp, os_name("13.6"), "x86_64", 1 << 30);
        assert_eq!(p.chip, "8-Core Intel Core i9");
        assert_eq!((p.performance_cores, p.gpu_cores), (16, 0));
        assert_eq!(p.memory_bandwidth_bytes_per_s, 0);
    }

    #[test]
    fn malformed_output_is_an_error_naming_the_field() {
        let err = parse_sysctl("lots\n32\n24\nApple M3 Ultra\n").unwrap_err();
        assert!(err.to_string().contains("hw.memsize"), "{err}");
        assert!(parse_sysctl("1\n").is_err());
        assert!(parse_system_profiler("{not json").is_err());
        let err = parse_system_profiler(r#"{"SPDisplaysDataType":[]}"#).unwrap_err();
        assert!(err.to_string().contains("SPHardwareDataType"), "{err}");
    }
}
