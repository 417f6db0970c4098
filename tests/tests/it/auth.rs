//! A node must prove its key on its own connection, and a result must be the
//! signed work of the node the job was given to; anything else is refused
//! and changes nothing.

use ed25519_dalek::{Signer, SigningKey};
use mlxnet_proto::{
    auth, claim,
    frame::{read_frame, write_frame},
    v1::{
        coordinator_control, job_update, node_control, Assignment, CachedModel, Challenge,
        CoordinatorControl, GetJobRequest, HardwareProfile, Hello, JobState, JobUpdate,
        NetworkStatsRequest, NodeControl, Open, ResultClaim,
    },
};
use mlxnet_tests::{
    chat_job, coordinator_config, spawn_coordinator, spawn_node, state, within, TestCoordinator,
};
use rand::rngs::OsRng;

const MODEL_SHA256: &str = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53";

/// A hand-made node speaking the wire protocol directly.
struct Rogue {
    conn: quinn::Connection,
    _endpoint: quinn::Endpoint,
    control: Option<(quinn::SendStream, quinn::RecvStream)>,
}

impl Rogue {
    async fn dial(coord: &TestCoordinator) -> anyhow::Result<Self> {
        let mut endpoint = quinn::Endpoint::client("127.0.0.1:0".parse()?)?;
        endpoint.set_default_client_config(mlx_node::link::tls::client_config(&coord.fingerprint)?);
        let conn = endpoint.connect(coord.quic_addr, "localhost")?.await?;
        Ok(Self {
            conn,
            _endpoint: endpoint,
            control: None,
        })
    }

    /// Opens the control stream and returns the coordinator's nonce.
    async fn challenge(&mut self) -> anyhow::Result<Vec<u8>> {
        let (mut send, mut recv) = self.conn.open_bi().await?;
        let open = NodeControl {
            msg: Some(node_control::Msg::Open(Open {
                version: "rogue".into(),
            })),
        };
        write_frame(&mut send, &open).await?;
        let reply: CoordinatorControl = read_frame(&mut recv).await?;
        let Some(coordinator_control::Msg::Challenge(Challenge { nonce })) = reply.msg else {
            anyhow::bail!("expected a challenge, got {reply:?}");
        };
        self.control = Some((send, recv));
        Ok(nonce)
    }

    fn exporter(&self) -> anyhow::Result<[u8; auth::EXPORTER_LEN]> {
        let mut out = [0u8; auth::EXPORTER_LEN];
        self.conn
            .export_keying_material(&mut out, auth::EXPORTER_LABEL, b"")
            .map_err(|e| anyhow::anyhow!("exporter: {e:?}"))?;
        Ok(out)
    }

    /// Sends `hello`; true when the coordinator welcomed it.
    async fn hello(&mut self, hello: Hello) -> anyhow::Result<bool> {
        let (send, recv) = self.control.as_mut().expect("challenge first");
        let msg = NodeControl {
            msg: Some(node_control::Msg::Hello(hello)),
        };
        write_frame(send, &msg).await?;
        let reply = within(
            "the coordinator's verdict",
            read_frame::<_, CoordinatorControl>(recv),
        )
        .await?;
        Ok(matches!(
            reply,
            Ok(CoordinatorControl {
                msg: Some(coordinator_control::Msg::Welcome(_))
            })
        ))
    }
}

fn hello(node: &SigningKey, signature: Vec<u8>) -> Hello {
    Hello {
        node_id: node.verifying_key().to_bytes().to_vec(),
        signature,
        hardware: Some(HardwareProfile {
            chip: "Apple M3 Ultra".into(),
            os: "macos 26.2".into(),
            arch: "aarch64".into(),
            cpu_cores: 32,
            memory_bytes: 512 << 30,
            free_memory_bytes: 500 << 30,
            ..Default::default()
        }),
        models: vec![CachedModel {
            model: mlxnet_tests::TEST_MODEL_ID.into(),
            sha256: hex::decode(MODEL_SHA256).unwrap(),
            size_bytes: 98_362_432,
        }],
        version: "rogue".into(),
        max_concurrent_jobs: 1,
        name: "rogue".into(),
        location: None,
        mode: "dedicated".into(),
        operator_account: String::new(),
        pod: None,
        batch: None,
    }
}

async fn nodes_online(coord: &TestCoordinator) -> anyhow::Result<u32> {
    let mut client = coord.client().await?;
    Ok(client
        .network
        .stats(NetworkStatsRequest {})
        .await?
        .into_inner()
        .nodes_online)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn proofs_signed_by_another_key_or_replayed_are_refused() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let coord = spawn_coordinator(coordinator_config(dir.path())).await?;
    let node = SigningKey::generate(&mut OsRng);
    let thief = SigningKey::generate(&mut OsRng);

    // Claims to be `node`, but the proof is signed by another key.
    let mut r = Rogue::dial(&coord).await?;
    let nonce = r.challenge().await?;
    let sig = thief.sign(&auth::transcript(&nonce, &r.exporter()?));
    assert!(
        !r.hello(hello(&node, sig.to_bytes().to_vec())).await?,
        "forged proof accepted"
    );

    // A proof made on one connection, replayed on another.
    let mut first = Rogue::dial(&coord).await?;
    let nonce1 = first.challenge().await?;
    let proof = node.sign(&auth::transcript(&nonce1, &first.exporter()?));
    let mut second = Rogue::dial(&coord).await?;
    let _nonce2 = second.challenge().await?;
    assert!(
        !second
            .hello(hello(&node, proof.to_bytes().to_vec()))
            .await?,
        "replayed proof accepted"
    );
    assert_eq!(nodes_online(&coord).await?, 0, "a refused node went online");

    // The honest proof on its own connection is welcome.
    assert!(first.hello(hello(&node, proof.to_bytes().to_vec())).await?);
    assert_eq!(nodes_online(&coord).await?, 1);
    Ok(())
}

