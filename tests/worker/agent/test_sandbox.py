"""The rank sandbox on this host: real bubblewrap, the real unprivileged user, real files."""

import json
import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from worker.agent import netpolicy
from worker.agent.sandbox import (
    Sandbox,
    check_datasets_dir,
    rank_environment,
    read_rank_file,
    write_rank_file,
)
from worker.agent.uids import Lease, SandboxUnavailable, UidPool

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
    "checkout": sorted(n for n in ("backend", "contracts", "polytrain", "worker")
                       if os.path.isdir(os.path.join(CHECKOUT, n))),
}))
"""


@pytest.fixture
def sandbox(tmp_path: Path) -> Sandbox:
    return Sandbox.detect(user="polytrain-run", data_dir=tmp_path)


@pytest.fixture
def leases(sandbox: Sandbox) -> Iterator[Callable[[], Lease]]:
    """Lease sandbox uids for the test; all are released at its end."""
    held: list[Lease] = []

    def lease() -> Lease:
        held.append(sandbox.pool.lease())
        return held[-1]

    yield lease
    for one in held:
        one.release()


def test_rank_environment_is_allow_listed(tmp_path: Path) -> None:
    host = {
        "POLYTRAIN_AGENT_TOKEN": "t0ken",
        "POLYTRAIN_ADMIN_PASSWORD": "pw",
        "DATABASE_URL": "postgresql://u:p@db/x",
        "BROKER_URL": "redis://:p@r",
        "AWS_SECRET_ACCESS_KEY": "k",
        "PATH": "/usr/bin",
        "GLOO_SOCKET_IFNAME": "lo",
    }
    env = rank_environment({"RANK": "1", "WORLD_SIZE": "2"}, tmp_path, host)
    assert not {"t0ken", "pw", "postgresql://u:p@db/x", "redis://:p@r", "k"} & set(env.values())
    assert env["RANK"] == "1" and env["GLOO_SOCKET_IFNAME"] == "lo" and env["PATH"] == "/usr/bin"
    assert env["HOME"] == str(tmp_path)
    with pytest.raises(KeyError, match="POLYTRAIN_AGENT_TOKEN"):
        rank_environment({"POLYTRAIN_AGENT_TOKEN": "t0ken"}, tmp_path, host)


def test_rank_runs_unprivileged_and_sees_only_its_own_folder(
    sandbox: Sandbox, leases: Callable[[], Lease], tmp_path: Path
) -> None:
    secret = tmp_path / "polytrain.db"
    secret.write_text("agent secrets")
    secret.chmod(0o644)  # world-readable on purpose: the mount namespace alone must hide it
    theirs, ours = leases(), leases()
    other = sandbox.new_rank_dir(theirs.uid)
    write_rank_file(other, "final.pt", b"another task's checkpoint")
    mine = sandbox.new_rank_dir(ours.uid)
    code = (
        PROBE.replace("SECRET", repr(str(secret)))
        .replace("OTHER", repr(str(other / "final.pt")))
        .replace("AGENT_PID", str(os.getpid()))
        .replace("CHECKOUT", repr(str(Path(__file__).resolve().parents[3])))
    )
    env = rank_environment({}, mine, {**os.environ, "POLYTRAIN_AGENT_TOKEN": "t0ken"})
    done = subprocess.run(
        sandbox.command(mine, ["-c", code], ours.uid),
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    seen = json.loads(done.stdout)
    assert seen["uid"] == ours.uid != theirs.uid
    assert seen["cwd"] == str(mine)
    assert seen["secret"].startswith("refused") and seen["other"].startswith("refused")
    assert seen["agent_proc"].startswith("refused")
    assert int(seen["caps"], 16) == 0
    # Of the checkout, the engine and the contracts only: not the API or the deployment tools.
    assert seen["checkout"] == ["contracts", "worker"]
    assert "t0ken" not in json.dumps(seen["env"])
    assert (mine / "own.txt").read_text() == "mine"
    assert (mine / "own.txt").stat().st_uid == ours.uid
    # Even where a mount would show it, another rank's folder belongs to another uid.
    assert other.stat().st_uid == theirs.uid and other.stat().st_mode & 0o077 == 0


def test_agent_reads_user_files_without_following_links(sandbox: Sandbox, tmp_path: Path) -> None:
    secret = tmp_path / "polytrain.db"
    secret.write_text("agent secrets")
    rank = sandbox.new_rank_dir(sandbox.pool.first)
    (rank / "checkpoints").mkdir()
    (rank / "checkpoints" / "step-1.pt").write_bytes(b"weights")
    (rank / "checkpoints" / "linked.pt").symlink_to(secret)
    os.mkfifo(rank / "checkpoints" / "fifo.pt")
    (rank / "elsewhere").symlink_to(tmp_path)
    assert read_rank_file(rank, "checkpoints", "step-1.pt") == b"weights"
    for folder, name in (
        ("checkpoints", "linked.pt"),
        ("checkpoints", "fifo.pt"),
        ("elsewhere", "polytrain.db"),
        ("checkpoints", "../../polytrain.db"),
        ("checkpoints", ".."),
    ):
        with pytest.raises(PermissionError):
            read_rank_file(rank, folder, name)


def test_missing_bubblewrap_or_user_fails_fast_naming_the_fix(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with pytest.raises(SandboxUnavailable, match="useradd"):
        Sandbox.detect(user="no-such-polytrain-user", data_dir=tmp_path)
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(SandboxUnavailable, match="apt-get install -y bubblewrap"):
        Sandbox.detect(user="polytrain-run", data_dir=tmp_path)


def test_a_pool_overlapping_an_account_is_refused_naming_the_setting(tmp_path: Path) -> None:
    with pytest.raises(SandboxUnavailable, match="'root'.*POLYTRAIN_SANDBOX_UID_FIRST"):
        Sandbox.detect(user="polytrain-run", data_dir=tmp_path, uids=UidPool(0, 2))


def test_agent_without_bubblewrap_stops_at_once_naming_the_install(tmp_path: Path) -> None:
    env = {
        "PATH": str(tmp_path),
        "POLYTRAIN_AGENT_TOKEN": "t0ken",
        "POLYTRAIN_DATA_DIR": str(tmp_path),
        "POLYTRAIN_API_URL": "http://127.0.0.1:9",
    }
    done = subprocess.run(
        [sys.executable, "-m", "polytrain.cli", "agent", "--resource-group", "cpu-a"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
    )
    assert done.returncode == 2, done.stderr
    assert "apt-get install -y bubblewrap" in done.stderr


def test_network_filter_is_installed_once_and_kept(sandbox: Sandbox) -> None:
    """Every agent start applies the same chains; a second start changes nothing (no gap
    opened for running ranks), and the pool's packets jump to them exactly once."""
    uids = sandbox.pool.uids
    netpolicy.install(uids)
    for tool, ipv6 in (("iptables", False), ("ip6tables", True)):

        def listed(chain: str, tool: str = tool) -> list[str]:
            return subprocess.run(
                [tool, "-S", chain], capture_output=True, text=True, check=True
            ).stdout.splitlines()

        main = netpolicy.main_rules(uids, ipv6=ipv6)
        assert listed(netpolicy.CHAIN) == [
            f"-N {netpolicy.CHAIN}",
            *(f"-A {netpolicy.CHAIN} " + " ".join(r) for r in main),
        ]
        jump = f"-A OUTPUT -m owner --uid-owner {uids[0]}-{uids[-1]} -j {netpolicy.CHAIN}"
        assert listed("OUTPUT").count(jump) == 1
        chain = netpolicy.uid_chain(uids[-1])  # not leased here: closed
        assert listed(chain)[1:] == [
            f"-A {chain} " + " ".join(r) for r in netpolicy.closed_rules(ipv6=ipv6)
        ]


