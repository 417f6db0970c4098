//! The QUIC link to the coordinator: dial with a pinned certificate, prove
//! the node's key, register, heartbeat, run the jobs the coordinator sends,
//! and reconnect with backoff whenever the link drops.
//!
//! # Flow (see `proto/mlxnet/v1/node.proto`)
//! 1. Dial `coordinator` (QUIC, ALPN `mlxnet/1`, certificate pinned by
//!    SHA-256: [`tls`]).
//! 2. Control stream: the node opens the first bidirectional stream and
//!    writes first, because a QUIC stream becomes visible to the peer only
//!    once data is sent. Its first frame is `NodeControl.open` (`Open`
//!    carrying the agent version); the coordinator answers with a
//!    `Challenge`.
//! 3. The node signs `auth::transcript(nonce, exporter)`, `exporter` being
//!    32 bytes of TLS keying material exported from this connection with
//!    `auth::EXPORTER_LABEL` and an empty context, and sends `Hello` (id,
//!    signature, hardware, models with digests, version, job slots, name).
//! 4. `Welcome` -> [`LinkStatus::Registered`]; `Rejected` -> the link ends
//!    with the coordinator's reason and is retried with backoff.
//! 5. Heartbeat every `Welcome.heartbeat_interval_ms` with free memory and
//!    running jobs; the coordinator acknowledges each.
//! 6. Each job arrives on a bidirectional stream the coordinator opens
//!    ([`job`]); resetting it cancels the job.
//!
//! # Invariants
//! - At most one session at a time; `link_status` always says which phase
//!   the link is in.
//! - The engine thread never waits on the network: tokens go through a
//!   bounded channel and are coalesced while it is full.
//! - Shutdown drains ([`drain`]): `Drain` is sent at once and no job is
//!   taken after it; running jobs get `drain_grace` to finish, then hand
//!   their streamed tokens back (partial claims) so they resume elsewhere;
//!   then the connection is closed with code 0 and the node waits (briefly)
//!   for the close to be delivered.
//! - A pause of lending (`crate::policy`: the owner returned, the battery,
//!   the heat, the schedule) drains the same way with `lending.grace_ms`,
//!   then closes the session ([`LinkStatus::Paused`]); the node is off the
//!   network (it takes no job and earns no availability reward) until
//!   lending resumes, and then dials again at once.
//!
//! - Several coordinator addresses (replicas) are tried in turn
//!   ([`targets`]): each session goes to the next, so a node whose replica
//!   went away moves to another. A replica that drains sends `Reconnect`:
//!   the node drains its session as for a pause (with the hint's grace),
//!   then dials the next address at once, with no delay.
//!
//! # Failure
//! Every way a session ends is a [`LinkError`]; the reconnect loop reports
//! it in [`LinkStatus::Disconnected`] and dials the next address after a
//! jittered exponential delay (`reconnect_min_ms`..`reconnect_max_ms`),
//! reset once a session has registered.

use std::{sync::Arc, time::Duration};

use mlxnet_proto::{frame::FrameError, v1::HardwareProfile};
use rand::{rngs::StdRng, SeedableRng};
use tokio::sync::{watch, Semaphore};
use tokio_util::sync::CancellationToken;

use crate::{
    config::{ConfigError, Location, NodeMode},
    identity::Identity,
    models::ModelSet,
};

pub mod backoff;
pub mod drain;
pub mod job;
pub mod session;
pub mod targets;
pub mod tls;

/// Version string sent in `Open` and `Hello`.
pub const AGENT_VERSION: &str = concat!("mlx-node/", env!("CARGO_PKG_VERSION"));

/// Where the link stands.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LinkStatus {
    /// Dialing, or handshaking with, the coordinator.
    Connecting,
    /// Welcomed by the coordinator; taking jobs.
    Registered {
        /// The heartbeat interval the coordinator asked for.
        heartbeat_interval: Duration,
        /// The address of the coordinator (replica) the node is linked to.
        coordinator: std::net::SocketAddr,
    },
    /// Not linked; `reason` says why (the next attempt follows after a delay,
    /// unless the node is shutting down).
    Disconnected { reason: String },
    /// Lending is paused (`reason` as the policy says it, e.g. "you are
    /// using the Mac"): draining, or off the network until it resumes.
    Paused { reason: String },
}

