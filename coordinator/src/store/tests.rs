//! The store's conformance suite: one contract per function, each run on
//! every backend compiled in through [`store_contracts!`]: SQLite in a
//! temporary directory, PostgreSQL in a fresh database on the server
//! [`crate::test_utils::postgres::PG_URL_VAR`] names (`scripts/pg-test-server.sh` starts one).
//!
//! Without that variable the PostgreSQL contracts say so and pass, except
//! under CI (`CI` set), where they fail: CI must run both backends.
//!
//! The contracts cover what the layers above rely on: jobs and their
//! guarded transitions, attempts, hand-off segments, nodes, accounts and
//! transfers (guarded balances, immutable rows read back), holds (open until
//! resolved once, due after their deadline), submits' batch reads, operator
//! links, rewards, API keys and audits, write transactions (one state,
//! nothing kept unless committed), and the singleton duties' leases (one
//! holder, a higher epoch on takeover, a stale holder's fenced write refused).

use std::collections::HashSet;

use mlxnet_proto::{
    ids::JobId,
    v1::{job_input, JobInput, ResultClaim, SamplingParams, SignedClaim},
};

use super::{Anomaly, AnyStore, NewKey, OpenHold, Side, Store, StoreError, StoreTx};
use crate::domain::liveness_lease;
use crate::domain::{
    Account, AccountKind, AttemptEnd, AuditRecord, CancelOutcome, Completion, JobRecord, JobState,
    JobTerms, KeyLimits, Lease, NewJob, NodeRecord, Price, RecordDelta, Scopes, Segment, Streamed,
    StreamedEnd, Transfer, TransferKind,
};

/// A backend under test: a fresh, empty database, and a way to open the
/// same database again.
#[allow(async_fn_in_trait)]
pub(crate) trait Backend: Sized {
    /// `None` when the backend cannot run here (e.g. no server): its
    /// contracts are skipped.
    async fn fresh() -> Option<Self>;
    fn store(&self) -> &AnyStore;
    /// Connects again to the same database (after the store was closed).
    async fn reopen(&mut self);
    /// A second handle on the same database with connections of its own,
    /// as another replica has.
    async fn another(&self) -> AnyStore;
}

/// SQLite in a temporary directory.
pub(crate) struct Sqlite {
    dir: tempfile::TempDir,
    store: AnyStore,
}

impl Sqlite {
    fn url(dir: &tempfile::TempDir) -> String {
        format!("sqlite://{}", dir.path().join("t.db").display())
    }
}

impl Backend for Sqlite {
    async fn fresh() -> Option<Self> {
        let dir = tempfile::tempdir().unwrap();
        let store = AnyStore::connect(&Self::url(&dir)).await.unwrap();
        Some(Self { dir, store })
    }

    fn store(&self) -> &AnyStore {
        &self.store
    }

    async fn reopen(&mut self) {
        self.store = AnyStore::connect(&Self::url(&self.dir)).await.unwrap();
    }

    async fn another(&self) -> AnyStore {
        AnyStore::connect(&Self::url(&self.dir)).await.unwrap()
    }
}

pub(crate) use crate::test_utils::postgres::pg_server_url;

/// A fresh, empty database on the server at `server` (the URL of one of
/// its databases): its URL.
pub(crate) async fn pg_fresh_database(server: &str) -> String {
    crate::store::postgres::fresh_database(server)
        .await
        .unwrap()
}

/// PostgreSQL: a database of its own on the test server.
pub(crate) struct Postgres {
    url: String,
    store: AnyStore,
}

impl Backend for Postgres {
    async fn fresh() -> Option<Self> {
        let url = pg_fresh_database(&pg_server_url()?).await;
        let store = AnyStore::connect(&url).await.unwrap();
        Some(Self { url, store })
    }

    fn store(&self) -> &AnyStore {
        &self.store
    }

    async fn reopen(&mut self) {
        self.store = AnyStore::connect(&self.url).await.unwrap();
    }

    async fn another(&self) -> AnyStore {
        AnyStore::connect(&self.url).await.unwrap()
    }
}

/// One `#[tokio::test]` per contract for `$backend` (a [`Backend`]).
macro_rules! store_contracts {
    ($backend:ty) => {
        $crate::store::tests::store_contracts!(@each $backend;
            a_job_runs_through_its_states_and_reads_back_as_stored,
            completion_is_accepted_once_and_only_from_the_holder,
            failed_attempts_requeue_until_the_bound_then_fail,
            cancel_stops_unfinished_jobs_and_blocks_later_results,
            restart_requeues_orphans_and_keeps_finished_jobs,
            a_starting_replica_leaves_a_live_replicas_attempts_and_nodes_alone,
            a_dead_replicas_attempts_are_requeued_once_when_its_liveness_lease_lapses,
            ended_attempts_leave_their_tokens_and_the_result_joins_them,
            a_batch_of_assignments_takes_each_queued_job_once,
            a_claim_assigns_what_is_placed_and_frees_the_rest,
            a_node_is_booked_up_to_its_slots_and_freed_as_its_jobs_end,
            queued_jobs_come_oldest_first_with_their_paying_accounts,
            nodes_register_beat_go_offline_and_count,
            debits_never_overdraw_and_unknown_accounts_refuse,
            transfers_read_back_by_id_account_and_job,
            a_hold_stays_open_until_closed_and_is_due_after_its_deadline,
            ended_jobs_with_open_holds_are_unsettled,
            pending_amounts_resolve_only_when_held,
            a_dropped_transaction_changes_nothing,
            a_read_in_a_transaction_waits_for_a_concurrent_writer,
            batch_reads_see_used_ids_and_payers,
            operator_links_replace_and_accounts_insert_once,
            availability_adds_up_and_an_epoch_is_paid_once,
            keys_are_found_by_hash_until_revoked_or_expired,
            a_revoke_reaches_every_key_made_under_the_key,
            key_limits_and_lists,
            an_audit_begins_once_ends_once_and_counts_in_the_record,
            a_nodes_record_adds_up_its_work_and_lists_in_id_order,
            books_with_a_hold_and_a_payout_are_sound,
            one_of_two_replicas_racing_for_a_lease_wins_it,
            an_expired_lease_is_taken_over_under_a_higher_epoch,
            a_stale_holders_fenced_write_is_refused_and_changes_nothing,
            relayed_chunks_read_back_in_order_rewind_and_purge,
        );
    };
    (@each $backend:ty; $($name:ident),* $(,)?) => {
        $(
            #[tokio::test]
            async fn $name() {
                match <$backend as $crate::store::tests::Backend>::fresh().await {
                    Some(b) => $crate::store::tests::$name(b).await,
                    None => eprintln!("{}: backend not available here", stringify!($backend)),
                }
            }
        )*
    };
}
pub(crate) use store_contracts;

mod sqlite {
    super::store_contracts!(crate::store::tests::Sqlite);
}

mod postgres {
    super::store_contracts!(crate::store::tests::Postgres);
}

pub(crate) async fn queued(store: &AnyStore) -> JobRecord {
    store
        .insert_job(&NewJob {
            id: JobId::new(),
            model: "m".into(),
            input: JobInput {
                kind: Some(job_input::Kind::Prompt("hello".into())),
            },
            sampling: SamplingParams {
                seed: Some(7),
                max_tokens: 16,
                ..Default::default()
            },
            priority: 0,
        })
        .await
        .unwrap()
}

pub(crate) fn completion(job: &JobRecord, attempt: u32, node: &str, text: &str) -> Completion {
    Completion {
        job_id: job.id,
        attempt,
        node_id: node.into(),
        result: SignedClaim {
            claim: Some(ResultClaim {
                job_id: job.id.to_string(),
                attempt,
                output_text: text.into(),
                completion_tokens: 3,
                ..Default::default()
            }),
            signature: vec![1; 64],
        },
    }
}

fn end<'a>(job: JobId, attempt: u32, node: &'a str) -> StreamedEnd<'a> {
    StreamedEnd {
        job,
        attempt,
        node_id: node,
        reason: "node lost",
        retryable: true,
        max_attempts: 3,
    }
}

fn segment(attempt: u32, node: &str, first: u32, ids: &[u32], text: &str) -> Segment {
    Segment {
        attempt,
        node_id: node.into(),
        first_index: first,
        token_ids: ids.to_vec(),
        text: text.into(),
        claim: None,
    }
}

