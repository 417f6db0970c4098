//! The load run's smoke test: a real coordinator child, 20 virtual nodes
//! over QUIC, 8 jobs over gRPC; every job must complete with a claim that
//! verifies (`--require-all`). No timing is asserted.
#![allow(clippy::unwrap_used, reason = "test code")]

#[test]
fn twenty_nodes_complete_every_job_with_a_verified_claim() {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_mlxnet-load"))
        .args([
            "--nodes",
            "20",
            "--jobs",
            "8",
            "--rate",
            "20",
            "--heartbeat-ms",
            "500",
            "--settle-beats",
            "1",
            "--require-all",
        ])
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        stdout.contains("jobs completed with a verified claim: 8/8"),
        "{stdout}"
    );
}

/// The process-kill run, small: the coordinator killed with SIGKILL 4
/// times under load and restarted on the same database; no job may be left
/// unended or missing, the books must hold, every claim must verify (the
/// binary exits non-zero otherwise), and jobs must have run across kills.
#[test]
fn four_coordinator_kills_under_load_lose_no_job_and_pay_nothing_twice() {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_mlxnet-load"))
        .args([
            "--kills",
            "4",
            "--kill-every-ms",
            "1500",
            "--nodes",
            "12",
            "--rate",
            "8",
            "--max-tokens",
            "24",
            "--settle-s",
            "240",
        ])
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    for line in [
        "jobs not ended after the settle time (lost)                       0",
        "ledger violations (double payments, holds)                        0",
    ] {
        assert!(stdout.contains(line), "{line:?} not in\n{stdout}");
    }
    assert!(stdout.contains("process-kill run: 4 kills"), "{stdout}");
}
