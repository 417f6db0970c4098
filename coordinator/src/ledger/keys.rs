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
//! A key made with a key (CreateApiKey) is that key's child: its expiry is
//! clipped to its parent's when made, it is made only while its parent is
//! valid, revoking a key revokes every key under it, and a key is accepted
//! only while its parent is unrevoked.
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

use super::{AccountKind, Ledger, LedgerError};
pub use crate::domain::{Caller, KeyInfo, KeyLimits, Scope, Scopes};
use crate::{
    store::{NewKey, Store},
    util::now_ms,
};

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

    /// Drops every entry (a revoke may reach keys made under the key).
    fn clear(&self) {
        self.lock().clear();
    }

    /// Drops the entry of key `key_id` (revoked or changed).
    fn forget(&self, key_id: &str) {
        self.lock().retain(|_, c| c.caller.key_id != key_id);
    }
}

fn hash(key: &str) -> [u8; 32] {
    Sha256::digest(key.as_bytes()).into()
}

impl Ledger {
    /// Creates a root key for `account`. Its secret is in the result and
    /// nowhere else.
    pub async fn create_key(
        &self,
        account: &str,
        scopes: Scopes,
        label: &str,
        expires_at_ms: Option<i64>,
    ) -> Result<IssuedKey, LedgerError> {
        self.insert_key(account, scopes, label, expires_at_ms, None)
            .await
    }

    /// Creates a key for `account` made with `parent`'s key: it expires no
    /// later than `parent`, is revoked with it, and is accepted only while
    /// `parent` is unrevoked. [`LedgerError::ParentKeyGone`] when `parent`
    /// was revoked or expired meanwhile.
    pub async fn create_child_key(
        &self,
        parent: &Caller,
        account: &str,
        scopes: Scopes,
        label: &str,
        expires_at_ms: Option<i64>,
    ) -> Result<IssuedKey, LedgerError> {
        let expires_at_ms = match (expires_at_ms, parent.expires_at_ms) {
            (Some(asked), Some(limit)) => Some(asked.min(limit)),
            (asked, limit) => asked.or(limit),
        };
        self.insert_key(account, scopes, label, expires_at_ms, Some(&parent.key_id))
            .await
    }

    async fn insert_key(
        &self,
        account: &str,
        scopes: Scopes,
        label: &str,
        expires_at_ms: Option<i64>,
        parent: Option<&str>,
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
        let inserted = self
            .store()
            .insert_key(&NewKey {
                id: id.clone(),
                account_id: account.to_owned(),
                hash: hash(&secret),
                scopes,
                label: label.to_owned(),
                created_at_ms: now_ms(),
                expires_at_ms,
                parent_key_id: parent.map(str::to_owned),
            })
            .await?;
        if !inserted {
            return Err(LedgerError::ParentKeyGone);
        }
        Ok(IssuedKey {
            id,
            account_id: account.to_owned(),
            scopes,
            expires_at_ms,
            secret,
        })
    }

    /// The caller behind `presented` if this replica knows the key now
    /// (its key cache), without asking the database; None otherwise (not
    /// known here, or no such key).
    pub fn known_key(&self, presented: &str, now_ms: i64) -> Option<Caller> {
        if !presented.starts_with(KEY_PREFIX) || presented.len() > 128 {
            return None;
        }
        self.key_cache().get(&hash(presented), now_ms)
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
        let Some(found) = self.store().key_by_hash(&digest, now_ms).await? else {
            return Ok(None);
        };
        self.key_cache()
            .put(digest, found.caller.clone(), found.expires_at_ms);
        Ok(Some(found.caller))
    }

    /// Sets key `key_id`'s own abuse limits (`None`: the coordinator's
    /// default; 0: unlimited). False if there is no such key.
    pub async fn set_key_limits(
        &self,
        key_id: &str,
        limits: KeyLimits,
    ) -> Result<bool, LedgerError> {
        let found = self.store().set_key_limits(key_id, limits).await?;
        self.key_cache().forget(key_id);
        Ok(found)
    }

    /// Revokes key `key_id` of `account` (any account's when `account` is
    /// `None`, for admins), and every key made under it. False if there is
    /// no such unrevoked key.
    pub async fn revoke_key(
        &self,
        key_id: &str,
        account: Option<&str>,
    ) -> Result<bool, LedgerError> {
        let revoked = self.store().revoke_key(key_id, account, now_ms()).await?;
        // The keys under it are not known here: every cached lookup goes
        // (revokes are rare; each key costs one query again).
        self.key_cache().clear();
        Ok(revoked)
    }

    /// Keys of `account`, newest first.
    pub async fn list_keys(&self, account: &str) -> Result<Vec<KeyInfo>, LedgerError> {
        Ok(self.store().list_keys(account).await?)
    }

    /// Creates an admin account with an admin key: how the first key comes
    /// to exist (`mlxnet-coordinator admin-key`, and test harnesses).
    pub async fn bootstrap_admin(&self, name: &str) -> Result<IssuedKey, LedgerError> {
        let account = self.create_account(name, AccountKind::Client).await?;
        self.create_key(&account.id, Scopes::ALL, "bootstrap admin", None)
            .await
    }
}
