//! The catalogue file: the operator's list of models in the shared TOML
//! format (`mlxnet_proto::catalogue`, the format of `proto/catalogue.toml`),
//! read at start and edited by `mlxnet-coordinator catalogue add|list|remove`.
//!
//! Why a file beside the config: an operator pins a model by adding the entry
//! `mlx-node models describe` printed (digests, pieces, mirrors, memory
//! figures from the file's own metadata), without editing the config by hand.
//!
//! # Invariants
//! - What is written is a validated catalogue ([`Catalogue::parse`] reads it
//!   back); it replaces the old file by rename, so a crash leaves the old or
//!   the new file, never half of one.
//! - A refused change (a bad entry, a duplicate id, an id not there) leaves
//!   the file as it was.
//!
//! # Failure
//! [`CatalogueFileError`] names the file and what is wrong with it.

use std::{
    io::Write,
    path::{Path, PathBuf},
};

use mlxnet_proto::catalogue::{Catalogue, CatalogueEntry};

use super::CatalogueModel;

/// Why the catalogue file could not be read or changed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum CatalogueFileError {
    #[error("catalogue file {path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("catalogue file {path}: {source}")]
    Invalid {
        path: PathBuf,
        #[source]
        source: mlxnet_proto::catalogue::CatalogueError,
    },
}

/// Reads and validates the catalogue file at `path`; a file that does not
/// exist is an empty catalogue (when `missing_ok`) or an error.
pub fn read(path: &Path, missing_ok: bool) -> Result<Catalogue, CatalogueFileError> {
    let text = match std::fs::read_to_string(path) {
        Ok(text) => text,
        Err(e) if missing_ok && e.kind() == std::io::ErrorKind::NotFound => {
            return Ok(Catalogue::default())
        }
        Err(source) => {
            return Err(CatalogueFileError::Io {
                path: path.to_owned(),
                source,
            })
        }
    };
    Catalogue::parse(&text).map_err(|source| CatalogueFileError::Invalid {
        path: path.to_owned(),
        source,
    })
}

/// Writes `catalogue` to `path` (a temporary file beside it, synced, then
/// renamed over it).
pub fn write(path: &Path, catalogue: &Catalogue) -> Result<(), CatalogueFileError> {
    let io = |source| CatalogueFileError::Io {
        path: path.to_owned(),
        source,
    };
    catalogue
        .validate()
        .map_err(|source| CatalogueFileError::Invalid {
            path: path.to_owned(),
            source,
        })?;
    let dir = match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d.to_owned(),
        _ => PathBuf::from("."),
    };
    std::fs::create_dir_all(&dir).map_err(io)?;
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_else(|| "catalogue.toml".into());
    let tmp = dir.join(format!(".{name}.{}.tmp", std::process::id()));
    let written = write_then_rename(&tmp, path, catalogue.to_toml().as_bytes());
    if written.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    written.map_err(io)
}

fn write_then_rename(tmp: &Path, path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    let mut f = std::fs::File::create(tmp)?;
    f.write_all(bytes)?;
    f.sync_all()?;
    std::fs::rename(tmp, path)
}

/// Adds every model of `entries` to the file at `path` (created if absent),
/// replacing same-id entries when `replace`; all or none. Returns the ids added.
pub fn add(
    path: &Path,
    entries: &Catalogue,
    replace: bool,
) -> Result<Vec<String>, CatalogueFileError> {
    let mut catalogue = read(path, true)?;
    for e in &entries.models {
        catalogue
            .add(e.clone(), replace)
            .map_err(|source| CatalogueFileError::Invalid {
                path: path.to_owned(),
                source,
            })?;
    }
    write(path, &catalogue)?;
    Ok(entries.models.iter().map(|e| e.id.clone()).collect())
}

/// Removes model `id` from the file at `path`.
pub fn remove(path: &Path, id: &str) -> Result<CatalogueEntry, CatalogueFileError> {
    let mut catalogue = read(path, false)?;
    let gone = catalogue
        .remove(id)
        .map_err(|source| CatalogueFileError::Invalid {
            path: path.to_owned(),
            source,
        })?;
    write(path, &catalogue)?;
    Ok(gone)
}

