//! The node link: the QUIC endpoint nodes dial, one session per node.
//!
//! Per connection: the handshake ([`handshake`]) within the handshake
//! timeout (a node banned after failed audits is refused); then the
//! session is registered (replacing any older session of
//! the same node, whose connection is closed), the node is recorded online,
//! `Welcome` is sent, and the control stream is served: heartbeats are
//! acknowledged and refresh the node's free memory; a node silent for longer
//! than the heartbeat timeout is closed. Job streams are opened by the
//! dispatcher on the session's connection ([`job`]). The link sees the rest
//! of the coordinator only through its [`LinkContext`].
//!
//! # Invariants
//! - A node is online (in [`session::Sessions`]) only after its proof
//!   verified, and only until its connection ends.
//! - When a session ends, its connection is closed, which ends every job
//!   stream on it: each attempt fails and is requeued by the dispatcher.
//!
//! # Draining
//! When the replica drains (SIGTERM; see `app`), every session's control
//! loop sends its node `Reconnect` once (with [`LinkConfig::reconnect_grace`])
//! and goes on serving it until the node leaves: the node hands its
//! running jobs off through this replica, which records them, and dials
//! another replica. New connections are refused meanwhile. Nodes that do
//! not know `Reconnect` ignore it and are closed at shutdown as before.
//!
//! # Failure
//! A refused handshake gets `Rejected { reason }` and the connection is
//! closed with [`CLOSE_REJECTED`]. Nothing a node sends can stop the endpoint.

pub mod handshake;
pub mod job;
pub mod session;
pub mod sources;
pub mod tls;

use std::{sync::Arc, time::Duration};

use mlxnet_proto::{
    frame::{read_frame, write_frame, FrameError},
    v1::{
        coordinator_control, node_control, CoordinatorControl, HeartbeatAck, ModelOutlook,
        NodeControl, Reconnect, Rejected, Welcome,
    },
};
use tracing::{debug, info, instrument, warn};

use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;

use crate::{
    audit::Audits,
    catalogue::Catalogue,
    ledger::{Ledger, LedgerError},
    metrics::Metrics,
    scheduler::memory_cap,
    store::{AnyStore, Store},
    util::{clip, error_chain, now_ms, Tasks},
    world::{Status, World},
};

use self::{session::Session, sources::SourceLimits};

/// Connection close code: handshake refused.
pub const CLOSE_REJECTED: u32 = 1;
/// Connection close code: a newer session of the same node replaced this one.
pub const CLOSE_REPLACED: u32 = 2;
/// Connection close code: no heartbeat within the timeout.
pub const CLOSE_SILENT: u32 = 3;
/// Connection close code: protocol violation on the control stream.
pub const CLOSE_PROTOCOL: u32 = 4;
/// Connection close code: the coordinator is shutting down.
pub const CLOSE_SHUTDOWN: u32 = 5;
/// Connection close code: the node is banned after failed audits.
pub const CLOSE_BANNED: u32 = 6;
/// Connection close code: the source address is past its handshake rate
/// (see [`sources`]).
pub const CLOSE_RATE_LIMITED: u32 = 7;

/// The node link's settings (top-level keys of the coordinator's config
/// file, and `limits.max_node_connections`; gathered by `config`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LinkConfig {
    /// How often nodes are told to heartbeat.
    pub heartbeat_interval_ms: u64,
    /// A node silent for longer is offline and its jobs are requeued.
    pub heartbeat_timeout_ms: u64,
    /// How long a node has to answer the challenge with its Hello.
    pub handshake_timeout_ms: u64,
    /// Node connections (handshakes included) at once.
    pub max_node_connections: usize,
    /// Per-source handshake rate and new-identity cap.
    pub sources: sources::SourceLimitsConfig,
    /// This replica's name: recorded as the owner of its nodes' sessions
    /// (and so of the attempts assigned to them).
    pub replica_id: String,
    /// How long a draining replica waits for its nodes to move and its
    /// attempts' ends to be recorded before it stops anyway.
    pub drain_timeout_ms: u64,
}

