"""A code version's own packages on an agent: one environment per lock, built once, cached.

A code version that declares requirements carries a *lock* (:mod:`contracts.packages`): exact
pins with hashes of the packages the platform lacks. The first task that needs a lock on this
host builds its environment with uv (`uv pip install --target`, `--no-deps`,
`--require-hashes`, wheels only by default, so no package code runs at install time) into
`<data_dir>/agent/envs/<lock hash>/`; every later task with the same lock uses it as it is.

* **Once.** Builds hold an exclusive `flock` on `<hash>.build`: two tasks (or two agents of
  the host) that need the same environment at once build it once; the second waits and
  finds it ready.
* **In use.** A task holds a shared `flock` on `<hash>.use` while its ranks run
  (:meth:`EnvironmentCache.prepare` returns a lease); eviction takes it exclusively without
  waiting, so it never removes an environment a task uses or builds.
* **Evicted least recently used** beyond `max_bytes` (`AgentSettings.env_cache_max_mb`):
  after each build the environments in no task's use are removed, oldest use first, until
  the cache fits.
* **Read-only for the ranks.** The environment's files belong to root, mode 0644/0755; each
  rank's sandbox sees its own hard-linked copy of the tree read-only
  (:func:`worker.agent.sandbox.link_environment`), so a rank can neither change the
  cache nor see another lock's environment.

Where this sits in the data flow: docs/architecture.md, "Training code's own packages".
"""

from __future__ import annotations

import fcntl
import functools
import logging
import os
import queue
import re
import shutil
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from contracts.packages import Environment, PackageIndex, lock_hash, pins, platform_packages, uv_bin

log = logging.getLogger(__name__)
READY = ".ready"
LAST_USED = ".last-used"
BUILD_TIMEOUT_S = 1800.0


class EnvironmentBuildFailed(RuntimeError):
    """An environment could not be built; the message names the package and the indexes
    tried, and ends with the installer's own output."""


class BuildStopped(RuntimeError):
    """The task that waited for a build no longer wants it (cancelled, restarted): the
    installer was stopped; the message says why."""


NAME = re.compile(r"^[0-9a-f]{64}$")  # an environment's folder: its lock hash
# What the installer may see of the agent's environment: not its secrets (POLYTRAIN_*,
# DATABASE_URL, BROKER_URL), which a source build (wheels_only off) would otherwise reach.
SECRET_ENV = ("POLYTRAIN_", "DATABASE_URL", "BROKER_URL")


@dataclass
class Lease:
    """A task's use of one environment: `site` is its folder (a site-packages directory);
    the environment stays on disk until :meth:`release`."""

    site: Path
    built: bool
    seconds: float
    _fd: int

    def release(self) -> None:
        """End the use (idempotent)."""
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


