//! One session with the coordinator: dial, prove the key, register, then
//! heartbeat and accept job streams until the link drops or the node stops.
//!
//! Shutdown drains (see [`super::drain`]): `Drain` goes out at once, new
//! job streams are refused, running jobs get the grace period, then hand
//! off; the session ends once no job task is left (or
//! [`HANDOFF_WAIT`] after the hand-off began).
//!
//! A pause of lending drains the same way with `lending.grace_ms` and ends
//! the session with [`Ended::Paused`]. So does a `Reconnect` hint from a
//! draining coordinator replica, with the hint's grace (at most the node's
//! own): the session ends with [`Ended::Moved`] and the link dials another
//! address at once.
//!
//! # Failure
//! Returns `Ok` only when shut down on request or paused (after `Drain` and
//! a graceful close); every other end is a [`LinkError`].

use std::{
    net::{Ipv4Addr, Ipv6Addr, SocketAddr},
    pin::Pin,
    sync::Arc,
    time::Duration,
};

use futures::{Stream, StreamExt};
use mlxnet_proto::{
    auth,
    frame::{read_frame, write_frame, FrameError},
    v1::{
        coordinator_control, node_control, CoordinatorControl, Drain, Heartbeat, Hello,
        NodeControl, Open,
    },
};
use tokio::{sync::watch, task::JoinSet, time::Instant};
use tokio_util::sync::CancellationToken;

use super::{job, targets::Target, LinkContext, LinkError, LinkStatus, AGENT_VERSION};

/// Used when the coordinator's `Welcome` asks for no interval.
const DEFAULT_HEARTBEAT: Duration = Duration::from_secs(5);
/// Heartbeats that may go unanswered before the link is declared dead...
const MISSED_ACKS: u32 = 4;
/// ...but never less than this, so a busy machine is not mistaken for a dead link.
const MIN_ACK_DEADLINE: Duration = Duration::from_secs(3);
/// How long a graceful close may take to reach the coordinator.
const CLOSE_GRACE: Duration = Duration::from_secs(2);
/// How long jobs that were told to hand off may take to send their partial
/// claims (one token's compute, then a frame) before the session ends anyway.
pub const HANDOFF_WAIT: Duration = Duration::from_secs(10);

type ControlFrames = Pin<Box<dyn Stream<Item = Result<CoordinatorControl, FrameError>> + Send>>;

/// How a session ended on purpose.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Ended {
    /// The node is shutting down.
    Shutdown,
    /// Lending paused; the link dials again when it resumes.
    Paused,
    /// The coordinator replica asked the node to move (it drains): the
    /// link dials the next address at once.
    Moved,
}

/// Runs one session with the coordinator at `target`; sets `registered`
/// once welcomed.
pub async fn run(
    ctx: &Arc<LinkContext>,
    target: &Target,
    status: &watch::Sender<LinkStatus>,
    shutdown: &CancellationToken,
    registered: &mut bool,
) -> Result<Ended, LinkError> {
    let connect = async {
        let (endpoint, conn) = dial(ctx, target).await?;
        let (send, frames, interval) = register(ctx, &conn).await?;
        Ok::<_, LinkError>((endpoint, conn, send, frames, interval))
    };
    let (endpoint, conn, mut send, mut frames, interval) = tokio::select! {
        _ = shutdown.cancelled() => return Ok(Ended::Shutdown),
        r = tokio::time::timeout(ctx.connect_timeout, connect) => {
            r.map_err(|_| LinkError::Timeout("connecting to the coordinator"))??
        }
    };
    *registered = true;
    status.send_replace(LinkStatus::Registered {
        heartbeat_interval: interval,
        coordinator: target.addr,
    });
    tracing::info!(coordinator = %target.entry, addr = %target.addr, node_id = %ctx.identity.node_id(), ?interval, "registered with coordinator");

    let result = serve(
        ctx,
        status,
        &conn,
        &mut send,
        &mut frames,
        interval,
        shutdown,
    )
    .await;
    match &result {
        Ok(_) => {
            // Closing a QUIC connection drops undelivered stream data: wait
            // (briefly) until the coordinator has read the control stream
            // (the Drain) to its end.
            let _ = tokio::time::timeout(CLOSE_GRACE, async {
                if send.finish().is_ok() {
                    let _ = send.stopped().await;
                }
            })
            .await;
            conn.close(0u32.into(), b"node shutting down");
        }
        Err(e) => conn.close(1u32.into(), e.to_string().as_bytes()),
    }
    let _ = tokio::time::timeout(CLOSE_GRACE, endpoint.wait_idle()).await;
    result
}

