//! The World page in real headless Chromium (Debian `chromium` +
//! `chromium-driver`), driven over WebDriver from the test suite.
//!
//! - With a real coordinator and real nodes: the page draws every node that
//!   gave a place, counts the one that opted out without drawing it, turns a
//!   stopped node's marker offline live (no reload), and shows a node's card
//!   when its marker is clicked; the JSON API returns only grid cell centres
//!   whatever the nodes sent.
//! - With a World of synthetic nodes behind the same router: the same page
//!   behaviour without model-running nodes, and screenshots of a few hundred
//!   nodes kept under `tests/artifacts/` (desktop and phone sizes), checked
//!   pixel by pixel: sea and land where the map has them, a marker where the
//!   page says it drew one, the totals bar's text.
//!
//! Waiting is event-driven: scripts resolve on the page's own change
//! notifications (`window.__world.subscribe`) or DOM mutations, bounded by
//! WebDriver's script timeout. No verdict depends on how fast the machine
//! is: the bounds ([`UPDATE_WITHIN`]) are wide margins that only keep a
//! broken page from hanging the suite.

use std::{net::SocketAddr, path::PathBuf, time::Duration};

use anyhow::{ensure, Context};
use mlx_node::config::Location;
use mlxnet_coordinator::test_utils::webdriver::{http_get, Browser};
use mlxnet_coordinator::world::{self, grid, NodeView, Status, World};
use mlxnet_tests::{coordinator_config, repo_root, spawn_coordinator, spawn_node, test_model};
use serde_json::{json, Value};

/// Longest a test waits for the page to show a change it was sent (a wide
/// margin: on an idle machine it takes milliseconds).
const UPDATE_WITHIN: Duration = Duration::from_secs(60);

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
        UPDATE_WITHIN,
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
        UPDATE_WITHIN,
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
        UPDATE_WITHIN,
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
    let tokyo = nodes.remove(1);
    tokyo.stop().await?;
    wait_for(
        &b,
        "window.__world.markers.some(m => m.id === a[0] && m.status === 'offline')",
        json!([ids[1]]),
        UPDATE_WITHIN,
    )
    .await
    .with_context(|| format!("node {} offline on the page", ids[1]))?;
    assert_eq!(
        b.execute("return window.__noReload;", json!([])).await?,
        json!("still here")
    );
    wait_for(
        &b,
        "document.getElementById('total-online').dataset.value === '3'",
        json!([]),
        UPDATE_WITHIN,
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
        UPDATE_WITHIN,
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
        UPDATE_WITHIN,
    )
    .await?;

    served
        .world
        .set_status(&format!("{:064x}", 1), Status::Offline)?;
    wait_for(
        &b,
        "window.__world.markers.some(m => m.id === a[0] && m.status === 'offline')
           && document.getElementById('total-online').dataset.value === '3'",
        json!([format!("{:064x}", 1)]),
        UPDATE_WITHIN,
    )
    .await
    .context("the page shows the status change live")?;

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
        UPDATE_WITHIN,
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
    // Metered jobs: 4 tokens per joule (the token-weighted median).
    world.record_energy(100, 25_000_000);
    world.record_energy(300, 75_000_000);
    world.record_energy(100, 50_000_000);
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
            UPDATE_WITHIN,
        )
        .await?;
        assert!(v["markers"].as_u64().unwrap_or(0) > 5, "{v}");
        let tpj = b
            .execute(
                "const e = document.getElementById('total-tpj'); return [e.textContent, e.dataset.value];",
                json!([]),
            )
            .await?;
        assert_eq!(
            tpj,
            json!(["4.00", "4"]),
            "tokens per joule in the totals bar"
        );
        let png = screenshot_checked(&b, file).await?;
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
                UPDATE_WITHIN,
            )
            .await?;
            assert!(v["nodes"].as_u64().unwrap_or(0) > 0, "{v}");
            let png = screenshot_checked(&b, "world-europe.png").await?;
            std::fs::write(dir.join("world-europe.png"), png)?;
        }
        b.close().await?;
    }
    assert!(on_map > 300);
    Ok(())
}

// ---------------------------------------------------------------------------
// Screenshots checked by their pixels.

