"""Rank processes forked from an interpreter that imported torch once (tests only).

A fresh interpreter spends about two seconds of CPU importing torch and the engine before a
rank does anything, and a tiny task's four ranks train for a fraction of that: a test suite
that runs hundreds of short tasks on 127.0.0.1 (:func:`worker.engine.local.launch_local`)
spends most of its CPU there. After :func:`enable`, ``launch_local`` starts each rank by
forking Python's multiprocessing fork server, which imported torch and
:mod:`worker.engine.launch` once (``set_forkserver_preload``, run no torch operation, so no
thread pool exists to be forked). The rank then takes the environment variables a fresh
interpreter would be given (``sys.path``, the modules already imported and the hash seed
stay the fork server's), leads a session of its own, writes stdout and stderr to one pipe,
and runs :func:`worker.engine.launch.main`, as ``python -m worker.engine.launch`` does.
``POLYTRAIN_TEST_PREFORK=0`` keeps it off for a whole test run (tests/conftest.py); one
test turns it off around its own run (:func:`disabled`).

The platform never uses this: an agent starts every rank in a sandboxed interpreter of its
own (:mod:`worker.agent.processes`), and benchmarks keep fresh interpreters (they measure
what a task costs).
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.connection
import os
import subprocess
import sys
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import IO

# torch._dynamo: a first optimizer step imports it (about a second of CPU).
PRELOAD = ["torch", "torch._dynamo", "worker.engine.launch"]

_enabled = False


def enable(also: Sequence[str] = ()) -> None:
    """Fork ranks of :func:`worker.engine.local.launch_local` from the preloaded fork server
    from now on, in this process. ``also``: more modules to preload, e.g. the caller's
    ``python -m`` module: multiprocessing runs the parent's main module again in every
    child it starts (as ``__mp_main__``), so a main module whose imports the fork server
    has not made would count them (0.56 s of CPU for bench.time_to_accuracy's) in every
    rank's start-up."""
    global _enabled
    multiprocessing.get_context("forkserver").set_forkserver_preload([*PRELOAD, *also])
    _enabled = True


def enabled() -> bool:
    return _enabled


@contextmanager
def disabled() -> Iterator[None]:
    """Inside, :func:`worker.engine.local.launch_local` starts fresh interpreters
    (``python -m worker.engine.launch``), as it does where :func:`enable` was never called."""
    global _enabled
    was, _enabled = _enabled, False
    try:
        yield
    finally:
        _enabled = was


def _run_rank(
    argv: list[str], env: dict[str, str], output: multiprocessing.connection.Connection
) -> None:
    """In the forked child: a session of its own, ``env`` as the whole environment, stdout
    and stderr into ``output``, multiprocessing's default start method as a fresh
    interpreter has it (the fork server's child inherits its parent's: a DataLoader's
    workers would start by spawning and not find the user's module), then the rank (never
    returns)."""
    multiprocessing.set_start_method(None, force=True)
    os.setsid()
    os.dup2(output.fileno(), 1)
    os.dup2(output.fileno(), 2)
    output.close()
    sys.stdout = open(1, "w", buffering=1, encoding="utf-8", closefd=False)  # noqa: SIM115
    sys.stderr = open(2, "w", buffering=1, encoding="utf-8", closefd=False)  # noqa: SIM115
    os.environ.clear()
    os.environ.update(env)
    sys.argv = ["worker.engine.launch", *argv]
    from worker.engine import launch

    launch.exit_now(launch.main(argv))


class ForkedRank:
    """One forked rank, with the part of :class:`subprocess.Popen` that
    :class:`worker.engine.ranks.RankSet` uses: ``pid``, ``stdout`` (text, line by line),
    ``poll``, ``wait`` and ``returncode`` (negative: killed by that signal)."""

    def __init__(self, argv: list[str], env: Mapping[str, str]) -> None:
        context = multiprocessing.get_context("forkserver")
        reader, writer = context.Pipe(duplex=False)
        self._process = context.Process(target=_run_rank, args=(argv, dict(env), writer))
        self._process.start()
        writer.close()
        assert self._process.pid is not None
        self.pid: int = self._process.pid
        self.stdout: IO[str] = open(  # noqa: SIM115 (read to the end by the rank's reader)
            os.dup(reader.fileno()), encoding="utf-8", errors="replace"
        )
        reader.close()

    @property
    def returncode(self) -> int | None:
        return self._process.exitcode

    def poll(self) -> int | None:
        return self._process.exitcode

    def wait(self, timeout: float | None = None) -> int:
        self._process.join(timeout)
        code = self._process.exitcode
        if code is None:
            raise subprocess.TimeoutExpired(["worker.engine.launch"], timeout or 0.0)
        return code
