//! Test harness (the crate's tests, and other crates' with the
//! `test-utils` feature): a real coordinator on `127.0.0.1:0` with a fresh
//! data directory, a QUIC client config that pins its certificate, nodes
//! made by hand that speak the wire protocol frame by frame, and a
//! WebDriver client for the World page ([`webdriver`]).

pub mod postgres;
pub mod webdriver;

use std::{net::SocketAddr, sync::Arc};

use ed25519_dalek::{Signer, SigningKey};
use mlxnet_proto::{
    auth,
    frame::{read_frame, write_frame},
    v1::{
        coordinator_control, node_control, CachedModel, CoordinatorControl, HardwareProfile, Hello,
        NodeControl, Open,
    },
};
use rustls::{
    client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier},
    crypto::{verify_tls12_signature, verify_tls13_signature, CryptoProvider},
    pki_types::{CertificateDer, ServerName, UnixTime},
    DigitallySignedStruct, SignatureScheme,
};
use tokio::{sync::oneshot, task::JoinHandle};

use crate::{
    app::{AppError, Application},
    config::CoordinatorConfig,
    ledger::{Account, Ledger, ESCROW, FEE},
    link::tls::fingerprint,
};

pub use mlxnet_proto::bearer::{Authed, Bearer};

/// The catalogue's test model.
pub const MODEL: &str = "smollm2-135m-instruct";

/// A plain-prompt job of [`MODEL`] generating at most `max_tokens`.
pub fn prompt_job(prompt: &str, max_tokens: u32) -> mlxnet_proto::v1::SubmitJobRequest {
    use mlxnet_proto::v1::{job_input, JobInput, SamplingParams, SubmitJobRequest};
    SubmitJobRequest {
        model: MODEL.into(),
        input: Some(JobInput {
            kind: Some(job_input::Kind::Prompt(prompt.into())),
        }),
        sampling: Some(SamplingParams {
            max_tokens,
            ..Default::default()
        }),
        max_price_micro_mlx: 0,
        priority: 0,
    }
}

/// Starting balance of the test client: 1,000 MLX.
pub const CLIENT_GRANT: i64 = 1_000_000_000;

/// One plain HTTP/1.1 GET of `path` from `addr`: the whole response,
/// status line and headers included.
pub async fn http_get(addr: SocketAddr, path: &str) -> String {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
    s.write_all(format!("GET {path} HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n").as_bytes())
        .await
        .unwrap();
    let mut out = String::new();
    s.read_to_string(&mut out).await.unwrap();
    out
}

pub struct TestApp {
    /// The running coordinator's ledger (same database).
    pub ledger: crate::ledger::Ledger,
    /// A client account funded with [`CLIENT_GRANT`], and its submit+read key.
    pub client_account: String,
    pub client_key: String,
    pub grpc_addr: SocketAddr,
    pub quic_addr: SocketAddr,
    pub http_addr: SocketAddr,
    pub fingerprint: String,
    /// The client API's abuse limits and their live counts.
    pub admission: Arc<crate::api::limits::Admission>,
    stop: Option<oneshot::Sender<()>>,
    task: Option<JoinHandle<Result<(), AppError>>>,
    _dir: tempfile::TempDir,
}

impl TestApp {
    pub async fn stop(mut self) {
        if let Some(s) = self.stop.take() {
            let _ = s.send(());
        }
        if let Some(t) = self.task.take() {
            t.await.unwrap().unwrap();
        }
    }

    /// A channel to the client API, authenticated as the funded test client.
    pub async fn grpc(&self) -> Authed {
        self.grpc_with(Some(&self.client_key)).await
    }

    /// A channel to the client API that sends `key` (or no key).
    pub async fn grpc_with(&self, key: Option<&str>) -> Authed {
        let channel = tonic::transport::Channel::from_shared(format!("http://{}", self.grpc_addr))
            .unwrap()
            .connect()
            .await
            .unwrap();
        Authed::new(
            channel,
            Bearer(key.map(|k| format!("Bearer {k}").parse().unwrap())),
        )
    }
}

impl Drop for TestApp {
    fn drop(&mut self) {
        if let Some(s) = self.stop.take() {
            let _ = s.send(());
        }
    }
}

