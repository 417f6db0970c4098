//! The model catalogue: the only models a job may name, each pinned to the
//! SHA-256 of its file.
//!
//! # Invariants
//! - Ids are unique; every digest is 32 bytes (checked by the config).
//! - A node "serves" a model only if its Hello reported a cached file with the
//!   catalogue's digest for that id; a matching id with another digest does not count.
//!
//! The models come from the config's `catalogue` list and the catalogue file
//! ([`file`], in the shared format of `mlxnet_proto::catalogue`), read at start.

pub mod file;

use std::collections::HashMap;

use serde::Deserialize;

use crate::{
    domain::Price,
    scheduler::{JobShape, ModelShape},
};

/// One model of the catalogue: the only models jobs may name.
#[derive(Clone, Debug, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct CatalogueModel {
    pub id: String,
    #[serde(default)]
    pub architecture: String,
    #[serde(default)]
    pub parameters: u64,
    /// Size of the model file in bytes (what a node must hold in memory).
    pub size_bytes: u64,
    /// Lowercase hex SHA-256 of the model file.
    pub sha256: String,
    #[serde(default = "default_context_length")]
    pub context_length: u32,
    /// Tokens in the model's vocabulary (0 = unknown): a job's `logit_bias`
    /// ids are checked against it at submission (the node checks them too).
    #[serde(default)]
    pub vocab_size: u32,
    /// KV-cache bytes per token of context, for the placement memory
    /// estimate when the architecture fields below are not given.
    #[serde(default = "default_kv_bytes_per_token")]
    pub kv_bytes_per_token: u64,
    /// Micro-MLX per million prompt tokens. Default: one per thousand
    /// parameters (so bigger models cost more), at least 1.
    #[serde(default)]
    pub price_input_per_mtok: Option<u64>,
    /// Micro-MLX per million generated tokens. Default: twice the input price.
    #[serde(default)]
    pub price_output_per_mtok: Option<u64>,
    /// Architecture for the placement cost model (0 = unknown): transformer
    /// layers, KV heads, head dimension, hidden size, bytes per KV-cache
    /// element, and parameters used per token (mixture of experts; 0 = all).
    #[serde(default)]
    pub layers: u32,
    #[serde(default)]
    pub kv_heads: u32,
    #[serde(default)]
    pub head_dim: u32,
    #[serde(default)]
    pub hidden_size: u32,
    #[serde(default)]
    pub kv_element_bytes: u32,
    #[serde(default)]
    pub active_parameters: u64,
}

fn default_context_length() -> u32 {
    2048
}

fn default_kv_bytes_per_token() -> u64 {
    // SmolLM2-135M: 2 (k, v) x 30 layers x 3 kv heads x 64 dims x 4 bytes.
    2 * 30 * 3 * 64 * 4
}

/// The catalogue entry of the test and demo model.
pub fn smollm2_135m_instruct() -> CatalogueModel {
    CatalogueModel {
        id: "smollm2-135m-instruct".into(),
        architecture: "llama".into(),
        parameters: 134_515_008,
        size_bytes: 98_362_432,
        sha256: "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53".into(),
        context_length: 8192,
        vocab_size: 49_152,
        kv_bytes_per_token: default_kv_bytes_per_token(),
        price_input_per_mtok: None,
        price_output_per_mtok: None,
        layers: 30,
        kv_heads: 3,
        head_dim: 64,
        hidden_size: 576,
        // The node's engine keeps the KV cache in f32.
        kv_element_bytes: 4,
        active_parameters: 0,
    }
}

/// A catalogue model with its digest decoded.
#[derive(Clone, Debug)]
pub struct Model {
    pub info: CatalogueModel,
    pub sha256: [u8; 32],
    /// What the placement cost model needs to know about it.
    pub shape: ModelShape,
}

impl Model {
    /// The model's price: configured, or by default one micro-MLX per
    /// thousand parameters per million prompt tokens (at least 1), and twice
    /// that per million generated tokens.
    pub fn price(&self) -> Price {
        let input = self
            .info
            .price_input_per_mtok
            .unwrap_or_else(|| (self.info.parameters / 1_000).max(1));
        Price {
            input_per_mtok: input,
            output_per_mtok: self
                .info
                .price_output_per_mtok
                .unwrap_or_else(|| input.saturating_mul(2)),
        }
    }