class EnvironmentCache:
    """The environments of one host, under `root` (`<data_dir>/agent/envs`).

    `index` says where uv finds packages (agent settings: `POLYTRAIN_INDEX_URL`, ...);
    `max_bytes` bounds the cache (least recently used environments in no use go first).
    """

    def __init__(self, root: Path, index: PackageIndex, *, max_bytes: int) -> None:
        self.root, self.index, self.max_bytes = root, index, max_bytes
        self.root.mkdir(parents=True, exist_ok=True, mode=0o755)
        self.uv_cache = self.root.parent / "uv-cache"
        self.sweep()

    def sweep(self, older_than_s: float = BUILD_TIMEOUT_S + 60) -> list[str]:
        """Remove what a killed agent left: staging folders of builds that cannot still be
        running (older than `older_than_s`) and folders evicted but not yet deleted."""
        removed = []
        now = time.time()
        for path in self.root.iterdir():
            stale = now - path.lstat().st_mtime > older_than_s
            if path.name.startswith(".evicted-") or (path.name.startswith(".staging-") and stale):
                if path.is_dir():
                    shutil.rmtree(path, ignore_errors=True)
                else:
                    path.unlink(missing_ok=True)
                removed.append(path.name)
        return removed

    def path(self, lock_hash_hex: str) -> Path:
        """The folder of a lock's environment (its site-packages)."""
        return self.root / lock_hash_hex

    def prepare(
        self,
        env: Environment,
        say: Callable[[str], None],
        stop: Callable[[], str | None] = lambda: None,
    ) -> Lease:
        """The environment of `env`'s lock, built first if this host has none; `say` gets the
        build's progress, line by line (the task's log); `stop`, asked about once a second
        during a build, says why the task no longer wants it (None: go on).

        Raises:
            ValueError: the lock does not hash to `env.lock_hash`.
            BuildStopped: `stop` answered; the installer was killed.
            EnvironmentBuildFailed: the installer failed (names the package and the indexes),
                or the lock names a package this agent's platform ships (torch, ...: the
                API's install differs from the agent's).
        """
        if lock_hash(env.lock) != env.lock_hash:
            raise ValueError(f"the lock does not hash to {env.lock_hash}")
        shipped = sorted(set(pins(env.lock)) & _platform())
        if shipped:  # the API's environment differs from this agent's: say so, don't retry
            raise EnvironmentBuildFailed(
                f"the lock names packages the platform ships on this agent: "
                f"{', '.join(shipped)}; give the API and the agents the same polytrain install"
            )
        site = self.path(env.lock_hash)
        # Two locks per environment: `.use`, held shared by every task using it (eviction
        # takes it exclusively or skips), and `.build`, exclusive while one checks or builds.
        use = os.open(self.root / f"{env.lock_hash}.use", os.O_RDWR | os.O_CREAT, 0o600)
        started, built = time.monotonic(), False
        try:
            fcntl.flock(use, fcntl.LOCK_SH)
            build = os.open(self.root / f"{env.lock_hash}.build", os.O_RDWR | os.O_CREAT, 0o600)
            try:
                fcntl.flock(build, fcntl.LOCK_EX)  # one build per lock, across agents
                if not (site / READY).exists():
                    say(
                        f"environment {env.lock_hash[:12]}: building {len(pins(env.lock))} "
                        f"packages from {self.index.describe()}"
                    )
                    self._build(env, site, say, stop)
                    built = True
            finally:
                os.close(build)
            (site / LAST_USED).touch()
        except BaseException:
            os.close(use)
            raise
        lease = Lease(site, built, time.monotonic() - started, use)
        if built:
            self.evict(keep=env.lock_hash)
        return lease

    def _build(
        self,
        env: Environment,
        site: Path,
        say: Callable[[str], None],
        stop: Callable[[], str | None],
    ) -> None:
        """Install the lock into a staging folder, make it read-only, then move it in place.
        The installer is killed after BUILD_TIMEOUT_S or when `stop` answers."""
        shutil.rmtree(site, ignore_errors=True)  # a build that died halfway
        staging = self.root / f".staging-{uuid.uuid4().hex}"
        staging.mkdir(mode=0o755)
        lock_file = staging.parent / f"{staging.name}.txt"
        try:
            lock_file.write_text(env.lock)
            command = [
                uv_bin(),
                "pip",
                "install",
                "--python",
                sys.executable,
                "--target",
                str(staging),
                "--no-deps",
                "--require-hashes",
                "--no-progress",
                # Bytecode now: the ranks cannot write it to the read-only environment, and
                # would compile every module of it at each start.
                "--compile-bytecode",
                *self.index.uv_args(),
                "-r",
                str(lock_file),
            ]
            environ = {k: v for k, v in os.environ.items() if not k.startswith(SECRET_ENV)}
            environ.update({"UV_CACHE_DIR": str(self.uv_cache), "UV_NO_CONFIG": "1"})
            self._run(command, environ, say, stop)
            _read_only(staging)
            (staging / READY).touch()
            staging.rename(site)
        except EnvironmentBuildFailed as exc:
            raise EnvironmentBuildFailed(self._failure(env, str(exc).splitlines())) from None
        finally:
            lock_file.unlink(missing_ok=True)
            shutil.rmtree(staging, ignore_errors=True)

    @staticmethod
    def _run(
        command: list[str],
        environ: dict[str, str],
        say: Callable[[str], None],
        stop: Callable[[], str | None],
    ) -> None:
        """Run the installer, its output line by line to `say`.

        Raises:
            EnvironmentBuildFailed: it failed or ran past BUILD_TIMEOUT_S (the message is
                its output).
            BuildStopped: `stop` answered.
        """
        proc = subprocess.Popen(
            command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=environ
        )
        lines: queue.Queue[str | None] = queue.Queue()

        def read() -> None:
            assert proc.stdout is not None
            for line in proc.stdout:
                lines.put(line.rstrip())
            lines.put(None)

        threading.Thread(target=read, name="uv-output", daemon=True).start()
        output: list[str] = []
        deadline, asked = time.monotonic() + BUILD_TIMEOUT_S, time.monotonic()
        try:
            while True:
                try:
                    line = lines.get(timeout=0.5)
                except queue.Empty:
                    line = ""
                if line is None:
                    break
                if line:
                    output.append(line)
                    say(f"uv: {line}")
                if time.monotonic() > deadline:
                    output.append(f"the installer ran past {BUILD_TIMEOUT_S:.0f} s: stopped")
                    raise EnvironmentBuildFailed("\n".join(output))
                if time.monotonic() - asked >= 1.0:
                    asked = time.monotonic()
                    why = stop()
                    if why:
                        raise BuildStopped(why)
        finally:
            if proc.poll() is None:
                proc.kill()
            proc.wait()
        if proc.returncode != 0:
            raise EnvironmentBuildFailed("\n".join(output))

    def _failure(self, env: Environment, output: list[str]) -> str:
        """The build's error: the package (when uv names one) and the indexes it tried."""
        text = "\n".join(output[-30:])
        lowered = text.lower()
        named = sorted(
            (lowered.find(token), f"{name}=={version}")
            for name, version in pins(env.lock).items()
            for token in (f"{name}==", f"/{name}/")
            if token in lowered
        )
        package = f"package {named[0][1]}" if named else "the packages of the lock"
        return (
            f"could not install {package} into environment {env.lock_hash[:12]} from "
            f"{self.index.describe()}:\n{text}"
        )

    def evict(self, keep: str | None = None) -> list[str]:
        """Remove environments in no use, least recently used first, until the cache holds at
        most `max_bytes`; the lock hashes removed. `keep` is never removed."""
        sizes = {
            p.name: _size(p)
            for p in self.root.iterdir()
            if NAME.match(p.name) and (p / READY).exists()
        }
        total = sum(sizes.values())
        removed: list[str] = []
        by_use = sorted(sizes, key=lambda name: _last_used(self.root / name))
        for name in by_use:
            if total <= self.max_bytes:
                break
            if name == keep:
                continue
            fd = os.open(self.root / f"{name}.use", os.O_RDWR | os.O_CREAT, 0o600)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:  # a task uses it (or builds it)
                os.close(fd)
                continue
            try:
                doomed = self.root / f".evicted-{uuid.uuid4().hex}"
                (self.root / name).rename(doomed)
                shutil.rmtree(doomed, ignore_errors=True)
                total -= sizes[name]
                removed.append(name)
                log.info("environment %s evicted (least recently used)", name[:12])
            finally:
                os.close(fd)
        return removed

    @contextmanager
    def using(self, env: Environment, say: Callable[[str], None]) -> Iterator[Lease]:
        """:meth:`prepare` as a context: the lease ends with the block."""
        lease = self.prepare(env, say)
        try:
            yield lease
        finally:
            lease.release()


@functools.lru_cache(maxsize=1)
def _platform() -> frozenset[str]:
    """The platform's distributions, read once per agent (0.1 s of metadata each time)."""
    return frozenset(platform_packages())


def _read_only(root: Path) -> None:
    """Every file 0644 and folder 0755, owned by this process's user (root on an agent)."""
    for folder, _, files in os.walk(root):
        os.chmod(folder, 0o755)
        for name in files:
            path = os.path.join(folder, name)
            if not os.path.islink(path):
                os.chmod(path, 0o755 if os.access(path, os.X_OK) else 0o644)


def _size(path: Path) -> int:
    return sum(
        os.lstat(os.path.join(folder, name)).st_size
        for folder, _, files in os.walk(path)
        for name in files
    )


def _last_used(path: Path) -> float:
    try:
        return (path / LAST_USED).stat().st_mtime
    except FileNotFoundError:
        return 0.0
