"""A stand-in benchmark for tests/bench/test_run_all.py: prints its JSON line and exits, leaving
behind a process of its own session that holds its output open (as a rank orphaned by a failed
benchmark does)."""

import json
import subprocess
import sys

if __name__ == "__main__":
    left = subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(600)"], start_new_session=True
    )
    print(json.dumps({"benchmark": "leaves_a_rank", "value": left.pid}), flush=True)
