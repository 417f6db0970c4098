//! The model catalogue as data: which models the network serves, what they
//! are, and where their files come from, each file pinned by SHA-256.
//!
//! One TOML format for everyone: the coordinator loads it (the models jobs
//! may name, their prices and memory needs), operators edit it
//! (`mlxnet-coordinator catalogue add|list|remove`), and nodes read it to
//! pull files (`mlx-node models pull`). [`BUILTIN`] is the catalogue shipped
//! with the code: the project's test models.
//!
//! ```toml
//! [[model]]
//! id = "gemma3-270m"
//! architecture = "gemma3"
//! parameters = 268098176
//! quantization = "Q4_K_M"
//! context_length = 32768
//! license = "gemma"
//! # Memory needs, read from the file's own metadata (`mlx-node models describe`).
//! layers = 18
//! kv_heads = 1
//! head_dim = 256
//! hidden_size = 640
//! kv_element_bytes = 4
//!
//! [[model.files]]
//! name = "gemma-3-270m-q4_k_m.gguf"
//! size_bytes = 253113024
//! sha256 = "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"
//! mirrors = ["https://example.org/gemma-3-270m-q4_k_m.gguf"]
//! # Optional: the SHA-256 of every `piece_bytes` piece, so a pod member that
//! # fetches only its shard's byte ranges can check what it got.
//! piece_bytes = 16777216
//! pieces = ["...", "..."]
//! ```
//!
//! # Invariants
//! A [`Catalogue`] that [`Catalogue::parse`] returned (or that passed
//! [`Catalogue::validate`]) has unique ids made of `[a-z0-9._-]`, at least one
//! file per model, file names that are plain names (no directory parts, so a
//! catalogue can never make a node write outside its model folder), every
//! digest 64 lowercase hex digits, `http(s)://` mirrors, and piece digests
//! that cover each file exactly.
//!
//! # Failure
//! [`CatalogueError`] names the model, file and field that is wrong.

use std::fmt::Write as _;

use serde::{Deserialize, Serialize};

/// The catalogue shipped with the code: the project's test models, pinned
/// by digest (`proto/catalogue.toml`).
pub const BUILTIN: &str = include_str!("../catalogue.toml");

/// Why a catalogue (or one entry) is unusable.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[non_exhaustive]
pub enum CatalogueError {
    #[error("catalogue is not valid TOML: {0}")]
    Syntax(String),
    #[error("model id {0:?} must be 1 to 64 characters of a-z, 0-9, '.', '_' and '-'")]
    BadId(String),
    #[error("catalogue lists model {0} twice")]
    Duplicate(String),
    #[error("model {0} has no files")]
    NoFiles(String),
    #[error("model {id}: {field} {reason}")]
    Field {
        id: String,
        field: &'static str,
        reason: String,
    },
    #[error("model {id}, file {file:?}: {reason}")]
    File {
        id: String,
        file: String,
        reason: String,
    },
    #[error("no model {0} in the catalogue")]
    NotFound(String),
}

/// Every model the network serves.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Catalogue {
    #[serde(default, rename = "model")]
    pub models: Vec<CatalogueEntry>,
}

/// One model: what it is, what it costs, what it needs, and its files.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CatalogueEntry {
    /// The id jobs name ("gemma3-270m").
    pub id: String,
    /// `general.architecture` of the file ("llama", "gemma3", "qwen3moe", ...).
    pub architecture: String,
    /// Total number of weights.
    pub parameters: u64,
    /// Weights used per token (mixture of experts); 0 = all of them.
    #[serde(default)]
    pub active_parameters: u64,
    /// How the weights are stored ("Q4_K_M", "Q8_0", "BF16", ...).
    pub quantization: String,
    /// Longest sequence (prompt + generated) the model accepts.
    pub context_length: u32,
    /// License identifier as the model ships it ("apache-2.0", "gemma", "llama3.1").
    pub license: String,
    /// Micro-MLX per million prompt tokens; absent = the coordinator's default rule.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub price_input_per_mtok: Option<u64>,
    /// Micro-MLX per million generated tokens; absent = twice the input price.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub price_output_per_mtok: Option<u64>,
    /// Transformer layers (from the file's metadata; 0 = unknown).
    #[serde(default)]
    pub layers: u32,
    /// Key/value heads per layer.
    #[serde(default)]
    pub kv_heads: u32,
    /// Dimension of one head.
    #[serde(default)]
    pub head_dim: u32,
    /// Width of the residual stream.
    #[serde(default)]
    pub hidden_size: u32,
    /// Bytes per KV-cache element on a node (the engine keeps f32: 4).
    #[serde(default)]
    pub kv_element_bytes: u32,
    /// Tokens in the vocabulary (from the file's tokenizer; 0 = unknown):
    /// the coordinator checks a job's `logit_bias` ids against it.
    #[serde(default, skip_serializing_if = "is_zero_u32")]
    pub vocab_size: u32,
    /// The model's files: one GGUF, or safetensors shards with `config.json`,
    /// `tokenizer.json` and the chat template beside them.
    pub files: Vec<ModelFile>,
}

