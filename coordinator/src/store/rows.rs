//! Rows to domain values, written once for every backend: each backend's
//! SQL selects the same column names, and [`Columns`] reads them from any
//! sqlx row (SQLite's or PostgreSQL's).
//!
//! # Failure
//! A column that is missing or of another type is a database error; a
//! value that does not decode (a prost blob, an unknown state or kind) is
//! [`StoreError::Corrupt`] naming the row.

use mlxnet_proto::{
    ids::JobId,
    v1::{JobInput, ResultClaim, SamplingParams, SignedClaim},
};
use prost::Message;

use super::{PayerBalance, Result, StoreError};
use crate::domain::{
    Account, AccountKind, AuditRecord, Availability, Caller, JobRecord, JobState, JobTerms,
    KeyInfo, KeyLimits, NodeEarnings, NodeRecord, Price, Scopes, Segment, StoredKey, Transfer,
    TransferKind,
};

/// The columns every backend's job queries select, in this order.
pub(super) const JOB_COLUMNS: &str = "id, model, input, sampling, state, attempt, node_id, \
     output_text, completion_tokens, claim, signature, error, created_at_ms, updated_at_ms, priority";

pub(super) const ACCOUNT_COLUMNS: &str = "id, name, kind, no_overdraft, debits_pending, \
     debits_posted, credits_pending, credits_posted, created_at_ms";

pub(super) const TRANSFER_COLUMNS: &str = "id, kind, debit_account, credit_account, amount, \
     pending_id, deadline_ms, job_id, node_id, tokens, memo, created_at_ms";

/// The values a row holds, by column name: the types every schema uses
/// (integers are 64-bit).
pub(super) trait Columns {
    fn text(&self, col: &str) -> Result<String>;
    fn opt_text(&self, col: &str) -> Result<Option<String>>;
    fn int(&self, col: &str) -> Result<i64>;
    fn opt_int(&self, col: &str) -> Result<Option<i64>>;
    fn bytes(&self, col: &str) -> Result<Vec<u8>>;
    fn opt_bytes(&self, col: &str) -> Result<Option<Vec<u8>>>;
}

impl<R> Columns for R
where
    R: sqlx::Row,
    for<'a> &'a str: sqlx::ColumnIndex<R>,
    for<'r> String: sqlx::Decode<'r, R::Database> + sqlx::Type<R::Database>,
    for<'r> i64: sqlx::Decode<'r, R::Database> + sqlx::Type<R::Database>,
    for<'r> Vec<u8>: sqlx::Decode<'r, R::Database> + sqlx::Type<R::Database>,
{
    fn text(&self, col: &str) -> Result<String> {
        Ok(self.try_get(col)?)
    }
    fn opt_text(&self, col: &str) -> Result<Option<String>> {
        Ok(self.try_get(col)?)
    }
    fn int(&self, col: &str) -> Result<i64> {
        Ok(self.try_get(col)?)
    }
    fn opt_int(&self, col: &str) -> Result<Option<i64>> {
        Ok(self.try_get(col)?)
    }
    fn bytes(&self, col: &str) -> Result<Vec<u8>> {
        Ok(self.try_get(col)?)
    }
    fn opt_bytes(&self, col: &str) -> Result<Option<Vec<u8>>> {
        Ok(self.try_get(col)?)
    }
}

fn corrupt(id: &str, what: String) -> StoreError {
    StoreError::Corrupt {
        id: id.to_owned(),
        what,
    }
}

pub(super) fn parse_state(id: &str, s: &str) -> Result<JobState> {
    s.parse()
        .map_err(|_| corrupt(id, format!("unknown state {s:?}")))
}

fn claim(id: &str, what: &str, bytes: &[u8]) -> Result<ResultClaim> {
    ResultClaim::decode(bytes).map_err(|e| corrupt(id, format!("{what}: {e}")))
}