/// Completes the QUIC/TLS handshake with `target`.
async fn dial(
    ctx: &LinkContext,
    target: &Target,
) -> Result<(quinn::Endpoint, quinn::Connection), LinkError> {
    let addr = target.addr;
    let local: SocketAddr = if addr.is_ipv6() {
        (Ipv6Addr::UNSPECIFIED, 0).into()
    } else {
        (Ipv4Addr::UNSPECIFIED, 0).into()
    };
    let mut endpoint = quinn::Endpoint::client(local).map_err(LinkError::Endpoint)?;
    endpoint.set_default_client_config(ctx.client_config.clone());
    // The pin, not the name, authenticates the coordinator; the name is sent
    // as SNI only (an IP address is sent as none).
    let conn = endpoint.connect(addr, &target.host)?.await?;
    Ok((endpoint, conn))
}

/// Control-stream handshake: Open, Challenge, Hello, Welcome | Rejected.
async fn register(
    ctx: &LinkContext,
    conn: &quinn::Connection,
) -> Result<(quinn::SendStream, ControlFrames, Duration), LinkError> {
    let (mut send, recv) = conn.open_bi().await?;
    let open = NodeControl {
        msg: Some(node_control::Msg::Open(Open {
            version: AGENT_VERSION.into(),
        })),
    };
    write_frame(&mut send, &open).await?;
    let mut frames = control_frames(recv);

    let nonce = match next(&mut frames).await?.msg {
        Some(coordinator_control::Msg::Challenge(c)) => c.nonce,
        Some(coordinator_control::Msg::Rejected(r)) => return Err(LinkError::Rejected(r.reason)),
        other => {
            return Err(LinkError::Unexpected {
                expected: "a challenge",
                got: describe(&other),
            })
        }
    };
    if nonce.len() != auth::NONCE_LEN {
        return Err(LinkError::BadNonce(nonce.len()));
    }
    let mut exporter = [0u8; auth::EXPORTER_LEN];
    conn.export_keying_material(&mut exporter, auth::EXPORTER_LABEL, b"")
        .map_err(|_| LinkError::Exporter)?;
    let signature = ctx.identity.sign(&auth::transcript(&nonce, &exporter));

    let mut hardware = ctx.hardware.clone();
    if let Ok(Ok(free)) = tokio::task::spawn_blocking(crate::hardware::free_memory_bytes).await {
        hardware.free_memory_bytes = free;
    }
    hardware.free_memory_bytes = ctx.offered_memory(hardware.free_memory_bytes);
    let hello = NodeControl {
        msg: Some(node_control::Msg::Hello(Hello {
            node_id: ctx.identity.node_id().as_bytes().to_vec(),
            signature: signature.to_bytes().to_vec(),
            hardware: Some(hardware),
            models: match &ctx.pod {
                Some(pod) => vec![pod.held.cached()],
                None => ctx.models.cached_models(),
            },
            version: AGENT_VERSION.into(),
            max_concurrent_jobs: ctx.max_concurrent_jobs,
            name: ctx.name.clone(),
            location: ctx.location.as_ref().map(|l| l.to_wire()),
            mode: ctx.mode.to_string(),
            operator_account: ctx.operator_account.clone(),
            pod: ctx.pod.as_ref().map(|p| p.runtime.info()),
            batch: ctx.batch.clone(),
        })),
    };
    write_frame(&mut send, &hello).await?;

    match next(&mut frames).await?.msg {
        Some(coordinator_control::Msg::Welcome(w)) => {
            if w.node_id != ctx.identity.node_id().to_string() {
                tracing::warn!(welcomed_as = %w.node_id, "coordinator welcomed this node under another id");
            }
            let interval = match w.heartbeat_interval_ms {
                0 => DEFAULT_HEARTBEAT,
                ms => Duration::from_millis(u64::from(ms)),
            };
            ctx.board.set_outlook(&w.outlook);
            Ok((send, frames, interval))
        }
        Some(coordinator_control::Msg::Rejected(r)) => Err(LinkError::Rejected(r.reason)),
        other => Err(LinkError::Unexpected {
            expected: "welcome or rejected",
            got: describe(&other),
        }),
    }
}

