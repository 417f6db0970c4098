//! `mlx-node models pull|list|remove|verify|describe|available`: the
//! owner's commands over the node's model folder ([`ModelStore`]).
//!
//! `pull` reads the catalogue (the built-in one, or `store.catalogue` /
//! `--catalogue`), applies the owner's rules from the node's config (quota,
//! size, licenses), shows a progress bar on a terminal (log lines
//! otherwise), and installs the model only once its digest matched. A
//! running `mlx-node run` serves what is installed when it starts.
//!
//! # Failure
//! Errors are `anyhow` errors with context; `main` prints them and exits
//! non-zero.

use std::path::{Path, PathBuf};

use anyhow::{bail, Context};
use mlxnet_proto::catalogue::{Catalogue, CatalogueEntry, ModelFile};

use super::download::{DownloadConfig, Downloader};
use super::progress;
use super::store::{ModelStore, Pulled};
use crate::config::NodeConfig;

/// What `mlx-node models` does.
#[derive(Debug, Clone, clap::Subcommand)]
pub enum ModelsCommand {
    /// Fetch a catalogue model into the node's model folder (resumes a
    /// broken download; installs it only when its SHA-256 matches).
    Pull {
        /// Catalogue id (`mlx-node models available` lists them).
        id: String,
        /// A mirror to try first: a folder URL the file names are appended
        /// to (repeatable).
        #[arg(long = "mirror", value_name = "URL")]
        mirrors: Vec<String>,
        /// Catalogue file (TOML) instead of the configured or built-in one.
        #[arg(long)]
        catalogue: Option<PathBuf>,
    },
    /// List the installed models.
    List,
    /// List the catalogue's models.
    Available {
        #[arg(long)]
        catalogue: Option<PathBuf>,
    },
    /// Remove an installed model and its files.
    Remove { id: String },
    /// Re-hash installed files against their digests (all models, or one).
    Verify { id: Option<String> },
    /// Print the catalogue entry of a local GGUF file: digests (whole and
    /// in pieces) and the memory figures from its metadata.
    Describe {
        file: PathBuf,
        /// The id jobs will name.
        #[arg(long)]
        id: String,
        /// License identifier; default: the file's `general.license`.
        #[arg(long)]
        license: Option<String>,
        /// Full URLs that serve this file (repeatable).
        #[arg(long = "mirror", value_name = "URL")]
        mirrors: Vec<String>,
        /// Size of the pieces hashed for shard fetches (0 = none).
        #[arg(long, default_value_t = 16 << 20)]
        piece_bytes: u64,
    },
}

/// The catalogue a command reads: `flag`, else the configured file, else
/// the built-in one.
pub fn load_catalogue(config: &NodeConfig, flag: Option<&Path>) -> anyhow::Result<Catalogue> {
    match flag.or(config.store.catalogue.as_deref()) {
        Some(path) => {
            let text = std::fs::read_to_string(path)
                .with_context(|| format!("reading catalogue {}", path.display()))?;
            Catalogue::parse(&text).with_context(|| format!("catalogue {}", path.display()))
        }
        None => Ok(Catalogue::builtin()),
    }
}

/// The node's model folder, with the owner's rules.
pub fn open_store(config: &NodeConfig) -> anyhow::Result<ModelStore> {
    let dir = config.store.dir_in(&config.data_dir);
    ModelStore::open(&dir, config.store.policy())
        .with_context(|| format!("opening the model folder {}", dir.display()))
}

/// Runs a `models` command.
pub fn run(config: &NodeConfig, command: ModelsCommand) -> anyhow::Result<()> {
    match command {
        ModelsCommand::Pull {
            id,
            mirrors,
            catalogue,
        } => {
            let catalogue = load_catalogue(config, catalogue.as_deref())?;
            let Some(entry) = catalogue.get(&id) else {
                bail!(
                    "no model {id:?} in the catalogue (available: {})",
                    catalogue
                        .models
                        .iter()
                        .map(|m| m.id.as_str())
                        .collect::<Vec<_>>()
                        .join(", ")
                );
            };
            let store = open_store(config)?;
            let runtime = tokio::runtime::Runtime::new().context("starting the async runtime")?;
            let outcome = runtime.block_on(async {
                let downloader = Downloader::new(DownloadConfig::default())?;
                let mut progress = progress::for_this_process();
                store
                    .pull(entry, &downloader, &mirrors, &[], progress.as_mut())
                    .await
            })?;
            match outcome {
                Pulled::AlreadyInstalled => println!("{id} is already installed"),
                Pulled::Installed { evicted } => {
                    for e in evicted {
                        println!("removed {e} (used longest ago) to make room");
                    }
                    let file = entry.primary_file();
                    println!(
                        "{id} installed: {} (sha256 {} checked)",
                        store.file_path(&id, &file.name).display(),
                        file.sha256
                    );
                }
            }
            Ok(())
        }
        ModelsCommand::List => {
            let store = open_store(config)?;
            let text = store.summary()?;
            if text.is_empty() {
                println!(
                    "no models installed in {} (mlx-node models pull <id>)",
                    store.root().display()
                );
            }
            print!("{text}");
            Ok(())
        }
        ModelsCommand::Available { catalogue } => {
            print!(
                "{}",
                load_catalogue(config, catalogue.as_deref())?.summary()
            );
            Ok(())
        }
        ModelsCommand::Remove { id } => {
            let store = open_store(config)?;
            let m = store.remove(&id)?;
            println!(
                "removed {id} ({})",
                mlxnet_proto::catalogue::human_bytes(m.size_bytes())
            );
            Ok(())
        }
        ModelsCommand::Verify { id } => {
            let store = open_store(config)?;
            let ids = match id {
                Some(id) => vec![id],
                None => store.list()?.into_iter().map(|m| m.id).collect(),
            };
            let mut bad = 0;
            for id in ids {
                for (file, verdict) in store.verify(&id)? {
                    match verdict {
                        Ok(()) => println!("{id} {}: ok", file.name),
                        Err(why) => {
                            bad += 1;
                            println!("{id} {}: CORRUPT: {why}", file.name);
                        }
                    }
                }
            }
            if bad > 0 {
                bail!("{bad} file(s) do not match their digests: remove and pull them again");
            }
            Ok(())
        }
        ModelsCommand::Describe {
            file,
            id,
            license,
            mirrors,
            piece_bytes,
        } => {
            let entry = describe(&file, &id, license, mirrors, piece_bytes)?;
            let catalogue = Catalogue {
                models: vec![entry],
            };
            print!("{}", catalogue.to_toml());
            Ok(())
        }
    }
}

