"""The sync strategies behind one interface: the registry matches the names the API and the
engine accept, and every strategy implements both roles' epochs."""

from __future__ import annotations

import inspect
from types import SimpleNamespace
from typing import Any, get_args

import pytest

from backend.tasks.schemas import TaskCreate
from contracts.plan import ROUND_STRATEGIES, SyncStrategy
from worker.engine.session import registered, strategy_for
from worker.engine.spec import RunSpec
from worker.engine.strategy import Strategy

NAMES = set(get_args(SyncStrategy))


def test_the_registry_holds_exactly_the_names_the_api_and_the_engine_accept() -> None:
    api = set(get_args(TaskCreate.model_fields["sync_strategy"].annotation))
    engine = set(get_args(RunSpec.model_fields["sync_strategy"].annotation))
    assert set(registered()) == NAMES == api == engine == {"sync", "periodic", "quorum", "diloco"}


@pytest.mark.parametrize("name", sorted(NAMES))
def test_every_strategy_overrides_both_epochs(name: str) -> None:
    cls = registered()[name]
    assert issubclass(cls, Strategy) and not inspect.isabstract(cls) and cls.name == name
    for method in ("worker_epoch", "server_epoch"):
        own = cls.__dict__.get(method)
        assert own is not None and getattr(own, "__override__", False), (name, method)


def test_an_unknown_name_is_refused_naming_the_known_ones() -> None:
    with pytest.raises(KeyError, match="gossip.*periodic"):
        strategy_for("gossip")


def test_a_name_is_taken_once() -> None:
    with pytest.raises(TypeError, match="'sync' defined twice"):
        type("AnotherSync", (Strategy,), {"name": "sync"})
    assert registered()["sync"].__name__ == "Synchronous"


def test_what_each_strategy_decides_outside_its_epochs() -> None:
    ps: Any = SimpleNamespace(is_ps=True, am_i_leader=False, rank=0)
    first: Any = SimpleNamespace(is_ps=False, am_i_leader=True, rank=1)
    leader: Any = SimpleNamespace(is_ps=False, am_i_leader=True, rank=3)
    member: Any = SimpleNamespace(is_ps=False, am_i_leader=False, rank=2)
    counters = {
        name: [strategy_for(name).counts_skips(t) for t in (ps, first, leader, member)]
        for name in NAMES
    }
    assert counters == {
        "sync": [False, True, False, False],  # every worker sees the one global sum
        "periodic": [False, True, True, False],
        "quorum": [False, True, True, False],
        "diloco": [False, True, True, False],
    }
    groups_own = {name for name in NAMES if strategy_for(name).group_optimizers}
    assert groups_own == {"periodic", "diloco"} == set(ROUND_STRATEGIES)
    assert {name for name in NAMES if strategy_for(name).replicated} == {"sync"}
