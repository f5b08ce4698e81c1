"""A sub-task from claim to reported outcome, against a fake API with `sh` standing in for ranks."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest

from contracts.packages import lock_hash
from tests.worker.agent.conftest import HOST
from tests.worker.agent.fakes import FakeApi, FakePool, FakeSlot, event
from worker.agent import runner as runner_module
from worker.agent.environments import READY
from worker.agent.runner import Peers
from worker.agent.sandbox import env_dir
from worker.config import AgentSettings
from worker.engine.ranks import JEMALLOC_PATHS, SHARDED_MALLOC_CONF

Run = Callable[..., tuple[str, FakePool]]
RENDEZVOUS = event("rendezvous", port=4242)


def logged(api: FakeApi) -> list[str]:
    return [x["text"] for x in api.reported("lines")]


def test_a_refused_claim_starts_nothing(api: FakeApi, run_with: Run) -> None:
    api.claimed_by = "agent-9"
    outcome, pool = run_with({})
    assert outcome == "ignored"
    assert pool.slots == [] and api.calls("code") == [] and api.bodies("finished") == []


def test_a_message_of_an_earlier_attempt_is_refused(api: FakeApi, run_with: Run) -> None:
    api.attempt = 2
    outcome, pool = run_with({}, attempt=1)
    assert outcome == "ignored" and pool.slots == []
    (claim,) = api.bodies("claim")
    assert len(claim.pop("claim_id")) == 32  # a retry of this claim would carry it again
    assert claim == {"agent_id": 7, "host": HOST, "attempt": 1, "preparing": False}


def test_a_claim_the_api_could_not_answer_is_tried_again_with_its_claim_id(
    api: FakeApi, run_with: Run, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An outage longer than the client's retries (here: none) meets the claim: the runner
    tries it again with the same claim id until the API answers, then runs the part."""
    monkeypatch.setattr(runner_module, "OUTAGE_RETRY_S", 0.0)
    api.fail["claim"] = [503, 0, 503]  # the database away, then the API process
    tries: list[str] = []
    answer = api.handle

    def recording(request: httpx.Request) -> httpx.Response:
        if request.url.path.endswith("/claim"):
            tries.append(json.loads(request.content)["claim_id"])
        return answer(request)

    monkeypatch.setattr(api, "handle", recording)
    outcome, _pool = run_with({0: f"echo ps up; {RENDEZVOUS}", 1: "echo r1 done"})
    assert outcome == "succeeded"
    assert len(tries) == 4 and len(set(tries)) == 1  # 3 failed (2 calls), then answered


def test_the_parameter_server_host_publishes_the_rendezvous_and_succeeds(
    api: FakeApi, run_with: Run
) -> None:
    outcome, pool = run_with({0: f"echo ps up; {RENDEZVOUS}", 1: "echo r1 done"})
    assert outcome == "succeeded"
    assert api.bodies("rendezvous") == [{"master_addr": HOST, "master_port": 4242, "attempt": 1}]
    ranks = pool.by_rank()
    assert sorted(ranks) == [0, 1, 2]
    assert ranks[0].env["MASTER_PORT"] == "0"  # rank 0 picks its own port
    assert {(s.env["MASTER_ADDR"], s.env["MASTER_PORT"]) for r, s in ranks.items() if r} == {
        (HOST, "4242")
    }
    assert all(s.env["WORLD_SIZE"] == "4" for s in ranks.values())
    assert api.bodies("finished") == [
        {"succeeded": True, "detail": "all processes exited cleanly", "cause": "user"}
    ]
    assert {"ps up", "r1 done"} <= set(logged(api))


def test_a_later_attempt_resumes_from_the_named_checkpoint(api: FakeApi, run_with: Run) -> None:
    api.attempt, api.checkpoints[9] = 2, b"epoch-3 weights"
    outcome, pool = run_with({0: RENDEZVOUS}, attempt=2, resume_checkpoint_id=9)
    assert outcome == "succeeded"
    ranks = pool.by_rank()
    spec = json.loads((ranks[0].rank_dir / "spec.json").read_text())
    assert Path(spec["resume_from"]).read_bytes() == b"epoch-3 weights"
    assert Path(spec["resume_from"]).parent == ranks[0].rank_dir
    assert json.loads((ranks[1].rank_dir / "spec.json").read_text())["resume_from"] is None
    assert {x["attempt"] for x in api.reported("lines")} == {2}


