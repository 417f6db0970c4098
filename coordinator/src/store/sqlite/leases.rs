//! Leases of the singleton duties on SQLite (see
//! [`crate::store::Store::acquire_lease`]). Each write is one statement in a
//! `BEGIN IMMEDIATE` transaction; the fence is a read inside a write
//! transaction, which holds SQLite's write lock to its end, so no takeover
//! commits before it does.

use sqlx::SqliteConnection;

use super::super::{Result, StoreError};
use crate::domain::Lease;

super::super::backend::lease_queries!(SqliteConnection, "");
