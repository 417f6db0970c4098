//! Persistence behind one seam: [`Store`] (reads and the job/node
//! transitions, each its own transaction) and [`StoreTx`] (a write
//! transaction with the primitives the ledger's and the audits' rules
//! compose). Each backend owns only its SQL; the rules live above it
//! (`ledger`, `audit`), written once.
//!
//! Backends: [`sqlite::SqliteStore`] (the default, a file in the data
//! directory) and [`postgres::PgStore`] (one database several replicas
//! share), the variants of [`AnyStore`], the closed set the application
//! picks from by the database URL's scheme (so no generic parameter reaches
//! the dispatcher or the API). [`rows`] decodes rows for both; [`tests`] is
//! the conformance suite every backend passes.
//!
//! # Invariants (every backend)
//! - Every job transition is guarded by the expected current state,
//!   attempt and node in the statement that writes it, so a duplicate, late
//!   or foreign result changes nothing and reports `false` / `None`.
//! - A completed job always has its claim and signature stored with it.
//! - Attempts are bounded: a failed attempt requeues with `attempt + 1`
//!   only while `attempt < max_attempts`, else the job fails for good.
//! - A segment is written in the same transaction as its attempt's end, and
//!   only when that end was accepted; a job's segments are contiguous.
//! - One [`StoreTx`] is open at a time per database (SQLite: an in-process
//!   writer lock, then `BEGIN IMMEDIATE`; PostgreSQL: an in-process lock,
//!   then an advisory lock every replica takes); its reads and writes see
//!   one state; dropping it without [`StoreTx::commit`] changes nothing.
//! - Transfer rows are never updated or deleted; a pending transfer's
//!   `open_holds` row exists until it is resolved, at most once.
//! - A lease has at most one live holder; its epoch grows whenever the
//!   holder changes, and [`StoreTx::fence`] refuses a transaction under an
//!   older epoch or an expired lease ([`StoreError::Fenced`]).
//!
//! # Failure
//! [`StoreError`]: database errors (kept as the source, never shown to
//! clients), rows that do not decode (a corrupt or foreign database), a
//! database URL no compiled-in backend serves, and a fenced write under a
//! lost lease.

mod backend;
pub mod postgres;
mod rows;
pub mod sqlite;
#[cfg(test)]
pub(crate) mod test_locks;
#[cfg(test)]
pub(crate) mod tests;

use std::collections::{HashMap, HashSet};

use mlxnet_proto::ids::JobId;

use crate::domain::{
    Account, AttemptEnd, AuditRecord, Availability, CancelOutcome, Completion, JobRecord, JobStats,
    JobTerms, KeyInfo, KeyLimits, Lease, NewJob, NodeEarnings, NodeRecord, RecordDelta, RelayChunk,
    Segment, StoredKey, StreamedEnd, Totals, Transfer,
};

pub use postgres::PgStore;
pub use sqlite::SqliteStore;

/// The `[store]` section: which database, and how the pool reaches it.
#[derive(Clone, Debug, PartialEq, Eq, serde::Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct StoreConfig {
    /// `sqlite://PATH` or `postgres://USER:PASSWORD@HOST:PORT/DB`. Unset:
    /// the SQLite file in the data directory. May hold a password: never
    /// printed.
    pub url: Option<String>,
    /// Most connections this replica opens (PostgreSQL; SQLite keeps 4).
    pub max_connections: u32,
    /// Longest a statement may run before the server cancels it
    /// (PostgreSQL's `statement_timeout`).
    pub statement_timeout_ms: u64,
    /// Longest a caller waits for a free connection before its operation
    /// fails.
    pub acquire_timeout_ms: u64,
}

impl Default for StoreConfig {
    fn default() -> Self {
        Self {
            url: None,
            max_connections: 16,
            statement_timeout_ms: 5_000,
            acquire_timeout_ms: 5_000,
        }
    }
}

/// Why a store operation failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum StoreError {
    #[error("database error")]
    Database(#[from] sqlx::Error),
    #[error("database migration failed")]
    Migrate(#[from] sqlx::migrate::MigrateError),
    #[error("stored row of {id} does not decode: {what}")]
    Corrupt { id: String, what: String },
    #[error(
        "no store backend serves database URL scheme {scheme:?} (compiled in: sqlite, postgres)"
    )]
    UnsupportedUrl { scheme: String },
    /// A duty's write under a lease this replica no longer holds (taken
    /// over, released or expired): refused, nothing written.
    #[error("lease {name} is no longer held under epoch {epoch}")]
    Fenced { name: String, epoch: i64 },
}

/// What a store call returns.
pub type Result<T, E = StoreError> = std::result::Result<T, E>;

/// A pending transfer's entry among the open holds.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct OpenHold {
    pub transfer_id: String,
    pub job_id: Option<String>,
    pub deadline_ms: i64,
}

/// Which side of its pending transfer an account was on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Side {
    Debit,
    Credit,
}

/// An account as a batch of holds sees it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PayerBalance {
    pub no_overdraft: bool,
    /// Posted credits less posted and pending debits.
    pub available: i64,
}

/// A key to store: its public id and the SHA-256 of its secret.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NewKey {
    pub id: String,
    pub account_id: String,
    pub hash: [u8; 32],
    pub scopes: crate::domain::Scopes,
    pub label: String,
    pub created_at_ms: i64,
    pub expires_at_ms: Option<i64>,
    /// The key it was made with (`None`: a root key). The insert happens
    /// only while that key is unrevoked and unexpired at `created_at_ms`.
    pub parent_key_id: Option<String>,
}

