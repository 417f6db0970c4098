//! The World page: every Mac on the network on a world map, live.
//!
//! The coordinator keeps one [`World`] and tells it what happens to nodes
//! ([`World::upsert_node`] on registration and changes, [`World::set_status`],
//! [`World::record_job`]); [`router`] serves the page, its JSON API and its
//! live stream from that state.
//!
//! # Layout
//! - [`grid`]: the ~50 km grid every shown location is snapped to.
//! - [`model`]: [`NodeView`], status, chip family and tier, [`Totals`].
//! - [`cluster`]: server-side clustering per zoom level, bounded output.
//! - [`http`]: the axum router: page assets, `/api/world/*`, server-sent events.
//! - [`synthetic`]: seeded synthetic networks for the bench, tests and demos.
//!
//! # Invariants
//! - No location finer than the grid is stored, so none can be returned:
//!   [`World::upsert_node`] snaps before storing.
//! - Nodes whose owner opted out (`hidden`) count in [`Totals`] but appear in
//!   no map view, card, or change event.
//! - A pod reference keeps a clipped id and at most [`MAX_POD_MEMBERS`]
//!   well-formed member ids, whatever the Hello said.
//! - An identity offline for longer than the stale TTL with no verified
//!   work (no job recorded) is forgotten, so identities that registered and
//!   left do not accumulate; a node that served jobs stays, shown offline.
//! - Every change to a drawn node is broadcast once to the live stream;
//!   a stream that falls behind is told to resynchronise, never blocks writers.
//!
//! # Failure
//! Calls about a node id that is not 64 hex characters, or one the World does
//! not know, return a [`WorldError`]; nothing here panics on input.

pub mod cluster;
pub mod grid;
pub mod http;
pub mod model;
pub mod synthetic;

use std::{
    collections::{HashMap, VecDeque},
    sync::{Arc, RwLock, RwLockReadGuard, RwLockWriteGuard},
    time::{Duration, Instant, SystemTime, UNIX_EPOCH},
};

use tokio::sync::broadcast;

pub use cluster::{Bbox, MapView, NodeItem};
pub use http::router;
pub use model::{Family, NodeView, PodRef, Status, Tier, Totals};

/// The moving window of "tokens per second now".
pub const TOKENS_WINDOW: Duration = Duration::from_secs(10);

/// How many metered jobs the network's tokens-per-joule figure is drawn
/// from (the most recent ones).
pub const ENERGY_SAMPLES: usize = 1024;
/// Changes buffered per live-stream subscriber before it must resynchronise.
const CHANGE_BUFFER: usize = 4096;
/// The most members a node's pod reference keeps (a Thunderbolt pod has a
/// handful; a Hello may list thousands).
pub const MAX_POD_MEMBERS: usize = 32;
/// How long an identity with no verified work stays on the map once
/// offline, unless configured (`world_stale_ttl_ms`).
pub const DEFAULT_STALE_TTL: Duration = Duration::from_secs(24 * 3600);

/// Why a World call was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum WorldError {
    #[error("node id must be 64 lowercase hex characters")]
    NodeId,
    #[error("node {0} is not known to the world map")]
    UnknownNode(String),
}

/// One change the live stream carries.
#[derive(Debug, Clone, PartialEq)]
pub enum Change {
    /// A drawn node appeared or changed.
    Node(NodeItem),
    /// A node is no longer drawn (gone, opted out, or lost its place).
    Gone(String),
    /// Only the totals changed (a hidden node, a job).
    Totals,
}

/// Which drawn nodes a map view asks for.
#[derive(Debug, Clone, PartialEq)]
pub struct MapQuery {
    pub zoom: u8,
    pub bbox: Bbox,
    /// Empty = every family.
    pub families: Vec<Family>,
    /// Empty = every tier.
    pub tiers: Vec<Tier>,
    /// Empty = every status.
    pub statuses: Vec<Status>,
    pub min_memory_bytes: u64,
    pub max_memory_bytes: u64,
}

