//! The ledger end to end, with a real node running the real model: a client
//! too poor for a job is refused at submit and no job exists; a completed job
//! moves exactly its price (from the signed claim's token counts and the
//! catalogue's prices) from the client to the node's operator, less the fee;
//! and `mlx-node earnings` shows it.

use mlxnet_proto::v1::{
    BalanceRequest, CreateAccountRequest, CreateApiKeyRequest, GrantRequest, JobState,
    ListJobsRequest,
};
use mlxnet_tests::{
    chat_job, coordinator_config, spawn_coordinator, spawn_node, state, test_model, CLIENT_GRANT,
};
use tonic::Code;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_job_is_paid_exactly_its_price_and_the_owner_sees_it() -> anyhow::Result<()> {
    test_model();
    let dir = tempfile::tempdir()?;
    let coord = spawn_coordinator(coordinator_config(&dir.path().join("coord"))).await?;
    let mut node = spawn_node(coord.node_config(&dir.path().join("n"), "n")).await?;
    node.registered().await?;

    // A client with 1 micro-MLX: refused at submit, and no job is made.
    let mut admin = coord.client_with(Some(&coord.accounts.admin_key)).await?;
    let poor = admin
        .accounts
        .create_account(CreateAccountRequest {
            name: "poor".into(),
            kind: "client".into(),
        })
        .await?
        .into_inner();
    admin
        .accounts
        .grant(GrantRequest {
            account_id: poor.account_id.clone(),
            amount_micro_mlx: 1,
            idempotency_key: "poor".into(),
            memo: String::new(),
        })
        .await?;
    let key = admin
        .accounts
        .create_api_key(CreateApiKeyRequest {
            account_id: poor.account_id.clone(),
            scopes: vec!["submit".into(), "read".into()],
            ..Default::default()
        })
        .await?
        .into_inner();
    let mut poor_client = coord.client_with(Some(&key.api_key)).await?;
    let err = poor_client
        .jobs
        .submit(chat_job("What is the capital of France?", 32))
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::FailedPrecondition, "{err:?}");
    assert!(
        err.message().contains("insufficient balance"),
        "{}",
        err.message()
    );
    let listed = poor_client.jobs.list(ListJobsRequest { limit: 10 }).await?;
    assert!(listed.into_inner().jobs.is_empty());

    // The funded client's job runs on the real node and is paid from the claim.
    let mut client = coord.client().await?;
    let run = client
        .run_job(chat_job("What is the capital of France?", 24))
        .await?;
    assert_eq!(state(&run.job), JobState::Completed);
    let (c, model) = client.claim_and_model(&run.job).await?;
    let (price, fee) = mlxnet_tests::price_of(&c, &model);
    assert!(price > 0);
    let b = client
        .accounts
        .balance(BalanceRequest {})
        .await?
        .into_inner();
    assert_eq!(
        b.balance_micro_mlx,
        CLIENT_GRANT - price,
        "exactly the price moved"
    );
    assert_eq!(b.held_micro_mlx, 0);

    // What the owner's `mlx-node earnings` prints.
    let grpc = format!("http://{}", coord.grpc_addr);
    let earned = mlx_node::earnings::fetch(&grpc, &coord.accounts.operator_key).await?;
    let all = earned.all_time.unwrap_or_default();
    assert_eq!(
        (all.micro_mlx, all.jobs, all.tokens),
        (price - fee, 1, u64::from(c.completion_tokens))
    );
    let report = mlx_node::earnings::render(&earned, &node.id.to_string());
    assert!(
        report.contains(&format!("node {} (this node)", node.id)),
        "{report}"
    );
    // A wrong key reads the same as a revoked one, also from the node's tool.
    let wrong = mlx_node::earnings::fetch(&grpc, "mlxk_wrong")
        .await
        .unwrap_err();
    assert!(wrong.to_string().contains("Unauthenticated"), "{wrong}");
    node.stop().await?;
    coord.stop().await?;
    Ok(())
}
