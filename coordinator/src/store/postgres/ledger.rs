//! The ledger's tables on PostgreSQL: the SQL of `store/sqlite/ledger.rs`
//! in PostgreSQL's dialect. Batches go as arrays (`UNNEST`, `= ANY`), one
//! statement each whatever their size; sums are cast back to `int8` (a
//! PostgreSQL `SUM` of `int8` is `numeric`).

use std::collections::{HashMap, HashSet};

use sqlx::PgConnection;

use super::super::{
    rows::{self, ACCOUNT_COLUMNS, TRANSFER_COLUMNS},
    Anomaly, OpenHold, PayerBalance, Result, Side,
};
use crate::domain::{Account, Availability, JobTerms, NodeEarnings, Totals, Transfer};

/// Inserts `a`; with `if_absent`, an existing id is left as it is.
pub(super) async fn insert_account(
    conn: &mut PgConnection,
    a: &Account,
    if_absent: bool,
) -> Result<()> {
    let tail = if if_absent {
        " ON CONFLICT (id) DO NOTHING"
    } else {
        ""
    };
    sqlx::query(&format!(
        "INSERT INTO accounts (id, name, kind, no_overdraft, created_at_ms) \
         VALUES ($1, $2, $3, $4, $5){tail}"
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

pub(super) async fn account(conn: &mut PgConnection, id: &str) -> Result<Option<Account>> {
    let row = sqlx::query(&format!(
        "SELECT {ACCOUNT_COLUMNS} FROM accounts WHERE id = $1"
    ))
    .bind(id)
    .fetch_optional(&mut *conn)
    .await?;
    row.as_ref().map(rows::account).transpose()
}

pub(super) async fn transfer(conn: &mut PgConnection, id: &str) -> Result<Option<Transfer>> {
    let row = sqlx::query(&format!(
        "SELECT {TRANSFER_COLUMNS} FROM transfers WHERE id = $1"
    ))
    .bind(id)
    .fetch_optional(&mut *conn)
    .await?;
    row.as_ref().map(rows::transfer).transpose()
}

pub(super) async fn history(
    conn: &mut PgConnection,
    account: &str,
    limit: u32,
) -> Result<Vec<Transfer>> {
    let rows = sqlx::query(&format!(
        "SELECT {TRANSFER_COLUMNS} FROM transfers WHERE debit_account = $1 OR credit_account = $1 \
         ORDER BY created_at_ms DESC, seq DESC LIMIT $2"
    ))
    .bind(account)
    .bind(i64::from(limit))
    .fetch_all(&mut *conn)
    .await?;
    rows.iter().map(rows::transfer).collect()
}

pub(super) async fn job_transfers(conn: &mut PgConnection, job: &str) -> Result<Vec<Transfer>> {
    let rows = sqlx::query(&format!(
        "SELECT {TRANSFER_COLUMNS} FROM transfers WHERE job_id = $1 ORDER BY seq"
    ))
    .bind(job)
    .fetch_all(&mut *conn)
    .await?;
    rows.iter().map(rows::transfer).collect()
}

pub(super) async fn earnings(
    conn: &mut PgConnection,
    account: &str,
    since_ms: i64,
) -> Result<Vec<NodeEarnings>> {
    let rows = sqlx::query(
        "SELECT COALESCE(node_id, '') AS node_id, SUM(amount)::int8 AS micro_mlx, \
         COUNT(DISTINCT job_id) AS jobs, SUM(tokens)::int8 AS tokens FROM transfers \
         WHERE credit_account = $1 AND memo IN ('payout', 'reward') AND created_at_ms >= $2 \
         GROUP BY node_id ORDER BY 1",
    )
    .bind(account)
    .bind(since_ms)
    .fetch_all(&mut *conn)
    .await?;
    rows.iter().map(rows::earnings).collect()
}

pub(super) async fn jobs_of(
    conn: &mut PgConnection,
    account: &str,
    limit: u32,
) -> Result<Vec<String>> {
    Ok(sqlx::query_scalar(
        "SELECT job_id FROM job_holds WHERE account_id = $1 ORDER BY seq DESC LIMIT $2",
    )
    .bind(account)
    .bind(i64::from(limit))
    .fetch_all(&mut *conn)
    .await?)
}

pub(super) async fn nodes_of(conn: &mut PgConnection, account: &str) -> Result<Vec<String>> {
    Ok(sqlx::query_scalar(
        "SELECT node_id FROM node_operators WHERE account_id = $1 ORDER BY node_id",
    )
    .bind(account)
    .fetch_all(&mut *conn)
    .await?)
}

pub(super) async fn totals(conn: &mut PgConnection) -> Result<Totals> {
    let (posted, pending, open_holds): (i64, i64, i64) = sqlx::query_as(
        "SELECT COALESCE(SUM(credits_posted - debits_posted), 0)::int8, \
         COALESCE(SUM(credits_pending - debits_pending), 0)::int8, \
         (SELECT COUNT(*) FROM open_holds) FROM accounts",
    )
    .fetch_one(&mut *conn)
    .await?;
    Ok(Totals {
        posted,
        pending,
        open_holds,
    })
}

pub(super) async fn balance_mismatches(conn: &mut PgConnection) -> Result<Vec<String>> {
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

/// Which of a check's parameters its SQL takes (PostgreSQL refuses a bind
/// its statement does not use).
enum Params {
    None,
    Now,
    NowAndWindow,
}

pub(super) async fn anomalies(
    conn: &mut PgConnection,
    now_ms: i64,
    audit_window_ms: i64,
) -> Result<Vec<(Anomaly, String)>> {
    let checks: [(Anomaly, Params, &str); 6] = [
        (
            Anomaly::ResolvedTwice,
            Params::None,
            "SELECT pending_id FROM transfers WHERE pending_id IS NOT NULL \
             GROUP BY pending_id HAVING COUNT(*) > 1",
        ),
        (
            Anomaly::OpenPastDeadline,
            Params::Now,
            "SELECT transfer_id FROM open_holds WHERE deadline_ms < $1",
        ),
        (
            Anomaly::EndedWithHoldOpen,
            Params::NowAndWindow,
            "SELECT h.job_id FROM open_holds h JOIN jobs j ON j.id = h.job_id \
             WHERE j.state IN ('failed', 'cancelled') OR (j.state = 'completed' \
             AND ($2::int8 = 0 OR j.updated_at_ms + $2::int8 < $1::int8))",
        ),
        (
            Anomaly::PaidMismatch,
            Params::None,
            "SELECT p.job_id FROM transfers p WHERE p.kind = 'post_pending' AND p.amount <> \
             (SELECT COALESCE(SUM(x.amount), 0) FROM transfers x \
              WHERE x.job_id = p.job_id AND x.memo IN ('payout', 'fee'))",
        ),
        (
            Anomaly::FailedAuditPaid,
            Params::None,
            "SELECT DISTINCT x.job_id FROM transfers x JOIN audits a ON a.job_id = x.job_id \
             WHERE x.memo = 'payout' AND a.state = 'failed' AND x.created_at_ms >= a.ended_at_ms",
        ),
        (
            Anomaly::EndedPaid,
            Params::None,
            "SELECT DISTINCT x.job_id FROM transfers x JOIN jobs j ON j.id = x.job_id \
             WHERE x.memo = 'payout' AND j.state IN ('failed', 'cancelled')",
        ),
    ];
    let mut out = Vec::new();
    for (what, params, sql) in checks {
        let query = sqlx::query_scalar::<_, String>(sql);
        let query = match params {
            Params::None => query,
            Params::Now => query.bind(now_ms),
            Params::NowAndWindow => query.bind(now_ms).bind(audit_window_ms),
        };
        let ids = query.fetch_all(&mut *conn).await?;
        out.extend(ids.into_iter().map(|id| (what, id)));
    }
    Ok(out)
}

pub(super) async fn due_holds(
    conn: &mut PgConnection,
    now_ms: i64,
    limit: u32,
) -> Result<Vec<String>> {
    Ok(sqlx::query_scalar(
        "SELECT job_id FROM open_holds WHERE deadline_ms < $1 AND job_id IS NOT NULL \
         ORDER BY deadline_ms LIMIT $2",
    )
    .bind(now_ms)
    .bind(i64::from(limit))
    .fetch_all(&mut *conn)
    .await?)
}

pub(super) async fn unsettled_jobs(
    conn: &mut PgConnection,
    now_ms: i64,
    audit_window_ms: i64,
    limit: u32,
) -> Result<Vec<String>> {
    Ok(sqlx::query_scalar(
        "SELECT h.job_id FROM open_holds h LEFT JOIN jobs j ON j.id = h.job_id \
         WHERE h.job_id IS NOT NULL AND (j.id IS NULL OR j.state IN ('failed', 'cancelled') \
         OR (j.state = 'completed' AND ($1::int8 = 0 OR j.updated_at_ms + $1::int8 <= $2::int8 \
           OR EXISTS (SELECT 1 FROM audits a WHERE a.job_id = j.id AND a.state = 'failed')))) \
         LIMIT $3",
    )
    .bind(audit_window_ms)
    .bind(now_ms)
    .bind(i64::from(limit))
    .fetch_all(&mut *conn)
    .await?)
}

pub(super) async fn job_terms(conn: &mut PgConnection, job: &str) -> Result<Option<JobTerms>> {
    let row = sqlx::query(
        "SELECT account_id, input_per_mtok, output_per_mtok, max_price FROM job_holds \
         WHERE job_id = $1",
    )
    .bind(job)
    .fetch_optional(&mut *conn)
    .await?;
    row.as_ref().map(rows::terms).transpose()
}

pub(super) async fn insert_terms(
    conn: &mut PgConnection,
    terms: &[(&str, &JobTerms)],
) -> Result<()> {
    if terms.is_empty() {
        return Ok(());
    }
    let micro = |v: u64| i64::try_from(v).unwrap_or(i64::MAX);
    sqlx::query(
        "INSERT INTO job_holds (job_id, account_id, input_per_mtok, output_per_mtok, max_price) \
         SELECT j, a, i, o, m FROM UNNEST($1::text[], $2::text[], $3::int8[], $4::int8[], \
           $5::int8[]) WITH ORDINALITY AS x (j, a, i, o, m, n) ORDER BY n",
    )
    .bind(terms.iter().map(|(j, _)| *j).collect::<Vec<_>>())
    .bind(
        terms
            .iter()
            .map(|(_, t)| t.account.as_str())
            .collect::<Vec<_>>(),
    )
    .bind(
        terms
            .iter()
            .map(|(_, t)| micro(t.price.input_per_mtok))
            .collect::<Vec<_>>(),
    )
    .bind(
        terms
            .iter()
            .map(|(_, t)| micro(t.price.output_per_mtok))
            .collect::<Vec<_>>(),
    )
    .bind(terms.iter().map(|(_, t)| t.max_price).collect::<Vec<_>>())
    .execute(&mut *conn)
    .await?;
    Ok(())
}

pub(super) async fn hold_deadline(
    conn: &mut PgConnection,
    transfer_id: &str,
) -> Result<Option<i64>> {
    Ok(
        sqlx::query_scalar("SELECT deadline_ms FROM open_holds WHERE transfer_id = $1")
            .bind(transfer_id)
            .fetch_optional(&mut *conn)
            .await?,
    )
}

pub(super) async fn add_debit(
    conn: &mut PgConnection,
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
        "UPDATE accounts SET {col} = {col} + $1 WHERE id = $2 \
         AND (no_overdraft = 0 OR credits_posted - debits_posted - debits_pending >= $1)"
    ))
    .bind(amount)
    .bind(account)
    .execute(&mut *conn)
    .await?
    .rows_affected();
    Ok(n == 1)
}

pub(super) async fn add_credit(
    conn: &mut PgConnection,
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
        "UPDATE accounts SET {col} = {col} + $1 WHERE id = $2"
    ))
    .bind(amount)
    .bind(account)
    .execute(&mut *conn)
    .await?
    .rows_affected();
    Ok(n == 1)
}

