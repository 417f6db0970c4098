//! The meters on recorded samples: a RAPL tree (two packages, a sub-domain
//! that must not be added again, a counter about to wrap) and
//! `powermetrics` output of an Apple silicon and an Intel Mac.

use super::*;

fn samples() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("src/energy/samples")
}

/// A copy of the recorded powercap tree the test may advance.
fn powercap_copy(dir: &Path) -> PathBuf {
    fn copy(from: &Path, to: &Path) {
        std::fs::create_dir_all(to).unwrap();
        for e in std::fs::read_dir(from).unwrap().flatten() {
            let target = to.join(e.file_name());
            if e.path().is_dir() {
                copy(&e.path(), &target);
            } else {
                std::fs::copy(e.path(), target).unwrap();
            }
        }
    }
    let root = dir.join("powercap");
    copy(&samples().join("powercap"), &root);
    root
}

#[test]
fn rapl_adds_the_package_domains_and_survives_a_wrap() {
    let dir = tempfile::tempdir().unwrap();
    let root = powercap_copy(dir.path());
    let rapl = Rapl::open(&root).unwrap();
    let meter: Arc<dyn EnergyMeter> = Arc::new(rapl);
    assert_eq!(meter.joules().unwrap(), 0.0);
    let span = Span::start(&meter).unwrap();
    // Package 0 uses 2.5 J; package 1 wraps (its range is 262143328850 µJ)
    // after 0.32885 J and goes on to 1.0 J more; the core sub-domain of
    // package 0 moves too but is part of package 0.
    std::fs::write(root.join("intel-rapl:0/energy_uj"), "123459289012\n").unwrap();
    std::fs::write(
        root.join("intel-rapl:0/intel-rapl:0:0/energy_uj"),
        "99999999\n",
    )
    .unwrap();
    std::fs::write(root.join("intel-rapl:1/energy_uj"), "1000000\n").unwrap();
    let j = span.joules();
    assert!((j - (2.5 + 0.32885 + 1.0)).abs() < 1e-6, "{j}");
    assert_eq!(span.meter_name(), "rapl");
    // A counter that is not a number is an error naming the file.
    std::fs::write(root.join("intel-rapl:1/energy_uj"), "n/a\n").unwrap();
    let err = meter.joules().unwrap_err();
    assert!(err.to_string().contains("intel-rapl:1"), "{err}");
}

#[test]
fn no_or_unreadable_rapl_is_an_error_not_a_meter() {
    let dir = tempfile::tempdir().unwrap();
    assert!(matches!(
        Rapl::open(&dir.path().join("absent")),
        Err(EnergyError::Read { .. })
    ));
    assert!(matches!(
        Rapl::open(dir.path()),
        Err(EnergyError::NoRapl(_))
    ));
    // This machine: say whether RAPL is readable (the note records it).
    match Rapl::open(Path::new("/sys/class/powercap")) {
        Ok(_) => eprintln!("RAPL is readable on this machine"),
        Err(e) => eprintln!("RAPL is not readable on this machine: {e}"),
    }
    assert_eq!(counter_delta(10, 25, 100), 15);
    assert_eq!(counter_delta(90, 5, 100), 15);
}

#[test]
fn powermetrics_samples_add_up_to_joules() {
    let text = std::fs::read_to_string(samples().join("powermetrics-m2.txt")).unwrap();
    let s = parse_powermetrics(&text);
    assert_eq!(s.len(), 2);
    assert_eq!(s[0].milliwatts, 11973.0);
    assert!((s[0].elapsed.as_secs_f64() - 0.50231).abs() < 1e-9);
    let meter = SampledEnergy::default();
    for x in &s {
        meter.add(x);
    }
    let want = 11.973 * 0.50231 + 12.030 * 0.50009;
    assert!((meter.joules().unwrap() - want).abs() < 1e-9);
    // No combined line (Intel Macs): the parts add up; the last sample is
    // flushed at the end of the output.
    let text = std::fs::read_to_string(samples().join("powermetrics-intel.txt")).unwrap();
    let s = parse_powermetrics(&text);
    assert_eq!(s.iter().map(PowerSample::joules).sum::<f64>(), 4.5 + 6.0);
    assert!(parse_powermetrics("powermetrics must be invoked as the superuser\n").is_empty());
}

#[test]
fn a_meter_that_is_off_or_absent_is_none() {
    let off = EnergySettings {
        meter: MeterKind::None,
        ..EnergySettings::default()
    };
    assert!(open(&off).is_none());
    let dir = tempfile::tempdir().unwrap();
    let rapl = EnergySettings {
        meter: MeterKind::Rapl,
        rapl_root: powercap_copy(dir.path()),
        ..EnergySettings::default()
    };
    assert_eq!(open(&rapl).unwrap().name(), "rapl");
    #[cfg(not(target_os = "macos"))]
    assert!(open(&EnergySettings {
        meter: MeterKind::Powermetrics,
        ..EnergySettings::default()
    })
    .is_none());
}
