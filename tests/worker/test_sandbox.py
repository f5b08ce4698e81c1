"""The rank sandbox on this host: real bubblewrap, the real unprivileged user, real files."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from worker.agent.sandbox import (
    Sandbox,
    SandboxUnavailable,
    rank_environment,
    read_rank_file,
    write_rank_file,
)

PROBE = """
import json, os
def attempt(fn):
    try:
        return "ok: " + str(fn())
    except OSError as exc:
        return "refused: " + type(exc).__name__
open("own.txt", "w").write("mine")
print(json.dumps({
    "uid": os.getuid(), "cwd": os.getcwd(), "env": dict(os.environ),
    "secret": attempt(lambda: open(SECRET).read()),
    "other": attempt(lambda: open(OTHER).read()),
    "agent_proc": attempt(lambda: open("/proc/%d/environ" % AGENT_PID).read()),
    "caps": [l for l in open("/proc/self/status") if l.startswith("CapEff")][0].split()[1],
}))
"""


@pytest.fixture
def sandbox(tmp_path: Path) -> Sandbox:
    return Sandbox.detect(user="polytrain-run", data_dir=tmp_path)


def test_rank_environment_is_allow_listed(tmp_path: Path) -> None:
    host = {"POLYTRAIN_AGENT_TOKEN": "t0ken", "POLYTRAIN_ADMIN_PASSWORD": "pw",
            "DATABASE_URL": "postgresql://u:p@db/x", "BROKER_URL": "redis://:p@r",
            "AWS_SECRET_ACCESS_KEY": "k", "PATH": "/usr/bin", "GLOO_SOCKET_IFNAME": "lo"}
    env = rank_environment({"RANK": "1", "WORLD_SIZE": "2"}, tmp_path, host)
    assert not {"t0ken", "pw", "postgresql://u:p@db/x", "redis://:p@r", "k"} & set(env.values())
    assert env["RANK"] == "1" and env["GLOO_SOCKET_IFNAME"] == "lo" and env["PATH"] == "/usr/bin"
    assert env["HOME"] == str(tmp_path)
    with pytest.raises(KeyError, match="POLYTRAIN_AGENT_TOKEN"):
        rank_environment({"POLYTRAIN_AGENT_TOKEN": "t0ken"}, tmp_path, host)


def test_rank_runs_unprivileged_and_sees_only_its_own_folder(
        sandbox: Sandbox, tmp_path: Path) -> None:
    secret = tmp_path / "polytrain.db"
    secret.write_text("agent secrets")
    secret.chmod(0o644)  # world-readable on purpose: the mount namespace alone must hide it
    other = sandbox.new_rank_dir()
    write_rank_file(other, "final.pt", b"another task's checkpoint")
    mine = sandbox.new_rank_dir()
    code = (PROBE.replace("SECRET", repr(str(secret)))
            .replace("OTHER", repr(str(other / "final.pt")))
            .replace("AGENT_PID", str(os.getpid())))
    env = rank_environment({}, mine, {**os.environ, "POLYTRAIN_AGENT_TOKEN": "t0ken"})
    done = subprocess.run(sandbox.command(mine, ["-c", code]), env=env, capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    seen = json.loads(done.stdout)
    assert seen["uid"] == sandbox.uid != 0
    assert seen["cwd"] == str(mine)
    assert seen["secret"].startswith("refused") and seen["other"].startswith("refused")
    assert seen["agent_proc"].startswith("refused")
    assert int(seen["caps"], 16) == 0
    assert "t0ken" not in json.dumps(seen["env"])
    assert (mine / "own.txt").read_text() == "mine"
    assert (mine / "own.txt").stat().st_uid == sandbox.uid


def test_agent_reads_user_files_without_following_links(sandbox: Sandbox, tmp_path: Path) -> None:
    secret = tmp_path / "polytrain.db"
    secret.write_text("agent secrets")
    rank = sandbox.new_rank_dir()
    (rank / "checkpoints").mkdir()
    (rank / "checkpoints" / "step-1.pt").write_bytes(b"weights")
    (rank / "checkpoints" / "linked.pt").symlink_to(secret)
    os.mkfifo(rank / "checkpoints" / "fifo.pt")
    (rank / "elsewhere").symlink_to(tmp_path)
    assert read_rank_file(rank, "checkpoints", "step-1.pt") == b"weights"
    for folder, name in (("checkpoints", "linked.pt"), ("checkpoints", "fifo.pt"),
                         ("elsewhere", "polytrain.db"), ("checkpoints", "../../polytrain.db"),
                         ("checkpoints", "..")):
        with pytest.raises(PermissionError):
            read_rank_file(rank, folder, name)


def test_missing_bubblewrap_or_user_fails_fast_naming_the_fix(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(SandboxUnavailable, match="useradd"):
        Sandbox.detect(user="no-such-polytrain-user", data_dir=tmp_path)
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(SandboxUnavailable, match="apt-get install -y bubblewrap"):
        Sandbox.detect(user="polytrain-run", data_dir=tmp_path)


def test_agent_without_bubblewrap_stops_at_once_naming_the_install(tmp_path: Path) -> None:
    env = {"PATH": str(tmp_path), "POLYTRAIN_AGENT_TOKEN": "t0ken",
           "POLYTRAIN_DATA_DIR": str(tmp_path), "POLYTRAIN_API_URL": "http://127.0.0.1:9"}
    done = subprocess.run([sys.executable, "-m", "backend.cli", "agent", "--resource-group",
                           "cpu-a"], env=env, capture_output=True, text=True, timeout=120,
                          cwd=tmp_path)
    assert done.returncode == 2, done.stderr
    assert "apt-get install -y bubblewrap" in done.stderr


def test_network_filter_is_installed_once_and_kept() -> None:
    """Every agent start applies the same chain; a second start changes nothing (no gap
    opened for running ranks), and the sandbox user's packets jump to it exactly once."""
    import pwd

    from worker.agent import netpolicy

    uid = pwd.getpwnam("polytrain-run").pw_uid
    netpolicy.apply(uid)
    netpolicy.apply(uid)
    for tool, ipv6 in (("iptables", False), ("ip6tables", True)):
        listed = subprocess.run([tool, "-S", netpolicy.CHAIN], capture_output=True, text=True,
                                check=True).stdout.splitlines()
        rules = netpolicy.chain_rules(netpolicy.ephemeral_ports(), ipv6=ipv6)
        assert listed == [f"-N {netpolicy.CHAIN}",
                          *(f"-A {netpolicy.CHAIN} " + " ".join(r) for r in rules)]
        output = subprocess.run([tool, "-S", "OUTPUT"], capture_output=True, text=True,
                                check=True).stdout
        jump = f"-A OUTPUT -m owner --uid-owner {uid} -j {netpolicy.CHAIN}"
        assert output.splitlines().count(jump) == 1


def test_a_sparse_checkpoint_is_refused_without_reading_it(tmp_path: Path) -> None:
    """User code can make a huge file that costs no disk; the agent (root) must not read it
    into memory."""
    (tmp_path / "checkpoints").mkdir()
    with open(tmp_path / "checkpoints" / "huge.pt", "wb") as fh:
        fh.truncate(200 * 2**30)  # 200 GiB, sparse
    with pytest.raises(PermissionError, match="more than the 1024 bytes"):
        read_rank_file(tmp_path, "checkpoints", "huge.pt", max_bytes=1024)
    (tmp_path / "checkpoints" / "small.pt").write_bytes(b"w" * 1024)
    assert read_rank_file(tmp_path, "checkpoints", "small.pt", max_bytes=1024) == b"w" * 1024