impl LinkConfig {
    /// How long a node connection may stay silent before QUIC closes it:
    /// twice the heartbeat timeout (a live node heartbeats far more often).
    pub fn idle_timeout(&self) -> Duration {
        Duration::from_millis(self.heartbeat_timeout_ms.saturating_mul(2))
    }

    /// The grace a `Reconnect` gives a node's running jobs before they hand
    /// off: half the drain timeout, so the hand-offs and the close fit in
    /// the other half.
    pub fn reconnect_grace(&self) -> Duration {
        Duration::from_millis(self.drain_timeout_ms / 2)
    }
}

/// What the node link needs from the rest of the coordinator: its settings
/// and the handles it shares with the dispatcher (built once, by `app`).
#[derive(Clone)]
pub struct LinkContext {
    pub config: LinkConfig,
    /// Registered nodes and their heartbeats.
    pub store: AnyStore,
    /// Operator links and availability rewards.
    pub ledger: Ledger,
    /// Node records and the models each node has shown it serves: a node
    /// earns availability rewards only for those, and none on probation.
    pub audits: Arc<Audits>,
    /// Which of a node's model files count.
    pub catalogue: Arc<Catalogue>,
    /// Where admitted nodes' sessions go (placement reads them).
    pub sessions: session::Sessions,
    pub metrics: Arc<Metrics>,
    pub world: World,
    /// Wakes placement: a node joined, beat, or left.
    pub placement: Arc<Notify>,
    /// Connection tasks, waited for on shutdown.
    pub tasks: Arc<Tasks>,
    pub shutdown: CancellationToken,
    /// Cancelled when the replica starts draining: its nodes are told to
    /// move, and new node connections are refused.
    pub drain: CancellationToken,
}

/// Accepts node connections until the endpoint closes or shutdown; at most
/// `config.max_node_connections` at once (more are refused at once).
pub async fn accept_loop(endpoint: quinn::Endpoint, ctx: LinkContext) {
    let ctx = Arc::new(ctx);
    let sources = Arc::new(SourceLimits::new(ctx.config.sources.clone()));
    let slots = Arc::new(tokio::sync::Semaphore::new(
        ctx.config.max_node_connections.max(1),
    ));
    loop {
        let incoming = tokio::select! {
            _ = ctx.shutdown.cancelled() => return,
            i = endpoint.accept() => i,
        };
        let Some(incoming) = incoming else { return };
        if ctx.drain.is_cancelled() {
            debug!(remote = %incoming.remote_address(), "node connection refused: draining");
            incoming.refuse();
            continue;
        }
        let Ok(slot) = Arc::clone(&slots).try_acquire_owned() else {
            ctx.metrics.connections_refused_at_cap.inc();
            debug!(remote = %incoming.remote_address(), "node connection refused: at the connection cap");
            incoming.refuse();
            continue;
        };
        let d = Arc::clone(&ctx);
        let sources = Arc::clone(&sources);
        ctx.tasks.spawn(async move {
            let remote = incoming.remote_address();
            match incoming.await {
                Ok(conn) => serve_connection(conn, &d, &sources).await,
                Err(e) => {
                    debug!(%remote, error = %e, "node connection failed before TLS completed")
                }
            }
            drop(slot);
        });
    }
}

