//! Operational HTTP (axum): `/healthz` (the process answers), `/readyz`
//! (this replica should get traffic: see [`readyz`]), `/metrics`
//! (OpenMetrics text); and the World page
//! ([`crate::world::router`]), whose live streams it ends at shutdown; and
//! the OpenAI-compatible API under `/v1` ([`crate::openai`]).
//!
//! # Abuse limits
//! - At most [`HttpConfig::max_connections`] open connections (more are closed at
//!   accept); request headers must arrive within `request_timeout_ms`
//!   (HTTP/1.1; HTTP/2 connections must answer keep-alive pings) and fit in
//!   [`MAX_HEADER_BYTES`].
//! - A body larger than `max_body_bytes` is refused with 413 on
//!   its `content-length` before anything is read, and cut off there if it
//!   comes without one.
//! - At most `max_in_flight` requests in flight (an open World
//!   stream counts until it ends); more get 429 at once. `/healthz` and
//!   `/readyz` are exempt, so the process can always say whether it is
//!   alive and ready (open World streams must not make a load balancer
//!   take a healthy replica out).
//! - A handler must produce its response within `request_timeout_ms`
//!   (503 otherwise), but for `/v1`: an answer there waits on its job, and
//!   its body must arrive within `request_timeout_ms` instead.
//! - Under `/v1` these refusals are in OpenAI's error shape.

use std::{future::Future, sync::Arc, time::Duration};

use axum::{
    body::Body,
    extract::{Request, State},
    http::{header, StatusCode},
    middleware::{self, Next},
    response::{IntoResponse, Response},
    routing::get,
    Router,
};
use hyper_util::{
    rt::{TokioExecutor, TokioIo, TokioTimer},
    server::{conn::auto, graceful::GracefulShutdown},
    service::TowerToHyperService,
};
use tokio::{
    net::TcpListener,
    sync::{OwnedSemaphorePermit, Semaphore},
};
use tracing::debug;

use crate::{
    api::ApiContext,
    domain::liveness_lease,
    link::session::Sessions,
    metrics::{Gauges, Metrics},
    openai::{self, OpenAiError},
    store::{AnyStore, Store},
    util::{error_chain, net::Held, now_ms},
    world::World,
};

/// The HTTP listener's abuse limits (`[limits]` keys, gathered by `config`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HttpConfig {
    /// Open connections at once; more are closed at accept.
    pub max_connections: usize,
    /// Request headers must arrive, and a handler answer, within this.
    pub request_timeout_ms: u64,
    /// Largest request body.
    pub max_body_bytes: usize,
    /// Requests in flight at once; more get 429.
    pub max_in_flight: usize,
}

/// Largest request head (request line and headers), HTTP/1.1 and HTTP/2.
pub const MAX_HEADER_BYTES: usize = 16 * 1024;
/// How long graceful shutdown waits for open connections to finish.
const DRAIN: Duration = Duration::from_secs(5);

/// What the HTTP routes read: the store (readiness, the queue gauge), the
/// counters, the online nodes, the World page's state, and the client API's
/// context (the OpenAI-compatible API submits through it).
#[derive(Clone)]
pub struct HttpContext {
    pub store: AnyStore,
    pub metrics: Arc<Metrics>,
    pub sessions: Sessions,
    pub world: World,
    pub api: Arc<ApiContext>,
    /// This replica's id: `/readyz` checks it holds `replica/<id>`.
    pub replica_id: String,
    /// Cancelled while the replica drains (`/readyz` answers 503).
    pub drain: tokio_util::sync::CancellationToken,
}

/// The routes, over `ctx`.
pub fn router(ctx: HttpContext) -> Router {
    let world = ctx.world.clone();
    let api = Arc::clone(&ctx.api);
    Router::new()
        .route("/healthz", get(|| async { "ok\n" }))
        .route("/readyz", get(readyz))
        .route("/metrics", get(metrics))
        .with_state(Arc::new(ctx))
        .merge(crate::world::router(world))
        .merge(openai::router(api))
}

/// The HTTP listener's request guard state (see the module docs).
#[derive(Debug)]
struct Guard {
    in_flight: Arc<Semaphore>,
    max_body: usize,
    timeout: Duration,
}

