//! Pulls against a real HTTP server started by each test (axum on port 0)
//! that misbehaves on purpose: cuts the connection mid-file, serves a wrong
//! byte, answers 404/416/500, ignores Range, or is slow. Verdicts are about
//! bytes, requests and files, never about time.

use std::{
    net::SocketAddr,
    sync::{
        atomic::{AtomicU64, AtomicUsize, Ordering},
        Arc, Mutex,
    },
    time::Duration,
};

use axum::{
    body::{Body, Bytes},
    extract::{Path as UrlPath, State},
    http::{header, HeaderMap, StatusCode},
    response::Response,
    routing::get,
    Router,
};
use mlxnet_proto::catalogue::{CatalogueEntry, ModelFile};
use rand::{rngs::StdRng, Rng, SeedableRng};
use sha2::{Digest, Sha256};

use super::download::{DownloadConfig, DownloadError, Downloader};
use super::progress::Progress;
use super::store::{ModelStore, Pulled, Refused, StoreError, StorePolicy};

/// What the server saw and sent.
#[derive(Default)]
struct Log {
    /// Body bytes handed to the connection, all requests.
    sent: AtomicU64,
    /// (mode, Range header) of every request, in order.
    requests: Mutex<Vec<(String, Option<String>)>>,
    /// Requests per mode that asked to cut (the first one is cut).
    cut_once: AtomicUsize,
}

struct Served {
    files: Vec<(String, Arc<Vec<u8>>)>,
    log: Log,
}

/// A file server whose first path segment picks how it misbehaves:
/// `good`, `cut` (the first request stops after 700 KiB), `wrong` (byte
/// 1000 is flipped), `404`, `416`, `500`, `norange` (answers 200 with the
/// whole file to every request), `slow` (4 KiB chunks, each after a yield
/// and a 1 ms pause).
pub(crate) struct TestServer {
    addr: SocketAddr,
    state: Arc<Served>,
}

const CUT_AT: usize = 700 << 10;

async fn serve(
    State(st): State<Arc<Served>>,
    UrlPath((mode, name)): UrlPath<(String, String)>,
    headers: HeaderMap,
) -> Response {
    let range = headers
        .get(header::RANGE)
        .and_then(|v| v.to_str().ok())
        .map(str::to_owned);
    st.log
        .requests
        .lock()
        .unwrap()
        .push((mode.clone(), range.clone()));
    let status = |s: StatusCode| Response::builder().status(s).body(Body::empty()).unwrap();
    let Some((_, data)) = st.files.iter().find(|(n, _)| *n == name) else {
        return status(StatusCode::NOT_FOUND);
    };
    match mode.as_str() {
        "404" => return status(StatusCode::NOT_FOUND),
        "416" => return status(StatusCode::RANGE_NOT_SATISFIABLE),
        "500" => return status(StatusCode::INTERNAL_SERVER_ERROR),
        _ => {}
    }
    let len = data.len();
    let (start, end) = match range.as_deref().filter(|_| mode != "norange") {
        Some(r) => {
            let r = r.strip_prefix("bytes=").unwrap();
            let (a, b) = r.split_once('-').unwrap();
            let a: usize = a.parse().unwrap();
            let b: usize = if b.is_empty() {
                len - 1
            } else {
                b.parse().unwrap()
            };
            if a >= len {
                return status(StatusCode::RANGE_NOT_SATISFIABLE);
            }
            (a, b.min(len - 1) + 1)
        }
        None => (0, len),
    };
    let mut body = data[start..end].to_vec();
    if mode == "wrong" && (start..end).contains(&1000) {
        body[1000 - start] ^= 0x40;
    }
    let cut = mode == "cut" && st.log.cut_once.fetch_add(1, Ordering::SeqCst) == 0;
    let slow = mode == "slow";
    let chunk = if slow { 4 << 10 } else { 64 << 10 };
    let st2 = st.clone();
    let stream = async_stream(body, chunk, cut, slow, st2);
    let mut resp = Response::builder()
        .header(header::CONTENT_LENGTH, end - start)
        .header(header::ACCEPT_RANGES, "bytes");
    if range.is_some() && mode != "norange" {
        resp = resp.status(StatusCode::PARTIAL_CONTENT).header(
            header::CONTENT_RANGE,
            format!("bytes {start}-{}/{len}", end - 1),
        );
    }
    resp.body(Body::from_stream(stream)).unwrap()
}

