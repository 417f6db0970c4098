//! API keys: how clients and operators prove which account they act for.
//!
//! A key is `mlxk_` followed by 64 hex digits of 32 bytes from the OS
//! random generator. It is shown once, when created; the database keeps only
//! its SHA-256. A fast hash is enough here (unlike passwords, which need a
//! slow one) because the key has 256 bits of entropy: a leaked hash cannot
//! be reversed by guessing, and a fast hash keeps each request's check cheap.
//! Each key has a public id (`key_<hex>`, used to list and revoke it) that
//! is unrelated to its secret.
//!
//! Lookups go through a small cache (hash → caller), so a busy key costs no
//! query per request. Only keys that were valid are cached, for at most
//! [`KEY_CACHE_TTL`] and never past their expiry; revoking a key or changing
//! its limits through this ledger drops its entry at once (a revoke by
//! another process, e.g. a second coordinator on the same database, is seen
//! within the TTL).
//!
//! # Invariants
//! - A database dump holds no usable key: only hashes and public ids.
//! - An unknown, revoked or expired key all read as "no caller": the API
//!   answers each with the same status and message, and each asks the
//!   database (none of them is cached).
//! - The secret never appears in `Debug` output or logs.
//!
//! # Failure
//! [`LedgerError`] for database errors and unknown accounts or scopes.

use std::{
    collections::HashMap,
    fmt,
    sync::Mutex,
    time::{Duration, Instant},
};

use sha2::{Digest, Sha256};
use sqlx::Row;

use super::{AccountKind, Ledger, LedgerError};
pub use crate::domain::{Caller, KeyInfo, KeyLimits, Scope, Scopes};

/// Prefix of every API key.
pub const KEY_PREFIX: &str = "mlxk_";

/// A key as created: the only time its secret exists outside the caller.
pub struct IssuedKey {
    pub id: String,
    pub account_id: String,
    pub scopes: Scopes,
    pub expires_at_ms: Option<i64>,
    secret: String,
}

impl IssuedKey {
    /// The key to give the user (once).
    pub fn secret(&self) -> &str {
        &self.secret
    }
}

impl fmt::Debug for IssuedKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("IssuedKey")
            .field("id", &self.id)
            .field("account_id", &self.account_id)
            .field("scopes", &self.scopes)
            .field("secret", &"<redacted>")
            .finish()
    }
}

/// Longest a cached key lookup is trusted.
pub const KEY_CACHE_TTL: Duration = Duration::from_secs(10);
/// Most keys cached at once (the cache is cleared when full).
const KEY_CACHE_MAX: usize = 10_000;

/// Valid keys recently seen, by hash (see the module docs).
#[derive(Debug, Default)]
pub(crate) struct KeyCache {
    entries: Mutex<HashMap<[u8; 32], Cached>>,
}

#[derive(Debug)]
struct Cached {
    caller: Caller,
    expires_at_ms: Option<i64>,
    fetched: Instant,
}

impl KeyCache {
    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<[u8; 32], Cached>> {
        self.entries.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn get(&self, hash: &[u8; 32], now_ms: i64) -> Option<Caller> {
        let mut entries = self.lock();
        let hit = entries.get(hash)?;
        if hit.fetched.elapsed() < KEY_CACHE_TTL && hit.expires_at_ms.is_none_or(|e| e > now_ms) {
            return Some(hit.caller.clone());
        }
        entries.remove(hash);
        None
    }

    fn put(&self, hash: [u8; 32], caller: Caller, expires_at_ms: Option<i64>) {
        let mut entries = self.lock();
        if entries.len() >= KEY_CACHE_MAX {
            entries.clear();
        }
        entries.insert(
            hash,
            Cached {
                caller,
                expires_at_ms,
                fetched: Instant::now(),
            },
        );
    }

    /// Drops the entry of key `key_id` (revoked or changed).
    fn forget(&self, key_id: &str) {
        self.lock().retain(|_, c| c.caller.key_id != key_id);
    }
}

fn limit_from_db(v: Option<i64>) -> Option<u32> {
    v.map(|n| u32::try_from(n.max(0)).unwrap_or(u32::MAX))
}

fn hash(key: &str) -> [u8; 32] {
    Sha256::digest(key.as_bytes()).into()
}

impl Ledger {
    /// Creates a key for `account`. Its secret is in the result and nowhere else.
    pub async fn create_key(
        &self,
        account: &str,
        scopes: Scopes,
        label: &str,
        expires_at_ms: Option<i64>,
    ) -> Result<IssuedKey, LedgerError> {
        if scopes == Scopes::default() {
            return Err(LedgerError::Invalid("a key needs at least one scope"));
        }
        if label.len() > 64 {
            return Err(LedgerError::Invalid("a key label is at most 64 bytes"));
        }
        match self.account(account).await? {
            Some(a) if matches!(a.kind, AccountKind::Client | AccountKind::Operator) => {}
            _ => return Err(LedgerError::NoSuchAccount(account.to_owned())),
        }
        let mut secret_bytes = [0u8; 32];
        rand::RngCore::fill_bytes(&mut rand::rngs::OsRng, &mut secret_bytes);
        let secret = format!("{KEY_PREFIX}{}", hex::encode(secret_bytes));
        let id = format!("key_{}", hex::encode(rand::random::<[u8; 6]>()));
        sqlx::query(
            "INSERT INTO api_keys (id, account_id, hash, scopes, label, created_at_ms, expires_at_ms) \
             VALUES (?, ?, ?, ?, ?, ?, ?)",
        )
        .bind(&id)
        .bind(account)
        .bind(hash(&secret).to_vec())
        .bind(scopes.names().join(","))
        .bind(label)
        .bind(crate::util::now_ms())
        .bind(expires_at_ms)
        .execute(self.pool())
        .await?;
        Ok(IssuedKey {
            id,
            account_id: account.to_owned(),
            scopes,
            expires_at_ms,
            secret,
        })
    }

