"""The coordinator's live status page, served at ``GET /``.

One self-contained HTML document: inline CSS and a little vanilla JavaScript, nothing fetched from
anywhere but the coordinator itself (the :data:`CSP` header forbids it), so it works on a network
with no way out. The script polls ``GET /api/status`` — the same snapshot ``somatize status``
shows, see :meth:`coordinator.server.app.Coordinator.status` — every :data:`POLL_MS` milliseconds
and redraws the workers and jobs tables; a job's row opens its view (:mod:`~coordinator.
status_page_job`: its events, error, loss curve and cancel button). Every value from a worker or
a job (ids, tags, error messages) goes into the page as text (``textContent``), never as markup.
Long values wrap: nothing scrolls sideways on a screen 1,400 pixels wide.

A browser that was asked for a password by the page's ``401`` (HTTP Basic, the client token as
password) sends the same credentials with its ``fetch`` calls: same origin, same realm.
"""

from __future__ import annotations

from coordinator.server.status_page_job import JOB_CSS, JOB_HTML, JOB_JS

POLL_MS = 1000
"""How often the page asks for a new snapshot."""

CSP = (
    "default-src 'none'; style-src 'unsafe-inline'; script-src 'unsafe-inline'; "
    "connect-src 'self'; img-src data:; base-uri 'none'; form-action 'none'; "
    "frame-ancestors 'none'"
)
"""The page's Content-Security-Policy: its own inline style and script, requests to its origin."""

