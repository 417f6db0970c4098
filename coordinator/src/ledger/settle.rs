//! Paying for jobs: settlement when the job ends, and the expiry of holds
//! whose deadline passed (the hold itself is placed at submit, by group
//! commit: see `submit.rs`).
//!
//! Transfer ids (idempotency keys) derive from the job id, so every step can
//! be retried, replayed after a crash, or raced by the sweep, and still
//! happens once:
//! - `job:<id>:hold`: pending, client -> escrow, the job's maximum price;
//! - `job:<id>:post`: posts the actual price (the rest goes back to the client);
//! - `job:<id>:pay:<attempt>:<node>`: escrow -> the node's operator, its
//!   share of the price less the fee (one per node that produced verified
//!   tokens, so a job handed off pays each node for what it produced);
//! - `job:<id>:fee`: escrow -> the network fee account;
//! - `job:<id>:void` / `job:<id>:expire`: releases the whole hold.
//!
//! # Invariants
//! - Settlement reads the job's state from the store and acts on it: only a
//!   completed job (its claim verified before the store accepted it) is paid,
//!   and only once its audit window closed (`audit_window_ms` after it
//!   completed) without a failed audit; a failed audit voids the hold;
//!   a failed or cancelled job is voided; an unfinished one is left alone.
//! - refund + payouts + fee == hold, and escrow returns to what it held
//!   before, in the same transaction as the post.
//! - A job completed before its hold's deadline is paid even if settlement
//!   runs later (crash recovery); the post is dated at the deadline at most.
//!
//! # Failure
//! [`LedgerError`]; nothing is committed unless the whole settlement is.

use mlxnet_proto::{
    ids::JobId,
    v1::{job_input, JobInput},
};

use super::{
    transfer, Applied, JobTerms, Ledger, LedgerError, NewTransfer, Price, TransferKind, ESCROW, FEE,
};
pub use crate::domain::hold_id;
use crate::{
    domain::{Account, AccountKind, JobState, Lease},
    store::{AnyTx, Store, StoreTx},
};

/// Settlement steps since the process started (for the test pause knob).
static STEPS: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);

/// One step of a settlement: where the crash test may stop the process.
async fn step(ledger: &Ledger) {
    let Some(at) = ledger.config().test_pause_at_step else {
        return;
    };
    let n = STEPS.fetch_add(1, std::sync::atomic::Ordering::SeqCst) + 1;
    if n == at {
        println!("settlement paused at step {n}");
        std::future::pending::<()>().await;
    }
}

/// Prompt tokens a chat template may add per message (role markers).
const TEMPLATE_TOKENS_PER_MESSAGE: u64 = 8;
/// Prompt tokens a chat template may add once (a default system prompt).
const TEMPLATE_TOKENS_FIXED: u64 = 64;

/// An upper bound of the prompt tokens of `input`: a byte-level tokenizer
/// never makes more tokens than bytes, plus what the chat template adds.
pub fn prompt_tokens_bound(input: &JobInput) -> u64 {
    match &input.kind {
        Some(job_input::Kind::Prompt(p)) => p.len() as u64 + TEMPLATE_TOKENS_FIXED,
        Some(job_input::Kind::Chat(c)) => {
            c.messages
                .iter()
                .map(|m| m.content.len() as u64 + TEMPLATE_TOKENS_PER_MESSAGE)
                .sum::<u64>()
                + TEMPLATE_TOKENS_FIXED
        }
        None => TEMPLATE_TOKENS_FIXED,
    }
}

/// The most a job can cost: its prompt bound and all of `max_tokens`.
pub fn max_price(price: &Price, input: &JobInput, max_tokens: u32) -> i64 {
    price.of(prompt_tokens_bound(input), u64::from(max_tokens))
}

/// Verified work by one node on a job.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Share {
    pub node_id: String,
    pub attempt: u32,
    pub input_tokens: u64,
    pub output_tokens: u64,
}

/// What settling a job did.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Settlement {
    /// The job was paid: `price` posted (`fee` of it to the network), and
    /// `refund` released to the client.
    Paid { price: i64, fee: i64, refund: i64 },
    /// The hold was released (failed or cancelled job).
    Voided,
    /// The hold's deadline passed first; released.
    Expired,
    /// The job has not finished and its hold is still valid.
    Open,
    /// The job has not finished but its hold's deadline passed: the caller
    /// must cancel the job, then settle again.
    Overdue,
    /// No open hold: already settled, or the job never had one.
    NothingOpen,
}

impl Ledger {
    /// Who pays for `job`, if it was submitted through the ledger.
    pub async fn job_terms(&self, job: JobId) -> Result<Option<JobTerms>, LedgerError> {
        Ok(self.store().job_terms(&job.to_string()).await?)
    }

    /// Settles `job` according to its state in the store (see [`Settlement`]).
    /// Idempotent: once the hold is resolved, it returns `NothingOpen`.
    pub async fn settle_job(&self, job: JobId, now_ms: i64) -> Result<Settlement, LedgerError> {
        self.settle_job_under(job, now_ms, None).await
    }

