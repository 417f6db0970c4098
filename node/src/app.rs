//! The node agent as one value: [`Node::build`] does everything that can
//! fail at start-up (config checks, identity, hardware profile, model
//! digests, engines), then [`Node::run_until`] keeps the link to the
//! coordinator up until the shutdown future resolves.
//!
//! # Invariants
//! - A built node has a valid pin, an identity on disk and every model
//!   hashed and loaded; running it only dials.
//! - `run_until` returns after the connection is closed gracefully, so the
//!   coordinator sees the node leave at once instead of timing it out.
//!
//! # Failure
//! [`NodeError`] says which start-up step failed and why (each wraps the
//! module's own error).

use std::{future::Future, sync::Arc, time::Duration};

use mlxnet_proto::{
    ids::NodeId,
    v1::{BatchCapacity, BatchPoint as WireBatchPoint, HardwareProfile},
};
use tokio::sync::{watch, Semaphore};
use tokio_util::sync::CancellationToken;

use crate::{
    collectives::tcp::PeerAuth,
    config::{ConfigError, NodeConfig},
    hardware::{self, HardwareError},
    identity::{Identity, IdentityError},
    link::{self, LinkContext, LinkError, LinkStatus},
    models::{store::ModelStore, BatchSettings, HeldModel, ModelError, ModelSet},
    pod::{
        hostfile::PodConfig,
        runtime::{PodError, PodRuntime, PodSetup},
    },
    policy::{Decision, Policy, SignalSource, SystemSignals},
    status::{Board, HeldModelView, Snapshot},
};