/// One file of a model, pinned by digest, with where to get it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ModelFile {
    /// The file's name in the model's folder (no directory parts).
    pub name: String,
    pub size_bytes: u64,
    /// Lowercase hex SHA-256 of the whole file.
    pub sha256: String,
    /// Full URLs of the same bytes, tried in order.
    #[serde(default)]
    pub mirrors: Vec<String>,
    /// Size of the pieces `pieces` hashes (the last may be shorter); 0 = none.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub piece_bytes: u64,
    /// SHA-256 of each piece, in order.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub pieces: Vec<String>,
}

fn is_zero(v: &u64) -> bool {
    *v == 0
}

fn is_zero_u32(v: &u32) -> bool {
    *v == 0
}

impl ModelFile {
    /// The whole-file digest as bytes (valid after validation).
    pub fn digest(&self) -> [u8; 32] {
        parse_digest(&self.sha256).unwrap_or([0; 32])
    }

    /// The digest of piece `i`, if the file has piece digests.
    pub fn piece_digest(&self, i: usize) -> Option<[u8; 32]> {
        self.pieces.get(i).and_then(|p| parse_digest(p))
    }

    /// The byte range of piece `i`.
    pub fn piece_range(&self, i: usize) -> std::ops::Range<u64> {
        let start = (i as u64).saturating_mul(self.piece_bytes);
        start.min(self.size_bytes)..(start.saturating_add(self.piece_bytes)).min(self.size_bytes)
    }

    fn validate(&self, id: &str) -> Result<(), CatalogueError> {
        let bad = |reason: String| CatalogueError::File {
            id: id.to_owned(),
            file: self.name.clone(),
            reason,
        };
        if !is_plain_file_name(&self.name) {
            return Err(bad(
                "the name must be a plain file name (no '/', '\\', '..' or leading '.')".into(),
            ));
        }
        if self.size_bytes == 0 {
            return Err(bad("size_bytes is 0".into()));
        }
        if parse_digest(&self.sha256).is_none() {
            return Err(bad("sha256 must be 64 lowercase hex digits".into()));
        }
        for m in &self.mirrors {
            if !(m.starts_with("https://") || m.starts_with("http://")) || m.len() > 2048 {
                return Err(bad(format!("mirror {m:?} is not an http(s) URL")));
            }
        }
        match (self.piece_bytes, self.pieces.len()) {
            (0, 0) => {}
            (0, _) => return Err(bad("pieces are given without piece_bytes".into())),
            (p, n) => {
                let want = self.size_bytes.div_ceil(p);
                if n as u64 != want {
                    return Err(bad(format!(
                        "{n} piece digests for {} bytes in pieces of {p} (want {want})",
                        self.size_bytes
                    )));
                }
                if self.pieces.iter().any(|d| parse_digest(d).is_none()) {
                    return Err(bad(
                        "every piece digest must be 64 lowercase hex digits".into()
                    ));
                }
            }
        }
        Ok(())
    }
}

/// A name that stays inside the folder it is joined to.
pub fn is_plain_file_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 255
        && !name.starts_with('.')
        && !name.contains(['/', '\\', '\0'])
        && name != ".."
}

/// 64 lowercase hex digits to 32 bytes.
pub fn parse_digest(hex_digits: &str) -> Option<[u8; 32]> {
    if hex_digits.len() != 64 || hex_digits.bytes().any(|b| b.is_ascii_uppercase()) {
        return None;
    }
    hex::decode(hex_digits).ok()?.try_into().ok()
}

fn valid_id(id: &str) -> bool {
    (1..=64).contains(&id.len())
        && id
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b"._-".contains(&b))
        && !id.starts_with('.')
}

