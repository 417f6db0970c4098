//! Unit tests of the World state and its HTTP API (through the real router).

use std::collections::HashMap;

use axum::body::Body;
use http_body_util::BodyExt;
use tower::ServiceExt;

use super::*;

fn id(i: u32) -> String {
    format!("{i:064x}")
}

fn mac(i: u32, chip: &str, gib: u64) -> NodeView {
    NodeView::new(id(i), &format!("mac-{i}"), chip, gib << 30)
}

async fn get(world: &World, uri: &str) -> (u16, String) {
    let res = router(world.clone())
        .oneshot(
            axum::http::Request::builder()
                .uri(uri)
                .body(Body::empty())
                .unwrap(),
        )
        .await
        .unwrap();
    let status = res.status().as_u16();
    let body = res.into_body().collect().await.unwrap().to_bytes();
    (status, String::from_utf8(body.to_vec()).unwrap())
}

#[test]
fn a_precise_location_is_never_stored() {
    let w = World::new();
    w.upsert_node(mac(1, "Apple M3 Max", 64).at("Lyon", 45.764_043, 4.835_659))
        .unwrap();
    let stored = w.node(&id(1)).unwrap().location.unwrap();
    assert!(grid::is_centre(stored.lat, stored.lon));
    assert_ne!((stored.lat, stored.lon), (45.764_043, 4.835_659));
    // A caller that bypasses `at` and hands a raw point gets it snapped too.
    let mut raw = mac(2, "Apple M1", 16);
    raw.location = Some(model::Place {
        label: "x".into(),
        lat: 51.507_351,
        lon: -0.127_758,
    });
    w.upsert_node(raw).unwrap();
    let stored = w.node(&id(2)).unwrap().location.unwrap();
    assert!(grid::is_centre(stored.lat, stored.lon));
}

#[test]
fn opted_out_nodes_are_counted_but_not_drawn() {
    let w = World::new();
    w.upsert_node(mac(1, "Apple M2 Ultra", 192).at("Paris", 48.85, 2.35))
        .unwrap();
    let mut hidden = mac(2, "Apple M4 Pro", 48).at("Oslo", 59.91, 10.75);
    hidden.hidden = true;
    w.upsert_node(hidden).unwrap();
    w.upsert_node(mac(3, "Apple M1", 8)).unwrap(); // no place given

    let t = w.totals();
    assert_eq!(t.macs_online, 3);
    assert_eq!(t.macs_on_map, 1);
    assert_eq!(t.memory_online_bytes, (192 + 48 + 8) << 30);
    let view = w.map(&MapQuery::default());
    assert_eq!(view.matched, 1);
    assert_eq!(view.nodes.len(), 1);
    assert_eq!(view.nodes[0].id, id(1));
    assert!(w.card(&id(2)).is_none());
    assert!(w.card(&id(1)).is_some());
}

#[test]
fn status_changes_move_the_totals_and_uptime() {
    let w = World::new();
    w.upsert_node(mac(1, "Apple M3", 24).at("Rome", 41.9, 12.5))
        .unwrap();
    assert!(w.node(&id(1)).unwrap().online_since_ms.is_some());
    w.set_status(&id(1), Status::Offline).unwrap();
    let n = w.node(&id(1)).unwrap();
    assert_eq!(n.status, Status::Offline);
    assert_eq!(n.online_since_ms, None);
    assert_eq!(w.totals().macs_online, 0);
    assert_eq!(w.totals().macs_known, 1);
    assert_eq!(
        w.set_status(&id(9), Status::Idle),
        Err(WorldError::UnknownNode(id(9)))
    );
    assert_eq!(w.set_status("nope", Status::Idle), Err(WorldError::NodeId));
}

#[test]
fn jobs_count_per_node_and_in_totals_and_survive_reregistration() {
    let w = World::new();
    w.upsert_node(mac(1, "Apple M4 Max", 128).at("Tokyo", 35.68, 139.69))
        .unwrap();
    w.record_job(&id(1), 100).unwrap();
    w.record_job(&id(1), 50).unwrap();
    assert_eq!(
        w.record_job(&id(7), 10),
        Err(WorldError::UnknownNode(id(7)))
    );
    let t = w.totals();
    assert_eq!(t.jobs_today, 3);
    assert!((t.tokens_per_s - 16.0).abs() < 1e-9, "{}", t.tokens_per_s);
    // Registering again with zero counters keeps what was counted.
    w.upsert_node(mac(1, "Apple M4 Max", 128).at("Tokyo", 35.68, 139.69))
        .unwrap();
    let card = w.card(&id(1)).unwrap();
    assert_eq!((card.jobs_served, card.tokens_produced), (2, 150));
}

