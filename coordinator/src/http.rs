//! Operational HTTP (axum): `/healthz` (the process answers), `/readyz` (the
//! database answers), `/metrics` (Prometheus text); and the World page
//! ([`crate::world::router`]), whose live streams it ends at shutdown.

use std::{future::Future, sync::Arc};

use axum::{extract::State, http::StatusCode, response::IntoResponse, routing::get, Router};
use tokio::net::TcpListener;

use crate::{dispatch::Dispatcher, error::error_chain, metrics::Gauges};

/// The routes, over the dispatcher's state.
pub fn router(d: Arc<Dispatcher>) -> Router {
    Router::new()
        .route("/healthz", get(|| async { "ok\n" }))
        .route("/readyz", get(readyz))
        .route("/metrics", get(metrics))
        .with_state(Arc::clone(&d))
        .merge(crate::world::router(d.world.clone()))
}

/// Serves the routes on `listener` until `shutdown` resolves.
pub async fn serve(
    listener: TcpListener,
    d: Arc<Dispatcher>,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    let world = d.world.clone();
    axum::serve(listener, router(d))
        .with_graceful_shutdown(async move {
            shutdown.await;
            // Open World event streams would hold the graceful shutdown open.
            world.close();
        })
        .await
}

async fn readyz(State(d): State<Arc<Dispatcher>>) -> impl IntoResponse {
    match d.store.ping().await {
        Ok(()) => (StatusCode::OK, "ready\n"),
        Err(e) => {
            tracing::warn!(error = %error_chain(&e), "readiness check failed");
            (StatusCode::SERVICE_UNAVAILABLE, "database unavailable\n")
        }
    }
}

async fn metrics(State(d): State<Arc<Dispatcher>>) -> impl IntoResponse {
    let jobs_queued = d.store.count_queued().await.unwrap_or(0);
    let body = d.metrics.render(Gauges {
        nodes_online: d.sessions.len() as u64,
        jobs_queued,
    });
    ([("content-type", "text/plain; version=0.0.4")], body)
}