    /// The caller `presented` stands for, or `None` if the key is unknown,
    /// revoked or expired (deliberately indistinguishable).
    pub async fn authenticate(
        &self,
        presented: &str,
        now_ms: i64,
    ) -> Result<Option<Caller>, LedgerError> {
        if !presented.starts_with(KEY_PREFIX) || presented.len() > 128 {
            return Ok(None);
        }
        let digest = hash(presented);
        if let Some(caller) = self.key_cache().get(&digest, now_ms) {
            return Ok(Some(caller));
        }
        let row = sqlx::query(
            "SELECT id, account_id, scopes, expires_at_ms, max_requests_per_sec, max_in_flight \
             FROM api_keys WHERE hash = ? AND revoked_at_ms IS NULL \
             AND (expires_at_ms IS NULL OR expires_at_ms > ?)",
        )
        .bind(digest.to_vec())
        .bind(now_ms)
        .fetch_optional(self.pool())
        .await?;
        let Some(r) = row else { return Ok(None) };
        let scopes: String = r.try_get("scopes")?;
        let caller = Caller {
            account_id: r.try_get("account_id")?,
            key_id: r.try_get("id")?,
            scopes: Scopes::from_text(&scopes)?,
            limits: KeyLimits {
                requests_per_sec: limit_from_db(r.try_get("max_requests_per_sec")?),
                max_in_flight: limit_from_db(r.try_get("max_in_flight")?),
            },
        };
        self.key_cache()
            .put(digest, caller.clone(), r.try_get("expires_at_ms")?);
        Ok(Some(caller))
    }

    /// Sets key `key_id`'s own abuse limits (`None`: the coordinator's
    /// default; 0: unlimited). False if there is no such key.
    pub async fn set_key_limits(
        &self,
        key_id: &str,
        limits: KeyLimits,
    ) -> Result<bool, LedgerError> {
        let n = sqlx::query(
            "UPDATE api_keys SET max_requests_per_sec = ?, max_in_flight = ? WHERE id = ?",
        )
        .bind(limits.requests_per_sec.map(i64::from))
        .bind(limits.max_in_flight.map(i64::from))
        .bind(key_id)
        .execute(self.pool())
        .await?
        .rows_affected();
        self.key_cache().forget(key_id);
        Ok(n == 1)
    }

    /// Revokes key `key_id` of `account` (any account's when `account` is
    /// `None`, for admins). False if there is no such unrevoked key.
    pub async fn revoke_key(
        &self,
        key_id: &str,
        account: Option<&str>,
    ) -> Result<bool, LedgerError> {
        let n = sqlx::query(
            "UPDATE api_keys SET revoked_at_ms = ?1 WHERE id = ?2 AND revoked_at_ms IS NULL \
             AND (?3 IS NULL OR account_id = ?3)",
        )
        .bind(crate::util::now_ms())
        .bind(key_id)
        .bind(account)
        .execute(self.pool())
        .await?
        .rows_affected();
        self.key_cache().forget(key_id);
        Ok(n == 1)
    }

    /// Keys of `account`, newest first.
    pub async fn list_keys(&self, account: &str) -> Result<Vec<KeyInfo>, LedgerError> {
        let rows = sqlx::query(
            "SELECT id, account_id, scopes, label, created_at_ms, expires_at_ms, revoked_at_ms \
             FROM api_keys WHERE account_id = ? ORDER BY created_at_ms DESC, id",
        )
        .bind(account)
        .fetch_all(self.pool())
        .await?;
        rows.iter()
            .map(|r| {
                let scopes: String = r.try_get("scopes")?;
                Ok(KeyInfo {
                    id: r.try_get("id")?,
                    account_id: r.try_get("account_id")?,
                    scopes: Scopes::from_text(&scopes)?,
                    label: r.try_get("label")?,
                    created_at_ms: r.try_get("created_at_ms")?,
                    expires_at_ms: r.try_get("expires_at_ms")?,
                    revoked_at_ms: r.try_get("revoked_at_ms")?,
                })
            })
            .collect()
    }

    /// Creates an admin account with an admin key: how the first key comes
    /// to exist (`mlxnet-coordinator admin-key`, and test harnesses).
    pub async fn bootstrap_admin(&self, name: &str) -> Result<IssuedKey, LedgerError> {
        let account = self.create_account(name, AccountKind::Client).await?;
        self.create_key(&account.id, Scopes::ALL, "bootstrap admin", None)
            .await
    }
}

/// Opens the database `config` names (creating and migrating it if needed),
/// creates an admin account named `name` with an admin key, and closes the
/// database. This is how the first key of a network is made: run
/// `mlxnet-coordinator admin-key` on the coordinator's host (whoever can read
/// the database can already do anything). SQLite allows it while the
/// coordinator runs.
pub async fn bootstrap_admin_key(
    config: &crate::config::CoordinatorConfig,
    name: &str,
) -> Result<IssuedKey, LedgerError> {
    std::fs::create_dir_all(&config.data_dir)
        .map_err(|_| LedgerError::Invalid("cannot create the data directory"))?;
    let store = crate::store::Store::connect(&config.database_url()).await?;
    let ledger = Ledger::new(store.pool().clone(), config.ledger.clone());
    let key = ledger.bootstrap_admin(name).await;
    store.close().await;
    key
}
