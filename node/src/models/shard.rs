//! A pod member's fetch of only its share of a model file.
//!
//! A member of a pod loads only some tensors of the GGUF file (its layers,
//! or its rows of each matrix), so it fetches only the catalogue pieces that
//! hold them: first the pieces of the header (read until the GGUF header
//! parses), then, from the tensor offsets in that header and the pod's plan,
//! the pieces covering the byte ranges its share reads
//! ([`crate::engine::sharded::shard_byte_ranges`]). The result is a sparse
//! file of the full size: the fetched pieces at their offsets, zeros
//! elsewhere, which the member loads like the whole file.
//!
//! # Invariants
//! - Every byte in the file came from a piece whose SHA-256 matched the
//!   catalogue's (whole-file digests cannot be checked without every byte).
//!
//! # Failure
//! [`ShardError`]: the catalogue has no piece digests for the file, a
//! download failed, or the header is not a GGUF model the pod can split.

use std::{io::Read, ops::Range, path::Path};

use mlxnet_proto::catalogue::ModelFile;

use super::download::{DownloadError, Downloader};
use super::progress::Progress;
use crate::engine::config::ModelConfig;
use crate::engine::sharded::{self, PodModelError, PodPlan};

/// Why a shard could not be fetched.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ShardError {
    #[error("{0}: the catalogue gives no piece digests, so a share of it cannot be checked; fetch the whole file")]
    NoPieces(String),
    #[error(transparent)]
    Download(#[from] DownloadError),
    #[error("the model's header: {0}")]
    Model(#[from] PodModelError),
    #[error("{path}: {source}")]
    Io {
        path: std::path::PathBuf,
        source: std::io::Error,
    },
}

/// What a shard fetch read.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ShardFetch {
    /// The byte ranges the member's share reads.
    pub ranges: Vec<Range<u64>>,
    /// The pieces fetched (or found intact) to cover them, header included.
    pub pieces: Vec<usize>,
}

/// The pieces of `file` that cover `ranges`.
pub fn covering_pieces(file: &ModelFile, ranges: &[Range<u64>]) -> Vec<usize> {
    let mut out: Vec<usize> = Vec::new();
    if file.piece_bytes == 0 {
        return out;
    }
    for r in ranges.iter().filter(|r| r.end > r.start) {
        let first = (r.start / file.piece_bytes) as usize;
        let last = ((r.end - 1) / file.piece_bytes) as usize;
        for p in first..=last {
            if out.last() != Some(&p) && !out.contains(&p) {
                out.push(p);
            }
        }
    }
    out.sort_unstable();
    out
}

/// Fetches rank `rank`'s share of `file` into `dest` (see the module doc);
/// `plan` is given the model's config and feed-forward cut unit from the
/// header and returns the pod's plan.
pub async fn fetch_shard(
    downloader: &Downloader,
    file: &ModelFile,
    mirrors: &[String],
    dest: &Path,
    rank: usize,
    plan: impl FnOnce(&ModelConfig, usize) -> Result<PodPlan, PodModelError>,
    progress: &mut dyn Progress,
) -> Result<ShardFetch, ShardError> {
    if file.pieces.is_empty() {
        return Err(ShardError::NoPieces(file.name.clone()));
    }
    let io = |source| ShardError::Io {
        path: dest.to_owned(),
        source,
    };
    let mut header_pieces = Vec::new();
    let (cfg, prefix) = loop {
        let next = header_pieces.len();
        if next >= file.pieces.len() {
            return Err(PodModelError::Plan("the file ends inside its header".into()).into());
        }
        header_pieces.push(next);
        downloader
            .fetch_pieces(file, mirrors, &header_pieces, dest, progress)
            .await?;
        let end = file.piece_range(next).end as usize;
        let mut prefix = vec![0u8; end];
        std::fs::File::open(dest)
            .and_then(|mut f| f.read_exact(&mut prefix))
            .map_err(io)?;
        if let Some(cfg) = sharded::header_config(&prefix)? {
            break (cfg, prefix);
        }
    };
    let plan = plan(&cfg.0, cfg.1)?;
    let ranges = sharded::shard_byte_ranges(&prefix, &plan, rank)?;
    let pieces = covering_pieces(file, &ranges);
    downloader
        .fetch_pieces(file, mirrors, &pieces, dest, progress)
        .await?;
    Ok(ShardFetch { ranges, pieces })
}
