//! Calls that need no key (Models, Network, reflection) are admitted under
//! their own cap (`limits.max_public_in_flight`), against a real listener:
//! unauthenticated streams held open cannot take the in-flight slots of
//! authenticated calls, and are themselves bounded.

use mlxnet_proto::v1::{
    accounts_client::AccountsClient, models_client::ModelsClient, BalanceRequest, ListModelsRequest,
};
use tokio_stream::wrappers::ReceiverStream;
use tonic::Code;
use tonic_reflection::pb::v1::{
    server_reflection_client::ServerReflectionClient, ServerReflectionRequest,
    ServerReflectionResponse,
};

use crate::test_utils::{spawn_app, Authed, TestApp};

/// An unauthenticated reflection stream, held open while the value lives.
type Held = (
    tokio::sync::mpsc::Sender<ServerReflectionRequest>,
    tonic::Streaming<ServerReflectionResponse>,
);

async fn open_stream(app: &TestApp) -> Result<Held, Code> {
    let mut client: ServerReflectionClient<Authed> =
        ServerReflectionClient::new(app.grpc_with(None).await);
    let (tx, rx) = tokio::sync::mpsc::channel(1);
    let resp = client
        .server_reflection_info(ReceiverStream::new(rx))
        .await
        .map_err(|s| s.code())?;
    Ok((tx, resp.into_inner()))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unauthenticated_streams_cannot_take_the_slots_of_authenticated_calls() {
    const SLOTS: usize = 4;
    let app = spawn_app(|c| {
        c.limits.max_in_flight_requests = SLOTS;
        c.limits.max_public_in_flight = 2 * SLOTS;
    })
    .await;
    let mut held = Vec::new();
    for _ in 0..SLOTS {
        held.push(open_stream(&app).await.expect("a public stream"));
    }
    // Every global slot would be taken by now if public calls held them.
    let balance = AccountsClient::new(app.grpc().await)
        .balance(BalanceRequest::default())
        .await;
    assert!(
        balance.is_ok(),
        "an authenticated call was refused while {SLOTS} unauthenticated streams were open: {balance:?}"
    );
    // Public calls have their own bound: past it they are refused at once,
    // while authenticated calls still pass.
    for _ in SLOTS..2 * SLOTS {
        held.push(open_stream(&app).await.expect("a public stream"));
    }
    let refused = ModelsClient::new(app.grpc_with(None).await)
        .list(ListModelsRequest {})
        .await
        .expect_err("a public call past max_public_in_flight");
    assert_eq!(refused.code(), Code::ResourceExhausted, "{refused:?}");
    AccountsClient::new(app.grpc().await)
        .balance(BalanceRequest::default())
        .await
        .unwrap();
    drop(held);
    app.stop().await;
}
