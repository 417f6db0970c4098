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
    metrics::Metrics,
    store::{AnyStore, Store},
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
        let replica = &d.config.replica_id;
        held = renew(&d.store, &d.metrics, replica, held, ttl_ms, now_ms()).await;
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

/// Takes or renews the sweep's lease for `replica` at `now_ms`; `None`
/// (counted as a loss if `held` was a lease) when another replica holds it
/// or the store failed.
async fn renew(
    store: &AnyStore,
    metrics: &Metrics,
    replica: &str,
    held: Option<Lease>,
    ttl_ms: i64,
    now_ms: i64,
) -> Option<Lease> {
    match store
        .acquire_lease(SWEEP_LEASE, replica, ttl_ms, now_ms)
        .await
    {
        Ok(Some(lease)) => {
            metrics.lease_renewed(replica, SWEEP_LEASE);
            if held.as_ref().is_none_or(|h| h.epoch != lease.epoch) {
                tracing::info!(replica, epoch = lease.epoch, "holding the sweep's lease");
            }
            Some(lease)
        }
        Ok(None) => {
            if held.is_some() {
                metrics.lease_lost(replica, SWEEP_LEASE);
                tracing::info!(replica, "the sweep's lease went to another replica");
            }
            None
        }
        Err(e) => {
            if held.is_some() {
                metrics.lease_lost(replica, SWEEP_LEASE);
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::metrics::Gauges;

    fn count(m: &Metrics, series: &str) -> String {
        let text = m.render(Gauges::default());
        let prefix = format!("mlxnet_{series}_total{{replica=");
        text.lines()
            .filter(|l| l.starts_with(&prefix))
            .collect::<Vec<_>>()
            .join("\n")
    }

    /// Two replicas' sweep loops on one database: the first to renew holds
    /// the lease, the other skips; a holder that stops renewing past the
    /// lease's end loses it to the other (a higher epoch) and counts the loss.
    #[tokio::test]
    async fn the_sweeps_lease_stays_with_one_replica_until_it_lapses_and_a_loss_is_counted() {
        let dir = tempfile::tempdir().unwrap();
        let url = format!("sqlite://{}", dir.path().join("c.db").display());
        let (a, b) = (
            AnyStore::connect(&url).await.unwrap(),
            AnyStore::connect(&url).await.unwrap(),
        );
        let (ma, mb) = (Metrics::default(), Metrics::default());
        let held_a = renew(&a, &ma, "replica-a", None, 1_000, 0).await;
        assert_eq!(held_a.as_ref().map(|l| l.epoch), Some(1));
        let held_b = renew(&b, &mb, "replica-b", None, 1_000, 10).await;
        assert_eq!(held_b, None, "the other replica skips its pass");
        let held_a = renew(&a, &ma, "replica-a", held_a, 1_000, 900).await;
        assert_eq!(held_a.as_ref().map(|l| l.epoch), Some(1), "renewed");
        // Replica a pauses past its lease's end; b takes it over.
        let held_b = renew(&b, &mb, "replica-b", held_b, 1_000, 1_900).await;
        assert_eq!(held_b.as_ref().map(|l| l.epoch), Some(2));
        let held_a = renew(&a, &ma, "replica-a", held_a, 1_000, 2_000).await;
        assert_eq!(held_a, None);
        assert_eq!(
            count(&ma, "lease_renewals"),
            "mlxnet_lease_renewals_total{replica=\"replica-a\",lease=\"ledger-sweep\"} 2"
        );
        assert_eq!(
            count(&ma, "lease_losses"),
            "mlxnet_lease_losses_total{replica=\"replica-a\",lease=\"ledger-sweep\"} 1"
        );
        assert_eq!(
            count(&mb, "lease_renewals"),
            "mlxnet_lease_renewals_total{replica=\"replica-b\",lease=\"ledger-sweep\"} 1"
        );
        assert_eq!(count(&mb, "lease_losses"), "", "b never held it before");
        a.close().await;
        b.close().await;
    }
}
