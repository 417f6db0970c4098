//! The World page in real headless Chromium (Debian `chromium` +
//! `chromium-driver`), driven over WebDriver from the test suite.
//!
//! - With a real coordinator and real nodes: the page draws every node that
//!   gave a place, counts the one that opted out without drawing it, turns a
//!   stopped node's marker offline live (no reload) within 5 s, and shows a
//!   node's card when its marker is clicked; the JSON API returns only grid
//!   cell centres whatever the nodes sent.
//! - With a World of synthetic nodes behind the same router: the same page
//!   behaviour without model-running nodes, and screenshots of a few hundred
//!   nodes kept under `tests/artifacts/` (desktop and phone sizes).
//!
//! Waiting is event-driven: scripts resolve on the page's own change
//! notifications (`window.__world.subscribe`) or DOM mutations, bounded by
//! WebDriver's script timeout.

use std::{net::SocketAddr, path::PathBuf, time::Duration};

use anyhow::{ensure, Context};
use mlx_node::config::Location;
use mlxnet_coordinator::test_utils::webdriver::{http_get, Browser};
use mlxnet_coordinator::world::{self, grid, NodeView, Status, World};
use mlxnet_tests::{coordinator_config, repo_root, spawn_coordinator, spawn_node, test_model};
use serde_json::{json, Value};

/// The page must show a stopped node as offline within this long.
const OFFLINE_WITHIN: Duration = Duration::from_secs(5);

/// A World served by its own router on a port the OS chose.
struct Served {
    addr: SocketAddr,
    world: World,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for Served {
    fn drop(&mut self) {
        self.task.abort();
    }
}

async fn serve(world: World) -> anyhow::Result<Served> {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    let router = world::router(world.clone());
    let task = tokio::spawn(async move {
        let _ = axum::serve(listener, router).await;
    });
    Ok(Served { addr, world, task })
}

/// Waits, inside the page, until the JS expression `cond` (which may read the
/// WebDriver arguments as `a`) is truthy, re-checking on every page update
/// and DOM mutation; returns its value. Fails after `timeout`.
async fn wait_for(
    b: &Browser,
    cond: &str,
    args: Value,
    timeout: Duration,
) -> anyhow::Result<Value> {
    b.script_timeout(timeout.as_millis() as u64).await?;
    let script = format!(
        "const a = Array.from(arguments); const done = a.pop();
         const test = () => {{ try {{ return ({cond}); }} catch (e) {{ return false; }} }};
         let off = null, obs = null;
         const check = () => {{ const v = test(); if (v) {{ if (off) off(); if (obs) obs.disconnect(); done(v); return true; }} return false; }};
         if (!check()) {{
           obs = new MutationObserver(check);
           obs.observe(document.body, {{ subtree: true, attributes: true, childList: true, characterData: true }});
           const hook = () => window.__world && window.__world.subscribe ? (off = window.__world.subscribe(check)) : null;
           if (!hook()) window.addEventListener('load', () => {{ hook(); check(); }});
         }}"
    );
    b.execute_async(&script, args)
        .await
        .with_context(|| format!("waiting for `{cond}`"))
}

/// The drawn node markers as the page lists them: (id, status).
async fn node_markers(b: &Browser) -> anyhow::Result<Vec<(String, String)>> {
    let v = b
        .execute(
            "return window.__world.markers.filter(m => m.kind === 'node').map(m => [m.id, m.status]);",
            json!([]),
        )
        .await?;
    Ok(v.as_array()
        .context("markers")?
        .iter()
        .map(|m| {
            (
                m[0].as_str().unwrap_or("").to_owned(),
                m[1].as_str().unwrap_or("").to_owned(),
            )
        })
        .collect())
}

/// Clicks the canvas where the page drew `node_id` and waits for its card.
async fn click_marker_and_read_card(b: &Browser, node_id: &str) -> anyhow::Result<Value> {
    let m = b
        .execute(
            "return window.__world.markers.find(m => m.id === arguments[0]) || null;",
            json!([node_id]),
        )
        .await?;
    ensure!(!m.is_null(), "no marker for {node_id}");
    let (x, y) = (m["x"].as_f64().context("x")?, m["y"].as_f64().context("y")?);
    b.hover_at(x, y).await?;
    let tip = wait_for(
        b,
        "(() => { const t = document.getElementById('tooltip'); return !t.hidden && t.dataset.nodeId === a[0] && t.textContent; })()",
        json!([node_id]),
        Duration::from_secs(5),
    )
    .await
    .context("hovering a marker shows its tooltip")?;
    ensure!(tip.as_str().is_some_and(|t| !t.is_empty()));
    b.click_at(x, y).await?;
    wait_for(
        b,
        "(() => { const c = document.getElementById('node-card');
                  return !c.hidden && c.dataset.nodeId === a[0] && c.dataset.loaded === 'true'
                    && { text: c.textContent, status: c.dataset.status }; })()",
        json!([node_id]),
        Duration::from_secs(10),
    )
    .await
    .context("clicking a marker shows its card")
}