/// The body as a stream of chunks; `cut` ends it with an error after
/// [`CUT_AT`] bytes, which makes the server drop the connection.
fn async_stream(
    body: Vec<u8>,
    chunk: usize,
    cut: bool,
    slow: bool,
    st: Arc<Served>,
) -> impl futures::Stream<Item = Result<Bytes, std::io::Error>> {
    futures::stream::unfold((body, 0usize), move |(body, at)| {
        let st = st.clone();
        async move {
            if at >= body.len() {
                return None;
            }
            if cut && at >= CUT_AT {
                return Some((Err(std::io::Error::other("cut")), (body, usize::MAX)));
            }
            if slow {
                tokio::task::yield_now().await;
                tokio::time::sleep(Duration::from_millis(1)).await;
            }
            let mut end = (at + chunk).min(body.len());
            if cut {
                end = end.min(CUT_AT);
            }
            let piece = Bytes::copy_from_slice(&body[at..end]);
            st.log.sent.fetch_add(piece.len() as u64, Ordering::SeqCst);
            Some((Ok(piece), (body, end)))
        }
    })
}

impl TestServer {
    pub(crate) async fn start(files: Vec<(String, Vec<u8>)>) -> TestServer {
        let state = Arc::new(Served {
            files: files.into_iter().map(|(n, d)| (n, Arc::new(d))).collect(),
            log: Log::default(),
        });
        let app = Router::new()
            .route("/{mode}/{name}", get(serve))
            .with_state(state.clone());
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(async move {
            axum::serve(listener, app).await.unwrap();
        });
        TestServer { addr, state }
    }

    pub(crate) fn url(&self, mode: &str, name: &str) -> String {
        format!("http://{}/{mode}/{name}", self.addr)
    }

    fn base(&self, mode: &str) -> String {
        format!("http://{}/{mode}/", self.addr)
    }

    pub(crate) fn sent(&self) -> u64 {
        self.state.log.sent.load(Ordering::SeqCst)
    }

    fn requests(&self) -> Vec<(String, Option<String>)> {
        self.state.log.requests.lock().unwrap().clone()
    }
}

/// Records every progress event.
#[derive(Default)]
struct Recorder {
    events: Vec<String>,
    advances: Vec<u64>,
}

impl Progress for Recorder {
    fn start(&mut self, file: &str, total: u64, have: u64) {
        self.events.push(format!("start {file} {total} {have}"));
    }
    fn advance(&mut self, have: u64) {
        self.advances.push(have);
    }
    fn note(&mut self, msg: &str) {
        self.events.push(format!("note {msg}"));
    }
    fn finish(&mut self, ok: bool) {
        self.events.push(format!("finish {ok}"));
    }
}

fn data(seed: u64, len: usize) -> Vec<u8> {
    let mut rng = StdRng::seed_from_u64(seed);
    (0..len).map(|_| rng.gen()).collect()
}

const PIECE: u64 = 256 << 10;

fn file_of(name: &str, bytes: &[u8], mirrors: Vec<String>) -> ModelFile {
    ModelFile {
        name: name.into(),
        size_bytes: bytes.len() as u64,
        sha256: hex::encode(Sha256::digest(bytes)),
        mirrors,
        piece_bytes: PIECE,
        pieces: bytes
            .chunks(PIECE as usize)
            .map(|c| hex::encode(Sha256::digest(c)))
            .collect(),
    }
}

