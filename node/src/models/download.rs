//! Fetching model files over HTTP(S): several mirrors with fail-over,
//! HTTP Range to resume after a cut, SHA-256 computed while streaming.
//!
//! [`Downloader::fetch`] fills a partial file until it holds the whole file
//! and its digest is the catalogue's, then syncs it to disk; the caller
//! renames it into place. [`Downloader::fetch_pieces`] fetches only some
//! pieces of a file (a pod member's shard) into a sparse file, each piece
//! checked against its own digest.
//!
//! The client is reqwest on rustls 0.23 with the ring provider (the one the
//! QUIC link uses) and the operating system's certificate verifier
//! (`rustls-platform-verifier`: the keychain on macOS).
//!
//! # Invariants
//! - Bytes are appended to the partial file only in order, and the running
//!   hash covers exactly the bytes in it; a partial file found on start is
//!   hashed first, so a resume across restarts is checked like one in
//!   process.
//! - Nothing is reported done unless the whole-file digest (or, for pieces,
//!   each piece's digest) matches. A mismatch deletes the bytes: the next
//!   mirror starts from zero.
//!
//! # Failure
//! Per mirror, what is retried and what moves on:
//! - a cut connection, a short body, 5xx or 429: retried on the same
//!   mirror, resuming from the last byte; [`DownloadConfig::retries`]
//!   failures in a row without new bytes move on to the next mirror;
//! - 404, 403, 410, 416 and other 4xx, a `Content-Range` that does not
//!   start where asked, more bytes than the file has, or a digest mismatch:
//!   the next mirror at once.
//!
//! When every mirror failed, [`DownloadError::AllMirrorsFailed`] lists each
//! mirror with why.

use std::{
    io::{Read, Seek, SeekFrom, Write},
    ops::Range,
    path::{Path, PathBuf},
    sync::Arc,
    time::Duration,
};

use mlxnet_proto::catalogue::ModelFile;
use reqwest::{header, StatusCode};
use sha2::{Digest, Sha256};

use super::progress::Progress;

/// How the downloader behaves.
#[derive(Debug, Clone)]
pub struct DownloadConfig {
    /// Failures in a row without a new byte before a mirror is given up.
    pub retries: u32,
    /// Wait before retry `n` (multiplied by `n`).
    pub backoff: Duration,
    /// Limit on connecting to a mirror.
    pub connect_timeout: Duration,
    /// A mirror that sends nothing for this long is treated as a cut.
    pub read_timeout: Duration,
}

impl Default for DownloadConfig {
    fn default() -> Self {
        DownloadConfig {
            retries: 4,
            backoff: Duration::from_millis(500),
            connect_timeout: Duration::from_secs(15),
            read_timeout: Duration::from_secs(60),
        }
    }
}

/// Why a file could not be fetched.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum DownloadError {
    #[error("{file}: no mirror to fetch it from (the catalogue lists none; pass --mirror)")]
    NoMirrors { file: String },
    #[error("{file}: every mirror failed: {}", .failures.iter().map(|(u, r)| format!("{u}: {r}")).collect::<Vec<_>>().join("; "))]
    AllMirrorsFailed {
        file: String,
        /// Each mirror tried, with why it was given up.
        failures: Vec<(String, String)>,
    },
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("cannot set up the HTTP client: {0}")]
    Client(String),
}

fn io_err(path: &Path) -> impl Fn(std::io::Error) -> DownloadError + '_ {
    move |source| DownloadError::Io {
        path: path.to_owned(),
        source,
    }
}

/// What one attempt on a mirror came to.
enum Attempt {
    /// The file (or the range) is complete.
    Done,
    /// Worth another try on the same mirror (a cut, 5xx).
    Retry(String),
    /// Give this mirror up.
    Bad(String),
    /// The mirror answered a resume with the whole file (200): it ignores
    /// HTTP Range.
    IgnoresRange,
}

/// An HTTP client for model files.
#[derive(Debug, Clone)]
pub struct Downloader {
    client: reqwest::Client,
    config: DownloadConfig,
}

/// The file being filled, with its running hash.
struct Partial {
    path: PathBuf,
    file: std::fs::File,
    have: u64,
    hasher: Sha256,
}

