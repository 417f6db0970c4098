//! The pod at run time: forming it from the hostfile, loading each rank's
//! share of the model, and running the leader's jobs across it.
//!
//! Every member runs one `mlx-node run` with the same hostfile and its own
//! rank. Each starts a dedicated thread ([`PodRuntime::start`]) that:
//! 1. forms the TCP data plane (rank `r` listens on `hosts[r].ips[0]` at
//!    `port + r`, see [`super::links`]) and moves it onto RDMA when the
//!    hostfile's `rdma` matrix cables every pair and the devices open
//!    ([`super::dataplane`]);
//! 2. exchanges a record per member (node id, memory budget, wanted
//!    parallelism, speed: measured by [`super::speed::probe`] or
//!    configured); rank 0's parallelism wins, so the members cannot
//!    disagree;
//! 3. rank 0 measures every link (latency, bandwidth);
//! 4. every rank computes the same plan from the same gathered records
//!    (tensor: KV-head groups and feed-forward columns in proportion to the
//!    members' speeds, [`super::speed::plan_weights`]; pipeline: layers in
//!    proportion to the members' budgets), checks its share
//!    against its memory budget and loads only its slices; then all ranks
//!    exchange whether they loaded, so one rank's refusal fails formation
//!    on every rank with that rank's reason;
//! 5. serves. The leader takes jobs from the node's link
//!    ([`PodRuntime::submit`]) and drives generation: per step it
//!    broadcasts a command (reset, forward `n` tokens, idle) and the tokens,
//!    all ranks run the step, rank 0 samples. While idle the leader
//!    broadcasts an idle command every [`IDLE_TICK`], which keeps the
//!    members inside the collectives' progress timeout and detects a lost
//!    member between jobs too.
//!
//! Which parallelism: forced by config, or by the links (RDMA: tensor;
//! TCP only: pipeline).
//!
//! # Invariants
//! - Every rank executes the leader's commands in the leader's order; the
//!   collectives' headers catch any divergence as an error, never a hang.
//! - A job the leader accepts either ends with a [`Generation`] or with a
//!   [`PodJobError`]; a lost member fails the running job within the
//!   collectives' bounded time and the pod turns degraded (its health says
//!   why) until it forms again.
//!
//! # Failure
//! [`PodError`] for what stops a pod from forming (bad hostfile, member
//! absent, a rank refusing its share); [`PodJobError`] for a job.

use std::net::TcpListener;
use std::ops::ControlFlow;
use std::path::PathBuf;
use std::sync::mpsc::{self, RecvTimeoutError};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use mlxnet_proto::v1::PodInfo;
use serde::Serialize;

use super::dataplane::{self, Backend};
use super::hostfile::{PodConfig, PodConfigError};
use super::links::{addresses, measure_links};
use super::speed;
use crate::collectives::tcp::{PeerAuth, TcpOptions, TcpTransport};
use crate::collectives::{first_failure, Collective, CollectiveError};
use crate::engine::sharded::{Compute, MemoryBudget, PodModel, PodModelError, PodPlan};
use crate::engine::{EngineError, Forward, GenerateRequest, Generation, TextSide, TokenChunk};

/// How often an idle leader shows the members it is alive.
pub const IDLE_TICK: Duration = Duration::from_millis(500);
/// Pause between attempts to form the pod again.
const REFORM_DELAY: Duration = Duration::from_millis(500);
/// Bytes of one member's record in the formation exchange: node id,
/// memory budget, wanted parallelism, speed (f64 bits).
const RECORD: usize = 32 + 8 + 8 + 8;

/// How the model is split across the pod.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Parallelism {
    /// By the links: tensor over RDMA, pipeline over TCP.
    #[default]
    Auto,
    Tensor,
    Pipeline,
}

impl std::str::FromStr for Parallelism {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s.trim().to_ascii_lowercase().as_str() {
            "auto" => Ok(Parallelism::Auto),
            "tensor" => Ok(Parallelism::Tensor),
            "pipeline" => Ok(Parallelism::Pipeline),
            other => Err(format!("expected auto, tensor or pipeline, got {other:?}")),
        }
    }
}

