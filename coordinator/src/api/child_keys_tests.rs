//! Keys made with a key (CreateApiKey) are its children, against a real
//! coordinator: a child never outlives its parent's expiry, and revoking a
//! key revokes every key made under it, while keys not made under it keep
//! working.

use mlxnet_proto::v1::{
    accounts_client::AccountsClient, CreateApiKeyRequest, CreateApiKeyResponse, ListApiKeysRequest,
    RevokeApiKeyRequest,
};
use tonic::Code;

use crate::{test_utils::spawn_app, test_utils::TestApp, util::now_ms};

async fn make_key(app: &TestApp, with: &str, ttl_seconds: u64) -> CreateApiKeyResponse {
    AccountsClient::new(app.grpc_with(Some(with)).await)
        .create_api_key(CreateApiKeyRequest {
            scopes: vec!["read".into(), "submit".into()],
            label: "child".into(),
            ttl_seconds,
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner()
}

/// Whether `key` is accepted for a read call.
async fn works(app: &TestApp, key: &str) -> Result<(), Code> {
    AccountsClient::new(app.grpc_with(Some(key)).await)
        .list_api_keys(ListApiKeysRequest::default())
        .await
        .map(|_| ())
        .map_err(|s| s.code())
}

#[tokio::test]
async fn a_child_key_never_outlives_its_parents_expiry() {
    let app = spawn_app(|_| {}).await;
    let parent = make_key(&app, &app.client_key, 3600).await;
    assert!(parent.expires_at_ms > now_ms());
    // Asked for no expiry, or a later one: it expires with its parent.
    for ttl in [0, 7 * 24 * 3600] {
        let child = make_key(&app, &parent.api_key, ttl).await;
        assert!(
            child.expires_at_ms != 0 && child.expires_at_ms <= parent.expires_at_ms,
            "a child asked for ttl {ttl} s expires at {} (0 = never); its parent at {}",
            child.expires_at_ms,
            parent.expires_at_ms
        );
        let after = parent.expires_at_ms + 1;
        assert_eq!(
            app.ledger
                .authenticate(&child.api_key, after)
                .await
                .unwrap(),
            None,
            "the child still authenticates after its parent expired"
        );
    }
    // A shorter expiry than the parent's is kept.
    let short = make_key(&app, &parent.api_key, 60).await;
    assert!(short.expires_at_ms < parent.expires_at_ms);
    app.stop().await;
}

#[tokio::test]
async fn revoking_a_key_revokes_every_key_made_under_it() {
    let app = spawn_app(|_| {}).await;
    let parent = make_key(&app, &app.client_key, 0).await;
    let child = make_key(&app, &parent.api_key, 0).await;
    let grandchild = make_key(&app, &child.api_key, 0).await;
    let sibling = make_key(&app, &app.client_key, 0).await;
    works(&app, &grandchild.api_key).await.unwrap();
    AccountsClient::new(app.grpc().await)
        .revoke_api_key(RevokeApiKeyRequest {
            key_id: parent.key_id.clone(),
        })
        .await
        .unwrap();
    for (what, key) in [
        ("the revoked key", &parent.api_key),
        ("its child", &child.api_key),
        ("its grandchild", &grandchild.api_key),
    ] {
        assert_eq!(
            works(&app, key).await,
            Err(Code::Unauthenticated),
            "{what} still works after the revoke"
        );
    }
    // Keys not made under it are untouched.
    works(&app, &sibling.api_key).await.unwrap();
    works(&app, &app.client_key).await.unwrap();
    app.stop().await;
}
