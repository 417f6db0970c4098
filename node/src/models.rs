//! The model files this node holds, identified by the SHA-256 of the file,
//! and the loaded engine for each.
//!
//! On start every configured file is hashed (streaming, 1 MiB at a time) and
//! reported to the coordinator as a `CachedModel`; then one [`Engine`] per
//! model is loaded. A job names a catalogue id and the digest the catalogue
//! expects; the node runs it only on a file it holds with exactly that
//! digest, so a job can make the node read or run nothing else.
//!
//! # Invariants
//! - The digest reported is the digest of the bytes the engine loaded (both
//!   happen at build time; the file is not re-read per job).
//! - Each model's engine runs on its own batch thread
//!   ([`crate::engine::batch::BatchThread`]): the jobs for one model share
//!   one pass per step over a KV pool of their own, and different models
//!   run side by side.
//!
//! # Failure
//! A missing or unreadable file, or one the engine cannot load, is a
//! [`ModelError`] at start-up naming the model id and path. A job for a
//! model not held, or with another digest, is a [`Refusal`] (the job's
//! fault, not retried on this node).

use std::{
    collections::BTreeMap,
    io::Read,
    path::{Path, PathBuf},
    sync::Arc,
};

use mlxnet_proto::v1::CachedModel;
use sha2::{Digest, Sha256};

use crate::{
    config::ModelEntry,
    engine::{
        batch::{BatchConfig, BatchStats, BatchThread},
        device::Backend,
        Engine, EngineError, ModelInfo,
    },
};

/// Why the configured models could not be made ready.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ModelError {
    #[error("model {id}: cannot read {path}: {source}")]
    Read {
        id: String,
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("model {id}: cannot load {path}: {source}")]
    Load {
        id: String,
        path: PathBuf,
        source: Box<EngineError>,
    },
}

/// Why a job's model request is refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum Refusal {
    #[error("model {0:?} is not held by this node")]
    NotHeld(String),
    #[error("model {model}: job wants sha256 {wanted}, this node holds {held}")]
    DigestMismatch {
        model: String,
        wanted: String,
        held: String,
    },
}

/// A model file and its identity.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HeldModel {
    pub id: String,
    pub path: PathBuf,
    pub sha256: [u8; 32],
    pub size_bytes: u64,
}

impl HeldModel {
    /// Hashes the file named by `entry`.
    pub fn hash(entry: &ModelEntry) -> Result<Self, ModelError> {
        let (sha256, size_bytes) = digest_file(&entry.path).map_err(|source| ModelError::Read {
            id: entry.id.clone(),
            path: entry.path.clone(),
            source,
        })?;
        Ok(Self {
            id: entry.id.clone(),
            path: entry.path.clone(),
            sha256,
            size_bytes,
        })
    }

    /// As reported in `Hello`.
    pub fn cached(&self) -> CachedModel {
        CachedModel {
            model: self.id.clone(),
            sha256: self.sha256.to_vec(),
            size_bytes: self.size_bytes,
        }
    }

    /// Checks that a job's wanted digest is this file's.
    pub fn check_digest(&self, wanted: &[u8]) -> Result<(), Refusal> {
        if wanted == self.sha256 {
            Ok(())
        } else {
            Err(Refusal::DigestMismatch {
                model: self.id.clone(),
                wanted: hex::encode(wanted),
                held: hex::encode(self.sha256),
            })
        }
    }
}

/// SHA-256 and size of a file, read in 1 MiB blocks.
pub fn digest_file(path: &Path) -> std::io::Result<([u8; 32], u64)> {
    let mut file = std::fs::File::open(path)?;
    if !file.metadata()?.is_file() {
        return Err(std::io::Error::other("not a regular file"));
    }
    let mut hasher = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    let mut size = 0u64;
    loop {
        let n = match file.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(e),
        };
        hasher.update(&buf[..n]);
        size += n as u64;
    }
    Ok((hasher.finalize().into(), size))
}

