//! A virtual node of the load run: the node link's real wire protocol
//! (QUIC with the pinned certificate, `Open`, the challenge signed over the
//! connection's exporter, `Hello`, heartbeats, one stream per job) in front
//! of a timed fake engine that says it is fake.
//!
//! Invariant: every token a fake streams is covered by the claim it signs
//! (`claim::sign` over exactly the ids and text streamed).
//!
//! Failure: a registration that fails is tried again with backoff
//! ([`register_backoff`]); a session that ends either ends the node (the
//! load run) or sends it back to registering (the process-kill run, where
//! the coordinator dies under it and comes back on the same address).

use std::{
    sync::{
        atomic::{AtomicU64, Ordering},
        Arc,
    },
    time::{Duration, Instant},
};

use anyhow::{anyhow, bail, Result};
use ed25519_dalek::{Signer, SigningKey};
use mlxnet_coordinator::config::smollm2_135m_instruct;
use mlxnet_proto::{
    auth, claim,
    frame::{read_frame, write_frame},
    v1::{
        coordinator_control, job_input, job_update, node_control, Assignment, CachedModel,
        CoordinatorControl, HardwareProfile, Heartbeat, Hello, JobUpdate, NodeControl, Open,
        ResultClaim,
    },
};
use rand::{rngs::StdRng, Rng};
use tokio::sync::{mpsc, Semaphore};

use crate::{FAKE_VERSION, MODEL};

/// A chip: name, memory (GiB), prefill and decode rates (tokens/s) of a
/// 135M-parameter model, share of the fleet.
pub(crate) const CHIPS: [(&str, u64, f64, f64, u32); 6] = [
    ("Apple M1", 16, 2_000.0, 120.0, 20),
    ("Apple M2", 16, 2_500.0, 140.0, 20),
    ("Apple M3 Pro", 36, 4_000.0, 180.0, 20),
    ("Apple M4", 24, 4_500.0, 200.0, 20),
    ("Apple M4 Max", 128, 9_000.0, 300.0, 15),
    ("Apple M2 Ultra", 192, 10_000.0, 320.0, 5),
];

/// Counters every node shares.
#[derive(Default)]
pub(crate) struct NodeStats {
    pub(crate) welcomed: AtomicU64,
    pub(crate) beats: AtomicU64,
    /// A heartbeat sent while the one before was still unacknowledged.
    pub(crate) missed: AtomicU64,
    /// Sessions that ended during the run.
    pub(crate) lost: AtomicU64,
    /// Registrations that failed and were tried again.
    pub(crate) retries: AtomicU64,
    pub(crate) jobs: AtomicU64,
}

pub(crate) struct VirtualNode {
    pub(crate) key: SigningKey,
    pub(crate) chip: usize,
}

// --- a virtual node ------------------------------------------------------

/// The wait before try `attempt + 1`: a ceiling of 250 ms doubling per
/// failed try up to 16 s, half of it fixed and half drawn ("equal
/// jitter"), so nodes refused together do not come back together.
pub(crate) fn register_backoff(attempt: u32, rng: &mut StdRng) -> Duration {
    let ceiling_ms = 250u64.saturating_mul(1 << attempt.saturating_sub(1).min(6));
    let half = ceiling_ms / 2;
    Duration::from_millis(half + rng.gen_range(0..=half))
}

/// `n` nodes with fresh keys, their chips drawn by the fleet's shares.
pub(crate) fn fleet(n: usize, rng: &mut StdRng) -> Vec<VirtualNode> {
    let weights: u32 = CHIPS.iter().map(|c| c.4).sum();
    (0..n)
        .map(|_| {
            let mut pick = rng.gen_range(0..weights);
            let chip = CHIPS
                .iter()
                .position(|c| {
                    if pick < c.4 {
                        true
                    } else {
                        pick -= c.4;
                        false
                    }
                })
                .unwrap_or(0);
            VirtualNode {
                key: SigningKey::generate(rng),
                chip,
            }
        })
        .collect()
}

/// Where and how a virtual node registers.
#[derive(Clone)]
pub(crate) struct Dial {
    pub(crate) endpoint: quinn::Endpoint,
    pub(crate) addr: std::net::SocketAddr,
    /// Handshakes at once, across all nodes.
    pub(crate) dials: Arc<Semaphore>,
    pub(crate) stats: Arc<NodeStats>,
    /// Tries per registration before the node gives up.
    pub(crate) attempts: u32,
    /// Register again when a session ends (the process-kill run).
    pub(crate) reconnect: bool,
}