fn entry_of(id: &str, file: ModelFile) -> CatalogueEntry {
    CatalogueEntry {
        id: id.into(),
        architecture: "llama".into(),
        parameters: 1000,
        active_parameters: 0,
        quantization: "Q8_0".into(),
        context_length: 2048,
        license: "apache-2.0".into(),
        price_input_per_mtok: None,
        price_output_per_mtok: None,
        layers: 0,
        kv_heads: 0,
        head_dim: 0,
        hidden_size: 0,
        kv_element_bytes: 0,
        vocab_size: 0,
        files: vec![file],
    }
}

fn downloader() -> Downloader {
    Downloader::new(DownloadConfig {
        retries: 2,
        backoff: Duration::ZERO,
        connect_timeout: Duration::from_secs(10),
        read_timeout: Duration::from_secs(30),
    })
    .unwrap()
}

fn store(dir: &std::path::Path, policy: StorePolicy) -> ModelStore {
    ModelStore::open(dir.join("models"), policy).unwrap()
}

/// The installed file's bytes, or None.
fn installed(store: &ModelStore, id: &str, name: &str) -> Option<Vec<u8>> {
    std::fs::read(store.file_path(id, name)).ok()
}

#[tokio::test]
async fn a_cut_download_resumes_from_the_last_byte() {
    let bytes = data(1, 3 << 20);
    let server = TestServer::start(vec![("m.gguf".into(), bytes.clone())]).await;
    let dir = tempfile::tempdir().unwrap();
    let store = store(dir.path(), StorePolicy::default());
    let entry = entry_of(
        "m",
        file_of("m.gguf", &bytes, vec![server.url("cut", "m.gguf")]),
    );
    let mut progress = Recorder::default();
    let pulled = store
        .pull(&entry, &downloader(), &[], &[], &mut progress)
        .await
        .unwrap();
    assert_eq!(pulled, Pulled::Installed { evicted: vec![] });
    assert_eq!(installed(&store, "m", "m.gguf").unwrap(), bytes);
    let requests = server.requests();
    assert_eq!(requests.len(), 2, "{requests:?}");
    assert_eq!(
        requests[0].1, None,
        "the first request asks for the whole file"
    );
    // The resume asks for exactly the bytes after those the client held
    // when the connection was cut (a count it had reported as progress).
    let resume = requests[1].1.clone().unwrap();
    let held: u64 = resume
        .strip_prefix("bytes=")
        .and_then(|r| r.strip_suffix(&format!("-{}", bytes.len() - 1)))
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| panic!("resume range {resume}"));
    assert!(held > 0 && held <= CUT_AT as u64, "{held}");
    assert!(progress.advances.contains(&held));
    // The server sent the first CUT_AT bytes once, then only what follows
    // the client's bytes: nothing the client held was fetched twice.
    assert_eq!(server.sent(), CUT_AT as u64 + (bytes.len() as u64 - held));
    // And a pull of what is there fetches nothing.
    let again = store
        .pull(&entry, &downloader(), &[], &[], &mut Recorder::default())
        .await
        .unwrap();
    assert_eq!(again, Pulled::AlreadyInstalled);
    assert_eq!(server.requests().len(), 2);
}

#[tokio::test]
async fn a_partial_file_from_an_earlier_run_is_resumed_after_rehashing_it() {
    let bytes = data(2, 1 << 20);
    let server = TestServer::start(vec![("m.gguf".into(), bytes.clone())]).await;
    let dir = tempfile::tempdir().unwrap();
    let store = store(dir.path(), StorePolicy::default());
    let file = file_of("m.gguf", &bytes, vec![server.url("good", "m.gguf")]);
    let partial = store
        .root()
        .join(".partial")
        .join(format!("{}.part", file.sha256));
    std::fs::write(&partial, &bytes[..300_000]).unwrap();
    let entry = entry_of("m", file);
    let mut progress = Recorder::default();
    store
        .pull(&entry, &downloader(), &[], &[], &mut progress)
        .await
        .unwrap();
    assert_eq!(installed(&store, "m", "m.gguf").unwrap(), bytes);
    assert_eq!(
        server.requests()[0].1.as_deref(),
        Some(format!("bytes=300000-{}", bytes.len() - 1).as_str())
    );
    assert_eq!(server.sent(), (bytes.len() - 300_000) as u64);
    assert_eq!(
        progress.events[0],
        format!("start m.gguf {} 300000", bytes.len())
    );
    assert!(
        !partial.exists(),
        "the partial file became the installed one"
    );
}