impl Partial {
    /// Opens (or creates) `path`, hashing what it already holds. A file
    /// longer than `size` cannot be a prefix: it is emptied.
    fn open(path: &Path, size: u64) -> Result<Partial, DownloadError> {
        let mut file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .open(path)
            .map_err(io_err(path))?;
        let len = file.metadata().map_err(io_err(path))?.len();
        let mut hasher = Sha256::new();
        let mut have = 0;
        if len > size {
            file.set_len(0).map_err(io_err(path))?;
        } else {
            let mut buf = vec![0u8; 1 << 20];
            loop {
                let n = match file.read(&mut buf) {
                    Ok(0) => break,
                    Ok(n) => n,
                    Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                    Err(e) => return Err(io_err(path)(e)),
                };
                hasher.update(&buf[..n]);
                have += n as u64;
            }
        }
        Ok(Partial {
            path: path.to_owned(),
            file,
            have,
            hasher,
        })
    }

    fn restart(&mut self) -> Result<(), DownloadError> {
        self.file.set_len(0).map_err(io_err(&self.path))?;
        self.file
            .seek(SeekFrom::Start(0))
            .map_err(io_err(&self.path))?;
        self.have = 0;
        self.hasher = Sha256::new();
        Ok(())
    }

    fn append(&mut self, bytes: &[u8]) -> Result<(), DownloadError> {
        self.file
            .seek(SeekFrom::Start(self.have))
            .map_err(io_err(&self.path))?;
        self.file.write_all(bytes).map_err(io_err(&self.path))?;
        self.hasher.update(bytes);
        self.have += bytes.len() as u64;
        Ok(())
    }
}

/// `BASE` + `/name` (a mirror given as a folder URL).
pub fn mirror_url(base: &str, name: &str) -> String {
    if base.ends_with('/') {
        format!("{base}{name}")
    } else {
        format!("{base}/{name}")
    }
}

/// The start, end (inclusive) and total of a `Content-Range: bytes a-b/n`.
fn content_range(v: &header::HeaderValue) -> Option<(u64, u64, Option<u64>)> {
    let s = v.to_str().ok()?.strip_prefix("bytes ")?;
    let (range, total) = s.split_once('/')?;
    let (a, b) = range.split_once('-')?;
    let total = if total == "*" {
        None
    } else {
        Some(total.parse().ok()?)
    };
    Some((a.parse().ok()?, b.parse().ok()?, total))
}

/// Writes everything to disk (data and size) before a rename makes it visible.
pub fn sync_file(path: &Path) -> std::io::Result<()> {
    std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(path)?
        .sync_all()
}

/// Makes a rename inside `dir` durable.
pub fn sync_dir(dir: &Path) -> std::io::Result<()> {
    // Directories cannot be fsynced on every platform; where they cannot,
    // a rename is as durable as the platform makes it.
    match std::fs::File::open(dir) {
        Ok(d) => d.sync_all().or(Ok(())),
        Err(e) => Err(e),
    }
}

impl Downloader {
    /// A client with the system's certificate verifier over rustls/ring.
    pub fn new(config: DownloadConfig) -> Result<Downloader, DownloadError> {
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let verifier = rustls_platform_verifier::Verifier::new(provider.clone())
            .map_err(|e| DownloadError::Client(e.to_string()))?;
        let mut tls = rustls::ClientConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .map_err(|e| DownloadError::Client(e.to_string()))?
            .dangerous()
            .with_custom_certificate_verifier(Arc::new(verifier))
            .with_no_client_auth();
        tls.alpn_protocols = vec![b"http/1.1".to_vec()];
        let client = reqwest::Client::builder()
            .tls_backend_preconfigured(tls)
            .connect_timeout(config.connect_timeout)
            .read_timeout(config.read_timeout)
            .user_agent(concat!("mlx-node/", env!("CARGO_PKG_VERSION")))
            .build()
            .map_err(|e| DownloadError::Client(e.to_string()))?;
        Ok(Downloader { client, config })
    }