/// A held model with its loaded engine.
pub struct LoadedModel {
    pub held: HeldModel,
    pub info: ModelInfo,
    /// Where its engine computes ("cpu", "metal", "cuda", "candle-cpu").
    pub backend: &'static str,
    /// The engine, batching every job and audit of this model.
    pub batch: BatchThread,
    /// Positions its KV pool holds (the longest job it can run, and what
    /// all its running jobs share).
    pub kv_positions: usize,
}

/// How each model's batch is sized.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BatchSettings {
    /// Sequences one step of a model runs.
    pub slots: usize,
    /// Memory for the KV pools of all models together (split evenly).
    pub kv_cache_bytes: u64,
}

/// Every model the node serves, by catalogue id.
#[derive(Default)]
pub struct ModelSet {
    by_id: BTreeMap<String, Arc<LoadedModel>>,
}

impl ModelSet {
    /// Hashes every file, then loads one engine per model. Blocking (reads
    /// whole files). All files are hashed before any is loaded, so a missing
    /// file is reported at once.
    pub fn load(entries: &[ModelEntry], batch: BatchSettings) -> Result<Self, ModelError> {
        Self::load_on(entries, batch, &Backend::Native)
    }

    /// [`ModelSet::load`] with every engine on `backend`.
    pub fn load_on(
        entries: &[ModelEntry],
        batch: BatchSettings,
        backend: &Backend,
    ) -> Result<Self, ModelError> {
        let held = entries
            .iter()
            .map(HeldModel::hash)
            .collect::<Result<Vec<_>, _>>()?;
        let kv_bytes = batch.kv_cache_bytes / held.len().max(1) as u64;
        let mut by_id = BTreeMap::new();
        for held in held {
            tracing::info!(model = %held.id, path = %held.path.display(), sha256 = %hex::encode(held.sha256), backend = backend.name(), "loading model");
            let failed = |source: EngineError| ModelError::Load {
                id: held.id.clone(),
                path: held.path.clone(),
                source: Box::new(source),
            };
            let engine = Engine::load_on(&held.path, backend).map_err(failed)?;
            let info = engine.info().clone();
            let backend = engine.backend();
            let cfg = BatchConfig::new(batch.slots, engine.kv_shape(), kv_bytes);
            let kv_positions = cfg.kv_pages * crate::engine::kv::PAGE;
            let batch = BatchThread::for_engine(engine, cfg).map_err(failed)?;
            tracing::info!(model = %held.id, slots = batch.stats().slots, kv_positions, "batch ready");
            by_id.insert(
                held.id.clone(),
                Arc::new(LoadedModel {
                    held,
                    info,
                    backend,
                    batch,
                    kv_positions,
                }),
            );
        }
        Ok(Self { by_id })
    }

    /// Each model's batch, as of its last step.
    pub fn batch_stats(&self) -> Vec<(String, BatchStats)> {
        self.by_id
            .iter()
            .map(|(id, m)| (id.clone(), m.batch.stats()))
            .collect()
    }

    /// The most sequences any model's batch runs at once (`None` without
    /// models).
    pub fn slots(&self) -> Option<usize> {
        self.by_id.values().map(|m| m.batch.stats().slots).max()
    }

    /// The fewest KV positions any model's pool holds (0 without models).
    pub fn kv_positions(&self) -> usize {
        self.by_id
            .values()
            .map(|m| m.kv_positions)
            .min()
            .unwrap_or(0)
    }

    /// What `Hello` reports.
    pub fn cached_models(&self) -> Vec<CachedModel> {
        self.by_id.values().map(|m| m.held.cached()).collect()
    }

    /// The model a job may run on: held, with exactly the digest it wants.
    pub fn resolve(&self, model: &str, sha256: &[u8]) -> Result<Arc<LoadedModel>, Refusal> {
        let loaded = self
            .by_id
            .get(model)
            .ok_or_else(|| Refusal::NotHeld(model.to_owned()))?;
        loaded.held.check_digest(sha256)?;
        Ok(loaded.clone())
    }

