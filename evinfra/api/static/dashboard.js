// The dashboard: polls /v1/evinfra/dashboard and redraws (plotly.js, served by evinfra from
// the installed plotly package). Times on the page are seconds before the service's "now".
"use strict";

const POLL_MS = 1000;
const LAYOUT = { margin: { l: 52, r: 12, t: 8, b: 72 },
                 legend: { orientation: "h", y: -0.32, yanchor: "top" },
                 xaxis: { title: { text: "seconds before now", standoff: 4 } } };
const CONFIG = { displayModeBar: false, responsive: true, staticPlot: false };

function $(id) { return document.getElementById(id); }

function fmt(x, digits = 3) {
  if (x === null || x === undefined) return "–";
  if (Math.abs(x) >= 1000) return Math.round(x).toLocaleString("en");
  return Number(x.toPrecision(digits)).toString();
}

function secs(x) { return x === null || x === undefined ? "–" : fmt(x) + " s"; }

function ago(t, now) { return fmt(now - t, 2) + " s ago"; }

function set(id, text) { $(id).textContent = text; }

function rows(tbody, data) {
  tbody.replaceChildren(...data.map((cells) => {
    const tr = document.createElement("tr");
    for (const c of cells) {
      const td = document.createElement("td");
      td.textContent = c;
      tr.appendChild(td);
    }
    return tr;
  }));
}

function draw(id, traces, layout) {
  Plotly.react($(id), traces, Object.assign({}, LAYOUT, layout || {}), CONFIG);
}

