// TopoJSON decoding for the World page's base map (no dependencies).
//
// Reads a quantized, unprojected TopoJSON topology (as world-atlas ships
// Natural Earth) into plain rings of [lon, lat] stored as Float64Arrays
// (lon0, lat0, lon1, lat1, ...), ready to project and draw.
// See https://github.com/topojson/topojson-specification.

/** Decodes every arc of `topology` into absolute longitude/latitude pairs. */
function decodeArcs(topology) {
  const t = topology.transform;
  const sx = t ? t.scale[0] : 1, sy = t ? t.scale[1] : 1;
  const tx = t ? t.translate[0] : 0, ty = t ? t.translate[1] : 0;
  return topology.arcs.map((arc) => {
    const out = new Float64Array(arc.length * 2);
    let x = 0, y = 0;
    for (let i = 0; i < arc.length; i++) {
      if (t) { x += arc[i][0]; y += arc[i][1]; } else { x = arc[i][0]; y = arc[i][1]; }
      out[2 * i] = x * sx + tx;
      out[2 * i + 1] = y * sy + ty;
    }
    return out;
  });
}

/** Joins arc indices (negative = reversed arc ~i) into one closed ring. */
function ring(arcs, indices) {
  const parts = [];
  let n = 0;
  for (const idx of indices) {
    const arc = arcs[idx < 0 ? ~idx : idx];
    parts.push([arc, idx < 0]);
    n += arc.length / 2;
  }
  const out = new Float64Array(n * 2);
  let k = 0;
  parts.forEach(([arc, reversed], p) => {
    const m = arc.length / 2;
    for (let i = 0; i < m; i++) {
      if (p > 0 && i === 0) continue; // shared with the previous arc's end
      const j = reversed ? m - 1 - i : i;
      out[k++] = arc[2 * j];
      out[k++] = arc[2 * j + 1];
    }
  });
  return unwrap(out.subarray(0, k));
}

/**
 * A ring that crosses the antimeridian (Russia, Fiji) jumps by ~360 degrees
 * twice; make its longitudes continuous and note, in `wrap`, the shift of the
 * copy that fills the other edge of the map (0 when none is needed).
 */
function unwrap(r) {
  let jumps = 0;
  for (let i = 2; i < r.length; i += 2) if (Math.abs(r[i] - r[i - 2]) > 180) jumps++;
  r.wrap = 0;
  if (jumps === 0 || jumps % 2 !== 0) return r; // Antarctica's edge: leave as is
  let offset = 0, min = Infinity, max = -Infinity;
  for (let i = 0; i < r.length; i += 2) {
    if (i > 0) {
      const d = r[i] + offset - r[i - 2];
      if (d > 180) offset -= 360; else if (d < -180) offset += 360;
    }
    r[i] += offset;
    min = Math.min(min, r[i]); max = Math.max(max, r[i]);
  }
  r.wrap = max > 180 ? -360 : min < -180 ? 360 : 0;
  return r;
}

/**
 * Polygons of one object of `topology` (e.g. "countries" or "land"):
 * [{id, name, rings: [Float64Array]}].
 */
export function features(topology, objectName) {
  const arcs = decodeArcs(topology);
  const obj = topology.objects[objectName];
  if (!obj) throw new Error(`topology has no object ${objectName}`);
  const geoms = obj.type === "GeometryCollection" ? obj.geometries : [obj];
  const out = [];
  for (const g of geoms) {
    const rings = [];
    if (g.type === "Polygon") {
      for (const r of g.arcs) rings.push(ring(arcs, r));
    } else if (g.type === "MultiPolygon") {
      for (const poly of g.arcs) for (const r of poly) rings.push(ring(arcs, r));
    } else {
      continue; // points and lines are not part of a base map
    }
    out.push({ id: g.id ?? null, name: g.properties?.name ?? "", rings });
  }
  return out;
}
