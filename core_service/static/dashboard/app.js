// ElasWave dashboard: follows the Core's event stream and renders it. No framework, no
// external asset. Everything from the server is inserted as text (never as HTML).
"use strict";

const STATE_COLOURS = {
  RUNNING: "#2da44e", JOINING: "#1e88e5", SLOW: "#f0a202", PREEMPTING: "#8e44ad",
  DRAINING: "#b07cc6", LOST: "#d32f2f", LEFT: "#9aa4b2", "-": "#e3e7ed",
};
const ROW_HEIGHT = 26; // px, .vrow in app.css: the virtualised member list relies on it
const TOKEN_KEY = "elaswave.schedulerToken";

const ui = {
  job: decodeURIComponent((location.hash.match(/job=([^&]+)/) || [])[1] || ""),
  stream: null,
  view: null,
  history: null,
  stage: null, // the stage whose members are listed
  members: [],
  updates: 0, // count of stream updates rendered (read by the browser test)
  pending: null, // the action waiting for the dialog
};
window.__elaswave = ui;

const $ = (id) => document.getElementById(id);

function el(tag, attrs, ...children) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (k === "class") node.className = v;
    else if (k === "style") node.style.cssText = v;
    else if (k.startsWith("data-")) node.setAttribute(k, v);
    else node[k] = v;
  }
  for (const c of children) node.append(c instanceof Node ? c : document.createTextNode(c == null ? "" : String(c)));
  return node;
}

const fmt = {
  s: (v) => (v == null ? "–" : v < 1 ? `${(v * 1000).toFixed(0)} ms` : `${v.toFixed(2)} s`),
  bytes: (v) => (v == null ? "–" : v >= 2 ** 30 ? `${(v / 2 ** 30).toFixed(1)} GiB` : `${(v / 2 ** 20).toFixed(0)} MiB`),
  num: (v, d = 1) => (v == null ? "–" : Number(v).toFixed(d)),
  time: (t) => (t == null ? "–" : new Date(t * 1000).toLocaleTimeString()),
};

function notice(text, refused) {
  const n = $("notice");
  n.textContent = text;
  n.className = refused ? "refused" : "";
  n.hidden = false;
}

// ---- the stream ---------------------------------------------------------------------------------
// Server-sent events read through fetch (not EventSource): a Core whose reads need the
// scheduler token (read_access = "token") gets it in the Authorization header.
function authHeaders() {
  const token = sessionStorage.getItem(TOKEN_KEY);
  return token ? { Authorization: `Bearer ${token}` } : {};
}

async function errorDetail(response) {
  const body = await response.json().catch(() => ({}));
  return typeof body.detail === "string" ? body.detail : JSON.stringify(body.detail || body);
}

function retry(controller, ms) {
  setTimeout(() => { if (ui.stream === controller) connect(); }, ms);
}

async function connect() {
  if (ui.stream) ui.stream.abort();
  const controller = new AbortController();
  ui.stream = controller;
  ui.history = null;
  const query = ui.job ? `?job=${encodeURIComponent(ui.job)}` : "";
  let response;
  try {
    response = await fetch(`/api/v1/dashboard/stream${query}`, { headers: authHeaders(), signal: controller.signal });
  } catch (err) {
    if (!controller.signal.aborted) { $("role").textContent = "reconnecting…"; retry(controller, 1000); }
    return;
  }
  if (!response.ok) {
    const detail = await errorDetail(response);
    if (response.status === 401 || response.status === 403) {
      sessionStorage.removeItem(TOKEN_KEY);
      renderTokenState();
      $("role").textContent = "token needed to read";
      notice(`This Core shows its jobs to holders of the scheduler token only (${response.status}: ${detail}).`, true);
      ask("read");
      return;
    }
    $("role").textContent = response.status === 503 ? `standby: ${detail}` : `error ${response.status}: ${detail}`;
    retry(controller, 2000);
    return;
  }
  const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = "";
  try {
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      buffer += value;
      let end;
      while ((end = buffer.indexOf("\n\n")) >= 0) {
        const frame = buffer.slice(0, end);
        buffer = buffer.slice(end + 2);
        const data = frame.split("\n").filter((l) => l.startsWith("data: ")).map((l) => l.slice(6)).join("\n");
        if (data) render(JSON.parse(data));
      }
    }
  } catch (err) {
    if (controller.signal.aborted) return;
  }
  if (!controller.signal.aborted) { $("role").textContent = "reconnecting…"; retry(controller, 500); }
}

