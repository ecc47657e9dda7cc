// Sandman's live dashboard: polls GET /v1/dashboard every second and draws it with SVG.
// No dependencies and no build step. Strings from the service (image names, error
// messages) only ever go into textContent, never into HTML.
"use strict";

const STATES = ["queued", "creating", "starting", "ready", "leased", "releasing", "failed", "lost"];
const COLORS = {
  queued: "#9ca3af", creating: "#f59e0b", starting: "#eab308", ready: "#10b981",
  leased: "#2563eb", releasing: "#8b5cf6", failed: "#dc2626", lost: "#7f1d1d",
};
const PACING = [
  ["completed", "ready / s", "#10b981"],
  ["rate", "pacer: creates / s allowed", "#f59e0b"],
  ["window", "pacer: window", "#2563eb"],
  ["in_flight", "created, not ready", "#8b5cf6"],
];
const KEY = "sandman.dashboard.key";
const POLL_MS = 1000;
const SVG = "http://www.w3.org/2000/svg";

const $ = (id) => document.getElementById(id);

function el(tag, attrs = {}, text) {
  const node = tag.startsWith("svg:")
    ? document.createElementNS(SVG, tag.slice(4))
    : document.createElement(tag);
  for (const [name, value] of Object.entries(attrs)) node.setAttribute(name, String(value));
  if (text !== undefined) node.textContent = String(text);
  return node;
}

function seconds(value) {
  if (value === null || value === undefined) return "–";
  return value < 1 ? `${Math.round(value * 1000)} ms` : `${value.toFixed(2)} s`;
}

function clock(t) {
  return new Date(t * 1000).toLocaleTimeString([], { hour12: false });
}

// -- key handling ---------------------------------------------------------------------

function askForKey(message) {
  $("board").hidden = true;
  $("key-form").hidden = false;
  $("key-error").textContent = message || "";
  $("forget-key").hidden = true;
  $("key-input").focus();
}

$("key-form").addEventListener("submit", (event) => {
  event.preventDefault();
  localStorage.setItem(KEY, $("key-input").value.trim());
  $("key-input").value = "";
  poll();
});

$("forget-key").addEventListener("click", () => {
  localStorage.removeItem(KEY);
  askForKey("");
});

// -- polling --------------------------------------------------------------------------

let timer = null;
const PAGE_SIZE = 50;
let sandboxPage = 0;

async function poll() {
  clearTimeout(timer);
  const key = localStorage.getItem(KEY);
  const headers = key ? { Authorization: `Bearer ${key}` } : {};
  try {
    const response = await fetch("/v1/dashboard?seconds=300", { headers, cache: "no-store" });
    if (response.status === 401) {
      // Without a key this is the first visit; with one, the key is wrong.
      askForKey(key ? "The service refused this key." : "");
      return;
    }
    if (!response.ok) throw new Error(`HTTP ${response.status}`);
    render(await response.json());
    const rows = await fetch(`/v1/dashboard/sandboxes?page=${sandboxPage}&size=${PAGE_SIZE}`,
                             { headers, cache: "no-store" });
    if (rows.ok) renderSandboxes(await rows.json());
    $("forget-key").hidden = !key;
    $("status").textContent = `live · ${clock(Date.now() / 1000)}`;
    $("status").classList.remove("down");
  } catch (error) {
    $("status").textContent = `offline: ${error.message}`;
    $("status").classList.add("down");
  }
  timer = setTimeout(poll, POLL_MS);
}

// -- rendering ------------------------------------------------------------------------

function render(data) {
  $("key-form").hidden = true;
  $("board").hidden = false;
  $("pool").textContent = data.pool;
  $("provider").textContent = data.provider;
  $("tenant").textContent = data.tenant;
  $("admin").hidden = !data.admin;
  $("images-scope").textContent = data.admin ? "(every tenant)" : "(your tenant)";
  $("errors-scope").textContent = data.admin
    ? "(every tenant's and the backend's; \"refused\": the service said no)"
    : "(yours and the backend's; \"refused\": the service said no)";
  const span = data.samples.length * data.interval;
  $("span").textContent = span < 120 ? `${Math.round(span)} s` : `${Math.round(span / 60)} min`;
  renderTiles(data);
  renderStates(data.samples);
  renderPacing(data.samples, data.interval);
  renderReadiness(data);
  renderGroups($("tenants"), data.tenants);
  renderGroups($("images"), data.images);
  $("images-empty").hidden = data.images.length > 0;
  renderErrors(data.errors);
}

function tile(parent, id, label, value, color) {
  const box = el("div", { class: "tile", "data-tile": id });
  if (color) box.style.borderTopColor = color;
  box.append(el("span", { class: "label" }, label), el("span", { class: "value", id }, value));
  parent.append(box);
}