#[test]
fn filters_select_by_chip_status_and_memory() {
    let w = World::new();
    w.upsert_node(mac(1, "Apple M1", 8).at("A", 10.0, 10.0))
        .unwrap();
    w.upsert_node(mac(2, "Apple M3 Ultra", 192).at("B", 20.0, 20.0))
        .unwrap();
    w.upsert_node(mac(3, "Apple M3 Pro", 36).at("C", 30.0, 30.0))
        .unwrap();
    w.set_status(&id(3), Status::Offline).unwrap();
    let q = |f: fn(&mut MapQuery)| {
        let mut q = MapQuery {
            zoom: MAX_ZOOM_FOR_TESTS,
            ..MapQuery::default()
        };
        f(&mut q);
        let mut ids: Vec<String> = w.map(&q).nodes.into_iter().map(|n| n.id).collect();
        ids.sort();
        ids
    };
    assert_eq!(q(|q| q.families = vec![Family::M3]), vec![id(2), id(3)]);
    assert_eq!(q(|q| q.tiers = vec![Tier::Ultra]), vec![id(2)]);
    assert_eq!(q(|q| q.statuses = vec![Status::Offline]), vec![id(3)]);
    assert_eq!(q(|q| q.min_memory_bytes = 32 << 30), vec![id(2), id(3)]);
    assert_eq!(q(|q| q.max_memory_bytes = 32 << 30), vec![id(1)]);
}

const MAX_ZOOM_FOR_TESTS: u8 = cluster::MAX_ZOOM;

#[test]
fn changes_are_broadcast_and_hidden_nodes_never_named() {
    let w = World::new();
    let mut rx = w.subscribe();
    w.upsert_node(mac(1, "Apple M2", 16).at("Cairo", 30.04, 31.24))
        .unwrap();
    let mut hidden = mac(2, "Apple M2", 16).at("Lima", -12.05, -77.04);
    hidden.hidden = true;
    w.upsert_node(hidden).unwrap();
    w.set_status(&id(1), Status::Offline).unwrap();
    match rx.try_recv().unwrap() {
        Change::Node(n) => assert_eq!((n.id, n.status), (id(1), Status::Idle)),
        other => panic!("{other:?}"),
    }
    assert_eq!(rx.try_recv().unwrap(), Change::Totals);
    match rx.try_recv().unwrap() {
        Change::Node(n) => assert_eq!((n.id, n.status), (id(1), Status::Offline)),
        other => panic!("{other:?}"),
    }
    // Opting out later removes the node from the map for watchers.
    let mut now_hidden = mac(1, "Apple M2", 16).at("Cairo", 30.04, 31.24);
    now_hidden.hidden = true;
    w.upsert_node(now_hidden).unwrap();
    assert_eq!(rx.try_recv().unwrap(), Change::Gone(id(1)));
}

#[test]
fn bad_node_ids_are_refused() {
    let w = World::new();
    assert_eq!(
        w.upsert_node(NodeView::new("ABC", "x", "Apple M1", 1)),
        Err(WorldError::NodeId)
    );
    assert!(w.is_empty());
}

fn all_coordinates(v: &serde_json::Value, out: &mut Vec<(f64, f64)>) {
    match v {
        serde_json::Value::Object(m) => {
            if let (Some(lat), Some(lon)) = (
                m.get("lat").and_then(|x| x.as_f64()),
                m.get("lon").and_then(|x| x.as_f64()),
            ) {
                out.push((lat, lon));
            }
            m.values().for_each(|x| all_coordinates(x, out));
        }
        serde_json::Value::Array(a) => a.iter().for_each(|x| all_coordinates(x, out)),
        _ => {}
    }
}

#[tokio::test]
async fn the_api_never_returns_a_location_finer_than_the_grid() {
    let w = World::new();
    // Precise points, as a careless or hostile node might send them.
    for i in 0..300u32 {
        let lat = -60.0 + f64::from(i) * 0.397_31;
        let lon = -170.0 + f64::from(i) * 1.123_457;
        w.upsert_node(mac(i, "Apple M4", 16).at("somewhere", lat, lon))
            .unwrap();
    }
    let mut coords = Vec::new();
    for z in 0..=cluster::MAX_ZOOM {
        let (status, body) = get(&w, &format!("/api/world/map?z={z}")).await;
        assert_eq!(status, 200, "{body}");
        all_coordinates(&serde_json::from_str(&body).unwrap(), &mut coords);
    }
    for i in [0u32, 17, 299] {
        let (status, body) = get(&w, &format!("/api/world/nodes/{}", id(i))).await;
        assert_eq!(status, 200, "{body}");
        all_coordinates(&serde_json::from_str(&body).unwrap(), &mut coords);
    }
    assert!(coords.len() > 300);
    for (lat, lon) in coords {
        assert!(
            grid::is_centre(lat, lon),
            "{lat},{lon} is finer than the grid"
        );
    }
}

