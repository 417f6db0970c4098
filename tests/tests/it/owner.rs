//! The owner's Mac end to end: the owner comes back while a job runs (the
//! lending policy's signals are injected, the rest is real: coordinator,
//! nodes, model, QUIC), and the owner's live view (`mlx-node status`) in a
//! real terminal (tmux) shows the running job and today's earnings.

use std::{process::Command, time::Duration};

use anyhow::{bail, Context};
use mlx_node::{
    config::NodeMode,
    link::LinkStatus,
    policy::{InjectedSignals, LocalTime, Signals},
};
use mlxnet_proto::v1::{CancelJobRequest, JobState};
use mlxnet_tests::{
    chat_job, coordinator_config, prompt_job, spawn_coordinator, spawn_node, spawn_node_with,
    state, test_model, within,
};

use crate::handoff::{
    check_one_stream, claim_of, long_job_with_survivor, quick_config, streamed_at_least, Underway,
};

/// An owner who has been away for an hour.
fn away() -> Signals {
    Signals {
        idle: Some(Duration::from_secs(3600)),
        ..Signals::away(LocalTime::now())
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_owner_returning_hands_the_running_job_off_and_the_clients_stream_is_whole(
) -> anyhow::Result<()> {
    test_model();
    let dir = tempfile::tempdir()?;
    let coord = spawn_coordinator(quick_config(&dir.path().join("coord"))).await?;
    let mut config = coord.node_config(&dir.path().join("owner"), "owners-mac");
    config.mode = NodeMode::Idle;
    config.lending.min_idle_s = 60;
    config.lending.grace_ms = 300;
    config.lending.poll_ms = 20;
    // The shutdown grace is long: only the pause's grace can hand the job off.
    config.drain_grace_ms = 600_000;
    let (owner, signals) = InjectedSignals::new(away());
    let mut mac = spawn_node_with(config, Some(Box::new(signals))).await?;
    mac.registered().await?;
    let mac_id = mac.id.to_string();

    let Underway {
        mut client,
        request,
        followed,
        survivor,
    } = long_job_with_survivor(&coord, dir.path()).await?;

    // The owner touches the keyboard: idle time zero.
    owner.send_replace(Signals {
        idle: Some(Duration::ZERO),
        ..away()
    });
    let paused = within(
        "the node to pause",
        mac.status
            .wait_for(|s| matches!(s, LinkStatus::Paused { .. })),
    )
    .await?
    .map_err(|_| anyhow::anyhow!("node stopped"))?
    .clone();
    let LinkStatus::Paused { reason } = paused else {
        unreachable!()
    };
    assert!(reason.starts_with("you are using"), "{reason}");

    // The job went on elsewhere after the tokens the Mac streamed: one
    // stream, no gap, no repeat; the Mac signed what it streamed.
    let run = within("the handed-off job", followed).await???;
    let cut = check_one_stream(&run, &request, &mac_id, &survivor.id.to_string())?;
    assert!(
        cut < run.streamed_ids.len(),
        "the Mac finished the job instead of handing it off"
    );
    let journal = std::fs::read_to_string(
        dir.path()
            .join("owner")
            .join(mlx_node::status::JOURNAL_FILE),
    )?;
    let entry: mlx_node::status::JournalEntry =
        serde_json::from_str(journal.lines().next().context("an empty journal")?)?;
    assert_eq!(
        (entry.finish.as_str(), entry.tokens as usize),
        ("handoff", cut)
    );

    // While the owner is here, jobs go elsewhere.
    let other = client
        .run_job(prompt_job("The capital of France is", 4))
        .await?;
    assert_eq!(state(&other.job), JobState::Completed);
    assert_eq!(other.assigned_to, vec![survivor.id.to_string()]);

    // The owner leaves again (idle for an hour): the Mac comes back.
    owner.send_replace(away());
    mac.registered().await?;
    mac.stop().await?;
    survivor.stop().await?;
    Ok(())
}

/// The view of [`the_live_status_view_shows_the_running_job_and_todays_earnings`],
/// run in tmux: `mlx_node::status::run_view`, what `mlx-node status` runs.
#[test]
#[ignore = "run inside tmux by the_live_status_view_shows_the_running_job_and_todays_earnings"]
fn status_view_child() -> anyhow::Result<()> {
    let var = |k: &str| std::env::var(k).with_context(|| format!("{k} is not set"));
    let args = mlx_node::status::ViewArgs {
        data_dir: var("OWNER_STATUS_DIR")?.into(),
        grpc: var("OWNER_GRPC")?,
        api_key: Some(var("OWNER_KEY")?),
        price_micro_per_kwh: 0,
        once: false,
    };
    tokio::runtime::Runtime::new()?.block_on(mlx_node::status::run_view(args))?;
    Ok(())
}

/// A tmux server of its own (its socket named for this test).
struct Tmux(String);

impl Tmux {
    fn run(&self, args: &[&str]) -> anyhow::Result<String> {
        let out = Command::new("tmux")
            .args(["-L", &self.0, "-f", "/dev/null"])
            .args(args)
            .output()
            .context("running tmux (apt-get install tmux)")?;
        if !out.status.success() {
            bail!(
                "tmux {args:?}: {}",
                String::from_utf8_lossy(&out.stderr).trim()
            );
        }
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    }
}

impl Drop for Tmux {
    fn drop(&mut self) {
        let _ = self.run(&["kill-server"]);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_live_status_view_shows_the_running_job_and_todays_earnings() -> anyhow::Result<()> {
    test_model();
    let dir = tempfile::tempdir()?;
    let coord = spawn_coordinator(coordinator_config(&dir.path().join("coord"))).await?;
    let node_dir = dir.path().join("node");
    let mut node = spawn_node(coord.node_config(&node_dir, "studio-in-lyon")).await?;
    node.registered().await?;
    let mut client = coord.client().await?;
    // A first job earns something today.
    let first = client
        .run_job(chat_job("What is the capital of France?", 16))
        .await?;
    assert_eq!(state(&first.job), JobState::Completed);
    let paid = claim_of(&first)?;
    assert!(paid.completion_tokens > 0);

    // A second, long one runs while the owner looks.
    let job = client
        .jobs
        .submit(prompt_job(
            "Once upon a time, in a small village by the sea,",
            4000,
        ))
        .await?
        .into_inner();
    streamed_at_least(&mut client, &job.id, 4).await?;

    let tmux = Tmux(format!("mlx-status-{}", std::process::id()));
    let exe = std::env::current_exe()?;
    let cmd = format!(
        "env OWNER_STATUS_DIR='{}' OWNER_GRPC='http://{}' OWNER_KEY='{}' '{}' --exact owner::status_view_child --ignored --nocapture",
        node_dir.display(),
        coord.grpc_addr,
        coord.accounts.operator_key,
        exe.display()
    );
    tmux.run(&[
        "new-session",
        "-d",
        "-s",
        "view",
        "-x",
        "150",
        "-y",
        "45",
        &cmd,
    ])?;
    let job_line = format!("job        {} on smollm2-135m-instruct:", job.id);
    let screen = within("the view to show the job and the earnings", async {
        loop {
            let screen = tmux.run(&["capture-pane", "-p", "-t", "view"])?;
            let earned_today = screen
                .lines()
                .find(|l| l.trim_start().starts_with("today") && l.contains(" MLX "))
                .is_some_and(|l| !l.contains(" 0.000000 MLX"));
            if screen.contains(&job_line) && earned_today {
                return anyhow::Ok(screen);
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    })
    .await??;
    assert!(screen.contains("state      lending"), "{screen}");
    assert!(screen.contains("tokens/s"), "{screen}");
    // Today's work from the node's journal: the first job.
    let work_today = screen
        .lines()
        .find(|l| l.trim_start().starts_with("today") && l.contains("tokens"))
        .context("no work line")?;
    assert!(
        work_today.contains(&format!(" {} tokens", paid.completion_tokens)),
        "{work_today}\n{screen}"
    );
    client
        .jobs
        .cancel(CancelJobRequest {
            job_id: job.id.clone(),
        })
        .await?;
    drop(tmux);
    node.stop().await?;
    Ok(())
}
