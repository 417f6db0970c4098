//! Harness for end-to-end tests and the devnet: real coordinators and real
//! nodes, in process, on ports the OS chose, each with a fresh data directory.
//! What the coordinator's and the node's own test harnesses already have
//! (their `test-utils` features) is reused, not copied: the API-key
//! interceptor, the plain prompt job, the test model's place.
//!
//! # Layout
//! - [`test_model`]: the real test model (SmolLM2-135M-Instruct Q4_1), fetched
//!   by `scripts/fetch-test-model.sh`, never from the network at test time.
//! - [`spawn_coordinator`] / [`TestCoordinator`]: an `Application` built on
//!   `127.0.0.1:0`, running until stopped or dropped.
//! - [`spawn_node`] / [`TestNode`]: an `mlx-node` dialing that coordinator.
//! - [`Client`]: gRPC clients of the coordinator, authenticated with an API
//!   key, and [`Client::run_job`], which submits and watches a job to its end.
//! - [`mirror`]: a model mirror (a folder over HTTP with Range) for pulls.
//! - [`Accounts`]: what every test coordinator starts with: an admin key, a
//!   client account with [`CLIENT_GRANT`] micro-MLX and a submit+read key, and
//!   an operator account (its nodes earn into it) with a read key. They are
//!   kept in the data directory, so a restarted coordinator has the same ones.
//!
//! # Invariants
//! - Nothing waits by sleeping: readiness is the node's own link status and
//!   the job's own event stream; every wait has a deadline and fails loudly.
//! - Tracing stays silent unless `TEST_LOG` is set.

use std::{
    future::Future,
    net::SocketAddr,
    path::{Path, PathBuf},
    sync::Once,
    time::Duration,
};

use anyhow::{anyhow, bail, ensure, Context};
use mlx_node::{
    app::Node,
    config::{ModelEntry, NodeConfig},
    link::LinkStatus,
};
use mlxnet_coordinator::{app::Application, config::CoordinatorConfig};
use mlxnet_proto::{
    ids::NodeId,
    v1::{
        accounts_client::AccountsClient, job_event, job_input, jobs_client::JobsClient,
        models_client::ModelsClient, network_client::NetworkClient, ChatMessage, ChatMessages, Job,
        JobInput, JobState, SamplingParams, SubmitJobRequest, WatchJobRequest,
    },
};
use tokio::{sync::oneshot, task::JoinHandle};
use tonic::transport::Channel;

pub use mlxnet_coordinator::{
    test_utils::{prompt_job, CLIENT_GRANT},
    util::now_ms,
};
pub use mlxnet_proto::bearer::{Authed, Bearer};

pub mod failover;
pub mod mirror;
pub mod relay;

/// Catalogue id of the test model.
pub const TEST_MODEL_ID: &str = mlxnet_coordinator::test_utils::MODEL;
/// File name of the test model under `models/`.
pub use mlx_node::test_utils::TEST_MODEL_FILE;

/// The accounts and keys a test coordinator starts with.
#[derive(Clone, Debug)]
pub struct Accounts {
    pub admin_key: String,
    pub client_account: String,
    pub client_key: String,
    pub operator_account: String,
    pub operator_key: String,
}

/// The file in a coordinator's data directory that keeps its [`Accounts`].
pub const ACCOUNTS_FILE: &str = "harness-accounts.txt";