/// Why a session with the coordinator failed or ended.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum LinkError {
    #[error("{0}")]
    Config(#[from] ConfigError),
    #[error("tls configuration: {0}")]
    Tls(rustls::Error),
    #[error("quic tls configuration: {0}")]
    QuicTls(String),
    #[error("cannot resolve coordinator address {addr}: {source}")]
    Resolve {
        addr: String,
        source: std::io::Error,
    },
    #[error("coordinator address {0} resolved to nothing")]
    NoAddress(String),
    #[error("cannot open a local udp socket: {0}")]
    Endpoint(std::io::Error),
    #[error("cannot dial coordinator: {0}")]
    Connect(#[from] quinn::ConnectError),
    #[error("connection to coordinator: {0}")]
    Connection(#[from] quinn::ConnectionError),
    #[error("timed out {0}")]
    Timeout(&'static str),
    #[error("control stream: {0}")]
    Frame(#[from] FrameError),
    #[error("coordinator sent {got} where {expected} was expected")]
    Unexpected { expected: &'static str, got: String },
    #[error("coordinator sent a {0}-byte challenge nonce, expected 32")]
    BadNonce(usize),
    #[error("cannot export tls keying material for the handshake proof")]
    Exporter,
    #[error("rejected by the coordinator: {0}")]
    Rejected(String),
    #[error("coordinator stopped answering heartbeats for {0:?}")]
    HeartbeatTimeout(Duration),
    #[error("coordinator closed the control stream")]
    ControlClosed,
}

/// What a link needs, shared by the session and its job tasks.
pub struct LinkContext {
    pub identity: Arc<Identity>,
    pub models: Arc<ModelSet>,
    pub hardware: HardwareProfile,
    /// The coordinator's addresses, `host:port` each (its replicas; a name
    /// may resolve to several), tried in turn ([`targets`]).
    pub coordinators: Vec<String>,
    pub client_config: quinn::ClientConfig,
    pub name: String,
    pub mode: NodeMode,
    /// Ledger account the node earns for (empty: the coordinator decides).
    pub operator_account: String,
    pub location: Option<Location>,
    pub max_concurrent_jobs: u32,
    /// How the node batches (sent in Hello); `None` on a pod member.
    pub batch: Option<mlxnet_proto::v1::BatchCapacity>,
    /// See [`crate::config::NodeConfig::test_cheat`].
    pub test_cheat: bool,
    pub connect_timeout: Duration,
    pub reconnect_min: Duration,
    pub reconnect_max: Duration,
    /// One permit per job slot; shared across sessions, so a job still
    /// finishing from a dropped session keeps its slot.
    pub slots: Arc<Semaphore>,
    /// Set on shutdown: no new jobs, then hand-off (see [`drain`]).
    pub drain: Arc<drain::DrainState>,
    /// How long running jobs may go on once the node drains.
    pub drain_grace: Duration,
    /// Whether the policy lends now (`None`: not read yet, which does not lend).
    pub lending: crate::policy::Lending,
    /// How long running jobs may go on once lending pauses.
    pub pause_grace: Duration,
    /// The most free memory the node reports (`lending.memory_cap_bytes`).
    pub memory_cap: Option<u64>,
    /// Most of the time a GPU engine computes (`lending.gpu_share`).
    pub gpu_share: Option<f64>,
    /// The owner's view of the node (`mlx-node status`).
    pub board: Arc<crate::status::Board>,
    /// The energy meter, when there is one.
    pub energy: Option<Arc<dyn crate::energy::EnergyMeter>>,
    /// Set on a pod member: its pod and the one model the pod serves.
    pub pod: Option<Arc<PodLink>>,
}

/// A pod member's side of the link: the leader runs the coordinator's jobs
/// across the pod; every member reports the pod in its Hello.
#[derive(Debug)]
pub struct PodLink {
    pub runtime: Arc<crate::pod::runtime::PodRuntime>,
    pub held: crate::models::HeldModel,
}

impl LinkContext {
    /// Free memory as reported to the coordinator: measured, at most the
    /// machine's total and the owner's cap.
    pub fn offered_memory(&self, free: u64) -> u64 {
        let free = free.min(self.hardware.memory_bytes);
        self.memory_cap.map_or(free, |cap| free.min(cap))
    }

    /// Why lending is paused now, if it is.
    pub fn pause_reason(&self) -> Option<String> {
        match &*self.lending.borrow() {
            Some(crate::policy::Decision::Lend) => None,
            Some(crate::policy::Decision::Pause(why)) => Some(why.to_string()),
            None => Some("reading the lending signals".into()),
        }
    }

    /// Jobs running now.
    pub fn running_jobs(&self) -> u32 {
        let free = self.slots.available_permits() as u32;
        self.max_concurrent_jobs.saturating_sub(free)
    }
}

/// Keeps a session with the coordinator up until `shutdown` is cancelled.
pub async fn run(
    ctx: Arc<LinkContext>,
    status: watch::Sender<LinkStatus>,
    shutdown: CancellationToken,
) {
    let mut backoff =
        backoff::Backoff::new(ctx.reconnect_min, ctx.reconnect_max, StdRng::from_entropy());
    let mut lending = ctx.lending.clone();
    let mut targets = targets::Targets::new(ctx.coordinators.clone());
    loop {
        if shutdown.is_cancelled() {
            break;
        }
        if let Some(reason) = ctx.pause_reason() {
            status.send_replace(LinkStatus::Paused { reason });
            // Wait for the next decision (and show its reason while paused).
            tokio::select! {
                _ = shutdown.cancelled() => break,
                r = lending.changed() => {
                    if r.is_err() {
                        break; // the policy is gone: the node is stopping
                    }
                    continue;
                }
            }
        }
        // The last session ended with no job left: take jobs again.
        ctx.drain.reopen();
        status.send_replace(LinkStatus::Connecting);
        let mut registered = false;
        // Every session goes to the next address: one whose replica went
        // away is not dialed again before the others were tried.
        let outcome = match targets.next().await {
            Ok(target) => session::run(&ctx, &target, &status, &shutdown, &mut registered)
                .await
                .map_err(|e| (e, Some(target))),
            Err(e) => Err((e, None)),
        };
        match outcome {
            Ok(session::Ended::Shutdown) => break,
            Ok(session::Ended::Paused) => continue,
            Ok(session::Ended::Moved) => {
                tracing::info!("the coordinator replica drains: moving to another address");
                backoff.reset();
                continue;
            }
            Err((err, target)) => {
                let at = target.map(|t| t.addr.to_string()).unwrap_or_default();
                tracing::warn!(error = %err, coordinator = %at, "link to coordinator lost");
                status.send_replace(LinkStatus::Disconnected {
                    reason: err.to_string(),
                });
            }
        }
        if registered {
            backoff.reset();
        }
        let delay = backoff.next_delay();
        tracing::debug!(?delay, "reconnecting after delay");
        tokio::select! {
            _ = shutdown.cancelled() => break,
            _ = tokio::time::sleep(delay) => {}
        }
    }
    status.send_replace(LinkStatus::Disconnected {
        reason: "node shut down".into(),
    });
}

#[cfg(test)]
mod tests;