function recentRate(samples, interval, n = 10) {
  const last = samples.slice(-n);
  if (!last.length) return 0;
  return last.reduce((sum, s) => sum + s.completed, 0) / (last.length * interval);
}

function renderTiles(data) {
  const tiles = $("tiles");
  tiles.replaceChildren();
  for (const state of STATES) tile(tiles, `count-${state}`, state, data.states[state] ?? 0, COLORS[state]);
  tile(tiles, "sessions", "sessions", data.sessions);
  tile(tiles, "snapshots", "snapshots", data.snapshots ?? 0);
  // Sandboxes that died by themselves since the start, by reason (oom, killed, evicted...).
  const lost = Object.entries(data.lost || {}).sort((a, b) => b[1] - a[1] || (a[0] < b[0] ? -1 : 1));
  const total = lost.reduce((sum, [, n]) => sum + n, 0);
  tile(tiles, "lost-total", "lost since start", total, COLORS.lost);
  for (const [reason, n] of lost) tile(tiles, `lost-${reason}`, `lost: ${reason}`, n, COLORS.lost);
  tile(tiles, "create-rate", "ready / s (10 s)", recentRate(data.samples, data.interval).toFixed(1));
  const p = data.pacing;
  tile(tiles, "pacing-rate", "pacer: creates / s", p.rate === null ? "–" : p.rate.toFixed(1));
  tile(tiles, "pacing-window", "pacer: window", p.window ?? "–");
  tile(tiles, "pacing-in-flight", "created, not ready", p.in_flight ?? "–");
}

// A time axis over the samples: x from the first sample's time to the last.
function frame(svg, samples, max, height) {
  svg.replaceChildren();
  const width = 900;
  const left = 34;
  // At least a minute wide, so the first seconds of a service are not stretched across it.
  const t1 = samples.length ? samples[samples.length - 1].t : 1;
  const t0 = samples.length ? Math.min(samples[0].t, t1 - 60) : 0;
  const x = (t) => left + ((t - t0) / Math.max(1e-9, t1 - t0)) * (width - left - 4);
  const y = (v) => height - 16 - (v / Math.max(1, max)) * (height - 26);
  svg.append(
    el("svg:line", { class: "axis", x1: left, x2: width, y1: y(0), y2: y(0) }),
    el("svg:text", { x: 0, y: y(max) + 4 }, Math.round(max)),
    el("svg:text", { x: 0, y: y(0) + 4 }, 0),
  );
  if (samples.length) {
    svg.append(
      el("svg:text", { x: left, y: height - 2 }, clock(t0)),
      el("svg:text", { x: width - 60, y: height - 2 }, clock(t1)),
    );
  }
  return { x, y };
}

function legend(parent, items) {
  parent.replaceChildren();
  for (const [label, color] of items) {
    const item = el("span", {}, "");
    const swatch = el("i");
    swatch.style.background = color;
    item.append(swatch, document.createTextNode(label));
    parent.append(item);
  }
}

function renderStates(samples) {
  const svg = $("chart-states");
  const max = Math.max(1, ...samples.map((s) => STATES.reduce((n, st) => n + (s.states[st] || 0), 0)));
  const { x, y } = frame(svg, samples, max, 220);
  if (samples.length > 1) {
    // Stacked areas, bottom-up in the order of the state machine's end: leased at the bottom.
    const order = [...STATES].reverse();
    const below = samples.map(() => 0);
    for (const state of order) {
      const above = samples.map((s, i) => below[i] + (s.states[state] || 0));
      if (above.some((v, i) => v !== below[i])) {
        const top = samples.map((s, i) => `${x(s.t)},${y(above[i])}`);
        const bottom = samples.map((s, i) => `${x(s.t)},${y(below[i])}`).reverse();
        svg.append(el("svg:polygon", { points: [...top, ...bottom].join(" "), fill: COLORS[state],
                                        "fill-opacity": 0.85, "data-state": state }));
      }
      above.forEach((v, i) => { below[i] = v; });
    }
  }
  legend($("legend-states"), STATES.map((s) => [s, COLORS[s]]));
}

function renderPacing(samples, interval) {
  const svg = $("chart-pacing");
  const value = (s, key) => (key === "completed" ? s.completed / interval : s.pacing[key]);
  const values = samples.flatMap((s) => PACING.map(([key]) => value(s, key) ?? 0));
  const { x, y } = frame(svg, samples, Math.max(1, ...values), 180);
  for (const [key, , color] of PACING) {
    const points = samples.filter((s) => value(s, key) !== null).map((s) => `${x(s.t)},${y(value(s, key))}`);
    if (points.length > 1) {
      svg.append(el("svg:polyline", { points: points.join(" "), fill: "none", stroke: color,
                                       "stroke-width": 2, "data-series": key }));
    }
  }
  legend($("legend-pacing"), PACING.map(([, label, color]) => [label, color]));
}

