"""An agent's identity: the instance id it keeps in its data dir, held by one process at a time.

The backend lets a registration take a live agent's name only with that
agent's instance id (`backend/agents/service.register`): an agent restarted
on the same host and data dir reads the same id and takes its name back at
once; a second agent elsewhere with the same name has another id and is
refused. On one host, the lock file stops a second process from using the
same name and data dir while the first runs.
"""

import fcntl
import os
import re
import secrets
from pathlib import Path
from typing import IO


class NameClash(Exception):
    """Another running agent already uses this name (here: the same data dir)."""


_held: dict[str, IO[str]] = {}


def claim_instance_id(data_dir: str | Path, name: str) -> str:
    """Lock `name` in `data_dir/agents/` for this process and return its instance id.

    The id (32 hex digits) is created on first use and kept in
    `data_dir/agents/<name>.id` (mode 0600). The lock is released when the
    process exits, however it exits.

    Raises:
        NameClash: another live process on this host holds `name` in this data dir.
    """
    folder = Path(data_dir) / "agents"
    folder.mkdir(parents=True, exist_ok=True, mode=0o700)
    stem = re.sub(r"[^A-Za-z0-9_.-]", "_", name)
    lock_path = (folder / f"{stem}.lock").resolve()
    if str(lock_path) not in _held:
        _held[str(lock_path)] = _lock(lock_path, name, data_dir)
    id_file = folder / f"{stem}.id"
    try:
        instance = id_file.read_text().strip()
    except FileNotFoundError:
        instance = ""
    if not re.fullmatch(r"[0-9a-f]{32}", instance):
        instance = secrets.token_hex(16)
        fd = os.open(id_file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as fh:
            fh.write(instance)
    return instance


def _lock(path: Path, name: str, data_dir: str | Path) -> IO[str]:
    """Hold an exclusive lock on `path` (kept open), writing this pid into it."""
    lock = open(path, "a+")  # noqa: SIM115 (held for the process's life)
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        lock.seek(0)
        holder = lock.read().strip() or "?"
        lock.close()
        raise NameClash(
            f"agent name '{name}' is in use by another agent on this host "
            f"(pid {holder}, data dir {Path(data_dir).resolve()}); start this agent "
            f"with another --name, or stop that one first"
        ) from None
    lock.truncate(0)
    lock.write(str(os.getpid()))
    lock.flush()
    return lock