#[instrument(skip_all, fields(remote = %conn.remote_address()))]
async fn serve_connection(conn: quinn::Connection, d: &LinkContext, sources: &SourceLimits) {
    // Counted once TLS completed: the address is the peer's own.
    let source = conn.remote_address().ip();
    if let Err(e) = sources.handshake(source, std::time::Instant::now()) {
        d.metrics.handshakes_rate_limited.inc();
        debug!(%source, "node connection closed: {e}");
        conn.close(CLOSE_RATE_LIMITED.into(), e.to_string().as_bytes());
        return;
    }
    let timeout = Duration::from_millis(d.config.handshake_timeout_ms);
    let admitted = tokio::select! {
        _ = d.shutdown.cancelled() => return,
        r = tokio::time::timeout(timeout, handshake::accept(&conn, &d.catalogue)) => r,
    };
    let admitted = match admitted {
        Ok(Ok(a)) => a,
        Ok(Err((e, send))) => {
            d.metrics.handshakes_refused.inc();
            warn!(error = %e, "node handshake refused");
            reject(&conn, send, &e.to_string()).await;
            return;
        }
        Err(_) => {
            d.metrics.handshakes_refused.inc();
            warn!("node handshake timed out");
            conn.close(CLOSE_REJECTED.into(), b"handshake timed out");
            return;
        }
    };
    let handshake::Admitted {
        registration,
        mut send,
        mut recv,
    } = admitted;
    if d.audits.is_banned(&registration.node_id) {
        d.metrics.handshakes_refused.inc();
        info!(node = %registration.node_id.short(), "banned node refused");
        reject(&conn, Some(send), "this node is banned after failed audits").await;
        return;
    }
    // A key the coordinator has no row for is a new identity: its source
    // may register only so many per window (a Sybil's keys cost nothing).
    if sources.counts_identities(source) {
        let known = match d.store.get_node(&registration.node_id.to_string()).await {
            Ok(row) => row.is_some(),
            Err(e) => {
                warn!(error = %error_chain(&e), "looking the node up failed");
                reject(&conn, Some(send), "coordinator unavailable").await;
                return;
            }
        };
        if !known {
            if let Err(e) = sources.new_identity(source, std::time::Instant::now()) {
                d.metrics.handshakes_refused.inc();
                d.metrics.identities_refused.inc();
                info!(%source, node = %registration.node_id.short(), "new node identity refused: {e}");
                reject(&conn, Some(send), &e.to_string()).await;
                return;
            }
        }
    }
    if let Err(e) = d
        .store
        .upsert_node(&registration.record, &d.config.replica_id)
        .await
    {
        warn!(error = %error_chain(&e), "recording the node failed");
        reject(&conn, Some(send), "coordinator unavailable").await;
        return;
    }
    let node_hex = registration.node_id.to_string();
    let operator = match d
        .ledger
        .link_node(&node_hex, &registration.operator_account)
        .await
    {
        Ok(operator) => operator,
        Err(LedgerError::NoSuchAccount(a)) => {
            d.metrics.handshakes_refused.inc();
            reject(
                &conn,
                Some(send),
                &format!("unknown operator account {a:?}"),
            )
            .await;
            return;
        }
        Err(e) => {
            warn!(error = %error_chain(&e), "linking the node to its operator failed");
            reject(&conn, Some(send), "coordinator unavailable").await;
            return;
        }
    };
    let session = Arc::new(Session::new(
        d.sessions.next_serial(),
        conn.clone(),
        &registration,
        operator,
    ));
    if let Some(old) = d.sessions.insert(Arc::clone(&session)) {
        info!(node = %old.node_id.short(), "node reconnected; closing its previous session");
        old.connection
            .close(CLOSE_REPLACED.into(), b"replaced by a newer session");
    }
    d.metrics.handshakes_accepted.inc();
    if let Err(e) = d.world.upsert_node(registration.world.clone()) {
        warn!(error = %e, "world map: node not shown");
    }
    info!(node = %session.node_id, name = %session.name, models = session.models.len(), "node registered");
    let welcome = CoordinatorControl {
        msg: Some(coordinator_control::Msg::Welcome(Welcome {
            node_id: session.node_id.to_string(),
            heartbeat_interval_ms: d.config.heartbeat_interval_ms.min(u64::from(u32::MAX)) as u32,
            outlook: outlook(d, &session).await,
        })),
    };
    if write_frame(&mut send, &welcome).await.is_ok() {
        d.placement.notify_one();
        let dedicated = registration.dedicated;
        control_loop(d, &session, dedicated, &mut send, &mut recv).await;
    }
    if d.sessions
        .remove_if_current(session.node_id, session.serial)
    {
        if let Err(e) = d.store.set_node_offline(&session.node_id.to_string()).await {
            warn!(error = %error_chain(&e), "recording the node offline failed");
        }
        let _ = d
            .world
            .set_status(&session.node_id.to_string(), Status::Offline);
        info!(node = %session.node_id.short(), "node offline");
    }
    d.placement.notify_one();
}

