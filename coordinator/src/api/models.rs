//! Models: the catalogue, with how many online nodes hold each model file.

use std::sync::Arc;

use mlxnet_proto::v1::{models_server::Models, ListModelsRequest, ListModelsResponse, ModelInfo};
use tonic::{Request, Response, Status};

use super::ApiContext;

pub struct ModelsApi {
    d: Arc<ApiContext>,
}

impl ModelsApi {
    pub fn new(d: Arc<ApiContext>) -> Self {
        Self { d }
    }
}

#[tonic::async_trait]
impl Models for ModelsApi {
    async fn list(
        &self,
        _req: Request<ListModelsRequest>,
    ) -> Result<Response<ListModelsResponse>, Status> {
        let sessions = self.d.sessions.all();
        let models = self
            .d
            .catalogue
            .models()
            .iter()
            .map(|m| ModelInfo {
                id: m.info.id.clone(),
                architecture: m.info.architecture.clone(),
                parameters: m.info.parameters,
                size_bytes: m.info.size_bytes,
                sha256: m.sha256.to_vec(),
                context_length: m.info.context_length,
                price_input_micro_mlx_per_mtok: m.price().input_per_mtok,
                price_output_micro_mlx_per_mtok: m.price().output_per_mtok,
                nodes_serving: sessions.iter().filter(|s| s.serves(&m.sha256)).count() as u32,
            })
            .collect();
        Ok(Response::new(ListModelsResponse { models }))
    }
}