function render(payload) {
  const started = performance.now();
  ui.updates += 1;
  if (!payload.leader) {
    $("role").textContent = `standby: ${payload.message}`;
    return;
  }
  $("role").textContent = `leader ${payload.core_id}`;
  if (payload.error) notice(payload.error, true);
  renderJobs(payload.jobs);
  if (!ui.job && payload.jobs.length) { selectJob(payload.jobs[0].name); return; }
  const view = payload.view;
  $("job").hidden = !view;
  $("nojob").hidden = !!view;
  if (!view) return;
  ui.view = view;
  appendHistory(view.history);
  renderSummary(view.summary);
  renderCharts();
  renderGrid(view.grid);
  renderStages(view.stages);
  renderPlans(view.plans);
  renderSpares(view.spares, view.scale);
  renderEvents(view.events);
  if (ui.stage != null) loadMembers(ui.stage);
  ui.renderMs = performance.now() - started; // the last update's render time (the 1,000-member test prints it)
  if (ui.firstViewAt == null) ui.firstViewAt = performance.now();
}

function selectJob(name) {
  ui.job = name;
  ui.stage = null;
  $("members-panel").hidden = true;
  location.hash = `job=${encodeURIComponent(name)}`;
  connect();
}

function renderJobs(jobs) {
  const list = $("jobs");
  list.replaceChildren(...jobs.map((j) => {
    const states = Object.entries(j.members_by_state).map(([s, n]) => `${n} ${s}`).join(", ");
    const li = el("li", { class: j.name === ui.job ? "selected" : "", "data-job": j.name },
      j.name, el("small", {}, `${j.phase} · epoch ${j.plan_epoch}`), el("small", {}, states || "no members"));
    li.onclick = () => selectJob(j.name);
    return li;
  }));
}

function renderSummary(s) {
  $("job-name").textContent = s.name;
  const states = Object.entries(s.members_by_state).map(([k, n]) => `${n} ${k}`).join(", ");
  $("job-summary").textContent =
    `${s.phase} · plan epoch ${s.plan_epoch} (committed ${s.committed_epoch}${s.plan_mode ? ", " + s.plan_mode : ""}) · ${states}`;
}

// ---- charts -----------------------------------------------------------------------------------
function appendHistory(h) {
  if (!ui.history) { ui.history = h; return; }
  for (const k of Object.keys(h)) ui.history[k].push(...h[k]);
  const extra = ui.history.time_unix.length - 3600;
  if (extra > 0) for (const k of Object.keys(ui.history)) ui.history[k].splice(0, extra);
}

function renderCharts() {
  const h = ui.history;
  line($("chart-step"), h.time_unix, h.step_time_s, (v) => fmt.s(v));
  line($("chart-sps"), h.time_unix, h.samples_per_s, (v) => fmt.num(v, 1));
  line($("chart-loss"), h.time_unix, h.loss, (v) => fmt.num(v, 3));
  line($("chart-live"), h.time_unix, h.live_workers, (v) => fmt.num(v, 0));
  line($("chart-lse"), h.time_unix, h.lse, (v) => fmt.num(v, 3));
}