/// A broken ledger invariant the store's rows show (see
/// [`Store::ledger_anomalies`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Anomaly {
    /// A pending transfer resolved more than once.
    ResolvedTwice,
    /// An open hold past its deadline.
    OpenPastDeadline,
    /// A failed, cancelled, or completed job past its audit window whose
    /// hold is still open.
    EndedWithHoldOpen,
    /// A posted job whose payouts and fee differ from the post.
    PaidMismatch,
    /// A job that failed its audit, yet paid a node after that.
    FailedAuditPaid,
    /// A failed or cancelled job that paid a node.
    EndedPaid,
}

/// Reads, and the job and node transitions (each its own transaction).
///
/// Callers use it through [`AnyStore`], a concrete type, so the futures'
/// `Send` is known there; generic code over `Store` (the conformance
/// suite) must not need it.
#[allow(async_fn_in_trait)]
pub trait Store: Clone + Send + Sync + 'static {
    /// A write transaction (see [`StoreTx`]).
    type Tx: StoreTx;

    /// Closes every connection; the database can be opened again afterwards.
    async fn close(&self);
    /// Checks the database answers.
    async fn ping(&self) -> Result<()>;
    /// The durability settings writes run under, in words (printed next to
    /// benchmark figures).
    async fn durability(&self) -> Result<String>;
    /// Opens a write transaction: one at a time per store; its reads and
    /// writes see one state.
    async fn write(&self) -> Result<Self::Tx>;

    // ---- jobs and attempts ----

    /// Inserts a queued job (attempt 1).
    async fn insert_job(&self, job: &NewJob) -> Result<JobRecord>;
    async fn get_job(&self, id: JobId) -> Result<Option<JobRecord>>;
    /// Newest first.
    async fn list_jobs(&self, limit: u32) -> Result<Vec<JobRecord>>;
    /// Queued jobs, oldest first.
    async fn queued_jobs(&self, limit: u32) -> Result<Vec<JobRecord>>;
    /// The paying account of each of `jobs` that has terms (jobs from before
    /// the ledger have none).
    async fn job_accounts(&self, jobs: &[JobId]) -> Result<HashMap<JobId, String>>;
    async fn count_queued(&self) -> Result<u64>;
    async fn job_stats(&self) -> Result<JobStats>;
    /// `queued -> assigned` to `node_id` for `attempt`, booking one of the
    /// node's slots (`NodeRecord::slots`, from its registration). False if
    /// the job is not queued at that attempt any more, or the node's
    /// assigned and running jobs already fill its slots (the job stays
    /// queued). Bookings of one node by several replicas are serialized
    /// (PostgreSQL: its row locked until the booking commits; SQLite: one
    /// writer), so no node is ever booked past its slots.
    async fn assign(&self, id: JobId, attempt: u32, node_id: &str) -> Result<bool>;
    /// [`Store::assign`] for a batch (job, attempt, node) in one
    /// transaction; one flag per entry.
    async fn assign_many(&self, batch: &[(JobId, u32, String)]) -> Result<Vec<bool>>;
    /// Claims up to `limit` queued jobs, oldest first, each with its paying
    /// account (if it has terms), for one placement pass; `place` picks
    /// `(job, attempt, node)` among them, and each pick is assigned (as
    /// [`Store::assign`]) in the claim's transaction. One flag per pick.
    ///
    /// Claims of several replicas on one database never see the same job
    /// at once (PostgreSQL: `FOR UPDATE SKIP LOCKED`; SQLite: one writer),
    /// so a pick of a claimed job is assigned unless it was not claimed or
    /// its node is full (see [`Store::assign`]: a replica's view of a node
    /// may miss another replica's bookings); jobs `place` leaves, and picks
    /// refused, are free again when the claim ends.
    async fn claim_queued<F>(&self, limit: u32, place: F) -> Result<Vec<bool>>
    where
        F: FnOnce(Vec<(JobRecord, Option<String>)>) -> Vec<(JobId, u32, String)> + Send;
    /// `assigned -> running` when the node says it started.
    async fn mark_running(&self, id: JobId, attempt: u32, node_id: &str) -> Result<bool>;
    /// `assigned | running -> completed` with the verified claim, only from
    /// the node holding this attempt, once. A resumed job's output is what
    /// its earlier attempts streamed followed by the claim's.
    async fn complete(&self, c: &Completion) -> Result<bool>;
    /// Ends `end.attempt` (held by `end.node_id`) as failed: requeued as the
    /// next attempt when retryable and attempts remain, else failed for
    /// good; `None` if the job is not at that attempt on that node any more.
    /// In the same transaction it records `segment` (when it holds tokens)
    /// for the next attempt to resume after; a segment that does not start
    /// where the job's stream ends is refused as `Corrupt` and nothing
    /// changes.
    async fn end_attempt_streamed(
        &self,
        end: &StreamedEnd<'_>,
        segment: &Segment,
    ) -> Result<Option<AttemptEnd>>;
    /// [`Store::end_attempt_streamed`] of an attempt that streamed nothing.
    async fn fail_attempt(
        &self,
        id: JobId,
        attempt: u32,
        node_id: &str,
        reason: &str,
        retryable: bool,
        max_attempts: u32,
    ) -> Result<Option<AttemptEnd>> {
        let end = StreamedEnd {
            job: id,
            attempt,
            node_id,
            reason,
            retryable,
            max_attempts,
        };
        self.end_attempt_streamed(&end, &Segment::default()).await
    }
    /// A job's segments in stream order.
    async fn segments(&self, job: JobId) -> Result<Vec<Segment>>;
    /// Cancels a job that has not finished.
    async fn cancel(&self, id: JobId) -> Result<CancelOutcome>;
    /// The orphan sweep: every assigned or running job whose attempt is
    /// owned by a dead replica is requeued (bounded by `max_attempts`), and
    /// every node online on a dead replica goes offline, in one
    /// transaction. A replica is dead when it is `me` (this replica's
    /// earlier incarnation, at start-up), when its liveness lease
    /// (`replica/<id>`) is not held by it until after `now_ms` (expired,
    /// released, never taken), or when the row names none. A job requeued
    /// is no longer assigned, so a second sweep requeues it no more. How
    /// many jobs.
    async fn requeue_orphans(
        &self,
        max_attempts: u32,
        me: Option<&str>,
        now_ms: i64,
    ) -> Result<u64>;

    // ---- nodes ----

    /// Records a node that completed the handshake, online on `replica`
    /// (the owner its attempts are recorded with when assigned).
    async fn upsert_node(&self, node: &NodeRecord, replica: &str) -> Result<()>;
    async fn touch_node(&self, id: &str) -> Result<()>;
    async fn set_node_offline(&self, id: &str) -> Result<()>;
    /// At start-up no session exists yet.
    async fn mark_all_nodes_offline(&self) -> Result<()>;
    /// A node and its status (`online` / `offline`).
    async fn get_node(&self, id: &str) -> Result<Option<(NodeRecord, String)>>;
    async fn count_nodes(&self) -> Result<u64>;

    // ---- ledger ----

    /// Inserts a new account (its id unused).
    async fn insert_account(&self, account: &Account) -> Result<()>;
    async fn account(&self, id: &str) -> Result<Option<Account>>;
    async fn transfer(&self, id: &str) -> Result<Option<Transfer>>;
    /// Who pays for `job` and at what price, if it was submitted with terms.
    async fn job_terms(&self, job: &str) -> Result<Option<JobTerms>>;
    /// Jobs `account` submitted, newest first.
    async fn jobs_of(&self, account: &str, limit: u32) -> Result<Vec<String>>;
    /// The account's transfers (either side), newest first.
    async fn history(&self, account: &str, limit: u32) -> Result<Vec<Transfer>>;
    /// Every transfer about `job`, oldest first.
    async fn job_transfers(&self, job: &str) -> Result<Vec<Transfer>>;
    /// Payouts and rewards to `account` since `since_ms`, per node.
    async fn earnings(&self, account: &str, since_ms: i64) -> Result<Vec<NodeEarnings>>;
    /// Nodes linked to `account`.
    async fn nodes_of(&self, account: &str) -> Result<Vec<String>>;
    /// Sums over all accounts, and the open holds.
    async fn totals(&self) -> Result<Totals>;
    /// Accounts whose stored balances differ from their transfer rows.
    async fn balance_mismatches(&self) -> Result<Vec<String>>;
    /// Rows that break a ledger invariant at `now_ms` (completed jobs hold
    /// pay for `audit_window_ms`): each with the id it is about.
    async fn ledger_anomalies(
        &self,
        now_ms: i64,
        audit_window_ms: i64,
    ) -> Result<Vec<(Anomaly, String)>>;
    /// Jobs whose hold is open and past its deadline at `now_ms`, oldest
    /// deadline first.
    async fn due_holds(&self, now_ms: i64, limit: u32) -> Result<Vec<String>>;
    /// Jobs with an open hold that have ended (failed, cancelled, gone), or
    /// completed whose audit window closed at `now_ms` or whose audit failed.
    async fn unsettled_jobs(
        &self,
        now_ms: i64,
        audit_window_ms: i64,
        limit: u32,
    ) -> Result<Vec<String>>;
    /// Adds `online_ms` to `node_id`'s availability in `epoch` (memory: the
    /// most it offered).
    async fn record_online(
        &self,
        epoch: i64,
        node_id: &str,
        memory_bytes: u64,
        online_ms: u64,
    ) -> Result<()>;
    /// Epochs before `current` with availability and no payout yet, in order.
    async fn unpaid_epochs(&self, current: i64) -> Result<Vec<i64>>;

    // ---- API keys ----

    /// False (nothing inserted) when the key's parent is revoked or expired.
    async fn insert_key(&self, key: &NewKey) -> Result<bool>;
    /// The unrevoked key with this hash, unexpired at `now_ms`.
    async fn key_by_hash(&self, hash: &[u8; 32], now_ms: i64) -> Result<Option<StoredKey>>;
    /// False if there is no such key.
    async fn set_key_limits(&self, key_id: &str, limits: KeyLimits) -> Result<bool>;
    /// Revokes `key_id` (of `account`, when given) at `now_ms`. False if
    /// there is no such unrevoked key.
    async fn revoke_key(&self, key_id: &str, account: Option<&str>, now_ms: i64) -> Result<bool>;
    /// `account`'s keys, newest first.
    async fn list_keys(&self, account: &str) -> Result<Vec<KeyInfo>>;

    // ---- audits ----

    /// Nodes banned from placement.
    async fn banned_nodes(&self) -> Result<Vec<String>>;
    /// `node`'s audit record (zero for a node never audited).
    async fn audit_record(&self, node: &str) -> Result<AuditRecord>;
    /// Every node's record, in node-id order.
    async fn node_records(&self) -> Result<Vec<(String, AuditRecord)>>;
    /// Adds `delta` to `node`'s record (one write).
    async fn count_record(&self, node: &str, delta: &RecordDelta) -> Result<()>;
    /// Records that `job`, served by `node`, is audited. False if it already was.
    async fn begin_audit(&self, job: &str, node: &str, now_ms: i64) -> Result<bool>;
    /// Ends `job`'s pending audit without a verdict.
    async fn miss_audit(&self, job: &str, now_ms: i64) -> Result<()>;
    /// How `job`'s audit stands (`pending`, `passed`, `failed`, `missed`;
    /// `None`: not audited).
    async fn audit_state(&self, job: &str) -> Result<Option<String>>;

    // ---- leases of the singleton duties ----
    /// Takes lease `name` for `holder` until `now_ms + ttl_ms`, or renews
    /// it: granted when nobody holds it, when it expired by `now_ms`, or
    /// when `holder` already holds it. The epoch grows by one whenever a
    /// holder takes a lease it did not hold (first grant: 1) and stays on a
    /// renewal. `None`: another holder's lease is live. One statement, so of
    /// replicas racing for a free lease exactly one gets it.
    async fn acquire_lease(
        &self,
        name: &str,
        holder: &str,
        ttl_ms: i64,
        now_ms: i64,
    ) -> Result<Option<Lease>>;
    /// Gives `lease` up (if still held under its epoch; false otherwise), so
    /// another replica may take it at once, under a higher epoch.
    async fn release_lease(&self, lease: &Lease) -> Result<bool>;
    /// Lease `name` as stored (`None`: never granted).
    async fn lease(&self, name: &str) -> Result<Option<Lease>>;

    // ---- the token relay: running jobs' tokens, between replicas ----

    /// Writes `chunks` in one transaction (a chunk already stored, same
    /// job, attempt and first index, stays as it was) and wakes the
    /// replicas following each job of `chunks` and of `wake` (PostgreSQL: a
    /// `NOTIFY` per job, delivered at commit; SQLite: nothing, it serves one
    /// replica). A wake-up is a hint: a follower that misses one finds the
    /// chunks when it next reads ([`Store::tokens_after`]).
    async fn append_tokens(&self, chunks: &[RelayChunk], wake: &[JobId], now_ms: i64)
        -> Result<()>;
    /// `job`'s chunks after `after` (an `(attempt, first index)`; `None`:
    /// from the first), in `(attempt, first index)` order, at most `limit`.
    async fn tokens_after(
        &self,
        job: JobId,
        after: Option<(u32, u32)>,
        limit: u32,
    ) -> Result<Vec<RelayChunk>>;
    /// Deletes `job`'s chunks from token `keep` on that attempts before
    /// `attempt` wrote (their unsigned tokens, which the job does not keep).
    /// Returns how many went.
    async fn rewind_tokens(&self, job: JobId, attempt: u32, keep: u32) -> Result<u64>;
    /// Deletes every chunk of the jobs that ended (completed, failed or
    /// cancelled) before `ended_before_ms`. Returns how many went.
    async fn purge_tokens(&self, ended_before_ms: i64) -> Result<u64>;
    /// The wake-ups [`Store::append_tokens`] sends, as this replica
    /// receives them (SQLite: none ever come).
    async fn token_wakeups(&self) -> Result<TokenWakeups>;
}

