//! Apple silicon chip table: unified-memory bandwidth, GPU cores, GPU compute
//! and Thunderbolt 5, per chip (M1..M5, base / Pro / Max / Ultra). The one
//! place these figures live: the node reports them in its hardware profile and
//! the coordinator's scheduler falls back on them when a node has not measured
//! itself (`mlx-node bench`); measured figures always win.
//!
//! Bandwidth is Apple's published peak for the fastest bin of each chip (some
//! M3 Max / M4 Max bins with fewer GPU cores are slower: 300 and 410 GB/s).
//! M5 Pro / Max / Ultra follow the family's pattern (Max = 2 x Pro,
//! Ultra = 2 x Max, Ultra about 1.2 TB/s as Apple states for the M5 Ultra
//! Mac Studio); their GPU core counts follow the same pattern (20 / 40 / 80).
//! GPU cores are the top bin of each chip. Compute is an estimate, not an
//! Apple figure: GPU cores x 128 ALUs x 2 FLOPs (fused multiply-add) x the
//! generation's GPU clock (M1 1.28, M2 1.40, M3 1.38, M4 1.58, M5 1.60 GHz);
//! e.g. M3 Ultra 80 cores = 28.3 FP32 TFLOPS. Thunderbolt 5: M3 Ultra, M4 Pro, M4 Max and the M5 Pro, Max
//! and Ultra; base M4 and M5 have Thunderbolt 4, earlier chips Thunderbolt 3/4.
//! Memory is the largest configuration Apple sells per chip (e.g. M1 16 GB,
//! M2 Max 96 GB, M3 Ultra 512 GB); the M5 Pro / Max / Ultra follow the M4
//! Pro / Max and M3 Ultra. The coordinator caps a node's reported memory at
//! it (availability rewards).
//!
//! # Failure
//! An unknown chip name gives `None`; callers report 0 bandwidth ("unknown").

/// Figures for one chip.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ChipSpec {
    /// Canonical name, as `system_profiler` reports it: "Apple M3 Ultra".
    pub name: &'static str,
    /// Peak unified-memory bandwidth, GB/s (10^9 bytes per second).
    pub memory_bandwidth_gb_s: u32,
    /// Has Thunderbolt 5 (RDMA over Thunderbolt possible from macOS 26.2).
    pub thunderbolt5: bool,
    /// GPU cores of the chip's top bin.
    pub gpu_cores: u32,
    /// GPU clock of the generation, MHz (for the compute estimate).
    pub gpu_clock_mhz: u32,
    /// The most unified memory any Mac with this chip ships with, in the
    /// "GB" Apple sells (binary: 2^30 bytes each, as the OS reports them).
    pub max_memory_gb: u32,
}

impl ChipSpec {
    /// Bandwidth in bytes per second.
    pub fn memory_bandwidth_bytes_per_s(&self) -> u64 {
        u64::from(self.memory_bandwidth_gb_s) * 1_000_000_000
    }

    /// The most unified memory a Mac with this chip has, in bytes.
    pub fn max_memory_bytes(&self) -> u64 {
        u64::from(self.max_memory_gb) << 30
    }

    /// Estimated peak GPU compute, FLOP/s (FP32 fused multiply-adds).
    pub fn compute_flops(&self) -> f64 {
        f64::from(self.gpu_cores) * 128.0 * 2.0 * f64::from(self.gpu_clock_mhz) * 1e6
    }
}

const fn chip(
    name: &'static str,
    memory_bandwidth_gb_s: u32,
    thunderbolt5: bool,
    gpu_cores: u32,
    gpu_clock_mhz: u32,
    max_memory_gb: u32,
) -> ChipSpec {
    ChipSpec {
        name,
        memory_bandwidth_gb_s,
        thunderbolt5,
        gpu_cores,
        gpu_clock_mhz,
        max_memory_gb,
    }
}

const M1: u32 = 1278;
const M2: u32 = 1398;
const M3: u32 = 1380;
const M4: u32 = 1578;
const M5: u32 = 1600;

