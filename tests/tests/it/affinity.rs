//! Prefix affinity (issue 25): the next turn of a conversation goes to the
//! node that ran the last one, whose prefix cache then serves its prefix.

use mlxnet_proto::v1::{job_input, ChatMessage, ChatMessages, JobInput, JobState};
use mlxnet_tests::{
    chat_job, coordinator_config, spawn_coordinator, spawn_node, state, test_model, within,
};

/// A system prompt of a few hundred tokens: many full KV pages to share.
fn long_system_prompt() -> String {
    let mut s = String::from("You are a careful assistant for a small bakery. ");
    for i in 0..40 {
        s.push_str(&format!(
            "Rule {i}: answer politely, name prices in euros, and never promise a delivery time. "
        ));
    }
    s
}

fn chat(turns: &[(&str, &str)], max_tokens: u32) -> mlxnet_proto::v1::SubmitJobRequest {
    let mut job = chat_job("unused", max_tokens);
    job.input = Some(JobInput {
        kind: Some(job_input::Kind::Chat(ChatMessages {
            messages: turns
                .iter()
                .map(|(role, content)| ChatMessage {
                    role: (*role).into(),
                    content: (*content).into(),
                })
                .collect(),
        })),
    });
    job
}

/// The coordinator's counter `name` (0 when absent).
async fn metric(addr: std::net::SocketAddr, name: &str) -> u64 {
    let text = mlxnet_coordinator::test_utils::http_get(addr, "/metrics").await;
    text.lines()
        .find_map(|l| l.strip_prefix(&format!("{name} ")))
        .map_or(0, |v| v.trim().parse::<f64>().unwrap_or(0.0) as u64)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_second_turn_of_a_chat_runs_where_its_prefix_is_cached() -> anyhow::Result<()> {
    test_model();
    let dir = tempfile::tempdir()?;
    let mut config = coordinator_config(&dir.path().join("coord"));
    config.heartbeat_interval_ms = 100;
    let coord = spawn_coordinator(config).await?;

    // Node A alone runs the first turn.
    let mut a = spawn_node(coord.node_config(&dir.path().join("a"), "a")).await?;
    a.registered().await?;
    let system = long_system_prompt();
    let q1 = "Do you sell rye bread?";
    let mut client = coord.client().await?;
    let first = client
        .jobs
        .submit(chat(&[("system", &system), ("user", q1)], 8))
        .await?
        .into_inner();
    let run1 = client.follow(first.id).await?;
    assert_eq!(state(&run1.job), JobState::Completed, "{:?}", run1.job);
    assert_eq!(run1.job.node_id, a.id.to_string());

    // Node B joins, offering less memory: the tighter fit, so a plain tie
    // between the two idle nodes would go to B.
    let mut b_config = coord.node_config(&dir.path().join("b"), "b");
    b_config.lending.memory_cap_bytes = Some(2 << 30);
    let mut b = spawn_node(b_config).await?;
    b.registered().await?;
    let hits_before = metric(coord.http_addr, "mlxnet_node_prefix_hit_tokens_total").await;

    // The second turn: the first turn, its answer, and a new question.
    let second = client
        .jobs
        .submit(chat(
            &[
                ("system", &system),
                ("user", q1),
                ("assistant", &run1.job.output_text),
                ("user", "And how much is it?"),
            ],
            // One token: the job is its prefill. A's estimate counts only
            // the prefill of the two new messages (it holds the rest), so
            // whatever speeds the two nodes measured or a's first job
            // showed on a loaded machine, b is not faster. (Before that
            // credit, a's slower figures on a loaded machine sent this turn
            // to b: seen in a whole-suite run under load.)
            1,
        ))
        .await?
        .into_inner();
    let run2 = client.follow(second.id).await?;
    assert_eq!(state(&run2.job), JobState::Completed, "{:?}", run2.job);
    assert_eq!(
        run2.job.node_id,
        a.id.to_string(),
        "the second turn went to node b ({}), not to a, which holds its prefix",
        b.id
    );
    assert_eq!(
        metric(coord.http_addr, "mlxnet_prefix_affinity_placements_total").await,
        1
    );
    // A's heartbeats report the prefix-cache hit of the second turn.
    let hits = within("a heartbeat reporting prefix-cache hits", async {
        loop {
            let hits = metric(coord.http_addr, "mlxnet_node_prefix_hit_tokens_total").await;
            if hits > hits_before {
                return hits;
            }
            tokio::time::sleep(std::time::Duration::from_millis(50)).await;
        }
    })
    .await?;
    assert!(hits >= 16, "{hits} prefix-hit tokens");

    // A third conversation sharing nothing but the model goes by the plain
    // rule again (the tighter fit, B): affinity follows prefixes, not nodes.
    let other = client
        .jobs
        .submit(chat(&[("user", "Something unrelated.")], 4))
        .await?
        .into_inner();
    let run3 = client.follow(other.id).await?;
    assert_eq!(state(&run3.job), JobState::Completed, "{:?}", run3.job);
    assert_eq!(run3.job.node_id, b.id.to_string());
    a.stop().await?;
    b.stop().await?;
    Ok(())
}

/// A node that restarted (its prefix cache is gone) loses its affinity:
/// the next turn goes by the plain rule.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_that_restarted_loses_its_prefix_affinity() -> anyhow::Result<()> {
    test_model();
    let dir = tempfile::tempdir()?;
    let mut config = coordinator_config(&dir.path().join("coord"));
    config.heartbeat_interval_ms = 100;
    let coord = spawn_coordinator(config).await?;
    let a_config = coord.node_config(&dir.path().join("a"), "a");
    let mut a = spawn_node(a_config.clone()).await?;
    a.registered().await?;
    let system = long_system_prompt();
    let q1 = "Do you sell rye bread?";
    let mut client = coord.client().await?;
    let first = client
        .jobs
        .submit(chat(&[("system", &system), ("user", q1)], 8))
        .await?
        .into_inner();
    let run1 = client.follow(first.id).await?;
    assert_eq!(state(&run1.job), JobState::Completed, "{:?}", run1.job);
    assert_eq!(run1.job.node_id, a.id.to_string());

    // A restarts (same identity, a new session, an empty cache); B joins.
    let a_id = a.id;
    a.stop().await?;
    let mut a = spawn_node(a_config).await?;
    assert_eq!(a.id, a_id);
    a.registered().await?;
    let mut b_config = coord.node_config(&dir.path().join("b"), "b");
    b_config.lending.memory_cap_bytes = Some(2 << 30);
    let mut b = spawn_node(b_config).await?;
    b.registered().await?;

    let second = client
        .jobs
        .submit(chat(
            &[
                ("system", &system),
                ("user", q1),
                ("assistant", &run1.job.output_text),
                ("user", "And how much is it?"),
            ],
            // One token: the estimates then differ by at most one token's
            // time, well inside the near-best band's 1 s floor whatever
            // speed a's first job showed on a loaded machine.
            1,
        ))
        .await?
        .into_inner();
    let run2 = client.follow(second.id).await?;
    assert_eq!(state(&run2.job), JobState::Completed, "{:?}", run2.job);
    assert_eq!(
        run2.job.node_id,
        b.id.to_string(),
        "the second turn followed a's affinity although a restarted"
    );
    assert_eq!(
        metric(coord.http_addr, "mlxnet_prefix_affinity_placements_total").await,
        0
    );
    assert!(metric(coord.http_addr, "mlxnet_prefix_affinity_dropped_total").await >= 1);
    a.stop().await?;
    b.stop().await?;
    Ok(())
}
