//! The ledger's periodic sweep: settles what a crash or an error left
//! unsettled, cancels (then settles) jobs whose hold's deadline passed, and
//! pays availability rewards; every `ledger.sweep_interval_ms` until shutdown.
//!
//! # Failure
//! A failed pass is logged; the next one retries.

use std::{sync::Arc, time::Duration};

use super::Dispatcher;
use crate::{
    ledger::{self, Swept},
    util::{error_chain, now_ms},
};

/// Runs [`ledger::sweep`] every `sweep_interval_ms` until shutdown; a job
/// past its hold's deadline is cancelled as a client's cancel is (watchers
/// and its node are told).
pub async fn sweep_loop(d: Arc<Dispatcher>) {
    let every = Duration::from_millis(d.ledger.config().sweep_interval_ms);
    loop {
        tokio::select! {
            _ = d.shutdown_token().cancelled() => return,
            _ = tokio::time::sleep(every) => {}
        }
        let result = ledger::sweep(&d.ledger, now_ms(), |job| {
            let d = Arc::clone(&d);
            async move { d.cancel(job).await.map(|_| ()) }
        })
        .await;
        if let Err(e) = d.ledger.pay_rewards(now_ms()).await {
            tracing::warn!(error = %error_chain(&e), "paying availability rewards failed");
        }
        match result {
            Ok(s) if s != Swept::default() => tracing::info!(?s, "ledger sweep"),
            Ok(_) => {}
            Err(e) => tracing::warn!(error = %error_chain(&e), "ledger sweep failed"),
        }
    }
}
