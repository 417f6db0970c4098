//! Submitting jobs: each job's hold and its job row, by group commit.
//!
//! Concurrent submits queue up; whoever takes the ledger's writer lock next
//! runs every queued submit in one `BEGIN IMMEDIATE` transaction, so one
//! commit (and, with `synchronous = FULL`, one fsync) serves the whole
//! batch. There is no linger: a batch is whatever queued while the previous
//! one was being written, so an idle ledger commits a lone submit at once
//! and a busy one grows its batches by itself.
//!
//! A batch costs a fixed number of statements, whatever its size: one
//! lookup of already used job ids, one of the paying accounts, one balance
//! `UPDATE` per paying account (the sum of its accepted holds) and one for
//! escrow, and multi-row `INSERT`s into `transfers`, `open_holds`,
//! `job_holds` and `jobs` (see [`crate::store::sqlite::insert_rows`]).
//!
//! # Invariants
//! - Every submit is decided in queue order against the balances as the
//!   earlier submits of its batch left them: a hold that would overdraw its
//!   account is refused alone ([`LedgerError::InsufficientFunds`], with the
//!   amount available to it), and so are an unknown account and a job id
//!   used before (in the database or earlier in the batch). A refused submit
//!   writes nothing; the others in its batch commit.
//! - Each accepted submit writes exactly what a single transfer would: the
//!   pending transfer `job:<id>:hold` (client -> escrow), its `open_holds`
//!   row, the job's terms and the queued job, in the batch's transaction.
//!   The sum over accounts stays zero: the debits added to the payers equal
//!   the credits added to escrow.
//! - The balance `UPDATE`s keep the overdraft guard in SQL (and the schema's
//!   CHECK backs it), so a decision made on stale balances aborts the batch
//!   instead of overdrawing.
//!
//! # Failure
//! A database error (or a guard that does not hold) rolls the batch back:
//! every accepted submit in it fails with [`LedgerError::BatchAborted`] and
//! nothing of it is stored; refusals keep their own error.

use std::collections::{HashMap, HashSet};

use sqlx::{Row, SqliteConnection};

use super::{settle::hold_id, JobTerms, Ledger, LedgerError, ESCROW};
use crate::{
    domain::{JobRecord, NewJob},
    store::sqlite::{insert_jobs_on, insert_rows},
    util::lock,
};

/// A submit waiting for the next group commit.
#[derive(Debug)]
pub(crate) struct QueuedSubmit {
    job: NewJob,
    terms: JobTerms,
    now_ms: i64,
    reply: tokio::sync::oneshot::Sender<Result<JobRecord, LedgerError>>,
}

impl Ledger {
    /// Places the hold for `job` on `terms.account` and inserts the job, in
    /// one transaction: with too small a balance nothing is stored. The
    /// answer comes after the transaction committed (see the module docs).
    pub async fn submit_job(
        &self,
        job: &NewJob,
        terms: &JobTerms,
        now_ms: i64,
    ) -> Result<JobRecord, LedgerError> {
        let (reply, mut answer) = tokio::sync::oneshot::channel();
        lock(&self.submits).push(QueuedSubmit {
            job: job.clone(),
            terms: terms.clone(),
            now_ms,
            reply,
        });
        // Whoever gets the writer lock first writes the queue; a submit that
        // was written by someone else meanwhile leaves the line for the lock
        // at once (else the answered submits would each take the lock in
        // turn, and every new submit would commit alone behind them).
        let guard = tokio::select! {
            biased;
            r = &mut answer => return r.unwrap_or_else(|_| Err(dropped())),
            guard = self.writer_lock() => guard,
        };
        let batch = std::mem::take(&mut *lock(&self.submits));
        if !batch.is_empty() {
            // The batch is written on a task of its own: a caller that goes
            // away (a client hanging up) must not roll back everyone else's
            // submits with it.
            let ledger = self.clone();
            tokio::spawn(async move {
                let committed = match ledger.begin_locked(guard).await {
                    Ok(mut tx) => match write_batch(&ledger, &mut tx, &batch).await {
                        Ok(verdicts) => tx
                            .commit()
                            .await
                            .map(|()| verdicts)
                            .map_err(|e| e.to_string()),
                        Err(e) => Err(e.to_string()),
                    },
                    Err(e) => Err(e.to_string()),
                };
                answer_all(batch, committed);
            });
        }
        // A batch that panicked dropped its answers: each caller sees that.
        answer.await.unwrap_or_else(|_| Err(dropped()))
    }
}

