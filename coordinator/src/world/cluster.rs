//! Server-side clustering: what the map draws at one zoom level, small
//! whatever the number of nodes.
//!
//! At zoom `z` the world is `TILE_PX * 2^z` pixels wide (equirectangular, as
//! the page draws it) and nodes are grouped into square cells of about
//! [`CLUSTER_PX`] pixels. A cell holding one node yields that node; a cell
//! whose nodes all sit on one grid point (a city, a pod) yields them one by
//! one when there are at most [`SPIDER_MAX`] (the page fans them out around
//! the point); any other cell yields one cluster.
//!
//! # Invariants
//! - Every returned coordinate, node or cluster, is a grid cell centre
//!   ([`super::grid`]): a cluster sits at its members' centroid snapped again.
//! - Cluster counts plus single nodes add up to the nodes passed in.
//! - At most [`MAX_ITEMS`] items: when a view would hold more, cells double in
//!   size until it does not (so a response stays far below 200 KB).
//! - Output order is deterministic (by cell), so equal inputs give equal bytes.

use std::collections::HashMap;

use serde::Serialize;

use super::{
    grid,
    model::{Family, NodeView, Status},
};

/// Highest zoom level; at it a cluster cell is smaller than a grid cell.
pub const MAX_ZOOM: u8 = 7;
/// World width in pixels at zoom 0.
pub const TILE_PX: f64 = 512.0;
/// Side of a cluster cell in pixels at its zoom.
pub const CLUSTER_PX: f64 = 40.0;
/// Most nodes of one grid point fanned out one by one.
pub const SPIDER_MAX: usize = 12;
/// Most items (nodes + clusters) in one view.
pub const MAX_ITEMS: usize = 700;

/// Side of a cluster cell in degrees at `zoom`.
pub fn cell_deg(zoom: u8) -> f64 {
    CLUSTER_PX * 360.0 / (TILE_PX * 2f64.powi(i32::from(zoom.min(MAX_ZOOM))))
}

/// A box of the map in degrees, west to east and south to north.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Bbox {
    pub west: f64,
    pub south: f64,
    pub east: f64,
    pub north: f64,
}

/// A bounding box that is not one.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[non_exhaustive]
pub enum BboxError {
    #[error("bbox must be four numbers `west,south,east,north`, got {0:?}")]
    Shape(String),
    #[error("bbox must have west < east within -180..180 and south < north within -90..90")]
    Range,
}

impl Bbox {
    pub const WORLD: Bbox = Bbox {
        west: -180.0,
        south: -90.0,
        east: 180.0,
        north: 90.0,
    };

    /// Parses `west,south,east,north`; values beyond the world are clamped to it.
    pub fn parse(s: &str) -> Result<Bbox, BboxError> {
        let parts: Vec<f64> = s
            .split(',')
            .map(|p| p.trim().parse::<f64>())
            .collect::<Result<_, _>>()
            .map_err(|_| BboxError::Shape(s.chars().take(80).collect()))?;
        let [w, so, e, n] = parts[..] else {
            return Err(BboxError::Shape(s.chars().take(80).collect()));
        };
        if !(w.is_finite() && so.is_finite() && e.is_finite() && n.is_finite()) {
            return Err(BboxError::Range);
        }
        let b = Bbox {
            west: w.clamp(-180.0, 180.0),
            south: so.clamp(-90.0, 90.0),
            east: e.clamp(-180.0, 180.0),
            north: n.clamp(-90.0, 90.0),
        };
        if b.west >= b.east || b.south >= b.north {
            return Err(BboxError::Range);
        }
        Ok(b)
    }

    pub fn contains(&self, lat: f64, lon: f64) -> bool {
        lat >= self.south && lat <= self.north && lon >= self.west && lon <= self.east
    }
}

/// A group of nodes drawn as one marker.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ClusterItem {
    pub lat: f64,
    pub lon: f64,
    pub count: u64,
    pub online: u64,
    pub memory_bytes: u64,
    /// The most common chip family, the marker colour.
    pub family: Family,
    /// Node count per family, in the order M1, M2, M3, M4, M5, other.
    pub by_family: [u64; 6],
    /// Node count per status: serving, idle, busy, offline.
    pub by_status: [u64; 4],
}

