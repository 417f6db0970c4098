//! The transfer engine: applies one transfer to the account balances and
//! records it, on a connection that is inside a transaction the caller owns.
//!
//! # Invariants
//! - Every transfer adds its amount to the debits of one account and the
//!   credits of another, so the sum over all accounts of
//!   `credits - debits` (posted, and pending) never changes.
//! - A transfer id is its idempotency key: the same transfer again is
//!   [`Applied::AlreadyExists`] and changes nothing; another transfer under a
//!   used id is [`LedgerError::ExistsWithDifferentFields`].
//! - A pending transfer is resolved (post, void, expire) at most once: the
//!   `open_holds` row is the proof it is still open, and the schema's unique
//!   index on `pending_id` backs it.
//! - A post moves at most the pending amount and never after the deadline.
//!
//! # Failure
//! Any error leaves partial updates in the caller's transaction, which must
//! then be dropped (rolled back), never committed.

use sqlx::{sqlite::SqliteRow, Row, SqliteConnection};

use super::{Account, Applied, LedgerError, NewTransfer, Transfer, TransferKind};

const TRANSFER_COLUMNS: &str = "id, kind, debit_account, credit_account, amount, pending_id, \
     deadline_ms, job_id, node_id, tokens, memo, created_at_ms";

pub(crate) fn transfer_from_row(row: &SqliteRow) -> Result<Transfer, LedgerError> {
    let kind: String = row.try_get("kind")?;
    Ok(Transfer {
        id: row.try_get("id")?,
        kind: TransferKind::parse(&kind)
            .ok_or_else(|| LedgerError::Corrupt(format!("unknown transfer kind {kind:?}")))?,
        debit: row.try_get("debit_account")?,
        credit: row.try_get("credit_account")?,
        amount: row.try_get("amount")?,
        pending_id: row.try_get("pending_id")?,
        deadline_ms: row.try_get("deadline_ms")?,
        job_id: row.try_get("job_id")?,
        node_id: row.try_get("node_id")?,
        tokens: row.try_get("tokens")?,
        memo: row.try_get("memo")?,
        created_at_ms: row.try_get("created_at_ms")?,
    })
}

pub(crate) async fn get(
    conn: &mut SqliteConnection,
    id: &str,
) -> Result<Option<Transfer>, LedgerError> {
    let row = sqlx::query(&format!(
        "SELECT {TRANSFER_COLUMNS} FROM transfers WHERE id = ?"
    ))
    .bind(id)
    .fetch_optional(&mut *conn)
    .await?;
    row.map(|r| transfer_from_row(&r)).transpose()
}

pub(crate) async fn account(
    conn: &mut SqliteConnection,
    id: &str,
) -> Result<Option<Account>, LedgerError> {
    let row = sqlx::query(
        "SELECT id, name, kind, no_overdraft, debits_pending, debits_posted, credits_pending, \
         credits_posted, created_at_ms FROM accounts WHERE id = ?",
    )
    .bind(id)
    .fetch_optional(&mut *conn)
    .await?;
    row.map(|r| super::account_from_row(&r)).transpose()
}

