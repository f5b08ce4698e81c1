/* Task lists: refresh each row's status badge and progress bar every few seconds. */
"use strict";

(function () {
  const P = window.Polytrain;
  const list = document.querySelector("[data-task-list]");
  if (!list) return;
  const notice = document.getElementById("new-tasks");

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