/// One node drawn as its own marker.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct NodeItem {
    pub id: String,
    pub name: String,
    pub lat: f64,
    pub lon: f64,
    pub chip: String,
    pub family: Family,
    pub tier: super::model::Tier,
    pub memory_bytes: u64,
    pub status: Status,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub pod: Option<String>,
}

/// The members of one pod that this view draws one by one, to be linked.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct PodLink {
    pub pod_id: String,
    pub members: Vec<String>,
}

/// What the map draws for one view.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct MapView {
    pub zoom: u8,
    /// Side of the cells actually used, in degrees (larger than the zoom's
    /// when the view had to be coarsened to stay small).
    pub cell_deg: f64,
    /// Side of a grid band, in degrees: no location is finer than this.
    pub grid_deg: f64,
    /// Nodes in the view (after filters), counted whether clustered or not.
    pub matched: u64,
    pub clusters: Vec<ClusterItem>,
    pub nodes: Vec<NodeItem>,
    pub pods: Vec<PodLink>,
}

/// The nodes at one grid point (many nodes share a city's cell), so each
/// clustering pass walks points, not nodes.
struct Point<'a> {
    lat: f64,
    lon: f64,
    count: u64,
    online: u64,
    memory: u64,
    by_family: [u64; 6],
    by_status: [u64; 4],
    /// The first `SPIDER_MAX + 1` nodes (enough to know whether to fan out).
    members: Vec<&'a NodeView>,
}

fn status_index(s: Status) -> usize {
    match s {
        Status::Serving => 0,
        Status::Idle => 1,
        Status::Busy => 2,
        Status::Offline => 3,
    }
}

fn points<'a>(nodes: &[&'a NodeView]) -> Vec<Point<'a>> {
    let mut index: HashMap<(u64, u64), usize> = HashMap::new();
    let mut out: Vec<Point<'a>> = Vec::new();
    for node in nodes {
        let Some(place) = &node.location else {
            continue;
        };
        let key = (place.lat.to_bits(), place.lon.to_bits());
        let i = *index.entry(key).or_insert_with(|| {
            out.push(Point {
                lat: place.lat,
                lon: place.lon,
                count: 0,
                online: 0,
                memory: 0,
                by_family: [0; 6],
                by_status: [0; 4],
                members: Vec::new(),
            });
            out.len() - 1
        });
        let p = &mut out[i];
        p.count += 1;
        if node.status.is_online() {
            p.online += 1;
            p.memory = p.memory.saturating_add(node.memory_bytes);
        }
        p.by_family[node.family().index()] += 1;
        p.by_status[status_index(node.status)] += 1;
        if p.members.len() <= SPIDER_MAX {
            p.members.push(node);
        }
    }
    out
}

#[derive(Default)]
struct Group {
    points: Vec<usize>,
    count: u64,
    online: u64,
    memory: u64,
    sum_lat: f64,
    sum_lon: f64,
    by_family: [u64; 6],
    by_status: [u64; 4],
}

impl Group {
    /// Markers this group becomes: its nodes one by one when it is a single
    /// node, or a few at one point; else one cluster.
    fn items(&self) -> usize {
        if self.count == 1 || (self.points.len() == 1 && self.count as usize <= SPIDER_MAX) {
            self.count as usize
        } else {
            1
        }
    }
}

