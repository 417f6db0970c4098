//! Ledger tests: transfer rules one by one, then a seeded random walk over
//! the messages of a job's life (submit, assign, complete, fail, cancel,
//! hand-off, expire, duplicate, crash-before-settle) against the real store
//! and ledger, checked after every step against an independent model.

use std::collections::HashMap;

use mlxnet_proto::{
    ids::JobId,
    v1::{job_input, JobInput, ResultClaim, SamplingParams, SignedClaim},
};
use rand::{rngs::StdRng, Rng, SeedableRng};

use super::{
    keys::Scopes,
    settle::{max_price, Settlement},
    *,
};
use crate::domain::{AttemptEnd, CancelOutcome, Completion, NewJob};

async fn fresh(config: LedgerConfig) -> (tempfile::TempDir, AnyStore, Ledger) {
    let dir = tempfile::tempdir().unwrap();
    let url = format!("sqlite://{}", dir.path().join("l.db").display());
    let store = AnyStore::connect(&url).await.unwrap();
    let ledger = Ledger::new(store.clone(), config);
    (dir, store, ledger)
}

/// A new account (the test's ledger must accept it).
async fn account(ledger: &Ledger, name: &str, kind: AccountKind) -> Account {
    ledger.create_account(name, kind).await.unwrap()
}

/// A greedy job (seed 1) on model "m" for `prompt`.
fn prompt_job(prompt: &str, max_tokens: u32) -> NewJob {
    NewJob {
        id: JobId::new(),
        model: "m".into(),
        input: JobInput {
            kind: Some(job_input::Kind::Prompt(prompt.into())),
        },
        sampling: SamplingParams {
            seed: Some(1),
            max_tokens,
            ..Default::default()
        },
        priority: 0,
    }
}

fn posted(id: &str, debit: &str, credit: &str, amount: i64) -> NewTransfer {
    NewTransfer {
        id: id.into(),
        kind: Some(TransferKind::Posted),
        debit: debit.into(),
        credit: credit.into(),
        amount,
        memo: "test".into(),
        ..Default::default()
    }
}

#[tokio::test]
async fn transfers_are_idempotent_two_phase_and_never_overdraw() {
    let (_dir, _store, ledger) = fresh(LedgerConfig::default()).await;
    let alice = account(&ledger, "alice", AccountKind::Client).await;
    let bob = account(&ledger, "bob", AccountKind::Operator).await;
    assert_eq!(
        ledger.grant("g1", &alice.id, 1_000, "start").await.unwrap(),
        Applied::Created
    );
    assert_eq!(
        ledger.grant("g1", &alice.id, 1_000, "start").await.unwrap(),
        Applied::AlreadyExists,
        "same id, same transfer: nothing more moves"
    );
    assert!(matches!(
        ledger.grant("g1", &alice.id, 5, "start").await,
        Err(LedgerError::ExistsWithDifferentFields { .. })
    ));
    // Overdraw refused, nothing changed.
    let err = ledger
        .transfer(&posted("t1", &alice.id, &bob.id, 1_001), 1)
        .await
        .unwrap_err();
    assert!(
        matches!(
            err,
            LedgerError::InsufficientFunds {
                needed: 1_001,
                available: 1_000,
                ..
            }
        ),
        "{err}"
    );
    // A hold reserves; only the rest can be spent.
    let hold = NewTransfer {
        id: "h1".into(),
        kind: Some(TransferKind::Pending),
        debit: alice.id.clone(),
        credit: ESCROW.into(),
        amount: 600,
        deadline_ms: Some(100),
        memo: "hold".into(),
        ..Default::default()
    };
    ledger.transfer(&hold, 10).await.unwrap();
    assert!(matches!(
        ledger
            .transfer(&posted("t2", &alice.id, &bob.id, 401), 11)
            .await,
        Err(LedgerError::InsufficientFunds { available: 400, .. })
    ));
    let a = ledger.account(&alice.id).await.unwrap().unwrap();
    assert_eq!((a.balance(), a.available()), (1_000, 400));
    // Partial post: 250 moves, 350 is released.
    let post = |id: &str, amount| NewTransfer {
        id: id.into(),
        kind: Some(TransferKind::PostPending),
        pending_id: Some("h1".into()),
        amount,
        memo: "post".into(),
        ..Default::default()
    };
    assert!(matches!(
        ledger.transfer(&post("p0", 601), 20).await,
        Err(LedgerError::ExceedsPending { .. })
    ));
    ledger.transfer(&post("p1", 250), 20).await.unwrap();
    assert_eq!(
        ledger.transfer(&post("p1", 250), 21).await.unwrap(),
        Applied::AlreadyExists
    );
    assert!(matches!(
        ledger.transfer(&post("p2", 1), 22).await,
        Err(LedgerError::AlreadyResolved(_))
    ));
    let void = NewTransfer {
        id: "v1".into(),
        kind: Some(TransferKind::VoidPending),
        pending_id: Some("h1".into()),
        ..Default::default()
    };
    assert!(matches!(
        ledger.transfer(&void, 23).await,
        Err(LedgerError::AlreadyResolved(_))
    ));
    let a = ledger.account(&alice.id).await.unwrap().unwrap();
    assert_eq!((a.balance(), a.available()), (750, 750));
    let e = ledger.account(ESCROW).await.unwrap().unwrap();
    assert_eq!(e.balance(), 250);

    // Expiry: not before the deadline, and a post after it is refused.
    let mut h2 = hold.clone();
    h2.id = "h2".into();
    h2.amount = 100;
    ledger.transfer(&h2, 30).await.unwrap();
    let expire = NewTransfer {
        id: "x2".into(),
        kind: Some(TransferKind::ExpirePending),
        pending_id: Some("h2".into()),
        ..Default::default()
    };
    assert!(
        ledger.transfer(&expire, 100).await.is_err(),
        "deadline not passed yet"
    );
    let mut late_post = post("p3", 10);
    late_post.pending_id = Some("h2".into());
    assert!(matches!(
        ledger.transfer(&late_post, 101).await,
        Err(LedgerError::PendingExpired { .. })
    ));
    ledger.transfer(&expire, 101).await.unwrap();
    assert_eq!(
        ledger
            .account(&alice.id)
            .await
            .unwrap()
            .unwrap()
            .available(),
        750
    );

    // Rows are immutable, whatever the caller: the schema's part, checked
    // by the SQLite store's own tests (`store::sqlite::tests`).
    assert_eq!(
        ledger.totals().await.unwrap(),
        Totals {
            posted: 0,
            pending: 0,
            open_holds: 0
        }
    );
    assert!(ledger.audit().await.unwrap().is_empty());
}

