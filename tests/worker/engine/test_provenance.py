"""Shard provenance: which worker trained which samples, through rebalances, exchanges and
restarts; the records of every epoch cover the training set exactly once."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from tests.worker.engine.reference import (
    TIMEOUT_S,
    dumped_batches,
    reference_run,
    run_with_dump,
    seeded_batches,
)
from tests.worker.engine.test_resume import HOLD_AFTER
from worker.engine.local import launch_local
from worker.engine.provenance import ShardLedger, index_hash, training_set_hash
from worker.engine.spec import RunSpec
from worker.engine.split import SplitState


def covers_once(records: list[dict[str, Any]], n_items: int) -> bool:
    """The records' counts sum to ``n_items`` and their hashes to the whole set's."""
    hashes = sum(int(r["index_hash"], 16) for r in records) % 2**64
    return sum(r["samples"] for r in records) == n_items and hashes == training_set_hash(n_items)


def test_the_hash_is_of_the_set_and_adds_over_disjoint_sets() -> None:
    order = torch.randperm(1000, generator=torch.Generator().manual_seed(0))
    assert index_hash(order) == index_hash(torch.arange(1000)) == training_set_hash(1000)
    parts = index_hash(order[:300]) + index_hash(order[300:])
    assert parts % 2**64 == training_set_hash(1000)
    assert index_hash(order[:300]) != index_hash(order[1:301]), "another set, another hash"
    assert index_hash(np.array([], dtype=np.int64)) == 0


def test_split_marks_what_a_share_change_and_an_exchange_moved() -> None:
    state = SplitState.initial(160, [4, 2, 2], seed=1)
    state.begin_epoch(seed=1, epoch=0)
    assert all(len(t) == 0 for t in state.rebalanced_in + state.exchanged_in)
    for _ in range(5):
        state.advance()
    before = [set(s[u:].tolist()) for s, u in zip(state.shards, state.used, strict=True)]
    state.set_shares([6, 1, 1])
    gained = set(state.rebalanced_in[0].tolist())
    assert gained and gained == set(state.shards[0][state.used[0] :].tolist()) - before[0]
    assert all(len(t) == 0 for t in state.rebalanced_in[1:]), "workers 1, 2 only gave samples"
    while not state.epoch_done:
        state.advance()
    held = [set(s.tolist()) for s in state.shards]
    sent = state.exchange(0.25, seed=1, epoch=0)
    for i, received in enumerate(state.exchanged_in):
        assert len(received) == sent[i - 1]
        assert set(received.tolist()) <= held[i - 1] and not set(received.tolist()) & held[i]
    held = [set(s.tolist()) for s in state.shards]
    state.begin_epoch(seed=1, epoch=1)  # resizes the shards to the shares: moves samples
    assert sum(map(len, state.rebalanced_in)) == abs(len(held[0]) - 120)
    for i, moved in enumerate(state.rebalanced_in):
        assert not set(moved.tolist()) & held[i] and set(moved.tolist()) <= set(
            state.shards[i].tolist()
        )
    restored = SplitState.from_state_dict(state.state_dict())
    assert all(
        torch.equal(a, b) for a, b in zip(restored.exchanged_in, state.exchanged_in, strict=True)
    )


def test_ledger_records_every_sample_once_per_epoch_across_a_restart(
    make_spec: Callable[..., RunSpec],
) -> None:
    """Epoch 0 with a rebalance and a checkpoint, then an exchange; epoch 1 restarted
    from a mid-epoch checkpoint (the failed attempt's later work is not recorded)."""
    spec = make_spec(global_batch_size=8)  # groups a (ranks 1, 2) and b (rank 3)
    state = SplitState.initial(160, [4, 2, 2], seed=1)
    ledger, sent_records = ShardLedger(spec), []
    step = 0
    for epoch in range(2):
        state.begin_epoch(seed=1, epoch=epoch)
        ledger.begin(state, step)
        kept_exchanged = sum(  # received at the exchange and not moved on by the resize
            int(torch.isin(shard, got).sum())
            for shard, got in zip(state.shards, state.exchanged_in, strict=True)
        )
        while not state.epoch_done:
            if epoch == 0 and state.step == 7:
                state.set_shares([6, 1, 1])
            state.advance()
            step += 1
            if state.step == 10 and epoch == 1:
                ledger.close(state, epoch=epoch, step=step)
                sent_records += ledger.drain(160)["records"]
                saved, saved_step = state.state_dict(), step
            if state.step == 15 and epoch == 1:
                break  # the attempt fails; steps 10..15 are lost with it
        if epoch == 0:
            ledger.close(state, epoch=epoch, step=step)
            state.exchange(0.25, seed=1, epoch=epoch)
            sent_records += ledger.drain(160)["records"]
    state, step = SplitState.from_state_dict(saved), saved_step  # the next attempt resumes
    ledger = ShardLedger(spec)
    ledger.begin(state, step)
    while not state.epoch_done:
        state.advance()
        step += 1
    ledger.close(state, epoch=1, step=step)
    sent_records += ledger.drain(160)["records"]

    by_epoch = defaultdict(list)
    for record in sent_records:
        by_epoch[record["epoch"]].append(record)
    assert sorted(by_epoch) == [0, 1]
    for records in by_epoch.values():
        assert covers_once(records, 160)
    first = by_epoch[0]
    assert first[0]["rebalanced"] > 0 and first[0]["group"] == "a" and first[0]["rank"] == 1
    assert first[2]["group_index"] == 1 and first[2]["rank"] == 3
    assert 0 < sum(r["exchanged"] for r in by_epoch[1]) == kept_exchanged
    assert [(r["step_from"], r["step_to"]) for r in by_epoch[1]][::3] == [(20, 30), (30, 40)]


# Every rank waits in loss_fn once the checkpoint named by HOLD_AFTER exists, until it is
# killed (tests/worker/engine/test_resume.py); rank 2 slows down after profiling when SLOW,
# so the controller moves samples away from it mid-run.
HOLDS = f"""
import os, time
from pathlib import Path
from examples.tiny_regression import build_datasets, build_model, build_optimizer, loss_fn as mse

SLOW = {{slow}}
calls = 0

def loss_fn(output, target):
    global calls
    calls += 1
    hold = os.environ.get("{HOLD_AFTER}")
    while hold and Path(hold).exists():
        time.sleep(0.05)
    if SLOW and os.environ.get("RANK") == "2" and calls > 16:
        time.sleep(0.004)
    return mse(output, target)
"""


def provenance_of(events: list[dict[str, Any]], until: str | None = None) -> list[dict[str, Any]]:
    """The provenance records of the checkpoints among ``events``; with ``until`` (a file
    name) only those of the checkpoints up to that one: what a run resumed from it continues.
    (An interrupted run may write one more before it is stopped, when its workers ran ahead
    of the parameter server's write on a loaded host.)"""
    checkpoints = [e for e in events if e["type"] == "checkpoint"]
    if until is not None:
        names = [Path(e["path"]).name for e in checkpoints]
        checkpoints = checkpoints[: names.index(until) + 1]
    found = [e["provenance"] for e in checkpoints if "provenance" in e]
    return [record for p in found for record in p["records"]]


def test_a_run_through_rebalance_exchange_and_restart_covers_each_epoch_once(
    make_spec: Callable[..., RunSpec], tmp_path: Path
) -> None:
    """Real ranks: the interrupted attempt's checkpoints and the resumed attempt's together
    name every training sample exactly once per epoch."""
    module = tmp_path / "slows_down.py"
    module.write_text(HOLDS.format(slow=True))
    stop_at = "step-30.pt"  # 23 steps an epoch (160 items, B 7): mid epoch 1
    spec = make_spec(
        code=str(module),
        split_policy="weighted",
        rebalance_every=2,
        exchange_fraction=0.25,
        checkpoint_every=10,
        epochs=3,
    )
    hold = {HOLD_AFTER: str(Path(spec.checkpoint_dir) / stop_at)}
    interrupted = launch_local(
        spec,
        timeout_s=TIMEOUT_S,
        env_extra=hold,
        stop_when=lambda e: e["type"] == "checkpoint" and Path(e["path"]).name == stop_at,
    )
    assert interrupted.stopped
    resumed = spec.model_copy(update={"resume_from": str(Path(spec.checkpoint_dir) / stop_at)})
    run, _ = run_with_dump(resumed, tmp_path / "params")
    first, second = provenance_of(interrupted.events, stop_at), provenance_of(run.events)
    n_items = next(e for e in run.events if "provenance" in e)["provenance"]["n_items"]
    assert n_items == 160
    records = first + second
    for epoch in range(3):
        assert covers_once([r for r in records if r["epoch"] == epoch], n_items), epoch
    assert {r["epoch"] for r in first} == {0, 1} and {r["epoch"] for r in second} == {1, 2}
    assert any(r["rebalanced"] for r in records), "a rebalance moved samples"
    assert any(r["exchanged"] for r in records if r["epoch"] > 0), "the exchange moved samples"
    assert {(r["rank"], r["group"]) for r in records} == {(1, "a"), (2, "a"), (3, "b")}


def test_a_restart_on_fewer_workers_continues_the_epoch_where_it_stopped(
    make_spec: Callable[..., RunSpec], tmp_path: Path
) -> None:
    """Three workers (groups a: 2, b: 1) checkpoint mid-epoch and stop; the task resumes on
    group a alone. The epoch goes on from its recorded position instead of being redone:
    the samples not yet taken are split over the two workers, every sample is used once
    per epoch across the two runs, and the final parameters are those of one process
    trained on the global batches both runs took (1e-5)."""
    stop_at = "step-30.pt"  # 23 steps an epoch (160 items, B 7): mid epoch 1
    first = make_spec(epochs=3, checkpoint_every=10)
    hold = {HOLD_AFTER: str(Path(first.checkpoint_dir) / stop_at)}
    module = tmp_path / "holds.py"
    module.write_text(HOLDS.format(slow=False))
    first = first.model_copy(update={"code": str(module)})
    interrupted = launch_local(
        first,
        timeout_s=TIMEOUT_S,
        env_extra=hold,
        stop_when=lambda e: e["type"] == "checkpoint" and Path(e["path"]).name == stop_at,
    )
    assert interrupted.stopped
    shrunk = first.model_copy(
        update={
            "groups": [first.groups[0]],
            "checkpoint_dir": str(tmp_path / "shrunk"),
            "resume_from": str(Path(first.checkpoint_dir) / stop_at),
        }
    )
    run, finals = run_with_dump(shrunk, tmp_path / "params")
    assert any("continues epoch 1 at step 7 of 23 on 2 workers" in line for line in run.output[0])
    records = provenance_of(interrupted.events, stop_at) + provenance_of(run.events)
    for epoch in (0, 1, 2):  # epoch 2: the next epoch starts from every sample again
        assert covers_once([r for r in records if r["epoch"] == epoch], 160), epoch
    assert {r["rank"] for r in provenance_of(run.events)} == {1, 2}

    taken = seeded_batches(first, 160)[:30] + dumped_batches(tmp_path / "params")
    assert len(taken) == 69 and all(len(b) == 7 for i, b in enumerate(taken) if i % 23 != 22)
    expected, _ = reference_run(first, taken)
    torch.testing.assert_close(finals[0], expected, atol=1e-5, rtol=0)