#[tokio::test]
async fn a_corrupt_file_is_never_installed_and_the_next_mirror_serves_it() {
    let bytes = data(3, 1 << 20);
    let server = TestServer::start(vec![("m.gguf".into(), bytes.clone())]).await;
    let dir = tempfile::tempdir().unwrap();
    let store = store(dir.path(), StorePolicy::default());

    // Only the corrupting mirror: refused, nothing installed, nothing kept.
    let only_wrong = entry_of(
        "m",
        file_of("m.gguf", &bytes, vec![server.url("wrong", "m.gguf")]),
    );
    let err = store
        .pull(
            &only_wrong,
            &downloader(),
            &[],
            &[],
            &mut Recorder::default(),
        )
        .await
        .unwrap_err();
    let text = err.to_string();
    assert!(
        matches!(
            err,
            StoreError::Download(DownloadError::AllMirrorsFailed { .. })
        ),
        "{text}"
    );
    assert!(text.contains("digest mismatch"), "{text}");
    assert!(store.list().unwrap().is_empty());
    assert!(installed(&store, "m", "m.gguf").is_none());
    let partials = std::fs::read_dir(store.root().join(".partial"))
        .unwrap()
        .count();
    assert_eq!(partials, 0, "the corrupt bytes are deleted, not resumed");

    // The corrupting mirror first, then a good one: installed, intact.
    let entry = entry_of(
        "m",
        file_of(
            "m.gguf",
            &bytes,
            vec![server.url("wrong", "m.gguf"), server.url("good", "m.gguf")],
        ),
    );
    let mut progress = Recorder::default();
    store
        .pull(&entry, &downloader(), &[], &[], &mut progress)
        .await
        .unwrap();
    assert_eq!(installed(&store, "m", "m.gguf").unwrap(), bytes);
    assert!(
        progress
            .events
            .iter()
            .any(|e| e.contains("digest mismatch")),
        "{:?}",
        progress.events
    );
    // The good mirror served the whole file from byte 0.
    let last = server.requests().last().cloned().unwrap();
    assert_eq!(last, ("good".to_string(), None));
    let (ok, verdicts): (Vec<_>, Vec<_>) = store
        .verify("m")
        .unwrap()
        .into_iter()
        .partition(|(_, v)| v.is_ok());
    assert_eq!((ok.len(), verdicts.len()), (1, 0));
}

#[tokio::test]
async fn bad_mirrors_fall_over_to_the_next() {
    let bytes = data(4, 1 << 20);
    let server = TestServer::start(vec![("m.gguf".into(), bytes.clone())]).await;
    let dir = tempfile::tempdir().unwrap();
    let store = store(dir.path(), StorePolicy::default());
    let entry = entry_of(
        "m",
        file_of(
            "m.gguf",
            &bytes,
            vec![
                server.url("404", "m.gguf"),
                server.url("416", "m.gguf"),
                server.url("500", "m.gguf"),
                server.url("good", "m.gguf"),
            ],
        ),
    );
    let mut progress = Recorder::default();
    store
        .pull(&entry, &downloader(), &[], &[], &mut progress)
        .await
        .unwrap();
    assert_eq!(installed(&store, "m", "m.gguf").unwrap(), bytes);
    let modes: Vec<String> = server.requests().into_iter().map(|(m, _)| m).collect();
    // 404 and 416 are given up at once; 500 is retried (2 retries after
    // the first try), then the good mirror serves.
    assert_eq!(modes, ["404", "416", "500", "500", "500", "good"]);
    let notes: Vec<&String> = progress
        .events
        .iter()
        .filter(|e| e.starts_with("note"))
        .collect();
    assert_eq!(notes.len(), 3, "{notes:?}");
    assert!(
        notes[0].contains("404") && notes[2].contains("500"),
        "{notes:?}"
    );
}

