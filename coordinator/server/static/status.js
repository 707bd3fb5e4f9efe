"use strict";
const POLL_MS = 1000;
// Beside this page, without the user:password@ a person may have typed (fetch refuses URLs with
// credentials; the browser sends the ones it logged in with by itself, same origin and realm).
const STATUS_URL = new URL("api/status", location.href);
STATUS_URL.username = STATUS_URL.password = "";

function el(tag, text, cls) {
  const node = document.createElement(tag);
  if (text !== undefined && text !== null) node.textContent = String(text);
  if (cls) node.className = cls;
  return node;
}

function cell(row, content, cls) {
  const td = el("td", undefined, cls);
  if (content instanceof Node) td.appendChild(content);
  else if (content !== undefined && content !== null) td.textContent = String(content);
  row.appendChild(td);
  return td;
}

function pill(state) {
  return el("span", state, "pill " + String(state).replace(/[^a-z]/g, ""));
}

function isNum(v) { return typeof v === "number" && isFinite(v); }

function seconds(s) {
  if (!isNum(s)) return "";
  if (s < 60) return s.toFixed(1) + " s";
  const m = Math.floor(s / 60);
  if (m < 60) return m + " min " + Math.round(s - 60 * m) + " s";
  return Math.floor(m / 60) + " h " + (m % 60) + " min";
}

function bytes(n) {
  return isNum(n) && n > 0 ? (n / 2 ** 30).toFixed(1) + " GiB" : "";
}

// The training device as `somatize status` says it (somatize/cli.py device_text).
function deviceText(caps) {
  const parts = [caps.device ? String(caps.device) : "cpu"];
  if (caps.device_name) parts.push(String(caps.device_name));
  const memory = bytes(caps.device_memory_bytes);
  if (memory) parts.push(memory);
  return parts.join(" ");
}

// A worker's datasets as `somatize status` says them (somatize/tables.py datasets_text).
function datasetsText(datasets) {
  if (!datasets || typeof datasets !== "object") return "";
  return Object.keys(datasets).sort().map((name) => {
    const d = datasets[name] || {};
    const words = [name, String(d.rows != null ? d.rows : "?")];
    if (d.x) {
      const trailing = (d.x.shape || []).slice(1).join(" × ");
      words.push((trailing + " " + (d.x.dtype || "")).trim());
    }
    if (d.y) words.push("→ " + (d.y.dtype || ""));
    if (d.kind === "shards") words.push("(" + d.shards + " shards)");
    return words.filter((w) => w).join(" ");
  }).join(", ");
}

// Where a job stands, in the words of `somatize jobs` (somatize/progress.py, the position):
// `epoch 1/2 · step 40/66` (the step within its epoch), `round 3/10`, else its phase.
function progressText(p) {
  const parts = [];
  const perEpoch = isNum(p.steps) && isNum(p.epochs) && p.epochs > 0 && p.steps % p.epochs === 0
    ? p.steps / p.epochs : null;
  if (p.epoch != null) parts.push("epoch " + p.epoch + (p.epochs ? "/" + p.epochs : ""));
  if (p.round != null) parts.push("round " + p.round + (p.rounds ? "/" + p.rounds : ""));
  if (p.step != null) {
    if (perEpoch && isNum(p.epoch)) {
      parts.push("step " + (p.step - (p.epoch - 1) * perEpoch) + "/" + perEpoch);
    } else {
      parts.push("step " + p.step + (p.steps ? "/" + p.steps : ""));
    }
  }
  if (!parts.length && p.phase) parts.push(String(p.phase));
  // The last epoch's (round's) figures: validation loss, metrics, learning rate.
  for (const [k, v] of Object.entries(p.metrics || {})) {
    if (k !== "epoch" && k !== "round" && k !== "loss" && isNum(v)) {
      parts.push(k + " " + (k === "lr" ? v.toPrecision(3) : v.toFixed(4)));
    }
  }
  return parts.join(" \u00b7 ");
}