pub(super) async fn resolve_pending(
    conn: &mut PgConnection,
    account: &str,
    side: Side,
    pending: i64,
    posted: i64,
) -> Result<bool> {
    let sql = match side {
        Side::Debit => {
            "UPDATE accounts SET debits_pending = debits_pending - $1, debits_posted = debits_posted + $2 \
             WHERE id = $3 AND debits_pending >= $1"
        }
        Side::Credit => {
            "UPDATE accounts SET credits_pending = credits_pending - $1, credits_posted = credits_posted + $2 \
             WHERE id = $3 AND credits_pending >= $1"
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

pub(super) async fn insert_transfers(conn: &mut PgConnection, ts: &[Transfer]) -> Result<()> {
    if ts.is_empty() {
        return Ok(());
    }
    let text = |f: fn(&Transfer) -> &str| ts.iter().map(f).collect::<Vec<_>>();
    let opt = |f: fn(&Transfer) -> Option<&str>| ts.iter().map(f).collect::<Vec<_>>();
    let int = |f: fn(&Transfer) -> i64| ts.iter().map(f).collect::<Vec<_>>();
    sqlx::query(&format!(
        "INSERT INTO transfers ({TRANSFER_COLUMNS}) SELECT {TRANSFER_COLUMNS} \
         FROM UNNEST($1::text[], $2::text[], $3::text[], $4::text[], $5::int8[], \
           $6::text[], $7::int8[], $8::text[], $9::text[], $10::int8[], $11::text[], $12::int8[]) \
           WITH ORDINALITY AS x ({TRANSFER_COLUMNS}, n) ORDER BY n"
    ))
    .bind(text(|t| t.id.as_str()))
    .bind(text(|t| t.kind.as_str()))
    .bind(text(|t| t.debit.as_str()))
    .bind(text(|t| t.credit.as_str()))
    .bind(int(|t| t.amount))
    .bind(opt(|t| t.pending_id.as_deref()))
    .bind(ts.iter().map(|t| t.deadline_ms).collect::<Vec<_>>())
    .bind(opt(|t| t.job_id.as_deref()))
    .bind(opt(|t| t.node_id.as_deref()))
    .bind(int(|t| t.tokens))
    .bind(text(|t| t.memo.as_str()))
    .bind(int(|t| t.created_at_ms))
    .execute(&mut *conn)
    .await?;
    Ok(())
}

pub(super) async fn open_holds(conn: &mut PgConnection, holds: &[OpenHold]) -> Result<()> {
    if holds.is_empty() {
        return Ok(());
    }
    sqlx::query(
        "INSERT INTO open_holds (transfer_id, job_id, deadline_ms) \
         SELECT * FROM UNNEST($1::text[], $2::text[], $3::int8[])",
    )
    .bind(
        holds
            .iter()
            .map(|h| h.transfer_id.as_str())
            .collect::<Vec<_>>(),
    )
    .bind(
        holds
            .iter()
            .map(|h| h.job_id.as_deref())
            .collect::<Vec<_>>(),
    )
    .bind(holds.iter().map(|h| h.deadline_ms).collect::<Vec<_>>())
    .execute(&mut *conn)
    .await?;
    Ok(())
}

pub(super) async fn close_hold(conn: &mut PgConnection, transfer_id: &str) -> Result<()> {
    sqlx::query("DELETE FROM open_holds WHERE transfer_id = $1")
        .bind(transfer_id)
        .execute(&mut *conn)
        .await?;
    Ok(())
}

pub(super) async fn used_job_ids(
    conn: &mut PgConnection,
    ids: &[String],
) -> Result<HashSet<String>> {
    let used: Vec<String> = sqlx::query_scalar(
        "SELECT v FROM UNNEST($1::text[]) AS v WHERE EXISTS (SELECT 1 FROM jobs WHERE id = v) \
         OR EXISTS (SELECT 1 FROM job_holds WHERE job_id = v) \
         OR EXISTS (SELECT 1 FROM transfers WHERE id = 'job:' || v || ':hold')",
    )
    .bind(ids)
    .fetch_all(&mut *conn)
    .await?;
    Ok(used.into_iter().collect())
}

pub(super) async fn payers(
    conn: &mut PgConnection,
    accounts: &[&str],
) -> Result<HashMap<String, PayerBalance>> {
    let rows = sqlx::query(
        "SELECT id, no_overdraft, credits_posted - debits_posted - debits_pending AS available \
         FROM accounts WHERE id = ANY($1)",
    )
    .bind(accounts)
    .fetch_all(&mut *conn)
    .await?;
    rows.iter().map(rows::payer).collect()
}

pub(super) async fn operator_of(conn: &mut PgConnection, node_id: &str) -> Result<Option<String>> {
    Ok(
        sqlx::query_scalar("SELECT account_id FROM node_operators WHERE node_id = $1")
            .bind(node_id)
            .fetch_optional(&mut *conn)
            .await?,
    )
}

pub(super) async fn link_operator(
    conn: &mut PgConnection,
    node_id: &str,
    account: &str,
    now_ms: i64,
) -> Result<()> {
    sqlx::query(
        "INSERT INTO node_operators (node_id, account_id, linked_at_ms) VALUES ($1, $2, $3) \
         ON CONFLICT (node_id) DO UPDATE SET account_id = $2, linked_at_ms = $3",
    )
    .bind(node_id)
    .bind(account)
    .bind(now_ms)
    .execute(&mut *conn)
    .await?;
    Ok(())
}

pub(super) async fn record_online(
    conn: &mut PgConnection,
    epoch: i64,
    node_id: &str,
    memory_bytes: u64,
    online_ms: u64,
) -> Result<()> {
    sqlx::query(
        "INSERT INTO availability (epoch, node_id, memory_bytes, online_ms) VALUES ($1, $2, $3, $4) \
         ON CONFLICT (epoch, node_id) DO UPDATE SET online_ms = availability.online_ms + $4, \
         memory_bytes = GREATEST(availability.memory_bytes, $3)",
    )
    .bind(epoch)
    .bind(node_id)
    .bind(i64::try_from(memory_bytes).unwrap_or(i64::MAX))
    .bind(i64::try_from(online_ms).unwrap_or(i64::MAX))
    .execute(&mut *conn)
    .await?;
    Ok(())
}

pub(super) async fn unpaid_epochs(conn: &mut PgConnection, current: i64) -> Result<Vec<i64>> {
    Ok(sqlx::query_scalar(
        "SELECT DISTINCT a.epoch FROM availability a LEFT JOIN reward_epochs r ON r.epoch = a.epoch \
         WHERE a.epoch < $1 AND r.epoch IS NULL ORDER BY a.epoch",
    )
    .bind(current)
    .fetch_all(&mut *conn)
    .await?)
}

pub(super) async fn epoch_paid(conn: &mut PgConnection, epoch: i64) -> Result<bool> {
    let paid: Option<i64> = sqlx::query_scalar("SELECT epoch FROM reward_epochs WHERE epoch = $1")
        .bind(epoch)
        .fetch_optional(&mut *conn)
        .await?;
    Ok(paid.is_some())
}

pub(super) async fn availability(conn: &mut PgConnection, epoch: i64) -> Result<Vec<Availability>> {
    let rows = sqlx::query(
        "SELECT node_id, memory_bytes, online_ms FROM availability WHERE epoch = $1 ORDER BY node_id",
    )
    .bind(epoch)
    .fetch_all(&mut *conn)
    .await?;
    rows.iter().map(rows::availability).collect()
}

pub(super) async fn mark_epoch_paid(
    conn: &mut PgConnection,
    epoch: i64,
    paid_ms: i64,
    total: i64,
) -> Result<()> {
    sqlx::query("INSERT INTO reward_epochs (epoch, paid_ms, total) VALUES ($1, $2, $3)")
        .bind(epoch)
        .bind(paid_ms)
        .bind(total)
        .execute(&mut *conn)
        .await?;
    Ok(())
}