/// Applies `t` at time `now_ms` (for a post, `now_ms` is also the moment
/// checked against the pending deadline).
pub(crate) async fn apply(
    conn: &mut SqliteConnection,
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
    if let Some(existing) = get(conn, &t.id).await? {
        return if same(&existing, kind, t) {
            Ok(Applied::AlreadyExists)
        } else {
            Err(LedgerError::ExistsWithDifferentFields { id: t.id.clone() })
        };
    }
    let recorded = if kind.resolves() {
        resolve(conn, kind, t, now_ms).await?
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
        debit(conn, &t.debit, t.amount, pending).await?;
        let (col, amount) = if pending {
            ("credits_pending", t.amount)
        } else {
            ("credits_posted", t.amount)
        };
        let n = sqlx::query(&format!(
            "UPDATE accounts SET {col} = {col} + ? WHERE id = ?"
        ))
        .bind(amount)
        .bind(&t.credit)
        .execute(&mut *conn)
        .await?
        .rows_affected();
        if n != 1 {
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
    insert(conn, &recorded).await?;
    if kind == TransferKind::Pending {
        sqlx::query("INSERT INTO open_holds (transfer_id, job_id, deadline_ms) VALUES (?, ?, ?)")
            .bind(&recorded.id)
            .bind(&recorded.job_id)
            .bind(recorded.deadline_ms)
            .execute(&mut *conn)
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
async fn debit(
    conn: &mut SqliteConnection,
    id: &str,
    amount: i64,
    pending: bool,
) -> Result<(), LedgerError> {
    let col = if pending {
        "debits_pending"
    } else {
        "debits_posted"
    };
    let n = sqlx::query(&format!(
        "UPDATE accounts SET {col} = {col} + ?1 WHERE id = ?2 \
         AND (no_overdraft = 0 OR credits_posted - debits_posted - debits_pending >= ?1)"
    ))
    .bind(amount)
    .bind(id)
    .execute(&mut *conn)
    .await?
    .rows_affected();
    if n == 1 {
        return Ok(());
    }
    match account(conn, id).await? {
        None => Err(LedgerError::NoSuchAccount(id.to_owned())),
        Some(a) => Err(LedgerError::InsufficientFunds {
            account: id.to_owned(),
            needed: amount,
            available: a.available(),
        }),
    }
}

async fn resolve(
    conn: &mut SqliteConnection,
    kind: TransferKind,
    t: &NewTransfer,
    now_ms: i64,
) -> Result<Transfer, LedgerError> {
    let pending_id = t.pending_id.as_deref().ok_or(LedgerError::Invalid(
        "a resolution names its pending transfer",
    ))?;
    let pending = match get(conn, pending_id).await? {
        Some(p) if p.kind == TransferKind::Pending => p,
        _ => return Err(LedgerError::NoSuchPending(pending_id.to_owned())),
    };
    let open: Option<i64> =
        sqlx::query_scalar("SELECT deadline_ms FROM open_holds WHERE transfer_id = ?")
            .bind(pending_id)
            .fetch_optional(&mut *conn)
            .await?;
    let Some(deadline_ms) = open else {
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
    let n = sqlx::query(
        "UPDATE accounts SET debits_pending = debits_pending - ?1, debits_posted = debits_posted + ?2 \
         WHERE id = ?3 AND debits_pending >= ?1",
    )
    .bind(pending.amount)
    .bind(posted)
    .bind(&pending.debit)
    .execute(&mut *conn)
    .await?
    .rows_affected();
    let m = sqlx::query(
        "UPDATE accounts SET credits_pending = credits_pending - ?1, credits_posted = credits_posted + ?2 \
         WHERE id = ?3 AND credits_pending >= ?1",
    )
    .bind(pending.amount)
    .bind(posted)
    .bind(&pending.credit)
    .execute(&mut *conn)
    .await?
    .rows_affected();
    if n != 1 || m != 1 {
        return Err(LedgerError::Corrupt(format!(
            "pending balances of transfer {pending_id} do not match its accounts"
        )));
    }
    sqlx::query("DELETE FROM open_holds WHERE transfer_id = ?")
        .bind(pending_id)
        .execute(&mut *conn)
        .await?;
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

async fn insert(conn: &mut SqliteConnection, t: &Transfer) -> Result<(), LedgerError> {
    sqlx::query(&format!(
        "INSERT INTO transfers ({TRANSFER_COLUMNS}) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)"
    ))
    .bind(&t.id)
    .bind(t.kind.as_str())
    .bind(&t.debit)
    .bind(&t.credit)
    .bind(t.amount)
    .bind(&t.pending_id)
    .bind(t.deadline_ms)
    .bind(&t.job_id)
    .bind(&t.node_id)
    .bind(t.tokens)
    .bind(&t.memo)
    .bind(t.created_at_ms)
    .execute(&mut *conn)
    .await?;
    Ok(())
}
