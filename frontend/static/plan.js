/* Project page: the submit form's "Plan" button. It starts a plan (POST /api/v1/plans) from
 * what the form holds, polls it while its trial task runs, then shows every option's predicted
 * times as a table and a bar chart (Chart.js), the left-out groups and the deadline answer;
 * "Use this plan" fills the form from the plan's `task_request` and sets its hidden `plan_id`. */
"use strict";

(function () {
  const P = window.Polytrain;
  const form = document.getElementById("task-form");
  const button = document.getElementById("plan-button");
  if (!form || !button) return;
  const $ = (id) => document.getElementById(id);
  const projectId = Number(form.dataset.projectId);
  const SHOWN = 10; // options listed (and charted) before "Show all"
  const FIELDS = ["code_version_id", "name", "global_batch_size", "epochs", "sync_strategy",
    "sync_period", "quorum", "seed", "split_policy", "deadline", "project_id"];
  let plan = null;
  let stop = null;
  let chart = null;
  let showAll = false;
  let candidates = [];

  const csrf = () => (document.querySelector('meta[name="csrf-token"]') || {}).content || "";

  /** POST `body` as JSON with the session's CSRF token; `{ok, status, body}` (never throws on
   * a refusal, so the caller can show the API's message and field). */
  async function post(url, body) {
    const response = await fetch(url, {
      method: "POST",
      headers: { "Content-Type": "application/json", Accept: "application/json", "X-CSRF-Token": csrf() },
      body: body === undefined ? undefined : JSON.stringify(body),
    });
    let parsed = null;
    try { parsed = await response.json(); } catch (err) { parsed = null; }
    return { ok: response.ok, status: response.status, body: parsed };
  }

  function duration(seconds) {
    if (seconds < 59.95) return `${Math.max(0, seconds).toFixed(1)} s`;
    const s = Math.round(seconds);
    if (s < 3600) return `${Math.floor(s / 60)} min ${s % 60} s`;
    return `${Math.floor(s / 3600)} h ${Math.floor((s % 3600) / 60)} min`;
  }

  const fixed = (value, digits) => (value === null || value === undefined ? "—" : Number(value).toFixed(digits));
  const groupsText = (workers) => Object.entries(workers).map(([g, n]) => `${g} × ${n}`).join(" + ");
  const same = (a, b) => !!a && !!b && a.split_policy === b.split_policy
    && JSON.stringify(a.workers) === JSON.stringify(b.workers);

  // ---- reading the form -------------------------------------------------------------------

  function input(name) { return form.elements.namedItem(name); }

  /** The form's group rows as [{name, input}] in page order. */
  function groupRows() {
    return [...form.querySelectorAll("tr[data-group]")].map((row) => ({
      name: row.dataset.group, input: row.querySelector('input[name="workers"]'),
    }));
  }

  /** A number when the text is one (the API then checks its bounds), else the text itself
   * (the API refuses it naming the field). */
  function numberOr(text) {
    const trimmed = String(text || "").trim();
    return /^-?\d+$/.test(trimmed) ? Number(trimmed) : trimmed;
  }

  /** The plan request from the form's current values; the candidate groups are the rows with
   * workers (each the most the plan may use there). */
  function planRequest(codeVersionId) {
    candidates = groupRows().filter((g) => (g.input.value || "").trim() !== "" && g.input.value.trim() !== "0");
    const body = {
      project_id: projectId,
      code_version_id: codeVersionId,
      name: input("name").value.trim(),
      resource_groups: candidates.map((g) => ({ name: g.name, workers: numberOr(g.input.value) })),
    };
    ["global_batch_size", "epochs", "seed", "memory_limit_mb"].forEach((name) => {
      const value = input(name) && input(name).value.trim();
      if (value) body[name] = numberOr(value);
    });
    const strategy = input("sync_strategy") ? input("sync_strategy").value : "sync";
    if (strategy) body.sync_strategy = strategy;
    const period = input("sync_period") && input("sync_period").value.trim();
    if ((strategy === "periodic" || strategy === "diloco") && period) body.sync_period = numberOr(period);
    const quorum = input("quorum") && input("quorum").value.trim();
    if (strategy === "quorum" && quorum) body.quorum = numberOr(quorum);
    // The task's hyperparameters, so the trial times the model they build (a value that is
    // not a JSON object is sent as typed: the API's refusal names the field).
    const typed = input("hyperparameters") && input("hyperparameters").value.trim();
    if (typed) {
      try {
        body.hyperparameters = JSON.parse(typed);
      } catch (err) {
        body.hyperparameters = typed;
      }
    }
    const deadline = $("plan-deadline").value.trim();
    if (deadline) body.deadline = (deadline.length === 16 ? `${deadline}:00` : deadline) + "Z";
    return body;
  }

  /** The selected code version's id; a bundled example is first added as the project's next
   * code version (as submitting the form would), and the select then shows that version. */
  async function codeVersionId() {
    const select = input("code_version_id");
    const value = select.value;
    if (!value.startsWith("example:")) return { id: numberOr(value) };
    const example = value.slice("example:".length);
    const added = await post(`/api/v1/projects/${projectId}/code-versions`, { example });
    if (!added.ok) return { error: added };
    const v = added.body;
    let group = select.querySelector('optgroup[label="Code versions"]');
    if (!group) {
      group = document.createElement("optgroup");
      group.label = "Code versions";
      select.insertBefore(group, select.firstChild);
    }
    const option = new Option(`v${v.version} · ${v.filename}`, String(v.id), true, true);
    group.insertBefore(option, group.firstChild);
    select.value = String(v.id);
    return { id: v.id, note: `Example ${example} added as code version v${v.version}. ` };
  }

  // ---- errors next to the fields ------------------------------------------------------------

  function clearErrors() {
    form.querySelectorAll("[data-plan-error]").forEach((node) => node.remove());
    form.querySelectorAll("[data-plan-invalid]").forEach((node) => {
      node.removeAttribute("aria-invalid");
      node.removeAttribute("data-plan-invalid");
    });
    $("plan-error").hidden = true;
  }

  /** The form element a plan field's error belongs next to (null: the panel only). */
  function anchorOf(field) {
    const group = /^resource_groups\.(\d+)/.exec(field);
    if (group) {
      const row = candidates[Number(group[1])];
      return row ? row.input : null;
    }
    if (field === "resource_groups") return form.querySelector("fieldset.groups table");
    if (field === "deadline") return $("plan-deadline");
    if (field === "code_version_id") return input("code_version_id");
    if (field === "name") return input("name");
    return field && input(field) instanceof Element ? input(field) : null;
  }

  /** A refused plan: the API's message in the panel, and next to the field it names (or,
   * for a check across fields, the first field its message names). */
  function showRefusal(answer) {
    const error = (answer.body && answer.body.error) || {};
    const message = error.message || `HTTP ${answer.status}`;
    let field = error.field || "";
    if (!field) field = FIELDS.find((name) => new RegExp(`\\b${name}\\b`).test(message)) || "";
    const shown = field && !message.startsWith(`${field}:`) ? `${field}: ${message}` : message;
    $("plan-error").textContent = `Plan refused: ${shown}`;
    $("plan-error").dataset.field = field;
    $("plan-error").hidden = false;
    const anchor = anchorOf(field);
    if (anchor) {
      const note = document.createElement("p");
      note.className = "field-error";
      note.dataset.planError = "";
      note.dataset.field = `plan.${field}`;
      note.textContent = message;
      if (anchor.tagName === "TABLE") anchor.before(note); else anchor.after(note);
      if (anchor.tagName !== "TABLE") {
        anchor.setAttribute("aria-invalid", "true");
        anchor.dataset.planInvalid = "";
      }
    }
  }

  // ---- the plan's life ----------------------------------------------------------------------

  function setStatus(nodes, busy) {
    const status = $("plan-status");
    status.replaceChildren();
    if (busy) {
      const spin = document.createElement("span");
      spin.className = "spinner";
      spin.setAttribute("aria-hidden", "true");
      status.appendChild(spin);
    }
    nodes.forEach((n) => status.appendChild(typeof n === "string" ? document.createTextNode(n) : n));
  }

  function trialLink(id) {
    const link = document.createElement("a");
    link.href = `/tasks/${id}`;
    link.id = "plan-trial-link";
    link.textContent = `task #${id}`;
    return link;
  }

  async function start() {
    if (stop) stop();
    clearErrors();
    plan = null;
    showAll = false;
    const panel = $("plan-panel");
    panel.hidden = false;
    $("plan-result").hidden = true;
    $("plan-cancel").hidden = true;
    $("plan-id").textContent = "";
    $("plan-use").textContent = "Use this plan";
    button.disabled = true;
    setStatus(["Starting a plan…"], true);
    try {
      const version = await codeVersionId();
      if (version.error) {
        candidates = [];
        setStatus([]);
        const error = (version.error.body && version.error.body.error) || {};
        showRefusal({ status: version.error.status, body: { error: { ...error, field: "code_version_id" } } });
        return;
      }
      const created = await post("/api/v1/plans", planRequest(version.id));
      if (!created.ok) {
        setStatus([]);
        showRefusal(created);
        return;
      }
      plan = created.body;
      $("plan-id").textContent = `#${plan.id}`;
      render(plan, version.note || "");
      if (plan.status === "trial") stop = P.poll(refresh, 1500);
    } catch (err) {
      setStatus([`The plan could not be started: ${err.message}`]);
    } finally {
      button.disabled = false;
    }
  }

  async function refresh() {
    if (!plan) return false;
    const current = await P.getJSON(`/api/v1/plans/${plan.id}`);
    let trial = null;
    if (current.status === "trial" && current.trial_task_id) {
      trial = await P.getJSON(`/api/v1/tasks/${current.trial_task_id}`).catch(() => null);
    }
    plan = current;
    render(current, "", trial);
    return current.status === "trial";
  }

  function render(current, note, trial) {
    $("plan-cancel").hidden = current.status !== "trial";
    if (current.status === "trial") {
      const state = trial ? `, ${trial.status.toLowerCase()}` : "";
      setStatus([note, "Trial running (", trialLink(current.trial_task_id),
        `${state}): each group times a few steps of the task's own model…`], true);
      return;
    }
    if (current.status === "failed") {
      setStatus([note, "The plan failed: ", current.error || "no reason given", ". Trial: ", trialLink(current.trial_task_id), "."]);
      return;
    }
    if (current.status === "cancelled") {
      setStatus([note, "The plan was cancelled (trial ", trialLink(current.trial_task_id), ")."]);
      return;
    }
    setStatus([note, `Ready: ${current.options.length} options predicted from the trial (`, trialLink(current.trial_task_id), ")."]);
    renderResult(current);
  }

  // ---- the answer: table, groups, deadline, chart -----------------------------------------

  /** The options shown: the fastest `SHOWN` (all with "Show all"), plus the deadline's. */
  function shownOptions(current) {
    if (showAll) return current.options;
    const shown = current.options.slice(0, SHOWN);
    const extra = current.for_deadline && !shown.some((o) => same(o, current.for_deadline));
    return extra ? [...shown, current.for_deadline] : shown;
  }

  function tag(text, className) {
    const span = document.createElement("span");
    span.className = `tag ${className}`;
    span.textContent = text;
    return span;
  }

  /** Each group's predicted peak per worker against what it may hold, with its sharding and
   * cap where the plan set them, e.g. "cpu-a 414 / 512 MiB, fsdp · cpu-b 512 / 512 MiB, ≤ 53
   * a step"; "—" where the trial measured no memory. */
  function memoryText(option) {
    const parts = Object.keys(option.workers).map((name) => {
      const peak = (option.memory_mb || {})[name];
      if (peak === null || peak === undefined) return null;
      const limit = (option.memory_limit_mb || {})[name];
      let text = `${name} ${Math.round(peak)}${limit ? ` / ${Math.round(limit)}` : ""} MiB`;
      if ((option.sharding || {})[name] === "fsdp") text += ", fsdp";
      const cap = (option.max_local_batch || {})[name];
      if (cap) text += `, ≤ ${cap} a step`;
      return text;
    }).filter((part) => part !== null);
    return parts.length ? parts.join(" · ") : "—";
  }

  function renderResult(current) {
    const chosen = current.for_deadline || current.best;
    $("plan-result").hidden = false;
    $("plan-best").textContent = `Recommended: ${groupsText(current.best.workers)}, `
      + `${current.best.split_policy} split: about ${duration(current.best.finish_s)} to finish `
      + `(${fixed(current.best.samples_per_s, 1)} samples/s).`;
    renderDeadline(current);
    const options = shownOptions(current);
    const body = $("plan-options").tBodies[0];
    body.replaceChildren(...options.map((option) => {
      const tr = document.createElement("tr");
      const first = document.createElement("td");
      first.textContent = groupsText(option.workers);
      if (same(option, current.best)) {
        tr.className = "recommended";
        tr.dataset.recommended = "true";
        first.appendChild(tag("recommended", "tag-recommended"));
      }
      if (current.for_deadline && same(option, current.for_deadline)) {
        tr.dataset.deadline = "true";
        first.appendChild(tag("fewest workers for the deadline", "tag-deadline"));
      }
      if (same(option, chosen)) tr.dataset.chosen = "true";
      tr.appendChild(first);
      [[option.split_policy, ""], [fixed(option.step_s, 3), "num"], [fixed(option.epoch_s, 1), "num"],
        [duration(option.finish_s), "num"], [fixed(option.samples_per_s, 1), "num"],
        [memoryText(option), ""]].forEach(([text, cls]) => {
        const td = document.createElement("td");
        td.textContent = text;
        if (cls) td.className = cls;
        tr.appendChild(td);
      });
      return tr;
    }));
    const hidden = current.options.length - SHOWN;
    $("plan-more").hidden = hidden <= 0;
    $("plan-show-all").textContent = showAll ? `Show the fastest ${SHOWN}` : `Show all ${current.options.length} options`;
    renderGroups(current);
    renderChart(current, options);
  }

  function renderDeadline(current) {
    const answer = $("plan-deadline-answer");
    answer.hidden = !current.deadline;
    answer.classList.toggle("missed", !!current.deadline && !current.for_deadline);
    if (!current.deadline) return;
    const by = P.fmtTime(current.deadline);
    answer.textContent = current.for_deadline
      ? `To finish by ${by} UTC: ${groupsText(current.for_deadline.workers)} (${current.for_deadline.split_policy} split) `
        + `is the fewest workers predicted to make it (about ${duration(current.for_deadline.finish_s)}); "Use this plan" takes it.`
      : `No option is predicted to finish by ${by} UTC; the fastest takes about ${duration(current.best.finish_s)}.`;
  }

  /** Each candidate group: its workers in the recommendation, what it changes in the time to
   * finish, and why it is left out. */
  function renderGroups(current) {
    const asked = (current.request.resource_groups || []).map((g) => g.name);
    P.fillTable($("plan-groups"), asked, (name) => {
      const used = current.best.workers[name];
      const gain = current.marginal_gain_s[name];
      // null: no option is left without it (or, for a group left out, with it)
      let effect = used && gain === null ? "cannot be left out" : "—";
      if (gain !== undefined && gain !== null) {
        const verb = used ? (gain >= 0 ? "saves" : "costs") : (gain >= 0 ? "would save" : "would cost");
        effect = `${verb} ${fixed(Math.abs(gain), 1)} s`;
      }
      const reason = current.left_out[name] || "";
      return [name, [used ? String(used) : "left out", "num"], [effect, "num"], reason];
    }, "No candidate groups.");
    [...$("plan-groups").tBodies[0].rows].forEach((tr, i) => {
      if (asked[i]) tr.dataset.group = asked[i];
      if (asked[i] && current.left_out[asked[i]]) tr.dataset.leftOut = "true";
    });
  }

  function renderChart(current, options) {
    const canvas = $("plan-chart");
    canvas.dataset.points = String(options.length);
    if (typeof window.Chart === "undefined") return;
    canvas.parentElement.style.height = `${Math.max(160, 26 * options.length + 50)}px`;
    const labels = options.map((o) => `${groupsText(o.workers)} · ${o.split_policy}`);
    const colors = options.map((o) => (same(o, current.best) ? "#2563eb"
      : current.for_deadline && same(o, current.for_deadline) ? "#16a34a" : "#9ca3af"));
    const data = options.map((o) => Number(o.finish_s.toFixed(2)));
    if (chart) {
      chart.data.labels = labels;
      chart.data.datasets[0].data = data;
      chart.data.datasets[0].backgroundColor = colors;
      chart.update("none");
      return;
    }
    chart = new window.Chart(canvas, {
      type: "bar",
      data: { labels, datasets: [{ label: "predicted time to finish (s)", data, backgroundColor: colors }] },
      options: {
        indexAxis: "y", animation: false, responsive: true, maintainAspectRatio: false,
        plugins: { legend: { display: false },
          tooltip: { callbacks: { label: (item) => `${duration(item.raw)} to finish` } } },
        scales: { x: { beginAtZero: true, title: { display: true, text: "seconds to finish" } } },
      },
    });
  }

  // ---- "Use this plan" ---------------------------------------------------------------------

  function setValue(name, value) {
    const field = input(name);
    if (!field || !(field instanceof Element)) return;
    field.value = value === null || value === undefined ? "" : String(value);
    field.dispatchEvent(new Event("change", { bubbles: true }));
  }

  /** Fill the form from the plan's task request: the chosen groups' workers (every other
   * group 0), split policy, sync settings, batch, epochs, seed and the hidden plan id. */
  function usePlan() {
    if (!plan || !plan.task_request) return;
    const request = plan.task_request;
    clearErrors();
    const asked = new Map(request.resource_groups.map((g) => [g.name, g]));
    groupRows().forEach((g) => {
      const item = asked.get(g.name);
      g.input.value = String(item ? item.workers : 0);
      const row = g.input.closest("tr");
      row.querySelector('select[name="group_sharding"]').value = (item && item.sharding) || "";
      row.querySelector('input[name="group_cap"]').value = item && item.max_local_batch ? String(item.max_local_batch) : "";
    });
    if (request.memory_limit_mb) setValue("memory_limit_mb", request.memory_limit_mb);
    setValue("code_version_id", request.code_version_id);
    if (request.name) setValue("name", request.name);
    ["global_batch_size", "epochs", "split_policy", "sync_strategy", "seed"].forEach(
      (name) => setValue(name, request[name]));
    setValue("sync_period", request.sync_period ?? 1);
    setValue("quorum", request.quorum ?? "");
    if ((request.sync_period ?? 1) !== 1 || request.quorum) {
      const more = $("more-settings");
      if (more) more.open = true;
    }
    $("task-plan-id").value = String(request.plan_id);
    $("plan-note-id").textContent = `#${request.plan_id}`;
    $("plan-note").hidden = false;
    $("plan-use").textContent = "Used: the form holds this plan";
    form.scrollIntoView({ behavior: "smooth", block: "start" });
  }

  function clearPlan() {
    $("task-plan-id").value = "";
    $("plan-note").hidden = true;
    $("plan-use").textContent = "Use this plan";
  }

  async function cancel() {
    if (!plan) return;
    const answer = await post(`/api/v1/plans/${plan.id}/cancel`);
    if (!answer.ok) {
      showRefusal(answer);
    }
    await refresh().catch(() => null);
    if (stop && plan.status !== "trial") stop();
  }

  button.addEventListener("click", start);
  $("plan-cancel").addEventListener("click", cancel);
  $("plan-use").addEventListener("click", usePlan);
  $("plan-clear").addEventListener("click", clearPlan);
  $("plan-show-all").addEventListener("click", () => {
    showAll = !showAll;
    if (plan && plan.status === "ready") renderResult(plan);
  });
})();
