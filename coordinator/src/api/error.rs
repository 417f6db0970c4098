//! What a client request can end in, and its one mapping to the wire
//! (`From<ApiError> for tonic::Status`).
//!
//! Client mistakes carry a message meant for the client;
//! [`ApiError::Internal`] and [`ApiError::Ledger`] are logged with their
//! whole chain and sent as a generic message, so database text never leaks.

use mlxnet_proto::money::mlx;

use crate::{ledger::LedgerError, store::StoreError, util::error_chain};

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
    /// The balance cannot cover the job's hold (gRPC: FAILED_PRECONDITION;
    /// HTTP: 402).
    #[error("{0}")]
    InsufficientFunds(String),
    /// No online node or pod could ever hold the job (gRPC:
    /// FAILED_PRECONDITION; HTTP: 503).
    #[error("{0}")]
    NoNode(String),
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
            } => ApiError::InsufficientFunds(format!(
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
            LedgerError::ParentKeyGone => ApiError::Unauthenticated,
            other => ApiError::Ledger(other),
        }
    }
}

impl From<crate::domain::InvalidScopes> for ApiError {
    fn from(e: crate::domain::InvalidScopes) -> Self {
        ApiError::InvalidArgument(e.0.to_owned())
    }
}

impl From<ApiError> for tonic::Status {
    fn from(err: ApiError) -> Self {
        match err {
            ApiError::InvalidArgument(m) => tonic::Status::invalid_argument(m),
            ApiError::NotFound(m) => tonic::Status::not_found(m),
            ApiError::ResourceExhausted(m) => tonic::Status::resource_exhausted(m),
            ApiError::FailedPrecondition(m)
            | ApiError::InsufficientFunds(m)
            | ApiError::NoNode(m) => tonic::Status::failed_precondition(m),
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