impl Ledger {
    /// The durability settings the ledger's writes run under, as SQLite
    /// reports them on a connection of the pool (e.g. `journal_mode=wal,
    /// synchronous=FULL`): what a benchmark states next to its figures.
    pub async fn durability(&self) -> Result<String, LedgerError> {
        let mut conn = self.pool().acquire().await?;
        let journal: String = sqlx::query_scalar("PRAGMA journal_mode")
            .fetch_one(&mut *conn)
            .await?;
        let sync: i64 = sqlx::query_scalar("PRAGMA synchronous")
            .fetch_one(&mut *conn)
            .await?;
        let sync = match sync {
            0 => "OFF",
            1 => "NORMAL",
            2 => "FULL",
            3 => "EXTRA",
            _ => "unknown",
        };
        Ok(format!("journal_mode={journal}, synchronous={sync}"))
    }
}

fn dropped() -> LedgerError {
    LedgerError::BatchAborted("the batch was dropped".into())
}

/// Sends each submit of a batch its answer: its refusal, its job once the
/// batch committed, or why the batch did not.
fn answer_all(batch: Vec<QueuedSubmit>, committed: Result<Vec<Verdict>, String>) {
    match committed {
        Ok(verdicts) => {
            for (q, v) in batch.into_iter().zip(verdicts) {
                let r = match v {
                    Verdict::Accepted => Ok(JobRecord::queued(&q.job, q.now_ms)),
                    Verdict::Refused(e) => Err(e),
                };
                let _ = q.reply.send(r);
            }
        }
        Err(why) => {
            for q in batch {
                let _ = q.reply.send(Err(LedgerError::BatchAborted(why.clone())));
            }
        }
    }
}

/// The pending transfer of one accepted submit.
struct Hold<'a> {
    id: String,
    job: &'a str,
    account: &'a str,
    amount: i64,
    deadline_ms: i64,
    now_ms: i64,
}

/// What the batch decided for one submit.
#[derive(Debug)]
enum Verdict {
    Accepted,
    Refused(LedgerError),
}

/// An account as a batch sees it: whether it may go below zero, and what it
/// still has available after the batch's earlier holds.
struct Payer {
    no_overdraft: bool,
    available: i64,
    held: i64,
}

/// Decides every submit of `batch` in order and writes the accepted ones on
/// `conn` (inside the batch's transaction). One verdict per submit.
async fn write_batch(
    ledger: &Ledger,
    conn: &mut SqliteConnection,
    batch: &[QueuedSubmit],
) -> Result<Vec<Verdict>, LedgerError> {
    let ids: Vec<String> = batch.iter().map(|q| q.job.id.to_string()).collect();
    let used = used_job_ids(conn, &ids).await?;
    let mut payers = payers(conn, batch).await?;
    let mut seen = HashSet::with_capacity(batch.len());
    let mut verdicts = Vec::with_capacity(batch.len());
    for (q, id) in batch.iter().zip(&ids) {
        verdicts.push(decide(q, id, &used, &mut seen, &mut payers));
    }

    // Balances: one guarded UPDATE per paying account, one for escrow.
    let mut escrow = 0i64;
    for (account, p) in &payers {
        if p.held == 0 {
            continue;
        }
        let n = sqlx::query(
            "UPDATE accounts SET debits_pending = debits_pending + ?1 WHERE id = ?2 \
             AND (no_overdraft = 0 OR credits_posted - debits_posted - debits_pending >= ?1)",
        )
        .bind(p.held)
        .bind(account)
        .execute(&mut *conn)
        .await?
        .rows_affected();
        if n != 1 {
            return Err(LedgerError::Corrupt(format!(
                "holds of {} on {account} do not fit its balance any more",
                p.held
            )));
        }
        escrow = escrow
            .checked_add(p.held)
            .ok_or_else(|| LedgerError::Corrupt("the batch's holds overflow".into()))?;
    }
    if escrow > 0 {
        sqlx::query("UPDATE accounts SET credits_pending = credits_pending + ? WHERE id = ?")
            .bind(escrow)
            .bind(ESCROW)
            .execute(&mut *conn)
            .await?;
    }

    // Rows: multi-row INSERTs of the accepted submits.
    let accepted: Vec<(&QueuedSubmit, &String)> = batch
        .iter()
        .zip(&ids)
        .zip(&verdicts)
        .filter(|(_, v)| matches!(v, Verdict::Accepted))
        .map(|(qi, _)| qi)
        .collect();
    let holds: Vec<Hold<'_>> = accepted
        .iter()
        .filter(|(q, _)| q.terms.max_price > 0)
        .map(|(q, id)| Hold {
            id: hold_id(id),
            job: id,
            account: &q.terms.account,
            amount: q.terms.max_price,
            deadline_ms: q.now_ms.saturating_add(ledger.config().hold_ttl_ms),
            now_ms: q.now_ms,
        })
        .collect();
    insert_rows(
        conn,
        "INSERT INTO transfers (id, kind, debit_account, credit_account, amount, pending_id, \
         deadline_ms, job_id, node_id, tokens, memo, created_at_ms) VALUES ",
        "(?, 'pending', ?, ?, ?, NULL, ?, ?, NULL, 0, 'hold', ?)",
        &holds,
        |q, h| {
            q.bind(h.id.as_str())
                .bind(h.account)
                .bind(ESCROW)
                .bind(h.amount)
                .bind(h.deadline_ms)
                .bind(h.job)
                .bind(h.now_ms)
        },
    )
    .await?;
    insert_rows(
        conn,
        "INSERT INTO open_holds (transfer_id, job_id, deadline_ms) VALUES ",
        "(?, ?, ?)",
        &holds,
        |q, h| q.bind(h.id.as_str()).bind(h.job).bind(h.deadline_ms),
    )
    .await?;
    insert_rows(
        conn,
        "INSERT INTO job_holds (job_id, account_id, input_per_mtok, output_per_mtok, max_price) \
         VALUES ",
        "(?, ?, ?, ?, ?)",
        &accepted,
        |q, (s, id)| {
            q.bind(id.as_str())
                .bind(s.terms.account.as_str())
                .bind(i64::try_from(s.terms.price.input_per_mtok).unwrap_or(i64::MAX))
                .bind(i64::try_from(s.terms.price.output_per_mtok).unwrap_or(i64::MAX))
                .bind(s.terms.max_price)
        },
    )
    .await?;
    let jobs: Vec<(&NewJob, i64)> = accepted.iter().map(|(q, _)| (&q.job, q.now_ms)).collect();
    insert_jobs_on(conn, &jobs).await?;
    Ok(verdicts)
}

