//! The ledger through the client API, against a real coordinator: keys are
//! checked the same way whatever is wrong with them; a client who cannot pay
//! is refused at submit; a verified job moves exactly its price to the
//! node's operator, less the fee, and the views show it.

use mlxnet_proto::{
    claim,
    frame::write_frame,
    v1::{
        accounts_client::AccountsClient, job_event, job_update, jobs_client::JobsClient,
        models_client::ModelsClient, BalanceRequest, CancelJobRequest, CreateApiKeyRequest,
        EarningsRequest, GetJobRequest, HistoryRequest, JobUpdate, ListJobsRequest,
        ListModelsRequest, ResultClaim, RevokeApiKeyRequest, WatchJobRequest,
    },
};
use tonic::Code;

use crate::{
    ledger::{keys::Scopes, AccountKind, FEE},
    store::Store,
    test_utils::{prompt_job as job, spawn_app, FakeNode, CLIENT_GRANT},
};

#[tokio::test]
async fn missing_wrong_revoked_and_expired_keys_are_indistinguishable() {
    let app = spawn_app(|_| {}).await;
    // Public methods need no key.
    ModelsClient::new(app.grpc_with(None).await)
        .list(ListModelsRequest {})
        .await
        .unwrap();

    let mut accounts = AccountsClient::new(app.grpc().await);
    let revoked = accounts
        .create_api_key(CreateApiKeyRequest {
            scopes: vec!["read".into()],
            label: "to revoke".into(),
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    assert!(revoked.api_key.starts_with("mlxk_"));
    accounts
        .revoke_api_key(RevokeApiKeyRequest {
            key_id: revoked.key_id.clone(),
        })
        .await
        .unwrap();
    let expired = app
        .ledger
        .create_key(
            &app.client_account,
            Scopes::from_list(["read"]).unwrap(),
            "",
            Some(1),
        )
        .await
        .unwrap();
    let unknown = format!("mlxk_{}", "0".repeat(64));
    let mut seen = Vec::new();
    for key in [
        None,
        Some("not a key"),
        Some(unknown.as_str()),
        Some(revoked.api_key.as_str()),
        Some(expired.secret()),
    ] {
        let err = JobsClient::new(app.grpc_with(key).await)
            .list(ListJobsRequest { limit: 1 })
            .await
            .unwrap_err();
        seen.push((err.code(), err.message().to_owned()));
    }
    assert_eq!(seen[0].0, Code::Unauthenticated);
    assert!(
        seen.iter().all(|s| *s == seen[0]),
        "every bad key reads the same: {seen:?}"
    );

    // A valid key without the scope: refused, and it says which scope.
    let read_only = accounts
        .create_api_key(CreateApiKeyRequest {
            scopes: vec!["read".into()],
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    let err = JobsClient::new(app.grpc_with(Some(&read_only.api_key)).await)
        .submit(job("hi", 4))
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::PermissionDenied);
    assert!(err.message().contains("submit"), "{}", err.message());
    // No escalation: a non-admin key cannot mint an admin key.
    let err = accounts
        .create_api_key(CreateApiKeyRequest {
            scopes: vec!["admin".into()],
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::PermissionDenied);
    app.stop().await;
}

#[tokio::test]
async fn too_small_a_balance_is_refused_at_submit_with_no_job() {
    let app = spawn_app(|_| {}).await;
    let poor = app
        .ledger
        .create_account("poor", AccountKind::Client)
        .await
        .unwrap();
    app.ledger
        .grant("poor", &poor.id, 10, "a little")
        .await
        .unwrap();
    let key = app
        .ledger
        .create_key(
            &poor.id,
            Scopes::from_list(["submit", "read"]).unwrap(),
            "",
            None,
        )
        .await
        .unwrap();
    let channel = app.grpc_with(Some(key.secret())).await;
    let mut jobs = JobsClient::new(channel.clone());
    let err = jobs
        .submit(job("Tell me a long story", 2000))
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::FailedPrecondition, "{err:?}");
    assert!(
        err.message().contains("insufficient balance") && err.message().contains("10 micro-MLX"),
        "{}",
        err.message()
    );
    let listed = jobs
        .list(ListJobsRequest { limit: 10 })
        .await
        .unwrap()
        .into_inner();
    assert!(listed.jobs.is_empty(), "no job was made");
    let b = AccountsClient::new(channel)
        .balance(BalanceRequest {})
        .await
        .unwrap()
        .into_inner();
    assert_eq!((b.balance_micro_mlx, b.held_micro_mlx), (10, 0));

    // The client's own price limit is honoured the same way.
    let mut capped = job("hi", 200);
    capped.max_price_micro_mlx = 1;
    let err = JobsClient::new(app.grpc().await)
        .submit(capped)
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::FailedPrecondition);
    assert!(err.message().contains("max_price"), "{}", err.message());
    app.stop().await;
}

#[tokio::test]
async fn a_verified_job_moves_exactly_its_price_and_a_cancelled_one_nothing() {
    let app = spawn_app(|_| {}).await;
    let channel = app.grpc().await;
    let mut jobs = JobsClient::new(channel.clone());
    let mut accounts = AccountsClient::new(channel);
    let node = FakeNode::register(&app, 21).await;
    let node_hex = hex::encode(node.key.verifying_key().to_bytes());
    let operator = app
        .ledger
        .create_account("owner", AccountKind::Operator)
        .await
        .unwrap();
    app.ledger.link_node(&node_hex, &operator.id).await.unwrap();
    let models = ModelsClient::new(app.grpc().await)
        .list(ListModelsRequest {})
        .await
        .unwrap()
        .into_inner();
    let (pin, pout) = (
        models.models[0].price_input_micro_mlx_per_mtok,
        models.models[0].price_output_micro_mlx_per_mtok,
    );
    assert!(pin > 0 && pout > pin);

    let request = job("The capital of France is", 300);
    let input = request.input.clone().unwrap();
    let submitted = jobs.submit(request).await.unwrap().into_inner();
    let held = accounts
        .balance(BalanceRequest {})
        .await
        .unwrap()
        .into_inner();
    assert_eq!(held.balance_micro_mlx, CLIENT_GRANT);
    assert!(held.held_micro_mlx > 0);
    assert_eq!(held.available_micro_mlx, CLIENT_GRANT - held.held_micro_mlx);

    let (mut send, _recv, a) = node.next_assignment().await;
    let (prompt_tokens, completion_tokens) = (6u32, 250u32);
    let c = ResultClaim {
        job_id: submitted.id.clone(),
        attempt: a.attempt,
        model_sha256: a.model_sha256.clone(),
        prompt_sha256: claim::input_digest(&input).to_vec(),
        output_token_ids: vec![7; completion_tokens as usize],
        output_text: " Paris".into(),
        prompt_tokens,
        completion_tokens,
        node_id: node.key.verifying_key().to_bytes().to_vec(),
        finish_reason: "length".into(),
        ..Default::default()
    };
    let mut watch = jobs
        .watch(WatchJobRequest {
            job_id: submitted.id.clone(),
        })
        .await
        .unwrap()
        .into_inner();
    // A claim covers what its attempt streamed.
    write_frame(&mut send, &crate::test_utils::tokens_of(0, &c))
        .await
        .unwrap();
    write_frame(
        &mut send,
        &JobUpdate {
            msg: Some(job_update::Msg::Result(claim::sign(c, &node.key))),
        },
    )
    .await
    .unwrap();
    while let Some(e) = watch.message().await.unwrap() {
        if matches!(e.event, Some(job_event::Event::Completed(_))) {
            break;
        }
    }
    // Settlement runs right after the store accepts the result; the
    // balance read waits for nothing else.
    let price = (u64::from(prompt_tokens) * pin + u64::from(completion_tokens) * pout)
        .div_ceil(1_000_000) as i64;
    let fee = price * 500 / 10_000;
    let after = accounts
        .balance(BalanceRequest {})
        .await
        .unwrap()
        .into_inner();
    assert_eq!(
        after.balance_micro_mlx,
        CLIENT_GRANT - price,
        "exactly the price moved"
    );
    assert_eq!(after.held_micro_mlx, 0, "the rest of the hold is released");
    let owner = app.ledger.account(&operator.id).await.unwrap().unwrap();
    assert_eq!(owner.balance(), price - fee);
    assert_eq!(
        app.ledger.account(FEE).await.unwrap().unwrap().balance(),
        fee
    );

    let history = accounts
        .history(HistoryRequest { limit: 10 })
        .await
        .unwrap()
        .into_inner()
        .entries;
    let memos: Vec<_> = history.iter().map(|e| e.memo.as_str()).collect();
    assert_eq!(memos, ["post", "hold", "starting balance"]);
    let net: i64 = history.iter().map(|e| e.amount_micro_mlx).sum();
    assert_eq!(
        net, after.available_micro_mlx,
        "history sums to the available balance"
    );

    let op_key = app
        .ledger
        .create_key(&operator.id, Scopes::from_list(["read"]).unwrap(), "", None)
        .await
        .unwrap();
    // The node's audit record as the store keeps it.
    app.ledger
        .store()
        .count_record(
            &node_hex,
            &crate::domain::RecordDelta {
                clean: 3,
                failed: 1,
                ..Default::default()
            },
        )
        .await
        .unwrap();
    let earnings = AccountsClient::new(app.grpc_with(Some(op_key.secret())).await)
        .earnings(EarningsRequest {})
        .await
        .unwrap()
        .into_inner();
    let today = earnings.today.unwrap();
    assert_eq!(
        (today.micro_mlx, today.jobs, today.tokens),
        (price - fee, 1, u64::from(completion_tokens))
    );
    assert_eq!(earnings.nodes.len(), 1);
    assert_eq!(earnings.nodes[0].node_id, node_hex);
    assert_eq!(
        (
            earnings.nodes[0].audits_passed,
            earnings.nodes[0].audits_failed,
            earnings.nodes[0].banned
        ),
        (3, 1, false)
    );
    // The running reward epoch ends within one epoch from now.
    let now = crate::util::now_ms();
    let epoch = app.ledger.config().reward_epoch_ms;
    assert!(
        earnings.next_reward_epoch_ms > now - 60_000
            && earnings.next_reward_epoch_ms <= now + epoch
            && earnings.next_reward_epoch_ms % epoch == 0,
        "{} (now {now}, epoch {epoch})",
        earnings.next_reward_epoch_ms
    );

    // Another account cannot see the job; a cancelled job costs nothing.
    let stranger = app
        .ledger
        .create_account("stranger", AccountKind::Client)
        .await
        .unwrap();
    let skey = app
        .ledger
        .create_key(
            &stranger.id,
            Scopes::from_list(["read", "submit"]).unwrap(),
            "",
            None,
        )
        .await
        .unwrap();
    let err = JobsClient::new(app.grpc_with(Some(skey.secret())).await)
        .get(GetJobRequest {
            job_id: submitted.id.clone(),
        })
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::NotFound);
    let second = jobs
        .submit(job("Count to a million", 64))
        .await
        .unwrap()
        .into_inner();
    let _assigned = node.next_assignment().await;
    jobs.cancel(CancelJobRequest {
        job_id: second.id.clone(),
    })
    .await
    .unwrap();
    let end = accounts
        .balance(BalanceRequest {})
        .await
        .unwrap()
        .into_inner();
    assert_eq!(
        (end.balance_micro_mlx, end.held_micro_mlx),
        (CLIENT_GRANT - price, 0),
        "a cancelled job's hold is voided"
    );
    app.stop().await;
}