// A job's progress cell: where it stands; for a job that failed or was cancelled, that it did
// and where (`failed at epoch 1/3 · step 4/7`, `failed while loading`), never a bare phase.
function jobProgressText(p, state) {
  if (state !== "failed" && state !== "cancelled") return progressText(p);
  const placed = p.epoch != null || p.round != null || p.step != null;
  if (placed) return state + " at " + progressText(p);
  return p.phase ? state + " while " + p.phase : state;
}

// Where a queued job stands and why it waits, as `somatize jobs` says it (somatize/tables.py
// wait_text): `#2 share: 1 of clients further under their share first · starts in ~40s`.
function waitText(w) {
  let text = "#" + w.position + " " + w.reason + ": " + w.detail;
  if (typeof w.starts_in === "number") text += " \u00b7 starts in ~" + Math.round(w.starts_in) + "s";
  return text;
}

function fraction(p, state) {
  if (state === "succeeded") return 1;
  for (const [done, total] of [["step", "steps"], ["round", "rounds"], ["epoch", "epochs"]]) {
    if (isNum(p[done]) && isNum(p[total]) && p[total] > 0) return Math.min(p[done] / p[total], 1);
  }
  return null;
}

function duration(job, now) {
  if (isNum(job.started)) return seconds((isNum(job.finished) ? job.finished : now) - job.started);
  if (isNum(job.created) && !isNum(job.finished)) return "waiting " + seconds(now - job.created);
  return "";
}

function card(value, label) {
  const div = el("div", undefined, "card");
  div.appendChild(el("b", value));
  div.appendChild(el("span", label));
  return div;
}

function count(list, key, value) { return list.filter((x) => x[key] === value).length; }

function renderCards(status) {
  const w = status.workers, j = status.jobs;
  const connected = count(w, "state", "idle") + count(w, "state", "busy");
  document.getElementById("cards").replaceChildren(
    card(connected, "workers connected"),
    card(count(w, "state", "busy"), "workers busy"),
    card(count(j, "state", "running"), "jobs running"),
    card(count(j, "state", "queued"), "jobs queued"),
    card(count(j, "state", "succeeded"), "jobs succeeded"),
    card(count(j, "state", "failed"), "jobs failed"),
  );
}

function renderWorkers(workers) {
  const rows = workers.map((w) => {
    const tr = el("tr");
    tr.dataset.worker = w.id;
    cell(tr, w.id, "id");
    const tags = el("span");
    for (const t of w.tags || []) tags.appendChild(el("span", t, "tag"));
    if (!(w.tags || []).length) tags.appendChild(el("span", "\u2014", "muted"));
    cell(tr, tags);
    const state = cell(tr, pill(w.state));
    if (w.reason && w.state !== "idle" && w.state !== "busy") {
      state.appendChild(el("div", w.reason, "muted"));
    }
    cell(tr, isNum(w.last_heartbeat_age) ? seconds(w.last_heartbeat_age) + " ago" : "", "num");
    cell(tr, w.job_id || "\u2014", w.job_id ? "id" : "muted");
    const caps = w.capabilities || {};
    cell(tr, caps.cpus, "num");
    cell(tr, bytes(caps.memory_bytes), "num");
    cell(tr, deviceText(caps));
    cell(tr, datasetsText(w.datasets));
    return tr;
  });
  document.querySelector("#workers tbody").replaceChildren(...rows);
  document.getElementById("workers-empty").hidden = rows.length > 0;
  document.getElementById("workers-count").textContent = rows.length ? "(" + rows.length + ")" : "";
}

