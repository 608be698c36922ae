/* ocrq's tiny SVG charts: a line (cumulative) and bars over time spans (throughput). No
   dependency; the server sends the data (api/pages_data.py: series). x is seconds since the
   job was submitted. */
(function () {
  "use strict";
  var NS = "http://www.w3.org/2000/svg";
  var M = { top: 10, right: 12, bottom: 28, left: 52 };

  function el(name, attrs, parent) {
    var node = document.createElementNS(NS, name);
    for (var k in attrs) { if (Object.prototype.hasOwnProperty.call(attrs, k)) node.setAttribute(k, attrs[k]); }
    if (parent) parent.appendChild(node);
    return node;
  }

  /* about five round ticks from 0 to max */
  function ticks(max) {
    if (!(max > 0)) return [0, 1];
    var raw = max / 5, mag = Math.pow(10, Math.floor(Math.log10(raw)));
    var step = [1, 2, 2.5, 5, 10].map(function (f) { return f * mag; }).find(function (s) { return s >= raw; });
    var out = [];
    for (var v = 0; v <= max + step * 0.001; v += step) out.push(v);
    if (out[out.length - 1] < max) out.push(out[out.length - 1] + step);
    return out;
  }

  function secondsText(s) {
    if (s < 120) return Math.round(s) + " s";
    if (s < 7200) return Math.round(s / 60) + " min";
    return (s / 3600).toFixed(1) + " h";
  }

  function numberText(v) {
    if (v >= 1e6) return (v / 1e6).toFixed(1) + "M";
    if (v >= 1e4) return Math.round(v / 1e3) + "k";
    if (v >= 100 || v === Math.round(v)) return String(Math.round(v));
    return v.toFixed(1);
  }

  /* the frame: axes, grid and tick labels; returns the scales */
  function frame(svg, w, h, xmax, ymax) {
    var yt = ticks(ymax), xt = ticks(xmax);
    var ytop = yt[yt.length - 1], xright = xt[xt.length - 1];
    var sx = function (x) { return M.left + (w - M.left - M.right) * (xright ? x / xright : 0); };
    var sy = function (y) { return h - M.bottom - (h - M.top - M.bottom) * (ytop ? y / ytop : 0); };
    yt.forEach(function (v) {
      el("line", { "class": "grid", x1: M.left, x2: w - M.right, y1: sy(v), y2: sy(v) }, svg);
      el("text", { x: M.left - 6, y: sy(v) + 4, "text-anchor": "end" }, svg).textContent = numberText(v);
    });
    xt.forEach(function (v) {
      el("text", { x: sx(v), y: h - M.bottom + 16, "text-anchor": "middle" }, svg).textContent = secondsText(v);
    });
    el("line", { "class": "axis", x1: M.left, x2: w - M.right, y1: sy(0), y2: sy(0) }, svg);
    el("line", { "class": "axis", x1: M.left, x2: M.left, y1: M.top, y2: sy(0) }, svg);
    return { x: sx, y: sy };
  }

  function start(box) {
    while (box.firstChild) box.removeChild(box.firstChild);
    var w = Math.max(box.clientWidth || 0, 240), h = Math.max(box.clientHeight || 0, 140);
    var svg = el("svg", { viewBox: "0 0 " + w + " " + h, "aria-hidden": "true", focusable: "false" }, box);
    return { svg: svg, w: w, h: h };
  }

  function note(c, text) {
    el("text", { "class": "empty-note", x: c.w / 2, y: c.h / 2, "text-anchor": "middle" }, c.svg).textContent = text;
  }

  /* points: [[seconds, value], ...] */
  function line(box, points) {
    var c = start(box);
    if (!points || points.length < 2) { note(c, "Nothing finished yet"); return; }
    var xmax = points[points.length - 1][0], ymax = Math.max.apply(null, points.map(function (p) { return p[1]; }));
    var s = frame(c.svg, c.w, c.h, xmax, ymax);
    var d = points.map(function (p, i) { return (i ? "L" : "M") + s.x(p[0]).toFixed(1) + " " + s.y(p[1]).toFixed(1); }).join(" ");
    el("path", { "class": "area", d: d + " L" + s.x(xmax).toFixed(1) + " " + s.y(0) + " L" + s.x(points[0][0]).toFixed(1) + " " + s.y(0) + " Z" }, c.svg);
    el("path", { "class": "line", d: d }, c.svg);
  }

  /* bars: [[from s, to s, value], ...] */
  function bars(box, spans) {
    var c = start(box);
    if (!spans || !spans.length) { note(c, "Nothing finished yet"); return; }
    var xmax = spans[spans.length - 1][1], ymax = Math.max.apply(null, spans.map(function (b) { return b[2]; }));
    var s = frame(c.svg, c.w, c.h, xmax, ymax);
    spans.forEach(function (b) {
      var x0 = s.x(b[0]), x1 = s.x(b[1]), y = s.y(b[2]);
      var gap = x1 - x0 > 4 ? 1 : 0;
      el("rect", { "class": "bar-rect", x: (x0 + gap).toFixed(1), y: y.toFixed(1),
        width: Math.max(x1 - x0 - 2 * gap, 1).toFixed(1), height: Math.max(s.y(0) - y, 0).toFixed(1) }, c.svg);
    });
  }

  window.ocrqCharts = { line: line, bars: bars, ticks: ticks };
})();