impl Parallelism {
    fn code(self) -> u64 {
        match self {
            Parallelism::Auto => 0,
            Parallelism::Tensor => 1,
            Parallelism::Pipeline => 2,
        }
    }

    fn from_code(c: u64) -> Self {
        match c {
            1 => Parallelism::Tensor,
            2 => Parallelism::Pipeline,
            _ => Parallelism::Auto,
        }
    }
}

/// Why the pod could not form or serve.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum PodError {
    #[error("pod config {path}: {reason}")]
    Read { path: PathBuf, reason: String },
    #[error("pod config: {0}")]
    Config(#[from] PodConfigError),
    #[error("this node is rank {rank}, the pod has {size} members")]
    Rank { rank: usize, size: usize },
    #[error("cannot listen on {addr}: {source}")]
    Listen {
        addr: std::net::SocketAddr,
        source: std::io::Error,
    },
    #[error(transparent)]
    Collective(#[from] CollectiveError),
    #[error(transparent)]
    Model(#[from] PodModelError),
    #[error("pod member {rank} could not load its share: {reason}")]
    MemberRefused { rank: usize, reason: String },
    #[error("pod thread ended")]
    Stopped,
}

/// Why a pod job failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum PodJobError {
    #[error("pod is degraded: {0}")]
    Degraded(String),
    #[error("this node is pod member {0}; pod jobs go to the leader (rank 0)")]
    NotLeader(usize),
    #[error("pod job failed: {0}")]
    Model(#[from] PodModelError),
    #[error("pod broke during the job: {0}")]
    Broken(String),
}

impl From<EngineError> for PodJobError {
    fn from(e: EngineError) -> Self {
        PodJobError::Model(PodModelError::Engine(e))
    }
}

impl PodJobError {
    /// True when the request, not the pod, is at fault.
    pub fn is_client_error(&self) -> bool {
        matches!(self, PodJobError::Model(PodModelError::Engine(e)) if e.is_client_error())
    }
}

/// What a member needs to take part.
#[derive(Debug, Clone)]
pub struct PodSetup {
    pub config: PodConfig,
    /// How the members prove their node keys on the data plane
    /// ([`PodConfig::peer_auth`]).
    pub auth: PeerAuth,
    pub rank: usize,
    /// Rank `r` listens on `port + r`.
    pub port: u16,
    pub parallelism: Parallelism,
    /// This member's node id (its public key).
    pub node_id: [u8; 32],
    /// What this member may hold: weights + KV cache.
    pub memory_budget: u64,
    /// Longest sequence (prompt + generated) the pod accepts.
    pub max_context: Option<usize>,
    /// This member's speed for its tensor-parallel share, in the unit of
    /// [`super::speed::probe`]; `None` measures it at each formation.
    pub speed: Option<f64>,
    /// The model file (every member holds the same file).
    pub model: PathBuf,
    pub compute: Compute,
    pub tcp: TcpOptions,
}

/// The token sink of a pod job (the link's coalescer).
pub type TokenSink = Box<dyn FnMut(&TokenChunk) -> ControlFlow<()> + Send>;

/// One job for the leader's thread.
struct PodJob {
    request: GenerateRequest,
    on_token: TokenSink,
    reply: tokio::sync::oneshot::Sender<(Result<Generation, PodJobError>, TokenSink)>,
}

/// A running pod member.
pub struct PodRuntime {
    pub rank: usize,
    info: Mutex<PodInfo>,
    /// The plan the pod formed with last.
    plan: Mutex<Option<PodPlan>>,
    /// `None` when whole; otherwise why it cannot take jobs.
    degraded: Arc<Mutex<Option<String>>>,
    jobs: Mutex<Option<mpsc::Sender<PodJob>>>,
}

impl std::fmt::Debug for PodRuntime {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PodRuntime")
            .field("rank", &self.rank)
            .finish_non_exhaustive()
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

impl PodRuntime {
    /// Starts this member's thread and waits (blocking) until the pod has
    /// formed once, or fails with why it could not (`setup.tcp`'s connect
    /// timeout bounds the wait for absent members).
    pub fn start(setup: PodSetup) -> Result<Arc<PodRuntime>, PodError> {
        let size = setup.config.size();
        if setup.rank >= size {
            return Err(PodError::Rank {
                rank: setup.rank,
                size,
            });
        }
        let addrs = addresses(&setup.config, setup.port)?;
        let addr = addrs[setup.rank];
        let listener =
            TcpListener::bind(addr).map_err(|source| PodError::Listen { addr, source })?;
        let text = if setup.rank == 0 {
            Some(TextSide::load_gguf(&setup.model).map_err(PodModelError::Engine)?)
        } else {
            None
        };
        let runtime = Arc::new(PodRuntime {
            rank: setup.rank,
            info: Mutex::new(PodInfo::default()),
            plan: Mutex::new(None),
            degraded: Arc::new(Mutex::new(Some("forming".into()))),
            jobs: Mutex::new(None),
        });
        let (jobs_tx, jobs_rx) = mpsc::channel();
        if setup.rank == 0 {
            *lock(&runtime.jobs) = Some(jobs_tx);
        }
        let (first_tx, first_rx) = mpsc::channel();
        let rt = runtime.clone();
        std::thread::Builder::new()
            .name(format!("pod-rank-{}", setup.rank))
            .spawn(move || {
                let mut member = Member {
                    setup,
                    addrs,
                    listener,
                    text,
                    loaded: None,
                    runtime: rt,
                    jobs: jobs_rx,
                    first: Some(first_tx),
                };
                member.run();
            })
            .map_err(|_| PodError::Stopped)?;
        match first_rx.recv() {
            Ok(Ok(())) => Ok(runtime),
            Ok(Err(e)) => Err(e),
            Err(_) => Err(PodError::Stopped),
        }
    }

    /// What the node's Hello says about the pod.
    pub fn info(&self) -> PodInfo {
        lock(&self.info).clone()
    }

    /// How the pod split the model when it last formed.
    pub fn plan(&self) -> Option<PodPlan> {
        lock(&self.plan).clone()
    }

    /// Why the pod cannot take jobs now, if it cannot.
    pub fn degraded(&self) -> Option<String> {
        lock(&self.degraded).clone()
    }

    /// Runs `request` across the pod (leader only). Resolves with the
    /// generation and gives the token sink back.
    pub async fn submit(
        &self,
        request: GenerateRequest,
        on_token: TokenSink,
    ) -> (Result<Generation, PodJobError>, TokenSink) {
        if self.rank != 0 {
            return (Err(PodJobError::NotLeader(self.rank)), on_token);
        }
        if let Some(why) = self.degraded() {
            return (Err(PodJobError::Degraded(why)), on_token);
        }
        let (reply, rx) = tokio::sync::oneshot::channel();
        let job = PodJob {
            request,
            on_token,
            reply,
        };
        let sent = match lock(&self.jobs).as_ref() {
            Some(tx) => tx.send(job).map_err(|e| e.0),
            None => Err(job),
        };
        if let Err(job) = sent {
            return (
                Err(PodJobError::Degraded("the pod thread ended".into())),
                job.on_token,
            );
        }
        match rx.await {
            Ok(done) => done,
            // The thread dropped the job without answering: it ended.
            Err(_) => (
                Err(PodJobError::Degraded("the pod thread ended".into())),
                Box::new(|_: &TokenChunk| ControlFlow::Break(())),
            ),
        }
    }
}

/// Commands the leader broadcasts: `[op, arg]`.
const OP_IDLE: u32 = 0;
const OP_RESET: u32 = 1;
const OP_FORWARD: u32 = 2;

/// One member's thread state.
struct Member {
    setup: PodSetup,
    addrs: Vec<std::net::SocketAddr>,
    listener: TcpListener,
    text: Option<TextSide>,
    /// The loaded share, reused when the pod forms again with the same plan.
    loaded: Option<(PodPlan, PodModel)>,
    runtime: Arc<PodRuntime>,
    jobs: mpsc::Receiver<PodJob>,
    first: Option<mpsc::Sender<Result<(), PodError>>>,
}

impl Member {
    fn run(&mut self) {
        loop {
            let outcome = self.form().and_then(|comm| {
                *lock(&self.runtime.degraded) = None;
                if let Some(first) = self.first.take() {
                    let _ = first.send(Ok(()));
                }
                tracing::info!(rank = self.setup.rank, "pod formed");
                self.serve(comm)
            });
            let err = match outcome {
                Ok(()) => return,
                Err(e) => e,
            };
            let reason = err.to_string();
            tracing::warn!(rank = self.setup.rank, %reason, "pod degraded");
            *lock(&self.runtime.degraded) = Some(reason.clone());
            if let Some(first) = self.first.take() {
                // Never formed: the node does not start, and says why.
                let _ = first.send(Err(err));
                return;
            }
            // Jobs that arrived meanwhile fail at once rather than wait.
            while let Ok(job) = self.jobs.try_recv() {
                let _ = job
                    .reply
                    .send((Err(PodJobError::Degraded(reason.clone())), job.on_token));
            }
            std::thread::sleep(REFORM_DELAY);
        }
    }

    /// Connects, agrees, measures, plans and loads.
    fn form(&mut self) -> Result<Box<dyn Collective>, PodError> {
        let s = &self.setup;
        let listener = self
            .listener
            .try_clone()
            .map_err(|source| PodError::Listen {
                addr: self.addrs[s.rank],
                source,
            })?;
        let transport = TcpTransport::connect_with(s.rank, listener, &self.addrs, s.tcp, &s.auth)?;
        let (mut comm, backend) = dataplane::open(&s.config, s.rank, transport, &s.tcp)?;
        let n = comm.size();
        // 1. Records: id, budget, wanted parallelism, speed.
        let speed = s.speed.unwrap_or_else(speed::probe);
        let mut mine = [0u8; RECORD];
        mine[..32].copy_from_slice(&s.node_id);
        mine[32..40].copy_from_slice(&s.memory_budget.to_le_bytes());
        mine[40..48].copy_from_slice(&s.parallelism.code().to_le_bytes());
        mine[48..56].copy_from_slice(&speed.to_bits().to_le_bytes());
        let mut all = vec![0u8; RECORD * n];
        comm.all_gather(&mine, &mut all)?;
        let word = |r: usize, at: usize| {
            let mut b = [0u8; 8];
            b.copy_from_slice(&all[r * RECORD + at..r * RECORD + at + 8]);
            u64::from_le_bytes(b)
        };
        let members: Vec<Vec<u8>> = (0..n)
            .map(|r| all[r * RECORD..r * RECORD + 32].to_vec())
            .collect();
        let budgets: Vec<f64> = (0..n).map(|r| word(r, 32) as f64).collect();
        let speeds: Vec<f64> = (0..n).map(|r| f64::from_bits(word(r, 48))).collect();
        // "auto" follows the data plane (every rank has the same).
        let parallelism = match (Parallelism::from_code(word(0, 40)), backend) {
            (Parallelism::Tensor, _) | (Parallelism::Auto, Backend::Rdma) => Parallelism::Tensor,
            _ => Parallelism::Pipeline,
        };
        // 2. Links, measured from rank 0.
        let figures = measure_links(comm.as_mut(), 20, 1 << 20)?;
        // 3. Plan and load.
        let (cfg, unit) = PodModel::ffn_unit(&s.model)?;
        let plan = match parallelism {
            Parallelism::Tensor => PodPlan::tensor(&cfg, unit, &speed::plan_weights(&speeds)),
            _ => PodPlan::pipeline(&cfg, &budgets),
        }
        .map_err(PodModelError::from)?;
        let positions = s
            .max_context
            .unwrap_or(cfg.context_length)
            .min(cfg.context_length);
        let loaded = match self.loaded.take() {
            Some((p, m)) if p == plan => Ok(m),
            _ => PodModel::load_gguf_within(
                &s.model,
                plan.clone(),
                s.rank,
                s.compute,
                MemoryBudget {
                    bytes: s.memory_budget,
                    positions,
                },
            ),
        };
        // 4. Everyone learns whether everyone loaded.
        let refused = first_failure(&mut *comm, loaded.as_ref().err().map(|e| e as _))?;
        let model = loaded?;
        if let Some((rank, reason)) = refused {
            return Err(PodError::MemberRefused { rank, reason });
        }
        let leader = hex_short(&members[0]);
        *lock(&self.runtime.info) = PodInfo {
            name: format!("pod-{leader}"),
            rank: s.rank as u32,
            members,
            link_latency_s: figures
                .iter()
                .map(|f| f.latency.as_secs_f64() / 2.0)
                .fold(0.0, f64::max),
            link_bandwidth: figures
                .iter()
                .map(|f| f.bandwidth)
                .fold(f64::INFINITY, f64::min)
                .min(1e12),
            parallelism: match parallelism {
                Parallelism::Tensor => "tensor".into(),
                _ => "pipeline".into(),
            },
        };
        tracing::info!(rank = s.rank, plan = %plan.describe(s.rank), ?speeds, "pod share loaded");
        *lock(&self.runtime.plan) = Some(plan.clone());
        self.loaded = Some((plan, model));
        Ok(comm)
    }

    /// Serves until the pod breaks (an error) or the node drops the runtime.
    fn serve(&mut self, mut comm: Box<dyn Collective>) -> Result<(), PodError> {
        let context = self
            .setup
            .max_context
            .unwrap_or(usize::MAX)
            .min(model_context(&self.setup));
        let Some((_, model)) = self.loaded.as_mut() else {
            return Err(PodError::Stopped);
        };
        if self.setup.rank != 0 {
            return follow(model, comm.as_mut());
        }
        let text = self.text.as_ref().ok_or(PodError::Stopped)?;
        loop {
            match self.jobs.recv_timeout(IDLE_TICK) {
                Ok(mut job) => {
                    let mut driver = Driver {
                        model: &mut *model,
                        comm: comm.as_mut(),
                        context,
                        broken: None,
                    };
                    let result = text.generate(&mut driver, &job.request, &mut *job.on_token);
                    let broken = driver.broken.take();
                    if let Some(e) = &broken {
                        // Degraded before the job's failure is reported, so
                        // no heartbeat in between says the pod is whole.
                        *lock(&self.runtime.degraded) = Some(e.to_string());
                    }
                    let _ = job.reply.send((result, job.on_token));
                    if let Some(e) = broken {
                        return Err(e.into());
                    }
                }
                Err(RecvTimeoutError::Timeout) => command(comm.as_mut(), OP_IDLE, 0)?,
                Err(RecvTimeoutError::Disconnected) => return Ok(()),
            }
        }
    }
}

fn model_context(s: &PodSetup) -> usize {
    PodModel::ffn_unit(&s.model).map_or(usize::MAX, |(cfg, _)| cfg.context_length)
}

fn hex_short(id: &[u8]) -> String {
    id.iter().take(4).map(|b| format!("{b:02x}")).collect()
}

fn command(comm: &mut dyn Collective, op: u32, arg: u32) -> Result<(), CollectiveError> {
    let mut head = [op, arg];
    comm.broadcast(bytemuck::cast_slice_mut(&mut head), 0)
}

/// A member's loop: run the leader's commands until the pod breaks.
fn follow(model: &mut PodModel, comm: &mut dyn Collective) -> Result<(), PodError> {
    let mut tokens = Vec::new();
    loop {
        let mut head = [0u32; 2];
        comm.broadcast(bytemuck::cast_slice_mut(&mut head), 0)?;
        match head[0] {
            OP_IDLE => {}
            OP_RESET => model.reset(head[1] as usize),
            OP_FORWARD => {
                tokens.resize(head[1] as usize, 0u32);
                comm.broadcast(bytemuck::cast_slice_mut(&mut tokens), 0)?;
                model.forward(&tokens, comm)?;
            }
            other => {
                return Err(PodError::Collective(CollectiveError::Mismatch {
                    peer: 0,
                    expected: "a pod command".into(),
                    got: format!("command {other}"),
                }))
            }
        }
    }
}

/// The leader's forward pass across the pod: each step is broadcast first.
struct Driver<'a> {
    model: &'a mut PodModel,
    comm: &'a mut dyn Collective,
    context: usize,
    /// A failure that leaves the pod out of step (the pod must form again).
    broken: Option<PodModelError>,
}

impl Driver<'_> {
    fn fail(&mut self, e: PodModelError) -> PodJobError {
        let msg = e.to_string();
        self.broken = Some(e);
        PodJobError::Broken(msg)
    }
}

impl Forward for Driver<'_> {
    type Error = PodJobError;

    fn context_length(&self) -> usize {
        self.context
    }

    fn reset(&mut self, capacity: usize) -> Result<(), PodJobError> {
        if let Err(e) = command(self.comm, OP_RESET, capacity as u32) {
            return Err(self.fail(e.into()));
        }
        self.model.reset(capacity);
        Ok(())
    }

    fn prefill_chunk(&self) -> usize {
        // Pipeline stages take the whole prompt and pass it on in
        // micro-batches, so they all work at once; tensor parallel splits
        // every layer already and prefills as a single node does.
        if self.model.is_pipeline() {
            usize::MAX
        } else {
            crate::engine::PREFILL_CHUNK
        }
    }

    fn forward(&mut self, tokens: &[u32]) -> Result<Vec<f32>, PodJobError> {
        let step = (|| {
            command(self.comm, OP_FORWARD, tokens.len() as u32)?;
            let mut t = tokens.to_vec();
            self.comm.broadcast(bytemuck::cast_slice_mut(&mut t), 0)?;
            self.model
                .forward(tokens, self.comm)?
                .ok_or_else(|| PodModelError::Plan("rank 0 received no logits".into()))
        })();
        step.map_err(|e| self.fail(e))
    }
}