/// Runs node `i`: registers (with backoff), serves until the session ends,
/// and (with `reconnect`) registers again. Every welcome sends the
/// heartbeat interval on `welcomed`; a registration that fails its last
/// try sends the error and ends the node.
pub(crate) async fn run(
    node: VirtualNode,
    i: usize,
    dial: Dial,
    mut jitter: StdRng,
    welcomed: mpsc::Sender<Result<Duration>>,
) {
    let node = Arc::new(node);
    loop {
        let mut attempt = 1;
        let session = loop {
            let permit = dial.dials.acquire().await;
            let tried = register(&dial.endpoint, dial.addr, &node, i).await;
            drop(permit);
            match tried {
                Ok(session) => break session,
                Err(e) if attempt >= dial.attempts => {
                    let e = e.context(format!("node {i}, after {attempt} tries"));
                    let _ = welcomed.send(Err(e)).await;
                    return;
                }
                Err(_) => {
                    dial.stats.retries.fetch_add(1, Ordering::Relaxed);
                    tokio::time::sleep(register_backoff(attempt, &mut jitter)).await;
                    attempt += 1;
                }
            }
        };
        let (conn, send, recv, interval) = session;
        dial.stats.welcomed.fetch_add(1, Ordering::Relaxed);
        let _ = welcomed.send(Ok(interval)).await;
        serve(
            Arc::clone(&node),
            conn,
            send,
            recv,
            interval,
            Arc::clone(&dial.stats),
        )
        .await;
        if !dial.reconnect {
            return;
        }
    }
}

/// Dials, proves the key and registers; returns the session and the
/// heartbeat interval `Welcome` asked for.
async fn register(
    endpoint: &quinn::Endpoint,
    addr: std::net::SocketAddr,
    node: &VirtualNode,
    i: usize,
) -> Result<(
    quinn::Connection,
    quinn::SendStream,
    quinn::RecvStream,
    Duration,
)> {
    let conn = endpoint.connect(addr, "localhost")?.await?;
    let (mut send, mut recv) = conn.open_bi().await?;
    let open = NodeControl {
        msg: Some(node_control::Msg::Open(Open {
            version: FAKE_VERSION.into(),
        })),
    };
    write_frame(&mut send, &open).await?;
    let challenge: CoordinatorControl = read_frame(&mut recv).await?;
    let Some(coordinator_control::Msg::Challenge(c)) = challenge.msg else {
        bail!("expected a challenge, got {:?}", challenge.msg);
    };
    let mut exporter = [0u8; auth::EXPORTER_LEN];
    conn.export_keying_material(&mut exporter, auth::EXPORTER_LABEL, b"")
        .map_err(|_| anyhow!("exporting keying material"))?;
    let signature = node.key.sign(&auth::transcript(&c.nonce, &exporter));
    let (chip, gib, ..) = CHIPS[node.chip];
    let memory = gib << 30;
    let hello = Hello {
        node_id: node.key.verifying_key().to_bytes().to_vec(),
        signature: signature.to_bytes().to_vec(),
        hardware: Some(HardwareProfile {
            chip: chip.into(),
            memory_bytes: memory,
            free_memory_bytes: memory / 2,
            ..Default::default()
        }),
        models: vec![CachedModel {
            model: MODEL.into(),
            sha256: hex::decode(smollm2_135m_instruct().sha256)?,
            size_bytes: 1,
        }],
        version: FAKE_VERSION.into(),
        max_concurrent_jobs: 1,
        name: format!("fake-engine-{i}"),
        ..Default::default()
    };
    write_frame(
        &mut send,
        &NodeControl {
            msg: Some(node_control::Msg::Hello(hello)),
        },
    )
    .await?;
    let reply: CoordinatorControl = read_frame(&mut recv).await?;
    match reply.msg {
        Some(coordinator_control::Msg::Welcome(w)) => {
            let ms = if w.heartbeat_interval_ms == 0 {
                5_000
            } else {
                u64::from(w.heartbeat_interval_ms)
            };
            Ok((conn, send, recv, Duration::from_millis(ms)))
        }
        other => bail!("not welcomed: {other:?}"),
    }
}

/// Heartbeats, acks and job streams until the session ends.
async fn serve(
    node: Arc<VirtualNode>,
    conn: quinn::Connection,
    mut send: quinn::SendStream,
    mut recv: quinn::RecvStream,
    interval: Duration,
    stats: Arc<NodeStats>,
) {
    let (ack_tx, mut ack_rx) = tokio::sync::mpsc::unbounded_channel::<()>();
    // The control stream's reader: counts acks.
    tokio::spawn(async move {
        while let Ok(m) = read_frame::<_, CoordinatorControl>(&mut recv).await {
            if matches!(m.msg, Some(coordinator_control::Msg::HeartbeatAck(_))) {
                let _ = ack_tx.send(());
            }
        }
    });
    let mut ticker = tokio::time::interval(interval);
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut unacked = 0u64;
    let (_, gib, ..) = CHIPS[node.chip];
    loop {
        tokio::select! {
            _ = ticker.tick() => {
                if unacked > 0 {
                    stats.missed.fetch_add(1, Ordering::Relaxed);
                }
                let beat = NodeControl {
                    msg: Some(node_control::Msg::Heartbeat(Heartbeat {
                        free_memory_bytes: (gib << 30) / 2,
                        running_jobs: 0,
                        ..Default::default()
                    })),
                };
                if write_frame(&mut send, &beat).await.is_err() {
                    break;
                }
                unacked += 1;
                stats.beats.fetch_add(1, Ordering::Relaxed);
            }
            ack = ack_rx.recv() => match ack {
                Some(()) => unacked = unacked.saturating_sub(1),
                None => break,
            },
            stream = conn.accept_bi() => match stream {
                Ok((s, r)) => {
                    stats.jobs.fetch_add(1, Ordering::Relaxed);
                    tokio::spawn(fake_engine(Arc::clone(&node), s, r));
                }
                Err(_) => break,
            },
        }
    }
    stats.lost.fetch_add(1, Ordering::Relaxed);
}

