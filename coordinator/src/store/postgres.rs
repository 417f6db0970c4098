//! The PostgreSQL store: a pool of connections to one database that
//! several coordinator replicas may share; schema from
//! `migrations/postgres` (embedded at build time, applied under sqlx's
//! migration lock, so replicas starting together migrate once).
//!
//! Durability: PostgreSQL's defaults (`fsync = on`, `synchronous_commit =
//! on`): a commit returns once its WAL is flushed, so an answered submit
//! survives power loss. [`PgStore::durability`] reports what the server
//! runs with.
//!
//! Write transactions ([`PgStore::write`]) are one at a time per database,
//! across every replica: each queues on an in-process lock (so the ledger's
//! group commit batches this replica's submits), then takes a transaction-
//! scoped advisory lock ([`WRITER_LOCK`]) before its first statement. That is
//! the contract SQLite's `BEGIN IMMEDIATE` gives, kept for several
//! processes: the ledger's rules read balances and then write guarded
//! updates in one state, and no two replicas' batches interleave (nor
//! deadlock on account rows). The job transitions are single guarded
//! statements (row locks, re-checked by PostgreSQL after a wait) and take no
//! advisory lock.
//!
//! Statements run under the configured `statement_timeout`; a connection
//! waits at most `acquire_timeout` for the pool.
//!
//! # Layout
//! - [`jobs`]: jobs, attempts and hand-off segments.
//! - [`nodes`]: registered nodes.
//! - [`ledger`]: accounts, transfers, holds, terms, operators, rewards.
//! - [`keys`]: API keys (hashes only).
//! - [`leases`]: the singleton duties' leases and fences.
//! - [`audits`]: audits and node records.
//! - [`tokens`]: the token relay's rows and its `LISTEN/NOTIFY` wake-ups.

mod audits;
mod jobs;
mod keys;
mod leases;
mod ledger;
mod nodes;
pub mod tokens;

use std::{
    collections::{HashMap, HashSet},
    str::FromStr,
    sync::Arc,
    time::Duration,
};

use mlxnet_proto::ids::JobId;
use sqlx::{
    postgres::{PgConnectOptions, PgPoolOptions},
    PgConnection, PgPool,
};

use super::{
    Anomaly, NewKey, OpenHold, PayerBalance, Result, Side, Store, StoreConfig, StoreTx,
    TokenWakeups,
};
use crate::{
    domain::{
        Account, AttemptEnd, AuditRecord, Availability, CancelOutcome, Completion, JobRecord,
        JobStats, JobTerms, KeyInfo, KeyLimits, Lease, NewJob, NodeEarnings, NodeRecord,
        RecordDelta, RelayChunk, Segment, StoredKey, StreamedEnd, Totals, Transfer,
    },
    util::now_ms,
};

static MIGRATOR: sqlx::migrate::Migrator = sqlx::migrate!("../migrations/postgres");

/// The advisory lock key every write transaction takes (see the module
/// docs): `mlxnetwr` in ASCII.
pub const WRITER_LOCK: i64 = 0x6d6c_786e_6574_7772;

/// A PostgreSQL database.
#[derive(Clone, Debug)]
pub struct PgStore {
    pool: PgPool,
    /// One [`PgTx`] at a time in this process (see the module docs).
    writer: Arc<tokio::sync::Mutex<()>>,
}

/// A write transaction holding the writer locks; commit with
/// [`StoreTx::commit`], drop to roll back.
#[derive(Debug)]
pub struct PgTx {
    tx: sqlx::Transaction<'static, sqlx::Postgres>,
    _writer: tokio::sync::OwnedMutexGuard<()>,
}

