//! The link against a fake coordinator: a real quinn server on 127.0.0.1:0
//! speaking the node-link protocol, driven step by step by the test.

use std::{net::SocketAddr, sync::Arc, time::Duration};

use ed25519_dalek::Verifier;
use mlxnet_proto::{
    auth, claim,
    frame::{read_frame, write_frame},
    ids::NodeId,
    v1::{
        coordinator_control, job_input, job_update, node_control, Assignment, Challenge,
        ChatMessage, ChatMessages, CoordinatorControl, Drain, HeartbeatAck, JobInput, JobUpdate,
        NodeControl, Reconnect, Rejected, SamplingParams, Welcome,
    },
};
use tokio::sync::{watch, Semaphore};
use tokio_util::sync::CancellationToken;

use super::{tls, LinkContext, LinkStatus};
use crate::{
    config::ModelEntry,
    identity::Identity,
    models::ModelSet,
    policy::{Decision, PauseReason},
};

const DEADLINE: Duration = Duration::from_secs(60);
const MODEL_ID: &str = "smollm2-135m-instruct";
const MODEL_SHA256: &str = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53";

async fn within<T>(what: &str, fut: impl std::future::Future<Output = T>) -> T {
    tokio::time::timeout(DEADLINE, fut)
        .await
        .unwrap_or_else(|_| panic!("timed out waiting for {what}"))
}

/// A running node link against `server`, with its status and stop switch.
struct TestLink {
    identity: Arc<Identity>,
    status: watch::Receiver<LinkStatus>,
    stop: CancellationToken,
    task: tokio::task::JoinHandle<()>,
    /// The lending decision the link follows (lends from the start).
    lending: watch::Sender<Option<Decision>>,
    /// The link's job slots.
    slots: Arc<Semaphore>,
}

impl TestLink {
    fn start(server: SocketAddr, pin: &str, models: Arc<ModelSet>, slots: u32) -> Self {
        Self::start_many(&[server], &[pin], models, slots)
    }

    /// A link given several coordinator addresses and pins (replicas).
    fn start_many(
        servers: &[SocketAddr],
        pins: &[&str],
        models: Arc<ModelSet>,
        slots: u32,
    ) -> Self {
        let identity = Arc::new(Identity::generate());
        let (lending, lending_rx) = watch::channel(Some(Decision::Lend));
        let job_slots = Arc::new(Semaphore::new(slots as usize));
        let ctx = Arc::new(LinkContext {
            identity: identity.clone(),
            models,
            hardware: crate::hardware::detect().unwrap(),
            coordinators: servers.iter().map(ToString::to_string).collect(),
            client_config: tls::client_config_pinning(pins).unwrap(),
            name: "test-node".into(),
            mode: crate::config::NodeMode::Idle,
            operator_account: String::new(),
            location: Some(crate::config::Location {
                place: Some("Lyon, France".into()),
                lat: Some(45.76),
                lon: Some(4.84),
                hidden: None,
            }),
            max_concurrent_jobs: slots,
            batch: None,
            test_cheat: false,
            connect_timeout: Duration::from_secs(10),
            reconnect_min: Duration::from_millis(10),
            reconnect_max: Duration::from_millis(50),
            slots: job_slots.clone(),
            drain: Arc::default(),
            drain_grace: Duration::from_millis(100),
            lending: lending_rx,
            pause_grace: Duration::from_millis(50),
            memory_cap: Some(1 << 30),
            gpu_share: None,
            board: crate::status::Board::new(Default::default(), None),
            energy: None,
            pod: None,
        });
        let (tx, status) = watch::channel(LinkStatus::Connecting);
        let stop = CancellationToken::new();
        let task = tokio::spawn(super::run(ctx, tx, stop.clone()));
        Self {
            identity,
            status,
            stop,
            task,
            lending,
            slots: job_slots,
        }
    }

