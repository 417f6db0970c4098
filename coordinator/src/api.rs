//! The client API over gRPC (package `mlxnet.v1`): jobs, models, network,
//! accounts, plus the standard health and reflection services so stock tools
//! (grpcurl, grpc_health_probe) work.
//!
//! Handlers are thin: they validate, call the dispatcher or store, and map
//! errors once through `From<ApiError> for tonic::Status`.
//!
//! # Invariants
//! - No request message larger than `limits.max_request_bytes` is decoded;
//!   tonic refuses it (OUT_OF_RANGE) before any handler runs.
//! - Authentication: [`auth::AuthLayer`] runs before every handler; handlers
//!   of non-public methods read the caller it set ([`auth::caller`]). A job
//!   is visible only to the account that submitted it (and to admins).

mod accounts;
pub mod auth;
mod jobs;
mod models;
mod network;

use std::{future::Future, sync::Arc};

use mlxnet_proto::v1::{
    accounts_server::AccountsServer, jobs_server::JobsServer, models_server::ModelsServer,
    network_server::NetworkServer, FILE_DESCRIPTOR_SET,
};
use tokio::net::TcpListener;
use tokio_stream::wrappers::TcpListenerStream;

use crate::{dispatch::Dispatcher, error::AppError};

pub use jobs::validate_submit;

/// Serves the client API on `listener` until `shutdown` resolves.
pub async fn serve(
    listener: TcpListener,
    dispatcher: Arc<Dispatcher>,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(), AppError> {
    let max = dispatcher.config.limits.max_request_bytes;
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
    tonic::transport::Server::builder()
        .layer(auth::AuthLayer::new(dispatcher.ledger.clone()))
        .add_service(health_service)
        .add_service(reflection)
        .add_service(
            JobsServer::new(jobs::JobsApi::new(Arc::clone(&dispatcher)))
                .max_decoding_message_size(max),
        )
        .add_service(
            ModelsServer::new(models::ModelsApi::new(Arc::clone(&dispatcher)))
                .max_decoding_message_size(max),
        )
        .add_service(
            NetworkServer::new(network::NetworkApi::new(Arc::clone(&dispatcher)))
                .max_decoding_message_size(max),
        )
        .add_service(
            AccountsServer::new(accounts::AccountsApi::new(Arc::clone(&dispatcher)))
                .max_decoding_message_size(max),
        )
        .serve_with_incoming_shutdown(TcpListenerStream::new(listener), shutdown)
        .await?;
    Ok(())
}

#[cfg(test)]
mod accounts_tests;
#[cfg(test)]
mod tests;