    /// Fills `partial` with `file` from `mirrors` (tried in order; a partial
    /// file already there is resumed), checks the whole-file digest and
    /// syncs it. On success the partial file is the file.
    pub async fn fetch(
        &self,
        file: &ModelFile,
        mirrors: &[String],
        partial: &Path,
        progress: &mut dyn Progress,
    ) -> Result<(), DownloadError> {
        if mirrors.is_empty() {
            return Err(DownloadError::NoMirrors {
                file: file.name.clone(),
            });
        }
        let want = file.digest();
        let path = partial.to_owned();
        let size = file.size_bytes;
        let mut part = tokio::task::spawn_blocking(move || Partial::open(&path, size))
            .await
            .map_err(|e| DownloadError::Client(e.to_string()))??;
        progress.start(&file.name, file.size_bytes, part.have);
        let mut failures = Vec::new();
        for url in mirrors {
            match self.fill(&mut part, url, file.size_bytes, progress).await? {
                Ok(()) => {
                    let got: [u8; 32] = part.hasher.clone().finalize().into();
                    if got == want {
                        part.file.sync_all().map_err(io_err(partial))?;
                        progress.finish(true);
                        return Ok(());
                    }
                    let reason = format!(
                        "digest mismatch: got sha256 {}, want {}",
                        hex::encode(got),
                        file.sha256
                    );
                    progress.note(&format!(
                        "{url}: {reason}; starting over on the next mirror"
                    ));
                    tracing::warn!(file = %file.name, %url, %reason, "mirror served corrupt bytes");
                    part.restart()?;
                    progress.advance(0);
                    failures.push((url.clone(), reason));
                }
                Err(reason) => {
                    progress.note(&format!("{url}: {reason}"));
                    tracing::warn!(file = %file.name, %url, %reason, "mirror failed");
                    failures.push((url.clone(), reason));
                }
            }
        }
        progress.finish(false);
        if part.have == 0 {
            // Nothing worth resuming (every byte was refused): leave no file.
            drop(part);
            let _ = std::fs::remove_file(partial);
        }
        Err(DownloadError::AllMirrorsFailed {
            file: file.name.clone(),
            failures,
        })
    }

    /// Appends to `part` from `url` until it holds `size` bytes: `Ok(())`,
    /// or why this mirror was given up.
    async fn fill(
        &self,
        part: &mut Partial,
        url: &str,
        size: u64,
        progress: &mut dyn Progress,
    ) -> Result<Result<(), String>, DownloadError> {
        let mut fails = 0;
        loop {
            if part.have == size {
                return Ok(Ok(()));
            }
            let before = part.have;
            let attempt = self
                .attempt(url, before..size, size, progress, &mut |bytes| {
                    part.append(bytes)
                })
                .await?;
            match attempt {
                Attempt::Done => return Ok(Ok(())),
                Attempt::Bad(reason) => return Ok(Err(reason)),
                Attempt::IgnoresRange => {
                    // Start over from byte 0 on this mirror, once.
                    fails += 1;
                    if fails > self.config.retries {
                        return Ok(Err("ignores HTTP Range".into()));
                    }
                    tracing::info!(%url, "mirror ignores HTTP Range: starting over");
                    part.restart()?;
                    progress.advance(0);
                }
                Attempt::Retry(reason) => {
                    // Progress resets the count: a mirror that cuts often
                    // but moves on is still worth following.
                    fails = if part.have > before { 1 } else { fails + 1 };
                    if fails > self.config.retries {
                        return Ok(Err(format!("{reason} ({fails} tries without progress)")));
                    }
                    tracing::info!(%url, %reason, resume_at = part.have, "retrying");
                    tokio::time::sleep(self.config.backoff * fails).await;
                }
            }
        }
    }

