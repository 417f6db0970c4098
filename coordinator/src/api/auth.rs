//! Authentication of the client API: a tower layer in front of every gRPC
//! service. It reads `authorization: Bearer <key>`, looks the key up in the
//! ledger (by hash), checks the scope the method needs, and hands the
//! [`Caller`] to the handler in the request's extensions.
//!
//! # Invariants
//! - Models, Network, health and reflection are public; every other method
//!   of `mlxnet.v1` needs a key with its scope (see [`required`]).
//! - A missing, malformed, unknown, revoked or expired key gets the same
//!   status (UNAUTHENTICATED) and the same message; the database is asked
//!   the same question in every case but a missing header.
//! - A valid key without the scope gets PERMISSION_DENIED naming the scope.
//! - Abuse limits ([`super::limits`]) are checked here too. A method that
//!   needs no key takes a slot of the public cap before anything else, so
//!   unauthenticated calls never hold the slots authenticated ones need. A
//!   method that needs a key is refused at once when no global slot is
//!   free (overload is shed before the database is asked); a key this
//!   replica does not know is looked up holding a slot of the small cap of
//!   key lookups, so made-up keys never hold a global slot; once the key is
//!   known, the request takes a global slot, a rate token and an in-flight
//!   slot of its key ([`admit_keyed`]). The slots are held until the
//!   response body ends ([`Held`]).
//!
//! # Failure
//! A database error while looking up a key is INTERNAL (logged), never a
//! pass.

use std::{
    sync::Arc,
    task::{Context, Poll},
};

use futures::future::BoxFuture;
use tonic::codegen::http;

use crate::{
    api::error::ApiError,
    domain::{Caller, Scope},
    ledger::Ledger,
    util::{net::Held, now_ms},
};

use super::limits::{Admission, Permit};

/// The health service: cheap, and answered even under overload.
const HEALTH: &str = "/grpc.health.";

/// What a method needs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Access {
    Public,
    Needs(Scope),
}

/// The access each gRPC method path needs.
pub fn required(path: &str) -> Access {
    const PUBLIC: [&str; 4] = [
        "/mlxnet.v1.Models/",
        "/mlxnet.v1.Network/",
        "/grpc.health.",
        "/grpc.reflection.",
    ];
    if PUBLIC.iter().any(|p| path.starts_with(p)) {
        return Access::Public;
    }
    Access::Needs(match path {
        "/mlxnet.v1.Jobs/Submit" | "/mlxnet.v1.Jobs/Cancel" => Scope::Submit,
        "/mlxnet.v1.Accounts/CreateApiKey" | "/mlxnet.v1.Accounts/RevokeApiKey" => Scope::Submit,
        "/mlxnet.v1.Accounts/CreateAccount" | "/mlxnet.v1.Accounts/Grant" => Scope::Admin,
        _ => Scope::Read,
    })
}

/// The caller a handler runs for (set by the layer).
pub fn caller<T>(req: &tonic::Request<T>) -> Result<Caller, ApiError> {
    req.extensions()
        .get::<Caller>()
        .cloned()
        .ok_or(ApiError::Unauthenticated)
}

/// The layer; see the module docs.
#[derive(Clone, Debug)]
pub struct AuthLayer {
    ledger: Ledger,
    admission: Arc<Admission>,
}

impl AuthLayer {
    pub fn new(ledger: Ledger, admission: Arc<Admission>) -> Self {
        Self { ledger, admission }
    }
}

impl<S> tower::Layer<S> for AuthLayer {
    type Service = Auth<S>;

    fn layer(&self, inner: S) -> Auth<S> {
        Auth {
            inner,
            ledger: self.ledger.clone(),
            admission: Arc::clone(&self.admission),
        }
    }
}

/// The service the layer wraps around the gRPC routes.
#[derive(Clone, Debug)]
pub struct Auth<S> {
    inner: S,
    ledger: Ledger,
    admission: Arc<Admission>,
}

