"""Code versions' environments on an agent: built once per lock with real uv from the real
index, shared, evicted least recently used, and seen read-only by the ranks' sandbox."""

import fcntl
import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from contracts.packages import Environment, PackageIndex, lock_hash, uv_bin
from worker.agent.environments import (
    READY,
    BuildStopped,
    EnvironmentBuildFailed,
    EnvironmentCache,
)
from worker.agent.sandbox import Sandbox, env_dir, link_environment, rank_environment
from worker.agent.warm import ENV_MOUNT

GiB = 1024**3
# A lock as uv needs one (a hash per file) that no index is asked about before the fetch.
HASHED = "einops==0.8.2 \\\n    --hash=sha256:" + "0" * 64 + "\n"


def make_lock(requirements: str, cache: Path) -> str:
    """A lock as the portal makes one: exact pins with every hash, no dependencies added."""
    source = cache / "requirements.in"
    source.write_text(requirements)
    done = subprocess.run(
        [uv_bin(), "pip", "compile", "--no-deps", "--generate-hashes", "--no-header", "-q"]
        + [*PackageIndex().uv_args(), str(source)],
        capture_output=True,
        text=True,
        env={**os.environ, "UV_CACHE_DIR": str(cache / "uv"), "UV_NO_CONFIG": "1"},
        timeout=120,
        check=True,
    )
    return done.stdout


@pytest.fixture(scope="module")
def einops_lock(tmp_path_factory: pytest.TempPathFactory, registry_cache: Path) -> Environment:
    """einops's lock; the index must answer (`registry_cache` fails on CI when it does not)."""
    lock = make_lock("einops==0.8.2\n", tmp_path_factory.mktemp("lock"))
    return Environment(lock_hash=lock_hash(lock), lock=lock)