/// What woke a token follower.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Wakeup {
    /// New chunks or a new state of this job.
    Job(JobId),
    /// Wake-ups may have been lost (the listening connection dropped and
    /// came back): every follower should read again.
    Lost,
}

/// A replica's stream of [`Wakeup`]s (see [`Store::token_wakeups`]).
#[derive(Debug)]
pub struct TokenWakeups(Listening);

#[derive(Debug)]
enum Listening {
    Postgres(Box<postgres::tokens::TokenListener>),
    Never,
}

impl TokenWakeups {
    /// Wake-ups that never come (a backend with one replica).
    pub fn never() -> Self {
        Self(Listening::Never)
    }

    fn listening(listener: postgres::tokens::TokenListener) -> Self {
        Self(Listening::Postgres(Box::new(listener)))
    }

    /// The next wake-up; pending forever when none can come.
    pub async fn next(&mut self) -> Wakeup {
        match &mut self.0 {
            Listening::Postgres(l) => l.next().await,
            Listening::Never => std::future::pending().await,
        }
    }
}

/// A write transaction: the primitives the ledger's and the audits' rules
/// compose. Dropped without [`StoreTx::commit`], it changes nothing.
#[allow(async_fn_in_trait)]
pub trait StoreTx: Send {
    async fn commit(self) -> Result<()>;