/// A client account with `credits` posted (from a treasury-like account
/// that may overdraw), in its own transaction.
async fn funded(store: &AnyStore, id: &str, credits: i64) -> Account {
    let account = Account::new(id.into(), id.into(), AccountKind::Client, 1);
    store.insert_account(&account).await.unwrap();
    if credits > 0 {
        let mut tx = store.write().await.unwrap();
        assert!(tx
            .add_debit("system:treasury", credits, false)
            .await
            .unwrap());
        assert!(tx.add_credit(id, credits, false).await.unwrap());
        tx.insert_transfers(&[posted(
            &format!("fund:{id}"),
            "system:treasury",
            id,
            credits,
            1,
        )])
        .await
        .unwrap();
        tx.commit().await.unwrap();
    }
    store.account(id).await.unwrap().unwrap()
}

fn posted(id: &str, debit: &str, credit: &str, amount: i64, at: i64) -> Transfer {
    Transfer {
        id: id.into(),
        kind: TransferKind::Posted,
        debit: debit.into(),
        credit: credit.into(),
        amount,
        pending_id: None,
        deadline_ms: None,
        job_id: None,
        node_id: None,
        tokens: 0,
        memo: "test".into(),
        created_at_ms: at,
    }
}

fn terms(account: &str) -> JobTerms {
    JobTerms {
        account: account.into(),
        price: Price {
            input_per_mtok: 1,
            output_per_mtok: 2,
        },
        max_price: 100,
    }
}

// ---- jobs, attempts, segments (the SQLite store's own tests, moved) ----

pub(crate) async fn a_job_runs_through_its_states_and_reads_back_as_stored<B: Backend>(b: B) {
    let store = b.store().clone();
    let job = queued(&store).await;
    assert_eq!(store.get_job(job.id).await.unwrap().unwrap(), job);
    assert_eq!(store.count_queued().await.unwrap(), 1);

    assert!(store.assign(job.id, 1, "n1").await.unwrap());
    assert!(
        !store.assign(job.id, 1, "n2").await.unwrap(),
        "already assigned"
    );
    assert!(
        !store.mark_running(job.id, 1, "n2").await.unwrap(),
        "other node"
    );
    assert!(store.mark_running(job.id, 1, "n1").await.unwrap());
    assert!(store
        .complete(&completion(&job, 1, "n1", "Paris"))
        .await
        .unwrap());

    let done = store.get_job(job.id).await.unwrap().unwrap();
    assert_eq!(done.state, JobState::Completed);
    assert_eq!(done.output_text, "Paris");
    assert_eq!(done.node_id.as_deref(), Some("n1"));
    let result = done.result.unwrap();
    assert_eq!(result.signature, vec![1; 64]);
    assert_eq!(result.claim.unwrap().output_text, "Paris");
    let stats = store.job_stats().await.unwrap();
    assert_eq!(
        (stats.completed, stats.tokens_generated, stats.queued),
        (1, 3, 0)
    );
}

pub(crate) async fn completion_is_accepted_once_and_only_from_the_holder<B: Backend>(b: B) {
    let store = b.store().clone();
    let job = queued(&store).await;
    assert!(
        !store
            .complete(&completion(&job, 1, "n1", "x"))
            .await
            .unwrap(),
        "not assigned yet"
    );
    assert!(store.assign(job.id, 1, "n1").await.unwrap());
    assert!(
        !store
            .complete(&completion(&job, 1, "n2", "x"))
            .await
            .unwrap(),
        "foreign node"
    );
    assert!(
        !store
            .complete(&completion(&job, 2, "n1", "x"))
            .await
            .unwrap(),
        "wrong attempt"
    );
    assert!(store
        .complete(&completion(&job, 1, "n1", "first"))
        .await
        .unwrap());
    assert!(
        !store
            .complete(&completion(&job, 1, "n1", "second"))
            .await
            .unwrap(),
        "duplicate"
    );
    assert!(
        store
            .fail_attempt(job.id, 1, "n1", "late", true, 3)
            .await
            .unwrap()
            .is_none(),
        "a late failure changes nothing"
    );
    let done = store.get_job(job.id).await.unwrap().unwrap();
    assert_eq!(
        (done.state, done.output_text.as_str()),
        (JobState::Completed, "first")
    );
}

pub(crate) async fn failed_attempts_requeue_until_the_bound_then_fail<B: Backend>(b: B) {
    let store = b.store().clone();
    let job = queued(&store).await;
    for attempt in 1..=2 {
        assert!(store.assign(job.id, attempt, "n1").await.unwrap());
        let end = store
            .fail_attempt(job.id, attempt, "n1", "lost", true, 3)
            .await
            .unwrap();
        assert_eq!(
            end,
            Some(AttemptEnd::Requeued {
                attempt: attempt + 1
            })
        );
        let j = store.get_job(job.id).await.unwrap().unwrap();
        assert_eq!(
            (j.state, j.attempt, j.node_id),
            (JobState::Queued, attempt + 1, None)
        );
    }
    assert!(
        !store.assign(job.id, 2, "n1").await.unwrap(),
        "stale attempt number"
    );
    assert!(store.assign(job.id, 3, "n1").await.unwrap());
    let end = store
        .fail_attempt(job.id, 3, "n1", "lost again", true, 3)
        .await
        .unwrap();
    assert_eq!(end, Some(AttemptEnd::Failed));
    let j = store.get_job(job.id).await.unwrap().unwrap();
    assert_eq!(
        (j.state, j.error.as_deref()),
        (JobState::Failed, Some("lost again"))
    );

    // A non-retryable failure fails at once.
    let job = queued(&store).await;
    assert!(store.assign(job.id, 1, "n1").await.unwrap());
    let end = store
        .fail_attempt(job.id, 1, "n1", "prompt too long", false, 3)
        .await
        .unwrap();
    assert_eq!(end, Some(AttemptEnd::Failed));
}

pub(crate) async fn cancel_stops_unfinished_jobs_and_blocks_later_results<B: Backend>(b: B) {
    let store = b.store().clone();
    let job = queued(&store).await;
    assert!(store.assign(job.id, 1, "n1").await.unwrap());
    assert_eq!(
        store.cancel(job.id).await.unwrap(),
        CancelOutcome::Cancelled
    );
    assert!(!store
        .complete(&completion(&job, 1, "n1", "x"))
        .await
        .unwrap());
    assert_eq!(
        store.cancel(job.id).await.unwrap(),
        CancelOutcome::AlreadyFinished(JobState::Cancelled)
    );
    assert_eq!(
        store.cancel(JobId::new()).await.unwrap(),
        CancelOutcome::NotFound
    );
}

pub(crate) async fn restart_requeues_orphans_and_keeps_finished_jobs<B: Backend>(mut b: B) {
    let store = b.store().clone();
    let done = queued(&store).await;
    assert!(store.assign(done.id, 1, "n1").await.unwrap());
    assert!(store
        .complete(&completion(&done, 1, "n1", "kept"))
        .await
        .unwrap());
    let orphan = queued(&store).await;
    assert!(store.assign(orphan.id, 1, "n1").await.unwrap());
    store
        .upsert_node(
            &NodeRecord {
                id: "n1".into(),
                name: "mac".into(),
                hardware: "{}".into(),
                models: "[]".into(),
                version: "0.1.0".into(),
                slots: 0,
            },
            "replica-a",
        )
        .await
        .unwrap();
    store.close().await;

    b.reopen().await;
    let store = b.store().clone();
    assert_eq!(
        store
            .requeue_orphans(3, Some("replica-a"), 1_000)
            .await
            .unwrap(),
        1
    );
    let o = store.get_job(orphan.id).await.unwrap().unwrap();
    assert_eq!((o.state, o.attempt), (JobState::Queued, 2));
    let d = store.get_job(done.id).await.unwrap().unwrap();
    assert_eq!(
        (d.state, d.output_text.as_str()),
        (JobState::Completed, "kept")
    );
    let (node, status) = store.get_node("n1").await.unwrap().unwrap();
    assert_eq!((node.name.as_str(), status.as_str()), ("mac", "offline"));
    assert_eq!(store.count_nodes().await.unwrap(), 1);
    let listed = store.list_jobs(10).await.unwrap();
    assert_eq!(listed.len(), 2);
    assert_eq!(listed[0].id, orphan.id, "newest first");
}

