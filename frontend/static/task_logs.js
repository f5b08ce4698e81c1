/* Task page: the live log stream (server-sent events) with follow/pause, a node filter, a
 * search box (hides the lines that do not contain its text, new ones too) and a download
 * link for the filtered node. Log text is only ever set as textContent. */
"use strict";

(function () {
  const view = document.getElementById("log-view");
  if (!view) return;
  const nodeSelect = document.getElementById("log-node");
  const followButton = document.getElementById("log-follow");
  const state = document.getElementById("log-state");
  const search = document.getElementById("log-search");
  const matches = document.getElementById("log-matches");
  const download = document.getElementById("log-download");
  const MAX_LINES = 5000;
  let source = null;
  let lastId = 0;
  let following = true;
  let pending = [];
  let needle = "";  // the search text, lower case; "" shows every line
  let shown = 0;  // lines in the view that match it

  function setState(text) { state.textContent = text; }

  function setFollowing(on) {
    following = on;
    followButton.setAttribute("aria-pressed", String(on));
    followButton.textContent = on ? "Following" : "Paused";
    if (on) view.scrollTop = view.scrollHeight;
  }

  /** Whether a row contains the search text (case-insensitive, in time, node or text). */
  function matchesSearch(row) {
    if (!needle) return true;
    return [...row.children].map((span) => span.textContent).join(" ").toLowerCase().includes(needle);
  }

  /** Show or hide a row for the search; true when it is shown. */
  function applySearch(row) {
    const match = matchesSearch(row);
    row.hidden = !match;
    return match;
  }

  function showCount() {
    matches.textContent = needle ? `${shown} of ${view.childElementCount} lines` : "";
  }

  function onSearch() {
    needle = search.value.trim().toLowerCase();
    shown = 0;
    for (const row of view.children) if (applySearch(row)) shown += 1;
    showCount();
    if (following) view.scrollTop = view.scrollHeight;
  }

  function lineElement(line) {
    const row = document.createElement("div");
    row.className = "log-line";
    row.dataset.node = line.node;
    [["log-time", line.time.slice(11, 19)], ["log-node", line.node], ["log-text", line.text]]
      .forEach(([className, text]) => {
        const span = document.createElement("span");
        span.className = className;
        span.textContent = text;
        row.appendChild(span);
      });
    return row;
  }

  function flush() {
    const fragment = document.createDocumentFragment();
    pending.forEach((line) => {
      const row = lineElement(line);
      if (applySearch(row)) shown += 1;
      fragment.appendChild(row);
    });
    pending = [];
    view.appendChild(fragment);
    while (view.childElementCount > MAX_LINES) {
      if (!view.firstElementChild.hidden) shown -= 1;
      view.firstElementChild.remove();
    }
    showCount();
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
    if (!pending.length) requestAnimationFrame(flush);
    pending.push(line);
    setState(`live · ${view.childElementCount + pending.length} lines`);
  }

  /** Open the stream; the browser reconnects by itself, sending Last-Event-ID, which the
   * server resumes after. Only a refused stream (readyState CLOSED) needs a new one. */
  function connect() {
    const params = new URLSearchParams();
    if (lastId) params.set("after_id", String(lastId));
    if (nodeSelect.value) params.set("node", nodeSelect.value);
    const query = params.toString();
    const stream = new EventSource(view.dataset.streamUrl + (query ? `?${query}` : ""));
    source = stream;
    stream.addEventListener("open", () => setState("live"));
    stream.addEventListener("log", onLog);
    stream.addEventListener("end", (event) => {
      stream.close();
      source = null;
      setState(`task ended (${JSON.parse(event.data).status}); log complete`);
    });
    stream.addEventListener("error", () => {
      if (source !== stream) return;
      if (stream.readyState === EventSource.CONNECTING) { setState("reconnecting…"); return; }
      stream.close();
      source = null;
      setState("disconnected; retrying…");
      setTimeout(() => { if (source === null) connect(); }, 3000);
    });
  }

  function restart() {
    if (source) source.close();
    source = null;
    pending = [];
    lastId = 0;
    view.replaceChildren();
    shown = 0;
    showCount();
    setDownload();
    setState("connecting…");
    connect();
  }

  /** The download link gives the node the view is filtered to (all nodes when none). */
  function setDownload() {
    const node = nodeSelect.value;
    download.href = download.dataset.baseUrl + (node ? `?node=${encodeURIComponent(node)}` : "");
  }

  followButton.addEventListener("click", () => setFollowing(!following));
  search.addEventListener("input", onSearch);
  view.addEventListener("wheel", (event) => { if (event.deltaY < 0 && following) setFollowing(false); });
  nodeSelect.addEventListener("change", restart);
  setDownload();
  connect();
})();