/// Every known Apple silicon Mac chip.
pub const CHIPS: &[ChipSpec] = &[
    chip("Apple M1", 68, false, 8, M1, 16),
    chip("Apple M1 Pro", 200, false, 16, M1, 32),
    chip("Apple M1 Max", 400, false, 32, M1, 64),
    chip("Apple M1 Ultra", 800, false, 64, M1, 128),
    chip("Apple M2", 100, false, 10, M2, 24),
    chip("Apple M2 Pro", 200, false, 19, M2, 32),
    chip("Apple M2 Max", 400, false, 38, M2, 96),
    chip("Apple M2 Ultra", 800, false, 76, M2, 192),
    chip("Apple M3", 100, false, 10, M3, 24),
    chip("Apple M3 Pro", 150, false, 18, M3, 36),
    chip("Apple M3 Max", 400, false, 40, M3, 128),
    chip("Apple M3 Ultra", 819, true, 80, M3, 512),
    chip("Apple M4", 120, false, 10, M4, 32),
    chip("Apple M4 Pro", 273, true, 20, M4, 64),
    chip("Apple M4 Max", 546, true, 40, M4, 128),
    chip("Apple M5", 153, false, 10, M5, 32),
    chip("Apple M5 Pro", 307, true, 20, M5, 64),
    chip("Apple M5 Max", 614, true, 40, M5, 128),
    chip("Apple M5 Ultra", 1228, true, 80, M5, 512),
];

/// Looks a chip up by the name macOS reports ("Apple M3 Ultra"); case and
/// spacing are forgiven, and the "Apple " prefix is optional.
pub fn lookup(name: &str) -> Option<&'static ChipSpec> {
    let wanted = normalize(name);
    let wanted = wanted.strip_prefix("apple ").unwrap_or(&wanted);
    CHIPS.iter().find(|c| {
        let n = normalize(c.name);
        n.strip_prefix("apple ").unwrap_or(&n) == wanted
    })
}

fn normalize(s: &str) -> String {
    s.split_whitespace()
        .collect::<Vec<_>>()
        .join(" ")
        .to_ascii_lowercase()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn known_chips_are_found_by_the_names_macos_reports() {
        let ultra = lookup("Apple M3 Ultra").unwrap();
        assert_eq!(ultra.memory_bandwidth_gb_s, 819);
        assert!(ultra.thunderbolt5);
        assert_eq!(ultra.memory_bandwidth_bytes_per_s(), 819_000_000_000);
        assert_eq!(lookup("  apple   m4 pro ").unwrap().name, "Apple M4 Pro");
        assert_eq!(lookup("M2 Max").unwrap().memory_bandwidth_gb_s, 400);
        // The base chip is not confused with its bigger siblings.
        assert_eq!(lookup("Apple M4").unwrap().memory_bandwidth_gb_s, 120);
        assert!(!lookup("Apple M4").unwrap().thunderbolt5);
        assert!(lookup("Intel(R) Core(TM) i9-9880H").is_none());
        assert!(lookup("Apple M9 Hyper").is_none());
        assert_eq!(ultra.gpu_cores, 80);
        assert_eq!(ultra.max_memory_bytes(), 512 << 30);
        assert_eq!(lookup("Apple M1").unwrap().max_memory_bytes(), 16 << 30);
        let tflops = ultra.compute_flops() / 1e12;
        assert!((28.0..29.0).contains(&tflops), "{tflops}");
    }

    #[test]
    fn table_is_complete_and_consistent() {
        for gen in 1..=5 {
            for tier in ["", " Pro", " Max", " Ultra"] {
                let name = format!("Apple M{gen}{tier}");
                // Apple made no M4 Ultra.
                assert_eq!(lookup(&name).is_some(), name != "Apple M4 Ultra", "{name}");
            }
        }
        for w in CHIPS.windows(2) {
            assert_ne!(w[0].name, w[1].name);
        }
        // Within a generation, bigger tiers never have less bandwidth.
        for gen in 1..=5 {
            let bw: Vec<u32> = ["", " Pro", " Max", " Ultra"]
                .iter()
                .filter_map(|t| lookup(&format!("M{gen}{t}")))
                .map(|c| c.memory_bandwidth_gb_s)
                .collect();
            assert!(bw.windows(2).all(|w| w[0] <= w[1]), "M{gen}: {bw:?}");
            let cores: Vec<u32> = ["", " Pro", " Max", " Ultra"]
                .iter()
                .filter_map(|t| lookup(&format!("M{gen}{t}")))
                .map(|c| c.gpu_cores)
                .collect();
            assert!(cores.windows(2).all(|w| w[0] < w[1]), "M{gen}: {cores:?}");
        }
        // Thunderbolt 5 exactly where Apple ships it.
        let tb5: Vec<&str> = CHIPS
            .iter()
            .filter(|c| c.thunderbolt5)
            .map(|c| c.name)
            .collect();
        assert_eq!(
            tb5,
            [
                "Apple M3 Ultra",
                "Apple M4 Pro",
                "Apple M4 Max",
                "Apple M5 Pro",
                "Apple M5 Max",
                "Apple M5 Ultra"
            ]
        );
    }
}
