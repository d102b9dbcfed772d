// Line charts as SVG, written for dtrain's dashboard: no library, no build step.
//
//   DtrainCharts.draw(figure, {title, xLabel, series: [{name, color, points: [[x, y], ...],
//                                                        smooth: bool, markers: bool}]}, smoothing)
//
// Each series is drawn as a polyline with every point it was given (class "raw", data-series=name,
// data-points=count), and, when `smooth` is set and smoothing > 0, a second polyline of the
// exponential moving average (TensorBoard's, debiased so the start is not pulled towards 0).
"use strict";

const DtrainCharts = (() => {
  const W = 560, H = 260, M = { left: 58, right: 14, top: 30, bottom: 34 };
  const NS = "http://www.w3.org/2000/svg";
  const COLORS = ["#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#17becf", "#8c564b", "#e377c2"];

  function el(name, attrs, parent) {
    const node = document.createElementNS(NS, name);
    for (const [k, v] of Object.entries(attrs || {})) node.setAttribute(k, v);
    if (parent) parent.appendChild(node);
    return node;
  }

  // Exponential moving average with TensorBoard's debiasing.
  function smooth(points, weight) {
    let last = 0, n = 0;
    return points.map(([x, y]) => {
      last = last * weight + (1 - weight) * y;
      n += 1;
      return [x, last / (1 - Math.pow(weight, n))];
    });
  }

  // Round tick values: 1, 2 or 5 times a power of ten, about `count` of them.
  function ticks(lo, hi, count) {
    if (!(hi > lo)) return [lo];
    const raw = (hi - lo) / count;
    const mag = Math.pow(10, Math.floor(Math.log10(raw)));
    const step = [1, 2, 5, 10].map((f) => f * mag).find((s) => s >= raw);
    const out = [];
    for (let v = Math.ceil(lo / step) * step; v <= hi + step * 1e-9; v += step) out.push(+v.toPrecision(12));
    return out;
  }

  function fmt(v) {
    const a = Math.abs(v);
    if (a !== 0 && (a < 1e-3 || a >= 1e5)) return v.toExponential(1);
    return +v.toPrecision(4) + "";
  }

  function draw(figure, spec, smoothing) {
    figure.replaceChildren();
    const series = spec.series.filter((s) => s.points.length > 0);
    const caption = document.createElement("figcaption");
    caption.textContent = spec.title;
    figure.appendChild(caption);
    const svg = el("svg", { viewBox: `0 0 ${W} ${H}`, role: "img", "aria-label": spec.title }, figure);
    if (!series.length) {
      el("text", { x: W / 2, y: H / 2, "text-anchor": "middle", class: "nodata" }, svg).textContent =
        spec.empty || "no data yet";
      return;
    }
    let [x0, x1, y0, y1] = [Infinity, -Infinity, Infinity, -Infinity];
    for (const s of series) {
      for (const [x, y] of s.points) {
        [x0, x1, y0, y1] = [Math.min(x0, x), Math.max(x1, x), Math.min(y0, y), Math.max(y1, y)];
      }
    }
    if (x0 === x1) [x0, x1] = [x0 - 1, x1 + 1];
    if (y0 === y1) [y0, y1] = [y0 - Math.abs(y0 || 1) * 0.05, y1 + Math.abs(y1 || 1) * 0.05];
    const pad = (y1 - y0) * 0.05;
    [y0, y1] = [y0 - pad, y1 + pad];
    const sx = (x) => M.left + ((x - x0) / (x1 - x0)) * (W - M.left - M.right);
    const sy = (y) => H - M.bottom - ((y - y0) / (y1 - y0)) * (H - M.top - M.bottom);

    const axes = el("g", { class: "axes" }, svg);
    for (const t of ticks(y0, y1, 5)) {
      el("line", { x1: M.left, x2: W - M.right, y1: sy(t), y2: sy(t), class: "grid" }, axes);
      el("text", { x: M.left - 6, y: sy(t) + 4, "text-anchor": "end" }, axes).textContent = fmt(t);
    }
    for (const t of ticks(x0, x1, 6)) {
      el("line", { x1: sx(t), x2: sx(t), y1: H - M.bottom, y2: H - M.bottom + 4, class: "tick" }, axes);
      el("text", { x: sx(t), y: H - M.bottom + 16, "text-anchor": "middle" }, axes).textContent = fmt(t);
    }
    el("text", { x: (M.left + W - M.right) / 2, y: H - 4, "text-anchor": "middle", class: "label" }, axes)
      .textContent = spec.xLabel || "step";

    series.forEach((s, i) => {
      const color = s.color || COLORS[i % COLORS.length];
      const path = (pts) => pts.map(([x, y]) => `${sx(x).toFixed(1)},${sy(y).toFixed(1)}`).join(" ");
      const smoothed = s.smooth && smoothing > 0;
      el("polyline", {
        points: path(s.points), class: "raw" + (smoothed ? " faint" : ""), stroke: color,
        "data-series": s.name, "data-points": s.points.length,
      }, svg);
      if (smoothed) el("polyline", { points: path(smooth(s.points, smoothing)), class: "smooth", stroke: color }, svg);
      if (s.markers) {
        for (const [x, y] of s.points) {
          el("circle", { cx: sx(x), cy: sy(y), r: 2.5, fill: color }, svg)
            .appendChild(el("title")).textContent = `${s.name} at ${fmt(x)}: ${fmt(y)}`;
        }
      }
      if (spec.legend !== false) {
        const lx = M.left + 4 + i * 130;
        el("rect", { x: lx, y: 8, width: 10, height: 10, fill: color }, svg);
        el("text", { x: lx + 14, y: 17, class: "legend" }, svg).textContent = s.name;
      }
    });
    hover(svg, series, sx, sy, x0, x1);
  }

  // A vertical rule and the values of every series at the step nearest the pointer.
  function hover(svg, series, sx, sy, x0, x1) {
    const rule = el("line", { y1: M.top, y2: H - M.bottom, class: "rule", visibility: "hidden" }, svg);
    const label = el("text", { y: M.top + 10, class: "readout", visibility: "hidden" }, svg);
    svg.addEventListener("mousemove", (ev) => {
      const box = svg.getBoundingClientRect();
      const px = ((ev.clientX - box.left) / box.width) * W;
      const x = x0 + ((px - M.left) / (W - M.left - M.right)) * (x1 - x0);
      const parts = [];
      let at = null;
      for (const s of series) {
        let best = s.points[0];
        for (const p of s.points) if (Math.abs(p[0] - x) < Math.abs(best[0] - x)) best = p;
        at = at === null ? best[0] : at;
        parts.push(`${s.name} ${fmt(best[1])}`);
      }
      rule.setAttribute("x1", sx(at));
      rule.setAttribute("x2", sx(at));
      label.setAttribute("x", Math.min(sx(at) + 6, W - 200));
      label.textContent = `step ${fmt(at)}: ${parts.join(", ")}`;
      rule.setAttribute("visibility", "visible");
      label.setAttribute("visibility", "visible");
    });
    svg.addEventListener("mouseleave", () => {
      rule.setAttribute("visibility", "hidden");
      label.setAttribute("visibility", "hidden");
    });
  }

  // The four charts of a run (or of several overlaid), from metrics rows. `runs` is
  // [{name, rows, color}]; a single run gets one colour per series instead.
  function specs(runs) {
    const single = runs.length === 1;
    const pick = (rows, key) =>
      rows.filter((r) => typeof r[key] === "number" && typeof r.step === "number").map((r) => [r.step, r[key]]);
    const has = (key) => runs.some((r) => r.rows.some((row) => typeof row[key] === "number"));
    const quality = has("eval_accuracy") ? ["eval_accuracy", "accuracy (eval)"]
      : has("eval_perplexity") ? ["eval_perplexity", "perplexity (eval)"]
      : has("perplexity") ? ["perplexity", "perplexity"] : ["eval_accuracy", "accuracy (eval)"];
    const speed = has("tokens_per_s") ? ["tokens_per_s", "throughput (tokens/s)"] : ["samples_per_s", "throughput (samples/s)"];
    const chart = (title, parts) => ({
      title,
      legend: single, // several runs: the page's table says which colour is which run
      series: runs.flatMap((run, i) => parts.map(([key, label, opts], j) => ({
        name: single ? label : `${run.name}${parts.length > 1 ? " " + label : ""}`,
        color: single ? COLORS[j] : COLORS[i % COLORS.length],
        points: pick(run.rows, key),
        ...opts,
      }))),
    });
    return {
      loss: chart("loss", [["loss", "loss", { smooth: true }], ["eval_loss", "eval loss", { markers: true }]]),
      quality: chart(quality[1], [[quality[0], quality[0].replace("eval_", ""), { markers: true }]]),
      lr: chart("learning rate", [["lr", "lr", {}]]),
      throughput: chart(speed[1], [[speed[0], speed[0], { smooth: true }]]),
    };
  }

  // Draws specs(runs) into #chart-<name> and redraws when the smoothing slider moves.
  function board(getRuns) {
    const slider = document.getElementById("smoothing");
    const shown = document.getElementById("smoothing-value");
    const redraw = () => {
      const weight = +slider.value;
      shown.textContent = weight.toFixed(2);
      for (const [name, spec] of Object.entries(specs(getRuns()))) {
        draw(document.getElementById(`chart-${name}`), spec, weight);
      }
    };
    slider.addEventListener("input", redraw);
    redraw();
    return redraw;
  }

  return { draw, smooth, ticks, specs, board, COLORS };
})();
