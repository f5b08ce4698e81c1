/* Comparison page: one chart overlaying the chosen metric of every compared task, by step,
 * epoch or seconds since each task's start (GET /api/v1/tasks/compare?metric=). */
"use strict";

(function () {
  const P = window.Polytrain;
  const root = document.getElementById("compare-page");
  if (!root || typeof window.Chart === "undefined") return;
  const ids = JSON.parse(root.dataset.ids);
  const metricSelect = document.getElementById("compare-metric");
  const xSelect = document.getElementById("compare-x");
  const empty = document.getElementById("compare-empty");
  const PALETTE = ["#2563eb", "#ea580c", "#16a34a", "#7c3aed", "#db2777", "#0891b2",
    "#65a30d", "#d97706", "#4b5563", "#dc2626"];
  const chart = new window.Chart(document.getElementById("compare-chart"), {
    type: "line",
    data: { datasets: [] },
    options: {
      animation: false, responsive: true, maintainAspectRatio: false, parsing: false,
      interaction: { mode: "nearest", intersect: false },
      plugins: { legend: { position: "bottom" } },
      scales: { x: { type: "linear", title: { display: true, text: "step" } }, y: {} },
    },
  });

  async function draw() {
    const metric = metricSelect.value;
    if (!metric) return;
    const query = ids.map((id) => `ids=${id}`).join("&");
    const body = await P.getJSON(
      `/api/v1/tasks/compare?${query}&metric=${encodeURIComponent(metric)}`);
    const x = xSelect.value;
    const names = new Map(body.tasks.map((t) => [t.id, t.name]));
    chart.data.datasets = body.curves.map((curve, i) => ({
      label: `#${curve.task_id} ${names.get(curve.task_id)}`,
      data: curve.points.filter((p) => p[x] !== null)
        .map((p) => ({ x: p[x], y: p.value })),
      borderColor: PALETTE[i % PALETTE.length], backgroundColor: PALETTE[i % PALETTE.length],
      pointRadius: curve.points.length > 60 ? 0 : 3, spanGaps: true, tension: 0.2,
    }));
    chart.options.scales.x.title.text = xSelect.selectedOptions[0].textContent;
    chart.options.scales.y.title = { display: true, text: metric };
    chart.update("none");
    const points = chart.data.datasets.reduce((n, d) => n + d.data.length, 0);
    chart.canvas.dataset.points = String(points);
    empty.hidden = points > 0;
    empty.textContent = x === "seconds"
      ? "No point has a wall time: a task's points have one only once it has started."
      : `No task has reported ${metric} yet.`;
  }

  metricSelect.addEventListener("change", draw);
  xSelect.addEventListener("change", draw);
  draw();
})();
