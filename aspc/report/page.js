// The report's timelines, drawn on a canvas (tens of thousands of spans), with zoom, pan and hover.
// Data: the JSON in #timeline-data (aspc/report/timeline.py). Each schedule has its own time scale
// above its rows: fitted to its own length (the default, so a short schedule is as readable as a
// long one) or, with "one time axis", the longest schedule's, to compare lengths. The view is a
// window [from, to] of fractions of each scale, so zoom and pan move every schedule alike.
(function () {
  "use strict";
  var data = JSON.parse(document.getElementById("timeline-data").textContent);
  var COLORS = data.colors;
  var canvas = document.getElementById("timeline");
  var tip = document.getElementById("timeline-tip");
  var sharedBox = document.getElementById("shared-axis");
  var ctx = canvas.getContext("2d");
  var ROW = 16, HEAD = 20, SCALE = 18, TOP = 4, LEFT = 120, RIGHT = 12, PANEL_GAP = 12, MIN_VIEW = 1e-5;
  var view = { from: 0, to: 1 };
  var panels = [], height = TOP, mouse = null, drag = null;
  data.schedules.forEach(function (s) {
    panels.push({ schedule: s, top: height, rowsTop: height + HEAD + SCALE });
    height += HEAD + SCALE + s.rows.length * ROW + PANEL_GAP;
  });
  var hatch = makeHatch();

  function makeHatch() {
    var c = document.createElement("canvas");
    c.width = 6; c.height = 6;
    var g = c.getContext("2d");
    g.fillStyle = "#fff"; g.fillRect(0, 0, 6, 6);
    g.strokeStyle = "#e0e0e0"; g.beginPath(); g.moveTo(0, 6); g.lineTo(6, 0); g.stroke();
    return ctx.createPattern(c, "repeat");
  }
  function width() { return canvas.clientWidth; }
  function plotWidth() { return width() - LEFT - RIGHT; }
  function shared() { return sharedBox.checked; }
  // a panel's scale in ticks: its own length, or the longest schedule's on one axis
  function extent(panel) { return shared() ? data.ticks : Math.max(1, panel.schedule.wall_s / data.tick_s); }
  function fracOf(x) { return view.from + (x - LEFT) / plotWidth() * (view.to - view.from); }
  function xOfFrac(f) { return LEFT + (f - view.from) / (view.to - view.from) * plotWidth(); }
  function xOf(panel, t) { return xOfFrac(t / extent(panel)); }
  function tOf(panel, x) { return fracOf(x) * extent(panel); }
  function seconds(t) { return t * data.tick_s; }
  function fmt(s) { return s === 0 ? "0" : s >= 100 ? s.toFixed(0) : s >= 1 ? s.toFixed(2) : s.toFixed(4); }
  function color(c) { return COLORS[data.categories[c]] || "#999"; }

  function resize() {
    var dpr = window.devicePixelRatio || 1, w = canvas.parentElement.clientWidth;
    canvas.width = Math.round(w * dpr); canvas.height = Math.round(height * dpr);
    canvas.style.width = w + "px"; canvas.style.height = height + "px";
    ctx.setTransform(dpr, 0, 0, dpr, 0, 0);
    draw();
  }

  function niceStep(range) {
    var raw = range / 8, p = Math.pow(10, Math.floor(Math.log10(raw)));
    var m = raw / p;
    return p * (m < 1.5 ? 1 : m < 3.5 ? 2 : m < 7.5 ? 5 : 10);
  }

  function drawScale(panel) {
    var e = extent(panel), from = seconds(view.from * e), to = seconds(view.to * e), step = niceStep(to - from);
    var y = panel.top + HEAD, bottom = panel.rowsTop + panel.schedule.rows.length * ROW;
    ctx.fillStyle = "#424242"; ctx.font = "11px system-ui, sans-serif"; ctx.textAlign = "center";
    for (var s = Math.ceil(from / step) * step; s <= to; s += step) {
      var x = xOf(panel, s / data.tick_s);
      ctx.fillText(fmt(s) + " s", x, y + 12);
      ctx.strokeStyle = "#eeeeee"; ctx.beginPath(); ctx.moveTo(x, y + SCALE - 4); ctx.lineTo(x, bottom); ctx.stroke();
    }
    ctx.textAlign = "left";
  }

  function drawSpan(panel, span, y) {
    var x0 = Math.max(LEFT, xOf(panel, span[0])), x1 = Math.min(width() - RIGHT, xOf(panel, span[1]));
    if (x1 < LEFT || x0 > width() - RIGHT) return;
    var w = Math.max(1, x1 - x0);
    if (span[3] < 0) {  // a summary of short spans: stacked by each category's share
      var yy = y + 1;
      span[4].forEach(function (share) {
        var h = (ROW - 2) * share[1] / 1000;
        ctx.fillStyle = color(share[0]); ctx.fillRect(x0, yy, w, h); yy += h;
      });
      return;
    }
    ctx.fillStyle = color(span[2]); ctx.fillRect(x0, y + 1, w, ROW - 2);
    if (data.categories[span[2]] === "sync") {  // weight sync or pool switch: a marker above the row
      ctx.fillStyle = "#0d47a1"; ctx.beginPath();
      ctx.moveTo(x0 - 4, y - 3); ctx.lineTo(x0 + 4, y - 3); ctx.lineTo(x0, y + 3); ctx.fill();
    }
  }

  function drawTitle(panel) {
    var s = panel.schedule;
    ctx.fillStyle = "#212121"; ctx.font = "bold 12px system-ui, sans-serif";
    ctx.fillText(s.name + "  (" + fmt(s.wall_s) + " s, " + s.spans + " spans" +
                 (s.summarised ? ", short spans summarised" : "") + ")" +
                 (shared() ? "" : "  \u00b7 time scale fitted to its length"), 4, panel.top + 15);
  }

  function drawRow(panel, row, ry) {
    ctx.font = "11px system-ui, sans-serif"; ctx.fillStyle = "#424242"; ctx.fillText(row.name, 8, ry + ROW - 4);
    var end = Math.min(width() - RIGHT, xOf(panel, panel.schedule.wall_s / data.tick_s));
    var device = row.name !== "tools" && !/ switch$/.test(row.name);  // runners, pool switches: no device row
    if (device && end > LEFT) { ctx.fillStyle = hatch; ctx.fillRect(LEFT, ry + 1, end - LEFT, ROW - 2); }
    row.spans.forEach(function (span) { drawSpan(panel, span, ry); });
  }

  function draw() {
    ctx.clearRect(0, 0, width(), height);
    panels.forEach(function (panel) {
      drawTitle(panel);
      drawScale(panel);
      panel.schedule.rows.forEach(function (row, i) { drawRow(panel, row, panel.rowsTop + i * ROW); });
    });
    canvas.dataset.view = view.from + "-" + view.to;
    canvas.dataset.axis = shared() ? "shared" : "fit";
    document.getElementById("view-range").textContent = describeView();
  }

  function describeView() {
    if (shared()) {
      return "showing " + fmt(seconds(view.from * data.ticks)) + " s to " + fmt(seconds(view.to * data.ticks)) + " s";
    }
    return "showing " + (100 * view.from).toFixed(1) + "% to " + (100 * view.to).toFixed(1) + "% of each schedule";
  }

  function setView(from, range) {
    range = Math.min(1, Math.max(MIN_VIEW, range));
    from = Math.max(0, Math.min(1 - range, from));
    view = { from: from, to: from + range };
    draw();
  }

  // the fraction under x stays under x: the cursor's point for the wheel, the left edge for the buttons
  function zoom(factor, x) {
    var anchor = fracOf(x), range = view.to - view.from, next = Math.min(1, Math.max(MIN_VIEW, range * factor));
    setView(anchor - (anchor - view.from) * next / range, next);
  }

  function reset() { setView(0, 1); }

  function panelAt(y) {
    for (var p = 0; p < panels.length; p++) {
      var panel = panels[p], i = Math.floor((y - panel.rowsTop) / ROW);
      if (i >= 0 && i < panel.schedule.rows.length) return { panel: panel, row: panel.schedule.rows[i] };
    }
    return null;
  }

  function hit(x, y) {
    var at = panelAt(y);
    if (!at) return null;
    var t = tOf(at.panel, x), found = null;
    var slack = (view.to - view.from) * extent(at.panel) / plotWidth();  // a pixel, for spans thinner than one
    at.row.spans.forEach(function (s) { if (s[0] - slack <= t && t <= s[1] + slack) found = s; });
    return { schedule: at.panel.schedule, row: at.row, span: found, t: t };
  }

  function describe(h) {
    var head = h.schedule.name + " \u00b7 " + h.row.name + "\n", at = "\nat " + fmt(seconds(h.t)) + " s";
    var s = h.span;
    if (!s) return head + "no work recorded" + at;
    var when = fmt(seconds(s[0])) + " - " + fmt(seconds(s[1])) + " s (" + fmt(seconds(s[1] - s[0])) + " s)";
    if (s[3] < 0) {
      return head + when + "\n" + (-s[3]) + " short spans summarised:\n" + s[4].map(function (sh) {
        return "  " + data.categories[sh[0]] + " " + (sh[1] / 10).toFixed(1) + "%";
      }).join("\n") + at;
    }
    var label = data.labels[s[3]];
    return head + data.categories[s[2]] + (label ? ": " + label : "") + "\n" + when + at;
  }

  function showTip() {
    var h = mouse && mouse.x > LEFT ? hit(mouse.x, mouse.y) : null;
    if (!h) { tip.hidden = true; return; }
    tip.textContent = describe(h);
    tip.hidden = false;
    tip.style.left = Math.min(mouse.x + 14, width() - 260) + "px";
    tip.style.top = (mouse.y + 14) + "px";
  }

  function pointer(e) {
    var r = canvas.getBoundingClientRect();
    return { x: e.clientX - r.left, y: e.clientY - r.top };
  }

  canvas.addEventListener("mousemove", function (e) {
    mouse = pointer(e);
    if (!drag) { showTip(); return; }
    var range = drag.to - drag.from;
    setView(drag.from + (drag.x - mouse.x) / plotWidth() * range, range);
  });
  canvas.addEventListener("mousedown", function (e) { drag = { x: pointer(e).x, from: view.from, to: view.to }; });
  window.addEventListener("mouseup", function () { drag = null; });
  canvas.addEventListener("mouseleave", function () { mouse = null; tip.hidden = true; });
  canvas.addEventListener("wheel", function (e) {
    e.preventDefault();
    mouse = pointer(e);
    zoom(e.deltaY > 0 ? 1.25 : 0.8, Math.max(LEFT, mouse.x));
    showTip();
  }, { passive: false });
  canvas.addEventListener("dblclick", reset);
  document.getElementById("zoom-in").addEventListener("click", function () { zoom(0.5, LEFT); });
  document.getElementById("zoom-out").addEventListener("click", function () { zoom(2, LEFT); });
  document.getElementById("zoom-reset").addEventListener("click", reset);
  sharedBox.addEventListener("change", reset);
  document.querySelectorAll(".picker input").forEach(function (input) {
    input.addEventListener("change", function () { document.body.dataset.show = input.value; });
  });
  window.addEventListener("resize", resize);
  resize();
  canvas.dataset.layout = JSON.stringify({ left: LEFT, right: RIGHT, row: ROW, panels: panels.map(function (p) {
    return { name: p.schedule.name, rows_top: p.rowsTop, rows: p.schedule.rows.length };
  }) });
  document.body.dataset.ready = "true";
})();
