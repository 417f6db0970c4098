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
    v1::{job_input, JobInput, ResultClaim},
};
use prost::Message;
use sqlx::{Row, SqliteConnection};

use super::{
    transfer, Applied, JobTerms, Ledger, LedgerError, NewTransfer, Price, TransferKind, ESCROW, FEE,
};
pub use crate::domain::hold_id;

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
        let mut conn = self.pool().acquire().await?;
        terms(&mut conn, &job.to_string()).await
    }

    /// Settles `job` according to its state in the store (see [`Settlement`]).
    /// Idempotent: once the hold is resolved, it returns `NothingOpen`.
    pub async fn settle_job(&self, job: JobId, now_ms: i64) -> Result<Settlement, LedgerError> {
        let id = job.to_string();
        let mut tx = self.write_tx().await?;
        step(self).await;
        let deadline: Option<i64> =
            sqlx::query_scalar("SELECT deadline_ms FROM open_holds WHERE transfer_id = ?")
                .bind(hold_id(&id))
                .fetch_optional(&mut *tx)
                .await?;
        let Some(deadline) = deadline else {
            return Ok(Settlement::NothingOpen);
        };
        let row = sqlx::query(
            "SELECT state, claim, node_id, attempt, updated_at_ms FROM jobs WHERE id = ?",
        )
        .bind(&id)
        .fetch_optional(&mut *tx)
        .await?;
        let release = |late: bool| {
            if late {
                TransferKind::ExpirePending
            } else {
                TransferKind::VoidPending
            }
        };
        let late = now_ms > deadline;
        let outcome = match row {
            None => release_hold(&mut tx, &id, release(late), now_ms).await?,
            Some(row) => {
                let state: String = row.try_get("state")?;
                let updated: i64 = row.try_get("updated_at_ms")?;
                let audit: Option<String> =
                    sqlx::query_scalar("SELECT state FROM audits WHERE job_id = ?")
                        .bind(&id)
                        .fetch_optional(&mut *tx)
                        .await?;
                let window = self.config().audit_window_ms;
                let in_window = window > 0 && now_ms < updated.saturating_add(window);
                match state.as_str() {
                    // A failed audit voids the pay: the client gets the
                    // whole hold back, the operator nothing.
                    "completed" if audit.as_deref() == Some("failed") => {
                        release_hold(&mut tx, &id, TransferKind::VoidPending, now_ms).await?
                    }
                    // Pay waits for the audit window to close.
                    "completed" if in_window && !late => Settlement::Open,
                    "completed" if updated <= deadline => {
                        let claim: Option<Vec<u8>> = row.try_get("claim")?;
                        let node: Option<String> = row.try_get("node_id")?;
                        let attempt: i64 = row.try_get("attempt")?;
                        let claim = ResultClaim::decode(claim.unwrap_or_default().as_slice())
                            .map_err(|e| LedgerError::Corrupt(format!("claim of job {id}: {e}")))?;
                        let finisher = Share {
                            node_id: node.unwrap_or_default(),
                            attempt: attempt as u32,
                            input_tokens: u64::from(claim.prompt_tokens),
                            output_tokens: u64::from(claim.completion_tokens),
                        };
                        let shares = job_shares(&mut tx, job, finisher).await?;
                        let terms = terms(&mut tx, &id).await?.ok_or_else(|| {
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
                    "completed" | "failed" | "cancelled" => {
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
        let mut tx = self.write_tx().await?;
        let Some(terms) = terms(&mut tx, &id).await? else {
            return Ok(Settlement::NothingOpen);
        };
        let open: Option<i64> =
            sqlx::query_scalar("SELECT deadline_ms FROM open_holds WHERE transfer_id = ?")
                .bind(hold_id(&id))
                .fetch_optional(&mut *tx)
                .await?;
        if open.is_none() {
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
        Ok(sqlx::query_scalar(
            "SELECT job_id FROM open_holds WHERE deadline_ms < ? AND job_id IS NOT NULL \
             ORDER BY deadline_ms LIMIT ?",
        )
        .bind(now_ms)
        .bind(i64::from(limit))
        .fetch_all(self.pool())
        .await?)
    }

    /// Jobs with an open hold that have already ended (left by a crash
    /// between the job's last transition and its settlement), or completed
    /// jobs whose audit window closed at `now_ms` or whose audit failed.
    pub async fn unsettled_jobs(
        &self,
        now_ms: i64,
        limit: u32,
    ) -> Result<Vec<String>, LedgerError> {
        Ok(sqlx::query_scalar(
            "SELECT h.job_id FROM open_holds h LEFT JOIN jobs j ON j.id = h.job_id \
             WHERE h.job_id IS NOT NULL AND (j.id IS NULL OR j.state IN ('failed', 'cancelled') \
             OR (j.state = 'completed' AND (?1 = 0 OR j.updated_at_ms + ?1 <= ?2 OR EXISTS \
               (SELECT 1 FROM audits a WHERE a.job_id = j.id AND a.state = 'failed')))) \
             LIMIT ?3",
        )
        .bind(self.config().audit_window_ms)
        .bind(now_ms)
        .bind(i64::from(limit))
        .fetch_all(self.pool())
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
    conn: &mut SqliteConnection,
    job: JobId,
    mut finisher: Share,
) -> Result<Vec<Share>, LedgerError> {
    let segments = crate::store::segments::segments_on(conn, job).await?;
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

async fn terms(conn: &mut SqliteConnection, job: &str) -> Result<Option<JobTerms>, LedgerError> {
    let row = sqlx::query(
        "SELECT account_id, input_per_mtok, output_per_mtok, max_price FROM job_holds WHERE job_id = ?",
    )
    .bind(job)
    .fetch_optional(&mut *conn)
    .await?;
    row.map(|r| {
        let input: i64 = r.try_get("input_per_mtok")?;
        let output: i64 = r.try_get("output_per_mtok")?;
        Ok(JobTerms {
            account: r.try_get("account_id")?,
            price: Price {
                input_per_mtok: input.max(0) as u64,
                output_per_mtok: output.max(0) as u64,
            },
            max_price: r.try_get("max_price")?,
        })
    })
    .transpose()
}

async fn release_hold(
    conn: &mut SqliteConnection,
    job: &str,
    kind: TransferKind,
    now_ms: i64,
) -> Result<Settlement, LedgerError> {
    let (suffix, outcome) = match kind {
        TransferKind::ExpirePending => ("expire", Settlement::Expired),
        _ => ("void", Settlement::Voided),
    };
    transfer::apply(
        conn,
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
    conn: &mut SqliteConnection,
    job: &str,
    price: &Price,
    shares: &[Share],
    fee_bps: u32,
    now_ms: i64,
) -> Result<Settlement, LedgerError> {
    let hold = transfer::get(conn, &hold_id(job))
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
        conn,
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
        let operator = operator_of(conn, &share.node_id).await?;
        let applied = transfer::apply(
            conn,
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
            conn,
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
/// operator account of its own, so its pay is never lost.
pub(crate) async fn operator_of(
    conn: &mut SqliteConnection,
    node_id: &str,
) -> Result<String, LedgerError> {
    if let Some(a) =
        sqlx::query_scalar::<_, String>("SELECT account_id FROM node_operators WHERE node_id = ?")
            .bind(node_id)
            .fetch_optional(&mut *conn)
            .await?
    {
        return Ok(a);
    }
    let short: String = node_id.chars().take(16).collect();
    let account = format!("acct_node_{short}");
    let now = crate::util::now_ms();
    sqlx::query(
        "INSERT OR IGNORE INTO accounts (id, name, kind, no_overdraft, created_at_ms) \
         VALUES (?, ?, 'operator', 1, ?)",
    )
    .bind(&account)
    .bind(format!("node {short}"))
    .bind(now)
    .execute(&mut *conn)
    .await?;
    sqlx::query("INSERT INTO node_operators (node_id, account_id, linked_at_ms) VALUES (?, ?, ?)")
        .bind(node_id)
        .bind(&account)
        .bind(now)
        .execute(&mut *conn)
        .await?;
    Ok(account)
}
