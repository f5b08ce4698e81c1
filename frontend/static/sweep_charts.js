/* Sweep page: one Chart.js scatter chart per hyperparameter, each scored trial's objective
 * (the sweep's metric at its best epoch) against the value it tried; the best trial in
 * green, trials stopped early hollow. A numeric parameter on a linear (or, searched on a
 * log scale, logarithmic) axis, any other on a category axis. Data: the section's
 * `data-chart` (backend/web/sweep_pages.py chart_data). While the sweep runs
 * (`data-running`), the page reloads itself every RELOAD_MS. */
"use strict";

(function () {
  const RELOAD_MS = 3000;
  const section = document.getElementById("sweep-charts");
  if (section && section.dataset.running === "true") {
    window.setTimeout(() => window.location.reload(), RELOAD_MS);
  }
  if (!section || typeof window.Chart === "undefined") return;
  const data = JSON.parse(section.dataset.chart || "{}");
  const BLUE = "#2563eb";
  const GREEN = "#16a34a";

  data.names.forEach((name, i) => {
    const canvas = document.getElementById(`sweep-chart-${i}`);
    if (!canvas) return;
    const points = data.points.filter((p) => p.values[name] !== undefined);
    const numeric = points.every((p) => typeof p.values[name] === "number");
    const categories = numeric ? [] : [...new Set(points.map((p) => String(p.values[name])))];
    const xAxis = numeric
      ? { type: data.log.includes(name) ? "logarithmic" : "linear", title: { display: true, text: name } }
      : { type: "category", labels: categories, title: { display: true, text: name } };
    const best = (p) => p.index === data.best;
    new window.Chart(canvas, {
      type: "scatter",
      data: {
        datasets: [{
          label: `${data.metric} (${data.goal})`,
          data: points.map((p) => ({ x: numeric ? p.values[name] : String(p.values[name]), y: p.objective, trial: p.index })),
          pointRadius: points.map((p) => (best(p) ? 7 : 4)),
          pointBackgroundColor: points.map((p) => (best(p) ? GREEN : p.stopped ? "transparent" : BLUE)),
          pointBorderColor: points.map((p) => (best(p) ? GREEN : BLUE)),
        }],
      },
      options: {
        animation: false, responsive: true, maintainAspectRatio: false,
        plugins: {
          legend: { display: false },
          tooltip: { callbacks: { label: (c) => `trial ${c.raw.trial}: ${name}=${c.raw.x}, ${data.metric} ${c.raw.y}` } },
        },
        scales: { x: xAxis, y: { title: { display: true, text: data.metric } } },
      },
    });
    canvas.dataset.points = String(points.length);
  });
})();
