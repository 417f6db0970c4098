//! The relay between two replicas on one database: a follower on one gets
//! every chunk the other writes, in order, whether or not the wake-ups
//! arrive (a lost notification only delays); a notification alone wakes a
//! follower on PostgreSQL.

use std::time::Duration;

use super::*;
use crate::{
    metrics::Gauges,
    store::tests::{Backend, Postgres, Sqlite},
};

/// Longest any wait here may take: a guard against a hang, not a verdict.
const DEADLINE: Duration = Duration::from_secs(120);

fn chunk(index: u32) -> job_event::Tokens {
    job_event::Tokens {
        index,
        token_ids: vec![index],
        text: format!("<{index}>"),
        logprobs: Vec::new(),
    }
}

fn relay(store: AnyStore, replica: &str, listen: bool, poll: Duration) -> (Relay, Arc<Metrics>) {
    let metrics = Arc::new(Metrics::default());
    let relay = Relay::start(RelayParts {
        store,
        metrics: Arc::clone(&metrics),
        replica: replica.into(),
        shutdown: CancellationToken::new(),
        listen,
        poll,
    });
    (relay, metrics)
}

/// The value of `series` for `replica` in `metrics`' exposition (0 if absent).
fn counted(metrics: &Metrics, series: &str, replica: &str) -> u64 {
    let line = format!("mlxnet_{series}_total{{replica=\"{replica}\"}} ");
    metrics
        .render(Gauges::default())
        .lines()
        .find_map(|l| l.strip_prefix(&line).map(|v| v.trim().parse().unwrap()))
        .unwrap_or(0)
}

/// Reads through `follower` until `want` chunks arrived, waiting on its
/// wake-ups (or polls) before each read: what it reads, a wake-up or a
/// poll told it to.
async fn read_all(follower: &mut Follower, want: usize) -> Vec<RelayChunk> {
    let mut got = Vec::new();
    tokio::time::timeout(DEADLINE, async {
        loop {
            follower.changed().await;
            got.extend(follower.read().await.unwrap());
            if got.len() >= want {
                return;
            }
        }
    })
    .await
    .unwrap_or_else(|_| panic!("only {} of {want} chunks arrived", got.len()));
    got
}

/// Every notification lost (the reader does not listen): polling alone
/// delivers every chunk, once and in order.
async fn a_lost_notification_only_delays_polling_delivers_every_chunk(b: impl Backend) {
    let job = JobId::new();
    let (writer, written) = relay(b.store().clone(), "w", false, POLL);
    let (reader, notified) = relay(b.another().await, "r", false, Duration::from_millis(50));
    let mut follower = reader.follow(job).unwrap();
    assert!(follower.read().await.unwrap().is_empty());
    for i in 0..600 {
        writer.tokens(job, 1, &chunk(i)).await;
    }
    writer.flush().await;
    let got = read_all(&mut follower, 600).await;
    let indexes: Vec<u32> = got.iter().map(|c| c.chunk.index).collect();
    assert_eq!(indexes, (0..600).collect::<Vec<_>>(), "whole and in order");
    assert!(got.iter().all(|c| c.attempt == 1 && c.job == job));
    assert_eq!(got[7].chunk, chunk(7), "chunks read back as written");
    assert_eq!(counted(&notified, "relay_notifications", "r"), 0);
    let batches = counted(&written, "relay_token_batches", "w");
    assert!(
        (1..600).contains(&batches),
        "600 chunks go in batches, not a row each: {batches} batches"
    );
}

#[tokio::test]
async fn sqlite_a_lost_notification_only_delays_polling_delivers_every_chunk() {
    a_lost_notification_only_delays_polling_delivers_every_chunk(Sqlite::fresh().await.unwrap())
        .await;
}

#[tokio::test]
async fn postgres_a_lost_notification_only_delays_polling_delivers_every_chunk() {
    match Postgres::fresh().await {
        Some(b) => a_lost_notification_only_delays_polling_delivers_every_chunk(b).await,
        None => eprintln!("PostgreSQL not available here"),
    }
}

/// PostgreSQL: with polling out of the picture (an hour), the writer's
/// notification alone wakes a follower on another replica, and is counted.
#[tokio::test]
async fn postgres_a_notification_wakes_a_follower_on_another_replica() {
    let Some(b) = Postgres::fresh().await else {
        eprintln!("PostgreSQL not available here");
        return;
    };
    let job = JobId::new();
    let (writer, _) = relay(b.store().clone(), "w", false, POLL);
    let (reader, notified) = relay(b.another().await, "r", true, Duration::from_secs(3600));
    reader.listening().await;
    let mut follower = reader.follow(job).unwrap();
    assert!(follower.read().await.unwrap().is_empty());
    writer.tokens(job, 1, &chunk(0)).await;
    writer.flush().await;
    tokio::time::timeout(DEADLINE, follower.changed())
        .await
        .expect("the notification woke the follower");
    let got = follower.read().await.unwrap();
    assert_eq!(got.len(), 1);
    assert!(counted(&notified, "relay_notifications", "r") >= 1);
}
