//! Several coordinator replicas on one PostgreSQL database, and a strict
//! watcher: what the cross-replica token relay is tested with.
//!
//! # Invariants
//! - Every replica is a real `Application` on port 0 with a data directory
//!   of its own and a replica id of its own; they share one fresh database
//!   and one set of harness accounts (made by the first, read by the rest).
//! - [`Watch`] accepts a token chunk only at the index it expects next: a
//!   gap, a repeat or a rewind fails the watch instead of being repaired,
//!   so a stream it returns is whole and in order.
//!
//! # Failure
//! Without a PostgreSQL server (`MLXNET_TEST_DATABASE_URL` unset) the
//! caller skips (`test_utils::postgres::pg_server_url` says so); under CI
//! (`CI` set) that is a failure.

use std::path::Path;

use anyhow::{bail, Context};
use mlxnet_proto::v1::{job_event, Job, JobEvent, WatchJobRequest};

use crate::{coordinator_config, spawn_coordinator, within, Client, TestCoordinator};

/// Starts `names.len()` replicas, each named by its entry, on a fresh
/// database of the PostgreSQL server at `server`, with data under `dir`.
pub async fn spawn_replicas(
    dir: &Path,
    server: &str,
    names: &[&str],
) -> anyhow::Result<Vec<TestCoordinator>> {
    let url = mlxnet_coordinator::test_utils::postgres::pg_fresh_database(server)
        .await
        .context("creating a fresh database")?;
    let mut replicas: Vec<TestCoordinator> = Vec::with_capacity(names.len());
    for name in names {
        let data_dir = dir.join(name);
        std::fs::create_dir_all(&data_dir)?;
        if let Some(first) = replicas.first() {
            // The accounts live in the shared database: the later replicas
            // read the first one's keys instead of making their own.
            std::fs::copy(
                first.config.data_dir.join(crate::ACCOUNTS_FILE),
                data_dir.join(crate::ACCOUNTS_FILE),
            )?;
        }
        let mut config = coordinator_config(&data_dir);
        config.database_url = Some(url.clone());
        config.replica_id = Some((*name).to_string());
        replicas.push(
            spawn_coordinator(config)
                .await
                .with_context(|| format!("starting replica {name}"))?,
        );
    }
    Ok(replicas)
}

/// A job's event stream, opened and past its first event.
pub struct Watch {
    stream: tonic::Streaming<JobEvent>,
    /// The first event (the job's state when the watch began).
    pub first: JobEvent,
}

/// What a [`Watch`] saw to the job's end.
#[derive(Debug)]
pub struct Watched {
    pub text: String,
    pub token_ids: Vec<u32>,
    /// The completed job, as its Completed event carried it.
    pub job: Job,
}

impl Watch {
    /// Opens a watch of `job_id` through `client` and waits for its first
    /// event, so the watch is live before anything runs the job.
    pub async fn open(client: &mut Client, job_id: &str) -> anyhow::Result<Self> {
        let mut stream = client
            .jobs
            .watch(WatchJobRequest {
                job_id: job_id.to_string(),
            })
            .await?
            .into_inner();
        let first = within("the watch's first event", stream.message())
            .await??
            .context("the watch ended before its first event")?;
        Ok(Self { stream, first })
    }

    /// Follows the job to its end, strictly: each token chunk must start
    /// where the last ended, and the job must complete.
    pub async fn completed(mut self) -> anyhow::Result<Watched> {
        let mut text = String::new();
        let mut token_ids = Vec::new();
        let mut seen = vec![self.first.clone()];
        let job = within("the job's end", async {
            loop {
                let Some(event) = self.stream.message().await? else {
                    bail!("the watch ended without the job's end; events: {seen:?}");
                };
                seen.push(event.clone());
                match event.event {
                    Some(job_event::Event::Tokens(t)) => {
                        if t.index as usize != token_ids.len() {
                            bail!(
                                "token chunk at index {} after {} tokens (a gap or a repeat)",
                                t.index,
                                token_ids.len()
                            );
                        }
                        text.push_str(&t.text);
                        token_ids.extend(t.token_ids);
                    }
                    Some(job_event::Event::Completed(c)) => {
                        return c.job.context("a Completed event carries its job");
                    }
                    Some(job_event::Event::Failed(f)) => bail!("the job failed: {}", f.reason),
                    Some(job_event::Event::Cancelled(_)) => bail!("the job was cancelled"),
                    Some(job_event::Event::Queued(_)) | Some(job_event::Event::Assigned(_)) => {}
                    None => {}
                }
            }
        })
        .await??;
        Ok(Watched {
            text,
            token_ids,
            job,
        })
    }
}
