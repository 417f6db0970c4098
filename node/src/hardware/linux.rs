//! Linux: memory from `/proc/meminfo`, CPU from `/proc/cpuinfo`, kernel
//! version from `/proc/sys/kernel/osrelease`.
//!
//! The parsers are pure and compiled everywhere; only [`detect`] and
//! [`free_memory_bytes`] touch the filesystem.
//!
//! # Failure
//! A file without the fields we need (e.g. no `MemTotal`, no `processor`
//! line) is a [`HardwareError::Parse`] naming the field.

use mlxnet_proto::v1::HardwareProfile;

use super::HardwareError;

/// The two memory figures the node reports.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MemInfo {
    pub total_bytes: u64,
    /// `MemAvailable` (or, on kernels before 3.14, `MemFree + Buffers + Cached`).
    pub available_bytes: u64,
}

/// What the node reports about the CPU.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CpuInfo {
    /// `model name` (x86), or the ARM core named from implementer/part ids.
    pub model: String,
    /// Logical CPUs (`processor` entries).
    pub logical_cores: u32,
}

/// Parses `/proc/meminfo` (`Key:   value kB` lines).
pub fn parse_meminfo(text: &str) -> Result<MemInfo, HardwareError> {
    let field = |name: &str| -> Result<Option<u64>, HardwareError> {
        for line in text.lines() {
            let Some((key, rest)) = line.split_once(':') else {
                continue;
            };
            if key.trim() != name {
                continue;
            }
            let mut parts = rest.split_whitespace();
            let value: u64 = parts.next().and_then(|v| v.parse().ok()).ok_or_else(|| {
                HardwareError::parse("/proc/meminfo", format!("{name} has no number: {line:?}"))
            })?;
            let scale = match parts.next() {
                Some("kB") => 1024,
                None => 1,
                Some(unit) => {
                    return Err(HardwareError::parse(
                        "/proc/meminfo",
                        format!("{name} has unit {unit:?}"),
                    ));
                }
            };
            return Ok(Some(value.saturating_mul(scale)));
        }
        Ok(None)
    };
    let total_bytes = field("MemTotal")?
        .ok_or_else(|| HardwareError::parse("/proc/meminfo", "no MemTotal line"))?;
    let available_bytes = match field("MemAvailable")? {
        Some(v) => v,
        None => {
            let free = field("MemFree")?.ok_or_else(|| {
                HardwareError::parse("/proc/meminfo", "no MemAvailable or MemFree line")
            })?;
            free + field("Buffers")?.unwrap_or(0) + field("Cached")?.unwrap_or(0)
        }
    };
    Ok(MemInfo {
        total_bytes,
        available_bytes: available_bytes.min(total_bytes),
    })
}

/// Parses `/proc/cpuinfo` (blank-line separated `key : value` blocks).
pub fn parse_cpuinfo(text: &str) -> Result<CpuInfo, HardwareError> {
    let mut logical_cores = 0u32;
    let mut model = None;
    let mut implementer = None;
    let mut part = None;
    let mut hardware = None;
    for line in text.lines() {
        let Some((key, value)) = line.split_once(':') else {
            continue;
        };
        let value = value.trim();
        match key.trim() {
            "processor" if value.parse::<u32>().is_ok() => logical_cores += 1,
            "model name" if model.is_none() && !value.is_empty() => model = Some(value.to_owned()),
            "CPU implementer" if implementer.is_none() => implementer = parse_hex(value),
            "CPU part" if part.is_none() => part = parse_hex(value),
            "Hardware" if hardware.is_none() && !value.is_empty() => {
                hardware = Some(value.to_owned())
            }
            _ => {}
        }
    }
    if logical_cores == 0 {
        return Err(HardwareError::parse(
            "/proc/cpuinfo",
            "no processor entries",
        ));
    }
    let model = model
        .or_else(|| implementer.map(|i| arm_core_name(i, part)))
        .or(hardware)
        .unwrap_or_else(|| "unknown CPU".to_owned());
    Ok(CpuInfo {
        model,
        logical_cores,
    })
}

fn parse_hex(s: &str) -> Option<u32> {
    u32::from_str_radix(s.trim_start_matches("0x"), 16).ok()
}

/// Names an ARM core from `/proc/cpuinfo`'s implementer and part ids.
fn arm_core_name(implementer: u32, part: Option<u32>) -> String {
    let known = match (implementer, part) {
        (0x41, Some(0xd08)) => Some("ARM Cortex-A72"),
        (0x41, Some(0xd0b)) => Some("ARM Cortex-A76"),
        (0x41, Some(0xd0c)) => Some("ARM Neoverse-N1"),
        (0x41, Some(0xd40)) => Some("ARM Neoverse-V1"),
        (0x41, Some(0xd49)) => Some("ARM Neoverse-N2"),
        (0x41, Some(0xd4f)) => Some("ARM Neoverse-V2"),
        (0x61, _) => Some("Apple silicon (Linux)"),
        _ => None,
    };
    match (known, part) {
        (Some(name), _) => name.to_owned(),
        (None, Some(p)) => format!("ARM CPU (implementer {implementer:#x}, part {p:#x})"),
        (None, None) => format!("ARM CPU (implementer {implementer:#x})"),
    }
}

