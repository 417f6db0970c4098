//! A pod of three real node processes on loopback, one hostfile, tensor
//! parallel over the TCP collectives, serving the coordinator's job as one
//! unit.
//!
//! Each member is this test binary run again as [`pod_member_child`], which
//! builds and runs the same `Node` that `mlx-node run` runs, configured
//! through `MLX_NODE__*` variables (a separate process, so a member can be
//! killed). The reference is the single-node engine's greedy output on the
//! same prompt; a tensor-parallel split sums in another order, so the
//! outputs must agree token for token except where the reference's own top
//! two logits are within [`NEAR_TIE`] (the engine tests' rule), after which
//! the branches may part.

use std::{
    io::{BufRead, BufReader},
    net::TcpListener,
    path::Path,
    process::{Child, Command, Stdio},
    sync::mpsc,
    time::Duration,
};

use mlx_node::{
    config::NodeConfig,
    engine::{Engine, PromptInput},
};
use mlxnet_proto::v1::{job_event, JobState, WatchJobRequest};
use mlxnet_tests::{
    coordinator_config, prompt_job, spawn_coordinator, state, test_model, within, TestCoordinator,
    TEST_MODEL_ID,
};

/// Below this top-2 margin the reference's choice is a near tie (the
/// engine tests' `NEAR_TIE`).
const NEAR_TIE: f32 = 0.35;
const PROMPT: &str = "The capital of France is";
const MAX_TOKENS: u32 = 24;

/// One pod member process (see the module header).
#[test]
#[ignore = "run as a child process by the pod tests"]
fn pod_member_child() -> anyhow::Result<()> {
    // Run any other way (`--include-ignored`) there is no pod to join.
    if std::env::var_os("MLX_NODE__POD__HOSTFILE").is_none() {
        eprintln!("not started by a pod test: nothing to do");
        return Ok(());
    }
    if let Ok(filter) = std::env::var("TEST_LOG") {
        let _ = tracing_subscriber::fmt()
            .with_env_filter(filter)
            .with_writer(std::io::stderr)
            .try_init();
    }
    let config = NodeConfig::load(None, std::env::vars(), Default::default())?;
    let runtime = tokio::runtime::Runtime::new()?;
    runtime.block_on(async {
        let node = mlx_node::app::Node::build(config).await?;
        println!("node {}", node.node_id());
        node.run_until_stopped().await?;
        anyhow::Ok(())
    })
}

struct Member {
    child: Child,
    id: mpsc::Receiver<String>,
}

impl Drop for Member {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A base port with `n` free consecutive ports after it.
fn free_ports(n: u16) -> u16 {
    loop {
        let Ok(first) = TcpListener::bind("127.0.0.1:0") else {
            continue;
        };
        let Ok(addr) = first.local_addr() else {
            continue;
        };
        let base = addr.port();
        if base.checked_add(n).is_none() {
            continue;
        }
        let rest: Vec<_> = (1..n)
            .map_while(|i| TcpListener::bind(("127.0.0.1", base + i)).ok())
            .collect();
        if rest.len() == usize::from(n) - 1 {
            return base;
        }
    }
}

fn spawn_member(
    coord: &TestCoordinator,
    dir: &Path,
    hostfile: &Path,
    rank: usize,
    port: u16,
) -> anyhow::Result<Member> {
    let data = dir.join(format!("rank{rank}"));
    let mut cmd = Command::new(std::env::current_exe()?);
    cmd.args([
        "--exact",
        "pod::pod_member_child",
        "--ignored",
        "--nocapture",
    ])
    .env("MLX_NODE__DATA_DIR", &data)
    .env("MLX_NODE__COORDINATOR", coord.quic_addr.to_string())
    .env("MLX_NODE__COORDINATOR_FINGERPRINT", &coord.fingerprint)
    .env(
        "MLX_NODE__MODELS",
        format!("{TEST_MODEL_ID}={}", test_model().display()),
    )
    .env("MLX_NODE__NAME", format!("pod-rank-{rank}"))
    .env("MLX_NODE__THREADS", "1")
    .env("MLX_NODE__RECONNECT_MIN_MS", "50")
    .env("MLX_NODE__RECONNECT_MAX_MS", "500")
    .env(
        "MLX_NODE__OPERATOR_ACCOUNT",
        &coord.accounts.operator_account,
    )
    .env("MLX_NODE__POD__HOSTFILE", hostfile)
    .env("MLX_NODE__POD__RANK", rank.to_string())
    .env("MLX_NODE__POD__PORT", port.to_string())
    .env("MLX_NODE__POD__PARALLELISM", "tensor")
    // Equal speeds, so the plan (and with it the split sums' rounding) is the
    // same every run: three processes probing a loaded 2-core machine
    // measure different speeds and would get uneven shares at random.
    .env("MLX_NODE__POD__SPEED", "1")
    .env("MLX_NODE__POD__MAX_CONTEXT", "512")
    .stdout(Stdio::piped())
    .stderr(if std::env::var("TEST_LOG").is_ok() {
        Stdio::inherit()
    } else {
        Stdio::null()
    });
    let mut child = cmd.spawn()?;
    let stdout = child
        .stdout
        .take()
        .ok_or_else(|| anyhow::anyhow!("no stdout"))?;
    let (tx, id) = mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines().map_while(Result::ok) {
            if let Some(id) = line.strip_prefix("node ") {
                let _ = tx.send(id.to_owned());
            }
        }
    });
    Ok(Member { child, id })
}

