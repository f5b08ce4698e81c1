/* Task page: live status, progress, time to finish, the tables that change with the status,
 * the checkpoints, and "Where the data went" as each checkpoint brings its records. */
"use strict";

(function () {
  const P = window.Polytrain;
  const root = document.getElementById("task-page");
  if (!root) return;
  const api = `/api/v1/tasks/${root.dataset.taskId}`;
  const $ = (id) => document.getElementById(id);
  let rankGroups = new Map();

  function renderTask(task) {
    P.setBadge($("task-status"), task.status);
    $("task-reason").textContent = task.status_reason;
    P.setProgress($("task-progress"), task.progress);
    if (!root.dataset.trial) $("task-epoch").textContent = epochsDone(task.progress);
    $("task-timing").textContent = timing(task);
    $("task-started").textContent = P.fmtTime(task.started_at);
    $("task-finished").textContent = P.fmtTime(task.finished_at);
    const ended = P.TERMINAL.has(task.status);
    const measured = $("task-measured");  // beside the plan's predicted time, once it ended
    if (measured && ended && task.started_at && task.finished_at) {
      const took = (Date.parse(task.finished_at) - Date.parse(task.started_at)) / 1000;
      measured.textContent = `(${task.status === "SUCCEEDED" ? "took" : "ran"} ${duration(took)})`;
    }
    root.dataset.terminal = String(ended);
    if (ended && $("cancel-form")) $("cancel-form").remove();
    if (ended && $("retry-form") && root.dataset.canWrite === "true") $("retry-form").hidden = false;
  }

  /** Whole epochs done, from the 0..1 progress: "2 of 5 epochs done". */
  function epochsDone(progress) {
    const epochs = Number(root.dataset.epochs);
    return `${Math.floor(progress * epochs + 1e-9)} of ${epochs} epochs done`;
  }

  const duration = P.fmtDuration;

  /** Running time and the API's estimate of the time to finish (`eta_s`: the pace of the
   * attempt's measured steps). */
  function timing(task) {
    if (!task.started_at) return "";
    const end = task.finished_at ? Date.parse(task.finished_at) : Date.now();
    const elapsed = (end - Date.parse(task.started_at)) / 1000;
    let text = ` · ${P.TERMINAL.has(task.status) ? "ran" : "running"} ${duration(elapsed)}`;
    if (task.status === "RUNNING" && task.eta_s !== null && task.eta_s !== undefined) {
      text += ` · about ${duration(task.eta_s)} left`;
    }
    return text;
  }

  async function refreshTables() {
    const [events, subTasks, allocations] = await Promise.all(
      ["events", "sub-tasks", "allocations"].map((part) => P.getJSON(`${api}/${part}`)));
    P.fillTable($("timeline"), events, (e) => [
      [P.fmtTime(e.created_at), "nowrap"], e.from_status || "—",
      e.kind === "status" ? e.to_status : e.kind, e.reason]);
    P.fillTable($("sub-tasks"), subTasks, (s) => [  // the columns of the page's table
      [String(s.group_index), "num"], s.resource_group + (s.hosts_parameter_server ? " (PS)" : ""),
      [String(s.part), "num"],
      s.workers > 1 ? `${s.first_rank}–${s.first_rank + s.workers - 1}` : String(s.first_rank),
      [s.agent_id === null || s.agent_id === undefined ? "—" : String(s.agent_id), "num"],
      [String(s.workers), "num"], s.status, s.detail], "Not dispatched yet.");
    P.fillTable($("allocations"), allocations, (a) => [
      a.role, a.resource_group, [a.rank === null ? "—" : String(a.rank), "num"], a.host || "—",
      [P.fmtTime(a.released_at), "nowrap"]], "No nodes allocated yet.");
    rankGroups = new Map(allocations.filter((a) => a.rank !== null && a.role === "compute")
      .map((a) => [a.rank, a.resource_group]));
  }

  /** "Where the data went" again from the server (the section alone), the epochs the user
   * opened kept open: the shard records arrive with each checkpoint (in a request of their
   * own, after the checkpoint's, so this runs on the poll that sees a new checkpoint and the
   * next). */
  async function refreshProvenance() {
    const response = await fetch(`/tasks/${root.dataset.taskId}/provenance-section`,
      { headers: { Accept: "text/html" } });
    if (!response.ok) return;
    const page = new DOMParser().parseFromString(await response.text(), "text/html");
    const fresh = page.getElementById("provenance");
    const section = $("provenance");
    if (!fresh || !section) return;
    const epochOf = (details) => details.querySelector("summary").textContent.split(":")[0].trim();
    const open = new Set([...section.querySelectorAll("details[open]")].map(epochOf));
    if (open.size) {
      fresh.querySelectorAll("details").forEach((d) => { d.open = open.has(epochOf(d)); });
    }
    section.replaceWith(document.importNode(fresh, true));
  }

  // The checkpoint list is oldest first and paged (100 by default): its length is read from
  // X-Total-Count with a one-row request each poll, and only when it grows are the newest
  // CHECKPOINTS_SHOWN fetched. (Reading the default page's length stopped at 100: the table
  // and "Where the data went" stopped following a task past its 100th checkpoint.)
  const CHECKPOINTS_SHOWN = 100;
  let seenCheckpoints = null, provenanceDue = 0, arriving = false;
  async function refreshCheckpoints(ended) {
    const head = await fetch(`${api}/checkpoints?limit=1`,
      { headers: { Accept: "application/json" }, cache: "no-store" });
    if (!head.ok) throw new Error(`${api}/checkpoints: HTTP ${head.status}`);
    const total = Number(head.headers.get("X-Total-Count") || 0);
    const grew = seenCheckpoints === null || total !== seenCheckpoints;
    if (seenCheckpoints !== null && grew) provenanceDue = 2;
    seenCheckpoints = total;
    if (provenanceDue > 0) {
      provenanceDue -= 1;
      await refreshProvenance();
    }
    if (!grew && !arriving) return;  // a listed checkpoint's state files still arriving
    const offset = Math.max(0, total - CHECKPOINTS_SHOWN);
    const checkpoints = await P.getJSON(`${api}/checkpoints?offset=${offset}&limit=${CHECKPOINTS_SHOWN}`);
    arriving = checkpoints.some((c) => !c.complete);
    P.fillTable($("checkpoints"), checkpoints, (c) => {
      const link = document.createElement("a");
      link.href = `${api}/checkpoints/${c.id}/download`;
      link.setAttribute("download", "");
      link.textContent = "Download";
      let cell = link;
      if (!c.complete) {  // its workers' optimizer state files not all stored
        cell = document.createElement("span");
        cell.className = "muted";
        cell.title = ended ? INCOMPLETE : "its state files are still arriving";
        cell.textContent = ended ? "Incomplete" : "Arriving…";
      }
      return [String(c.epoch), [String(c.step), "num"],
        [formatBytes(c.size_bytes + c.state_bytes), "num"], [P.fmtTime(c.created_at), "nowrap"], cell];
    }, "No checkpoints yet.");
  }

  const INCOMPLETE = "a file of its state never arrived: download an earlier checkpoint";

  function formatBytes(size) {
    const units = ["B", "KiB", "MiB", "GiB"];
    let value = size, unit = 0;
    while (value >= 1024 && unit < units.length - 1) { value /= 1024; unit += 1; }
    return unit ? `${value.toFixed(1)} ${units[unit]}` : `${value} B`;
  }

  let lastStatus = null; // the first poll fills every table, then only on a status change
  P.poll(async () => {
    const task = await P.getJSON(api);
    renderTask(task);
    const tables = task.status !== lastStatus ? refreshTables() : Promise.resolve();
    lastStatus = task.status;
    // Throughput rows name each rank's group, known from the allocations table.
    await Promise.all([tables.then(() => window.TaskCharts.refresh(rankGroups, task)),
      refreshCheckpoints(P.TERMINAL.has(task.status))]);
    return !P.TERMINAL.has(task.status);
  }, 3000);
})();
