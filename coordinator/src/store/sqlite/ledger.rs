//! The ledger's tables: accounts and their balances, immutable transfers,
//! open holds, job terms, node operators, availability and reward epochs.
//! The rules that combine these (double entry, holds resolved once,
//! settlement) are the ledger's; here is only their SQL.

use std::collections::{HashMap, HashSet};

use sqlx::{Row, SqliteConnection};

use super::{
    super::{
        rows::{self, ACCOUNT_COLUMNS, TRANSFER_COLUMNS},
        Anomaly, OpenHold, PayerBalance, Result, Side, StoreError,
    },
    jobs::insert_rows,
};
use crate::domain::{Account, Availability, JobTerms, NodeEarnings, Totals, Transfer};

/// Inserts `a`; with `if_absent`, an existing id is left as it is.
pub(super) async fn insert_account(
    conn: &mut SqliteConnection,
    a: &Account,
    if_absent: bool,
) -> Result<()> {
    let verb = if if_absent {
        "INSERT OR IGNORE"
    } else {
        "INSERT"
    };
    sqlx::query(&format!(
        "{verb} INTO accounts (id, name, kind, no_overdraft, created_at_ms) VALUES (?, ?, ?, ?, ?)"
    ))
    .bind(&a.id)
    .bind(&a.name)
    .bind(a.kind.as_str())
    .bind(i64::from(a.no_overdraft))
    .bind(a.created_at_ms)
    .execute(&mut *conn)
    .await?;
    Ok(())
}

pub(super) async fn account(conn: &mut SqliteConnection, id: &str) -> Result<Option<Account>> {
    let row = sqlx::query(&format!(
        "SELECT {ACCOUNT_COLUMNS} FROM accounts WHERE id = ?"
    ))
    .bind(id)
    .fetch_optional(&mut *conn)
    .await?;
    row.as_ref().map(rows::account).transpose()
}

pub(super) async fn transfer(conn: &mut SqliteConnection, id: &str) -> Result<Option<Transfer>> {
    let row = sqlx::query(&format!(
        "SELECT {TRANSFER_COLUMNS} FROM transfers WHERE id = ?"
    ))
    .bind(id)
    .fetch_optional(&mut *conn)
    .await?;
    row.as_ref().map(rows::transfer).transpose()
}

pub(super) async fn history(
    conn: &mut SqliteConnection,
    account: &str,
    limit: u32,
) -> Result<Vec<Transfer>> {
    let rows = sqlx::query(&format!(
        "SELECT {TRANSFER_COLUMNS} FROM transfers WHERE debit_account = ?1 OR credit_account = ?1 \
         ORDER BY created_at_ms DESC, rowid DESC LIMIT ?2"
    ))
    .bind(account)
    .bind(i64::from(limit))
    .fetch_all(&mut *conn)
    .await?;
    rows.iter().map(rows::transfer).collect()
}

pub(super) async fn job_transfers(conn: &mut SqliteConnection, job: &str) -> Result<Vec<Transfer>> {
    let rows = sqlx::query(&format!(
        "SELECT {TRANSFER_COLUMNS} FROM transfers WHERE job_id = ? ORDER BY rowid"
    ))
    .bind(job)
    .fetch_all(&mut *conn)
    .await?;
    rows.iter().map(rows::transfer).collect()
}

pub(super) async fn earnings(
    conn: &mut SqliteConnection,
    account: &str,
    since_ms: i64,
) -> Result<Vec<NodeEarnings>> {
    let rows = sqlx::query(
        "SELECT COALESCE(node_id, '') AS node_id, SUM(amount) AS micro_mlx, \
         COUNT(DISTINCT job_id) AS jobs, SUM(tokens) AS tokens FROM transfers \
         WHERE credit_account = ? AND memo IN ('payout', 'reward') AND created_at_ms >= ? \
         GROUP BY node_id ORDER BY node_id",
    )
    .bind(account)
    .bind(since_ms)
    .fetch_all(&mut *conn)
    .await?;
    rows.iter().map(rows::earnings).collect()
}

pub(super) async fn jobs_of(
    conn: &mut SqliteConnection,
    account: &str,
    limit: u32,
) -> Result<Vec<String>> {
    Ok(sqlx::query_scalar(
        "SELECT job_id FROM job_holds WHERE account_id = ? ORDER BY rowid DESC LIMIT ?",
    )
    .bind(account)
    .bind(i64::from(limit))
    .fetch_all(&mut *conn)
    .await?)
}

pub(super) async fn nodes_of(conn: &mut SqliteConnection, account: &str) -> Result<Vec<String>> {
    Ok(sqlx::query_scalar(
        "SELECT node_id FROM node_operators WHERE account_id = ? ORDER BY node_id",
    )
    .bind(account)
    .fetch_all(&mut *conn)
    .await?)
}