function renderJobs(jobs, now) {
  const rows = jobs.map((job) => {
    const p = job.progress || {};
    const tr = el("tr");
    tr.dataset.job = job.id;
    if (job.id === openJob) tr.className = "open";
    tr.addEventListener("click", () => { location.hash = "job=" + encodeURIComponent(job.id); });
    const id = cell(tr, job.id, "id");
    const summary = job.summary || {};
    if (summary.name) id.appendChild(el("span", summary.name, "name"));
    cell(tr, job.strategy);
    cell(tr, pill(job.state));
    const prog = cell(tr, job.wait ? waitText(job.wait) : jobProgressText(p, job.state), "wrap progress");
    const f = fraction(p, job.state);
    if (f !== null) {
      const bar = el("div", undefined, job.state === "succeeded" ? "bar done" : "bar");
      const fill = el("i");
      fill.style.width = (100 * f).toFixed(1) + "%";
      bar.appendChild(fill);
      prog.appendChild(bar);
    }
    cell(tr, isNum(p.loss) ? p.loss.toPrecision(4) : "", "num");
    cell(tr, (job.workers || []).join(", "), "wrap");
    cell(tr, clockTime(job.created), "num");
    cell(tr, duration(job, now), "num");
    const err = cell(tr, undefined, "wrap clamp error");
    if (job.error) {
      const text = el("div");
      text.appendChild(el("code", job.error.code));
      text.appendChild(document.createTextNode(job.error.message || ""));
      err.appendChild(text);
    }
    return tr;
  });
  document.querySelector("#jobs tbody").replaceChildren(...rows);
  document.getElementById("jobs-empty").hidden = rows.length > 0;
  document.getElementById("jobs-count").textContent =
    rows.length ? "(latest " + rows.length + ")" : "";
}

function connection(ok, text) {
  document.getElementById("dot").className = ok ? "live" : "down";
  document.getElementById("conn-text").textContent = text;
}

async function poll() {
  try {
    const response = await fetch(STATUS_URL, { cache: "no-store" });
    if (!response.ok) throw new Error("HTTP " + response.status);
    const status = await response.json();
    renderCards(status);
    renderWorkers(status.workers);
    renderJobs(status.jobs, status.time);
    await refreshJob(status.time);
    connection(true, "live");
    document.getElementById("footer").textContent =
      (status.server || "") + " \u00b7 updated " + new Date().toLocaleTimeString();
  } catch (exc) {
    connection(false, "unreachable (" + exc.message + "), retrying");
  } finally {
    setTimeout(poll, POLL_MS);
  }
}

// -- the job view --------------------------------------------------------------------------
let openJob = null;  // the id in #job=ID, or null
let armedUntil = 0;  // the cancel button asks before it cancels

function jobInHash() {
  const m = /^#job=(.+)$/.exec(location.hash);
  return m ? decodeURIComponent(m[1]) : null;
}

function clockTime(t) {
  return isNum(t) ? new Date(t * 1000).toLocaleTimeString() : "";
}

function fmt4(v) { return String(Number(v.toPrecision(4))); }  // Python's {:.4g}, mostly
function grouped(n) { return Number(n).toLocaleString("en-US"); }

// One progress event in the words of somatize/progress.py event_text.
function progressEventText(d) {
  const SEP = " \u00b7 ";
  if (d.phase === "training" && Number.isInteger(d.step)) {
    const parts = [progressText(d)];
    if (isNum(d.loss)) parts.push("loss " + fmt4(d.loss) + " (last step)");
    return parts.join(SEP);
  }
  if (d.phase === "round") {
    const parts = ["round " + d.round + (d.rounds ? "/" + d.rounds : "")];
    if (isNum(d.loss)) {
      const among = Array.isArray(d.workers) ? "mean of " + d.workers.length + " workers" : "mean";
      parts.push("loss " + fmt4(d.loss) + " (" + among + ")");
    }
    const dropped = d.dropped && typeof d.dropped === "object" ? Object.keys(d.dropped) : [];
    if (dropped.length) parts.push("dropped " + dropped.join(", "));
    if (Number.isInteger(d.rows)) parts.push(grouped(d.rows) + " rows");
    return parts.join(SEP);
  }
  if (d.phase === "trained") return trainedText(d);
  if (d.phase === "epoch" && Number.isInteger(d.epoch)) {
    const loss = isNum(d.loss) ? SEP + "loss " + fmt4(d.loss) + " (epoch mean)" : "";
    const said = "epoch " + d.epoch + loss;
    return [said, ...figures(d)].join(SEP);
  }
  return phaseText(d);
}