#[tokio::test]
async fn keys_are_stored_as_hashes_and_bad_keys_are_indistinguishable() {
    let (dir, store, ledger) = fresh(LedgerConfig::default()).await;
    let admin = ledger.bootstrap_admin("root").await.unwrap();
    assert!(!format!("{admin:?}").contains(admin.secret()));
    let acct = account(&ledger, "carol", AccountKind::Client).await;
    let key = ledger
        .create_key(
            &acct.id,
            Scopes::from_list(["submit", "read"]).unwrap(),
            "laptop",
            None,
        )
        .await
        .unwrap();
    let expired = ledger
        .create_key(&acct.id, Scopes::from_list(["read"]).unwrap(), "", Some(5))
        .await
        .unwrap();
    let caller = ledger
        .authenticate(key.secret(), 10)
        .await
        .unwrap()
        .unwrap();
    assert_eq!(caller.account_id, acct.id);
    assert!(caller.scopes.allows(keys::Scope::Submit) && !caller.scopes.allows(keys::Scope::Admin));
    assert_eq!(
        ledger.authenticate(expired.secret(), 10).await.unwrap(),
        None
    );
    assert!(ledger.revoke_key(&key.id, Some(&acct.id)).await.unwrap());
    assert_eq!(ledger.authenticate(key.secret(), 10).await.unwrap(), None);
    assert_eq!(ledger.authenticate("mlxk_00", 10).await.unwrap(), None);
    assert!(!ledger.revoke_key(&key.id, Some(&acct.id)).await.unwrap());
    store.close().await;

    // A dump of the whole database file holds no key.
    let mut bytes = std::fs::read(dir.path().join("l.db")).unwrap();
    if let Ok(wal) = std::fs::read(dir.path().join("l.db-wal")) {
        bytes.extend(wal);
    }
    for secret in [admin.secret(), key.secret(), expired.secret()] {
        let hex_part = &secret[keys::KEY_PREFIX.len()..];
        assert!(
            !bytes
                .windows(hex_part.len())
                .any(|w| w == hex_part.as_bytes()),
            "a key's secret is in the database"
        );
    }
}

// ---- the random walk ----

const NODES: [&str; 3] = [
    "a1a1a1a1a1a1a1a1a1a1a1a1a1a1a1a1a1a1a1a1a1a1a1a1a1a1a1a1a1a1a1a1",
    "b2b2b2b2b2b2b2b2b2b2b2b2b2b2b2b2b2b2b2b2b2b2b2b2b2b2b2b2b2b2b2b2",
    "c3c3c3c3c3c3c3c3c3c3c3c3c3c3c3c3c3c3c3c3c3c3c3c3c3c3c3c3c3c3c3c3",
];
const PRICE: Price = Price {
    input_per_mtok: 700_000,
    output_per_mtok: 2_300_000,
};
const FEE_BPS: u32 = 500;
const TTL: i64 = 3_600_000;
const MAX_ATTEMPTS: u32 = 3;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum St {
    Queued,
    Assigned,
    Completed,
    Failed,
    Cancelled,
}

#[derive(Clone, Debug)]
struct ModelJob {
    id: JobId,
    client: usize,
    hold: i64,
    deadline: i64,
    st: St,
    attempt: u32,
    node: Option<usize>,
    /// Verified work of earlier nodes (hand-off).
    partial: Vec<Share>,
    settled: bool,
}

#[derive(Clone, Debug)]
enum Msg {
    Submit {
        client: usize,
        prompt: usize,
        max_tokens: u32,
    },
    Assign {
        job: usize,
        node: usize,
    },
    Complete {
        job: usize,
        input: u64,
        output: u64,
        settle: bool,
    },
    Fail {
        job: usize,
        retryable: bool,
    },
    Cancel {
        job: usize,
    },
    HandOff {
        job: usize,
        output: u64,
    },
    Expire {
        advance: i64,
    },
    Reconcile,
}

struct Walk {
    store: AnyStore,
    ledger: Ledger,
    clients: Vec<String>,
    operators: Vec<String>,
    jobs: Vec<ModelJob>,
    now: i64,
    /// Expected balance per account id.
    expect: HashMap<String, i64>,
    refused: usize,
    expired: usize,
}

impl Walk {
    fn operator(&self, node: usize) -> String {
        self.operators[node].clone()
    }

    fn available(&self, client: usize) -> i64 {
        let id = &self.clients[client];
        self.expect[id]
            - self
                .jobs
                .iter()
                .filter(|j| j.client == client && !j.settled && j.hold > 0)
                .map(|j| j.hold)
                .sum::<i64>()
    }

    /// Books the expected effect of settling `j` (index) now.
    fn book(&mut self, j: usize, shares: &[Share]) {
        let job = self.jobs[j].clone();
        if job.settled {
            return;
        }
        self.jobs[j].settled = true;
        if job.st != St::Completed || job.hold == 0 {
            return;
        }
        let mut remaining = job.hold;
        for s in shares {
            let p = PRICE.of(s.input_tokens, s.output_tokens).min(remaining);
            remaining -= p;
            let fee = p * i64::from(FEE_BPS) / 10_000;
            *self.expect.get_mut(&self.clients[job.client]).unwrap() -= p;
            let node = NODES.iter().position(|n| *n == s.node_id).unwrap();
            *self.expect.entry(self.operator(node)).or_default() += p - fee;
            *self.expect.entry(FEE.to_owned()).or_default() += fee;
        }
    }

    async fn settle(&mut self, j: usize, shares: Option<Vec<Share>>) {
        let id = self.jobs[j].id;
        let got = match &shares {
            Some(s) => self.ledger.settle_shares(id, s, self.now).await.unwrap(),
            None => self.ledger.settle_job(id, self.now).await.unwrap(),
        };
        let job = &self.jobs[j];
        let expected_kind = match (job.settled, job.st, job.hold) {
            (true, _, _) | (_, _, 0) => "nothing",
            (false, St::Completed, _) => "paid",
            (false, St::Failed | St::Cancelled, _) => "released",
            _ => "open",
        };
        let kind = match got {
            Settlement::Paid { price, fee, refund } => {
                assert_eq!(price + refund, job.hold, "refund + payout + fee == hold");
                assert!(fee <= price);
                "paid"
            }
            Settlement::Voided | Settlement::Expired => "released",
            Settlement::Open | Settlement::Overdue => "open",
            Settlement::NothingOpen => "nothing",
        };
        assert_eq!(kind, expected_kind, "settling job {j} ({:?})", self.jobs[j]);
        if kind == "paid" || kind == "released" {
            let shares = shares.unwrap_or_else(|| self.jobs[j].partial.clone());
            self.book(j, &shares);
        }
    }

