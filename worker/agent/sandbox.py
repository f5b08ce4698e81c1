"""The sandbox every rank runs in: bubblewrap, an unprivileged user, an allow-listed environment.

Uploaded training code is untrusted (docs/security.md). Each rank process is
started as

    bwrap <read-only system, Python and engine code; its own rank directory> \
        -- setpriv --reuid <its own sandbox uid> ... -- python -m worker.agent.warm

so it sees only the files it needs (no data directory, database, agent token
file or other task's folders; when the agent names one, the host's datasets
folder, read-only: `AgentSettings.datasets_dir`), runs with no capabilities as a user of its
own, leased from a pool of sandbox uids (:class:`worker.agent.uids.UidPool`) shared by the
agents of the host, in its own PID, IPC and UTS namespaces, and gets only the
environment variables in :data:`ALLOWED_ENV`. Its directory belongs to that
uid alone (mode 0700), so another rank could not read it even if it saw it.
The network namespace is the host's (ranks must reach their rendezvous peers
on other hosts); what each uid may connect to is filtered by
`worker.agent.netpolicy`: nothing until the agent admits the slot to a task,
then only that task's ranks.
"""

from __future__ import annotations

import glob
import os
import pwd
import shutil
import stat
import sys
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from worker.agent import netpolicy
from worker.agent.netpolicy import NetworkPolicyUnavailable
from worker.agent.uids import DEFAULT_UID_COUNT, DEFAULT_UID_FIRST, SandboxUnavailable, UidPool
from worker.agent.warm import ENV_MOUNT
from worker.engine.ranks import REPO_ROOT

INSTALL_HINT = "install bubblewrap: `apt-get install -y bubblewrap` (make install does it)"
USER_HINT = (
    "create the sandbox user: `useradd --system --user-group --no-create-home "
    "--shell /usr/sbin/nologin {user}` (make install does it as root)"
)

# Passed through from the agent's environment when set: locale, thread counts, devices and
# network interfaces. Anything else (POLYTRAIN_* settings, DATABASE_URL, BROKER_URL, tokens,
# passwords) never reaches user code.
ALLOWED_ENV = (
    "PATH",
    "LANG",
    "LC_ALL",
    "TZ",
    "OMP_NUM_THREADS",
    "MKL_NUM_THREADS",
    "CUDA_VISIBLE_DEVICES",
    "GLOO_SOCKET_IFNAME",
    "TP_SOCKET_IFNAME",
    "NCCL_SOCKET_IFNAME",
    "LD_LIBRARY_PATH",
    "POLYTRAIN_NUM_THREADS",
)
# What the engine itself reads (worker.engine.launch), set by the agent per rank, and the
# datasets folder the agent mounts for training code (`AgentSettings.datasets_dir`).
RANK_ENV = (
    "RANK",
    "WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "LOCAL_RANK",
    "POLYTRAIN_DIST_TIMEOUT_S",
    "PYTHONUNBUFFERED",
    "POLYTRAIN_DATASETS",
    # set by the platform alone, at the interpreter's start, for a sharded group's workers
    # (worker.engine.ranks.allocator_env): jemalloc and its settings
    "LD_PRELOAD",
    "MALLOC_CONF",
)
ETC_FILES = (
    "group",
    "hosts",
    "resolv.conf",
    "nsswitch.conf",
    "host.conf",
    "gai.conf",
    "protocols",
    "services",
    "ld.so.cache",
    "ld.so.conf",
    "ld.so.conf.d",
    "localtime",
    "ssl",
    "ca-certificates",
    "alternatives",
)
# The top-level packages of this checkout a rank process imports (docs/architecture.md, Layout).
RANK_PACKAGES = ("worker", "contracts")
TMP_SIZE_BYTES = 512 * 1024 * 1024
# The rank's own /dev/shm: DataLoader processes hand batches and semaphores to the rank there
# (bwrap's minimal /dev has no writable one). Pages count only once written.
SHM_SIZE_BYTES = 1024 * 1024 * 1024
# The API's default `max_internal_body_bytes`: a larger checkpoint would be refused anyway.
MAX_CHECKPOINT_BYTES = 512 * 1024 * 1024