CONNECT = """
import socket, sys
try:
    with socket.create_connection(("127.0.0.1", int(sys.argv[1])), timeout=3) as conn:
        print(conn.recv(5).decode() or "closed")
except OSError as exc:
    print("refused:", type(exc).__name__)
"""
LISTEN = """
import socket
with socket.socket() as server:
    server.bind(("127.0.0.1", 0))
    server.listen()
    print(server.getsockname()[1], flush=True)
    while True:
        conn, _ = server.accept()
        conn.sendall(b"hello")
        conn.close()
"""


def test_admitting_a_slot_puts_back_a_filter_someone_removed(
    sandbox: Sandbox, leases: Callable[[], Lease]
) -> None:
    """A firewall reload that drops the OUTPUT jump must not let the next rank run unfiltered."""
    uids = sandbox.pool.uids
    jump = ["OUTPUT", "-m", "owner", "--uid-owner", f"{uids[0]}-{uids[-1]}", "-j", netpolicy.CHAIN]
    subprocess.run(["iptables", "-D", *jump], check=True)
    leases().admit(3)
    assert subprocess.run(["iptables", "-C", *jump]).returncode == 0


def test_a_rank_reaches_only_ranks_of_its_own_task(
    sandbox: Sandbox, leases: Callable[[], Lease]
) -> None:
    """Two tasks on one host: a rank of task 1 connects to task 1's listening rank; a rank of
    task 2 is refused, as is a slot not yet given a task, and one whose task has ended."""
    listener, peer, stranger, idle = leases(), leases(), leases(), leases()
    for lease, task_id in ((listener, 1), (peer, 1), (stranger, 2)):
        lease.admit(task_id)

    def python(lease: Lease, code: str, *args: str) -> list[str]:
        rank_dir = sandbox.new_rank_dir(lease.uid)
        return sandbox.command(rank_dir, ["-c", code, *args], lease.uid)

    def connect(lease: Lease, port: str) -> str:
        return subprocess.run(
            python(lease, CONNECT, port),
            capture_output=True,
            text=True,
            timeout=60,
            env=rank_environment({}, Path("/tmp")),
        ).stdout.strip()

    server = subprocess.Popen(
        python(listener, LISTEN),
        stdout=subprocess.PIPE,
        text=True,
        env=rank_environment({}, Path("/tmp")),
    )
    try:
        assert server.stdout is not None
        port = server.stdout.readline().strip()
        assert connect(peer, port) == "hello"
        # Its handshake's reply is dropped on the way back: the connection attempt times out.
        assert connect(stranger, port).startswith("refused")
        assert connect(idle, port).startswith("refused")
        peer.release()  # its task ended: the uid is closed again
        peer = leases()
        assert connect(peer, port).startswith("refused")
        assert connect(listener, "22").startswith("refused")  # a service on a fixed port
    finally:
        server.kill()
        server.wait()


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