pub(crate) async fn ended_attempts_leave_their_tokens_and_the_result_joins_them<B: Backend>(b: B) {
    let store = b.store().clone();
    let job = queued(&store).await;
    assert!(store.assign(job.id, 1, "n1").await.unwrap());
    let s1 = segment(1, "n1", 0, &[5, 6], "Once upon");
    assert_eq!(
        store
            .end_attempt_streamed(&end(job.id, 1, "n1"), &s1)
            .await
            .unwrap(),
        Some(AttemptEnd::Requeued { attempt: 2 })
    );
    // A late report of the same attempt adds nothing.
    let late = segment(1, "n1", 2, &[7], " a");
    assert_eq!(
        store
            .end_attempt_streamed(&end(job.id, 1, "n1"), &late)
            .await
            .unwrap(),
        None
    );
    assert!(store.assign(job.id, 2, "n2").await.unwrap());
    // A segment that does not start where the stream ends is refused,
    // and the attempt stays as it was.
    let gap = segment(2, "n2", 3, &[7], " a");
    assert!(matches!(
        store
            .end_attempt_streamed(&end(job.id, 2, "n2"), &gap)
            .await,
        Err(StoreError::Corrupt { .. })
    ));
    let s2 = segment(2, "n2", 2, &[7], " a");
    store
        .end_attempt_streamed(&end(job.id, 2, "n2"), &s2)
        .await
        .unwrap();
    assert_eq!(store.segments(job.id).await.unwrap(), [s1, s2]);
    assert_eq!(
        Streamed::of(&store.segments(job.id).await.unwrap()),
        Streamed {
            token_ids: vec![5, 6, 7],
            text: "Once upon a".into()
        }
    );
    assert!(store.assign(job.id, 3, "n3").await.unwrap());
    assert!(store
        .complete(&completion(&job, 3, "n3", " time"))
        .await
        .unwrap());
    let done = store.get_job(job.id).await.unwrap().unwrap();
    assert_eq!(done.output_text, "Once upon a time");
    assert_eq!(done.completion_tokens, 3 + 3, "resumed plus the claim's");
}

// ---- attempts, jobs ----

pub(crate) async fn a_batch_of_assignments_takes_each_queued_job_once<B: Backend>(b: B) {
    let store = b.store().clone();
    let (j1, j2) = (queued(&store).await, queued(&store).await);
    let done = store
        .assign_many(&[
            (j1.id, 1, "n1".into()),
            (j2.id, 2, "n1".into()),
            (j1.id, 1, "n2".into()),
        ])
        .await
        .unwrap();
    assert_eq!(
        done,
        [true, false, false],
        "wrong attempt, then already assigned"
    );
    let j1 = store.get_job(j1.id).await.unwrap().unwrap();
    assert_eq!(
        (j1.state, j1.node_id.as_deref()),
        (JobState::Assigned, Some("n1"))
    );
    assert_eq!(
        store.get_job(j2.id).await.unwrap().unwrap().state,
        JobState::Queued
    );
    assert!(store.assign_many(&[]).await.unwrap().is_empty());
}

/// A node registered with `slots`, owned by `replica-a`.
pub(crate) async fn node_with_slots(store: &AnyStore, id: &str, slots: u32) {
    store
        .upsert_node(
            &NodeRecord {
                id: id.into(),
                name: id.into(),
                hardware: "{}".into(),
                models: "[]".into(),
                version: "1".into(),
                slots,
            },
            "replica-a",
        )
        .await
        .unwrap();
}

/// An assignment books one of its node's slots: none lands beyond them
/// (by `assign`, a batch or a claim), and a job that ends (completed,
/// failed, requeued) frees its slot. A node with no row, or registered
/// with 0 slots, has no bound.
pub(crate) async fn a_node_is_booked_up_to_its_slots_and_freed_as_its_jobs_end<B: Backend>(b: B) {
    let store = b.store().clone();
    node_with_slots(&store, "n2", 2).await;
    node_with_slots(&store, "n0", 0).await;
    let mut jobs = Vec::new();
    for _ in 0..5 {
        jobs.push(queued(&store).await);
    }
    let on_n2: Vec<_> = jobs.iter().map(|j| (j.id, 1, "n2".to_owned())).collect();
    assert_eq!(
        store.assign_many(&on_n2[..3]).await.unwrap(),
        [true, true, false],
        "two slots: the third booking is refused"
    );
    assert!(!store.assign(jobs[3].id, 1, "n2").await.unwrap());
    let done = store
        .claim_queued(10, |claimed| {
            claimed
                .iter()
                .map(|(j, _)| (j.id, j.attempt, "n2".to_owned()))
                .collect()
        })
        .await
        .unwrap();
    assert_eq!(done, [false, false, false], "a full node takes no claim");
    assert_eq!(
        store.count_queued().await.unwrap(),
        3,
        "refused: still queued"
    );

    // A running job keeps its slot; an ended one (failed here) frees it.
    assert!(store.mark_running(jobs[0].id, 1, "n2").await.unwrap());
    assert!(!store.assign(jobs[2].id, 1, "n2").await.unwrap());
    store
        .fail_attempt(jobs[1].id, 1, "n2", "lost", true, 3)
        .await
        .unwrap();
    assert!(store.assign(jobs[2].id, 1, "n2").await.unwrap());
    assert!(
        !store.assign(jobs[1].id, 2, "n2").await.unwrap(),
        "the requeued job finds the node full again"
    );

    // No bound: a node with 0 slots, or with no row.
    assert!(store.assign(jobs[3].id, 1, "n0").await.unwrap());
    assert!(store.assign(jobs[4].id, 1, "ghost").await.unwrap());
}

pub(crate) async fn a_claim_assigns_what_is_placed_and_frees_the_rest<B: Backend>(b: B) {
    let store = b.store().clone();
    funded(&store, "acct_a", 0).await;
    let new = || NewJob {
        id: JobId::new(),
        model: "m".into(),
        input: JobInput::default(),
        sampling: SamplingParams::default(),
        priority: 0,
    };
    let (first, second, third) = (new(), new(), new());
    let mut tx = store.write().await.unwrap();
    tx.insert_jobs(&[(&third, 30), (&first, 10), (&second, 20)])
        .await
        .unwrap();
    tx.insert_terms(&[(first.id.to_string().as_str(), &terms("acct_a"))])
        .await
        .unwrap();
    tx.commit().await.unwrap();
    let mut seen = Vec::new();
    let done = store
        .claim_queued(2, |claimed| {
            seen = claimed.iter().map(|(j, a)| (j.id, a.clone())).collect();
            vec![(first.id, 1, "n1".into()), (second.id, 2, "n1".into())]
        })
        .await
        .unwrap();
    assert_eq!(
        seen,
        [(first.id, Some("acct_a".to_owned())), (second.id, None)],
        "the oldest, with their paying accounts"
    );
    assert_eq!(done, [true, false], "assigned; wrong attempt");
    let j = store.get_job(first.id).await.unwrap().unwrap();
    assert_eq!(
        (j.state, j.node_id.as_deref()),
        (JobState::Assigned, Some("n1"))
    );
    let mut seen = Vec::new();
    let done = store
        .claim_queued(10, |claimed| {
            seen = claimed.iter().map(|(j, _)| j.id).collect();
            Vec::new()
        })
        .await
        .unwrap();
    assert!(done.is_empty());
    assert_eq!(seen, [second.id, third.id], "what was left is free again");
    assert_eq!(store.count_queued().await.unwrap(), 2);
}

pub(crate) async fn queued_jobs_come_oldest_first_with_their_paying_accounts<B: Backend>(b: B) {
    let store = b.store().clone();
    funded(&store, "acct_a", 0).await;
    let new = |priority| NewJob {
        id: JobId::new(),
        model: "m".into(),
        input: JobInput::default(),
        sampling: SamplingParams::default(),
        priority,
    };
    let (first, second, running) = (new(0), new(3), new(0));
    let mut tx = store.write().await.unwrap();
    tx.insert_jobs(&[(&second, 20), (&first, 10), (&running, 5)])
        .await
        .unwrap();
    tx.commit().await.unwrap();
    assert!(store.assign(running.id, 1, "n1").await.unwrap());
    let mut tx = store.write().await.unwrap();
    tx.insert_terms(&[(first.id.to_string().as_str(), &terms("acct_a"))])
        .await
        .unwrap();
    tx.commit().await.unwrap();
    let ids: Vec<JobId> = store
        .queued_jobs(10)
        .await
        .unwrap()
        .iter()
        .map(|j| j.id)
        .collect();
    assert_eq!(ids, [first.id, second.id]);
    assert_eq!(store.queued_jobs(1).await.unwrap().len(), 1);
    assert_eq!(store.count_queued().await.unwrap(), 2);
    let accounts = store.job_accounts(&[first.id, second.id]).await.unwrap();
    assert_eq!(
        accounts.len(),
        1,
        "jobs without terms have no paying account"
    );
    assert_eq!(accounts[&first.id], "acct_a");
    assert_eq!(
        store.job_terms(&first.id.to_string()).await.unwrap(),
        Some(terms("acct_a"))
    );
    assert_eq!(
        store.jobs_of("acct_a", 10).await.unwrap(),
        [first.id.to_string()]
    );
    let stats = store.job_stats().await.unwrap();
    assert_eq!((stats.queued, stats.running), (2, 1));
}