fn text_u64(v: &Value) -> u64 {
    v.as_str().and_then(|s| s.parse().ok()).unwrap_or(u64::MAX)
}

async fn totals_in_page(b: &Browser) -> anyhow::Result<Value> {
    b.execute(
        "const g = id => document.getElementById(id).dataset.value;
         return { online: g('total-online'), memory: g('total-memory'), pods: g('total-pods') };",
        json!([]),
    )
    .await
}

fn artifacts() -> anyhow::Result<PathBuf> {
    let dir = repo_root().join("tests").join("artifacts");
    std::fs::create_dir_all(&dir)?;
    Ok(dir)
}

fn all_coordinates(v: &Value, out: &mut Vec<(f64, f64)>) {
    match v {
        Value::Object(m) => {
            if let (Some(lat), Some(lon)) = (
                m.get("lat").and_then(Value::as_f64),
                m.get("lon").and_then(Value::as_f64),
            ) {
                out.push((lat, lon));
            }
            m.values().for_each(|x| all_coordinates(x, out));
        }
        Value::Array(a) => a.iter().for_each(|x| all_coordinates(x, out)),
        _ => {}
    }
}

async fn get_json(addr: SocketAddr, path: &str) -> anyhow::Result<(u16, Value)> {
    let (status, body, _) = http_get(addr, path).await?;
    let v = serde_json::from_slice(&body).with_context(|| format!("{path}: not JSON"))?;
    Ok((status, v))
}

