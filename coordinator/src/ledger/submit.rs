//! Submitting jobs: each job's hold and its job row, by group commit.
//!
//! Concurrent submits queue up; whoever takes the batch writer's lock next
//! runs every queued submit in one write transaction, so one
//! commit (and, with `synchronous = FULL`, one fsync) serves the whole
//! batch. There is no linger: a batch is whatever queued while the previous
//! one was being written, so an idle ledger commits a lone submit at once
//! and a busy one grows its batches by itself.
//!
//! A batch costs a fixed number of statements, whatever its size: one
//! lookup of already used job ids, one of the paying accounts, one balance
//! `UPDATE` per paying account (the sum of its accepted holds) and one for
//! escrow, and multi-row `INSERT`s into `transfers`, `open_holds`,
//! `job_holds` and `jobs` (the store writes each as few multi-row statements).
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

use super::{settle::hold_id, JobTerms, Ledger, LedgerError, ESCROW};
use crate::{
    domain::{JobRecord, NewJob, Transfer, TransferKind},
    store::{AnyTx, OpenHold, Store, StoreTx},
    util::{error_chain, lock},
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
        // Whoever takes the batch writer's lock next writes the queue; a
        // submit that was written by someone else meanwhile leaves the line
        // at once (else the answered submits would each take the lock in
        // turn, and every new submit would commit alone behind them). Only
        // the lock is raced: opening the store's transaction is not
        // cancel-safe (a `BEGIN` dropped half-way can leave its connection
        // holding SQLite's write lock, and every later writer then times out
        // with "database is locked"), so it happens on the batch's task,
        // which no caller can cancel: a caller that goes away (a client
        // hanging up) must not roll back everyone else's submits with it.
        let guard = tokio::select! {
            biased;
            r = &mut answer => return r.unwrap_or_else(|_| Err(dropped())),
            guard = std::sync::Arc::clone(&self.batch_writer).lock_owned() => guard,
        };
        let ledger = self.clone();
        tokio::spawn(async move {
            let tx = ledger.store().write().await;
            // The batch is what queued until the transaction opened.
            let batch = std::mem::take(&mut *lock(&ledger.submits));
            if !batch.is_empty() {
                let committed = match tx {
                    Ok(mut tx) => match write_batch(&ledger, &mut tx, &batch).await {
                        Ok(verdicts) => tx
                            .commit()
                            .await
                            .map(|()| verdicts)
                            .map_err(|e| error_chain(&e)),
                        Err(e) => Err(error_chain(&e)),
                    },
                    Err(e) => Err(error_chain(&e)),
                };
                answer_all(batch, committed);
            }
            drop(guard);
        });
        // A batch that panicked dropped its answers: each caller sees that.
        answer.await.unwrap_or_else(|_| Err(dropped()))
    }

    /// The durability settings the ledger's writes run under, as the store
    /// reports them (e.g. `journal_mode=wal, synchronous=FULL`): what a
    /// benchmark states next to its figures.
    pub async fn durability(&self) -> Result<String, LedgerError> {
        Ok(self.store().durability().await?)
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

/// Decides every submit of `batch` in order and writes the accepted ones in
/// `tx` (the batch's transaction). One verdict per submit.
async fn write_batch(
    ledger: &Ledger,
    tx: &mut AnyTx,
    batch: &[QueuedSubmit],
) -> Result<Vec<Verdict>, LedgerError> {
    let ids: Vec<String> = batch.iter().map(|q| q.job.id.to_string()).collect();
    let used = tx.used_job_ids(&ids).await?;
    let mut payers = payers(tx, batch).await?;
    let mut seen = HashSet::with_capacity(batch.len());
    let mut verdicts = Vec::with_capacity(batch.len());
    for (q, id) in batch.iter().zip(&ids) {
        verdicts.push(decide(q, id, &used, &mut seen, &mut payers));
    }

    // Balances: one guarded debit per paying account, one credit to escrow.
    let mut escrow = 0i64;
    for (account, p) in &payers {
        if p.held == 0 {
            continue;
        }
        if !tx.add_debit(account, p.held, true).await? {
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
        tx.add_credit(ESCROW, escrow, true).await?;
    }

    // Rows: the accepted submits' holds, their open holds, terms and jobs.
    let accepted: Vec<(&QueuedSubmit, &String)> = batch
        .iter()
        .zip(&ids)
        .zip(&verdicts)
        .filter(|(_, v)| matches!(v, Verdict::Accepted))
        .map(|(qi, _)| qi)
        .collect();
    let holds: Vec<Transfer> = accepted
        .iter()
        .filter(|(q, _)| q.terms.max_price > 0)
        .map(|(q, id)| Transfer {
            id: hold_id(id),
            kind: TransferKind::Pending,
            debit: q.terms.account.clone(),
            credit: ESCROW.into(),
            amount: q.terms.max_price,
            pending_id: None,
            deadline_ms: Some(q.now_ms.saturating_add(ledger.config().hold_ttl_ms)),
            job_id: Some((*id).clone()),
            node_id: None,
            tokens: 0,
            memo: "hold".into(),
            created_at_ms: q.now_ms,
        })
        .collect();
    tx.insert_transfers(&holds).await?;
    let open: Vec<OpenHold> = holds
        .iter()
        .map(|h| OpenHold {
            transfer_id: h.id.clone(),
            job_id: h.job_id.clone(),
            deadline_ms: h.deadline_ms.unwrap_or_default(),
        })
        .collect();
    tx.open_holds(&open).await?;
    let terms: Vec<(&str, &JobTerms)> = accepted
        .iter()
        .map(|(q, id)| (id.as_str(), &q.terms))
        .collect();
    tx.insert_terms(&terms).await?;
    let jobs: Vec<(&NewJob, i64)> = accepted.iter().map(|(q, _)| (&q.job, q.now_ms)).collect();
    tx.insert_jobs(&jobs).await?;
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

/// The accounts paying for `batch`, as stored now (an unknown account is
/// missing from the map).
async fn payers(
    tx: &mut AnyTx,
    batch: &[QueuedSubmit],
) -> Result<HashMap<String, Payer>, LedgerError> {
    let mut accounts: Vec<&str> = batch.iter().map(|q| q.terms.account.as_str()).collect();
    accounts.sort_unstable();
    accounts.dedup();
    Ok(tx
        .payers(&accounts)
        .await?
        .into_iter()
        .map(|(id, b)| {
            (
                id,
                Payer {
                    no_overdraft: b.no_overdraft,
                    available: b.available,
                    held: 0,
                },
            )
        })
        .collect())
}