pub(super) async fn totals(conn: &mut SqliteConnection) -> Result<Totals> {
    let row = sqlx::query(
        "SELECT COALESCE(SUM(credits_posted - debits_posted), 0) AS posted, \
         COALESCE(SUM(credits_pending - debits_pending), 0) AS pending, \
         (SELECT COUNT(*) FROM open_holds) AS open_holds FROM accounts",
    )
    .fetch_one(&mut *conn)
    .await?;
    Ok(Totals {
        posted: row.try_get("posted")?,
        pending: row.try_get("pending")?,
        open_holds: row.try_get("open_holds")?,
    })
}

pub(super) async fn balance_mismatches(conn: &mut SqliteConnection) -> Result<Vec<String>> {
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
    .fetch_all(&mut *conn)
    .await?)
}

pub(super) async fn anomalies(
    conn: &mut SqliteConnection,
    now_ms: i64,
    audit_window_ms: i64,
) -> Result<Vec<(Anomaly, String)>> {
    let checks: [(Anomaly, &str); 6] = [
        (
            Anomaly::ResolvedTwice,
            "SELECT pending_id FROM transfers WHERE pending_id IS NOT NULL \
             GROUP BY pending_id HAVING COUNT(*) > 1",
        ),
        (
            Anomaly::OpenPastDeadline,
            "SELECT transfer_id FROM open_holds WHERE deadline_ms < ?1",
        ),
        (
            Anomaly::EndedWithHoldOpen,
            "SELECT h.job_id FROM open_holds h JOIN jobs j ON j.id = h.job_id \
             WHERE j.state IN ('failed', 'cancelled') OR (j.state = 'completed' \
             AND (?2 = 0 OR j.updated_at_ms + ?2 < ?1))",
        ),
        (
            Anomaly::PaidMismatch,
            "SELECT p.job_id FROM transfers p WHERE p.kind = 'post_pending' AND p.amount <> \
             (SELECT COALESCE(SUM(x.amount), 0) FROM transfers x \
              WHERE x.job_id = p.job_id AND x.memo IN ('payout', 'fee')) AND ?1 = ?1",
        ),
        (
            Anomaly::FailedAuditPaid,
            "SELECT DISTINCT x.job_id FROM transfers x JOIN audits a ON a.job_id = x.job_id \
             WHERE x.memo = 'payout' AND a.state = 'failed' AND x.created_at_ms >= a.ended_at_ms \
             AND ?1 = ?1 AND ?2 = ?2",
        ),
        (
            Anomaly::EndedPaid,
            "SELECT DISTINCT x.job_id FROM transfers x JOIN jobs j ON j.id = x.job_id \
             WHERE x.memo = 'payout' AND j.state IN ('failed', 'cancelled') AND ?1 = ?1",
        ),
    ];
    let mut out = Vec::new();
    for (what, sql) in checks {
        let ids: Vec<String> = sqlx::query_scalar(sql)
            .bind(now_ms)
            .bind(audit_window_ms)
            .fetch_all(&mut *conn)
            .await?;
        out.extend(ids.into_iter().map(|id| (what, id)));
    }
    Ok(out)
}

pub(super) async fn due_holds(
    conn: &mut SqliteConnection,
    now_ms: i64,
    limit: u32,
) -> Result<Vec<String>> {
    Ok(sqlx::query_scalar(
        "SELECT job_id FROM open_holds WHERE deadline_ms < ? AND job_id IS NOT NULL \
         ORDER BY deadline_ms LIMIT ?",
    )
    .bind(now_ms)
    .bind(i64::from(limit))
    .fetch_all(&mut *conn)
    .await?)
}

pub(super) async fn unsettled_jobs(
    conn: &mut SqliteConnection,
    now_ms: i64,
    audit_window_ms: i64,
    limit: u32,
) -> Result<Vec<String>> {
    Ok(sqlx::query_scalar(
        "SELECT h.job_id FROM open_holds h LEFT JOIN jobs j ON j.id = h.job_id \
         WHERE h.job_id IS NOT NULL AND (j.id IS NULL OR j.state IN ('failed', 'cancelled') \
         OR (j.state = 'completed' AND (?1 = 0 OR j.updated_at_ms + ?1 <= ?2 OR EXISTS \
           (SELECT 1 FROM audits a WHERE a.job_id = j.id AND a.state = 'failed')))) \
         LIMIT ?3",
    )
    .bind(audit_window_ms)
    .bind(now_ms)
    .bind(i64::from(limit))
    .fetch_all(&mut *conn)
    .await?)
}