#[cfg(test)]
mod tests {
    use std::path::Path;

    use super::*;

    const SMOLLM: &str = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../models/SmolLM2-135M-Instruct.Q4_1.gguf"
    );

    fn setup(rank: usize, port: u16, budget: u64) -> PodSetup {
        PodSetup {
            config: PodConfig::parse(
                r#"[{"ssh": "a", "ips": ["127.0.0.1"]}, {"ssh": "b", "ips": ["127.0.0.1"]}]"#,
            )
            .unwrap(),
            auth: PeerAuth::Open,
            rank,
            port,
            parallelism: Parallelism::Pipeline,
            node_id: [rank as u8; 32],
            memory_budget: budget,
            max_context: Some(256),
            speed: None,
            model: PathBuf::from(SMOLLM),
            compute: Compute::Native,
            tcp: TcpOptions {
                connect_timeout: Duration::from_secs(20),
                ..TcpOptions::default()
            },
        }
    }

    fn free_pair() -> u16 {
        loop {
            let a = TcpListener::bind("127.0.0.1:0").unwrap();
            let port = a.local_addr().unwrap().port();
            if port < u16::MAX && TcpListener::bind(("127.0.0.1", port + 1)).is_ok() {
                return port;
            }
        }
    }

    /// Both members learn that rank 1 refused its layers, and why; neither
    /// starts serving.
    #[test]
    fn a_member_over_its_memory_budget_stops_the_pod_with_its_reason() {
        let port = free_pair();
        let ranks: Vec<_> = [(0, 1u64 << 34), (1, 10_000_000)]
            .into_iter()
            .map(|(rank, budget)| {
                std::thread::spawn(move || PodRuntime::start(setup(rank, port, budget)))
            })
            .collect();
        for h in ranks {
            let err = h.join().unwrap().unwrap_err().to_string();
            assert!(
                err.contains("rank 1 refuses layers")
                    && err.contains("memory budget of 10000000 B"),
                "{err}"
            );
        }
    }

    /// Configured speeds 2 : 1 give the faster member two thirds of every
    /// layer (KV-head groups, feed-forward columns, vocabulary rows), and the
    /// uneven tensor-parallel pod still generates the single node's greedy
    /// tokens (a near tie may go either way, as in the pod e2e test).
    #[test]
    fn members_twice_as_fast_take_twice_the_share_and_generate_the_same_tokens() {
        let port = free_pair();
        let ranks: Vec<_> = [(0, 2.0), (1, 1.0)]
            .into_iter()
            .map(|(rank, speed)| {
                std::thread::spawn(move || {
                    PodRuntime::start(PodSetup {
                        parallelism: Parallelism::Tensor,
                        speed: Some(speed),
                        ..setup(rank, port, 1 << 34)
                    })
                })
            })
            .collect();
        let mut pods: Vec<_> = ranks
            .into_iter()
            .map(|h| h.join().unwrap().unwrap())
            .collect();
        let _member = pods.pop().unwrap();
        let leader = pods.pop().unwrap();
        // SmolLM2: 3 KV heads, 1536 feed-forward columns cut in Q4_1 units
        // of 64, 49152 vocabulary rows.
        let Some(PodPlan::Tensor {
            kv_heads,
            ffn,
            vocab,
        }) = leader.plan()
        else {
            panic!("no tensor plan: {:?}", leader.plan());
        };
        assert_eq!(kv_heads, vec![0..2, 2..3]);
        assert_eq!(ffn, vec![0..1024, 1024..1536]);
        assert_eq!(vocab, vec![0..32768, 32768..49152]);
        assert_eq!(leader.info().parallelism, "tensor");

        const STEPS: usize = 12;
        const NEAR_TIE: f32 = 0.35;
        let prompt = crate::engine::PromptInput::Text("The capital of France is".into());
        let request = GenerateRequest {
            input: prompt.clone(),
            sampling: crate::engine::Sampling {
                max_tokens: STEPS,
                ..Default::default()
            },
            resume: crate::engine::Resume::default(),
        };
        let rt = tokio::runtime::Builder::new_current_thread()
            .build()
            .unwrap();
        let (got, _) = rt.block_on(leader.submit(request, Box::new(|_| ControlFlow::Continue(()))));
        let got = got.unwrap().output_token_ids;
        let want = crate::engine::Engine::load(Path::new(SMOLLM))
            .unwrap()
            .greedy_trace(&prompt, STEPS)
            .unwrap();
        let mut equal = 0;
        for (i, &(token, margin)) in want.iter().enumerate() {
            if got.get(i) == Some(&token) {
                equal += 1;
                continue;
            }
            assert!(
                margin < NEAR_TIE,
                "token {i}: pod {:?}, single node {token}, margin {margin} is no near tie",
                got.get(i)
            );
            break;
        }
        assert!(
            equal * 2 >= want.len(),
            "only {equal} of {} tokens equal",
            want.len()
        );
        eprintln!(
            "tensor x2 at speeds 2:1 vs single node: {equal} of {} tokens equal",
            want.len()
        );
    }

    /// A whole pod of two takes a job from its leader; a member cannot.
    #[test]
    fn the_leader_runs_a_job_across_the_pod() {
        let port = free_pair();
        let ranks: Vec<_> = [0, 1]
            .into_iter()
            .map(|rank| std::thread::spawn(move || PodRuntime::start(setup(rank, port, 1 << 34))))
            .collect();
        let mut pods: Vec<_> = ranks
            .into_iter()
            .map(|h| h.join().unwrap().unwrap())
            .collect();
        let member = pods.pop().unwrap();
        let leader = pods.pop().unwrap();
        assert_eq!(leader.degraded(), None);
        let info = leader.info();
        assert_eq!((info.rank, info.members.len()), (0, 2));
        assert_eq!(info.parallelism, "pipeline");
        let rt = tokio::runtime::Builder::new_current_thread()
            .build()
            .unwrap();
        let request = GenerateRequest {
            input: crate::engine::PromptInput::Text("The capital of France is".into()),
            sampling: crate::engine::Sampling {
                max_tokens: 4,
                ..Default::default()
            },
            resume: crate::engine::Resume::default(),
        };
        let (got, _) =
            rt.block_on(leader.submit(request.clone(), Box::new(|_| ControlFlow::Continue(()))));
        let got = got.unwrap();
        let mut engine = crate::engine::Engine::load(Path::new(SMOLLM)).unwrap();
        let want = engine
            .generate(&request, &mut |_| ControlFlow::Continue(()))
            .unwrap();
        // Pipeline stages compute exactly what the whole model computes.
        assert_eq!(got.output_token_ids, want.output_token_ids);
        assert_eq!(got.text, want.text);
        let (refused, _) =
            rt.block_on(member.submit(request, Box::new(|_| ControlFlow::Continue(()))));
        assert!(matches!(refused, Err(PodJobError::NotLeader(1))));
    }
}