// ---- nodes ----

/// A node online on `replica`, with an attempt of a fresh job assigned
/// to it (and running when `running`).
async fn attempt_on(store: &AnyStore, node: &str, replica: &str, running: bool) -> JobRecord {
    store
        .upsert_node(
            &NodeRecord {
                id: node.into(),
                name: node.into(),
                hardware: "{}".into(),
                models: "[]".into(),
                version: "1".into(),
                slots: 0,
            },
            replica,
        )
        .await
        .unwrap();
    let job = queued(store).await;
    assert!(store.assign(job.id, 1, node).await.unwrap());
    if running {
        assert!(store.mark_running(job.id, 1, node).await.unwrap());
    }
    job
}

async fn state_of(store: &AnyStore, job: &JobRecord) -> (JobState, u32) {
    let j = store.get_job(job.id).await.unwrap().unwrap();
    (j.state, j.attempt)
}

async fn status_of(store: &AnyStore, node: &str) -> String {
    store.get_node(node).await.unwrap().unwrap().1
}

/// Replica b starts (its start-up recovery) beside a live replica a: a's
/// running and assigned attempts and a's node are left as they are; only
/// what b's own earlier incarnation held is requeued and offlined.
pub(crate) async fn a_starting_replica_leaves_a_live_replicas_attempts_and_nodes_alone<
    B: Backend,
>(
    b: B,
) {
    let a = b.store().clone();
    let other = b.another().await;
    let live = a
        .acquire_lease(&liveness_lease("replica-a"), "replica-a", 1_000, 0)
        .await
        .unwrap()
        .unwrap();
    let running = attempt_on(&a, "n-a", "replica-a", true).await;
    let assigned = attempt_on(&a, "n-a2", "replica-a", false).await;
    // What replica b held before it restarted (its lease still live).
    b_lease(&other, 0).await;
    let mine = attempt_on(&other, "n-b", "replica-b", true).await;

    let n = other
        .requeue_orphans(3, Some("replica-b"), 500)
        .await
        .unwrap();
    assert_eq!(n, 1, "only b's own earlier attempt");
    assert_eq!(state_of(&a, &running).await, (JobState::Running, 1));
    assert_eq!(state_of(&a, &assigned).await, (JobState::Assigned, 1));
    assert_eq!(status_of(&a, "n-a").await, "online");
    assert_eq!(status_of(&a, "n-a2").await, "online");
    assert_eq!(state_of(&a, &mine).await, (JobState::Queued, 2));
    assert_eq!(status_of(&a, "n-b").await, "offline");
    // a's attempt still completes: nothing of it was touched.
    assert!(a
        .complete(&completion(&running, 1, "n-a", "done"))
        .await
        .unwrap());
    assert_eq!(a.lease(&live.name).await.unwrap(), Some(live));
    other.close().await;
}

async fn b_lease(store: &AnyStore, now: i64) -> Lease {
    store
        .acquire_lease(&liveness_lease("replica-b"), "replica-b", 1_000, now)
        .await
        .unwrap()
        .unwrap()
}

/// Replica a stops renewing its liveness lease: the orphan sweep leaves
/// its attempts alone while the lease lives, requeues them (and offlines
/// its nodes) once it lapsed, exactly once even with two sweeps racing,
/// and never touches the live replica b's; a released lease is dead at
/// once.
pub(crate) async fn a_dead_replicas_attempts_are_requeued_once_when_its_liveness_lease_lapses<
    B: Backend,
>(
    b: B,
) {
    let a = b.store().clone();
    let other = b.another().await;
    a.acquire_lease(&liveness_lease("replica-a"), "replica-a", 1_000, 0)
        .await
        .unwrap()
        .unwrap();
    let running = attempt_on(&a, "n-a", "replica-a", true).await;
    let assigned = attempt_on(&a, "n-a2", "replica-a", false).await;
    b_lease(&other, 0).await;
    let bs = attempt_on(&other, "n-b", "replica-b", true).await;

    assert_eq!(other.requeue_orphans(3, None, 999).await.unwrap(), 0);
    assert_eq!(state_of(&a, &running).await, (JobState::Running, 1));
    // b renews; a does not. At 1_000 a's lease has ended.
    b_lease(&other, 900).await;
    let (x, y) = tokio::join!(
        other.requeue_orphans(3, None, 1_000),
        b.store().requeue_orphans(3, None, 1_000)
    );
    assert_eq!(x.unwrap() + y.unwrap(), 2, "each of a's attempts once");
    assert_eq!(state_of(&a, &running).await, (JobState::Queued, 2));
    assert_eq!(state_of(&a, &assigned).await, (JobState::Queued, 2));
    assert_eq!(status_of(&a, "n-a").await, "offline");
    assert_eq!(status_of(&a, "n-a2").await, "offline");
    assert_eq!(state_of(&a, &bs).await, (JobState::Running, 1));
    assert_eq!(status_of(&a, "n-b").await, "online");
    assert_eq!(other.requeue_orphans(3, None, 1_100).await.unwrap(), 0);
    // a's late result for the requeued attempt is refused.
    assert!(!a
        .complete(&completion(&running, 1, "n-a", "late"))
        .await
        .unwrap());

    // b stops cleanly: its released lease is dead at once.
    let held = b_lease(&other, 1_200).await;
    assert!(other.release_lease(&held).await.unwrap());
    assert_eq!(a.requeue_orphans(3, None, 1_300).await.unwrap(), 1);
    assert_eq!(state_of(&a, &bs).await, (JobState::Queued, 2));
    other.close().await;
}

pub(crate) async fn nodes_register_beat_go_offline_and_count<B: Backend>(b: B) {
    let store = b.store().clone();
    let node = |name: &str| NodeRecord {
        id: "n1".into(),
        name: name.into(),
        hardware: "{}".into(),
        models: "[]".into(),
        version: "1".into(),
        slots: 4,
    };
    assert!(store.get_node("n1").await.unwrap().is_none());
    store
        .upsert_node(&node("first"), "replica-a")
        .await
        .unwrap();
    store.touch_node("n1").await.unwrap();
    let (got, status) = store.get_node("n1").await.unwrap().unwrap();
    assert_eq!((got, status.as_str()), (node("first"), "online"));
    store.set_node_offline("n1").await.unwrap();
    assert_eq!(store.get_node("n1").await.unwrap().unwrap().1, "offline");
    store
        .upsert_node(&node("renamed"), "replica-a")
        .await
        .unwrap();
    let (got, status) = store.get_node("n1").await.unwrap().unwrap();
    assert_eq!((got.name.as_str(), status.as_str()), ("renamed", "online"));
    store.mark_all_nodes_offline().await.unwrap();
    assert_eq!(store.get_node("n1").await.unwrap().unwrap().1, "offline");
    assert_eq!(store.count_nodes().await.unwrap(), 1);
}

// ---- accounts and transfers ----

pub(crate) async fn debits_never_overdraw_and_unknown_accounts_refuse<B: Backend>(b: B) {
    let store = b.store().clone();
    funded(&store, "acct_a", 100).await;
    let mut tx = store.write().await.unwrap();
    assert!(
        !tx.add_debit("acct_a", 101, false).await.unwrap(),
        "overdraw"
    );
    assert!(
        tx.add_debit("acct_a", 60, true).await.unwrap(),
        "a hold of 60"
    );
    assert!(
        !tx.add_debit("acct_a", 41, false).await.unwrap(),
        "holds count against what is available"
    );
    assert!(tx.add_debit("acct_a", 40, false).await.unwrap());
    assert!(!tx.add_debit("acct_nobody", 1, false).await.unwrap());
    assert!(!tx.add_credit("acct_nobody", 1, false).await.unwrap());
    assert!(
        tx.add_debit("system:treasury", 1_000, false).await.unwrap(),
        "the treasury may go below zero"
    );
    let a = tx.account("acct_a").await.unwrap().unwrap();
    assert_eq!(
        (a.debits_pending, a.debits_posted, a.available()),
        (60, 40, 0)
    );
    tx.commit().await.unwrap();
    assert_eq!(
        store.account("acct_a").await.unwrap().unwrap().available(),
        0
    );
    assert!(store.account("acct_nobody").await.unwrap().is_none());
}

