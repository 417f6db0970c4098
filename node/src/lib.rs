//! mlx-node: lends a Mac to mlx-network and runs whole inference jobs.
//!
//! # Layout
//! - [`config`]: the node's layered configuration ([`config::NodeConfig`]).
//! - [`identity`]: the node's ed25519 key (its id), created on first run.
//! - [`hardware`]: the hardware profile (Linux `/proc`; macOS `sysctl` and
//!   `system_profiler -json`, parsed by pure functions).
//! - [`models`]: model files the node holds, identified by SHA-256.
//! - [`engine`]: inference on candle-core: Llama-family model code, GGUF and
//!   safetensors loading, tokenizer, chat template, sampling.
//! - [`link`]: the QUIC link to the coordinator (pinned certificate, handshake,
//!   heartbeat, reconnect, one stream per job).
//! - [`earnings`]: `mlx-node earnings`, read from the coordinator's accounts service.
//! - [`energy`]: the energy of each job (RAPL on Linux, `powermetrics` on macOS).
//! - [`status`]: the owner's view (`mlx-node status`): the running node's
//!   board, its journal of finished jobs, and the live terminal view.
//! - [`pod`]: pod membership (MLX hostfile / JACCL device file) and the
//!   sharding plan.
//! - [`policy`]: when the machine is lent (dedicated, idle, schedule;
//!   power, heat) from signals parsed by pure functions.
//! - [`collectives`]: all-reduce, all-gather, broadcast, send/recv and barrier
//!   among pod members (TCP, emulated RDMA fabric, RDMA verbs).
//! - [`doctor`]: `mlx-node doctor`: what the machine lacks (macOS version,
//!   RDMA, Thunderbolt 5, GPU build, energy meter).
//! - [`service`]: `mlx-node service`: the launchd agent / systemd unit
//!   written from the node's config.
//! - [`app`]: [`app::Node::build`] / `run_until_stopped`, what `main` calls.
//! - `test_utils` (tests, and the `test-utils` feature): the workspace, its
//!   test model, bench settings, tiny model writers.

pub mod app;
pub mod collectives;
pub mod config;
pub mod doctor;
pub mod earnings;
pub mod energy;
pub mod engine;
pub mod hardware;
pub mod identity;
pub mod link;
pub mod models;
pub mod pod;
pub mod policy;
pub mod service;
pub mod status;
#[cfg(any(test, feature = "test-utils"))]
#[allow(
    clippy::unwrap_used,
    reason = "test harness: a failed unwrap is a failed test"
)]
pub mod test_utils;