def test_a_later_attempts_workers_fetch_the_sharded_state_of_its_checkpoint(
    api: FakeApi, run_with: Run
) -> None:
    """A checkpoint whose optimizer state a sharded group's workers kept (its state folder,
    contracts/sharded_state.py): every compute worker gets the folder's files in its own
    folder, where it reads its rows of them; the parameter server only the checkpoint."""
    files = {".metadata": b"meta", "__0_0.distcp": b"rows 0", "__1_0.distcp": b"rows 1"}
    api.attempt, api.checkpoints[9] = 2, b"outline"
    api.parts[9] = {f"step-8.pt.dcp/{name}": body for name, body in files.items()}
    outcome, pool = run_with({0: RENDEZVOUS}, attempt=2, resume_checkpoint_id=9)
    assert outcome == "succeeded"
    ranks = pool.by_rank()
    assert json.loads((ranks[0].rank_dir / "spec.json").read_text())["resume_state_dir"] is None
    for rank in (1, 2):
        spec = json.loads((ranks[rank].rank_dir / "spec.json").read_text())
        root = Path(spec["resume_state_dir"])
        assert root == ranks[rank].rank_dir / "resume-9.state"
        folder = root / "step-8.pt.dcp"
        assert {p.name: p.read_bytes() for p in folder.iterdir()} == files


def test_a_later_attempts_workers_fetch_their_own_groups_state_only(
    api: FakeApi, run_with: Run
) -> None:
    """Under periodic and diloco each group's leader wrote its group's optimizer into a folder
    of its own (``<checkpoint>.g<g>.dcp``): a worker of group 0 downloads group 0's, not
    group 1's (at 25M parameters with Adam, 200 MB a group)."""
    api.attempt, api.checkpoints[9] = 2, b"outline"
    api.parts[9] = {
        f"step-8.pt.g{g}.dcp/{name}": f"{g}{name}".encode()
        for g in (0, 1)
        for name in (".metadata", "__0_0.distcp")
    }
    outcome, pool = run_with({0: RENDEZVOUS}, attempt=2, resume_checkpoint_id=9)  # group 0
    assert outcome == "succeeded"
    for rank in (1, 2):
        spec = json.loads((pool.by_rank()[rank].rank_dir / "spec.json").read_text())
        root = Path(spec["resume_state_dir"])
        assert [p.name for p in root.iterdir()] == ["step-8.pt.g0.dcp"]
        assert (root / "step-8.pt.g0.dcp" / ".metadata").read_bytes() == b"0.metadata"
    fetched = [r.url.path for r in api.requests if "/parts/" in r.url.path]
    assert fetched and all("/step-8.pt.g0.dcp/" in path for path in fetched), fetched


def test_the_parameter_server_fetches_the_models_slices_and_the_workers_do_not(
    api: FakeApi, run_with: Run
) -> None:
    """With the parameter server in shards under periodic and diloco its owners wrote the
    checkpoint's model, each its slice (``<checkpoint>.s<shard>.dcp``): rank 0 downloads those
    (it builds the whole model at a start and sends it on), the workers only their group's
    optimizer state."""
    api.attempt, api.checkpoints[9] = 2, b"outline"
    names = (".metadata", "__0_0.distcp")
    folders = ["step-8.pt.s0.dcp", "step-8.pt.s1.dcp", "step-8.pt.g0.dcp"]
    api.parts[9] = {f"{f}/{n}": f"{f}{n}".encode() for f in folders for n in names}
    outcome, pool = run_with({0: RENDEZVOUS}, attempt=2, resume_checkpoint_id=9)  # group 0
    assert outcome == "succeeded"
    ranks = pool.by_rank()
    server = Path(json.loads((ranks[0].rank_dir / "spec.json").read_text())["resume_state_dir"])
    assert sorted(p.name for p in server.iterdir()) == folders[:2]
    assert (server / "step-8.pt.s1.dcp" / ".metadata").read_bytes() == b"step-8.pt.s1.dcp.metadata"
    for rank in (1, 2):
        spec = json.loads((ranks[rank].rank_dir / "spec.json").read_text())
        assert [p.name for p in Path(spec["resume_state_dir"]).iterdir()] == [folders[2]]