@pytest.mark.registry
def test_two_tasks_needing_one_environment_at_once_build_it_once(
    tmp_path: Path, einops_lock: Environment
) -> None:
    cache = EnvironmentCache(tmp_path / "envs", PackageIndex(), max_bytes=GiB)
    said: list[str] = []
    leases = []

    def take() -> None:
        leases.append(cache.prepare(einops_lock, said.append))

    threads = [threading.Thread(target=take) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert sorted(lease.built for lease in leases) == [False, True]
    assert sum("building 1 packages" in line for line in said) == 1
    assert any(line.startswith("uv: ") for line in said), said  # the installer's own lines
    site = cache.path(einops_lock.lock_hash)
    assert (site / "einops" / "__init__.py").is_file() and (site / READY).exists()
    # Read-only for anyone but its owner, files and folders alike.
    assert all(
        os.stat(os.path.join(folder, name)).st_mode & 0o022 == 0
        for folder, dirs, files in os.walk(site)
        for name in [*dirs, *files]
    )
    for lease in leases:
        lease.release()
    # A later task finds it: no build, nothing said about one.
    said.clear()
    with cache.using(einops_lock, said.append) as again:
        assert not again.built and not said


@pytest.mark.registry
def test_a_rank_imports_its_environment_read_only_after_the_platforms_packages(
    tmp_path: Path, einops_lock: Environment
) -> None:
    cache = EnvironmentCache(tmp_path / "envs", PackageIndex(), max_bytes=GiB)
    sandbox = Sandbox.detect(user="polytrain-run", data_dir=tmp_path)
    # Like a warm interpreter, the rank starts before its task (and environment) is known:
    # it waits for a line, and the environment is linked in meanwhile.
    probe = f"""
import json, os, sys
print(json.dumps(os.listdir("{ENV_MOUNT}")), flush=True)
sys.stdin.readline()
from worker.agent.warm import _add_environment
_add_environment()
import einops, torch
def write(path):
    try:
        open(path, "a").write("x")
        return "wrote"
    except OSError as exc:
        return "refused: " + type(exc).__name__
print(json.dumps({{
    "einops": einops.__file__, "torch": torch.__file__,
    "last": sys.path[-1],
    "write": write("{ENV_MOUNT}/einops/__init__.py"),
    "create": write("{ENV_MOUNT}/sitecustomize.py"),
}}))
"""
    with cache.using(einops_lock, lambda line: None) as lease:
        uid = sandbox.pool.lease()
        try:
            rank_dir = sandbox.new_rank_dir(uid.uid)
            rank = subprocess.Popen(
                sandbox.command(rank_dir, ["-c", probe], uid.uid),
                env=rank_environment({}, rank_dir, dict(os.environ)),
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
            assert rank.stdout is not None
            before = json.loads(rank.stdout.readline() or "null")
            assert link_environment(rank_dir, lease.site) > 5
            out, err = rank.communicate("go\n", timeout=120)
        finally:
            uid.release()
    assert rank.returncode == 0, err
    seen = json.loads(out)
    assert before == []  # nothing to see before its task's environment is linked
    assert seen["einops"] == f"{ENV_MOUNT}/einops/__init__.py"
    assert seen["torch"].startswith(sys.prefix)  # the platform's torch, not the environment's
    assert seen["last"] == ENV_MOUNT
    assert seen["write"].startswith("refused") and seen["create"].startswith("refused")
    # The cache itself is untouched, and the rank's links are the same files (no copy).
    cached = lease.site / "einops" / "__init__.py"
    assert not cached.read_text().endswith("x")
    assert os.stat(cached).st_ino == os.stat(env_dir(rank_dir) / "einops" / "__init__.py").st_ino


@pytest.mark.registry
def test_a_failed_build_names_the_package_and_keeps_the_installers_message(
    tmp_path: Path, einops_lock: Environment
) -> None:
    forged = einops_lock.lock.replace("sha256:", "sha256:0", 1).replace(
        einops_lock.lock.split("sha256:")[1][:64], einops_lock.lock.split("sha256:")[1][:63], 1
    )
    bad = Environment(lock_hash=lock_hash(forged), lock=forged)
    cache = EnvironmentCache(tmp_path / "envs", PackageIndex(), max_bytes=GiB)
    said: list[str] = []
    with pytest.raises(EnvironmentBuildFailed) as failed:
        cache.prepare(bad, said.append)
    message = str(failed.value)
    assert "package einops==0.8.2" in message and "https://pypi.org/simple" in message
    assert "Hash mismatch" in message  # uv's own words
    assert not cache.path(bad.lock_hash).exists()  # nothing half-built stays


def test_an_unreachable_index_fails_naming_the_package_and_the_index(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("UV_HTTP_RETRIES", "0")  # the agent's environment reaches uv
    lock = HASHED
    offline = PackageIndex(index_url="http://127.0.0.1:9/simple")
    cache = EnvironmentCache(tmp_path / "envs", offline, max_bytes=GiB)
    with pytest.raises(EnvironmentBuildFailed) as failed:
        cache.prepare(Environment(lock_hash=lock_hash(lock), lock=lock), lambda line: None)
    message = str(failed.value)
    assert "package einops==0.8.2" in message and "http://127.0.0.1:9/simple" in message
    assert "Connection refused" in message  # uv's own words: the index did not answer


def test_a_lock_naming_a_platform_package_or_the_wrong_hash_is_refused(tmp_path: Path) -> None:
    cache = EnvironmentCache(tmp_path / "envs", PackageIndex(), max_bytes=GiB)
    lock = "torch==2.12.0\n"
    with pytest.raises(EnvironmentBuildFailed, match="the platform ships on this agent: torch"):
        cache.prepare(Environment(lock_hash=lock_hash(lock), lock=lock), lambda line: None)
    with pytest.raises(ValueError, match="does not hash"):
        cache.prepare(Environment(lock_hash="0" * 64, lock=lock), lambda line: None)


def test_eviction_removes_the_least_recently_used_environments_in_no_use(tmp_path: Path) -> None:
    cache = EnvironmentCache(tmp_path / "envs", PackageIndex(), max_bytes=2500)
    for age, name in enumerate(("a" * 64, "b" * 64, "c" * 64, "d" * 64)):
        site = cache.path(name)
        site.mkdir()
        (site / "module.py").write_bytes(b"#" * 1000)
        (site / READY).touch()
        (site / ".last-used").touch()
        os.utime(site / ".last-used", (1000 + age, 1000 + age))
    # "a" (the oldest) is in a task's use: it stays; "b" and "c" go; then "d" fits.
    held = os.open(cache.root / f"{'a' * 64}.use", os.O_RDWR | os.O_CREAT)
    fcntl.flock(held, fcntl.LOCK_SH)
    try:
        assert cache.evict() == ["b" * 64, "c" * 64]
        assert cache.evict(keep="d" * 64) == []  # 2 × 1000 bytes fit in 2500
        cache.max_bytes = 1500
        assert cache.evict(keep="d" * 64) == []  # "a" in use, "d" kept: nothing may go
    finally:
        os.close(held)
    assert cache.evict() == ["a" * 64]  # no longer in use
    assert [p.name for p in cache.root.iterdir() if (p / READY).exists()] == ["d" * 64]


def test_a_build_in_progress_is_never_evicted_and_a_killed_agents_leftovers_are_swept(
    tmp_path: Path,
) -> None:
    root = tmp_path / "envs"
    root.mkdir()
    building = root / ".staging-0f"  # a build about to move in place: already marked ready
    building.mkdir()
    (building / "module.py").write_bytes(b"#" * 1000)
    (building / READY).touch()
    (root / ".evicted-1a").mkdir()  # renamed away, not yet deleted, when the agent died
    old = root / ".staging-2b"  # a build older than any build may run
    old.mkdir()
    os.utime(old, (1000, 1000))
    cache = EnvironmentCache(root, PackageIndex(), max_bytes=1)
    assert sorted(p.name for p in root.iterdir()) == [".staging-0f"]
    assert cache.evict() == [] and (building / "module.py").exists()


def test_a_build_the_task_no_longer_wants_is_stopped(tmp_path: Path) -> None:
    lock = HASHED
    offline = PackageIndex(index_url="http://127.0.0.1:9/simple")  # uv retries for seconds
    cache = EnvironmentCache(tmp_path / "envs", offline, max_bytes=GiB)
    with pytest.raises(BuildStopped, match="task is CANCELLED"):
        cache.prepare(
            Environment(lock_hash=lock_hash(lock), lock=lock),
            lambda line: None,
            stop=lambda: "task is CANCELLED in attempt 1",
        )
    assert [p.name for p in cache.root.iterdir() if p.is_dir()] == []  # nothing half-built
