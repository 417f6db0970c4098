//! A model mirror: the files of one folder over plain HTTP with Range, as a
//! catalogue mirror serves them (tests, and the devnet's `--mirror-addr`).
//!
//! `GET /<file name>` answers 200 with the file, or 206 with the bytes of a
//! `Range: bytes=a-b` / `bytes=a-` request (416 when it starts past the
//! end); names with a directory part are 404. It counts the body bytes it
//! sends, so a test can tell what a client fetched.

use std::{
    net::SocketAddr,
    path::PathBuf,
    sync::{
        atomic::{AtomicU64, Ordering},
        Arc,
    },
};

use axum::{
    body::Body,
    extract::{Path as UrlPath, State},
    http::{header, HeaderMap, StatusCode},
    response::Response,
    routing::get,
    Router,
};
use tokio::io::{AsyncReadExt, AsyncSeekExt};

/// A running mirror.
pub struct Mirror {
    pub addr: SocketAddr,
    sent: Arc<AtomicU64>,
    task: tokio::task::JoinHandle<()>,
}

impl Mirror {
    /// The folder URL to pass as `--mirror` (file names are appended).
    pub fn base_url(&self) -> String {
        format!("http://{}/", self.addr)
    }

    /// Body bytes sent so far, all requests.
    pub fn bytes_sent(&self) -> u64 {
        self.sent.load(Ordering::SeqCst)
    }
}

impl Drop for Mirror {
    fn drop(&mut self) {
        self.task.abort();
    }
}

struct Served {
    dir: PathBuf,
    sent: Arc<AtomicU64>,
}

fn status(s: StatusCode) -> Response {
    let mut r = Response::new(Body::empty());
    *r.status_mut() = s;
    r
}

async fn serve(
    State(st): State<Arc<Served>>,
    UrlPath(name): UrlPath<String>,
    headers: HeaderMap,
) -> Response {
    if !mlxnet_proto::catalogue::is_plain_file_name(&name) {
        return status(StatusCode::NOT_FOUND);
    }
    let path = st.dir.join(&name);
    let Ok(mut file) = tokio::fs::File::open(&path).await else {
        return status(StatusCode::NOT_FOUND);
    };
    let Ok(len) = file.metadata().await.map(|m| m.len()) else {
        return status(StatusCode::INTERNAL_SERVER_ERROR);
    };
    let range = headers
        .get(header::RANGE)
        .and_then(|v| v.to_str().ok())
        .and_then(|r| r.strip_prefix("bytes="))
        .and_then(|r| r.split_once('-'))
        .map(|(a, b)| (a.parse::<u64>().ok(), b.parse::<u64>().ok()));
    let (start, end, partial) = match range {
        None => (0, len, false),
        Some((Some(a), b)) => {
            if a >= len {
                return status(StatusCode::RANGE_NOT_SATISFIABLE);
            }
            (a, b.map_or(len, |b| (b + 1).min(len)), true)
        }
        Some((None, _)) => return status(StatusCode::RANGE_NOT_SATISFIABLE),
    };
    if file.seek(std::io::SeekFrom::Start(start)).await.is_err() {
        return status(StatusCode::INTERNAL_SERVER_ERROR);
    }
    let sent = st.sent.clone();
    let body = futures::stream::unfold(
        (file.take(end - start), sent),
        |(mut reader, sent)| async move {
            let mut buf = vec![0u8; 64 << 10];
            match reader.read(&mut buf).await {
                Ok(0) => None,
                Ok(n) => {
                    buf.truncate(n);
                    sent.fetch_add(n as u64, Ordering::SeqCst);
                    Some((Ok::<_, std::io::Error>(buf), (reader, sent)))
                }
                Err(e) => Some((Err(e), (reader, sent))),
            }
        },
    );
    let mut resp = Response::builder()
        .header(header::CONTENT_LENGTH, end - start)
        .header(header::ACCEPT_RANGES, "bytes");
    if partial {
        resp = resp.status(StatusCode::PARTIAL_CONTENT).header(
            header::CONTENT_RANGE,
            format!("bytes {start}-{}/{len}", end - 1),
        );
    }
    resp.body(Body::from_stream(body))
        .unwrap_or_else(|_| status(StatusCode::INTERNAL_SERVER_ERROR))
}

/// Serves the files of `dir` on `listener` until the mirror is dropped.
pub fn serve_dir(dir: PathBuf, listener: tokio::net::TcpListener) -> anyhow::Result<Mirror> {
    let addr = listener.local_addr()?;
    let sent = Arc::new(AtomicU64::new(0));
    let app = Router::new()
        .route("/{name}", get(serve))
        .with_state(Arc::new(Served {
            dir,
            sent: sent.clone(),
        }));
    let task = tokio::spawn(async move {
        if let Err(e) = axum::serve(listener, app).await {
            tracing::warn!(error = %e, "model mirror stopped");
        }
    });
    Ok(Mirror { addr, sent, task })
}

/// A mirror of `dir` on a port the OS chose.
pub async fn spawn_mirror(dir: PathBuf) -> anyhow::Result<Mirror> {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    serve_dir(dir, listener)
}
