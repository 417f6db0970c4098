//! Network: totals over nodes and jobs.

use std::sync::Arc;

use mlxnet_proto::v1::{network_server::Network, NetworkStats, NetworkStatsRequest};
use tonic::{Request, Response, Status};

use super::ApiContext;
use crate::{api::error::ApiError, store::Store};

pub struct NetworkApi {
    d: Arc<ApiContext>,
}

impl NetworkApi {
    pub fn new(d: Arc<ApiContext>) -> Self {
        Self { d }
    }
}

#[tonic::async_trait]
impl Network for NetworkApi {
    async fn stats(
        &self,
        _req: Request<NetworkStatsRequest>,
    ) -> Result<Response<NetworkStats>, Status> {
        let sessions = self.d.sessions.all();
        let jobs = self.d.store.job_stats().await.map_err(ApiError::from)?;
        let nodes_total = self.d.store.count_nodes().await.map_err(ApiError::from)?;
        Ok(Response::new(NetworkStats {
            nodes_online: sessions.len() as u32,
            nodes_total: nodes_total as u32,
            memory_bytes_online: sessions
                .iter()
                .map(|s| s.memory_bytes)
                .fold(0, u64::saturating_add),
            jobs_queued: jobs.queued,
            jobs_running: jobs.running,
            jobs_completed: jobs.completed,
            jobs_failed: jobs.failed,
            tokens_generated: jobs.tokens_generated,
        }))
    }
}