impl Accounts {
    /// Reads the accounts from the data dir, or creates them (and writes them there).
    pub async fn load_or_create(app: &Application, data_dir: &Path) -> anyhow::Result<Self> {
        use mlxnet_coordinator::ledger::{keys::Scopes, AccountKind};
        let path = data_dir.join(ACCOUNTS_FILE);
        if let Ok(text) = std::fs::read_to_string(&path) {
            let f: Vec<&str> = text.lines().collect();
            if let [admin_key, client_account, client_key, operator_account, operator_key] = f[..] {
                return Ok(Self {
                    admin_key: admin_key.into(),
                    client_account: client_account.into(),
                    client_key: client_key.into(),
                    operator_account: operator_account.into(),
                    operator_key: operator_key.into(),
                });
            }
            bail!("{} is malformed", path.display());
        }
        let ledger = app.ledger();
        let admin = ledger.bootstrap_admin("harness admin").await?;
        let client = ledger
            .create_account("demo client", AccountKind::Client)
            .await?;
        ledger
            .grant(
                "harness-client",
                &client.id,
                CLIENT_GRANT,
                "starting balance",
            )
            .await?;
        let client_key = ledger
            .create_key(
                &client.id,
                Scopes::from_list(["submit", "read"])?,
                "harness",
                None,
            )
            .await?;
        let operator = ledger
            .create_account("demo operator", AccountKind::Operator)
            .await?;
        let operator_key = ledger
            .create_key(&operator.id, Scopes::from_list(["read"])?, "harness", None)
            .await?;
        let accounts = Self {
            admin_key: admin.secret().into(),
            client_account: client.id,
            client_key: client_key.secret().into(),
            operator_account: operator.id,
            operator_key: operator_key.secret().into(),
        };
        std::fs::write(
            &path,
            format!(
                "{}\n{}\n{}\n{}\n{}\n",
                accounts.admin_key,
                accounts.client_account,
                accounts.client_key,
                accounts.operator_account,
                accounts.operator_key
            ),
        )
        .with_context(|| format!("writing {}", path.display()))?;
        Ok(accounts)
    }
}

/// Longest any single wait in a test may take before it fails: a guard
/// against a hang, never a verdict on speed. Wide, because a loaded machine
/// (the suite beside a build, many processes on 2 cores) was seen taking
/// over 120 s for a pod's requeued job and a hand-off's resumed job that
/// take under 30 s on an idle one.
pub const DEADLINE: Duration = Duration::from_secs(300);

/// The repository root (the workspace this crate lives in).
pub fn repo_root() -> PathBuf {
    mlx_node::test_utils::workspace()
}

/// Path of the real test model; panics with the fix when it is missing.
pub fn test_model() -> PathBuf {
    let path = mlx_node::test_utils::test_model_path();
    assert!(
        path.is_file(),
        "test model missing at {}: run scripts/fetch-test-model.sh",
        path.display()
    );
    path
}

/// The `mlx-node` binary built with this test binary (same target dir and
/// profile): Cargo builds it whenever it builds `mlx-node`'s own tests
/// (`node/tests/`), as `scripts/test.sh` does. Missing or older than any
/// source file of the crates it is built from, it is an error that says how
/// to build it, never a stale binary silently run.
pub fn mlx_node_binary() -> anyhow::Result<PathBuf> {
    built_binary(
        "mlx-node",
        &["node/src", "node/Cargo.toml", "proto"],
        "cargo build -p mlx-node",
    )
}

/// The `mlxnet` client binary built with this test binary: Cargo builds it
/// whenever it builds the client's own tests (`client/tests/`), as
/// `scripts/test.sh` does. Missing or older than any source file of the
/// crates it is built from, it is an error that says how to build it.
pub fn mlxnet_binary() -> anyhow::Result<PathBuf> {
    built_binary(
        "mlxnet",
        &["client/src", "client/Cargo.toml", "proto"],
        "cargo build -p mlxnet-client",
    )
}

/// The binary `name` in this test binary's target directory and profile,
/// checked to be no older than any file under `sources` (paths in the
/// workspace). Comparing with the sources, not with the libraries in
/// `deps/`, keeps a library built for another feature set (a `-p` run) from
/// making a fresh binary look stale.
fn built_binary(name: &str, sources: &[&str], build: &str) -> anyhow::Result<PathBuf> {
    let exe = std::env::current_exe().context("the test binary's path")?;
    // <target>/<profile>/deps/<test binary>
    let profile_dir = exe
        .parent()
        .and_then(Path::parent)
        .context("the test binary is not in a Cargo target directory")?;
    let bin = profile_dir.join(format!("{name}{}", std::env::consts::EXE_SUFFIX));
    let fix = format!("build it with the workspace's tests (scripts/test.sh) or `{build}`");
    let built = std::fs::metadata(&bin)
        .and_then(|m| m.modified())
        .with_context(|| format!("{} is missing: {fix}", bin.display()))?;
    let root = mlx_node::test_utils::workspace();
    for source in sources {
        if let Some((path, changed)) = newest_file(&root.join(source))? {
            ensure!(
                changed <= built,
                "{} is older than its source {}: {fix}",
                bin.display(),
                path.display()
            );
        }
    }
    Ok(bin)
}

