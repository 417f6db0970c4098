//! The caller's side of the client API's authentication: every call
//! carries `authorization: Bearer <key>`. Shared by the `mlxnet` client,
//! `mlx-node earnings`, the test harnesses and the benches.
//!
//! # Failure
//! A key must be printable ASCII without inner whitespace (what the
//! coordinator issues): [`Bearer::for_key`] refuses anything else with
//! [`BadKey`] before a call is made. (A header value alone would let
//! bytes above 0x7f through, and the coordinator would then refuse the
//! key with a less telling message.)

use tonic::{
    metadata::AsciiMetadataValue,
    service::{interceptor::InterceptedService, Interceptor},
    transport::Channel,
};

/// Sends `authorization: Bearer <key>` on every call (nothing without a key).
#[derive(Clone, Debug, Default)]
pub struct Bearer(pub Option<AsciiMetadataValue>);

impl Bearer {
    /// The interceptor for `key` (surrounding whitespace trimmed), or one
    /// that sends nothing.
    pub fn for_key(key: Option<&str>) -> Result<Self, BadKey> {
        let Some(key) = key.map(str::trim) else {
            return Ok(Self(None));
        };
        if key.is_empty() || !key.bytes().all(|b| b.is_ascii_graphic()) {
            return Err(BadKey);
        }
        let value = format!("Bearer {key}").parse().map_err(|_| BadKey)?;
        Ok(Self(Some(value)))
    }
}

/// An API key that cannot travel as a header (empty, not ASCII, or with
/// whitespace or control characters inside).
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[error("an API key is printable ASCII without spaces")]
pub struct BadKey;

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
        for bad in ["caf\u{e9}", "a b", "a\tb", "", "  "] {
            assert_eq!(Bearer::for_key(Some(bad)).unwrap_err(), BadKey, "{bad:?}");
        }
    }
}
