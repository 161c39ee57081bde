"""The page at ``/``: one self-contained HTML document (inline CSS and JavaScript, no external asset: a
hub may be air-gapped) that fetches ``api/v1/clusters`` every few seconds and redraws the table.

Every text that comes from outside (cluster names, agent ids, error messages, which an agent or a
target can choose) is put in the page with ``textContent`` or ``setAttribute``, never parsed as HTML;
the Content-Security-Policy allows only this page's own script and style (by hash) and requests to
this origin, so even a mistake could not run injected script.
"""

from __future__ import annotations

import base64
import hashlib

__all__ = ["PAGE_HEADERS", "page_html"]

STYLE = """
:root { --ok: #1a7f37; --bad: #cf222e; --unknown: #9a6700; --ink: #1f2328; --muted: #656d76; }
* { box-sizing: border-box; }
body { font: 14px/1.4 system-ui, -apple-system, "Segoe UI", sans-serif; margin: 0; color: var(--ink);
       background: #f6f8fa; }
header { display: flex; align-items: baseline; gap: 1.5em; padding: 12px 20px; background: #fff;
         border-bottom: 1px solid #d0d7de; }
h1 { font-size: 18px; margin: 0; }
#summary span { margin-right: 1em; }
#updated { color: var(--muted); margin-left: auto; }
#banners { padding: 0 20px; }
.banner { margin: 10px 0 0; padding: 8px 12px; border-radius: 6px; background: #ffebe9;
          border: 1px solid var(--bad); color: #82071e; }
main { padding: 12px 20px 24px; }
table { border-collapse: collapse; width: 100%; background: #fff; border: 1px solid #d0d7de; }
th, td { text-align: left; padding: 6px 10px; border-bottom: 1px solid #eaeef2; vertical-align: middle; }
th { background: #f6f8fa; font-weight: 600; white-space: nowrap; }
tr.healthy td.cluster { border-left: 6px solid var(--ok); }
tr.unhealthy { background: #ffebe9; }
tr.unhealthy td.cluster { border-left: 6px solid var(--bad); }
tr.unknown { background: #fff8c5; }
tr.unknown td.cluster { border-left: 6px solid var(--unknown); }
td.cluster { font-weight: 600; }
.yes { color: var(--ok); font-weight: 600; }
.no { color: var(--bad); font-weight: 600; }
.maybe { color: var(--unknown); }
td.latency { font-variant-numeric: tabular-nums; white-space: nowrap; }
td.error { color: #82071e; max-width: 40em; overflow-wrap: anywhere; }
td.error small { color: var(--muted); display: block; }
td.agents { color: var(--muted); white-space: nowrap; }
svg.spark { display: block; }
svg.spark polyline { fill: none; stroke: #0969da; stroke-width: 1.5; }
svg.spark line.fail { stroke: var(--bad); stroke-width: 2; }
#empty { color: var(--muted); padding: 16px; }
"""

