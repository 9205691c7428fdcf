/* torchdebug charts: small SVG line/marker/stack/heatmap charts for the report and the dashboard.
   Figures are plain JSON built in Python (views/report/_figures.py). No network, no dependencies.
   Each chart: a title and one-line summary (its text alternative), an SVG with measured margins (no cut
   or overprinted labels), an HTML legend below the plot, a log toggle and smoothing where useful,
   hover read-out, drag to zoom (double-click resets). Event and NaN markers sit on a lane of their own
   under the plot (one row per marker trace), never at a height that reads as data; an axis marked
   "robust" starts with outliers left out (a toggle shows them); a lone point is drawn as a dot. Colours come from CSS variables, so
   prefers-color-scheme switches light/dark without a redraw. */
(function () {
  "use strict";
  var NS = "http://www.w3.org/2000/svg";
  // no red and no pink: red is kept for NaN markers and anomalies, pink for rule events
  var PALETTE = ["#1f77b4", "#ff7f0e", "#2ca02c", "#9467bd", "#8c564b", "#17becf", "#7f7f7f", "#bcbd22",
    "#393b79", "#637939"];
  var LANE_ROW = 14, LANE_ROWS = 4; // marker lane: px per row, rows at most (more traces share rows)
  var SUP = { "-": "\u207b", "0": "\u2070", "1": "\u00b9", "2": "\u00b2", "3": "\u00b3", "4": "\u2074",
    "5": "\u2075", "6": "\u2076", "7": "\u2077", "8": "\u2078", "9": "\u2079" };
  var LEGEND_OPEN = 8; // more entries than this: the legend folds into a <details>
  var state = {}; // per chart id: {fig, hidden: {name: true}, log, robust, smooth, zoom: [x0, x1] | null}

  function el(tag, attrs, parent) {
    var e = document.createElementNS(NS, tag);
    for (var k in attrs) if (attrs[k] !== undefined && attrs[k] !== null) e.setAttribute(k, attrs[k]);
    if (parent) parent.appendChild(e);
    return e;
  }
  function h(tag, cls, parent, text) {
    var e = document.createElement(tag);
    if (cls) e.className = cls;
    if (text !== undefined) e.textContent = text;
    if (parent) parent.appendChild(e);
    return e;
  }
  function finite(v) { return typeof v === "number" && isFinite(v); }

  // ---- number formatting: never a bare minor digit, never more than ~6 characters of mantissa
  function trim(s) { return s.indexOf("e") < 0 && s.indexOf(".") >= 0 ? s.replace(/\.?0+$/, "") : s; }
  function fmt(v) {
    if (!finite(v)) return String(v);
    var a = Math.abs(v);
    if (a === 0) return "0";
    if (a >= 1e5 || a < 1e-3) {
      var e = Math.floor(Math.log10(a)), m = v / Math.pow(10, e);
      if (Math.abs(m) >= 9.995) { m /= 10; e += 1; }
      return trim(m.toFixed(2)) + "e" + e;
    }
    if (a >= 100) return trim(v.toFixed(0));
    if (a >= 1) return trim(v.toPrecision(4));
    return trim(v.toPrecision(3));
  }
  function fmtStep(v) {
    var a = Math.abs(v);
    if (a >= 1e6) return trim((v / 1e6).toFixed(2)) + "M";
    if (a >= 1e4) return trim((v / 1e3).toFixed(1)) + "k";
    return String(Math.round(v));
  }
  function fmtPow(e) { // 10^e as "10⁻³"
    return "10" + String(e).split("").map(function (c) { return SUP[c] || c; }).join("");
  }

  // ---- ticks
  function niceStep(span, n) {
    var raw = span / Math.max(1, n), p = Math.pow(10, Math.floor(Math.log10(raw))), f = raw / p;
    return (f <= 1 ? 1 : f <= 2 ? 2 : f <= 5 ? 5 : 10) * p;
  }
  function linTicks(lo, hi, n, integer) {
    if (!(hi > lo)) return [lo];
    var step = niceStep(hi - lo, n);
    if (integer) step = Math.max(1, Math.round(step));
    var out = [], t = Math.ceil(lo / step - 1e-9) * step;
    for (; t <= hi + step * 1e-9; t += step) out.push(Math.abs(t) < step * 1e-9 ? 0 : +t.toPrecision(12));
    return out;
  }
  function logTicks(lo, hi, n) { // lo, hi: log10 of the range; labels are full numbers or powers of ten
    var d0 = Math.floor(lo), d1 = Math.ceil(hi), decades = d1 - d0, out = [];
    if (decades > n) { // several decades per tick
      var every = Math.ceil(decades / n);
      for (var e = Math.ceil(lo / every) * every; e <= hi + 1e-9; e += every) out.push({ v: e, label: fmtPow(e) });
      return out;
    }
    var mults = decades >= 3 ? [1] : decades >= 2 ? [1, 3] : [1, 2, 5];
    for (var d = d0; d <= d1; d++) {
      for (var i = 0; i < mults.length; i++) {
        var lv = d + Math.log10(mults[i]);
        if (lv >= lo - 1e-9 && lv <= hi + 1e-9) {
          out.push({ v: lv, label: mults[i] === 1 && decades >= 2 ? fmtPow(d) : fmt(mults[i] * Math.pow(10, d)) });
        }
      }
    }
    if (out.length < 2) { // less than a decade: linear ticks inside it, full labels
      out = linTicks(Math.pow(10, lo), Math.pow(10, hi), n, false).filter(function (v) { return v > 0; })
        .map(function (v) { return { v: Math.log10(v), label: fmt(v) }; });
    }
    return out;
  }

  // ---- data transforms
  function ema(ys, w) { // TensorBoard's debiased exponential moving average; gaps stay gaps
    var out = new Array(ys.length), acc = 0, n = 0;
    for (var i = 0; i < ys.length; i++) {
      var y = ys[i];
      if (!finite(y)) { out[i] = null; continue; }
      acc = acc * w + (1 - w) * y; n++;
      out[i] = acc / (1 - Math.pow(w, n));
    }
    return out;
  }
  function stackTraces(traces) { // cumulative sums per x across traces of one stackgroup
    var base = {};
    return traces.map(function (t) {
      var y = t.y.map(function (v, i) {
        var x = t.x[i], b = base[x] || 0;
        if (!finite(v)) return null;
        base[x] = b + v; return b + v;
      });
      var lower = t.x.map(function (x, i) { return y[i] === null ? null : y[i] - t.y[i]; });
      return { t: t, y: y, lower: lower };
    });
  }

  function bsearch(xs, x) { // index of the x closest to x in a sorted array
    var lo = 0, hi = xs.length - 1;
    if (hi < 0) return -1;
    while (hi - lo > 1) { var m = (lo + hi) >> 1; if (xs[m] < x) lo = m; else hi = m; }
    return Math.abs(xs[lo] - x) <= Math.abs(xs[hi] - x) ? lo : hi;
  }

  var MARK = { // marker shapes centred on 0,0 (size ~5px)
    "x": "M-4,-4L4,4M-4,4L4,-4", "x-thin-open": "M-5,-5L5,5M-5,5L5,-5", "triangle-down": "M-5,-4L5,-4L0,4Z",
    "diamond": "M0,-5L5,0L0,5L-5,0Z", "circle": "M-3,0a3,3 0 1,0 6,0a3,3 0 1,0 -6,0"
  };

  function colorOf(t, i) {
    return (t.line && t.line.color) || (t.marker && t.marker.color) || PALETTE[i % PALETTE.length];
  }

  // ---- one chart
  function measurer(svg) {
    var t = el("text", { "class": "tick", x: -1000, y: -1000 }, svg);
    return function (s) { t.textContent = s; var w = t.getComputedTextLength(); return w; };
  }

  function draw(container, fig) {
    var st = state[fig.id] || (state[fig.id] = { hidden: {}, log: null, robust: null, smooth: 0, zoom: null });
    st.fig = fig;
    container.data = fig.data; // the figure's traces stay reachable (tests, devtools)
    if (!fig.data.length) {
      container.className = container.className.replace(/\bhas-plot\b/, "") + " is-empty";
      container.innerHTML = "";
      h("p", "empty", container, fig.title + ": " + fig.empty);
      return;
    }
    container.classList.remove("is-empty");
    container.classList.add("has-plot");
    var lay = fig.layout || {};
    if (st.log === null) st.log = !!(lay.yaxis && lay.yaxis.type === "log");
    if (st.robust === null) st.robust = !!(lay.yaxis && lay.yaxis.robust);
    if (!container.querySelector(".chart-head")) build(container, fig, st);
    var cap = container.querySelector(".chart-summary");
    if (cap.textContent !== (fig.summary || "")) cap.textContent = fig.summary || "";
    render(container, fig, st);
  }

  function build(container, fig, st) {
    container.innerHTML = "";
    var head = h("div", "chart-head", container);
    var cap = h("figcaption", "", head);
    h("h3", "chart-title", cap, fig.title);
    h("p", "chart-summary", cap, fig.summary || "");
    var tools = h("div", "chart-tools", head);
    var toggles = (fig.layout && fig.layout.toggles) || [];
    if (toggles.indexOf("outliers") >= 0) {
      var lab0 = h("label", "", tools), cb0 = h("input", "", lab0);
      cb0.type = "checkbox"; cb0.checked = st.robust; cb0.setAttribute("data-tool", "outliers");
      h("span", "outliers-label", lab0, " ignore outliers");
      cb0.addEventListener("change", function () { st.robust = cb0.checked; render(container, st.fig, st); });
    }
    if (toggles.indexOf("log") >= 0) {
      var lab = h("label", "", tools), cb = h("input", "", lab);
      cb.type = "checkbox"; cb.checked = st.log; cb.setAttribute("data-tool", "log");
      lab.appendChild(document.createTextNode(" log scale"));
      cb.addEventListener("change", function () { st.log = cb.checked; render(container, st.fig, st); });
    }
    if (toggles.indexOf("smooth") >= 0) {
      var lab2 = h("label", "", tools); lab2.appendChild(document.createTextNode("smoothing "));
      var sel = h("select", "", lab2); sel.setAttribute("data-tool", "smooth");
      [["off", 0], ["0.6", 0.6], ["0.9", 0.9], ["0.99", 0.99]].forEach(function (o) {
        var op = h("option", "", sel, o[0]); op.value = String(o[1]);
      });
      sel.addEventListener("change", function () { st.smooth = +sel.value; render(container, st.fig, st); });
    }
    var reset = h("button", "zoom-reset", tools, "reset zoom"); reset.type = "button"; reset.hidden = true;
    reset.addEventListener("click", function () { st.zoom = null; render(container, st.fig, st); });
    var box = h("div", "plot", container);
    box.style.position = "relative";
    h("div", "legend", container);
  }

  function legend(container, fig, st, colors) {
    var host = container.querySelector(".legend");
    host.innerHTML = "";
    var items = fig.data.filter(function (t) { return t.type !== "heatmap" && t.showlegend !== false; });
    if (items.length < 2) return;
    var parent = host;
    if (items.length > LEGEND_OPEN) {
      var det = h("details", "", host);
      h("summary", "", det, items.length + " series (click a name to hide it)");
      parent = det;
    }
    var list = h("div", "legend-items", parent);
    items.forEach(function (t) {
      var b = h("button", "legend-item" + (st.hidden[t.name] ? " off" : ""), list);
      b.type = "button";
      var sw = h("span", "swatch", b); sw.style.background = colors[t.name];
      b.appendChild(document.createTextNode(t.name));
      b.addEventListener("click", function () {
        if (st.hidden[t.name]) delete st.hidden[t.name]; else st.hidden[t.name] = true;
        render(container, st.fig, st);
      });
    });
  }

  function render(container, fig, st) {
    var box = container.querySelector(".plot");
    var tool = container.querySelector(".zoom-reset");
    if (tool) tool.hidden = !st.zoom;
    var width = Math.max(240, box.clientWidth || container.clientWidth || 600);
    var height = (fig.layout && fig.layout.height) || 260;
    box.innerHTML = "";
    var svg = el("svg", { width: width, height: height, viewBox: "0 0 " + width + " " + height, role: "img",
      "aria-label": fig.title + ". " + (fig.summary || "") }, box);
    var measure = measurer(svg);
    var colors = {};
    fig.data.forEach(function (t, i) { colors[t.name] = colorOf(t, i); });
    legend(container, fig, st, colors);
    if (fig.data[0].type === "heatmap") heatmap(svg, box, fig, st, width, height, measure);
    else lines(svg, box, fig, st, width, height, measure, colors);
    svg.querySelector("text.tick[x='-1000']") && svg.removeChild(svg.querySelector("text.tick[x='-1000']"));
  }

  function lines(svg, box, fig, st, W, H, measure, colors) {
    var lay = fig.layout || {}, log = st.log, y2lay = lay.yaxis2;
    var y2log = !!(y2lay && y2lay.type === "log");
    var vis = fig.data.filter(function (t) { return !st.hidden[t.name]; });
    var groups = {}, plain = [];
    vis.forEach(function (t) {
      if (t.stackgroup) (groups[t.stackgroup] = groups[t.stackgroup] || []).push(t); else plain.push(t);
    });
    var series = []; // {t, ys, lower, axis}
    Object.keys(groups).forEach(function (g) {
      stackTraces(groups[g]).forEach(function (s) { series.push({ t: s.t, ys: s.y, lower: s.lower, axis: "y" }); });
    });
    plain.forEach(function (t) { series.push({ t: t, ys: t.y, axis: t.yaxis || "y" }); });
    // x range
    var xs0 = Infinity, xs1 = -Infinity;
    vis.forEach(function (t) { t.x.forEach(function (x) { if (finite(x)) { if (x < xs0) xs0 = x; if (x > xs1) xs1 = x; } }); });
    if (!finite(xs0)) { xs0 = 0; xs1 = 1; }
    var xmin = xs0;
    if (st.zoom) { xs0 = st.zoom[0]; xs1 = st.zoom[1]; }
    if (xs1 === xs0) { xs0 -= 1; xs1 += 1; }
    if (!st.zoom) { var padx = (xs1 - xs0) * 0.015; xs0 -= padx; xs1 += padx; } // markers at the ends stay whole
    var cut = 0; // points left out of the y range as outliers (robust axis)
    function spikes(ys, xsOf, isLog) { // indexes of lone spikes: far from the median of their 11 neighbours
      var idx = [], vals = [];
      for (var i = 0; i < ys.length; i++) {
        var x = xsOf[i], v = ys[i];
        if (!finite(v) || (isLog && v <= 0) || x < xs0 || x > xs1) continue;
        idx.push(i); vals.push(isLog ? Math.log10(v) : v);
      }
      var res = vals.map(function (v, k) { // centred window, narrower at the ends
        var w = Math.min(5, k, vals.length - 1 - k);
        var win = vals.slice(k - w, k + w + 1).sort(function (a, b) { return a - b; });
        return Math.abs(v - win[w]);
      });
      var sorted = res.slice().sort(function (a, b) { return a - b; });
      var scale = sorted.length ? sorted[sorted.length >> 1] : 0;
      var vs = vals.slice().sort(function (a, b) { return a - b; });
      var spread = vs.length ? vs[Math.floor((vs.length - 1) * 0.9)] - vs[Math.floor((vs.length - 1) * 0.1)] : 0;
      var out = {};
      // a spike stands 20 median residuals from its neighbours' median (far beyond a noisy loss's
      // jitter) and half the series' 10-90% spread; a level that lasts 6 points or more becomes the
      // local median and is no spike
      var limit = Math.max(20 * scale, 0.5 * spread);
      res.forEach(function (r, k) { if (r > limit && r > 0) out[idx[k]] = true; });
      return { out: out, n: vals.length };
    }
    function yrange(axis, isLog) {
      var lo = Infinity, hi = -Infinity, rlo = Infinity, rhi = -Infinity, n = 0, nOut = 0;
      series.forEach(function (s) {
        if (s.axis !== axis) return;
        var sp = axis === "y" && st.robust && !s.lower ? spikes(s.ys, s.t.x, isLog) : { out: {}, n: 0 };
        var all = s.lower ? s.ys.concat(s.lower) : s.ys;
        for (var i = 0; i < all.length; i++) {
          var x = s.t.x[i % s.t.x.length], v = all[i];
          if (!finite(v) || (isLog && v <= 0) || x < xs0 || x > xs1) continue;
          v = isLog ? Math.log10(v) : v;
          if (v < lo) lo = v; if (v > hi) hi = v;
          n++;
          if (sp.out[i]) { nOut++; continue; }
          if (v < rlo) rlo = v; if (v > rhi) rhi = v;
        }
      });
      if (!finite(lo)) return null;
      // only a few lone spikes (2% of the points at most, one at least) are left off the axis
      if (nOut > 0 && finite(rlo) && nOut <= Math.max(1, Math.floor(n * 0.02))) { cut = nOut; lo = rlo; hi = rhi; }
      if (hi === lo) { var d = isLog ? 0.5 : (Math.abs(lo) || 1) * 0.5; lo -= d; hi += d; }
      else { var pad = (hi - lo) * 0.05; lo -= pad; hi += pad; }
      if (!isLog && lay.yaxis && lay.yaxis.rangemode === "tozero" && axis === "y" && lo > 0) lo = 0;
      return [lo, hi];
    }
    var r1 = yrange("y", log), r2 = y2lay ? yrange("y2", y2log) : null;
    var outl = svg.closest(".chart") && svg.closest(".chart").querySelector(".outliers-label");
    if (outl) outl.textContent = " ignore outliers" + (st.robust && cut ? " (" + cut + " off the axis)" : "");
    var laneTraces = series.filter(function (s) { return s.axis === "y3"; });
    var onlyLane = !r1 && !r2; // markers alone: the whole plot is the lane
    var laneH = laneTraces.length && !onlyLane ? Math.min(LANE_ROWS, laneTraces.length) * LANE_ROW + 4 : 0;
    var plotH = H - 8 - 40 - laneH;
    var nY = Math.max(2, Math.floor(plotH / 40));
    var t1 = r1 ? (log ? logTicks(r1[0], r1[1], nY) : linTicks(r1[0], r1[1], nY).map(function (v) { return { v: v, label: fmt(v) }; })) : [];
    var t2 = r2 ? (y2log ? logTicks(r2[0], r2[1], nY) : linTicks(r2[0], r2[1], nY).map(function (v) { return { v: v, label: fmt(v) }; })) : [];
    var w1 = Math.max.apply(null, [0].concat(t1.map(function (t) { return measure(t.label); })));
    var w2 = Math.max.apply(null, [0].concat(t2.map(function (t) { return measure(t.label); })));
    var L = 8 + 18 + w1 + 6, R = r2 ? 8 + 18 + w2 + 6 : 14, T = 8, B = 40 + laneH;
    var pw = W - L - R, ph = H - T - B;
    if (pw < 40) return;
    // the marker lane: under the plot (or the whole plot when there is nothing else), one row per trace
    var laneT = onlyLane ? T : T + ph + 4, laneHH = onlyLane ? ph : laneH - 4;
    var laneRows = onlyLane ? Math.max(1, laneTraces.length) : Math.min(LANE_ROWS, laneTraces.length);
    function X(x) { return L + (x - xs0) / (xs1 - xs0) * pw; }
    function Yf(r, isLog) { return function (v) { var u = isLog ? Math.log10(v) : v; return T + ph - (u - r[0]) / (r[1] - r[0]) * ph; }; }
    var Y1 = r1 ? Yf(r1, log) : null, Y2 = r2 ? Yf(r2, y2log) : null;
    var clipId = "clip-" + fig.id;
    var defs = el("defs", {}, svg);
    el("rect", { x: L, y: T, width: pw, height: ph }, el("clipPath", { id: clipId }, defs));
    // grid and y ticks
    t1.forEach(function (t) {
      var y = T + ph - (t.v - r1[0]) / (r1[1] - r1[0]) * ph;
      el("line", { "class": "grid", x1: L, x2: L + pw, y1: y, y2: y }, svg);
      el("text", { "class": "tick y", x: L - 6, y: y + 4, "text-anchor": "end" }, svg).textContent = t.label;
    });
    t2.forEach(function (t) {
      var y = T + ph - (t.v - r2[0]) / (r2[1] - r2[0]) * ph;
      el("text", { "class": "tick y2", x: L + pw + 6, y: y + 4, "text-anchor": "start" }, svg).textContent = t.label;
    });
    // x ticks: as many as fit, none before the first step (steps count from 0)
    var wx = measure(fmtStep(xs1)) + 24;
    var tx = linTicks(xs0, xs1, Math.max(2, Math.floor(pw / wx)), true);
    var bottom = laneH ? laneT + laneHH : T + ph;
    tx.forEach(function (v) {
      var x = X(v);
      if (x < L - 0.5 || x > L + pw + 0.5 || (v < 0 && xmin >= 0)) return;
      el("line", { "class": "grid", x1: x, x2: x, y1: T, y2: bottom }, svg);
      el("text", { "class": "tick x", x: x, y: bottom + 15, "text-anchor": "middle" }, svg).textContent = fmtStep(v);
    });
    if (!onlyLane) el("rect", { "class": "frame", x: L, y: T, width: pw, height: ph }, svg);
    if (laneTraces.length) el("rect", { "class": "lane", x: L, y: laneT, width: pw, height: laneHH }, svg);
    el("text", { "class": "axis-title", x: L + pw / 2, y: H - 6, "text-anchor": "middle" }, svg).textContent = "step";
    var yt = (lay.yaxis && lay.yaxis.title) || "";
    if (yt && !onlyLane) el("text", { "class": "axis-title", transform: "translate(14," + (T + ph / 2) + ") rotate(-90)", "text-anchor": "middle" }, svg).textContent = yt;
    if (r2 && y2lay.title) el("text", { "class": "axis-title", transform: "translate(" + (W - 8) + "," + (T + ph / 2) + ") rotate(-90)", "text-anchor": "middle" }, svg).textContent = y2lay.title;
    var g = el("g", { "clip-path": "url(#" + clipId + ")" }, svg);
    // stacked areas first, then lines, then markers on top
    series.forEach(function (s) {
      var t = s.t, Y = s.axis === "y2" ? Y2 : Y1, isLog = s.axis === "y2" ? y2log : log;
      if (!Y || s.axis === "y3") return;
      var color = colors[t.name], mode = t.mode || "lines";
      var ys = s.ys;
      var smooth = st.smooth > 0 && s.axis === "y" && !s.lower && mode.indexOf("lines") >= 0;
      function ok(v) { return finite(v) && (!isLog || v > 0); }
      if (s.lower) { // area between lower and ys
        var top = [], bottom = [];
        for (var i = 0; i < t.x.length; i++) if (ok(ys[i])) { top.push(X(t.x[i]) + "," + Y(ys[i])); bottom.unshift(X(t.x[i]) + "," + Y(Math.max(s.lower[i], isLog ? 1e-300 : s.lower[i]))); }
        if (top.length) el("polygon", { points: top.concat(bottom).join(" "), fill: color, "fill-opacity": 0.45, stroke: "none" }, g);
      }
      if (mode.indexOf("lines") >= 0) {
        var path = pathOf(t.x, ys, X, Y, ok, t.line && t.line.shape === "hv");
        el("path", { d: path, fill: "none", stroke: color, "stroke-width": (t.line && t.line.width) || 1.5,
          "stroke-dasharray": t.line && t.line.dash === "dot" ? "2,3" : null, "stroke-opacity": smooth ? 0.25 : 1 }, g);
        if (smooth) el("path", { d: pathOf(t.x, ema(ys, st.smooth), X, Y, ok, false), fill: "none", stroke: color, "stroke-width": 1.8 }, g);
        for (var k = 0; k < t.x.length; k++) { // a point with no drawn neighbour makes no line: a dot
          if (ok(ys[k]) && !(k > 0 && ok(ys[k - 1])) && !(k + 1 < t.x.length && ok(ys[k + 1])))
            el("circle", { "class": "lone", cx: X(t.x[k]).toFixed(1), cy: Y(ys[k]).toFixed(1), r: 3, fill: color }, g);
        }
      }
      if (mode.indexOf("markers") >= 0) {
        for (var j = 0; j < t.x.length; j++) if (ok(ys[j])) mark(g, X(t.x[j]), Y(ys[j]), (t.marker && t.marker.symbol) || "circle", color);
      }
    });
    var gm = el("g", { "class": "marks" }, svg);
    laneTraces.forEach(function (s, k) { // y3: event / NaN markers, each trace on its own row of the lane
      var t = s.t, y = laneT + ((k % laneRows) + 0.5) * laneHH / laneRows;
      for (var j = 0; j < t.x.length; j++) {
        if (t.x[j] < xs0 || t.x[j] > xs1) continue;
        mark(gm, Math.min(L + pw - 6, Math.max(L + 6, X(t.x[j]))), y, (t.marker && t.marker.symbol) || "x", colors[t.name]);
      }
    });
    // the hover area covers the lane too: a marker reads out its text there
    hover(svg, box, series, { L: L, T: T, pw: pw, ph: laneH ? laneT + laneHH - T : ph, X: X, xs0: xs0, xs1: xs1 }, st, fig, colors);
  }

  function pathOf(xs, ys, X, Y, ok, hv) {
    var d = "", pen = false, px = 0, py = 0;
    for (var i = 0; i < xs.length; i++) {
      if (!ok(ys[i])) { pen = false; continue; }
      var x = X(xs[i]), y = Y(ys[i]);
      if (!pen) d += "M" + x.toFixed(1) + "," + y.toFixed(1);
      else if (hv) d += "H" + x.toFixed(1) + "V" + y.toFixed(1);
      else d += "L" + x.toFixed(1) + "," + y.toFixed(1);
      pen = true; px = x; py = y;
    }
    return d || "M0,0";
  }
  function mark(parent, x, y, symbol, color) {
    var open = symbol.indexOf("x") === 0;
    el("path", { d: MARK[symbol] || MARK.circle, transform: "translate(" + x.toFixed(1) + "," + y.toFixed(1) + ")",
      stroke: color, fill: open ? "none" : color, "stroke-width": open ? 2 : 1 }, parent);
  }

  function hover(svg, box, series, geo, st, fig, colors) {
    var tip = h("div", "tip", box); tip.hidden = true;
    var cross = el("line", { "class": "cross", x1: 0, x2: 0, y1: geo.T, y2: geo.T + geo.ph, visibility: "hidden" }, svg);
    var band = el("rect", { "class": "zoomband", x: 0, y: geo.T, width: 0, height: geo.ph, visibility: "hidden" }, svg);
    var area = el("rect", { x: geo.L, y: geo.T, width: geo.pw, height: geo.ph, fill: "transparent" }, svg);
    var drag = null;
    function toX(ev) { var r = svg.getBoundingClientRect(); return ev.clientX - r.left; }
    function stepAt(px) { return geo.xs0 + (px - geo.L) / geo.pw * (geo.xs1 - geo.xs0); }
    area.addEventListener("mousemove", function (ev) {
      var px = toX(ev), x = stepAt(px);
      if (drag !== null) {
        band.setAttribute("x", Math.min(drag, px)); band.setAttribute("width", Math.abs(px - drag));
        band.setAttribute("visibility", "visible");
      }
      var best = null;
      series.forEach(function (s) {
        var i = bsearch(s.t.x, x);
        if (i < 0) return;
        if (best === null || Math.abs(s.t.x[i] - x) < Math.abs(best - x)) best = s.t.x[i];
      });
      if (best === null) return;
      var rows = [];
      series.forEach(function (s) {
        var i = bsearch(s.t.x, best);
        if (i < 0 || s.t.x[i] !== best) return;
        var v = s.t.text ? s.t.text[i] : s.lower ? s.ys[i] - s.lower[i] : s.t.y[i];
        if (v === null || v === undefined) v = "NaN/Inf";
        rows.push([s.t.name, typeof v === "number" ? fmt(v) : String(v)]);
      });
      if (!rows.length) return;
      var cx = geo.X(best);
      cross.setAttribute("x1", cx); cross.setAttribute("x2", cx); cross.setAttribute("visibility", "visible");
      tip.innerHTML = "";
      h("b", "", tip, "step " + best);
      rows.slice(0, 12).forEach(function (r) {
        var line = h("div", "", tip);
        var sw = h("span", "swatch", line); sw.style.background = colors[r[0]];
        line.appendChild(document.createTextNode(r[0] + ": " + r[1]));
      });
      tip.hidden = false;
      var left = cx + 12;
      if (left + tip.offsetWidth > box.clientWidth) left = Math.max(0, cx - 12 - tip.offsetWidth);
      tip.style.left = left + "px"; tip.style.top = (geo.T + 4) + "px";
    });
    area.addEventListener("mouseleave", function () { tip.hidden = true; cross.setAttribute("visibility", "hidden"); });
    area.addEventListener("mousedown", function (ev) { drag = toX(ev); ev.preventDefault(); });
    area.addEventListener("mouseup", function (ev) {
      if (drag === null) return;
      var a = stepAt(Math.min(drag, toX(ev))), b = stepAt(Math.max(drag, toX(ev)));
      band.setAttribute("visibility", "hidden");
      if (Math.abs(toX(ev) - drag) > 6) { st.zoom = [a, b]; render(svg.closest(".chart"), st.fig, st); }
      drag = null;
    });
    area.addEventListener("dblclick", function () { st.zoom = null; render(svg.closest(".chart"), st.fig, st); });
  }

  // ---- heatmap: cells drawn into a canvas (one pixel each), shown scaled inside the SVG
  var VIRIDIS = [[68, 1, 84], [72, 40, 120], [62, 74, 137], [49, 104, 142], [38, 130, 142], [31, 158, 137],
    [53, 183, 121], [109, 205, 89], [180, 222, 44], [253, 231, 37]];
  function viridis(f) {
    f = Math.min(1, Math.max(0, f)) * (VIRIDIS.length - 1);
    var i = Math.min(VIRIDIS.length - 2, Math.floor(f)), u = f - i, a = VIRIDIS[i], b = VIRIDIS[i + 1];
    return [0, 1, 2].map(function (k) { return Math.round(a[k] + (b[k] - a[k]) * u); });
  }
  function heatmap(svg, box, fig, st, W, H, measure) {
    var t = fig.data[0], rows = t.y, cols = t.x, z = t.z;
    var lo = Infinity, hi = -Infinity;
    z.forEach(function (r) { r.forEach(function (v) { if (finite(v)) { if (v < lo) lo = v; if (v > hi) hi = v; } }); });
    if (!finite(lo)) { lo = 0; hi = 1; }
    if (hi === lo) hi = lo + 1;
    var maxLabel = Math.min(W * 0.35, Math.max.apply(null, rows.map(function (r) { return measure(r); })));
    var cbw = 14, cbLabels = Math.max(measure(fmt(lo)), measure(fmt(hi)));
    var L = 8 + maxLabel + 6, R = 12 + cbw + 6 + cbLabels + 8, T = 8, B = 40;
    var pw = W - L - R, ph = H - T - B;
    if (pw < 40) return;
    // a column starts at its step (a bucket's first step) and lasts until the next column's; the
    // last one as long as the gap before it. So the first column starts at the first step's tick,
    // and columns of uneven gaps (appended live, a detail step off the schedule) stay on the axis
    var n = cols.length, gap = n > 1 ? cols[n - 1] - cols[n - 2] : 1;
    var edges = cols.concat([cols[n - 1] + (gap > 0 ? gap : 1)]);
    var xa = edges[0], xb = edges[n];
    function colAt(x) { // the column whose [edges[c], edges[c + 1]) holds x
      var a = 0, b = n - 1;
      while (a < b) { var m = (a + b + 1) >> 1; if (edges[m] <= x) a = m; else b = m - 1; }
      return a;
    }
    // one canvas pixel per screen pixel across, one per row down
    var PX = Math.max(1, Math.round(pw)), at = [];
    for (var px = 0; px < PX; px++) at.push(colAt(xa + (px + 0.5) / PX * (xb - xa)));
    var canvas = document.createElement("canvas");
    canvas.width = PX; canvas.height = rows.length;
    var ctx = canvas.getContext("2d"), img = ctx.createImageData(PX, rows.length);
    for (var r = 0; r < rows.length; r++) for (var q = 0; q < PX; q++) {
      var v = z[r][at[q]], o = (r * PX + q) * 4;
      if (!finite(v)) { img.data[o + 3] = 0; continue; }
      var rgb = viridis((v - lo) / (hi - lo));
      img.data[o] = rgb[0]; img.data[o + 1] = rgb[1]; img.data[o + 2] = rgb[2]; img.data[o + 3] = 255;
    }
    ctx.putImageData(img, 0, 0);
    el("image", { href: canvas.toDataURL(), x: L, y: T, width: pw, height: ph, preserveAspectRatio: "none",
      style: "image-rendering:pixelated" }, svg);
    var rowH = ph / rows.length;
    rows.forEach(function (name, i) {
      if (rowH < 11 && i % Math.ceil(11 / rowH)) return; // too dense: label every k-th row
      var label = name;
      while (measure(label) > maxLabel && label.length > 4) label = "\u2026" + label.slice(2);
      var tx = el("text", { "class": "tick", x: L - 6, y: T + (i + 0.5) * rowH + 4, "text-anchor": "end" }, svg);
      tx.textContent = label;
      if (label !== name) el("title", {}, tx).textContent = name;
    });
    var tx2 = linTicks(xa, xb, Math.max(2, Math.floor(pw / (measure(fmtStep(xb)) + 24))), true);
    tx2.forEach(function (v) {
      var x = L + (v - xa) / (xb - xa) * pw;
      if (x < L || x > L + pw || (v < 0 && xa >= 0)) return; // no tick before step 0
      el("text", { "class": "tick x", x: x, y: T + ph + 15, "text-anchor": "middle" }, svg).textContent = fmtStep(v);
    });
    el("rect", { "class": "frame", x: L, y: T, width: pw, height: ph }, svg);
    el("text", { "class": "axis-title", x: L + pw / 2, y: H - 6, "text-anchor": "middle" }, svg).textContent = "step";
    // colour bar
    var cbx = L + pw + 12, grad = el("linearGradient", { id: "cb-" + fig.id, x1: 0, x2: 0, y1: 1, y2: 0 }, el("defs", {}, svg));
    for (var k = 0; k <= 8; k++) {
      var rgb2 = viridis(k / 8);
      el("stop", { offset: k / 8, "stop-color": "rgb(" + rgb2.join(",") + ")" }, grad);
    }
    el("rect", { x: cbx, y: T, width: cbw, height: ph, fill: "url(#cb-" + fig.id + ")" }, svg);
    el("text", { "class": "tick", x: cbx + cbw + 4, y: T + 10, "text-anchor": "start" }, svg).textContent = fmt(hi);
    el("text", { "class": "tick", x: cbx + cbw + 4, y: T + ph, "text-anchor": "start" }, svg).textContent = fmt(lo);
    // non-finite cells
    fig.data.slice(1).forEach(function (m) {
      m.x.forEach(function (xv, i) {
        var ri = rows.indexOf(m.y[i]), c = colAt(xv);
        if (ri < 0) return;
        mark(svg, L + ((edges[c] + edges[c + 1]) / 2 - xa) / (xb - xa) * pw, T + (ri + 0.5) * rowH, "x", "#d62728");
      });
    });
    var tip = h("div", "tip", box); tip.hidden = true;
    var area = el("rect", { x: L, y: T, width: pw, height: ph, fill: "transparent" }, svg);
    area.addEventListener("mousemove", function (ev) {
      var rc = svg.getBoundingClientRect(), px = ev.clientX - rc.left, py = ev.clientY - rc.top;
      var c = colAt(xa + Math.min(1, Math.max(0, (px - L) / pw)) * (xb - xa));
      var r = Math.min(rows.length - 1, Math.max(0, Math.floor((py - T) / rowH)));
      var v = z[r][c];
      tip.textContent = rows[r] + ", step \u2248 " + fmtStep(cols[c]) + ": log10 \u2016g\u2016 = " + (finite(v) ? v.toFixed(2) : "none");
      tip.hidden = false;
      var left = px + 12;
      if (left + tip.offsetWidth > box.clientWidth) left = Math.max(0, px - 12 - tip.offsetWidth);
      tip.style.left = left + "px"; tip.style.top = Math.max(0, py - 30) + "px";
    });
    area.addEventListener("mouseleave", function () { tip.hidden = true; });
  }

  function drawAll(figs) {
    figs.forEach(function (f) {
      var c = document.getElementById("chart-" + f.id);
      if (c) draw(c, f);
    });
  }

  // ---- live updates: ask only for steps after the last one seen and append them
  var CAP = 6000; // points per trace kept by the page; beyond it the page asks for a fresh downsampled copy
  function mergeFigure(old, inc) {
    if (!old) return inc;
    if (!inc.data.length) return old;
    if (!old.data.length) return inc;
    if (old.data[0].type === "heatmap" || inc.data[0].type === "heatmap") {
      var a = old.data[0], b = inc.data[0];
      if (a.type !== b.type || a.y.join("\n") !== b.y.join("\n")) return null;
      var last = a.x[a.x.length - 1];
      b.x.forEach(function (x, c) {
        if (x <= last) return;
        a.x.push(x);
        for (var r = 0; r < a.z.length; r++) a.z[r].push(b.z[r][c]);
      });
      old.data = [a].concat(inc.data.slice(1));
    } else {
      var byName = {};
      old.data.forEach(function (t) { byName[t.name] = t; });
      inc.data.forEach(function (t) {
        var o = byName[t.name];
        if (!o) { old.data.push(t); byName[t.name] = t; return; }
        var last = o.x.length ? o.x[o.x.length - 1] : -Infinity;
        for (var i = 0; i < t.x.length; i++) {
          if (t.x[i] <= last) continue;
          o.x.push(t.x[i]); o.y.push(t.y[i]);
          if (o.text && t.text) o.text.push(t.text[i]);
        }
      });
    }
    // the summary describes the whole run: an increment's would describe only its new steps; the
    // periodic full refresh brings the new one
    return old;
  }
  function tooBig(figs) {
    return figs.some(function (f) {
      return f.data.some(function (t) { return (t.x && t.x.length > CAP) || (t.z && t.x.length > 4 * 200); });
    });
  }

  function live(url, token, everyMs, initial) {
    // initial: what the page was rendered with ({figures, last_step, frag}): the first poll is incremental
    var headers = token ? { "Authorization": "Bearer " + token } : {};
    var figs = initial ? initial.figures : null, since = initial ? initial.last_step : null;
    var frag = initial ? initial.frag : "";
    if (since === undefined) since = null;
    function q(params) {
      var u = new URL(url, location.href);
      for (var k in params) if (params[k] !== null && params[k] !== undefined) u.searchParams.set(k, params[k]);
      return u.toString();
    }
    var polls = 0, FULL_EVERY = 15; // a full (re-downsampled) copy every 15 polls, 30 s
    async function poll() {
      try {
        if (++polls % FULL_EVERY === 0) since = null;
        var r = await fetch(q({ since_step: since, frag: frag }), { headers: headers, cache: "no-store" });
        if (r.ok) {
          var v = await r.json();
          if (since === null || !figs) figs = v.figures;
          else {
            var byId = {}, rebuild = false;
            figs.forEach(function (f) { byId[f.id] = f; });
            figs = v.figures.map(function (f) {
              var m = mergeFigure(byId[f.id], f);
              if (m === null) { rebuild = true; return f; }
              return m;
            });
            if (rebuild || tooBig(figs)) { since = null; figs = null; setTimeout(poll, 0); return; }
          }
          drawAll(figs);
          if (v.last_step !== null && v.last_step !== undefined) since = v.last_step;
          if (v.frag && v.frag !== frag) {
            frag = v.frag;
            ["verdict", "summary", "ranks", "cards", "events", "meta"].forEach(function (key) {
              var e = document.getElementById(key), html = v[key + "_html"];
              if (e && html !== undefined && e.innerHTML !== html) e.innerHTML = html;
            });
          }
          var s = document.getElementById("status");
          s.textContent = v.status; s.className = "badge " + v.status + " " + (v.level || "");
          document.getElementById("updated").textContent = "updated " + new Date().toLocaleTimeString();
          if (v.status !== "running") return; // a finished run no longer changes
        }
      } catch (e) { document.getElementById("updated").textContent = "connection lost, retrying"; }
      setTimeout(poll, everyMs);
    }
    setTimeout(poll, everyMs);
  }

  var resizeTimer = null;
  window.addEventListener("resize", function () {
    clearTimeout(resizeTimer);
    resizeTimer = setTimeout(function () {
      Object.keys(state).forEach(function (id) {
        var c = document.getElementById("chart-" + id);
        if (c && state[id].fig && state[id].fig.data.length) render(c, state[id].fig, state[id]);
      });
    }, 150);
  });

  window.tdCharts = { draw: drawAll, live: live, fmt: fmt, logTicks: logTicks, ema: ema, merge: mergeFigure };
})();