#[tokio::test]
async fn every_mirror_failing_is_an_error_naming_each() {
    let bytes = data(5, 64 << 10);
    let server = TestServer::start(vec![("m.gguf".into(), bytes.clone())]).await;
    let dir = tempfile::tempdir().unwrap();
    let store = store(dir.path(), StorePolicy::default());
    let entry = entry_of(
        "m",
        file_of(
            "m.gguf",
            &bytes,
            vec![server.url("404", "m.gguf"), server.url("500", "m.gguf")],
        ),
    );
    let err = store
        .pull(&entry, &downloader(), &[], &[], &mut Recorder::default())
        .await
        .unwrap_err();
    let StoreError::Download(DownloadError::AllMirrorsFailed { failures, .. }) = &err else {
        panic!("{err}");
    };
    assert_eq!(failures.len(), 2);
    assert!(
        failures[0].1.contains("404") && failures[1].1.contains("500"),
        "{failures:?}"
    );
    assert!(store.list().unwrap().is_empty());
    // No mirror at all is its own clear error.
    let mut none = entry.clone();
    none.files[0].mirrors.clear();
    let err = store
        .pull(&none, &downloader(), &[], &[], &mut Recorder::default())
        .await
        .unwrap_err();
    assert!(
        matches!(err, StoreError::Download(DownloadError::NoMirrors { .. })),
        "{err}"
    );
}

#[tokio::test]
async fn a_mirror_that_ignores_range_is_restarted_from_zero() {
    let bytes = data(6, 2 << 20);
    let server = TestServer::start(vec![("m.gguf".into(), bytes.clone())]).await;
    let dir = tempfile::tempdir().unwrap();
    let store = store(dir.path(), StorePolicy::default());
    let file = file_of("m.gguf", &bytes, vec![server.url("norange", "m.gguf")]);
    std::fs::write(
        store
            .root()
            .join(".partial")
            .join(format!("{}.part", file.sha256)),
        &bytes[..1000],
    )
    .unwrap();
    store
        .pull(
            &entry_of("m", file),
            &downloader(),
            &[],
            &[],
            &mut Recorder::default(),
        )
        .await
        .unwrap();
    assert_eq!(installed(&store, "m", "m.gguf").unwrap(), bytes);
    // The resume was answered with the whole file, which was read once more from 0.
    assert_eq!(server.requests().len(), 2);
    assert_eq!(server.sent(), 2 * bytes.len() as u64);
}

#[tokio::test]
async fn a_slow_mirror_still_delivers_the_file() {
    let bytes = data(7, 256 << 10);
    let server = TestServer::start(vec![("m.gguf".into(), bytes.clone())]).await;
    let dir = tempfile::tempdir().unwrap();
    let store = store(dir.path(), StorePolicy::default());
    // The mirror passed on the command line (a folder URL) comes first.
    let entry = entry_of(
        "m",
        file_of("m.gguf", &bytes, vec![server.url("404", "m.gguf")]),
    );
    let mut progress = Recorder::default();
    store
        .pull(
            &entry,
            &downloader(),
            &[server.base("slow")],
            &[],
            &mut progress,
        )
        .await
        .unwrap();
    assert_eq!(installed(&store, "m", "m.gguf").unwrap(), bytes);
    assert_eq!(
        server.requests().len(),
        1,
        "the extra mirror is tried first"
    );
    // Many small chunks, each reported.
    assert!(progress.advances.len() >= 64, "{}", progress.advances.len());
    assert!(progress.advances.windows(2).all(|w| w[0] <= w[1]));
    assert_eq!(progress.events.last().unwrap(), "finish true");
}