/// `linux <version>` from `/proc/sys/kernel/osrelease` ("6.1.0-18-amd64" -> "linux 6.1.0").
pub fn os_name(osrelease: &str) -> String {
    let release = osrelease.trim();
    let version: String = release
        .chars()
        .take_while(|c| c.is_ascii_digit() || *c == '.')
        .collect();
    let version = version.trim_end_matches('.');
    format!(
        "linux {}",
        if version.is_empty() { release } else { version }
    )
}

/// Assembles a profile from parsed parts.
pub fn profile(
    mem: MemInfo,
    cpu: &CpuInfo,
    os: String,
    arch: &str,
    model_name: String,
) -> HardwareProfile {
    let mut p = HardwareProfile {
        chip: cpu.model.clone(),
        os,
        arch: arch.to_owned(),
        cpu_cores: cpu.logical_cores,
        // Linux gives no performance/efficiency split we can trust: all count.
        performance_cores: cpu.logical_cores,
        gpu_cores: 0,
        memory_bytes: mem.total_bytes,
        free_memory_bytes: mem.available_bytes,
        memory_bandwidth_bytes_per_s: 0,
        thunderbolt5: false,
        model_name,
        // Filled from `mlx-node bench --save` at start-up, if it ran.
        ..HardwareProfile::default()
    };
    super::apply_chip_table(&mut p);
    p
}

#[cfg(target_os = "linux")]
fn read(path: &str) -> Result<String, HardwareError> {
    std::fs::read_to_string(path).map_err(|source| HardwareError::Read {
        path: path.into(),
        source,
    })
}

/// Profiles this Linux machine.
#[cfg(target_os = "linux")]
pub fn detect() -> Result<HardwareProfile, HardwareError> {
    let mem = parse_meminfo(&read("/proc/meminfo")?)?;
    let cpu = parse_cpuinfo(&read("/proc/cpuinfo")?)?;
    let os = os_name(&read("/proc/sys/kernel/osrelease").unwrap_or_default());
    // The DMI product name ("ThinkPad X1", "Standard PC"...) is a nicety: absent in many VMs.
    let model_name = std::fs::read_to_string("/sys/devices/virtual/dmi/id/product_name")
        .map(|s| s.trim().to_owned())
        .unwrap_or_default();
    Ok(profile(mem, &cpu, os, std::env::consts::ARCH, model_name))
}

/// `MemAvailable` now.
#[cfg(target_os = "linux")]
pub fn free_memory_bytes() -> Result<u64, HardwareError> {
    Ok(parse_meminfo(&read("/proc/meminfo")?)?.available_bytes)
}

#[cfg(test)]
mod tests {
    use super::*;

    const MEMINFO_EPYC: &str = include_str!("samples/linux_meminfo_epyc.txt");
    const CPUINFO_EPYC: &str = include_str!("samples/linux_cpuinfo_epyc.txt");
    const CPUINFO_GRAVITON2: &str = include_str!("samples/linux_cpuinfo_graviton2.txt");

    #[test]
    fn meminfo_sample_gives_total_and_available_in_bytes() {
        let m = parse_meminfo(MEMINFO_EPYC).unwrap();
        assert_eq!(m.total_bytes, 24_683_652 * 1024);
        assert_eq!(m.available_bytes, 21_594_284 * 1024);
    }

    #[test]
    fn old_kernels_without_memavailable_fall_back_to_free_plus_caches() {
        let text = "MemTotal: 1000 kB\nMemFree: 100 kB\nBuffers: 10 kB\nCached: 200 kB\n";
        let m = parse_meminfo(text).unwrap();
        assert_eq!(m.available_bytes, 310 * 1024);
    }

    #[test]
    fn meminfo_without_total_or_with_garbage_is_an_error() {
        assert!(parse_meminfo("MemFree: 1 kB\n").is_err());
        let err = parse_meminfo("MemTotal: lots kB\n").unwrap_err();
        assert!(err.to_string().contains("MemTotal"), "{err}");
        assert!(parse_meminfo("").is_err());
    }

    #[test]
    fn cpuinfo_samples_give_model_and_core_count() {
        let c = parse_cpuinfo(CPUINFO_EPYC).unwrap();
        assert_eq!(c.model, "AMD EPYC");
        assert_eq!(c.logical_cores, 2);
        // aarch64 has no `model name`: the core is named from its part id.
        let c = parse_cpuinfo(CPUINFO_GRAVITON2).unwrap();
        assert_eq!(c.model, "ARM Neoverse-N1");
        assert_eq!(c.logical_cores, 4);
        assert!(parse_cpuinfo("flags : fpu\n").is_err());
    }

    #[test]
    fn profile_from_samples() {
        let p = profile(
            parse_meminfo(MEMINFO_EPYC).unwrap(),
            &parse_cpuinfo(CPUINFO_EPYC).unwrap(),
            os_name("6.18.44-fc-v857\n"),
            "x86_64",
            String::new(),
        );
        assert_eq!(p.os, "linux 6.18.44");
        assert_eq!(p.chip, "AMD EPYC");
        assert_eq!(p.cpu_cores, 2);
        assert_eq!(p.memory_bytes, 24_683_652 * 1024);
        assert_eq!(
            p.memory_bandwidth_bytes_per_s, 0,
            "not in the Apple table: unknown"
        );
        assert!(!p.thunderbolt5);
    }
}
