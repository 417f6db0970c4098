//! mlx-network coordinator: takes client jobs over gRPC, hands each whole to
//! one node over QUIC, verifies the node's signed result, and keeps nodes and
//! jobs in SQLite.
//!
//! # Layout
//! - [`config`]: layered configuration (defaults, TOML file, `MLXNET__*` env, flags);
//!   [`cli`]: the binary's flags and subcommands (the last layer).
//! - [`app`]: [`app::Application`]: binds every listener, runs until shutdown.
//! - [`api`]: the gRPC client API (jobs, models, network, accounts, health, reflection).
//! - [`link`]: the QUIC node link: TLS identity, handshake, sessions, job streams.
//! - [`dispatch`]: shared state; queues, places and drives jobs; audits;
//!   the ledger's periodic sweep; cancels.
//! - [`scheduler`]: placement as a pure module: capability and cost models,
//!   the indexed fleet and its decisions, the fair-share queue.
//! - [`jobs`]: the live event hub behind Watch.
//! - [`relay`]: running jobs' tokens between replicas (batched into the
//!   database, `LISTEN/NOTIFY` wake-ups, polling as the fallback).
//! - [`audit`]: which completed jobs are re-scored on another node, node
//!   records and bans; pay is held until a job's audit window closes.
//! - [`ledger`]: accounts, two-phase transfers, API keys, job holds and settlement.
//! - [`store`]: persistence behind the `Store` trait (SQLite backend; a
//!   conformance suite every backend passes), every transition guarded by
//!   current state.
//! - [`catalogue`]: the models jobs may name, pinned by file digest.
//! - [`http`]: `/healthz`, `/readyz`, `/metrics`; [`metrics`]: the counters, histograms and gauges (prometheus-client).
//! - [`openai`]: the OpenAI-compatible HTTP API under `/v1` (on the HTTP
//!   listener, through the client API's job pipeline).
//! - [`world`]: the World page (map of every node), its JSON API and live stream.
//! - [`domain`]: the values every layer speaks in (jobs, nodes, money, keys).
//! - [`util`]: the lock, error-chain and clock helpers.
#![forbid(unsafe_code)]

pub mod api;
pub mod app;
pub mod audit;
pub mod catalogue;
pub mod cli;
pub mod config;
#[cfg(test)]
mod deploy_tests;
pub mod dispatch;
pub mod domain;
pub mod http;
pub mod jobs;
#[cfg(test)]
mod layering_tests;
pub mod ledger;
pub mod link;
pub mod metrics;
pub mod openai;
pub mod relay;
pub mod scheduler;
pub mod store;
#[cfg(any(test, feature = "test-utils"))]
#[allow(
    clippy::unwrap_used,
    reason = "test harness: a failed unwrap is a failed test"
)]
pub mod test_utils;
pub mod util;
pub mod world;

pub use app::Application;
pub use config::CoordinatorConfig;