/// The most recently modified file under `path` (itself, if a file), with
/// its time; `None` for an empty or missing folder.
fn newest_file(path: &Path) -> anyhow::Result<Option<(PathBuf, std::time::SystemTime)>> {
    let meta = match std::fs::metadata(path) {
        Ok(meta) => meta,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(e).with_context(|| format!("reading {}", path.display())),
    };
    if !meta.is_dir() {
        return Ok(Some((path.to_path_buf(), meta.modified()?)));
    }
    let mut newest: Option<(PathBuf, std::time::SystemTime)> = None;
    for entry in std::fs::read_dir(path).with_context(|| format!("listing {}", path.display()))? {
        if let Some(found) = newest_file(&entry?.path())? {
            if newest.as_ref().is_none_or(|(_, t)| found.1 > *t) {
                newest = Some(found);
            }
        }
    }
    Ok(newest)
}

#[cfg(test)]
mod built_binary_tests {
    use super::*;

    #[test]
    fn the_newest_file_of_a_tree_is_found() {
        let dir = tempfile::tempdir().expect("tempdir");
        assert!(newest_file(&dir.path().join("absent"))
            .expect("missing is fine")
            .is_none());
        std::fs::create_dir_all(dir.path().join("a/b")).expect("mkdir");
        let old = dir.path().join("a/old.rs");
        let new = dir.path().join("a/b/new.rs");
        std::fs::write(&old, "old").expect("write");
        std::fs::write(&new, "new").expect("write");
        let earlier = std::time::SystemTime::now() - Duration::from_secs(60);
        std::fs::File::options()
            .write(true)
            .open(&old)
            .and_then(|f| f.set_modified(earlier))
            .expect("set time");
        let (path, _) = newest_file(dir.path()).expect("walk").expect("a file");
        assert_eq!(path, new);
    }
}

/// Starts tracing output when `TEST_LOG` is set (e.g. `TEST_LOG=debug`).
pub fn init_tracing() {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        if let Ok(filter) = std::env::var("TEST_LOG") {
            let _ = tracing_subscriber::fmt()
                .with_env_filter(filter)
                .with_test_writer()
                .try_init();
        }
    });
}

/// Awaits `fut`, failing with `what` after [`DEADLINE`].
pub async fn within<T>(what: &str, fut: impl Future<Output = T>) -> anyhow::Result<T> {
    tokio::time::timeout(DEADLINE, fut)
        .await
        .map_err(|_| anyhow!("timed out after {DEADLINE:?} waiting for {what}"))
}

/// A running coordinator.
pub struct TestCoordinator {
    pub grpc_addr: SocketAddr,
    pub quic_addr: SocketAddr,
    pub http_addr: SocketAddr,
    pub fingerprint: String,
    pub config: CoordinatorConfig,
    pub accounts: Accounts,
    /// Its ledger (accounts, keys and their limits), for what no client API
    /// sets.
    pub ledger: mlxnet_coordinator::ledger::Ledger,
    stop: Option<oneshot::Sender<()>>,
    task: Option<JoinHandle<anyhow::Result<()>>>,
}

impl TestCoordinator {
    /// Stops it and waits until its ports and database are released.
    pub async fn stop(mut self) -> anyhow::Result<CoordinatorConfig> {
        self.shutdown().await?;
        Ok(self.config.clone())
    }

    async fn shutdown(&mut self) -> anyhow::Result<()> {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        if let Some(task) = self.task.take() {
            within("coordinator shutdown", task).await???;
        }
        Ok(())
    }

    /// gRPC clients connected to it, as the funded test client.
    pub async fn client(&self) -> anyhow::Result<Client> {
        Client::connect(self.grpc_addr, Some(&self.accounts.client_key)).await
    }

