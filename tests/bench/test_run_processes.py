"""bench.common.run_processes: results from spawned processes, or a clear error, and no
process left behind."""

from __future__ import annotations

import os
from typing import Any

import pytest

from bench.common import run_processes


def _answer(value: int, out: Any) -> None:
    out.put(("pid", os.getpid(), value * 2))


def _fail(out: Any) -> None:
    raise SystemExit(3)


def test_each_process_result_comes_back_and_every_process_is_reaped() -> None:
    found = run_processes([(_answer, (1,)), (_answer, (20,))], timeout_s=120)
    assert sorted(value for _, _, value in found) == [2, 40]
    pids = [pid for _, pid, _ in found]
    assert len(set(pids)) == 2 and os.getpid() not in pids
    for pid in pids:  # reaped: no such process any more
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


def test_a_process_that_fails_before_its_result_is_an_error_not_a_wait() -> None:
    with pytest.raises(RuntimeError, match=r"a process failed \(exit codes \[3\]\)"):
        run_processes([(_answer, (1,)), (_fail, ())], timeout_s=600)
