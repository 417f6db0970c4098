// The World page: every Mac on the network on a world map, live.
//
// Plain ES module, no build step, no third-party code. Draws on one canvas:
// the Natural Earth base map (decoded by topo.js), then the markers the
// coordinator clustered for the current view (/api/world/map), and keeps
// them live from the server-sent events at /api/world/events.
//
// Test and accessibility hooks (a canvas has no DOM per marker):
// - every drawn marker is also a button in #marker-list
//   (data-kind, data-node-id, data-status, data-count); the buttons select
//   exactly like a click on the canvas;
// - window.__world exposes {ready, live, firstRenderMs, markers, totals, view,
//   lastFetch, fetches} and zoomTo(lon, lat, zoom) / whenIdle().

import { features } from "./topo.js";

const TILE_PX = 512;        // world width in px at zoom 0 (as the server clusters)
const MAX_ZOOM = 7;         // server's highest zoom level
const MAX_VIEW_ZOOM = 9;    // the page may magnify beyond it
const FAMILY_COLOURS = {
  M1: [59, 130, 246], M2: [16, 185, 129], M3: [245, 158, 11],
  M4: [168, 85, 247], M5: [239, 68, 68], other: [148, 163, 184],
};
const TIER_SHADE = { base: 0.35, pro: 0.12, max: 0, ultra: -0.3 };
const STATUS_COLOURS = { serving: "#22c55e", idle: "#60a5fa", busy: "#f59e0b", offline: "#6b7280" };

const $ = (id) => document.getElementById(id);
const canvas = $("map");
const ctx = canvas.getContext("2d");

const state = {
  view: { lon: 10, lat: 20, zoom: 0 },
  size: { w: 0, h: 0, dpr: 1 },
  land: null,              // [{rings}] from the topology
  data: null,              // last MapView
  markers: [],             // drawn markers, with screen positions
  links: [],               // pod links in screen space
  totals: null,
  hover: null,
  selected: null,          // node id or null
  fetchSeq: 0,
  pendingFetch: null,
  inflight: 0,
  refetchTimer: null,
};

let resolveFirstRender;
const listeners = new Set();
const hooks = {
  ready: false, live: false, firstRenderMs: null, markers: [], totals: null,
  view: state.view, lastFetch: null, fetches: 0, errors: [],
  firstRender: new Promise((r) => { resolveFirstRender = r; }),
  zoomTo(lon, lat, zoom) { setView(lon, lat, zoom); return scheduleFetch(0); },
  whenIdle,
  // Calls fn() after every change of markers or totals; returns an unsubscribe.
  subscribe(fn) { listeners.add(fn); return () => listeners.delete(fn); },
};
function notify() { for (const fn of [...listeners]) { try { fn(); } catch (e) { hooks.errors.push(String(e)); } } }
window.__world = hooks;

// ---- projection (equirectangular) ----
function worldWidth(zoom = state.view.zoom) { return TILE_PX * 2 ** zoom; }
function project(lon, lat) {
  const W = worldWidth();
  const cx = ((state.view.lon + 180) / 360) * W;
  const cy = ((90 - state.view.lat) / 360) * W;
  return [((lon + 180) / 360) * W - cx + state.size.w / 2, ((90 - lat) / 360) * W - cy + state.size.h / 2];
}
function unproject(x, y) {
  const W = worldWidth();
  const cx = ((state.view.lon + 180) / 360) * W;
  const cy = ((90 - state.view.lat) / 360) * W;
  return [((x - state.size.w / 2 + cx) / W) * 360 - 180, 90 - ((y - state.size.h / 2 + cy) / W) * 360];
}
function minZoom() { return Math.max(0, Math.log2(Math.max(state.size.w, 1) / TILE_PX)); }
function setView(lon, lat, zoom) {
  const z = Math.min(MAX_VIEW_ZOOM, Math.max(minZoom(), zoom));
  const W = worldWidth(z);
  // Keep the world on screen: the visible half-extent in degrees.
  const halfLon = (state.size.w / 2 / W) * 360;
  const halfLat = (state.size.h / 2 / W) * 360;
  const clamp = (v, lo, hi) => (lo > hi ? (lo + hi) / 2 : Math.min(hi, Math.max(lo, v)));
  state.view.zoom = z;
  state.view.lon = clamp(lon, -180 + halfLon, 180 - halfLon);
  state.view.lat = clamp(lat, -90 + halfLat, 90 - halfLat);
  layout();
  requestDraw();
}