SCRIPT = """
"use strict";
const API = "api/v1/clusters";
let refreshMs = 2000;

function el(tag, attrs, text) {
  const node = document.createElement(tag);
  for (const [name, value] of Object.entries(attrs || {})) node.setAttribute(name, String(value));
  if (text !== undefined && text !== null) node.textContent = String(text);
  return node;
}

function word(value) {
  if (value === true) return el("span", {class: "yes"}, "True");
  if (value === false) return el("span", {class: "no"}, "False");
  return el("span", {class: "maybe"}, "Unknown");
}

function latency(ms) {
  if (typeof ms !== "number") return "-";
  return ms >= 1000 ? (ms / 1000).toFixed(2) + "s" : ms.toFixed(2) + "ms";
}

function sparkline(history) {
  const NS = "http://www.w3.org/2000/svg";
  const width = 160, height = 28, pad = 2;
  const svg = document.createElementNS(NS, "svg");
  svg.setAttribute("class", "spark");
  svg.setAttribute("width", width);
  svg.setAttribute("height", height);
  svg.setAttribute("viewBox", `0 0 ${width} ${height}`);
  const points = Array.isArray(history) ? history : [];
  const values = points.map(p => (Array.isArray(p) && typeof p[1] === "number" ? p[1] : null));
  const top = Math.max(1, ...values.filter(v => v !== null));
  const step = points.length > 1 ? (width - 2 * pad) / (points.length - 1) : 0;
  let line = [];
  const flush = () => {
    if (line.length) {
      const poly = document.createElementNS(NS, "polyline");
      poly.setAttribute("points", line.join(" "));
      svg.appendChild(poly);
    }
    line = [];
  };
  values.forEach((v, i) => {
    const x = (pad + i * step).toFixed(1);
    if (v === null) {
      flush();
      const mark = document.createElementNS(NS, "line");
      mark.setAttribute("class", "fail");
      mark.setAttribute("x1", x); mark.setAttribute("x2", x);
      mark.setAttribute("y1", pad); mark.setAttribute("y2", height - pad);
      svg.appendChild(mark);
    } else {
      line.push(x + "," + (height - pad - (v / top) * (height - 2 * pad)).toFixed(1));
    }
  });
  flush();
  const title = document.createElementNS(NS, "title");
  title.textContent = `last ${points.length} probes, peak ${latency(top)}`;
  svg.appendChild(title);
  return svg;
}

function agentsText(agents) {
  if (!Array.isArray(agents) || agents.length === 0) return "none";
  return agents.map(a => `${a.agent_id} (${(a.replicas || []).length} replica${(a.replicas || []).length === 1 ? "" : "s"})`).join(", ");
}

function row(cluster) {
  const tr = el("tr", {"data-cluster": cluster.name, "data-state": cluster.state, class: cluster.state});
  tr.appendChild(el("td", {class: "cluster"}, cluster.name));
  for (const key of ["installed", "available", "probed"]) {
    const td = el("td", {class: key});
    td.appendChild(word(cluster[key]));
    tr.appendChild(td);
  }
  tr.appendChild(el("td", {class: "latency"}, latency(cluster.latency_ms)));
  const chart = el("td", {class: "history"});
  chart.appendChild(sparkline(cluster.history));
  tr.appendChild(chart);
  tr.appendChild(el("td", {class: "agents"}, agentsText(cluster.agents)));
  const error = el("td", {class: "error"});
  if (cluster.last_error && cluster.state !== "healthy") {
    error.appendChild(document.createTextNode(cluster.last_error.message));
    error.appendChild(el("small", {}, "at " + cluster.last_error.at));
  } else if (cluster.addon && cluster.addon.available !== true && cluster.addon.message) {
    error.appendChild(document.createTextNode(cluster.addon.message));
  }
  tr.appendChild(error);
  return tr;
}

function banners(doc, fetchError) {
  const box = document.getElementById("banners");
  box.replaceChildren();
  const messages = fetchError ? ["the collector does not answer: " + fetchError] : (doc.problems || []);
  for (const message of messages) box.appendChild(el("div", {class: "banner", role: "alert"}, message));
}

function render(doc) {
  const body = document.getElementById("rows");
  body.replaceChildren(...(doc.clusters || []).map(row));
  document.getElementById("empty").hidden = (doc.clusters || []).length > 0;
  const s = doc.summary || {};
  const summary = document.getElementById("summary");
  summary.replaceChildren(
    el("span", {class: "yes"}, `${s.healthy || 0} healthy`),
    el("span", {class: "no"}, `${s.unhealthy || 0} unhealthy`),
    el("span", {class: "maybe"}, `${s.unknown || 0} unknown`));
  document.getElementById("updated").textContent =
    `probe ${doc.probe ? doc.probe.url : "?"} every ${doc.interval_seconds}s; last round ${doc.last_round_at || "pending"}`;
  banners(doc, null);
  if (typeof doc.interval_seconds === "number") refreshMs = Math.min(5000, Math.max(1000, doc.interval_seconds * 1000));
}

async function refresh() {
  try {
    const answer = await fetch(API, {cache: "no-store"});
    if (!answer.ok) throw new Error("HTTP " + answer.status);
    render(await answer.json());
    document.body.dataset.loaded = "true";
  } catch (error) {
    banners(null, String(error && error.message || error));
  }
  setTimeout(refresh, refreshMs);
}

refresh();
"""

BODY = """<!doctype html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>cluster-proxy health</title>
<link rel="icon" href="data:,">
<style>{style}</style>
</head>
<body>
<header><h1>cluster-proxy health</h1><div id="summary"></div><div id="updated">loading</div></header>
<div id="banners"></div>
<main>
<table>
<thead><tr><th>Cluster</th><th>Installed</th><th>Available</th><th>Probed health</th><th>Latency</th>
<th>Latency history</th><th>Agents</th><th>Last error</th></tr></thead>
<tbody id="rows"></tbody>
</table>
<div id="empty" hidden>No cluster known yet: no proxy-server answered with one.</div>
</main>
<script>{script}</script>
</body>
</html>
"""


def _hash(text: str) -> str:
    return "'sha256-" + base64.b64encode(hashlib.sha256(text.encode()).digest()).decode() + "'"


def page_html() -> bytes:
    return BODY.replace("{style}", STYLE).replace("{script}", SCRIPT).encode()


PAGE_HEADERS = (
    (
        "content-security-policy",
        f"default-src 'none'; script-src {_hash(SCRIPT)}; style-src {_hash(STYLE)}; connect-src 'self'; "
        "img-src 'self' data:; base-uri 'none'; form-action 'none'; frame-ancestors 'none'",
    ),
    ("x-content-type-options", "nosniff"),
    ("referrer-policy", "no-referrer"),
)
