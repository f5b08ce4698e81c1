"""Per-worker batch shares from measured throughput, and the online controller that keeps them.

A worker's step time is roughly ``b_i / r_i`` (its batch share over its
throughput in samples/s), and a synchronous step lasts as long as the slowest
worker. Shares proportional to throughput, ``b_i = B r_i / sum(r)``, make all
workers finish together; the step then takes ``B / sum(r)``, the ideal.

The controller re-estimates ``r_i`` from real step times over a window and
moves shares towards that target when the predicted step time exceeds the ideal
by more than ``tolerance``. It moves only ``damping`` of the way, in whole
samples, and never changes B, so noise inside the dead band causes no change
and a real drift is followed in a few damped moves without oscillating. A
predicted excess of ``jump`` or more (a device whose speed changed, not the
noise of a few per cent) is followed the whole way at once: a damped controller
would take three or four checks to close it, and every step meanwhile waits for
the overloaded worker. Once it has started to move it goes on (hysteresis)
until the predicted excess is within ``settle`` or whole samples allow no
closer split, rather than stopping just inside the dead band: otherwise a split
would stay up to ``tolerance`` slower than the ideal for good. The rates are an
exponentially weighted average over windows (weight ``smoothing`` on the newest), so
the noise of short windows moves the shares less; a window in which some worker's rate
differs from the average by ``jump`` or more (its speed changed) restarts the average
from that window, so a change is still followed at the first check. This is
semi-dynamic load balancing from measured step times
(Chen et al., "Semi-Dynamic Load Balancing: Efficient Distributed Learning in
Non-Dedicated Environments", SoCC 2020; per-node batch sizes from measured
speed as in the heterogeneous-computing patent family and HetPipe, Park et
al., USENIX ATC 2020).

A worker may have a cap, the most samples it takes in a step (its group's
``max_local_batch``, a memory limit). Every share the balancer makes stays within it
(:func:`worker.engine.sharding.capped_shares`), and the ideal it measures against is the
capped one (water-filling, :func:`ideal_shares`): a worker held at its cap takes less than
its speed would give it, and the others finish together without it, so a split that is as
close to that as whole samples allow is not imbalanced and the controller rests there.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from contracts.plan import SplitPolicy
from worker.engine.sharding import capped_shares, even_shares


def rates_of(compute_s: list[float], samples: list[float]) -> list[float]:
    """Samples/s per worker; a worker with no measured time gets the mean of the others (or 1)."""
    pairs = zip(samples, compute_s, strict=True)
    rates = [n / t if t > 0 and n > 0 else math.nan for n, t in pairs]
    known = [r for r in rates if not math.isnan(r)]
    fallback = sum(known) / len(known) if known else 1.0
    return [fallback if math.isnan(r) else r for r in rates]


def by_group(rates: list[float], groups: list[tuple[str, int]]) -> str:
    """Per-worker ``rates`` (samples/s) summed by group, for a log line: ``cpu-a 1624.8
    [812.4, 812.4], cpu-b 501.2`` (a group of several workers lists theirs in brackets).
    ``groups``: each group's name and number of workers, in worker order."""
    shown, first = [], 0
    for name, workers in groups:
        own = rates[first : first + workers]
        first += workers
        text = f"{name} {sum(own):.1f}"
        if len(own) > 1:
            text += f" [{', '.join(f'{r:.1f}' for r in own)}]"
        shown.append(text)
    return ", ".join(shown)