// ---- data ----
function filterParams() {
  const form = $("filters");
  const p = new URLSearchParams();
  for (const name of ["family", "tier", "status"]) {
    const boxes = [...form.querySelectorAll(`input[name=${name}]`)];
    const on = boxes.filter((b) => b.checked).map((b) => b.value);
    if (on.length < boxes.length) p.set(name, on.length ? on.join(",") : "none");
  }
  for (const name of ["min_mem_gb", "max_mem_gb"]) {
    const v = form.elements[name].value;
    if (v) p.set(name, v);
  }
  return p;
}

function viewQuery() {
  const p = filterParams();
  const z = Math.max(0, Math.min(MAX_ZOOM, Math.round(state.view.zoom)));
  const [w, n] = unproject(-state.size.w * 0.25, -state.size.h * 0.25);
  const [e, s] = unproject(state.size.w * 1.25, state.size.h * 1.25);
  const r = (v) => v.toFixed(3);
  p.set("z", String(z));
  p.set("bbox", [r(Math.max(-180, w)), r(Math.max(-90, s)), r(Math.min(180, e)), r(Math.min(90, n))].join(","));
  return p;
}

let idleWaiters = [];
function whenIdle() {
  if (state.inflight === 0 && !state.pendingFetch && state.data) return Promise.resolve(true);
  return new Promise((resolve) => idleWaiters.push(resolve));
}
function settle() {
  if (state.inflight === 0 && !state.pendingFetch) {
    const w = idleWaiters; idleWaiters = [];
    w.forEach((f) => f(true));
  }
}

// Debounced: the latest call wins, and every caller's promise resolves when
// the fetch that finally runs has ended.
let fetchWaiters = [];
function scheduleFetch(delay = 120) {
  clearTimeout(state.pendingFetch);
  const done = new Promise((resolve) => fetchWaiters.push(resolve));
  state.pendingFetch = setTimeout(() => {
    state.pendingFetch = null;
    const waiters = fetchWaiters;
    fetchWaiters = [];
    fetchView().then(() => waiters.forEach((f) => f(true)));
  }, delay);
  return done;
}

async function fetchView() {
  const params = filterParams();
  // A filter that excludes everything ("none") needs no request.
  if ([...params.values()].includes("none")) {
    state.data = { zoom: 0, clusters: [], nodes: [], pods: [], matched: 0 };
    layout(); requestDraw(); settle();
    return;
  }
  const seq = ++state.fetchSeq;
  const url = `/api/world/map?${viewQuery()}`;
  const t0 = performance.now();
  state.inflight++;
  try {
    const res = await fetch(url, { cache: "no-store" });
    const text = await res.text();
    if (!res.ok) throw new Error(`${res.status}: ${text}`);
    const data = JSON.parse(text);
    hooks.fetches++;
    hooks.lastFetch = { url, bytes: text.length, ms: performance.now() - t0, zoom: data.zoom };
    if (seq !== state.fetchSeq) return; // a newer view was asked for meanwhile
    state.data = data;
    layout();
    requestDraw();
  } catch (err) {
    hooks.errors.push(String(err));
    $("status-line").textContent = "Could not load the map data; retrying.";
    state.refetchTimer = setTimeout(() => scheduleFetch(0), 2000);
  } finally {
    state.inflight--;
    settle();
  }
}

async function loadBaseMap() {
  const res = await fetch("/world/countries-110m.json");
  if (!res.ok) throw new Error(`base map: HTTP ${res.status}`);
  state.land = features(await res.json(), "countries");
  requestDraw();
}