/// Decides one submit against what the batch has decided so far.
fn decide(
    q: &QueuedSubmit,
    id: &str,
    used: &HashSet<String>,
    seen: &mut HashSet<String>,
    payers: &mut HashMap<String, Payer>,
) -> Verdict {
    let refuse = Verdict::Refused;
    let amount = q.terms.max_price;
    if amount < 0 {
        return refuse(LedgerError::Invalid("amounts are never negative"));
    }
    if amount > 0 && q.terms.account == ESCROW {
        return refuse(LedgerError::Invalid(
            "debit and credit accounts must differ",
        ));
    }
    if used.contains(id) || !seen.insert(id.to_owned()) {
        return refuse(LedgerError::Invalid("this job was already submitted"));
    }
    let Some(payer) = payers.get_mut(&q.terms.account) else {
        seen.remove(id);
        return refuse(LedgerError::NoSuchAccount(q.terms.account.clone()));
    };
    if payer.no_overdraft && payer.available < amount {
        seen.remove(id);
        return refuse(LedgerError::InsufficientFunds {
            account: q.terms.account.clone(),
            needed: amount,
            available: payer.available,
        });
    }
    let Some(held) = payer.held.checked_add(amount) else {
        seen.remove(id);
        return refuse(LedgerError::Invalid("the holds on this account overflow"));
    };
    payer.held = held;
    payer.available = payer.available.saturating_sub(amount);
    Verdict::Accepted
}

/// The job ids among `ids` that already have a job, terms or a hold.
async fn used_job_ids(
    conn: &mut SqliteConnection,
    ids: &[String],
) -> Result<HashSet<String>, LedgerError> {
    let list = serde_json::to_string(ids)
        .map_err(|e| LedgerError::Corrupt(format!("job ids do not encode: {e}")))?;
    let rows = sqlx::query(
        "SELECT value FROM json_each(?1) WHERE value IN (SELECT id FROM jobs) \
         OR value IN (SELECT job_id FROM job_holds) \
         OR 'job:' || value || ':hold' IN (SELECT id FROM transfers)",
    )
    .bind(list)
    .fetch_all(&mut *conn)
    .await?;
    rows.iter()
        .map(|r| Ok(r.try_get::<String, _>(0)?))
        .collect()
}

/// The accounts paying for `batch`, as stored now (an unknown account is
/// missing from the map).
async fn payers(
    conn: &mut SqliteConnection,
    batch: &[QueuedSubmit],
) -> Result<HashMap<String, Payer>, LedgerError> {
    let mut accounts: Vec<&str> = batch.iter().map(|q| q.terms.account.as_str()).collect();
    accounts.sort_unstable();
    accounts.dedup();
    let list = serde_json::to_string(&accounts)
        .map_err(|e| LedgerError::Corrupt(format!("account ids do not encode: {e}")))?;
    let rows = sqlx::query(
        "SELECT id, no_overdraft, credits_posted - debits_posted - debits_pending FROM accounts \
         WHERE id IN (SELECT value FROM json_each(?1))",
    )
    .bind(list)
    .fetch_all(&mut *conn)
    .await?;
    rows.iter()
        .map(|r| {
            let no_overdraft: i64 = r.try_get(1)?;
            Ok((
                r.try_get(0)?,
                Payer {
                    no_overdraft: no_overdraft != 0,
                    available: r.try_get(2)?,
                    held: 0,
                },
            ))
        })
        .collect()
}
