"""The split state: shards sized by shares, every sample once per epoch, exchange, rebalance."""

from __future__ import annotations

import pytest
import torch

from worker.engine.split import SplitState


def run_epoch(state: SplitState, change_at: int | None = None, new: list[int] | None = None):
    """Take every step of the epoch; returns the per-step global batches."""
    batches = []
    while not state.epoch_done:
        if state.step == change_at and new is not None:
            state.set_shares(new)
        batches.append(state.global_batch())
        state.advance()
    return batches


def assert_each_sample_once(batches: list[torch.Tensor], n: int) -> None:
    assert torch.equal(torch.cat(batches).sort().values, torch.arange(n))


@pytest.mark.parametrize("n,shares", [(160, [3, 2, 2]), (100, [24, 8]), (10, [3, 1]), (5, [4, 4])])
def test_every_sample_once_per_epoch_with_constant_global_batch(n: int, shares: list[int]) -> None:
    state = SplitState.initial(n, shares, seed=3)
    for epoch in range(3):
        state.begin_epoch(seed=3, epoch=epoch)
        batches = run_epoch(state)
        assert len(batches) == state.steps_per_epoch
        assert all(len(b) == sum(shares) for b in batches[:-1])
        assert_each_sample_once(batches, n)


def test_worker_takes_its_share_from_its_own_shard() -> None:
    state = SplitState.initial(100, [24, 8], seed=0)
    state.begin_epoch(seed=0, epoch=0)
    assert [len(s) for s in state.shards] == [75, 25]
    first, second = state.take(0), state.take(1)
    assert len(first) == 24 and len(second) == 8
    assert set(first.tolist()) <= set(state.shards[0].tolist())


def test_mid_epoch_rebalance_keeps_samples_and_batch_size() -> None:
    state = SplitState.initial(160, [4, 2, 2], seed=1)
    state.begin_epoch(seed=1, epoch=0)
    batches = run_epoch(state, change_at=5, new=[6, 1, 1])
    assert state.shares == [6, 1, 1]
    assert all(len(b) == 8 for b in batches)
    assert_each_sample_once(batches, 160)
    assert state.used == [5 * 4 + 15 * 6, 5 * 2 + 15, 5 * 2 + 15]


def test_set_shares_rejects_a_different_global_batch() -> None:
    state = SplitState.initial(20, [2, 2], seed=0)
    with pytest.raises(ValueError):
        state.set_shares([3, 2])


def test_exchange_passes_a_fraction_to_the_ring_neighbour() -> None:
    state = SplitState.initial(120, [2, 1, 1], seed=2)
    state.begin_epoch(seed=2, epoch=0)
    run_epoch(state)
    before = [set(s.tolist()) for s in state.shards]
    sent = state.exchange(0.25, seed=2, epoch=0)
    assert sent == [15, 8, 8]
    after = [set(s.tolist()) for s in state.shards]
    for i in range(3):
        received = after[i] - before[i]
        assert len(received) == sent[i - 1] and received <= before[i - 1]
        assert len(before[i] - after[i]) == sent[i]
    state.begin_epoch(seed=2, epoch=1)
    assert_each_sample_once(run_epoch(state), 120)


def test_no_exchange_without_fraction_or_neighbour() -> None:
    state = SplitState.initial(10, [2], seed=0)
    assert state.exchange(0.5, seed=0, epoch=0) == [0]
    state = SplitState.initial(10, [1, 1], seed=0)
    assert state.exchange(0.0, seed=0, epoch=0) == [0, 0]


def test_state_round_trips_mid_epoch() -> None:
    state = SplitState.initial(50, [3, 2], seed=4)
    state.begin_epoch(seed=4, epoch=0)
    for _ in range(4):
        state.advance()
    copy = SplitState.from_state_dict(state.state_dict())
    assert copy.step == 4 and copy.used == state.used and copy.shares == state.shares
    assert torch.equal(copy.global_batch(), state.global_batch())


def test_upcoming_batches_are_the_steps_a_worker_will_take_until_shares_change() -> None:
    state = SplitState.initial(50, [4, 3], seed=1)
    state.begin_epoch(seed=1, epoch=0)
    planned = state.upcoming(1)
    assert len(planned) == state.steps_per_epoch == 8  # the last step splits 50 - 7 * 7 = 1
    taken = []
    while state.step < 4:
        taken.append(state.take(1))
        state.advance()
    assert all(torch.equal(p, t) for p, t in zip(planned, taken, strict=False))
    state.set_shares([2, 5])
    replanned = state.upcoming(1)
    assert [len(b) for b in replanned] == [5, 5, 5, 1]  # the last sample: the larger share
    while not state.epoch_done:
        assert torch.equal(replanned[state.step - 4], state.take(1))
        state.advance()
    assert torch.equal(replanned.shifted(100)[0], replanned[0] + 100)