// ---- layout: markers in screen space ----
function radiusFor(memoryBytes) {
  const gb = Math.max(8, memoryBytes / 2 ** 30);
  return 4 + 2.2 * Math.log2(gb / 8);
}
function clusterRadius(count) { return 11 + 4 * Math.log10(Math.max(1, count)); }

function layout() {
  const markers = [];
  const links = [];
  const d = state.data;
  if (!d) { state.markers = markers; state.links = links; return; }
  for (const c of d.clusters) {
    const [x, y] = project(c.lon, c.lat);
    markers.push({ kind: "cluster", x, y, r: clusterRadius(c.count), c, id: `cluster:${c.lat},${c.lon}` });
  }
  // Nodes sharing one grid point are fanned out around it.
  const byPoint = new Map();
  for (const n of d.nodes) {
    const key = `${n.lat},${n.lon}`;
    if (!byPoint.has(key)) byPoint.set(key, []);
    byPoint.get(key).push(n);
  }
  const at = new Map();
  for (const group of byPoint.values()) {
    const [x0, y0] = project(group[0].lon, group[0].lat);
    // Pod members next to each other on the ring.
    group.sort((a, b) => (a.pod || "").localeCompare(b.pod || "") || a.id.localeCompare(b.id));
    const spread = group.length > 1 ? 12 + 3 * group.length : 0;
    group.forEach((n, i) => {
      const a = (2 * Math.PI * i) / group.length - Math.PI / 2;
      const x = x0 + spread * Math.cos(a), y = y0 + spread * Math.sin(a);
      const m = { kind: "node", x, y, r: radiusFor(n.memory_bytes), n, id: n.id, anchor: [x0, y0] };
      markers.push(m);
      at.set(n.id, m);
    });
  }
  for (const pod of d.pods || []) {
    const pts = pod.members.map((id) => at.get(id)).filter(Boolean);
    if (pts.length > 1) links.push({ pod: pod.pod_id, pts });
  }
  state.markers = markers;
  state.links = links;
  publishMarkers();
}

function publishMarkers() {
  const rect = canvas.getBoundingClientRect();
  const onScreen = (m) => m.x >= -m.r && m.y >= -m.r && m.x <= state.size.w + m.r && m.y <= state.size.h + m.r;
  hooks.markers = state.markers.filter(onScreen).map((m) => m.kind === "node"
    ? { kind: "node", id: m.n.id, name: m.n.name, status: m.n.status, family: m.n.family, tier: m.n.tier,
        memory_bytes: m.n.memory_bytes, lat: m.n.lat, lon: m.n.lon, pod: m.n.pod || null,
        x: rect.left + m.x, y: rect.top + m.y, r: m.r }
    : { kind: "cluster", id: m.id, count: m.c.count, online: m.c.online, family: m.c.family,
        lat: m.c.lat, lon: m.c.lon, x: rect.left + m.x, y: rect.top + m.y, r: m.r });
  renderMarkerList();
  notify();
}

function renderMarkerList() {
  const list = $("marker-list");
  const frag = document.createDocumentFragment();
  for (const m of hooks.markers) {
    const li = document.createElement("li");
    const b = document.createElement("button");
    b.type = "button";
    b.dataset.kind = m.kind;
    if (m.kind === "node") {
      b.dataset.nodeId = m.id;
      b.dataset.status = m.status;
      b.dataset.family = m.family;
      b.textContent = `${m.name}: ${m.family === "other" ? "" : m.family + " "}${m.tier}, ${gb(m.memory_bytes)}, ${m.status}`;
    } else {
      b.dataset.count = String(m.count);
      b.textContent = `Group of ${m.count} Macs (${m.online} online)`;
    }
    b.addEventListener("click", () => activate(m.kind === "node" ? findMarker(m.id) : state.markers.find((x) => x.id === m.id)));
    li.appendChild(b);
    frag.appendChild(li);
  }
  list.replaceChildren(frag);
}

function findMarker(nodeId) { return state.markers.find((m) => m.kind === "node" && m.n.id === nodeId); }

