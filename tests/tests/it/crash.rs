//! Crash consistency of the ledger: a real coordinator process is killed
//! (SIGKILL) at a chosen step inside settlement, 50 times, on one database;
//! after every restart the books balance, every hold is resolved at most
//! once, no ended job keeps its hold, and no hold outlives its deadline.
//!
//! The coordinator process is this test binary run again as
//! [`coordinator_child`] (it builds and runs the same `Application` that
//! `mlxnet-coordinator` runs), with the ledger's test knob
//! `ledger.test_pause_at_step` set through `MLXNET__*` variables: at that
//! step of settlement it prints `settlement paused at step N` and stops dead
//! with its transaction open; the parent then kills it. The jobs are run by a
//! hand-made node in the parent that completes, fails or ignores each one.

use std::{
    io::{BufRead, BufReader},
    process::{Child, Command, Stdio},
    sync::{mpsc, Arc, Mutex},
    time::Duration,
};

use ed25519_dalek::{Signer, SigningKey};
use mlxnet_coordinator::{
    config::CoordinatorConfig,
    ledger::{Ledger, LedgerConfig},
    store::{AnyStore, Store},
};
use mlxnet_proto::{
    auth, claim,
    frame::{read_frame, write_frame},
    v1::{
        coordinator_control, job_update, node_control, Assignment, CachedModel, CoordinatorControl,
        GrantRequest, HardwareProfile, Hello, HistoryRequest, JobUpdate, NodeControl, Open,
        ResultClaim,
    },
};
use mlxnet_tests::{chat_job, now_ms, within, Client};
use rand::{rngs::StdRng, Rng, SeedableRng};

const RUNS: u32 = 50;
/// Jobs submitted per run.
const JOBS: usize = 6;
const MODEL_SHA256: &str = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53";

/// Set (to "1") in the environment of [`coordinator_child`] by its parent.
const CHILD_MARK: &str = "MLXNET_TESTS_CRASH_CHILD";

/// The coordinator process of [`settlement_survives_sigkill_at_any_step`].
/// Run any other way (`--include-ignored`) it does nothing: its config comes
/// from the environment, which would otherwise leave it on the default
/// (fixed) ports and data directory.
#[test]
#[ignore = "run as a child process by settlement_survives_sigkill_at_any_step"]
fn coordinator_child() -> anyhow::Result<()> {
    if std::env::var(CHILD_MARK).as_deref() != Ok("1") {
        eprintln!("not started by settlement_survives_sigkill_at_any_step: nothing to do");
        return Ok(());
    }
    let config = CoordinatorConfig::load(None, std::env::vars())?;
    let runtime = tokio::runtime::Runtime::new()?;
    runtime.block_on(async {
        let app = mlxnet_coordinator::Application::build(config).await?;
        println!("grpc {}", app.grpc_addr());
        println!("quic {}", app.quic_addr());
        println!("fingerprint {}", app.cert_fingerprint());
        app.run_until_stopped().await?;
        anyhow::Ok(())
    })
}

/// What the child printed.
enum Line {
    Grpc(String),
    Quic(String),
    Fingerprint(String),
    Paused,
}

struct Child_ {
    child: Child,
    lines: mpsc::Receiver<Line>,
}