    // ---- reads, inside the transaction ----

    async fn account(&mut self, id: &str) -> Result<Option<Account>>;
    async fn transfer(&mut self, id: &str) -> Result<Option<Transfer>>;
    /// The deadline of pending transfer `transfer_id` while it is open.
    async fn hold_deadline(&mut self, transfer_id: &str) -> Result<Option<i64>>;
    async fn job_terms(&mut self, job: &str) -> Result<Option<JobTerms>>;
    async fn get_job(&mut self, id: JobId) -> Result<Option<JobRecord>>;
    async fn segments(&mut self, job: JobId) -> Result<Vec<Segment>>;
    async fn audit_state(&mut self, job: &str) -> Result<Option<String>>;
    /// The operator account `node_id` earns for, if linked.
    async fn operator_of(&mut self, node_id: &str) -> Result<Option<String>>;

    // ---- balances and transfers ----

    /// Adds `amount` to the posted or pending debits of `account`, unless
    /// it forbids overdraft and has less than that available. False if it
    /// does not exist or cannot pay.
    async fn add_debit(&mut self, account: &str, amount: i64, pending: bool) -> Result<bool>;
    /// Adds `amount` to the posted or pending credits of `account`. False
    /// if it does not exist.
    async fn add_credit(&mut self, account: &str, amount: i64, pending: bool) -> Result<bool>;
    /// Resolves `pending` of `account`'s pending debits (or credits) and
    /// posts `posted` of it. False if the account does not hold that much
    /// pending.
    async fn resolve_pending(
        &mut self,
        account: &str,
        side: Side,
        pending: i64,
        posted: i64,
    ) -> Result<bool>;
    /// Records transfers (ids unused).
    async fn insert_transfers(&mut self, transfers: &[Transfer]) -> Result<()>;
    /// Opens pending transfers' holds.
    async fn open_holds(&mut self, holds: &[OpenHold]) -> Result<()>;
    /// Closes pending transfer `transfer_id`'s hold.
    async fn close_hold(&mut self, transfer_id: &str) -> Result<()>;