def ideal_shares(
    batch: int, rates: list[float], caps: list[int | None] | None = None
) -> tuple[list[float], float]:
    """The shares (real numbers) that make every worker finish together within its cap, and
    the step time they take: ``b_i = min(c_i, r_i T)`` summing to ``batch`` (water-filling:
    a worker whose share ``r_i T`` would exceed its cap ``c_i`` is held at it and the rest is
    shared by the others in proportion to their rates, until none exceeds). Without a cap
    that binds: ``batch r_i / sum(r)`` and ``T = batch / sum(r)``. When every worker is held
    (the caps sum to ``batch``), ``T`` is the slowest held worker's ``c_i / r_i``."""
    caps = caps if caps is not None else [None] * len(rates)
    held: set[int] = set()
    while True:
        rest = batch - sum(c for i, c in enumerate(caps) if i in held and c is not None)
        free_rate = sum(r for i, r in enumerate(rates) if i not in held)
        if free_rate <= 0:
            shares = [float(c) if i in held and c is not None else 0.0 for i, c in enumerate(caps)]
            step = max((b / r for b, r in zip(shares, rates, strict=True) if r > 0), default=0.0)
            return shares, step
        shares = [
            float(c) if i in held and c is not None else rest * r / free_rate
            for i, (r, c) in enumerate(zip(rates, caps, strict=True))
        ]
        over = {
            i
            for i, (b, c) in enumerate(zip(shares, caps, strict=True))
            if i not in held and c is not None and b > c
        }
        if not over:
            return shares, rest / free_rate
        held |= over


def imbalance(shares: list[int], rates: list[float], caps: list[int | None] | None = None) -> float:
    """Predicted step time ``max_i b_i / r_i`` over the ideal, minus 1 (>= 0): the ideal is
    ``B / sum(r)``, or with ``caps`` (per worker, None: none) the capped one of
    :func:`ideal_shares`, so a worker held at its cap is no imbalance."""
    if caps is None or all(c is None for c in caps):
        ideal = sum(shares) / sum(rates)
    else:
        ideal = ideal_shares(sum(shares), rates, caps)[1]
    slowest = max(b / r for b, r in zip(shares, rates, strict=True))
    return max(0.0, slowest / ideal - 1.0)


