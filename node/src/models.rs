//! The model files this node holds, identified by the SHA-256 of the file,
//! and the loaded engine for each.
//!
//! # Layout
//! - this file: [`HeldModel`] (a file and its digest) and [`ModelSet`] (the
//!   engines a node serves);
//! - [`store`]: the node's model folder: catalogue models pulled within the
//!   owner's quota and rules, least recently used evicted;
//! - [`download`]: HTTP(S) fetches with mirrors, Range resume, streaming
//!   SHA-256, and piece-by-piece fetches for a pod member's shard;
//! - [`progress`]: a progress bar on a terminal, log lines in a service;
//! - [`shard`]: a pod member's fetch of only the pieces its share reads;
//! - [`hint`]: automatic pulls of models the coordinator says are in demand;
//! - [`cli`]: `mlx-node models pull|list|remove|verify|describe|available`.
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

pub mod cli;
pub mod download;
#[cfg(test)]
pub(crate) mod fetch_tests;
pub mod hint;
pub mod progress;
pub mod shard;
pub mod store;

use std::{
    collections::BTreeMap,
    io::Read,
    path::{Path, PathBuf},
    sync::{
        atomic::{AtomicBool, Ordering},
        Arc, RwLock,
    },
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
    #[error("model folder: {0}")]
    Store(Box<store::StoreError>),
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

impl LoadedModel {
    /// Hashes the file of `entry` and loads its engine on `backend` behind
    /// a batch thread with a KV pool of `kv_bytes`. Blocking.
    pub fn load(
        entry: &ModelEntry,
        backend: &Backend,
        slots: usize,
        kv_bytes: u64,
    ) -> Result<LoadedModel, ModelError> {
        let held = HeldModel::hash(entry)?;
        Self::load_held(held, backend, slots, kv_bytes)
    }

    fn load_held(
        held: HeldModel,
        backend: &Backend,
        slots: usize,
        kv_bytes: u64,
    ) -> Result<LoadedModel, ModelError> {
        tracing::info!(model = %held.id, path = %held.path.display(), sha256 = %hex::encode(held.sha256), backend = backend.name(), "loading model");
        let failed = |source: EngineError| ModelError::Load {
            id: held.id.clone(),
            path: held.path.clone(),
            source: Box::new(source),
        };
        let engine = Engine::load_on(&held.path, backend).map_err(failed)?;
        let info = engine.info().clone();
        let backend = engine.backend();
        let cfg = BatchConfig::new(slots, engine.kv_shape(), kv_bytes);
        let kv_positions = cfg.kv_pages * crate::engine::kv::PAGE;
        let batch = BatchThread::for_engine(engine, cfg).map_err(failed)?;
        tracing::info!(model = %held.id, slots = batch.stats().slots, kv_positions, "batch ready");
        Ok(LoadedModel {
            held,
            info,
            backend,
            batch,
            kv_positions,
        })
    }
}

/// Every model the node serves, by catalogue id. Models can be added (a
/// pull finished) and removed (evicted) while the node runs; a job keeps
/// the model it resolved until it ends.
#[derive(Default)]
pub struct ModelSet {
    by_id: RwLock<BTreeMap<String, Arc<LoadedModel>>>,
    /// The model folder some of them came from (told when they are used).
    store: Option<Arc<store::ModelStore>>,
    /// The set differs from what the node's Hello listed.
    changed: AtomicBool,
    /// A hinted pull is under way (one at a time).
    pulling: AtomicBool,
    /// Where its engines compute (a pulled model loads there too).
    backend: Backend,
    /// Sequences per step, and the KV pool bytes of each model (the start's
    /// share: a pulled model gets the same).
    slots: usize,
    kv_bytes_per_model: u64,
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
            let loaded = LoadedModel::load_held(held, backend, batch.slots, kv_bytes)?;
            by_id.insert(loaded.held.id.clone(), Arc::new(loaded));
        }
        Ok(Self {
            by_id: RwLock::new(by_id),
            backend: backend.clone(),
            slots: batch.slots,
            kv_bytes_per_model: kv_bytes,
            ..Self::default()
        })
    }

    fn read(&self) -> std::sync::RwLockReadGuard<'_, BTreeMap<String, Arc<LoadedModel>>> {
        self.by_id.read().unwrap_or_else(|p| p.into_inner())
    }

    fn write(&self) -> std::sync::RwLockWriteGuard<'_, BTreeMap<String, Arc<LoadedModel>>> {
        self.by_id.write().unwrap_or_else(|p| p.into_inner())
    }

    /// Adds (or replaces) a loaded model.
    pub fn insert(&self, model: LoadedModel) {
        self.write().insert(model.held.id.clone(), Arc::new(model));
        self.changed.store(true, Ordering::SeqCst);
    }

    /// Stops serving `id` (a job running on it finishes).
    pub fn remove(&self, id: &str) -> bool {
        let gone = self.write().remove(id).is_some();
        if gone {
            self.changed.store(true, Ordering::SeqCst);
        }
        gone
    }

    /// Whether the served models differ from the Hello's list.
    pub fn changed(&self) -> bool {
        self.changed.load(Ordering::SeqCst)
    }

    /// Ids of the models a job is running on now: one whose batch ran or
    /// queued a sequence at its last step, or that a job holds (a job keeps
    /// the model it resolved until it ends, before its batch sees it too).
    pub fn busy(&self) -> Vec<String> {
        self.read()
            .values()
            .filter(|m| {
                let stats = m.batch.stats();
                stats.running + stats.waiting > 0 || Arc::strong_count(m) > 1
            })
            .map(|m| m.held.id.clone())
            .collect()
    }

    /// Sequences per step and KV pool bytes for a model loaded now (a pull).
    pub fn batch_for_new_model(&self) -> (usize, u64) {
        (self.slots, self.kv_bytes_per_model)
    }

    /// Claims the one pull slot; `false` when a pull is under way.
    pub fn begin_pull(&self) -> bool {
        !self.pulling.swap(true, Ordering::SeqCst)
    }

    /// Frees the pull slot.
    pub fn end_pull(&self) {
        self.pulling.store(false, Ordering::SeqCst);
    }

    /// Whether model `id` is served with file digest `sha256`.
    pub fn holds(&self, id: &str, sha256: &[u8]) -> bool {
        self.read().get(id).is_some_and(|m| m.held.sha256 == sha256)
    }

    /// Every configured file plus every model installed in `store` (a
    /// configured id wins over an installed one), loaded; the store's
    /// models are marked used.
    pub fn load_with_store(
        entries: &[ModelEntry],
        store: Arc<store::ModelStore>,
        batch: BatchSettings,
        backend: &Backend,
    ) -> Result<Self, ModelError> {
        let mut all = entries.to_vec();
        let installed = store
            .entries()
            .map_err(|e| ModelError::Store(Box::new(e)))?;
        for e in installed {
            if !all.iter().any(|c| c.id == e.id) {
                all.push(e);
            }
        }
        let mut set = Self::load_on(&all, batch, backend)?;
        for id in set.read().keys() {
            if !entries.iter().any(|c| &c.id == id) {
                store
                    .touch(id)
                    .map_err(|e| ModelError::Store(Box::new(e)))?;
            }
        }
        set.store = Some(store);
        Ok(set)
    }

    /// Where the set's engines compute.
    pub fn backend(&self) -> &Backend {
        &self.backend
    }

    /// The model folder, when the set was loaded with one.
    pub fn store(&self) -> Option<&Arc<store::ModelStore>> {
        self.store.as_ref()
    }

    /// Each model's batch, as of its last step.
    pub fn batch_stats(&self) -> Vec<(String, BatchStats)> {
        self.read()
            .iter()
            .map(|(id, m)| (id.clone(), m.batch.stats()))
            .collect()
    }

    /// The most sequences any model's batch runs at once (`None` without
    /// models).
    pub fn slots(&self) -> Option<usize> {
        self.read().values().map(|m| m.batch.stats().slots).max()
    }

    /// The fewest KV positions any model's pool holds (0 without models).
    pub fn kv_positions(&self) -> usize {
        self.read()
            .values()
            .map(|m| m.kv_positions)
            .min()
            .unwrap_or(0)
    }

    /// What `Hello` reports.
    pub fn cached_models(&self) -> Vec<CachedModel> {
        self.read().values().map(|m| m.held.cached()).collect()
    }

    /// The model a job may run on: held, with exactly the digest it wants.
    pub fn resolve(&self, model: &str, sha256: &[u8]) -> Result<Arc<LoadedModel>, Refusal> {
        let loaded = self
            .read()
            .get(model)
            .cloned()
            .ok_or_else(|| Refusal::NotHeld(model.to_owned()))?;
        loaded.held.check_digest(sha256)?;
        Ok(loaded)
    }

    /// Every model served now, by catalogue id.
    pub fn all(&self) -> Vec<Arc<LoadedModel>> {
        self.read().values().cloned().collect()
    }

    pub fn len(&self) -> usize {
        self.read().len()
    }

    pub fn is_empty(&self) -> bool {
        self.read().is_empty()
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