    // ---- submits ----

    /// The ids among `ids` already used by a job, its terms or its hold.
    async fn used_job_ids(&mut self, ids: &[String]) -> Result<HashSet<String>>;
    /// The balances of `accounts` that exist.
    async fn payers(&mut self, accounts: &[&str]) -> Result<HashMap<String, PayerBalance>>;
    /// Records jobs' payment terms.
    async fn insert_terms(&mut self, terms: &[(&str, &JobTerms)]) -> Result<()>;
    /// Inserts queued jobs (attempt 1), each created at its own time.
    async fn insert_jobs(&mut self, jobs: &[(&NewJob, i64)]) -> Result<()>;

    // ---- accounts and operators ----

    /// Inserts `account` unless its id exists.
    async fn insert_account_if_absent(&mut self, account: &Account) -> Result<()>;
    /// Links `node_id` to `account` (replacing an earlier link).
    async fn link_operator(&mut self, node_id: &str, account: &str, now_ms: i64) -> Result<()>;

    // ---- rewards ----

    async fn epoch_paid(&mut self, epoch: i64) -> Result<bool>;
    /// The availability recorded in `epoch`, by node id.
    async fn availability(&mut self, epoch: i64) -> Result<Vec<Availability>>;
    async fn mark_epoch_paid(&mut self, epoch: i64, paid_ms: i64, total: i64) -> Result<()>;

    // ---- audits ----

    /// Ends `job`'s pending audit with a verdict by `auditor`; the audited
    /// node, or `None` if the audit had already ended.
    async fn end_audit(
        &mut self,
        job: &str,
        passed: bool,
        auditor: &str,
        verdict: &[u8],
        now_ms: i64,
    ) -> Result<Option<String>>;
    /// Adds `delta` to `node`'s record (audits counted, wrong verdicts).
    async fn count_record(&mut self, node: &str, delta: &RecordDelta) -> Result<()>;
    async fn audit_record(&mut self, node: &str) -> Result<AuditRecord>;
    /// Bans `node` from placement at `now_ms` (once).
    async fn ban_node(&mut self, node: &str, now_ms: i64) -> Result<()>;
    /// Fails with [`StoreError::Fenced`] unless `lease` is still held, under
    /// its epoch, and unexpired at `now_ms`. The check stands until this
    /// transaction ends (no takeover commits in between), so a duty that
    /// fences its transaction writes under its lease or not at all.
    async fn fence(&mut self, lease: &Lease, now_ms: i64) -> Result<()>;
}

/// The backends compiled in: what the application holds. A new backend is
/// a variant here, an arm in [`AnyStore::connect`], and one line in
/// [`on_backend`]'s match.
#[derive(Clone, Debug)]
#[non_exhaustive]
pub enum AnyStore {
    Sqlite(SqliteStore),
    Postgres(PgStore),
}

/// A write transaction of an [`AnyStore`].
#[derive(Debug)]
#[non_exhaustive]
pub enum AnyTx {
    Sqlite(sqlite::SqliteTx),
    Postgres(postgres::PgTx),
}

/// Runs `$body` with `$s` bound to the backend inside `$any` (an
/// [`AnyStore`] or an [`AnyTx`]).
macro_rules! on_backend {
    ($any:expr, $s:ident => $body:expr) => {
        match $any {
            Self::Sqlite($s) => $body,
            Self::Postgres($s) => $body,
        }
    };
}

impl AnyStore {
    /// Opens (creating and migrating if needed) the database at `url`, with
    /// the backend its scheme names (`sqlite:`, `postgres:`), and the
    /// default pool settings.
    pub async fn connect(url: &str) -> Result<Self> {
        Self::connect_with(url, &StoreConfig::default()).await
    }