impl Default for MapQuery {
    fn default() -> Self {
        MapQuery {
            zoom: 0,
            bbox: Bbox::WORLD,
            families: Vec::new(),
            tiers: Vec::new(),
            statuses: Vec::new(),
            min_memory_bytes: 0,
            max_memory_bytes: u64::MAX,
        }
    }
}

impl MapQuery {
    fn matches(&self, n: &NodeView) -> bool {
        let Some(place) = &n.location else {
            return false;
        };
        !n.hidden
            && self.bbox.contains(place.lat, place.lon)
            && (self.families.is_empty() || self.families.contains(&n.family()))
            && (self.tiers.is_empty() || self.tiers.contains(&n.tier()))
            && (self.statuses.is_empty() || self.statuses.contains(&n.status))
            && n.memory_bytes >= self.min_memory_bytes
            && n.memory_bytes <= self.max_memory_bytes
    }
}

/// A node's card: everything the page shows when it is clicked.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct NodeCard {
    pub id: String,
    pub name: String,
    pub chip: String,
    pub family: Family,
    pub tier: Tier,
    pub memory_bytes: u64,
    pub place: String,
    pub lat: f64,
    pub lon: f64,
    pub status: Status,
    pub jobs_served: u64,
    pub tokens_produced: u64,
    pub online_since_ms: Option<u64>,
    pub pod: Option<PodCard>,
}

/// A pod as a card shows it: the drawn members, and how many opted out.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct PodCard {
    pub pod_id: String,
    pub members: Vec<PodMember>,
    pub hidden_members: u64,
}

#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct PodMember {
    pub id: String,
    pub name: String,
    pub status: Status,
}

/// The World's shared state. Cheap to clone: every clone is the same world.
#[derive(Clone)]
pub struct World {
    inner: Arc<Inner>,
}

struct Inner {
    state: RwLock<State>,
    changes: broadcast::Sender<Change>,
    /// Cancelled by [`World::close`]: live streams end, so a graceful HTTP
    /// shutdown is not held open by browsers watching the page.
    closed: tokio_util::sync::CancellationToken,
    /// Idle identities offline for longer are forgotten.
    stale_ttl: Duration,
}

#[derive(Default)]
struct State {
    nodes: HashMap<String, NodeView>,
    /// (when, tokens) of recent jobs, oldest first, within TOKENS_WINDOW.
    recent_tokens: VecDeque<(Instant, u64)>,
    /// (UTC day number, jobs completed that day).
    jobs_today: (u64, u64),
    /// (tokens, microjoules) of the last [`ENERGY_SAMPLES`] completed jobs
    /// whose claim carried energy, oldest first.
    energy: VecDeque<(u64, u64)>,
    /// When each offline node went offline (online nodes are absent).
    offline_at: HashMap<String, Instant>,
    /// The last stale sweep.
    swept_at: Option<Instant>,
}

impl Default for World {
    fn default() -> Self {
        World::new()
    }
}

impl std::fmt::Debug for World {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("World")
            .field("nodes", &self.read().nodes.len())
            .finish()
    }
}

fn unix_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

fn check_id(id: &str) -> Result<(), WorldError> {
    if id.len() == 64
        && id
            .bytes()
            .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
    {
        Ok(())
    } else {
        Err(WorldError::NodeId)
    }
}

impl World {
    /// A World that forgets identities offline for longer than
    /// [`DEFAULT_STALE_TTL`] with no verified work.
    pub fn new() -> World {
        World::with_stale_ttl(DEFAULT_STALE_TTL)
    }

    /// A World that forgets identities offline for longer than `ttl` with
    /// no verified work ([`World::forget_stale`], run by every
    /// [`World::upsert_node`] at most once per `ttl`, and at least once a
    /// minute): a Sybil's keys that registered and left do not stay on the
    /// map or in the totals, while a node that served jobs stays (offline).
    pub fn with_stale_ttl(ttl: Duration) -> World {
        let (changes, _) = broadcast::channel(CHANGE_BUFFER);
        World {
            inner: Arc::new(Inner {
                state: RwLock::new(State::default()),
                changes,
                closed: tokio_util::sync::CancellationToken::new(),
                stale_ttl: ttl,
            }),
        }
    }

