"""Cross-device agreement: a group whose numbers differ from the parameter server's raises an
alarm naming it and fails the task or is left out; a clean run raises none."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from pydantic import ValidationError

from tests.worker.engine.reference import TIMEOUT_S
from tests.worker.engine.test_provenance import HOLDS, covers_once, provenance_of
from tests.worker.engine.test_resume import HOLD_AFTER
from worker.engine.agreement import BFLOAT16_HOOK, DIGEST_BYTES, digest, distance
from worker.engine.balance import Balancer
from worker.engine.local import LocalRun, launch_local
from worker.engine.spec import RunSpec


def alarms(run: LocalRun) -> list[dict[str, Any]]:
    return [e for e in run.events if e["type"] == "alarm"]


def test_distance_is_relative_l2_and_zero_only_for_the_same_bits() -> None:
    reference = torch.tensor([3.0, 4.0])
    assert distance(reference.clone(), reference) == 0.0
    assert distance(torch.tensor([3.0, 4.5]), reference) == pytest.approx(0.1)
    assert distance(torch.tensor([0.0, 1e-30]), torch.zeros(2)) > 0  # any gap from zero
    assert distance(torch.tensor([3.0, float("nan")]), reference) == float("inf")
    assert distance(reference, torch.tensor([3.0, float("nan")])) == 0.0, "nothing to compare"


def test_the_digest_is_the_same_only_for_the_same_bits_in_the_same_order() -> None:
    """What a group sends before training unless the parameter server asks for more."""
    a, b = torch.randn(5), torch.randn(3, 2)
    same = digest([a.clone(), b.clone()])
    assert same.dtype == torch.uint8 and same.shape == (DIGEST_BYTES,)
    assert torch.equal(digest([a, b]), same)
    assert torch.equal(digest([a, b.t().contiguous().t()]), same)  # layout is not content
    nudged = a.clone()
    nudged[2] = torch.nextafter(nudged[2], torch.tensor(float("inf")))  # one ulp
    assert not torch.equal(digest([nudged, b]), same)
    assert not torch.equal(digest([b, a]), same)
    assert not torch.equal(digest([a.double(), b.double()]), same)


def test_tolerance_keys_are_device_type_pairs(make_spec: Callable[..., RunSpec]) -> None:
    spec = make_spec(agreement_tolerance={"cuda/cpu": 1e-3})
    assert spec.agreement_tolerance == {"cpu/cuda": 1e-3}, "the pair is sorted"
    with pytest.raises(ValidationError, match="key 'cpu-cuda' must be two device types"):
        make_spec(agreement_tolerance={"cpu-cuda": 1e-3})
    with pytest.raises(ValidationError, match="tpu"):
        make_spec(agreement_tolerance={"cpu/tpu": 1e-3})


def test_excluded_workers_keep_no_share_and_the_batch_stays() -> None:
    balancer = Balancer("weighted", 12)
    shares = balancer.exclude({2}, [4, 4, 4])
    assert shares == [6, 6, 0]
    balancer.update_estimate([10.0, 30.0, 50.0])
    assert balancer.propose(shares, [1.0, 1.0, 0.0], [10.0, 30.0, 0.0]) == [3, 9, 0]
    with pytest.raises(ValueError, match="every worker is excluded"):
        balancer.exclude({0, 1}, [3, 9, 0])
    assert Balancer("even", 12).exclude({0}, [4, 4, 4]) == [0, 6, 6]


def test_a_clean_run_raises_no_alarm(make_spec: Callable[..., RunSpec]) -> None:
    """CPU groups against the CPU parameter server agree bit for bit, before training and at
    every parameter check (every 3 steps). (Every other engine test runs the check before
    training too, with `on_disagreement: fail`: a false alarm would fail it.)"""
    spec = make_spec(agreement_every=3)
    run = launch_local(spec, timeout_s=TIMEOUT_S)
    assert run.ok, run.text(0)
    assert alarms(run) == []


def test_a_group_computing_in_bfloat16_is_named_and_fails_the_task(
    make_spec: Callable[..., RunSpec],
) -> None:
    run = launch_local(make_spec(), timeout_s=TIMEOUT_S, env_extra={BFLOAT16_HOOK: "b"})
    assert not run.ok
    (alarm,) = alarms(run)
    assert alarm["group"] == "b"
    assert "group 'b' (cpu) disagrees with the parameter server" in alarm["reason"]
    assert (
        "gradient of a fixed batch" in alarm["reason"]
        and "tolerance 0 for cpu/cpu" in (alarm["reason"])
    )
    assert "DisagreementError" in run.text(3) and "on_disagreement: fail" in run.text(3)
    assert not any(e["type"] == "checkpoint" for e in run.events), "no step was trained"


def test_an_excluded_group_trains_nothing_and_every_sample_is_still_used_once(
    make_spec: Callable[..., RunSpec],
) -> None:
    spec = make_spec(on_disagreement="exclude", split_policy="weighted", epochs=2)
    run = launch_local(spec, timeout_s=TIMEOUT_S, env_extra={BFLOAT16_HOOK: "b"})
    assert run.ok, run.text(0)
    assert [a["group"] for a in alarms(run)] == ["b"]
    assert any("excluded 'b' (on_disagreement: exclude)" in line for line in run.output[0])
    records = provenance_of(run.events)
    assert {r["samples"] for r in records if r["group"] == "b"} == {0}
    for epoch in (0, 1):
        assert covers_once([r for r in records if r["epoch"] == epoch], 160)


def test_a_bfloat16_group_passes_with_a_tolerance_for_it(make_spec: Callable[..., RunSpec]) -> None:
    spec = make_spec(agreement_tolerance={"cpu/cpu": 0.05}, epochs=1)
    run = launch_local(spec, timeout_s=TIMEOUT_S, env_extra={BFLOAT16_HOOK: "b"})
    assert run.ok, run.text(0)
    assert alarms(run) == []


# Rank 3 (group b) corrupts its replica of the model after a few steps, as a faulty device
# would: the parameter checksums of the next check differ.
DRIFTS = """
import os
import torch
from examples import tiny_regression
from examples.tiny_regression import build_datasets, build_optimizer, loss_fn as mse

