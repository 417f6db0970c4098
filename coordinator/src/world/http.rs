//! HTTP for the World page: the page itself (assets embedded from
//! `world-web/`), its JSON API, and a server-sent-event stream of changes.
//!
//! Routes:
//! - `GET /`, `GET /world`: the page; `GET /world/{asset}`: its script, style
//!   and map data.
//! - `GET /api/world/map?z=&bbox=w,s,e,n&family=M1,M3&tier=max&status=idle&min_mem_gb=&max_mem_gb=`:
//!   clustered markers for one view ([`super::MapView`]).
//! - `GET /api/world/totals`: [`super::Totals`].
//! - `GET /api/world/nodes/{id}`: a drawn node's card, 404 for hidden ones.
//! - `GET /api/world/events`: `hello` (totals), then `changes` (changed drawn
//!   nodes, nodes no longer drawn, totals) batched every
//!   [`BATCH_WINDOW`], `totals` when only they moved, `resync` when this
//!   stream fell behind and should refetch. Streams end when
//!   [`World::close`] is called (at shutdown).
//!
//! # Invariants
//! - Nothing here computes: handlers parse, call the [`World`], serialise.
//! - The page's Content-Security-Policy allows this origin only, so the page
//!   cannot quietly depend on a CDN.
//!
//! # Failure
//! A bad query is a 400 with `{"error": "..."}`; an unknown or hidden node a
//! 404 of the same shape. Each error is mapped to a response once, in
//! [`ApiError`]'s `IntoResponse`.

use std::{collections::HashMap, convert::Infallible, time::Duration};

use axum::{
    extract::{Path, Query, State},
    http::{header, HeaderValue, StatusCode},
    response::{
        sse::{Event, KeepAlive, Sse},
        IntoResponse, Response,
    },
    routing::get,
    Json, Router,
};
use futures::Stream;
use serde::Serialize;
use tokio::sync::broadcast::error::{RecvError, TryRecvError};

use super::{
    cluster::{Bbox, BboxError, NodeItem, MAX_ZOOM},
    model::{Family, Status, Tier},
    Change, MapQuery, Totals, World,
};

/// How long the live stream gathers changes before sending them as one event.
pub const BATCH_WINDOW: Duration = Duration::from_millis(200);
/// How often the live stream re-checks totals that move on their own
/// (tokens per second decays as its window slides).
pub const TOTALS_TICK: Duration = Duration::from_secs(2);
/// Most changed nodes in one event; beyond it the page is told to resync.
pub const MAX_BATCH: usize = 500;

const INDEX_HTML: &str = include_str!("../../../world-web/index.html");
const APP_JS: &str = include_str!("../../../world-web/app.js");
const TOPO_JS: &str = include_str!("../../../world-web/topo.js");
const STYLE_CSS: &str = include_str!("../../../world-web/style.css");
const COUNTRIES_JSON: &str = include_str!("../../../world-web/map/countries-110m.json");
const MAP_LICENCE: &str = include_str!("../../../world-web/map/LICENSE-world-atlas");

const CSP: &str = "default-src 'self'; script-src 'self'; style-src 'self'; \
                   img-src 'self' data:; connect-src 'self'; frame-ancestors 'none'";

/// A request the World API refuses.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ApiError {
    #[error("zoom `z` must be an integer 0..={MAX_ZOOM}, got {0:?}")]
    Zoom(String),
    #[error(transparent)]
    Bbox(#[from] BboxError),
    #[error("unknown {what} {value:?}; expected one of {expected}")]
    Filter {
        what: &'static str,
        value: String,
        expected: &'static str,
    },
    #[error("{0} must be a whole number of GiB")]
    Memory(&'static str),
    #[error("no node {0} on the map")]
    NotFound(String),
}

#[derive(Serialize)]
struct ErrorBody {
    error: String,
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let status = match self {
            ApiError::NotFound(_) => StatusCode::NOT_FOUND,
            _ => StatusCode::BAD_REQUEST,
        };
        (
            status,
            Json(ErrorBody {
                error: self.to_string(),
            }),
        )
            .into_response()
    }
}