def rank_environment(
    rank_env: Mapping[str, str], rank_dir: Path, environ: Mapping[str, str] | None = None
) -> dict[str, str]:
    """The whole environment of a rank: allow-listed host variables plus its place in the task.

    Raises KeyError for a variable in `rank_env` outside :data:`RANK_ENV` (so a
    new secret cannot be added by accident).
    """
    source = os.environ if environ is None else environ
    check_rank_env(rank_env)
    env = {k: source[k] for k in ALLOWED_ENV if k in source}
    env.setdefault("PATH", "/usr/local/bin:/usr/bin:/bin")
    env.update(rank_env)
    env.update(
        {
            "HOME": str(rank_dir),
            "TMPDIR": "/tmp",
            "PYTHONPATH": str(REPO_ROOT),
            "PYTHONNOUSERSITE": "1",
            "PYTHONUNBUFFERED": "1",
        }
    )
    return env


def check_rank_env(rank_env: Mapping[str, str]) -> None:
    """Raise KeyError if `rank_env` sets anything outside :data:`RANK_ENV`."""
    unknown = set(rank_env) - set(RANK_ENV)
    if unknown:
        raise KeyError(f"not allowed in a rank's environment: {sorted(unknown)}")


@dataclass(frozen=True)
class Sandbox:
    """How this agent starts rank processes: bwrap binary, sandbox uids and where ranks live.

    `ranks_dir` (mode 0700, the agent's) holds one fresh directory per rank,
    owned by the rank's own uid (group `gid`, the sandbox user's); only that
    directory is writable (and visible) inside the rank's sandbox.
    """

    bwrap: str
    setpriv: str
    pool: UidPool
    gid: int
    ranks_dir: Path
    datasets_dir: Path | None = None

    @classmethod
    def detect(
        cls,
        *,
        user: str,
        data_dir: str | os.PathLike[str],
        uids: UidPool | None = None,
        datasets_dir: str | os.PathLike[str] | None = None,
    ) -> Sandbox:
        """Check this host can sandbox ranks and prepare `data_dir/agent/ranks`.

        `user` (an unprivileged account) gives the ranks' group; `uids` the
        pool of rank uids (default: 64 from 2100000000); `datasets_dir` a folder
        of datasets ranks may read (mounted read-only). Installs the ranks'
        network filter (`worker.agent.netpolicy`). Raises SandboxUnavailable
        naming the fix: bubblewrap or iptables missing, the sandbox user
        missing, the agent not running as root (only root can start
        processes as another user and filter their packets), or no folder
        `datasets_dir`.
        """
        pool = uids or UidPool(DEFAULT_UID_FIRST, DEFAULT_UID_COUNT)
        bwrap, setpriv = shutil.which("bwrap"), shutil.which("setpriv")
        if bwrap is None:
            raise SandboxUnavailable(f"bwrap not found: {INSTALL_HINT}")
        if setpriv is None:
            raise SandboxUnavailable("setpriv not found: `apt-get install -y util-linux`")
        try:
            entry = pwd.getpwnam(user)
        except KeyError:
            raise SandboxUnavailable(f"no user '{user}': {USER_HINT.format(user=user)}") from None
        if entry.pw_uid == 0:
            raise SandboxUnavailable(f"sandbox user '{user}' is root: choose an unprivileged one")
        if os.geteuid() != 0:
            raise SandboxUnavailable("the agent must run as root to start ranks as sandbox uids")
        pool.check_unowned()
        try:
            netpolicy.install(pool.uids)
        except NetworkPolicyUnavailable as exc:
            raise SandboxUnavailable(f"cannot filter the ranks' network: {exc}") from exc
        ranks_dir = Path(data_dir).resolve() / "agent" / "ranks"
        ranks_dir.mkdir(parents=True, exist_ok=True)
        for folder in (ranks_dir.parent, ranks_dir):
            folder.chmod(0o700)
        passwd = Path("/etc/passwd").read_text().rstrip("\n").splitlines()
        staged = ranks_dir.parent / f"passwd.{os.getpid()}"  # replaced whole: agents share it
        staged.write_text("\n".join([*passwd, *pool.passwd_lines(entry.pw_gid)]) + "\n")
        staged.replace(ranks_dir.parent / "passwd")
        datasets = Path(datasets_dir).resolve() if datasets_dir else None
        if datasets is not None:
            check_datasets_dir(datasets, Path(data_dir).resolve())
        return cls(bwrap, setpriv, pool, entry.pw_gid, ranks_dir, datasets)

    def new_rank_dir(self, uid: int) -> Path:
        """A fresh empty directory for one rank, owned by sandbox uid `uid` (mode 0700), and
        beside it the agent's empty folder for the rank's environment (:meth:`env_dir`)."""
        path = self.ranks_dir / uuid.uuid4().hex
        path.mkdir(mode=0o700)
        os.chown(path, uid, self.gid)
        env_dir(path).mkdir(mode=0o755)
        return path

    def command(self, rank_dir: Path, argv: list[str], uid: int) -> list[str]:
        """The command line running `python argv...` as `uid` in `rank_dir` inside the sandbox."""
        return [
            self.bwrap,
            *self._mounts(rank_dir),
            "--chdir",
            str(rank_dir),
            "--unshare-pid",
            "--unshare-ipc",
            "--unshare-uts",
            "--unshare-cgroup-try",
            "--die-with-parent",
            "--",
            self.setpriv,
            f"--reuid={uid}",
            f"--regid={self.gid}",
            "--clear-groups",
            "--inh-caps=-all",
            "--bounding-set=-all",
            "--no-new-privs",
            "--",
            sys.executable,
            *argv,
        ]

    def _mounts(self, rank_dir: Path) -> list[str]:
        args = [
            "--ro-bind",
            "/usr",
            "/usr",
            "--proc",
            "/proc",
            "--dev",
            "/dev",
            "--perms",
            "1777",
            "--size",
            str(SHM_SIZE_BYTES),
            "--tmpfs",
            "/dev/shm",
            "--perms",
            "1777",
            "--size",
            str(TMP_SIZE_BYTES),
            "--tmpfs",
            "/tmp",
            "--perms",
            "0755",
            "--dir",
            "/etc",
            "--ro-bind",
            str(self.ranks_dir.parent / "passwd"),
            "/etc/passwd",
        ]
        for top in ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32"):
            if os.path.islink(top):
                args += ["--symlink", os.readlink(top), top]
            elif os.path.isdir(top):
                args += ["--ro-bind", top, top]
        for name in ETC_FILES:
            args += ["--ro-bind-try", f"/etc/{name}", f"/etc/{name}"]
        # Read-only /sys: gloo maps network interfaces to devices there, torch counts CPUs.
        args += ["--ro-bind-try", "/sys", "/sys"]
        for device in sorted(glob.glob("/dev/nvidia*")):
            args += ["--dev-bind", device, device]
        # Of a checkout, only what a rank imports: the engine and the contracts (not the API's
        # `backend/` or the deployment tools' `polytrain/`).
        read_only = {
            Path(sys.base_prefix),
            Path(sys.prefix),
            Path(sys.exec_prefix),
            *(REPO_ROOT / package for package in RANK_PACKAGES),
        }
        for path in sorted(p.resolve() for p in read_only):
            if not str(path).startswith("/usr/"):
                args += [*_parents(path), "--ro-bind", str(path), str(path)]
        if self.datasets_dir is not None:  # the admin's shared datasets, read-only
            args += [*_parents(self.datasets_dir), "--ro-bind", *[str(self.datasets_dir)] * 2]
        args += [*_parents(Path(ENV_MOUNT)), "--ro-bind", str(env_dir(rank_dir)), ENV_MOUNT]
        return args + [*_parents(rank_dir), "--bind", str(rank_dir), str(rank_dir)]