impl CatalogueEntry {
    /// Checks one entry (see the module invariants).
    pub fn validate(&self) -> Result<(), CatalogueError> {
        if !valid_id(&self.id) {
            return Err(CatalogueError::BadId(self.id.clone()));
        }
        let field = |field: &'static str, reason: &str| CatalogueError::Field {
            id: self.id.clone(),
            field,
            reason: reason.to_owned(),
        };
        if self.architecture.trim().is_empty() {
            return Err(field("architecture", "is empty"));
        }
        if self.license.trim().is_empty() {
            return Err(field("license", "is empty"));
        }
        if self.context_length == 0 {
            return Err(field("context_length", "is 0"));
        }
        if self.active_parameters > self.parameters {
            return Err(field("active_parameters", "exceeds parameters"));
        }
        if self.files.is_empty() {
            return Err(CatalogueError::NoFiles(self.id.clone()));
        }
        for (i, f) in self.files.iter().enumerate() {
            f.validate(&self.id)?;
            if self.files[..i].iter().any(|g| g.name == f.name) {
                return Err(CatalogueError::File {
                    id: self.id.clone(),
                    file: f.name.clone(),
                    reason: "listed twice".into(),
                });
            }
        }
        Ok(())
    }

    /// Bytes of all files.
    pub fn size_bytes(&self) -> u64 {
        self.files.iter().map(|f| f.size_bytes).sum()
    }

    /// The file an engine loads: the GGUF, or (safetensors) the first file.
    pub fn primary_file(&self) -> &ModelFile {
        self.files
            .iter()
            .find(|f| f.name.ends_with(".gguf"))
            .unwrap_or(&self.files[0])
    }

    /// KV-cache bytes per token of context (keys and values of every
    /// layer), or `None` when the architecture fields are unknown.
    pub fn kv_bytes_per_token(&self) -> Option<u64> {
        let f = [
            self.layers,
            self.kv_heads,
            self.head_dim,
            self.kv_element_bytes,
        ];
        if f.contains(&0) {
            return None;
        }
        Some(f.iter().map(|&v| u64::from(v)).product::<u64>() * 2)
    }
}

impl Catalogue {
    /// Parses and validates TOML text.
    pub fn parse(text: &str) -> Result<Catalogue, CatalogueError> {
        let c: Catalogue =
            toml::from_str(text).map_err(|e| CatalogueError::Syntax(e.to_string()))?;
        c.validate()?;
        Ok(c)
    }

    /// The built-in catalogue ([`BUILTIN`]).
    pub fn builtin() -> Catalogue {
        // Checked by this module's tests; an empty catalogue if it ever broke.
        Catalogue::parse(BUILTIN).unwrap_or_default()
    }

    /// Checks every entry and that ids are unique.
    pub fn validate(&self) -> Result<(), CatalogueError> {
        for (i, m) in self.models.iter().enumerate() {
            m.validate()?;
            if self.models[..i].iter().any(|o| o.id == m.id) {
                return Err(CatalogueError::Duplicate(m.id.clone()));
            }
        }
        Ok(())
    }

    pub fn get(&self, id: &str) -> Option<&CatalogueEntry> {
        self.models.iter().find(|m| m.id == id)
    }

    /// Adds `entry`, replacing one with the same id when `replace`.
    pub fn add(&mut self, entry: CatalogueEntry, replace: bool) -> Result<(), CatalogueError> {
        entry.validate()?;
        match self.models.iter().position(|m| m.id == entry.id) {
            Some(i) if replace => self.models[i] = entry,
            Some(_) => return Err(CatalogueError::Duplicate(entry.id)),
            None => self.models.push(entry),
        }
        Ok(())
    }

    /// Removes the entry `id`.
    pub fn remove(&mut self, id: &str) -> Result<CatalogueEntry, CatalogueError> {
        let i = self
            .models
            .iter()
            .position(|m| m.id == id)
            .ok_or_else(|| CatalogueError::NotFound(id.to_owned()))?;
        Ok(self.models.remove(i))
    }

    /// The TOML text of this catalogue (what [`Catalogue::parse`] reads back).
    pub fn to_toml(&self) -> String {
        // Serialising plain structs of strings and integers cannot fail.
        toml::to_string_pretty(self).unwrap_or_default()
    }

    /// One line per model, for `list` commands.
    pub fn summary(&self) -> String {
        let mut out = String::new();
        for m in &self.models {
            let _ = writeln!(
                out,
                "{:<28} {:<10} {:>7} {:<8} {:>9} {:<12} {} file(s)",
                m.id,
                m.architecture,
                human_count(m.parameters),
                m.quantization,
                human_bytes(m.size_bytes()),
                m.license,
                m.files.len()
            );
        }
        out
    }
}

