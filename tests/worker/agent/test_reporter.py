"""What a group's output becomes at the backend: numbered logs, metrics, progress, checkpoints."""

from __future__ import annotations

import json
import queue
from pathlib import Path

import httpx
import pytest

from contracts.agent_api import REPORT_MAX_ITEMS
from contracts.trial import TrialResult
from tests.worker.agent.fakes import FakeApi
from worker.agent import reporter as reporter_module
from worker.agent.reporter import Reporter
from worker.engine.report import PREFIX


def lines(*items: tuple[str, str]) -> queue.Queue[tuple[str, str]]:
    waiting: queue.Queue[tuple[str, str]] = queue.Queue()
    for item in items:
        waiting.put(item)
    return waiting


def ev(**event: object) -> str:
    return PREFIX + json.dumps(event)


def test_logs_are_numbered_per_node_and_sent_in_batches(api: FakeApi) -> None:
    reporter = Reporter(api.client(), 4, group="a", attempt=2, interval_s=60.0)
    reporter.pump(lines(("ps", "one"), ("rank-1", "two"), ("ps", "three")))
    reporter.pump(lines(("rank-1", "four")))  # within the interval: kept for the next batch
    assert len(api.bodies("report")) == 1
    reporter.flush()
    assert len(api.bodies("report")) == 2
    sent = api.reported("lines")
    assert [(x["node"], x["seq"], x["text"]) for x in sent] == [
        ("ps", 0, "one"),
        ("rank-1", 0, "two"),
        ("ps", 1, "three"),
        ("rank-1", 1, "four"),
    ]
    assert {x["attempt"] for x in sent} == {2}


def test_more_than_a_report_carries_goes_in_several_in_order(api: FakeApi) -> None:
    """A burst beyond `REPORT_MAX_ITEMS` (a fast task's metrics while the agent was busy) is
    sent in reports the API accepts, in order, the progress with the last; before, the one
    report of everything was refused (422) at every flush and the task's output stopped."""
    reporter = Reporter(api.client(), 4, group="a", interval_s=60.0)
    n_metrics, n_lines = 2 * REPORT_MAX_ITEMS + 5, REPORT_MAX_ITEMS + 1
    reporter.pump(
        lines(
            *[
                ("ps", ev(type="metric", name="loss", value=float(i), step=i))
                for i in range(n_metrics)
            ],
            *[("rank-1", f"line {i}") for i in range(n_lines)],
            ("ps", ev(type="progress", step=5, epochs=2, steps_per_epoch=10, epoch=0)),
        )
    )
    reporter.flush()
    bodies = api.bodies("report")
    assert len(bodies) == 3
    assert all(len(b["metrics"]) <= REPORT_MAX_ITEMS >= len(b["lines"]) for b in bodies)
    assert [m["value"] for m in api.reported("metrics")] == [float(i) for i in range(n_metrics)]
    assert [x["seq"] for x in api.reported("lines")] == list(range(n_lines))
    assert [b.get("progress") is not None for b in bodies] == [False, False, True]
    reporter.flush()  # nothing left behind
    assert len(api.bodies("report")) == 3


def test_logs_survive_a_503(api: FakeApi) -> None:
    api.fail["report"] = [503]
    reporter = Reporter(api.client(), 4, group="a")
    reporter.agent_line("started")
    reporter.flush()
    assert [x["text"] for x in api.reported("lines")] == ["started"]
    assert api.reported("lines")[0]["node"] == "agent-a"


def test_an_api_outage_keeps_the_output_and_costs_the_running_part_nothing(
    api: FakeApi, monkeypatch: pytest.MonkeyPatch
) -> None:
    """While the ranks run, a report the API fails (its database restarting: 5xx, or the
    process gone: a dropped connection), after the client's retries, is kept for a later
    flush instead of failing the part; nothing is lost or sent twice."""
    monkeypatch.setattr(reporter_module, "OUTAGE_RETRY_S", 0.0)
    api.fail["report"] = [503, 0]  # retries=0: one failed flush each
    reporter = Reporter(api.client(retries=0), 4, group="a", interval_s=0.0)
    reporter.pump(lines(("rank-1", "one"), ("ps", ev(type="metric", name="loss", value=0.5))))
    reporter.pump(lines(("rank-1", "two")))
    assert api.reported("lines") == []
    reporter.pump(lines(("rank-1", "three")))  # the API is back
    assert [x["text"] for x in api.reported("lines")] == ["one", "two", "three"]
    assert [x["seq"] for x in api.reported("lines")] == [0, 1, 2]
    assert [m["value"] for m in api.reported("metrics")] == [0.5]