impl PgStore {
    /// Connects to the database at `url` with `config`'s pool size and
    /// timeouts, and applies migrations.
    pub async fn connect(url: &str, config: &StoreConfig) -> Result<Self> {
        let timeout = config.statement_timeout_ms.to_string();
        let options = PgConnectOptions::from_str(url)?
            .application_name("mlxnet-coordinator")
            .options([("statement_timeout", timeout.as_str())]);
        let pool = PgPoolOptions::new()
            .max_connections(config.max_connections.max(1))
            .acquire_timeout(Duration::from_millis(config.acquire_timeout_ms.max(1)))
            .connect_with(options)
            .await?;
        MIGRATOR.run(&pool).await?;
        Ok(Self {
            pool,
            writer: Arc::default(),
        })
    }

    /// The connection pool, for the backend's own tests (schema checks).
    #[cfg(test)]
    pub(crate) fn pool(&self) -> &PgPool {
        &self.pool
    }

    async fn conn(&self) -> Result<sqlx::pool::PoolConnection<sqlx::Postgres>> {
        Ok(self.pool.acquire().await?)
    }

    /// A job transition's own transaction (no writer lock: one statement
    /// guards it, see the module docs).
    async fn begin(&self) -> Result<sqlx::Transaction<'static, sqlx::Postgres>> {
        Ok(self.pool.begin().await?)
    }
}

fn conn(tx: &mut PgTx) -> &mut PgConnection {
    &mut tx.tx
}

impl Store for PgStore {
    type Tx = PgTx;

    async fn close(&self) {
        self.pool.close().await;
    }

    async fn ping(&self) -> Result<()> {
        sqlx::query("SELECT 1").execute(&self.pool).await?;
        Ok(())
    }

    async fn durability(&self) -> Result<String> {
        let mut conn = self.conn().await?;
        let fsync: String = sqlx::query_scalar("SHOW fsync")
            .fetch_one(&mut *conn)
            .await?;
        let sync: String = sqlx::query_scalar("SHOW synchronous_commit")
            .fetch_one(&mut *conn)
            .await?;
        Ok(format!("fsync={fsync}, synchronous_commit={sync}"))
    }

    async fn write(&self) -> Result<PgTx> {
        let writer = Arc::clone(&self.writer).lock_owned().await;
        let mut tx = self.begin().await?;
        sqlx::query("SELECT pg_advisory_xact_lock($1)")
            .bind(WRITER_LOCK)
            .execute(&mut *tx)
            .await?;
        Ok(PgTx {
            tx,
            _writer: writer,
        })
    }

    async fn token_wakeups(&self) -> Result<TokenWakeups> {
        Ok(TokenWakeups::listening(
            tokens::TokenListener::connect(&self.pool).await?,
        ))
    }

    super::backend::store_methods!();
}

impl StoreTx for PgTx {
    super::backend::tx_methods!();
}

/// A fresh, empty database on the PostgreSQL server at `server` (the URL
/// of one of its databases): its URL. For tests (a database each).
#[cfg(any(test, feature = "test-utils"))]
pub async fn fresh_database(server: &str) -> Result<String, crate::store::StoreError> {
    use sqlx::{Connection, Executor};
    let name = format!("t_{}", uuid::Uuid::new_v4().simple());
    let mut admin = sqlx::PgConnection::connect(server).await?;
    admin
        .execute(format!("CREATE DATABASE {name}").as_str())
        .await?;
    admin.close().await?;
    let base = server.rsplit_once('/').map_or(server, |(base, _)| base);
    Ok(format!("{base}/{name}"))
}

#[cfg(test)]
mod tests {
    use std::hash::{Hash, Hasher};

    use mlxnet_proto::v1::{JobInput, SamplingParams};

    use super::*;
    use crate::{
        domain::{JobState, TransferKind},
        store::tests::{pg_fresh_database, pg_server_url},
    };