function line(canvas, xs, ys, label) {
  const ctx = canvas.getContext("2d");
  const w = canvas.width, hgt = canvas.height, pad = 16;
  ctx.clearRect(0, 0, w, hgt);
  const pts = xs.map((x, i) => [x, ys[i]]).filter((p) => p[1] != null);
  ctx.fillStyle = "#667085";
  ctx.font = "11px system-ui";
  if (!pts.length) { ctx.fillText("no data yet", 8, hgt / 2); return; }
  const x0 = xs[0], x1 = Math.max(xs[xs.length - 1], x0 + 1);
  let lo = Math.min(...pts.map((p) => p[1])), hi = Math.max(...pts.map((p) => p[1]));
  if (hi === lo) { hi += Math.abs(hi) * 0.1 || 1; lo -= Math.abs(lo) * 0.1 || 0; }
  const X = (x) => pad + ((x - x0) / (x1 - x0)) * (w - 2 * pad);
  const Y = (y) => hgt - pad - ((y - lo) / (hi - lo)) * (hgt - 2 * pad);
  ctx.strokeStyle = "#1f4e79";
  ctx.lineWidth = 1.5;
  ctx.beginPath();
  let drawing = false;
  xs.forEach((x, i) => {
    const y = ys[i];
    if (y == null) { drawing = false; return; } // a gap: no step reported (a recovery)
    if (drawing) ctx.lineTo(X(x), Y(y)); else ctx.moveTo(X(x), Y(y));
    drawing = true;
  });
  ctx.stroke();
  ctx.fillText(label(hi), 2, 10);
  ctx.fillText(label(lo), 2, hgt - 3);
  ctx.fillText(`now ${label(pts[pts.length - 1][1])}`, w - 90, 10);
}

// ---- the layout grid (one canvas, whatever the number of ranks) -------------------------------
let gridCells = [];

function renderGrid(grid) {
  const canvas = $("grid");
  const legend = $("grid-legend");
  if (!legend.childElementCount) {
    legend.append(...Object.entries(STATE_COLOURS).map(([s, c]) =>
      el("span", {}, el("i", { style: `background:${c}` }), s === "-" ? "no worker" : s)));
  }
  if (!grid) { canvas.height = 20; $("grid-stages").textContent = "The job has no layout (membership only)."; gridCells = []; return; }
  const width = canvas.clientWidth || 900;
  canvas.width = width;
  const label = 70;
  const widest = Math.max(...grid.stages.map((s) => s.cells.length), 1);
  const size = Math.max(5, Math.min(24, Math.floor((width - label) / widest)));
  const perRow = Math.max(1, Math.floor((width - label) / size));
  const rows = grid.stages.map((s) => Math.max(1, Math.ceil(s.cells.length / perRow)));
  canvas.height = rows.reduce((a, b) => a + b, 0) * size + grid.stages.length * 4 + 4;
  const ctx = canvas.getContext("2d");
  ctx.font = "11px system-ui";
  gridCells = [];
  let y = 2;
  grid.stages.forEach((s, si) => {
    ctx.fillStyle = "#1d2430";
    ctx.fillText(`stage ${s.stage}`, 2, y + Math.min(size, 14) - 2);
    s.cells.forEach((cell, i) => {
      const cx = label + (i % perRow) * size, cy = y + Math.floor(i / perRow) * size;
      ctx.fillStyle = STATE_COLOURS[cell[1]] || "#e3e7ed";
      ctx.fillRect(cx, cy, size - 1, size - 1);
      gridCells.push({ x: cx, y: cy, size, stage: s, replica: i, cell });
    });
    y += rows[si] * size + 4;
  });
  ui.gridCells = gridCells;
  $("grid-stages").replaceChildren(...grid.stages.map((s) => el("div", {},
    `stage ${s.stage}: layers ${s.layers[0]}–${s.layers[1] - 1} (${s.layers[1] - s.layers[0]}), ` +
    `${s.cells.length} replicas, clock ${s.clock_mhz ? s.clock_mhz[0] + (s.clock_mhz[1] !== s.clock_mhz[0] ? "–" + s.clock_mhz[1] : "") + " MHz" : "default"}`)));
}

