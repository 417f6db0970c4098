//! The application: binds every listener, then runs the servers and loops
//! until shutdown.
//!
//! # Invariants
//! - `build` binds all listeners first, so callers (tests) learn the real
//!   ports before anything runs and never wait for readiness.
//! - After `run_until` returns, every task has ended, the QUIC endpoint is
//!   idle and its UDP port released, and the database pool is closed: the same
//!   config (data dir and ports) can be built again.
//!
//! # Failure
//! [`AppError`] for anything that stops start-up; a server that fails while
//! running stops the others and its error is returned.

use std::{future::Future, io, net::SocketAddr, sync::Arc, time::Duration};

use tokio::net::TcpListener;
use tracing::{info, warn};

use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;

use crate::{
    api::{self, limits::Admission, ApiContext},
    catalogue::{Catalogue, CatalogueError},
    config::CoordinatorConfig,
    dispatch::{self, Dispatcher},
    domain::liveness_lease,
    http,
    http::{HttpConfig, HttpContext},
    jobs::EventHub,
    ledger::{self, keys::IssuedKey, Ledger, LedgerError},
    link::{
        self,
        session::Sessions,
        tls::{Identity, TlsError},
        LinkContext,
    },
    metrics::Metrics,
    store::{AnyStore, Store, StoreError},
    util::Tasks,
    world::World,
};

