//! Coordinator replicas for failover tests: several `Application`s on one
//! PostgreSQL database, each in a tokio runtime of its own, so a test can
//! stop one as SIGTERM does ([`Replica::drain`]: the same shutdown future
//! `run_until_stopped` waits on) or as a crash does ([`Replica::kill`]:
//! its runtime dropped, every task, socket and database connection gone at
//! once, nothing sent to its nodes). [`process`] runs replicas as child
//! processes instead, for a real SIGKILL.
//!
//! # Invariants
//! - Each replica binds `127.0.0.1:0` (or the ports its config names, to
//!   come back where its nodes look for it) before the test learns them.
//! - Nothing waits by sleeping: every wait is on an event, under the
//!   harness's [`DEADLINE`](crate::DEADLINE).

use std::{net::SocketAddr, path::Path};

use anyhow::{anyhow, Context};
use mlx_node::link::LinkStatus;
use mlxnet_coordinator::{app::Application, config::CoordinatorConfig, test_utils::postgres};
use tokio::sync::{oneshot, watch};

use crate::{init_tracing, within, Accounts, ACCOUNTS_FILE};

pub mod process;

/// A fresh database on the PostgreSQL test server (`None`: no server is
/// configured here; the caller skips).
pub async fn fresh_database() -> anyhow::Result<Option<String>> {
    let Some(server) = postgres::pg_server_url() else {
        return Ok(None);
    };
    Ok(Some(postgres::pg_fresh_database(&server).await?))
}

/// A replica's config: its data in `dir`, the database at `database_url`,
/// named `id`, with heartbeats every 500 ms (a node notices a replica that
/// died within a few seconds rather than the default's 20) and a drain of
/// up to 120 s.
pub fn replica_config(dir: &Path, database_url: &str, id: &str) -> CoordinatorConfig {
    let mut config = CoordinatorConfig::for_data_dir(dir.to_path_buf());
    config.database_url = Some(database_url.to_string());
    config.replica_id = Some(id.to_string());
    config.heartbeat_interval_ms = 500;
    config.heartbeat_timeout_ms = 5_000;
    // A drain waits for the real node to move: generously (the tests'
    // default is 2 s, for hand-made nodes that never move).
    config.drain_timeout_ms = 120_000;
    config
}

/// What a replica reports once built.
type Built = (SocketAddr, SocketAddr, SocketAddr, String, Accounts);

/// A running replica.
pub struct Replica {
    pub grpc_addr: SocketAddr,
    pub quic_addr: SocketAddr,
    pub http_addr: SocketAddr,
    pub fingerprint: String,
    /// Its config, with the ports it got: starting it again comes back on them.
    pub config: CoordinatorConfig,
    pub accounts: Accounts,
    stop: Option<oneshot::Sender<()>>,
    done: Option<oneshot::Receiver<anyhow::Result<()>>>,
    runtime: Option<tokio::runtime::Runtime>,
}

impl Replica {
    /// Builds and runs a replica from `config` in a runtime of its own. The
    /// test accounts are read from its data directory, or made (once per
    /// database: copy them with [`Replica::share_accounts`]).
    pub async fn start(config: CoordinatorConfig) -> anyhow::Result<Self> {
        init_tracing();
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .thread_name("replica")
            .enable_all()
            .build()?;
        let (ready_tx, ready) = oneshot::channel::<anyhow::Result<Built>>();
        let (stop, stopped) = oneshot::channel::<()>();
        let (done_tx, done) = oneshot::channel();
        let data_dir = config.data_dir.clone();
        let build_config = config.clone();
        runtime.spawn(async move {
            let built = async {
                let app = Application::build(build_config)
                    .await
                    .context("building a replica")?;
                let accounts = Accounts::load_or_create(&app, &data_dir).await?;
                Ok::<_, anyhow::Error>((app, accounts))
            }
            .await;
            match built {
                Err(e) => {
                    let _ = ready_tx.send(Err(e));
                }
                Ok((app, accounts)) => {
                    let _ = ready_tx.send(Ok((
                        app.grpc_addr(),
                        app.quic_addr(),
                        app.http_addr(),
                        app.cert_fingerprint(),
                        accounts,
                    )));
                    let r = app
                        .run_until(async move {
                            let _ = stopped.await;
                        })
                        .await;
                    let _ = done_tx.send(r.map_err(anyhow::Error::from));
                }
            }
        });
        let built = within("a replica's start", ready).await?;
        let (grpc_addr, quic_addr, http_addr, fingerprint, accounts) = match built {
            Ok(Ok(b)) => b,
            Ok(Err(e)) => {
                runtime.shutdown_background();
                return Err(e);
            }
            Err(_) => {
                runtime.shutdown_background();
                return Err(anyhow!("the replica's runtime ended before it started"));
            }
        };
        let mut config = config;
        config.grpc_addr = grpc_addr;
        config.quic_addr = quic_addr;
        config.http_addr = http_addr;
        Ok(Self {
            grpc_addr,
            quic_addr,
            http_addr,
            fingerprint,
            config,
            accounts,
            stop: Some(stop),
            done: Some(done),
            runtime: Some(runtime),
        })
    }

    /// Copies the test accounts `from` a replica's data directory `to`
    /// another's, so a replica started there uses the same accounts.
    pub fn share_accounts(from: &Path, to: &Path) -> anyhow::Result<()> {
        std::fs::create_dir_all(to)?;
        std::fs::copy(from.join(ACCOUNTS_FILE), to.join(ACCOUNTS_FILE))?;
        Ok(())
    }

    /// Stops it as SIGTERM does (it drains), and waits until it has
    /// stopped; returns its config (its ports) and how `run_until` ended.
    pub async fn drain(mut self) -> anyhow::Result<CoordinatorConfig> {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        if let Some(done) = self.done.take() {
            within("a replica's drain and stop", done)
                .await?
                .map_err(|_| anyhow!("the replica's runtime ended before it stopped"))??;
        }
        Ok(self.config.clone())
    }

    /// Stops it as a crash does: its runtime is dropped at once.
    pub fn kill(mut self) -> CoordinatorConfig {
        if let Some(runtime) = self.runtime.take() {
            runtime.shutdown_background();
        }
        self.config.clone()
    }
}

impl Drop for Replica {
    fn drop(&mut self) {
        if let Some(runtime) = self.runtime.take() {
            runtime.shutdown_background();
        }
    }
}

/// Waits until the node whose link status is `status` is registered with
/// the coordinator replica at `quic_addr`.
pub async fn registered_with(
    status: &mut watch::Receiver<LinkStatus>,
    quic_addr: SocketAddr,
) -> anyhow::Result<()> {
    within(
        "the node's registration with the replica",
        status.wait_for(
            |s| matches!(s, LinkStatus::Registered { coordinator, .. } if *coordinator == quic_addr),
        ),
    )
    .await?
    .map_err(|_| anyhow!("node stopped"))?;
    Ok(())
}

/// The link statuses a node showed, in order, recorded from
/// [`record_statuses`] on (a state held only for an instant may be missed;
/// none is invented).
pub type Statuses = std::sync::Arc<std::sync::Mutex<Vec<LinkStatus>>>;

/// Records every link status the node shows from now on (until it stops).
pub fn record_statuses(mut status: watch::Receiver<LinkStatus>) -> Statuses {
    let seen: Statuses = Default::default();
    let out = seen.clone();
    tokio::spawn(async move {
        loop {
            let now = status.borrow_and_update().clone();
            out.lock().unwrap_or_else(|p| p.into_inner()).push(now);
            if status.changed().await.is_err() {
                return;
            }
        }
    });
    seen
}
