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