def env_dir(rank_dir: Path) -> Path:
    """The agent's folder (root's, 0755) beside a rank's directory that the rank sees
    read-only at :data:`ENV_MOUNT`: empty, or its task's environment."""
    return rank_dir.with_name(rank_dir.name + ".env")


def link_environment(rank_dir: Path, site: Path) -> int:
    """Show a rank the environment `site` (a cached site-packages folder): hard-link its
    tree into the rank's environment folder (:func:`env_dir`), which its sandbox mounts
    read-only at :data:`ENV_MOUNT` from the start (a warm interpreter's mounts are fixed
    before its task is known). Links, not copies: no bytes move, and the files stay root's
    and read-only. The number of files linked."""
    target, count = env_dir(rank_dir), 0
    target.mkdir(mode=0o755, exist_ok=True)
    for folder, dirs, files in os.walk(site):
        relative = Path(folder).relative_to(site)
        for name in dirs:
            (target / relative / name).mkdir(mode=0o755)
        for name in files:
            os.link(Path(folder) / name, target / relative / name, follow_symlinks=False)
            count += 1
    return count


def check_datasets_dir(datasets: Path, data_dir: Path) -> None:
    """Refuse a datasets folder that is missing or would show ranks more than datasets: the
    root, or a folder holding the agent's data directory, this checkout or the agent's
    working directory (its `.env`). Raises SandboxUnavailable naming POLYTRAIN_DATASETS_DIR."""
    setting = "POLYTRAIN_DATASETS_DIR"
    if not datasets.is_dir():
        raise SandboxUnavailable(f"{setting}: the datasets folder {datasets} does not exist")
    for name, secret in (
        ("the agent's data directory", data_dir),
        ("this checkout", REPO_ROOT.resolve()),
        ("the agent's working directory", Path.cwd().resolve()),
    ):
        if secret == datasets or datasets in secret.parents:
            raise SandboxUnavailable(
                f"{setting}={datasets} holds {name} ({secret}): ranks would read it; name a "
                "folder of datasets only"
            )