    async fn step(&mut self, msg: Msg) {
        match msg {
            Msg::Submit {
                client,
                prompt,
                max_tokens,
            } => {
                let job = prompt_job(&"x".repeat(prompt), max_tokens);
                let hold = max_price(&PRICE, &job.input, max_tokens);
                let terms = JobTerms {
                    account: self.clients[client].clone(),
                    price: PRICE,
                    max_price: hold,
                };
                let fits = self.available(client) >= hold;
                let r = self.ledger.submit_job(&job, &terms, self.now).await;
                if fits {
                    r.unwrap();
                    self.jobs.push(ModelJob {
                        id: job.id,
                        client,
                        hold,
                        deadline: self.now + TTL,
                        st: St::Queued,
                        attempt: 1,
                        node: None,
                        partial: Vec::new(),
                        settled: false,
                    });
                } else {
                    assert!(
                        matches!(r, Err(LedgerError::InsufficientFunds { .. })),
                        "{r:?}"
                    );
                    assert!(
                        self.store.get_job(job.id).await.unwrap().is_none(),
                        "no job row"
                    );
                    self.refused += 1;
                }
                // A duplicate submit of the same job changes nothing.
                if fits {
                    assert!(self
                        .ledger
                        .submit_job(&job, &terms, self.now)
                        .await
                        .is_err());
                }
            }
            Msg::Assign { job, node } => {
                let Some(m) = self.jobs.get(job).cloned() else {
                    return;
                };
                let ok = self
                    .store
                    .assign(m.id, m.attempt, NODES[node])
                    .await
                    .unwrap();
                assert_eq!(ok, m.st == St::Queued);
                if ok {
                    self.jobs[job].st = St::Assigned;
                    self.jobs[job].node = Some(node);
                }
            }
            Msg::Complete {
                job,
                input,
                output,
                settle,
            } => {
                let Some(m) = self.jobs.get(job).cloned() else {
                    return;
                };
                let node = m.node.unwrap_or(0);
                let c = Completion {
                    job_id: m.id,
                    attempt: m.attempt,
                    node_id: NODES[node].into(),
                    result: SignedClaim {
                        claim: Some(ResultClaim {
                            job_id: m.id.to_string(),
                            attempt: m.attempt,
                            prompt_tokens: input as u32,
                            completion_tokens: output as u32,
                            ..Default::default()
                        }),
                        signature: vec![1; 64],
                    },
                };
                let ok = self.store.complete(&c).await.unwrap();
                assert_eq!(ok, m.st == St::Assigned && m.node.is_some());
                if !ok {
                    // A late or duplicate result: settling again moves nothing.
                    self.settle(job, None).await;
                    return;
                }
                self.jobs[job].st = St::Completed;
                let handed_off = !m.partial.is_empty();
                self.jobs[job].partial.push(Share {
                    node_id: NODES[node].into(),
                    attempt: m.attempt,
                    input_tokens: input,
                    output_tokens: output,
                });
                if handed_off {
                    let shares = self.jobs[job].partial.clone();
                    self.settle(job, Some(shares)).await;
                } else if settle {
                    self.settle(job, None).await;
                }
                // else: a crash between the store's completion and settlement;
                // reconcile, the sweep or a duplicate result settles it later.
            }
            Msg::Fail { job, retryable } => {
                let Some(m) = self.jobs.get(job).cloned() else {
                    return;
                };
                let node = m.node.unwrap_or(0);
                let end = self
                    .store
                    .fail_attempt(
                        m.id,
                        m.attempt,
                        NODES[node],
                        "lost",
                        retryable,
                        MAX_ATTEMPTS,
                    )
                    .await
                    .unwrap();
                if m.st != St::Assigned || m.node.is_none() {
                    assert_eq!(end, None);
                    return;
                }
                match end {
                    Some(AttemptEnd::Requeued { attempt }) => {
                        assert!(retryable && m.attempt < MAX_ATTEMPTS);
                        self.jobs[job].st = St::Queued;
                        self.jobs[job].attempt = attempt;
                        self.jobs[job].node = None;
                    }
                    Some(AttemptEnd::Failed) => {
                        self.jobs[job].st = St::Failed;
                        self.jobs[job].partial.clear();
                        self.settle(job, None).await;
                    }
                    None => panic!("fail of an assigned attempt changed nothing"),
                }
            }
            Msg::HandOff { job, output } => {
                // The node produced `output` verified tokens, then handed the
                // job on (its attempt ends; the next node continues).
                let Some(m) = self.jobs.get(job).cloned() else {
                    return;
                };
                if m.st != St::Assigned || m.attempt >= MAX_ATTEMPTS {
                    return;
                }
                let node = m.node.unwrap_or(0);
                let end = self
                    .store
                    .fail_attempt(
                        m.id,
                        m.attempt,
                        NODES[node],
                        "handed off",
                        true,
                        MAX_ATTEMPTS,
                    )
                    .await
                    .unwrap();
                assert_eq!(
                    end,
                    Some(AttemptEnd::Requeued {
                        attempt: m.attempt + 1
                    })
                );
                let j = &mut self.jobs[job];
                j.partial.push(Share {
                    node_id: NODES[node].into(),
                    attempt: m.attempt,
                    input_tokens: 0,
                    output_tokens: output,
                });
                j.st = St::Queued;
                j.attempt += 1;
                j.node = None;
            }
            Msg::Cancel { job } => {
                let Some(m) = self.jobs.get(job).cloned() else {
                    return;
                };
                let out = self.store.cancel(m.id).await.unwrap();
                if matches!(m.st, St::Queued | St::Assigned) {
                    assert_eq!(out, CancelOutcome::Cancelled);
                    self.jobs[job].st = St::Cancelled;
                    self.jobs[job].partial.clear();
                    self.settle(job, None).await;
                } else {
                    assert!(matches!(out, CancelOutcome::AlreadyFinished(_)));
                    self.settle(job, None).await;
                }
            }
            Msg::Expire { advance } => {
                self.now += advance;
                self.sweep().await;
            }
            Msg::Reconcile => self.reconcile().await,
        }
    }