/// Builds and runs a coordinator; `tune` adjusts the default test config.
pub async fn spawn_app(tune: impl FnOnce(&mut CoordinatorConfig)) -> TestApp {
    let dir = tempfile::tempdir().unwrap();
    let mut config = CoordinatorConfig::for_data_dir(dir.path().to_path_buf());
    tune(&mut config);
    let app = Application::build(config).await.unwrap();
    let (stop, stopped) = oneshot::channel::<()>();
    let grpc_addr = app.grpc_addr();
    let quic_addr = app.quic_addr();
    let http_addr = app.http_addr();
    let admission = app.admission();
    let fingerprint = app.cert_fingerprint();
    let ledger = app.ledger().clone();
    let account = ledger
        .create_account("test client", crate::ledger::AccountKind::Client)
        .await
        .unwrap();
    ledger
        .grant("test-client", &account.id, CLIENT_GRANT, "starting balance")
        .await
        .unwrap();
    let key = ledger
        .create_key(
            &account.id,
            crate::ledger::keys::Scopes::from_list(["submit", "read"]).unwrap(),
            "test",
            None,
        )
        .await
        .unwrap();
    let task = tokio::spawn(app.run_until(async move {
        let _ = stopped.await;
    }));
    TestApp {
        ledger,
        client_account: account.id,
        client_key: key.secret().to_owned(),
        grpc_addr,
        quic_addr,
        http_addr,
        fingerprint,
        admission,
        stop: Some(stop),
        task: Some(task),
        _dir: dir,
    }
}

/// Accepts exactly the certificate whose SHA-256 is the pin.
#[derive(Debug)]
struct Pinned {
    pin: String,
    provider: Arc<CryptoProvider>,
}

impl ServerCertVerifier for Pinned {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        _intermediates: &[CertificateDer<'_>],
        _server_name: &ServerName<'_>,
        _ocsp: &[u8],
        _now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        if fingerprint(end_entity) == self.pin {
            Ok(ServerCertVerified::assertion())
        } else {
            Err(rustls::Error::General(
                "certificate fingerprint mismatch".into(),
            ))
        }
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        verify_tls12_signature(
            message,
            cert,
            dss,
            &self.provider.signature_verification_algorithms,
        )
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        verify_tls13_signature(
            message,
            cert,
            dss,
            &self.provider.signature_verification_algorithms,
        )
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.provider
            .signature_verification_algorithms
            .supported_schemes()
    }
}

/// A quinn client config pinning `fingerprint`, ALPN `mlxnet/1`, ring provider.
pub fn client_config(fingerprint: &str) -> quinn::ClientConfig {
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let mut tls = rustls::ClientConfig::builder_with_provider(Arc::clone(&provider))
        .with_protocol_versions(&[&rustls::version::TLS13])
        .unwrap()
        .dangerous()
        .with_custom_certificate_verifier(Arc::new(Pinned {
            pin: fingerprint.to_owned(),
            provider,
        }))
        .with_no_client_auth();
    tls.alpn_protocols = vec![mlxnet_proto::auth::ALPN.to_vec()];
    quinn::ClientConfig::new(Arc::new(
        quinn::crypto::rustls::QuicClientConfig::try_from(tls).unwrap(),
    ))
}

/// A hand-made node's connection, stopped at the challenge: tests choose
/// the proof and the Hello.
pub struct Dialer {
    _endpoint: quinn::Endpoint,
    pub conn: quinn::Connection,
    pub send: quinn::SendStream,
    pub recv: quinn::RecvStream,
    pub nonce: Vec<u8>,
}

impl Dialer {
    /// Connects, opens the control stream and reads the challenge.
    pub async fn connect(app: &TestApp) -> Self {
        Self::connect_at(app.quic_addr, &app.fingerprint).await
    }

    /// [`Dialer::connect`] to the coordinator at `quic_addr` whose
    /// certificate is `fingerprint` (one not started by [`spawn_app`]).
    pub async fn connect_at(quic_addr: SocketAddr, fingerprint: &str) -> Self {
        let mut endpoint = quinn::Endpoint::client("127.0.0.1:0".parse().unwrap()).unwrap();
        endpoint.set_default_client_config(client_config(fingerprint));
        let conn = endpoint
            .connect(quic_addr, "localhost")
            .unwrap()
            .await
            .unwrap();
        let (mut send, mut recv) = conn.open_bi().await.unwrap();
        let open = NodeControl {
            msg: Some(node_control::Msg::Open(Open {
                version: "test".into(),
            })),
        };
        write_frame(&mut send, &open).await.unwrap();
        let challenge: CoordinatorControl = read_frame(&mut recv).await.unwrap();
        let Some(coordinator_control::Msg::Challenge(c)) = challenge.msg else {
            panic!("expected a challenge, got {challenge:?}");
        };
        assert_eq!(c.nonce.len(), auth::NONCE_LEN);
        Self {
            _endpoint: endpoint,
            conn,
            send,
            recv,
            nonce: c.nonce,
        }
    }