pub(crate) async fn transfers_read_back_by_id_account_and_job<B: Backend>(b: B) {
    let store = b.store().clone();
    funded(&store, "acct_a", 0).await;
    funded(&store, "acct_b", 0).await;
    let mut t1 = posted("t1", "acct_a", "acct_b", 5, 10);
    t1.job_id = Some("job1".into());
    t1.node_id = Some("n1".into());
    t1.tokens = 3;
    let t2 = posted("t2", "acct_b", "acct_a", 7, 20);
    let mut t3 = posted("t3", "acct_b", "system:fee", 1, 20);
    t3.job_id = Some("job1".into());
    let mut tx = store.write().await.unwrap();
    tx.insert_transfers(&[t1.clone(), t2.clone(), t3.clone()])
        .await
        .unwrap();
    assert_eq!(tx.transfer("t1").await.unwrap(), Some(t1.clone()));
    tx.commit().await.unwrap();
    assert_eq!(store.transfer("t2").await.unwrap(), Some(t2.clone()));
    assert!(store.transfer("t9").await.unwrap().is_none());
    let history = store.history("acct_a", 10).await.unwrap();
    assert_eq!(
        history,
        [t2.clone(), t1.clone()],
        "newest first, either side"
    );
    assert_eq!(store.history("acct_a", 1).await.unwrap(), [t2]);
    assert_eq!(store.job_transfers("job1").await.unwrap(), [t1, t3]);
    let mut tx = store.write().await.unwrap();
    assert!(
        tx.insert_transfers(&[posted("t1", "acct_a", "acct_b", 9, 30)])
            .await
            .is_err(),
        "a transfer id is used once"
    );
}

// ---- holds ----

/// A pending transfer (treasury to escrow) about `job`.
fn pending(id: &str, job: Option<&str>, deadline_ms: i64) -> Transfer {
    Transfer {
        kind: TransferKind::Pending,
        deadline_ms: Some(deadline_ms),
        job_id: job.map(String::from),
        ..posted(id, "system:treasury", "system:escrow", 1, 0)
    }
}

pub(crate) async fn a_hold_stays_open_until_closed_and_is_due_after_its_deadline<B: Backend>(b: B) {
    let store = b.store().clone();
    let job = queued(&store).await;
    let id = job.id.to_string();
    let mut tx = store.write().await.unwrap();
    tx.insert_transfers(&[pending("h1", Some(&id), 100), pending("h2", None, 50)])
        .await
        .unwrap();
    tx.open_holds(&[
        OpenHold {
            transfer_id: "h1".into(),
            job_id: Some(id.clone()),
            deadline_ms: 100,
        },
        OpenHold {
            transfer_id: "h2".into(),
            job_id: None,
            deadline_ms: 50,
        },
    ])
    .await
    .unwrap();
    tx.commit().await.unwrap();
    let mut tx = store.write().await.unwrap();
    assert_eq!(tx.hold_deadline("h1").await.unwrap(), Some(100));
    assert_eq!(tx.hold_deadline("h9").await.unwrap(), None);
    drop(tx);
    assert!(
        store.due_holds(100, 10).await.unwrap().is_empty(),
        "due after, not at"
    );
    assert_eq!(
        store.due_holds(101, 10).await.unwrap(),
        std::slice::from_ref(&id),
        "only holds of a job"
    );
    assert_eq!(store.totals().await.unwrap().open_holds, 2);
    let mut tx = store.write().await.unwrap();
    tx.close_hold("h1").await.unwrap();
    assert_eq!(tx.hold_deadline("h1").await.unwrap(), None);
    tx.commit().await.unwrap();
    assert!(store.due_holds(1_000, 10).await.unwrap().is_empty());
    assert_eq!(store.totals().await.unwrap().open_holds, 1);
}

pub(crate) async fn ended_jobs_with_open_holds_are_unsettled<B: Backend>(b: B) {
    let store = b.store().clone();
    let hold = |job: &JobRecord| OpenHold {
        transfer_id: format!("job:{}:hold", job.id),
        job_id: Some(job.id.to_string()),
        deadline_ms: i64::MAX,
    };
    let open = queued(&store).await;
    let cancelled = queued(&store).await;
    store.cancel(cancelled.id).await.unwrap();
    let done = queued(&store).await;
    assert!(store.assign(done.id, 1, "n1").await.unwrap());
    assert!(store
        .complete(&completion(&done, 1, "n1", "x"))
        .await
        .unwrap());
    let completed_at = store.get_job(done.id).await.unwrap().unwrap().updated_at_ms;
    let mut tx = store.write().await.unwrap();
    for job in [&open, &cancelled, &done] {
        let h = hold(job);
        tx.insert_transfers(&[pending(&h.transfer_id, h.job_id.as_deref(), h.deadline_ms)])
            .await
            .unwrap();
        tx.open_holds(&[h]).await.unwrap();
    }
    tx.commit().await.unwrap();
    let set = |v: Vec<String>| v.into_iter().collect::<HashSet<_>>();
    let ended = |ids: &[&JobRecord]| ids.iter().map(|j| j.id.to_string()).collect::<HashSet<_>>();
    // No audit window: completed jobs are settled at once.
    assert_eq!(
        set(store.unsettled_jobs(completed_at, 0, 10).await.unwrap()),
        ended(&[&cancelled, &done])
    );
    // A window holds the completed job's pay until it closes.
    assert_eq!(
        set(store.unsettled_jobs(completed_at, 1_000, 10).await.unwrap()),
        ended(&[&cancelled])
    );
    assert_eq!(
        set(store
            .unsettled_jobs(completed_at + 1_000, 1_000, 10)
            .await
            .unwrap()),
        ended(&[&cancelled, &done])
    );
    // A failed audit ends the window at once.
    assert!(store
        .begin_audit(&done.id.to_string(), "n1", 0)
        .await
        .unwrap());
    let mut tx = store.write().await.unwrap();
    tx.end_audit(&done.id.to_string(), false, "n2", b"v", 1)
        .await
        .unwrap();
    tx.commit().await.unwrap();
    assert_eq!(
        set(store.unsettled_jobs(completed_at, 1_000, 10).await.unwrap()),
        ended(&[&cancelled, &done])
    );
}

pub(crate) async fn pending_amounts_resolve_only_when_held<B: Backend>(b: B) {
    let store = b.store().clone();
    funded(&store, "acct_a", 100).await;
    let mut tx = store.write().await.unwrap();
    assert!(tx.add_debit("acct_a", 30, true).await.unwrap());
    assert!(tx.add_credit("system:escrow", 30, true).await.unwrap());
    assert!(
        !tx.resolve_pending("acct_a", Side::Debit, 31, 0)
            .await
            .unwrap(),
        "more than is pending"
    );
    assert!(tx
        .resolve_pending("acct_a", Side::Debit, 30, 10)
        .await
        .unwrap());
    assert!(tx
        .resolve_pending("system:escrow", Side::Credit, 30, 10)
        .await
        .unwrap());
    let a = tx.account("acct_a").await.unwrap().unwrap();
    assert_eq!(
        (a.debits_pending, a.debits_posted, a.balance()),
        (0, 10, 90)
    );
    let e = tx.account("system:escrow").await.unwrap().unwrap();
    assert_eq!((e.credits_pending, e.credits_posted), (0, 10));
}

// ---- write transactions ----

pub(crate) async fn a_dropped_transaction_changes_nothing<B: Backend>(b: B) {
    let store = b.store().clone();
    funded(&store, "acct_a", 100).await;
    let job = NewJob {
        id: JobId::new(),
        model: "m".into(),
        input: JobInput::default(),
        sampling: SamplingParams::default(),
        priority: 0,
    };
    let mut tx = store.write().await.unwrap();
    assert!(tx.add_debit("acct_a", 100, false).await.unwrap());
    tx.insert_jobs(&[(&job, 5)]).await.unwrap();
    assert!(tx.get_job(job.id).await.unwrap().is_some(), "seen inside");
    drop(tx);
    assert!(store.get_job(job.id).await.unwrap().is_none());
    assert_eq!(
        store.account("acct_a").await.unwrap().unwrap().balance(),
        100
    );
    let mut tx = store.write().await.unwrap();
    tx.insert_jobs(&[(&job, 5)]).await.unwrap();
    tx.commit().await.unwrap();
    let stored = store.get_job(job.id).await.unwrap().unwrap();
    assert_eq!(stored, JobRecord::queued(&job, 5));
}