    /// [`AnyStore::connect`] with `config`'s pool size and timeouts (its
    /// `url` is not read: `url` is).
    pub async fn connect_with(url: &str, config: &StoreConfig) -> Result<Self> {
        let scheme = url.split(':').next().unwrap_or_default();
        match scheme {
            "sqlite" => Ok(Self::Sqlite(SqliteStore::connect(url).await?)),
            "postgres" | "postgresql" => Ok(Self::Postgres(PgStore::connect(url, config).await?)),
            other => Err(StoreError::UnsupportedUrl {
                scheme: other.to_owned(),
            }),
        }
    }
}

impl Store for AnyStore {
    type Tx = AnyTx;

    async fn close(&self) {
        on_backend!(self, s => s.close().await)
    }

    async fn ping(&self) -> Result<()> {
        on_backend!(self, s => s.ping().await)
    }

    async fn durability(&self) -> Result<String> {
        on_backend!(self, s => s.durability().await)
    }

    async fn write(&self) -> Result<Self::Tx> {
        match self {
            Self::Sqlite(s) => Ok(AnyTx::Sqlite(s.write().await?)),
            Self::Postgres(s) => Ok(AnyTx::Postgres(s.write().await?)),
        }
    }

    async fn insert_job(&self, job: &NewJob) -> Result<JobRecord> {
        on_backend!(self, s => s.insert_job(job).await)
    }

    async fn get_job(&self, id: JobId) -> Result<Option<JobRecord>> {
        on_backend!(self, s => s.get_job(id).await)
    }

    async fn list_jobs(&self, limit: u32) -> Result<Vec<JobRecord>> {
        on_backend!(self, s => s.list_jobs(limit).await)
    }

    async fn queued_jobs(&self, limit: u32) -> Result<Vec<JobRecord>> {
        on_backend!(self, s => s.queued_jobs(limit).await)
    }

    async fn job_accounts(&self, jobs: &[JobId]) -> Result<HashMap<JobId, String>> {
        on_backend!(self, s => s.job_accounts(jobs).await)
    }

    async fn count_queued(&self) -> Result<u64> {
        on_backend!(self, s => s.count_queued().await)
    }

    async fn job_stats(&self) -> Result<JobStats> {
        on_backend!(self, s => s.job_stats().await)
    }

    async fn assign(&self, id: JobId, attempt: u32, node_id: &str) -> Result<bool> {
        on_backend!(self, s => s.assign(id, attempt, node_id).await)
    }

    async fn assign_many(&self, batch: &[(JobId, u32, String)]) -> Result<Vec<bool>> {
        on_backend!(self, s => s.assign_many(batch).await)
    }

    async fn claim_queued<F>(&self, limit: u32, place: F) -> Result<Vec<bool>>
    where
        F: FnOnce(Vec<(JobRecord, Option<String>)>) -> Vec<(JobId, u32, String)> + Send,
    {
        on_backend!(self, s => s.claim_queued(limit, place).await)
    }

    async fn mark_running(&self, id: JobId, attempt: u32, node_id: &str) -> Result<bool> {
        on_backend!(self, s => s.mark_running(id, attempt, node_id).await)
    }

    async fn complete(&self, c: &Completion) -> Result<bool> {
        on_backend!(self, s => s.complete(c).await)
    }

    async fn end_attempt_streamed(
        &self,
        end: &StreamedEnd<'_>,
        segment: &Segment,
    ) -> Result<Option<AttemptEnd>> {
        on_backend!(self, s => s.end_attempt_streamed(end, segment).await)
    }

    async fn segments(&self, job: JobId) -> Result<Vec<Segment>> {
        on_backend!(self, s => s.segments(job).await)
    }

    async fn cancel(&self, id: JobId) -> Result<CancelOutcome> {
        on_backend!(self, s => s.cancel(id).await)
    }

    async fn requeue_orphans(
        &self,
        max_attempts: u32,
        me: Option<&str>,
        now_ms: i64,
    ) -> Result<u64> {
        on_backend!(self, s => s.requeue_orphans(max_attempts, me, now_ms).await)
    }

    async fn upsert_node(&self, node: &NodeRecord, replica: &str) -> Result<()> {
        on_backend!(self, s => s.upsert_node(node, replica).await)
    }

    async fn touch_node(&self, id: &str) -> Result<()> {
        on_backend!(self, s => s.touch_node(id).await)
    }

    async fn set_node_offline(&self, id: &str) -> Result<()> {
        on_backend!(self, s => s.set_node_offline(id).await)
    }

    async fn mark_all_nodes_offline(&self) -> Result<()> {
        on_backend!(self, s => s.mark_all_nodes_offline().await)
    }

    async fn get_node(&self, id: &str) -> Result<Option<(NodeRecord, String)>> {
        on_backend!(self, s => s.get_node(id).await)
    }

    async fn count_nodes(&self) -> Result<u64> {
        on_backend!(self, s => s.count_nodes().await)
    }

    async fn insert_account(&self, account: &Account) -> Result<()> {
        on_backend!(self, s => s.insert_account(account).await)
    }

    async fn account(&self, id: &str) -> Result<Option<Account>> {
        on_backend!(self, s => s.account(id).await)
    }

    async fn transfer(&self, id: &str) -> Result<Option<Transfer>> {
        on_backend!(self, s => s.transfer(id).await)
    }

    async fn job_terms(&self, job: &str) -> Result<Option<JobTerms>> {
        on_backend!(self, s => s.job_terms(job).await)
    }

