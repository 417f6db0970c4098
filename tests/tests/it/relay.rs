//! Three coordinator replicas on one PostgreSQL database: jobs submitted
//! through replica A, watched through every replica, run on a real node
//! connected only to replica C. Each watcher gets the whole stream, in
//! order, then the verified result.

use mlxnet_proto::{
    claim,
    v1::{job_event, JobState},
};
use mlxnet_tests::{
    chat_job,
    relay::{spawn_replicas, Watch},
    spawn_node, state, test_model,
};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn jobs_submitted_on_a_run_on_c_and_stream_whole_to_watchers_on_every_replica(
) -> anyhow::Result<()> {
    let Some(server) = mlxnet_coordinator::test_utils::postgres::pg_server_url() else {
        return Ok(());
    };
    test_model();
    let dir = tempfile::tempdir()?;
    let replicas = spawn_replicas(
        dir.path(),
        &server,
        &["replica-a", "replica-b", "replica-c"],
    )
    .await?;
    let (a, b, c) = (&replicas[0], &replicas[1], &replicas[2]);
    let mut submitter = a.client().await?;
    let mut watchers = [a.client().await?, b.client().await?, c.client().await?];

    let questions = [
        "What is the capital of France?",
        "Name a color of the sky.",
        "What do bees make?",
    ];
    // Every job is submitted and watched through each replica before any
    // node exists, so each watch follows its job from the start.
    let mut jobs = Vec::new();
    for q in questions {
        let request = chat_job(q, 40);
        let input = request.input.clone().unwrap();
        let job = submitter.jobs.submit(request).await?.into_inner();
        let mut watches = Vec::new();
        for w in watchers.iter_mut() {
            let watch = Watch::open(w, &job.id).await?;
            assert!(
                matches!(watch.first.event, Some(job_event::Event::Queued(_))),
                "a job no node can run yet is queued: {:?}",
                watch.first
            );
            watches.push(watch);
        }
        jobs.push((job.id, input, watches));
    }

    // The only node, connected only to replica C.
    let mut node = spawn_node(c.node_config(&dir.path().join("node"), "node")).await?;
    node.registered().await?;

    for (job_id, input, watches) in jobs {
        let seen = futures::future::try_join_all(watches.into_iter().map(Watch::completed)).await?;
        for (watched, through) in seen.iter().zip(["A", "B", "C"]) {
            let job = &watched.job;
            assert_eq!(
                state(job),
                JobState::Completed,
                "through {through}: {job:?}"
            );
            assert!(
                !watched.token_ids.is_empty(),
                "through {through}: no tokens"
            );
            let signed = job.result.clone().expect("a completed job has its claim");
            let signer = claim::verify(&signed).expect("the claim verifies");
            assert_eq!(signer, node.id, "through {through}: signed by the node");
            let c = signed.claim.expect("a signed claim");
            assert_eq!(c.job_id, job_id);
            assert_eq!(c.prompt_sha256, claim::input_digest(&input).to_vec());
            assert_eq!(
                c.output_token_ids, watched.token_ids,
                "through {through}: the streamed ids are the claim's"
            );
            assert_eq!(
                c.output_text, watched.text,
                "through {through}: the streamed text is the claim's"
            );
        }
    }
    // Per replica: only C, whose node ran the jobs, wrote token batches.
    for (r, name, wrote) in [
        (a, "replica-a", false),
        (b, "replica-b", false),
        (c, "replica-c", true),
    ] {
        let metrics = mlxnet_coordinator::test_utils::http_get(r.http_addr, "/metrics").await;
        let batches = metrics
            .lines()
            .find_map(|l| {
                l.strip_prefix(&format!(
                    "mlxnet_relay_token_batches_total{{replica=\"{name}\"}} "
                ))
            })
            .map_or(0, |v| v.trim().parse::<u64>().unwrap());
        assert_eq!(batches > 0, wrote, "{name} wrote {batches} token batches");
    }
    node.stop().await?;
    for r in replicas {
        r.stop().await?;
    }
    Ok(())
}