def test_a_group_parked_at_the_checkpoint_fetches_the_other_groups_state(
    api: FakeApi, run_with: Run
) -> None:
    """A group the guard had parked wrote no folder: its entry in the checkpoint names the
    source group's, so its workers take the folders there are."""
    api.attempt, api.checkpoints[9] = 2, b"outline"
    api.parts[9] = {f"step-8.pt.g1.dcp/{name}": b"b" for name in (".metadata", "__0_0.distcp")}
    outcome, pool = run_with({0: RENDEZVOUS}, attempt=2, resume_checkpoint_id=9)  # group 0
    assert outcome == "succeeded"
    spec = json.loads((pool.by_rank()[1].rank_dir / "spec.json").read_text())
    assert [p.name for p in Path(spec["resume_state_dir"]).iterdir()] == ["step-8.pt.g1.dcp"]


def test_another_group_waits_for_the_published_rendezvous(api: FakeApi, run_with: Run) -> None:
    def publish_on_second_ask(route: str) -> None:
        if route == "rendezvous" and len(api.calls("rendezvous")) >= 2:
            api.master = ("10.0.0.9", 5151)

    api.before = publish_on_second_ask
    outcome, pool = run_with({}, group_index=1, hosts_parameter_server=False, sub_task_id=18)
    assert outcome == "succeeded"
    (slot,) = pool.slots
    assert (slot.env["RANK"], slot.env["MASTER_ADDR"], slot.env["MASTER_PORT"]) == (
        "3",
        "10.0.0.9",
        "5151",
    )
    assert "10.0.0.9" in slot.lease.admitted[0][1]  # its rank may reach the parameter server


@pytest.mark.parametrize(
    ("script", "cause", "summary"),
    [
        ("echo 'Traceback'; echo 'ValueError: bad batch'; exit 3", "user", "ValueError: bad batch"),
        ("echo 'DistBackendError: Connection closed by peer'; exit 1", "peer", "DistBackendError"),
        ("kill -9 $$", "infra", "exited with code -9"),
        ("echo 'MemoryError'; exit 1", "user", "memory_limit_mb=4096 exceeded"),
    ],
)
def test_a_failed_rank_is_reported_with_its_cause(
    api: FakeApi, run_with: Run, script: str, cause: str, summary: str
) -> None:
    outcome, _ = run_with({0: f"{RENDEZVOUS}; sleep 30", 2: script, 1: "sleep 30"})
    assert outcome == "failed"
    (finished,) = api.bodies("finished")
    assert finished["succeeded"] is False and finished["cause"] == cause
    assert summary in finished["detail"] and "rank-2" in finished["detail"]


def test_an_agent_error_is_an_infra_failure_and_is_logged(api: FakeApi, run_with: Run) -> None:
    api.fail["code"] = [500, 500, 500]
    outcome, pool = run_with({})
    assert outcome == "failed" and pool.slots == []
    (finished,) = api.bodies("finished")
    assert finished["succeeded"] is False and finished["cause"] == "infra"
    assert "HTTPStatusError" in finished["detail"]
    assert any(text.startswith("agent error:") for text in logged(api))


@pytest.mark.parametrize(("status", "attempt"), [("CANCELLED", 1), ("RUNNING", 2)])
def test_ranks_stop_when_the_task_is_cancelled_or_restarted(
    api: FakeApi, run_with: Run, status: str, attempt: int
) -> None:
    def change_after_start(route: str) -> None:
        if route == "state":
            api.status, api.attempt = status, attempt

    api.before = change_after_start
    outcome, pool = run_with({0: f"{RENDEZVOUS}; sleep 30", 1: "sleep 30", 2: "sleep 30"})
    assert outcome == "failed"
    assert all(slot.popen.poll() is not None for slot in pool.slots)
    (finished,) = api.bodies("finished")
    assert finished["cause"] == "stopped" and f"{status} in attempt {attempt}" in finished["detail"]


def test_a_rank_beyond_its_wall_clock_limit_fails_the_task(api: FakeApi, run_with: Run) -> None:
    outcome, pool = run_with({0: f"{RENDEZVOUS}; sleep 30"}, limits={"max_runtime_s": 1})
    assert outcome == "failed" and pool.slots[0].popen.poll() is not None
    (finished,) = api.bodies("finished")
    assert finished["cause"] == "user" and "max_runtime_s=1 exceeded" in finished["detail"]


