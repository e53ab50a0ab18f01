"""The memory timeline page's script (jaxmem.plan.timeline_html embeds it): draws the embedded timeline
JSON as SVG, with no library and no network fetch. Kept as a Python string so that it ships with the package."""

SCRIPT = r'''// jaxmem memory timeline: draws the embedded timeline JSON as SVG (no library, no network).
"use strict";
window.addEventListener("error", function (e) {
  var d = document.createElement("p");
  d.className = "err";
  d.textContent = "timeline script error: " + e.message;
  document.body.insertBefore(d, document.body.firstChild);
});

var DATA = JSON.parse(document.getElementById("data").textContent);
var NS = "http://www.w3.org/2000/svg";
var CAT_INDEX = {};
DATA.categories.forEach(function (c, i) { CAT_INDEX[c] = i; });

function el(tag, attrs, parent, text) {
  var e = document.createElementNS(NS, tag);
  for (var k in attrs) e.setAttribute(k, attrs[k]);
  if (text !== undefined) e.textContent = text;
  if (parent) parent.appendChild(e);
  return e;
}
function div(cls, parent, text) {
  var e = document.createElement("div");
  if (cls) e.className = cls;
  if (text !== undefined) e.textContent = text;
  if (parent) parent.appendChild(e);
  return e;
}
function fmt(b) {
  if (b === null || b === undefined) return "n/a";
  var u = ["B", "KiB", "MiB", "GiB", "TiB"], i = 0, v = b;
  while (Math.abs(v) >= 1024 && i < u.length - 1) { v /= 1024; i++; }
  return (i ? v.toFixed(v < 10 ? 2 : 1) : v.toFixed(0)) + " " + u[i];
}
function niceStep(max, n) {
  var raw = max / n, p = Math.pow(10, Math.floor(Math.log10(raw))), m = raw / p;
  return p * (m <= 1 ? 1 : m <= 2 ? 2 : m <= 2.5 ? 2.5 : m <= 5 ? 5 : 10);
}
function niceBytes(max) {  // ticks in whole binary units
  var unit = Math.pow(1024, Math.max(0, Math.floor(Math.log(Math.max(max, 1)) / Math.log(1024))));
  var step = niceStep(max / unit, 5) * unit, ticks = [];
  for (var v = 0; v <= max * 1.0001; v += step) ticks.push(v);
  return ticks;
}
function esc(s) {
  return String(s === null || s === undefined ? "" : s).replace(/[&<>"]/g, function (c) {
    return {"&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;"}[c];
  });
}
function bandHtml(b, tl) {
  var rows = [["buffer", b.buffer], ["bytes", fmt(b.bytes) + " (" + b.bytes.toLocaleString() + ")"],
    ["shape", b.dtype + "[" + b.shape.join(", ") + "]"],
    ["category", b.category + (b.category !== b.explain_category ? " (explain: " + b.explain_category + ")" : "")],
    ["checkpoint name", b.checkpoint_name || "-"], ["source", b.source], ["why", b.why],
    ["live", "#" + b.first + " " + (tl.instructions[b.first] || "") + " .. #" + b.last + " " +
      (tl.instructions[b.last] || "")], ["lever", b.suggestion]];
  return "<table>" + rows.map(function (r) {
    return "<tr><th>" + r[0] + "</th><td>" + esc(r[1]) + "</td></tr>";
  }).join("") + "</table>";
}
var tip = document.getElementById("tip");
function showTip(ev, htmlText) {
  tip.innerHTML = htmlText;
  tip.style.display = "block";
  var x = ev.clientX + 14, y = ev.clientY + 14;
  if (x + 470 > window.innerWidth) x = Math.max(0, ev.clientX - 480);
  if (y + tip.offsetHeight > window.innerHeight) y = Math.max(0, ev.clientY - tip.offsetHeight - 10);
  tip.style.left = x + "px";
  tip.style.top = y + "px";
}
function hideTip() { tip.style.display = "none"; }

var W = 760, LEFT = 64, RIGHT = 10, PW = W - LEFT - RIGHT;

// One lane (device or host): the bands of one pool stacked by category, over columns of the schedule.
function lane(svg, tl, memory, top, height, ymax, pinBox, title) {
  var n = tl.positions, total = memory === "device" ? tl.device_total : tl.host_total;
  var C = Math.max(1, Math.min(n, PW)), start = [], rep = [];
  for (var c = 0; c <= C; c++) start.push(Math.floor(c * n / C));
  for (c = 0; c < C; c++) {  // each column shows the moment of its largest total (the peak survives)
    var best = start[c];
    for (var t = start[c]; t < start[c + 1]; t++) if (total[t] > total[best]) best = t;
    rep.push(best);
  }
  if (memory === "device") rep[Math.min(C - 1, Math.floor(tl.peak.position * C / n))] = tl.peak.position;
  var colOf = function (t) { return Math.min(C - 1, Math.floor(t * C / n)); };
  var xOf = function (c) { return LEFT + c * PW / C; };
  var yOf = function (v) { return top + height - v / ymax * height; };
  var g = el("g", {}, svg);
  el("rect", {x: LEFT, y: top, width: PW, height: height, fill: "#fafafa", stroke: "#ccc"}, g);
  niceBytes(ymax).forEach(function (v) {
    el("line", {x1: LEFT, x2: LEFT + PW, y1: yOf(v), y2: yOf(v), stroke: "#e4e4e4"}, g);
    el("text", {x: LEFT - 4, y: yOf(v) + 3, "text-anchor": "end", fill: "#555"}, g, fmt(v));
  });
  el("text", {x: LEFT + 4, y: top + 12, fill: "#333", "font-weight": "bold"}, g, title);
  var bands = tl.bands.filter(function (b) { return b.memory === memory; });
  bands.sort(function (a, b) {
    return (CAT_INDEX[a.category] - CAT_INDEX[b.category]) || (a.first - b.first) || (b.bytes - a.bytes);
  });
  var off = new Float64Array(C), minPx = 0.04;
  bands.forEach(function (b) {
    var c0 = colOf(b.first), c1 = colOf(b.last), runs = [], run = null;
    for (var c = c0; c <= c1; c++) {
      var live = b.first <= rep[c] && rep[c] <= b.last;
      if (live) { if (!run) { run = [c, c]; runs.push(run); } else run[1] = c; } else run = null;
    }
    if (!runs.length) return;
    var drawn = b.bytes / ymax * height >= minPx, d = "";
    runs.forEach(function (r) {
      if (drawn) {
        var top_ = "", bot = "";
        for (var c = r[0]; c <= r[1]; c++) {
          var y1 = yOf(off[c] + b.bytes).toFixed(2);
          top_ += (c === r[0] ? "M" : "L") + xOf(c).toFixed(2) + " " + y1 + "L" + xOf(c + 1).toFixed(2) + " " + y1;
        }
        for (c = r[1]; c >= r[0]; c--) {
          var y0 = yOf(off[c]).toFixed(2);
          bot += "L" + xOf(c + 1).toFixed(2) + " " + y0 + "L" + xOf(c).toFixed(2) + " " + y0;
        }
        d += top_ + bot + "Z";
      }
      for (var k = r[0]; k <= r[1]; k++) off[k] += b.bytes;
    });
    if (!drawn) return;
    var p = el("path", {d: d, fill: DATA.colors[b.category], stroke: "#ffffff", "stroke-width": 0.35,
      "class": "band"}, g);
    p.addEventListener("mousemove", function (ev) { showTip(ev, bandHtml(b, tl)); });
    p.addEventListener("mouseenter", function () {
      p.setAttribute("stroke", "#000"); p.setAttribute("stroke-width", 1);
    });
    p.addEventListener("mouseleave", function () {
      p.setAttribute("stroke", "#ffffff"); p.setAttribute("stroke-width", 0.35); hideTip();
    });
    p.addEventListener("click", function () { pinBox.innerHTML = "<b>pinned buffer</b>" + bandHtml(b, tl); });
  });
  return {rep: rep, C: C, xOf: xOf, yOf: yOf, colOf: colOf};
}

function panel(root, tl, scale) {
  var box = div("panel", root);
  var h = document.createElement("h2");
  h.textContent = tl.config || "train step";
  box.appendChild(h);
  div("note", box, tl.label + "; device peak " + fmt(tl.peak.device_bytes) + " at #" + tl.peak.position + " " +
    tl.peak.instruction + " (" + tl.peak.phase + ")" + (tl.peak.host_bytes ? "; pinned host then " +
    fmt(tl.peak.host_bytes) : "") + (tl.compiled_device_bytes ? "; XLA memory analysis of the same compile: " +
    fmt(tl.compiled_device_bytes) : ""));
  var hasHost = tl.bands.some(function (b) { return b.memory === "host"; });
  var PH = 18, DH = 300, HH = 110, gap = 26;
  var H = PH + 6 + DH + (hasHost ? gap + HH : 0) + 30;
  var svg = el("svg", {viewBox: "0 0 " + W + " " + H, role: "img"}, box);
  var readout = div("readout", box, "move over the chart: the moment under the pointer");
  var pin = div("pin", box, "click a band to pin its buffer here");
  var n = tl.positions;
  // the step's parts
  var palette = {"forward layers": "#dbe8f5", "forward": "#eaf1f8", "loss": "#fbeccd", "backward layers": "#f6dcdc",
    "backward": "#f9ebeb", "update": "#e3d9ec", "grad accumulation": "#e2efe0", "start": "#f0f0f0"};
  tl.phases.forEach(function (ph) {
    var x0 = LEFT + ph.first / n * PW, x1 = LEFT + (ph.last + 1) / n * PW;
    var r = el("rect", {x: x0, y: 0, width: Math.max(0.5, x1 - x0), height: PH, fill: palette[ph.name] || "#eee",
      stroke: "#fff"}, svg);
    el("title", {}, r, ph.name + ": #" + ph.first + "-#" + ph.last);
    if (x1 - x0 > ph.name.length * 5.6) el("text", {x: (x0 + x1) / 2, y: 13, "text-anchor": "middle",
      fill: "#333"}, svg, ph.name);
  });
  var dev = lane(svg, tl, "device", PH + 6, DH, scale.device, pin, "device memory");
  var host = hasHost ? lane(svg, tl, "host", PH + 6 + DH + gap, HH, scale.host, pin, "pinned host memory") : null;
  var bottom = PH + 6 + DH + (hasHost ? gap + HH : 0);
  // x axis: schedule positions
  var step = niceStep(n, 6);
  for (var t = 0; t <= n; t += step) {
    var x = LEFT + t / n * PW;
    el("line", {x1: x, x2: x, y1: bottom, y2: bottom + 4, stroke: "#555"}, svg);
    el("text", {x: x, y: bottom + 15, "text-anchor": "middle", fill: "#555"}, svg, String(t));
  }
  el("text", {x: LEFT + PW, y: bottom + 27, "text-anchor": "end", fill: "#555"}, svg,
    "schedule position (instruction order)");
  // the device peak
  var px = dev.xOf(dev.colOf(tl.peak.position) + 0.5);
  var py = dev.yOf(tl.peak.device_bytes);  // the line stops above the peak's column, so that stays visible
  el("line", {x1: px, x2: px, y1: PH + 6, y2: py - 3, stroke: "#c00", "stroke-dasharray": "4 3",
    "stroke-width": 1.2}, svg);
  el("line", {x1: px, x2: px, y1: dev.yOf(0), y2: bottom, stroke: "#c00", "stroke-dasharray": "4 3",
    "stroke-width": 1.2}, svg);
  el("path", {d: "M" + (px - 5) + " " + (py - 9) + "L" + (px + 5) + " " + (py - 9) + "L" + px + " " + (py - 1) + "Z",
    fill: "#c00"}, svg);
  var label = "peak " + fmt(tl.peak.device_bytes);
  var right = px > LEFT + PW * 0.7;
  el("text", {x: px + (right ? -4 : 4), y: dev.yOf(tl.peak.device_bytes) + (tl.peak.device_bytes /
    scale.device > 0.93 ? 24 : -4), "text-anchor": right ? "end" : "start", fill: "#c00",
    "font-weight": "bold", stroke: "#fff", "stroke-width": 3, "paint-order": "stroke"}, svg, label);
  // the moment under the pointer
  var cursor = el("line", {x1: 0, x2: 0, y1: PH + 6, y2: bottom, stroke: "#333", "stroke-width": 0.6,
    visibility: "hidden", "pointer-events": "none"}, svg);
  svg.addEventListener("mousemove", function (ev) {
    var r = svg.getBoundingClientRect(), sx = (ev.clientX - r.left) * W / r.width;
    if (sx < LEFT || sx > LEFT + PW) { cursor.setAttribute("visibility", "hidden"); return; }
    var c = Math.min(dev.C - 1, Math.floor((sx - LEFT) / PW * dev.C)), t = dev.rep[c];
    cursor.setAttribute("x1", sx); cursor.setAttribute("x2", sx); cursor.setAttribute("visibility", "visible");
    var ph = tl.phases.filter(function (p) { return p.first <= t && t <= p.last; })[0];
    readout.textContent = "#" + t + " " + (tl.instructions[t] || "") + " (" + (ph ? ph.name : "") + "): device " +
      fmt(tl.device_total[t]) + (hasHost ? ", pinned host " + fmt(tl.host_total[t]) : "");
  });
  svg.addEventListener("mouseleave", function () { cursor.setAttribute("visibility", "hidden"); hideTip(); });
  // legend: bytes per category at the peak
  var atPeak = {};
  tl.bands.forEach(function (b) {
    if (b.memory === "device" && b.first <= tl.peak.position && tl.peak.position <= b.last)
      atPeak[b.category] = (atPeak[b.category] || 0) + b.bytes;
  });
  var legend = div("legend", box);
  DATA.categories.forEach(function (c) {
    var s = document.createElement("span");
    s.innerHTML = '<i class="sw" style="background:' + DATA.colors[c] + '"></i>' + c + " " + fmt(atPeak[c] || 0);
    legend.appendChild(s);
  });
  // the live set at the peak: explain --top's list
  var h3 = document.createElement("h2");
  h3.textContent = "live at the device peak (" + tl.peak.buffers.length + " buffers, " + fmt(tl.peak.device_bytes) +
    "): jaxmem explain --top";
  box.appendChild(h3);
  var list = div("peaklist", box);
  var rows = tl.peak.buffers.map(function (b, i) {
    return "<tr><td class=n>" + (i + 1) + "</td><td class=n>" + fmt(b.bytes) + "</td><td>" + esc(b.dtype) + "[" +
      esc(b.shape.join(",")) + "]</td><td><i class=sw style=\"background:" + DATA.colors[b.category] + "\"></i>" +
      esc(b.category) + (b.checkpoint_name ? " (" + esc(b.checkpoint_name) + ")" : "") + "</td><td>" +
      esc(b.source) + "<div class=lever>" + esc(b.suggestion) + "</div></td></tr>";
  });
  list.innerHTML = "<table><tr><th>#</th><th>bytes</th><th>shape</th><th>category</th><th>source, lever</th>" +
    "</tr>" + rows.join("") + "</table>";
}

function measuredPanel(root, m) {
  var box = div("panel", root);
  var h = document.createElement("h2");
  h.textContent = "device memory per step: measured vs planned";
  box.appendChild(h);
  div("note", box, "measured: " + m.source + "; planned: " + m.planned_label);
  var pts = m.points.filter(function (p) { return p.bytes_in_use !== null || p.peak_bytes_in_use !== null; });
  if (!pts.length) {
    div("note", box, "no allocator statistics in these rows (the CPU backend reports none): planned device peak " +
      fmt(m.planned_device_bytes) + " only");
    return;
  }
  var ymax = m.planned_device_bytes || 0;
  pts.forEach(function (p) { ymax = Math.max(ymax, p.bytes_in_use || 0, p.peak_bytes_in_use || 0); });
  ymax *= 1.08;
  var H = 260, top = 10, height = 210, svg = el("svg", {viewBox: "0 0 " + W + " " + H, role: "img"}, box);
  var legend = div("legend", box);
  var s0 = pts[0].step, s1 = Math.max(pts[pts.length - 1].step, s0 + 1);
  var xOf = function (s) { return LEFT + (s - s0) / (s1 - s0) * PW; };
  var yOf = function (v) { return top + height - v / ymax * height; };
  el("rect", {x: LEFT, y: top, width: PW, height: height, fill: "#fafafa", stroke: "#ccc"}, svg);
  niceBytes(ymax).forEach(function (v) {
    el("line", {x1: LEFT, x2: LEFT + PW, y1: yOf(v), y2: yOf(v), stroke: "#e4e4e4"}, svg);
    el("text", {x: LEFT - 4, y: yOf(v) + 3, "text-anchor": "end", fill: "#555"}, svg, fmt(v));
  });
  if (m.planned_device_bytes) {
    el("line", {x1: LEFT, x2: LEFT + PW, y1: yOf(m.planned_device_bytes), y2: yOf(m.planned_device_bytes),
      stroke: "#c00", "stroke-dasharray": "5 3", "stroke-width": 1.4}, svg);
    el("text", {x: LEFT + PW - 4, y: yOf(m.planned_device_bytes) - 4, "text-anchor": "end", fill: "#c00"}, svg,
      "planned device peak " + fmt(m.planned_device_bytes) + " (compiled)");
  }
  [["peak_bytes_in_use", "#e15759", "allocator peak_bytes_in_use"], ["bytes_in_use", "#4e79a7",
    "bytes_in_use after the step"]].forEach(function (s, k) {
    var d = "";
    pts.forEach(function (p) {
      if (p[s[0]] === null || p[s[0]] === undefined) return;
      d += (d ? "L" : "M") + xOf(p.step).toFixed(2) + " " + yOf(p[s[0]]).toFixed(2);
      var c = el("circle", {cx: xOf(p.step), cy: yOf(p[s[0]]), r: 2.6, fill: s[1]}, svg);
      el("title", {}, c, "step " + p.step + ": " + s[2] + " " + fmt(p[s[0]]));
    });
    if (d) el("path", {d: d, fill: "none", stroke: s[1], "stroke-width": 1.6}, svg);
    var key = document.createElement("span");
    key.innerHTML = '<i class="sw" style="background:' + s[1] + '"></i>' + s[2] + " (measured)";
    legend.appendChild(key);
  });
  var key = document.createElement("span");
  key.innerHTML = '<i class="sw" style="background:#c00"></i>planned device peak (compiled, dashed)';
  legend.appendChild(key);
  el("text", {x: LEFT + PW, y: top + height + 28, "text-anchor": "end", fill: "#555"}, svg, "step");
  var step = Math.max(1, Math.ceil(niceStep(s1 - s0, 8)));
  for (var s = s0; s <= s1; s += step) {
    el("text", {x: xOf(s), y: top + height + 14, "text-anchor": "middle", fill: "#555"}, svg, String(s));
  }
}

(function main() {
  var root = document.getElementById("root");
  var scale = {device: 1, host: 1};
  DATA.panels.forEach(function (tl) {
    tl.device_total.forEach(function (v) { scale.device = Math.max(scale.device, v); });
    tl.host_total.forEach(function (v) { scale.host = Math.max(scale.host, v); });
  });
  scale.device *= 1.05; scale.host *= 1.05;
  if (DATA.panels.length > 1) {
    var a = DATA.panels[0].peak.device_bytes, b = DATA.panels[1].peak.device_bytes;
    div("sub", root, "same y scale in every panel. Device peak: " + fmt(a) + " -> " + fmt(b) + " (" +
      (b >= a ? "+" : "-") + fmt(Math.abs(b - a)) + ", " + (100 * (b - a) / a).toFixed(1) + "%)");
  }
  var row = div("panels", root);
  DATA.panels.forEach(function (tl) { panel(row, tl, scale); });
  if (DATA.measured) measuredPanel(div("panels", root), DATA.measured);
  document.body.setAttribute("data-rendered", "1");
})();
'''