MODEL = None
calls = 0

def build_model():
    global MODEL
    MODEL = tiny_regression.build_model()
    return MODEL

def loss_fn(output, target):
    global calls
    calls += 1
    if os.environ.get("RANK") == "{rank}" and calls == 20:  # after profiling, in epoch 0
        with torch.no_grad():
            next(MODEL.parameters()).view(-1)[0] += 1e-3
    return mse(output, target)
"""


def test_a_replica_that_drifts_is_named_at_the_next_parameter_check(
    make_spec: Callable[..., RunSpec], tmp_path: Path
) -> None:
    module = tmp_path / "drifts.py"
    module.write_text(DRIFTS.replace("{rank}", "3"))
    # every profile step, however slow the host: loss_fn's calls are counted
    spec = make_spec(code=str(module), agreement_every=5, profile_budget_s=3600)
    run = launch_local(spec, timeout_s=TIMEOUT_S)
    assert not run.ok
    (alarm,) = alarms(run)
    assert alarm["group"] == "b" and "its parameters' checksum at step" in alarm["reason"]
    assert "disagrees with group 'a' (cpu)" in alarm["reason"]


ONE_EACH = [{"name": n, "device_type": "cpu", "workers": 1} for n in ("a", "b", "c")]


def test_when_the_models_source_drifts_it_is_named_and_the_task_fails(
    make_spec: Callable[..., RunSpec], tmp_path: Path
) -> None:
    """Group a's replica is the one the parameter server takes: when it drifts, the other
    two groups agree with each other, not with it; a is named, and even `exclude` fails."""
    module = tmp_path / "drifts.py"
    module.write_text(DRIFTS.replace("{rank}", "1"))
    spec = make_spec(
        code=str(module), groups=ONE_EACH, agreement_every=5, on_disagreement="exclude"
    )
    run = launch_local(spec, timeout_s=TIMEOUT_S)
    assert not run.ok
    (alarm,) = alarms(run)
    assert alarm["group"] == "a" and "every other group's differs from it" in alarm["reason"]
    assert "the model's source cannot be left out" in run.text(1)


CPU_SHY = """
import os
from examples.tiny_regression import build_datasets, build_model, build_optimizer
from examples.tiny_regression import loss_fn as mse

def loss_fn(output, target):
    if os.environ.get("RANK") == "0":
        raise RuntimeError("this loss needs the group's accelerator")
    return mse(output, target)
