//! A fresh node pulls a catalogue model from a mirror (a real HTTP server on
//! a port the OS chose), checks its digest, and then serves it.

use mlx_node::models::{
    download::{DownloadConfig, Downloader},
    progress::LogLines,
    store::{ModelStore, Pulled},
};
use mlxnet_proto::{catalogue::Catalogue, claim, v1::JobState};
use mlxnet_tests::{
    chat_job, coordinator_config, mirror::spawn_mirror, repo_root, spawn_coordinator, spawn_node,
    state, test_model, TEST_MODEL_ID,
};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_serves_a_model_once_it_is_pulled() -> anyhow::Result<()> {
    test_model();
    let dir = tempfile::tempdir()?;
    let mirror = spawn_mirror(repo_root().join("models")).await?;
    let coord = spawn_coordinator(coordinator_config(&dir.path().join("coord"))).await?;
    let mut config = coord.node_config(&dir.path().join("node"), "fresh");
    // Nothing configured by path: what the store holds is all it serves.
    config.models.clear();

    let entry = Catalogue::builtin()
        .get(TEST_MODEL_ID)
        .cloned()
        .expect("the built-in catalogue has the test model");
    let store = ModelStore::open(config.store.dir_in(&config.data_dir), config.store.policy())?;
    let pulled = store
        .pull(
            &entry,
            &Downloader::new(DownloadConfig::default())?,
            &[mirror.base_url()],
            &[],
            &mut LogLines::default(),
        )
        .await?;
    assert_eq!(pulled, Pulled::Installed { evicted: vec![] });
    assert_eq!(mirror.bytes_sent(), entry.size_bytes());
    drop(store);

    let mut node = spawn_node(config).await?;
    node.registered().await?;
    let mut client = coord.client().await?;
    let run = client
        .run_job(chat_job("What is the capital of France?", 24))
        .await?;
    assert_eq!(state(&run.job), JobState::Completed, "{:?}", run.job);
    let signed = run.job.result.clone().expect("a signed claim");
    assert_eq!(claim::verify(&signed)?, node.id);
    let c = signed.claim.unwrap_or_default();
    assert_eq!(hex::encode(&c.model_sha256), entry.primary_file().sha256);
    node.stop().await?;
    Ok(())
}
