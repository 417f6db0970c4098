//! Automatic pulls: the coordinator's hint that a model this node has room
//! for is in demand.
//!
//! A hint is never an order. The node pulls only when its owner opted in
//! with a disk quota (`store.quota_bytes`; without one it never pulls on its
//! own), the model passes the owner's rules (size, license), it is not held
//! already, and no other hinted pull is under way. The pull makes room by
//! evicting the models used longest ago (never one a job is running on),
//! fetches and checks the file, loads its engine, and adds it to the served
//! set; the next heartbeat announces the new set.
//!
//! # Failure
//! Everything is logged and dropped: a refused or failed hinted pull changes
//! nothing but the store's partial file (kept for a later resume) and the
//! models evicted to make room.

use std::sync::Arc;

use mlxnet_proto::catalogue::CatalogueEntry;

use super::download::{DownloadConfig, Downloader};
use super::progress::LogLines;
use super::store::{ModelStore, Pulled};
use super::{LoadedModel, ModelSet};
use crate::config::ModelEntry;

/// Acts on a hint from the coordinator (see the module doc); returns at
/// once, the pull runs in the background.
pub fn on_hint(models: &Arc<ModelSet>, hint: &mlxnet_proto::v1::ModelHint) {
    let Some(store) = models.store().cloned() else {
        return;
    };
    let Some(wire) = &hint.entry else {
        tracing::warn!("a model hint without an entry; ignored");
        return;
    };
    let entry = match CatalogueEntry::from_wire(wire) {
        Ok(e) => e,
        Err(e) => {
            tracing::warn!(error = %e, "an invalid model hint; ignored");
            return;
        }
    };
    if store.policy().quota_bytes.is_none() {
        tracing::info!(model = %entry.id, "model in demand, but automatic pulls are off (set store.quota_bytes to allow them)");
        return;
    }
    if models.holds(&entry.id, &entry.primary_file().digest()) {
        return;
    }
    if let Err(refused) = store.admit(&entry) {
        tracing::info!(model = %entry.id, reason = %refused, "model in demand, refused by the owner's rules");
        return;
    }
    if !models.begin_pull() {
        tracing::debug!(model = %entry.id, "a hinted pull is already under way");
        return;
    }
    let models = models.clone();
    tokio::spawn(async move {
        tracing::info!(model = %entry.id, bytes = entry.size_bytes(), "pulling a model in demand");
        match pull_and_load(&models, &store, &entry).await {
            Ok(()) => {
                tracing::info!(model = %entry.id, "model pulled, checked and loaded; now serving it")
            }
            Err(e) => tracing::warn!(model = %entry.id, error = %e, "hinted pull failed"),
        }
        models.end_pull();
    });
}

/// Why a hinted pull failed.
#[derive(Debug, thiserror::Error)]
enum HintError {
    #[error(transparent)]
    Store(#[from] super::store::StoreError),
    #[error(transparent)]
    Download(#[from] super::download::DownloadError),
    #[error(transparent)]
    Model(#[from] super::ModelError),
    #[error("loading task failed: {0}")]
    Task(#[from] tokio::task::JoinError),
}

async fn pull_and_load(
    models: &Arc<ModelSet>,
    store: &Arc<ModelStore>,
    entry: &CatalogueEntry,
) -> Result<(), HintError> {
    let downloader = Downloader::new(DownloadConfig::default())?;
    let busy = models.busy();
    let pulled = store
        .pull(entry, &downloader, &[], &busy, &mut LogLines::default())
        .await?;
    if let Pulled::Installed { evicted } = &pulled {
        for id in evicted {
            models.remove(id);
        }
    }
    let model = ModelEntry {
        id: entry.id.clone(),
        path: store.file_path(&entry.id, &entry.primary_file().name),
    };
    let backend = models.backend().clone();
    let (slots, kv_bytes) = models.batch_for_new_model();
    let loaded =
        tokio::task::spawn_blocking(move || LoadedModel::load(&model, &backend, slots, kv_bytes))
            .await??;
    models.insert(loaded);
    Ok(())
}