    /// This connection's proof of `key`.
    pub fn proof(&self, key: &SigningKey) -> Vec<u8> {
        let mut exporter = [0u8; auth::EXPORTER_LEN];
        self.conn
            .export_keying_material(&mut exporter, auth::EXPORTER_LABEL, b"")
            .unwrap();
        key.sign(&auth::transcript(&self.nonce, &exporter))
            .to_bytes()
            .to_vec()
    }

    /// Sends a Hello naming `node` with `signature`; returns the reply, or
    /// `None` if the connection ended without one.
    pub async fn hello(
        &mut self,
        node: &SigningKey,
        signature: Vec<u8>,
    ) -> Option<coordinator_control::Msg> {
        self.hello_with(node, signature, |_| {}).await
    }

    /// [`Dialer::hello`] with the Hello edited by `edit` first.
    pub async fn hello_with(
        &mut self,
        node: &SigningKey,
        signature: Vec<u8>,
        edit: impl FnOnce(&mut Hello),
    ) -> Option<coordinator_control::Msg> {
        let mut hello = Hello {
            node_id: node.verifying_key().to_bytes().to_vec(),
            signature,
            hardware: Some(HardwareProfile {
                memory_bytes: 16 << 30,
                free_memory_bytes: 8 << 30,
                ..Default::default()
            }),
            models: vec![CachedModel {
                model: "smollm2-135m-instruct".into(),
                sha256: hex::decode(crate::config::smollm2_135m_instruct().sha256).unwrap(),
                size_bytes: 1,
            }],
            version: "test".into(),
            max_concurrent_jobs: 1,
            name: "test".into(),
            ..Default::default()
        };
        edit(&mut hello);
        write_frame(
            &mut self.send,
            &NodeControl {
                msg: Some(node_control::Msg::Hello(hello)),
            },
        )
        .await
        .unwrap();
        read_frame::<_, CoordinatorControl>(&mut self.recv)
            .await
            .ok()
            .and_then(|m| m.msg)
    }
}

/// The key [`FakeNode::register`] gives the node of `seed`.
pub fn node_key(seed: u64) -> SigningKey {
    use rand::SeedableRng;
    SigningKey::generate(&mut rand::rngs::StdRng::seed_from_u64(seed))
}

/// The id (lowercase hex) of [`FakeNode::register`]'s node of `seed`.
pub fn node_hex(seed: u64) -> String {
    hex::encode(node_key(seed).verifying_key().to_bytes())
}

/// A node made by hand: registered with the test model, speaking the wire
/// protocol directly so tests control every frame.
pub struct FakeNode {
    pub key: ed25519_dalek::SigningKey,
    pub conn: quinn::Connection,
    dialer: Dialer,
}

impl FakeNode {
    pub async fn register(app: &TestApp, seed: u64) -> Self {
        Self::register_with(app, seed, |_| {}).await
    }

    /// [`FakeNode::register`] with its Hello edited by `edit` first.
    pub async fn register_with(app: &TestApp, seed: u64, edit: impl FnOnce(&mut Hello)) -> Self {
        Self::register_at(app.quic_addr, &app.fingerprint, seed, edit).await
    }

    /// [`FakeNode::register_with`] at the coordinator at `quic_addr` whose
    /// certificate is `fingerprint` (one not started by [`spawn_app`]).
    pub async fn register_at(
        quic_addr: SocketAddr,
        fingerprint: &str,
        seed: u64,
        edit: impl FnOnce(&mut Hello),
    ) -> Self {
        let key = node_key(seed);
        let mut dialer = Dialer::connect_at(quic_addr, fingerprint).await;
        let proof = dialer.proof(&key);
        let reply = dialer.hello_with(&key, proof, edit).await;
        assert!(
            matches!(
                reply,
                Some(mlxnet_proto::v1::coordinator_control::Msg::Welcome(_))
            ),
            "{reply:?}"
        );
        Self {
            key,
            conn: dialer.conn.clone(),
            dialer,
        }
    }

