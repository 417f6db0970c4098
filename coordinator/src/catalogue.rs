//! The model catalogue: the only models a job may name, each pinned to the
//! SHA-256 of its file.
//!
//! # Invariants
//! - Ids are unique; every digest is 32 bytes (checked by the config).
//! - A node "serves" a model only if its Hello reported a cached file with the
//!   catalogue's digest for that id; a matching id with another digest does not count.

use std::collections::HashMap;

use crate::{
    config::CatalogueModel,
    scheduler::{JobShape, ModelShape},
};

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
    pub fn price(&self) -> crate::ledger::Price {
        let input = self
            .info
            .price_input_per_mtok
            .unwrap_or_else(|| (self.info.parameters / 1_000).max(1));
        crate::ledger::Price {
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
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::smollm2_135m_instruct;

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