def test_uid_pool_hands_each_uid_to_one_slot_at_a_time(sandbox: Sandbox, tmp_path: Path) -> None:
    """Leases are host-wide locks: a held uid is not handed out again until released, and an
    exhausted pool says which setting to raise."""
    uid = sandbox.pool.uids[-1] + 1  # outside the host's pool: no running agent holds it
    pool = UidPool(uid, 1, lease_dir=tmp_path / "leases")
    try:
        held = pool.lease()
        with pytest.raises(SandboxUnavailable, match="POLYTRAIN_SANDBOX_UID_COUNT"):
            pool.lease()
        held.release()
        again = pool.lease()
        assert again.uid == held.uid == uid
        again.release()
    finally:
        for tool in ("iptables", "ip6tables"):
            for action in ("-F", "-X"):
                subprocess.run([tool, action, netpolicy.uid_chain(uid)], capture_output=True)


def test_ranks_gloo_traffic_leaves_from_the_advertised_address(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Peers let a host's ranks in by its advertised address, so gloo must use that one."""
    from worker.agent.main import choose_gloo_interface

    monkeypatch.delenv("GLOO_SOCKET_IFNAME", raising=False)
    choose_gloo_interface("127.0.0.1")
    assert os.environ["GLOO_SOCKET_IFNAME"] == "lo"
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "eth9")  # the operator's choice stands
    choose_gloo_interface("127.0.0.1")
    assert os.environ["GLOO_SOCKET_IFNAME"] == "eth9"
    monkeypatch.delenv("GLOO_SOCKET_IFNAME")
    choose_gloo_interface("192.0.2.1")  # TEST-NET-1: on no interface here
    assert "GLOO_SOCKET_IFNAME" not in os.environ
    assert "set GLOO_SOCKET_IFNAME" in caplog.text