    /// Every model, by catalogue id.
    pub fn iter(&self) -> impl Iterator<Item = &Arc<LoadedModel>> {
        self.by_id.values()
    }

    pub fn len(&self) -> usize {
        self.by_id.len()
    }

    pub fn is_empty(&self) -> bool {
        self.by_id.is_empty()
    }
}

/// A small batch for tests: 4 slots, 64 MiB of KV cache.
#[cfg(test)]
pub(crate) const TEST_BATCH: BatchSettings = BatchSettings {
    slots: 4,
    kv_cache_bytes: 64 << 20,
};

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn files_are_hashed_by_content_and_size() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("m.gguf");
        // Over one read block, so streaming across blocks is exercised.
        let data: Vec<u8> = (0..(3 << 20) + 17).map(|i| (i % 251) as u8).collect();
        std::fs::write(&path, &data).unwrap();
        let held = HeldModel::hash(&ModelEntry {
            id: "m".into(),
            path: path.clone(),
        })
        .unwrap();
        let expected: [u8; 32] = Sha256::digest(&data).into();
        assert_eq!(held.sha256, expected);
        assert_eq!(held.size_bytes, data.len() as u64);
        let cached = held.cached();
        assert_eq!(
            (cached.model.as_str(), cached.sha256.as_slice()),
            ("m", &expected[..])
        );

        held.check_digest(&expected).unwrap();
        let mut other = expected;
        other[0] ^= 1;
        let refusal = held.check_digest(&other).unwrap_err();
        assert!(matches!(refusal, Refusal::DigestMismatch { .. }));
        assert!(
            refusal.to_string().contains(&hex::encode(expected)),
            "{refusal}"
        );
        assert!(held.check_digest(&[]).is_err());
    }

    #[test]
    fn a_missing_model_file_is_a_start_up_error_naming_it() {
        let dir = tempfile::tempdir().unwrap();
        let entries = [ModelEntry {
            id: "ghost".into(),
            path: dir.path().join("ghost.gguf"),
        }];
        let err = ModelSet::load(&entries, TEST_BATCH).err().unwrap();
        let text = err.to_string();
        assert!(matches!(err, ModelError::Read { .. }), "{text}");
        assert!(
            text.contains("ghost") && text.contains("ghost.gguf"),
            "{text}"
        );
        // A directory is not a model file either.
        let err = HeldModel::hash(&ModelEntry {
            id: "dir".into(),
            path: dir.path().to_owned(),
        })
        .unwrap_err();
        assert!(matches!(err, ModelError::Read { .. }), "{err}");
    }

    #[test]
    fn the_test_model_loads_and_only_its_digest_is_accepted() {
        let path =
            Path::new(env!("CARGO_MANIFEST_DIR")).join("../models/SmolLM2-135M-Instruct.Q4_1.gguf");
        assert!(
            path.is_file(),
            "test model missing: run scripts/fetch-test-model.sh"
        );
        let set = ModelSet::load(
            &[ModelEntry {
                id: "smollm2-135m-instruct".into(),
                path,
            }],
            TEST_BATCH,
        )
        .unwrap();
        let sha = hex::decode("b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53")
            .unwrap();
        assert_eq!(set.cached_models()[0].sha256, sha);
        assert_eq!(set.cached_models()[0].size_bytes, 98_362_432);
        assert!(set.resolve("smollm2-135m-instruct", &sha).is_ok());
        assert_eq!(
            set.resolve("llama-70b", &sha).err(),
            Some(Refusal::NotHeld("llama-70b".into()))
        );
        assert!(matches!(
            set.resolve("smollm2-135m-instruct", &[0; 32]).err(),
            Some(Refusal::DigestMismatch { .. })
        ));
    }
}