@dataclass
class Balancer:
    """Chooses per-worker batch shares (samples per step) that sum to ``batch``.

    ``policy`` ``even`` keeps equal shares forever; ``weighted`` starts from the
    profiled throughputs and follows measured step times. ``tolerance`` is the
    dead band (fraction of the ideal step time), ``damping`` in (0, 1] the
    fraction of the way moved per decision (the whole way from a predicted excess of
    ``jump``); once moving, the controller goes on until the predicted excess is at
    most ``settle``. ``smoothing`` in (0, 1] is the newest window's weight in the rate
    estimate (1: each window alone). Every rank holds its own Balancer and feeds it the
    same windows, so all hold the same estimate and take the same decisions. Workers in
    ``excluded`` (:meth:`exclude`) keep a share of 0 and are left out of every decision;
    so are the workers of groups the guard parked (``parked``, :meth:`park`), until it
    takes them back. ``caps`` (one per worker, None: no cap; all None by default): the most
    samples a worker takes in a step (its group's ``max_local_batch``); every share made here
    stays within it, and a move that would leave workers unable to hold the batch within
    their caps raises ValueError and changes nothing.
    """

    policy: SplitPolicy
    batch: int
    tolerance: float = 0.02
    damping: float = 0.5
    settle: float = 0.01
    jump: float = 0.15
    smoothing: float = 0.5
    moving: bool = False
    estimate: list[float] | None = field(default=None, repr=False)
    excluded: frozenset[int] = frozenset()
    parked: frozenset[int] = frozenset()
    caps: list[int | None] | None = None

    @property
    def left_out(self) -> frozenset[int]:
        """The workers that take no share: excluded or parked."""
        return self.excluded | self.parked

    def exclude(self, workers: set[int], shares: list[int]) -> list[int]:
        """Shares without ``workers`` from now on (e.g. a group whose numerics disagree,
        :mod:`worker.engine.agreement`): the other workers share the global batch, evenly
        under ``even``, else in proportion to their rate estimates (their current shares
        before the first estimate), within their caps. Raises ValueError, excluding no one,
        when no worker would be left or the others' caps cannot hold the batch."""
        before = self.excluded
        self.excluded = self.excluded | frozenset(workers)
        try:
            return self._reshare(shares)
        except ValueError:
            self.excluded = before
            raise

    def park(self, workers: set[int], shares: list[int]) -> list[int]:
        """Shares with exactly ``workers`` parked (:mod:`worker.engine.guard`): a parked
        worker takes none, the others share the batch as :meth:`exclude` does. Raises
        ValueError, changing nothing, when no worker would be left or the others' caps
        cannot hold the batch (:meth:`holds`)."""
        before = self.parked, self.moving
        self.parked = frozenset(workers)
        self.moving = False
        try:
            return self._reshare(shares)
        except ValueError:
            self.parked, self.moving = before
            raise

    def _caps_of(self, keep: list[int]) -> list[int | None]:
        """The caps of the workers ``keep`` (None: no cap)."""
        return [None] * len(keep) if self.caps is None else [self.caps[i] for i in keep]

    def holds(self, keep: list[int]) -> bool:
        """True when the workers ``keep`` can take the whole batch within their caps."""
        caps = self._caps_of(keep)
        if any(c is None for c in caps):
            return True
        return sum(c for c in caps if c is not None) >= self.batch

    def _even(self, keep: list[int]) -> list[int]:
        """Even shares of the batch over ``keep``; ValueError when one exceeds its cap."""
        kept = even_shares(self.batch, len(keep))
        for i, share, cap in zip(keep, kept, self._caps_of(keep), strict=True):
            if cap is not None and share > cap:
                raise ValueError(
                    f"the even split gives worker {i} {share} samples a step, above its "
                    f"max_local_batch {cap} ({len(keep)} workers share {self.batch})"
                )
        return kept

    def _capped(self, keep: list[int], weights: list[float]) -> list[int]:
        """Shares of the batch over ``keep`` in proportion to ``weights``, within the caps."""
        if not self.holds(keep):
            room = sum(c for c in self._caps_of(keep) if c is not None)
            raise ValueError(
                f"workers {keep} take at most {room} samples a step (their max_local_batch), "
                f"fewer than the global batch {self.batch}"
            )
        return capped_shares(self.batch, weights, self._caps_of(keep))

    def _reshare(self, shares: list[int]) -> list[int]:
        keep = [i for i in range(len(shares)) if i not in self.left_out]
        if not keep:
            raise ValueError("every worker is excluded: none is left to train")
        if self.policy == "even":
            kept = self._even(keep)
        else:
            weights = self.estimate if self.estimate is not None else shares
            kept = self._capped(keep, [float(weights[i]) for i in keep])
        return self._expand(kept, keep, len(shares))

    @staticmethod
    def _expand(kept: list[int], keep: list[int], n: int) -> list[int]:
        out = [0] * n
        for i, share in zip(keep, kept, strict=True):
            out[i] = share
        return out

    def initial(self, rates: list[float]) -> list[int]:
        """Shares before the first step from profiled ``rates`` (samples/s per worker),
        within the caps. Raises ValueError when the caps cannot hold the batch, or the even
        split gives a worker more than its cap."""
        every = list(range(len(rates)))
        if self.policy == "even":
            return self._even(every)
        return self._capped(every, rates)

    def profiling(self, n_workers: int) -> list[int]:
        """The shares the workers first profile at: even without caps; with them, as even as
        they allow (:func:`capped_shares` of equal weights). Raises ValueError as
        :meth:`initial`."""
        if self.caps is None or all(c is None for c in self.caps):
            return even_shares(self.batch, n_workers)
        return self._capped(list(range(n_workers)), [1.0] * n_workers)

    def fit(self, shares: list[int]) -> list[int]:
        """``shares`` (e.g. a checkpoint's) when every one is within its cap; else shares in
        proportion to them within the caps, the left-out workers at 0. Raises ValueError as
        :meth:`initial`."""
        caps = self.caps or [None] * len(shares)
        if all(c is None or b <= c for b, c in zip(shares, caps, strict=True)):
            return shares
        keep = [i for i in range(len(shares)) if i not in self.left_out]
        if self.policy == "even":
            return self._expand(self._even(keep), keep, len(shares))
        return self._expand(self._capped(keep, [float(shares[i]) for i in keep]), keep, len(shares))

    def propose(
        self,
        shares: list[int],
        compute_s: list[float],
        samples: list[float],
        *,
        update: bool = True,
    ) -> list[int] | None:
        """New shares from a window of measured work, or None to keep ``shares``.

        ``compute_s[i]`` is worker i's busy seconds in the window (compute sections and
        its own work between them, :meth:`worker.engine.run.Run.compute`) and
        ``samples[i]`` the samples it processed then. ``update`` False decides on the
        current estimate where there is one, without blending the window in (a window
        whose steps were already counted, e.g. the whole epoch).
        """
        if self.policy == "even" or len(shares) < 2:
            return None
        measured = [t > 0 and n > 0 for t, n in zip(compute_s, samples, strict=True)]
        window = rates_of(compute_s, samples)
        if update or self.estimate is None or len(self.estimate) != len(window):
            rates = self.update_estimate(window, measured)
        else:
            rates = self.estimate
        if self.left_out:
            keep = [i for i in range(len(shares)) if i not in self.left_out]
            kept = self._decide(
                [shares[i] for i in keep], [rates[i] for i in keep], self._caps_of(keep)
            )
            return None if kept is None else self._expand(kept, keep, len(shares))
        return self._decide(shares, rates, self._caps_of(list(range(len(shares)))))

    def _decide(
        self, shares: list[int], rates: list[float], caps: list[int | None]
    ) -> list[int] | None:
        """The controller's move from ``shares`` towards shares proportional to ``rates``
        within ``caps`` (:func:`ideal_shares`)."""
        uncapped = all(c is None for c in caps)
        excess = imbalance(shares, rates, None if uncapped else caps)
        self.moving = excess > (self.settle if self.moving else self.tolerance)
        if not self.moving:
            return None
        damping = 1.0 if excess >= self.jump else self.damping
        if uncapped:
            total = sum(rates)
            ideal = [self.batch * r / total for r in rates]
        else:
            ideal = ideal_shares(self.batch, rates, caps)[0]
        target = [b + damping * (i - b) for b, i in zip(shares, ideal, strict=True)]
        # Each target lies between a share and its ideal, both within the cap, so no share
        # is cut here: the caps only hold the rounding.
        proposed = capped_shares(self.batch, target, caps)
        if proposed == shares:
            self.moving = False  # whole samples allow no closer split
            return None
        return proposed

    def update_estimate(
        self, window: list[float], measured: list[bool] | None = None
    ) -> list[float]:
        """The rate estimate (samples/s per worker) after one more window's ``window`` rates,
        worker by worker: ``smoothing * window + (1 - smoothing) * estimate``; the window's
        rate itself on the first window (or a changed number of workers) and for a worker
        whose window rate is ``jump`` or more away from its estimate (relative: its speed
        changed); the estimate kept for a worker ``measured`` marks as not measured in the
        window (its window rate is a stand-in, :func:`rates_of`)."""
        old = self.estimate
        if old is None or len(old) != len(window):
            self.estimate = list(window)
            return self.estimate
        measured = measured or [True] * len(window)
        a, new = self.smoothing, []
        for w, e, seen in zip(window, old, measured, strict=True):
            if not seen:
                new.append(e)
            elif not (e > 0 and math.isfinite(e)) or abs(w / e - 1.0) >= self.jump:
                new.append(w)
            else:
                new.append(a * w + (1 - a) * e)
        self.estimate = new
        return self.estimate