    /// gRPC clients connected to it with `key` (or none).
    pub async fn client_with(&self, key: Option<&str>) -> anyhow::Result<Client> {
        Client::connect(self.grpc_addr, key).await
    }

    /// A node config that dials this coordinator and serves the test model.
    pub fn node_config(&self, data_dir: &Path, name: &str) -> NodeConfig {
        node_config_for(
            data_dir,
            &self.quic_addr.to_string(),
            &self.fingerprint,
            &self.accounts.operator_account,
            name,
        )
    }
}

/// A node config that dials the coordinator at `quic_addr` (pinned by
/// `fingerprint`), serves the test model on one thread and earns for
/// `operator_account` (for nodes in another process).
pub fn node_config_for(
    data_dir: &Path,
    quic_addr: &str,
    fingerprint: &str,
    operator_account: &str,
    name: &str,
) -> NodeConfig {
    let mut config = NodeConfig::new(data_dir.to_path_buf(), quic_addr, fingerprint);
    config.name = name.to_string();
    config.models = vec![ModelEntry {
        id: TEST_MODEL_ID.to_string(),
        path: test_model(),
    }];
    config.threads = Some(1);
    // Thousands of positions of KV cache: plenty for tests, small beside
    // the default (a quarter of the free memory).
    config.kv_cache_bytes = Some(256 << 20);
    config.reconnect_min_ms = 50;
    config.reconnect_max_ms = 500;
    config.operator_account = operator_account.to_string();
    config
}

impl Drop for TestCoordinator {
    fn drop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
    }
}

/// The coordinator's catalogue entry for a built-in catalogue model.
pub fn catalogue_model(
    entry: &mlxnet_proto::catalogue::CatalogueEntry,
) -> mlxnet_coordinator::config::CatalogueModel {
    mlxnet_coordinator::config::CatalogueModel::from_entry(entry)
}

/// A coordinator config for tests: everything on `127.0.0.1:0`, data in `dir`.
pub fn coordinator_config(dir: &Path) -> CoordinatorConfig {
    CoordinatorConfig::for_data_dir(dir.to_path_buf())
}

/// Builds and starts a coordinator from `config`.
pub async fn spawn_coordinator(config: CoordinatorConfig) -> anyhow::Result<TestCoordinator> {
    init_tracing();
    let app = Application::build(config.clone())
        .await
        .context("building the coordinator")?;
    let (stop, stopped) = oneshot::channel::<()>();
    let grpc_addr = app.grpc_addr();
    let quic_addr = app.quic_addr();
    let http_addr = app.http_addr();
    let fingerprint = app.cert_fingerprint();
    let accounts = Accounts::load_or_create(&app, &config.data_dir).await?;
    let ledger = app.ledger().clone();
    // Later starts on the same data dir reuse the ports this one got, so
    // nodes that pinned the address find it again after a restart.
    let mut config = config;
    config.grpc_addr = grpc_addr;
    config.quic_addr = quic_addr;
    config.http_addr = http_addr;
    let task = tokio::spawn(async move {
        app.run_until(async move {
            let _ = stopped.await;
        })
        .await
        .map_err(anyhow::Error::from)
    });
    Ok(TestCoordinator {
        grpc_addr,
        quic_addr,
        http_addr,
        fingerprint,
        config,
        accounts,
        ledger,
        stop: Some(stop),
        task: Some(task),
    })
}

/// A running node.
pub struct TestNode {
    pub id: NodeId,
    pub status: tokio::sync::watch::Receiver<LinkStatus>,
    stop: Option<oneshot::Sender<()>>,
    task: Option<JoinHandle<anyhow::Result<()>>>,
}

impl TestNode {
    /// Waits until the node is registered with the coordinator.
    pub async fn registered(&mut self) -> anyhow::Result<()> {
        within(
            "node registration",
            self.status
                .wait_for(|s| matches!(s, LinkStatus::Registered { .. })),
        )
        .await?
        .map_err(|_| anyhow!("node stopped before registering"))?;
        Ok(())
    }