// ---------------------------------------------------------------------------
// With a real coordinator and real nodes.

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn world_page_shows_real_nodes_live() -> anyhow::Result<()> {
    test_model();
    let dir = tempfile::tempdir()?;
    let coord = spawn_coordinator(coordinator_config(&dir.path().join("coord"))).await?;
    let places = [
        ("lyon", "Lyon, France", 45.764_043, 4.835_659, false),
        ("tokyo", "Tokyo, Japan", 35.689_487, 139.691_711, false),
        ("santos", "Santos, Brazil", -23.960_833, -46.333_611, false),
        ("oslo", "Oslo, Norway", 59.913_868, 10.752_245, true),
    ];
    let mut nodes = Vec::new();
    for (name, place, lat, lon, hidden) in places {
        let mut config = coord.node_config(&dir.path().join(name), name);
        config.location = Some(Location {
            place: Some(place.into()),
            lat: Some(lat),
            lon: Some(lon),
            hidden: Some(hidden),
        });
        let mut node = spawn_node(config).await?;
        node.registered().await?;
        nodes.push(node);
    }
    let ids: Vec<String> = nodes.iter().map(|n| n.id.to_string()).collect();

    // Must show 2, at the API: only grid cell centres, whatever was sent.
    let mut coords = Vec::new();
    for z in 0..=world::cluster::MAX_ZOOM {
        let (status, v) = get_json(coord.http_addr, &format!("/api/world/map?z={z}")).await?;
        ensure!(status == 200, "map z={z}: {v}");
        all_coordinates(&v, &mut coords);
    }
    for id in &ids[..3] {
        let (status, v) = get_json(coord.http_addr, &format!("/api/world/nodes/{id}")).await?;
        ensure!(status == 200, "card {id}: {v}");
        all_coordinates(&v, &mut coords);
    }
    ensure!(coords.len() >= 3 * 9, "too few coordinates: {coords:?}");
    for (lat, lon) in &coords {
        assert!(
            grid::is_centre(*lat, *lon),
            "{lat},{lon} is finer than the grid"
        );
        for (_, _, plat, plon, _) in places {
            assert!(
                (*lat, *lon) != (plat, plon),
                "a node's own coordinates came back"
            );
        }
    }
    let (status, _) = get_json(coord.http_addr, &format!("/api/world/nodes/{}", ids[3])).await?;
    assert_eq!(status, 404, "the opted-out node's card must not exist");

    // Must show 1, in the browser.
    let b = Browser::start(1280, 800).await?;
    b.goto(&format!("http://{}/", coord.http_addr)).await?;
    wait_for(
        &b,
        "window.__world.ready && window.__world.live && window.__world.markers.filter(m => m.kind === 'node').length === 3
           && document.getElementById('total-online').dataset.value === '4'",
        json!([]),
        Duration::from_secs(20),
    )
    .await
    .context("the page shows 3 markers and 4 Macs online")?;
    let markers = node_markers(&b).await?;
    let mut drawn: Vec<&str> = markers.iter().map(|(id, _)| id.as_str()).collect();
    drawn.sort();
    let mut visible: Vec<&str> = ids[..3].iter().map(String::as_str).collect();
    visible.sort();
    assert_eq!(drawn, visible, "exactly the three visible nodes are drawn");
    let html = b
        .execute("return document.documentElement.outerHTML;", json!([]))
        .await?;
    assert!(
        !html.as_str().unwrap_or("").contains(&ids[3]),
        "the opted-out node is named in the page"
    );
    let listed = b
        .execute(
            "return document.querySelectorAll('#marker-list button[data-kind=node]').length;",
            json!([]),
        )
        .await?;
    assert_eq!(listed, json!(3));
    let totals = totals_in_page(&b).await?;
    assert_eq!(
        text_u64(&totals["online"]),
        4,
        "hidden node counted: {totals}"
    );
    assert!(text_u64(&totals["memory"]) > 0, "{totals}");

    let card = click_marker_and_read_card(&b, &ids[0]).await?;
    let text = card["text"].as_str().unwrap_or("");
    assert!(
        text.contains("lyon") && text.contains("Lyon, France"),
        "card: {text}"
    );

    // Stop one node: its marker turns offline without a reload.
    b.execute("window.__noReload = 'still here';", json!([]))
        .await?;
    let started = std::time::Instant::now();
    let tokyo = nodes.remove(1);
    tokyo.stop().await?;
    let left = OFFLINE_WITHIN.saturating_sub(started.elapsed());
    wait_for(
        &b,
        "window.__world.markers.some(m => m.id === a[0] && m.status === 'offline')",
        json!([ids[1]]),
        left.max(Duration::from_millis(1)),
    )
    .await
    .with_context(|| {
        format!(
            "node {} offline on the page within {OFFLINE_WITHIN:?}",
            ids[1]
        )
    })?;
    let took = started.elapsed();
    assert!(took <= OFFLINE_WITHIN, "took {took:?}");
    assert_eq!(
        b.execute("return window.__noReload;", json!([])).await?,
        json!("still here")
    );
    wait_for(
        &b,
        "document.getElementById('total-online').dataset.value === '3'",
        json!([]),
        Duration::from_secs(5),
    )
    .await?;
    b.close().await?;
    Ok(())
}

// ---------------------------------------------------------------------------
// With a World of synthetic nodes behind the same router.