def test_an_api_gone_for_longer_than_the_limit_fails_the_part(api: FakeApi) -> None:
    """The outage is counted from the first failing flush's start (its client retries
    included): with no time allowed, that flush already fails the part."""
    api.fail["report"] = [503]
    reporter = Reporter(api.client(retries=0), 4, group="a", interval_s=0.0, outage_limit_s=0.0)
    with pytest.raises(httpx.HTTPStatusError):
        reporter.pump(lines(("rank-1", "one")))
    api.fail["report"] = [422]  # a refusal is no outage: raised at once, whatever the limit
    with pytest.raises(httpx.HTTPStatusError):
        Reporter(api.client(retries=0), 4, group="a", interval_s=0.0).pump(lines(("ps", "x")))


def test_metrics_keep_their_rank_and_the_parameter_server_reports_global_ones(api: FakeApi) -> None:
    reporter = Reporter(api.client(), 4, group="a")
    reporter.pump(
        lines(
            ("ps", ev(type="metric", name="loss", value=0.5, step=3, epoch=1, rank=0)),
            ("rank-2", ev(type="metric", name="loss", value=0.7, step=3, epoch=1, rank=2)),
            ("rank-2", ev(type="metric", name="loss", value=None, nonfinite="nan", step=4, rank=2)),
        )
    )
    (batch,) = api.bodies("report")
    assert [(m["rank"], m["value"], m["nonfinite"]) for m in batch["metrics"]] == [
        (None, 0.5, None),
        (2, 0.7, None),
        (2, None, "nan"),
    ]
    # Numbered per node and attempt, so a report sent again stores each value once.
    assert [(m["attempt"], m["node"], m["seq"]) for m in batch["metrics"]] == [
        (1, "ps", 0),
        (1, "rank-2", 0),
        (1, "rank-2", 1),
    ]


def test_a_malformed_event_is_logged_and_loses_nothing_else(api: FakeApi) -> None:
    reporter = Reporter(api.client(), 4, group="a")
    reporter.pump(
        lines(
            ("rank-1", ev(type="metric", name="x" * 500, value=1.0)),  # refused by the API schema
            ("rank-1", ev(type="progress", step=1)),  # fields missing
            ("rank-1", ev(type="metric", name="acc", value=0.9, rank=1)),
        )
    )
    assert [m["name"] for m in api.reported("metrics")] == ["acc"]
    assert api.reported("metrics")[0]["seq"] == 0  # a refused value takes no number
    texts = [x["text"] for x in api.reported("lines")]
    assert len(texts) == 2 and all(t.startswith("ignored a malformed") for t in texts)


def test_the_first_progress_is_sent_at_once(api: FakeApi) -> None:
    reporter = Reporter(api.client(), 4, group="a", interval_s=60.0)
    reporter.flush()
    reporter.pump(lines(("ps", ev(type="progress", step=5, epochs=2, steps_per_epoch=10, epoch=0))))
    assert api.reported("progress") == [{"progress": 0.25, "epoch": 0, "attempt": 1}]


def test_checkpoints_are_uploaded_only_from_the_ranks_own_folder(
    api: FakeApi, tmp_path: Path
) -> None:
    rank_dir = tmp_path / "rank"
    (rank_dir / "checkpoints").mkdir(parents=True)
    (rank_dir / "checkpoints" / "ep1.pt").write_bytes(b"weights")
    secret = tmp_path / "agent-secret"
    secret.write_text("token")
    (rank_dir / "checkpoints" / "link.pt").symlink_to(secret)
    reporter = Reporter(api.client(), 4, group="a", attempt=3)
    reporter.rank_dirs["ps"] = rank_dir
    reporter.pump(
        lines(
            (
                "ps",
                ev(
                    type="checkpoint",
                    path=str(rank_dir / "checkpoints" / "ep1.pt"),
                    epoch=1,
                    step=10,
                ),
            ),
            ("ps", ev(type="checkpoint", path=str(secret), epoch=1, step=10)),
            (
                "ps",
                ev(
                    type="checkpoint",
                    path=str(rank_dir / "checkpoints" / "link.pt"),
                    epoch=1,
                    step=10,
                ),
            ),
            (
                "rank-1",
                ev(
                    type="checkpoint",
                    path=str(rank_dir / "checkpoints" / "ep1.pt"),
                    epoch=1,
                    step=10,
                ),
            ),
        )
    )
    uploads = [r for r in api.requests if r.url.path.endswith("/checkpoints")]
    assert len(uploads) == 1 and uploads[0].content == b"weights"
    assert dict(uploads[0].url.params) == {
        "name": "ep1.pt",
        "epoch": "1",
        "step": "10",
        "attempt": "3",
    }
    refused = [x["text"] for x in api.reported("lines")]
    assert len(refused) == 3 and all(t.startswith("refused checkpoint") for t in refused)


