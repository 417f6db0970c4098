//! The caller's side of the client API's authentication: every call
//! carries `authorization: Bearer <key>`. Shared by the `mlxnet` client,
//! `mlx-node earnings`, the test harnesses and the benches.
//!
//! # Failure
//! A key that is not printable ASCII cannot be a header value:
//! [`Bearer::for_key`] refuses it with `InvalidMetadataValue`.

use tonic::{
    metadata::{errors::InvalidMetadataValue, AsciiMetadataValue},
    service::{interceptor::InterceptedService, Interceptor},
    transport::Channel,
};

/// Sends `authorization: Bearer <key>` on every call (nothing without a key).
#[derive(Clone, Debug, Default)]
pub struct Bearer(pub Option<AsciiMetadataValue>);

impl Bearer {
    /// The interceptor for `key` (surrounding whitespace trimmed), or one
    /// that sends nothing.
    pub fn for_key(key: Option<&str>) -> Result<Self, InvalidMetadataValue> {
        Ok(Self(
            key.map(|k| format!("Bearer {}", k.trim()).parse())
                .transpose()?,
        ))
    }
}

impl Interceptor for Bearer {
    fn call(&mut self, mut req: tonic::Request<()>) -> Result<tonic::Request<()>, tonic::Status> {
        if let Some(v) = &self.0 {
            req.metadata_mut().insert("authorization", v.clone());
        }
        Ok(req)
    }
}

/// A channel whose calls carry an API key.
pub type Authed = InterceptedService<Channel, Bearer>;

/// `channel` with every call carrying `bearer`.
pub fn authed(channel: Channel, bearer: Bearer) -> Authed {
    InterceptedService::new(channel, bearer)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_key_becomes_one_header_and_no_key_none() {
        let mut with = Bearer::for_key(Some(" mlxk_ab \n")).unwrap();
        let req = with.call(tonic::Request::new(())).unwrap();
        assert_eq!(
            req.metadata().get("authorization").unwrap(),
            "Bearer mlxk_ab"
        );
        let mut without = Bearer::for_key(None).unwrap();
        let req = without.call(tonic::Request::new(())).unwrap();
        assert!(req.metadata().get("authorization").is_none());
        assert!(Bearer::for_key(Some("caf\u{e9}")).is_err());
    }
}