    /// The schema's triggers keep transfer rows immutable, whatever the
    /// caller; the CHECKs refuse an overdraft written around the store.
    #[tokio::test]
    async fn transfer_rows_are_immutable_and_balances_guarded_whatever_the_caller() {
        let Some(server) = pg_server_url() else {
            return;
        };
        let url = crate::store::tests::pg_fresh_database(&server).await;
        let store = PgStore::connect(&url, &StoreConfig::default())
            .await
            .unwrap();
        let mut tx = store.write().await.unwrap();
        tx.insert_transfers(&[Transfer {
            id: "p1".into(),
            kind: TransferKind::Posted,
            debit: "system:treasury".into(),
            credit: "system:fee".into(),
            amount: 5,
            pending_id: None,
            deadline_ms: None,
            job_id: None,
            node_id: None,
            tokens: 0,
            memo: "test".into(),
            created_at_ms: 1,
        }])
        .await
        .unwrap();
        tx.commit().await.unwrap();
        for sql in [
            "UPDATE transfers SET amount = 1 WHERE id = 'p1'",
            "DELETE FROM transfers WHERE id = 'p1'",
            "TRUNCATE transfers CASCADE",
            "UPDATE accounts SET debits_posted = 1 WHERE id = 'system:fee'",
        ] {
            assert!(
                sqlx::query(sql).execute(store.pool()).await.is_err(),
                "{sql}"
            );
        }
        assert_eq!(store.transfer("p1").await.unwrap().unwrap().amount, 5);
        assert!(store.durability().await.unwrap().contains("fsync=on"));
    }

    /// Whether replica `replica` leaves `job` for later on pass `pass` (its
    /// first passes leave about a third of what it claims): seeded.
    fn leaves(seed: u64, replica: usize, pass: u64, job: JobId) -> bool {
        let mut h = std::hash::DefaultHasher::new();
        (seed, replica, pass, job.to_string()).hash(&mut h);
        pass < 3 && h.finish().is_multiple_of(3)
    }

    /// `replicas` stores on one database (each its own pool, as separate
    /// processes have), racing claims of `batch` over `jobs` queued jobs
    /// until none is left. What each replica picked, and how many of its
    /// picks were refused.
    async fn race(
        server: &str,
        replicas: usize,
        jobs: usize,
        batch: u32,
        seed: u64,
    ) -> (PgStore, Vec<(Vec<JobId>, usize)>, usize) {
        let url = pg_fresh_database(server).await;
        let mut stores = Vec::new();
        for _ in 0..replicas {
            stores.push(
                PgStore::connect(&url, &StoreConfig::default())
                    .await
                    .unwrap(),
            );
        }
        let new: Vec<NewJob> = (0..jobs)
            .map(|_| NewJob {
                id: JobId::new(),
                model: "m".into(),
                input: JobInput::default(),
                sampling: SamplingParams::default(),
                priority: 0,
            })
            .collect();
        let mut tx = stores[0].write().await.unwrap();
        let rows: Vec<(&NewJob, i64)> = new.iter().zip(0..).collect();
        tx.insert_jobs(&rows).await.unwrap();
        tx.commit().await.unwrap();
        let first = stores[0].clone();
        let tasks: Vec<_> = stores
            .into_iter()
            .enumerate()
            .map(|(r, store)| {
                tokio::spawn(async move {
                    let node = format!("node-{r}");
                    let (mut picked, mut refused) = (Vec::new(), 0);
                    for pass in 0.. {
                        let mut claimed = 0;
                        let mut picks = Vec::new();
                        let done = store
                            .claim_queued(batch, |jobs| {
                                claimed = jobs.len();
                                picks = jobs
                                    .iter()
                                    .filter(|(j, _)| !leaves(seed, r, pass, j.id))
                                    .map(|(j, _)| j.id)
                                    .collect();
                                picks.iter().map(|id| (*id, 1, node.clone())).collect()
                            })
                            .await
                            .unwrap();
                        refused += done.iter().filter(|ok| !**ok).count();
                        picked.extend(
                            picks
                                .into_iter()
                                .zip(done)
                                .filter(|(_, ok)| *ok)
                                .map(|(id, _)| id),
                        );
                        if claimed == 0 {
                            break;
                        }
                        tokio::task::yield_now().await;
                    }
                    (picked, refused)
                })
            })
            .collect();
        let mut out = Vec::new();
        for t in tasks {
            out.push(t.await.unwrap());
        }
        (first, out, jobs)
    }