#[tokio::test]
async fn bad_queries_get_clear_json_errors() {
    let w = World::new();
    for (uri, needle) in [
        ("/api/world/map?z=99", "zoom"),
        ("/api/world/map?bbox=1,2,3", "bbox"),
        ("/api/world/map?family=M9", "family"),
        ("/api/world/map?status=asleep", "status"),
        ("/api/world/map?min_mem_gb=-3", "min_mem_gb"),
    ] {
        let (status, body) = get(&w, uri).await;
        assert_eq!(status, 400, "{uri}");
        let v: HashMap<String, String> = serde_json::from_str(&body).unwrap();
        assert!(v["error"].contains(needle), "{uri}: {body}");
    }
    let (status, body) = get(&w, &format!("/api/world/nodes/{}", id(5))).await;
    assert_eq!(status, 404);
    assert!(body.contains("error"));
}

#[tokio::test]
async fn the_page_and_its_assets_are_served_from_the_binary() {
    let w = World::new();
    let (status, html) = get(&w, "/").await;
    assert_eq!(status, 200);
    assert!(html.contains("/world/app.js") && html.contains("id=\"map\""));
    for asset in [
        "app.js",
        "topo.js",
        "style.css",
        "countries-110m.json",
        "map-licence.txt",
    ] {
        let (status, body) = get(&w, &format!("/world/{asset}")).await;
        assert_eq!(status, 200, "{asset}");
        assert!(!body.is_empty(), "{asset}");
    }
    assert_eq!(get(&w, "/world/secret.txt").await.0, 404);
}

#[tokio::test]
async fn live_streams_end_when_the_world_is_closed() {
    let w = World::new();
    let res = router(w.clone())
        .oneshot(
            axum::http::Request::builder()
                .uri("/api/world/events")
                .body(Body::empty())
                .unwrap(),
        )
        .await
        .unwrap();
    assert_eq!(res.status().as_u16(), 200);
    let mut body = res.into_body();
    // The first event is `hello` with the totals.
    let first = body.frame().await.unwrap().unwrap().into_data().unwrap();
    assert!(String::from_utf8_lossy(&first).contains("event: hello"));
    w.upsert_node(mac(1, "Apple M5", 32).at("Nairobi", -1.29, 36.82))
        .unwrap();
    let next = body.frame().await.unwrap().unwrap().into_data().unwrap();
    let text = String::from_utf8_lossy(&next);
    assert!(
        text.contains("event: changes") && text.contains(&id(1)),
        "{text}"
    );
    w.close();
    let end = tokio::time::timeout(std::time::Duration::from_secs(5), async {
        while let Some(frame) = body.frame().await {
            if frame.is_err() {
                break;
            }
        }
    })
    .await;
    assert!(end.is_ok(), "the stream did not end after close");
}

/// Tokens per joule is the token-weighted median of the metered jobs:
/// jobs without energy do not count, and a node lying about its energy
/// moves the figure only as far as its share of the tokens.
#[test]
fn tokens_per_joule_is_the_token_weighted_median_of_metered_jobs() {
    let w = World::new();
    assert_eq!(w.totals().tokens_per_joule, None);
    w.record_energy(100, 0);
    w.record_energy(0, 5_000_000);
    assert_eq!(w.totals().tokens_per_joule, None);
    // Honest jobs: 2 and 4 tokens per joule, as many tokens each.
    w.record_energy(100, 50_000_000);
    w.record_energy(100, 25_000_000);
    w.record_energy(100, 25_000_000);
    assert_eq!(w.totals().tokens_per_joule, Some(4.0));
    // A liar claiming almost no energy, with fewer tokens than the rest.
    w.record_energy(250, 1);
    assert_eq!(w.totals().tokens_per_joule, Some(4.0));
    // Only the last ENERGY_SAMPLES jobs count.
    for _ in 0..ENERGY_SAMPLES {
        w.record_energy(10, 10_000_000);
    }
    assert_eq!(w.totals().tokens_per_joule, Some(1.0));
}
