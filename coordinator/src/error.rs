//! Errors at the coordinator's edges, and their one mapping to the wire.
//!
//! [`ApiError`] is what a client request can end in. Client mistakes carry a
//! message meant for the client; [`ApiError::Internal`] is logged with its
//! whole chain and sent as a generic message, so database text never leaks.
//! [`AppError`] is what starting or running the application can end in.

use std::{io, net::SocketAddr};

use crate::util::error_chain;

use crate::{
    catalogue::CatalogueError, ledger::LedgerError, link::tls::TlsError, store::StoreError,
};

/// Why a client request failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ApiError {
    #[error("{0}")]
    InvalidArgument(String),
    #[error("{0}")]
    NotFound(String),
    #[error("{0}")]
    ResourceExhausted(String),
    #[error("{0}")]
    FailedPrecondition(String),
    /// No key, or an unknown, revoked or expired one: one message for all.
    #[error("{UNAUTHENTICATED}")]
    Unauthenticated,
    #[error("{0}")]
    PermissionDenied(String),
    #[error("internal error")]
    Internal(#[from] StoreError),
    #[error("internal error")]
    Ledger(#[source] LedgerError),
}

/// The one message every authentication failure gets.
pub const UNAUTHENTICATED: &str = "missing or invalid API key (send `authorization: Bearer <key>`)";

impl From<LedgerError> for ApiError {
    fn from(err: LedgerError) -> Self {
        match err {
            LedgerError::InsufficientFunds {
                needed, available, ..
            } => ApiError::FailedPrecondition(format!(
                "insufficient balance: this job may cost up to {} MLX ({needed} micro-MLX) \
                 and {} MLX ({available} micro-MLX) is available; lower max_tokens or add funds",
                mlx(needed),
                mlx(available)
            )),
            LedgerError::NoSuchAccount(a) => ApiError::NotFound(format!("no account {a}")),
            LedgerError::Invalid(m) => ApiError::InvalidArgument(m.to_owned()),
            LedgerError::ExistsWithDifferentFields { id } => ApiError::FailedPrecondition(format!(
                "idempotency key {id:?} was already used for another operation"
            )),
            LedgerError::Store(e) => ApiError::Internal(e),
            other => ApiError::Ledger(other),
        }
    }
}

impl From<crate::domain::InvalidScopes> for ApiError {
    fn from(e: crate::domain::InvalidScopes) -> Self {
        ApiError::InvalidArgument(e.0.to_owned())
    }
}

/// `micro` micro-MLX as MLX with six decimals.
pub fn mlx(micro: i64) -> String {
    let sign = if micro < 0 { "-" } else { "" };
    let m = micro.unsigned_abs();
    format!("{sign}{}.{:06}", m / 1_000_000, m % 1_000_000)
}

impl From<ApiError> for tonic::Status {
    fn from(err: ApiError) -> Self {
        match err {
            ApiError::InvalidArgument(m) => tonic::Status::invalid_argument(m),
            ApiError::NotFound(m) => tonic::Status::not_found(m),
            ApiError::ResourceExhausted(m) => tonic::Status::resource_exhausted(m),
            ApiError::FailedPrecondition(m) => tonic::Status::failed_precondition(m),
            ApiError::Unauthenticated => tonic::Status::unauthenticated(UNAUTHENTICATED),
            ApiError::PermissionDenied(m) => tonic::Status::permission_denied(m),
            ApiError::Internal(source) => {
                tracing::error!(error = %error_chain(&source), "request failed");
                tonic::Status::internal("internal error")
            }
            ApiError::Ledger(source) => {
                tracing::error!(error = %error_chain(&source), "request failed");
                tonic::Status::internal("internal error")
            }
        }
    }
}

/// Why the application could not start or stopped with an error.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum AppError {
    #[error("invalid configuration: {0}")]
    Config(String),
    #[error("creating data directory {path}")]
    DataDir { path: String, source: io::Error },
    #[error("opening the database")]
    Store(#[from] StoreError),
    #[error("recovering the ledger")]
    Ledger(#[source] Box<crate::ledger::LedgerError>),
    #[error(transparent)]
    Catalogue(#[from] CatalogueError),
    #[error("node-link certificate")]
    Tls(#[from] TlsError),
    #[error("binding {what} on {addr}")]
    Bind {
        what: &'static str,
        addr: SocketAddr,
        source: io::Error,
    },
    #[error("gRPC reflection descriptors")]
    Reflection(#[from] tonic_reflection::server::Error),
    #[error("gRPC server failed")]
    Grpc(#[from] tonic::transport::Error),
    #[error("HTTP server failed")]
    Http(#[source] io::Error),
    #[error("a server task panicked")]
    Panicked(#[from] tokio::task::JoinError),
}
