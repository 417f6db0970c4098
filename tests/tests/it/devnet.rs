//! The README's "run it" command: the devnet prints a generated answer.

use std::process::Command;

#[test]
fn devnet_runs_a_sample_job_and_prints_the_answer() {
    mlxnet_tests::test_model();
    let dir = tempfile::tempdir().unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_devnet"))
        .args(["--ephemeral-ports", "--exit-after-sample", "--data-dir"])
        .arg(dir.path())
        .output()
        .expect("devnet runs");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "devnet failed: {stdout}\n{stderr}");
    assert!(stdout.contains("Paris"), "no answer in: {stdout}");
    assert!(
        stdout.contains("verified: signed by "),
        "no verified claim in: {stdout}"
    );
    assert!(stdout.contains("registered at Lyon, France"), "{stdout}");
    // A newcomer's World page shows the devnet's Mac on the map.
    assert!(stdout.contains(": 1 Mac(s) on the map"), "{stdout}");
    // The demo client's key is printed, and the sample job was paid for.
    assert!(stdout.contains("API key (submit, read)  mlxk_"), "{stdout}");
    let earned = stdout
        .lines()
        .find_map(|l| l.strip_prefix("operator earned: "))
        .expect("devnet prints the operator's earnings");
    assert!(
        !earned.starts_with("0 ") && earned.contains("for 1 jobs"),
        "{earned}"
    );
}
