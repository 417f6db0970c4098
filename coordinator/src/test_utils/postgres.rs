//! A fresh PostgreSQL database per test, on the server the tests are given
//! (`MLXNET_TEST_DATABASE_URL`), for other crates' tests (the store's own
//! suite has its copy in `store/tests.rs`).

/// The variable naming a PostgreSQL server the tests may create databases
/// on (`postgres://USER@HOST:PORT/postgres`).
pub const PG_URL_VAR: &str = "MLXNET_TEST_DATABASE_URL";

/// The server's URL, or `None` when none is configured here (the caller
/// skips, saying so). Under CI a missing URL is a failure.
pub fn pg_server_url() -> Option<String> {
    match std::env::var(PG_URL_VAR) {
        Ok(url) if !url.is_empty() => Some(url),
        _ => {
            assert!(
                std::env::var_os("CI").is_none(),
                "{PG_URL_VAR} is not set: CI must run the PostgreSQL tests (.ci/run starts a server)"
            );
            eprintln!(
                "skipped: {PG_URL_VAR} is not set (scripts/pg-test-server.sh starts a server)"
            );
            None
        }
    }
}

/// A fresh, empty database on the server at `server` (the URL of one of
/// its databases): its URL.
pub async fn pg_fresh_database(server: &str) -> Result<String, crate::store::StoreError> {
    crate::store::postgres::fresh_database(server).await
}