def test_a_sharded_workers_state_files_are_uploaded_from_its_own_folder_only(
    api: FakeApi, tmp_path: Path
) -> None:
    """Each worker of a sharded group uploads the files of a checkpoint's state folder it
    wrote (contracts/sharded_state.py); the parameter server's checkpoint names them all."""
    rank_dir = tmp_path / "rank"
    state = rank_dir / "checkpoints" / "step-8.pt.dcp"
    state.mkdir(parents=True)
    (state / "__1_0.distcp").write_bytes(b"rows")
    (state / "notes.txt").write_bytes(b"x")
    secret = tmp_path / "agent-secret"
    secret.write_text("token")
    (state / "__2_0.distcp").symlink_to(secret)
    reporter = Reporter(api.client(), 4, group="a", attempt=2)
    reporter.rank_dirs["rank-2"] = rank_dir
    part = {"type": "checkpoint_part"}
    reporter.pump(
        lines(
            ("rank-2", ev(**part, path=str(state / "__1_0.distcp"))),
            ("rank-2", ev(**part, path=str(state / "notes.txt"))),  # not DCP's
            ("rank-2", ev(**part, path=str(state / "__2_0.distcp"))),  # a symlink
            ("rank-2", ev(**part, path=str(secret))),  # outside its folder
            ("rank-1", ev(**part, path=str(state / "__1_0.distcp"))),  # not its folder
        )
    )
    uploads = [r for r in api.requests if r.url.path.endswith("/checkpoint-parts")]
    assert len(uploads) == 1 and uploads[0].content == b"rows"
    assert dict(uploads[0].url.params) == {"part": "step-8.pt.dcp/__1_0.distcp", "attempt": "2"}
    refused = [x["text"] for x in api.reported("lines")]
    assert len(refused) == 4 and all(t.startswith("refused checkpoint part") for t in refused)


def _provenance(**change: object) -> dict:
    record = {
        "worker": 0,
        "rank": 1,
        "group_index": 0,
        "group": "a",
        "epoch": 0,
        "step_from": 0,
        "step_to": 4,
        "samples": 28,
        "index_hash": "00000000000000ff",
        "rebalanced": 0,
        "exchanged": 0,
    }
    return {"n_items": 28, "set_hash": "00000000000000ff", "records": [{**record, **change}]}


def test_a_checkpoints_shard_provenance_follows_it_and_bad_records_are_refused(
    api: FakeApi, tmp_path: Path
) -> None:
    rank_dir = tmp_path / "ps"
    (rank_dir / "checkpoints").mkdir(parents=True)
    for name in ("epoch-0.pt", "epoch-1.pt"):
        (rank_dir / "checkpoints" / name).write_bytes(name.encode())
    reporter = Reporter(api.client(), 4, group="a")
    reporter.rank_dirs["ps"] = rank_dir
    path = str(rank_dir / "checkpoints")
    reporter.pump(
        lines(
            (
                "ps",
                ev(
                    type="checkpoint",
                    path=f"{path}/epoch-0.pt",
                    epoch=0,
                    step=4,
                    provenance=_provenance(),
                ),
            ),
            (
                "ps",
                ev(
                    type="checkpoint",
                    path=f"{path}/epoch-1.pt",
                    epoch=1,
                    step=8,
                    provenance=_provenance(step_to=-1),
                ),
            ),
        )
    )
    assert len(api.calls("checkpoints")) == 2, "a checkpoint is kept whatever its records"
    (stored,) = api.calls("provenance")
    assert stored.url.path.endswith("/tasks/4/checkpoints/1/provenance")
    assert json.loads(stored.content) == _provenance()
    (refused,) = [x["text"] for x in api.reported("lines")]
    assert refused.startswith("refused the shard provenance of 'epoch-1.pt' from ps")