    /// Forgets every node offline for longer than the stale TTL at `now`
    /// that has no verified work (no job recorded); returns how many.
    pub fn forget_stale(&self, now: Instant) -> usize {
        let mut state = self.write();
        self.sweep(&mut state, now)
    }

    fn sweep(&self, state: &mut State, now: Instant) -> usize {
        state.swept_at = Some(now);
        let ttl = self.inner.stale_ttl;
        let stale: Vec<String> = state
            .offline_at
            .iter()
            .filter(|(_, at)| now.saturating_duration_since(**at) >= ttl)
            .map(|(id, _)| id.clone())
            .collect();
        let mut forgotten = 0;
        for id in stale {
            state.offline_at.remove(&id);
            let idle = state
                .nodes
                .get(&id)
                .is_some_and(|n| !n.status.is_online() && n.jobs_served == 0);
            if !idle {
                continue;
            }
            if let Some(n) = state.nodes.remove(&id) {
                forgotten += 1;
                let change = if n.is_visible() {
                    Change::Gone(n.node_id)
                } else {
                    Change::Totals
                };
                let _ = self.inner.changes.send(change);
            }
        }
        forgotten
    }

    /// Notes when `view` went offline (or that it is online), for the sweep.
    fn track_offline(state: &mut State, view: &NodeView, now: Instant) {
        if view.status.is_online() {
            state.offline_at.remove(&view.node_id);
        } else {
            state.offline_at.entry(view.node_id.clone()).or_insert(now);
        }
    }