class _Api:
    def __init__(self, *answers: dict) -> None:
        self.answers = list(answers)

    def rendezvous(self, task_id: int) -> dict:
        return self.answers.pop(0)


class _Lease:
    def __init__(self) -> None:
        self.admitted: list[list[str]] = []

    def admit(self, task_id: int, peers: list[str]) -> None:
        self.admitted.append(list(peers))


def test_peers_are_admitted_as_agents_claim_until_complete() -> None:
    from worker.agent.runner import Peers

    api = _Api(
        {"attempt": 1, "peer_hosts": ["10.0.0.1"], "peers_complete": False},
        {"attempt": 1, "peer_hosts": ["10.0.0.1", "10.0.0.2"], "peers_complete": True},
    )
    peers = Peers(api, 7, 1, ["10.0.0.1"])  # type: ignore[arg-type]
    lease = _Lease()
    peers.leases.append(lease)  # type: ignore[arg-type]
    peers.refresh()
    assert lease.admitted == [] and not peers.complete  # nothing new yet
    peers._checked = 0.0
    peers.refresh()
    assert lease.admitted == [["10.0.0.1", "10.0.0.2"]] and peers.complete
    peers._checked = 0.0
    peers.refresh()  # complete: the backend is not asked again (no answer left)


def test_peers_of_another_attempt_are_not_admitted() -> None:
    from worker.agent.runner import Peers

    api = _Api({"attempt": 2, "peer_hosts": ["10.0.0.9"], "peers_complete": True})
    peers = Peers(api, 7, 1, ["10.0.0.1"])  # type: ignore[arg-type]
    lease = _Lease()
    peers.leases.append(lease)  # type: ignore[arg-type]
    peers.refresh()
    assert lease.admitted == [] and peers.hosts == ["10.0.0.1"] and peers.complete


DATASET_PROBE = """
import json, os
import torch
from torch.utils.data import DataLoader, TensorDataset

root = os.environ["POLYTRAIN_DATASETS"]
try:
    open(os.path.join(root, "mine.txt"), "w")
    wrote = "ok"
except OSError as exc:
    wrote = "refused: " + type(exc).__name__
loader = DataLoader(TensorDataset(torch.arange(8.0)), batch_size=4, num_workers=2)
print(json.dumps({
    "read": open(os.path.join(root, "digits", "0.txt")).read(),
    "wrote": wrote,
    "batches": [float(batch[0].sum()) for batch in loader],
}))
"""


def test_ranks_read_the_hosts_datasets_folder_and_run_dataloader_processes(
    tmp_path: Path,
) -> None:
    datasets = tmp_path / "datasets"
    (datasets / "digits").mkdir(parents=True)
    (datasets / "digits" / "0.txt").write_text("zero")
    for path in (datasets, datasets / "digits", datasets / "digits" / "0.txt"):
        path.chmod(0o755 if path.is_dir() else 0o644)
    sandbox = Sandbox.detect(user="polytrain-run", data_dir=tmp_path, datasets_dir=datasets)
    lease = sandbox.pool.lease()
    try:
        mine = sandbox.new_rank_dir(lease.uid)
        env = rank_environment({"POLYTRAIN_DATASETS": str(datasets)}, mine, dict(os.environ))
        done = subprocess.run(
            sandbox.command(mine, ["-c", DATASET_PROBE], lease.uid),
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
    finally:
        lease.release()
    assert done.returncode == 0, done.stderr
    seen = json.loads(done.stdout)
    assert seen["read"] == "zero" and seen["wrote"].startswith("refused")
    # Loader processes pass batches through shared memory inside the sandbox.
    assert seen["batches"] == [6.0, 22.0]
    with pytest.raises(SandboxUnavailable, match="POLYTRAIN_DATASETS_DIR: the datasets folder"):
        Sandbox.detect(user="polytrain-run", data_dir=tmp_path, datasets_dir=tmp_path / "none")
    for too_wide in ("/", tmp_path):  # the root; a folder holding the agent's data directory
        with pytest.raises(SandboxUnavailable, match="holds .* ranks would read it"):
            check_datasets_dir(Path(too_wide), tmp_path / "agent-data")