    /// [`Ledger::settle_job`] by a duty holding `lease` (the sweep): its
    /// transaction is fenced, so a replica that lost the lease settles
    /// nothing (`StoreError::Fenced`).
    pub async fn settle_job_under(
        &self,
        job: JobId,
        now_ms: i64,
        lease: Option<&Lease>,
    ) -> Result<Settlement, LedgerError> {
        let id = job.to_string();
        let mut tx = self.store().write().await?;
        if let Some(lease) = lease {
            tx.fence(lease, now_ms).await?;
        }
        step(self).await;
        let Some(deadline) = tx.hold_deadline(&hold_id(&id)).await? else {
            return Ok(Settlement::NothingOpen);
        };
        let release = |late: bool| {
            if late {
                TransferKind::ExpirePending
            } else {
                TransferKind::VoidPending
            }
        };
        let late = now_ms > deadline;
        let outcome = match tx.get_job(job).await? {
            None => release_hold(&mut tx, &id, release(late), now_ms).await?,
            Some(record) => {
                let updated = record.updated_at_ms;
                let audit = tx.audit_state(&id).await?;
                let window = self.config().audit_window_ms;
                let in_window = window > 0 && now_ms < updated.saturating_add(window);
                let completed = record.state == JobState::Completed;
                match record.state {
                    // A failed audit voids the pay: the client gets the
                    // whole hold back, the operator nothing.
                    _ if completed && audit.as_deref() == Some("failed") => {
                        release_hold(&mut tx, &id, TransferKind::VoidPending, now_ms).await?
                    }
                    // Pay waits for the audit window to close.
                    _ if completed && in_window && !late => Settlement::Open,
                    _ if completed && updated <= deadline => {
                        let claim = record
                            .result
                            .as_ref()
                            .and_then(|r| r.claim.clone())
                            .unwrap_or_default();
                        let finisher = Share {
                            node_id: record.node_id.clone().unwrap_or_default(),
                            attempt: record.attempt,
                            input_tokens: u64::from(claim.prompt_tokens),
                            output_tokens: u64::from(claim.completion_tokens),
                        };
                        let shares = job_shares(&mut tx, job, finisher).await?;
                        let terms = tx.job_terms(&id).await?.ok_or_else(|| {
                            LedgerError::Corrupt(format!("job {id} has a hold but no terms"))
                        })?;
                        post(
                            self,
                            &mut tx,
                            &id,
                            &terms.price,
                            &shares,
                            self.config().fee_bps,
                            now_ms.min(deadline),
                        )
                        .await?
                    }
                    JobState::Completed | JobState::Failed | JobState::Cancelled => {
                        release_hold(&mut tx, &id, release(late), now_ms).await?
                    }
                    _ if late => Settlement::Overdue,
                    _ => Settlement::Open,
                }
            }
        };
        step(self).await;
        tx.commit().await?;
        step(self).await;
        Ok(outcome)
    }

    /// Pays for `job` with explicit shares (a job handed off between nodes
    /// pays each for the verified tokens it produced). The caller has
    /// checked every share is verified work of a job that completed.
    pub async fn settle_shares(
        &self,
        job: JobId,
        shares: &[Share],
        now_ms: i64,
    ) -> Result<Settlement, LedgerError> {
        let id = job.to_string();
        let mut tx = self.store().write().await?;
        let Some(terms) = tx.job_terms(&id).await? else {
            return Ok(Settlement::NothingOpen);
        };
        if tx.hold_deadline(&hold_id(&id)).await?.is_none() {
            return Ok(Settlement::NothingOpen);
        }
        let outcome = post(
            self,
            &mut tx,
            &id,
            &terms.price,
            shares,
            self.config().fee_bps,
            now_ms,
        )
        .await?;
        tx.commit().await?;
        Ok(outcome)
    }

    /// Jobs whose hold is open and due (deadline at or before `now_ms`).
    pub async fn due_holds(&self, now_ms: i64, limit: u32) -> Result<Vec<String>, LedgerError> {
        Ok(self.store().due_holds(now_ms, limit).await?)
    }

    /// Jobs with an open hold that have already ended (left by a crash
    /// between the job's last transition and its settlement), or completed
    /// jobs whose audit window closed at `now_ms` or whose audit failed.
    pub async fn unsettled_jobs(
        &self,
        now_ms: i64,
        limit: u32,
    ) -> Result<Vec<String>, LedgerError> {
        Ok(self
            .store()
            .unsettled_jobs(now_ms, self.config().audit_window_ms, limit)
            .await?)
    }
}

