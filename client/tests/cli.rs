//! The `mlxnet` binary as a user runs it, before any coordinator answers:
//! a bad key or an unreachable coordinator is a clear error and exit code 1.
//! (The binary against a real coordinator and real nodes is in
//! `tests/tests/it/`, which runs this same build of it: Cargo builds a
//! package's binaries for its integration tests, so these tests are also
//! what puts `mlxnet` beside the workspace's test binaries.)

// A test crate: its helper panics on a broken fixture, as its tests do.
#![allow(clippy::expect_used, reason = "a test crate")]

use std::process::{Command, Output};

fn mlxnet(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_mlxnet"))
        .args(args)
        .env_remove("MLXNET_API_KEY")
        .env_remove("MLXNET_COORDINATOR")
        .output()
        .expect("running mlxnet")
}

#[test]
fn an_api_key_that_is_not_printable_ascii_is_refused_before_any_call() {
    let out = mlxnet(&["--api-key", "clé\n", "balance"]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(err.contains("the API key must be printable ASCII"), "{err}");
}

#[test]
fn an_unreachable_coordinator_is_named_in_the_error() {
    // A port nothing listens on: bound, then released.
    let addr = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("a free port");
    let url = format!("http://{addr}");
    let out = mlxnet(&["--coordinator", &url, "balance"]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(
        err.contains(&format!("cannot reach the coordinator at {url}")),
        "{err}"
    );
}
