//! The hardware profile a node reports when it registers: chip, cores,
//! memory, memory bandwidth, Thunderbolt 5.
//!
//! Detection reads the OS (Linux: `/proc/meminfo`, `/proc/cpuinfo`; macOS:
//! `sysctl`, `system_profiler -json`, `vm_stat`, `sw_vers`); every parser is a
//! pure function over the text those produce, compiled on every platform and
//! tested on recorded samples (`hardware/samples/`). Only running the macOS
//! commands is behind `cfg(target_os = "macos")`.
//!
//! # Layout
//! - [`chips`]: the Apple chip table (bandwidth, GPU cores, Thunderbolt 5),
//!   which lives in `mlxnet_proto::chips` so the scheduler uses the same one.
//! - [`linux`]: `/proc` parsers and detection on Linux.
//! - [`macos`]: `sysctl` / `system_profiler` / `vm_stat` parsers and
//!   detection on macOS.
//!
//! # Invariants
//! - Memory figures are bytes; `memory_bandwidth_bytes_per_s` is 0 when the
//!   chip is not in the table (never a guess).
//!
//! # Failure
//! [`HardwareError`] names the file or command and what was wrong in its
//! output. A profile is all or nothing: a node never registers with made-up
//! memory figures.

use std::path::PathBuf;

use mlxnet_proto::v1::HardwareProfile;

pub use mlxnet_proto::chips;
pub mod linux;
pub mod macos;

/// Why the hardware could not be profiled.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum HardwareError {
    #[error("cannot read {path}: {source}")]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("cannot run `{command}`: {source}")]
    Spawn {
        command: String,
        source: std::io::Error,
    },
    #[error("`{command}` failed ({status}): {stderr}")]
    CommandFailed {
        command: String,
        status: String,
        stderr: String,
    },
    #[error("unexpected {what}: {reason}")]
    Parse { what: &'static str, reason: String },
    #[error("hardware detection is not supported on {0}")]
    Unsupported(&'static str),
}

impl HardwareError {
    fn parse(what: &'static str, reason: impl Into<String>) -> Self {
        Self::Parse {
            what,
            reason: reason.into(),
        }
    }
}

/// Profiles this machine. Blocking (reads files, may run commands).
pub fn detect() -> Result<HardwareProfile, HardwareError> {
    #[cfg(target_os = "linux")]
    {
        linux::detect()
    }
    #[cfg(target_os = "macos")]
    {
        macos::detect()
    }
    #[cfg(not(any(target_os = "linux", target_os = "macos")))]
    {
        Err(HardwareError::Unsupported(std::env::consts::OS))
    }
}

/// Memory available to new work right now, in bytes. Blocking.
pub fn free_memory_bytes() -> Result<u64, HardwareError> {
    #[cfg(target_os = "linux")]
    {
        linux::free_memory_bytes()
    }
    #[cfg(target_os = "macos")]
    {
        macos::free_memory_bytes()
    }
    #[cfg(not(any(target_os = "linux", target_os = "macos")))]
    {
        Err(HardwareError::Unsupported(std::env::consts::OS))
    }
}

/// Fills bandwidth and Thunderbolt 5 from the chip table when the chip is known.
pub fn apply_chip_table(profile: &mut HardwareProfile) {
    if let Some(spec) = chips::lookup(&profile.chip) {
        profile.memory_bandwidth_bytes_per_s = spec.memory_bandwidth_bytes_per_s();
        profile.thunderbolt5 = spec.thunderbolt5;
        if profile.gpu_cores == 0 {
            profile.gpu_cores = spec.gpu_cores;
        }
    }
}

/// Where `mlx-node bench --save` puts its figures inside the data directory.
pub const BENCH_FILE: &str = "bench.json";

/// What `mlx-node bench` measured on this machine.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct BenchFigures {
    /// Bytes read per generated token x decode tokens/s.
    pub memory_bandwidth_bytes_per_s: u64,
    /// 2 x parameters x prefill tokens/s.
    pub compute_flops: u64,
}

/// One point of the throughput curve `mlx-node bench --batch` measures.
#[derive(Clone, Copy, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct BatchPoint {
    /// Concurrent streams.
    pub streams: u32,
    /// Decode tokens/s of all of them together.
    pub tokens_per_s: f64,
}

/// The throughput curve in a bench file (`"batch"`, next to the figures);
/// empty when the file or the curve is absent.
pub fn read_batch_curve(path: &std::path::Path) -> Result<Vec<BatchPoint>, HardwareError> {
    #[derive(serde::Deserialize)]
    struct WithCurve {
        #[serde(default)]
        batch: Vec<BatchPoint>,
    }
    let bytes = match std::fs::read(path) {
        Ok(b) => b,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(source) => {
            return Err(HardwareError::Read {
                path: path.to_owned(),
                source,
            })
        }
    };
    let file: WithCurve = serde_json::from_slice(&bytes)
        .map_err(|e| HardwareError::parse("bench batch curve", e.to_string()))?;
    let mut curve: Vec<BatchPoint> = file
        .batch
        .into_iter()
        .filter(|p| p.streams > 0 && p.tokens_per_s.is_finite() && p.tokens_per_s > 0.0)
        .collect();
    curve.sort_by_key(|p| p.streams);
    Ok(curve)
}

