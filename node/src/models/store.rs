//! The node's model folder: catalogue models pulled over HTTP(S), within the
//! owner's disk quota and rules, evicting the least recently used.
//!
//! Layout under the root (`<data_dir>/models` by default):
//! - `<id>/<file name>`: the files of each installed model;
//! - `.partial/<sha256>.part`: a download in progress, named by the digest
//!   it must reach, so a resume only ever continues the same bytes;
//! - `index.json`: what is installed, with each model's license, files
//!   (name, size, SHA-256) and when it was installed and last used.
//!
//! # Invariants
//! - A model is in the index only after every file of it was fetched, its
//!   digest matched the catalogue's, and it was synced and renamed into its
//!   folder; the index itself is replaced atomically (temporary file, sync,
//!   rename), so a crash leaves either the old or the new index.
//! - The owner's rules hold before any byte is fetched: a model over
//!   `max_model_bytes` or under a refused license is refused, and room for
//!   it under the quota is made first, by removing the models used longest
//!   ago (never one the caller says is in use). The partial file counts
//!   against the quota like an installed one.
//! - Only the store writes under its root; a catalogue's file names are
//!   plain names (checked by the catalogue), so nothing lands outside.
//!
//! # Failure
//! [`StoreError`]: a refusal by the owner's rules (nothing changed), a
//! download that failed on every mirror (the partial file stays for a
//! resume; models evicted to make room stay evicted), or an I/O error
//! naming the path.
//!
//! One writer at a time is assumed per root (the node, or one `mlx-node
//! models` command); the index is re-read before every change, so a
//! concurrent writer can at worst lose another's last-used time.

use std::{
    collections::BTreeMap,
    path::{Path, PathBuf},
    sync::Mutex,
    time::{SystemTime, UNIX_EPOCH},
};

use mlxnet_proto::catalogue::{human_bytes, CatalogueEntry};
use serde::{Deserialize, Serialize};

use super::download::{self, DownloadError, Downloader};
use super::progress::Progress;
use crate::config::ModelEntry;

const INDEX: &str = "index.json";
const PARTIAL: &str = ".partial";

/// What the owner allows on this node's disk.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StorePolicy {
    /// Bytes all pulled models may take together; `None` = no limit.
    #[serde(default)]
    pub quota_bytes: Option<u64>,
    /// Models larger than this are refused; `None` = no limit.
    #[serde(default)]
    pub max_model_bytes: Option<u64>,
    /// Licenses (as the catalogue names them, case-insensitive) the owner refuses.
    #[serde(default)]
    pub refuse_licenses: Vec<String>,
}

/// Why the owner's rules refuse a model.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum Refused {
    #[error("model {id} is {size} bytes, over this node's limit of {max} bytes per model")]
    TooLarge { id: String, size: u64, max: u64 },
    #[error("model {id} is under license {license:?}, which this node's owner refuses")]
    License { id: String, license: String },
    #[error("model {id} needs {size} bytes, more than this node's whole quota of {quota} bytes (with the models in use kept)")]
    QuotaTooSmall { id: String, size: u64, quota: u64 },
}

/// Why a store operation failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum StoreError {
    #[error(transparent)]
    Refused(#[from] Refused),
    #[error("model {0} is not installed")]
    NotInstalled(String),
    #[error(transparent)]
    Download(#[from] DownloadError),
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("model index {path} is unreadable: {reason}")]
    Index { path: PathBuf, reason: String },
}

fn io_err(path: &Path) -> impl Fn(std::io::Error) -> StoreError + '_ {
    move |source| StoreError::Io {
        path: path.to_owned(),
        source,
    }
}

/// One file of an installed model.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct InstalledFile {
    pub name: String,
    pub size_bytes: u64,
    /// Lowercase hex.
    pub sha256: String,
}

/// A model in the store.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct InstalledModel {
    pub id: String,
    pub architecture: String,
    pub license: String,
    pub files: Vec<InstalledFile>,
    /// Milliseconds since the Unix epoch.
    pub installed_ms: u64,
    /// When a node last loaded or ran it (ms since the epoch).
    pub last_used_ms: u64,
}

impl InstalledModel {
    pub fn size_bytes(&self) -> u64 {
        self.files.iter().map(|f| f.size_bytes).sum()
    }