/// Serves heartbeats until the node goes silent, leaves, or shutdown.
///
/// Every heartbeat is answered and updates the session's figures in
/// memory, but the store (a write or two, fsynced), the availability
/// ledger and a placement pass happen at most once per half heartbeat
/// interval: a node sending heartbeats back to back costs an ack each, not
/// a write each. A repeated `Drain` is logged once.
async fn control_loop(
    d: &LinkContext,
    session: &Session,
    dedicated: bool,
    send: &mut quinn::SendStream,
    recv: &mut quinn::RecvStream,
) {
    let conn = &session.connection;
    let silence = Duration::from_millis(d.config.heartbeat_timeout_ms);
    let mut last_beat = std::time::Instant::now();
    let write_gap = Duration::from_millis(d.config.heartbeat_interval_ms / 2);
    let mut written: Option<std::time::Instant> = None;
    let mut hinted = false;
    loop {
        let frame = tokio::select! {
            _ = d.shutdown.cancelled() => {
                conn.close(CLOSE_SHUTDOWN.into(), b"coordinator shutting down");
                return;
            }
            _ = d.drain.cancelled(), if !hinted => {
                hinted = true;
                let grace = d.config.reconnect_grace();
                let hint = CoordinatorControl {
                    msg: Some(coordinator_control::Msg::Reconnect(Reconnect {
                        reason: "this coordinator replica is draining".into(),
                        grace_ms: grace.as_millis().min(u128::from(u32::MAX)) as u32,
                    })),
                };
                info!(node = %session.node_id.short(), ?grace, "draining: telling the node to move");
                if write_frame(send, &hint).await.is_err() {
                    conn.close(CLOSE_PROTOCOL.into(), b"control stream error");
                    return;
                }
                continue;
            }
            r = tokio::time::timeout(silence, read_frame::<_, NodeControl>(recv)) => r,
        };
        let msg = match frame {
            Err(_) => {
                warn!(node = %session.node_id.short(), "no heartbeat within {silence:?}; closing");
                conn.close(CLOSE_SILENT.into(), b"heartbeat timeout");
                return;
            }
            Ok(Err(FrameError::Closed)) => {
                conn.close(0u32.into(), b"control stream closed");
                return;
            }
            Ok(Err(e)) => {
                debug!(error = %e, "control stream ended");
                conn.close(CLOSE_PROTOCOL.into(), b"control stream error");
                return;
            }
            Ok(Ok(m)) => m,
        };
        match msg.msg {
            Some(node_control::Msg::Heartbeat(hb)) => {
                session.report_free_memory(hb.free_memory_bytes);
                d.metrics
                    .prefix_hit_tokens
                    .inc_by(session.report_prefix(hb.prompt_tokens, hb.prefix_hit_tokens));
                if session.pod.is_some() {
                    session.report_pod_degraded(&hb.pod_degraded);
                }
                let ack = CoordinatorControl {
                    msg: Some(coordinator_control::Msg::HeartbeatAck(HeartbeatAck {})),
                };
                if write_frame(send, &ack).await.is_err() {
                    conn.close(CLOSE_PROTOCOL.into(), b"control stream error");
                    return;
                }
                let beat = std::time::Instant::now();
                if written.is_some_and(|w| beat.duration_since(w) < write_gap) {
                    d.metrics.heartbeats_coalesced.inc();
                    continue;
                }
                written = Some(beat);
                d.metrics.heartbeats_written.inc();
                if let Err(e) = d.store.touch_node(&session.node_id.to_string()).await {
                    warn!(error = %error_chain(&e), "recording the heartbeat failed");
                }
                // A dedicated node earns availability rewards for the time
                // since its last written heartbeat (at most the timeout: it
                // answered), for the capacity it has shown.
                let online = beat.duration_since(last_beat).min(silence);
                last_beat = beat;
                let offered = if dedicated {
                    rewarded_memory(d, session)
                } else {
                    0
                };
                if offered > 0 {
                    if let Err(e) = d
                        .ledger
                        .record_online(
                            &session.node_id.to_string(),
                            offered,
                            online.as_millis() as u64,
                            now_ms(),
                        )
                        .await
                    {
                        warn!(error = %error_chain(&e), "recording availability failed");
                    }
                }
                d.placement.notify_one();
            }
            Some(node_control::Msg::Drain(drain)) => {
                if !session.is_draining() {
                    let reason = clip(&drain.reason, session::MAX_REASON_CHARS);
                    info!(node = %session.node_id.short(), %reason, "node draining");
                }
                session.drain();
            }
            Some(node_control::Msg::Hello(_) | node_control::Msg::Open(_)) | None => {
                warn!(node = %session.node_id.short(), "unexpected control message; closing");
                conn.close(CLOSE_PROTOCOL.into(), b"unexpected control message");
                return;
            }
        }
    }
}