    /// What the coordinator's sweep does: unfinished jobs whose hold is due
    /// are cancelled, then every due hold is settled.
    async fn sweep(&mut self) {
        let due = self.ledger.due_holds(self.now, 1_000).await.unwrap();
        for id in due {
            let j = self
                .jobs
                .iter()
                .position(|j| j.id.to_string() == id)
                .unwrap();
            assert!(self.jobs[j].deadline < self.now && !self.jobs[j].settled);
            if matches!(self.jobs[j].st, St::Queued | St::Assigned) {
                assert_eq!(
                    self.store.cancel(self.jobs[j].id).await.unwrap(),
                    CancelOutcome::Cancelled
                );
                self.jobs[j].st = St::Cancelled;
                self.jobs[j].partial.clear();
            }
            let shares = self.jobs[j].partial.clone();
            let got = self
                .ledger
                .settle_job(self.jobs[j].id, self.now)
                .await
                .unwrap();
            assert!(
                matches!(got, Settlement::Paid { .. } | Settlement::Expired),
                "{got:?}"
            );
            self.expired += usize::from(got == Settlement::Expired);
            self.book(j, &shares);
        }
    }

    /// What start-up does: settle jobs that ended without settlement.
    async fn reconcile(&mut self) {
        for id in self.ledger.unsettled_jobs(self.now, 1_000).await.unwrap() {
            let j = self
                .jobs
                .iter()
                .position(|j| j.id.to_string() == id)
                .unwrap();
            let shares = self.jobs[j].partial.clone();
            let got = self
                .ledger
                .settle_job(self.jobs[j].id, self.now)
                .await
                .unwrap();
            assert!(!matches!(
                got,
                Settlement::Open | Settlement::Overdue | Settlement::NothingOpen
            ));
            self.book(j, &shares);
        }
    }

    async fn check(&self) {
        let t = self.ledger.totals().await.unwrap();
        assert_eq!(
            (t.posted, t.pending),
            (0, 0),
            "the sum over accounts is constant"
        );
        let open = self
            .jobs
            .iter()
            .filter(|j| !j.settled && j.hold > 0)
            .count() as i64;
        assert_eq!(t.open_holds, open, "open holds");
        assert_eq!(self.ledger.audit().await.unwrap(), Vec::<String>::new());

        for (id, want) in &self.expect {
            let a = self.ledger.account(id).await.unwrap().unwrap();
            assert_eq!(a.balance(), *want, "balance of {id}");
        }
        let escrow = self.ledger.account(ESCROW).await.unwrap().unwrap();
        assert_eq!(
            escrow.balance(),
            0,
            "escrow pays out in the same transaction"
        );
    }

    /// After the walk: per-job checks on the transfer rows.
    async fn check_rows(&self) {
        // (id, kind, amount, pending_id, node_id, memo) of every job's transfers.
        let mut rows = Vec::new();
        for j in &self.jobs {
            let transfers = self.store.job_transfers(&j.id.to_string()).await.unwrap();
            rows.extend(transfers.into_iter().map(|t| {
                let kind = t.kind.as_str().to_owned();
                (t.id, kind, t.amount, t.pending_id, t.node_id, t.memo)
            }));
        }
        for j in &self.jobs {
            let prefix = format!("job:{}:", j.id);
            let mine: Vec<_> = rows.iter().filter(|r| r.0.starts_with(&prefix)).collect();
            let holds = mine.iter().filter(|r| r.1 == "pending").count();
            let resolutions: Vec<_> = mine.iter().filter(|r| r.3.is_some()).collect();
            let payouts: Vec<_> = mine.iter().filter(|r| r.5 == "payout").collect();
            let fee: i64 = mine.iter().filter(|r| r.5 == "fee").map(|r| r.2).sum();
            if j.hold == 0 {
                assert!(mine.is_empty());
                continue;
            }
            assert_eq!(holds, 1);
            assert_eq!(
                resolutions.len(),
                usize::from(j.settled),
                "each hold resolved exactly once"
            );
            if j.st == St::Completed && j.settled {
                let post = resolutions[0];
                assert_eq!(
                    post.1, "post_pending",
                    "no job paid twice, none voided after pay"
                );
                let paid: i64 = payouts.iter().map(|r| r.2).sum();
                assert_eq!(paid + fee, post.2, "payout + fee == posted");
                assert!(post.2 <= j.hold);
            } else {
                assert!(
                    payouts.is_empty() && fee == 0,
                    "nobody is paid for a failed job: {j:?}"
                );
                if j.settled {
                    assert!(matches!(
                        resolutions[0].1.as_str(),
                        "void_pending" | "expire_pending"
                    ));
                    assert_eq!(resolutions[0].2, j.hold, "the whole hold is released");
                }
            }
        }
    }
}

fn random_msg(rng: &mut StdRng, jobs: usize) -> Msg {
    // Mostly the newest jobs, so many go through their whole lives.
    let job = match jobs {
        0 => 0,
        n if rng.gen_bool(0.7) => n - 1 - rng.gen_range(0..n.min(3)),
        n => rng.gen_range(0..n),
    };
    match rng.gen_range(0..100) {
        0..=24 => Msg::Submit {
            client: rng.gen_range(0..3),
            prompt: rng.gen_range(1..400),
            max_tokens: rng.gen_range(1..600),
        },
        25..=44 => Msg::Assign {
            job,
            node: rng.gen_range(0..NODES.len()),
        },
        45..=62 => Msg::Complete {
            job,
            input: rng.gen_range(0..300),
            output: rng.gen_range(0..500),
            settle: rng.gen_bool(0.8),
        },
        63..=72 => Msg::Fail {
            job,
            retryable: rng.gen_bool(0.6),
        },
        73..=79 => Msg::Cancel { job },
        80..=86 => Msg::HandOff {
            job,
            output: rng.gen_range(1..200),
        },
        87..=93 => Msg::Expire {
            advance: rng.gen_range(0..TTL / 2),
        },
        _ => Msg::Reconcile,
    }
}