    /// The file an engine loads (the GGUF, else the first).
    pub fn primary_file(&self) -> Option<&InstalledFile> {
        self.files
            .iter()
            .find(|f| f.name.ends_with(".gguf"))
            .or(self.files.first())
    }

    fn matches(&self, entry: &CatalogueEntry) -> bool {
        self.files.len() == entry.files.len()
            && entry.files.iter().all(|f| {
                self.files.iter().any(|g| {
                    g.name == f.name && g.sha256 == f.sha256 && g.size_bytes == f.size_bytes
                })
            })
    }
}

#[derive(Debug, Default, Serialize, Deserialize)]
struct Index {
    models: BTreeMap<String, InstalledModel>,
}

/// A file and whether it is intact (else why not).
pub type Verdict = (InstalledFile, Result<(), String>);

/// What a pull did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Pulled {
    /// The model was already installed with these digests; nothing fetched.
    AlreadyInstalled,
    /// Fetched and installed, after removing `evicted` to make room.
    Installed { evicted: Vec<String> },
}

/// The node's model folder.
#[derive(Debug)]
pub struct ModelStore {
    root: PathBuf,
    policy: StorePolicy,
    /// Serialises index changes within this process.
    lock: Mutex<()>,
}

/// Now in ms since the epoch, but after every time already in `index`, so
/// "used longest ago" is a strict order even within one millisecond.
fn stamp(index: &Index) -> u64 {
    let now = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or_default();
    let latest = index.models.values().map(|m| m.last_used_ms).max();
    latest.map_or(now, |l| now.max(l + 1))
}

impl ModelStore {
    /// Opens (creating) the store at `root`.
    pub fn open(root: impl Into<PathBuf>, policy: StorePolicy) -> Result<ModelStore, StoreError> {
        let root = root.into();
        std::fs::create_dir_all(root.join(PARTIAL)).map_err(io_err(&root))?;
        Ok(ModelStore {
            root,
            policy,
            lock: Mutex::new(()),
        })
    }

    pub fn root(&self) -> &Path {
        &self.root
    }

    pub fn policy(&self) -> &StorePolicy {
        &self.policy
    }

    fn guard(&self) -> std::sync::MutexGuard<'_, ()> {
        self.lock.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn read_index(&self) -> Result<Index, StoreError> {
        let path = self.root.join(INDEX);
        match std::fs::read(&path) {
            Ok(bytes) => serde_json::from_slice(&bytes).map_err(|e| StoreError::Index {
                path,
                reason: e.to_string(),
            }),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(Index::default()),
            Err(e) => Err(io_err(&path)(e)),
        }
    }

    fn write_index(&self, index: &Index) -> Result<(), StoreError> {
        let path = self.root.join(INDEX);
        let tmp = self.root.join(format!("{INDEX}.tmp"));
        let bytes = serde_json::to_vec_pretty(index).map_err(|e| StoreError::Index {
            path: path.clone(),
            reason: e.to_string(),
        })?;
        std::fs::write(&tmp, bytes).map_err(io_err(&tmp))?;
        download::sync_file(&tmp).map_err(io_err(&tmp))?;
        std::fs::rename(&tmp, &path).map_err(io_err(&path))?;
        download::sync_dir(&self.root).map_err(io_err(&self.root))?;
        Ok(())
    }

    /// Installed models, by id.
    pub fn list(&self) -> Result<Vec<InstalledModel>, StoreError> {
        Ok(self.read_index()?.models.into_values().collect())
    }

    pub fn get(&self, id: &str) -> Result<Option<InstalledModel>, StoreError> {
        Ok(self.read_index()?.models.remove(id))
    }

    /// Bytes the installed models take.
    pub fn used_bytes(&self) -> Result<u64, StoreError> {
        Ok(self.list()?.iter().map(InstalledModel::size_bytes).sum())
    }

    /// Where model `id`'s files live.
    pub fn model_dir(&self, id: &str) -> PathBuf {
        self.root.join(id)
    }

    /// Where `id`'s file `name` lives.
    pub fn file_path(&self, id: &str, name: &str) -> PathBuf {
        self.model_dir(id).join(name)
    }

    fn partial_path(&self, sha256: &str) -> PathBuf {
        self.root.join(PARTIAL).join(format!("{sha256}.part"))
    }

