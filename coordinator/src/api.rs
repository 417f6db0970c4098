//! The client API over gRPC (package `mlxnet.v1`): jobs, models, network,
//! accounts, plus the standard health and reflection services (reflection
//! v1 and v1alpha) so stock tools (grpcurl, grpc_health_probe, Postman,
//! Evans) work.
//!
//! Handlers are thin: they validate, call the dispatcher or store, and map
//! errors once through `From<ApiError> for tonic::Status` ([`error`]).
//!
//! # Invariants
//! - No request message larger than `limits.max_request_bytes` is decoded;
//!   tonic reads the 5-byte length prefix and refuses it (OUT_OF_RANGE)
//!   before buffering the message or running any handler.
//! - Abuse limits ([`limits`]): at most `limits.max_connections`
//!   connections, `limits.max_in_flight_requests` requests in flight, and
//!   each key's rate and in-flight caps; the excess is RESOURCE_EXHAUSTED at
//!   once. Slow senders meet `limits.request_timeout_ms` and the HTTP/2
//!   keep-alive.
//! - Authentication: [`auth::AuthLayer`] runs before every handler; handlers
//!   of non-public methods read the caller it set ([`auth::caller`]). A job
//!   is visible only to the account that submitted it (and to admins).

mod accounts;
pub mod auth;
pub mod error;
pub mod jobs;
pub mod limits;
mod models;
mod network;

use std::{future::Future, sync::Arc, time::Duration};

use mlxnet_proto::v1::{
    accounts_server::AccountsServer, jobs_server::JobsServer, models_server::ModelsServer,
    network_server::NetworkServer, FILE_DESCRIPTOR_SET,
};
use tokio::net::TcpListener;

use tokio_util::sync::CancellationToken;

use self::limits::{Admission, Limits};
use crate::{
    catalogue::Catalogue, dispatch::Dispatcher, jobs::EventHub, ledger::Ledger,
    link::session::Sessions, store::AnyStore, util::net::capped_incoming,
};

pub use jobs::validate_submit;

/// Keep-alive ping period on idle gRPC connections, and how long an answer
/// may take before the connection is closed.
const KEEPALIVE_INTERVAL: Duration = Duration::from_secs(30);
const KEEPALIVE_TIMEOUT: Duration = Duration::from_secs(10);
/// Largest header block a request may send (keys are under 100 bytes).
const MAX_HEADER_LIST_BYTES: u32 = 16 * 1024;
/// Concurrent streams per HTTP/2 connection (calls beyond it wait client-side).
const MAX_STREAMS_PER_CONNECTION: u32 = 256;

/// What the client API needs from the rest of the coordinator: its limits
/// and the handles it shares (built once, by `app`).
pub struct ApiContext {
    /// Submits, cancels, and the could-it-ever-fit check.
    pub dispatcher: Arc<Dispatcher>,
    /// Jobs, nodes and stats, read.
    pub store: AnyStore,
    /// Accounts, keys, history and earnings.
    pub ledger: Ledger,
    pub catalogue: Arc<Catalogue>,
    /// The live events behind Watch.
    pub hub: EventHub,
    /// Running jobs' tokens from every replica (enabled: Watch reads
    /// through it instead of the hub).
    pub relay: crate::relay::Relay,
    /// The online nodes (models served, network totals).
    pub sessions: Sessions,
    pub limits: Limits,
    /// The abuse limits' live counts.
    pub admission: Arc<Admission>,
    /// Cancelled when the application stops (open Watch streams end).
    pub shutdown: CancellationToken,
}

/// Why the gRPC server could not start or stopped.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ServeError {
    #[error("gRPC reflection descriptors")]
    Reflection(#[from] tonic_reflection::server::Error),
    #[error("gRPC server failed")]
    Grpc(#[from] tonic::transport::Error),
}

/// Serves the client API on `listener` until `shutdown` resolves, within
/// `limits` (counted by `admission`).
pub async fn serve(
    listener: TcpListener,
    ctx: Arc<ApiContext>,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(), ServeError> {
    let limits = ctx.limits.clone();
    let max = limits.max_request_bytes;
    let (health, health_service) = tonic_health::server::health_reporter();
    health.set_serving::<JobsServer<jobs::JobsApi>>().await;
    health
        .set_serving::<ModelsServer<models::ModelsApi>>()
        .await;
    health
        .set_serving::<NetworkServer<network::NetworkApi>>()
        .await;
    health
        .set_serving::<AccountsServer<accounts::AccountsApi>>()
        .await;
    let reflection = tonic_reflection::server::Builder::configure()
        .register_encoded_file_descriptor_set(FILE_DESCRIPTOR_SET)
        .register_encoded_file_descriptor_set(tonic_health::pb::FILE_DESCRIPTOR_SET)
        .build_v1()?;
    // v1alpha too: older grpcurl, Postman and Evans ask only for it.
    let reflection_v1alpha = tonic_reflection::server::Builder::configure()
        .register_encoded_file_descriptor_set(FILE_DESCRIPTOR_SET)
        .register_encoded_file_descriptor_set(tonic_health::pb::FILE_DESCRIPTOR_SET)
        .build_v1alpha()?;
    tonic::transport::Server::builder()
        // Slow senders: a request must be read and answered (a stream:
        // started) in time; a connection that stops answering keep-alive
        // pings is closed; headers and frames are bounded.
        .timeout(Duration::from_millis(limits.request_timeout_ms))
        .http2_keepalive_interval(Some(KEEPALIVE_INTERVAL))
        .http2_keepalive_timeout(Some(KEEPALIVE_TIMEOUT))
        .http2_max_header_list_size(MAX_HEADER_LIST_BYTES)
        .max_concurrent_streams(MAX_STREAMS_PER_CONNECTION)
        .http2_max_pending_accept_reset_streams(Some(64))
        .layer(auth::AuthLayer::new(
            ctx.ledger.clone(),
            Arc::clone(&ctx.admission),
        ))
        .add_service(health_service)
        .add_service(reflection)
        .add_service(reflection_v1alpha)
        .add_service(
            JobsServer::new(jobs::JobsApi::new(Arc::clone(&ctx))).max_decoding_message_size(max),
        )
        .add_service(
            ModelsServer::new(models::ModelsApi::new(Arc::clone(&ctx)))
                .max_decoding_message_size(max),
        )
        .add_service(
            NetworkServer::new(network::NetworkApi::new(Arc::clone(&ctx)))
                .max_decoding_message_size(max),
        )
        .add_service(
            AccountsServer::new(accounts::AccountsApi::new(Arc::clone(&ctx)))
                .max_decoding_message_size(max),
        )
        .serve_with_incoming_shutdown(capped_incoming(listener, limits.max_connections), shutdown)
        .await?;
    Ok(())
}

#[cfg(test)]
mod accounts_tests;
#[cfg(test)]
mod child_keys_tests;
#[cfg(test)]
mod tests;