"""


def test_code_that_cannot_run_on_the_servers_cpu_skips_the_check_and_trains(
    make_spec: Callable[..., RunSpec], tmp_path: Path
) -> None:
    module = tmp_path / "cpu_shy.py"
    module.write_text(CPU_SHY)
    run = launch_local(make_spec(code=str(module), epochs=1), timeout_s=TIMEOUT_S)
    assert run.ok, run.text(0)
    assert alarms(run) == []
    skipped = [line for line in run.output[0] if "agreement check before training skipped" in line]
    assert len(skipped) == 1 and "needs the group's accelerator" in skipped[0]


def test_the_checksum_sees_a_swap_and_does_not_depend_on_the_chunking(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from worker.engine import agreement

    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(3000)), torch.nn.Parameter(torch.randn(40, 50))]
    whole = agreement.checksum(params)
    flat = torch.cat([p.detach().reshape(-1).double() for p in params])
    weights = torch.arange(len(flat), dtype=torch.float64) % agreement.CHECKSUM_PERIOD + 1
    expected = torch.stack([flat.sum(), flat.dot(flat), flat.dot(weights)])
    torch.testing.assert_close(whole, expected, rtol=1e-12, atol=0)
    monkeypatch.setattr(agreement, "_CHUNK", 7)
    torch.testing.assert_close(agreement.checksum(params), whole, rtol=1e-12, atol=0)
    with torch.no_grad():
        params[0][[0, 1]] = params[0][[1, 0]]  # two values swapped: sums alike, weights not
    swapped = agreement.checksum(params)
    assert swapped[0] == pytest.approx(float(whole[0])) and swapped[2] != whole[2]


def test_an_excluded_group_stays_excluded_after_a_restart(
    make_spec: Callable[..., RunSpec], tmp_path: Path
) -> None:
    """Excluded in the first run; the resumed run (on hardware that now agrees) keeps it
    out: the exclusion is part of the checkpoint."""
    module = tmp_path / "holds.py"
    module.write_text(HOLDS.format(slow=False))
    stop_at = "step-10.pt"
    spec = make_spec(code=str(module), on_disagreement="exclude", checkpoint_every=5)
    hold = {HOLD_AFTER: str(Path(spec.checkpoint_dir) / stop_at), BFLOAT16_HOOK: "b"}
    first = launch_local(
        spec,
        timeout_s=TIMEOUT_S,
        env_extra=hold,
        stop_when=lambda e: e["type"] == "checkpoint" and Path(e["path"]).name == stop_at,
    )
    assert first.stopped and [a["group"] for a in alarms(first)] == ["b"]
    resumed = spec.model_copy(update={"resume_from": str(Path(spec.checkpoint_dir) / stop_at)})
    run = launch_local(resumed, timeout_s=TIMEOUT_S)
    assert run.ok, run.text(0)
    assert any("groups ['b'] stay excluded" in line for line in run.output[0])
    assert {r["samples"] for r in provenance_of(run.events) if r["group"] == "b"} == {0}


@pytest.mark.parametrize(
    "fields",
    [
        {"sync_strategy": "sync"},
        {"sync_strategy": "periodic", "sync_period": 4},
        {"sync_strategy": "quorum", "quorum": 1},
        {"sync_strategy": "diloco", "sync_period": 4},
        {"sync_strategy": "diloco", "sync_period": 4, "diloco_exchange": "overlapped"},
    ],
)
def test_the_agreement_mark_is_a_control_point_only_where_a_check_runs(
    make_spec: Callable[..., RunSpec], fields: dict[str, Any]
) -> None:
    """Only a replicated strategy (``sync``) checks parameters at the ``agreement_every``
    mark; under the others the mark schedules no control point, which in ``diloco``'s
    non-blocking exchanges would be a barrier for nothing."""
    from types import SimpleNamespace

    from worker.engine.run import control_due
    from worker.engine.session import registered

    spec = make_spec(agreement_every=5, split_policy="even", **fields)
    run = SimpleNamespace(
        spec=spec,
        strategy=registered()[spec.sync_strategy],
        guard=None,
        step=5,
        last_agreement=0,
        last_checkpoint=0,
        last_balance=0,
        split=SimpleNamespace(epoch_done=False),
    )
    assert control_due(run) is (spec.sync_strategy == "sync")  # type: ignore[arg-type]
    assert not control_due(run, step=4)  # type: ignore[arg-type]
