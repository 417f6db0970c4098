//! The ledger: accounts in integer micro-MLX, double-entry two-phase
//! transfers (the TigerBeetle model), API keys, and the job settlement built
//! on them. Users see "MLX tokens"; in code "token" means a model token and
//! the currency is `mlx` / `micro_mlx` (1 MLX = 1,000,000 micro-MLX).
//!
//! Accounts: clients and node operators (users; either may submit jobs and
//! earn), and the network's own: the treasury (issues grants; the only
//! account allowed below zero), job escrow, the network fee, and the reward
//! pool. Money moves only through [`transfer`]; jobs pay through [`settle`];
//! callers authenticate through [`keys`].
//!
//! # Invariants
//! - Amounts are `i64` micro-MLX, never floats, never negative.
//! - The sum over all accounts of `credits - debits` (posted and pending
//!   separately) is zero at every commit: each transfer debits one account and
//!   credits another by the same amount.
//! - Transfer rows are immutable (schema triggers); a transfer's id is its
//!   idempotency key; a hold is resolved at most once (schema index).
//! - An account with `no_overdraft` never has debits (posted + pending)
//!   above its posted credits (checked here, and by a schema CHECK).
//! - Every operation runs in one SQLite transaction, so a crash at any point
//!   leaves either all of it or none of it.
//!
//! # Failure
//! [`LedgerError`]: a refused operation (insufficient balance, unknown
//! account, a reused id) changes nothing; database errors are kept as the
//! source and never shown to clients.

pub mod keys;
pub mod rewards;
pub mod settle;
mod submit;
pub mod transfer;

#[cfg(test)]
mod tests;

use serde::Deserialize;
use sqlx::{sqlite::SqliteRow, Row, SqlitePool};

pub use crate::domain::{
    Account, AccountKind, Applied, JobTerms, NewTransfer, NodeEarnings, Price, Totals, Transfer,
    TransferKind,
};
pub use settle::Share;

use crate::store::StoreError;

/// Issues every MLX token that enters the ledger; may go below zero.
pub const TREASURY: &str = "system:treasury";
/// Holds job payments between submit and settlement.
pub const ESCROW: &str = "system:escrow";
/// Collects the network's fee on every paid job.
pub const FEE: &str = "system:fee";
/// Funds availability rewards.
pub const REWARD_POOL: &str = "system:reward_pool";

/// Ledger settings (`[ledger]` in the coordinator config).
#[derive(Clone, Debug, Deserialize, PartialEq)]
#[serde(default, deny_unknown_fields)]
pub struct LedgerConfig {
    /// Network fee on each job's price, in basis points (500 = 5%).
    pub fee_bps: u32,
    /// How long a job's hold lives; a job still unfinished then is cancelled
    /// and its hold expires.
    pub hold_ttl_ms: i64,
    /// How often the expiry sweep runs.
    pub sweep_interval_ms: u64,
    /// Test knob for the crash-consistency test: the process stops dead
    /// (prints `settlement paused at step N` and waits forever, holding its
    /// transaction open) at the N-th settlement step since start. Never set
    /// in production.
    pub test_pause_at_step: Option<u32>,
    /// Length of an availability reward epoch.
    pub reward_epoch_ms: i64,
    /// Pay for a completed job waits this long after completion (the audit
    /// window, set from `[audit] window_ms` by the coordinator); a failed
    /// audit voids it instead.
    #[serde(skip)]
    pub audit_window_ms: i64,
    /// Micro-MLX a dedicated node earns per GiB offered per hour online.
    pub reward_per_gib_hour: u64,
    /// Most the reward pool pays out per epoch, in micro-MLX.
    pub reward_pool_per_epoch: i64,
}

impl Default for LedgerConfig {
    fn default() -> Self {
        Self {
            fee_bps: 500,
            hold_ttl_ms: 24 * 60 * 60 * 1000,
            sweep_interval_ms: 5_000,
            test_pause_at_step: None,
            audit_window_ms: 0,
            reward_epoch_ms: 60 * 60 * 1000,
            reward_per_gib_hour: 1_000,
            reward_pool_per_epoch: 100_000_000,
        }
    }
}