/// The base map's colours (app.js `drawBase`): the sea and the land fill.
const SEA: [u8; 3] = [0x0b, 0x12, 0x20];
const LAND: [u8; 3] = [0x1e, 0x29, 0x3b];
/// Points well inside a continent or an ocean, away from the graticule
/// (every 30 degrees), as (lon, lat).
const LAND_POINTS: [(f64, f64); 12] = [
    (3.0, 26.0),    // Algeria, the Sahara
    (100.0, 62.0),  // Siberia
    (134.0, -24.0), // central Australia
    (-100.0, 40.0), // Kansas
    (-55.0, -10.0), // Mato Grosso
    (68.0, 48.0),   // Kazakhstan
    (22.0, 5.0),    // Central African Republic
    (-40.0, 74.0),  // Greenland
    (2.0, 46.5),    // the Massif Central
    (26.0, 64.0),   // Finland
    (33.0, 50.0),   // Ukraine
    (-5.0, 39.0),   // La Mancha
];
const SEA_POINTS: [(f64, f64); 10] = [
    (-140.0, -20.0), // south Pacific
    (-160.0, 25.0),  // north Pacific
    (-20.0, -40.0),  // south Atlantic
    (-40.0, 40.0),   // north Atlantic
    (80.0, -40.0),   // Indian Ocean
    (170.0, -50.0),  // south of New Zealand
    (-25.0, 48.0),   // the Atlantic west of Europe
    (-14.0, 53.0),   // west of Ireland
    (19.0, 34.0),    // the Mediterranean south of Greece
    (4.0, 56.0),     // the North Sea
];

/// What the page says about where it drew things, in viewport CSS px, once
/// two animation frames have passed (so the canvas shows the markers).
const PAGE_FACTS: &str = r#"
const done = arguments[arguments.length - 1];
const [land, sea] = [arguments[0], arguments[1]];
requestAnimationFrame(() => requestAnimationFrame(() => {
  const canvas = document.getElementById('map');
  const r = canvas.getBoundingClientRect();
  const v = window.__world.view;
  const W = 512 * 2 ** v.zoom;
  const at = ([lon, lat]) => [
    ((lon + 180) / 360) * W - ((v.lon + 180) / 360) * W + r.width / 2 + r.left,
    ((90 - lat) / 360) * W - ((90 - v.lat) / 360) * W + r.height / 2 + r.top];
  const markers = window.__world.markers.map(m => ({ kind: m.kind, x: m.x, y: m.y, r: m.r }));
  // A point shows the bare map if the canvas is on top there and no marker
  // (with its halo) covers it.
  const bare = ([x, y]) => document.elementFromPoint(x, y) === canvas
    && markers.every(m => Math.hypot(m.x - x, m.y - y) > m.r + 14);
  const t = document.getElementById('totals').getBoundingClientRect();
  done({
    dpr: window.devicePixelRatio, width: window.innerWidth, height: window.innerHeight,
    land: land.map(at).filter(bare), sea: sea.map(at).filter(bare),
    markers: markers.filter(m => document.elementFromPoint(m.x, m.y) === canvas),
    totals: [t.left, t.top, t.width, t.height],
  });
}));
"#;

/// An RGB image decoded from a PNG.
struct Image {
    width: usize,
    height: usize,
    rgb: Vec<u8>,
}

impl Image {
    fn decode(png_bytes: &[u8]) -> anyhow::Result<Image> {
        let mut decoder = png::Decoder::new(std::io::Cursor::new(png_bytes));
        decoder.set_transformations(png::Transformations::normalize_to_color8());
        let mut reader = decoder.read_info().context("not a PNG")?;
        let mut buf = vec![0; reader.output_buffer_size().context("PNG size")?];
        let info = reader.next_frame(&mut buf)?;
        let channels = info.color_type.samples();
        ensure!(channels >= 3, "a {:?} screenshot", info.color_type);
        let rgb = buf[..info.buffer_size()]
            .chunks_exact(channels)
            .flat_map(|p| [p[0], p[1], p[2]])
            .collect();
        Ok(Image {
            width: info.width as usize,
            height: info.height as usize,
            rgb,
        })
    }

    fn pixel(&self, x: usize, y: usize) -> [u8; 3] {
        let i = 3 * (y * self.width + x);
        [self.rgb[i], self.rgb[i + 1], self.rgb[i + 2]]
    }

    /// The per-channel median of the 5 x 5 pixels around device pixel
    /// (x, y): robust to a border line or an anti-aliased edge through it.
    fn patch(&self, x: f64, y: f64) -> Option<[u8; 3]> {
        let (cx, cy) = (x.round() as i64, y.round() as i64);
        let mut px = Vec::with_capacity(25);
        for dy in -2..=2 {
            for dx in -2..=2 {
                let (x, y) = (cx + dx, cy + dy);
                if x < 0 || y < 0 || x as usize >= self.width || y as usize >= self.height {
                    return None;
                }
                px.push(self.pixel(x as usize, y as usize));
            }
        }
        let mut out = [0u8; 3];
        for (c, o) in out.iter_mut().enumerate() {
            let mut v: Vec<u8> = px.iter().map(|p| p[c]).collect();
            v.sort_unstable();
            *o = v[v.len() / 2];
        }
        Some(out)
    }
}