fn spawn_child(data_dir: &std::path::Path, pause_at: Option<u32>) -> anyhow::Result<Child_> {
    let mut cmd = Command::new(std::env::current_exe()?);
    cmd.args([
        "--exact",
        "crash::coordinator_child",
        "--ignored",
        "--nocapture",
    ])
    .env(CHILD_MARK, "1")
    .env("MLXNET__DATA_DIR", data_dir)
    .env("MLXNET__GRPC_ADDR", "127.0.0.1:0")
    .env("MLXNET__QUIC_ADDR", "127.0.0.1:0")
    .env("MLXNET__HTTP_ADDR", "127.0.0.1:0")
    .env("MLXNET__HEARTBEAT_TIMEOUT_MS", "60000")
    .env("MLXNET__LEDGER__HOLD_TTL_MS", "400")
    // Expiry here is the start-up sweep's; the periodic one would race
    // the checks made while the child runs.
    .env("MLXNET__LEDGER__SWEEP_INTERVAL_MS", "600000")
    // This test is about settlement itself: pay on completion, no audits.
    .env("MLXNET__AUDIT__WINDOW_MS", "0")
    .env("MLXNET__AUDIT__RATE_NEW", "0.0")
    .env("MLXNET__AUDIT__RATE_FLOOR", "0.0")
    .env("RUST_LOG", "warn")
    .stdout(Stdio::piped())
    .stderr(Stdio::null());
    if let Some(n) = pause_at {
        cmd.env("MLXNET__LEDGER__TEST_PAUSE_AT_STEP", n.to_string());
    }
    let mut child = cmd.spawn()?;
    let stdout = child
        .stdout
        .take()
        .ok_or_else(|| anyhow::anyhow!("no stdout"))?;
    let (tx, lines) = mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines().map_while(Result::ok) {
            let parsed = if let Some(a) = line.strip_prefix("grpc ") {
                Line::Grpc(a.to_owned())
            } else if let Some(a) = line.strip_prefix("quic ") {
                Line::Quic(a.to_owned())
            } else if let Some(f) = line.strip_prefix("fingerprint ") {
                Line::Fingerprint(f.to_owned())
            } else if line.starts_with("settlement paused at step") {
                Line::Paused
            } else {
                continue;
            };
            if tx.send(parsed).is_err() {
                return;
            }
        }
    });
    Ok(Child_ { child, lines })
}

/// Addresses of a started child, or `None` if it paused while starting
/// (settling what the last crash left, before it serves anything).
fn started(c: &Child_) -> anyhow::Result<Option<(String, String, String)>> {
    let (mut grpc, mut quic) = (None, None);
    loop {
        match c.lines.recv_timeout(Duration::from_secs(60))? {
            Line::Paused => return Ok(None),
            Line::Grpc(a) => grpc = Some(a),
            Line::Quic(a) => quic = Some(a),
            Line::Fingerprint(f) => {
                let (Some(g), Some(q)) = (grpc.take(), quic.take()) else {
                    anyhow::bail!("fingerprint before addresses");
                };
                return Ok(Some((g, q, f)));
            }
        }
    }
}

/// Registers a hand-made node; returns its connection.
async fn register(
    quic: &str,
    fingerprint: &str,
    key: &SigningKey,
    operator: &str,
) -> anyhow::Result<(quinn::Endpoint, quinn::Connection, quinn::SendStream)> {
    let mut endpoint = quinn::Endpoint::client("127.0.0.1:0".parse()?)?;
    endpoint.set_default_client_config(mlx_node::link::tls::client_config(fingerprint)?);
    let conn = endpoint.connect(quic.parse()?, "localhost")?.await?;
    let (mut send, mut recv) = conn.open_bi().await?;
    let open = NodeControl {
        msg: Some(node_control::Msg::Open(Open {
            version: "crash".into(),
        })),
    };
    write_frame(&mut send, &open).await?;
    let reply: CoordinatorControl = read_frame(&mut recv).await?;
    let Some(coordinator_control::Msg::Challenge(c)) = reply.msg else {
        anyhow::bail!("expected a challenge");
    };
    let mut exporter = [0u8; auth::EXPORTER_LEN];
    conn.export_keying_material(&mut exporter, auth::EXPORTER_LABEL, b"")
        .map_err(|e| anyhow::anyhow!("exporter: {e:?}"))?;
    let hello = Hello {
        node_id: key.verifying_key().to_bytes().to_vec(),
        signature: key
            .sign(&auth::transcript(&c.nonce, &exporter))
            .to_bytes()
            .to_vec(),
        hardware: Some(HardwareProfile {
            memory_bytes: 64 << 30,
            free_memory_bytes: 60 << 30,
            ..Default::default()
        }),
        models: vec![CachedModel {
            model: mlxnet_tests::TEST_MODEL_ID.into(),
            sha256: hex::decode(MODEL_SHA256)?,
            size_bytes: 98_362_432,
        }],
        version: "crash".into(),
        max_concurrent_jobs: 4,
        name: "crash".into(),
        operator_account: operator.into(),
        ..Default::default()
    };
    write_frame(
        &mut send,
        &NodeControl {
            msg: Some(node_control::Msg::Hello(hello)),
        },
    )
    .await?;
    let reply: CoordinatorControl = read_frame(&mut recv).await?;
    if !matches!(reply.msg, Some(coordinator_control::Msg::Welcome(_))) {
        anyhow::bail!("not welcomed: {reply:?}");
    }
    Ok((endpoint, conn, send))
}