function renderReadiness(data) {
  const svg = $("chart-readiness");
  svg.replaceChildren();
  const buckets = data.readiness;
  const max = Math.max(1, ...buckets.map((b) => b.count));
  const width = 440, height = 200, gap = 4;
  const w = (width - gap * buckets.length) / buckets.length;
  buckets.forEach((b, i) => {
    const h = (b.count / max) * (height - 40);
    const left = i * (w + gap);
    svg.append(el("svg:rect", { x: left, y: height - 22 - h, width: w, height: h, fill: "#2563eb",
                                "data-le": b.le === null ? "inf" : b.le, "data-count": b.count }));
    const middle = { x: left + w / 2, "text-anchor": "middle" };
    if (b.count) svg.append(el("svg:text", { ...middle, y: height - 26 - h }, b.count));
    svg.append(el("svg:text", { ...middle, y: height - 6 }, b.le === null ? "more" : b.le));
  });
  $("readiness-count").textContent = data.readiness_count;
  $("readiness-p50").textContent = seconds(data.readiness_p50);
  $("readiness-p95").textContent = seconds(data.readiness_p95);
}

function renderGroups(table, groups) {
  const body = table.tBodies[0];
  body.replaceChildren();
  const max = Math.max(1, ...groups.map((g) => g.total));
  for (const group of groups) {
    const row = el("tr", { "data-name": group.name });
    const bar = el("div", { class: "bar" });
    bar.style.width = `${(100 * Math.max(group.total, 0.0001)) / max}%`;
    for (const state of STATES) {
      const n = group.states[state] || 0;
      if (!n) continue;
      const part = el("span", { title: `${state}: ${n}`, "data-state": state });
      part.style.flex = String(n);
      part.style.background = COLORS[state];
      bar.append(part);
    }
    const cell = el("td");
    cell.append(bar);
    const waiting = group.waiting ? `+${group.waiting} waiting` : "";
    row.append(el("td", { class: "name" }, group.name), cell, el("td", { class: "total" }, group.total),
               el("td", { class: "waiting", "data-waiting": group.waiting ?? 0 }, waiting));
    body.append(row);
  }
}

$("sandboxes-prev").addEventListener("click", () => {
  sandboxPage = Math.max(0, sandboxPage - 1);
  poll();
});
$("sandboxes-next").addEventListener("click", () => {
  sandboxPage += 1;
  poll();
});

function age(seconds) {
  if (seconds < 120) return `${Math.round(seconds)} s`;
  if (seconds < 7200) return `${Math.round(seconds / 60)} min`;
  return `${(seconds / 3600).toFixed(1)} h`;
}

function mib(bytes) {
  return bytes === null || bytes === undefined ? "–" : `${(bytes / 2 ** 20).toFixed(1)} MiB`;
}

function renderSandboxes(page) {
  const pages = Math.max(1, Math.ceil(page.total / page.size));
  if (page.page >= pages && page.page > 0) {
    sandboxPage = pages - 1;  // the list shrank under this page: the last one next time
  }
  const body = $("sandboxes").tBodies[0];
  body.replaceChildren();
  for (const s of page.sandboxes) {
    const row = el("tr", { "data-sandbox": s.id });
    const cpu = s.cpu_seconds === null || s.cpu_seconds === undefined ? "–" : s.cpu_seconds.toFixed(2);
    for (const text of [s.id, s.state, age(s.age), s.image, cpu, mib(s.memory_bytes), s.session ?? ""]) {
      row.append(el("td", {}, text));
    }
    body.append(row);
  }
  $("sandboxes-total").textContent = page.total;
  $("sandboxes-empty").hidden = page.sandboxes.length > 0;
  $("sandboxes-page").textContent = `page ${page.page + 1} of ${pages}`;
  $("sandboxes-prev").disabled = page.page === 0;
  $("sandboxes-next").disabled = page.page + 1 >= pages;
}

function renderErrors(errors) {
  const body = $("errors").tBodies[0];
  body.replaceChildren();
  for (const e of errors) {
    const row = el("tr");
    for (const [text, cls] of [[clock(e.at)], [e.event], [e.kind ?? ""], [e.image ?? ""],
                               [e.sandbox_id ?? ""], [e.tenant ?? ""], [e.message, "message"]]) {
      row.append(el("td", cls ? { class: cls } : {}, text));
    }
    body.append(row);
  }
  $("errors-empty").hidden = errors.length > 0;
}

poll();