    /// Every installed model as the engine loads it: id and primary file.
    pub fn entries(&self) -> Result<Vec<ModelEntry>, StoreError> {
        Ok(self
            .list()?
            .into_iter()
            .filter_map(|m| {
                let f = m.primary_file()?;
                Some(ModelEntry {
                    path: self.file_path(&m.id, &f.name),
                    id: m.id.clone(),
                })
            })
            .collect())
    }

    /// Checks the owner's per-model rules (size, license); no disk access.
    pub fn admit(&self, entry: &CatalogueEntry) -> Result<(), Refused> {
        let size = entry.size_bytes();
        if let Some(max) = self.policy.max_model_bytes {
            if size > max {
                return Err(Refused::TooLarge {
                    id: entry.id.clone(),
                    size,
                    max,
                });
            }
        }
        let license = entry.license.trim();
        if self
            .policy
            .refuse_licenses
            .iter()
            .any(|l| l.trim().eq_ignore_ascii_case(license))
        {
            return Err(Refused::License {
                id: entry.id.clone(),
                license: entry.license.clone(),
            });
        }
        Ok(())
    }

    /// The models to remove, least recently used first, so that `entry`
    /// fits under the quota; `in_use` are never removed. Refused when even
    /// removing every other model would not make room.
    pub fn eviction_plan(
        &self,
        entry: &CatalogueEntry,
        in_use: &[String],
    ) -> Result<Vec<String>, StoreError> {
        let Some(quota) = self.policy.quota_bytes else {
            return Ok(Vec::new());
        };
        let index = self.read_index()?;
        // A model replaced by another version of itself frees its bytes.
        let others: Vec<&InstalledModel> =
            index.models.values().filter(|m| m.id != entry.id).collect();
        let mut used: u64 = others.iter().map(|m| m.size_bytes()).sum();
        let need = entry.size_bytes();
        let mut candidates: Vec<&InstalledModel> = others
            .iter()
            .copied()
            .filter(|m| !in_use.contains(&m.id))
            .collect();
        candidates.sort_by(|a, b| (a.last_used_ms, &a.id).cmp(&(b.last_used_ms, &b.id)));
        let mut plan = Vec::new();
        let mut candidates = candidates.into_iter();
        while used + need > quota {
            match candidates.next() {
                Some(m) => {
                    used -= m.size_bytes();
                    plan.push(m.id.clone());
                }
                None => {
                    return Err(Refused::QuotaTooSmall {
                        id: entry.id.clone(),
                        size: need,
                        quota,
                    }
                    .into())
                }
            }
        }
        Ok(plan)
    }

    /// Fetches and installs `entry` (mirrors: `extra_mirrors` first, then
    /// the catalogue's), unless it is installed already. Checks the owner's
    /// rules first, then makes room (see the module invariants).
    pub async fn pull(
        &self,
        entry: &CatalogueEntry,
        downloader: &Downloader,
        extra_mirrors: &[String],
        in_use: &[String],
        progress: &mut dyn Progress,
    ) -> Result<Pulled, StoreError> {
        entry.validate().map_err(|e| StoreError::Index {
            path: self.root.clone(),
            reason: e.to_string(),
        })?;
        if let Some(m) = self.get(&entry.id)? {
            let present = m.files.iter().all(|f| {
                std::fs::metadata(self.file_path(&m.id, &f.name))
                    .is_ok_and(|md| md.len() == f.size_bytes)
            });
            if m.matches(entry) && present {
                return Ok(Pulled::AlreadyInstalled);
            }
        }
        self.admit(entry)?;
        let evicted = self.eviction_plan(entry, in_use)?;
        for id in &evicted {
            tracing::info!(model = %id, for_model = %entry.id, "evicting the least recently used model to make room");
            progress.note(&format!("removing {id} (used longest ago) to make room"));
            self.remove(id)?;
        }
        // Partial downloads of other files are stale once room is planned
        // without them.
        let keep: Vec<PathBuf> = entry
            .files
            .iter()
            .map(|f| self.partial_path(&f.sha256))
            .collect();
        if self.policy.quota_bytes.is_some() {
            if let Ok(dir) = std::fs::read_dir(self.root.join(PARTIAL)) {
                for e in dir.filter_map(Result::ok) {
                    if !keep.contains(&e.path()) {
                        let _ = std::fs::remove_file(e.path());
                    }
                }
            }
        }
        let dir = self.model_dir(&entry.id);
        std::fs::create_dir_all(&dir).map_err(io_err(&dir))?;
        for f in &entry.files {
            let dest = self.file_path(&entry.id, &f.name);
            if std::fs::metadata(&dest).is_ok_and(|m| m.len() == f.size_bytes)
                && super::digest_file(&dest).is_ok_and(|(d, _)| d == f.digest())
            {
                continue;
            }
            let mut mirrors: Vec<String> = extra_mirrors
                .iter()
                .map(|base| download::mirror_url(base, &f.name))
                .collect();
            mirrors.extend(f.mirrors.iter().cloned());
            let partial = self.partial_path(&f.sha256);
            downloader.fetch(f, &mirrors, &partial, progress).await?;
            std::fs::rename(&partial, &dest).map_err(io_err(&dest))?;
            download::sync_dir(&dir).map_err(io_err(&dir))?;
            tracing::info!(model = %entry.id, file = %f.name, bytes = f.size_bytes, "file installed, digest checked");
        }
        let _g = self.guard();
        let mut index = self.read_index()?;
        let now = stamp(&index);
        index.models.insert(
            entry.id.clone(),
            InstalledModel {
                id: entry.id.clone(),
                architecture: entry.architecture.clone(),
                license: entry.license.clone(),
                files: entry
                    .files
                    .iter()
                    .map(|f| InstalledFile {
                        name: f.name.clone(),
                        size_bytes: f.size_bytes,
                        sha256: f.sha256.clone(),
                    })
                    .collect(),
                installed_ms: now,
                last_used_ms: now,
            },
        );
        self.write_index(&index)?;
        Ok(Pulled::Installed { evicted })
    }