impl CatalogueEntry {
    /// The entry as the node link carries it.
    pub fn to_wire(&self) -> crate::v1::CatalogueEntry {
        crate::v1::CatalogueEntry {
            id: self.id.clone(),
            architecture: self.architecture.clone(),
            parameters: self.parameters,
            active_parameters: self.active_parameters,
            quantization: self.quantization.clone(),
            context_length: self.context_length,
            license: self.license.clone(),
            files: self
                .files
                .iter()
                .map(|f| crate::v1::CatalogueFile {
                    name: f.name.clone(),
                    size_bytes: f.size_bytes,
                    sha256: f.digest().to_vec(),
                    mirrors: f.mirrors.clone(),
                    piece_bytes: f.piece_bytes,
                    pieces: (0..f.pieces.len())
                        .filter_map(|i| f.piece_digest(i))
                        .map(|d| d.to_vec())
                        .collect(),
                })
                .collect(),
            layers: self.layers,
            kv_heads: self.kv_heads,
            head_dim: self.head_dim,
            hidden_size: self.hidden_size,
            kv_element_bytes: self.kv_element_bytes,
            vocab_size: self.vocab_size,
        }
    }

    /// An entry from the node link, validated like one from TOML (a peer
    /// may send anything).
    pub fn from_wire(w: &crate::v1::CatalogueEntry) -> Result<CatalogueEntry, CatalogueError> {
        let digest = |b: &[u8], what: &str| -> Result<String, CatalogueError> {
            if b.len() == 32 {
                Ok(hex::encode(b))
            } else {
                Err(CatalogueError::File {
                    id: w.id.clone(),
                    file: what.to_owned(),
                    reason: format!("a digest of {} bytes (want 32)", b.len()),
                })
            }
        };
        let mut files = Vec::with_capacity(w.files.len());
        for f in &w.files {
            files.push(ModelFile {
                name: f.name.clone(),
                size_bytes: f.size_bytes,
                sha256: digest(&f.sha256, &f.name)?,
                mirrors: f.mirrors.clone(),
                piece_bytes: f.piece_bytes,
                pieces: f
                    .pieces
                    .iter()
                    .map(|p| digest(p, &f.name))
                    .collect::<Result<_, _>>()?,
            });
        }
        let entry = CatalogueEntry {
            id: w.id.clone(),
            architecture: w.architecture.clone(),
            parameters: w.parameters,
            active_parameters: w.active_parameters,
            quantization: w.quantization.clone(),
            context_length: w.context_length,
            license: w.license.clone(),
            price_input_per_mtok: None,
            price_output_per_mtok: None,
            layers: w.layers,
            kv_heads: w.kv_heads,
            head_dim: w.head_dim,
            hidden_size: w.hidden_size,
            kv_element_bytes: w.kv_element_bytes,
            vocab_size: w.vocab_size,
            files,
        };
        entry.validate()?;
        Ok(entry)
    }
}

/// `1234567` -> `1.2M`.
pub fn human_count(n: u64) -> String {
    match n {
        n if n >= 1_000_000_000 => format!("{:.1}B", n as f64 / 1e9),
        n if n >= 1_000_000 => format!("{:.0}M", n as f64 / 1e6),
        n if n >= 1_000 => format!("{:.0}K", n as f64 / 1e3),
        n => n.to_string(),
    }
}