/// Waits until the coordinator lists `n` online nodes.
async fn online(coord: &TestCoordinator, n: u32) -> anyhow::Result<()> {
    let mut client = coord.client().await?;
    within("pod members online", async {
        loop {
            let stats = client
                .network
                .stats(mlxnet_proto::v1::NetworkStatsRequest {})
                .await?
                .into_inner();
            if stats.nodes_online >= n {
                return anyhow::Ok(());
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    })
    .await?
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_three_process_pod_serves_a_job_like_one_node_and_a_lost_rank_requeues_it(
) -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let coord = spawn_coordinator(coordinator_config(&dir.path().join("coord"))).await?;
    let hostfile = dir.path().join("hostfile.json");
    std::fs::write(
        &hostfile,
        r#"[{"ssh": "m1", "ips": ["127.0.0.1"]}, {"ssh": "m2", "ips": ["127.0.0.1"]}, {"ssh": "m3", "ips": ["127.0.0.1"]}]"#,
    )?;
    let port = free_ports(3);
    let mut members = (0..3)
        .map(|rank| spawn_member(&coord, dir.path(), &hostfile, rank, port))
        .collect::<anyhow::Result<Vec<_>>>()?;
    let leader = within("the leader's id", async {
        tokio::task::block_in_place(|| members[0].id.recv_timeout(mlxnet_tests::DEADLINE))
    })
    .await??;
    online(&coord, 3).await?;

    // The single-node reference, greedy, with its margins.
    let reference = tokio::task::spawn_blocking(|| {
        let mut engine = Engine::load(&test_model())?;
        engine.greedy_trace(&PromptInput::Text(PROMPT.into()), MAX_TOKENS as usize)
    })
    .await??;

    let mut client = coord.client().await?;
    let run = client.run_job(prompt_job(PROMPT, MAX_TOKENS)).await?;
    assert_eq!(state(&run.job), JobState::Completed, "{:?}", run.job);
    // (The watch may repeat the assignment it joined after.)
    assert!(
        !run.assigned_to.is_empty() && run.assigned_to.iter().all(|n| *n == leader),
        "the leader speaks for the pod: {:?}",
        run.assigned_to
    );
    let claim = run
        .job
        .result
        .as_ref()
        .and_then(|r| r.claim.as_ref())
        .ok_or_else(|| anyhow::anyhow!("no claim"))?;
    assert_eq!(claim.output_token_ids, run.streamed_ids);
    assert_eq!(claim.output_text, run.streamed_text);
    let got = &run.streamed_ids;
    let mut compared = 0;
    for (i, &(want, margin)) in reference.iter().enumerate() {
        match got.get(i) {
            Some(&t) if t == want => compared += 1,
            Some(&t) => {
                assert!(
                    margin < NEAR_TIE,
                    "token {i}: pod {t}, single node {want}, margin {margin} is no near tie"
                );
                break;
            }
            None => panic!("the pod stopped after {i} tokens, the single node went on"),
        }
    }
    assert!(
        compared * 2 >= reference.len(),
        "only {compared} of {} tokens compared",
        reference.len()
    );
    eprintln!(
        "pod (tensor x3) vs single node: {compared} of {} tokens equal: {:?}",
        reference.len(),
        run.streamed_text
    );

    // A rank killed mid-job: the job fails on the pod with a clear reason
    // and goes back to the queue; nothing hangs.
    let job = client
        .jobs
        // Greedy counting goes on until max_tokens.
        .submit(prompt_job("1, 2, 3, 4, 5, 6, 7, 8,", 16))
        .await?
        .into_inner();
    let mut events = client
        .jobs
        .watch(WatchJobRequest {
            job_id: job.id.clone(),
        })
        .await?
        .into_inner();
    let mut killed = false;
    let requeued = within("the requeue after a lost rank", async {
        while let Some(event) = events.message().await? {
            match event.event {
                Some(job_event::Event::Tokens(_)) if !killed => {
                    members[2].child.kill()?;
                    members[2].child.wait()?;
                    killed = true;
                }
                Some(job_event::Event::Queued(q)) if killed => return anyhow::Ok(q),
                Some(job_event::Event::Completed(c)) => anyhow::bail!(
                    "completed despite a lost rank (killed: {killed}): {:?}",
                    c.job
                        .and_then(|j| j.result)
                        .and_then(|r| r.claim)
                        .map(|c| c.output_text)
                ),
                Some(job_event::Event::Failed(f)) => anyhow::bail!("failed: {}", f.reason),
                _ => {}
            }
        }
        anyhow::bail!("event stream ended")
    })
    .await??;
    assert_eq!(requeued.attempt, 2);
    // The leader sees whichever member failed first: rank 2 itself, or
    // rank 1, which shuts its links down when it loses rank 2.
    assert!(
        requeued.reason.contains("pod broke during the job")
            && requeued.reason.contains("pod member"),
        "the reason says the pod lost a member: {}",
        requeued.reason
    );

    // The member comes back; the pod forms again and serves the requeued job.
    members[2] = spawn_member(&coord, dir.path(), &hostfile, 2, port)?;
    let done = client.follow(job.id).await?;
    assert_eq!(state(&done.job), JobState::Completed, "{:?}", done.job);
    assert_eq!(done.job.attempt, 2);
    drop(members);
    coord.stop().await?;
    Ok(())
}