pub(crate) async fn a_read_in_a_transaction_waits_for_a_concurrent_writer<B: Backend>(b: B) {
    let store = b.store().clone();
    funded(&store, "acct_a", 1).await;
    let mut first = store.write().await.unwrap();
    assert!(first.account("acct_a").await.unwrap().is_some());
    // A second writer's read waits for the first writer to end.
    let second = async {
        let mut tx = store.write().await.unwrap();
        let seen = tx.account("acct_a").await.unwrap().unwrap().balance();
        tx.commit().await.unwrap();
        seen
    };
    let end_first = async move {
        assert!(first.add_credit("acct_a", 1, false).await.unwrap());
        first.commit().await.unwrap();
    };
    let ((), seen) = tokio::join!(end_first, second);
    assert_eq!(seen, 2, "the second transaction saw the first's commit");
}

// ---- submits ----

pub(crate) async fn batch_reads_see_used_ids_and_payers<B: Backend>(b: B) {
    let store = b.store().clone();
    funded(&store, "acct_a", 50).await;
    let job = queued(&store).await;
    let fresh = JobId::new().to_string();
    let termed = JobId::new().to_string();
    let mut tx = store.write().await.unwrap();
    tx.insert_terms(&[(termed.as_str(), &terms("acct_a"))])
        .await
        .unwrap();
    let used = tx
        .used_job_ids(&[job.id.to_string(), fresh.clone(), termed.clone()])
        .await
        .unwrap();
    assert_eq!(used, HashSet::from([job.id.to_string(), termed]));
    assert!(tx.add_debit("acct_a", 20, true).await.unwrap());
    let payers = tx.payers(&["acct_a", "acct_nobody"]).await.unwrap();
    assert_eq!(payers.len(), 1, "unknown accounts are missing");
    assert!(payers["acct_a"].no_overdraft);
    assert_eq!(payers["acct_a"].available, 30);
    let treasury = tx.payers(&["system:treasury"]).await.unwrap();
    assert!(!treasury["system:treasury"].no_overdraft);
}

// ---- operators and accounts ----

pub(crate) async fn operator_links_replace_and_accounts_insert_once<B: Backend>(b: B) {
    let store = b.store().clone();
    funded(&store, "acct_a", 0).await;
    funded(&store, "acct_b", 0).await;
    let mut tx = store.write().await.unwrap();
    assert_eq!(tx.operator_of("n1").await.unwrap(), None);
    tx.link_operator("n1", "acct_a", 1).await.unwrap();
    tx.link_operator("n1", "acct_b", 2).await.unwrap();
    assert_eq!(
        tx.operator_of("n1").await.unwrap().as_deref(),
        Some("acct_b")
    );
    let again = Account::new("acct_a".into(), "another".into(), AccountKind::Operator, 9);
    tx.insert_account_if_absent(&again).await.unwrap();
    tx.commit().await.unwrap();
    let a = store.account("acct_a").await.unwrap().unwrap();
    assert_eq!((a.name.as_str(), a.kind), ("acct_a", AccountKind::Client));
    assert_eq!(store.nodes_of("acct_b").await.unwrap(), ["n1"]);
    assert!(store.nodes_of("acct_a").await.unwrap().is_empty());
    assert!(
        store.insert_account(&again).await.is_err(),
        "a plain insert of a used id fails"
    );
}

// ---- rewards ----

pub(crate) async fn availability_adds_up_and_an_epoch_is_paid_once<B: Backend>(b: B) {
    let store = b.store().clone();
    store.record_online(3, "n1", 10, 100).await.unwrap();
    store.record_online(3, "n1", 20, 50).await.unwrap();
    store.record_online(3, "n2", 5, 1).await.unwrap();
    store.record_online(4, "n1", 10, 1).await.unwrap();
    assert_eq!(store.unpaid_epochs(4).await.unwrap(), [3]);
    assert_eq!(store.unpaid_epochs(5).await.unwrap(), [3, 4]);
    let mut tx = store.write().await.unwrap();
    let rows = tx.availability(3).await.unwrap();
    assert_eq!(rows.len(), 2);
    assert_eq!(
        (
            rows[0].node_id.as_str(),
            rows[0].memory_bytes,
            rows[0].online_ms
        ),
        ("n1", 20, 150),
        "online time adds up; memory is the most offered"
    );
    assert!(!tx.epoch_paid(3).await.unwrap());
    tx.mark_epoch_paid(3, 1_000, 42).await.unwrap();
    assert!(tx.epoch_paid(3).await.unwrap());
    assert!(tx.mark_epoch_paid(3, 1_001, 1).await.is_err(), "paid once");
    drop(tx);
    let mut tx = store.write().await.unwrap();
    tx.mark_epoch_paid(3, 1_000, 42).await.unwrap();
    tx.commit().await.unwrap();
    assert_eq!(store.unpaid_epochs(5).await.unwrap(), [4]);
}

// ---- API keys ----

fn key(id: &str, account: &str, byte: u8, expires_at_ms: Option<i64>) -> NewKey {
    NewKey {
        id: id.into(),
        account_id: account.into(),
        hash: [byte; 32],
        scopes: Scopes::from_list(["submit", "read"]).unwrap(),
        label: format!("label {id}"),
        created_at_ms: i64::from(byte),
        expires_at_ms,
        parent_key_id: None,
    }
}

pub(crate) async fn a_revoke_reaches_every_key_made_under_the_key<B: Backend>(b: B) {
    let store = b.store().clone();
    funded(&store, "acct_a", 0).await;
    let child = |id: &str, byte: u8, parent: &str, expires: Option<i64>| NewKey {
        parent_key_id: Some(parent.into()),
        ..key(id, "acct_a", byte, expires)
    };
    assert!(store
        .insert_key(&key("root", "acct_a", 1, None))
        .await
        .unwrap());
    assert!(store
        .insert_key(&key("other", "acct_a", 2, None))
        .await
        .unwrap());
    assert!(store
        .insert_key(&child("kid", 3, "root", None))
        .await
        .unwrap());
    assert!(store
        .insert_key(&child("grandkid", 4, "kid", None))
        .await
        .unwrap());
    // A parent expired at the child's creation time makes no child.
    assert!(store
        .insert_key(&key("old", "acct_a", 5, Some(6)))
        .await
        .unwrap());
    assert!(
        !store
            .insert_key(&child("late", 7, "old", None))
            .await
            .unwrap(),
        "a key made under an expired key"
    );
    assert!(store.key_by_hash(&[4; 32], 10).await.unwrap().is_some());
    assert!(store.revoke_key("root", Some("acct_a"), 20).await.unwrap());
    for (byte, what) in [(1, "root"), (3, "its child"), (4, "its grandchild")] {
        assert!(
            store.key_by_hash(&[byte; 32], 21).await.unwrap().is_none(),
            "{what} still found"
        );
    }
    assert!(store.key_by_hash(&[2; 32], 21).await.unwrap().is_some());
    assert!(
        !store
            .insert_key(&child("after", 8, "root", None))
            .await
            .unwrap(),
        "a key made under a revoked key"
    );
    assert!(
        !store.revoke_key("root", None, 22).await.unwrap(),
        "revoked once"
    );
}