function gridHover(event) {
  const tip = $("grid-tip");
  const r = event.target.getBoundingClientRect();
  const x = (event.clientX - r.left) * (event.target.width / r.width), y = (event.clientY - r.top) * (event.target.height / r.height);
  const hit = gridCells.find((c) => x >= c.x && x < c.x + c.size && y >= c.y && y < c.y + c.size);
  if (!hit) { tip.hidden = true; return; }
  const [rank, state, clock, worker] = hit.cell;
  tip.textContent = `stage ${hit.stage.stage} replica ${hit.replica} · rank ${rank} · ${worker || "no worker"} ${state} · ${clock ? clock + " MHz" : "default clock"}`;
  tip.style.left = `${event.clientX - r.left + 12}px`;
  tip.style.top = `${event.clientY - r.top + 12}px`;
  tip.hidden = false;
}

// ---- members ----------------------------------------------------------------------------------
function renderStages(stages) {
  $("stages").replaceChildren(...stages.map((s) => {
    const states = Object.entries(s.by_state).map(([k, n]) => el("span", { class: `state-${k}` }, `${n} ${k} `));
    const button = el("button", { type: "button", "data-stage": String(s.stage) }, ui.stage === s.stage ? "hide" : "members");
    button.onclick = () => toggleStage(s.stage);
    return el("tr", { "data-stage-row": String(s.stage) },
      el("td", {}, s.stage < 0 ? "unplaced" : s.stage), el("td", {}, s.members), el("td", {}, ...states),
      el("td", {}, s.unhealthy), el("td", {}, fmt.bytes(s.device_used_max_bytes)),
      el("td", {}, s.min_step == null ? "–" : `${s.min_step}–${s.max_step}`), el("td", {}, fmt.s(s.step_time_median_s)),
      el("td", {}, fmt.s(s.heartbeat_age_max_s)), el("td", {}, button));
  }));
}

function toggleStage(stage) {
  ui.stage = ui.stage === stage ? null : stage;
  $("members-panel").hidden = ui.stage == null;
  if (ui.stage != null) { $("members-scroll").scrollTop = 0; loadMembers(ui.stage); }
  if (ui.view) renderStages(ui.view.stages);
}

async function loadMembers(stage) {
  const r = await fetch(`/api/v1/dashboard/jobs/${encodeURIComponent(ui.job)}/stages/${stage}/members`, { headers: authHeaders() });
  if (!r.ok || ui.stage !== stage) return;
  ui.members = (await r.json()).members;
  $("members-title").textContent = `Stage ${stage}: ${ui.members.length} members`;
  $("members-spacer").style.height = `${ui.members.length * ROW_HEIGHT}px`;
  $("members-scroll").style.height = `${Math.min(12, Math.max(1, ui.members.length)) * ROW_HEIGHT + 2}px`;
  renderMemberWindow();
}

function memberRow(m) {
  const drain = el("button", { type: "button", "data-action": "drain", "data-worker": m.worker_id }, "drain");
  const preempt = el("button", { type: "button", "data-action": "preempt", "data-worker": m.worker_id }, "preempt");
  return el("div", { class: "vrow", "data-member": m.worker_id },
    el("span", { title: `${m.worker_id} on ${m.host}` }, m.worker_id), el("span", {}, m.dp_rank), el("span", {}, m.rank),
    el("span", {}), el("span", {}), el("span", {}), el("span", {}), el("span", {}), el("span", {}), el("span", {}),
    el("span", {}, drain, " ", preempt));
}

// The live cells of a row, refreshed in place: a row (and its buttons) is replaced only when
// another member scrolls into its slot, so a click never lands on a node being swapped out.
function fillMemberRow(row, m) {
  const cells = row.children;
  cells[3].textContent = m.state;
  cells[3].className = `state-${m.state}`;
  cells[3].title = m.reason;
  cells[4].textContent = m.health;
  cells[5].textContent = m.device_total_bytes ? `${fmt.bytes(m.device_used_bytes)} / ${fmt.bytes(m.device_total_bytes)}` : fmt.bytes(m.device_used_bytes);
  cells[6].textContent = fmt.bytes(m.rss_bytes);
  cells[7].textContent = m.last_step == null ? "–" : m.last_step;
  cells[8].textContent = fmt.s(m.step_time_s);
  cells[9].textContent = fmt.s(m.heartbeat_age_s);
}