/// The World page's routes, to merge into the coordinator's HTTP router.
pub fn router(world: World) -> Router {
    Router::new()
        .route("/", get(index))
        .route("/world", get(index))
        .route("/world/{asset}", get(asset))
        .route("/api/world/map", get(map))
        .route("/api/world/totals", get(totals))
        .route("/api/world/nodes/{id}", get(card))
        .route("/api/world/events", get(events))
        .with_state(world)
}

async fn index() -> Response {
    (
        [
            (
                header::CONTENT_TYPE,
                HeaderValue::from_static("text/html; charset=utf-8"),
            ),
            (header::CACHE_CONTROL, HeaderValue::from_static("no-cache")),
            (
                header::CONTENT_SECURITY_POLICY,
                HeaderValue::from_static(CSP),
            ),
        ],
        INDEX_HTML,
    )
        .into_response()
}

async fn asset(Path(name): Path<String>) -> Response {
    let (body, kind, cache) = match name.as_str() {
        "app.js" => (APP_JS, "text/javascript; charset=utf-8", "no-cache"),
        "topo.js" => (TOPO_JS, "text/javascript; charset=utf-8", "no-cache"),
        "style.css" => (STYLE_CSS, "text/css; charset=utf-8", "no-cache"),
        "countries-110m.json" => (COUNTRIES_JSON, "application/json", "public, max-age=86400"),
        "map-licence.txt" => (
            MAP_LICENCE,
            "text/plain; charset=utf-8",
            "public, max-age=86400",
        ),
        _ => return ApiError::NotFound(name).into_response(),
    };
    (
        [
            (header::CONTENT_TYPE, HeaderValue::from_static(kind)),
            (header::CACHE_CONTROL, HeaderValue::from_static(cache)),
        ],
        body,
    )
        .into_response()
}

fn list<T: Copy>(
    params: &HashMap<String, String>,
    key: &'static str,
    parse: fn(&str) -> Option<T>,
    expected: &'static str,
) -> Result<Vec<T>, ApiError> {
    let Some(raw) = params.get(key) else {
        return Ok(Vec::new());
    };
    raw.split(',')
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .map(|s| {
            parse(s).ok_or_else(|| ApiError::Filter {
                what: key,
                value: s.chars().take(40).collect(),
                expected,
            })
        })
        .collect()
}

fn gib(params: &HashMap<String, String>, key: &'static str) -> Result<Option<u64>, ApiError> {
    match params.get(key).map(|s| s.trim()).filter(|s| !s.is_empty()) {
        None => Ok(None),
        Some(s) => s
            .parse::<u64>()
            .ok()
            .and_then(|g| g.checked_mul(1 << 30))
            .map(Some)
            .ok_or(ApiError::Memory(key)),
    }
}

/// Parses the map query string (see the module doc).
pub fn parse_query(params: &HashMap<String, String>) -> Result<MapQuery, ApiError> {
    let zoom = match params.get("z") {
        None => 0,
        Some(z) => z
            .trim()
            .parse::<u8>()
            .ok()
            .filter(|z| *z <= MAX_ZOOM)
            .ok_or_else(|| ApiError::Zoom(z.chars().take(20).collect()))?,
    };
    let bbox = match params.get("bbox") {
        None => Bbox::WORLD,
        Some(b) => Bbox::parse(b)?,
    };
    Ok(MapQuery {
        zoom,
        bbox,
        families: list(params, "family", Family::parse, "M1, M2, M3, M4, M5, other")?,
        tiers: list(params, "tier", Tier::parse, "base, pro, max, ultra")?,
        statuses: list(
            params,
            "status",
            Status::parse,
            "serving, idle, busy, offline",
        )?,
        min_memory_bytes: gib(params, "min_mem_gb")?.unwrap_or(0),
        max_memory_bytes: gib(params, "max_mem_gb")?.unwrap_or(u64::MAX),
    })
}

async fn map(
    State(world): State<World>,
    Query(params): Query<HashMap<String, String>>,
) -> Result<Response, ApiError> {
    let query = parse_query(&params)?;
    let view = world.map(&query);
    Ok(([(header::CACHE_CONTROL, "no-store")], Json(view)).into_response())
}

async fn totals(State(world): State<World>) -> Response {
    ([(header::CACHE_CONTROL, "no-store")], Json(world.totals())).into_response()
}

