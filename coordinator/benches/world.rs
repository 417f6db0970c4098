//! World page benchmark: 100,000 synthetic nodes.
//!
//! Prints, per zoom level, the map API's response size and time (over real
//! HTTP to the real router) for a 1280x800 view over Europe and for the whole
//! world, then the time to first render of the page in headless Chromium
//! (when `chromedriver` is installed; `apt-get install chromium chromium-driver`).
//! Goals: responses <= 200 KB, first render <= 1 s.
//!
//! Run: `cargo bench -p mlxnet-coordinator --bench world` (optionally
//! `-- --nodes 100000 --runs 15`).

use std::{net::SocketAddr, time::Duration};

use anyhow::Context;
use mlxnet_coordinator::{
    test_utils::webdriver,
    world::{self, cluster, World},
};
use serde_json::json;

const VIEW_W: f64 = 1280.0;
const VIEW_H: f64 = 800.0;
const GOAL_BYTES: usize = 200 * 1024;

/// The bbox the page asks for at `zoom` centred on (lon, lat): the viewport
/// plus a quarter on every side, as app.js does.
fn page_bbox(zoom: u8, lon: f64, lat: f64) -> String {
    let w = cluster::TILE_PX * 2f64.powi(i32::from(zoom));
    let k = 360.0 / w;
    let half_lon = VIEW_W * 0.75 * k;
    let half_lat = VIEW_H * 0.75 * k;
    format!(
        "{:.3},{:.3},{:.3},{:.3}",
        (lon - half_lon).max(-180.0),
        (lat - half_lat).max(-90.0),
        (lon + half_lon).min(180.0),
        (lat + half_lat).min(90.0)
    )
}

fn median(mut v: Vec<Duration>) -> Duration {
    v.sort();
    v[v.len() / 2]
}

struct Row {
    zoom: u8,
    view: &'static str,
    bytes: usize,
    items: usize,
    matched: u64,
    median: Duration,
    max: Duration,
}

async fn measure(
    addr: SocketAddr,
    zoom: u8,
    view: &'static str,
    bbox: &str,
    runs: usize,
) -> anyhow::Result<Row> {
    let path = format!("/api/world/map?z={zoom}&bbox={bbox}");
    let mut times = Vec::new();
    let mut body = Vec::new();
    for _ in 0..runs {
        let (status, b, took) = webdriver::http_get(addr, &path).await?;
        anyhow::ensure!(status == 200, "{path}: HTTP {status}");
        times.push(took);
        body = b;
    }
    let v: serde_json::Value = serde_json::from_slice(&body)?;
    let items =
        v["nodes"].as_array().map_or(0, Vec::len) + v["clusters"].as_array().map_or(0, Vec::len);
    Ok(Row {
        zoom,
        view,
        bytes: body.len(),
        items,
        matched: v["matched"].as_u64().unwrap_or(0),
        max: times.iter().max().copied().unwrap_or_default(),
        median: median(times),
    })
}

async fn first_render(addr: SocketAddr, runs: usize) -> anyhow::Result<Vec<(f64, f64, u64)>> {
    let browser = webdriver::Browser::start(VIEW_W as u32, VIEW_H as u32).await?;
    browser.script_timeout(30_000).await?;
    let mut out = Vec::new();
    for _ in 0..runs {
        browser.goto(&format!("http://{addr}/")).await?;
        let v = browser
            .execute_async(
                "const done = arguments[arguments.length - 1];
                 window.__world.firstRender.then((ms) => done({
                   ms, markers: window.__world.markers.length,
                   bytes: window.__world.lastFetch ? window.__world.lastFetch.bytes : 0,
                   errors: window.__world.errors }));",
                json!([]),
            )
            .await?;
        anyhow::ensure!(
            v["errors"].as_array().is_none_or(|e| e.is_empty()),
            "page errors: {}",
            v["errors"]
        );
        out.push((
            v["ms"].as_f64().unwrap_or(f64::NAN),
            v["markers"].as_f64().unwrap_or(0.0),
            v["bytes"].as_u64().unwrap_or(0),
        ));
    }
    browser.close().await?;
    Ok(out)
}

fn arg(name: &str, default: usize) -> usize {
    let args: Vec<String> = std::env::args().collect();
    args.iter()
        .position(|a| a == name)
        .and_then(|i| args.get(i + 1))
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let nodes = arg("--nodes", 100_000);
    let runs = arg("--runs", 15).max(1);

    let started = std::time::Instant::now();
    let world = World::new();
    for n in world::synthetic::network(nodes, 42) {
        world.upsert_node(n).context("synthetic node")?;
    }
    let t = world.totals();
    println!(
        "World bench: {nodes} synthetic nodes loaded in {:.0} ms ({} online, {} on the map, {} pods)",
        started.elapsed().as_secs_f64() * 1e3,
        t.macs_online,
        t.macs_on_map,
        t.pods
    );

    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    tokio::spawn(async move { axum::serve(listener, world::router(world)).await });

    let mut rows = Vec::new();
    for zoom in 0..=cluster::MAX_ZOOM {
        rows.push(
            measure(
                addr,
                zoom,
                "europe 1280x800",
                &page_bbox(zoom, 10.0, 48.0),
                runs,
            )
            .await?,
        );
        rows.push(measure(addr, zoom, "whole world", "-180,-90,180,90", runs).await?);
    }
    println!();
    println!(
        "| zoom | view            | response bytes | items | nodes in view | median ms | max ms |"
    );
    println!(
        "|-----:|-----------------|---------------:|------:|--------------:|----------:|-------:|"
    );
    for r in &rows {
        println!(
            "| {:>4} | {:<15} | {:>14} | {:>5} | {:>13} | {:>9.2} | {:>6.2} |",
            r.zoom,
            r.view,
            r.bytes,
            r.items,
            r.matched,
            r.median.as_secs_f64() * 1e3,
            r.max.as_secs_f64() * 1e3
        );
    }
    let largest = rows.iter().map(|r| r.bytes).max().unwrap_or(0);
    println!(
        "largest response: {largest} bytes ({}; goal <= {GOAL_BYTES})",
        if largest <= GOAL_BYTES { "ok" } else { "OVER" }
    );

    println!();
    match first_render(addr, 5).await {
        Ok(renders) => {
            println!("| run | first render ms (from navigation start) | markers drawn | first map response bytes |");
            println!("|----:|----------------------------------------:|--------------:|-------------------------:|");
            for (i, (ms, markers, bytes)) in renders.iter().enumerate() {
                println!(
                    "| {:>3} | {:>39.0} | {:>13} | {:>24} |",
                    i + 1,
                    ms,
                    markers,
                    bytes
                );
            }
            let mut ms: Vec<f64> = renders.iter().map(|r| r.0).collect();
            ms.sort_by(f64::total_cmp);
            let med = ms[ms.len() / 2];
            println!(
                "first render in headless Chromium: median {med:.0} ms ({}; goal <= 1000)",
                if med <= 1000.0 { "ok" } else { "OVER" }
            );
        }
        Err(e) => println!("first render: skipped, {e:#}"),
    }
    Ok(())
}