/// Why a ledger operation failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum LedgerError {
    #[error("database error")]
    Database(#[from] sqlx::Error),
    #[error("job store")]
    Store(#[from] StoreError),
    #[error("account {0} does not exist")]
    NoSuchAccount(String),
    #[error("insufficient balance in {account}: {needed} micro-MLX needed, {available} available")]
    InsufficientFunds {
        account: String,
        needed: i64,
        available: i64,
    },
    #[error("transfer {id} already exists with different fields")]
    ExistsWithDifferentFields { id: String },
    #[error("pending transfer {0} does not exist")]
    NoSuchPending(String),
    #[error("pending transfer {0} was already resolved")]
    AlreadyResolved(String),
    #[error("pending transfer {id} expired at {deadline_ms}")]
    PendingExpired { id: String, deadline_ms: i64 },
    #[error("cannot post {amount}: the pending transfer holds {pending}")]
    ExceedsPending { amount: i64, pending: i64 },
    #[error("{0}")]
    Invalid(&'static str),
    #[error("stored ledger data does not decode: {0}")]
    Corrupt(String),
    #[error("the group commit this submit was in failed: {0}")]
    BatchAborted(String),
}

impl From<crate::domain::InvalidScopes> for LedgerError {
    fn from(e: crate::domain::InvalidScopes) -> Self {
        LedgerError::Invalid(e.0)
    }
}

pub(crate) fn account_from_row(row: &SqliteRow) -> Result<Account, LedgerError> {
    let kind: String = row.try_get("kind")?;
    let no_overdraft: i64 = row.try_get("no_overdraft")?;
    Ok(Account {
        id: row.try_get("id")?,
        name: row.try_get("name")?,
        kind: AccountKind::parse(&kind)
            .ok_or_else(|| LedgerError::Corrupt(format!("unknown account kind {kind:?}")))?,
        no_overdraft: no_overdraft != 0,
        debits_pending: row.try_get("debits_pending")?,
        debits_posted: row.try_get("debits_posted")?,
        credits_pending: row.try_get("credits_pending")?,
        credits_posted: row.try_get("credits_posted")?,
        created_at_ms: row.try_get("created_at_ms")?,
    })
}

/// The ledger over the coordinator's database.
#[derive(Clone, Debug)]
pub struct Ledger {
    pool: SqlitePool,
    config: LedgerConfig,
    /// One ledger write transaction at a time (see [`Ledger::write_tx`]).
    writer: std::sync::Arc<tokio::sync::Mutex<()>>,
    /// Submits waiting for the next group commit (see [`Ledger::submit_job`]).
    submits: std::sync::Arc<std::sync::Mutex<Vec<submit::QueuedSubmit>>>,
    /// Recently authenticated keys (see [`keys`]).
    keys: std::sync::Arc<keys::KeyCache>,
}

/// A ledger write transaction holding the in-process writer lock; commit
/// with [`WriteTx::commit`], drop to roll back.
pub(crate) struct WriteTx {
    tx: sqlx::Transaction<'static, sqlx::Sqlite>,
    _guard: tokio::sync::OwnedMutexGuard<()>,
}

impl WriteTx {
    pub(crate) async fn commit(self) -> Result<(), LedgerError> {
        Ok(self.tx.commit().await?)
    }
}

impl std::ops::Deref for WriteTx {
    type Target = sqlx::SqliteConnection;
    fn deref(&self) -> &sqlx::SqliteConnection {
        &self.tx
    }
}

impl std::ops::DerefMut for WriteTx {
    fn deref_mut(&mut self) -> &mut sqlx::SqliteConnection {
        &mut self.tx
    }
}

impl Ledger {
    /// The ledger in the database behind `pool` (migrated by the store).
    pub fn new(pool: SqlitePool, config: LedgerConfig) -> Self {
        Self {
            pool,
            config,
            writer: std::sync::Arc::default(),
            submits: std::sync::Arc::default(),
            keys: std::sync::Arc::default(),
        }
    }

    pub(crate) fn key_cache(&self) -> &keys::KeyCache {
        &self.keys
    }

    /// The ledger in `store`'s database (tools and tests that open it).
    pub fn of_store(store: &crate::store::Store, config: LedgerConfig) -> Self {
        Self::new(store.pool().clone(), config)
    }

    pub fn config(&self) -> &LedgerConfig {
        &self.config
    }

    pub(crate) fn pool(&self) -> &SqlitePool {
        &self.pool
    }

    /// A write transaction that holds SQLite's write lock from its start
    /// (`BEGIN IMMEDIATE`): its reads and writes see one state, and a
    /// concurrent writer waits instead of failing the upgrade from a read
    /// snapshot. Ledger writers queue on an in-process lock first, so they
    /// never meet in SQLite's busy handler (which sleeps for milliseconds).
    pub(crate) async fn write_tx(&self) -> Result<WriteTx, LedgerError> {
        let guard = self.writer_lock().await;
        self.begin_locked(guard).await
    }

    /// The in-process writer lock alone (a group commit looks at its queue
    /// before it opens a transaction).
    pub(crate) async fn writer_lock(&self) -> tokio::sync::OwnedMutexGuard<()> {
        std::sync::Arc::clone(&self.writer).lock_owned().await
    }

    /// A write transaction under an already held writer lock.
    pub(crate) async fn begin_locked(
        &self,
        guard: tokio::sync::OwnedMutexGuard<()>,
    ) -> Result<WriteTx, LedgerError> {
        let tx = self.pool.begin_with("BEGIN IMMEDIATE").await?;
        Ok(WriteTx { tx, _guard: guard })
    }

    /// Creates a client or operator account with a zero balance.
    pub async fn create_account(
        &self,
        name: &str,
        kind: AccountKind,
    ) -> Result<Account, LedgerError> {
        if !matches!(kind, AccountKind::Client | AccountKind::Operator) {
            return Err(LedgerError::Invalid(
                "only client and operator accounts can be created",
            ));
        }
        let name = name.trim();
        if name.is_empty() || name.len() > 64 {
            return Err(LedgerError::Invalid("an account name is 1 to 64 bytes"));
        }
        let id = format!("acct_{}", hex::encode(rand::random::<[u8; 8]>()));
        let now = crate::util::now_ms();
        sqlx::query(
            "INSERT INTO accounts (id, name, kind, no_overdraft, created_at_ms) VALUES (?, ?, ?, 1, ?)",
        )
        .bind(&id)
        .bind(name)
        .bind(kind.as_str())
        .bind(now)
        .execute(&self.pool)
        .await?;
        Ok(Account {
            id,
            name: name.to_owned(),
            kind,
            no_overdraft: true,
            debits_pending: 0,
            debits_posted: 0,
            credits_pending: 0,
            credits_posted: 0,
            created_at_ms: now,
        })
    }

    pub async fn account(&self, id: &str) -> Result<Option<Account>, LedgerError> {
        let mut conn = self.pool.acquire().await?;
        transfer::account(&mut conn, id).await
    }

    /// Applies one transfer in its own transaction.
    pub async fn transfer(&self, t: &NewTransfer, now_ms: i64) -> Result<Applied, LedgerError> {
        let mut tx = self.write_tx().await?;
        let applied = transfer::apply(&mut tx, t, now_ms).await?;
        tx.commit().await?;
        Ok(applied)
    }

    /// Issues `amount` from the treasury to `account` (admin only at the API).
    /// `id` is the idempotency key.
    pub async fn grant(
        &self,
        id: &str,
        account: &str,
        amount: i64,
        memo: &str,
    ) -> Result<Applied, LedgerError> {
        // Escrow and the fee account move only through settlement.
        match self.account(account).await? {
            Some(a)
                if matches!(
                    a.kind,
                    AccountKind::Client | AccountKind::Operator | AccountKind::RewardPool
                ) => {}
            _ => return Err(LedgerError::NoSuchAccount(account.to_owned())),
        }
        self.transfer(
            &NewTransfer {
                id: format!("grant:{id}"),
                kind: Some(TransferKind::Posted),
                debit: TREASURY.into(),
                credit: account.into(),
                amount,
                memo: memo.into(),
                ..Default::default()
            },
            crate::util::now_ms(),
        )
        .await
    }

    /// One transfer by id.
    pub async fn get_transfer(&self, id: &str) -> Result<Option<Transfer>, LedgerError> {
        let mut conn = self.pool.acquire().await?;
        transfer::get(&mut conn, id).await
    }

    /// Jobs submitted by `account`, newest first.
    pub async fn jobs_of(&self, account: &str, limit: u32) -> Result<Vec<String>, LedgerError> {
        Ok(sqlx::query_scalar(
            "SELECT job_id FROM job_holds WHERE account_id = ? ORDER BY rowid DESC LIMIT ?",
        )
        .bind(account)
        .bind(i64::from(limit))
        .fetch_all(&self.pool)
        .await?)
    }

    /// The account's transfers, newest first.
    pub async fn history(&self, account: &str, limit: u32) -> Result<Vec<Transfer>, LedgerError> {
        let rows = sqlx::query(
            "SELECT id, kind, debit_account, credit_account, amount, pending_id, deadline_ms, job_id, \
             node_id, tokens, memo, created_at_ms FROM transfers \
             WHERE debit_account = ?1 OR credit_account = ?1 \
             ORDER BY created_at_ms DESC, rowid DESC LIMIT ?2",
        )
        .bind(account)
        .bind(i64::from(limit))
        .fetch_all(&self.pool)
        .await?;
        rows.iter().map(transfer::transfer_from_row).collect()
    }

    /// Payouts to `account` since `since_ms`, per node.
    pub async fn earnings(
        &self,
        account: &str,
        since_ms: i64,
    ) -> Result<Vec<NodeEarnings>, LedgerError> {
        let rows = sqlx::query(
            "SELECT COALESCE(node_id, '') AS node_id, SUM(amount) AS micro_mlx, \
             COUNT(DISTINCT job_id) AS jobs, SUM(tokens) AS tokens FROM transfers \
             WHERE credit_account = ? AND memo IN ('payout', 'reward') AND created_at_ms >= ? \
             GROUP BY node_id ORDER BY node_id",
        )
        .bind(account)
        .bind(since_ms)
        .fetch_all(&self.pool)
        .await?;
        rows.iter()
            .map(|r| {
                Ok(NodeEarnings {
                    node_id: r.try_get("node_id")?,
                    micro_mlx: r.try_get("micro_mlx")?,
                    jobs: r.try_get("jobs")?,
                    tokens: r.try_get("tokens")?,
                })
            })
            .collect()
    }

    /// Nodes linked to `account`.
    pub async fn nodes_of(&self, account: &str) -> Result<Vec<String>, LedgerError> {
        Ok(sqlx::query_scalar(
            "SELECT node_id FROM node_operators WHERE account_id = ? ORDER BY node_id",
        )
        .bind(account)
        .fetch_all(&self.pool)
        .await?)
    }

    /// Links `node_id` to the operator account it earns for. An empty
    /// `account` keeps the node's current link, or gives a new node an
    /// account of its own (`node <id prefix>`), so no payout is ever lost.
    pub async fn link_node(&self, node_id: &str, account: &str) -> Result<String, LedgerError> {
        let mut tx = self.write_tx().await?;
        let linked = if account.is_empty() {
            settle::operator_of(&mut tx, node_id).await?
        } else {
            let Some(a) = transfer::account(&mut tx, account).await? else {
                return Err(LedgerError::NoSuchAccount(account.to_owned()));
            };
            if !matches!(a.kind, AccountKind::Client | AccountKind::Operator) {
                return Err(LedgerError::NoSuchAccount(account.to_owned()));
            }
            sqlx::query(
                "INSERT INTO node_operators (node_id, account_id, linked_at_ms) VALUES (?1, ?2, ?3) \
                 ON CONFLICT (node_id) DO UPDATE SET account_id = ?2, linked_at_ms = ?3",
            )
            .bind(node_id)
            .bind(account)
            .bind(crate::util::now_ms())
            .execute(&mut *tx)
            .await?;
            account.to_owned()
        };
        tx.commit().await?;
        Ok(linked)
    }

    /// Sums over all accounts, and the open holds.
    pub async fn totals(&self) -> Result<Totals, LedgerError> {
        let row = sqlx::query(
            "SELECT COALESCE(SUM(credits_posted - debits_posted), 0) AS posted, \
             COALESCE(SUM(credits_pending - debits_pending), 0) AS pending, \
             (SELECT COUNT(*) FROM open_holds) AS open_holds FROM accounts",
        )
        .fetch_one(&self.pool)
        .await?;
        Ok(Totals {
            posted: row.try_get("posted")?,
            pending: row.try_get("pending")?,
            open_holds: row.try_get("open_holds")?,
        })
    }

    /// Every broken ledger invariant, described (empty when the books are
    /// sound): stored balances that differ from the transfer rows; sums over
    /// accounts that are not zero; a hold resolved twice; an open hold past
    /// its deadline (at `now_ms`); an ended job whose hold is still open; a
    /// paid job whose payouts and fee do not add up to what was posted; a
    /// failed or cancelled job that paid anyone.
    pub async fn violations(&self, now_ms: i64) -> Result<Vec<String>, LedgerError> {
        let mut out: Vec<String> = self
            .audit()
            .await?
            .into_iter()
            .map(|a| format!("account {a}: stored balances differ from its transfers"))
            .collect();
        let t = self.totals().await?;
        if t.posted != 0 || t.pending != 0 {
            out.push(format!("sums over accounts are {t:?}, not zero"));
        }
        let checks: [(&str, &str); 6] = [
            (
                "resolved more than once",
                "SELECT pending_id FROM transfers WHERE pending_id IS NOT NULL \
                 GROUP BY pending_id HAVING COUNT(*) > 1",
            ),
            (
                "open past its deadline",
                "SELECT transfer_id FROM open_holds WHERE deadline_ms < ?1",
            ),
            (
                "ended with its hold still open",
                "SELECT h.job_id FROM open_holds h JOIN jobs j ON j.id = h.job_id \
                 WHERE j.state IN ('failed', 'cancelled') OR (j.state = 'completed' \
                 AND (?2 = 0 OR j.updated_at_ms + ?2 < ?1))",
            ),
            (
                "paid, but payouts and fee differ from the post",
                "SELECT p.job_id FROM transfers p WHERE p.kind = 'post_pending' AND p.amount <> \
                 (SELECT COALESCE(SUM(x.amount), 0) FROM transfers x \
                  WHERE x.job_id = p.job_id AND x.memo IN ('payout', 'fee')) AND ?1 = ?1",
            ),
            (
                "failed its audit, yet paid someone",
                "SELECT DISTINCT x.job_id FROM transfers x JOIN audits a ON a.job_id = x.job_id \
                 WHERE x.memo = 'payout' AND a.state = 'failed' AND x.created_at_ms >= a.ended_at_ms \
                 AND ?1 = ?1 AND ?2 = ?2",
            ),
            (
                "failed or cancelled, yet paid someone",
                "SELECT DISTINCT x.job_id FROM transfers x JOIN jobs j ON j.id = x.job_id \
                 WHERE x.memo = 'payout' AND j.state IN ('failed', 'cancelled') AND ?1 = ?1",
            ),
        ];
        for (what, sql) in checks {
            let ids: Vec<String> = sqlx::query_scalar(sql)
                .bind(now_ms)
                .bind(self.config.audit_window_ms)
                .fetch_all(&self.pool)
                .await?;
            out.extend(ids.into_iter().map(|id| format!("{id}: {what}")));
        }
        Ok(out)
    }

    /// Recomputes every account's balances from the transfer rows and
    /// returns the accounts whose stored balances differ (empty when sound).
    pub async fn audit(&self) -> Result<Vec<String>, LedgerError> {
        // Pending: holds still open. Posted: posted transfers and posts.
        Ok(sqlx::query_scalar(
            "WITH moves AS ( \
               SELECT debit_account AS a, amount AS dpo, 0 AS cpo, 0 AS dpe, 0 AS cpe FROM transfers WHERE kind IN ('posted', 'post_pending') \
               UNION ALL SELECT credit_account, 0, amount, 0, 0 FROM transfers WHERE kind IN ('posted', 'post_pending') \
               UNION ALL SELECT t.debit_account, 0, 0, t.amount, 0 FROM transfers t JOIN open_holds h ON h.transfer_id = t.id \
               UNION ALL SELECT t.credit_account, 0, 0, 0, t.amount FROM transfers t JOIN open_holds h ON h.transfer_id = t.id \
             ), sums AS (SELECT a, SUM(dpo) dpo, SUM(cpo) cpo, SUM(dpe) dpe, SUM(cpe) cpe FROM moves GROUP BY a) \
             SELECT acc.id FROM accounts acc LEFT JOIN sums s ON s.a = acc.id \
             WHERE acc.debits_posted <> COALESCE(s.dpo, 0) OR acc.credits_posted <> COALESCE(s.cpo, 0) \
                OR acc.debits_pending <> COALESCE(s.dpe, 0) OR acc.credits_pending <> COALESCE(s.cpe, 0) \
             ORDER BY acc.id",
        )
        .fetch_all(&self.pool)
        .await?)
    }
}

/// Settles `job` now, logging (not returning) a failure: the sweep and the
/// next start-up settle whatever is left open.
pub async fn settle_logged(ledger: &Ledger, job: mlxnet_proto::ids::JobId) {
    match ledger.settle_job(job, crate::util::now_ms()).await {
        Ok(outcome) => tracing::debug!(job_id = %job, ?outcome, "settled"),
        Err(e) => tracing::warn!(
            job_id = %job,
            error = %crate::util::error_chain(&e),
            "settlement failed; the sweep retries it"
        ),
    }
}

/// Holds handled per sweep pass.
const SWEEP_BATCH: u32 = 512;

/// What one sweep pass did.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Swept {
    /// Ended jobs whose settlement had not happened (a crash, an error).
    pub settled: usize,
    /// Unfinished jobs cancelled because their hold's deadline passed.
    pub cancelled: usize,
}

/// Settles every ended job with an open hold, and cancels then settles every
/// job whose hold is past its deadline. `cancel` cancels one job (the store's
/// guarded transition, plus whatever the caller must tell watchers and
/// nodes). Run at start-up (before anything is served) and periodically.
pub async fn sweep<F, Fut>(ledger: &Ledger, now_ms: i64, cancel: F) -> Result<Swept, LedgerError>
where
    F: Fn(mlxnet_proto::ids::JobId) -> Fut,
    Fut: std::future::Future<Output = Result<(), StoreError>>,
{
    let mut out = Swept::default();
    for id in ledger.unsettled_jobs(now_ms, SWEEP_BATCH).await? {
        let Ok(job) = id.parse() else {
            return Err(LedgerError::Corrupt(format!("hold of job {id:?}")));
        };
        ledger.settle_job(job, now_ms).await?;
        out.settled += 1;
    }
    for id in ledger.due_holds(now_ms, SWEEP_BATCH).await? {
        let Ok(job) = id.parse() else {
            return Err(LedgerError::Corrupt(format!("hold of job {id:?}")));
        };
        if ledger.settle_job(job, now_ms).await? == settle::Settlement::Overdue {
            cancel(job).await?;
            out.cancelled += 1;
            ledger.settle_job(job, now_ms).await?;
        }
    }
    Ok(out)
}

/// Runs [`sweep`] every `sweep_interval_ms` until shutdown.
pub async fn sweep_loop(d: std::sync::Arc<crate::dispatch::Dispatcher>) {
    let every = std::time::Duration::from_millis(d.ledger.config().sweep_interval_ms);
    loop {
        tokio::select! {
            _ = d.shutdown_token().cancelled() => return,
            _ = tokio::time::sleep(every) => {}
        }
        let result = sweep(&d.ledger, crate::util::now_ms(), |job| {
            let d = std::sync::Arc::clone(&d);
            async move { d.cancel(job).await.map(|_| ()) }
        })
        .await;
        if let Err(e) = d.ledger.pay_rewards(crate::util::now_ms()).await {
            tracing::warn!(error = %crate::util::error_chain(&e), "paying availability rewards failed");
        }
        match result {
            Ok(s) if s != Swept::default() => tracing::info!(?s, "ledger sweep"),
            Ok(_) => {}
            Err(e) => tracing::warn!(error = %crate::util::error_chain(&e), "ledger sweep failed"),
        }
    }
}