impl CatalogueModel {
    /// The coordinator's view of a catalogue file entry: its primary file's
    /// size and digest, its memory figures and prices.
    pub fn from_entry(entry: &CatalogueEntry) -> CatalogueModel {
        let file = entry.primary_file();
        CatalogueModel {
            id: entry.id.clone(),
            architecture: entry.architecture.clone(),
            parameters: entry.parameters,
            size_bytes: file.size_bytes,
            sha256: file.sha256.clone(),
            context_length: entry.context_length,
            // 0 ("unknown", an entry written before the field existed):
            // `logit_bias` ids are then checked by the node alone.
            vocab_size: entry.vocab_size,
            kv_bytes_per_token: entry
                .kv_bytes_per_token()
                .unwrap_or_else(super::default_kv_bytes_per_token),
            price_input_per_mtok: entry.price_input_per_mtok,
            price_output_per_mtok: entry.price_output_per_mtok,
            layers: entry.layers,
            kv_heads: entry.kv_heads,
            head_dim: entry.head_dim,
            hidden_size: entry.hidden_size,
            kv_element_bytes: entry.kv_element_bytes,
            active_parameters: entry.active_parameters,
        }
    }
}

/// The configured models with the file's: a file entry replaces a
/// configured one of the same id (the file is what the operator manages).
pub fn merged(configured: &[CatalogueModel], file: &Catalogue) -> Vec<CatalogueModel> {
    let mut out: Vec<CatalogueModel> = configured
        .iter()
        .filter(|m| file.get(&m.id).is_none())
        .cloned()
        .collect();
    out.extend(file.models.iter().map(CatalogueModel::from_entry));
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn builtin_entry(id: &str) -> CatalogueEntry {
        Catalogue::builtin()
            .get(id)
            .cloned()
            .expect("built-in entry")
    }

    #[test]
    fn a_file_entry_gives_the_coordinator_its_vocabulary_size() {
        let smol = CatalogueModel::from_entry(&builtin_entry("smollm2-135m-instruct"));
        assert_eq!(smol.vocab_size, 49_152);
        let gemma = CatalogueModel::from_entry(&builtin_entry("gemma3-270m"));
        assert_eq!(gemma.vocab_size, 262_144);
    }

    #[test]
    fn add_list_remove_round_trip_through_the_file() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("sub/catalogue.toml");
        assert!(read(&path, true)
            .expect("missing is empty")
            .models
            .is_empty());
        assert!(matches!(
            read(&path, false),
            Err(CatalogueFileError::Io { .. })
        ));
        let gemma = Catalogue {
            models: vec![builtin_entry("gemma3-270m")],
        };
        assert_eq!(add(&path, &gemma, false).expect("added"), ["gemma3-270m"]);
        let back = read(&path, false).expect("reads back");
        assert_eq!(back, gemma);

        // A duplicate is refused and the file is unchanged; `replace` takes it.
        let before = std::fs::read(&path).expect("file");
        assert!(matches!(
            add(&path, &gemma, false),
            Err(CatalogueFileError::Invalid { .. })
        ));
        assert_eq!(std::fs::read(&path).expect("file"), before);
        add(&path, &gemma, true).expect("replaced");

        // A bad entry is refused whole: the good one beside it is not added.
        let mut bad = builtin_entry("smollm2-135m-instruct");
        bad.files[0].sha256 = "not hex".into();
        let two = Catalogue {
            models: vec![builtin_entry("smollm2-135m-instruct"), bad],
        };
        assert!(add(&path, &two, false).is_err());
        assert_eq!(read(&path, false).expect("reads").models.len(), 1);

        assert!(matches!(
            remove(&path, "nope"),
            Err(CatalogueFileError::Invalid { .. })
        ));
        assert_eq!(
            remove(&path, "gemma3-270m").expect("removed").id,
            "gemma3-270m"
        );
        assert!(read(&path, false).expect("reads").models.is_empty());
    }

    #[test]
    fn file_entries_join_the_configured_catalogue_and_win_on_the_same_id() {
        let smollm = super::super::smollm2_135m_instruct();
        let mut file = Catalogue::builtin();
        // The file's smollm entry has another price: it replaces the configured one.
        file.models[0].price_input_per_mtok = Some(77);
        let models = merged(&[smollm], &file);
        let ids: Vec<&str> = models.iter().map(|m| m.id.as_str()).collect();
        assert_eq!(ids, ["smollm2-135m-instruct", "gemma3-270m"]);
        assert_eq!(models[0].price_input_per_mtok, Some(77));
        // The figures come from the entry's file and metadata.
        let gemma = &models[1];
        let entry = file.get("gemma3-270m").expect("gemma");
        assert_eq!(gemma.sha256, entry.primary_file().sha256);
        assert_eq!(gemma.size_bytes, entry.primary_file().size_bytes);
        assert_eq!(gemma.layers, entry.layers);
        assert_eq!(Some(gemma.kv_bytes_per_token), entry.kv_bytes_per_token());
        super::super::Catalogue::new(&models).expect("a valid coordinator catalogue");
    }
}
