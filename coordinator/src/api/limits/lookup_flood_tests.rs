//! A flood of made-up API keys, each looked up in the database, must not
//! take the in-flight slots of callers whose keys are good, against a real
//! listener on PostgreSQL.
//!
//! The lookups are made slow for sure, not by load: a second connection
//! holds an exclusive lock on the keys table, so every lookup waits in the
//! database until the test lets go. The flood is known to be in flight
//! once PostgreSQL reports its lookups waiting on that lock (a wait for an
//! event, never a verdict). The honest key was used once before, so this
//! replica knows it without asking the database.
//!
//! Skipped (passes with a message) when `MLXNET_TEST_DATABASE_URL` is not
//! set, like the other PostgreSQL tests.

use std::time::Duration;

use mlxnet_proto::v1::{accounts_client::AccountsClient, BalanceRequest};
use tonic::Code;

use crate::{
    store::test_locks::{lock_table, lock_waiters},
    test_utils::{
        postgres::{pg_fresh_database, pg_server_url},
        spawn_app,
    },
};

/// The bound on the wait for the flood to be in flight (a failure, never
/// a verdict).
const WAIT: Duration = Duration::from_secs(60);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_flood_of_made_up_keys_cannot_take_the_slots_of_a_good_key() {
    const SLOTS: usize = 4;
    const FLOOD: usize = 2 * SLOTS;
    let Some(server) = pg_server_url() else {
        eprintln!("MLXNET_TEST_DATABASE_URL not set; skipped");
        return;
    };
    let url = pg_fresh_database(&server).await.unwrap();
    let app = spawn_app(|c| {
        c.database_url = Some(url.clone());
        c.limits.max_in_flight_requests = SLOTS;
        // The lookups wait on the lock for as long as the test holds it.
        c.store.statement_timeout_ms = 600_000;
    })
    .await;
    // The good key, used once: this replica knows it from now on.
    AccountsClient::new(app.grpc().await)
        .balance(BalanceRequest::default())
        .await
        .unwrap();

    let lock = lock_table(&url, "api_keys").await.unwrap();
    let mut flood = Vec::new();
    for i in 0..FLOOD {
        let channel = app.grpc_with(Some(&format!("mlxk_{i:064x}"))).await;
        flood.push(tokio::spawn(async move {
            AccountsClient::new(channel)
                .balance(BalanceRequest::default())
                .await
                .map(|_| ())
                .map_err(|s| s.code())
        }));
    }
    let waiting = tokio::time::timeout(WAIT, async {
        loop {
            let n = lock_waiters(&url).await.unwrap();
            if n >= SLOTS as i64 {
                return n;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await
    .expect("the made-up keys' lookups were never in flight");

    let balance = AccountsClient::new(app.grpc().await)
        .balance(BalanceRequest::default())
        .await;
    assert!(
        balance.is_ok(),
        "a good key was refused while {waiting} made-up keys were being looked up: {balance:?}"
    );

    lock.release().await.unwrap();
    for call in flood {
        let got = call.await.unwrap();
        assert!(
            matches!(
                got,
                Err(Code::Unauthenticated) | Err(Code::ResourceExhausted)
            ),
            "a made-up key was answered {got:?}"
        );
    }
    app.stop().await;
}