// ---- drawing ----
let drawQueued = false;
function requestDraw() {
  if (drawQueued) return;
  drawQueued = true;
  requestAnimationFrame(() => { drawQueued = false; draw(); });
}

function rgb(c, a = 1) { return `rgba(${c[0]},${c[1]},${c[2]},${a})`; }
function shade(c, k) {
  return k >= 0 ? c.map((v) => Math.round(v + (255 - v) * k)) : c.map((v) => Math.round(v * (1 + k)));
}
function colourOf(family, tier = "max") { return shade(FAMILY_COLOURS[family] || FAMILY_COLOURS.other, TIER_SHADE[tier] ?? 0); }

function drawBase() {
  const { w, h } = state.size;
  ctx.fillStyle = "#0b1220";
  ctx.fillRect(0, 0, w, h);
  // Graticule every 30 degrees.
  ctx.strokeStyle = "rgba(148,163,184,0.08)";
  ctx.lineWidth = 1;
  ctx.beginPath();
  for (let lon = -180; lon <= 180; lon += 30) { const [x] = project(lon, 0); ctx.moveTo(x, project(0, 90)[1]); ctx.lineTo(x, project(0, -90)[1]); }
  for (let lat = -60; lat <= 60; lat += 30) { const [, y] = project(0, lat); ctx.moveTo(project(-180, 0)[0], y); ctx.lineTo(project(180, 0)[0], y); }
  ctx.stroke();
  if (!state.land) return;
  const W = worldWidth();
  const k = W / 360;
  const [ox, oy] = project(-180, 90);
  ctx.save();
  // Rings that cross the antimeridian are drawn twice, clipped to the world.
  ctx.beginPath();
  ctx.rect(ox, oy, W, W / 2);
  ctx.clip();
  ctx.beginPath();
  const trace = (r, shift) => {
    for (let i = 0; i < r.length; i += 2) {
      const x = ox + (r[i] + shift + 180) * k, y = oy + (90 - r[i + 1]) * k;
      if (i === 0) ctx.moveTo(x, y); else ctx.lineTo(x, y);
    }
    ctx.closePath();
  };
  for (const f of state.land) {
    for (const r of f.rings) {
      trace(r, 0);
      if (r.wrap) trace(r, r.wrap);
    }
  }
  ctx.fillStyle = "#1e293b";
  ctx.fill();
  ctx.strokeStyle = "rgba(148,163,184,0.35)";
  ctx.lineWidth = 0.6;
  ctx.stroke();
  ctx.restore();
}