/// What the hand-made node did: assignments it got, and the jobs it
/// answered (completed or failed), whose settlement is due.
#[derive(Default)]
struct Served {
    assigned: usize,
    answered: Vec<String>,
}

/// Serves assignments: completes most, fails some, ignores a few (their
/// holds expire), until the connection ends.
async fn serve(conn: quinn::Connection, key: SigningKey, seed: u64, served: Arc<Mutex<Served>>) {
    let mut rng = StdRng::seed_from_u64(seed);
    while let Ok((mut send, mut recv)) = conn.accept_bi().await {
        let Ok(a) = read_frame::<_, Assignment>(&mut recv).await else {
            continue;
        };
        lock(&served).assigned += 1;
        let roll: u32 = rng.gen_range(0..10);
        let update = if roll < 7 {
            let c = ResultClaim {
                job_id: a.job_id.clone(),
                attempt: a.attempt,
                model_sha256: a.model_sha256.clone(),
                prompt_sha256: claim::input_digest(&a.input.clone().unwrap_or_default()).to_vec(),
                output_token_ids: vec![42; 20],
                output_text: "Paris".into(),
                prompt_tokens: 12,
                completion_tokens: 20,
                node_id: key.verifying_key().to_bytes().to_vec(),
                finish_reason: "length".into(),
                ..Default::default()
            };
            // A claim covers what its attempt streamed: stream it first.
            let _ = write_frame(&mut send, &mlxnet_coordinator::test_utils::tokens_of(0, &c)).await;
            job_update::Msg::Result(claim::sign(c, &key))
        } else if roll < 9 {
            job_update::Msg::Failure(job_update::Failure {
                reason: "out of memory".into(),
                retryable: false,
            })
        } else {
            // Never answers: the job waits until its hold expires.
            std::mem::forget((send, recv));
            continue;
        };
        let _ = write_frame(&mut send, &JobUpdate { msg: Some(update) }).await;
        let _ = send.finish();
        lock(&served).answered.push(a.job_id);
    }
}

fn lock(served: &Mutex<Served>) -> std::sync::MutexGuard<'_, Served> {
    served.lock().unwrap_or_else(|p| p.into_inner())
}