pub(crate) async fn keys_are_found_by_hash_until_revoked_or_expired<B: Backend>(b: B) {
    let store = b.store().clone();
    funded(&store, "acct_a", 0).await;
    funded(&store, "acct_b", 0).await;
    store
        .insert_key(&key("key_1", "acct_a", 1, None))
        .await
        .unwrap();
    store
        .insert_key(&key("key_2", "acct_a", 2, Some(100)))
        .await
        .unwrap();
    let found = store.key_by_hash(&[1; 32], 5).await.unwrap().unwrap();
    assert_eq!(
        (
            found.caller.key_id.as_str(),
            found.caller.account_id.as_str()
        ),
        ("key_1", "acct_a")
    );
    assert_eq!(
        found.caller.scopes,
        Scopes::from_list(["submit", "read"]).unwrap()
    );
    assert_eq!(found.caller.limits, KeyLimits::default());
    assert!(store.key_by_hash(&[9; 32], 5).await.unwrap().is_none());
    assert_eq!(
        store
            .key_by_hash(&[2; 32], 99)
            .await
            .unwrap()
            .unwrap()
            .expires_at_ms,
        Some(100)
    );
    assert!(
        store.key_by_hash(&[2; 32], 100).await.unwrap().is_none(),
        "expired"
    );
    assert!(
        !store.revoke_key("key_1", Some("acct_b"), 7).await.unwrap(),
        "another account's key"
    );
    assert!(store.revoke_key("key_1", Some("acct_a"), 7).await.unwrap());
    assert!(
        !store.revoke_key("key_1", None, 8).await.unwrap(),
        "revoked once"
    );
    assert!(store.key_by_hash(&[1; 32], 9).await.unwrap().is_none());
    assert!(
        store
            .insert_key(&key("key_3", "acct_a", 1, None))
            .await
            .is_err(),
        "a hash is used once"
    );
}

pub(crate) async fn key_limits_and_lists<B: Backend>(b: B) {
    let store = b.store().clone();
    funded(&store, "acct_a", 0).await;
    store
        .insert_key(&key("key_1", "acct_a", 1, None))
        .await
        .unwrap();
    store
        .insert_key(&key("key_2", "acct_a", 2, Some(50)))
        .await
        .unwrap();
    let limits = KeyLimits {
        requests_per_sec: Some(3),
        max_in_flight: Some(0),
    };
    assert!(store.set_key_limits("key_1", limits).await.unwrap());
    assert!(!store.set_key_limits("key_9", limits).await.unwrap());
    assert_eq!(
        store
            .key_by_hash(&[1; 32], 0)
            .await
            .unwrap()
            .unwrap()
            .caller
            .limits,
        limits
    );
    store.revoke_key("key_1", None, 60).await.unwrap();
    let listed = store.list_keys("acct_a").await.unwrap();
    let ids: Vec<&str> = listed.iter().map(|k| k.id.as_str()).collect();
    assert_eq!(ids, ["key_2", "key_1"], "newest first");
    assert_eq!(
        (
            listed[0].expires_at_ms,
            listed[0].revoked_at_ms,
            listed[0].label.as_str()
        ),
        (Some(50), None, "label key_2")
    );
    assert_eq!(listed[1].revoked_at_ms, Some(60));
    assert!(store.list_keys("acct_nobody").await.unwrap().is_empty());
}

// ---- audits ----

pub(crate) async fn an_audit_begins_once_ends_once_and_counts_in_the_record<B: Backend>(b: B) {
    let store = b.store().clone();
    let (j1, j2) = (queued(&store).await, queued(&store).await);
    let (j1, j2) = (j1.id.to_string(), j2.id.to_string());
    assert_eq!(store.audit_state(&j1).await.unwrap(), None);
    assert!(store.begin_audit(&j1, "n1", 0).await.unwrap());
    assert!(!store.begin_audit(&j1, "n1", 0).await.unwrap(), "once");
    assert_eq!(
        store.audit_state(&j1).await.unwrap().as_deref(),
        Some("pending")
    );
    let mut tx = store.write().await.unwrap();
    assert_eq!(
        tx.end_audit(&j1, false, "n2", b"verdict", 5)
            .await
            .unwrap()
            .as_deref(),
        Some("n1")
    );
    assert_eq!(
        tx.end_audit(&j1, true, "n2", b"again", 6).await.unwrap(),
        None
    );
    let delta = |clean, failed| RecordDelta {
        clean,
        failed,
        ..RecordDelta::default()
    };
    tx.count_record("n1", &delta(0, 1)).await.unwrap();
    tx.count_record("n1", &delta(1, 0)).await.unwrap();
    assert_eq!(
        tx.audit_record("n1").await.unwrap(),
        AuditRecord {
            clean: 1,
            failed: 1,
            ..AuditRecord::default()
        }
    );
    tx.ban_node("n1", 7).await.unwrap();
    assert!(tx.audit_state(&j1).await.unwrap().is_some());
    tx.commit().await.unwrap();
    assert_eq!(
        store.audit_state(&j1).await.unwrap().as_deref(),
        Some("failed")
    );
    assert!(store.audit_record("n1").await.unwrap().banned);
    assert_eq!(
        store.audit_record("n9").await.unwrap(),
        AuditRecord::default()
    );
    assert_eq!(store.banned_nodes().await.unwrap(), ["n1"]);
    // A missed audit ends without a verdict, once.
    assert!(store.begin_audit(&j2, "n3", 0).await.unwrap());
    store.miss_audit(&j2, 9).await.unwrap();
    assert_eq!(
        store.audit_state(&j2).await.unwrap().as_deref(),
        Some("missed")
    );
    let mut tx = store.write().await.unwrap();
    assert_eq!(
        tx.end_audit(&j2, true, "n4", b"late", 10).await.unwrap(),
        None
    );
}

pub(crate) async fn a_nodes_record_adds_up_its_work_and_lists_in_id_order<B: Backend>(mut b: B) {
    let store = b.store().clone();
    assert!(store.node_records().await.unwrap().is_empty());
    let work = RecordDelta {
        jobs: 2,
        failed_attempts: 1,
        ..RecordDelta::default()
    };
    store.count_record("n2", &work).await.unwrap();
    store.count_record("n2", &work).await.unwrap();
    let mut tx = store.write().await.unwrap();
    let wrong = RecordDelta {
        wrong_verdicts: 1,
        clean: 3,
        ..RecordDelta::default()
    };
    tx.count_record("n1", &wrong).await.unwrap();
    tx.ban_node("n1", 5).await.unwrap();
    tx.commit().await.unwrap();
    // A dropped transaction's count is not kept.
    let mut tx = store.write().await.unwrap();
    tx.count_record("n3", &wrong).await.unwrap();
    drop(tx);
    let n1 = AuditRecord {
        clean: 3,
        wrong_verdicts: 1,
        banned: true,
        ..AuditRecord::default()
    };
    let n2 = AuditRecord {
        jobs: 4,
        failed_attempts: 2,
        ..AuditRecord::default()
    };
    assert_eq!(store.audit_record("n2").await.unwrap(), n2);
    let expected = vec![("n1".to_string(), n1), ("n2".to_string(), n2)];
    assert_eq!(store.node_records().await.unwrap(), expected);
    b.reopen().await;
    assert_eq!(
        b.store().node_records().await.unwrap(),
        expected,
        "the records survive a reopen"
    );
}

// ---- the books ----

pub(crate) async fn books_with_a_hold_and_a_payout_are_sound<B: Backend>(b: B) {
    let store = b.store().clone();
    funded(&store, "acct_a", 100).await;
    let job = queued(&store).await;
    let id = job.id.to_string();
    let hold = Transfer {
        kind: TransferKind::Pending,
        deadline_ms: Some(1_000),
        job_id: Some(id.clone()),
        ..posted(&format!("job:{id}:hold"), "acct_a", "system:escrow", 40, 2)
    };
    let mut tx = store.write().await.unwrap();
    assert!(tx.add_debit("acct_a", 40, true).await.unwrap());
    assert!(tx.add_credit("system:escrow", 40, true).await.unwrap());
    tx.insert_transfers(std::slice::from_ref(&hold))
        .await
        .unwrap();
    tx.open_holds(&[OpenHold {
        transfer_id: hold.id.clone(),
        job_id: Some(id.clone()),
        deadline_ms: 1_000,
    }])
    .await
    .unwrap();
    tx.commit().await.unwrap();
    assert!(store.balance_mismatches().await.unwrap().is_empty());
    let t = store.totals().await.unwrap();
    assert_eq!((t.posted, t.pending, t.open_holds), (0, 0, 1));
    assert!(store.ledger_anomalies(500, 0).await.unwrap().is_empty());
    assert_eq!(
        store.ledger_anomalies(1_001, 0).await.unwrap(),
        [(Anomaly::OpenPastDeadline, hold.id.clone())]
    );
    // A balance changed without a transfer row shows.
    let mut tx = store.write().await.unwrap();
    assert!(tx.add_credit("acct_a", 1, false).await.unwrap());
    tx.commit().await.unwrap();
    assert_eq!(store.balance_mismatches().await.unwrap(), ["acct_a"]);
    assert_eq!(store.totals().await.unwrap().posted, 1);
}

// ---- leases ----

