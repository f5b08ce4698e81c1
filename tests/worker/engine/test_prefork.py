"""Ranks forked from the preloaded fork server (worker/engine/prefork.py, enabled for the
tests in tests/conftest.py unless POLYTRAIN_TEST_PREFORK=0) run as a fresh interpreter's
would: the environment given and nothing else, a session of their own, their output read
to the end, their exit code; and without it, ranks are ``python -m worker.engine.launch``
processes."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import pytest

from worker.engine import prefork
from worker.engine.local import LocalRun, launch_local
from worker.engine.spec import RunSpec

# The tiny regression task, reporting what its rank sees when it builds the model.
REPORTING = """
import os
from examples.tiny_regression import build_datasets, build_optimizer, loss_fn
from examples.tiny_regression import build_model as _build_model

def build_model():
    with open("/proc/self/cmdline", "rb") as f:
        command_line = b"-m\\0worker.engine.launch\\0" in f.read()
    print("SEES", os.environ.get("PREFORK_LATE"), os.environ.get("PREFORK_GONE"),
          os.getsid(0) == os.getpid(), command_line, flush=True)
    return _build_model()
"""


def seen(run: LocalRun) -> list[str]:
    """What each rank printed when it built its model (REPORTING), rank by rank."""
    return [line for rank in sorted(run.output) for line in run.output[rank] if "SEES" in line]


forked = pytest.mark.skipif(
    not prefork.enabled(), reason="the fork server is off (POLYTRAIN_TEST_PREFORK=0)"
)


@forked
def test_forked_ranks_see_their_environment_lead_a_session_and_train(
    make_spec: Callable[..., RunSpec], tmp_path: Path
) -> None:
    module = tmp_path / "reporting.py"
    module.write_text(REPORTING)
    spec = make_spec(code=str(module), epochs=1)
    os.environ["PREFORK_GONE"] = "leaked"
    try:
        assert launch_local(spec).ok  # the fork server runs from here at the latest
    finally:
        del os.environ["PREFORK_GONE"]
    # Set and removed after the server started: the ranks follow this process's environment,
    # not the server's copy of it.
    os.environ["PREFORK_LATE"] = "late"
    try:
        run = launch_local(spec)
    finally:
        del os.environ["PREFORK_LATE"]
    assert run.ok, run.output
    assert seen(run) == ["SEES late None True False"] * spec.world_size  # forked, no command line
    assert {e["type"] for e in run.events} >= {"metric", "progress", "checkpoint", "done"}


@forked
def test_a_failing_forked_rank_shows_its_traceback_and_exit_code(
    make_spec: Callable[..., RunSpec], tmp_path: Path
) -> None:
    module = tmp_path / "broken.py"
    module.write_text(REPORTING + "\ndef build_datasets():\n    raise RuntimeError('no data')\n")
    run = launch_local(make_spec(code=str(module), epochs=1), fail_grace_s=2.0)
    assert not run.ok
    assert set(run.returncodes.values()) - {0}, run.returncodes
    shown = "\n".join(line for lines in run.output.values() for line in lines)
    assert "RuntimeError: no data" in shown


def test_without_the_fork_server_ranks_are_fresh_interpreters_and_train(
    make_spec: Callable[..., RunSpec], tmp_path: Path
) -> None:
    """The path benchmarks and users of launch_local take: ``python -m worker.engine.launch``."""
    module = tmp_path / "reporting.py"
    module.write_text(REPORTING)
    was = prefork.enabled()
    with prefork.disabled():
        run = launch_local(make_spec(code=str(module), epochs=1))
    assert prefork.enabled() == was
    assert run.ok, run.output
    assert seen(run) == ["SEES None None True True"] * len(run.pids)
    assert {e["type"] for e in run.events} >= {"metric", "progress", "checkpoint", "done"}
