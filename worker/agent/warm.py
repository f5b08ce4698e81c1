"""A warm interpreter: torch and the training engine imported before a rank is known.

The agent keeps a few of these ready (see `processes.WarmPool`) so a task's
ranks start in milliseconds instead of paying Python's and torch's import
time (seconds on a small host) after the task was scheduled. A cold start
(`--cold`, when no warm one is ready) skips the warm-up. Either runs inside the
rank's sandbox (`worker.agent.sandbox`) as the unprivileged sandbox user.

The process reads one JSON line `{"argv": [...], "env": {...}, "cwd": ...,
"memory_limit_bytes": N}` from stdin, lowers its data-memory limit
(RLIMIT_DATA, soft and hard, so user code cannot raise it again) to N bytes
and turns core dumps off, adds `env` to its environment, moves to `cwd`, names
itself `pt-rank-<RANK>` (as `ps` shows it) and runs
`worker.engine.launch.main(argv)` exactly as `python -m worker.engine.launch`
would; end of input (the agent closed the pipe or died) makes it exit without
running anything.
"""

import ctypes
import json
import os
import resource
import sys
import time

PR_SET_NAME = 15
# Where a rank sees its code version's own packages (worker.agent.environments): its slot's
# hard-linked copy of the environment, read-only, added after the platform's site-packages.
ENV_MOUNT = "/polytrain/env"


def _warm_up() -> None:
    """Import the engine and run one tiny forward/backward and optimizer step (torch's
    first-call costs: the first optimizer imports torch._dynamo, about a second)."""
    import torch

    import worker.engine.launch  # noqa: F401  (the import is the point)

    layer = torch.nn.Linear(4, 1)
    optimizer = torch.optim.SGD(layer.parameters(), lr=0.1)
    layer(torch.randn(2, 4)).sum().backward()
    optimizer.step()


def _name(title: str) -> None:
    try:
        ctypes.CDLL(None).prctl(PR_SET_NAME, title.encode()[:15], 0, 0, 0)
    except (OSError, AttributeError):
        pass


def limit_memory(limit_bytes: int) -> None:
    """Cap this process's data memory (heap, private writable mappings: where tensors live)
    at `limit_bytes`; an allocation beyond it fails (MemoryError, or torch's
    "can't allocate memory"). No core dumps either."""
    resource.setrlimit(resource.RLIMIT_DATA, (limit_bytes, limit_bytes))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))


def _add_environment() -> None:
    """The code version's own packages (worker.agent.environments), when its agent linked
    them into this rank's read-only folder, go after the platform's: what the platform ships
    (torch, the engine) cannot be shadowed. `site.addsitedir` also reads their `.pth` files."""
    import site

    if os.path.isdir(ENV_MOUNT) and os.listdir(ENV_MOUNT):
        site.addsitedir(ENV_MOUNT)


def main(argv: list[str]) -> int:
    if "--cold" not in argv:
        _warm_up()
        print("@@warm ready", flush=True)
    line = sys.stdin.readline()
    if not line:
        return 0
    from worker.engine import report

    report.RANK_STARTED = time.time()  # a rank's start-up counts from its order, not the wait
    order = json.loads(line)
    limit_memory(int(order["memory_limit_bytes"]))
    os.environ.update(order["env"])
    os.chdir(order["cwd"])
    _add_environment()
    _name(f"pt-rank-{os.environ.get('RANK', '?')}")
    from worker.engine.launch import exit_now
    from worker.engine.launch import main as launch

    exit_now(launch(order["argv"]))  # no teardown after a rank (worker.engine.launch.exit_now)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