#[tokio::test]
async fn the_quota_evicts_the_least_recently_used_model() {
    let (a, b, c) = (data(10, 1 << 20), data(11, 1 << 20), data(12, 1 << 20));
    let server = TestServer::start(vec![
        ("a.gguf".into(), a.clone()),
        ("b.gguf".into(), b.clone()),
        ("c.gguf".into(), c.clone()),
    ])
    .await;
    let dir = tempfile::tempdir().unwrap();
    let store = store(
        dir.path(),
        StorePolicy {
            quota_bytes: Some((5 << 20) / 2),
            ..StorePolicy::default()
        },
    );
    let entry = |id: &str, bytes: &[u8]| {
        entry_of(
            id,
            file_of(
                &format!("{id}.gguf"),
                bytes,
                vec![server.url("good", &format!("{id}.gguf"))],
            ),
        )
    };
    let d = downloader();
    let mut p = Recorder::default();
    store
        .pull(&entry("a", &a), &d, &[], &[], &mut p)
        .await
        .unwrap();
    store
        .pull(&entry("b", &b), &d, &[], &[], &mut p)
        .await
        .unwrap();
    // a is used again (a job ran on it): b is now the one unused for longest.
    store.touch("a").unwrap();
    let pulled = store
        .pull(&entry("c", &c), &d, &[], &[], &mut p)
        .await
        .unwrap();
    assert_eq!(
        pulled,
        Pulled::Installed {
            evicted: vec!["b".into()]
        }
    );
    let ids: Vec<String> = store.list().unwrap().into_iter().map(|m| m.id).collect();
    assert_eq!(ids, ["a", "c"]);
    assert!(!store.model_dir("b").exists(), "b's files are gone");
    assert!(store.used_bytes().unwrap() <= (5 << 20) / 2);

    // A model in use is never evicted: with a and c both in use, b cannot fit.
    let err = store
        .pull(&entry("b", &b), &d, &[], &["a".into(), "c".into()], &mut p)
        .await
        .unwrap_err();
    assert!(
        matches!(err, StoreError::Refused(Refused::QuotaTooSmall { .. })),
        "{err}"
    );
    assert_eq!(store.list().unwrap().len(), 2, "a refusal changes nothing");
}

#[tokio::test]
async fn the_owners_rules_refuse_before_any_byte_is_fetched() {
    let bytes = data(13, 1 << 20);
    let server = TestServer::start(vec![("m.gguf".into(), bytes.clone())]).await;
    let dir = tempfile::tempdir().unwrap();
    let entry = entry_of(
        "m",
        file_of("m.gguf", &bytes, vec![server.url("good", "m.gguf")]),
    );
    let cases = [
        (
            StorePolicy {
                max_model_bytes: Some(1000),
                ..StorePolicy::default()
            },
            "limit",
        ),
        (
            StorePolicy {
                refuse_licenses: vec!["Apache-2.0".into()],
                ..StorePolicy::default()
            },
            "license",
        ),
        (
            StorePolicy {
                quota_bytes: Some(1000),
                ..StorePolicy::default()
            },
            "quota",
        ),
    ];
    for (policy, word) in cases {
        let store = store(dir.path(), policy);
        let err = store
            .pull(&entry, &downloader(), &[], &[], &mut Recorder::default())
            .await
            .unwrap_err();
        assert!(matches!(err, StoreError::Refused(_)), "{err}");
        assert!(err.to_string().contains(word), "{err}");
        assert!(store.list().unwrap().is_empty());
    }
    assert!(server.requests().is_empty(), "no byte was asked for");
}