    async fn wait_for(&mut self, what: &str, f: impl FnMut(&LinkStatus) -> bool) -> LinkStatus {
        within(what, self.status.wait_for(f)).await.unwrap().clone()
    }
}

/// The coordinator's side of one connection, after the handshake.
struct Peer {
    conn: quinn::Connection,
    send: quinn::SendStream,
    recv: quinn::RecvStream,
}

impl Peer {
    /// Accepts a connection and runs the handshake; `verdict` decides the answer.
    async fn accept(
        server: &quinn::Endpoint,
        welcome: bool,
        heartbeat_ms: u32,
    ) -> (Self, mlxnet_proto::v1::Hello) {
        let conn = within("a connection", async {
            server.accept().await.unwrap().await.unwrap()
        })
        .await;
        let (mut send, mut recv) = within("the control stream", conn.accept_bi())
            .await
            .unwrap();
        let open: NodeControl = read_frame(&mut recv).await.unwrap();
        assert!(
            matches!(open.msg, Some(node_control::Msg::Open(_))),
            "{open:?}"
        );
        let nonce = vec![7u8; 32];
        let challenge = CoordinatorControl {
            msg: Some(coordinator_control::Msg::Challenge(Challenge {
                nonce: nonce.clone(),
            })),
        };
        write_frame(&mut send, &challenge).await.unwrap();
        let hello: NodeControl = read_frame(&mut recv).await.unwrap();
        let Some(node_control::Msg::Hello(hello)) = hello.msg else {
            panic!("expected hello, got {hello:?}")
        };
        // The proof is bound to this connection's exporter.
        let mut exporter = [0u8; auth::EXPORTER_LEN];
        conn.export_keying_material(&mut exporter, auth::EXPORTER_LABEL, b"")
            .unwrap();
        let node = NodeId::from_bytes(&hello.node_id).unwrap();
        let sig = ed25519_dalek::Signature::from_slice(&hello.signature).unwrap();
        node.verifying_key()
            .unwrap()
            .verify(&auth::transcript(&nonce, &exporter), &sig)
            .expect("hello signature verifies against this session");
        let reply = if welcome {
            coordinator_control::Msg::Welcome(Welcome {
                node_id: node.to_string(),
                heartbeat_interval_ms: heartbeat_ms,
                outlook: Vec::new(),
            })
        } else {
            coordinator_control::Msg::Rejected(Rejected {
                reason: "unknown node".into(),
            })
        };
        write_frame(&mut send, &CoordinatorControl { msg: Some(reply) })
            .await
            .unwrap();
        (Self { conn, send, recv }, hello)
    }

    async fn next_control(&mut self) -> NodeControl {
        within("a control frame", read_frame(&mut self.recv))
            .await
            .unwrap()
    }

