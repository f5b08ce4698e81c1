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
registers it (:func:`defined`), and :func:`worker.engine.session.strategy_for`
imports every ``strategy_*`` module of this package before it looks a name up.
This module is the bottom of the strategies: it imports none of them and not
the run they act on (:class:`worker.engine.run.Run`, which holds a strategy),
so a strategy class names its run's type as its parameter
(``Strategy[Run]``). The names a task may ask for are
``contracts.plan.SyncStrategy``, which the API (``TaskCreate``) and the
engine's ``RunSpec`` both validate against; a new strategy adds its name
there (docs/architecture.md, "Training engine"; a test checks the two agree).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Any, ClassVar, Generic, TypeVar

from typing_extensions import override

if TYPE_CHECKING:
    from worker.engine.distributed import Topology

RunT = TypeVar("RunT")
"""The rank's training state a strategy acts on (:class:`worker.engine.run.Run`)."""

_REGISTRY: dict[str, type[Strategy[Any]]] = {}


class Strategy(ABC, Generic[RunT]):
    """How the groups sync with the parameter server during an epoch (stateless).

    ``RunT`` is the run the epochs take: a strategy module subclasses ``Strategy[Run]``.
    ``name`` is the ``sync_strategy`` value that selects the subclass.
    ``group_optimizers``: each group steps its own copy of the user's
    optimizer, so compute workers build one and checkpoints keep every
    group's optimizer state instead of the parameter server's.
    ``replicated``: every compute worker steps an identical replica of the
    user's optimizer on the same global sum, so the parameter server is off the
    step path; its model and optimizer are brought up to date from the first
    worker (:func:`worker.engine.run.pull_replica`) at every checkpoint and
    epoch end, and a checkpoint keeps that one optimizer state.
    ``steps_at_share``: every worker's step is its share of the global batch, so the
    ``weighted`` split profiles once more at the share the first profile gave it; False
    where every group takes its samples in steps of the global batch (``diloco``), whose
    rate the first profile, at the even share, measures closer.
    ``guarded``: every step waits for every group, so the guard may park a group that
    lengthens the step (:mod:`worker.engine.guard`; the strategy steps only the groups
    :func:`worker.engine.run.stepping` leaves in).
    """

    name: ClassVar[str]
    group_optimizers: ClassVar[bool] = False
    replicated: ClassVar[bool] = False
    steps_at_share: ClassVar[bool] = True
    guarded: ClassVar[bool] = False

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
    def worker_epoch(self, run: RunT) -> None:
        """Compute rank: the remaining steps of the epoch ``run.epoch``."""

    @abstractmethod
    def server_epoch(self, run: RunT) -> None:
        """Parameter server: its part of the remaining steps of the epoch ``run.epoch``."""

    def guards(self, spec: Any) -> bool:
        """True when the guard may park a group of a task with ``spec`` (a RunSpec) under this
        strategy: ``guarded`` unless a strategy narrows it."""
        return self.guarded

    def reports_progress(self, topo: Topology) -> bool:
        """True on the one rank that reports the task's progress (so the agents never send
        two ranks' differing views of it): by default the parameter server, which drives
        the steps."""
        return topo.is_ps

    def counts_skips(self, topo: Topology) -> bool:
        """True on the rank that counts skipped optimizer steps (``on_nonfinite:
        skip_step``): by default every group leader, as each group checks its own sum."""
        return topo.am_i_leader


def defined() -> dict[str, type[Strategy[Any]]]:
    """Every strategy whose module has been imported so far, by name (defining registers;
    :func:`worker.engine.session.registered` imports them all first)."""
    return dict(_REGISTRY)
