"""An agent's instance id: kept in its data dir, held by one process at a time."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from worker.agent.identity import claim_instance_id


def test_the_id_survives_a_restart_and_differs_per_name(tmp_path: Path) -> None:
    first = claim_instance_id(tmp_path, "gpu-box/a")
    assert len(first) == 32 and int(first, 16) >= 0
    assert claim_instance_id(tmp_path, "gpu-box/a") == first
    assert claim_instance_id(tmp_path, "gpu-box/b") != first
    id_file = tmp_path / "agents" / "gpu-box_a.id"
    assert id_file.read_text() == first and id_file.stat().st_mode & 0o777 == 0o600


def test_a_corrupt_id_file_gets_a_new_id(tmp_path: Path) -> None:
    (tmp_path / "agents").mkdir()
    (tmp_path / "agents" / "x.id").write_text("not-an-id")
    assert len(claim_instance_id(tmp_path, "x")) == 32


def test_a_second_process_cannot_take_a_held_name(tmp_path: Path) -> None:
    claim_instance_id(tmp_path, "held")
    claim = (
        "import sys; from worker.agent.identity import claim_instance_id; "
        "print(claim_instance_id(sys.argv[1], sys.argv[2]))"
    )
    other = subprocess.run(
        [sys.executable, "-c", claim, str(tmp_path), "held"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert other.returncode != 0
    assert "NameClash" in other.stderr and "another --name" in other.stderr
    free = subprocess.run(
        [sys.executable, "-c", claim, str(tmp_path), "free"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert free.returncode == 0 and len(free.stdout.strip()) == 32
