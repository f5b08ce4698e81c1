"""The cross-group sync strategy: one interface, one module per strategy.

A strategy decides how the groups' work reaches the global model inside an
epoch: what a compute rank does for the epoch's remaining steps
(:meth:`Strategy.worker_epoch`) and what the parameter server does meanwhile
(:meth:`Strategy.server_epoch`). The session (:mod:`worker.engine.session`)
runs the epochs around them: it starts each epoch, then calls the method of
the rank's role, then ends the epoch with the same collectives on every rank.
Both methods must therefore leave the epoch done (``run.split.epoch_done``)
and pass the same control points (:func:`worker.engine.run.control_point`)
on every rank, in the same order.

The strategies are ``sync`` (:mod:`worker.engine.strategy_sync`),
``periodic`` (:mod:`worker.engine.strategy_periodic`) and ``quorum``
(:mod:`worker.engine.strategy_quorum`); docs/heterogeneity.md compares them.

A new strategy is one module ``worker/engine/strategy_<name>.py`` holding one
subclass of :class:`Strategy` that sets ``name``: defining the subclass
registers it, and :func:`strategy_for` imports every ``strategy_*`` module of
this package before it looks a name up. The names a task may ask for are
``contracts.plan.SyncStrategy``, which the API (``TaskCreate``) and the
engine's ``RunSpec`` both validate against; a new strategy adds its name
there (docs/architecture.md, "Training engine"; a test checks the two agree).
"""

from __future__ import annotations

import importlib
import pkgutil
from abc import ABC, abstractmethod
from functools import cache
from pathlib import Path
from typing import TYPE_CHECKING, ClassVar

from typing_extensions import override

if TYPE_CHECKING:
    from worker.engine.distributed import Topology
    from worker.engine.run import Run

_REGISTRY: dict[str, type[Strategy]] = {}


class Strategy(ABC):
    """How the groups sync with the parameter server during an epoch (stateless).

    ``name`` is the ``sync_strategy`` value that selects the subclass.
    ``group_optimizers``: each group steps its own copy of the user's
    optimizer, so compute workers build one and checkpoints keep every
    group's optimizer state instead of the parameter server's.
    ``replicated``: every compute worker steps an identical replica of the
    user's optimizer on the same global sum, so the parameter server is off the
    step path; its model and optimizer are brought up to date from the first
    worker (:func:`worker.engine.run.pull_replica`) at every checkpoint and
    epoch end, and a checkpoint keeps that one optimizer state.
    """

    name: ClassVar[str]
    group_optimizers: ClassVar[bool] = False
    replicated: ClassVar[bool] = False

    @override
    def __init_subclass__(cls, **kwargs: object) -> None:
        super().__init_subclass__(**kwargs)
        name = cls.__dict__.get("name")
        if name is None:
            return
        if name in _REGISTRY:
            raise TypeError(f"sync strategy {name!r} defined twice: {_REGISTRY[name]} and {cls}")
        _REGISTRY[name] = cls

    @abstractmethod
    def worker_epoch(self, run: Run) -> None:
        """Compute rank: the remaining steps of the epoch ``run.epoch``."""

    @abstractmethod
    def server_epoch(self, run: Run) -> None:
        """Parameter server: its part of the remaining steps of the epoch ``run.epoch``."""

    def reports_progress(self, topo: Topology) -> bool:
        """True on the one rank that reports the task's progress (so the agents never send
        two ranks' differing views of it): by default the parameter server, which drives
        the steps."""
        return topo.is_ps

    def counts_skips(self, topo: Topology) -> bool:
        """True on the rank that counts skipped optimizer steps (``on_nonfinite:
        skip_step``): by default every group leader, as each group checks its own sum."""
        return topo.am_i_leader


@cache
def _import_strategy_modules() -> None:
    """Import every ``strategy_*`` module of this package, once (defining registers)."""
    for module in pkgutil.iter_modules([str(Path(__file__).parent)]):
        if module.name.startswith("strategy_"):
            importlib.import_module(f"{__package__}.{module.name}")


def registered() -> dict[str, type[Strategy]]:
    """Every strategy by name."""
    _import_strategy_modules()
    return dict(_REGISTRY)


def strategy_for(name: str) -> Strategy:
    """The strategy ``name`` selects; raises KeyError naming the known ones if none does."""
    strategies = registered()
    if name not in strategies:
        raise KeyError(f"unknown sync strategy {name!r}; known: {sorted(strategies)}")
    return strategies[name]()