// A history row's validation figures (somatize/progress.py _figures).
const NOT_FIGURES = new Set(["phase", "epoch", "epochs", "round", "rounds", "loss", "lr",
  "step", "steps", "rows"]);
function figures(row) {
  return Object.keys(row || {})
    .filter((k) => !NOT_FIGURES.has(k) && isNum(row[k]))
    .map((k) => k + " " + fmt4(row[k]));
}

// A run's last event (somatize/progress.py _trained_text).
function trainedText(d) {
  const SEP = " \u00b7 ";
  const rows = Array.isArray(d.history) ? d.history : [];
  const last = rows.length && rows[rows.length - 1] && typeof rows[rows.length - 1] === "object"
    ? rows[rows.length - 1] : {};
  const l = d.epoch_losses;
  const loss = Array.isArray(l) && l.length ? l[l.length - 1] : last.loss;
  let parts, unit = "epoch";
  if (Number.isInteger(d.step)) {
    parts = [progressText({ epoch: d.epoch, epochs: d.epochs, step: d.step, steps: d.steps })];
  } else if (Number.isInteger(d.round)) {
    parts = ["round " + d.round + (d.rounds ? "/" + d.rounds : "")];
    unit = "round";
  } else {
    parts = ["trained" + (d.epochs ? " " + d.epochs + " epochs" : "")];
  }
  if (isNum(loss)) parts.push("loss " + fmt4(loss) + " (last " + unit + " mean)");
  return [...parts, ...figures(last)].join(SEP);
}

// What a job does before and after its steps (somatize/progress.py _phase_text).
function phaseText(d) {
  const SEP = " \u00b7 ";
  if (d.phase === "loading") {
    for (const key of ["replicas", "stages", "nodes"]) {
      if (Number.isInteger(d[key])) return "loading the filters (" + d[key] + " " + key + ")";
    }
    if (Array.isArray(d.workers)) return "loading the filters on " + d.workers.length + " workers";
    return "loading the filters";
  }
  if (d.phase === "fitting") {
    const nodes = Array.isArray(d.nodes) ? d.nodes.map((n) => "'" + n + "'").join(", ") : "";
    return "fitting the plain filters" + (nodes ? " [" + nodes + "]" : "");
  }
  if (d.phase === "staged" && d.rows && typeof d.rows === "object") {
    const counts = Object.values(d.rows).map(Number);
    const total = grouped(counts.reduce((a, b) => a + b, 0));
    return "staged " + total + " rows on " + counts.length + " workers";
  }
  if (d.phase === "linked") return "stages linked (" + (d.transport || "?") + ")";
  if (d.phase === "sharded") return "model sharded (" + (d.sharding || "?") + ")";
  if (d.phase === "training") {
    const on = Number.isInteger(d.rows) ? " on " + grouped(d.rows) + " rows" : "";
    return "training" + on + " (one worker runs the whole loop: its loss comes at the end)";
  }
  const shown = Object.keys(d)
    .filter((k) => k !== "phase" && (typeof d[k] === "string" || typeof d[k] === "number"))
    .map((k) => k + " " + d[k]);
  return [d.phase, ...shown].filter((p) => p).join(SEP);
}

// A URL of this coordinator's API, without the credentials a person may have typed.
function apiUrl(path) {
  const url = new URL(path, location.href);
  url.username = url.password = url.hash = "";
  return url;
}

// somatize/tables.py placed_text and queued_text.
function placedText(d) {
  let workers = (d.workers || []).map(String);
  if (Array.isArray(d.devices) && d.devices.length === workers.length) {
    workers = workers.map((w, i) => w + " (" + d.devices[i] + ")");
  }
  let text = "placed on " + (workers.join(", ") || "?");
  if (d.collective === "torch") {
    text += "; gradients by torch.distributed (" + (d.backend || "?") + ")";
  } else if (d.collective === "coordinator") {
    text += "; gradients through the coordinator: " + (d.collective_reason || "");
  }
  return text;
}