// Only the rows in view (plus a margin) exist in the DOM: a 1,000-member stage costs ~20 rows.
function renderMemberWindow() {
  const scroll = $("members-scroll");
  const first = Math.max(0, Math.floor(scroll.scrollTop / ROW_HEIGHT) - 5);
  const count = Math.ceil(scroll.clientHeight / ROW_HEIGHT) + 10;
  const box = $("members-rows");
  const existing = new Map([...box.children].map((r) => [r.dataset.member, r]));
  const rows = ui.members.slice(first, first + count).map((m) => {
    const row = existing.get(m.worker_id) || memberRow(m);
    fillMemberRow(row, m);
    return row;
  });
  box.style.transform = `translateY(${first * ROW_HEIGHT}px)`;
  const same = rows.length === box.children.length && rows.every((r, i) => box.children[i] === r);
  if (!same) box.replaceChildren(...rows);
}

// ---- plans, spares, events --------------------------------------------------------------------
const PHASE_COLOURS = { plan: "#1e88e5", pause: "#f0a202", apply: "#8e44ad", resume: "#2da44e" };

function renderPlans(plans) {
  if (!plans.length) {
    $("plans").replaceChildren(el("tr", {}, el("td", { colSpan: 9 }, "no plan published yet: the job runs on its starting layout")));
    return;
  }
  $("plans").replaceChildren(...plans.slice().reverse().map((p) => {
    const total = Object.values(p.phases_s).reduce((a, b) => a + b, 0);
    const bar = el("div", { class: "mttr", title: Object.entries(p.phases_s).map(([k, v]) => `${k} ${fmt.s(v)}`).join(" · ") },
      ...Object.entries(p.phases_s).map(([k, v]) => el("i", { style: `width:${total ? (100 * v) / total : 0}%;background:${PHASE_COLOURS[k]}` })));
    const why = [p.detail, p.trigger_count ? `after ${p.triggers.join(", ")}${p.trigger_count > p.triggers.length ? " …" : ""}` : ""].filter(Boolean).join("; ");
    return el("tr", { "data-epoch": String(p.epoch) }, el("td", {}, p.epoch), el("td", {}, fmt.time(p.time_unix)),
      el("td", {}, `${p.mode || ""} (${p.policy || ""})`), el("td", { title: (p.reasons || []).join("\n") }, why),
      el("td", {}, fmt.s(p.step_time_before_s)), el("td", {}, p.predicted_step_time_s ? fmt.s(p.predicted_step_time_s) : "–"),
      el("td", {}, fmt.s(p.measured_step_time_s)),
      el("td", {}, p.mttr_s == null ? (total ? `${fmt.s(total)} so far` : "–") : fmt.s(p.mttr_s), bar),
      el("td", {}, p.steps_lost));
  }));
}

function renderSpares(spares, scale) {
  $("spares").replaceChildren(...(spares.length ? spares.map((s) => el("tr", {}, el("td", {}, s.worker_id), el("td", {}, s.host), el("td", {}, s.state)))
    : [el("tr", {}, el("td", { colSpan: 3 }, "none: every live worker holds a rank"))]));
  $("scale").replaceChildren(...(scale.rows.length ? scale.rows.map((r) => el("tr", {}, el("td", {}, r.devices), el("td", {}, r.dp), el("td", {}, r.pp),
    el("td", {}, r.tp), el("td", {}, fmt.s(r.step_time_s)), el("td", {}, fmt.num(r.throughput_samples_per_s, 1))))
    : [el("tr", {}, el("td", { colSpan: 6 }, scale.why_empty))]));
}

function renderEvents(events) {
  $("events").replaceChildren(...events.map((e) => el("tr", { "data-kind": e.kind }, el("td", {}, e.seq), el("td", {}, fmt.time(e.time_unix)),
    el("td", {}, e.kind), el("td", {}, e.worker_id), el("td", {}, e.detail))));
}