    /// The cost model's view of one job of this model. A token is at least
    /// one byte, so prompt bytes bound prompt tokens.
    pub fn job(&self, prompt_bytes: usize, max_tokens: u32) -> JobShape<'_> {
        JobShape {
            model: &self.shape,
            prompt_tokens: u32::try_from(prompt_bytes).unwrap_or(u32::MAX),
            max_tokens,
        }
    }

    /// Memory a node needs for one job: the weights plus the KV cache for the
    /// whole context the job may use, plus 10% overhead.
    pub fn memory_needed(&self, prompt_bytes: usize, max_tokens: u32) -> u64 {
        self.job(prompt_bytes, max_tokens).memory_needed()
    }

    /// The memory a node serving this model offers the network: one job
    /// using the model's whole context (what availability rewards pay for,
    /// once the node has shown it serves the model).
    pub fn capacity_bytes(&self) -> u64 {
        self.memory_needed(0, self.info.context_length)
    }
}

/// The cost model's shape of a catalogue entry. Without the architecture
/// fields, the flat `kv_bytes_per_token` stands in as one layer of one head.
fn shape(m: &CatalogueModel, sha256: [u8; 32]) -> ModelShape {
    let known = m.layers > 0 && m.kv_heads > 0 && m.head_dim > 0 && m.kv_element_bytes > 0;
    let (layers, kv_heads, head_dim, kv_element_bytes) = if known {
        (m.layers, m.kv_heads, m.head_dim, m.kv_element_bytes)
    } else {
        let half = m.kv_bytes_per_token.div_ceil(2);
        (1, 1, u32::try_from(half).unwrap_or(u32::MAX), 1)
    };
    ModelShape {
        id: m.id.clone(),
        sha256,
        parameters: m.parameters,
        active_parameters: m.active_parameters,
        weights_bytes: m.size_bytes,
        layers,
        kv_heads,
        head_dim,
        hidden_size: m.hidden_size,
        kv_element_bytes,
        context_length: m.context_length,
    }
}

/// Why the configured catalogue is unusable.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum CatalogueError {
    #[error("catalogue model {id}: sha256 must be 64 hex digits")]
    Digest { id: String },
    #[error("catalogue lists model {id} twice")]
    Duplicate { id: String },
}

/// The models jobs may name.
#[derive(Clone, Debug, Default)]
pub struct Catalogue {
    models: Vec<Model>,
    by_id: HashMap<String, usize>,
}

impl Catalogue {
    pub fn new(models: &[CatalogueModel]) -> Result<Self, CatalogueError> {
        let mut out = Catalogue::default();
        for m in models {
            let sha256: [u8; 32] = hex::decode(&m.sha256)
                .ok()
                .and_then(|b| b.try_into().ok())
                .ok_or_else(|| CatalogueError::Digest { id: m.id.clone() })?;
            if out.by_id.insert(m.id.clone(), out.models.len()).is_some() {
                return Err(CatalogueError::Duplicate { id: m.id.clone() });
            }
            out.models.push(Model {
                info: m.clone(),
                sha256,
                shape: shape(m, sha256),
            });
        }
        Ok(out)
    }

    pub fn get(&self, id: &str) -> Option<&Model> {
        self.by_id.get(id).map(|&i| &self.models[i])
    }

    pub fn models(&self) -> &[Model] {
        &self.models
    }

    /// The model whose file has SHA-256 `digest`.
    pub fn by_digest(&self, digest: &[u8; 32]) -> Option<&Model> {
        self.models.iter().find(|m| m.sha256 == *digest)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn looks_up_by_id_and_refuses_bad_digests() {
        let cat = Catalogue::new(&[smollm2_135m_instruct()]).unwrap();
        let m = cat.get("smollm2-135m-instruct").unwrap();
        assert_eq!(hex::encode(m.sha256), smollm2_135m_instruct().sha256);
        assert!(cat.get("gpt-5").is_none());
        assert!(m.memory_needed(100, 256) > m.info.size_bytes);
        // 2 x 30 layers x 3 kv heads x 64 dims x 4 bytes, for 356 tokens,
        // on top of the weights, plus 10%.
        assert_eq!(m.shape.kv_bytes_per_token(), 46_080);
        let raw = m.info.size_bytes + 356 * 46_080;
        assert_eq!(m.memory_needed(100, 256), raw + raw / 10);
        // The flat figure stands in when the architecture is not given.
        let mut flat = smollm2_135m_instruct();
        flat.layers = 0;
        flat.kv_bytes_per_token = 1000;
        let flat = Catalogue::new(&[flat]).unwrap();
        let m = flat.get("smollm2-135m-instruct").unwrap();
        assert_eq!(m.shape.kv_bytes_per_token(), 1000);

        let mut bad = smollm2_135m_instruct();
        bad.sha256 = "abc".into();
        assert!(matches!(
            Catalogue::new(&[bad]),
            Err(CatalogueError::Digest { .. })
        ));
        let dup = smollm2_135m_instruct();
        assert!(matches!(
            Catalogue::new(&[dup.clone(), dup]),
            Err(CatalogueError::Duplicate { .. })
        ));
    }
}