PAGE = """<!doctype html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>somatize coordinator</title>
<link rel="icon" href="data:,">
<style>
  :root {
    --bg: #f5f6f8; --panel: #fff; --ink: #1d2330; --muted: #6b7280; --line: #e4e7ec;
    --accent: #3257d6; --ok: #1b7f4b; --ok-bg: #e3f4ea; --bad: #b42318; --bad-bg: #fdecea;
    --warn: #9a6700; --warn-bg: #fff4d6; --run: #1d4ed8; --run-bg: #e4ecff;
    --idle: #475467; --idle-bg: #eef0f3;
  }
  * { box-sizing: border-box; }
  body {
    margin: 0; background: var(--bg); color: var(--ink);
    font: 14px/1.45 system-ui, -apple-system, "Segoe UI", Roboto, "DejaVu Sans", sans-serif;
  }
  header {
    display: flex; align-items: center; gap: 12px; padding: 14px 28px;
    background: #161b26; color: #fff;
  }
  header h1 { margin: 0; font-size: 18px; font-weight: 600; letter-spacing: .2px; }
  header h1 span { color: #9aa4b8; font-weight: 400; }
  #conn { margin-left: auto; display: flex; align-items: center; gap: 8px; color: #c9d0dc; }
  #dot { width: 9px; height: 9px; border-radius: 50%; background: #9aa4b8; }
  #dot.live { background: #3ccf7e; box-shadow: 0 0 0 3px rgba(60, 207, 126, .25); }
  #dot.down { background: #f0584a; }
  main { max-width: 1280px; margin: 0 auto; padding: 22px 28px 40px; }
  .cards { display: grid; grid-template-columns: repeat(auto-fit, minmax(150px, 1fr)); gap: 12px; }
  .card {
    background: var(--panel); border: 1px solid var(--line); border-radius: 10px;
    padding: 12px 16px;
  }
  .card b { display: block; font-size: 24px; font-weight: 600; }
  .card span {
    color: var(--muted); font-size: 12px; text-transform: uppercase; letter-spacing: .5px;
  }
  section.panel {
    margin-top: 20px; background: var(--panel); border: 1px solid var(--line);
    border-radius: 10px; overflow: hidden;
  }
  section.panel h2 {
    margin: 0; padding: 12px 16px; font-size: 15px; font-weight: 600;
    border-bottom: 1px solid var(--line);
  }
  section.panel h2 small { color: var(--muted); font-weight: 400; margin-left: 6px; }
  .scroll { overflow-x: auto; }
  #jobs tbody tr { cursor: pointer; }
  #jobs tbody tr:hover td, #jobs tbody tr.open td { background: #f3f6ff; }
  table { width: 100%; border-collapse: collapse; }
  th, td { padding: 9px 16px; text-align: left; vertical-align: baseline; white-space: nowrap; }
  th {
    font-size: 12px; font-weight: 600; color: var(--muted); text-transform: uppercase;
    letter-spacing: .4px; background: #fafbfc; border-bottom: 1px solid var(--line);
  }
  tbody tr + tr td { border-top: 1px solid var(--line); }
  td.num { font-variant-numeric: tabular-nums; }
  td.id { font-family: ui-monospace, "DejaVu Sans Mono", Menlo, monospace; font-size: 13px; }
  td.wrap { white-space: normal; overflow-wrap: anywhere; min-width: 120px; max-width: 360px; }
  td.progress { min-width: 190px; }
  td.clamp div {
    display: -webkit-box; -webkit-line-clamp: 2; -webkit-box-orient: vertical; overflow: hidden;
  }
  td .name { display: block; color: var(--muted); font-family: inherit; font-size: 12px; }
  .muted { color: var(--muted); }
  .empty { padding: 16px; color: var(--muted); }
  .tag {
    display: inline-block; margin: 0 4px 2px 0; padding: 0 7px; border-radius: 4px;
    background: #eef2ff; color: #3b4a8c; font-size: 12px;
  }
  .pill {
    display: inline-block; padding: 1px 9px; border-radius: 999px; font-size: 12px;
    font-weight: 600; background: var(--idle-bg); color: var(--idle);
  }
  .pill.succeeded, .pill.idle { background: var(--ok-bg); color: var(--ok); }
  .pill.failed, .pill.lost { background: var(--bad-bg); color: var(--bad); }
  .pill.running, .pill.busy { background: var(--run-bg); color: var(--run); }
  .pill.queued, .pill.cancelled { background: var(--warn-bg); color: var(--warn); }
  .bar {
    width: 140px; height: 6px; margin-top: 5px; border-radius: 3px; background: var(--line);
    overflow: hidden;
  }
  .bar i { display: block; height: 100%; background: var(--accent); }
  .bar.done i { background: var(--ok); }
  .error { color: var(--bad); }
  .error code { font-weight: 600; margin-right: 6px; }
  footer { margin-top: 18px; color: var(--muted); font-size: 12px; }
__JOB_CSS__
</style>
</head>
<body>
<header>
  <h1>somatize <span>coordinator</span></h1>
  <div id="conn"><i id="dot"></i><span id="conn-text">connecting&hellip;</span></div>
</header>
<main>
  <div class="cards" id="cards"></div>
  <section class="panel">
    <h2>Workers <small id="workers-count"></small></h2>
    <div class="scroll"><table id="workers">
      <thead><tr>
        <th>Worker</th><th>Tags</th><th>State</th><th>Heartbeat</th><th>Job</th>
        <th>CPUs</th><th>Memory</th><th>Device</th><th>Datasets</th>
      </tr></thead>
      <tbody></tbody>
    </table></div>
    <div class="empty" id="workers-empty">No worker has connected yet.</div>
  </section>
  <section class="panel">
    <h2>Jobs <small id="jobs-count"></small></h2>
    <div class="scroll"><table id="jobs">
      <thead><tr>
        <th>Job</th><th>Strategy</th><th>State</th><th>Progress</th><th>Loss</th>
        <th>Workers</th><th>Submitted</th><th>Duration</th><th>Error</th>
      </tr></thead>
      <tbody></tbody>
    </table></div>
    <div class="empty" id="jobs-empty">No job has been submitted yet.</div>
  </section>
__JOB_HTML__
  <footer id="footer"></footer>
</main>
<script>
"use strict";
const POLL_MS = __POLL_MS__;
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
      const trailing = (d.x.shape || []).slice(1).join(" \u00d7 ");
      words.push((trailing + " " + (d.x.dtype || "")).trim());
    }
    if (d.y) words.push("\u2192 " + (d.y.dtype || ""));
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
  return parts.join(" \\u00b7 ");
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
    if (!(w.tags || []).length) tags.appendChild(el("span", "\\u2014", "muted"));
    cell(tr, tags);
    const state = cell(tr, pill(w.state));
    if (w.reason && w.state !== "idle" && w.state !== "busy") {
      state.appendChild(el("div", w.reason, "muted"));
    }
    cell(tr, isNum(w.last_heartbeat_age) ? seconds(w.last_heartbeat_age) + " ago" : "", "num");
    cell(tr, w.job_id || "\\u2014", w.job_id ? "id" : "muted");
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
    const prog = cell(tr, progressText(p), "wrap progress");
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
      (status.server || "") + " \\u00b7 updated " + new Date().toLocaleTimeString();
  } catch (exc) {
    connection(false, "unreachable (" + exc.message + "), retrying");
  } finally {
    setTimeout(poll, POLL_MS);
  }
}
__JOB_JS__
window.addEventListener("hashchange", () => refreshJob(null));
poll();
</script>
</body>
</html>
""".replace("__POLL_MS__", str(POLL_MS))
PAGE = PAGE.replace("__JOB_CSS__", JOB_CSS).replace("__JOB_HTML__", JOB_HTML)
PAGE = PAGE.replace("__JOB_JS__", JOB_JS)
"""The page itself."""

__all__ = ["CSP", "PAGE", "POLL_MS"]