pub(crate) async fn one_of_two_replicas_racing_for_a_lease_wins_it<B: Backend>(b: B) {
    let (a, other) = (b.store().clone(), b.another().await);
    for round in 0..12 {
        let name = format!("duty-{round}");
        let (x, y) = tokio::join!(
            a.acquire_lease(&name, "replica-a", 1_000, 10),
            other.acquire_lease(&name, "replica-b", 1_000, 10),
        );
        let won: Vec<Lease> = [x.unwrap(), y.unwrap()].into_iter().flatten().collect();
        assert_eq!(won.len(), 1, "{name}: exactly one holder, got {won:?}");
        assert_eq!((won[0].epoch, won[0].expires_at_ms), (1, 1_010));
        assert_eq!(other.lease(&name).await.unwrap().as_ref(), Some(&won[0]));
        // The loser keeps losing while the lease is live.
        let loser = if won[0].holder == "replica-a" {
            (&other, "replica-b")
        } else {
            (&a, "replica-a")
        };
        let again = loser.0.acquire_lease(&name, loser.1, 1_000, 1_009).await;
        assert_eq!(again.unwrap(), None, "{name}");
    }
    other.close().await;
}

pub(crate) async fn an_expired_lease_is_taken_over_under_a_higher_epoch<B: Backend>(b: B) {
    let (a, other) = (b.store().clone(), b.another().await);
    let acquire = |s: &AnyStore, holder: &'static str, now: i64| {
        let s = s.clone();
        async move { s.acquire_lease("sweep", holder, 1_000, now).await.unwrap() }
    };
    let first = acquire(&a, "replica-a", 0).await.unwrap();
    assert_eq!((first.epoch, first.expires_at_ms), (1, 1_000));
    // Its holder renews it under the same epoch; nobody else gets it while it lives.
    let renewed = acquire(&a, "replica-a", 500).await.unwrap();
    assert_eq!((renewed.epoch, renewed.expires_at_ms), (1, 1_500));
    assert_eq!(acquire(&other, "replica-b", 1_499).await, None);
    // Expired: taken over under a higher epoch; the old holder cannot renew.
    let taken = acquire(&other, "replica-b", 1_500).await.unwrap();
    assert_eq!(
        (taken.holder.as_str(), taken.epoch, taken.expires_at_ms),
        ("replica-b", 2, 2_500)
    );
    assert_eq!(acquire(&a, "replica-a", 1_600).await, None);
    // Only the holder under its epoch releases it; then anyone takes it at
    // once, under a new epoch (its own holder too).
    assert!(!a.release_lease(&renewed).await.unwrap(), "stale epoch");
    assert!(other.release_lease(&taken).await.unwrap());
    assert!(!other.release_lease(&taken).await.unwrap(), "released once");
    let back = acquire(&a, "replica-a", 1_700).await.unwrap();
    assert_eq!(back.epoch, 3);
    assert!(a.release_lease(&back).await.unwrap());
    assert_eq!(acquire(&a, "replica-a", 1_800).await.unwrap().epoch, 4);
    other.close().await;
}

pub(crate) async fn a_stale_holders_fenced_write_is_refused_and_changes_nothing<B: Backend>(b: B) {
    let (a, other) = (b.store().clone(), b.another().await);
    let mine = a
        .acquire_lease("rewards", "replica-a", 1_000, 0)
        .await
        .unwrap()
        .unwrap();
    // Under a live lease the write commits.
    let mut tx = a.write().await.unwrap();
    tx.fence(&mine, 999).await.unwrap();
    tx.mark_epoch_paid(1, 999, 10).await.unwrap();
    tx.commit().await.unwrap();
    // Expired (nobody took it yet): refused, since its holder cannot know.
    let mut tx = a.write().await.unwrap();
    tx.mark_epoch_paid(2, 1_000, 10).await.unwrap();
    let err = tx.fence(&mine, 1_000).await.unwrap_err();
    assert!(
        matches!(&err, StoreError::Fenced { name, epoch: 1 } if name == "rewards"),
        "{err:?}"
    );
    drop(tx);
    // Taken over: the stale holder's write is refused and changes nothing;
    // the new holder's commits.
    let theirs = other
        .acquire_lease("rewards", "replica-b", 1_000, 1_000)
        .await
        .unwrap()
        .unwrap();
    let mut tx = a.write().await.unwrap();
    tx.mark_epoch_paid(2, 1_001, 10).await.unwrap();
    assert!(matches!(
        tx.fence(&mine, 1_001).await,
        Err(StoreError::Fenced { epoch: 1, .. })
    ));
    drop(tx);
    let mut tx = a.write().await.unwrap();
    assert!(tx.epoch_paid(1).await.unwrap());
    assert!(
        !tx.epoch_paid(2).await.unwrap(),
        "the fenced write left nothing"
    );
    drop(tx);
    let mut tx = other.write().await.unwrap();
    tx.fence(&theirs, 1_001).await.unwrap();
    tx.mark_epoch_paid(2, 1_001, 10).await.unwrap();
    tx.commit().await.unwrap();
    let mut tx = a.write().await.unwrap();
    assert!(tx.epoch_paid(2).await.unwrap());
    drop(tx);
    other.close().await;
}

fn relay_chunk(job: JobId, attempt: u32, index: u32, len: u32) -> crate::domain::RelayChunk {
    crate::domain::RelayChunk {
        job,
        attempt,
        chunk: mlxnet_proto::v1::job_event::Tokens {
            index,
            token_ids: (index..index + len).collect(),
            text: format!("[{attempt}:{index}]"),
            logprobs: Vec::new(),
        },
    }
}

/// The token relay's rows: a batch reads back after any cursor in
/// (attempt, first index) order, as written, on another replica's handle;
/// a repeat is ignored; a rewind drops only the unkept tokens of earlier
/// attempts; a purge drops only ended jobs' rows older than its bound.
pub(crate) async fn relayed_chunks_read_back_in_order_rewind_and_purge(b: impl Backend) {
    let store = b.store();
    let other = b.another().await;
    let job = queued(store).await;
    let live = queued(store).await;
    // Attempt 1 streamed 0..6 (kept: a hand-off), attempt 2 6..10 (lost),
    // written out of order in two batches, the second repeating a row.
    let written = [
        relay_chunk(job.id, 2, 6, 4),
        relay_chunk(job.id, 1, 0, 3),
        relay_chunk(job.id, 1, 3, 3),
        relay_chunk(live.id, 1, 0, 2),
    ];
    store.append_tokens(&written, &[], 1_000).await.unwrap();
    store
        .append_tokens(&[relay_chunk(job.id, 1, 3, 3)], &[live.id], 1_001)
        .await
        .unwrap();
    let all = other.tokens_after(job.id, None, 100).await.unwrap();
    assert_eq!(
        all,
        vec![written[1].clone(), written[2].clone(), written[0].clone()]
    );
    let page = other.tokens_after(job.id, None, 2).await.unwrap();
    assert_eq!(page, all[..2].to_vec(), "a page is the first rows in order");
    let rest = other.tokens_after(job.id, Some((1, 3)), 100).await.unwrap();
    assert_eq!(
        rest,
        vec![written[0].clone()],
        "after a cursor, only later rows"
    );
    assert!(other
        .tokens_after(job.id, Some((2, 6)), 100)
        .await
        .unwrap()
        .is_empty());
    // Attempt 2 failed: attempt 3 resumes at 6 and its rewind drops 6.. of
    // the attempts before it, nothing of attempt 1's kept tokens.
    assert_eq!(store.rewind_tokens(job.id, 3, 6).await.unwrap(), 1);
    assert_eq!(
        other.tokens_after(job.id, None, 100).await.unwrap(),
        all[..2].to_vec()
    );
    // Purge: only ended jobs, only before the bound.
    assert_eq!(
        store.cancel(job.id).await.unwrap(),
        CancelOutcome::Cancelled
    );
    let ended = store.get_job(job.id).await.unwrap().unwrap().updated_at_ms;
    assert_eq!(
        store.purge_tokens(ended).await.unwrap(),
        0,
        "not yet old enough"
    );
    assert_eq!(store.purge_tokens(ended + 1).await.unwrap(), 2);
    assert!(store
        .tokens_after(job.id, None, 100)
        .await
        .unwrap()
        .is_empty());
    assert_eq!(
        store.tokens_after(live.id, None, 100).await.unwrap().len(),
        1,
        "an unfinished job's rows stay"
    );
    other.close().await;
}