fn near(a: [u8; 3], b: [u8; 3], tolerance: u8) -> bool {
    a.iter().zip(&b).all(|(x, y)| x.abs_diff(*y) <= tolerance)
}

fn points(v: &Value) -> Vec<(f64, f64)> {
    v.as_array()
        .map(|a| {
            a.iter()
                .filter_map(|p| Some((p[0].as_f64()?, p[1].as_f64()?)))
                .collect()
        })
        .unwrap_or_default()
}

/// Takes a screenshot and checks its pixels against what the page says it
/// drew: the sea and the land where the map has them, a marker at every
/// marker the page lists (not the bare map), and text in the totals bar.
async fn screenshot_checked(b: &Browser, what: &str) -> anyhow::Result<Vec<u8>> {
    let facts = b
        .execute_async(PAGE_FACTS, json!([LAND_POINTS, SEA_POINTS]))
        .await
        .context("reading where the page drew things")?;
    let png = b.screenshot().await?;
    let img = Image::decode(&png).with_context(|| format!("{what}: the screenshot"))?;
    let dpr = facts["dpr"].as_f64().context("dpr")?;
    let width = facts["width"].as_f64().context("width")?;
    ensure!(
        img.width == (width * dpr).round() as usize,
        "{what}: a {}-pixel-wide screenshot of a {width}-px viewport at {dpr}x",
        img.width
    );
    let (land, sea) = (points(&facts["land"]), points(&facts["sea"]));
    ensure!(
        land.len() >= 2 && sea.len() >= 2,
        "{what}: too few bare map points to check: {facts}"
    );
    for (kind, pts, colour) in [("land", &land, LAND), ("sea", &sea, SEA)] {
        for &(x, y) in pts {
            let got = img
                .patch(x * dpr, y * dpr)
                .with_context(|| format!("{what}: {kind} point ({x}, {y}) off the image"))?;
            ensure!(
                near(got, colour, 8),
                "{what}: {kind} expected at ({x:.0}, {y:.0}) as {colour:?}, the screenshot has {got:?}"
            );
        }
    }
    let markers = facts["markers"].as_array().context("markers")?;
    let mut checked = 0;
    for m in markers {
        let (x, y, r) = (
            m["x"].as_f64().context("x")?,
            m["y"].as_f64().context("y")?,
            m["r"].as_f64().context("r")?,
        );
        // A cluster's count is written on its centre: look above it.
        let (x, y) = if m["kind"] == "cluster" {
            if r < 8.0 {
                continue;
            }
            (x, y - 0.7 * r)
        } else {
            (x, y)
        };
        let Some(i) = (x * dpr >= 0.0 && y * dpr >= 0.0)
            .then_some(((x * dpr) as usize, (y * dpr) as usize))
            .filter(|&(x, y)| x < img.width && y < img.height)
        else {
            continue;
        };
        let got = img.pixel(i.0, i.1);
        ensure!(
            !near(got, SEA, 12) && !near(got, LAND, 12),
            "{what}: the page lists a {} at ({x:.0}, {y:.0}) but the screenshot shows bare map there ({got:?})",
            m["kind"]
        );
        checked += 1;
    }
    ensure!(checked > 0, "{what}: no marker to check: {facts}");
    let t = points(&json!([facts["totals"]]));
    let (tl, tt) = t.first().copied().context("totals rect")?;
    let (tw, th) = (
        facts["totals"][2].as_f64().context("totals width")?,
        facts["totals"][3].as_f64().context("totals height")?,
    );
    let mut lit = 0;
    for y in (tt * dpr) as usize..((tt + th) * dpr) as usize {
        for x in (tl * dpr) as usize..((tl + tw) * dpr) as usize {
            if x < img.width && y < img.height && img.pixel(x, y).iter().any(|&c| c > 140) {
                lit += 1;
            }
        }
    }
    ensure!(
        lit > 40,
        "{what}: the totals bar ({tw:.0} x {th:.0} px) shows no text ({lit} light pixels)"
    );
    eprintln!(
        "{what}: {} land and {} sea points, {checked} markers, {lit} light totals pixels checked",
        land.len(),
        sea.len()
    );
    Ok(png)
}