    // A panic while holding the lock cannot leave State half-updated in a way
    // that matters more than losing the map, so a poisoned lock is used as is.
    fn read(&self) -> RwLockReadGuard<'_, State> {
        self.inner.state.read().unwrap_or_else(|e| e.into_inner())
    }

    fn write(&self) -> RwLockWriteGuard<'_, State> {
        self.inner.state.write().unwrap_or_else(|e| e.into_inner())
    }

    fn announce(&self, before_visible: bool, after: &NodeView) {
        let change = if after.is_visible() {
            Change::Node(cluster::node_item(after))
        } else if before_visible {
            Change::Gone(after.node_id.clone())
        } else {
            Change::Totals
        };
        // No subscriber is fine: nobody is watching the page.
        let _ = self.inner.changes.send(change);
    }

    /// Adds or replaces a node. Its location is snapped and its text cleaned
    /// here; its counters never go down (a re-registration with zeros keeps
    /// what was counted); `online_since_ms` is kept by the World.
    pub fn upsert_node(&self, mut view: NodeView) -> Result<(), WorldError> {
        check_id(&view.node_id)?;
        view.normalise();
        let mut state = self.write();
        let before = state.nodes.get(&view.node_id);
        let before_visible = before.is_some_and(NodeView::is_visible);
        view.online_since_ms = match before {
            Some(b) if b.status.is_online() && view.status.is_online() => b.online_since_ms,
            _ if view.status.is_online() => Some(unix_ms()),
            _ => None,
        };
        if let Some(b) = before {
            view.jobs_served = view.jobs_served.max(b.jobs_served);
            view.tokens_produced = view.tokens_produced.max(b.tokens_produced);
        }
        self.announce(before_visible, &view);
        let now = Instant::now();
        World::track_offline(&mut state, &view, now);
        state.nodes.insert(view.node_id.clone(), view);
        let every = self.inner.stale_ttl.min(Duration::from_secs(60));
        if state
            .swept_at
            .is_none_or(|at| now.saturating_duration_since(at) >= every)
        {
            self.sweep(&mut state, now);
        }
        Ok(())
    }

    /// Changes a known node's status (e.g. `Offline` when its link drops).
    pub fn set_status(&self, node_id: &str, status: Status) -> Result<(), WorldError> {
        check_id(node_id)?;
        let mut state = self.write();
        let node = state
            .nodes
            .get_mut(node_id)
            .ok_or_else(|| WorldError::UnknownNode(node_id.to_owned()))?;
        if node.status == status {
            return Ok(());
        }
        node.online_since_ms = match (node.status.is_online(), status.is_online()) {
            (false, true) => Some(unix_ms()),
            (_, false) => None,
            (true, true) => node.online_since_ms,
        };
        node.status = status;
        let visible = node.is_visible();
        let node = node.clone();
        World::track_offline(&mut state, &node, Instant::now());
        drop(state);
        self.announce(visible, &node);
        Ok(())
    }

    /// Records a completed job of `tokens` model tokens on `node_id`. The
    /// network totals count it even when the node is unknown (then the error
    /// says so).
    pub fn record_job(&self, node_id: &str, tokens: u64) -> Result<(), WorldError> {
        let now = Instant::now();
        let today = unix_ms() / 86_400_000;
        let mut state = self.write();
        state.recent_tokens.push_back((now, tokens));
        prune(&mut state.recent_tokens, now);
        state.jobs_today = match state.jobs_today {
            (day, n) if day == today => (day, n + 1),
            _ => (today, 1),
        };
        let known = check_id(node_id)
            .is_ok()
            .then(|| state.nodes.get_mut(node_id))
            .flatten();
        let Some(node) = known else {
            drop(state);
            let _ = self.inner.changes.send(Change::Totals);
            return match check_id(node_id) {
                Ok(()) => Err(WorldError::UnknownNode(node_id.to_owned())),
                Err(e) => Err(e),
            };
        };
        node.jobs_served += 1;
        node.tokens_produced += tokens;
        let node = node.clone();
        drop(state);
        self.announce(node.is_visible(), &node);
        Ok(())
    }

    /// Forgets a node entirely (it is no longer counted anywhere).
    pub fn remove_node(&self, node_id: &str) -> Result<(), WorldError> {
        check_id(node_id)?;
        let removed = {
            let mut state = self.write();
            state.offline_at.remove(node_id);
            state.nodes.remove(node_id)
        };
        match removed {
            Some(n) if n.is_visible() => {
                let _ = self.inner.changes.send(Change::Gone(n.node_id));
                Ok(())
            }
            Some(_) => {
                let _ = self.inner.changes.send(Change::Totals);
                Ok(())
            }
            None => Err(WorldError::UnknownNode(node_id.to_owned())),
        }
    }

    /// The stored view of a node, hidden or not (for the coordinator itself;
    /// the HTTP API uses [`World::card`]).
    pub fn node(&self, node_id: &str) -> Option<NodeView> {
        self.read().nodes.get(node_id).cloned()
    }

    /// Number of nodes known, hidden ones included.
    pub fn len(&self) -> usize {
        self.read().nodes.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Records the energy a completed job of `tokens` tokens claimed
    /// (`microjoules`). Jobs without energy or without tokens say nothing
    /// about tokens per joule and are not kept.
    pub fn record_energy(&self, tokens: u64, microjoules: u64) {
        if tokens == 0 || microjoules == 0 {
            return;
        }
        let mut state = self.write();
        if state.energy.len() == ENERGY_SAMPLES {
            state.energy.pop_front();
        }
        state.energy.push_back((tokens, microjoules));
        drop(state);
        let _ = self.inner.changes.send(Change::Totals);
    }

    /// A drawn node's card; `None` for unknown, hidden or unplaced nodes.
    pub fn card(&self, node_id: &str) -> Option<NodeCard> {
        let state = self.read();
        let n = state.nodes.get(node_id).filter(|n| n.is_visible())?;
        let place = n.location.clone()?;
        let pod = n.pod.as_ref().map(|p| {
            let mut members = Vec::new();
            let mut hidden_members = 0;
            for id in &p.members {
                match state.nodes.get(id) {
                    Some(m) if m.is_visible() => members.push(PodMember {
                        id: m.node_id.clone(),
                        name: m.name.clone(),
                        status: m.status,
                    }),
                    _ => hidden_members += 1,
                }
            }
            PodCard {
                pod_id: p.pod_id.clone(),
                members,
                hidden_members,
            }
        });
        Some(NodeCard {
            id: n.node_id.clone(),
            name: n.name.clone(),
            chip: n.chip.clone(),
            family: n.family(),
            tier: n.tier(),
            memory_bytes: n.memory_bytes,
            place: place.label,
            lat: place.lat,
            lon: place.lon,
            status: n.status,
            jobs_served: n.jobs_served,
            tokens_produced: n.tokens_produced,
            online_since_ms: n.online_since_ms,
            pod,
        })
    }

    /// Network totals now.
    pub fn totals(&self) -> Totals {
        let now = Instant::now();
        let today = unix_ms() / 86_400_000;
        let state = self.read();
        let mut t = Totals::default();
        let mut pods: Vec<&str> = Vec::new();
        for n in state.nodes.values() {
            t.macs_known += 1;
            if !n.status.is_online() {
                continue;
            }
            t.macs_online += 1;
            t.memory_online_bytes = t.memory_online_bytes.saturating_add(n.memory_bytes);
            if n.is_visible() {
                t.macs_on_map += 1;
            }
            if let Some(p) = &n.pod {
                pods.push(&p.pod_id);
            }
        }
        pods.sort_unstable();
        pods.dedup();
        t.pods = pods.len() as u64;
        let window_tokens: u64 = state
            .recent_tokens
            .iter()
            .filter(|(at, _)| now.duration_since(*at) <= TOKENS_WINDOW)
            .map(|(_, n)| n)
            .sum();
        t.tokens_per_s = window_tokens as f64 / TOKENS_WINDOW.as_secs_f64();
        t.jobs_today = if state.jobs_today.0 == today {
            state.jobs_today.1
        } else {
            0
        };
        t.tokens_per_joule = tokens_per_joule(&state.energy);
        t
    }

    /// What the map draws for `query`.
    pub fn map(&self, query: &MapQuery) -> MapView {
        let state = self.read();
        let matching: Vec<&NodeView> = state.nodes.values().filter(|n| query.matches(n)).collect();
        cluster::cluster(&matching, query.zoom)
    }

    /// A receiver of every change from now on.
    pub fn subscribe(&self) -> broadcast::Receiver<Change> {
        self.inner.changes.subscribe()
    }

    /// Ends every live stream (now and later). Call when the HTTP server
    /// starts its graceful shutdown: open event streams would hold it open.
    pub fn close(&self) {
        self.inner.closed.cancel();
    }

    /// Resolves once [`World::close`] was called.
    pub async fn closed(&self) {
        self.inner.closed.cancelled().await
    }
}