def _parents(path: Path) -> list[str]:
    """Create `path`'s ancestors inside the sandbox world-traversable (bwrap makes them 0700)."""
    args: list[str] = []
    for parent in reversed(path.parents):
        if str(parent) not in ("/", "/usr", "/etc", "/tmp", "/proc", "/dev"):
            args += ["--perms", "0755", "--dir", str(parent)]
    return args


def read_rank_file(
    rank_dir: Path, folder: str, name: str, max_bytes: int = MAX_CHECKPOINT_BYTES
) -> bytes:
    """The bytes of regular file `rank_dir/folder/name`, written by user code, read safely.

    `folder` is one folder name or several joined by `/` (`checkpoints/step-8.pt.dcp`).
    Neither a folder nor `name` may be a symlink, and each must be a plain
    name: the agent (root) never follows a path that user code made point
    at the agent's own files, and reads at most `max_bytes`. Raises
    PermissionError for anything else, or a larger file.
    """
    folders = folder.split("/")
    if "/" in name or any(n in ("", ".", "..") for n in [name, *folders]):
        raise PermissionError(f"refusing checkpoint name {name!r}")
    flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC
    opened = [os.open(rank_dir, flags | os.O_DIRECTORY)]
    try:
        for step in folders:
            opened.append(os.open(step, flags | os.O_DIRECTORY, dir_fd=opened[-1]))
        fd = os.open(name, flags | os.O_NONBLOCK, dir_fd=opened[-1])
    except OSError as exc:
        raise PermissionError(f"refusing {folder}/{name} of {rank_dir}: {exc}") from exc
    finally:
        for each in opened:
            os.close(each)
    with os.fdopen(fd, "rb") as fh:
        info = os.fstat(fh.fileno())
        if not stat.S_ISREG(info.st_mode):
            raise PermissionError(f"{folder}/{name} is not a regular file")
        body = b""
        if info.st_size <= max_bytes:  # a sparse file costs the rank no disk, the agent memory
            body = fh.read(max_bytes + 1)
        if info.st_size > max_bytes or len(body) > max_bytes:
            raise PermissionError(
                f"{folder}/{name} holds more than the {max_bytes} bytes a checkpoint may"
            )
        return body


def write_rank_file(rank_dir: Path, name: str, body: bytes) -> Path:
    """Create `rank_dir/name` (readable by the sandbox user) with `body`; never overwrites."""
    path = rank_dir / name
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    with os.fdopen(fd, "wb") as fh:
        fh.write(body)
    return path