/// Reads the next assignment the coordinator sends the rogue.
async fn next_assignment(
    r: &Rogue,
) -> anyhow::Result<(quinn::SendStream, quinn::RecvStream, Assignment)> {
    let (send, mut recv) = within("an assignment", r.conn.accept_bi()).await??;
    let a: Assignment = read_frame(&mut recv).await?;
    Ok((send, recv, a))
}

fn claim_for(
    a: &Assignment,
    job_input: &mlxnet_proto::v1::JobInput,
    key: &SigningKey,
) -> ResultClaim {
    ResultClaim {
        job_id: a.job_id.clone(),
        attempt: a.attempt,
        model_sha256: a.model_sha256.clone(),
        prompt_sha256: claim::input_digest(job_input).to_vec(),
        output_token_ids: vec![42, 43],
        output_text: "Lyon".into(),
        prompt_tokens: 10,
        completion_tokens: 2,
        prefill_micros: 1,
        decode_micros: 1,
        node_id: key.verifying_key().to_bytes().to_vec(),
        finish_reason: "eos".into(),
        ..Default::default()
    }
}

async fn send_result(
    send: &mut quinn::SendStream,
    signed: mlxnet_proto::v1::SignedClaim,
) -> anyhow::Result<()> {
    // A claim covers what its attempt streamed: stream its tokens first.
    if let Some(c) = &signed.claim {
        write_frame(send, &mlxnet_coordinator::test_utils::tokens_of(0, c)).await?;
    }
    let update = JobUpdate {
        msg: Some(job_update::Msg::Result(signed)),
    };
    write_frame(send, &update).await?;
    let _ = send.finish();
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn forged_or_misdirected_results_are_refused_and_change_nothing() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let mut config = coordinator_config(&dir.path().join("coord"));
    config.limits.max_attempts = 5;
    let coord = spawn_coordinator(config).await?;
    let mut client = coord.client().await?;

    // An honest node completes job X, then leaves.
    let mut honest = spawn_node(coord.node_config(&dir.path().join("h"), "h")).await?;
    honest.registered().await?;
    let x = client
        .run_job(chat_job("What is the capital of France?", 8))
        .await?;
    assert_eq!(state(&x.job), JobState::Completed);
    honest.stop().await?;

    // The rogue registers honestly and is given job Y.
    let key = SigningKey::generate(&mut OsRng);
    let mut r = Rogue::dial(&coord).await?;
    let nonce = r.challenge().await?;
    let sig = key.sign(&auth::transcript(&nonce, &r.exporter()?));
    assert!(r.hello(hello(&key, sig.to_bytes().to_vec())).await?);
    let y_request = chat_job("Name a river.", 8);
    let y_input = y_request.input.clone().unwrap();
    let y = client.jobs.submit(y_request).await?.into_inner();

    let get = |id: String| {
        let mut jobs = client.jobs.clone();
        async move { anyhow::Ok(jobs.get(GetJobRequest { job_id: id }).await?.into_inner()) }
    };

    // 1. A claim with a bad signature.
    let (mut send, _recv, a) = next_assignment(&r).await?;
    assert_eq!(a.job_id, y.id);
    let mut signed = claim::sign(claim_for(&a, &y_input, &key), &key);
    signed.signature[0] ^= 0xff;
    send_result(&mut send, signed).await?;

    // 2. A correctly signed claim about job X, which was never the rogue's.
    let (mut send, _recv, a) = next_assignment(&r).await?;
    assert_eq!(a.job_id, y.id, "job Y comes back after the refused result");
    let mut stolen = claim_for(&a, &y_input, &key);
    stolen.job_id = x.job_id.clone();
    send_result(&mut send, claim::sign(stolen, &key)).await?;

    // 3. A claim signed by a key that is not the rogue's.
    let (mut send, _recv, a) = next_assignment(&r).await?;
    let other = SigningKey::generate(&mut OsRng);
    send_result(
        &mut send,
        claim::sign(claim_for(&a, &y_input, &other), &other),
    )
    .await?;

    // Nothing changed: X still holds the honest node's result; Y is unfinished.
    let x_now = get(x.job_id.clone()).await?;
    assert_eq!(x_now.result, x.job.result, "job X's claim was replaced");
    assert_eq!(x_now.output_text, x.job.output_text);
    let y_now = get(y.id.clone()).await?;
    assert_ne!(state(&y_now), JobState::Completed);
    assert!(y_now.result.is_none(), "a refused claim was stored");

    // A correct claim from the rogue for its own job is accepted, once.
    let (mut send, _recv, a) = next_assignment(&r).await?;
    send_result(&mut send, claim::sign(claim_for(&a, &y_input, &key), &key)).await?;
    let done = client.follow(y.id.clone()).await?;
    assert_eq!(state(&done.job), JobState::Completed);
    assert_eq!(done.job.output_text, "Lyon");
    assert_eq!(
        claim::verify(done.job.result.as_ref().unwrap())?.to_string(),
        hex::encode(key.verifying_key().to_bytes())
    );
    Ok(())
}