async fn card(State(world): State<World>, Path(id): Path<String>) -> Result<Response, ApiError> {
    let card = world
        .card(&id)
        .ok_or_else(|| ApiError::NotFound(id.chars().take(64).collect()))?;
    Ok(([(header::CACHE_CONTROL, "no-store")], Json(card)).into_response())
}

/// One `changes` event.
#[derive(Serialize)]
struct Batch {
    nodes: Vec<NodeItem>,
    gone: Vec<String>,
    totals: Totals,
}

enum Step {
    Hello,
    Live,
}

struct Live {
    world: World,
    rx: tokio::sync::broadcast::Receiver<Change>,
    last_totals: Option<Totals>,
    step: Step,
}

fn json_event(name: &str, data: &impl Serialize) -> Event {
    Event::default()
        .event(name)
        .json_data(data)
        .unwrap_or_else(|_| Event::default().event("resync").data("{}"))
}

impl Live {
    /// The next event of this stream, or `None` when the World is gone.
    async fn next(&mut self) -> Option<Event> {
        let world = self.world.clone();
        tokio::select! {
            _ = world.closed() => None,
            e = self.advance() => e,
        }
    }

    async fn advance(&mut self) -> Option<Event> {
        if let Step::Hello = self.step {
            self.step = Step::Live;
            let totals = self.world.totals();
            self.last_totals = Some(totals.clone());
            return Some(json_event("hello", &totals));
        }
        loop {
            let first = match tokio::time::timeout(TOTALS_TICK, self.rx.recv()).await {
                Err(_) => {
                    let totals = self.world.totals();
                    if self.last_totals.as_ref() != Some(&totals) {
                        self.last_totals = Some(totals.clone());
                        return Some(json_event("totals", &totals));
                    }
                    continue;
                }
                Ok(Err(RecvError::Closed)) => return None,
                Ok(Err(RecvError::Lagged(_))) => return Some(self.resync()),
                Ok(Ok(change)) => change,
            };
            let mut changes = vec![first];
            let deadline = tokio::time::Instant::now() + BATCH_WINDOW;
            loop {
                match self.rx.try_recv() {
                    Ok(c) => {
                        changes.push(c);
                        if changes.len() > MAX_BATCH * 4 {
                            return Some(self.resync());
                        }
                    }
                    Err(TryRecvError::Lagged(_)) => return Some(self.resync()),
                    Err(TryRecvError::Closed) => break,
                    Err(TryRecvError::Empty) => {
                        match tokio::time::timeout_at(deadline, self.rx.recv()).await {
                            Err(_) => break,
                            Ok(Ok(c)) => changes.push(c),
                            Ok(Err(RecvError::Lagged(_))) => return Some(self.resync()),
                            Ok(Err(RecvError::Closed)) => break,
                        }
                    }
                }
            }
            return Some(self.batch(changes));
        }
    }

    fn resync(&mut self) -> Event {
        let totals = self.world.totals();
        self.last_totals = Some(totals.clone());
        json_event("resync", &totals)
    }

    fn batch(&mut self, changes: Vec<Change>) -> Event {
        // Latest state per node wins; order of first appearance is kept.
        let mut latest: HashMap<String, Option<NodeItem>> = HashMap::new();
        let mut order = Vec::new();
        for c in changes {
            let (id, item) = match c {
                Change::Node(n) => (n.id.clone(), Some(n)),
                Change::Gone(id) => (id, None),
                Change::Totals => continue,
            };
            if latest.insert(id.clone(), item).is_none() {
                order.push(id);
            }
        }
        if order.len() > MAX_BATCH {
            return self.resync();
        }
        let mut batch = Batch {
            nodes: Vec::new(),
            gone: Vec::new(),
            totals: self.world.totals(),
        };
        for id in order {
            match latest.remove(&id).flatten() {
                Some(item) => batch.nodes.push(item),
                None => batch.gone.push(id),
            }
        }
        self.last_totals = Some(batch.totals.clone());
        json_event("changes", &batch)
    }
}

async fn events(State(world): State<World>) -> Sse<impl Stream<Item = Result<Event, Infallible>>> {
    let live = Live {
        rx: world.subscribe(),
        world,
        last_totals: None,
        step: Step::Hello,
    };
    let stream = futures::stream::unfold(live, |mut live| async move {
        live.next().await.map(|e| (Ok(e), live))
    });
    Sse::new(stream).keep_alive(KeepAlive::default())
}