    /// Waits until the node has lost its link (e.g. the coordinator stopped).
    pub async fn disconnected(&mut self) -> anyhow::Result<()> {
        within(
            "node link loss",
            self.status
                .wait_for(|s| !matches!(s, LinkStatus::Registered { .. })),
        )
        .await?
        .map_err(|_| anyhow!("node stopped"))?;
        Ok(())
    }

    /// Stops the node and waits for it to end.
    pub async fn stop(mut self) -> anyhow::Result<()> {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        if let Some(task) = self.task.take() {
            within("node shutdown", task).await???;
        }
        Ok(())
    }
}

impl Drop for TestNode {
    fn drop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
    }
}

/// Builds and starts a node from `config`.
pub async fn spawn_node(config: NodeConfig) -> anyhow::Result<TestNode> {
    spawn_node_with(config, None).await
}

/// [`spawn_node`] with the lending signals read from `signals` (an owner
/// the test makes come and go) instead of the operating system.
pub async fn spawn_node_with(
    config: NodeConfig,
    signals: Option<Box<dyn mlx_node::policy::SignalSource>>,
) -> anyhow::Result<TestNode> {
    init_tracing();
    let mut node = Node::build(config).await.context("building the node")?;
    if let Some(s) = signals {
        node = node.with_signals(s);
    }
    let id = node.node_id();
    let status = node.link_status();
    let (stop, stopped) = oneshot::channel::<()>();
    let task = tokio::spawn(async move {
        node.run_until(async move {
            let _ = stopped.await;
        })
        .await
        .map_err(anyhow::Error::from)
    });
    Ok(TestNode {
        id,
        status,
        stop: Some(stop),
        task: Some(task),
    })
}

/// gRPC clients of one coordinator.
#[derive(Clone)]
pub struct Client {
    pub jobs: JobsClient<Authed>,
    pub models: ModelsClient<Authed>,
    pub network: NetworkClient<Authed>,
    pub accounts: AccountsClient<Authed>,
}

/// What a client saw of one job, from submit to its end.
#[derive(Debug)]
pub struct JobRun {
    pub job_id: String,
    /// Text of the token events, concatenated in order.
    pub streamed_text: String,
    /// Token ids of the token events, concatenated in order.
    pub streamed_ids: Vec<u32>,
    /// Node ids of the assigned events, in order.
    pub assigned_to: Vec<String>,
    /// Where the stream rewound (an attempt's unsigned tokens dropped), in order.
    pub rewound_to: Vec<usize>,
    /// Each token event's first index and text, to rewind the text.
    chunks: Vec<(usize, String)>,
    /// The job as the terminal event carried it (or as `Get` returned it).
    pub job: Job,
}

impl Client {
    /// A completed job's claim and the catalogue's (only) model it ran: what
    /// [`price_of`] prices.
    pub async fn claim_and_model(
        &mut self,
        job: &mlxnet_proto::v1::Job,
    ) -> anyhow::Result<(mlxnet_proto::v1::ResultClaim, mlxnet_proto::v1::ModelInfo)> {
        let claim = job
            .result
            .as_ref()
            .and_then(|r| r.claim.clone())
            .context("a completed job carries its claim")?;
        let mut models = self
            .models
            .list(mlxnet_proto::v1::ListModelsRequest {})
            .await?
            .into_inner()
            .models;
        anyhow::ensure!(!models.is_empty(), "the catalogue lists no model");
        Ok((claim, models.remove(0)))
    }

    /// Connects, sending `key` (if any) as the bearer on every call.
    pub async fn connect(addr: SocketAddr, key: Option<&str>) -> anyhow::Result<Self> {
        let channel = Channel::from_shared(format!("http://{addr}"))?
            .connect()
            .await
            .with_context(|| format!("connecting to gRPC at {addr}"))?;
        let bearer = Bearer::for_key(key).context("an API key is printable ASCII")?;
        let authed = mlxnet_proto::bearer::authed(channel, bearer);
        Ok(Self {
            jobs: JobsClient::new(authed.clone()),
            models: ModelsClient::new(authed.clone()),
            network: NetworkClient::new(authed.clone()),
            accounts: AccountsClient::new(authed),
        })
    }