function queuedText(d) {
  const text = d.placement ? "queued: waiting for " + d.placement : "queued";
  return text + (isNum(d.wait_for_workers) ? " (at most " + d.wait_for_workers + " s)" : "");
}

function eventText(e) {
  const d = e.data || {};
  if (e.event === "queued") return queuedText(d);
  if (e.event === "placed") return placedText(d);
  if (e.event === "progress") return progressEventText(d);
  if (e.event === "failed" || e.event === "cancelled") {
    return "[" + d.code + "] " + (d.message || "");
  }
  if (e.event === "succeeded") return "nodes " + (d.nodes || []).join(", ");
  const said = Object.keys(d).filter((k) => typeof d[k] !== "object");
  return said.map((k) => k + " " + d[k]).join(" \u00b7 ");
}

// The points somatize result --plot draws (somatize/cli.py loss_curve) and what x counts.
function lossCurve(events) {
  const points = [];
  let unit = "epoch";
  for (const e of events) {
    const d = e.data || {};
    if (e.event !== "progress") continue;
    if (d.phase === "round") unit = "round";
    else if (Number.isInteger(d.step) && unit !== "round") unit = "step";
    if (Array.isArray(d.losses) && Number.isInteger(d.step)) {
      const first = d.step - d.losses.length + 1;
      d.losses.forEach((v, i) => points.push([first + i, v]));
    } else if (isNum(d.loss) && d.phase !== "trained" && d.phase !== "epoch") {
      points.push([d.step || d.round || points.length + 1, d.loss]);
    } else if (Array.isArray(d.epoch_losses)) {
      d.epoch_losses.forEach((v, i) => points.push([i + 1, v]));
    }
  }
  return { points: points.filter((p) => isNum(p[0]) && isNum(p[1])), unit };
}

function svg(tag, attrs, text) {
  // The curve's <svg> is in SVG's namespace already (the HTML parser puts it there).
  const node = document.createElementNS(document.getElementById("job-curve").namespaceURI, tag);
  for (const [k, v] of Object.entries(attrs)) node.setAttribute(k, String(v));
  if (text !== undefined) node.textContent = String(text);
  return node;
}

function drawCurve(events) {
  const box = document.getElementById("job-curve");
  const { points, unit } = lossCurve(events);
  box.hidden = points.length < 2;
  box.dataset.points = String(points.length);
  box.dataset.unit = unit;
  if (box.hidden) return box.replaceChildren();
  // As wide as it is shown (its text unstretched), in CSS pixels.
  const W = Math.max(box.clientWidth, 320), H = 220, L = 56, R = 28, T = 12, B = 30;
  box.setAttribute("viewBox", "0 0 " + W + " " + H);
  const xs = points.map((p) => p[0]), ys = points.map((p) => p[1]);
  const x0 = Math.min(...xs), x1 = Math.max(...xs), y0 = Math.min(...ys), y1 = Math.max(...ys);
  const sx = (x) => L + (x1 > x0 ? (x - x0) / (x1 - x0) : 0.5) * (W - L - R);
  const sy = (y) => T + (y1 > y0 ? (y1 - y) / (y1 - y0) : 0.5) * (H - T - B);
  const line = points.map((p) => sx(p[0]).toFixed(1) + "," + sy(p[1]).toFixed(1)).join(" ");
  box.replaceChildren(
    svg("line", { x1: L, y1: H - B, x2: W - R, y2: H - B, stroke: "#e4e7ec" }),
    svg("line", { x1: L, y1: T, x2: L, y2: H - B, stroke: "#e4e7ec" }),
    svg("polyline", { points: line, fill: "none", stroke: "#3257d6", "stroke-width": 1.5 }),
    svg("text", { x: L - 6, y: T + 10, "text-anchor": "end" }, fmt4(y1)),
    svg("text", { x: L - 6, y: H - B, "text-anchor": "end" }, fmt4(y0)),
    svg("text", { x: L, y: H - 8 }, unit + " " + x0),  // whole numbers: steps, rounds, epochs
    svg("text", { x: W - R, y: H - 8, "text-anchor": "end" }, unit + " " + x1),
    svg("text", { x: (L + W) / 2, y: H - 8, "text-anchor": "middle" }, "loss by " + unit),
  );
}

