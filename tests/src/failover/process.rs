//! Coordinator replicas as real processes, for fault tests that SIGKILL
//! one: the test binary run again as a child ([`child_main`], called from
//! an ignored test the parent names on the command line, as `crash.rs`
//! does), which builds the same `Application` that `mlxnet-coordinator`
//! runs on a shared PostgreSQL database, prints one `READY` line and runs
//! until its stdin closes (the parent holds it: a parent that dies takes
//! its children with it).
//!
//! The child's config is [`replica_config`] (heartbeats every 500 ms)
//! with a sweep every second, so a killed replica's liveness lease lapses
//! within 3 s and its attempts go back to the queue at the next pass of
//! whichever replica holds the sweep's lease; audits are off (pay on
//! completion: every hold of an ended job resolves at once).
//!
//! # Invariants
//! - Each child binds `127.0.0.1:0`; the parent learns the ports from the
//!   `READY` line, never by sleeping.
//! - [`ReplicaProcess::kill`] is SIGKILL: no drain, no lease released,
//!   sockets closed by the kernel, transactions left to PostgreSQL.
//!
//! # Failure
//! A child that exits or prints nothing within the harness's deadline is
//! an error; a dropped [`ReplicaProcess`] is killed, so a failed test
//! leaves no process behind.

use std::{
    io::{BufRead, BufReader, Read},
    net::SocketAddr,
    path::{Path, PathBuf},
    process::{Child, Command, Stdio},
};

use anyhow::{anyhow, bail, Context};
use mlxnet_coordinator::{app::Application, config::CoordinatorConfig};

use super::replica_config;
use crate::{init_tracing, within, Accounts};

/// Set (to "1") in a child's environment by its parent.
const CHILD_MARK: &str = "MLXNET_TESTS_REPLICA_CHILD";
const DIR_VAR: &str = "MLXNET_TESTS_REPLICA_DIR";
const DATABASE_VAR: &str = "MLXNET_TESTS_REPLICA_DATABASE";
const ID_VAR: &str = "MLXNET_TESTS_REPLICA_ID";

/// A process replica's config: [`replica_config`], swept every second,
/// audits off, no per-key rate, and a short drain (its nodes are stopped
/// before it is).
pub fn process_config(dir: &Path, database_url: &str, id: &str) -> CoordinatorConfig {
    let mut config = replica_config(dir, database_url, id);
    config.ledger.sweep_interval_ms = 1_000;
    config.audit.window_ms = 0;
    config.audit.rate_new = 0.0;
    config.audit.rate_floor = 0.0;
    config.limits.key_requests_per_sec = 0;
    config.limits.key_max_in_flight = 0;
    config.drain_timeout_ms = 5_000;
    config
}

/// The child's body: run by the ignored test `test` (its libtest name,
/// e.g. `replica_kill::replica_child`) when the parent started it; run any
/// other way (`--include-ignored`) it does nothing.
pub fn child_main() -> anyhow::Result<()> {
    if std::env::var(CHILD_MARK).as_deref() != Ok("1") {
        eprintln!("not started by a replica-process test: nothing to do");
        return Ok(());
    }
    let var = |name: &str| std::env::var(name).with_context(|| format!("{name} is not set"));
    let dir = PathBuf::from(var(DIR_VAR)?);
    let config = process_config(&dir, &var(DATABASE_VAR)?, &var(ID_VAR)?);
    init_tracing();
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    runtime.block_on(async {
        let app = Application::build(config).await?;
        let accounts = Accounts::load_or_create(&app, &dir).await?;
        println!(
            "READY {} {} {} {} {} {}",
            app.grpc_addr(),
            app.quic_addr(),
            app.http_addr(),
            app.cert_fingerprint(),
            accounts.client_key,
            accounts.operator_account,
        );
        app.run_until(async {
            // The parent holds stdin: its end (or death) stops the child.
            let _ = tokio::task::spawn_blocking(|| {
                let mut sink = Vec::new();
                std::io::stdin().read_to_end(&mut sink)
            })
            .await;
        })
        .await?;
        anyhow::Ok(())
    })
}

