/* Task page: live status, progress, tables, metrics charts and the log stream. */
"use strict";

(function () {
  const P = window.Polytrain;
  const root = document.getElementById("task-page");
  if (!root) return;
  const taskId = root.dataset.taskId;
  const api = `/api/v1/tasks/${taskId}`;
  const $ = (id) => document.getElementById(id);
  let rankGroups = new Map();

  /* ---- status, progress and the tables that change with the status ---- */

  function renderTask(task) {
    P.setBadge($("task-status"), task.status);
    $("task-reason").textContent = task.status_reason;
    P.setProgress($("task-progress"), task.progress);
    $("task-epoch").textContent = epochsDone(task.progress);
    $("task-started").textContent = P.fmtTime(task.started_at);
    $("task-finished").textContent = P.fmtTime(task.finished_at);
    if (P.TERMINAL.has(task.status) && $("cancel-form")) $("cancel-form").remove();
  }

  /** Whole epochs done, from the 0..1 progress: "2 of 5 epochs done". */
  function epochsDone(progress) {
    const epochs = Number(root.dataset.epochs);
    return `${Math.floor(progress * epochs + 1e-9)} of ${epochs} epochs done`;
  }

  async function refreshTables() {
    const [events, subTasks, allocations] = await Promise.all(
      ["events", "sub-tasks", "allocations"].map((part) => P.getJSON(`${api}/${part}`)));
    P.fillTable($("timeline"), events, (e) => [
      [P.fmtTime(e.created_at), "nowrap"], e.from_status || "—", e.to_status, e.reason]);
    P.fillTable($("sub-tasks"), subTasks, (s) => [
      [String(s.group_index), "num"], s.resource_group + (s.hosts_parameter_server ? " (PS)" : ""),
      [String(s.workers), "num"], s.status, s.detail], "Not dispatched yet.");
    P.fillTable($("allocations"), allocations, (a) => [
      a.role, a.resource_group, [a.rank === null ? "—" : String(a.rank), "num"], a.host || "—",
      [P.fmtTime(a.released_at), "nowrap"]], "No nodes allocated yet.");
    rankGroups = new Map(allocations.filter((a) => a.rank !== null)
      .map((a) => [a.rank, a.resource_group]));
  }

  async function refreshCheckpoints() {
    const checkpoints = await P.getJSON(`${api}/checkpoints`);
    P.fillTable($("checkpoints"), checkpoints, (c) => {
      const link = document.createElement("a");
      link.href = `${api}/checkpoints/${c.id}/download`;
      link.setAttribute("download", "");
      link.textContent = "Download";
      return [String(c.epoch), [String(c.step), "num"], [formatBytes(c.size_bytes), "num"],
        [P.fmtTime(c.created_at), "nowrap"], link];
    }, "No checkpoints yet.");
  }

  function formatBytes(size) {
    const units = ["B", "KiB", "MiB", "GiB"];
    let value = size, unit = 0;
    while (value >= 1024 && unit < units.length - 1) { value /= 1024; unit += 1; }
    return unit ? `${value.toFixed(1)} ${units[unit]}` : `${value} B`;
  }

  /* ---- metrics: loss and accuracy per epoch, throughput per worker ---- */

  const COLORS = { train_loss: "#2563eb", val_loss: "#ea580c", val_accuracy: "#16a34a" };
  const charts = {};

  function makeChart(canvasId, names, yOptions) {
    if (typeof window.Chart === "undefined") return null;
    return new window.Chart($(canvasId), {
      type: "line",
      data: { labels: [], datasets: names.map((name) => ({
        label: name, data: [], borderColor: COLORS[name], backgroundColor: COLORS[name],
        spanGaps: true, tension: 0.2, pointRadius: 3 })) },
      options: {
        animation: false, responsive: true, maintainAspectRatio: false,
        interaction: { mode: "index", intersect: false },
        plugins: { legend: { position: "bottom" } },
        scales: { x: { title: { display: true, text: "epoch" } }, y: yOptions },
      },
    });
  }

  /** The task-wide (rank-less) value of each metric per epoch: Map(name -> Map(epoch -> value)). */
  function perEpoch(metrics) {
    const series = new Map();
    metrics.filter((m) => m.rank === null).forEach((m) => {
      if (!series.has(m.name)) series.set(m.name, new Map());
      series.get(m.name).set(m.epoch, m.value);
    });
    return series;
  }

  function updateChart(chart, series) {
    if (!chart) return;
    const epochs = new Set();
    chart.data.datasets.forEach((d) => (series.get(d.label) || new Map()).forEach((_, e) => epochs.add(e)));
    const labels = [...epochs].sort((a, b) => a - b);
    chart.data.labels = labels;
    chart.data.datasets.forEach((d) => {
      const values = series.get(d.label) || new Map();
      d.data = labels.map((e) => (values.has(e) ? values.get(e) : null));
    });
    chart.update("none");
  }

  function renderThroughput(metrics) {
    const latest = new Map();
    metrics.filter((m) => m.rank !== null && m.name === "samples_per_s")
      .forEach((m) => latest.set(m.rank, m));
    const rows = [...latest.values()].sort((a, b) => a.rank - b.rank);
    P.fillTable($("throughput"), rows, (m) => [
      `rank-${m.rank}`, rankGroups.get(m.rank) || "—", String(m.epoch),
      [m.value.toFixed(1), "num"]], "No throughput reported yet.");
  }

  async function refreshMetrics() {
    const metrics = await P.getJSON(`${api}/metrics`);
    const series = perEpoch(metrics);
    updateChart(charts.loss, series);
    updateChart(charts.accuracy, series);
    renderThroughput(metrics);
  }

  /* ---- live logs over server-sent events ---- */

  const view = $("log-view");
  const nodeSelect = $("log-node");
  const followButton = $("log-follow");
  const MAX_LINES = 5000;
  let source = null;
  let lastId = 0;
  let following = true;
  let pending = [];

  function setLogState(text) { $("log-state").textContent = text; }

  function setFollowing(on) {
    following = on;
    followButton.setAttribute("aria-pressed", String(on));
    followButton.textContent = on ? "Following" : "Paused";
    if (on) view.scrollTop = view.scrollHeight;
  }

  function lineElement(line) {
    const row = document.createElement("div");
    row.className = "log-line";
    [["log-time", line.time.slice(11, 19)], ["log-node", line.node], ["log-text", line.text]]
      .forEach(([className, text]) => {
        const span = document.createElement("span");
        span.className = className;
        span.textContent = text;
        row.appendChild(span);
      });
    return row;
  }

  function flushLines() {
    const fragment = document.createDocumentFragment();
    pending.forEach((line) => fragment.appendChild(lineElement(line)));
    pending = [];
    view.appendChild(fragment);
    while (view.childElementCount > MAX_LINES) view.firstElementChild.remove();
    if (following) view.scrollTop = view.scrollHeight;
  }

  /** Offer every node seen in the logs (e.g. agents) in the filter, not only ps and ranks. */
  function offerNode(node) {
    if ([...nodeSelect.options].some((option) => option.value === node)) return;
    nodeSelect.add(new Option(node, node));
  }

  function onLog(event) {
    const line = JSON.parse(event.data);
    if (line.id <= lastId) return;
    lastId = line.id;
    offerNode(line.node);
    if (!pending.length) requestAnimationFrame(flushLines);
    pending.push(line);
  }

  function connect() {
    const params = new URLSearchParams();
    if (lastId) params.set("after_id", String(lastId));
    if (nodeSelect.value) params.set("node", nodeSelect.value);
    const query = params.toString();
    const stream = new EventSource(view.dataset.streamUrl + (query ? `?${query}` : ""));
    source = stream;
    stream.addEventListener("open", () => setLogState("live"));
    stream.addEventListener("log", onLog);
    stream.addEventListener("end", (event) => {
      stream.close();
      source = null;
      setLogState(`task ended (${JSON.parse(event.data).status}); log complete`);
    });
    // The stream resumes from `after_id`, not Last-Event-ID: reconnect by hand.
    stream.addEventListener("error", () => {
      if (source !== stream) return;
      stream.close();
      source = null;
      setLogState("disconnected; retrying…");
      setTimeout(() => { if (source === null) connect(); }, 2000);
    });
  }

  function reconnect() {
    if (source) source.close();
    source = null;
    pending = [];
    lastId = 0;
    view.replaceChildren();
    setLogState("connecting…");
    connect();
  }

  /* ---- wiring ---- */

  followButton.addEventListener("click", () => setFollowing(!following));
  view.addEventListener("wheel", (event) => { if (event.deltaY < 0 && following) setFollowing(false); });
  nodeSelect.addEventListener("change", reconnect);

  charts.loss = makeChart("loss-chart", ["train_loss", "val_loss"], { title: { display: true, text: "loss" } });
  charts.accuracy = makeChart("accuracy-chart", ["val_accuracy"],
    { suggestedMin: 0, suggestedMax: 1, title: { display: true, text: "accuracy" } });
  connect();

  let lastStatus = null; // the first poll fills every table, then only on a status change
  P.poll(async () => {
    const task = await P.getJSON(api);
    renderTask(task);
    const tables = task.status !== lastStatus ? refreshTables() : Promise.resolve();
    lastStatus = task.status;
    // Throughput rows name each rank's group, known from the allocations table.
    await Promise.all([tables.then(refreshMetrics), refreshCheckpoints()]);
    return !P.TERMINAL.has(task.status);
  }, 3000);
})();