    /// One request for bytes `range` of a file of `size` bytes; each chunk
    /// of the body goes to `sink` in order. A 200 answer to a request that
    /// did not start at 0 means the mirror ignores ranges: it is `Bad` here
    /// unless `range.start == 0` (a caller that can restart asks again from 0).
    async fn attempt(
        &self,
        url: &str,
        range: Range<u64>,
        size: u64,
        progress: &mut dyn Progress,
        sink: &mut (dyn FnMut(&[u8]) -> Result<(), DownloadError> + Send),
    ) -> Result<Attempt, DownloadError> {
        let whole = range.start == 0 && range.end == size;
        let mut req = self.client.get(url);
        if !whole {
            req = req.header(
                header::RANGE,
                format!("bytes={}-{}", range.start, range.end - 1),
            );
        }
        let mut resp = match req.send().await {
            Ok(r) => r,
            Err(e) => {
                return Ok(Attempt::Retry(format!(
                    "request failed: {}",
                    error_chain(&e)
                )))
            }
        };
        let status = resp.status();
        match status {
            StatusCode::PARTIAL_CONTENT => {
                let cr = resp
                    .headers()
                    .get(header::CONTENT_RANGE)
                    .and_then(content_range);
                match cr {
                    Some((a, b, total))
                        if a == range.start && b < range.end && total.is_none_or(|t| t == size) => {
                    }
                    _ => {
                        return Ok(Attempt::Bad(format!(
                            "answered bytes {:?} to a request for {}-{}",
                            resp.headers().get(header::CONTENT_RANGE),
                            range.start,
                            range.end - 1
                        )))
                    }
                }
            }
            StatusCode::OK if range.start == 0 => {
                if resp.content_length().is_some_and(|l| l != size) {
                    return Ok(Attempt::Bad(format!(
                        "serves {} bytes, the file has {size}",
                        resp.content_length().unwrap_or_default()
                    )));
                }
            }
            StatusCode::OK => return Ok(Attempt::IgnoresRange),
            s if s.is_server_error() || s == StatusCode::TOO_MANY_REQUESTS => {
                return Ok(Attempt::Retry(format!("answered {s}")))
            }
            s => return Ok(Attempt::Bad(format!("answered {s}"))),
        }
        let mut at = range.start;
        loop {
            match resp.chunk().await {
                Ok(Some(bytes)) => {
                    if at + bytes.len() as u64 > range.end {
                        return Ok(Attempt::Bad(format!(
                            "sent more than the {} bytes asked for",
                            range.end - range.start
                        )));
                    }
                    sink(&bytes)?;
                    at += bytes.len() as u64;
                    progress.advance(at);
                }
                Ok(None) if at == range.end => return Ok(Attempt::Done),
                Ok(None) => {
                    return Ok(Attempt::Retry(format!(
                        "connection closed at byte {at} of {}",
                        range.end
                    )))
                }
                Err(e) => {
                    return Ok(Attempt::Retry(format!(
                        "cut at byte {at}: {}",
                        error_chain(&e)
                    )))
                }
            }
        }
    }

    /// Fetches only pieces `pieces` of `file` (indices into its piece
    /// digests) into `dest`, a sparse file of the file's full size: pieces
    /// already there with the right digest are kept, each fetched piece is
    /// checked against its digest before the next. `dest` then holds every
    /// byte of those pieces at its offset and zeros elsewhere.
    pub async fn fetch_pieces(
        &self,
        file: &ModelFile,
        mirrors: &[String],
        pieces: &[usize],
        dest: &Path,
        progress: &mut dyn Progress,
    ) -> Result<(), DownloadError> {
        if mirrors.is_empty() {
            return Err(DownloadError::NoMirrors {
                file: file.name.clone(),
            });
        }
        let mut out = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .open(dest)
            .map_err(io_err(dest))?;
        out.set_len(file.size_bytes).map_err(io_err(dest))?;
        let total: u64 = pieces
            .iter()
            .map(|&i| file.piece_range(i))
            .map(|r| r.end - r.start)
            .sum();
        progress.start(&file.name, total, 0);
        let mut done = 0u64;
        let mut failures: Vec<(String, String)> = Vec::new();
        for &i in pieces {
            let range = file.piece_range(i);
            let want = file
                .piece_digest(i)
                .ok_or_else(|| DownloadError::AllMirrorsFailed {
                    file: file.name.clone(),
                    failures: vec![(
                        String::new(),
                        format!("the catalogue has no digest for piece {i}"),
                    )],
                })?;
            if read_digest(&mut out, &range).map_err(io_err(dest))? == want {
                done += range.end - range.start;
                progress.advance(done);
                continue;
            }
            let mut ok = false;
            for url in mirrors {
                if failures.iter().any(|(u, _)| u == url) {
                    continue;
                }
                match self
                    .fetch_range(
                        url,
                        &range,
                        file.size_bytes,
                        &want,
                        &mut out,
                        dest,
                        done,
                        progress,
                    )
                    .await?
                {
                    Ok(()) => {
                        ok = true;
                        break;
                    }
                    Err(reason) => {
                        progress.note(&format!("{url}: {reason}"));
                        tracing::warn!(file = %file.name, %url, piece = i, %reason, "mirror failed");
                        failures.push((url.clone(), reason));
                    }
                }
            }
            if !ok {
                progress.finish(false);
                return Err(DownloadError::AllMirrorsFailed {
                    file: file.name.clone(),
                    failures,
                });
            }
            done += range.end - range.start;
            progress.advance(done);
        }
        out.sync_all().map_err(io_err(dest))?;
        progress.finish(true);
        Ok(())
    }