def test_rank_0_ending_before_the_rendezvous_is_reported(api: FakeApi, run_with: Run) -> None:
    outcome, pool = run_with({0: "echo 'RuntimeError: no port'; exit 1"})
    assert outcome == "failed" and len(pool.slots) == 1
    assert api.bodies("rendezvous") == []
    (finished,) = api.bodies("finished")
    assert finished["cause"] == "user" and "RuntimeError: no port" in finished["detail"]


class Lease:
    def __init__(self) -> None:
        self.admitted: list[list[str]] = []

    def admit(self, task_id: int, peers: list[str]) -> None:
        self.admitted.append(list(peers))


def test_peers_admit_each_new_host_until_every_sub_task_is_claimed(
    api: FakeApi, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(Peers, "REFRESH_S", 0.0)
    peers, lease = Peers(api.client(), 4, 1, [HOST]), Lease()
    peers.leases.append(lease)  # type: ignore[arg-type]
    api.peer_hosts = [HOST]
    peers.refresh()
    assert lease.admitted == []  # nothing new
    api.peer_hosts = [HOST, "10.0.0.9"]
    peers.refresh()
    assert lease.admitted == [[HOST, "10.0.0.9"]]
    api.peer_hosts, api.peers_complete = [HOST, "10.0.0.9", "10.0.0.8"], True
    peers.refresh()
    asks = len(api.calls("rendezvous"))
    peers.refresh()
    assert len(api.calls("rendezvous")) == asks  # complete: the backend is not asked again
    assert lease.admitted[-1] == sorted([HOST, "10.0.0.8", "10.0.0.9"])


def test_peers_stop_following_another_attempt(
    api: FakeApi, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(Peers, "REFRESH_S", 0.0)
    peers, lease = Peers(api.client(), 4, 1, [HOST]), Lease()
    peers.leases.append(lease)  # type: ignore[arg-type]
    api.attempt, api.peer_hosts = 2, ["10.0.0.66"]
    peers.refresh()
    assert peers.complete and lease.admitted == [] and peers.hosts == [HOST]


def cached_environment(settings: AgentSettings, lock: str) -> Path:
    """An environment of `lock` already on this host (as a build leaves it)."""
    site = Path(settings.data_dir).resolve() / "agent" / "envs" / lock_hash(lock)
    (site / "einops").mkdir(parents=True)
    (site / "einops" / "__init__.py").write_text("VERSION = 'cached'\n")
    (site / READY).touch()
    return site


def test_a_cached_environment_is_linked_for_every_rank_and_reported_ready(
    api: FakeApi, run_with: Run, settings: AgentSettings
) -> None:
    lock = "einops==0.8.2\n"
    site = cached_environment(settings, lock)
    outcome, pool = run_with(
        {0: RENDEZVOUS}, environment={"lock_hash": lock_hash(lock), "lock": lock}
    )
    assert outcome == "succeeded"
    assert api.bodies("claim")[0]["preparing"] is True
    assert api.bodies("ready") == [{"detail": f"environment {lock_hash(lock)[:12]} cached"}]
    for slot in pool.slots:  # each rank's read-only folder holds the same files
        linked = env_dir(slot.rank_dir) / "einops" / "__init__.py"
        assert linked.stat().st_ino == (site / "einops" / "__init__.py").stat().st_ino


def test_an_environment_that_cannot_be_built_fails_the_task_with_the_installers_message(
    api: FakeApi, run_with: Run, settings: AgentSettings, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("UV_HTTP_RETRIES", "0")  # fail at once, not after uv's retries
    settings.index_url = "http://127.0.0.1:9/simple"  # nothing listens: an offline site
    lock = "einops==0.8.2 \\\n    --hash=sha256:" + "0" * 64 + "\n"
    outcome, pool = run_with(
        {0: RENDEZVOUS}, environment={"lock_hash": lock_hash(lock), "lock": lock}
    )
    assert outcome == "failed" and pool.slots == []  # no rank started
    assert api.bodies("claim")[0]["preparing"] is True and api.bodies("ready") == []
    [finished] = api.bodies("finished")
    assert not finished["succeeded"] and finished["cause"] == "user"
    detail = finished["detail"]
    assert "could not install package einops==0.8.2" in detail
    assert "http://127.0.0.1:9/simple" in detail and "Connection refused" in detail
    assert any(line.startswith("uv: ") for line in logged(api))  # the installer's own output
    assert any("could not install package einops==0.8.2" in line for line in logged(api))


def test_a_task_cancelled_while_its_environment_was_prepared_starts_no_rank(
    api: FakeApi, run_with: Run, settings: AgentSettings
) -> None:
    lock = "einops==0.8.2\n"
    cached_environment(settings, lock)
    api.fail["ready"] = [409]  # the API refuses: the task is no longer this attempt's
    outcome, pool = run_with(
        {0: RENDEZVOUS}, environment={"lock_hash": lock_hash(lock), "lock": lock}
    )
    assert outcome == "failed" and pool.slots == []
    [finished] = api.bodies("finished")
    assert (finished["succeeded"], finished["cause"]) == (False, "stopped")


def test_sharded_workers_start_fresh_with_the_allocator_the_host_asks_for(
    api: FakeApi,
    run_with: Run,
    settings: AgentSettings,
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
) -> None:
    # A sharded group's workers need jemalloc preloaded when their interpreter starts
    # (POLYTRAIN_JEMALLOC on this host): fresh slots with it in their environment, not warm
    # ones; the parameter server and unsharded ranks keep the warm pool.
    library = next((p for p in JEMALLOC_PATHS if Path(p).is_file()), None)
    if library is None:
        pytest.skip("no jemalloc on this host (Debian: libjemalloc2)")
    settings.jemalloc = library  # POLYTRAIN_JEMALLOC on the agent's host
    scripts = {0: f"echo ps up; {RENDEZVOUS}"}
    fresh: list[tuple[dict[str, str], FakeSlot]] = []

    def start_slot(sandbox: object, *, warm: bool = False, env: dict[str, str] | None = None):  # type: ignore[no-untyped-def]
        slot = FakeSlot(tmp_path / f"fresh-{len(fresh)}", scripts)
        fresh.append((dict(env or {}), slot))
        return slot

    monkeypatch.setattr(runner_module, "start_slot", start_slot)
    groups = [
        {"name": "a", "device_type": "cpu", "workers": 2, "sharding": "fsdp"},
        {"name": "b", "device_type": "cpu", "workers": 1},
    ]
    try:
        outcome, pool = run_with(scripts, groups=groups)
        assert outcome == "succeeded"
        expected = {"LD_PRELOAD": library, "MALLOC_CONF": SHARDED_MALLOC_CONF}
        assert [env for env, _ in fresh] == [expected, expected]  # group a's 2 workers
        assert sorted(int(slot.env["RANK"]) for _, slot in fresh) == [1, 2]
        assert sorted(pool.by_rank()) == [0]  # the parameter server: a warm slot
    finally:
        for _, slot in fresh:
            slot.popen.kill()
            slot.popen.wait()
            if slot.popen.stdout is not None:
                slot.popen.stdout.close()


def test_an_outcome_the_api_could_not_answer_is_sent_again_until_it_arrives(
    api: FakeApi, run_with: Run, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The part ends while the API is away for longer than the client's retries: its outcome
    is sent again (the same, which changes nothing twice), not lost with the task waiting."""
    monkeypatch.setattr(runner_module, "OUTAGE_RETRY_S", 0.0)
    api.fail["finished"] = [503, 0, 503, 0]  # the client's 3 tries fail, then 1 more
    outcome, _pool = run_with({0: f"echo ps up; {RENDEZVOUS}", 1: "echo r1 done"})
    assert outcome == "succeeded"
    assert api.fail["finished"] == []
    (finished,) = api.bodies("finished")
    assert finished["succeeded"] is True


def test_an_outcome_refused_is_not_sent_again(
    api: FakeApi, run_with: Run, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(runner_module, "OUTAGE_RETRY_S", 0.0)
    api.fail["finished"] = [422, 200]
    with pytest.raises(httpx.HTTPStatusError):
        run_with({0: f"echo ps up; {RENDEZVOUS}", 1: "echo r1 done"})
    assert api.fail["finished"] == [200]
