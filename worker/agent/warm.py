"""A warm interpreter: torch and the training engine imported before a rank is known.

The agent keeps a few of these ready (see `processes.WarmPool`) so a task's
ranks start in milliseconds instead of paying Python's and torch's import
time (seconds on a small host) after the task was scheduled. The process
reads one JSON line `{"argv": [...], "env": {...}, "cwd": ...}` from stdin,
adds `env` to its environment, moves to `cwd`, names itself `pt-rank-<RANK>`
(as `ps` shows it) and runs `worker.engine.launch.main(argv)` exactly as
`python -m worker.engine.launch` would; end of input (the agent closed the
pipe or died) makes it exit without running anything.
"""

import ctypes
import json
import os
import sys

PR_SET_NAME = 15


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


def main() -> int:
    _warm_up()
    print("@@warm ready", flush=True)
    line = sys.stdin.readline()
    if not line:
        return 0
    order = json.loads(line)
    os.environ.update(order["env"])
    os.chdir(order["cwd"])
    _name(f"pt-rank-{os.environ.get('RANK', '?')}")
    from worker.engine.launch import main as launch

    return launch(order["argv"])


if __name__ == "__main__":
    sys.exit(main())
