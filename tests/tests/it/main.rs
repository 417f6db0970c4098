//! End-to-end tests: real coordinators, real nodes running the real SmolLM2
//! model, real QUIC and gRPC on ports the OS chose, a fresh database each.
//! One binary; the harness is the `mlxnet_tests` library.

mod affinity;
mod audit;
mod audit_driver;
mod auth;
mod client_cli;
mod crash;
mod devnet;
mod energy;
mod failover;
mod fleet;
mod handoff;
mod jobs;
mod ledger;
mod models;
mod openai;
mod owner;
mod pod;
mod relay;
mod replica_kill;
mod restart;
mod rewards;
mod validation;
mod world;