/// One job on the timed fake engine: `Started`, the chip's prefill time,
/// tokens at its decode rate, a signed claim of exactly what was streamed.
async fn fake_engine(
    node: Arc<VirtualNode>,
    mut send: quinn::SendStream,
    mut recv: quinn::RecvStream,
) {
    let Ok(a) = read_frame::<_, Assignment>(&mut recv).await else {
        return;
    };
    let _ = run_fake(&node, &a, &mut send).await;
}

async fn run_fake(node: &VirtualNode, a: &Assignment, send: &mut quinn::SendStream) -> Result<()> {
    let (_, _, prefill_rate, decode_rate, _) = CHIPS[node.chip];
    let input = a.input.clone().unwrap_or_default();
    let resumed = a.resume.clone().unwrap_or_default();
    let prompt_len = match &input.kind {
        Some(job_input::Kind::Prompt(p)) => p.len(),
        _ => 16,
    };
    let prompt_tokens = (prompt_len / 4).max(1) as u32;
    let update = |m| JobUpdate { msg: Some(m) };
    write_frame(
        send,
        &update(job_update::Msg::Started(job_update::Started {})),
    )
    .await?;
    let prefill = Duration::from_secs_f64(f64::from(prompt_tokens) / prefill_rate);
    tokio::time::sleep(prefill).await;
    let max = a.sampling.as_ref().map_or(16, |s| s.max_tokens);
    let n = max.saturating_sub(resumed.token_ids.len() as u32);
    let first = resumed.token_ids.len() as u32;
    let step = Duration::from_secs_f64(1.0 / decode_rate);
    let decode_start = Instant::now();
    let mut ids = Vec::new();
    let mut text = String::new();
    for k in 0..n {
        let id = 1_000 + (k * 7919 + a.attempt) % 40_000;
        let t = format!(" w{id}");
        write_frame(
            send,
            &update(job_update::Msg::Tokens(job_update::Tokens {
                index: first + k,
                token_ids: vec![id],
                text: t.clone(),
                logprobs: Vec::new(),
            })),
        )
        .await?;
        ids.push(id);
        text.push_str(&t);
        tokio::time::sleep(step).await;
    }
    let signed = claim::sign(
        ResultClaim {
            job_id: a.job_id.clone(),
            attempt: a.attempt,
            model_sha256: a.model_sha256.clone(),
            prompt_sha256: claim::resumed_input_digest(&input, &resumed.token_ids).to_vec(),
            completion_tokens: ids.len() as u32,
            output_token_ids: ids,
            output_text: text,
            prompt_tokens,
            prefill_micros: prefill.as_micros() as u64,
            decode_micros: decode_start.elapsed().as_micros() as u64,
            node_id: node.key.verifying_key().to_bytes().to_vec(),
            finish_reason: "length".into(),
            grammar_sha256: mlxnet_proto::grammar::claim_digest(
                a.sampling.as_ref().and_then(|s| s.grammar.as_ref()),
            )
            .map(|d| d.to_vec())
            .unwrap_or_default(),
            // A timed fake engine measures no energy.
            energy_microjoules: 0,
            microjoules_per_token: 0,
        },
        &node.key,
    );
    write_frame(send, &update(job_update::Msg::Result(signed))).await?;
    let _ = send.finish();
    let _ = send.stopped().await;
    Ok(())
}

#[cfg(test)]
mod tests {
    use rand::SeedableRng;

    use super::*;

    #[test]
    fn the_register_backoff_doubles_to_its_cap_with_jitter_inside_each_ceiling() {
        let mut rng = StdRng::seed_from_u64(7);
        for attempt in 1..=12u32 {
            let ceiling = 250u64 << (attempt - 1).min(6);
            for _ in 0..50 {
                let wait = register_backoff(attempt, &mut rng).as_millis() as u64;
                assert!(
                    (ceiling / 2..=ceiling).contains(&wait),
                    "try {attempt}: waited {wait} ms, ceiling {ceiling} ms"
                );
            }
        }
        // Capped at 16 s: the 7th try and every later one share the ceiling.
        assert_eq!(250u64 << 6, 16_000);
        // Two nodes refused together draw different waits.
        let mut a = StdRng::seed_from_u64(1);
        let mut b = StdRng::seed_from_u64(2);
        let draws_a: Vec<_> = (0..8).map(|_| register_backoff(4, &mut a)).collect();
        let draws_b: Vec<_> = (0..8).map(|_| register_backoff(4, &mut b)).collect();
        assert_ne!(draws_a, draws_b);
    }
}