/// The network's tokens per joule over `jobs` (tokens, microjoules): the
/// token-weighted median of each job's own figure, so that the figure a
/// node claims (self-reported: nothing checks a meter) moves it only as
/// far as that node's share of the tokens, and a minority of nodes lying
/// about their energy cannot set it. `None` without a metered job.
pub fn tokens_per_joule(jobs: &VecDeque<(u64, u64)>) -> Option<f64> {
    let mut rates: Vec<(f64, u64)> = jobs
        .iter()
        .filter(|(t, uj)| *t > 0 && *uj > 0)
        .map(|&(t, uj)| (t as f64 * 1e6 / uj as f64, t))
        .collect();
    if rates.is_empty() {
        return None;
    }
    rates.sort_by(|a, b| a.0.total_cmp(&b.0));
    let total: u64 = rates.iter().map(|r| r.1).sum();
    let mut seen = 0;
    for (rate, tokens) in &rates {
        seen += tokens;
        if 2 * seen >= total {
            return Some(*rate);
        }
    }
    rates.last().map(|r| r.0)
}

fn prune(recent: &mut VecDeque<(Instant, u64)>, now: Instant) {
    while recent
        .front()
        .is_some_and(|(at, _)| now.duration_since(*at) > TOKENS_WINDOW)
    {
        recent.pop_front();
    }
}

#[cfg(test)]
mod hygiene_tests;
#[cfg(test)]
mod tests;