/// Why the node could not start or run.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum NodeError {
    #[error("configuration: {0}")]
    Config(#[from] ConfigError),
    #[error("identity: {0}")]
    Identity(#[from] IdentityError),
    #[error("hardware profile: {0}")]
    Hardware(#[from] HardwareError),
    #[error("{0}")]
    Model(#[from] ModelError),
    #[error("link: {0}")]
    Link(#[from] LinkError),
    #[error("start-up task failed: {0}")]
    Task(#[from] tokio::task::JoinError),
    #[error("cannot listen for shutdown signals: {0}")]
    Signal(std::io::Error),
    #[error("pod: {0}")]
    Pod(#[from] PodError),
    #[error("{0}")]
    Device(#[from] crate::engine::device::DeviceError),
    #[error("lending schedule: {0}")]
    Schedule(#[from] crate::policy::ScheduleError),
}

/// A node ready to dial its coordinator.
pub struct Node {
    ctx: Arc<LinkContext>,
    status_tx: watch::Sender<LinkStatus>,
    status_rx: watch::Receiver<LinkStatus>,
    policy: Policy,
    signals: Box<dyn SignalSource>,
    poll: Duration,
    lending_tx: watch::Sender<Option<Decision>>,
    status_file: std::path::PathBuf,
}

impl Node {
    /// Checks the config, loads (or creates) the identity, profiles the
    /// hardware, hashes the model files and loads their engines.
    pub async fn build(config: NodeConfig) -> Result<Node, NodeError> {
        config.validate()?;
        let pins: Vec<&str> = config.coordinator_fingerprint.iter().collect();
        let client_config = link::tls::client_config_pinning(&pins)?;
        let policy = Policy::new(config.mode, &config.lending)?;
        let backend = crate::engine::device::resolve(config.device)?;
        if let Some(n) = config.effective_threads() {
            // Only the first pool in a process is built; later nodes in the
            // same process (tests) share it.
            if rayon::ThreadPoolBuilder::new()
                .num_threads(n)
                .build_global()
                .is_err()
            {
                tracing::debug!(threads = n, "compute thread pool already set up");
            }
        }
        let data_dir = config.data_dir.clone();
        let identity = Arc::new(
            tokio::task::spawn_blocking(move || Identity::load_or_create(&data_dir)).await??,
        );
        let mut hardware = tokio::task::spawn_blocking(hardware::detect).await??;
        let bench = config.data_dir.join(hardware::BENCH_FILE);
        match hardware::apply_bench(&mut hardware, &bench) {
            Ok(true) => tracing::info!(path = %bench.display(), "using measured bench figures"),
            Ok(false) => {}
            Err(e) => tracing::warn!(error = %e, "ignoring unreadable bench figures"),
        }
        let curve = hardware::read_batch_curve(&bench).unwrap_or_else(|e| {
            tracing::warn!(error = %e, "ignoring an unreadable batch curve");
            Vec::new()
        });
        let batch = batch_settings(&config, &hardware, &curve);
        let node_id = identity.node_id();
        let (models, pod) = match &config.pod {
            None => {
                let entries = config.models.clone();
                tracing::info!(device = %config.device, backend = backend.name(), "engine device");
                let dir = config.store.dir_in(&config.data_dir);
                let policy = config.store.policy();
                let models = tokio::task::spawn_blocking(move || {
                    let store = ModelStore::open(&dir, policy)
                        .map_err(|e| ModelError::Store(Box::new(e)))?;
                    ModelSet::load_with_store(&entries, Arc::new(store), batch, &backend)
                })
                .await??;
                (models, None)
            }
            Some(settings) => {
                // A pod member loads only its share, in the pod runtime.
                let entry = config.models[0].clone();
                let held = tokio::task::spawn_blocking(move || HeldModel::hash(&entry)).await??;
                let text =
                    std::fs::read_to_string(&settings.hostfile).map_err(|e| PodError::Read {
                        path: settings.hostfile.clone(),
                        reason: e.to_string(),
                    })?;
                let pod_config = PodConfig::parse(&text).map_err(PodError::Config)?;
                let auth = pod_config
                    .peer_auth(settings.rank, &identity)
                    .map_err(PodError::Config)?;
                if matches!(auth, PeerAuth::Open) {
                    tracing::warn!(
                        hostfile = %settings.hostfile.display(),
                        "the pod's data plane is not authenticated: any machine that reaches a \
                         member's port can take a rank; give every host its node_id in the hostfile"
                    );
                }
                let setup = PodSetup {
                    config: pod_config,
                    auth,
                    rank: settings.rank,
                    port: settings.port,
                    parallelism: settings.parallelism,
                    node_id: *node_id.as_bytes(),
                    memory_budget: settings
                        .memory_limit_bytes
                        .unwrap_or(hardware.free_memory_bytes.max(1)),
                    max_context: settings.max_context,
                    speed: settings.speed,
                    model: held.path.clone(),
                    compute: crate::engine::sharded::Compute::Native,
                    tcp: Default::default(),
                };
                tracing::info!(rank = settings.rank, hostfile = %settings.hostfile.display(), "forming the pod");
                let runtime =
                    tokio::task::spawn_blocking(move || PodRuntime::start(setup)).await??;
                (
                    ModelSet::default(),
                    Some(Arc::new(link::PodLink { runtime, held })),
                )
            }
        };
        let name = if config.name.trim().is_empty() {
            format!("node-{}", node_id.short())
        } else {
            config.name.trim().to_owned()
        };
        tracing::info!(%node_id, %name, models = models.len(), chip = %hardware.chip, "node built");
        // A pod runs one job at a time across its members (its batching is
        // the leader's to do); a single node takes as many as it batches.
        // A model on a GPU runs one sequence at a time: its batch says so.
        let slots = u32::try_from(models.slots().unwrap_or(batch.slots)).unwrap_or(u32::MAX);
        let max_concurrent_jobs = match &pod {
            Some(_) => 1,
            None => config.max_concurrent_jobs.unwrap_or(slots),
        };
        let capacity = pod.is_none().then(|| BatchCapacity {
            slots,
            kv_positions: models.kv_positions() as u64,
            throughput: curve
                .iter()
                .map(|p| WireBatchPoint {
                    streams: p.streams,
                    tokens_per_s: p.tokens_per_s,
                })
                .collect(),
        });
        let (status_tx, status_rx) = watch::channel(LinkStatus::Connecting);
        let (lending_tx, lending) = watch::channel(None);
        let energy_settings = config.energy.clone();
        let energy =
            tokio::task::spawn_blocking(move || crate::energy::open(&energy_settings)).await?;
        let board = Board::new(
            Snapshot {
                node_id: node_id.to_string(),
                name: name.clone(),
                version: link::AGENT_VERSION.into(),
                pid: std::process::id(),
                state: "connecting".into(),
                coordinator: config.coordinator.to_string(),
                mode: config.mode.to_string(),
                models: match &pod {
                    Some(p) => vec![HeldModelView {
                        id: p.held.id.clone(),
                        parameters: 0,
                        size_bytes: p.held.size_bytes,
                        backend: "cpu (pod)".into(),
                    }],
                    None => models
                        .all()
                        .iter()
                        .map(|m| HeldModelView {
                            id: m.held.id.clone(),
                            parameters: m.info.parameters,
                            size_bytes: m.held.size_bytes,
                            backend: m.backend.into(),
                        })
                        .collect(),
                },
                energy_meter: energy
                    .as_ref()
                    .map(|m| m.name().to_owned())
                    .unwrap_or_default(),
                ..Snapshot::default()
            },
            Some(&config.data_dir),
        );
        let ctx = LinkContext {
            identity: Arc::clone(&identity),
            models: Arc::new(models),
            hardware,
            coordinators: config.coordinator.iter().map(str::to_owned).collect(),
            client_config,
            name,
            mode: config.mode,
            operator_account: config.operator_account.clone(),
            location: config.location.clone(),
            test_cheat: config.test_cheat,
            connect_timeout: Duration::from_millis(config.connect_timeout_ms),
            reconnect_min: Duration::from_millis(config.reconnect_min_ms),
            reconnect_max: Duration::from_millis(config.reconnect_max_ms),
            slots: Arc::new(Semaphore::new(max_concurrent_jobs as usize)),
            max_concurrent_jobs,
            batch: capacity,
            pod,
            drain: Arc::default(),
            drain_grace: Duration::from_millis(config.drain_grace_ms),
            lending,
            pause_grace: Duration::from_millis(config.lending.grace_ms),
            memory_cap: config.lending.memory_cap_bytes,
            gpu_share: config.lending.gpu_share,
            board: board.clone(),
            energy,
        };
        Ok(Node {
            ctx: Arc::new(ctx),
            status_tx,
            status_rx,
            policy,
            signals: Box::new(SystemSignals::default()),
            poll: Duration::from_millis(config.lending.poll_ms),
            lending_tx,
            status_file: config.data_dir.join(crate::status::STATUS_FILE),
        })
    }

    /// The owner's view of this node (what `mlx-node status` shows).
    pub fn board(&self) -> Arc<Board> {
        self.ctx.board.clone()
    }

    /// Reads the lending signals from `source` instead of the operating
    /// system (tests inject an owner who comes and goes; see
    /// [`crate::policy::InjectedSignals`]).
    pub fn with_signals(mut self, source: Box<dyn SignalSource>) -> Self {
        self.signals = source;
        self
    }

    /// The node's id (its public key).
    pub fn node_id(&self) -> NodeId {
        self.ctx.identity.node_id()
    }

    /// The hardware profile sent to the coordinator.
    pub fn hardware(&self) -> &HardwareProfile {
        &self.ctx.hardware
    }

    /// Follows the link: Connecting, Registered, Disconnected{reason}.
    pub fn link_status(&self) -> watch::Receiver<LinkStatus> {
        self.status_rx.clone()
    }

    /// Keeps the link up (reconnecting as needed) until `shutdown` resolves,
    /// then closes it gracefully.
    pub async fn run_until(
        self,
        shutdown: impl Future<Output = ()> + Send + 'static,
    ) -> Result<(), NodeError> {
        let token = CancellationToken::new();
        let policy_stop = CancellationToken::new();
        let lender = tokio::spawn(crate::policy::run(
            self.policy,
            self.signals,
            self.poll,
            self.lending_tx,
            policy_stop.clone(),
        ));
        let writer = tokio::spawn(
            self.ctx
                .board
                .clone()
                .write_until(self.status_file.clone(), policy_stop.clone()),
        );
        let follower = tokio::spawn(follow_link(self.status_rx.clone(), self.ctx.board.clone()));
        let link = link::run(self.ctx.clone(), self.status_tx.clone(), token.clone());
        tokio::pin!(link);
        tokio::select! {
            _ = &mut link => {}
            _ = shutdown => {
                token.cancel();
                link.await;
            }
        }
        policy_stop.cancel();
        let _ = lender.await;
        follower.abort();
        let _ = writer.await;
        Ok(())
    }

    /// [`run_until`](Self::run_until) Ctrl-C or SIGTERM.
    pub async fn run_until_stopped(self) -> Result<(), NodeError> {
        let signal = shutdown_signal()?;
        self.run_until(signal).await
    }
}

/// Batch slots when neither the config nor a measured curve says.
pub const DEFAULT_BATCH_SLOTS: usize = 8;
/// Most KV cache taken by default.
const DEFAULT_KV_CACHE_MAX: u64 = 4 << 30;

/// How big each model's batch is: slots from the config, else from the
/// measured curve, else [`DEFAULT_BATCH_SLOTS`]; KV memory from the config,
/// else a quarter of the free memory (at most 4 GiB).
pub fn batch_settings(
    config: &NodeConfig,
    hardware: &HardwareProfile,
    curve: &[hardware::BatchPoint],
) -> BatchSettings {
    let slots = config
        .batch_slots
        .or_else(|| hardware::slots_from_curve(curve))
        .map_or(DEFAULT_BATCH_SLOTS, |s| s as usize);
    let kv_cache_bytes = config
        .kv_cache_bytes
        .unwrap_or((hardware.free_memory_bytes / 4).min(DEFAULT_KV_CACHE_MAX));
    BatchSettings {
        slots,
        kv_cache_bytes,
    }
}

/// Mirrors the link's status on the owner's board.
async fn follow_link(mut status: watch::Receiver<LinkStatus>, board: Arc<Board>) {
    loop {
        let (state, reason) = match &*status.borrow_and_update() {
            LinkStatus::Connecting => ("connecting", String::new()),
            LinkStatus::Registered { .. } => ("lending", String::new()),
            LinkStatus::Paused { reason } => ("paused", reason.clone()),
            LinkStatus::Disconnected { reason } => ("disconnected", reason.clone()),
        };
        board.set_state(state, &reason);
        if status.changed().await.is_err() {
            return;
        }
    }
}

/// Resolves on Ctrl-C, or SIGTERM (what launchd and systemd send).
#[cfg(unix)]
fn shutdown_signal() -> Result<impl Future<Output = ()> + Send + 'static, NodeError> {
    use tokio::signal::unix::{signal, SignalKind};
    let mut term = signal(SignalKind::terminate()).map_err(NodeError::Signal)?;
    Ok(async move {
        tokio::select! {
            _ = tokio::signal::ctrl_c() => {}
            _ = term.recv() => {}
        }
        tracing::info!("shutting down");
    })
}

/// Resolves on Ctrl-C.
#[cfg(not(unix))]
fn shutdown_signal() -> Result<impl Future<Output = ()> + Send + 'static, NodeError> {
    Ok(async {
        let _ = tokio::signal::ctrl_c().await;
        tracing::info!("shutting down");
    })
}
