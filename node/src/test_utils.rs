//! Helpers for tests and benches (compiled for the crate's own tests, and
//! for others with the `test-utils` feature): the workspace and its test
//! model, bench settings from the environment, and writers of tiny
//! random-weight model files (`engine::testutil`).

use std::path::{Path, PathBuf};

pub use crate::engine::testutil::*;

/// File name of the real test model (SmolLM2-135M-Instruct Q4_1) under the
/// workspace's `models/` (fetched by `scripts/fetch-test-model.sh`).
pub const TEST_MODEL_FILE: &str = "SmolLM2-135M-Instruct.Q4_1.gguf";

/// The workspace root.
pub fn workspace() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .map(Path::to_path_buf)
        .unwrap_or_else(|| PathBuf::from("."))
}

/// Where the real test model is (it may be missing: see [`TEST_MODEL_FILE`]).
pub fn test_model_path() -> PathBuf {
    workspace().join("models").join(TEST_MODEL_FILE)
}

/// A non-empty environment setting.
pub fn setting(name: &str) -> Option<String> {
    std::env::var(name).ok().filter(|v| !v.is_empty())
}
