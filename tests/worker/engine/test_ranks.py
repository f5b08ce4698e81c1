"""The rank launcher's view of a failed rank includes the output it printed last."""

import subprocess
import time
from pathlib import Path

import pytest

from worker.agent.processes import ProcessSet
from worker.engine import ranks
from worker.engine.ranks import (
    JEMALLOC_PATHS,
    SHARDED_MALLOC_CONF,
    RankProcess,
    allocator_env,
    jemalloc_path,
)


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


def test_a_sharded_worker_gets_jemalloc_where_the_host_asks(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    found = next(p for p in JEMALLOC_PATHS if Path(p).is_file())  # make install's libjemalloc2
    named = {"POLYTRAIN_JEMALLOC": found}
    assert jemalloc_path(named) == found
    assert allocator_env(True, named) == {"LD_PRELOAD": found, "MALLOC_CONF": SHARDED_MALLOC_CONF}
    assert allocator_env(False, named) == {}  # whole-model ranks keep glibc's malloc
    for value in (None, " off ", "", "0"):
        off = {} if value is None else {"POLYTRAIN_JEMALLOC": value}
        assert allocator_env(True, off) == {}  # glibc's, the default
    # "on" takes the first of the distributions' paths that exists
    first, second = tmp_path / "a.so", tmp_path / "b.so"
    second.write_bytes(b"")
    monkeypatch.setattr(ranks, "JEMALLOC_PATHS", (str(first), str(second)))
    for on in ("on", "ON", "1", "true"):
        assert jemalloc_path({"POLYTRAIN_JEMALLOC": on}) == str(second)
    second.unlink()
    assert jemalloc_path({"POLYTRAIN_JEMALLOC": "on"}) is None
    # the library goes into processes the agent starts as root: a file under /usr, root's alone
    library = tmp_path / "libjemalloc.so.2"
    library.write_bytes(b"")
    for bad in (str(library), str(tmp_path / "missing.so"), "yes", "/usr"):
        with pytest.raises(ValueError, match="POLYTRAIN_JEMALLOC"):
            jemalloc_path({"POLYTRAIN_JEMALLOC": bad})
