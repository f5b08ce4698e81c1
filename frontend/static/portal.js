/* Shared helpers of the polytrain portal: JSON fetches, status badges, progress bars, tables. */
"use strict";

window.Polytrain = (function () {
  const TERMINAL = new Set(["SUCCEEDED", "FAILED", "CANCELLED"]);

  /** GET `url` and parse the JSON body; throws on a non-2xx answer. */
  async function getJSON(url) {
    const response = await fetch(url, { headers: { Accept: "application/json" }, cache: "no-store" });
    if (response.status === 401) {  // the session ended: log in again, then come back here
      window.location.assign(`/login?next=${encodeURIComponent(location.pathname + location.search)}`);
    }
    if (!response.ok) throw new Error(`${url}: HTTP ${response.status}`);
    return response.json();
  }

  /** Run `fn` now and every `ms` milliseconds (skipped while the tab is hidden) until it returns false. */
  function poll(fn, ms) {
    let timer = null;
    async function tick() {
      let again = true;
      if (!document.hidden) {
        try { again = (await fn()) !== false; } catch (err) { console.warn(err); }
      }
      if (again) timer = setTimeout(tick, ms);
    }
    tick();
    return () => clearTimeout(timer);
  }

  function setBadge(badge, status) {
    if (!badge || badge.dataset.status === status) return;
    badge.className = `badge status-${status.toLowerCase()}`;
    badge.dataset.status = status;
    badge.textContent = status;
  }

  /** Update a progress bar rendered by the `progress_bar` macro inside `container`. */
  function setProgress(container, fraction) {
    if (!container) return;
    const pct = `${Math.round((fraction || 0) * 100)}%`;
    const bar = container.querySelector(".progress");
    container.querySelector(".progress-fill").style.width = pct;
    container.querySelector(".progress-label").textContent = pct;
    if (bar) bar.setAttribute("aria-valuenow", String(Math.round((fraction || 0) * 100)));
  }

  /** A naive UTC ISO timestamp from the API as `YYYY-MM-DD HH:MM:SS`. */
  function fmtTime(iso) {
    return iso ? iso.replace("T", " ").slice(0, 19) : "—";
  }

  /** Seconds as `45 s`, `12 min 5 s` or `3 h 20 min` (as the server's `duration` filter). */
  function fmtDuration(seconds) {
    const s = Math.max(0, Math.round(seconds));
    if (s < 60) return `${s} s`;
    if (s < 3600) return `${Math.floor(s / 60)} min ${s % 60} s`;
    return `${Math.floor(s / 3600)} h ${Math.floor((s % 3600) / 60)} min`;
  }

  function cell(content, className) {
    const td = document.createElement("td");
    if (content instanceof Node) td.appendChild(content); else td.textContent = content ?? "—";
    if (className) td.className = className;
    return td;
  }

  /** Replace the body of `table` with one row per item; `columns` maps an item to cells. */
  function fillTable(table, items, columns, emptyText) {
    const body = table.tBodies[0];
    const rows = items.map((item) => {
      const tr = document.createElement("tr");
      columns(item).forEach((c) => tr.appendChild(Array.isArray(c) ? cell(c[0], c[1]) : cell(c)));
      return tr;
    });
    if (!rows.length) {
      const tr = document.createElement("tr");
      tr.className = "empty-row";
      const td = cell(emptyText);
      td.colSpan = table.tHead.rows[0].cells.length;
      tr.appendChild(td);
      rows.push(tr);
    }
    body.replaceChildren(...rows);
  }

  /** What pages would otherwise do inline (the CSP allows no inline script or style):
   *  progress bars take their width from `aria-valuenow`, `data-confirm` forms ask first. */
  function initPage() {
    document.querySelectorAll(".progress[aria-valuenow]").forEach((bar) => {
      const fill = bar.querySelector(".progress-fill");
      if (fill) fill.style.width = `${bar.getAttribute("aria-valuenow")}%`;
    });
    document.querySelectorAll("form[data-confirm]").forEach((form) => {
      form.addEventListener("submit", (event) => {
        if (!window.confirm(form.dataset.confirm)) event.preventDefault();
      });
    });
  }
  if (document.readyState === "loading") document.addEventListener("DOMContentLoaded", initPage);
  else initPage();

  return { TERMINAL, getJSON, poll, setBadge, setProgress, fmtTime, fmtDuration, fillTable };
})();