// ---- actions: they need the scheduler token ---------------------------------------------------
const ACTIONS = {
  read: () => ({ title: "Scheduler token", what: "This Core shows its jobs to holders of the scheduler token only.", read: true }),
  checkpoint: () => ({ title: "Checkpoint now", what: `Every worker of ${ui.job} saves a checkpoint a few steps ahead.`,
    path: `/api/v1/jobs/${encodeURIComponent(ui.job)}/checkpoint`, body: {} }),
  stop: () => ({ title: `Stop job ${ui.job}`, what: "Every worker saves a checkpoint, then leaves the job (resume with elaswave run --resume).",
    path: `/api/v1/jobs/${encodeURIComponent(ui.job)}/checkpoint`, body: { stop: true } }),
  drain: (w) => ({ title: `Drain ${w}`, what: `${w} finishes its step and leaves; the job re-plans without it.`,
    path: `/api/v1/jobs/${encodeURIComponent(ui.job)}/workers/${encodeURIComponent(w)}/commands`, body: { command: "drain", reason: "drained from the dashboard" } }),
  preempt: (w) => ({ title: `Preempt ${w}`, what: `${w} is told it will be reclaimed in 30 s; the job plans around it.`,
    path: `/api/v1/jobs/${encodeURIComponent(ui.job)}/preempt`, body: () => ({ worker_ids: [w], deadline_unix: Date.now() / 1000 + 30, reason: "preempted from the dashboard" }) }),
};

function ask(kind, worker) {
  const action = ACTIONS[kind](worker);
  ui.pending = action;
  $("action-title").textContent = action.title;
  $("action-what").textContent = action.what;
  $("action-token").value = sessionStorage.getItem(TOKEN_KEY) || "";
  $("action-dialog").showModal();
  $("action-token").focus();
}

async function perform(action, token) {
  const headers = { "Content-Type": "application/json" };
  if (token) headers.Authorization = `Bearer ${token}`;
  const body = typeof action.body === "function" ? action.body() : action.body;
  let response;
  try {
    response = await fetch(action.path, { method: "POST", headers, body: JSON.stringify(body) });
  } catch (err) {
    notice(`${action.title}: the Core did not answer (${err})`, true);
    return;
  }
  const answer = await response.json().catch(() => ({}));
  const detail = typeof answer.detail === "string" ? answer.detail : JSON.stringify(answer.detail || answer);
  if (response.ok) {
    if (token) sessionStorage.setItem(TOKEN_KEY, token);
    notice(`${action.title}: accepted (${response.status})`, false);
  } else if (response.status === 401 || response.status === 403) {
    sessionStorage.removeItem(TOKEN_KEY);
    notice(`${action.title}: refused (${response.status}): ${detail}. Enter the scheduler token to act.`, true);
  } else {
    notice(`${action.title}: refused (${response.status}): ${detail}`, true);
  }
  renderTokenState();
}

function renderTokenState() {
  const has = !!sessionStorage.getItem(TOKEN_KEY);
  $("token-state").textContent = has ? "token set for this tab" : "read-only (no token)";
  $("token-forget").hidden = !has;
}

document.addEventListener("click", (e) => {
  const button = e.target.closest("button[data-action]");
  if (button && ui.job) ask(button.dataset.action, button.dataset.worker);
});
$("action-cancel").onclick = () => { ui.pending = null; $("action-dialog").close(); };
$("action-form").addEventListener("submit", (e) => {
  e.preventDefault();
  const action = ui.pending;
  ui.pending = null;
  $("action-dialog").close();
  const token = $("action-token").value.trim();
  if (action && action.read) {
    if (token) sessionStorage.setItem(TOKEN_KEY, token);
    renderTokenState();
    connect();
  } else if (action) {
    perform(action, token);
  }
});
$("token-forget").onclick = () => { sessionStorage.removeItem(TOKEN_KEY); renderTokenState(); };
$("members-scroll").addEventListener("scroll", renderMemberWindow, { passive: true });
$("grid").addEventListener("mousemove", gridHover);
$("grid").addEventListener("mouseleave", () => { $("grid-tip").hidden = true; });
window.addEventListener("hashchange", () => {
  const name = decodeURIComponent((location.hash.match(/job=([^&]+)/) || [])[1] || "");
  if (name && name !== ui.job) selectJob(name);
});
renderTokenState();
connect();