/// Who is paid for a completed job, given its finishing attempt's share
/// (input = the prompt tokens its claim states).
///
/// A job handed off between nodes pays each token once, to the node whose
/// signed claim covers it:
/// - each hand-off segment with a verified partial claim (a drained node)
///   is paid its output tokens;
/// - the finishing attempt is paid its output tokens and the prompt once:
///   its claim's prompt tokens less the resumed ones it prefilled again;
/// - tokens a node streamed before it vanished carry no signature: they are
///   paid to nobody and cost the client nothing.
///
/// So a split job never costs the client more than the same job run
/// uninterrupted, and no attempt is paid twice.
async fn job_shares(
    tx: &mut AnyTx,
    job: JobId,
    mut finisher: Share,
) -> Result<Vec<Share>, LedgerError> {
    let segments = tx.segments(job).await?;
    let resumed: u64 = segments.iter().map(|s| s.token_ids.len() as u64).sum();
    finisher.input_tokens = finisher.input_tokens.saturating_sub(resumed);
    let mut shares: Vec<Share> = segments
        .iter()
        .filter(|s| s.claim.is_some())
        .map(|s| Share {
            node_id: s.node_id.clone(),
            attempt: s.attempt,
            input_tokens: 0,
            output_tokens: s.token_ids.len() as u64,
        })
        .collect();
    shares.push(finisher);
    Ok(shares)
}

async fn release_hold(
    tx: &mut AnyTx,
    job: &str,
    kind: TransferKind,
    now_ms: i64,
) -> Result<Settlement, LedgerError> {
    let (suffix, outcome) = match kind {
        TransferKind::ExpirePending => ("expire", Settlement::Expired),
        _ => ("void", Settlement::Voided),
    };
    transfer::apply(
        tx,
        &NewTransfer {
            id: format!("job:{job}:{suffix}"),
            kind: Some(kind),
            pending_id: Some(hold_id(job)),
            memo: suffix.into(),
            ..Default::default()
        },
        now_ms,
    )
    .await?;
    Ok(outcome)
}

/// Posts the price of `shares` (capped by the hold), pays each node's
/// operator its share less the fee, and the fee to the network.
async fn post(
    ledger: &Ledger,
    tx: &mut AnyTx,
    job: &str,
    price: &Price,
    shares: &[Share],
    fee_bps: u32,
    now_ms: i64,
) -> Result<Settlement, LedgerError> {
    let hold = tx
        .transfer(&hold_id(job))
        .await?
        .ok_or_else(|| LedgerError::NoSuchPending(hold_id(job)))?;
    let mut remaining = hold.amount;
    let mut total = 0i64;
    let mut fee_total = 0i64;
    let mut payouts = Vec::with_capacity(shares.len());
    for s in shares {
        let p = price.of(s.input_tokens, s.output_tokens).min(remaining);
        remaining -= p;
        let fee = (i128::from(p) * i128::from(fee_bps) / 10_000) as i64;
        payouts.push((s, p - fee));
        fee_total += fee;
        total += p;
    }
    transfer::apply(
        tx,
        &NewTransfer {
            id: format!("job:{job}:post"),
            kind: Some(TransferKind::PostPending),
            pending_id: Some(hold.id.clone()),
            amount: total,
            memo: "post".into(),
            ..Default::default()
        },
        now_ms,
    )
    .await?;
    step(ledger).await;
    for (share, pay) in payouts {
        if pay == 0 {
            continue;
        }
        let operator = operator_of(tx, &share.node_id).await?;
        let applied = transfer::apply(
            tx,
            &NewTransfer {
                id: format!("job:{job}:pay:{}:{}", share.attempt, share.node_id),
                kind: Some(TransferKind::Posted),
                debit: ESCROW.into(),
                credit: operator,
                amount: pay,
                job_id: Some(job.to_owned()),
                node_id: Some(share.node_id.clone()),
                tokens: i64::try_from(share.output_tokens).unwrap_or(i64::MAX),
                memo: "payout".into(),
                ..Default::default()
            },
            now_ms,
        )
        .await?;
        if applied == Applied::AlreadyExists {
            return Err(LedgerError::Corrupt(format!(
                "payout of job {job} to {} existed before its post",
                share.node_id
            )));
        }
        step(ledger).await;
    }
    if fee_total > 0 {
        transfer::apply(
            tx,
            &NewTransfer {
                id: format!("job:{job}:fee"),
                kind: Some(TransferKind::Posted),
                debit: ESCROW.into(),
                credit: FEE.into(),
                amount: fee_total,
                job_id: Some(job.to_owned()),
                memo: "fee".into(),
                ..Default::default()
            },
            now_ms,
        )
        .await?;
    }
    Ok(Settlement::Paid {
        price: total,
        fee: fee_total,
        refund: hold.amount - total,
    })
}

/// The operator account `node_id` earns for; a node never linked gets an
/// operator account of its own (`acct_node_<id prefix>`), so its pay is
/// never lost.
pub(crate) async fn operator_of(tx: &mut AnyTx, node_id: &str) -> Result<String, LedgerError> {
    if let Some(a) = tx.operator_of(node_id).await? {
        return Ok(a);
    }
    let short: String = node_id.chars().take(16).collect();
    let now = crate::util::now_ms();
    let account = Account::new(
        format!("acct_node_{short}"),
        format!("node {short}"),
        AccountKind::Operator,
        now,
    );
    tx.insert_account_if_absent(&account).await?;
    tx.link_operator(node_id, &account.id, now).await?;
    Ok(account.id)
}