/// The catalogue entry of a local GGUF file.
pub fn describe(
    path: &Path,
    id: &str,
    license: Option<String>,
    mirrors: Vec<String>,
    piece_bytes: u64,
) -> anyhow::Result<CatalogueEntry> {
    let facts = crate::engine::describe_gguf(path)
        .with_context(|| format!("reading {}", path.display()))?;
    let (sha256, size_bytes) =
        super::digest_file(path).with_context(|| format!("hashing {}", path.display()))?;
    let pieces = piece_digests(path, piece_bytes)?;
    let name = path
        .file_name()
        .and_then(|n| n.to_str())
        .context("the file has no name")?
        .to_owned();
    let entry = CatalogueEntry {
        id: id.to_owned(),
        architecture: facts.architecture,
        parameters: facts.parameters,
        // The catalogue's 0 means "every weight" (a dense model).
        active_parameters: if facts.active_parameters < facts.parameters {
            facts.active_parameters
        } else {
            0
        },
        quantization: facts.quantization,
        context_length: u32::try_from(facts.context_length).unwrap_or(u32::MAX),
        license: license
            .or(facts.license)
            .unwrap_or_else(|| "unknown".into()),
        price_input_per_mtok: None,
        price_output_per_mtok: None,
        layers: facts.layers as u32,
        kv_heads: facts.kv_heads as u32,
        head_dim: facts.head_dim as u32,
        hidden_size: facts.hidden_size as u32,
        kv_element_bytes: 4,
        vocab_size: u32::try_from(facts.vocab_size).unwrap_or(0),
        files: vec![ModelFile {
            name,
            size_bytes,
            sha256: hex::encode(sha256),
            mirrors,
            piece_bytes: if pieces.is_empty() { 0 } else { piece_bytes },
            pieces,
        }],
    };
    entry.validate()?;
    Ok(entry)
}

/// SHA-256 of every `piece_bytes` piece of the file (none for 0).
pub fn piece_digests(path: &Path, piece_bytes: u64) -> anyhow::Result<Vec<String>> {
    use sha2::{Digest, Sha256};
    use std::io::Read;
    if piece_bytes == 0 {
        return Ok(Vec::new());
    }
    let mut f = std::fs::File::open(path).with_context(|| format!("opening {}", path.display()))?;
    let mut out = Vec::new();
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let mut hasher = Sha256::new();
        let mut left = piece_bytes;
        let mut got = 0u64;
        while left > 0 {
            let n = f.read(&mut buf[..left.min(1 << 20) as usize])?;
            if n == 0 {
                break;
            }
            hasher.update(&buf[..n]);
            left -= n as u64;
            got += n as u64;
        }
        if got == 0 {
            break;
        }
        out.push(hex::encode(hasher.finalize()));
        if left > 0 {
            break;
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `models describe` of the shipped test model reproduces the built-in
    /// catalogue's entry: digests, pieces and every figure read from the
    /// file's own metadata (the vocabulary size among them).
    #[test]
    fn describing_the_test_model_gives_the_builtin_entry() {
        let path = crate::test_utils::test_model_path();
        let builtin = Catalogue::builtin()
            .get("smollm2-135m-instruct")
            .cloned()
            .expect("built-in entry");
        let file = &builtin.files[0];
        let described = describe(
            &path,
            &builtin.id,
            Some(builtin.license.clone()),
            file.mirrors.clone(),
            file.piece_bytes,
        )
        .expect("describe the test model");
        assert_eq!(described, builtin);
        assert_eq!(described.vocab_size, 49_152);
    }
}
