"""A checkpoint as one file to download: its sharded state made whole, on demand.

A checkpoint keeps the optimizer states its workers hold out of its file, in state folders
beside it (a sharded group's: one file from each member; each group's own under
``periodic`` and ``diloco``), and where the parameter server's owners hold the model, its
slices (one folder an owner; contracts/sharded_state.py).
A user downloads one ``torch.save`` dict all the same: the first download builds it
(``python -m contracts.sharded_state``, in a process of its own, so the API process never
holds the state and a malformed folder cannot reach it) and keeps it beside the checkpoint,
in ``.whole/``, for the next; stored checkpoints and their parts never change, so neither
does what is built from them.
"""

import fcntl
import os
import subprocess
import sys
import threading
from pathlib import Path

from backend.core.errors import Conflict, ServiceError
from backend.tasks.models import Checkpoint

CONSOLIDATE_TIMEOUT_S = 1800.0
"""The longest a consolidation may run (it reads and writes the whole state once)."""


class ConsolidationFailed(ServiceError):
    """The stored state could not be made one file: its files, written by the task's own
    ranks, are malformed (a 422 naming the checkpoint)."""

    status = 422


def _plain_env() -> dict[str, str]:
    """The consolidation's environment: the interpreter's search paths and locale only."""
    keep = ("PATH", "PYTHONPATH", "LANG", "LC_ALL", "HOME", "VIRTUAL_ENV")
    return {k: v for k, v in os.environ.items() if k in keep} | {"OMP_NUM_THREADS": "1"}


def whole_file(checkpoint: Checkpoint) -> Path:
    """The file to download for ``checkpoint``: its own, or, where its state is
    sharded, the consolidated one (built now if not yet).

    Raises:
        Conflict: a file of its sharded state is not stored yet (field `checkpoint_id`).
        ConsolidationFailed: the stored files do not make a whole state (field
            `checkpoint_id`).
    """
    own = Path(checkpoint.path)
    if not checkpoint.parts:
        return own
    missing = checkpoint.missing_parts()
    if missing:
        raise Conflict(
            f"checkpoint {checkpoint.id}'s sharded state is still arriving: "
            f"{len(missing)} of its {len(checkpoint.parts)} files are not stored yet; the "
            "ranks that wrote them upload them beside it, so try again shortly",
            field="checkpoint_id",
        )
    target = own.parent / ".whole" / own.name
    if target.is_file():
        return target
    target.parent.mkdir(exist_ok=True, mode=0o700)
    # One build at a time for a checkpoint (across the API's processes): a second download
    # waits for the first's file instead of building it again.
    with open(target.with_name(f".{own.name}.lock"), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not target.is_file():
            _build(checkpoint.id, own, target)
    return target


def _build(checkpoint_id: int, own: Path, target: Path) -> None:
    """Write ``target``: checkpoint file ``own`` with the states of its folders (beside it)
    made whole, by a subprocess."""
    partial = target.with_name(f".{own.name}.{os.getpid()}-{threading.get_ident()}.partial")
    command = [sys.executable, "-m", "contracts.sharded_state", str(own)]
    try:
        done = subprocess.run(
            [*command, str(partial)],
            capture_output=True,
            text=True,
            timeout=CONSOLIDATE_TIMEOUT_S,
            check=False,
            env=_plain_env(),  # none of the portal's settings or secrets
            cwd=own.parent,
        )
        if done.returncode != 0:
            said = (done.stderr.strip().splitlines() or ["no reason given"])[-1]
            raise ConsolidationFailed(
                f"checkpoint {checkpoint_id} could not be made one file, its sharded state's "
                f"files being malformed ({said[-300:]}); download an earlier checkpoint",
                field="checkpoint_id",
            )
        os.replace(partial, target)
    except subprocess.TimeoutExpired:
        raise ConsolidationFailed(
            f"checkpoint {checkpoint_id} took over {CONSOLIDATE_TIMEOUT_S:.0f} s to make whole",
            field="checkpoint_id",
        ) from None
    finally:
        partial.unlink(missing_ok=True)
