"""The rank launcher's view of a failed rank includes the output it printed last."""

import subprocess
import time

from worker.agent.processes import ProcessSet
from worker.engine.ranks import RankProcess


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
