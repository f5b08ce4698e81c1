"""A task's connections grow with its groups, not its world (docs/scaling.md, point 6).

One real task of 4 groups x 2 workers + the parameter server (world 9) on 127.0.0.1:
every TCP connection between two of its rank processes is recorded while it runs (from
/proc, every few milliseconds: psutil's per-process listing parses the host's whole socket
table for each process, too slow for ranks that live a second; a gloo connection lives from
its first use to the end), the TCPStore's left out, and each is named by the ranks at its
two ends.
"""

from __future__ import annotations

import os
import sys
import threading
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.worker.engine.conftest import build_spec
from worker.engine.local import launch_local
from worker.engine.ranks import free_port

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")

GROUPS, WORKERS = 4, 2
ESTABLISHED = "01"  # the st column of /proc/net/tcp

Endpoint = tuple[str, int]


def _endpoint(text: str) -> Endpoint:
    """``0100007F:1F90`` (IPv4) or 32 hex digits (IPv6) and a port, as /proc/net/tcp* write."""
    address, port = text.split(":")
    return address, int(port, 16)


def established(store_port: int) -> dict[int, tuple[Endpoint, Endpoint]]:
    """This host's established TCP sockets by inode: ``(local, remote)``, the TCPStore's
    (``store_port`` at either end) left out."""
    out = {}
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            local, remote, state, inode = fields[1], fields[2], fields[3], int(fields[9])
            ends = _endpoint(local), _endpoint(remote)
            if state == ESTABLISHED and inode and store_port not in (ends[0][1], ends[1][1]):
                out[inode] = ends
    return out


def socket_inodes(pid: int) -> set[int]:
    """The inodes of the sockets process ``pid`` holds open (empty once it is gone)."""
    found = set()
    try:
        with os.scandir(f"/proc/{pid}/fd") as entries:
            for entry in entries:
                try:
                    target = os.readlink(entry.path)
                except OSError:
                    continue
                if target.startswith("socket:["):
                    found.add(int(target[8:-1]))
    except OSError:
        pass
    return found


class Connections:
    """The established TCP connections of a set of processes, seen while they run."""

    def __init__(self, store_port: int) -> None:
        self.store_port = store_port
        self.sockets: dict[tuple[Endpoint, Endpoint], int] = {}  # (local, remote) -> rank
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self, pids: dict[int, int]) -> None:
        self._thread = threading.Thread(target=self._poll, args=(pids,), daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def _poll(self, pids: dict[int, int]) -> None:
        while not self._stop.wait(0.005):
            held = {rank: socket_inodes(pid) for rank, pid in pids.items()}
            table = established(self.store_port)
            for rank, inodes in held.items():
                for inode in inodes & table.keys():
                    self.sockets[table[inode]] = rank

    def pairs(self) -> Counter[tuple[int, int]]:
        """``(lower rank, higher rank) -> connections`` between two of the processes."""
        out: Counter[tuple[int, int]] = Counter()
        for (local, remote), rank in self.sockets.items():
            peer = self.sockets.get((remote, local))
            if peer is not None and rank < peer:
                out[(rank, peer)] += 1
        return out


def _kind(pair: tuple[int, int], leaders: set[int], group_of: Callable[[int], int]) -> str:
    a, b = pair
    if a == 0:
        return "ps-leader" if b in leaders else "ps-worker"
    if group_of(a) == group_of(b):
        return "in-group"
    return "leader-leader" if {a, b} <= leaders else "across groups"


def test_a_four_group_task_connects_inside_its_groups_and_to_their_leaders(tmp_path: Path) -> None:
    spec = build_spec(
        tmp_path,
        groups=[{"name": f"g{g}", "device_type": "cpu", "workers": WORKERS} for g in range(GROUPS)],
        global_batch_size=80,  # 160 items: 2 steps
        epochs=1,
    )
    port = free_port()
    seen = Connections(port)
    try:
        run = launch_local(spec, port=port, on_spawn=seen.start, timeout_s=120)
    finally:
        seen.stop()
    assert run.ok, {rank: run.text(rank)[-2000:] for rank in run.output}

    leaders = set(spec.leader_ranks())
    pairs = seen.pairs()
    kinds: Counter[str] = Counter()
    for pair, n in pairs.items():
        kinds[_kind(pair, leaders, spec.group_of)] += n
    world = spec.world_size
    in_groups = sum(g.workers * (g.workers - 1) // 2 for g in spec.groups)  # 4 x 1
    # Inside each group a full mesh, built with the group; the parameter server and each
    # leader one connection (the leaders' group: the exchange and the control collectives'
    # star), and the first leader a second one (the world's: the replica's pull at the
    # epoch's end, the last one made, which a sample can miss); the sync step's leaders'
    # allreduce a ring of the G leaders. Nothing else: no two workers of different groups
    # but leaders, no worker but a leader with the parameter server.
    assert set(kinds) <= {"in-group", "ps-leader", "leader-leader"}, pairs
    assert kinds["in-group"] == in_groups, pairs
    assert {pair for pair in pairs if pair[0] == 0} == {(0, r) for r in leaders}, pairs
    assert GROUPS <= kinds["ps-leader"] <= GROUPS + 1, pairs
    assert kinds["leader-leader"] <= GROUPS, pairs  # the ring; a miss is possible, never more
    total = sum(pairs.values())
    assert total <= in_groups + 2 * GROUPS + 1  # 13: the formula's 4 + 4, the ring's 4, 1
    assert world * (world - 1) // 2 == 36  # the world's full mesh, before
    # A worker that leads nothing holds its group's connections only.
    for rank in range(1, world):
        if rank not in leaders:
            assert sum(n for pair, n in pairs.items() if rank in pair) == WORKERS - 1, pairs