    /// This node's claim about assignment `a` (see [`claim_for`]).
    pub fn claim(
        &self,
        a: &mlxnet_proto::v1::Assignment,
        ids: Vec<u32>,
        text: &str,
    ) -> mlxnet_proto::v1::ResultClaim {
        claim_for(&self.key, a, ids, text)
    }

    /// Sends `msg` on the node's control stream.
    pub async fn control(&mut self, msg: &NodeControl) {
        write_frame(&mut self.dialer.send, msg).await.unwrap();
    }

    /// The coordinator's next message on the node's control stream.
    pub async fn control_reply(&mut self) -> CoordinatorControl {
        read_frame(&mut self.dialer.recv).await.unwrap()
    }

    /// The next job the coordinator assigns.
    pub async fn next_assignment(
        &self,
    ) -> (
        quinn::SendStream,
        quinn::RecvStream,
        mlxnet_proto::v1::Assignment,
    ) {
        let (send, mut recv) = self.conn.accept_bi().await.unwrap();
        let a = mlxnet_proto::frame::read_frame(&mut recv).await.unwrap();
        (send, recv, a)
    }
}

/// The claim of the node holding `key` about assignment `a`, listing `ids`
/// and `text` (finish `eos`, counts matching, 5 prompt tokens, timings
/// zero, the assignment's grammar bound); sign it with `claim::sign`, after
/// any edit.
pub fn claim_for(
    key: &SigningKey,
    a: &mlxnet_proto::v1::Assignment,
    ids: Vec<u32>,
    text: &str,
) -> mlxnet_proto::v1::ResultClaim {
    mlxnet_proto::v1::ResultClaim {
        job_id: a.job_id.clone(),
        attempt: a.attempt,
        model_sha256: a.model_sha256.clone(),
        prompt_sha256: mlxnet_proto::claim::input_digest(&a.input.clone().unwrap_or_default())
            .to_vec(),
        completion_tokens: ids.len() as u32,
        output_token_ids: ids,
        output_text: text.into(),
        prompt_tokens: 5,
        node_id: key.verifying_key().to_bytes().to_vec(),
        finish_reason: "eos".into(),
        grammar_sha256: mlxnet_proto::grammar::claim_digest(
            a.sampling.as_ref().and_then(|s| s.grammar.as_ref()),
        )
        .map(|d| d.to_vec())
        .unwrap_or_default(),
        ..Default::default()
    }
}

/// The update streaming exactly the tokens and text `c` lists, from token
/// `index` (a claim must cover what its attempt streamed).
pub fn tokens_of(index: u32, c: &mlxnet_proto::v1::ResultClaim) -> mlxnet_proto::v1::JobUpdate {
    use mlxnet_proto::v1::{job_update, JobUpdate};
    JobUpdate {
        msg: Some(job_update::Msg::Tokens(job_update::Tokens {
            index,
            token_ids: c.output_token_ids.clone(),
            text: c.output_text.clone(),
            logprobs: Vec::new(),
        })),
    }
}

/// Every balance a refused claim (or any node's misbehaviour) could move:
/// the test client's, one operator's, the fee's and the escrow's.
#[derive(Debug, PartialEq)]
pub struct Books {
    pub client: Account,
    pub operator: Account,
    pub fee: Account,
    pub escrow: Account,
}

pub async fn books(ledger: &Ledger, client: &str, operator: &str) -> Books {
    let get = |id: String| async move { ledger.account(&id).await.unwrap().unwrap() };
    Books {
        client: get(client.to_owned()).await,
        operator: get(operator.to_owned()).await,
        fee: get(FEE.to_owned()).await,
        escrow: get(ESCROW.to_owned()).await,
    }
}

/// The books once `settled` holds of them: settlement runs after the store
/// records a completion, so a test that saw the completion (or the node's next
/// assignment) waits for it, up to 10 s.
pub async fn books_once(
    ledger: &Ledger,
    client: &str,
    operator: &str,
    settled: impl Fn(&Books) -> bool,
) -> Books {
    let mut now = books(ledger, client, operator).await;
    for _ in 0..500 {
        if settled(&now) {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
        now = books(ledger, client, operator).await;
    }
    now
}
