// Small line charts in SVG for the node's page: no library, nothing fetched.
"use strict";
(function () {
  const NS = "http://www.w3.org/2000/svg";
  const W = 300, H = 110, L = 34, R = 6, T = 8, B = 16;

  function el(name, attrs, parent) {
    const e = document.createElementNS(NS, name);
    for (const k in attrs) e.setAttribute(k, attrs[k]);
    if (parent) parent.appendChild(e);
    return e;
  }

  function niceMax(v) {
    if (!(v > 0)) return 1;
    const p = Math.pow(10, Math.floor(Math.log10(v)));
    for (const m of [1, 2, 2.5, 5, 10]) if (m * p >= v) return m * p;
    return 10 * p;
  }

  function axis(v) {
    if (v >= 1e6) return `${+(v / 1e6).toFixed(1)}M`;
    if (v >= 1e3) return `${+(v / 1e3).toFixed(1)}k`;
    return Number.isInteger(v) ? String(v) : v.toFixed(v < 1 ? 2 : 1);
  }

  function fmt(v, digits) {
    if (v === null || v === undefined || Number.isNaN(v)) return "–";
    if (Math.abs(v) >= 1000) return Math.round(v).toLocaleString();
    return v.toFixed(digits === undefined ? (Math.abs(v) < 10 ? 2 : 1) : digits);
  }

  // figure: a <figure> with its <figcaption>; series: [{name, values: [[t, v|null], ...]}] (at most two);
  // opts: {from, to (unix s), max (a fixed top, e.g. 1 for a share), digits}.
  function draw(figure, series, opts) {
    let svg = figure.querySelector("svg");
    if (!svg) {
      svg = el("svg", {viewBox: `0 0 ${W} ${H}`, role: "img", focusable: "false"});
      el("line", {x1: L, y1: H - B, x2: W - R, y2: H - B, class: "axis"}, svg);
      el("line", {x1: L, y1: T, x2: W - R, y2: T, class: "axis"}, svg);
      const top = el("text", {x: L - 4, y: T + 4, "text-anchor": "end", class: "lab"}, svg);
      top.dataset.role = "top";
      el("text", {x: L - 4, y: H - B + 3, "text-anchor": "end", class: "lab"}, svg).textContent = "0";
      el("text", {x: L, y: H - 3, class: "lab"}, svg).dataset.role = "from";
      el("text", {x: W - R, y: H - 3, "text-anchor": "end", class: "lab"}, svg).textContent = "now";
      series.forEach((s, i) => {
        el("path", {class: `l${i + 1}`, d: ""}, svg).dataset.series = String(i);
        el("circle", {class: `d${i + 1}`, r: 2.5, cx: -10, cy: -10}, svg).dataset.dot = String(i);
      });
      figure.appendChild(svg);
      const now = document.createElement("p");
      now.className = "now";
      figure.appendChild(now);
    }
    const from = opts.from, span = Math.max(1, opts.to - opts.from);
    let peak = 0;
    for (const s of series) for (const [, v] of s.values) if (v !== null && v > peak) peak = v;
    const top = opts.max !== undefined ? opts.max : niceMax(peak);
    svg.querySelector('[data-role="top"]').textContent = axis(top);
    const minutes = Math.round(span / 60);
    svg.querySelector('[data-role="from"]').textContent = minutes >= 60 ? "−60 min" : `−${minutes} min`;
    const x = (t) => L + (W - L - R) * Math.min(1, Math.max(0, (t - from) / span));
    const y = (v) => H - B - (H - B - T) * Math.min(1, Math.max(0, v / top));
    const latest = [];
    series.forEach((s, i) => {
      let d = "", pen = false, last = null, at = null;
      for (const [t, v] of s.values) {
        if (t < from || v === null || v === undefined) { pen = false; continue; }
        d += `${pen ? "L" : "M"}${x(t).toFixed(1)},${y(v).toFixed(1)}`;
        pen = true;
        last = v;
        at = [x(t), y(v)];
      }
      svg.querySelector(`[data-series="${i}"]`).setAttribute("d", d);
      const dot = svg.querySelector(`[data-dot="${i}"]`);  // the latest point, seen even when it stands alone
      dot.setAttribute("cx", at ? at[0].toFixed(1) : -10);
      dot.setAttribute("cy", at ? at[1].toFixed(1) : -10);
      latest.push([s.name, last]);
    });
    const now = figure.querySelector(".now");
    now.replaceChildren();
    latest.forEach(([name, v], i) => {
      const span = document.createElement("span");
      span.className = `k${i + 1}`;
      span.append(`${i ? " · " : ""}${name} `);
      const b = document.createElement("b");
      b.textContent = fmt(v, opts.digits);
      span.appendChild(b);
      now.appendChild(span);
    });
    const caption = figure.querySelector("figcaption").textContent;
    svg.setAttribute("aria-label", `${caption}, last point: ` +
      latest.map(([n, v]) => `${n} ${fmt(v, opts.digits)}`).join(", "));
  }

  window.Charts = {draw: draw, fmt: fmt};
})();