/// Admits a request that needs a key (also used by the OpenAI-compatible
/// HTTP API): the caller behind `headers`' bearer key, if it has `scope`,
/// and the permit to hold until its response ends (a global slot and one
/// of the key's). Overload is shed first, before the database is asked; a
/// key this replica does not know is looked up holding a slot of the small
/// cap of key lookups, never a global slot; the global slot is taken once
/// the key is known (see [`super::limits`]).
pub async fn admit_keyed(
    ledger: &Ledger,
    admission: &Admission,
    headers: &http::HeaderMap,
    scope: Scope,
) -> Result<(Caller, Permit), ApiError> {
    admission.shed_overload()?;
    let presented = headers
        .get(http::header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .map(str::trim)
        .ok_or(ApiError::Unauthenticated)?;
    let caller = match ledger.known_key(presented, now_ms()) {
        Some(caller) => caller,
        // Looked up again after the wait in line: a key the calls before
        // it looked up is known by then (`Ledger::authenticate` asks the
        // cache first).
        None => {
            let _lookup = admission.admit_lookup().await?;
            ledger
                .authenticate(presented, now_ms())
                .await?
                .ok_or(ApiError::Unauthenticated)?
        }
    };
    if !caller.scopes.allows(scope) {
        return Err(ApiError::PermissionDenied(format!(
            "this API key lacks the {} scope",
            scope.as_str()
        )));
    }
    let mut permit = admission.admit_anonymous()?;
    admission.admit_key(&mut permit, &caller)?;
    Ok((caller, permit))
}

impl<S, ReqBody, ResBody> tower::Service<http::Request<ReqBody>> for Auth<S>
where
    S: tower::Service<http::Request<ReqBody>, Response = http::Response<ResBody>>
        + Clone
        + Send
        + 'static,
    S::Future: Send + 'static,
    ReqBody: Send + 'static,
    ResBody: Default + Send + 'static,
{
    type Response = http::Response<Held<ResBody, Permit>>;
    type Error = S::Error;
    type Future = BoxFuture<'static, Result<Self::Response, Self::Error>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, mut req: http::Request<ReqBody>) -> Self::Future {
        // The clone is ready only if polled; swap so the ready one serves.
        let clone = self.inner.clone();
        let mut inner = std::mem::replace(&mut self.inner, clone);
        let ledger = self.ledger.clone();
        let admission = Arc::clone(&self.admission);
        Box::pin(async move {
            let refuse = |e: ApiError| {
                tonic::Status::from(e)
                    .into_http()
                    .map(|b| Held::new(b, None))
            };
            if req.uri().path().starts_with(HEALTH) {
                return Ok(inner.call(req).await?.map(|b| Held::new(b, None)));
            }
            let permit = match required(req.uri().path()) {
                Access::Public => match admission.admit_public() {
                    Ok(p) => p,
                    Err(e) => return Ok(refuse(e.into())),
                },
                Access::Needs(scope) => {
                    match admit_keyed(&ledger, &admission, req.headers(), scope).await {
                        Ok((caller, permit)) => {
                            req.extensions_mut().insert(caller);
                            permit
                        }
                        Err(e) => return Ok(refuse(e)),
                    }
                }
            };
            Ok(inner.call(req).await?.map(|b| Held::new(b, Some(permit))))
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_client_method_has_its_scope() {
        assert_eq!(required("/mlxnet.v1.Models/List"), Access::Public);
        assert_eq!(required("/mlxnet.v1.Network/Stats"), Access::Public);
        assert_eq!(required("/grpc.health.v1.Health/Check"), Access::Public);
        assert_eq!(
            required("/mlxnet.v1.Jobs/Submit"),
            Access::Needs(Scope::Submit)
        );
        assert_eq!(
            required("/mlxnet.v1.Jobs/Watch"),
            Access::Needs(Scope::Read)
        );
        assert_eq!(
            required("/mlxnet.v1.Accounts/Grant"),
            Access::Needs(Scope::Admin)
        );
        assert_eq!(
            required("/mlxnet.v1.Anything/New"),
            Access::Needs(Scope::Read)
        );
    }
}
