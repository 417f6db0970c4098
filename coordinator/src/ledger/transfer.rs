//! The transfer engine: applies one transfer to the account balances and
//! records it, inside a write transaction the caller owns.
//!
//! # Invariants
//! - Every transfer adds its amount to the debits of one account and the
//!   credits of another, so the sum over all accounts of
//!   `credits - debits` (posted, and pending) never changes.
//! - A transfer id is its idempotency key: the same transfer again is
//!   [`Applied::AlreadyExists`] and changes nothing; another transfer under a
//!   used id is [`LedgerError::ExistsWithDifferentFields`].
//! - A pending transfer is resolved (post, void, expire) at most once: its
//!   open hold is the proof it is still open, and the store's unique
//!   resolution per pending transfer backs it.
//! - A post moves at most the pending amount and never after the deadline.
//!
//! # Failure
//! Any error leaves partial updates in the caller's transaction, which must
//! then be dropped (rolled back), never committed.

use super::{Applied, LedgerError, NewTransfer, Transfer, TransferKind};
use crate::store::{AnyTx, OpenHold, Side, StoreTx};

/// Applies `t` at time `now_ms` (for a post, `now_ms` is also the moment
/// checked against the pending deadline).
pub(crate) async fn apply(
    tx: &mut AnyTx,
    t: &NewTransfer,
    now_ms: i64,
) -> Result<Applied, LedgerError> {
    let kind = t
        .kind
        .ok_or(LedgerError::Invalid("transfer kind is required"))?;
    if t.id.is_empty() {
        return Err(LedgerError::Invalid("transfer id is required"));
    }
    if t.amount < 0 || t.tokens < 0 {
        return Err(LedgerError::Invalid("amounts are never negative"));
    }
    if let Some(existing) = tx.transfer(&t.id).await? {
        return if same(&existing, kind, t) {
            Ok(Applied::AlreadyExists)
        } else {
            Err(LedgerError::ExistsWithDifferentFields { id: t.id.clone() })
        };
    }
    let recorded = if kind.resolves() {
        resolve(tx, kind, t, now_ms).await?
    } else {
        if t.amount == 0 {
            return Err(LedgerError::Invalid("a transfer moves a positive amount"));
        }
        if t.debit == t.credit {
            return Err(LedgerError::Invalid(
                "debit and credit accounts must differ",
            ));
        }
        if kind == TransferKind::Pending && t.deadline_ms.is_none() {
            return Err(LedgerError::Invalid("a pending transfer needs a deadline"));
        }
        let pending = kind == TransferKind::Pending;
        debit(tx, &t.debit, t.amount, pending).await?;
        if !tx.add_credit(&t.credit, t.amount, pending).await? {
            return Err(LedgerError::NoSuchAccount(t.credit.clone()));
        }
        Transfer {
            id: t.id.clone(),
            kind,
            debit: t.debit.clone(),
            credit: t.credit.clone(),
            amount: t.amount,
            pending_id: None,
            deadline_ms: if pending { t.deadline_ms } else { None },
            job_id: t.job_id.clone(),
            node_id: t.node_id.clone(),
            tokens: t.tokens,
            memo: t.memo.clone(),
            created_at_ms: now_ms,
        }
    };
    tx.insert_transfers(std::slice::from_ref(&recorded)).await?;
    if let (TransferKind::Pending, Some(deadline_ms)) = (kind, recorded.deadline_ms) {
        tx.open_holds(&[OpenHold {
            transfer_id: recorded.id.clone(),
            job_id: recorded.job_id.clone(),
            deadline_ms,
        }])
        .await?;
    }
    Ok(Applied::Created)
}

/// Whether an existing row is the same transfer as the one asked for.
fn same(existing: &Transfer, kind: TransferKind, t: &NewTransfer) -> bool {
    if existing.kind != kind || existing.pending_id != t.pending_id {
        return false;
    }
    match kind {
        TransferKind::VoidPending | TransferKind::ExpirePending => true,
        TransferKind::PostPending => existing.amount == t.amount,
        TransferKind::Posted | TransferKind::Pending => {
            existing.debit == t.debit
                && existing.credit == t.credit
                && existing.amount == t.amount
                && existing.job_id == t.job_id
        }
    }
}

/// Adds `amount` to the debits (posted or pending) of `id`, refusing to
/// overdraw an account that forbids it.
async fn debit(tx: &mut AnyTx, id: &str, amount: i64, pending: bool) -> Result<(), LedgerError> {
    if tx.add_debit(id, amount, pending).await? {
        return Ok(());
    }
    match tx.account(id).await? {
        None => Err(LedgerError::NoSuchAccount(id.to_owned())),
        Some(a) => Err(LedgerError::InsufficientFunds {
            account: id.to_owned(),
            needed: amount,
            available: a.available(),
        }),
    }
}

async fn resolve(
    tx: &mut AnyTx,
    kind: TransferKind,
    t: &NewTransfer,
    now_ms: i64,
) -> Result<Transfer, LedgerError> {
    let pending_id = t.pending_id.as_deref().ok_or(LedgerError::Invalid(
        "a resolution names its pending transfer",
    ))?;
    let pending = match tx.transfer(pending_id).await? {
        Some(p) if p.kind == TransferKind::Pending => p,
        _ => return Err(LedgerError::NoSuchPending(pending_id.to_owned())),
    };
    let Some(deadline_ms) = tx.hold_deadline(pending_id).await? else {
        return Err(LedgerError::AlreadyResolved(pending_id.to_owned()));
    };
    let posted = match kind {
        TransferKind::PostPending => {
            if now_ms > deadline_ms {
                return Err(LedgerError::PendingExpired {
                    id: pending_id.to_owned(),
                    deadline_ms,
                });
            }
            if t.amount > pending.amount {
                return Err(LedgerError::ExceedsPending {
                    amount: t.amount,
                    pending: pending.amount,
                });
            }
            t.amount
        }
        TransferKind::ExpirePending if now_ms <= deadline_ms => {
            return Err(LedgerError::Invalid(
                "a pending transfer expires only after its deadline",
            ))
        }
        _ => 0,
    };
    let debited = tx
        .resolve_pending(&pending.debit, Side::Debit, pending.amount, posted)
        .await?;
    let credited = tx
        .resolve_pending(&pending.credit, Side::Credit, pending.amount, posted)
        .await?;
    if !debited || !credited {
        return Err(LedgerError::Corrupt(format!(
            "pending balances of transfer {pending_id} do not match its accounts"
        )));
    }
    tx.close_hold(pending_id).await?;
    Ok(Transfer {
        id: t.id.clone(),
        kind,
        debit: pending.debit,
        credit: pending.credit,
        amount: if kind == TransferKind::PostPending {
            posted
        } else {
            pending.amount
        },
        pending_id: Some(pending_id.to_owned()),
        deadline_ms: None,
        job_id: pending.job_id,
        node_id: t.node_id.clone(),
        tokens: t.tokens,
        memo: t.memo.clone(),
        created_at_ms: now_ms,
    })
}