/// The memory a dedicated node earns availability rewards for now: the
/// capacity it has shown, never what it merely reports. Zero while it
/// drains, is banned or on probation (verified work first). Otherwise the
/// capacity ([`Model::capacity_bytes`](crate::catalogue::Model::capacity_bytes))
/// of the models it holds and has served verified work for
/// ([`Audits::shown`]), capped by the memory it reports and that by its
/// chip's largest configuration ([`memory_cap`]): a node reporting
/// `i64::MAX` bytes earns for what it served, never for the figure.
fn rewarded_memory(d: &LinkContext, session: &Session) -> u64 {
    let id = &session.node_id;
    if session.is_draining() || d.audits.is_banned(id) || d.audits.on_probation(id) {
        return 0;
    }
    let shown = d
        .audits
        .shown(id)
        .iter()
        .filter(|m| session.models.contains(m))
        .filter_map(|m| d.catalogue.by_digest(m))
        .map(crate::catalogue::Model::capacity_bytes)
        .fold(0u64, u64::saturating_add);
    shown
        .min(session.memory_bytes)
        .min(memory_cap(&session.chip))
}

/// Tells the node why it was refused, gives the frame a moment to arrive,
/// and closes the connection.
async fn reject(conn: &quinn::Connection, send: Option<quinn::SendStream>, reason: &str) {
    if let Some(mut send) = send {
        let msg = CoordinatorControl {
            msg: Some(coordinator_control::Msg::Rejected(Rejected {
                reason: reason.to_owned(),
            })),
        };
        if write_frame(&mut send, &msg).await.is_ok() && send.finish().is_ok() {
            // Resolves once the node has read the rejection (or stopped reading).
            let _ = tokio::time::timeout(Duration::from_secs(2), send.stopped()).await;
        }
    }
    conn.close(CLOSE_REJECTED.into(), reason.as_bytes());
}

/// What serving each of `session`'s models looks like now, for the
/// owner's first-run summary: the catalogue's prices, the nodes serving
/// it, and the demand (jobs queued, network-wide, plus the jobs running on
/// this replica's nodes, per 1,000 of their job slots). One indexed count
/// per handshake: the running jobs and slots are the sessions' own. A
/// store that cannot count gives demand 0.
async fn outlook(d: &LinkContext, session: &Session) -> Vec<ModelOutlook> {
    let sessions = d.sessions.all();
    let slots: u64 = sessions
        .iter()
        .map(|s| u64::from(s.max_concurrent_jobs.max(1)))
        .sum();
    let running: u64 = sessions.iter().map(|s| u64::from(s.running_jobs())).sum();
    let demand_permille = match d.store.count_queued().await {
        Ok(queued) => demand_permille(queued.saturating_add(running), slots),
        Err(e) => {
            debug!(error = %error_chain(&e), "counting jobs for the outlook failed");
            0
        }
    };
    d.catalogue
        .models()
        .iter()
        .filter(|m| session.models.contains(&m.sha256))
        .map(|m| ModelOutlook {
            model: m.info.id.clone(),
            price_output_micro_mlx_per_mtok: m.price().output_per_mtok,
            price_input_micro_mlx_per_mtok: m.price().input_per_mtok,
            nodes_serving: sessions.iter().filter(|s| s.serves(&m.sha256)).count() as u32,
            demand_permille,
        })
        .collect()
}

/// Jobs `waiting` (queued or running) per 1,000 of `slots`, at most 1,000.
fn demand_permille(waiting: u64, slots: u64) -> u32 {
    (waiting.saturating_mul(1000) / slots.max(1)).min(1000) as u32
}

#[cfg(test)]
mod claims_tests;
#[cfg(test)]
mod sources_tests;
#[cfg(test)]
mod tests;
#[cfg(test)]
mod world_map_tests;