#[tokio::test]
async fn removing_and_verifying_installed_models() {
    let bytes = data(14, 128 << 10);
    let server = TestServer::start(vec![("m.gguf".into(), bytes.clone())]).await;
    let dir = tempfile::tempdir().unwrap();
    let store = store(dir.path(), StorePolicy::default());
    let entry = entry_of(
        "m",
        file_of("m.gguf", &bytes, vec![server.url("good", "m.gguf")]),
    );
    store
        .pull(&entry, &downloader(), &[], &[], &mut Recorder::default())
        .await
        .unwrap();
    assert_eq!(
        store.entries().unwrap()[0].path,
        store.file_path("m", "m.gguf")
    );
    // A byte changed on disk is found by verify.
    let path = store.file_path("m", "m.gguf");
    let mut changed = bytes.clone();
    changed[5] ^= 1;
    std::fs::write(&path, &changed).unwrap();
    let verdicts = store.verify("m").unwrap();
    assert!(
        verdicts[0].1.as_ref().unwrap_err().contains("sha256"),
        "{verdicts:?}"
    );
    store.remove("m").unwrap();
    assert!(store.list().unwrap().is_empty());
    assert!(!path.exists());
    assert!(matches!(
        store.remove("m"),
        Err(StoreError::NotInstalled(_))
    ));
    assert!(matches!(
        store.verify("m"),
        Err(StoreError::NotInstalled(_))
    ));
}

#[tokio::test]
async fn fetching_pieces_reads_only_those_bytes_and_checks_each() {
    let bytes = data(15, (PIECE * 6 + 1234) as usize);
    let server = TestServer::start(vec![("m.gguf".into(), bytes.clone())]).await;
    let dir = tempfile::tempdir().unwrap();
    let file = file_of(
        "m.gguf",
        &bytes,
        vec![server.url("wrong", "m.gguf"), server.url("good", "m.gguf")],
    );
    let dest = dir.path().join("m.gguf");
    let mut progress = Recorder::default();
    // Piece 0 holds the flipped byte 1000: the first mirror fails it, the
    // second serves it; pieces 3 and 6 (the short last one) come from the
    // second mirror only.
    downloader()
        .fetch_pieces(&file, &file.mirrors, &[0, 3, 6], &dest, &mut progress)
        .await
        .unwrap();
    let got = std::fs::read(&dest).unwrap();
    assert_eq!(got.len(), bytes.len());
    for i in 0..7 {
        let r = file.piece_range(i);
        let (r0, r1) = (r.start as usize, r.end as usize);
        if [0, 3, 6].contains(&i) {
            assert_eq!(got[r0..r1], bytes[r0..r1], "piece {i}");
        } else {
            assert!(
                got[r0..r1].iter().all(|&b| b == 0),
                "piece {i} was not fetched"
            );
        }
    }
    let wanted: u64 = [0, 3, 6]
        .iter()
        .map(|&i| file.piece_range(i))
        .map(|r| r.end - r.start)
        .sum();
    // The bad mirror sent piece 0 once; the good one exactly the three pieces.
    assert_eq!(server.sent(), wanted + PIECE);
    // Run again: every piece is on disk and intact, nothing is fetched.
    let before = server.requests().len();
    downloader()
        .fetch_pieces(
            &file,
            &file.mirrors,
            &[0, 3, 6],
            &dest,
            &mut Recorder::default(),
        )
        .await
        .unwrap();
    assert_eq!(server.requests().len(), before);
}

