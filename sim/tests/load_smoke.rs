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

/// PostgreSQL restarted (immediate mode, as a crash) 8 times under load
/// while the coordinator keeps running: no job lost, the books hold, and
/// every watcher is sent its job's end (a watch silent after its job ended
/// fails the run). The server is this test's own, started and stopped by
/// `scripts/pg-test-server.sh`, so no other test sees the restarts. Runs
/// where the PostgreSQL tests run (`MLXNET_TEST_DATABASE_URL` set; CI
/// must).
#[test]
fn postgres_restarts_under_load_lose_no_job_and_every_watcher_sees_the_end() {
    if std::env::var("MLXNET_TEST_DATABASE_URL").map_or(true, |u| u.is_empty()) {
        assert!(
            std::env::var_os("CI").is_none(),
            "MLXNET_TEST_DATABASE_URL is not set: CI must run the PostgreSQL tests"
        );
        eprintln!("skipped: MLXNET_TEST_DATABASE_URL is not set");
        return;
    }
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/../scripts/pg-test-server.sh");
    let dir_file = tempfile_path("pg-dir");
    let started = std::process::Command::new(script)
        .env("PGTEST_DIR_FILE", &dir_file)
        .output()
        .unwrap();
    assert!(
        started.status.success(),
        "{}",
        String::from_utf8_lossy(&started.stderr)
    );
    let url = String::from_utf8(started.stdout).unwrap().trim().to_owned();
    let dir = std::fs::read_to_string(&dir_file)
        .unwrap()
        .trim()
        .to_owned();
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_mlxnet-load"))
        .args([
            "--kills",
            "8",
            "--kill-every-ms",
            "2000",
            "--nodes",
            "12",
            "--rate",
            "8",
            "--max-tokens",
            "24",
            "--settle-s",
            "120",
            "--postgres",
            &url,
            "--restart-postgres",
            &format!("{script} restart {dir}"),
        ])
        .output()
        .unwrap();
    let _ = std::process::Command::new(script)
        .args(["stop", &dir])
        .status();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        stdout.contains("process-kill run: 8 PostgreSQL restarts"),
        "{stdout}"
    );
}

/// A fresh path under the temp directory for this process.
fn tempfile_path(what: &str) -> std::path::PathBuf {
    std::env::temp_dir().join(format!("mlxnet-load-smoke-{}-{what}", std::process::id()))
}