pub(super) async fn job_terms(conn: &mut SqliteConnection, job: &str) -> Result<Option<JobTerms>> {
    let row = sqlx::query(
        "SELECT account_id, input_per_mtok, output_per_mtok, max_price FROM job_holds WHERE job_id = ?",
    )
    .bind(job)
    .fetch_optional(&mut *conn)
    .await?;
    row.as_ref().map(rows::terms).transpose()
}

pub(super) async fn insert_terms(
    conn: &mut SqliteConnection,
    terms: &[(&str, &JobTerms)],
) -> Result<()> {
    insert_rows(
        conn,
        "INSERT INTO job_holds (job_id, account_id, input_per_mtok, output_per_mtok, max_price) \
         VALUES ",
        "(?, ?, ?, ?, ?)",
        terms,
        |q, (job, t)| {
            q.bind(*job)
                .bind(t.account.as_str())
                .bind(i64::try_from(t.price.input_per_mtok).unwrap_or(i64::MAX))
                .bind(i64::try_from(t.price.output_per_mtok).unwrap_or(i64::MAX))
                .bind(t.max_price)
        },
    )
    .await?;
    Ok(())
}

pub(super) async fn hold_deadline(
    conn: &mut SqliteConnection,
    transfer_id: &str,
) -> Result<Option<i64>> {
    Ok(
        sqlx::query_scalar("SELECT deadline_ms FROM open_holds WHERE transfer_id = ?")
            .bind(transfer_id)
            .fetch_optional(&mut *conn)
            .await?,
    )
}

pub(super) async fn add_debit(
    conn: &mut SqliteConnection,
    account: &str,
    amount: i64,
    pending: bool,
) -> Result<bool> {
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
    .bind(account)
    .execute(&mut *conn)
    .await?
    .rows_affected();
    Ok(n == 1)
}

pub(super) async fn add_credit(
    conn: &mut SqliteConnection,
    account: &str,
    amount: i64,
    pending: bool,
) -> Result<bool> {
    let col = if pending {
        "credits_pending"
    } else {
        "credits_posted"
    };
    let n = sqlx::query(&format!(
        "UPDATE accounts SET {col} = {col} + ? WHERE id = ?"
    ))
    .bind(amount)
    .bind(account)
    .execute(&mut *conn)
    .await?
    .rows_affected();
    Ok(n == 1)
}

pub(super) async fn resolve_pending(
    conn: &mut SqliteConnection,
    account: &str,
    side: Side,
    pending: i64,
    posted: i64,
) -> Result<bool> {
    let sql = match side {
        Side::Debit => {
            "UPDATE accounts SET debits_pending = debits_pending - ?1, debits_posted = debits_posted + ?2 \
             WHERE id = ?3 AND debits_pending >= ?1"
        }
        Side::Credit => {
            "UPDATE accounts SET credits_pending = credits_pending - ?1, credits_posted = credits_posted + ?2 \
             WHERE id = ?3 AND credits_pending >= ?1"
        }
    };
    let n = sqlx::query(sql)
        .bind(pending)
        .bind(posted)
        .bind(account)
        .execute(&mut *conn)
        .await?
        .rows_affected();
    Ok(n == 1)
}

pub(super) async fn insert_transfers(conn: &mut SqliteConnection, ts: &[Transfer]) -> Result<()> {
    insert_rows(
        conn,
        &format!("INSERT INTO transfers ({TRANSFER_COLUMNS}) VALUES "),
        "(?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
        ts,
        |q, t| {
            q.bind(t.id.as_str())
                .bind(t.kind.as_str())
                .bind(t.debit.as_str())
                .bind(t.credit.as_str())
                .bind(t.amount)
                .bind(t.pending_id.as_deref())
                .bind(t.deadline_ms)
                .bind(t.job_id.as_deref())
                .bind(t.node_id.as_deref())
                .bind(t.tokens)
                .bind(t.memo.as_str())
                .bind(t.created_at_ms)
        },
    )
    .await?;
    Ok(())
}

pub(super) async fn open_holds(conn: &mut SqliteConnection, holds: &[OpenHold]) -> Result<()> {
    insert_rows(
        conn,
        "INSERT INTO open_holds (transfer_id, job_id, deadline_ms) VALUES ",
        "(?, ?, ?)",
        holds,
        |q, h| {
            q.bind(h.transfer_id.as_str())
                .bind(h.job_id.as_deref())
                .bind(h.deadline_ms)
        },
    )
    .await?;
    Ok(())
}

