/* Task lists: refresh each row's status badge and progress bar every few seconds (the rows
 * of the page shown, with its filters); "Compare selected" is enabled while 2 to the most
 * comparable tasks are ticked. */
"use strict";

(function () {
  const P = window.Polytrain;
  const list = document.querySelector("[data-task-list]");
  if (!list) return;
  const notice = document.getElementById("new-tasks");
  const compare = document.getElementById("compare-button");
  const hint = document.getElementById("compare-hint");
  const most = Number(list.dataset.maxCompared || 10);

  function selectionChanged() {
    if (!compare) return;
    const ticked = list.querySelectorAll('input[name="ids"]:checked').length;
    compare.disabled = ticked < 2 || ticked > most;
    hint.textContent = ticked > most ? `at most ${most} tasks (${ticked} selected)`
      : `${ticked} selected: select 2 to ${most} tasks`;
  }
  list.addEventListener("change", selectionChanged);
  selectionChanged();

  function update(task) {
    const row = list.querySelector(`tr[data-task-id="${task.id}"]`);
    if (!row) return false;
    P.setBadge(row.querySelector(".cell-status .badge"), task.status);
    P.setProgress(row.querySelector(".cell-progress"), task.progress);
    return true;
  }

  P.poll(async () => {
    const tasks = await P.getJSON(list.dataset.refreshUrl);
    const unknown = tasks.filter((task) => !update(task)).length;
    if (notice) notice.hidden = unknown === 0;
  }, 3000);
})();