/// Registered: heartbeats, acks and job streams until the link ends.
async fn serve(
    ctx: &Arc<LinkContext>,
    status: &watch::Sender<LinkStatus>,
    conn: &quinn::Connection,
    send: &mut quinn::SendStream,
    frames: &mut ControlFrames,
    interval: Duration,
    shutdown: &CancellationToken,
) -> Result<Ended, LinkError> {
    let mut jobs = JoinSet::new();
    let mut ticker = tokio::time::interval(interval);
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let ack_deadline = (interval * MISSED_ACKS).max(MIN_ACK_DEADLINE);
    let mut last_heard = Instant::now();
    // When the node began draining (and with what grace), and when it
    // began handing jobs off.
    let mut drained_at: Option<Instant> = None;
    let mut grace = ctx.drain_grace;
    let mut handoff_at: Option<Instant> = None;
    let mut ended = Ended::Shutdown;
    let mut stopping = false;
    let mut lending = ctx.lending.clone();
    let mut lending_open = true;
    loop {
        if drained_at.is_some() && jobs.is_empty() {
            return Ok(ended);
        }
        // A pause (checked every turn, so one that came while the session
        // was registering counts too).
        if drained_at.is_none() {
            if let Some(reason) = ctx.pause_reason() {
                ctx.drain.start();
                drained_at = Some(Instant::now());
                grace = ctx.pause_grace;
                ended = Ended::Paused;
                tracing::info!(running = jobs.len(), ?grace, %reason, "lending paused: no new jobs");
                status.send_replace(LinkStatus::Paused {
                    reason: reason.clone(),
                });
                let drain = NodeControl {
                    msg: Some(node_control::Msg::Drain(Drain { reason })),
                };
                write_frame(send, &drain).await?;
                continue;
            }
        }
        let handoff_due = drained_at.map(|t| t + grace);
        let give_up = handoff_at.map(|t| t + HANDOFF_WAIT);
        tokio::select! {
            _ = shutdown.cancelled(), if !stopping => {
                stopping = true;
                ended = Ended::Shutdown;
                // Already draining for a pause: its (shorter) grace stands.
                if drained_at.is_none() {
                    ctx.drain.start();
                    drained_at = Some(Instant::now());
                    tracing::info!(running = jobs.len(), grace = ?ctx.drain_grace, "draining: no new jobs");
                    let drain = NodeControl {
                        msg: Some(node_control::Msg::Drain(Drain {
                            reason: "node shutting down".into(),
                        })),
                    };
                    write_frame(send, &drain).await?;
                }
            }
            r = lending.changed(), if lending_open && drained_at.is_none() => {
                // The top of the loop reads the new decision.
                lending_open = r.is_ok();
            }
            _ = sleep_until_some(handoff_due), if handoff_at.is_none() => {
                tracing::info!(running = jobs.len(), "grace period over: handing running jobs off");
                ctx.drain.hand_off();
                handoff_at = Some(Instant::now());
            }
            _ = sleep_until_some(give_up) => {
                tracing::warn!(running = jobs.len(), "jobs did not hand off in time; leaving");
                return Ok(ended);
            }
            _ = ticker.tick() => {
                if last_heard.elapsed() > ack_deadline {
                    return Err(LinkError::HeartbeatTimeout(last_heard.elapsed()));
                }
                let free = tokio::task::spawn_blocking(crate::hardware::free_memory_bytes)
                    .await
                    .ok()
                    .and_then(Result::ok)
                    .unwrap_or(ctx.hardware.free_memory_bytes);
                let batches = ctx.models.batch_stats();
                let kv_free = batches
                    .iter()
                    .map(|(_, s)| (s.kv_pages_free * crate::engine::kv::PAGE) as u64)
                    .min()
                    .unwrap_or(0);
                // Read once: the flag and the list sent describe one moment.
                let models_changed = ctx.models.changed();
                let models = if models_changed {
                    ctx.models.cached_models()
                } else {
                    Vec::new()
                };
                let beat = NodeControl {
                    msg: Some(node_control::Msg::Heartbeat(Heartbeat {
                        free_memory_bytes: ctx.offered_memory(free),
                        running_jobs: ctx.running_jobs(),
                        pod_degraded: ctx
                            .pod
                            .as_ref()
                            .and_then(|p| p.runtime.degraded())
                            .unwrap_or_default(),
                        kv_positions_free: kv_free,
                        prompt_tokens: batches.iter().map(|(_, s)| s.prompt_tokens).sum(),
                        prefix_hit_tokens: batches.iter().map(|(_, s)| s.prefix_hit_tokens).sum(),
                        models_changed,
                        models,
                    })),
                };
                write_frame(send, &beat).await?;
            }
            frame = frames.next() => match frame {
                Some(Ok(CoordinatorControl { msg: Some(coordinator_control::Msg::HeartbeatAck(_)) })) => {
                    last_heard = Instant::now();
                }
                Some(Ok(CoordinatorControl { msg: Some(coordinator_control::Msg::Rejected(r)) })) => {
                    return Err(LinkError::Rejected(r.reason));
                }
                Some(Ok(CoordinatorControl { msg: Some(coordinator_control::Msg::Reconnect(hint)) })) => {
                    last_heard = Instant::now();
                    // Already draining (shutdown, pause): that drain ends
                    // the session anyway.
                    if drained_at.is_none() {
                        ctx.drain.start();
                        drained_at = Some(Instant::now());
                        grace = ctx
                            .drain_grace
                            .min(Duration::from_millis(u64::from(hint.grace_ms)));
                        ended = Ended::Moved;
                        // A coordinator's reason, bounded before it is logged.
                        let reason: String = hint.reason.chars().take(256).collect();
                        tracing::info!(running = jobs.len(), ?grace, %reason, "the coordinator replica drains: moving to another");
                        let drain = NodeControl {
                            msg: Some(node_control::Msg::Drain(Drain {
                                reason: "moving to another coordinator".into(),
                            })),
                        };
                        write_frame(send, &drain).await?;
                    }
                }
                Some(Ok(CoordinatorControl { msg: Some(coordinator_control::Msg::ModelHint(hint)) })) => {
                    last_heard = Instant::now();
                    if drained_at.is_none() {
                        crate::models::hint::on_hint(&ctx.models, &hint);
                    }
                }
                Some(Ok(other)) => {
                    last_heard = Instant::now();
                    tracing::debug!(msg = describe(&other.msg), "ignoring control message");
                }
                Some(Err(FrameError::Closed)) | None => return Err(LinkError::ControlClosed),
                Some(Err(e)) => return Err(e.into()),
            },
            stream = conn.accept_bi() => {
                let (job_send, job_recv) = stream?;
                jobs.spawn(job::serve(ctx.clone(), job_send, job_recv));
            }
            Some(done) = jobs.join_next() => {
                if let Err(e) = done {
                    if e.is_panic() {
                        tracing::error!(error = %e, "job task panicked");
                    }
                }
            }
        }
    }
}

