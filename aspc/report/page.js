// The report's timelines: every schedule on one time axis, drawn on a canvas (tens of thousands of
// spans), with zoom, pan and hover. Data: the JSON in #timeline-data (aspc/report/timeline.py).
(function () {
  "use strict";
  var data = JSON.parse(document.getElementById("timeline-data").textContent);
  var COLORS = data.colors;
  var canvas = document.getElementById("timeline");
  var tip = document.getElementById("timeline-tip");
  var ctx = canvas.getContext("2d");
  var ROW = 16, HEAD = 22, AXIS = 26, LEFT = 120, RIGHT = 12, PANEL_GAP = 10;
  var view = { from: 0, to: data.ticks };
  var panels = [], height = AXIS;
  data.schedules.forEach(function (s) {
    panels.push({ schedule: s, top: height });
    height += HEAD + s.rows.length * ROW + PANEL_GAP;
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
  function xOf(t) { return LEFT + (t - view.from) / (view.to - view.from) * (width() - LEFT - RIGHT); }
  function tOf(x) { return view.from + (x - LEFT) / (width() - LEFT - RIGHT) * (view.to - view.from); }
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

  function drawAxis() {
    var from = seconds(view.from), to = seconds(view.to), step = niceStep(to - from);
    ctx.fillStyle = "#424242"; ctx.font = "11px system-ui, sans-serif"; ctx.textAlign = "center";
    for (var s = Math.ceil(from / step) * step; s <= to; s += step) {
      var x = xOf(s / data.tick_s);
      ctx.fillText(fmt(s) + " s", x, 14);
      ctx.strokeStyle = "#eeeeee"; ctx.beginPath(); ctx.moveTo(x, AXIS - 6); ctx.lineTo(x, height); ctx.stroke();
    }
    ctx.textAlign = "left";
  }

  function drawSpan(span, y) {
    var x0 = Math.max(LEFT, xOf(span[0])), x1 = Math.min(width() - RIGHT, xOf(span[1]));
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

  function draw() {
    ctx.clearRect(0, 0, width(), height);
    drawAxis();
    panels.forEach(function (panel) {
      var s = panel.schedule, y = panel.top;
      ctx.fillStyle = "#212121"; ctx.font = "bold 12px system-ui, sans-serif";
      ctx.fillText(s.name + "  (" + fmt(s.wall_s) + " s, " + s.spans + " spans" +
                   (s.summarised ? ", short spans summarised" : "") + ")", 4, y + 15);
      ctx.font = "11px system-ui, sans-serif";
      s.rows.forEach(function (row, i) {
        var ry = y + HEAD + i * ROW;
        ctx.fillStyle = "#424242"; ctx.fillText(row.name, 8, ry + ROW - 4);
        var end = Math.min(width() - RIGHT, xOf(s.wall_s / data.tick_s));
        var device = row.name !== "tools" && !/ switch$/.test(row.name);  // runners, pool switches: no device row
        if (device && end > LEFT) { ctx.fillStyle = hatch; ctx.fillRect(LEFT, ry + 1, end - LEFT, ROW - 2); }
        row.spans.forEach(function (span) { drawSpan(span, ry); });
      });
    });
    canvas.dataset.view = view.from + "-" + view.to;
    document.getElementById("view-range").textContent =
      "showing " + fmt(seconds(view.from)) + " s to " + fmt(seconds(view.to)) + " s";
  }

  function zoom(factor, centerX) {
    var c = tOf(centerX === undefined ? (LEFT + width()) / 2 : centerX);
    var span = Math.min(data.ticks, Math.max(10, (view.to - view.from) * factor));
    var from = Math.max(0, Math.min(data.ticks - span, c - (c - view.from) * span / (view.to - view.from)));
    view = { from: from, to: from + span };
    draw();
  }

  function hit(x, y) {
    for (var p = 0; p < panels.length; p++) {
      var panel = panels[p], i = Math.floor((y - panel.top - HEAD) / ROW);
      if (y < panel.top + HEAD || i < 0 || i >= panel.schedule.rows.length) continue;
      var row = panel.schedule.rows[i], t = tOf(x), found = null;
      var slack = (view.to - view.from) / (width() - LEFT - RIGHT);  // a pixel, for spans thinner than one
      row.spans.forEach(function (s) { if (s[0] - slack <= t && t <= s[1] + slack) found = s; });
      return { schedule: panel.schedule, row: row, span: found, t: t };
    }
    return null;
  }

  function describe(h) {
    var head = h.schedule.name + " \u00b7 " + h.row.name + "\n";
    var s = h.span;
    if (!s) return head + "no work recorded at " + fmt(seconds(h.t)) + " s";
    var when = fmt(seconds(s[0])) + " - " + fmt(seconds(s[1])) + " s (" + fmt(seconds(s[1] - s[0])) + " s)";
    if (s[3] < 0) {
      return head + when + "\n" + (-s[3]) + " short spans summarised:\n" + s[4].map(function (sh) {
        return "  " + data.categories[sh[0]] + " " + (sh[1] / 10).toFixed(1) + "%";
      }).join("\n");
    }
    var label = data.labels[s[3]];
    return head + data.categories[s[2]] + (label ? ": " + label : "") + "\n" + when;
  }

  canvas.addEventListener("mousemove", function (e) {
    var r = canvas.getBoundingClientRect(), x = e.clientX - r.left, y = e.clientY - r.top;
    if (drag) {
      var dt = (drag.x - x) / (width() - LEFT - RIGHT) * (view.to - view.from);
      var from = Math.max(0, Math.min(data.ticks - (view.to - view.from), drag.from + dt));
      view = { from: from, to: from + (drag.to - drag.from) };
      draw();
      return;
    }
    var h = x > LEFT ? hit(x, y) : null;
    if (!h) { tip.hidden = true; return; }
    tip.textContent = describe(h);
    tip.hidden = false;
    tip.style.left = Math.min(x + 14, width() - 260) + "px";
    tip.style.top = (y + 14) + "px";
  });
  var drag = null;
  canvas.addEventListener("mousedown", function (e) { drag = { x: e.clientX - canvas.getBoundingClientRect().left, from: view.from, to: view.to }; });
  window.addEventListener("mouseup", function () { drag = null; });
  canvas.addEventListener("mouseleave", function () { tip.hidden = true; });
  canvas.addEventListener("wheel", function (e) {
    e.preventDefault();
    zoom(e.deltaY > 0 ? 1.25 : 0.8, e.clientX - canvas.getBoundingClientRect().left);
  }, { passive: false });
  canvas.addEventListener("dblclick", function () { view = { from: 0, to: data.ticks }; draw(); });
  document.getElementById("zoom-in").addEventListener("click", function () { zoom(0.5); });
  document.getElementById("zoom-out").addEventListener("click", function () { zoom(2); });
  document.getElementById("zoom-reset").addEventListener("click", function () { view = { from: 0, to: data.ticks }; draw(); });
  document.querySelectorAll(".picker input").forEach(function (input) {
    input.addEventListener("change", function () { document.body.dataset.show = input.value; });
  });
  window.addEventListener("resize", resize);
  resize();
  document.body.dataset.ready = "true";
})();