def test_the_parameter_servers_alarms_are_raised_and_a_ranks_are_not(api: FakeApi) -> None:
    reporter = Reporter(api.client(), 4, group="a", attempt=2)
    reporter.pump(
        lines(
            ("ps", ev(type="alarm", reason="group 'b' (cpu) disagrees", group="b")),
            ("rank-1", ev(type="alarm", reason="forged by the training code", group="a")),
            ("ps", ev(type="guard", reason="group 'b' parked at step 8", group="b")),
            ("rank-1", ev(type="guard", reason="forged too", group="a")),
        )
    )
    assert api.bodies("alarms") == [
        {"reason": "group 'b' (cpu) disagrees", "group": "b", "attempt": 2, "kind": "alarm"},
        {"reason": "group 'b' parked at step 8", "group": "b", "attempt": 2, "kind": "guard"},
    ]


TRIAL = {
    "n_train": 60,
    "exchange_bytes": 652,
    "startup_s": 2.5,
    "workers": [{"rank": 1, "group_index": 0, "batch_sizes": [4, 8], "step_s": [0.01, 0.02]}],
    "exchanges": [],
}


def test_trial_timings_are_taken_from_the_parameter_server_only(api: FakeApi) -> None:
    reporter = Reporter(api.client(), 4, group="a")
    forged = {**TRIAL, "startup_s": 99.0}
    malformed = {**TRIAL, "workers": []}
    reporter.pump(
        lines(
            ("rank-1", ev(type="trial", result=forged)),
            ("ps", ev(type="trial", result=malformed)),
            ("ps", ev(type="trial", result=TRIAL)),
        )
    )
    (stored,) = api.calls("trial")
    assert stored.url.path.endswith("/tasks/4/trial") and stored.method == "PUT"
    assert api.bodies("trial") == [TrialResult.model_validate(TRIAL).model_dump(mode="json")]
    logged = [x["text"] for x in api.reported("lines")]
    assert any("malformed 'trial' event from ps" in line for line in logged)


def test_shard_provenance_is_taken_from_the_parameter_server_only(
    api: FakeApi, tmp_path: Path
) -> None:
    rank_dir = tmp_path / "rank-1"
    (rank_dir / "checkpoints").mkdir(parents=True)
    (rank_dir / "checkpoints" / "epoch-0.pt").write_bytes(b"weights")
    reporter = Reporter(api.client(), 4, group="a")
    reporter.rank_dirs["rank-1"] = rank_dir
    forged = ev(
        type="checkpoint",
        path=str(rank_dir / "checkpoints" / "epoch-0.pt"),
        epoch=0,
        step=4,
        provenance=_provenance(),
    )
    reporter.pump(lines(("rank-1", forged)))
    assert api.calls("provenance") == []
    (refused,) = [x["text"] for x in api.reported("lines")]
    assert "only the parameter server records shard provenance" in refused


def test_the_last_flush_rides_out_an_outage_and_sends_everything(
    api: FakeApi, monkeypatch: pytest.MonkeyPatch
) -> None:
    """As the ranks end, the API restarting: the last output is sent once it is back, not
    dropped at the first failure."""
    monkeypatch.setattr(reporter_module, "OUTAGE_RETRY_S", 0.0)
    api.fail["report"] = [503, 0, 503]
    reporter = Reporter(api.client(retries=0), 4, group="a", interval_s=3600.0)
    reporter.agent_line("ranks ended")
    reporter.flush_last()
    assert api.fail["report"] == []
    assert [x["text"] for x in api.reported("lines")] == ["ranks ended"]


def test_the_last_flush_gives_up_after_the_outage_limit(api: FakeApi) -> None:
    api.fail["report"] = [503]
    reporter = Reporter(api.client(retries=0), 4, group="a", outage_limit_s=0.0)
    reporter.agent_line("ranks ended")
    with pytest.raises(httpx.HTTPStatusError):
        reporter.flush_last()