#[tokio::test]
async fn random_job_lives_keep_the_books_balanced() {
    let seeds: u64 = std::env::var("LEDGER_WALK_SEEDS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(64);
    #[derive(Debug, Default)]
    struct Seen {
        completed: usize,
        handed_off: usize,
        failed: usize,
        refused: usize,
        expired: usize,
    }
    let mut seen = Seen::default();
    for seed in 0..seeds {
        eprintln!("seed {seed}");
        let mut rng = StdRng::seed_from_u64(seed);
        let config = LedgerConfig {
            fee_bps: FEE_BPS,
            hold_ttl_ms: TTL,
            ..LedgerConfig::default()
        };
        let (_dir, store, ledger) = fresh(config).await;
        let mut clients = Vec::new();
        let mut expect = HashMap::new();
        for (i, grant) in [200_000i64, 8_000, 600].into_iter().enumerate() {
            let a = account(&ledger, &format!("client{i}"), AccountKind::Client).await;
            ledger
                .grant(&format!("g{i}"), &a.id, grant, "start")
                .await
                .unwrap();
            expect.insert(a.id.clone(), grant);
            clients.push(a.id);
        }
        let op = account(&ledger, "op", AccountKind::Operator).await;
        let mut operators = Vec::new();
        for (i, n) in NODES.iter().enumerate() {
            // Two nodes share one operator; the third was never linked.
            let linked = if i < 2 {
                ledger.link_node(n, &op.id).await.unwrap()
            } else {
                ledger.link_node(n, "").await.unwrap()
            };
            expect.entry(linked.clone()).or_insert(0);
            operators.push(linked);
        }
        expect.insert(FEE.to_owned(), 0);
        let mut walk = Walk {
            store,
            ledger,
            clients,
            operators,
            jobs: Vec::new(),
            now: crate::util::now_ms(),
            expect,
            refused: 0,
            expired: 0,
        };
        let mut history: Vec<Msg> = Vec::new();
        for _ in 0..80 {
            // Duplicates: a message seen before, delivered again.
            let msg = if !history.is_empty() && rng.gen_bool(0.1) {
                history[rng.gen_range(0..history.len())].clone()
            } else {
                random_msg(&mut rng, walk.jobs.len())
            };
            if !matches!(msg, Msg::Submit { .. }) {
                history.push(msg.clone());
            }
            walk.step(msg).await;
            walk.check().await;
        }
        // The end of the world: everything unfinished is cancelled.
        walk.reconcile().await;
        for j in 0..walk.jobs.len() {
            walk.step(Msg::Cancel { job: j }).await;
        }
        walk.step(Msg::Reconcile).await;
        walk.check().await;
        assert_eq!(
            walk.ledger.totals().await.unwrap().open_holds,
            0,
            "seed {seed}"
        );
        walk.check_rows().await;
        assert_eq!(
            walk.ledger.violations(walk.now).await.unwrap(),
            Vec::<String>::new(),
            "seed {seed}"
        );
        seen.completed += walk.jobs.iter().filter(|j| j.st == St::Completed).count();
        seen.handed_off += walk
            .jobs
            .iter()
            .filter(|j| j.st == St::Completed && j.partial.len() > 1)
            .count();
        seen.failed += walk.jobs.iter().filter(|j| j.st == St::Failed).count();
        seen.refused += walk.refused;
        seen.expired += walk.expired;
    }
    // The walk went through every path it claims to test.
    eprintln!("{seen:?}");
    assert!(
        seen.completed > 0
            && seen.handed_off > 0
            && seen.failed > 0
            && seen.refused > 0
            && seen.expired > 0,
        "{seen:?}"
    );
}

#[test]
fn availability_rewards_follow_memory_and_time_within_the_cap() {
    use super::rewards::{split, Availability};
    let gib = 1u64 << 30;
    let rows = [
        Availability {
            node_id: "ultra".into(),
            memory_bytes: 512 * gib,
            online_ms: 3_600_000,
        },
        Availability {
            node_id: "mini".into(),
            memory_bytes: 16 * gib,
            online_ms: 3_600_000,
        },
        Availability {
            node_id: "half".into(),
            memory_bytes: 16 * gib,
            online_ms: 1_800_000,
        },
    ];
    // 1,000 micro-MLX per GiB-hour, budget not binding.
    let paid: HashMap<_, _> = split(&rows, 1_000, i64::MAX).into_iter().collect();
    assert_eq!(paid["ultra"], 512_000);
    assert_eq!(paid["mini"], 16_000);
    assert_eq!(paid["half"], 8_000, "half the hours, half the reward");
    // A cap scales every reward by the same factor and is never exceeded.
    let capped: HashMap<_, _> = split(&rows, 1_000, 268_000).into_iter().collect();
    assert_eq!(capped["ultra"], 256_000);
    assert_eq!(capped["mini"], 8_000);
    assert!(capped.values().sum::<i64>() <= 268_000);
    assert!(
        split(&rows, 1_000, 0).is_empty(),
        "an empty pool pays nothing"
    );
}

/// A ledger paying rewards in 1 s epochs, 1 micro-MLX per GiB-ms, from a
/// pool holding 50,000; `NODES[0]` linked to the operator it returns.
async fn rewards_ledger() -> (tempfile::TempDir, AnyStore, Ledger, Account) {
    let config = LedgerConfig {
        reward_epoch_ms: 1_000,
        reward_per_gib_hour: 3_600_000,
        reward_pool_per_epoch: 1_000_000,
        ..LedgerConfig::default()
    };
    let (dir, store, ledger) = fresh(config).await;
    ledger
        .grant("pool", REWARD_POOL, 50_000, "fund")
        .await
        .unwrap();
    let op = account(&ledger, "op", AccountKind::Operator).await;
    ledger.link_node(NODES[0], &op.id).await.unwrap();
    (dir, store, ledger, op)
}

#[tokio::test]
async fn rewards_are_paid_once_per_epoch_from_the_pool() {
    let (_dir, _store, ledger, op) = rewards_ledger().await;
    let gib = 1u64 << 30;
    // Epoch 5 (5,000..6,000 ms): node 0 offers 8 GiB for 2 s, node 1 2 GiB for 1 s.
    ledger
        .record_online(NODES[0], 8 * gib, 1_000, 5_100)
        .await
        .unwrap();
    ledger
        .record_online(NODES[0], 8 * gib, 1_000, 5_900)
        .await
        .unwrap();
    ledger
        .record_online(NODES[1], 2 * gib, 1_000, 5_500)
        .await
        .unwrap();
    assert_eq!(
        ledger.pay_rewards(5_999).await.unwrap(),
        0,
        "epoch not over"
    );
    assert_eq!(ledger.pay_rewards(6_000).await.unwrap(), 1);
    assert_eq!(ledger.pay_rewards(7_000).await.unwrap(), 0, "paid once");
    // 1 micro-MLX per GiB-ms: 16,000 and 2,000.
    assert_eq!(
        ledger.account(&op.id).await.unwrap().unwrap().balance(),
        16_000
    );
    let pool = ledger.account(REWARD_POOL).await.unwrap().unwrap();
    assert_eq!(pool.balance(), 50_000 - 18_000);
    // The pool caps what it pays: an epoch owed more than it holds is scaled.
    ledger
        .record_online(NODES[0], 8 * gib, 10_000, 7_100)
        .await
        .unwrap();
    assert_eq!(ledger.pay_rewards(8_000).await.unwrap(), 1);
    let pool = ledger.account(REWARD_POOL).await.unwrap().unwrap();
    assert!(
        pool.balance() >= 0 && pool.balance() < 32_000,
        "{}",
        pool.balance()
    );
    assert_eq!(
        ledger.violations(8_000).await.unwrap(),
        Vec::<String>::new()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_submits_commit_in_groups_and_each_gets_its_own_answer() {
    let (_dir, store, ledger) = fresh(LedgerConfig::default()).await;
    let rich = account(&ledger, "rich", AccountKind::Client).await;
    let poor = account(&ledger, "poor", AccountKind::Client).await;
    ledger.grant("rich", &rich.id, 1_000_000, "").await.unwrap();
    ledger.grant("poor", &poor.id, 300, "").await.unwrap();
    let mut tasks = Vec::new();
    for i in 0..40 {
        let ledger = ledger.clone();
        let account = if i % 2 == 0 { &rich.id } else { &poor.id }.clone();
        tasks.push(tokio::spawn(async move {
            let job = prompt_job("hi", 8);
            let terms = JobTerms {
                account: account.clone(),
                price: PRICE,
                max_price: 100,
            };
            (account, job.id, ledger.submit_job(&job, &terms, 1).await)
        }));
    }
    let (mut rich_ok, mut poor_ok, mut refused) = (0, 0, 0);
    for t in tasks {
        let (account, id, r) = t.await.unwrap();
        match r {
            Ok(record) => {
                assert_eq!(record.id, id, "each submit gets its own job back");
                if account == rich.id {
                    rich_ok += 1;
                } else {
                    poor_ok += 1;
                }
            }
            Err(LedgerError::InsufficientFunds { .. }) => {
                assert_eq!(account, poor.id);
                assert!(store.get_job(id).await.unwrap().is_none());
                refused += 1;
            }
            Err(e) => panic!("{e}"),
        }
    }
    assert_eq!((rich_ok, poor_ok, refused), (20, 3, 17));
    assert_eq!(ledger.totals().await.unwrap().open_holds, 23);
    assert!(ledger.audit().await.unwrap().is_empty());
}

/// A job split across three attempts pays each token once, to the node whose
/// signed claim covers it: the drained node (partial claim) its output, the
/// vanished node (no claim) nothing, the finisher the prompt once and its
/// output. The client pays no more than the job run whole.
#[tokio::test]
async fn a_handed_off_job_pays_each_signed_token_once() {
    use crate::domain::{Segment, StreamedEnd};
    let (_dir, store, ledger) = fresh(LedgerConfig::default()).await;
    let client = account(&ledger, "client", AccountKind::Client).await;
    ledger.grant("c", &client.id, 1_000_000, "").await.unwrap();
    let op = account(&ledger, "op", AccountKind::Operator).await;
    for n in ["drained", "vanished", "finisher"] {
        ledger.link_node(n, &op.id).await.unwrap();
    }
    let job = prompt_job("hello there", 100);
    let terms = JobTerms {
        account: client.id.clone(),
        price: PRICE,
        max_price: 10_000,
    };
    let now = crate::util::now_ms();
    ledger.submit_job(&job, &terms, now).await.unwrap();
    let partial = SignedClaim {
        claim: Some(ResultClaim {
            finish_reason: "handoff".into(),
            completion_tokens: 40,
            ..Default::default()
        }),
        signature: vec![1; 64],
    };
    let attempts = [
        ("drained", 0, 40, Some(partial)),
        ("vanished", 40, 25, None),
    ];
    for (i, (node, first, n, claim)) in attempts.into_iter().enumerate() {
        let attempt = i as u32 + 1;
        assert!(store.assign(job.id, attempt, node).await.unwrap());
        let end = StreamedEnd {
            job: job.id,
            attempt,
            node_id: node,
            reason: "gone",
            retryable: true,
            max_attempts: 3,
        };
        let segment = Segment {
            attempt,
            node_id: node.into(),
            first_index: first,
            token_ids: vec![9; n],
            text: "x".repeat(n),
            claim,
        };
        store.end_attempt_streamed(&end, &segment).await.unwrap();
    }
    assert!(store.assign(job.id, 3, "finisher").await.unwrap());
    let prompt = 12;
    let finished = Completion {
        job_id: job.id,
        attempt: 3,
        node_id: "finisher".into(),
        result: SignedClaim {
            claim: Some(ResultClaim {
                // It prefilled the prompt and the 65 resumed tokens.
                prompt_tokens: prompt + 65,
                completion_tokens: 35,
                finish_reason: "length".into(),
                ..Default::default()
            }),
            signature: vec![1; 64],
        },
    };
    assert!(store.complete(&finished).await.unwrap());
    let drained = PRICE.of(0, 40);
    let finisher = PRICE.of(u64::from(prompt), 35);
    let fee = |p: i64| p * i64::from(FEE_BPS) / 10_000;
    match ledger.settle_job(job.id, now + 1).await.unwrap() {
        Settlement::Paid { price, .. } => assert_eq!(price, drained + finisher),
        other => panic!("{other:?}"),
    }
    assert!(drained + finisher <= PRICE.of(u64::from(prompt), 100) + 1);
    let earned: HashMap<String, (i64, i64)> = ledger
        .earnings(&op.id, 0)
        .await
        .unwrap()
        .into_iter()
        .map(|e| (e.node_id, (e.micro_mlx, e.tokens)))
        .collect();
    assert_eq!(earned["drained"], (drained - fee(drained), 40));
    assert_eq!(earned["finisher"], (finisher - fee(finisher), 35));
    assert!(
        !earned.contains_key("vanished"),
        "unsigned tokens pay nobody"
    );
    assert_eq!(
        ledger.settle_job(job.id, now + 2).await.unwrap(),
        Settlement::NothingOpen,
        "paid once"
    );
    assert!(ledger.audit().await.unwrap().is_empty());
}

/// Queues `submits` in order while a write transaction is held (so the
/// store's writer is taken), then lets them go: they are written as one
/// group commit. One answer per submit.
async fn one_batch(
    ledger: &Ledger,
    submits: Vec<(NewJob, JobTerms)>,
) -> Vec<Result<crate::domain::JobRecord, LedgerError>> {
    let guard = ledger.store().write().await.unwrap();
    let mut tasks = Vec::new();
    for (i, (job, terms)) in submits.into_iter().enumerate() {
        let l = ledger.clone();
        tasks.push(tokio::spawn(async move {
            l.submit_job(&job, &terms, 1_000).await
        }));
        while ledger.submits.lock().unwrap().len() <= i {
            tokio::task::yield_now().await;
        }
    }
    drop(guard);
    let mut out = Vec::new();
    for t in tasks {
        out.push(t.await.unwrap());
    }
    assert!(ledger.submits.lock().unwrap().is_empty());
    out
}

fn terms_of(account: &str, max_price: i64) -> JobTerms {
    JobTerms {
        account: account.into(),
        price: PRICE,
        max_price,
    }
}

#[tokio::test]
async fn a_batch_refuses_only_the_submits_that_cannot_be_held() {
    let (_dir, store, ledger) = fresh(LedgerConfig::default()).await;
    let rich = account(&ledger, "rich", AccountKind::Client).await;
    let poor = account(&ledger, "poor", AccountKind::Client).await;
    ledger.grant("rich", &rich.id, 1_000_000, "").await.unwrap();
    ledger.grant("poor", &poor.id, 250, "").await.unwrap();
    let old = prompt_job("old", 8);
    ledger
        .submit_job(&old, &terms_of(&rich.id, 10), 1)
        .await
        .unwrap();
    let twice = prompt_job("twice", 8);
    let batch = vec![
        (prompt_job("a", 8), terms_of(&poor.id, 100)),
        (prompt_job("b", 8), terms_of(&rich.id, 100)),
        (prompt_job("c", 8), terms_of(&poor.id, 100)),
        // 50 left: this one would overdraw, the next one fits exactly.
        (prompt_job("d", 8), terms_of(&poor.id, 100)),
        (prompt_job("e", 8), terms_of(&poor.id, 50)),
        (prompt_job("f", 8), terms_of("acct_nobody", 10)),
        (old.clone(), terms_of(&rich.id, 10)),
        (twice.clone(), terms_of(&rich.id, 10)),
        (twice.clone(), terms_of(&rich.id, 10)),
        (prompt_job("g", 8), terms_of(&rich.id, -5)),
        (prompt_job("h", 8), terms_of(&rich.id, 0)),
    ];
    let jobs: Vec<JobId> = batch.iter().map(|(j, _)| j.id).collect();
    let answers = one_batch(&ledger, batch).await;
    let verdict = |r: &Result<crate::domain::JobRecord, LedgerError>| match r {
        Ok(_) => "ok".to_owned(),
        Err(LedgerError::InsufficientFunds {
            needed, available, ..
        }) => format!("funds {needed}/{available}"),
        Err(LedgerError::NoSuchAccount(_)) => "account".into(),
        Err(LedgerError::Invalid(m)) => m.to_string(),
        Err(e) => panic!("{e}"),
    };
    let got: Vec<String> = answers.iter().map(verdict).collect();
    assert_eq!(
        got,
        [
            "ok",
            "ok",
            "ok",
            "funds 100/50",
            "ok",
            "account",
            "this job was already submitted",
            "ok",
            "this job was already submitted",
            "amounts are never negative",
            "ok",
        ]
    );
    for (i, (id, r)) in jobs.iter().zip(&answers).enumerate() {
        let stored = store.get_job(*id).await.unwrap();
        match r {
            Ok(record) => {
                assert_eq!(record.id, *id);
                assert_eq!(stored.as_ref(), Some(record), "submit {i}");
            }
            // A refused duplicate leaves the first one's row alone.
            Err(_) if *id == old.id || *id == twice.id => assert!(stored.is_some()),
            Err(_) => assert!(stored.is_none(), "refused submit {i} stored a job"),
        }
    }
    let poor_now = ledger.account(&poor.id).await.unwrap().unwrap();
    assert_eq!((poor_now.available(), poor_now.debits_pending), (0, 250));
    let rich_now = ledger.account(&rich.id).await.unwrap().unwrap();
    assert_eq!(rich_now.debits_pending, 10 + 100 + 10);
    let escrow = ledger.account(ESCROW).await.unwrap().unwrap();
    assert_eq!(escrow.credits_pending, 250 + 120);
    // Holds: old, a, b, c, e, twice (h is free: terms, no hold).
    assert_eq!(ledger.totals().await.unwrap().open_holds, 6);
    assert_eq!(
        ledger.job_terms(jobs[10]).await.unwrap().unwrap().max_price,
        0
    );
    assert_eq!(
        ledger.violations(2_000).await.unwrap(),
        Vec::<String>::new()
    );
    // Each hold settles once, as any other.
    assert!(store.cancel(jobs[0]).await.is_ok());
    assert_eq!(
        ledger.settle_job(jobs[0], 2_000).await.unwrap(),
        Settlement::Voided
    );
    assert_eq!(
        ledger.account(&poor.id).await.unwrap().unwrap().available(),
        100
    );
}

#[tokio::test]
async fn a_database_error_aborts_the_whole_batch_and_stores_nothing_of_it() {
    let (_dir, store, ledger) = fresh(LedgerConfig::default()).await;
    let client = account(&ledger, "client", AccountKind::Client).await;
    ledger.grant("c", &client.id, 1_000, "").await.unwrap();
    let mut bad = prompt_job("bad", 8);
    // The schema refuses it (priority is 0..=3), inside the batch's
    // transaction, after the holds were added to the balances.
    bad.priority = 9;
    let batch = vec![
        (prompt_job("a", 8), terms_of(&client.id, 100)),
        (bad, terms_of(&client.id, 100)),
        (prompt_job("b", 8), terms_of(&client.id, 100)),
    ];
    let jobs: Vec<JobId> = batch.iter().map(|(j, _)| j.id).collect();
    for r in one_batch(&ledger, batch).await {
        assert!(matches!(r, Err(LedgerError::BatchAborted(_))), "{r:?}");
    }
    for id in jobs {
        assert!(store.get_job(id).await.unwrap().is_none());
    }
    let after = ledger.account(&client.id).await.unwrap().unwrap();
    assert_eq!((after.available(), after.debits_pending), (1_000, 0));
    assert_eq!(ledger.totals().await.unwrap().open_holds, 0);
    assert!(ledger.audit().await.unwrap().is_empty());
    // The next batch commits as usual.
    let job = prompt_job("next", 8);
    ledger
        .submit_job(&job, &terms_of(&client.id, 100), 1)
        .await
        .unwrap();
    assert!(store.get_job(job.id).await.unwrap().is_some());
}

/// The sweep's duties under a lease: once another replica took the lease
/// over, the stale holder's settlement and reward payment are refused
/// (`StoreError::Fenced`) and change nothing; the new holder's go through.
#[tokio::test]
async fn a_replica_that_lost_the_sweeps_lease_settles_and_pays_nothing() {
    let (_dir, store, ledger, op) = rewards_ledger().await;
    // Epoch 5: 1 GiB for 1 s is owed 1,000 micro-MLX.
    ledger
        .record_online(NODES[0], 1 << 30, 1_000, 5_100)
        .await
        .unwrap();
    // A cancelled job with its hold still open.
    let client = account(&ledger, "client", AccountKind::Client).await;
    ledger.grant("c", &client.id, 1_000, "").await.unwrap();
    let job = prompt_job("hi", 8);
    ledger
        .submit_job(&job, &terms_of(&client.id, 100), 5_000)
        .await
        .unwrap();
    assert_eq!(
        store.cancel(job.id).await.unwrap(),
        CancelOutcome::Cancelled
    );

    let stale = store
        .acquire_lease("ledger-sweep", "replica-a", 1_000, 5_000)
        .await
        .unwrap()
        .unwrap();
    let current = store
        .acquire_lease("ledger-sweep", "replica-b", 1_000, 6_000)
        .await
        .unwrap()
        .unwrap();
    assert_eq!(current.epoch, stale.epoch + 1);
    fn fenced<T>(r: Result<T, LedgerError>, stale: i64) -> bool {
        matches!(r, Err(LedgerError::Store(StoreError::Fenced { epoch, .. })) if epoch == stale)
    }
    let e = stale.epoch;
    assert!(fenced(
        ledger.pay_rewards_under(6_000, Some(&stale)).await,
        e
    ));
    assert!(fenced(
        ledger.settle_job_under(job.id, 6_000, Some(&stale)).await,
        e
    ));
    assert!(fenced(
        sweep_under(&ledger, 6_000, Some(&stale), |_| async { Ok(()) }).await,
        e
    ));
    assert_eq!(
        ledger.account(&op.id).await.unwrap().unwrap().balance(),
        0,
        "no reward paid under the stale lease"
    );
    assert_eq!(
        ledger.unsettled_jobs(6_000, 10).await.unwrap(),
        [job.id.to_string()],
        "the hold is still open"
    );

    assert_eq!(
        ledger
            .pay_rewards_under(6_000, Some(&current))
            .await
            .unwrap(),
        1
    );
    assert_eq!(
        ledger.account(&op.id).await.unwrap().unwrap().balance(),
        1_000
    );
    let swept = sweep_under(&ledger, 6_000, Some(&current), |_| async { Ok(()) })
        .await
        .unwrap();
    assert_eq!(swept.settled, 1);
    assert!(ledger.unsettled_jobs(6_000, 10).await.unwrap().is_empty());
    assert_eq!(
        ledger.account(&client.id).await.unwrap().unwrap().balance(),
        1_000,
        "the cancelled job's hold went back to the client"
    );
}

/// A replica dies with a job running on its node: while its liveness lease
/// lives the orphan sweep leaves the job alone; once it lapsed, two
/// replicas' sweeps racing requeue it once; it runs again on the live
/// replica's node and is paid once, the dead replica's late result is
/// refused, and the hold is resolved once (no ledger violation).
#[tokio::test]
async fn a_dead_replicas_job_is_requeued_once_and_its_hold_resolved_once() {
    use crate::domain::{liveness_lease, NodeRecord};
    let (dir, store, ledger) = fresh(LedgerConfig::default()).await;
    let url = format!("sqlite://{}", dir.path().join("l.db").display());
    let other = AnyStore::connect(&url).await.unwrap();
    let client = account(&ledger, "client", AccountKind::Client).await;
    ledger.grant("c", &client.id, 1_000_000, "").await.unwrap();
    let op = account(&ledger, "op", AccountKind::Operator).await;
    let now = crate::util::now_ms();
    for (s, node, replica, ttl) in [
        (&store, "n-a", "replica-a", 1_000),
        (&other, "n-b", "replica-b", 60_000),
    ] {
        ledger.link_node(node, &op.id).await.unwrap();
        s.acquire_lease(&liveness_lease(replica), replica, ttl, now)
            .await
            .unwrap()
            .unwrap();
        let record = NodeRecord {
            id: node.into(),
            name: node.into(),
            hardware: "{}".into(),
            models: "[]".into(),
            version: "1".into(),
            slots: 0,
        };
        s.upsert_node(&record, replica).await.unwrap();
    }
    let job = prompt_job("hello there", 100);
    let terms = JobTerms {
        account: client.id.clone(),
        price: PRICE,
        max_price: 10_000,
    };
    ledger.submit_job(&job, &terms, now).await.unwrap();
    assert!(store.assign(job.id, 1, "n-a").await.unwrap());
    assert!(store.mark_running(job.id, 1, "n-a").await.unwrap());

    assert_eq!(other.requeue_orphans(3, None, now + 999).await.unwrap(), 0);
    let (x, y) = tokio::join!(
        other.requeue_orphans(3, None, now + 1_000),
        store.requeue_orphans(3, None, now + 1_000)
    );
    assert_eq!(x.unwrap() + y.unwrap(), 1, "requeued once");
    let done = |attempt: u32, node: &str| Completion {
        job_id: job.id,
        attempt,
        node_id: node.into(),
        result: SignedClaim {
            claim: Some(ResultClaim {
                prompt_tokens: 12,
                completion_tokens: 20,
                finish_reason: "stop".into(),
                ..Default::default()
            }),
            signature: vec![1; 64],
        },
    };
    assert!(other.assign(job.id, 2, "n-b").await.unwrap());
    assert!(
        !store.complete(&done(1, "n-a")).await.unwrap(),
        "late result"
    );
    assert!(other.complete(&done(2, "n-b")).await.unwrap());
    match ledger.settle_job(job.id, now + 1_001).await.unwrap() {
        Settlement::Paid { price, .. } => assert_eq!(price, PRICE.of(12, 20)),
        other => panic!("{other:?}"),
    }
    assert_eq!(
        ledger.settle_job(job.id, now + 1_002).await.unwrap(),
        Settlement::NothingOpen,
        "paid once"
    );
    assert_eq!(
        other.requeue_orphans(3, None, now + 2_000).await.unwrap(),
        0
    );
    assert_eq!(
        ledger.violations(now + 2_000).await.unwrap(),
        Vec::<String>::new()
    );
    other.close().await;
}