/// A row of [`JOB_COLUMNS`].
pub(super) fn job(row: &impl Columns) -> Result<JobRecord> {
    let id_text = row.text("id")?;
    let id: JobId = id_text
        .parse()
        .map_err(|e| corrupt(&id_text, format!("{e}")))?;
    let result = match (row.opt_bytes("claim")?, row.opt_bytes("signature")?) {
        (Some(c), Some(signature)) => Some(SignedClaim {
            claim: Some(claim(&id_text, "claim", &c)?),
            signature,
        }),
        _ => None,
    };
    Ok(JobRecord {
        id,
        model: row.text("model")?,
        input: JobInput::decode(row.bytes("input")?.as_slice())
            .map_err(|e| corrupt(&id_text, format!("input: {e}")))?,
        sampling: SamplingParams::decode(row.bytes("sampling")?.as_slice())
            .map_err(|e| corrupt(&id_text, format!("sampling: {e}")))?,
        state: parse_state(&id_text, &row.text("state")?)?,
        priority: row.int("priority")?.clamp(0, 3) as u8,
        attempt: row.int("attempt")? as u32,
        node_id: row.opt_text("node_id")?,
        output_text: row.text("output_text")?,
        completion_tokens: row.int("completion_tokens")? as u32,
        result,
        error: row.opt_text("error")?,
        created_at_ms: row.int("created_at_ms")?,
        updated_at_ms: row.int("updated_at_ms")?,
    })
}

/// A segment of `job`: `attempt, node_id, first_index, token_ids, text,
/// claim, signature`.
pub(super) fn segment(job: &str, row: &impl Columns) -> Result<Segment> {
    let claim = match row.opt_bytes("claim")? {
        Some(bytes) => Some(SignedClaim {
            claim: Some(claim(job, "segment claim", &bytes)?),
            signature: row.opt_bytes("signature")?.unwrap_or_default(),
        }),
        None => None,
    };
    Ok(Segment {
        attempt: row.int("attempt")? as u32,
        node_id: row.text("node_id")?,
        first_index: row.int("first_index")? as u32,
        token_ids: decode_ids(&row.bytes("token_ids")?)
            .ok_or_else(|| corrupt(job, "segment token ids".into()))?,
        text: row.text("text")?,
        claim,
    })
}

/// Token ids as stored: each a little-endian u32.
pub(super) fn encode_ids(ids: &[u32]) -> Vec<u8> {
    ids.iter().flat_map(|t| t.to_le_bytes()).collect()
}

fn decode_ids(bytes: &[u8]) -> Option<Vec<u32>> {
    if !bytes.len().is_multiple_of(4) {
        return None;
    }
    Some(
        bytes
            .chunks_exact(4)
            .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect(),
    )
}

/// A row of [`ACCOUNT_COLUMNS`].
pub(super) fn account(row: &impl Columns) -> Result<Account> {
    let id = row.text("id")?;
    let kind = row.text("kind")?;
    Ok(Account {
        kind: AccountKind::parse(&kind).ok_or_else(|| {
            corrupt(
                &format!("account {id}"),
                format!("unknown account kind {kind:?}"),
            )
        })?,
        id,
        name: row.text("name")?,
        no_overdraft: row.int("no_overdraft")? != 0,
        debits_pending: row.int("debits_pending")?,
        debits_posted: row.int("debits_posted")?,
        credits_pending: row.int("credits_pending")?,
        credits_posted: row.int("credits_posted")?,
        created_at_ms: row.int("created_at_ms")?,
    })
}

/// A row of [`TRANSFER_COLUMNS`].
pub(super) fn transfer(row: &impl Columns) -> Result<Transfer> {
    let id = row.text("id")?;
    let kind = row.text("kind")?;
    Ok(Transfer {
        kind: TransferKind::parse(&kind).ok_or_else(|| {
            corrupt(
                &format!("transfer {id}"),
                format!("unknown transfer kind {kind:?}"),
            )
        })?,
        id,
        debit: row.text("debit_account")?,
        credit: row.text("credit_account")?,
        amount: row.int("amount")?,
        pending_id: row.opt_text("pending_id")?,
        deadline_ms: row.opt_int("deadline_ms")?,
        job_id: row.opt_text("job_id")?,
        node_id: row.opt_text("node_id")?,
        tokens: row.int("tokens")?,
        memo: row.text("memo")?,
        created_at_ms: row.int("created_at_ms")?,
    })
}

/// `node_id, micro_mlx, jobs, tokens`.
pub(super) fn earnings(row: &impl Columns) -> Result<NodeEarnings> {
    Ok(NodeEarnings {
        node_id: row.text("node_id")?,
        micro_mlx: row.int("micro_mlx")?,
        jobs: row.int("jobs")?,
        tokens: row.int("tokens")?,
    })
}