    async fn jobs_of(&self, account: &str, limit: u32) -> Result<Vec<String>> {
        on_backend!(self, s => s.jobs_of(account, limit).await)
    }

    async fn history(&self, account: &str, limit: u32) -> Result<Vec<Transfer>> {
        on_backend!(self, s => s.history(account, limit).await)
    }

    async fn job_transfers(&self, job: &str) -> Result<Vec<Transfer>> {
        on_backend!(self, s => s.job_transfers(job).await)
    }

    async fn earnings(&self, account: &str, since_ms: i64) -> Result<Vec<NodeEarnings>> {
        on_backend!(self, s => s.earnings(account, since_ms).await)
    }

    async fn nodes_of(&self, account: &str) -> Result<Vec<String>> {
        on_backend!(self, s => s.nodes_of(account).await)
    }

    async fn totals(&self) -> Result<Totals> {
        on_backend!(self, s => s.totals().await)
    }

    async fn balance_mismatches(&self) -> Result<Vec<String>> {
        on_backend!(self, s => s.balance_mismatches().await)
    }

    async fn ledger_anomalies(
        &self,
        now_ms: i64,
        audit_window_ms: i64,
    ) -> Result<Vec<(Anomaly, String)>> {
        on_backend!(self, s => s.ledger_anomalies(now_ms, audit_window_ms).await)
    }

    async fn due_holds(&self, now_ms: i64, limit: u32) -> Result<Vec<String>> {
        on_backend!(self, s => s.due_holds(now_ms, limit).await)
    }

    async fn unsettled_jobs(
        &self,
        now_ms: i64,
        audit_window_ms: i64,
        limit: u32,
    ) -> Result<Vec<String>> {
        on_backend!(self, s => s.unsettled_jobs(now_ms, audit_window_ms, limit).await)
    }

    async fn record_online(
        &self,
        epoch: i64,
        node_id: &str,
        memory_bytes: u64,
        online_ms: u64,
    ) -> Result<()> {
        on_backend!(self, s => s.record_online(epoch, node_id, memory_bytes, online_ms).await)
    }

    async fn unpaid_epochs(&self, current: i64) -> Result<Vec<i64>> {
        on_backend!(self, s => s.unpaid_epochs(current).await)
    }

    async fn insert_key(&self, key: &NewKey) -> Result<bool> {
        on_backend!(self, s => s.insert_key(key).await)
    }

    async fn key_by_hash(&self, hash: &[u8; 32], now_ms: i64) -> Result<Option<StoredKey>> {
        on_backend!(self, s => s.key_by_hash(hash, now_ms).await)
    }

    async fn set_key_limits(&self, key_id: &str, limits: KeyLimits) -> Result<bool> {
        on_backend!(self, s => s.set_key_limits(key_id, limits).await)
    }

    async fn revoke_key(&self, key_id: &str, account: Option<&str>, now_ms: i64) -> Result<bool> {
        on_backend!(self, s => s.revoke_key(key_id, account, now_ms).await)
    }

    async fn list_keys(&self, account: &str) -> Result<Vec<KeyInfo>> {
        on_backend!(self, s => s.list_keys(account).await)
    }

    async fn banned_nodes(&self) -> Result<Vec<String>> {
        on_backend!(self, s => s.banned_nodes().await)
    }

    async fn audit_record(&self, node: &str) -> Result<AuditRecord> {
        on_backend!(self, s => s.audit_record(node).await)
    }

    async fn node_records(&self) -> Result<Vec<(String, AuditRecord)>> {
        on_backend!(self, s => s.node_records().await)
    }

    async fn count_record(&self, node: &str, delta: &RecordDelta) -> Result<()> {
        on_backend!(self, s => s.count_record(node, delta).await)
    }

    async fn begin_audit(&self, job: &str, node: &str, now_ms: i64) -> Result<bool> {
        on_backend!(self, s => s.begin_audit(job, node, now_ms).await)
    }

    async fn miss_audit(&self, job: &str, now_ms: i64) -> Result<()> {
        on_backend!(self, s => s.miss_audit(job, now_ms).await)
    }

    async fn audit_state(&self, job: &str) -> Result<Option<String>> {
        on_backend!(self, s => s.audit_state(job).await)
    }

    async fn acquire_lease(
        &self,
        name: &str,
        holder: &str,
        ttl_ms: i64,
        now_ms: i64,
    ) -> Result<Option<Lease>> {
        on_backend!(self, s => s.acquire_lease(name, holder, ttl_ms, now_ms).await)
    }

    async fn release_lease(&self, lease: &Lease) -> Result<bool> {
        on_backend!(self, s => s.release_lease(lease).await)
    }

    async fn lease(&self, name: &str) -> Result<Option<Lease>> {
        on_backend!(self, s => s.lease(name).await)
    }

    async fn append_tokens(
        &self,
        chunks: &[RelayChunk],
        wake: &[JobId],
        now_ms: i64,
    ) -> Result<()> {
        on_backend!(self, s => s.append_tokens(chunks, wake, now_ms).await)
    }

    async fn tokens_after(
        &self,
        job: JobId,
        after: Option<(u32, u32)>,
        limit: u32,
    ) -> Result<Vec<RelayChunk>> {
        on_backend!(self, s => s.tokens_after(job, after, limit).await)
    }

    async fn rewind_tokens(&self, job: JobId, attempt: u32, keep: u32) -> Result<u64> {
        on_backend!(self, s => s.rewind_tokens(job, attempt, keep).await)
    }