/// The batch slots a curve suggests: the fewest streams whose aggregate
/// speed is within 90% of the best measured (more streams would only slow
/// each one down); `None` without a curve.
pub fn slots_from_curve(curve: &[BatchPoint]) -> Option<u32> {
    let best = curve.iter().map(|p| p.tokens_per_s).fold(0.0, f64::max);
    curve
        .iter()
        .find(|p| p.tokens_per_s >= 0.9 * best)
        .map(|p| p.streams)
}

/// Puts measured figures saved by `mlx-node bench --save` at `path` into the
/// profile. A missing file changes nothing; an unreadable one is an error.
pub fn apply_bench(
    profile: &mut HardwareProfile,
    path: &std::path::Path,
) -> Result<bool, HardwareError> {
    let bytes = match std::fs::read(path) {
        Ok(b) => b,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(false),
        Err(source) => {
            return Err(HardwareError::Read {
                path: path.to_owned(),
                source,
            })
        }
    };
    let figures: BenchFigures = serde_json::from_slice(&bytes)
        .map_err(|e| HardwareError::parse("bench figures", e.to_string()))?;
    profile.measured_memory_bandwidth_bytes_per_s = figures.memory_bandwidth_bytes_per_s;
    profile.measured_compute_flops = figures.compute_flops;
    Ok(true)
}

/// The profile as JSON (what `mlx-node hardware` prints).
pub fn to_json(p: &HardwareProfile) -> serde_json::Value {
    serde_json::json!({
        "chip": p.chip,
        "model_name": p.model_name,
        "os": p.os,
        "arch": p.arch,
        "cpu_cores": p.cpu_cores,
        "performance_cores": p.performance_cores,
        "gpu_cores": p.gpu_cores,
        "memory_bytes": p.memory_bytes,
        "free_memory_bytes": p.free_memory_bytes,
        "memory_bandwidth_bytes_per_s": p.memory_bandwidth_bytes_per_s,
        "thunderbolt5": p.thunderbolt5,
        "measured_memory_bandwidth_bytes_per_s": p.measured_memory_bandwidth_bytes_per_s,
        "measured_compute_flops": p.measured_compute_flops,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn saved_bench_figures_go_into_the_profile() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join(BENCH_FILE);
        let mut p = HardwareProfile::default();
        assert!(
            !apply_bench(&mut p, &path).unwrap(),
            "missing file: nothing to apply"
        );
        assert_eq!(p.measured_memory_bandwidth_bytes_per_s, 0);
        let figures = BenchFigures {
            memory_bandwidth_bytes_per_s: 12_345_678_901,
            compute_flops: 98_765_432_100,
        };
        std::fs::write(&path, serde_json::to_vec(&figures).unwrap()).unwrap();
        assert!(apply_bench(&mut p, &path).unwrap());
        assert_eq!(p.measured_memory_bandwidth_bytes_per_s, 12_345_678_901);
        assert_eq!(p.measured_compute_flops, 98_765_432_100);
        std::fs::write(&path, b"{not json").unwrap();
        assert!(matches!(
            apply_bench(&mut p, &path),
            Err(HardwareError::Parse { .. })
        ));
    }

    #[test]
    fn the_batch_curve_is_read_sorted_and_picks_the_knee() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join(BENCH_FILE);
        assert!(read_batch_curve(&path).unwrap().is_empty());
        std::fs::write(
            &path,
            r#"{"memory_bandwidth_bytes_per_s": 1, "compute_flops": 2, "batch": [
                {"streams": 8, "tokens_per_s": 640.0}, {"streams": 1, "tokens_per_s": 160.0},
                {"streams": 16, "tokens_per_s": 680.0}, {"streams": 4, "tokens_per_s": 500.0},
                {"streams": 0, "tokens_per_s": 9999.0}]}"#,
        )
        .unwrap();
        let curve = read_batch_curve(&path).unwrap();
        let streams: Vec<u32> = curve.iter().map(|p| p.streams).collect();
        assert_eq!(streams, [1, 4, 8, 16], "sorted, nonsense dropped");
        // 640 is within 90% of 680; 500 is not.
        assert_eq!(slots_from_curve(&curve), Some(8));
        assert_eq!(slots_from_curve(&[]), None);
        // The figures still read from the same file.
        let mut p = HardwareProfile::default();
        assert!(apply_bench(&mut p, &path).unwrap());
        assert_eq!(p.measured_compute_flops, 2);
    }

    #[cfg(target_os = "linux")]
    #[test]
    fn this_machine_profiles_with_real_memory_and_cores() {
        let p = detect().unwrap();
        assert!(p.memory_bytes > 0);
        assert!(p.free_memory_bytes <= p.memory_bytes);
        assert!(p.cpu_cores >= 1);
        assert!(!p.chip.is_empty());
        assert!(p.os.starts_with("linux "), "{}", p.os);
        assert_eq!(p.arch, std::env::consts::ARCH);
        assert!(free_memory_bytes().unwrap() <= p.memory_bytes);
        let json = to_json(&p);
        assert_eq!(json["memory_bytes"], p.memory_bytes);
        assert_eq!(json["chip"], p.chip.as_str());
    }
}