    proptest::proptest! {
        #![proptest_config(proptest::test_runner::Config::with_cases(8))]

        /// Replicas racing for one queue never take a job twice: every job
        /// a replica's claim picked is assigned to it (no other claim held
        /// that job meanwhile, so no replica ever books a node for a job
        /// another replica got), and every job ends assigned exactly once.
        #[test]
        fn replicas_racing_for_one_queue_never_take_a_job_twice(
            replicas in 2usize..=3,
            jobs in 1usize..80,
            batch in 1u32..12,
            seed in proptest::prelude::any::<u64>(),
        ) {
            let Some(server) = pg_server_url() else {
                return Ok(());
            };
            let rt = tokio::runtime::Runtime::new().unwrap();
            let (store, per_replica, jobs) =
                rt.block_on(race(&server, replicas, jobs, batch, seed));
            let refused: usize = per_replica.iter().map(|(_, n)| n).sum();
            proptest::prop_assert_eq!(refused, 0, "a claimed job was taken by another replica");
            let mut all = HashSet::new();
            for (r, (picked, _)) in per_replica.iter().enumerate() {
                for id in picked {
                    proptest::prop_assert!(all.insert(*id), "job {} taken twice", id);
                    let j = rt.block_on(store.get_job(*id)).unwrap().unwrap();
                    let node = format!("node-{r}");
                    proptest::prop_assert_eq!(
                        (j.state, j.node_id.as_deref()),
                        (JobState::Assigned, Some(node.as_str()))
                    );
                }
            }
            proptest::prop_assert_eq!(all.len(), jobs, "every job placed");
            proptest::prop_assert_eq!(rt.block_on(store.count_queued()).unwrap(), 0);
            let attempts: i64 = rt
                .block_on(
                    sqlx::query_scalar("SELECT COUNT(*) FROM job_attempts").fetch_one(store.pool()),
                )
                .unwrap();
            proptest::prop_assert_eq!(attempts, jobs as i64, "one attempt row per job");
        }
    }