fn node(i: u32, name: &str, chip: &str, gib: u64, lat: f64, lon: f64) -> NodeView {
    NodeView::new(format!("{i:064x}"), name, chip, gib << 30).at(name, lat, lon)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn world_page_markers_cards_and_live_status() -> anyhow::Result<()> {
    let world = World::new();
    world.upsert_node(node(1, "lyon-studio", "Apple M2 Ultra", 192, 45.76, 4.84))?;
    world.upsert_node(node(2, "tokyo-mini", "Apple M4 Pro", 64, 35.68, 139.69))?;
    world.upsert_node(node(3, "lima-air", "Apple M3", 16, -12.05, -77.04))?;
    let mut hidden = node(4, "secret", "Apple M1 Max", 64, 59.91, 10.75);
    hidden.hidden = true;
    world.upsert_node(hidden)?;
    let served = serve(world).await?;
    let b = Browser::start(1280, 800).await?;
    b.goto(&format!("http://{}/", served.addr)).await?;
    wait_for(
        &b,
        "window.__world.ready && window.__world.live && window.__world.markers.filter(m => m.kind === 'node').length === 3",
        json!([]),
        Duration::from_secs(20),
    )
    .await?;
    let totals = totals_in_page(&b).await?;
    assert_eq!(text_u64(&totals["online"]), 4, "{totals}");
    assert_eq!(
        text_u64(&totals["memory"]),
        (192 + 64 + 16 + 64) << 30,
        "{totals}"
    );
    let markers = node_markers(&b).await?;
    assert!(!markers.iter().any(|(id, _)| id == &format!("{:064x}", 4)));

    let card = click_marker_and_read_card(&b, &format!("{:064x}", 2)).await?;
    let text = card["text"].as_str().unwrap_or("");
    assert!(
        text.contains("tokyo-mini") && text.contains("Apple M4 Pro") && text.contains("64 GB"),
        "{text}"
    );

    // The accessible list selects like a click on the canvas.
    // (Visually hidden until focused, so it is activated as a keyboard or
    // screen reader would, not with a pointer.)
    b.find(&format!("#marker-list button[data-node-id='{:064x}']", 3))
        .await?;
    b.execute(
        "document.querySelector(`#marker-list button[data-node-id='${arguments[0]}']`).click();",
        json!([format!("{:064x}", 3)]),
    )
    .await?;
    wait_for(
        &b,
        "document.getElementById('node-card').dataset.nodeId === a[0] && document.getElementById('node-card').dataset.loaded === 'true'",
        json!([format!("{:064x}", 3)]),
        Duration::from_secs(5),
    )
    .await?;

    let started = std::time::Instant::now();
    served
        .world
        .set_status(&format!("{:064x}", 1), Status::Offline)?;
    wait_for(
        &b,
        "window.__world.markers.some(m => m.id === a[0] && m.status === 'offline')
           && document.getElementById('total-online').dataset.value === '3'",
        json!([format!("{:064x}", 1)]),
        OFFLINE_WITHIN,
    )
    .await?;
    assert!(started.elapsed() <= OFFLINE_WITHIN);

    // Filters: only Ultra chips.
    b.execute(
        "for (const t of ['base', 'pro', 'max']) document.querySelector(`input[name=tier][value=${t}]`).click();",
        json!([]),
    )
    .await?;
    wait_for(
        &b,
        "window.__world.markers.length === 1 && window.__world.markers[0].tier === 'ultra'",
        json!([]),
        Duration::from_secs(5),
    )
    .await
    .context("the tier filter leaves the one Ultra")?;
    b.close().await?;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn world_page_screenshots_of_a_few_hundred_nodes() -> anyhow::Result<()> {
    let world = World::new();
    for n in world::synthetic::network(400, 7) {
        world.upsert_node(n)?;
    }
    let on_map = world.totals().macs_on_map;
    let served = serve(world).await?;
    let dir = artifacts()?;

    for (file, w, h) in [
        ("world-desktop.png", 1440, 900),
        ("world-phone.png", 390, 844),
    ] {
        let b = Browser::start(w, h).await?;
        b.goto(&format!("http://{}/", served.addr)).await?;
        let v = wait_for(
            &b,
            "window.__world.ready && window.__world.totals && window.__world.markers.length > 0 && { markers: window.__world.markers.length }",
            json!([]),
            Duration::from_secs(20),
        )
        .await?;
        assert!(v["markers"].as_u64().unwrap_or(0) > 5, "{v}");
        let png = b.screenshot().await?;
        assert_eq!(&png[..8], b"\x89PNG\r\n\x1a\n", "not a PNG");
        std::fs::write(dir.join(file), &png)?;
        if w > 1000 {
            // Zoomed on Europe: single Macs, fanned-out cities, pods.
            b.execute_async(
                "const done = arguments[arguments.length - 1]; window.__world.zoomTo(10, 48, 3.6).then(() => done(true));",
                json!([]),
            )
            .await?;
            let v = wait_for(
                &b,
                "window.__world.markers.some(m => m.kind === 'node') && { nodes: window.__world.markers.filter(m => m.kind === 'node').length }",
                json!([]),
                Duration::from_secs(10),
            )
            .await?;
            assert!(v["nodes"].as_u64().unwrap_or(0) > 0, "{v}");
            std::fs::write(dir.join("world-europe.png"), b.screenshot().await?)?;
        }
        b.close().await?;
    }
    assert!(on_map > 300);
    Ok(())
}