function renderJob(view, now) {
  const job = view.record, events = view.events || [], summary = job.summary || {};
  document.getElementById("job-title").textContent =
    "Job " + job.id + (summary.name ? " \u00b7 " + summary.name : "");
  const facts = [
    ["State", pill(job.state)], ["Strategy", job.strategy], ["File", summary.file || "\u2014"],
    ["Submitted", clockTime(job.created)], ["Duration", duration(job, now || Date.now() / 1000)],
    ["Workers", (job.workers || []).join(", ") || "\u2014"], ["Asked for", summary.placement || ""],
  ];
  document.getElementById("job-facts").replaceChildren(...facts.map(([k, v]) => {
    const pair = el("div"), dd = el("dd");
    if (v instanceof Node) dd.appendChild(v); else dd.textContent = String(v);
    pair.append(el("dt", k), dd);
    return pair;
  }));
  const error = document.getElementById("job-error");
  error.hidden = !job.error;
  if (job.error) {
    const message = document.createTextNode(" " + (job.error.message || ""));
    error.replaceChildren(el("code", job.error.code), message);
    const trace = (job.error.detail || {}).traceback;
    if (trace) error.appendChild(el("pre", trace));
  }
  drawCurve(events);
  const start = isNum(job.created) ? job.created : (events[0] || {}).time;
  const rows = events.map((e) => {
    const tr = el("tr");
    cell(tr, "+" + seconds(e.time - start), "num");
    cell(tr, e.event);
    cell(tr, eventText(e), "what");
    return tr;
  });
  if (view.dropped) {
    const tr = el("tr");
    cell(tr, "");
    cell(tr, "\u2026");
    cell(tr, view.dropped + " earlier events not shown", "what muted");
    rows.unshift(tr);
  }
  document.querySelector("#job-events tbody").replaceChildren(...rows);
  const live = job.state === "queued" || job.state === "running";
  const cancel = document.getElementById("job-cancel");
  cancel.hidden = !live;
  if (Date.now() > armedUntil) { cancel.className = ""; cancel.textContent = "Cancel job"; }
}

async function refreshJob(now) {
  const wanted = jobInHash();
  const view = document.getElementById("job-view");
  if (wanted !== openJob) { openJob = wanted; armedUntil = 0; }
  view.hidden = openJob === null;
  if (openJob === null) return;
  const title = document.getElementById("job-title");
  try {
    const url = apiUrl("api/jobs/" + encodeURIComponent(openJob));
    const response = await fetch(url, { cache: "no-store" });
    const json = response.headers.get("Content-Type") === "application/json";
    const body = json ? await response.json() : {};
    if (!response.ok) {
      const why = (body.error || {}).message || "HTTP " + response.status;
      title.textContent = "Job " + openJob + ": " + why;
      return;
    }
    if (jobInHash() === openJob) renderJob(body, now);
  } catch (exc) {
    title.textContent = "Job " + openJob + ": " + exc.message;
  }
}

document.getElementById("job-close").addEventListener("click", () => {
  history.replaceState(null, "", location.pathname + location.search);
  refreshJob(null);
});

document.getElementById("job-cancel").addEventListener("click", async () => {
  const button = document.getElementById("job-cancel");
  if (Date.now() > armedUntil) {  // the first click asks
    armedUntil = Date.now() + 5000;
    button.className = "armed";
    button.textContent = "Click again to cancel";
    return;
  }
  armedUntil = 0;
  button.disabled = true;
  button.textContent = "Cancelling\u2026";
  try {
    const url = apiUrl("api/jobs/" + encodeURIComponent(openJob) + "/cancel");
    await fetch(url, { cache: "no-store", headers: { "X-Requested-By": "somatize-status-page" } });
  } finally {
    button.disabled = false;
    await refreshJob(null);
  }
});

window.addEventListener("hashchange", () => refreshJob(null));
poll();
