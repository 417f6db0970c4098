//! The ledger's periodic sweep: settles what a crash or an error left
//! unsettled, cancels (then settles) jobs whose hold's deadline passed, and
//! pays availability rewards; every `ledger.sweep_interval_ms` until shutdown.
//!
//! With several replicas on one database it is a singleton duty: each pass
//! first takes or renews the lease [`SWEEP_LEASE`] (for three intervals) and
//! runs only while this replica holds it; every settlement and reward
//! payment it makes is fenced by the lease's epoch, so a replica that lost
//! the lease (paused, partitioned) writes nothing under it. The lease is
//! released at shutdown, so another replica takes over at its next pass.
//!
//! # Failure
//! A failed pass is logged; the next one retries. A failed renewal counts
//! as a loss: the pass is skipped.

use std::{sync::Arc, time::Duration};

use super::Dispatcher;
use crate::{
    domain::Lease,
    ledger::{self, Swept},
    store::Store,
    util::{error_chain, now_ms},
};

/// The name of the sweep's lease.
pub const SWEEP_LEASE: &str = "ledger-sweep";

/// How many sweep intervals a lease lasts without renewal.
const LEASE_INTERVALS: u64 = 3;

/// Runs [`ledger::sweep_under`] and the reward payments every
/// `sweep_interval_ms` until shutdown, while this replica holds the sweep's
/// lease; a job past its hold's deadline is cancelled as a client's cancel
/// is (watchers and its node are told).
pub async fn sweep_loop(d: Arc<Dispatcher>) {
    let interval_ms = d.ledger.config().sweep_interval_ms;
    let every = Duration::from_millis(interval_ms);
    let ttl_ms = i64::try_from(interval_ms.saturating_mul(LEASE_INTERVALS)).unwrap_or(i64::MAX);
    let mut held: Option<Lease> = None;
    loop {
        tokio::select! {
            _ = d.shutdown_token().cancelled() => break,
            _ = tokio::time::sleep(every) => {}
        }
        held = renew(&d, held, ttl_ms).await;
        if let Some(lease) = &held {
            sweep_once(&d, lease).await;
        }
    }
    if let Some(lease) = held {
        if let Err(e) = d.store.release_lease(&lease).await {
            tracing::warn!(error = %error_chain(&e), "releasing the sweep's lease failed");
        }
    }
}

/// Takes or renews the sweep's lease; `None` (counted as a loss if it was
/// held) when another replica holds it or the store failed.
async fn renew(d: &Dispatcher, held: Option<Lease>, ttl_ms: i64) -> Option<Lease> {
    let replica = &d.config.replica_id;
    match d
        .store
        .acquire_lease(SWEEP_LEASE, replica, ttl_ms, now_ms())
        .await
    {
        Ok(Some(lease)) => {
            d.metrics.lease_renewed(replica, SWEEP_LEASE);
            if held.as_ref().is_none_or(|h| h.epoch != lease.epoch) {
                tracing::info!(replica, epoch = lease.epoch, "holding the sweep's lease");
            }
            Some(lease)
        }
        Ok(None) => {
            if held.is_some() {
                d.metrics.lease_lost(replica, SWEEP_LEASE);
                tracing::info!(replica, "the sweep's lease went to another replica");
            }
            None
        }
        Err(e) => {
            if held.is_some() {
                d.metrics.lease_lost(replica, SWEEP_LEASE);
            }
            tracing::warn!(error = %error_chain(&e), "renewing the sweep's lease failed");
            None
        }
    }
}

/// One pass of the sweep under `lease`.
async fn sweep_once(d: &Arc<Dispatcher>, lease: &Lease) {
    let result = ledger::sweep_under(&d.ledger, now_ms(), Some(lease), |job| {
        let d = Arc::clone(d);
        async move { d.cancel(job).await.map(|_| ()) }
    })
    .await;
    if let Err(e) = d.ledger.pay_rewards_under(now_ms(), Some(lease)).await {
        tracing::warn!(error = %error_chain(&e), "paying availability rewards failed");
    }
    match result {
        Ok(s) if s != Swept::default() => tracing::info!(?s, "ledger sweep"),
        Ok(_) => {}
        Err(e) => tracing::warn!(error = %error_chain(&e), "ledger sweep failed"),
    }
}
