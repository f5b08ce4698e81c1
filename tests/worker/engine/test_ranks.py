"""The rank launcher's view of a failed rank includes the output it printed last."""

import subprocess
import time
from pathlib import Path

import pytest

from worker.agent.processes import ProcessSet
from worker.engine.ranks import SHARDED_MALLOC_CONF, RankProcess, allocator_env, jemalloc_path


class SlowReader(ProcessSet):
    """A reader that falls behind, as it does on a loaded host."""

    def _pump(self, proc: RankProcess) -> None:
        time.sleep(0.5)
        super()._pump(proc)


def test_a_failed_rank_is_judged_on_its_whole_output() -> None:
    """A rank can exit before the reader has taken its last lines, the ones that say why it
    failed; the failure (cause, summary) is judged only once they are read."""
    ranks = SlowReader()
    script = "echo 'DistBackendError: Connection closed by peer'; exit 1"
    popen = subprocess.Popen(
        ["sh", "-c", script], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    ranks.add(1, popen)
    popen.wait()
    failed = ranks.failed()
    assert failed is not None
    assert failed.tail == ["DistBackendError: Connection closed by peer"]
    assert ProcessSet.cause(failed) == "peer"


def test_a_sharded_worker_gets_jemalloc_where_the_host_asks(tmp_path: Path) -> None:
    library = tmp_path / "libjemalloc.so.2"
    library.write_bytes(b"")
    named = {"POLYTRAIN_JEMALLOC": str(library)}
    assert jemalloc_path(named) == str(library)
    assert allocator_env(True, named) == {
        "LD_PRELOAD": str(library),
        "MALLOC_CONF": SHARDED_MALLOC_CONF,
    }
    assert allocator_env(False, named) == {}  # whole-model ranks keep glibc's malloc
    for off in ({}, {"POLYTRAIN_JEMALLOC": "off"}, {"POLYTRAIN_JEMALLOC": ""}):
        assert allocator_env(True, off) == {}  # glibc's, the default
    with pytest.raises(FileNotFoundError, match="POLYTRAIN_JEMALLOC"):
        jemalloc_path({"POLYTRAIN_JEMALLOC": str(tmp_path / "missing.so")})
    found = jemalloc_path({"POLYTRAIN_JEMALLOC": "on"})  # this host's, from the usual paths
    assert found is None or Path(found).is_file()