/// `253113024` -> `241.4 MiB`.
pub fn human_bytes(n: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut v = n as f64;
    let mut u = 0;
    while v >= 1024.0 && u + 1 < UNITS.len() {
        v /= 1024.0;
        u += 1;
    }
    if u == 0 {
        format!("{n} B")
    } else {
        format!("{v:.1} {}", UNITS[u])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry() -> CatalogueEntry {
        Catalogue::builtin()
            .get("smollm2-135m-instruct")
            .cloned()
            .expect("built-in entry")
    }

    #[test]
    fn the_builtin_catalogue_parses_and_pins_the_test_models() {
        let c = Catalogue::parse(BUILTIN).expect("built-in catalogue is valid");
        let smol = c.get("smollm2-135m-instruct").expect("smollm2");
        assert_eq!(
            smol.primary_file().sha256,
            "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
        );
        assert_eq!(smol.size_bytes(), 98_362_432);
        // 30 layers x 3 kv heads x 64 dims x 4 bytes x (K and V).
        assert_eq!(smol.kv_bytes_per_token(), Some(46_080));
        // `tokenizer.ggml.tokens` of each file.
        assert_eq!(smol.vocab_size, 49_152);
        let gemma = c.get("gemma3-270m").expect("gemma3");
        assert_eq!(
            gemma.primary_file().sha256,
            "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"
        );
        assert_eq!(gemma.license, "gemma");
        assert_eq!(gemma.vocab_size, 262_144);
        // Round trip through the TOML writer.
        assert_eq!(Catalogue::parse(&c.to_toml()).expect("round trip"), c);
        assert!(c.summary().contains("gemma3-270m"));
    }

    #[test]
    fn bad_entries_are_refused_naming_the_field() {
        let mut e = entry();
        e.id = "Bad Id".into();
        assert_eq!(e.validate(), Err(CatalogueError::BadId("Bad Id".into())));

        let mut e = entry();
        e.files[0].name = "../../etc/passwd".into();
        assert!(matches!(e.validate(), Err(CatalogueError::File { .. })));
        for name in ["a/b", ".hidden", "..", "", "a\\b"] {
            assert!(!is_plain_file_name(name), "{name:?}");
        }

        let mut e = entry();
        e.files[0].sha256 = e.files[0].sha256.to_uppercase();
        let err = e.validate().unwrap_err().to_string();
        assert!(err.contains("sha256"), "{err}");

        let mut e = entry();
        e.files[0].mirrors = vec!["file:///etc/passwd".into()];
        assert!(e.validate().unwrap_err().to_string().contains("mirror"));

        let mut e = entry();
        e.files[0].piece_bytes = 1 << 20;
        e.files[0].pieces = vec![e.files[0].sha256.clone()];
        assert!(e.validate().unwrap_err().to_string().contains("piece"));

        let mut e = entry();
        e.files.clear();
        assert_eq!(e.validate(), Err(CatalogueError::NoFiles(e.id.clone())));

        let mut e = entry();
        e.active_parameters = e.parameters + 1;
        assert!(matches!(e.validate(), Err(CatalogueError::Field { .. })));

        assert!(matches!(
            Catalogue::parse("[[model]]\nid = 3"),
            Err(CatalogueError::Syntax(_))
        ));
        assert!(matches!(
            Catalogue::parse("[[model]]\nid = \"x\"\nsurprise = 1"),
            Err(CatalogueError::Syntax(_))
        ));
    }

    #[test]
    fn add_and_remove_keep_ids_unique() {
        let mut c = Catalogue::default();
        c.add(entry(), false).expect("add");
        assert_eq!(
            c.add(entry(), false),
            Err(CatalogueError::Duplicate(entry().id))
        );
        let mut changed = entry();
        changed.license = "mit".into();
        c.add(changed, true).expect("replace");
        assert_eq!(c.models.len(), 1);
        assert_eq!(c.models[0].license, "mit");
        c.remove(&entry().id).expect("remove");
        assert!(matches!(c.remove("nope"), Err(CatalogueError::NotFound(_))));
        let dup = Catalogue {
            models: vec![entry(), entry()],
        };
        assert!(matches!(dup.validate(), Err(CatalogueError::Duplicate(_))));
    }

    #[test]
    fn entries_cross_the_wire_unchanged_and_bad_ones_are_refused() {
        for e in Catalogue::builtin().models {
            let back = CatalogueEntry::from_wire(&e.to_wire()).expect("valid");
            // Prices are the coordinator's business, not the node's.
            assert_eq!(
                back,
                CatalogueEntry {
                    price_input_per_mtok: None,
                    price_output_per_mtok: None,
                    ..e
                }
            );
        }
        let mut w = entry().to_wire();
        w.files[0].sha256.pop();
        assert!(CatalogueEntry::from_wire(&w).is_err());
        let mut w = entry().to_wire();
        w.files[0].name = "../x".into();
        assert!(CatalogueEntry::from_wire(&w).is_err());
        let mut w = entry().to_wire();
        w.files[0].pieces.pop();
        assert!(CatalogueEntry::from_wire(&w).is_err());
    }

    #[test]
    fn pieces_cover_the_file() {
        let mut f = entry().files[0].clone();
        f.size_bytes = 10;
        f.piece_bytes = 4;
        assert_eq!(f.piece_range(0), 0..4);
        assert_eq!(f.piece_range(2), 8..10);
        assert_eq!(f.piece_range(3), 10..10);
    }

    #[test]
    fn sizes_print_for_people() {
        assert_eq!(human_bytes(253_113_024), "241.4 MiB");
        assert_eq!(human_bytes(12), "12 B");
        assert_eq!(human_count(268_098_176), "268M");
        assert_eq!(human_count(1_500_000_000), "1.5B");
    }
}