/// A replica running in a child process.
pub struct ReplicaProcess {
    pub id: String,
    pub grpc_addr: SocketAddr,
    pub quic_addr: SocketAddr,
    pub http_addr: SocketAddr,
    pub fingerprint: String,
    /// The shared test client's key, and the operator account nodes earn into.
    pub client_key: String,
    pub operator_account: String,
    child: Option<Child>,
}

impl ReplicaProcess {
    /// Starts replica `id` on `database_url` with its data in `dir`, as the
    /// ignored test `child_test` of this test binary; waits for its `READY`
    /// line. The test accounts are made by the first replica of a database;
    /// copy them to the others' directories before they start
    /// ([`super::Replica::share_accounts`]).
    pub async fn start(
        child_test: &str,
        dir: &Path,
        database_url: &str,
        id: &str,
    ) -> anyhow::Result<Self> {
        std::fs::create_dir_all(dir)?;
        let mut child = Command::new(std::env::current_exe()?)
            .args(["--exact", child_test, "--ignored", "--nocapture"])
            .env(CHILD_MARK, "1")
            .env(DIR_VAR, dir)
            .env(DATABASE_VAR, database_url)
            .env(ID_VAR, id)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .context("starting a replica process")?;
        let stdout = child.stdout.take().context("the child's stdout")?;
        let (ready_tx, ready) = tokio::sync::oneshot::channel::<String>();
        let name = id.to_owned();
        // Reads every line (so the child never blocks on a full pipe): the
        // READY line goes to the parent, the rest (libtest's, the child's
        // tracing under TEST_LOG) to the test's output.
        std::thread::spawn(move || {
            let mut ready_tx = Some(ready_tx);
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                match (line.strip_prefix("READY "), ready_tx.take()) {
                    (Some(rest), Some(tx)) => {
                        let _ = tx.send(rest.to_owned());
                    }
                    (_, tx) => {
                        ready_tx = tx;
                        eprintln!("[{name}] {line}");
                    }
                }
            }
        });
        let mut started = Self {
            id: id.to_owned(),
            grpc_addr: ([127, 0, 0, 1], 0).into(),
            quic_addr: ([127, 0, 0, 1], 0).into(),
            http_addr: ([127, 0, 0, 1], 0).into(),
            fingerprint: String::new(),
            client_key: String::new(),
            operator_account: String::new(),
            child: Some(child),
        };
        let line = within("a replica process's READY line", ready)
            .await?
            .map_err(|_| anyhow!("replica {id} exited before it was ready"))?;
        let parts: Vec<&str> = line.split_whitespace().collect();
        let [grpc, quic, http, fingerprint, client_key, operator] = parts[..] else {
            bail!("replica {id} printed a malformed READY line: {line:?}");
        };
        started.grpc_addr = grpc.parse()?;
        started.quic_addr = quic.parse()?;
        started.http_addr = http.parse()?;
        started.fingerprint = fingerprint.to_owned();
        started.client_key = client_key.to_owned();
        started.operator_account = operator.to_owned();
        Ok(started)
    }

    /// SIGKILL: the process stops dead, whatever it was doing.
    pub fn kill(mut self) -> anyhow::Result<()> {
        if let Some(mut child) = self.child.take() {
            child.kill().context("killing a replica process")?;
            child.wait()?;
        }
        Ok(())
    }

    /// A clean stop: its stdin closes, it drains and exits; waits for that.
    pub async fn stop(mut self) -> anyhow::Result<()> {
        let Some(mut child) = self.child.take() else {
            return Ok(());
        };
        drop(child.stdin.take());
        let id = self.id.clone();
        let status = within(
            "a replica process's clean stop",
            tokio::task::spawn_blocking(move || child.wait()),
        )
        .await???;
        anyhow::ensure!(status.success(), "replica {id} exited with {status}");
        Ok(())
    }
}

impl Drop for ReplicaProcess {
    fn drop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}