/// Why the application could not start or stopped with an error.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum AppError {
    #[error("invalid configuration: {0}")]
    Config(String),
    #[error("creating data directory {path}")]
    DataDir { path: String, source: io::Error },
    #[error("opening the database")]
    Store(#[from] StoreError),
    #[error("recovering the ledger")]
    Ledger(#[source] Box<crate::ledger::LedgerError>),
    #[error(transparent)]
    Catalogue(#[from] CatalogueError),
    #[error(transparent)]
    CatalogueFile(#[from] crate::catalogue::file::CatalogueFileError),
    #[error("node-link certificate")]
    Tls(#[from] TlsError),
    #[error("binding {what} on {addr}")]
    Bind {
        what: &'static str,
        addr: SocketAddr,
        source: io::Error,
    },
    #[error(transparent)]
    Grpc(#[from] api::ServeError),
    #[error("HTTP server failed")]
    Http(#[source] io::Error),
    #[error("a server task panicked")]
    Panicked(#[from] tokio::task::JoinError),
}

/// A coordinator with its listeners bound, ready to run.
pub struct Application {
    dispatcher: Arc<Dispatcher>,
    /// What the node link, the client API and the HTTP routes each get.
    link: LinkContext,
    api: Arc<ApiContext>,
    http_ctx: HttpContext,
    http_config: HttpConfig,
    store: AnyStore,
    tasks: Arc<Tasks>,
    shutdown: CancellationToken,
    /// Cancelled when a requested stop begins: the replica drains first.
    drain: CancellationToken,
    drain_timeout: Duration,
    endpoint: quinn::Endpoint,
    grpc: TcpListener,
    http: TcpListener,
    grpc_addr: SocketAddr,
    quic_addr: SocketAddr,
    http_addr: SocketAddr,
    fingerprint: String,
}

impl Application {
    /// Opens the database (migrating it), loads or creates the certificate,
    /// and binds gRPC, QUIC and HTTP.
    pub async fn build(mut config: CoordinatorConfig) -> Result<Application, AppError> {
        config
            .validate()
            .map_err(|e| AppError::Config(format!("{e:#}")))?;
        std::fs::create_dir_all(&config.data_dir).map_err(|source| AppError::DataDir {
            path: config.data_dir.display().to_string(),
            source,
        })?;
        let replica = match &config.replica_id {
            Some(id) => id.clone(),
            None => default_replica_id(&config.data_dir)?,
        };
        config.replica_id = Some(replica.clone());
        let catalogue = Arc::new(Catalogue::new(&config.catalogue_models()?)?);
        let identity = Identity::load_or_create(&config.data_dir)?;
        let server_config = identity.server_config(
            config.link().idle_timeout(),
            config.limits.max_node_connections,
        )?;
        let grpc = bind_tcp("gRPC", config.grpc_addr).await?;
        let http = bind_tcp("HTTP", config.http_addr).await?;
        let endpoint =
            quinn::Endpoint::server(server_config, config.quic_addr).map_err(|source| {
                AppError::Bind {
                    what: "QUIC",
                    addr: config.quic_addr,
                    source,
                }
            })?;
        let quic_addr = endpoint.local_addr().map_err(|source| AppError::Bind {
            what: "QUIC",
            addr: config.quic_addr,
            source,
        })?;
        let store = match AnyStore::connect_with(&config.database_url(), &config.store).await {
            Ok(s) => s,
            Err(e) => {
                endpoint.close(0u32.into(), b"");
                return Err(e.into());
            }
        };
        // The one ledger: recovery below and the running coordinator share
        // it (its writer lock and key cache).
        let ledger = Ledger::new(store.clone(), config.ledger_config());
        let recovered = async {
            let (requeued, swept) =
                recover(&store, &ledger, config.limits.max_attempts, &replica).await?;
            // Live from here on: the orphan sweep of the other replicas
            // leaves this replica's nodes and attempts alone while it
            // renews this lease (`dispatch::sweep`).
            let ttl = dispatch::sweep::lease_ttl_ms(config.ledger.sweep_interval_ms);
            store
                .acquire_lease(
                    &liveness_lease(&replica),
                    &replica,
                    ttl,
                    crate::util::now_ms(),
                )
                .await?;
            if swept != ledger::Swept::default() {
                info!(?swept, "ledger recovered at start-up");
            }
            let audits = crate::audit::Audits::load(store.clone(), config.audit.clone())
                .await
                .map_err(|crate::audit::AuditError::Store(e)| AppError::from(e))?;
            Ok::<_, AppError>((requeued, audits))
        }
        .await;
        let (requeued, audits) = match recovered {
            Ok(n) => n,
            Err(e) => {
                store.close().await;
                endpoint.close(0u32.into(), b"");
                return Err(e);
            }
        };
        if requeued > 0 {
            info!(
                requeued,
                "jobs interrupted by the last stop went back to the queue"
            );
        }
        let grpc_addr = local_addr("gRPC", &grpc, config.grpc_addr)?;
        let http_addr = local_addr("HTTP", &http, config.http_addr)?;
        let fingerprint = identity.fingerprint();
        info!(%grpc_addr, %quic_addr, %http_addr, %fingerprint, %replica, "coordinator bound");
        // The handles the layers share, each made once.
        let hub = EventHub::default();
        let sessions = Sessions::default();
        let metrics = Arc::new(Metrics::default());
        let world = World::with_stale_ttl(Duration::from_millis(config.world_stale_ttl_ms));
        let wake = Arc::new(Notify::new());
        let tasks = Arc::new(Tasks::default());
        let shutdown = CancellationToken::new();
        let relay = crate::relay::Relay::for_store(
            &store,
            Arc::clone(&metrics),
            &replica,
            shutdown.clone(),
        );
        let drain = CancellationToken::new();
        let audits = Arc::new(audits);
        let dispatcher = Dispatcher::new(dispatch::Parts {
            config: config.dispatch(),
            store: store.clone(),
            ledger: ledger.clone(),
            catalogue: Arc::clone(&catalogue),
            audits: Arc::clone(&audits),
            hub: hub.clone(),
            relay: relay.clone(),
            sessions: sessions.clone(),
            metrics: Arc::clone(&metrics),
            world: world.clone(),
            wake: Arc::clone(&wake),
            tasks: Arc::clone(&tasks),
            shutdown: shutdown.clone(),
            drain: drain.clone(),
        });
        let link = LinkContext {
            config: config.link(),
            store: store.clone(),
            ledger: ledger.clone(),
            audits,
            catalogue: Arc::clone(&catalogue),
            sessions: sessions.clone(),
            metrics: Arc::clone(&metrics),
            world: world.clone(),
            placement: wake,
            tasks: Arc::clone(&tasks),
            shutdown: shutdown.clone(),
            drain: drain.clone(),
        };
        let api = Arc::new(ApiContext {
            dispatcher: Arc::clone(&dispatcher),
            store: store.clone(),
            ledger,
            catalogue,
            hub,
            relay,
            sessions: sessions.clone(),
            limits: config.limits.clone(),
            admission: Arc::new(Admission::new(&config.limits)),
            shutdown: shutdown.clone(),
        });
        let http_ctx = HttpContext {
            store: store.clone(),
            metrics,
            sessions,
            world,
            api: Arc::clone(&api),
            replica_id: replica.clone(),
            drain: drain.clone(),
        };
        Ok(Application {
            dispatcher,
            link,
            api,
            http_ctx,
            http_config: config.http(),
            store,
            tasks,
            shutdown,
            drain,
            drain_timeout: Duration::from_millis(config.drain_timeout_ms),
            endpoint,
            grpc,
            http,
            grpc_addr,
            quic_addr,
            http_addr,
            fingerprint,
        })
    }

    pub fn grpc_addr(&self) -> SocketAddr {
        self.grpc_addr
    }

    pub fn quic_addr(&self) -> SocketAddr {
        self.quic_addr
    }

    pub fn http_addr(&self) -> SocketAddr {
        self.http_addr
    }

    /// The ledger (accounts, keys): how a harness or the `admin-key` command
    /// creates the first accounts and keys.
    pub fn ledger(&self) -> &Ledger {
        &self.api.ledger
    }

    /// The client API's abuse limits and their live counts.
    pub fn admission(&self) -> Arc<Admission> {
        Arc::clone(&self.api.admission)
    }

    /// Lowercase hex SHA-256 of the node-link certificate's DER.
    pub fn cert_fingerprint(&self) -> String {
        self.fingerprint.clone()
    }

    /// Runs until ctrl-c or SIGTERM.
    pub async fn run_until_stopped(self) -> Result<(), AppError> {
        self.run_until(stop_signal()).await
    }

    /// Runs until `shutdown` resolves (or a server fails), then stops
    /// everything and releases every port and the database.
    ///
    /// A requested stop drains first (see [`drain`]): no queued job is
    /// claimed any more, `/readyz` answers 503, every node is told to move
    /// to another replica (`Reconnect`) and new node connections are
    /// refused; the replica waits (at most `drain_timeout_ms`) until its
    /// nodes have left and every attempt's end is recorded, and only then
    /// stops its loops, which release its leases. A server that fails
    /// stops everything at once.
    pub async fn run_until(
        self,
        shutdown: impl Future<Output = ()> + Send + 'static,
    ) -> Result<(), AppError> {
        let Application {
            dispatcher: d,
            link,
            api,
            http_ctx,
            http_config,
            store,
            tasks,
            shutdown: token,
            drain: drain_token,
            drain_timeout,
            endpoint,
            grpc,
            http,
            quic_addr,
            ..
        } = self;
        let sessions = link.sessions.clone();
        // The loops run supervised: one that panics (or ends before
        // shutdown) is logged and started again, so a panic never stops
        // placement silently while Submit keeps taking holds.
        let placement = tokio::spawn(supervise("placement", token.clone(), {
            let d = Arc::clone(&d);
            move || Arc::clone(&d).placement_loop()
        }));
        d.spawn(supervise("ledger sweep", token.clone(), {
            let d = Arc::clone(&d);
            move || dispatch::sweep::sweep_loop(Arc::clone(&d))
        }));
        let accept = tokio::spawn(supervise("node accept", token.clone(), {
            let endpoint = endpoint.clone();
            move || link::accept_loop(endpoint.clone(), link.clone())
        }));
        let mut grpc_task = tokio::spawn(api::serve(grpc, api, token.clone().cancelled_owned()));
        let mut http_task = tokio::spawn(http::serve(
            http,
            http_ctx,
            http_config,
            token.clone().cancelled_owned(),
        ));

        let mut result = Ok(());
        let mut grpc_done = false;
        let mut http_done = false;
        tokio::select! {
            _ = shutdown => {
                info!("shutting down: draining");
                drain(&drain_token, &sessions, &d, drain_timeout).await;
            }
            r = &mut grpc_task => {
                grpc_done = true;
                result = flatten(r);
            }
            r = &mut http_task => {
                http_done = true;
                result = flatten_http(r);
            }
        }
        token.cancel();
        endpoint.close(link::CLOSE_SHUTDOWN.into(), b"coordinator shutting down");
        if !grpc_done {
            let r = flatten(grpc_task.await);
            if result.is_ok() {
                result = r;
            }
        }
        if !http_done {
            let r = flatten_http(http_task.await);
            if result.is_ok() {
                result = r;
            }
        }
        let _ = placement.await;
        let _ = accept.await;
        tasks.join_all().await;
        endpoint.wait_idle().await;
        drop(endpoint);
        store.close().await;
        drop(d);
        wait_udp_released(quic_addr).await;
        info!("stopped");
        result
    }
}

/// The drain of a requested stop: cancels `token` (placement claims no
/// more, nodes are told to move, new node connections are refused), then
/// waits until every node session has ended and every attempt's end is
/// recorded, or `limit` passed.
async fn drain(token: &CancellationToken, sessions: &Sessions, d: &Dispatcher, limit: Duration) {
    token.cancel();
    let moved = async {
        sessions.emptied().await;
        d.attempts_ended().await;
    };
    match tokio::time::timeout(limit, moved).await {
        Ok(()) => info!("drained: every node moved and every attempt's end is recorded"),
        Err(_) => warn!(
            nodes = sessions.len(),
            ?limit,
            "drain timed out: stopping with nodes still linked"
        ),
    }
}

/// How long a supervised loop that ended waits before it starts again (so
/// one that fails at once does not spin).
const RESTART_PAUSE: Duration = Duration::from_secs(1);

/// Runs the loop `start` makes until `shutdown`: a loop that panics, or
/// returns while the coordinator still runs, is logged and started again
/// after [`RESTART_PAUSE`]. Returns once `shutdown` is cancelled and the
/// running loop has ended.
pub async fn supervise<F, Fut>(name: &'static str, shutdown: CancellationToken, start: F)
where
    F: Fn() -> Fut,
    Fut: Future<Output = ()> + Send + 'static,
{
    loop {
        let ended = tokio::spawn(start()).await;
        if shutdown.is_cancelled() {
            return;
        }
        match ended {
            Err(e) if e.is_panic() => {
                tracing::error!(task = name, "loop panicked; restarting it");
            }
            _ => warn!(task = name, "loop ended before shutdown; restarting it"),
        }
        tokio::select! {
            _ = shutdown.cancelled() => return,
            _ = tokio::time::sleep(RESTART_PAUSE) => {}
        }
    }
}

/// The file in the data directory that keeps the default replica id.
pub const REPLICA_ID_FILE: &str = "replica-id";

/// The replica id of a coordinator started without one: the id kept in
/// `data_dir`'s [`REPLICA_ID_FILE`], made (a random `replica-<12 hex>`)
/// the first time. So a restart on the same data directory is the same
/// replica, and its start-up recovery takes back at once what its earlier
/// incarnation held; replicas sharing a data directory must each be given
/// an id of their own.
fn default_replica_id(data_dir: &std::path::Path) -> Result<String, AppError> {
    let path = data_dir.join(REPLICA_ID_FILE);
    let failed = |source| AppError::DataDir {
        path: path.display().to_string(),
        source,
    };
    match std::fs::read_to_string(&path) {
        Ok(id) if !id.trim().is_empty() => return Ok(id.trim().to_string()),
        Ok(_) => {}
        Err(e) if e.kind() == io::ErrorKind::NotFound => {}
        Err(e) => return Err(failed(e)),
    }
    let id = uuid::Uuid::new_v4().simple().to_string();
    let id = format!("replica-{}", &id[..12]);
    std::fs::write(&path, &id).map_err(failed)?;
    Ok(id)
}

/// Loads the node-link certificate from `config`'s data directory, creating
/// the directory and the pair if absent, and returns its fingerprint: what
/// `Application::build` on the same data directory serves and nodes pin.
/// Touches no database.
pub fn certificate(config: &CoordinatorConfig) -> Result<String, AppError> {
    std::fs::create_dir_all(&config.data_dir).map_err(|source| AppError::DataDir {
        path: config.data_dir.display().to_string(),
        source,
    })?;
    Ok(Identity::load_or_create(&config.data_dir)?.fingerprint())
}

/// Opens the database `config` names (creating and migrating it if needed),
/// creates an admin account named `name` with an admin key, and closes the
/// database. This is how the first key of a network is made: run
/// `mlxnet-coordinator admin-key` on the coordinator's host (whoever can read
/// the database can already do anything). SQLite allows it while the
/// coordinator runs.
pub async fn bootstrap_admin_key(
    config: &CoordinatorConfig,
    name: &str,
) -> Result<IssuedKey, AppError> {
    std::fs::create_dir_all(&config.data_dir).map_err(|source| AppError::DataDir {
        path: config.data_dir.display().to_string(),
        source,
    })?;
    let store = AnyStore::connect_with(&config.database_url(), &config.store).await?;
    let ledger = Ledger::new(store.clone(), config.ledger.clone());
    let key = ledger.bootstrap_admin(name).await;
    store.close().await;
    key.map_err(|e: LedgerError| AppError::Ledger(Box::new(e)))
}

/// Start-up recovery of `replica`, before anything is served: the orphan
/// sweep with `replica` counted dead (its earlier incarnation's nodes
/// offline, their attempts requeued; so are those of every replica whose
/// liveness lease is not live, and nothing of a live replica's), then what
/// a crash left unsettled settled and overdue holds expired (their jobs
/// cancelled). Returns how many jobs went back to the queue and what the
/// sweep did. The simulator (`mlxnet-sim`) runs this after each
/// coordinator crash it injects.
pub async fn recover(
    store: &AnyStore,
    ledger: &Ledger,
    max_attempts: u32,
    replica: &str,
) -> Result<(u64, ledger::Swept), AppError> {
    let requeued = store
        .requeue_orphans(max_attempts, Some(replica), crate::util::now_ms())
        .await?;
    let swept = ledger::sweep(ledger, crate::util::now_ms(), |job| {
        let store = store.clone();
        async move { store.cancel(job).await.map(|_| ()) }
    })
    .await
    .map_err(|e| AppError::Ledger(Box::new(e)))?;
    Ok((requeued, swept))
}

fn flatten(r: Result<Result<(), api::ServeError>, tokio::task::JoinError>) -> Result<(), AppError> {
    Ok(r??)
}

fn flatten_http(r: Result<std::io::Result<()>, tokio::task::JoinError>) -> Result<(), AppError> {
    r?.map_err(AppError::Http)
}

async fn bind_tcp(what: &'static str, addr: SocketAddr) -> Result<TcpListener, AppError> {
    TcpListener::bind(addr)
        .await
        .map_err(|source| AppError::Bind { what, addr, source })
}

fn local_addr(
    what: &'static str,
    l: &TcpListener,
    addr: SocketAddr,
) -> Result<SocketAddr, AppError> {
    l.local_addr()
        .map_err(|source| AppError::Bind { what, addr, source })
}

/// quinn's endpoint driver owns the UDP socket and drops it on its next poll
/// after the last handle is gone. Wait (bounded) until the port can be bound
/// again, so a restart on the same address cannot race it.
async fn wait_udp_released(addr: SocketAddr) {
    for _ in 0..200 {
        if std::net::UdpSocket::bind(addr).is_ok() {
            return;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    warn!(%addr, "QUIC port still in use after shutdown");
}

async fn stop_signal() {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{signal, SignalKind};
        match signal(SignalKind::terminate()) {
            Ok(mut term) => {
                tokio::select! {
                    _ = tokio::signal::ctrl_c() => {}
                    _ = term.recv() => {}
                }
            }
            Err(_) => {
                let _ = tokio::signal::ctrl_c().await;
            }
        }
    }
    #[cfg(not(unix))]
    {
        let _ = tokio::signal::ctrl_c().await;
    }
}

#[cfg(test)]
mod drain_tests;

#[cfg(test)]
mod tests {
    use super::*;

    /// A supervised loop that panics is started again (the second run
    /// reports in); at shutdown the supervisor returns.
    #[tokio::test]
    async fn a_supervised_loop_that_panics_is_started_again() {
        let token = CancellationToken::new();
        let runs = Arc::new(std::sync::atomic::AtomicU32::new(0));
        let (again_tx, mut again) = tokio::sync::mpsc::unbounded_channel::<u32>();
        let supervisor = tokio::spawn(supervise("test", token.clone(), {
            let (runs, token) = (Arc::clone(&runs), token.clone());
            move || {
                let n = runs.fetch_add(1, std::sync::atomic::Ordering::SeqCst) + 1;
                let (again_tx, token) = (again_tx.clone(), token.clone());
                async move {
                    assert!(n > 1, "the first run panics");
                    let _ = again_tx.send(n);
                    token.cancelled().await;
                }
            }
        }));
        assert_eq!(again.recv().await, Some(2), "the loop was started again");
        token.cancel();
        supervisor.await.unwrap();
        assert_eq!(runs.load(std::sync::atomic::Ordering::SeqCst), 2);
    }
    use mlxnet_proto::v1::{
        job_input, jobs_client::JobsClient, GetJobRequest, JobInput, SubmitJobRequest,
    };

    struct Running {
        grpc: SocketAddr,
        quic: SocketAddr,
        http: SocketAddr,
        fingerprint: String,
        stop: tokio::sync::oneshot::Sender<()>,
        task: tokio::task::JoinHandle<Result<(), AppError>>,
        key: String,
    }

    /// Runs `config`; the first run creates a funded admin key, later runs
    /// (same database) reuse `key`.
    async fn run(config: CoordinatorConfig, key: Option<String>) -> Running {
        let app = Application::build(config).await.unwrap();
        let key = match key {
            Some(k) => k,
            None => {
                let admin = app.ledger().bootstrap_admin("test").await.unwrap();
                app.ledger()
                    .grant("t", &admin.account_id, 1_000_000_000, "test")
                    .await
                    .unwrap();
                admin.secret().to_owned()
            }
        };
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        Running {
            key,
            grpc: app.grpc_addr(),
            quic: app.quic_addr(),
            http: app.http_addr(),
            fingerprint: app.cert_fingerprint(),
            stop,
            task: tokio::spawn(app.run_until(async move {
                let _ = stopped.await;
            })),
        }
    }

    /// A coordinator started without a replica id is the same replica at
    /// each restart on its data directory, and another on another one.
    #[test]
    fn the_default_replica_id_is_made_once_per_data_dir_and_kept() {
        let dir = tempfile::tempdir().unwrap();
        let first = default_replica_id(dir.path()).unwrap();
        assert!(
            first.starts_with("replica-") && first.len() == 20,
            "{first}"
        );
        assert_eq!(default_replica_id(dir.path()).unwrap(), first);
        let other = tempfile::tempdir().unwrap();
        assert_ne!(default_replica_id(other.path()).unwrap(), first);
    }

    #[tokio::test]
    async fn restarts_on_the_same_data_dir_and_ports_with_jobs_and_certificate_kept() {
        let dir = tempfile::tempdir().unwrap();
        let mut config = CoordinatorConfig::for_data_dir(dir.path().join("data"));
        let Running {
            grpc,
            quic,
            http,
            fingerprint,
            stop,
            task,
            key,
        } = run(config.clone(), None).await;
        assert_eq!(fingerprint.len(), 64);

        let mut client = jobs_client(grpc, &key).await;
        let job = client
            .submit(SubmitJobRequest {
                model: "smollm2-135m-instruct".into(),
                input: Some(JobInput {
                    kind: Some(job_input::Kind::Prompt("hello".into())),
                }),
                ..Default::default()
            })
            .await
            .unwrap()
            .into_inner();
        let health = crate::test_utils::http_get(http, "/readyz").await;
        assert!(health.starts_with("HTTP/1.1 200"), "{health}");
        let metrics = crate::test_utils::http_get(http, "/metrics").await;
        assert!(
            metrics.contains("mlxnet_jobs_submitted_total 1"),
            "{metrics}"
        );
        // The submit was timed, in OpenMetrics text.
        assert!(
            metrics.contains("\nmlxnet_submit_seconds_count 1\n"),
            "{metrics}"
        );
        assert!(
            metrics.contains("application/openmetrics-text"),
            "{metrics}"
        );
        drop(client);
        stop.send(()).unwrap();
        task.await.unwrap().unwrap();

        config.grpc_addr = grpc;
        config.quic_addr = quic;
        config.http_addr = http;
        let second = run(config, Some(key.clone())).await;
        assert_eq!((second.grpc, second.quic), (grpc, quic));
        assert_eq!(second.fingerprint, fingerprint, "the certificate is reused");
        let (stop, task) = (second.stop, second.task);
        let mut client = jobs_client(grpc, &key).await;
        let again = client
            .get(GetJobRequest {
                job_id: job.id.clone(),
            })
            .await
            .unwrap()
            .into_inner();
        assert_eq!(again.id, job.id);
        assert_eq!(again.input, job.input);
        drop(client);
        stop.send(()).unwrap();
        task.await.unwrap().unwrap();
    }

    /// `mlxnet-coordinator certificate` makes the pair a coordinator on the
    /// same data directory then serves: replicas given copies of it are
    /// pinned by one fingerprint.
    #[tokio::test]
    async fn the_certificate_command_prints_the_fingerprint_the_coordinator_serves() {
        let dir = tempfile::tempdir().unwrap();
        let config = CoordinatorConfig::for_data_dir(dir.path().join("data"));
        let made = certificate(&config).unwrap();
        assert_eq!(made.len(), 64);
        assert_eq!(certificate(&config).unwrap(), made, "created once");
        let running = run(config, None).await;
        assert_eq!(running.fingerprint, made);
        running.stop.send(()).unwrap();
        running.task.await.unwrap().unwrap();
    }

    /// `/readyz` follows the database: 200 while it answers, 503 once the
    /// replica's connections to it are gone (what the Kubernetes readiness
    /// probe and a load balancer act on); `/healthz` still answers.
    #[tokio::test]
    async fn readyz_answers_503_once_the_database_is_gone_and_healthz_still_answers() {
        let app = crate::test_utils::spawn_app(|_| {}).await;
        let ready = crate::test_utils::http_get(app.http_addr, "/readyz").await;
        assert!(ready.starts_with("HTTP/1.1 200"), "{ready}");
        app.ledger.store().close().await;
        let gone = crate::test_utils::http_get(app.http_addr, "/readyz").await;
        assert!(gone.starts_with("HTTP/1.1 503"), "{gone}");
        assert!(gone.ends_with("database unavailable\n"), "{gone}");
        let live = crate::test_utils::http_get(app.http_addr, "/healthz").await;
        assert!(live.starts_with("HTTP/1.1 200"), "{live}");
        app.stop().await;
    }

    async fn jobs_client(grpc: SocketAddr, key: &str) -> JobsClient<crate::test_utils::Authed> {
        let channel = tonic::transport::Channel::from_shared(format!("http://{grpc}"))
            .unwrap()
            .connect()
            .await
            .unwrap();
        JobsClient::new(crate::test_utils::Authed::new(
            channel,
            crate::test_utils::Bearer(Some(format!("Bearer {key}").parse().unwrap())),
        ))
    }
}
