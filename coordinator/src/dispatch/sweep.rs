//! The periodic sweep, every `ledger.sweep_interval_ms` until shutdown:
//! renews this replica's liveness lease, then (on one replica at a time)
//! requeues the attempts of dead replicas (the orphan sweep), settles what
//! a crash or an error left unsettled, cancels (then settles) jobs whose
//! hold's deadline passed, pays availability rewards, and deletes the
//! relayed tokens of jobs that ended over [`crate::relay::RETENTION`] ago.
//!
//! Liveness: every replica holds the lease `replica/<replica_id>`
//! ([`crate::domain::liveness_lease`]), taken at start-up (after its own
//! recovery), renewed by each pass for [`LEASE_INTERVALS`] intervals, and
//! released at shutdown. The nodes and attempts a replica owns carry its
//! id (`nodes.replica`, `jobs.replica`). The rule: a replica is dead when
//! its liveness lease is not live (expired, released, never taken); the
//! orphan sweep requeues exactly the assigned/running attempts of dead
//! replicas and offlines their nodes (`Store::requeue_orphans`), and at
//! start-up a replica also counts its own earlier incarnation (same id)
//! dead. So a replica starting beside live ones touches nothing of theirs,
//! and a dead replica's jobs go back to the queue within about
//! `LEASE_INTERVALS + 1` sweep intervals of its last renewal (at once after
//! a clean stop, which releases the lease). A requeue is one guarded
//! statement (only assigned/running rows), so two sweeps never requeue an
//! attempt twice, and it moves no money: the job's hold stays open until
//! the job ends.
//!
//! The singleton part is guarded by the lease [`SWEEP_LEASE`] (for three
//! intervals): it runs only while this replica holds it; every settlement
//! and reward payment it makes is fenced by the lease's epoch, so a replica
//! that lost the lease (paused, partitioned) writes nothing under it. The
//! lease is released at shutdown, so another replica takes over at its
//! next pass.
//!
//! # Failure
//! A failed pass is logged; the next one retries. A failed renewal counts
//! as a loss: the pass is skipped. A replica paused past its liveness
//! lease has its attempts requeued by another; their later results are
//! refused by the jobs' guarded transitions (the attempt is no longer
//! assigned), and its next pass takes its liveness lease again.

use std::{sync::Arc, time::Duration};

use super::Dispatcher;
use crate::{
    domain::{liveness_lease, Lease},
    ledger::{self, Swept},
    metrics::Metrics,
    store::{AnyStore, Store},
    util::{error_chain, now_ms},
};

/// The name of the sweep's lease.
pub const SWEEP_LEASE: &str = "ledger-sweep";

/// How many sweep intervals a lease lasts without renewal.
pub const LEASE_INTERVALS: u64 = 3;

/// A lease's time to live for sweep interval `interval_ms`.
pub fn lease_ttl_ms(interval_ms: u64) -> i64 {
    i64::try_from(interval_ms.saturating_mul(LEASE_INTERVALS)).unwrap_or(i64::MAX)
}

/// Runs [`ledger::sweep_under`] and the reward payments every
/// `sweep_interval_ms` until shutdown, while this replica holds the sweep's
/// lease; a job past its hold's deadline is cancelled as a client's cancel
/// is (watchers and its node are told).
pub async fn sweep_loop(d: Arc<Dispatcher>) {
    let interval_ms = d.ledger.config().sweep_interval_ms;
    let every = Duration::from_millis(interval_ms);
    let ttl_ms = lease_ttl_ms(interval_ms);
    let replica = &d.config.replica_id;
    let alive = liveness_lease(replica);
    let mut held: Option<Lease> = None;
    let mut live: Option<Lease> = None;
    loop {
        tokio::select! {
            _ = d.shutdown_token().cancelled() => break,
            _ = tokio::time::sleep(every) => {}
        }
        let now = now_ms();
        live = match d.store.acquire_lease(&alive, replica, ttl_ms, now).await {
            Ok(lease) => lease,
            Err(e) => {
                tracing::warn!(error = %error_chain(&e), "renewing the liveness lease failed");
                None
            }
        };
        held = renew(&d.store, &d.metrics, replica, held, ttl_ms, now).await;
        if let Some(lease) = &held {
            if orphan_sweep(&d.store, d.config.max_attempts, now).await > 0 {
                d.wake();
            }
            sweep_once(&d, lease).await;
            // The relayed tokens of jobs that ended a while ago.
            match d.relay.purge(now_ms()).await {
                Ok(0) => {}
                Ok(n) => tracing::debug!(rows = n, "purged ended jobs' relayed tokens"),
                Err(e) => tracing::warn!(error = %error_chain(&e), "purging relayed tokens failed"),
            }
        }
    }
    for lease in [held, live].into_iter().flatten() {
        if let Err(e) = d.store.release_lease(&lease).await {
            tracing::warn!(error = %error_chain(&e), lease = lease.name, "releasing a lease failed");
        }
    }
}

/// The orphan sweep at `now_ms`: requeues the attempts of dead replicas
/// and offlines their nodes (see the module header). Returns how many jobs
/// went back to the queue (0 when the store failed: logged, retried at the
/// next pass).
async fn orphan_sweep(store: &AnyStore, max_attempts: u32, now_ms: i64) -> u64 {
    match store.requeue_orphans(max_attempts, None, now_ms).await {
        Ok(n) => {
            if n > 0 {
                tracing::info!(
                    requeued = n,
                    "jobs of a dead replica went back to the queue"
                );
            }
            n
        }
        Err(e) => {
            tracing::warn!(error = %error_chain(&e), "the orphan sweep failed");
            0
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
