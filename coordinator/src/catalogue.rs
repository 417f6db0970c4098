//! The model catalogue: the only models a job may name, each pinned to the
//! SHA-256 of its file.
//!
//! # Invariants
//! - Ids are unique; every digest is 32 bytes (checked by the config).
//! - A node "serves" a model only if its Hello reported a cached file with the
//!   catalogue's digest for that id; a matching id with another digest does not count.

use std::collections::HashMap;

use crate::config::CatalogueModel;

/// A catalogue model with its digest decoded.
#[derive(Clone, Debug)]
pub struct Model {
    pub info: CatalogueModel,
    pub sha256: [u8; 32],
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

    /// Memory a node needs for one job: the weights plus the KV cache for the
    /// whole context the job may use, plus 10% overhead.
    pub fn memory_needed(&self, prompt_bytes: usize, max_tokens: u32) -> u64 {
        // A token is at least one byte, so prompt bytes bound prompt tokens.
        let tokens = (prompt_bytes as u64 + u64::from(max_tokens))
            .min(u64::from(self.info.context_length.max(1)));
        let raw = self.info.size_bytes + tokens * self.info.kv_bytes_per_token;
        raw + raw / 10
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