async fn guard(State(g): State<Arc<Guard>>, req: Request, next: Next) -> Response {
    let path = req.uri().path();
    let v1 = path == "/v1" || path.starts_with("/v1/");
    let declared = req
        .headers()
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    if declared.is_some_and(|n| n > g.max_body as u64) {
        if v1 {
            return OpenAiError::too_large(g.max_body).into_response();
        }
        return (
            StatusCode::PAYLOAD_TOO_LARGE,
            format!("request body is over the limit of {} bytes\n", g.max_body),
        )
            .into_response();
    }
    let permit: Option<OwnedSemaphorePermit> = if path == "/healthz" || path == "/readyz" {
        None
    } else {
        match Arc::clone(&g.in_flight).try_acquire_owned() {
            Ok(p) => Some(p),
            Err(_) if v1 => {
                return OpenAiError::overloaded("too many requests in flight; retry later")
                    .into_response()
            }
            Err(_) => {
                return (
                    StatusCode::TOO_MANY_REQUESTS,
                    [(header::RETRY_AFTER, "1")],
                    "too many requests in flight; retry later\n",
                )
                    .into_response()
            }
        }
    };
    let max_body = g.max_body;
    let req = req.map(|b| Body::new(http_body_util::Limited::new(b, max_body)));
    if v1 {
        return next.run(req).await.map(|b| Body::new(Held::new(b, permit)));
    }
    match tokio::time::timeout(g.timeout, next.run(req)).await {
        Ok(resp) => resp.map(|b| Body::new(Held::new(b, permit))),
        Err(_) => (StatusCode::SERVICE_UNAVAILABLE, "request timed out\n").into_response(),
    }
}

/// The routes with the abuse limits of `config` in front.
pub fn guarded_router(ctx: HttpContext, config: &HttpConfig) -> Router {
    let g = Arc::new(Guard {
        in_flight: Arc::new(Semaphore::new(config.max_in_flight.max(1))),
        max_body: config.max_body_bytes,
        timeout: Duration::from_millis(config.request_timeout_ms),
    });
    router(ctx).layer(middleware::from_fn_with_state(g, guard))
}

/// Serves the routes on `listener` until `shutdown` resolves.
pub async fn serve(
    listener: TcpListener,
    ctx: HttpContext,
    limits: HttpConfig,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    let world = ctx.world.clone();
    let app = guarded_router(ctx, &limits);
    let timeout = Duration::from_millis(limits.request_timeout_ms);
    let mut builder = auto::Builder::new(TokioExecutor::new());
    builder
        .http1()
        .timer(TokioTimer::new())
        .header_read_timeout(timeout)
        .max_buf_size(MAX_HEADER_BYTES.max(8192));
    builder
        .http2()
        .timer(TokioTimer::new())
        .keep_alive_interval(Some(Duration::from_secs(30)))
        .keep_alive_timeout(Duration::from_secs(10))
        .max_header_list_size(MAX_HEADER_BYTES as u32)
        .max_concurrent_streams(64);
    let graceful = GracefulShutdown::new();
    let slots = Arc::new(Semaphore::new(limits.max_connections.max(1)));
    tokio::pin!(shutdown);
    loop {
        let (stream, _) = tokio::select! {
            _ = &mut shutdown => break,
            r = listener.accept() => match r {
                Ok(c) => c,
                Err(e) => {
                    debug!(error = %e, "accept failed");
                    tokio::time::sleep(Duration::from_millis(10)).await;
                    continue;
                }
            },
        };
        let Ok(slot) = Arc::clone(&slots).try_acquire_owned() else {
            debug!("HTTP connection refused: at the connection cap");
            continue;
        };
        let _ = stream.set_nodelay(true);
        let service = TowerToHyperService::new(app.clone());
        let conn = builder
            .serve_connection_with_upgrades(TokioIo::new(stream), service)
            .into_owned();
        let conn = graceful.watch(conn);
        tokio::spawn(async move {
            if let Err(e) = conn.await {
                debug!(error = %e, "HTTP connection ended with an error");
            }
            drop(slot);
        });
    }
    drop(listener);
    // Open World event streams would hold the graceful shutdown open.
    world.close();
    if tokio::time::timeout(DRAIN, graceful.shutdown())
        .await
        .is_err()
    {
        debug!("HTTP connections still open after the drain period");
    }
    Ok(())
}

/// `/readyz`: 200 while this replica should get traffic; 503 (with the
/// reason) while it drains, when the database does not answer, and when
/// it does not hold its liveness lease `replica/<id>` (another replica's
/// orphan sweep may then take its jobs and nodes: it must not take new
/// ones). The lease is read from the database, so this also checks that
/// the database answers.
async fn readyz(State(d): State<Arc<HttpContext>>) -> impl IntoResponse {
    if d.drain.is_cancelled() {
        return (StatusCode::SERVICE_UNAVAILABLE, "draining\n");
    }
    match d.store.lease(&liveness_lease(&d.replica_id)).await {
        Ok(Some(lease)) if lease.holder == d.replica_id && lease.expires_at_ms > now_ms() => {
            (StatusCode::OK, "ready\n")
        }
        Ok(_) => (
            StatusCode::SERVICE_UNAVAILABLE,
            "this replica does not hold its liveness lease\n",
        ),
        Err(e) => {
            tracing::warn!(error = %error_chain(&e), "readiness check failed");
            (StatusCode::SERVICE_UNAVAILABLE, "database unavailable\n")
        }
    }
}

async fn metrics(State(d): State<Arc<HttpContext>>) -> impl IntoResponse {
    let jobs_queued = d.store.count_queued().await.unwrap_or(0);
    let body = d.metrics.render(Gauges {
        nodes_online: d.sessions.len() as u64,
        jobs_queued,
    });
    ([("content-type", crate::metrics::CONTENT_TYPE)], body)
}
