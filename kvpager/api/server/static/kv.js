// The /kv page: draws the KV map (docs/kv-map.md) from /v1/kv/stream. Plain JS, canvas and SVG.
"use strict";
(() => {
  const $ = (id) => document.getElementById(id);
  const WINDOW_S = 300; // charts show the last five minutes
  const params = new URLSearchParams(location.search);
  const interval = Math.min(10, Math.max(0.25, Number(params.get("interval")) || 1));
  const view = { doc: null, history: [], grid: null, rows: [], updates: 0 };
  window.kvView = view; // read by the browser test and handy in the console

  const css = (name) => getComputedStyle(document.documentElement).getPropertyValue(name).trim();
  const STATE_NAMES = { ".": "free", c: "cached", o: "owned", p: "pinned" };
  // One block of the document's columns (docs/kv-map.md) as an object.
  function block(id) {
    const B = view.doc.blocks;
    const k = String(id);
    return {
      id, state: STATE_NAMES[B.state[id]], ref: B.ref[k] || 0, hash: B.hash[k], owners: B.owners[k],
      pins: B.pins[k], text: B.text[k], tiers: B.tiers[k],
    };
  }
  view.block = block;
  const isShared = (b) => b.state === "owned" && b.ref >= 2;
  const colorOf = (b) => css("--" + (isShared(b) ? "shared" : b.state));
  view.colorOf = colorOf;

  function fmtBytes(n) {
    if (n === null || n === undefined) return "–";
    const units = ["B", "KiB", "MiB", "GiB", "TiB"];
    let i = 0;
    while (Math.abs(n) >= 1024 && i < units.length - 1) { n /= 1024; i++; }
    return (i ? n.toFixed(1) : String(Math.round(n))) + " " + units[i];
  }
  const pct = (x) => (x === null || x === undefined ? "–" : (100 * x).toFixed(1) + "%");

  function setStatus(kind, text) {
    const el = $("status");
    el.className = "status " + kind;
    el.textContent = text;
  }

  // ---- block cells ------------------------------------------------------------------------
  function cellSize(n) {
    return n <= 1024 ? 14 : n <= 4096 ? 10 : n <= 16384 ? 6 : n <= 65536 ? 4 : 2;
  }

  function drawCells(canvas, ids, size, width) {
    const doc = view.doc;
    const cols = Math.max(1, Math.floor(width / size));
    const rows = Math.max(1, Math.ceil(ids.length / cols));
    const dpr = window.devicePixelRatio || 1;
    canvas.style.width = Math.min(ids.length, cols) * size + "px";
    canvas.style.height = rows * size + "px";
    canvas.width = Math.max(1, Math.min(ids.length, cols) * size * dpr);
    canvas.height = rows * size * dpr;
    const ctx = canvas.getContext("2d");
    ctx.setTransform(dpr, 0, 0, dpr, 0, 0);
    const gap = size >= 6 ? 1 : 0;
    const numCached = doc.evict_order.length || 1;
    const lru = view.lruRank;
    ctx.font = `${Math.floor(size * 0.7)}px ui-monospace, monospace`;
    ctx.textAlign = "center";
    ctx.textBaseline = "middle";
    ids.forEach((id, i) => {
      const b = block(id);
      const x = (i % cols) * size;
      const y = Math.floor(i / cols) * size;
      // cached blocks: the next ones to be evicted (head of the LRU queue) are drawn faintest
      ctx.globalAlpha = b.state === "cached" ? 0.35 + 0.65 * ((lru[id] || 0) / numCached) : 1;
      ctx.fillStyle = colorOf(b);
      ctx.fillRect(x, y, size - gap, size - gap);
      if (size >= 14 && b.ref >= 2) {
        ctx.globalAlpha = 1;
        ctx.fillStyle = css("--bg");
        ctx.fillText(b.ref > 9 ? "+" : String(b.ref), x + (size - gap) / 2, y + (size - gap) / 2 + 0.5);
      }
    });
    ctx.globalAlpha = 1;
    return { canvas, ids, size, cols };
  }

  function cellCenter(layout, index) {
    const rect = layout.canvas.getBoundingClientRect();
    return {
      x: (index % layout.cols) * layout.size + (layout.size - 1) / 2,
      y: Math.floor(index / layout.cols) * layout.size + (layout.size - 1) / 2,
      left: rect.left, top: rect.top,
    };
  }
  view.cellCenter = (blockId) => cellCenter(view.grid, blockId);

  function blockAt(layout, event) {
    const rect = layout.canvas.getBoundingClientRect();
    const col = Math.floor((event.clientX - rect.left) / layout.size);
    const row = Math.floor((event.clientY - rect.top) / layout.size);
    if (col < 0 || col >= layout.cols || row < 0) return null;
    const index = row * layout.cols + col;
    return index < layout.ids.length ? layout.ids[index] : null;
  }

  // ---- hover details ----------------------------------------------------------------------
  function showTip(event, layout) {
    const tip = $("tip");
    const id = layout ? blockAt(layout, event) : null;
    if (id === null || !view.doc) { tip.hidden = true; return; }
    const b = block(id);
    tip.replaceChildren();
    const line = (label, value, cls) => {
      const div = document.createElement("div");
      if (label) { const s = document.createElement("b"); s.textContent = label + " "; div.append(s); }
      const v = document.createElement(cls === "text" ? "span" : "code");
      if (cls) v.className = cls;
      v.textContent = value;
      div.append(v);
      tip.append(div);
    };
    line("block", `${id} · ${isShared(b) ? "shared" : b.state} · ref ${b.ref}` + (b.pins ? ` · ${b.pins} pin(s)` : ""));
    if (b.hash) line("hash", b.hash + "…");
    if (b.state === "cached") line("evicted", `${view.lruRank[id] + 1} of ${view.doc.evict_order.length} in line`);
    if (b.owners) line("owners", b.owners.join(", "));
    line("tiers", ["device", ...(b.tiers || [])].join(", "));
    if (b.text !== undefined) line("", b.text, "text");
    tip.hidden = false;
    const x = Math.min(event.clientX + 12, window.innerWidth - tip.offsetWidth - 4);
    const y = event.clientY + 16 + tip.offsetHeight > window.innerHeight ? event.clientY - tip.offsetHeight - 8 : event.clientY + 16;
    tip.style.left = Math.max(4, x) + "px";
    tip.style.top = Math.max(4, y) + "px";
  }

  // ---- charts -----------------------------------------------------------------------------
  const SERIES_COLORS = { device: "--c1", host: "--c2", disk: "--c3", remote: "--c4" };

  function rate(points, pick) {
    const out = [];
    for (let i = 1; i < points.length; i++) {
      const dt = points[i].t - points[i - 1].t;
      const a = pick(points[i - 1]);
      const b = pick(points[i]);
      if (dt > 0 && a !== undefined && b !== undefined) out.push([points[i].t, Math.max(0, (b - a) / dt)]);
    }
    return out;
  }

  function hitRate(points) {
    const out = [];
    for (let i = 1; i < points.length; i++) {
      const j = Math.max(0, i - 5); // over the last few samples, so the line moves
      const q = points[i].prefix_queries - points[j].prefix_queries;
      const h = points[i].prefix_hits - points[j].prefix_hits;
      out.push([points[i].t, q > 0 ? (100 * h) / q : 0]);
    }
    return out;
  }

  function drawChart(svg, series, fixedMax, fmt) {
    const ns = "http://www.w3.org/2000/svg";
    svg.replaceChildren();
    const now = view.doc ? view.doc.time : Date.now() / 1000;
    // the x axis spans the history held (up to WINDOW_S), so a fresh page draws full-width lines
    const first = view.history.length ? view.history[0].t : now;
    const t0 = Math.max(now - WINDOW_S, Math.min(first, now - 10));
    const span = now - t0;
    let max = fixedMax || 0;
    if (!fixedMax) for (const s of series) for (const [, v] of s.values) max = Math.max(max, v);
    max = max || 1;
    for (const frac of [0, 0.5, 1]) {
      const line = document.createElementNS(ns, "line");
      line.setAttribute("x1", "0"); line.setAttribute("x2", "300");
      line.setAttribute("y1", String(88 - 86 * frac)); line.setAttribute("y2", String(88 - 86 * frac));
      svg.append(line);
    }
    let count = 0;
    for (const s of series) {
      const pts = s.values.filter(([t]) => t >= t0).map(([t, v]) => `${(((t - t0) / span) * 300).toFixed(1)},${(88 - (86 * v) / max).toFixed(1)}`);
      count += pts.length;
      const poly = document.createElementNS(ns, "polyline");
      poly.setAttribute("points", pts.join(" "));
      poly.style.stroke = css(SERIES_COLORS[s.name] || "--c1");
      poly.dataset.series = s.name;
      svg.append(poly);
    }
    svg.dataset.points = String(count);
    svg.dataset.max = String(max);
    const caption = svg.previousElementSibling;
    let value = caption.querySelector("span");
    if (!value) { value = document.createElement("span"); caption.append(value); }
    const last = series.length && series[0].values.length ? series[0].values[series[0].values.length - 1][1] : null;
    value.textContent = last === null ? "" : fmt(last) + (fixedMax ? "" : ` · max ${fmt(max)}`);
  }

  function drawCharts() {
    const h = view.history;
    const tiers = view.doc.tiers.map((t) => t.name);
    const lower = tiers.filter((n) => n !== "device");
    const perTier = (names, pick) => names.map((name) => ({ name, values: rate(h, (p) => (p.tiers[name] ? pick(p.tiers[name]) : undefined)) }));
    drawChart($("chart-usage"), [{ name: "device", values: h.map((p) => [p.t, 100 * p.usage]) }], 100, (v) => v.toFixed(0) + "%");
    drawChart($("chart-hits"), [{ name: "device", values: hitRate(h) }], 100, (v) => v.toFixed(0) + "%");
    drawChart($("chart-tier-hits"), perTier(lower.length ? lower : ["device"], (t) => t.hits), 0, (v) => v.toFixed(1));
    drawChart($("chart-tier-bytes"), perTier(tiers, (t) => t.bytes_in + t.bytes_out), 0, (v) => fmtBytes(v) + "/s");
    drawChart($("chart-evictions"), perTier(tiers, (t) => t.evictions), 0, (v) => v.toFixed(1));
    const legend = $("chart-legend");
    legend.replaceChildren();
    for (const name of tiers) {
      const i = document.createElement("i");
      i.style.background = css(SERIES_COLORS[name] || "--c1");
      legend.append(i, name + (name === "device" && !lower.length ? " (hits in tokens)" : ""));
    }
  }

  // ---- tables -----------------------------------------------------------------------------
  function fillTable(tbody, rows) {
    tbody.replaceChildren(...rows.map((cells) => {
      const tr = document.createElement("tr");
      for (const c of cells) { const td = document.createElement("td"); td.textContent = c; tr.append(td); }
      return tr;
    }));
  }

  function drawRequests() {
    const doc = view.doc;
    const box = $("requests");
    const width = box.clientWidth || 300;
    $("n-requests").textContent = `${doc.requests.length} live`;
    view.rows = [];
    box.replaceChildren(...doc.requests.map((r) => {
      const row = document.createElement("div");
      row.className = "row";
      row.dataset.request = r.id;
      const meta = document.createElement("div");
      meta.className = "meta";
      const id = document.createElement("span");
      id.className = "id";
      id.textContent = r.id;
      id.title = r.id;
      const total = r.prompt_tokens + r.output_tokens;
      meta.append(id, `${r.status} · ${r.computed_tokens}/${total} tok · ${r.cached_tokens} cached` + (r.preemptions ? ` · preempted ${r.preemptions}×` : ""));
      const canvas = document.createElement("canvas");
      row.append(meta, canvas);
      const layout = { canvas, ids: r.blocks, size: 10, cols: 1 };
      view.rows.push(layout);
      requestAnimationFrame(() => {
        Object.assign(layout, drawCells(canvas, r.blocks, 10, Math.max(60, canvas.parentElement.clientWidth - (width > 600 ? 240 : 0))));
      });
      canvas.addEventListener("mousemove", (e) => showTip(e, layout));
      canvas.addEventListener("mouseleave", () => { $("tip").hidden = true; });
      return row;
    }));
  }

  function render(doc) {
    view.doc = doc;
    view.updates += 1;
    view.lruRank = {};
    doc.evict_order.forEach((id, i) => { view.lruRank[id] = i; });
    $("view").hidden = false;
    const model = doc.model || "";
    $("model").textContent = model.split("/").filter(Boolean).pop() || model;
    $("model").title = model;
    for (const k of ["free", "cached", "owned", "shared", "pinned"]) $("n-" + k).textContent = doc.counts[k];
    $("usage").textContent = pct(doc.point.usage);
    $("hit-rate").textContent = pct(doc.prefix_cache.hit_rate);
    $("preemptions").textContent = doc.num_preemptions;
    $("pool-size").textContent = `${doc.num_blocks} × ${doc.block_size} tokens`;
    const grid = $("grid");
    const ids = Array.from({ length: doc.num_blocks }, (_, i) => i);
    view.grid = drawCells(grid, ids, cellSize(doc.num_blocks), grid.parentElement.clientWidth);
    drawRequests();
    drawCharts();
    fillTable($("tiers").tBodies[0], doc.tiers.map((t) => [
      t.name, t.num_blocks, fmtBytes(t.bytes_held), pct(t.occupancy), t.hits + (t.unit === "blocks" ? "" : " " + t.unit),
      t.misses, fmtBytes(t.bytes_in), fmtBytes(t.bytes_out), t.evictions,
    ]));
    const p = doc.planner;
    fillTable($("planner").tBodies[0], p ? [
      ["", "planner", "pool"],
      ["blocks", p.num_blocks ?? "–", p.measured_num_blocks],
      [`max concurrency at ${p.max_model_len} tokens`, p.max_concurrency ?? "–", p.measured_max_concurrency],
      ["KV bytes per token", p.kv_bytes_per_token, ""],
      ["KV budget", fmtBytes(p.kv_budget_bytes), p.budget_source],
    ] : [["no planner prediction for this model"]]);
  }

  function onSnapshot(doc) {
    if (doc.history) view.history = doc.history.slice();
    else if (!view.history.length || view.history[view.history.length - 1].t < doc.point.t) view.history.push(doc.point);
    const cutoff = doc.time - WINDOW_S;
    while (view.history.length && view.history[0].t < cutoff) view.history.shift();
    render(doc);
  }

  // ---- connection and login ---------------------------------------------------------------
  let source = null;
  async function start() {
    let response;
    try {
      response = await fetch("/v1/kv/map?history=1", { credentials: "same-origin", cache: "no-store" });
    } catch (err) {
      setStatus("down", "server unreachable; retrying");
      setTimeout(start, 3000);
      return;
    }
    if (response.status === 401) {
      setStatus("down", "API key needed");
      $("view").hidden = true;
      $("login").hidden = false;
      $("login-key").focus();
      return;
    }
    if (!response.ok) {
      setStatus("down", `server answered ${response.status}; retrying`);
      setTimeout(start, 3000);
      return;
    }
    onSnapshot(await response.json());
    source = new EventSource(`/v1/kv/stream?interval=${interval}`);
    source.onmessage = (event) => {
      const doc = JSON.parse(event.data);
      onSnapshot(doc);
      setStatus("live", `live · every ${Math.max(interval, doc.interval_s || 0).toFixed(2).replace(/\.?0+$/, "")} s`);
    };
    source.onerror = () => {
      source.close();
      setStatus("down", "reconnecting…");
      setTimeout(start, 2000);
    };
  }

  $("login").addEventListener("submit", async (event) => {
    event.preventDefault();
    const body = new URLSearchParams({ key: $("login-key").value });
    const response = await fetch("/kv/login", { method: "POST", body, credentials: "same-origin" });
    $("login-key").value = "";
    if (response.status === 204) {
      $("login").hidden = true;
      $("login-error").hidden = true;
      start();
    } else {
      $("login-error").textContent = "That key was not accepted.";
      $("login-error").hidden = false;
    }
  });

  $("grid").addEventListener("mousemove", (e) => showTip(e, view.grid));
  $("grid").addEventListener("mouseleave", () => { $("tip").hidden = true; });
  let resizeTimer = 0;
  window.addEventListener("resize", () => {
    clearTimeout(resizeTimer);
    resizeTimer = setTimeout(() => view.doc && render(view.doc), 150);
  });
  start();
})();
