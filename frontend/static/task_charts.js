/* Task page: loss, accuracy and per-group throughput charts (Chart.js), each worker's CPU and
 * memory over time (the agents' samples; a note instead of a chart while no worker has two),
 * the throughput and batch-share tables, and the per-step curves (training loss, samples/s,
 * learning rate, the training code's per-step metrics: `GET /tasks/{id}/metrics?scale=step`,
 * at most STEP_POINTS points a series) with zoom (chartjs-plugin-zoom) and EMA smoothing.
 * `TaskCharts.refresh(rankGroups, task)` redraws them from the API. */
"use strict";

window.TaskCharts = (function () {
  const P = window.Polytrain;
  const root = document.getElementById("task-page");
  if (!root) return { refresh: async () => {} };
  const api = `/api/v1/tasks/${root.dataset.taskId}`;
  const planned = JSON.parse(root.dataset.shares || "[]");
  const $ = (id) => document.getElementById(id);
  const COLORS = { train_loss: "#2563eb", val_loss: "#ea580c", val_accuracy: "#16a34a" };
  const PALETTE = ["#7c3aed", "#0891b2", "#db2777", "#65a30d", "#d97706", "#4b5563"];
  const charts = {};
  const STEP_POINTS = 2000; // the most points of one per-step series the page fetches

  function makeChart(canvasId, names, yOptions) {
    if (typeof window.Chart === "undefined") return null;
    return new window.Chart($(canvasId), {
      type: "line",
      data: { labels: [], datasets: names.map((name, i) => dataset(name, COLORS[name] || PALETTE[i % PALETTE.length])) },
      options: {
        animation: false, responsive: true, maintainAspectRatio: false,
        interaction: { mode: "index", intersect: false },
        plugins: { legend: { position: "bottom" } },
        scales: { x: { title: { display: true, text: "epoch" } }, y: yOptions },
      },
    });
  }

  function dataset(label, color) {
    return { label, data: [], borderColor: color, backgroundColor: color, spanGaps: true,
      tension: 0.2, pointRadius: 3 };
  }

  /** Map(name -> Map(epoch -> value)) of the task-wide (rank-less) metrics. */
  function perEpoch(metrics) {
    const series = new Map();
    metrics.filter((m) => m.rank === null && m.value !== null).forEach((m) => {
      if (!series.has(m.name)) series.set(m.name, new Map());
      series.get(m.name).set(m.epoch, m.value);
    });
    return series;
  }

  /** Map(group -> Map(epoch -> samples/s summed over the group's ranks)). */
  function groupThroughput(metrics, rankGroups) {
    const series = new Map();
    metrics.filter((m) => m.rank !== null && m.name === "samples_per_s" && m.value !== null)
      .forEach((m) => {
        const group = rankGroups.get(m.rank) || `rank-${m.rank}`;
        if (!series.has(group)) series.set(group, new Map());
        const epochs = series.get(group);
        epochs.set(m.epoch, (epochs.get(m.epoch) || 0) + m.value);
      });
    return series;
  }

  function updateChart(chart, series, addMissing) {
    if (!chart) return;
    if (addMissing) {
      [...series.keys()].filter((name) => !chart.data.datasets.some((d) => d.label === name))
        .forEach((name) => chart.data.datasets.push(
          dataset(name, PALETTE[chart.data.datasets.length % PALETTE.length])));
    }
    const epochs = new Set();
    chart.data.datasets.forEach((d) => (series.get(d.label) || new Map()).forEach((_, e) => epochs.add(e)));
    const labels = [...epochs].sort((a, b) => a - b);
    chart.data.labels = labels;
    chart.data.datasets.forEach((d) => {
      const values = series.get(d.label) || new Map();
      d.data = labels.map((e) => (values.has(e) ? values.get(e) : null));
    });
    chart.update("none");
    chart.canvas.dataset.points = String(labels.length);
  }

  /** A line chart over time: x in minutes since the task's first sample, one line per rank. */
  function makeTimeChart(canvasId, yTitle) {
    if (typeof window.Chart === "undefined") return null;
    return new window.Chart($(canvasId), {
      type: "line",
      data: { datasets: [] },
      options: {
        animation: false, responsive: true, maintainAspectRatio: false, parsing: false,
        interaction: { mode: "nearest", axis: "x", intersect: false },
        plugins: { legend: { position: "bottom" } },
        scales: {
          x: { type: "linear", title: { display: true, text: "minutes" } },
          y: { beginAtZero: true, title: { display: true, text: yTitle } },
        },
      },
    });
  }

  /** Map(worker -> [{x: minutes since `start`, y}]) of one resource metric's samples. */
  function perWorker(samples, name, start) {
    const series = new Map();
    samples.filter((m) => m.name === name && m.rank !== null && m.value !== null).forEach((m) => {
      const worker = m.rank === 0 ? "ps" : `rank-${m.rank}`;
      if (!series.has(worker)) series.set(worker, []);
      series.get(worker).push({ x: (Date.parse(m.created_at) - start) / 60000, y: m.value });
    });
    return series;
  }

  function updateTimeChart(chart, series) {
    if (!chart) return;
    const workers = [...series.keys()].sort((a, b) => (a === "ps" ? -1 : b === "ps" ? 1
      : Number(a.slice(5)) - Number(b.slice(5))));
    chart.data.datasets = workers.map((worker, i) => ({
      ...dataset(worker, PALETTE[i % PALETTE.length]), data: series.get(worker), pointRadius: 0 }));
    chart.update("none");
    chart.canvas.dataset.points = String(workers.reduce((n, w) => n + series.get(w).length, 0));
  }

  /** Why a resource chart has nothing to draw: the agents sample every `data-sample-every-s`
   * seconds, so a task shorter than that has one sample per worker or none. `found`: the
   * most samples of one worker (0 or 1). */
  function noSamples(found, task) {
    const every = Number(root.dataset.sampleEveryS);
    const what = found ? "Only one sample per worker, too few to draw" : "No samples";
    if (!task || !task.started_at) {
      return `${what} yet: resources are sampled every ${every} s while the task runs.`;
    }
    const ended = P.TERMINAL.has(task.status);
    const end = task.finished_at ? Date.parse(task.finished_at) : Date.now();
    const ran = (end - Date.parse(task.started_at)) / 1000;
    if (ran >= 2 * every) {
      return `${found ? "Only one sample per worker was" : "No samples were"} reported (resources are sampled every ${every} s).`;
    }
    return ended ? `${what}: resources are sampled every ${every} s and this task ran ${P.fmtDuration(ran)}.`
      : `${what} yet: resources are sampled every ${every} s and this task has run ${P.fmtDuration(ran)}.`;
  }

  /** The chart, or in its place the note saying why it has no line to draw (no worker has
   * two samples). */
  function showUsage(canvasId, series, task) {
    const most = Math.max(0, ...[...series.values()].map((points) => points.length));
    const box = $(canvasId).parentElement;
    const note = $(`${canvasId}-empty`);
    box.hidden = most < 2;
    note.hidden = most >= 2;
    note.textContent = most < 2 ? noSamples(most, task) : "";
  }

  /** Each worker's CPU (% of one core) and resident memory (MiB), as its agent sampled them. */
  function renderUsage(samples, task) {
    const start = samples.reduce((first, m) => Math.min(first, Date.parse(m.created_at)), Infinity);
    [["cpu", "cpu-chart", "rank_cpu_percent"], ["memory", "memory-chart", "rank_rss_mb"]]
      .forEach(([chart, canvasId, name]) => {
        const series = perWorker(samples, name, start);
        updateTimeChart(charts[chart], series);
        showUsage(canvasId, series, task);
      });
  }

  const fmtRate = (v) => (v === null || v === undefined ? "—" : v.toFixed(1));
  const fmtShare = (v) => (v === null || v === undefined ? "—" : `${(v * 100).toFixed(0)}%`);
  const fmtIdle = (v) => (v === null || v === undefined ? "—" : `${(v * 100).toFixed(1)}%`);

  /** Per worker and per group: measured samples/s and share of the global batch
   * (`GET /tasks/{id}/throughput`); shares fall back to the plan until measured.
   * Per worker also the idle part of its last epoch. */
  function renderThroughput(throughput) {
    P.fillTable($("throughput"), throughput.workers, (w) => [
      `rank-${w.rank}`, w.group, [fmtRate(w.samples_per_s), "num"], [fmtShare(w.batch_share), "num"],
      [fmtIdle(w.idle_fraction), "num"]],
    "No throughput reported yet.");
    const plannedShare = new Map(planned.map((g) => [g.name, g.share]));
    const groups = throughput.groups.length ? throughput.groups
      : planned.map((g) => ({ name: g.name, workers: g.workers, samples_per_s: null, batch_share: null }));
    P.fillTable($("group-throughput"), groups, (g) => [
      g.name, [String(g.workers), "num"], [fmtRate(g.samples_per_s), "num"],
      [fmtShare(g.batch_share ?? plannedShare.get(g.name)), "num"]], "Not placed yet.");
  }

  /** TensorBoard's smoothing: an exponential moving average of weight `weight` (0: none),
   * debiased (divided by 1 - weight^n) so that it does not start at 0; a point that is not
   * finite stays as it is and leaves the average alone. */
  function smooth(points, weight) {
    let last = 0;
    let n = 0;
    return points.map((p) => {
      if (!Number.isFinite(p.y) || weight <= 0) return p;
      last = last * weight + (1 - weight) * p.y;
      n += 1;
      return { x: p.x, y: last / (1 - Math.pow(weight, n)) };
    });
  }

  /** A chart of per-step series: x the global step (linear), zoom by wheel or drag on x,
   * double-click to zoom out (chartjs-plugin-zoom, registered by its script). */
  function makeStepChart(canvasId, yTitle) {
    if (typeof window.Chart === "undefined") return null;
    const chart = new window.Chart($(canvasId), {
      type: "line",
      data: { datasets: [] },
      options: {
        animation: false, responsive: true, maintainAspectRatio: false, parsing: false,
        normalized: true,
        interaction: { mode: "nearest", axis: "x", intersect: false },
        plugins: {
          legend: { position: "bottom" },
          zoom: {
            zoom: { wheel: { enabled: true }, drag: { enabled: true }, mode: "x" },
            limits: { x: { min: "original", max: "original" } },
          },
        },
        scales: {
          x: { type: "linear", title: { display: true, text: "step" } },
          y: { title: { display: true, text: yTitle } },
        },
      },
    });
    $(canvasId).addEventListener("dblclick", () => chart.resetZoom && chart.resetZoom());
    return chart;
  }

  /** Map(label -> [{x: step, y}]) of the per-step points, by name (rank-less: the task's)
   * or by name and worker, in step order. */
  function perStep(points) {
    const series = new Map();
    points.filter((m) => m.value !== null).forEach((m) => {
      const name = m.name.slice("step/".length);
      const label = m.rank === null ? name : `${name} rank-${m.rank}`;
      if (!series.has(label)) series.set(label, []);
      series.get(label).push({ x: m.step, y: m.value });
    });
    series.forEach((list) => list.sort((a, b) => a.x - b.x));
    return series;
  }

  const stepSeries = { loaded: new Map() };

  /** Redraw one step chart: each series smoothed (when `smoothed`) over its raw points,
   * faded. The zoom the user chose stays (the plugin keeps the scale's limits). */
  function drawStepChart(chart, series, smoothed) {
    if (!chart) return;
    const weight = smoothed ? Number($("step-smoothing").value) : 0;
    const datasets = [];
    [...series.keys()].forEach((label, i) => {
      const color = COLORS[label] || PALETTE[i % PALETTE.length];
      const raw = series.get(label);
      if (weight > 0) {
        datasets.push({ ...dataset(label, color), data: smooth(raw, weight), pointRadius: 0, tension: 0,
          borderWidth: 2 });
        datasets.push({ ...dataset(`${label} (raw)`, `${color}44`), data: raw, pointRadius: 0,
          tension: 0, borderWidth: 1 });
      } else {
        datasets.push({ ...dataset(label, color), data: raw, pointRadius: 0, tension: 0, borderWidth: 1.5 });
      }
    });
    chart.data.datasets = datasets;
    chart.update("none");
    chart.canvas.dataset.points = String([...series.values()].reduce((n, l) => n + l.length, 0));
    chart.canvas.dataset.smoothing = String(weight);
  }

  function renderSteps() {
    const all = stepSeries.loaded;
    const pick = (names) => new Map([...all].filter(([label]) => names.includes(label)));
    const own = new Set(["train_loss", "samples_per_s", "lr"]);
    const user = new Map([...all].filter(([label]) => !own.has(label)));
    $("step-charts").hidden = all.size === 0;
    $("step-charts-empty").hidden = all.size !== 0;
    $("step-user-figure").hidden = user.size === 0;
    drawStepChart(charts.stepLoss, pick(["train_loss"]), true);
    drawStepChart(charts.stepRate, pick(["samples_per_s"]), true);
    drawStepChart(charts.stepLr, pick(["lr"]), false);
    drawStepChart(charts.stepUser, user, true);
  }

  charts.stepLoss = makeStepChart("step-loss-chart", "training loss");
  charts.stepRate = makeStepChart("step-rate-chart", "samples/s");
  charts.stepLr = makeStepChart("step-lr-chart", "learning rate");
  charts.stepUser = makeStepChart("step-user-chart", "value");
  $("step-smoothing").addEventListener("input", () => {
    $("step-smoothing-value").textContent = Number($("step-smoothing").value).toFixed(2);
    renderSteps();
  });
  $("step-zoom-reset").addEventListener("click", () => {
    [charts.stepLoss, charts.stepRate, charts.stepLr, charts.stepUser]
      .forEach((c) => c && c.resetZoom && c.resetZoom());
  });

  charts.loss = makeChart("loss-chart", ["train_loss", "val_loss"], { title: { display: true, text: "loss" } });
  charts.accuracy = makeChart("accuracy-chart", ["val_accuracy"],
    { suggestedMin: 0, suggestedMax: 1, title: { display: true, text: "accuracy" } });
  charts.throughput = makeChart("throughput-chart", [], { beginAtZero: true, title: { display: true, text: "samples/s" } });
  charts.cpu = makeTimeChart("cpu-chart", "CPU % of one core");
  charts.memory = makeTimeChart("memory-chart", "RSS (MiB)");

  const SHOW = { nan: "NaN", inf: "+Infinity", "-inf": "-Infinity" };

  /** Metric values that were NaN or infinite: listed, since a chart can only leave a gap. */
  function renderNonFinite(metrics) {
    const bad = metrics.filter((m) => m.nonfinite);
    $("nonfinite-metrics").hidden = !bad.length;
    P.fillTable($("nonfinite-table"), bad, (m) => [
      m.name, [String(m.epoch), "num"], [String(m.step), "num"],
      m.rank === null ? "task" : `rank-${m.rank}`, [SHOW[m.nonfinite] || m.nonfinite, "num"]],
    "None.");
  }

  const PAGE_ROWS = 10000; // rows a request asks for; a full page asks for the next one
  const LATE_MS = 10000; // how long after later ids were read a report's rows may commit
  const MAX_SAMPLES = 50000; // resource samples kept per list (the newest)

  /** A list of metrics fetched in increments (`after_id`): each poll asks only for the rows
   * after its cursor and merges them by id, so a long task's polls cost what is new, not
   * its whole history. Ids are taken when a report is stored, and one still being written
   * when the page read may commit with a lower id than those read: the cursor is the newest
   * id the page had seen LATE_MS ago (by its own clock), so rows are fetched again for 10 s
   * and only a report whose commit took longer could be missed. After the first load it is
   * the last row stored LATE_MS before the newest (by `created_at`), so a long task's
   * history is read once. `cap`: keep at most that many rows, the newest. */
  function increments(query, cap) {
    const rows = new Map();
    const seen = []; // [time of a poll (ms), the newest id seen by then]
    let cursor = 0, newest = 0, first = true;
    return async function fetchNew() {
      let after = cursor, page;
      do {
        page = await P.getJSON(`${api}/metrics?${query}&after_id=${after}&limit=${PAGE_ROWS}`);
        page.forEach((m) => { rows.set(m.id, m); after = Math.max(after, m.id); });
      } while (page.length === PAGE_ROWS);
      const now = Date.now();
      newest = Math.max(newest, after);
      seen.push([now, newest]);
      while (seen.length && seen[0][0] <= now - LATE_MS) {
        cursor = Math.max(cursor, seen.shift()[1]);
      }
      const sorted = [...rows.values()].sort((a, b) => a.id - b.id);
      if (first && sorted.length) {
        first = false;
        const settled = Date.parse(sorted[sorted.length - 1].created_at) - LATE_MS;
        let i = sorted.length - 1;
        while (i >= 0 && Date.parse(sorted[i].created_at) > settled) i -= 1;
        if (i >= 0) cursor = Math.max(cursor, sorted[i].id);
      }
      if (cap && sorted.length > cap) {
        sorted.splice(0, sorted.length - cap).forEach((m) => rows.delete(m.id));
      }
      return sorted;
    };
  }
  const epochMetrics = increments("resources=false&scale=epoch");
  const cpuSamples = increments("name=rank_cpu_percent", MAX_SAMPLES);
  const memorySamples = increments("name=rank_rss_mb", MAX_SAMPLES);

  async function refresh(rankGroups, task) {
    const [metrics, steps, throughput, cpu, memory] = await Promise.all([
      epochMetrics(),
      P.getJSON(`${api}/metrics?scale=step&max_points=${STEP_POINTS}&limit=100000`),
      P.getJSON(`${api}/throughput`), cpuSamples(), memorySamples()]);
    renderNonFinite([...metrics, ...steps]);
    stepSeries.loaded = perStep(steps);
    renderSteps();
    const series = perEpoch(metrics);
    updateChart(charts.loss, series, false);
    updateChart(charts.accuracy, series, false);
    updateChart(charts.throughput, groupThroughput(metrics, rankGroups), true);
    renderThroughput(throughput);
    renderUsage([...cpu, ...memory], task);
  }

  return { refresh };
})();
