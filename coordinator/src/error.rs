//! Errors at the coordinator's edges, and their one mapping to the wire.
//!
//! [`ApiError`] is what a client request can end in. Client mistakes carry a
//! message meant for the client; [`ApiError::Internal`] is logged with its
//! whole chain and sent as a generic message, so database text never leaks.
//! [`AppError`] is what starting or running the application can end in.

use std::{io, net::SocketAddr};

use crate::{catalogue::CatalogueError, link::tls::TlsError, store::StoreError};

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
    #[error("internal error")]
    Internal(#[from] StoreError),
}

impl From<ApiError> for tonic::Status {
    fn from(err: ApiError) -> Self {
        match err {
            ApiError::InvalidArgument(m) => tonic::Status::invalid_argument(m),
            ApiError::NotFound(m) => tonic::Status::not_found(m),
            ApiError::ResourceExhausted(m) => tonic::Status::resource_exhausted(m),
            ApiError::FailedPrecondition(m) => tonic::Status::failed_precondition(m),
            ApiError::Internal(source) => {
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

/// `err` and all its sources, joined by ": ".
pub fn error_chain(err: &dyn std::error::Error) -> String {
    let mut out = err.to_string();
    let mut source = err.source();
    while let Some(s) = source {
        out.push_str(": ");
        out.push_str(&s.to_string());
        source = s.source();
    }
    out
}