    /// One piece from one mirror, retried on cuts, checked against `want`.
    #[allow(clippy::too_many_arguments)]
    async fn fetch_range(
        &self,
        url: &str,
        range: &Range<u64>,
        size: u64,
        want: &[u8; 32],
        out: &mut std::fs::File,
        dest: &Path,
        done: u64,
        progress: &mut dyn Progress,
    ) -> Result<Result<(), String>, DownloadError> {
        let mut fails = 0;
        let mut at = range.start;
        let mut hasher = Sha256::new();
        loop {
            let before = at;
            let mut shifted = Shifted {
                inner: &mut *progress,
                by: done,
                base: range.start,
            };
            let attempt = self
                .attempt(url, at..range.end, size, &mut shifted, &mut |bytes| {
                    out.seek(SeekFrom::Start(at)).map_err(io_err(dest))?;
                    out.write_all(bytes).map_err(io_err(dest))?;
                    hasher.update(bytes);
                    at += bytes.len() as u64;
                    Ok(())
                })
                .await?;
            match attempt {
                Attempt::Done => {
                    let got: [u8; 32] = hasher.finalize().into();
                    return Ok(if &got == want {
                        Ok(())
                    } else {
                        Err(format!(
                            "digest mismatch on bytes {}..{}",
                            range.start, range.end
                        ))
                    });
                }
                Attempt::Bad(reason) => return Ok(Err(reason)),
                Attempt::IgnoresRange => return Ok(Err("ignores HTTP Range".into())),
                Attempt::Retry(reason) => {
                    fails = if at > before { 1 } else { fails + 1 };
                    if fails > self.config.retries {
                        return Ok(Err(format!("{reason} ({fails} tries without progress)")));
                    }
                    tokio::time::sleep(self.config.backoff * fails).await;
                }
            }
        }
    }
}

/// Reports a piece's byte offsets as progress over all pieces.
struct Shifted<'a> {
    inner: &'a mut dyn Progress,
    by: u64,
    base: u64,
}

impl Progress for Shifted<'_> {
    fn start(&mut self, file: &str, total: u64, have: u64) {
        self.inner.start(file, total, have)
    }
    fn advance(&mut self, have: u64) {
        self.inner.advance(self.by + have.saturating_sub(self.base))
    }
    fn note(&mut self, msg: &str) {
        self.inner.note(msg)
    }
    fn finish(&mut self, ok: bool) {
        self.inner.finish(ok)
    }
}

/// SHA-256 of bytes `range` of `f`.
fn read_digest(f: &mut std::fs::File, range: &Range<u64>) -> std::io::Result<[u8; 32]> {
    f.seek(SeekFrom::Start(range.start))?;
    let mut left = range.end - range.start;
    let mut hasher = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    while left > 0 {
        let n = f.read(&mut buf[..left.min(1 << 20) as usize])?;
        if n == 0 {
            break;
        }
        hasher.update(&buf[..n]);
        left -= n as u64;
    }
    Ok(hasher.finalize().into())
}

/// An error with its sources, on one line.
fn error_chain(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut src = e.source();
    while let Some(inner) = src {
        s.push_str(": ");
        s.push_str(&inner.to_string());
        src = inner.source();
    }
    s
}