/// `account_id, input_per_mtok, output_per_mtok, max_price`.
pub(super) fn terms(row: &impl Columns) -> Result<JobTerms> {
    Ok(JobTerms {
        account: row.text("account_id")?,
        price: Price {
            input_per_mtok: row.int("input_per_mtok")?.max(0) as u64,
            output_per_mtok: row.int("output_per_mtok")?.max(0) as u64,
        },
        max_price: row.int("max_price")?,
    })
}

/// `id, no_overdraft, available`.
pub(super) fn payer(row: &impl Columns) -> Result<(String, PayerBalance)> {
    Ok((
        row.text("id")?,
        PayerBalance {
            no_overdraft: row.int("no_overdraft")? != 0,
            available: row.int("available")?,
        },
    ))
}

/// `node_id, memory_bytes, online_ms`.
pub(super) fn availability(row: &impl Columns) -> Result<Availability> {
    Ok(Availability {
        node_id: row.text("node_id")?,
        memory_bytes: row.int("memory_bytes")?.max(0) as u64,
        online_ms: row.int("online_ms")?.max(0) as u64,
    })
}

/// `id, name, hardware, models, version, status`.
pub(super) fn node(row: &impl Columns) -> Result<(NodeRecord, String)> {
    Ok((
        NodeRecord {
            id: row.text("id")?,
            name: row.text("name")?,
            hardware: row.text("hardware")?,
            models: row.text("models")?,
            version: row.text("version")?,
            slots: u32::try_from(row.int("slots")?).unwrap_or(0),
        },
        row.text("status")?,
    ))
}

/// [`RECORD_COLUMNS`], or a node with no record yet.
pub(super) fn audit_record(row: Option<&impl Columns>) -> Result<AuditRecord> {
    let Some(r) = row else {
        return Ok(AuditRecord::default());
    };
    let count =
        |col: &str| -> Result<u32> { Ok(u32::try_from(r.int(col)?.max(0)).unwrap_or(u32::MAX)) };
    Ok(AuditRecord {
        clean: count("clean_audits")?,
        failed: count("failed_audits")?,
        banned: r.opt_int("banned_at_ms")?.is_some(),
        jobs: count("jobs_done")?,
        failed_attempts: count("failed_attempts")?,
        wrong_verdicts: count("wrong_verdicts")?,
    })
}

/// `node_id` and [`RECORD_COLUMNS`]: one row of the list of every node's
/// record.
pub(super) fn node_audit_record(row: &impl Columns) -> Result<(String, AuditRecord)> {
    Ok((row.text("node_id")?, audit_record(Some(row))?))
}

/// The `node_records` columns [`audit_record`] reads.
pub(super) const RECORD_COLUMNS: &str =
    "clean_audits, failed_audits, banned_at_ms, jobs_done, failed_attempts, wrong_verdicts";

fn scopes(key: &str, text: &str) -> Result<Scopes> {
    Scopes::from_text(text).map_err(|e| corrupt(&format!("key {key}"), e.to_string()))
}

fn limit(v: Option<i64>) -> Option<u32> {
    v.map(|n| u32::try_from(n.max(0)).unwrap_or(u32::MAX))
}

/// `id, account_id, scopes, expires_at_ms, max_requests_per_sec, max_in_flight`.
pub(super) fn stored_key(r: &impl Columns) -> Result<StoredKey> {
    let id = r.text("id")?;
    Ok(StoredKey {
        caller: Caller {
            account_id: r.text("account_id")?,
            scopes: scopes(&id, &r.text("scopes")?)?,
            limits: KeyLimits {
                requests_per_sec: limit(r.opt_int("max_requests_per_sec")?),
                max_in_flight: limit(r.opt_int("max_in_flight")?),
            },
            key_id: id,
            expires_at_ms: r.opt_int("expires_at_ms")?,
        },
        expires_at_ms: r.opt_int("expires_at_ms")?,
    })
}

/// `id, account_id, scopes, label, created_at_ms, expires_at_ms, revoked_at_ms`.
pub(super) fn key_info(r: &impl Columns) -> Result<KeyInfo> {
    let id = r.text("id")?;
    Ok(KeyInfo {
        scopes: scopes(&id, &r.text("scopes")?)?,
        id,
        account_id: r.text("account_id")?,
        label: r.text("label")?,
        created_at_ms: r.int("created_at_ms")?,
        expires_at_ms: r.opt_int("expires_at_ms")?,
        revoked_at_ms: r.opt_int("revoked_at_ms")?,
    })
}
