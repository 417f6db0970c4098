//! Leases of the singleton duties on PostgreSQL (see
//! [`crate::store::Store::acquire_lease`]). Each write is one statement
//! (the upsert locks the row); the fence share-locks the lease's row to the
//! end of its write transaction, so a takeover waits until that transaction
//! ends: its writes are made under the lease or not at all.

use sqlx::PgConnection;

use super::super::{Result, StoreError};
use crate::domain::Lease;

super::super::backend::lease_queries!(PgConnection, " FOR SHARE");