function render(v) {
  const now = v.time;
  const xs = v.series.map((s) => s[0] - now);
  set("split", v.split);
  set("prefill-nodes", v.prefill.join(" ") || "–");
  set("decode-nodes", v.decode.join(" ") || "–");
  const switching = Object.keys(v.switching);
  set("planner", v.warming_up ? "warming up" :
      switching.length ? "switching " + switching.join(" ") :
      v.next_decision_at === null ? "fixed" : "next decision in " + secs(v.next_decision_at - now));
  const c = v.counters;
  set("submitted", c.submitted);
  set("ok", c.ok);
  set("failed", c.failed);
  set("in-flight", v.in_flight);
  set("rps", fmt(v.requests_per_s));
  set("eps", fmt(v.errors_per_s));
  set("split-changes", v.split_changes);
  set("node-switches", c.switches);
  set("active-branches", v.active_branches);
  set("inferred-branches", v.inferred_branches);
  set("branches-seen", v.branches_seen);
  set("agents", v.agents);
  set("ttft", secs(v.ttft.p50) + " / " + secs(v.ttft.p99));
  set("e2e", secs(v.e2e.p50) + " / " + secs(v.e2e.p99));

  rows($("switches").tBodies[0], v.switches.slice().reverse().map(
    (s) => [ago(s.time, now), s.label + "  (P: " + s.prefill.join(" ") + ")", s.reason]));
  rows($("decisions").tBodies[0], v.decisions.length ? v.decisions.slice().reverse().map(
    (d) => [ago(d.time, now), d.split, d.chosen || "keep", d.reason]) :
    [["–", v.split, "–", v.warming_up ? "none yet: the collocated warm-up" : "none yet"]]);
  rows($("nodes").tBodies[0], v.nodes.map((n) => [
    n.name + (n.cordoned ? " (cordoned)" : "") + (n.healthy ? "" : " (down)"),
    n.phase + (n.draining_to ? " → " + n.draining_to : ""), n.queued, n.prefilling, n.decoding,
    n.l1_capacity ? fmt(100 * n.l1_used / n.l1_capacity) + " %" : "–",
    n.l2_capacity ? fmt(100 * n.l2_used / n.l2_capacity) + " %" : "–",
    n.blocks, n.blocks ? fmt(100 * n.positive_blocks / n.blocks) + " %" : "–"]));

  const shapes = v.switches.filter((s) => s.time - now >= (xs[0] || 0)).map((s) => ({
    type: "line", x0: s.time - now, x1: s.time - now, yref: "paper", y0: 0, y1: 1,
    line: { dash: "dot", color: "#d97706" } }));
  draw("chart-split", [
    { x: xs, y: v.series.map((s) => s[1]), name: "prefill", mode: "lines", line: { shape: "hv" } },
    { x: xs, y: v.series.map((s) => s[2]), name: "decode", mode: "lines", line: { shape: "hv" } },
    { x: xs, y: v.series.map((s) => s[3]), name: "collocated", mode: "lines", line: { shape: "hv" } },
    { x: v.switches.map((s) => s.time - now), y: v.switches.map((s) => s.prefill.length),
      text: v.switches.map((s) => s.label + ": " + s.reason), name: "switch",
      mode: "markers", marker: { size: 10, symbol: "diamond", color: "#d97706" },
      hoverinfo: "text" },
  ], { shapes: shapes, yaxis: { title: { text: "nodes" }, rangemode: "tozero" } });
  const names = v.nodes.map((n) => n.name);
  draw("chart-queue", names.map((n) => ({ x: xs, y: v.series.map((s) => s[4][n]), name: n,
                                          mode: "lines" })),
       { yaxis: { title: { text: "queued prefills" }, rangemode: "tozero" } });
  draw("chart-decode", names.map((n) => ({ x: xs, y: v.series.map((s) => s[5][n]), name: n,
                                           mode: "lines" })),
       { yaxis: { title: { text: "decoding requests" }, rangemode: "tozero" } });
  const share = (a, b) => v.nodes.map((n) => (n[b] ? 100 * n[a] / n[b] : 0));
  draw("chart-cache", [
    { x: names, y: share("l1_used", "l1_capacity"), name: "L1 (GPU) used %", type: "bar" },
    { x: names, y: share("l2_used", "l2_capacity"), name: "L2 (host) used %", type: "bar" },
    { x: names, y: share("positive_blocks", "blocks"), name: "held by live branches %",
      type: "bar" },
  ], { barmode: "group", xaxis: { title: { text: "node" } },
       yaxis: { title: { text: "%" }, range: [0, 100] } });
  // Markers too: a percentile exists only once requests ended, maybe in a single sample.
  const pts = { size: 4 };
  draw("chart-latency", [
    { x: xs, y: v.series.map((s) => s[6]), name: "TTFT P50", mode: "lines+markers", marker: pts },
    { x: xs, y: v.series.map((s) => s[7]), name: "TTFT P99", mode: "lines+markers", marker: pts },
    { x: xs, y: v.series.map((s) => s[8]), name: "E2E P50", mode: "lines+markers", marker: pts },
    { x: xs, y: v.series.map((s) => s[9]), name: "E2E P99", mode: "lines+markers", marker: pts },
  ], { yaxis: { title: { text: "seconds (last " + fmt(v.latency_window_s) + " s)" },
                rangemode: "tozero" } });
  draw("chart-rates", [
    { x: xs, y: v.series.map((s) => s[10]), name: "requests/s", mode: "lines" },
    { x: xs, y: v.series.map((s) => s[11]), name: "errors/s", mode: "lines" },
  ], { yaxis: { title: { text: "per second (last " + fmt(v.rate_window_s) + " s)" },
                rangemode: "tozero" } });
  const u = $("updated");
  u.textContent = "updated " + new Date().toLocaleTimeString("en-GB");
  u.classList.remove("stale");
  document.body.dataset.polls = String(Number(document.body.dataset.polls || 0) + 1);
}

async function poll() {
  try {
    const r = await fetch("/v1/evinfra/dashboard", { cache: "no-store" });
    if (!r.ok) throw new Error("HTTP " + r.status);
    render(await r.json());
  } catch (e) {
    const u = $("updated");
    u.textContent = "no data: " + e.message;
    u.classList.add("stale");
  } finally {
    setTimeout(poll, POLL_MS);
  }
}

poll();