function drawMarkers(now) {
  // Pod links under the markers.
  for (const l of state.links) {
    ctx.strokeStyle = "rgba(226,232,240,0.75)";
    ctx.lineWidth = 2;
    ctx.setLineDash([]);
    ctx.beginPath();
    l.pts.forEach((m, i) => (i ? ctx.lineTo(m.x, m.y) : ctx.moveTo(m.x, m.y)));
    if (l.pts.length > 2) ctx.closePath();
    ctx.stroke();
  }
  for (const m of state.markers) {
    if (m.kind === "cluster") {
      const c = m.c;
      const col = colourOf(c.family);
      ctx.beginPath();
      ctx.arc(m.x, m.y, m.r + 4, 0, 2 * Math.PI);
      ctx.fillStyle = rgb(col, 0.25);
      ctx.fill();
      ctx.beginPath();
      ctx.arc(m.x, m.y, m.r, 0, 2 * Math.PI);
      ctx.fillStyle = rgb(col, c.online ? 0.9 : 0.35);
      ctx.fill();
      ctx.fillStyle = "#0b1220";
      ctx.font = `600 ${m.r > 14 ? 12 : 11}px system-ui, sans-serif`;
      ctx.textAlign = "center";
      ctx.textBaseline = "middle";
      ctx.fillText(compact(c.count), m.x, m.y + 0.5);
      continue;
    }
    const n = m.n;
    if (m.anchor && (m.anchor[0] !== m.x || m.anchor[1] !== m.y)) {
      ctx.strokeStyle = "rgba(148,163,184,0.35)";
      ctx.lineWidth = 1;
      ctx.beginPath(); ctx.moveTo(m.anchor[0], m.anchor[1]); ctx.lineTo(m.x, m.y); ctx.stroke();
    }
    const col = colourOf(n.family, n.tier);
    if (n.status === "serving") {
      const t = (now / 1400) % 1;
      ctx.beginPath();
      ctx.arc(m.x, m.y, m.r + 2 + 8 * t, 0, 2 * Math.PI);
      ctx.strokeStyle = rgb(col, 0.6 * (1 - t));
      ctx.lineWidth = 2;
      ctx.stroke();
    }
    ctx.beginPath();
    ctx.arc(m.x, m.y, m.r, 0, 2 * Math.PI);
    if (n.status === "offline") {
      ctx.fillStyle = "rgba(107,114,128,0.55)";
      ctx.fill();
      ctx.setLineDash([3, 2]);
      ctx.strokeStyle = rgb(col, 0.8);
      ctx.lineWidth = 1.5;
      ctx.stroke();
      ctx.setLineDash([]);
    } else {
      ctx.fillStyle = rgb(col);
      ctx.fill();
      ctx.strokeStyle = n.status === "busy" ? STATUS_COLOURS.busy : "rgba(11,18,32,0.9)";
      ctx.lineWidth = n.status === "busy" ? 2.5 : 1;
      ctx.stroke();
    }
    if (n.tier === "ultra") {
      ctx.beginPath();
      ctx.arc(m.x, m.y, m.r + 2.5, 0, 2 * Math.PI);
      ctx.strokeStyle = rgb(col, 0.9);
      ctx.lineWidth = 1;
      ctx.stroke();
    }
    if (state.selected === n.id || state.hover === m) {
      ctx.beginPath();
      ctx.arc(m.x, m.y, m.r + 5, 0, 2 * Math.PI);
      ctx.strokeStyle = "#f8fafc";
      ctx.lineWidth = 2;
      ctx.stroke();
    }
  }
}

function draw() {
  const now = performance.now();
  const { dpr } = state.size;
  ctx.setTransform(dpr, 0, 0, dpr, 0, 0);
  drawBase();
  drawMarkers(now);
  if (state.data && state.land && hooks.firstRenderMs === null) {
    hooks.firstRenderMs = now;
    hooks.ready = true;
    document.body.dataset.ready = "true";
    resolveFirstRender(now);
  }
  // Keep serving halos moving, but only while some are on screen.
  if (state.markers.some((m) => m.kind === "node" && m.n.status === "serving")) setTimeout(requestDraw, 80);
}