/// Runs a pod of `paths.len()` ranks (rank r loading `paths[r]`) over TCP on
/// loopback: the logits of every step and the greedy tokens.
fn pod_greedy(
    paths: &[std::path::PathBuf],
    plan: &crate::engine::sharded::PodPlan,
    prompt: &[u32],
    steps: usize,
) -> (Vec<Vec<f32>>, Vec<u32>) {
    use crate::collectives::{tcp::TcpOptions, tests::tcp_pod, GroupOptions};
    use crate::engine::sharded::{generate_greedy, Compute, PodModel};
    let comms = tcp_pod(paths.len(), TcpOptions::default(), GroupOptions::default());
    let handles: Vec<_> = comms
        .into_iter()
        .enumerate()
        .map(|(rank, mut comm)| {
            let (path, plan) = (paths[rank].clone(), plan.clone());
            let prompt = if rank == 0 {
                prompt.to_vec()
            } else {
                Vec::new()
            };
            std::thread::spawn(move || {
                let mut m = PodModel::load_gguf(&path, plan, rank, Compute::Native).unwrap();
                generate_greedy(&mut m, comm.as_mut(), &prompt, steps).unwrap()
            })
        })
        .collect();
    let mut results: Vec<_> = handles.into_iter().map(|h| h.join().unwrap()).collect();
    results.swap_remove(0)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pod_members_fetch_only_their_shard_and_compute_what_the_whole_file_does() {
    use super::shard::{covering_pieces, fetch_shard};
    use crate::engine::sharded::PodPlan;
    use crate::engine::testutil::{write_gguf, GgufTweaks, TinySpec};
    let dir = tempfile::tempdir().unwrap();
    let spec = TinySpec {
        layers: 4,
        ..TinySpec::new("llama")
    };
    let whole = dir.path().join("whole.gguf");
    write_gguf(
        &whole,
        &spec,
        candle_core::quantized::GgmlDType::Q8_0,
        &GgufTweaks::default(),
    );
    let bytes = std::fs::read(&whole).unwrap();
    let server = TestServer::start(vec![("m.gguf".into(), bytes.clone())]).await;
    let mut file = file_of("m.gguf", &bytes, vec![server.url("good", "m.gguf")]);
    // Small pieces, so a share is a clear part of this small file.
    file.piece_bytes = 16 << 10;
    file.pieces = bytes
        .chunks(16 << 10)
        .map(|c| hex::encode(Sha256::digest(c)))
        .collect();

    for (what, make_plan) in [("pipeline x2", 0), ("tensor x2", 1)] {
        let mut paths = Vec::new();
        let mut sent_before = server.sent();
        let mut fetched = Vec::new();
        for rank in 0..2 {
            let dest = dir.path().join(format!("{what}-rank{rank}.gguf"));
            let got = fetch_shard(
                &downloader(),
                &file,
                &file.mirrors,
                &dest,
                rank,
                |cfg, unit| {
                    if make_plan == 0 {
                        PodPlan::pipeline(cfg, &[1.0, 1.0])
                    } else {
                        PodPlan::tensor(cfg, unit, &[1.0, 1.0])
                    }
                    .map_err(Into::into)
                },
                &mut Recorder::default(),
            )
            .await
            .unwrap();
            // The server sent exactly the pieces that cover the share.
            let sent = server.sent() - sent_before;
            sent_before = server.sent();
            let covered: u64 = covering_pieces(&file, &got.ranges)
                .iter()
                .map(|&i| file.piece_range(i))
                .map(|r| r.end - r.start)
                .sum();
            assert_eq!(sent, covered, "{what} rank {rank}: bytes sent");
            fetched.push(sent);
            paths.push(dest);
        }
        let total = bytes.len() as u64;
        eprintln!("{what}: ranks fetched {fetched:?} of {total} bytes");
        if make_plan == 0 {
            // Pipeline stages split the layers: each fetches well under the whole.
            assert!(
                fetched.iter().all(|&f| f < total * 3 / 4),
                "{what}: {fetched:?} of {total}"
            );
        } else {
            assert!(
                fetched.iter().all(|&f| f < total),
                "{what}: {fetched:?} of {total}"
            );
        }
        // The sparse files compute exactly what the whole file computes.
        let plan = {
            let (cfg, unit) = crate::engine::sharded::PodModel::ffn_unit(&whole).unwrap();
            if make_plan == 0 {
                PodPlan::pipeline(&cfg, &[1.0, 1.0]).unwrap()
            } else {
                PodPlan::tensor(&cfg, unit, &[1.0, 1.0]).unwrap()
            }
        };
        let prompt = [3u32, 7, 11, 5, 9];
        let from_shards = pod_greedy(&paths, &plan, &prompt, 4);
        let from_whole = pod_greedy(&[whole.clone(), whole.clone()], &plan, &prompt, 4);
        assert_eq!(
            from_shards, from_whole,
            "{what}: sparse shards differ from the whole file"
        );
    }
}