/// Waits until the node got all `jobs` assignments and the ledger settled
/// every job it answered (a post or a void of its hold is committed): from
/// then on no settlement of this run is pending, so none can pause.
async fn all_settled(
    client: &mut Client,
    served: &Mutex<Served>,
    jobs: usize,
) -> anyhow::Result<()> {
    loop {
        let answered = {
            let s = lock(served);
            (s.assigned == jobs).then(|| s.answered.clone())
        };
        if let Some(answered) = answered {
            let history = client
                .accounts
                .history(HistoryRequest { limit: 200 })
                .await?
                .into_inner()
                .entries;
            let settled = |job: &String| {
                history
                    .iter()
                    .any(|e| &e.job_id == job && (e.memo == "post" || e.memo == "void"))
            };
            if answered.iter().all(settled) {
                return Ok(());
            }
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn settlement_survives_sigkill_at_any_step() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let data = dir.path().join("coord");
    let config = CoordinatorConfig::for_data_dir(data.clone());
    // The first key and the accounts, made the way an operator of the
    // network would: in the database, before the coordinator first runs.
    let admin = mlxnet_coordinator::app::bootstrap_admin_key(&config, "admin").await?;
    let (store, ledger) = open(&config).await?;
    let operator = ledger
        .create_account(
            "crash operator",
            mlxnet_coordinator::ledger::AccountKind::Operator,
        )
        .await?;
    store.close().await;

    let mut rng = StdRng::seed_from_u64(6);
    let key = SigningKey::generate(&mut rng);
    let mut paused = 0;
    let mut submitted = 0;
    for run in 0..RUNS {
        let pause_at = rng.gen_range(1..=14);
        let spawned_at = now_ms();
        let mut child = spawn_child(&data, Some(pause_at))?;
        let Some((grpc, quic, fingerprint)) = started(&child)? else {
            // Paused while settling at start-up: kill it right there.
            paused += 1;
            child.child.kill()?;
            child.child.wait()?;
            continue;
        };
        check(&config, spawned_at, &format!("run {run}, after restart")).await?;

        let mut client = Client::connect(grpc.parse()?, Some(admin.secret())).await?;
        client
            .accounts
            .grant(GrantRequest {
                account_id: admin.account_id.clone(),
                amount_micro_mlx: 1_000_000,
                idempotency_key: format!("crash-{run}"),
                memo: String::new(),
            })
            .await?;
        // Submit first: once settlement pauses, its open transaction
        // blocks every other write.
        for i in 0..JOBS {
            client
                .jobs
                .submit(chat_job(&format!("question {run}.{i}"), 32))
                .await?;
            submitted += 1;
        }
        let (_endpoint, conn, _control) = register(&quic, &fingerprint, &key, &operator.id).await?;
        let served = Arc::new(Mutex::new(Served::default()));
        let node = tokio::spawn(serve(
            conn.clone(),
            key.clone(),
            u64::from(run),
            served.clone(),
        ));
        // Wait for the pause, or for every settlement of this run to be
        // done (the step is past this run's settlements): two events, no
        // clock. Either way the kill comes next.
        let lines = child.lines;
        let pause = tokio::task::spawn_blocking(move || lines.recv());
        tokio::select! {
            line = pause => {
                anyhow::ensure!(
                    matches!(line?, Ok(Line::Paused)),
                    "run {run}: the coordinator ended or printed something else before pausing"
                );
                paused += 1;
            }
            settled = within("this run's settlements", all_settled(&mut client, &served, JOBS)) => {
                settled??;
            }
        }
        child.child.kill()?; // SIGKILL
        child.child.wait()?;
        conn.close(0u32.into(), b"");
        node.abort();
    }
    // A last start settles and expires everything left; then the books must
    // be sound at any later time too.
    let spawned_at = now_ms();
    let mut last = spawn_child(&data, None)?;
    let addrs = started(&last)?;
    assert!(addrs.is_some(), "the last start pauses nowhere");
    check(&config, spawned_at, "after the last restart").await?;
    last.child.kill()?;
    last.child.wait()?;
    // Every way a hold ends happened, many times over.
    let (store, ledger) = open(&config).await?;
    let history = ledger.history(&admin.account_id, 100_000).await?;
    let open_holds = ledger.totals().await?.open_holds as usize;
    store.close().await;
    let count = |memo: &str| history.iter().filter(|t| t.memo == memo).count();
    let (holds, posts, voids, expiries) =
        (count("hold"), count("post"), count("void"), count("expire"));
    eprintln!(
        "{RUNS} kills ({paused} inside settlement); {submitted} jobs: {holds} holds, \
         {posts} posted, {voids} voided, {expiries} expired, {open_holds} open (not yet due)"
    );
    assert_eq!(
        holds,
        posts + voids + expiries + open_holds,
        "every hold resolved at most once"
    );
    assert!(posts > 0 && voids > 0 && expiries > 0);
    assert!(
        paused >= RUNS / 2,
        "only {paused} of {RUNS} runs stopped inside settlement"
    );
    assert!(submitted > RUNS, "jobs were submitted ({submitted})");
    Ok(())
}

async fn open(config: &CoordinatorConfig) -> anyhow::Result<(AnyStore, Ledger)> {
    let store = AnyStore::connect(&config.database_url()).await?;
    let ledger = Ledger::new(store.clone(), LedgerConfig::default());
    Ok((store, ledger))
}

/// The books as a restarted coordinator left them: every invariant holds,
/// and no hold whose deadline was before `started_ms` (when the process was
/// started) is still open.
async fn check(config: &CoordinatorConfig, started_ms: i64, when: &str) -> anyhow::Result<()> {
    let (store, ledger) = open(config).await?;
    let broken = within("the ledger check", ledger.violations(started_ms)).await??;
    store.close().await;
    anyhow::ensure!(broken.is_empty(), "{when}: {broken:?}");
    Ok(())
}
