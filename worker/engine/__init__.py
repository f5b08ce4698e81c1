"""polytrain training engine: the processes of one distributed task.

One task runs ``1 + sum(workers)`` processes. Rank 0 is the parameter server
(global model and optimizer); ranks 1.. are compute workers, each resource
group on a contiguous block of ranks. Gradients are summed by allreduce inside
each group, then reduced by the group leaders to the parameter server, which
steps the optimizer and broadcasts parameters back the same way: a
hierarchical allreduce (intra-group ring, inter-group parameter server after
Li et al., "Scaling Distributed Machine Learning with the Parameter Server",
OSDI 2014).

Heterogeneous groups (docs/heterogeneity.md): the parameter server
preprocesses the data once and sends it to every worker (:mod:`data`,
:mod:`preprocess`); workers profile their throughput and the parameter server
splits data and batch evenly or by speed, re-balancing online
(:mod:`split`, :mod:`balance`); groups sync every step, every H steps or by
quorum, one :class:`strategy.Strategy` each (:mod:`strategy_sync`,
:mod:`strategy_periodic`, :mod:`strategy_quorum`); checkpoints resume exactly (:mod:`checkpoint`);
``speed_factor`` emulates slower groups on one host (:mod:`emulation`).

Entry points: ``python -m worker.engine.launch --spec spec.json`` for one rank,
:func:`worker.engine.local.launch_local` for a whole world on one host, and
:func:`worker.engine.report.parse_event` to read the event lines a rank prints.
"""

from contracts.plan import GroupPlan
from worker.engine.spec import RunSpec

__all__ = ["GroupPlan", "RunSpec"]