    async fn purge_tokens(&self, ended_before_ms: i64) -> Result<u64> {
        on_backend!(self, s => s.purge_tokens(ended_before_ms).await)
    }

    async fn token_wakeups(&self) -> Result<TokenWakeups> {
        on_backend!(self, s => s.token_wakeups().await)
    }
}

impl StoreTx for AnyTx {
    async fn commit(self) -> Result<()> {
        on_backend!(self, s => s.commit().await)
    }

    async fn account(&mut self, id: &str) -> Result<Option<Account>> {
        on_backend!(self, s => s.account(id).await)
    }

    async fn transfer(&mut self, id: &str) -> Result<Option<Transfer>> {
        on_backend!(self, s => s.transfer(id).await)
    }

    async fn hold_deadline(&mut self, transfer_id: &str) -> Result<Option<i64>> {
        on_backend!(self, s => s.hold_deadline(transfer_id).await)
    }

    async fn job_terms(&mut self, job: &str) -> Result<Option<JobTerms>> {
        on_backend!(self, s => s.job_terms(job).await)
    }

    async fn get_job(&mut self, id: JobId) -> Result<Option<JobRecord>> {
        on_backend!(self, s => s.get_job(id).await)
    }

    async fn segments(&mut self, job: JobId) -> Result<Vec<Segment>> {
        on_backend!(self, s => s.segments(job).await)
    }

    async fn audit_state(&mut self, job: &str) -> Result<Option<String>> {
        on_backend!(self, s => s.audit_state(job).await)
    }

    async fn operator_of(&mut self, node_id: &str) -> Result<Option<String>> {
        on_backend!(self, s => s.operator_of(node_id).await)
    }

    async fn add_debit(&mut self, account: &str, amount: i64, pending: bool) -> Result<bool> {
        on_backend!(self, s => s.add_debit(account, amount, pending).await)
    }

    async fn add_credit(&mut self, account: &str, amount: i64, pending: bool) -> Result<bool> {
        on_backend!(self, s => s.add_credit(account, amount, pending).await)
    }

    async fn resolve_pending(
        &mut self,
        account: &str,
        side: Side,
        pending: i64,
        posted: i64,
    ) -> Result<bool> {
        on_backend!(self, s => s.resolve_pending(account, side, pending, posted).await)
    }

    async fn insert_transfers(&mut self, transfers: &[Transfer]) -> Result<()> {
        on_backend!(self, s => s.insert_transfers(transfers).await)
    }

    async fn open_holds(&mut self, holds: &[OpenHold]) -> Result<()> {
        on_backend!(self, s => s.open_holds(holds).await)
    }

    async fn close_hold(&mut self, transfer_id: &str) -> Result<()> {
        on_backend!(self, s => s.close_hold(transfer_id).await)
    }

    async fn used_job_ids(&mut self, ids: &[String]) -> Result<HashSet<String>> {
        on_backend!(self, s => s.used_job_ids(ids).await)
    }

    async fn payers(&mut self, accounts: &[&str]) -> Result<HashMap<String, PayerBalance>> {
        on_backend!(self, s => s.payers(accounts).await)
    }

    async fn insert_terms(&mut self, terms: &[(&str, &JobTerms)]) -> Result<()> {
        on_backend!(self, s => s.insert_terms(terms).await)
    }

    async fn insert_jobs(&mut self, jobs: &[(&NewJob, i64)]) -> Result<()> {
        on_backend!(self, s => s.insert_jobs(jobs).await)
    }

    async fn insert_account_if_absent(&mut self, account: &Account) -> Result<()> {
        on_backend!(self, s => s.insert_account_if_absent(account).await)
    }

    async fn link_operator(&mut self, node_id: &str, account: &str, now_ms: i64) -> Result<()> {
        on_backend!(self, s => s.link_operator(node_id, account, now_ms).await)
    }

    async fn epoch_paid(&mut self, epoch: i64) -> Result<bool> {
        on_backend!(self, s => s.epoch_paid(epoch).await)
    }

    async fn availability(&mut self, epoch: i64) -> Result<Vec<Availability>> {
        on_backend!(self, s => s.availability(epoch).await)
    }

    async fn mark_epoch_paid(&mut self, epoch: i64, paid_ms: i64, total: i64) -> Result<()> {
        on_backend!(self, s => s.mark_epoch_paid(epoch, paid_ms, total).await)
    }

    async fn end_audit(
        &mut self,
        job: &str,
        passed: bool,
        auditor: &str,
        verdict: &[u8],
        now_ms: i64,
    ) -> Result<Option<String>> {
        on_backend!(self, s => s.end_audit(job, passed, auditor, verdict, now_ms).await)
    }

    async fn count_record(&mut self, node: &str, delta: &RecordDelta) -> Result<()> {
        on_backend!(self, s => s.count_record(node, delta).await)
    }

    async fn audit_record(&mut self, node: &str) -> Result<AuditRecord> {
        on_backend!(self, s => s.audit_record(node).await)
    }

    async fn ban_node(&mut self, node: &str, now_ms: i64) -> Result<()> {
        on_backend!(self, s => s.ban_node(node, now_ms).await)
    }

    async fn fence(&mut self, lease: &Lease, now_ms: i64) -> Result<()> {
        on_backend!(self, t => t.fence(lease, now_ms).await)
    }
}