/// Sleeps until `at`, or forever when there is no `at`.
async fn sleep_until_some(at: Option<Instant>) {
    match at {
        Some(at) => tokio::time::sleep_until(at).await,
        None => std::future::pending().await,
    }
}

fn control_frames(recv: quinn::RecvStream) -> ControlFrames {
    Box::pin(futures::stream::unfold(recv, |mut recv| async move {
        let frame = read_frame::<_, CoordinatorControl>(&mut recv).await;
        Some((frame, recv))
    }))
}

async fn next(frames: &mut ControlFrames) -> Result<CoordinatorControl, LinkError> {
    match frames.next().await {
        Some(Ok(msg)) => Ok(msg),
        Some(Err(FrameError::Closed)) | None => Err(LinkError::ControlClosed),
        Some(Err(e)) => Err(e.into()),
    }
}

fn describe(msg: &Option<coordinator_control::Msg>) -> String {
    match msg {
        None => "an empty message".into(),
        Some(coordinator_control::Msg::Challenge(_)) => "a challenge".into(),
        Some(coordinator_control::Msg::Welcome(_)) => "a welcome".into(),
        Some(coordinator_control::Msg::Rejected(r)) => format!("a rejection ({})", r.reason),
        Some(coordinator_control::Msg::HeartbeatAck(_)) => "a heartbeat ack".into(),
        Some(coordinator_control::Msg::ModelHint(_)) => "a model hint".into(),
        Some(coordinator_control::Msg::Reconnect(_)) => "a reconnect hint".into(),
    }
}