    /// `replicas` stores on one database (each its own pool, as separate
    /// processes have) over `jobs` queued jobs and the nodes `slots`
    /// (`node-<i>` with `slots[i]` slots), each placing every job it claims
    /// onto the nodes as if it alone booked them (up to each node's slots,
    /// less what it booked itself: the stale view of a replica that has not
    /// heard of the others' bookings), in a seeded order, until a pass
    /// books nothing (a pass may stop a replica while another node has
    /// room: the property is about over-booking, not about filling every
    /// slot). What each replica was told it booked, per node.
    async fn book_race(
        server: &str,
        replicas: usize,
        jobs: usize,
        slots: &[u32],
        batch: u32,
        seed: u64,
    ) -> (PgStore, Vec<HashMap<String, usize>>) {
        use rand::{seq::SliceRandom, SeedableRng};
        let url = pg_fresh_database(server).await;
        let mut stores = Vec::new();
        for _ in 0..replicas {
            stores.push(
                PgStore::connect(&url, &StoreConfig::default())
                    .await
                    .unwrap(),
            );
        }
        for (i, n) in slots.iter().enumerate() {
            let record = NodeRecord {
                id: format!("node-{i}"),
                name: format!("node {i}"),
                hardware: "{}".into(),
                models: "[]".into(),
                version: "1".into(),
                slots: *n,
            };
            stores[0].upsert_node(&record, "replica-a").await.unwrap();
        }
        let new: Vec<NewJob> = (0..jobs)
            .map(|_| NewJob {
                id: JobId::new(),
                model: "m".into(),
                input: JobInput::default(),
                sampling: SamplingParams::default(),
                priority: 0,
            })
            .collect();
        let mut tx = stores[0].write().await.unwrap();
        let rows: Vec<(&NewJob, i64)> = new.iter().zip(0..).collect();
        tx.insert_jobs(&rows).await.unwrap();
        tx.commit().await.unwrap();
        let first = stores[0].clone();
        let slots = slots.to_vec();
        let tasks: Vec<_> = stores
            .into_iter()
            .enumerate()
            .map(|(r, store)| {
                let slots = slots.clone();
                tokio::spawn(async move {
                    let mut rng = rand::rngs::StdRng::seed_from_u64(seed ^ r as u64);
                    let mut booked: HashMap<String, usize> = HashMap::new();
                    loop {
                        let mut picks: Vec<(JobId, u32, String)> = Vec::new();
                        let mut order: Vec<usize> = (0..slots.len()).collect();
                        order.shuffle(&mut rng);
                        let done = store
                            .claim_queued(batch, |claimed| {
                                let mut free: Vec<(String, usize)> = order
                                    .iter()
                                    .map(|&i| {
                                        let node = format!("node-{i}");
                                        let mine = booked.get(&node).copied().unwrap_or(0);
                                        (node, (slots[i] as usize).saturating_sub(mine))
                                    })
                                    .collect();
                                for (j, _) in &claimed {
                                    if let Some((node, left)) =
                                        free.iter_mut().find(|(_, left)| *left > 0)
                                    {
                                        *left -= 1;
                                        picks.push((j.id, j.attempt, node.clone()));
                                    }
                                }
                                picks.clone()
                            })
                            .await
                            .unwrap();
                        let mut any = false;
                        for ((_, _, node), ok) in picks.iter().zip(&done) {
                            if *ok {
                                any = true;
                                *booked.entry(node.clone()).or_default() += 1;
                            }
                        }
                        if !any {
                            break;
                        }
                        tokio::task::yield_now().await;
                    }
                    booked
                })
            })
            .collect();
        let mut out = Vec::new();
        for t in tasks {
            out.push(t.await.unwrap());
        }
        (first, out)
    }

    proptest::proptest! {
        #![proptest_config(proptest::test_runner::Config::with_cases(8))]

        /// Replicas racing for one queue never double-book a node: each
        /// places what it claims onto the same nodes as if it alone booked
        /// them, and the store's conditional booking lets no node hold
        /// more assigned jobs than its slots; what each replica was told
        /// it booked is exactly what the database holds.
        #[test]
        fn replicas_racing_for_one_queue_never_double_book_a_node(
            replicas in 2usize..=3,
            jobs in 1usize..60,
            slots in proptest::collection::vec(1u32..6, 1..4),
            batch in 1u32..12,
            seed in proptest::prelude::any::<u64>(),
        ) {
            let Some(server) = pg_server_url() else {
                return Ok(());
            };
            let rt = tokio::runtime::Runtime::new().unwrap();
            let (store, per_replica) =
                rt.block_on(book_race(&server, replicas, jobs, &slots, batch, seed));
            let held: Vec<(String, i64)> = rt
                .block_on(
                    sqlx::query_as(
                        "SELECT node_id, COUNT(*) FROM jobs WHERE state = 'assigned' GROUP BY node_id",
                    )
                    .fetch_all(store.pool()),
                )
                .unwrap();
            let held: HashMap<String, i64> = held.into_iter().collect();
            for (i, n) in slots.iter().enumerate() {
                let node = format!("node-{i}");
                let booked = held.get(&node).copied().unwrap_or(0);
                proptest::prop_assert!(
                    booked <= i64::from(*n),
                    "{} holds {} jobs, over its {} slots", node, booked, n
                );
                let told: usize = per_replica.iter().filter_map(|b| b.get(&node)).sum();
                proptest::prop_assert_eq!(told as i64, booked, "told of bookings the database lacks");
            }
            let total: i64 = held.values().sum();
            proptest::prop_assert!(total >= 1, "nothing was booked");
        }
    }
}