fn group(points: &[Point<'_>], side: f64) -> Vec<((i64, i64), Group)> {
    let mut cells: HashMap<(i64, i64), Group> = HashMap::new();
    for (i, p) in points.iter().enumerate() {
        let key = (
            ((p.lon + 180.0) / side).floor() as i64,
            ((p.lat + 90.0) / side).floor() as i64,
        );
        let g = cells.entry(key).or_default();
        g.points.push(i);
        g.count += p.count;
        g.online += p.online;
        g.memory = g.memory.saturating_add(p.memory);
        g.sum_lat += p.lat * p.count as f64;
        g.sum_lon += p.lon * p.count as f64;
        for (a, b) in g.by_family.iter_mut().zip(p.by_family) {
            *a += b;
        }
        for (a, b) in g.by_status.iter_mut().zip(p.by_status) {
            *a += b;
        }
    }
    let mut cells: Vec<_> = cells.into_iter().collect();
    cells.sort_unstable_by_key(|(k, _)| *k);
    cells
}

/// Clusters `nodes` (already filtered: visible, matching, inside the view)
/// for `zoom`.
pub fn cluster(nodes: &[&NodeView], zoom: u8) -> MapView {
    let zoom = zoom.min(MAX_ZOOM);
    let points = points(nodes);
    let mut side = cell_deg(zoom);
    let mut cells = group(&points, side);
    while cells.iter().map(|(_, g)| g.items()).sum::<usize>() > MAX_ITEMS && side < 360.0 {
        side *= 2.0;
        cells = group(&points, side);
    }
    let mut view = MapView {
        zoom,
        cell_deg: side,
        grid_deg: grid::BAND_DEG,
        matched: 0,
        clusters: Vec::new(),
        nodes: Vec::new(),
        pods: Vec::new(),
    };
    let mut pods: Vec<PodLink> = Vec::new();
    for (_, g) in cells {
        view.matched += g.count;
        if g.items() as u64 == g.count {
            for node in g.points.iter().flat_map(|&i| &points[i].members) {
                view.nodes.push(node_item(node));
                if let Some(pod) = &node.pod {
                    match pods.iter_mut().find(|p| p.pod_id == pod.pod_id) {
                        Some(p) => p.members.push(node.node_id.clone()),
                        None => pods.push(PodLink {
                            pod_id: pod.pod_id.clone(),
                            members: vec![node.node_id.clone()],
                        }),
                    }
                }
            }
        } else {
            let n = g.count as f64;
            // The centroid of cell centres is not one: snap it again.
            let first = g.points.first().map(|&i| (points[i].lat, points[i].lon));
            let at = grid::snap(
                (g.sum_lat / n).clamp(-90.0, 90.0),
                (g.sum_lon / n).clamp(-180.0, 180.0),
            );
            let (lat, lon) = match (at, first) {
                (Ok(s), _) => (s.lat, s.lon),
                (Err(_), Some(first)) => first,
                (Err(_), None) => continue,
            };
            let family = Family::ALL
                .into_iter()
                .max_by_key(|f| (g.by_family[f.index()], std::cmp::Reverse(f.index())))
                .unwrap_or(Family::Other);
            view.clusters.push(ClusterItem {
                lat,
                lon,
                count: g.count,
                online: g.online,
                memory_bytes: g.memory,
                family,
                by_family: g.by_family,
                by_status: g.by_status,
            });
        }
    }
    pods.retain(|p| p.members.len() > 1);
    view.pods = pods;
    view
}

/// The marker of one node.
pub fn node_item(node: &NodeView) -> NodeItem {
    let (lat, lon) = node
        .location
        .as_ref()
        .map(|p| (p.lat, p.lon))
        .unwrap_or_default();
    NodeItem {
        id: node.node_id.clone(),
        name: node.name.clone(),
        lat,
        lon,
        chip: node.chip.clone(),
        family: node.family(),
        tier: node.tier(),
        memory_bytes: node.memory_bytes,
        status: node.status,
        pod: node.pod.as_ref().map(|p| p.pod_id.clone()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::world::model::NodeView;
    use proptest::prelude::*;

    fn node(i: usize, lat: f64, lon: f64) -> NodeView {
        NodeView::new(
            format!("{i:064x}"),
            &format!("n{i}"),
            "Apple M2 Max",
            64 << 30,
        )
        .at("", lat, lon)
    }

    fn all_coordinates_on_grid(v: &MapView) -> bool {
        v.nodes.iter().all(|n| grid::is_centre(n.lat, n.lon))
            && v.clusters.iter().all(|c| grid::is_centre(c.lat, c.lon))
    }

    fn total(v: &MapView) -> u64 {
        v.nodes.len() as u64 + v.clusters.iter().map(|c| c.count).sum::<u64>()
    }

    #[test]
    fn far_apart_nodes_stay_single_and_near_ones_cluster_when_zoomed_out() {
        let ns = [
            node(1, 48.85, 2.35),
            node(2, 47.0, 4.0),
            node(3, -33.9, 151.2),
        ];
        let refs: Vec<&NodeView> = ns.iter().collect();
        let out = cluster(&refs, 0);
        assert_eq!(out.clusters.len(), 1, "{out:?}");
        assert_eq!(out.clusters[0].count, 2);
        assert_eq!(out.nodes.len(), 1);
        assert_eq!(out.nodes[0].name, "n3");
        let zoomed = cluster(&refs, MAX_ZOOM);
        assert_eq!(zoomed.nodes.len(), 3);
        assert!(zoomed.clusters.is_empty());
    }

    #[test]
    fn a_city_of_few_macs_is_fanned_out_and_a_big_one_stays_a_cluster() {
        let few: Vec<NodeView> = (0..5).map(|i| node(i, 45.76, 4.83)).collect();
        let refs: Vec<&NodeView> = few.iter().collect();
        assert_eq!(cluster(&refs, 3).nodes.len(), 5);
        let many: Vec<NodeView> = (0..50).map(|i| node(i, 45.76, 4.83)).collect();
        let refs: Vec<&NodeView> = many.iter().collect();
        let out = cluster(&refs, MAX_ZOOM);
        assert_eq!(out.clusters.len(), 1);
        assert_eq!(out.clusters[0].count, 50);
    }

    #[test]
    fn pod_members_drawn_one_by_one_are_linked() {
        let mut a = node(1, 35.68, 139.69);
        let mut b = node(2, 35.68, 139.69);
        let pod = crate::world::model::PodRef {
            pod_id: "pod-tokyo".into(),
            members: vec![a.node_id.clone(), b.node_id.clone()],
        };
        a.pod = Some(pod.clone());
        b.pod = Some(pod);
        let out = cluster(&[&a, &b], 5);
        assert_eq!(out.pods.len(), 1);
        assert_eq!(out.pods[0].members.len(), 2);
    }

    #[test]
    fn a_hundred_thousand_scattered_nodes_stay_within_the_item_budget() {
        let ns: Vec<NodeView> = (0..100_000)
            .map(|i| {
                let lat = ((i * 7919) % 16_000) as f64 / 100.0 - 80.0;
                let lon = ((i * 104_729) % 35_000) as f64 / 100.0 - 175.0;
                node(i, lat, lon)
            })
            .collect();
        let refs: Vec<&NodeView> = ns.iter().collect();
        for z in 0..=MAX_ZOOM {
            let out = cluster(&refs, z);
            assert!(
                out.nodes.len() + out.clusters.len() <= MAX_ITEMS,
                "zoom {z}"
            );
            assert_eq!(total(&out), 100_000);
            assert!(serde_json::to_vec(&out).unwrap().len() <= 200 * 1024);
        }
    }

    #[test]
    fn bbox_parsing_rejects_nonsense() {
        assert!(Bbox::parse("-10,40,20,60").is_ok());
        assert_eq!(Bbox::parse("-400,-100,400,100").unwrap(), Bbox::WORLD);
        assert!(matches!(Bbox::parse("1,2,3"), Err(BboxError::Shape(_))));
        assert!(matches!(Bbox::parse("a,b,c,d"), Err(BboxError::Shape(_))));
        assert!(matches!(Bbox::parse("20,40,10,60"), Err(BboxError::Range)));
        assert!(matches!(Bbox::parse("NaN,0,1,1"), Err(BboxError::Range)));
    }

    proptest! {
        #[test]
        fn clusters_are_on_the_grid_and_add_up(
            points in proptest::collection::vec((-90.0f64..=90.0, -180.0f64..=180.0), 0..400),
            zoom in 0u8..=MAX_ZOOM,
        ) {
            let ns: Vec<NodeView> = points.iter().enumerate().map(|(i, (la, lo))| node(i, *la, *lo)).collect();
            let refs: Vec<&NodeView> = ns.iter().collect();
            let out = cluster(&refs, zoom);
            prop_assert!(all_coordinates_on_grid(&out));
            prop_assert_eq!(total(&out), ns.len() as u64);
            prop_assert_eq!(out.matched, ns.len() as u64);
        }
    }
}