pub(super) async fn close_hold(conn: &mut SqliteConnection, transfer_id: &str) -> Result<()> {
    sqlx::query("DELETE FROM open_holds WHERE transfer_id = ?")
        .bind(transfer_id)
        .execute(&mut *conn)
        .await?;
    Ok(())
}

pub(super) async fn used_job_ids(
    conn: &mut SqliteConnection,
    ids: &[String],
) -> Result<HashSet<String>> {
    let list = serde_json::to_string(ids).map_err(|e| StoreError::Corrupt {
        id: "job ids".into(),
        what: format!("do not encode: {e}"),
    })?;
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

pub(super) async fn payers(
    conn: &mut SqliteConnection,
    accounts: &[&str],
) -> Result<HashMap<String, PayerBalance>> {
    let list = serde_json::to_string(accounts).map_err(|e| StoreError::Corrupt {
        id: "account ids".into(),
        what: format!("do not encode: {e}"),
    })?;
    let rows = sqlx::query(
        "SELECT id, no_overdraft, credits_posted - debits_posted - debits_pending AS available \
         FROM accounts WHERE id IN (SELECT value FROM json_each(?1))",
    )
    .bind(list)
    .fetch_all(&mut *conn)
    .await?;
    rows.iter().map(rows::payer).collect()
}

pub(super) async fn operator_of(
    conn: &mut SqliteConnection,
    node_id: &str,
) -> Result<Option<String>> {
    Ok(
        sqlx::query_scalar("SELECT account_id FROM node_operators WHERE node_id = ?")
            .bind(node_id)
            .fetch_optional(&mut *conn)
            .await?,
    )
}

pub(super) async fn link_operator(
    conn: &mut SqliteConnection,
    node_id: &str,
    account: &str,
    now_ms: i64,
) -> Result<()> {
    sqlx::query(
        "INSERT INTO node_operators (node_id, account_id, linked_at_ms) VALUES (?1, ?2, ?3) \
         ON CONFLICT (node_id) DO UPDATE SET account_id = ?2, linked_at_ms = ?3",
    )
    .bind(node_id)
    .bind(account)
    .bind(now_ms)
    .execute(&mut *conn)
    .await?;
    Ok(())
}

pub(super) async fn record_online(
    conn: &mut SqliteConnection,
    epoch: i64,
    node_id: &str,
    memory_bytes: u64,
    online_ms: u64,
) -> Result<()> {
    sqlx::query(
        "INSERT INTO availability (epoch, node_id, memory_bytes, online_ms) VALUES (?1, ?2, ?3, ?4) \
         ON CONFLICT (epoch, node_id) DO UPDATE SET online_ms = online_ms + ?4, \
         memory_bytes = MAX(memory_bytes, ?3)",
    )
    .bind(epoch)
    .bind(node_id)
    .bind(i64::try_from(memory_bytes).unwrap_or(i64::MAX))
    .bind(i64::try_from(online_ms).unwrap_or(i64::MAX))
    .execute(&mut *conn)
    .await?;
    Ok(())
}

pub(super) async fn unpaid_epochs(conn: &mut SqliteConnection, current: i64) -> Result<Vec<i64>> {
    Ok(sqlx::query_scalar(
        "SELECT DISTINCT a.epoch FROM availability a LEFT JOIN reward_epochs r ON r.epoch = a.epoch \
         WHERE a.epoch < ? AND r.epoch IS NULL ORDER BY a.epoch",
    )
    .bind(current)
    .fetch_all(&mut *conn)
    .await?)
}

pub(super) async fn epoch_paid(conn: &mut SqliteConnection, epoch: i64) -> Result<bool> {
    let paid: Option<i64> = sqlx::query_scalar("SELECT epoch FROM reward_epochs WHERE epoch = ?")
        .bind(epoch)
        .fetch_optional(&mut *conn)
        .await?;
    Ok(paid.is_some())
}

pub(super) async fn availability(
    conn: &mut SqliteConnection,
    epoch: i64,
) -> Result<Vec<Availability>> {
    let rows = sqlx::query(
        "SELECT node_id, memory_bytes, online_ms FROM availability WHERE epoch = ? ORDER BY node_id",
    )
    .bind(epoch)
    .fetch_all(&mut *conn)
    .await?;
    rows.iter().map(rows::availability).collect()
}

pub(super) async fn mark_epoch_paid(
    conn: &mut SqliteConnection,
    epoch: i64,
    paid_ms: i64,
    total: i64,
) -> Result<()> {
    sqlx::query("INSERT INTO reward_epochs (epoch, paid_ms, total) VALUES (?, ?, ?)")
        .bind(epoch)
        .bind(paid_ms)
        .bind(total)
        .execute(&mut *conn)
        .await?;
    Ok(())
}