// ---- formatting ----
function gb(bytes) { return `${Math.round(bytes / 2 ** 30)} GB`; }
function compact(n) { return n >= 1e6 ? `${(n / 1e6).toFixed(1)}M` : n >= 1e4 ? `${Math.round(n / 1e3)}k` : n >= 1e3 ? `${(n / 1e3).toFixed(1)}k` : String(n); }
function memory(bytes) {
  const tb = bytes / 2 ** 40;
  return tb >= 1 ? `${tb.toFixed(tb >= 100 ? 0 : 1)} TB` : `${Math.round(bytes / 2 ** 30)} GB`;
}
function duration(ms) {
  const s = Math.max(0, Math.floor(ms / 1000));
  const d = Math.floor(s / 86400), h = Math.floor((s % 86400) / 3600), m = Math.floor((s % 3600) / 60);
  return d ? `${d}d ${h}h` : h ? `${h}h ${m}m` : m ? `${m}m` : `${s}s`;
}
function esc(s) { return String(s).replace(/[&<>"']/g, (c) => `&#${c.charCodeAt(0)};`); }

// ---- totals ----
function setTotals(t) {
  state.totals = t;
  hooks.totals = t;
  const set = (id, raw, text) => { const el = $(id); el.dataset.value = String(raw); el.textContent = text; };
  set("total-online", t.macs_online, compact(t.macs_online));
  set("total-pods", t.pods, compact(t.pods));
  set("total-memory", t.memory_online_bytes, memory(t.memory_online_bytes));
  set("total-tps", t.tokens_per_s, t.tokens_per_s >= 100 ? compact(Math.round(t.tokens_per_s)) : t.tokens_per_s.toFixed(1));
  set("total-jobs", t.jobs_today, compact(t.jobs_today));
  const tpj = t.tokens_per_joule;
  set("total-tpj", tpj ?? "", tpj == null ? "–" : tpj >= 100 ? compact(Math.round(tpj)) : tpj.toFixed(tpj >= 10 ? 1 : 2));
  notify();
}

// ---- card and tooltip ----
async function showCard(nodeId) {
  state.selected = nodeId;
  requestDraw();
  const card = $("node-card");
  const body = $("card-body");
  card.hidden = false;
  card.dataset.nodeId = nodeId;
  card.dataset.loaded = "false";
  const m = findMarker(nodeId);
  if (m) body.innerHTML = cardHtml({ ...m.n, place: "", jobs_served: null });
  try {
    const res = await fetch(`/api/world/nodes/${encodeURIComponent(nodeId)}`, { cache: "no-store" });
    if (!res.ok) throw new Error(`HTTP ${res.status}`);
    const c = await res.json();
    if (state.selected !== nodeId) return;
    body.innerHTML = cardHtml(c);
    card.dataset.status = c.status;
    card.dataset.loaded = "true";
  } catch (err) {
    if (state.selected === nodeId) body.insertAdjacentHTML("beforeend", `<p class="err">Details unavailable (${esc(err.message)}).</p>`);
  }
}

function cardHtml(c) {
  const fam = c.family === "other" ? "" : `<span class="sw" data-family="${esc(c.family)}"></span>`;
  const rows = [
    ["Chip", esc(c.chip || "unknown")],
    ["Memory", gb(c.memory_bytes)],
    ["Status", `<span class="st" data-status="${esc(c.status)}"></span><span class="card-status">${esc(c.status)}</span>`],
  ];
  if (c.place) rows.push(["Where", esc(c.place)]);
  if (c.jobs_served !== null && c.jobs_served !== undefined) {
    rows.push(["Jobs served", compact(c.jobs_served)], ["Tokens produced", compact(c.tokens_produced)]);
    rows.push(["Uptime", c.online_since_ms ? duration(Date.now() - c.online_since_ms) : "offline"]);
  }
  let pod = "";
  if (c.pod && typeof c.pod === "object") {
    const members = c.pod.members.map((m) => `<li data-node-id="${esc(m.id)}">${esc(m.name)} · ${esc(m.status)}</li>`).join("");
    const more = c.pod.hidden_members ? `<li>+${c.pod.hidden_members} not on the map</li>` : "";
    pod = `<h3>Pod ${esc(c.pod.pod_id)}</h3><ul class="pod">${members}${more}</ul>`;
  }
  return `<h2>${fam}<span class="card-name">${esc(c.name || c.id.slice(0, 12))}</span></h2>
    <dl>${rows.map(([k, v]) => `<dt>${k}</dt><dd>${v}</dd>`).join("")}</dl>${pod}
    <p class="fine mono">${esc(c.id.slice(0, 16))}…</p>`;
}

function closeCard() {
  state.selected = null;
  $("node-card").hidden = true;
  requestDraw();
}

function showTooltip(m, x, y) {
  const tip = $("tooltip");
  if (!m) { tip.hidden = true; return; }
  tip.innerHTML = m.kind === "node"
    ? `<strong>${esc(m.n.name)}</strong><br>${esc(m.n.chip)} · ${gb(m.n.memory_bytes)}<br>${esc(m.n.status)}`
    : `<strong>${m.c.count.toLocaleString()} Macs</strong><br>${m.c.online.toLocaleString()} online · ${memory(m.c.memory_bytes)}<br>click to zoom in`;
  tip.dataset.kind = m.kind;
  tip.dataset.nodeId = m.kind === "node" ? m.n.id : "";
  tip.hidden = false;
  const pad = 14;
  const tw = tip.offsetWidth, th = tip.offsetHeight;
  tip.style.left = `${Math.min(state.size.w - tw - 4, x + pad)}px`;
  tip.style.top = `${Math.max(4, y - th - pad)}px`;
}

function activate(m) {
  if (!m) return;
  if (m.kind === "node") { showCard(m.n.id); return; }
  // A cluster: zoom in on it (at the last zoom, its breakdown instead).
  if (Math.round(state.view.zoom) >= MAX_ZOOM) {
    state.selected = null;
    const c = m.c;
    const fams = ["M1", "M2", "M3", "M4", "M5", "other"].map((f, i) => [f, c.by_family[i]]).filter(([, n]) => n);
    $("card-body").innerHTML = `<h2>${c.count.toLocaleString()} Macs here</h2><dl>
      <dt>Online</dt><dd>${c.online.toLocaleString()}</dd><dt>Memory online</dt><dd>${memory(c.memory_bytes)}</dd>
      <dt>Chips</dt><dd>${fams.map(([f, n]) => `${f} ${n}`).join(", ")}</dd></dl>`;
    $("node-card").hidden = false;
    $("node-card").dataset.nodeId = "";
    return;
  }
  const [lon, lat] = unproject(m.x, m.y);
  setView(lon, lat, Math.floor(state.view.zoom) + 2);
  scheduleFetch(0);
}

function hit(x, y) {
  let best = null, bestD = Infinity;
  for (const m of state.markers) {
    const d = Math.hypot(m.x - x, m.y - y);
    const reach = m.r + (matchMedia("(pointer: coarse)").matches ? 10 : 4);
    if (d <= reach && d < bestD) { best = m; bestD = d; }
  }
  return best;
}

// ---- input: drag, wheel, pinch, click, hover ----
const pointers = new Map();
let drag = null;
function local(e) { const r = canvas.getBoundingClientRect(); return [e.clientX - r.left, e.clientY - r.top]; }

canvas.addEventListener("pointerdown", (e) => {
  canvas.setPointerCapture(e.pointerId);
  pointers.set(e.pointerId, local(e));
  const [x, y] = local(e);
  drag = { x, y, lon: state.view.lon, lat: state.view.lat, moved: false, pinch: null };
  if (pointers.size === 2) {
    const [a, b] = [...pointers.values()];
    drag.pinch = { d: Math.hypot(a[0] - b[0], a[1] - b[1]), zoom: state.view.zoom, mid: [(a[0] + b[0]) / 2, (a[1] + b[1]) / 2] };
  }
});
canvas.addEventListener("pointermove", (e) => {
  const [x, y] = local(e);
  if (pointers.has(e.pointerId)) pointers.set(e.pointerId, [x, y]);
  if (drag && pointers.size >= 1) {
    if (drag.pinch && pointers.size === 2) {
      const [a, b] = [...pointers.values()];
      const d = Math.hypot(a[0] - b[0], a[1] - b[1]);
      zoomAround(drag.pinch.mid[0], drag.pinch.mid[1], drag.pinch.zoom + Math.log2(d / drag.pinch.d));
      drag.moved = true;
      return;
    }
    const dx = x - drag.x, dy = y - drag.y;
    if (Math.abs(dx) + Math.abs(dy) > 4) drag.moved = true;
    if (drag.moved) {
      const k = 360 / worldWidth();
      setView(drag.lon - dx * k, drag.lat + dy * k, state.view.zoom);
      scheduleFetch();
      showTooltip(null);
      return;
    }
  }
  if (e.pointerType === "mouse") {
    const m = hit(x, y);
    if (m !== state.hover) { state.hover = m; requestDraw(); }
    canvas.style.cursor = m ? "pointer" : "grab";
    showTooltip(m, x, y);
  }
});
function endPointer(e) {
  pointers.delete(e.pointerId);
  if (drag && !drag.moved && e.type === "pointerup") {
    const [x, y] = local(e);
    const m = hit(x, y);
    if (m) activate(m); else if (!$("node-card").hidden) closeCard();
  }
  if (pointers.size === 0) drag = null;
}
canvas.addEventListener("pointerup", endPointer);
canvas.addEventListener("pointercancel", endPointer);
canvas.addEventListener("pointerleave", () => { state.hover = null; showTooltip(null); requestDraw(); });

function zoomAround(x, y, zoom) {
  const [lon, lat] = unproject(x, y);
  const z = Math.min(MAX_VIEW_ZOOM, Math.max(minZoom(), zoom));
  // Keep (lon, lat) under the cursor.
  const W = worldWidth(z);
  const k = 360 / W;
  setView(lon - (x - state.size.w / 2) * k, lat + (y - state.size.h / 2) * k, z);
  scheduleFetch();
}
canvas.addEventListener("wheel", (e) => {
  e.preventDefault();
  const [x, y] = local(e);
  zoomAround(x, y, state.view.zoom - e.deltaY * (e.deltaMode === 1 ? 0.05 : 0.002));
}, { passive: false });

$("zoom-in").addEventListener("click", () => { zoomAround(state.size.w / 2, state.size.h / 2, state.view.zoom + 1); });
$("zoom-out").addEventListener("click", () => { zoomAround(state.size.w / 2, state.size.h / 2, state.view.zoom - 1); });
$("zoom-reset").addEventListener("click", () => { setView(10, 20, 0); scheduleFetch(0); });
$("card-close").addEventListener("click", closeCard);
document.addEventListener("keydown", (e) => { if (e.key === "Escape") closeCard(); });
$("filters").addEventListener("change", () => scheduleFetch(0));
$("panel-toggle").addEventListener("click", () => {
  const open = document.body.classList.toggle("panel-open");
  $("panel-toggle").setAttribute("aria-expanded", String(open));
});

// ---- size ----
function resize() {
  const r = canvas.getBoundingClientRect();
  const dpr = Math.min(2, window.devicePixelRatio || 1);
  state.size = { w: r.width, h: r.height, dpr };
  canvas.width = Math.round(r.width * dpr);
  canvas.height = Math.round(r.height * dpr);
  setView(state.view.lon, state.view.lat, state.view.zoom);
}
new ResizeObserver(() => { resize(); scheduleFetch(); }).observe(canvas);

// ---- live ----
function connectLive() {
  const live = $("live");
  const es = new EventSource("/api/world/events");
  const setLive = (s) => { live.dataset.state = s; live.textContent = s; hooks.live = s === "live"; };
  es.addEventListener("hello", (e) => { setLive("live"); setTotals(JSON.parse(e.data)); scheduleFetch(0); });
  es.addEventListener("totals", (e) => setTotals(JSON.parse(e.data)));
  es.addEventListener("resync", (e) => { setTotals(JSON.parse(e.data)); scheduleFetch(0); });
  es.addEventListener("changes", (e) => {
    const b = JSON.parse(e.data);
    setTotals(b.totals);
    hooks.lastChange = { at: performance.now(), nodes: b.nodes.length, gone: b.gone.length };
    // Patch drawn markers at once; clusters catch up with the refetch.
    let patched = false;
    for (const n of b.nodes) {
      const m = findMarker(n.id);
      if (m) { Object.assign(m.n, n); patched = true; }
    }
    if (patched) { publishMarkers(); requestDraw(); }
    const card = $("node-card");
    if (!card.hidden && state.selected && (b.nodes.some((n) => n.id === state.selected) || b.gone.includes(state.selected))) {
      showCard(state.selected);
    }
    clearTimeout(state.refetchTimer);
    state.refetchTimer = setTimeout(() => scheduleFetch(0), 600);
  });
  es.onerror = () => setLive(es.readyState === EventSource.CLOSED ? "offline" : "reconnecting");
}

// ---- start ----
function start() {
  resize();
  fetch("/api/world/totals", { cache: "no-store" }).then((r) => r.json()).then(setTotals).catch(() => {});
  loadBaseMap().catch((err) => { hooks.errors.push(String(err)); });
  scheduleFetch(0);
  connectLive();
}
start();
