//! The `mlx-node` binary as its owner runs it: each command's output, exit
//! code and error text. (`mlx-node run` against a real coordinator, and its
//! SIGTERM drain, are in the tests crate, which has a coordinator.)
//!
//! Exit codes: 0 on success; 1 for an error the command reports (anyhow
//! from `main`, printed as `Error: ...` with its causes); 2 for flags clap
//! refuses.

// A test crate: its helpers panic on a broken fixture, as its tests do.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

fn mlx_node() -> Command {
    Command::new(env!("CARGO_BIN_EXE_mlx-node"))
}

fn run(cmd: &mut Command) -> Output {
    let out = cmd.output().expect("the mlx-node binary runs");
    eprintln!(
        "{cmd:?}: {:?}\nstdout: {}\nstderr: {}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    out
}

fn stdout(out: &Output) -> String {
    String::from_utf8_lossy(&out.stdout).into_owned()
}

fn stderr(out: &Output) -> String {
    String::from_utf8_lossy(&out.stderr).into_owned()
}

fn test_model() -> PathBuf {
    let path = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("..")
        .join("models")
        .join("SmolLM2-135M-Instruct.Q4_1.gguf");
    assert!(
        path.is_file(),
        "the test model {} is missing: run scripts/fetch-test-model.sh",
        path.display()
    );
    path
}

#[test]
fn id_creates_the_key_once_and_prints_the_same_id() {
    let dir = tempfile::tempdir().unwrap();
    let first = run(mlx_node().args(["id", "--data-dir"]).arg(dir.path()));
    assert_eq!(first.status.code(), Some(0));
    let id = stdout(&first).trim().to_owned();
    assert_eq!(id.len(), 64, "an ed25519 public key in hex: {id:?}");
    assert!(id.bytes().all(|b| b.is_ascii_hexdigit()), "{id:?}");
    let again = run(mlx_node().args(["id", "--data-dir"]).arg(dir.path()));
    assert_eq!(stdout(&again).trim(), id, "the key is kept");
    let other = tempfile::tempdir().unwrap();
    let elsewhere = run(mlx_node().args(["id", "--data-dir"]).arg(other.path()));
    assert_ne!(stdout(&elsewhere).trim(), id, "a new data dir, a new key");
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        let mode = std::fs::metadata(dir.path().join("node.key"))
            .unwrap()
            .permissions()
            .mode();
        assert_eq!(mode & 0o777, 0o600, "the key is the owner's alone");
    }
}

#[test]
fn hardware_prints_the_profile_as_json() {
    let out = run(mlx_node().arg("hardware"));
    assert_eq!(out.status.code(), Some(0));
    let v: serde_json::Value = serde_json::from_str(&stdout(&out)).expect("JSON");
    assert!(v["memory_bytes"].as_u64().unwrap_or(0) > 0, "{v}");
    assert!(v["cpu_cores"].as_u64().unwrap_or(0) > 0, "{v}");
    assert_eq!(v["arch"].as_str(), Some(std::env::consts::ARCH), "{v}");
}

#[test]
fn generate_answers_from_the_real_model() {
    let model = test_model();
    let out = run(mlx_node()
        .args([
            "generate",
            "--threads",
            "1",
            "--max-tokens",
            "64",
            "--model",
        ])
        .arg(&model)
        .args([
            "--chat",
            "--system",
            "You are a helpful assistant.",
            "What is the capital of France?",
        ]));
    assert_eq!(out.status.code(), Some(0));
    assert!(stdout(&out).contains("Paris"), "{}", stdout(&out));
}

#[test]
fn errors_exit_1_and_say_what_failed() {
    let dir = tempfile::tempdir().unwrap();
    let missing = dir.path().join("nope.gguf");
    let out = run(mlx_node()
        .args(["generate", "--model"])
        .arg(&missing)
        .arg("hi"));
    assert_eq!(out.status.code(), Some(1));
    assert!(stderr(&out).contains("nope.gguf"), "{}", stderr(&out));

    // A coordinator nobody listens on (port 1 is never served here).
    let out = run(mlx_node()
        .args(["earnings", "--grpc", "http://127.0.0.1:1", "--api-key", "k"])
        .arg("--data-dir")
        .arg(dir.path())
        .env_remove("MLXNET_API_KEY")
        .env_remove("MLXNET_COORDINATOR"));
    assert_eq!(out.status.code(), Some(1));
    assert!(
        stderr(&out).contains("cannot reach the coordinator at http://127.0.0.1:1"),
        "{}",
        stderr(&out)
    );

    // `run` without the coordinator's fingerprint names the flag to pass.
    let out = run(mlx_node()
        .args(["run", "--coordinator", "127.0.0.1:7071", "--data-dir"])
        .arg(dir.path())
        .env_remove("MLX_NODE__COORDINATOR_FINGERPRINT"));
    assert_eq!(out.status.code(), Some(1));
    assert!(
        stderr(&out).contains("coordinator_fingerprint is not set: pass --fingerprint"),
        "{}",
        stderr(&out)
    );
    let out = run(mlx_node()
        .args([
            "run",
            "--coordinator",
            "127.0.0.1:7071",
            "--fingerprint",
            "not-hex",
            "--data-dir",
        ])
        .arg(dir.path()));
    assert_eq!(out.status.code(), Some(1));
    assert!(
        stderr(&out).contains("must be 64 lowercase hex digits"),
        "{}",
        stderr(&out)
    );
    // An unknown MLX_NODE__ variable is an error, not silently ignored.
    let out = run(mlx_node()
        .args(["id", "--data-dir"])
        .arg(dir.path())
        .env("MLX_NODE__NO_SUCH_KEY", "1"));
    assert_eq!(out.status.code(), Some(1));
    assert!(
        stderr(&out).contains("unknown environment variable MLX_NODE__NO_SUCH_KEY"),
        "{}",
        stderr(&out)
    );

    let out = run(mlx_node()
        .args(["doctor", "--pod"])
        .arg(dir.path().join("missing.json")));
    assert_eq!(out.status.code(), Some(1));
    assert!(stderr(&out).contains("missing.json"), "{}", stderr(&out));
}

#[test]
fn bad_flags_exit_2_with_usage() {
    let out = run(mlx_node().arg("no-such-command"));
    assert_eq!(out.status.code(), Some(2));
    assert!(stderr(&out).contains("Usage"), "{}", stderr(&out));
    // --rank needs --pod.
    let out = run(mlx_node().args(["run", "--rank", "1"]));
    assert_eq!(out.status.code(), Some(2));
    assert!(stderr(&out).contains("--pod"), "{}", stderr(&out));
    // `earnings` needs an API key (flag or MLXNET_API_KEY).
    let out = run(mlx_node().arg("earnings").env_remove("MLXNET_API_KEY"));
    assert_eq!(out.status.code(), Some(2));
    assert!(stderr(&out).contains("--api-key"), "{}", stderr(&out));
}