    /// Removes model `id` and its files.
    pub fn remove(&self, id: &str) -> Result<InstalledModel, StoreError> {
        let _g = self.guard();
        let mut index = self.read_index()?;
        let m = index
            .models
            .remove(id)
            .ok_or_else(|| StoreError::NotInstalled(id.to_owned()))?;
        // Out of the index first: a crash midway leaves stray files, never
        // an index entry without its files.
        self.write_index(&index)?;
        let dir = self.model_dir(id);
        match std::fs::remove_dir_all(&dir) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return Err(io_err(&dir)(e)),
        }
        Ok(m)
    }

    /// Re-hashes every file of `id`: each file with whether it is intact.
    pub fn verify(&self, id: &str) -> Result<Vec<Verdict>, StoreError> {
        let m = self
            .get(id)?
            .ok_or_else(|| StoreError::NotInstalled(id.to_owned()))?;
        Ok(m.files
            .iter()
            .map(|f| {
                let path = self.file_path(id, &f.name);
                let verdict = match super::digest_file(&path) {
                    Err(e) => Err(format!("cannot read {}: {e}", path.display())),
                    Ok((_, size)) if size != f.size_bytes => {
                        Err(format!("{size} bytes, want {}", f.size_bytes))
                    }
                    Ok((d, _)) if hex::encode(d) != f.sha256 => Err(format!(
                        "sha256 {} is not the installed {}",
                        hex::encode(d),
                        f.sha256
                    )),
                    Ok(_) => Ok(()),
                };
                (f.clone(), verdict)
            })
            .collect())
    }

    /// Records that `id` was just used (for least-recently-used eviction).
    pub fn touch(&self, id: &str) -> Result<(), StoreError> {
        let _g = self.guard();
        let mut index = self.read_index()?;
        let now = stamp(&index);
        if let Some(m) = index.models.get_mut(id) {
            m.last_used_ms = now;
            self.write_index(&index)?;
        }
        Ok(())
    }

    /// One line per installed model, for `mlx-node models list`.
    pub fn summary(&self) -> Result<String, StoreError> {
        let mut out = String::new();
        for m in self.list()? {
            out.push_str(&format!(
                "{:<28} {:<10} {:>10} {:<12} last used {}\n",
                m.id,
                m.architecture,
                human_bytes(m.size_bytes()),
                m.license,
                m.last_used_ms
            ));
        }
        if let Some(q) = self.policy.quota_bytes {
            out.push_str(&format!(
                "{} of the {} quota used\n",
                human_bytes(self.used_bytes()?),
                human_bytes(q)
            ));
        }
        Ok(out)
    }
}