    /// Submits `request` and follows its events until the job ends.
    pub async fn run_job(&mut self, request: SubmitJobRequest) -> anyhow::Result<JobRun> {
        let job = self.jobs.submit(request).await?.into_inner();
        self.follow(job.id).await
    }

    /// Follows a submitted job's events until it ends.
    pub async fn follow(&mut self, job_id: String) -> anyhow::Result<JobRun> {
        let mut stream = self
            .jobs
            .watch(WatchJobRequest {
                job_id: job_id.clone(),
            })
            .await?
            .into_inner();
        let mut run = JobRun {
            job_id: job_id.clone(),
            streamed_text: String::new(),
            streamed_ids: Vec::new(),
            assigned_to: Vec::new(),
            rewound_to: Vec::new(),
            chunks: Vec::new(),
            job: Job::default(),
        };
        let end = within("the job's end", async {
            while let Some(event) = stream.message().await? {
                match event.event {
                    Some(job_event::Event::Tokens(t)) => {
                        let at = t.index as usize;
                        if at < run.streamed_ids.len() {
                            // The stream rewinds: an attempt's unsigned
                            // tokens were dropped, and what follows replaces
                            // them.
                            run.rewound_to.push(at);
                            run.streamed_ids.truncate(at);
                            run.chunks.retain(|(i, _)| *i < at);
                            run.streamed_text =
                                run.chunks.iter().map(|(_, t)| t.as_str()).collect();
                        } else if at > run.streamed_ids.len() {
                            bail!(
                                "token event at index {at} after {} tokens",
                                run.streamed_ids.len()
                            );
                        }
                        run.streamed_text.push_str(&t.text);
                        run.streamed_ids.extend(t.token_ids);
                        run.chunks.push((at, t.text));
                    }
                    Some(job_event::Event::Assigned(a)) => run.assigned_to.push(a.node_id),
                    Some(job_event::Event::Completed(c)) => {
                        return Ok(c.job);
                    }
                    Some(job_event::Event::Failed(_)) | Some(job_event::Event::Cancelled(_)) => {
                        return Ok(None);
                    }
                    Some(job_event::Event::Queued(_)) | None => {}
                }
            }
            Ok(None)
        })
        .await??;
        run.job = match end {
            Some(job) => job,
            None => self
                .jobs
                .get(mlxnet_proto::v1::GetJobRequest { job_id })
                .await?
                .into_inner(),
        };
        Ok(run)
    }
}

/// The system prompt of [`chat_job`]. SmolLM2-135M answers plain questions
/// well with it; under its template's default system prompt it rambles (so
/// does llama.cpp on the same file).
pub const SYSTEM_PROMPT: &str = "You are a helpful assistant.";

/// A chat job for the test model: a short system prompt and one user
/// message, greedy.
pub fn chat_job(question: &str, max_tokens: u32) -> SubmitJobRequest {
    SubmitJobRequest {
        model: TEST_MODEL_ID.to_string(),
        input: Some(JobInput {
            kind: Some(job_input::Kind::Chat(ChatMessages {
                messages: vec![
                    ChatMessage {
                        role: "system".into(),
                        content: SYSTEM_PROMPT.into(),
                    },
                    ChatMessage {
                        role: "user".into(),
                        content: question.into(),
                    },
                ],
            })),
        }),
        sampling: Some(SamplingParams {
            max_tokens,
            ..Default::default()
        }),
        max_price_micro_mlx: 0,
        priority: 0,
    }
}

/// The state of `job` as the enum.
pub fn state(job: &Job) -> JobState {
    JobState::try_from(job.state).unwrap_or(JobState::Unspecified)
}

/// What a job with `claim`'s token counts costs at `model`'s prices, and
/// the network fee in it (5%, the default).
pub fn price_of(
    claim: &mlxnet_proto::v1::ResultClaim,
    model: &mlxnet_proto::v1::ModelInfo,
) -> (i64, i64) {
    let price = (u64::from(claim.prompt_tokens) * model.price_input_micro_mlx_per_mtok
        + u64::from(claim.completion_tokens) * model.price_output_micro_mlx_per_mtok)
        .div_ceil(1_000_000) as i64;
    (price, price * 500 / 10_000)
}