    /// Acknowledges heartbeats in the background; the task ends with the
    /// node's `Drain` (or `None` if the stream ends without one).
    fn serve_control(self) -> (quinn::Connection, tokio::task::JoinHandle<Option<Drain>>) {
        let Self {
            conn,
            mut send,
            mut recv,
        } = self;
        let task = tokio::spawn(async move {
            loop {
                let Ok(msg) = read_frame::<_, NodeControl>(&mut recv).await else {
                    return None;
                };
                match msg.msg {
                    Some(node_control::Msg::Heartbeat(_)) => {
                        let ack = CoordinatorControl {
                            msg: Some(coordinator_control::Msg::HeartbeatAck(HeartbeatAck {})),
                        };
                        if write_frame(&mut send, &ack).await.is_err() {
                            return None;
                        }
                    }
                    Some(node_control::Msg::Drain(d)) => return Some(d),
                    _ => {}
                }
            }
        });
        (conn, task)
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn registers_heartbeats_reconnects_and_closes_gracefully() {
    let (server, pin) = tls::tests::test_server();
    let mut link = TestLink::start(
        server.local_addr().unwrap(),
        &pin,
        Arc::new(ModelSet::default()),
        2,
    );

    let (mut peer, hello) = Peer::accept(&server, true, 50).await;
    assert_eq!(hello.node_id, link.identity.node_id().as_bytes().to_vec());
    assert_eq!(hello.name, "test-node");
    assert_eq!(hello.max_concurrent_jobs, 2);
    assert_eq!(hello.mode, "idle");
    assert_eq!(hello.location.as_ref().unwrap().label, "Lyon, France");
    assert!(hello.hardware.as_ref().unwrap().memory_bytes > 0);
    let status = link
        .wait_for("registration", |s| {
            matches!(s, LinkStatus::Registered { .. })
        })
        .await;
    assert_eq!(
        status,
        LinkStatus::Registered {
            heartbeat_interval: Duration::from_millis(50),
            coordinator: server.local_addr().unwrap(),
        }
    );
    // Heartbeats flow and report free memory.
    for _ in 0..2 {
        match peer.next_control().await.msg {
            Some(node_control::Msg::Heartbeat(h)) => assert!(h.free_memory_bytes > 0),
            other => panic!("expected a heartbeat, got {other:?}"),
        }
        let ack = CoordinatorControl {
            msg: Some(coordinator_control::Msg::HeartbeatAck(HeartbeatAck {})),
        };
        write_frame(&mut peer.send, &ack).await.unwrap();
    }

    // The coordinator drops the link: the node notices and comes back by itself.
    peer.conn.close(0u32.into(), b"restart");
    link.wait_for("link loss", |s| {
        matches!(s, LinkStatus::Disconnected { .. })
    })
    .await;
    let (peer, _) = Peer::accept(&server, true, 50).await;
    link.wait_for("re-registration", |s| {
        matches!(s, LinkStatus::Registered { .. })
    })
    .await;

    // Shutdown: Drain, then a close with code 0.
    let (conn, drained) = peer.serve_control();
    link.stop.cancel();
    let drain = within("drain", drained)
        .await
        .unwrap()
        .expect("a Drain before the close");
    assert!(drain.reason.contains("shutting down"), "{drain:?}");
    let closed = within("close", conn.closed()).await;
    assert!(
        matches!(closed, quinn::ConnectionError::ApplicationClosed(ref c) if c.error_code == quinn::VarInt::from_u32(0)),
        "{closed:?}"
    );
    within("link task end", link.task).await.unwrap();
    assert!(
        matches!(&*link.status.borrow(), LinkStatus::Disconnected { reason } if reason.contains("shut down"))
    );
}

/// Waits until the link is registered with the coordinator at `at`.
async fn registered_with(link: &mut TestLink, at: &quinn::Endpoint) {
    let at = at.local_addr().unwrap();
    link.wait_for(
        "registration with the next replica",
        |s| matches!(s, LinkStatus::Registered { coordinator, .. } if *coordinator == at),
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_two_replicas_the_node_moves_to_the_other_when_its_replica_goes_away() {
    // Two replicas with certificates of their own: the node pins both.
    let (a, pin_a) = tls::tests::test_server();
    let (b, pin_b) = tls::tests::test_server();
    let mut link = TestLink::start_many(
        &[a.local_addr().unwrap(), b.local_addr().unwrap()],
        &[&pin_a, &pin_b],
        Arc::new(ModelSet::default()),
        1,
    );
    let (peer, _) = Peer::accept(&a, true, 50).await;
    registered_with(&mut link, &a).await;
    // Replica A goes away: the next session is B's, not A's again.
    peer.conn.close(0u32.into(), b"gone");
    let (peer, _) = Peer::accept(&b, true, 50).await;
    registered_with(&mut link, &b).await;
    // And B going away brings it back round to A.
    peer.conn.close(0u32.into(), b"gone");
    let (_peer, _) = Peer::accept(&a, true, 50).await;
    registered_with(&mut link, &a).await;
    link.stop.cancel();
    within("link task end", link.task).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reconnect_hint_makes_the_node_drain_leave_and_dial_the_next_replica() {
    let (a, pin_a) = tls::tests::test_server();
    let (b, pin_b) = tls::tests::test_server();
    let mut link = TestLink::start_many(
        &[a.local_addr().unwrap(), b.local_addr().unwrap()],
        &[&pin_a, &pin_b],
        Arc::new(ModelSet::default()),
        1,
    );
    // Heartbeats every 10 s: the node cannot be leaving on a timeout.
    let (mut peer, _) = Peer::accept(&a, true, 10_000).await;
    registered_with(&mut link, &a).await;
    let hint = CoordinatorControl {
        msg: Some(coordinator_control::Msg::Reconnect(Reconnect {
            reason: "replica draining".into(),
            grace_ms: 0,
        })),
    };
    write_frame(&mut peer.send, &hint).await.unwrap();
    // The node answers with Drain (its hand-offs are accepted), closes
    // gracefully, and registers with B while A's endpoint is still up.
    let (conn, drained) = peer.serve_control();
    let drain = within("drain", drained)
        .await
        .unwrap()
        .expect("a Drain before the close");
    assert!(drain.reason.contains("another coordinator"), "{drain:?}");
    let closed = within("close", conn.closed()).await;
    assert!(
        matches!(closed, quinn::ConnectionError::ApplicationClosed(ref c) if c.error_code == quinn::VarInt::from_u32(0)),
        "{closed:?}"
    );
    let (_peer, _) = Peer::accept(&b, true, 50).await;
    registered_with(&mut link, &b).await;
    link.stop.cancel();
    within("link task end", link.task).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pause_drains_and_leaves_and_lending_again_dials_back() {
    let (server, pin) = tls::tests::test_server();
    let mut link = TestLink::start(
        server.local_addr().unwrap(),
        &pin,
        Arc::new(ModelSet::default()),
        1,
    );
    let (peer, hello) = Peer::accept(&server, true, 50).await;
    // The owner's memory cap bounds what the node offers.
    assert!(hello.hardware.unwrap().free_memory_bytes <= 1 << 30);
    link.wait_for("registration", |s| {
        matches!(s, LinkStatus::Registered { .. })
    })
    .await;

    // The owner comes back: Drain with the policy's reason, then a graceful close.
    let (conn, drained) = peer.serve_control();
    link.lending
        .send_replace(Some(Decision::Pause(PauseReason::OwnerActive)));
    let drain = within("drain", drained)
        .await
        .unwrap()
        .expect("a Drain before the close");
    assert!(drain.reason.starts_with("you are using"), "{drain:?}");
    let closed = within("close", conn.closed()).await;
    assert!(
        matches!(closed, quinn::ConnectionError::ApplicationClosed(ref c) if c.error_code == quinn::VarInt::from_u32(0)),
        "{closed:?}"
    );
    let status = link
        .wait_for("paused", |s| matches!(s, LinkStatus::Paused { .. }))
        .await;
    assert!(
        matches!(&status, LinkStatus::Paused { reason } if reason.starts_with("you are using")),
        "{status:?}"
    );

    // The owner leaves again: the node dials back on its own.
    link.lending.send_replace(Some(Decision::Lend));
    let (_peer, _) = Peer::accept(&server, true, 50).await;
    link.wait_for("re-registration", |s| {
        matches!(s, LinkStatus::Registered { .. })
    })
    .await;
    link.stop.cancel();
    within("link task end", link.task).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rejection_is_reported_and_retried() {
    let (server, pin) = tls::tests::test_server();
    let mut link = TestLink::start(
        server.local_addr().unwrap(),
        &pin,
        Arc::new(ModelSet::default()),
        1,
    );
    let (_peer, _) = Peer::accept(&server, false, 50).await;
    let status = link
        .wait_for("rejection", |s| {
            matches!(s, LinkStatus::Disconnected { .. })
        })
        .await;
    let LinkStatus::Disconnected { reason } = status else {
        unreachable!()
    };
    assert!(
        reason.contains("rejected by the coordinator: unknown node"),
        "{reason}"
    );
    // It tries again on its own.
    let (_peer, _) = Peer::accept(&server, true, 50).await;
    link.wait_for("registration", |s| {
        matches!(s, LinkStatus::Registered { .. })
    })
    .await;
    link.stop.cancel();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wrong_pin_never_registers_and_says_why() {
    let (server, _pin) = tls::tests::test_server();
    let (_other, other_pin) = tls::tests::test_server();
    let accept = {
        let server = server.clone();
        tokio::spawn(async move {
            while let Some(i) = server.accept().await {
                let _ = i.await;
            }
        })
    };
    let mut link = TestLink::start(
        server.local_addr().unwrap(),
        &other_pin,
        Arc::new(ModelSet::default()),
        1,
    );
    let status = link
        .wait_for("a failed dial", |s| {
            matches!(s, LinkStatus::Disconnected { .. })
        })
        .await;
    let LinkStatus::Disconnected { reason } = status else {
        unreachable!()
    };
    assert!(
        reason.contains("does not match the pinned fingerprint"),
        "{reason}"
    );
    link.stop.cancel();
    within("link task end", link.task).await.unwrap();
    accept.abort();
}

fn test_models() -> Arc<ModelSet> {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../models/SmolLM2-135M-Instruct.Q4_1.gguf");
    Arc::new(
        ModelSet::load(
            &[ModelEntry {
                id: MODEL_ID.into(),
                path,
            }],
            crate::models::TEST_BATCH,
        )
        .unwrap(),
    )
}

fn assignment(job: &str, question: &str, max_tokens: u32, sha: &str) -> Assignment {
    Assignment {
        job_id: job.into(),
        attempt: 1,
        model: MODEL_ID.into(),
        model_sha256: hex::decode(sha).unwrap(),
        input: Some(JobInput {
            kind: Some(job_input::Kind::Chat(ChatMessages {
                messages: vec![ChatMessage {
                    role: "user".into(),
                    content: question.into(),
                }],
            })),
        }),
        sampling: Some(SamplingParams {
            max_tokens,
            seed: Some(1),
            ..Default::default()
        }),
        resume: None,
        audit: None,
    }
}

async fn open_job(
    conn: &quinn::Connection,
    a: &Assignment,
) -> (quinn::SendStream, quinn::RecvStream) {
    let (mut send, recv) = conn.open_bi().await.unwrap();
    write_frame(&mut send, a).await.unwrap();
    (send, recv)
}

async fn next_update(recv: &mut quinn::RecvStream) -> job_update::Msg {
    let u: JobUpdate = within("a job update", read_frame(recv)).await.unwrap();
    u.msg.expect("empty job update")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn jobs_stream_tokens_and_a_signed_claim_and_bad_jobs_are_refused() {
    let (server, pin) = tls::tests::test_server();
    let link = TestLink::start(server.local_addr().unwrap(), &pin, test_models(), 1);
    let (peer, hello) = Peer::accept(&server, true, 1000).await;
    let (peer, _drained) = peer.serve_control();
    assert_eq!(hello.models.len(), 1);
    assert_eq!(hex::encode(&hello.models[0].sha256), MODEL_SHA256);

    // A real job: tokens stream, then a claim that verifies and matches them.
    let a = assignment("job-1", "What is the capital of France?", 24, MODEL_SHA256);
    let (_send, mut recv) = open_job(&peer, &a).await;
    assert!(matches!(
        next_update(&mut recv).await,
        job_update::Msg::Started(_)
    ));
    let (mut text, mut ids) = (String::new(), Vec::new());
    let signed = loop {
        match next_update(&mut recv).await {
            job_update::Msg::Tokens(t) => {
                assert_eq!(
                    t.index as usize,
                    ids.len(),
                    "tokens arrive in order, none lost"
                );
                text.push_str(&t.text);
                ids.extend(t.token_ids);
            }
            job_update::Msg::Result(signed) => break signed,
            other => panic!("unexpected {other:?}"),
        }
    };
    assert_eq!(claim::verify(&signed).unwrap(), link.identity.node_id());
    let c = signed.claim.unwrap();
    assert_eq!((c.job_id.as_str(), c.attempt), ("job-1", 1));
    assert_eq!(hex::encode(&c.model_sha256), MODEL_SHA256);
    assert_eq!(
        c.prompt_sha256,
        claim::input_digest(a.input.as_ref().unwrap()).to_vec()
    );
    assert_eq!(c.output_text, text);
    assert_eq!(c.output_token_ids, ids);
    assert_eq!(c.completion_tokens as usize, ids.len());
    assert!(c.prompt_tokens > 5 && !ids.is_empty());
    // The model's own words (its quality is the engine's tests' business).
    assert!(!text.trim().is_empty());
    // The slot was given back before the result was sent: the coordinator
    // may send the next job the moment it reads the result.
    assert_eq!(link.slots.available_permits(), 1, "the slot is still held");

    // A digest the node does not hold, and a model it does not have: refused for good.
    let bad = assignment("job-2", "Hi", 4, &"00".repeat(32));
    let (_send, mut recv) = open_job(&peer, &bad).await;
    match next_update(&mut recv).await {
        job_update::Msg::Failure(f) => {
            assert!(!f.retryable && f.reason.contains("sha256"), "{f:?}")
        }
        other => panic!("expected a refusal, got {other:?}"),
    }
    let mut other = assignment("job-3", "Hi", 4, MODEL_SHA256);
    other.model = "llama-70b".into();
    let (_send, mut recv) = open_job(&peer, &other).await;
    match next_update(&mut recv).await {
        job_update::Msg::Failure(f) => {
            assert!(!f.retryable && f.reason.contains("llama-70b"), "{f:?}")
        }
        other => panic!("expected a refusal, got {other:?}"),
    }

    // One slot: a second job while the first runs is refused as retryable;
    // resetting the first cancels it and frees the slot.
    // (Long, yet inside the test pool's 1,456 KV positions: a job the pool
    // cannot hold is refused as soon as it reaches the batch.)
    let long = assignment(
        "job-4",
        "Write a long story about a lighthouse.",
        1000,
        MODEL_SHA256,
    );
    let (mut long_send, mut long_recv) = open_job(&peer, &long).await;
    assert!(matches!(
        next_update(&mut long_recv).await,
        job_update::Msg::Started(_)
    ));
    let (_send, mut recv) = open_job(&peer, &assignment("job-5", "Hi", 4, MODEL_SHA256)).await;
    match next_update(&mut recv).await {
        job_update::Msg::Failure(f) => assert!(f.retryable && f.reason.contains("busy"), "{f:?}"),
        other => panic!("expected busy, got {other:?}"),
    }
    long_send.reset(7u32.into()).unwrap();
    // The node stops at its next token and ends the stream without a result.
    within("the cancelled job to end", async {
        loop {
            match read_frame::<_, JobUpdate>(&mut long_recv).await {
                Ok(JobUpdate {
                    msg: Some(job_update::Msg::Tokens(_)),
                }) => continue,
                Ok(other) => panic!("a cancelled job sent {other:?}"),
                Err(_) => break,
            }
        }
    })
    .await;
    // Its slot is free again: a new job runs to a result.
    let (_send, mut recv) = open_job(&peer, &assignment("job-6", "Say hi.", 4, MODEL_SHA256)).await;
    assert!(matches!(
        next_update(&mut recv).await,
        job_update::Msg::Started(_)
    ));
    let signed = loop {
        match next_update(&mut recv).await {
            job_update::Msg::Tokens(_) => continue,
            job_update::Msg::Result(r) => break r,
            other => panic!("unexpected {other:?}"),
        }
    };
    assert_eq!(signed.claim.unwrap().job_id, "job-6");
    link.stop.cancel();
    within("link task end", link.task).await.unwrap();
}

/// The coordinator hints that a model is in demand: a node whose owner set
/// a quota pulls it from its mirror, checks it, announces it in its next
/// heartbeat, and then runs a job on it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hinted_model_is_pulled_announced_and_served() {
    use crate::models::{
        fetch_tests::TestServer,
        store::{ModelStore, StorePolicy},
    };
    let dir = tempfile::tempdir().unwrap();
    let bytes = std::fs::read(
        std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../models/SmolLM2-135M-Instruct.Q4_1.gguf"),
    )
    .unwrap();
    let mirror = TestServer::start(vec![("SmolLM2-135M-Instruct.Q4_1.gguf".into(), bytes)]).await;
    let mut entry = mlxnet_proto::catalogue::Catalogue::builtin()
        .get(MODEL_ID)
        .cloned()
        .unwrap();
    entry.files[0].mirrors = vec![mirror.url("good", "SmolLM2-135M-Instruct.Q4_1.gguf")];
    let store = ModelStore::open(
        dir.path().join("models"),
        StorePolicy {
            quota_bytes: Some(1 << 30),
            ..StorePolicy::default()
        },
    )
    .unwrap();
    let models = Arc::new(
        ModelSet::load_with_store(
            &[],
            Arc::new(store),
            crate::models::TEST_BATCH,
            &crate::engine::device::Backend::Native,
        )
        .unwrap(),
    );
    assert!(models.is_empty());

    let (server, pin) = tls::tests::test_server();
    let link = TestLink::start(server.local_addr().unwrap(), &pin, models, 1);
    let (mut peer, hello) = Peer::accept(&server, true, 50).await;
    assert!(hello.models.is_empty());
    let hint = CoordinatorControl {
        msg: Some(coordinator_control::Msg::ModelHint(
            mlxnet_proto::v1::ModelHint {
                entry: Some(entry.to_wire()),
            },
        )),
    };
    write_frame(&mut peer.send, &hint).await.unwrap();
    // Heartbeats until one announces the model with its digest.
    let announced = within("the model's announcement", async {
        loop {
            let Some(node_control::Msg::Heartbeat(h)) = peer.next_control().await.msg else {
                continue;
            };
            let ack = CoordinatorControl {
                msg: Some(coordinator_control::Msg::HeartbeatAck(HeartbeatAck {})),
            };
            write_frame(&mut peer.send, &ack).await.unwrap();
            if h.models_changed {
                break h.models;
            }
        }
    })
    .await;
    assert_eq!(announced.len(), 1);
    assert_eq!(announced[0].model, MODEL_ID);
    assert_eq!(hex::encode(&announced[0].sha256), MODEL_SHA256);
    assert_eq!(mirror.sent(), entry.size_bytes());

    let (peer, _drained) = peer.serve_control();
    let a = assignment(
        "job-hinted",
        "What is the capital of France?",
        8,
        MODEL_SHA256,
    );
    let (_send, mut recv) = open_job(&peer, &a).await;
    assert!(matches!(
        next_update(&mut recv).await,
        job_update::Msg::Started(_)
    ));
    loop {
        match next_update(&mut recv).await {
            job_update::Msg::Tokens(_) => {}
            job_update::Msg::Result(signed) => {
                assert_eq!(
                    hex::encode(signed.claim.unwrap().model_sha256),
                    MODEL_SHA256
                );
                break;
            }
            other => panic!("unexpected {other:?}"),
        }
    }
    link.stop.cancel();
    within("link task end", link.task).await.unwrap();
}
