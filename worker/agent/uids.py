"""The pool of sandbox uids a host's agents share: one uid per rank slot (docs/security.md).

A lease is a `flock` on a file named for the uid, so the agents of a host
share the pool and a crashed agent's uids come back by themselves. While a
slot holds its uid, `worker.agent.netpolicy` decides what the uid's packets
may reach.
"""

from __future__ import annotations

import fcntl
import os
import pwd
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from worker.agent import netpolicy
from worker.agent.netpolicy import NetworkPolicyUnavailable

DEFAULT_UID_FIRST, DEFAULT_UID_COUNT = 2_100_000_000, 64
# Where the agents of a host record which sandbox uids they hold (one lock file per uid).
LEASE_DIR = Path("/run/polytrain/sandbox-uids")


class SandboxUnavailable(RuntimeError):
    """The sandbox cannot be set up on this host; the message names the command that fixes it."""


class Lease:
    """One sandbox uid held by this process until :meth:`release` (a lock on its file).

    While held, :meth:`admit` lets the uid's packets reach one task's ranks
    (`worker.agent.netpolicy.admit`); release closes its network again first.
    """

    def __init__(self, uid: int, fd: int, pool: range) -> None:
        self.uid, self._fd, self.pool = uid, fd, pool
        self._lock = threading.Lock()
        self._released = False

    def admit(self, task_id: int, peers: Sequence[str] = ()) -> None:
        """Open the uid's network to the ranks of task `task_id` on this host and on the hosts
        `peers` (again with more peers as their agents claim). Raises
        NetworkPolicyUnavailable, or RuntimeError once released."""
        with self._lock:
            if self._released:
                raise RuntimeError(f"sandbox uid {self.uid} was already released")
            netpolicy.admit(self.uid, task_id, self.pool, peers)

    def release(self) -> None:
        """Close the uid's network and give the uid back to the pool (idempotent)."""
        with self._lock:
            if self._released:
                return
            self._released = True
            try:
                netpolicy.revoke(self.uid)
            finally:
                os.close(self._fd)  # the lock goes with it


@dataclass(frozen=True)
class UidPool:
    """The sandbox uids `first` .. `first + count - 1`, leased one per rank slot.

    Leases are `flock`s on files in `lease_dir`, so the agents of a host share
    the pool and a crashed agent's uids come back by themselves. The uids need
    no account: ranks see them named ``polytrain-run-<n>`` in the passwd file
    the sandbox mounts.
    """

    first: int
    count: int
    lease_dir: Path = LEASE_DIR

    @property
    def uids(self) -> range:
        return range(self.first, self.first + self.count)

    def lease(self) -> Lease:
        """A free uid, its network closed. Raises SandboxUnavailable when all are held."""
        self.lease_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        for uid in self.uids:
            fd = os.open(self.lease_dir / str(uid), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                continue
            try:  # a crashed agent may have left it admitted
                netpolicy.revoke(uid)
            except NetworkPolicyUnavailable:
                os.close(fd)
                raise
            return Lease(uid, fd, self.uids)
        raise SandboxUnavailable(
            f"all {self.count} sandbox uids ({self.first}..{self.first + self.count - 1}) are "
            "in use on this host: raise POLYTRAIN_SANDBOX_UID_COUNT"
        )

    def check_unowned(self) -> None:
        """Raise SandboxUnavailable if an account of this host owns a uid of the pool (its
        files and processes would be open to user code)."""
        for uid in self.uids:
            try:
                owner = pwd.getpwuid(uid).pw_name
            except KeyError:
                continue
            raise SandboxUnavailable(
                f"sandbox uid {uid} belongs to the account '{owner}': move the pool with "
                "POLYTRAIN_SANDBOX_UID_FIRST to uids no account uses"
            )

    def passwd_lines(self, gid: int) -> list[str]:
        """passwd entries naming the pool's uids, for the sandbox's /etc/passwd."""
        return [
            f"polytrain-run-{uid - self.first}:x:{uid}:{gid}:polytrain rank:/nonexistent:"
            "/usr/sbin/nologin"
            for uid in self.uids
        ]
